//! A RabbitMQ cluster of three private nodes (`scripts/cluster.sh`), the consumers on quorum queues: the node holding
//! a queue's leader killed with SIGKILL mid-stream, then started again. Every parcel once, nothing dead-lettered;
//! `publish`, `consume` and `replay` go on through the other nodes of one `--amqp-url` host list.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, Cluster, NOTIFICATION_QUEUE, TestEnv};

fn run_ok(env: &TestEnv, amqp: &str, args: &[&str]) -> String {
    let out = env.cmd().env("AMQP_URL", amqp).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leaders_node_killed_mid_stream_every_parcel_once_and_replay_goes_on_through_the_others()
 {
    let env = TestEnv::migrated().await;
    let cluster = Cluster::start();
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");

    // The consumer declares its queue as a quorum queue, replicated on the three nodes.
    run_ok(
        &env,
        &cluster.url_from(1),
        &[
            "consume",
            "carrier",
            "--queue-type",
            "quorum",
            "--exit-when-idle",
            "1s",
        ],
    );
    assert_eq!(cluster.queue(2, CARRIER_QUEUE).unwrap().0, "quorum");
    let leader = cluster.leader(CARRIER_QUEUE);
    // Both processes connect to the leader's node first, so that its end is theirs too.
    let url = cluster.url_from(leader);
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--queue-type",
            "quorum",
            "--concurrency",
            "4",
            "--prefetch",
            "16",
        ],
        &[("AMQP_URL", url.as_str())],
    );
    let mut publisher = env.spawn_with(
        &[
            "publish",
            "parcel-created",
            "--count",
            "2000",
            "--duplicates",
            "0.1",
            "--rate",
            "250",
            "--json",
        ],
        &[("AMQP_URL", url.as_str())],
    );
    common::eventually(
        "a first part processed",
        Duration::from_secs(60),
        || async { effects().await >= 300 },
    )
    .await;
    cluster.kill(leader);
    let at_kill = effects().await;
    assert!(at_kill < 2_000, "the kill came mid-stream ({at_kill} done)");
    // With the node down, the consumer and the publisher go on through the other two.
    common::eventually(
        "progress while the leader's node is down",
        Duration::from_secs(60),
        || async { effects().await >= at_kill + 300 },
    )
    .await;
    cluster.boot(leader);
    assert_eq!(
        publisher.wait(Duration::from_secs(120)),
        Some(0),
        "{}",
        publisher.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(&publisher.stdout()).unwrap();
    assert_eq!(report["published"], 2000, "{report}");
    assert!(report["reconnects"].as_u64().unwrap() >= 1, "{report}");
    common::eventually("all 2,000 parcels", Duration::from_secs(120), || async {
        effects().await >= 2_000
    })
    .await;
    common::assert_carrier_exactly_once(&pool, 2_000).await;
    let stderr = consumer.stderr();
    assert!(
        stderr.contains("connected to another RabbitMQ node"),
        "{stderr}"
    );
    assert!(!stderr.contains("moving it to the error queue"), "{stderr}");
    assert!(
        cluster
            .queue(1, &format!("{CARRIER_QUEUE}_error"))
            .is_none(),
        "nothing dead-lettered"
    );
    consumer.terminate();

    // Dead letters on quorum queues, replayed while the node of the error queue's leader is down.
    let any = cluster.url_from(1);
    let notification = |extra: &[&str]| {
        let mut args = vec![
            "consume",
            "notification",
            "--queue-type",
            "quorum",
            "--exit-when-idle",
            "2s",
        ];
        args.extend_from_slice(extra);
        run_ok(&env, &any, &args);
    };
    notification(&[]);
    run_ok(
        &env,
        &any,
        &[
            "publish",
            "parcel-created",
            "--count",
            "50",
            "--destination",
            "FAIL",
        ],
    );
    notification(&["--fail-destination", "FAIL", "--max-attempts", "1"]);
    let error_queue = format!("{NOTIFICATION_QUEUE}_error");
    common::eventually(
        "50 dead letters on the quorum error queue",
        Duration::from_secs(30),
        || async { cluster.queue(1, &error_queue) == Some(("quorum".to_owned(), 50)) },
    )
    .await;
    let error_leader = cluster.leader(&error_queue);
    cluster.kill(error_leader);
    let alive = error_leader % 3 + 1;
    common::eventually(
        "a new leader elected for the error queue",
        Duration::from_secs(30),
        || async {
            let out = cluster.ctl(
                alive,
                &["list_queues", "name", "leader", "--no-table-headers"],
            );
            out.lines().any(|l| {
                l.starts_with(&format!("{error_queue}\t"))
                    && !l.ends_with(&format!("-{error_leader}@localhost"))
            })
        },
    )
    .await;
    // The URL names the dead node first.
    let replayed = run_ok(
        &env,
        &cluster.url_from(error_leader),
        &["replay", "--from", &error_queue, "--json"],
    );
    let replayed: serde_json::Value = serde_json::from_str(&replayed).unwrap();
    assert_eq!(replayed["replayed"], 50, "{replayed}");
    run_ok(
        &env,
        &cluster.url_from(error_leader),
        &[
            "consume",
            "notification",
            "--queue-type",
            "quorum",
            "--exit-when-idle",
            "2s",
        ],
    );
    let sent = common::count(
        &pool,
        "SELECT count(DISTINCT parcel_id) FROM notifications_sent",
    )
    .await;
    let rows = common::count(&pool, "SELECT count(*) FROM notifications_sent").await;
    assert_eq!((rows, sent), (50, 50), "every notification once");
    cluster.boot(error_leader);
}

