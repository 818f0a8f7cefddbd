//! Reading a delivery (a MassTransit 8 envelope, or plain JSON) and writing MassTransit envelopes.
//!
//! What MassTransit writes (captured in `tests/fixtures/interop`): content type `application/vnd.masstransit+json`,
//! delivery mode 2, AMQP `message_id` equal to the envelope's `messageId`, and an indented camelCase JSON body whose
//! `message` is the event.

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::Digest as _;
use uuid::Uuid;

use super::limits::{self, MAX_CANONICAL_EVENT, MAX_HEADER_DEPTH, MAX_LOGGED_TEXT};
use crate::inbox::Fingerprint;

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

/// The envelope fields inboxctl reads. Unknown fields are ignored; a field given twice is an error.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvelopeIn<'a> {
    #[serde(borrow)]
    message_id: Option<std::borrow::Cow<'a, str>>,
    message_type: Option<Vec<String>>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    #[serde(borrow)]
    sent_time: Option<std::borrow::Cow<'a, str>>,
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
                message_types: envelope.message_type.unwrap_or_default(),
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
                message_types: properties
                    .kind()
                    .as_ref()
                    .map(|t| vec![t.as_str().to_owned()])
                    .unwrap_or_default(),
                payload: raw.to_owned(),
                masstransit: false,
                sent_time: None,
            })
        }
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

/// The fingerprint of an event, to tell a copy of a message from another message reusing its id: SHA-256 (first 16
/// bytes) of its canonical form — parsed, object keys sorted, no whitespace — so that a legitimate re-send that
/// differs in key order, whitespace or the envelope around it (`sentTime`, headers) has the same fingerprint. An
/// event larger than [`MAX_CANONICAL_EVENT`], deeper than the JSON parser's bound, or holding a number the parse
/// would round (more digits than a double holds exactly: a .NET `decimal`, an amount past 2^64), is fingerprinted
/// over its bytes as they are: two events that differ only in such a number's last digits are two events, not a
/// copy and its original.
pub fn fingerprint(event: &RawValue) -> Fingerprint {
    let text = event.get();
    let canonical = (text.len() <= MAX_CANONICAL_EVENT && !has_rounded_number(text))
        .then(|| serde_json::from_str::<serde_json::Value>(text).ok())
        .flatten()
        .map(|value| {
            let mut out = Vec::with_capacity(text.len());
            write_canonical(&value, &mut out);
            out
        });
    let digest = sha2::Sha256::digest(canonical.as_deref().unwrap_or(text.as_bytes()));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Fingerprint::from_bytes(bytes)
}

/// Whether `json` holds a number that parsing would not keep exactly: an integer beyond 64 bits, or a decimal with
/// more significant digits than a double holds (15) or an exponent near its limits. Strings are skipped.
fn has_rounded_number(json: &str) -> bool {
    let bytes = json.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                if rounded(&json[start..i]) {
                    return true;
                }
            }
            _ => i += 1,
        }
    }
    false
}

/// Whether one JSON number's text would be rounded by parsing it (see [`has_rounded_number`]): the value serde_json
/// writes back after parsing it — what the canonical form holds — is not the value written. A double written
/// shortest-round-trip (`0.30000000000000004`, as JavaScript, .NET and Python write them) comes back as it was.
fn rounded(number: &str) -> bool {
    let Ok(parsed) = serde_json::from_str::<serde_json::Number>(number) else {
        return true;
    };
    match (decimal(number), decimal(&parsed.to_string())) {
        (Some(a), Some(b)) => a != b,
        _ => true,
    }
}

/// A JSON number's value as (negative, significant digits, exponent of the first digit); zero as `(false, "", 0)`.
fn decimal(number: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: String = int.chars().chain(frac.chars()).collect();
    let leading = digits.len() - digits.trim_start_matches('0').len();
    let significant = digits.trim_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let point = i64::try_from(int.len()).ok()? - i64::try_from(leading).ok()?;
    Some((
        negative,
        significant.to_owned(),
        exponent.checked_add(point)?,
    ))
}

/// `value` as compact JSON with every object's keys sorted, whatever order the map type keeps them in. Its depth is
/// bounded by the JSON parser's (128 levels).
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_scalar(&serde_json::Value::String(key.clone()), out);
                out.push(b':');
                write_canonical(value, out);
            }
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => write_scalar(scalar, out),
    }
}

