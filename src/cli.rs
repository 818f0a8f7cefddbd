//! The command line: global options and the subcommands.

use clap::{Args, Parser, ValueEnum};

use crate::cmd::Command;

/// Loopback defaults that work on a developer machine with PostgreSQL and RabbitMQ installed from packages.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/parceltracker";
pub const DEFAULT_AMQP_URL: &str = "amqp://127.0.0.1:5672/%2f";

/// The operator's tool for the Inbox pattern on PostgreSQL + RabbitMQ: exactly-once consumers, the inbox schema,
/// cleanup, replay of dead-lettered messages, and a live view of duplicates and unprocessed rows.
#[derive(Debug, Parser)]
#[command(
    name = "inboxctl",
    version,
    propagate_version = true,
    max_term_width = 110
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalOpts,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
pub struct GlobalOpts {
    #[command(flatten)]
    pub connect: ConnectOpts,

    /// More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Log line format on stderr
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

/// Where PostgreSQL and RabbitMQ are. A password in either URL is never printed.
#[derive(Debug, Clone, Args)]
pub struct ConnectOpts {
    /// PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL,
        global = true
    )]
    pub database_url: String,

    /// RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f)
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = DEFAULT_AMQP_URL,
        global = true
    )]
    pub amqp_url: String,

    /// File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment
    #[arg(
        long,
        env = "DATABASE_PASSWORD_FILE",
        value_name = "PATH",
        global = true
    )]
    pub database_password_file: Option<std::path::PathBuf>,

    /// File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment
    #[arg(long, env = "AMQP_PASSWORD_FILE", value_name = "PATH", global = true)]
    pub amqp_password_file: Option<std::path::PathBuf>,

    /// CA certificate (PEM) that an amqps:// broker's certificate must chain to, instead of the system's roots
    #[arg(long, env = "AMQP_CA_FILE", value_name = "PATH", global = true)]
    pub amqp_ca_file: Option<std::path::PathBuf>,

    /// The URLs whose password was typed in the command line itself, where `ps` shows it to every user of the
    /// machine (found by [`parse`]; a URL from the environment is not among them).
    #[arg(skip)]
    pub passwords_in_arguments: Vec<UrlFlag>,
}

/// A URL flag, with the safer places its password can come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlFlag {
    pub flag: &'static str,
    pub env: &'static str,
    pub password_file: &'static str,
}

pub const DATABASE_URL: UrlFlag = UrlFlag {
    flag: "--database-url",
    env: "DATABASE_URL",
    password_file: "--database-password-file",
};

pub const AMQP_URL: UrlFlag = UrlFlag {
    flag: "--amqp-url",
    env: "AMQP_URL",
    password_file: "--amqp-password-file",
};

/// Parses the process's command line as [`Cli`], and notes which URLs were given a password in it.
pub fn parse() -> Result<Cli, clap::Error> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let matches = Cli::command().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut Cli::command()))?;
    let connect = &mut cli.global.connect;
    for (id, url, flag) in [
        ("database_url", &connect.database_url, DATABASE_URL),
        ("amqp_url", &connect.amqp_url, AMQP_URL),
    ] {
        if matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
            && crate::redact::has_password(url)
        {
            connect.passwords_in_arguments.push(flag);
        }
    }
    Ok(cli)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// A duration the humantime way (`90m`, `36h`, `7d`, `250ms`).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err("a duration cannot be negative".to_owned());
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{e} (expected e.g. 500ms, 90s, 15m, 36h, 7d)"))
}

/// A duration that must be longer than zero.
pub fn parse_positive_duration(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be longer than zero".to_owned());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("7d"),
            Ok(std::time::Duration::from_secs(7 * 86400))
        );
        assert_eq!(
            parse_duration("90m"),
            Ok(std::time::Duration::from_secs(5400))
        );
        assert!(parse_duration("-5m").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_positive_duration("0s").is_err());
    }
}