/// A host list whose first node accepts the connection and never speaks (a host gone behind a load balancer, a
/// firewall that drops): `top` bounds each refresh's connect to 2 s, and the broker's connect began each time at that
/// node, 10 s its own bound, so it never reached the second — every queue figure unknown with the cluster healthy.
/// A connect given up on starts at the next node the next time.
#[tokio::test(flavor = "multi_thread")]
async fn a_connect_given_up_on_a_silent_node_starts_at_the_next_one_the_next_time() {
    let env = TestEnv::migrated().await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let url = env.amqp_url.replace(
        "guest:guest@127.0.0.1:5672",
        &format!("guest:guest@127.0.0.1:{silent_port},127.0.0.1:5672"),
    );
    assert_ne!(url, env.amqp_url, "the test's URL is the shared broker's");
    let broker = inboxctl::amqp::Broker::from_url(&url).unwrap();
    let bound = std::time::Duration::from_secs(2);
    let first = tokio::time::timeout(bound, broker.connect("test")).await;
    assert!(first.is_err(), "the silent node held the first connect");
    // A connect to the live node takes well under a second, but the box may be at its busiest (private nodes booting
    // beside this test): 8 s, still short of the 10 s the silent node would hold a connect that began at it.
    let second = tokio::time::timeout(Duration::from_secs(8), broker.connect("test"))
        .await
        .expect("the next connect starts at the live node")
        .unwrap();
    inboxctl::amqp::close(&second, "OK").await;
    drop(silent);
}

/// A host list whose first node does not answer: the next one is used; none answering is the broker unavailable
/// (exit 69) naming how many were tried, the password masked.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_list_goes_past_a_node_that_does_not_answer() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let live = env.amqp_url.replace(
        "guest:guest@127.0.0.1:5672",
        &format!("guest:guest@127.0.0.1:{dead_port},127.0.0.1:5672"),
    );
    assert_ne!(live, env.amqp_url, "the test's URL is the shared broker's");
    let out = env
        .cmd()
        .env("AMQP_URL", &live)
        .args(["publish", "parcel-created", "--count", "3", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("node=127.0.0.1:{dead_port}")),
        "{stderr}"
    );

    let none = env.amqp_url.replace(
        "guest:guest@127.0.0.1:5672",
        &format!("guest:guest@127.0.0.1:{dead_port},127.0.0.1:{dead_port}"),
    );
    let out = env
        .cmd()
        .env("AMQP_URL", &none)
        .args(["publish", "parcel-created", "--count", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("none of its 2 nodes answered"), "{stderr}");
    assert!(!stderr.contains("guest:guest"), "{stderr}");

    let out = env
        .cmd()
        .args(["publish", "parcel-created", "--count", "1"])
        .args([
            "--amqp-url",
            &env.amqp_url,
            "--amqp-url",
            "amqp://other:pw@127.0.0.1:5673/x",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("differ only in host and port"));
}
