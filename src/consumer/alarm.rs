//! A broker alarm and the dead-letter copies that wait it out. A node in a memory or disk alarm blocks the connection
//! the copies go out on ([`dead_letters`](super::dead_letters)) until the alarm ends. A copy blocked so may wait, its
//! message unacknowledged, but each waiting copy holds a worker: how many may wait is bounded here, and the batch
//! worker's own copies never wait.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The copies waiting out an alarm, and how many may: each holds a worker (`--concurrency`), and the workers left
/// go on with the other messages — half of them, rounded down (with one worker, none waits). A partition queue's copy
/// always waits: given back, its message would come round behind the partition's later messages the consumer holds
/// already (the prefetch), which would overtake it.
pub(crate) struct AlarmWaits {
    waiting: AtomicUsize,
    most: usize,
}

impl AlarmWaits {
    pub(super) fn new(options: &super::ConsumerOptions) -> Self {
        Self::at_most(if options.partitions.is_some() {
            usize::MAX
        } else {
            options.concurrency / 2
        })
    }

    /// No place to wait: a copy that meets an alarm gives its message back.
    pub(super) fn none() -> Self {
        Self::at_most(0)
    }

    fn at_most(most: usize) -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            most,
        }
    }

    /// A place among the copies waiting, if the copy may wait (it is not the batch worker's own, [`in_a_batch`]) and
    /// one is left.
    pub(super) fn enter(&self) -> Option<AlarmWait<'_>> {
        if IN_A_BATCH.try_with(|()| ()).is_ok() {
            return None;
        }
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.most).then_some(n + 1)
            })
            .ok()?;
        tracing::warn!(
            "RabbitMQ is blocking the dead-letter copy (a memory or disk alarm: `rabbitmqctl status` shows it); it \
             waits for the alarm to end, its message unacknowledged, while the consumer goes on"
        );
        Some(AlarmWait(self))
    }
}

/// A copy's place among those waiting out an alarm, given up when dropped.
pub(super) struct AlarmWait<'a>(&'a AlarmWaits);

impl Drop for AlarmWait<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

tokio::task_local! {
    /// Set while a batch worker runs a batch (see [`in_a_batch`]).
    static IN_A_BATCH: ();
}

/// Runs `work` as a batch worker's own. A dead-letter copy made there does not wait for an alarm to end, which would
/// hold every member of the batch and the batches behind it: its message goes back to its queue. The tasks beside the
/// worker (a failed member's retries) are not the worker's, and their copies wait as one by one.
pub(super) async fn in_a_batch<F: Future>(work: F) -> F::Output {
    IN_A_BATCH.scope((), work).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_more_copies_wait_out_an_alarm_than_may_and_a_place_given_up_is_free_again() {
        let waits = AlarmWaits::at_most(2);
        let first = waits.enter().expect("a first place");
        let second = waits.enter().expect("a second place");
        assert!(waits.enter().is_none(), "two at most");
        drop(first);
        let third = waits.enter().expect("the place given up, free again");
        assert!(waits.enter().is_none());
        drop((second, third));
        assert_eq!(waits.waiting.load(Ordering::SeqCst), 0);
        assert!(
            AlarmWaits::at_most(0).enter().is_none(),
            "one worker: none waits"
        );
    }

    #[tokio::test]
    async fn the_batch_workers_own_copies_never_wait_out_an_alarm() {
        let waits = AlarmWaits::at_most(usize::MAX);
        assert!(in_a_batch(async { waits.enter().is_none() }).await);
        let beside = tokio::spawn(in_a_batch(async {
            tokio::spawn(async { AlarmWaits::at_most(1).enter().is_some() })
                .await
                .unwrap()
        }));
        assert!(
            beside.await.unwrap(),
            "a task spawned from the worker may wait"
        );
        assert!(waits.enter().is_some());
    }
}
