//! Running a consumer on a RabbitMQ queue with the claim protocol: reading deliveries, retrying, dead-lettering,
//! acknowledging only what is done, surviving outages of either server.
//!
//! Per delivery:
//! - unreadable (no id, an id that is not a UUID, not JSON, an envelope without a message) → `<queue>_error` at once;
//! - a message type the consumer does not handle → `<queue>_skipped` (`MT-Reason: dead-letter`, as MassTransit);
//! - an event that cannot be decoded (a field missing or of the wrong type) → `<queue>_error` at once;
//! - otherwise [`Inbox::process`]: processed or duplicate → ack; the consumer's work failed (an error or a panic) →
//!   retried in this process with a doubling delay, and after `max_attempts` → `<queue>_error`; PostgreSQL
//!   unavailable → retried without counting, however long it takes, and no new delivery is started meanwhile.
//!
//! Batched (`batch_size` > 1): deliveries that arrive together share one transaction ([`Inbox::process_batch`]); a
//! member whose work fails is retried alone, one message per transaction, as above.
//!
//! A move to a dead-letter queue is acknowledged only after the broker confirmed the copy. Nothing is acknowledged
//! before its outcome is committed or confirmed; what cannot be finished is left to the broker to deliver again.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::{FutureExt as _, StreamExt as _};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;
use tokio::sync::{OnceCell, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::dead_letter::{self, Fault};
use crate::amqp::envelope::{self, Incoming, Unreadable};
use crate::amqp::{Broker, topology};
use crate::db::sql;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::inbox::{
    ConsumerType, Inbox, Member, MemberOutcome, Outcome, ProcessError, Work, WorkError,
};
use crate::sanitize;

/// What a consumer knows about the delivery it works on.
#[derive(Debug, Clone)]
pub struct MessageContext {
    pub message_id: Uuid,
    pub consumer_type: ConsumerType,
    /// The broker's flag: this message was delivered before (to this or another consumer process).
    pub redelivered: bool,
    /// 1 for the first attempt in this process.
    pub attempt: u32,
}

impl MessageContext {
    /// The idempotency key for calls to the outside world: the same for every delivery of this message to this
    /// consumer_type.
    pub fn idempotency_key(&self) -> Uuid {
        self.consumer_type.idempotency_key(self.message_id)
    }
}

/// A consumer of one message type, whose effects are database writes on the transaction it is given.
pub trait Consumer: Send + Sync + 'static {
    type Message: DeserializeOwned + Serialize + Clone + Send + Sync + 'static;

    /// The MassTransit message type URN it handles, e.g. `urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent`.
    const MESSAGE_TYPE: &'static str;

    /// Does the work of one message on `tx`, the transaction that also holds the message's inbox row. Must not commit
    /// or roll back; returning an error rolls everything back.
    fn consume<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        context: &'c MessageContext,
        message: &'c Self::Message,
    ) -> impl Future<Output = Result<(), WorkError>> + Send + 'c;

    /// Whether a delivery whose declared types are `types` is one this consumer handles. A plain JSON message that
    /// declares no type is assumed to be of the consumer's type (and goes to the error queue if it cannot be decoded).
    fn handles(types: &[String]) -> bool {
        if types.is_empty() {
            return true;
        }
        let urn = Self::MESSAGE_TYPE;
        let dotnet = envelope::dotnet_type_name(urn);
        let short = dotnet.rsplit('.').next().unwrap_or_default().to_owned();
        types
            .iter()
            .any(|t| t == urn || *t == dotnet || *t == short)
    }
}

/// How a consumer runs.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    pub queue: String,
    /// The exchange the message type is published to; the queue is bound to it through an endpoint exchange.
    pub event_exchange: String,
    pub prefetch: u16,
    pub concurrency: usize,
    /// Attempts of a message whose work fails, in this process, before it goes to `<queue>_error`.
    pub max_attempts: u32,
    /// Delay before the second attempt; it doubles for each further attempt, up to [`MAX_RETRY_DELAY`].
    pub retry_delay: Duration,
    /// End once nothing arrived and nothing was in flight for this long, and the queue is empty.
    pub exit_when_idle: Option<Duration>,
    /// How long in-flight messages may take to finish after a stop was asked for.
    pub shutdown_timeout: Duration,
    /// Where the run counts what it does (shared with `--metrics-addr`).
    pub counts: Arc<RunCounts>,
    /// More than 1: up to this many deliveries share one transaction (see [`Inbox::process_batch`]).
    pub batch_size: usize,
    /// How long a batch waits to fill while another batch is running.
    pub batch_wait: Duration,
    /// A redelivered message that has started this many times without reaching an outcome (each start ended its
    /// process) goes to the error queue at its next delivery.
    pub poison_after: u32,
}

pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);
/// Backoff while PostgreSQL or RabbitMQ is unavailable.
const OUTAGE_DELAY_MIN: Duration = Duration::from_millis(100);
const OUTAGE_DELAY_MAX: Duration = Duration::from_secs(5);

