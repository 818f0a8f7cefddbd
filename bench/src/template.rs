//! Template databases: rows built once, marked complete, and copied for each run that needs them (the cleanup's 10M
//! rows, the inbox prefill of `--inbox-rows`).

use inboxctl::db::{self as store, Database};
use sqlx::postgres::PgPool;

use crate::error::Result;
use crate::scratch::drop_database;
use crate::sql;

/// Whether `template` exists and carries `marker`: it was built to the end, by a bench of the current shape.
pub async fn ready(template: &Database, marker: &str) -> bool {
    let Ok(pool) = template.pool(1).await else {
        return false;
    };
    let found: Option<String> = sqlx::query_scalar(sql::TEMPLATE_MARKER)
        .fetch_one(&pool)
        .await
        .ok()
        .flatten();
    pool.close().await;
    found.as_deref() == Some(marker)
}

/// Ends a template's build: hint bits, the visibility map and the planner's statistics set once for every copy, then
/// `marker` (made by the bench from numbers and names: no quote in it), which [`ready`] looks for.
pub async fn finish(pool: &PgPool, marker: &str) -> Result<()> {
    sqlx::query(sql::VACUUM_INBOX).execute(pool).await?;
    sqlx::query(sqlx::AssertSqlSafe(
        sql::MARK_TEMPLATE.replace("{}", marker),
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates database `name` (dropped first if there) as a copy of `template`. PostgreSQL 15 copies a database by
/// writing it all to the WAL unless told to copy the files, which would force checkpoints into the measurement that
/// follows; then a checkpoint of our own (if the role may), so each run starts from the same clean state.
pub async fn copy(db: &Database, template: &str, name: &str) -> Result<()> {
    drop_database(db, name).await?;
    let mut admin = db.with_database("postgres").connect().await?;
    let version: i32 = sqlx::query_scalar(sql::SERVER_VERSION_NUM)
        .fetch_one(&mut admin)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {} TEMPLATE {}{}",
        store::sql::quote_ident(name),
        store::sql::quote_ident(template),
        if version >= 150_000 {
            " STRATEGY = FILE_COPY"
        } else {
            ""
        }
    )))
    .execute(&mut admin)
    .await?;
    if let Err(e) = sqlx::query(sql::CHECKPOINT).execute(&mut admin).await {
        tracing::debug!(error = %e, "no checkpoint before the run");
    }
    Ok(())
}
