//! Speaking to PostgreSQL through a transaction pooler (PgBouncer's `pool_mode = transaction`), and noticing one that
//! inboxctl was not told about.
//!
//! A transaction pooler hands each of its clients a server connection for one transaction at a time: between two
//! transactions, the next statement may go to another server connection, one that other clients used meanwhile.
//! Nothing of a session lasts: session settings, session advisory locks, and prepared statements. sqlx prepares every
//! statement as a named statement (`sqlx_s_N`, numbered per client connection) and sends it in two exchanges (parse and
//! describe, then bind and execute), so through a transaction pooler a statement may be bound on a server connection
//! where it was never prepared (SQLSTATE 26000), prepared where another client's statement of the same name exists
//! (42P05) — or executed where another client's `sqlx_s_N` is a different statement with the same parameter types:
//! another statement's effect, silently. Unnamed statements outside a transaction have the same fault (measured through
//! PgBouncer 1.18: 1,755 of 4,000 statements returned another client's result).
//!
//! So with `--transaction-pooling` ([`active`]), every statement of the store is unnamed ([`super::sql::query`]) and
//! runs inside a transaction: the caller's, or one of its own around the store function ([`super::Unit`]); inside a
//! transaction a client keeps its server connection. Nothing depends on a session setting (the claim sets its
//! `lock_timeout` with `SET LOCAL`, [`super::claim::begin`], and a consumer whose sessions have `synchronous_commit`
//! off makes every transaction set it to `local`, [`make_commits_durable`]), and cleanup's per-consumer_type lock is
//! a transaction-scoped one taken by each batch.
//!
//! Without the flag, [`check`] looks at connection start for what a pooler does and PostgreSQL never does: a session
//! setting gone at the session's next statement, or seen by another client's transaction. It refuses the command
//! then, with what to do ([`crate::Error::PoolerNotDeclared`]), as `db::diagnose` does with the errors a pooler causes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnection, Postgres};
use sqlx::{AssertSqlSafe, ConnectOptions as _, Connection as _, Row as _, Transaction};
use uuid::Uuid;

use super::Database;
use crate::error::{Error, Result};

statements! {
    /// The pooler probe's read of the setting its first session made: the token, while that session is the one
    /// reading (simple protocol, like every statement of the probe).
    const PROBE_READ = "SELECT current_setting('inboxctl.pooler_probe', true)";

    /// The `lock_timeout` of this session in milliseconds: the one `consume` gives at connection start, unless
    /// something between dropped it.
    const LOCK_TIMEOUT_SETTING = "SELECT setting FROM pg_settings WHERE name = 'lock_timeout'";
}

/// The probe's setting of a random token in its session (a token of hexadecimal digits: nothing to quote).
fn probe_set(token: &str) -> String {
    format!("SELECT set_config('inboxctl.pooler_probe', '{token}', false)")
}

/// The statements built around a value, each with a sample one, for [`super::statements`].
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    vec![("probe_set", probe_set("0123456789abcdef"))]
}

/// The statements of several commands, sent as simple queries, for [`super::statements`].
pub(super) fn built_simple_statements() -> Vec<(&'static str, String)> {
    vec![("durable_begin", durable_begin().to_owned())]
}

/// Whether this process speaks to PostgreSQL as through a transaction pooler: set for good by the first connection a
/// [`Database`] with `--transaction-pooling` opens. Process-wide because the store's statements are sent by functions
/// that are handed a connection and nothing else; the other way round it would only cost speed (unnamed statements
/// and their transactions, on a direct connection too), never correctness.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Whether the store's statements go unnamed, each in a transaction (see the module documentation).
pub fn active() -> bool {
    ACTIVE.load(Ordering::SeqCst)
}

/// From now on, this process speaks as through a transaction pooler.
pub(super) fn enable() {
    ACTIVE.store(true, Ordering::SeqCst);
}

/// Whether every transaction the store begins through the pooler sets `synchronous_commit = local` for itself: set for
/// good by a consumer that found its sessions' setting `off` ([`make_commits_durable`]).
static DURABLE: AtomicBool = AtomicBool::new(false);

/// Whether each transaction the store begins sets `synchronous_commit = local` for itself ([`begin`]).
pub fn durable_commits() -> bool {
    DURABLE.load(Ordering::SeqCst)
}

/// From now on, every transaction the store begins — a claim's, a store function's own ([`super::Unit`]), the
/// effects worker's — sets `synchronous_commit = local` for itself (`SET LOCAL`, in its `BEGIN`'s round trip): for a
/// consumer through a transaction pooler whose sessions have it `off`, where no session setting holds. A message is
/// acknowledged once its commit returns, and an external effect's lease must be on disk before its call goes out.
pub fn make_commits_durable() {
    DURABLE.store(true, Ordering::SeqCst);
}

/// `BEGIN` with `synchronous_commit = local` for the transaction alone, in one round trip.
fn durable_begin() -> &'static str {
    "BEGIN; SET LOCAL synchronous_commit = local"
}

/// Begins a transaction on `conn` the store's way: one whose commit is on this server's disk before it returns when
/// [`durable_commits`] says so, a plain one otherwise.
pub async fn begin(conn: &mut PgConnection) -> sqlx::Result<Transaction<'_, Postgres>> {
    if durable_commits() {
        conn.begin_with(AssertSqlSafe(durable_begin())).await
    } else {
        conn.begin().await
    }
}

