//! Dropping a partition whole: what it holds (read through its indexes), the detach that lets the claims go on, and
//! the look at the detached table — under its lock — that drops it or attaches it again; and the tables a stopped
//! drop left detached.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection as _};

use super::{Partition, attach_named_statement, convert, run};
use crate::db::Exec;
use crate::db::sql::{self, quote_ident};

statements! {
    /// Whether the table `$1` is a partition whose `DETACH … CONCURRENTLY` stopped half way (`true`), a partition
    /// (`false`), or none (no row).
    const DETACH_PENDING_OF = "\
SELECT i.inhdetachpending FROM pg_inherits i WHERE i.inhrelid = to_regclass(quote_ident($1))";

    /// Whether the table `$1` is a partition (of anything) now.
    const IS_PARTITION =
    "SELECT coalesce((SELECT relispartition FROM pg_class WHERE oid = to_regclass(quote_ident($1))), false)";

    /// Tables left by a drop that stopped between its detach and its drop: partitions of ours no longer attached,
    /// marked by the cleanup that detached them (`$1`, [`DETACHING`]). Only names of the form inboxctl gives its
    /// partitions: a table an operator named `inbox_messages_pre_...`, say (a copy kept before `migrate
    /// --partitioned`), is none of the cleanup's business; nor is a partition an operator detached by hand (to dump
    /// it, to keep it): it has no mark.
    const DETACHED_LEFTOVERS = "\
SELECT c.relname::text FROM pg_class c
WHERE c.relname ~ '^inbox_messages_p[0-9]{8}_[0-9]{6}$' AND c.relkind = 'r' AND NOT c.relispartition
  AND pg_has_role(c.relowner, 'USAGE')
  AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass('inbox_messages'))
  AND obj_description(c.oid, 'pg_class') = $1";

    /// Whether the rows of `[$1, $2)` include an unprocessed one (found through the unprocessed index).
    const UNPROCESSED_BETWEEN = "\
SELECT EXISTS (SELECT 1 FROM inbox_messages
               WHERE message_time >= $1 AND message_time < $2 AND processed_at IS NULL)";

    /// Each consumer_type with rows in `[$1, $2)` and its newest processed_at there: a loose index scan of the
    /// partition's `(consumer_type, processed_at)` index, one probe per consumer_type, not a scan of its rows. A time
    /// of `infinity` (another writer's) counts as now (within the window: kept); `-infinity` as long past; the driver
    /// is never handed either (it cannot hold them). The max is a plain one over the index, which PostgreSQL reads as
    /// one probe; a `FILTER` or an expression inside it would read every row.
    const CONSUMER_TYPES_BETWEEN = "\
WITH RECURSIVE t AS (
    (SELECT consumer_type FROM inbox_messages
     WHERE message_time >= $1 AND message_time < $2 ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT i.consumer_type FROM inbox_messages i
            WHERE i.message_time >= $1 AND i.message_time < $2 AND i.consumer_type > t.consumer_type
            ORDER BY i.consumer_type LIMIT 1)
    FROM t WHERE t.consumer_type IS NOT NULL
)
SELECT t.consumer_type::text,
       (SELECT CASE WHEN m > now() THEN now() ELSE m END FROM (
            SELECT max(i.processed_at) AS m FROM inbox_messages i
            WHERE i.message_time >= $1 AND i.message_time < $2 AND i.consumer_type = t.consumer_type
              AND i.processed_at > '-infinity') newest)
FROM t WHERE t.consumer_type IS NOT NULL";
}

/// The comment a cleanup puts on a partition before it detaches it: the mark of a table it is dropping, by which the
/// next cleanup knows the leftover of a drop that stopped (from a table an operator detached). Taken off when the
/// partition is attached again.
pub const DETACHING: &str = "inboxctl: detached by a cleanup, to be dropped (or attached again if it holds rows that must stay)";

pub(super) fn mark_statement(name: &str) -> String {
    format!(
        "COMMENT ON TABLE {} IS '{}'",
        quote_ident(name),
        DETACHING.replace('\'', "''")
    )
}

