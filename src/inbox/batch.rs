//! Batched processing: several messages in one transaction (see the module documentation of [`crate::inbox`]).

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use futures_util::FutureExt as _;
use futures_util::future::BoxFuture;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use super::{
    Carried, Conflict, Fingerprint, Inbox, ProcessError, WorkError, commit_error, conflict,
};
use crate::db;
use crate::failpoint;

/// The most members a batch may have: a batch holds its members' keys locked until it commits, and a failing member
/// costs the batch a redo.
pub const MAX_BATCH: usize = 64;

/// A batch member's work on the batch's transaction. It may run more than once — a batch that fails because of
/// another member is done again without that one — and only its last run's effects commit.
pub type MemberWork<T> =
    Box<dyn for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send + Sync>;

/// The work of a batch's claimed members in one call (one statement, say), given their ids in the batch's order; one
/// output per id, in that order. Runs at most once: if it fails, the members' own work runs instead.
pub type TogetherWork<T> = Box<
    dyn for<'c> FnOnce(&'c mut PgConnection, &'c [Uuid]) -> BoxFuture<'c, Result<Vec<T>, WorkError>>
        + Send,
>;

/// One message of a batch.
pub struct Member<T> {
    pub message_id: Uuid,
    /// Its event's fingerprint, if known: kept with the claim, compared with later copies'.
    pub fingerprint: Option<Fingerprint>,
    /// The times its delivery carries, one of which a partitioned inbox keys it on.
    pub carried: Carried,
    pub work: MemberWork<T>,
}

/// What became of one member of a committed batch.
#[derive(Debug)]
pub enum MemberOutcome<T> {
    Processed(T),
    Duplicate,
    Conflict(Conflict),
    /// Its work failed: the batch was done again without it; nothing of it committed.
    Failed(WorkError),
    /// It cannot be claimed in this inbox (see [`ProcessError::Unclaimable`]): left out of the batch; nothing ran.
    Unclaimable(String),
}

impl Inbox {
    /// Processes `members` (distinct message ids, at most [`MAX_BATCH`]) in one transaction, each member's work in
    /// turn; see the module documentation. `Err` means nothing committed: `Unavailable` is the database's doing;
    /// `Failed` means the batch as a whole could not be committed (a member panicked, or the commit itself was
    /// refused), and its members should be processed one by one.
    pub async fn process_batch<T: Send>(
        &self,
        members: Vec<Member<T>>,
    ) -> Result<Vec<MemberOutcome<T>>, ProcessError> {
        self.process_batch_with(members, None).await
    }

    /// [`Inbox::process_batch`], with the claimed members' work done by `together` in one call when it succeeds.
    pub async fn process_batch_with<T: Send>(
        &self,
        members: Vec<Member<T>>,
        together: Option<TogetherWork<T>>,
    ) -> Result<Vec<MemberOutcome<T>>, ProcessError> {
        // Each round's claim locks every key left, and a failing member costs a round: the size is bounded (and
        // refused before a connection is taken, which a failure would close).
        if members.len() > MAX_BATCH {
            return Err(ProcessError::Failed(WorkError::msg(format!(
                "a batch holds at most {MAX_BATCH} messages, not {}",
                members.len()
            ))));
        }
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(ProcessError::Unavailable)?;
        let result = self.process_batch_on(&mut conn, members, together).await;
        // As in `process`; and a member that panicked may have left the session mid-statement, so any other failure
        // too; and one still inside a transaction a member's work left open.
        if result
            .as_ref()
            .is_err_and(|e| e.session_suspect() || !matches!(e, ProcessError::Unavailable(_)))
            || sqlx::Connection::is_in_transaction(&*conn)
        {
            conn.close_on_drop();
        }
        result
    }

