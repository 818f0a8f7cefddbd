//! A consumer process killed with SIGKILL at fixed crash points: between commit and ack, and before the commit.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};

async fn crash_at(point: &str, mode: &[&str]) -> (TestEnv, sqlx::PgPool) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1"]);
    let mut victim = env.spawn_with(
        &common::with_mode(&["consume", "carrier"], mode),
        &[("INBOXCTL_FAILPOINTS", point)],
    );
    // The process says it reached the point, and waits there for its SIGKILL.
    victim.wait_for_stderr(
        &format!("failpoint {point} reached"),
        Duration::from_secs(30),
    );
    victim.kill();
    common::eventually(
        "the unacked message back on the queue",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (1, 0) },
    )
    .await;
    let pool = env.pool().await;
    (env, pool)
}

in_both_modes!(
    killed_after_commit_before_ack_the_redelivery_is_discarded,
    after_commit
);

async fn after_commit(mode: &[&str]) {
    let (env, pool) = crash_at("after-commit", mode).await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1,
        "committed before the kill"
    );

    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
    assert!(out.stderr.contains("duplicate discarded"), "{}", out.stderr);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        1
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

in_both_modes!(
    killed_before_commit_the_redelivery_is_processed,
    before_commit
);

async fn before_commit(mode: &[&str]) {
    let (env, pool) = crash_at("before-commit", mode).await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0,
        "rolled back by the kill"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );

    let out = common::consume_until_idle(&env, &["carrier"]);
    assert!(
        !out.stderr.contains("duplicate discarded"),
        "{}",
        out.stderr
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        0
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_shutdown_timeout_in_flight_work_is_rolled_back_and_left_for_redelivery() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Stuck"]);
    // The stand-in carrier hangs for this parcel: its transaction stays open.
    let mut consumer = env.spawn_with(
        &["consume", "carrier", "--shutdown-timeout", "1s"],
        &[("INBOXCTL_FAILPOINTS", "carrier=pause@Stuck")],
    );
    consumer.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    let asked = std::time::Instant::now();
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(20)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "the timeout bounds the stop"
    );
    assert!(
        consumer.stderr().contains("shutdown timeout reached"),
        "{}",
        consumer.stderr()
    );

    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0,
        "rolled back"
    );
    common::eventually(
        "the message back on the queue",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (1, 0) },
    )
    .await;
    common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );
}
