//! The health figures of every consumer_type: inbox rows, unprocessed rows, rates over a window, its queues.
//!
//! Cheap at 10M rows: nothing counts the whole table. Row counts are exact where an index makes them cheap (up to
//! [`EXACT_BELOW`] rows per consumer_type, an index-only count that stops there) and estimated from the planner's
//! statistics above, flagged as such. Rates come from rows in the window only, found through
//! `(consumer_type, processed_at)` and `(consumer_type, occurred_at)`. A figure that cannot be known is `None`,
//! never 0: a consumer_type that no inboxctl consumer ever ran as (a .NET service's) has no counters, so its rates
//! are unknown.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::amqp::Connection;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPool;

use crate::amqp::topology;
use crate::db::{schema, sql};
use crate::error::Result;

/// `stats` counts rows exactly up to this many per consumer_type; above, it estimates.
pub const EXACT_BELOW: u64 = 1_000_000;

/// `top`, refreshing every second, counts exactly only up to this many: an index-only count of a million entries
/// takes ~65 ms on the benchmark machine, this one a quarter of that.
pub const EXACT_BELOW_LIVE: u64 = 250_000;

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

/// A queue's depth, as the broker reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    pub name: String,
    /// `None` when the broker could not be asked or the queue does not exist.
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
    pub exists: bool,
}

/// One consumer_type's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerStats {
    pub consumer_type: String,
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    /// Counters for the window; `None` when inboxctl keeps none for this consumer_type.
    pub window: Option<Counts>,
    /// Deliveries and duplicates per bucket, oldest first, covering the range's span.
    pub series: Vec<(u64, u64)>,
    pub queue: Option<QueueDepth>,
    pub error_queue: Option<QueueDepth>,
}

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
}

impl Range {
    /// Rates over `window` and no series to speak of (one bucket).
    pub fn rates(window: Duration) -> Self {
        Self {
            exact_below: EXACT_BELOW,
            window,
            span: window,
            bucket: window,
        }
    }

    fn buckets(&self, of: Duration) -> usize {
        (of.as_secs_f64() / self.bucket.as_secs_f64())
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
    /// Why the broker figures are missing, when they are.
    pub broker_error: Option<String>,
}

/// Collects a snapshot. `broker` is optional: without it (or when it fails) the queue figures are `None`.
pub async fn collect(pool: &PgPool, broker: Option<&Connection>, range: Range) -> Result<Snapshot> {
    let mut conn = pool.acquire().await?;
    let ours = schema::table_exists(&mut conn, "inboxctl_events").await?
        && schema::table_exists(&mut conn, "inboxctl_consumers").await?;
    let registered: HashMap<String, String> = if ours {
        sqlx::query_as::<_, (String, String)>(sql::REGISTERED_CONSUMERS)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect()
    } else {
        HashMap::new()
    };
    let mut types: Vec<String> = sqlx::query_scalar(sql::INBOX_CONSUMER_TYPES)
        .fetch_all(&mut *conn)
        .await?;
    types.extend(registered.keys().cloned());
    types.sort();
    types.dedup();

    let estimates = Estimates::read(&mut conn).await?;
    let mut consumers = Vec::with_capacity(types.len());
    for consumer_type in types {
        let exact_below = range.exact_below;
        let (rows, rows_estimated) = match estimates.rows(&consumer_type) {
            Some(estimate) if estimate >= exact_below => (Some(estimate), true),
            estimate => {
                let exact = capped_count(
                    &mut conn,
                    sql::COUNT_ROWS_CAPPED,
                    &consumer_type,
                    exact_below,
                )
                .await?;
                if exact > exact_below {
                    (Some(estimate.unwrap_or(exact).max(exact)), true)
                } else {
                    (Some(exact), false)
                }
            }
        };
        let exact_unprocessed = capped_count(
            &mut conn,
            sql::COUNT_UNPROCESSED_CAPPED,
            &consumer_type,
            exact_below,
        )
        .await?;
        let (unprocessed, unprocessed_estimated) = if exact_unprocessed > exact_below {
            (
                Some(
                    estimates
                        .unprocessed(&consumer_type)
                        .unwrap_or(exact_unprocessed)
                        .max(exact_unprocessed),
                ),
                true,
            )
        } else {
            (Some(exact_unprocessed), false)
        };
        let oldest_unprocessed_seconds: Option<f64> = if exact_unprocessed == 0 {
            None
        } else {
            sqlx::query_scalar(sql::OLDEST_UNPROCESSED_AGE)
                .bind(&consumer_type)
                .fetch_optional(&mut *conn)
                .await?
        };

        let (window_counts, series) = if registered.contains_key(&consumer_type) {
            let (counts, series) = counters(&mut conn, &consumer_type, range).await?;
            (Some(counts), series)
        } else {
            (None, Vec::new())
        };
        let queue_name = registered
            .get(&consumer_type)
            .cloned()
            .unwrap_or_else(|| consumer_type.clone());
        consumers.push(ConsumerStats {
            consumer_type,
            rows,
            rows_estimated,
            unprocessed,
            unprocessed_estimated,
            oldest_unprocessed_seconds,
            window: window_counts,
            series,
            queue: Some(QueueDepth {
                name: queue_name.clone(),
                ready: None,
                consumers: None,
                exists: false,
            }),
            error_queue: Some(QueueDepth {
                name: topology::error_queue(&queue_name),
                ready: None,
                consumers: None,
                exists: false,
            }),
        });
    }
    drop(conn);

    let mut broker_error = None;
    if let Some(connection) = broker {
        'queues: for c in &mut consumers {
            for depth in [c.queue.as_mut(), c.error_queue.as_mut()]
                .into_iter()
                .flatten()
            {
                if crate::amqp::validate_name("queue", &depth.name).is_err() {
                    continue;
                }
                match topology::queue_depth(connection, &depth.name).await {
                    Ok(Some((ready, consumers))) => {
                        depth.ready = Some(ready);
                        depth.consumers = Some(consumers);
                        depth.exists = true;
                    }
                    Ok(None) => {
                        // An error queue that does not exist has nothing in it: 0 is known, not assumed.
                        if depth.name.ends_with("_error") {
                            depth.ready = Some(0);
                        }
                    }
                    Err(e) => {
                        broker_error = Some(crate::redact::text(&e.to_string()));
                        break 'queues;
                    }
                }
            }
        }
    } else {
        broker_error = Some("RabbitMQ not reachable".to_owned());
    }

