//! Purging the inbox: processed rows older than the retention window, in small batches, never an unprocessed row.
//!
//! Each batch is one `DELETE` of at most `batch_size` rows found through `(consumer_type, processed_at)`, in a
//! transaction of its own: consumers never wait on a cleanup for longer than one batch, and an interrupted cleanup
//! leaves every batch either done or not begun. Two cleanups at once never clean the same consumer_type together: an
//! advisory lock per consumer_type makes the second one skip it (and say so), so neither waits on the other, deletes a
//! row twice, or deadlocks. Through a transaction pooler (`--transaction-pooling`), where no session lasts, each batch
//! takes that lock for its own transaction: a second cleanup skips a consumer_type from the first batch it finds
//! locked, so two cleanups may take turns on one consumer_type, but never delete from it at the same time.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, Postgres};
use tokio_util::sync::CancellationToken;

use crate::db::{self, Database, schema};
use crate::error::Result;

pub mod partitions;
mod prune;
pub mod refusal;
mod schedule;
pub mod window;

use prune::{EffectsPruned, prune_attempts, prune_audit, prune_effects};

pub use refusal::Refusal;
pub use schedule::scheduled;
pub use window::Guard;

/// What to clean.
#[derive(Debug, Clone)]
pub struct Plan {
    pub retention: Duration,
    /// One consumer_type, or all of them.
    pub consumer_type: Option<String>,
    pub batch_size: i64,
    /// Rest between batches, to leave the database room on a busy day.
    pub batch_pause: Duration,
    /// Count only; delete nothing.
    pub dry_run: bool,
    /// Where to look for dead-lettered messages older than the cutoff before cleaning (none: `--force`).
    pub guard: Option<Guard>,
    /// How long audit rows are kept (longer than the inbox's, as a rule).
    pub audit_retention: Duration,
    /// How long dropping a partition waits for the transactions that could see it before leaving it for the next
    /// cleanup (`--detach-wait`).
    pub detach_wait: Duration,
}

/// One consumer_type's share of a cleanup.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ConsumerReport {
    pub consumer_type: String,
    /// Processed inbox rows older than the cutoff that were deleted (with `dry_run`: that would be).
    pub deleted: u64,
    /// inboxctl's own event rows older than the cutoff deleted (or that would be).
    pub events_deleted: u64,
    /// Rows received before the cutoff and never processed: kept, and a warning.
    pub unprocessed_older: u64,
    pub oldest_unprocessed: Option<DateTime<Utc>>,
    /// Another cleanup was cleaning this consumer_type, so this one left it to that one (through a transaction pooler,
    /// perhaps after batches of its own).
    pub busy: bool,
    /// Left alone: a dead-letter queue of its holds a message older than the cutoff, whose replay needs its row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<Refusal>,
    /// Cleaned, but no partition goes: on a partitioned inbox, a dead-letter queue of its holds at its head a message
    /// that failed within the window but whose own time (its claim's key) is before the cutoff — a replay that
    /// failed again, a delayed redelivery — and its replay claims in the partition of that time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds_partitions: Option<Refusal>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub retention_seconds: u64,
    pub cutoff: DateTime<Utc>,
    pub dry_run: bool,
    /// Stopped by a signal before the end; what was deleted stays deleted.
    pub interrupted: bool,
    pub consumers: Vec<ConsumerReport>,
    pub deleted: u64,
    pub events_deleted: u64,
    /// Counts of redelivered messages' starts (see `consume --poison-after`) older than the window: left by messages
    /// that never came back.
    pub attempts_deleted: u64,
    /// Audit rows older than the audit's own retention, deleted.
    pub audit_deleted: u64,
    /// Records of calls made outside the database (`inboxctl_effects`) that were done before the cutoff, deleted
    /// (a dry run: that would be). Calls owed, started, in doubt or failed stay until settled.
    pub effects_deleted: u64,
    /// Why the records of done calls were left, when they were (the role may not delete them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub effects_left: Option<String>,
    /// Consumer_types left alone to keep the deduplication window of a waiting replay.
    pub refused: u64,
    /// A partitioned inbox: the partitions made ahead, and those dropped whole (their rows not counted in `deleted`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitions: Option<partitions::PartitionWork>,
    /// What ended the run early after it had deleted rows (the database gone mid-run, a role that may not prune the
    /// audit): what it deleted is reported all the same, and the run is partial.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    pub seconds: f64,
    pub rows_per_second: f64,
}

