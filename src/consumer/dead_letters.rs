//! The dead-letter side of a consuming connection: how a copy of a message moved aside ([`move_aside`](super::move_aside))
//! is published, with publisher confirms, and waited for.
//!
//! Copies go out on a connection of their own, opened on the first one. A node in a memory or disk alarm blocks every
//! connection that publishes until the alarm ends, and lapin then writes nothing more on it, acks included: were the
//! copies sent on the consuming connection, the first failure during an alarm would stop every ack, and the
//! connection could not even be closed. On its own connection a copy may wait for the alarm to end, its message
//! unacknowledged, while the other messages are processed and acknowledged as usual; how many may wait so is
//! bounded ([`AlarmWaits`]), and the others give their message back.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use lapin::message::Delivery;
use lapin::options::ConfirmSelectOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionStatus};
use tokio_util::sync::CancellationToken;

use super::alarm::{AlarmWait, AlarmWaits};
use super::link::Link;
use super::lock;
use crate::amqp::Broker;
use crate::amqp::dead_letter;
use crate::amqp::publish::{self, PublishError, Routed};
use crate::amqp::tail;
use crate::amqp::topology;
use crate::error::Error;
use crate::failpoint;

/// Why a copy was not published; either way the original stays where it is, unacknowledged.
#[derive(Debug)]
pub(super) enum CopyError {
    /// The copy can never be made (its own headers are too large for a frame): the message is held, not sent back
    /// round.
    Impossible(String),
    /// The broker refused it or could not take it now (a nack, no queue to route to even after declaring one again,
    /// the channel or the connection gone): to be tried again later.
    Refused(String),
    /// RabbitMQ blocks the dead-letter connection (an alarm) and the copy did not wait for the alarm to end: to be
    /// tried again later, as `Refused`, but said less often, since it comes round for as long as the alarm lasts.
    GivenBackInAnAlarm,
}

/// Where a copy goes.
#[derive(Clone, Copy)]
pub(super) enum To<'a> {
    /// A dead-letter queue: the exchange of that name, declared with its queue if it was not since the consuming
    /// connection was opened; the copy's properties as [`dead_letter::copy_properties`] makes them.
    DeadLetter(&'a str),
    /// The tail of the consumed queue itself, through the default exchange, which routes to that queue and no other
    /// (the queue's own exchange may be bound to others: an audit queue would get a copy each round): the message as
    /// it came, with the headers given. Nothing is declared: the queue is there, with arguments of its own.
    Tail(&'a str),
}

impl To<'_> {
    fn name(&self) -> &str {
        match self {
            To::DeadLetter(name) | To::Tail(name) => name,
        }
    }
}

/// What one publish of a copy came to.
enum Sent {
    Confirmed,
    /// The broker routed it to no queue (`mandatory`): the destination queue or its binding is gone.
    Returned,
    Nacked,
    /// The channel failed (the destination exchange is gone, or something else closed it).
    Failed(Error),
}

/// The dead-letter side of one consuming connection: a publishing connection of its own.
pub(super) struct DeadLetters {
    broker: Broker,
    /// The name the publishing connection is made with, for `rabbitmqctl list_connections`.
    name: String,
    /// The publishing connection and its confirm-mode channel, opened on the first copy and again after a failure.
    publishing: tokio::sync::Mutex<Option<Publishing>>,
    /// The publishing connection's state, read without waiting for `publishing`.
    status: std::sync::Mutex<Option<ConnectionStatus>>,
    /// Set once the consuming connection is closed: no connection is opened any more.
    closed: AtomicBool,
    /// Destinations declared since this consuming connection was opened.
    declared: std::sync::Mutex<HashSet<String>>,
    /// Held by the copy in flight: one at a time on the channel. lapin hands a returned message to whichever confirm
    /// on the channel completes next, not to the publish it belongs to; with two copies in flight, an unroutable
    /// copy's return could be taken for the other's, and the unroutable copy taken for confirmed: its message
    /// acknowledged, and lost.
    sending: tokio::sync::Mutex<()>,
    /// Set when a copy was abandoned before its answer (given back in an alarm, say): its confirm or its return may
    /// still come on the channel, to be taken for the next copy's, so the next copy opens another channel.
    abandoned: AtomicBool,
    /// The user inboxctl publishes as: a copy may carry no other `user_id`.
    publisher: String,
    /// What a dead-letter queue that does not exist yet is declared as (the consumed queue's type).
    queue_type: topology::QueueType,
}

