//! The store: PostgreSQL. Connecting, telling an outage from a real error, and one module per area, each owning its
//! statements and the typed functions that bind and run them. Nothing outside `db` binds a parameter by position.
//!
//! Every statement is declared with `statements!`, which also lists it in [`statements`]: `tests/statements.rs`
//! prepares each of them against a freshly migrated database, and a unit test below checks that `src/db/` sends no
//! statement that is not declared that way.

/// Declares an area's statements (`const NAME = "SQL";`, doc comments allowed) and lists them in the area's
/// `STATEMENTS`, which [`statements`] gathers.
macro_rules! statements {
    ($($(#[$attr:meta])* $vis:vis const $name:ident = $sql:expr;)*) => {
        $($(#[$attr])* $vis const $name: &str = $sql;)*

        /// This area's statements, for [`crate::db::statements`].
        pub(super) const STATEMENTS: &[(&str, &str)] = &[$((stringify!($name), $name)),*];
    };
}

/// Runs a store function's statements (`$body`, a future, with `$conn` the `&mut PgConnection` to send them on) on a
/// connection from `$executor` (a pool, a connection or a transaction), inside a [`Unit`]: through a
/// transaction pooler, in a transaction of their own unless the connection is in one already. Returns `$body`'s
/// result.
macro_rules! unit {
    ($executor:expr, |$conn:ident| $body:expr) => {{
        let mut held = Into::<$crate::db::Exec<'_>>::into($executor)
            .connection()
            .await?;
        let mut unit = $crate::db::Unit::of(&mut held).await?;
        let result = {
            let $conn = unit.conn();
            $body.await
        };
        unit.end(result).await
    }};
}

/// Runs `statement` (written `bounded!(pool, limit, |conn| statement(conn, …))`) on a connection of `pool` taken for
/// it alone, within `limit`: past it, the connection is closed rather than given back — sqlx pings a connection on its
/// way back to the pool, with no bound of its own, so a connection that went silent would keep its pool slot until
/// the kernel's TCP timeout — and the result is [`no_answer`]. For statements that must not wait on a connection
/// that died without a word (a consumer's, `consume --attempt-timeout`).
macro_rules! bounded {
    ($pool:expr, $limit:expr, |$conn:ident| $statement:expr) => {
        async {
            let limit: std::time::Duration = $limit;
            let mut held = $pool.acquire().await?;
            let $conn = &mut *held;
            match tokio::time::timeout(limit, $statement).await {
                Ok(result) => result,
                Err(_) => {
                    held.close_on_drop();
                    Err($crate::db::no_answer(limit))
                }
            }
        }
    };
}
pub(crate) use bounded;

pub mod attempts;
pub mod audit;
pub mod claim;
pub mod cleanup;
pub mod effects;
mod errors;
pub mod events;
mod exec;
pub mod external;
pub mod grants;
pub mod partitions;
pub mod pooler;
pub mod schema;
pub mod sql;
pub mod stats;
pub mod triage;

use std::borrow::Cow;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::ConnectOptions as _;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use crate::error::{Error, Result};
use crate::{redact, secret};

pub use errors::{
    describe, diagnose, is_contention, is_no_answer, is_no_partition_for_now,
    is_poolers_idle_limit, is_transient, no_answer, no_partition_for_now, sqlstate,
};
pub use exec::Exec;
pub(crate) use exec::Unit;

/// How long a caller waits for a pooled connection before the wait counts as an outage.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// In a pool for messages ([`Database::message_pool`]), a connection used within this long is handed out without a
/// ping first. sqlx pings every idle connection on every acquire by default: a whole round trip before each message's
/// one statement, measured at about an eighth of an inbox message's CPU (consumer and PostgreSQL together,
/// `docs/performance.md`). A connection that died meanwhile fails its next statement instead, which the message path
/// takes as the database unavailable (retried, nothing acked) — as it must anyway, since a connection can die between
/// a ping and the statement after it.
const TRUSTED_WHILE_IDLE: Duration = Duration::from_secs(1);

/// When a pooled connection is pinged before it is handed out.
#[derive(Debug, Clone, Copy)]
enum Ping {
    /// Every time (sqlx's default): for commands whose every statement error ends them, or shows as an error.
    Always,
    /// Only after [`TRUSTED_WHILE_IDLE`]: for a consumer, whose every statement's failure is retried.
    WhenIdle,
}

/// The options every pool of inboxctl's shares: up to `size` connections, a bounded wait for one, and the ping.
fn pool_options(size: u32, ping: Ping) -> PgPoolOptions {
    let options = PgPoolOptions::new()
        .max_connections(size.max(1))
        .acquire_timeout(ACQUIRE_TIMEOUT);
    match ping {
        Ping::Always => options,
        Ping::WhenIdle => options
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > TRUSTED_WHILE_IDLE {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            }),
    }
}

/// Connection settings parsed from a `postgres://` URL, with inboxctl's own additions.
#[derive(Clone, Debug)]
pub struct Database {
    options: PgConnectOptions,
    url: String,
    /// Reached through a transaction pooler (`--transaction-pooling`): see [`pooler`].
    transaction_pooling: bool,
    /// The `lock_timeout` every session is given at its start ([`Database::with_lock_timeout`]).
    session_lock_timeout: Option<Duration>,
}

impl Database {
    /// Parses a database URL. The URL's password is registered for redaction before anything can print it.
    pub fn from_url(url: &str) -> Result<Self> {
        redact::register_url(url);
        if redact::password_parameter_holds_ampersand(url) {
            return Err(Error::Usage(format!(
                "the `password=` parameter of {} is followed by a part the PostgreSQL driver does not know as a \
                 parameter: if it is the password's (an '&' not percent-encoded, where the driver ends the password), \
                 write that '&' as %26; if not, leave it out",
                secret::DATABASE_URL.flag
            )));
        }
        // A client key's passphrase (`sslpassword=`) the driver does not take: left out of what it is given, or it
        // logs the value as it ignores it.
        let (for_driver, dropped) = redact::without_unused_password_parameters(url);
        if dropped {
            tracing::warn!(
                "ignoring the URL's sslpassword (or another parameter named for a password): the PostgreSQL driver \
                 takes no passphrase for a client key; give the key unencrypted"
            );
        }
        let options = PgConnectOptions::from_str(&for_driver)
            .map_err(|e| secret::invalid_url(secret::DATABASE_URL, url, &e.to_string()))?
            .application_name("inboxctl")
            // A statement that waits (a claim behind another attempt's, a migration behind an open transaction) is
            // said in inboxctl's words where it matters; the driver's own warning printed the statement's whole text
            // each time, at the default level. Kept for -vv.
            .log_slow_statements(log::LevelFilter::Info, Duration::from_secs(1));
        secret::warn_if_ambiguous(secret::DATABASE_URL, url);
        Ok(Self {
            options,
            url: url.to_owned(),
            transaction_pooling: false,
            session_lock_timeout: None,
        })
    }

    /// The same database, reached through a transaction pooler (`--transaction-pooling`) or not. Through one, the
    /// connections send no startup parameter a pooler refuses (`extra_float_digits`, `options`), every statement of the
    /// store goes unnamed and inside a transaction, and `migrate` is refused (see [`pooler`]).
    pub fn with_transaction_pooling(&self, on: bool) -> Self {
        let mut db = self.clone();
        db.transaction_pooling = on;
        if on {
            db.options = db.options.extra_float_digits(None);
        }
        db
    }

    /// Whether the database is reached through a transaction pooler (`--transaction-pooling`).
    pub fn transaction_pooling(&self) -> bool {
        self.transaction_pooling
    }

    /// The `lock_timeout` given to every session at its start, if any ([`Database::with_lock_timeout`]).
    pub fn session_lock_timeout(&self) -> Option<Duration> {
        self.session_lock_timeout
    }

    /// A database URL, with the password read from `password_file` if given (`--database-password-file`).
    pub fn new(url: &str, password_file: Option<&Path>) -> Result<Self> {
        let mut db = Self::from_url(url)?;
        if let Some(path) = password_file {
            let password = secret::read_password_file("--database-password-file", path)?;
            if redact::has_password(url) {
                return Err(secret::given_twice(
                    "--database-url",
                    "--database-password-file",
                ));
            }
            db.options = db.options.password(&password);
            db.url = secret::url_with_password(&db.url, db.options.get_username(), &password);
        }
        Ok(db)
    }

    /// The URL with its password masked, for messages.
    pub fn display_url(&self) -> String {
        redact::url(&self.url)
    }

    /// The database name the URL names (PostgreSQL's default is the user's name).
    pub fn name(&self) -> String {
        self.options
            .get_database()
            .map(str::to_owned)
            .unwrap_or_else(|| self.options.get_username().to_owned())
    }

    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// The same server and credentials, another database.
    pub fn with_database(&self, name: &str) -> Self {
        let url = match url::Url::parse(&self.url) {
            Ok(mut u) => {
                u.set_path(&format!("/{name}"));
                u.to_string()
            }
            Err(_) => self.url.clone(),
        };
        Self {
            options: self.options.clone().database(name),
            url,
            ..self.clone()
        }
    }

    /// The URL as given, password included: only for handing to a child process, never for printing.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Bounds how long any statement waits for a row lock; a claim that waits longer gives up and is retried later.
    /// Set for the session at its start (the startup parameter `options`); through a transaction pooler, which keeps
    /// no session setting, not at all: the claim sets it in each of its transactions
    /// ([`Database::lock_timeout_per_transaction`]).
    pub fn with_lock_timeout(&self, timeout: Duration) -> Self {
        if self.transaction_pooling {
            return self.clone();
        }
        let millis = timeout.as_millis().max(1).to_string();
        Self {
            options: self
                .options
                .clone()
                .options([("lock_timeout", millis.as_str())]),
            session_lock_timeout: Some(timeout),
            ..self.clone()
        }
    }

    /// Ends, on the server, a session that sits inside a transaction without sending anything for longer than
    /// `timeout` (`idle_in_transaction_session_timeout`): a consumer whose connection died without a word (a host
    /// lost, a network cut) leaves its transaction open on the server, holding its claims' row locks, until the
    /// server's TCP keepalive notices, hours later by default; with this, the server rolls it back and the copies
    /// waiting on those keys proceed. A consumer's attempt never pauses inside its transaction for that long: it gives
    /// up first (`Inbox::with_attempt_timeout`). Set for the session at its start, as `with_lock_timeout`; through a
    /// transaction pooler, not at all.
    pub fn with_idle_in_transaction_timeout(&self, timeout: Duration) -> Self {
        self.with_session_timeout("idle_in_transaction_session_timeout", timeout)
    }

    /// Ends, on the server, any statement of the session that runs (or waits for a lock) longer than `timeout`
    /// (`statement_timeout`): for a dashboard, which gives up on a refresh that takes too long — a statement it stops
    /// waiting for would otherwise go on, on the server, holding its connection and queued behind whatever lock held
    /// it. Set for the session at its start, as `with_lock_timeout`; through a transaction pooler, not at all.
    pub fn with_statement_timeout(&self, timeout: Duration) -> Self {
        self.with_session_timeout("statement_timeout", timeout)
    }

    /// Commits that return only once they are on this server's disk (`synchronous_commit = local`: no wait for a
    /// synchronous standby), for every session from its start, whatever the server, the database or the role set;
    /// through a transaction pooler, not at all.
    pub fn with_durable_commits(&self) -> Self {
        if self.transaction_pooling {
            return self.clone();
        }
        Self {
            options: self
                .options
                .clone()
                .options([("synchronous_commit", "local")]),
            ..self.clone()
        }
    }

    /// The session setting `name` (a timeout in milliseconds) given at each session's start; through a transaction
    /// pooler, where no session lasts, not at all.
    fn with_session_timeout(&self, name: &str, timeout: Duration) -> Self {
        if self.transaction_pooling {
            return self.clone();
        }
        // At most what the setting holds (2^31 − 1 ms, about 24 days): a longer bound is none at all in practice.
        let most = u128::from(i32::MAX.unsigned_abs());
        let millis = timeout.as_millis().clamp(1, most).to_string();
        Self {
            options: self.options.clone().options([(name, millis.as_str())]),
            ..self.clone()
        }
    }

    /// `timeout`, for a claim transaction to set for itself, where it cannot be the session's
    /// ([`Database::with_lock_timeout`]): through a transaction pooler. `None` elsewhere.
    pub fn lock_timeout_per_transaction(&self, timeout: Duration) -> Option<Duration> {
        self.transaction_pooling.then_some(timeout)
    }

    /// One connection, now. Fails with [`Error::DatabaseUnavailable`] when the server cannot be reached.
    pub async fn connect(&self) -> Result<PgConnection> {
        let conn = self.connect_only().await?;
        self.opened().await?;
        Ok(conn)
    }

    /// [`Database::connect`] without what follows a first connection.
    async fn connect_only(&self) -> Result<PgConnection> {
        self.options
            .connect()
            .await
            .map_err(|e| self.unavailable(e))
    }

    /// After a first connection: through a declared transaction pooler, this process speaks as through one from now
    /// on; without the flag, refuses an undeclared one ([`pooler::check`], once per process).
    async fn opened(&self) -> Result<()> {
        if self.transaction_pooling {
            pooler::enable();
            Ok(())
        } else {
            pooler::check(self).await
        }
    }

    /// Refuses a database reached through a transaction pooler without `--transaction-pooling` ([`pooler::check`]), for
    /// a command that opens its pool lazily: an unreachable database lets it go on.
    pub async fn check_pooler(&self) -> Result<()> {
        self.opened().await
    }

    /// A pool of up to `size` connections, with one connection opened at once so a bad URL or a down server is
    /// reported at start rather than at the first message.
    pub async fn pool(&self, size: u32) -> Result<PgPool> {
        self.open_pool(size, Ping::Always).await
    }

    /// [`Database::pool`] for a consumer's messages: a connection used within the last second is handed out without a
    /// ping (a round trip a message saved). One that died meanwhile fails its next statement, which the caller must
    /// take as the database unavailable and try again — as the inbox and the consumer do.
    pub async fn message_pool(&self, size: u32) -> Result<PgPool> {
        self.open_pool(size, Ping::WhenIdle).await
    }

    async fn open_pool(&self, size: u32, ping: Ping) -> Result<PgPool> {
        match pool_options(size, ping)
            .min_connections(0)
            .connect_with(self.options.clone())
            .await
        {
            Ok(pool) => {
                if let Err(e) = self.opened().await {
                    pool.close().await;
                    return Err(e);
                }
                Ok(pool)
            }
            // The pool retries a failing connect until its timeout and then only says that it timed out (a role or
            // database at its CONNECTION LIMIT, a server refusing connections): one direct attempt names the cause.
            Err(sqlx::Error::PoolTimedOut) => match self.connect_only().await {
                Err(cause) => Err(cause),
                Ok(conn) => {
                    let _ = sqlx::Connection::close(conn).await;
                    Err(self.unavailable(sqlx::Error::PoolTimedOut))
                }
            },
            Err(e) => Err(self.unavailable(e)),
        }
    }

    /// A pool that connects on first use (and again after an outage), for callers that must start regardless (and call
    /// [`Database::check_pooler`] themselves).
    pub fn lazy_pool(&self, size: u32) -> PgPool {
        if self.transaction_pooling {
            pooler::enable();
        }
        pool_options(size, Ping::Always).connect_lazy_with(self.options.clone())
    }

    /// A failure to connect or to run a statement, as the policy sees it (see [`diagnose`]).
    pub(crate) fn unavailable(&self, source: sqlx::Error) -> Error {
        diagnose(source, Some(self))
    }
}

statements! {
    /// Whether the server answers (`/health`).
    const PING = "SELECT 1";

    /// The server's version as a number (`150020` for 15.20).
    const SERVER_VERSION = "SELECT current_setting('server_version_num')::int4";

    /// The session's `synchronous_commit`: what the server, the database and the role made of it.
    const SYNCHRONOUS_COMMIT = "SELECT current_setting('synchronous_commit')";
}

/// The server's version as a number (`SERVER_VERSION`): `150020` for 15.20.
pub async fn server_version(executor: impl Into<Exec<'_>>) -> sqlx::Result<i32> {
    unit!(executor, |conn| sql::query_scalar(SERVER_VERSION)
        .fetch_one(conn))
}

/// The session's `synchronous_commit` (`SYNCHRONOUS_COMMIT`): `off` when a commit may return before it is on disk.
pub async fn synchronous_commit(executor: impl Into<Exec<'_>>) -> sqlx::Result<String> {
    unit!(executor, |conn| sql::query_scalar(SYNCHRONOUS_COMMIT)
        .fetch_one(conn))
}

/// Whether the server answers `SELECT 1` within `limit`, a connection to wait for included. A connection that took
/// the statement and never answered is dropped at once, neither given back nor closed politely: sqlx pings a
/// connection on its way back to the pool with no bound of its own, so a silent one would hold its pool slot until
/// the kernel's TCP timeout, and a polite close holds it up to five seconds more; every check meanwhile would find
/// the pool full and report the database down.
pub async fn answers_within(pool: &PgPool, limit: std::time::Duration) -> bool {
    let started = tokio::time::Instant::now();
    let Ok(Ok(mut held)) = tokio::time::timeout(limit, pool.acquire()).await else {
        return false;
    };
    let left = limit.saturating_sub(started.elapsed());
    match tokio::time::timeout(left, sql::query_scalar::<i32>(PING).fetch_one(&mut *held)).await {
        Ok(answer) => matches!(answer, Ok(1)),
        Err(_) => {
            drop(held.detach());
            false
        }
    }
}

/// One statement of the store, by area and name.
#[derive(Debug, Clone)]
pub struct Statement {
    /// `area::NAME`, e.g. `claim::CLAIM`.
    pub name: String,
    pub sql: Cow<'static, str>,
    /// Sent as a simple query, several commands in one (the claim's `BEGIN; SET LOCAL …`): it cannot be prepared.
    pub simple_query: bool,
}

/// Every statement the store sends, those built around an identifier with a sample one: what `tests/statements.rs`
/// prepares against a freshly migrated database.
pub fn statements() -> Vec<Statement> {
    let areas: [(&str, &[(&str, &str)]); 18] = [
        ("db", STATEMENTS),
        ("attempts", attempts::STATEMENTS),
        ("audit", audit::STATEMENTS),
        ("claim", claim::STATEMENTS),
        ("cleanup", cleanup::STATEMENTS),
        ("effects", effects::STATEMENTS),
        ("events", events::STATEMENTS),
        ("external", external::STATEMENTS),
        ("grants", grants::STATEMENTS),
        ("partitions", partitions::STATEMENTS),
        ("partitions", partitions::CONVERT_STATEMENTS),
        ("partitions", partitions::DROP_STATEMENTS),
        ("partitions", partitions::REFUSAL_STATEMENTS),
        ("pooler", pooler::STATEMENTS),
        ("schema", schema::STATEMENTS),
        ("schema", schema::INBOX_STATEMENTS),
        ("stats", stats::STATEMENTS),
        ("triage", triage::STATEMENTS),
    ];
    let fixed = areas.into_iter().flat_map(|(area, statements)| {
        statements.iter().map(move |(name, sql)| Statement {
            name: format!("{area}::{name}"),
            sql: Cow::Borrowed(*sql),
            simple_query: false,
        })
    });
    let built = [
        ("schema", schema::built_statements(), false),
        ("pooler", pooler::built_statements(), false),
        ("pooler", pooler::built_simple_statements(), true),
        ("partitions", partitions::built_statements(), false),
        ("claim", claim::built_statements(), true),
        ("claim", claim::built_with_effect(), false),
        ("effects", effects::built_statements(), false),
    ]
    .into_iter()
    .flat_map(|(area, statements, simple_query)| {
        statements.into_iter().map(move |(name, sql)| Statement {
            name: format!("{area}::{name}"),
            sql: Cow::Owned(sql),
            simple_query,
        })
    });
    fixed.chain(built).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_name_comes_from_the_url() {
        let db = Database::from_url("postgres://postgres@127.0.0.1:5432/parceltracker")
            .expect("valid url");
        assert_eq!(db.name(), "parceltracker");
        assert_eq!(db.with_database("postgres").name(), "postgres");
    }

    #[test]
    fn a_bad_url_is_a_usage_error_without_the_password() {
        let err =
            Database::from_url("postgres://u:topsecretpw@host:notaport/db").expect_err("invalid");
        let text = err.to_string();
        assert!(matches!(err, Error::Usage(_)), "{text}");
        assert!(!text.contains("topsecretpw"), "{text}");
    }

    /// The driver would cut the password at the `&` and log the rest as a parameter it ignores.
    #[test]
    fn a_password_parameter_with_a_bare_ampersand_is_refused_without_it() {
        let err =
            Database::from_url("postgres://app@db/parcels?password=Tr0ub&4dorX&sslmode=disable")
                .expect_err("refused");
        let text = err.to_string();
        assert!(matches!(err, Error::Usage(_)), "{text}");
        assert!(text.contains("%26") && !text.contains("4dorX"), "{text}");
        Database::from_url("postgres://app@db/parcels?password=Tr0ub%264dorX&sslmode=disable")
            .expect("encoded");
    }
}
