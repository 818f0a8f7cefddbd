//! A cleanup run once or on a schedule (`--every`), each run recorded in the audit.

use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use super::{Event, Plan, Report, run};
use crate::error::Result;

/// Runs a cleanup once, or with `every`, again on that schedule until `shutdown`, telling `on` how each run goes.
/// Returns whether the last run was interrupted (a stop between two runs interrupts nothing).
///
/// With `every`, a run that fails after one has succeeded is said and the schedule goes on: a sidecar that ended on a
/// database restart, or on a dead-letter queue it was not yet allowed to read, would make no more partitions ahead,
/// and past them every message would be refused. The first run's failure ends it (a flag or a grant to fix).
pub async fn scheduled(
    pool: &PgPool,
    plan: &Plan,
    every: Option<Duration>,
    shutdown: &CancellationToken,
    mut on: impl FnMut(Event<'_>) -> Result<()>,
) -> Result<bool> {
    let mut succeeded_once = false;
    loop {
        on(Event::Started)?;
        let mut progress_failed = None;
        let report = run(pool, plan, shutdown, |p| {
            if let Err(e) = on(Event::Progress(p)) {
                progress_failed.get_or_insert(e);
            }
        })
        .await;
        if !plan.dry_run {
            crate::audit::record(pool, &audit_entry(plan, &report)).await;
        }
        let report = match report {
            Ok(report) => report,
            Err(e) => {
                let Some(every) = every.filter(|_| succeeded_once) else {
                    return Err(e);
                };
                tracing::warn!(
                    error = %crate::redact::text(&e.for_a_retry()),
                    "this cleanup run failed; the next one runs on schedule (--every)"
                );
                on(Event::Failed(&e))?;
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    () = tokio::time::sleep(every) => {}
                }
                continue;
            }
        };
        // A run that failed after deleting rows is reported like any (what it deleted), but is no success: a first
        // one ends the command as a first failure does (a grant to fix), after its report.
        let failed_first = report.failed.is_some() && !succeeded_once;
        succeeded_once |= report.failed.is_none();
        if let Some(e) = progress_failed {
            return Err(e);
        }
        on(Event::Finished(&report))?;
        if failed_first {
            return Ok(false);
        }
        if report.interrupted {
            return Ok(true);
        }
        let Some(every) = every else {
            return Ok(false);
        };
        tokio::select! {
            () = shutdown.cancelled() => return Ok(false),
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// The audit's row for one run.
fn audit_entry(plan: &Plan, report: &Result<Report>) -> crate::audit::Entry {
    let mut details = serde_json::json!({
        "retention_seconds": plan.retention.as_secs(),
        "audit_retention_seconds": plan.audit_retention.as_secs(),
        "forced": plan.guard.is_none(),
    });
    if let (Ok(r), serde_json::Value::Object(map)) = (report, &mut details) {
        let refused: Vec<_> = r
            .consumers
            .iter()
            .filter_map(|c| c.refused.as_ref().map(|why| serde_json::json!({"consumer_type": c.consumer_type, "queue": why.queue, "message_id": why.message_id, "other_vhost": why.other_vhost.as_ref().map(|o| &o.vhost), "absent": why.absent, "replay_running": why.replay_running})))
            .collect();
        for (key, value) in [
            ("cutoff", serde_json::json!(r.cutoff)),
            ("deleted", serde_json::json!(r.deleted)),
            ("events_deleted", serde_json::json!(r.events_deleted)),
            ("audit_deleted", serde_json::json!(r.audit_deleted)),
            ("effects_deleted", serde_json::json!(r.effects_deleted)),
            ("interrupted", serde_json::json!(r.interrupted)),
            ("failed", serde_json::json!(r.failed)),
            (
                "consumer_types",
                serde_json::json!(
                    r.consumers
                        .iter()
                        .map(|c| c.consumer_type.as_str())
                        .collect::<Vec<_>>()
                ),
            ),
            ("refused", serde_json::json!(refused)),
            (
                "partitions_dropped",
                serde_json::json!(r.partitions.as_ref().map(|p| {
                    p.dropped
                        .iter()
                        .map(|d| d.partition.as_str())
                        .collect::<Vec<_>>()
                })),
            ),
        ] {
            map.insert(key.to_owned(), value);
        }
    }
    crate::audit::Entry::ended("cleanup", report, Report::outcome, details)
}
