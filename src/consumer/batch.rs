//! Batched consumption (`--batch-size` > 1): deliveries that arrive together share one transaction
//! ([`Inbox::process_batch`](crate::inbox::Inbox::process_batch)).
//!
//! A batch worker only runs batches. Whatever takes time beyond the batch's transaction — a failed member's retries and
//! their waits, a copy of a member's id, a dead-letter copy the broker refused and its pause, the members of a batch
//! that failed as a whole — goes on in a task of its own beside the worker, so that one slow message never holds up
//! the batches behind it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use futures_util::FutureExt as _;
use lapin::Acker;
use lapin::message::Delivery;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::acks::ack_all;
use super::dispatch::{
    Access, Disposition, Prepared, Ready, as_one_statement, attempts, conflict, context, duplicate,
    failed, handling_panicked, prepare, processed, settle, settle_acker, settled, unclaimable,
};
use super::link::Link;
use super::outage::{POOL_BUSY, database_back, database_gone, pool_busy};
use super::{
    Consumer, MessageContext, OUTAGE_DELAY_MAX, OUTAGE_DELAY_MIN, Shared, error_chain, logged,
    panic_message, sleep_or_cancel,
};
use crate::backoff::Backoff;
use crate::failpoint;
use crate::inbox::{
    Member, MemberOutcome, MemberWork, Outcome, ProcessError, TogetherWork, WorkError,
};

/// A delivery waiting for a batch, with the broker connection it came on.
pub(super) type Queued = (Delivery, Arc<Link>);

/// A member of a batch: a delivery read and ready.
type Held<C> = (Delivery, Arc<Link>, Ready<<C as Consumer>::Message>);

/// Takes deliveries off `queue` in batches of up to `batch_size` and processes each batch in one transaction. A batch
/// starts with whatever is waiting; it waits up to `batch_wait` for more only while another batch is running, so a
/// lone message never waits.
pub(super) async fn worker<C: Consumer>(
    shared: Arc<Shared<C>>,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Queued>>>,
    running: Arc<AtomicUsize>,
) {
    // Dropped (and its tasks with it) if the worker is abandoned at the shutdown timeout, like any work in flight.
    let mut aside = Aside::default();
    while let Some(batch) = next(&shared, &queue, &running).await {
        while aside.tasks.try_join_next().is_some() {}
        aside.taken.clear();
        running.fetch_add(1, Ordering::SeqCst);
        let ackers: Vec<(Acker, u64, Arc<Link>)> = batch
            .iter()
            .map(|(d, link)| (d.acker.clone(), d.delivery_tag, Arc::clone(link)))
            .collect();
        let ran = super::alarm::in_a_batch(run(&shared, batch, &mut aside));
        if let Err(panic) = AssertUnwindSafe(ran).catch_unwind().await {
            tracing::error!(
                panic = %logged(&panic_message(&*panic)),
                "handling a batch panicked; what it had not settled goes back to the queue"
            );
            // What the batch settled (alone, or with others by a `multiple` ack), or handed to a task of its own,
            // stays as it is: given back while its task still runs it, a delivery would come round and be run twice
            // over (its attempts, its copy to the error queue). One whose channel closed is counted out of flight
            // here: the broker delivers it again.
            let unsettled = ackers.into_iter().filter(|(a, tag, link)| {
                if a.poisoned() {
                    settled(&shared, link, *tag, false);
                }
                a.usable() && link.outstanding.contains(*tag) && !aside.took(link, *tag)
            });
            let unsettled: Vec<_> = unsettled.collect();
            for (acker, tag, link) in unsettled {
                let shared = Arc::clone(&shared);
                aside.tasks.spawn(async move {
                    let disposition = Disposition::RequeueAfter(OUTAGE_DELAY_MAX);
                    settle_acker(&shared, &link, &acker, tag, disposition).await;
                });
            }
        }
        running.fetch_sub(1, Ordering::SeqCst);
    }
    while aside.tasks.join_next().await.is_some() {}
}

/// The tasks beside a batch worker, and which deliveries of its current batch they took over: theirs to settle,
/// never the worker's clean-up after a panic.
#[derive(Default)]
struct Aside {
    tasks: JoinSet<()>,
    /// Each as its link (by address) and delivery tag.
    taken: Vec<(usize, u64)>,
}

impl Aside {
    /// Runs `task`, which settles the delivery `tag` of `link`, beside the worker.
    fn take(
        &mut self,
        link: &Arc<Link>,
        tag: u64,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.taken.push((Arc::as_ptr(link) as usize, tag));
        self.tasks.spawn(task);
    }