/// What one consumer process did, for its closing log line, `demo` and `--metrics-addr`.
#[derive(Debug, Default)]
pub struct RunCounts {
    pub processed: AtomicU64,
    pub duplicates: AtomicU64,
    pub failed_attempts: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub skipped: AtomicU64,
    /// Whether the consumer holds a working broker connection now.
    pub broker_connected: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunSummary {
    pub processed: u64,
    pub duplicates: u64,
    pub failed_attempts: u64,
    pub dead_lettered: u64,
    pub skipped: u64,
}

impl RunCounts {
    pub fn summary(&self) -> RunSummary {
        RunSummary {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            failed_attempts: self.failed_attempts.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
        }
    }
}

/// Everything a delivery's task shares with the others.
struct Shared<C: Consumer> {
    inbox: Inbox,
    consumer: Arc<C>,
    options: ConsumerOptions,
    input_address: String,
    counts: Arc<RunCounts>,
    /// Whether PostgreSQL answered last time anyone asked; no new delivery starts while it is `false`.
    database_up: watch::Sender<bool>,
    shutdown: CancellationToken,
    in_flight: AtomicUsize,
    last_activity: std::sync::Mutex<Instant>,
    /// Work holds it shared; a suspect — a redelivered message that was in flight when a process ended before — holds
    /// it alone, so that if its process ends again, nothing else was in flight to share the blame.
    alone: tokio::sync::RwLock<()>,
}

/// One broker connection's channels: deliveries come in on one, dead-letter copies go out on the other (in
/// confirm mode).
struct Link {
    connection: Connection,
    consume: Channel,
    publish: Channel,
    error_declared: OnceCell<()>,
    skipped_declared: OnceCell<()>,
}

/// Runs `consumer` on its queue until `shutdown` is cancelled (or, with `exit_when_idle`, until the queue stays
/// empty). Fails at start if PostgreSQL or RabbitMQ cannot be reached; after that, outages are waited out.
pub async fn run<C: Consumer>(
    inbox: Inbox,
    consumer: C,
    broker: &Broker,
    options: ConsumerOptions,
    shutdown: CancellationToken,
) -> Result<RunSummary> {
    sqlx::query(sql::REGISTER_CONSUMER)
        .bind(inbox.consumer_type().as_str())
        .bind(&options.queue)
        .execute(inbox.pool())
        .await?;

    let shared = Arc::new(Shared {
        input_address: broker.queue_address(&options.queue),
        inbox,
        consumer: Arc::new(consumer),
        counts: Arc::clone(&options.counts),
        options,
        database_up: watch::Sender::new(true),
        shutdown: shutdown.clone(),
        in_flight: AtomicUsize::new(0),
        last_activity: std::sync::Mutex::new(Instant::now()),
        alone: tokio::sync::RwLock::new(()),
    });
    let permits = Arc::new(Semaphore::new(shared.options.concurrency.max(1)));
    let mut tasks: JoinSet<()> = JoinSet::new();
    // Batched: deliveries queue up for a few batch workers instead of getting a task each.
    let mut batches = (shared.options.batch_size > 1).then(|| {
        let (tx, rx) = mpsc::channel::<Queued>(usize::from(shared.options.prefetch).max(1));
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let running = Arc::new(AtomicUsize::new(0));
        let workers = shared
            .options
            .concurrency
            .div_ceil(shared.options.batch_size)
            .max(1);
        for _ in 0..workers {
            tasks.spawn(batch_worker(
                Arc::clone(&shared),
                Arc::clone(&rx),
                Arc::clone(&running),
            ));
        }
        tx
    });
    let mut outage_delay = OUTAGE_DELAY_MIN;
    let mut first = true;

    'connect: loop {
        if shutdown.is_cancelled() {
            break;
        }
        let link = match open_link(broker, &shared).await {
            Ok(link) => Arc::new(link),
            Err(e) if first => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?outage_delay, "RabbitMQ unavailable");
                if sleep_or_cancel(outage_delay, &shutdown).await {
                    break;
                }
                outage_delay = (outage_delay * 2).min(OUTAGE_DELAY_MAX);
                continue;
            }
        };
        first = false;
        outage_delay = OUTAGE_DELAY_MIN;
        let tag = format!(
            "inboxctl-{}-{}",
            std::process::id(),
            Uuid::new_v4().simple()
        );
        let mut deliveries = match link
            .consume
            .basic_consume(
                shared.options.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(deliveries) => deliveries,
            Err(e) => {
                tracing::warn!(error = %e, "could not start consuming; reconnecting");
                crate::amqp::close(&link.connection, "reconnecting").await;
                continue;
            }
        };
        tracing::info!(
            queue = %shared.options.queue,
            consumer_type = %shared.inbox.consumer_type(),
            "consuming"
        );
        shared
            .counts
            .broker_connected
            .store(true, Ordering::Relaxed);
        *lock(&shared.last_activity) = Instant::now();
        let mut idle_check = tokio::time::interval(Duration::from_millis(100));
        // The deliveries stream is not always ended when the connection goes (lapin has had such bugs, and a node
        // restart is where they showed): the connection's own state is watched too, so a lost connection is never
        // waited on forever.
        let mut connection_check = tokio::time::interval(Duration::from_secs(1));

        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => {
                    let _ = link.consume.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
                    break 'connect;
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                _ = connection_check.tick() => {
                    if !link.connection.status().connected() {
                        tracing::warn!("RabbitMQ connection lost (seen in its state); reconnecting");
                        break;
                    }
                }
                _ = idle_check.tick(), if shared.options.exit_when_idle.is_some() => {
                    if is_idle(&shared, &link).await {
                        tracing::info!(queue = %shared.options.queue, "queue idle; stopping");
                        let _ = link.consume.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
                        break 'connect;
                    }
                }
                delivery = deliveries.next() => match delivery {
                    Some(Ok(delivery)) => {
                        shared.in_flight.fetch_add(1, Ordering::SeqCst);
                        *lock(&shared.last_activity) = Instant::now();
                        // No new delivery starts while PostgreSQL is down or all workers are busy.
                        if !wait_for_database(&shared).await {
                            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                            break 'connect;
                        }
                        // A redelivered message is processed on its own: if it is what ended a process, it must not
                        // take a batch's healthy members down with it again.
                        if let Some(queue) = batches.as_ref().filter(|_| !delivery.redelivered) {
                            let queued = (delivery, Arc::clone(&link));
                            tokio::select! {
                                () = shutdown.cancelled() => {
                                    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                                    break 'connect;
                                }
                                sent = queue.send(queued) => if sent.is_err() { break 'connect; },
                            }
                            continue;
                        }
                        let permit = tokio::select! {
                            () = shutdown.cancelled() => None,
                            permit = Arc::clone(&permits).acquire_owned() => permit.ok(),
                        };
                        let Some(permit) = permit else {
                            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                            break 'connect;
                        };
                        let shared = Arc::clone(&shared);
                        let link = Arc::clone(&link);
                        tasks.spawn(async move {
                            handle(&shared, &link, delivery).await;
                            drop(permit);
                        });
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "RabbitMQ connection lost; reconnecting");
                        break;
                    }
                    None => {
                        tracing::warn!(queue = %shared.options.queue, "the broker cancelled the consumer; reconnecting");
                        break;
                    }
                }
            }
        }
        // Deliveries in flight on the lost connection finish their database work; their acks fail and the broker
        // delivers them again, as duplicates.
        shared
            .counts
            .broker_connected
            .store(false, Ordering::Relaxed);
        crate::amqp::close(&link.connection, "reconnecting").await;
    }

    // The batch workers end once the deliveries queued for them are done.
    batches.take();
    drain(&shared, &mut tasks).await;
    shared
        .counts
        .broker_connected
        .store(false, Ordering::Relaxed);
    let summary = shared.counts.summary();
    tracing::info!(
        consumer_type = %shared.inbox.consumer_type(),
        processed = summary.processed,
        duplicates = summary.duplicates,
        failed_attempts = summary.failed_attempts,
        dead_lettered = summary.dead_lettered,
        skipped = summary.skipped,
        "consumer stopped"
    );
    Ok(summary)
}

