//! Running a consumer on a RabbitMQ queue with the claim protocol: reading deliveries, retrying, dead-lettering,
//! acknowledging only what is done, surviving outages of either server.
//!
//! Per delivery:
//! - unreadable (no id or the nil id, an id that is not a UUID, not JSON, a byte order mark, headers nested too deep,
//!   an envelope without a message) → `<queue>_error` at once;
//! - a message type the consumer does not handle → `<queue>_skipped` (`MT-Reason: dead-letter`, as MassTransit);
//! - an event that cannot be decoded (a field missing or of the wrong type) → `<queue>_error` at once;
//! - otherwise [`Inbox::process_event`]: processed or duplicate → ack; an id processed before for another event → a
//!   conflict, moved to `<queue>_error` or dropped (`on_conflict`); the consumer's work failed (an error or a panic) →
//!   retried in this process with a doubling delay, and after `max_attempts` → `<queue>_error`; PostgreSQL
//!   unavailable → retried without counting, however long it takes, and no new delivery is started meanwhile.
//!
//! Batched (`batch_size` > 1, [`batch`]): deliveries that arrive together share one transaction; a member whose work
//! fails is retried alone, one message per transaction, as above, beside the batches. Redelivered messages, which may
//! be what ends a process, go through [`poison`]. Dead-letter copies go out through [`dead_letters`].
//!
//! A move to a dead-letter queue is acknowledged only after the broker confirmed the copy. Nothing is acknowledged
//! before its outcome is committed or confirmed; what cannot be finished is left to the broker to deliver again.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod batch;
mod dead_letters;
mod poison;

use futures_util::{FutureExt as _, StreamExt as _};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use self::dead_letters::{CopyError, DeadLetters};
use crate::amqp::dead_letter::{self, Fault};
use crate::amqp::envelope::{self, Incoming, Unreadable};
use crate::amqp::limits::{self, MAX_HEADER_TEXT, MAX_LOGGED_TEXT};
use crate::amqp::{Broker, topology};
use crate::db::sql;
use crate::error::Result;
use crate::failpoint;
use crate::inbox::{
    Conflict, ConsumerType, Fingerprint, Inbox, Outcome, ProcessError, Work, WorkError,
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
    /// What becomes of a copy whose message id was processed before for another event.
    pub on_conflict: OnConflict,
}

/// What becomes of a message whose id was processed before for another event (a producer that reused an id): it is
/// never processed, and always counted and logged as a conflict; this says whether it is also kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnConflict {
    /// Moved to `<queue>_error` with the reason, for someone to look at: it is a bug upstream.
    #[default]
    DeadLetter,
    /// Acknowledged and dropped, like a duplicate.
    Discard,
}

pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);
/// Backoff while PostgreSQL or RabbitMQ is unavailable.
const OUTAGE_DELAY_MIN: Duration = Duration::from_millis(100);
const OUTAGE_DELAY_MAX: Duration = Duration::from_secs(5);
/// How long a message whose dead-letter copy can never be made is held before it goes back to the queue: it is not
/// acknowledged (nothing is lost) and must not come round in a tight loop.
const HOLD_IMPOSSIBLE: Duration = Duration::from_secs(60);
/// How long the work left in flight at a stop may take to be told apart from a crash, and the pool to close.
const STOP_BOOKKEEPING: Duration = Duration::from_secs(2);

/// What one consumer process did, for its closing log line, `demo` and `--metrics-addr`.
#[derive(Debug, Default)]
pub struct RunCounts {
    pub processed: AtomicU64,
    pub duplicates: AtomicU64,
    pub failed_attempts: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub skipped: AtomicU64,
    pub conflicts: AtomicU64,
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
    pub conflicts: u64,
}