    fn took(&self, link: &Arc<Link>, tag: u64) -> bool {
        self.taken.contains(&(Arc::as_ptr(link) as usize, tag))
    }
}

/// The next batch; `None` once the queue is closed (a stop, an idle end, a lost connection). After a stop, what is
/// still queued is no worker's yet: it goes back to the queue at once, for the other consumers, as what the consume
/// loop had not handed over does, rather than run while the stop drains.
async fn next<C: Consumer>(
    shared: &Shared<C>,
    queue: &tokio::sync::Mutex<mpsc::Receiver<Queued>>,
    running: &AtomicUsize,
) -> Option<Vec<Queued>> {
    failpoint::hit("batch-next").await;
    // As `Inbox::process_batch` takes (the command line's `--batch-size` is checked; a library caller's is not).
    let size = shared.options.batch_size.clamp(1, crate::inbox::MAX_BATCH);
    let mut rx = queue.lock().await;
    let first = loop {
        let queued = rx.recv().await?;
        if !shared.shutdown.is_cancelled() {
            break queued;
        }
        give_back(shared, vec![queued]).await;
    };
    let mut batch = vec![first];
    // What comes after a stop is no batch's: it goes back too (the batch gathered so far runs).
    let mut after_stop = Vec::new();
    while batch.len() < size {
        match rx.try_recv() {
            Ok(queued) if shared.shutdown.is_cancelled() => after_stop.push(queued),
            Ok(queued) => batch.push(queued),
            Err(_) => break,
        }
    }
    if batch.len() < size && running.load(Ordering::SeqCst) > 0 {
        let deadline = tokio::time::Instant::now() + shared.options.batch_wait;
        while batch.len() < size && !shared.shutdown.is_cancelled() {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(queued)) if shared.shutdown.is_cancelled() => after_stop.push(queued),
                Ok(Some(queued)) => batch.push(queued),
                _ => break,
            }
        }
    }
    drop(rx);
    give_back(shared, after_stop).await;
    Some(batch)
}

/// At a stop, what is queued for the batch workers and in no batch yet goes back to the queue at once (see [`next`]);
/// a worker waiting in `next` for a delivery holds the queue and gives back what comes itself.
pub(super) async fn give_back_queued<C: Consumer>(
    shared: &Shared<C>,
    queue: &tokio::sync::Mutex<mpsc::Receiver<Queued>>,
) {
    let Ok(mut rx) = queue.try_lock() else {
        return;
    };
    let mut queued = Vec::new();
    while let Ok(one) = rx.try_recv() {
        queued.push(one);
    }
    drop(rx);
    give_back(shared, queued).await;
}

/// Gives `queued` back to the queue: a nack each (a partition queue's stays unacknowledged, to go back with the
/// close, in order: `settle_acker`).
async fn give_back<C: Consumer>(shared: &Shared<C>, queued: Vec<Queued>) {
    let given_back = queued.len();
    for (delivery, link) in queued {
        let requeue = Disposition::Requeue;
        settle_acker(
            shared,
            &link,
            &delivery.acker,
            delivery.delivery_tag,
            requeue,
        )
        .await;
    }
    if given_back > 0 {
        tracing::info!(
            given_back,
            "stopping: deliveries queued for the batch workers given back to the queue"
        );
    }
}

async fn run<C: Consumer>(shared: &Arc<Shared<C>>, batch: Vec<Queued>, aside: &mut Aside) {
    let started = Instant::now();
    // Read each delivery; two copies of one id in a batch: the later one waits for the batch's outcome.
    let mut members: Vec<Held<C>> = Vec::with_capacity(batch.len());
    let mut later: Vec<Held<C>> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (delivery, link) in batch {
        match prepare(shared, &link, &delivery).await {
            Prepared::Done(disposition) => {
                finish(shared, aside, link, delivery, disposition, started).await
            }
            Prepared::Ready(ready) => {
                // Batched, a message is a first delivery (a redelivery is processed on its own).
                shared.owed.sent_again(
                    ready.incoming.message_id,
                    ready.fingerprint,
                    &delivery.properties,
                );
                if ids.insert(ready.incoming.message_id) {
                    members.push((delivery, link, ready));
                } else {
                    later.push((delivery, link, ready));
                }
            }
        }
    }

    match commit(shared, &members).await {
        Committed::Outcomes(outcomes) => {
            settle_outcomes(shared, aside, members, outcomes, started).await
        }
        Committed::OneByOne => later.extend(members),
        Committed::Stopped => {
            for (delivery, link, _) in members.iter().chain(&later) {
                settle(shared, link, delivery, Disposition::Requeue, started).await;
            }
            return;
        }
    }
    for (delivery, link, ready) in later {
        let shared = Arc::clone(shared);
        aside.take(&Arc::clone(&link), delivery.delivery_tag, async move {
            let decided = attempts(&shared, &link, &delivery, &ready, 1, Access::Shared);
            let disposition = or_given_back(&delivery, decided).await;
            settle(&shared, &link, &delivery, disposition, started).await;
        });
    }
}