async fn open_link<C: Consumer>(broker: &Broker, shared: &Shared<C>) -> Result<Link> {
    let name = format!("inboxctl consume {}", shared.inbox.consumer_type());
    let connection = broker.connect(&name).await?;
    topology::ensure_endpoint(
        &connection,
        &shared.options.event_exchange,
        &shared.options.queue,
    )
    .await?;
    let consume = connection.create_channel().await?;
    consume
        .basic_qos(shared.options.prefetch, BasicQosOptions::default())
        .await?;
    let publish = connection.create_channel().await?;
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(Link {
        connection,
        consume,
        publish,
        error_declared: OnceCell::new(),
        skipped_declared: OnceCell::new(),
    })
}

/// Waits until PostgreSQL is up; `false` if a stop was asked for meanwhile.
async fn wait_for_database<C: Consumer>(shared: &Shared<C>) -> bool {
    let mut up = shared.database_up.subscribe();
    tokio::select! {
        () = shared.shutdown.cancelled() => false,
        result = up.wait_for(|up| *up) => result.is_ok(),
    }
}

async fn is_idle<C: Consumer>(shared: &Shared<C>, link: &Link) -> bool {
    let Some(idle_after) = shared.options.exit_when_idle else {
        return false;
    };
    if shared.in_flight.load(Ordering::SeqCst) > 0
        || lock(&shared.last_activity).elapsed() < idle_after
    {
        return false;
    }
    matches!(
        topology::queue_depth(&link.connection, &shared.options.queue).await,
        Ok(Some((0, _)))
    )
}

