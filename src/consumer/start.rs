//! A Parcel Tracker consumer started the way `consume` and `demo` start it: its names checked, a pool opened, the
//! schema and the role's privileges checked before the first delivery, `/metrics` served if asked, then
//! [`run`](super::run) until it stops.
//!
//! [`Config::default`] holds `consume`'s defaults: the face's flags start from the same values (a test in
//! `cmd::consume` keeps the two equal), so `demo`, the bench and `consume` run one and the same consumer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use super::{ConsumerOptions, OnConflict, Partitions, RunCounts, RunSummary, WorkGuard};
use crate::amqp::{self, Broker, topology};
use crate::db::{self, Database, schema};
use crate::effects::{self, CarrierApi, CarrierClient, EffectMode};
use crate::error::{Error, Result};
use crate::inbox::{ConsumerType, Inbox, Keying};
use crate::metrics;
use crate::parcel::{CarrierConsumer, Kind, NotificationConsumer, StandInCarrier, StandInSms};

pub const DEFAULT_PREFETCH: u16 = 64;
pub const DEFAULT_CONCURRENCY: u16 = 16;
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(200);
pub const DEFAULT_CLAIM_TIMEOUT: Duration = Duration::from_secs(30);
/// What an attempt's bound allows beyond its longest wait on purpose, when `--attempt-timeout` is not given: with the
/// default `--claim-timeout`, 60s.
pub const ATTEMPT_MARGIN: Duration = Duration::from_secs(30);
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_BROKER_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_BATCH_SIZE: u16 = 1;
pub const DEFAULT_BATCH_WAIT: Duration = Duration::from_millis(5);
pub const DEFAULT_POISON_AFTER: u32 = 3;

/// Everything `consume` is told; [`Default`] is `consume carrier` with no flags.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub consumer: Kind,
    /// The queue to read; `None`: the consumer's own ([`Kind::default_queue`]).
    pub queue: Option<String>,
    /// The exchange the event is published to.
    pub exchange: String,
    /// What the queue and its dead-letter queues are declared as where they do not exist.
    pub queue_type: topology::QueueType,
    /// The deduplication scope; `None`: the queue's name.
    pub consumer_type: Option<String>,
    pub prefetch: u16,
    pub concurrency: u16,
    /// Most PostgreSQL connections; `None`: `concurrency`.
    pub pool_size: Option<u32>,
    pub max_attempts: u32,
    pub retry_delay: Duration,
    /// How long a copy waits for another process's attempt at the same message (PostgreSQL's `lock_timeout`).
    pub claim_timeout: Duration,
    /// How long one attempt at a message (or a batch) may wait on PostgreSQL before its connection is given up
    /// (`--attempt-timeout`); `None`: [`Config::attempt_timeout`]'s default, from the waits an attempt makes.
    pub attempt_timeout: Option<Duration>,
    pub exit_when_idle: Option<Duration>,
    pub shutdown_timeout: Duration,
    /// How long a call to RabbitMQ may take before the connection is given up (`--broker-timeout`).
    pub broker_timeout: Duration,
    pub batch_size: u16,
    pub batch_wait: Duration,
    pub poison_after: u32,
    pub on_conflict: OnConflict,
    pub metrics_addr: Option<SocketAddr>,
    /// The stand-in carrier (or SMS gateway) fails every call for parcels to this destination.
    pub fail_destination: Option<String>,
    /// Spread over partition queues, one message at a time in each (`concurrency` and `batch_size` do not apply).
    pub partitions: Option<Partitions>,
    /// The carrier as an HTTP API (the carrier consumer only); `None`: the stand-in that writes a row.
    pub carrier_api: Option<CarrierApi>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            consumer: Kind::Carrier,
            queue: None,
            exchange: topology::PARCEL_CREATED_EXCHANGE.to_owned(),
            queue_type: topology::QueueType::Classic,
            consumer_type: None,
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            pool_size: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_delay: DEFAULT_RETRY_DELAY,
            claim_timeout: DEFAULT_CLAIM_TIMEOUT,
            attempt_timeout: None,
            exit_when_idle: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            broker_timeout: DEFAULT_BROKER_TIMEOUT,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_wait: DEFAULT_BATCH_WAIT,
            poison_after: DEFAULT_POISON_AFTER,
            on_conflict: OnConflict::DeadLetter,
            metrics_addr: None,
            fail_destination: None,
            partitions: None,
            carrier_api: None,
        }
    }
}

