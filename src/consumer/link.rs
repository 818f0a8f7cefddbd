//! One broker connection a consumer reads its queue on (with the connection its dead-letter copies go out on): how
//! it is opened, how long RabbitMQ is given to answer on it, and how its loss is seen.

use std::time::Duration;

use lapin::options::BasicQosOptions;
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use super::acks::Outstanding;
use super::dead_letters::DeadLetters;
use super::{Consumer, Shared};
use crate::amqp::Broker;
use crate::amqp::topology;
use crate::error::Result;

/// One broker connection that deliveries come in on, and the connection their dead-letter copies go out on.
pub(super) struct Link {
    pub(super) connection: Connection,
    pub(super) consume: Channel,
    pub(super) dead_letters: DeadLetters,
    /// The tags of deliveries on `consume` not settled yet.
    pub(super) outstanding: Outstanding,
    /// Cancelled when RabbitMQ did not answer within `broker_timeout`: the run loop then drops the connection.
    pub(super) given_up: CancellationToken,
    pub(super) broker_timeout: Duration,
}

impl Link {
    /// Awaits `op` on RabbitMQ (an ack, a nack, a dead-letter copy and its confirm, the start of consuming, a look
    /// at the queue's depth) for at most the broker timeout; `None` if it did not complete, or the link was given up
    /// already. (An ack has no reply: lapin's completes once the frame is handed to the connection.)
    ///
    /// Past the timeout the link is given up. A broker that does not answer keeps the deliveries it holds unsettled,
    /// and a connection whose socket died without lapin noticing (seen after a node restart) would hold the worker
    /// waiting on it for ever — and once every worker is held, the whole consumer, whose loop waits for a free one.
    /// The run loop closes a given-up connection (the broker then delivers again whatever was not settled, and the
    /// inbox absorbs the copies) and opens a new one.
    pub(super) async fn answer<T>(
        &self,
        what: &'static str,
        op: impl Future<Output = T>,
    ) -> Option<T> {
        if self.given_up.is_cancelled() {
            return None;
        }
        if let Ok(answer) = crate::amqp::answered(what, self.broker_timeout, op).await {
            return Some(answer);
        }
        if !self.given_up.is_cancelled() {
            tracing::warn!(
                waited = %humantime::format_duration(self.broker_timeout),
                "RabbitMQ did not complete {what} in time (--broker-timeout); giving the connection up: what it did \
                 not settle is delivered again"
            );
            self.given_up.cancel();
        }
        None
    }

    /// Closes the consuming connection (the broker gives back what it did not settle) and the dead-letter one. The
    /// link is given up: work of it still in flight settles nothing more on it, and makes no more copies.
    pub(super) async fn close(&self, reason: &str) {
        self.given_up.cancel();
        tokio::join!(
            crate::amqp::close(&self.connection, reason),
            self.dead_letters.close(reason)
        );
    }

    /// Resolves once the link is given up.
    pub(super) async fn given_up(&self) {
        self.given_up.cancelled().await;
    }

    /// Resolves once the link is given up or its connection is seen lost (its state is looked at every second).
    pub(super) async fn lost(&self) {
        let mut check = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                () = self.given_up.cancelled() => return,
                _ = check.tick() => if self.is_lost() {
                    return;
                }
            }
        }
    }

    /// Whether the link is given up, or its connection or consuming channel lost, now. RabbitMQ closes the channel
    /// alone, the connection left up, when a delivery is held past its `consumer_timeout` (a database outage longer
    /// than it, the loop parked waiting for a free worker): its deliveries are given back then, and what is still in
    /// flight on the link can settle nothing and must copy nothing.
    pub(super) fn is_lost(&self) -> bool {
        self.given_up.is_cancelled()
            || !self.connection.status().connected()
            || !self.consume.status().connected()
    }
}

/// When this process last made sure of each partitioned topology (by the broker, the event exchange, the queue, the
/// partitions and the queue type), for the links of its other partitions.
static TOPOLOGY_MADE: std::sync::LazyLock<
    tokio::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
