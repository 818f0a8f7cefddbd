//! A message put again at the tail of its own queue by the consumer that could not settle it (its dead-letter copy
//! refused, its handling panicked): the mark it carries, by which it is a redelivery when it comes round, and the
//! properties it is published with.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::dead_letter::{self, ORIGINAL_EXPIRATION_HEADER};

/// The header a message carries when a consumer gave it back to the tail of its own queue, because it could not be
/// settled then (its dead-letter copy refused, say): how many times so far. A message that carries it is handled as a
/// redelivery. Not copied to a dead-letter queue, nor kept by a replay.
pub const GIVEN_BACK_HEADER: &str = "inboxctl-given-back";

/// Whether a message was given back to its queue's tail ([`GIVEN_BACK_HEADER`]), and so is a redelivery.
pub fn given_back(properties: &BasicProperties) -> bool {
    properties
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key(GIVEN_BACK_HEADER))
}

/// `headers` with [`GIVEN_BACK_HEADER`] counted once more, without the broker's per-delivery headers (a quorum
/// queue's delivery count), which would read stale on the message published again, and without `CC` and `BCC`,
/// which through the default exchange would name other queues to copy it into.
pub fn given_back_once_more(headers: Option<&FieldTable>) -> FieldTable {
    let mut headers = headers.cloned().unwrap_or_default();
    dead_letter::drop_keys(&mut headers, |k| {
        super::topology::is_per_delivery_header(k) || super::copy::is_routing_header(k)
    });
    let times = match headers.inner().get(GIVEN_BACK_HEADER) {
        Some(AMQPValue::LongLongInt(n)) => n.saturating_add(1).max(1),
        _ => 1,
    };
    headers.insert(GIVEN_BACK_HEADER.into(), AMQPValue::LongLongInt(times));
    headers
}

/// The properties of a message put again at its queue's tail (`headers`: its own, with the given-back mark): the
/// original's, but for a per-message TTL, which goes to [`ORIGINAL_EXPIRATION_HEADER`] as it does on a dead-letter
/// copy. Republished, the TTL would start again, and behind a backlog the copy could expire at the tail, unseen, its
/// original acknowledged. The message was the consumer's when it was delivered (RabbitMQ expires no message a
/// consumer holds), and it comes round to be settled: at the tail it no longer expires. The caller has refused a
/// `user_id` not the publisher's ([`super::copy::uncopyable`]): it is kept as it is.
pub fn properties(original: &BasicProperties, mut headers: FieldTable) -> BasicProperties {
    let Some(expiration) = original.expiration() else {
        return original.clone().with_headers(headers);
    };
    dead_letter::put(
        &mut headers,
        ORIGINAL_EXPIRATION_HEADER,
        expiration.as_str(),
    );
    // Its delivery mode as it was: a dead-letter copy is made persistent, and this one is the message again.
    dead_letter::properties_of(
        original,
        original.user_id().clone(),
        *original.delivery_mode(),
    )
    .with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::dead_letter::{Fault, error_headers, header_text};

    /// Put at the tail, a message is itself again, but for its TTL, kept in a header (republished, it would start
    /// again); without one, its properties are as they were.
    #[test]
    fn a_tail_copy_is_the_message_with_its_ttl_in_a_header() {
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/vnd.masstransit+json".into())
            .with_delivery_mode(1)
            .with_priority(7)
            .with_timestamp(1_700_000_000)
            .with_user_id("guest".into())
            .with_correlation_id("c-1".into())
            .with_expiration("60000".into());
        let mut headers = FieldTable::default();
        headers.insert(GIVEN_BACK_HEADER.into(), AMQPValue::LongLongInt(1));
        let copy = properties(&original, headers.clone());
        assert_eq!(*copy.expiration(), None);
        assert_eq!(
            header_text(copy.headers().as_ref(), ORIGINAL_EXPIRATION_HEADER).as_deref(),
            Some("60000")
        );
        assert!(
            copy.headers()
                .as_ref()
                .is_some_and(|h| h.inner().contains_key(GIVEN_BACK_HEADER))
        );
        let expected = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/vnd.masstransit+json".into())
            .with_delivery_mode(1)
            .with_priority(7)
            .with_timestamp(1_700_000_000)
            .with_correlation_id("c-1".into())
            .with_user_id("guest".into())
            .with_headers(copy.headers().clone().unwrap());
        assert_eq!(copy, expected, "as it was, but for the TTL");
        let plain = BasicProperties::default()
            .with_message_id("m-2".into())
            .with_delivery_mode(2);
        assert_eq!(
            properties(&plain, headers.clone()),
            plain.clone().with_headers(headers)
        );
    }

    #[test]
    fn the_given_back_mark_is_counted_and_not_copied_to_the_error_queue() {
        let once = given_back_once_more(None);
        assert_eq!(
            once.inner().get(GIVEN_BACK_HEADER),
            Some(&AMQPValue::LongLongInt(1))
        );
        let mut twice = given_back_once_more(Some(&once));
        assert_eq!(
            twice.inner().get(GIVEN_BACK_HEADER),
            Some(&AMQPValue::LongLongInt(2))
        );
        assert!(given_back(
            &BasicProperties::default().with_headers(twice.clone())
        ));
        assert!(!given_back(&BasicProperties::default()));
        // What would route it elsewhere through the default exchange, or read stale, is left out.
        let mut routed = FieldTable::default();
        routed.insert("CC".into(), AMQPValue::LongString("billing".into()));
        routed.insert("BCC".into(), AMQPValue::LongString("audit".into()));
        routed.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        routed.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let back = given_back_once_more(Some(&routed));
        for gone in ["CC", "BCC", "x-delivery-count"] {
            assert!(!back.inner().contains_key(gone), "{gone}");
        }
        assert!(back.inner().contains_key("tenant"));
        twice.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let fault = Fault {
            exception_type: "inboxctl::ConsumerFailed".into(),
            message: "carrier API returned 503".into(),
            stack_trace: String::new(),
            input_address: "rabbitmq://127.0.0.1/parcel-created-carrier".into(),
            consumer_type: "parcel-created-carrier".into(),
            message_type: None,
            retry_count: 0,
        };
        let copy = error_headers(Some(&twice), &fault);
        assert!(!copy.inner().contains_key(GIVEN_BACK_HEADER));
        assert!(copy.inner().contains_key("tenant"));
    }
}
