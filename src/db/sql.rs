//! Every SQL statement inboxctl sends, in one place. All of them take their values as parameters.

/// The claim. Inserts the inbox row — with `processed_at` already set, because nobody sees the row before it commits,
/// and it commits only together with the consumer's effects — and, beside it, the fingerprint of the message's event
/// (when given), so that a later copy of another event under the same id can be told from a copy of this one. A copy
/// whose key is held by an uncommitted attempt waits here for that attempt's outcome: it claims the key if the attempt
/// rolls back, and is a copy ([`RECORD_COPY`]) if it commits.
///
/// Returns whether the key was claimed. `$1` message id, `$2` consumer_type, `$3` fingerprint (null: unknown).
pub const CLAIM: &str = "\
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

/// A copy whose key a committed claim holds: recorded as a `duplicate`, or as a `conflict` when the claim kept another
/// fingerprint than this copy's (both known). A statement of its own after the claim, because the claim's snapshot
/// predates the attempt it waited for. Returns the fingerprint the key was claimed with (null: unknown).
/// `$1` message id, `$2` consumer_type, `$3` this copy's fingerprint (null: unknown).
pub const RECORD_COPY: &str = "\
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
pub const CLAIM_BATCH: &str = "\
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

/// [`RECORD_COPY`] for the members of a batch whose keys a committed claim held. Returns each id with the
/// fingerprint it was claimed with. `$1` message ids, `$2` consumer_type, `$3` their fingerprints (empty: unknown).
pub const RECORD_BATCH_COPIES: &str = "\
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

/// Each member of a batch works inside this savepoint (one name, reused: a new savepoint shadows the last).
pub const SAVEPOINT: &str = "SAVEPOINT inbox_member";
pub const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT inbox_member";

/// Takes back the claim of a batch member whose work failed, and its fingerprint, inside the batch's transaction.
/// `$1` message id, `$2` consumer_type.
pub const UNCLAIM: &str = "\
WITH fingerprint AS (DELETE FROM inboxctl_fingerprints WHERE id = $1 AND consumer_type = $2)
DELETE FROM inbox_messages WHERE id = $1 AND consumer_type = $2";

/// Records one event of a consumer (`failed`, `dead_lettered`, `skipped`) in a statement of its own.
/// `$1` consumer_type, `$2` kind, `$3` message id (null when the message had none), `$4` detail.
pub const RECORD_EVENT: &str = "\
INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail) VALUES ($1, $2, $3, $4)";

/// A redelivered message starts: counts the starts that have not reached an outcome, and returns them with those made
/// alone. `$1` consumer_type, `$2` message id. Committed on its own, before the work, so a start that ends the process
/// stays counted.
pub const REDELIVERED_START: &str = "\
INSERT INTO inboxctl_attempts (consumer_type, message_id, started) VALUES ($1, $2, 1)
ON CONFLICT (consumer_type, message_id)
DO UPDATE SET started = inboxctl_attempts.started + 1, last_started_at = now()
RETURNING started, alone";

/// A redelivered message starts alone (nothing else in flight in its process). `$1` consumer_type, `$2` message id.
pub const REDELIVERED_ALONE: &str =
    "UPDATE inboxctl_attempts SET alone = alone + 1 WHERE consumer_type = $1 AND message_id = $2";

/// Starts abandoned by a clean stop (not ended by a crash) taken back. `$1` consumer_type, `$2` message ids, `$3` for
/// each, 1 if the start was also counted as made alone.
pub const REDELIVERED_ABANDONED: &str = "\
UPDATE inboxctl_attempts a
SET started = greatest(a.started - 1, 0), alone = greatest(a.alone - s.alone, 0)
FROM unnest($2::uuid[], $3::int[]) AS s(message_id, alone)
WHERE a.consumer_type = $1 AND a.message_id = s.message_id";

/// `cleanup`: start counts of messages that never came back. `$1` consumer_type, `$2` cutoff.
pub const DELETE_OLD_ATTEMPTS: &str =
    "DELETE FROM inboxctl_attempts WHERE consumer_type = $1 AND last_started_at < $2";

/// A redelivered message came through an attempt alive: its count goes. `$1` consumer_type, `$2` message id.
pub const REDELIVERED_DONE: &str =
    "DELETE FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2";

/// Registers a consumer process's consumer_type and queue, so `stats` knows which consumer_types have counters and
/// which queue each reads. `$1` consumer_type, `$2` queue.
pub const REGISTER_CONSUMER: &str = "\
INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
VALUES ($1, $2, now(), now())
ON CONFLICT (consumer_type) DO UPDATE SET queue = EXCLUDED.queue, last_seen_at = now()";

/// The carrier stand-in's booking. `$1` parcel id, `$2` slot id, `$3` pickup time, `$4` message id,
/// `$5` idempotency key.
pub const INSERT_CARRIER_RESERVATION: &str = "\
INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)
VALUES ($1, $2, $3, $4, $5)";

