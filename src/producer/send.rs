//! Sending a plan with publisher confirms: a window of confirms in flight, the copies not confirmed sent again after
//! a reconnect, refusals retried with a backoff, and a report of what the broker confirmed.

use std::collections::VecDeque;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Message, ParcelField, Plan, Report, Stamp, envelope_stamped, messages, schedule};
use crate::amqp::envelope::HostInfo;
use crate::amqp::publish::{ConfirmChannel, Pending, PublishError, Routed};
use crate::amqp::{BLOCKED_HINT, Broker, Connection, GaveUp, Link, answered, is_blocked};
use crate::error::{Error, Result};

/// Confirms awaited in flight at most; bounds memory on large runs without waiting on each publish.
const CONFIRM_WINDOW: usize = 512;

/// Publishes `plan` to `exchange` with publisher confirms; returns once the broker confirmed every copy.
///
/// When the connection is lost on the way (the broker restarted, the network broke), it connects again for up to
/// `reconnect_for` and sends again every copy whose confirm it had not received — the same message ids, so an inbox
/// discards the ones that had in fact arrived. Out of time, it fails saying how many copies were confirmed before.
pub async fn publish(
    connection: &Connection,
    broker: &Broker,
    exchange: &str,
    plan: &Plan,
    reconnect_for: Duration,
    shutdown: &CancellationToken,
) -> Result<Report> {
    let quiet = |_, _| {};
    publish_showing(
        connection,
        broker,
        exchange,
        plan,
        reconnect_for,
        shutdown,
        quiet,
    )
    .await
}

/// [`publish`], calling `progress` with (copies confirmed, copies planned) as the broker confirms them.
pub async fn publish_showing(
    connection: &Connection,
    broker: &Broker,
    exchange: &str,
    plan: &Plan,
    reconnect_for: Duration,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(u64, u64),
) -> Result<Report> {
    let messages = messages(plan);
    let order = schedule(messages.len(), plan.duplicates);
    let host = HostInfo::current();
    let mut run = Run {
        messages: &messages,
        order: &order,
        broker,
        exchange,
        host: &host,
        stamps: vec![None; messages.len()],
        routing_key: plan.routing_key,
        broker_timeout: plan.broker_timeout,
        ticker: plan.rate.map(|rate| {
            let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        }),
        confirmed: 0,
        progress: &mut progress,
        sent: 0,
        prefix_broken: false,
        nacked: false,
        report: Report {
            exchange: exchange.to_owned(),
            duplicates: (order.len() - messages.len()) as u64,
            planned: order.len() as u64,
            ..Report::default()
        },
    };
    let mut link = Link::new(broker, "inboxctl publish", connection, reconnect_for);
    let sent = run.send_all(&mut link, shutdown).await;
    link.close().await;
    sent?;
    let mut report = run.report;
    if run.confirmed < order.len() {
        // Interrupted: the confirmed copies are the first ones of the order; count what they were.
        report.interrupted = true;
        let mut seen = vec![false; messages.len()];
        report.published = 0;
        report.duplicates = 0;
        for &index in &order[..run.confirmed] {
            if std::mem::replace(&mut seen[index], true) {
                report.duplicates += 1;
            } else {
                report.published += 1;
            }
        }
    } else {
        report.published = messages.len() as u64;
    }
    report.messages = messages;
    Ok(report)
}

