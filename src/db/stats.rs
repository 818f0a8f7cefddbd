//! What `stats` and `top` read: the consumer_types, capped row counts, the planner's estimates, the age of the oldest
//! unprocessed row, and the series of processed rows and events per bucket of time.

use std::collections::HashMap;
use std::time::Duration;

use super::{Exec, sql};

statements! {
    /// Whether `inbox_messages` has the index every refresh's figures are read through, built and valid (a .NET
    /// service's table before `migrate` has none).
    const CONSUMER_TYPE_INDEX_READY = "\
SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               WHERE i.indrelid = to_regclass('inbox_messages') AND i.indisvalid
                 AND c.relname = 'ix_inbox_messages_consumer_type_processed_at')";

    /// consumer_types with inbox rows, by a loose index scan on `(consumer_type, processed_at)`.
    pub const INBOX_CONSUMER_TYPES = "\
WITH RECURSIVE inbox AS (
    (SELECT consumer_type FROM inbox_messages ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT i.consumer_type FROM inbox_messages i
            WHERE i.consumer_type > inbox.consumer_type ORDER BY i.consumer_type LIMIT 1)
    FROM inbox WHERE inbox.consumer_type IS NOT NULL
)
SELECT consumer_type::text FROM inbox WHERE consumer_type IS NOT NULL";

    /// Without that index (a .NET service's table before `migrate`): every consumer_type's rows, unprocessed rows and
    /// the age of its oldest unprocessed row, read in one pass over the table (a null consumer_type, which a service's
    /// table may allow, passed over as the loose scan passes it). The statements above would each read
    /// the whole table instead — the loose scan once per consumer_type, and each capped count again. A time of
    /// `-infinity` or `infinity` has no age, as in `OLDEST_UNPROCESSED_AGE`.
    const WHOLE_INBOX_BY_CONSUMER_TYPE = "\
SELECT consumer_type::text, count(*), count(*) FILTER (WHERE processed_at IS NULL),
       extract(epoch FROM now() - min(received_at) FILTER (
           WHERE processed_at IS NULL AND received_at > '-infinity' AND received_at < 'infinity'))::float8
FROM inbox_messages WHERE consumer_type IS NOT NULL GROUP BY 1";

    /// The consumer_types inboxctl consumers ran as, with their queue.
    const REGISTERED_CONSUMERS = "SELECT consumer_type::text, queue FROM inboxctl_consumers";

    /// The registered consumer_types whose vhost was recorded, with it (through `to_jsonb`, as below).
    const REGISTERED_VHOSTS = "\
SELECT consumer_type::text, to_jsonb(c) ->> 'vhost' FROM inboxctl_consumers c
WHERE to_jsonb(c) ->> 'vhost' IS NOT NULL";

    /// The queues each registered consumer_type's consumers read before the one they read now, each with its vhost
    /// (null: not recorded), through `to_jsonb` as above (none on a database migrated before migration 14). At most
    /// 10,000: one per queue a consumer_type ever moved from.
    const REGISTERED_EARLIER = "\
SELECT c.consumer_type::text, e ->> 'queue', e ->> 'vhost'
FROM inboxctl_consumers c,
     jsonb_array_elements(CASE WHEN jsonb_typeof(to_jsonb(c) -> 'earlier_queues') = 'array'
                               THEN to_jsonb(c) -> 'earlier_queues' ELSE '[]' END) e
