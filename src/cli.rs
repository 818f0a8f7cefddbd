//! The command line: global options and the subcommands.

use clap::{Args, Parser, ValueEnum};

use crate::cmd::Command;

/// Loopback defaults that work on a developer machine with PostgreSQL and RabbitMQ installed from packages.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/parceltracker";
pub const DEFAULT_AMQP_URL: &str = "amqp://127.0.0.1:5672/%2f";

/// `inboxctl --version`: the version and the git commit it was built from (see `build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("INBOXCTL_COMMIT"),
    ")"
);

/// The operator's tool for the Inbox pattern on PostgreSQL + RabbitMQ: exactly-once consumers, the inbox schema,
/// cleanup, replay of dead-lettered messages, and a live view of duplicates and unprocessed rows.
#[derive(Debug, Parser)]
#[command(
    name = "inboxctl",
    version = VERSION,
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

    /// RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a
    /// cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = DEFAULT_AMQP_URL,
        global = true,
        action = clap::ArgAction::Append
    )]
    pub amqp_url: Vec<String>,

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

    /// CA certificate (PEM) an amqps:// broker's certificate may chain to, beside the system's roots (amqps:// only)
    #[arg(long, env = "AMQP_CA_FILE", value_name = "PATH", global = true)]
    pub amqp_ca_file: Option<std::path::PathBuf>,

    /// PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer's pool_mode = transaction):
    /// every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against
    /// PostgreSQL itself)
    #[arg(
        long,
        env = "INBOXCTL_TRANSACTION_POOLING",
        value_parser = clap::builder::BoolishValueParser::new(),
        global = true
    )]
    pub transaction_pooling: bool,

    /// The URLs whose password was typed in the command line itself, where `ps` shows it to every user of the
    /// machine (found by [`parse`]; a URL from the environment is not among them).
    #[arg(skip)]
    pub passwords_in_arguments: Vec<UrlFlag>,
}

impl ConnectOpts {
    /// The database of the command line: `--database-url`, with the password of `--database-password-file` if given.
    pub fn database(&self) -> crate::Result<crate::db::Database> {
        let db =
            crate::db::Database::new(&self.database_url, self.database_password_file.as_deref())?;
        Ok(db.with_transaction_pooling(self.transaction_pooling))
    }

    /// Notes which URLs were given a password in the command line itself (`matches`: the parsed command line).
    pub fn note_passwords_in_arguments(&mut self, matches: &clap::ArgMatches) {
        let amqp_urls = self.amqp_url.join(" ");
        for (id, url, flag) in [
            ("database_url", &self.database_url, DATABASE_URL),
            ("amqp_url", &amqp_urls, AMQP_URL),
        ] {
            if matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
                && crate::redact::has_password(url)
            {
                self.passwords_in_arguments.push(flag);
            }
        }
    }

    /// Registers the URLs' passwords for redaction, before anything can print them.
    pub fn register_secrets(&self) {
        crate::redact::register_url(&self.database_url);
        for url in &self.amqp_url {
            crate::redact::register_url(url);
        }
    }

    /// `--amqp-url` as one URL: given more than once, the host list of every node.
    pub fn amqp_url(&self) -> crate::Result<String> {
        crate::amqp::nodes::join(&self.amqp_url)
            .map_err(|e| crate::Error::Usage(format!("--amqp-url: {e}")))
    }

    /// The broker of the command line: `--amqp-url`, with `--amqp-ca-file` and `--amqp-password-file` if given.
    pub fn broker(&self) -> crate::Result<crate::amqp::Broker> {
        crate::amqp::Broker::new(&crate::amqp::BrokerOptions {
            url: self.amqp_url()?,
            ca_file: self.amqp_ca_file.clone(),
            password_file: self.amqp_password_file.clone(),
        })
    }
}

pub use crate::secret::{AMQP_URL, DATABASE_URL, UrlFlag};

/// Parses the process's command line as [`Cli`], and notes which URLs were given a password in it.
pub fn parse() -> Result<Cli, clap::Error> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let matches = Cli::command().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut Cli::command()))?;
    cli.global.connect.note_passwords_in_arguments(&matches);
    Ok(cli)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The longest duration any flag takes: 100 years (of 365.25 days). Far longer than any window or wait that means
/// something, and short enough that no clock, timer or PostgreSQL timestamp it is added to or taken from can
/// overflow (PostgreSQL's timestamps end in 4713 BC).
pub const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(100 * 31_557_600);

/// A duration the humantime way (`90m`, `36h`, `7d`, `250ms`), from zero to [`MAX_DURATION`].
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    duration_in(s, std::time::Duration::ZERO, MAX_DURATION)
}

/// A duration from `min` to `max`; the error names the range.
fn duration_in(
    s: &str,
    min: std::time::Duration,
    max: std::time::Duration,
) -> Result<std::time::Duration, String> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err("a duration cannot be negative".to_owned());
    }
    let range = || {
        if min.is_zero() {
            format!("at most {}", show(max))
        } else {
            format!("must be from {} to {}", show(min), show(max))
        }
    };
    let d = humantime::parse_duration(s).map_err(|e| match e {
        humantime::DurationError::NumberOverflow => range(),
        e => format!("{e} (expected e.g. 500ms, 90s, 15m, 36h, 7d)"),
    })?;
    if d < min || d > max {
        return Err(range());
    }
    Ok(d)
}