> = std::sync::LazyLock::new(Default::default);

/// How long a partitioned topology made sure of is taken as made by the other partitions' links.
const TOPOLOGY_FRESH_FOR: Duration = Duration::from_secs(30);

/// Opens the link a run reads `shared`'s queue (or its partition queues) on: a connection, the queue's topology
/// made sure of, a channel with the prefetch.
pub(super) async fn open_link<C: Consumer>(broker: &Broker, shared: &Shared<C>) -> Result<Link> {
    let name = format!("inboxctl consume {}", shared.inbox.consumer_type());
    // Each step bounded like any broker call: a node that takes the connection and then says nothing must not hold
    // the consumer, nor its stop. Not the whole: a partitioned topology of hundreds of queues is that many calls.
    let bound = shared.options.broker_timeout;
    let unanswered = |what: &str| crate::error::Error::BrokerUnavailable {
        url: broker.display_url(),
        reason: format!(
            "it did not {what} within {} (--broker-timeout)",
            humantime::format_duration(bound)
        ),
    };
    let connection = tokio::time::timeout(bound, async {
        crate::failpoint::hit_with("open-link", &shared.queue).await;
        broker.connect(&name).await
    })
    .await
    .map_err(|_| unanswered("set the connection up"))??;
    match &shared.options.partitions {
        None => {
            tokio::time::timeout(
                bound,
                topology::ensure_endpoint(
                    &connection,
                    &shared.options.event_exchange,
                    &shared.options.queue,
                    shared.options.queue_type,
                ),
            )
            .await
            .map_err(|_| unanswered("answer the queue's declaration"))??;
        }
        Some(p) => {
            // One link of the process makes sure of the whole partitioned topology — each link doing it was 2N
            // round trips a link, 2N² in all, at every start and reconnect: past `--broker-timeout` with hundreds of
            // partitions —, and the others, opened meanwhile or soon after, wait for it (as long as its steps, each
            // bounded, take) and take it as made. A
            // partition queue gone since fails its consumer's `basic.consume`, and the reconnect after
            // [`TOPOLOGY_FRESH_FOR`] makes sure of it all again.
            // Keyed on all that the declaration depends on: another `consume` of the process (through the library)
            // on the same queue's name with other partitions, another event exchange or broker makes sure of its own.
            let key = format!(
                "{}\u{0}{}\u{0}{}\u{0}{}\u{0}{}",
                broker.display_url(),
                shared.options.event_exchange,
                shared.options.queue,
                p.count,
                shared.options.queue_type.name()
            );
            let mut made = TOPOLOGY_MADE.lock().await;
            let fresh = made
                .get(&key)
                .is_some_and(|at| at.elapsed() < TOPOLOGY_FRESH_FOR);
            if !fresh {
                topology::ensure_partitioned_endpoint(
                    &connection,
                    &shared.options.event_exchange,
                    &shared.options.queue,
                    p.count,
                    shared.options.queue_type,
                    bound,
                )
                .await?;
                made.insert(key, std::time::Instant::now());
                tracing::debug!(
                    queue = %crate::sanitize::text(&shared.options.queue),
                    partitions = p.count,
                    "made sure of the partitioned topology"
                );
            }
        }
    }
    let consume = tokio::time::timeout(bound, async {
        let consume = connection.create_channel().await?;
        consume
            .basic_qos(shared.options.prefetch, BasicQosOptions::default())
            .await?;
        Ok::<_, lapin::Error>(consume)
    })
    .await
    .map_err(|_| unanswered("open the consuming channel"))??;
    Ok(Link {
        connection,
        consume,
        dead_letters: DeadLetters::new(
            broker,
            format!("{name} (dead letters)"),
            shared.options.queue_type,
        ),
        outstanding: Outstanding::default(),
        given_up: CancellationToken::new(),
        broker_timeout: shared.options.broker_timeout,
    })
}
