//! The worker that makes the calls a consumer owes after its commits (after-commit, at-most-once): it leases due
//! effects (`db::external::lease_due`, `FOR UPDATE SKIP LOCKED`, so two processes never hold one at once), calls
//! with the key, and records each outcome under its attempt's number, so an attempt whose lease was taken over
//! records nothing. Up to `concurrency` calls at once; a slow carrier holds up only those.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{CallError, CarrierClient, EffectMode};
use crate::carrier_stub::{PickupBody, SlotAnswer};
use crate::consumer::logged;
use crate::db::{bounded, effects, external};
use crate::inbox::ConsumerType;
use crate::parcel::PickupRequest;

/// How often the worker looks for due effects when nothing woke it.
const POLL: Duration = Duration::from_millis(200);
/// The longest wait before a failed call is tried again.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// What the worker needs.
#[derive(Debug, Clone)]
pub struct Worker {
    pub pool: PgPool,
    pub consumer_type: ConsumerType,
    pub client: CarrierClient,
    /// Asked first when an after-commit effect's earlier call has an unknown outcome.
    pub lookup: Option<CarrierClient>,
    pub lease: Duration,
    pub max_attempts: u32,
    pub retry_delay: Duration,
    pub concurrency: usize,
    pub wake: Arc<Notify>,
    /// How long one of its statements (or an outcome's transaction) may wait on PostgreSQL before its connection is
    /// dropped: the consumer's `--attempt-timeout`. A connection that died without a word holds up no leasing and no
    /// record for longer.
    pub bound: Duration,
    /// Only calls that are pending (nothing booked, or not tried yet): a keyed run making the calls an earlier run in
    /// another mode left owed has no look-up, and a call whose outcome is unknown is not its to make again.
    pub pending_only: bool,
    /// How long a call whose outcome is unknown is left alone before it is taken again (with a look-up: the call may
    /// still be at work at the carrier, and a look-up before it books would answer 404); zero without one.
    pub quiet: Duration,
    /// How long the carrier keeps a key (`--effect-key-ttl`): a call whose outcome is unknown is not sent again once
    /// its key may be forgotten, but put in doubt.
    pub key_ttl: Duration,
}

/// When the calls still in flight at a stop are given up: `shutdown_timeout` after the stop was asked for, as for the
/// consumer's own work in flight. Set when the stop comes; until then, unset.
pub fn stop_deadline(
    shutdown: &CancellationToken,
    shutdown_timeout: Duration,
) -> Arc<std::sync::OnceLock<tokio::time::Instant>> {
    let deadline = Arc::new(std::sync::OnceLock::new());
    let set = Arc::clone(&deadline);
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        let _ = set.set(tokio::time::Instant::now() + shutdown_timeout);
    });
    deadline
}

/// Waits for a stopped worker's calls in flight until `deadline` (none set: the consumer stopped on its own, and the
/// calls are waited for; each is bounded by the carrier's timeout). Past it they are given up like a crash's: each
/// stays `started` under its lease, and the next run looks it up or makes it again with the same key (at most once: it
/// is listed in doubt).
pub async fn finish(
    mut working: tokio::task::JoinHandle<()>,
    shutdown: &CancellationToken,
    shutdown_timeout: Duration,
    deadline: &std::sync::OnceLock<tokio::time::Instant>,
) {
    // A stop asked for whose deadline's task has not run yet: counted from now.
    let deadline = deadline.get().copied().or_else(|| {
        shutdown
            .is_cancelled()
            .then(|| tokio::time::Instant::now() + shutdown_timeout)
    });
    let Some(deadline) = deadline else {
        let _ = working.await;
        return;
    };
    if tokio::time::timeout_at(deadline, &mut working)
        .await
        .is_err()
    {
        tracing::warn!(
            "shutdown timeout reached: abandoning the carrier calls in flight; each stays started, and the next run \
             looks it up or makes it again with the same key"
        );
        working.abort();
        let _ = working.await;
    }
}

