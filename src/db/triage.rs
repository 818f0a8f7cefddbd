//! `find`'s statements: everything the database knows about one message id.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{Exec, sql};

/// The most events shown per message and consumer_type: a message redelivered in a loop can have thousands.
pub const MAX_EVENTS: i64 = 200;

/// The most events read for a message, all its consumer_types together: each one's newest first.
pub const MAX_EVENTS_IN_ALL: i64 = 2_000;

statements! {
    /// The message's inbox rows, per consumer_type. `$1` message id.
    const INBOX_ROWS_OF = "\
SELECT consumer_type::text, CASE WHEN isfinite(received_at) THEN received_at END,
       CASE WHEN isfinite(processed_at) THEN processed_at END, processed_at IS NOT NULL
FROM inbox_messages WHERE id = $1 ORDER BY consumer_type";

    /// Its newest `$2` events of each consumer_type, oldest first, at most `$3` in all (each consumer_type's newest
    /// before anyone's older ones): a message looping in one consumer_type does not hide what another did with it.
    /// `$1` message id.
    const EVENTS_OF = "\
SELECT consumer_type, kind, occurred_at, detail, newest FROM (
    SELECT consumer_type, kind, occurred_at, detail, newest FROM (
        SELECT consumer_type::text, kind, occurred_at, detail,
               row_number() OVER (PARTITION BY consumer_type ORDER BY occurred_at DESC, kind DESC) AS newest
        FROM inboxctl_events WHERE message_id = $1
    ) numbered WHERE newest <= $2 ORDER BY newest, occurred_at DESC LIMIT $3
) kept ORDER BY occurred_at, kind";

    /// Its poison-detection starts, per consumer_type. `$1` message id.
    const ATTEMPTS_OF = "\
SELECT consumer_type::text, started, alone, last_started_at FROM inboxctl_attempts
WHERE message_id = $1 ORDER BY consumer_type";

    /// Its effects in the Parcel Tracker's tables. `$1` message id.
    const EFFECTS_OF = "\
SELECT 'carrier_reservations', parcel_id, reserved_at FROM carrier_reservations WHERE message_id = $1
UNION ALL
SELECT 'notifications_sent', parcel_id, sent_at FROM notifications_sent WHERE message_id = $1
ORDER BY 3";

    /// A consumer_type's oldest unprocessed rows, through the partial index on unprocessed rows. `$1` consumer_type,
    /// `$2` how many.
    const OLDEST_UNPROCESSED = "\
SELECT id, CASE WHEN isfinite(received_at) THEN received_at END FROM inbox_messages
WHERE consumer_type = $1 AND processed_at IS NULL ORDER BY received_at LIMIT $2";

    /// A consumer_type's latest failures (failed attempts, dead-lettered, skipped, conflicts), newest first. `$1`
    /// consumer_type, `$2` how many.
    const RECENT_FAILURES = "\
SELECT occurred_at, kind, detail, message_id FROM inboxctl_events
WHERE consumer_type = $1 AND kind IN ('failed', 'dead_lettered', 'skipped', 'conflict')
ORDER BY occurred_at DESC LIMIT $2";
}

/// A message's inbox row for one consumer_type.
#[derive(Debug, Clone, serde::Serialize)]
pub struct InboxRow {
    pub consumer_type: String,
    /// None: the table holds `-infinity` or `infinity` (.NET's `DateTime.MinValue`/`MaxValue` as Npgsql writes
    /// them), which no time here can hold.
    pub received_at: Option<DateTime<Utc>>,
    /// None: not processed, or processed at `±infinity` (`processed` says which).
    pub processed_at: Option<DateTime<Utc>>,
    pub processed: bool,
}

/// One of its events.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EventRow {
    pub consumer_type: String,
    pub kind: String,
    pub occurred_at: DateTime<Utc>,
    pub detail: Option<String>,
}

/// Its poison-detection starts for one consumer_type.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttemptsRow {
    pub consumer_type: String,
    pub started: i32,
    pub alone: i32,
    pub last_started_at: DateTime<Utc>,
}

/// One of its effects.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EffectRow {
    pub table: String,
    pub parcel_id: Uuid,
    pub at: DateTime<Utc>,
}

