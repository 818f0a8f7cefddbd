//! The claim's statements: the inbox row and its fingerprint, taken for one message or a batch, and the copies
//! recorded. The protocol that orders them is `inbox`'s.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use sqlx::postgres::{PgArguments, PgConnection, Postgres};
use sqlx::{Arguments as _, AssertSqlSafe, Connection as _, Transaction};
use uuid::Uuid;

use super::sql;
use crate::inbox::{ConsumerType, Fingerprint};

statements! {
    /// The claim. Inserts the inbox row — with `processed_at` already set, because nobody sees the row before it
    /// commits, and it commits only together with the consumer's effects — and, beside it, the fingerprint of the
    /// message's event (when given), so that a later copy of another event under the same id can be told from a copy
    /// of this one. A copy whose key is held by an uncommitted attempt waits here for that attempt's outcome: it claims
    /// the key if the attempt rolls back, and is a copy (`RECORD_COPY`) if it commits.
    ///
    /// Returns whether the key was claimed. `$1` message id, `$2` consumer_type, `$3` fingerprint (null: unknown).
    pub const CLAIM = "\
WITH claim AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
    VALUES ($1, $2, now(), now())
    ON CONFLICT (id, consumer_type) DO NOTHING
    RETURNING 1
), fingerprint AS (
    INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint)
    SELECT $1, $2, $3 FROM claim WHERE $3::bytea IS NOT NULL
    ON CONFLICT (id, consumer_type) DO UPDATE SET fingerprint = EXCLUDED.fingerprint
)
SELECT EXISTS (SELECT 1 FROM claim) AND set_config('inboxctl.claim', 'on', true) = 'on'";

    /// A copy whose key a committed claim holds: recorded as a `duplicate`, or as a `conflict` when the claim kept
    /// another fingerprint than this copy's (both known). A statement of its own after the claim, because the claim's
    /// snapshot predates the attempt it waited for. Returns the fingerprint the key was claimed with (null: unknown).
    /// `$1` message id, `$2` consumer_type, `$3` this copy's fingerprint (null: unknown).
    const RECORD_COPY = "\
WITH first AS (
    SELECT (SELECT fingerprint FROM inboxctl_fingerprints WHERE id = $1 AND consumer_type = $2) AS first,
           $3::bytea AS this
), event AS (
    INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail)
    SELECT $2,
           CASE WHEN first <> this THEN 'conflict' ELSE 'duplicate' END,
           $1,
           CASE WHEN first <> this
                THEN 'first event ' || encode(first, 'hex') || ', this one ' || encode(this, 'hex') END
    FROM first
)
SELECT first FROM first";

    /// The batched claim: every key of a batch in one statement, in the order of `$1` (sorted by the caller, so two
    /// batches never wait on each other in a cycle), each with its fingerprint. Returns the ids claimed.
    /// `$1` message ids, `$2` consumer_type, `$3` their fingerprints (empty: unknown).
    const CLAIM_BATCH = "\
WITH m AS (
    SELECT id, NULLIF(fingerprint, ''::bytea) AS fingerprint, n
    FROM unnest($1::uuid[], $3::bytea[]) WITH ORDINALITY AS m(id, fingerprint, n)
), claim AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
    SELECT id, $2, now(), now() FROM m ORDER BY n
    ON CONFLICT (id, consumer_type) DO NOTHING
    RETURNING id
), fingerprint AS (
    INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint)
    SELECT m.id, $2, m.fingerprint FROM m JOIN claim USING (id) WHERE m.fingerprint IS NOT NULL
    ON CONFLICT (id, consumer_type) DO UPDATE SET fingerprint = EXCLUDED.fingerprint
)
SELECT id FROM claim WHERE set_config('inboxctl.claim', 'on', true) = 'on'";

    /// The claim on a partitioned inbox (`db::partitions`): the same, keyed on `(id, consumer_type, message_time)`
    /// with the message's time, which routes the row to its partition, and the fingerprint kept in the inbox row
    /// itself (dropped with its partition). A key's untimed row (written before the inbox was partitioned, or by a
    /// service that sets no time) is its claim too: never inserted anew by a claim, so read, not waited on.
    /// `$1` message id, `$2` consumer_type, `$3` fingerprint (null: unknown), `$4` the message's time.
    pub const CLAIM_TIMED = "\
WITH claim AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time, fingerprint)
    SELECT $1::uuid, $2::varchar, now(), now(), $4::timestamptz, $3::bytea
    WHERE NOT EXISTS (SELECT 1 FROM inbox_messages
                      WHERE id = $1 AND consumer_type = $2 AND message_time = '-infinity')
    ON CONFLICT (id, consumer_type, message_time) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM claim) AND set_config('inboxctl.claim', 'on', true) = 'on'";

    /// `RECORD_COPY` on a partitioned inbox: the first fingerprint is the inbox row's, or, for a row from before the
    /// inbox was partitioned, the one kept beside it then. `$1` message id, `$2` consumer_type, `$3` this copy's
    /// fingerprint, `$4` the message's time.
    const RECORD_COPY_TIMED = "\
WITH first AS (
    SELECT coalesce(
               (SELECT fingerprint FROM inbox_messages
                WHERE id = $1 AND consumer_type = $2 AND message_time IN ($4::timestamptz, '-infinity')
                  AND fingerprint IS NOT NULL
                LIMIT 1),
               (SELECT fingerprint FROM inboxctl_fingerprints WHERE id = $1 AND consumer_type = $2)) AS first,
           $3::bytea AS this
), event AS (
    INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail)
    SELECT $2,
           CASE WHEN first <> this THEN 'conflict' ELSE 'duplicate' END,
           $1,
           CASE WHEN first <> this
                THEN 'first event ' || encode(first, 'hex') || ', this one ' || encode(this, 'hex') END
    FROM first
)
SELECT first FROM first";

    /// `CLAIM_BATCH` on a partitioned inbox. `$4` the messages' times.
    const CLAIM_BATCH_TIMED = "\
WITH m AS (
    SELECT id, NULLIF(fingerprint, ''::bytea) AS fingerprint, message_time, n
    FROM unnest($1::uuid[], $3::bytea[], $4::timestamptz[]) WITH ORDINALITY AS m(id, fingerprint, message_time, n)
), claim AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time, fingerprint)
    SELECT m.id, $2::varchar, now(), now(), m.message_time, m.fingerprint FROM m
    WHERE NOT EXISTS (SELECT 1 FROM inbox_messages u
                      WHERE u.id = m.id AND u.consumer_type = $2::varchar AND u.message_time = '-infinity')
    ORDER BY n
    ON CONFLICT (id, consumer_type, message_time) DO NOTHING
    RETURNING id
)
SELECT id FROM claim WHERE set_config('inboxctl.claim', 'on', true) = 'on'";

    /// `RECORD_BATCH_COPIES` on a partitioned inbox. `$4` the messages' times.
    const RECORD_BATCH_COPIES_TIMED = "\
WITH c AS (
    SELECT m.id, NULLIF(m.fingerprint, ''::bytea) AS this,
           coalesce(
               (SELECT i.fingerprint FROM inbox_messages i
                WHERE i.id = m.id AND i.consumer_type = $2 AND i.message_time IN (m.message_time, '-infinity')
                  AND i.fingerprint IS NOT NULL
                LIMIT 1),
               (SELECT f.fingerprint FROM inboxctl_fingerprints f WHERE f.id = m.id AND f.consumer_type = $2)) AS first
    FROM unnest($1::uuid[], $3::bytea[], $4::timestamptz[]) AS m(id, fingerprint, message_time)
), event AS (
    INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail)
    SELECT $2,
           CASE WHEN first <> this THEN 'conflict' ELSE 'duplicate' END,
           id,
           CASE WHEN first <> this
                THEN 'first event ' || encode(first, 'hex') || ', this one ' || encode(this, 'hex') END
    FROM c
)
SELECT id, first FROM c";

    /// `RECORD_COPY` for the members of a batch whose keys a committed claim held. Returns each id with the
    /// fingerprint it was claimed with. `$1` message ids, `$2` consumer_type, `$3` their fingerprints (empty: unknown).
    const RECORD_BATCH_COPIES = "\
WITH c AS (
    SELECT m.id, NULLIF(m.fingerprint, ''::bytea) AS this, f.fingerprint AS first
    FROM unnest($1::uuid[], $3::bytea[]) AS m(id, fingerprint)
    LEFT JOIN inboxctl_fingerprints f ON f.id = m.id AND f.consumer_type = $2
), event AS (
    INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail)
    SELECT $2,
           CASE WHEN first <> this THEN 'conflict' ELSE 'duplicate' END,
           id,
           CASE WHEN first <> this
                THEN 'first event ' || encode(first, 'hex') || ', this one ' || encode(this, 'hex') END
    FROM c
)
SELECT id, first FROM c";

    /// Whether the transaction can still commit: it fails (25P02) once a statement in it failed, even one whose error
    /// the work caught and did not return. PostgreSQL answers a `COMMIT` of such a transaction with `ROLLBACK` and
    /// no error, and sqlx's commit does not look at the answer: without this, a message whose work swallowed a
    /// statement's error would be taken as committed, acknowledged, and lost.
    /// It also answers whether the transaction is still the claim's: a work that ended it itself (a `ROLLBACK` or
    /// `COMMIT` of its own) leaves the connection outside any transaction, with no transaction id — the claim wrote
    /// its row, so its transaction has one (asked only where a claim wrote) — or, if it then began another, in a
    /// transaction without the claim's mark (`inboxctl.claim`, which the claim itself sets for its transaction alone:
    /// `set_config(…, true)`, gone with the transaction).
    /// sqlx's commit, which counts transactions itself, would send a `COMMIT` that PostgreSQL answers with a warning
    /// only, or that commits the work's own transaction: a rolled-back claim taken for committed, its work done again
    /// by the next copy.
    pub const STILL_OPEN = "\
SELECT pg_current_xact_id_if_assigned() IS NOT NULL AND current_setting('inboxctl.claim', true) = 'on'";
}