impl Config {
    /// `consume <consumer>` with every default.
    pub fn of(consumer: Kind) -> Self {
        Self {
            consumer,
            ..Self::default()
        }
    }

    /// Messages worked on at once: `concurrency`, or partitioned, one per partition.
    pub fn workers(&self) -> u16 {
        self.partitions
            .as_ref()
            .map_or(self.concurrency, |p| p.count)
    }

    pub fn queue(&self) -> &str {
        self.queue
            .as_deref()
            .unwrap_or(self.consumer.default_queue())
    }
}

/// Runs the consumer `config` describes with the claim protocol until it stops.
pub async fn consume(
    config: &Config,
    db: &Database,
    broker: &Broker,
    shutdown: CancellationToken,
) -> Result<RunSummary> {
    consume_guarded(config, db, broker, shutdown, |inbox| inbox).await
}

/// The same consumer, its work guarded by what `guard` makes of the inbox it would have used (the bench's
/// comparisons); everything else — checks, pool, retries, dead-lettering — is [`consume`]'s.
pub async fn consume_guarded<G: WorkGuard>(
    config: &Config,
    db: &Database,
    broker: &Broker,
    shutdown: CancellationToken,
    guard: impl FnOnce(Inbox) -> G,
) -> Result<RunSummary> {
    let (queue, consumer_type) = names(config)?;
    check_carrier_api(config)?;
    check_attempt_timeout(config)?;
    let pool_size = config.pool_size.unwrap_or(u32::from(config.workers()));
    let pool = db
        .with_lock_timeout(config.claim_timeout)
        .with_idle_in_transaction_timeout(config.attempt_timeout())
        .message_pool(pool_size)
        .await?;
    let summary = async {
        check_schema(&pool, db, config.carrier_api.is_some()).await?;
        check_privileges(&pool, db, config).await?;
        let counts = Arc::new(RunCounts::default());
        let mut inbox = Inbox::new(pool.clone(), consumer_type.clone())
            .with_claim_timeout(db.lock_timeout_per_transaction(config.claim_timeout))
            .with_attempt_timeout(Some(config.attempt_timeout()))
            .with_keying(keying(&pool, db).await?);
        let mut timings = None;
        if let Some(addr) = config.metrics_addr {
            let (registry, fed) = metrics::consume::registry(&consumer_type, Arc::clone(&counts));
            let health = metrics::consume::ConsumerHealth {
                pool: pool.clone(),
                counts: Arc::clone(&counts),
            };
            metrics::serve(addr, registry, Arc::new(health), shutdown.clone()).await?;
            inbox = inbox.with_claim_observer(Arc::new(fed.clone()));
            timings = Some(fed);
        }
        let about = serde_json::json!({
            "consumer_type": consumer_type.as_str(),
            "queue": queue,
            "effect_table": config.consumer.effect_table(),
            "batch_size": config.batch_size,
            "concurrency": config.concurrency,
            "partitions": config.partitions.as_ref().map(|p| p.count),
            "pid": std::process::id(),
        });
        crate::audit::record(
            &pool,
            &crate::audit::Entry {
                command: "consume",
                outcome: "started",
                exit_code: None,
                details: about.clone(),
            },
        )
        .await;
        let options = options(config, queue, counts, timings);
        let guard = guard(inbox);
        let fail_destination = config.fail_destination.clone();
        let ran = match (config.consumer, &config.carrier_api) {
            (Kind::Carrier, Some(api)) => {
                db::events::register_effect_mode(
                    &pool,
                    &consumer_type,
                    &options.queue,
                    api.mode.name(),
                    api.key_ttl,
                )
                .await?;
                let client = CarrierClient::new(&api.url, api.timeout, api.connect_timeout)?;
                match api.mode {
                    EffectMode::Keyed => {
                        let carrier = effects::HttpCarrier {
                            client,
                            consumer_type: consumer_type.clone(),
                        };
                        let consumer = CarrierConsumer { carrier };
                        super::run(guard, consumer, broker, options, shutdown).await
                    }
                    mode => {
                        let wake = Arc::new(tokio::sync::Notify::new());
                        let lookup = api
                            .lookup_url
                            .as_ref()
                            .map(|u| CarrierClient::new(u, api.timeout, api.connect_timeout))
                            .transpose()?;
                        let worker = effects::worker::Worker {
                            pool: pool.clone(),
                            consumer_type: consumer_type.clone(),
                            client,
                            lookup,
                            lease: api.lease,
                            max_attempts: config.max_attempts,
                            retry_delay: config.retry_delay,
                            concurrency: usize::from(config.workers()),
                            wake: Arc::clone(&wake),
                            bound: config.attempt_timeout(),
                        };
                        // The worker goes on making the calls owed until the consumer has stopped.
                        let stop_worker = CancellationToken::new();
                        let working = tokio::spawn(worker.run(stop_worker.clone()));
                        let carrier = effects::DeferredCarrier {
                            mode,
                            consumer_type: consumer_type.clone(),
                            wake,
                        };
                        let consumer = CarrierConsumer { carrier };
                        let options = ConsumerOptions {
                            owed_effects: Some(super::OwedEffects {
                                pool: pool.clone(),
                                consumer_type: consumer_type.clone(),
                            }),
                            ..options
                        };
                        let ran = super::run(guard, consumer, broker, options, shutdown).await;
                        stop_worker.cancel();
                        let _ = working.await;
                        ran
                    }
                }
            }
            (Kind::Carrier, None) => {
                let carrier = StandInCarrier { fail_destination };
                let consumer = CarrierConsumer { carrier };
                super::run(guard, consumer, broker, options, shutdown).await
            }
            (Kind::Notification, _) => {
                let gateway = StandInSms { fail_destination };
                let consumer = NotificationConsumer { gateway };
                super::run(guard, consumer, broker, options, shutdown).await
            }
        };
        let mut details = about;
        if let (Ok(summary), serde_json::Value::Object(map)) = (&ran, &mut details) {
            map.insert("summary".to_owned(), serde_json::json!(summary));
        }
        let mut entry =
            crate::audit::Entry::ended("consume", &ran, |_| crate::error::Outcome::Done, details);
        if entry.outcome == "done" {
            entry.outcome = "stopped";
        }
        // Over a connection of its own, briefly: the pool's may all be held by work stuck on a lock that the
        // shutdown is leaving behind.
        crate::audit::record_within(db, &entry, std::time::Duration::from_secs(2)).await;
        ran
    }
    .await;
    close_pool(pool).await;
    summary
}

