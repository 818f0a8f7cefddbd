//! The schema: applying inboxctl's migrations, and checking an `inbox_messages` table someone else created.

use std::collections::HashSet;

use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection as _};

use super::Database;
use super::sql::{self, quote_ident};
use crate::error::{Error, Result};

mod inbox;
pub use inbox::{inbox_columns, inbox_differences, inbox_primary_key};
/// The adopted inbox's checks' statements, for [`super::statements`].
pub(super) const INBOX_STATEMENTS: &[(&str, &str)] = inbox::STATEMENTS;

statements! {
    /// Whether a relation is visible on the search path. `$1` name.
    const TABLE_EXISTS = "SELECT to_regclass($1) IS NOT NULL";

    /// The versions recorded as applied by inboxctl's migrations.
    const APPLIED_MIGRATIONS =
    "SELECT version FROM inboxctl_migrations WHERE success ORDER BY version";

    /// Serialises `migrate` runs against one database: one applies, the others wait and then find nothing to do.
    /// Taken with a try in a loop, not a blocking wait: a session blocked in a statement holds a snapshot, and
    /// `CREATE INDEX CONCURRENTLY` in the other run would wait for that snapshot while it waits for the lock.
    const MIGRATE_TRY_LOCK = "SELECT pg_try_advisory_lock($1)";
    const MIGRATE_UNLOCK = "SELECT pg_advisory_unlock($1)";

    /// Indexes of inboxctl's tables left invalid by an interrupted `CREATE INDEX CONCURRENTLY`. `$1` index names.
    const INVALID_INBOX_INDEXES = "\
SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid IN (to_regclass('inbox_messages'), to_regclass('inboxctl_effects'), to_regclass('inboxctl_events'),
                     to_regclass('carrier_reservations'), to_regclass('notifications_sent'))
  AND NOT i.indisvalid
  AND c.relname = ANY($1)";

    /// The unprocessed rows' index of the first migration, built without blocking writes, for an adopted inbox that
    /// lacks it (under another name, or none): the migration's own `CREATE INDEX` would hold the table against every
    /// claim for as long as it builds on every row.
    const BUILD_UNPROCESSED_INDEX = "\
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inbox_messages_unprocessed ON inbox_messages (received_at)
WHERE processed_at IS NULL";

    /// The server looks whether the client is still there every second while a statement runs (PostgreSQL 14+).
    const CHECK_CLIENT_CONNECTION = "SET client_connection_check_interval = '1s'";

    /// No bound on one statement for the session: a `statement_timeout` of the role's or the database's would cancel
    /// an index build on a large adopted inbox, every run, each leaving it invalid to build again (as `pg_dump` does).
    const NO_STATEMENT_TIMEOUT = "SET statement_timeout = 0";

    /// [`ADOPT_LOCK_TIMEOUT`], for the session, and back.
    const SET_ADOPT_LOCK_TIMEOUT = "SET lock_timeout = '2s'";
    const RESET_LOCK_TIMEOUT = "RESET lock_timeout";

    /// The sessions holding a lock on `inbox_messages` that a `SHARE` lock waits for, each as `pid N (state, its
    /// transaction open for Ns)`.
    const INBOX_WRITE_HOLDERS = "\
SELECT format('pid %s (%s, its transaction open for %ss)', a.pid, a.state,
              floor(extract(epoch FROM now() - a.xact_start))::bigint)
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.relation = to_regclass('inbox_messages') AND l.granted
  AND l.mode IN ('RowExclusiveLock', 'ShareUpdateExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock',
                 'AccessExclusiveLock')
  AND l.pid <> pg_backend_pid()
ORDER BY a.xact_start
LIMIT 5";

    /// Whether `inbox_messages` is a plain table (not partitioned, where no index is built concurrently).
    const INBOX_IS_PLAIN = "SELECT relkind = 'r' FROM pg_class WHERE oid = to_regclass('inbox_messages')";

    /// Whether a database exists. `$1` name.
    const DATABASE_EXISTS = "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)";
}

/// `DROP INDEX CONCURRENTLY` of an index name known to inboxctl (never one taken from input).
fn drop_index_concurrently(name: &str) -> String {
    format!("DROP INDEX CONCURRENTLY IF EXISTS {}", quote_ident(name))
}

