//! Moving a message aside: to `<queue>_error` (unreadable, failed too often, poison, a conflict) or `<queue>_skipped`
//! (a type the consumer does not handle), its copy published with publisher confirms on a channel of its own, the
//! destination declared on first use — and again when it was deleted under a running consumer, so that a deleted
//! error queue does not turn every later failure into a message sent back round until a restart. The original is
//! acknowledged only once the copy is confirmed; a copy the broker refuses leaves it on its queue.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use lapin::message::Delivery;
use lapin::options::ConfirmSelectOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use uuid::Uuid;

use super::Consumer;
use super::bookkeeping::record_event;
use super::dispatch::{Disposition, Ready};
use super::run::Link;
use super::{HOLD_IMPOSSIBLE, OUTAGE_DELAY_MAX, Shared, lock, logged};
use crate::amqp::dead_letter::{self, Fault};
use crate::amqp::envelope::{Incoming, Unreadable};
use crate::amqp::publish::{self, PublishError, Routed};
use crate::amqp::topology;
use crate::error::Error;

/// Why a copy was not published; either way the original stays where it is, unacknowledged.
#[derive(Debug)]
pub(super) enum CopyError {
    /// The copy can never be made (its own headers are too large for a frame): the message is held, not sent back
    /// round.
    Impossible(String),
    /// The broker refused it or could not take it now (a nack, no queue to route to even after declaring one again,
    /// the channel or the connection gone): to be tried again later.
    Refused(String),
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

/// The dead-letter side of one broker connection.
pub(super) struct DeadLetters {
    /// The confirm-mode channel copies go out on; opened again after a channel error.
    channel: tokio::sync::Mutex<Option<Channel>>,
    /// Destinations declared on this connection.
    declared: std::sync::Mutex<HashSet<String>>,
    /// The user inboxctl publishes as: a copy may carry no other `user_id`.
    publisher: String,
    /// What a dead-letter queue that does not exist yet is declared as (the consumed queue's type).
    queue_type: topology::QueueType,
}

impl DeadLetters {
    pub(super) fn new(publisher: String, queue_type: topology::QueueType) -> Self {
        Self {
            channel: tokio::sync::Mutex::new(None),
            declared: std::sync::Mutex::new(HashSet::new()),
            publisher,
            queue_type,
        }
    }

    /// Publishes the delivery's body and properties, with `headers`, to the exchange `destination` and waits for the
    /// broker's confirm. A copy that comes back unroutable, or whose channel failed, is tried once more after
    /// declaring the destination again.
    pub(super) async fn publish(
        &self,
        connection: &Connection,
        destination: &str,
        delivery: &Delivery,
        headers: FieldTable,
    ) -> Result<(), CopyError> {
        let frame_max = usize::try_from(connection.configuration().frame_max()).unwrap_or(0);
        let properties =
            dead_letter::copy_properties(&delivery.properties, headers, &self.publisher, frame_max)
                .map_err(|e| CopyError::Impossible(e.to_string()))?;
        let mut last = String::new();
        for attempt in 0..2 {
            if attempt > 0 {
                tracing::warn!(
                    reason = %last,
                    "the dead-letter copy to {destination} did not go through; declaring {destination} again and retrying"
                );
                self.forget(destination);
            }
            match self
                .send(connection, destination, delivery, &properties)
                .await
            {
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
        destination: &str,
        delivery: &Delivery,
        properties: &BasicProperties,
    ) -> Sent {
        let channel = match self.ready(connection, destination).await {
            Ok(channel) => channel,
            Err(e) => return Sent::Failed(e),
        };
        let published = publish::publish_confirmed(
            &channel,
            destination,
            "",
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

    /// The copy channel, opened if there is none or it failed; `destination` declared if it was not on this connection.
    async fn ready(&self, connection: &Connection, destination: &str) -> crate::Result<Channel> {
        if !self.is_declared(destination) {
            topology::ensure_dead_letter_queue(connection, destination, self.queue_type).await?;
            self.declared_now(destination);
        }
        let mut slot = self.channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *slot = Some(channel.clone());
        Ok(channel)
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
    /// Publishes a dead-letter copy of `delivery` to `destination` and waits for its confirm, for at most the broker
    /// timeout (see [`Link::answer`]).
    async fn copy(
        &self,
        destination: &str,
        delivery: &Delivery,
        headers: FieldTable,
    ) -> Result<(), CopyError> {
        let published = self
            .dead_letters
            .publish(&self.connection, destination, delivery, headers);
        self.answer("a dead-letter copy", published)
            .await
            .unwrap_or_else(|| {
                Err(CopyError::Refused(
                    "RabbitMQ did not confirm the copy in time; the connection is given up"
                        .to_owned(),
                ))
            })
    }
}

pub(super) async fn skip<C: Consumer>(
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
    let moved = link.copy(&destination, delivery, headers).await;
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
pub(super) type FaultText = (&'static str, String, String);

/// The exception type of a conflict's copy. A conflict moved aside is counted once, as a conflict (the claim recorded
/// it), not again as a dead-lettering.
pub(super) const CONFLICT_FAULT: &str = "inboxctl::MessageIdConflict";

pub(super) fn unreadable_fault(unreadable: &Unreadable) -> FaultText {
    (
        "inboxctl::UnreadableMessage",
        unreadable.to_string(),
        unreadable.to_string(),
    )
}

/// Moves a message that could be read to the error queue.
pub(super) async fn error_queue<C: Consumer>(
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

pub(super) async fn dead_letter_error<C: Consumer>(
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
    let moved = link.copy(&destination, delivery, headers).await;
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
pub(super) fn copy_refused(
    message_id: Option<Uuid>,
    destination: &str,
    error: CopyError,
) -> Disposition {
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
