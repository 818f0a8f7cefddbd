//! One message's whole effect as one SQL statement, which the inbox sends together with the claim: one statement, one
//! round trip, no `BEGIN` and no `COMMIT` (see [`Inbox::process_effect`]).

use sqlx::Arguments as _;
use sqlx::encode::Encode;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArguments, PgConnection, Postgres};
use sqlx::types::Type;
use uuid::Uuid;

use super::{
    Carried, Fingerprint, Inbox, Outcome, ProcessError, WorkError, commit_error, conflict,
};
use crate::db::{self, is_transient};
use crate::failpoint;

mod guard;

use guard::{highest_parameter, unfit};

/// A message's effect written as one statement that the inbox runs inside its claim's: `INSERT … SELECT … FROM
/// claimed` (or `UPDATE … FROM claimed`, `DELETE … USING claimed`), where `claimed` is a relation the claim makes with
/// one row when this delivery takes the message and none for a copy. **It must write only through `claimed`**: a
/// statement that writes without it writes for copies too. Its parameters are `$1`, `$2`, … in the order of
/// [`Effect::bind`]; give each one a cast (`$1::uuid`), as PostgreSQL cannot always infer a type in a select list.
///
/// The effect runs on the snapshot its statement took before the claim waited on another attempt at the message, if
/// it had to: have it read its parameters and `claimed`, not other tables that may have changed meanwhile (the usual
/// way's later statements would see those changes).
///
/// Never sent with the claim (the message goes the usual way, and the inbox says why, once a process): a statement
/// that is not an `INSERT`, `UPDATE` or `DELETE` (PostgreSQL runs a `SELECT` inside `WITH` only if something reads
/// it, and nothing does), one that does not read `claimed` in a `FROM`, `JOIN` or `USING` clause (it cannot write only through it), and one that
/// uses a parameter beyond those bound (it would read the claim's own).
pub struct Effect {
    sql: &'static str,
    /// Why `sql` cannot go with the claim, if it cannot.
    unfit: Option<&'static str>,
    /// The highest `$n` the statement uses.
    highest_parameter: usize,
    arguments: PgArguments,
    /// The first value that could not be encoded: the effect then goes the usual way (see
    /// [`Inbox::process_effect`]), where its work tells the error.
    unencodable: Option<BoxDynError>,
}

impl std::fmt::Debug for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effect")
            .field("sql", &self.sql)
            .field("parameters", &self.arguments.len())
            .finish_non_exhaustive()
    }
}

impl Effect {
    /// An effect of `sql`, its parameters to be bound in order. `sql` is `'static`: each distinct effect is built
    /// into its claim once per process and kept (a bounded cache), and prepared once per connection.
    pub fn new(sql: &'static str) -> Self {
        Self {
            sql,
            unfit: unfit(sql),
            highest_parameter: highest_parameter(sql),
            arguments: PgArguments::default(),
            unencodable: None,
        }
    }

    /// The next parameter's value.
    pub fn bind<'t, T: Encode<'t, Postgres> + Type<Postgres>>(mut self, value: T) -> Self {
        if self.unencodable.is_none()
            && let Err(e) = self.arguments.add(value)
        {
            self.unencodable = Some(e);
        }
        self
    }

    /// Makes the effect with no claim around it (`claimed` is one row, always): at least once, what a consumer
    /// without an inbox does. For comparisons (the bench's `bare` mode), not for a consumer that needs exactly once.
    pub async fn make_unguarded(self, conn: &mut PgConnection) -> Result<(), WorkError> {
        if let Some(e) = self.unencodable {
            return Err(WorkError::Database(sqlx::Error::Encode(e)));
        }
        db::claim::effect_alone_with(conn, self.sql, self.arguments)
            .await
            .map_err(WorkError::Database)
    }
}

/// How the claim-with-effect statement ended.
enum Sent {
    Done(Outcome<()>),
    Unavailable(sqlx::Error),
    /// It failed for a reason of its own (the effect's, or the claim's on a partitioned inbox): the message is done
    /// again the usual way, which tells which.
    Redo(String),
}