/// `CREATE DATABASE` cannot take its name as a parameter; the name is quoted as an identifier instead.
fn create_database_statement(name: &str) -> String {
    format!("CREATE DATABASE {}", quote_ident(name))
}

/// The statements built around an identifier, each with a sample one, for [`super::statements`].
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    vec![
        (
            "drop_index_concurrently",
            drop_index_concurrently(CONCURRENT_INDEXES[0]),
        ),
        (
            "create_database_statement",
            create_database_statement("inboxctl sample"),
        ),
    ]
}

/// The table that records inboxctl's applied migrations; its own, so that a service's sqlx migrations in the same
/// database are never confused with ours.
pub const MIGRATIONS_TABLE: &str = "inboxctl_migrations";

/// Key of the advisory lock that serialises `migrate` runs on one database.
const MIGRATE_LOCK_KEY: i64 = 0x696e_626f_7863_746c; // "inboxctl"

/// Indexes our migrations build with `CREATE INDEX CONCURRENTLY`; an interrupted build leaves one invalid, and
/// `IF NOT EXISTS` would then keep the useless leftover, so `migrate` drops it first.
const CONCURRENT_INDEXES: [&str; 7] = [
    "ix_inbox_messages_consumer_type_processed_at",
    "ix_inbox_messages_unprocessed_by_consumer_type",
    "ix_inboxctl_effects_owed",
    "ix_inboxctl_events_failures",
    "ix_inboxctl_effects_unsettled",
    "ix_carrier_reservations_message_id",
    "ix_notifications_sent_message_id",
];

/// The migration that builds the index of calls done (inside its transaction, not concurrently), and the index.
const EFFECTS_DONE_INDEX: (i64, &str) = (20261203000012, "ix_inboxctl_effects_done");

/// The migrations in `migrations/`, embedded in the binary.
pub fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!();
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    // `migrate` takes its own lock around the compatibility check and the run together.
    migrator.set_locking(false);
    migrator
}

/// One migration, as reported to the user.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MigrationInfo {
    pub version: i64,
    pub description: String,
    /// Runs outside a transaction (e.g. `CREATE INDEX CONCURRENTLY`).
    pub no_transaction: bool,
    #[serde(skip)]
    pub sql: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct MigrateReport {
    pub database: String,
    /// The database did not exist and was created (or, with `dry_run`, would be).
    pub database_created: bool,
    /// An `inbox_messages` table that inboxctl did not create was found compatible and kept as it is.
    pub adopted_existing_inbox: bool,
    /// Applied by this run (or, with `dry_run`, pending).
    pub migrations: Vec<MigrationInfo>,
    pub dry_run: bool,
    /// `--partitioned`: what was done to partition the inbox (with `dry_run`: nothing yet; the settings only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitioning: Option<super::partitions::PartitionReport>,
}

/// Creates the database if needed and applies the pending migrations; with `dry_run`, reports what that would do and
/// changes nothing. An incompatible `inbox_messages` stops it before anything is changed.
pub async fn migrate(db: &Database, dry_run: bool) -> Result<MigrateReport> {
    migrate_partitioned(db, dry_run, None).await
}

/// [`migrate`], and then, with `partitioning`, the inbox partitioned with those settings (see
/// [`super::partitions::partition`]).
pub async fn migrate_partitioned(
    db: &Database,
    dry_run: bool,
    partitioning: Option<super::partitions::Settings>,
) -> Result<MigrateReport> {
    migrate_with(db, dry_run, partitioning, None, false).await
}

