//! `--metrics-addr`: Prometheus counters and a health check that follows the real services.

use crate::common;

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{CARRIER_QUEUE, Proxy, TestEnv};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `(status line, body)` of a GET.
fn get(port: u16, path: &str) -> (String, String) {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

fn sample(body: &str, metric: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(metric))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_exports_its_counters_and_its_health_follows_the_database() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "10", "--duplicates", "0.5"]);
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let consumer = env.spawn_with(
        &["consume", "carrier", "--metrics-addr", &addr],
        &[("DATABASE_URL", proxied.as_str())],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let label = format!("{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    // Every delivery through, the late copies too (they come after all the originals).
    common::eventually(
        "all 15 deliveries through",
        Duration::from_secs(30),
        || async {
            let body = get(port, "/metrics").1;
            sample(&body, &format!("inbox_messages_processed_total{label}")) == Some(10.0)
                && sample(&body, &format!("inbox_deliveries_total{label}")) == Some(15.0)
        },
    )
    .await;
    let (status, body) = get(port, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(
        sample(&body, &format!("inbox_duplicates_discarded_total{label}")),
        Some(5.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, &format!("inbox_deliveries_total{label}")),
        Some(15.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, &format!("inbox_messages_dead_lettered_total{label}")),
        Some(0.0)
    );
    assert!(body.contains("# TYPE inbox_duplicates_discarded_total counter"));

    assert_eq!(
        get(port, "/health"),
        (
            "HTTP/1.1 200 OK".to_owned(),
            "{\"database\":\"up\",\"broker\":\"up\"}\n".to_owned()
        )
    );
    proxy.cut();
    let (status, body) = get(port, "/health");
    assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
    assert_eq!(body, "{\"database\":\"down\",\"broker\":\"up\"}\n");
    proxy.restore();
    common::eventually("healthy again", Duration::from_secs(20), || async {
        get(port, "/health").0 == "HTTP/1.1 200 OK"
    })
    .await;
    assert_eq!(get(port, "/nope").0, "HTTP/1.1 404 Not Found");
    consumer.terminate();
}

/// Prometheus' own checker on an exposition: `promtool check metrics`, fed on its standard input. Whether it passed,
/// and what it said. A machine without promtool fails the test, never skips it.
fn promtool_check(body: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(
            "promtool checks /metrics: it comes with Debian's prometheus package, which scripts/services.sh installs",
        );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// Runs `consume carrier` with `extra` flags until the 15 deliveries `publish --count 10 --duplicates 0.5` makes are
/// through; returns its /metrics.
async fn scrape_after_fifteen(env: &TestEnv, extra: &[&str]) -> String {
    common::publish_parcels(env, &["--count", "10", "--duplicates", "0.5"]);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec![
        "consume",
        "carrier",
        "--metrics-addr",
        &addr,
        "--concurrency",
        "4",
    ];
    args.extend_from_slice(extra);
    let consumer = env.spawn(&args);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let deliveries = format!("inbox_deliveries_total{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    // A delivery is counted at its outcome and timed once it is settled (in a batch, after the batch's ack): both.
    let timed = format!("inbox_processing_seconds_count{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    common::eventually(
        "all 15 deliveries through",
        Duration::from_secs(30),
        || async {
            let body = get(port, "/metrics").1;
            sample(&body, &deliveries) == Some(15.0) && sample(&body, &timed) == Some(15.0)
        },
    )
    .await;
    let (status, body) = get(port, "/metrics");
    consumer.terminate();
    assert_eq!(status, "HTTP/1.1 200 OK");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exposition_passes_promtool_with_the_processing_and_claim_histograms() {
    // The checker itself: it must refuse a malformed exposition, or its approval below would mean nothing.
    let (passed, said) =
        promtool_check("# TYPE inbox_deliveries_total counter\ninbox_deliveries_total{ 1\n");
    assert!(!passed, "promtool accepted a malformed exposition: {said}");

    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let label = format!("{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    // One message per transaction (a claim each), then batched (a claim per batch, and one per copy left to go alone).
    for (mode, extra) in [
        ("one by one", &[][..]),
        ("batched", &["--batch-size", "8"][..]),
    ] {
        let body = scrape_after_fifteen(&env, extra).await;
        let (passed, said) = promtool_check(&body);
        assert!(
            passed,
            "{mode}: promtool check metrics failed:\n{said}\n{body}"
        );
        for histogram in ["inbox_processing_seconds", "inbox_claim_wait_seconds"] {
            assert!(
                body.contains(&format!("# TYPE {histogram} histogram")),
                "{mode}: {histogram} missing:\n{body}"
            );
            let le = format!("{histogram}_bucket{{consumer_type=\"{CARRIER_QUEUE}\",le=\"+Inf\"}}");
            assert!(sample(&body, &le).is_some(), "{mode}: {le}:\n{body}");
        }
        let count =
            |histogram: &str| sample(&body, &format!("{histogram}_count{label}")).unwrap_or(0.0);
        // Every delivery that reached an outcome was timed, and nothing else.
        assert_eq!(count("inbox_processing_seconds"), 15.0, "{mode}:\n{body}");
        let claims = count("inbox_claim_wait_seconds");
        match mode {
            "one by one" => assert_eq!(claims, 15.0, "{mode}: a claim per delivery:\n{body}"),
            // A claim per batch (however the deliveries fell into batches), and one per copy of an id already in its
            // batch, which goes alone.
            _ => assert!((1.0..=15.0).contains(&claims), "{mode}:\n{body}"),
        }
        // The counters kept their names, with `_total` once.
        assert!(
            body.contains("# TYPE inbox_messages_processed_total counter"),
            "{body}"
        );
        assert!(!body.contains("_total_total"), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cleanup_sidecar_exports_what_it_deleted() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inbox_messages SELECT gen_random_uuid(), 'alpha', now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 25);
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'alpha', now() - interval '2 days', NULL FROM generate_series(1, 2);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let sidecar = env.spawn(&[
        "cleanup",
        "--retention",
        "1d",
        "--every",
        "1h",
        "--metrics-addr",
        &addr,
    ]);
    common::eventually("one run", Duration::from_secs(20), || async {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            && sample(&get(port, "/metrics").1, "inbox_cleanup_runs_total") == Some(1.0)
    })
    .await;
    let body = get(port, "/metrics").1;
    assert_eq!(
        sample(
            &body,
            "inbox_cleanup_rows_deleted_total{consumer_type=\"alpha\"}"
        ),
        Some(25.0),
        "{body}"
    );
    assert_eq!(
        sample(
            &body,
            "inbox_unprocessed_older_than_retention_rows{consumer_type=\"alpha\"}"
        ),
        Some(2.0)
    );
    assert!(sample(&body, "inbox_cleanup_last_success_timestamp_seconds").is_some());
    let (passed, said) = promtool_check(&body);
    assert!(passed, "promtool check metrics failed:\n{said}\n{body}");
    assert_eq!(get(port, "/health").0, "HTTP/1.1 200 OK");
    sidecar.terminate();
}

/// `/health`'s look at the database is bounded, and a connection that took it and then went silent (a host lost, a
/// network cut: no FIN, no RST) is closed, not given back: given back, sqlx's unbounded ping on its return would hold
/// the pool's slot until the kernel's TCP timeout, and every later look would report the database down while it is up.
#[tokio::test(flavor = "multi_thread")]
async fn a_health_look_on_a_silent_connection_gives_its_pool_slot_back() {
    let env = TestEnv::migrated().await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let db = inboxctl::db::Database::from_url(&proxy.postgres_url(&env.db_name)).unwrap();
    let pool = db.message_pool(1).await.unwrap();
    assert!(inboxctl::metrics::database_up(&pool).await, "up at first");
    // Its connection back in the pool first: sqlx pings a connection on its way back, a ping nothing of inboxctl's
    // can bound, and one silenced during it is out of every caller's reach (docs/reliability.md).
    common::eventually(
        "the connection back in the pool",
        Duration::from_secs(10),
        || async { pool.num_idle() == 1 },
    )
    .await;
    proxy.silence();
    let started = std::time::Instant::now();
    assert!(
        !inboxctl::metrics::database_up(&pool).await,
        "a silent connection is not an answer"
    );
    assert!(
        // Its bound is 2 s; unbounded, it would wait for the kernel's TCP timeout (minutes).
        started.elapsed() < Duration::from_secs(6),
        "the look is bounded: {:?}",
        started.elapsed()
    );
    // New connections go through the proxy: the database is up, and the next look must say so on one of them.
    assert!(
        inboxctl::metrics::database_up(&pool).await,
        "the silent connection still holds the pool's only slot"
    );
}

/// Partitioned, the broker is up for `/health` (and `inbox_broker_connected` is 1) only while every partition queue
/// is consumed: one that never gets to consume (here its connection held at a failpoint; in a cluster, its queue's
/// node down) while the other partition consumes processes nothing, and a probe must see it. Before, the partitions
/// shared one flag and the last to write it won.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_cannot_consume_makes_the_broker_down() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let failpoint = format!(
        "open-link=pause@{}",
        inboxctl::amqp::topology::partition_queue(CARRIER_QUEUE, 1)
    );
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--partitions",
            "2",
            "--partition-key",
            "parcelId",
            "--metrics-addr",
            &addr,
        ],
        &[("INBOXCTL_FAILPOINTS", failpoint.as_str())],
    );
    consumer.wait_for_stderr("failpoint open-link reached", Duration::from_secs(30));
    consumer.wait_for_stderr("consuming queue", Duration::from_secs(30));
    let label = format!("{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    for _ in 0..3 {
        assert_eq!(
            get(port, "/health"),
            (
                "HTTP/1.1 503 Service Unavailable".to_owned(),
                "{\"database\":\"up\",\"broker\":\"down\"}\n".to_owned()
            ),
            "{}",
            consumer.stderr()
        );
        assert_eq!(
            sample(
                &get(port, "/metrics").1,
                &format!("inbox_broker_connected{label}")
            ),
            Some(0.0)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `/health`'s database is the consumer's view of it, not only a `SELECT 1`: a consumer whose claims wait on a key
/// held elsewhere (its one connection busy) is healthy — the look has a connection of its own, where it used to wait
/// for the busy one and report the database down, which a liveness probe would answer with a restart — and a consumer
/// that holds its deliveries because the database refuses the inbox's own statements (the table gone) is not, though
/// `SELECT 1` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_what_the_consumer_sees_of_the_database() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut consumer = env.spawn(&[
        "consume",
        "carrier",
        "--concurrency",
        "1",
        "--metrics-addr",
        &addr,
    ]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let healthy = || {
        (
            "HTTP/1.1 200 OK".to_owned(),
            "{\"database\":\"up\",\"broker\":\"up\"}\n".to_owned(),
        )
    };
    assert_eq!(get(port, "/health"), healthy());

    // Its key held by another transaction: the consumer's only connection waits on it.
    let id = uuid::Uuid::now_v7();
    let holder = common::hold_key(&pool, id, CARRIER_QUEUE).await;
    let conn = env.amqp().await;
    let (props, body, _) = common::parcel_message(id, "Berlin");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    common::eventually("the claim waiting on the key", Duration::from_secs(20), || async {
        common::count(
            &pool,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            == 1
    })
    .await;
    for _ in 0..3 {
        assert_eq!(get(port, "/health"), healthy(), "{}", consumer.stderr());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    holder.rollback().await.unwrap();
    common::eventually("processed", Duration::from_secs(20), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 1
    })
    .await;

    // The inbox gone: the consumer holds its deliveries, and says the database is down.
    sqlx::raw_sql("ALTER TABLE inbox_messages RENAME TO inbox_messages_away")
        .execute(&pool)
        .await
        .unwrap();
    common::publish_parcels(&env, &["--count", "1"]);
    consumer.wait_for_stderr("holding deliveries", Duration::from_secs(20));
    assert_eq!(
        get(port, "/health"),
        (
            "HTTP/1.1 503 Service Unavailable".to_owned(),
            "{\"database\":\"down\",\"broker\":\"up\"}\n".to_owned()
        )
    );
    sqlx::raw_sql("ALTER TABLE inbox_messages_away RENAME TO inbox_messages")
        .execute(&pool)
        .await
        .unwrap();
    common::eventually("healthy again", Duration::from_secs(30), || async {
        get(port, "/health") == healthy()
    })
    .await;
    let _ = conn.close(200, "OK".into()).await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A client that opens connections to the metrics port and sends nothing, or half a request, holds none for long:
/// each is closed within its lifetime (10 s), and at most 32 are served at once, so a flood of them neither keeps
/// `/health` from answering for good nor takes the process's file descriptors (which its connections to PostgreSQL
/// and RabbitMQ need). Before, axum read a request with no timeout: such a connection stayed open for ever.
#[tokio::test(flavor = "multi_thread")]
async fn connections_that_send_nothing_are_closed_and_bounded() {
    let env = TestEnv::migrated().await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let _sidecar = env.spawn(&[
        "cleanup",
        "--retention",
        "1d",
        "--every",
        "1h",
        "--metrics-addr",
        &addr,
    ]);
    common::eventually("serving", Duration::from_secs(20), || async {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
    let mut half = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(half, "GET /metrics HTTP/1.1\r\n").unwrap();
    half.set_read_timeout(Some(Duration::from_secs(25)))
        .unwrap();
    let opened = std::time::Instant::now();
    let mut rest = Vec::new();
    let read = half.read_to_end(&mut rest);
    assert!(
        read.is_ok()
            || read
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "closed by the server, not timed out here: {read:?} after {:?}",
        opened.elapsed()
    );
    // Given up once no whole request came within 2 s (before 2026-12-07: only at the connection's 10 s).
    assert!(
        opened.elapsed() < Duration::from_secs(6),
        "{:?}",
        opened.elapsed()
    );

    // A flood of silent connections, more than the 32 served at once: the health look still answers, once the first
    // of them are given up, 2 s on (a kubelet's probe waits a second by default, and retries).
    let flood: Vec<_> = (0..40)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(25)))
        .unwrap();
    write!(stream, "GET /health HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let asked = std::time::Instant::now();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(
        asked.elapsed() < Duration::from_secs(6),
        "{:?}",
        asked.elapsed()
    );
    drop(flood);
}

/// A conflict (an id reused for another event) is counted once it is settled — moved to the error queue — not each
/// time it comes round because the broker refused its copy: `inbox_conflicts_total` 0 while the copy is refused, 1
/// once it went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_is_counted_once_however_often_its_copy_is_refused() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::declare_queue_that_refuses_everything(&conn, &error_queue).await;
    let id = uuid::Uuid::now_v7();
    let (props, body, _) = common::parcel_message(id, "Berlin");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    common::consume_until_idle(&env, &["carrier"]);
    let (props, body, _) = common::parcel_message(id, "Paris");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let consumer = env.spawn(&["consume", "carrier", "--metrics-addr", &addr]);
    consumer.wait_for_stderr(
        &format!("could not move a message to {error_queue}"),
        Duration::from_secs(30),
    );
    let label = format!("{{consumer_type=\"{CARRIER_QUEUE}\"}}");
    let conflicts = || {
        sample(
            &get(port, "/metrics").1,
            &format!("inbox_conflicts_total{label}"),
        )
    };
    assert_eq!(conflicts(), Some(0.0), "{}", consumer.stderr());
    conn.create_channel()
        .await
        .unwrap()
        .queue_delete(
            error_queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    common::eventually("the copy moved aside", Duration::from_secs(30), || async {
        env.queue_exists(&error_queue) && env.queue_counts(&error_queue).0 == 1
    })
    .await;
    common::eventually("counted", Duration::from_secs(10), || async {
        conflicts() == Some(1.0)
    })
    .await;
    assert_eq!(conflicts(), Some(1.0), "{}", consumer.stderr());
}
