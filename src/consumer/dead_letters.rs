//! Moving a message aside: its dead-letter copy (`<queue>_error`, `<queue>_skipped`) published with publisher
//! confirms on a channel of its own, the destination declared on first use — and again when it was deleted under a
//! running consumer, so that a deleted error queue does not turn every later failure into a message sent back
//! round until a restart.

use std::collections::HashSet;

use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use crate::amqp::{dead_letter, topology};
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
}

impl DeadLetters {
    pub(super) fn new(publisher: String) -> Self {
        Self {
            channel: tokio::sync::Mutex::new(None),
            declared: std::sync::Mutex::new(HashSet::new()),
            publisher,
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
        let published = channel
            .basic_publish(
                destination.into(),
                "".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties.clone(),
            )
            .await;
        let confirm = match published {
            Ok(confirm) => confirm.await,
            Err(e) => Err(e),
        };
        match confirm {
            Ok(Confirmation::Ack(None)) => Sent::Confirmed,
            Ok(Confirmation::Ack(Some(_))) => Sent::Returned,
            Ok(Confirmation::Nack(_)) => Sent::Nacked,
            Ok(Confirmation::NotRequested) => {
                Sent::Failed(Error::Topology("publisher confirms are off".to_owned()))
            }
            Err(e) => Sent::Failed(e.into()),
        }
    }

    /// The copy channel, opened if there is none or it failed; `destination` declared if it was not on this connection.
    async fn ready(&self, connection: &Connection, destination: &str) -> crate::Result<Channel> {
        if !self.is_declared(destination) {
            topology::ensure_dead_letter_queue(connection, destination).await?;
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

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
