//! The health figures of every consumer_type: inbox rows, unprocessed rows, rates over a window, its queues.
//!
//! Cheap at 10M rows: nothing counts the whole table. Row counts are exact where an index makes them cheap (up to
//! [`EXACT_BELOW`] rows per consumer_type, an index-only count that stops there) and estimated from the planner's
//! statistics above, flagged as such. Rates come from rows in the window only, found through
//! `(consumer_type, processed_at)` and `(consumer_type, occurred_at)`. A figure that cannot be known is `None`,
//! never 0: a consumer_type that no inboxctl consumer ever ran as (a .NET service's) has no counters, so its rates
//! are unknown.

use std::collections::HashMap;
use std::time::Duration;

use crate::amqp::Connection;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPool;

use crate::amqp::topology;
use crate::db::{self, schema};
use crate::error::Result;

mod broker;
pub mod display;
mod estimates;
mod rates;

pub use broker::{QueueDepth, Window, queue_label};
use estimates::{Estimates, Figure};

/// `stats` counts rows exactly up to this many per consumer_type; above, it estimates.
pub const EXACT_BELOW: u64 = 1_000_000;

/// The retention `stats` and `top` compare the oldest dead-lettered message with unless told another (`cleanup`'s
/// usual one).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// A dead-lettered message this close to the retention (as a share of it) is flagged as nearing the window.
pub const NEAR_WINDOW: f64 = 0.8;

/// `top`, refreshing every second, counts exactly only up to this many: an index-only count of a million entries
/// takes ~65 ms on the benchmark machine, this one a quarter of that.
pub const EXACT_BELOW_LIVE: u64 = 250_000;

/// The most processed rows — and, apart, events — one refresh of `top` reads for a consumer_type's rates and series
/// (the newest): on a busy consumer_type (past ~400 a second over `top`'s two minutes), what lies beyond them is
/// estimated from the rate of those read, and the rates are marked so (`~`), rather than every row of the window read
/// every second (a `top --window 7d` would read the whole inbox each refresh).
pub const SERIES_AT_MOST_LIVE: u64 = 50_000;

/// The same for one `stats` (past ~16,000 a second over its one minute).
pub const SERIES_AT_MOST: u64 = 1_000_000;

/// What one consumer_type's counters say for a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub processed: u64,
    pub duplicates: u64,
    pub failed: u64,
    pub dead_lettered: u64,
    pub skipped: u64,
    /// Copies of an id first processed for another event (an id reused upstream).
    pub conflicts: u64,
}

impl Counts {
    /// Deliveries that reached an outcome: processed, discarded as duplicates, in conflict with an earlier message of
    /// their id, dead-lettered or skipped. (A failed attempt is retried, so it is not a delivery of its own; a
    /// conflict that is then dead-lettered is counted once, as a conflict.)
    pub fn deliveries(&self) -> u64 {
        self.processed + self.duplicates + self.conflicts + self.dead_lettered + self.skipped
    }

    /// Share of deliveries that were duplicates; `None` when there were no deliveries.
    pub fn duplicate_ratio(&self) -> Option<f64> {
        let deliveries = self.deliveries();
        (deliveries > 0).then(|| self.duplicates as f64 / deliveries as f64)
    }

    fn add(&mut self, kind: &str, n: u64) {
        match kind {
            "duplicate" => self.duplicates += n,
            "failed" => self.failed += n,
            "dead_lettered" => self.dead_lettered += n,
            "skipped" => self.skipped += n,
            "conflict" => self.conflicts += n,
            _ => {}
        }
    }
}

/// `count` events over `window` as a rate per second.
pub fn per_second(count: u64, window: Duration) -> f64 {
    let seconds = window.as_secs_f64();
    if seconds <= 0.0 {
        0.0
    } else {
        count as f64 / seconds
    }
}

