//! The bounds inboxctl keeps on what it takes from a message: what it copies into headers, writes to logs, recurses
//! over and hashes. A message the broker accepted can hold anything (a header table nested a thousand levels deep, a
//! 70,000-character message id, 130 KB of headers); nothing from it may crash a consumer, make a dead-letter copy the
//! broker refuses, or flood a log. `docs/reliability.md` lists each limit and what happens at it.

use std::borrow::Cow;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};

/// Deepest nesting of tables and arrays in a message's headers that inboxctl reads or copies. Deeper: the message is
/// unreadable (moved to the error queue with that reason), and the copy carries a note instead of the too-deep value.
/// Below the AMQP parser's own bound (`vendor/README.md`), so that every message that parser had to cut short is
/// caught here.
pub const MAX_HEADER_DEPTH: usize = 64;

/// Longest text inboxctl writes into one header of a dead-letter copy (`MT-Fault-Message`, a message type, a
/// consumer_type, …) when the text comes from a message or an error about it.
pub const MAX_HEADER_TEXT: usize = 2048;

/// Longest `MT-Fault-StackTrace` (the error and its causes): MassTransit's own are ~2 KB.
pub const MAX_STACK_TRACE: usize = 8192;

/// Longest text from a message (an id, a type, a reason that quotes it) in one log field.
pub const MAX_LOGGED_TEXT: usize = 512;

/// Largest event whose fingerprint is taken over its canonical form (parsed, keys sorted, no whitespace); a larger
/// one is fingerprinted over its bytes as they are, so that a re-send with other whitespace reads as a conflict.
pub const MAX_CANONICAL_EVENT: usize = 1 << 20;

/// Bytes of a content header frame beyond its properties: frame type, channel and size (7), class, weight and body
/// size (12), frame end (1).
const CONTENT_HEADER_OVERHEAD: usize = 20;

/// `text` cut to at most `max` bytes (at a character boundary) with a note of how long it was.
pub fn truncate(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let note = format!("… [cut by inboxctl: {} bytes in all]", text.len());
    let mut end = max.saturating_sub(note.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{note}", &text[..end]))
}

/// How deep tables and arrays nest in `headers` (0 for a table of plain values).
pub fn header_depth(headers: &FieldTable) -> usize {
    headers.inner().values().map(value_depth).max().unwrap_or(0)
}

/// How deep tables and arrays nest in `value`. Walks with a stack of its own, so that no nesting can exhaust the
/// thread's.
fn value_depth(value: &AMQPValue) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(value, 1)];
    while let Some((value, depth)) = pending.pop() {
        match value {
            AMQPValue::FieldTable(t) => {
                deepest = deepest.max(depth);
                pending.extend(t.inner().values().map(|v| (v, depth + 1)));
            }
            AMQPValue::FieldArray(a) => {
                deepest = deepest.max(depth);
                pending.extend(a.as_slice().iter().map(|v| (v, depth + 1)));
            }
            // What the parser did not descend into it keeps as bytes: deeper than anything allowed.
            AMQPValue::ByteArray(_) if depth > MAX_HEADER_DEPTH => deepest = deepest.max(depth),
            _ => {}
        }
    }
    deepest
}

/// Whether a short string of `headers` — a name at any depth, or a short-string value — was not UTF-8 on the wire
/// (read with U+FFFD in its place, see `vendor/README.md`). Walks with a stack of its own, within
/// [`MAX_HEADER_DEPTH`] (the caller refuses deeper headers first).
pub fn header_text_replaced(headers: &FieldTable) -> bool {
    let mut pending: Vec<(&FieldTable, usize)> = vec![(headers, 1)];
    let mut values: Vec<(&AMQPValue, usize)> = Vec::new();
    while let Some((table, depth)) = pending.pop() {
        for (key, value) in table.inner() {
            if key.as_str().contains(char::REPLACEMENT_CHARACTER) {
                return true;
            }
            values.push((value, depth));
        }
        while let Some((value, depth)) = values.pop() {
            match value {
                AMQPValue::ShortString(s) if s.as_str().contains(char::REPLACEMENT_CHARACTER) => {
                    return true;
                }
                AMQPValue::FieldTable(t) if depth <= MAX_HEADER_DEPTH => {
                    pending.push((t, depth + 1))
                }
                AMQPValue::FieldArray(a) if depth <= MAX_HEADER_DEPTH => {
                    values.extend(a.as_slice().iter().map(|v| (v, depth + 1)));
                }
                _ => {}
            }
        }
    }
    false
}