/// Waits for in-flight deliveries up to the shutdown timeout; past it, abandons them: their transactions roll back
/// with their connections and the broker delivers the messages again.
async fn drain<C: Consumer>(shared: &Shared<C>, tasks: &mut JoinSet<()>) {
    if tasks.is_empty() {
        return;
    }
    tracing::info!(in_flight = tasks.len(), "waiting for in-flight messages");
    let finished = tokio::time::timeout(shared.options.shutdown_timeout, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!(
            abandoned = tasks.len(),
            "shutdown timeout reached: abandoning in-flight messages, uncommitted and unacknowledged, for redelivery"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
}

/// What to do with a delivery once its handling ended.
enum Disposition {
    /// Its outcome is committed or its copy confirmed.
    Ack,
    /// Not finished (a stop, or RabbitMQ refused the dead-letter copy): give it back to the broker.
    Requeue,
}

/// Handles one delivery on its own (not batched) and settles it with the broker.
async fn handle<C: Consumer>(shared: &Shared<C>, link: &Link, delivery: Delivery) {
    let disposition = match prepare(shared, link, &delivery).await {
        Prepared::Done(disposition) => disposition,
        Prepared::Ready(ready) if delivery.redelivered => {
            let id = ready.incoming.message_id;
            let counted = redelivered_start(shared, id).await;
            let disposition = match counted {
                // It ended its process this many times while it was the only work in flight: it is the cause.
                Some((_, alone)) if alone >= shared.options.poison_after => {
                    poison(shared, link, &delivery, &ready, alone).await
                }
                // In flight at an earlier end (with others, perhaps): a suspect, tried alone.
                Some((started, _)) if started >= 2 => {
                    let _alone = shared.alone.write().await;
                    // Counted before the work, so that it stays counted if the work ends the process.
                    redelivery_count(shared, sql::REDELIVERED_ALONE, id).await;
                    attempts(shared, link, &delivery, &ready, 1).await
                }
                _ => {
                    let _shared = shared.alone.read().await;
                    attempts(shared, link, &delivery, &ready, 1).await
                }
            };
            // Alive after this start, whatever its outcome: the message is not what ends processes.
            if counted.is_some() {
                redelivery_count(shared, sql::REDELIVERED_DONE, id).await;
            }
            disposition
        }
        Prepared::Ready(ready) => {
            let _shared = shared.alone.read().await;
            attempts(shared, link, &delivery, &ready, 1).await
        }
    };
    settle(shared, &delivery, disposition).await;
}

/// Counts a start of a redelivered message: its starts without an outcome so far (this one included), and those of
/// them made alone. `None` when it cannot be counted (the database down, or a schema from before the count existed),
/// and the message is then processed as usual.
async fn redelivered_start<C: Consumer>(shared: &Shared<C>, id: Uuid) -> Option<(u32, u32)> {
    match sqlx::query_as::<_, (i32, i32)>(sql::REDELIVERED_START)
        .bind(shared.inbox.consumer_type().as_str())
        .bind(id)
        .fetch_one(shared.inbox.pool())
        .await
    {
        Ok((started, alone)) => Some((
            u32::try_from(started).unwrap_or(0),
            u32::try_from(alone).unwrap_or(0),
        )),
        Err(e) => {
            bookkeeping_failed(
                "redelivery not counted",
                "poison-message detection is off until it can be (a grant on inboxctl_attempts missing?)",
                Some(id),
                &e,
            );
            None
        }
    }
}

/// Runs one of the redelivery count's statements (`$1` consumer_type, `$2` message id) on its own. A count that
/// cannot be kept (the database down) only weakens poison detection; it never holds up the message.
async fn redelivery_count<C: Consumer>(shared: &Shared<C>, statement: &'static str, id: Uuid) {
    if let Err(e) = sqlx::query(statement)
        .bind(shared.inbox.consumer_type().as_str())
        .bind(id)
        .execute(shared.inbox.pool())
        .await
    {
        bookkeeping_failed(
            "redelivery count not kept",
            "poison-message detection is off until it can be (a grant on inboxctl_attempts missing?)",
            Some(id),
            &e,
        );
    }
}

/// A bookkeeping statement (the redelivery count, an event counter) failed. It never holds up a message; during an
/// outage that is expected and said at debug level. Any other failure (a grant or a table missing) is a warning,
/// once per process and statement, so that it is neither silent nor one line per message.
fn bookkeeping_failed(
    what: &'static str,
    consequence: &'static str,
    id: Option<Uuid>,
    error: &sqlx::Error,
) {
    static WARNED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let text = crate::redact::text(&error.to_string());
    let first = !crate::db::is_transient(error) && {
        let mut warned = lock(&WARNED);
        !warned.contains(&what) && {
            warned.push(what);
            true
        }
    };
    if first {
        tracing::warn!(message_id = ?id, error = %text, "{what}: {consequence} (said once; the rest at -v)");
    } else {
        tracing::debug!(message_id = ?id, error = %text, "{what}");
    }
}

/// A message whose processing ended its process `alone` times while nothing else was in flight: to the error queue.
async fn poison<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    alone: u32,
) -> Disposition {
    let id = ready.incoming.message_id;
    let reason = format!(
        "processed alone {alone} times without reaching an outcome: each attempt ended the consumer process \
         (a crash, an abort or a kill while it was the only message in flight)"
    );
    tracing::error!(message_id = %id, alone, "poison message; moving it to the error queue");
    let fault = ("inboxctl::PoisonMessage", reason.clone(), reason);
    let retries = i32::try_from(alone).unwrap_or(i32::MAX);
    dead_letter_error(
        shared,
        link,
        delivery,
        Some(id),
        ready.message_type.clone(),
        &fault,
        retries,
    )
    .await
}

/// Acks or requeues a delivery whose handling ended, and counts it out of flight.
async fn settle<C: Consumer>(shared: &Shared<C>, delivery: &Delivery, disposition: Disposition) {
    let acker = &delivery.acker;
    match disposition {
        Disposition::Ack => match acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) | Err(_) => tracing::debug!(
                delivery_tag = delivery.delivery_tag,
                "ack not sent (channel closed); the broker will deliver the message again"
            ),
        },
        Disposition::Requeue => {
            let _ = acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await;
        }
    }
    *lock(&shared.last_activity) = Instant::now();
    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
}

