//! A consumer process killed with SIGKILL at fixed crash points: between commit and ack, and before the commit.
#![cfg(feature = "failpoints")]

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};
use lapin::BasicProperties;
use uuid::Uuid;

/// Publishes `parcels` parcels and kills a consumer at `point`; returns once every one is ready on the queue again.
async fn crash_at(point: &str, mode: &[&str], parcels: u64) -> (TestEnv, sqlx::PgPool) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", &parcels.to_string()]);
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
        "the unacked messages back on the queue",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (parcels, 0) },
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
    let (env, pool) = crash_at("after-commit", mode, 1).await;
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
    let (env, pool) = crash_at("before-commit", mode, 2).await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0,
        "rolled back by the kill"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );

    // A redelivered message is processed one by one even in batched mode (so that a message that ends processes
    // cannot take a batch down with it): a redelivery never reaches the batched path. So in batched mode one of the
    // two is taken off the queue and published again unchanged — a fresh delivery of the same message, as a replay
    // or a producer's resend makes it — and that one is processed in a batch; the other stays a redelivery.
    let resent = if mode == common::BATCHED {
        Some(resend_one(&env, CARRIER_QUEUE).await)
    } else {
        None
    };
    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier", "-v"], mode));
    assert!(
        !out.stderr.contains("duplicate discarded"),
        "{}",
        out.stderr
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        2
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
    let with_row: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM carrier_reservations e
         JOIN inbox_messages i ON i.id = e.message_id AND i.consumer_type = $1 AND i.xmin::text = e.xmin::text",
    )
    .bind(CARRIER_QUEUE)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(with_row, 2, "each effect committed with its inbox row");

    // The path each message took: a batch says at -v which messages it committed.
    let batched: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("batch committed"))
        .collect();
    match resent {
        Some(id) => assert!(
            batched.iter().any(|l| l.contains(&id.to_string())),
            "the message resent after the crash was processed in a batch:\n{}",
            out.stderr
        ),
        None => assert!(batched.is_empty(), "one by one, no batch:\n{}", out.stderr),
    }
}

/// Takes the first message off `queue` and publishes it again to the queue unchanged (body and properties), confirmed
/// before the original is acknowledged; returns its message id.
async fn resend_one(env: &TestEnv, queue: &str) -> uuid::Uuid {
    use lapin::options::{BasicAckOptions, BasicGetOptions};
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    let original = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("a message on the queue")
        .delivery;
    assert!(original.redelivered, "the crash made it a redelivery");
    common::publish(
        &conn,
        "",
        queue,
        original.properties.clone(),
        &original.data,
    )
    .await;
    original
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    let _ = channel.close(200, "OK".into()).await;
    let _ = conn.close(200, "OK".into()).await;
    uuid::Uuid::parse_str(original.properties.message_id().as_ref().unwrap().as_str()).unwrap()
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

// A message whose processing ends the process every time (here an abort inside the carrier call, as a crash in
// native code or an out-of-memory kill would): each redelivery starts it again. It must not take the consumer down
// forever: once it has ended the process --poison-after (3) times while tried alone, it goes to the error queue; the
// healthy messages that were in flight beside it at the first aborts (the same ones each time: a requeued message
// keeps its place) are processed once, none of them moved aside.
in_both_modes!(
    a_message_that_ends_its_process_every_time_is_moved_aside_and_the_rest_flows,
    poison
);

async fn poison(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "10"]);
    common::publish_parcels(&env, &["--count", "1", "--destination", "POISON"]);
    common::publish_parcels(&env, &["--count", "10"]);

    let mut aborted = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        assert!(runs <= 10, "the consumer never got past the poison message");
        let mut consumer = env.spawn_with(
            &common::with_mode(
                &[
                    "consume",
                    "carrier",
                    "--concurrency",
                    "2",
                    "--prefetch",
                    "8",
                    "--exit-when-idle",
                    "1s",
                ],
                mode,
            ),
            &[("INBOXCTL_FAILPOINTS", "carrier=abort@POISON")],
        );
        match consumer.wait(Duration::from_secs(60)) {
            Some(0) => break,
            None => aborted += 1,
            Some(code) => panic!("exit {code}: {}", consumer.stderr()),
        }
    }
    assert_eq!(
        aborted, 5,
        "ended by its first delivery, its first redelivery (beside others), and three starts alone; then moved aside"
    );

    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        20
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
        )
        .await,
        20
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    let conn = env.amqp().await;
    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(errors.len(), 1, "only the poison message is moved aside");
    assert!(
        String::from_utf8_lossy(&errors[0].data).contains("POISON"),
        "the moved message is the poison one"
    );
    let reason = common::header_text(&errors[0].properties, "MT-Fault-Message").unwrap();
    assert!(reason.contains("without reaching an outcome"), "{reason}");
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_attempts").await,
        0,
        "no count is left behind"
    );
}

