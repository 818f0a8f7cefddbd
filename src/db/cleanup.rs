//! The cleanup's statements: its cutoff, the consumer_types to clean, the counts of a dry run, the per-consumer_type
//! lock (of the session, or through a transaction pooler of each batch's transaction), and the batched deletes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;

use super::{Exec, sql};

statements! {
    /// The cleanup's cutoff, on the database's clock. `$1` retention in seconds.
    const CUTOFF = "SELECT now() - make_interval(secs => $1)";

    /// Every consumer_type with inbox rows, events or a registration. The inbox and the events are walked with a loose
    /// index scan (one index probe per distinct value), not a scan of every row.
    const CONSUMER_TYPES = "\
WITH RECURSIVE inbox AS (
    (SELECT consumer_type FROM inbox_messages ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT i.consumer_type FROM inbox_messages i
            WHERE i.consumer_type > inbox.consumer_type ORDER BY i.consumer_type LIMIT 1)
    FROM inbox WHERE inbox.consumer_type IS NOT NULL
), events AS (
    (SELECT consumer_type FROM inboxctl_events ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT e.consumer_type FROM inboxctl_events e
            WHERE e.consumer_type > events.consumer_type ORDER BY e.consumer_type LIMIT 1)
    FROM events WHERE events.consumer_type IS NOT NULL
)
SELECT consumer_type::text FROM inbox WHERE consumer_type IS NOT NULL
UNION SELECT consumer_type::text FROM events WHERE consumer_type IS NOT NULL
UNION SELECT consumer_type::text FROM inboxctl_consumers
ORDER BY 1";

    /// One cleanup batch: at most `$3` processed rows of consumer_type `$1` older than `$2`, found through
    /// `(consumer_type, processed_at)` and deleted by their tuple ids. Unprocessed rows (`processed_at IS NULL`) never
    /// match. No `FOR UPDATE SKIP LOCKED`: nothing else deletes these rows while a cleanup holds the consumer_type's
    /// `CLEANUP_TRY_LOCK`, and locking them first would write each row once more.
    /// The batch's fingerprints go with it, found through their key.
    /// The delete asks again what the batch asked: a tuple id names a row only within one table, and a cleanup that
    /// began on a plain inbox runs this statement on after `migrate --partitioned` converts it in place (the name
    /// then resolves to the partitioned table), where a tuple id matches a row in every partition — fresh ones
    /// among them, whose deletion would let their messages' next copies through as new.
    const DELETE_PROCESSED_BATCH = "\
WITH batch AS (
    SELECT ctid, id FROM inbox_messages
    WHERE consumer_type = $1 AND processed_at < $2
    LIMIT $3
), fingerprints AS (
    DELETE FROM inboxctl_fingerprints f USING batch WHERE f.consumer_type = $1 AND f.id = batch.id
)
DELETE FROM inbox_messages
WHERE ctid = ANY (ARRAY (SELECT ctid FROM batch)) AND consumer_type = $1 AND processed_at < $2";

    /// `DELETE_PROCESSED_BATCH` on a partitioned inbox, where a tuple id names a row only within its partition: the
    /// batch's rows are deleted by their key, each found in its partition through its key's time. The keys travel as
    /// two arrays unnested in the join, so that the planner probes the primary key once per row (a nested loop,
    /// pruned to one partition per probe); joined to the batch itself, it hashed every row of the consumer_type in
    /// every partition, 1.3 s a batch at 10M rows instead of 25 ms (measured by the bench's partition-drop run).
    /// Only rows whose message time is below `$4` (none: all): the untimed partition's and those of partitions kept
    /// whole; a partition that holds the cutoff is dropped whole once it is wholly past the window
    /// (`cleanup::partitions`), and freeing its rows one by one first would be work done twice.
    const DELETE_PROCESSED_BATCH_TIMED = "\
WITH batch AS (
    SELECT array_agg(id) AS ids, array_agg(message_time) AS times FROM (
        SELECT id, message_time FROM inbox_messages
        WHERE consumer_type = $1 AND processed_at < $2 AND ($4::timestamptz IS NULL OR message_time < $4)
        LIMIT $3) AS picked
), fingerprints AS (
    DELETE FROM inboxctl_fingerprints f USING batch WHERE f.consumer_type = $1 AND f.id = ANY (batch.ids)
)
DELETE FROM inbox_messages i USING batch, unnest(batch.ids, batch.times) AS b(id, message_time)
WHERE i.id = b.id AND i.consumer_type = $1 AND i.message_time = b.message_time";

    /// The same for inboxctl's own event rows.
    const DELETE_EVENTS_BATCH = "\
DELETE FROM inboxctl_events WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM inboxctl_events
    WHERE consumer_type = $1 AND occurred_at < $2
    LIMIT $3))";

    /// One cleanup at a time per consumer_type (per database): a second one skips a consumer_type another is
    /// cleaning, rather than waiting on it or deleting the same rows. `$1` consumer_type.
    const CLEANUP_TRY_LOCK =
    "SELECT pg_try_advisory_lock(hashtextextended('inboxctl cleanup: ' || $1, 0))";
    /// Releases the cleanup's locks: every advisory lock of the session, which holds nothing else.
    const CLEANUP_UNLOCK_ALL = "SELECT pg_advisory_unlock_all()";

    /// The same lock for one transaction, taken by each batch through a transaction pooler, where no session (and no
    /// session lock) lasts beyond a transaction. The same key: it excludes a cleanup holding the session lock too.
    /// `$1` consumer_type.
    const CLEANUP_TRY_XACT_LOCK =
    "SELECT pg_try_advisory_xact_lock(hashtextextended('inboxctl cleanup: ' || $1, 0))";

    /// What a cleanup would delete (`--dry-run`). `$1` consumer_type, `$2` cutoff.
    const COUNT_PROCESSED_BEFORE =
    "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1 AND processed_at < $2";
    /// The same on a partitioned inbox, below `$3` as `DELETE_PROCESSED_BATCH_TIMED`, leaving out the rows of the
    /// partitions named in `$4` (those the run would drop whole: the batched delete never sees their rows).
    const COUNT_PROCESSED_BEFORE_TIMED = "\
SELECT count(*) FROM inbox_messages
WHERE consumer_type = $1 AND processed_at < $2 AND ($3::timestamptz IS NULL OR message_time < $3)
  AND tableoid NOT IN (SELECT c.oid FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                       WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname = ANY($4::text[]))";
    const COUNT_EVENTS_BEFORE =
    "SELECT count(*) FROM inboxctl_events WHERE consumer_type = $1 AND occurred_at < $2";

    /// Rows received before the cutoff and never processed, and the oldest of them. `$1` consumer_type, `$2` cutoff.
    const UNPROCESSED_BEFORE = "\
SELECT count(*), min(received_at) FILTER (WHERE isfinite(received_at)) FROM inbox_messages
WHERE consumer_type = $1 AND processed_at IS NULL AND received_at < $2";

    /// `cleanup`: start counts of messages that never came back. `$1` consumer_type, `$2` cutoff.
    const DELETE_OLD_ATTEMPTS =
    "DELETE FROM inboxctl_attempts WHERE consumer_type = $1 AND last_started_at < $2";

    /// One batch of calls made outside the database (`inboxctl_effects`) that are done and were settled before the
    /// cutoff: at most `$3` of consumer_type `$1` older than `$2`. Calls owed, started, in doubt or failed never match.
    const DELETE_DONE_EFFECTS_BATCH = "\
DELETE FROM inboxctl_effects WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM inboxctl_effects
    WHERE consumer_type = $1 AND state = 'done' AND updated_at < $2
    LIMIT $3))";
    const COUNT_DONE_EFFECTS_BEFORE =
    "SELECT count(*) FROM inboxctl_effects WHERE consumer_type = $1 AND state = 'done' AND updated_at < $2";

    /// Whether this role may read and delete the calls' records (both: `has_table_privilege` with a list answers
    /// whether it holds any of them).
    const MAY_DELETE_EFFECTS = "\
SELECT has_table_privilege('inboxctl_effects', 'SELECT') AND has_table_privilege('inboxctl_effects', 'DELETE')";
}

