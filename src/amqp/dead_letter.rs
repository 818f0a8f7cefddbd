//! The headers of a message moved to `<queue>_error` or `<queue>_skipped`, written the way MassTransit writes them
//! (see `tests/fixtures/interop/messages/error`), so that tools built for MassTransit's error queues read ours too.
//!
//! The body and every property are kept as they were; only the headers change. (lapin writes a header table in key
//! order, not in MassTransit's order; AMQP gives the order no meaning.)

use chrono::Utc;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::envelope::{HostInfo, format_time};

/// The header a dead-letter copy keeps a message's per-message TTL (the `expiration` property) in, since the copy must not expire.
pub const ORIGINAL_EXPIRATION_HEADER: &str = "inboxctl-original-expiration";

/// Headers of a previous failure, replaced rather than kept when a message fails again; and the publisher's sequence
/// number, which means nothing on a copy another process publishes.
fn is_failure_header(key: &str) -> bool {
    key.starts_with("MT-Fault-")
        || key.starts_with("MT-Host-")
        || key == "MT-Reason"
        || key == "x-dotnet-pub-seq-no"
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
    put(&mut headers, "MT-Fault-Message", &fault.message);
    put(&mut headers, "MT-Fault-Timestamp", &format_time(Utc::now()));
    put(&mut headers, "MT-Fault-StackTrace", &fault.stack_trace);
    put(&mut headers, "MT-Fault-ConsumerType", &fault.consumer_type);
    if let Some(message_type) = &fault.message_type {
        put(&mut headers, "MT-Fault-MessageType", message_type);
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

fn carried_over(original: Option<&FieldTable>) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(original) = original {
        for (key, value) in original.inner() {
            if !is_failure_header(key.as_str()) {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers
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

fn put(headers: &mut FieldTable, key: &str, value: &str) {
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
