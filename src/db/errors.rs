//! What PostgreSQL's errors mean: which are the moment's (the server gone, a connection lost or silent, a deadlock)
//! rather than the statement's, what a person is told, and the one place they become inboxctl's own.

use std::time::Duration;

use super::{ACQUIRE_TIMEOUT, Database, pooler};
use crate::error::Error;

/// The error of a unit of work that PostgreSQL did not answer within `limit` (its connection died without a word, or
/// the server hangs): transient, like any lost connection, so the work is tried again and never counted against its
/// message.
pub fn no_answer(limit: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "PostgreSQL did not answer within {}; the connection is dropped",
            humantime::format_duration(limit)
        ),
    ))
}

/// How the claim's refusal begins when the partitions ahead ran out and no partition holds the present: the
/// database's state, held like an outage ([`no_partition_for_now`]).
const NO_PARTITION_FOR_NOW: &str = "no partition of inbox_messages holds the current time";

/// The error a claim gives when no partition holds the present (`detail`: the server's refusal): every message of now
/// would be refused, so it is held as in an outage. Not the connection's fault: the session is kept.
pub fn no_partition_for_now(detail: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "{NO_PARTITION_FOR_NOW} (the partitions ahead ran out: `inboxctl cleanup`, run as the table's owner, makes \
         them); holding the messages until one does: {detail}"
    ))
}

/// Whether `error` is [`no_partition_for_now`]'s.
pub fn is_no_partition_for_now(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Protocol(m) if m.starts_with(NO_PARTITION_FOR_NOW))
}

/// Whether `error` is [`no_answer`]'s: the statements ran past the bound they were given (`--attempt-timeout`), the
/// connection dropped — a work slow or stuck as much as a server gone silent.
pub fn is_no_answer(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut)
}

/// The one place PostgreSQL's errors become inboxctl's (the policy is in [`Error`]): a server that cannot be reached,
/// a database that does not exist, a refused login, a missing privilege or table each say what to do. `db` is what
/// the command was pointed at, when known, for the message. Anything else stays [`Error::Database`].
pub fn diagnose(error: sqlx::Error, db: Option<&Database>) -> Error {
    let url = || db.map_or_else(String::new, Database::display_url);
    let reason = describe(&error);
    if let sqlx::Error::Database(e) = &error
        && !pooler::active()
        && pooler::is_pooler_error(&error)
    {
        return Error::PoolerNotDeclared {
            url: url(),
            reason: e.message().to_owned(),
        };
    }
    match sqlstate(&error).as_deref() {
        Some("3D000") => Error::DatabaseMissing {
            database: db.map_or_else(|| quoted_name(&reason), Database::name),
            url: url(),
        },
        Some("28P01" | "28000") => Error::DatabaseLoginRefused {
            url: url(),
            role: db.map_or_else(String::new, |d| d.options().get_username().to_owned()),
            reason,
        },
        Some("42501") => Error::PrivilegeRefused {
            service: "PostgreSQL",
            reason,
            fix: "grant the role what the command needs (docs/security.md lists it per command)"
                .to_owned(),
        },
        Some("42P01") => Error::SchemaMissing {
            database: db.map(Database::name),
            // `relation "inboxctl_events" does not exist`: the name, bounded and shown inert.
            table: reason.split('"').nth(1).map(|t| {
                crate::sanitize::text(&t.chars().take(128).collect::<String>()).into_owned()
            }),
        },
        // Met connecting (`db` known): whatever the server said, it could not be used.
        _ if db.is_some()
            && (is_transient(&error) || matches!(error, sqlx::Error::Database(_))) =>
        {
            Error::DatabaseUnavailable { url: url(), reason }
        }
        _ => Error::Database(error),
    }
}

