//! Cleanup on a partitioned inbox (`migrate --partitioned`): partitions made ahead, and every partition wholly older
//! than the cutoff — nothing unprocessed in it, nothing processed within the window, nothing of a consumer_type this
//! run does not clean — detached without stopping the consumers (`DETACH PARTITION … CONCURRENTLY`) and dropped,
//! instead of its rows deleted one batch at a time. What is left in partitions wholly older than the cutoff (the
//! untimed partition, a partition kept for one of those reasons) goes through the batched delete as ever. The
//! partition that holds the cutoff is not touched: its rows past the window go with it, whole, once all of it is past
//! the window — an interval later at most. Deleting them row by row first would cost the consumers the batched
//! delete's WAL and CPU for rows whose partition goes anyway (measured in docs/performance.md).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPool;

use crate::db::{self, partitions::Layout};
use crate::error::Result;

/// What a cleanup did to the partitions of a partitioned inbox.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PartitionWork {
    /// Partitions made ahead of time.
    pub created: Vec<String>,
    /// Partitions wholly older than the cutoff, dropped (with `dry_run`: that would be).
    pub dropped: Vec<Dropped>,
    /// Partitions wholly older than the cutoff and kept, with why; their old rows go by the batched delete.
    pub kept: Vec<Kept>,
    /// Tables a stopped drop had left detached, dropped now.
    pub leftovers: Vec<String>,
    /// The partition that holds the cutoff, if one does: its rows past the window wait for it to go whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<Next>,
    /// Why no partition could be made or dropped (the role is not the table's owner, say): the old rows went by the
    /// batched delete instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The partition whose detach waited past `--detach-wait`, after which no other was tried: the run is partial,
    /// and the batched delete leaves the rows from its start on to the next run's drops.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub given_up: Option<GivenUp>,
}

/// A partition whose detach was given up ([`PartitionWork::given_up`]).
#[derive(Debug, Clone, Serialize)]
pub struct GivenUp {
    pub partition: String,
    pub from: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Dropped {
    pub partition: String,
    pub from: Option<DateTime<Utc>>,
    pub to: Option<DateTime<Utc>>,
    /// Its rows as the planner counted them at its last analyze (none: never analyzed): an estimate.
    pub rows_estimated: Option<u64>,
}

/// The partition that holds the cutoff, and when all of it is past the window (a cleanup after that drops it).
#[derive(Debug, Clone, Serialize)]
pub struct Next {
    pub partition: String,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub whole_past_window_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Kept {
    pub partition: String,
    pub why: String,
    /// Left detached (its lock held elsewhere, or it could not be attached again): a message whose time falls in
    /// its range cannot be claimed until a cleanup settles it, so the run is partial (exit 3).
    pub detached: bool,
}

impl PartitionWork {
    /// The rows the dropped partitions held, as estimated.
    pub fn rows_dropped(&self) -> u64 {
        self.dropped.iter().filter_map(|d| d.rows_estimated).sum()
    }

