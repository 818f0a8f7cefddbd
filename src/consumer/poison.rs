//! Poison messages: a message whose processing ends its consumer process (an abort, a crash in native code, an
//! out-of-memory kill) comes back redelivered every time. Redelivered messages are counted in `inboxctl_attempts` as
//! they start (a first delivery costs nothing); one that was in flight at an earlier end is a suspect and is tried
//! alone; once it has ended the process `--poison-after` times alone, it moves to the error queue.
//!
//! Only an end of the process may count: a start that reaches an outcome is forgotten, and so is one abandoned by a
//! clean stop (SIGTERM past `--shutdown-timeout`), which is not the message's doing.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;

use lapin::message::Delivery;
use uuid::Uuid;

use super::bookkeeping::{bookkeeping_failed, bounded};
use super::dispatch::{Access, Disposition, Ready, attempts};
use super::link::Link;
use super::move_aside::error_queue;
use super::{Consumer, STOP_BOOKKEEPING, Shared, lock};
use crate::db::attempts;

/// The starts of redelivered messages in this process that are counted and have not reached an outcome, each with
/// whether it is also counted as made alone: what a clean stop that abandons them takes back. By start, not by id:
/// two copies of one message may be in flight at once (one on a link lost meanwhile, its redelivery on the next).
#[derive(Debug, Default)]
pub(super) struct Starts {
    next: std::sync::atomic::AtomicU64,
    by_start: std::sync::Mutex<HashMap<u64, (Uuid, bool)>>,
}

/// One start among [`Starts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Start(u64);

impl Starts {
    fn begin(&self, id: Uuid) -> Start {
        let start = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.by_start).insert(start, (id, false));
        Start(start)
    }

    fn set_alone(&self, start: Start, alone: bool) {
        if let Some(entry) = lock(&self.by_start).get_mut(&start.0) {
            entry.1 = alone;
        }
    }

    fn alone(&self, start: Start) -> bool {
        lock(&self.by_start)
            .get(&start.0)
            .is_some_and(|(_, alone)| *alone)
    }

    fn end(&self, start: Start) {
        lock(&self.by_start).remove(&start.0);
    }

    fn take(&self) -> Vec<(Uuid, bool)> {
        std::mem::take(&mut *lock(&self.by_start))
            .into_values()
            .collect()
    }
}

