//! The headers of a message moved to `<queue>_error` or `<queue>_skipped`, written the way MassTransit writes them
//! (see `tests/fixtures/interop/messages/error`), so that tools built for MassTransit's error queues read ours too.
//!
//! The body and every property are kept as they were; only the headers change. (lapin writes a header table in key
//! order, not in MassTransit's order; AMQP gives the order no meaning.)

use chrono::Utc;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::envelope::{HostInfo, format_time};
use super::limits::{self, MAX_HEADER_TEXT, MAX_STACK_TRACE};

/// The header a dead-letter copy, or a copy put at its queue's tail, keeps a message's per-message TTL (the
/// `expiration` property) in, since the copy must not expire.
pub const ORIGINAL_EXPIRATION_HEADER: &str = "inboxctl-original-expiration";

/// The header a dead-letter copy keeps a message's `user_id` property in when it names another user than the one
/// inboxctl publishes as: RabbitMQ refuses a `user_id` that is not the publisher's own.
pub const ORIGINAL_USER_ID_HEADER: &str = "inboxctl-original-user-id";

/// The header a dead-letter copy carries when the message's properties or header names held bytes that were not
/// UTF-8: read with U+FFFD in their place (lapin reads text only), the copy carries the replaced text, not the bytes
/// the producer sent — and two header names that differed only there are one. Said on the copy rather than the
/// message held for ever: the original bytes are gone once read. A replay moves such a copy back as it is.
pub const ALTERED_HEADER: &str = "inboxctl-altered";

/// MassTransit's headers of a failure (`MT-Fault-*`, `MT-Host-*`, `MT-Reason`), replaced rather than kept when a
/// message fails again; the publisher's sequence number, which means nothing on a copy another process publishes;
/// and inboxctl's mark of a message given back to its queue's tail ([`super::tail::GIVEN_BACK_HEADER`]).
pub fn is_failure_header(key: &str) -> bool {
    key.starts_with("MT-Fault-")
        || key.starts_with("MT-Host-")
        || key == "MT-Reason"
        || key == "x-dotnet-pub-seq-no"
        || key == super::tail::GIVEN_BACK_HEADER
}

/// RabbitMQ's headers of a dead-lettering (`x-death`, `x-first-death-*`, `x-last-death-*`) and of a quorum queue's
/// delivery counts: the broker's record of where a message failed, not part of the message.
pub fn is_death_header(key: &str) -> bool {
    key == "x-death"
        || key.starts_with("x-first-death-")
        || key.starts_with("x-last-death-")
        || super::topology::is_per_delivery_header(key)
}

/// Why a message failed, for `MT-Fault-*`.
#[derive(Debug, Clone)]
pub struct Fault {
    /// `MT-Fault-ExceptionType`: what kind of failure (e.g. `inboxctl::UnreadableMessage`).
    pub exception_type: String,
    /// `MT-Fault-Message`: the reason, one line.
    pub message: String,
    /// `MT-Fault-StackTrace`: the error and its causes, one per line.
    pub stack_trace: String,
    /// `MT-Fault-InputAddress`: the queue the message was read from, as MassTransit writes it.
    pub input_address: String,
    /// `MT-Fault-ConsumerType`: the consumer_type that failed it.
    pub consumer_type: String,
    /// `MT-Fault-MessageType`: the .NET name of the message type, when it could be read.
    pub message_type: Option<String>,
    /// `MT-Fault-RetryCount`: attempts after the first.
    pub retry_count: i32,
}

/// Headers for the `<queue>_error` copy: the original's headers without earlier failure headers, then the host, then
/// `MT-Reason: fault` and the `MT-Fault-*` headers (`MT-Fault-RetryCount` as an int32, the others as long strings).
pub fn error_headers(original: Option<&FieldTable>, fault: &Fault) -> FieldTable {
    let mut headers = carried_over(original);
    host_headers(&mut headers);
    put(&mut headers, "MT-Reason", "fault");
    put(
        &mut headers,
        "MT-Fault-ExceptionType",
        &fault.exception_type,
    );
    put(&mut headers, "MT-Fault-InputAddress", &fault.input_address);
    put(
        &mut headers,
        "MT-Fault-Message",
        &limits::truncate(&fault.message, MAX_HEADER_TEXT),
    );
    put(&mut headers, "MT-Fault-Timestamp", &format_time(Utc::now()));
    put(
        &mut headers,
        "MT-Fault-StackTrace",
        &limits::truncate(&fault.stack_trace, MAX_STACK_TRACE),
    );
    put(
        &mut headers,
        "MT-Fault-ConsumerType",
        &limits::truncate(&fault.consumer_type, MAX_HEADER_TEXT),
    );
    if let Some(message_type) = &fault.message_type {
        put(
            &mut headers,
            "MT-Fault-MessageType",
            &limits::truncate(message_type, MAX_HEADER_TEXT),
        );
    }
    headers.insert(
        "MT-Fault-RetryCount".into(),
        AMQPValue::LongInt(fault.retry_count),
    );
    headers
}

