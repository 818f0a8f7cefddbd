//! The run loop: one broker connection after another (reconnecting with backoff), deliveries handed to workers —
//! a task per delivery, or batch workers — while PostgreSQL is up. How it ends (a stop, or idle) is in `stop.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicNackOptions};
use lapin::types::FieldTable;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::dispatch::handle;
use super::link::{Link, open_link};
use super::outage::wait_for_database;
use super::stop::{drain, idle_stop, is_idle, stop_deadline, stopping};
use super::{Consumer, WorkGuard};
use super::{
    ConsumerOptions, OUTAGE_DELAY_MAX, OUTAGE_DELAY_MIN, RunSummary, Shared, lock, sleep_or_cancel,
};
use super::{batch, poison};
use crate::amqp::Broker;
use crate::amqp::topology;
use crate::backoff::Backoff;
use crate::db;
use crate::error::Result;

/// Runs `consumer` on its queue until `shutdown` is cancelled (or, with `exit_when_idle`, until the queue stays
/// empty). Fails at start if PostgreSQL or RabbitMQ cannot be reached; after that, outages are waited out.
///
/// Partitioned (`options.partitions`), it reads each of the partition queues in a loop of its own, one message at a
/// time: the broker keeps each queue's order, and one message at a time per queue keeps it in the effects. A loop that
/// fails at start (its first connection refused) stops the others as a stop would — each drains what it holds and
/// takes back the starts it counted — before the run fails: dropped half-way instead, their work would be abandoned
/// with its starts still counted, as if the process had crashed on it (and a healthy message could come to be taken
/// for poison).
pub async fn run<C: Consumer>(
    inbox: impl WorkGuard,
    consumer: C,
    broker: &Broker,
    options: ConsumerOptions,
    shutdown: CancellationToken,
) -> Result<RunSummary> {
    // One message at a time per partition, whatever the caller asked: two at once (a worker pool, a batch) process a
    // key's messages out of order.
    let options = match options.partitions {
        Some(_) => ConsumerOptions {
            concurrency: 1,
            batch_size: 1,
            ..options
        },
        None => options,
    };
    let partitions = options.partitions.clone();
    db::events::register_consumer(
        inbox.pool(),
        inbox.consumer_type(),
        &options.queue,
        partitions.as_ref().map(|p| p.count),
        broker.vhost(),
    )
    .await?;
    let inbox: Arc<dyn WorkGuard> = Arc::new(inbox);
    let consumer = Arc::new(consumer);
    let counts = Arc::clone(&options.counts);
    let queues: Vec<String> = match &partitions {
        None => vec![options.queue.clone()],
        Some(p) => {
            tracing::info!(
                queue = %options.queue,
                partitions = p.count,
                queues = %format!("{}..{}", topology::partition_queue(&options.queue, 0),
                    topology::partition_queue(&options.queue, p.count.saturating_sub(1))),
                exchange = %topology::partition_exchange(&options.queue),
                partition_key = %p.key,
                "partitioned: each queue read by one active consumer, one message at a time; the exchange hashes the \
                 routing key, which publishers set to the partition key"
            );
            (0..p.count)
                .map(|i| topology::partition_queue(&options.queue, i))
                .collect()
        }
    };
    let alone = Arc::clone(&super::ALONE);
    let idle = Arc::new(super::IdleTogether::new(queues.len()));
    let stop = shutdown.child_token();
    counts.queues.store(queues.len(), Ordering::Relaxed);
    let runs = queues.into_iter().map(|queue| {
        let shared = Arc::new(Shared {
            input_address: broker.queue_address(&queue),
            queue,
            inbox: Arc::clone(&inbox),
            consumer: Arc::clone(&consumer),
            counts: Arc::clone(&counts),
            options: options.clone(),
            database_up: watch::Sender::new(true),
            shutdown: stop.clone(),
            in_flight: AtomicUsize::new(0),
            last_activity: std::sync::Mutex::new(Instant::now()),
            alone: Arc::clone(&alone),
            starts: poison::Starts::default(),
            routing_key_warned: std::sync::atomic::AtomicBool::new(false),
            alarm_waits: super::alarm::AlarmWaits::new(&options),
            owed: super::owed::OwedCopies::default(),
            held_back: AtomicUsize::new(0),
            consuming: std::sync::atomic::AtomicBool::new(false),
            idle: Arc::clone(&idle),
            idle_counted: std::sync::atomic::AtomicBool::new(false),
        });
        let stop = stop.clone();
        async move {
            let ran = run_queue(shared, broker).await;
            if ran.is_err() {
                stop.cancel();
            }
            ran
        }
    });
    for ran in futures_util::future::join_all(runs).await {
        ran?;
    }
    let summary = counts.summary();
    tracing::info!(
        consumer_type = %inbox.consumer_type(),
        processed = summary.processed,
        duplicates = summary.duplicates,
        failed_attempts = summary.failed_attempts,
        dead_lettered = summary.dead_lettered,
        skipped = summary.skipped,
        conflicts = summary.conflicts,
        "consumer stopped"
    );
    Ok(summary)
}