/// Settles the members of a committed batch: the processed and the duplicates acknowledged together (see
/// [`ack_all`]), a conflict as `--on-conflict` says, a failed member retried aside.
async fn settle_outcomes<C: Consumer>(
    shared: &Arc<Shared<C>>,
    aside: &mut Aside,
    members: Vec<Held<C>>,
    outcomes: Vec<MemberOutcome<()>>,
    started: Instant,
) {
    let committed: Vec<uuid::Uuid> = members
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| matches!(o, MemberOutcome::Processed(())))
        .map(|((_, _, ready), _)| ready.incoming.message_id)
        .collect();
    if !committed.is_empty() {
        tracing::debug!(message_ids = ?committed, "batch committed");
        failpoint::hit("after-commit").await;
    }
    // Deliveries to acknowledge, by the link they came on (all the same one, but across a reconnect).
    let mut acks: Vec<(Arc<Link>, Vec<Delivery>)> = Vec::new();
    for ((delivery, link, ready), outcome) in members.into_iter().zip(outcomes) {
        let id = ready.incoming.message_id;
        let disposition = match outcome {
            MemberOutcome::Processed(()) => {
                processed(shared, id);
                Disposition::Ack
            }
            MemberOutcome::Duplicate => {
                duplicate(shared, id);
                Disposition::Ack
            }
            MemberOutcome::Conflict(c) => conflict(shared, &link, &delivery, &ready, c).await,
            MemberOutcome::Unclaimable(reason) => {
                unclaimable(shared, &link, &delivery, &ready, &reason).await
            }
            MemberOutcome::Failed(e) => {
                let member = (delivery, link, ready);
                retry_aside(shared, aside, member, error_chain(&e), started);
                continue;
            }
        };
        if !matches!(disposition, Disposition::Ack) {
            finish(shared, aside, link, delivery, disposition, started).await;
        } else if let Some((_, of_link)) = acks.iter_mut().find(|(l, _)| Arc::ptr_eq(l, &link)) {
            of_link.push(delivery);
        } else {
            acks.push((link, vec![delivery]));
        }
    }
    for (link, deliveries) in acks {
        ack_all(shared, &link, deliveries, started).await;
    }
}

/// A member whose work failed in the batch: its first attempt is counted, and the next ones go on alone, in a task of
/// their own beside the worker.
fn retry_aside<C: Consumer>(
    shared: &Arc<Shared<C>>,
    aside: &mut Aside,
    (delivery, link, ready): Held<C>,
    failure: String,
    started: Instant,
) {
    let shared = Arc::clone(shared);
    aside.take(&Arc::clone(&link), delivery.delivery_tag, async move {
        let decided = async {
            match failed(&shared, &link, &delivery, &ready, 1, failure).await {
                Some(disposition) => disposition,
                None => attempts(&shared, &link, &delivery, &ready, 2, Access::Shared).await,
            }
        };
        let disposition = or_given_back(&delivery, decided).await;
        settle(&shared, &link, &delivery, disposition, started).await;
    });
}

/// What `decided` comes to for `delivery`, in a task beside the worker; if it panics (a dead-letter copy's publish,
/// say: the consumer's own work is caught as a failed attempt), the delivery given back after a pause, as one by one.
/// A panicked task is dropped silently by its `JoinSet`: without this its delivery would stay unsettled, holding a
/// place of the prefetch for good and keeping `--exit-when-idle` from ever seeing the consumer idle.
async fn or_given_back(
    delivery: &Delivery,
    decided: impl std::future::Future<Output = Disposition>,
) -> Disposition {
    match AssertUnwindSafe(decided).catch_unwind().await {
        Ok(disposition) => disposition,
        Err(panic) => handling_panicked(delivery, &panic_message(&*panic)),
    }
}