/// What [`still_open`] fails with when the work ended the claim's transaction itself.
pub const ENDED_BY_THE_WORK: &str =
    "the work ended the claim's transaction itself (a ROLLBACK or COMMIT of its own)";

/// What is said when a transaction the work began (sqlx's `begin`, a savepoint under the claim's) was left open —
/// forgotten, neither committed nor rolled back: the claim's COMMIT only ended that one, nothing of the claim
/// committed, and the connection is still inside the claim's transaction ([`committed`]); and what [`begin`] fails
/// with on such a connection.
pub const LEFT_OPEN_BY_THE_WORK: &str = "the work left a transaction of its own open (begun, and neither committed nor \
                                         rolled back)";

/// After the claim's `COMMIT` on `conn`: fails with [`LEFT_OPEN_BY_THE_WORK`] if the connection is still inside a
/// transaction — the COMMIT only released a savepoint the work had begun and left open, and nothing committed.
pub fn committed(conn: &PgConnection) -> sqlx::Result<()> {
    if conn.is_in_transaction() {
        return Err(sqlx::Error::Protocol(LEFT_OPEN_BY_THE_WORK.to_owned()));
    }
    Ok(())
}

/// Whether a protocol error is one of the looks' own: the work ended the claim's transaction, or left one open.
pub fn is_the_works_doing(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Protocol(m) if m == ENDED_BY_THE_WORK || m == LEFT_OPEN_BY_THE_WORK)
}