impl Inbox {
    /// Like [`Inbox::process_carried`], with the message's work written as one statement, `effect`: the claim and the
    /// effect go to PostgreSQL as one statement, its own transaction — one round trip where the usual way
    /// takes four (`BEGIN`, the claim, the work, `COMMIT`). A copy's claim takes no row, so its effect writes nothing;
    /// a copy of an attempt in flight waits for it in the claim, as the usual way does. Where each claim must bound
    /// its own wait or make its own commit durable (`with_claim_timeout`, `db::pooler::make_commits_durable`:
    /// connections through a transaction pooler), the statement runs between a `BEGIN` that sets them and a `COMMIT`.
    ///
    /// `work` is the same effect made the usual way, on the claim's transaction. It runs only when the statement
    /// fails for any reason but the database's (a constraint the effect breaks, a time no partition holds, a value
    /// that cannot be encoded): the message is then done again the usual way, which tells a failure of the work
    /// ([`ProcessError::Failed`]) from the claim's, and nothing of the failed statement remains.
    pub async fn process_effect<F>(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: &Carried,
        effect: Effect,
        work: F,
    ) -> Result<Outcome<()>, ProcessError>
    where
        F: for<'c> FnOnce(
                &'c mut PgConnection,
            )
                -> futures_util::future::BoxFuture<'c, Result<(), WorkError>>
            + Send,
    {
        let key = self.key(message_id, fingerprint, carried)?;
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(ProcessError::Unavailable)?;
        let attempt = async {
            match self.send_effect(&mut conn, &key, effect).await {
                Sent::Done(outcome) => Ok(outcome),
                Sent::Unavailable(e) => Err(ProcessError::Unavailable(e)),
                Sent::Redo(why) => {
                    tracing::debug!(%message_id, error = %crate::sanitize::text(&why), "the claim with its effect failed; done again the usual way");
                    self.process_on(&mut conn, &key, work).await
                }
            }
        };
        let result = self.bounded(attempt).await;
        // As `process_carried`: a session that failed, or one still inside a transaction (the usual way's work began
        // one and left it open), is never handed out again — the next claim on it would commit nothing.
        if result.as_ref().is_err_and(ProcessError::session_suspect)
            || sqlx::Connection::is_in_transaction(&*conn)
        {
            conn.close_on_drop();
        }
        result
    }

    async fn send_effect(
        &self,
        conn: &mut PgConnection,
        key: &db::claim::Key,
        effect: Effect,
    ) -> Sent {
        let unfit = effect.unfit.or_else(|| {
            (effect.highest_parameter > effect.arguments.len()).then_some(
                "it uses more parameters than are bound to it, and would read the claim's own",
            )
        });
        if let Some(why) = unfit {
            say_once(why, effect.sql);
            return Sent::Redo(format!("the effect cannot go with the claim: {why}"));
        }
        if let Some(e) = effect.unencodable {
            return Sent::Redo(format!(
                "a parameter of the effect could not be encoded: {e}"
            ));
        }
        let failed = |e: sqlx::Error| {
            // A limit of the statement's own making (53400) goes the usual way, which counts it as the work's.
            if is_transient(&e) && db::sqlstate(&e).as_deref() != Some("53400") {
                Sent::Unavailable(e)
            } else {
                // A statement wrong for every message would be redone for every message: say it once.
                static SAID: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        statement = %crate::sanitize::text(effect.sql),
                        error = %crate::sanitize::text(&e.to_string()),
                        "a claim with its effect failed; the message went the usual way, which tells whose failure \
                         it was (said once; a statement that fails for every message costs each a second try)"
                    );
                }
                Sent::Redo(e.to_string())
            }
        };
        // The statement alone commits itself: inside a transaction left open it would commit nothing (`begin`
        // refuses such a connection on the other paths; this one has none).
        if sqlx::Connection::is_in_transaction(&*conn) {
            return Sent::Unavailable(sqlx::Error::Protocol(
                db::claim::LEFT_OPEN_BY_THE_WORK.to_owned(),
            ));
        }
        let started = std::time::Instant::now();
        let per_transaction = self.per_transaction();
        let claimed = if per_transaction.is_empty() {
            failpoint::hit("before-commit").await;
            db::claim::claim_with(conn, key, &self.consumer_type, effect.sql, effect.arguments)
                .await
        } else {
            let mut tx = match db::claim::begin(conn, &per_transaction).await {
                Ok(tx) => tx,
                Err(e) => return Sent::Unavailable(e),
            };
            let claimed = match db::claim::claim_with(
                &mut tx,
                key,
                &self.consumer_type,
                effect.sql,
                effect.arguments,
            )
            .await
            {
                Ok(claimed) => claimed,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return failed(e);
                }
            };
            failpoint::hit("before-commit").await;
            if let Err(e) = tx.commit().await {
                return match commit_error(e) {
                    ProcessError::Unavailable(e) => Sent::Unavailable(e),
                    other => Sent::Redo(other.to_string()),
                };
            }
            Ok(claimed)
        };
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) => return failed(e),
        };
        self.claim_took(started);
        if claimed {
            return Sent::Done(Outcome::Processed(()));
        }
        match db::claim::record_copy(conn, key, &self.consumer_type).await {
            Ok(first) => Sent::Done(
                conflict(first, key.fingerprint).map_or(Outcome::Duplicate, Outcome::Conflict),
            ),
            Err(e) => Sent::Unavailable(e),
        }
    }
}

/// Says once a process, for each reason, that effects go the usual way because of it.
fn say_once(why: &'static str, sql: &str) {
    static SAID: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
    if !said.contains(&why) {
        said.push(why);
        tracing::warn!(
            statement = %crate::sanitize::text(sql),
            "an effect statement cannot go with its claim: {why}; such messages go the usual way (said once)"
        );
    }
}