/// How long the probe waits for its second connection's look: a pooler whose every server connection is busy would
/// make it wait, and the probe only tells, never holds a command up.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// How long the whole probe may take (two connections and four statements): a server that does not answer is met by
/// the command itself, not by the probe.
const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// Refuses a connection that goes through a pooler inboxctl was not told about (without `--transaction-pooling`):
/// [`Error::PoolerNotDeclared`] when the probe saw one, or when `consume`'s `lock_timeout` given at connection start did
/// not arrive. Once per process; anything that keeps the probe from telling (a connection refused, a statement
/// failing) lets the command go on, and is said at debug level.
pub(crate) async fn check(db: &Database) -> Result<()> {
    static CHECKED: AtomicBool = AtomicBool::new(false);
    if db.transaction_pooling() || CHECKED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    match tokio::time::timeout(PROBE_LIMIT, probe(db)).await {
        Ok(Ok(None)) => Ok(()),
        Ok(Ok(Some(reason))) => Err(Error::PoolerNotDeclared {
            url: db.display_url(),
            reason,
        }),
        Ok(Err(e)) => {
            tracing::debug!(error = %crate::redact::text(&super::describe(&e)), "pooler probe: cannot tell");
            Ok(())
        }
        Err(_) => {
            tracing::debug!("pooler probe: no answer in time, cannot tell");
            Ok(())
        }
    }
}

/// What a pooler did that PostgreSQL never does, if anything: one session sets a random token; a second connection's
/// transaction reads it (a pooler hands out the server connection released last, the first session's, to the next
/// transaction); then the first session reads its own token back. Then, if that told nothing, whether the first
/// session has the `lock_timeout` it was given at its start. Every statement goes by the simple protocol, which a
/// pooler forwards whole.
async fn probe(db: &Database) -> sqlx::Result<Option<String>> {
    let mut first = db.options().connect().await?;
    let token = Uuid::new_v4().simple().to_string();
    sqlx::raw_sql(AssertSqlSafe(probe_set(&token)))
        .execute(&mut first)
        .await?;
    // Bounded: a pooler with no server connection free (session pooling, a small pool) keeps the second one waiting.
    let shared = tokio::time::timeout(PROBE_WAIT, shared_out(db, &mut first, &token)).await;
    let verdict = match shared {
        Ok(verdict) => verdict?,
        Err(_) => None,
    };
    let verdict = match verdict {
        Some(verdict) => Some(verdict),
        None => lost_lock_timeout(db, &mut first).await?,
    };
    let _ = first.close().await;
    Ok(verdict)
}

/// Whether the session `first`, which set `token`, is shared out transaction by transaction: its token seen by
/// another connection's transaction, or gone at its own next statement.
async fn shared_out(
    db: &Database,
    first: &mut PgConnection,
    token: &str,
) -> sqlx::Result<Option<String>> {
    let mut second = db.options().connect().await?;
    let mut tx = second.begin().await?;
    let verdict = if read_probe(&mut tx).await?.as_deref() == Some(token) {
        Some(
            "another connection's transaction saw a setting of this session: sessions are shared out \
             transaction by transaction"
                .to_owned(),
        )
    } else if read_probe(first).await?.as_deref() != Some(token) {
        Some(
            "a setting this session made was gone at its next statement: its transactions go to other server \
             connections"
                .to_owned(),
        )
    } else {
        None
    };
    let _ = tx.rollback().await;
    let _ = second.close().await;
    Ok(verdict)
}

async fn read_probe(conn: &mut PgConnection) -> sqlx::Result<Option<String>> {
    sqlx::raw_sql(PROBE_READ).fetch_one(conn).await?.try_get(0)
}

/// Whether the `lock_timeout` `db` gives its sessions at their start was dropped on the way (PgBouncer, told to
/// ignore the startup parameter `options`, drops it): the claim would wait for another attempt without bound.
async fn lost_lock_timeout(db: &Database, conn: &mut PgConnection) -> sqlx::Result<Option<String>> {
    let Some(expected) = db.session_lock_timeout() else {
        return Ok(None);
    };
    let setting: String = sqlx::raw_sql(LOCK_TIMEOUT_SETTING)
        .fetch_one(conn)
        .await?
        .try_get(0)?;
    let expected = expected.as_millis().max(1).to_string();
    Ok((setting != expected).then(|| {
        format!(
            "the lock_timeout given at connection start ({expected} ms) did not arrive (the session has {setting} \
             ms): something between inboxctl and PostgreSQL drops the startup parameter `options`"
        )
    }))
}

/// Whether a server's error is one that only a pooler between inboxctl and PostgreSQL causes: a startup parameter
/// refused (PgBouncer refuses those it does not know), or a prepared statement of sqlx's missing, already there, or
/// not the one bound (inboxctl prepares nothing by name itself).
pub fn is_pooler_error(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(e) = error else {
        return false;
    };
    let message = e.message();
    match e.code().as_deref() {
        Some("26000" | "42P05") => true,
        Some("08P01") => {
            message.starts_with("unsupported startup parameter")
                || message.contains("prepared statement \"sqlx_s_")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probes_token_needs_no_quoting() {
        let token = Uuid::new_v4().simple().to_string();
        assert!(token.chars().all(|c| c.is_ascii_hexdigit()), "{token}");
        assert_eq!(probe_set(&token).matches('\'').count(), 4);
    }
}
