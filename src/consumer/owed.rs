//! Copies owed: messages whose move to the error queue was decided (their attempts spent, a conflict, no time to
//! claim them by) but whose copy the broker did not take — a node in an alarm, a nack, a copy that can never be made.
//! The message went back to its queue. When it comes round, it goes straight to its copy with the reason decided
//! before, instead of being tried again: its attempts, their waits and any call they make outside the database are
//! not run again for every round of an alarm, and its failures are counted once.
//!
//! Kept by the process, keyed on the message id, the event's fingerprint (an id reused for another event is tried
//! as any message) and which copy of it the message is ([`CopyOf`]: a replay's copy of the same event, sent later, is
//! a new message, tried as any), bounded in number and forgotten when not renewed for a while: a message forgotten, or
//! taken by another process, is tried again, as it would be without this. The first delivery of a message of the same
//! key forgets it too: the message owed never comes round as a first delivery, so another copy of it was sent, and is
//! tried. Before its copy is made, the inbox is asked whether another process processed it meanwhile ([`owed_copy`]).

use std::time::Duration;

use uuid::Uuid;

use super::move_aside::FaultText;
use lapin::message::Delivery;

use super::dispatch::{Disposition, Ready, conflict, duplicate};
use super::link::Link;
use super::move_aside::{CONFLICT_FAULT, error_queue};
use super::outage::{Looked, database_back, look, unavailable, wait_to_retry};
use super::{Consumer, OUTAGE_DELAY_MAX, OUTAGE_DELAY_MIN, Shared, poison};
use crate::amqp::copy::{REPLAY_COUNT_HEADER, REPLAY_RUN_HEADER};
use crate::amqp::{dead_letter, failure, limits};
use crate::backoff::Backoff;
use crate::inbox::Fingerprint;
use crate::inbox::{Outcome, ProcessError};
use crate::recent::Recent;
use lapin::BasicProperties;

/// How many messages may be owed a copy at once. A fault is kept as its copy's headers carry it (at most 10 KB), so
/// this bounds the memory to a few MB; beyond it the one owed longest is forgotten.
const MOST: usize = 512;

/// How long a copy stays owed without its message coming round: long enough for a message given back every few
/// seconds during an alarm, short enough that a message gone elsewhere is soon forgotten.
const KEPT_FOR: Duration = Duration::from_secs(600);

/// The copy owed to one message: why, and how many retries it had spent.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Owed {
    pub(super) fault: FaultText,
    pub(super) retry_count: i32,
}

/// Which copy of a message a delivery is: a copy `replay` sent carries the run's tag and its replay count
/// ([`crate::amqp::copy`]), which the broker's redelivery and a copy put at the tail of the queue keep and the next
/// replay changes; `None` for a message never replayed. The tag is cut to a bound: a header can hold anything.
pub(super) type CopyOf = Option<(String, u32)>;

const MOST_TAG: usize = 128;

/// Which copy of its message `properties` are ([`CopyOf`]).
pub(super) fn copy_of(properties: &BasicProperties) -> CopyOf {
    let headers = properties.headers().as_ref();
    let run = dead_letter::header_text(headers, REPLAY_RUN_HEADER)?;
    let count = headers
        .and_then(|h| h.inner().get(REPLAY_COUNT_HEADER))
        .and_then(failure::as_u32)
        .unwrap_or(0);
    Some((limits::truncate(&run, MOST_TAG).into_owned(), count))
}

type Key = (Uuid, Fingerprint, CopyOf);

#[derive(Debug)]
pub(super) struct OwedCopies(Recent<Key, Owed>);

impl Default for OwedCopies {
    fn default() -> Self {
        Self(Recent::new(MOST, KEPT_FOR))
    }
}

