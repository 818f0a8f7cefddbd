//! Per-key order: `consume --partitions N --partition-key parcelId` spreads the event over N queues by a
//! consistent-hash exchange on the routing key (`publish --partition-key parcelId` sets it), each queue read by one
//! active consumer at a time (`x-single-active-consumer`), one message at a time. Every parcel's events are
//! processed in the order they were published, and once — also when the process that was active on some partitions
//! is SIGKILLed mid-stream and standbys take them over.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{EVENT_EXCHANGE, Proc, TestEnv};
use uuid::Uuid;

const QUEUE: &str = "orders-carrier";
const PARTITIONS: u16 = 8;
const PARCELS: usize = 1_000;
const EVENTS: usize = 5;

fn partitioned(env: &TestEnv, extra: &[&str]) -> Proc {
    partitioned_on(env, "classic", extra)
}

fn partitioned_on(env: &TestEnv, queue_type: &str, extra: &[&str]) -> Proc {
    let partitions = PARTITIONS.to_string();
    let mut args = vec![
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        &partitions,
        "--partition-key",
        "parcelId",
        "--prefetch",
        "16",
        "--queue-type",
        queue_type,
    ];
    args.extend_from_slice(extra);
    env.spawn(&args)
}

/// Which inboxctl process (by pid, from its consumer tag) is the active consumer of each partition queue.
fn active_consumers(env: &TestEnv) -> HashMap<String, u32> {
    let out = common::rabbitmqctl(&[
        "-q",
        "list_consumers",
        "-p",
        &env.vhost,
        "queue_name",
        "consumer_tag",
        "active",
    ]);
    out.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split('\t').collect();
            let [queue, tag, active] = cols[..] else {
                return None;
            };
            let pid = tag
                .strip_prefix("inboxctl-")?
                .split('-')
                .next()?
                .parse()
                .ok()?;
            (active == "true").then(|| (queue.to_owned(), pid))
        })
        .collect()
}

/// The order the messages went out in, from a queue bound to the event exchange before anything was published:
/// `(message id, parcel id)`, each id at its first copy.
async fn published_order(env: &TestEnv, capture: &str) -> Vec<(Uuid, Uuid)> {
    let conn = env.amqp().await;
    let mut seen = std::collections::HashSet::new();
    let mut order = Vec::new();
    for delivery in common::drain(&conn, capture).await {
        let incoming =
            inboxctl::amqp::envelope::parse(&delivery.properties, &delivery.data).unwrap();
        let event: inboxctl::parcel::ParcelCreatedEvent =
            serde_json::from_str(incoming.payload.get()).unwrap();
        assert_eq!(
            delivery.routing_key.as_str(),
            event.parcel_id.to_string(),
            "publish --partition-key parcelId sets the routing key"
        );
        if seen.insert(incoming.message_id) {
            order.push((incoming.message_id, event.parcel_id));
        }
    }
    order
}

#[tokio::test]
async fn each_parcels_events_are_processed_in_order_and_once_across_a_killed_active_consumer() {
    in_order_across_a_kill("classic").await;
}

/// The same on quorum queues: a consumer's unacknowledged messages go back to the queue when its process dies, ahead
/// of what it had not been sent yet, and in their order.
#[tokio::test]
async fn on_quorum_queues_each_parcels_events_are_processed_in_order_and_once_across_a_killed_active_consumer()
 {
    in_order_across_a_kill("quorum").await;
}

