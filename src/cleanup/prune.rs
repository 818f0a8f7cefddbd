//! What a cleanup deletes beside the inbox's rows, once they are done: the start counts of redelivered messages,
//! the records of done calls outside the database, and the audit's own old rows; each counted as it goes.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use super::{ConsumerReport, Plan};
use crate::db::{self, schema};
use crate::error::Result;

/// Deletes the start counts older than the cutoff of the consumer_types this cleanup cleaned (`order`), where the
/// table exists (a schema from before it did is not an error).
pub(super) async fn prune_attempts(
    pool: &PgPool,
    consumers: &[ConsumerReport],
    order: &[usize],
    cutoff: DateTime<Utc>,
    deleted: &mut u64,
) -> Result<()> {
    if !schema::table_exists(&mut *pool.acquire().await?, "inboxctl_attempts").await? {
        return Ok(());
    }
    for &i in order {
        *deleted +=
            db::cleanup::delete_old_attempts(pool, &consumers[i].consumer_type, cutoff).await?;
    }
    Ok(())
}

/// What became of the records of done calls.
#[derive(Debug, Default)]
pub(super) struct EffectsPruned {
    pub(super) deleted: u64,
    pub(super) left: Option<String>,
}

/// Deletes (a dry run: counts) the records of calls made outside the database that were done before the cutoff, of
/// the consumer_types this cleanup cleaned (`order`), in batches, where the table exists (a schema from before it
/// did is not an error). A role that may not delete them leaves them, and the report says why. Counted into `pruned`
/// batch by batch (each is committed: a failure later leaves what went counted); whether a stop ended it first.
#[allow(clippy::too_many_arguments)]
pub(super) async fn prune_effects(
    pool: &PgPool,
    plan: &Plan,
    consumers: &[ConsumerReport],
    order: &[usize],
    cutoff: DateTime<Utc>,
    shutdown: &CancellationToken,
    pruned: &mut EffectsPruned,
) -> Result<bool> {
    if !schema::table_exists(&mut *pool.acquire().await?, "inboxctl_effects").await? {
        return Ok(false);
    }
    if !db::cleanup::may_delete_effects(pool).await? {
        pruned.left = Some(
            "this role may not read and delete inboxctl_effects (SELECT, DELETE): the records of done calls stay"
                .to_owned(),
        );
        return Ok(false);
    }
    for &i in order {
        let consumer_type = &consumers[i].consumer_type;
        if plan.dry_run {
            pruned.deleted +=
                db::cleanup::count_done_effects_before(pool, consumer_type, cutoff).await?;
            continue;
        }
        loop {
            if shutdown.is_cancelled() {
                return Ok(true);
            }
            let batch = db::cleanup::delete_done_effects_batch(
                pool,
                consumer_type,
                cutoff,
                plan.batch_size,
            )
            .await?;
            pruned.deleted += batch;
            crate::failpoint::hit("effects-pruned").await;
            if batch < u64::try_from(plan.batch_size).unwrap_or(u64::MAX) {
                break;
            }
        }
    }
    Ok(false)
}

/// Deletes audit rows older than the audit's own retention, in batches, where the table exists, counted into
/// `deleted` batch by batch; whether a stop ended it first.
pub(super) async fn prune_audit(
    pool: &PgPool,
    plan: &Plan,
    shutdown: &CancellationToken,
    deleted: &mut u64,
) -> Result<bool> {
    if !schema::table_exists(&mut *pool.acquire().await?, "inboxctl_audit").await? {
        return Ok(false);
    }
    let cutoff = db::cleanup::cutoff(pool, plan.audit_retention).await?;
    loop {
        if shutdown.is_cancelled() {
            return Ok(true);
        }
        let batch = db::audit::delete_batch(pool, cutoff, plan.batch_size).await?;
        *deleted += batch;
        if batch < u64::try_from(plan.batch_size).unwrap_or(u64::MAX) {
            return Ok(false);
        }
    }
}