WHERE jsonb_typeof(e) = 'object' AND e ->> 'queue' IS NOT NULL
LIMIT 10000";

    /// The registered consumer_types whose queue is spread over partitions, with how many. Read through `to_jsonb`
    /// so that a database migrated before the column existed answers "none" rather than failing.
    const REGISTERED_PARTITIONS = "\
SELECT consumer_type::text, (to_jsonb(c) ->> 'partitions')::int FROM inboxctl_consumers c
WHERE to_jsonb(c) ->> 'partitions' IS NOT NULL";

    /// The planner's statistics of the inbox, one row per table holding its rows — the table itself, or each
    /// partition of a partitioned inbox: rows, rows of the unprocessed index, and the most common consumer_types with
    /// their frequencies (nothing is counted). `pg_stats` names a schema raw: joined by `nspname`, not by
    /// `regnamespace::text`, which quotes a name that needs it (EF Core's `Messaging`) and never matched it.
    pub const INBOX_ESTIMATES = "\
WITH parts AS (
    SELECT c.oid, c.relname, c.relnamespace, c.reltuples FROM pg_class c
    WHERE c.oid = to_regclass('inbox_messages') AND c.relkind <> 'p'
    UNION ALL
    SELECT c.oid, c.relname, c.relnamespace, c.reltuples
    FROM pg_partition_tree(to_regclass('inbox_messages')) t JOIN pg_class c ON c.oid = t.relid
    WHERE t.isleaf AND t.level > 0
)
SELECT p.reltuples::float8,
       (SELECT ic.reltuples::float8 FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
        WHERE i.indrelid = p.oid
          AND (i.indexrelid = to_regclass('ix_inbox_messages_unprocessed')
               OR i.indexrelid IN (SELECT relid FROM pg_partition_tree(to_regclass('ix_inbox_messages_unprocessed'))))
        LIMIT 1),
       s.most_common_vals::text::text[], s.most_common_freqs, s.null_frac, s.n_distinct
FROM parts p
JOIN pg_namespace n ON n.oid = p.relnamespace
LEFT JOIN pg_stats s ON s.schemaname = n.nspname
                    AND s.tablename = p.relname AND s.attname = 'consumer_type' AND NOT s.inherited";

    /// Rows of a consumer_type, counted through the index and never past `$2`. `$1` consumer_type.
    pub const COUNT_ROWS_CAPPED =
    "SELECT count(*) FROM (SELECT 1 FROM inbox_messages WHERE consumer_type = $1 LIMIT $2) t";

    /// Unprocessed rows of a consumer_type, never counting past `$2`.
    pub const COUNT_UNPROCESSED_CAPPED = "\
SELECT count(*) FROM (SELECT 1 FROM inbox_messages WHERE consumer_type = $1 AND processed_at IS NULL LIMIT $2) t";

    /// Seconds since the oldest unprocessed row of a consumer_type was received. A time of `-infinity` or
    /// `infinity` (what Npgsql writes for .NET's `DateTime.MinValue`/`MaxValue`) has no age: passed over, since
    /// PostgreSQL refuses to subtract it and one such row would blank every figure.
    pub const OLDEST_UNPROCESSED_AGE = "\
SELECT extract(epoch FROM now() - received_at)::float8 FROM inbox_messages
WHERE consumer_type = $1 AND processed_at IS NULL AND received_at > '-infinity' AND received_at < 'infinity'
ORDER BY received_at LIMIT 1";

    /// Processed rows of a consumer_type in the last `$2` seconds, per bucket of `$3` seconds (0 = newest), of the
    /// newest `$4` only (what a refresh reads stays bounded however busy the consumer_type is), with the age in
    /// seconds of each bucket's oldest row read. A row stamped after the database's now (another writer's clock
    /// ahead, or `infinity`) counts once its time has come.
    pub const PROCESSED_SERIES = "\
SELECT floor(extract(epoch FROM now() - processed_at) / $3)::int, count(*),
       max(extract(epoch FROM now() - processed_at))::float8
FROM (
    SELECT processed_at FROM inbox_messages
    WHERE consumer_type = $1 AND processed_at > now() - make_interval(secs => $2) AND processed_at <= now()
    ORDER BY processed_at DESC LIMIT $4
) newest
GROUP BY 1";

    /// Events of a consumer_type in the last `$2` seconds, per kind and bucket of `$3` seconds (0 = newest), of the
    /// newest `$4` only, with the age in seconds of each group's oldest event read.
    pub const EVENT_SERIES = "\
SELECT kind, floor(extract(epoch FROM now() - occurred_at) / $3)::int, count(*),
       max(extract(epoch FROM now() - occurred_at))::float8
FROM (
    SELECT kind, occurred_at FROM inboxctl_events
    WHERE consumer_type = $1 AND occurred_at > now() - make_interval(secs => $2)
    ORDER BY occurred_at DESC LIMIT $4
) newest
GROUP BY 1, 2";
}

/// Whether the index the figures are read through is there (`CONSUMER_TYPE_INDEX_READY`).
pub async fn consumer_type_index_ready(executor: impl Into<Exec<'_>>) -> sqlx::Result<bool> {
    let query = sql::query_scalar(CONSUMER_TYPE_INDEX_READY);
    unit!(executor, |conn| query.fetch_one(conn))
}

