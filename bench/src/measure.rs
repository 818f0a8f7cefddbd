//! The consumer modes, side by side, on the PostgreSQL and RabbitMQ the bench is given.
//!
//! Every mode gets a scratch database and a queue (and event exchange) of its own, the same effect (one row in
//! `carrier_reservations`), the same prefetch and concurrency, and a warm-up before it is measured; modes alternate
//! within each repeat, so a noisy neighbour hurts them all alike. The consumers run as child processes (see
//! [`crate::guard`]; the peer under Node.js, [`crate::peer`]), so their resident memory can be read.
//!
//! - `ceiling`: the library's [`Inbox`] with the same effect, from `concurrency` tasks, no broker;
//! - `bare`: the consumer without an inbox; `tutorial`: a look-up first, then the inbox insert and the effect;
//! - `inbox`: inboxctl's consumer; `inbox-batched`: the same with `--batch-size`;
//! - `peer`: pg-transactional-outbox (npm) under Node.js, as its docs and RabbitMQ example set it up.
//!
//! Per mode and repeat: throughput (messages pre-loaded, first effect to last), latency from publish to effect at a
//! steady rate (p50, p99), duplicate effects when a fraction of the messages arrive twice, peak resident memory.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use inboxctl::amqp::Broker;
use inboxctl::amqp::envelope::HostInfo;
use inboxctl::db::{Database, schema};
use inboxctl::ids::IdKind;
use inboxctl::inbox::{
    ConsumerType, Fingerprint, Inbox, Member, ProcessError, TogetherWork, Work, WorkError,
};
use inboxctl::parcel::{Carrier as _, PickupRequest, StandInCarrier};
use inboxctl::producer::{self, Plan};
use lapin::Connection;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::report::{Machine, Mode, ModeReport, Options, Repeat, Report, Settings, ms, ratios};
use crate::scratch::{
    Scratch, consume_until_idle, drop_database, latencies, messages, publish, spawn_consumer, stop,
    wait_for_consumer,
};
use crate::{peer, prefill, sql};

pub async fn run(
    db: &Database,
    broker: &Broker,
    options: &Options,
    shutdown: &CancellationToken,
    mut say: impl FnMut(&str),
) -> Result<Report> {
    let started_at = Utc::now();
    if options.modes.is_empty() {
        let pool = db.with_database("postgres").pool(1).await?;
        let machine = machine(&pool).await?;
        pool.close().await;
        return Ok(report(
            machine,
            Settings::of(options, None),
            started_at,
            BTreeMap::new(),
        ));
    }
    if options.inbox_rows > 0 && options.ids == IdKind::NewId {
        // The new ids continue the prefilled ones as that process's would: among them, not in a range of their own.
        inboxctl::ids::pin_new_id_process(prefill::NEW_ID_PROCESS);
    }
    let connection = broker.connect("inboxctl bench").await?;
    let peer = if options.modes.contains(&Mode::Peer) {
        let mut say_now = |line: &str| say(line);
        Some(tokio::task::block_in_place(|| {
            peer::Peer::install(&mut say_now)
        })?)
    } else {
        None
    };
    let mut scratches = Vec::new();
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
    let repeats = repeat(&scratches, broker, &connection, options, shutdown, &mut say).await?;
    if !options.keep {
        for scratch in scratches {
            remove(db, &connection, scratch).await?;
        }
    }
    inboxctl::amqp::close(&connection, "OK").await;
    let settings = Settings::of(options, peer.as_ref());
    Ok(report(machine, settings, started_at, repeats))
}

fn report(
    machine: Machine,
    settings: Settings,
    started_at: DateTime<Utc>,
    repeats: BTreeMap<Mode, Vec<Repeat>>,
) -> Report {
    Report {
        machine,
        settings,
        started_at,
        ratios: ratios(&repeats),
        modes: repeats
            .into_iter()
            .map(|(m, r)| (m.name(), ModeReport::of(r)))
            .collect(),
        cleanup: None,
        refresh_ms: None,
    }
}