impl Worker {
    /// Makes the calls owed until `shutdown`; then waits for those in flight (each bounded by the carrier timeout).
    pub async fn run(self, shutdown: CancellationToken) {
        let this = Arc::new(self);
        let slots = Arc::new(Semaphore::new(this.concurrency.max(1)));
        let mut calls = JoinSet::new();
        // The sweep for calls in doubt runs at the poll's pace, not at each wake (a wake comes with every message).
        let mut swept: Option<Instant> = None;
        while !shutdown.is_cancelled() {
            if swept.is_none_or(|at| at.elapsed() >= POLL) {
                swept = Some(Instant::now());
                let ct = this.consumer_type.as_str();
                let marked = bounded!(&this.pool, this.bound, |conn| external::mark_in_doubt(
                    conn,
                    ct,
                    this.key_ttl
                ));
                if let Err(e) = marked.await {
                    tracing::debug!(error = %e, "could not look for effects in doubt");
                }
            }
            let free = slots.available_permits();
            if free > 0 {
                let limit = i64::try_from(free).unwrap_or(i64::MAX);
                let ct = this.consumer_type.as_str();
                // The lease runs from its statement's start in PostgreSQL, which is after the statement is sent (once
                // a connection is had): it ends no sooner than `lease` from then, whenever the answer comes.
                let mut lease_ends = Instant::now();
                let leased = bounded!(&this.pool, this.bound, |conn| {
                    lease_ends = Instant::now() + this.lease;
                    external::lease_due(
                        conn,
                        ct,
                        this.lease,
                        limit,
                        this.pending_only,
                        this.quiet,
                        this.key_ttl,
                    )
                })
                .await;
                match leased {
                    Ok(leased) => {
                        for effect in leased {
                            let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
                                break;
                            };
                            let this = Arc::clone(&this);
                            calls.spawn(async move {
                                this.call(effect, lease_ends).await;
                                drop(slot);
                            });
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "could not lease effects; trying again"),
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = this.wake.notified() => {}
                () = tokio::time::sleep(POLL) => {}
                Some(_) = calls.join_next(), if !calls.is_empty() => {}
            }
        }
        while calls.join_next().await.is_some() {}
    }

    /// One leased effect: its call (or, for an unknown earlier outcome, the look-up first) and its outcome recorded.
    /// Each request is sent only if it can end within the lease (`lease_ends`): past it, another process (or this
    /// one's next look) may take the effect over and call at the same time.
    async fn call(&self, effect: external::Leased, lease_ends: Instant) {
        let Some(request) = self.request(&effect) else {
            self.record(
                &effect,
                "failed",
                None,
                Some("its stored request cannot be read"),
                None,
            )
            .await;
            return;
        };
        let mode = match effect.mode.as_str() {
            "at-most-once" => EffectMode::AtMostOnce,
            _ => EffectMode::AfterCommit,
        };
        // Whether a look-up found nothing booked for this attempt (said when the call is given up below).
        let mut looked_up_none = false;
        if effect.was == "started"
            && let Some(lookup) = &self.lookup
        {
            if !self.time_left_for(lookup, lease_ends) {
                return self.leased_too_late(&effect).await;
            }
            match lookup.lookup(effect.idempotency_key).await {
                Ok(Some(slot)) => {
                    let reference = slot.slot_id.to_string();
                    let Some(error) = self.done(&effect, &request, slot).await else {
                        return;
                    };
                    // Booked, by the look-up, and its outcome refused again (a trigger or a foreign key on the
                    // reservations): after `--max-attempts` leases it ends `failed`, as a call made without a
                    // look-up does — left started, it was taken again each lease for ever, listed nowhere, and an
                    // idle run waited for it.
                    if u32::try_from(effect.attempts).unwrap_or(u32::MAX) > self.max_attempts {
                        let why = format!(
                            "the carrier booked it (slot {reference}, by its look-up) and its outcome could not be \
                             recorded in {} attempts (--max-attempts {}): {error}; once the reservation can be \
                             written, settle it with `inboxctl effects reconcile`, which writes it with the slot",
                            effect.attempts, self.max_attempts
                        );
                        tracing::warn!(message_id = %effect.message_id, slot_id = %reference, "{why}");
                        self.record(&effect, "failed", None, Some(&why), Some(&reference))
                            .await;
                    }
                    return;
                }
                Ok(None) => looked_up_none = true,
                Err(e) => {
                    // Still unknown: an attempt whose outcome is unknown, as a call's that got no answer is — left
                    // started and due again after the retry delay, until `--max-attempts` ends it `failed`. Left
                    // started for good, a look-up that never answers would keep the call owed, and an idle run
                    // waiting for it, for ever.
                    let error = CallError::Unknown(format!("look-up failed: {e}"));
                    return self.failed(&effect, mode, &error).await;
                }
            }
        }
        // Taken again for an unknown outcome after `--max-attempts` attempts: theirs were never recorded (the process
        // died or was abandoned after each request, or recording failed for good — a trigger or a foreign key on the
        // reservations refusing them). A call made again each time its lease ran out was made without end with a
        // carrier that ignores keys; it ends `failed` now, for an operator to settle.
        if effect.was == "started"
            && u32::try_from(effect.attempts).unwrap_or(u32::MAX) > self.max_attempts
        {
            let outcome = if looked_up_none {
                "the carrier's look-up finds nothing booked"
            } else {
                "its outcome is still unknown"
            };
            let why = format!(
                "{outcome} after {} attempts (--max-attempts {}; the last not recorded: a process that died, or an \
                 outcome that could not be recorded): not called again; settle it with `inboxctl effects reconcile` \
                 or `resolve`",
                effect.attempts.saturating_sub(1),
                self.max_attempts
            );
            tracing::warn!(message_id = %effect.message_id, attempt = effect.attempts, "{why}");
            return self.record(&effect, "failed", None, Some(&why), None).await;
        }
        if !self.time_left_for(&self.client, lease_ends) {
            return self.leased_too_late(&effect).await;
        }
        match self.client.book(&request).await {
            Ok(slot) => drop(self.done(&effect, &request, slot).await),
            Err(e) => self.failed(&effect, mode, &e).await,
        }
    }

    /// Whether a call to `client` started now ends within the lease.
    fn time_left_for(&self, client: &CarrierClient, lease_ends: Instant) -> bool {
        Instant::now() + client.longest_call() < lease_ends
    }

    /// A lease whose answer came too late to call within it (PostgreSQL slow to answer: a commit waiting on a standby,
    /// a stalled disk): no request sent, the effect given back as it was — its attempt not counted, its error left as
    /// it was — and due again at the next look.
    async fn leased_too_late(&self, effect: &external::Leased) {
        tracing::warn!(
            message_id = %effect.message_id,
            "the effect's lease came too late for a call to end within it (PostgreSQL slow to answer); no request \
             sent, leased again"
        );
        let ct = self.consumer_type.as_str();
        let given = transient_retried(|| {
            bounded!(&self.pool, self.bound, |conn| external::give_back(
                conn, effect, ct, POLL
            ))
        })
        .await;
        match given {
            Ok(true) => {}
            Ok(false) => lost_lease(effect),
            Err(e) => tracing::warn!(
                message_id = %effect.message_id,
                error = %e,
                "an effect leased too late to call could not be given back: it stays started until its lease runs out"
            ),
        }
    }

    fn request(&self, effect: &external::Leased) -> Option<PickupRequest> {
        let body: PickupBody = serde_json::from_str(&effect.request).ok()?;
        Some(PickupRequest {
            parcel_id: body.parcel_id,
            tracking_number: body.tracking_number,
            destination: body.destination,
            message_id: effect.message_id,
            idempotency_key: effect.idempotency_key,
        })
    }

    /// Doubling from `--retry-delay`, per attempt made.
    fn retry_after(&self, attempts: i32) -> Duration {
        let doublings = u32::try_from(attempts.saturating_sub(1))
            .unwrap_or(0)
            .min(16);
        self.retry_delay
            .saturating_mul(1 << doublings)
            .min(MAX_RETRY_DELAY)
    }

    async fn failed(&self, effect: &external::Leased, mode: EffectMode, error: &CallError) {
        let text = error.to_string();
        let last = u32::try_from(effect.attempts).unwrap_or(u32::MAX) >= self.max_attempts;
        let (state, due) = match (error, mode) {
            (CallError::Unknown(_), EffectMode::AtMostOnce) => ("in_doubt", None),
            (_, _) if last => ("failed", None),
            // Nothing booked: owed again after the delay.
            (CallError::Refused(_), _) => ("pending", Some(self.retry_after(effect.attempts))),
            // May have booked: started, so the next attempt asks the look-up first if there is one.
            (CallError::Unknown(_), _) => ("started", Some(self.retry_after(effect.attempts))),
        };
        tracing::warn!(
            message_id = %effect.message_id,
            attempt = effect.attempts,
            state,
            reason = %logged(&text),
            "the carrier call failed"
        );
        self.record(effect, state, due, Some(&text), None).await;
    }

    /// Records the slot, with its reservation, in one transaction. `Some(error)`: it could not be recorded (the effect
    /// stays started, its lease held).
    async fn done(
        &self,
        effect: &external::Leased,
        request: &PickupRequest,
        slot: SlotAnswer,
    ) -> Option<String> {
        let reference = slot.slot_id.to_string();
        let recorded = transient_retried(|| {
            bounded!(&self.pool, self.bound, |conn| self
                .record_done(conn, effect, request, &slot, &reference))
        })
        .await;
        match recorded {
            Ok(true) => {
                tracing::debug!(message_id = %effect.message_id, slot_id = %reference, "carrier call done");
                None
            }
            Ok(false) => {
                // The slot is said: the row no longer says the call was booked (another look, or the sweep of a
                // lease run out, has it in doubt), and an operator settling it needs what the carrier answered.
                tracing::warn!(
                    message_id = %effect.message_id,
                    attempt = effect.attempts,
                    slot_id = %reference,
                    "the carrier booked, but the effect's lease ran out before its outcome was recorded (a call \
                     longer than --effect-lease, or PostgreSQL unreachable until then): the slot is not recorded; \
                     if the effect is left in doubt, settle it with `inboxctl effects reconcile`"
                );
                None
            }
            Err(e) => {
                let error = crate::redact::text(&e.to_string());
                tracing::warn!(
                    message_id = %effect.message_id,
                    slot_id = %reference,
                    error = %error,
                    "the carrier booked, and its outcome could not be recorded: the effect stays started"
                );
                Some(error)
            }
        }
    }

    /// The slot's record and reservation, in one transaction on `conn`; whether the lease still held.
    async fn record_done(
        &self,
        conn: &mut sqlx::PgConnection,
        effect: &external::Leased,
        request: &PickupRequest,
        slot: &SlotAnswer,
        reference: &str,
    ) -> sqlx::Result<bool> {
        let mut tx = crate::db::pooler::begin(conn).await?;
        let held = external::record_outcome(
            &mut *tx,
            effect,
            self.consumer_type.as_str(),
            &external::Outcome {
                state: "done",
                due_in: None,
                last_error: None,
                reference: Some(reference),
            },
        )
        .await?;
        if held {
            effects::insert_carrier_reservation(
                &mut tx,
                &super::carrier::reservation(request, slot),
            )
            .await?;
        }
        tx.commit().await?;
        Ok(held)
    }

    async fn record(
        &self,
        effect: &external::Leased,
        state: &str,
        due_in: Option<Duration>,
        last_error: Option<&str>,
        reference: Option<&str>,
    ) {
        let outcome = external::Outcome {
            state,
            due_in,
            last_error,
            reference,
        };
        let recorded = transient_retried(|| {
            bounded!(&self.pool, self.bound, |conn| external::record_outcome(
                conn,
                effect,
                self.consumer_type.as_str(),
                &outcome,
            ))
        })
        .await;
        match recorded {
            Ok(true) => {}
            Ok(false) => lost_lease(effect),
            Err(e) => tracing::warn!(
                message_id = %effect.message_id,
                error = %e,
                "the outcome of a carrier call could not be recorded: the effect stays started"
            ),
        }
    }
}

/// How many times a call's outcome is tried before it is left `started` (the lease then makes it due, or in doubt).
const RECORD_TRIES: u32 = 6;

/// Runs `record` again while it fails for a reason that passes (a pooled connection that died, a restart), a few
/// times with backoff: a carrier's answer lives only in memory until it is recorded, and a record is guarded by its
/// attempt (`attempts = $n AND state = 'started'`), so trying it again never records it twice.
async fn transient_retried<T, F, Fut>(mut record: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut tries = 1;
    loop {
        match record().await {
            Err(e) if tries < RECORD_TRIES && crate::db::is_transient(&e) => {
                tracing::debug!(error = %e, tries, "recording a carrier call's outcome failed; trying again");
                tokio::time::sleep(backoff.next_delay()).await;
                tries += 1;
            }
            result => return result,
        }
    }
}

fn lost_lease(effect: &external::Leased) {
    tracing::warn!(
        message_id = %effect.message_id,
        attempt = effect.attempts,
        "the effect's lease ran out before its outcome was recorded (a call longer than --effect-lease)"
    );
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn dead_connection() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    }

