//! The publish topology MassTransit builds, so that MassTransit publishers and inboxctl consumers (and the other way
//! round) interoperate whoever declared it first:
//!
//! ```text
//! exchange <event type> ──▶ exchange <endpoint> ──▶ queue <endpoint>        (all fanout, durable, no arguments)
//! on first fault:           exchange <endpoint>_error   ──▶ queue <endpoint>_error
//! on first skip:            exchange <endpoint>_skipped ──▶ queue <endpoint>_skipped
//! ```
//!
//! An entity that already exists is used as it is, whatever its arguments (a quorum queue, a TTL): inboxctl checks
//! for it passively first and declares only what is missing, so it never fails on, or changes, a topology a .NET
//! service declared. A queue it declares is a classic one, or with `--queue-type quorum` a quorum queue (replicated
//! over a cluster's nodes; see docs/scaling.md): the queue and its `_error` and `_skipped` alike.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ExchangeKind};

use super::is_not_found;
use crate::error::{Error, Result};

pub use super::markers::{
    LookMark, Marker, look_marker, looks_at, mark_look, mark_replay, not_a_replay_destination,
    replay_marker, replay_running, unmark_replay,
};

/// The exchange MassTransit publishes `ParcelTracker.Domain.Events.ParcelCreatedEvent` to.
pub const PARCEL_CREATED_EXCHANGE: &str = "ParcelTracker.Domain.Events:ParcelCreatedEvent";

/// The kind of queue inboxctl declares where none exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QueueType {
    /// RabbitMQ's classic queue: on one node (MassTransit's default too).
    #[default]
    Classic,
    /// A quorum queue: replicated over the cluster's nodes, the broker counting each message's deliveries in
    /// `x-delivery-count`.
    Quorum,
}

impl QueueType {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Classic => "classic",
            Self::Quorum => "quorum",
        }
    }

    /// The declare arguments that make a queue of this type.
    fn arguments(self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if self == Self::Quorum {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        arguments
    }
}

/// The type of exchange that spreads messages over a partitioned consumer's queues by a hash of their routing key
/// (RabbitMQ's `rabbitmq_consistent_hash_exchange` plugin).
pub const CONSISTENT_HASH: &str = "x-consistent-hash";

/// The exchange that spreads the event over the `partitions` queues of the partitioned consumer of `queue`.
pub fn partition_exchange(queue: &str) -> String {
    format!("{queue}.partitions")
}

/// The `index`th (from 0) of the queues a partitioned consumer of `queue` reads.
pub fn partition_queue(queue: &str, index: u16) -> String {
    format!("{queue}.{index}")
}

/// The header a quorum queue counts a message's earlier deliveries in (absent on a first delivery).
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Whether `key` is a header a quorum queue writes on each delivery: its count of failed deliveries
/// (`x-delivery-count`) and, from RabbitMQ 4.3, of every time the message was handed out (`x-acquired-count`, a look
/// by `basic.get` included). They change as the same message is delivered again: they are not part of it.
pub fn is_per_delivery_header(key: &str) -> bool {
    key == DELIVERY_COUNT_HEADER || key == "x-acquired-count"
}

/// The queue (and exchange) a failed message of `queue` is moved to.
pub fn error_queue(queue: &str) -> String {
    format!("{queue}_error")
}

/// The queue (and exchange) a message of a type the consumer of `queue` does not handle is moved to.
pub fn skipped_queue(queue: &str) -> String {
    format!("{queue}_skipped")
}

/// Makes sure the event exchange exists.
pub async fn ensure_event_exchange(conn: &Connection, exchange: &str) -> Result<()> {
    ensure_exchange(conn, exchange).await
}