/// Handles a redelivered message: counts its start, moves it aside if it is the poison, tries it alone if it is a
/// suspect.
pub(super) async fn redelivered<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
) -> Disposition {
    let id = ready.incoming.message_id;
    // Registered before the count, so that a stop can never miss a start it counted.
    let start = shared.starts.begin(id);
    let counted = redelivered_start(shared, id).await;
    let starts = counted.or_else(|| broker_count(delivery));
    let is_poison = matches!(starts, Some((_, alone)) if alone >= shared.options.poison_after);
    let decided = async {
        match starts {
            // It ended its process this many times while it was the only work in flight: it is the cause.
            Some((_, alone)) if alone >= shared.options.poison_after => {
                poison(shared, link, delivery, ready, alone).await
            }
            // In flight at an earlier end (with others, perhaps): a suspect, tried alone.
            Some((started, _)) if started >= 2 => {
                attempts(shared, link, delivery, ready, 1, Access::Alone(start)).await
            }
            _ => attempts(shared, link, delivery, ready, 1, Access::Shared).await,
        }
    };
    // A panic in its handling outside the consumer's work (which is a failed attempt) is inboxctl's, and the process
    // goes on: caught here only to keep the books, then passed on to the handler's last resort, which gives the
    // message back. Left counted, the start would count as an end of the process, and a message whose move aside
    // panicked would come to be moved aside as poison, for a reason that is not true. But it says nothing of the
    // message either (its work may not even have run: a poison's move aside): only this start is taken back, as a
    // clean stop takes back the starts it abandons, and the counts before it stand.
    let decided = AssertUnwindSafe(decided).catch_unwind().await;
    // Left among the starts until the books are kept: a stop that abandons this task meanwhile takes it back.
    let alone = shared.starts.alone(start);
    if counted.is_some() {
        let consumer_type = shared.inbox.consumer_type();
        let kept = match &decided {
            // Alive after this start, whatever its outcome: the message is not what ends processes. But a poison
            // whose move aside did not happen (its copy refused, a stop) ran no work: its counts stand, or the next
            // process to get it would run it again, and the poison would end that one too.
            Ok(disposition) if !is_poison || matches!(disposition, Disposition::Ack) => {
                bounded!(shared, |conn| attempts::done(conn, consumer_type, id)).await
            }
            _ => {
                bounded!(shared, |conn| attempts::abandoned(
                    conn,
                    consumer_type,
                    &[(id, alone)]
                ))
                .await
            }
        };
        redelivery_count(id, kept);
    }
    shared.starts.end(start);
    decided.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A suspect's attempt starts alone: counted before the work, so that it stays counted if the work ends the process.
/// A count that failed may still have been made (a statement timed out, its answer lost): it is taken back as one
/// that was (the take-back never goes below 0).
pub(super) async fn starting_alone<C: Consumer>(shared: &Shared<C>, id: Uuid, start: Start) {
    shared.starts.set_alone(start, true);
    let kept = bounded!(shared, |conn| attempts::started_alone(
        conn,
        shared.inbox.consumer_type(),
        id
    ))
    .await;
    redelivery_count(id, kept);
}

/// A suspect's attempt alone returned, whatever its outcome: its count alone is taken back while it still holds the
/// lock, so that only an end of the process *during* an attempt alone is charged to it — not one while it waits for
/// its retry, another suspect's attempt alone (the poison's) running then. Should the database not take it back, the
/// count stands (and a stop that abandons the start takes it back then). Whether the database took it back.
pub(super) async fn returned_alone<C: Consumer>(
    shared: &Shared<C>,
    id: Uuid,
    start: Start,
) -> bool {
    let kept = bounded!(shared, |conn| attempts::returned_alone(
        conn,
        shared.inbox.consumer_type(),
        id
    ))
    .await;
    let taken_back = kept.is_ok();
    if taken_back {
        shared.starts.set_alone(start, false);
    }
    redelivery_count(id, kept);
    taken_back
}

/// A clean stop abandoned the work still in flight: the starts it had counted are taken back (within a bound of
/// time: a database that does not answer costs poison detection a count, never the stop its promptness).
pub(super) async fn abandoned<C: Consumer>(shared: &Shared<C>) {
    let starts = shared.starts.take();
    if starts.is_empty() {
        return;
    }
    let undo = attempts::abandoned(shared.inbox.pool(), shared.inbox.consumer_type(), &starts);
    match tokio::time::timeout(STOP_BOOKKEEPING, undo).await {
        Ok(Ok(_)) => tracing::debug!(
            messages = starts.len(),
            "starts abandoned by the stop taken back"
        ),
        Ok(Err(e)) => bookkeeping_failed(
            "starts abandoned by the stop not taken back",
            "they count towards --poison-after as if the process had crashed",
            None,
            &e,
        ),
        Err(_) => tracing::warn!(
            messages = starts.len(),
            "PostgreSQL did not answer in time: the starts abandoned by the stop count towards --poison-after"
        ),
    }
}

/// Where the starts cannot be counted, a quorum queue's own count of the message's deliveries (`x-delivery-count`,
/// this one included) stands in for them: enough to try a message delivered again and again alone, never to call it
/// the poison (the broker counts every return, a clean stop's and another message's crash alike).
fn broker_count(delivery: &Delivery) -> Option<(u32, u32)> {
    let earlier = crate::amqp::failure::delivery_count(delivery.properties.headers().as_ref())?;
    Some((earlier.saturating_add(1), 0))
}

/// Counts a start of a redelivered message: its starts without an outcome so far (this one included), and those of
/// them made alone. `None` when it cannot be counted (the database down, or a schema from before the count existed),
/// and the message is then processed as usual.
async fn redelivered_start<C: Consumer>(shared: &Shared<C>, id: Uuid) -> Option<(u32, u32)> {
    let start = bounded!(shared, |conn| attempts::start(
        conn,
        shared.inbox.consumer_type(),
        id
    ));
    match start.await {
        Ok(attempts::Starts { started, alone }) => Some((started, alone)),
        Err(e) => {
            bookkeeping_failed(
                "redelivery not counted",
                "poison-message detection is off until it can be (a grant on inboxctl_attempts missing?)",
                Some(id),
                &e,
            );
            None
        }
    }
}

/// Says when one of the redelivery count's statements failed. A count that cannot be kept (the database down) only
/// weakens poison detection; it never holds up the message.
fn redelivery_count(id: Uuid, kept: sqlx::Result<()>) {
    if let Err(e) = kept {
        bookkeeping_failed(
            "redelivery count not kept",
            "poison-message detection is off until it can be (a grant on inboxctl_attempts missing?)",
            Some(id),
            &e,
        );
    }
}

/// The fault type of a poison's copy in the error queue.
pub(super) const POISON_FAULT: &str = "inboxctl::PoisonMessage";

/// A poison moved aside later than it was found (its copy refused then, owed since): its counts go, as they go when
/// the move succeeds at once — left, a replay of it redelivered once would be moved aside again, never run.
pub(super) async fn moved_aside_later<C: Consumer>(shared: &Shared<C>, id: Uuid) {
    let kept = bounded!(shared, |conn| attempts::done(
        conn,
        shared.inbox.consumer_type(),
        id
    ))
    .await;
    redelivery_count(id, kept);
}

/// A message whose processing ended its process `alone` times while nothing else was in flight: to the error queue.
async fn poison<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    alone: u32,
) -> Disposition {
    let id = ready.incoming.message_id;
    let reason = format!(
        "processed alone {alone} times without reaching an outcome: each attempt ended the consumer process \
         (a crash, an abort or a kill while it was the only message in flight)"
    );
    tracing::error!(message_id = %id, alone, "poison message; moving it to the error queue");
    let fault = (POISON_FAULT, reason.clone(), reason);
    let retries = i32::try_from(alone).unwrap_or(i32::MAX);
    error_queue(shared, link, delivery, ready, &fault, retries).await
}
