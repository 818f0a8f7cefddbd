//! Triage against real RabbitMQ and PostgreSQL: `failures` groups a dead-letter queue by cause and `replay --group`
//! replays the members as listed; `cleanup` keeps the window of a waiting replay; every state-changing command is
//! audited; `find` shows one message everywhere — and looking never takes, reorders or loses a message.

use crate::common;

use std::time::{Duration, Instant};

use chrono::{TimeDelta, Utc};
use common::{CARRIER_QUEUE, NOTIFICATION_QUEUE, TestEnv};
use lapin::Connection;
use lapin::types::{AMQPValue, FieldTable, LongString};
use uuid::Uuid;

const ERROR_QUEUE: &str = "parcel-created-carrier_error";

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Dead-letters a fresh parcel event into `queue` as MassTransit does, failed `age` ago on the carrier's queue.
async fn fail(
    conn: &Connection,
    queue: &str,
    exception: &str,
    reason: &str,
    age: TimeDelta,
) -> String {
    fail_as(conn, queue, Uuid::new_v4(), exception, reason, age).await
}

/// The same, for a message of the id given (a later copy of a message failed before).
async fn fail_as(
    conn: &Connection,
    queue: &str,
    id: Uuid,
    exception: &str,
    reason: &str,
    age: TimeDelta,
) -> String {
    let (props, body, _) = common::parcel_message(id, "Berlin");
    fail_message(conn, queue, props, &body, exception, reason, age).await;
    id.to_string()
}

/// A message of the properties and body given, failed as [`fail`] fails one.
async fn fail_message(
    conn: &Connection,
    queue: &str,
    props: lapin::BasicProperties,
    body: &[u8],
    exception: &str,
    reason: &str,
    age: TimeDelta,
) {
    let mut headers = FieldTable::default();
    headers.insert("MT-Reason".into(), long("fault"));
    headers.insert("MT-Fault-ExceptionType".into(), long(exception));
    headers.insert("MT-Fault-Message".into(), long(reason));
    headers.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://127.0.0.1/parcel-created-carrier"),
    );
    let when = inboxctl::amqp::envelope::format_time(Utc::now() - age);
    headers.insert("MT-Fault-Timestamp".into(), long(&when));
    common::publish(conn, "", queue, props.with_headers(headers), body).await;
}

/// The message ids of a queue in its order, looked at and given back.
async fn ids_in(conn: &Connection, queue: &str) -> Vec<String> {
    common::peek(conn, queue)
        .await
        .iter()
        .map(|m| {
            m.properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default()
        })
        .collect()
}

fn json(out: &common::Output) -> serde_json::Value {
    serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

/// Three causes, a hundred messages each, with ids and numbers that vary from message to message.
async fn three_causes(conn: &Connection, each: usize) -> [Vec<String>; 3] {
    let mut out: [Vec<String>; 3] = Default::default();
    for i in 0..each {
        let age = TimeDelta::minutes(i64::try_from(3 * each - i).unwrap());
        out[0].push(
            fail(
                conn,
                ERROR_QUEUE,
                "System.TimeoutException",
                &format!("timeout after {} ms", 1000 + i * 7),
                age,
            )
            .await,
        );
        out[1].push(
            fail(
                conn,
                ERROR_QUEUE,
                "System.InvalidOperationException",
                &format!("carrier API returned 503 for parcel {}", Uuid::new_v4()),
                age,
            )
            .await,
        );
        out[2].push(
            fail(
                conn,
                ERROR_QUEUE,
                "System.Collections.Generic.KeyNotFoundException",
                &format!("destination 'Zone-{i}' of tracking number PT{i:08}NL is unknown"),
                age,
            )
            .await,
        );
    }
    out
}

/// A group replay stopped half way (SIGTERM, here at 2 messages a second) says no listed member gone: it did not
/// meet them all, and those it did not meet are still in the queue. It used to say every one it had not reached was
/// gone. And a listed member with a later copy of another cause behind it in the queue is the member replayed, not
/// "changed" (the later copy used to stand for the id, and the replay exited 3 for a drift that was none).
#[tokio::test(flavor = "multi_thread")]
async fn a_group_replay_stopped_half_way_says_none_gone_and_a_members_later_copy_does_not_change_it()
 {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    let mut timeouts = Vec::new();
    for i in 0..20 {
        let age = TimeDelta::minutes(30);
        timeouts.push(
            fail(
                &conn,
                ERROR_QUEUE,
                "System.TimeoutException",
                &format!("timeout after {i} ms"),
                age,
            )
            .await,
        );
        fail(
            &conn,
            ERROR_QUEUE,
            "System.Collections.Generic.KeyNotFoundException",
            "no such depot",
            age,
        )
        .await;
    }
    fail_as(
        &conn,
        ERROR_QUEUE,
        Uuid::parse_str(&timeouts[0]).unwrap(),
        "System.InvalidOperationException",
        "carrier API returned 503",
        TimeDelta::minutes(1),
    )
    .await;
    common::eventually("the messages ready", Duration::from_secs(10), || async {
        env.queue_counts(ERROR_QUEUE) == (41, 0)
    })
    .await;
    let (listing, report) = failures_listing(&env);
    let fingerprint = |t: &str| {
        report["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["exception_type"] == t)
            .unwrap_or_else(|| panic!("{t}: {report}"))["fingerprint"]
            .as_str()
            .unwrap()
            .to_owned()
    };

    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        &fingerprint("System.TimeoutException"),
        "--listing",
        listing.to_str().unwrap(),
        "--json",
    ]);
    // The later copy stays, as a copy of a message replayed: left, so exit 3.
    assert_eq!(out.code, Some(3), "{out:?}");
    let replayed = json(&out);
    assert_eq!(replayed["replayed"], 20, "{}", replayed["group"]);
    assert_eq!(replayed["left"], 1, "{}", replayed["group"]);
    assert_eq!(
        replayed["group"]["changed"],
        serde_json::json!([]),
        "{}",
        replayed["group"]
    );
    assert_eq!(
        replayed["group"]["gone"],
        serde_json::json!([]),
        "{}",
        replayed["group"]
    );

    let mut replay = env.spawn(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        &fingerprint("System.Collections.Generic.KeyNotFoundException"),
        "--listing",
        listing.to_str().unwrap(),
        "--rate",
        "2",
        "--json",
    ]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    replay.terminate();
    replay
        .wait(Duration::from_secs(30))
        .expect("the replay ended");
    let stopped: serde_json::Value = serde_json::from_str(replay.stdout().trim())
        .unwrap_or_else(|e| panic!("{e}: {}", replay.stderr()));
    assert_eq!(stopped["interrupted"], true, "{stopped}");
    let done = stopped["replayed"].as_u64().unwrap();
    assert!(done < 20, "{stopped}");
    assert_eq!(
        stopped["group"]["gone"],
        serde_json::json!([]),
        "{}",
        stopped["group"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn three_causes_make_three_groups_and_a_group_replays_exactly_its_listed_members() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    let causes = three_causes(&conn, 100).await;
    let before = ids_in(&conn, ERROR_QUEUE).await;
    // The look's messages back on the queue before the command looks: the broker requeues them after the look's
    // channel closes, and `failures` looks at what is ready when it begins (CI saw 192 of 300).
    common::eventually(
        "the looked-at messages back",
        Duration::from_secs(10),
        || async { env.queue_counts(ERROR_QUEUE) == (300, 0) },
    )
    .await;
    // The order they were published in, one of each cause in turn: the look below must keep it.
    let published: Vec<String> = (0..100)
        .flat_map(|i| causes.iter().map(move |c| c[i].clone()))
        .collect();
    assert_eq!(before, published);

    let (listing, report) = failures_listing(&env);
    let groups = report["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 3, "{report}");
    let by_type = |t: &str| {
        groups
            .iter()
            .find(|g| g["exception_type"] == t)
            .unwrap_or_else(|| panic!("{t}: {report}"))
    };
    let timeout = by_type("System.TimeoutException");
    assert_eq!(timeout["count"], 100);
    assert_eq!(timeout["reason"], "timeout after # ms");
    assert_eq!(
        by_type("System.InvalidOperationException")["reason"],
        "carrier API returned 503 for parcel #"
    );
    assert_eq!(
        by_type("System.Collections.Generic.KeyNotFoundException")["count"],
        100
    );
    assert_eq!(timeout["origins"], serde_json::json!([CARRIER_QUEUE]));
    assert!(
        timeout["message_ids"].is_null(),
        "stdout leaves the ids to the file"
    );
    let first = timeout["first_failed_at"].as_str().unwrap();
    let last = timeout["last_failed_at"].as_str().unwrap();
    assert!(first < last, "{timeout}");
    // Looking took nothing and kept the order.
    assert_eq!(ids_in(&conn, ERROR_QUEUE).await, before);

    // New failures of the same cause arrive after the listing: they are not what the operator saw.
    let mut late = Vec::new();
    for i in 0..10 {
        late.push(
            fail(
                &conn,
                ERROR_QUEUE,
                "System.TimeoutException",
                &format!("timeout after {i} ms"),
                TimeDelta::zero(),
            )
            .await,
        );
    }
    let fingerprint = timeout["fingerprint"].as_str().unwrap();
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        fingerprint,
        "--listing",
        listing.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    assert_eq!(report["replayed"], 100, "{}", report["group"]);
    assert_eq!(report["group"]["new"], 10, "{}", report["group"]);
    assert_eq!(report["group"]["gone"], serde_json::json!([]));
    let mut replayed = ids_in(&conn, CARRIER_QUEUE).await;
    replayed.sort();
    let mut listed = causes[0].clone();
    listed.sort();
    assert_eq!(replayed, listed, "exactly the listed members went back");
    let left = ids_in(&conn, ERROR_QUEUE).await;
    let expected: Vec<String> = before
        .iter()
        .filter(|id| !causes[0].contains(id))
        .cloned()
        .chain(late)
        .collect();
    assert_eq!(left, expected, "the rest stayed, in order");

    // The same group again: every member is gone, and the replay says so (exit 3), replaying nothing.
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        fingerprint,
        "--listing",
        listing.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    assert_eq!(report["replayed"], 0);
    assert_eq!(report["group"]["gone"].as_array().unwrap().len(), 100);
    // A listing of another queue, or a fingerprint it does not hold, is a usage error.
    let out = env.run(&[
        "replay",
        "--from",
        "other_error",
        "--group",
        fingerprint,
        "--listing",
        listing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(64), "{out:?}");
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        "ffffffffff",
        "--listing",
        listing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("has no group ffffffffff"), "{out:?}");
    // The group that gathers the causes past the listing's first 10,000 (here made so by hand): its members' causes
    // are their own, none of them its fingerprint, so its replay would replay nothing and call every member changed.
    let mut edited: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&listing).unwrap()).unwrap();
    edited["groups"][1]["fingerprint"] = serde_json::json!("other");
    std::fs::write(&listing, edited.to_string()).unwrap();
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        "other",
        "--listing",
        listing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("gathers the causes past"), "{out:?}");
}

