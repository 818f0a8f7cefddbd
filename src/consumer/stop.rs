//! How a consumer's run on a queue ends: at a stop (SIGINT/SIGTERM), the work in flight drained within the shutdown
//! timeout on the connection it came on, and what no worker took given back; or, with `--exit-when-idle`, once the
//! queue and the calls owed after commits are found idle.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::options::BasicNackOptions;
use tokio::task::JoinSet;

use super::link::Link;
use super::run::{Handover, LinkEnd, Workers};
use super::{Consumer, Shared, lock, poison, sleep_or_cancel};
use crate::amqp::topology;

/// When the work in flight at a stop is given up: the shutdown timeout from now (the stop has just been seen).
pub(super) fn stop_deadline<C: Consumer>(shared: &Shared<C>) -> tokio::time::Instant {
    tokio::time::Instant::now() + shared.options.shutdown_timeout
}

/// A stop: the work in flight finishes on this connection, which stays open until it has, and then closes. What the
/// work commits is acknowledged, and what it gives back goes by a nack that is sent, not by a close racing it; closed
/// first, every message in flight at a stop came round again as a duplicate.
///
/// Before the drain: a partition queue has one active consumer, and a cancel (lapin sends one when its consumer is
/// dropped, too) makes a standby active at once, which would take the partition's later messages while this process
/// still finishes an earlier one. So the consumer is kept until the connection closes, and the partition's messages
/// go back, in order, with the close. Any other queue's deliveries prefetched but not taken go back now, for the
/// other consumers, not after the drain.
pub(super) async fn stopping<C: Consumer, F: Future<Output = bool>>(
    shared: &Shared<C>,
    link: &Link,
    mut deliveries: lapin::Consumer,
    workers: &mut Workers,
    cancel: impl FnOnce() -> F,
) {
    // Counted from the stop, not from the end of what comes before the drain.
    let deadline = stop_deadline(shared);
    if shared.options.partitions.is_none() && cancel().await {
        give_back_prefetched(link, &mut deliveries).await;
    }
    workers.finish(shared, deadline).await;
    link.close("stopped").await;
    drop(deliveries);
}

/// `--exit-when-idle`, the queue found idle. What the broker sent before the cancel took effect (arrived since the
/// queue was looked at) is this consumer's: it is processed before the process ends — however long that takes, its
/// retries and an outage included; no stop was asked for, so `--shutdown-timeout` does not cut it short — not left
/// behind for the next run, and so are the calls its commits owe. Its connection lost meanwhile, the run is not idle:
/// it connects again (the message comes again), and is idle only once that is done. A partition queue is not cancelled (a standby would take the
/// partition's later messages at once, [`stopping`]): what it sent goes back, in order, with the close.
pub(super) async fn idle_stop<C: Consumer, F: Future<Output = bool>>(
    shared: &Arc<Shared<C>>,
    link: &Arc<Link>,
    mut deliveries: lapin::Consumer,
    workers: &mut Workers,
    cancel: impl FnOnce() -> F,
) -> LinkEnd {
    crate::failpoint::hit("idle-stopping").await;
    let mut late = 0_usize;
    if shared.options.partitions.is_none() && cancel().await {
        while let Ok(Some(Ok(delivery))) =
            tokio::time::timeout(Duration::from_secs(2), deliveries.next()).await
        {
            if workers.dispatch(shared, link, delivery).await != Handover::Handed {
                break;
            }
            late += 1;
        }
    }
    if workers.finish_unless_stopped(shared, link).await {
        tracing::warn!(
            "RabbitMQ connection lost while finishing what arrived as the queue went idle; reconnecting (not idle \
             until it is done)"
        );
        return super::run::reconnect(shared, link, deliveries).await;
    }
    // Idle means no call owed, as [`is_idle`] found before these came.
    if late > 0 {
        while !shared.shutdown.is_cancelled()
            && owed_calls(shared).await.is_none_or(|owed| owed > 0)
        {
            if sleep_or_cancel(Duration::from_millis(100), &shared.shutdown).await {
                break;
            }
        }
    }
    link.close("idle").await;
    drop(deliveries);
    LinkEnd::Stop
}

