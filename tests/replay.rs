//! `inboxctl replay` against real RabbitMQ and PostgreSQL: MassTransit error queues and dead-letter-exchange queues
//! back to their origin, byte for byte, exactly one effect, safe to repeat and to crash.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, EVENT_EXCHANGE, TestEnv, peek};
use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};

const ERROR_QUEUE: &str = "parcel-created-carrier_error";
/// The captured fixtures failed on 2026-11-30: a window that keeps them inside it whenever these tests run.
const FIXTURE_RETENTION: &str = "36500d";

async fn error_queue(conn: &Connection) {
    inboxctl::amqp::topology::ensure_dead_letter_queue(conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
}

fn replay_json(env: &TestEnv, args: &[&str], expected_code: i32) -> serde_json::Value {
    let mut all = vec!["replay", "--json"];
    all.extend_from_slice(args);
    let out = env.run(&all);
    assert_eq!(out.code, Some(expected_code), "{out:?}");
    serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

#[tokio::test(flavor = "multi_thread")]
async fn masstransit_error_messages_go_back_byte_for_byte_and_are_consumed_once() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    // published-03 was in fact processed before its copy was dead-lettered (say, a timeout after the commit).
    let processed_before = common::fixture("published/published-03.json");
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        processed_before.properties.clone(),
        &processed_before.body,
    )
    .await;
    common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );

    error_queue(&conn).await;
    let errors = common::fixtures("error");
    for f in &errors {
        common::publish(&conn, ERROR_QUEUE, "", f.properties.clone(), &f.body).await;
    }

    let report = replay_json(
        &env,
        &["--from", ERROR_QUEUE, "--retention", FIXTURE_RETENTION],
        0,
    );
    assert_eq!(report["snapshot"], 3);
    assert_eq!(report["replayed"], 3);
    assert_eq!(
        env.queue_counts(ERROR_QUEUE),
        (0, 0),
        "acked after the confirm"
    );

    let back = peek(&conn, CARRIER_QUEUE).await;
    assert_eq!(back.len(), 3);
    for (copy, original) in back.iter().zip(&errors) {
        assert_eq!(
            copy.data, original.body,
            "{}: body byte for byte",
            original.name
        );
        assert_eq!(
            copy.properties.message_id(),
            original.properties.message_id(),
            "{}",
            original.name
        );
        assert_eq!(
            copy.properties.content_type(),
            original.properties.content_type()
        );
        assert_eq!(
            copy.properties.delivery_mode(),
            original.properties.delivery_mode()
        );
        let headers = copy.properties.headers().as_ref().unwrap().inner();
        assert!(
            !headers.keys().any(|k| k.as_str().starts_with("MT-")),
            "failure headers dropped: {headers:?}"
        );
        assert_eq!(
            headers.get("inboxctl-replay-count"),
            Some(&AMQPValue::LongInt(1))
        );
    }

    let out = common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(
        out.stderr.matches("duplicate discarded").count(),
        1,
        "{}",
        out.stderr
    );
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT message_id FROM carrier_reservations ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut expected: Vec<uuid::Uuid> = errors
        .iter()
        .map(|f| uuid::Uuid::parse_str(&f.message_id).unwrap())
        .collect();
    expected.sort();
    assert_eq!(
        ids, expected,
        "one effect each; the one processed before is not repeated"
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_between_republish_and_ack_then_a_second_replay_leaves_one_effect() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let f = common::fixture("error/error-02.json");
    common::publish(&conn, ERROR_QUEUE, "", f.properties.clone(), &f.body).await;

    let mut replay = env.spawn_with(
        &[
            "replay",
            "--from",
            ERROR_QUEUE,
            "--retention",
            FIXTURE_RETENTION,
        ],
        &[("INBOXCTL_FAILPOINTS", "replay-after-publish")],
    );
    replay.wait_for_stderr(
        "failpoint replay-after-publish reached",
        Duration::from_secs(30),
    );
    replay.kill();
    common::eventually(
        "the unacked copy back in the error queue",
        Duration::from_secs(10),
        || async { env.queue_counts(ERROR_QUEUE) == (1, 0) },
    )
    .await;
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (1, 0),
        "the confirmed republish is on the origin queue"
    );

    let report = replay_json(
        &env,
        &["--from", ERROR_QUEUE, "--retention", FIXTURE_RETENTION],
        0,
    );
    assert_eq!(report["replayed"], 1);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (2, 0), "two copies now");

    let out = common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );
    assert!(
        out.stderr.contains("duplicate discarded"),
        "the inbox absorbs the second copy"
    );
}

/// A queue with a RabbitMQ dead-letter exchange, and `n` messages rejected into its dead-letter queue.
async fn dead_lettered(conn: &Connection, n: usize) -> Vec<Vec<u8>> {
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-dead-letter-exchange".into(), long(""));
    args.insert("x-dead-letter-routing-key".into(), long("orders.dlq"));
    channel
        .queue_declare("orders".into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    channel
        .queue_declare(
            "orders.dlq".into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut bodies = Vec::new();
    for i in 0..n {
        let body = format!("{{\"order\": {i}}}").into_bytes();
        let mut headers = FieldTable::default();
        headers.insert("tenant".into(), long("acme"));
        let props = BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_headers(headers);
        common::publish(conn, "", "orders", props, &body).await;
        bodies.push(body);
    }
    for _ in 0..n {
        let m = channel
            .basic_get("orders".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .unwrap();
        m.delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    let _ = channel.close(200, "OK".into()).await;
    bodies
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_exchange_queue_goes_back_to_its_origin_and_a_dry_run_moves_nothing() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let bodies = dead_lettered(&conn, 5).await;
    common::eventually("five dead-lettered", Duration::from_secs(10), || async {
        env.queue_counts("orders.dlq") == (5, 0)
    })
    .await;
    let before = peek(&conn, "orders.dlq").await;

    let dry = replay_json(&env, &["--from", "orders.dlq", "--dry-run"], 0);
    assert_eq!(dry["snapshot"], 5);
    for item in dry["items"].as_array().unwrap() {
        assert_eq!(item["origin"], "orders");
        assert_eq!(item["reason"], "rejected");
        assert_eq!(item["action"], "would_replay");
    }
    let after = peek(&conn, "orders.dlq").await;
    assert_eq!(after.len(), 5, "same count");
    for ((a, b), body) in after.iter().zip(&before).zip(&bodies) {
        assert_eq!(&a.data, body, "same order");
        assert_eq!(a.data, b.data);
        assert_eq!(a.properties.message_id(), b.properties.message_id());
        assert_eq!(
            a.properties.headers(),
            b.properties.headers(),
            "same headers, x-death included"
        );
    }
    assert_eq!(env.queue_counts("orders"), (0, 0));

    let report = replay_json(&env, &["--from", "orders.dlq"], 0);
    assert_eq!(report["replayed"], 5);
    assert_eq!(env.queue_counts("orders.dlq"), (0, 0));
    let back = peek(&conn, "orders").await;
    assert_eq!(
        back.iter().map(|d| d.data.clone()).collect::<Vec<_>>(),
        bodies,
        "all back, in order"
    );
    for d in &back {
        let h = d.properties.headers().as_ref().unwrap().inner();
        assert!(
            !h.contains_key("x-death")
                && !h.keys().any(|k| k.as_str().starts_with("x-first-death")),
            "{h:?}"
        );
        assert_eq!(h.get("tenant"), Some(&long("acme")));
    }
}

/// A message dead-lettered twice: expired from a delay queue into `orders` (its dead-letter exchange), then rejected
/// there into `orders.dlq`. It failed in `orders`, and goes back there: taken from the first dead-lettering, its
/// origin was the delay queue, where the copy (without the expiration it had) waited for ever with no consumer. And a
/// message rejected, then expired from its dead-letter queue into an archive: it goes back where it was rejected.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_dead_lettered_twice_goes_back_to_the_queue_it_failed_in_last() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    // A queue dead-lettering into `to` (after `ttl` ms, if given), by the default exchange.
    let declare = |name: &'static str, to: Option<&'static str>, ttl: Option<i32>| {
        let channel = channel.clone();
        async move {
            let mut args = FieldTable::default();
            if let Some(to) = to {
                args.insert("x-dead-letter-exchange".into(), long(""));
                args.insert("x-dead-letter-routing-key".into(), long(to));
            }
            if let Some(ttl) = ttl {
                args.insert(
                    "x-message-ttl".into(),
                    lapin::types::AMQPValue::LongInt(ttl),
                );
            }
            channel
                .queue_declare(name.into(), QueueDeclareOptions::durable(), args)
                .await
                .unwrap();
        }
    };
    let in_queue = |queue: &'static str| {
        let env = &env;
        async move {
            common::eventually(
                &format!("one in {queue}"),
                Duration::from_secs(10),
                || async { env.queue_counts(queue) == (1, 0) },
            )
            .await;
        }
    };
    let reject_from = |queue: &'static str| {
        let channel = channel.clone();
        async move {
            let m = channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
                .unwrap();
            m.delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
        }
    };
    let replayed_back_to = |from: &'static str, origin: &'static str| {
        let report = replay_json(&env, &["--from", from], 0);
        assert_eq!(report["replayed"], 1, "{report}");
        assert_eq!(report["items"][0]["origin"], origin, "{report}");
        assert_eq!(report["items"][0]["reason"], "rejected", "{report}");
        assert_eq!(env.queue_counts(origin), (1, 0));
    };

    declare("orders.delay", Some("orders"), None).await;
    declare("orders", Some("orders.dlq"), None).await;
    declare("orders.dlq", None, None).await;
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_expiration("1".into());
    common::publish(&conn, "", "orders.delay", props, b"{\"order\": 1}").await;
    in_queue("orders").await;
    reject_from("orders").await;
    in_queue("orders.dlq").await;
    replayed_back_to("orders.dlq", "orders");
    assert_eq!(env.queue_counts("orders.delay"), (0, 0));

    // The other way round: rejected in `jobs` into `jobs.dlq`, whose TTL then moves it into `jobs.archive`. It
    // failed in `jobs`, not in the dead-letter queue the newest death names.
    declare("jobs", Some("jobs.dlq"), None).await;
    declare("jobs.dlq", Some("jobs.archive"), Some(1)).await;
    declare("jobs.archive", None, None).await;
    let props = BasicProperties::default().with_message_id(uuid::Uuid::new_v4().to_string().into());
    common::publish(&conn, "", "jobs", props, b"{\"job\": 1}").await;
    in_queue("jobs").await;
    reject_from("jobs").await;
    in_queue("jobs.archive").await;
    replayed_back_to("jobs.archive", "jobs");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_queue_that_does_not_exist_is_a_clear_error() {
    let env = TestEnv::bare().await;
    let out = env.run(&["replay", "--from", "no-such-queue_error"]);
    assert_eq!(out.code, Some(66), "{out:?}");
    assert!(
        out.stderr
            .contains("queue \"no-such-queue_error\" does not exist"),
        "{}",
        out.stderr
    );
}

/// An error-queue message as inboxctl's consumer writes it, failed `age` ago, replayed `replays` times before.
async fn failed_message(
    conn: &Connection,
    reason: &str,
    age: chrono::TimeDelta,
    replays: i32,
) -> String {
    let id = uuid::Uuid::new_v4();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let mut headers = FieldTable::default();
    headers.insert("MT-Reason".into(), long("fault"));
    headers.insert("MT-Fault-Message".into(), long(reason));
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://127.0.0.1/parcel-created-carrier"),
    );
    let when = inboxctl::amqp::envelope::format_time(chrono::Utc::now() - age);
    headers.insert("MT-Fault-Timestamp".into(), long(&when));
    if replays > 0 {
        headers.insert("inboxctl-replay-count".into(), AMQPValue::LongInt(replays));
    }
    common::publish(conn, ERROR_QUEUE, "", props.with_headers(headers), &body).await;
    id.to_string()
}

/// A copy whose headers say nothing of when it failed (a skipped one, a producer's own) is aged by when it was
/// published, as `cleanup`'s guard and `stats` age it: published 8 days ago, past the 7-day window, it is left
/// (`expired`) — its inbox row may be gone, and replayed, a message processed before would be processed again. It
/// was taken for one within the window, and replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_without_a_failure_time_is_aged_by_when_it_was_published() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let id = uuid::Uuid::new_v4();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://127.0.0.1/parcel-created-carrier"),
    );
    let published = (chrono::Utc::now() - chrono::TimeDelta::days(8)).timestamp() as u64;
    let props = props.with_headers(headers).with_timestamp(published);
    common::publish(&conn, ERROR_QUEUE, "", props, &body).await;
    let report = replay_json(&env, &["--from", ERROR_QUEUE], 3);
    assert_eq!(report["items"][0]["message_id"], id.to_string(), "{report}");
    assert_eq!(report["items"][0]["action"], "expired", "{report}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (1, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_and_over_replayed_messages_stay_and_filters_choose() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let hour = chrono::TimeDelta::hours(1);
    let fresh_503 = failed_message(&conn, "carrier API returned 503", hour, 0).await;
    let fresh_timeout = failed_message(&conn, "carrier API timed out", hour, 0).await;
    let expired = failed_message(
        &conn,
        "carrier API returned 503",
        chrono::TimeDelta::days(8),
        0,
    )
    .await;
    let looping = failed_message(&conn, "carrier API returned 503", hour, 3).await;

    // Only one id: the others are not selected and stay, in order.
    let one = replay_json(
        &env,
        &[
            "--from",
            ERROR_QUEUE,
            "--message-id",
            &fresh_timeout.to_uppercase(),
        ],
        0,
    );
    assert_eq!(one["replayed"], 1);
    assert_eq!(env.queue_counts(ERROR_QUEUE), (3, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (1, 0));

    // By reason, with a limit on replays: the expired and the looping one are left and reported (exit 3).
    let report = replay_json(
        &env,
        &[
            "--from",
            ERROR_QUEUE,
            "--reason",
            "503",
            "--max-replays",
            "3",
        ],
        3,
    );
    let action = |id: &str| {
        report["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["message_id"] == id)
            .unwrap()["action"]
            .clone()
    };
    assert_eq!(action(&fresh_503), "replayed");
    assert_eq!(action(&expired), "expired");
    assert_eq!(action(&looping), "max_replays");
    assert_eq!(report["left"], 2);
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0));

    // Asked for explicitly, the expired one goes too.
    let report = replay_json(
        &env,
        &[
            "--from",
            ERROR_QUEUE,
            "--include-expired",
            "--max-replays",
            "3",
        ],
        3,
    );
    assert_eq!(report["replayed"], 1);
    assert_eq!(
        env.queue_counts(ERROR_QUEUE),
        (1, 0),
        "only the over-replayed one is left"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (3, 0));
}