    /// Which old rows the batched delete takes: those whose message time is below this (none: all of them). A drop
    /// refused (`refused`) ends the look at the partitions before it reaches the one holding the cutoff, so that run
    /// deletes every row past the window by batch: nothing else would remove them.
    pub fn batched_below(&self) -> Option<DateTime<Utc>> {
        let next = self.next.as_ref().map(|n| n.from);
        match (&self.given_up, next) {
            (Some(given_up), Some(next)) => Some(given_up.from.min(next)),
            (Some(given_up), None) => Some(given_up.from),
            (None, next) => next,
        }
    }
}

/// A failure of [`maintain`], with what it had done by then (partitions made, dropped): done all the same.
#[derive(Debug)]
pub struct Failed {
    pub error: crate::error::Error,
    pub work: Option<PartitionWork>,
}

impl From<crate::error::Error> for Failed {
    fn from(error: crate::error::Error) -> Self {
        Failed { error, work: None }
    }
}

/// Makes the partitions of the next days and drops the old ones `cleanable` allows (the consumer_types this run
/// cleans), none while `held` says why none may go; `None` when the inbox is not partitioned. With `dry_run`, changes
/// nothing and says what it would drop.
pub async fn maintain(
    pool: &PgPool,
    window: Window,
    cleanable: &HashSet<String>,
    held: Option<&str>,
    made_ahead: &[String],
    dry_run: bool,
    detach_wait: std::time::Duration,
) -> std::result::Result<Option<PartitionWork>, Failed> {
    let Some(Layout::Partitioned(settings)) = db::partitions::layout(pool).await? else {
        return Ok(None);
    };
    let mut work = PartitionWork::default();
    match drop_and_make(
        pool,
        settings,
        window,
        cleanable,
        held,
        made_ahead,
        dry_run,
        detach_wait,
        &mut work,
    )
    .await
    {
        Ok(()) => Ok(Some(work)),
        // Making, attaching, detaching and dropping a partition are the table owner's: a role that may only delete
        // rows still cleans, by the batched delete.
        Err(crate::error::Error::PrivilegeRefused { reason, .. }) => {
            tracing::warn!(
                reason = %crate::redact::text(&reason),
                "this role may not make or drop the inbox's partitions (only its owner may); deleting the old rows \
                 in batches instead"
            );
            work.refused = Some(reason);
            Ok(Some(work))
        }
        Err(error) => Err(Failed {
            error,
            work: Some(work),
        }),
    }
}

/// Makes the partitions of the time ahead (`db::partitions::AHEAD`) on a partitioned inbox: the first thing a cleanup
/// does, before anything that may refuse or fail (the guard's look at the dead-letter queues, the drops), since a
/// claim whose time no partition holds is refused and its message moved aside — and only a cleanup makes them.
/// The partitions made. A role that may not make them: none, and a warning.
pub async fn make_ahead(pool: &PgPool) -> Result<Vec<String>> {
    let Some(Layout::Partitioned(settings)) = db::partitions::layout(pool).await? else {
        return Ok(Vec::new());
    };
    let mut conn = pool.acquire().await?;
    match db::partitions::make_missing(&mut conn, settings).await {
        Ok(created) => Ok(created),
        Err(crate::error::Error::PrivilegeRefused { reason, .. }) => {
            tracing::warn!(
                reason = %crate::redact::text(&reason),
                "this role may not make the inbox's partitions ahead (only the table's owner may): once those there \
                 run out (3 days at most), every message is refused as unclaimable; run cleanup as the owner"
            );
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// The cleanup's window: rows processed before `cutoff` may go; `retention` is how far back it lies.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub cutoff: DateTime<Utc>,
    pub retention: std::time::Duration,
}

#[allow(clippy::too_many_arguments)]
async fn drop_and_make(
    pool: &PgPool,
    settings: db::partitions::Settings,
    window: Window,
    cleanable: &HashSet<String>,
    held: Option<&str>,
    made_ahead: &[String],
    dry_run: bool,
    detach_wait: std::time::Duration,
    work: &mut PartitionWork,
) -> Result<()> {
    let cutoff = window.cutoff;
    let mut conn = pool.acquire().await?;
    if !dry_run {
        for name in db::partitions::leftovers(&mut conn).await? {
            // Dropped only if nothing in it must stay; else attached again (it is out of the inbox while detached,
            // and a copy of a message whose row it holds would be taken for new).
            let bounds =
                db::partitions::start_of(&name).map(|from| (from, from + settings.interval));
            let settled = db::partitions::settle_detached(&mut conn, &name, bounds, |c| {
                why_kept(c, cutoff, cleanable, held)
            })
            .await?;
            match settled {
                db::partitions::Settled::Dropped => work.leftovers.push(name),
                db::partitions::Settled::Kept { why, attached } => {
                    let how = attached_how(&attached);
                    tracing::warn!(partition = %name, "a partition left detached by a stopped drop holds rows that must stay: {how}");
                    work.kept.push(Kept {
                        partition: name,
                        why: format!("{why} (left detached by a stopped drop: {how})"),
                        detached: attached.is_err(),
                    });
                }
                db::partitions::Settled::Taken => {}
                db::partitions::Settled::Busy => work.kept.push(Kept {
                    partition: name,
                    why: "left detached by a stopped drop, and its lock held elsewhere: the next cleanup settles it"
                        .to_owned(),
                    detached: true,
                }),
            }
        }
        work.created = db::partitions::make_missing(&mut conn, settings).await?;
    }
    let mut partitions = db::partitions::partitions(&mut *conn).await?;
    // Those left half detached first: until one is finished PostgreSQL detaches no other.
    partitions.sort_by_key(|p| !(p.detach_pending && p.to.is_some_and(|to| to <= cutoff)));
    for partition in partitions {
        let (Some(from), Some(to)) = (partition.from, partition.to) else {
            continue; // the untimed partition: its rows go by the batched delete
        };
        if to > cutoff {
            // Oldest first: this one holds the cutoff, and the rest are younger.
            let retention =
                chrono::TimeDelta::from_std(window.retention).unwrap_or(chrono::TimeDelta::MAX);
            work.next = Some(Next {
                partition: partition.name,
                from,
                to,
                whole_past_window_at: to
                    .checked_add_signed(retention)
                    .unwrap_or(DateTime::<Utc>::MAX_UTC),
            });
            break;
        }
        // Made by this run where the partitions had run out: messages of its times are held for it, however old,
        // and claim in it once it is there. Empty now, it is not dropped under them; a later run drops it once what
        // they wrote is past the window.
        if made_ahead.contains(&partition.name) || work.created.contains(&partition.name) {
            work.kept.push(Kept {
                why: "made by this run for messages held since the partitions ran out".to_owned(),
                partition: partition.name,
                detached: false,
            });
            continue;
        }
        // Made later, where the partitions had run out, less than a window ago: its messages, held for it, are
        // claimed in it only from then, and a backlog may still be on its way to it. Its window runs from its making.
        if let Some(at) = partition.made_late.filter(|at| *at >= cutoff) {
            work.kept.push(Kept {
                why: format!(
                    "made at {} for messages held since the partitions ran out: kept a whole window from then",
                    at.format("%Y-%m-%d %H:%M:%S UTC")
                ),
                partition: partition.name,
                detached: false,
            });
            continue;
        }
        if !partition.mine {
            work.kept.push(Kept {
                why: format!(
                    "it belongs to role {:?}, whose rights this role does not have: only its owner may drop it{}",
                    crate::sanitize::text(&partition.owner),
                    if partition.detach_pending {
                        " (left half detached: its range takes no row until its owner finishes the detach or \
                         attaches it again)"
                    } else {
                        ""
                    }
                ),
                partition: partition.name,
                detached: partition.detach_pending,
            });
            continue;
        }
        if let Some(first) = work.given_up.as_ref().map(|g| &g.partition) {
            work.kept.push(Kept {
                why: format!(
                    "not tried this run: the detach of {first} waited past --detach-wait, and this one's would wait \
                     for the same transactions"
                ),
                partition: partition.name,
                detached: partition.detach_pending,
            });
            continue;
        }
        // Left half detached by a drop that stopped (or an operator's detach): the inbox no longer shows its rows,
        // and its range takes none. Finished, and then looked at on the table itself — dropped, or attached again
        // when a row in it must stay (whatever holds the other partitions back).
        if partition.detach_pending && dry_run {
            work.kept.push(Kept {
                partition: partition.name,
                why: "left half detached by a drop that stopped: a cleanup finishes the detach, then drops it or \
                      attaches it again as what it holds says"
                    .to_owned(),
                detached: true,
            });
            continue;
        }
        if !partition.detach_pending {
            let contents = db::partitions::contents(&mut *conn, from, to).await?;
            if let Some(why) = why_kept(&contents, cutoff, cleanable, held) {
                work.kept.push(Kept {
                    partition: partition.name,
                    why,
                    detached: false,
                });
                continue;
            }
        }
        let rows_estimated = db::partitions::rows_estimate(&mut *conn, &partition.name).await?;
        if !dry_run {
            // Between the look above and the detach a claim may still write there (a late copy of an old message):
            // what the detached table holds is looked at again, and if it must stay it is attached again.
            crate::failpoint::hit_with("partition-looked", &partition.name).await;
            match db::partitions::detach(&mut conn, &partition, detach_wait).await? {
                db::partitions::Detached::Done => {}
                db::partitions::Detached::Taken => continue, // another cleanup dropped it first
                db::partitions::Detached::Waited { pending } => {
                    tracing::warn!(
                        partition = %partition.name,
                        wait = %humantime::format_duration(detach_wait),
                        pending,
                        "a partition's detach waited past --detach-wait for the transactions reading the inbox; \
                         left for the next cleanup"
                    );
                    work.kept.push(Kept {
                        partition: partition.name.clone(),
                        why: format!(
                            "its detach waited {} (--detach-wait) for the transactions that could see it (a long \
                             query, a dump, a session idle in a transaction) and was given up: {}",
                            humantime::format_duration(detach_wait),
                            if pending {
                                "left half detached (its range takes no row), for the next cleanup to finish"
                            } else {
                                "the next cleanup tries again"
                            }
                        ),
                        detached: pending,
                    });
                    work.given_up = Some(GivenUp {
                        partition: partition.name,
                        from,
                    });
                    continue;
                }
                db::partitions::Detached::Blocked(reason) => {
                    work.kept.push(Kept {
                        partition: partition.name,
                        why: if reason.contains("pending detach") {
                            format!(
                                "another partition's detach is pending, and PostgreSQL detaches one at a time ({}): \
                                 finish it (ALTER TABLE inbox_messages DETACH PARTITION … FINALIZE) as its owner",
                                crate::sanitize::text(&reason)
                            )
                        } else {
                            format!(
                                "PostgreSQL refused its detach: {}",
                                crate::sanitize::text(&reason)
                            )
                        },
                        detached: false,
                    });
                    continue;
                }
            }
            crate::failpoint::hit("partition-detached").await;
            let settled = db::partitions::settle_detached(
                &mut conn,
                &partition.name,
                Some((from, to)),
                |c| why_kept(c, cutoff, cleanable, held),
            )
            .await?;
            match settled {
                db::partitions::Settled::Dropped => {}
                db::partitions::Settled::Kept { why, attached } => {
                    let how = attached_how(&attached);
                    tracing::warn!(partition = %partition.name, "a partition written to as it was being dropped holds rows that must stay: {how}");
                    work.kept.push(Kept {
                        partition: partition.name,
                        why: format!("{why} (written to as it was being dropped: {how})"),
                        detached: attached.is_err(),
                    });
                    continue;
                }
                // Another cleanup settled it first (took it for a leftover).
                db::partitions::Settled::Taken => continue,
                db::partitions::Settled::Busy => {
                    tracing::warn!(partition = %partition.name, "a detached partition's lock is held elsewhere: left detached, for the next cleanup");
                    work.kept.push(Kept {
                        partition: partition.name,
                        why: "detached, and its lock held elsewhere (an autovacuum, a dump): left detached, for the \
                              next cleanup to settle"
                            .to_owned(),
                        detached: true,
                    });
                    continue;
                }
            }
        }
        tracing::info!(partition = %partition.name, ?rows_estimated, dry_run, "dropped a partition older than the cutoff");
        work.dropped.push(Dropped {
            partition: partition.name,
            from: Some(from),
            to: Some(to),
            rows_estimated,
        });
    }
    Ok(())
}

/// What became of a kept partition that had been detached, for the report: attached again, or why not.
fn attached_how(attached: &std::result::Result<(), String>) -> String {
    match attached {
        Ok(()) => "attached again".to_owned(),
        Err(reason) => format!(
            "it could not be attached again ({}): attach it by hand",
            crate::redact::text(reason)
        ),
    }
}

/// Why a partition wholly older than the cutoff cannot go whole, if it cannot; `held`: why no partition may go.
fn why_kept(
    contents: &db::partitions::Contents,
    cutoff: DateTime<Utc>,
    cleanable: &HashSet<String>,
    held: Option<&str>,
) -> Option<String> {
    if contents.unprocessed {
        return Some(
            "it holds unprocessed rows (a consumer that never sets processed_at, or work in flight)".to_owned(),
        );
    }
    if let Some(held) = held {
        return Some(held.to_owned());
    }
    for (consumer_type, newest) in &contents.consumer_types {
        if !cleanable.contains(consumer_type) {
            return Some(format!(
                "it holds rows of consumer_type {consumer_type:?}, which this cleanup leaves (refused, busy or not \
                 chosen)"
            ));
        }
        if newest.is_some_and(|t| t >= cutoff) {
            return Some(format!(
                "rows of consumer_type {consumer_type:?} in it were processed within the window (late copies or \
                 replays of old messages)"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .expect("time")
            .with_timezone(&Utc)
    }

    #[test]
    fn a_partition_goes_whole_only_when_every_row_of_it_may_go() {
        let cutoff = t("2026-12-01T00:00:00Z");
        let cleanable: HashSet<String> = ["a".to_owned(), "b".to_owned()].into();
        let contents = |unprocessed, types: &[(&str, &str)]| db::partitions::Contents {
            unprocessed,
            consumer_types: types
                .iter()
                .map(|(c, at)| ((*c).to_owned(), Some(t(at))))
                .collect(),
        };
        let old = "2026-11-20T00:00:00Z";
        assert_eq!(
            why_kept(
                &contents(false, &[("a", old), ("b", old)]),
                cutoff,
                &cleanable,
                None
            ),
            None
        );
        assert_eq!(
            why_kept(&contents(false, &[]), cutoff, &cleanable, None),
            None
        );
        assert_eq!(
            why_kept(&contents(false, &[]), cutoff, &cleanable, Some("held")).as_deref(),
            Some("held"),
            "an empty partition too, while a replay may need it"
        );
        assert!(
            why_kept(&contents(true, &[("a", old)]), cutoff, &cleanable, None)
                .is_some_and(|w| w.contains("unprocessed"))
        );
        assert!(
            why_kept(
                &contents(false, &[("a", old), ("c", old)]),
                cutoff,
                &cleanable,
                None
            )
            .is_some_and(|w| w.contains("\"c\""))
        );
        assert!(
            why_kept(
                &contents(false, &[("a", "2026-12-01T00:00:00Z")]),
                cutoff,
                &cleanable,
                None
            )
            .is_some_and(|w| w.contains("within the window"))
        );
    }
}