    Ok(Snapshot {
        taken_at: Utc::now(),
        window: range.window,
        bucket: range.bucket,
        consumers,
        broker_error,
    })
}

async fn capped_count(
    conn: &mut sqlx::PgConnection,
    statement: &'static str,
    consumer_type: &str,
    cap: u64,
) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(statement)
        .bind(consumer_type)
        .bind(i64::try_from(cap + 1).unwrap_or(i64::MAX))
        .fetch_one(&mut *conn)
        .await?;
    Ok(n.unsigned_abs())
}

/// The window's counters and a series of (deliveries, duplicates) per bucket over the span, oldest first.
async fn counters(
    conn: &mut sqlx::PgConnection,
    consumer_type: &str,
    range: Range,
) -> Result<(Counts, Vec<(u64, u64)>)> {
    let buckets = range.buckets(range.span);
    let in_window = range.buckets(range.window);
    let mut per_bucket: BTreeMap<usize, Counts> = BTreeMap::new();
    let processed: Vec<(i32, i64)> = sqlx::query_as(sql::PROCESSED_SERIES)
        .bind(consumer_type)
        .bind(range.span.as_secs_f64())
        .bind(range.bucket.as_secs_f64())
        .fetch_all(&mut *conn)
        .await?;
    for (b, n) in processed {
        per_bucket
            .entry(usize::try_from(b).unwrap_or(0))
            .or_default()
            .processed += n.unsigned_abs();
    }
    let events: Vec<(String, i32, i64)> = sqlx::query_as(sql::EVENT_SERIES)
        .bind(consumer_type)
        .bind(range.span.as_secs_f64())
        .bind(range.bucket.as_secs_f64())
        .fetch_all(&mut *conn)
        .await?;
    for (kind, b, n) in events {
        per_bucket
            .entry(usize::try_from(b).unwrap_or(0))
            .or_default()
            .add(&kind, n.unsigned_abs());
    }
    let mut total = Counts::default();
    let mut series = vec![(0, 0); buckets];
    for (age, c) in &per_bucket {
        if *age < in_window {
            total.processed += c.processed;
            total.duplicates += c.duplicates;
            total.failed += c.failed;
            total.dead_lettered += c.dead_lettered;
            total.skipped += c.skipped;
            total.conflicts += c.conflicts;
        }
        // Bucket 0 is the newest; the series runs oldest first.
        if let Some(slot) = buckets.checked_sub(age + 1).and_then(|i| series.get_mut(i)) {
            *slot = (c.deliveries(), c.duplicates);
        }
    }
    Ok((total, series))
}