    async fn process_batch_on<T: Send>(
        &self,
        conn: &mut PgConnection,
        members: Vec<Member<T>>,
        mut together: Option<TogetherWork<T>>,
    ) -> Result<Vec<MemberOutcome<T>>, ProcessError> {
        let mut ids: Vec<Uuid> = members.iter().map(|m| m.message_id).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != members.len() {
            return Err(ProcessError::Failed(WorkError::msg(
                "a batch must not hold one message id twice",
            )));
        }
        // Each member's key; one that cannot be claimed is left out of every round.
        let mut keys: HashMap<Uuid, db::claim::Key> = HashMap::with_capacity(members.len());
        let mut unclaimable: HashMap<Uuid, String> = HashMap::new();
        for m in &members {
            match self.key(m.message_id, m.fingerprint, &m.carried) {
                Ok(key) => {
                    keys.insert(m.message_id, key);
                }
                Err(ProcessError::Unclaimable(reason)) => {
                    unclaimable.insert(m.message_id, reason);
                }
                Err(other) => return Err(other),
            }
        }
        // Members whose work failed, with the error: left out of every later round.
        let mut failed: HashMap<Uuid, WorkError> = HashMap::new();
        // Once a round was aborted under a member's caught error: each member's work is looked at after it.
        let mut check_each = false;
        loop {
            // Each round is an attempt of its own, bounded as one (`with_attempt_timeout`): a batch redone without a
            // failing member waits again, for its claim and its work.
            let round = self
                .bounded(self.batch_round(
                    conn,
                    &members,
                    &keys,
                    &failed,
                    together.take(),
                    check_each,
                ))
                .await?;
            match round {
                Round::Committed {
                    claimed,
                    copies,
                    mut outputs,
                } => {
                    return Ok(members
                        .iter()
                        .map(|m| {
                            if let Some(reason) = unclaimable.remove(&m.message_id) {
                                MemberOutcome::Unclaimable(reason)
                            } else if let Some(error) = failed.remove(&m.message_id) {
                                MemberOutcome::Failed(error)
                            } else if claimed.contains(&m.message_id) {
                                outputs
                                    .remove(&m.message_id)
                                    .map_or(MemberOutcome::Duplicate, MemberOutcome::Processed)
                            } else {
                                let first = copies.get(&m.message_id).copied().flatten();
                                conflict(first, m.fingerprint)
                                    .map_or(MemberOutcome::Duplicate, MemberOutcome::Conflict)
                            }
                        })
                        .collect());
                }
                // The together work failed: the next round goes member by member.
                Round::TogetherFailed => {}
                Round::Aborted => check_each = true,
                Round::MemberFailed(id, error) => {
                    failed.insert(id, error);
                }
            }
        }
    }

    /// One try at the batch, without the members in `failed`: claim, work, commit. A failure of the work rolls the
    /// transaction back and says what failed, for the next round.
    async fn batch_round<T: Send>(
        &self,
        conn: &mut PgConnection,
        members: &[Member<T>],
        all_keys: &HashMap<Uuid, db::claim::Key>,
        failed: &HashMap<Uuid, WorkError>,
        together: Option<TogetherWork<T>>,
        check_each: bool,
    ) -> Result<Round<T>, ProcessError> {
        let mut keys: Vec<db::claim::Key> = members
            .iter()
            .filter(|m| !failed.contains_key(&m.message_id))
            .filter_map(|m| all_keys.get(&m.message_id).copied())
            .collect();
        keys.sort_unstable_by_key(|k| k.message_id);
        // `begin` refuses a connection still in a transaction: an earlier round's member left one open (its
        // rollback went back to that transaction's savepoint only). The batch as a whole failed; its members go one
        // by one, where the culprit fails alone.
        let mut tx = db::claim::begin(conn, &self.per_transaction())
            .await
            .map_err(|e| {
                if db::claim::is_the_works_doing(&e) {
                    ProcessError::Failed(super::aborted(e))
                } else {
                    ProcessError::Unavailable(e)
                }
            })?;
        let claim_started = Instant::now();
        let claimed = if keys.is_empty() {
            HashSet::new()
        } else {
            match db::claim::claim_batch(&mut tx, &keys, &self.consumer_type).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    let _ = tx.rollback().await;
                    // Held only if every member no partition holds is of now, past the partitions (they ran out);
                    // else it may be a member's own time, found one by one.
                    return Err(match self.claim_error(conn, e, &keys).await {
                        // Which member's time no partition holds, the statement does not say: one by one, it is
                        // found and moved aside, and the others go on.
                        ProcessError::Unclaimable(_) => ProcessError::Failed(WorkError::msg(
                            "a member's time is in no partition of the inbox",
                        )),
                        other => other,
                    });
                }
            }
        };
        self.claim_took(claim_started);
        let copies = self.record_batch_copies(&mut tx, &keys, &claimed).await?;
        // The claimed members, in the batch's order.
        let working: Vec<&Member<T>> = members
            .iter()
            .filter(|m| claimed.contains(&m.message_id))
            .collect();

        let outputs = match run_work(&mut tx, &working, together, check_each).await {
            Worked::Done(outputs) => outputs,
            Worked::Unavailable(e) => {
                let _ = tx.rollback().await;
                return Err(ProcessError::Unavailable(e));
            }
            Worked::Redo(round) => {
                tx.rollback().await.map_err(ended_under_failed_work)?;
                return Ok(round);
            }
            Worked::EndedUnderFailure(e) => {
                let _ = tx.rollback().await;
                return Err(ended_under_failed_work(e));
            }
            Worked::Miscounted => {
                let _ = tx.rollback().await;
                return Err(ProcessError::Failed(WorkError::msg(
                    "the batch's work gave another number of outputs than it had members",
                )));
            }
            Worked::Panicked => return Err(panicked(tx).await),
        };

        failpoint::hit("before-commit").await;
        tx.commit().await.map_err(commit_error)?;
        // A member's work left a transaction of its own open: the COMMIT committed nothing. Which member's, a look
        // after each would have to find on a connection no round can use again (its claim would be a savepoint):
        // the batch as a whole failed, the connection is closed (all rolled back), and its members go one by one,
        // where the culprit fails alone.
        db::claim::committed(conn).map_err(|e| ProcessError::Failed(super::aborted(e)))?;
        Ok(Round::Committed {
            claimed,
            copies,
            outputs,
        })
    }

    /// Records the members a committed claim already held (duplicates and conflicts) in one statement, if any;
    /// returns the fingerprint each was first claimed with.
    async fn record_batch_copies(
        &self,
        conn: &mut PgConnection,
        keys: &[db::claim::Key],
        claimed: &HashSet<Uuid>,
    ) -> Result<HashMap<Uuid, Option<Fingerprint>>, ProcessError> {
        let copies: Vec<db::claim::Key> = keys
            .iter()
            .filter(|k| !claimed.contains(&k.message_id))
            .copied()
            .collect();
        if copies.is_empty() {
            return Ok(HashMap::new());
        }
        db::claim::record_batch_copies(conn, &copies, &self.consumer_type)
            .await
            .map_err(ProcessError::Unavailable)
    }
}

