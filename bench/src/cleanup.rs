//! `inboxctl-bench --cleanup-rows N`: the cleanup and the dashboard at N inbox rows (10M by the measure).
//!
//! The rows are built once into a template database (4 consumer_types, half of the processed rows past a 7-day
//! window, 1 % never processed) and copied for each run with `CREATE DATABASE … TEMPLATE`. Each run copies the
//! template, starts a consumer at a steady rate, and measures its latency while nothing else happens (baseline),
//! while `inboxctl cleanup` runs, and while one plain `DELETE … WHERE processed_at < cutoff` runs. The refresh queries
//! of `stats`/`top` are timed on a copy too.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use inboxctl::amqp::Broker;
use inboxctl::cleanup::{self, Plan};
use inboxctl::db as store;
use inboxctl::db::{Database, schema};
use inboxctl::inbox::ConsumerType;
use inboxctl::stats::{self, Range};

use crate::error::{Error, Result};
use crate::report::{Mode, Options, Spread, ms, percentile};
use crate::scratch::{
    Scratch, drop_database, latencies, messages, publish, spawn_consumer, stop, wait_for_consumer,
};
use crate::sql;

/// The four consumer_types of the table.
const CONSUMER_TYPES: [&str; 4] = ["bench-alpha", "bench-beta", "bench-gamma", "bench-delta"];
const RETENTION: Duration = Duration::from_secs(7 * 86_400);
/// The consumer's steady rate while a cleanup runs, messages per second.
const RATE: f64 = 100.0;
/// How long the baseline (no cleanup) is measured.
const BASELINE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize)]
pub struct CleanupRun {
    pub seconds: f64,
    pub rows_deleted: u64,
    pub rows_per_second: f64,
    pub consumer_p50_ms: Option<f64>,
    pub consumer_p99_ms: Option<f64>,
    pub consumer_messages: usize,
    /// WAL written during the run, and checkpoints it forced (max_wal_size reached).
    pub wal_mb: f64,
    pub checkpoints_requested: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CleanupReport {
    pub rows: u64,
    pub deletable: u64,
    pub batch_size: i64,
    pub batch_pause_ms: f64,
    pub consumer_rate: f64,
    /// Each repeat's runs, by variant (`partition_drop`: the same rows in a partitioned inbox, `migrate --partitioned
    /// 1d`, during `inboxctl cleanup`, which drops the partitions past the window whole; its rows counted from the
    /// planner's statistics of the partitions dropped).
    pub repeats: Vec<BTreeMap<Variant, CleanupRun>>,
    /// Each cleanup's consumer p99 over its baseline's in the same repeat: median, min and max over the repeats.
    pub p99_ratios: BTreeMap<Variant, Spread>,
    pub partitions_dropped: usize,
}

/// One of the cleanup measurement's runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// The consumer alone, on the unpartitioned inbox.
    Baseline,
    /// During `inboxctl cleanup`.
    Inboxctl,
    /// During one plain `DELETE`.
    PlainDelete,
    /// The consumer alone, on the partitioned inbox.
    PartitionedBaseline,
    /// During `inboxctl cleanup` on the partitioned inbox.
    PartitionDrop,
}

impl Variant {
    /// The baseline a cleanup's p99 is set against; `None` for a baseline.
    fn baseline(self) -> Option<Variant> {
        match self {
            Variant::Inboxctl | Variant::PlainDelete => Some(Variant::Baseline),
            Variant::PartitionDrop => Some(Variant::PartitionedBaseline),
            Variant::Baseline | Variant::PartitionedBaseline => None,
        }
    }

    fn partitioned(self) -> bool {
        matches!(self, Variant::PartitionedBaseline | Variant::PartitionDrop)
    }

    /// The chosen runs in their order, each cleanup with its baseline.
    pub fn checked(chosen: &[Variant]) -> Result<Vec<Variant>> {
        let mut variants = chosen.to_vec();
        variants.sort();
        variants.dedup();
        for v in &variants {
            if let Some(base) = v.baseline()
                && !variants.contains(&base)
            {
                return Err(Error::usage(format!(
                    "--cleanup-variants: {} is measured against {}; add it",
                    v.name(),
                    base.name()
                )));
            }
        }
        Ok(variants)
    }