/// A replay done while PostgreSQL takes connections and never answers (a server hung, a network path that drops
/// the answers): its report is printed all the same, and it ends — the audit and the look for keyed consumers are
/// bounded. Both used to wait for ever after the replay was done, the report never printed.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_done_while_postgres_never_answers_prints_its_report_and_ends() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let id = failed_message(
        &conn,
        "carrier API returned 503",
        chrono::TimeDelta::hours(1),
        0,
    )
    .await;
    // Takes every connection and never reads from it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            held.push(stream);
        }
    });
    let silent = format!("postgres://inboxctl@127.0.0.1:{port}/silent");
    let mut replay = env.spawn_with(
        &["replay", "--from", ERROR_QUEUE, "--json"],
        &[("DATABASE_URL", &silent)],
    );
    assert_eq!(
        replay.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["items"][0]["message_id"], id.as_str());
    assert!(
        replay.stderr().contains("was not written to the audit"),
        "{}",
        replay.stderr()
    );
}

/// A replay needs nothing of PostgreSQL but its audit row and the look for keyed consumers whose idempotency keys
/// its messages may have outlived. With PostgreSQL unreachable the replay is done, and that look said not made (it
/// used to be said at debug level only: the warning about keys past their lifetime silently missing).
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_without_postgres_says_it_could_not_look_for_keyed_consumers() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    failed_message(
        &conn,
        "carrier API returned 503",
        chrono::TimeDelta::hours(1),
        0,
    )
    .await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let unreachable = format!("postgres://inboxctl@127.0.0.1:{port}/gone");
    let mut replay = env.spawn_with(
        &["replay", "--from", ERROR_QUEUE, "--json"],
        &[("DATABASE_URL", &unreachable)],
    );
    assert_eq!(
        replay.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        replay.stderr()
    );
    assert!(
        replay
            .stderr()
            .contains("could not look for keyed consumers"),
        "{}",
        replay.stderr()
    );
}

/// A reason as long as a header may be (here 100 KB, its last words what `--reason` asks for): chosen by the whole
/// text, and kept in the report cut, as `failures` and `find` cut it — a queue of such messages was held whole in
/// memory, every one, until the report was printed.
#[tokio::test(flavor = "multi_thread")]
async fn a_long_reason_is_matched_whole_and_reported_cut() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let reason = format!("{} the last words", "x".repeat(100_000));
    let id = failed_message(&conn, &reason, chrono::TimeDelta::hours(1), 0).await;
    let report = replay_json(
        &env,
        &[
            "--from",
            ERROR_QUEUE,
            "--reason",
            "the last words",
            "--dry-run",
        ],
        0,
    );
    let item = &report["items"][0];
    assert_eq!(item["message_id"], id.as_str(), "{report}");
    let reported = item["reason"].as_str().unwrap();
    assert!(reported.len() <= 512, "{} bytes", reported.len());
    assert!(reported.contains("cut by inboxctl"), "{reported}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (1, 0), "a dry run");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_works_through_its_snapshot_not_its_own_refailures() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    // Messages that keep failing: each goes to the error queue after one attempt.
    common::publish_parcels(&env, &["--count", "150", "--destination", "FAIL"]);
    let consumer = env.spawn(&[
        "consume",
        "carrier",
        "--fail-destination",
        "FAIL",
        "--max-attempts",
        "1",
    ]);
    common::eventually("all dead-lettered", Duration::from_secs(60), || async {
        env.queue_exists(ERROR_QUEUE) && env.queue_counts(ERROR_QUEUE) == (150, 0)
    })
    .await;

    // The consumer keeps running, so every replayed copy fails again while the replay is still going.
    let report = replay_json(&env, &["--from", ERROR_QUEUE], 0);
    assert_eq!(report["snapshot"], 150);
    assert_eq!(
        report["replayed"], 150,
        "each message once, never its own re-failure"
    );
    common::eventually(
        "all back in the error queue",
        Duration::from_secs(30),
        || async { env.queue_counts(ERROR_QUEUE) == (150, 0) },
    )
    .await;
    let conn = env.amqp().await;
    for m in peek(&conn, ERROR_QUEUE).await {
        let h = m.properties.headers().as_ref().unwrap().inner();
        assert_eq!(
            h.get("inboxctl-replay-count"),
            Some(&AMQPValue::LongInt(1)),
            "replayed exactly once"
        );
    }
    consumer.terminate();
}

/// A failure reason holding escape sequences and control characters (it comes from whoever failed the message) is
/// shown inert by `replay --dry-run`, in the table for people and in JSON, and the message stays where it is.
#[tokio::test(flavor = "multi_thread")]
async fn a_dry_run_shows_hostile_reasons_inert() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let hostile = "carrier down\u{1b}[2J\u{1b}]0;pwned\u{7}\r\nrm -rf";
    let id = failed_message(&conn, hostile, chrono::TimeDelta::hours(1), 0).await;

    let out = env.run(&["replay", "--from", ERROR_QUEUE, "--dry-run"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains(&id), "{}", out.stdout);
    assert!(out.stdout.contains("carrier down"), "{}", out.stdout);
    for raw in ['\u{1b}', '\u{7}', '\r'] {
        assert!(
            !out.stdout.contains(raw) && !out.stderr.contains(raw),
            "{raw:?} reached the terminal: {out:?}"
        );
    }
    assert!(
        out.stdout.contains("\\u{1b}[2J"),
        "shown escaped: {}",
        out.stdout
    );

    // For scripts, JSON carries the reason exactly, its control characters escaped by JSON itself.
    let out = env.run(&["replay", "--json", "--from", ERROR_QUEUE, "--dry-run"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stdout.contains('\u{1b}'), "{}", out.stdout);
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["items"][0]["reason"], hostile);
    assert_eq!(
        env.queue_counts(ERROR_QUEUE),
        (1, 0),
        "a dry run moves nothing"
    );
}

/// One dead-letter queue collecting the copies of one event from two queues (the event fanned out, both consumers
/// failed): the same message id, two origins — each goes back to its own queue. A second copy for the same origin is
/// left where it is and said (it cannot be told from the first failing again on a path that dropped the replay
/// count): nothing deleted.
#[tokio::test(flavor = "multi_thread")]
async fn one_message_id_from_two_queues_goes_back_to_both_and_a_second_copy_stays() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    for queue in ["fan-a", "fan-b", "fan.dlq"] {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    let id = uuid::Uuid::new_v4().to_string();
    for origin in ["fan-a", "fan-b", "fan-a"] {
        let mut headers = FieldTable::default();
        headers.insert(
            "MT-Fault-InputAddress".into(),
            long(&format!("rabbitmq://localhost/{origin}")),
        );
        headers.insert("MT-Fault-Message".into(), long("boom"));
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        common::publish(&conn, "", "fan.dlq", props, b"{}").await;
    }
    let report = replay_json(&env, &["--from", "fan.dlq"], 3);
    assert_eq!(report["snapshot"], 3, "{report}");
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(report["left"], 1, "{report}");
    assert_eq!(report["items"][2]["action"], "copy_of_replayed", "{report}");
    assert_eq!(report["already_replayed"], 0, "{report}");
    assert_eq!(env.queue_counts("fan-a"), (1, 0));
    assert_eq!(env.queue_counts("fan-b"), (1, 0));
    assert_eq!(env.queue_counts("fan.dlq"), (1, 0));
}

/// The connection lost between a confirmed republish and the acknowledgement of its dead-letter copy (a failpoint
/// holds the replay there while a proxy cuts the connection): the replay connects again, finds that copy back
/// (redelivered, its replay count unchanged), acknowledges it without sending it again, and goes on. Exactly one copy
/// of each of the three messages on the origin queue, none left behind.
#[tokio::test(flavor = "multi_thread")]
async fn an_acknowledgement_lost_with_the_connection_is_made_again_without_a_second_copy() {
    acknowledgement_lost_with_the_connection(3).await;
}