/// Fails with 25P02 if a statement of the transaction on `conn` failed, and with [`ENDED_BY_THE_WORK`] (a protocol
/// error) if the transaction is no longer the claim's: see [`STILL_OPEN`].
pub async fn still_open(conn: &mut PgConnection) -> sqlx::Result<()> {
    let open: Option<bool> = sql::query_scalar(STILL_OPEN).fetch_one(conn).await?;
    if open == Some(true) {
        Ok(())
    } else {
        Err(sqlx::Error::Protocol(ENDED_BY_THE_WORK.to_owned()))
    }
}

/// The claim and a message's whole effect in one statement (`Inbox::process_effect`): one round trip, and, outside
/// a transaction, its own transaction. The claim is `CLAIM`'s (`CLAIM_TIMED`'s when `timed`) as the relation
/// `claimed`, one row when this delivery takes the key and none for a copy; `effect` writes only through it (`INSERT
/// … SELECT … FROM claimed`), so a copy writes nothing. The effect's own parameters are `$1`…`$own`; the claim's
/// follow: message id, consumer_type, fingerprint (null: unknown), and when `timed` the message's time.
/// Returns whether the key was claimed.
fn claim_with_effect(effect: &str, own: usize, timed: bool) -> String {
    let [id, consumer_type, fingerprint, time] = [1, 2, 3, 4].map(|n| format!("${}", own + n));
    let claim = if timed {
        format!(
            "\
claimed AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time, fingerprint)
    SELECT {id}::uuid, {consumer_type}::varchar, now(), now(), {time}::timestamptz, {fingerprint}::bytea
    WHERE NOT EXISTS (SELECT 1 FROM inbox_messages
                      WHERE id = {id}::uuid AND consumer_type = {consumer_type}::varchar
                        AND message_time = '-infinity')
    ON CONFLICT (id, consumer_type, message_time) DO NOTHING
    RETURNING 1
)"
        )
    } else {
        format!(
            "\
claimed AS (
    INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
    SELECT {id}::uuid, {consumer_type}::varchar, now(), now()
    ON CONFLICT (id, consumer_type) DO NOTHING
    RETURNING 1
), fingerprint AS (
    INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint)
    SELECT {id}::uuid, {consumer_type}::varchar, {fingerprint}::bytea FROM claimed WHERE {fingerprint}::bytea IS NOT NULL
    ON CONFLICT (id, consumer_type) DO UPDATE SET fingerprint = EXCLUDED.fingerprint
)"
        )
    };
    format!("WITH {claim}, effect AS (\n{effect}\n)\nSELECT EXISTS (SELECT 1 FROM claimed)")
}

