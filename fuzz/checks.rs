//! What each fuzz target checks, one function per target: arbitrary bytes in, and nothing may panic, overflow the
//! stack or break the invariant stated. Shared by the targets (`fuzz/fuzz_targets/`) and by the corpus replay in the
//! test suite (`tests/fuzz_corpus.rs`), so that every input a campaign kept is checked again at every CI run.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, gen_frame};
use inboxctl::amqp::{address, dead_letter, envelope, limits};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// Two inputs from one: the first byte says where to cut the rest.
fn split(data: &[u8]) -> (&[u8], &[u8]) {
    match data.split_first() {
        Some((&at, rest)) => rest.split_at(usize::from(at).min(rest.len())),
        None => (&[], &[]),
    }
}

/// A short string (at most 255 bytes) from arbitrary bytes.
fn short(bytes: &[u8]) -> ShortString {
    let text = String::from_utf8_lossy(bytes);
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(text[..end].to_owned())
}

/// A header table read from `data` as lapin reads one off the wire, if `data` holds one.
fn table(data: &[u8]) -> Option<FieldTable> {
    lapin::types::parsing::parse_field_table(data)
        .ok()
        .map(|(_, table)| table)
}

/// The bytes the content header frame carrying `properties` takes on the wire, as lapin would write it.
fn frame_len(properties: &BasicProperties) -> usize {
    let frame = AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 0,
            properties: properties.clone(),
        },
    );
    let (bytes, _) = cookie_factory::r#gen(gen_frame(&frame), Vec::new()).expect("serialises");
    bytes.len()
}

/// Reading a delivery: any body, any message id property, with or without MassTransit's content type.
pub fn envelope(data: &[u8]) {
    let (id, body) = split(data);
    let mut properties = BasicProperties::default().with_message_id(short(id));
    if id.first().is_some_and(|b| b % 2 == 0) {
        properties = properties.with_content_type(envelope::MASSTRANSIT_CONTENT_TYPE.into());
    }
    if let Ok(incoming) = envelope::parse(&properties, body) {
        assert!(!incoming.message_id.is_nil(), "the nil id is never an id");
        let fingerprint = envelope::fingerprint(&incoming.payload);
        assert_eq!(fingerprint, envelope::fingerprint(&incoming.payload));
    }
}

/// Reading a header table off the wire: bounded nesting, and what a copy keeps of it is within inboxctl's bound and
/// measured as the encoder writes it.
pub fn header_table(data: &[u8]) {
    let Some(table) = table(data) else {
        return;
    };
    let shallow = limits::shallow_headers(&table);
    assert!(limits::header_depth(&shallow) <= limits::MAX_HEADER_DEPTH);
    let properties = BasicProperties::default().with_headers(shallow.clone());
    let empty = frame_len(&BasicProperties::default());
    assert_eq!(
        frame_len(&properties) - empty,
        limits::table_len(&shallow),
        "the table's length as inboxctl measures it is the encoder's"
    );
}

/// A dead-letter copy of an arbitrary message (its headers, TTL and user) with an arbitrary failure, for frames of
/// 4 KB to 128 KB: if made, it fits the frame, carries no TTL and no foreign user, and its texts are bounded.
pub fn dead_letter_copy(data: &[u8]) {
    let (text, rest) = split(data);
    let frame_max = 4096 + usize::from(rest.first().copied().unwrap_or(0)) * 496;
    let headers = table(rest.get(1..).unwrap_or_default()).unwrap_or_default();
    let text = String::from_utf8_lossy(text).repeat(1 + text.len() % 7 * 300);
    let fault = dead_letter::Fault {
        exception_type: "inboxctl::Fuzz".to_owned(),
        message: text.clone(),
        stack_trace: text.clone(),
        input_address: "rabbitmq://127.0.0.1/q".to_owned(),
        consumer_type: text.chars().take(500).collect(),
        message_type: Some(text.clone()),
        retry_count: 3,
    };
    let original = BasicProperties::default()
        .with_message_id(short(text.as_bytes()))
        .with_expiration("60000".into())
        .with_user_id(short(text.as_bytes()))
        .with_headers(headers.clone());
    let copy_headers = dead_letter::error_headers(Some(&headers), &fault);
    assert!(limits::header_depth(&copy_headers) <= limits::MAX_HEADER_DEPTH);
    match dead_letter::copy_properties(&original, copy_headers, "guest", frame_max) {
        Ok(copy) => {
            let on_the_wire = frame_len(&copy);
            assert_eq!(on_the_wire, limits::content_header_len(&copy));
            assert!(on_the_wire <= frame_max, "{on_the_wire} > {frame_max}");
            assert!(copy.expiration().is_none());
            assert!(
                copy.user_id()
                    .as_ref()
                    .is_none_or(|u| u.as_str() == "guest")
            );
            let copied = copy.headers().as_ref().expect("headers");
            for key in [
                "MT-Fault-Message",
                "MT-Fault-MessageType",
                "MT-Fault-ConsumerType",
            ] {
                if let Some(AMQPValue::LongString(s)) = copied.inner().get(key) {
                    assert!(s.len() <= limits::MAX_HEADER_TEXT, "{key}: {}", s.len());
                }
            }
        }
        Err(too_large) => assert!(too_large.needed > frame_max),
    }
}

/// What `replay` reads from a dead-lettered message's headers: never a panic, and an origin it names is a valid
/// queue name.
pub fn replay_failure(data: &[u8]) {
    let (from, rest) = split(data);
    // `--from` is a queue name (replay refuses one over 255 bytes before it reads anything), so the queue a message
    // is read from is one too.
    let from = short(from);
    let headers = table(rest);
    let failure = inboxctl::replay::failure(headers.as_ref(), from.as_str(), "/");
    let queue = match &failure.origin {
        inboxctl::replay::Origin::Queue(queue) => Some(queue),
        inboxctl::replay::Origin::OtherVhost { queue, .. } => Some(queue),
        _ => None,
    };
    if let Some(queue) = queue {
        assert!(
            !queue.is_empty() && queue.len() <= 255,
            "an origin must be a queue name: {} bytes",
            queue.len()
        );
    }
}

/// MassTransit addresses: any text is read without a panic, and a queue it names is a valid queue name; any vhost and
/// queue name written is read back exactly.
pub fn address(data: &[u8]) {
    if let Ok(read) = address::parse(&String::from_utf8_lossy(data)) {
        assert!(
            !read.queue.is_empty() && read.queue.len() <= 255,
            "{read:?}"
        );
    }
    let (vhost, name) = split(data);
    let (vhost, name) = (
        String::from_utf8_lossy(vhost),
        String::from_utf8_lossy(name),
    );
    if name.is_empty() || name.len() > 255 || vhost.is_empty() || vhost.len() > 255 {
        return;
    }
    let written = address::write("127.0.0.1", None, false, &vhost, &name);
    let read = address::parse(&written).unwrap_or_else(|e| panic!("{written}: {e}"));
    assert_eq!(read.queue, name, "{written}");
    assert_eq!(read.vhost.as_deref().unwrap_or("/"), vhost, "{written}");
}
