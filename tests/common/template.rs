//! A migrated database to copy: `migrate` on a new database takes about a second (twenty migrations, four index
//! builds), a copy of a migrated one (`CREATE DATABASE … TEMPLATE`) a tenth of that, and most tests begin with one.
//!
//! One template a test binary build and inbox mode: its name holds a hash of the binary (its size and time: a build
//! with other migrations, or another `migrate`, is another binary) and of the mode's partitioning, so that a changed
//! schema is never copied from a stale template. It is made once, by whichever test asks first, under an advisory
//! lock the others wait on; it takes no connections (autovacuum leaves it alone, and a copy is never refused because
//! someone is connected to it). The templates of other builds are dropped when a new one is made.

use std::hash::{DefaultHasher, Hash, Hasher};

use super::{admin_pool, pg_base, quote_ident};

const PREFIX: &str = "inboxctl_tpl_";

/// This build's part of a template's name.
fn build() -> String {
    let mut hasher = DefaultHasher::new();
    if let Ok(meta) = std::env::current_exe().and_then(std::fs::metadata) {
        meta.len().hash(&mut hasher);
        meta.modified().ok().hash(&mut hasher);
    }
    format!("{:08x}", hasher.finish() as u32)
}

/// The template for this build and `partitioning`, made if it is not there yet.
pub async fn template(partitioning: Option<inboxctl::db::partitions::Settings>) -> String {
    let mut hasher = DefaultHasher::new();
    format!("{partitioning:?}").hash(&mut hasher);
    let build = build();
    let name = format!("{PREFIX}{build}_{:08x}", hasher.finish() as u32);
    let admin = admin_pool().await;
    let mut lock = admin
        .acquire()
        .await
        .expect("a connection for the template's lock");
    let key = i64::from_str_radix(&build, 16).expect("hex") ^ 0x7470_6c00;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut *lock)
        .await
        .expect("the template's lock");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut *lock)
            .await
            .expect("look for the template");
    if !exists {
        make(&mut lock, &name, &build, partitioning).await;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut *lock)
        .await
        .expect("the template's lock");
    drop(lock);
    admin.close().await;
    name
}

async fn make(
    admin: &mut sqlx::PgConnection,
    name: &str,
    build: &str,
    partitioning: Option<inboxctl::db::partitions::Settings>,
) {
    // Built under another name and renamed when whole: a build cut short is never copied.
    let building = format!("{name}_building");
    let drop = |db: &str| format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(db));
    sqlx::query(sqlx::AssertSqlSafe(drop(&building)))
        .execute(&mut *admin)
        .await
        .expect("drop a template build cut short");
    let db = inboxctl::db::Database::from_url(&format!("{}/{building}", pg_base())).unwrap();
    inboxctl::db::schema::migrate_partitioned(&db, false, partitioning)
        .await
        .expect("migrate the template");
    // Whatever connection of the migration's pool is still closing.
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&building)
        .execute(&mut *admin)
        .await
        .expect("end the template's connections");
    for statement in [
        format!(
            "ALTER DATABASE {} RENAME TO {}",
            quote_ident(&building),
            quote_ident(name)
        ),
        format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS false",
            quote_ident(name)
        ),
    ] {
        retry(admin, &statement).await;
    }
    // Other builds' templates: not used by this run.
    let stale: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE starts_with(datname, $1)")
            .bind(PREFIX)
            .fetch_all(&mut *admin)
            .await
            .expect("list the templates");
    for old in stale
        .iter()
        .filter(|d| !d.starts_with(&format!("{PREFIX}{build}_")))
    {
        let _ = sqlx::query(sqlx::AssertSqlSafe(drop(old)))
            .execute(&mut *admin)
            .await;
    }
}

/// A statement on a database a closing connection may still hold for a moment ("being accessed by other users").
async fn retry(admin: &mut sqlx::PgConnection, statement: &str) {
    for attempt in 0.. {
        match sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(&mut *admin)
            .await
        {
            Ok(_) => return,
            Err(_) if attempt < 50 => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{statement}: {e}"),
        }
    }
}
