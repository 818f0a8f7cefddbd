//! The channels `replay` works through over one connection (a pass): one takes the dead-letter copies and settles
//! them, one republishes with publisher confirms, and one asks whether origin queues exist. Every call waits for its
//! answer at most the pass's bound ([`super::answered`]).

use std::collections::HashMap;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

use super::publish::{ConfirmChannel, PublishError, Routed};
use super::{answered, is_connection_lost, is_locked, is_not_found};
use crate::error::{Error, Result};

/// The channels of one pass.
pub struct Channels<'c> {
    connection: &'c Connection,
    /// Takes the dead-letter copies, and acknowledges them.
    inbound: Channel,
    /// Republishes, with publisher confirms.
    outbound: ConfirmChannel,
    probe: Probe<'c>,
    /// The last delivery tag held, to give everything held back at once.
    held: Option<u64>,
    /// How long a call may wait for the broker's answer (`--broker-timeout`).
    within: Duration,
}

impl<'c> Channels<'c> {
    /// Opens the pass's channels; each call on them waits for the broker's answer at most `within`.
    pub async fn open(connection: &'c Connection, within: Duration) -> Result<Self> {
        let inbound = answered("a new channel", within, connection.create_channel()).await??;
        let outbound = answered(
            "a new channel in confirm mode",
            within,
            ConfirmChannel::open(connection),
        )
        .await??;
        Ok(Self {
            connection,
            inbound,
            outbound,
            probe: Probe {
                connection,
                channel: None,
                known: HashMap::new(),
                within,
            },
            held: None,
            within,
        })
    }

    /// Takes the next message of `queue`, unacknowledged. The answer comes after every acknowledgement sent before it
    /// on this channel: those arrived.
    /// Whether another look (a cleanup's guard, `find`, `failures`, `top`'s detail) holds `queue` marked now: it may
    /// hold messages, which it gives back as it ends. A mark that cannot be read counts as one.
    pub async fn looked_at_elsewhere(&self, queue: &str) -> bool {
        answered(
            "a look for other looks' marks",
            self.within,
            super::markers::looks_at(self.connection, queue),
        )
        .await
        .map_or(true, |looks| looks.is_none_or(|n| n > 0))
    }

    pub async fn get(&self, queue: &str) -> Result<Option<Delivery>> {
        let get = self
            .inbound
            .basic_get(queue.into(), BasicGetOptions { no_ack: false });
        let got = answered("a get", self.within, get).await??;
        Ok(got.map(|message| message.delivery))
    }

    /// Keeps a delivery unacknowledged, to be given back in its place by [`Channels::finish`].
    pub fn hold(&mut self, delivery_tag: u64) {
        self.held = Some(delivery_tag);
    }

    pub async fn ack(&self, delivery_tag: u64) -> Result<()> {
        // A test closes the channel here, as the broker does when messages are held past its `consumer_timeout`.
        if crate::failpoint::armed("replay-channel-closed-before-ack", "") {
            let _ = answered(
                "a channel's close",
                self.within,
                self.inbound.close(200, "OK".into()),
            )
            .await;
        }
        let ack = self
            .inbound
            .basic_ack(delivery_tag, BasicAckOptions::default());
        answered("an ack", self.within, ack).await??;
        Ok(())
    }

    /// Whether `queue` exists, and is a queue to replay to; asked once per queue and pass.
    pub async fn destination(&mut self, queue: &str) -> Result<Destination> {
        self.probe.look(queue).await
    }

    /// `queue` turned out not to exist (a copy came back unroutable).
    pub fn queue_missing(&mut self, queue: &str) {
        self.probe
            .known
            .insert(queue.to_owned(), Destination::Missing);
    }

    /// Publishes a copy of `delivery` to `queue` through the default exchange and waits for the broker's confirm. The
    /// outer error is the connection's: lost, or not answering in time (the publish itself, which lapin holds while
    /// the broker blocks the connection, or the confirm).
    pub async fn republish(
        &self,
        delivery: &Delivery,
        queue: &str,
        properties: BasicProperties,
    ) -> Result<Result<Routed, PublishError>> {
        let publish = self.outbound.publish("", queue, &delivery.data, properties);
        let pending = answered("a publish", self.within, publish).await??;
        answered("a copy's confirm", self.within, pending.confirmed()).await
    }

    /// Gives back everything held and not acknowledged, at once (the broker puts each back in its place, in order),
    /// and closes the channels. `true` when the close was answered after every acknowledgement sent: they all
    /// arrived. A lost connection is an error; another failure to close is not.
    pub async fn finish(self) -> Result<bool> {
        // A test closes the channel here, as the broker may just after the last acknowledgement.
        if crate::failpoint::armed("replay-channel-closed-before-finish", "") {
            let _ = answered(
                "a channel's close",
                self.within,
                self.inbound.close(200, "OK".into()),
            )
            .await;
        }
        if let Some(last) = self.held {
            let nack = self.inbound.basic_nack(
                last,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            );
            answered("the nack of what was held", self.within, nack).await??;
        }
        let close = self.inbound.close(200, "OK".into());
        let settled = match answered("a channel's close", self.within, close).await? {
            Ok(()) => true,
            Err(e) => {
                let e = Error::from(e);
                if is_connection_lost(self.connection, &e) {
                    return Err(e);
                }
                false
            }
        };
        // Whether these two close in time changes nothing: they hold no message.
        let _ = answered("a channel's close", self.within, self.outbound.close()).await;
        let _ = answered("a channel's close", self.within, self.probe.close()).await;
        Ok(settled)
    }
}

/// What a look at a queue a copy would go to found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    Queue,
    Missing,
    /// Another connection's exclusive queue (a client's reply queue): the broker would route the copy there, and it
    /// would be gone with that connection, its dead-letter copy acknowledged.
    Exclusive,
}

/// Whether origin queues exist, asked once per queue and pass (a passive declare, which needs no permission).
struct Probe<'c> {
    connection: &'c Connection,
    /// A failed passive declare closes its channel: a new one is made for the next.
    channel: Option<Channel>,
    known: HashMap<String, Destination>,
    within: Duration,
}

impl Probe<'_> {
    async fn look(&mut self, queue: &str) -> Result<Destination> {
        if let Some(&known) = self.known.get(queue) {
            return Ok(known);
        }
        let channel = match self.channel.take() {
            Some(channel) if channel.status().connected() => channel,
            _ => {
                answered(
                    "a new channel",
                    self.within,
                    self.connection.create_channel(),
                )
                .await??
            }
        };
        let declare = channel.queue_declare(
            queue.into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        );
        let found = match answered("a look at a queue", self.within, declare).await? {
            Ok(_) => {
                self.channel = Some(channel);
                Destination::Queue
            }
            Err(e) if is_not_found(&e) => Destination::Missing,
            Err(e) if is_locked(&e) => Destination::Exclusive,
            // Another refusal is not an absence: the republish tells, its copy coming back unroutable if the queue is
            // missing after all.
            Err(e) if e.is_amqp_soft_error() => Destination::Queue,
            Err(e) => return Err(e.into()),
        };
        self.known.insert(queue.to_owned(), found);
        Ok(found)
    }

    async fn close(self) {
        if let Some(channel) = self.channel {
            let _ = channel.close(200, "OK".into()).await;
        }
    }
}