/// A message's effect with no claim around it (`Effect::make_unguarded`): `claimed` is one row, always. At least
/// once: what a consumer without an inbox does, which the bench measures the claim against.
pub(super) fn effect_alone(effect: &str) -> String {
    format!("WITH claimed AS (SELECT), effect AS (\n{effect}\n)\nSELECT true")
}

/// The statements `claim_with_effect` and `effect_alone` built, once each per effect, kept for the process: one per
/// effect statement the program has (they are `'static`), so the cache is bounded.
static BUILT: std::sync::LazyLock<std::sync::Mutex<HashMap<BuiltKey, Arc<str>>>> =
    std::sync::LazyLock::new(Default::default);

/// An effect statement, its parameter count, and what is built around it.
type BuiltKey = (&'static str, usize, Build);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Build {
    Claim,
    ClaimTimed,
    Alone,
}

fn built(effect: &'static str, own: usize, build: Build) -> Arc<str> {
    let mut cache = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    Arc::clone(cache.entry((effect, own, build)).or_insert_with(|| {
        match build {
            Build::Claim => claim_with_effect(effect, own, false),
            Build::ClaimTimed => claim_with_effect(effect, own, true),
            Build::Alone => effect_alone(effect),
        }
        .into()
    }))
}

/// Claims `key` and makes the effect `effect` (its statement, with its own arguments bound) in one statement
/// (`claim_with_effect`); whether the key was claimed, and so the effect made.
pub async fn claim_with(
    conn: &mut PgConnection,
    key: &Key,
    consumer_type: &ConsumerType,
    effect: &'static str,
    mut args: PgArguments,
) -> sqlx::Result<bool> {
    let own = args.len();
    let build = if key.time.is_some() {
        Build::ClaimTimed
    } else {
        Build::Claim
    };
    let statement = built(effect, own, build);
    let encoded = args
        .add(key.message_id)
        .and_then(|()| args.add(consumer_type.as_str()))
        .and_then(|()| args.add(key.fingerprint.map(|f| f.as_bytes().to_vec())))
        .and_then(|()| key.time.map_or(Ok(()), |time| args.add(time)));
    encoded.map_err(sqlx::Error::Encode)?;
    let query = sql::query_scalar_with(AssertSqlSafe(statement), args);
    unit!(conn, |conn| query.fetch_one(conn))
}

/// Makes the effect `effect` with no claim (`effect_alone`): at least once.
pub async fn effect_alone_with(
    conn: &mut PgConnection,
    effect: &'static str,
    args: PgArguments,
) -> sqlx::Result<()> {
    let statement = built(effect, args.len(), Build::Alone);
    let query = sql::query_scalar_with::<bool>(AssertSqlSafe(statement), args);
    unit!(conn, |conn| query.fetch_one(conn)).map(drop)
}