/// One consumer_type's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerStats {
    pub consumer_type: String,
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    /// `rows` is a floor: counted up to the cap, and PostgreSQL's statistics held no larger estimate (not analyzed
    /// since the table grew).
    pub rows_at_least: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    /// `unprocessed` is a floor, as `rows_at_least`.
    pub unprocessed_at_least: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    /// Counters for the window; `None` when inboxctl keeps none for this consumer_type.
    pub window: Option<Counts>,
    /// The window's counters (and the series) are in part estimated: more rows or events than one look reads
    /// ([`SERIES_AT_MOST_LIVE`], [`SERIES_AT_MOST`]), the rest taken at the rate of the newest.
    pub rates_estimated: bool,
    /// Deliveries and duplicates per bucket, oldest first, covering the range's span.
    pub series: Vec<(u64, u64)>,
    pub queue: Option<QueueDepth>,
    pub error_queue: Option<QueueDepth>,
    /// The oldest message of the error queue (its head, looked at and given back): how long ago it failed.
    pub oldest_dead_letter_seconds: Option<f64>,
    /// Its error queue's head was looked at for this snapshot (whatever the look found): its age is this snapshot's,
    /// even when the broker's half was cut short before other heads.
    pub head_looked: bool,
    /// Its error queue's head was not looked at on purpose: delivered too often already (`top`'s worn heads). Its
    /// last age stands, aging, whatever the snapshot's other heads.
    pub head_skipped: bool,
    /// Its calls outside the database not done (`inboxctl_effects`); `None` where that table is absent or unreadable.
    pub effects: Option<EffectCounts>,
    /// The vhost its consumer recorded reading its queue in, when it is not the one looked in: its queues' figures are
    /// not looked at (a queue of the same name here is another environment's), and stay unknown.
    pub other_vhost: Option<String>,
}

/// One consumer_type's calls outside the database that are not done.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EffectCounts {
    /// Owed: not called yet, or being called.
    pub pending: u64,
    pub oldest_pending_seconds: Option<f64>,
    /// In doubt: made or not, nobody knows (at-most-once).
    pub in_doubt: u64,
    pub oldest_in_doubt_seconds: Option<f64>,
    pub failed: u64,
    /// A count stopped at [`EFFECTS_AT_MOST`]: the counts are floors.
    pub at_least: bool,
}

/// Where each count of a consumer_type's calls not done stops (owed, in doubt, failed): a carrier's outage can leave
/// millions failed or in doubt, and `top` counts every second.
pub const EFFECTS_AT_MOST: u64 = 10_000;

/// Which stretch of time the rates and the series cover, and how far counts are exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Row counts up to this many per consumer_type are exact; above, estimated.
    pub exact_below: u64,
    /// Rates are averages over this last stretch.
    pub window: Duration,
    /// The series runs this far back (at least the window).
    pub span: Duration,
    /// One point of the series per bucket.
    pub bucket: Duration,
    /// The oldest dead-lettered message is compared with this.
    pub retention: Duration,
    /// Look at the head of each error queue that is not empty (a get and a requeue): `top` does it only now and
    /// then, since every look counts as a delivery of that message.
    pub look_at_heads: bool,
    /// The longest the broker's half may take (`top`: its figures must not wait on a broker that answers late, nor
    /// lose the database's half with it); what was not answered by then is unknown.
    pub broker_within: Option<Duration>,
    /// Collected again and again (`top`): refused on an inbox without the index its figures are read through, where
    /// every refresh would read the whole table. Once (`stats`), it reads what it must.
    pub live: bool,
}

impl Range {
    /// Rates over `window` and no series to speak of (one bucket).
    pub fn rates(window: Duration) -> Self {
        Self {
            exact_below: EXACT_BELOW,
            window,
            span: window,
            bucket: window,
            retention: DEFAULT_RETENTION,
            look_at_heads: true,
            broker_within: None,
            live: false,
        }
    }

    pub(crate) fn buckets(&self, of: Duration) -> usize {
        // Less a hair before the ceiling: a window cut into buckets of a fraction of a second's nanoseconds is a whole
        // number of them, not one more.
        (of.as_secs_f64() / self.bucket.as_secs_f64() - 1e-6)
            .ceil()
            .max(1.0) as usize
    }
}

