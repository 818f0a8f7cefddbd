//! The claim protocol: at-least-once deliveries in, exactly-once database effects out.
//!
//! For each delivery of a message, [`Inbox::process`] runs one PostgreSQL transaction on one connection (each trap
//! named is written out in `docs/architecture.md`, "The traps the claim avoids"):
//!
//! 1. `BEGIN`.
//! 2. Claim `(message id, consumer_type)`: insert the inbox row with `ON CONFLICT DO NOTHING` ([`db::claim`]). The
//!    claim comes first, before any work (the check-then-insert trap lets two first deliveries both work). If another
//!    delivery of the same message holds the key in a transaction that has not ended, PostgreSQL makes this insert
//!    wait for it: if that transaction commits, this delivery is a duplicate; if it rolls back, this delivery takes
//!    the key and does the work (dropping a copy too early: a copy is dropped only after a committed claim).
//! 3. A duplicate is recorded (in the same statement) and committed; nothing else happens.
//! 4. Otherwise the caller's work runs on the same transaction (no split transaction), and `processed_at` is already
//!    set by the claim — nobody can see the row before it commits, and it commits only with the work (so
//!    `processed_at` is never left unset).
//! 5. `COMMIT`: one transaction per message (no extra transactions). Any failure before it rolls everything back,
//!    claim included, so a failed attempt leaves no trace and the message can be processed again.
//!
//! **One statement** ([`Inbox::process_effect`]): when the work is one SQL statement that writes only through the
//! claim's row ([`Effect`]), steps 1–5 are one statement — the claim and the effect as one, its own transaction —
//! sent in one round trip. The order and the waits are the same; any failure of the statement but the database's
//! sends the message the usual way, which tells the work's failure from the claim's.
//!
//! The caller acknowledges the delivery only after `process` returned: a crash between the commit and the ack makes
//! the broker deliver the message again, and that delivery is then a duplicate.
//!
//! **Batched** ([`Inbox::process_batch`], [`Inbox::process_batch_with`]): several messages share one transaction.
//! All their keys are claimed by one statement (in id order, so two batches never lock each other in a cycle); the
//! copies among them are recorded by one more, only when there are any; then the claimed members' work runs — all of
//! it in one call when the caller can write every member's effect at once (`together`), else member after member —
//! and the batch commits once. No savepoint on the way: a failure is paid for when it happens, not by every batch.
//! When a member's work fails, the whole transaction is rolled back and the batch done again without it (claim
//! included), so the failing member alone is left unprocessed, to be retried alone, and the others commit together;
//! when the `together` work fails, the batch is done again member by member to find out which failed. With
//! `together`, a batch of n messages costs five round trips (`BEGIN`, the claim, the effects, a look that the
//! transaction is not aborted, `COMMIT`) instead of five per message.
//!
//! **An aborted transaction is never taken for committed.** A work whose statement fails and that goes on, its error
//! caught ("the row may exist: fine"), leaves the transaction aborted, and PostgreSQL answers its `COMMIT` with
//! `ROLLBACK` and no error. Before each commit the transaction is looked at ([`db::claim::still_open`]): aborted, it is
//! the work's failure — in a batch, the member whose work did it is found and left out. So is a work that ended the
//! transaction itself (a `ROLLBACK` of its own), after which sqlx's `COMMIT` would be answered with a warning only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnection, PgPool};
use uuid::Uuid;

use crate::db::{self, is_transient};
use crate::failpoint;

mod batch;
mod effect;
mod refused;
mod scope;
pub mod time;

pub use batch::{MAX_BATCH, Member, MemberOutcome, MemberWork, TogetherWork};
pub use effect::Effect;
pub use scope::{ConsumerType, MAX_CONSUMER_TYPE_CHARS};
pub use time::{Carried, TimeSource};