/// `failures --from` the error queue, its listing written to a file of its own: the file, and the `--json` report.
fn failures_listing(env: &TestEnv) -> (std::path::PathBuf, serde_json::Value) {
    let listing = tempdir().join("listing.json");
    let out = env.run(&[
        "failures",
        "--from",
        ERROR_QUEUE,
        "--json",
        "--output",
        listing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    (listing, json(&out))
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("inboxctl-triage-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_holds_and_without_a_terminal_nothing_is_asked() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    for i in 0..150 {
        fail(
            &conn,
            ERROR_QUEUE,
            "System.TimeoutException",
            &format!("timeout after {i} ms"),
            TimeDelta::zero(),
        )
        .await;
    }
    // 150 messages, more than --confirm-above's 100, and no terminal: nothing is asked.
    let started = Instant::now();
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--rate",
        "25",
        "--limit",
        "120",
        "--json",
    ]);
    let took = started.elapsed();
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["replayed"], 120);
    // 120 copies at 25 a second: 119 intervals of 40 ms, 4.76 s at the least (well above what a process start and
    // connect can take on a loaded box, which the run without --rate below is compared with).
    assert!(took >= Duration::from_millis(4760), "{took:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    let started = Instant::now();
    let out = env.run(&["replay", "--from", ERROR_QUEUE, "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["replayed"], 30);
    assert!(
        started.elapsed() < took,
        "without --rate it is not held back"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn on_a_terminal_a_large_replay_asks_first_and_yes_skips_the_question() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    three_causes(&conn, 40).await;
    let tmux = common::Tmux::of(&env);
    let replay = |extra: &str| format!("replay --from {ERROR_QUEUE} {extra}");
    tmux.start(&env, &replay(""));
    let screen = tmux.wait_for("the question", |s| s.contains("replay them? [y/N]"));
    assert!(
        screen.contains("replay 120 messages from parcel-created-carrier_error"),
        "{screen}"
    );
    assert!(
        screen.contains(": 40 messages, e.g. timeout after"),
        "{screen}"
    );
    assert!(
        screen.contains(": 40 messages, e.g. carrier API returned 503"),
        "{screen}"
    );
    // No: nothing moves.
    tmux.run(&["send-keys", "-t", "top", "n", "Enter"]);
    let screen = tmux.wait_for("the refusal", |s| s.contains("EXITED="));
    assert!(
        screen.contains("nothing replayed") && screen.contains("EXITED=3"),
        "{screen}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (120, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    tmux.run(&["kill-session", "-t", "top"]);

    // Ctrl-C at the question: a no.
    tmux.start(&env, &replay(""));
    tmux.wait_for("the question", |s| s.contains("replay them? [y/N]"));
    tmux.run(&["send-keys", "-t", "top", "C-c"]);
    let screen = tmux.wait_for("the refusal", |s| s.contains("EXITED="));
    assert!(
        screen.contains("nothing replayed") && screen.contains("EXITED=3"),
        "{screen}"
    );
    assert_eq!(env.queue_counts(ERROR_QUEUE), (120, 0));
    tmux.run(&["kill-session", "-t", "top"]);

    // Yes: all of it.
    tmux.start(&env, &replay(""));
    tmux.wait_for("the question", |s| s.contains("replay them? [y/N]"));
    tmux.run(&["send-keys", "-t", "top", "y", "Enter"]);
    let screen = tmux.wait_for("the replay", |s| s.contains("EXITED="));
    assert!(
        screen.contains("replayed 120") && screen.contains("EXITED=0"),
        "{screen}"
    );
    tmux.run(&["kill-session", "-t", "top"]);

    // --yes on a terminal: no question.
    three_causes(&conn, 40).await;
    tmux.start(&env, &replay("--yes"));
    let screen = tmux.wait_for("the replay", |s| s.contains("EXITED="));
    assert!(!screen.contains("replay them?"), "{screen}");
    assert!(
        screen.contains("replayed 120") && screen.contains("EXITED=0"),
        "{screen}"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (240, 0));
}

/// The question's yes confirms the messages the dry run chose, not a count of whatever comes first. A message that
/// fails while the dry run looks lands behind what the dry run holds; on a quorum queue (RabbitMQ 3.x) what the dry
/// run gives back goes to the tail, and the newcomer comes first. Confirmed by count, the replay sent it — a message of
/// another cause, never shown — and left one the operator said yes to, reporting all replayed. Now it is left. (It
/// tells only where a quorum queue returns to its tail: RabbitMQ 3.x, as here and in `compose.yaml`.)
#[tokio::test(flavor = "multi_thread")]
async fn a_yes_replays_the_messages_shown_not_one_that_failed_while_the_dry_run_looked() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        ERROR_QUEUE,
        inboxctl::amqp::topology::QueueType::Quorum,
    )
    .await
    .unwrap();
    let age = TimeDelta::minutes(5);
    let mut shown = Vec::new();
    for i in 0..6 {
        shown.push(
            fail(
                &conn,
                ERROR_QUEUE,
                "System.TimeoutException",
                &format!("timeout after {i} ms"),
                age,
            )
            .await,
        );
    }
    common::eventually("the messages ready", Duration::from_secs(10), || async {
        env.queue_counts(ERROR_QUEUE) == (6, 0)
    })
    .await;
    let tmux = common::Tmux::of(&env);
    // The dry run pauses 3 s before its fourth look: the newcomer fails meanwhile.
    tmux.start_with(
        &env,
        "INBOXCTL_FAILPOINTS='replay-before-get=sleep-once-3000@3'",
        &format!("replay --from {ERROR_QUEUE} --confirm-above 5"),
    );
    tmux.wait_for("the dry run's pause", |s| {
        s.contains("failpoint replay-before-get reached")
    });
    let newcomer = fail(
        &conn,
        ERROR_QUEUE,
        "System.InvalidOperationException",
        "carrier API returned 503",
        TimeDelta::zero(),
    )
    .await;
    let screen = tmux.wait_for("the question", |s| s.contains("replay them? [y/N]"));
    assert!(screen.contains("replay 6 messages"), "{screen}");
    assert!(!screen.contains("carrier API returned 503"), "{screen}");
    tmux.run(&["send-keys", "-t", "top", "y", "Enter"]);
    let screen = tmux.wait_for("the replay", |s| s.contains("EXITED="));
    assert!(screen.contains("replayed 6"), "{screen}");
    assert_eq!(
        ids_in(&conn, ERROR_QUEUE).await,
        [newcomer],
        "the newcomer left, every message shown replayed: {screen}"
    );
    let mut replayed = ids_in(&conn, CARRIER_QUEUE).await;
    replayed.sort();
    shown.sort();
    assert_eq!(replayed, shown);
}

/// A consumer_type whose name holds a control character (an adopted table's, written by another application): its
/// dead-letter queue can exist (RabbitMQ takes the name), and an old message waiting in it keeps its rows. The guard
/// used to skip such a name without a look, and the rows went.
#[tokio::test(flavor = "multi_thread")]
async fn the_guard_looks_at_a_dead_letter_queue_whose_name_holds_a_control_character() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    let odd = "orders\u{7}carrier";
    processed_rows(&pool, odd, odd, 3, 8).await;
    let error_queue = format!("{odd}_error");
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, &error_queue, common::queue_type())
        .await
        .unwrap();
    let id = fail(
        &conn,
        &error_queue,
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(rows_of(&pool, odd).await, 3, "{out:?}");
    assert_eq!(json(&out)["refused"], 1, "{out:?}");
    // `find` looks there too (it used to skip the name, and say the message was found nowhere).
    let found = env.run(&["find", &id, "--json"]);
    assert_eq!(found.code, Some(0), "{found:?}");
    assert!(
        found.stdout.contains("orders\\u0007carrier_error"),
        "{}",
        found.stdout
    );
}

/// Another service's fault whose text quotes a URL with its password (a MassTransit consumer's connection error), and a
/// .NET connection string with its `Password=`: `find`, `failures` and `replay`'s report show both masked, in their
/// tables, their JSON and the listing file, as inboxctl masks its own consumers' reasons. They used to print the URL's
/// as it came (until 2026-12-07), and the connection string's until the session after.
#[tokio::test(flavor = "multi_thread")]
async fn another_services_fault_quoting_a_password_is_shown_masked() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    // No digit in it: the grouping's mask hides words with digits, and would hide this one for the wrong reason.
    let secret = "HunterSecret";
    // And a .NET connection string's, which is no URL.
    let net_secret = "KestrelSecret";
    let id = fail(
        &conn,
        ERROR_QUEUE,
        "RabbitMQ.Client.Exceptions.BrokerUnreachableException",
        &format!(
            "connect failed amqps://svc:{secret}@mq.internal/prod \
             (Npgsql: Host=db;Username=app;Password={net_secret};Database=parcels)"
        ),
        TimeDelta::minutes(5),
    )
    .await;
    let (listing, report) = failures_listing(&env);
    let listing = std::fs::read_to_string(listing).unwrap();
    let found = env.run(&["find", &id, "--dlq", ERROR_QUEUE, "--json"]);
    assert_eq!(found.code, Some(0), "{found:?}");
    let tables = [
        env.run(&["find", &id, "--dlq", ERROR_QUEUE]),
        env.run(&["failures", "--from", ERROR_QUEUE]),
        env.run(&["replay", "--from", ERROR_QUEUE, "--dry-run"]),
        env.run(&["replay", "--from", ERROR_QUEUE, "--dry-run", "--json"]),
    ];
    for (what, text) in [
        ("failures --json", report.to_string()),
        ("the listing", listing),
        ("find --json", found.stdout.clone()),
        ("find", tables[0].stdout.clone()),
        ("failures", tables[1].stdout.clone()),
        ("replay --dry-run", tables[2].stdout.clone()),
        ("replay --dry-run --json", tables[3].stdout.clone()),
    ] {
        assert!(!text.contains(secret), "{what}: {text}");
        assert!(!text.contains(net_secret), "{what}: {text}");
    }
    assert!(
        found.stdout.contains("Password=***;Database=parcels"),
        "{}",
        found.stdout
    );
    assert!(
        found.stdout.contains("amqps://svc:***@mq.internal/prod"),
        "{}",
        found.stdout
    );
    assert!(
        report
            .to_string()
            .contains("amqps://svc:***@mq.internal/prod"),
        "{report}"
    );
}