/// What a claim's transaction sets for itself (`SET LOCAL`, in its `BEGIN`'s round trip), for connections that keep no
/// session setting — a transaction pooler's — where it cannot be given at connection start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerTransaction {
    /// The claim's bound on waiting for another attempt at the same key (`lock_timeout`).
    pub lock_timeout: Option<Duration>,
    /// The commit returns only once it is on this server's disk (`synchronous_commit = local`): where the sessions'
    /// own setting is `off`, under which an acknowledged message's effect could be lost in a crash
    /// ([`super::pooler::make_commits_durable`]).
    pub durable_commit: bool,
}

impl PerTransaction {
    /// `lock_timeout` for each claim transaction (`None`: the session's own), durable as the store's transactions
    /// are ([`super::pooler::durable_commits`]).
    pub fn now(lock_timeout: Option<Duration>) -> Self {
        Self {
            lock_timeout,
            durable_commit: super::pooler::durable_commits(),
        }
    }

    /// Nothing to set: a plain `BEGIN`, or none at all where a statement is its own transaction.
    pub fn is_empty(&self) -> bool {
        self.lock_timeout.is_none() && !self.durable_commit
    }

    /// `BEGIN` and what the transaction sets for itself, in one round trip.
    fn begin_statement(&self) -> String {
        let mut statement = String::from("BEGIN");
        if let Some(timeout) = self.lock_timeout {
            statement.push_str(&format!(
                "; SET LOCAL lock_timeout = {}",
                timeout.as_millis().max(1)
            ));
        }
        if self.durable_commit {
            statement.push_str("; SET LOCAL synchronous_commit = local");
        }
        statement
    }
}

/// The statements built around a value, each with a sample one, for [`super::statements`]; simple queries.
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    let both = PerTransaction {
        lock_timeout: Some(Duration::from_secs(30)),
        durable_commit: true,
    };
    vec![("begin_statement", both.begin_statement())]
}

/// The claim built around an effect, with the carrier's as the sample, plain and timed; and an effect alone.
pub(super) fn built_with_effect() -> Vec<(&'static str, String)> {
    let sample = super::effects::CARRIER_RESERVATION_EFFECT;
    vec![
        ("claim_with_effect", claim_with_effect(sample, 5, false)),
        (
            "claim_with_effect_TIMED",
            claim_with_effect(sample, 5, true),
        ),
        ("effect_alone", effect_alone(sample)),
    ]
}

/// Begins a claim's transaction: setting for itself what `settings` holds (`SET LOCAL`), else bounded by the session's
/// own (`Database::with_lock_timeout`, `Database::with_durable_commits`).
pub async fn begin<'c>(
    conn: &'c mut PgConnection,
    settings: &PerTransaction,
) -> sqlx::Result<Transaction<'c, Postgres>> {
    // On a connection still inside a transaction, sqlx's `begin` makes a savepoint, and the claim's COMMIT would
    // commit nothing. (The inbox closes such a connection rather than give it back; this is the last line.)
    if conn.is_in_transaction() {
        return Err(sqlx::Error::Protocol(LEFT_OPEN_BY_THE_WORK.to_owned()));
    }
    if settings.is_empty() {
        conn.begin().await
    } else {
        conn.begin_with(AssertSqlSafe(settings.begin_statement()))
            .await
    }
}

/// One message's key: its id, its event's fingerprint if known, and on a partitioned inbox its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub message_id: Uuid,
    pub fingerprint: Option<Fingerprint>,
    /// The time the partitioned inbox keys the message on; `None` on an unpartitioned inbox.
    pub time: Option<DateTime<Utc>>,
}

/// Claims `(message_id, consumer_type)` — on a partitioned inbox with the key's time — and keeps the fingerprint
/// beside it (`CLAIM`, `CLAIM_TIMED`); `false`: a committed claim holds the key (after waiting for an uncommitted one
/// to end).
pub async fn claim(
    conn: &mut PgConnection,
    key: &Key,
    consumer_type: &ConsumerType,
) -> sqlx::Result<bool> {
    let statement = if key.time.is_some() {
        CLAIM_TIMED
    } else {
        CLAIM
    };
    let query = sql::query_scalar(statement)
        .bind(key.message_id)
        .bind(consumer_type.as_str())
        .bind(key.fingerprint.map(|f| f.as_bytes().to_vec()));
    let query = match key.time {
        Some(time) => query.bind(time),
        None => query,
    };
    unit!(conn, |conn| query.fetch_one(conn))
}