/// Reads one queue until the stop: one broker connection after another.
async fn run_queue<C: Consumer>(shared: Arc<Shared<C>>, broker: &Broker) -> Result<()> {
    let shutdown = shared.shutdown.clone();
    let _watching = watch_database(&shared);
    let mut workers = Workers::start(&shared);
    let mut backoff = Backoff::new(OUTAGE_DELAY_MIN, OUTAGE_DELAY_MAX);
    let mut first = true;
    while !shutdown.is_cancelled() {
        // Each of its steps bounded by --broker-timeout ([`open_link`]); a stop ends the wait.
        let opened = tokio::select! {
            () = shutdown.cancelled() => break,
            opened = open_link(broker, &shared) => opened,
        };
        let link = match opened {
            Ok(link) => Arc::new(link),
            Err(e) if first => return Err(e),
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e.for_a_retry(), retry_in = ?delay, "RabbitMQ unavailable");
                if sleep_or_cancel(delay, &shutdown).await {
                    break;
                }
                continue;
            }
        };
        first = false;
        let began = Instant::now();
        let end = consume_on(&shared, &link, &mut workers).await;
        if end == LinkEnd::Stop {
            // Drained and closed already ([`stopping`]).
            return Ok(());
        }
        // Deliveries in flight on a lost connection finish their database work; their acks fail and the broker
        // delivers them again, as duplicates.
        shared.set_consuming(false);
        link.close("reconnecting").await;
        // A connection that consumed for a while was a recovery: the next starts at once. One that ended as it began
        // — consuming refused (the queue in exclusive use, deleted, a permission), or cancelled at once — waits its
        // turn as a failed connection does, rather than going round in a tight loop.
        if began.elapsed() >= OUTAGE_DELAY_MAX {
            backoff.reset();
        } else if sleep_or_cancel(backoff.next_delay(), &shutdown).await {
            break;
        }
    }
    workers.finish(&shared, stop_deadline(&shared)).await;
    Ok(())
}

/// Looks for PostgreSQL's return whenever an attempt found it gone and no delivery is in flight, until the guard
/// returned is dropped: a delivery waiting for it looks itself, but a quiet queue has none, and would stay held —
/// `/health` saying the database down — long after it came back.
fn watch_database<C: Consumer>(shared: &Arc<Shared<C>>) -> tokio_util::sync::DropGuard {
    let watching = shared.shutdown.child_token();
    let shared = Arc::clone(shared);
    let stop = watching.clone();
    tokio::spawn(async move {
        let mut up = shared.database_up.subscribe();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                gone = up.wait_for(|up| !*up) => if gone.is_err() { return },
            }
            tokio::select! {
                () = stop.cancelled() => return,
                back = super::outage::wait_for_database(&shared, true) => if !back { return },
            }
        }
    });
    watching.drop_guard()
}

/// Why consuming on one connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkEnd {
    /// A stop was asked for, or the queue stayed idle: no more connections.
    Stop,
    /// The connection was lost, or the broker cancelled the consumer: connect again.
    Reconnect,
}

/// Starts consuming the queue under `tag` and marks the broker connected; `None` (logged) when the broker refused.
async fn start_consuming<C: Consumer>(
    shared: &Arc<Shared<C>>,
    link: &Arc<Link>,
    tag: &str,
) -> Option<lapin::Consumer> {
    let consumed = link.consume.basic_consume(
        shared.queue.as_str().into(),
        tag.into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    );
    let deliveries = match link.answer("the start of consuming", consumed).await? {
        Ok(deliveries) => deliveries,
        Err(e) => {
            tracing::warn!(error = %e, "could not start consuming; reconnecting");
            return None;
        }
    };
    tracing::info!(
        queue = %shared.queue,
        consumer_type = %shared.inbox.consumer_type(),
        "consuming"
    );
    shared.set_consuming(true);
    Some(deliveries)
}

