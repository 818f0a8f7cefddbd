//! Sending one copy back to its origin, and acknowledging its dead-letter copy only once the broker confirmed it.

use super::decide::Read;
use super::machine::{Outcome, Step};
use super::run::State;
use super::{Action, replay_properties};
use crate::amqp::Delivery;
use crate::amqp::pass::{Channels, Destination};
use crate::amqp::publish::{PublishError, Routed};
use crate::error::{Error, Result};
use crate::failpoint;

/// How sending one copy went: the machine's outcome, the error for the report, and a refusal that stops the replay.
struct Sent {
    outcome: Outcome,
    error: Option<String>,
    refused: Option<Error>,
}

impl Sent {
    fn outcome(outcome: Outcome, error: Option<String>) -> Self {
        Self {
            outcome,
            error,
            refused: None,
        }
    }
}

impl State<'_> {
    /// Republishes one message (in a dry run, only checks its origin) and acknowledges its dead-letter copy once the
    /// broker confirmed the republished one.
    pub(super) async fn replay_one(
        &mut self,
        channels: &mut Channels<'_>,
        delivery: &Delivery,
        read: Read,
    ) -> Result<()> {
        let origin = read.origin.clone().unwrap_or_default();
        let found = channels.destination(&origin).await?;
        let sent = if found == Destination::Missing {
            Sent::outcome(
                Outcome::Missing,
                Some(format!("queue {origin} does not exist")),
            )
        } else if found == Destination::Exclusive {
            Sent::outcome(
                Outcome::Failed,
                Some(format!(
                    "queue {origin} is exclusive to another connection (a client's reply queue, not a consumer's): \
                     a copy there would be gone with that connection"
                )),
            )
        } else if self.plan.dry_run {
            Sent::outcome(Outcome::WouldReplay, None)
        } else {
            self.send(channels, delivery, &read, &origin).await?
        };
        match self.machine.outcome(sent.outcome) {
            Step::Ack => {
                self.record(read, Action::Replayed, None);
                // The copy is confirmed and counted: only now may the dead-letter copy go. A crash or a lost
                // connection before this leaves it in both queues, and the inbox discards the second.
                failpoint::hit("replay-after-publish").await;
                channels.ack(delivery.delivery_tag).await?;
            }
            Step::Leave(action) => {
                channels.hold(delivery.delivery_tag);
                self.record(read, action, sent.error);
            }
            Step::Hold | Step::AckAgain | Step::Publish => {}
        }
        match sent.refused {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Publishes the copy to `origin` and reads the broker's answer. A lost connection is an error (this pass stops
    /// and the replay connects again); a refusal is an outcome, with the reason.
    async fn send(
        &mut self,
        channels: &mut Channels<'_>,
        delivery: &Delivery,
        read: &Read,
        origin: &str,
    ) -> Result<Sent> {
        if let Some(pace) = &mut self.pace {
            pace.wait().await;
        }
        failpoint::hit("replay-before-publish").await;
        let properties = replay_properties(
            &delivery.properties,
            read.failure.replays,
            &self.run,
            self.plan.restore_expiration,
        );
        Ok(
            match republish(channels, delivery, origin, properties).await {
                Ok(Outcome::Missing) => {
                    channels.queue_missing(origin);
                    Sent::outcome(
                        Outcome::Missing,
                        Some(format!(
                            "the copy came back unroutable: queue {origin} does not exist"
                        )),
                    )
                }
                Ok(Outcome::Failed) => Sent::outcome(
                    Outcome::Failed,
                    Some(format!("the broker refused the copy to {origin} (nack)")),
                ),
                Ok(outcome) => Sent::outcome(outcome, None),
                // The broker refused the copy and closed the channel with its reason (a permission, say): every later
                // copy would fail the same way. This one is left, with the reason, and the replay stops.
                Err(Error::Broker(e)) if e.is_refusal() => {
                    let error = crate::redact::text(&e.to_string());
                    Sent {
                        outcome: Outcome::Failed,
                        error: Some(error),
                        refused: Some(Error::Broker(e)),
                    }
                }
                // The connection failed, or the confirm did not come in time: stop this pass (and connect again).
                Err(e @ (Error::Broker(_) | Error::BrokerSilent { .. })) => return Err(e),
                Err(e) => Sent::outcome(Outcome::Failed, Some(crate::redact::text(&e.to_string()))),
            },
        )
    }
}

/// Publishes a copy to `queue` through the default exchange and waits for the broker's confirm: `Confirmed`,
/// `Missing` (returned as unroutable: no such queue) or `Failed` (nacked).
async fn republish(
    channels: &Channels<'_>,
    delivery: &Delivery,
    queue: &str,
    properties: crate::amqp::BasicProperties,
) -> Result<Outcome> {
    match channels.republish(delivery, queue, properties).await? {
        Ok(Routed::Queued) => Ok(Outcome::Confirmed),
        Ok(Routed::Returned) => Ok(Outcome::Missing),
        Err(PublishError::Nacked) => Ok(Outcome::Failed),
        Err(PublishError::ConfirmsOff) => {
            Err(Error::Topology("publisher confirms are off".to_owned()))
        }
        Err(PublishError::Broker(e)) => Err(e.into()),
    }
}

/// `--rate`: copies spaced evenly. A copy late by a little (a timer's overshoot) is made up by the next, so the rate
/// over the run holds; a long pause (a reconnect) is not made up with a burst.
#[derive(Debug)]
pub(super) struct Pace {
    interval: std::time::Duration,
    next: Option<tokio::time::Instant>,
}

impl Pace {
    pub(super) fn new(per_second: f64) -> Self {
        Self {
            interval: std::time::Duration::from_secs_f64(1.0 / per_second),
            next: None,
        }
    }

    /// Waits until the next copy may go, and takes nothing: the replay waits here, between messages, holding none
    /// and ending at once on a stop, whatever the rate.
    pub(super) async fn ready(&self) {
        if let Some(next) = self.next {
            tokio::time::sleep_until(next).await;
        }
    }

    /// Waits for the next copy's time and takes it.
    pub(super) async fn wait(&mut self) {
        let at = self.slot(tokio::time::Instant::now());
        tokio::time::sleep_until(at).await;
        self.next = Some(at + self.interval);
    }

    /// When the copy asked for at `now` goes. Late by up to an interval: at its time, made up (the copy after it stays
    /// on the grid). Later: a pause, and the grid starts again from now — kept from its old place, the copy after this
    /// one would go at once, two copies back to back.
    fn slot(&self, now: tokio::time::Instant) -> tokio::time::Instant {
        match self.next {
            Some(next) if next + self.interval >= now => next,
            _ => now,
        }
    }
}

#[cfg(test)]
mod pace_tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::Pace;

    /// After a pause of ten intervals, a copy goes at once and the one after it a whole interval later: not two back
    /// to back. A copy late by less than an interval is made up by the next.
    #[test]
    fn a_long_pause_is_not_made_up_with_a_burst() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let pace = |next: Instant| Pace {
            interval: second,
            next: Some(next),
        };
        // The copy due at `start + 1s`, asked for ten seconds later: now, and the next a second after it.
        let resumed = start + Duration::from_secs(11);
        assert_eq!(pace(start + second).slot(resumed), resumed);
        // Asked for 300 ms late: at its time (in the past, so at once), the next on the grid, 700 ms after now.
        let late = start + Duration::from_millis(1300);
        assert_eq!(pace(start + second).slot(late), start + second);
        // Early: at its time.
        assert_eq!(pace(start + second).slot(start), start + second);
        assert_eq!(Pace::new(1.0).slot(start), start);
    }
}