async fn in_order_across_a_kill(queue_type: &str) {
    let env = TestEnv::migrated().await;
    let mut consumers: Vec<Proc> = (0..3)
        .map(|_| partitioned_on(&env, queue_type, &[]))
        .collect();
    for c in &consumers {
        // Each partition's loop says it is consuming once its queue is declared and subscribed to.
        common::eventually(
            "every partition subscribed",
            Duration::from_secs(30),
            || async { c.stderr().matches("consuming").count() >= usize::from(PARTITIONS) },
        )
        .await;
    }
    assert!(
        consumers[0].has_said("partitioned"),
        "{}",
        consumers[0].stderr()
    );
    // Declared by the consumers; a copy of everything published, in the order it went out.
    common::capture_queue(&env.amqp().await, EVENT_EXCHANGE, "capture").await;
    let actives = active_consumers(&env);
    assert_eq!(
        actives.len(),
        usize::from(PARTITIONS),
        "one active consumer per partition: {actives:?}"
    );

    let started = Instant::now();
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        &PARCELS.to_string(),
        "--events-per-parcel",
        &EVENTS.to_string(),
        "--partition-key",
        "parcelId",
        "--duplicates",
        "0.1",
        "--rate",
        "1000",
    ]);
    let pool = env.pool().await;
    let total = (PARCELS * EVENTS) as i64;
    common::eventually("1,000 effects", Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 1_000
    })
    .await;
    // The process that is the active consumer of the most partitions, killed mid-stream. Who is active does not
    // change before the kill: the listing read before the publish is used, and nothing slow (a `rabbitmqctl` call,
    // seconds on a loaded box) stands between the 1,000th effect and the kill.
    let mut held: HashMap<u32, usize> = HashMap::new();
    for pid in actives.values() {
        *held.entry(*pid).or_default() += 1;
    }
    let (&victim_pid, &victim_partitions) = held.iter().max_by_key(|(_, n)| **n).unwrap();
    let victim = consumers
        .iter()
        .position(|c| c.pid() == victim_pid)
        .expect("the active consumer is one of ours");
    consumers[victim].kill();
    let at_kill = common::count(&pool, "SELECT count(*) FROM carrier_reservations").await;
    assert!(
        at_kill < total,
        "killed mid-stream: {at_kill} of {total} effects were in"
    );

    assert_eq!(publisher.wait(Duration::from_secs(60)), Some(0));
    common::eventually("every event's effect", Duration::from_secs(120), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= total
    })
    .await;
    let after = active_consumers(&env);
    assert!(
        after.values().all(|pid| *pid != victim_pid) && after.len() == usize::from(PARTITIONS),
        "standbys took over every partition of the killed process: {after:?}"
    );
    let seconds = started.elapsed().as_secs_f64();

    let published = published_order(&env, "capture").await;
    assert_eq!(published.len(), PARCELS * EVENTS);
    let rows: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT message_id, parcel_id FROM carrier_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), PARCELS * EVENTS, "one effect per event");
    let distinct: std::collections::HashSet<Uuid> = rows.iter().map(|(m, _)| *m).collect();
    assert_eq!(distinct.len(), rows.len(), "no event's effect twice");
    let per_parcel = |pairs: &[(Uuid, Uuid)]| {
        let mut by: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
        for (message, parcel) in pairs {
            by.entry(*parcel).or_default().push(*message);
        }
        by
    };
    let expected = per_parcel(&published);
    let processed = per_parcel(&rows);
    assert_eq!(expected.len(), PARCELS);
    let out_of_order = expected
        .iter()
        .filter(|(parcel, order)| processed.get(*parcel) != Some(*order))
        .count();
    assert_eq!(
        out_of_order, 0,
        "every parcel's effects in the order its events were published"
    );
    for dead in [format!("{QUEUE}_error"), format!("{QUEUE}_skipped")] {
        assert!(
            !env.queue_exists(&dead) || env.queue_counts(&dead) == (0, 0),
            "{dead} stays empty"
        );
    }
    // The copies published after the last originals may still queue behind them in their partitions.
    common::eventually("the copies discarded", Duration::from_secs(60), || async {
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
        )
        .await
            >= 500
    })
    .await;
    let duplicates = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    assert!(
        duplicates >= 500,
        "the published copies were discarded: {duplicates}"
    );
    eprintln!(
        "partitions ({queue_type}): {PARCELS} parcels × {EVENTS} events over {PARTITIONS} partitions in {seconds:.1} s; \
         killed the active consumer of {victim_partitions} partitions at {at_kill} effects; {duplicates} duplicates discarded"
    );
    for c in &consumers {
        if c.pid() != victim_pid {
            c.terminate();
        }
    }
    for mut c in consumers {
        c.wait(Duration::from_secs(30));
    }
}