/// What became of a batch's transaction.
enum Committed {
    Outcomes(Vec<MemberOutcome<()>>),
    /// It failed as a whole (a member panicked, the commit was refused): its members go one by one.
    OneByOne,
    /// A stop came, or the batch's connection was lost, while PostgreSQL was unavailable: its members go back.
    Stopped,
}

/// Runs the batch's transaction, waiting out outages.
async fn commit<C: Consumer>(shared: &Shared<C>, members: &[Held<C>]) -> Committed {
    let mut backoff = Backoff::new(OUTAGE_DELAY_MIN, OUTAGE_DELAY_MAX);
    if members.is_empty() {
        return Committed::Outcomes(Vec::new());
    }
    // What each member's work needs, shared by the member's own work and the batch's together work.
    let items: Arc<Vec<(MessageContext, C::Message)>> = Arc::new(
        members
            .iter()
            .map(|(delivery, _, ready)| {
                (context(shared, delivery, ready, 1), ready.message.clone())
            })
            .collect(),
    );
    loop {
        let result = match alone(shared, members).await {
            Some(result) => result,
            None => {
                let batch: Vec<Member<()>> = members
                    .iter()
                    .enumerate()
                    .map(|(i, (_, _, ready))| Member {
                        message_id: ready.incoming.message_id,
                        fingerprint: Some(ready.fingerprint),
                        carried: ready.carried,
                        work: member_work(shared, &items, i),
                    })
                    .collect();
                let _shared = shared.alone.read().await;
                shared
                    .inbox
                    .process_batch(batch, Some(together_work(shared, &items)))
                    .await
            }
        };
        match result {
            Ok(outcomes) => {
                database_back(shared);
                return Committed::Outcomes(outcomes);
            }
            // A member's key held elsewhere past `--claim-timeout` (or a deadlock): the database is up, and the batch
            // would meet it again. Its members go one by one, each in a task of its own: that member waits alone.
            Err(ProcessError::Unavailable(e)) if crate::db::is_contention(&e) => {
                database_back(shared);
                tracing::warn!(
                    error = %logged(&crate::redact::text(&crate::db::describe(&e))),
                    "batch met another transaction (a member's key held elsewhere past --claim-timeout, a deadlock); \
                     processing its messages one by one"
                );
                return Committed::OneByOne;
            }
            // The round ran past --attempt-timeout: a member's work slow or stuck (a hung call, a query past the
            // bound) would make every try of the batch run out again, its other members never committed and this
            // worker held for good. One by one, each member in a task of its own is bounded alone: the stuck one is
            // tried again alone, the others go on. Intake is held meanwhile, as in any outage, until an attempt or
            // the look at the claim answers: a server gone silent is waited out by this batch's members alone, not
            // by every batch taken after it split in turn.
            Err(ProcessError::Unavailable(e)) if crate::db::is_no_answer(&e) => {
                tracing::warn!(
                    error = %logged(&crate::redact::text(&crate::db::describe(&e))),
                    "batch ran past --attempt-timeout (a member's work slow or stuck, or PostgreSQL silent); \
                     processing its messages one by one"
                );
                database_gone(shared, &e);
                return Committed::OneByOne;
            }
            // Waited out, unless a stop comes or a connection of the batch's members is lost (they can no longer all
            // be settled; the broker delivers again what came on it): then they go back. Every connection of the
            // pool busy past the wait for one is waited out the same, the database not taken for gone (and the batch
            // not split into one task a member, each wanting a connection of the same pool).
            Err(ProcessError::Unavailable(e)) => {
                if pool_busy(shared.inbox.pool(), &e) {
                    tracing::warn!("{POOL_BUSY}: trying the batch again");
                } else {
                    database_gone(shared, &e);
                }
                let mut links: Vec<&Arc<Link>> = Vec::new();
                for (_, link, _) in members {
                    if !links.iter().any(|l| Arc::ptr_eq(l, link)) {
                        links.push(link);
                    }
                }
                let lost =
                    futures_util::future::select_all(links.iter().map(|l| Box::pin(l.lost())));
                let given_up = tokio::select! {
                    stopped = sleep_or_cancel(backoff.next_delay(), &shared.shutdown) => stopped,
                    _ = lost => true,
                };
                if given_up {
                    return Committed::Stopped;
                }
            }
            Err(ProcessError::Unclaimable(reason)) => {
                tracing::warn!(
                    reason = %logged(&reason),
                    "batch could not be claimed; processing its messages one by one"
                );
                return Committed::OneByOne;
            }
            Err(ProcessError::Failed(e)) => {
                tracing::warn!(
                    reason = %logged(&error_chain(&e)),
                    "batch failed as a whole; processing its messages one by one"
                );
                return Committed::OneByOne;
            }
        }
    }
}

