//! Looking at a queue without taking anything from it: the messages present when the look begins (their count, read
//! first) are fetched one by one and held unacknowledged, then all given back at once, each to its place and in its
//! order. The broker marks every message looked at this way redelivered; nothing else about it changes.
//!
//! Used where an operator looks at dead-letter queues (`find`, `failures`, `cleanup`'s check of the deduplication
//! window, `top`'s detail view): the same snapshot-and-give-back as `replay --dry-run`. A look at more than one
//! message, and the guard's, marks the queue while it looks (`topology::mark_look`), so that the guard knows when
//! messages are held out of its sight.

use std::time::Duration;

use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicGetOptions, BasicNackOptions};

use super::{answered, topology};
use crate::error::Result;

/// The longest a take from a queue whose count says 0 may take: an empty queue answers at once.
const EMPTY_CHECK: Duration = Duration::from_secs(15);

/// What a look at one queue saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Looked {
    /// Messages ready in the queue when the look began.
    pub depth: u64,
    /// Messages looked at (at most `depth` and the limit asked for).
    pub looked: u64,
    /// Another look held the queue marked before this one's first take or after its last (`find`, `failures`, `top`'s
    /// detail, a cleanup's guard), or whether one did could not be read: messages it held may have been out of this
    /// look's sight. Read by the looks that mark (of more than one message, and the guard's); `false` otherwise.
    pub crowded: bool,
    /// Consumers of the queue when the look began (its count's): inboxctl's own looks take with `basic.get` and mark
    /// other queues, so each is another client's — a fault monitor, a shovel — whose unacknowledged messages no look
    /// sees.
    pub consumers: u32,
    /// The most times any message looked at had been delivered before (its `x-delivery-count`: a quorum queue's, which
    /// every return raises before RabbitMQ 4.3, a look's too); `None` when none carried it.
    pub most_deliveries: Option<u32>,
}

/// Shows `visit` each message of `queue` present when the look begins, oldest first, up to `limit`, and gives them
/// all back. `Ok(None)` when the queue does not exist. Messages that arrive during the look are not shown: the count
/// is read first, so a queue filling as fast as it is read cannot keep the look going. No call to the broker waits
/// past `within` for its answer (a queue whose leader is lost, a node that stops answering): the look fails, saying
/// so, and what it held goes back with its channel.
pub async fn each(
    connection: &Connection,
    queue: &str,
    limit: u64,
    within: Duration,
    visit: impl FnMut(&Delivery),
) -> Result<Option<Looked>> {
    look(connection, queue, limit, within, visit, limit > 1).await
}