pub(super) fn unmark_statement(name: &str) -> String {
    format!("COMMENT ON TABLE {} IS NULL", quote_ident(name))
}

/// The lock a cleanup takes on a detached partition before it looks at it and drops or attaches it again (waited for
/// at most `SET_LOCAL_LOCK_TIMEOUT`: another cleanup doing the same at once ends its transaction in moments).
pub(super) fn lock_detached_statement(name: &str) -> String {
    format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", quote_ident(name))
}

/// `DETACH PARTITION … CONCURRENTLY`: the consumers' inserts go on meanwhile (it waits for the transactions that
/// could see the partition, in two steps). `FINALIZE` ends one that stopped half way.
pub(super) fn detach_statement(name: &str, finalize: bool) -> String {
    format!(
        "ALTER TABLE inbox_messages DETACH PARTITION {} {}",
        quote_ident(name),
        if finalize { "FINALIZE" } else { "CONCURRENTLY" }
    )
}

/// Each consumer_type of the table `name` (a detached partition), the newest `processed_at` of its rows, and whether
/// the table holds an unprocessed row (on every row alike): `CONSUMER_TYPES_BETWEEN`'s loose index scan, on the table.
pub(super) fn detached_contents_statement(name: &str) -> String {
    let t = quote_ident(name);
    format!(
        "WITH RECURSIVE t AS (
    (SELECT consumer_type FROM {t} ORDER BY consumer_type LIMIT 1)
    UNION ALL
    SELECT (SELECT i.consumer_type FROM {t} i WHERE i.consumer_type > t.consumer_type
            ORDER BY i.consumer_type LIMIT 1)
    FROM t WHERE t.consumer_type IS NOT NULL
)
SELECT t.consumer_type::text,
       (SELECT CASE WHEN m > now() THEN now() ELSE m END FROM (
            SELECT max(i.processed_at) AS m FROM {t} i
            WHERE i.consumer_type = t.consumer_type AND i.processed_at > '-infinity') newest),
       EXISTS (SELECT 1 FROM {t} i WHERE i.processed_at IS NULL)
FROM t WHERE t.consumer_type IS NOT NULL"
    )
}

pub(super) fn drop_statement(name: &str) -> String {
    format!("DROP TABLE IF EXISTS {}", quote_ident(name))
}

/// What keeps a partition from being dropped whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contents {
    pub unprocessed: bool,
    /// Each consumer_type with rows in it, and the newest `processed_at` of its rows there.
    pub consumer_types: Vec<(String, Option<DateTime<Utc>>)>,
}

/// What the partition `[from, to)` holds, as far as dropping it goes: read through its indexes.
pub async fn contents(
    executor: impl Into<Exec<'_>>,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> sqlx::Result<Contents> {
    unit!(executor, |conn| async move {
        let unprocessed: bool = sql::query_scalar(UNPROCESSED_BETWEEN)
            .bind(from)
            .bind(to)
            .fetch_one(&mut *conn)
            .await?;
        let consumer_types = sql::query_as(CONSUMER_TYPES_BETWEEN)
            .bind(from)
            .bind(to)
            .fetch_all(&mut *conn)
            .await?;
        Ok(Contents {
            unprocessed,
            consumer_types,
        })
    })
}

/// What a detach came to ([`detach`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detached {
    Done,
    /// Another process detached it first, or is detaching it (no such table, not a partition, its detach pending
    /// under another cleanup): left to that one.
    Taken,
    /// It waited past its bound for the transactions that could see the partition (a long query, a dump, a session
    /// idle in a transaction) and was given up; `pending`: in its second step, the partition left half detached (its
    /// range takes no row) for the next cleanup to finish.
    Waited {
        pending: bool,
    },
    /// Another partition's detach is pending, and PostgreSQL detaches one at a time: the server's words.
    Blocked(String),
}