/// Everything at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub taken_at: DateTime<Utc>,
    pub window: Duration,
    pub bucket: Duration,
    pub consumers: Vec<ConsumerStats>,
    pub retention: Duration,
    /// Whether the error queues' heads were looked at for this snapshot (see [`Range::look_at_heads`]).
    pub heads_looked: bool,
    /// The broker's half ran out of [`Range::broker_within`]: the heads were not all looked at.
    pub broker_cut_short: bool,
    /// Why the broker figures are missing, when they are.
    pub broker_error: Option<String>,
}

/// Refuses a database without `inbox_messages` (one `migrate` has not prepared), saying so, before anything is
/// collected; inboxctl's own tables are optional (a database only EF Core wrote has none).
pub async fn check_schema(pool: &PgPool, db: &crate::db::Database) -> Result<()> {
    schema::require_tables(pool, db, &["inbox_messages"]).await
}

/// The index every figure of a consumer_type is read through.
const CONSUMER_TYPE_INDEX: &str = "ix_inbox_messages_consumer_type_processed_at";

/// What a snapshot collected without a broker connection says.
const UNREACHABLE: &str = "RabbitMQ not reachable";

/// What a snapshot says when the broker could not be connected to, and why (the reason redacted by the caller): a
/// refused login, a vhost that does not exist, a certificate — each its own remedy.
pub fn unreachable(why: &str) -> String {
    let why: Vec<&str> = why
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    format!("{UNREACHABLE}: {}", why.join("; "))
}

/// Collects a snapshot. `broker` is optional: without it (or when it fails) the queue figures are `None`.
pub async fn collect(pool: &PgPool, broker: Option<&Connection>, range: Range) -> Result<Snapshot> {
    collect_in(pool, broker, None, range).await
}

/// [`collect`], the broker's connection in `vhost`: a consumer_type whose consumer recorded another vhost has its
/// queues' figures left unknown ([`ConsumerStats::other_vhost`]) rather than read from a queue of the same name here.
pub async fn collect_in(
    pool: &PgPool,
    broker: Option<&Connection>,
    vhost: Option<&str>,
    range: Range,
) -> Result<Snapshot> {
    let mut conn = pool.acquire().await?;
    let indexed = db::stats::consumer_type_index_ready(&mut *conn).await?;
    if range.live && !indexed {
        return Err(crate::error::Error::IndexMissing {
            index: CONSUMER_TYPE_INDEX,
        });
    }
    // Without the index each figure would be its own pass over the whole table; one pass reads them all.
    let whole = if indexed {
        None
    } else {
        tracing::warn!(
            "inbox_messages has no index {CONSUMER_TYPE_INDEX} (a service's table before `inboxctl migrate`, or \
             one whose build was cut short): its counts are read in one pass over the whole table; `inboxctl \
             migrate` builds the index without blocking writes, and stats then reads through it"
        );
        Some(db::stats::whole_inbox_by_consumer_type(&mut *conn).await?)
    };
    let ours = schema::table_exists(&mut conn, "inboxctl_events").await?
        && schema::table_exists(&mut conn, "inboxctl_consumers").await?;
    let (registered, partitioned, vhosts): (
        HashMap<String, String>,
        HashMap<String, u16>,
        HashMap<String, String>,
    ) = if ours {
        (
            db::stats::registered_consumers(&mut *conn).await?,
            db::stats::registered_partitions(&mut *conn).await?,
            match vhost {
                Some(_) => db::stats::registered_vhosts(&mut *conn).await?,
                None => HashMap::new(),
            },
        )
    } else {
        Default::default()
    };
    let mut types = match &whole {
        Some(whole) => whole.keys().cloned().collect(),
        None => db::stats::inbox_consumer_types(&mut *conn).await?,
    };
    types.extend(registered.keys().cloned());
    types.sort();
    types.dedup();

    let open_effects = open_effects(&mut conn, &types).await?;
    let estimates = Estimates::read(&mut conn).await?;
    let mut consumers = Vec::with_capacity(types.len());
    for consumer_type in types {
        let counted = whole
            .as_ref()
            .map(|whole| whole.get(&consumer_type).copied().unwrap_or_default());
        let mut stats = consumer_stats(
            &mut conn,
            consumer_type,
            &registered,
            &estimates,
            counted,
            range,
        )
        .await?;
        if let Some(queue) = stats.queue.as_mut() {
            queue.partitions = partitioned.get(&stats.consumer_type).copied();
        }
        stats.effects = open_effects
            .as_ref()
            .map(|open| open.get(&stats.consumer_type).copied().unwrap_or_default());
        stats.other_vhost = vhosts
            .get(&stats.consumer_type)
            .filter(|recorded| Some(recorded.as_str()) != vhost)
            .cloned();
        consumers.push(stats);
    }
    drop(conn);

    let missing = match broker {
        Some(connection) => broker::from_broker(connection, &mut consumers, range).await,
        None => broker::Missing {
            error: Some(UNREACHABLE.to_owned()),
            heads_looked: false,
            cut_short: false,
        },
    };

    Ok(Snapshot {
        taken_at: Utc::now(),
        window: range.window,
        bucket: range.bucket,
        retention: range.retention,
        heads_looked: missing.heads_looked,
        broker_cut_short: missing.cut_short,
        consumers,
        broker_error: missing.error,
    })
}

