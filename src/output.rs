//! Writing results to stdout. A closed pipe (`inboxctl … | head`) is not an error: the reader has what it wanted.

use std::io::{ErrorKind, Write as _};

use crate::error::Result;

/// Writes `text` and a newline to stdout; a reader that went away is not an error.
pub fn line(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Writes `value` as one line of JSON to stdout. Text from a message or the database may hold what a terminal obeys
/// (C1 controls such as U+009B, which JSON leaves as they are, and bidirectional overrides): every such character is
/// written escaped (`\u009b`), so a person reading the line on a terminal sees it inert, and a parser reads the same
/// string back.
pub fn json<T: serde::Serialize>(value: &T) -> Result<()> {
    line(&to_inert_json(value)?)
}

fn to_inert_json<T: serde::Serialize>(value: &T) -> Result<String> {
    let mut bytes = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut bytes, Inert);
    value
        .serialize(&mut serializer)
        .map_err(std::io::Error::other)?;
    String::from_utf8(bytes).map_err(|e| std::io::Error::other(e).into())
}

/// serde_json's compact format, with [`crate::sanitize::is_unsafe`] characters escaped in strings.
struct Inert;

impl serde_json::ser::Formatter for Inert {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut rest = fragment;
        while let Some((at, c)) = rest
            .char_indices()
            .find(|(_, c)| crate::sanitize::is_unsafe(*c))
        {
            writer.write_all(&rest.as_bytes()[..at])?;
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(writer, "\\u{unit:04x}")?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        writer.write_all(rest.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_a_terminal_obeys_are_escaped_and_read_back_the_same() {
        let evil = "carrier\u{9b}2J\u{202e}txt.exe\u{1b}[31m\n Zürich";
        let text = to_inert_json(&serde_json::json!({ "reason": evil })).expect("serialized");
        assert!(!text.chars().any(crate::sanitize::is_unsafe), "{text:?}");
        assert!(
            text.contains("\\u009b") && text.contains("\\u202e"),
            "{text}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(back["reason"], evil);
        assert_eq!(
            to_inert_json(&serde_json::json!({"a": [1, "b"]})).expect("serialized"),
            r#"{"a":[1,"b"]}"#
        );
    }
}