fn unavailable_reason(error: &Error) -> String {
    match error {
        Error::BrokerUnavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// A publishing run's progress: the copies of `order` before `confirmed` were confirmed by the broker, those before
/// `sent` were handed to the connection.
struct Run<'a> {
    messages: &'a [Message],
    order: &'a [usize],
    broker: &'a Broker,
    exchange: &'a str,
    host: &'a HostInfo,
    /// Each message's stamp, taken at its first send: its copies (and what a reconnect sends again) carry the same.
    stamps: Vec<Option<Stamp>>,
    routing_key: Option<ParcelField>,
    /// How long a call to the broker may wait for its answer.
    broker_timeout: Duration,
    ticker: Option<tokio::time::Interval>,
    confirmed: usize,
    /// Told (confirmed, planned) after each confirm.
    progress: &'a mut dyn FnMut(u64, u64),
    sent: usize,
    /// Set when a confirm was taken from the window and failed: the copies after it are no longer a prefix.
    prefix_broken: bool,
    /// Set when the broker refused a copy (a nack): a quorum queue without a leader for a moment (its node lost,
    /// the election running) refuses what is routed to it, and takes it again once one is elected.
    nacked: bool,
    report: Report,
}

impl Run<'_> {
    /// Sends every copy, connecting again after a lost connection (and sending again what was not confirmed).
    async fn send_all(&mut self, link: &mut Link<'_>, shutdown: &CancellationToken) -> Result<()> {
        let mut refusals = Refusals::new(link.within());
        loop {
            let confirmed_before = self.confirmed;
            self.nacked = false;
            let e = match self.send_rest(link.current(), shutdown).await {
                Ok(()) => return Ok(()),
                Err(e) if self.nacked => {
                    if !refusals
                        .again(self.confirmed > confirmed_before, shutdown)
                        .await
                    {
                        // Stopped while it waited: the run is interrupted, its confirmed copies reported (exit 3).
                        if shutdown.is_cancelled() {
                            return Ok(());
                        }
                        self.say_confirmed();
                        return Err(e);
                    }
                    tracing::warn!(
                        error = %e,
                        confirmed = self.confirmed,
                        of = self.order.len(),
                        "RabbitMQ refused a copy (a quorum queue electing a leader?); sending the unconfirmed rest \
                         again"
                    );
                    self.report.resent += (self.sent - self.confirmed) as u64;
                    self.sent = self.confirmed;
                    continue;
                }
                Err(e) if !link.is_lost(&e) => {
                    self.say_confirmed();
                    return Err(e);
                }
                Err(e) if is_blocked(link.current(), &e) => {
                    let why = format!("{}: {BLOCKED_HINT}", crate::redact::text(&e.to_string()));
                    return Err(self.stopped_unconfirmed(why));
                }
                Err(e) => e,
            };
            let in_flight = self.sent - self.confirmed;
            tracing::warn!(
                error = %e,
                confirmed = self.confirmed,
                of = self.order.len(),
                unconfirmed_in_flight = in_flight,
                "lost the connection to RabbitMQ; connecting again to send the unconfirmed rest"
            );
            if let Err(gave_up) = link
                .again(self.confirmed > confirmed_before, shutdown)
                .await
            {
                // Stopped while it connected again: interrupted, not given up.
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                return Err(self.gave_up(gave_up, &e, link.within()));
            }
            self.report.reconnects = link.reconnects();
            self.report.resent += in_flight as u64;
            self.sent = self.confirmed;
        }
    }

    /// The error a run that lost its connection for good ends with.
    fn gave_up(&self, gave_up: GaveUp, lost: &Error, reconnect_for: Duration) -> Error {
        let last = match gave_up {
            GaveUp::Fruitless(times) => format!(
                "the connection was lost {times} times in a row without a confirm in between ({})",
                crate::redact::text(&lost.to_string())
            ),
            // Not connecting again at all (`--reconnect-timeout 0`): `last` says only that; why it was lost says more.
            GaveUp::NotBack(_) if reconnect_for.is_zero() => unavailable_reason(lost),
            GaveUp::NotBack(last) => unavailable_reason(&last),
        };
        self.stopped_unconfirmed(format!(
            "{last}; the connection was lost and did not come back within {}",
            humantime::format_duration(reconnect_for)
        ))
    }

    /// Says how far a run that stops on an error got, for the operator to know what is on the queue.
    fn say_confirmed(&self) {
        tracing::warn!(
            "stopping: the broker had confirmed {} of {} copies (the first {} in the run's order): the rest may not \
             have arrived; publishing them again is safe for an inbox (same message ids)",
            self.confirmed,
            self.order.len(),
            self.confirmed
        );
    }

    /// The error a run that stops before every copy was confirmed ends with: `why`, how far it got, and that sending
    /// again is safe.
    fn stopped_unconfirmed(&self, why: String) -> Error {
        Error::BrokerUnavailable {
            url: self.broker.display_url(),
            reason: format!(
                "{why}; the broker had confirmed {} of {} copies (the first {} in the run's order): the rest may not \
                 have arrived; publishing them again is safe for an inbox (same message ids)",
                self.confirmed,
                self.order.len(),
                self.confirmed
            ),
        }
    }

    /// Sends every copy from the first unconfirmed one on, over a new confirm-mode channel of `connection`. On an
    /// error, the confirms that had already arrived still count.
    async fn send_rest(
        &mut self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let mut pending: VecDeque<Pending> = VecDeque::with_capacity(CONFIRM_WINDOW);
        self.prefix_broken = false;
        let result = self.send_rest_on(connection, &mut pending, shutdown).await;
        // Only while the confirmed copies are still a prefix: after a copy whose confirm failed (a nack, say), later
        // acks do not make it confirmed.
        if result.is_err() && !self.prefix_broken {
            while let Some(confirm) = pending.pop_front() {
                // Polled once: ready only if the broker's confirm had arrived before the failure.
                match confirm.acked_already().await {
                    Some(routed) => {
                        self.report.unroutable += u64::from(routed == Routed::Returned);
                        self.confirmed_one();
                    }
                    None => break,
                }
            }
        }
        result
    }

    /// One more copy confirmed, in the run's order.
    fn confirmed_one(&mut self) {
        self.confirmed += 1;
        (self.progress)(self.confirmed as u64, self.order.len() as u64);
    }

    /// Waits for the oldest confirm in the window, at most `--broker-timeout`; a failure breaks the confirmed prefix,
    /// and so does a confirm that did not come: the copy may or may not have arrived.
    async fn settle(&mut self, confirm: Pending) -> Result<()> {
        let waited = answered(
            "a copy's confirm",
            self.broker_timeout,
            settle(confirm, &mut self.report),
        )
        .await;
        let settled = match waited {
            Ok(settled) => settled,
            Err(silent) => Err(Settled::Failed(silent)),
        };
        self.prefix_broken |= settled.is_err();
        if let Err(Settled::Nacked(_)) = &settled {
            self.nacked = true;
        }
        settled.map_err(Settled::into_error)
    }

    async fn send_rest_on(
        &mut self,
        connection: &Connection,
        pending: &mut VecDeque<Pending>,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        if self.report.reconnects > 0 {
            // After a reconnect, as at the start: the exchange exists (inside the retry, so a second loss here is
            // handled like any other).
            let ensure = crate::amqp::topology::ensure_event_exchange(connection, self.exchange);
            answered("the exchange's declaration", self.broker_timeout, ensure).await??;
        }
        let open = ConfirmChannel::open(connection);
        let channel =
            answered("a new channel in confirm mode", self.broker_timeout, open).await??;
        // Confirms arrive in order, so the confirmed copies are always a prefix of the order.
        while self.sent < self.order.len() {
            if let Some(ticker) = self.ticker.as_mut() {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    _ = ticker.tick() => {}
                }
            }
            if shutdown.is_cancelled() {
                // Stop sending; what was sent is confirmed below, and the report says how far it got.
                break;
            }
            let index = self.order[self.sent];
            let message = &self.messages[index];
            let stamp = *self.stamps[index].get_or_insert_with(Stamp::now);
            let (properties, body) =
                envelope_stamped(message, self.broker, self.exchange, self.host, stamp);
            let routing_key = self
                .routing_key
                .map(|field| field.of(&message.event))
                .unwrap_or_default();
            let publish = channel.publish(self.exchange, &routing_key, &body, properties);
            match answered("a publish", self.broker_timeout, publish).await? {
                Ok(confirm) => pending.push_back(confirm),
                Err(e) => {
                    // A channel the broker closed (a publish it refused, say for want of a permission) fails every
                    // later publish with only "invalid channel state"; the broker's reason comes with an earlier
                    // publish's confirm, so that is the error to report.
                    while let Some(confirm) = pending.pop_front() {
                        self.settle(confirm).await?;
                        self.confirmed_one();
                    }
                    return Err(e);
                }
            }
            self.sent += 1;
            if pending.len() >= CONFIRM_WINDOW
                && let Some(oldest) = pending.pop_front()
            {
                self.settle(oldest).await?;
                self.confirmed_one();
            }
        }
        while let Some(confirm) = pending.pop_front() {
            self.settle(confirm).await?;
            self.confirmed_one();
        }
        // What was sent is confirmed: whether the close is answered changes nothing.
        let _ = answered("a channel's close", self.broker_timeout, channel.close()).await;
        Ok(())
    }
}