/// `now() - retention` on the database's clock (`CUTOFF`).
pub async fn cutoff(
    executor: impl Into<Exec<'_>>,
    retention: Duration,
) -> sqlx::Result<DateTime<Utc>> {
    unit!(executor, |conn| sql::query_scalar(CUTOFF)
        .bind(retention.as_secs_f64())
        .fetch_one(conn))
}

/// Every consumer_type with inbox rows, events or a registration, in order (`CONSUMER_TYPES`).
pub async fn consumer_types(executor: impl Into<Exec<'_>>) -> sqlx::Result<Vec<String>> {
    unit!(executor, |conn| sql::query_scalar(CONSUMER_TYPES)
        .fetch_all(conn))
}

/// Rows of a consumer_type received before the cutoff and never processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unprocessed {
    pub count: u64,
    pub oldest: Option<DateTime<Utc>>,
}

/// The unprocessed rows received before `cutoff` (`UNPROCESSED_BEFORE`).
pub async fn unprocessed_before(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<Unprocessed> {
    let (count, oldest): (i64, Option<DateTime<Utc>>) =
        unit!(executor, |conn| sql::query_as(UNPROCESSED_BEFORE)
            .bind(consumer_type)
            .bind(cutoff)
            .fetch_one(conn))?;
    Ok(Unprocessed {
        count: count.unsigned_abs(),
        oldest,
    })
}

/// Processed rows older than `cutoff`: what a cleanup deletes in batches (`COUNT_PROCESSED_BEFORE`, on a
/// partitioned inbox `COUNT_PROCESSED_BEFORE_TIMED`, without the rows of the partitions `dropped` names).
pub async fn count_processed_before(
    executor: impl Into<Exec<'_>>,
    rows: Rows,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    dropped: &[String],
) -> sqlx::Result<u64> {
    let Rows::ProcessedPartitioned { below } = rows else {
        return count(executor, COUNT_PROCESSED_BEFORE, consumer_type, cutoff).await;
    };
    let counted = sql::query_scalar(COUNT_PROCESSED_BEFORE_TIMED);
    let n: i64 = unit!(executor, |conn| counted
        .bind(consumer_type)
        .bind(cutoff)
        .bind(below)
        .bind(dropped)
        .fetch_one(conn))?;
    Ok(n.unsigned_abs())
}

/// Event rows older than `cutoff` (`COUNT_EVENTS_BEFORE`).
pub async fn count_events_before(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<u64> {
    count(executor, COUNT_EVENTS_BEFORE, consumer_type, cutoff).await
}

async fn count(
    executor: impl Into<Exec<'_>>,
    statement: &'static str,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<u64> {
    let n: i64 = unit!(executor, |conn| sql::query_scalar(statement)
        .bind(consumer_type)
        .bind(cutoff)
        .fetch_one(conn))?;
    Ok(n.unsigned_abs())
}

/// Takes the consumer_type's cleanup lock on this session if no other session holds it (`CLEANUP_TRY_LOCK`).
pub async fn try_lock(executor: impl Into<Exec<'_>>, consumer_type: &str) -> sqlx::Result<bool> {
    unit!(executor, |conn| sql::query_scalar(CLEANUP_TRY_LOCK)
        .bind(consumer_type)
        .fetch_one(conn))
}

/// Releases every advisory lock of the session (`CLEANUP_UNLOCK_ALL`).
pub async fn unlock_all(executor: impl Into<Exec<'_>>) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(CLEANUP_UNLOCK_ALL)
        .execute(conn))
    .map(drop)
}

/// What a cleanup batch deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Processed inbox rows, with their fingerprints (`DELETE_PROCESSED_BATCH`).
    Processed,
    /// The same on a partitioned inbox (`DELETE_PROCESSED_BATCH_TIMED`), of the rows whose message time is below
    /// `below` (none: all).
    ProcessedPartitioned { below: Option<DateTime<Utc>> },
    /// inboxctl's own event rows (`DELETE_EVENTS_BATCH`).
    Events,
}