/// [`each`], reading as it ends whether another look held the queue marked (`crowded`).
async fn look(
    connection: &Connection,
    queue: &str,
    limit: u64,
    within: Duration,
    mut visit: impl FnMut(&Delivery),
    read_crowded: bool,
) -> Result<Option<Looked>> {
    let mut most_deliveries = None;
    let mut visit = |delivery: &Delivery| {
        let deliveries = super::failure::delivery_count(delivery.properties.headers().as_ref());
        most_deliveries = most_deliveries.max(deliveries);
        visit(delivery);
    };
    let depth_of = || answered(COUNT, within, topology::queue_depth(connection, queue));
    if depth_of().await??.is_none() {
        return Ok(None);
    }
    // Marked before anything is taken: a cleanup's guard looking meanwhile knows that messages may be out of sight.
    // Not a look at one message (`stats`, `top`'s table, replay's check of a count of 0): it holds it for a moment, and
    // `top` bounds its refresh by dropping the look where it stands, which a mark's channel being opened does not
    // survive (the connection is left unusable). Such a look is not seen by the guard: a message it holds at the
    // guard's count is not counted (on a quorum queue it goes back behind what was counted).
    let mark = match limit > 1 || read_crowded {
        true => answered(MARK, within, topology::mark_look(connection, queue, true)).await?,
        false => None,
    };
    // Read before the count and again after the last take (below): a look that held messages at this one's count or
    // takes had marked the queue before its own first take, so its mark is seen at one of the two reads — unless it
    // both began after the first read and ended before the second (a look begun and ended inside this one's takes,
    // whose messages went behind what this one counted: not seen).
    let before = match read_crowded {
        true => Some(answered(MARKS, within, topology::looks_at(connection, queue)).await?),
        false => None,
    };
    let Some((ready, consumers)) = depth_of().await?? else {
        if let Some(mark) = mark {
            end(mark, within).await;
        }
        return Ok(None);
    };
    let mut depth = u64::from(ready);
    let channel = answered(CHANNEL, within, connection.create_channel()).await??;
    let mut looked = 0;
    let mut last = None;
    let outcome = async {
        // A count of 0 is checked by taking one: a quorum queue whose members lost their leader answers every count
        // with 0 whatever it holds, and a look that believed it would call a queue of waiting messages empty (the
        // cleanup's guard then deleting the rows their replay needs). An empty queue answers the take at once; one
        // that cannot answer it (no leader) fails the look, bounded, rather than reads as empty.
        if depth == 0 && limit > 0 {
            let got = answered(
                "a take from a queue whose count is 0",
                EMPTY_CHECK.min(within),
                channel.basic_get(queue.into(), BasicGetOptions { no_ack: false }),
            )
            .await??;
            let Some(message) = got else {
                return Ok(());
            };
            // The count said 0 and a message came: counted again (the one held is not among the ready ones).
            depth = depth_of()
                .await??
                .map_or(1, |(ready, _)| u64::from(ready) + 1);
            last = Some(message.delivery.delivery_tag);
            looked = 1;
            visit(&message.delivery);
        }
        while looked < depth.min(limit) {
            let take = channel.basic_get(queue.into(), BasicGetOptions { no_ack: false });
            let Some(message) = answered(TAKE, within, take).await?? else {
                break;
            };
            last = Some(message.delivery.delivery_tag);
            looked += 1;
            visit(&message.delivery);
            crate::failpoint::hit_with("peek", queue).await;
        }
        Ok::<_, crate::error::Error>(())
    }
    .await;
    // Everything looked at still held (a test pauses here: what a look holds is out of every other client's sight).
    crate::failpoint::hit_with("peek-holding", queue).await;
    if let Some(last) = last {
        // One nack for everything held: the broker puts each back in its place. Should it fail, closing the channel
        // (or the connection going) gives them back all the same.
        let back = channel.basic_nack(
            last,
            BasicNackOptions {
                multiple: true,
                requeue: true,
            },
        );
        let _ = answered("the messages' return", within, back).await;
    }
    // Its close unanswered (a node that hangs, a queue whose leader is lost), the channel may still hold what it
    // took: its mark stays as long as it does (below).
    let closed = answered("a channel's close", within, channel.close(200, "OK".into()))
        .await
        .is_ok();
    // Another look's mark beside this one's (or any, when this one could not mark): read before this one's goes.
    if read_crowded {
        // Between the take and the read of the marks (a test ends another look here).
        crate::failpoint::hit_with("peek-before-marks", queue).await;
    }
    let others = |looks: Option<u32>| looks.is_none_or(|looks| looks > u32::from(mark.is_some()));
    let crowded = match (outcome.is_ok(), before) {
        (true, Some(before)) => {
            let after = answered(MARKS, within, topology::looks_at(connection, queue)).await;
            others(before) || others(after.ok().flatten())
        }
        _ => false,
    };
    match (closed, mark) {
        (true, Some(mark)) => end(mark, within).await,
        (true, None) => {}
        (false, mark) => hold(channel, mark),
    }
    outcome?;
    Ok(Some(Looked {
        depth,
        looked,
        crowded,
        consumers,
        most_deliveries,
    }))
}

/// What `read` makes of each message of `queue` present when the look begins, oldest first, up to `limit`, all
/// looked at and given back (none when the queue does not exist or is empty), and what the look saw: how many there
/// were, and whether another look held the queue marked meanwhile ([`Looked::crowded`]).
pub async fn all<T>(
    connection: &Connection,
    queue: &str,
    limit: u64,
    within: Duration,
    mut read: impl FnMut(&Delivery) -> T,
) -> Result<(Vec<T>, Option<Looked>)> {
    let mut seen = Vec::new();
    let looked = look(
        connection,
        queue,
        limit,
        within,
        |d| seen.push(read(d)),
        true,
    )
    .await?;
    Ok((seen, looked))
}

/// A message delivered this many times before (`x-delivery-count`) is near a quorum queue's `delivery-limit` where
/// RabbitMQ counts every return, a look's too (before 4.3; 4.0–4.2 set a limit of 20 by default, past which the
/// message is dropped): the looks say so, and `top` stops looking at such a head.
pub const WORN: u32 = 10;

/// What is said of a queue holding a message delivered `most` times before.
pub fn worn(most: u32) -> String {
    format!(
        "a message of this queue has been delivered {most} times before (on a quorum queue each look counts, before \
         RabbitMQ 4.3, and RabbitMQ 4.0–4.2 drop a message past its delivery-limit, 20 by default): give dead-letter \
         queues no delivery limit (docs/scaling.md)"
    )
}

/// What a look waits for, as its errors name them.
const COUNT: &str = "a count of the queue looked at";
const TAKE: &str = "a take from the queue looked at";
const MARK: &str = "the look's mark";
const MARKS: &str = "a read of the marks of other looks";
const CHANNEL: &str = "a new channel";

/// Keeps a look's mark for as long as `channel`, whose close RabbitMQ did not answer, may hold messages the look took:
/// until the channel is closed (its close answered late, or its connection gone). Ended at once, the mark would let a
/// cleanup's guard count the queue without the messages held and take the queue for all there is, while `find` goes
/// on to other queues over the same connection.
fn hold(channel: lapin::Channel, mark: Option<topology::LookMark>) {
    tokio::spawn(async move {
        while channel.status().connected() || channel.status().closing() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        drop(mark);
    });
}

/// Ends a look's mark, not waiting past `within` (a mark not ended expires a minute after its last use).
async fn end(mark: topology::LookMark, within: Duration) {
    let _ = answered("the end of the look's mark", within, mark.end()).await;
}
