//! inboxctl: the operator's tool for the Inbox pattern on PostgreSQL + RabbitMQ.
//!
//! - [`inbox`]: the claim protocol, usable on its own by a Rust service;
//! - [`consumer`]: running a consumer on a RabbitMQ queue with it (retries, dead-lettering, outages);
//! - [`parcel`]: the Parcel Tracker's carrier and notification consumers;
//! - [`db`] and [`amqp`]: PostgreSQL (statements, schema) and RabbitMQ (topology, envelopes, dead-letter headers);
//! - [`cmd`]: one module per subcommand.

pub mod amqp;
pub mod audit;
pub mod backoff;
pub mod carrier_stub;
pub mod cleanup;
pub mod cli;
pub mod cmd;
pub mod consumer;
pub mod db;
pub mod demo;
pub mod effects;
pub mod error;
pub mod failpoint;
pub mod ids;
pub mod inbox;
pub mod logging;
pub mod metrics;
pub mod output;
pub mod panic_hook;
pub mod parcel;
pub mod producer;
pub mod recent;
pub mod redact;
pub mod replay;
pub mod sanitize;
pub mod secret;
pub mod shutdown;
pub mod stats;
pub mod table;
pub mod top;
pub mod triage;

pub use cli::Cli;
pub use error::{Error, Outcome, Result};

/// Runs a parsed command line to its end.
pub fn run(cli: Cli) -> Result<Outcome> {
    cli.global.connect.register_secrets();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let shutdown = shutdown::on_signals();
        cmd::run(cli.command, &cli.global, shutdown).await
    });
    // A command has returned: whatever its tasks still wait on (a statement stuck on a lock, a broker that does not
    // answer a close) must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// The most causes of an error told after it (in a log line, on stderr, in a dead-letter reason): an error type may
/// chain to itself (a `source()` that loops), and what tells it must end.
pub(crate) const MAX_CAUSES: usize = 32;

/// For the tests of what tells an error's causes: an error that is its own cause, told "a loop" at every step.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct LoopingError;

#[cfg(test)]
impl std::fmt::Display for LoopingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a loop")
    }
}

#[cfg(test)]
impl std::error::Error for LoopingError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self)
    }
}

/// Prints `error: …` and the causes the message does not already say, to stderr, without passwords or control
/// characters.
pub fn report(error: &Error) {
    use std::io::Write as _;
    let mut text = error.to_string();
    let mut causes = std::iter::successors(std::error::Error::source(error), |c| c.source());
    for cause in causes.by_ref().take(MAX_CAUSES) {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str("\n  caused by: ");
            text.push_str(&line);
        }
    }
    if causes.next().is_some() {
        text.push_str("\n  caused by: … (more causes not shown)");
    }
    if logging::json_lines() {
        // One more line of the JSON log; the causes on their lines of the message.
        let mut fields = serde_json::Map::new();
        fields.insert("exit_code".to_owned(), error.exit_code().into());
        logging::write_json_event("ERROR", &format!("error: {text}"), fields);
        return;
    }
    // A reader of stderr that went away (`2>&1 | head`) is no reason to panic: the exit code still says it.
    let _ = writeln!(
        std::io::stderr(),
        "error: {}",
        sanitize::multiline(&redact::text(&text))
    );
}
