//! What operators do with effects (`inboxctl effects`): list those owed, in doubt or failed; settle one by hand after
//! checking with the carrier; or have the carrier's look-up by key settle those whose outcome is unknown.

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::CarrierClient;
use crate::db::{effects, external};
use crate::error::{Error, Result};

/// The states `effects` lists by default: everything not done.
pub const OPEN: [&str; 4] = ["pending", "started", "in_doubt", "failed"];

/// How an operator settles one effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The carrier did book it (the operator checked): done, with the carrier's reference if given; a call never
    /// attempted yet only with `never_attempted`.
    Done {
        reference: Option<String>,
        never_attempted: bool,
    },
    /// It was not booked: owed again, its attempts counted afresh; a consumer makes the call.
    Retry,
}

/// The effect of `message_id` to settle: the one of `consumer_type`, or the message's only one.
async fn one_effect(
    pool: &sqlx::PgPool,
    message_id: Uuid,
    consumer_type: Option<&str>,
) -> Result<external::Row> {
    let mut rows = external::of_message(pool, message_id, consumer_type).await?;
    match rows.len() {
        0 => Err(Error::Usage(format!(
            "message {message_id} has no effect{}",
            consumer_type.map_or(String::new(), |c| format!(" for consumer_type {c:?}"))
        ))),
        1 => Ok(rows.remove(0)),
        _ => Err(Error::Usage(format!(
            "message {message_id} has effects for several consumer_types ({}): say which with --consumer-type",
            rows.iter()
                .map(|r| crate::sanitize::text(&r.consumer_type).into_owned())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Settles one effect; returns it as it was. Refused for an effect done already or leased by a live process, and —
/// to be made again — for one whose last attempt ended less than `quiet_for` ago (the database's clock): a request
/// whose answer never came may still be in the carrier's hands, its booking not shown yet; owed again now, it would
/// be made twice wherever the carrier does not honour keys.
pub async fn resolve(
    pool: &sqlx::PgPool,
    message_id: Uuid,
    consumer_type: Option<&str>,
    resolution: &Resolution,
    quiet_for: std::time::Duration,
) -> Result<external::Row> {
    let before = one_effect(pool, message_id, consumer_type).await?;
    if let Resolution::Done {
        never_attempted: false,
        ..
    } = resolution
        && before.state == "pending"
        && before.attempts == 0
    {
        return Err(Error::Usage(format!(
            "the effect of message {message_id} was never attempted: it is owed, and a consumer makes the call; marked \
             done, the call would never be made. If the carrier has it from elsewhere, give --never-attempted; \
             nothing settled"
        )));
    }
    if *resolution == Resolution::Retry && before.attempts > 0 {
        let now = external::database_now(pool).await?;
        if !quiet_since(&before, now, quiet_for) {
            let ended = before
                .lease_until
                .map_or(before.updated_at, |l| l.max(before.updated_at));
            let ago = (now - ended).to_std().unwrap_or_default();
            return Err(Error::Usage(format!(
                "the last attempt of the effect of message {message_id} ended {} ago, less than --quiet-for {}: \
                 the carrier may still be booking it, and owed again now it could be booked twice; look again \
                 later (or give --quiet-for 0s if the carrier has said it has no such booking); nothing settled",
                humantime::format_duration(std::time::Duration::from_secs(ago.as_secs())),
                humantime::format_duration(quiet_for)
            )));
        }
    }
    // Between the read and the settle (a test changes the effect here, as a consumer's worker may).
    crate::failpoint::hit("resolve-read").await;
    let (state, reference, note) = match resolution {
        Resolution::Done { reference, .. } => {
            ("done", reference.as_deref(), "settled by an operator: done")
        }
        Resolution::Retry => ("pending", None, "settled by an operator: to be made again"),
    };
    let settled = external::settle(
        pool,
        message_id,
        &before.consumer_type,
        state,
        reference,
        Some(note),
        // Fenced on the state read: the operator's decision is about the effect as shown, and a worker may have
        // leased it and made the call since (a `--retry` then would owe it again, to be made blind a second time).
        Some(before.updated_at),
    )
    .await?;
    if settled.is_none() {
        if let Ok(now) = one_effect(pool, message_id, Some(&before.consumer_type)).await
            && now.updated_at != before.updated_at
        {
            return Err(Error::Usage(format!(
                "the effect of message {message_id} changed while this command ran ({} then, {} now): nothing \
                 settled; look at it again (`inboxctl effects`) and settle it as it is now",
                before.state, now.state
            )));
        }
        return Err(Error::Usage(format!(
            "the effect of message {message_id} is {} and cannot be settled now{}",
            before.state,
            if before.state == "started" {
                " (a consumer process is making the call; wait for its lease to end)"
            } else {
                ""
            }
        )));
    }
    Ok(before)
}

/// What `reconcile` did with one effect.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Reconciled {
    pub message_id: Uuid,
    pub consumer_type: String,
    pub was: String,
    /// `done` (the carrier has a booking under its key), `pending` (it has none: to be made), `unknown` (the
    /// look-up failed; left as it was), `recent` (none, but its last attempt ended less than the wait ago: the carrier
    /// may still be working on it; left as it was), `expired` (none, but its key is older than the carrier keeps keys:
    /// it may have forgotten it; left as it was), or `changed` (done or leased since it was listed; or, after a 404, an attempt
    /// was made or it was settled: the answer is about the call as it was, and it is left as it is now).
    pub now: String,
    pub reference: Option<String>,
    pub error: Option<String>,
}

/// Asks the carrier's look-up about every effect whose outcome is unknown — in doubt, started by a process whose
/// lease ran out, or failed — and settles it: done (with its slot, and the reservation written) if the carrier has a
/// booking under its key, pending (to be made again) if it has none — but only for a call whose last attempt ended
/// at least `quiet_for` ago: a request whose answer never came may still be in the carrier's hands, and booked after
/// the look-up; owed again on that 404, it would be made twice wherever the carrier does not honour keys.
///
/// A stop ends it before the next look-up (one under way is given up: a look-up changes nothing); what was settled
/// stays settled and reported, and the calls not looked at are counted in `left`.
pub async fn reconcile(
    pool: &sqlx::PgPool,
    lookup: &CarrierClient,
    consumer_type: Option<&str>,
    quiet_for: std::time::Duration,
    stop: &CancellationToken,
) -> Result<Reconciliation> {
    let mut candidates = external::list(
        pool,
        &["in_doubt", "started", "failed"],
        consumer_type,
        RECONCILE_AT_MOST + 1,
    )
    .await?;
    // The oldest first, at most so many a run; the rest are counted as left (exit 3: run again), not passed over.
    let beyond = candidates.len() > RECONCILE_AT_MOST as usize;
    candidates.truncate(RECONCILE_AT_MOST as usize);
    // The database's time, not this machine's: a clock minutes ahead took a call answered by a gateway's timeout a
    // moment ago for one quiet past `quiet_for`, and owed it again on a 404 while the carrier was still booking it.
    let now = external::database_now(pool).await?;
    // A call started by a process whose lease has not run out is that process's to settle.
    let candidates: Vec<_> = candidates
        .into_iter()
        .filter(|e| e.state != "started" || e.lease_until.is_some_and(|l| l <= now))
        .collect();
    // One look-up answers for one carrier: asked about another consumer_type's call (another carrier's), its 404
    // would owe that call again — and an at-most-once call in doubt, booked by the other carrier, would be made twice.
    if consumer_type.is_none() {
        let kinds: std::collections::BTreeSet<&str> = candidates
            .iter()
            .map(|e| e.consumer_type.as_str())
            .collect();
        if kinds.len() > 1 {
            return Err(Error::Usage(format!(
                "the calls to settle belong to several consumer_types ({}), and a look-up answers for one carrier's: \
                 say whose calls --lookup-url answers for with --consumer-type; nothing was settled",
                kinds
                    .iter()
                    .map(|k| crate::sanitize::text(k).into_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    // How long each carrier keeps keys (registered by its consumers; 24h where none was): past it, "no booking
    // under this key" may be a key forgotten, and the call owed again would be booked twice.
    let key_ttls = crate::db::events::key_ttls(pool).await?;
    let mut out = Vec::new();
    let mut left = 0;
    let total = candidates.len();
    for (i, effect) in candidates.into_iter().enumerate() {
        if stop.is_cancelled() {
            left = total - i;
            break;
        }
        let mut done = Reconciled {
            message_id: effect.message_id,
            consumer_type: effect.consumer_type.clone(),
            was: effect.state.clone(),
            now: "unknown".to_owned(),
            reference: None,
            error: None,
        };
        let looked = tokio::select! {
            looked = lookup.lookup(effect.idempotency_key) => looked,
            () = stop.cancelled() => {
                left = total - i;
                break;
            }
        };
        // What the look-up said holds for the effect as it was listed: one changed since (an attempt made meanwhile
        // by a consumer process) is not settled on it.
        crate::failpoint::hit("reconcile-looked").await;
        // What the call is now, or why settling it failed.
        let settled: Result<&str> = match looked {
            Ok(Some(slot)) => {
                let reference = slot.slot_id.to_string();
                settle_booked(pool, &effect, slot).await.map(|booked| {
                    if booked {
                        done.reference = Some(reference);
                        "done"
                    } else {
                        CHANGED
                    }
                })
            }
            Ok(None) if !quiet_since(&effect, now, quiet_for) => Ok(RECENT),
            Ok(None)
                if older_than_its_key(
                    &effect,
                    now,
                    key_ttls
                        .get(&effect.consumer_type)
                        .copied()
                        .unwrap_or(super::DEFAULT_KEY_TTL),
                ) =>
            {
                Ok(EXPIRED)
            }
            Ok(None) => external::settle(
                pool,
                effect.message_id,
                &effect.consumer_type,
                "pending",
                None,
                Some("reconciled: the carrier has no booking under its key; to be made again"),
                Some(effect.updated_at),
            )
            .await
            .map_err(Error::from)
            .map(|settled| {
                if settled.is_some() {
                    "pending"
                } else {
                    CHANGED
                }
            }),
            Err(e) => {
                done.error = Some(e.to_string());
                Ok("unknown")
            }
        };
        match settled {
            Ok(state) => done.now = state.to_owned(),
            // A settle that fails (a role without INSERT on the reservations) leaves that call as it was and says
            // why; the calls settled before it stay settled and reported, and the run goes on — unless the database
            // is gone, when it stops there.
            Err(e) => {
                done.error = Some(not_settled(effect.message_id, &e));
                if database_gone(&e) {
                    out.push(done);
                    left = total - i - 1;
                    break;
                }
            }
        }
        out.push(done);
    }
    Ok(Reconciliation {
        done: out,
        left,
        beyond,
    })
}

/// The most calls one `reconcile` run looks at.
const RECONCILE_AT_MOST: i64 = 100_000;

/// What one `reconcile` run did.
#[derive(Debug)]
pub struct Reconciliation {
    /// The calls looked up, each with what was done with it.
    pub done: Vec<Reconciled>,
    /// The calls not looked at because the run was stopped.
    pub left: usize,
    /// More calls were to settle than one run looks at (100,000, the oldest first): the rest are for the next run.
    pub beyond: bool,
}

/// Whether a settle's error is the database's state rather than this call's (unreachable, restarting): the run stops
/// there, what it did reported, rather than ask the carrier about every other call for nothing to record.
fn database_gone(e: &Error) -> bool {
    let gone = match e {
        Error::Database(e) => crate::db::is_transient(e),
        _ => false,
    };
    if gone {
        tracing::warn!(
            "the database cannot be reached: reconcile stops here; run it again once it is back"
        );
    }
    gone
}

/// Why a call the look-up answered for was left as it was.
fn not_settled(message_id: Uuid, e: &Error) -> String {
    // Masked, not escaped: the log line and the output escape it where they show it.
    let why = crate::redact::text(&e.to_string());
    tracing::warn!(%message_id, error = %why, "the look-up answered, but settling the call failed; left as it was");
    format!("the look-up answered, but settling it failed: {why}")
}

/// What `reconcile` says of a call it did not settle because it changed since it was listed.
const CHANGED: &str = "changed";

/// What `reconcile` says of a call the carrier has no booking for yet, whose last attempt is too recent to be sure.
pub const RECENT: &str = "recent";

/// What `reconcile` says of a call the carrier has no booking for under its key, when the key is older than the carrier
/// keeps keys (`--effect-key-ttl`): the carrier may have forgotten it, so its answer says nothing; left as it was.
pub const EXPIRED: &str = "expired";

/// Whether a call's key may be forgotten by the carrier: its row, written before its first call, is `key_ttl` old.
fn older_than_its_key(
    effect: &external::Row,
    now: chrono::DateTime<chrono::Utc>,
    key_ttl: std::time::Duration,
) -> bool {
    (now - effect.created_at)
        .to_std()
        .is_ok_and(|age| age >= key_ttl)
}

/// Whether a call's last attempt ended at least `quiet_for` before `now`: its last change, or — for one a process
/// held — the end of that process's lease, whichever is later.
fn quiet_since(
    effect: &external::Row,
    now: chrono::DateTime<chrono::Utc>,
    quiet_for: std::time::Duration,
) -> bool {
    let ended = effect
        .lease_until
        .map_or(effect.updated_at, |l| l.max(effect.updated_at));
    (now - ended).to_std().is_ok_and(|quiet| quiet >= quiet_for)
}

/// Marks an effect done with the carrier's slot and writes its reservation, in one transaction; false if it could
/// not be settled (done meanwhile, or leased again).
async fn settle_booked(
    pool: &sqlx::PgPool,
    effect: &external::Row,
    slot: crate::carrier_stub::SlotAnswer,
) -> Result<bool> {
    let reference = slot.slot_id.to_string();
    let mut conn = pool.acquire().await?;
    let mut tx = crate::db::pooler::begin(&mut conn).await?;
    let settled = external::settle(
        &mut *tx,
        effect.message_id,
        &effect.consumer_type,
        "done",
        Some(&reference),
        Some("reconciled: the carrier has a booking under its key"),
        // A booking under its key stays true whatever became of the row since (done or leased: not settled).
        None,
    )
    .await?;
    if settled.is_none() {
        return Ok(false);
    }
    let parcel_id = effect
        .request
        .get("parcelId")
        .and_then(|p| p.as_str())
        .and_then(|p| Uuid::parse_str(p).ok());
    if let Some(parcel_id) = parcel_id {
        effects::insert_carrier_reservation(
            &mut tx,
            &effects::Reservation {
                parcel_id,
                slot_id: slot.slot_id,
                pickup_at: slot.pickup_at,
                message_id: effect.message_id,
                idempotency_key: effect.idempotency_key,
            },
        )
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Messages of a replay (replayed, or to be replayed on a dry run) older than the idempotency-key lifetime of a keyed
/// consumer of their origin queue: its carrier may have forgotten the key, and a message whose call had in fact been
/// made could book again. One warning per consumer_type; when PostgreSQL cannot be asked (replay needs it for nothing
/// else), a warning that says so.
pub async fn warn_past_key_lifetime(
    database: &crate::db::Database,
    report: &crate::replay::Report,
) {
    use crate::replay::Action;
    let chosen: Vec<_> = report
        .items
        .iter()
        .filter(|i| matches!(i.action, Action::Replayed | Action::WouldReplay))
        .collect();
    if chosen.is_empty() {
        return;
    }
    let pool = match database.pool(1).await {
        Ok(pool) => pool,
        Err(e) => {
            tracing::warn!(
                error = %crate::redact::text(&e.to_string()),
                "could not look for keyed consumers whose idempotency keys the replayed messages may have outlived \
                 (a carrier that forgot a key books again): PostgreSQL could not be reached"
            );
            return;
        }
    };
    let mut origins: Vec<&str> = chosen.iter().filter_map(|i| i.origin.as_deref()).collect();
    origins.sort_unstable();
    origins.dedup();
    let now = chrono::Utc::now();
    for origin in origins {
        let keyed = match crate::db::events::keyed_consumers_of(&pool, origin).await {
            Ok(keyed) => keyed,
            Err(e) => {
                tracing::warn!(
                    error = %crate::redact::text(&crate::db::describe(&e)),
                    "could not look for keyed consumers whose idempotency keys the replayed messages may have \
                     outlived (a carrier that forgot a key books again): inboxctl_consumers could not be read"
                );
                break;
            }
        };
        for (consumer_type, ttl) in keyed {
            let older = chosen
                .iter()
                .filter(|i| i.origin.as_deref() == Some(origin))
                .filter(|i| {
                    i.failed_at
                        .is_some_and(|t| (now - t).to_std().is_ok_and(|age| age > ttl))
                })
                .count();
            if older > 0 {
                tracing::warn!(
                    consumer_type = %crate::sanitize::text(&consumer_type),
                    queue = %crate::sanitize::text(origin),
                    messages = older,
                    key_lifetime = %humantime::format_duration(ttl),
                    "messages failed longer ago than the carrier keeps idempotency keys (--effect-key-ttl of this keyed \
                     consumer): one whose call had in fact been made may book again"
                );
            }
        }
    }
    pool.close().await;
}
