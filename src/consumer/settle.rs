//! Settling a delivery with the broker once its handling ended: acknowledged (its outcome committed or its copy
//! confirmed) or given back, and counted out of flight once.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;

use super::dead_letters::{CopyError, To};
use super::link::Link;
use super::{Consumer, Shared, lock, sleep_or_cancel};
use crate::amqp::tail;

/// What to do with a delivery once its handling ended.
pub(super) enum Disposition {
    /// Its outcome is committed or its copy confirmed.
    Ack,
    /// Not finished (a stop, an outage): give it back to the broker.
    Requeue,
    /// Not finished, and not to come back at once (its dead-letter copy was refused): give it back after this pause,
    /// or at a stop.
    RequeueAfter(Duration),
}

/// Acks or requeues a delivery whose handling ended (it was taken up at `started`), and counts it out of flight. One
/// that reached its outcome (acked) has its handling time observed, for `--metrics-addr`: from when a worker took it
/// up to its outcome committed or its copy confirmed, retries and their waits included; one given back is not.
pub(super) async fn settle<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    disposition: Disposition,
    started: Instant,
) {
    if let (Disposition::Ack, Some(timings)) = (&disposition, &shared.options.timings) {
        timings.handled(started.elapsed());
    }
    let disposition = match disposition {
        Disposition::RequeueAfter(pause) if shared.options.partitions.is_none() => {
            to_the_tail(shared, link, delivery, pause).await
        }
        other => other,
    };
    settle_acker(
        shared,
        link,
        &delivery.acker,
        delivery.delivery_tag,
        disposition,
    )
    .await;
}

/// A message that cannot be settled now (its dead-letter copy refused, its handling panicked), after its pause, while
/// half the prefetch or more waits so: put at the tail of its queue — published there again through the queue's
/// exchange, confirmed, marked ([`tail::GIVEN_BACK_HEADER`]) so that it is handled as a redelivery when it
/// comes round — and acknowledged. A requeue puts a message back at the head, where it is delivered again first: with
/// as many such messages as the prefetch at the head (the error queue full, say), the same ones came round for as
/// long as it lasted, and the messages behind them were never delivered. With fewer, the others flow past them
/// through the rest of the prefetch, and a requeue keeps the message's place (and it comes round within seconds,
/// while its owed copy is remembered).
///
/// A per-message TTL is not carried as such: it would start again, and the copy could expire at the tail (see
/// [`tail::properties`]).
///
/// Given back with a requeue as before at a stop, on a lost link, in an alarm, or when the queue does not take it (or
/// it cannot be published again as it is, or the role may not write to the queue's exchange: said once a minute): the
/// pause keeps that from a tight loop. Not for a partition queue, whose order a message at its tail would give up. A
/// copy confirmed whose ack is then lost leaves the message twice on its queue: processed, the second is a duplicate;
/// moved aside, the second comes round and is moved aside too (a second copy in the error queue, which a replay finds
/// a duplicate).
async fn to_the_tail<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    pause: Duration,
) -> Disposition {
    shared.held_back.fetch_add(1, Ordering::SeqCst);
    let stopped = tokio::select! {
        stopped = sleep_or_cancel(pause, &shared.shutdown) => stopped,
        () = link.given_up() => true,
    };
    // How many wait so at the end of this one's pause, this one included.
    let held = shared.held_back.fetch_sub(1, Ordering::SeqCst);
    if stopped || link.is_lost() {
        return Disposition::Requeue;
    }
    if held < (usize::from(shared.options.prefetch) / 2).max(1) {
        return Disposition::Requeue;
    }
    let headers = tail::given_back_once_more(delivery.properties.headers().as_ref());
    let queue = &shared.options.queue;
    // Never waiting out an alarm: with no place to wait in, a copy that meets one gives the message back (held, it
    // could land only once the alarm ended, and it would take a place the copies to the error queue wait in). A
    // panic in it is a refusal: the delivery is settled whatever happens here.
    let no_wait = super::alarm::AlarmWaits::none();
    let copied = link.copy(
        To::Tail(queue),
        delivery,
        headers,
        &shared.shutdown,
        &no_wait,
    );
    let copied = match AssertUnwindSafe(copied).catch_unwind().await {
        Ok(copied) => copied,
        Err(_) => Err(CopyError::Refused(
            "putting it at the tail panicked".to_owned(),
        )),
    };
    match copied {
        Ok(()) => {
            tracing::debug!(
                delivery_tag = delivery.delivery_tag,
                "a message that could not be settled is put at the tail of {queue}"
            );
            Disposition::Ack
        }
        Err(CopyError::GivenBackInAnAlarm) => Disposition::Requeue,
        Err(CopyError::Impossible(why) | CopyError::Refused(why)) => {
            static SAID: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
            let now = Instant::now();
            let mut said = lock(&SAID);
            if said.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60)) {
                *said = Some(now);
                let grant = if why.contains("ACCESS_REFUSED") || why.contains("403") {
                    " (the role needs write on amq.default, the default exchange, to put it there)"
                } else {
                    ""
                };
                tracing::warn!(
                    error = %why,
                    "could not put a message that cannot be settled now at the tail of {queue}{grant}; it goes back \
                     to the head, where such messages may hold up those behind them (said once a minute)"
                );
            }
            Disposition::Requeue
        }
    }
}

pub(super) async fn settle_acker<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    acker: &lapin::Acker,
    delivery_tag: u64,
    disposition: Disposition,
) {
    let sent = match disposition {
        Disposition::Ack => {
            link.answer("an ack", acker.ack(BasicAckOptions::default()))
                .await
        }
        Disposition::Requeue | Disposition::RequeueAfter(_) => {
            // The pause keeps a message that cannot be settled now from coming round in a tight loop; on a link
            // given up it comes round on the next connection anyway.
            if let Disposition::RequeueAfter(pause) = disposition {
                tokio::select! {
                    _ = sleep_or_cancel(pause, &shared.shutdown) => {}
                    () = link.given_up() => {}
                }
            }
            if shared.options.partitions.is_some() && shared.shutdown.is_cancelled() {
                // A partition queue at a stop: its consumer stays active until the connection closes, so a nack would
                // hand the message straight back to it, behind the partition's later messages it holds. The close
                // gives them all back, in order.
                None
            } else {
                let nack = acker.nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                });
                link.answer("a nack", nack).await
            }
        }
    };
    // `Ok(false)`: settled already (by the clean-up after a panic), or its channel closed (lapin's acker poisoned);
    // `settled` counts a delivery out of flight once either way.
    let sent = matches!(sent, Some(Ok(true)));
    settled(shared, link, delivery_tag, sent);
}

/// The bookkeeping of a delivery settled with the broker (`sent`), or not settled because its channel closed or its
/// link was given up (then the broker delivers it again). Counted out of flight once, however often it is called.
pub(super) fn settled<C: Consumer>(shared: &Shared<C>, link: &Link, delivery_tag: u64, sent: bool) {
    *lock(&shared.last_activity) = Instant::now();
    if !link.outstanding.remove(delivery_tag) {
        return;
    }
    if !sent {
        tracing::debug!(
            delivery_tag,
            "not settled (channel closed or connection given up); the broker will deliver the message again"
        );
    }
    let _ = shared
        .in_flight
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}