/// The same with one message: the acknowledgement made again is the replay's last request on its channel, so only
/// the channel's close tells that it arrived — and the report still counts it.
#[tokio::test(flavor = "multi_thread")]
async fn the_last_message_acknowledged_again_is_counted_in_the_report() {
    acknowledgement_lost_with_the_connection(1).await;
}

async fn acknowledgement_lost_with_the_connection(messages: u64) {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    for queue in ["lost-a", "lost.dlq"] {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    for _ in 0..messages {
        let mut headers = FieldTable::default();
        headers.insert(
            "MT-Fault-InputAddress".into(),
            long("rabbitmq://localhost/lost-a"),
        );
        let props = BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        common::publish(&conn, "", "lost.dlq", props, b"{}").await;
    }
    let proxy = common::Proxy::start("127.0.0.1:5672").await;
    let proxied = format!("amqp://guest:guest@127.0.0.1:{}/{}", proxy.port, env.vhost);
    let mut replay = env.spawn_with(
        &["replay", "--from", "lost.dlq", "--json"],
        &[
            ("AMQP_URL", proxied.as_str()),
            (
                "INBOXCTL_FAILPOINTS",
                "replay-after-publish=sleep-once-3000",
            ),
        ],
    );
    replay.wait_for_stderr(
        "failpoint replay-after-publish reached",
        Duration::from_secs(30),
    );
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.restore();
    assert_eq!(
        replay.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["replayed"], messages, "{report}");
    assert_eq!(report["already_replayed"], 1, "{report}");
    assert_eq!(report["reconnects"], 1, "{report}");
    assert_eq!(env.queue_counts("lost-a"), (messages, 0), "one copy each");
    assert_eq!(env.queue_counts("lost.dlq"), (0, 0));
}

/// Declares durable queues (arguments for the first only, when given).
async fn declare(conn: &Connection, queues: &[&str], first_args: FieldTable) {
    let channel = conn.create_channel().await.unwrap();
    for (i, queue) in queues.iter().enumerate() {
        let args = if i == 0 {
            first_args.clone()
        } else {
            FieldTable::default()
        };
        channel
            .queue_declare((*queue).into(), QueueDeclareOptions::durable(), args)
            .await
            .unwrap();
    }
    let _ = channel.close(200, "OK".into()).await;
}

/// `n` dead-lettered messages in `queue`, each its own id and body (`{"n": i}`), all failed on `input_address`.
#[cfg(feature = "failpoints")]
async fn dead_letters(conn: &Connection, queue: &str, n: usize, input_address: &str) {
    for i in 0..n {
        let id = uuid::Uuid::new_v4().to_string();
        let body = format!("{{\"n\": {i}}}");
        dead_letter(conn, queue, &id, body.as_bytes(), input_address).await;
    }
}

/// A dead-lettered message as MassTransit leaves it in an error queue: `MT-Fault-InputAddress` and a reason.
async fn dead_letter(conn: &Connection, queue: &str, id: &str, body: &[u8], input_address: &str) {
    let mut headers = FieldTable::default();
    headers.insert("MT-Fault-InputAddress".into(), long(input_address));
    headers.insert("MT-Fault-Message".into(), long("boom"));
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(headers);
    common::publish(conn, "", queue, props, body).await;
}

#[cfg(feature = "failpoints")]
fn items_with<'r>(report: &'r serde_json::Value, action: &str) -> Vec<&'r serde_json::Value> {
    report["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["action"] == action)
        .collect()
}

/// The report's counts against the queues: every message is in the dead-letter queue exactly when the report says
/// it was not replayed, and `replayed` copies reached their origins.
fn assert_counts_match(
    env: &TestEnv,
    report: &serde_json::Value,
    dead_letter_queue: &str,
    origins: &[&str],
) {
    let items = report["items"].as_array().unwrap();
    let not_replayed = items.iter().filter(|i| i["action"] != "replayed").count() as u64;
    let replayed = items.len() as u64 - not_replayed;
    assert_eq!(report["replayed"], replayed, "{report}");
    assert_eq!(
        env.queue_counts(dead_letter_queue),
        (not_replayed, 0),
        "{report}"
    );
    let on_origins: u64 = origins.iter().map(|q| env.queue_counts(q).0).sum();
    assert_eq!(on_origins, replayed, "{report}");
}

/// The data loss the hostile test found: A and B share a message id and differ (two origins, or a buggy producer),
/// followed by others; A is replayed and B left (`copy_of_replayed`); the broker closes the replay's connection
/// (`rabbitmqctl close_connection`, timed by a failpoint). After the reconnect B comes back redelivered: it stays
/// where it is, as reported, and is not taken for a lost acknowledgement of A.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_left_copy_sharing_an_id_with_a_replayed_one_stays_when_the_connection_is_cut() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["cut-a", "cut.dlq"], FieldTable::default()).await;
    let address = "rabbitmq://localhost/cut-a";
    let shared = uuid::Uuid::new_v4().to_string();
    dead_letter(&conn, "cut.dlq", &shared, b"{\"copy\": \"A\"}", address).await;
    dead_letter(&conn, "cut.dlq", &shared, b"{\"copy\": \"B\"}", address).await;
    dead_letters(&conn, "cut.dlq", 30, address).await;

    let mut replay = env.spawn_with(
        &["replay", "--from", "cut.dlq", "--json"],
        // Held before taking the third message, A replayed and B left, long enough for two rabbitmqctl calls on a
        // loaded machine (2.5 s each seen).
        &[(
            "INBOXCTL_FAILPOINTS",
            "replay-before-get=sleep-once-15000@2",
        )],
    );
    replay.wait_for_stderr(
        "failpoint replay-before-get reached",
        Duration::from_secs(30),
    );
    common::close_connection(&env.vhost, "inboxctl replay");
    assert_eq!(
        replay.wait(Duration::from_secs(60)),
        Some(3),
        "{}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["reconnects"], 1, "{report}");
    assert_eq!(report["snapshot"], 32, "{report}");
    assert_eq!(report["replayed"], 31, "{report}");
    assert_eq!(report["left"], 1, "{report}");
    assert_eq!(report["already_replayed"], 0, "{report}");
    assert_eq!(items_with(&report, "copy_of_replayed").len(), 1, "{report}");
    assert_counts_match(&env, &report, "cut.dlq", &["cut-a"]);
    let left = peek(&conn, "cut.dlq").await;
    assert_eq!(left.len(), 1);
    assert_eq!(
        left[0].data, b"{\"copy\": \"B\"}",
        "B itself is still there"
    );
}

/// An acknowledgement sent just before the connection was cut may have been lost: the next pass looks for its copy.
/// Here it had arrived, so the copy never comes back, and the replay went on taking — and holding out of sight —
/// every message the dead-letter queue received until it found the queue empty: with failures arriving faster than
/// it takes messages, it never ended. It looks at as many messages as the queue held when the pass began and the lost
/// connection held, and no further.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn an_acknowledgement_in_doubt_is_looked_for_only_among_the_messages_there_when_the_pass_began()
 {
    acknowledgement_in_doubt_looked_for_within_the_pass(true).await;
}

/// The same, run by a user who may not declare the replay's marker (configure on the queues alone): the replay warns
/// and goes on unmarked. It did not count the queue then, so it looked for the copy without a bound — until the queue
/// ran empty, for ever while failures came faster than it took them.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn unmarked_an_acknowledgement_in_doubt_is_looked_for_only_among_the_messages_there_when_the_pass_began()
 {
    acknowledgement_in_doubt_looked_for_within_the_pass(false).await;
}

#[cfg(feature = "failpoints")]
async fn acknowledgement_in_doubt_looked_for_within_the_pass(marked: bool) {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["owed-a", "owed.dlq"], FieldTable::default()).await;
    if !marked {
        // The vhost is this test's alone (never handed out again).
        common::rabbitmqctl(&[
            "set_permissions",
            "-p",
            &env.vhost,
            "guest",
            "^owed",
            ".*",
            ".*",
        ]);
    }
    let address = "rabbitmq://localhost/owed-a";
    dead_letters(&conn, "owed.dlq", 3, address).await;

    let mut replay = env.spawn_with(
        &["replay", "--from", "owed.dlq", "--json"],
        // Held before the third message, the second's acknowledgement sent and not yet known to have arrived; then,
        // after the reconnect, once the snapshot is done.
        &[(
            "INBOXCTL_FAILPOINTS",
            "replay-before-get=sleep-once-15000@2,replay-before-get=sleep-once-4000@3",
        )],
    );
    replay.wait_for_stderr(
        "failpoint replay-before-get reached",
        Duration::from_secs(30),
    );
    // Two failures before the cut, there when the next pass begins.
    dead_letters(&conn, "owed.dlq", 2, address).await;
    common::close_connection(&env.vhost, "inboxctl replay");
    replay.wait_for_stderr_times(
        "failpoint replay-before-get reached",
        2,
        Duration::from_secs(40),
    );
    // Five after the pass counted the queue.
    dead_letters(&conn, "owed.dlq", 5, address).await;
    let code = replay.wait(Duration::from_secs(30));
    assert!(
        code.is_some(),
        "the replay did not end: {}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["reconnects"], 1, "{report}");
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(env.queue_counts("owed-a"), (3, 0), "{report}");
    if !marked {
        assert!(
            replay.stderr().contains("not marked on the broker"),
            "the run was meant to go unmarked: {}",
            replay.stderr()
        );
    }

    let left = peek(&conn, "owed.dlq").await;
    let taken: Vec<bool> = left.iter().map(|d| d.redelivered).collect();
    assert_eq!(
        taken,
        [true, true, true, false, false, false, false],
        "taken by the replay, in the queue's order: the two there when the pass began, and one in place of the copy the \
         lost connection held (given back late, it would have come first)"
    );
}

/// A copy the broker nacks — its origin declared with `x-max-length=1` and `x-overflow=reject-publish`, and full —
/// leaves the message in the dead-letter queue, reported. Also the guard that the dead-letter copy is acknowledged only
/// after the confirm was awaited: acknowledged before, both messages would be gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_the_broker_nacks_leaves_the_message_in_the_dead_letter_queue() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert("x-overflow".into(), long("reject-publish"));
    declare(&conn, &["full", "full.dlq"], args).await;
    common::publish(
        &conn,
        "",
        "full",
        BasicProperties::default(),
        b"already here",
    )
    .await;
    for _ in 0..2 {
        let id = uuid::Uuid::new_v4().to_string();
        dead_letter(&conn, "full.dlq", &id, b"{}", "rabbitmq://localhost/full").await;
    }

    let report = replay_json(&env, &["--from", "full.dlq"], 3);
    assert_eq!(report["replayed"], 0, "{report}");
    assert_eq!(report["left"], 2, "{report}");
    for item in report["items"].as_array().unwrap() {
        assert_eq!(item["action"], "publish_failed", "{report}");
        assert!(
            item["error"].as_str().unwrap().contains("refused"),
            "{report}"
        );
    }
    assert_eq!(env.queue_counts("full.dlq"), (2, 0), "{report}");
    assert_eq!(env.queue_counts("full"), (1, 0), "{report}");
}