/// Headers for the `<queue>_skipped` copy: the original's, the host, and `MT-Reason: dead-letter` (what MassTransit
/// writes for a message no consumer of the endpoint handles).
pub fn skipped_headers(original: Option<&FieldTable>) -> FieldTable {
    let mut headers = carried_over(original);
    host_headers(&mut headers);
    put(&mut headers, "MT-Reason", "dead-letter");
    headers
}

/// The original's headers a copy keeps: all but earlier failure headers, with values nested too deep to copy
/// replaced by a note.
fn carried_over(original: Option<&FieldTable>) -> FieldTable {
    let mut headers = original.map(limits::shallow_headers).unwrap_or_default();
    drop_keys(&mut headers, is_failure_header);
    headers
}

/// Why a dead-letter copy of a message cannot be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "its dead-letter copy needs a {needed}-byte header frame, more than the connection's {frame_max}-byte frames \
     allow even without inboxctl's own failure details: its own headers are too large to copy"
)]
pub struct CopyTooLarge {
    pub needed: usize,
    pub frame_max: usize,
}

/// The properties of a dead-letter copy of a message whose properties are `original`, with `headers`, as `publisher`
/// (the user inboxctl connects as) may publish them and a frame of `frame_max` bytes can carry them:
/// - no `expiration`: a copy in a dead-letter queue must not expire (the original value is kept in
///   [`ORIGINAL_EXPIRATION_HEADER`], as RabbitMQ's own dead-lettering keeps it in `x-death`);
/// - a `user_id` that is not `publisher`'s is moved to [`ORIGINAL_USER_ID_HEADER`], since RabbitMQ refuses it;
/// - if the header frame would be larger than `frame_max`, inboxctl's own details go first (the stack trace, then
///   the host, then most of the failure message, then the message type and the consumer_type, up to 2 KB each);
///   if the original's own headers are still too large, no copy.
///
/// - the copy is persistent (delivery mode 2) whatever the original was: it waits in its queue for days;
///
/// Everything else (body, content type, message id, …) is kept as it was.
pub fn copy_properties(
    original: &BasicProperties,
    mut headers: FieldTable,
    publisher: &str,
    frame_max: usize,
) -> Result<BasicProperties, CopyTooLarge> {
    if let Some(expiration) = original.expiration() {
        put(
            &mut headers,
            ORIGINAL_EXPIRATION_HEADER,
            expiration.as_str(),
        );
    }
    if super::copy::text_replaced(original) {
        put(
            &mut headers,
            ALTERED_HEADER,
            "a property or a header name of the message was not UTF-8: this copy carries it with U+FFFD in place \
             of those bytes",
        );
    }
    let user_id = original
        .user_id()
        .as_ref()
        .filter(|user| user.as_str() == publisher);
    if let Some(other) = original
        .user_id()
        .as_ref()
        .filter(|u| u.as_str() != publisher)
    {
        put(&mut headers, ORIGINAL_USER_ID_HEADER, other.as_str());
    }
    let base = rebuilt(original, user_id.cloned());
    let mut copy = base.clone().with_headers(headers.clone());
    let shrink: [&dyn Fn(&mut FieldTable); 4] = [
        &|h| drop_keys(h, |k| k == "MT-Fault-StackTrace"),
        &|h| drop_keys(h, |k| k.starts_with("MT-Host-")),
        &|h| {
            if let Some(message) = header_text(Some(h), "MT-Fault-Message") {
                put(h, "MT-Fault-Message", &limits::truncate(&message, 256));
            }
        },
        // Read from the message or the command line, not needed to replay it (the input address and the queue's
        // name tell where it goes back to): a copy without them beats a message held for good.
        &|h| {
            drop_keys(h, |k| {
                k == "MT-Fault-MessageType" || k == "MT-Fault-ConsumerType"
            })
        },
    ];
    for step in shrink {
        if limits::content_header_len(&copy) <= frame_max {
            return Ok(copy);
        }
        step(&mut headers);
        copy = base.clone().with_headers(headers.clone());
    }
    let needed = limits::content_header_len(&copy);
    if needed <= frame_max {
        Ok(copy)
    } else {
        Err(CopyTooLarge { needed, frame_max })
    }
}

/// The original's properties but for its headers and its per-message TTL, persistent; `user_id` in place of its own.
fn rebuilt(original: &BasicProperties, user_id: Option<ShortString>) -> BasicProperties {
    // Persistent whatever the original was: a copy waits in its queue for days, and a transient message in a classic
    // queue is gone at the broker's next restart.
    properties_of(original, user_id, Some(2))
}

