//! The audit of operator actions: who changed what, when, from where, and what came of it (`inboxctl_audit`).
//!
//! An action's row is written in a statement of its own, after the action (a consumer's also at its start), never in
//! the action's own transaction: when it cannot be written (the database gone, no privilege, a database from before
//! the table), the action's work stands and the command says on stderr that it was not audited.

use serde_json::{Value, json};
use sqlx::postgres::PgPool;

use crate::db;
use crate::error::{Error, Outcome, Result};

/// The longest command line kept.
const MAX_COMMAND_LINE: usize = 4096;

/// One action to record.
#[derive(Debug, Clone)]
pub struct Entry {
    pub command: &'static str,
    pub outcome: &'static str,
    pub exit_code: Option<i32>,
    pub details: Value,
}

impl Entry {
    /// An action that has ended with `result`; its details are `details`, with the error's text added if it failed.
    pub fn ended<T>(
        command: &'static str,
        result: &Result<T>,
        outcome: impl Fn(&T) -> Outcome,
        mut details: Value,
    ) -> Self {
        let (outcome, exit_code) = match result {
            Ok(done) => match outcome(done) {
                Outcome::Done => ("done", 0),
                Outcome::Partial => ("partial", i32::from(crate::error::exit::PARTIAL)),
            },
            Err(e) => {
                if let Value::Object(map) = &mut details {
                    map.insert(
                        "error".to_owned(),
                        json!(crate::redact::text(&e.to_string())),
                    );
                }
                ("failed", i32::from(e.exit_code()))
            }
        };
        Self {
            command,
            outcome,
            exit_code: Some(exit_code),
            details,
        }
    }
}

/// Writes `entry`; a failure is logged (a warning on stderr) and returned as `false`, never as an error: the action
/// it records is done either way.
pub async fn record(pool: &PgPool, entry: &Entry) -> bool {
    try_record(pool, entry).await.is_ok()
}

/// [`record`], with why the row was not written (its passwords masked), for a caller that shows it where it shows
/// the action's outcome (`top`, which has no log); logged all the same.
pub async fn try_record(pool: &PgPool, entry: &Entry) -> std::result::Result<(), String> {
    // `args_os`: a path given as bytes that are not UTF-8 (`--listing`, `--output`) is the operator's to give;
    // `args` would panic on it, after the action it records was done.
    let command_line = command_line(std::env::args_os().map(|a| a.to_string_lossy().into_owned()));
    let details = storable(&entry.details).to_string();
    let (user, host) = (os_user(), host());
    let row = db::audit::NewRow {
        command: entry.command,
        os_user: user.as_deref(),
        host: host.as_deref(),
        command_line: &command_line,
        outcome: entry.outcome,
        exit_code: entry.exit_code,
        details: &details,
    };
    match db::audit::insert(pool, &row).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let why = Error::from(e).to_string();
            not_audited(entry, &why);
            Err(crate::redact::text(&why))
        }
    }
}

