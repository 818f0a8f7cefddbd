//! The library's error type and the process exit codes it maps to.

use std::process::ExitCode;

/// Exit codes, documented in docs/commands.md. They follow sysexits(3) where one fits.
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// Failed for a reason not listed below.
    pub const FAILURE: u8 = 1;
    /// Part of the work was done and part was not (interrupted, or some items left behind).
    pub const PARTIAL: u8 = 3;
    /// A bad flag, value or combination of them.
    pub const USAGE: u8 = 64;
    /// What the command was pointed at does not exist (a queue to replay from).
    pub const NO_INPUT: u8 = 66;
    /// PostgreSQL or RabbitMQ could not be reached.
    pub const UNAVAILABLE: u8 = 69;
    /// A login was refused, or the role or user lacks privileges the command needs.
    pub const NO_PERMISSION: u8 = 77;
    /// What the command was pointed at is not set up: the database, its schema or the vhost is missing, or the schema
    /// is incompatible.
    pub const CONFIG: u8 = 78;
}

/// The library's errors. Those a user can fix name the fix: the policy is here (each kind, its exit code and the
/// words that say what to do); the drivers' errors become these in one place each, `db::diagnose` for PostgreSQL's
/// and `amqp::diagnose` for RabbitMQ's. No message carries a server's internal detail (PostgreSQL's source line)
/// or a password.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),

    /// The server could not be reached (exit 69).
    #[error("cannot connect to PostgreSQL at {url}: {reason}\n  {}", start_hint("PostgreSQL", .url))]
    DatabaseUnavailable { url: String, reason: String },

    /// The server answers, but the database is not there (exit 78).
    #[error(
        "database {database:?} does not exist at {url}: run `inboxctl migrate`, which creates it and the inbox schema"
    )]
    DatabaseMissing { database: String, url: String },

    /// The server refused the role's login: a wrong password, or `pg_hba.conf` (exit 77).
    #[error(
        "PostgreSQL at {url} refused the login of role {role:?}: {reason}\n  check the password (in the URL, \
         --database-password-file, PGPASSWORD or ~/.pgpass) and the server's pg_hba.conf"
    )]
    DatabaseLoginRefused {
        url: String,
        role: String,
        reason: String,
    },

    #[error("cannot connect to RabbitMQ at {url}: {reason}\n  {}", start_hint("RabbitMQ", .url))]
    BrokerUnavailable { url: String, reason: String },

    /// RabbitMQ did not answer a call within `--broker-timeout`: its connection counts as lost.
    #[error(
        "RabbitMQ did not answer {what} within {} (--broker-timeout): the connection is given up",
        humantime::format_duration(*.within)
    )]
    BrokerSilent {
        what: &'static str,
        within: std::time::Duration,
    },

    /// The broker refused the user's login (exit 77).
    #[error(
        "RabbitMQ at {url} refused the login of user {user:?}: {reason}\n  check the password (in the URL or \
         --amqp-password-file); `rabbitmqctl authenticate_user {user} <password>` tells whether it is the right one"
    )]
    BrokerLoginRefused {
        url: String,
        user: String,
        reason: String,
    },

    /// The broker has no such vhost (exit 78).
    #[error(
        "RabbitMQ at {url} has no vhost {vhost:?}: create it with `rabbitmqctl add_vhost {vhost}` and let the user \
         in with `rabbitmqctl set_permissions -p {vhost} {user} '.*' '.*' '.*'` (or the narrower grants of \
         docs/security.md), or point --amqp-url at another"
    )]
    VhostMissing {
        url: String,
        vhost: String,
        user: String,
    },

    /// A server refused an operation for want of a privilege (exit 77).
    #[error("{service} refused: {reason}\n  {fix}")]
    PrivilegeRefused {
        service: &'static str,
        reason: String,
        fix: String,
    },

    #[error(
        "inbox_messages has no index {index} (a table made before `inboxctl migrate`, or a build interrupted): run \
         `inboxctl migrate`, which builds it without blocking writes; without it every refresh would read the whole \
         table"
    )]
    IndexMissing { index: &'static str },

    #[error(
        "table {} does not exist in {}: run `inboxctl migrate` first",
        .table.as_deref().unwrap_or("inbox_messages"),
        .database.as_deref().map_or_else(|| "this database".to_owned(), |d| format!("database {d:?}"))
    )]
    SchemaMissing {
        database: Option<String>,
        /// The table the server named (none: `inbox_messages`).
        table: Option<String>,
    },

    #[error(
        "inbox_messages in database {database:?} is not compatible with inboxctl; nothing was changed:\n{}",
        .differences.iter().map(|d| format!("  - {d}")).collect::<Vec<_>>().join("\n")
    )]
    SchemaIncompatible {
        database: String,
        differences: Vec<String>,
    },

    #[error(
        "the PostgreSQL role {role:?} lacks privileges that {command} needs: {}; grant them (docs/security.md \
         lists what each command needs)",
        .missing.join("; ")
    )]
    PermissionMissing {
        role: String,
        command: &'static str,
        missing: Vec<String>,
    },

    /// PostgreSQL is reached through a connection pooler (PgBouncer) that refuses what inboxctl sends without
    /// `--transaction-pooling`, or shares sessions out transaction by transaction, and inboxctl was not told (exit 78).
    #[error(
        "PostgreSQL{} is reached through a connection pooler (PgBouncer?) that inboxctl was not told about: \
         {reason}\n  give --transaction-pooling (or INBOXCTL_TRANSACTION_POOLING=true) to every inboxctl command that \
         connects through it (it works in session pooling too), and run `inboxctl migrate` against PostgreSQL itself \
         (docs/scaling.md, PgBouncer)",
        if .url.is_empty() { String::new() } else { format!(" at {}", .url) }
    )]
    PoolerNotDeclared { url: String, reason: String },

    #[error("PostgreSQL: {}", crate::db::describe(.0))]
    Database(sqlx::Error),

    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    #[error("RabbitMQ: {0}{fix}", fix = .0.fix().map(|f| format!("\n  {f}")).unwrap_or_default())]
    Broker(#[from] crate::amqp::BrokerError),

    #[error("RabbitMQ: {0}")]
    Topology(String),

    /// The broker's topology is not what the command needs, and cannot be made so without someone deciding (an
    /// entity declared otherwise, a plugin not enabled).
    #[error("RabbitMQ: {0}")]
    TopologyConflict(String),

    #[error("queue {0:?} does not exist in this vhost")]
    QueueNotFound(String),

    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A PostgreSQL error met anywhere, as the policy sees it (see [`crate::db::diagnose`]).
impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        crate::db::diagnose(error, None)
    }
}