/// A copy returned as unroutable leaves the message where it is: `--to` a queue that does not exist (found before
/// sending), and an origin deleted between the check and the publish (a failpoint holds the replay there), whose
/// copy the broker returns.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_returned_as_unroutable_leaves_the_message_in_the_dead_letter_queue() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["doomed", "doomed.dlq"], FieldTable::default()).await;
    let id = uuid::Uuid::new_v4().to_string();
    dead_letter(
        &conn,
        "doomed.dlq",
        &id,
        b"{}",
        "rabbitmq://localhost/doomed",
    )
    .await;

    let report = replay_json(&env, &["--from", "doomed.dlq", "--to", "no-such-queue"], 3);
    assert_eq!(report["left"], 1, "{report}");
    assert_eq!(report["items"][0]["action"], "origin_missing", "{report}");
    assert_counts_match(&env, &report, "doomed.dlq", &["doomed"]);

    let mut replay = env.spawn_with(
        &["replay", "--from", "doomed.dlq", "--json"],
        &[(
            "INBOXCTL_FAILPOINTS",
            "replay-before-publish=sleep-once-3000",
        )],
    );
    replay.wait_for_stderr(
        "failpoint replay-before-publish reached",
        Duration::from_secs(30),
    );
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(
            "doomed".into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        replay.wait(Duration::from_secs(30)),
        Some(3),
        "{}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["replayed"], 0, "{report}");
    assert_eq!(report["left"], 1, "{report}");
    assert_eq!(report["items"][0]["action"], "origin_missing", "{report}");
    assert!(
        report["items"][0]["error"]
            .as_str()
            .unwrap()
            .contains("came back unroutable"),
        "{report}"
    );
    assert_eq!(env.queue_counts("doomed.dlq"), (1, 0), "{report}");
}

/// A producer's message that names another queue in `MT-Fault-InputAddress` (a header any producer can write),
/// rejected by a consumer of `fx-orders` and dead-lettered by RabbitMQ into `fx-orders_error`: replayed, it went to the
/// queue its header named, `fx-payments`, another service's. The broker's `x-death` (from `fx-orders`) contradicts
/// the header and the queue it sits in does not corroborate it: left, saying why; `--to` sends it where the operator
/// says.
#[tokio::test(flavor = "multi_thread")]
async fn an_address_a_producer_wrote_is_not_taken_over_the_brokers_dead_lettering() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let mut dead_lettering = FieldTable::default();
    dead_lettering.insert("x-dead-letter-exchange".into(), long(""));
    dead_lettering.insert("x-dead-letter-routing-key".into(), long("fx-orders_error"));
    declare(
        &conn,
        &["fx-orders", "fx-orders_error", "fx-payments"],
        dead_lettering,
    )
    .await;
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://localhost/fx-payments"),
    );
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_delivery_mode(2)
        .with_headers(headers);
    common::publish(&conn, "", "fx-orders", props, b"{}").await;
    let channel = conn.create_channel().await.unwrap();
    let got = channel
        .basic_get("fx-orders".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the message");
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    common::eventually(
        "dead-lettered by the broker",
        Duration::from_secs(10),
        || async { env.queue_counts("fx-orders_error") == (1, 0) },
    )
    .await;
    let report = replay_json(&env, &["--from", "fx-orders_error"], 3);
    assert_eq!(report["items"][0]["action"], "origin_ambiguous", "{report}");
    assert!(
        report["items"][0]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("RabbitMQ dead-lettered the message from fx-orders"),
        "{report}"
    );
    assert_eq!(env.queue_counts("fx-payments"), (0, 0), "{report}");
    assert_eq!(env.queue_counts("fx-orders_error"), (1, 0), "{report}");
    let report = replay_json(&env, &["--from", "fx-orders_error", "--to", "fx-orders"], 0);
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(env.queue_counts("fx-orders"), (1, 0), "{report}");
}

/// A replay gives back every message it does not send (a dry run all of them), and on a quorum queue each return is
/// a delivery more, which RabbitMQ 4.0–4.2 drop past their delivery limit (20 by default): a message 10 times
/// delivered is said, as the other looks say it (`most_deliveries`, and a warning).
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_says_when_a_message_it_gives_back_nears_a_delivery_limit() {
    use lapin::options::BasicNackOptions;
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), long("quorum"));
    declare(&conn, &["worn.dlq", "worn"], quorum).await;
    dead_letter(
        &conn,
        "worn.dlq",
        &uuid::Uuid::new_v4().to_string(),
        b"{}",
        "rabbitmq://localhost/worn",
    )
    .await;
    let channel = conn.create_channel().await.unwrap();
    let ready = || async {
        channel
            .queue_declare(
                "worn.dlq".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    };
    let report = replay_json(&env, &["--from", "worn.dlq", "--dry-run"], 0);
    assert!(report.get("most_deliveries").is_none(), "{report}");
    for _ in 0..10 {
        // Each return is applied by the queue after the nack that asked for it: waited for before the next take.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ready().await != 1 {
            assert!(std::time::Instant::now() < deadline, "the message back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let got = channel
            .basic_get("worn.dlq".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("the message");
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
    }
    common::eventually("the message back", Duration::from_secs(10), || async {
        env.queue_counts("worn.dlq") == (1, 0)
    })
    .await;
    let out = env.run(&["replay", "--from", "worn.dlq", "--dry-run", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        report["most_deliveries"].as_u64().is_some_and(|n| n >= 10),
        "{report}"
    );
    assert!(out.stderr.contains("has been delivered"), "{out:?}");
}

/// A dead-lettered message carrying a `CC` header (RabbitMQ's sender-selected distribution: its values are routing
/// keys added to the publish's, and it stays on the message delivered) went back with it. Through the default
/// exchange each value is a queue name: the replayed copy also landed in any queue so named, outside every check of
/// where a replay may send (and, its origin gone, was confirmed through that queue and counted replayed). Replayed
/// copies carry neither `CC` nor `BCC`.
#[tokio::test(flavor = "multi_thread")]
async fn a_cc_header_does_not_send_a_replayed_copy_to_another_queue() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(
        &conn,
        &["cc-origin", "cc-origin.dlq", "cc-decoy"],
        FieldTable::default(),
    )
    .await;
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://localhost/cc-origin"),
    );
    headers.insert("MT-Fault-Message".into(), long("boom"));
    headers.insert(
        "CC".into(),
        AMQPValue::FieldArray(vec![long("cc-decoy")].into()),
    );
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_delivery_mode(2)
        .with_headers(headers);
    // Its own publish puts a copy in the decoy too (as the producer's did wherever its CC pointed).
    common::publish(&conn, "", "cc-origin.dlq", props, b"{}").await;
    assert_eq!(env.queue_counts("cc-decoy"), (1, 0));
    let report = replay_json(&env, &["--from", "cc-origin.dlq"], 0);
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(env.queue_counts("cc-origin"), (1, 0), "{report}");
    assert_eq!(
        env.queue_counts("cc-decoy"),
        (1, 0),
        "no replayed copy in the queue its CC names: {report}"
    );
    let back = peek(&conn, "cc-origin").await;
    let headers = back[0].properties.headers().clone().unwrap_or_default();
    assert!(!headers.inner().contains_key("CC"), "{headers:?}");
}

/// Three dead-lettered messages that had a per-message TTL, one for each place it is kept: the `expiration` property
/// itself (a MassTransit copy may keep it: this one must be replayed before it expires in `ttl.dlq`), inboxctl's
/// `inboxctl-original-expiration` header, and `x-death` (RabbitMQ's own dead-lettering of `ttl-src`, whose
/// messages it dead-letters when they expire). Returns the TTLs, in that order.
async fn ttl_messages(env: &TestEnv, conn: &Connection) -> [&'static str; 3] {
    // Long enough for the copies to be looked at before the restored ones expire, on a loaded machine.
    let ttls = ["8000", "5000", "3000"];
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://localhost/ttl-origin"),
    );
    headers.insert(
        inboxctl::amqp::dead_letter::ORIGINAL_EXPIRATION_HEADER.into(),
        long(ttls[1]),
    );
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_headers(headers);
    common::publish(conn, "", "ttl.dlq", props, b"header").await;
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_expiration(ttls[2].into());
    common::publish(conn, "", "ttl-src", props, b"x-death").await;
    common::eventually(
        "RabbitMQ dead-letters the expired message",
        Duration::from_secs(10),
        || async { env.queue_counts("ttl.dlq") == (2, 0) },
    )
    .await;
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://localhost/ttl-origin"),
    );
    let props = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_expiration(ttls[0].into())
        .with_headers(headers);
    common::publish(conn, "", "ttl.dlq", props, b"property").await;
    ttls
}

/// The TTL a copy on an origin queue carries, and the one it keeps in `inboxctl-original-expiration`, by body.
async fn ttls_on(conn: &Connection, queue: &str) -> Vec<(String, Option<String>, Option<String>)> {
    peek(conn, queue)
        .await
        .iter()
        .map(|d| {
            (
                String::from_utf8_lossy(&d.data).into_owned(),
                d.properties
                    .expiration()
                    .as_ref()
                    .map(|e| e.as_str().to_owned()),
                common::header_text(&d.properties, "inboxctl-original-expiration"),
            )
        })
        .collect()
}

/// A dead-lettered message that had a per-message TTL is replayed without one: its copy is still on its origin after
/// that TTL, and keeps the original value in `inboxctl-original-expiration`. With `--restore-expiration` the copy
/// carries the original TTL again, wherever it was kept, and expires on its origin.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_copy_has_no_ttl_unless_asked_for_and_then_its_original_one() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let mut dead_lettering = FieldTable::default();
    dead_lettering.insert("x-dead-letter-exchange".into(), long(""));
    dead_lettering.insert("x-dead-letter-routing-key".into(), long("ttl.dlq"));
    declare(&conn, &["ttl-src", "ttl-origin", "ttl.dlq"], dead_lettering).await;
    let origins = ["ttl-origin", "ttl-src"];

    let ttls = ttl_messages(&env, &conn).await;
    let report = replay_json(&env, &["--from", "ttl.dlq"], 0);
    assert_eq!(report["replayed"], 3, "{report}");
    assert_counts_match(&env, &report, "ttl.dlq", &origins);
    let no_ttl = |body: &str, ttl: &str| (body.to_owned(), None, Some(ttl.to_owned()));
    assert_eq!(
        ttls_on(&conn, "ttl-origin").await,
        [no_ttl("header", ttls[1]), no_ttl("property", ttls[0])]
    );
    assert_eq!(
        ttls_on(&conn, "ttl-src").await,
        [no_ttl("x-death", ttls[2])]
    );
    tokio::time::sleep(Duration::from_millis(9_000)).await;
    assert_eq!(env.queue_counts("ttl-origin"), (2, 0), "outlived its TTL");
    assert_eq!(env.queue_counts("ttl-src"), (1, 0), "outlived its TTL");

    let channel = conn.create_channel().await.unwrap();
    for queue in origins {
        channel
            .queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default())
            .await
            .unwrap();
    }
    let ttls = ttl_messages(&env, &conn).await;
    let report = replay_json(&env, &["--from", "ttl.dlq", "--restore-expiration"], 0);
    assert_eq!(report["replayed"], 3, "{report}");
    // Looked at at once, the shortest TTL first: the copies now expire (and are counted below, once they have).
    let restored = |body: &str, ttl: &str| (body.to_owned(), Some(ttl.to_owned()), None);
    assert_eq!(
        ttls_on(&conn, "ttl-src").await,
        [restored("x-death", ttls[2])]
    );
    assert_eq!(
        ttls_on(&conn, "ttl-origin").await,
        [restored("header", ttls[1]), restored("property", ttls[0])]
    );
    common::eventually(
        "the restored TTLs expire the copies",
        Duration::from_secs(15),
        || async {
            env.queue_counts("ttl-origin") == (0, 0) && env.queue_counts("ttl-src") == (0, 0)
        },
    )
    .await;
    // All three left the dead-letter queue; ttl-src dead-letters its expired copy once more, as it did the original.
    assert_eq!(env.queue_counts("ttl.dlq"), (1, 0));
}