/// A batch acknowledges with one `multiple` frame only what is its own: while another batch worker still holds the
/// first delivery (its carrier call stuck), the batches after it commit and are acknowledged, and the held one stays
/// unacknowledged — a kill then gives it back, and it is processed once.
#[tokio::test(flavor = "multi_thread")]
async fn a_batchs_multiple_ack_never_covers_a_delivery_another_worker_holds() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Hold"]);
    let mut victim = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--batch-size",
            "4",
            "--concurrency",
            "16",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier=pause@Hold")],
    );
    victim.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    common::publish_parcels(&env, &["--count", "12"]);
    common::eventually(
        "the batches after the held one committed",
        Duration::from_secs(30),
        || async { common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 12 },
    )
    .await;
    common::eventually(
        "and were acknowledged, all but the held one",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (0, 1) },
    )
    .await;
    victim.kill();
    common::eventually(
        "the held one back on the queue",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE) == (1, 0) },
    )
    .await;
    common::consume_until_idle(&env, &["carrier", "--batch-size", "4"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        13,
        "the held one processed, once"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// A broker call that never answers (the failpoint holds the first call of its kind for ten minutes: what a
/// connection whose socket died without lapin noticing looks like) must not hold the consumer. With one worker, an
/// ack waited on for ever held it all: the loop waited for a free worker and looked at nothing else. Past
/// `--broker-timeout` the connection is given up and opened again; the held message comes back, and is discarded as
/// a duplicate if it had committed.
async fn unanswered(call: &str, mode: &[&str]) -> String {
    unanswered_at(
        call,
        &format!("broker-answer=sleep-once-600000@{call}"),
        mode,
    )
    .await
}

/// [`unanswered`] with the call held at `failpoint`.
async fn unanswered_at(call: &str, failpoint: &str, mode: &[&str]) -> String {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "40"]);
    common::publish_parcels(&env, &["--count", "1", "--destination", "FAIL"]);
    let args = [
        &[
            "consume",
            "carrier",
            "--concurrency",
            "1",
            "--broker-timeout",
            "5s",
        ][..],
        &["--fail-destination", "FAIL", "--max-attempts", "1"],
    ]
    .concat();
    let consumer = env.spawn_with(
        &common::with_mode(&args, mode),
        &[("INBOXCTL_FAILPOINTS", failpoint)],
    );
    let name = failpoint.split('=').next().unwrap_or(failpoint);
    consumer.wait_for_stderr(
        &format!("failpoint {name} reached"),
        Duration::from_secs(30),
    );
    let pool = env.pool().await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::eventually(
        &format!("every parcel processed or moved aside, though {call} was never answered"),
        Duration::from_secs(60),
        || async {
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 40
                && env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && env.queue_counts(&error_queue).0 == 1
        },
    )
    .await;
    let said = consumer.stderr();
    assert!(
        said.contains(&format!("RabbitMQ did not complete {call} in time")),
        "{said}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        40,
        "each once"
    );
    assert_eq!(env.queue_counts(&error_queue), (1, 0), "moved aside once");
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_rabbitmq_never_answers_gives_the_connection_up_one_by_one() {
    let said = unanswered("an ack", common::ONE_BY_ONE).await;
    assert!(said.contains("duplicate discarded"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_rabbitmq_never_answers_gives_the_connection_up_batched() {
    // A batch's members acknowledged with one frame (`multiple`): the first batch of the 40 queued is the lone first
    // message, the next ones are many.
    let said = unanswered("a multiple ack", common::BATCHED).await;
    assert!(said.contains("duplicate discarded"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// The copy goes out on a connection of its own: the copy is given up, and that connection, and the message goes back
/// to its queue. Held once the copy has its turn on the connection (one copy in flight at a time there): a copy held
/// before it, waiting for the copies ahead, would give its message back and leave the connection be.
async fn a_dead_letter_copy_rabbitmq_never_confirms_gives_its_connection_up() {
    unanswered_at(
        "a dead-letter copy",
        "dead-letter-publish=sleep-once-600000",
        common::ONE_BY_ONE,
    )
    .await;
}

/// A copy unanswered on a dead-letter connection that is open and not blocked gives that connection up, not only the
/// copy: a connection whose socket died silently would otherwise be used for every later copy, each waiting out the
/// broker timeout and going back, none ever moved aside. The first unreadable message's copy opens the connection; the
/// second's is held past `--broker-timeout` on it; the second comes round and is moved aside on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_copy_unanswered_on_an_open_connection_replaces_that_connection() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let held = Uuid::now_v7();
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "1",
            "--broker-timeout",
            "5s",
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!("dead-letter-publish=sleep-once-600000@{held}"),
        )],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let conn = env.amqp().await;
    let unreadable = |id: Uuid| BasicProperties::default().with_message_id(id.to_string().into());
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::publish(
        &conn,
        "",
        CARRIER_QUEUE,
        unreadable(Uuid::now_v7()),
        b"not json",
    )
    .await;
    common::eventually("the first copy", Duration::from_secs(30), || async {
        env.queue_exists(&error_queue) && env.queue_counts(&error_queue).0 == 1
    })
    .await;
    let first = dead_letter_connections(&env);
    assert_eq!(first.len(), 1, "{first:?}");

    common::publish(&conn, "", CARRIER_QUEUE, unreadable(held), b"not json").await;
    common::eventually(
        "the second copy, after its first was given up",
        Duration::from_secs(30),
        || async {
            env.queue_counts(&error_queue).0 == 2 && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        },
    )
    .await;
    assert!(consumer.has_said("failpoint dead-letter-publish reached"));
    assert!(consumer.has_said("RabbitMQ did not complete a dead-letter copy in time"));
    let then = dead_letter_connections(&env);
    assert_eq!(then.len(), 1, "the one given up closed: {then:?}");
    assert_ne!(then, first, "a new dead-letter connection");
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// One dead-letter copy in flight at a time on the channel: lapin hands a returned message to whichever confirm
/// completes next, so with two in flight an unroutable copy could be taken for confirmed (see
/// `hostile::copies_at_once_to_an_unbound_error_queue_and_the_skipped_queue_each_arrive_and_none_is_lost`, which shows
/// the loss, but only by chance). Here the first copy is held for 15 s once it has its turn; the second, another
/// worker's, waits behind it and reaches the error queue only after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_copy_waits_for_the_one_in_flight_on_its_channel() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let unreadable = |id: Uuid| BasicProperties::default().with_message_id(id.to_string().into());
    // The error queue declared, so that neither copy waits on a declaration.
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, &error_queue, common::queue_type())
        .await
        .unwrap();
    let held = Uuid::now_v7();
    let mut consumer = env.spawn_with(
        &["consume", "carrier", "--concurrency", "4"],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!("dead-letter-publish=sleep-once-15000@{held}"),
        )],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    common::publish(&conn, "", CARRIER_QUEUE, unreadable(held), b"not json").await;
    consumer.wait_for_stderr(
        "failpoint dead-letter-publish reached",
        Duration::from_secs(30),
    );
    common::publish(
        &conn,
        "",
        CARRIER_QUEUE,
        unreadable(Uuid::now_v7()),
        b"not json",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        env.queue_counts(&error_queue),
        (0, 0),
        "the second copy went out beside the first"
    );
    common::eventually("both copies, in turn", Duration::from_secs(30), || async {
        env.queue_counts(&error_queue).0 == 2 && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    let copies = common::drain(&conn, &error_queue).await;
    assert_eq!(
        copies[0]
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        Some(held.to_string()),
        "the held copy first"
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// The client ports of the consumer's dead-letter connections.
/// (`list_connections` lists every vhost's: those of the tests running beside this one are told apart by theirs.)
fn dead_letter_connections(env: &TestEnv) -> Vec<String> {
    common::rabbitmqctl(&[
        "-q",
        "list_connections",
        "vhost",
        "peer_port",
        "client_properties",
    ])
    .lines()
    .filter(|l| l.contains("(dead letters)"))
    .filter_map(|l| {
        let mut cols = l.split('\t');
        (cols.next() == Some(env.vhost.as_str()))
            .then(|| cols.next().unwrap_or_default().to_owned())
    })
    .collect()
}

/// One worker consuming until idle, with `point` armed; returns once the point is reached and the broker has closed
/// the consumer's connection under it.
fn one_worker_cut_at(env: &TestEnv, point: &str) -> common::Proc {
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "1",
            "--exit-when-idle",
            "1s",
        ],
        &[("INBOXCTL_FAILPOINTS", point)],
    );
    let name = point.split('=').next().unwrap_or(point);
    consumer.wait_for_stderr(
        &format!("failpoint {name} reached"),
        Duration::from_secs(30),
    );
    common::close_connection(&env.vhost, "inboxctl consume");
    consumer
}

/// The consumer ended by itself (idle) `within`, and every parcel has its one effect, nothing left on the queue.
async fn ends_with_each_once(
    env: &TestEnv,
    consumer: &mut common::Proc,
    parcels: i64,
    within: Duration,
) {
    assert_eq!(consumer.wait(within), Some(0), "{}", consumer.stderr());
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        parcels
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// An ack on a connection the broker has closed meanwhile: lapin answers `Ok(false)` (its acker poisoned), which the
/// consumer took for "settled before" and never counted out of flight, so `--exit-when-idle` waited for ever. The
/// failpoint holds the first message between its commit and its ack while the broker closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_on_a_connection_closed_meanwhile_is_counted_out_of_flight() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "3"]);
    // Held 10 s: the cut comes within a second of the hold's start, or seconds on a loaded machine without the
    // test's own Erlang node.
    let mut consumer = one_worker_cut_at(&env, "after-commit=sleep-once-10000");
    ends_with_each_once(&env, &mut consumer, 3, Duration::from_secs(30)).await;
    assert!(
        consumer.stderr().contains("duplicate discarded"),
        "{}",
        consumer.stderr()
    );
}

/// The consume loop waiting for a free worker (the only one busy for 15 s, held by a failpoint) still sees its
/// connection closed under it, and connects again at once rather than when the worker is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_while_waiting_for_a_free_worker_is_seen_at_once() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Slow"]);
    common::publish_parcels(&env, &["--count", "5"]);
    let mut consumer = one_worker_cut_at(&env, "carrier=sleep-once-15000@Slow");
    // Well before the worker is free again (15 s after the hold began; the cut comes within a second of it).
    consumer.wait_for_stderr(
        "RabbitMQ connection lost while waiting for a free worker",
        Duration::from_secs(8),
    );
    ends_with_each_once(&env, &mut consumer, 6, Duration::from_secs(60)).await;
}