/// A delivery that could be read, of a type this consumer handles, with its event decoded.
struct Ready<M> {
    incoming: Incoming,
    message: M,
    message_type: Option<String>,
}

enum Prepared<M> {
    /// Dead-lettered or skipped already.
    Done(Disposition),
    Ready(Ready<M>),
}

/// Reads a delivery; what cannot be read goes to the error queue, what this consumer does not handle to the skipped
/// queue, both at once.
async fn prepare<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
) -> Prepared<C::Message> {
    let incoming = match envelope::parse(&delivery.properties, &delivery.data) {
        Ok(incoming) => incoming,
        Err(unreadable) => {
            let id = property_id(delivery);
            tracing::warn!(
                message_id = id.map(|i| i.to_string()).unwrap_or_default(),
                reason = %sanitize::text(&unreadable.to_string()),
                "unreadable message; moving it to the error queue"
            );
            let fault = unreadable_fault(&unreadable);
            return Prepared::Done(
                dead_letter_error(shared, link, delivery, id, None, &fault, 0).await,
            );
        }
    };
    let message_type = incoming
        .message_types
        .first()
        .map(|t| envelope::dotnet_type_name(t));
    if !C::handles(&incoming.message_types) {
        return Prepared::Done(skip(shared, link, delivery, &incoming).await);
    }
    match serde_json::from_str(incoming.payload.get()) {
        Ok(message) => Prepared::Ready(Ready {
            incoming,
            message,
            message_type,
        }),
        Err(e) => {
            let reason = format!(
                "the message cannot be read as {}: {e}",
                envelope::dotnet_type_name(C::MESSAGE_TYPE)
            );
            tracing::warn!(message_id = %incoming.message_id, reason = %sanitize::text(&reason), "moving message to the error queue");
            let fault = ("inboxctl::MalformedMessage", reason.clone(), reason);
            let id = Some(incoming.message_id);
            Prepared::Done(
                dead_letter_error(shared, link, delivery, id, message_type, &fault, 0).await,
            )
        }
    }
}

/// The consumer's work on one message, for [`Inbox::process`] or a batch.
fn work<C: Consumer>(
    shared: &Shared<C>,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
) -> Work<()> {
    let context = MessageContext {
        message_id: ready.incoming.message_id,
        consumer_type: shared.inbox.consumer_type().clone(),
        redelivered: delivery.redelivered,
        attempt,
    };
    let consumer = Arc::clone(&shared.consumer);
    let message = ready.message.clone();
    Box::new(move |tx| Box::pin(async move { consumer.consume(tx, &context, &message).await }))
}

/// Processes one message in transactions of its own, from attempt `first` on: retries what fails, waits out outages.
async fn attempts<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    first: u32,
) -> Disposition {
    let id = ready.incoming.message_id;
    let mut attempt = first;
    let mut outage_delay = OUTAGE_DELAY_MIN;
    loop {
        let work = shared
            .inbox
            .process(id, work(shared, delivery, ready, attempt));
        let failure = match AssertUnwindSafe(work).catch_unwind().await {
            Ok(Ok(outcome)) => {
                database_back(shared);
                match outcome {
                    Outcome::Processed(()) => {
                        processed(shared, id);
                        failpoint::hit("after-commit").await;
                    }
                    Outcome::Duplicate => duplicate(shared, id),
                }
                return Disposition::Ack;
            }
            Ok(Err(ProcessError::Unavailable(e))) => {
                database_gone(shared, &e);
                if sleep_or_cancel(jitter(outage_delay), &shared.shutdown).await {
                    return Disposition::Requeue;
                }
                outage_delay = (outage_delay * 2).min(OUTAGE_DELAY_MAX);
                continue;
            }
            Ok(Err(ProcessError::Failed(e))) => error_chain(&e),
            Err(panic) => format!("panicked: {}", panic_message(&*panic)),
        };
        if let Some(disposition) = failed(shared, link, delivery, ready, attempt, failure).await {
            return disposition;
        }
        attempt += 1;
    }
}

