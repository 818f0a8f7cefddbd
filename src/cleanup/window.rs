//! The deduplication window, guarded: the inbox recognises a copy only while its message's row exists, so a message
//! waiting in a dead-letter queue for its replay must keep its row. Before cleaning a consumer_type, the cleanup
//! looks at the messages of each of its dead-letter queues (up to [`GUARD_AT_MOST`]; not the head alone, which a quorum
//! queue does not keep oldest), without taking them; if one failed before the cutoff, deleting that consumer_type's
//! rows could let its replay do the work twice, and the consumer_type is left alone (unless `--force`).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;

use super::ConsumerReport;
use super::refusal::{OtherVhost, Refusal};
use crate::amqp::failure::{failed_at, failure};
use crate::amqp::{Broker, Delivery, answered, limits, peek, topology};
use crate::db;
use crate::error::{Error, Result};
use crate::inbox::TimeSource;

/// Where to look: the broker, and dead-letter-exchange queues beyond each consumer_type's own `_error`/`_skipped`.
#[derive(Debug, Clone)]
pub struct Guard {
    pub broker: Broker,
    /// Dead-letter-exchange queues (`--dlq`): an old message in one keeps every consumer_type's rows
    /// (any origin may wait there).
    pub dlqs: Vec<String>,
    /// How long any call to RabbitMQ may wait for its answer (`--broker-timeout`): past it the cleanup fails, saying
    /// so, and deletes nothing.
    pub broker_timeout: std::time::Duration,
}

/// The head of one dead-letter queue, as the guard reads it.
#[derive(Clone)]
struct Head {
    message_id: Option<String>,
    failed_at: Option<DateTime<Utc>>,
    /// On a partitioned inbox, the time its claim is keyed on (`None`: unpartitioned, or a message carrying none).
    message_time: Option<DateTime<Utc>>,
}

/// How long the guard waits for another look at a dead-letter queue to end (`find`, `failures`, `top`'s detail,
/// another cleanup's guard) before it refuses: the messages such a look holds are out of sight.
const OTHER_LOOK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The most messages of one dead-letter queue the guard looks at.
const GUARD_AT_MOST: u64 = 10_000;

/// What the guard saw of a dead-letter queue.
enum Seen {
    /// Its messages (up to [`GUARD_AT_MOST`]; none: empty), and whether they are all it held when looked at.
    Messages(Vec<Head>, bool),
    /// A replay of it is running.
    Replaying,
    /// Another look held it marked through every try for [`OTHER_LOOK_WAIT`].
    LookedAtElsewhere,
    /// Another client consumes it (this many): what it holds unacknowledged is out of sight.
    Consumed(u32),
}

/// The messages of `queue`, unless a replay of it is running or another look keeps them out of sight. The
/// replay's marker is looked for before the look at the head and again after it: a replay running before holds
/// messages out of the look's sight (and may end, giving them back, before a look after), and one beginning in between
/// marks the queue before it takes anything, so the look after sees it.
///
/// Other looks mark the queue while they look (`peek`), and the guard's look reads the marks before its take and
/// after it: another's mark at either read (crowded), and it looks again after about half a second (a random part, so
/// that two cleanups do not keep meeting), until [`OTHER_LOOK_WAIT`] has passed. (Not a second take compared with the
/// first: a quorum queue puts a message given back at its tail, so the head changes with every look.)
async fn head_unless_replaying(
    connection: &crate::amqp::Connection,
    queue: &str,
    vhost: &str,
    keyed_on: Option<TimeSource>,
    within: std::time::Duration,
) -> Result<Seen> {
    let until = std::time::Instant::now() + OTHER_LOOK_WAIT;
    let mut takes = 0;
    let replay_running = || {
        answered(
            REPLAY_MARKER,
            within,
            topology::replay_running(connection, queue),
        )
    };
    loop {
        if replay_running().await?? {
            return Ok(Seen::Replaying);
        }
        // Another's mark up: waited for without taking anything (each take counts towards a quorum queue's delivery
        // limit where RabbitMQ counts every return), then looked at once it is gone.
        let clear = answered(MARKS, within, topology::looks_at(connection, queue))
            .await?
            .is_some_and(|looks| looks == 0);
        if clear {
            crate::failpoint::hit_with("guard-between-looks", queue).await;
            let (seen, looked) = peek::all(connection, queue, GUARD_AT_MOST, within, |d| {
                head(d, queue, vhost, keyed_on)
            })
            .await?;
            takes += 1;
            if let Some(most) = looked
                .and_then(|l| l.most_deliveries)
                .filter(|&n| n >= peek::WORN)
            {
                tracing::warn!(queue = %crate::sanitize::text(queue), "{}", peek::worn(most));
            }
            if replay_running().await?? {
                return Ok(Seen::Replaying);
            }
            if let Some(consumers) = looked.map(|l| l.consumers).filter(|&n| n > 0) {
                return Ok(Seen::Consumed(consumers));
            }
            let all = looked.is_none_or(|l| l.looked >= l.depth);
            if !looked.is_some_and(|l| l.crowded) {
                return Ok(Seen::Messages(seen, all));
            }
        }
        if std::time::Instant::now() >= until || takes >= MAX_GUARD_TAKES {
            return Ok(Seen::LookedAtElsewhere);
        }
        let jitter = u64::try_from(uuid::Uuid::new_v4().as_u128() % 500).unwrap_or(0);
        tokio::time::sleep(std::time::Duration::from_millis(250 + jitter)).await;
    }
}