#[tokio::test]
async fn stats_sums_the_partitions_and_a_replay_goes_back_to_the_messages_partition() {
    let env = TestEnv::migrated().await;
    let mut consumer = partitioned(&env, &["--fail-destination", "FAIL", "--max-attempts", "1"]);
    common::eventually(
        "every partition subscribed",
        Duration::from_secs(30),
        || async { consumer.stderr().matches("consuming").count() >= usize::from(PARTITIONS) },
    )
    .await;
    // A publisher that does not set the routing key: said once per partition queue, processed all the same.
    common::publish_parcels(&env, &["--count", "20", "--destination", "FAIL"]);
    common::eventually("20 dead letters", Duration::from_secs(30), || async {
        env.queue_exists(&format!("{QUEUE}_error"))
            && env.queue_counts(&format!("{QUEUE}_error")).0 == 20
    })
    .await;
    assert!(
        consumer.has_said("another routing key than its partition key"),
        "{}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));

    common::publish_parcels(&env, &["--count", "30", "--partition-key", "parcelId"]);
    let out = env.run(&["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let carrier = json["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == QUEUE)
        .expect("the partitioned consumer_type");
    assert_eq!(carrier["queue"]["name"], QUEUE);
    assert_eq!(carrier["queue"]["partitions"], PARTITIONS);
    assert_eq!(
        carrier["queue"]["ready"], 30,
        "the partitions' messages summed"
    );
    assert_eq!(
        carrier["error_queue"]["ready"], 20,
        "one error queue for all partitions"
    );

    // The dead letters name their partition queue as their origin; replay puts each back there.
    let conn = env.amqp().await;
    let dead = common::peek(&conn, &format!("{QUEUE}_error")).await;
    let origins: std::collections::HashSet<String> = dead
        .iter()
        .map(|d| common::header_text(&d.properties, "MT-Fault-InputAddress").unwrap())
        .collect();
    assert!(
        origins.iter().all(|o| o.contains(&format!("/{QUEUE}."))),
        "each names a partition queue: {origins:?}"
    );
    // A look (`stats`' at the head, the peek above) gives back what it held with a message to the queue, and a queue
    // answers a count ahead of such messages still waiting for it: under load a replay begun at once could count one
    // short. Settled first, so that it counts all 20.
    common::eventually(
        "the looks' messages back in the error queue",
        Duration::from_secs(10),
        || async { env.queue_counts(&format!("{QUEUE}_error")) == (20, 0) },
    )
    .await;
    let out = env.run(&["replay", "--from", &format!("{QUEUE}_error"), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(
        (&report["snapshot"], &report["replayed"]),
        (&20.into(), &20.into()),
        "{report}"
    );
    let counts: Vec<(u64, u64)> = (0..PARTITIONS)
        .map(|i| env.queue_counts(&format!("{QUEUE}.{i}")))
        .collect();
    let total: u64 = counts.iter().map(|(ready, _)| ready).sum();
    assert_eq!(
        total,
        50,
        "the 30 waiting and the 20 replayed, in the partition queues: {counts:?}, error queue {:?}, replay {}",
        env.queue_counts(&format!("{QUEUE}_error")),
        out.stdout
    );

    // A replayed copy comes straight to its partition queue, by its name: not a publisher's routing key to warn of
    // (said once a queue, such a warning would leave a later publisher that does not set the key unsaid).
    let mut consumer = partitioned(&env, &["--exit-when-idle", "1s"]);
    assert_eq!(consumer.wait(Duration::from_secs(60)), Some(0));
    assert!(
        !consumer.has_said("another routing key than its partition key"),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    let processed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE consumer_type = $1")
            .bind(QUEUE)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(processed, 50);
}

/// A switch from one queue to partitions and back. The queue of the consumer without partitions goes on taking a
/// copy of every message, and what it held before the partitions were bound is there alone, where no partitioned
/// consumer reads it: the partitioned consumer says so at its start, with the count. Back without partitions, the
/// consumer says the same of the partition queues. Nothing is refused: a switch runs both for a while.
#[tokio::test]
async fn a_switch_between_one_queue_and_partitions_says_what_the_other_still_holds() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    let queue = "switched-carrier";
    inboxctl::amqp::topology::ensure_endpoint(
        &conn,
        EVENT_EXCHANGE,
        queue,
        inboxctl::amqp::topology::QueueType::Classic,
    )
    .await
    .unwrap();
    let report = common::publish_parcels(&env, &["--count", "3"]);
    assert_eq!(report["published"], 3);

    let consume = |partitions: bool| {
        let mut args = vec![
            "consume",
            "carrier",
            "--queue",
            queue,
            "--exit-when-idle",
            "1s",
        ];
        if partitions {
            args.extend(["--partitions", "2", "--partition-key", "parcelId"]);
        }
        env.run(&args)
    };
    let out = consume(true);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr
            .matches("the queue of this consumer without partitions exists")
            .count()
            == 1
            && out.stderr.contains("ready=3"),
        "said once, not once a partition: {}",
        out.stderr
    );
    assert_eq!(
        env.queue_counts(queue),
        (3, 0),
        "still there, for a consumer without partitions"
    );

    let out = consume(false);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr
            .contains("an earlier run spread this queue over partition queues"),
        "{}",
        out.stderr
    );
    assert_eq!(env.queue_counts(queue), (0, 0));
    let pool = env.pool().await;
    let processed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE consumer_type = $1")
            .bind(queue)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(processed, 3);
}

#[tokio::test]
async fn a_partition_left_over_from_more_partitions_or_a_plain_queue_in_the_way_is_refused() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    // An earlier run with more partitions left <queue>.8 bound to the exchange: a share of the messages would land
    // where nobody reads them.
    inboxctl::amqp::topology::ensure_partitioned_endpoint(
        &conn,
        EVENT_EXCHANGE,
        QUEUE,
        9,
        inboxctl::amqp::topology::QueueType::Classic,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let out = env.run(&[
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "8",
        "--partition-key",
        "parcelId",
        "--exit-when-idle",
        "1s",
    ]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains(&format!("queue \"{QUEUE}.8\" exists")),
        "{}",
        out.stderr
    );

    // A partition queue declared without a single active consumer (by hand, say) would give up the order.
    let other = "plain-carrier";
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            format!("{other}.0").as_str().into(),
            lapin::options::QueueDeclareOptions::durable(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let out = env.run(&[
        "consume",
        "carrier",
        "--queue",
        other,
        "--partitions",
        "2",
        "--partition-key",
        "parcelId",
        "--exit-when-idle",
        "1s",
    ]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("with a single active consumer"),
        "{}",
        out.stderr
    );
}

/// A clean stop (SIGTERM) of the active consumer while it works on a parcel's first event, a standby waiting: the
/// standby takes the partition only once the stopping process has finished that event and closed its connection, so
/// the parcel's 30 effects land in the order its events were published. (A cancel sent before the drain made the
/// standby active at once: it took the later events while the first was still being worked on, and the first effect
/// landed last.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_of_the_active_consumer_keeps_each_parcels_order() {
    let env = TestEnv::migrated().await;
    let args = [
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "1",
        "--partition-key",
        "parcelId",
        "--prefetch",
        "16",
    ];
    let mut active = env.spawn_with(&args, &[("INBOXCTL_FAILPOINTS", "carrier=sleep-once-3000")]);
    active.wait_for_stderr("consuming", Duration::from_secs(30));
    let mut standby = env.spawn(&args);
    standby.wait_for_stderr("consuming", Duration::from_secs(30));
    common::capture_queue(&env.amqp().await, EVENT_EXCHANGE, "capture").await;
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        "1",
        "--events-per-parcel",
        "30",
        "--partition-key",
        "parcelId",
        "--rate",
        "10",
    ]);
    active.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    active.terminate();
    assert_eq!(
        active.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        active.stderr()
    );
    assert_eq!(publisher.wait(Duration::from_secs(60)), Some(0));
    let pool = env.pool().await;
    common::eventually("every event's effect", Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 30
    })
    .await;
    let published: Vec<Uuid> = published_order(&env, "capture")
        .await
        .into_iter()
        .map(|(message, _)| message)
        .collect();
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM carrier_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    standby.terminate();
    assert_eq!(standby.wait(Duration::from_secs(30)), Some(0));
    assert_eq!(
        processed, published,
        "the parcel's effects in the order its events were published"
    );
}

