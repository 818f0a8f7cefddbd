//! One delivery, from reading it to settling it: read (or moved aside at once), processed in transactions of its
//! own with retries and outage waits, and acknowledged only once its outcome is committed or its copy confirmed.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use futures_util::FutureExt as _;
use lapin::message::Delivery;
use uuid::Uuid;

use super::Consumer;
use super::bookkeeping::record_event;
use super::link::Link;
use super::move_aside::{CONFLICT_FAULT, dead_letter_error, error_queue, skip, unreadable_fault};
use super::outage::{Timeouts, database_back, unavailable, wait_to_retry};
use super::owed;
use super::poison;
use super::{
    HOLD_IMPOSSIBLE, MessageContext, OUTAGE_DELAY_MAX, OUTAGE_DELAY_MIN, OnConflict, Shared,
    error_chain, logged, panic_message, property_id, retry_delay, sleep_or_cancel,
};
use crate::amqp::envelope::{self, Incoming};
use crate::backoff::Backoff;
use crate::failpoint;
use crate::inbox::{Carried, Conflict, Fingerprint, Outcome, ProcessError, Work};

pub(super) use super::settle::{Disposition, settle, settle_acker, settled};

/// Handles one delivery on its own (not batched) and settles it with the broker. A panic anywhere in its handling
/// (not only in the consumer's work, which counts as a failed attempt) gives the delivery back, never leaves it
/// unsettled.
///
/// It holds `worker` (a place among `--concurrency`) until it is settled, but for the pause before a message given
/// back goes back: waiting takes no worker, and the broker's prefetch bounds how many wait. On a partition queue it
/// holds it throughout: the partition's next message must not overtake the one going back.
pub(super) async fn handle<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: Delivery,
    worker: tokio::sync::OwnedSemaphorePermit,
) {
    let started = Instant::now();
    let mut disposition = dispose_caught(shared, link, &delivery, false).await;
    if shared.options.partitions.is_some() {
        // A message that cannot be settled now (its handling panicked, its dead-letter copy refused) is handled again
        // here after its pause, not given back: given back, it would come round behind the partition's later
        // messages that the broker has sent already (up to the prefetch), and they would overtake it. A stop or a
        // lost connection gives it back, in order, as for any message of the partition. Not for ever: after
        // IN_PLACE_TRIES it goes back as elsewhere (its key's order then lost, as for a message moved aside), so that
        // one that can never be settled (a copy that can never be made, a handling that always panics) does not hold
        // its partition for good, unacknowledged where nobody can move it by hand.
        let mut tries = 0;
        while let Disposition::RequeueAfter(pause) = disposition
            && pause < HOLD_IMPOSSIBLE
            && tries < IN_PLACE_TRIES
        {
            tries += 1;
            let stopped = tokio::select! {
                stopped = sleep_or_cancel(pause, &shared.shutdown) => stopped,
                () = link.given_up() => true,
            };
            if stopped || link.is_lost() {
                break;
            }
            disposition = dispose_caught(shared, link, &delivery, true).await;
        }
    } else if matches!(disposition, Disposition::RequeueAfter(_)) {
        drop(worker);
    }
    settle(shared, link, &delivery, disposition, started).await;
}

/// How many times a partition's message that cannot be settled now is handled again in place before it goes back.
const IN_PLACE_TRIES: u32 = 3;

/// [`dispose`] (`again`: handled before in this process, as a redelivery is), a panic in it taken as
/// [`handling_panicked`].
async fn dispose_caught<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    again: bool,
) -> Disposition {
    match AssertUnwindSafe(dispose(shared, link, delivery, again))
        .catch_unwind()
        .await
    {
        Ok(disposition) => disposition,
        Err(panic) => handling_panicked(delivery, &panic_message(&*panic)),
    }
}