/// The address inboxctl's consumer writes for `queue` in the test's vhost.
fn written_address(env: &TestEnv, queue: &str) -> String {
    inboxctl::amqp::Broker::from_url(&env.amqp_url)
        .unwrap()
        .queue_address(queue)
}

fn action_of<'r>(report: &'r serde_json::Value, id: &str) -> &'r serde_json::Value {
    &report["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["message_id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {report}"))["action"]
}

/// Queues named `eu/parcel-created-carrier` and `q?x=1#f`, with decoys named `parcel-created-carrier` and `q` (what
/// "the text after the last /, before ? or #" made of their addresses). Addresses written escaped go back to their
/// queue; the same names written raw (an older writer, a hand-made header) cannot be read without guessing and are
/// left; an address naming a vhost `eu` is in another vhost; a queue that does not exist is said. Never the decoys.
#[tokio::test(flavor = "multi_thread")]
async fn names_with_a_slash_a_question_mark_or_a_hash_go_back_to_their_own_queue_or_stay() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let (slash, query) = ("eu/parcel-created-carrier", "q?x=1#f");
    let decoys = ["parcel-created-carrier", "q"];
    declare(
        &conn,
        &[slash, query, decoys[0], decoys[1], "mixed.dlq"],
        FieldTable::default(),
    )
    .await;
    let vhost = &env.vhost;
    let cases = [
        (written_address(&env, slash), "would_replay", "replayed"),
        (written_address(&env, query), "would_replay", "replayed"),
        (
            format!("rabbitmq://127.0.0.1/{vhost}/{slash}"),
            "origin_ambiguous",
            "origin_ambiguous",
        ),
        (
            format!("rabbitmq://127.0.0.1/{vhost}/{query}"),
            "origin_ambiguous",
            "origin_ambiguous",
        ),
        (
            format!("rabbitmq://127.0.0.1/{slash}"),
            "origin_other_vhost",
            "origin_other_vhost",
        ),
        (
            written_address(&env, "gone"),
            "origin_missing",
            "origin_missing",
        ),
    ];
    let mut ids = Vec::new();
    for (address, _, _) in &cases {
        let id = uuid::Uuid::new_v4().to_string();
        dead_letter(&conn, "mixed.dlq", &id, b"{}", address).await;
        ids.push(id);
    }

    let dry = replay_json(&env, &["--from", "mixed.dlq", "--dry-run"], 3);
    let report = replay_json(&env, &["--from", "mixed.dlq"], 3);
    for ((address, in_dry_run, in_run), id) in cases.iter().zip(&ids) {
        assert_eq!(action_of(&dry, id), in_dry_run, "{address}: {dry}");
        assert_eq!(action_of(&report, id), in_run, "{address}: {report}");
    }
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(report["left"], 4, "{report}");
    assert_counts_match(&env, &report, "mixed.dlq", &[slash, query]);
    assert_eq!(env.queue_counts(slash), (1, 0));
    assert_eq!(env.queue_counts(query), (1, 0));
    for decoy in decoys {
        assert_eq!(env.queue_counts(decoy), (0, 0), "{decoy}");
    }
    // For people: what was left, and why.
    let out = env.run(&["replay", "--from", "mixed.dlq", "--dry-run"]);
    for why in [
        "left: origin address ambiguous (use --to)",
        "more than two segments",
        "left: origin in another vhost",
        "left: origin queue does not exist",
    ] {
        assert!(out.stdout.contains(why), "{why}: {}", out.stdout);
    }
}

/// The consumer's own error copies of a queue named `eu/parcel-created-carrier`, a decoy `parcel-created-carrier`
/// beside it: what the consumer writes into `MT-Fault-InputAddress` is what replay reads back, and every message
/// goes back to the queue it failed on.
#[tokio::test(flavor = "multi_thread")]
async fn the_consumers_error_copies_of_a_queue_with_a_slash_go_back_to_it() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    let queue = "eu/parcel-created-carrier";
    let error_queue = format!("{queue}_error");
    inboxctl::amqp::topology::ensure_endpoint(&conn, EVENT_EXCHANGE, queue, common::queue_type())
        .await
        .unwrap();
    declare(&conn, &[CARRIER_QUEUE], FieldTable::default()).await;
    common::publish_parcels(&env, &["--count", "3", "--destination", "FAIL"]);
    common::consume_until_idle(
        &env,
        &[
            "carrier",
            "--queue",
            queue,
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "1",
        ],
    );
    assert_eq!(env.queue_counts(&error_queue), (3, 0));
    for copy in peek(&conn, &error_queue).await {
        assert_eq!(
            common::header_text(&copy.properties, "MT-Fault-InputAddress"),
            Some(format!(
                "rabbitmq://127.0.0.1/{}/eu%2Fparcel-created-carrier",
                env.vhost
            ))
        );
    }

    let report = replay_json(&env, &["--from", &error_queue], 0);
    assert_eq!(report["replayed"], 3, "{report}");
    assert_counts_match(&env, &report, &error_queue, &[queue]);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0), "the decoy");
}

/// A vhost named `probe?q…` (the `?` escaped in the URL as `%3F`): the address MassTransit and inboxctl write for it
/// names it escaped and is replayed; the same address written raw read as the vhost `probe`, or the queue `probe`,
/// before — it is now left, and the decoy queue `probe` stays empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_vhost_with_a_question_mark_is_read_as_written() {
    let mut env = TestEnv::bare().await;
    let vhost = format!(
        "probe?q-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    common::vhosts::give_back(&env.vhost, false);
    common::rabbitmqctl(&["add_vhost", &vhost]);
    common::rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    // Dropped, the environment deletes this vhost instead.
    env.amqp_url = format!("{}/{}", common::amqp_base(), vhost.replace('?', "%3F"));
    env.vhost = vhost.clone();
    let conn = env.amqp().await;
    declare(
        &conn,
        &["orders", "probe", "orders_error"],
        FieldTable::default(),
    )
    .await;
    let written = written_address(&env, "orders");
    assert_eq!(
        written,
        format!("rabbitmq://127.0.0.1/{}/orders", vhost.replace('?', "%3F"))
    );
    let raw = format!("rabbitmq://127.0.0.1/{vhost}/orders");
    let (escaped_id, raw_id) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    dead_letter(&conn, "orders_error", &escaped_id, b"{}", &written).await;
    dead_letter(&conn, "orders_error", &raw_id, b"{}", &raw).await;

    let report = replay_json(&env, &["--from", "orders_error"], 3);
    assert_eq!(action_of(&report, &escaped_id), "replayed", "{report}");
    assert_eq!(action_of(&report, &raw_id), "origin_ambiguous", "{report}");
    assert_counts_match(&env, &report, "orders_error", &["orders"]);
    assert_eq!(env.queue_counts("probe"), (0, 0), "the decoy");
}

/// Found by the `replay_failure` fuzz target: a producer can write `x-first-death-queue` as any long string, and one
/// of 256 bytes named an origin no AMQP frame can carry. Such a message is left and reported, never sent; the
/// message beside it, naming a real queue, goes back. So is one naming the replay's own marker queue (which, the
/// replay's connection's own, answered a look as present: the copy went into the marker, confirmed, the message
/// acknowledged, and both gone when the marker was deleted) or a name the broker reserves; `--to` either is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_death_queue_name_longer_than_amqp_allows_is_left_and_reported() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    declare(&conn, &["odd.dlq", "odd.origin"], FieldTable::default()).await;
    let mut ids = Vec::new();
    for origin in [
        "q".repeat(256),
        "inboxctl.replaying.odd.dlq".to_owned(),
        "amq.gen-odd".to_owned(),
        "odd.origin".to_owned(),
    ] {
        let id = uuid::Uuid::new_v4().to_string();
        let mut headers = FieldTable::default();
        headers.insert("x-first-death-queue".into(), long(&origin));
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        common::publish(&conn, "", "odd.dlq", props, b"{}").await;
        ids.push(id);
    }
    let dry = replay_json(&env, &["--from", "odd.dlq", "--dry-run"], 3);
    assert_eq!(action_of(&dry, &ids[0]), "origin_ambiguous", "{dry}");
    let report = replay_json(&env, &["--from", "odd.dlq"], 3);
    for id in &ids[..3] {
        assert_eq!(action_of(&report, id), "origin_ambiguous", "{report}");
    }
    assert_eq!(action_of(&report, &ids[3]), "replayed", "{report}");
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["left"], 3, "{report}");
    assert_eq!(env.queue_counts("odd.dlq"), (3, 0));
    assert_eq!(env.queue_counts("odd.origin"), (1, 0));
    for to in ["inboxctl.replaying.odd.dlq", "amq.gen-odd"] {
        let out = env.run(&["replay", "--from", "odd.dlq", "--to", to]);
        assert_eq!(out.code, Some(64), "{out:?}");
        assert!(out.stderr.contains("not a consumer's queue"), "{out:?}");
    }
    assert_eq!(env.queue_counts("odd.dlq"), (3, 0));
}

/// A dead-lettered message whose own headers fill most of a frame: the broker took it, but the copy a replay sends
/// adds `inboxctl-replay-count` and `inboxctl-replay-run` (~88 bytes) and would no longer fit. Sent, it made the
/// broker close the connection, for ever at that message: every replay of the queue reconnected until it gave up,
/// and nothing behind it was replayed. It is left with the reason, and the healthy message behind it replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_whose_replayed_copy_would_not_fit_a_frame_is_left_and_the_rest_replayed() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let mut headers = FieldTable::default();
    for i in 0..13 {
        headers.insert(format!("h{i:02}").into(), long(&"v".repeat(10_000)));
    }
    headers.insert("pad".into(), long(&"p".repeat(830)));
    let big = BasicProperties::default()
        .with_message_id(uuid::Uuid::now_v7().to_string().into())
        .with_headers(headers);
    let frame_max = usize::try_from(conn.configuration().frame_max()).unwrap();
    let len = inboxctl::amqp::limits::content_header_len(&big);
    assert!(
        len <= frame_max && len + 88 > frame_max,
        "{len} of {frame_max}"
    );
    common::publish(&conn, ERROR_QUEUE, "", big, b"{}").await;
    let healthy = failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;

    let out = env.run(&[
        "replay",
        "--json",
        "--from",
        ERROR_QUEUE,
        "--reconnect-timeout",
        "5s",
    ]);
    eprintln!("{out:?}");
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(action_of(&report, &healthy), "replayed", "{report}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (1, 0));
}