pub async fn inbox_rows(executor: impl Into<Exec<'_>>, id: Uuid) -> sqlx::Result<Vec<InboxRow>> {
    type Row = (String, Option<DateTime<Utc>>, Option<DateTime<Utc>>, bool);
    let rows: Vec<Row> = unit!(executor, |conn| sql::query_as(INBOX_ROWS_OF)
        .bind(id)
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(
            |(consumer_type, received_at, processed_at, processed)| InboxRow {
                consumer_type,
                received_at,
                processed_at,
                processed,
            },
        )
        .collect())
}

/// The message's newest [`MAX_EVENTS`] events of each consumer_type (at most [`MAX_EVENTS_IN_ALL`]), oldest first, and
/// whether any were left out.
pub async fn events(
    executor: impl Into<Exec<'_>>,
    id: Uuid,
) -> sqlx::Result<(Vec<EventRow>, bool)> {
    // consumer_type, kind, occurred_at, detail, and its rank among its consumer_type's events, newest first.
    type Ranked = (String, String, DateTime<Utc>, Option<String>, i64);
    let mut rows: Vec<Ranked> = unit!(executor, |conn| sql::query_as(EVENTS_OF)
        .bind(id)
        .bind(MAX_EVENTS + 1)
        .bind(MAX_EVENTS_IN_ALL + 1)
        .fetch_all(conn))?;
    // Each read one more than shown, to tell a cut: past the whole bound, the row read last (the highest rank of
    // its consumer_type, the oldest of those); past a consumer_type's, its rank past it.
    let mut cut = false;
    if rows.len() as i64 > MAX_EVENTS_IN_ALL
        && let Some(last) = rows
            .iter()
            .enumerate()
            .max_by_key(|(i, r)| (r.4, std::cmp::Reverse(*i)))
            .map(|(i, _)| i)
    {
        rows.remove(last);
        cut = true;
    }
    let before = rows.len();
    rows.retain(|r| r.4 <= MAX_EVENTS);
    cut |= rows.len() < before;
    let events = rows
        .into_iter()
        .map(|(consumer_type, kind, occurred_at, detail, _)| EventRow {
            consumer_type,
            kind,
            occurred_at,
            detail,
        })
        .collect();
    Ok((events, cut))
}

pub async fn attempts(executor: impl Into<Exec<'_>>, id: Uuid) -> sqlx::Result<Vec<AttemptsRow>> {
    let rows: Vec<(String, i32, i32, DateTime<Utc>)> =
        unit!(executor, |conn| sql::query_as(ATTEMPTS_OF)
            .bind(id)
            .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(
            |(consumer_type, started, alone, last_started_at)| AttemptsRow {
                consumer_type,
                started,
                alone,
                last_started_at,
            },
        )
        .collect())
}

pub async fn effects(executor: impl Into<Exec<'_>>, id: Uuid) -> sqlx::Result<Vec<EffectRow>> {
    let rows: Vec<(String, Uuid, DateTime<Utc>)> =
        unit!(executor, |conn| sql::query_as(EFFECTS_OF)
            .bind(id)
            .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(table, parcel_id, at)| EffectRow {
            table,
            parcel_id,
            at,
        })
        .collect())
}

/// A consumer_type's oldest unprocessed rows: (message id, received at; None for `±infinity`)
/// (`OLDEST_UNPROCESSED`).
pub async fn oldest_unprocessed(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    limit: i64,
) -> sqlx::Result<Vec<(Uuid, Option<DateTime<Utc>>)>> {
    unit!(executor, |conn| sql::query_as(OLDEST_UNPROCESSED)
        .bind(consumer_type)
        .bind(limit)
        .fetch_all(conn))
}

/// One of a consumer_type's latest failures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FailureRow {
    pub occurred_at: DateTime<Utc>,
    pub kind: String,
    pub detail: Option<String>,
    pub message_id: Option<Uuid>,
}

type RawFailure = (DateTime<Utc>, String, Option<String>, Option<Uuid>);

/// A consumer_type's latest failures, newest first (`RECENT_FAILURES`).
pub async fn recent_failures(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    limit: i64,
) -> sqlx::Result<Vec<FailureRow>> {
    let rows: Vec<RawFailure> = unit!(executor, |conn| sql::query_as(RECENT_FAILURES)
        .bind(consumer_type)
        .bind(limit)
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(occurred_at, kind, detail, message_id)| FailureRow {
            occurred_at,
            kind,
            detail,
            message_id,
        })
        .collect())
}