/// Handles one delivery to its disposition; `again` when this process handled it before without settling it, which
/// makes it a redelivery: its owed dead-letter copy made, its start counted.
pub(super) async fn dispose<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    again: bool,
) -> Disposition {
    match prepare(shared, link, delivery).await {
        Prepared::Done(disposition) => disposition,
        Prepared::Ready(ready) if redelivered(delivery, &shared.options.queue) || again => {
            let copy = owed::copy_of(&delivery.properties);
            if let Some(owed) = shared
                .owed
                .take(ready.incoming.message_id, ready.fingerprint, copy)
            {
                return owed::owed_copy(shared, link, delivery, &ready, owed).await;
            }
            poison::redelivered(shared, link, delivery, &ready).await
        }
        Prepared::Ready(ready) => {
            shared.owed.sent_again(
                ready.incoming.message_id,
                ready.fingerprint,
                &delivery.properties,
            );
            attempts(shared, link, delivery, &ready, 1, Access::Shared).await
        }
    }
}

/// Whether a delivery is a redelivery: the broker's flag, or a consumer's mark on a message it gave back to the
/// tail of its queue (`queue`, through the default exchange: [`crate::amqp::tail::GIVEN_BACK_HEADER`]): the
/// mark on a message published otherwise is a producer's, not taken.
pub(super) fn redelivered(delivery: &Delivery, queue: &str) -> bool {
    delivery.redelivered
        || (delivery.exchange.as_str().is_empty()
            && delivery.routing_key.as_str() == queue
            && crate::amqp::tail::given_back(&delivery.properties))
}

/// Handling a delivery panicked outside the consumer's work (a bug of inboxctl's, or of a library under it): said,
/// and the delivery given back after a pause, so that it cannot come round in a tight loop.
pub(super) fn handling_panicked(delivery: &Delivery, panic: &str) -> Disposition {
    tracing::error!(
        message_id = ?property_id(&delivery.properties),
        panic = %logged(panic),
        "handling a message panicked; it goes back to the queue"
    );
    Disposition::RequeueAfter(OUTAGE_DELAY_MAX)
}

/// A delivery that could be read, of a type this consumer handles, with its event decoded.
pub(super) struct Ready<M> {
    pub(super) incoming: Incoming,
    pub(super) message: M,
    pub(super) message_type: Option<String>,
    pub(super) fingerprint: Fingerprint,
    /// The times it carries besides its id (a partitioned inbox keys it on one of them).
    pub(super) carried: Carried,
}

pub(super) enum Prepared<M> {
    /// Dead-lettered or skipped already.
    Done(Disposition),
    Ready(Ready<M>),
}

/// Reads a delivery; what cannot be read goes to the error queue, what this consumer does not handle to the skipped
/// queue, both at once.
pub(super) async fn prepare<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
) -> Prepared<C::Message> {
    let label = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str());
    failpoint::hit_with("handle", label.unwrap_or_default()).await;
    let incoming = match envelope::parse(&delivery.properties, &delivery.data) {
        Ok(incoming) => incoming,
        Err(unreadable) => {
            let id = property_id(&delivery.properties);
            tracing::warn!(
                message_id = id.map(|i| i.to_string()).unwrap_or_default(),
                reason = %logged(&unreadable.to_string()),
                "unreadable message; moving it to the error queue"
            );
            let fault = unreadable_fault(&unreadable);
            return Prepared::Done(
                dead_letter_error(shared, link, delivery, id, None, &fault, 0).await,
            );
        }
    };
    // The consumer's own code — which types it handles, how its message decodes (a `deserialize_with` of its own) —
    // panics on this message alone, the same at every delivery: a message that cannot be read, moved to the error
    // queue. Taken as a panic of the handling, it was given back every 5 s for ever, never in the error queue.
    // A MassTransit envelope that declares no type (none given, or `[]`) is no consumer's to MassTransit, which moves it
    // to `_skipped`: so here (a plain JSON message that declares none is taken for the consumer's type instead).
    let handles = if incoming.masstransit && incoming.message_types.is_empty() {
        Ok(false)
    } else {
        std::panic::catch_unwind(|| C::handles(&incoming.message_types))
    };
    let decoded = match handles {
        Ok(false) => return Prepared::Done(skip(shared, link, delivery, &incoming).await),
        Ok(true) => std::panic::catch_unwind(AssertUnwindSafe(|| {
            serde_json::from_str::<C::Message>(incoming.payload.get())
        })),
        Err(panic) => Err(panic),
    };
    // The type consumed, as MassTransit names it in a fault: the consumer's, not the envelope's first (a message may
    // list several types, the consumer's not first among them).
    let message_type = Some(envelope::dotnet_type_name(C::MESSAGE_TYPE));
    if let Some(partitions) = &shared.options.partitions {
        check_routing_key(shared, delivery, &incoming, &partitions.key);
    }
    let decoded = match decoded {
        Ok(decoded) => decoded.map_err(|e| e.to_string()),
        Err(panic) => Err(format!("panicked: {}", panic_message(&*panic))),
    };
    match decoded {
        Ok(message) => Prepared::Ready(Ready {
            fingerprint: envelope::fingerprint(&incoming.payload),
            carried: envelope::carried(incoming.sent_time, &delivery.properties),
            incoming,
            message,
            message_type,
        }),
        Err(e) => {
            // Masked: a panic's message may quote a URL.
            let reason = crate::redact::text(&format!(
                "the message cannot be read as {}: {e}",
                envelope::dotnet_type_name(C::MESSAGE_TYPE)
            ));
            tracing::warn!(message_id = %incoming.message_id, reason = %logged(&reason), "moving message to the error queue");
            let fault = ("inboxctl::MalformedMessage", reason.clone(), reason);
            let id = Some(incoming.message_id);
            Prepared::Done(
                dead_letter_error(shared, link, delivery, id, message_type, &fault, 0).await,
            )
        }
    }
}

