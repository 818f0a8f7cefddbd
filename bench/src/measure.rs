//! `inboxctl bench`: the inbox's cost measured side by side, in one run, on the PostgreSQL and RabbitMQ it is given.
//!
//! Every mode gets a scratch database and a queue (and event exchange) of its own, the same effect (one row in
//! `carrier_reservations`), the same prefetch and concurrency, and a warm-up before it is measured; modes alternate
//! within each repeat, so a noisy neighbour hurts them all alike. The consumers run as child processes
//! (`inboxctl consume`), so their resident memory can be read.
//!
//! - `ceiling`: the inbox transaction's statements sent straight from `concurrency` connections, no broker;
//! - `bare`: the consumer without an inbox; `tutorial`: a look-up first, then the inbox insert and the effect;
//! - `inbox`: `inboxctl consume`; `inbox-batched`: the same with `--batch-size`;
//! - `peer`: pg-transactional-outbox (npm) under Node.js, as its docs and RabbitMQ example set it up ([`peer`]).
//!
//! Per mode and repeat: throughput (messages pre-loaded, first effect to last), latency from publish to effect at a
//! steady rate (p50, p99), duplicate effects when a fraction of the messages arrive twice, peak resident memory.

pub mod cleanup;
pub mod peer;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
};
use lapin::{Confirmation, Connection};
use serde::Serialize;
use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::Broker;
use crate::amqp::envelope::HostInfo;
use crate::db::{Database, schema, sql};
use crate::error::{Error, Result};
use crate::producer::{self, Message, Plan};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Ceiling,
    Bare,
    Tutorial,
    Inbox,
    InboxBatched,
    Peer,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ceiling => "ceiling",
            Mode::Bare => "bare",
            Mode::Tutorial => "tutorial",
            Mode::Inbox => "inbox",
            Mode::InboxBatched => "inbox-batched",
            Mode::Peer => "peer",
        }
    }

    fn database_suffix(self) -> &'static str {
        match self {
            Mode::Ceiling => "ceiling",
            Mode::Bare => "bare",
            Mode::Tutorial => "tutorial",
            Mode::Inbox => "inbox",
            Mode::InboxBatched => "inbox_batched",
            Mode::Peer => "peer",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub modes: Vec<Mode>,
    pub messages: u64,
    pub repeats: u32,
    pub concurrency: u16,
    pub prefetch: u16,
    pub batch_size: u16,
    pub warmup: u64,
    /// Steady rate for the latency run, messages per second, for `latency_seconds`.
    pub latency_rate: f64,
    pub latency_seconds: u64,
    /// Messages of the duplicate run, and the fraction of them that arrive twice.
    pub duplicate_messages: u64,
    pub duplicates: f64,
    /// Keep the scratch databases and queues afterwards.
    pub keep: bool,
    /// The `inboxctl cleanup` settings measured at many rows.
    pub cleanup_batch_size: i64,
    pub cleanup_batch_pause: Duration,
}

/// One measurement of one mode.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Repeat {
    pub throughput: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub duplicate_effects: Option<u64>,
    pub rss_mb: Option<f64>,
}

