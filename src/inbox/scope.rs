//! The scope of deduplication, a consumer_type: what a claim is keyed on beside the message id.

use std::sync::Arc;

use uuid::Uuid;

/// The longest consumer_type the seed schema stores (`VARCHAR(500)`).
pub const MAX_CONSUMER_TYPE_CHARS: usize = 500;

/// The scope of deduplication: one per consumer. Explicit and stable (see `docs/architecture.md`, the fragile scope), at most 500 characters.
/// Shared, not copied: every message's context holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerType(Arc<str>);

impl ConsumerType {
    pub fn new(name: impl Into<String>) -> Result<Self, String> {
        let name = name.into();
        let chars = name.chars().count();
        if chars == 0 {
            return Err("consumer_type must not be empty".to_owned());
        }
        if chars > MAX_CONSUMER_TYPE_CHARS {
            return Err(format!(
                "consumer_type is {chars} characters long; inbox_messages.consumer_type holds at most {MAX_CONSUMER_TYPE_CHARS}"
            ));
        }
        if name.chars().any(char::is_control) {
            return Err("consumer_type must not contain control characters".to_owned());
        }
        // A scope that looks like another is another: `carrier` and `carrier` with a zero-width space, a direction
        // mark or a space at its end would each process the same message once, and nobody reading them would see two.
        if name.chars().any(crate::sanitize::is_unsafe) {
            return Err(
                "consumer_type must not contain invisible or direction-changing characters (zero-width spaces, \
                 bidi marks, soft hyphens): a scope that looks like another would process the same messages again"
                    .to_owned(),
            );
        }
        if name.trim() != name {
            return Err(
                "consumer_type must not begin or end with spaces: a scope that looks like another would process the \
                 same messages again"
                    .to_owned(),
            );
        }
        Ok(Self(name.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The idempotency key a call to the outside world made for `message_id` carries: the same on every delivery of
    /// the message to this consumer, different for another consumer of the same message.
    pub fn idempotency_key(&self, message_id: Uuid) -> Uuid {
        const NAMESPACE: Uuid = Uuid::from_u128(0x6a1d_5f0e_2b7c_4c1a_9a55_1b0c_2d3e_4f50);
        let mut name = Vec::with_capacity(self.0.len() + 17);
        name.extend_from_slice(self.0.as_bytes());
        name.push(0);
        name.extend_from_slice(message_id.as_bytes());
        Uuid::new_v5(&NAMESPACE, &name)
    }
}

impl std::fmt::Display for ConsumerType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_type_limits() {
        assert!(ConsumerType::new("parcel-created-carrier").is_ok());
        assert!(
            ConsumerType::new("é".repeat(500)).is_ok(),
            "500 characters, not bytes"
        );
        let err = ConsumerType::new("x".repeat(501)).expect_err("too long");
        assert!(err.contains("501 characters"), "{err}");
        assert!(ConsumerType::new("").is_err());
        assert!(ConsumerType::new("a\u{1b}[2Jb").is_err());
        for look_alike in [
            "carrier\u{200b}",
            "car\u{202e}rier",
            "carrier ",
            " carrier",
            "carr\u{00ad}ier",
        ] {
            let err = ConsumerType::new(look_alike).expect_err(look_alike);
            assert!(err.contains("looks like another"), "{err}");
        }
        assert!(ConsumerType::new("Parcel Created: carrier (v2)").is_ok());
    }

    #[test]
    fn idempotency_keys_are_stable_per_message_and_consumer() {
        let carrier = ConsumerType::new("parcel-created-carrier").expect("valid");
        let notification = ConsumerType::new("parcel-created-notification").expect("valid");
        let id = Uuid::from_u128(42);
        assert_eq!(carrier.idempotency_key(id), carrier.idempotency_key(id));
        assert_ne!(
            carrier.idempotency_key(id),
            notification.idempotency_key(id)
        );
        assert_ne!(
            carrier.idempotency_key(id),
            carrier.idempotency_key(Uuid::from_u128(43))
        );
    }
}