/// A partitioned topology whose declarations take, together, longer than `--broker-timeout` (each partition's 800 ms
/// here, a failpoint standing for quorum queues' consensus on a cluster; 4 of them against 2 s): each is bounded, not
/// the whole, and the consumer starts. Bound as one, the start failed ("did not set the connection up within 2s"):
/// measured 2026-12-07 on this machine's broker, 512 quorum partitions took 10 s to declare, and failed at
/// `--broker-timeout 5s`; they start now.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_topology_longer_to_declare_than_one_broker_call_still_starts() {
    let env = TestEnv::migrated().await;
    let queue = "slow-declare";
    let failpoints: Vec<String> = (0..4)
        .map(|i| format!("declare-partition=sleep-once-800@{queue}.{i}"))
        .collect();
    let failpoints = failpoints.join(",");
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--queue",
            queue,
            "--partitions",
            "4",
            "--partition-key",
            "parcelId",
            "--broker-timeout",
            "2s",
            "--exit-when-idle",
            "1s",
        ],
        &[("INBOXCTL_FAILPOINTS", failpoints.as_str())],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        consumer
            .stderr()
            .matches("failpoint declare-partition reached")
            .count(),
        4,
        "{}",
        consumer.stderr()
    );
    for i in 0..4 {
        assert!(
            env.queue_exists(&format!("{queue}.{i}")),
            "{}",
            consumer.stderr()
        );
    }
}