/// A yes confirms what the question counted: three messages asked about, two more dead-lettered while the question
/// is on screen, `y`: the three go back, the two stay (before, all five went back unseen).
#[tokio::test(flavor = "multi_thread")]
async fn a_confirmed_replay_moves_only_the_count_confirmed() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    // A processed message past a 2-day window, for the cleanup below to find.
    common::publish_parcels(&env, &["--count", "1"]);
    common::consume_until_idle(&env, &["carrier"]);
    sqlx::query("UPDATE inbox_messages SET received_at = now() - interval '3 days', processed_at = now() - interval '3 days'")
        .execute(&env.pool().await)
        .await
        .unwrap();
    for _ in 0..3 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    let tmux = common::Tmux::of(&env);
    tmux.start(
        &env,
        &format!("replay --from {ERROR_QUEUE} --confirm-above 1"),
    );
    tmux.wait_for("the question", |s| s.contains("replay 3 messages"));
    // The dry run's marker is down while the question waits (for as long as the operator leaves it open): a cleanup
    // meanwhile is not refused for a running replay (the dead-lettered messages are fresh: nothing else refuses it).
    let cleanup = env.run(&["cleanup", "--retention", "2d", "--dry-run", "--json"]);
    assert_eq!(cleanup.code, Some(0), "{cleanup:?}");
    assert!(cleanup.stdout.contains("\"deleted\":1"), "{cleanup:?}");
    // Two more fail while the operator reads the question.
    for _ in 0..2 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    tmux.run(&["send-keys", "-t", "top", "y", "Enter"]);
    let screen = tmux.wait_for("the end", |s| s.contains("EXITED="));
    eprintln!("{screen}");
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (3, 0),
        "only the 3 confirmed went back:\n{screen}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0), "{screen}");
}

/// A yes at the question caps the replay at the count confirmed, but it is still a replay of everything: messages
/// another client takes while it runs (a `failures` look holding them) are said to be unreached and the run ends
/// partial (exit 3), as it does without the question. The yes had made it a replay of a chosen few, which cannot
/// tell: one of three replayed, exit 0.
#[tokio::test(flavor = "multi_thread")]
async fn a_confirmed_replay_still_says_what_another_client_took_while_it_ran() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    for _ in 0..3 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    let tmux = common::Tmux::of(&env);
    // One every 10 s: time enough, once the first is back on its queue, for the test to take the other two.
    tmux.start(
        &env,
        &format!("replay --from {ERROR_QUEUE} --confirm-above 1 --rate 0.1"),
    );
    tmux.wait_for("the question", |s| s.contains("replay 3 messages"));
    tmux.run(&["send-keys", "-t", "top", "y", "Enter"]);
    // Counted through the test's own connection (a passive declare: milliseconds, where `rabbitmqctl` takes seconds).
    common::eventually("the first replayed", Duration::from_secs(20), || async {
        let channel = conn.create_channel().await.unwrap();
        let queue = channel
            .queue_declare(
                CARRIER_QUEUE.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = channel.close(200, "OK".into()).await;
        queue.message_count() == 1
    })
    .await;
    let holder = conn.create_channel().await.unwrap();
    for _ in 0..2 {
        holder
            .basic_get(ERROR_QUEUE.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message to hold");
    }
    let screen = tmux.wait_for("the end", |s| s.contains("EXITED="));
    assert!(screen.contains("EXITED=3"), "{screen}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (1, 0), "{screen}");
}

/// The cleanup's guard looks at the head of each error queue, and a running replay holds every message it leaves
/// (not selected, expired) unacknowledged, out of sight. X was processed (its row 3 days old) and a copy of it waits
/// in the error queue, failed 4 days ago (a replay that crashed between the confirm and the ack). Alone,
/// `cleanup --retention 2d` is refused for the carrier (exit 3). While a `replay --reason 503 --rate 1` of other
/// messages runs, holding X as not selected, the same cleanup must be refused too: before, it deleted X's row, and
/// X's later replay was processed again (two reservations for one message). A second replay of the same queue is
/// refused while the first runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_replay_keeps_the_rows_of_what_it_holds_from_the_cleanup() {
    let env = TestEnv::migrated().await;
    // Ten others at one a second: the replay runs ~9 s, a wide margin for the cleanup and the second replay below.
    let (_conn, pool, x) = processed_long_ago_and_waiting_in_the_error_queue(&env, 40).await;

    // Alone, the guard keeps X's row.
    let out = env.run(&["cleanup", "--retention", "2d", "--dry-run", "--json"]);
    assert_eq!(out.code, Some(3), "the guard refuses: {out:?}");

    let mut replay = env.spawn(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--reason",
        "503",
        "--rate",
        "1",
    ]);
    common::eventually("the replay holding X", Duration::from_secs(20), || async {
        env.queue_counts(ERROR_QUEUE).1 >= 1
    })
    .await;
    let out = env.run(&["cleanup", "--retention", "2d", "--json"]);
    let second = env.run(&["replay", "--from", ERROR_QUEUE, "--dry-run"]);
    assert_eq!(second.code, Some(1), "a second replay at once: {second:?}");
    assert!(
        second.stderr.contains("another replay of"),
        "{}",
        second.stderr
    );
    assert_eq!(replay.try_wait(), None, "the replay still ran meanwhile");
    let row: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE id = $1")
        .bind(x)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(replay.wait(Duration::from_secs(60)), Some(0));
    // Then X is replayed (it failed 4 days ago, within replay's default 7 days) and consumed.
    replay_json(
        &env,
        &["--from", ERROR_QUEUE, "--message-id", &x.to_string()],
        0,
    );
    common::consume_until_idle(&env, &["carrier"]);
    let reservations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE message_id = $1")
            .bind(x)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (out.code, row, reservations),
        (Some(3), 1, 1),
        "cleanup refused, X's row kept, one reservation: {out:?}"
    );
}

/// The same race the other way round: the cleanup's guard has looked for the replay's marker (none) and not yet at the
/// error queue's head (a failpoint holds it there) when the replay begins and takes X out of sight. The guard looks
/// for the marker again after the head: it is seen, and the cleanup is refused. With the marker looked for only
/// before (none yet) and the head after (X held: a fresh message at the head), X's row was deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_beginning_between_the_guards_two_looks_keeps_the_rows_of_what_it_holds() {
    let env = TestEnv::migrated().await;
    let (_conn, pool, x) = processed_long_ago_and_waiting_in_the_error_queue(&env, 40).await;
    // Held 10 s between its looks; the replay takes X first and holds it for its 20 s (40 others at 2 a second).
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "2d", "--json"],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!("guard-between-looks=sleep-once-10000@{ERROR_QUEUE}"),
        )],
    );
    cleanup.wait_for_stderr(
        "failpoint guard-between-looks reached",
        Duration::from_secs(30),
    );
    let mut replay = env.spawn(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--reason",
        "503",
        "--rate",
        "2",
    ]);
    common::eventually("the replay holding X", Duration::from_secs(20), || async {
        env.queue_counts(ERROR_QUEUE).1 >= 1
    })
    .await;
    let code = cleanup.wait(Duration::from_secs(60));
    assert_eq!(replay.wait(Duration::from_secs(60)), Some(0));
    let row: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE id = $1")
        .bind(x)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((code, row), (Some(3), 1), "{}", cleanup.stderr());
    // Refused for the running replay, which held X out of the look's sight: the race was met, not passed by.
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert_eq!(
        report["consumers"][0]["refused"]["replay_running"], true,
        "{report:#}"
    );
}

/// The same race, ended another way: the guard's look takes every message but X, which the replay holds, and pauses
/// (a failpoint) holding them. The replay, finding the queue empty, used to end there: it gave X back
/// behind the look, took its marker down, and the guard, reading no marker, deleted X's row (seen once in CI, by
/// timing alone). The replay now waits for the look to end, so the guard sees it running and refuses.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_meeting_the_guards_look_waits_for_it_rather_than_end_under_it() {
    let env = TestEnv::migrated().await;
    let (_conn, pool, x) = processed_long_ago_and_waiting_in_the_error_queue(&env, 40).await;
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "2d", "--json"],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!(
                "guard-between-looks=sleep-once-8000@{ERROR_QUEUE},peek-holding=sleep-once-4000@{ERROR_QUEUE}"
            ),
        )],
    );
    cleanup.wait_for_stderr(
        "failpoint guard-between-looks reached",
        Duration::from_secs(30),
    );
    let mut replay = env.spawn(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--reason",
        "503",
        "--rate",
        "2",
    ]);
    common::eventually("the replay holding X", Duration::from_secs(20), || async {
        env.queue_counts(ERROR_QUEUE).1 >= 1
    })
    .await;
    let code = cleanup.wait(Duration::from_secs(60));
    assert_eq!(replay.wait(Duration::from_secs(60)), Some(0));
    let row: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE id = $1")
        .bind(x)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((code, row), (Some(3), 1), "{}", cleanup.stderr());
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert_eq!(
        report["consumers"][0]["refused"]["replay_running"], true,
        "{report:#}"
    );
}

/// A yes moves the messages the question counted. Two expired messages (failed 8 days ago, past the default 7 days)
/// at the head, three fresh ones behind: the question counts 3 (the expired are not "would replay"), and `--limit`
/// counts every chosen message, one left for an obstacle too: a limit of 3 was spent on the expired ones, and only 1
/// of the 3 confirmed went back. The limit is what the dry run chose.
#[tokio::test(flavor = "multi_thread")]
async fn a_confirmed_replay_moves_every_message_counted_when_expired_ones_lead() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    for _ in 0..2 {
        failed_message(&conn, "boom", chrono::TimeDelta::days(8), 0).await;
    }
    for _ in 0..3 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    let tmux = common::Tmux::of(&env);
    tmux.start(
        &env,
        &format!("replay --from {ERROR_QUEUE} --confirm-above 1"),
    );
    tmux.wait_for("the question", |s| s.contains("replay 3 messages"));
    tmux.run(&["send-keys", "-t", "top", "y", "Enter"]);
    let screen = tmux.wait_for("the end", |s| s.contains("EXITED="));
    eprintln!("{screen}");
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (3, 0),
        "the 3 confirmed went back:\n{screen}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0), "{screen}");
}

/// After a reconnect, the lost connection's marker may still stand (the broker has not yet closed that connection;
/// played here by the test's own connection holding the exclusive marker). The replay went on unmarked for the rest
/// of its pass: once the stale marker went, the cleanup's guard no longer saw it, and deleted the row of the message
/// it held. It now takes nothing until the stale marker has gone and it has marked the queue again.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_that_reconnected_under_a_stale_marker_is_still_seen_by_the_cleanup() {
    let env = TestEnv::migrated().await;
    let (_conn, _, _) = processed_long_ago_and_waiting_in_the_error_queue(&env, 40).await;

    let mut replay = env.spawn_with(
        &[
            "replay",
            "--from",
            ERROR_QUEUE,
            "--reason",
            "503",
            "--rate",
            "2",
        ],
        // Held long enough for two rabbitmqctl calls on a loaded machine (2.5 s each seen) and the marker's declare.
        &[(
            "INBOXCTL_FAILPOINTS",
            "replay-before-get=sleep-once-12000@2",
        )],
    );
    // Opened ahead, so that only the declare is left to do once the connection is cut.
    let stale = env.amqp().await;
    replay.wait_for_stderr(
        "failpoint replay-before-get reached",
        Duration::from_secs(30),
    );
    common::close_connection(&env.vhost, "inboxctl replay");
    // The lost connection's marker, still standing at the broker a while (here: the test's connection holds it).
    hold_the_marker(&stale, ERROR_QUEUE).await;
    replay.wait_for_stderr("still stands", Duration::from_secs(40));
    // The broker closes the stale connection at last (its heartbeat missed): its marker goes.
    stale.close(200, "OK".into()).await.unwrap();
    common::eventually(
        "the replay holding X again",
        Duration::from_secs(20),
        || async { env.queue_counts(ERROR_QUEUE).1 >= 1 },
    )
    .await;
    let out = env.run(&["cleanup", "--retention", "2d", "--dry-run", "--json"]);
    // Seen: the rest of the replay (its forty messages at two a second) is not this test's.
    replay.terminate();
    let _ = replay.wait(Duration::from_secs(30));
    assert_eq!(
        out.code,
        Some(3),
        "the replay still holds X: the cleanup must be refused: {out:?}"
    );
}