/// Per consumer_type, the calls outside the database not done: one statement over the partial index of the rows not
/// done. `None` on a database without `inboxctl_effects`, or for a role that may not read it.
async fn open_effects(
    conn: &mut sqlx::PgConnection,
    consumer_types: &[String],
) -> Result<Option<HashMap<String, EffectCounts>>> {
    if !schema::table_exists(&mut *conn, "inboxctl_effects").await? {
        return Ok(None);
    }
    let open = match db::external::open(
        &mut *conn,
        consumer_types,
        i64::try_from(EFFECTS_AT_MOST).unwrap_or(i64::MAX),
    )
    .await
    {
        Ok(open) => open,
        Err(e) if db::sqlstate(&e).as_deref() == Some("42501") => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some(
        open.into_iter()
            .map(|o| {
                // On the database's clock, as every other age here (this machine's may be off).
                let age =
                    |t: Option<DateTime<Utc>>| t.map(|t| (o.now - t).as_seconds_f64().max(0.0));
                let counts = EffectCounts {
                    pending: u64::try_from(o.pending).unwrap_or(0),
                    oldest_pending_seconds: age(o.oldest_pending),
                    in_doubt: u64::try_from(o.in_doubt).unwrap_or(0),
                    oldest_in_doubt_seconds: age(o.oldest_in_doubt),
                    failed: u64::try_from(o.failed).unwrap_or(0),
                    at_least: o.at_least,
                };
                (o.consumer_type, counts)
            })
            .collect(),
    ))
}