/// What the guard waits for, as its errors name them.
const REPLAY_MARKER: &str = "a look for a replay's marker";
const MARKS: &str = "a read of the marks of other looks";
const COUNT: &str = "a count of a --dlq queue";

/// The most looks the guard takes at one dead-letter queue in a run, each crowded by another's.
const MAX_GUARD_TAKES: u32 = 3;

fn head(delivery: &Delivery, queue: &str, vhost: &str, keyed_on: Option<TimeSource>) -> Head {
    let failure = failure(delivery.properties.headers().as_ref(), queue, vhost);
    let message_time = keyed_on.and_then(|source| {
        let incoming = crate::amqp::envelope::parse(&delivery.properties, &delivery.data).ok();
        let carried = crate::amqp::envelope::carried(
            incoming.as_ref().and_then(|i| i.sent_time),
            &delivery.properties,
        );
        let id = match &incoming {
            Some(i) => Some(i.message_id),
            None => delivery
                .properties
                .message_id()
                .as_ref()
                .and_then(|id| uuid::Uuid::parse_str(id.as_str()).ok()),
        }?;
        source.time_of(id, &carried)
    });
    Head {
        message_id: delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| limits::truncate(id.as_str(), 255).into_owned()),
        // A time ahead of this machine's by more than a day (a host's clock far off, a header written by hand) tells
        // nothing of the message's age: taken as young, its row could go while its replay still needs it.
        failed_at: failed_at(delivery, &failure)
            .filter(|t| *t <= Utc::now() + chrono::TimeDelta::days(1)),
        message_time,
    }
}