/// One consumer_type's figures read in [`whole_inbox_by_consumer_type`]'s one pass.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WholeCounts {
    pub rows: u64,
    pub unprocessed: u64,
    /// Seconds since its oldest unprocessed row with a finite time was received.
    pub oldest_unprocessed_seconds: Option<f64>,
}

/// Every consumer_type's figures in one pass over the table (`WHOLE_INBOX_BY_CONSUMER_TYPE`): for a table without the
/// `(consumer_type, processed_at)` index.
pub async fn whole_inbox_by_consumer_type(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<HashMap<String, WholeCounts>> {
    let rows: Vec<(String, i64, i64, Option<f64>)> =
        unit!(executor, |conn| sql::query_as(WHOLE_INBOX_BY_CONSUMER_TYPE)
            .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(consumer_type, rows, unprocessed, oldest)| {
            let counts = WholeCounts {
                rows: rows.unsigned_abs(),
                unprocessed: unprocessed.unsigned_abs(),
                oldest_unprocessed_seconds: oldest,
            };
            (consumer_type, counts)
        })
        .collect())
}

/// consumer_types with inbox rows (`INBOX_CONSUMER_TYPES`).
pub async fn inbox_consumer_types(executor: impl Into<Exec<'_>>) -> sqlx::Result<Vec<String>> {
    unit!(executor, |conn| sql::query_scalar(INBOX_CONSUMER_TYPES)
        .fetch_all(conn))
}