/// After a confirmed cancel: the deliveries the broker had sent before it that no worker took (lapin keeps them, then
/// ends the stream) go back to the queue now. Bounded: a stream that does not end is left to the connection's close.
async fn give_back_prefetched(link: &Link, deliveries: &mut lapin::Consumer) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut given_back = 0_usize;
    while let Ok(Some(Ok(delivery))) = tokio::time::timeout_at(deadline, deliveries.next()).await {
        let nack = delivery.acker.nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        });
        // A nack has no reply: it is done once its frame is handed to the connection. Bounded all the same, by the
        // give-back's deadline rather than the broker timeout.
        if matches!(
            tokio::time::timeout_at(deadline, link.answer("a nack", nack)).await,
            Ok(Some(Ok(true)))
        ) {
            given_back += 1;
        }
    }
    if given_back > 0 {
        tracing::info!(
            given_back,
            "stopping: prefetched deliveries given back to the queue"
        );
    }
}

/// Idle: nothing in flight, nothing arrived for `--exit-when-idle`, the queue empty, and no call owed after a commit
/// (an effect worker in this process makes them; a call that keeps failing ends pending or failed after its
/// attempts, so the wait is bounded).
pub(super) async fn is_idle<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    owed_said: &mut bool,
) -> bool {
    let Some(idle_after) = shared.options.exit_when_idle else {
        return false;
    };
    if shared.in_flight.load(Ordering::SeqCst) > 0
        || lock(&shared.last_activity).elapsed() < idle_after
    {
        return false;
    }
    let depth = topology::queue_depth(&link.connection, &shared.queue);
    if !matches!(
        link.answer("a look at the queue's depth", depth).await,
        Some(Ok(Some((0, _))))
    ) {
        return false;
    }
    match owed_calls(shared).await {
        Some(0) => true,
        Some(owed) => {
            if !std::mem::replace(owed_said, true) {
                tracing::info!(owed, "queue idle; waiting for the calls owed after commits");
            }
            false
        }
        None => false,
    }
}

/// How many calls this consumer type still owes after commits (an effects worker in this process makes them): 0 when
/// it has no such worker; `None` if they could not be counted.
async fn owed_calls<C: Consumer>(shared: &Shared<C>) -> Option<i64> {
    let Some(effects) = &shared.options.owed_effects else {
        return Some(0);
    };
    let ct = effects.consumer_type.as_str();
    let owed = crate::db::bounded!(&effects.pool, shared.options.attempt_timeout, |conn| {
        crate::db::external::owed(conn, ct, effects.pending_only)
    });
    match owed.await {
        Ok(owed) => Some(owed),
        Err(e) => {
            tracing::debug!(error = %e, "could not count the calls owed; not idle yet");
            None
        }
    }
}

/// Waits for in-flight deliveries until `deadline` (the shutdown timeout after the stop was asked for); past it, abandons them: their transactions roll back
/// with their connections and the broker delivers the messages again.
pub(super) async fn drain<C: Consumer>(
    shared: &Shared<C>,
    tasks: &mut JoinSet<()>,
    deadline: tokio::time::Instant,
) {
    if tasks.is_empty() {
        return;
    }
    tracing::info!(in_flight = tasks.len(), "waiting for in-flight messages");
    let finished = tokio::time::timeout_at(deadline, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!(
            abandoned = tasks.len(),
            "shutdown timeout reached: abandoning in-flight messages, uncommitted and unacknowledged, for redelivery"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        // Abandoned by a clean stop, not ended by a crash: their starts must not count towards --poison-after.
        poison::abandoned(shared).await;
    }
}
