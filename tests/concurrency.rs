//! Parallel copies of one message id, delivered at once to two consumer processes: one effect, every copy acked.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};
use uuid::Uuid;

in_both_modes!(
    sixteen_copies_at_once_to_two_processes_give_one_effect_fifty_rounds,
    sixteen_copies
);

async fn sixteen_copies(mode: &[&str]) {
    const ROUNDS: i64 = 50;
    const COPIES: i64 = 16;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let args = common::with_mode(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "16",
            "--prefetch",
            "64",
        ],
        mode,
    );
    let a = env.spawn(&args);
    let b = env.spawn(&args);
    a.wait_for_stderr("consuming", Duration::from_secs(30));
    b.wait_for_stderr("consuming", Duration::from_secs(30));

    let conn = env.amqp().await;
    let pool = env.pool().await;
    for round in 1..=ROUNDS {
        let (props, body, parcel) = common::parcel_message(Uuid::now_v7(), "Berlin");
        common::publish_copies(&conn, CARRIER_QUEUE, props, &body, COPIES as usize).await;
        common::eventually(
            &format!("round {round}: one effect and 15 duplicates"),
            Duration::from_secs(30),
            || async {
                common::count(
                    &pool,
                    "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
                )
                .await
                    == round * (COPIES - 1)
            },
        )
        .await;
        let effects: i64 =
            sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE parcel_id = $1")
                .bind(parcel)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(effects, 1, "round {round}");
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        ROUNDS
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        ROUNDS
    );

    // Every copy acknowledged: nothing ready, nothing held.
    common::eventually("all copies acked", Duration::from_secs(10), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    // Both processes got copies of the same ids and discarded some.
    assert!(a.stderr().contains("duplicate discarded"), "{}", a.stderr());
    assert!(b.stderr().contains("duplicate discarded"), "{}", b.stderr());
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
    a.terminate();
    b.terminate();
}

// Not on a partitioned inbox, whose key holds the time taken from the message: the same code path, and a row the
// test cannot write without taking that time out of the id as the consumer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_past_the_claim_timeout_holds_up_its_own_message_alone() {
    key_held_elsewhere(common::ONE_BY_ONE, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_past_the_claim_timeout_holds_up_its_own_message_alone_batched() {
    key_held_elsewhere(common::BATCHED, false).await;
}

/// The same with the server's own `statement_timeout` (1 s, set on the database, as managed services often do)
/// shorter than `--claim-timeout` (3 s here): the consumer's sessions carry their own, so the claim waits to its
/// `lock_timeout` and is the same contention — not a database that refuses the inbox's statements (which paused every
/// message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_past_the_servers_statement_timeout_holds_up_its_own_message_alone() {
    key_held_elsewhere(common::ONE_BY_ONE, true).await;
}

/// The work's own statement (the effect's insert) waits on a lock another transaction holds on the effect table (an
/// operator's `LOCK`, a migration), longer than the server's `statement_timeout` (1 s, set on the database). The
/// consumer's sessions carry their own `statement_timeout` (past `--attempt-timeout`): the wait goes on, and the message
/// is processed once the lock goes, nothing counted. The server's cut it short and counted it as the message's failure:
/// with `--max-attempts 1`, a good message went to the error queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_the_work_waits_on_past_the_servers_statement_timeout_fails_nothing() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE carrier_reservations IN EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {} SET statement_timeout = '1s'",
        common::quote_ident(&env.db_name)
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut consumer = env.spawn(&[
        "consume",
        "carrier",
        "--max-attempts",
        "1",
        "--claim-timeout",
        "30s",
    ]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let conn = env.amqp().await;
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    let _ = conn.close(200, "OK".into()).await;
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%carrier_reservations%'";
    common::eventually(
        "the work waiting on the lock",
        Duration::from_secs(20),
        || async { common::count(&pool, waiting).await >= 1 },
    )
    .await;
    // Three of the server's statement_timeouts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    holder.rollback().await.unwrap();
    let effects = "SELECT count(*) FROM carrier_reservations";
    common::eventually(
        "the message processed once the lock is let go",
        Duration::from_secs(30),
        || async {
            common::count(&pool, effects).await == 1 && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        },
    )
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let stderr = consumer.stderr();
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
        "a good message moved aside: {stderr}"
    );
    assert!(!stderr.contains("PostgreSQL unavailable"), "{stderr}");
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'"
        )
        .await,
        0,
        "{stderr}"
    );
}

/// A message whose key another transaction holds (an attempt elsewhere that is slow, a session left open in a
/// transaction) waits past `--claim-timeout` again and again. The database is up all along: the messages behind it
/// are processed meanwhile — not held up as in an outage, nor, batched, stuck in a batch with it that is tried again
/// and again — and it is processed once the key is let go.
async fn key_held_elsewhere(mode: &[&str], statement_timeout: bool) {
    const BEHIND: i64 = 20;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    // Not looked at (a look gives it back redelivered, and a redelivered message is processed on its own even when
    // batched): batched, it goes as a batch, whose claim meets the held key.
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let conn = env.amqp().await;
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    let _ = conn.close(200, "OK".into()).await;
    let pool = env.pool().await;
    let holder = common::hold_key(&pool, id, CARRIER_QUEUE).await;
    let claim_timeout = if statement_timeout {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET statement_timeout = '1s'",
            common::quote_ident(&env.db_name)
        )))
        .execute(&pool)
        .await
        .unwrap();
        "3s"
    } else {
        "1s"
    };
    let mut consumer = env.spawn(&common::with_mode(
        &["consume", "carrier", "--claim-timeout", claim_timeout, "-v"],
        mode,
    ));
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    // The messages behind it come once its claim has waited past the timeout (1 s; 3 s) at least once: taken, and
    // processed, while it waits again.
    let waited = if statement_timeout { 4000 } else { 2500 };
    tokio::time::sleep(Duration::from_millis(waited)).await;
    common::publish_parcels(&env, &["--count", &BEHIND.to_string()]);
    let effects = "SELECT count(*) FROM carrier_reservations";
    let behind_done = common::within(Duration::from_secs(20), || async {
        common::count(&pool, effects).await == BEHIND
    })
    .await;
    assert!(
        behind_done,
        "the messages behind it processed while its key is held: {} of {BEHIND}\n{}",
        common::count(&pool, effects).await,
        consumer.stderr()
    );
    assert!(consumer.has_said("met another transaction"));
    assert!(
        !consumer.stderr().contains("PostgreSQL unavailable"),
        "a key held elsewhere is not an outage: {}",
        consumer.stderr()
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE).0, 0);
    holder.rollback().await.unwrap();
    common::eventually(
        "the held message processed once its key is let go",
        Duration::from_secs(20),
        || async {
            common::count(&pool, effects).await == BEHIND + 1
                && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        },
    )
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}
