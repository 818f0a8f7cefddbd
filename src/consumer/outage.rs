//! PostgreSQL unavailable: an attempt the database could not take holds up intake until the database answers again
//! (or, when it met another transaction, only its own message); what waits meanwhile, and how the consumer sees the
//! end of an outage — by a claim, not a `SELECT 1`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use uuid::Uuid;

use super::link::Link;
use super::{Consumer, OUTAGE_DELAY_MAX, Shared, sleep_or_cancel};
use crate::inbox::{Carried, Fingerprint, Outcome, ProcessError, Work, WorkError};

/// An attempt reached PostgreSQL (its claim went through, whatever came of its work): intake resumes if an outage
/// had paused it.
pub(super) fn database_back<C: Consumer>(shared: &Shared<C>) {
    // The count moves under the watch's lock, with the state it counts.
    if shared.database_up.send_if_modified(|up| {
        let back = !std::mem::replace(up, true);
        if back {
            shared.counts.queues_held.fetch_sub(1, Ordering::Relaxed);
        }
        back
    }) {
        tracing::info!("PostgreSQL is back: taking deliveries again");
    }
}

/// An attempt the database could not take, `error` its answer: the database gone (intake paused until it answers
/// again), or up and saying that the message's statement met another transaction (a key held elsewhere past
/// `--claim-timeout`, a deadlock), which holds up that message alone.
pub(super) fn unavailable<C: Consumer>(shared: &Shared<C>, id: Uuid, error: &sqlx::Error) {
    if crate::db::is_contention(error) {
        database_back(shared);
        tracing::warn!(
            message_id = %id,
            error = %crate::redact::text(&crate::db::describe(error)),
            "the message's statement met another transaction (its key, or a lock its work waits on, held elsewhere \
             past --claim-timeout, a deadlock): trying it again"
        );
    } else if pool_busy(shared.inbox.pool(), error) {
        tracing::warn!(message_id = %id, "{POOL_BUSY}: trying it again");
    } else {
        database_gone(shared, error);
    }
}

/// The attempts of one message given up past `--attempt-timeout` in a row: the first is an outage's (its connection
/// may have gone silent, a network cut, and the next try is on another); from the second, if PostgreSQL then takes a
/// claim, each is the message's own — its work slow or stuck on it — and counted as a failed attempt, so that it ends
/// in the error queue after `--max-attempts`. Taken for an outage, it was tried for ever, intake paused at each try.
#[derive(Default)]
pub(super) struct Timeouts {
    /// Whether the last try was given up past the bound.
    last: bool,
}

impl Timeouts {
    /// `error` ended a try: the failure to count against the message when the try is its own slowness (above), `None`
    /// when it is to be waited out as an outage.
    pub(super) async fn own<C: Consumer>(
        &mut self,
        shared: &Shared<C>,
        error: &sqlx::Error,
    ) -> Option<String> {
        let again = std::mem::replace(&mut self.last, crate::db::is_no_answer(error));
        if !(again && self.last && the_claim_answers(shared).await) {
            return None;
        }
        database_back(shared);
        Some(format!(
            "the attempt did not end within --attempt-timeout ({}), twice in a row, while PostgreSQL answered: its \
             work is slow or stuck on this message",
            humantime::format_duration(shared.options.attempt_timeout)
        ))
    }

    /// A try that failed otherwise: the next timeout is the first in a row again.
    pub(super) fn reset(&mut self) {
        self.last = false;
    }
}

/// What is said of a wait for a connection that ran out with the pool busy ([`pool_busy`]).
pub(super) const POOL_BUSY: &str = "every connection of the consumer's pool stayed busy past the wait for one (more \
                                    work holding a connection at once than --pool-size)";

/// Whether `error` is the wait for one of `pool`'s connections running out with every one of them open and in use:
/// the database up and answering (work holding its connection long, more at once than the pool holds), not gone.
/// Taken for an outage, intake paused and `/health` said the database down while it served every connection.
pub(super) fn pool_busy(pool: &sqlx::PgPool, error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::PoolTimedOut)
        && pool.size() >= pool.options().get_max_connections()
}

pub(super) fn database_gone<C: Consumer>(shared: &Shared<C>, error: &sqlx::Error) {
    if shared.database_up.send_if_modified(|up| {
        let gone = std::mem::replace(up, false);
        if gone {
            shared.counts.queues_held.fetch_add(1, Ordering::Relaxed);
        }
        gone
    }) {
        let text = crate::redact::text(&crate::db::describe(error));
        if crate::db::is_no_partition_for_now(error) {
            tracing::error!(error = %text, "the inbox cannot take messages of now: holding deliveries until it can");
        } else if crate::db::is_transient(error) {
            tracing::error!(error = %text, "PostgreSQL unavailable: holding deliveries until it is back");
        } else {
            // A missing grant or table: the inbox's own statements fail, whatever the message. Held, never acked.
            tracing::error!(
                error = %text,
                "PostgreSQL refuses the inbox's own statements (a grant or the schema, not the message): holding \
                 deliveries until they succeed; docs/security.md lists the grants"
            );
        }
    } else {
        tracing::debug!(error = %crate::redact::text(&crate::db::describe(error)), "PostgreSQL still unavailable");
    }
}

