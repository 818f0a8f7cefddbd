//! The partitioned inbox: `inbox_messages` range-partitioned on `message_time`, a time every copy of a message
//! carries (`inbox::time`), with one partition per interval and an `untimed` partition below them all.
//!
//! ```text
//! inbox_messages (partitioned on message_time; key (id, consumer_type, message_time); + fingerprint)
//! ├── inbox_messages_untimed   FROM (MINVALUE) TO ('2000-01-01')   the rows from before, and rows written with no time
//! ├── inbox_messages_p20261201_000000   one interval each, created ahead by `migrate` and `cleanup`
//! └── …
//! ```
//!
//! An existing `inbox_messages` is converted without copying a row ([`partition`]): it gets the two new columns (a
//! constant default, so no rewrite), a unique index on the new key built concurrently, and a validated check that
//! places it below every time; then, in one short transaction, it is renamed `inbox_messages_untimed` and attached to
//! a new partitioned `inbox_messages` as its untimed partition — its indexes attached, not rebuilt. Its rows keep
//! `message_time = '-infinity'`, and the claim treats an untimed row of a key as that key's claim (see
//! `claim::CLAIM_TIMED`), so that a copy of a message processed before the conversion is still a duplicate.
//!
//! The interval and the time source are kept in the comment of the untimed partition (`inboxctl
//! {"interval_seconds":…}`) — a table inboxctl made, so the comment is nobody else's — where every role can read them,
//! and no second table needs grants.

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection as _};

use super::Exec;
use super::sql::{self, quote_ident};
use crate::error::{Error, Result};
use crate::inbox::time::{TimeSource, earliest};

mod convert;
mod drop;
mod refusals;
pub use convert::{PartitionReport, check_back, partition, require_server};
pub use drop::{
    Contents, DETACHING, Detached, Settled, contents, detach, leftovers, settle_detached,
};
/// The conversion's statements, for [`super::statements`].
pub(super) const CONVERT_STATEMENTS: &[(&str, &str)] = convert::STATEMENTS;
/// The statements of dropping a partition, for [`super::statements`].
pub(super) const DROP_STATEMENTS: &[(&str, &str)] = drop::STATEMENTS;
/// The conversion's refusals' statements, for [`super::statements`].
pub(super) const REFUSAL_STATEMENTS: &[(&str, &str)] = refusals::STATEMENTS;

statements! {
    /// Whether `inbox_messages` is partitioned, and the comment of its untimed partition (where the partitioning's
    /// settings are kept).
    const INBOX_LAYOUT = "\
SELECT c.relkind = 'p', obj_description(to_regclass('inbox_messages_untimed'), 'pg_class')
FROM pg_class c WHERE c.oid = to_regclass('inbox_messages')";

    /// The inbox's partitions: name, bounds (null for MINVALUE), whether a concurrent detach of it was interrupted,
    /// its owner and whether this role has the owner's rights, and its comment ([`MADE_LATE`]'s mark, say). The
    /// bounds are read back from the text PostgreSQL writes them as, in this session's time zone.
    const PARTITIONS = "\
SELECT c.relname::text,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']*)''\\)')::timestamptz,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']*)''\\)')::timestamptz,
       i.inhdetachpending, pg_get_userbyid(c.relowner)::text, pg_has_role(c.relowner, 'USAGE'),
       obj_description(c.oid, 'pg_class')
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass('inbox_messages')
ORDER BY 2 NULLS FIRST";

    /// The owner of `inbox_messages` when it is another role than this one and this one may act as it: the owner
    /// the partitions this role makes are handed to.
    const PARENT_OWNER_TO_GIVE = "\
SELECT pg_get_userbyid(p.relowner)::text FROM pg_class p
WHERE p.oid = to_regclass('inbox_messages')
  AND p.relowner <> (SELECT oid FROM pg_roles WHERE rolname = current_user)
  AND pg_has_role(p.relowner, 'MEMBER')";

    /// The schema `inbox_messages` is in: its partitions are made there, whatever schema comes first on the search path.
    const INBOX_SCHEMA = "\
SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('inbox_messages')";

    /// The planner's row count of a relation (-1: never analyzed). `$1` its name.
    const ROWS_ESTIMATE = "SELECT reltuples::float8 FROM pg_class WHERE oid = to_regclass(quote_ident($1))";

}

/// The name of the partition below every time: the inbox's rows from before it was partitioned, and rows written by
/// a service that sets no `message_time`.
pub const UNTIMED: &str = "inbox_messages_untimed";