/// Partitioned: says (once per partition queue) that a message came with another routing key than its partition
/// key. The exchange hashed that routing key, so such messages may sit in other partitions than the other messages of
/// their key, and their order among them is not kept. It is processed all the same: what counts is exactly once.
fn check_routing_key<C: Consumer>(
    shared: &Shared<C>,
    delivery: &Delivery,
    incoming: &Incoming,
    key: &str,
) {
    // Through the default exchange, by the queue's name: a replay putting a copy back where it failed, not a publisher
    // of the event (said once a queue, a replay's copies would leave a publisher that does not set the key unsaid).
    if delivery.exchange.as_str().is_empty() {
        return;
    }
    let value = envelope::field_text(&incoming.payload, key);
    if value.as_deref() == Some(delivery.routing_key.as_str())
        || shared.routing_key_warned.swap(true, Ordering::Relaxed)
    {
        return;
    }
    tracing::warn!(
        queue = %shared.queue,
        message_id = %incoming.message_id,
        routing_key = %logged(delivery.routing_key.as_str()),
        partition_key = %logged(key),
        value = %logged(value.as_deref().unwrap_or("(none)")),
        "a message was published with another routing key than its partition key: the exchange spreads messages by \
         routing key, so the order of such messages among the others of their key is not kept; publishers must set the \
         routing key to the partition key (said once per partition queue)"
    );
}

/// What the consumer is told about attempt `attempt` of `delivery`.
pub(super) fn context<C: Consumer>(
    shared: &Shared<C>,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
) -> MessageContext {
    MessageContext {
        message_id: ready.incoming.message_id,
        consumer_type: shared.inbox.consumer_type().clone(),
        redelivered: redelivered(delivery, &shared.options.queue),
        attempt,
    }
}

pub(super) fn work<C: Consumer>(
    shared: &Shared<C>,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
) -> Work<()> {
    let context = context(shared, delivery, ready, attempt);
    let consumer = Arc::clone(&shared.consumer);
    let message = ready.message.clone();
    Box::new(move |tx| Box::pin(async move { consumer.consume(tx, &context, &message).await }))
}

/// Attempt `attempt` of the message with its work as one statement sent with the claim
/// ([`Inbox::process_effect`](crate::inbox::Inbox::process_effect)), when the consumer writes it so; `None` when it
/// does not (or cannot tell: an error of its `effect` is its `consume`'s to tell, after the claim, where a copy of a
/// message done is still a copy).
pub(super) async fn as_one_statement<C: Consumer>(
    shared: &Shared<C>,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
) -> Option<Result<Outcome<()>, ProcessError>> {
    let context = context(shared, delivery, ready, attempt);
    let Ok(Some(effect)) = shared.consumer.effect(&context, &ready.message).await else {
        return None;
    };
    let usual = work(shared, delivery, ready, attempt);
    let (id, fingerprint) = (ready.incoming.message_id, Some(ready.fingerprint));
    Some(
        (shared.inbox)
            .process_effect(id, fingerprint, ready.carried, effect, usual)
            .await,
    )
}