/// Counts and records a failed attempt. After the last attempt the message goes to the error queue (the returned
/// disposition); before it, this waits the retry delay and returns `None` — or `Requeue` if a stop came meanwhile.
async fn failed<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
    failure: String,
) -> Option<Disposition> {
    let id = ready.incoming.message_id;
    shared
        .counts
        .failed_attempts
        .fetch_add(1, Ordering::Relaxed);
    record_event(shared, "failed", Some(id), &failure).await;
    if attempt >= shared.options.max_attempts {
        tracing::warn!(
            message_id = %id,
            attempts = attempt,
            reason = %sanitize::text(&failure),
            "giving up; moving message to the error queue"
        );
        let first_line = failure.lines().next().unwrap_or_default().to_owned();
        let fault = ("inboxctl::ConsumerFailed", first_line, failure);
        let retries = i32::try_from(attempt - 1).unwrap_or(i32::MAX);
        return Some(
            dead_letter_error(
                shared,
                link,
                delivery,
                Some(id),
                ready.message_type.clone(),
                &fault,
                retries,
            )
            .await,
        );
    }
    let delay = retry_delay(shared.options.retry_delay, attempt);
    tracing::warn!(
        message_id = %id,
        attempt,
        retry_in = ?delay,
        reason = %sanitize::text(&failure),
        "attempt failed"
    );
    sleep_or_cancel(delay, &shared.shutdown)
        .await
        .then_some(Disposition::Requeue)
}

fn processed<C: Consumer>(shared: &Shared<C>, id: Uuid) {
    shared.counts.processed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(message_id = %id, "processed");
}

fn duplicate<C: Consumer>(shared: &Shared<C>, id: Uuid) {
    shared.counts.duplicates.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        message_id = %id,
        consumer_type = %shared.inbox.consumer_type(),
        "duplicate discarded"
    );
}

fn database_back<C: Consumer>(shared: &Shared<C>) {
    if shared
        .database_up
        .send_if_modified(|up| !std::mem::replace(up, true))
    {
        tracing::info!("PostgreSQL is back: taking deliveries again");
    }
}

fn database_gone<C: Consumer>(shared: &Shared<C>, error: &sqlx::Error) {
    if shared
        .database_up
        .send_if_modified(|up| std::mem::replace(up, false))
    {
        let text = crate::redact::text(&error.to_string());
        if crate::db::is_transient(error) {
            tracing::error!(error = %text, "PostgreSQL unavailable: holding deliveries until it is back");
        } else {
            // A missing grant or table: the inbox's own statements fail, whatever the message. Held, never acked.
            tracing::error!(
                error = %text,
                "PostgreSQL refuses the inbox's own statements (a grant or the schema, not the message): holding                  deliveries until they succeed; see the README's security section for the grants"
            );
        }
    } else {
        tracing::debug!(error = %crate::redact::text(&error.to_string()), "PostgreSQL still unavailable");
    }
}

/// A delivery waiting for a batch, with the broker connection it came on.
type Queued = (Delivery, Arc<Link>);