/// A quorum dead-letter queue without a leader (here its one member's Raft server stopped inside the broker, as when
/// a cluster loses the majority of a queue's members) answers every count with 0, whatever it holds. The cleanup's
/// guard took such a queue, holding a message that failed 8 days ago, for empty, and deleted the rows its replay
/// needs. A count of 0 is now checked by taking one: the take fails without a leader, the look fails, nothing is
/// deleted. (`cluster::` shows the same on three nodes, two of them killed: by hand, 2026-12-05.) A replay of it
/// said "0 messages" and ended 0, as if nothing waited: it fails now, saying why. `stats` (and `top`) showed "errors
/// 0": the count is unknown now, and the broker error says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_leaderless_quorum_error_queue_is_not_taken_for_empty_by_cleanup() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "leaderless", "leaderless", 3, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "leaderless_error",
        inboxctl::amqp::topology::QueueType::Quorum,
    )
    .await
    .unwrap();
    fail(
        &conn,
        "leaderless_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    common::eventually(
        "the message in the queue",
        Duration::from_secs(10),
        || async { env.queue_counts("leaderless_error") == (1, 0) },
    )
    .await;
    let server = format!(
        "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"{}\">>, queue, <<\"leaderless_error\">>)), \
         ra:{{}}_server(quorum_queues, amqqueue:get_pid(Q)).",
        env.vhost
    );
    let ra = |what: &str| common::rabbitmqctl(&["eval", &server.replace("{}", what)]);
    /// Starts the queue's Raft server again however the test ends: the shared broker is left as it was.
    struct Restart<'a>(&'a str);
    impl Drop for Restart<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["eval", &self.0.replace("{}", "restart")])
                .output();
        }
    }
    assert_eq!(ra("stop").trim(), "ok");
    let restart = Restart(&server);
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    // A replay of it (a dry run: what the operator runs first) is not told "0 messages" either.
    let replay = env.run(&[
        "replay",
        "--from",
        "leaderless_error",
        "--dry-run",
        "--json",
    ]);
    // Nor `stats` (and `top`, which reads the same figures): not "errors 0".
    let stats = env.run(&["stats", "--json"]);
    drop(restart);
    let report: serde_json::Value = serde_json::from_str(stats.stdout.trim()).unwrap();
    let line = report["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == "leaderless")
        .unwrap();
    assert_ne!(line["error_queue"]["ready"], 0, "{line}");
    assert_ne!(out.code, Some(0), "{out:?}");
    assert_eq!(rows_of(&pool, "leaderless").await, 3, "{out:?}");
    assert_ne!(replay.code, Some(0), "{replay:?}");
}

/// A queue a consumer_type read before its consumers recorded their vhost is recorded without one, and where it was
/// is not known. The cleanup's guard looked for its failures in its own vhost only, `find` in the one the consumer
/// reads in now only: pointed at the other, the guard deleted the rows the failures' replays need, and `find` called
/// a waiting message found nowhere. Both look in both now.
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_read_before_the_vhost_was_recorded_is_looked_for_in_both_vhosts() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    let recorded = |vhost: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE inboxctl_consumers SET vhost = $1, \
                 earlier_queues = '[{\"queue\": \"orders-carrier-old\", \"vhost\": null}]' \
                 WHERE consumer_type = 'carrier'",
            )
            .bind(vhost)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier-old_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier-old_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    // The consumer reads in this test's vhost, where the old queue is; the cleanup is pointed at another.
    recorded(env.vhost.clone()).await;
    let elsewhere = format!("amqp://guest:guest@{}/%2f", env.amqp_addr());
    let out = common::Output::of(
        env.cmd()
            .env("AMQP_URL", &elsewhere)
            .args(["cleanup", "--retention", "7d", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    assert_eq!(
        report["consumers"][0]["refused"]["queue"], "orders-carrier-old_error",
        "{report}"
    );
    assert_eq!(
        report["consumers"][0]["refused"]["message_id"], old,
        "{report}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    // The consumer reads in another vhost now; `find` is pointed at the one the old queue is in.
    recorded("/".to_owned()).await;
    let out = env.run(&["find", &old, "--json"]);
    let report = json(&out);
    assert_eq!(report["messages"][0]["found"], true, "{out:?}");
    common::eventually("the message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier-old_error") == (1, 0)
    })
    .await;
}

/// `n` messages that failed an hour ago (a timeout) in the dead-letter queue `queue`, declared if absent: their ids.
#[cfg(feature = "failpoints")]
async fn timed_out_an_hour_ago(conn: &Connection, queue: &str, n: usize) -> Vec<String> {
    inboxctl::amqp::topology::ensure_dead_letter_queue(conn, queue, common::queue_type())
        .await
        .unwrap();
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let id = fail(
            conn,
            queue,
            "System.TimeoutException",
            "timeout",
            TimeDelta::hours(1),
        )
        .await;
        ids.push(id);
    }
    ids
}

/// Registers consumer_types as their consumers do, with processed inbox rows of the given age.
async fn processed_rows(
    pool: &sqlx::PgPool,
    consumer_type: &str,
    queue: &str,
    rows: i64,
    age_days: i64,
) {
    sqlx::query(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
         VALUES ($1, $2, now(), now()) ON CONFLICT (consumer_type) DO NOTHING",
    )
    .bind(consumer_type)
    .bind(queue)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         SELECT gen_random_uuid(), $1, now() - make_interval(days => $3::int), now() - make_interval(days => $3::int)
         FROM generate_series(1, $2)",
    )
    .bind(consumer_type)
    .bind(rows)
    .bind(i32::try_from(age_days).unwrap())
    .execute(pool)
    .await
    .unwrap();
}

async fn rows_of(pool: &sqlx::PgPool, consumer_type: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE consumer_type = $1")
        .bind(consumer_type)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A consumer_type moved to another queue (a quorum queue in place of a classic one) keeps its name, and its failed
/// messages wait in the old queue's `_error`. The guard looked only in the queue its consumers registered last: the
/// new queue's dead-letter queues empty, it cleaned the rows the old failures' replays need. Each consumer's
/// registration keeps the queues read before, and the guard looks in theirs too.
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_looks_for_failures_in_the_queue_a_consumer_type_read_before() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    let carrier = inboxctl::inbox::ConsumerType::new("carrier").unwrap();
    // Its consumers read orders-carrier, then orders-carrier-quorum; one of the old ones starts again for a while
    // (both run through the move), and the new ones last.
    for queue in [
        "orders-carrier",
        "orders-carrier-quorum",
        "orders-carrier",
        "orders-carrier-quorum",
    ] {
        inboxctl::db::events::register_consumer(&pool, &carrier, queue, None, &env.vhost)
            .await
            .unwrap();
    }
    let earlier: serde_json::Value = sqlx::query_scalar(
        "SELECT earlier_queues FROM inboxctl_consumers WHERE consumer_type = 'carrier'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        earlier,
        serde_json::json!([
            {"queue": "orders-carrier", "vhost": env.vhost},
            {"queue": "orders-carrier-quorum", "vhost": env.vhost}
        ]),
        "each queue once"
    );
    // A carrier consumer records its effect mode first (its row without a vhost), then itself: its queue is not one
    // it read before.
    let sms = inboxctl::inbox::ConsumerType::new("sms").unwrap();
    inboxctl::db::events::register_effect_mode(
        &pool,
        &sms,
        "orders-sms",
        "keyed",
        std::time::Duration::from_secs(86_400),
    )
    .await
    .unwrap();
    inboxctl::db::events::register_consumer(&pool, &sms, "orders-sms", None, &env.vhost)
        .await
        .unwrap();
    let earlier: serde_json::Value = sqlx::query_scalar(
        "SELECT earlier_queues FROM inboxctl_consumers WHERE consumer_type = 'sms'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(earlier, serde_json::json!([]));
    processed_rows(&pool, "carrier", "orders-carrier-quorum", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    let refused = &report["consumers"][0]["refused"];
    assert_eq!(refused["queue"], "orders-carrier_error", "{report}");
    assert_eq!(refused["message_id"], old, "{report}");
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
}

/// A look at a dead-letter queue (`failures`, held by a failpoint as it looks) holds the queue's old message out of
/// sight: the guard's own look found the queue empty, and the cleanup deleted the rows the message's replay needs.
/// Every look marks the queue now (a consumer on its look marker) and the guard, crowded, looks again until it has
/// waited 10 s, then refuses the consumer_type, saying why; once the look ends, it sees the message itself.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_refuses_while_another_look_holds_a_dead_letter_queues_messages() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    let mut look = env.spawn_with(
        &["failures", "--from", "orders-carrier_error"],
        &[("INBOXCTL_FAILPOINTS", "peek=pause@orders-carrier_error")],
    );
    look.wait_for_stderr("failpoint peek reached", Duration::from_secs(20));
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    let refused = &report["consumers"][0]["refused"];
    assert_eq!(refused["looked_at_elsewhere"], true, "{report}");
    assert!(
        out.stderr.contains("another look at orders-carrier_error"),
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    look.kill();
    common::eventually("the held message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier_error") == (1, 0)
    })
    .await;
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(
        json(&out)["consumers"][0]["refused"]["message_id"],
        old,
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5);
}

