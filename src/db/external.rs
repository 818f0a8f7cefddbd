//! Calls to the outside world (`inboxctl_effects`): the intent written with the claim, the lease a consumer process
//! takes before it calls, the outcome it records after, and what operators list and settle.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use super::{Exec, sql};

statements! {
    /// An effect owed, written in the claim's transaction. `$1` message id, `$2` consumer_type, `$3` idempotency key,
    /// `$4` mode, `$5` state (`pending`, or `done` for a keyed call made inside the transaction), `$6` request (JSON
    /// text), `$7` attempts so far, `$8` reference (the slot id of a call made).
    const INSERT_EFFECT = "\
INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, reference)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)
ON CONFLICT (message_id, consumer_type) DO NOTHING";

    /// Leases up to `$3` effects of consumer_type `$1` that are due, for `$2` seconds: pending ones whose wait has
    /// passed, and (unless `$4`, pending ones only) after-commit ones whose process's lease ran out (that process
    /// died, or its call's outcome was unknown), quiet for `$5` seconds, and whose key is still younger than `$6`
    /// seconds at the lease's end (the key's lifetime at the carrier, `--effect-key-ttl`, counted from when the row
    /// was written: sent again past it, the key may be forgotten and the call booked twice; `MARK_IN_DOUBT` puts
    /// those in doubt). An at-most-once effect already started is never taken again. Each is counted an attempt and marked
    /// started; `was` says what it was before; its lease's end, with the attempt's number, fences the attempt's
    /// outcome. Rows another process is leasing are skipped, not waited for. A pending effect's earlier error (a refusal)
    /// is cleared: it says nothing of this attempt's outcome (a 503 before, and this attempt in doubt, is not "nothing
    /// booked"); a started one's (an unknown outcome) is kept, as what is still not known.
    const LEASE_DUE = "\
WITH due AS (
    SELECT message_id, consumer_type, state FROM inboxctl_effects
    WHERE consumer_type = $1
      AND (state = 'pending' OR (NOT $4 AND state = 'started' AND mode = 'after-commit'
                                 AND coalesce(lease_until, '-infinity') < now() - make_interval(secs => $5)
                                 AND created_at > now() - make_interval(secs => $6) + make_interval(secs => $2)))
      AND (lease_until IS NULL OR lease_until < now())
    ORDER BY created_at
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
UPDATE inboxctl_effects e
SET state = 'started', lease_until = now() + make_interval(secs => $2), attempts = e.attempts + 1, updated_at = now(),
    last_error = CASE WHEN due.state = 'pending' THEN NULL ELSE e.last_error END
FROM due
WHERE e.message_id = due.message_id AND e.consumer_type = due.consumer_type
RETURNING e.message_id, e.idempotency_key, e.mode, e.request::text, e.attempts, due.state, e.lease_until";

    /// The database's time: what every time of an effect row is written in.
    const DATABASE_NOW = "SELECT now()";

    /// Effects of consumer_type `$1` started by a process whose lease ran out, put in doubt: at-most-once ones, and
    /// after-commit ones written `$2` seconds ago or more (`--effect-key-ttl`), whose key the carrier may have
    /// forgotten: sent again, such a call could be booked twice. The time the row was written is no later than the
    /// first call's, so a call is never taken for younger than it is.
    const MARK_IN_DOUBT = "\
UPDATE inboxctl_effects
SET state = 'in_doubt', updated_at = now(),
    last_error = CASE WHEN mode = 'at-most-once'
        THEN coalesce(last_error, 'the process making the call ended before its outcome was recorded')
        ELSE 'its outcome unknown, and its idempotency key older than --effect-key-ttl: the carrier may have forgotten \
the key and would book the call again, so it is not sent again' || coalesce(' (last: ' || last_error || ')', '') END
WHERE consumer_type = $1 AND state = 'started' AND lease_until < now()
  AND (mode = 'at-most-once' OR (mode = 'after-commit' AND created_at <= now() - make_interval(secs => $2)))";

    /// How many effects of consumer_type `$1` are still owed: pending, or started and not yet settled (a call in
    /// flight, an after-commit call whose outcome is unknown, an at-most-once call the worker has yet to mark in
    /// doubt); with `$2`, the pending ones and those in flight under a live lease only (not those whose outcome is
    /// unknown). Counted up to 1000.
    const OWED = "\
SELECT count(*) FROM (
    SELECT 1 FROM inboxctl_effects
    WHERE consumer_type = $1
      AND (state = 'pending' OR (state = 'started' AND (NOT $2 OR lease_until >= now())))
    LIMIT 1000) owed";

    /// The effects of consumer_type `$1` owed by an earlier run, each count up to 1000: those still to be made or in
    /// flight (pending, or started under a live lease), and those whose outcome is unknown (started, the lease run
    /// out). One statement, so that the two are of one moment.
    const OWED_BY_OUTCOME = "\
SELECT
    (SELECT count(*) FROM (
        SELECT 1 FROM inboxctl_effects
        WHERE consumer_type = $1 AND (state = 'pending' OR (state = 'started' AND lease_until >= now()))
        LIMIT 1000) live),
    (SELECT count(*) FROM (
        SELECT 1 FROM inboxctl_effects
        WHERE consumer_type = $1 AND state = 'started' AND lease_until < now()
        LIMIT 1000) unknown)";

    /// Records the outcome of attempt `$3` of effect (`$1` message id, `$2` consumer_type), if that attempt still
    /// holds it (started, same attempt count, same lease `$8`: a settle to `pending` counts attempts afresh, so the
    /// number alone could match a later attempt's): `$4` new state, `$5` seconds until it is due again (null:
    /// never), `$6` last error, `$7` reference. Answers whether it still held it.
    const RECORD_OUTCOME = "\
UPDATE inboxctl_effects
SET state = $4, lease_until = now() + make_interval(secs => $5), last_error = coalesce($6, last_error),
    reference = coalesce($7, reference), updated_at = now()