/// Each consumer_type an inboxctl consumer ran as, with the queue it read (`REGISTERED_CONSUMERS`).
pub async fn registered_consumers(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<HashMap<String, String>> {
    let rows: Vec<(String, String)> = unit!(executor, |conn| sql::query_as(REGISTERED_CONSUMERS)
        .fetch_all(conn))?;
    Ok(rows.into_iter().collect())
}

/// Each registered consumer_type whose consumer recorded the vhost of its queue, with it (`REGISTERED_VHOSTS`).
pub async fn registered_vhosts(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<HashMap<String, String>> {
    let rows: Vec<(String, String)> = unit!(executor, |conn| sql::query_as(REGISTERED_VHOSTS)
        .fetch_all(conn))?;
    Ok(rows.into_iter().collect())
}

/// The vhosts a queue a consumer_type read before is to be looked for in: the one recorded with it (`recorded`). One
/// recorded without (read before consumers recorded their vhost) was in a vhost not known: both the one its consumers
/// read in now (`now_in`) and the looker's own (`own`) — in either alone, its failures in the other would read as none.
pub fn earlier_vhosts(recorded: Option<&String>, now_in: &str, own: &str) -> Vec<String> {
    match recorded {
        Some(vhost) => vec![vhost.clone()],
        None if now_in == own => vec![own.to_owned()],
        None => vec![now_in.to_owned(), own.to_owned()],
    }
}

/// The queues each registered consumer_type read before, each with its vhost if recorded (`REGISTERED_EARLIER`).
pub async fn registered_earlier(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<HashMap<String, Vec<(String, Option<String>)>>> {
    let rows: Vec<(String, String, Option<String>)> =
        unit!(executor, |conn| sql::query_as(REGISTERED_EARLIER)
            .fetch_all(conn))?;
    let mut earlier: HashMap<String, Vec<(String, Option<String>)>> = HashMap::new();
    for (consumer_type, queue, vhost) in rows {
        earlier
            .entry(consumer_type)
            .or_default()
            .push((queue, vhost));
    }
    Ok(earlier)
}

/// Each registered consumer_type whose queue is spread over partitions, with their number (`REGISTERED_PARTITIONS`).
pub async fn registered_partitions(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<HashMap<String, u16>> {
    let rows: Vec<(String, i32)> = unit!(executor, |conn| sql::query_as(REGISTERED_PARTITIONS)
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .filter_map(|(consumer_type, n)| Some((consumer_type, u16::try_from(n).ok()?)))
        .collect())
}

/// The planner's statistics of the inbox (`INBOX_ESTIMATES`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Estimates {
    /// reltuples of the table (-1 until it was first vacuumed or analyzed).
    pub rows: f64,
    /// reltuples of the unprocessed index, if it exists.
    pub unprocessed: Option<f64>,
    /// The most common consumer_types and their frequencies.
    pub common_values: Option<Vec<String>>,
    pub common_freqs: Option<Vec<f32>>,
    pub null_frac: Option<f32>,
    pub n_distinct: Option<f32>,
}

type EstimateRow = (
    f64,
    Option<f64>,
    Option<Vec<String>>,
    Option<Vec<f32>>,
    Option<f32>,
    Option<f32>,
);

/// The planner's statistics of the inbox, one for each table holding its rows (the table itself, or each partition of a
/// partitioned inbox); empty when there is no `inbox_messages`.
pub async fn estimates(executor: impl Into<Exec<'_>>) -> sqlx::Result<Vec<Estimates>> {
    let rows: Vec<EstimateRow> = unit!(executor, |conn| sql::query_as(INBOX_ESTIMATES)
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(
            |(rows, unprocessed, common_values, common_freqs, null_frac, n_distinct)| Estimates {
                rows,
                unprocessed,
                common_values,
                common_freqs,
                null_frac,
                n_distinct,
            },
        )
        .collect())
}

/// Rows of a consumer_type, counted up to `cap + 1` (more than `cap` means at least that many)
/// (`COUNT_ROWS_CAPPED`).
pub async fn count_rows_capped(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cap: u64,
) -> sqlx::Result<u64> {
    capped(executor, COUNT_ROWS_CAPPED, consumer_type, cap).await
}

/// Unprocessed rows of a consumer_type, counted up to `cap + 1` (`COUNT_UNPROCESSED_CAPPED`).
pub async fn count_unprocessed_capped(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    cap: u64,
) -> sqlx::Result<u64> {
    capped(executor, COUNT_UNPROCESSED_CAPPED, consumer_type, cap).await
}

async fn capped(
    executor: impl Into<Exec<'_>>,
    statement: &'static str,
    consumer_type: &str,
    cap: u64,
) -> sqlx::Result<u64> {
    let n: i64 = unit!(executor, |conn| sql::query_scalar(statement)
        .bind(consumer_type)
        .bind(i64::try_from(cap + 1).unwrap_or(i64::MAX))
        .fetch_one(conn))?;
    Ok(n.unsigned_abs())
}

/// Seconds since the oldest unprocessed row of a consumer_type was received; `None` when there is none
/// (`OLDEST_UNPROCESSED_AGE`).
pub async fn oldest_unprocessed_age(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
) -> sqlx::Result<Option<f64>> {
    unit!(executor, |conn| sql::query_scalar(OLDEST_UNPROCESSED_AGE)
        .bind(consumer_type)
        .fetch_optional(conn))
}

/// Rows in one bucket of time: bucket 0 is the newest.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// The event kind (for events; empty for processed rows).
    pub kind: String,
    pub age: i32,
    pub count: i64,
    /// How long ago, in seconds, the oldest row read of this bucket was stamped.
    pub oldest: f64,
}

/// Processed rows of a consumer_type over the last `span`, per `bucket` (`PROCESSED_SERIES`).
pub async fn processed_series(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    span: Duration,
    bucket: Duration,
    at_most: u64,
) -> sqlx::Result<Vec<Bucket>> {
    let rows: Vec<(i32, i64, f64)> = unit!(executor, |conn| sql::query_as(PROCESSED_SERIES)
        .bind(consumer_type)
        .bind(span.as_secs_f64())
        .bind(bucket.as_secs_f64())
        .bind(i64::try_from(at_most).unwrap_or(i64::MAX))
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(age, count, oldest)| Bucket {
            kind: String::new(),
            age,
            count,
            oldest,
        })
        .collect())
}

/// Events of a consumer_type over the last `span`, per kind and `bucket` (`EVENT_SERIES`).
pub async fn event_series(
    executor: impl Into<Exec<'_>>,
    consumer_type: &str,
    span: Duration,
    bucket: Duration,
    at_most: u64,
) -> sqlx::Result<Vec<Bucket>> {
    let rows: Vec<(String, i32, i64, f64)> = unit!(executor, |conn| sql::query_as(EVENT_SERIES)
        .bind(consumer_type)
        .bind(span.as_secs_f64())
        .bind(bucket.as_secs_f64())
        .bind(i64::try_from(at_most).unwrap_or(i64::MAX))
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(kind, age, count, oldest)| Bucket {
            kind,
            age,
            count,
            oldest,
        })
        .collect())
}