/// What went wrong, for a person: the server's message (with its detail), never its internal source line (which
/// sqlx's own display of a server error appends as `at line N`).
pub fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(e) => {
            let mut text = e.message().to_owned();
            if let Some(detail) = e
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|pg| pg.detail())
            {
                text.push_str(" (");
                text.push_str(detail);
                text.push(')');
            }
            if !pooler::active() && pooler::is_pooler_error(error) {
                text.push_str(POOLER_HINT);
            }
            text
        }
        // Said as it is, without the driver's "encountered unexpected or invalid data" before it.
        sqlx::Error::Protocol(m) if is_no_partition_for_now(error) => m.clone(),
        sqlx::Error::PoolTimedOut => format!(
            "no connection within {} (the server does not answer, or takes no more connections)",
            humantime::format_duration(ACQUIRE_TIMEOUT)
        ),
        other => other.to_string(),
    }
}

/// What a pooler's error means, said after it where it is not turned into [`Error::PoolerNotDeclared`] (a consumer's
/// log lines).
const POOLER_HINT: &str = " (a connection pooler in transaction mode between inboxctl and PostgreSQL, such as \
                           PgBouncer? give --transaction-pooling: docs/scaling.md, PgBouncer)";

/// The first double-quoted name in a server message (`database "x" does not exist`).
fn quoted_name(message: &str) -> String {
    message
        .split('"')
        .nth(1)
        .map_or_else(|| "?".to_owned(), str::to_owned)
}

/// Whether an error is the infrastructure's (the server gone, the connection lost, the pool empty, a deadlock or a
/// serialization failure, a lock wait timed out, the database read-only) rather than the statement's. Such an error
/// never counts against a message: the work is retried, however long it takes.
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => true,
        // A pooler's doing (see `pooler`): not the statement's, and never a message's.
        sqlx::Error::Database(_) if pooler::is_pooler_error(error) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| is_transient_sqlstate(&code)),
        _ => false,
    }
}

/// Whether the database answered that the statement met another transaction — a lock held past the wait allowed
/// (`lock_timeout`: `--claim-timeout`), a deadlock, a serialization failure — or ran past the server's own
/// `statement_timeout` (57014, set on the role or the database as managed services often do: a claim waiting on a
/// key held elsewhere meets it before `--claim-timeout` when it is the shorter). The moment's doing, so tried again,
/// like an outage; but the database is up, and only what that statement touched is held up.
pub fn is_contention(error: &sqlx::Error) -> bool {
    matches!(
        sqlstate(error).as_deref(),
        Some("40001" | "40P01" | "55P03" | "57014")
    )
}

/// SQLSTATEs that describe the server or the moment, not the statement.
fn is_transient_sqlstate(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("53") // insufficient resources (too many connections, disk full, out of memory)
        || code.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
        || matches!(
            code,
            "40001" // serialization failure
                | "40P01" // deadlock detected
                | "55P03" // lock not available (lock_timeout)
                | "25P03" // idle_in_transaction_session_timeout: the session was silent, not the statement wrong
                | "25006" // read-only transaction (a replica, or default_transaction_read_only)
                | "3D000" // database does not exist (dropped under us)
                | "28000" // invalid authorization (the role lost its login)
                | "28P01" // invalid password
        )
}

/// Whether `error` is a pooler ending the session for a transaction left idle past its limit: PgBouncer's
/// `idle_transaction_timeout` ("idle transaction timeout", SQLSTATE 08P01). Met by a work that waits on the outside
/// world inside its transaction, it is that work's slowness, not the database gone.
pub fn is_poolers_idle_limit(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.message() == "idle transaction timeout"
            && db.code().is_some_and(|c| c.starts_with("08")))
}

/// The SQLSTATE of a database error, if it is one.
pub fn sqlstate(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_transient_and_statement_errors_are_not() {
        assert!(is_transient(&sqlx::Error::PoolTimedOut));
        assert!(is_transient(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset
        ))));
        assert!(!is_transient(&sqlx::Error::RowNotFound));
        for code in [
            "08006", "57P01", "53300", "40001", "40P01", "55P03", "25P03", "25006",
        ] {
            assert!(is_transient_sqlstate(code), "{code}");
        }
        for code in ["23505", "22P02", "42703", "23502"] {
            assert!(!is_transient_sqlstate(code), "{code}");
        }
    }
}
