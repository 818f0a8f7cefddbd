//! What every measurement uses: a mode's scratch database and queue, publishing with confirms, the mode's consumer as
//! a child process (its resident memory sampled), and the latencies read back from the effects.

use std::collections::{BTreeMap, VecDeque};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use inboxctl::amqp::envelope::HostInfo;
use inboxctl::amqp::publish::{self, Routed};
use inboxctl::amqp::{Broker, topology};
use inboxctl::db::Database;
use inboxctl::ids::IdKind;
use inboxctl::producer::{self, Message, Plan};
use lapin::Connection;
use lapin::options::ConfirmSelectOptions;
use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::report::{Mode, Options};
use crate::{peer, sql};

/// A mode's scratch database, queue and exchange.
pub struct Scratch {
    pub mode: Mode,
    pub db: Database,
    pub pool: PgPool,
    pub queue: String,
    pub exchange: String,
    pub peer: Option<peer::Peer>,
    /// The inbox holds `--inbox-rows` rows that every run keeps.
    pub prefilled: bool,
    /// What its queue is declared as.
    pub queue_type: topology::QueueType,
}

impl Scratch {
    pub fn route(&self) -> (&str, &str, topology::QueueType) {
        (&self.exchange, &self.queue, self.queue_type)
    }
}

pub async fn drop_database(db: &Database, name: &str) -> Result<()> {
    let mut admin = db.with_database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        inboxctl::db::sql::quote_ident(name)
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}

/// `count` new parcels, each once, their message ids of the kind `ids`.
pub fn messages(count: u64, ids: IdKind) -> Vec<Message> {
    producer::messages(&Plan {
        ids,
        ..Plan::parcels(count)
    })
}

/// Publishes `messages` to `exchange` (bound to `queue`), with confirms; at `rate` per second if given; until `stop`
/// if given. Returns when each was published.
pub async fn publish(
    connection: &Connection,
    broker: &Broker,
    (exchange, queue, queue_type): (&str, &str, topology::QueueType),
    messages: &[Message],
    rate: Option<f64>,
    stop: Option<&CancellationToken>,
) -> Result<BTreeMap<Uuid, DateTime<Utc>>> {
    topology::ensure_endpoint(connection, exchange, queue, queue_type).await?;
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
    let mut pending = VecDeque::new();
    for message in messages {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        if stop.is_some_and(CancellationToken::is_cancelled) {
            break;
        }
        let (properties, body) = producer::envelope(message, broker, exchange, &host);
        let confirm = publish::publish(&channel, exchange, "", &body, properties).await?;
        sent.insert(message.message_id, Utc::now());
        pending.push_back(confirm);
        if pending.len() >= 512
            && let Some(c) = pending.pop_front()
        {
            confirmed(c).await?;
        }
    }
    while let Some(c) = pending.pop_front() {
        confirmed(c).await?;
    }
    let _ = channel.close(200, "OK".into()).await;
    Ok(sent)
}

/// Waits for one message's confirm: refused or returned, the run cannot measure what it meant to.
async fn confirmed(confirm: lapin::PublisherConfirm) -> Result<()> {
    match publish::confirmed(confirm).await {
        Ok(Routed::Queued) => Ok(()),
        Ok(Routed::Returned) => Err(Error::topology(
            "a benchmark message reached no queue (returned by the broker)",
        )),
        Err(e) => Err(Error::topology(format!(
            "the broker did not take a benchmark message: {e}"
        ))),
    }
}

/// The latencies from publish to effect of the messages `ids`, sorted, in milliseconds.
pub async fn latencies(
    pool: &PgPool,
    published: &BTreeMap<Uuid, DateTime<Utc>>,
    ids: &[Uuid],
) -> Result<Vec<f64>> {
    let effects: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(sql::EFFECT_TIMES)
        .bind(ids)
        .fetch_all(pool)
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
    Ok(latencies)
}

/// Runs the mode's consumer until its queue is idle; returns its peak resident memory in MB.
pub async fn consume_until_idle(
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
        return Err(Error::topology(format!(
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

/// The mode's consumer as a child process: the peer's under Node.js, the others this binary's `consume`.
pub fn spawn_consumer(
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
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["consume", "--queue", &scratch.queue])
        .args(["--queue-type", scratch.queue_type.name()])
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
    let guard = match scratch.mode {
        Mode::Bare => "bare",
        Mode::Tutorial => "lookup-first",
        Mode::InboxTransaction => "inbox-transaction",
        Mode::InboxBatched => {
            cmd.args(["--batch-size", &options.batch_size.to_string()]);
            "inbox"
        }
        Mode::Broker => "nothing",
        Mode::BrokerBatched => {
            cmd.args(["--batch-size", &options.batch_size.to_string()]);
            "nothing"
        }
        Mode::Inbox | Mode::InboxQuorum | Mode::Ceiling | Mode::CeilingBatched | Mode::Peer => {
            "inbox"
        }
    };
    cmd.args(["--guard", guard]);
    if until_idle {
        cmd.args(["--exit-when-idle", "1s"]);
        if scratch.mode.writes_nothing() {
            cmd.arg("--span-file").arg(span_file(scratch));
        }
    }
    // A binary rebuilt while the bench runs is gone from the path it started from: say which file is missing.
    cmd.spawn().map_err(|e| {
        Error::Tool(format!(
            "cannot start a consumer process from {}: {e}",
            inboxctl::sanitize::text(&cmd.get_program().to_string_lossy())
        ))
    })
}

/// Where a mode that writes nothing says what it took ([`crate::guard::Span`]).
pub fn span_file(scratch: &Scratch) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{}-{}.span", scratch.queue, std::process::id()))
}

/// Waits until the queue has a consumer.
pub async fn wait_for_consumer(connection: &Connection, queue: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some((_, consumers)) = topology::queue_depth(connection, queue).await?
            && consumers > 0
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(Error::topology(format!("no consumer on {queue} after 30s")))
}

pub fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}