    /// Calls `transient_retried` with a record that fails `failures` times with `error` before it succeeds; returns
    /// the result and how many times the record ran.
    async fn record_failing(
        failures: u32,
        error: fn() -> sqlx::Error,
    ) -> (Result<(), sqlx::Error>, u32) {
        let runs = AtomicU32::new(0);
        let result = transient_retried(|| {
            let run = runs.fetch_add(1, Ordering::Relaxed) + 1;
            async move {
                if run <= failures {
                    Err(error())
                } else {
                    Ok(())
                }
            }
        })
        .await;
        (result, runs.load(Ordering::Relaxed))
    }

    #[tokio::test]
    async fn an_outcome_is_recorded_again_while_its_connection_was_dead() {
        let (result, runs) = record_failing(2, dead_connection).await;
        assert!(result.is_ok());
        assert_eq!(runs, 3);
    }

    #[tokio::test]
    async fn an_outcome_is_tried_a_bounded_number_of_times() {
        let (result, runs) = record_failing(u32::MAX, dead_connection).await;
        assert!(matches!(result, Err(sqlx::Error::Io(_))));
        assert_eq!(runs, RECORD_TRIES);
    }

    #[tokio::test]
    async fn an_error_that_does_not_pass_is_not_tried_again() {
        let (result, runs) = record_failing(u32::MAX, || sqlx::Error::RowNotFound).await;
        assert!(matches!(result, Err(sqlx::Error::RowNotFound)));
        assert_eq!(runs, 1);
    }
}
