//! Reading a delivery (a MassTransit 8 envelope, or plain JSON) and writing MassTransit envelopes.
//!
//! What MassTransit writes (captured in `tests/fixtures/interop`): content type `application/vnd.masstransit+json`,
//! delivery mode 2, AMQP `message_id` equal to the envelope's `messageId`, and an indented camelCase JSON body whose
//! `message` is the event.

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use super::limits::{self, MAX_HEADER_DEPTH, MAX_LOGGED_TEXT};

mod envelope_in;
pub(crate) mod fields;
mod fingerprint;

use envelope_in::EnvelopeIn;
pub use envelope_in::MAX_MESSAGE_TYPES;
pub use fingerprint::fingerprint;

pub const MASSTRANSIT_CONTENT_TYPE: &str = "application/vnd.masstransit+json";

/// A delivery that could be read: its id, what type it says it is, and the event's JSON.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub message_id: Uuid,
    /// MassTransit message type URNs (`urn:message:Namespace:Type`); for plain JSON the AMQP `type` property, if set.
    pub message_types: Vec<String>,
    /// The event: the envelope's `message`, or the whole body of a plain JSON message.
    pub payload: Box<RawValue>,
    /// Whether the body was a MassTransit envelope.
    pub masstransit: bool,
    pub sent_time: Option<DateTime<Utc>>,
}

/// Why a delivery cannot be read. Such a message goes to the error queue at once: retrying cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error("the message body is empty")]
    EmptyBody,
    #[error("the message body is not JSON: {0}")]
    NotJson(String),
    #[error(
        "the message body starts with a UTF-8 byte order mark (EF BB BF), which JSON does not allow (MassTransit's \
         deserializer refuses it too): the producer should write UTF-8 without a BOM"
    )]
    ByteOrderMark,
    #[error(
        "the message's headers nest tables or arrays {0} levels deep; inboxctl reads at most {MAX_HEADER_DEPTH}"
    )]
    HeadersTooDeep(usize),
    #[error("the MassTransit envelope cannot be read: {0}")]
    BadEnvelope(String),
    #[error("the MassTransit envelope has no message")]
    NoMessage,
    #[error("the message has no message id (no messageId in an envelope, no message_id property)")]
    NoMessageId,
    #[error("the message id {0:?} is not a UUID")]
    BadMessageId(String),
    #[error(
        "the message id is the nil UUID 00000000-0000-0000-0000-000000000000 (an id never set, e.g. Guid.Empty): \
         every message carrying it would be taken for a copy of the first"
    )]
    NilMessageId,
}

/// Reads a delivery's id, type and event.
pub fn parse(properties: &BasicProperties, body: &[u8]) -> Result<Incoming, Unreadable> {
    if let Some(headers) = properties.headers() {
        let depth = limits::header_depth(headers);
        if depth > MAX_HEADER_DEPTH {
            return Err(Unreadable::HeadersTooDeep(depth));
        }
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(Unreadable::EmptyBody);
    }
    if body.starts_with(b"\xEF\xBB\xBF") {
        return Err(Unreadable::ByteOrderMark);
    }
    let property_id = properties.message_id().as_ref().map(|s| s.as_str());
    let declared_masstransit = properties
        .content_type()
        .as_ref()
        .is_some_and(|ct| ct.as_str().eq_ignore_ascii_case(MASSTRANSIT_CONTENT_TYPE));

    // One pass over the body when it is an envelope (what a MassTransit publisher sends); a body that is not one is
    // read again as plain JSON. UTF-8 first: the envelope's reader skips the fields it does not read unchecked.
    let not_json = || match serde_json::from_slice::<&RawValue>(body) {
        Err(e) => Unreadable::NotJson(e.to_string()),
        Ok(_) => Unreadable::NotJson("not UTF-8".to_owned()),
    };
    let text = std::str::from_utf8(body).map_err(|_| not_json())?;
    let envelope = match serde_json::from_str::<EnvelopeIn<'_>>(text) {
        Ok(envelope) => Some(envelope),
        Err(e) => {
            serde_json::from_str::<&RawValue>(text)
                .map_err(|e| Unreadable::NotJson(e.to_string()))?;
            if declared_masstransit {
                return Err(Unreadable::BadEnvelope(e.to_string()));
            }
            None
        }
    };
    // A body with messageType and message is an envelope even if a shovel or a plugin dropped its content type.
    let envelope = envelope
        .filter(|e| declared_masstransit || (e.message_type.is_some() && e.message.is_some()));

    match envelope {
        Some(envelope) => {
            let payload = envelope.message.ok_or(Unreadable::NoMessage)?.to_owned();
            let id = envelope
                .message_id
                .as_deref()
                .or(property_id)
                .ok_or(Unreadable::NoMessageId)?;
            Ok(Incoming {
                message_id: parse_id(id)?,
                message_types: envelope.message_type.map(|t| t.0).unwrap_or_default(),
                payload,
                masstransit: true,
                sent_time: envelope.sent_time.as_deref().and_then(parse_time),
            })
        }
        None => {
            let id = property_id.ok_or(Unreadable::NoMessageId)?;
            let raw: &RawValue =
                serde_json::from_str(text).map_err(|e| Unreadable::NotJson(e.to_string()))?;
            Ok(Incoming {
                message_id: parse_id(id)?,
                message_types: match properties.kind() {
                    Some(t) => vec![t.as_str().to_owned()],
                    None => raw_message_types(properties),
                },
                payload: raw.to_owned(),
                masstransit: false,
                sent_time: None,
            })
        }
    }
}

