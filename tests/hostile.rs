//! What a hostile test of `consume` found, each case against the real services: messages the broker accepts but that
//! lost a message, crashed or stalled a consumer, or were mistaken for something else. Each test here failed against
//! the build that had the bug (run it with `INBOXCTL_TEST_BIN=<that build's binary>` to see).

use crate::common;

use std::time::{Duration, Instant};

use common::{CARRIER_QUEUE, EVENT_EXCHANGE, TestEnv, raw_amqp};
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicNackOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use uuid::Uuid;

const ERROR_QUEUE: &str = "parcel-created-carrier_error";

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Every message of a queue, taken.
async fn take_all(env: &TestEnv, queue: &str) -> Vec<lapin::message::Delivery> {
    let conn = env.amqp().await;
    let out = common::drain(&conn, queue).await;
    let _ = conn.close(200, "OK".into()).await;
    out
}

fn header_text(delivery: &lapin::message::Delivery, key: &str) -> String {
    common::header_text(&delivery.properties, key).unwrap_or_default()
}

async fn effects(pool: &sqlx::PgPool) -> i64 {
    common::count(pool, "SELECT count(*) FROM carrier_reservations").await
}

/// A consumer of the carrier queue, started and consuming.
fn consumer(env: &TestEnv, args: &[&str]) -> common::Proc {
    let mut all = vec!["consume", "carrier", "--concurrency", "4"];
    all.extend_from_slice(args);
    let proc = env.spawn(&all);
    proc.wait_for_stderr("consuming", Duration::from_secs(60));
    proc
}

// ---- a dead-letter copy must not expire, nor be lost in a broker restart ----

// Each copy is also persistent (delivery mode 2), the unreadable one's original having been published transient (no
// delivery mode): a copy waits in the error queue for days, and a transient one in a classic queue is gone at the
// broker's next restart.

in_both_modes!(
    dead_letter_copies_do_not_expire_and_keep_the_ttl_in_a_header,
    copies_do_not_expire
);

async fn copies_do_not_expire(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut consumer = consumer(
        &env,
        &common::with_mode(&["--fail-destination", "FAIL", "--max-attempts", "1"], mode),
    );
    let conn = env.amqp().await;
    // A message whose work fails, and one that cannot be read, each with a per-message TTL of 4 s.
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        props.with_expiration("4000".into()),
        &body,
    )
    .await;
    let unreadable = BasicProperties::default()
        .with_message_id(Uuid::now_v7().to_string().into())
        .with_expiration("4000".into());
    common::publish(&conn, "", CARRIER_QUEUE, unreadable, b"not json").await;
    common::eventually(
        "both copies in the error queue",
        Duration::from_secs(60),
        || async { env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE).0 == 2 },
    )
    .await;
    // Past the TTL: a copy that kept `expiration` would be gone.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0), "no copy expired");
    for copy in take_all(&env, ERROR_QUEUE).await {
        assert_eq!(copy.properties.expiration(), &None, "the copy has no TTL");
        assert_eq!(
            copy.properties.delivery_mode(),
            &Some(2),
            "the copy is persistent"
        );
        assert_eq!(
            header_text(&copy, "inboxctl-original-expiration"),
            "4000",
            "the original TTL is kept"
        );
    }
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

// ---- message ids: the nil UUID, and an id reused for another event ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nil_message_id_is_unreadable_and_no_message_carrying_it_is_lost() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    for destination in ["Berlin", "Paris"] {
        let (props, body, _) = common::parcel_message(Uuid::nil(), destination);
        common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    }
    common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 0, "neither was processed");
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 2, "both kept in the error queue");
    for copy in &copies {
        assert!(
            header_text(copy, "MT-Fault-Message").contains("nil UUID"),
            "{}",
            header_text(copy, "MT-Fault-Message")
        );
    }
}

/// A body that starts with a UTF-8 byte order mark is unreadable (MassTransit's deserializer refuses it too), and its
/// error copy says so in words, not as "expected value at line 1 column 1"; the healthy message behind it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_with_a_byte_order_mark_is_dead_lettered_saying_so() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "Berlin");
    let mut marked = vec![0xEF, 0xBB, 0xBF];
    marked.extend_from_slice(&body);
    common::publish(&conn, EVENT_EXCHANGE, "", props, &marked).await;
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "Paris");
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    assert_eq!(
        effects(&pool).await,
        1,
        "only the healthy one was processed"
    );
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "the marked one is kept in the error queue");
    let reason = header_text(&copies[0], "MT-Fault-Message");
    assert!(reason.contains("byte order mark"), "{reason}");
    assert_eq!(copies[0].data, marked, "kept byte for byte");
}

in_both_modes!(
    a_reused_message_id_with_another_event_is_a_conflict_not_a_duplicate,
    reused_id
);

/// The envelope body of a `ParcelCreatedEvent` with `id`, written by hand so that its key order, whitespace and
/// `sentTime` can differ from another copy's.
fn envelope(id: Uuid, parcel: Uuid, destination: &str, sent: &str, reorder: bool) -> Vec<u8> {
    let event = if reorder {
        format!(r#"{{"destination":"{destination}","trackingNumber":"PT1","parcelId":"{parcel}"}}"#)
    } else {
        format!(
            "{{\n    \"parcelId\": \"{parcel}\",\n    \"trackingNumber\": \"PT1\",\n    \"destination\": \"{destination}\"\n  }}"
        )
    };
    format!(
        r#"{{"messageId": "{id}", "messageType": ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"], "message": {event}, "sentTime": "{sent}", "headers": {{}}}}"#
    )
    .into_bytes()
}

async fn reused_id(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let id = Uuid::now_v7();
    let (first, second) = (Uuid::now_v7(), Uuid::now_v7());
    let props = inboxctl::amqp::envelope::masstransit_properties(id);
    let send = |body: Vec<u8>| {
        let conn = &conn;
        let props = props.clone();
        async move { common::publish(conn, EVENT_EXCHANGE, "", props, &body).await }
    };
    send(envelope(
        id,
        first,
        "Berlin",
        "2026-12-01T10:00:00.1234567Z",
        false,
    ))
    .await;
    common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
    // A legitimate re-send of the same event (other key order, whitespace and sentTime): a duplicate.
    send(envelope(id, first, "Berlin", "2026-12-01T10:05:00Z", true)).await;
    // Another parcel under the same message id: a conflict.
    send(envelope(id, second, "Paris", "2026-12-01T10:06:00Z", false)).await;
    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
    assert!(
        out.stderr.contains("message id reused for another event"),
        "{}",
        out.stderr
    );

    let pool = env.pool().await;
    let parcels: Vec<Uuid> = sqlx::query_scalar("SELECT parcel_id FROM carrier_reservations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(parcels, [first], "only the first event was processed");
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM inboxctl_events WHERE kind IN ('duplicate', 'conflict') ORDER BY kind",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kinds, ["conflict", "duplicate"]);
    let stats = env.run(&["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats.stdout).unwrap();
    let carrier = stats["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == CARRIER_QUEUE)
        .unwrap();
    assert_eq!(
        carrier["conflicts"], 1,
        "stats shows the conflict: {carrier}"
    );
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(
        copies.len(),
        1,
        "the conflicting message is kept, for a look"
    );
    assert_eq!(
        header_text(&copies[0], "MT-Fault-ExceptionType"),
        "inboxctl::MessageIdConflict"
    );
    assert!(String::from_utf8_lossy(&copies[0].data).contains(&second.to_string()));

    // Discarding conflicts is the operator's choice; they are counted all the same.
    send(envelope(
        id,
        Uuid::now_v7(),
        "Rome",
        "2026-12-01T10:07:00Z",
        false,
    ))
    .await;
    common::consume_until_idle(
        &env,
        &common::with_mode(&["carrier", "--on-conflict", "discard"], mode),
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (0, 0));
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'conflict'"
        )
        .await,
        2
    );
    assert_eq!(effects(&pool).await, 1);
}

// ---- a message published by another user ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_from_another_user_is_moved_aside_without_its_user_id() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    // A producer with a user of its own stamps its name in user_id (RabbitMQ checks it is the publisher's).
    let user = format!("producer-{}", &env.vhost);
    common::add_user(&user, "producer-secret");
    common::set_permissions(&env.vhost, &user, ".*", ".*", ".*");
    let url = format!(
        "amqp://{user}:producer-secret@{}/{}",
        env.amqp_addr(),
        env.vhost
    );
    let producer = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let unreadable = BasicProperties::default()
        .with_message_id(Uuid::now_v7().to_string().into())
        .with_user_id(user.as_str().into());
    common::publish(&producer, "", CARRIER_QUEUE, unreadable, b"not json").await;
    common::publish_parcels(&env, &["--count", "5"]);
    let out = common::consume_until_idle(&env, &["carrier"]);
    common::delete_user(&user);
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 5);
    assert!(!out.stderr.contains("reconnect"), "{}", out.stderr);
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "moved aside: {}", out.stderr);
    assert_eq!(copies[0].properties.user_id(), &None);
    assert_eq!(header_text(&copies[0], "inboxctl-original-user-id"), user);
}