    fn name(self) -> &'static str {
        match self {
            Variant::Baseline => "baseline",
            Variant::Inboxctl => "inboxctl",
            Variant::PlainDelete => "plain-delete",
            Variant::PartitionedBaseline => "partitioned-baseline",
            Variant::PartitionDrop => "partition-drop",
        }
    }
}

pub async fn run(
    db: &Database,
    broker: &Broker,
    options: &Options,
    rows: u64,
    shutdown: &CancellationToken,
    mut say: impl FnMut(&str),
) -> Result<(CleanupReport, BTreeMap<String, Spread>)> {
    let template = format!("{}_bench_rows_{rows}", db.name());
    let template_db = db.with_database(&template);
    if !crate::template::ready(&template_db, &marker(rows)).await {
        say(&format!(
            "building {rows} inbox rows into {template} (once; later runs reuse it)"
        ));
        build_template(db, &template_db, rows, &mut say).await?;
    }
    let deletable: i64 = {
        let pool = template_db.pool(1).await?;
        let n = sqlx::query_scalar(sql::COUNT_DELETABLE)
            .bind(RETENTION.as_secs_f64())
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        n
    };

    let partitioned = format!("{template}_partitioned");
    let partitioned_db = db.with_database(&partitioned);
    if !crate::template::ready(&partitioned_db, &marker(rows)).await {
        say(&format!(
            "building {rows} inbox rows into {partitioned}, partitioned by day (once; later runs reuse it)"
        ));
        build_partitioned_template(db, &partitioned_db, rows, &mut say).await?;
    }

    let connection = broker.connect("inboxctl bench cleanup").await?;
    let mut repeats = Vec::new();
    let mut partitions_dropped = 0;
    for repeat in 1..=options.cleanup_repeats {
        let mut runs = BTreeMap::new();
        for &variant in &options.cleanup_variants {
            let from = if variant.partitioned() {
                &partitioned
            } else {
                &template
            };
            let scratch = copy(db, from, "cleanup").await?;
            if variant.partitioned() {
                // A template built days ago: the partitions of today and the next days, for the stream's messages.
                let mut conn = scratch.db.connect().await?;
                let settings = store::partitions::Settings {
                    interval: chrono::TimeDelta::days(1),
                    source: inboxctl::inbox::TimeSource::Id,
                };
                let now = Utc::now();
                store::partitions::ensure_partitions(
                    &mut conn,
                    settings,
                    now,
                    now + store::partitions::AHEAD,
                )
                .await?;
            }
            let (measured, dropped) =
                under_load(&scratch, broker, &connection, options, variant, shutdown).await?;
            partitions_dropped = partitions_dropped.max(dropped);
            say(&format!(
                "cleanup at {rows} rows, {} (repeat {repeat}): {:.1}s, {} rows ({:.0} rows/s); consumer p50 {} p99 {}; WAL {:.0} MB, {} checkpoints",
                variant.name(),
                measured.seconds,
                measured.rows_deleted,
                measured.rows_per_second,
                ms(measured.consumer_p50_ms),
                ms(measured.consumer_p99_ms),
                measured.wal_mb,
                measured.checkpoints_requested
            ));
            scratch.pool.close().await;
            drop_database(db, &scratch.db.name()).await?;
            runs.insert(variant, measured);
        }
        repeats.push(runs);
    }
    inboxctl::amqp::close(&connection, "OK").await;
    let p99_ratios = p99_ratios(&repeats);
    for (variant, spread) in &p99_ratios {
        say(&format!(
            "cleanup at {rows} rows, {}: consumer p99 {:.2}× its baseline (median of {}; {:.2}–{:.2})",
            variant.name(),
            spread.median,
            repeats.len(),
            spread.min,
            spread.max
        ));
    }

    let scratch = copy(db, &template, "refresh").await?;
    let refresh = refresh_timings(&scratch.pool).await?;
    for (query, spread) in &refresh {
        say(&format!(
            "refresh at {rows} rows, {query}: median {:.1} ms (max {:.1})",
            spread.median, spread.max
        ));
    }
    scratch.pool.close().await;
    drop_database(db, &scratch.db.name()).await?;

    Ok((
        CleanupReport {
            rows,
            deletable: deletable.unsigned_abs(),
            batch_size: options.cleanup_batch_size,
            batch_pause_ms: options.cleanup_batch_pause.as_secs_f64() * 1000.0,
            consumer_rate: RATE,
            repeats,
            p99_ratios,
            partitions_dropped,
        },
        refresh,
    ))
}

