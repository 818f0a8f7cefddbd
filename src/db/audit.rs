//! The audit of operator actions (`inboxctl_audit`): one row per action that changed state.

use chrono::{DateTime, Utc};

use super::{Exec, sql};

statements! {
    /// One action. `$1` command, `$2` OS user, `$3` host, `$4` command line (masked), `$5` outcome, `$6` exit code,
    /// `$7` details (JSON text). The role is the statement's own `current_user`.
    const INSERT_AUDIT = "\
INSERT INTO inboxctl_audit (command, os_user, host, command_line, outcome, exit_code, details)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)";

    /// The actions of the last `$1` seconds, oldest first, at most `$2`; `$3` only this command (null: all).
    const LIST_AUDIT = "\
SELECT occurred_at, command, database_role, os_user, host, command_line, outcome, exit_code, details::text
FROM inboxctl_audit
WHERE occurred_at >= now() - make_interval(secs => $1) AND ($3::text IS NULL OR command = $3)
ORDER BY occurred_at DESC, id DESC
LIMIT $2";

    /// The last `$2` actions that name consumer_type `$1` (`top`'s detail view), newest first.
    const LIST_AUDIT_FOR = "\
SELECT occurred_at, command, database_role, os_user, host, command_line, outcome, exit_code, details::text
FROM inboxctl_audit
WHERE occurred_at >= now() - interval '90 days'
  AND (details->>'consumer_type' = $1 OR details->'consumer_types' ? $1)
ORDER BY occurred_at DESC, id DESC
LIMIT $2";

    /// One batch of the audit's own cleanup: at most `$2` rows older than `$1`.
    const DELETE_AUDIT_BATCH = "\
DELETE FROM inboxctl_audit WHERE id = ANY (ARRAY (
    SELECT id FROM inboxctl_audit WHERE occurred_at < $1 ORDER BY occurred_at LIMIT $2))";
}

/// One action, as written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub occurred_at: DateTime<Utc>,
    pub command: String,
    pub database_role: String,
    pub os_user: Option<String>,
    pub host: Option<String>,
    pub command_line: String,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub details: serde_json::Value,
}

/// What is written for one action.
#[derive(Debug, Clone)]
pub struct NewRow<'a> {
    pub command: &'a str,
    pub os_user: Option<&'a str>,
    pub host: Option<&'a str>,
    pub command_line: &'a str,
    pub outcome: &'a str,
    pub exit_code: Option<i32>,
    pub details: &'a str,
}

/// Writes one action (`INSERT_AUDIT`).
pub async fn insert(executor: impl Into<Exec<'_>>, row: &NewRow<'_>) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(INSERT_AUDIT)
        .bind(row.command)
        .bind(row.os_user)
        .bind(row.host)
        .bind(row.command_line)
        .bind(row.outcome)
        .bind(row.exit_code)
        .bind(row.details)
        .execute(conn))
    .map(drop)
}

type Raw = (
    DateTime<Utc>,
    String,
    String,
    Option<String>,
    Option<String>,
    String,
    String,
    Option<i32>,
    String,
);

fn row(raw: Raw) -> Row {
    let (
        occurred_at,
        command,
        database_role,
        os_user,
        host,
        command_line,
        outcome,
        exit_code,
        details,
    ) = raw;
    Row {
        occurred_at,
        command,
        database_role,
        os_user,
        host,
        command_line,
        outcome,
        exit_code,
        details: serde_json::from_str(&details).unwrap_or(serde_json::Value::Null),
    }
}

/// The actions of the last `since`, newest first, at most `limit` (`LIST_AUDIT`).
pub async fn list(
    executor: impl Into<Exec<'_>>,
    since: std::time::Duration,
    command: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<Row>> {
    let rows: Vec<Raw> = unit!(executor, |conn| sql::query_as(LIST_AUDIT)
        .bind(since.as_secs_f64())
        .bind(limit)
        .bind(command)
        .fetch_all(conn))?;
    Ok(rows.into_iter().map(row).collect())
}

/// The last `limit` actions naming `consumer_type`, newest first (`LIST_AUDIT_FOR`).
pub async fn list_for(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    limit: i64,
) -> sqlx::Result<Vec<Row>> {
    let rows: Vec<Raw> = unit!(executor, |conn| sql::query_as(LIST_AUDIT_FOR)
        .bind(consumer_type)
        .bind(limit)
        .fetch_all(conn))?;
    Ok(rows.into_iter().map(row).collect())
}

/// Deletes at most `limit` audit rows older than `cutoff`; returns how many (`DELETE_AUDIT_BATCH`).
pub async fn delete_batch(
    executor: impl Into<Exec<'_>>,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<u64> {
    Ok(unit!(executor, |conn| sql::query(DELETE_AUDIT_BATCH)
        .bind(cutoff)
        .bind(limit)
        .execute(conn))?
    .rows_affected())
}
