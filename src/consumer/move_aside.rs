//! Moving a message aside: to `<queue>_error` (unreadable, failed too often, poison, a conflict) or `<queue>_skipped`
//! (a type the consumer does not handle), its copy published with publisher confirms ([`dead_letters`](super::dead_letters)),
//! the destination declared on first use — and again when it was deleted under a running consumer, so that a deleted
//! error queue does not turn every later failure into a message sent back round until a restart. The original is
//! acknowledged only once the copy is confirmed; a copy the broker refuses leaves it on its queue, owed its copy
//! ([`owed`](super::owed)).

use std::sync::atomic::Ordering;

use lapin::message::Delivery;
use lapin::types::FieldTable;
use uuid::Uuid;

use super::Consumer;
use super::bookkeeping::record_event;
use super::dead_letters::{CopyError, To};
use super::dispatch::{Disposition, Ready};
use super::link::Link;
use super::owed::Owed;
use super::{HOLD_IMPOSSIBLE, OUTAGE_DELAY_MAX, Shared, lock, logged};
use crate::amqp::dead_letter::{self, Fault};
use crate::amqp::envelope::{Incoming, Unreadable};
use crate::amqp::topology;

/// How often a copy given back in an alarm is said at warning level.
const GIVEN_BACK_SAID_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Why a copy that did not wait out an alarm gave its message back.
const GIVEN_BACK_IN_AN_ALARM: &str = "RabbitMQ blocks the dead-letter connection (a memory or disk alarm); the \
     copy does not wait for the alarm to end (it is the batch worker's, or as many copies wait as may: half the \
     workers, rounded down), and the message goes back to its queue";

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
    let moved = copy(shared, link, &destination, delivery, headers).await;
    match moved {
        Ok(()) => {
            shared.counts.skipped.fetch_add(1, Ordering::Relaxed);
            record_event(shared, "skipped", Some(incoming.message_id), &types).await;
            Disposition::Ack
        }
        Err(e) => copy_refused(Some(incoming.message_id), &destination, e),
    }
}

/// [`Link::copy`], with the consumer's stop and its limit on the copies that wait out an alarm.
async fn copy<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    destination: &str,
    delivery: &Delivery,
    headers: FieldTable,
) -> Result<(), CopyError> {
    link.copy(
        To::DeadLetter(destination),
        delivery,
        headers,
        &shared.shutdown,
        &shared.alarm_waits,
    )
    .await
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

/// Moves a message that could be read to the error queue. A copy the broker does not take is owed to the message
/// when it comes round ([`owed`](super::owed)).
pub(super) async fn error_queue<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    fault: &FaultText,
    retry_count: i32,
) -> Disposition {
    let id = ready.incoming.message_id;
    let message_type = ready.message_type.clone();
    let disposition = dead_letter_error(
        shared,
        link,
        delivery,
        Some(id),
        message_type,
        fault,
        retry_count,
    )
    .await;
    if let Disposition::RequeueAfter(_) = disposition {
        let owed = Owed {
            fault: fault.clone(),
            retry_count,
        };
        let copy = super::owed::copy_of(&delivery.properties);
        shared.owed.remember(id, ready.fingerprint, copy, owed);
    }
    disposition
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
    let moved = copy(shared, link, &destination, delivery, headers).await;
    match moved {
        Ok(()) => {
            // Counted once the copy is confirmed: a copy refused comes round again (owed), and would count again.
            if fault.0 == CONFLICT_FAULT {
                shared.counts.conflicts.fetch_add(1, Ordering::Relaxed);
            } else {
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
        CopyError::GivenBackInAnAlarm => {
            // Every few seconds for each such message while the alarm lasts: said once a minute, the rest at -v.
            static SAID: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
            let now = std::time::Instant::now();
            let mut said = lock(&SAID);
            if said.is_none_or(|at| now.duration_since(at) >= GIVEN_BACK_SAID_EVERY) {
                *said = Some(now);
                tracing::warn!(
                    message_id = ?message_id,
                    error = GIVEN_BACK_IN_AN_ALARM,
                    "could not move a message to {destination}; it stays on the queue (said once a minute while \
                     the alarm lasts, the rest at -v)"
                );
            } else {
                tracing::debug!(
                    message_id = ?message_id,
                    error = GIVEN_BACK_IN_AN_ALARM,
                    "could not move a message to {destination}"
                );
            }
            OUTAGE_DELAY_MAX
        }
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
