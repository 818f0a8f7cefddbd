//! PostgreSQL unreachable mid-stream, through a loopback proxy the test cuts and restores: nothing is acknowledged
//! while it is down, and every message is processed exactly once after it is back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{CARRIER_QUEUE, Proxy, TestEnv};

const MESSAGES: i64 = 600;

in_both_modes!(
    postgres_down_mid_stream_nothing_is_acked_and_everything_is_processed_once_after,
    postgres_down
);

async fn postgres_down(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", &MESSAGES.to_string()]);
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        proxy.port, env.db_name
    );
    let consumer = env.spawn_with(
        &common::with_mode(
            &[
                "consume",
                "carrier",
                "--concurrency",
                "2",
                "--prefetch",
                "8",
            ],
            mode,
        ),
        &[("DATABASE_URL", proxied.as_str())],
    );
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::eventually(
        "a first part processed",
        Duration::from_secs(60),
        || async { effects().await >= 50 },
    )
    .await;

    proxy.cut();
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    let acked = |(ready, unacked): (u64, u64)| MESSAGES - i64::try_from(ready + unacked).unwrap();
    let during = effects().await;
    let acked_during = acked(env.queue_counts(CARRIER_QUEUE));
    assert!(
        during < MESSAGES,
        "the outage must come mid-stream ({during} done)"
    );
    assert!(
        acked_during <= during,
        "acked {acked_during} but committed only {during}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        effects().await,
        during,
        "nothing commits while the database is unreachable"
    );
    assert_eq!(
        acked(env.queue_counts(CARRIER_QUEUE)),
        acked_during,
        "nothing is acked while it is down"
    );

    proxy.restore();
    common::eventually(
        "every message processed after the outage",
        Duration::from_secs(120),
        || async { effects().await >= MESSAGES && env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    assert_eq!(effects().await, MESSAGES, "exactly once");
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
        )
        .await,
        MESSAGES
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind <> 'duplicate'"
        )
        .await,
        0,
        "the outage never counted against a message"
    );
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
        "nothing dead-lettered"
    );
    consumer.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_connection_lost_mid_stream_the_consumer_reconnects_and_nothing_repeats() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(
        &env,
        &["--count", &MESSAGES.to_string(), "--duplicates", "0.1"],
    );
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let proxied = format!("amqp://guest:guest@127.0.0.1:{}/{}", proxy.port, env.vhost);
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "2",
            "--prefetch",
            "8",
        ],
        &[("AMQP_URL", proxied.as_str())],
    );
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::eventually(
        "a first part processed",
        Duration::from_secs(60),
        || async { effects().await >= 50 },
    )
    .await;

    proxy.cut();
    consumer.wait_for_stderr("RabbitMQ connection lost", Duration::from_secs(30));
    let during = effects().await;
    assert!(
        during < MESSAGES,
        "the outage must come mid-stream ({during} done)"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.restore();

    common::eventually(
        "every message processed after the reconnect",
        Duration::from_secs(120),
        || async { effects().await >= MESSAGES && env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    assert_eq!(
        effects().await,
        MESSAGES,
        "exactly once, redelivered in-flight messages included"
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
        )
        .await,
        MESSAGES
    );
    assert!(consumer.stderr().contains("consuming"));
    assert_eq!(
        consumer.stderr().matches("consuming queue").count(),
        2,
        "one reconnect:\n{}",
        consumer.stderr()
    );
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
        "nothing dead-lettered"
    );
    consumer.terminate();
}