/// `headers` with every value that nests deeper than [`MAX_HEADER_DEPTH`] replaced by a note saying so: what a copy
/// can carry. (Cloning recurses, so only values within the bound are cloned.)
pub fn shallow_headers(headers: &FieldTable) -> FieldTable {
    let mut out = FieldTable::default();
    for (key, value) in headers.inner() {
        let kept = if value_depth(value) > MAX_HEADER_DEPTH {
            long_string(&format!(
                "[dropped by inboxctl: nested deeper than {MAX_HEADER_DEPTH} levels]"
            ))
        } else {
            value.clone()
        };
        out.insert(key.clone(), kept);
    }
    out
}

/// A header value holding `text`.
pub fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// Bytes `value` takes on the wire, type tag included. Only for values within [`MAX_HEADER_DEPTH`].
fn value_len(value: &AMQPValue) -> usize {
    1 + match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.len(),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(value_len).sum::<usize>(),
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}

/// Bytes a header table takes on the wire.
pub fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + value_len(v))
        .sum::<usize>()
}

/// Bytes of the content header frame that carries `properties`: it must fit in one frame, at most the connection's
/// negotiated frame size, or the broker closes the connection (`FRAME_ERROR`).
pub fn content_header_len(properties: &BasicProperties) -> usize {
    let short =
        |s: &Option<lapin::types::ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    CONTENT_HEADER_OVERHEAD
        + 2 // property flags
        + short(properties.content_type())
        + short(properties.content_encoding())
        + properties.headers().as_ref().map_or(0, table_len)
        + properties.delivery_mode().map_or(0, |_| 1)
        + properties.priority().map_or(0, |_| 1)
        + short(properties.correlation_id())
        + short(properties.reply_to())
        + short(properties.expiration())
        + short(properties.message_id())
        + properties.timestamp().map_or(0, |_| 8)
        + short(properties.kind())
        + short(properties.user_id())
        + short(properties.app_id())
        + short(properties.cluster_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> AMQPValue {
        let mut value = AMQPValue::LongInt(1);
        for _ in 0..depth {
            let mut t = FieldTable::default();
            t.insert("k".into(), value);
            value = AMQPValue::FieldTable(t);
        }
        value
    }

    #[test]
    fn a_name_or_a_short_value_read_with_u_fffd_is_found_at_any_depth_within_the_bound() {
        let mut inner = FieldTable::default();
        inner.insert("na\u{fffd}me".into(), AMQPValue::LongInt(1));
        let mut array = FieldTable::default();
        array.insert(
            "list".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(inner)].into()),
        );
        let mut headers = FieldTable::default();
        headers.insert("plain".into(), AMQPValue::LongInt(1));
        headers.insert("x-death".into(), AMQPValue::FieldTable(array));
        assert!(header_text_replaced(&headers));
        let mut value = FieldTable::default();
        value.insert("kind".into(), AMQPValue::ShortString("\u{fffd}".into()));
        assert!(header_text_replaced(&value));
        let mut clean = FieldTable::default();
        clean.insert("tenant".into(), nested(10));
        clean.insert("text".into(), AMQPValue::LongString("\u{fffd}".into()));
        assert!(!header_text_replaced(&clean), "long strings are bytes");
    }

    /// A table at the deepest nesting a copy carries (`MAX_HEADER_DEPTH`) is looked into too: its names were not,
    /// and one read with U+FFFD was copied altered (two such names merged into one), its dead-letter copy acked.
    #[test]
    fn a_name_read_with_u_fffd_at_the_deepest_nesting_allowed_is_found() {
        let at_depth = |depth: usize, key: &str| {
            let mut value = AMQPValue::LongInt(1);
            for level in 0..depth {
                let mut t = FieldTable::default();
                t.insert(if level == 0 { key } else { "k" }.into(), value);
                value = AMQPValue::FieldTable(t);
            }
            let mut headers = FieldTable::default();
            headers.insert("deep".into(), value);
            headers
        };
        let deepest = at_depth(MAX_HEADER_DEPTH, "na\u{fffd}me");
        assert_eq!(header_depth(&deepest), MAX_HEADER_DEPTH);
        assert!(header_text_replaced(&deepest));
        assert!(!header_text_replaced(&at_depth(MAX_HEADER_DEPTH, "name")));
        let mut in_array = FieldTable::default();
        in_array.insert(
            "list".into(),
            AMQPValue::FieldArray(vec![AMQPValue::ShortString("\u{fffd}".into())].into()),
        );
        let mut value = AMQPValue::FieldTable(in_array);
        for _ in 1..MAX_HEADER_DEPTH - 1 {
            let mut t = FieldTable::default();
            t.insert("k".into(), value);
            value = AMQPValue::FieldTable(t);
        }
        let mut headers = FieldTable::default();
        headers.insert("deep".into(), value);
        assert_eq!(header_depth(&headers), MAX_HEADER_DEPTH);
        assert!(
            header_text_replaced(&headers),
            "a short string in an array at the deepest nesting"
        );
    }

    #[test]
    fn truncation_keeps_short_text_and_says_how_long_long_text_was() {
        assert!(matches!(truncate("short", 10), Cow::Borrowed("short")));
        let long = "é".repeat(5000);
        let cut = truncate(&long, 300);
        assert!(cut.len() <= 300, "{}", cut.len());
        assert!(
            cut.ends_with("[cut by inboxctl: 10000 bytes in all]"),
            "{cut}"
        );
    }

    #[test]
    fn depth_counts_tables_and_arrays() {
        let mut h = FieldTable::default();
        h.insert("plain".into(), long_string("x"));
        assert_eq!(header_depth(&h), 0);
        h.insert("deep".into(), nested(3));
        assert_eq!(header_depth(&h), 3);
        h.insert(
            "array".into(),
            AMQPValue::FieldArray(vec![nested(5)].into()),
        );
        assert_eq!(header_depth(&h), 6);
    }

    #[test]
    fn too_deep_values_are_replaced_by_a_note_and_the_rest_kept() {
        let mut h = FieldTable::default();
        h.insert("tenant".into(), long_string("acme"));
        h.insert("ok".into(), nested(MAX_HEADER_DEPTH));
        h.insert("deep".into(), nested(MAX_HEADER_DEPTH + 1));
        let out = shallow_headers(&h);
        assert_eq!(out.inner().get("tenant"), h.inner().get("tenant"));
        assert_eq!(out.inner().get("ok"), h.inner().get("ok"));
        assert!(
            matches!(out.inner().get("deep"), Some(AMQPValue::LongString(s)) if String::from_utf8_lossy(s.as_bytes()).contains("nested deeper")),
        );
        assert_eq!(header_depth(&out), MAX_HEADER_DEPTH);
    }

    #[test]
    fn lengths_are_those_of_the_wire() {
        let mut h = FieldTable::default();
        h.insert("ab".into(), long_string("xyz"));
        // 4 (table size) + 1 + 2 (key) + 1 (type) + 4 + 3 (long string)
        assert_eq!(table_len(&h), 15);
        let props = BasicProperties::default()
            .with_message_id("id".into())
            .with_delivery_mode(2)
            .with_headers(h);
        assert_eq!(content_header_len(&props), 20 + 2 + 3 + 1 + 15);
    }
}
