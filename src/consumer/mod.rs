//! Running a consumer on a RabbitMQ queue with the claim protocol: reading deliveries, retrying, dead-lettering,
//! acknowledging only what is done, surviving outages of either server.
//!
//! Per delivery:
//! - unreadable (no id or the nil id, an id that is not a UUID, not JSON, a byte order mark, headers nested too deep,
//!   an envelope without a message) → `<queue>_error` at once;
//! - a message type the consumer does not handle → `<queue>_skipped` (`MT-Reason: dead-letter`, as MassTransit);
//! - an event that cannot be decoded (a field missing or of the wrong type) → `<queue>_error` at once;
//! - otherwise [`Inbox::process_event`](crate::inbox::Inbox::process_event): processed or duplicate → ack; an id processed before for another event → a
//!   conflict, moved to `<queue>_error` or dropped (`on_conflict`); the consumer's work failed (an error or a panic) →
//!   retried in this process with a doubling delay, and after `max_attempts` → `<queue>_error`; PostgreSQL
//!   unavailable → retried without counting, however long it takes, and no new delivery is started meanwhile.
//!
//! Batched (`batch_size` > 1, [`batch`]): deliveries that arrive together share one transaction; a member whose work
//! fails is retried alone, one message per transaction, as above, beside the batches. Redelivered messages, which may
//! be what ends a process, go through [`poison`]. Dead-letter copies go out through [`dead_letters`], on a
//! connection of their own; those a broker alarm blocks wait it out as [`alarm`] allows.
//!
//! A move to a dead-letter queue is acknowledged only after the broker confirmed the copy. Nothing is acknowledged
//! before its outcome is committed or confirmed; what cannot be finished is left to the broker to deliver again.
//!
//! [`consume`] starts a Parcel Tracker consumer from a [`Config`] (what `inboxctl consume` and `demo` run); [`run`]
//! is the loop beneath it, for any [`Consumer`].

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod acks;
mod alarm;
mod batch;
mod bookkeeping;
pub mod config;
mod dead_letters;
mod dispatch;
mod guard;
mod link;
mod move_aside;
mod outage;
mod owed;
mod poison;
mod run;
mod settle;
pub mod start;
mod stop;

pub use self::config::Config;
pub use self::guard::WorkGuard;
pub use self::run::{batch_workers, run};
pub use self::start::{consume, consume_guarded};

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::MAX_CAUSES;
use crate::amqp::envelope;
use crate::amqp::limits::MAX_LOGGED_TEXT;
use crate::backoff::sleep_or_cancel;
use crate::error::Result;
use crate::inbox::{ConsumerType, Effect, WorkError};
use crate::metrics::consume::Timings;
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
    /// or roll back; returning an error rolls everything back. A raw `COMMIT` or `ROLLBACK` after which the work
    /// returns `Ok` is found (the message fails), in a batch only once the members after it ran outside any
    /// transaction (their writes committed on their own, made again when the batch is redone). A raw `COMMIT`
    /// commits the claim: a work that then fails, and in a batch every member after it that fails or is not reached,
    /// is taken as processed when it comes again — its message lost. Never end the transaction. A transaction
    /// of its own (`begin`) is a savepoint: commit it (one leaked, left open, fails the message; one dropped is rolled
    /// back with what it wrote, and the message commits without it, as with any transaction dropped). Settings only
    /// with `SET LOCAL`: a plain `SET` (`search_path`, `lock_timeout`, `ROLE`) outlives the transaction on the pooled
    /// connection and changes the claims of later messages on it (another `search_path`, another `inbox_messages`).
    fn consume<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        context: &'c MessageContext,
        message: &'c Self::Message,
    ) -> impl Future<Output = Result<(), WorkError>> + Send + 'c;

    /// The work of several messages on one transaction (a batch's claimed members, in order), under the same
    /// contract as [`Consumer::consume`]. A consumer whose effect is SQL writes them all in one statement here; the
    /// default does each message's [`Consumer::consume`] in turn. If it fails, the batch is done again message by
    /// message through `consume`, to find out which one failed.
    fn consume_batch<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [&'c (MessageContext, Self::Message)],
    ) -> impl Future<Output = Result<(), WorkError>> + Send + 'c {
        async move {
            for (context, message) in batch.iter().copied() {
                self.consume(&mut *tx, context, message).await?;
            }
            Ok(())
        }
    }

    /// The work of one message as one SQL statement, when it is one ([`Effect`]): the inbox then sends the claim and
    /// the effect as one statement, in one round trip ([`Inbox::process_effect`](crate::inbox::Inbox::process_effect)).
    /// The effect must be the one [`Consumer::consume`] makes, which still runs when the statement fails for a reason
    /// of its own (to tell the work's failure from the claim's), and in place of it when this returns `None` (the
    /// default) or an error. It runs before the claim, for every copy and every attempt: it must only build the
    /// statement (no call, no write, nothing that cannot be done twice). The statement must write only rows drawn
    /// from `claimed` (`INSERT … SELECT … FROM claimed`): the inbox refuses one that does not name it, but cannot
    /// prove that a statement naming it writes nothing for a copy (an outer join to it, `NOT EXISTS` over it, an
    /// aggregate of it all write a row for an empty `claimed`).
    fn effect<'c>(
        &'c self,
        context: &'c MessageContext,
        message: &'c Self::Message,
    ) -> impl Future<Output = Result<Option<Effect>, WorkError>> + Send + 'c {
        let _ = (context, message);
        async { Ok(None) }
    }

    /// Whether a delivery whose declared types are `types` is one this consumer handles. A plain JSON message that
    /// declares no type is assumed to be of the consumer's type (and goes to the error queue if it cannot be decoded).
    /// Not asked of a MassTransit envelope that declares none: skipped, as MassTransit skips it.
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
    /// What the queue and its dead-letter queues are declared as where they do not exist.
    pub queue_type: crate::amqp::topology::QueueType,
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
    /// How long a call to RabbitMQ may take (an ack, a nack, a dead-letter copy's confirm, setting a connection up);
    /// past it the connection is given up and opened again (see `link::Link::answer`).
    pub broker_timeout: Duration,
    /// How long one attempt (or one round of a batch) may take; also bounds the bookkeeping beside a message (see
    /// `bookkeeping::bounded`).
    pub attempt_timeout: Duration,
    /// Where the run counts what it does (shared with `--metrics-addr`).
    pub counts: Arc<RunCounts>,
    /// More than 1: up to this many deliveries share one transaction (see [`Inbox::process_batch`](crate::inbox::Inbox::process_batch)).
    pub batch_size: usize,
    /// How long a batch waits to fill while another batch is running.
    pub batch_wait: Duration,
    /// A redelivered message that has started this many times without reaching an outcome (each start ended its
    /// process) goes to the error queue at its next delivery.
    pub poison_after: u32,
    /// What becomes of a copy whose message id was processed before for another event.
    pub on_conflict: OnConflict,
    /// Where the time each delivery took to reach its outcome goes (`--metrics-addr`), if anywhere.
    pub timings: Option<Timings>,
    /// Spread over partition queues, each read one message at a time, for per-key order.
    pub partitions: Option<Partitions>,
    /// The calls this consumer owes after its commits, made by an effect worker in this process: `--exit-when-idle`
    /// waits until none is owed, so that a run that ends idle has made every call it could.
    pub owed_effects: Option<OwedEffects>,
}