/// reltuples of the table and of the unprocessed index; most common consumer_types, their frequencies, null_frac,
/// n_distinct.
type EstimateRow = (
    f64,
    Option<f64>,
    Option<Vec<String>>,
    Option<Vec<f32>>,
    Option<f32>,
    Option<f32>,
);

/// The planner's statistics: total rows, unprocessed rows, and each consumer_type's share.
#[derive(Debug, Default)]
struct Estimates {
    rows: Option<f64>,
    unprocessed: Option<f64>,
    shares: HashMap<String, f64>,
    /// The share of a consumer_type not among the most common values.
    other_share: Option<f64>,
}

impl Estimates {
    async fn read(conn: &mut sqlx::PgConnection) -> Result<Self> {
        let row: Option<EstimateRow> = sqlx::query_as(sql::INBOX_ESTIMATES)
            .fetch_optional(&mut *conn)
            .await?;
        let Some((rows, unprocessed, values, freqs, null_frac, n_distinct)) = row else {
            return Ok(Self::default());
        };
        // reltuples is -1 until the table was first vacuumed or analyzed: no estimate then.
        let known = |v: f64| (v >= 0.0).then_some(v);
        let mut shares = HashMap::new();
        let mut common = 0.0;
        if let (Some(values), Some(freqs)) = (values, freqs) {
            for (v, f) in values.into_iter().zip(freqs) {
                common += f64::from(f);
                shares.insert(v, f64::from(f));
            }
        }
        let rest = (1.0 - common - f64::from(null_frac.unwrap_or(0.0))).max(0.0);
        let distinct = f64::from(n_distinct.unwrap_or(0.0));
        let others = if distinct > 0.0 {
            distinct - shares.len() as f64
        } else {
            0.0
        };
        Ok(Self {
            rows: known(rows),
            unprocessed: unprocessed.and_then(known),
            other_share: (others >= 1.0).then(|| rest / others),
            shares,
        })
    }

    fn share(&self, consumer_type: &str) -> Option<f64> {
        self.shares.get(consumer_type).copied().or(self.other_share)
    }

    fn rows(&self, consumer_type: &str) -> Option<u64> {
        Some((self.rows? * self.share(consumer_type)?).round() as u64)
    }

    fn unprocessed(&self, consumer_type: &str) -> Option<u64> {
        Some((self.unprocessed? * self.share(consumer_type)?).round() as u64)
    }
}

/// The documented JSON of `stats --json`.
#[derive(Debug, Serialize)]
pub struct Json {
    pub taken_at: DateTime<Utc>,
    pub window_seconds: f64,
    pub broker_error: Option<String>,
    pub consumers: Vec<ConsumerJson>,
}

#[derive(Debug, Serialize)]
pub struct ConsumerJson {
    pub consumer_type: String,
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    pub deliveries_per_second: Option<f64>,
    pub duplicates_per_second: Option<f64>,
    pub duplicate_ratio: Option<f64>,
    pub processed_per_second: Option<f64>,
    pub failed_per_second: Option<f64>,
    /// Messages whose id had been processed before for another event, in the window: a producer reusing ids.
    pub conflicts: Option<u64>,
    pub queue: QueueJson,
    pub error_queue: QueueJson,
}

#[derive(Debug, Serialize)]
pub struct QueueJson {
    pub name: Option<String>,
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
}