fn options(
    config: &Config,
    queue: String,
    counts: Arc<RunCounts>,
    timings: Option<metrics::consume::Timings>,
) -> ConsumerOptions {
    ConsumerOptions {
        queue,
        queue_type: config.queue_type,
        event_exchange: config.exchange.clone(),
        prefetch: config.prefetch,
        // Partitioned, each partition's loop takes one message at a time: its queue's order is the effects' order.
        concurrency: match config.partitions {
            Some(_) => 1,
            None => usize::from(config.concurrency),
        },
        max_attempts: config.max_attempts,
        retry_delay: config.retry_delay,
        exit_when_idle: config.exit_when_idle,
        shutdown_timeout: config.shutdown_timeout,
        broker_timeout: config.broker_timeout,
        attempt_timeout: config.attempt_timeout(),
        counts,
        batch_size: match config.partitions {
            Some(_) => 1,
            None => usize::from(config.batch_size),
        },
        batch_wait: config.batch_wait,
        poison_after: config.poison_after,
        on_conflict: config.on_conflict,
        timings,
        partitions: config.partitions.clone(),
        owed_effects: None,
    }
}

/// The queue to consume and the consumer_type to claim under, checked: the queue and its dead-letter queues must be
/// valid AMQP names.
fn names(config: &Config) -> Result<(String, ConsumerType)> {
    let queue = config.queue().to_owned();
    amqp::validate_name("--queue", &queue)?;
    // The dead-letter queues' (and partitioned, the partitions' exchange's) names are the queue's with a suffix:
    // they must be valid too, or the first message to move aside would find no name to go to.
    let (longest, what) = match config.partitions {
        Some(_) => (
            topology::partition_exchange(&queue),
            "its partitions' exchange <queue>.partitions",
        ),
        None => (
            topology::skipped_queue(&queue),
            "its dead-letter queue <queue>_skipped",
        ),
    };
    if longest.len() > 255 {
        let suffix = longest.len() - queue.len();
        return Err(Error::Usage(format!(
            "--queue is {} bytes long; the name of {what} would be {} bytes, past AMQP's 255: at most {} bytes",
            queue.len(),
            longest.len(),
            255 - suffix
        )));
    }
    let consumer_type = ConsumerType::new(
        config
            .consumer_type
            .clone()
            .unwrap_or_else(|| queue.clone()),
    )
    .map_err(|e| Error::Usage(format!("--consumer-type: {e}")))?;
    Ok((queue, consumer_type))
}