/// Where the calls a consumer owes after its commits are written (`inboxctl_effects`, under its consumer_type).
#[derive(Debug, Clone)]
pub struct OwedEffects {
    pub pool: sqlx::PgPool,
    pub consumer_type: crate::inbox::ConsumerType,
    /// Only the pending ones are this run's to make (see [`crate::effects::worker::Worker::pending_only`]).
    pub pending_only: bool,
}

/// A consumer spread over `count` queues by a consistent-hash exchange (see `docs/scaling.md`, "Per-key order").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitions {
    /// How many partition queues (`<queue>.0` …).
    pub count: u16,
    /// The field of the message whose value publishers give as the routing key, the exchange hashing it: messages
    /// with the same value go to the same queue, in the order they were published.
    pub key: String,
}

/// What becomes of a message whose id was processed before for another event (a producer that reused an id): it is
/// never processed, and always counted and logged as a conflict; this says whether it is also kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// The queues the consumer reads (one, or its partitions) and how many of them it consumes now.
    pub queues: AtomicUsize,
    pub queues_consuming: AtomicUsize,
    /// How many of its queues hold their deliveries now because PostgreSQL is gone or refuses the inbox's own
    /// statements (a grant, the schema): what a `SELECT 1` cannot see.
    pub queues_held: AtomicUsize,
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
    /// Whether the consumer holds a working broker connection for every queue it reads: a partition whose consuming
    /// is refused again and again while the others consume is not "connected".
    pub fn broker_connected(&self) -> bool {
        let queues = self.queues.load(Ordering::Relaxed);
        queues > 0 && self.queues_consuming.load(Ordering::Relaxed) == queues
    }

    /// Whether every queue takes deliveries as far as PostgreSQL goes: none held up by an outage.
    pub fn database_taken(&self) -> bool {
        self.queues_held.load(Ordering::Relaxed) == 0
    }

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

/// The process's one lock of attempts and suspects (see [`Shared::alone`]).
static ALONE: std::sync::LazyLock<Arc<tokio::sync::RwLock<()>>> =
    std::sync::LazyLock::new(|| Arc::new(tokio::sync::RwLock::new(())));