/// X processed 3 days ago (its inbox row backdated) and a copy of it waiting in the error queue, failed 4 days ago (a
/// replay that crashed between the confirm and the ack): `cleanup --retention 2d` alone is refused for the carrier.
/// Behind X, `others` messages that failed just now with a 503, for a replay to take.
async fn processed_long_ago_and_waiting_in_the_error_queue(
    env: &TestEnv,
    others: usize,
) -> (lapin::Connection, sqlx::PgPool, uuid::Uuid) {
    common::ensure_endpoints(env).await;
    let conn = env.amqp().await;
    let pool = env.pool().await;
    error_queue(&conn).await;
    let x = uuid::Uuid::new_v4();
    let (props, body, _) = common::parcel_message(x, "Berlin");
    common::publish(&conn, EVENT_EXCHANGE, "", props.clone(), &body).await;
    common::consume_until_idle(env, &["carrier"]);
    sqlx::query(
        "UPDATE inbox_messages SET received_at = now() - interval '3 days', processed_at = now() - interval '3 days'
         WHERE id = $1",
    )
    .bind(x)
    .execute(&pool)
    .await
    .unwrap();
    let mut headers = FieldTable::default();
    headers.insert("MT-Reason".into(), long("fault"));
    headers.insert("MT-Fault-Message".into(), long("timeout after 30000 ms"));
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://127.0.0.1/parcel-created-carrier"),
    );
    let when =
        inboxctl::amqp::envelope::format_time(chrono::Utc::now() - chrono::TimeDelta::days(4));
    headers.insert("MT-Fault-Timestamp".into(), long(&when));
    common::publish(&conn, ERROR_QUEUE, "", props.with_headers(headers), &body).await;
    for _ in 0..others {
        failed_message(
            &conn,
            "carrier API returned 503",
            chrono::TimeDelta::zero(),
            0,
        )
        .await;
    }
    (conn, pool, x)
}

/// `replay --from dlq --json --broker-timeout 5s --reconnect-timeout reconnect`, the first broker call of the kind
/// `call` held for ten minutes by a failpoint.
#[cfg(feature = "failpoints")]
fn replay_with_an_answer_held(
    env: &TestEnv,
    dlq: &str,
    reconnect: &str,
    call: &str,
) -> common::Proc {
    env.spawn_with(
        &[
            "replay",
            "--from",
            dlq,
            "--json",
            "--broker-timeout",
            "5s",
            "--reconnect-timeout",
            reconnect,
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!("broker-answer=sleep-once-600000@{call}"),
        )],
    )
}

/// A confirm that never comes must not hold the replay. The failpoint holds the wait for the first copy's confirm for
/// ten minutes, the copy itself sent and queued: a confirm lost on its way. Past `--broker-timeout` the replay gives
/// the connection up; the message it held goes back to the dead-letter queue with the connection, and the replay
/// either connects again and sends every message — that one a second time, since its first copy was never
/// confirmed: the inbox discards the second — or, told not to (`--reconnect-timeout 0`), stops saying why, with
/// every message still in the dead-letter queue and the one unconfirmed copy on its origin.
#[cfg(feature = "failpoints")]
async fn confirm_never_comes(reconnect: &str) -> serde_json::Value {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["silent-a", "silent.dlq"], FieldTable::default()).await;
    dead_letters(&conn, "silent.dlq", 10, "rabbitmq://localhost/silent-a").await;
    let mut replay = replay_with_an_answer_held(&env, "silent.dlq", reconnect, "a copy's confirm");
    let code = replay.wait(Duration::from_secs(60));
    let said = replay.stderr();
    assert!(
        said.contains("RabbitMQ did not answer a copy's confirm within 5s (--broker-timeout)"),
        "{said}"
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    if reconnect == "0s" {
        assert_eq!(code, Some(69), "{said}");
        assert_eq!(report["connection_lost"], true, "{report}");
        assert_eq!(report["replayed"], 0, "{report}");
        common::eventually(
            "the held message back in the dead-letter queue",
            Duration::from_secs(10),
            || async { env.queue_counts("silent.dlq") == (10, 0) },
        )
        .await;
        assert_eq!(env.queue_counts("silent-a"), (1, 0), "the unconfirmed copy");
    } else {
        assert_eq!(code, Some(0), "{said}");
        assert_eq!(report["replayed"], 10, "{report}");
        assert_eq!(report["reconnects"], 1, "{report}");
        assert_eq!(env.queue_counts("silent.dlq"), (0, 0));
        let copies = peek(&conn, "silent-a").await;
        let ids: std::collections::HashSet<_> = copies
            .iter()
            .map(|d| d.properties.message_id().clone())
            .collect();
        assert_eq!(
            (copies.len(), ids.len()),
            (11, 10),
            "every message, the unconfirmed one twice"
        );
    }
    report
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_confirm_that_never_comes_gives_the_connection_up_and_the_replay_goes_on() {
    confirm_never_comes("60s").await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_confirm_that_never_comes_without_reconnecting_stops_with_every_message_in_the_dead_letter_queue()
 {
    let report = confirm_never_comes("0s").await;
    assert!(
        report["stopped"]
            .as_str()
            .is_some_and(|s| s.contains("did not answer a copy's confirm")),
        "{report}"
    );
}

/// The close of the replay's channel, after its last acknowledgement, is never answered (a failpoint holds it for ten
/// minutes): nothing tells whether that acknowledgement arrived. Told not to connect again, the replay stops (exit 69)
/// and says so — the report counts the acknowledgement in doubt and the error says what it means — instead of only
/// "the rest are where they were", which a message left in both queues would belie.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn an_acknowledgement_in_doubt_when_the_replay_stops_is_counted_and_said() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["doubt-a", "doubt.dlq"], FieldTable::default()).await;
    dead_letters(&conn, "doubt.dlq", 3, "rabbitmq://localhost/doubt-a").await;
    let mut replay = replay_with_an_answer_held(&env, "doubt.dlq", "0s", "a channel's close");
    let code = replay.wait(Duration::from_secs(60));
    let said = replay.stderr();
    assert_eq!(code, Some(69), "{said}");
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(report["connection_lost"], true, "{report}");
    assert_eq!(report["acks_in_doubt"], 1, "{report}");
    assert!(
        said.contains("the acknowledgement of 1 replayed message(s) is not known to have arrived"),
        "{said}"
    );
    // Here it did arrive: the connection itself was sound.
    assert_eq!(env.queue_counts("doubt-a"), (3, 0));
    assert_eq!(env.queue_counts("doubt.dlq"), (0, 0));
}

/// The same doubt, when the stop comes later: the connection is lost after the first message's acknowledgement went
/// out (a failpoint holds the next get while the test closes the connection), and the replay connects again — but
/// before it takes anything, it finds its lost connection's marker still standing (the test holds one like it) and
/// waits; there it is stopped (SIGTERM). The acknowledgement is still in doubt: the report counts it and the summary
/// says it. It used to be counted only for a stop that was itself a loss.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn an_acknowledgement_in_doubt_stays_counted_when_the_replay_stops_after_connecting_again() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["later-a", "later.dlq"], FieldTable::default()).await;
    dead_letters(&conn, "later.dlq", 3, "rabbitmq://localhost/later-a").await;
    let mut replay = env.spawn_with(
        &["replay", "--from", "later.dlq", "--json"],
        // Long enough for two rabbitmqctl calls on a loaded machine (2.5 s each seen) and the holder's declare.
        &[(
            "INBOXCTL_FAILPOINTS",
            "replay-before-get=sleep-once-12000@1",
        )],
    );
    replay.wait_for_stderr(
        "failpoint replay-before-get reached",
        Duration::from_secs(30),
    );
    common::close_connection(&env.vhost, "inboxctl replay");
    let _holder = hold_the_marker(&conn, "later.dlq").await;
    replay.wait_for_stderr("still stands", Duration::from_secs(30));
    replay.terminate();
    replay
        .wait(Duration::from_secs(30))
        .expect("the replay ended");
    let said = replay.stderr();
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["interrupted"], true, "{report}");
    assert_eq!(report["acks_in_doubt"], 1, "{report} {said}");
    // A stop asked for, not the marker's wait running out.
    assert!(report["stopped"].is_null(), "{report}");
}