/// Each cleanup's p99 over its baseline's, repeat by repeat, as a spread.
fn p99_ratios(repeats: &[BTreeMap<Variant, CleanupRun>]) -> BTreeMap<Variant, Spread> {
    let mut ratios: BTreeMap<Variant, Vec<f64>> = BTreeMap::new();
    for runs in repeats {
        for (variant, run) in runs {
            let base = variant.baseline().and_then(|b| runs.get(&b));
            if let (Some(during), Some(without)) =
                (run.consumer_p99_ms, base.and_then(|b| b.consumer_p99_ms))
                && without > 0.0
            {
                ratios.entry(*variant).or_default().push(during / without);
            }
        }
    }
    ratios
        .into_iter()
        .filter_map(|(v, r)| Spread::of(&r).map(|s| (v, s)))
        .collect()
}

/// What the template's table comment says when it is complete and of the current shape.
fn marker(rows: u64) -> String {
    format!("inboxctl bench v3: {rows} rows")
}

async fn build_template(
    db: &Database,
    template: &Database,
    rows: u64,
    say: &mut impl FnMut(&str),
) -> Result<()> {
    drop_database(db, &template.name()).await?;
    schema::migrate(template, false).await?;
    let pool = template.pool(1).await?;
    let chunk = 1_000_000u64;
    let started = Instant::now();
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        sqlx::query(sql::SEED_ROWS)
            .bind(i64::try_from(done).unwrap_or(i64::MAX))
            .bind(i64::try_from(n).unwrap_or(i64::MAX))
            .bind(&CONSUMER_TYPES[..])
            .bind(i64::try_from(rows).unwrap_or(i64::MAX))
            .execute(&pool)
            .await?;
        done += n;
        say(&format!(
            "  {done} rows ({:.0}s)",
            started.elapsed().as_secs_f64()
        ));
    }
    crate::template::finish(&pool, &marker(rows)).await?;
    pool.close().await;
    Ok(())
}

/// The template's rows in a partitioned inbox, a partition a day from 15 days back.
async fn build_partitioned_template(
    db: &Database,
    template: &Database,
    rows: u64,
    say: &mut impl FnMut(&str),
) -> Result<()> {
    drop_database(db, &template.name()).await?;
    let settings = store::partitions::Settings {
        interval: chrono::TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    schema::migrate_partitioned(template, false, Some(settings)).await?;
    let mut conn = template.connect().await?;
    let now = Utc::now();
    store::partitions::ensure_partitions(
        &mut conn,
        settings,
        now - chrono::TimeDelta::days(15),
        now,
    )
    .await?;
    let pool = template.pool(1).await?;
    let chunk = 1_000_000u64;
    let started = Instant::now();
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        sqlx::query(sql::SEED_ROWS_PARTITIONED)
            .bind(i64::try_from(done).unwrap_or(i64::MAX))
            .bind(i64::try_from(n).unwrap_or(i64::MAX))
            .bind(&CONSUMER_TYPES[..])
            .bind(i64::try_from(rows).unwrap_or(i64::MAX))
            .execute(&pool)
            .await?;
        done += n;
        say(&format!(
            "  {done} rows ({:.0}s)",
            started.elapsed().as_secs_f64()
        ));
    }
    crate::template::finish(&pool, &marker(rows)).await?;
    pool.close().await;
    Ok(())
}

async fn copy(db: &Database, template: &str, purpose: &str) -> Result<Scratch> {
    let name = format!("{}_bench_{purpose}", db.name());
    crate::template::copy(db, template, &name).await?;
    let scratch_db = db.with_database(&name);
    let pool = scratch_db.pool(4).await?;
    Ok(Scratch {
        mode: Mode::Inbox,
        db: scratch_db,
        pool,
        queue: "inboxctl-bench-cleanup".to_owned(),
        exchange: "inboxctl-bench-cleanup-events".to_owned(),
        peer: None,
        prefilled: false,
        queue_type: inboxctl::amqp::topology::QueueType::Classic,
    })
}