/// Makes sure a receive endpoint exists and is fed by the event exchange: exchange and queue named `queue`, the queue
/// bound to its exchange, the endpoint exchange bound to the event exchange.
///
/// An earlier run that spread `queue` over partition queues ([`ensure_partitioned_endpoint`]) left their exchange
/// bound to the event exchange, taking a copy of every message for queues this endpoint's consumers never read:
/// said, not refused (a switch from partitions to one queue runs both for a while; docs/scaling.md).
pub async fn ensure_endpoint(
    conn: &Connection,
    event_exchange: &str,
    queue: &str,
    queue_type: QueueType,
) -> Result<()> {
    let partitioned = partition_exchange(queue);
    // Looked at once a process (each reconnect opens the endpoint again), and only to say so: a look that fails
    // holds nothing up.
    if first_look(&partitioned)
        && looked_now(&partitioned, exchange_exists(conn, &partitioned).await)
    {
        let first = partition_queue(queue, 0);
        let waiting = queue_depth(conn, &first).await.ok().flatten();
        tracing::warn!(
            exchange = %crate::sanitize::text(&partitioned),
            first_partition = %crate::sanitize::text(&first),
            first_partition_ready = waiting.map(|(ready, _)| ready),
            first_partition_consumers = waiting.map(|(_, consumers)| consumers),
            "an earlier run spread this queue over partition queues, and their exchange still takes a copy of every \
             message for them, which a consumer without --partitions never reads: once no partitioned consumer runs, \
             take what they hold (consume with the earlier --partitions and --exit-when-idle), then delete them and \
             the exchange (docs/scaling.md, switching)"
        );
    }
    ensure_exchange(conn, event_exchange).await?;
    ensure_exchange(conn, queue).await?;
    ensure_queue(conn, queue, queue_type).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_bind(
            queue.into(),
            queue.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_bind(
            queue.into(),
            event_exchange.into(),
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let _ = channel.close(200, "OK".into()).await;
    Ok(())
}

/// Makes sure a dead-letter destination (`<queue>_error` or `<queue>_skipped`) exists: an exchange and a queue of that
/// name, bound.
pub async fn ensure_dead_letter_queue(
    conn: &Connection,
    name: &str,
    queue_type: QueueType,
) -> Result<()> {
    ensure_exchange(conn, name).await?;
    ensure_queue(conn, name, queue_type).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_bind(
            name.into(),
            name.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let _ = channel.close(200, "OK".into()).await;
    Ok(())
}

/// Makes sure the partitioned topology of `queue` exists and is fed by the event exchange:
///
/// ```text
/// exchange <event type> ──▶ exchange <queue>.partitions (x-consistent-hash) ──▶ queue <queue>.0 … <queue>.<n-1>
/// ```
///
/// Each partition queue is bound with the same weight and declared with `x-single-active-consumer`, so that the broker
/// delivers it to one consumer at a time and hands it to a standby when that consumer goes. Unlike the plain
/// endpoint, these are declared with their exact arguments, not only checked for: a partition queue that exists
/// without a single active consumer would give up the order it is there for, and the broker refuses the declare
/// (said, with what to do). A queue `<queue>.<n>` that exists means an earlier run had more partitions: the exchange
/// still routes a share of the messages to it, where nobody reads them, so the consumer refuses to start.
///
/// The plain endpoint's queue `queue` (an earlier run without partitions, or another service reading it) goes on
/// taking a copy of every message, which no partitioned consumer reads, and what it held before the partitions were
/// bound is in it alone: said, with what to do, not refused (a switch runs both for a while; docs/scaling.md).
///
/// `bound` bounds each step — the checks and the exchanges, then each partition queue's declaration and binding —, not
/// the whole: with hundreds of partitions (quorum queues on a cluster, each declaration a consensus round) the whole
/// takes many times what one call may, and bound as one it failed the consumer's start on a healthy broker.
pub async fn ensure_partitioned_endpoint(
    conn: &Connection,
    event_exchange: &str,
    queue: &str,
    partitions: u16,
    queue_type: QueueType,
    bound: std::time::Duration,
) -> Result<()> {
    // Said as any broker call unanswered (exit 69); which step, in the log before it.
    let within = |what: String| {
        move |_| {
            tracing::warn!(step = %crate::sanitize::text(&what), "RabbitMQ did not answer a step of the partitioned topology");
            Error::BrokerSilent {
                what: "a declaration of the partitioned topology",
                within: bound,
            }
        }
    };
    tokio::time::timeout(
        bound,
        prepare_partitions(conn, event_exchange, queue, partitions),
    )
    .await
    .map_err(within(format!("the look at {queue:?}'s partitions")))??;
    let exchange = partition_exchange(queue);
    let channel = tokio::time::timeout(bound, conn.create_channel())
        .await
        .map_err(within("a channel's opening".to_owned()))??;
    for index in 0..partitions {
        let name = partition_queue(queue, index);
        tokio::time::timeout(
            bound,
            declare_partition(&channel, &name, &exchange, queue_type),
        )
        .await
        .map_err(within(format!("the declaration of {name:?}")))??;
    }
    tokio::time::timeout(
        bound,
        channel.exchange_bind(
            exchange.as_str().into(),
            event_exchange.into(),
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .map_err(within(format!("the binding of {exchange:?}")))??;
    let _ = tokio::time::timeout(bound, channel.close(200, "OK".into())).await;
    Ok(())
}

/// The partitioned endpoint's checks and exchanges, before its queues: the plain queue looked at, the event exchange
/// made sure of, no partition queue past the count, the partition exchange declared.
async fn prepare_partitions(
    conn: &Connection,
    event_exchange: &str,
    queue: &str,
    partitions: u16,
) -> Result<()> {
    // Looked at once a process (each partition's link, each reconnect opens the endpoint again), and only to say so.
    if first_look(queue)
        && let Some((ready, consumers)) = looked_now(queue, queue_depth(conn, queue).await)
    {
        tracing::warn!(
            queue = %crate::sanitize::text(queue),
            ready,
            consumers,
            "the queue of this consumer without partitions exists: it still takes a copy of every message, which no \
             partitioned consumer reads, and what it held before the partitions were bound is there alone; once its \
             own consumers have stopped, take what it holds (consume without --partitions, --exit-when-idle), then \
             delete it (docs/scaling.md, switching)"
        );
    }
    ensure_exchange(conn, event_exchange).await?;
    let beyond = partition_queue(queue, partitions);
    if queue_depth(conn, &beyond).await?.is_some() {
        return Err(Error::TopologyConflict(format!(
            "queue {beyond:?} exists: an earlier run spread {queue:?} over more than {partitions} partitions, and \
             {:?} still routes a share of the messages to it; run with the earlier --partitions, or drain and delete \
             the queues past {:?}",
            partition_exchange(queue),
            partition_queue(queue, partitions.saturating_sub(1)),
        )));
    }
    let exchange = partition_exchange(queue);
    declare_consistent_hash_exchange(conn, &exchange).await?;
    Ok(())
}

/// One partition queue declared (durable, single active consumer, the queue type's arguments) and bound to the
/// partition exchange with the weight every queue has.
async fn declare_partition(
    channel: &lapin::Channel,
    name: &str,
    exchange: &str,
    queue_type: QueueType,
) -> Result<()> {
    crate::failpoint::hit_with("declare-partition", name).await;
    let mut arguments = queue_type.arguments();
    arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let declared = channel
        .queue_declare(name.into(), QueueDeclareOptions::durable(), arguments)
        .await;
    if let Err(e) = declared {
        return Err(refused_declare(
            e,
            &format!(
                "queue {name:?} exists, declared otherwise than as a {} queue with a single active consumer (the \
                 broker said: {{reason}}); delete it once it is drained, or give the --queue-type it was declared with",
                queue_type.name()
            ),
        ));
    }
    // The weight of each queue on the hash ring: all equal.
    channel
        .queue_bind(
            name.into(),
            exchange.into(),
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// Declares `name` as a durable consistent-hash exchange (the same declare again is a no-op; one of another type is
/// refused by the broker, and said).
async fn declare_consistent_hash_exchange(conn: &Connection, name: &str) -> Result<()> {
    let channel = conn.create_channel().await?;
    let declared = channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Custom(CONSISTENT_HASH.to_owned()),
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "OK".into()).await;
            Ok(())
        }
        Err(e) if is_unknown_exchange_type(&e) => Err(Error::TopologyConflict(format!(
            "the broker does not know the exchange type {CONSISTENT_HASH} that partitions need: enable its plugin \
             with `rabbitmq-plugins enable rabbitmq_consistent_hash_exchange` (on every node of a cluster)"
        ))),
        Err(e) => Err(refused_declare(
            e,
            &format!(
                "exchange {name:?} exists with another type than {CONSISTENT_HASH} (the broker said: {{reason}}); delete it \
             or consume another --queue"
            ),
        )),
    }
}

/// A declare the broker refused as inequivalent to what exists (406), said with `what` (in which `{reason}` stands
/// for the broker's words); any other failure as it is.
fn refused_declare(error: lapin::Error, what: &str) -> Error {
    if let lapin::ErrorKind::ProtocolError(e) = error.kind()
        && matches!(
            e.kind(),
            lapin::protocol::AMQPErrorKind::Soft(
                lapin::protocol::AMQPSoftError::PRECONDITIONFAILED
            )
        )
    {
        let reason = crate::sanitize::text(&e.to_string()).into_owned();
        return Error::TopologyConflict(what.replace("{reason}", &reason));
    }
    error.into()
}

/// Whether the broker refused a declare for an exchange type it does not know (a hard error: it closes the
/// connection).
fn is_unknown_exchange_type(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Hard(lapin::protocol::AMQPHardError::COMMANDINVALID))
    )
}

/// Ready messages and consumers of a queue, or `None` when it does not exist.
pub async fn queue_depth(conn: &Connection, queue: &str) -> Result<Option<(u32, u32)>> {
    let channel = conn.create_channel().await?;
    match channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        )
        .await
    {
        Ok(q) => {
            let _ = channel.close(200, "OK".into()).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if super::is_absent_queue(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The names this process looks or looked at for a switch between one queue and partitions.
static LOOKED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Whether this process should look at `name` for a switch: the first time only (each partition's link, each
/// reconnect opens the endpoint again, several at once: said once).
fn first_look(name: &str) -> bool {
    let mut looked = LOOKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    !looked.iter().any(|n| n == name) && {
        looked.push(name.to_owned());
        true
    }
}

/// The answer of a look at `name` for a switch. A look that failed holds nothing up — it only feeds a warning — and
/// is made again at the next opening of the endpoint.
fn looked_now<T: Default>(name: &str, answer: Result<T>) -> T {
    answer.unwrap_or_else(|e| {
        tracing::debug!(error = %e, "a look for a switch between one queue and partitions failed");
        LOOKED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|n| n != name);
        T::default()
    })
}

/// Whether an exchange of that name exists (of any kind).
async fn exchange_exists(conn: &Connection, name: &str) -> Result<bool> {
    // A failed passive declare closes its channel, so each check gets a channel of its own.
    let probe = conn.create_channel().await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    match probe
        .exchange_declare(
            name.into(),
            ExchangeKind::Fanout,
            passive,
            FieldTable::default(),
        )
        .await
    {
        Ok(()) => {
            let _ = probe.close(200, "OK".into()).await;
            Ok(true)
        }
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Declares a fanout, durable exchange without arguments, as MassTransit does — unless one of that name exists.
async fn ensure_exchange(conn: &Connection, name: &str) -> Result<()> {
    if exchange_exists(conn, name).await? {
        return Ok(());
    }
    let channel = conn.create_channel().await?;
    channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    tracing::debug!(exchange = name, "declared exchange");
    let _ = channel.close(200, "OK".into()).await;
    Ok(())
}

/// Declares a durable queue of `queue_type`, as MassTransit does — unless one of that name exists.
async fn ensure_queue(conn: &Connection, name: &str, queue_type: QueueType) -> Result<()> {
    if queue_depth(conn, name).await?.is_some() {
        return Ok(());
    }
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions::durable(),
            queue_type.arguments(),
        )
        .await?;
    tracing::debug!(queue = name, ?queue_type, "declared queue");
    let _ = channel.close(200, "OK".into()).await;
    Ok(())
}