/// Median, smallest and largest of the repeats.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let median = if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
        };
        Some(Self {
            median,
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    pub throughput: Option<Spread>,
    pub p50_ms: Option<Spread>,
    pub p99_ms: Option<Spread>,
    /// The largest count of any repeat.
    pub duplicate_effects: Option<u64>,
    /// The largest peak of any repeat.
    pub rss_mb: Option<f64>,
    pub repeats: Vec<Repeat>,
}

impl ModeReport {
    fn of(repeats: Vec<Repeat>) -> Self {
        let collect =
            |f: fn(&Repeat) -> Option<f64>| repeats.iter().filter_map(f).collect::<Vec<_>>();
        Self {
            throughput: Spread::of(&collect(|r| Some(r.throughput))),
            p50_ms: Spread::of(&collect(|r| r.p50_ms)),
            p99_ms: Spread::of(&collect(|r| r.p99_ms)),
            duplicate_effects: repeats.iter().filter_map(|r| r.duplicate_effects).max(),
            rss_mb: collect(|r| r.rss_mb).into_iter().reduce(f64::max),
            repeats,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub os: String,
    pub postgres_version: String,
    pub synchronous_commit: String,
    pub rabbitmq_version: Option<String>,
    pub inboxctl_version: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub messages: u64,
    pub repeats: u32,
    pub concurrency: u16,
    pub prefetch: u16,
    pub batch_size: u16,
    pub warmup: u64,
    pub latency_rate: f64,
    pub latency_seconds: u64,
    pub duplicate_messages: u64,
    pub duplicates: f64,
    /// The peer's configuration, when it ran.
    pub peer: Option<peer::PeerSettings>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub settings: Settings,
    pub started_at: DateTime<Utc>,
    pub modes: BTreeMap<&'static str, ModeReport>,
    /// Each mode's throughput over another's, per repeat (same repeat), with their median.
    pub ratios: BTreeMap<String, Spread>,
    pub cleanup: Option<cleanup::CleanupReport>,
    pub refresh_ms: Option<BTreeMap<String, Spread>>,
}

/// A mode's scratch database, queue and exchange.
struct Scratch {
    mode: Mode,
    db: Database,
    pool: PgPool,
    queue: String,
    exchange: String,
    peer: Option<peer::Peer>,
}

impl Scratch {
    fn route(&self) -> (&str, &str) {
        (&self.exchange, &self.queue)
    }
}

pub async fn run(
    db: &Database,
    broker: &Broker,
    options: &Options,
    shutdown: &CancellationToken,
    mut say: impl FnMut(&str),
) -> Result<Report> {
    let started_at = Utc::now();
    let connection = broker.connect("inboxctl bench").await?;
    let mut scratches = Vec::new();
    if options.modes.is_empty() {
        let pool = db.with_database("postgres").pool(1).await?;
        let machine = machine(&pool).await?;
        pool.close().await;
        return Ok(Report {
            machine,
            settings: settings(options, None),
            started_at,
            modes: BTreeMap::new(),
            ratios: BTreeMap::new(),
            cleanup: None,
            refresh_ms: None,
        });
    }
    let peer = if options.modes.contains(&Mode::Peer) {
        let mut say_now = |line: &str| say(line);
        Some(tokio::task::block_in_place(|| {
            peer::Peer::install(&mut say_now)
        })?)
    } else {
        None
    };
    for &mode in &options.modes {
        scratches.push(prepare(db, mode, options, peer.as_ref()).await?);
    }
    let machine = machine(&scratches[0].pool).await?;
    say(&format!(
        "{} cores, PostgreSQL {} (synchronous_commit={}), RabbitMQ {}",
        machine.cores,
        machine.postgres_version,
        machine.synchronous_commit,
        machine.rabbitmq_version.as_deref().unwrap_or("?")
    ));

    let mut repeats: BTreeMap<Mode, Vec<Repeat>> = BTreeMap::new();
    for repeat in 1..=options.repeats {
        for scratch in &scratches {
            if shutdown.is_cancelled() {
                return Err(Error::Usage("interrupted".to_owned()));
            }
            let result = measure(scratch, broker, &connection, options, shutdown).await?;
            say(&format!(
                "repeat {repeat}/{}: {:<13} {:>8.0} msg/s  p50 {}  p99 {}  duplicate effects {}  rss {}",
                options.repeats,
                scratch.mode.name(),
                result.throughput,
                ms(result.p50_ms),
                ms(result.p99_ms),
                result
                    .duplicate_effects
                    .map_or("-".to_owned(), |d| d.to_string()),
                result
                    .rss_mb
                    .map_or("-".to_owned(), |r| format!("{r:.1} MB")),
            ));
            repeats.entry(scratch.mode).or_default().push(result);
        }
    }

    if !options.keep {
        for scratch in scratches {
            scratch.pool.close().await;
            if let Ok(channel) = connection.create_channel().await {
                let _ = channel
                    .queue_delete(scratch.queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel
                    .exchange_delete(
                        scratch.queue.as_str().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
                let _ = channel
                    .exchange_delete(
                        scratch.exchange.as_str().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
            }
            drop_database(db, &scratch.db.name()).await?;
        }
    }
    crate::amqp::close(&connection, "OK").await;

    let ratios = ratios(&repeats);
    Ok(Report {
        machine,
        settings: settings(options, peer.as_ref()),
        started_at,
        modes: repeats
            .into_iter()
            .map(|(m, r)| (m.name(), ModeReport::of(r)))
            .collect(),
        ratios,
        cleanup: None,
        refresh_ms: None,
    })
}

fn settings(options: &Options, peer: Option<&peer::Peer>) -> Settings {
    Settings {
        messages: options.messages,
        repeats: options.repeats,
        concurrency: options.concurrency,
        prefetch: options.prefetch,
        batch_size: options.batch_size,
        warmup: options.warmup,
        latency_rate: options.latency_rate,
        latency_seconds: options.latency_seconds,
        duplicate_messages: options.duplicate_messages,
        duplicates: options.duplicates,
        peer: peer.map(|p| p.settings(options.concurrency)),
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.1} ms"))
}

/// Throughput ratios per repeat, e.g. `inbox/bare`.
fn ratios(repeats: &BTreeMap<Mode, Vec<Repeat>>) -> BTreeMap<String, Spread> {
    let pairs = [
        (Mode::Inbox, Mode::Bare),
        (Mode::InboxBatched, Mode::Bare),
        (Mode::Inbox, Mode::Tutorial),
        (Mode::Inbox, Mode::Peer),
        (Mode::Inbox, Mode::Ceiling),
        (Mode::InboxBatched, Mode::Ceiling),
        (Mode::Bare, Mode::Ceiling),
    ];
    let mut out = BTreeMap::new();
    for (a, b) in pairs {
        let (Some(ra), Some(rb)) = (repeats.get(&a), repeats.get(&b)) else {
            continue;
        };
        let per_repeat: Vec<f64> = ra
            .iter()
            .zip(rb)
            .filter(|(_, y)| y.throughput > 0.0)
            .map(|(x, y)| x.throughput / y.throughput)
            .collect();
        if let Some(spread) = Spread::of(&per_repeat) {
            out.insert(format!("{}/{}", a.name(), b.name()), spread);
        }
    }
    out
}

async fn prepare(
    db: &Database,
    mode: Mode,
    options: &Options,
    peer: Option<&peer::Peer>,
) -> Result<Scratch> {
    let name = format!("{}_bench_{}", db.name(), mode.database_suffix());
    drop_database(db, &name).await?;
    let scratch_db = db.with_database(&name);
    // Every mode, the peer too, has the same effect table (`carrier_reservations`), from our migrations.
    schema::migrate(&scratch_db, false).await?;
    let peer = match (mode, peer) {
        (Mode::Peer, Some(p)) => {
            let url = scratch_db.url();
            tokio::task::block_in_place(|| p.setup(url))?;
            Some(p.clone())
        }
        _ => None,
    };
    let pool = scratch_db.pool(u32::from(options.concurrency) + 2).await?;
    Ok(Scratch {
        mode,
        db: scratch_db,
        pool,
        queue: format!("inboxctl-bench-{}", mode.name()),
        exchange: format!("inboxctl-bench-{}-events", mode.name()),
        peer,
    })
}

async fn drop_database(db: &Database, name: &str) -> Result<()> {
    let mut admin = db.with_database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        sql::quote_ident(name)
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}

async fn machine(pool: &PgPool) -> Result<Machine> {
    let postgres_version: String = sqlx::query_scalar(sql::SERVER_VERSION)
        .fetch_one(pool)
        .await?;
    let synchronous_commit: String =
        sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(pool)
            .await?;
    let rabbitmq_version = Command::new("rabbitmqctl")
        .args(["-q", "version"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    Ok(Machine {
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        os: HostInfo::current().operating_system_version,
        postgres_version,
        synchronous_commit,
        rabbitmq_version,
        inboxctl_version: env!("CARGO_PKG_VERSION").to_owned(),
    })
}

/// Empty tables before each run (the peer's inbox too: its polling slows with every row it keeps).
async fn truncate(scratch: &Scratch) -> Result<()> {
    sqlx::query(sql::BENCH_TRUNCATE)
        .execute(&scratch.pool)
        .await?;
    if scratch.peer.is_some() {
        sqlx::query(sql::BENCH_TRUNCATE_PEER)
            .execute(&scratch.pool)
            .await?;
    }
    Ok(())
}

async fn measure(
    scratch: &Scratch,
    broker: &Broker,
    connection: &Connection,
    options: &Options,
    shutdown: &CancellationToken,
) -> Result<Repeat> {
    if scratch.mode == Mode::Ceiling {
        return ceiling(scratch, options).await;
    }
    // Warm-up: the same run, smaller, on the same database and queue; then empty tables for the measured run.
    truncate(scratch).await?;
    let warm = messages(options.warmup, 0.0);
    publish(connection, broker, scratch.route(), &warm, None, None).await?;
    consume_until_idle(scratch, broker, options).await?;

    // Throughput: everything pre-loaded, first effect to last.
    truncate(scratch).await?;
    let load = messages(options.messages, 0.0);
    publish(connection, broker, scratch.route(), &load, None, None).await?;
    let rss = consume_until_idle(scratch, broker, options).await?;
    let (count, seconds): (i64, Option<f64>) = sqlx::query_as(sql::BENCH_EFFECT_SPAN)
        .fetch_one(&scratch.pool)
        .await?;
    let throughput = match seconds {
        Some(s) if s > 0.0 && count > 1 => (count - 1) as f64 / s,
        _ => 0.0,
    };

    // Latency at a steady rate.
    truncate(scratch).await?;
    let steady = messages(
        (options.latency_rate * options.latency_seconds as f64).round() as u64,
        0.0,
    );
    let mut consumer = spawn_consumer(scratch, broker, options, false)?;
    wait_for_consumer(connection, &scratch.queue).await?;
    let published = publish(
        connection,
        broker,
        scratch.route(),
        &steady,
        Some(options.latency_rate),
        None,
    )
    .await?;
    let ids: Vec<Uuid> = steady.iter().map(|m| m.message_id).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: i64 = sqlx::query_scalar(sql::BENCH_COUNT_EFFECTS_FOR)
            .bind(&ids)
            .fetch_one(&scratch.pool)
            .await?;
        if done >= ids.len() as i64 || Instant::now() > deadline || shutdown.is_cancelled() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(&mut consumer);
    let effects: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(sql::BENCH_EFFECT_TIMES)
        .bind(&ids)
        .fetch_all(&scratch.pool)
        .await?;
    let mut latencies: Vec<f64> = effects
        .iter()
        .filter_map(|(id, at)| {
            published
                .get(id)
                .map(|sent| (*at - *sent).num_microseconds().unwrap_or(0) as f64 / 1000.0)
        })
        .collect();
    latencies.sort_by(f64::total_cmp);

    // Duplicates: a fraction of the messages twice, half at once and half after the rest.
    truncate(scratch).await?;
    let plan = Plan {
        count: options.duplicate_messages,
        duplicates: options.duplicates,
        rate: None,
        destination: None,
    };
    // A measurement with a lost connection in it would not be one: fail instead of resuming.
    producer::publish(
        connection,
        broker,
        &scratch.exchange,
        &plan,
        Duration::ZERO,
        shutdown,
    )
    .await?;
    consume_until_idle(scratch, broker, options).await?;
    let (effects, parcels): (i64, i64) = sqlx::query_as(sql::BENCH_DUPLICATE_EFFECTS)
        .fetch_one(&scratch.pool)
        .await?;

    Ok(Repeat {
        throughput,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        duplicate_effects: Some((effects - parcels).unsigned_abs()),
        rss_mb: rss,
    })
}

/// The value below which `q` of the sorted `values` lie (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

fn messages(count: u64, duplicates: f64) -> Vec<Message> {
    producer::messages(&Plan {
        count,
        duplicates,
        rate: None,
        destination: None,
    })
}

/// Publishes `messages` to `exchange` (bound to `queue`), with confirms; at `rate` per second if given; until `stop`
/// if given. Returns when each was published.
async fn publish(
    connection: &Connection,
    broker: &Broker,
    (exchange, queue): (&str, &str),
    messages: &[Message],
    rate: Option<f64>,
    stop: Option<&CancellationToken>,
) -> Result<BTreeMap<Uuid, DateTime<Utc>>> {
    crate::amqp::topology::ensure_endpoint(connection, exchange, queue).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let host = HostInfo::current();
    let mut ticker = rate.map(|r| {
        let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / r));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut sent = BTreeMap::new();
    let mut pending = std::collections::VecDeque::new();
    for message in messages {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        if stop.is_some_and(CancellationToken::is_cancelled) {
            break;
        }
        let (properties, body) = producer::envelope(message, broker, exchange, &host);
        let confirm = channel
            .basic_publish(
                exchange.into(),
                "".into(),
                BasicPublishOptions::default(),
                &body,
                properties,
            )
            .await?;
        sent.insert(message.message_id, Utc::now());
        pending.push_back(confirm);
        if pending.len() >= 512
            && let Some(c) = pending.pop_front()
        {
            confirmed(c.await?)?;
        }
    }
    while let Some(c) = pending.pop_front() {
        confirmed(c.await?)?;
    }
    let _ = channel.close(200, "OK".into()).await;
    Ok(sent)
}

fn confirmed(confirmation: Confirmation) -> Result<()> {
    match confirmation {
        Confirmation::Nack(_) => Err(Error::Topology(
            "the broker refused a benchmark message".to_owned(),
        )),
        _ => Ok(()),
    }
}

/// Runs the mode's consumer until its queue is idle; returns its peak resident memory in MB.
async fn consume_until_idle(
    scratch: &Scratch,
    broker: &Broker,
    options: &Options,
) -> Result<Option<f64>> {
    let mut child = spawn_consumer(scratch, broker, options, true)?;
    let pid = child.id();
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let peak = Arc::clone(&peak);
        tokio::spawn(async move {
            loop {
                if let Some(kb) = rss_kb(pid) {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .map_err(std::io::Error::other)??;
    sampler.abort();
    if !status.success() {
        let output = scratch
            .peer
            .as_ref()
            .map(|p| format!(" (its output: {})", p.log().display()))
            .unwrap_or_default();
        return Err(Error::Topology(format!(
            "the {} consumer failed: {status}{output}",
            scratch.mode.name()
        )));
    }
    let kb = peak.load(Ordering::Relaxed);
    Ok((kb > 0).then(|| kb as f64 / 1024.0))
}

fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn spawn_consumer(
    scratch: &Scratch,
    broker: &Broker,
    options: &Options,
    until_idle: bool,
) -> Result<Child> {
    if let Some(peer) = &scratch.peer {
        let mut cmd = peer.node("consume");
        cmd.env("DATABASE_URL", scratch.db.url())
            .env("AMQP_URL", broker.url())
            .env_remove("DATABASE_PASSWORD_FILE")
            .env_remove("AMQP_PASSWORD_FILE")
            .env("QUEUE", &scratch.queue)
            .env("CONCURRENCY", options.concurrency.to_string())
            .env("PREFETCH", options.prefetch.to_string())
            .env("EXIT_WHEN_IDLE_MS", if until_idle { "1000" } else { "0" })
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(peer.log())?);
        return cmd
            .spawn()
            .map_err(|e| Error::Tool(format!("cannot start the peer's consumer (node): {e}")));
    }
    let exe: PathBuf = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "consume",
        "carrier",
        "--queue",
        &scratch.queue,
        "--consumer-type",
        &scratch.queue,
    ])
    .args(["--exchange", &scratch.exchange])
    .args(["--concurrency", &options.concurrency.to_string()])
    .args(["--prefetch", &options.prefetch.to_string()])
    // The URLs carry the passwords (from a password file too): a password file inherited as well would be a
    // password given twice.
    .env("DATABASE_URL", scratch.db.url())
    .env("AMQP_URL", broker.url())
    .env_remove("DATABASE_PASSWORD_FILE")
    .env_remove("AMQP_PASSWORD_FILE")
    .envs(broker.ca_file().map(|p| ("AMQP_CA_FILE", p)))
    // The same quiet logging for every mode: a WARN line per duplicate would tax the modes that find them.
    .env("RUST_LOG", "error")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    match scratch.mode {
        Mode::Bare => {
            cmd.args(["--claim", "none"]);
        }
        Mode::Tutorial => {
            cmd.args(["--claim", "lookup-first"]);
        }
        Mode::InboxBatched => {
            cmd.args(["--batch-size", &options.batch_size.to_string()]);
        }
        Mode::Inbox | Mode::Ceiling | Mode::Peer => {}
    }
    if until_idle {
        cmd.args(["--exit-when-idle", "1s"]);
    }
    // A binary rebuilt while the bench runs is gone from the path it started from: say which file is missing.
    cmd.spawn().map_err(|e| {
        Error::Tool(format!(
            "cannot start a consumer process from {}: {e}",
            crate::sanitize::text(&cmd.get_program().to_string_lossy())
        ))
    })
}

/// Waits until the queue has a consumer.
async fn wait_for_consumer(connection: &Connection, queue: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some((_, consumers)) = crate::amqp::topology::queue_depth(connection, queue).await?
            && consumers > 0
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(Error::Topology(format!("no consumer on {queue} after 30s")))
}

fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// The database alone: the inbox transaction from `concurrency` connections, as fast as they go.
async fn ceiling(scratch: &Scratch, options: &Options) -> Result<Repeat> {
    truncate(scratch).await?;
    let run = |count: u64| {
        let pool = scratch.pool.clone();
        let next = Arc::new(AtomicU64::new(0));
        let workers = (0..options.concurrency).map(move |_| {
            let pool = pool.clone();
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < count {
                    let id = Uuid::now_v7();
                    let mut tx = pool.begin().await?;
                    let _: bool = sqlx::query_scalar(sql::CLAIM)
                        .bind(id)
                        .bind("ceiling")
                        .bind(Uuid::new_v4().as_bytes().as_slice())
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(sql::INSERT_CARRIER_RESERVATION)
                        .bind(Uuid::new_v4())
                        .bind(Uuid::new_v4())
                        .bind(Utc::now())
                        .bind(id)
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
                Ok::<(), sqlx::Error>(())
            })
        });
        futures_util::future::join_all(workers)
    };
    for result in run(options.warmup).await {
        result.map_err(std::io::Error::other)??;
    }
    truncate(scratch).await?;
    let started = Instant::now();
    for result in run(options.messages).await {
        result.map_err(std::io::Error::other)??;
    }
    Ok(Repeat {
        throughput: options.messages as f64 / started.elapsed().as_secs_f64(),
        ..Repeat::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_and_percentiles() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).expect("spread");
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(
            Spread::of(&[1.0, 2.0, 3.0, 4.0]).map(|s| s.median),
            Some(2.5)
        );
        assert!(Spread::of(&[]).is_none());
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.5), Some(50.0));
        assert_eq!(percentile(&sorted, 0.99), Some(99.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn ratios_pair_the_same_repeats() {
        let r = |t: f64| Repeat {
            throughput: t,
            ..Repeat::default()
        };
        let mut repeats = BTreeMap::new();
        repeats.insert(Mode::Bare, vec![r(100.0), r(200.0), r(100.0)]);
        repeats.insert(Mode::Inbox, vec![r(80.0), r(100.0), r(90.0)]);
        let ratios = ratios(&repeats);
        let s = ratios["inbox/bare"];
        assert_eq!((s.median, s.min, s.max), (0.8, 0.5, 0.9));
    }
}
