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
use crate::error::Result;

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

/// The header a quorum queue counts a message's earlier deliveries in (absent on a first delivery).
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

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
pub async fn ensure_endpoint(
    conn: &Connection,
    event_exchange: &str,
    queue: &str,
    queue_type: QueueType,
) -> Result<()> {
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
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Declares a fanout, durable exchange without arguments, as MassTransit does — unless one of that name exists.
async fn ensure_exchange(conn: &Connection, name: &str) -> Result<()> {
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
            return Ok(());
        }
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(e.into()),
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