/// A batch of one whose work the consumer writes as one SQL statement ([`Consumer::effect`]) goes with its claim as
/// that one statement ([`as_one_statement`]), as it would one by one: one round trip where the batch's transaction
/// takes five (`BEGIN`, the claim, the work, the look before the commit, `COMMIT`). A message that arrives alone —
/// every message, at a low rate — then waits no longer for its commit than it would without `--batch-size`. Its
/// outcome is a member's, settled as any batch's; a panic of the consumer's code (its `effect`, or its work, done the
/// usual way when the statement failed) is a failed attempt of it, as one by one. `None` when the batch is not one
/// such member.
async fn alone<C: Consumer>(
    shared: &Shared<C>,
    members: &[Held<C>],
) -> Option<Result<Vec<MemberOutcome<()>>, ProcessError>> {
    let [(delivery, _, ready)] = members else {
        return None;
    };
    // The consumer's code runs under the shared hold, as every attempt's does: a suspect tried alone meanwhile is.
    let attempt = async {
        let _shared = shared.alone.read().await;
        as_one_statement(shared, delivery, ready, 1).await
    };
    let outcome = match AssertUnwindSafe(attempt).catch_unwind().await {
        Ok(None) => return None,
        Ok(Some(Ok(Outcome::Processed(())))) => MemberOutcome::Processed(()),
        Ok(Some(Ok(Outcome::Duplicate))) => MemberOutcome::Duplicate,
        Ok(Some(Ok(Outcome::Conflict(conflict)))) => MemberOutcome::Conflict(conflict),
        Ok(Some(Err(ProcessError::Failed(e)))) => MemberOutcome::Failed(e),
        Ok(Some(Err(ProcessError::Unclaimable(reason)))) => MemberOutcome::Unclaimable(reason),
        Ok(Some(Err(unavailable @ ProcessError::Unavailable(_)))) => {
            return Some(Err(unavailable));
        }
        Err(panic) => MemberOutcome::Failed(WorkError::msg(format!(
            "panicked: {}",
            panic_message(&*panic)
        ))),
    };
    Some(Ok(vec![outcome]))
}

/// Member `i`'s own work: its message through [`Consumer::consume`] (it may run more than once, if the batch is done
/// again without a member that failed).
fn member_work<C: Consumer>(
    shared: &Shared<C>,
    items: &Arc<Vec<(MessageContext, C::Message)>>,
    i: usize,
) -> MemberWork<()> {
    let consumer = Arc::clone(&shared.consumer);
    let items = Arc::clone(items);
    Box::new(move |tx| {
        let consumer = Arc::clone(&consumer);
        let items = Arc::clone(&items);
        Box::pin(async move {
            let (context, message) = &items[i];
            consumer.consume(tx, context, message).await
        })
    })
}

/// The claimed members' work in one call: [`Consumer::consume_batch`] over their messages, in the batch's order.
fn together_work<C: Consumer>(
    shared: &Shared<C>,
    items: &Arc<Vec<(MessageContext, C::Message)>>,
) -> TogetherWork<()> {
    let consumer = Arc::clone(&shared.consumer);
    let items = Arc::clone(items);
    Box::new(move |tx, ids| {
        Box::pin(async move {
            let claimed: Vec<&(MessageContext, C::Message)> = items
                .iter()
                .filter(|(context, _)| ids.contains(&context.message_id))
                .collect();
            consumer.consume_batch(tx, &claimed).await?;
            Ok(vec![(); claimed.len()])
        })
    })
}

/// Settles a delivery of the batch taken up at `started` at once, or in a task of its own if it is to be given back
/// after a pause.
async fn finish<C: Consumer>(
    shared: &Arc<Shared<C>>,
    aside: &mut Aside,
    link: Arc<Link>,
    delivery: Delivery,
    disposition: Disposition,
    started: Instant,
) {
    if let Disposition::RequeueAfter(_) = disposition {
        let shared = Arc::clone(shared);
        let (of, tag) = (Arc::clone(&link), delivery.delivery_tag);
        aside.take(&of, tag, async move {
            settle(&shared, &link, &delivery, disposition, started).await;
        });
    } else {
        settle(shared, &link, &delivery, disposition, started).await;
    }
}