impl Config {
    /// The longest an attempt waits on purpose: up to `--claim-timeout` for another attempt at its message before its
    /// own work starts, and keyed, a call to the carrier inside its transaction (`--carrier-timeout`, after a connect
    /// of up to its own timeout) — batched, one for each member of the batch, in turn.
    fn attempt_waits(&self) -> Duration {
        let members = match self.partitions {
            Some(_) => 1,
            None => u32::from(self.batch_size.max(1)),
        };
        let keyed_calls = self
            .carrier_api
            .as_ref()
            .filter(|api| api.mode == EffectMode::Keyed)
            .map(|api| (api.timeout + api.connect_timeout) * members);
        self.claim_timeout + keyed_calls.unwrap_or_default()
    }

    /// The bound on one attempt: `--attempt-timeout` when given, else [`ATTEMPT_MARGIN`] beyond what the attempt
    /// waits for on purpose (60s with the defaults), so that a longer `--claim-timeout` or `--carrier-timeout` never
    /// needs a second flag.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
            .unwrap_or_else(|| self.attempt_waits() + ATTEMPT_MARGIN)
    }
}

/// A bound on the whole attempt no longer than what it waits for on purpose would give up attempts that are only
/// waiting their turn, or a call in progress — as the database unavailable, tried again for ever, never counted
/// against the message.
fn check_attempt_timeout(config: &Config) -> Result<()> {
    let waits = config.attempt_waits();
    let limit = config.attempt_timeout();
    if limit <= waits {
        return Err(Error::Usage(format!(
            "--attempt-timeout ({}) must be longer than --claim-timeout{} ({}): an attempt may wait that long before \
             it is done",
            crate::cli::show(limit),
            if waits > config.claim_timeout {
                " plus the keyed calls to the carrier a batch makes, with their connects"
            } else {
                ""
            },
            crate::cli::show(waits),
        )));
    }
    Ok(())
}

/// Refuses a carrier API where it cannot apply: on the notification consumer, and with a lease no longer than a call
/// may take (another process could take over an effect whose call is still in flight).
fn check_carrier_api(config: &Config) -> Result<()> {
    let Some(api) = &config.carrier_api else {
        return Ok(());
    };
    if config.consumer != Kind::Carrier {
        return Err(Error::Usage(
            "--carrier-url applies to the carrier consumer only".to_owned(),
        ));
    }
    if api.mode != EffectMode::Keyed && api.lease <= api.timeout + api.connect_timeout {
        return Err(Error::Usage(format!(
            "--effect-lease ({}) must be longer than --carrier-timeout plus the connect timeout ({}): a call must have \
             ended before another process may take its effect over",
            crate::cli::show(api.lease),
            crate::cli::show(api.timeout + api.connect_timeout)
        )));
    }
    if api.lookup_url.is_some() && api.mode != EffectMode::AfterCommit {
        return Err(Error::Usage(
            "--lookup-url applies to --effect-mode after-commit (an at-most-once effect in doubt is settled by \
             `inboxctl effects reconcile`)"
                .to_owned(),
        ));
    }
    Ok(())
}