impl OwedCopies {
    /// The message's copy was decided and not made; it goes back to its queue owed it.
    pub(super) fn remember(&self, id: Uuid, fingerprint: Fingerprint, copy: CopyOf, owed: Owed) {
        // Cut as the copy's headers cut them (so the copy made later is the same); cut again, they do not change.
        let (kind, message, description) = owed.fault;
        let owed = Owed {
            fault: (
                kind,
                limits::truncate(&message, limits::MAX_HEADER_TEXT).into_owned(),
                limits::truncate(&description, limits::MAX_STACK_TRACE).into_owned(),
            ),
            retry_count: owed.retry_count,
        };
        self.0.insert((id, fingerprint, copy), owed);
    }

    /// A first delivery of the message (`properties` its delivery's): the message owed never comes round as one, so
    /// this is another copy of it, sent again, which is tried; the decision about the one owed is forgotten.
    pub(super) fn sent_again(
        &self,
        id: Uuid,
        fingerprint: Fingerprint,
        properties: &BasicProperties,
    ) {
        if !self.0.is_empty() {
            let _ = self.0.take(&(id, fingerprint, copy_of(properties)));
        }
    }

    /// The copy owed to this message, if any, taken: made again and refused again, it is remembered again.
    pub(super) fn take(&self, id: Uuid, fingerprint: Fingerprint, copy: CopyOf) -> Option<Owed> {
        self.0.take(&(id, fingerprint, copy))
    }
}

