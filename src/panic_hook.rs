//! Panics printed as every other text inboxctl prints: passwords masked, control and direction-changing characters
//! escaped. Rust's own hook writes a panic's message as it is, and a panic in a consumer's work — caught, counted as
//! the message's failure — may quote the message's text or a URL.

use std::io::Write as _;

/// Replaces the process's panic hook (the binary's, at start; `top` chains its own, which gives the terminal back,
/// before it). The line keeps Rust's shape (`thread '…' panicked at file:line:col:` and the message), and a backtrace
/// follows when `RUST_BACKTRACE` asks for one; under `--log-format json` it is one JSON line of the log instead.
pub fn install() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown place".to_owned());
        let message = info.payload_as_str().unwrap_or("Box<dyn Any>");
        let backtrace = std::backtrace::Backtrace::capture();
        let backtrace = (backtrace.status() == std::backtrace::BacktraceStatus::Captured)
            .then(|| backtrace.to_string());
        if crate::logging::json_lines() {
            let mut fields = serde_json::Map::new();
            fields.insert("panic".to_owned(), message.into());
            fields.insert("thread".to_owned(), name.into());
            fields.insert("location".to_owned(), location.as_str().into());
            if let Some(backtrace) = backtrace {
                fields.insert("backtrace".to_owned(), backtrace.into());
            }
            let said = format!("thread '{name}' panicked at {location}: {message}");
            crate::logging::write_json_event("ERROR", &said, fields);
            return;
        }
        let mut text = format!("thread '{name}' panicked at {location}:\n{message}\n");
        if let Some(backtrace) = backtrace {
            text.push_str(&format!("stack backtrace:\n{backtrace}\n"));
        }
        let text = crate::sanitize::multiline(&crate::redact::text(&text));
        let _ = std::io::stderr().write_all(text.as_bytes());
    }));
}