// ---- poison detection: a clean stop is not a crash ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_that_abandon_a_message_stuck_on_a_lock_do_not_make_it_poison() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1"]);
    let pool = env.pool().await;
    // Work stuck on a lock: the effect table held by another session.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE carrier_reservations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    for stop in 1..=5 {
        let mut consumer = consumer(
            &env,
            &["--claim-timeout", "10m", "--shutdown-timeout", "1s"],
        );
        common::eventually("the message in flight", Duration::from_secs(30), || async {
            env.queue_counts(CARRIER_QUEUE).1 == 1
        })
        .await;
        consumer.terminate();
        assert_eq!(
            consumer.wait(Duration::from_secs(30)),
            Some(0),
            "stop {stop}"
        );
        assert_eq!(
            env.queue_counts(CARRIER_QUEUE).0,
            1,
            "stop {stop}: the message is back"
        );
    }
    blocker.rollback().await.unwrap();
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert!(!out.stderr.contains("poison"), "{}", out.stderr);
    assert_eq!(effects(&pool).await, 1, "processed, not moved aside");
    assert!(!env.queue_exists(ERROR_QUEUE) || env.queue_counts(ERROR_QUEUE) == (0, 0));
}

/// A suspect (in flight at an earlier end of its process) whose key is held elsewhere waits past `--claim-timeout`
/// again and again: it is counted alone while an attempt runs, at most once — counted at each wait and kept, a suspect
/// slow through no fault of its own would reach `--poison-after` without ever ending a process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_waiting_on_its_key_is_counted_alone_once() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let conn = env.amqp().await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    // Delivered once and given back: it comes redelivered, and with the start already counted, a suspect.
    assert_eq!(common::peek(&conn, CARRIER_QUEUE).await.len(), 1);
    let _ = conn.close(200, "OK".into()).await;
    let pool = env.pool().await;
    common::count_a_start(&pool, id, CARRIER_QUEUE).await;
    let holder = common::hold_key(&pool, id, CARRIER_QUEUE).await;
    let mut consumer = consumer(&env, &["--claim-timeout", "200ms", "-v"]);
    consumer.wait_for_stderr_times("met another transaction", 4, Duration::from_secs(30));
    let alone: i32 = sqlx::query_scalar(
        "SELECT alone FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(alone <= 1, "alone {alone}: {}", consumer.stderr());
    holder.rollback().await.unwrap();
    common::eventually("processed", Duration::from_secs(20), || async {
        effects(&pool).await == 1 && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A suspect whose attempt alone failed waits for its retry holding nothing; another suspect's attempt alone may run
/// then — the poison's — and end the process. That end was charged to the waiting one too (its count alone, made at
/// its first attempt, kept for the whole start): after `--poison-after` such ends a healthy message was moved aside as
/// the poison. Its count alone is taken back as each attempt returns: the process killed while it waits leaves it at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_killed_while_it_waits_for_its_retry_is_not_counted_alone() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "FAIL");
    let conn = env.amqp().await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    // Delivered once and given back: it comes redelivered, and with the start already counted, a suspect.
    assert_eq!(common::peek(&conn, CARRIER_QUEUE).await.len(), 1);
    let _ = conn.close(200, "OK".into()).await;
    let pool = env.pool().await;
    common::count_a_start(&pool, id, CARRIER_QUEUE).await;
    let mut consumer = consumer(
        &env,
        &[
            "--fail-destination",
            "FAIL",
            "--retry-delay",
            "30s",
            "--max-attempts",
            "5",
        ],
    );
    consumer.wait_for_stderr("attempt failed", Duration::from_secs(30));
    consumer.kill();
    let (started, alone): (i32, i32) = sqlx::query_as(
        "SELECT started, alone FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (started, alone),
        (2, 0),
        "killed in its retry's wait: a start, not one alone"
    );
}

/// Two copies of one message in flight in one process (one on a link lost meanwhile, its redelivery on the next),
/// both abandoned by a clean stop: each start is taken back. The process kept its starts by message id, the second
/// copy's overwriting the first's, and the statement joined the id once: one start was left counted, as a crash.
#[tokio::test(flavor = "multi_thread")]
async fn two_starts_of_one_message_abandoned_by_a_stop_are_both_taken_back() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, alone) VALUES ($1, $2, 3, 1)",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    let consumer_type = inboxctl::inbox::ConsumerType::new(CARRIER_QUEUE).unwrap();
    inboxctl::db::attempts::abandoned(&pool, &consumer_type, &[(id, false), (id, true)])
        .await
        .unwrap();
    let counts: (i32, i32) = sqlx::query_as(
        "SELECT started, alone FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(counts, (1, 0), "both starts taken back, and the one alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_moving_a_failed_message_aside_gives_it_back_and_the_consumer_goes_idle() {
    panic_moving_aside(common::ONE_BY_ONE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_moving_a_failed_batched_message_aside_gives_it_back_and_the_consumer_goes_idle() {
    panic_moving_aside(common::BATCHED).await;
}

/// Moving a failed message aside panics (inboxctl's bug, or a library's: here a failpoint in the dead-letter publish,
/// once). One by one the delivery goes back, as any handling that panics; batched, where the failed member's retries
/// and its copy run in a task beside the worker, it used to stay unsettled for good: a place of the prefetch lost,
/// and `--exit-when-idle` waiting for it forever. It must go back, come round, and be moved aside.
async fn panic_moving_aside(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "FAIL");
    let conn = env.amqp().await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    let _ = conn.close(200, "OK".into()).await;
    common::publish_parcels(&env, &["--count", "5"]);
    let failpoint = format!("dead-letter-publish=panic-once@{id}");
    let mut consumer = env.spawn_with(
        &common::with_mode(
            &[
                "consume",
                "carrier",
                "--fail-destination",
                "FAIL",
                "--max-attempts",
                "1",
                "--exit-when-idle",
                "1s",
            ],
            mode,
        ),
        &[("INBOXCTL_FAILPOINTS", failpoint.as_str())],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "the consumer went idle and ended: {}",
        consumer.stderr()
    );
    assert!(
        consumer.stderr().contains("handling a message panicked"),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 5);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "{}", consumer.stderr());
    assert_eq!(
        copies[0]
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(id.to_string())
    );
}

/// A batch's handling panics after it handed a failed member to a task of its own (here a failpoint in the ack of the
/// batch's other members, once). The worker's clean-up gives back what the batch had not settled — but the failed
/// member is its task's to settle: given back while that task still waits to retry it, it used to come round and run
/// a second chain of attempts beside the first, ending in the error queue twice, with `--max-attempts` counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_panics_leaves_a_member_retried_aside_to_its_task() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "FAIL");
    let conn = env.amqp().await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    let _ = conn.close(200, "OK".into()).await;
    common::publish_parcels(&env, &["--count", "5"]);
    // The batch worker's first look at its queue waits 1.5 s, so that all six are one batch. The failed member's
    // attempts take 3 + 6 s of retry delays: its task still runs when the clean-up's give-back goes out (after its
    // 5 s pause).
    let mut consumer = env.spawn_with(
        &common::with_mode(
            &[
                "consume",
                "carrier",
                "--fail-destination",
                "FAIL",
                "--max-attempts",
                "3",
                "--retry-delay",
                "3s",
                "--exit-when-idle",
                "2s",
            ],
            common::BATCHED,
        ),
        &[(
            "INBOXCTL_FAILPOINTS",
            "batch-next=sleep-once-1500,broker-answer=panic-once@an ack",
        )],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(90)),
        Some(0),
        "the consumer went idle and ended: {}",
        consumer.stderr()
    );
    assert!(
        consumer.stderr().contains("handling a batch panicked"),
        "the failpoint was met: {}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 5);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    let failed: i64 = sqlx::query_scalar(FAILED).fetch_one(&pool).await.unwrap();
    assert_eq!(
        failed,
        3,
        "--max-attempts counted once: {}",
        consumer.stderr()
    );
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "moved aside once: {}", consumer.stderr());
}