/// Runs the claimed members' work on the batch's transaction: `together` in one call if given, else each member's in
/// turn, stopping at the first failure.
async fn run_work<T: Send>(
    conn: &mut PgConnection,
    working: &[&Member<T>],
    together: Option<TogetherWork<T>>,
    check_each: bool,
) -> Worked<T> {
    let mut outputs = HashMap::with_capacity(working.len());
    if let Some(together) = together.filter(|_| !working.is_empty()) {
        let ids: Vec<Uuid> = working.iter().map(|m| m.message_id).collect();
        let result = AssertUnwindSafe(together(conn, &ids)).catch_unwind().await;
        let outage = match &result {
            Ok(Err(error)) => super::outage(conn, error).await,
            _ => false,
        };
        return match result {
            Ok(Ok(out)) if out.len() == ids.len() => match db::claim::still_open(conn).await {
                Ok(()) => {
                    outputs.extend(ids.into_iter().zip(out));
                    Worked::Done(outputs)
                }
                // Member by member, looking at each, the next round finds whose work it was.
                Err(e) => match super::aborted(e) {
                    WorkError::Database(e) => Worked::Unavailable(e),
                    _ => Worked::Redo(Round::Aborted),
                },
            },
            Ok(Ok(_)) => Worked::Miscounted,
            Ok(Err(WorkError::Database(e))) if outage => Worked::Unavailable(e),
            Ok(Err(_)) => Worked::Redo(Round::TogetherFailed),
            Err(_) => Worked::Panicked,
        };
    }
    for (i, member) in working.iter().enumerate() {
        let result = AssertUnwindSafe((member.work)(conn)).catch_unwind().await;
        let outage = match &result {
            Ok(Err(error)) => super::outage(conn, error).await,
            _ => false,
        };
        match result {
            Ok(Ok(output)) => {
                // Looking for the member whose caught error aborted an earlier round: each one's transaction looked
                // at after its work, so that it is the one left out, not the next, whose first statement is refused.
                if check_each && let Err(e) = db::claim::still_open(conn).await {
                    return match super::aborted(e) {
                        WorkError::Database(e) => Worked::Unavailable(e),
                        error => Worked::Redo(Round::MemberFailed(member.message_id, error)),
                    };
                }
                outputs.insert(member.message_id, output);
            }
            Ok(Err(WorkError::Database(e))) if outage => return Worked::Unavailable(e),
            // Refused because an earlier member's caught error aborted the transaction, maybe: not this member's
            // failure then. Its error may say so (25P02, itself or down its sources) or not (wrapped as text only).
            Ok(Err(error)) if !check_each && refused_as_aborted(&error) => {
                return Worked::Redo(Round::Aborted);
            }
            // A failure of any member but the first, in a round that did not look after each: the transaction looked
            // at. Still open, the failure is this member's own, and the next round leaves it out (its work not run
            // once more, in a round that looks after each, to find it: a call to the outside world made again).
            // Aborted, an earlier member's caught error may have done it: the next round looks after each member
            // and finds whose it is. The first member's is its own: the claim before it succeeded.
            Ok(Err(error)) if !check_each && i > 0 => {
                return match db::claim::still_open(conn).await {
                    Ok(()) => Worked::Redo(Round::MemberFailed(member.message_id, error)),
                    Err(e) => match super::aborted(e) {
                        WorkError::Database(e) => Worked::EndedUnderFailure(e),
                        _ => Worked::Redo(Round::Aborted),
                    },
                };
            }
            Ok(Err(error)) => return Worked::Redo(Round::MemberFailed(member.message_id, error)),
            Err(_) => return Worked::Panicked,
        }
    }
    // (No member working: nothing was claimed in this round, and there is nothing to look at.)
    if !check_each
        && !working.is_empty()
        && let Err(e) = db::claim::still_open(conn).await
    {
        return match super::aborted(e) {
            WorkError::Database(e) => Worked::Unavailable(e),
            _ => Worked::Redo(Round::Aborted),
        };
    }
    Worked::Done(outputs)
}