/// Marks the consumer_types of `consumers` whose dead-letter queues hold a message older than `cutoff` as refused. A
/// consumer_type whose consumer recorded another vhost than the guard's is looked at in that vhost (the same user and
/// nodes): its dead-letter queues are there, and their absence here would read as "nothing waiting". One it cannot
/// look in is refused, and says why.
pub async fn check(
    pool: &PgPool,
    guard: &Guard,
    cutoff: DateTime<Utc>,
    consumers: &mut [ConsumerReport],
) -> Result<()> {
    if consumers.is_empty() {
        return Ok(());
    }
    let queues = db::stats::registered_consumers(pool).await?;
    let vhosts = db::stats::registered_vhosts(pool).await?;
    let earlier = db::stats::registered_earlier(pool).await?;
    let own = guard.broker.vhost().to_owned();
    // Each consumer_type's queues to look at, by vhost: the one its consumers read now, and those they read before (a
    // consumer_type moved to another queue leaves its failed messages in the old one's dead-letter queues).
    let mut by_vhost: BTreeMap<String, Vec<(usize, String)>> = BTreeMap::new();
    for (i, report) in consumers.iter().enumerate() {
        let ct = &report.consumer_type;
        let now_in = vhosts.get(ct).cloned().unwrap_or_else(|| own.clone());
        let mut places = vec![(queue_of(&queues, ct), now_in.clone())];
        for (queue, vhost) in earlier.get(ct).into_iter().flatten() {
            for vhost in db::stats::earlier_vhosts(vhost.as_ref(), &now_in, &own) {
                let place = (queue.clone(), vhost);
                if !places.contains(&place) {
                    places.push(place);
                }
            }
        }
        for (queue, vhost) in places {
            by_vhost.entry(vhost).or_default().push((i, queue));
        }
    }
    let here = by_vhost.remove(&own).unwrap_or_default();
    let elsewhere = by_vhost;
    let unrecorded: Vec<String> = consumers
        .iter()
        .filter(|r| queues.contains_key(&r.consumer_type) && !vhosts.contains_key(&r.consumer_type))
        .map(|r| crate::sanitize::text(&r.consumer_type).into_owned())
        .collect();
    if !unrecorded.is_empty() {
        tracing::warn!(
            consumer_types = %unrecorded.join(", "),
            "these consumers have not recorded the vhost they read in (started before `inboxctl migrate` added it: \
             restart them): their dead letters are looked for in this one"
        );
    }
    // On a partitioned inbox a waiting message's claim lands in the partition of its own time, whenever it failed.
    let keyed_on = match db::partitions::layout(pool).await? {
        Some(db::partitions::Layout::Partitioned(settings)) => Some(settings.source),
        _ => None,
    };
    let looks = Looks {
        cutoff,
        now: Utc::now(),
        keyed_on,
        within: guard.broker_timeout,
    };
    let connection = guard.broker.connect("inboxctl cleanup").await?;
    let result = async {
        looks.each(&connection, &own, consumers, &here).await?;
        looks.dlqs(&connection, &own, &guard.dlqs, consumers).await
    }
    .await;
    crate::amqp::close(&connection, "OK").await;
    result?;
    for (vhost, places) in elsewhere {
        let looked = match guard
            .broker
            .in_vhost(&vhost)
            .connect("inboxctl cleanup")
            .await
        {
            Ok(connection) => {
                let looked = looks.each(&connection, &vhost, consumers, &places).await;
                crate::amqp::close(&connection, "OK").await;
                looked
            }
            // A vhost that no longer exists holds no queue, so no message waits there.
            Err(Error::VhostMissing { .. }) => {
                tracing::warn!(
                    vhost = %crate::sanitize::text(&vhost),
                    "the vhost some consumer_types' consumers recorded no longer exists: nothing of theirs waits \
                     for a replay there"
                );
                Ok(())
            }
            Err(e) => Err(e),
        };
        // One it could not look in (no access to it, no read on a queue there, the broker gone from it): refused, as
        // the message it could not see may be waiting; the rest of the run goes on.
        if let Err(e) = looked {
            let why = crate::redact::text(&e.to_string());
            for (i, queue) in &places {
                let i = *i;
                if consumers[i].refused.is_some() {
                    continue;
                }
                consumers[i].refused = Some(Refusal {
                    other_vhost: Some(OtherVhost {
                        vhost: vhost.clone(),
                        why: why.clone(),
                    }),
                    ..Refusal::of(&topology::error_queue(queue), cutoff)
                });
            }
        }
    }
    Ok(())
}

/// The queue of `consumer_type`: the one its consumer registered, else (a consumer_type inboxctl never ran) its own
/// name, as the .NET tutorial names them.
fn queue_of(queues: &HashMap<String, String>, consumer_type: &str) -> String {
    queues
        .get(consumer_type)
        .cloned()
        .unwrap_or_else(|| consumer_type.to_owned())
}

/// What the looks at the dead-letter queues share.
struct Looks {
    cutoff: DateTime<Utc>,
    now: DateTime<Utc>,
    keyed_on: Option<TimeSource>,
    within: std::time::Duration,
}

/// How far ahead of the database's clock a failure time may have been stamped and still be read as before the cutoff.
/// The time is the failing host's (`MT-Fault-Timestamp`: the consumer's, or a .NET service's), the cutoff the
/// database's: a host Δ ahead stamps a failure at T as T + Δ, and a copy of that message processed in between (its row
/// older than the stamp) would be deleted while the failure looked young, and its replay claimed as new.
const FAILURE_CLOCK_AHEAD: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