/// One consumer_type's figures from the database; its queues' depths are left for the broker to fill in.
async fn consumer_stats(
    conn: &mut sqlx::PgConnection,
    consumer_type: String,
    registered: &HashMap<String, String>,
    estimates: &Estimates,
    counted: Option<db::stats::WholeCounts>,
    range: Range,
) -> Result<ConsumerStats> {
    let (rows, unprocessed, oldest_unprocessed_seconds) = match counted {
        Some(whole) => (
            Figure::Exact(whole.rows),
            Figure::Exact(whole.unprocessed),
            whole.oldest_unprocessed_seconds,
        ),
        None => {
            read_through_the_index(&mut *conn, &consumer_type, estimates, range.exact_below).await?
        }
    };
    // A received_at ahead of the server's clock (a service's clock off) is no age: 0, not a negative one.
    let oldest_unprocessed_seconds = oldest_unprocessed_seconds.map(|age| age.max(0.0));

    let (window_counts, series, rates_estimated) = if registered.contains_key(&consumer_type) {
        let (counts, series, estimated) =
            rates::counters(&mut *conn, &consumer_type, range).await?;
        (Some(counts), series, estimated)
    } else {
        (None, Vec::new(), false)
    };
    let queue_name = registered
        .get(&consumer_type)
        .cloned()
        .unwrap_or_else(|| consumer_type.clone());
    Ok(ConsumerStats {
        consumer_type,
        rows: Some(rows.value()),
        rows_estimated: matches!(rows, Figure::Estimated(_)),
        rows_at_least: matches!(rows, Figure::AtLeast(_)),
        unprocessed: Some(unprocessed.value()),
        unprocessed_estimated: matches!(unprocessed, Figure::Estimated(_)),
        unprocessed_at_least: matches!(unprocessed, Figure::AtLeast(_)),
        oldest_unprocessed_seconds,
        window: window_counts,
        rates_estimated,
        series,
        queue: Some(QueueDepth {
            name: queue_name.clone(),
            partitions: None,
            ready: None,
            consumers: None,
            exists: false,
        }),
        error_queue: Some(QueueDepth {
            name: topology::error_queue(&queue_name),
            partitions: None,
            ready: None,
            consumers: None,
            exists: false,
        }),
        oldest_dead_letter_seconds: None,
        head_looked: false,
        head_skipped: false,
        effects: None,
        other_vhost: None,
    })
}

/// A consumer_type's rows, unprocessed rows and the age of its oldest unprocessed row, read through the
/// `(consumer_type, processed_at)` index: counted up to `exact_below`, estimated past it.
async fn read_through_the_index(
    conn: &mut sqlx::PgConnection,
    consumer_type: &str,
    estimates: &Estimates,
    exact_below: u64,
) -> Result<(Figure, Figure, Option<f64>)> {
    let rows = match estimates.rows(consumer_type) {
        Some(estimate)
            if estimate >= exact_below && estimates.among_the_most_common(consumer_type) =>
        {
            Figure::Estimated(estimate)
        }
        // Its share is not its own but the average of the consumer_types the statistics do not list (more of them
        // than they keep, or one new since the last ANALYZE): a consumer_type of ten rows could be shown as hundreds
        // of thousands. A count up to a tenth of the cap tells a small one exactly, at a tenth of the cost of a count
        // up to the cap for each such consumer_type each refresh.
        Some(estimate) if estimate >= exact_below => {
            let probe = (exact_below / 10).max(1);
            let counted = db::stats::count_rows_capped(&mut *conn, consumer_type, probe).await?;
            if counted <= probe {
                Figure::Exact(counted)
            } else {
                Figure::Estimated(estimate)
            }
        }
        estimate => {
            let exact =
                db::stats::count_rows_capped(&mut *conn, consumer_type, exact_below).await?;
            Figure::past_the_cap(exact, exact_below, estimate)
        }
    };
    let exact_unprocessed =
        db::stats::count_unprocessed_capped(&mut *conn, consumer_type, exact_below).await?;
    let unprocessed = Figure::past_the_cap(
        exact_unprocessed,
        exact_below,
        estimates.unprocessed(consumer_type),
    );
    let oldest_unprocessed_seconds = if exact_unprocessed == 0 {
        None
    } else {
        db::stats::oldest_unprocessed_age(&mut *conn, consumer_type).await?
    };

    Ok((rows, unprocessed, oldest_unprocessed_seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_ratios_from_counters() {
        let c = Counts {
            processed: 90,
            duplicates: 10,
            failed: 3,
            dead_lettered: 0,
            skipped: 0,
            conflicts: 0,
        };
        assert_eq!(c.deliveries(), 100);
        assert_eq!(c.duplicate_ratio(), Some(0.1));
        assert_eq!(
            per_second(c.deliveries(), Duration::from_secs(60)),
            100.0 / 60.0
        );
        assert_eq!(
            Counts::default().duplicate_ratio(),
            None,
            "no deliveries: unknown, not 0"
        );
    }
}