/// Whether an attempt may run beside others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    Shared,
    /// A suspect's (its start): nothing else may be in flight in this process while it runs.
    Alone(poison::Start),
}

/// Processes one message in transactions of its own, from attempt `first` on: retries what fails, waits out outages.
/// Each attempt holds [`Shared::alone`] (shared, or alone for a suspect) while it runs, and only then: a retry's wait
/// holds up nobody.
pub(super) async fn attempts<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    first: u32,
    access: Access,
) -> Disposition {
    let id = ready.incoming.message_id;
    let mut attempt = first;
    let mut backoff = Backoff::new(OUTAGE_DELAY_MIN, OUTAGE_DELAY_MAX);
    // Whether the database may hold a count alone of this start now: counted as an attempt alone begins, taken back as
    // it returns; one the database did not take back stays, and is not counted again.
    let mut counted_alone = false;
    let mut timeouts = Timeouts::default();
    loop {
        let result = {
            // A suspect is counted alone for as long as it holds the lock alone, each attempt, and only then.
            let _guard = match access {
                Access::Shared => Guard::Shared {
                    _held: shared.alone.read().await,
                },
                Access::Alone(start) => {
                    let guard = Guard::Alone {
                        _held: shared.alone.write().await,
                    };
                    if !counted_alone {
                        poison::starting_alone(shared, id, start).await;
                        counted_alone = true;
                    }
                    guard
                }
            };
            let work = async {
                match as_one_statement(shared, delivery, ready, attempt).await {
                    Some(result) => result,
                    None => {
                        let usual = work(shared, delivery, ready, attempt);
                        (shared.inbox)
                            .process_event(id, Some(ready.fingerprint), ready.carried, usual)
                            .await
                    }
                }
            };
            let result = AssertUnwindSafe(work).catch_unwind().await;
            if let Access::Alone(start) = access
                && counted_alone
                && poison::returned_alone(shared, id, start).await
            {
                counted_alone = false;
            }
            result
        };
        let failure = match result {
            Ok(Ok(outcome)) => {
                database_back(shared);
                match outcome {
                    Outcome::Processed(()) => {
                        processed(shared, id);
                        failpoint::hit("after-commit").await;
                    }
                    Outcome::Duplicate => duplicate(shared, id),
                    Outcome::Conflict(c) => {
                        return conflict(shared, link, delivery, ready, c).await;
                    }
                }
                return Disposition::Ack;
            }
            Ok(Err(ProcessError::Unavailable(e))) => match timeouts.own(shared, &e).await {
                Some(failure) => failure,
                None => {
                    unavailable(shared, id, &e);
                    if wait_to_retry(shared, link, id, backoff.next_delay()).await {
                        return Disposition::Requeue;
                    }
                    continue;
                }
            },
            // The work's failure, after the claim: the database took the inbox's statement.
            Ok(Err(ProcessError::Failed(e))) => {
                database_back(shared);
                timeouts.reset();
                error_chain(&e)
            }
            // Not taken for PostgreSQL's answer: most refusals are decided before it is asked (no usable time), and
            // one during an outage would end it while PostgreSQL is still unreachable. The outage's own look at a
            // claim sees its end.
            Ok(Err(ProcessError::Unclaimable(reason))) => {
                return unclaimable(shared, link, delivery, ready, &reason).await;
            }
            Err(panic) => {
                timeouts.reset();
                // Kept as the reason, as `error_chain`'s is, and as masked: a panic's message may show a URL.
                crate::redact::text(&format!("panicked: {}", panic_message(&*panic)))
            }
        };
        if let Some(disposition) = failed(shared, link, delivery, ready, attempt, failure).await {
            return disposition;
        }
        attempt += 1;
    }
}