/// Takes deliveries off `queue` in batches of up to `batch_size` and processes each batch in one transaction. A batch
/// starts with whatever is waiting; it waits up to `batch_wait` for more only while another batch is running, so a
/// lone message never waits.
async fn batch_worker<C: Consumer>(
    shared: Arc<Shared<C>>,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Queued>>>,
    running: Arc<AtomicUsize>,
) {
    let size = shared.options.batch_size;
    loop {
        let batch = {
            let mut rx = queue.lock().await;
            let Some(first) = rx.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < size {
                match rx.try_recv() {
                    Ok(queued) => batch.push(queued),
                    Err(_) => break,
                }
            }
            if batch.len() < size && running.load(Ordering::SeqCst) > 0 {
                let deadline = tokio::time::Instant::now() + shared.options.batch_wait;
                while batch.len() < size {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(queued)) => batch.push(queued),
                        _ => break,
                    }
                }
            }
            batch
        };
        running.fetch_add(1, Ordering::SeqCst);
        {
            let _shared = shared.alone.read().await;
            process_batch(&shared, batch).await;
        }
        running.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn process_batch<C: Consumer>(shared: &Shared<C>, batch: Vec<Queued>) {
    // Read each delivery; two copies of one id in a batch: the later one waits for the batch's outcome.
    let mut members = Vec::with_capacity(batch.len());
    let mut later = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (delivery, link) in batch {
        match prepare(shared, &link, &delivery).await {
            Prepared::Done(disposition) => settle(shared, &delivery, disposition).await,
            Prepared::Ready(ready) if ids.insert(ready.incoming.message_id) => {
                members.push((delivery, link, ready))
            }
            Prepared::Ready(ready) => later.push((delivery, link, ready)),
        }
    }

    let mut outage_delay = OUTAGE_DELAY_MIN;
    let outcomes = loop {
        if members.is_empty() {
            break Some(Vec::new());
        }
        let batch: Vec<Member<()>> = members
            .iter()
            .map(|(delivery, _, ready)| Member {
                message_id: ready.incoming.message_id,
                work: work(shared, delivery, ready, 1),
            })
            .collect();
        match shared.inbox.process_batch(batch).await {
            Ok(outcomes) => {
                database_back(shared);
                break Some(outcomes);
            }
            Err(ProcessError::Unavailable(e)) => {
                database_gone(shared, &e);
                if sleep_or_cancel(jitter(outage_delay), &shared.shutdown).await {
                    for (delivery, _, _) in members.iter().chain(&later) {
                        settle(shared, delivery, Disposition::Requeue).await;
                    }
                    return;
                }
                outage_delay = (outage_delay * 2).min(OUTAGE_DELAY_MAX);
            }
            Err(ProcessError::Failed(e)) => {
                tracing::warn!(reason = %sanitize::text(&error_chain(&e)), "batch failed as a whole; processing its messages one by one");
                break None;
            }
        }
    };

    match outcomes {
        Some(outcomes) => {
            if outcomes
                .iter()
                .any(|o| matches!(o, MemberOutcome::Processed(())))
            {
                failpoint::hit("after-commit").await;
            }
            let settled =
                members
                    .iter()
                    .zip(outcomes)
                    .map(|((delivery, link, ready), outcome)| async move {
                        let id = ready.incoming.message_id;
                        let disposition = match outcome {
                            MemberOutcome::Processed(()) => {
                                processed(shared, id);
                                Disposition::Ack
                            }
                            MemberOutcome::Duplicate => {
                                duplicate(shared, id);
                                Disposition::Ack
                            }
                            MemberOutcome::Failed(e) => {
                                match failed(shared, link, delivery, ready, 1, error_chain(&e))
                                    .await
                                {
                                    Some(disposition) => disposition,
                                    None => attempts(shared, link, delivery, ready, 2).await,
                                }
                            }
                        };
                        settle(shared, delivery, disposition).await;
                    });
            futures_util::future::join_all(settled).await;
        }
        None => {
            let one_by_one = members.iter().map(|(delivery, link, ready)| async move {
                let disposition = attempts(shared, link, delivery, ready, 1).await;
                settle(shared, delivery, disposition).await;
            });
            futures_util::future::join_all(one_by_one).await;
        }
    }
    let rest = later.iter().map(|(delivery, link, ready)| async move {
        let disposition = attempts(shared, link, delivery, ready, 1).await;
        settle(shared, delivery, disposition).await;
    });
    futures_util::future::join_all(rest).await;
}

async fn skip<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    incoming: &Incoming,
) -> Disposition {
    let destination = topology::skipped_queue(&shared.options.queue);
    tracing::warn!(
        message_id = %incoming.message_id,
        message_type = %sanitize::text(&incoming.message_types.join(", ")),
        "message type not handled here; moving it to {destination}"
    );
    let headers = dead_letter::skipped_headers(delivery.properties.headers().as_ref());
    match publish_copy(
        link,
        &link.skipped_declared,
        &destination,
        delivery,
        headers,
    )
    .await
    {
        Ok(()) => {
            shared.counts.skipped.fetch_add(1, Ordering::Relaxed);
            let detail = incoming.message_types.join(", ");
            record_event(shared, "skipped", Some(incoming.message_id), &detail).await;
            Disposition::Ack
        }
        Err(e) => copy_refused(shared, &destination, &e).await,
    }
}

/// `(exception type, one-line message, full description)`.
type FaultText = (&'static str, String, String);

fn unreadable_fault(unreadable: &Unreadable) -> FaultText {
    (
        "inboxctl::UnreadableMessage",
        unreadable.to_string(),
        unreadable.to_string(),
    )
}

async fn dead_letter_error<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    message_id: Option<Uuid>,
    message_type: Option<String>,
    fault: &FaultText,
    retry_count: i32,
) -> Disposition {
    let destination = topology::error_queue(&shared.options.queue);
    let fault_headers = Fault {
        exception_type: fault.0.to_owned(),
        message: fault.1.clone(),
        stack_trace: fault.2.clone(),
        input_address: shared.input_address.clone(),
        consumer_type: shared.inbox.consumer_type().to_string(),
        message_type,
        retry_count,
    };
    let headers =
        dead_letter::error_headers(delivery.properties.headers().as_ref(), &fault_headers);
    match publish_copy(link, &link.error_declared, &destination, delivery, headers).await {
        Ok(()) => {
            shared.counts.dead_lettered.fetch_add(1, Ordering::Relaxed);
            record_event(shared, "dead_lettered", message_id, &fault.1).await;
            Disposition::Ack
        }
        Err(e) => copy_refused(shared, &destination, &e).await,
    }
}