/// One batch in a transaction of its own that first takes the consumer_type's lock for that transaction
/// (`CLEANUP_TRY_XACT_LOCK`): a cleanup's batch through a transaction pooler. `None`: another cleanup holds the
/// consumer_type, and nothing was deleted.
pub async fn delete_batch_locked(
    pool: &PgPool,
    rows: Rows,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<Option<u64>> {
    let mut tx = pool.begin().await?;
    let locked: bool = sql::query_scalar(CLEANUP_TRY_XACT_LOCK)
        .bind(consumer_type)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        tx.rollback().await?;
        return Ok(None);
    }
    let deleted = match rows {
        Rows::Events => delete_events_batch(&mut *tx, consumer_type, cutoff, limit).await?,
        processed => {
            delete_processed_batch(&mut *tx, processed, consumer_type, cutoff, limit).await?
        }
    };
    tx.commit().await?;
    Ok(Some(deleted))
}

/// Deletes at most `limit` processed rows older than `cutoff`, with their fingerprints (`DELETE_PROCESSED_BATCH`, or
/// on a partitioned inbox `DELETE_PROCESSED_BATCH_TIMED`); returns the rows deleted. `rows` is not `Rows::Events`.
pub async fn delete_processed_batch(
    executor: impl Into<Exec<'_>>,
    rows: Rows,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<u64> {
    let Rows::ProcessedPartitioned { below } = rows else {
        return delete_batch(
            executor,
            DELETE_PROCESSED_BATCH,
            consumer_type,
            cutoff,
            limit,
        )
        .await;
    };
    Ok(
        unit!(executor, |conn| sql::query(DELETE_PROCESSED_BATCH_TIMED)
            .bind(consumer_type)
            .bind(cutoff)
            .bind(limit)
            .bind(below)
            .execute(conn))?
        .rows_affected(),
    )
}

/// Deletes at most `limit` event rows older than `cutoff` (`DELETE_EVENTS_BATCH`); returns the rows deleted.
pub async fn delete_events_batch(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<u64> {
    delete_batch(executor, DELETE_EVENTS_BATCH, consumer_type, cutoff, limit).await
}

async fn delete_batch(
    executor: impl Into<Exec<'_>>,
    statement: &'static str,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<u64> {
    Ok(unit!(executor, |conn| sql::query(statement)
        .bind(consumer_type)
        .bind(cutoff)
        .bind(limit)
        .execute(conn))?
    .rows_affected())
}

/// Deletes the start counts last started before `cutoff` (`DELETE_OLD_ATTEMPTS`); returns how many.
pub async fn delete_old_attempts(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<u64> {
    Ok(unit!(executor, |conn| sql::query(DELETE_OLD_ATTEMPTS)
        .bind(consumer_type)
        .bind(cutoff)
        .execute(conn))?
    .rows_affected())
}

/// Deletes at most `limit` done calls of `consumer_type` settled before `cutoff` (`DELETE_DONE_EFFECTS_BATCH`).
pub async fn delete_done_effects_batch(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> sqlx::Result<u64> {
    delete_batch(
        executor,
        DELETE_DONE_EFFECTS_BATCH,
        consumer_type,
        cutoff,
        limit,
    )
    .await
}

/// What a cleanup would delete of the calls' records (`--dry-run`, `COUNT_DONE_EFFECTS_BEFORE`).
pub async fn count_done_effects_before(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<u64> {
    count(executor, COUNT_DONE_EFFECTS_BEFORE, consumer_type, cutoff).await
}

/// Whether this role may delete the calls' records (`MAY_DELETE_EFFECTS`).
pub async fn may_delete_effects(executor: impl Into<Exec<'_>>) -> sqlx::Result<bool> {
    unit!(executor, |conn| sql::query_scalar(MAY_DELETE_EFFECTS)
        .fetch_one(conn))
}