/// Everything a delivery's task shares with the others.
struct Shared<C: Consumer> {
    /// The [`Inbox`](crate::inbox::Inbox), unless the caller guards the work otherwise.
    inbox: Arc<dyn WorkGuard>,
    /// The queue this loop reads: `options.queue`, or one of its partitions (the dead-letter queues are named after
    /// `options.queue` either way).
    queue: String,
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
    /// blame. Only attempts hold it: never a retry's wait. One for the process ([`ALONE`]), shared by the partition
    /// queues it reads (`--partitions`) and by every consumer it runs (`demo` runs two, and so may a service on the
    /// library): a suspect is alone only if no other attempt runs beside it, whichever queue it is of.
    alone: Arc<tokio::sync::RwLock<()>>,
    /// Redelivered messages whose start is counted and not yet through (see [`poison`]).
    starts: poison::Starts,
    /// Partitioned: whether a message published without its partition key as routing key was said already.
    routing_key_warned: std::sync::atomic::AtomicBool,
    /// The dead-letter copies waiting for a broker alarm to end, each holding a worker.
    alarm_waits: alarm::AlarmWaits,
    /// Messages gone back to the queue whose copy to the error queue was decided and not made.
    owed: owed::OwedCopies,
    /// Deliveries waiting out their pause before they go back (see `settle::to_the_tail`).
    held_back: AtomicUsize,
    /// Whether this loop consumes its queue now (counted in `counts.queues_consuming`).
    consuming: AtomicBool,
    /// `--exit-when-idle` over every queue of the process (its partitions), and whether this one is counted idle.
    idle: Arc<IdleTogether>,
    idle_counted: AtomicBool,
}

/// `--exit-when-idle` over every queue the process reads (its partitions): it ends once all of them are idle at
/// once, and then all together. A partition found idle alone goes on reading while another still works: stopped, a
/// message arriving on it would be left behind by a run that ends "idle". A queue counted idle stays so until it is
/// handed a delivery.
#[derive(Debug)]
struct IdleTogether {
    queues: usize,
    idle: AtomicUsize,
    /// Every queue idle at once: each stops now, finishing what it was handed meanwhile.
    all: CancellationToken,
}

impl IdleTogether {
    fn new(queues: usize) -> Self {
        Self {
            queues,
            idle: AtomicUsize::new(0),
            all: CancellationToken::new(),
        }
    }
}

impl<C: Consumer> Shared<C> {
    /// Counts this queue idle; whether every queue of the process is now (then each of them stops).
    fn idle_now(&self) -> bool {
        if !self.idle_counted.swap(true, Ordering::SeqCst) {
            self.idle.idle.fetch_add(1, Ordering::SeqCst);
        }
        if self.idle.idle.load(Ordering::SeqCst) >= self.idle.queues {
            self.idle.all.cancel();
        }
        self.idle.all.is_cancelled()
    }

    /// This queue was handed a delivery: not idle, until it is found so again.
    fn busy(&self) {
        if self.idle_counted.swap(false, Ordering::SeqCst) {
            self.idle.idle.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Says whether this loop consumes its queue now; each queue counted once however often it is said.
    fn set_consuming(&self, consuming: bool) {
        if self.consuming.swap(consuming, Ordering::Relaxed) != consuming {
            if consuming {
                self.counts.queues_consuming.fetch_add(1, Ordering::Relaxed);
            } else {
                self.counts.queues_consuming.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A message's AMQP message id, read as the envelope's reader reads it (surrounding blanks ignored): what an
/// unreadable message is recorded and logged under.
fn property_id(properties: &lapin::BasicProperties) -> Option<Uuid> {
    properties
        .message_id()
        .as_ref()
        .and_then(|id| Uuid::parse_str(id.as_str().trim()).ok())
}

/// Text from a message or an error about it, for a log field: passwords masked before it is cut (cut first, a URL's
/// `@` cut off hides its password from the log's masking), bounded, control characters escaped.
pub(crate) fn logged(text: &str) -> String {
    sanitize::text(&crate::redact::text_cut(text, MAX_LOGGED_TEXT)).into_owned()
}

/// The error and its causes, one per line (at most [`MAX_CAUSES`]); a PostgreSQL error as [`crate::db::describe`]
/// tells it (without the server's internal source line). Passwords masked ([`crate::redact::text`]): it is logged,
/// and kept as the reason in a dead-letter copy's headers and in `inboxctl_events`, and a work's causes (a client
/// library's error) may show a URL with its password.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    fn told(e: &(dyn std::error::Error + 'static)) -> (String, bool) {
        match e.downcast_ref::<sqlx::Error>() {
            Some(db) => (crate::db::describe(db), true),
            None => (e.to_string(), false),
        }
    }
    let (mut text, mut last) = told(error);
    let mut source = error.source();
    let mut causes = 0;
    while let (false, Some(cause)) = (last, source) {
        causes += 1;
        if causes > MAX_CAUSES {
            text.push_str("\ncaused by: … (more causes not shown)");
            break;
        }
        let (line, db) = told(cause);
        if !text.contains(&line) {
            text.push_str("\ncaused by: ");
            text.push_str(&line);
        }
        last = db;
        source = cause.source();
    }
    crate::redact::text(&text)
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

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