impl Looks {
    /// Failed before the cutoff (a failure within [`FAILURE_CLOCK_AHEAD`] after it counts as before), or at no time
    /// told.
    fn too_old(&self, h: &Head) -> bool {
        h.failed_at
            .is_none_or(|t| t < self.cutoff + FAILURE_CLOCK_AHEAD)
    }

    /// Of the messages of a dead-letter queue, the one to refuse on: of those that failed before the cutoff, the one
    /// that failed longest ago (one that tells no time first). All are looked at, not the head alone: a quorum queue
    /// puts a message given back at its tail, so after any look (`stats`, `top`, a guard) its oldest may be anywhere.
    fn oldest_too_old(&self, seen: &[Head]) -> Option<Head> {
        seen.iter()
            .filter(|h| self.too_old(h))
            .min_by_key(|h| h.failed_at)
            .cloned()
    }

    /// Of the messages of a dead-letter queue, the one keyed earliest before the cutoff, if any.
    fn keyed_earliest(&self, seen: &[Head]) -> Option<Head> {
        seen.iter()
            .filter(|h| self.keyed_before_the_window(h))
            .min_by_key(|h| h.message_time)
            .cloned()
    }

    /// Whether `h`, young by its failure, is keyed on a time before the cutoff: its replay claims in a partition past
    /// the window, which must stay while it waits.
    fn keyed_before_the_window(&self, h: &Head) -> bool {
        h.message_time.is_some_and(|t| t < self.cutoff)
    }

    fn refusal(&self, queue: &str, h: Head) -> Refusal {
        Refusal {
            message_id: h.message_id,
            age_seconds: h.failed_at.map(|t| (self.now - t).num_seconds()),
            failed_at: h.failed_at,
            message_time: h.message_time,
            ..Refusal::of(queue, self.cutoff)
        }
    }

    fn replaying(&self, queue: &str) -> Refusal {
        Refusal {
            replay_running: true,
            ..Refusal::of(queue, self.cutoff)
        }
    }

    fn beyond_the_look(&self, queue: &str) -> Refusal {
        Refusal {
            beyond_the_look: true,
            ..Refusal::of(queue, self.cutoff)
        }
    }

    fn looked_at_elsewhere(&self, queue: &str) -> Refusal {
        Refusal {
            looked_at_elsewhere: true,
            ..Refusal::of(queue, self.cutoff)
        }
    }

    fn consumed(&self, queue: &str, consumers: u32) -> Refusal {
        Refusal {
            consumers: Some(consumers),
            ..Refusal::of(queue, self.cutoff)
        }
    }

    /// Looks at the `_error` and `_skipped` queues of each `(i, queue)` of `places` for `consumers[i]`, on
    /// `connection` (in `vhost`); a consumer_type refused by one is not looked at further.
    async fn each(
        &self,
        connection: &crate::amqp::Connection,
        vhost: &str,
        consumers: &mut [ConsumerReport],
        places: &[(usize, String)],
    ) -> Result<()> {
        for (i, queue) in places {
            let report = &mut consumers[*i];
            if report.refused.is_some() {
                continue;
            }
            for dead_letters in [topology::error_queue(queue), topology::skipped_queue(queue)] {
                // RabbitMQ takes no name longer than AMQP's 255 bytes: no such queue can hold anything. Any other
                // name (a control character in a .NET consumer_type's) is looked at like the rest.
                if crate::amqp::no_queue_can_have(&dead_letters) {
                    continue;
                }
                let seen = match head_unless_replaying(
                    connection,
                    &dead_letters,
                    vhost,
                    self.keyed_on,
                    self.within,
                )
                .await?
                {
                    Seen::Messages(seen, all) => {
                        if !all && self.oldest_too_old(&seen).is_none() {
                            report.refused = Some(self.beyond_the_look(&dead_letters));
                            break;
                        }
                        seen
                    }
                    Seen::Replaying => {
                        report.refused = Some(self.replaying(&dead_letters));
                        break;
                    }
                    Seen::LookedAtElsewhere => {
                        report.refused = Some(self.looked_at_elsewhere(&dead_letters));
                        break;
                    }
                    Seen::Consumed(n) => {
                        report.refused = Some(self.consumed(&dead_letters, n));
                        break;
                    }
                };
                if let Some(h) = self.oldest_too_old(&seen) {
                    report.refused = Some(self.refusal(&dead_letters, h));
                    break;
                }
                if report.holds_partitions.is_none()
                    && let Some(h) = self.keyed_earliest(&seen)
                {
                    report.holds_partitions = Some(self.refusal(&dead_letters, h));
                }
            }
        }
        Ok(())
    }