/// Another client consumes a dead-letter queue (a fault monitor, a shovel, a script) and holds its one message —
/// failed 8 days ago, its replay needing the consumer_type's rows — unacknowledged: no look sees it, and the queue
/// reads empty. The cleanup's guard took that for "nothing waits" and deleted the rows; it refuses the consumer_type
/// now (exit 3), naming the consumers, and cleans once they are gone (here: the message back, and too old, refused
/// by its age as usual).
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_refuses_a_dead_letter_queue_another_client_consumes() {
    use futures_util::StreamExt as _;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    let monitor = env.amqp().await;
    let channel = monitor.create_channel().await.unwrap();
    channel
        .basic_qos(10, lapin::options::BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = channel
        .basic_consume(
            "orders-carrier_error".into(),
            "fault-monitor".into(),
            lapin::options::BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let held = deliveries.next().await.unwrap().unwrap();
    assert_eq!(env.queue_counts("orders-carrier_error"), (0, 1));

    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    assert_eq!(
        report["consumers"][0]["refused"]["consumers"], 1,
        "{report}"
    );
    assert!(
        out.stderr
            .contains("orders-carrier_error has 1 consumer(s) of another client"),
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");

    drop(held);
    monitor.close(200, "OK".into()).await.unwrap();
    common::eventually("the held message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier_error") == (1, 0)
    })
    .await;
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(
        json(&out)["consumers"][0]["refused"]["message_id"],
        old,
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5);
}

/// `failures` and `find` while another look holds some of a dead-letter queue's messages (a `failures` paused after
/// its first take): they saw the rest and said nothing of it — a listing short of a member, a message "found nowhere"
/// that waits in the queue. They read the other looks' marks now, as the cleanup's guard does, and say the listing
/// may be incomplete (exit 3).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn failures_and_find_say_when_another_look_held_messages_out_of_their_sight() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    let ids = timed_out_an_hour_ago(&conn, "orders-carrier_error", 3).await;
    let mut look = env.spawn_with(
        &["failures", "--from", "orders-carrier_error"],
        &[("INBOXCTL_FAILPOINTS", "peek=pause@orders-carrier_error")],
    );
    look.wait_for_stderr("failpoint peek reached", Duration::from_secs(20));
    let out = env.run(&["failures", "--from", "orders-carrier_error", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let listing = json(&out);
    assert_eq!(listing["looked_at_elsewhere"], true, "{listing}");
    assert_eq!(
        listing["looked"], 2,
        "the one held is out of sight: {listing}"
    );
    let out = env.run(&["failures", "--from", "orders-carrier_error"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stdout
            .contains("another look at it held messages meanwhile"),
        "{out:?}"
    );
    let out = env.run(&["find", &ids[1], "--dlq", "orders-carrier_error", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    assert_eq!(report["messages"][0]["found"], true, "{report}");
    assert_eq!(report["queues"][0]["looked_at_elsewhere"], true, "{report}");
    assert!(out.stderr.contains("another look at these"), "{out:?}");
    look.kill();
    common::eventually("the held message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier_error") == (3, 0)
    })
    .await;
    let out = env.run(&["failures", "--from", "orders-carrier_error", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["looked"], 3, "{out:?}");
    assert!(json(&out).get("looked_at_elsewhere").is_none(), "{out:?}");
}

/// A look whose channel's close RabbitMQ did not answer may still hold what it took; it ended its mark anyway, and
/// `find` went on to its next queue over the same connection, the messages held and unmarked: a `failures` (or a
/// cleanup's guard) meanwhile found the queue empty and said so, exit 0. The mark stays now for as long as the
/// channel may hold them. The failpoint holds the answer to the first queue's close (so the close is never sent and
/// the channel keeps its three messages, as under a node that hangs); `find` is then paused in its second queue.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_look_whose_close_went_unanswered_keeps_its_mark_while_its_channel_may_hold_messages() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    let ids = timed_out_an_hour_ago(&conn, "orders-carrier_error", 3).await;
    timed_out_an_hour_ago(&conn, "zz-other_error", 1).await;
    let mut find = env.spawn_with(
        &[
            "find",
            &ids[0],
            "--dlq",
            "orders-carrier_error",
            "--dlq",
            "zz-other_error",
            "--broker-timeout",
            "2s",
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            "broker-answer=sleep-once-600000@the messages' return,\
             broker-answer=sleep-once-600000@a channel's close,peek=pause@zz-other_error",
        )],
    );
    find.wait_for_stderr("failpoint peek reached", Duration::from_secs(30));
    assert_eq!(
        env.queue_counts("orders-carrier_error").0,
        0,
        "the first queue's messages are still held by the look whose close went unanswered"
    );
    let out = env.run(&["failures", "--from", "orders-carrier_error", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(json(&out)["looked_at_elsewhere"], true, "{out:?}");
    find.kill();
    common::eventually(
        "the held messages back",
        Duration::from_secs(10),
        || async { env.queue_counts("orders-carrier_error") == (3, 0) },
    )
    .await;
    let out = env.run(&["failures", "--from", "orders-carrier_error", "--json"]);
    assert_eq!(
        out.code,
        Some(0),
        "the mark went with its connection: {out:?}"
    );
    assert_eq!(json(&out)["looked"], 3, "{out:?}");
}

/// A RabbitMQ that stops answering the guard's look (a quorum queue whose leader is lost, a node that hangs) held the
/// cleanup for ever, the messages it had taken out of every other look's sight. Each call of the look is bounded by
/// `--broker-timeout` now: the failpoint holds the answer to the guard's first take for ten minutes, and the cleanup
/// fails within seconds, saying what RabbitMQ did not answer (exit 69), deleting nothing; the message goes back. The
/// message is young: without the bound (and the failpoint, which fires only inside it) the rows would go.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_fails_deleting_nothing_when_rabbitmq_does_not_answer_its_guards_look() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    let started = std::time::Instant::now();
    let mut cleanup = env.spawn_with(
        &[
            "cleanup",
            "--retention",
            "7d",
            "--broker-timeout",
            "2s",
            "--json",
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            "broker-answer=sleep-once-600000@a take from the queue looked at",
        )],
    );
    let code = cleanup.wait(Duration::from_secs(60));
    let said = cleanup.stderr();
    assert_eq!(code, Some(69), "{said}");
    assert!(
        said.contains("RabbitMQ did not answer a take from the queue looked at within 2s"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "{said}");
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    common::eventually("the message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier_error") == (1, 0)
    })
    .await;
}

/// `failures` and `find` asked RabbitMQ whether a replay of the queue runs with no bound: a node that stops answering
/// held them for ever, whatever `--broker-timeout` said. And `find`, one queue not looked at (its take unanswered),
/// exited 0 though a copy may wait there. Bounded now: `failures` fails saying what was not answered (exit 69); `find`
/// names the queue it could not look at and exits 3.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn failures_and_find_do_not_wait_past_the_broker_timeout_and_find_says_what_it_could_not_look_at()
 {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 1, 0).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let id = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    // A trace of it in the database: found, whatever the queue holds — so the exit says whether every queue was seen.
    sqlx::query(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at) \
         VALUES ('carrier', 'failed', $1::uuid, now())",
    )
    .bind(&id)
    .execute(&pool)
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let mut failures = env.spawn_with(
        &[
            "failures",
            "--from",
            "orders-carrier_error",
            "--broker-timeout",
            "2s",
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            "broker-answer=sleep-once-600000@a look for a replay's marker",
        )],
    );
    let code = failures.wait(Duration::from_secs(60));
    let said = failures.stderr();
    assert_eq!(code, Some(69), "{said}");
    assert!(
        said.contains("RabbitMQ did not answer a look for a replay's marker within 2s"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "{said}");
    // Its first call (before any take) was the one not answered: nothing was looked at.
    let held = common::peek(&conn, "orders-carrier_error").await;
    assert!(!held[0].redelivered, "failures took nothing");

    let mut find = env.spawn_with(
        &[
            "find",
            &id,
            "--dlq",
            "orders-carrier_error",
            "--broker-timeout",
            "2s",
            "--json",
        ],
        &[(
            "INBOXCTL_FAILPOINTS",
            "broker-answer=sleep-once-600000@a take from the queue looked at",
        )],
    );
    let code = find.wait(Duration::from_secs(60));
    assert_eq!(code, Some(3), "{}", find.stderr());
    let report: serde_json::Value = serde_json::from_str(find.stdout().trim()).unwrap();
    let unlooked = report["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["error"].is_string())
        .unwrap_or_else(|| panic!("{report}"));
    assert!(
        unlooked["error"]
            .as_str()
            .unwrap()
            .contains("did not answer a take from the queue looked at"),
        "{report}"
    );
    common::eventually("the held message back", Duration::from_secs(10), || async {
        env.queue_counts("orders-carrier_error") == (1, 0)
    })
    .await;
}

/// Another look that began after the guard found no mark, held the messages at the guard's take, and ended before
/// the guard read the marks again (failpoints hold the guard before its look and between its take and that read,
/// while the test starts a `failures` and then ends it): no mark left to see after, and the queue read as empty. The
/// guard reads the marks before its take too: it looks again once the look is over, sees the old message, refuses.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_sees_the_messages_of_a_look_that_ended_between_its_take_and_its_read_of_the_marks()
{
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "7d", "--json"],
        &[(
            "INBOXCTL_FAILPOINTS",
            "guard-between-looks=sleep-once-4000@orders-carrier_error,\
             peek-before-marks=sleep-once-4000@orders-carrier_error",
        )],
    );
    cleanup.wait_for_stderr(
        "failpoint guard-between-looks reached",
        Duration::from_secs(20),
    );
    let mut look = env.spawn_with(
        &["failures", "--from", "orders-carrier_error"],
        &[("INBOXCTL_FAILPOINTS", "peek=pause@orders-carrier_error")],
    );
    look.wait_for_stderr("failpoint peek reached", Duration::from_secs(20));
    cleanup.wait_for_stderr(
        "failpoint peek-before-marks reached",
        Duration::from_secs(20),
    );
    look.kill();
    assert_eq!(
        cleanup.wait(Duration::from_secs(60)),
        Some(3),
        "{}",
        cleanup.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert_eq!(
        report["consumers"][0]["refused"]["message_id"], old,
        "{report}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
}

/// A quorum queue puts a message given back at its tail (RabbitMQ 3.x): after one look at its head (`stats`, `top`,
/// a cleanup's guard), a quorum dead-letter queue's oldest message is no longer its head. The guard looked at the
/// head alone, found a message failed an hour ago, and deleted the rows the 8-day-old one's replay needs. It looks at
/// every message now (up to 10,000), and refuses on the oldest.
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_finds_an_old_failure_behind_the_head_of_a_quorum_dead_letter_queue() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        inboxctl::amqp::topology::QueueType::Quorum,
    )
    .await
    .unwrap();
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    for _ in 0..2 {
        fail(
            &conn,
            "orders-carrier_error",
            "System.TimeoutException",
            "timeout",
            TimeDelta::hours(1),
        )
        .await;
    }
    // One look at the head, as `stats` makes: the old message goes to the tail.
    let mut head = None;
    inboxctl::amqp::peek::each(
        &conn,
        "orders-carrier_error",
        1,
        Duration::from_secs(30),
        |d| {
            head = d.properties.message_id().as_ref().map(|id| id.to_string());
        },
    )
    .await
    .unwrap();
    assert_eq!(
        head.as_deref(),
        Some(old.as_str()),
        "the old message was the head"
    );
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(
        json(&out)["consumers"][0]["refused"]["message_id"],
        old,
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
}