/// What to do about a server that cannot be reached: on this machine, the script that starts (or installs) both;
/// elsewhere, whether it runs and can be reached.
fn start_hint(service: &str, url: &str) -> String {
    let host = url::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default();
    let local = host.is_empty()
        || host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if local {
        format!(
            "is {service} running on this machine? `scripts/services.sh`, in inboxctl's source folder, starts \
             PostgreSQL and RabbitMQ (and, as root on Debian or Ubuntu, installs them first)"
        )
    } else {
        format!("is {service} running at {host}, and can this machine reach it?")
    }
}

impl Error {
    /// The error as a loop that retries says it each time (a consumer reconnecting, `cleanup --every`): a server that
    /// cannot be reached without the hint on how to start one, which, said again every few seconds with its line
    /// break escaped, was noise. Every other error as it is: a refused login's or a grant's fix is said nowhere else
    /// while the loop goes on.
    pub fn for_a_retry(&self) -> String {
        let said = self.to_string();
        match self {
            Error::DatabaseUnavailable { .. } | Error::BrokerUnavailable { .. } => said
                .split_once('\n')
                .map_or_else(|| said.clone(), |(first, _)| first.to_owned()),
            _ => said,
        }
    }

    /// The exit code a process ending with this error returns.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => exit::USAGE,
            Error::QueueNotFound(_) => exit::NO_INPUT,
            Error::DatabaseUnavailable { .. }
            | Error::BrokerUnavailable { .. }
            | Error::BrokerSilent { .. } => exit::UNAVAILABLE,
            Error::DatabaseMissing { .. }
            | Error::VhostMissing { .. }
            | Error::SchemaMissing { .. }
            | Error::IndexMissing { .. }
            | Error::SchemaIncompatible { .. }
            | Error::TopologyConflict(_)
            | Error::PoolerNotDeclared { .. } => exit::CONFIG,
            Error::PermissionMissing { .. }
            | Error::PrivilegeRefused { .. }
            | Error::DatabaseLoginRefused { .. }
            | Error::BrokerLoginRefused { .. } => exit::NO_PERMISSION,
            Error::Database(e) if crate::db::is_transient(e) => exit::UNAVAILABLE,
            Error::Broker(e) if e.is_io_error() => exit::UNAVAILABLE,
            Error::Broker(e) if e.is_access_refused() => exit::NO_PERMISSION,
            Error::Database(_)
            | Error::Migrate(_)
            | Error::Broker(_)
            | Error::Topology(_)
            | Error::Io(_) => exit::FAILURE,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a command's `run` returns when it did not fail outright.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// Some of the work was left undone; the command has said what.
    Partial,
}

impl From<Outcome> for ExitCode {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Done => ExitCode::from(exit::OK),
            Outcome::Partial => ExitCode::from(exit::PARTIAL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_says_an_unreachable_server_without_the_hint_and_a_refusal_with_its_fix() {
        let e = Error::BrokerUnavailable {
            url: "amqp://***:***@127.0.0.1:5672/%2f".to_owned(),
            reason: "IO error: Connection refused (os error 111)".to_owned(),
        };
        assert!(e.to_string().contains("scripts/services.sh"), "{e}");
        assert_eq!(
            e.for_a_retry(),
            "cannot connect to RabbitMQ at amqp://***:***@127.0.0.1:5672/%2f: IO error: Connection refused (os error 111)"
        );
        let refused = Error::Usage("first line\n  and its fix".to_owned());
        assert_eq!(refused.for_a_retry(), refused.to_string());
    }
}
