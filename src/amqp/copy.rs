//! The copy `replay` republishes of a dead-lettered message: the body and properties untouched, the failure headers
//! dropped, inboxctl's replay count raised and the run's tag added, the per-message TTL left out unless asked for.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::dead_letter::{self, ORIGINAL_EXPIRATION_HEADER};
use super::failure::x_death;
use super::limits;

/// The header in which inboxctl counts how often a message was replayed. Not an `x-` header: RabbitMQ 4 reserves
/// those for itself.
pub const REPLAY_COUNT_HEADER: &str = "inboxctl-replay-count";

/// The header that tags each copy with the replay run that sent it, so that the run knows its own copies when they
/// fail again and come back.
pub const REPLAY_RUN_HEADER: &str = "inboxctl-replay-run";

/// The per-message TTL a message had before it was dead-lettered: its `expiration` property (a MassTransit copy may
/// keep it), else inboxctl's header, else what RabbitMQ's dead-lettering kept in `x-death` (newest death first).
/// Only a value RabbitMQ accepts (milliseconds, digits only, at most 2^32 - 1: a larger one closes the channel of
/// the copy that carries it).
pub fn original_expiration(properties: &BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref();
    let in_death = || {
        x_death(headers).iter().find_map(|death| {
            let value = death.as_field_table()?.inner().get("original-expiration")?;
            match value {
                AMQPValue::LongString(s) => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
                _ => None,
            }
        })
    };
    properties
        .expiration()
        .as_ref()
        .map(|e| e.as_str().to_owned())
        .or_else(|| dead_letter::header_text(headers, ORIGINAL_EXPIRATION_HEADER))
        .or_else(in_death)
        .filter(|e| {
            e.len() <= 10 && e.bytes().all(|b| b.is_ascii_digit()) && e.parse::<u32>().is_ok()
        })
}

/// RabbitMQ's sender-selected distribution headers: their values are routing keys added to the publish's own (and
/// `CC` stays on the message delivered). A replayed copy goes through the default exchange, where each is a queue
/// name: carried over, the copy would also land in any queue so named, and be confirmed through it when its origin
/// is gone.
pub fn is_routing_header(key: &str) -> bool {
    key == "CC" || key == "BCC"
}

/// MassTransit's count of a message's delayed redeliveries (`UseDelayedRedelivery`, `context.Redeliver`). Its
/// redelivery filter starts the policy that many intervals in: kept on a replayed copy, a MassTransit consumer whose
/// redeliveries were used up before the failure would move the replay straight back to `_error` after its immediate
/// retries, the delayed ones it was replayed for never tried. (The error copy itself keeps it, as MassTransit's does:
/// it tells how the message came to fail.)
pub const REDELIVERY_COUNT_HEADER: &str = "MT-Redelivery-Count";