/// A dead-letter queue holding more messages than the guard looks at (10,000), all young among those it looks at:
/// it cannot tell whether one further on failed before the cutoff (on a quorum queue, the ones it looks at go behind
/// the rest, so the next run would not see them either). It accepted them; it refuses now, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn cleanup_refuses_a_dead_letter_queue_holding_more_than_it_looks_at() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "MT-Fault-Timestamp".into(),
        long(&inboxctl::amqp::envelope::format_time(
            Utc::now() - TimeDelta::hours(1),
        )),
    );
    let (props, body, _) = common::parcel_message(Uuid::new_v4(), "Berlin");
    let props = props.with_headers(headers);
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..10_001 {
        let _confirm = channel
            .basic_publish(
                "".into(),
                "orders-carrier_error".into(),
                lapin::options::BasicPublishOptions::default(),
                &body,
                props.clone(),
            )
            .await
            .unwrap();
    }
    channel.wait_for_confirms().await.unwrap();
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(
        json(&out)["consumers"][0]["refused"]["beyond_the_look"],
        true,
        "{out:?}"
    );
    assert!(
        out.stderr
            .contains("holds more messages than the cleanup looks at"),
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_keeps_the_rows_a_waiting_replay_needs_unless_forced() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    processed_rows(&pool, "sms", "orders-sms", 7, 8).await;
    for q in ["orders-carrier_error", "orders-sms_error"] {
        inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, q, common::queue_type())
            .await
            .unwrap();
    }
    // The carrier's oldest failure is 8 days old, older than the 7-day cutoff; the SMS's is an hour old.
    let old = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::days(8),
    )
    .await;
    fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    fail(
        &conn,
        "orders-sms_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    let order = ids_in(&conn, "orders-carrier_error").await;

    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    let carrier = report["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == "carrier")
        .unwrap();
    assert_eq!(carrier["deleted"], 0, "{report}");
    assert_eq!(
        carrier["refused"]["queue"], "orders-carrier_error",
        "{report}"
    );
    assert_eq!(carrier["refused"]["message_id"], old, "{report}");
    let age = carrier["refused"]["age_seconds"].as_i64().unwrap();
    assert!((8 * 86400 - 60..8 * 86400 + 60).contains(&age), "{report}");
    assert_eq!(report["refused"], 1);
    assert!(
        out.stderr.contains("orders-carrier_error holds message"),
        "{out:?}"
    );
    assert!(out.stderr.contains(&old), "{out:?}");
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    assert_eq!(
        rows_of(&pool, "sms").await,
        0,
        "the other consumer_type is cleaned"
    );
    assert_eq!(
        ids_in(&conn, "orders-carrier_error").await,
        order,
        "looking took nothing"
    );

    // Pointed at another vhost, where the carrier's error queue is not: before, its absence was taken for "nothing
    // waiting" and the rows went. The vhost its consumer recorded is looked in instead: the carrier's old message
    // found there, and the SMS's, an hour old, lets its new rows go.
    processed_rows(&pool, "sms", "orders-sms", 7, 8).await;
    sqlx::query(
        "UPDATE inboxctl_consumers SET vhost = $1 WHERE consumer_type IN ('carrier', 'sms')",
    )
    .bind(&env.vhost)
    .execute(&pool)
    .await
    .unwrap();
    let elsewhere = format!("amqp://guest:guest@{}/%2f", env.amqp_addr());
    let cleanup_elsewhere = || {
        common::Output::of(
            env.cmd()
                .env("AMQP_URL", &elsewhere)
                .args(["cleanup", "--retention", "7d", "--json"])
                .output()
                .unwrap(),
        )
    };
    let carrier_of = |report: &serde_json::Value| {
        report["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer_type"] == "carrier")
            .cloned()
            .unwrap()
    };
    let out = cleanup_elsewhere();
    assert_eq!(out.code, Some(3), "{out:?}");
    let carrier = carrier_of(&json(&out));
    assert_eq!(
        carrier["refused"]["queue"], "orders-carrier_error",
        "{carrier}"
    );
    assert_eq!(carrier["refused"]["message_id"], old, "{carrier}");
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    assert_eq!(
        rows_of(&pool, "sms").await,
        0,
        "looked at there, and cleaned"
    );
    // A vhost it may not enter: refused, the vhost and why named.
    let closed = common::vhosts::take();
    common::clear_permissions(&closed, "guest");
    sqlx::query("UPDATE inboxctl_consumers SET vhost = $1 WHERE consumer_type = 'carrier'")
        .bind(&closed)
        .execute(&pool)
        .await
        .unwrap();
    let out = cleanup_elsewhere();
    assert_eq!(out.code, Some(3), "{out:?}");
    let carrier = carrier_of(&json(&out));
    assert_eq!(
        carrier["refused"]["other_vhost"]["vhost"], closed,
        "{carrier}"
    );
    assert!(
        out.stderr.contains(&format!(
            "reads its queue in vhost {closed}, where the cleanup could not look"
        )),
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(rows_of(&pool, "carrier").await, 0, "--force cleans");
    // A vhost that no longer exists holds nothing: cleaned, and said.
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    let gone = format!("{}-gone", env.vhost);
    sqlx::query("UPDATE inboxctl_consumers SET vhost = $1 WHERE consumer_type = 'carrier'")
        .bind(&gone)
        .execute(&pool)
        .await
        .unwrap();
    let out = cleanup_elsewhere();
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("no longer exists"), "{out:?}");
    assert_eq!(rows_of(&pool, "carrier").await, 0);
    // A --dlq that is not in the cleanup's vhost is no proof that nothing waits in it: every consumer_type refused.
    processed_rows(&pool, "carrier", "orders-carrier", 5, 8).await;
    let out = env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--dlq",
        "no-such-dlq",
        "--json",
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let carrier = carrier_of(&json(&out));
    assert_eq!(carrier["refused"]["absent"], true, "{carrier}");
    assert!(
        out.stderr.contains("--dlq no-such-dlq is not in the vhost"),
        "{out:?}"
    );
    assert_eq!(rows_of(&pool, "carrier").await, 5, "the rows are kept");
}

/// Three carrier rows processed two days ago, and the carrier's error queue, empty.
async fn rows_two_days_old_and_an_error_queue() -> (TestEnv, sqlx::PgPool, lapin::Connection) {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, CARRIER_QUEUE, CARRIER_QUEUE, 3, 2).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    (env, pool, conn)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_guard_reads_the_failure_time_of_masstransit_error_messages() {
    // Rows processed two days ago; the captured fixtures failed on 2026-11-30 (MT-Fault-Timestamp).
    let (env, _, conn) = rows_two_days_old_and_an_error_queue().await;
    let fixture = common::fixture("error/error-01.json");
    common::publish(
        &conn,
        "",
        ERROR_QUEUE,
        fixture.properties.clone(),
        &fixture.body,
    )
    .await;
    let stamp = fixture.json["headers"]["MT-Fault-Timestamp"]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let failed_at = inboxctl::amqp::envelope::parse_time(&stamp).unwrap();

    refused_from(&env, failed_at, &fixture.message_id);
    assert_eq!(env.queue_counts(ERROR_QUEUE), (1, 0));
}

