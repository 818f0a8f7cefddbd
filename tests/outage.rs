//! PostgreSQL unreachable mid-stream (through a loopback proxy the test cuts and restores) or turned read-only, and
//! RabbitMQ's connection lost: nothing is acknowledged while it lasts, and every message is processed exactly once
//! after.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, FaultStream, Proxy, TestEnv};

const MESSAGES: i64 = 600;

in_both_modes!(
    postgres_down_mid_stream_nothing_is_acked_and_everything_is_processed_once_after,
    postgres_down
);

async fn postgres_down(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let stream = FaultStream {
        consumer_env: &[("DATABASE_URL", proxied.as_str())],
        ..FaultStream::new(MESSAGES, mode)
    }
    .start(&env, env.pool().await)
    .await;
    let (consumer, pool) = (&stream.consumer, &stream.pool);

    proxy.cut();
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    // A commit sent just before the cut may still land; once none of the consumer's sessions is left on the server,
    // none can (the proxy refuses new ones), so the count read then is the outage's, however slow the machine.
    common::eventually(
        "the consumer's sessions gone from the server",
        Duration::from_secs(30),
        || async { common::inboxctl_sessions(pool, &env.db_name).await == 0 },
    )
    .await;
    let during = stream.effects().await;
    assert!(
        during < MESSAGES,
        "the outage must come mid-stream ({during} done)"
    );
    // Nothing is acked that is not committed, sampled all through the outage. Each sample reads the broker first
    // and the database second: an ack is sent only after its commit, so by the time the broker counts an ack the
    // commit is visible to the read that follows, and a slow machine cannot make a correct consumer fail. Acks of
    // work committed before the cut may still arrive (that is allowed); an ack of a held message shows as more
    // acked than committed, with the committed count frozen. The end of the test closes the last gap: every message
    // processed once, so none was acked unprocessed.
    let outage = std::time::Instant::now();
    let mut samples = 0;
    while samples < 3 || outage.elapsed() < Duration::from_secs(3) {
        acked_at_most_committed(&env, pool, "during the outage").await;
        samples += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        stream.effects().await,
        during,
        "nothing commits while the database is unreachable"
    );
    acked_at_most_committed(&env, pool, "at the end of the outage").await;

    proxy.restore();
    stream
        .end_when("every message processed after the outage", || async {
            let (queue, committed) = acked_at_most_committed(&env, pool, "after the outage").await;
            committed >= MESSAGES && queue == (0, 0)
        })
        .await;
}

// The consumer's connections to PostgreSQL go silent mid-stream (a host lost, a network cut: no FIN, no RST, no answer
// ever), while new connections go through: each attempt on a silent connection is given up after --attempt-timeout
// and tried again on a new one, and every message is processed exactly once. Without the bound, the messages in
// flight on the silent connections would wait for the kernel's TCP timeout (here, behind a proxy that swallows what
// it is sent, for ever). The spare pool connections are for those being given back when the silence came: sqlx pings
// each on its way back with no bound of its own, which on a real network ends at the TCP timeout.
in_both_modes!(
    connections_silent_mid_stream_are_given_up_and_every_message_is_processed_once,
    connections_silent
);

async fn connections_silent(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let mut args = mode.to_vec();
    args.extend([
        "--attempt-timeout",
        "3s",
        "--claim-timeout",
        "1s",
        "--pool-size",
        "6",
    ]);
    let stream = FaultStream {
        consumer_env: &[("DATABASE_URL", proxied.as_str())],
        ..FaultStream::new(MESSAGES, &args)
    }
    .start(&env, env.pool().await)
    .await;

    proxy.silence();
    let during = stream.effects().await;
    assert!(
        during < MESSAGES,
        "the silence must come mid-stream ({during} done)"
    );
    stream
        .consumer
        .wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    stream
        .end("every message processed after the consumer's connections went silent")
        .await;
}

/// Asserts that the broker holds every message of [`MESSAGES`] not yet committed: acknowledged (no longer ready or
/// unacknowledged on the queue) is at most committed (effects). The broker is read before the database. Returns what
/// it read: the queue's `(ready, unacknowledged)` and the effects.
async fn acked_at_most_committed(
    env: &TestEnv,
    pool: &sqlx::PgPool,
    when: &str,
) -> ((u64, u64), i64) {
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    let committed = common::count(pool, "SELECT count(*) FROM carrier_reservations").await;
    let acked = MESSAGES - i64::try_from(ready + unacked).unwrap();
    assert!(
        acked <= committed,
        "{when}: acked {acked} but committed only {committed} (ready {ready}, unacked {unacked})"
    );
    ((ready, unacked), committed)
}