/// The headers a replayed copy carries: the original's without the failure headers, MassTransit's redelivery count and
/// the routing headers, with the replay count raised and the run's tag; and the original per-message TTL in
/// [`ORIGINAL_EXPIRATION_HEADER`] when the copy does not carry it as its `expiration`, so that a later replay can still
/// give it back.
pub fn replay_headers(
    original: Option<&FieldTable>,
    replays: u32,
    run: &str,
    kept_expiration: Option<&str>,
) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(original) = original {
        for (key, value) in original.inner() {
            let k = key.as_str();
            let failure = dead_letter::is_failure_header(k)
                || dead_letter::is_death_header(k)
                || k == REPLAY_COUNT_HEADER
                || k == REPLAY_RUN_HEADER
                || k == ORIGINAL_EXPIRATION_HEADER
                || k.eq_ignore_ascii_case(REDELIVERY_COUNT_HEADER)
                || is_routing_header(k);
            if !failure {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers.insert(
        REPLAY_COUNT_HEADER.into(),
        AMQPValue::LongInt(i32::try_from(replays.saturating_add(1)).unwrap_or(i32::MAX)),
    );
    headers.insert(REPLAY_RUN_HEADER.into(), limits::long_string(run));
    if let Some(expiration) = kept_expiration {
        headers.insert(
            ORIGINAL_EXPIRATION_HEADER.into(),
            limits::long_string(expiration),
        );
    }
    headers
}

/// The properties of a replayed copy: the original's, untouched, but for the headers, the per-message TTL, which is
/// left out unless `restore_expiration` (then the original one is given back, wherever it was kept), and the delivery
/// mode, always persistent (2): the dead-letter copy is acknowledged once the replayed one is confirmed, and a
/// transient copy in a durable queue would be lost at the broker's next restart, with no copy left anywhere.
pub fn replay_properties(
    original: &BasicProperties,
    replays: u32,
    run: &str,
    restore_expiration: bool,
) -> BasicProperties {
    let expiration = original_expiration(original);
    let kept = (!restore_expiration)
        .then_some(expiration.as_deref())
        .flatten();
    let headers = replay_headers(original.headers().as_ref(), replays, run, kept);
    // AMQP properties are all optional and lapin has no way to unset one: the copy is built field by field.
    let mut copy = BasicProperties::default().with_headers(headers);
    let text = |v: &Option<ShortString>| v.clone();
    if let Some(v) = text(original.content_type()) {
        copy = copy.with_content_type(v);
    }
    if let Some(v) = text(original.content_encoding()) {
        copy = copy.with_content_encoding(v);
    }
    copy = copy.with_delivery_mode(2);
    if let Some(v) = *original.priority() {
        copy = copy.with_priority(v);
    }
    if let Some(v) = text(original.correlation_id()) {
        copy = copy.with_correlation_id(v);
    }
    if let Some(v) = text(original.reply_to()) {
        copy = copy.with_reply_to(v);
    }
    if let Some(v) = expiration.filter(|_| restore_expiration) {
        copy = copy.with_expiration(v.into());
    }
    if let Some(v) = text(original.message_id()) {
        copy = copy.with_message_id(v);
    }
    if let Some(v) = *original.timestamp() {
        copy = copy.with_timestamp(v);
    }
    if let Some(v) = text(original.kind()) {
        copy = copy.with_type(v);
    }
    if let Some(v) = text(original.user_id()) {
        copy = copy.with_user_id(v);
    }
    if let Some(v) = text(original.app_id()) {
        copy = copy.with_app_id(v);
    }
    if let Some(v) = text(original.cluster_id()) {
        copy = copy.with_cluster_id(v);
    }
    copy
}

/// Why a dead-lettered message cannot be republished as it is, if it cannot: a copy would not be the message.
pub fn uncopyable(properties: &BasicProperties, user: &str) -> Option<String> {
    let depth = properties
        .headers()
        .as_ref()
        .map_or(0, limits::header_depth);
    if depth > limits::MAX_HEADER_DEPTH {
        return Some(format!(
            "its headers nest {depth} levels deep; inboxctl reads at most {}",
            limits::MAX_HEADER_DEPTH
        ));
    }
    // A copy a consumer made of such a message says so (`ALTERED_HEADER`): what it carries is all there is of it
    // now, and refused, it would stay in its dead-letter queue for good.
    let marked =
        dead_letter::header_text(properties.headers().as_ref(), dead_letter::ALTERED_HEADER)
            .is_some();
    if !marked && text_replaced(properties) {
        return Some(
            "a property or a header name of it is not UTF-8 (read with U+FFFD in its place): a copy would not carry \
             the same bytes"
                .to_owned(),
        );
    }
    match properties.user_id() {
        Some(other) if other.as_str() != user => Some(format!(
            "its user_id {:?} is not the user the replay publishes as, and the broker would refuse it",
            limits::truncate(other.as_str(), 64)
        )),
        _ => None,
    }
}

/// Whether a short string of `properties` — a property, or a header's name or short-string value within
/// [`limits::MAX_HEADER_DEPTH`] — was not UTF-8 on the wire (read with U+FFFD in its place, see `vendor/README.md`).
pub fn text_replaced(properties: &BasicProperties) -> bool {
    let replaced = |s: &Option<ShortString>| {
        s.as_ref()
            .is_some_and(|s| s.as_str().contains(char::REPLACEMENT_CHARACTER))
    };
    [
        properties.content_type(),
        properties.content_encoding(),
        properties.correlation_id(),
        properties.reply_to(),
        properties.expiration(),
        properties.message_id(),
        properties.kind(),
        properties.user_id(),
        properties.app_id(),
        properties.cluster_id(),
    ]
    .into_iter()
    .any(replaced)
        || properties
            .headers()
            .as_ref()
            .is_some_and(limits::header_text_replaced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
    }

    #[test]
    fn a_replayed_copy_is_persistent_whatever_the_original_was() {
        for mode in [None, Some(1), Some(2)] {
            let mut original = BasicProperties::default().with_message_id("m".into());
            if let Some(mode) = mode {
                original = original.with_delivery_mode(mode);
            }
            let copy = replay_properties(&original, 1, "run", false);
            assert_eq!(*copy.delivery_mode(), Some(2), "{mode:?}");
            assert_eq!(copy.message_id(), original.message_id());
        }
    }

    #[test]
    fn replay_headers_drop_failures_and_count() {
        let mut h = FieldTable::default();
        h.insert("MT-Fault-Message".into(), long("x"));
        h.insert("MT-Host-MachineName".into(), long("vm"));
        h.insert("MT-Reason".into(), long("fault"));
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::default()),
        );
        h.insert("x-first-death-queue".into(), long("orders"));
        h.insert("tenant".into(), long("acme"));
        h.insert(REPLAY_COUNT_HEADER.into(), AMQPValue::LongInt(1));
        h.insert(REPLAY_RUN_HEADER.into(), long("an earlier run"));
        h.insert("x-delivery-count".into(), AMQPValue::LongInt(3));
        h.insert("x-acquired-count".into(), AMQPValue::LongLongInt(4));
        h.insert("MT-Redelivery-Count".into(), AMQPValue::LongInt(3));
        h.insert("mt-redelivery-count".into(), AMQPValue::LongInt(3));
        let out = replay_headers(Some(&h), 1, "this run", None);
        let keys: Vec<&str> = out.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, [REPLAY_COUNT_HEADER, REPLAY_RUN_HEADER, "tenant"]);
        assert_eq!(out.inner().get(REPLAY_RUN_HEADER), Some(&long("this run")));
        assert_eq!(
            out.inner().get(REPLAY_COUNT_HEADER),
            Some(&AMQPValue::LongInt(2))
        );
    }

    #[test]
    fn a_copy_carries_no_ttl_unless_asked_and_keeps_the_original_in_a_header() {
        let mut death = FieldTable::default();
        death.insert("original-expiration".into(), long("8000"));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        let from_death = BasicProperties::default()
            .with_message_id("m".into())
            .with_headers(h);
        let mut h = FieldTable::default();
        h.insert(ORIGINAL_EXPIRATION_HEADER.into(), long("7000"));
        let from_header = BasicProperties::default().with_headers(h);
        let from_property = BasicProperties::default()
            .with_expiration("6000".into())
            .with_priority(3);
        for (original, ttl) in [
            (&from_death, "8000"),
            (&from_header, "7000"),
            (&from_property, "6000"),
        ] {
            let copy = replay_properties(original, 0, "run", false);
            assert_eq!(copy.expiration(), &None, "{original:?}");
            assert_eq!(
                dead_letter::header_text(copy.headers().as_ref(), ORIGINAL_EXPIRATION_HEADER)
                    .as_deref(),
                Some(ttl)
            );
            let restored = replay_properties(original, 0, "run", true);
            assert_eq!(
                restored.expiration().as_ref().map(ShortString::as_str),
                Some(ttl)
            );
            assert!(
                !restored
                    .headers()
                    .as_ref()
                    .is_some_and(|h| h.contains_key(ORIGINAL_EXPIRATION_HEADER))
            );
        }
        assert_eq!(
            replay_properties(&from_death, 0, "run", false).message_id(),
            from_death.message_id()
        );
        assert_eq!(
            replay_properties(&from_property, 0, "run", true).priority(),
            &Some(3)
        );
        // A value RabbitMQ would refuse (and close the channel for) is not given back.
        let odd = BasicProperties::default().with_expiration("soon".into());
        assert_eq!(replay_properties(&odd, 0, "run", true).expiration(), &None);
    }
}