/// How a copy's confirm failed.
enum Settled {
    /// The broker refused the copy: sending it again later may succeed.
    Nacked(Error),
    Failed(Error),
}

impl Settled {
    fn into_error(self) -> Error {
        match self {
            Self::Nacked(e) | Self::Failed(e) => e,
        }
    }
}

/// Waits for a copy's confirm: a copy no queue received is counted, one the broker refused fails the run.
async fn settle(confirm: Pending, report: &mut Report) -> std::result::Result<(), Settled> {
    match confirm.confirmed().await {
        Ok(Routed::Queued) => Ok(()),
        Ok(Routed::Returned) => {
            report.unroutable += 1;
            Ok(())
        }
        Err(PublishError::Broker(e)) => Err(Settled::Failed(e.into())),
        Err(refused @ PublishError::Nacked) => Err(Settled::Nacked(Error::Topology(format!(
            "the broker refused a message: {refused}"
        )))),
        Err(refused) => Err(Settled::Failed(Error::Topology(format!(
            "the broker refused a message: {refused}"
        )))),
    }
}

/// Refused copies sent again: with a backoff (0.1 s doubling to 2 s), for as long as a lost connection is tried
/// again; a refusal after some progress starts the wait afresh.
struct Refusals {
    within: Duration,
    deadline: tokio::time::Instant,
    backoff: crate::backoff::Backoff,
}

impl Refusals {
    fn new(within: Duration) -> Self {
        Self {
            within,
            deadline: tokio::time::Instant::now() + within,
            backoff: Self::backoff(),
        }
    }

    fn backoff() -> crate::backoff::Backoff {
        crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2))
    }

    /// Waits before the next try; false when the time is up (or the run is stopped).
    async fn again(&mut self, progressed: bool, shutdown: &CancellationToken) -> bool {
        if progressed {
            self.deadline = tokio::time::Instant::now() + self.within;
            self.backoff = Self::backoff();
        }
        let delay = self.backoff.next_delay();
        if tokio::time::Instant::now() + delay > self.deadline {
            return false;
        }
        !crate::backoff::sleep_or_cancel(delay, shutdown).await
    }
}