/// A redelivered message (a suspect: its start counted once before) whose move aside panics (a failpoint in the
/// dead-letter publish, once): the process goes on, so its start is not an end of the process. Its start used to stay
/// counted — the panic unwound past the books — and with `--poison-after 1` it came round counted as ending the process
/// alone, and was moved aside as poison ("each attempt ended the consumer process"), which never happened. It must
/// be moved aside for what did happen: its attempt failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_moving_a_suspect_aside_is_not_counted_as_an_end_of_the_process() {
    let args = [
        "--fail-destination",
        "FAIL",
        "--max-attempts",
        "1",
        "--poison-after",
        "1",
    ];
    let moved = panic_moving_a_redelivered_message_aside("FAIL", (1, 0), &args).await;
    assert_eq!(moved.fault, "inboxctl::ConsumerFailed", "{}", moved.stderr);
}

/// A message that has ended its process `--poison-after` times alone, whose move aside as poison panics (once): the
/// panic says nothing for the message — its work never ran — so only this start is taken back, and the counts before
/// it stand: it comes round and is moved aside as poison, never processed. Taking the start back as an outcome does
/// (its counts deleted) would have it processed on its next delivery: run again, the poison it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_moving_a_poison_aside_keeps_its_counts() {
    let moved =
        panic_moving_a_redelivered_message_aside("Berlin", (3, 3), &["--poison-after", "3"]).await;
    assert_eq!(moved.fault, "inboxctl::PoisonMessage", "{}", moved.stderr);
    assert_eq!(moved.effects, 0, "never processed: {}", moved.stderr);
}

/// A poison (it ended its process alone `--poison-after` times) whose move aside the broker refuses (the error queue
/// full): no work ran, so its counts stand — the process that gets it next, after a stop, moves it aside at once.
/// Before, surviving the refusal deleted its counts as an outcome does, and the next process ran it again: the
/// poison it is, it would have ended that process and everything in flight beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_whose_move_aside_is_refused_keeps_its_counts() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let conn = env.amqp().await;
    common::declare_queue_that_refuses_everything(&conn, ERROR_QUEUE).await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(common::peek(&conn, CARRIER_QUEUE).await.len(), 1);
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, alone) VALUES ($1, $2, 3, 3)",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    let mut consumer = env.spawn(&["consume", "carrier", "--poison-after", "3"]);
    consumer.wait_for_stderr(
        &format!("could not move a message to {ERROR_QUEUE}"),
        Duration::from_secs(30),
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let alone: Option<i32> = sqlx::query_scalar(
        "SELECT alone FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert_eq!(alone, Some(3), "its counts stand: {}", consumer.stderr());

    // The error queue takes copies again: a new process moves it aside as poison, and never runs it.
    conn.create_channel()
        .await
        .unwrap()
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let out = common::consume_until_idle(&env, &["carrier", "--poison-after", "3"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "{}", out.stderr);
    assert_eq!(
        header_text(&copies[0], "MT-Fault-ExceptionType"),
        "inboxctl::PoisonMessage",
        "{}",
        out.stderr
    );
    assert_eq!(effects(&pool).await, 0, "never processed: {}", out.stderr);
    let attempts = "SELECT count(*) FROM inboxctl_attempts";
    assert_eq!(
        common::count(&pool, attempts).await,
        0,
        "moved aside, its counts go"
    );

    // Refused, then taken by the same process when it comes round (its owed copy): its counts go too — left, a
    // replay of it redelivered once would be moved aside as poison again without running.
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    common::declare_queue_that_refuses_everything(&conn, ERROR_QUEUE).await;
    let second = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(second, "Berlin");
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(common::peek(&conn, CARRIER_QUEUE).await.len(), 1);
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, alone) VALUES ($1, $2, 3, 3)",
    )
    .bind(CARRIER_QUEUE)
    .bind(second)
    .execute(&pool)
    .await
    .unwrap();
    let mut consumer = env.spawn(&["consume", "carrier", "--poison-after", "3"]);
    consumer.wait_for_stderr(
        &format!("could not move a message to {ERROR_QUEUE}"),
        Duration::from_secs(30),
    );
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    common::eventually(
        "moved aside when it came round",
        Duration::from_secs(30),
        || async { env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE).0 == 1 },
    )
    .await;
    common::eventually("its counts gone", Duration::from_secs(10), || async {
        common::count(&pool, attempts).await == 0
    })
    .await;
    assert_eq!(
        effects(&pool).await,
        0,
        "never processed: {}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// What became of a redelivered message whose move aside panicked once.
struct MovedAside {
    /// The `MT-Fault-ExceptionType` of its one copy in the error queue.
    fault: String,
    stderr: String,
    effects: i64,
}

/// A parcel to `destination`, published, looked at and given back (it comes redelivered) with `(started, alone)`
/// starts counted, as earlier processes that ended with it in flight would have left them; then a consumer (`args`,
/// and `--exit-when-idle`) whose first move of it aside panics (a failpoint in the dead-letter publish), run until
/// it goes idle. Its message must have gone back after the panic, come round and been moved aside once.
async fn panic_moving_a_redelivered_message_aside(
    destination: &str,
    (started, alone): (i32, i32),
    args: &[&str],
) -> MovedAside {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, destination);
    let conn = env.amqp().await;
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(common::peek(&conn, CARRIER_QUEUE).await.len(), 1);
    let _ = conn.close(200, "OK".into()).await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, alone) VALUES ($1, $2, $3, $4)",
    )
    .bind(CARRIER_QUEUE)
    .bind(id)
    .bind(started)
    .bind(alone)
    .execute(&pool)
    .await
    .unwrap();
    let failpoint = format!("dead-letter-publish=panic-once@{id}");
    let mut all = vec!["consume", "carrier", "--exit-when-idle", "1s"];
    all.extend_from_slice(args);
    let mut consumer = env.spawn_with(&all, &[("INBOXCTL_FAILPOINTS", failpoint.as_str())]);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "the consumer went idle and ended: {}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert!(stderr.contains("handling a message panicked"), "{stderr}");
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1, "{stderr}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0), "{stderr}");
    MovedAside {
        fault: header_text(&copies[0], "MT-Fault-ExceptionType"),
        effects: effects(&pool).await,
        stderr,
    }
}

// ---- messages the broker accepts that must not crash or stall a consumer ----