// A stop (SIGTERM) while PostgreSQL is unreachable: the deliveries the consumer holds — in batched mode a whole batch
// waiting for the database — go back to the broker, none acknowledged. The consumer is started, the database cut
// away, and only then are the messages published, so that none of them can have been committed.
in_both_modes!(
    a_stop_during_a_postgres_outage_gives_every_held_message_back,
    stop_during_outage
);

async fn stop_during_outage(mode: &[&str]) {
    const HELD: u64 = 20;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let mut consumer = env.spawn_with(
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
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    proxy.cut();
    common::publish_parcels(&env, &["--count", &HELD.to_string()]);
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert!(unacked > 0, "some deliveries held by the consumer");
    assert_eq!(ready + unacked, HELD, "nothing acked while it is down");

    let asked = std::time::Instant::now();
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    // The nacks go out on a connection that is still open: none waits out `--broker-timeout` (30 s).
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "stopped in {:?}:\n{}",
        asked.elapsed(),
        consumer.stderr()
    );
    common::eventually(
        "no delivery left unsettled once the process is gone",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE).1 == 0 },
    )
    .await;
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (HELD, 0),
        "every held message given back, none acknowledged:\n{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
        "nothing dead-lettered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_connection_lost_mid_stream_the_consumer_reconnects_and_nothing_repeats() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let proxied = format!("amqp://guest:guest@127.0.0.1:{}/{}", proxy.port, env.vhost);
    let stream = FaultStream {
        duplicates: Some("0.1"),
        consumer_env: &[("AMQP_URL", proxied.as_str())],
        ..FaultStream::new(MESSAGES, common::ONE_BY_ONE)
    }
    .start(&env, env.pool().await)
    .await;
    let (consumer, pool) = (&stream.consumer, &stream.pool);
    let effects = || stream.effects();

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
            pool,
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

// A database that turns read-only under a running consumer (a failover onto a replica, or
// `default_transaction_read_only`): every claim fails with SQLSTATE 25006, which is the database's state, not the
// message's. Nothing is acked, nothing counts as a failed attempt or goes to the error queue, and once the database
// is writable again every message is processed exactly once, on fresh sessions (a pooled session keeps the
// read-only default it was opened with, so it must not be reused).
in_both_modes!(
    a_database_turned_read_only_holds_every_message_until_it_is_writable,
    read_only
);