/// Every mode once per repeat, in the order given.
async fn repeat(
    scratches: &[Scratch],
    broker: &Broker,
    connection: &Connection,
    options: &Options,
    shutdown: &CancellationToken,
    say: &mut impl FnMut(&str),
) -> Result<BTreeMap<Mode, Vec<Repeat>>> {
    let mut repeats: BTreeMap<Mode, Vec<Repeat>> = BTreeMap::new();
    for repeat in 1..=options.repeats {
        for scratch in scratches {
            if shutdown.is_cancelled() {
                return Err(Error::usage("interrupted"));
            }
            let result = measure(scratch, broker, connection, options, shutdown).await?;
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
    Ok(repeats)
}

/// Drops a mode's scratch database, queue and exchanges.
async fn remove(db: &Database, connection: &Connection, scratch: Scratch) -> Result<()> {
    scratch.pool.close().await;
    if let Ok(channel) = connection.create_channel().await {
        let _ = channel
            .queue_delete(scratch.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        for exchange in [&scratch.queue, &scratch.exchange] {
            let _ = channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
    }
    drop_database(db, &scratch.db.name()).await
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
    let prefilled = options.inbox_rows > 0 && mode.claims();
    if prefilled {
        let shape = prefill::Shape {
            rows: options.inbox_rows,
            ids: options.ids,
            partitioned: options.inbox_partitioned,
        };
        let template = prefill::template(db, shape, &mut |l| eprintln!("{l}")).await?;
        crate::template::copy(db, &template, &name).await?;
    } else {
        // Every mode, the peer too, has the same effect table (`carrier_reservations`), from inboxctl's migrations.
        schema::migrate(&scratch_db, false).await?;
    }
    if mode == Mode::Tutorial {
        let mut admin = db.with_database("postgres").connect().await?;
        sqlx::query(sqlx::AssertSqlSafe(
            sql::TUTORIAL_PLANNING.replace("{}", &inboxctl::db::sql::quote_ident(&name)),
        ))
        .execute(&mut admin)
        .await?;
    }
    let peer = match (mode, peer) {
        (Mode::Peer, Some(p)) => {
            let url = scratch_db.url();
            tokio::task::block_in_place(|| p.setup(url))?;
            Some(p.clone())
        }
        _ => None,
    };
    let pool = scratch_db
        .message_pool(u32::from(options.concurrency) + 2)
        .await?;
    Ok(Scratch {
        mode,
        db: scratch_db,
        pool,
        queue: format!("inboxctl-bench-{}", mode.name()),
        exchange: format!("inboxctl-bench-{}-events", mode.name()),
        peer,
        prefilled,
        queue_type: match mode {
            Mode::InboxQuorum => inboxctl::amqp::topology::QueueType::Quorum,
            _ => options.queue_type,
        },
    })
}

async fn machine(pool: &PgPool) -> Result<Machine> {
    let postgres_version: String = sqlx::query_scalar(sql::SERVER_VERSION)
        .fetch_one(pool)
        .await?;
    let synchronous_commit: String = sqlx::query_scalar(sql::SYNCHRONOUS_COMMIT)
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
    if scratch.prefilled {
        sqlx::raw_sql(sql::TRUNCATE_KEEPING_PREFILL)
            .execute(&scratch.pool)
            .await?;
    } else {
        sqlx::query(sql::TRUNCATE).execute(&scratch.pool).await?;
    }
    if scratch.peer.is_some() {
        sqlx::query(sql::TRUNCATE_PEER)
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
    match scratch.mode {
        Mode::Ceiling => return ceiling(scratch, options, 1).await,
        Mode::CeilingBatched => return ceiling(scratch, options, options.batch_size).await,
        _ => {}
    }
    // Warm-up: the same run, smaller, on the same database and queue; then empty tables for the measured run.
    truncate(scratch).await?;
    let warm = messages(options.warmup, options.ids);
    publish(connection, broker, scratch.route(), &warm, None, None).await?;
    consume_until_idle(scratch, broker, options).await?;

    // Throughput: everything pre-loaded, first effect to last.
    truncate(scratch).await?;
    let load = messages(options.messages, options.ids);
    publish(connection, broker, scratch.route(), &load, None, None).await?;
    let rss = consume_until_idle(scratch, broker, options).await?;
    if scratch.mode.writes_nothing() {
        // No effect to time, and none to count copies of: the consumer's own count of what it acknowledged.
        let path = crate::scratch::span_file(scratch);
        let line = std::fs::read_to_string(&path)?;
        let _ = std::fs::remove_file(&path);
        return Ok(Repeat {
            throughput: crate::guard::Span::throughput(&line).unwrap_or(0.0),
            rss_mb: rss,
            ..Repeat::default()
        });
    }
    let (count, seconds): (i64, Option<f64>) = sqlx::query_as(sql::EFFECT_SPAN)
        .fetch_one(&scratch.pool)
        .await?;
    let throughput = match seconds {
        Some(s) if s > 0.0 && count > 1 => (count - 1) as f64 / s,
        _ => 0.0,
    };
    let latencies = steady(scratch, broker, connection, options, shutdown).await?;
    let duplicate_effects = duplicates(scratch, broker, connection, options, shutdown).await?;
    Ok(Repeat {
        throughput,
        p50_ms: crate::report::percentile(&latencies, 0.50),
        p99_ms: crate::report::percentile(&latencies, 0.99),
        duplicate_effects: Some(duplicate_effects),
        rss_mb: rss,
    })
}

/// Latencies from publish to effect at a steady rate, sorted.
async fn steady(
    scratch: &Scratch,
    broker: &Broker,
    connection: &Connection,
    options: &Options,
    shutdown: &CancellationToken,
) -> Result<Vec<f64>> {
    truncate(scratch).await?;
    let count = (options.latency_rate * options.latency_seconds as f64).round() as u64;
    let steady = messages(count, options.ids);
    let mut consumer = spawn_consumer(scratch, broker, options, false)?;
    wait_for_consumer(connection, &scratch.queue).await?;
    let rate = Some(options.latency_rate);
    let published = publish(connection, broker, scratch.route(), &steady, rate, None).await?;
    let ids: Vec<Uuid> = steady.iter().map(|m| m.message_id).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: i64 = sqlx::query_scalar(sql::COUNT_EFFECTS_FOR)
            .bind(&ids)
            .fetch_one(&scratch.pool)
            .await?;
        if done >= ids.len() as i64 || Instant::now() > deadline || shutdown.is_cancelled() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(&mut consumer);
    latencies(&scratch.pool, &published, &ids).await
}

/// Duplicate effects when a fraction of the messages arrive twice, half at once and half after the rest.
async fn duplicates(
    scratch: &Scratch,
    broker: &Broker,
    connection: &Connection,
    options: &Options,
    shutdown: &CancellationToken,
) -> Result<u64> {
    truncate(scratch).await?;
    let plan = Plan {
        duplicates: options.duplicates,
        ids: options.ids,
        ..Plan::parcels(options.duplicate_messages)
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
    let (effects, parcels): (i64, i64) = sqlx::query_as(sql::DUPLICATE_EFFECTS)
        .fetch_one(&scratch.pool)
        .await?;
    Ok((effects - parcels).unsigned_abs())
}

/// The database alone: the library's inbox with the carrier's effect, as fast as it goes — one message a
/// transaction from `concurrency` tasks, or with `batch` > 1, batches of that size from as many tasks as the batched
/// consumer runs batch workers, each batch's bookings in one statement as the consumer writes them.
async fn ceiling(scratch: &Scratch, options: &Options, batch: u16) -> Result<Repeat> {
    truncate(scratch).await?;
    let consumer_type = ConsumerType::new("ceiling").map_err(Error::usage)?;
    let inbox = Inbox::new(scratch.pool.clone(), consumer_type);
    let batch = u64::from(batch.max(1));
    let ids = options.ids;
    // As many batches at once as the batched consumer works on (one by one, as many messages as it).
    let tasks = match batch {
        1 => u64::from(options.concurrency),
        _ => inboxctl::consumer::batch_workers(usize::from(options.concurrency), batch as usize)
            as u64,
    };
    let run = |count: u64| {
        let next = Arc::new(AtomicU64::new(0));
        let workers = (0..tasks).map(|_| {
            let (inbox, next) = (inbox.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let first = next.fetch_add(batch, Ordering::Relaxed);
                    if first >= count {
                        break;
                    }
                    let n = batch.min(count - first);
                    if batch == 1 {
                        claim_and_book(&inbox, ids).await?;
                    } else {
                        claim_and_book_batch(&inbox, n, ids).await?;
                    }
                }
                Ok::<(), Error>(())
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

/// `n` new messages through the batched inbox: `BEGIN`, the batch's claim, its bookings in one statement, `COMMIT`.
async fn claim_and_book_batch(inbox: &Inbox, n: u64, ids: IdKind) -> Result<()> {
    let requests: Vec<PickupRequest> = (0..n)
        .map(|_| {
            let id = ids.next();
            PickupRequest {
                parcel_id: Uuid::new_v4(),
                tracking_number: String::new(),
                destination: String::new(),
                message_id: id,
                idempotency_key: id,
            }
        })
        .collect();
    let members: Vec<Member<()>> = requests
        .iter()
        .map(|r| Member {
            message_id: r.message_id,
            fingerprint: Some(Fingerprint::from_bytes(*Uuid::new_v4().as_bytes())),
            carried: Default::default(),
            work: Box::new(|_| {
                Box::pin(async { Err(WorkError::msg("the ceiling books together")) })
            }),
        })
        .collect();
    let together: TogetherWork<()> = Box::new(move |tx, ids| {
        Box::pin(async move {
            StandInCarrier::default()
                .reserve_pickups(tx, &requests)
                .await?;
            Ok(vec![(); ids.len()])
        })
    });
    match inbox.process_batch_with(members, Some(together)).await {
        Ok(_) => Ok(()),
        Err(ProcessError::Unavailable(e) | ProcessError::Failed(WorkError::Database(e))) => {
            Err(e.into())
        }
        Err(ProcessError::Failed(other)) => Err(std::io::Error::other(other.to_string()).into()),
        Err(ProcessError::Unclaimable(reason)) => Err(std::io::Error::other(reason).into()),
    }
}

/// One new message through the inbox as `inboxctl consume` sends it: the claim and the stand-in carrier's booking in
/// one statement (`Inbox::process_effect`).
async fn claim_and_book(inbox: &Inbox, ids: IdKind) -> Result<()> {
    let id = ids.next();
    let request = PickupRequest {
        parcel_id: Uuid::new_v4(),
        tracking_number: String::new(),
        destination: String::new(),
        message_id: id,
        idempotency_key: id,
    };
    let fingerprint = Fingerprint::from_bytes(*Uuid::new_v4().as_bytes());
    let effect = StandInCarrier::default()
        .pickup_effect(&request)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?
        .ok_or_else(|| std::io::Error::other("the stand-in carrier books in one statement"))?;
    let work: Work<()> = Box::new(move |tx| {
        Box::pin(async move {
            let carrier = StandInCarrier::default();
            carrier.reserve_pickup(tx, &request).await.map(drop)
        })
    });
    let carried = Default::default();
    match inbox
        .process_effect(id, Some(fingerprint), &carried, effect, work)
        .await
    {
        Ok(_) => Ok(()),
        Err(ProcessError::Unavailable(e) | ProcessError::Failed(WorkError::Database(e))) => {
            Err(e.into())
        }
        Err(ProcessError::Failed(other)) => Err(std::io::Error::other(other.to_string()).into()),
        Err(ProcessError::Unclaimable(reason)) => Err(std::io::Error::other(reason).into()),
    }
}