/// The SMS stand-in's record. `$1` parcel id, `$2` tracking number, `$3` text, `$4` message id, `$5` idempotency key.
pub const INSERT_NOTIFICATION_SENT: &str = "\
INSERT INTO notifications_sent (parcel_id, tracking_number, body, message_id, idempotency_key)
VALUES ($1, $2, $3, $4, $5)";

/// Whether a relation is visible on the search path. `$1` name.
pub const TABLE_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL";

/// The columns of `inbox_messages`: name, SQL type, NOT NULL, has a default.
pub const INBOX_COLUMNS: &str = "\
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
FROM pg_attribute a
WHERE a.attrelid = to_regclass('inbox_messages') AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum";

/// The primary key of `inbox_messages`: its name and its columns in key order.
pub const INBOX_PRIMARY_KEY: &str = "\
SELECT c.conname::text, array_agg(a.attname::text ORDER BY k.ord)
FROM pg_constraint c
CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
WHERE c.conrelid = to_regclass('inbox_messages') AND c.contype = 'p'
GROUP BY c.conname";

/// The versions recorded as applied by inboxctl's migrations.
pub const APPLIED_MIGRATIONS: &str =
    "SELECT version FROM inboxctl_migrations WHERE success ORDER BY version";

/// Serialises `migrate` runs against one database: one applies, the others wait and then find nothing to do. Taken
/// with a try in a loop, not a blocking wait: a session blocked in a statement holds a snapshot, and
/// `CREATE INDEX CONCURRENTLY` in the other run would wait for that snapshot while it waits for the lock.
pub const MIGRATE_TRY_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
pub const MIGRATE_UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// Indexes on `inbox_messages` left invalid by an interrupted `CREATE INDEX CONCURRENTLY`. `$1` index names.
pub const INVALID_INBOX_INDEXES: &str = "\
SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass('inbox_messages') AND NOT i.indisvalid AND c.relname = ANY($1)";

/// `DROP INDEX CONCURRENTLY` of an index name known to inboxctl (never one taken from input).
pub fn drop_index_concurrently(name: &str) -> String {
    format!("DROP INDEX CONCURRENTLY IF EXISTS {}", quote_ident(name))
}

/// Whether a database exists. `$1` name.
pub const DATABASE_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)";

/// Rows each consumer wrote for a set of parcels (the demo's tally). `$1` parcel ids.
pub const COUNT_CARRIER_RESERVATIONS_FOR: &str =
    "SELECT count(*) FROM carrier_reservations WHERE parcel_id = ANY($1)";
pub const COUNT_NOTIFICATIONS_SENT_FOR: &str =
    "SELECT count(*) FROM notifications_sent WHERE parcel_id = ANY($1)";

/// Duplicates discarded for a set of message ids. `$1` message ids.
pub const COUNT_DUPLICATES_FOR: &str =
    "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate' AND message_id = ANY($1)";

/// The cleanup's cutoff, on the database's clock. `$1` retention in seconds.
pub const CUTOFF: &str = "SELECT now() - make_interval(secs => $1)";

/// Every consumer_type with inbox rows, events or a registration. The inbox and the events are walked with a loose
/// index scan (one index probe per distinct value), not a scan of every row.
pub const CONSUMER_TYPES: &str = "\
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
/// [`CLEANUP_TRY_LOCK`], and locking them first would write each row once more.
/// The batch's fingerprints go with it, found through their key.
pub const DELETE_PROCESSED_BATCH: &str = "\
WITH batch AS (
    SELECT ctid, id FROM inbox_messages
    WHERE consumer_type = $1 AND processed_at < $2
    LIMIT $3
), fingerprints AS (
    DELETE FROM inboxctl_fingerprints f USING batch WHERE f.consumer_type = $1 AND f.id = batch.id
)
DELETE FROM inbox_messages WHERE ctid = ANY (ARRAY (SELECT ctid FROM batch))";

/// The same for inboxctl's own event rows.
pub const DELETE_EVENTS_BATCH: &str = "\
DELETE FROM inboxctl_events WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM inboxctl_events
    WHERE consumer_type = $1 AND occurred_at < $2
    LIMIT $3))";

/// One cleanup at a time per consumer_type (per database): a second one skips a consumer_type another is cleaning,
/// rather than waiting on it or deleting the same rows. `$1` consumer_type.
pub const CLEANUP_TRY_LOCK: &str =
    "SELECT pg_try_advisory_lock(hashtextextended('inboxctl cleanup: ' || $1, 0))";
/// Releases the cleanup's locks: every advisory lock of the session, which holds nothing else.
pub const CLEANUP_UNLOCK_ALL: &str = "SELECT pg_advisory_unlock_all()";

/// What a cleanup would delete (`--dry-run`). `$1` consumer_type, `$2` cutoff.
pub const COUNT_PROCESSED_BEFORE: &str =
    "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1 AND processed_at < $2";
pub const COUNT_EVENTS_BEFORE: &str =
    "SELECT count(*) FROM inboxctl_events WHERE consumer_type = $1 AND occurred_at < $2";