/// `SET lock_timeout` for the session, in milliseconds: a detach's bound (`DETACH … CONCURRENTLY` runs outside a
/// transaction, so it cannot be `SET LOCAL`).
pub(super) fn set_lock_timeout_statement(wait: std::time::Duration) -> String {
    let most = u128::from(i32::MAX.unsigned_abs());
    format!("SET lock_timeout = {}", wait.as_millis().clamp(1, most))
}

/// Detaches a partition without stopping the consumers' inserts (`DETACH … CONCURRENTLY`, or `FINALIZE` for one a
/// stopped detach left pending), waiting at most `wait` for the transactions that could see it (`lock_timeout`; not
/// through a transaction pooler, where no session setting holds, so unbounded there).
pub async fn detach(
    conn: &mut PgConnection,
    partition: &Partition,
    wait: std::time::Duration,
) -> sqlx::Result<Detached> {
    let bounded = !crate::db::pooler::active();
    if bounded {
        run(conn, &set_lock_timeout_statement(wait)).await?;
    }
    // Settled under the same bound: the unmark waits for the partition's lock too.
    let detached = match mark_and_detach(conn, partition).await {
        Ok(()) => Ok(Detached::Done),
        Err((marked, e)) => failed_detach(conn, &partition.name, marked, e).await,
    };
    if bounded {
        run(conn, convert::RESET_LOCK_TIMEOUT).await?;
    }
    detached
}

/// What a detach that failed with `e` came to; the mark taken off again (`marked`: it was put on) where the partition
/// is still one of the inbox's, this cleanup's to act on.
async fn failed_detach(
    conn: &mut PgConnection,
    name: &str,
    marked: bool,
    e: sqlx::Error,
) -> sqlx::Result<Detached> {
    let code = crate::db::sqlstate(&e);
    // Not a partition (any more), or no such table: another cleanup got there first, and the mark is its.
    if matches!(code.as_deref(), Some("42P01" | "42809")) {
        return Ok(Detached::Taken);
    }
    let state = match pending_state(conn, name).await {
        Ok(state) => state,
        Err(_) if !matches!(code.as_deref(), Some("55000" | "55P03")) => return Err(e),
        Err(other) => return Err(other),
    };
    match (code.as_deref(), state) {
        // No longer a partition: detached by another cleanup meanwhile (the mark is that one's).
        (_, None) => Ok(Detached::Taken),
        // Its detach pending under another cleanup (whose mark it is).
        (Some("55000"), Some(true)) => Ok(Detached::Taken),
        // Refused while it is attached: another partition's detach is pending (PostgreSQL detaches one at a time),
        // or another reason the server gives.
        (Some("55000"), Some(false)) => {
            unmark_if(conn, name, marked).await;
            Ok(Detached::Blocked(server_words(&e)))
        }
        (Some("55P03"), Some(pending)) => {
            unmark_if(conn, name, marked).await;
            Ok(Detached::Waited { pending })
        }
        (_, Some(_)) => {
            unmark_if(conn, name, marked).await;
            Err(e)
        }
    }
}

/// Marks the partition (a drop that stops after the detach leaves a table the next cleanup knows for its own), then
/// detaches it; failed, whether the mark was put on.
async fn mark_and_detach(
    conn: &mut PgConnection,
    partition: &Partition,
) -> Result<(), (bool, sqlx::Error)> {
    run(conn, &mark_statement(&partition.name))
        .await
        .map_err(|e| (false, e))?;
    run(
        conn,
        &detach_statement(&partition.name, partition.detach_pending),
    )
    .await
    .map_err(|e| (true, e))
}

/// Takes the mark off a partition whose detach failed, if it was put on, best effort: an operator who detaches it
/// later keeps it. (One left half detached is marked again by the cleanup that finishes it.)
async fn unmark_if(conn: &mut PgConnection, name: &str, marked: bool) {
    if marked {
        let _ = run(conn, &unmark_statement(name)).await;
    }
}

/// What the server said of `error`, without the driver's wrapping.
fn server_words(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(e) => e.message().to_owned(),
        other => other.to_string(),
    }
}

