//! Losing the connection and making it again: the one way `publish` and `replay` go on after the broker restarted
//! or the network broke (the consumer keeps its own link, since it also waits for PostgreSQL).

use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::Broker;
use crate::backoff::{Backoff, sleep_or_cancel};
use crate::error::{Error, Result};

/// A publisher or a replay that loses its connection this many times in a row without getting anything done in
/// between (a connection that flaps, an error that ends every connection) stops rather than trying forever.
pub const MAX_FRUITLESS_RECONNECTS: u32 = 5;

impl Broker {
    /// Connects again after a lost connection: tries with a backoff (0.1 s doubling to 5 s) for up to `within`, then
    /// gives up with the last reason (at once, without a try, when `within` is zero; and when `shutdown` is
    /// cancelled). Each failed try is logged.
    pub async fn reconnect(
        &self,
        name: &str,
        within: Duration,
        shutdown: Option<&tokio_util::sync::CancellationToken>,
    ) -> Result<Connection> {
        let deadline = tokio::time::Instant::now() + within;
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        if within.is_zero() {
            return Err(Error::BrokerUnavailable {
                url: self.display_url(),
                reason: "the connection was lost".to_owned(),
            });
        }
        let stop = shutdown.cloned().unwrap_or_default();
        loop {
            let attempt = tokio::select! {
                () = stop.cancelled() => Err(Error::BrokerUnavailable {
                    url: self.display_url(),
                    reason: "interrupted while connecting again".to_owned(),
                }),
                result = self.connect(name) => result,
            };
            match attempt {
                Ok(connection) => {
                    tracing::info!(url = %self.display_url(), "connected to RabbitMQ again");
                    return Ok(connection);
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    if tokio::time::Instant::now() + delay > deadline || stop.is_cancelled() {
                        return Err(e);
                    }
                    tracing::warn!(error = %e.for_a_retry(), retry_in = ?delay, "RabbitMQ unavailable");
                    if sleep_or_cancel(delay, &stop).await {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// Closes a connection, waiting at most 2 s for the broker's answer: on a connection that is dead without lapin having
/// noticed yet (a node stopped under it), `close` would wait for its answer for ever.
pub async fn close(connection: &Connection, reason: &str) {
    let closing = connection.close(200, reason.into());
    if tokio::time::timeout(Duration::from_secs(2), closing)
        .await
        .is_err()
    {
        tracing::debug!("RabbitMQ did not answer the close within 2 s; the connection is given up");
    }
}

/// Whether `error` came from losing `connection` itself (the broker stopped, the network broke), as opposed to the
/// broker refusing something on a channel (an exchange that does not exist, a permission): the first is worth a
/// reconnect, the second is not.
pub fn is_connection_lost(connection: &Connection, error: &Error) -> bool {
    if !connection.status().connected() {
        return true;
    }
    match error {
        Error::Broker(super::BrokerError(e)) => {
            e.is_io_error()
                || e.is_amqp_hard_error()
                || matches!(
                    e.kind(),
                    lapin::ErrorKind::InvalidConnectionState(_)
                        | lapin::ErrorKind::MissingHeartbeatError
                )
        }
        Error::BrokerUnavailable { .. } | Error::BrokerSilent { .. } => true,
        _ => false,
    }
}

/// Whether `error` is a call not answered in time on a connection the broker blocks: a memory or disk alarm, in which
/// RabbitMQ holds the publishes of every connection that publishes until the alarm ends. lapin then writes nothing
/// more on it, not even a close, so the connection cannot be given up and what it holds stays held: connecting again
/// would only leave more such connections behind. Such an operation stops instead; the process's exit closes the
/// socket, and the broker takes what it held back once the alarm ends.
pub fn is_blocked(connection: &Connection, error: &Error) -> bool {
    // lapin clears `blocked` only when it reconnects: a connection that failed while blocked still says so, and is
    // given up as any lost one.
    let status = connection.status();
    matches!(error, Error::BrokerSilent { .. }) && status.connected() && status.blocked()
}

/// What an operation stopped by [`is_blocked`] says after the error.
pub const BLOCKED_HINT: &str = "RabbitMQ is blocking this connection's publishes (a memory or disk alarm: `rabbitmqctl \
     status` shows it); what the connection holds goes back to its queue once the alarm ends";

/// Why a [`Link`] stopped connecting again.
#[derive(Debug)]
pub enum GaveUp {
    /// The connection was lost this many times in a row without progress in between.
    Fruitless(u32),
    /// The broker did not come back in time (or the run was stopped meanwhile): the last reason.
    NotBack(Error),
}

/// The connection an operation works over, made again when it is lost: the caller's first connection, then one of
/// its own after each loss (closed when the next is made, and by [`Link::close`]).
pub struct Link<'a> {
    broker: &'a Broker,
    /// The name connections are made with, for `rabbitmqctl list_connections`.
    name: &'a str,
    first: &'a Connection,
    own: Option<Connection>,
    within: Duration,
    fruitless: u32,
    reconnects: u32,
}

impl<'a> Link<'a> {
    /// Starts on `first`; after a loss, connects again as `name` for up to `within`.
    pub fn new(broker: &'a Broker, name: &'a str, first: &'a Connection, within: Duration) -> Self {
        Self {
            broker,
            name,
            first,
            own: None,
            within,
            fruitless: 0,
            reconnects: 0,
        }
    }

    /// The connection to work over now.
    pub fn current(&self) -> &Connection {
        self.own.as_ref().unwrap_or(self.first)
    }

    /// Whether `error` was the current connection being lost (worth [`Link::again`]), not a refusal.
    pub fn is_lost(&self, error: &Error) -> bool {
        is_connection_lost(self.current(), error)
    }

    /// How long it keeps connecting again after a loss.
    pub fn within(&self) -> Duration {
        self.within
    }

    /// Times the connection was made again.
    pub fn reconnects(&self) -> u32 {
        self.reconnects
    }

    /// After the current connection was lost: closes it for certain (so that nothing it held stays unacknowledged out
    /// of the next connection's sight) and connects again — unless it was lost [`MAX_FRUITLESS_RECONNECTS`] times in a
    /// row without `progressed` in between, or the broker is not back within the time given.
    pub async fn again(
        &mut self,
        progressed: bool,
        shutdown: &CancellationToken,
    ) -> Result<(), GaveUp> {
        close(self.current(), "reconnecting").await;
        self.fruitless = if progressed { 0 } else { self.fruitless + 1 };
        if self.fruitless >= MAX_FRUITLESS_RECONNECTS {
            return Err(GaveUp::Fruitless(self.fruitless));
        }
        let again = self
            .broker
            .reconnect(self.name, self.within, Some(shutdown))
            .await
            .map_err(GaveUp::NotBack)?;
        self.reconnects += 1;
        if let Some(old) = self.own.replace(again) {
            close(&old, "OK").await;
        }
        Ok(())
    }

    /// Closes the connection it made, if any (the caller's first one is the caller's).
    pub async fn close(self) {
        if let Some(own) = self.own {
            close(&own, "OK").await;
        }
    }
}