WHERE message_id = $1 AND consumer_type = $2 AND state = 'started' AND attempts = $3 AND lease_until = $8";

    /// Gives back the effect `$1` of consumer_type `$2` leased as attempt `$3` with the lease `$5` and sent no request:
    /// as it was before the lease (`$4`, pending or started), its attempt not counted, due again in `$6` seconds.
    const GIVE_BACK = "\
UPDATE inboxctl_effects
SET state = $4, attempts = attempts - 1, lease_until = now() + make_interval(secs => $6), updated_at = now()
WHERE message_id = $1 AND consumer_type = $2 AND state = 'started' AND attempts = $3 AND lease_until = $5";

    /// The effects in states `$1` (an array), of consumer_type `$2` (null: all), oldest first, at most `$3`. An
    /// at-most-once effect started by a process whose lease ran out is shown in doubt.
    const LIST_EFFECTS = "\
SELECT message_id, consumer_type::text, idempotency_key, mode, shown, attempts, created_at, updated_at, lease_until,
       last_error, reference, request::text
FROM (SELECT *, CASE WHEN state = 'started' AND mode = 'at-most-once' AND lease_until < now() THEN 'in_doubt'
                     ELSE state END AS shown
      FROM inboxctl_effects
      WHERE state IN ('pending', 'started', 'in_doubt', 'failed')) e
WHERE shown = ANY($1) AND ($2::text IS NULL OR consumer_type = $2)
ORDER BY created_at
LIMIT $3";

    /// One message's effects, for `find` and `effects resolve`. `$1` message id, `$2` consumer_type (null: all).
    const EFFECTS_OF = "\
SELECT message_id, consumer_type::text, idempotency_key, mode,
       CASE WHEN state = 'started' AND mode = 'at-most-once' AND lease_until < now() THEN 'in_doubt' ELSE state END,
       attempts, created_at, updated_at, lease_until, last_error, reference, request::text
FROM inboxctl_effects
WHERE message_id = $1 AND ($2::text IS NULL OR consumer_type = $2)
ORDER BY consumer_type";

    /// Settles an effect that is not running now (not leased by a live process): `$3` new state (`done` or
    /// `pending`, its attempts counted afresh), `$4` reference, `$5` note kept as its last error. `$1` message id,
    /// `$2` consumer_type, `$6` when it was last seen changed (null: as it is now): a row changed since — an attempt
    /// made meanwhile — is not settled on what was learnt before. Answers the state it had.
    const SETTLE = "\
UPDATE inboxctl_effects e
SET state = $3, reference = coalesce($4, e.reference), last_error = coalesce($5, e.last_error), lease_until = NULL,
    attempts = CASE WHEN $3 = 'pending' THEN 0 ELSE e.attempts END, updated_at = now()
