//! Acknowledging a batch with one frame: `basic.ack` with `multiple` acknowledges every delivery of the channel up
//! to a tag — also one that another worker still holds, which would lose it. So each link keeps the tags of its
//! deliveries not yet settled ([`Outstanding`]), and a batch acknowledges with `multiple` only up to the first tag
//! that is not its own; the rest of its members one by one.

use std::collections::BTreeSet;
use std::time::Instant;

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;

use super::dispatch::{Disposition, settle, settled};
use super::link::Link;
use super::{Consumer, Shared, lock};

/// The delivery tags of a channel's deliveries that are not settled yet.
#[derive(Debug, Default)]
pub(super) struct Outstanding(std::sync::Mutex<BTreeSet<u64>>);

impl Outstanding {
    /// A delivery has arrived.
    pub(super) fn add(&self, tag: u64) {
        lock(&self.0).insert(tag);
    }

    /// A delivery is settled (its ack or nack sent, or its channel gone); `false` if it was settled before.
    pub(super) fn remove(&self, tag: u64) -> bool {
        lock(&self.0).remove(&tag)
    }

    pub(super) fn contains(&self, tag: u64) -> bool {
        lock(&self.0).contains(&tag)
    }

    /// The highest of `tags` (sorted) that one `multiple` ack may cover: every outstanding tag up to it is one of
    /// `tags`. `None` when that covers fewer than two, where one ack each is as good.
    fn multiple_up_to(&self, tags: &[u64]) -> Option<u64> {
        let outstanding = lock(&self.0);
        let boundary = outstanding
            .iter()
            .find(|t| tags.binary_search(t).is_err())
            .copied();
        let covered: Vec<u64> = tags
            .iter()
            .copied()
            .filter(|t| boundary.is_none_or(|b| *t < b) && outstanding.contains(t))
            .collect();
        (covered.len() >= 2).then(|| covered[covered.len() - 1])
    }
}

/// Acknowledges deliveries of one batch whose outcomes are committed, all of them from `link`: with one `multiple`
/// frame for those it may cover, one by one for the rest.
pub(super) async fn ack_all<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    deliveries: Vec<Delivery>,
    started: Instant,
) {
    let mut tags: Vec<u64> = deliveries.iter().map(|d| d.delivery_tag).collect();
    tags.sort_unstable();
    let Some(up_to) = link.outstanding.multiple_up_to(&tags) else {
        for delivery in &deliveries {
            settle(shared, link, delivery, Disposition::Ack, started).await;
        }
        return;
    };
    let (covered, rest): (Vec<Delivery>, Vec<Delivery>) = deliveries
        .into_iter()
        .partition(|d| d.delivery_tag <= up_to && link.outstanding.contains(d.delivery_tag));
    let last = covered
        .iter()
        .find(|d| d.delivery_tag == up_to)
        .map(|d| d.acker.clone());
    if let Some(acker) = last {
        let sent = link
            .answer(
                "a multiple ack",
                acker.ack(BasicAckOptions { multiple: true }),
            )
            .await;
        let sent = matches!(sent, Some(Ok(_)));
        for delivery in &covered {
            if let Some(timings) = &shared.options.timings {
                timings.handled(started.elapsed());
            }
            settled(shared, link, delivery.delivery_tag, sent);
        }
    }
    for delivery in &rest {
        settle(shared, link, delivery, Disposition::Ack, started).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outstanding(tags: &[u64]) -> Outstanding {
        let o = Outstanding::default();
        for t in tags {
            o.add(*t);
        }
        o
    }

    #[test]
    fn a_multiple_ack_never_covers_a_delivery_of_another_worker() {
        // 3 is another worker's: the batch's 1 and 2 go together, 4 and 5 one by one.
        let o = outstanding(&[1, 2, 3, 4, 5]);
        assert_eq!(o.multiple_up_to(&[1, 2, 4, 5]), Some(2));
        // Another's delivery first: nothing can be covered.
        assert_eq!(o.multiple_up_to(&[2, 4, 5]), None);
        // All the batch's: all together.
        let o = outstanding(&[7, 8, 9]);
        assert_eq!(o.multiple_up_to(&[7, 8, 9]), Some(9));
        // Settled ones below do not matter; one alone is not worth a multiple.
        let o = outstanding(&[10, 12]);
        assert_eq!(o.multiple_up_to(&[10, 11]), None);
        assert_eq!(
            outstanding(&[10, 11, 12]).multiple_up_to(&[10, 11]),
            Some(11)
        );
    }
}
