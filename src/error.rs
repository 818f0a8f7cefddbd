//! The library's error type and the process exit codes it maps to.

use std::process::ExitCode;

/// Exit codes, documented in the README. They follow sysexits(3) where one fits.
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
    /// The role lacks privileges the command needs.
    pub const NO_PERMISSION: u8 = 77;
    /// The database is not in a state inboxctl can work with (schema missing or incompatible).
    pub const CONFIG: u8 = 78;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),

    #[error("cannot connect to PostgreSQL at {url}: {source}")]
    DatabaseUnavailable {
        url: String,
        #[source]
        source: sqlx::Error,
    },

    #[error("cannot connect to RabbitMQ at {url}: {reason}")]
    BrokerUnavailable { url: String, reason: String },

    #[error(
        "table inbox_messages does not exist in database {database:?}: run `inboxctl migrate` first"
    )]
    SchemaMissing { database: String },

    #[error(
        "inbox_messages in database {database:?} is not compatible with inboxctl; nothing was changed:\n{}",
        .differences.iter().map(|d| format!("  - {d}")).collect::<Vec<_>>().join("\n")
    )]
    SchemaIncompatible {
        database: String,
        differences: Vec<String>,
    },

    #[error(
        "the PostgreSQL role {role:?} lacks privileges that {command} needs: {}; see the README's security section",
        .missing.join("; ")
    )]
    PermissionMissing {
        role: String,
        command: &'static str,
        missing: Vec<String>,
    },

    #[error("PostgreSQL: {0}")]
    Database(#[from] sqlx::Error),

    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    #[error("RabbitMQ: {0}")]
    Broker(#[from] crate::amqp::BrokerError),

    #[error("RabbitMQ: {0}")]
    Topology(String),

    #[error("queue {0:?} does not exist in this vhost")]
    QueueNotFound(String),

    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The exit code a process ending with this error returns.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => exit::USAGE,
            Error::QueueNotFound(_) => exit::NO_INPUT,
            Error::DatabaseUnavailable { .. } | Error::BrokerUnavailable { .. } => {
                exit::UNAVAILABLE
            }
            Error::SchemaMissing { .. } | Error::SchemaIncompatible { .. } => exit::CONFIG,
            Error::PermissionMissing { .. } => exit::NO_PERMISSION,
            Error::Database(e) if crate::db::is_transient(e) => exit::UNAVAILABLE,
            Error::Broker(e) if e.is_io_error() => exit::UNAVAILABLE,
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