/// How long closing the publishing connection waits for a copy that holds it.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A copy in flight: dropped before [`Unanswered::answered`] (its future dropped: given back, a stop), it marks the
/// channel abandoned.
struct Unanswered<'a>(Option<&'a AtomicBool>);

impl Unanswered<'_> {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(abandoned) = self.0.take() {
            abandoned.store(true, Ordering::SeqCst);
        }
    }
}

/// When a copy had its turn on the dead-letter channel, and the connection it went out on.
#[derive(Default)]
pub(super) struct Turn {
    at: OnceLock<Instant>,
    on: OnceLock<Arc<Connection>>,
}

struct Publishing {
    connection: Arc<Connection>,
    channel: Option<Channel>,
}

impl DeadLetters {
    pub(super) fn new(broker: &Broker, name: String, queue_type: topology::QueueType) -> Self {
        Self {
            publisher: broker.username().to_owned(),
            broker: broker.clone(),
            name,
            publishing: tokio::sync::Mutex::new(None),
            status: std::sync::Mutex::new(None),
            closed: AtomicBool::new(false),
            declared: std::sync::Mutex::new(HashSet::new()),
            sending: tokio::sync::Mutex::new(()),
            abandoned: AtomicBool::new(false),
            queue_type,
        }
    }

    /// Publishes the delivery's body and properties, with `headers`, to the exchange `destination` and waits for the
    /// broker's confirm. A copy that comes back unroutable, or whose channel failed, is tried once more after
    /// declaring the destination again.
    ///
    /// It waits its turn first (one copy in flight at a time) and notes in `turn` when it has it, and the connection it
    /// goes out on: a copy still waiting when its bound passes was held up by the copies before it, not by the broker.
    pub(super) async fn publish(
        &self,
        to: To<'_>,
        delivery: &Delivery,
        headers: FieldTable,
        turn: &Turn,
        lost: impl Fn() -> bool,
    ) -> Result<(), CopyError> {
        let _one_at_a_time = self.sending.lock().await;
        // Looked at again once its turn has come: a copy that waited behind others while the consuming connection
        // was lost would be a second one when its message comes back on the next.
        if lost() {
            return Err(CopyError::Refused(
                "the consuming connection was lost while the copy waited its turn; the message comes back on the \
                 next one"
                    .to_owned(),
            ));
        }
        let _ = turn.at.set(Instant::now());
        let connection = self
            .connection()
            .await
            .map_err(|e| CopyError::Refused(crate::redact::text(&e.for_a_retry())))?;
        let _ = turn.on.set(Arc::clone(&connection));
        let frame_max = usize::try_from(connection.configuration().frame_max()).unwrap_or(0);
        let properties = match to {
            To::DeadLetter(_) => dead_letter::copy_properties(
                &delivery.properties,
                headers,
                &self.publisher,
                frame_max,
            )
            .map_err(|e| CopyError::Impossible(e.to_string()))?,
            To::Tail(_) => {
                // Published again as it is, or not at all: a copy that would not be the message goes back the usual
                // way.
                if let Some(why) =
                    crate::amqp::copy::uncopyable(&delivery.properties, &self.publisher)
                {
                    return Err(CopyError::Impossible(why));
                }
                let properties = tail::properties(&delivery.properties, headers);
                if crate::amqp::limits::content_header_len(&properties) > frame_max {
                    return Err(CopyError::Impossible(
                        "the message with its given-back mark is too large for a frame".to_owned(),
                    ));
                }
                properties
            }
        };
        let unanswered = Unanswered(Some(&self.abandoned));
        let published = self
            .publish_on(&connection, to, delivery, &properties)
            .await;
        unanswered.answered();
        published
    }