/// Whether a statement was refused because an earlier statement of its transaction failed (25P02).
fn is_aborted(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}

/// Whether a member's work failed on such a refusal: its `sqlx` error itself, or one found down the chain of sources
/// of an error of its own that wraps it (bounded: a chain that loops ends the look).
fn refused_as_aborted(error: &WorkError) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = match error {
        WorkError::Database(e) => return is_aborted(e),
        WorkError::Failed(e) => Some(e.as_ref()),
    };
    for _ in 0..crate::MAX_CAUSES {
        let Some(e) = next else {
            return false;
        };
        if e.downcast_ref::<sqlx::Error>().is_some_and(is_aborted) {
            return true;
        }
        next = e.source();
    }
    false
}

/// How the members' work ended, the transaction still open.
enum Worked<T> {
    Done(HashMap<Uuid, T>),
    /// The database failed under the work.
    Unavailable(sqlx::Error),
    /// A failure the next round can leave out.
    Redo(Round<T>),
    /// A member's work failed, and the session did not answer the look at the transaction after it: see
    /// [`ended_under_failed_work`].
    EndedUnderFailure(sqlx::Error),
    /// `together` gave another number of outputs than it had members.
    Miscounted,
    Panicked,
}

/// How one try at a batch ended.
enum Round<T> {
    Committed {
        claimed: HashSet<Uuid>,
        /// The fingerprint each copy's key was first claimed with.
        copies: HashMap<Uuid, Option<Fingerprint>>,
        outputs: HashMap<Uuid, T>,
    },
    TogetherFailed,
    /// A statement of the work failed and the work went on, its error caught: the transaction was aborted, and it is
    /// not known whose work it was; or a member after the first failed, maybe on that. The next round goes member by
    /// member, looking at the transaction after each.
    Aborted,
    MemberFailed(Uuid, WorkError),
}

/// The session ended under a round whose work failed — its rollback, or the look at the transaction after a
/// member's failure, refused: a pooler's `idle_transaction_timeout` while a member waited on a slow call, say. The
/// failure is the work's, not the database's: taken for an outage, the batch was held and tried again whole, for
/// ever, the member's failure never counted and the others never committed. The batch fails as a whole and its
/// members go one by one, where that member fails alone (and a database really gone is found by the others' claims).
fn ended_under_failed_work(e: sqlx::Error) -> ProcessError {
    ProcessError::Failed(WorkError::msg(format!(
        "the database session ended under a member's failed work: {}",
        crate::redact::text(&db::describe(&e))
    )))
}

/// A member's work panicked, which may have left the connection mid-statement: the whole batch is given up, and its
/// members are processed one by one, where a panic costs one message an attempt.
async fn panicked(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> ProcessError {
    let _ = tx.rollback().await;
    ProcessError::Failed(WorkError::msg("a member of the batch panicked"))
}