fn write_scalar(value: &serde_json::Value, out: &mut Vec<u8>) {
    // Writing a string, number, bool or null into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

/// MassTransit writes `sentTime` in UTC with 0 to 7 fractional digits.
/// The value of the top-level field `name` of an event, as a publisher would write it into a routing key: a string's
/// text, a number's or a boolean's JSON; `None` when the event is not an object, lacks the field, or holds an
/// object, an array or null there.
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
    fn a_huge_id_is_quoted_cut_short() {
        let huge = "x".repeat(70_000);
        let props = BasicProperties::default().with_content_type("application/json".into());
        let body = format!(r#"{{"messageId": "{huge}", "messageType": [], "message": {{}}}}"#);
        let reason = parse(&props, body.as_bytes()).unwrap_err().to_string();
        assert!(reason.len() < 1000, "{} bytes", reason.len());
        assert!(reason.contains("70000 bytes in all"), "{reason}");
    }

    fn event(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).expect("json")
    }

    #[test]
    fn a_fingerprint_ignores_key_order_and_whitespace_not_content() {
        let a = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Berlin", "n": [1, {"b": 2, "a": 1}]}"#,
        ));
        let reordered = fingerprint(&event(
            "{\n  \"n\" : [ 1 , { \"a\":1,\"b\":2 } ],\"destination\":\"Berlin\",\"parcelId\":\"p1\"}",
        ));
        assert_eq!(a, reordered);
        let other = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Paris", "n": [1, {"b": 2, "a": 1}]}"#,
        ));
        assert_ne!(a, other);
        let swapped_array = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Berlin", "n": [{"b": 2, "a": 1}, 1]}"#,
        ));
        assert_ne!(a, swapped_array, "array order is content");
    }

    #[test]
    fn a_fingerprint_tells_numbers_apart_past_a_doubles_precision() {
        let with = |amount: &str| fingerprint(&event(&format!(r#"{{"a": "x", "v": {amount}}}"#)));
        // A .NET decimal's 20 digits, and integers past 64 bits: once rounded to one double, now told apart.
        assert_ne!(with("1234567890.1234567891"), with("1234567890.1234567899"));
        assert_ne!(with("18446744073709551616"), with("18446744073709551617"));
        assert_ne!(with("1e-400"), with("2e-400"));
        // Numbers a double holds keep the canonical form of before: the same fingerprints as stored ones.
        let spaced =
            |amount: &str| fingerprint(&event(&format!(r#"{{ "v" : {amount}, "a":"x" }}"#)));
        for n in [
            "1",
            "-7",
            "1.5",
            "1.50",
            "123456789012345",
            "0.000001",
            "18446744073709551615",
            "-9223372036854775808",
        ] {
            assert_eq!(with(n), spaced(n), "{n}");
        }
        assert_eq!(with("1.5"), with("1.50"), "the same value");
        // Digits inside a string are not a number.
        assert!(!has_rounded_number(
            r#"{"id": "123456789012345678901234567890"}"#
        ));
        assert!(!has_rounded_number(
            r#"{"id": "a\"123456789012345678901234567890"}"#
        ));
        assert!(has_rounded_number(
            r#"{"id": "a\"", "n": 123456789012345678901234567890}"#
        ));
    }

    #[test]
    fn times_are_written_with_seven_digits() {
        let t = parse_time("2026-11-30T20:14:42.2177304Z").expect("time");
        assert_eq!(format_time(t), "2026-11-30T20:14:42.2177304Z");
        let t = parse_time("2026-11-30T20:14:42Z").expect("time");
        assert_eq!(format_time(t), "2026-11-30T20:14:42.0000000Z");
    }

    #[test]
    fn dotnet_names_from_urns() {
        assert_eq!(
            dotnet_type_name("urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"),
            "ParcelTracker.Domain.Events.ParcelCreatedEvent"
        );
    }

    /// The fingerprint as stored before this change: always the canonical form (size permitting).
    fn old(text: &str) -> Fingerprint {
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        let mut out = Vec::new();
        write_canonical(&value, &mut out);
        let digest = sha2::Sha256::digest(&out);
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Fingerprint::from_bytes(bytes)
    }

    #[test]
    fn ordinary_numbers_keep_their_stored_fingerprint() {
        let mut changed = Vec::new();
        for n in [
            "0",
            "-0",
            "1e5",
            "1E+2",
            "0.1",
            "123.456e-7",
            "-0.0",
            "1.5e10",
            // doubles written shortest-round-trip (JS, .NET Core, Python): the double holds them exactly
            "0.30000000000000004",
            "52.52000659999999",
            "33.333333333333336",
            "1.0e308",
            "1e300",
            "-2.5e-300",
            "1e0",
            "1234567890123456.0",
            "100000000000000000000",
            "0.1234567890123456",
            "1.2345678901234567",
            "3.141592653589793",
            "-0.0",
            "0e999",
        ] {
            let text = format!(r#"{{ "v": {n}, "a": "x" }}"#);
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            let back = value["v"].to_string();
            let new = fingerprint(&RawValue::from_string(text.clone()).unwrap());
            if new != old(&text) {
                changed.push(format!("{n} (serde writes it back as {back})"));
            }
        }
        assert!(
            changed.is_empty(),
            "stored fingerprints changed for: {changed:#?}"
        );
        // What serde_json's parse does lose stays apart.
        for n in [
            "19.990000000000002",
            "9007199254740993.5",
            "1234567890.1234567891",
            "18446744073709551617",
            "1e-400",
            "1e400",
        ] {
            assert!(has_rounded_number(&format!("[{n}]")), "{n}");
        }
    }

    #[test]
    fn the_number_scan_never_panics() {
        for s in [
            "",
            "-",
            "--",
            "1e",
            "1e+",
            "é1",
            "\"",
            "\"\\",
            "\"\\é\"1",
            "é\"\\\"",
            "1.2.3e-e",
            "\"é",
            "-é",
            "9e99999999999999999",
            "\u{10FFFF}-1",
            "\"\\\u{10FFFF}\"12345678901234567890",
        ] {
            let _ = has_rounded_number(s);
        }
        let long = format!("{}e{}", "9".repeat(100_000), "9".repeat(100));
        assert!(has_rounded_number(&long));
    }
}