    /// [`DeadLetters::publish`] on `connection`, the copy's properties made.
    async fn publish_on(
        &self,
        connection: &Connection,
        to: To<'_>,
        delivery: &Delivery,
        properties: &BasicProperties,
    ) -> Result<(), CopyError> {
        let label = delivery.properties.message_id().as_ref();
        failpoint::hit_with("dead-letter-publish", label.map_or("", |id| id.as_str())).await;
        let destination = to.name();
        let mut last = String::new();
        // The consumed queue is not declared again: a message it does not take goes back the usual way.
        let tries = if matches!(to, To::Tail(_)) { 1 } else { 2 };
        for attempt in 0..tries {
            if attempt > 0 {
                tracing::warn!(
                    reason = %last,
                    "the dead-letter copy to {destination} did not go through; declaring {destination} again and retrying"
                );
                self.forget(destination);
            }
            match self.send(connection, to, delivery, properties).await {
                Sent::Confirmed => return Ok(()),
                Sent::Nacked => {
                    return Err(CopyError::Refused(format!(
                        "the broker refused the copy to {destination} (a nack: the queue full, say)"
                    )));
                }
                Sent::Returned => {
                    last = format!("{destination} routes to no queue; the copy was returned");
                }
                Sent::Failed(e) => last = crate::redact::text(&e.to_string()),
            }
            if !connection.status().connected() {
                break;
            }
        }
        Err(CopyError::Refused(last))
    }

    async fn send(
        &self,
        connection: &Connection,
        to: To<'_>,
        delivery: &Delivery,
        properties: &BasicProperties,
    ) -> Sent {
        let channel = match self.ready(connection, to).await {
            Ok(channel) => channel,
            Err(e) => return Sent::Failed(e),
        };
        let (exchange, routing_key) = match to {
            To::DeadLetter(destination) => (destination, ""),
            To::Tail(queue) => ("", queue),
        };
        let published = publish::publish_confirmed(
            &channel,
            exchange,
            routing_key,
            &delivery.data,
            properties.clone(),
        )
        .await;
        match published {
            Ok(Routed::Queued) => Sent::Confirmed,
            Ok(Routed::Returned) => Sent::Returned,
            Err(PublishError::Nacked) => Sent::Nacked,
            Err(PublishError::ConfirmsOff) => {
                Sent::Failed(Error::Topology("publisher confirms are off".to_owned()))
            }
            Err(PublishError::Broker(e)) => Sent::Failed(e.into()),
        }
    }