/// A message whose id is not UTF-8 (AMQP's short strings are bytes, and RabbitMQ passes them on as written): lapin
/// could not read its frame and closed the connection, and the message came first again on every new one — nothing
/// behind it was ever delivered, to a consumer or to a replay. It is read now, its id's invalid bytes replaced
/// (`vendor/README.md`): the consumer processes it once by its envelope's id, and the messages behind it flow; in a
/// dead-letter queue, a replay leaves it (a copy would not carry the same bytes) and replays what is behind it. So
/// for an id of 86 invalid bytes, and a header's name of them, whose replacements outgrow a short string's 255 bytes
/// (they panicked lapin's I/O thread, which then never read again: no delivery, no ack, no reconnect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_that_is_not_utf8_neither_stalls_a_consumer_nor_a_replay() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let tenant = raw_amqp::table(&[("tenant", raw_amqp::long_string("acme"))]);
    let invalid = [0xFF_u8; 86];
    let oddly_named = raw_amqp::table(&[
        (invalid.as_slice(), raw_amqp::long_string("x")),
        (b"tenant".as_slice(), raw_amqp::long_string("acme")),
    ]);
    // (id, headers) of each odd message: an id of invalid bytes, short or outgrowing; a header's name outgrowing.
    let odd: [(Vec<u8>, &[u8]); 3] = [
        (b"\xff\xfe-not-utf8".to_vec(), &tenant),
        (invalid.to_vec(), &tenant),
        (Uuid::now_v7().to_string().into_bytes(), &oddly_named),
    ];
    let publish_odd = |exchange: &str, queue: &str| {
        for (id, headers) in &odd {
            let (_, body, _) = common::parcel_message(Uuid::now_v7(), "Berlin");
            raw_amqp::publish(
                &env.amqp_addr(),
                &env.vhost,
                exchange,
                queue,
                id,
                inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE,
                headers,
                &body,
            );
        }
    };
    publish_odd(EVENT_EXCHANGE, "");
    common::publish_parcels(&env, &["--count", "20"]);
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 23, "{}", out.stderr);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));

    let dlq = "odd.dlq";
    let conn = env.amqp().await;
    common::capture_queue(&conn, "amq.direct", dlq).await;
    publish_odd("", dlq);
    let behind = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(behind, "Berlin");
    common::publish(&conn, "", dlq, props, &body).await;
    let out = env.run(&["replay", "--from", dlq, "--to", CARRIER_QUEUE, "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    for i in 0..3 {
        assert_eq!(report["items"][i]["action"], "uncopyable", "{report}");
    }
    assert_eq!(report["items"][3]["action"], "replayed", "{report}");
    assert_eq!(
        report["items"][3]["message_id"],
        behind.to_string(),
        "{report}"
    );
    assert_eq!(env.queue_counts(dlq), (3, 0), "left where they were");
}

/// A message that cannot be processed, whose id or header names held bytes that are not UTF-8: its copy in the error
/// queue carries them replaced (lapin reads text only; two names that differed only there are one), and said
/// nothing of it — it was taken for the message, and its replay then left it in the error queue for good (a copy
/// would not carry the same bytes). The copy says so now (`inboxctl-altered`), and a replay moves it back as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_message_with_text_that_is_not_utf8_is_moved_aside_saying_so_and_can_be_replayed()
 {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let tenant = raw_amqp::table(&[("tenant", raw_amqp::long_string("acme"))]);
    let oddly_named = raw_amqp::table(&[
        (b"k\xff".as_slice(), raw_amqp::long_string("1")),
        (b"k\xfe".as_slice(), raw_amqp::long_string("2")),
    ]);
    let odd: [(Vec<u8>, &[u8]); 2] = [
        (b"\xff\xfe-not-utf8".to_vec(), &tenant),
        (Uuid::now_v7().to_string().into_bytes(), &oddly_named),
    ];
    for (id, headers) in &odd {
        raw_amqp::publish(
            &env.amqp_addr(),
            &env.vhost,
            EVENT_EXCHANGE,
            "",
            id,
            inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE,
            headers,
            b"not json",
        );
    }
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let conn = env.amqp().await;
    let copies = common::peek(&conn, &error_queue).await;
    assert_eq!(copies.len(), 2, "{}", out.stderr);
    for copy in &copies {
        let headers = copy.properties.headers().as_ref().unwrap().inner();
        assert!(
            headers.contains_key(inboxctl::amqp::dead_letter::ALTERED_HEADER),
            "{headers:?}"
        );
    }

    common::capture_queue(&conn, "amq.direct", "odd.back").await;
    let out = env.run(&[
        "replay",
        "--from",
        &error_queue,
        "--to",
        "odd.back",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(env.queue_counts("odd.back"), (2, 0));
    assert_eq!(env.queue_counts(&error_queue), (0, 0));
}

in_both_modes!(
    a_header_nested_a_thousand_levels_deep_is_dead_lettered_not_a_crash,
    deep_header
);

async fn deep_header(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    // Written frame by frame: a client library's recursive writer would overflow its own stack first.
    let (_, body, _) = common::parcel_message(Uuid::now_v7(), "Berlin");
    let headers = raw_amqp::table(&[
        ("deep", raw_amqp::nested_table_value("k", 1000)),
        ("tenant", raw_amqp::long_string("acme")),
    ]);
    raw_amqp::publish(
        &env.amqp_addr(),
        &env.vhost,
        EVENT_EXCHANGE,
        "",
        Uuid::now_v7().to_string(),
        inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE,
        &headers,
        &body,
    );
    common::publish_parcels(&env, &["--count", "20"]);
    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
    assert!(!out.stderr.contains("overflow"), "{}", out.stderr);
    let pool = env.pool().await;
    assert_eq!(
        effects(&pool).await,
        20,
        "the messages behind it were processed"
    );
    // The same message in a dead-letter queue as it is (dead-lettered by RabbitMQ, say): replay reads it without
    // crashing, and leaves it, since a copy would not be the message.
    let dlq = "deep.dlq";
    let conn = env.amqp().await;
    common::capture_queue(&conn, "amq.direct", dlq).await;
    raw_amqp::publish(
        &env.amqp_addr(),
        &env.vhost,
        "",
        dlq,
        Uuid::now_v7().to_string(),
        inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE,
        &headers,
        &body,
    );
    let out = env.run(&["replay", "--from", dlq, "--to", CARRIER_QUEUE, "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["items"][0]["action"], "uncopyable", "{report}");
    assert_eq!(env.queue_counts(dlq), (1, 0), "left where it was");
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1);
    assert!(
        header_text(&copies[0], "MT-Fault-Message").contains("nest"),
        "{}",
        header_text(&copies[0], "MT-Fault-Message")
    );
    assert_eq!(
        header_text(&copies[0], "tenant"),
        "acme",
        "the other headers are kept"
    );
    assert!(
        header_text(&copies[0], "deep").contains("nested deeper than 64 levels"),
        "the too-deep value is replaced by a note"
    );
    let copied = copies[0].properties.headers().as_ref().unwrap();
    assert!(inboxctl::amqp::limits::header_depth(copied) <= 64);
}

in_both_modes!(
    a_huge_message_id_or_huge_headers_never_loop_on_reconnects,
    huge_values
);

async fn huge_values(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    // A 70,000-character messageId: the reason that quotes it would not fit in a frame.
    let huge_id = "x".repeat(70_000);
    let body = format!(
        r#"{{"messageId": "{huge_id}", "messageType": ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"], "message": {{"parcelId": "{}", "trackingNumber": "PT1", "destination": "Berlin"}}}}"#,
        Uuid::now_v7()
    );
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        BasicProperties::default(),
        body.as_bytes(),
    )
    .await;
    // A failing message whose own headers take most of a frame: the copy's must be cut to fit.
    let mut headers = FieldTable::default();
    for i in 0..12 {
        headers.insert(format!("h{i}").into(), long(&"v".repeat(10_000)));
    }
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        props.with_headers(headers),
        &body,
    )
    .await;
    common::publish_parcels(&env, &["--count", "300"]);

    let started = Instant::now();
    let out = common::consume_until_idle(
        &env,
        &common::with_mode(
            &[
                "carrier",
                "--fail-destination",
                "FAIL",
                "--max-attempts",
                "1",
            ],
            mode,
        ),
    );
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 300);
    assert!(
        !out.stderr.contains("reconnect"),
        "no connection was lost: {}",
        out.stderr
    );
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 2, "both moved aside");
    for copy in &copies {
        let reason = header_text(copy, "MT-Fault-Message");
        assert!(reason.len() <= 2048, "bounded: {} bytes", reason.len());
    }
    assert!(
        copies.iter().any(|c| header_text(c, "h3").len() == 10_000),
        "the original's own headers are kept whole"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_cannot_fit_a_frame_is_held_not_looped_on() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    // Headers that leave no room in a 128 KB frame for any failure header.
    let mut headers = FieldTable::default();
    for i in 0..13 {
        headers.insert(format!("h{i:02}").into(), long(&"v".repeat(10_000)));
    }
    headers.insert("pad".into(), long(&"p".repeat(780)));
    let unreadable = BasicProperties::default()
        .with_message_id(Uuid::now_v7().to_string().into())
        .with_headers(headers);
    common::publish(&conn, "", CARRIER_QUEUE, unreadable, b"not json").await;
    common::publish_parcels(&env, &["--count", "50"]);
    let mut consumer = consumer(&env, &[]);
    let pool = env.pool().await;
    common::eventually(
        "the healthy messages processed",
        Duration::from_secs(60),
        || async { effects(&pool).await == 50 },
    )
    .await;
    consumer.wait_for_stderr("cannot move a message", Duration::from_secs(30));
    // Held, not given back to come round again at once: a few seconds on, it was tried once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        consumer.stderr().matches("cannot move a message").count(),
        1,
        "{}",
        consumer.stderr()
    );
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!((ready, unacked), (0, 1), "the message held, unacknowledged");
    assert!(
        !consumer.stderr().contains("reconnect"),
        "{}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (1, 0),
        "given back at the stop"
    );
}

