//! Logs: `tracing` to stderr, filtered by `RUST_LOG` or `-v`, as text or JSON lines. Colour only on a terminal and
//! never under `NO_COLOR`.
//!
//! A log line carries text from outside — a consumer_type, a queue name, a failure reason, a message id — and a
//! control character or a bidirectional override in it would act on the terminal (or forge a line) rather than show.
//! Both formats make such characters inert here, once, whatever the call site logged: text lines write them as
//! `\u{1b}` (the form the tables use), JSON lines as `\u001b` (so a JSON reader gets back exactly what was logged).

use std::fmt::{self, Write as _};
use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::field::{Field, Visit};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::Writer;

use crate::cli::{GlobalOpts, LogFormat};
use crate::{redact, sanitize};

/// How much of the log a command wants on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Stderr,
    /// The consumers' per-message warnings (duplicates, retries) left out unless `-v` is given — for `demo`, whose
    /// duplicates are the point, not news.
    StderrQuietConsumers,
    /// Nothing: `top` draws on the terminal stderr goes to.
    Nowhere,
}

pub fn init(global: &GlobalOpts, target: Target) {
    if target == Target::Nowhere {
        return;
    }
    let quiet_consumers = target == Target::StderrQuietConsumers;
    // lapin logs a passive declare of a missing exchange (how inboxctl checks before declaring) as an ERROR;
    // inboxctl reports the broker problems that matter itself. So it does the database's outages, which sqlx's pool
    // also warns of, in its own terms ("time to acquire exceeded slow threshold", "error occurred while testing the
    // connection on-release … at line 3211"): those are for -v.
    let mut default = match global.verbose {
        0 => "warn,lapin=off,sqlx::pool=error,sqlx_core::pool=error,inboxctl=info".to_owned(),
        1 => "warn,lapin=warn,inboxctl=debug".to_owned(),
        _ => "info,inboxctl=trace".to_owned(),
    };
    if quiet_consumers && global.verbose == 0 {
        default.push_str(",inboxctl::consumer=error");
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // A log line that cannot be written (stderr's reader gone: `2>&1 | head`) is dropped: the subscriber's own report
    // of it is an `eprintln!`, which panics on the same closed pipe.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .log_internal_errors(false);
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let _ = match global.log_format {
        LogFormat::Text => builder
            .with_writer(std::io::stderr)
            .with_ansi(use_colour())
            .fmt_fields(InertFields)
            .finish()
            .with(no_lapin_traces())
            .try_init(),
        LogFormat::Json => {
            JSON_LINES.store(true, Ordering::Relaxed);
            builder
                .json()
                .flatten_event(true)
                .with_writer(|| InertJson(std::io::stderr()))
                .finish()
                .with(no_lapin_traces())
                .try_init()
        }
    };
    crate::secret::warn_if_on_command_line(&global.connect.passwords_in_arguments);
}

/// lapin traces every frame it writes, the login's (user and password as a list of bytes) among them, where no
/// masking can see it: its traces are never logged, whatever RUST_LOG asks; what else it logs is as the filter says.
fn no_lapin_traces() -> tracing_subscriber::filter::FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool>
{
    tracing_subscriber::filter::filter_fn(|meta| {
        !(*meta.level() == tracing::Level::TRACE && meta.target().starts_with("lapin"))
    })
}

/// Colour on stderr only when it is a terminal and `NO_COLOR` is unset or empty.
fn use_colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The fields of a text line (`name=value`, the message bare), as tracing-subscriber writes them, with every value
/// made inert. Only the values: the level's colour and the names' styling are the formatter's own escape codes.
struct InertFields;

impl<'w> MakeVisitor<Writer<'w>> for InertFields {
    type Visitor = InertVisitor<'w>;

    fn make_visitor(&self, writer: Writer<'w>) -> Self::Visitor {
        InertVisitor {
            writer,
            first: true,
            result: Ok(()),
        }
    }
}

struct InertVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl InertVisitor<'_> {
    fn field(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        let name = field.name();
        // Metadata of records from the `log` crate, which the line's prefix already shows.
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let separator = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = if name == "message" {
            write!(self.writer, "{separator}")
        } else if self.writer.has_ansi_escapes() {
            // Italic name, dimmed `=`: tracing-subscriber's own styling.
            write!(
                self.writer,
                "{separator}\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m"
            )
        } else {
            write!(self.writer, "{separator}{name}=")
        }
        .and_then(|()| Inert(&mut self.writer).write_str(&redact::text(&value.to_string())));
    }
}