    /// Looks at each `--dlq` (in the guard's vhost): an old head keeps every consumer_type's rows.
    async fn dlqs(
        &self,
        connection: &crate::amqp::Connection,
        vhost: &str,
        dlqs: &[String],
        consumers: &mut [ConsumerReport],
    ) -> Result<()> {
        for dlq in dlqs {
            // Named by the operator: absent here (a typo, another vhost), it is no proof that nothing waits in it. Every
            // consumer_type is refused, as by an old head, and the run goes on (partitions ahead made, the refusal said).
            let count = topology::queue_depth(connection, dlq);
            if answered(COUNT, self.within, count).await??.is_none() {
                for report in consumers.iter_mut().filter(|r| r.refused.is_none()) {
                    report.refused = Some(Refusal {
                        absent: true,
                        ..Refusal::of(dlq, self.cutoff)
                    });
                }
                continue;
            }
            let seen =
                match head_unless_replaying(connection, dlq, vhost, self.keyed_on, self.within)
                    .await?
                {
                    Seen::Messages(seen, all) => {
                        if !all && self.oldest_too_old(&seen).is_none() {
                            for report in consumers.iter_mut().filter(|r| r.refused.is_none()) {
                                report.refused = Some(self.beyond_the_look(dlq));
                            }
                            continue;
                        }
                        seen
                    }
                    seen => {
                        for report in consumers.iter_mut().filter(|r| r.refused.is_none()) {
                            report.refused = Some(match seen {
                                Seen::Replaying => self.replaying(dlq),
                                Seen::Consumed(n) => self.consumed(dlq, n),
                                _ => self.looked_at_elsewhere(dlq),
                            });
                        }
                        continue;
                    }
                };
            let Some(h) = self.oldest_too_old(&seen) else {
                if let Some(h) = self.keyed_earliest(&seen) {
                    for report in consumers
                        .iter_mut()
                        .filter(|r| r.holds_partitions.is_none())
                    {
                        report.holds_partitions = Some(self.refusal(dlq, h.clone()));
                    }
                }
                continue;
            };
            // Messages of any origin wait there (and past the most looked at, unseen): an old one keeps every
            // consumer_type's rows, whatever queue it failed on.
            for report in consumers.iter_mut().filter(|r| r.refused.is_none()) {
                report.refused = Some(self.refusal(dlq, h.clone()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(at: Option<DateTime<Utc>>) -> Head {
        Head {
            message_id: None,
            failed_at: at,
            message_time: None,
        }
    }

    /// A failure stamped by a host ahead of the database's clock: up to five minutes past the cutoff, it is taken as
    /// before it (its message's other rows may be older than the stamp); well past it, as young.
    #[test]
    fn a_failure_just_past_the_cutoff_is_read_as_before_it() {
        let cutoff = Utc::now() - chrono::TimeDelta::days(1);
        let looks = Looks {
            cutoff,
            now: Utc::now(),
            keyed_on: None,
            within: std::time::Duration::from_secs(1),
        };
        let at = |minutes: i64| failed(Some(cutoff + chrono::TimeDelta::minutes(minutes)));
        assert!(looks.too_old(&at(-1)));
        assert!(looks.too_old(&at(2)), "two minutes past the cutoff");
        assert!(looks.too_old(&at(4)), "four minutes past the cutoff");
        assert!(!looks.too_old(&at(6)));
        assert!(!looks.too_old(&at(60)));
        assert!(looks.too_old(&failed(None)), "no time told");
        assert_eq!(
            looks
                .oldest_too_old(&[at(30), at(3)])
                .and_then(|h| h.failed_at),
            Some(cutoff + chrono::TimeDelta::minutes(3))
        );
    }
}