/// A stop while a partition's first message waits to retry, the next ones of the partition waiting for the worker it
/// holds. The stop ends the wait and frees the worker; the consume loop, waiting to hand the next message over, took
/// that worker before it saw the stop, and processed the next message — committed and acknowledged ahead of the one
/// given back. Now a worker freed by a stop (or by the link's loss) starts nothing. A race, so several rounds; the
/// consumer after the stop books them in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_retry_wait_starts_nothing_behind_the_message_given_back() {
    const ROUNDS: usize = 10;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let args = [
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "1",
        "--partition-key",
        "parcelId",
        "--prefetch",
        "16",
    ];
    let failing: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--fail-destination", "Late", "--retry-delay", "30s"])
        .collect();
    let draining: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--exit-when-idle", "1s"])
        .collect();
    let conn = env.amqp().await;
    let mut published = Vec::new();
    for round in 0..ROUNDS {
        let mut active = env.spawn(&failing);
        active.wait_for_stderr("consuming", Duration::from_secs(30));
        for destination in ["Late", "Berlin", "Berlin"] {
            let id = Uuid::now_v7();
            let (props, body, _) = common::parcel_message(id, destination);
            common::publish(&conn, EVENT_EXCHANGE, "one-key", props, &body).await;
            published.push(id);
        }
        active.wait_for_stderr("attempt failed", Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(300)).await;
        active.terminate();
        assert_eq!(
            active.wait(Duration::from_secs(30)),
            Some(0),
            "{}",
            active.stderr()
        );
        let booked = common::count(&pool, "SELECT count(*) FROM carrier_reservations").await;
        assert_eq!(
            booked,
            i64::try_from(3 * round).unwrap(),
            "round {round}: the stopped consumer booked a message behind the one it gave back\n{}",
            active.stderr()
        );
        let mut drain = env.spawn(&draining);
        assert_eq!(
            drain.wait(Duration::from_secs(60)),
            Some(0),
            "{}",
            drain.stderr()
        );
    }
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM carrier_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(processed, published, "booked in the order published");
}

/// A stop while the active consumer of a partition waits to retry a parcel's first event (its carrier fails for the
/// destination; the next attempt 30 s away), the parcel's later events held by it meanwhile, a standby waiting. The
/// wait is cut short, and the event is not nacked: the consumer is still the partition's active one, so a nack would
/// hand the event straight back to it, behind the later ones. The close gives all five back in order, and the
/// standby (whose carrier does not fail) books them in the order they were published. On both queue types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_retry_wait_keeps_the_partitions_order() {
    for queue_type in ["classic", "quorum"] {
        stop_during_a_retry_wait_keeps_order(queue_type).await;
    }
}

async fn stop_during_a_retry_wait_keeps_order(queue_type: &str) {
    let env = TestEnv::migrated().await;
    let args = [
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "1",
        "--partition-key",
        "parcelId",
        "--prefetch",
        "16",
        "--queue-type",
        queue_type,
    ];
    let failing: Vec<&str> = args
        .iter()
        .copied()
        .chain([
            "--fail-destination",
            "Late",
            "--retry-delay",
            "30s",
            "--max-attempts",
            "5",
        ])
        .collect();
    let mut active = env.spawn(&failing);
    active.wait_for_stderr("consuming", Duration::from_secs(30));
    let mut standby = env.spawn(&args);
    standby.wait_for_stderr("consuming", Duration::from_secs(30));
    common::capture_queue(&env.amqp().await, EVENT_EXCHANGE, "capture").await;
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        "1",
        "--events-per-parcel",
        "5",
        "--partition-key",
        "parcelId",
        "--destination",
        "Late",
    ]);
    assert_eq!(publisher.wait(Duration::from_secs(60)), Some(0));
    active.wait_for_stderr("attempt failed", Duration::from_secs(30));
    // The later four reach the active consumer's prefetch meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    active.terminate();
    assert_eq!(
        active.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        active.stderr()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "the retry's wait cut short by the stop"
    );
    let pool = env.pool().await;
    common::eventually(
        "every event's effect, by the standby",
        Duration::from_secs(60),
        || async { common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 5 },
    )
    .await;
    let published: Vec<Uuid> = published_order(&env, "capture")
        .await
        .into_iter()
        .map(|(message, _)| message)
        .collect();
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM carrier_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    standby.terminate();
    assert_eq!(standby.wait(Duration::from_secs(30)), Some(0));
    assert_eq!(
        processed, published,
        "on {queue_type} queues, the parcel's effects in the order its events were published"
    );
}