/// A consumer at a steady rate while `variant` runs; its latencies during the run.
async fn under_load(
    scratch: &Scratch,
    broker: &Broker,
    connection: &lapin::Connection,
    options: &Options,
    variant: Variant,
    shutdown: &CancellationToken,
) -> Result<(CleanupRun, usize)> {
    let mut consumer = spawn_consumer(scratch, broker, options, false)?;
    inboxctl::amqp::topology::ensure_endpoint(
        connection,
        &scratch.exchange,
        &scratch.queue,
        inboxctl::amqp::topology::QueueType::Classic,
    )
    .await?;
    wait_for_consumer(connection, &scratch.queue).await?;
    let (stop_stream, publisher) = stream(scratch, broker).await?;
    // Let the stream settle before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (wal_before, checkpoints_before): (f64, i64) = sqlx::query_as(sql::WAL_AND_CHECKPOINTS)
        .fetch_one(&scratch.pool)
        .await?;
    let window_start: DateTime<Utc> = Utc::now();
    let started = Instant::now();
    let (deleted, dropped) = delete(scratch, options, variant, shutdown).await?;
    let seconds = started.elapsed().as_secs_f64();
    // The consumer's latency is taken over as long a window as the baseline's at least: a cleanup done in a second
    // leaves ~100 messages, whose p99 is the worst one or two of them, not a percentile to set beside the
    // baseline's.
    if let Some(rest) = BASELINE.checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let window_end: DateTime<Utc> = Utc::now();
    let (wal_after, checkpoints_after): (f64, i64) = sqlx::query_as(sql::WAL_AND_CHECKPOINTS)
        .fetch_one(&scratch.pool)
        .await?;
    stop_stream.cancel();
    let sent = publisher.await.map_err(std::io::Error::other)??;
    // Let the last messages of the window arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop(&mut consumer);

    let in_window: Vec<Uuid> = sent
        .iter()
        .filter(|(_, at)| **at >= window_start && **at <= window_end)
        .map(|(id, _)| *id)
        .collect();
    let latencies = latencies(&scratch.pool, &sent, &in_window).await?;
    let run = CleanupRun {
        seconds,
        rows_deleted: deleted,
        rows_per_second: if seconds > 0.0 {
            deleted as f64 / seconds
        } else {
            0.0
        },
        consumer_p50_ms: percentile(&latencies, 0.5),
        consumer_p99_ms: percentile(&latencies, 0.99),
        consumer_messages: latencies.len(),
        wal_mb: (wal_after - wal_before) / 1_048_576.0,
        checkpoints_requested: checkpoints_after - checkpoints_before,
    };
    Ok((run, dropped))
}

type Sent = BTreeMap<Uuid, DateTime<Utc>>;

/// The steady stream, in the background until cancelled; its messages are 10 minutes' worth, more than any run
/// takes.
async fn stream(
    scratch: &Scratch,
    broker: &Broker,
) -> Result<(CancellationToken, tokio::task::JoinHandle<Result<Sent>>)> {
    let stream = messages((RATE * 600.0) as u64, inboxctl::ids::IdKind::NewId);
    let stop_stream = CancellationToken::new();
    let connection = broker.connect("inboxctl bench stream").await?;
    let broker = broker.clone();
    let (exchange, queue) = (scratch.exchange.clone(), scratch.queue.clone());
    let stop = stop_stream.clone();
    let publisher = tokio::spawn(async move {
        let route = (
            exchange.as_str(),
            queue.as_str(),
            inboxctl::amqp::topology::QueueType::Classic,
        );
        let sent = publish(
            &connection,
            &broker,
            route,
            &stream,
            Some(RATE),
            Some(&stop),
        )
        .await;
        inboxctl::amqp::close(&connection, "OK").await;
        sent
    });
    Ok((stop_stream, publisher))
}

/// What `variant` deletes — `inboxctl cleanup` (on the partitioned inbox, dropping partitions), one plain `DELETE`, or
/// nothing for a while (the baselines) —: the rows, and the partitions dropped.
async fn delete(
    scratch: &Scratch,
    options: &Options,
    variant: Variant,
    shutdown: &CancellationToken,
) -> Result<(u64, usize)> {
    Ok(match variant {
        Variant::Inboxctl | Variant::PartitionDrop => {
            let plan = Plan {
                retention: RETENTION,
                consumer_type: None,
                batch_size: options.cleanup_batch_size,
                batch_pause: options.cleanup_batch_pause,
                dry_run: false,
                // The bench's inbox has no dead-letter queues to wait on: the cleanup's cost alone is measured.
                guard: None,
                audit_retention: RETENTION,
                detach_wait: std::time::Duration::from_secs(30),
            };
            let report = cleanup::run(&scratch.pool, &plan, shutdown, |_| {}).await?;
            let partitions = report.partitions.as_ref();
            (
                report.deleted + partitions.map_or(0, |p| p.rows_dropped()),
                partitions.map_or(0, |p| p.dropped.len()),
            )
        }
        Variant::PlainDelete => (
            sqlx::query(sql::PLAIN_DELETE)
                .bind(RETENTION.as_secs_f64())
                .execute(&scratch.pool)
                .await?
                .rows_affected(),
            0,
        ),
        Variant::Baseline | Variant::PartitionedBaseline => {
            tokio::time::sleep(BASELINE).await;
            (0, 0)
        }
    })
}