impl Visit for InertVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.field(field, format_args!("{value}"));
        } else {
            self.field(field, format_args!("{value:?}"));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.field(field, format_args!("{value}"));
        // Bounded: an error type may chain to itself (a `source()` that loops), and a log line must end.
        let mut causes = std::iter::successors(value.source(), |c| c.source());
        for cause in causes.by_ref().take(crate::MAX_CAUSES) {
            self.result = self.result.and_then(|()| {
                Inert(&mut self.writer).write_str(&redact::text(&format!(": {cause}")))
            });
        }
        if causes.next().is_some() {
            self.result = self
                .result
                .and_then(|()| Inert(&mut self.writer).write_str(": …"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, format_args!("{value:?}"));
    }
}

impl VisitOutput<fmt::Result> for InertVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for InertVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

/// Writes through to `W` with every unsafe character as a `\u{…}` escape, the form [`sanitize::text`] uses. A
/// backslash is not doubled: a value a call site already made inert (or that `Debug` escaped) is not escaped twice.
struct Inert<'a, W: fmt::Write>(&'a mut W);

impl<W: fmt::Write> fmt::Write for Inert<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            if sanitize::is_unsafe(c) {
                write!(self.0, "\\u{{{:x}}}", u32::from(c))?;
            } else {
                self.0.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// Set once the log is JSON lines (`--log-format json`): what inboxctl writes to stderr itself besides the log — a
/// panic, the error it ends with — is then one more line of it, not text among them.
static JSON_LINES: AtomicBool = AtomicBool::new(false);

/// Whether stderr carries JSON lines (`--log-format json`, once the log is set up).
pub(crate) fn json_lines() -> bool {
    JSON_LINES.load(Ordering::Relaxed)
}

/// Writes an event of the JSON log from outside `tracing` (a panic, the error a run ends with, the second signal's
/// stop) to stderr, in the log's shape (tracing-subscriber's, flattened: `timestamp`, `level`, `message` and `fields`
/// beside them), masked and escaped as every line of it is ([`InertJson`]).
pub(crate) fn write_json_event(
    level: &str,
    message: &str,
    fields: serde_json::Map<String, serde_json::Value>,
) {
    use std::io::Write as _;
    let mut line = fields;
    line.insert(
        "timestamp".to_owned(),
        chrono::Utc::now()
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
            .into(),
    );
    line.insert("level".to_owned(), level.into());
    line.insert("message".to_owned(), message.into());
    let line = format!("{}\n", serde_json::Value::Object(line));
    let _ = InertJson(std::io::stderr()).write_all(line.as_bytes());
}

/// A JSON line with its passwords masked. Masked as text, the line stays JSON unless a password runs into an escaped
/// quote (`?password=pw\"…`), whose escape the mask then takes with it: such a line is masked value by value instead
/// (its keys then in another order).
fn masked_json_line(line: &str) -> String {
    let masked = redact::text(line);
    if masked == line
        || serde_json::from_str::<serde::de::IgnoredAny>(masked.trim_end()).is_ok()
        || serde_json::from_str::<serde::de::IgnoredAny>(line.trim_end()).is_err()
    {
        return masked;
    }
    let Ok(mut value) = serde_json::from_str::<serde_json::Value>(line.trim_end()) else {
        return masked;
    };
    mask_strings(&mut value, 0);
    let end = if line.ends_with('\n') { "\n" } else { "" };
    format!("{value}{end}")
}

/// Every string of a JSON value masked, to a bound on the depth (a log line's fields are flat; deeper is left masked
/// as a whole).
fn mask_strings(value: &mut serde_json::Value, depth: usize) {
    match value {
        serde_json::Value::String(s) => *s = redact::text(s),
        serde_json::Value::Array(items) if depth < 16 => {
            for item in items {
                mask_strings(item, depth + 1);
            }
        }
        serde_json::Value::Object(fields) if depth < 16 => {
            for item in fields.values_mut() {
                mask_strings(item, depth + 1);
            }
        }
        other @ (serde_json::Value::Array(_) | serde_json::Value::Object(_)) => {
            *other = serde_json::Value::String("***".to_owned());
        }
        _ => {}
    }
}

/// JSON lines to `W`, with the unsafe characters that JSON leaves raw (DEL, C1 controls, bidirectional overrides)
/// written as `\uXXXX` escapes: the same string to a JSON reader, inert on a terminal. The C0 controls are already
/// escaped by the JSON writer, and the line end is the only one outside a string.
struct InertJson<W>(W);

impl<W: std::io::Write> std::io::Write for InertJson<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Each line comes in one write; anything else is passed through as it is. A password a library put in its
        // own log line (a driver echoing what it ignores) is masked like everywhere else.
        let masked = std::str::from_utf8(buf).ok().map(masked_json_line);
        let buf_len = buf.len();
        let buf = masked.as_deref().map_or(buf, str::as_bytes);
        match std::str::from_utf8(buf) {
            Ok(line) if line.chars().any(|c| c != '\n' && sanitize::is_unsafe(c)) => {
                let mut out = String::with_capacity(line.len() + 16);
                for c in line.chars() {
                    if c != '\n' && sanitize::is_unsafe(c) {
                        for unit in c.encode_utf16(&mut [0; 2]) {
                            let _ = write!(out, "\\u{unit:04x}");
                        }
                    } else {
                        out.push(c);
                    }
                }
                self.0.write_all(out.as_bytes())?;
            }
            _ => self.0.write_all(buf)?,
        }
        Ok(buf_len)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Self;
        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("lock").clone()).expect("UTF-8")
        }
    }

    const HOSTILE: &str = "carrier\u{202e}\u{1b}[31mred\u{9b}2J\u{7f}\r\nINFO forged line";

    fn log_hostile_values() {
        let span = tracing::info_span!("consume", queue = %HOSTILE);
        let _entered = span.enter();
        tracing::warn!(
            consumer_type = %HOSTILE,
            message_id = ?HOSTILE,
            reason = HOSTILE,
            "moving {HOSTILE} to the error queue"
        );
    }

    fn text_lines(ansi: bool) -> String {
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_ansi(ansi)
            .with_target(false)
            .fmt_fields(InertFields)
            .finish();
        tracing::subscriber::with_default(subscriber, log_hostile_values);
        out.text()
    }

    #[test]
    fn a_text_line_shows_controls_and_bidi_overrides_escaped() {
        let line = text_lines(false);
        assert_eq!(line.matches('\n').count(), 1, "one line: {line:?}");
        assert!(
            !line.trim_end_matches('\n').chars().any(sanitize::is_unsafe),
            "{line:?}"
        );
        assert!(
            line.contains("consumer_type=carrier\\u{202e}\\u{1b}[31mred\\u{9b}2J\\u{7f}\\u{d}\\u{a}INFO forged line"),
            "{line:?}"
        );
        assert!(
            line.contains("WARN consume{queue=carrier\\u{202e}"),
            "{line:?}"
        );
        assert!(line.contains("moving carrier\\u{202e}"), "{line:?}");
    }

    /// An error logged as a field whose `source()` is itself: its causes are written up to a bound, and the line ends
    /// (it used to be written for ever, the process held in its log call).
    #[test]
    fn an_error_whose_causes_loop_is_logged_to_a_bound() {
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_ansi(false)
            .fmt_fields(InertFields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(
                error = &crate::LoopingError as &(dyn std::error::Error + 'static),
                "failed"
            );
        });
        let line = out.text();
        assert_eq!(
            line.matches(": a loop").count(),
            crate::MAX_CAUSES,
            "{line:?}"
        );
        assert!(line.contains(": a loop: …"), "{line:?}");
        assert_eq!(line.matches('\n').count(), 1, "{line:?}");
    }

    #[test]
    fn on_a_terminal_the_colours_stay_and_the_values_are_still_inert() {
        let line = text_lines(true);
        // The formatter's own escape codes (level colour, styled names) are there...
        assert!(line.contains("\u{1b}[33m"), "{line:?}");
        assert!(line.contains("\u{1b}[3mconsumer_type\u{1b}[0m"), "{line:?}");
        // ...and none of the value's.
        assert!(!line.contains("\u{1b}[31m"), "{line:?}");
        assert!(
            !line.contains('\u{202e}') && !line.contains('\u{9b}'),
            "{line:?}"
        );
        assert_eq!(line.matches('\n').count(), 1, "{line:?}");
    }

    #[test]
    fn a_json_line_escapes_what_json_leaves_raw_and_reads_back_the_same() {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || InertJson(writer.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, log_hostile_values);
        let line = out.text();
        assert!(line.ends_with('\n'), "{line:?}");
        assert!(
            !line.trim_end_matches('\n').chars().any(sanitize::is_unsafe),
            "{line:?}"
        );
        assert!(
            line.contains("carrier\\u202e\\u001b[31mred\\u009b2J\\u007f"),
            "{line:?}"
        );
        let parsed: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(parsed["consumer_type"], HOSTILE, "{parsed}");
        assert_eq!(parsed["reason"], HOSTILE, "{parsed}");
    }

    /// lapin's traces (its frames, the login's among them) are dropped whatever the filter lets through; its other
    /// lines are as the filter says: off by default (an earlier directive capping its frames let them all through).
    #[test]
    fn lapin_traces_are_never_logged_and_its_other_lines_as_the_filter_says() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let lines = |filter: &str| {
            let out = Captured::default();
            let subscriber = tracing_subscriber::fmt()
                .with_env_filter(EnvFilter::new(filter))
                .with_writer(out.clone())
                .with_ansi(false)
                .finish()
                .with(no_lapin_traces());
            tracing::subscriber::with_default(subscriber, || {
                tracing::trace!(target: "lapin::io_loop", "frame-trace");
                tracing::debug!(target: "lapin::io_loop", "lapin-debug");
                tracing::error!(target: "lapin::io_loop", "lapin-error");
                tracing::trace!(target: "inboxctl::consumer", "own-trace");
            });
            out.text()
        };
        let all = lines("trace");
        assert!(!all.contains("frame-trace"), "{all}");
        assert!(
            all.contains("lapin-debug") && all.contains("own-trace"),
            "{all}"
        );
        let default = lines("warn,lapin=off,inboxctl=info");
        assert!(!default.contains("lapin-"), "{default}");
    }

    /// A library's own log line (the driver echoing a parameter it ignores) goes through the same masking as
    /// inboxctl's messages: a registered password, and any URL's, never reach stderr.
    #[test]
    fn a_password_in_any_log_line_is_masked_in_both_formats() {
        const SECRET: &str = "Zq9-logged-secret";
        const QUOTED: &str = "Zq9\"quoted\\secret";
        redact::register(SECRET);
        redact::register(QUOTED);
        let log = || {
            tracing::warn!(key = %SECRET, value = "", "ignoring unrecognized connect parameter");
            tracing::warn!(
                url = "amqp://app:0ther-pass@rabbit/%2f",
                "could not connect: {SECRET}"
            );
            tracing::warn!(value = QUOTED, "a value logged as Debug and JSON escape it");
        };
        let text = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(text.clone())
            .with_ansi(false)
            .fmt_fields(InertFields)
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let json = Captured::default();
        let writer = json.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || InertJson(writer.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        for lines in [text.text(), json.text()] {
            assert_eq!(lines.matches('\n').count(), 3, "{lines}");
            assert!(!lines.contains(SECRET), "{lines}");
            assert!(!lines.contains("quoted"), "{lines}");
            assert!(!lines.contains("0ther-pass"), "{lines}");
            assert!(lines.contains("***"), "{lines}");
        }
    }

    /// A URL whose password is followed by a quote, as a driver's error may quote it: in a JSON line the quote is
    /// escaped (`\"`), and masking the written line took the escape into the password it replaced, leaving a quote
    /// that ended the string: the line was no longer JSON. It is masked value by value then, and stays JSON.
    #[test]
    fn a_masked_json_line_stays_json_when_a_password_runs_into_a_quote() {
        let log = || {
            tracing::warn!(
                error =
                    "cannot connect to \"postgres://app@db/orders?password=Pw-in-url\": refused",
                "could not connect to postgres://app:Other-pw@db/orders"
            );
        };
        let json = Captured::default();
        let writer = json.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || InertJson(writer.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let lines = json.text();
        assert_eq!(lines.matches('\n').count(), 1, "{lines}");
        let line: serde_json::Value = serde_json::from_str(lines.trim())
            .unwrap_or_else(|e| panic!("not JSON ({e}): {lines}"));
        assert!(
            !lines.contains("Pw-in-url") && !lines.contains("Other-pw"),
            "{lines}"
        );
        assert!(line["error"].as_str().unwrap().contains("***"), "{line}");
    }
}