async fn read_only(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let consumer = env.spawn(&common::with_mode(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "2",
            "--prefetch",
            "8",
        ],
        mode,
    ));
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::publish_parcels(&env, &["--count", "20"]);
    common::eventually(
        "the first messages processed",
        Duration::from_secs(60),
        || async { effects().await == 20 },
    )
    .await;

    // Read-only for every session, the consumer's open ones included (as after a failover onto a replica).
    let admin = common::admin_pool().await;
    let database = format!("\"{}\"", env.db_name);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {database} SET default_transaction_read_only = on"
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&env.db_name)
    .execute(&admin)
    .await
    .unwrap();
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::publish_parcels(&env, &["--count", "30"]);
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(effects().await, 20, "nothing commits while read-only");
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 30, "nothing is acked while read-only");

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {database} RESET default_transaction_read_only"
    )))
    .execute(&admin)
    .await
    .unwrap();
    // Sessions opened while it was read-only keep that default: only fresh ones can write.
    common::eventually(
        "every message processed once the database is writable",
        Duration::from_secs(60),
        || async { effects().await >= 50 && env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    common::assert_carrier_exactly_once(&pool, 50).await;
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
    consumer.terminate();
}

/// An outage whose only attempt in flight ends without seeing PostgreSQL back — its claim unavailable, then, once
/// the database is back, its work panicking (a failpoint in the carrier call) until it is moved aside — does not leave
/// the consumer holding deliveries for good: the consumer looks for the database itself while it waits, and the next
/// message is processed. (Batched mode reaches the panic through a batch, whose own answer marks the database back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_whose_last_attempt_failed_for_its_own_reason_does_not_hold_deliveries_for_good()
{
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let mut consumer = env.spawn_with(
        &["consume", "carrier", "--max-attempts", "1"],
        &[
            ("DATABASE_URL", proxied.as_str()),
            ("INBOXCTL_FAILPOINTS", "carrier=panic@Boom"),
        ],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    proxy.cut();
    common::publish_parcels(&env, &["--count", "1", "--destination", "Boom"]);
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    proxy.restore();
    consumer.wait_for_stderr("giving up; moving message", Duration::from_secs(30));
    common::eventually(
        "the failing message moved aside",
        Duration::from_secs(30),
        || async {
            env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && env.queue_exists(&format!("{CARRIER_QUEUE}_error"))
        },
    )
    .await;
    common::publish_parcels(&env, &["--count", "1"]);
    let pool = env.pool().await;
    let processed = common::within(Duration::from_secs(20), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 1
    })
    .await;
    assert!(
        processed,
        "the next message processed: {}",
        consumer.stderr()
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// The consuming connection lost while a failed message waits for its retry: the message can no longer be settled
/// on it, and the broker delivers it again on the next connection, where its attempts run. The first connection's
/// task leaves it there — going on would run its attempts twice over and move it aside twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_during_a_retry_delay_leaves_the_message_to_its_redelivery() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut consumer = env.spawn(&[
        "consume",
        "carrier",
        "--fail-destination",
        "FAIL",
        "--max-attempts",
        "3",
        "--retry-delay",
        "5s",
    ]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    // Found now, so that the close below is one quick call well inside the retry wait (5 s; the loss is looked for
    // once a second).
    let pid = common::connection_pid(&env.vhost, "inboxctl consume");
    common::publish_parcels(&env, &["--count", "1", "--destination", "FAIL"]);
    consumer.wait_for_stderr("attempt failed", Duration::from_secs(30));
    common::close_connection_by_pid(&pid);
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::eventually(
        "the message moved aside",
        Duration::from_secs(60),
        || async {
            env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && env.queue_exists(&error_queue)
                && env.queue_counts(&error_queue).0 >= 1
        },
    )
    .await;
    // Long enough for a second chain of attempts, had one gone on, to end too.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        env.queue_counts(&error_queue).0,
        1,
        "moved aside once: {}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'"
        )
        .await,
        4,
        "one attempt before the loss, three after: {}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// PostgreSQL up but refusing the inbox's own statements (here the inbox table renamed under the running consumer, as
/// a missing grant would): deliveries are held until the claim succeeds. A `SELECT 1` passes all along, so the
/// consumer's own look for the end of an outage must not take deliveries again meanwhile; and with the connection to
/// RabbitMQ lost during the refusal (the waiting attempt then leaves its message to the redelivery), that look is what
/// must see its end: it tries a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_of_the_inbox_statements_is_not_taken_for_over_by_a_select_1() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let mut consumer = env.spawn(&["consume", "carrier", "--concurrency", "1"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    sqlx::query("ALTER TABLE inbox_messages RENAME TO inbox_messages_away")
        .execute(&pool)
        .await
        .unwrap();
    common::publish_parcels(&env, &["--count", "1"]);
    consumer.wait_for_stderr(
        "PostgreSQL refuses the inbox's own statements",
        Duration::from_secs(30),
    );
    // A delivery that comes now waits for the database: past the consumer's 5 s look, still held.
    common::publish_parcels(&env, &["--count", "1"]);
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(
        !consumer.stderr().contains("PostgreSQL is back"),
        "deliveries taken again while the claim is still refused: {}",
        consumer.stderr()
    );
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE).0 + env.queue_counts(CARRIER_QUEUE).1,
        2
    );
    common::close_connection(&env.vhost, "inboxctl consume");
    consumer.wait_for_stderr_times("consuming", 2, Duration::from_secs(30));
    sqlx::query("ALTER TABLE inbox_messages_away RENAME TO inbox_messages")
        .execute(&pool)
        .await
        .unwrap();
    common::eventually("both processed", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 2
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// The consuming connection lost while a message waits out a PostgreSQL outage: the message can no longer be settled
/// on it, and the broker delivers it again on the next connection. The first connection's task leaves it there, so
/// that it is processed once, by the task of its redelivery — not by both, the first one's commit then unacknowledged
/// and its redelivery discarded as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_during_a_database_outage_leaves_the_message_to_its_redelivery() {
    lost_during_an_outage(common::ONE_BY_ONE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_during_a_database_outage_leaves_the_batch_to_its_redelivery() {
    lost_during_an_outage(common::BATCHED).await;
}

async fn lost_during_an_outage(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let mut consumer = env.spawn_with(
        &common::with_mode(&["consume", "carrier"], mode),
        &[("DATABASE_URL", proxied.as_str())],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    proxy.cut();
    common::publish_parcels(&env, &["--count", "1"]);
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    common::close_connection(&env.vhost, "inboxctl consume");
    consumer.wait_for_stderr_times("consuming", 2, Duration::from_secs(30));
    proxy.restore();
    let pool = env.pool().await;
    common::eventually("processed", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 1
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        0,
        "processed once, not twice over: {}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}