/// `details` as `jsonb` can hold it: a NUL character in a string or a key (a message id read from a message, in a
/// replay's or a cleanup's details) written as U+FFFD — `jsonb` refuses `\u0000`, and the row would be lost.
fn storable(details: &serde_json::Value) -> std::borrow::Cow<'_, serde_json::Value> {
    use serde_json::Value;
    if !details.to_string().contains("\\u0000") {
        return std::borrow::Cow::Borrowed(details);
    }
    let fix = |s: &str| crate::db::sql::storable(s).into_owned();
    let mut out = details.clone();
    let mut stack = vec![&mut out];
    while let Some(value) = stack.pop() {
        match value {
            Value::String(s) => *s = fix(s),
            Value::Array(items) => stack.extend(items.iter_mut()),
            Value::Object(map) => {
                let fields = std::mem::take(map);
                map.extend(fields.into_iter().map(|(k, v)| (fix(&k), v)));
                stack.extend(map.values_mut());
            }
            _ => {}
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Says on stderr that `entry` could not be written, and why; always `false`.
fn not_audited(entry: &Entry, why: &str) -> bool {
    tracing::warn!(
        command = entry.command,
        outcome = entry.outcome,
        "this action was not written to the audit (inboxctl_audit): {}; its work stands",
        crate::redact::text(why)
    );
    false
}

/// Writes `entry` over a connection of its own to `database` (for commands that hold no pool of their own, or whose
/// pool is gone); like [`record`], a failure is a warning and `false`.
pub async fn record_in(database: &crate::db::Database, entry: &Entry) -> bool {
    match database.pool(1).await {
        Ok(pool) => {
            let written = record(&pool, entry).await;
            pool.close().await;
            written
        }
        Err(e) => not_audited(entry, &e.to_string()),
    }
}

/// [`record_in`], given up after `limit` (a warning, `false`): for a process on its way out, which must not wait
/// long on a database that is slow or gone.
pub async fn record_within(
    database: &crate::db::Database,
    entry: &Entry,
    limit: std::time::Duration,
) -> bool {
    match tokio::time::timeout(limit, record_in(database, entry)).await {
        Ok(written) => written,
        Err(_) => not_audited(
            entry,
            &format!("not done within {}", humantime::format_duration(limit)),
        ),
    }
}

/// The command line as the audit keeps it: every URL's password masked, every password inboxctl was given removed,
/// cut to a bound.
pub fn command_line(args: impl Iterator<Item = String>) -> String {
    let masked: Vec<String> = args
        .map(|arg| {
            let (flag, value) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => {
                    (Some(flag.to_owned()), value.to_owned())
                }
                _ => (None, arg),
            };
            let value = if value.contains("://") {
                crate::redact::url(&value)
            } else {
                value
            };
            let value = crate::redact::text(&value);
            match flag {
                Some(flag) => format!("{flag}={value}"),
                None => value,
            }
        })
        .collect();
    crate::amqp::limits::truncate(&masked.join(" "), MAX_COMMAND_LINE).into_owned()
}

/// The operating system's user the command runs as.
fn os_user() -> Option<String> {
    ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
        .or_else(|| {
            let status = std::fs::read_to_string("/proc/self/status").ok()?;
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            Some(format!("uid {}", uid.split_whitespace().next()?))
        })
        .map(|u| crate::amqp::limits::truncate(&u, 256).into_owned())
}

/// The machine's name.
fn host() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|h| h.trim().to_owned())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|h| !h.is_empty())
        .map(|h| crate::amqp::limits::truncate(&h, 256).into_owned())
}

/// A row's details in a few words, for a table: the counts and names it holds, the error last.
pub fn summary(details: &Value) -> String {
    let Value::Object(map) = details else {
        return String::new();
    };
    let mut parts = Vec::new();
    for (key, value) in map {
        if key == "error" {
            continue;
        }
        match value {
            Value::Null => {}
            Value::Array(a) if a.is_empty() => {}
            Value::String(s) => parts.push(format!("{key} {s}")),
            other => parts.push(format!("{key} {other}")),
        }
    }
    if let Some(Value::String(e)) = map.get("error") {
        parts.push(format!("error: {e}"));
    }
    crate::amqp::limits::truncate(&parts.join(", "), 400).into_owned()
}

/// The audit's rows of the last `since`, newest first.
pub async fn list(
    pool: &PgPool,
    database: &crate::db::Database,
    since: std::time::Duration,
    command: Option<&str>,
    limit: i64,
) -> Result<Vec<db::audit::Row>> {
    crate::db::schema::require_tables(pool, database, &["inboxctl_audit"]).await?;
    Ok(db::audit::list(pool, since, command, limit).await?)
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_nul_in_the_details_is_stored_as_a_replacement_character() {
        let details = serde_json::json!({"gone": ["m\u{0}1"], "k\u{0}": {"id": "x"}, "n": 3});
        let stored = storable(&details).to_string();
        assert!(!stored.contains("\\u0000"), "{stored}");
        assert_eq!(
            stored,
            serde_json::json!({"gone": ["m\u{FFFD}1"], "k\u{FFFD}": {"id": "x"}, "n": 3})
                .to_string()
        );
        let plain = serde_json::json!({"id": "x"});
        assert!(matches!(storable(&plain), std::borrow::Cow::Borrowed(_)));
    }
    use super::*;

    #[test]
    fn passwords_in_the_command_line_are_masked() {
        let line = command_line(
            [
                "inboxctl",
                "--database-url=postgres://ops:s3cr3t-pw@db/x",
                "--amqp-url",
                "amqp://guest:hunter22@mq:5672/%2f",
                "replay",
            ]
            .into_iter()
            .map(str::to_owned),
        );
        assert!(!line.contains("s3cr3t-pw"), "{line}");
        assert!(!line.contains("hunter22"), "{line}");
        assert!(
            line.contains("--database-url=postgres://ops:***@db/x"),
            "{line}"
        );
        assert!(line.ends_with(" replay"), "{line}");
    }
}