/// Closes the pool, waiting a bounded time.
async fn close_pool(pool: PgPool) {
    // Bounded: a connection abandoned mid-statement at the shutdown timeout (work stuck on a lock) is never given
    // back, and the pool would wait for it for ever. The server rolls it back when the process is gone.
    if tokio::time::timeout(Duration::from_secs(2), pool.close())
        .await
        .is_err()
    {
        tracing::debug!(
            "PostgreSQL connections still busy after the stop; left to the server to roll back"
        );
    }
}

/// How the inbox keys messages, said when it is partitioned: which time each message is claimed on.
async fn keying(pool: &PgPool, db: &Database) -> Result<Keying> {
    let layout = db::partitions::layout(pool).await.map_err(|e| match e {
        Error::SchemaIncompatible { differences, .. } => Error::SchemaIncompatible {
            database: db.name(),
            differences,
        },
        other => other,
    })?;
    let keying = layout.map_or(Keying::Plain, Keying::of);
    if let Some(db::partitions::Layout::Partitioned(settings)) = layout {
        tracing::info!(
            every = %humantime::format_duration(settings.interval.to_std().unwrap_or_default()),
            time = settings.source.name(),
            "partitioned inbox: each message is claimed on {}; one that carries none, or whose time no partition \
             holds, goes to the error queue with the reason",
            settings.source.describe()
        );
    }
    Ok(keying)
}

/// Refuses to start on a database `migrate` has not prepared, or whose `inbox_messages` inboxctl cannot use.
async fn check_schema(pool: &PgPool, db: &Database, calls_outside: bool) -> Result<()> {
    let mut tables = vec![
        "inbox_messages",
        "inboxctl_events",
        "inboxctl_consumers",
        "inboxctl_fingerprints",
    ];
    if calls_outside {
        tables.push("inboxctl_effects");
    }
    schema::require_tables(pool, db, &tables).await?;
    let mut conn = pool.acquire().await.map_err(|e| db.unavailable(e))?;
    let differences = schema::inbox_differences(&mut conn).await?;
    if !differences.is_empty() {
        return Err(Error::SchemaIncompatible {
            database: db.name(),
            differences,
        });
    }
    Ok(())
}