/// The smallest and largest interval of one partition.
pub const MIN_INTERVAL: TimeDelta = TimeDelta::hours(1);
pub const MAX_INTERVAL: TimeDelta = TimeDelta::days(31);
/// How far back `migrate` creates partitions at a conversion unless told (`--partition-back`): copies of older
/// messages, replays. And how far ahead it and `cleanup` keep them (clocks ahead; the time to the next cleanup).
pub const BACK: TimeDelta = TimeDelta::days(7);
pub const AHEAD: TimeDelta = TimeDelta::days(3);
/// At most this many partitions are created at once.
const MAX_NEW_PARTITIONS: usize = 1000;

/// How `inbox_messages` is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One table, keyed on (id, consumer_type): the schema every user has.
    Plain,
    /// Partitioned on a message time read from `source`, one partition per `interval`.
    Partitioned(Settings),
}

/// A partitioned inbox's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    #[serde(with = "seconds")]
    #[serde(rename = "interval_seconds")]
    pub interval: TimeDelta,
    #[serde(rename = "time_source")]
    pub source: TimeSource,
}

mod seconds {
    use chrono::TimeDelta;

    pub fn serialize<S: serde::Serializer>(d: &TimeDelta, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64(d.num_seconds())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<TimeDelta, D::Error> {
        let n: i64 = serde::Deserialize::deserialize(d)?;
        TimeDelta::try_seconds(n).ok_or_else(|| serde::de::Error::custom("interval out of range"))
    }
}

/// How the settings are written into the table's comment.
const COMMENT_PREFIX: &str = "inboxctl ";

impl Settings {
    fn comment(&self) -> String {
        format!(
            "{COMMENT_PREFIX}{}",
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    fn from_comment(comment: &str) -> Option<Self> {
        serde_json::from_str(comment.strip_prefix(COMMENT_PREFIX)?).ok()
    }

    /// The start of the interval holding `t` (intervals counted from the Unix epoch, in UTC).
    pub fn floor(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        let step = self.interval.num_seconds().max(1);
        let s = t.timestamp().div_euclid(step) * step;
        DateTime::from_timestamp(s, 0).unwrap_or(t)
    }
}

/// How `inbox_messages` is laid out; `None` when there is none.
pub async fn layout(executor: impl Into<Exec<'_>>) -> Result<Option<Layout>> {
    match read_layout(executor).await? {
        None => Ok(None),
        Some(None) => Err(Error::SchemaIncompatible {
            database: String::new(),
            differences: vec![
                "inbox_messages is partitioned, but the comment of inbox_messages_untimed does not hold inboxctl's \
                 settings (the time its partitions are keyed on): it was partitioned by someone else, or the comment \
                 was changed; run `inboxctl migrate --partitioned <interval> --partition-time <source>` with the \
                 settings it was partitioned with to write them again"
                    .to_owned(),
            ],
        }),
        Some(Some(layout)) => Ok(Some(layout)),
    }
}

/// The layout, `Some(None)` for a partitioned inbox whose settings are not to be found.
async fn read_layout(executor: impl Into<Exec<'_>>) -> Result<Option<Option<Layout>>> {
    let row: Option<(bool, Option<String>)> = unit!(executor, |conn| sql::query_as(INBOX_LAYOUT)
        .fetch_optional(conn))?;
    Ok(row.map(|(partitioned, comment)| match partitioned {
        false => Some(Layout::Plain),
        true => comment
            .as_deref()
            .and_then(Settings::from_comment)
            .map(Layout::Partitioned),
    }))
}

/// One partition of the inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    pub name: String,
    /// `None`: from MINVALUE (the untimed partition).
    pub from: Option<DateTime<Utc>>,
    pub to: Option<DateTime<Utc>>,
    /// A `DETACH … CONCURRENTLY` of it stopped half way.
    pub detach_pending: bool,
    /// Its owner, and whether this role has the owner's rights (to detach, look at, drop or attach it again).
    pub owner: String,
    pub mine: bool,
    /// When it was made, if it was made after its time had begun, for messages held since the partitions ran out
    /// ([`MADE_LATE`]): the window of what it holds runs from then, not from its range.
    pub made_late: Option<DateTime<Utc>>,
}

/// The start of the comment on a partition made after its time had begun (where the partitions had run out), then the
/// time it was made (RFC 3339). The messages of its times were held for it, however old; they are claimed in it only
/// once it is there, so a cleanup keeps it, empty or not, for a whole window from when it was made — dropped by its
/// range, a backlog held longer than the window would find its partitions gone and be unclaimable.
pub const MADE_LATE: &str =
    "inboxctl: made late, for messages held since the partitions ran out, at ";

/// The time in a [`MADE_LATE`] comment.
fn made_late_at(comment: Option<&str>) -> Option<DateTime<Utc>> {
    let at = comment?.strip_prefix(MADE_LATE)?;
    DateTime::parse_from_rfc3339(at)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The inbox's partitions, oldest first (the untimed one first).
pub async fn partitions(executor: impl Into<Exec<'_>>) -> sqlx::Result<Vec<Partition>> {
    type Row = (
        String,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
        bool,
        String,
        bool,
        Option<String>,
    );
    let rows: Vec<Row> = unit!(executor, |conn| sql::query_as(PARTITIONS).fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(
            |(name, from, to, detach_pending, owner, mine, comment)| Partition {
                name,
                from,
                to,
                detach_pending,
                owner,
                mine,
                made_late: made_late_at(comment.as_deref()),
            },
        )
        .collect())
}

/// The name of the partition starting at `from`.
pub fn partition_name(from: DateTime<Utc>) -> String {
    format!("inbox_messages_p{}", from.format("%Y%m%d_%H%M%S"))
}

/// A timestamp as a literal of PostgreSQL's, for the statements that cannot take parameters (DDL): written by us from
/// a time, never from input.
fn literal(t: DateTime<Utc>) -> String {
    format!("'{}'", t.format("%Y-%m-%d %H:%M:%S+00"))
}

/// The partition `[from, to)` made as a table of its own first: `CREATE TABLE … PARTITION OF` would wait for every
/// transaction that writes the inbox (it locks the parent exclusively), and hold every claim behind it meanwhile.
/// Made in the inbox's `schema`: unqualified, it would go to the first schema of the search path (a role's own, say),
/// where a cleanup run by another role would not find it, nor its leftover.
fn create_table_statement(schema: &str, from: DateTime<Utc>) -> String {
    format!(
        "CREATE TABLE {}.{} (LIKE inbox_messages INCLUDING DEFAULTS)",
        quote_ident(schema),
        quote_ident(&partition_name(from))
    )
}

/// The [`MADE_LATE`] mark of the partition starting at `from`, made at `at`.
fn made_late_statement(schema: &str, from: DateTime<Utc>, at: DateTime<Utc>) -> String {
    format!(
        "COMMENT ON TABLE {}.{} IS '{MADE_LATE}{}'",
        quote_ident(schema),
        quote_ident(&partition_name(from)),
        at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    )
}

/// …then attached, which locks the parent only against other schema changes (`SHARE UPDATE EXCLUSIVE`): the claims
/// go on. Its indexes are made as it is attached (it is empty).
fn attach_statement(schema: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> String {
    format!(
        "ALTER TABLE inbox_messages ATTACH PARTITION {}.{} FOR VALUES FROM ({}) TO ({})",
        quote_ident(schema),
        quote_ident(&partition_name(from)),
        literal(from),
        literal(to)
    )
}

/// The same for a table of any name (one an operator made and attached, detached by a cleanup).
fn attach_named_statement(name: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> String {
    format!(
        "ALTER TABLE inbox_messages ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})",
        quote_ident(name),
        literal(from),
        literal(to)
    )
}

fn owner_statement(table: &str, owner: &str) -> String {
    format!(
        "ALTER TABLE {} OWNER TO {}",
        quote_ident(table),
        quote_ident(owner)
    )
}

fn comment_statement(settings: &Settings) -> String {
    format!(
        "COMMENT ON TABLE inbox_messages_untimed IS '{}'",
        settings.comment().replace('\'', "''")
    )
}

/// The statements built around a name or a time, each with a sample one, for [`super::statements`].
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    let t = earliest() + TimeDelta::days(10_000);
    let settings = Settings {
        interval: TimeDelta::days(1),
        source: TimeSource::Id,
    };
    let mut statements = vec![
        (
            "create_table_statement",
            create_table_statement("public", t),
        ),
        (
            "attach_statement",
            attach_statement("public", t, t + TimeDelta::days(1)),
        ),
        (
            "detach_statement",
            drop::detach_statement("inbox_messages_p20270519_000000", false),
        ),
        (
            "drop_statement",
            drop::drop_statement("inbox_messages_p20270519_000000"),
        ),
        ("comment_statement", comment_statement(&settings)),
        (
            "detached_contents_statement",
            drop::detached_contents_statement("inbox_messages"),
        ),
        (
            "lock_detached_statement",
            drop::lock_detached_statement("inbox_messages"),
        ),
        (
            "attach_named_statement",
            attach_named_statement("inbox_messages_p20270519_000000", t, t + TimeDelta::days(1)),
        ),
        (
            "owner_statement",
            owner_statement("inbox_messages", "inboxctl"),
        ),
        (
            "mark_statement",
            drop::mark_statement("inbox_messages_p20270519_000000"),
        ),
        (
            "unmark_statement",
            drop::unmark_statement("inbox_messages_p20270519_000000"),
        ),
        (
            "set_lock_timeout_statement",
            drop::set_lock_timeout_statement(std::time::Duration::from_secs(30)),
        ),
        (
            "made_late_statement",
            made_late_statement("public", t, t + TimeDelta::days(1)),
        ),
    ];
    statements.extend(convert::built_statements());
    statements
}

/// Runs a statement built or declared here, by the simple protocol (DDL takes no parameters).
async fn run(conn: &mut PgConnection, statement: &str) -> sqlx::Result<()> {
    let statement = statement.to_owned();
    sqlx::raw_sql(AssertSqlSafe(statement))
        .execute(conn)
        .await
        .map(drop)
}

/// Makes the partitions from where they are missing to [`AHEAD`] (for `migrate` run again and for `cleanup`): from
/// the end of the newest partition that has begun by now — past it the partitions ran out, and the messages of the
/// times since are held for theirs, however long ago that was (the [`BACK`] and the time ahead first, then at most
/// [`MAX_NEW_PARTITIONS`] of the gap before, from where they ran out) —, or [`BACK`] ago when none has begun. One missing before that newest was dropped by a
/// cleanup, its rows past the window: made again, a late copy of such a message would be claimed as a message never
/// seen, where the partition's absence moves it aside. A partition that has not begun (an operator's made far ahead,
/// a clock ahead) is not the newest: the times before it are still to be made. Returns the partitions made.
///
/// "Now" is the database's, as the cleanup's window is: on a host whose clock is behind by more than the window, no
/// partition would have begun by its own, and the week before it — past the window, dropped — would be made again.
pub async fn make_missing(conn: &mut PgConnection, settings: Settings) -> Result<Vec<String>> {
    let now = crate::db::external::database_now(&mut *conn).await?;
    let not_before = now - BACK;
    // The untimed partition (from MINVALUE) says nothing of when the partitions ran out.
    let timed: Vec<Partition> = partitions(&mut *conn)
        .await?
        .into_iter()
        .filter(|p| p.from.is_some())
        .collect();
    let newest = newest_begun(&timed, now);
    let from = newest.map_or(not_before, |end| end.min(now));
    // Where they ran out, those made for times already begun are marked: messages were held for them.
    let late = newest.is_some_and(|end| end < now).then_some(now);
    // The week back and the time ahead first: the present is never what the cap leaves out. Then the gap before.
    let mut created = make(conn, settings, from.max(not_before), now + AHEAD, late).await?;
    if from < not_before {
        created.extend(make(conn, settings, from, not_before, late).await?);
    }
    Ok(created)
}

/// The end of the newest of `partitions` that has begun by `at` (a stopped detach's aside: its range takes no row).
pub fn newest_begun(partitions: &[Partition], at: DateTime<Utc>) -> Option<DateTime<Utc>> {
    partitions
        .iter()
        .filter(|p| !p.detach_pending && p.from.is_none_or(|f| f <= at))
        .filter_map(|p| p.to)
        .max()
}

/// Creates the partitions missing between `from` and `to` (whole intervals), after the newest one there is; returns
/// their names. Another process creating the same partition at once is no error.
pub async fn ensure_partitions(
    conn: &mut PgConnection,
    settings: Settings,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<String>> {
    make(conn, settings, from, to, None).await
}

/// [`ensure_partitions`]; with `late` (now, where the partitions had run out), each made for a time already begun by
/// then is marked [`MADE_LATE`] in the transaction that makes it.
async fn make(
    conn: &mut PgConnection,
    settings: Settings,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    late: Option<DateTime<Utc>>,
) -> Result<Vec<String>> {
    let existing = partitions(&mut *conn).await?;
    let schema: String = sql::query_scalar(INBOX_SCHEMA)
        .fetch_one(&mut *conn)
        .await?;
    let mut created = Vec::new();
    for (start, end) in intervals(settings, from, to) {
        if created.len() >= MAX_NEW_PARTITIONS {
            break;
        }
        let covered = existing
            .iter()
            .any(|p| p.from.is_some_and(|f| f < end) && p.to.is_some_and(|t| t > start));
        if !covered {
            // One transaction: no other process sees the table before it is a partition (and takes it for the
            // leftover of a drop).
            let made = async {
                let mut tx = conn.begin().await?;
                run(&mut tx, &create_table_statement(&schema, start)).await?;
                if let Some(at) = late.filter(|at| start < *at) {
                    run(&mut tx, &made_late_statement(&schema, start, at)).await?;
                }
                run(&mut tx, &attach_statement(&schema, start, end)).await?;
                tx.commit().await
            }
            .await;
            match made {
                Ok(()) => created.push(partition_name(start)),
                // Attached by another process in between (already a partition, or a range overlapping now), or
                // its table dropped as a leftover before it was attached: the next run makes it.
                Err(e)
                    if matches!(
                        super::sqlstate(&e).as_deref(),
                        // 23505: the same name created at once by another (pg_type's unique index).
                        Some("42P07" | "42P17" | "42P01" | "42710" | "23505")
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    give_to_the_parents_owner(conn, &created).await?;
    Ok(created)
}

/// Hands the partitions just made to the owner of `inbox_messages` when that is another role this one may act as (a
/// superuser, a member): only the owner drops them later, and a cleanup run as the owner would otherwise find
/// partitions it cannot drop. One that cannot be handed over is said, and stays this role's.
async fn give_to_the_parents_owner(conn: &mut PgConnection, created: &[String]) -> Result<()> {
    if created.is_empty() {
        return Ok(());
    }
    let Some(owner): Option<String> = sql::query_scalar(PARENT_OWNER_TO_GIVE)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(());
    };
    for name in created {
        if let Err(e) = run(conn, &owner_statement(name, &owner)).await {
            tracing::warn!(
                partition = %name,
                owner = %crate::sanitize::text(&owner),
                error = %super::errors::describe(&e),
                "a partition made by this role could not be handed to the inbox's owner, who cannot drop it"
            );
            break;
        }
    }
    Ok(())
}

/// The intervals `[start, end)` of `settings` from the one holding `from` (none before 2000) to the one holding `to`.
fn intervals(
    settings: Settings,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> impl Iterator<Item = (DateTime<Utc>, DateTime<Utc>)> {
    let first = settings.floor(from.max(earliest()));
    std::iter::successors(Some(first), move |start| Some(*start + settings.interval))
        .take_while(move |start| *start <= to)
        .map(move |start| (start, start + settings.interval))
}

/// The planner's row count of a partition (none: never analyzed).
pub async fn rows_estimate(executor: impl Into<Exec<'_>>, name: &str) -> sqlx::Result<Option<u64>> {
    let rows: Option<f64> = unit!(executor, |conn| sql::query_scalar(ROWS_ESTIMATE)
        .bind(name)
        .fetch_optional(conn))?;
    Ok(rows.filter(|r| *r >= 0.0).map(|r| r.round() as u64))
}

/// The time a partition of ours starts at, read from its name (`inbox_messages_pYYYYMMDD_HHMMSS`).
pub fn start_of(name: &str) -> Option<DateTime<Utc>> {
    let stamp = name.strip_prefix("inbox_messages_p")?;
    chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%d_%H%M%S")
        .ok()
        .map(|t| t.and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_survive_the_comment_and_other_comments_are_not_settings() {
        let settings = Settings {
            interval: TimeDelta::hours(6),
            source: TimeSource::SentTime,
        };
        assert_eq!(Settings::from_comment(&settings.comment()), Some(settings));
        assert!(settings.comment().contains("\"interval_seconds\":21600"));
        assert!(settings.comment().contains("\"time_source\":\"sent-time\""));
        assert_eq!(Settings::from_comment("the inbox of the EU shop"), None);
        assert_eq!(
            Settings::from_comment("inboxctl {\"interval_seconds\":1}"),
            None
        );
    }

    #[test]
    fn partitions_are_aligned_to_their_interval_and_named_by_their_start() {
        let settings = Settings {
            interval: TimeDelta::days(1),
            source: TimeSource::Id,
        };
        let t = DateTime::parse_from_rfc3339("2026-12-02T13:45:10Z")
            .expect("time")
            .with_timezone(&Utc);
        let start = settings.floor(t);
        assert_eq!(start.to_rfc3339(), "2026-12-02T00:00:00+00:00");
        assert_eq!(partition_name(start), "inbox_messages_p20261202_000000");
        assert_eq!(start_of(&partition_name(start)), Some(start));
        assert_eq!(start_of("inbox_messages_pre_partitioning"), None);
        assert_eq!(
            attach_statement("public", start, start + settings.interval),
            "ALTER TABLE inbox_messages ATTACH PARTITION \"public\".\"inbox_messages_p20261202_000000\" FOR VALUES FROM \
             ('2026-12-02 00:00:00+00') TO ('2026-12-03 00:00:00+00')"
        );
    }
}
