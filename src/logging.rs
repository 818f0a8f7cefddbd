//! Logs: `tracing` to stderr, filtered by `RUST_LOG` or `-v`, as text or JSON lines. Colour only on a terminal and
//! never under `NO_COLOR`.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

use crate::cli::{GlobalOpts, LogFormat};

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
    // inboxctl reports the broker problems that matter itself.
    let mut default = match global.verbose {
        0 => "warn,lapin=off,inboxctl=info".to_owned(),
        1 => "warn,lapin=warn,inboxctl=debug".to_owned(),
        _ => "info,inboxctl=trace".to_owned(),
    };
    if quiet_consumers && global.verbose == 0 {
        default.push_str(",inboxctl::consumer=error");
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match global.log_format {
        LogFormat::Text => builder.with_ansi(use_colour()).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    crate::secret::warn_if_on_command_line(&global.connect);
}

/// Colour on stderr only when it is a terminal and `NO_COLOR` is unset or empty.
fn use_colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