FROM (SELECT message_id, consumer_type, state FROM inboxctl_effects
      WHERE message_id = $1 AND consumer_type = $2
        AND state <> 'done' AND (state <> 'started' OR lease_until < now())
        AND ($6::timestamptz IS NULL OR updated_at = $6)
      FOR UPDATE) old
WHERE e.message_id = old.message_id AND e.consumer_type = old.consumer_type
RETURNING old.state";

    /// Per consumer_type of `$1`, its calls owed, in doubt and failed, each count stopping at `$2` (a floor there), and
    /// the oldest owed and in doubt (`stats`, `top`): each read through an index of its own state, so a refresh reads
    /// no more however many a carrier's outage left. An at-most-once call `started` past its lease is in doubt.
    const OPEN_EFFECTS = "\
SELECT t.consumer_type,
  (SELECT count(*) FROM (SELECT 1 FROM inboxctl_effects e
     WHERE e.consumer_type = t.consumer_type AND e.state IN ('pending', 'started')
       AND NOT (e.state = 'started' AND e.mode = 'at-most-once' AND e.lease_until < now()) LIMIT $2) x),
  (SELECT e.created_at FROM inboxctl_effects e
     WHERE e.consumer_type = t.consumer_type AND e.state IN ('pending', 'started')
       AND NOT (e.state = 'started' AND e.mode = 'at-most-once' AND e.lease_until < now())
     ORDER BY e.created_at LIMIT 1),
  (SELECT count(*) FROM (SELECT 1 FROM inboxctl_effects e
     WHERE e.consumer_type = t.consumer_type AND e.state = 'in_doubt' LIMIT $2) x)
  + (SELECT count(*) FROM (SELECT 1 FROM inboxctl_effects e
     WHERE e.consumer_type = t.consumer_type AND e.state = 'started'
       AND e.mode = 'at-most-once' AND e.lease_until < now() LIMIT $2) x),
  LEAST(
    (SELECT e.created_at FROM inboxctl_effects e
       WHERE e.consumer_type = t.consumer_type AND e.state = 'in_doubt' ORDER BY e.created_at LIMIT 1),
    (SELECT e.created_at FROM inboxctl_effects e
       WHERE e.consumer_type = t.consumer_type AND e.state = 'started'
         AND e.mode = 'at-most-once' AND e.lease_until < now()
       ORDER BY e.created_at LIMIT 1)),
  (SELECT count(*) FROM (SELECT 1 FROM inboxctl_effects e
     WHERE e.consumer_type = t.consumer_type AND e.state = 'failed' LIMIT $2) x),
  now()
FROM unnest($1::text[]) AS t(consumer_type)";
}

/// An effect to write with the claim.
#[derive(Debug, Clone)]
pub struct NewEffect<'a> {
    pub message_id: Uuid,
    pub consumer_type: &'a str,
    pub idempotency_key: Uuid,
    pub mode: &'a str,
    pub state: &'a str,
    pub request: &'a str,
    pub attempts: i32,
    pub reference: Option<&'a str>,
}

/// Writes an effect in the claim's transaction (`INSERT_EFFECT`).
pub async fn insert(conn: &mut PgConnection, e: &NewEffect<'_>) -> sqlx::Result<()> {
    unit!(conn, |conn| sql::query(INSERT_EFFECT)
        .bind(e.message_id)
        .bind(e.consumer_type)
        .bind(e.idempotency_key)
        .bind(e.mode)
        .bind(e.state)
        .bind(e.request)
        .bind(e.attempts)
        .bind(e.reference)
        .execute(conn))
    .map(drop)
}

/// An effect a process leased to make its call.
#[derive(Debug, Clone)]
pub struct Leased {
    pub message_id: Uuid,
    pub idempotency_key: Uuid,
    pub mode: String,
    pub request: String,
    /// This attempt's number: the fence its outcome is recorded under.
    pub attempts: i32,
    /// What it was before: `started` if an earlier attempt's outcome is unknown.
    pub was: String,
    /// When this lease ends: with `attempts`, the fence its outcome is recorded under.
    pub lease_until: DateTime<Utc>,
}

