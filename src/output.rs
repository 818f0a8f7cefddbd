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

/// Writes `value` as one line of JSON to stdout.
pub fn json<T: serde::Serialize>(value: &T) -> Result<()> {
    let text = serde_json::to_string(value).map_err(std::io::Error::other)?;
    line(&text)
}