/// A hash of a message's event, kept beside its claim, that tells a copy of the message (the same event) from another
/// message that reuses its id (a producer bug): see `amqp::envelope::fingerprint`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub(crate) fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// A copy whose message id was claimed before for another event: the id was reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conflict {
    /// The fingerprint of the event processed under this id.
    pub first: Fingerprint,
    /// This copy's.
    pub this: Fingerprint,
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The key was claimed, the work ran and committed with the inbox row.
    Processed(T),
    /// A committed claim already had the key, for the same event (or one whose fingerprint is not known): nothing ran;
    /// the discard is counted.
    Duplicate,
    /// A committed claim already had the key for another event: nothing ran; recorded as a conflict, not as a
    /// duplicate. What to do with the copy is the caller's choice.
    Conflict(Conflict),
}

/// Why the consumer's work failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The work's own error, told as it is, its causes with it (the consumer logs them, and writes them into the
    /// dead-letter copy's reason).
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl WorkError {
    pub fn msg(message: impl Into<String>) -> Self {
        WorkError::Failed(message.into().into())
    }
}

/// Why [`Inbox::process`] committed nothing. Either way the message is still owed an attempt.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// PostgreSQL could not be used (unreachable, restarting, out of connections, a deadlock, a lock wait that timed
    /// out). Not the message's fault: retry it, without counting the attempt. An answer to the `COMMIT` that never
    /// came is one too: the commit may have landed, and the retry then finds the message a duplicate (the work's
    /// output of that attempt is lost; its effects are not doubled).
    #[error("PostgreSQL unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// The consumer's own work failed. Counts as a failed attempt of the message.
    #[error("{0}")]
    Failed(#[source] WorkError),
    /// The message cannot be claimed in this inbox, now or later: a partitioned inbox keys messages on a time this
    /// one does not carry, or whose time no partition holds. Trying again cannot help; nothing ran.
    #[error("{0}")]
    Unclaimable(String),
}

impl ProcessError {
    /// Whether the session it came on may be what failed, and is not to be handed out again: the database's doing,
    /// but for a claim held because no partition holds the present (the session is fine, and closing it would open a
    /// new one for every held message's next try).
    fn session_suspect(&self) -> bool {
        matches!(self, ProcessError::Unavailable(e) if !db::is_no_partition_for_now(e))
    }
}

/// A consumer's work on one message, run on the transaction that holds the message's inbox row.
pub type Work<T> =
    Box<dyn for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send>;

/// Told how long each claim statement took, from sending it to its answer: next to nothing for a first delivery, and
/// for a copy of a message whose attempt is in flight elsewhere, the time it waited for that attempt's end. Lets a
/// caller measure the claim (`--metrics-addr`) without the core knowing how it is exported. A claim that failed (the
/// database gone, `--claim-timeout` reached) is not told.
pub trait ClaimObserver: std::fmt::Debug + Send + Sync + 'static {
    /// One claim statement (one per message, or one per batch) answered after `took`.
    fn claimed(&self, took: Duration);
}

/// The claim protocol for one consumer_type, on a pool of connections. A Rust service can embed it as it is; the
/// carrier and notification consumers use nothing else.
#[derive(Debug, Clone)]
pub struct Inbox {
    pool: PgPool,
    consumer_type: ConsumerType,
    observer: Option<Arc<dyn ClaimObserver>>,
    /// The `lock_timeout` each claim transaction sets for itself, where the sessions keep none of their own.
    claim_timeout: Option<Duration>,
    /// How long one attempt (or one round of a batch) may hold its connection before it is given up
    /// (`with_attempt_timeout`).
    attempt_timeout: Option<Duration>,
    /// How the claim keys a message: shared by the inbox's clones, and learnt again when the inbox is partitioned
    /// under a running consumer.
    keying: Arc<std::sync::RwLock<Keying>>,
}

/// How the claim keys messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Keying {
    /// By `(id, consumer_type)`: the schema every user has.
    #[default]
    Plain,
    /// Also by a time every copy carries, read from this source: a partitioned inbox (`migrate --partitioned`).
    Timed(TimeSource),
}

impl Inbox {
    pub fn new(pool: PgPool, consumer_type: ConsumerType) -> Self {
        Self {
            pool,
            consumer_type,
            observer: None,
            claim_timeout: None,
            attempt_timeout: None,
            keying: Arc::default(),
        }
    }