/// A partition's message that cannot be settled now — its handling panicked (outside the work, which would be a
/// failed attempt), or its dead-letter copy refused — is handled again in place after its pause, not given back: a
/// nack sent it behind the partition's later messages, which the broker had sent already (the prefetch), and they
/// were processed first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_handling_panicked_keeps_its_place_in_its_partition() {
    let env = TestEnv::migrated().await;
    let args = [
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "1",
        "--partition-key",
        "parcelId",
        "--prefetch",
        "16",
    ];
    // A first run declares the partition queue and its exchange.
    let mut first = env.spawn(&args);
    first.wait_for_stderr("consuming queue", Duration::from_secs(30));
    first.terminate();
    assert_eq!(first.wait(Duration::from_secs(30)), Some(0));
    common::capture_queue(&env.amqp().await, EVENT_EXCHANGE, "capture").await;
    common::publish_parcels(
        &env,
        &[
            "--count",
            "1",
            "--events-per-parcel",
            "5",
            "--partition-key",
            "parcelId",
        ],
    );
    let published: Vec<Uuid> = published_order(&env, "capture")
        .await
        .into_iter()
        .map(|(message, _)| message)
        .collect();
    assert_eq!(published.len(), 5);
    let failpoint = format!("handle=panic-once@{}", published[0]);
    let mut consumer = env.spawn_with(&args, &[("INBOXCTL_FAILPOINTS", failpoint.as_str())]);
    let pool = env.pool().await;
    common::eventually("every event's effect", Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 5
    })
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    assert!(
        consumer.stderr().contains("handling a message panicked"),
        "{}",
        consumer.stderr()
    );
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM carrier_reservations ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        processed, published,
        "the parcel's effects in the order its events were published"
    );
}

/// A suspect (a redelivered message in flight at an earlier end of its process) is tried alone: nothing else in flight
/// in its process, so that if the process ends again, nothing shares the blame. With partitions, "nothing else" is
/// every partition's attempts, not only its own partition's: else a healthy message at the head of another partition,
/// a suspect too after the same ends, would be counted as ending the process alone and moved aside with the poison.
/// Here the suspect's attempt is held (its key taken by a transaction left open), and no other partition's message is
/// processed until it is through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_on_one_partition_is_tried_alone_in_the_whole_process() {
    let env = TestEnv::migrated().await;
    let (_, id) = one_parcel_redelivered(&env).await;
    let pool = env.pool().await;
    // Its start counted once before: a suspect.
    common::count_a_start(&pool, id, QUEUE).await;
    let holder = common::hold_key(&pool, id, QUEUE).await;

    let mut consumer = partitioned(&env, &["--claim-timeout", "10m"]);
    common::eventually(
        "the suspect's claim waiting on the key",
        Duration::from_secs(30),
        // This database's sessions only: the server is shared with the other tests.
        || async {
            common::count(
                &pool,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await
                >= 1
        },
    )
    .await;
    common::publish_parcels(&env, &["--count", "20", "--partition-key", "parcelId"]);
    let effects = "SELECT count(*) FROM carrier_reservations";
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        common::count(&pool, effects).await,
        0,
        "processed beside a suspect tried alone: {}",
        consumer.stderr()
    );
    holder.rollback().await.unwrap();
    common::eventually(
        "every message processed",
        Duration::from_secs(30),
        || async { common::count(&pool, effects).await == 21 },
    )
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// One partition's first connection fails (held past `--broker-timeout` by a failpoint) while another partition works
/// on a message (a suspect, tried alone; its carrier call takes 10 s): the run fails, but only once the other
/// partitions have drained as at a stop — the message finished and acknowledged, its counted start taken back. They
/// used to be dropped half-way: the message back on its queue unprocessed and its start left counted, as if it had
/// ended the process — with a supervisor restarting the service into the same failure, a healthy message on its way
/// to being moved aside as poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_cannot_start_lets_the_others_drain_before_the_run_fails() {
    let env = TestEnv::migrated().await;
    let (partition, id) = one_parcel_redelivered(&env).await;
    let pool = env.pool().await;
    common::count_a_start(&pool, id, QUEUE).await;

    // The held partition's connection is given up after the broker timeout (6 s: time enough, on a loaded machine,
    // for the other partition to connect and reach its message's work), while that work is held (10 s).
    let held = format!(
        "open-link=sleep-once-20000@{QUEUE}.{},carrier=sleep-once-10000",
        (partition + 1) % PARTITIONS
    );
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--queue",
            QUEUE,
            "--partitions",
            &PARTITIONS.to_string(),
            "--partition-key",
            "parcelId",
            "--broker-timeout",
            "6s",
            "--shutdown-timeout",
            "20s",
        ],
        &[("INBOXCTL_FAILPOINTS", held.as_str())],
    );
    let code = consumer.wait(Duration::from_secs(60));
    let stderr = consumer.stderr();
    assert_eq!(
        code,
        Some(69),
        "the run failed, RabbitMQ unavailable: {stderr}"
    );
    assert!(stderr.contains("failpoint carrier reached"), "{stderr}");
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1,
        "finished before the exit: {stderr}"
    );
    assert_eq!(
        env.queue_counts(&format!("{QUEUE}.{partition}")),
        (0, 0),
        "acknowledged: {stderr}"
    );
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inboxctl_attempts WHERE message_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 0, "no start left counted: {stderr}");
}