/// A replay sees only what is ready when it begins: what another client holds unacknowledged then (a `find` or
/// `failures` look, a consumer of the dead-letter queue) is not in its count, and is not replayed. Given back while
/// the replay runs, it is in the queue when the replay ends, and the report says how many are there now
/// (`in_queue_after`); the summary's words are checked in `cmd::replay`.
#[tokio::test(flavor = "multi_thread")]
async fn messages_held_elsewhere_when_a_replay_begins_are_counted_in_the_queue_after_it() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    let origin = written_address(&env, CARRIER_QUEUE);
    for i in 0..10 {
        let id = uuid::Uuid::new_v4().to_string();
        dead_letter(
            &conn,
            ERROR_QUEUE,
            &id,
            format!("{{\"n\": {i}}}").as_bytes(),
            &origin,
        )
        .await;
    }
    let holder = conn.create_channel().await.unwrap();
    let mut last = 0;
    for _ in 0..2 {
        let got = holder
            .basic_get(ERROR_QUEUE.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message to hold");
        last = got.delivery.delivery_tag;
    }
    // Paced, so that it runs for 7 s at least: long enough to see it under way and give the two back meanwhile.
    let mut replay = env.spawn(&["replay", "--from", ERROR_QUEUE, "--json", "--rate", "1"]);
    // Its count taken (the marker comes after it), the two go back while it runs. The marker is another
    // connection's exclusive queue: a passive declare of it is refused as locked once it exists.
    let marker = inboxctl::amqp::topology::replay_marker(ERROR_QUEUE);
    common::eventually("the replay under way", Duration::from_secs(20), || async {
        let channel = conn.create_channel().await.unwrap();
        let declared = channel
            .queue_declare(
                marker.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        matches!(&declared, Err(e) if e.to_string().contains("RESOURCE_LOCKED"))
    })
    .await;
    holder
        .basic_nack(
            last,
            lapin::options::BasicNackOptions {
                multiple: true,
                requeue: true,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        replay.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        replay.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim()).unwrap();
    assert_eq!(
        (
            &report["snapshot"],
            &report["replayed"],
            &report["in_queue_after"]
        ),
        (&8.into(), &8.into(), &2.into()),
        "{report}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (8, 0));
}

/// Declares `queue`'s replay marker on `conn`, exclusive, as a replay's lost connection would still hold it; the
/// declare is tried again (on a fresh channel: a refused one closes its channel) while the marker of the connection
/// just cut still stands at the broker. The channel holding it.
#[cfg(feature = "failpoints")]
async fn hold_the_marker(conn: &Connection, queue: &str) -> lapin::Channel {
    let marker = inboxctl::amqp::topology::replay_marker(queue);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let channel = conn.create_channel().await.unwrap();
        let declared = channel
            .queue_declare(
                marker.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(_) => return channel,
            Err(e)
                if e.to_string().contains("RESOURCE_LOCKED")
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the marker {marker} could not be held: {e}"),
        }
    }
}

/// `--rate` paces the copies, not a stop: at one copy every 100 s, a stop after the first copy ends the replay at once
/// (it waits between messages, holding none), the other two left in the dead-letter queue and said.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_ends_a_slow_paced_replay_at_once_between_its_copies() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["paced-a", "paced.dlq"], FieldTable::default()).await;
    for i in 0..3 {
        let id = uuid::Uuid::new_v4().to_string();
        let body = format!("{{\"n\": {i}}}");
        dead_letter(
            &conn,
            "paced.dlq",
            &id,
            body.as_bytes(),
            "rabbitmq://localhost/paced-a",
        )
        .await;
    }
    let mut replay = env.spawn(&["replay", "--from", "paced.dlq", "--rate", "0.01", "--json"]);
    common::eventually("the first copy back", Duration::from_secs(30), || async {
        env.queue_counts("paced-a").0 == 1
    })
    .await;
    replay.terminate();
    let code = replay.wait(Duration::from_secs(15));
    let report: serde_json::Value = serde_json::from_str(replay.stdout().trim())
        .unwrap_or_else(|e| panic!("{e}: {}", replay.stderr()));
    assert_eq!(code, Some(3), "interrupted: {report}");
    assert_eq!(
        (&report["replayed"], &report["interrupted"]),
        (&serde_json::json!(1), &serde_json::json!(true)),
        "{report}"
    );
    assert_eq!(env.queue_counts("paced.dlq"), (2, 0), "two left, none held");
    assert_eq!(env.queue_counts("paced-a"), (1, 0), "one replayed");
}

/// A kept TTL past what RabbitMQ takes (2^32 - 1 ms; a larger one closes the publishing channel) is not restored: the
/// copy goes without it and the replay goes on to the messages behind it. The largest the broker takes is restored.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_ttl_the_broker_would_refuse_is_not_restored_and_the_replay_goes_on() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["exp-origin", "exp.dlq"], FieldTable::default()).await;
    for (body, kept) in [
        ("over", Some("9999999999")),
        ("max", Some("4294967295")),
        ("plain", None),
    ] {
        let mut headers = FieldTable::default();
        headers.insert(
            "MT-Fault-InputAddress".into(),
            long("rabbitmq://localhost/exp-origin"),
        );
        if let Some(kept) = kept {
            headers.insert(
                inboxctl::amqp::dead_letter::ORIGINAL_EXPIRATION_HEADER.into(),
                long(kept),
            );
        }
        let props = BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_headers(headers);
        common::publish(&conn, "", "exp.dlq", props, body.as_bytes()).await;
    }
    let report = replay_json(&env, &["--from", "exp.dlq", "--restore-expiration"], 0);
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(
        ttls_on(&conn, "exp-origin").await,
        [
            ("over".to_owned(), None, None),
            ("max".to_owned(), Some("4294967295".to_owned()), None),
            ("plain".to_owned(), None, None),
        ]
    );
    assert_eq!(env.queue_counts("exp.dlq"), (0, 0));
}

/// `--message-id` names what the operator wants back: an id the replay does not meet in the queue is said, by name,
/// and the replay is partial (exit 3), not a success that replayed nothing. Each id once, however it was spelt.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_id_not_in_the_queue_is_named_and_the_replay_is_partial() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(&conn, &["asked-a", "asked.dlq"], FieldTable::default()).await;
    let here = uuid::Uuid::new_v4().to_string();
    dead_letter(
        &conn,
        "asked.dlq",
        &here,
        b"{}",
        "rabbitmq://localhost/asked-a",
    )
    .await;
    let absent = uuid::Uuid::new_v4();
    let upper = absent.to_string().to_uppercase();
    let report = replay_json(
        &env,
        &[
            "--from",
            "asked.dlq",
            "--message-id",
            &here,
            "--message-id",
            &upper,
            "--message-id",
            &absent.to_string(),
        ],
        3,
    );
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["unmatched"], serde_json::json!([upper]), "{report}");
    let out = env.run(&["replay", "--from", "asked.dlq", "--message-id", &here]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stdout
            .contains(&format!("no message chosen for --message-id {here}")),
        "{out:?}"
    );
    assert_eq!(env.queue_counts("asked-a"), (1, 0), "replayed once");
    // In the queue but not chosen by another filter: named too.
    let there = uuid::Uuid::new_v4().to_string();
    dead_letter(
        &conn,
        "asked.dlq",
        &there,
        b"{}",
        "rabbitmq://localhost/asked-a",
    )
    .await;
    let report = replay_json(
        &env,
        &[
            "--from",
            "asked.dlq",
            "--message-id",
            &there,
            "--reason",
            "no such reason",
        ],
        3,
    );
    assert_eq!(report["unmatched"], serde_json::json!([there]), "{report}");
    assert_eq!(env.queue_counts("asked.dlq"), (1, 0), "left");
}

/// What a forged `MT-Fault-InputAddress` could do: a message naming another client's exclusive reply queue was
/// republished into it (the broker routes a publish into any connection's exclusive queue, and the look at it was
/// refused with `RESOURCE_LOCKED`, taken for "exists"), confirmed, its dead-letter copy acknowledged, and gone with
/// that client's connection; one naming the dead-letter queue itself went round into it, reported replayed, its
/// failure's headers gone. Both are left now, with the reason; `--to` the queue replayed from is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_naming_a_reply_queue_or_its_own_dead_letter_queue_is_left_where_it_is() {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    declare(
        &conn,
        &["forged.dlq", "forged-origin"],
        FieldTable::default(),
    )
    .await;
    // Another client's reply queue, exclusive to its connection.
    let client = env.amqp().await;
    let client_channel = client.create_channel().await.unwrap();
    client_channel
        .queue_declare(
            "rpc-reply".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (reply, itself, fine) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    dead_letter(
        &conn,
        "forged.dlq",
        &reply,
        b"{}",
        &written_address(&env, "rpc-reply"),
    )
    .await;
    dead_letter(
        &conn,
        "forged.dlq",
        &itself,
        b"{}",
        &written_address(&env, "forged.dlq"),
    )
    .await;
    dead_letter(
        &conn,
        "forged.dlq",
        &fine,
        b"{}",
        &written_address(&env, "forged-origin"),
    )
    .await;

    let report = replay_json(&env, &["--from", "forged.dlq"], 3);
    assert_eq!(action_of(&report, &fine), "replayed", "{report}");
    assert_eq!(action_of(&report, &reply), "publish_failed", "{report}");
    assert_eq!(action_of(&report, &itself), "origin_ambiguous", "{report}");
    let text = report.to_string();
    assert!(text.contains("exclusive to another connection"), "{text}");
    assert!(text.contains("itself as its origin"), "{text}");
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["left"], 2, "{report}");
    // Nothing went into the reply queue; the two are still in the dead-letter queue, once each.
    let got = client_channel
        .basic_get("rpc-reply".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(got.is_none(), "a copy in another client's reply queue");
    let _ = client.close(200, "OK".into()).await;
    assert_counts_match(&env, &report, "forged.dlq", &["forged-origin"]);

    let out = env.run(&["replay", "--from", "forged.dlq", "--to", "forged.dlq"]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("the queue replayed from"),
        "{}",
        out.stderr
    );
    assert_eq!(env.queue_counts("forged.dlq"), (2, 0));
}

/// The replay's receiving channel closes under it — as the broker closes it when messages are held past its
/// `consumer_timeout` (a slow `--rate`, a narrow filter over a long queue) — after a copy was confirmed, before its
/// dead-letter copy's acknowledgement is known to have arrived (a failpoint closes it there). The replay stops, and
/// that acknowledgement is counted in doubt: the message is in both queues (the inbox discards the second copy). It
/// used to report it replayed and nothing in doubt, the error queue still holding it.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_channel_closed_under_the_replay_before_an_acknowledgement_leaves_it_in_doubt() {
    let (env, code, report, said) =
        replay_three_with("closed", "replay-channel-closed-before-ack").await;
    assert_ne!(code, Some(0), "{said}");
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["interrupted"], true, "{report}");
    assert_eq!(report["acks_in_doubt"], 1, "{report} {said}");
    assert!(
        said.contains("the acknowledgement of 1 replayed message(s) is not known to have arrived"),
        "{said}"
    );
    // What the queues hold: the copy, and the three in the dead-letter queue (the first given back as its channel
    // closed) — the one in doubt in both.
    assert_eq!(env.queue_counts("closed-a"), (1, 0));
    assert_eq!(env.queue_counts("closed.dlq"), (3, 0));

    // The channel closed after the last acknowledgement, before the replay's end was answered: the replay has done
    // its work, and says that last acknowledgement is in doubt (here it did arrive: the queue is empty).
    let (env, code, report, said) =
        replay_three_with("late", "replay-channel-closed-before-finish").await;
    assert_eq!(code, Some(0), "{said}");
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(report["interrupted"], false, "{report}");
    assert_eq!(report["acks_in_doubt"], 1, "{report} {said}");
    assert_eq!(env.queue_counts("late-a"), (3, 0));
}

/// `replay --from <name>.dlq --json` of three dead letters from `<name>-a`, with the failpoint `failpoint` armed: the
/// exit code, the report and what it said on stderr.
#[cfg(feature = "failpoints")]
async fn replay_three_with(
    name: &str,
    failpoint: &str,
) -> (TestEnv, Option<i32>, serde_json::Value, String) {
    let env = TestEnv::bare().await;
    let conn = env.amqp().await;
    let (origin, dlq) = (format!("{name}-a"), format!("{name}.dlq"));
    declare(&conn, &[&origin, &dlq], FieldTable::default()).await;
    dead_letters(&conn, &dlq, 3, &format!("rabbitmq://localhost/{origin}")).await;
    let mut replay = env.spawn_with(
        &["replay", "--from", &dlq, "--json"],
        &[("INBOXCTL_FAILPOINTS", failpoint)],
    );
    let code = replay.wait(Duration::from_secs(60));
    let said = replay.stderr();
    let report: serde_json::Value =
        serde_json::from_str(replay.stdout().trim()).unwrap_or_else(|e| panic!("{e}: {said}"));
    (env, code, report, said)
}

/// On a terminal, a count within `--confirm-above` asks nothing — and the replay is still held to what was counted:
/// three messages counted, five more failing between the count and the replay (a failpoint holds it there), and only
/// the three go back. The five used to go back too, unasked: a burst of failures of any size, with no question.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_not_asked_about_moves_only_what_its_count_saw() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    error_queue(&conn).await;
    for _ in 0..3 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    let tmux = common::Tmux::of(&env);
    tmux.start_with(
        &env,
        "INBOXCTL_FAILPOINTS='replay-counted=sleep-once-8000'",
        &format!("replay --from {ERROR_QUEUE} --confirm-above 5"),
    );
    tmux.wait_for("the count", |s| {
        s.contains("failpoint replay-counted reached")
    });
    for _ in 0..5 {
        failed_message(&conn, "boom", chrono::TimeDelta::zero(), 0).await;
    }
    let screen = tmux.wait_for("the end", |s| s.contains("EXITED="));
    assert!(!screen.contains("replay them?"), "nothing asked:\n{screen}");
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (3, 0),
        "the 3 counted went back:\n{screen}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (5, 0), "{screen}");
}