/// A NUL character (`\u0000` in JSON) is text to serde and to RabbitMQ, but PostgreSQL's text refuses it: a parcel
/// whose destination holds one is booked, and its text sent (its body quoting the destination was refused, and the
/// parcel dead-lettered), the NUL read as U+FFFD; and a message of a type not handled here whose type holds one is
/// skipped — its `skipped` event was refused by PostgreSQL and missing from the counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_character_in_a_message_is_processed_or_skipped_and_counted() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "Ber\0lin");
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    let skipped_id = Uuid::now_v7();
    let body = format!(
        r#"{{"messageId": "{skipped_id}", "messageType": ["urn:message:Other:Odd\u0000Type"], "message": {{}}}}"#
    );
    let props = BasicProperties::default()
        .with_message_id(skipped_id.to_string().into())
        .with_content_type(inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE.into());
    common::publish(&conn, EVENT_EXCHANGE, "", props, body.as_bytes()).await;
    common::publish_parcels(&env, &["--count", "10"]);
    let texts = common::consume_until_idle(&env, &["notification", "--max-attempts", "1"]);
    assert_eq!(texts.code, Some(0), "{}", texts.stderr);
    let out = common::consume_until_idle(&env, &["carrier", "--max-attempts", "1"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let pool = env.pool().await;
    assert_eq!(effects(&pool).await, 11, "{}", out.stderr);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM notifications_sent").await,
        11,
        "{}",
        texts.stderr
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    assert!(!env.queue_exists(ERROR_QUEUE), "{}", out.stderr);
    assert_eq!(
        take_all(&env, &format!("{CARRIER_QUEUE}_skipped"))
            .await
            .len(),
        1
    );
    let skipped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'skipped' AND message_id = $1 \
         AND consumer_type = $2",
    )
    .bind(skipped_id)
    .bind(CARRIER_QUEUE)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(skipped, 1, "{}", out.stderr);
    assert!(
        !out.stderr.contains("could not record an event"),
        "{}",
        out.stderr
    );
}

// ---- names and panics ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_name_too_long_for_its_dead_letter_queues_is_refused_at_start() {
    let env = TestEnv::migrated().await;
    let queue = "q".repeat(250);
    let out = env.run(&["consume", "carrier", "--queue", &queue]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("at most 247 bytes"), "{}", out.stderr);
}

in_both_modes!(
    a_panic_while_handling_a_message_gives_it_back,
    panic_in_handling
);

async fn panic_in_handling(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    common::publish_parcels(&env, &["--count", "10"]);
    let point = format!("handle=panic-once@{id}");
    let mut args = vec![
        "consume",
        "carrier",
        "--exit-when-idle",
        "1s",
        "--concurrency",
        "4",
    ];
    args.extend_from_slice(mode);
    let mut consumer = env.spawn_with(&args, &[("INBOXCTL_FAILPOINTS", point.as_str())]);
    assert_eq!(
        consumer.wait(Duration::from_secs(90)),
        Some(0),
        "the consumer ends once idle: nothing left unsettled"
    );
    let stderr = consumer.stderr();
    assert!(
        stderr.contains("handling a message panicked")
            || stderr.contains("handling a batch panicked"),
        "{stderr}"
    );
    let pool = env.pool().await;
    common::assert_carrier_exactly_once(&pool, 11).await;
}

// ---- stops that end, and waits that hold nobody up ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_in_time_even_with_work_stuck_on_a_lock() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "4"]);
    let pool = env.pool().await;
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE carrier_reservations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    for run in 1..=4 {
        let mut consumer = consumer(
            &env,
            &["--claim-timeout", "10m", "--shutdown-timeout", "1s"],
        );
        common::eventually("work in flight", Duration::from_secs(30), || async {
            env.queue_counts(CARRIER_QUEUE).1 > 0
        })
        .await;
        let stopped = Instant::now();
        consumer.terminate();
        assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0), "run {run}");
        assert!(
            // Held by the locked claim, it would wait out the 10 min --claim-timeout: 15 s is room for a loaded box.
            stopped.elapsed() < Duration::from_secs(15),
            "run {run}: the process ended {:?} after SIGTERM (shutdown timeout 1 s)",
            stopped.elapsed()
        );
    }
    blocker.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_waits_for_work_in_progress_not_for_a_retry_backoff() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    // S was in flight when a process ended before: a suspect, redelivered. F fails every time (a long backoff ahead
    // of it) and is a first delivery, so its attempt starts at once, while S's start is being counted: F is in its
    // backoff when S asks to run alone.
    let s_id = Uuid::now_v7();
    let (s_props, s_body, _) = common::parcel_message(s_id, "Berlin");
    common::publish(&conn, EVENT_EXCHANGE, "", s_props, &s_body).await;
    let channel = conn.create_channel().await.unwrap();
    let got = channel
        .basic_get(CARRIER_QUEUE.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .unwrap();
    channel
        .basic_nack(
            got.delivery.delivery_tag,
            BasicNackOptions {
                multiple: false,
                requeue: true,
            },
        )
        .await
        .unwrap();
    let (f_props, f_body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
    common::publish(&conn, EVENT_EXCHANGE, "", f_props, &f_body).await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started) VALUES ($1, $2, 1)",
    )
    .bind(CARRIER_QUEUE)
    .bind(s_id)
    .execute(&pool)
    .await
    .unwrap();
    common::publish_parcels(&env, &["--count", "30"]);

    let mut consumer = consumer(
        &env,
        &[
            "--fail-destination",
            "FAIL",
            "--retry-delay",
            "5s",
            "--max-attempts",
            "8",
        ],
    );
    // Within a fraction of F's ~155 s of backoff, everything else is done.
    common::eventually(
        "S and the 30 others processed",
        Duration::from_secs(40),
        || async { effects(&pool).await == 31 },
    )
    .await;
    // F has failed (its line may reach the test's reader of stderr a moment after the effects, on a loaded machine).
    consumer.wait_for_stderr("attempt failed", Duration::from_secs(10));
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (1, 0),
        "F given back at the stop"
    );
}

// ---- dead-letter topology deleted under a running consumer ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_error_queue_or_exchange_is_declared_again() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let mut consumer = consumer(&env, &[]);
    let unreadable =
        || BasicProperties::default().with_message_id(Uuid::now_v7().to_string().into());
    common::publish(&conn, "", CARRIER_QUEUE, unreadable(), b"not json").await;
    common::eventually("the first copy", Duration::from_secs(30), || async {
        env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE).0 == 1
    })
    .await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    common::publish(&conn, "", CARRIER_QUEUE, unreadable(), b"not json").await;
    common::eventually(
        "a copy in the error queue declared again",
        Duration::from_secs(30),
        || async { env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE).0 == 1 },
    )
    .await;
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    channel
        .exchange_delete(
            ERROR_QUEUE.into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .unwrap();
    common::publish(&conn, "", CARRIER_QUEUE, unreadable(), b"not json").await;
    common::eventually(
        "a copy after the exchange too was deleted",
        Duration::from_secs(30),
        || async { env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE).0 == 1 },
    )
    .await;
    // Its ack follows the copy's confirm (and the event's row).
    common::eventually(
        "the message acknowledged",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    // Declared again at the first refusal, not after a refused copy's pause: no copy was ever refused. (A bound on
    // the time, as before, read the broker's books through seconds-long `rabbitmqctl` calls on a loaded box.)
    assert!(
        !consumer.stderr().contains("could not move a message to"),
        "{}",
        consumer.stderr()
    );
}