/// The partition queues declared (a consumer run until every partition is subscribed, then stopped), one parcel
/// published, and looked at once and given back, so that it comes redelivered: its partition and its message id.
async fn one_parcel_redelivered(env: &TestEnv) -> (u16, Uuid) {
    let mut consumer = partitioned(env, &[]);
    common::eventually(
        "every partition subscribed",
        Duration::from_secs(30),
        || async { consumer.stderr().matches("consuming").count() >= usize::from(PARTITIONS) },
    )
    .await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    common::publish_parcels(env, &["--count", "1", "--partition-key", "parcelId"]);
    let conn = env.amqp().await;
    let mut found = Vec::new();
    for i in 0..PARTITIONS {
        found.extend(
            common::peek(&conn, &format!("{QUEUE}.{i}"))
                .await
                .into_iter()
                .map(|d| (i, d)),
        );
    }
    let _ = conn.close(200, "OK".into()).await;
    assert_eq!(found.len(), 1);
    let (partition, delivery) = &found[0];
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .unwrap()
        .as_str()
        .parse()
        .unwrap();
    (*partition, id)
}

/// `--exit-when-idle` with partitions ends once every partition is idle at once. Partition 1 busy first (a parcel
/// whose carrier call fails, tried 3 times 2 and 4 s apart) while partition 0 is idle; then two such parcels at once on
/// partition 0, which works 12 s on them; partition 1, idle meanwhile, reads on, and a parcel published to it then is
/// processed before the run ends idle (exit 0). Each partition used to stop on its own once idle (partition 0 at once,
/// leaving its two parcels in its queue); and a partition counted idle stayed counted while it worked on a burst, so
/// that partition 1 stopped as soon as it was idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_partitions_the_run_ends_idle_only_once_every_partition_is() {
    let env = TestEnv::migrated().await;
    let mut consumer = env.spawn(&[
        "consume",
        "carrier",
        "--queue",
        QUEUE,
        "--partitions",
        "2",
        "--partition-key",
        "parcelId",
        "--fail-destination",
        "FAIL",
        "--max-attempts",
        "3",
        "--retry-delay",
        "2s",
        "--exit-when-idle",
        "1s",
    ]);
    consumer.wait_for_stderr_times("consuming queue", 2, Duration::from_secs(30));
    let conn = env.amqp().await;
    let to = |partition: u16| format!("{QUEUE}.{partition}");
    let failing = || common::parcel_message(Uuid::now_v7(), "FAIL");
    let (props, body, _) = failing();
    common::publish(&conn, "", &to(1), props, &body).await;
    // Partition 0 idle (1 s without a message), partition 1 busy: then the burst on partition 0.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for _ in 0..2 {
        let (props, body, _) = failing();
        common::publish(&conn, "", &to(0), props, &body).await;
    }
    let error_queue = format!("{QUEUE}_error");
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        &error_queue,
        inboxctl::amqp::topology::QueueType::Classic,
    )
    .await
    .unwrap();
    common::eventually(
        "partition 1's parcel moved aside",
        Duration::from_secs(30),
        || async { env.queue_counts(&error_queue).0 >= 1 },
    )
    .await;
    // Partition 1 idle (1 s more), partition 0 still on its burst: a parcel for partition 1.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = Uuid::now_v7();
    let (props, body, _) = common::parcel_message(late, "Berlin");
    common::publish(&conn, "", &to(1), props, &body).await;
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    for partition in [0, 1] {
        assert_eq!(
            env.queue_counts(&to(partition)),
            (0, 0),
            "partition {partition} read to the end: {}",
            consumer.stderr()
        );
    }
    assert_eq!(env.queue_counts(&error_queue).0, 3, "{}", consumer.stderr());
    let pool = env.pool().await;
    let booked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE message_id = $1")
            .bind(late)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(booked, 1, "{}", consumer.stderr());
}