/// The types a plain JSON message declares in the header MassTransit's raw JSON serialiser writes them to,
/// `MT-MessageType` (URNs, `;` between them), its first [`MAX_MESSAGE_TYPES`] kept; none when it has no such header.
fn raw_message_types(properties: &BasicProperties) -> Vec<String> {
    super::dead_letter::header_text(properties.headers().as_ref(), "MT-MessageType")
        .map(|types| {
            types
                .split(';')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .take(MAX_MESSAGE_TYPES)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The id a consumer keys a dead-lettered message on, for the tools that name and choose such messages (`replay`,
/// `failures`), as `find` and the consumer read it: its envelope's where the body is one (a producer or a shovel may
/// leave the AMQP property unset, or set another), else the AMQP message id as given — one that is not a UUID
/// included, so that the message can still be named.
pub fn keyed_id(properties: &BasicProperties, body: &[u8]) -> Option<String> {
    match parse(properties, body) {
        Ok(incoming) => Some(incoming.message_id.to_string()),
        Err(_) => properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned()),
    }
}

fn parse_id(id: &str) -> Result<Uuid, Unreadable> {
    match Uuid::parse_str(id.trim()) {
        Ok(id) if id.is_nil() => Err(Unreadable::NilMessageId),
        Ok(id) => Ok(id),
        Err(_) => Err(Unreadable::BadMessageId(
            limits::truncate(id, MAX_LOGGED_TEXT).into_owned(),
        )),
    }
}

/// MassTransit writes `sentTime` in UTC with 0 to 7 fractional digits.
/// The value of the top-level field `name` of an event, as a publisher would write it into a routing key: a string's
/// text, a number's or a boolean's JSON; `None` when the event is not an object, lacks the field, or holds an
/// object, an array or null there.
/// The times a delivery carries besides its id, which a partitioned inbox may key it on: the envelope's `sentTime`
/// (as parsed, if it was) and the AMQP `timestamp`. One reading for the consumer's claim and the cleanup guard's look
/// at a dead-letter queue's head, so both key a message alike.
pub fn carried(
    sent_time: Option<DateTime<Utc>>,
    properties: &BasicProperties,
) -> crate::inbox::Carried {
    crate::inbox::Carried {
        sent_time,
        timestamp: properties
            .timestamp()
            .and_then(|t| DateTime::from_timestamp(i64::try_from(t).ok()?, 0)),
    }
}

pub fn field_text(event: &RawValue, name: &str) -> Option<String> {
    let fields: std::collections::HashMap<std::borrow::Cow<'_, str>, &RawValue> =
        serde_json::from_str(event.get()).ok()?;
    let value = fields.get(name)?;
    match serde_json::from_str::<serde_json::Value>(value.get()).ok()? {
        serde_json::Value::String(text) => Some(text),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

pub fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// A time the way .NET writes it: UTC, 7 fractional digits, `Z`.
pub fn format_time(t: DateTime<Utc>) -> String {
    format!(
        "{}.{:07}Z",
        t.format("%Y-%m-%dT%H:%M:%S"),
        t.timestamp_subsec_nanos() / 100
    )
}

/// A time the way MassTransit's JSON body carries it (System.Text.Json): UTC, `Z`, the fraction of a second to 7
/// digits without its trailing zeros, and none when it is zero (`…42.338386Z`, `…42Z`). Headers carry
/// [`format_time`]'s 7 digits.
pub fn format_json_time(t: DateTime<Utc>) -> String {
    let seconds = t.format("%Y-%m-%dT%H:%M:%S");
    let fraction = format!("{:07}", t.timestamp_subsec_nanos() / 100);
    let fraction = fraction.trim_end_matches('0');
    if fraction.is_empty() {
        format!("{seconds}Z")
    } else {
        format!("{seconds}.{fraction}Z")
    }
}

/// The .NET type name a URN names: `urn:message:Ns:Type` → `Ns.Type` (as in `MT-Fault-MessageType`).
pub fn dotnet_type_name(urn: &str) -> String {
    urn.strip_prefix("urn:message:")
        .unwrap_or(urn)
        .replacen(':', ".", 1)
}

/// The process that wrote a message, as MassTransit's envelope `host` describes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HostInfo {
    pub machine_name: String,
    pub process_name: String,
    pub process_id: u32,
    pub assembly: String,
    pub assembly_version: String,
    pub framework_version: String,
    pub mass_transit_version: Option<String>,
    pub operating_system_version: String,
    /// The bus this process publishes as: a temporary endpoint of its own, in the envelope's `sourceAddress` (not
    /// part of `host`).
    #[serde(skip, default = "Uuid::new_v4")]
    pub bus_id: Uuid,
}

impl HostInfo {
    /// This process.
    pub fn current() -> Self {
        Self {
            machine_name: machine_name(),
            bus_id: Uuid::new_v4(),
            process_name: "inboxctl".to_owned(),
            process_id: std::process::id(),
            assembly: "inboxctl".to_owned(),
            assembly_version: env!("CARGO_PKG_VERSION").to_owned(),
            framework_version: format!("rust {}", env!("CARGO_PKG_RUST_VERSION")),
            // inboxctl is not MassTransit; the field is written (MassTransit always writes it), but empty.
            mass_transit_version: None,
            operating_system_version: format!(
                "Unix {}",
                std::fs::read_to_string("/proc/sys/kernel/osrelease")
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            ),
        }
    }
}

/// This machine's host name.
pub fn machine_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A MassTransit 8 envelope as MassTransit writes it: every field, in MassTransit's order, nulls included.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvelopeOut<'a, T: Serialize> {
    pub message_id: String,
    pub request_id: Option<String>,
    pub correlation_id: Option<String>,
    pub conversation_id: Option<String>,
    pub initiator_id: Option<String>,
    pub source_address: Option<String>,
    pub destination_address: Option<String>,
    pub response_address: Option<String>,
    pub fault_address: Option<String>,
    pub message_type: Vec<String>,
    pub message: &'a T,
    pub expiration_time: Option<String>,
    pub sent_time: String,
    pub headers: serde_json::Map<String, serde_json::Value>,
    pub host: &'a HostInfo,
}

impl<T: Serialize> EnvelopeOut<'_, T> {
    /// The body bytes: indented JSON (two spaces, `\n`), no trailing newline, like MassTransit's serializer.
    pub fn to_body(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self)
            .expect("an envelope of strings, ids and a serialisable event always serialises")
    }
}

/// The AMQP properties MassTransit sets on a message: content type, persistent delivery, message id.
pub fn masstransit_properties(message_id: Uuid) -> BasicProperties {
    BasicProperties::default()
        .with_content_type(MASSTRANSIT_CONTENT_TYPE.into())
        .with_delivery_mode(2)
        .with_message_id(message_id.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "1a280000-161d-4c08-9e18-08df4f1e91b6";

    fn mt_props() -> BasicProperties {
        masstransit_properties(Uuid::parse_str(ID).expect("uuid"))
    }

    fn envelope(body_extra: &str) -> String {
        format!(
            r#"{{"messageId": "{ID}", "messageType": ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"], "message": {{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT1", "destination": "Berlin"}}{body_extra}, "sentTime": "2026-11-30T20:14:42.338386Z"}}"#
        )
    }

    #[test]
    fn reads_an_envelope() {
        let got = parse(&mt_props(), envelope("").as_bytes()).expect("readable");
        assert_eq!(got.message_id.to_string(), ID);
        assert!(got.masstransit);
        assert_eq!(
            got.message_types,
            ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"]
        );
        assert!(got.payload.get().contains("\"trackingNumber\": \"PT1\""));
        assert_eq!(
            got.sent_time.map(format_time).as_deref(),
            Some("2026-11-30T20:14:42.3383860Z")
        );
    }

    #[test]
    fn the_envelope_id_wins_over_the_property_and_the_property_fills_in() {
        let other = masstransit_properties(Uuid::from_u128(7));
        assert_eq!(
            parse(&other, envelope("").as_bytes())
                .expect("ok")
                .message_id
                .to_string(),
            ID
        );
        let body = envelope("").replace(&format!("\"messageId\": \"{ID}\", "), "");
        assert_eq!(
            parse(&other, body.as_bytes()).expect("ok").message_id,
            Uuid::from_u128(7)
        );
    }

    #[test]
    fn plain_json_takes_the_property_id() {
        let props = BasicProperties::default()
            .with_message_id(ID.into())
            .with_content_type("application/json".into());
        let got = parse(&props, br#"{"parcelId": "x"}"#).expect("readable");
        assert!(!got.masstransit);
        assert_eq!(got.message_id.to_string(), ID);
        assert!(got.message_types.is_empty());
        assert_eq!(got.payload.get(), r#"{"parcelId": "x"}"#);
    }

    #[test]
    fn an_envelope_without_its_content_type_is_still_an_envelope() {
        let got = parse(&BasicProperties::default(), envelope("").as_bytes()).expect("readable");
        assert!(got.masstransit);
    }

    #[test]
    fn unreadable_messages_say_why() {
        let props = BasicProperties::default();
        assert_eq!(parse(&props, b"").unwrap_err(), Unreadable::EmptyBody);
        assert_eq!(parse(&props, b"  \n").unwrap_err(), Unreadable::EmptyBody);
        assert!(matches!(
            parse(&props, b"not json").unwrap_err(),
            Unreadable::NotJson(_)
        ));
        assert!(matches!(
            parse(&props, b"{\"a\": \"\xff\"}").unwrap_err(),
            Unreadable::NotJson(_)
        ));
        assert_eq!(
            parse(&props, br#"{"parcelId": "x"}"#).unwrap_err(),
            Unreadable::NoMessageId
        );
        let bad = BasicProperties::default().with_message_id("order-17".into());
        assert_eq!(
            parse(&bad, br#"{"parcelId": "x"}"#).unwrap_err(),
            Unreadable::BadMessageId("order-17".into())
        );
        let no_message = format!(r#"{{"messageId": "{ID}", "messageType": []}}"#);
        assert_eq!(
            parse(&mt_props(), no_message.as_bytes()).unwrap_err(),
            Unreadable::NoMessage
        );
        let twice = format!(r#"{{"messageId": "{ID}", "messageId": "{ID}", "message": {{}}}}"#);
        let err = parse(&mt_props(), twice.as_bytes()).unwrap_err();
        assert!(
            matches!(&err, Unreadable::BadEnvelope(e) if e.contains("duplicate field")),
            "{err}"
        );
        assert!(matches!(
            parse(&mt_props(), b"[1,2]").unwrap_err(),
            Unreadable::BadEnvelope(_)
        ));
    }

    #[test]
    fn a_byte_order_mark_the_nil_id_and_deep_headers_are_unreadable_with_their_reason() {
        let mut bom = b"\xEF\xBB\xBF".to_vec();
        bom.extend_from_slice(envelope("").as_bytes());
        assert_eq!(
            parse(&mt_props(), &bom).unwrap_err(),
            Unreadable::ByteOrderMark
        );
        assert!(
            Unreadable::ByteOrderMark
                .to_string()
                .contains("byte order mark")
        );

        let nil = envelope("").replace(ID, "00000000-0000-0000-0000-000000000000");
        assert_eq!(
            parse(&mt_props(), nil.as_bytes()).unwrap_err(),
            Unreadable::NilMessageId
        );
        let nil_property =
            BasicProperties::default().with_message_id(Uuid::nil().to_string().into());
        assert_eq!(
            parse(&nil_property, br#"{"parcelId": "x"}"#).unwrap_err(),
            Unreadable::NilMessageId
        );

        let mut deep = lapin::types::AMQPValue::LongInt(1);
        for _ in 0..=MAX_HEADER_DEPTH {
            let mut t = lapin::types::FieldTable::default();
            t.insert("k".into(), deep);
            deep = lapin::types::AMQPValue::FieldTable(t);
        }
        let mut headers = lapin::types::FieldTable::default();
        headers.insert("deep".into(), deep);
        let props = mt_props().with_headers(headers);
        assert_eq!(
            parse(&props, envelope("").as_bytes()).unwrap_err(),
            Unreadable::HeadersTooDeep(MAX_HEADER_DEPTH + 1)
        );
    }

    #[test]
    fn only_the_first_message_types_are_kept() {
        let many = vec![r#""urn:message:X:Y""#; 200_000].join(",");
        let body = format!(
            r#"{{"messageId": "{ID}", "messageType": [{many}], "message": {{"parcelId": 1}}}}"#
        );
        let got = parse(&mt_props(), body.as_bytes()).expect("read");
        assert_eq!(got.message_types.len(), MAX_MESSAGE_TYPES);
        let few = format!(r#"{{"messageId": "{ID}", "messageType": ["a", "b"], "message": {{}}}}"#);
        assert_eq!(
            parse(&mt_props(), few.as_bytes())
                .expect("read")
                .message_types,
            ["a", "b"]
        );
        let not_texts = format!(r#"{{"messageId": "{ID}", "messageType": [1], "message": {{}}}}"#);
        assert!(matches!(
            parse(&mt_props(), not_texts.as_bytes()),
            Err(Unreadable::BadEnvelope(_))
        ));
    }

    #[test]
    fn a_huge_id_is_quoted_cut_short() {
        let huge = "x".repeat(70_000);
        let props = BasicProperties::default().with_content_type("application/json".into());
        let body = format!(r#"{{"messageId": "{huge}", "messageType": [], "message": {{}}}}"#);
        let reason = parse(&props, body.as_bytes()).unwrap_err().to_string();
        assert!(reason.len() < 1000, "{} bytes", reason.len());
        assert!(reason.contains("70000 bytes in all"), "{reason}");
    }

    #[test]
    fn times_are_written_with_seven_digits() {
        let t = parse_time("2026-11-30T20:14:42.2177304Z").expect("time");
        assert_eq!(format_time(t), "2026-11-30T20:14:42.2177304Z");
        let t = parse_time("2026-11-30T20:14:42Z").expect("time");
        assert_eq!(format_time(t), "2026-11-30T20:14:42.0000000Z");
    }

    #[test]
    fn body_times_are_written_as_masstransits_json_writes_them() {
        // As captured from MassTransit 8: a fraction whose last digit is 0 has 6 digits.
        for written in [
            "2026-11-30T20:14:42.2177304Z",
            "2026-11-30T20:14:42.338386Z",
            "2026-11-30T20:14:42.5Z",
            "2026-11-30T20:14:42Z",
        ] {
            let t = parse_time(written).expect("time");
            assert_eq!(format_json_time(t), written);
        }
    }

    #[test]
    fn dotnet_names_from_urns() {
        assert_eq!(
            dotnet_type_name("urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"),
            "ParcelTracker.Domain.Events.ParcelCreatedEvent"
        );
    }
}