/// Consuming refused every time (the queue in exclusive use by another client): the consumer connects again, but
/// waits its turn between tries as it does when the broker is down — not a connection, a topology declaration and a
/// warning in a tight loop — and consumes once the queue is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consuming_refused_again_and_again_is_tried_with_a_backoff_not_in_a_tight_loop() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    let _exclusive = channel
        .basic_consume(
            CARRIER_QUEUE.into(),
            "the-test".into(),
            lapin::options::BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut consumer = env.spawn(&["consume", "carrier"]);
    consumer.wait_for_stderr("could not start consuming", Duration::from_secs(30));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let tries = consumer
        .stderr()
        .matches("could not start consuming")
        .count();
    assert!(
        (2..=12).contains(&tries),
        "{tries} tries in 6 s: {}",
        consumer.stderr()
    );
    channel
        .basic_cancel(
            "the-test".into(),
            lapin::options::BasicCancelOptions::default(),
        )
        .await
        .unwrap();
    consumer.wait_for_stderr("consuming queue", Duration::from_secs(30));
    common::publish_parcels(&env, &["--count", "3"]);
    let pool = env.pool().await;
    common::eventually("processed", Duration::from_secs(20), || async {
        effects(&pool).await == 3
    })
    .await;
    let _ = conn.close(200, "OK".into()).await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// Copies at once to two destinations on the consumer's one dead-letter channel: unreadable messages to the error
/// queue, whose binding the test keeps removing (each such copy comes back unroutable, and the consumer binds it again),
/// and messages of a type not handled to the skipped queue, routed. lapin hands a returned message to whichever
/// confirm on the channel completes next, not to the publish it belongs to: with copies in flight together, an
/// unroutable copy could be taken for confirmed and its message acknowledged — lost — and a routed one taken for
/// returned and sent twice. Every message must reach its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_at_once_to_an_unbound_error_queue_and_the_skipped_queue_each_arrive_and_none_is_lost()
 {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let mut consumer = env.spawn(&["consume", "carrier", "--concurrency", "16"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(60));
    // Persistent, so that each routed copy's confirm waits for the disk and several come in one acknowledgement.
    let properties = |id: Uuid| {
        BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_delivery_mode(2)
    };
    let other_type = |id: Uuid| {
        format!(
            r#"{{"messageId": "{id}", "messageType": ["urn:message:Other:LabelPrinted"], "message": {{}}}}"#
        )
    };
    let skipped_queue = format!("{CARRIER_QUEUE}_skipped");
    let other = Uuid::now_v7();
    for (id, body) in [
        (Uuid::now_v7(), b"not json".to_vec()),
        (other, other_type(other).into_bytes()),
    ] {
        common::publish(&conn, "", CARRIER_QUEUE, properties(id), &body).await;
    }
    common::eventually("both queues declared", Duration::from_secs(30), || async {
        env.queue_exists(ERROR_QUEUE) && env.queue_exists(&skipped_queue)
    })
    .await;

    // Three bursts: the race is a matter of timing, and one burst shows it only about every other time.
    let (mut unreadable, mut unhandled) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (errors, skips) = burst(&env, &conn, &properties, &other_type).await;
        unreadable.extend(errors);
        unhandled.extend(skips);
    }
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let ids_in = |deliveries: Vec<lapin::message::Delivery>| -> std::collections::HashSet<String> {
        deliveries
            .iter()
            .filter_map(|d| d.properties.message_id().as_ref().map(|id| id.to_string()))
            .collect()
    };
    let errors = ids_in(take_all(&env, ERROR_QUEUE).await);
    let skipped = ids_in(take_all(&env, &skipped_queue).await);
    let lost: Vec<&Uuid> = unreadable
        .iter()
        .filter(|id| !errors.contains(&id.to_string()))
        .chain(
            unhandled
                .iter()
                .filter(|id| !skipped.contains(&id.to_string())),
        )
        .collect();
    assert!(
        lost.is_empty(),
        "acknowledged with no copy: {lost:?}\n{}",
        consumer.stderr()
    );
}

/// One burst of [`copies_at_once_to_an_unbound_error_queue_and_the_skipped_queue_each_arrive_and_none_is_lost`]: 250
/// unreadable messages and 250 of a type not handled, published at once while the error queue's binding is removed
/// every 2 ms; returns once the queue is empty again, with their ids.
async fn burst(
    env: &TestEnv,
    conn: &lapin::Connection,
    properties: &impl Fn(Uuid) -> BasicProperties,
    other_type: &impl Fn(Uuid) -> String,
) -> (Vec<Uuid>, Vec<Uuid>) {
    let unbinding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let unbinder = {
        let (channel, unbinding) = (conn.create_channel().await.unwrap(), unbinding.clone());
        tokio::spawn(async move {
            while unbinding.load(std::sync::atomic::Ordering::SeqCst) {
                channel
                    .queue_unbind(
                        ERROR_QUEUE.into(),
                        ERROR_QUEUE.into(),
                        "".into(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let unreadable: Vec<Uuid> = (0..250).map(|_| Uuid::now_v7()).collect();
    let unhandled: Vec<Uuid> = (0..250).map(|_| Uuid::now_v7()).collect();
    let bodies: Vec<(Uuid, Vec<u8>)> = unreadable
        .iter()
        .map(|id| (*id, b"not json".to_vec()))
        .chain(
            unhandled
                .iter()
                .map(|id| (*id, other_type(*id).into_bytes())),
        )
        .collect();
    futures_util::future::join_all(
        bodies
            .iter()
            .map(|(id, body)| common::publish(conn, "", CARRIER_QUEUE, properties(*id), body)),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    unbinding.store(false, std::sync::atomic::Ordering::SeqCst);
    unbinder.await.unwrap();
    // What came back unroutable twice goes back to the queue and comes round: bound again by then.
    common::eventually(
        "every message moved aside",
        Duration::from_secs(60),
        // A message is acknowledged only once its copy is confirmed: with the queue empty, every copy is in.
        || async { env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    (unreadable, unhandled)
}

// ---- a dead-letter copy the broker refuses ----

/// A carrier consumer with half its prefetch of 4 soon held back by messages to `FAIL` that fail once and cannot be
/// moved aside (the error queue refusing): the tail copy's condition.
fn held_back_consumer(env: &TestEnv) -> common::Proc {
    env.spawn(&[
        "consume",
        "carrier",
        "--concurrency",
        "2",
        "--prefetch",
        "4",
        "--fail-destination",
        "FAIL",
        "--max-attempts",
        "1",
    ])
}

/// The carrier's error queue declared full (`x-max-length` 0, `reject-publish`): the broker refuses every copy.
async fn refusing_error_queue(env: &TestEnv) {
    common::ensure_endpoints(env).await;
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    let mut full = FieldTable::default();
    full.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    full.insert("x-overflow".into(), long("reject-publish"));
    channel
        .queue_declare(
            ERROR_QUEUE.into(),
            lapin::options::QueueDeclareOptions::durable(),
            full,
        )
        .await
        .unwrap();
    let _ = conn.close(200, "OK".into()).await;
}

/// A carrier consumer whose one message failed and is owed its copy: the error queue is declared full
/// (`x-max-length` 0, `reject-publish`), so the broker refuses the copy and the message goes back to its queue.
/// Returns the consumer (`-v`, `consumer_env` set), a pool of the test's own, the message's id and consumer_type.
async fn owed_one(
    env: &TestEnv,
    consumer_env: &[(&str, &str)],
) -> (common::Proc, sqlx::PgPool, Uuid, String) {
    refusing_error_queue(env).await;
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "4",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "1",
            "-v",
        ],
        consumer_env,
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(60));
    let out = env.run(&[
        "publish",
        "parcel-created",
        "--count",
        "1",
        "--destination",
        "FAIL",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    consumer.wait_for_stderr("could not move a message", Duration::from_secs(30));
    let pool = env.pool().await;
    let (id, consumer_type): (Uuid, String) = sqlx::query_as(
        "SELECT message_id, consumer_type FROM inboxctl_events WHERE kind = 'failed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    (consumer, pool, id, consumer_type)
}

const FAILED: &str = "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'";

/// More messages that cannot be moved aside (their copies refused) than the prefetch, at the head of the queue: each
/// goes back after its pause to the queue's tail, not its head, so the healthy messages behind them are delivered and
/// processed meanwhile. Given back with a requeue (to the head), the same ones came round every time, and nothing
/// behind them was ever delivered while the error queue refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_that_cannot_be_moved_aside_do_not_starve_the_healthy_ones_behind_them() {
    let env = TestEnv::migrated().await;
    refusing_error_queue(&env).await;
    let out = env.run(&[
        "publish",
        "parcel-created",
        "--count",
        "6",
        "--destination",
        "FAIL",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let out = env.run(&["publish", "parcel-created", "--count", "20"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut consumer = held_back_consumer(&env);
    let pool = env.pool().await;
    common::eventually(
        "the healthy messages processed while the error queue refuses",
        Duration::from_secs(45),
        || async { effects(&pool).await == 20 },
    )
    .await;
    // The six are still on the queue, owed their copies, not lost.
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 6, "{}", consumer.stderr());
    assert_eq!(
        common::count(&pool, FAILED).await,
        6,
        "{}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!((ready, unacked), (6, 0));
}

/// A message with a per-message TTL (`expiration`) put at the tail of its queue carries it in a header, not as a TTL:
/// republished, its TTL would start again, and behind a backlog the copy could expire at the tail, unseen, its
/// original acknowledged. Four of them failing, the error queue refusing their copies, half the prefetch held back:
/// each is put at the tail after its pause, with `inboxctl-original-expiration`, and no `expiration`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_put_at_the_tail_keeps_its_ttl_in_a_header_not_as_a_ttl() {
    let env = TestEnv::migrated().await;
    refusing_error_queue(&env).await;
    let conn = env.amqp().await;
    for _ in 0..4 {
        let (props, body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
        let props = props.with_expiration("600000".into());
        common::publish(&conn, "", CARRIER_QUEUE, props, &body).await;
    }
    let mut consumer = held_back_consumer(&env);
    // Refused twice each: all came round once at least after the first pause.
    consumer.wait_for_stderr_times("could not move a message to", 8, Duration::from_secs(40));
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let left = common::drain(&conn, CARRIER_QUEUE).await;
    assert_eq!(left.len(), 4, "{}", consumer.stderr());
    let mut at_the_tail = 0;
    for m in &left {
        let headers = m.properties.headers().clone().unwrap_or_default();
        let expiration = m
            .properties
            .expiration()
            .as_ref()
            .map(|e| e.as_str().to_owned());
        if headers
            .inner()
            .contains_key(inboxctl::amqp::tail::GIVEN_BACK_HEADER)
        {
            at_the_tail += 1;
            assert_eq!(expiration, None, "{:?}", m.properties);
            assert_eq!(
                common::header_text(&m.properties, "inboxctl-original-expiration").as_deref(),
                Some("600000"),
                "{:?}",
                m.properties
            );
        } else {
            assert_eq!(expiration.as_deref(), Some("600000"));
        }
    }
    assert!(
        at_the_tail > 0,
        "none was put at the tail: {}",
        consumer.stderr()
    );
}

/// A message whose copy to the error queue the broker refuses (a nack: the queue full) goes back to its queue, owed
/// its copy: each time it comes round it goes straight to the copy, its work not tried again. Processed meanwhile by
/// another process (its inbox row committed there, its ack lost), it is a copy like any other when it comes round:
/// acknowledged as a duplicate, not moved aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_owed_its_copy_is_not_tried_again_nor_moved_aside_once_processed_elsewhere() {
    let env = TestEnv::migrated().await;
    let (mut consumer, pool, id, consumer_type) = owed_one(&env, &[]).await;
    // Given back after a pause of 5 s each time: round twice, and not tried again.
    consumer.wait_for_stderr_times(
        "moving it without trying it again",
        2,
        Duration::from_secs(40),
    );
    assert_eq!(
        common::count(&pool, FAILED).await,
        1,
        "{}",
        consumer.stderr()
    );
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 1);

    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) VALUES ($1, $2, now(), now())",
    )
    .bind(id)
    .bind(&consumer_type)
    .execute(&pool)
    .await
    .unwrap();
    common::eventually(
        "the message acknowledged as a copy",
        Duration::from_secs(20),
        || async { env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    let duplicates = "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'";
    assert_eq!(common::count(&pool, duplicates).await, 1);
    assert_eq!(common::count(&pool, FAILED).await, 1);
    assert_eq!(env.queue_counts(ERROR_QUEUE), (0, 0));
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// Owed its copy, the message's id taken meanwhile by another event (its inbox row and fingerprint committed by
/// another process): the look at its claim finds the conflict, and the message is moved aside as a conflict — not
/// acknowledged as a duplicate, which would lose it, nor copied with its old fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_owed_its_copy_whose_id_another_event_took_meanwhile_is_moved_aside_as_a_conflict()
 {
    let env = TestEnv::migrated().await;
    let (mut consumer, pool, id, consumer_type) = owed_one(&env, &[]).await;
    let mut another = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) VALUES ($1, $2, now(), now())",
    )
    .bind(id)
    .bind(&consumer_type)
    .execute(&mut *another)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint) VALUES ($1, $2, decode(repeat('00', 16), 'hex'))",
    )
    .bind(id)
    .bind(&consumer_type)
    .execute(&mut *another)
    .await
    .unwrap();
    another.commit().await.unwrap();
    consumer.wait_for_stderr(
        "message id reused for another event",
        Duration::from_secs(30),
    );
    // The error queue takes copies again: deleted, it is declared anew by the consumer's next copy.
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    common::eventually(
        "the message moved aside",
        Duration::from_secs(30),
        || async {
            env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && env.queue_exists(ERROR_QUEUE)
                && env.queue_counts(ERROR_QUEUE).0 == 1
        },
    )
    .await;
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_eq!(copies.len(), 1);
    assert_eq!(
        header_text(&copies[0], "MT-Fault-ExceptionType"),
        "inboxctl::MessageIdConflict",
        "{}",
        consumer.stderr()
    );
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM inboxctl_events WHERE kind <> 'processed' ORDER BY kind",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // Its one failed attempt, then the conflict the look's claim recorded: no duplicate, no second attempt.
    assert_eq!(kinds, ["conflict", "failed"], "{}", consumer.stderr());
    let _ = conn.close(200, "OK".into()).await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A message owed its copy (the error queue refusing it), and a replay's copy of the same message — the same id and
/// event, sent later by `inboxctl replay` — that comes round as a redelivery (given back at the tail, as a consumer
/// gives back one it could not settle): the replay's copy is a new message, tried. It used to take the decision made
/// about the first one, and go to the error queue with its fault, never tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replays_copy_of_a_message_owed_its_copy_is_tried_not_moved_aside_with_the_old_fault() {
    let env = TestEnv::migrated().await;
    refusing_error_queue(&env).await;
    let conn = env.amqp().await;
    let id = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "FAIL");
    common::publish(&conn, "", CARRIER_QUEUE, props.clone(), &body).await;
    let mut consumer = consumer(
        &env,
        &["--fail-destination", "FAIL", "--max-attempts", "1", "-v"],
    );
    consumer.wait_for_stderr("could not move a message", Duration::from_secs(30));
    let pool = env.pool().await;
    assert_eq!(common::count(&pool, FAILED).await, 1);

    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(
        inboxctl::amqp::copy::REPLAY_RUN_HEADER.into(),
        long("a-later-replay"),
    );
    headers.insert(
        inboxctl::amqp::copy::REPLAY_COUNT_HEADER.into(),
        AMQPValue::LongInt(1),
    );
    headers.insert(
        inboxctl::amqp::tail::GIVEN_BACK_HEADER.into(),
        AMQPValue::LongLongInt(1),
    );
    common::publish(&conn, "", CARRIER_QUEUE, props.with_headers(headers), &body).await;
    common::eventually(
        "the replay's copy tried (and failed: its destination fails)",
        Duration::from_secs(30),
        || async { common::count(&pool, FAILED).await == 2 },
    )
    .await;
    // Each owed its own copy now, and neither tried again as they come round.
    let moved = "moving it without trying it again";
    let times = consumer.stderr().matches(moved).count() + 2;
    consumer.wait_for_stderr_times(moved, times, Duration::from_secs(40));
    assert_eq!(
        common::count(&pool, FAILED).await,
        2,
        "{}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// Owed its copy, the message comes round while PostgreSQL is unreachable: the look at its claim cannot be made, so
/// the copy waits for the database, as an attempt does — neither made blind (another process may have processed the
/// message meanwhile) nor the work tried again — and is made once the look says the message was not processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_owed_its_copy_waits_out_a_database_outage_for_its_look_and_is_not_tried_again() {
    let env = TestEnv::migrated().await;
    let proxy = common::Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let (mut consumer, pool, _, _) = owed_one(&env, &[("DATABASE_URL", proxied.as_str())]).await;
    // Within the 5 s the refused copy's message is held before it goes back: the error queue takes copies again
    // (deleted, the consumer's next copy declares it anew), and the database is cut. A copy made without the look
    // would be there as soon as the look failed.
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(ERROR_QUEUE.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    proxy.cut();
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(6) {
        assert!(
            !env.queue_exists(ERROR_QUEUE) || env.queue_counts(ERROR_QUEUE) == (0, 0),
            "a copy made while the look could not be: {}",
            consumer.stderr()
        );
        let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
        assert_eq!(ready + unacked, 1, "the message kept through the outage");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    proxy.restore();
    let moved = common::within(Duration::from_secs(30), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 0)
            && env.queue_exists(ERROR_QUEUE)
            && env.queue_counts(ERROR_QUEUE).0 == 1
    })
    .await;
    assert!(
        moved,
        "the message moved aside once the database is back: {}",
        consumer.stderr()
    );
    let copies = take_all(&env, ERROR_QUEUE).await;
    assert_ne!(
        header_text(&copies[0], "MT-Fault-ExceptionType"),
        "inboxctl::MessageIdConflict"
    );
    assert_eq!(
        common::count(&pool, FAILED).await,
        1,
        "tried once: {}",
        consumer.stderr()
    );
    let _ = conn.close(200, "OK".into()).await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A panic in a consumer's work is caught and counted as the message's failure, but Rust's own hook printed it first,
/// as it was: a panic that quotes the message's text (here a failpoint quoting the parcel's destination) wrote its
/// escape sequences and direction overrides to the operator's terminal, and a password in it in clear. The panic is
/// printed masked and escaped now, in Rust's shape.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_is_printed_masked_and_escaped() {
    let stderr = run_a_panicking_consumer(&[]).await;
    assert!(stderr.contains("panicked at"), "{stderr}");
    assert!(stderr.contains("failpoint carrier at ***"), "{stderr}");
}

/// Under `--log-format json` the panic is one more JSON line of the log, masked and escaped like the others: a log
/// shipper reading JSON lines gets every line, the panic's among them.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_under_json_logs_is_one_json_line_masked_and_escaped() {
    let stderr = run_a_panicking_consumer(&["--log-format", "json"]).await;
    let mut panics = 0;
    // The failpoint's own `failpoint … reached` line is the test build's, written raw for the tests to wait on.
    for line in stderr.lines().filter(|l| !l.starts_with("failpoint ")) {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}\n{stderr}"));
        if event["panic"].is_string() {
            panics += 1;
            assert_eq!(event["level"], "ERROR", "{line}");
            assert!(
                event["panic"]
                    .as_str()
                    .unwrap()
                    .contains("failpoint carrier at ***"),
                "{line}"
            );
            assert!(
                event["location"].as_str().unwrap().contains(".rs:"),
                "{line}"
            );
        }
    }
    assert_eq!(panics, 1, "{stderr}");
}

/// A consumer whose work panics on a message whose destination holds the database URL's password and terminal
/// escapes; `extra` goes before the command. Returns its stderr, checked for neither.
#[cfg(feature = "failpoints")]
async fn run_a_panicking_consumer(extra: &[&str]) -> String {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let secret = "Pw-Secret9";
    let database_url =
        env.database_url
            .replacen("://postgres@", &format!("://postgres:{secret}@"), 1);
    assert_ne!(
        database_url, env.database_url,
        "the test's URL has no password"
    );
    let destination = format!("{secret}\u{1b}[2J\u{202e}tail");
    let conn = env.amqp().await;
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), &destination);
    common::publish(&conn, "", CARRIER_QUEUE, props, &body).await;
    let failpoint = format!("carrier=panic@{destination}");
    let mut args = extra.to_vec();
    args.extend([
        "consume",
        "carrier",
        "--max-attempts",
        "1",
        "--exit-when-idle",
        "1s",
    ]);
    let mut consumer = env.spawn_with(
        &args,
        &[
            ("INBOXCTL_FAILPOINTS", failpoint.as_str()),
            ("DATABASE_URL", database_url.as_str()),
        ],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert!(!stderr.contains(secret), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}') && !stderr.contains('\u{202e}'),
        "{stderr:?}"
    );
    stderr
}

/// A library consumer's message whose decoding (a `deserialize_with` of its own) panics on one destination.
#[derive(Debug, Clone, serde::Serialize)]
struct PanickyEvent;

impl<'de> serde::Deserialize<'de> for PanickyEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let event = inboxctl::parcel::ParcelCreatedEvent::deserialize(d)?;
        assert!(
            event.destination != "PANIC",
            "the decoder's own bug, on its one message"
        );
        Ok(Self)
    }
}

struct PanickyDecoder;

impl inboxctl::consumer::Consumer for PanickyDecoder {
    type Message = PanickyEvent;
    const MESSAGE_TYPE: &'static str = inboxctl::parcel::PARCEL_CREATED_URN;

    async fn consume<'c>(
        &'c self,
        _tx: &'c mut sqlx::PgConnection,
        _context: &'c inboxctl::consumer::MessageContext,
        _message: &'c Self::Message,
    ) -> Result<(), inboxctl::inbox::WorkError> {
        Ok(())
    }
}

/// Through the library, a consumer whose message decoding panics on one message (the same at every delivery): that
/// message is moved to the error queue as one that cannot be read, the other processed, and the run ends idle. It
/// was taken for a panic of inboxctl's handling and given back every 5 s for ever: never in the error queue, and
/// `exit_when_idle` never reached.
#[tokio::test(flavor = "multi_thread")]
async fn a_library_consumers_decoder_panicking_on_a_message_moves_it_to_the_error_queue() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let queue = "panicky-decoder";
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_endpoint(&conn, EVENT_EXCHANGE, queue, common::queue_type())
        .await
        .unwrap();
    for destination in ["PANIC", "Berlin"] {
        let (props, body, _) = common::parcel_message(Uuid::new_v4(), destination);
        common::publish(&conn, "", queue, props, &body).await;
    }
    let inbox = inboxctl::inbox::Inbox::new(
        pool.clone(),
        inboxctl::inbox::ConsumerType::new(queue).unwrap(),
    );
    let broker = inboxctl::amqp::Broker::from_url(&env.amqp_url).unwrap();
    let options = common::library_options(queue);
    let summary = tokio::time::timeout(
        Duration::from_secs(30),
        inboxctl::consumer::run(
            inbox,
            PanickyDecoder,
            &broker,
            options,
            tokio_util::sync::CancellationToken::new(),
        ),
    )
    .await
    .expect("the run ends idle: the message that panics is not given back for ever")
    .unwrap();
    assert_eq!(summary.processed, 1);
    let moved = common::peek(&conn, &format!("{queue}_error")).await;
    assert_eq!(moved.len(), 1);
    let headers = moved[0].properties.headers().clone().unwrap_or_default();
    let reason = match headers.inner().get("MT-Fault-Message") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("{other:?}"),
    };
    assert!(
        reason.contains("panicked") && reason.contains("the decoder's own bug"),
        "{reason}"
    );
    assert_eq!(env.queue_counts(queue), (0, 0));
}