/// Rows received before the cutoff and never processed, and the oldest of them. `$1` consumer_type, `$2` cutoff.
pub const UNPROCESSED_BEFORE: &str = "\
SELECT count(*), min(received_at) FROM inbox_messages
WHERE consumer_type = $1 AND processed_at IS NULL AND received_at < $2";

/// consumer_types with inbox rows, by a loose index scan on `(consumer_type, processed_at)`.
pub const INBOX_CONSUMER_TYPES: &str = "\
WITH RECURSIVE inbox AS (
    (SELECT consumer_type FROM inbox_messages ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT i.consumer_type FROM inbox_messages i
            WHERE i.consumer_type > inbox.consumer_type ORDER BY i.consumer_type LIMIT 1)
    FROM inbox WHERE inbox.consumer_type IS NOT NULL
)
SELECT consumer_type::text FROM inbox WHERE consumer_type IS NOT NULL";

/// The consumer_types inboxctl consumers ran as, with their queue.
pub const REGISTERED_CONSUMERS: &str = "SELECT consumer_type::text, queue FROM inboxctl_consumers";

/// The planner's statistics of the inbox: total rows, rows of the unprocessed index, and the most common
/// consumer_types with their frequencies (nothing is counted).
pub const INBOX_ESTIMATES: &str = "\
SELECT c.reltuples::float8,
       (SELECT reltuples::float8 FROM pg_class WHERE oid = to_regclass('ix_inbox_messages_unprocessed')),
       s.most_common_vals::text::text[], s.most_common_freqs, s.null_frac, s.n_distinct
FROM pg_class c
LEFT JOIN pg_stats s ON s.schemaname = c.relnamespace::regnamespace::text
                    AND s.tablename = 'inbox_messages' AND s.attname = 'consumer_type'
WHERE c.oid = to_regclass('inbox_messages')";

/// Rows of a consumer_type, counted through the index and never past `$2`. `$1` consumer_type.
pub const COUNT_ROWS_CAPPED: &str =
    "SELECT count(*) FROM (SELECT 1 FROM inbox_messages WHERE consumer_type = $1 LIMIT $2) t";

/// Unprocessed rows of a consumer_type, never counting past `$2`.
pub const COUNT_UNPROCESSED_CAPPED: &str = "\
SELECT count(*) FROM (SELECT 1 FROM inbox_messages WHERE consumer_type = $1 AND processed_at IS NULL LIMIT $2) t";

/// Seconds since the oldest unprocessed row of a consumer_type was received.
pub const OLDEST_UNPROCESSED_AGE: &str = "\
SELECT extract(epoch FROM now() - received_at)::float8 FROM inbox_messages
WHERE consumer_type = $1 AND processed_at IS NULL ORDER BY received_at LIMIT 1";

/// Processed rows of a consumer_type in the last `$2` seconds, per bucket of `$3` seconds (0 = newest).
pub const PROCESSED_SERIES: &str = "\
SELECT floor(extract(epoch FROM now() - processed_at) / $3)::int, count(*)
FROM inbox_messages
WHERE consumer_type = $1 AND processed_at > now() - make_interval(secs => $2)
GROUP BY 1";

/// Events of a consumer_type in the last `$2` seconds, per kind and bucket of `$3` seconds (0 = newest).
pub const EVENT_SERIES: &str = "\
SELECT kind, floor(extract(epoch FROM now() - occurred_at) / $3)::int, count(*)
FROM inboxctl_events
WHERE consumer_type = $1 AND occurred_at > now() - make_interval(secs => $2)
GROUP BY 1, 2";

/// `CREATE DATABASE` cannot take its name as a parameter; the name is quoted as an identifier instead.
pub fn create_database(name: &str) -> String {
    format!("CREATE DATABASE {}", quote_ident(name))
}

/// An identifier quoted for PostgreSQL: wrapped in double quotes, inner double quotes doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The privileges of `$1` (tables) × `$2` (privileges, comma-separated, per table) the current role lacks, per table,
/// for the tables that exist. One row per table: (table, missing privileges).
pub const MISSING_PRIVILEGES: &str = "\
SELECT need.t, string_agg(p.privilege, ', ' ORDER BY p.n)
FROM unnest($1::text[], $2::text[]) AS need(t, privileges)
CROSS JOIN LATERAL unnest(string_to_array(need.privileges, ',')) WITH ORDINALITY AS p(privilege, n)
WHERE to_regclass(need.t) IS NOT NULL AND NOT has_table_privilege(need.t, p.privilege)
GROUP BY need.t
ORDER BY min(array_position($1::text[], need.t))";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("parceltracker"), "\"parceltracker\"");
        assert_eq!(
            quote_ident("a\"; DROP TABLE x; --"),
            "\"a\"\"; DROP TABLE x; --\""
        );
        assert_eq!(create_database("My DB"), "CREATE DATABASE \"My DB\"");
    }
}