/// Leases up to `limit` due effects for `lease` (`LEASE_DUE`); with `pending_only`, none whose earlier outcome is
/// unknown; one whose outcome is unknown only once it has been quiet (its lease, or its retry's wait, over) for
/// `quiet`, and only while its key is younger than `key_ttl`.
pub async fn lease_due(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    lease: std::time::Duration,
    limit: i64,
    pending_only: bool,
    quiet: std::time::Duration,
    key_ttl: std::time::Duration,
) -> sqlx::Result<Vec<Leased>> {
    type LeasedRaw = (Uuid, Uuid, String, String, i32, String, DateTime<Utc>);
    let query = sql::query_as::<LeasedRaw>(LEASE_DUE)
        .bind(consumer_type)
        .bind(lease.as_secs_f64())
        .bind(limit)
        .bind(pending_only)
        .bind(quiet.as_secs_f64())
        .bind(key_ttl.as_secs_f64());
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(
            |(message_id, idempotency_key, mode, request, attempts, was, lease_until)| Leased {
                message_id,
                idempotency_key,
                mode,
                request,
                attempts,
                was,
                lease_until,
            },
        )
        .collect())
}

/// Gives back an effect leased and sent no request (`GIVE_BACK`): as it was, its attempt not counted, due again after
/// `due_in`; whether the lease still held.
pub async fn give_back(
    executor: impl Into<Exec<'_>>,
    leased: &Leased,
    consumer_type: &str,
    due_in: std::time::Duration,
) -> sqlx::Result<bool> {
    let query = sql::query(GIVE_BACK)
        .bind(leased.message_id)
        .bind(consumer_type)
        .bind(leased.attempts)
        .bind(&leased.was)
        .bind(leased.lease_until)
        .bind(due_in.as_secs_f64());
    unit!(executor, |conn| query.execute(conn)).map(|r| r.rows_affected() == 1)
}

/// Marks in doubt the effects whose process's lease ran out that may not be sent again (`MARK_IN_DOUBT`): at-most-once
/// ones, and after-commit ones older than `key_ttl`; how many.
pub async fn mark_in_doubt(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    key_ttl: std::time::Duration,
) -> sqlx::Result<u64> {
    let query = sql::query(MARK_IN_DOUBT)
        .bind(consumer_type)
        .bind(key_ttl.as_secs_f64());
    unit!(executor, |conn| query.execute(conn)).map(|r| r.rows_affected())
}

/// How many effects of `consumer_type` are still owed (`OWED`), up to 1000; with `pending_only`, how many of them
/// are pending or in flight (not those whose outcome is unknown, their lease run out).
pub async fn owed(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    pending_only: bool,
) -> sqlx::Result<i64> {
    let query = sql::query_scalar::<i64>(OWED)
        .bind(consumer_type)
        .bind(pending_only);
    unit!(executor, |conn| query.fetch_one(conn))
}

/// The effects of `consumer_type` owed (`OWED_BY_OUTCOME`): `(to make or in flight, of unknown outcome)`, each up to
/// 1000.
pub async fn owed_by_outcome(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
) -> sqlx::Result<(i64, i64)> {
    let query = sql::query_as::<(i64, i64)>(OWED_BY_OUTCOME).bind(consumer_type);
    unit!(executor, |conn| query.fetch_one(conn))
}

/// The outcome of one attempt at an effect.
#[derive(Debug, Clone)]
pub struct Outcome<'a> {
    pub state: &'a str,
    /// Due again after this long (pending, or started with its outcome unknown); `None`: not due again.
    pub due_in: Option<std::time::Duration>,
    pub last_error: Option<&'a str>,
    pub reference: Option<&'a str>,
}

/// Records the outcome of the attempt `leased` if it still holds the effect (`RECORD_OUTCOME`).
pub async fn record_outcome(
    executor: impl Into<Exec<'_>>,
    leased: &Leased,
    consumer_type: &str,
    outcome: &Outcome<'_>,
) -> sqlx::Result<bool> {
    let last_error = outcome.last_error.map(sql::storable);
    let reference = outcome.reference.map(sql::storable);
    let query = sql::query(RECORD_OUTCOME)
        .bind(leased.message_id)
        .bind(consumer_type)
        .bind(leased.attempts)
        .bind(outcome.state)
        .bind(outcome.due_in.map(|d| d.as_secs_f64()))
        .bind(last_error.as_deref())
        .bind(reference.as_deref())
        .bind(leased.lease_until);
    unit!(executor, |conn| query.execute(conn)).map(|r| r.rows_affected() == 1)
}