/// The guard's turning point: a cutoff an hour before `at` leaves the window whole (nothing refused); one an hour
/// after it refuses, naming `message_id` and `at` as the message's time.
fn refused_from(env: &TestEnv, at: chrono::DateTime<Utc>, message_id: &str) {
    let window = (Utc::now() - at).num_seconds() + 3600;
    let out = env.run(&["cleanup", "--retention", &format!("{window}s"), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["refused"], 0, "{out:?}");
    let window = (Utc::now() - at).num_seconds() - 3600;
    let out = env.run(&["cleanup", "--retention", &format!("{window}s"), "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    let refused = &report["consumers"][0]["refused"];
    assert_eq!(refused["message_id"], message_id, "{report}");
    let read: chrono::DateTime<Utc> = serde_json::from_value(refused["failed_at"].clone()).unwrap();
    assert_eq!(read, at, "{report}");
}

/// A copy moved aside unhandled (`_skipped`) carries no failure time, MassTransit's (the captured one) nor inboxctl's,
/// and MassTransit sets no AMQP timestamp: read as of unknown age, any such copy, a second old, refused its
/// consumer_type's cleanup on every run. Its age is read from its envelope's `sentTime` now.
#[tokio::test(flavor = "multi_thread")]
async fn the_guard_reads_a_skipped_messages_age_from_its_envelope() {
    let (env, _, conn) = rows_two_days_old_and_an_error_queue().await;
    let skipped = format!("{CARRIER_QUEUE}_skipped");
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, &skipped, common::queue_type())
        .await
        .unwrap();
    let fixture = common::fixture("skipped/skipped-01.json");
    assert!(fixture.properties.timestamp().is_none());
    common::publish(
        &conn,
        "",
        &skipped,
        fixture.properties.clone(),
        &fixture.body,
    )
    .await;
    let envelope: serde_json::Value = serde_json::from_slice(&fixture.body).unwrap();
    let sent_at =
        inboxctl::amqp::envelope::parse_time(envelope["sentTime"].as_str().unwrap()).unwrap();

    refused_from(&env, sent_at, &fixture.message_id);
    assert_eq!(env.queue_counts(&skipped), (1, 0));
}

/// A failure time years ahead (a host's clock far off, a header written by hand) tells nothing of a dead-lettered
/// message's age. Read as it is, the message looked young, and the rows its replay needs were deleted; it is now
/// passed over for the next source of its age (when it was published or sent: here the captured message's, long
/// past), or, with none, of an unknown age — either keeps them.
#[tokio::test(flavor = "multi_thread")]
async fn the_guard_passes_over_a_failure_time_in_the_future() {
    let (env, pool, conn) = rows_two_days_old_and_an_error_queue().await;
    let fixture = common::fixture("error/error-01.json");
    let mut headers = fixture.properties.headers().clone().unwrap_or_default();
    let ahead = inboxctl::amqp::envelope::format_time(Utc::now() + chrono::TimeDelta::days(3650));
    headers.insert(
        "MT-Fault-Timestamp".into(),
        lapin::types::AMQPValue::LongString(ahead.into()),
    );
    common::publish(
        &conn,
        "",
        ERROR_QUEUE,
        fixture.properties.clone().with_headers(headers),
        &fixture.body,
    )
    .await;
    let out = env.run(&["cleanup", "--retention", "1d", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report = json(&out);
    let refused = &report["consumers"][0]["refused"];
    assert_eq!(refused["message_id"], fixture.message_id, "{report}");
    assert!(
        refused["age_seconds"]
            .as_i64()
            .is_some_and(|age| age > 86_400),
        "{report}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        3
    );
    // `stats` takes it alike: no age known, not a negative one said to be within the window.
    let out = env.run(&["stats", "--retention", "1d", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    let consumer = &report["consumers"][0];
    assert!(
        consumer["oldest_dead_letter_seconds"]
            .as_f64()
            .is_some_and(|age| age > 86_400.0),
        "{consumer}"
    );
    assert_ne!(consumer["dead_letter_window"], "ok", "{consumer}");
}

/// Why an action's audit row was not written is given to a caller that shows it itself: `top`, which keeps no log,
/// said "not audited: see the log", and the reason was lost.
#[tokio::test(flavor = "multi_thread")]
async fn why_an_action_was_not_audited_is_given_to_a_caller_that_keeps_no_log() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::query("ALTER TABLE inboxctl_audit RENAME TO inboxctl_audit_away")
        .execute(&pool)
        .await
        .unwrap();
    let entry = inboxctl::audit::Entry {
        command: "replay",
        outcome: "done",
        exit_code: Some(0),
        details: serde_json::json!({"via": "top"}),
    };
    let why = inboxctl::audit::try_record(&pool, &entry)
        .await
        .expect_err("no audit table to write to");
    assert!(why.contains("inboxctl_audit"), "{why}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_state_changing_command_is_audited_without_a_password_and_outlives_cleanup() {
    let mut env = TestEnv::bare().await;
    // Trust authentication ignores the password, so the URL can carry one for the audit to leave out.
    env.database_url = env
        .database_url
        .replacen("postgres@", "postgres:Audit-Secret-77@", 1);
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "3"]);
    common::consume_until_idle(&env, &["carrier"]);
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    fail(
        &conn,
        ERROR_QUEUE,
        "System.TimeoutException",
        "timeout",
        TimeDelta::zero(),
    )
    .await;
    let out = env.run(&["replay", "--from", ERROR_QUEUE]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let out = env.run(&["cleanup", "--retention", "1s", "--force"]);
    assert_eq!(out.code, Some(0), "{out:?}");

    let out = env.run(&["audit", "--since", "1h", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stdout.contains("Audit-Secret-77"), "{out:?}");
    let rows = json(&out);
    let rows = rows.as_array().unwrap();
    let commands: Vec<(&str, &str)> = rows
        .iter()
        .rev()
        .map(|r| {
            (
                r["command"].as_str().unwrap(),
                r["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        commands,
        [
            ("migrate", "done"),
            ("consume", "started"),
            ("consume", "stopped"),
            ("replay", "done"),
            ("cleanup", "done")
        ],
        "{rows:?}"
    );
    for r in rows {
        assert_eq!(r["database_role"], "postgres", "{r}");
        assert!(r["os_user"].as_str().is_some_and(|u| !u.is_empty()), "{r}");
        assert!(r["host"].as_str().is_some_and(|h| !h.is_empty()), "{r}");
        let line = r["command_line"].as_str().unwrap();
        assert!(line.contains(r["command"].as_str().unwrap()), "{r}");
    }
    let replay = &rows[1];
    assert_eq!(replay["details"]["replayed"], 1, "{replay}");
    assert_eq!(replay["exit_code"], 0);
    assert_eq!(rows[0]["details"]["deleted"], 3, "{}", rows[0]);
    assert_eq!(rows[2]["details"]["summary"]["processed"], 3, "{}", rows[2]);
    // The password of a URL typed on the command line is kept out too.
    let url = env.database_url.clone();
    let out = env.run(&[
        "--database-url",
        &url,
        "cleanup",
        "--retention",
        "1s",
        "--force",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let pool = env.pool().await;
    let lines: Vec<String> = sqlx::query_scalar("SELECT command_line FROM inboxctl_audit")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("--database-url postgres://postgres:***@")),
        "{lines:?}"
    );
    assert!(
        lines.iter().all(|l| !l.contains("Audit-Secret-77")),
        "{lines:?}"
    );
    // The audit outlives the inbox's retention: `cleanup --retention 1s` left every row.
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_audit").await,
        6
    );
    // Its own retention: a row past --audit-retention (90 days) goes, one inside it stays.
    sqlx::query(
        "INSERT INTO inboxctl_audit (occurred_at, command, command_line, outcome)
         VALUES (now() - interval '100 days', 'cleanup', 'old', 'done'),
                (now() - interval '10 days', 'cleanup', 'recent', 'done')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["cleanup", "--retention", "1s", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["audit_deleted"], 1, "{out:?}");
    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT command_line FROM inboxctl_audit WHERE command_line IN ('old', 'recent')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kept, ["recent"]);
    // An audit that cannot be written never undoes the work, and says so.
    sqlx::query("ALTER TABLE inboxctl_audit RENAME TO inboxctl_audit_away")
        .execute(&pool)
        .await
        .unwrap();
    let out = env.run(&["cleanup", "--retention", "1s", "--force"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("not written to the audit"), "{out:?}");
    sqlx::query("ALTER TABLE inboxctl_audit_away RENAME TO inboxctl_audit")
        .execute(&pool)
        .await
        .unwrap();
}

/// `find` looked for copies only in the `_error` queues of the queue each consumer_type reads now, and only in the vhost
/// it was pointed at: a consumer that reads its queue in another vhost, or that moved to another queue leaving its
/// failures in the old one's `_error`, had its waiting copies called "found nowhere". It looks where the guard does now:
/// each consumer's recorded vhost (with the same user), and the queues it read before.
#[tokio::test(flavor = "multi_thread")]
async fn find_looks_in_the_vhost_a_consumer_reads_in_and_the_queues_it_read_before() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    let elsewhere = common::vhosts::take();
    let there = lapin::Connection::connect(
        &env.amqp_url.replace(&env.vhost, &elsewhere),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let carrier = inboxctl::inbox::ConsumerType::new("carrier").unwrap();
    for queue in ["orders-carrier", "orders-carrier-quorum"] {
        inboxctl::db::events::register_consumer(&pool, &carrier, queue, None, &env.vhost)
            .await
            .unwrap();
    }
    let sms = inboxctl::inbox::ConsumerType::new("sms").unwrap();
    inboxctl::db::events::register_consumer(&pool, &sms, "orders-sms", None, &elsewhere)
        .await
        .unwrap();
    for (conn, queue) in [
        (&conn, "orders-carrier_error"),
        (&there, "orders-sms_error"),
    ] {
        inboxctl::amqp::topology::ensure_dead_letter_queue(conn, queue, common::queue_type())
            .await
            .unwrap();
    }
    let moved = fail(
        &conn,
        "orders-carrier_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    let away = fail(
        &there,
        "orders-sms_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    let out = env.run(&["find", &moved, &away, "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    for m in report["messages"].as_array().unwrap() {
        assert_eq!(m["dead_letters"].as_array().unwrap().len(), 1, "{report}");
    }
    assert_eq!(
        report["messages"][1]["dead_letters"][0]["queue"],
        "orders-sms_error"
    );
    let queues = report["queues"].as_array().unwrap();
    assert!(
        queues
            .iter()
            .any(|q| q["queue"] == "orders-sms_error" && q["vhost"] == elsewhere.as_str()),
        "{report}"
    );
    let out = env.run(&["find", &away]);
    assert!(
        out.stdout
            .contains(&format!("orders-sms_error (in vhost {elsewhere})")),
        "{out:?}"
    );
}

/// `find` put a dead-letter copy under its AMQP property's id where that differed from its envelope's (a producer
/// setting another, a shovel), while the consumer keyed it on the envelope's: the message it was is shown none, and
/// an id the inbox never saw is shown it. And of a message with more events than shown it listed the oldest, which
/// hides what became of it in the end (its last dead-lettering), and called exactly that many "cut". Now: under the
/// envelope's id (a body no envelope: the property's), and the newest events, cut only past the limit.
#[tokio::test(flavor = "multi_thread")]
async fn find_shows_a_copy_under_the_id_it_was_keyed_on_and_a_messages_newest_events() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "orders-carrier_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    let (enveloped, property) = (Uuid::new_v4(), Uuid::new_v4());
    let (props, body, _) = common::parcel_message(enveloped, "Berlin");
    let props = props.with_message_id(property.to_string().into());
    fail_message(
        &conn,
        "orders-carrier_error",
        props,
        &body,
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(1),
    )
    .await;
    let copies = |id: Uuid| {
        let out = env.run(&[
            "find",
            &id.to_string(),
            "--dlq",
            "orders-carrier_error",
            "--json",
        ]);
        json(&out)["messages"][0]["dead_letters"]
            .as_array()
            .unwrap()
            .len()
    };
    assert_eq!(copies(enveloped), 1, "under the envelope's id");
    assert_eq!(copies(property), 0, "not under the property's");

    let seed = |id: Uuid, n: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
                 SELECT 'carrier', CASE WHEN i = $2 THEN 'dead_lettered' ELSE 'failed' END, $1,
                        now() - make_interval(secs => ($2 - i)::float8)
                 FROM generate_series(1, $2) i",
            )
            .bind(id)
            .bind(n)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let (looping, just) = (Uuid::new_v4(), Uuid::new_v4());
    seed(looping, 250).await;
    seed(just, 200).await;
    // Another consumer_type moved the looping message aside an hour before: its event is older than all 250, and is
    // shown, the cut being each consumer_type's (before 2026-12-07 the newest 200 of all were kept, and it was cut).
    sqlx::query(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at) \
         VALUES ('notifier', 'dead_lettered', $1, now() - interval '1 hour')",
    )
    .bind(looping)
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["find", &looping.to_string(), &just.to_string(), "--json"]);
    let report = json(&out);
    let looping = &report["messages"][0];
    let events = looping["events"].as_array().unwrap();
    assert_eq!(events.len(), 201, "{looping}");
    assert_eq!(looping["events_cut"], true);
    assert_eq!(events[0]["consumer_type"], "notifier", "{looping}");
    assert_eq!(events[0]["kind"], "dead_lettered");
    assert_eq!(events[200]["kind"], "dead_lettered", "the newest last");
    assert_eq!(events[1]["kind"], "failed");
    let just = &report["messages"][1];
    assert_eq!(just["events"].as_array().unwrap().len(), 200, "{just}");
    assert_eq!(just["events_cut"], false, "exactly the limit is not cut");
}

#[tokio::test(flavor = "multi_thread")]
async fn find_shows_one_message_everywhere_and_leaves_the_error_queue_as_it_was() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    // One message, published three times: the carrier processes it once and discards two copies; the notification
    // consumer fails it (its destination is the one it is told to fail) and dead-letters it.
    let id = Uuid::new_v4();
    let (props, body, parcel) = common::parcel_message(id, "FAIL");
    common::publish_copies(&conn, common::EVENT_EXCHANGE, props, &body, 3).await;
    common::consume_until_idle(&env, &["carrier"]);
    // Other failures around it, so that its place and the queue's order show.
    let notification_error = format!("{NOTIFICATION_QUEUE}_error");
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        &notification_error,
        common::queue_type(),
    )
    .await
    .unwrap();
    fail(
        &conn,
        &notification_error,
        "System.TimeoutException",
        "timeout",
        TimeDelta::zero(),
    )
    .await;
    common::consume_until_idle(
        &env,
        &[
            "notification",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "2",
            "--retry-delay",
            "10ms",
        ],
    );
    fail(
        &conn,
        &notification_error,
        "System.TimeoutException",
        "timeout",
        TimeDelta::zero(),
    )
    .await;
    let order = ids_in(&conn, &notification_error).await;
    assert_eq!(order.len(), 5, "{order:?}");

    let out = env.run(&["find", &id.to_string(), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    let m = &report["messages"][0];
    let inbox = m["inbox"].as_array().unwrap();
    assert_eq!(inbox.len(), 1, "{m}");
    assert_eq!(inbox[0]["consumer_type"], CARRIER_QUEUE);
    assert!(inbox[0]["processed_at"].is_string());
    let kinds = |ct: &str| -> Vec<String> {
        m["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["consumer_type"] == ct)
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(kinds(CARRIER_QUEUE), ["duplicate", "duplicate"], "{m}");
    let notification = kinds(NOTIFICATION_QUEUE);
    assert!(notification.contains(&"failed".to_owned()), "{m}");
    assert_eq!(
        notification
            .iter()
            .filter(|k| *k == "dead_lettered")
            .count(),
        3,
        "{m}"
    );
    assert_eq!(m["effects"].as_array().unwrap().len(), 1, "{m}");
    assert_eq!(m["effects"][0]["table"], "carrier_reservations");
    assert_eq!(m["effects"][0]["parcel_id"], parcel.to_string());
    let copies = m["dead_letters"].as_array().unwrap();
    assert_eq!(copies.len(), 3, "{m}");
    assert!(
        copies
            .iter()
            .all(|c| c["queue"] == notification_error.as_str())
    );
    assert_eq!(copies[0]["position"], 2, "{m}");
    assert!(copies[0]["reason"] == "SMS gateway returned 503", "{m}");
    assert_eq!(copies[0]["origin"], NOTIFICATION_QUEUE);
    assert_eq!(
        ids_in(&conn, &notification_error).await,
        order,
        "the error queue is as it was"
    );

    // The same id twice, spelt two ways: one message, its copies under it.
    let braced = format!("{{{}}}", id.to_string().to_uppercase());
    let out = env.run(&["find", &id.to_string(), &braced, "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    assert_eq!(report["messages"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(
        report["messages"][0]["dead_letters"]
            .as_array()
            .unwrap()
            .len(),
        3,
        "{report}"
    );

    // On a terminal's table too, and the note that looking marks messages redelivered.
    let out = env.run(&["find", &id.to_string()]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("duplicate"), "{}", out.stdout);
    assert!(out.stdout.contains("redelivered"), "{}", out.stdout);

    // An id that is nowhere (exit 3), and one that is no id (a usage error).
    let nowhere = Uuid::new_v4().to_string();
    let out = env.run(&["find", &nowhere]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(out.stdout.contains("found nowhere"), "{out:?}");
    let out = env.run(&["find", "not-a-uuid"]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("is not a message id"), "{out:?}");

    // A message published without the AMQP message id (its envelope's is the one the consumer keys on): its copy in
    // the error queue is found by that id too (it was not: only the property was read).
    let bare_id = Uuid::new_v4();
    let (_, body, _) = common::parcel_message(bare_id, "FAIL");
    let bare = lapin::BasicProperties::default()
        .with_content_type(inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE.into())
        .with_delivery_mode(2);
    common::publish(&conn, "", NOTIFICATION_QUEUE, bare, &body).await;
    common::consume_until_idle(
        &env,
        &[
            "notification",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "1",
        ],
    );
    let out = env.run(&["find", &bare_id.to_string(), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    assert_eq!(
        report["messages"][0]["dead_letters"][0]["queue"], notification_error,
        "{report}"
    );

    // While a replay of the queue runs, what it holds cannot be seen: said, not taken for absent.
    let marker = env.amqp().await;
    inboxctl::amqp::topology::mark_replay(&marker, &notification_error)
        .await
        .unwrap();
    let out = env.run(&["find", &bare_id.to_string()]);
    assert!(
        out.stdout
            .contains("a replay of it is running: what it holds is not seen"),
        "{out:?}"
    );
    let _ = marker.close(200, "OK".into()).await;
}

/// `failures` and `find` take nothing, so a stop (Ctrl-C) ends them at once, exit 3: the messages they held go back
/// to their queue in their order as the connection closes. Before, the first Ctrl-C only said "finishing what is in
/// flight" while a look at a long queue went on, and a second one ended it with exit 130.
#[tokio::test(flavor = "multi_thread")]
async fn a_look_is_ended_at_once_by_a_stop_and_leaves_the_queue_as_it_was() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    for i in 0..5 {
        fail(
            &conn,
            ERROR_QUEUE,
            "System.TimeoutException",
            &format!("timeout {i}"),
            TimeDelta::zero(),
        )
        .await;
    }
    let before = ids_in(&conn, ERROR_QUEUE).await;
    common::eventually(
        "the looked-at messages back",
        Duration::from_secs(10),
        || async { env.queue_counts(ERROR_QUEUE) == (5, 0) },
    )
    .await;
    let failpoint = format!("peek=pause@{ERROR_QUEUE}");
    for command in [
        vec!["failures", "--from", ERROR_QUEUE],
        vec!["find", &before[0], "--dlq", ERROR_QUEUE],
    ] {
        let mut look = env.spawn_with(&command, &[("INBOXCTL_FAILPOINTS", failpoint.as_str())]);
        look.wait_for_stderr("failpoint peek reached", Duration::from_secs(20));
        let status = std::process::Command::new("kill")
            .args(["-INT", &look.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let asked = Instant::now();
        assert_eq!(
            look.wait(Duration::from_secs(20)),
            Some(3),
            "{}",
            look.stderr()
        );
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "{command:?} took {:?} to end",
            asked.elapsed()
        );
        assert!(
            look.stderr().contains("interrupted: nothing was taken"),
            "{}",
            look.stderr()
        );
        common::eventually(
            "the held messages back",
            Duration::from_secs(10),
            || async { env.queue_counts(ERROR_QUEUE) == (5, 0) },
        )
        .await;
        assert_eq!(ids_in(&conn, ERROR_QUEUE).await, before, "{command:?}");
        common::eventually(
            "the look's messages back",
            Duration::from_secs(10),
            || async { env.queue_counts(ERROR_QUEUE) == (5, 0) },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_shows_the_oldest_dead_letter_beside_the_retention() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let conn = env.amqp().await;
    processed_rows(&pool, "ops", "ops-queue", 1, 0).await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(
        &conn,
        "ops-queue_error",
        common::queue_type(),
    )
    .await
    .unwrap();
    fail(
        &conn,
        "ops-queue_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::hours(2),
    )
    .await;
    fail(
        &conn,
        "ops-queue_error",
        "System.TimeoutException",
        "timeout",
        TimeDelta::minutes(1),
    )
    .await;
    let order = ids_in(&conn, "ops-queue_error").await;
    for (retention, window) in [("1d", "ok"), ("2h10m", "near"), ("1h", "past")] {
        let out = env.run(&["stats", "--retention", retention, "--json"]);
        assert_eq!(out.code, Some(0), "{out:?}");
        let report = json(&out);
        let ops = &report["consumers"][0];
        assert_eq!(ops["dead_letter_window"], window, "{retention}: {ops}");
        let age = ops["oldest_dead_letter_seconds"].as_f64().unwrap();
        assert!(
            (7140.0..7260.0).contains(&age),
            "the head's age, not the newest's: {ops}"
        );
    }
    let out = env.run(&["stats", "--retention", "1h"]);
    let row = out
        .stdout
        .lines()
        .find(|l| l.contains("ops"))
        .unwrap_or_default()
        .to_owned();
    assert!(
        row.contains(" PAST"),
        "the ops row flags it: {}",
        out.stdout
    );
    let out = env.run(&["stats", "--retention", "1d"]);
    let row = out
        .stdout
        .lines()
        .find(|l| l.contains("ops"))
        .unwrap_or_default()
        .to_owned();
    assert!(
        !row.contains("PAST") && !row.contains("near"),
        "{}",
        out.stdout
    );

    assert_eq!(
        ids_in(&conn, "ops-queue_error").await,
        order,
        "looking took nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn top_shows_a_consumer_types_detail_and_replays_a_group_after_a_confirmation() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    processed_rows(&pool, CARRIER_QUEUE, CARRIER_QUEUE, 2, 0).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    for i in 0..3 {
        fail(
            &conn,
            ERROR_QUEUE,
            "System.TimeoutException",
            &format!("timeout after {i} ms"),
            TimeDelta::zero(),
        )
        .await;
    }
    for _ in 0..2 {
        fail(
            &conn,
            ERROR_QUEUE,
            "System.InvalidOperationException",
            "carrier API returned 503",
            TimeDelta::zero(),
        )
        .await;
    }
    let tmux = common::Tmux::of(&env);
    let top = |extra: &str| format!("top --interval 500ms {extra}");
    tmux.start(&env, &top(""));
    tmux.wait_for("the table", |s| s.contains(CARRIER_QUEUE));
    tmux.run(&["send-keys", "-t", "top", "Enter"]);
    let screen = tmux.wait_for("the detail", |s| {
        s.contains("failure groups of parcel-created-carrier_error")
    });
    assert!(
        screen.contains("timeout after # ms") && screen.contains("carrier API returned 503"),
        "{screen}"
    );
    assert!(
        screen.contains("recent failures") && screen.contains("oldest unprocessed rows"),
        "{screen}"
    );
    // The largest group first, selected: r asks, n moves nothing.
    tmux.run(&["send-keys", "-t", "top", "r"]);
    tmux.wait_for("the question", |s| s.contains("replay 3 messages of group"));
    tmux.run(&["send-keys", "-t", "top", "n"]);
    tmux.wait_for("the refusal", |s| s.contains("replay cancelled"));
    assert_eq!(env.queue_counts(ERROR_QUEUE), (5, 0));
    tmux.run(&["send-keys", "-t", "top", "r"]);
    tmux.wait_for("the question", |s| s.contains("replay 3 messages of group"));
    tmux.run(&["send-keys", "-t", "top", "y"]);
    let screen = tmux.wait_for("the replay's outcome", |s| {
        s.contains("replayed 3 of group")
    });
    assert!(screen.contains("0 gone"), "{screen}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (3, 0));
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inboxctl_audit WHERE command = 'replay' AND details->>'via' = 'top'
           AND (details->>'replayed')::int = 3",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);
    tmux.run(&["send-keys", "-t", "top", "Escape"]);
    tmux.wait_for("the table again", |s| {
        s.contains("deliv/s") && !s.contains("failure groups of")
    });
    tmux.run(&["send-keys", "-t", "top", "q"]);
    tmux.wait_for("top to exit", |s| s.contains("EXITED=0"));
    tmux.run(&["kill-session", "-t", "top"]);

    // --read-only: the detail, but no replay.
    tmux.start(&env, &top("--read-only"));
    tmux.wait_for("the table", |s| {
        s.contains(CARRIER_QUEUE) && s.contains("read-only")
    });
    tmux.run(&["send-keys", "-t", "top", "Enter"]);
    tmux.wait_for("the detail", |s| {
        s.contains("failure groups of parcel-created-carrier_error")
    });
    tmux.run(&["send-keys", "-t", "top", "r"]);
    let screen = tmux.wait_for("the refusal", |s| s.contains("replay is off"));
    assert!(!screen.contains("replay 2 messages of group"), "{screen}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (2, 0));
}

/// A listing is what the operator saw: re-run with it later, a group replay leaves a listed member's copy that failed
/// after the listing (its replayed copy failing again, of the same cause): counted as new of its cause, and the
/// listed copy, replayed by the first run, reported gone. The second run used to replay the new failure as the
/// member, and say nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_group_replay_run_again_with_its_listing_leaves_a_members_failure_since() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    let timeout = "System.TimeoutException";
    let age = TimeDelta::minutes(30);
    let a = fail(&conn, ERROR_QUEUE, timeout, "timeout after 10 ms", age).await;
    fail(&conn, ERROR_QUEUE, timeout, "timeout after 20 ms", age).await;
    // A member failed on a host whose clock runs five minutes ahead: it must not move the bound of the others (the
    // failure since of `a`, below, would be taken for `a` itself).
    fail(
        &conn,
        ERROR_QUEUE,
        timeout,
        "timeout after 40 ms",
        TimeDelta::minutes(-5),
    )
    .await;
    common::eventually("the messages ready", Duration::from_secs(10), || async {
        env.queue_counts(ERROR_QUEUE) == (3, 0)
    })
    .await;
    let (listing, report) = failures_listing(&env);
    let fingerprint = report["groups"][0]["fingerprint"]
        .as_str()
        .unwrap()
        .to_owned();
    let group_replay = |extra: &[&str]| {
        let mut args = vec![
            "replay",
            "--from",
            ERROR_QUEUE,
            "--group",
            &fingerprint,
            "--listing",
            listing.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        env.run(&args)
    };
    // A listing names messages of its own vhost: another vhost's same-named queue holds other messages.
    let elsewhere = format!("{}/%2f", common::amqp_base());
    let out = group_replay(&["--amqp-url", &elsewhere]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("not in the vhost connected to"),
        "{out:?}"
    );
    let first = json(&group_replay(&["--limit", "1"]));
    assert_eq!(first["replayed"], 1, "{first}");
    // The member replayed fails again, of the same cause, after the listing.
    fail_as(
        &conn,
        ERROR_QUEUE,
        Uuid::parse_str(&a).unwrap(),
        timeout,
        "timeout after 30 ms",
        TimeDelta::zero(),
    )
    .await;
    common::eventually(
        "the failure since ready",
        Duration::from_secs(10),
        || async { env.queue_counts(ERROR_QUEUE) == (3, 0) },
    )
    .await;

    let out = group_replay(&[]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let second = json(&out);
    assert_eq!(second["replayed"], 2, "the two others only: {second}");
    assert_eq!(second["group"]["new"], 1, "{}", second["group"]);
    assert_eq!(
        second["group"]["gone"],
        serde_json::json!([a]),
        "{}",
        second["group"]
    );
    assert_eq!(
        ids_in(&conn, ERROR_QUEUE).await,
        [a],
        "the failure since left"
    );
}

/// The same through `_skipped`, whose copies carry no failure time (MassTransit's nor inboxctl's): two messages of a
/// type the consumer does not handle are moved aside and listed; the group replay with `--limit 1` sends the first
/// back, where it is skipped again. Run again with the listing, the group replay leaves that copy — replayed once
/// more than its listed member — counted new, and replays the other member only. It used to take the copy for the
/// member (no time told them apart), replay both and say the group was whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_group_replay_of_skipped_copies_leaves_a_member_replayed_and_skipped_again() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let skipped = format!("{CARRIER_QUEUE}_skipped");
    let mut ids = Vec::new();
    for _ in 0..2 {
        let id = Uuid::new_v4();
        let (props, body, _) = common::parcel_message(id, "Berlin");
        let mut envelope: serde_json::Value = serde_json::from_slice(&body).unwrap();
        envelope["messageType"] =
            serde_json::json!(["urn:message:ParcelTracker.Domain.Events:ParcelLabelPrinted"]);
        let body = serde_json::to_vec(&envelope).unwrap();
        common::publish(&conn, "", CARRIER_QUEUE, props, &body).await;
        ids.push(id.to_string());
    }
    // One worker, so that the copies are moved aside in the order they came (four at once did it in either order).
    let consume = || common::consume_until_idle(&env, &["carrier", "--concurrency", "1"]);
    consume();
    assert_eq!(ids_in(&conn, &skipped).await, ids, "both moved aside");

    let listing = tempdir().join("listing.json");
    let out = env.run(&[
        "failures",
        "--from",
        &skipped,
        "--json",
        "--output",
        listing.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let fingerprint = json(&out)["groups"][0]["fingerprint"]
        .as_str()
        .unwrap()
        .to_owned();
    let group_replay = |extra: &[&str]| {
        let mut args = vec![
            "replay",
            "--from",
            &skipped,
            "--group",
            &fingerprint,
            "--listing",
            listing.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        env.run(&args)
    };
    let first = group_replay(&["--limit", "1"]);
    assert_eq!(json(&first)["replayed"], 1, "{first:?}");
    consume();
    assert_eq!(
        ids_in(&conn, &skipped).await,
        [ids[1].clone(), ids[0].clone()],
        "the first skipped again, behind the second"
    );

    let out = group_replay(&[]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let second = json(&out);
    assert_eq!(second["replayed"], 1, "the second member only: {second}");
    assert_eq!(second["group"]["new"], 1, "{}", second["group"]);
    assert_eq!(
        second["group"]["gone"],
        serde_json::json!([ids[0]]),
        "{}",
        second["group"]
    );
    assert_eq!(
        ids_in(&conn, &skipped).await,
        [ids[0].clone()],
        "the failure since left"
    );
}

/// A replay holds the messages it leaves until it ends (hours with `--rate`): a `failures` meanwhile listed the queue
/// without them — "0 messages in 0 groups", exit 0 — and could write that listing for a group replay. It says that a
/// replay was running (as `find` does), in its summary and its JSON, and exits 3.
#[tokio::test(flavor = "multi_thread")]
async fn failures_while_a_replay_holds_the_queue_says_so() {
    let env = TestEnv::migrated().await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    for _ in 0..3 {
        fail(
            &conn,
            ERROR_QUEUE,
            "Boom",
            "carrier down",
            TimeDelta::minutes(5),
        )
        .await;
    }
    let out = env.run(&["failures", "--from", ERROR_QUEUE, "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(json(&out)["replay_running"], false, "{out:?}");

    // A replay's marker, and what it holds taken from the queue (unacknowledged, on the marker's connection).
    let replay = env.amqp().await;
    inboxctl::amqp::topology::mark_replay(&replay, ERROR_QUEUE)
        .await
        .unwrap();
    let channel = replay.create_channel().await.unwrap();
    for _ in 0..3 {
        let got = channel
            .basic_get(
                ERROR_QUEUE.into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .unwrap();
        assert!(got.is_some());
    }
    let out = env.run(&["failures", "--from", ERROR_QUEUE, "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let listing = json(&out);
    assert_eq!(listing["replay_running"], true, "{listing}");
    assert_eq!(listing["looked"], 0, "{listing}");
    let out = env.run(&["failures", "--from", ERROR_QUEUE]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stdout
            .contains("a replay of it was running: the messages it holds were not seen"),
        "{out:?}"
    );
    let _ = replay.close(200, "OK".into()).await;
}

/// A consumer host whose clock runs two minutes ahead of the operator's: its members' failure times are "after" the
/// listing by the operator's clock. They were taken for failures since the listing — not replayed, and reported gone
/// while still in the queue (and new). The members are compared with the newest failure the listing read, on the same
/// clocks: every member goes back.
#[tokio::test(flavor = "multi_thread")]
async fn a_group_failed_on_a_host_whose_clock_runs_ahead_replays_its_members() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    for i in 0..3 {
        fail(
            &conn,
            ERROR_QUEUE,
            "System.TimeoutException",
            &format!("timeout after {i} ms"),
            TimeDelta::minutes(-2) + TimeDelta::seconds(i),
        )
        .await;
    }
    common::eventually("the messages ready", Duration::from_secs(10), || async {
        env.queue_counts(ERROR_QUEUE) == (3, 0)
    })
    .await;
    let (listing, report) = failures_listing(&env);
    let fingerprint = report["groups"][0]["fingerprint"].as_str().unwrap();
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        fingerprint,
        "--listing",
        listing.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = json(&out);
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(report["group"]["gone"], serde_json::json!([]), "{report}");
    assert_eq!(report["group"]["new"], 0, "{report}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (0, 0));
}

/// Messages published without the AMQP message id, failed: the consumer keyed each on its envelope's id, which `find`
/// shows. `failures` lists them under those ids — they were counted among the messages without one — and `replay`
/// chooses them by them, with `--message-id` and with `--group`: before, the first was reported unmatched and the
/// group's members left where they were.
#[tokio::test(flavor = "multi_thread")]
async fn failed_messages_known_by_their_envelopes_ids_alone_are_listed_and_replayed_by_them() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, ERROR_QUEUE, common::queue_type())
        .await
        .unwrap();
    let bare = lapin::BasicProperties::default()
        .with_content_type(inboxctl::amqp::envelope::MASSTRANSIT_CONTENT_TYPE.into())
        .with_delivery_mode(2);
    let ids = [Uuid::new_v4(), Uuid::new_v4()];
    for id in ids {
        let (_, body, _) = common::parcel_message(id, "Berlin");
        let exception = "System.TimeoutException";
        let age = TimeDelta::minutes(1);
        fail_message(
            &conn,
            ERROR_QUEUE,
            bare.clone(),
            &body,
            exception,
            "timeout",
            age,
        )
        .await;
    }
    common::eventually("the messages ready", Duration::from_secs(10), || async {
        env.queue_counts(ERROR_QUEUE) == (2, 0)
    })
    .await;

    let (listing, report) = failures_listing(&env);
    let group = &report["groups"][0];
    assert_eq!(group["without_id"], 0, "{report}");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&listing).unwrap()).unwrap();
    let listed: Vec<&str> = written["groups"][0]["message_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_str().unwrap())
        .collect();
    assert_eq!(listed, [ids[0].to_string(), ids[1].to_string()], "{report}");

    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--message-id",
        &ids[0].to_string(),
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let replayed = json(&out);
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    assert_eq!(
        replayed["items"][0]["message_id"],
        ids[0].to_string(),
        "{replayed}"
    );

    let fingerprint = group["fingerprint"].as_str().unwrap();
    let out = env.run(&[
        "replay",
        "--from",
        ERROR_QUEUE,
        "--group",
        fingerprint,
        "--listing",
        listing.to_str().unwrap(),
        "--json",
    ]);
    let replayed = json(&out);
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    assert_eq!(env.queue_counts(ERROR_QUEUE), (0, 0), "{replayed}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (2, 0), "{replayed}");
}

/// Past the bound on all of a message's events (2,000), what is left out is the busiest consumer_types' oldest, not
/// the one event of a quiet consumer_type that happens to be the oldest of all: eleven consumer_types with 201
/// events each, and a twelfth whose one event is older than all of them, which is shown.
#[tokio::test(flavor = "multi_thread")]
async fn find_past_its_bound_on_all_events_keeps_each_consumer_types_newest() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
         SELECT 'busy-' || t, 'duplicate', $1, now() - make_interval(secs => i)
         FROM generate_series(1, 11) t, generate_series(1, 201) i",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at) \
         VALUES ('quiet', 'dead_lettered', $1, now() - interval '1 day')",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["find", &id.to_string(), "--json"]);
    let report = json(&out);
    let found = &report["messages"][0];
    assert_eq!(found["events_cut"], true);
    let events = found["events"].as_array().unwrap();
    assert_eq!(events.len(), 2_000);
    assert_eq!(events[0]["consumer_type"], "quiet", "the oldest, and kept");
}