/// An HTTP URL that may carry a password (`--carrier-url`, `--lookup-url`): a bad one is refused without its
/// text (clap's own message quotes the value), and a good one's password is registered for masking.
#[derive(Clone, Copy, Debug)]
pub struct SecretUrl;

impl clap::builder::TypedValueParser for SecretUrl {
    type Value = url::Url;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<url::Url, clap::Error> {
        let name = arg
            .and_then(clap::Arg::get_long)
            .map_or_else(|| "the URL".to_owned(), |long| format!("--{long}"));
        let refuse = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for {name}: {why} (the value is not shown: it may hold a password)\n"),
            )
            .with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| refuse("not UTF-8".to_owned()))?;
        crate::redact::register_url(text);
        url::Url::parse(text).map_err(|e| refuse(e.to_string()))
    }
}

/// A duration that must be longer than zero (and at most [`MAX_DURATION`]).
pub fn parse_positive_duration(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be longer than zero".to_owned());
    }
    Ok(d)
}

/// A parser for a duration from `min` to `max`, for flags where a shorter or longer one means nothing or breaks
/// something further down; the error names the range.
pub fn duration_between(
    min: std::time::Duration,
    max: std::time::Duration,
) -> impl Fn(&str) -> Result<std::time::Duration, String> + Clone + Send + Sync + 'static {
    move |s: &str| duration_in(s, min, max)
}

/// A window that rates are averaged over: from one second (a shorter one has no rate worth the name, and its
/// per-bucket arithmetic overflows) to [`MAX_DURATION`].
pub fn parse_window(s: &str) -> Result<std::time::Duration, String> {
    duration_between(std::time::Duration::from_secs(1), MAX_DURATION)(s)
}

/// A lock wait (`consume --claim-timeout`), set as PostgreSQL's `lock_timeout`: at most what that setting holds
/// (2^31 − 1 ms, about 24 days), and at least 100ms, since a copy waits for the whole of another attempt's work and a
/// shorter wait turns every such overlap into an outage backoff.
pub fn parse_lock_timeout(s: &str) -> Result<std::time::Duration, String> {
    duration_between(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_millis(i32::MAX.unsigned_abs().into()),
    )(s)
}

/// A parser for a finite number from `min` to `max` (not NaN, not infinite); the error names the range.
pub fn number_between(
    min: f64,
    max: f64,
) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let n: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number"))?;
        if !(min..=max).contains(&n) {
            return Err(format!("must be a number from {min} to {max}"));
        }
        Ok(n)
    }
}

/// A fraction from 0 to 1 (`--duplicates`).
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(0.0..=1.0).contains(&f) {
        return Err("must be between 0 and 1".to_owned());
    }
    Ok(f)
}

/// The most parcels one run publishes: the producer holds each message until the broker confirmed it.
pub const MAX_COUNT: u64 = 1_000_000;

/// A rate in messages per second: one every 1000 s at the slowest; at the fastest a million a second, far above
/// what a broker confirms, and a tick still nanoseconds long (a faster one would round to zero).
pub fn parse_rate(s: &str) -> Result<f64, String> {
    number_between(0.001, 1_000_000.0)(s).map_err(|e| format!("{e} messages per second"))
}

/// A duration as the flags take it (`100years`, `1m`, `24days 20h 31m 23s 647ms`).
pub fn show(d: std::time::Duration) -> String {
    humantime::format_duration(d).to_string()
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

    #[test]
    fn durations_are_bounded_and_the_error_names_the_bound() {
        assert_eq!(parse_duration("100y"), Ok(MAX_DURATION));
        for huge in ["101y", "1000000y", "584542046090y", "99999999999999999999d"] {
            assert_eq!(
                parse_duration(huge),
                Err("at most 100years".to_owned()),
                "{huge}"
            );
        }
        assert!(parse_window("999ms").is_err());
        assert_eq!(parse_window("1s"), Ok(std::time::Duration::from_secs(1)));
        let between = duration_between(
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(60),
        );
        assert_eq!(between("1ns"), Err("must be from 100ms to 1m".to_owned()));
        assert_eq!(between("61s"), Err("must be from 100ms to 1m".to_owned()));
        assert_eq!(
            parse_window("1000000y"),
            Err("must be from 1s to 100years".to_owned())
        );
        assert!(between("100ms").is_ok());
    }

    #[test]
    fn numbers_are_finite_and_in_range() {
        let rate = number_between(0.001, 1_000_000.0);
        for bad in [
            "NaN", "inf", "-inf", "1e309", "1e10", "1e-20", "0", "-1", "x", "",
        ] {
            assert!(rate(bad).is_err(), "{bad}");
        }
        assert_eq!(rate("200"), Ok(200.0));
        assert_eq!(
            rate("1e10"),
            Err("must be a number from 0.001 to 1000000".to_owned())
        );
    }
}