    /// The publishing connection, opened if there is none or it was lost.
    async fn connection(&self) -> crate::Result<Arc<Connection>> {
        let mut slot = self.publishing.lock().await;
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Topology(
                "the consuming connection is closed: no more dead-letter copies for it".to_owned(),
            ));
        }
        if let Some(publishing) = slot.as_ref().filter(|p| p.connection.status().connected()) {
            return Ok(Arc::clone(&publishing.connection));
        }
        let connection = Arc::new(self.broker.connect(&self.name).await?);
        if self.closed.load(Ordering::SeqCst) {
            // Closed while connecting (the close waits for the slot only so long).
            crate::amqp::close(&connection, "closed").await;
            return Err(Error::Topology(
                "the consuming connection is closed: no more dead-letter copies for it".to_owned(),
            ));
        }
        *lock(&self.status) = Some(connection.status().clone());
        *slot = Some(Publishing {
            connection: Arc::clone(&connection),
            channel: None,
        });
        Ok(connection)
    }

    /// The copy channel, opened if there is none or it failed; a dead-letter destination declared if it was not since
    /// the consuming connection was opened.
    async fn ready(&self, connection: &Connection, to: To<'_>) -> crate::Result<Channel> {
        if let To::DeadLetter(destination) = to
            && !self.is_declared(destination)
        {
            topology::ensure_dead_letter_queue(connection, destination, self.queue_type).await?;
            self.declared_now(destination);
        }
        let mut slot = self.publishing.lock().await;
        let Some(publishing) = slot
            .as_mut()
            .filter(|p| std::ptr::eq(Arc::as_ptr(&p.connection), connection))
        else {
            return Err(Error::Topology(
                "the dead-letter connection was given up meanwhile".to_owned(),
            ));
        };
        if self.abandoned.swap(false, Ordering::SeqCst)
            && let Some(old) = publishing.channel.take()
        {
            // Closed aside: on a connection the broker blocks, even the close waits for the alarm to end.
            tokio::spawn(async move { drop(old.close(200, "replaced".into()).await) });
        }
        if let Some(channel) = publishing
            .channel
            .as_ref()
            .filter(|c| c.status().connected())
        {
            return Ok(channel.clone());
        }
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        publishing.channel = Some(channel.clone());
        Ok(channel)
    }

    /// Whether RabbitMQ blocks the publishing connection (a memory or disk alarm).
    fn blocked(&self) -> bool {
        lock(&self.status)
            .as_ref()
            .is_some_and(|s| s.connected() && s.blocked())
    }

    /// Closes the publishing connection `on`, which did not answer, unless another replaced it meanwhile; the next
    /// copy opens another.
    async fn give_up(&self, on: &Connection) {
        self.close_connection("given up", Some(on)).await;
    }

    /// Closes the publishing connection, if it is open, for good: the consuming connection is closed.
    pub(super) async fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::SeqCst);
        self.close_connection(reason, None).await;
    }

    /// Closes the publishing connection (`only` that one, if given). A copy that holds the slot while it waits on the
    /// broker holds the close no longer than the close's own bound.
    async fn close_connection(&self, reason: &str, only: Option<&Connection>) {
        let Ok(mut slot) = tokio::time::timeout(CLOSE_WAIT, self.publishing.lock()).await else {
            return;
        };
        let this =
            |p: &Publishing| only.is_none_or(|c| std::ptr::eq(Arc::as_ptr(&p.connection), c));
        if let Some(publishing) = slot.take_if(|p| this(p)) {
            drop(slot);
            crate::amqp::close(&publishing.connection, reason).await;
        }
    }

    fn is_declared(&self, destination: &str) -> bool {
        lock(&self.declared).contains(destination)
    }

    fn declared_now(&self, destination: &str) {
        lock(&self.declared).insert(destination.to_owned());
    }

    fn forget(&self, destination: &str) {
        lock(&self.declared).remove(destination);
    }
}

impl Link {
    /// Publishes a dead-letter copy of `delivery` to `destination` and waits for its confirm.
    ///
    /// While RabbitMQ blocks the publishing connection (an alarm), the copy may wait for the alarm to end, or for a
    /// stop, or for the consuming connection to be lost, its message unacknowledged: if it has a place among the
    /// copies allowed to wait ([`AlarmWaits`]) and is not the batch worker's own ([`in_a_batch`](super::alarm::in_a_batch)). Otherwise it gives
    /// its message back. Not blocked, the wait is bounded by the broker timeout, past which the publishing connection
    /// is given up (see [`Link::answer`]) and the message goes back to its queue.
    pub(super) async fn copy(
        &self,
        to: To<'_>,
        delivery: &Delivery,
        headers: FieldTable,
        shutdown: &CancellationToken,
        waits: &AlarmWaits,
    ) -> Result<(), CopyError> {
        let place = self.admit(waits)?;
        let turn = Turn::default();
        let published = Box::pin(
            self.dead_letters
                .publish(to, delivery, headers, &turn, || self.is_lost()),
        );
        match self.confirmed(published, &turn.at, place, waits, shutdown).await {
            Waited::Answered(copied) => copied,
            Waited::GivenBack => Err(CopyError::GivenBackInAnAlarm),
            Waited::Behind => Err(CopyError::Refused(
                "the dead-letter copies before it took longer than --broker-timeout; the message goes back to its \
                 queue"
                    .to_owned(),
            )),
            Waited::Silent => {
                tracing::warn!(
                    waited = %humantime::format_duration(self.broker_timeout),
                    "RabbitMQ did not complete a dead-letter copy in time (--broker-timeout); giving the dead-letter \
                     connection up: the message goes back to its queue"
                );
                if let Some(on) = turn.on.get() {
                    self.dead_letters.give_up(on).await;
                }
                Err(CopyError::Refused(
                    "RabbitMQ did not confirm the copy in time; its connection is given up"
                        .to_owned(),
                ))
            }
        }
    }

