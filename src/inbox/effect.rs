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

/// A message's effect written as one statement that the inbox runs inside its claim's: `INSERT … SELECT … FROM
/// claimed` (or `UPDATE … FROM claimed`, `DELETE … USING claimed`), where `claimed` is a relation the claim makes with
/// one row when this delivery takes the message and none for a copy. **It must write only through `claimed`**: a
/// statement that writes without it writes for copies too. Its parameters are `$1`, `$2`, … in the order of
/// [`Effect::bind`]; give each one a cast (`$1::uuid`), as PostgreSQL cannot always infer a type in a select list.
///
/// A statement that does not name `claimed` at all cannot be one that writes only through it: it is never sent with
/// the claim; the message goes the usual way, and the inbox says so (once a process).
pub struct Effect {
    sql: &'static str,
    /// Whether `sql` names `claimed` (as a word): else it cannot be guarded by the claim.
    reads_claimed: bool,
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
            reads_claimed: names_claimed(sql),
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
    /// effect go to PostgreSQL as one statement, on its own its own transaction — one round trip where the usual way
    /// takes four (`BEGIN`, the claim, the work, `COMMIT`). A copy's claim takes no row, so its effect writes nothing;
    /// a copy of an attempt in flight waits for it in the claim, as the usual way does. Where each claim must bound
    /// its own wait (`with_claim_timeout`: connections through a transaction pooler), the statement runs between a
    /// `BEGIN` that sets the bound and a `COMMIT`.
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
        let result = match self.send_effect(&mut conn, &key, effect).await {
            Sent::Done(outcome) => Ok(outcome),
            Sent::Unavailable(e) => Err(ProcessError::Unavailable(e)),
            Sent::Redo(why) => {
                tracing::debug!(%message_id, error = %why, "the claim with its effect failed; done again the usual way");
                self.process_on(&mut conn, &key, work).await
            }
        };
        if matches!(result, Err(ProcessError::Unavailable(_))) {
            // As `process_carried`: a session that failed is never handed out again.
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
        if !effect.reads_claimed {
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    statement = %crate::sanitize::text(effect.sql),
                    "an effect statement that does not read `claimed` would write for copies too: such messages go \
                     the usual way (said once)"
                );
            }
            return Sent::Redo("the effect does not read `claimed`".to_owned());
        }
        if let Some(e) = effect.unencodable {
            return Sent::Redo(format!(
                "a parameter of the effect could not be encoded: {e}"
            ));
        }
        let failed = |e: sqlx::Error| {
            if is_transient(&e) {
                Sent::Unavailable(e)
            } else {
                Sent::Redo(e.to_string())
            }
        };
        let started = std::time::Instant::now();
        let claimed = match self.claim_timeout {
            None => {
                failpoint::hit("before-commit").await;
                db::claim::claim_with(conn, key, &self.consumer_type, effect.sql, effect.arguments)
                    .await
            }
            Some(timeout) => {
                let mut tx = match db::claim::begin(conn, Some(timeout)).await {
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
            }
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

/// Whether `sql` names `claimed` as a word (not inside `unclaimed` or `claimed_at`).
fn names_claimed(sql: &str) -> bool {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    sql.match_indices("claimed").any(|(at, found)| {
        let before = sql[..at].chars().next_back();
        let after = sql[at + found.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

#[cfg(test)]
mod tests {
    use super::names_claimed;

    #[test]
    fn an_effect_reads_claimed_only_where_it_names_it_as_a_word() {
        assert!(names_claimed("INSERT INTO t SELECT $1 FROM claimed"));
        assert!(names_claimed(
            "UPDATE t SET n = n + 1 FROM claimed WHERE t.id = $1"
        ));
        assert!(names_claimed("DELETE FROM t USING claimed WHERE t.id = $1"));
        assert!(!names_claimed("INSERT INTO t VALUES ($1)"));
        assert!(!names_claimed("INSERT INTO unclaimed SELECT $1"));
        assert!(!names_claimed("INSERT INTO t (claimed_at) VALUES (now())"));
    }
}