/// Consumes on one connection until it is lost, a stop is asked for, or (with `exit_when_idle`) the queue is idle.
async fn consume_on<C: Consumer>(
    shared: &Arc<Shared<C>>,
    link: &Arc<Link>,
    workers: &mut Workers,
) -> LinkEnd {
    let tag = format!(
        "inboxctl-{}-{}",
        std::process::id(),
        Uuid::new_v4().simple()
    );
    // Waits on the broker (up to `--broker-timeout`): a stop meanwhile is not held by it. Work from an earlier
    // connection may still be in flight: drained as at any stop.
    let started = tokio::select! {
        biased;
        () = shared.shutdown.cancelled() => {
            workers.finish(shared, stop_deadline(shared)).await;
            link.close("stopped").await;
            return LinkEnd::Stop;
        }
        started = start_consuming(shared, link, &tag) => started,
    };
    let Some(mut deliveries) = started else {
        return LinkEnd::Reconnect;
    };
    *lock(&shared.last_activity) = Instant::now();
    // A new connection: what the last one held comes again, so this queue is idle only once a look on this one says so.
    shared.busy();
    let mut idle_check = tokio::time::interval(Duration::from_millis(100));
    // A look slower than the tick does not make the next one due at once: the deliveries are read between looks.
    idle_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The deliveries stream is not always ended when the connection goes (lapin has had such bugs, and a node
    // restart is where they showed): the connection's own state is watched too, so a lost connection is never
    // waited on forever.
    let mut connection_check = tokio::time::interval(Duration::from_secs(1));
    // Idle with calls still owed: said once, then waited for quietly.
    let mut owed_said = false;
    // At a stop or when idle, the connection is closed once the work in flight is done: the cancel only spares the
    // broker deliveries that would come back, and is not waited on for long. `true` once the broker confirmed it.
    let cancel = || async {
        let cancelled = link
            .consume
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default());
        matches!(
            tokio::time::timeout(Duration::from_secs(2), cancelled).await,
            Ok(Ok(()))
        )
    };
    loop {
        tokio::select! {
            biased;
            () = shared.shutdown.cancelled() => {
                stopping(shared, link, deliveries, workers, cancel).await;
                return LinkEnd::Stop;
            }
            Some(_) = workers.tasks.join_next(), if !workers.tasks.is_empty() => {}
            () = link.given_up.cancelled() => return reconnect(shared, link, deliveries).await,
            // Every queue of the process idle at once (found so by the last of them): all stop together — each one
            // counted idle by its own look on this connection (a queue handed work since, or connected again, looks
            // again first).
            () = shared.idle.all.cancelled(), if shared.options.exit_when_idle.is_some()
                && shared.idle_counted.load(Ordering::SeqCst) => {
                tracing::info!(queue = %shared.queue, "queue idle; stopping");
                return idle_stop(shared, link, deliveries, workers, cancel).await;
            }
            _ = connection_check.tick() => {
                if !link.connection.status().connected() {
                    tracing::warn!("RabbitMQ connection lost (seen in its state); reconnecting");
                    return reconnect(shared, link, deliveries).await;
                }
            }
            _ = idle_check.tick(), if shared.options.exit_when_idle.is_some()
                && !shared.idle_counted.load(Ordering::SeqCst) => {
                // The look at the queue waits on the broker (up to `--broker-timeout`) and the count of calls owed on
                // the database: a stop meanwhile is not held by either.
                let idle = tokio::select! {
                    biased;
                    () = shared.shutdown.cancelled() => None,
                    idle = is_idle(shared, link, &mut owed_said) => Some(idle),
                };
                match idle {
                    None => {
                        stopping(shared, link, deliveries, workers, cancel).await;
                        return LinkEnd::Stop;
                    }
                    Some(true) if shared.idle_now() => {
                        tracing::info!(queue = %shared.queue, "queue idle; stopping");
                        return idle_stop(shared, link, deliveries, workers, cancel).await;
                    }
                    // Idle, and another queue of the process (a partition) still works: this one reads on, counted
                    // idle (not looked at again) until it is handed a delivery or every queue is idle.
                    Some(true) | Some(false) => {}
                }
            }
            delivery = deliveries.next() => match delivery {
                Some(Ok(delivery)) => match workers.dispatch(shared, link, delivery).await {
                    Handover::Handed => {}
                    Handover::Stop => {
                        stopping(shared, link, deliveries, workers, cancel).await;
                        return LinkEnd::Stop;
                    }
                    Handover::Lost => {
                        tracing::warn!("RabbitMQ connection lost while waiting for a free worker; reconnecting");
                        return reconnect(shared, link, deliveries).await;
                    }
                },
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "RabbitMQ connection lost; reconnecting");
                    return reconnect(shared, link, deliveries).await;
                }
                None => {
                    tracing::warn!(queue = %shared.queue, "the broker cancelled the consumer; reconnecting");
                    return reconnect(shared, link, deliveries).await;
                }
            }
        }
    }
}

