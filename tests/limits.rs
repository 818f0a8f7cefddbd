//! Connection limits: more workers than database connections, and no connection to be had at all (a `CONNECTION
//! LIMIT` on the test's own role, never the shared server's `max_connections`). Clear errors, no deadlock, nothing
//! acked unprocessed, recovery once connections free up.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};

in_both_modes!(
    more_workers_than_connections_every_message_once,
    more_workers_than_connections
);

async fn more_workers_than_connections(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "300", "--duplicates", "0.1"]);
    let out = common::consume_until_idle(
        &env,
        &common::with_mode(
            &["carrier", "--concurrency", "16", "--pool-size", "2"],
            mode,
        ),
    );
    assert!(
        !out.stderr.contains("PostgreSQL unavailable"),
        "{}",
        out.stderr
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        300
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
        )
        .await,
        300
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// One worker's work holds the pool's only connection 7 s; the other waits for it past the 5 s allowed: the
/// database up and serving every connection, not gone. It is tried again, said as such; it was taken for an outage —
/// "PostgreSQL unavailable" at ERROR, intake paused, `/health` saying the database down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_busy_past_the_wait_for_a_connection_is_not_an_outage() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "4"]);
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "2",
            "--pool-size",
            "1",
            "--exit-when-idle",
            "2s",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier=sleep-once-7000")],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert!(stderr.contains("stayed busy past the wait"), "{stderr}");
    assert!(!stderr.contains("PostgreSQL unavailable"), "{stderr}");
    let pool = env.pool().await;
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
        )
        .await,
        4
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// A login role of the test's own, with what a consumer needs on the test database; dropped with the guard.
struct Role {
    name: String,
    db: String,
}

impl Role {
    async fn create(env: &TestEnv) -> Self {
        let name = format!("{}_role", env.db_name);
        let admin = common::admin_pool().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{name}\" LOGIN")))
            .execute(&admin)
            .await
            .unwrap();
        let pool = env.pool().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "GRANT ALL ON ALL TABLES IN SCHEMA public TO \"{name}\";
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO \"{name}\";"
        )))
        .execute(&pool)
        .await
        .unwrap();
        Self {
            name,
            db: env.db_name.clone(),
        }
    }

    fn url(&self) -> String {
        common::pg_base().replacen("//postgres@", &format!("//{}@", self.name), 1) + "/" + &self.db
    }

    async fn limit(&self, limit: i32) {
        let admin = common::admin_pool().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER ROLE \"{}\" CONNECTION LIMIT {limit}",
            self.name
        )))
        .execute(&admin)
        .await
        .unwrap();
    }

    /// Ends every session of the role (as a restart or a connection-killing proxy would).
    async fn terminate_sessions(&self) {
        let admin = common::admin_pool().await;
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
            .bind(&self.name)
            .execute(&admin)
            .await
            .unwrap();
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let base = common::pg_base();
        for (db, sql) in [
            (self.db.as_str(), format!("DROP OWNED BY \"{}\"", self.name)),
            ("postgres", format!("DROP ROLE IF EXISTS \"{}\"", self.name)),
        ] {
            let _ = Command::new("psql")
                .args([&format!("{base}/{db}"), "-qXc", &sql])
                .output();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_connection_to_be_had_is_a_clear_error_at_start_and_held_deliveries_later() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let role = Role::create(&env).await;
    let url = role.url();

    // At start: no connection at all is a clear error naming the cause, and nothing is consumed.
    role.limit(0).await;
    common::publish_parcels(&env, &["--count", "5"]);
    let out = env
        .cmd()
        .env("DATABASE_URL", &url)
        .args(["consume", "carrier", "--exit-when-idle", "1s"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("too many connections"), "{stderr}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (5, 0), "nothing taken");

    // Running: its sessions end and no new one is to be had; it holds its deliveries, then recovers.
    role.limit(-1).await;
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "4",
            "--prefetch",
            "8",
        ],
        &[("DATABASE_URL", url.as_str())],
    );
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::eventually(
        "the first five processed",
        Duration::from_secs(60),
        || async { effects().await == 5 },
    )
    .await;
    role.limit(0).await;
    role.terminate_sessions().await;
    common::publish_parcels(&env, &["--count", "20"]);
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(effects().await, 5, "nothing commits without a connection");
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 20, "nothing is acked without a connection");

    role.limit(-1).await;
    common::eventually(
        "every message processed once connections are to be had again",
        Duration::from_secs(60),
        || async { effects().await >= 25 && env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    common::assert_carrier_exactly_once(&pool, 25).await;
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
    consumer.terminate();
}