/// Records a copy whose key a committed claim holds (`RECORD_COPY`, `RECORD_COPY_TIMED`); returns the fingerprint
/// the key was claimed with, if known.
pub async fn record_copy(
    conn: &mut PgConnection,
    key: &Key,
    consumer_type: &ConsumerType,
) -> sqlx::Result<Option<Fingerprint>> {
    let statement = if key.time.is_some() {
        RECORD_COPY_TIMED
    } else {
        RECORD_COPY
    };
    let query = sql::query_scalar(statement)
        .bind(key.message_id)
        .bind(consumer_type.as_str())
        .bind(key.fingerprint.map(|f| f.as_bytes().to_vec()));
    let query = match key.time {
        Some(time) => query.bind(time),
        None => query,
    };
    let first: Option<Vec<u8>> = unit!(conn, |conn| query.fetch_one(conn))?;
    Ok(first.as_deref().and_then(Fingerprint::from_slice))
}

/// A batch's keys as the batch statements take them: arrays of ids, fingerprints (unknown: empty) and, on a
/// partitioned inbox, times.
struct Arrays {
    ids: Vec<Uuid>,
    fingerprints: Vec<Vec<u8>>,
    times: Option<Vec<DateTime<Utc>>>,
}

fn arrays(keys: &[Key]) -> Arrays {
    let times: Option<Vec<DateTime<Utc>>> = keys.iter().map(|k| k.time).collect();
    Arrays {
        ids: keys.iter().map(|k| k.message_id).collect(),
        fingerprints: keys
            .iter()
            .map(|k| {
                k.fingerprint
                    .map(|f| f.as_bytes().to_vec())
                    .unwrap_or_default()
            })
            .collect(),
        times: times.filter(|_| keys.first().is_some_and(|k| k.time.is_some())),
    }
}

/// Claims every key of a batch in one statement, in the order of `keys` (`CLAIM_BATCH`, `CLAIM_BATCH_TIMED`);
/// returns the ids claimed. The keys are all timed (a partitioned inbox) or none.
pub async fn claim_batch(
    conn: &mut PgConnection,
    keys: &[Key],
    consumer_type: &ConsumerType,
) -> sqlx::Result<HashSet<Uuid>> {
    let a = arrays(keys);
    let statement = if a.times.is_some() {
        CLAIM_BATCH_TIMED
    } else {
        CLAIM_BATCH
    };
    let query = sql::query_scalar(statement)
        .bind(a.ids)
        .bind(consumer_type.as_str())
        .bind(a.fingerprints);
    let query = match a.times {
        Some(times) => query.bind(times),
        None => query,
    };
    let claimed: Vec<Uuid> = unit!(conn, |conn| query.fetch_all(conn))?;
    Ok(claimed.into_iter().collect())
}

/// Records the members of a batch whose keys a committed claim held (`RECORD_BATCH_COPIES`,
/// `RECORD_BATCH_COPIES_TIMED`); returns the fingerprint each was first claimed with, if known.
pub async fn record_batch_copies(
    conn: &mut PgConnection,
    copies: &[Key],
    consumer_type: &ConsumerType,
) -> sqlx::Result<HashMap<Uuid, Option<Fingerprint>>> {
    let a = arrays(copies);
    let statement = if a.times.is_some() {
        RECORD_BATCH_COPIES_TIMED
    } else {
        RECORD_BATCH_COPIES
    };
    let query = sql::query_as(statement)
        .bind(a.ids)
        .bind(consumer_type.as_str())
        .bind(a.fingerprints);
    let query = match a.times {
        Some(times) => query.bind(times),
        None => query,
    };
    let rows: Vec<(Uuid, Option<Vec<u8>>)> = unit!(conn, |conn| query.fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(id, first)| (id, first.as_deref().and_then(Fingerprint::from_slice)))
        .collect())
}