async fn copy_refused<C: Consumer>(
    shared: &Shared<C>,
    destination: &str,
    error: &Error,
) -> Disposition {
    tracing::error!(
        error = %crate::redact::text(&error.to_string()),
        "could not move a message to {destination}; it stays on the queue"
    );
    // Not at once: a broker that refuses the copy would otherwise get it back in a tight loop.
    sleep_or_cancel(OUTAGE_DELAY_MAX, &shared.shutdown).await;
    Disposition::Requeue
}

/// Publishes the delivery's body and properties, with `headers`, to the exchange `destination` (declared on first
/// use) and waits for the broker's confirm. A copy the broker could not route to a queue counts as refused.
async fn publish_copy(
    link: &Link,
    declared: &OnceCell<()>,
    destination: &str,
    delivery: &Delivery,
    headers: FieldTable,
) -> Result<()> {
    declared
        .get_or_try_init(|| topology::ensure_dead_letter_queue(&link.connection, destination))
        .await?;
    let properties: BasicProperties = delivery.properties.clone().with_headers(headers);
    let confirm = link
        .publish
        .basic_publish(
            destination.into(),
            "".into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &delivery.data,
            properties,
        )
        .await?
        .await?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => Err(Error::Topology(format!(
            "{destination} routes to no queue; the copy was returned"
        ))),
        lapin::Confirmation::Nack(_) => Err(Error::Topology(format!(
            "the broker refused the copy to {destination}"
        ))),
        lapin::Confirmation::NotRequested => {
            Err(Error::Topology("publisher confirms are off".to_owned()))
        }
    }
}

async fn record_event<C: Consumer>(
    shared: &Shared<C>,
    kind: &str,
    message_id: Option<Uuid>,
    detail: &str,
) {
    let recorded = sqlx::query(sql::RECORD_EVENT)
        .bind(shared.inbox.consumer_type().as_str())
        .bind(kind)
        .bind(message_id)
        .bind(detail)
        .execute(shared.inbox.pool())
        .await;
    if let Err(e) = recorded {
        bookkeeping_failed(
            "could not record an event in inboxctl_events",
            "the counters that stats and top show miss it (a grant on inboxctl_events missing?)",
            message_id,
            &e,
        );
    }
}

fn property_id(delivery: &Delivery) -> Option<Uuid> {
    delivery
        .properties
        .message_id()
        .as_ref()
        .and_then(|id| Uuid::parse_str(id.as_str()).ok())
}

/// The error and its causes, one per line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str("\ncaused by: ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Delay before attempt `attempt + 1`: `first`, doubling, at most [`MAX_RETRY_DELAY`].
pub fn retry_delay(first: Duration, attempt: u32) -> Duration {
    first
        .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)))
        .min(MAX_RETRY_DELAY)
}

/// Up to a quarter off, so that many workers waiting out one outage do not all retry in the same instant.
fn jitter(delay: Duration) -> Duration {
    let nanos = u64::from(Uuid::new_v4().as_u128() as u16);
    delay - delay.mul_f64(nanos as f64 / f64::from(u16::MAX) / 4.0)
}

/// Sleeps; `true` if a stop was asked for first.
async fn sleep_or_cancel(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let first = Duration::from_millis(200);
        assert_eq!(retry_delay(first, 1), Duration::from_millis(200));
        assert_eq!(retry_delay(first, 2), Duration::from_millis(400));
        assert_eq!(retry_delay(first, 3), Duration::from_millis(800));
        assert_eq!(retry_delay(first, 40), MAX_RETRY_DELAY);
    }

    #[test]
    fn jitter_takes_off_at_most_a_quarter() {
        for _ in 0..100 {
            let d = jitter(Duration::from_secs(4));
            assert!(
                d <= Duration::from_secs(4) && d >= Duration::from_secs(3),
                "{d:?}"
            );
        }
    }

    struct Parcel;
    impl Consumer for Parcel {
        type Message = serde_json::Value;
        const MESSAGE_TYPE: &'static str =
            "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent";
        async fn consume<'c>(
            &'c self,
            _tx: &'c mut PgConnection,
            _context: &'c MessageContext,
            _message: &'c Self::Message,
        ) -> Result<(), WorkError> {
            Ok(())
        }
    }

    #[test]
    fn a_consumer_handles_its_type_in_any_spelling_and_untyped_json() {
        let t = |s: &str| vec![s.to_owned()];
        assert!(Parcel::handles(&[]));
        assert!(Parcel::handles(&t(
            "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"
        )));
        assert!(Parcel::handles(&t(
            "ParcelTracker.Domain.Events.ParcelCreatedEvent"
        )));
        assert!(Parcel::handles(&t("ParcelCreatedEvent")));
        assert!(!Parcel::handles(&t(
            "urn:message:ParcelTracker.Domain.Events:ParcelLabelPrinted"
        )));
    }
}