/// A message that came round owed its copy to the error queue ([`owed`](super::owed)) goes straight to it, its work
/// not tried again — unless another process processed it meanwhile (it went back to the queue, and an ack can be lost
/// after a commit): the inbox is asked first, by a claim whose transaction is rolled back, which waits for an attempt
/// in flight elsewhere as any claim does. Processed, it is a copy like any other. A conflict stays one: it goes
/// straight to its copy.
pub(super) async fn owed_copy<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    owed: Owed,
) -> Disposition {
    let id = ready.incoming.message_id;
    let mut backoff = Backoff::new(OUTAGE_DELAY_MIN, OUTAGE_DELAY_MAX);
    if owed.fault.0 != CONFLICT_FAULT {
        loop {
            let looked = {
                let _shared = shared.alone.read().await;
                look(shared, id, Some(ready.fingerprint), ready.carried).await
            };
            match looked {
                Ok(Looked::Free) => {
                    database_back(shared);
                    break;
                }
                Ok(Looked::Taken(Outcome::Duplicate)) => {
                    database_back(shared);
                    duplicate(shared, id);
                    return Disposition::Ack;
                }
                // The claim recorded it: moved aside as a conflict.
                Ok(Looked::Taken(Outcome::Conflict(c))) => {
                    database_back(shared);
                    return conflict(shared, link, delivery, ready, c).await;
                }
                // Waited out as any attempt's outage, still owed meanwhile: the message may come back on another
                // connection while this one waits.
                Err(ProcessError::Unavailable(e)) => {
                    unavailable(shared, id, &e);
                    let copy = copy_of(&delivery.properties);
                    shared
                        .owed
                        .remember(id, ready.fingerprint, copy.clone(), owed.clone());
                    if wait_to_retry(shared, link, id, backoff.next_delay()).await {
                        return Disposition::Requeue;
                    }
                    if shared.owed.take(id, ready.fingerprint, copy).is_none() {
                        // Taken by its delivery on a new connection: this one goes back, not acknowledged.
                        return Disposition::Requeue;
                    }
                }
                // Anything else (no time to claim it by): the usual way, which tells it apart.
                _ => return poison::redelivered(shared, link, delivery, ready).await,
            }
        }
    }
    tracing::debug!(
        message_id = %id,
        "its move to the error queue was decided before and its copy not taken; moving it without trying it again"
    );
    let moved = error_queue(shared, link, delivery, ready, &owed.fault, owed.retry_count).await;
    if matches!(moved, Disposition::Ack) && owed.fault.0 == poison::POISON_FAULT {
        poison::moved_aside_later(shared, id).await;
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn owed(reason: &str) -> Owed {
        Owed {
            fault: (
                "inboxctl::ConsumerFailed",
                reason.to_owned(),
                reason.to_owned(),
            ),
            retry_count: 2,
        }
    }

    #[test]
    fn a_copy_owed_is_taken_once_for_the_same_event_only() {
        let copies = OwedCopies::default();
        let (id, event, other) = (
            Uuid::now_v7(),
            Fingerprint::from_bytes([1; 16]),
            Fingerprint::from_bytes([2; 16]),
        );
        copies.remember(id, event, None, owed("boom"));
        assert_eq!(
            copies.take(id, other, None),
            None,
            "an id reused for another event"
        );
        assert_eq!(copies.take(id, event, None), Some(owed("boom")));
        assert_eq!(copies.take(id, event, None), None, "taken");
    }

    fn replayed(run: &str) -> BasicProperties {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(REPLAY_RUN_HEADER.into(), limits::long_string(run));
        headers.insert(
            REPLAY_COUNT_HEADER.into(),
            lapin::types::AMQPValue::LongInt(1),
        );
        BasicProperties::default().with_headers(headers)
    }

    #[test]
    fn a_replays_copy_is_not_the_message_owed_and_a_first_delivery_forgets_its_own() {
        let copies = OwedCopies::default();
        let (id, event) = (Uuid::now_v7(), Fingerprint::from_bytes([1; 16]));
        let (original, replay) = (BasicProperties::default(), replayed("run-1"));
        copies.remember(id, event, copy_of(&original), owed("boom"));
        assert_eq!(copies.take(id, event, copy_of(&replay)), None);
        assert_eq!(
            copies.take(id, event, copy_of(&original)),
            Some(owed("boom"))
        );

        copies.remember(id, event, copy_of(&replay), owed("boom"));
        copies.sent_again(id, event, &original);
        copies.sent_again(id, event, &replayed("run-2"));
        assert!(!copies.0.is_empty(), "another copy's first delivery");
        copies.sent_again(id, event, &replay);
        assert_eq!(copies.take(id, event, copy_of(&replay)), None);

        let (tag, count) = copy_of(&replayed(&"r".repeat(100_000))).unwrap();
        assert!(tag.len() < 2 * MOST_TAG, "{tag}");
        assert_eq!(count, 1);
    }

    #[test]
    fn a_copy_owed_too_long_or_beyond_the_bound_is_forgotten() {
        let copies = OwedCopies::default();
        let start = Instant::now();
        let event = Fingerprint::from_bytes([1; 16]);
        let stale = Uuid::now_v7();
        copies.0.insert_at((stale, event, None), owed("old"), start);
        assert_eq!(
            copies.0.take_at(&(stale, event, None), start + KEPT_FOR),
            None
        );

        let ids: Vec<Uuid> = (0..=MOST).map(|_| Uuid::now_v7()).collect();
        for (i, id) in ids.iter().enumerate() {
            let at = start + Duration::from_millis(u64::try_from(i).unwrap());
            copies.0.insert_at((*id, event, None), owed("boom"), at);
        }
        let now = start + Duration::from_secs(1);
        assert_eq!(copies.0.len(), MOST);
        assert_eq!(
            copies.0.take_at(&(ids[0], event, None), now),
            None,
            "the oldest went"
        );
        assert!(copies.0.take_at(&(ids[MOST], event, None), now).is_some());
        assert!(copies.0.take_at(&(ids[1], event, None), now).is_some());
    }

    #[test]
    fn a_fault_is_kept_as_its_copys_headers_would_carry_it() {
        let copies = OwedCopies::default();
        let (id, event) = (Uuid::now_v7(), Fingerprint::from_bytes([1; 16]));
        let long = "x".repeat(100_000);
        copies.remember(id, event, None, owed(&long));
        let kept = copies.take(id, event, None).unwrap().fault;
        assert_eq!(kept.1, limits::truncate(&long, limits::MAX_HEADER_TEXT));
        assert_eq!(kept.2, limits::truncate(&long, limits::MAX_STACK_TRACE));
        assert_eq!(limits::truncate(&kept.2, limits::MAX_STACK_TRACE), kept.2);
    }
}