    /// The same inbox, keying messages as `keying` says (what `db::partitions::layout` found).
    pub fn with_keying(self, keying: Keying) -> Self {
        *self.keying.write().unwrap_or_else(|p| p.into_inner()) = keying;
        self
    }

    /// How the claim keys messages now.
    pub fn keying(&self) -> Keying {
        *self.keying.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the inbox's layout again, after a claim met another than it expected (the inbox partitioned under a
    /// running consumer): the next attempt keys the message the new way. A failure to read is left to that attempt.
    async fn learn_keying(&self, conn: &mut PgConnection) {
        match db::partitions::layout(conn).await {
            Ok(Some(layout)) => {
                let keying = Keying::of(layout);
                if keying != self.keying() {
                    tracing::warn!(
                        ?keying,
                        "inbox_messages changed its layout; claiming the new way"
                    );
                    *self.keying.write().unwrap_or_else(|p| p.into_inner()) = keying;
                }
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "could not read the inbox's layout"),
        }
    }

    /// The same inbox, each claim transaction bounding its own wait for a copy's other attempt (`SET LOCAL
    /// lock_timeout`) when `timeout` is given: for connections that keep no session setting, a transaction pooler's,
    /// where the bound cannot be given at connection start (`Database::lock_timeout_per_transaction`).
    pub fn with_claim_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.claim_timeout = timeout;
        self
    }

    /// What each claim transaction sets for itself: its `lock_timeout` (`with_claim_timeout`), and durable commits
    /// where the store's transactions make them so (`db::pooler::make_commits_durable`).
    fn per_transaction(&self) -> db::claim::PerTransaction {
        db::claim::PerTransaction::now(self.claim_timeout)
    }