/// Progress after each batch: the consumer_type at hand and the rows deleted so far in this run.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub consumer_type: &'a str,
    pub deleted: u64,
    pub elapsed: Duration,
}

/// What a scheduled cleanup tells its caller, as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// A run begins.
    Started,
    /// A batch of the run is done.
    Progress(Progress<'a>),
    /// A run has ended (interrupted or not).
    Finished(&'a Report),
    /// A run of `--every` failed, after one had succeeded; the next runs on schedule.
    Failed(&'a crate::error::Error),
}

/// Refuses to clean a database `migrate` has not prepared: cleanup's batches delete fingerprints and events with their
/// inbox rows, so a database from before those tables needs `migrate` first.
pub async fn check_schema(pool: &PgPool, db: &Database) -> Result<()> {
    schema::require_tables(
        pool,
        db,
        &["inbox_messages", "inboxctl_events", "inboxctl_fingerprints"],
    )
    .await
}

impl Report {
    /// Partial when interrupted, when a consumer_type was left to keep a waiting replay's window, or when a
    /// partition was left detached (the next cleanup settles it) or its detach given up (`--detach-wait`).
    pub fn outcome(&self) -> crate::error::Outcome {
        let detached = self
            .partitions
            .as_ref()
            .is_some_and(|p| p.kept.iter().any(|k| k.detached) || p.given_up.is_some());
        if self.interrupted || self.refused > 0 || detached || self.failed.is_some() {
            crate::error::Outcome::Partial
        } else {
            crate::error::Outcome::Done
        }
    }
}

/// Runs one cleanup. Stops between two batches when `shutdown` is cancelled.
pub async fn run(
    pool: &PgPool,
    plan: &Plan,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<Report> {
    let started = Instant::now();
    let cutoff = db::cleanup::cutoff(pool, plan.retention).await?;
    let window = partitions::Window {
        cutoff,
        retention: plan.retention,
    };
    let made_ahead = if plan.dry_run {
        Vec::new()
    } else {
        partitions::make_ahead(pool).await?
    };
    let mut consumers = reports(pool, plan, cutoff).await?;
    if let Some(guard) = &plan.guard {
        window::check(pool, guard, cutoff, &mut consumers).await?;
    }
    let held = partitions_held(plan, &consumers);

    let mut interrupted = false;
    let mut attempts_deleted = 0;
    let mut audit_deleted = 0;
    let mut effects = EffectsPruned::default();
    let mut failed = None;
    let partitions;
    if plan.dry_run {
        let cleanable = consumers
            .iter()
            .filter(|c| c.refused.is_none())
            .map(|c| c.consumer_type.clone())
            .collect();
        partitions = partitions::maintain(
            pool,
            window,
            &cleanable,
            held.as_deref(),
            &[],
            true,
            plan.detach_wait,
        )
        .await
        .map_err(|f| f.error)?;
        count_what_would_go(pool, &mut consumers, cutoff, &partitions).await?;
        let order: Vec<usize> = (0..consumers.len())
            .filter(|&i| consumers[i].refused.is_none())
            .collect();
        prune_effects(
            pool,
            plan,
            &consumers,
            &order,
            cutoff,
            shutdown,
            &mut effects,
        )
        .await?;
    } else {
        let (lock, mine) = take_locks(pool, &mut consumers).await?;
        let cleanable = mine
            .iter()
            .map(|&i| consumers[i].consumer_type.clone())
            .collect();
        let maintained = partitions::maintain(
            pool,
            window,
            &cleanable,
            held.as_deref(),
            &made_ahead,
            false,
            plan.detach_wait,
        )
        .await;
        let result = match maintained {
            Ok(mut work) => {
                if let Some(work) = &mut work {
                    work.created.splice(0..0, made_ahead);
                }
                partitions = work;
                delete_in_turns(
                    pool,
                    plan,
                    cutoff,
                    &mut consumers,
                    &mine,
                    shutdown,
                    &mut progress,
                    started,
                    processed_rows(&partitions),
                )
                .await
            }
            // What it dropped before it failed is dropped: reported with the failure.
            Err(failed) => {
                partitions = failed.work.map(|mut work| {
                    work.created.splice(0..0, made_ahead);
                    work
                });
                Err(failed.error)
            }
        };
        if let Some(mut lock) = lock
            && db::cleanup::unlock_all(&mut *lock).await.is_err()
        {
            lock.close_on_drop();
        }
        // A failure after rows went ends the run, but not its report: each batch was committed, and what went is
        // said, audited and counted.
        // Each step counts what it deleted as it goes, and says whether a stop ended it: a stop between steps, or
        // in one, ends the run interrupted (exit 3), the rest left for the next.
        let steps = async {
            interrupted = result?;
            if !interrupted {
                prune_attempts(pool, &consumers, &mine, cutoff, &mut attempts_deleted).await?;
                interrupted = prune_effects(
                    pool,
                    plan,
                    &consumers,
                    &mine,
                    cutoff,
                    shutdown,
                    &mut effects,
                )
                .await?;
            }
            if !interrupted {
                interrupted = prune_audit(pool, plan, shutdown, &mut audit_deleted).await?;
            }
            Ok::<(), crate::error::Error>(())
        }
        .await;
        if let Err(e) = steps {
            let went = consumers
                .iter()
                .any(|c| c.deleted > 0 || c.events_deleted > 0)
                || attempts_deleted > 0
                || effects.deleted > 0
                || audit_deleted > 0
                || partitions
                    .as_ref()
                    .is_some_and(|p| !p.dropped.is_empty() || !p.leftovers.is_empty());
            if !went {
                return Err(e);
            }
            let why = crate::redact::text(&e.to_string());
            tracing::warn!(error = %crate::sanitize::text(&why), "the cleanup failed after deleting rows; what it deleted is reported");
            failed = Some(why);
        }
    }

    let seconds = started.elapsed().as_secs_f64();
    let deleted = consumers.iter().map(|c| c.deleted).sum::<u64>();
    Ok(Report {
        retention_seconds: plan.retention.as_secs(),
        cutoff,
        dry_run: plan.dry_run,
        interrupted,
        events_deleted: consumers.iter().map(|c| c.events_deleted).sum(),
        attempts_deleted,
        audit_deleted,
        effects_deleted: effects.deleted,
        effects_left: effects.left,
        refused: consumers.iter().filter(|c| c.refused.is_some()).count() as u64,
        partitions,
        failed,
        consumers,
        deleted,
        seconds,
        rows_per_second: if plan.dry_run || seconds == 0.0 {
            0.0
        } else {
            deleted as f64 / seconds
        },
    })
}

/// Why no partition may go this run, if one may not: the guard refused a consumer_type, whose dead-lettered message
/// waits for its replay (or a replay of its queue runs). The replayed message's claim lands in the partition of its
/// own time, which may hold no row of that consumer_type — an old day whose other rows may all go — and with that
/// partition gone the message could never be claimed again: moved aside as unclaimable, its effect never made.
///
/// A run of one `--consumer-type` (not forced) drops none either: its guard looked at that consumer_type's dead-letter
/// queues only, and a partition holding no row of the others may hold the time of one of their waiting messages.
fn partitions_held(plan: &Plan, consumers: &[ConsumerReport]) -> Option<String> {
    if let Some(refused) = consumers.iter().find(|c| c.refused.is_some()) {
        return Some(format!(
            "consumer_type {:?} is refused (a dead-lettered message of it waits for its replay, or may: see its \
             refusal): the replayed message's claim lands in the partition of its own time, which may be this one; \
             no partition goes until it is replayed or removed (or --force)",
            crate::sanitize::text(&refused.consumer_type)
        ));
    }
    if let Some(waiting) = consumers.iter().find_map(|c| c.holds_partitions.as_ref()) {
        return Some(format!(
            "{} holds message {} whose own time ({}) is before the cutoff, though it failed within the window: its \
             replay claims in the partition of that time; no partition goes until it is replayed or removed (or \
             --force)",
            crate::sanitize::text(&waiting.queue),
            crate::sanitize::text(waiting.message_id.as_deref().unwrap_or("(no message id)")),
            waiting
                .message_time
                .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                .unwrap_or_default()
        ));
    }
    match (&plan.consumer_type, &plan.guard) {
        (Some(one), Some(_)) => Some(format!(
            "this run cleans consumer_type {:?} only, and looked at its dead-letter queues only: a partition may \
             hold the time of another's waiting message, whose replay claims there; partitions go in a run over \
             every consumer_type (or with --force)",
            crate::sanitize::text(one)
        )),
        _ => None,
    }
}

/// The consumer_types this cleanup cleans (indexes into `consumers`, those not refused), each locked for the whole run
/// on a session of its own, returned with them: the locks live as long as it, and are released however the cleanup
/// ends (a session that cannot release them is closed, which does). Another cleanup's consumer_types are marked busy.
/// Through a transaction pooler, where no session lasts, no session: each batch takes its consumer_type's lock for its
/// own transaction ([`db::cleanup::delete_batch_locked`]).
async fn take_locks(
    pool: &PgPool,
    consumers: &mut [ConsumerReport],
) -> Result<(Option<PoolConnection<Postgres>>, Vec<usize>)> {
    let candidates = consumers
        .iter()
        .enumerate()
        .filter(|(_, c)| c.refused.is_none())
        .map(|(i, _)| i);
    if db::pooler::active() {
        return Ok((None, candidates.collect()));
    }
    let candidates: Vec<usize> = candidates.collect();
    let mut lock = pool.acquire().await?;
    let mut mine = Vec::with_capacity(candidates.len());
    for i in candidates {
        let report = &mut consumers[i];
        if db::cleanup::try_lock(&mut *lock, &report.consumer_type).await? {
            mine.push(i);
        } else {
            report.busy = true;
        }
    }
    Ok((Some(lock), mine))
}

/// One batch of a consumer_type's processed rows (phase 0) or event rows (phase 1); `None` when, through a transaction
/// pooler, another cleanup holds the consumer_type's lock.
async fn one_batch(
    pool: &PgPool,
    phase: u8,
    consumer_type: &str,
    cutoff: DateTime<Utc>,
    limit: i64,
    processed: db::cleanup::Rows,
) -> Result<Option<u64>> {
    let rows = match phase {
        0 => processed,
        _ => db::cleanup::Rows::Events,
    };
    if db::pooler::active() {
        let batch = db::cleanup::delete_batch_locked(pool, rows, consumer_type, cutoff, limit);
        return Ok(batch.await?);
    }
    Ok(Some(match rows {
        db::cleanup::Rows::Events => {
            db::cleanup::delete_events_batch(pool, consumer_type, cutoff, limit).await?
        }
        processed => {
            db::cleanup::delete_processed_batch(pool, processed, consumer_type, cutoff, limit)
                .await?
        }
    }))
}

/// Which processed inbox rows the batched delete takes: on a partitioned inbox, only those of the partitions wholly
/// past the window (`partitions::PartitionWork::batched_below`).
fn processed_rows(partitions: &Option<partitions::PartitionWork>) -> db::cleanup::Rows {
    match partitions {
        None => db::cleanup::Rows::Processed,
        Some(work) => db::cleanup::Rows::ProcessedPartitioned {
            below: work.batched_below(),
        },
    }
}

/// A dry run's counts: what each consumer_type not refused would lose. The rows of the partitions it would drop are
/// counted with them (`partitions`), not in `deleted`: a real run drops them before its batched delete.
async fn count_what_would_go(
    pool: &PgPool,
    consumers: &mut [ConsumerReport],
    cutoff: DateTime<Utc>,
    partitions: &Option<partitions::PartitionWork>,
) -> Result<()> {
    let processed = processed_rows(partitions);
    let dropped: Vec<String> = partitions
        .iter()
        .flat_map(|work| work.dropped.iter().map(|d| d.partition.clone()))
        .collect();
    for report in consumers.iter_mut().filter(|c| c.refused.is_none()) {
        report.deleted = db::cleanup::count_processed_before(
            pool,
            processed,
            &report.consumer_type,
            cutoff,
            &dropped,
        )
        .await?;
        report.events_deleted =
            db::cleanup::count_events_before(pool, &report.consumer_type, cutoff).await?;
    }
    Ok(())
}

/// A report for each consumer_type the plan cleans, with its rows received before the cutoff and never processed.
async fn reports(pool: &PgPool, plan: &Plan, cutoff: DateTime<Utc>) -> Result<Vec<ConsumerReport>> {
    let consumer_types = match &plan.consumer_type {
        Some(one) => vec![one.clone()],
        None => db::cleanup::consumer_types(pool).await?,
    };
    let mut consumers = Vec::with_capacity(consumer_types.len());
    for consumer_type in consumer_types {
        let unprocessed = db::cleanup::unprocessed_before(pool, &consumer_type, cutoff).await?;
        consumers.push(ConsumerReport {
            consumer_type,
            unprocessed_older: unprocessed.count,
            oldest_unprocessed: unprocessed.oldest,
            ..ConsumerReport::default()
        });
    }
    Ok(consumers)
}

/// Deletes in batches, one consumer_type after another in turn (`order`, indexes into `consumers`), each first its
/// inbox rows and then its event rows, until none is left or `shutdown`; returns whether it was interrupted.
///
/// In turn rather than one consumer_type after the other: the consumer_types' rows share the heap's pages (a message
/// gets a row per consumer_type), so a pass per consumer_type would dirty every page once per consumer_type, and
/// after each checkpoint write its full image to the WAL again. Taking the consumer_types' oldest rows together
/// dirties each page about once.
#[allow(clippy::too_many_arguments)]
async fn delete_in_turns(
    pool: &PgPool,
    plan: &Plan,
    cutoff: DateTime<Utc>,
    consumers: &mut [ConsumerReport],
    order: &[usize],
    shutdown: &CancellationToken,
    progress: &mut impl FnMut(Progress<'_>),
    started: Instant,
    processed: db::cleanup::Rows,
) -> Result<bool> {
    // Per consumer_type: 0 deletes inbox rows, 1 event rows, 2 is done.
    let mut phase = vec![0u8; consumers.len()];
    let mut deleted_total = 0;
    loop {
        let mut any = false;
        for &i in order {
            if phase[i] > 1 {
                continue;
            }
            any = true;
            if shutdown.is_cancelled() {
                return Ok(true);
            }
            let report = &mut consumers[i];
            let (consumer_type, limit) = (&report.consumer_type, plan.batch_size);
            let Some(batch) =
                one_batch(pool, phase[i], consumer_type, cutoff, limit, processed).await?
            else {
                // Another cleanup is deleting from it: left to that one from here on.
                report.busy = true;
                phase[i] = 2;
                continue;
            };
            if phase[i] == 0 {
                report.deleted += batch;
                deleted_total += batch;
            } else {
                report.events_deleted += batch;
            }
            progress(Progress {
                consumer_type: &report.consumer_type,
                deleted: deleted_total,
                elapsed: started.elapsed(),
            });
            if batch < u64::try_from(plan.batch_size).unwrap_or(u64::MAX) {
                phase[i] += 1;
            }
            if batch > 0 && !plan.batch_pause.is_zero() {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(plan.batch_pause) => {}
                }
            }
        }
        if !any {
            return Ok(false);
        }
    }
}