/// The hold an attempt has on [`Shared::alone`].
pub(super) enum Guard<'a> {
    Shared {
        _held: tokio::sync::RwLockReadGuard<'a, ()>,
    },
    Alone {
        _held: tokio::sync::RwLockWriteGuard<'a, ()>,
    },
}

/// Counts and records a failed attempt. After the last attempt the message goes to the error queue (the returned
/// disposition); before it, this waits the retry delay and returns `None` — or `Requeue` if a stop came meanwhile, or
/// the connection the message came on was lost.
pub(super) async fn failed<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    attempt: u32,
    failure: String,
) -> Option<Disposition> {
    let id = ready.incoming.message_id;
    shared
        .counts
        .failed_attempts
        .fetch_add(1, Ordering::Relaxed);
    record_event(shared, "failed", Some(id), &failure).await;
    if attempt >= shared.options.max_attempts {
        tracing::warn!(
            message_id = %id,
            attempts = attempt,
            reason = %logged(&failure),
            "giving up; moving message to the error queue"
        );
        let first_line = failure.lines().next().unwrap_or_default().to_owned();
        let fault = ("inboxctl::ConsumerFailed", first_line, failure);
        let retries = i32::try_from(attempt - 1).unwrap_or(i32::MAX);
        return Some(error_queue(shared, link, delivery, ready, &fault, retries).await);
    }
    let delay = retry_delay(shared.options.retry_delay, attempt);
    tracing::warn!(
        message_id = %id,
        attempt,
        retry_in = ?delay,
        reason = %logged(&failure),
        "attempt failed"
    );
    wait_to_retry(shared, link, id, delay)
        .await
        .then_some(Disposition::Requeue)
}

/// A message the inbox cannot claim (a partitioned inbox, and no usable time): never processed, moved to the error
/// queue at once with the reason — retrying cannot give it a time.
pub(super) async fn unclaimable<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    reason: &str,
) -> Disposition {
    tracing::warn!(
        message_id = %ready.incoming.message_id,
        reason = %logged(reason),
        "the inbox cannot claim this message; moving it to the error queue"
    );
    let text = format!("the inbox cannot claim this message: {reason}");
    let fault = ("inboxctl::UnclaimableMessage", text.clone(), text);
    error_queue(shared, link, delivery, ready, &fault, 0).await
}

pub(super) fn processed<C: Consumer>(shared: &Shared<C>, id: Uuid) {
    shared.counts.processed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(message_id = %id, "processed");
}

pub(super) fn duplicate<C: Consumer>(shared: &Shared<C>, id: Uuid) {
    shared.counts.duplicates.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        message_id = %id,
        consumer_type = %shared.inbox.consumer_type(),
        "duplicate discarded"
    );
}

/// A copy whose message id was processed before for another event: never processed; logged as a conflict (the claim
/// recorded it), then moved to the error queue or dropped, as the operator chose, and counted once that is done (its
/// copy confirmed: [`error_queue`] counts it).
pub(super) async fn conflict<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    delivery: &Delivery,
    ready: &Ready<C::Message>,
    conflict: Conflict,
) -> Disposition {
    let id = ready.incoming.message_id;
    let then = match shared.options.on_conflict {
        OnConflict::DeadLetter => "moving it to the error queue",
        OnConflict::Discard => "discarding it (--on-conflict discard)",
    };
    tracing::warn!(
        message_id = %id,
        consumer_type = %shared.inbox.consumer_type(),
        first_event = %conflict.first,
        this_event = %conflict.this,
        "message id reused for another event: this message was not processed; {then}"
    );
    match shared.options.on_conflict {
        OnConflict::Discard => {
            shared.counts.conflicts.fetch_add(1, Ordering::Relaxed);
            Disposition::Ack
        }
        OnConflict::DeadLetter => {
            let reason = format!(
                "message id {id} was processed before for another event (fingerprint {}; this message's {}): the id \
                 was reused for a different message, which was not processed",
                conflict.first, conflict.this
            );
            let fault = (CONFLICT_FAULT, reason.clone(), reason);
            error_queue(shared, link, delivery, ready, &fault, 0).await
        }
    }
}
