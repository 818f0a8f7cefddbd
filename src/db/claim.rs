//! The claim's statements: the inbox row and its fingerprint, taken for one message or a batch, and the copies
//! recorded. The protocol that orders them is `inbox`'s.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::postgres::{PgConnection, Postgres};
use sqlx::{AssertSqlSafe, Connection as _, Transaction};
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
SELECT EXISTS (SELECT 1 FROM claim)";

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
SELECT id FROM claim";

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
}

/// `BEGIN` and the transaction's own `lock_timeout`, in one round trip: for connections that keep no session setting
/// (a transaction pooler's), where the claim's bound on waiting for another attempt cannot be given at connection start.
fn begin_with_lock_timeout(timeout: Duration) -> String {
    format!(
        "BEGIN; SET LOCAL lock_timeout = {}",
        timeout.as_millis().max(1)
    )
}

/// The statements built around a value, each with a sample one, for [`super::statements`]; simple queries.
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    vec![(
        "begin_with_lock_timeout",
        begin_with_lock_timeout(Duration::from_secs(30)),
    )]
}

/// Begins a claim's transaction: with `lock_timeout` set for it alone (`SET LOCAL`) when given, else bounded by the
/// session's own (`Database::with_lock_timeout`).
pub async fn begin(
    conn: &mut PgConnection,
    lock_timeout: Option<Duration>,
) -> sqlx::Result<Transaction<'_, Postgres>> {
    match lock_timeout {
        None => conn.begin().await,
        Some(timeout) => {
            conn.begin_with(AssertSqlSafe(begin_with_lock_timeout(timeout)))
                .await
        }
    }
}

/// One key of a batch: a message id and its event's fingerprint, if known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub message_id: Uuid,
    pub fingerprint: Option<Fingerprint>,
}

/// Claims `(message_id, consumer_type)` and keeps `fingerprint` beside it (`CLAIM`); `false`: a committed claim
/// holds the key (after waiting for an uncommitted one to end).
pub async fn claim(
    conn: &mut PgConnection,
    message_id: Uuid,
    consumer_type: &ConsumerType,
    fingerprint: Option<&Fingerprint>,
) -> sqlx::Result<bool> {
    unit!(conn, |conn| sql::query_scalar(CLAIM)
        .bind(message_id)
        .bind(consumer_type.as_str())
        .bind(fingerprint.map(|f| f.as_bytes().as_slice()))
        .fetch_one(conn))
}

/// Records a copy whose key a committed claim holds (`RECORD_COPY`); returns the fingerprint the key was claimed
/// with, if known.
pub async fn record_copy(
    conn: &mut PgConnection,
    message_id: Uuid,
    consumer_type: &ConsumerType,
    fingerprint: Option<&Fingerprint>,
) -> sqlx::Result<Option<Fingerprint>> {
    let first: Option<Vec<u8>> = unit!(conn, |conn| sql::query_scalar(RECORD_COPY)
        .bind(message_id)
        .bind(consumer_type.as_str())
        .bind(fingerprint.map(|f| f.as_bytes().as_slice()))
        .fetch_one(conn))?;
    Ok(first.as_deref().and_then(Fingerprint::from_slice))
}

/// Ids and fingerprints as the batch statements take them: two arrays, an unknown fingerprint as an empty one.
fn arrays(keys: &[Key]) -> (Vec<Uuid>, Vec<Vec<u8>>) {
    keys.iter()
        .map(|k| {
            let fingerprint = k.fingerprint.map(|f| f.as_bytes().to_vec());
            (k.message_id, fingerprint.unwrap_or_default())
        })
        .unzip()
}

/// Claims every key of a batch in one statement, in the order of `keys` (`CLAIM_BATCH`); returns the ids claimed.
pub async fn claim_batch(
    conn: &mut PgConnection,
    keys: &[Key],
    consumer_type: &ConsumerType,
) -> sqlx::Result<HashSet<Uuid>> {
    let (ids, fingerprints) = arrays(keys);
    Ok(unit!(conn, |conn| sql::query_scalar(CLAIM_BATCH)
        .bind(&ids)
        .bind(consumer_type.as_str())
        .bind(&fingerprints)
        .fetch_all(conn))?
    .into_iter()
    .collect())
}

/// Records the members of a batch whose keys a committed claim held (`RECORD_BATCH_COPIES`); returns the
/// fingerprint each was first claimed with, if known.
pub async fn record_batch_copies(
    conn: &mut PgConnection,
    copies: &[Key],
    consumer_type: &ConsumerType,
) -> sqlx::Result<HashMap<Uuid, Option<Fingerprint>>> {
    let (ids, fingerprints) = arrays(copies);
    let rows: Vec<(Uuid, Option<Vec<u8>>)> =
        unit!(conn, |conn| sql::query_as(RECORD_BATCH_COPIES)
            .bind(&ids)
            .bind(consumer_type.as_str())
            .bind(&fingerprints)
            .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(id, first)| (id, first.as_deref().and_then(Fingerprint::from_slice)))
        .collect())
}