/// Waits `delay` before a message's next try; `true` if it is to go back instead: a stop came, or the connection it
/// came on was lost — it can no longer be settled here, and the broker delivers it again on the next connection,
/// where it is tried. Going on here too would run it twice over (and move it aside twice).
pub(super) async fn wait_to_retry<C: Consumer>(
    shared: &Shared<C>,
    link: &Link,
    id: Uuid,
    delay: Duration,
) -> bool {
    tokio::select! {
        stopped = sleep_or_cancel(delay, &shared.shutdown) => stopped,
        () = link.lost() => {
            tracing::debug!(message_id = %id, "its connection lost while it waited: left to its redelivery");
            true
        }
    }
}

/// Waits until PostgreSQL is up; `false` if a stop was asked for meanwhile. The attempts that found it gone mark it
/// back when they reach it again, but each of them may end first — its work panicking once the database is back, say,
/// or its connection to RabbitMQ lost — and then nothing would: so the wait looks too, every [`OUTAGE_DELAY_MAX`], one
/// look at a time. A look runs in a task of its own, to its end: dropped half-way (by a stop, or this wait ending), its
/// pooled connection would go back through sqlx's ping, which no bound covers. `when_idle`: look only while no
/// delivery is in flight (the run's own watch, [`super::run`]): a delivery in flight tries again itself, or waits
/// here and looks — and a look's claim of a new id does not meet what a held delivery may (a copy's record, a
/// message's own statements), so looking beside it would only mark the database back for it to fail again.
pub(super) async fn wait_for_database<C: Consumer>(
    shared: &Arc<Shared<C>>,
    when_idle: bool,
) -> bool {
    let mut up = shared.database_up.subscribe();
    let mut look: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            () = shared.shutdown.cancelled() => return false,
            result = up.wait_for(|up| *up) => return result.is_ok(),
            () = tokio::time::sleep(OUTAGE_DELAY_MAX) => {
                let busy = when_idle && shared.in_flight.load(Ordering::SeqCst) > 0;
                if !busy && look.as_ref().is_none_or(tokio::task::JoinHandle::is_finished) {
                    let shared = Arc::clone(shared);
                    look = Some(tokio::spawn(async move {
                        if the_claim_answers(&shared).await {
                            database_back(&shared);
                        }
                    }));
                }
            }
        }
    }
}

/// Whether the inbox takes a claim again: one made for a new id, in a transaction rolled back ([`look`]), bounded as
/// any attempt (`--attempt-timeout`, its connection dropped if it was the one that failed). Not a `SELECT 1`, which
/// passes while PostgreSQL refuses the inbox's own statements (a grant taken away, the schema): only the claim sees
/// the end of both kinds of outage. A key refused (no partition holds its time) is an answer too.
async fn the_claim_answers<C: Consumer>(shared: &Shared<C>) -> bool {
    let now = chrono::Utc::now();
    let carried = Carried {
        sent_time: Some(now),
        timestamp: Some(now),
    };
    match look(shared, Uuid::now_v7(), None, carried).await {
        Ok(_) | Err(ProcessError::Unclaimable(_)) => true,
        Err(ProcessError::Unavailable(_) | ProcessError::Failed(_)) => false,
    }
}

/// What a claim made only to look finds.
pub(super) enum Looked {
    /// No attempt committed the key: a claim would take it.
    Free,
    /// A committed attempt holds the key: this is a copy (recorded as one, as any copy is).
    Taken(Outcome<()>),
}

/// Looks at the key of `id` with a claim whose transaction is rolled back when it takes the key (its work does
/// nothing but fail); a claim that meets an attempt in flight elsewhere waits for it, as any claim does.
pub(super) async fn look<C: Consumer>(
    shared: &Shared<C>,
    id: Uuid,
    fingerprint: Option<Fingerprint>,
    carried: Carried,
) -> Result<Looked, ProcessError> {
    const LOOK: &str = "not processed: a look at the claim only";
    let look: Work<()> = Box::new(|_| Box::pin(async { Err(WorkError::msg(LOOK)) }));
    match shared
        .inbox
        .process_event(id, fingerprint, carried, look)
        .await
    {
        Ok(outcome) => Ok(Looked::Taken(outcome)),
        Err(ProcessError::Failed(e)) if e.to_string() == LOOK => Ok(Looked::Free),
        Err(other) => Err(other),
    }
}