impl From<&Snapshot> for Json {
    fn from(s: &Snapshot) -> Self {
        let queue = |q: &Option<QueueDepth>| QueueJson {
            name: q.as_ref().map(|q| q.name.clone()),
            ready: q.as_ref().and_then(|q| q.ready),
            consumers: q.as_ref().and_then(|q| q.consumers),
        };
        Json {
            taken_at: s.taken_at,
            window_seconds: s.window.as_secs_f64(),
            broker_error: s.broker_error.clone(),
            consumers: s
                .consumers
                .iter()
                .map(|c| {
                    let rate = |n: fn(&Counts) -> u64| {
                        c.window.as_ref().map(|w| per_second(n(w), s.window))
                    };
                    ConsumerJson {
                        consumer_type: c.consumer_type.clone(),
                        rows: c.rows,
                        rows_estimated: c.rows_estimated,
                        unprocessed: c.unprocessed,
                        unprocessed_estimated: c.unprocessed_estimated,
                        oldest_unprocessed_seconds: c.oldest_unprocessed_seconds,
                        deliveries_per_second: rate(Counts::deliveries),
                        duplicates_per_second: rate(|w| w.duplicates),
                        duplicate_ratio: c.window.as_ref().and_then(Counts::duplicate_ratio),
                        processed_per_second: rate(|w| w.processed),
                        failed_per_second: rate(|w| w.failed),
                        conflicts: c.window.as_ref().map(|w| w.conflicts),
                        queue: queue(&c.queue),
                        error_queue: {
                            let mut q = queue(&c.error_queue);
                            q.consumers = None;
                            q
                        },
                    }
                })
                .collect(),
        }
    }
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

    #[test]
    fn estimates_share_the_table_by_the_most_common_values() {
        let e = Estimates {
            rows: Some(10_000_000.0),
            unprocessed: Some(1000.0),
            shares: [("a".to_owned(), 0.5), ("b".to_owned(), 0.3)]
                .into_iter()
                .collect(),
            other_share: Some(0.1),
        };
        assert_eq!(e.rows("a"), Some(5_000_000));
        assert_eq!(e.rows("b"), Some(3_000_000));
        assert_eq!(e.rows("zzz"), Some(1_000_000));
        assert_eq!(e.unprocessed("a"), Some(500));
        assert_eq!(Estimates::default().rows("a"), None);
    }
}

/// Figures as people read them: `1234`, `~2.5M` for an estimate, `?` for unknown.
pub mod display {
    pub const UNKNOWN: &str = "?";

    pub fn count(n: Option<u64>, estimated: bool) -> String {
        let Some(n) = n else {
            return UNKNOWN.to_owned();
        };
        let text = if n >= 10_000_000 {
            format!("{:.0}M", n as f64 / 1e6)
        } else if n >= 1_000_000 {
            format!("{:.1}M", n as f64 / 1e6)
        } else if n >= 100_000 {
            format!("{:.0}k", n as f64 / 1e3)
        } else {
            n.to_string()
        };
        if estimated { format!("~{text}") } else { text }
    }

    pub fn rate(r: Option<f64>) -> String {
        match r {
            None => UNKNOWN.to_owned(),
            Some(r) if r >= 100.0 => format!("{r:.0}"),
            Some(r) => format!("{r:.1}"),
        }
    }

    pub fn percent(r: Option<f64>) -> String {
        r.map_or_else(|| UNKNOWN.to_owned(), |r| format!("{:.1}%", r * 100.0))
    }

    /// `42s`, `17m`, `5h`, `3d`; empty when there is nothing unprocessed.
    pub fn age(seconds: Option<f64>) -> String {
        let Some(s) = seconds else {
            return String::new();
        };
        let s = s.max(0.0);
        if s < 120.0 {
            format!("{s:.0}s")
        } else if s < 7200.0 {
            format!("{:.0}m", s / 60.0)
        } else if s < 172_800.0 {
            format!("{:.0}h", s / 3600.0)
        } else {
            format!("{:.0}d", s / 86400.0)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn figures() {
            assert_eq!(count(Some(999), false), "999");
            assert_eq!(count(Some(2_500_000), true), "~2.5M");
            assert_eq!(count(Some(12_000_000), true), "~12M");
            assert_eq!(count(None, false), "?");
            assert_eq!(rate(Some(3.25)), "3.2");
            assert_eq!(rate(None), "?");
            assert_eq!(percent(Some(0.125)), "12.5%");
            assert_eq!(age(Some(90.0)), "90s");
            assert_eq!(age(Some(3.0 * 86400.0)), "3d");
            assert_eq!(age(None), "");
        }
    }
}