/// Gives the link up to connect again. A partition queue's connection is closed before its consumer is dropped:
/// dropping a consumer cancels it, and a standby the cancel made active would take the partition's later messages
/// before those this one held go back with the close.
pub(super) async fn reconnect<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    deliveries: lapin::Consumer,
) -> LinkEnd {
    if shared.options.partitions.is_some() {
        link.close("reconnecting").await;
    }
    drop(deliveries);
    LinkEnd::Reconnect
}

/// What became of a delivery the consume loop received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Handover {
    /// A worker has it.
    Handed,
    /// A stop was asked for first.
    Stop,
    /// The link was lost first.
    Lost,
}

/// How many batches are worked on at once: enough for `concurrency` messages, and two at least (unless one message at
/// a time was asked for). One batch at a time is bound by its round trips, not by any party's work: the database
/// waits while the batch's acknowledgement goes out and the next one is gathered, and the broker waits while the
/// batch commits. Two overlap them (at `--batch-size 32` and the default concurrency, 1.13× the throughput: the
/// bench, docs/performance.md). Never more than the pool has connections: a worker waiting for one would only
/// warn that the pool is busy.
pub fn batch_workers(concurrency: usize, batch_size: usize) -> usize {
    concurrency
        .div_ceil(batch_size.max(1))
        .max(concurrency.min(2))
        .max(1)
}

/// Who handles the deliveries: a task each (at most `concurrency` at once), or, batched, a few batch workers fed
/// through a queue.
pub(super) struct Workers {
    pub(super) tasks: JoinSet<()>,
    permits: Arc<Semaphore>,
    batches: Option<mpsc::Sender<batch::Queued>>,
    /// The batch workers' end of `batches`.
    batch_queue: Option<Arc<tokio::sync::Mutex<mpsc::Receiver<batch::Queued>>>>,
}

impl Workers {
    fn start<C: Consumer>(shared: &Arc<Shared<C>>) -> Self {
        let mut workers = Self {
            tasks: JoinSet::new(),
            permits: Arc::new(Semaphore::new(shared.options.concurrency.max(1))),
            batches: None,
            batch_queue: None,
        };
        workers.start_batches(shared);
        workers
    }

    /// Batched: the batch workers and the queue that feeds them — again after an idle stop whose connection was lost
    /// while it finished what had arrived (its batch workers ended with their queue).
    fn start_batches<C: Consumer>(&mut self, shared: &Arc<Shared<C>>) {
        let options = &shared.options;
        if options.batch_size <= 1 {
            return;
        }
        let (tx, rx) = mpsc::channel::<batch::Queued>(usize::from(options.prefetch).max(1));
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let running = Arc::new(AtomicUsize::new(0));
        let connections = shared.inbox.pool().options().get_max_connections();
        let workers = batch_workers(options.concurrency, options.batch_size)
            .min(usize::try_from(connections).unwrap_or(usize::MAX))
            .max(1);
        for _ in 0..workers {
            let worker = batch::worker(Arc::clone(shared), Arc::clone(&rx), Arc::clone(&running));
            self.tasks.spawn(worker);
        }
        self.batches = Some(tx);
        self.batch_queue = Some(rx);
    }