    /// The same inbox, giving up an attempt — one message's transaction, or one round of a batch's — that has not
    /// ended within `timeout`: its connection is dropped (and never handed out again) and the attempt is
    /// [`ProcessError::Unavailable`], to be tried again like any other lost connection. A connection that dies without
    /// a word (a host lost, a network cut: no FIN, no RST) otherwise holds its statement until the kernel's TCP
    /// timeout, a quarter of an hour by default, and its message with it. Giving up is safe at any point: a `COMMIT`
    /// that did land makes the next attempt a duplicate. `None` (the default): no bound.
    ///
    /// The bound must be longer than anything an attempt waits for on purpose: the claim's wait for another attempt
    /// (`lock_timeout`), and the work's own.
    pub fn with_attempt_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Runs `attempt` (one attempt's work on its connection) within [`Inbox::with_attempt_timeout`]'s bound; past it,
    /// the attempt is dropped where it stands and is `Unavailable` (its caller then closes the connection).
    async fn bounded<T>(
        &self,
        attempt: impl Future<Output = Result<T, ProcessError>>,
    ) -> Result<T, ProcessError> {
        match self.attempt_timeout {
            None => attempt.await,
            Some(limit) => tokio::time::timeout(limit, attempt)
                .await
                .unwrap_or_else(|_| Err(ProcessError::Unavailable(db::no_answer(limit)))),
        }
    }

    /// The same inbox, telling `observer` how long each claim took.
    pub fn with_claim_observer(mut self, observer: Arc<dyn ClaimObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    fn claim_took(&self, started: Instant) {
        if let Some(observer) = &self.observer {
            observer.claimed(started.elapsed());
        }
    }

    pub fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs `work` exactly once per `message_id` for this consumer_type, however often it is called with that id;
    /// see the module documentation for the protocol. A message id reused for another event is not noticed: see
    /// [`Inbox::process_event`].
    pub async fn process<T, F>(&self, message_id: Uuid, work: F) -> Result<Outcome<T>, ProcessError>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send,
        T: Send,
    {
        self.process_event(message_id, None, work).await
    }

    /// Like [`Inbox::process`], and keeps `fingerprint` (of the message's event) with the claim: a later copy whose
    /// fingerprint differs is a [`Outcome::Conflict`], not a duplicate.
    pub async fn process_event<T, F>(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        work: F,
    ) -> Result<Outcome<T>, ProcessError>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send,
        T: Send,
    {
        self.process_carried(message_id, fingerprint, &Carried::default(), work)
            .await
    }

    /// Like [`Inbox::process_event`], with the times the delivery carries besides its id, which a partitioned inbox
    /// may key the message on (see [`time`]).
    pub async fn process_carried<T, F>(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: &Carried,
        work: F,
    ) -> Result<Outcome<T>, ProcessError>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send,
        T: Send,
    {
        let key = self.key(message_id, fingerprint, carried)?;
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(ProcessError::Unavailable)?;
        let result = self.bounded(self.process_on(&mut conn, &key, work)).await;
        // Still inside a transaction (one the work began and left open): never hand it out again either.
        if result.as_ref().is_err_and(ProcessError::session_suspect)
            || sqlx::Connection::is_in_transaction(&*conn)
        {
            // The session itself may be what failed (made read-only by a failover or by
            // default_transaction_read_only, terminated by an administrator): never hand it out again.
            conn.close_on_drop();
        }
        result
    }

    async fn process_on<T, F>(
        &self,
        conn: &mut PgConnection,
        key: &db::claim::Key,
        work: F,
    ) -> Result<Outcome<T>, ProcessError>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, WorkError>> + Send,
        T: Send,
    {
        let mut tx = db::claim::begin(conn, &self.per_transaction())
            .await
            .map_err(ProcessError::Unavailable)?;

        let claim_started = Instant::now();
        // Whatever goes wrong with the claim is the database's doing (the statement depends on nothing but the key),
        // or, partitioned, the key's time's.
        let claimed = match db::claim::claim(&mut tx, key, &self.consumer_type).await {
            Ok(claimed) => claimed,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(self.claim_error(conn, e, std::slice::from_ref(key)).await);
            }
        };
        self.claim_took(claim_started);

        if !claimed {
            let outcome = self.record_copy(&mut tx, key).await?;
            tx.commit().await.map_err(ProcessError::Unavailable)?;
            return Ok(outcome);
        }

        let output = match work(&mut tx).await {
            Ok(output) => output,
            Err(error) => {
                let outage = outage(&mut tx, &error).await;
                // Roll back now rather than when the connection is next used, so a copy waiting on this key
                // proceeds at once.
                let _ = tx.rollback().await;
                return Err(match error {
                    WorkError::Database(e) if outage => ProcessError::Unavailable(e),
                    other => ProcessError::Failed(other),
                });
            }
        };

        if let Err(e) = db::claim::still_open(&mut tx).await {
            let _ = tx.rollback().await;
            return Err(match aborted(e) {
                WorkError::Database(e) => ProcessError::Unavailable(e),
                other => ProcessError::Failed(other),
            });
        }
        failpoint::hit("before-commit").await;
        tx.commit().await.map_err(commit_error)?;
        db::claim::committed(conn).map_err(|e| ProcessError::Failed(aborted(e)))?;
        Ok(Outcome::Processed(output))
    }
}

impl Inbox {
    /// Records a copy whose key a committed claim holds: a duplicate, or a conflict if the claim kept another
    /// fingerprint. A statement of its own, after the claim: the claim's snapshot was taken before it waited for the
    /// other attempt, and would not see that attempt's fingerprint.
    async fn record_copy<T>(
        &self,
        conn: &mut PgConnection,
        key: &db::claim::Key,
    ) -> Result<Outcome<T>, ProcessError> {
        let first = db::claim::record_copy(conn, key, &self.consumer_type)
            .await
            .map_err(ProcessError::Unavailable)?;
        Ok(conflict(first, key.fingerprint).map_or(Outcome::Duplicate, Outcome::Conflict))
    }
}

impl Keying {
    /// How to key messages in an inbox laid out as `layout`.
    pub fn of(layout: db::partitions::Layout) -> Self {
        match layout {
            db::partitions::Layout::Plain => Keying::Plain,
            db::partitions::Layout::Partitioned(settings) => Keying::Timed(settings.source),
        }
    }
}

/// What the last look at a transaction before its commit found ([`db::claim::still_open`]): the database's doing
/// (returned as [`WorkError::Database`]), or a statement of the work that failed while the work went on, its error
/// caught — the transaction aborted, and nothing of it can commit.
fn aborted(e: sqlx::Error) -> WorkError {
    if matches!(&e, sqlx::Error::Protocol(m) if m == db::claim::LEFT_OPEN_BY_THE_WORK) {
        return WorkError::msg(format!(
            "{}: the claim's COMMIT would have committed nothing; the message is not taken as processed (commit or \
             roll back every transaction the work begins)",
            db::claim::LEFT_OPEN_BY_THE_WORK
        ));
    }
    if matches!(&e, sqlx::Error::Protocol(m) if m == db::claim::ENDED_BY_THE_WORK) {
        return WorkError::msg(format!(
            "{}: its claim and whatever it wrote before are rolled back or committed apart, and the message is \
             not taken as processed (leave the transaction to the inbox, which commits or rolls it back)",
            db::claim::ENDED_BY_THE_WORK
        ));
    }
    if is_transient(&e) {
        return WorkError::Database(e);
    }
    WorkError::msg(format!(
        "a statement of the work failed and the work went on as if it had not: the transaction was aborted, and \
         nothing of it can commit (return the statement's error, or write it so that it cannot fail: ON CONFLICT …): \
         {}",
        crate::sanitize::text(&e.to_string())
    ))
}

/// Whether the error the work returned is the database's doing: waited out and tried again, never counted. A
/// protocol error its session outlived was its own statement's (more parameters than one statement may carry): the
/// message's, counted like any failure — taken for an outage, it would be tried again for ever, the consumer's intake
/// paused each time. So is a limit of the statement's own making (53400, `configuration_limit_exceeded`: a
/// `temp_file_limit` the statement's sort or hash went past): the server is fine, and the same statement meets it
/// again every time.
async fn outage(conn: &mut PgConnection, error: &WorkError) -> bool {
    match error {
        WorkError::Database(sqlx::Error::Protocol(_)) => match db::claim::still_open(conn).await {
            Ok(()) => false,
            // The server answered (25P02: an earlier statement's error, caught): the session is alive — unless its
            // answer is itself the infrastructure's (a shutdown, a pooler's refusal).
            Err(e @ sqlx::Error::Database(_)) => is_transient(&e),
            Err(e) => !db::claim::is_the_works_doing(&e),
        },
        WorkError::Database(e) if db::sqlstate(e).as_deref() == Some("53400") => false,
        // The pooler ended the session: the work kept its transaction idle past the pooler's limit (a call to the
        // outside world slower than it, say). Counted, so that a work slow of its own ends in the error queue; taken
        // for an outage, the message was held and tried again for ever, each try as slow.
        WorkError::Database(e) if db::is_poolers_idle_limit(e) => false,
        // A statement the server's `statement_timeout` (57014) or an operator's cancel ended is the work's: counted,
        // so that a work slow of its own ends in the error queue. The consumer's sessions carry their own
        // `statement_timeout`, past `--attempt-timeout` (`Database::with_statement_timeout`), so a lock the work waits
        // on ends at `lock_timeout` (55P03, transient) first, as the claim's does.
        WorkError::Database(e) => is_transient(e),
        _ => false,
    }
}

/// A refused `COMMIT`: the database's doing when transient (the message is tried again), else a failure of the
/// message (or the batch) itself.
fn commit_error(e: sqlx::Error) -> ProcessError {
    if is_transient(&e) {
        ProcessError::Unavailable(e)
    } else {
        ProcessError::Failed(WorkError::Database(e))
    }
}

/// Whether a copy with `this` fingerprint, of a message first claimed with `first`, is a conflict (both known and
/// different).
fn conflict(first: Option<Fingerprint>, this: Option<Fingerprint>) -> Option<Conflict> {
    let first = first?;
    let this = this?;
    (first != this).then_some(Conflict { first, this })
}