/// A consumer whose work overlaps with itself only if the run gives it two messages at once: it counts the works
/// running, and keeps the most seen, and the largest batch it was handed (a batch's member that fails is tried again
/// after the others commit: out of order).
struct Overlap {
    running: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    largest_batch: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl inboxctl::consumer::Consumer for Overlap {
    type Message = inboxctl::parcel::ParcelCreatedEvent;
    const MESSAGE_TYPE: &'static str = inboxctl::parcel::PARCEL_CREATED_URN;

    fn consume<'c>(
        &'c self,
        _tx: &'c mut sqlx::PgConnection,
        _context: &'c inboxctl::consumer::MessageContext,
        _message: &'c Self::Message,
    ) -> impl std::future::Future<Output = Result<(), inboxctl::inbox::WorkError>> + Send + 'c {
        use std::sync::atomic::Ordering::SeqCst;
        async move {
            let now = self.running.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.running.fetch_sub(1, SeqCst);
            Ok(())
        }
    }

    fn consume_batch<'c>(
        &'c self,
        tx: &'c mut sqlx::PgConnection,
        batch: &'c [&'c (inboxctl::consumer::MessageContext, Self::Message)],
    ) -> impl std::future::Future<Output = Result<(), inboxctl::inbox::WorkError>> + Send + 'c {
        self.largest_batch
            .fetch_max(batch.len(), std::sync::atomic::Ordering::SeqCst);
        async move {
            for (context, message) in batch.iter().copied() {
                self.consume(&mut *tx, context, message).await?;
            }
            Ok(())
        }
    }
}

/// Through the library, a partition is read one message at a time whatever concurrency and batch size the caller
/// gives `consumer::run` (the CLI refuses them beside `--partitions`; a library caller can pass them): two at once
/// process one key's messages out of order, and so does a batch whose member fails. Every message here goes to one partition (one routing key), a work takes
/// 20 ms, and 8 at once were asked for, with room for 32 unacked.
#[tokio::test(flavor = "multi_thread")]
async fn the_library_reads_a_partition_one_message_at_a_time_whatever_it_is_asked() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const MESSAGES: usize = 24;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    for (concurrency, batch_size) in [(8, 1), (1, 8)] {
        let queue = format!("overlap-{concurrency}-{batch_size}");
        let (most, largest_batch) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let consumer = Overlap {
            running: Arc::new(AtomicUsize::new(0)),
            most: Arc::clone(&most),
            largest_batch: Arc::clone(&largest_batch),
        };
        let inbox = inboxctl::inbox::Inbox::new(
            pool.clone(),
            inboxctl::inbox::ConsumerType::new(&queue).unwrap(),
        );
        let broker = inboxctl::amqp::Broker::from_url(&env.amqp_url).unwrap();
        let options = inboxctl::consumer::ConsumerOptions {
            prefetch: 32,
            concurrency,
            batch_size,
            partitions: Some(inboxctl::consumer::Partitions {
                count: 2,
                key: "parcelId".to_owned(),
            }),
            ..common::library_options(&queue)
        };
        // Published before the run starts, so that all of them wait in the partition when it begins to read.
        let conn = env.amqp().await;
        inboxctl::amqp::topology::ensure_partitioned_endpoint(
            &conn,
            EVENT_EXCHANGE,
            &queue,
            2,
            common::queue_type(),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        for _ in 0..MESSAGES {
            let (props, body, _) = common::parcel_message(Uuid::new_v4(), "NL");
            common::publish(&conn, EVENT_EXCHANGE, "one-parcel", props, &body).await;
        }
        let _ = conn.close(200, "OK".into()).await;
        let summary = tokio::time::timeout(
            Duration::from_secs(60),
            inboxctl::consumer::run(
                inbox,
                consumer,
                &broker,
                options,
                tokio_util::sync::CancellationToken::new(),
            ),
        )
        .await
        .expect("the run ends idle")
        .unwrap();
        assert_eq!(
            summary.processed, MESSAGES as u64,
            "{concurrency}/{batch_size}"
        );
        assert_eq!(
            most.load(SeqCst),
            1,
            "concurrency {concurrency}, batch size {batch_size}: at most one work at a time on a partition"
        );
        assert!(
            largest_batch.load(SeqCst) <= 1,
            "concurrency {concurrency}, batch size {batch_size}: no batch of several messages on a partition"
        );
    }
}

/// The partitioned topology is made sure of once a process, by one partition's link, not by each: each link did it
/// for all N queues (2N round trips a link, 2N² in all, at every start and reconnect), which with hundreds of
/// partitions ran past `--broker-timeout` at start.
#[tokio::test(flavor = "multi_thread")]
async fn the_partitioned_topology_is_made_once_a_process_not_once_a_partition() {
    let env = TestEnv::migrated().await;
    let mut consumer = partitioned(&env, &["-v", "--exit-when-idle", "1s"]);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert_eq!(
        stderr
            .matches("made sure of the partitioned topology")
            .count(),
        1,
        "{stderr}"
    );
    // And every partition was consumed.
    assert!(
        stderr.matches("consuming").count() >= usize::from(PARTITIONS),
        "{stderr}"
    );
}