/// Refuses to start when the role lacks a privilege the claim or the effect needs (docs/security.md),
/// naming each: otherwise every delivery would be held with the same error. A missing privilege on
/// `inboxctl_attempts` turns off only the poison-message guard: said, not refused.
async fn check_privileges(pool: &PgPool, db: &Database, config: &Config) -> Result<()> {
    let kind = config.consumer;
    let mut needs: Vec<(&str, &str)> = vec![
        ("inbox_messages", "SELECT,INSERT"),
        ("inboxctl_fingerprints", "SELECT,INSERT,UPDATE"),
        (kind.effect_table(), "INSERT"),
        ("inboxctl_events", "INSERT"),
        ("inboxctl_consumers", "SELECT,INSERT,UPDATE"),
        ("inboxctl_attempts", "SELECT,INSERT,UPDATE,DELETE"),
    ];
    if config.carrier_api.is_some() {
        needs.push(("inboxctl_effects", "SELECT,INSERT,UPDATE"));
    }
    let missing = db::grants::missing_privileges(pool, &needs)
        .await
        .map_err(|e| match db::is_transient(&e) {
            true => db.unavailable(e),
            false => Error::from(e),
        })?;
    let (attempts, required): (Vec<_>, Vec<_>) = missing
        .into_iter()
        .partition(|m| m.table == "inboxctl_attempts");
    if let Some(db::grants::Missing { privileges, .. }) = attempts.first() {
        tracing::warn!(
            missing = %privileges,
            "the role lacks privileges on inboxctl_attempts: poison-message detection is off (a message that ends \
             the process every time will keep coming back)"
        );
    }
    if required.is_empty() {
        return Ok(());
    }
    Err(Error::PermissionMissing {
        role: db.options().get_username().to_owned(),
        command: "consume",
        missing: required
            .into_iter()
            .map(|m| format!("{} on {}", m.privileges, m.table))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_api(consumer: Kind, mode: EffectMode) -> Config {
        let mut api = CarrierApi::new(url::Url::parse("http://127.0.0.1:1").expect("url"));
        api.mode = mode;
        Config {
            carrier_api: Some(api),
            ..Config::of(consumer)
        }
    }

    #[test]
    fn an_attempt_timeout_outlasts_what_an_attempt_waits_for() {
        let default = Config::default();
        assert_eq!(default.attempt_timeout(), Duration::from_secs(60));
        assert!(check_attempt_timeout(&default).is_ok());
        // A longer claim wait, or a keyed call, moves the default along: no second flag needed.
        let long_claim = Config {
            claim_timeout: Duration::from_secs(600),
            ..Config::default()
        };
        assert_eq!(long_claim.attempt_timeout(), Duration::from_secs(630));
        assert!(check_attempt_timeout(&long_claim).is_ok());
        let keyed = with_api(Kind::Carrier, EffectMode::Keyed);
        assert_eq!(
            keyed.attempt_timeout(),
            Duration::from_secs(30 + 10 + 3 + 30)
        );
        // Batched, keyed: a call for each member, in turn, in one transaction.
        let keyed_batches = Config {
            batch_size: 8,
            ..keyed.clone()
        };
        assert_eq!(
            keyed_batches.attempt_timeout(),
            Duration::from_secs(30 + 8 * 13 + 30)
        );
        // After commit, the call is outside the attempt.
        let after_commit = with_api(Kind::Carrier, EffectMode::AfterCommit);
        assert_eq!(after_commit.attempt_timeout(), Duration::from_secs(60));

        // Given, it must be longer than those waits.
        for (config, given, named) in [
            (Config::default(), 30, "--claim-timeout (30s)"),
            (Config::default(), 10, "--claim-timeout (30s)"),
            (
                keyed.clone(),
                40,
                "keyed calls to the carrier a batch makes, with their connects (43s)",
            ),
        ] {
            let short = Config {
                attempt_timeout: Some(Duration::from_secs(given)),
                ..config
            };
            let err = check_attempt_timeout(&short).expect_err("no longer than the waits");
            assert!(matches!(err, Error::Usage(_)), "{err}");
            assert!(
                err.to_string().contains("--attempt-timeout") && err.to_string().contains(named),
                "{err}"
            );
        }
        let given = Config {
            attempt_timeout: Some(Duration::from_secs(44)),
            ..keyed
        };
        assert!(check_attempt_timeout(&given).is_ok());
        assert_eq!(given.attempt_timeout(), Duration::from_secs(44));
    }

    #[test]
    fn a_carrier_api_is_refused_where_it_cannot_apply() {
        assert!(check_carrier_api(&with_api(Kind::Carrier, EffectMode::Keyed)).is_ok());
        assert!(check_carrier_api(&with_api(Kind::Notification, EffectMode::Keyed)).is_err());
        let mut short = with_api(Kind::Carrier, EffectMode::AfterCommit);
        assert!(check_carrier_api(&short).is_ok(), "the defaults fit");
        if let Some(api) = short.carrier_api.as_mut() {
            api.lease = api.timeout;
        }
        let err = check_carrier_api(&short).expect_err("a lease no longer than a call");
        assert!(err.to_string().contains("--effect-lease"), "{err}");
        let mut lookup = with_api(Kind::Carrier, EffectMode::AtMostOnce);
        if let Some(api) = lookup.carrier_api.as_mut() {
            api.lookup_url = Some(api.url.clone());
        }
        assert!(
            check_carrier_api(&lookup).is_err(),
            "at-most-once takes no look-up"
        );
    }
}
