//! Publishing a message that must not be lost: with `mandatory` set (a message no queue receives comes back rather
//! than vanishing) on a channel in confirm mode, and read back from the broker's confirm. The one way inboxctl sends
//! such a message: a dead-letter copy, a replayed copy, a published parcel.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};

/// Where a confirmed message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed {
    /// To at least one queue.
    Queued,
    /// To none: the broker returned it (`mandatory`), e.g. the queue or its binding does not exist.
    Returned,
}

/// Why a message is not known to be with the broker.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker refused it (a queue full with `x-overflow=reject-publish`, an internal error).
    #[error("the broker refused the message (a nack)")]
    Nacked,
    /// The channel is not in confirm mode: nothing tells whether the broker has it.
    #[error("publisher confirms are off on this channel")]
    ConfirmsOff,
    /// The channel or the connection failed: closed by the broker (with its reason) or lost.
    #[error(transparent)]
    Broker(#[from] lapin::Error),
}

/// Hands `body` with `properties` to the broker for `exchange` and `routing_key`, `mandatory`; the confirm is waited
/// for with [`confirmed`] (a publisher may keep several in flight).
pub async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<PublisherConfirm, lapin::Error> {
    channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await
}

/// Waits for a published message's confirm and says what it means.
pub async fn confirmed(confirm: PublisherConfirm) -> Result<Routed, PublishError> {
    match confirm.await? {
        Confirmation::Ack(None) => Ok(Routed::Queued),
        Confirmation::Ack(Some(_)) => Ok(Routed::Returned),
        Confirmation::Nack(_) => Err(PublishError::Nacked),
        Confirmation::NotRequested => Err(PublishError::ConfirmsOff),
    }
}

/// [`publish`], then [`confirmed`].
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<Routed, PublishError> {
    confirmed(publish(channel, exchange, routing_key, body, properties).await?).await
}

/// A channel in confirm mode, for a publisher that keeps several messages in flight.
pub struct ConfirmChannel(Channel);

impl ConfirmChannel {
    /// A new channel of `connection`, in confirm mode.
    pub async fn open(connection: &Connection) -> crate::error::Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self(channel))
    }

    /// [`publish`] on this channel; the confirm is waited for with [`Pending::confirmed`].
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> crate::error::Result<Pending> {
        Ok(Pending(
            publish(&self.0, exchange, routing_key, body, properties).await?,
        ))
    }

    /// [`publish_confirmed`] on this channel.
    pub async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<Routed, PublishError> {
        publish_confirmed(&self.0, exchange, routing_key, body, properties).await
    }

    pub async fn close(self) {
        let _ = self.0.close(200, "OK".into()).await;
    }
}

/// A published message whose confirm was not waited for yet.
pub struct Pending(PublisherConfirm);

impl Pending {
    /// Waits for the confirm and says what it means.
    pub async fn confirmed(self) -> Result<Routed, PublishError> {
        confirmed(self.0).await
    }

    /// Where the message went if the broker's ack had arrived already (looked at once, without waiting); `None` when
    /// it had not, or was not an ack.
    pub async fn acked_already(self) -> Option<Routed> {
        match tokio::time::timeout(std::time::Duration::ZERO, confirmed(self.0)).await {
            Ok(Ok(routed)) => Some(routed),
            _ => None,
        }
    }
}