/// Each refresh statement `stats`/`top` sends, timed five times per consumer_type, and one whole collection.
async fn refresh_timings(pool: &PgPool) -> Result<BTreeMap<String, Spread>> {
    let mut conn = pool.acquire().await?;
    // Counters of inboxctl's for the consumer_types, as if a consumer had run as each.
    for ct in CONSUMER_TYPES {
        let consumer_type = ConsumerType::new((*ct).to_owned()).map_err(Error::usage)?;
        store::events::register_consumer(pool, &consumer_type, ct, None, "/").await?;
    }
    let mut timings = Timings::default();
    let exact_cap = stats::EXACT_BELOW;
    for _ in 0..5 {
        let t = Instant::now();
        store::stats::inbox_consumer_types(&mut *conn).await?;
        timings.add("consumer_types", t);
        let t = Instant::now();
        store::stats::estimates(&mut *conn).await?;
        timings.add("estimates", t);
        for ct in CONSUMER_TYPES {
            per_consumer_type(&mut conn, ct, exact_cap, &mut timings).await?;
        }
        // The capped exact counts, used only below their cap (1M rows per consumer_type for stats, 250k for top):
        // their worst case, counting up to the cap.
        for (name, cap) in [
            ("stats_rows_count_up_to_1m", stats::EXACT_BELOW),
            ("top_rows_count_up_to_250k", stats::EXACT_BELOW_LIVE),
        ] {
            let t = Instant::now();
            store::stats::count_rows_capped(&mut *conn, CONSUMER_TYPES[0], cap).await?;
            timings.add(name, t);
        }
    }
    drop(conn);
    for _ in 0..5 {
        let t = Instant::now();
        let range = Range {
            exact_below: stats::EXACT_BELOW_LIVE,
            window: Duration::from_secs(60),
            span: Duration::from_secs(120),
            bucket: Duration::from_secs(1),
            retention: stats::DEFAULT_RETENTION,
            look_at_heads: true,
            broker_within: None,
            live: true,
        };
        stats::collect(pool, None, range).await?;
        timings.add("top_whole_refresh", t);
    }
    Ok(timings.spreads())
}

/// The refresh statements of one consumer_type, each timed.
async fn per_consumer_type(
    conn: &mut PgConnection,
    ct: &str,
    exact_cap: u64,
    timings: &mut Timings,
) -> Result<()> {
    let t = Instant::now();
    store::stats::count_unprocessed_capped(&mut *conn, ct, exact_cap).await?;
    timings.add("unprocessed_count", t);
    let t = Instant::now();
    store::stats::oldest_unprocessed_age(&mut *conn, ct).await?;
    timings.add("oldest_unprocessed", t);
    let t = Instant::now();
    let (span, bucket) = (Duration::from_secs(120), Duration::from_secs(1));
    store::stats::processed_series(
        &mut *conn,
        ct,
        span,
        bucket,
        inboxctl::stats::SERIES_AT_MOST_LIVE,
    )
    .await?;
    timings.add("processed_series", t);
    let t = Instant::now();
    store::stats::event_series(
        &mut *conn,
        ct,
        span,
        bucket,
        inboxctl::stats::SERIES_AT_MOST_LIVE,
    )
    .await?;
    timings.add("event_series", t);
    Ok(())
}

/// Milliseconds per statement.
#[derive(Default)]
struct Timings(BTreeMap<String, Vec<f64>>);

impl Timings {
    fn add(&mut self, name: &str, started: Instant) {
        self.0
            .entry(name.to_owned())
            .or_default()
            .push(started.elapsed().as_secs_f64() * 1000.0);
    }

    fn spreads(self) -> BTreeMap<String, Spread> {
        self.0
            .into_iter()
            .filter_map(|(k, v)| Spread::of(&v).map(|s| (k, s)))
            .collect()
    }
}
