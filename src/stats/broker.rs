//! The broker's half of the figures: each consumer_type's queues' depths (summed over partition queues) and how long
//! ago its error queue's oldest message failed, against the retention.

use std::time::Duration;

use chrono::Utc;
use serde::Serialize;

use super::{ConsumerStats, NEAR_WINDOW, Range};
use crate::amqp::peek::WORN;
use crate::amqp::{Connection, topology};
use crate::error::{Error, Result};

/// A queue's depth, as the broker reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    pub name: String,
    /// Spread over this many partition queues (`<name>.0` …): `ready` is their sum, `consumers` the most any has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u16>,
    /// `None` when the broker could not be asked or the queue does not exist.
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
    pub exists: bool,
}

impl QueueDepth {
    /// Its name for a person: spread over partitions, with how many.
    pub fn label(&self) -> String {
        queue_label(&self.name, self.partitions)
    }
}

/// A queue's name for a person: spread over `partitions` queues, their range and number.
pub fn queue_label(name: &str, partitions: Option<u16>) -> String {
    match partitions {
        Some(n) => format!("{name}.0–{} ({n} partitions)", n.saturating_sub(1)),
        None => name.to_owned(),
    }
}

/// Where the oldest dead-lettered message stands against the retention, the longest a replay may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Window {
    Ok,
    /// Older than [`NEAR_WINDOW`] of the retention: replay it soon.
    Near,
    /// Older than the retention: its inbox row may be gone, so its replay may be processed again.
    Past,
}

impl Window {
    pub fn of(age_seconds: f64, retention: Duration) -> Self {
        let retention = retention.as_secs_f64();
        if age_seconds >= retention {
            Window::Past
        } else if age_seconds >= retention * NEAR_WINDOW {
            Window::Near
        } else {
            Window::Ok
        }
    }
}

/// What [`from_broker`] could not fill in, and whether the error queues' heads were looked at.
pub(super) struct Missing {
    /// Why some of the broker's figures are missing, if they are.
    pub error: Option<String>,
    /// The heads were looked at, each queue's age known or, where its look was refused, unknown (`None`): false when
    /// the connection failed before every queue was seen, or the looks were cut short.
    pub heads_looked: bool,
    /// The looks ran out of `broker_within` before they were done: the heads not looked at keep no new age, and are
    /// not looked at again at once.
    pub cut_short: bool,
}

/// Fills in the queues' depths and the error queues' oldest messages: every depth first, then the heads, so that slow
/// looks at heads (a quorum queue without a leader answers a take late or never) never leave a depth unknown. A look
/// at one error queue's oldest message that is refused (no read permission on it) leaves that age unknown and the
/// others are still looked at: one queue's refusal must not blank the figures of every consumer_type after it, nor
/// have the refused queue's neighbours looked at again on every refresh as if no look had been made.
///
/// With `range.broker_within`, the whole is bounded: what was not answered by then stays unknown, said in the error
/// (`cut_short`: the heads not all looked at).
pub(super) async fn from_broker(
    connection: &Connection,
    consumers: &mut [ConsumerStats],
    range: Range,
) -> Missing {
    let mut found = Found {
        error: None,
        complete: true,
        cut_short: false,
    };
    let Some(within) = range.broker_within else {
        look(connection, consumers, range, &mut found).await;
        return found.missing(range);
    };
    if tokio::time::timeout(within, look(connection, consumers, range, &mut found))
        .await
        .is_err()
    {
        found.cut_short = true;
        found.error = Some(format!(
            "RabbitMQ did not answer every look within {}: the figures it gave are shown",
            humantime::format_duration(within)
        ));
    }
    found.missing(range)
}

/// What the looks found missing so far.
struct Found {
    error: Option<String>,
    complete: bool,
    cut_short: bool,
}

impl Found {
    fn missing(self, range: Range) -> Missing {
        Missing {
            error: self.error,
            heads_looked: range.look_at_heads && self.complete && !self.cut_short,
            cut_short: self.cut_short,
        }
    }
}

