//! PostgreSQL as the tests see it: the superuser's pool, counts, and what the tests add to a schema to watch it.

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::pg_base;

/// A PostgreSQL identifier quoted for SQL built as text (a database's name in `CREATE DATABASE`): in double quotes,
/// each double quote in it doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

pub async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect to PostgreSQL: is it running on 127.0.0.1:5432?")
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// A message's key held as an attempt in flight elsewhere holds it: its inbox row inserted in a transaction left open,
/// on which a consumer's claim of the key waits (past `--claim-timeout`, as contention). Roll it back to let go.
pub async fn hold_key(
    pool: &PgPool,
    id: uuid::Uuid,
    consumer_type: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at) VALUES ($1, $2, now())",
    )
    .bind(id)
    .bind(consumer_type)
    .execute(&mut *holder)
    .await
    .unwrap();
    holder
}

/// A redelivered message's start counted once already, as an earlier process that ended with it in flight would
/// have: its next start makes it a suspect, tried alone.
pub async fn count_a_start(pool: &PgPool, id: uuid::Uuid, consumer_type: &str) {
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started) VALUES ($1, $2, 1)",
    )
    .bind(consumer_type)
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

/// Sessions that inboxctl processes hold on the database `db_name` (inboxctl names its sessions `inboxctl`; the
/// tests' own pools do not), seen through `pool`.
pub async fn inboxctl_sessions(pool: &PgPool, db_name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'inboxctl'",
    )
    .bind(db_name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Gives `inbox_messages` and both effect tables a column `committed_in` holding the top-level transaction that
/// inserted each row (`pg_current_xact_id()` names the top-level transaction even inside a savepoint, where `xmin`
/// names the savepoint's subtransaction). inboxctl's statements list their columns, so it does not see the column.
pub async fn record_inserting_transactions(pool: &PgPool) {
    for table in [
        "inbox_messages",
        "carrier_reservations",
        "notifications_sent",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table} ADD COLUMN committed_in xid8 DEFAULT pg_current_xact_id()"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
}