/// Whether `name` is a partition left half detached (`Some(true)`), a partition (`Some(false)`), or none.
async fn pending_state(conn: &mut PgConnection, name: &str) -> sqlx::Result<Option<bool>> {
    sql::query_scalar(DETACH_PENDING_OF)
        .bind(name)
        .fetch_optional(&mut *conn)
        .await
}

/// What a detached partition holds, read on the table itself. Once `DETACH … CONCURRENTLY` has returned, no claim
/// writes there any more: a row a claim wrote between the look through the parent ([`contents`]) and the detach is
/// seen here.
async fn detached_contents(conn: &mut PgConnection, name: &str) -> sqlx::Result<Contents> {
    let rows: Vec<(String, Option<DateTime<Utc>>, bool)> =
        sql::query_as(AssertSqlSafe(detached_contents_statement(name)))
            .fetch_all(&mut *conn)
            .await?;
    Ok(Contents {
        unprocessed: rows.iter().any(|(_, _, unprocessed)| *unprocessed),
        consumer_types: rows
            .into_iter()
            .map(|(consumer_type, newest, _)| (consumer_type, newest))
            .collect(),
    })
}

/// What became of a detached partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    Dropped,
    /// Kept, with why; attached again (at the bounds given), or left detached (no bounds, or the attach failed:
    /// with the server's reason).
    Kept {
        why: String,
        attached: Result<(), String>,
    },
    /// It is gone or a partition again (another cleanup settled it first): left as it is.
    Taken,
    /// Its lock was held elsewhere past the wait (an autovacuum, a dump, a long query): left detached, for the next
    /// cleanup to settle as a leftover.
    Busy,
}

/// Looks at the detached table `name` and drops it, or — `keep` says why it must stay — attaches it again at
/// `bounds`; under the table's lock, taken without waiting, in one transaction: two cleanups never both act on one
/// table (one detaching it, the other taking it for a leftover), and one never drops a table the other attached
/// again.
pub async fn settle_detached(
    conn: &mut PgConnection,
    name: &str,
    bounds: Option<(DateTime<Utc>, DateTime<Utc>)>,
    keep: impl FnOnce(&Contents) -> Option<String>,
) -> sqlx::Result<Settled> {
    let mut tx = conn.begin().await?;
    run(&mut tx, convert::SET_LOCAL_LOCK_TIMEOUT).await?;
    match run(&mut tx, &lock_detached_statement(name)).await {
        Ok(()) => {}
        Err(e) if crate::db::sqlstate(&e).as_deref() == Some("42P01") => return Ok(Settled::Taken),
        Err(e) if crate::db::sqlstate(&e).as_deref() == Some("55P03") => return Ok(Settled::Busy),
        Err(e) => return Err(e),
    }
    let attached_now: bool = sql::query_scalar(IS_PARTITION)
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    if attached_now {
        return Ok(Settled::Taken);
    }
    let contents = detached_contents(&mut tx, name).await?;
    let Some(why) = keep(&contents) else {
        run(&mut tx, &drop_statement(name)).await?;
        tx.commit().await?;
        return Ok(Settled::Dropped);
    };
    let Some((from, to)) = bounds else {
        return Ok(Settled::Kept {
            why,
            attached: Err("its bounds are not known".to_owned()),
        });
    };
    let attached = match run(&mut tx, &attach_named_statement(name, from, to)).await {
        Ok(()) => run(&mut tx, &unmark_statement(name)).await,
        Err(e) => Err(e),
    };
    match attached {
        Ok(()) => {
            tx.commit().await?;
            Ok(Settled::Kept {
                why,
                attached: Ok(()),
            })
        }
        Err(e) => Ok(Settled::Kept {
            why,
            attached: Err(crate::db::errors::describe(&e)),
        }),
    }
}

/// The tables a drop left detached and not dropped (stopped between the two, or before it looked again at what it
/// had detached).
pub async fn leftovers(conn: &mut PgConnection) -> sqlx::Result<Vec<String>> {
    sql::query_scalar(DETACHED_LEFTOVERS)
        .bind(DETACHING)
        .fetch_all(&mut *conn)
        .await
}