/// The original's properties but for its headers, its per-message TTL and its delivery mode (`delivery_mode`), and
/// `user_id` in place of its own.
pub(super) fn properties_of(
    original: &BasicProperties,
    user_id: Option<ShortString>,
    delivery_mode: Option<u8>,
) -> BasicProperties {
    let mut p = BasicProperties::default();
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(mode) = delivery_mode {
        p = p.with_delivery_mode(mode);
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = user_id {
        p = p.with_user_id(v);
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

pub(super) fn drop_keys(headers: &mut FieldTable, drop: impl Fn(&str) -> bool) {
    let mut kept = FieldTable::default();
    for (key, value) in headers.inner() {
        if !drop(key.as_str()) {
            kept.insert(key.clone(), value.clone());
        }
    }
    *headers = kept;
}

fn host_headers(headers: &mut FieldTable) {
    let host = HostInfo::current();
    put(headers, "MT-Host-MachineName", &host.machine_name);
    put(headers, "MT-Host-ProcessName", &host.process_name);
    put(headers, "MT-Host-ProcessId", &host.process_id.to_string());
    put(headers, "MT-Host-Assembly", &host.assembly);
    put(headers, "MT-Host-AssemblyVersion", &host.assembly_version);
    put(headers, "MT-Host-FrameworkVersion", &host.framework_version);
    put(
        headers,
        "MT-Host-OperatingSystemVersion",
        &host.operating_system_version,
    );
}

pub(super) fn put(headers: &mut FieldTable, key: &str, value: &str) {
    headers.insert(
        key.into(),
        AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
    );
}

/// A header's value as text, if it is a string.
pub fn header_text(headers: Option<&FieldTable>, key: &str) -> Option<String> {
    match headers?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault() -> Fault {
        Fault {
            exception_type: "inboxctl::ConsumerFailed".into(),
            message: "carrier API returned 503".into(),
            stack_trace: "carrier API returned 503".into(),
            input_address: "rabbitmq://127.0.0.1/parcel-created-carrier".into(),
            consumer_type: "parcel-created-carrier".into(),
            message_type: Some("ParcelTracker.Domain.Events.ParcelCreatedEvent".into()),
            retry_count: 4,
        }
    }

    #[test]
    fn error_headers_have_masstransits_names_and_types() {
        let mut original = FieldTable::default();
        original.insert("x-dotnet-pub-seq-no".into(), AMQPValue::LongLongInt(3));
        original.insert(
            "MT-Fault-Message".into(),
            AMQPValue::LongString("old".into()),
        );
        original.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let headers = error_headers(Some(&original), &fault());
        let h = headers.inner();
        assert_eq!(
            header_text(Some(&headers), "MT-Reason").as_deref(),
            Some("fault")
        );
        assert_eq!(h.get("MT-Fault-RetryCount"), Some(&AMQPValue::LongInt(4)));
        assert_eq!(
            header_text(Some(&headers), "MT-Fault-Message").as_deref(),
            Some("carrier API returned 503")
        );
        assert_eq!(
            header_text(Some(&headers), "tenant").as_deref(),
            Some("acme")
        );
        assert!(!h.contains_key("x-dotnet-pub-seq-no"));
        for key in [
            "MT-Host-MachineName",
            "MT-Host-ProcessId",
            "MT-Fault-ExceptionType",
            "MT-Fault-InputAddress",
            "MT-Fault-Timestamp",
            "MT-Fault-StackTrace",
            "MT-Fault-ConsumerType",
            "MT-Fault-MessageType",
        ] {
            assert!(
                matches!(h.get(key), Some(AMQPValue::LongString(_))),
                "{key}"
            );
        }
    }

    /// Each header a copy of MassTransit's own carries (`tests/fixtures/interop`, captured from a MassTransit 8
    /// service: an error copy and a skipped one), name for name and AMQP type for type, with the timestamp written
    /// as theirs is; but the two inboxctl leaves out on purpose (`x-dotnet-pub-seq-no`, a publisher's sequence
    /// number; `MT-Host-MassTransitVersion`). A header renamed, left out, added or written as another type fails here.
    #[test]
    fn the_headers_of_a_copy_are_masstransits_name_for_name_and_type_for_type() {
        let kind = |v: &AMQPValue| match v {
            AMQPValue::LongString(_) => "S (longstr)",
            AMQPValue::LongInt(_) => "I (int32)",
            AMQPValue::LongLongInt(_) => "l (int64)",
            other => panic!("{other:?}"),
        };
        let fixtures = [
            (
                include_str!("../../tests/fixtures/interop/messages/error/error-01.json"),
                error_headers(None, &fault()),
            ),
            (
                include_str!("../../tests/fixtures/interop/messages/skipped/skipped-01.json"),
                skipped_headers(None),
            ),
        ];
        for (fixture, ours) in fixtures {
            let fixture: serde_json::Value = serde_json::from_str(fixture).unwrap();
            let theirs: std::collections::BTreeMap<String, String> = fixture["headers"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| {
                    !["x-dotnet-pub-seq-no", "MT-Host-MassTransitVersion"].contains(&k.as_str())
                })
                .map(|(k, v)| (k.clone(), v["amqp_type"].as_str().unwrap().to_owned()))
                .collect();
            let written: std::collections::BTreeMap<String, String> = ours
                .inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), kind(v).to_owned()))
                .collect();
            assert_eq!(written, theirs);
            if let Some(AMQPValue::LongString(at)) = fixture["headers"]
                .get("MT-Fault-Timestamp")
                .and(ours.inner().get("MT-Fault-Timestamp"))
            {
                let shape = |t: &str| {
                    t.chars()
                        .map(|c| if c.is_ascii_digit() { '9' } else { c })
                        .collect::<String>()
                };
                assert_eq!(
                    shape(&String::from_utf8_lossy(at.as_bytes())),
                    shape(
                        fixture["headers"]["MT-Fault-Timestamp"]["text"]
                            .as_str()
                            .unwrap()
                    )
                );
            }
        }
    }

    /// Whatever a failure quotes — a reason or an error chain that repeats a message's text, a message type read
    /// from the message — the copy carries a bounded amount of it, cut with a note, before any frame is considered.
    #[test]
    fn failure_texts_are_cut_to_their_bounds() {
        let long = "x".repeat(100_000);
        let fault = Fault {
            message: long.clone(),
            stack_trace: long.clone(),
            consumer_type: long.clone(),
            message_type: Some(long),
            ..fault()
        };
        let headers = error_headers(None, &fault);
        for (key, max) in [
            ("MT-Fault-Message", MAX_HEADER_TEXT),
            ("MT-Fault-StackTrace", MAX_STACK_TRACE),
            ("MT-Fault-ConsumerType", MAX_HEADER_TEXT),
            ("MT-Fault-MessageType", MAX_HEADER_TEXT),
        ] {
            let text = header_text(Some(&headers), key).expect(key);
            assert!(text.len() <= max, "{key}: {} bytes", text.len());
            assert!(
                text.ends_with("[cut by inboxctl: 100000 bytes in all]"),
                "{key}"
            );
        }
    }

    /// A message whose own headers leave room for the failure's essentials but not for a long message type and
    /// consumer_type (2 KB each): those go too, and the copy is made — it was refused as "its own headers are too
    /// large to copy", and the message held for good.
    #[test]
    fn a_long_message_type_and_consumer_type_go_before_the_copy_is_refused() {
        let mut own = FieldTable::default();
        own.insert(
            "tenant".into(),
            AMQPValue::LongString("t".repeat(100_000).into()),
        );
        // Persistent, as every copy is: the frame bound below is measured on the original.
        let original = BasicProperties::default()
            .with_message_id("m".into())
            .with_delivery_mode(2)
            .with_headers(own.clone());
        let fault = Fault {
            consumer_type: "c".repeat(5_000),
            message_type: Some("T".repeat(5_000)),
            ..fault()
        };
        let headers = error_headers(Some(&own), &fault);
        let mut essentials = headers.clone();
        drop_keys(&mut essentials, |k| {
            k == "MT-Fault-StackTrace"
                || k.starts_with("MT-Host-")
                || k == "MT-Fault-MessageType"
                || k == "MT-Fault-ConsumerType"
        });
        let frame_max = limits::content_header_len(&original.clone().with_headers(essentials));
        let copy = copy_properties(&original, headers, "guest", frame_max).expect("a copy");
        let kept = copy.headers().clone().unwrap_or_default();
        assert!(limits::content_header_len(&copy) <= frame_max);
        for key in [
            "MT-Reason",
            "MT-Fault-ExceptionType",
            "MT-Fault-InputAddress",
            "tenant",
        ] {
            assert!(kept.inner().contains_key(key), "{key}");
        }
        assert!(!kept.inner().contains_key("MT-Fault-MessageType"));
    }

    #[test]
    fn skipped_headers_say_dead_letter_and_carry_no_fault() {
        let headers = skipped_headers(None);
        assert_eq!(
            header_text(Some(&headers), "MT-Reason").as_deref(),
            Some("dead-letter")
        );
        assert!(
            !headers
                .inner()
                .keys()
                .any(|k| k.as_str().starts_with("MT-Fault-"))
        );
    }
}