async fn look(
    connection: &Connection,
    consumers: &mut [ConsumerStats],
    range: Range,
    found: &mut Found,
) {
    if !depths(connection, consumers, found).await || !range.look_at_heads {
        return;
    }
    for c in consumers.iter_mut().filter(|c| c.other_vhost.is_none()) {
        if !head(connection, c, found).await {
            return;
        }
    }
}

/// Each consumer_type's queues' depths; false when the connection failed.
async fn depths(
    connection: &Connection,
    consumers: &mut [ConsumerStats],
    found: &mut Found,
) -> bool {
    for c in consumers.iter_mut().filter(|c| c.other_vhost.is_none()) {
        // Whether the consumer's queue is in this vhost: only then does a missing error queue mean nothing failed.
        let mut queue_here = false;
        for (is_error_queue, depth) in [(false, c.queue.as_mut()), (true, c.error_queue.as_mut())]
            .into_iter()
            .filter_map(|(e, d)| d.map(|d| (e, d)))
        {
            if crate::amqp::no_queue_can_have(&depth.name) {
                continue;
            }
            match queue_depth(connection, &depth.name, depth.partitions).await {
                Ok(Some((ready, consumers))) => {
                    depth.ready = Some(ready);
                    depth.consumers = Some(consumers);
                    depth.exists = true;
                    queue_here |= !is_error_queue;
                }
                Ok(None) => {
                    // An error queue that does not exist beside its queue has nothing in it: 0 is known, not assumed.
                    // With the queue not here either (stats pointed at another vhost), nothing is known.
                    if is_error_queue && queue_here {
                        depth.ready = Some(0);
                    }
                }
                // One queue that cannot be reached (a classic queue whose node is down) leaves its own figures
                // unknown; the others are still looked at while the connection holds.
                Err(e) => {
                    found
                        .error
                        .get_or_insert_with(|| crate::redact::text(&e.to_string()));
                    if !connection.status().connected() {
                        found.complete = false;
                        return false;
                    }
                }
            }
        }
    }
    true
}

/// The head of `c`'s error queue; false when the connection failed.
async fn head(connection: &Connection, c: &mut ConsumerStats, found: &mut Found) -> bool {
    // An error queue counted 0 is looked at too: a quorum queue without a leader answers every count with 0
    // whatever it holds, and the look (a take of one message, given back) is what tells it from an empty one.
    let Some(q) = c
        .error_queue
        .as_mut()
        .filter(|q| q.exists && q.ready.is_some())
    else {
        return true;
    };
    // The check of a 0 is bounded apart (a leaderless queue may leave the take unanswered): `top`'s refresh
    // would otherwise end at its own limit with no figures at all. A role without read on the queue (a
    // monitoring role) cannot check it: its 0 stands as counted, as before the check.
    let counted = q.ready;
    let counted_zero = counted == Some(0);
    // Unknown until checked: a look cut short (`broker_within`) leaves no 0 it did not check.
    if counted_zero {
        q.ready = None;
    }
    // A head looked at often is left alone from then on (below), until its queue is seen empty.
    if counted_zero {
        worn(&q.name, None);
    } else if is_worn(&q.name) {
        c.head_skipped = true;
        return true;
    }
    // A look the broker answers late (a test holds it here).
    crate::failpoint::hit_with("head-look", &q.name).await;
    let looked = if counted_zero {
        match tokio::time::timeout(ZERO_CHECK, oldest_failure(connection, &q.name)).await {
            Ok(Err(Error::Broker(e))) if e.is_access_refused() => {
                q.ready = counted;
                return true;
            }
            Ok(looked) => looked,
            Err(_) => Err(Error::Topology(format!(
                "a take from it, to check its count of 0, was not answered within {}s",
                ZERO_CHECK.as_secs()
            ))),
        }
    } else {
        oldest_failure(connection, &q.name).await
    };
    c.head_looked = true;
    match looked {
        Ok((depth, age, deliveries)) => {
            if let Some(n) = deliveries.filter(|&n| n >= WORN) {
                worn(&q.name, Some(n));
            }
            c.oldest_dead_letter_seconds = age;
            q.ready = depth
                .map(|depth| u32::try_from(depth).unwrap_or(u32::MAX))
                .or(counted);
        }
        Err(e) => {
            // A count of 0 it could not check says nothing (left unknown above); another count stands.
            c.oldest_dead_letter_seconds = None;
            // Made inert where it is shown (`stats`' table, `top`'s status line), as the broker's own words in it
            // are: made so here too, the name's escapes were escaped again.
            found.error.get_or_insert_with(|| {
                format!(
                    "the oldest message of {} could not be looked at: {}",
                    q.name,
                    crate::redact::text(&e.to_string())
                )
            });
            if !connection.status().connected() {
                found.complete = false;
                return false;
            }
        }
    }
    true
}