impl RunCounts {
    pub fn summary(&self) -> RunSummary {
        RunSummary {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            failed_attempts: self.failed_attempts.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            conflicts: self.conflicts.load(Ordering::Relaxed),
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
    /// An attempt holds it shared; an attempt of a suspect — a redelivered message that was in flight when a process
    /// ended before — holds it alone, so that if its process ends again, nothing else was in flight to share the
    /// blame. Only attempts hold it: never a retry's wait.
    alone: tokio::sync::RwLock<()>,
    /// Redelivered messages whose start is counted and not yet through (see [`poison`]).
    starts: poison::Starts,
}

/// One broker connection: deliveries come in on one channel, dead-letter copies go out on another.
struct Link {
    connection: Connection,
    consume: Channel,
    dead_letters: DeadLetters,
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
        starts: poison::Starts::default(),
    });
    let permits = Arc::new(Semaphore::new(shared.options.concurrency.max(1)));
    let mut tasks: JoinSet<()> = JoinSet::new();
    // Batched: deliveries queue up for a few batch workers instead of getting a task each.
    let mut batches = (shared.options.batch_size > 1).then(|| {
        let (tx, rx) = mpsc::channel::<batch::Queued>(usize::from(shared.options.prefetch).max(1));
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let running = Arc::new(AtomicUsize::new(0));
        let workers = shared
            .options
            .concurrency
            .div_ceil(shared.options.batch_size)
            .max(1);
        for _ in 0..workers {
            tasks.spawn(batch::worker(
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
        conflicts = summary.conflicts,
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
    Ok(Link {
        connection,
        consume,
        dead_letters: DeadLetters::new(broker.username().to_owned()),
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
        // Abandoned by a clean stop, not ended by a crash: their starts must not count towards --poison-after.
        poison::abandoned(shared).await;
    }
}

/// What to do with a delivery once its handling ended.
enum Disposition {
    /// Its outcome is committed or its copy confirmed.
    Ack,
    /// Not finished (a stop, an outage): give it back to the broker.
    Requeue,
    /// Not finished, and not to come back at once (its dead-letter copy was refused): give it back after this pause,
    /// or at a stop.
    RequeueAfter(Duration),
}

/// Handles one delivery on its own (not batched) and settles it with the broker. A panic anywhere in its handling
/// (not only in the consumer's work, which counts as a failed attempt) gives the delivery back, never leaves it
/// unsettled.
async fn handle<C: Consumer>(shared: &Shared<C>, link: &Link, delivery: Delivery) {
    let disposition = match AssertUnwindSafe(dispose(shared, link, &delivery))
        .catch_unwind()
        .await
    {
        Ok(disposition) => disposition,
        Err(panic) => handling_panicked(&delivery, &panic_message(&*panic)),
    };
    settle(shared, &delivery, disposition).await;
}

async fn dispose<C: Consumer>(shared: &Shared<C>, link: &Link, delivery: &Delivery) -> Disposition {
    match prepare(shared, link, delivery).await {
        Prepared::Done(disposition) => disposition,
        Prepared::Ready(ready) if delivery.redelivered => {
            poison::redelivered(shared, link, delivery, &ready).await
        }
        Prepared::Ready(ready) => attempts(shared, link, delivery, &ready, 1, Access::Shared).await,
    }
}

/// Handling a delivery panicked outside the consumer's work (a bug of inboxctl's, or of a library under it): said,
/// and the delivery given back after a pause, so that it cannot come round in a tight loop.
fn handling_panicked(delivery: &Delivery, panic: &str) -> Disposition {
    tracing::error!(
        message_id = ?property_id(delivery),
        panic = %logged(panic),
        "handling a message panicked; it goes back to the queue"
    );
    Disposition::RequeueAfter(OUTAGE_DELAY_MAX)
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

/// Acks or requeues a delivery whose handling ended, and counts it out of flight.
async fn settle<C: Consumer>(shared: &Shared<C>, delivery: &Delivery, disposition: Disposition) {
    settle_acker(shared, &delivery.acker, delivery.delivery_tag, disposition).await;
}

async fn settle_acker<C: Consumer>(
    shared: &Shared<C>,
    acker: &lapin::Acker,
    delivery_tag: u64,
    disposition: Disposition,
) {
    let settled = match disposition {
        Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
        Disposition::Requeue | Disposition::RequeueAfter(_) => {
            if let Disposition::RequeueAfter(pause) = disposition {
                sleep_or_cancel(pause, &shared.shutdown).await;
            }
            acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
        }
    };
    match settled {
        Ok(true) => {}
        // Settled already, by the clean-up after a panic: counted out of flight there.
        Ok(false) => return,
        Err(_) => tracing::debug!(
            delivery_tag,
            "not settled (channel closed); the broker will deliver the message again"
        ),
    }
    *lock(&shared.last_activity) = Instant::now();
    let _ = shared
        .in_flight
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

/// A delivery that could be read, of a type this consumer handles, with its event decoded.
struct Ready<M> {
    incoming: Incoming,
    message: M,
    message_type: Option<String>,
    fingerprint: Fingerprint,
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
    let label = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str());
    failpoint::hit_with("handle", label.unwrap_or_default()).await;
    let incoming = match envelope::parse(&delivery.properties, &delivery.data) {
        Ok(incoming) => incoming,
        Err(unreadable) => {
            let id = property_id(delivery);
            tracing::warn!(
                message_id = id.map(|i| i.to_string()).unwrap_or_default(),
                reason = %logged(&unreadable.to_string()),
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
            fingerprint: envelope::fingerprint(&incoming.payload),
            incoming,
            message,
            message_type,
        }),
        Err(e) => {
            let reason = format!(
                "the message cannot be read as {}: {e}",
                envelope::dotnet_type_name(C::MESSAGE_TYPE)
            );
            tracing::warn!(message_id = %incoming.message_id, reason = %logged(&reason), "moving message to the error queue");
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

/// Whether an attempt may run beside others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Shared,
    /// A suspect's: nothing else may be in flight in this process while it runs.
    Alone,
}

/// Processes one message in transactions of its own, from attempt `first` on: retries what fails, waits out outages.
/// Each attempt holds [`Shared::alone`] (shared, or alone for a suspect) while it runs, and only then: a retry's wait
/// holds up nobody.
async fn attempts<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    first: u32,
    access: Access,
) -> Disposition {
    let id = ready.incoming.message_id;
    let mut attempt = first;
    let mut outage_delay = OUTAGE_DELAY_MIN;
    loop {
        let result = {
            let _guard = match access {
                Access::Shared => Guard::Shared {
                    _held: shared.alone.read().await,
                },
                Access::Alone => {
                    let guard = Guard::Alone {
                        _held: shared.alone.write().await,
                    };
                    if attempt == first {
                        poison::starting_alone(shared, id).await;
                    }
                    guard
                }
            };
            let work = shared.inbox.process_event(
                id,
                Some(ready.fingerprint),
                work(shared, delivery, ready, attempt),
            );
            AssertUnwindSafe(work).catch_unwind().await
        };
        let failure = match result {
            Ok(Ok(outcome)) => {
                database_back(shared);
                match outcome {
                    Outcome::Processed(()) => {
                        processed(shared, id);
                        failpoint::hit("after-commit").await;
                    }
                    Outcome::Duplicate => duplicate(shared, id),
                    Outcome::Conflict(c) => {
                        return conflict(shared, link, delivery, ready, c).await;
                    }
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

/// The hold an attempt has on [`Shared::alone`].
enum Guard<'a> {
    Shared {
        _held: tokio::sync::RwLockReadGuard<'a, ()>,
    },
    Alone {
        _held: tokio::sync::RwLockWriteGuard<'a, ()>,
    },
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
            reason = %logged(&failure),
            "giving up; moving message to the error queue"
        );
        let first_line = failure.lines().next().unwrap_or_default().to_owned();
        let fault = ("inboxctl::ConsumerFailed", first_line, failure);
        let retries = i32::try_from(attempt - 1).unwrap_or(i32::MAX);
        return Some(error_queue(shared, link, delivery, ready, &fault, retries).await);
    }
    let delay = retry_delay(shared.options.retry_delay, attempt);
    tracing::warn!(
        message_id = %id,
        attempt,
        retry_in = ?delay,
        reason = %logged(&failure),
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

/// A copy whose message id was processed before for another event: never processed; counted and logged as a
/// conflict (the claim recorded it), then moved to the error queue or dropped, as the operator chose.
async fn conflict<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    conflict: Conflict,
) -> Disposition {
    shared.counts.conflicts.fetch_add(1, Ordering::Relaxed);
    let id = ready.incoming.message_id;
    let then = match shared.options.on_conflict {
        OnConflict::DeadLetter => "moving it to the error queue",
        OnConflict::Discard => "discarding it (--on-conflict discard)",
    };
    tracing::warn!(
        message_id = %id,
        consumer_type = %shared.inbox.consumer_type(),
        first_event = %conflict.first,
        this_event = %conflict.this,
        "message id reused for another event: this message was not processed; {then}"
    );
    match shared.options.on_conflict {
        OnConflict::Discard => Disposition::Ack,
        OnConflict::DeadLetter => {
            let reason = format!(
                "message id {id} was processed before for another event (fingerprint {}; this message's {}): the id \
                 was reused for a different message, which was not processed",
                conflict.first, conflict.this
            );
            let fault = (CONFLICT_FAULT, reason.clone(), reason);
            error_queue(shared, link, delivery, ready, &fault, 0).await
        }
    }
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

async fn skip<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    incoming: &Incoming,
) -> Disposition {
    let destination = topology::skipped_queue(&shared.options.queue);
    let types = incoming.message_types.join(", ");
    tracing::warn!(
        message_id = %incoming.message_id,
        message_type = %logged(&types),
        "message type not handled here; moving it to {destination}"
    );
    let headers = dead_letter::skipped_headers(delivery.properties.headers().as_ref());
    let moved = link
        .dead_letters
        .publish(&link.connection, &destination, delivery, headers)
        .await;
    match moved {
        Ok(()) => {
            shared.counts.skipped.fetch_add(1, Ordering::Relaxed);
            record_event(shared, "skipped", Some(incoming.message_id), &types).await;
            Disposition::Ack
        }
        Err(e) => copy_refused(Some(incoming.message_id), &destination, e),
    }
}

/// `(exception type, one-line message, full description)`.
type FaultText = (&'static str, String, String);

/// The exception type of a conflict's copy. A conflict moved aside is counted once, as a conflict (the claim recorded
/// it), not again as a dead-lettering.
const CONFLICT_FAULT: &str = "inboxctl::MessageIdConflict";

fn unreadable_fault(unreadable: &Unreadable) -> FaultText {
    (
        "inboxctl::UnreadableMessage",
        unreadable.to_string(),
        unreadable.to_string(),
    )
}

/// Moves a message that could be read to the error queue.
async fn error_queue<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    fault: &FaultText,
    retry_count: i32,
) -> Disposition {
    let id = Some(ready.incoming.message_id);
    let message_type = ready.message_type.clone();
    dead_letter_error(shared, link, delivery, id, message_type, fault, retry_count).await
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
    let moved = link
        .dead_letters
        .publish(&link.connection, &destination, delivery, headers)
        .await;
    match moved {
        Ok(()) => {
            if fault.0 != CONFLICT_FAULT {
                shared.counts.dead_lettered.fetch_add(1, Ordering::Relaxed);
                record_event(shared, "dead_lettered", message_id, &fault.1).await;
            }
            Disposition::Ack
        }
        Err(e) => copy_refused(message_id, &destination, e),
    }
}

/// The dead-letter copy was not published: the message stays on its queue, given back after a pause — a short one
/// if the broker may take the copy later, a long one if the copy can never be made — never in a tight loop.
fn copy_refused(message_id: Option<Uuid>, destination: &str, error: CopyError) -> Disposition {
    let pause = match error {
        CopyError::Refused(reason) => {
            tracing::error!(
                message_id = ?message_id,
                error = %reason,
                "could not move a message to {destination}; it stays on the queue"
            );
            OUTAGE_DELAY_MAX
        }
        CopyError::Impossible(reason) => {
            tracing::error!(
                message_id = ?message_id,
                error = %reason,
                "cannot move a message to {destination}; it stays on the queue, held {} at a time (move or delete \
                 it by hand)",
                humantime::format_duration(HOLD_IMPOSSIBLE)
            );
            HOLD_IMPOSSIBLE
        }
    };
    Disposition::RequeueAfter(pause)
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
        .bind(limits::truncate(detail, MAX_HEADER_TEXT).as_ref())
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

/// Text from a message or an error about it, for a log field: bounded and with control characters escaped.
fn logged(text: &str) -> String {
    sanitize::text(&limits::truncate(text, MAX_LOGGED_TEXT)).into_owned()
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