    /// Hands a delivery to a worker once PostgreSQL is up and a worker is free. While it waits, the consume loop
    /// waits too: a stop, or the link lost (a worker's broker call given up, or the connection seen closed), ends
    /// the wait, and the delivery, not handed over, comes again on a new connection.
    pub(super) async fn dispatch<C: Consumer>(
        &mut self,
        shared: &Arc<Shared<C>>,
        link: &Arc<Link>,
        delivery: lapin::message::Delivery,
    ) -> Handover {
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        shared.busy();
        *lock(&shared.last_activity) = Instant::now();
        link.outstanding.add(delivery.delivery_tag);
        // The hand-over first: when a worker is free it is done at its first poll, and nothing else is set up.
        let tag = delivery.delivery_tag;
        let handed = tokio::select! {
            biased;
            handed = self.hand_over(shared, link, delivery) => handed,
            () = shared.shutdown.cancelled() => Handover::Stop,
            () = link.lost() => Handover::Lost,
        };
        // One not handed over stays outstanding: no `multiple` ack may cover it.
        if handed != Handover::Handed {
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        // At a stop it goes back now, for the other consumers, rather than at the close after the drain; a partition
        // queue's goes back at the close, in order ([`stopping`]).
        if handed == Handover::Stop && shared.options.partitions.is_none() {
            // Its acker went with the hand-over, unused: the nack goes by its tag.
            let options = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            let nack = link.consume.basic_nack(tag, options);
            let _ = tokio::time::timeout(Duration::from_secs(2), link.answer("a nack", nack)).await;
        }
        handed
    }

    async fn hand_over<C: Consumer>(
        &mut self,
        shared: &Arc<Shared<C>>,
        link: &Arc<Link>,
        delivery: lapin::message::Delivery,
    ) -> Handover {
        if !wait_for_database(shared, false).await {
            return Handover::Stop;
        }
        // A redelivered message is processed on its own: if it is what ended a process, it must not take a batch's
        // healthy members down with it again.
        if let Some(queue) = self
            .batches
            .as_ref()
            .filter(|_| !super::dispatch::redelivered(&delivery, &shared.options.queue))
        {
            return match queue.send((delivery, Arc::clone(link))).await {
                Ok(()) => Handover::Handed,
                Err(_) => Handover::Stop,
            };
        }
        let Ok(permit) = Arc::clone(&self.permits).acquire_owned().await else {
            return Handover::Stop;
        };
        // A worker freed by a stop or by the link's loss — the work it held ended by them, its message given back —
        // starts nothing: the hand-over is polled first, and would take that worker before the stop or the loss is
        // seen. On a partition, the next message would be processed (committed, and at a stop acknowledged) ahead
        // of the one given back.
        if shared.shutdown.is_cancelled() {
            return Handover::Stop;
        }
        if link.is_lost() {
            return Handover::Lost;
        }
        let shared = Arc::clone(shared);
        let link = Arc::clone(link);
        self.tasks.spawn(async move {
            handle(&shared, &link, delivery, permit).await;
        });
        Handover::Handed
    }

    /// The batch workers end once the deliveries queued for them are done; then everything in flight is drained.
    pub(super) async fn finish<C: Consumer>(
        &mut self,
        shared: &Shared<C>,
        deadline: tokio::time::Instant,
    ) {
        self.batches.take();
        if let Some(queue) = self.batch_queue.take()
            && shared.shutdown.is_cancelled()
        {
            batch::give_back_queued(shared, &queue).await;
        }
        drain(shared, &mut self.tasks, deadline).await;
        shared.set_consuming(false);
    }

    /// Like [`Workers::finish`] with no deadline: the work in flight runs to its end, however long — unless a stop
    /// comes meanwhile, which gives it the shutdown timeout from then, as any stop does, or `link` is lost first: then
    /// it goes on as on any lost connection (its acks fail, the broker delivers it again), the workers are ready for a
    /// new connection, and this returns `true`. Work that ended because the link was lost (a message left to its
    /// redelivery) is not done: a link found lost once the work ended counts as lost too — each waiter looks at the
    /// connection on a tick of its own, so the work may see the loss a second before this does.
    pub(super) async fn finish_unless_stopped<C: Consumer>(
        &mut self,
        shared: &Arc<Shared<C>>,
        link: &Link,
    ) -> bool {
        enum End {
            Done,
            Stop,
            Lost,
        }
        self.batches.take();
        let end = tokio::select! {
            () = async { while self.tasks.join_next().await.is_some() {} } => End::Done,
            () = shared.shutdown.cancelled() => End::Stop,
            () = link.lost() => End::Lost,
        };
        match end {
            End::Done if !link.is_lost() => {}
            End::Stop => {
                if let Some(queue) = self.batch_queue.take() {
                    batch::give_back_queued(shared, &queue).await;
                }
                drain(shared, &mut self.tasks, stop_deadline(shared)).await;
            }
            End::Done | End::Lost => {
                self.start_batches(shared);
                return true;
            }
        }
        shared.set_consuming(false);
        false
    }
}