/// Ready messages and consumers of `queue`, or spread over `partitions` queues, their ready messages summed and the
/// most consumers any of them has; `None` when no such queue exists.
async fn queue_depth(
    connection: &Connection,
    queue: &str,
    partitions: Option<u16>,
) -> Result<Option<(u32, u32)>> {
    let Some(count) = partitions else {
        return topology::queue_depth(connection, queue).await;
    };
    let mut total: Option<(u32, u32)> = None;
    for index in 0..count {
        let partition = topology::partition_queue(queue, index);
        if let Some((ready, consumers)) = topology::queue_depth(connection, &partition).await? {
            let (r, c) = total.unwrap_or_default();
            total = Some((r.saturating_add(ready), c.max(consumers)));
        }
    }
    Ok(total)
}

/// The error queues whose head this process no longer looks at: a head [`WORN`] times delivered is not looked at again
/// by this process (`top`, every 30 s, would get it to a `delivery-limit` in minutes). Its age stays the last one
/// seen, aging; the queue seen empty, its next head is looked at.
static WORN_HEADS: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn is_worn(queue: &str) -> bool {
    WORN_HEADS
        .lock()
        .map(|worn| worn.contains(queue))
        .unwrap_or(false)
}

/// Marks `queue`'s head as worn, delivered `deliveries` times before, or (`None`: the queue seen empty) no longer.
fn worn(queue: &str, deliveries: Option<u32>) {
    if let Ok(mut worn) = WORN_HEADS.lock() {
        match deliveries {
            Some(n) if worn.insert(queue.to_owned()) => tracing::warn!(
                queue = %crate::sanitize::text(queue),
                "{}; its oldest message is not looked at again while this runs",
                crate::amqp::peek::worn(n)
            ),
            Some(_) => {}
            None => {
                worn.remove(queue);
            }
        }
    }
}

/// How long a look checks an error queue's count of 0 (well within `top`'s refresh limit).
const ZERO_CHECK: Duration = Duration::from_secs(3);

/// The messages ready in `queue` as the look counted them (a count of 0 checked by taking one), how long ago the
/// message at its head failed (as its headers say, else when it was published), and how many times it had been
/// delivered before (`x-delivery-count`).
async fn oldest_failure(
    connection: &Connection,
    queue: &str,
) -> Result<(Option<u64>, Option<f64>, Option<u32>)> {
    let mut failed_at = None;
    let mut deliveries = None;
    let looked = crate::amqp::peek::each(
        connection,
        queue,
        1,
        crate::amqp::DEFAULT_BROKER_TIMEOUT,
        |d| {
            let failure = crate::amqp::failure::failure(d.properties.headers().as_ref(), queue, "");
            failed_at = crate::amqp::failure::failed_at(d, &failure);
            deliveries = crate::amqp::failure::delivery_count(d.properties.headers().as_ref());
        },
    )
    .await?;
    // `failed_at` passes over a time more than a day ahead (it tells nothing of the age); one a little ahead is of
    // now, not of a negative age.
    let now = Utc::now();
    let age = failed_at.map(|t| ((now - t).num_milliseconds() as f64 / 1000.0).max(0.0));
    Ok((looked.map(|l| l.depth), age, deliveries))
}