/// [`migrate_partitioned`]; `partition_back`: how far back a conversion makes partitions (default
/// [`super::partitions::BACK`]); with `new_inbox`, a new inbox is made even where another schema of the database holds
/// an `inbox_messages` the search path does not reach (otherwise refused: it may be the one a service uses).
pub async fn migrate_with(
    db: &Database,
    dry_run: bool,
    partitioning: Option<super::partitions::Settings>,
    partition_back: Option<chrono::TimeDelta>,
    new_inbox: bool,
) -> Result<MigrateReport> {
    if let Some(settings) = partitioning {
        super::partitions::check_back(settings, partition_back.unwrap_or(super::partitions::BACK))?;
    }
    if db.transaction_pooling() {
        return Err(Error::Usage(
            "migrate needs a session of its own, which a transaction pooler does not keep: it holds an advisory lock \
             from its first statement to its last, and builds indexes with CREATE INDEX CONCURRENTLY outside any \
             transaction; run it against PostgreSQL itself (a --database-url that does not go through the pooler), \
             without --transaction-pooling"
                .to_owned(),
        ));
    }
    let database = db.name();
    let exists = database_exists(db, &database).await?;
    let migrator = migrator();

    if !exists && dry_run {
        return Ok(MigrateReport {
            database,
            database_created: true,
            adopted_existing_inbox: false,
            migrations: migrator.iter().map(info).collect(),
            dry_run,
            partitioning: partitioning.map(planned),
        });
    }
    let created = !exists && create_database(db, &database).await?;

    let mut conn = db.connect().await?;
    // A migrate stopped by a signal closes its connection mid-statement; PostgreSQL 14 and later then end the statement
    // within a second (an index build, holding the migrate lock, would otherwise run on to its end). Older servers
    // know no such setting, and run it to its end.
    let _ = sql::query(CHECK_CLIENT_CONNECTION).execute(&mut conn).await;
    sql::query(NO_STATEMENT_TIMEOUT).execute(&mut conn).await?;
    let mut waiting = false;
    while !sql::query_scalar::<bool>(MIGRATE_TRY_LOCK)
        .bind(MIGRATE_LOCK_KEY)
        .fetch_one(&mut conn)
        .await?
    {
        if !waiting {
            tracing::info!(database = %database, "another migrate is running; waiting for it");
            waiting = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let ready = match partitioning {
        Some(_) => super::partitions::require_server(&mut conn).await,
        None => Ok(()),
    };
    let result = match ready {
        Err(e) => Err(e),
        Ok(()) => migrate_locked(&mut conn, &migrator, &database, dry_run, new_inbox).await,
    };
    let result = match result {
        Ok(mut report) => match partitioning {
            Some(settings) if dry_run => {
                report.partitioning = Some(planned(settings));
                Ok(report)
            }
            Some(settings) => {
                super::partitions::partition(&mut conn, settings, partition_back, &database)
                    .await
                    .map(|done| {
                        report.partitioning = Some(done);
                        report
                    })
            }
            None => Ok(report),
        },
        Err(e) => Err(e),
    };
    // The lock is released with the connection too; unlocking explicitly just frees it sooner.
    let _ = sql::query(MIGRATE_UNLOCK)
        .bind(MIGRATE_LOCK_KEY)
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    let mut report = result?;
    report.database_created = created;
    Ok(report)
}

async fn migrate_locked(
    conn: &mut PgConnection,
    migrator: &Migrator,
    database: &str,
    dry_run: bool,
    new_inbox: bool,
) -> Result<MigrateReport> {
    let applied = applied_versions(conn).await?;
    let inbox_exists = table_exists(conn, "inbox_messages").await?;
    inbox::check_place(conn, database, inbox_exists, new_inbox).await?;
    let adopted_existing_inbox = inbox_exists && !applied.contains(&first_version(migrator));
    if inbox_exists {
        let differences = inbox_differences(conn).await?;
        if !differences.is_empty() {
            return Err(Error::SchemaIncompatible {
                database: database.to_owned(),
                differences,
            });
        }
    }

    let pending: Vec<MigrationInfo> = migrator
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(info)
        .collect();
    if !dry_run && !pending.is_empty() {
        drop_invalid_indexes(conn, &pending).await?;
        if adopted_existing_inbox {
            build_unprocessed_index(conn).await?;
            adopt(conn, migrator).await?;
        }
        migrator
            .run_direct(None, conn, false)
            .await
            .map_err(migrate_error)?;
    }
    Ok(MigrateReport {
        database: database.to_owned(),
        database_created: false,
        adopted_existing_inbox,
        migrations: pending,
        dry_run,
        partitioning: None,
    })
}

/// The first migration on an adopted inbox, its lock waited for a moment at a time. Its statements find the table
/// and its index there and change nothing, but `CREATE INDEX IF NOT EXISTS` takes the table's SHARE lock before it
/// looks: it waits for every write transaction open on the table (a .NET service's, a claim's), and every write
/// begun meanwhile waits behind it — all of them, for as long as the longest open transaction lasts (one left idle:
/// for ever). Each wait ends after [`ADOPT_LOCK_TIMEOUT`], and the next is tried after a pause that lets the writes
/// through; while a transaction holds the table, migrate waits (as it waits for another migrate), saying which.
async fn adopt(conn: &mut PgConnection, migrator: &Migrator) -> Result<()> {
    sql::query(SET_ADOPT_LOCK_TIMEOUT)
        .execute(&mut *conn)
        .await?;
    let started = std::time::Instant::now();
    let mut said = None::<std::time::Instant>;
    let adopted = loop {
        match migrator
            .run_direct(Some(first_version(migrator)), &mut *conn, false)
            .await
        {
            Err(sqlx::migrate::MigrateError::ExecuteMigration(e, _))
                if super::sqlstate(&e).as_deref() == Some("55P03") =>
            {
                if said.is_none_or(|at| at.elapsed() >= ADOPT_SAY_EVERY) {
                    said = Some(std::time::Instant::now());
                    let holders: Vec<String> = sql::query_scalar(INBOX_WRITE_HOLDERS)
                        .fetch_all(&mut *conn)
                        .await
                        .unwrap_or_default();
                    tracing::warn!(
                        waited_s = started.elapsed().as_secs(),
                        holders = %crate::sanitize::text(&holders.join(", ")),
                        "inbox_messages is held by transactions still open; waiting for a moment when none is, \
                         holding the writes back at most {}ms at a time",
                        ADOPT_LOCK_TIMEOUT.as_millis()
                    );
                }
                tokio::time::sleep(ADOPT_PAUSE).await;
            }
            other => break other,
        }
    };
    sql::query(RESET_LOCK_TIMEOUT).execute(&mut *conn).await?;
    adopted.map_err(migrate_error)
}

/// A statement of a migration the server refused: the same policy as any statement (a privilege missing is exit 77
/// and names the grant).
fn migrate_error(error: sqlx::migrate::MigrateError) -> Error {
    match error {
        sqlx::migrate::MigrateError::Execute(e)
        | sqlx::migrate::MigrateError::ExecuteMigration(e, _) => Error::from(e),
        other => Error::Migrate(other),
    }
}

/// How long the adopting migration waits for the table's lock at a time ([`adopt`]), and the pause between. Above
/// the server's `deadlock_timeout` (1 s by default), after which a lock request blocked by an autovacuum cancels it:
/// at or below it, the request timed out first, and migrate waited out the whole vacuum, holding the writes back a
/// second in every one and a half.
const ADOPT_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
const ADOPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);
/// How often a migrate kept waiting by open transactions says so.
const ADOPT_SAY_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// What a dry run says of `--partitioned`: the settings, nothing done.
fn planned(settings: super::partitions::Settings) -> super::partitions::PartitionReport {
    super::partitions::PartitionReport {
        settings: Some(settings),
        ..Default::default()
    }
}

/// The first migration's index on an adopted plain table, built concurrently ([`BUILD_UNPROCESSED_INDEX`]); one left
/// invalid by an interrupted build of this is dropped first. Only here: elsewhere an invalid index of that name is
/// nobody's to drop, since no later run would build it again.
async fn build_unprocessed_index(conn: &mut PgConnection) -> Result<()> {
    let plain: Option<bool> = sql::query_scalar(INBOX_IS_PLAIN)
        .fetch_optional(&mut *conn)
        .await?;
    if plain != Some(true) {
        return Ok(());
    }
    const NAME: &str = "ix_inbox_messages_unprocessed";
    let invalid: Vec<String> = sql::query_scalar(INVALID_INBOX_INDEXES)
        .bind(&[NAME][..])
        .fetch_all(&mut *conn)
        .await?;
    if !invalid.is_empty() {
        tracing::warn!(
            index = NAME,
            "dropping an invalid index left by an interrupted build"
        );
        sql::query(AssertSqlSafe(drop_index_concurrently(NAME)))
            .execute(&mut *conn)
            .await?;
    }
    sql::query(BUILD_UNPROCESSED_INDEX)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn drop_invalid_indexes(conn: &mut PgConnection, pending: &[MigrationInfo]) -> Result<()> {
    let mut names = CONCURRENT_INDEXES.to_vec();
    // Built by the operator beforehand, concurrently, as commands.md suggests for a large table: cut short, it is left
    // invalid, and the migration's `IF NOT EXISTS` would take it for built. Only while that migration is to run,
    // which builds it again.
    if pending.iter().any(|m| m.version == EFFECTS_DONE_INDEX.0) {
        names.push(EFFECTS_DONE_INDEX.1);
    }
    let invalid: Vec<String> = sql::query_scalar(INVALID_INBOX_INDEXES)
        .bind(&names[..])
        .fetch_all(&mut *conn)
        .await?;
    for name in invalid {
        tracing::warn!(index = %name, "dropping an invalid index left by an interrupted build");
        sql::query(AssertSqlSafe(drop_index_concurrently(&name)))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

fn first_version(migrator: &Migrator) -> i64 {
    migrator.iter().map(|m| m.version).min().unwrap_or_default()
}

fn info(m: &sqlx::migrate::Migration) -> MigrationInfo {
    MigrationInfo {
        version: m.version,
        description: m.description.to_string(),
        no_transaction: m.no_tx,
        sql: m.sql.as_str().to_owned(),
    }
}

async fn applied_versions(conn: &mut PgConnection) -> Result<HashSet<i64>> {
    if !table_exists(conn, MIGRATIONS_TABLE).await? {
        return Ok(HashSet::new());
    }
    let versions: Vec<i64> = sql::query_scalar(APPLIED_MIGRATIONS)
        .fetch_all(&mut *conn)
        .await?;
    Ok(versions.into_iter().collect())
}

pub async fn table_exists(conn: &mut PgConnection, name: &str) -> Result<bool> {
    Ok(unit!(&mut *conn, |conn| sql::query_scalar(TABLE_EXISTS)
        .bind(name)
        .fetch_one(conn))?)
}

/// Refuses a database that lacks any of `tables` (one `migrate` has not prepared, or one from before a table was
/// added): [`Error::SchemaMissing`], which says to run `migrate`.
pub async fn require_tables(pool: &sqlx::PgPool, db: &Database, tables: &[&str]) -> Result<()> {
    let mut conn = pool.acquire().await.map_err(|e| db.unavailable(e))?;
    for table in tables {
        if !table_exists(&mut conn, table).await? {
            return Err(Error::SchemaMissing {
                database: Some(db.name()),
                table: Some((*table).to_owned()),
            });
        }
    }
    Ok(())
}

async fn database_exists(db: &Database, name: &str) -> Result<bool> {
    match db.connect().await {
        Ok(conn) => {
            let _ = conn.close().await;
            Ok(true)
        }
        Err(Error::DatabaseMissing { .. }) => {
            let mut admin = maintenance_connection(db).await?;
            let exists = sql::query_scalar(DATABASE_EXISTS)
                .bind(name)
                .fetch_one(&mut admin)
                .await?;
            let _ = admin.close().await;
            Ok(exists)
        }
        Err(e) => Err(e),
    }
}

/// Creates the database; `false` when another `migrate` created it first.
async fn create_database(db: &Database, name: &str) -> Result<bool> {
    let mut admin = maintenance_connection(db).await?;
    let created = sql::query(AssertSqlSafe(create_database_statement(name)))
        .execute(&mut admin)
        .await;
    let _ = admin.close().await;
    match created {
        Ok(_) => {
            tracing::debug!(database = name, "created database");
            Ok(true)
        }
        // Another `migrate` created it first: what we wanted.
        Err(e) if matches!(super::sqlstate(&e).as_deref(), Some("42P04" | "23505")) => Ok(false),
        Err(e) => Err(Error::from(e)),
    }
}

/// A connection to the server's `postgres` database (or `template1`), to create the target database from.
async fn maintenance_connection(db: &Database) -> Result<PgConnection> {
    match db.with_database("postgres").connect().await {
        Ok(conn) => Ok(conn),
        Err(first) => db
            .with_database("template1")
            .connect()
            .await
            .map_err(|_| first),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_are_quoted() {
        assert_eq!(
            create_database_statement("My DB"),
            "CREATE DATABASE \"My DB\""
        );
    }

    #[test]
    fn the_embedded_migrations_are_ordered_and_named() {
        let m = migrator();
        let versions: Vec<i64> = m.iter().map(|m| m.version).collect();
        assert!(versions.windows(2).all(|w| w[0] < w[1]));
        assert!(m.iter().next().is_some_and(|m| {
            m.sql
                .as_str()
                .contains("CREATE TABLE IF NOT EXISTS inbox_messages")
        }));
    }
}
