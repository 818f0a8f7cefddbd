//! A Parcel Tracker consumer started the way `consume` and `demo` start it from its [`Config`]: its names and bounds
//! checked, a pool opened, the schema and the role's privileges checked before the first delivery, `/metrics` served
//! if asked, then [`run`](super::run) until it stops.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use super::config::{Config, check_attempt_timeout, check_carrier_api, names};
use super::{ConsumerOptions, RunCounts, RunSummary, WorkGuard};
use crate::amqp::Broker;
use crate::db::{self, Database, schema};
use crate::effects::{self, CarrierClient, EffectMode};
use crate::error::{Error, Result};
use crate::inbox::{Inbox, Keying};
use crate::metrics;
use crate::parcel::{CarrierConsumer, Kind, NotificationConsumer, StandInCarrier, StandInSms};

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
    let pool = open_message_pool(
        &db.with_lock_timeout(config.claim_timeout)
            .with_idle_in_transaction_timeout(config.attempt_timeout())
            // Its own, replacing one the role or the database sets (managed services often do, and shorter): a lock
            // the work waits on then ends at `lock_timeout` (--claim-timeout), the moment's doing, tried again
            // uncounted — cut short by the server's, it was the work's failure, and a good message went to the error
            // queue. A work slow of its own is given up at --attempt-timeout, the server's bound a second after.
            .with_statement_timeout(config.attempt_timeout() + std::time::Duration::from_secs(1)),
        pool_size,
    )
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
                pool: db.message_pool(1).await?,
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
                let wake = Arc::new(tokio::sync::Notify::new());
                let worker = effects::worker::Worker {
                    pool: pool.clone(),
                    consumer_type: consumer_type.clone(),
                    client: client.clone(),
                    lookup: api
                        .lookup_url
                        .as_ref()
                        .map(|u| CarrierClient::new(u, api.timeout, api.connect_timeout))
                        .transpose()?,
                    // Keyed, the lease is checked against nothing else (no call of its own is leased): it still
                    // outlasts a call, for those owed by an earlier run.
                    lease: match api.mode {
                        EffectMode::Keyed => api
                            .lease
                            .max(api.timeout + api.connect_timeout + Duration::from_secs(1)),
                        _ => api.lease,
                    },
                    max_attempts: config.max_attempts,
                    retry_delay: config.retry_delay,
                    concurrency: usize::from(config.workers()),
                    wake: Arc::clone(&wake),
                    bound: config.attempt_timeout(),
                    // Only an after-commit run makes again a call whose outcome is unknown (an after-commit run's,
                    // its lease run out): a keyed run has no look-up that run may have had, and an at-most-once run
                    // must never make a call twice.
                    pending_only: api.mode != EffectMode::AfterCommit,
                    quiet: if api.lookup_url.is_some() {
                        api.lookup_quiet
                    } else {
                        Duration::ZERO
                    },
                    key_ttl: api.key_ttl,
                };
                match api.mode {
                    EffectMode::Keyed => {
                        let carrier = effects::HttpCarrier {
                            client,
                            consumer_type: consumer_type.clone(),
                            answered: Arc::new(effects::Answered::new()),
                        };
                        let consumer = CarrierConsumer { carrier };
                        // Calls pending are made by this run too, whenever they come to be owed: left by an earlier
                        // run in another mode, owed again by an operator (`effects resolve --retry`, `effects
                        // reconcile`), or committed by the drain of a run in another mode stopping beside this one
                        // (a rolling deploy). Keyed, no call is owed after a commit, so nothing else would ever make
                        // them: the worker runs beside the consumer from the start, whatever is owed now. One whose
                        // outcome is unknown is not made: without the look-up that run may have had, making it again
                        // could book twice.
                        let (_, unknown) = owed_by_an_earlier_run(&pool, &consumer_type).await;
                        if unknown > 0 {
                            tracing::warn!(
                                consumer_type = %consumer_type,
                                calls = unknown,
                                "calls to the carrier whose outcome is unknown were left by an earlier run \
                                 (--effect-mode after-commit or at-most-once); this keyed run does not make them again: \
                                 run the consumer in their mode, or settle them (inboxctl effects reconcile; effects \
                                 resolve)"
                            );
                        }
                        beside_the_worker(worker, guard, consumer, broker, options, shutdown).await
                    }
                    mode => {
                        if mode == EffectMode::AtMostOnce {
                            let (_, unknown) = owed_by_an_earlier_run(&pool, &consumer_type).await;
                            if unknown > 0 {
                                tracing::warn!(
                                    consumer_type = %consumer_type,
                                    calls = unknown,
                                    "calls to the carrier whose outcome is unknown were left by an earlier run; this \
                                     at-most-once run does not make them again (an at-most-once run's are marked in \
                                     doubt; an after-commit run's wait for a run in their mode): settle them \
                                     (inboxctl effects reconcile; effects resolve)"
                                );
                            }
                        }
                        let carrier = effects::DeferredCarrier {
                            mode,
                            consumer_type: consumer_type.clone(),
                            wake,
                        };
                        let consumer = CarrierConsumer { carrier };
                        beside_the_worker(worker, guard, consumer, broker, options, shutdown).await
                    }
                }
            }
            (Kind::Carrier, None) => {
                let (pending, unknown) = owed_by_an_earlier_run(&pool, &consumer_type).await;
                if pending + unknown > 0 {
                    tracing::warn!(
                        consumer_type = %consumer_type,
                        "calls to the carrier are owed after the commits of an earlier run (--effect-mode after-commit \
                         or at-most-once), and this run, with the stand-in carrier, cannot make them: run the consumer \
                         with --carrier-url to make them, or settle them (inboxctl effects --pending; effects resolve)"
                    );
                }
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

/// The pool the consumer's messages commit through, opened again with durable commits if `db`'s would not be
/// ([`durable_commits`]).
async fn open_message_pool(db: &Database, size: u32) -> Result<PgPool> {
    let pool = db.message_pool(size).await?;
    match durable_commits(&pool, db).await {
        Ok(Durability::AsItIs) => Ok(pool),
        Ok(Durability::PerTransaction) => {
            db::pooler::make_commits_durable();
            Ok(pool)
        }
        Ok(Durability::Sessions(durable)) => {
            close_pool(pool).await;
            durable.message_pool(size).await
        }
        Err(e) => {
            close_pool(pool).await;
            Err(e)
        }
    }
}

/// How the consumer's commits are made durable ([`durable_commits`]).
enum Durability {
    /// They are: the sessions' `synchronous_commit` waits for this server's disk.
    AsItIs,
    /// By sessions opened again with `synchronous_commit = local`.
    Sessions(Box<Database>),
    /// By each transaction's own `SET LOCAL synchronous_commit = local`: through a transaction pooler, where no
    /// session setting holds.
    PerTransaction,
}

/// A message is acknowledged once its commit returns. With `synchronous_commit` off (the server's, the database's, the
/// role's or the URL's setting) a commit returns before it is on disk, and a PostgreSQL crash loses the last ones:
/// their messages are gone from the queue, and their claims and effects from the database. So the consumer's message
/// sessions set it to `local` — on this server's disk before the commit returns, and no wait for a synchronous standby
/// the setting `off` was perhaps chosen to avoid. Through a transaction pooler no session setting holds, and each
/// transaction the store begins sets it for itself, in its `BEGIN`'s round trip: the claims', and the effects
/// worker's, whose lease must be on disk before its call goes out. `local`, `on` and the `remote_*` levels are left
/// as they are: each waits for the commit to be on this server's disk.
async fn durable_commits(pool: &PgPool, db: &Database) -> Result<Durability> {
    let setting = db::synchronous_commit(pool)
        .await
        .map_err(|e| db.unavailable(e))?;
    if setting != "off" {
        return Ok(Durability::AsItIs);
    }
    if db.transaction_pooling() {
        tracing::info!(
            "synchronous_commit is off (the server's, the database's or the role's setting): through a transaction \
             pooler (--transaction-pooling) each of the consumer's transactions sets it to local for itself (SET \
             LOCAL), so that no acknowledged message's effect can be lost in a PostgreSQL crash"
        );
        return Ok(Durability::PerTransaction);
    }
    tracing::info!(
        "synchronous_commit is off (the server's, the database's, the role's or the URL's setting): the consumer's \
         sessions set it to local, so that no acknowledged message's effect can be lost in a PostgreSQL crash"
    );
    Ok(Durability::Sessions(Box::new(db.with_durable_commits())))
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

/// How many calls are owed after the commits of an earlier run of this consumer_type: `(pending or in flight, of
/// unknown outcome)`. A run in keyed mode, or with the stand-in, writes none of its own. Not known (the database did
/// not say): as none, said at debug level.
async fn owed_by_an_earlier_run(
    pool: &PgPool,
    consumer_type: &crate::inbox::ConsumerType,
) -> (i64, i64) {
    match db::external::owed_by_outcome(pool, consumer_type.as_str()).await {
        Ok(owed) => owed,
        Err(e) => {
            tracing::debug!(error = %e, "could not look for calls owed by an earlier run");
            (0, 0)
        }
    }
}

/// Runs `consumer` with the effects `worker` beside it: the worker makes the calls owed until a stop is asked for
/// (then it starts no new call) or the consumer stops on its own (idle, with no call owed).
async fn beside_the_worker<C: super::Consumer>(
    worker: effects::worker::Worker,
    guard: impl WorkGuard,
    consumer: C,
    broker: &Broker,
    options: ConsumerOptions,
    shutdown: CancellationToken,
) -> Result<RunSummary> {
    let owed_effects = Some(super::OwedEffects {
        pool: worker.pool.clone(),
        consumer_type: worker.consumer_type.clone(),
        pending_only: worker.pending_only,
    });
    let stop_worker = shutdown.child_token();
    let working = tokio::spawn(worker.run(stop_worker.clone()));
    let shutdown_timeout = options.shutdown_timeout;
    let deadline = effects::worker::stop_deadline(&shutdown, shutdown_timeout);
    let options = ConsumerOptions {
        owed_effects,
        ..options
    };
    let ran = super::run(guard, consumer, broker, options, shutdown.clone()).await;
    stop_worker.cancel();
    effects::worker::finish(working, &shutdown, shutdown_timeout, &deadline).await;
    ran
}

/// Refuses to start on a database `migrate` has not prepared, or whose `inbox_messages` inboxctl cannot use.
async fn check_schema(pool: &PgPool, db: &Database, calls_outside: bool) -> Result<()> {
    let version = db::server_version(pool)
        .await
        .map_err(|e| db.unavailable(e))?;
    require_server(version)?;
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

/// The oldest PostgreSQL a consumer runs on: before each commit it asks whether the claim's transaction is still open
/// (`pg_current_xact_id_if_assigned`, PostgreSQL 13's). On an older server that question fails, and every message
/// would be taken for a failed attempt and end in the error queue.
const MIN_SERVER_VERSION: i32 = 130_000;

/// Refuses a server older than [`MIN_SERVER_VERSION`] (`version` as `server_version_num` gives it), naming it.
fn require_server(version: i32) -> Result<()> {
    if version < MIN_SERVER_VERSION {
        // Before 10, the number holds three parts (`90624` for 9.6.24).
        let named = if version >= 100_000 {
            format!("{}.{}", version / 10_000, version % 10_000)
        } else {
            format!(
                "{}.{}.{}",
                version / 10_000,
                version / 100 % 100,
                version % 100
            )
        };
        return Err(Error::Usage(format!(
            "a consumer needs PostgreSQL 13 or later; this server is {named}"
        )));
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
    use super::require_server;

    #[test]
    fn a_server_older_than_13_is_refused_by_its_name() {
        for (version, named) in [(120_017, "12.17"), (90_624, "9.6.24"), (100_000, "10.0")] {
            let refused = require_server(version).unwrap_err().to_string();
            assert!(
                refused.contains("PostgreSQL 13 or later") && refused.ends_with(named),
                "{refused}"
            );
        }
        for version in [130_000, 150_020, 180_001] {
            assert!(require_server(version).is_ok());
        }
    }
}