/// An effect as listed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub message_id: Uuid,
    pub consumer_type: String,
    pub idempotency_key: Uuid,
    pub mode: String,
    pub state: String,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub lease_until: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub reference: Option<String>,
    pub request: serde_json::Value,
}

type Raw = (
    Uuid,
    String,
    Uuid,
    String,
    String,
    i32,
    DateTime<Utc>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<String>,
    String,
);

fn row(r: Raw) -> Row {
    Row {
        message_id: r.0,
        consumer_type: r.1,
        idempotency_key: r.2,
        mode: r.3,
        state: r.4,
        attempts: r.5,
        created_at: r.6,
        updated_at: r.7,
        lease_until: r.8,
        last_error: r.9,
        reference: r.10,
        request: serde_json::from_str(&r.11).unwrap_or(serde_json::Value::Null),
    }
}

/// The effects in `states`, of `consumer_type` (or all), oldest first (`LIST_EFFECTS`).
pub async fn list(
    executor: impl Into<Exec<'_>>,
    states: &[&str],
    consumer_type: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<Row>> {
    let query = sql::query_as::<Raw>(LIST_EFFECTS)
        .bind(states)
        .bind(consumer_type)
        .bind(limit);
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows.into_iter().map(row).collect())
}

/// The database's time, against which the times of effect rows (written by its `now()`) are judged: this machine's
/// clock may be off by minutes.
pub async fn database_now(executor: impl Into<Exec<'_>>) -> sqlx::Result<DateTime<Utc>> {
    unit!(executor, |conn| sql::query_scalar(DATABASE_NOW)
        .fetch_one(conn))
}

/// One message's effects (`EFFECTS_OF`).
pub async fn of_message(
    executor: impl Into<Exec<'_>>,
    message_id: Uuid,
    consumer_type: Option<&str>,
) -> sqlx::Result<Vec<Row>> {
    let query = sql::query_as::<Raw>(EFFECTS_OF)
        .bind(message_id)
        .bind(consumer_type);
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows.into_iter().map(row).collect())
}

/// Settles an effect no live process holds (`SETTLE`), and, with `unchanged_since`, that has not changed since it was
/// seen: the state it had, or `None` if there was none to settle.
pub async fn settle(
    executor: impl Into<Exec<'_>>,
    message_id: Uuid,
    consumer_type: &str,
    state: &str,
    reference: Option<&str>,
    note: Option<&str>,
    unchanged_since: Option<DateTime<Utc>>,
) -> sqlx::Result<Option<String>> {
    let (reference, note) = (reference.map(sql::storable), note.map(sql::storable));
    let query = sql::query_scalar::<String>(SETTLE)
        .bind(message_id)
        .bind(consumer_type)
        .bind(state)
        .bind(reference.as_deref())
        .bind(note.as_deref())
        .bind(unchanged_since);
    unit!(executor, |conn| query.fetch_optional(conn))
}

/// Per consumer_type: effects owed and in doubt, the oldest of each, and those failed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Open {
    pub consumer_type: String,
    pub pending: i64,
    pub oldest_pending: Option<DateTime<Utc>>,
    pub in_doubt: i64,
    pub oldest_in_doubt: Option<DateTime<Utc>>,
    pub failed: i64,
    /// A count stopped at `at_most`: it is a floor (the oldest are the oldest all the same).
    pub at_least: bool,
    /// The database's time as it answered: the oldest are aged against it, not against this machine's clock.
    pub now: DateTime<Utc>,
}

/// `OPEN_EFFECTS`, for `consumer_types`, each count stopping at `at_most`.
pub async fn open(
    executor: impl Into<Exec<'_>>,
    consumer_types: &[String],
    at_most: i64,
) -> sqlx::Result<Vec<Open>> {
    type OpenRaw = (
        String,
        i64,
        Option<DateTime<Utc>>,
        i64,
        Option<DateTime<Utc>>,
        i64,
        DateTime<Utc>,
    );
    let query = sql::query_as::<OpenRaw>(OPEN_EFFECTS)
        .bind(consumer_types)
        .bind(at_most);
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|r| Open {
            consumer_type: r.0,
            pending: r.1,
            oldest_pending: r.2,
            in_doubt: r.3,
            oldest_in_doubt: r.4,
            failed: r.5,
            at_least: r.1 >= at_most || r.3 >= at_most || r.5 >= at_most,
            now: r.6,
        })
        .collect())
}