    /// Whether a copy may be sent at all, and, the dead-letter connection known blocked already, its place among the
    /// copies waiting out the alarm. A copy that may not wait then is not sent: lapin would hold it, and send it once
    /// the alarm ends, when its message may have been given back.
    fn admit<'w>(&self, waits: &'w AlarmWaits) -> Result<Option<AlarmWait<'w>>, CopyError> {
        if self.is_lost() {
            // The message's ack could not go out: it comes back on the next connection, and a copy now would be a
            // second one then.
            return Err(CopyError::Refused(
                "the consuming connection was lost; the message comes back on the next one"
                    .to_owned(),
            ));
        }
        if !self.dead_letters.blocked() {
            return Ok(None);
        }
        match waits.enter() {
            Some(place) => Ok(Some(place)),
            None => Err(CopyError::GivenBackInAnAlarm),
        }
    }

    /// Waits for `published` (the copy and its confirm, once it has its `turn`): a bound at a time while the
    /// connection is not blocked — the last a whole bound from its turn —, and
    /// for as long as the alarm lasts once the copy has a place among those waiting (and a whole bound more after the
    /// block ends, for the confirm to come).
    async fn confirmed<'w, F: Future<Output = Result<(), CopyError>>>(
        &self,
        mut published: std::pin::Pin<Box<F>>,
        turn: &OnceLock<Instant>,
        mut place: Option<AlarmWait<'w>>,
        waits: &'w AlarmWaits,
        shutdown: &CancellationToken,
    ) -> Waited {
        let mut blocked = place.is_some();
        loop {
            let bounded = crate::amqp::answered(
                "a dead-letter copy",
                self.broker_timeout,
                published.as_mut(),
            );
            let answer = if place.is_some() {
                // The answer first: a confirm that came with a stop or a lost connection is the copy made, not
                // refused (its message given back would be in the error queue and its own queue both).
                tokio::select! {
                    biased;
                    answer = bounded => answer,
                    () = shutdown.cancelled() => return Waited::Answered(Err(CopyError::Refused(
                        "a stop came while RabbitMQ blocked the copy (an alarm)".to_owned()))),
                    () = self.lost() => return Waited::Answered(Err(CopyError::Refused(
                        "the consuming connection was lost while RabbitMQ blocked the copy (an alarm)"
                            .to_owned()))),
                }
            } else {
                bounded.await
            };
            if let Ok(copied) = answer {
                return Waited::Answered(copied);
            }
            let was_blocked = std::mem::replace(&mut blocked, self.dead_letters.blocked());
            if !blocked && !was_blocked {
                match turn.get() {
                    None => return Waited::Behind,
                    // Its turn came late in the bound: it gets a whole bound of its own.
                    Some(at) if at.elapsed() < self.broker_timeout => continue,
                    Some(_) => return Waited::Silent,
                }
            }
            if place.is_none() {
                place = waits.enter();
                if place.is_none() {
                    return Waited::GivenBack;
                }
            }
        }
    }
}

/// How the wait for a copy's confirm ended. Either way the copy's future is dropped before anything else is done: a
/// copy still holding the connection's slot would hold its close.
enum Waited {
    Answered(Result<(), CopyError>),
    /// Blocked, and no place to wait.
    GivenBack,
    /// Not blocked, and no answer within a bound from its turn.
    Silent,
    /// Not blocked, and still waiting for its turn behind other copies when the bound passed.
    Behind,
}
