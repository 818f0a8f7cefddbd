//! Effects outside the database: the carrier as a real HTTP API (`inboxctl carrier-stub` on loopback), called keyed,
//! after the commit or at most once, with consumer processes killed with SIGKILL at each crash point; the stand-in's
//! own count of bookings per parcel is what each test checks.
#![cfg(feature = "failpoints")]

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use common::{CARRIER_QUEUE, Proc, Stub, TestEnv};
use inboxctl::db::external;

/// Timeouts short enough for the tests, and a lease just past them (a call has ended before its lease does).
const KEY_TTL: Duration = inboxctl::effects::DEFAULT_KEY_TTL;

const QUICK: &[&str] = &[
    "--carrier-timeout",
    "2s",
    "--carrier-connect-timeout",
    "500ms",
    "--effect-lease",
    "3s",
    "--retry-delay",
    "100ms",
    "--concurrency",
    "4",
];

/// With a look-up, a leased attempt may ask it and then call, both within QUICK's 3 s lease: each bounded so that the
/// two together end before it (2 × 1.4 s).
const LOOK_UP_QUICK: [&str; 6] = [
    "--carrier-timeout",
    "1s",
    "--carrier-connect-timeout",
    "400ms",
    "--lookup-quiet",
    "1s",
];

fn consume_args<'a>(stub: &'a Stub, mode: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "consume",
        "carrier",
        "--carrier-url",
        &stub.url,
        "--effect-mode",
        mode,
    ];
    // A flag in `extra` replaces QUICK's.
    for pair in QUICK.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend_from_slice(pair);
        }
    }
    args.extend_from_slice(extra);
    args
}

/// The state of the effect of the parcel sent to `destination`, as `effects` shows it.
async fn state_of(pool: &PgPool, destination: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT CASE WHEN state = 'started' AND mode = 'at-most-once' AND lease_until < now() THEN 'in_doubt'
                     ELSE state END
         FROM inboxctl_effects WHERE request->>'destination' = $1",
    )
    .bind(destination)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The state of the effect of message `id` as stored (`started` past its lease not read as in doubt).
async fn stored_state(pool: &PgPool, id: Uuid) -> String {
    sqlx::query_scalar("SELECT state FROM inboxctl_effects WHERE message_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// How many effects are in each state, by state.
async fn effect_states(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT state, count(*) FROM inboxctl_effects GROUP BY state ORDER BY state")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn message_of(pool: &PgPool, destination: &str) -> Uuid {
    sqlx::query_scalar("SELECT message_id FROM inboxctl_effects WHERE request->>'destination' = $1")
        .bind(destination)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn publish_to(env: &TestEnv, destination: &str, count: u32) {
    common::publish_parcels(
        env,
        &["--count", &count.to_string(), "--destination", destination],
    );
}

/// Runs a consumer until the effect for `destination` is settled (done, in doubt or failed) and the queue is empty.
async fn settle(env: &TestEnv, pool: &PgPool, args: &[&str], destination: &str) -> String {
    let mut consumer = env.spawn(args);
    let mut state = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        state = state_of(pool, destination).await;
        if state
            .as_deref()
            .is_some_and(|s| ["done", "in_doubt", "failed"].contains(&s))
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.terminate();
    consumer.wait(Duration::from_secs(30));
    state.unwrap_or_else(|| panic!("no effect for {destination}: {}", consumer.stderr()))
}

#[derive(Debug, Clone, Copy)]
enum Point {
    /// `effect-after-intent`: the intent is on record (keyed: claimed, not committed), the request not sent.
    Intent,
    /// The request reached the carrier, which booked and holds the answer back; SIGKILL meanwhile.
    Request,
    /// `effect-after-response`: the answer arrived; its outcome not committed.
    Response,
    /// `after-commit`: the claim committed, the delivery not acknowledged (and, after-commit or at-most-once, the
    /// worker held before its request, so the kill lands at the same place each time).
    Commit,
}

const POINTS: [Point; 4] = [
    Point::Intent,
    Point::Request,
    Point::Response,
    Point::Commit,
];

/// One crash: a parcel to its own destination, a consumer killed at `point`, then a consumer that runs until its
/// effect is settled. Returns the bookings the stand-in made for it and the effect's state.
async fn crash_case(
    env: &TestEnv,
    pool: &PgPool,
    stub: &Stub,
    mode: &str,
    point: Point,
    behaviour: serde_json::Value,
    extra: &[&str],
) -> (usize, String) {
    let destination = format!("{mode}-{point:?}-{}", Uuid::new_v4().simple());
    let mut held = behaviour.clone();
    if let Point::Request = point {
        held["delayMs"] = json!(60_000);
    }
    stub.behave(held).await;
    publish_to(env, &destination, 1);
    let failpoints = match (point, mode) {
        (Point::Intent, _) => format!("effect-after-intent@{destination}"),
        (Point::Request, _) => String::new(),
        (Point::Response, _) => format!("effect-after-response@{destination}"),
        (Point::Commit, "keyed") => "after-commit".to_owned(),
        (Point::Commit, _) => format!("after-commit,effect-after-intent@{destination}"),
    };
    let mut victim: Proc = env.spawn_with(
        &consume_args(stub, mode, extra),
        &[("INBOXCTL_FAILPOINTS", &failpoints)],
    );
    match point {
        Point::Request => {
            common::eventually(
                "the stand-in booked and holds its answer",
                Duration::from_secs(30),
                || async { stub.bookings_to(&destination).await == 1 },
            )
            .await;
        }
        Point::Commit => {
            victim.wait_for_stderr("failpoint after-commit reached", Duration::from_secs(30));
            if mode != "keyed" {
                victim.wait_for_stderr(
                    "failpoint effect-after-intent reached",
                    Duration::from_secs(30),
                );
            }
        }
        Point::Intent => victim.wait_for_stderr(
            "failpoint effect-after-intent reached",
            Duration::from_secs(30),
        ),
        Point::Response => victim.wait_for_stderr(
            "failpoint effect-after-response reached",
            Duration::from_secs(30),
        ),
    }
    victim.kill();
    stub.behave(behaviour).await;
    let state = settle(env, pool, &consume_args(stub, mode, extra), &destination).await;
    (stub.bookings_to(&destination).await, state)
}

/// Runs every crash point for `mode` against a stand-in that honours keys or not; checks each outcome against
/// `expected(point)` (bookings, state).
async fn matrix(
    mode: &str,
    honour: bool,
    extra: &[&str],
    expected: impl Fn(Point) -> (usize, &'static str),
) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let behaviour = json!({"honourKeys": honour});
    let started = Instant::now();
    let mut outcomes = Vec::new();
    for point in POINTS {
        let case = Instant::now();
        let got = crash_case(&env, &pool, &stub, mode, point, behaviour.clone(), extra).await;
        let want = expected(point);
        eprintln!(
            "{mode} honour={honour} {extra:?} {point:?}: {} booking(s), {} ({:.1} s)",
            got.0,
            got.1,
            case.elapsed().as_secs_f64()
        );
        outcomes.push((point, got.clone(), want));
    }
    let wrong: Vec<_> = outcomes
        .iter()
        .filter(|(_, got, want)| got.0 != want.0 || got.1 != want.1)
        .collect();
    assert!(
        wrong.is_empty(),
        "{mode} honour={honour}: (point, got, expected) {wrong:?}"
    );
    eprintln!(
        "{mode} honour={honour}: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if mode == "at-most-once" {
        reconcile_in_doubt(&env, &pool, &stub, mode).await;
    }
}

/// An at-most-once call whose process died mid-call, its lease run out, with no consumer running to mark it: listed
/// in doubt as `find` and `stats` count it, not "started" (held by a live process, which it is not).
#[tokio::test(flavor = "multi_thread")]
async fn a_call_whose_process_died_is_listed_in_doubt_not_started() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, \
         lease_until) VALUES (gen_random_uuid(), 'carrier', gen_random_uuid(), 'at-most-once', 'started', '{}', 1, \
         now() - interval '1 second')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listed = env.run(&["effects", "--in-doubt", "--json"]);
    assert_eq!(listed.code, Some(0), "{listed:?}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&listed.stdout).unwrap();
    assert_eq!(rows.len(), 1, "{}", listed.stdout);
    assert_eq!(rows[0]["state"], "in_doubt", "{}", listed.stdout);
}

/// At-most-once leaves its effects in doubt; `effects reconcile` asks the stand-in about each: the booked ones are
/// done, the others owed again and made once by the next consumer. Every parcel ends booked exactly once.
async fn reconcile_in_doubt(env: &TestEnv, pool: &PgPool, stub: &Stub, mode: &str) {
    let listed = env.run(&["effects", "--in-doubt", "--json"]);
    assert_eq!(listed.code, Some(0), "{listed:?}");
    let in_doubt: Vec<serde_json::Value> = serde_json::from_str(&listed.stdout).unwrap();
    assert_eq!(in_doubt.len(), POINTS.len(), "{}", listed.stdout);
    let out = env.run(&[
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
        "--quiet-for",
        "0s",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut consumer = env.spawn(&consume_args(stub, mode, &[]));
    common::eventually("every effect done", Duration::from_secs(30), || async {
        common::count(
            pool,
            "SELECT count(*) FROM inboxctl_effects WHERE state <> 'done'",
        )
        .await
            == 0
    })
    .await;
    consumer.terminate();
    consumer.wait(Duration::from_secs(30));
    let mut per_destination: HashMap<String, usize> = HashMap::new();
    for b in stub.bookings().await {
        *per_destination
            .entry(b["destination"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(per_destination.len(), POINTS.len());
    assert!(
        per_destination.values().all(|&n| n == 1),
        "{per_destination:?}"
    );
    assert_eq!(
        common::count(pool, "SELECT count(*) FROM carrier_reservations").await,
        POINTS.len() as i64
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn keyed_crash_matrix_honouring_keys_books_once() {
    matrix("keyed", true, &[], |_| (1, "done")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn keyed_crash_matrix_ignoring_keys_books_again_after_a_call_was_made() {
    matrix("keyed", false, &[], |p| match p {
        Point::Request | Point::Response => (2, "done"),
        Point::Intent | Point::Commit => (1, "done"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn after_commit_crash_matrix_honouring_keys_books_once() {
    matrix("after-commit", true, &[], |_| (1, "done")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn after_commit_crash_matrix_ignoring_keys_is_at_least_once() {
    matrix("after-commit", false, &[], |p| match p {
        Point::Request | Point::Response => (2, "done"),
        Point::Intent | Point::Commit => (1, "done"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn after_commit_crash_matrix_ignoring_keys_with_a_lookup_books_once() {
    // The look-up is the same stand-in's: it ignores keys when booking, and finds a booking by the key it was sent.
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let url = stub.url.clone();
    let extra = [
        "--lookup-url",
        url.as_str(),
        LOOK_UP_QUICK[0],
        LOOK_UP_QUICK[1],
        LOOK_UP_QUICK[2],
        LOOK_UP_QUICK[3],
        LOOK_UP_QUICK[4],
        LOOK_UP_QUICK[5],
    ];
    for point in POINTS {
        let got = crash_case(
            &env,
            &pool,
            &stub,
            "after-commit",
            point,
            json!({"honourKeys": false}),
            &extra,
        )
        .await;
        eprintln!("after-commit with a look-up, ignoring keys, {point:?}: {got:?}");
        assert_eq!(got, (1, "done".to_owned()), "{point:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn at_most_once_crash_matrix_books_at_most_once_and_lists_the_doubt() {
    matrix("at-most-once", false, &[], |p| match p {
        Point::Request | Point::Response => (1, "in_doubt"),
        Point::Intent | Point::Commit => (0, "in_doubt"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn at_most_once_crash_matrix_honouring_keys_is_the_same() {
    matrix("at-most-once", true, &[], |p| match p {
        Point::Request | Point::Response => (1, "in_doubt"),
        Point::Intent | Point::Commit => (0, "in_doubt"),
    })
    .await;
}

/// The stand-in books and drops the connection without answering: keyed and after-commit call again with the key
/// (one booking, the carrier honouring it); at-most-once never calls again, lists the effect in doubt, and an
/// operator settles it with `effects resolve --done`, audited.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_dropped_after_booking() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    for (mode, state) in [
        ("keyed", "done"),
        ("after-commit", "done"),
        ("at-most-once", "in_doubt"),
    ] {
        let destination = format!("dropped-{mode}");
        stub.behave(json!({"honourKeys": true, "dropNext": 1}))
            .await;
        publish_to(&env, &destination, 1);
        let got = settle(&env, &pool, &consume_args(&stub, mode, &[]), &destination).await;
        assert_eq!(
            (stub.bookings_to(&destination).await, got.as_str()),
            (1, state),
            "{mode}"
        );
    }
    let id = message_of(&pool, "dropped-at-most-once").await;
    let stats = env.run(&["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats.stdout).unwrap();
    let carrier = stats["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == CARRIER_QUEUE)
        .unwrap();
    assert_eq!(carrier["effects_in_doubt"], 1, "{carrier}");
    assert_eq!(carrier["effects_pending"], 0, "{carrier}");
    assert!(carrier["oldest_effect_in_doubt_seconds"].as_f64().unwrap() >= 0.0);
    let listed = env.run(&["effects", "--in-doubt"]);
    assert!(listed.stdout.contains(&id.to_string()), "{listed:?}");
    assert!(listed.stdout.contains("answer was lost"), "{listed:?}");
    let slot = stub.bookings().await.last().unwrap()["slotId"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = env.run(&[
        "effects",
        "resolve",
        &id.to_string(),
        "--done",
        "--reference",
        &slot,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        state_of(&pool, "dropped-at-most-once").await.as_deref(),
        Some("done")
    );
    let again = env.run(&["effects", "resolve", &id.to_string(), "--retry"]);
    assert_ne!(
        again.code,
        Some(0),
        "a done effect is not settled again: {again:?}"
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_audit WHERE command = 'effects resolve' AND outcome = 'done'"
        )
        .await,
        1
    );
    let found = env.run(&["find", &id.to_string(), "--json"]);
    assert!(
        found.stdout.contains(&slot),
        "find shows the effect: {found:?}"
    );
}

/// 503s are retried with the consumer's backoff; past --max-attempts the message goes to the error queue, nothing
/// booked. After-commit: the effect fails after as many calls, and is listed.
#[tokio::test(flavor = "multi_thread")]
async fn unavailable_carriers_are_retried_then_dead_lettered() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);

    stub.behave(json!({"failNext": 2})).await;
    publish_to(&env, "flaky", 1);
    common::consume_until_idle(
        &env,
        &consume_args(&stub, "keyed", &["--max-attempts", "5"])[1..],
    );
    assert_eq!(stub.bookings_to("flaky").await, 1);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'"
        )
        .await,
        2,
        "two 503s, each a failed attempt"
    );

    stub.behave(json!({"failAlways": true})).await;
    publish_to(&env, "down", 1);
    let out = common::consume_until_idle(
        &env,
        &consume_args(&stub, "keyed", &["--max-attempts", "3"])[1..],
    );
    assert!(out.stderr.contains("503"), "{}", out.stderr);
    assert_eq!(env.queue_counts(&format!("{CARRIER_QUEUE}_error")), (1, 0));
    assert_eq!(stub.bookings_to("down").await, 0);

    publish_to(&env, "down-later", 1);
    let state = settle(
        &env,
        &pool,
        &consume_args(&stub, "after-commit", &["--max-attempts", "3"]),
        "down-later",
    )
    .await;
    assert_eq!(state, "failed");
    let listed = env.run(&["effects", "--failed", "--json"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&listed.stdout).unwrap();
    assert_eq!(rows.len(), 1, "{listed:?}");
    assert_eq!(rows[0]["attempts"], 3);
    assert!(
        rows[0]["last_error"].as_str().unwrap().contains("503"),
        "{rows:?}"
    );
}

/// One destination's calls take fifteen seconds: with four at once, the other parcels are booked meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_carrier_holds_up_only_its_own_calls() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"delayMs": 15000, "delayDestination": "Slow"}))
        .await;
    publish_to(&env, "Slow", 1);
    common::publish_parcels(&env, &["--count", "40"]);
    let started = Instant::now();
    let mut consumer = env.spawn(&consume_args(
        &stub,
        "keyed",
        &["--carrier-timeout", "25s", "--effect-lease", "40s"],
    ));
    // Committed, not only booked: the stand-in records a booking before it answers, and the message's transaction
    // commits after the answer. The slow one cannot commit before its 15 s, so 40 rows before then are the others.
    let pool = env.pool().await;
    common::eventually("the 40 others booked", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 40
    })
    .await;
    let others = started.elapsed();
    assert!(
        others < Duration::from_secs(15),
        "the others waited for the slow call: {others:?}"
    );
    assert_eq!(
        stub.bookings()
            .await
            .iter()
            .filter(|b| b["destination"] != "Slow")
            .count(),
        40
    );

    common::eventually("the slow one booked", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 41
    })
    .await;
    consumer.terminate();
    consumer.wait(Duration::from_secs(30));
}

/// 2,000 parcels with 30 % duplicates, after-commit against a stand-in that ignores keys, with its look-up; one of
/// two consumers killed every two seconds. Then `effects reconcile`: every parcel booked exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn chaos_after_commit_with_a_lookup_books_every_parcel_once() {
    const PARCELS: usize = 2_000;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &["--ignore-keys"]);
    let url = stub.url.clone();
    let args = consume_args(
        &stub,
        "after-commit",
        &[
            "--lookup-url",
            &url,
            "--prefetch",
            "16",
            LOOK_UP_QUICK[0],
            LOOK_UP_QUICK[1],
            LOOK_UP_QUICK[2],
            LOOK_UP_QUICK[3],
            LOOK_UP_QUICK[4],
            LOOK_UP_QUICK[5],
        ],
    );
    let started = Instant::now();
    let mut consumers: Vec<Proc> = (0..2).map(|_| env.spawn(&args)).collect();
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        &PARCELS.to_string(),
        "--duplicates",
        "0.3",
        "--rate",
        "250",
    ]);
    let mut kills = 0;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let victim = kills % consumers.len();
        consumers[victim].kill();
        kills += 1;
        consumers[victim] = env.spawn(&args);
        if publisher.try_wait().is_some() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the publisher did not finish"
        );
    }
    assert_eq!(publisher.wait(Duration::from_secs(10)), Some(0));
    common::eventually(
        "the queue drained, every effect settled",
        Duration::from_secs(60),
        || async {
            env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && common::count(
                    &pool,
                    "SELECT count(*) FROM inboxctl_effects WHERE state = 'done'",
                )
                .await
                    == PARCELS as i64
        },
    )
    .await;
    for mut c in consumers {
        c.terminate();
        c.wait(Duration::from_secs(30));
    }
    let out = env.run(&[
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &url,
        "--quiet-for",
        "0s",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let seconds = started.elapsed().as_secs_f64();
    let bookings = stub.bookings().await;
    let mut per_parcel: HashMap<String, usize> = HashMap::new();
    for b in &bookings {
        *per_parcel
            .entry(b["parcelId"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    let doubled = per_parcel.values().filter(|&&n| n > 1).count();
    let duplicates = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    eprintln!(
        "effects chaos: {PARCELS} parcels, {} bookings, {doubled} parcels booked twice, {duplicates} duplicates \
         discarded, {kills} kills, {seconds:.1} s",
        bookings.len()
    );
    assert_eq!(
        (per_parcel.len(), doubled),
        (PARCELS, 0),
        "every parcel booked exactly once"
    );
    assert_eq!(bookings.len(), PARCELS);
    let (rows, parcels): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, parcels), (PARCELS as i64, PARCELS as i64));
    assert!(kills >= 4, "only {kills} kills");
}

/// `replay` warns about messages that failed longer ago than a keyed consumer's carrier keeps its keys.
#[tokio::test(flavor = "multi_thread")]
async fn replay_warns_past_the_key_lifetime_of_a_keyed_consumer() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let stub = Stub::start(&env, &["--fail-always"]);
    publish_to(&env, "down", 1);
    common::consume_until_idle(
        &env,
        &consume_args(
            &stub,
            "keyed",
            &["--max-attempts", "1", "--effect-key-ttl", "8s"],
        )[1..],
    );
    let error_queue = format!("{CARRIER_QUEUE}_error");
    assert_eq!(env.queue_counts(&error_queue), (1, 0));
    let fresh = env.run(&["replay", "--from", &error_queue, "--dry-run"]);
    assert!(
        !fresh.stderr.contains("keeps idempotency keys"),
        "{fresh:?}"
    );
    // The key lifetime is well past what the consume and the first dry run take on a loaded machine (3 s was not).
    tokio::time::sleep(Duration::from_millis(8500)).await;
    let old = env.run(&["replay", "--from", &error_queue, "--dry-run"]);
    assert!(old.stderr.contains("keeps idempotency keys"), "{old:?}");
    assert!(old.stderr.contains("messages=1"), "{old:?}");
}

/// A login role with nothing but `grants` (`{role}` standing for it); dropped with what it was granted at the end.
struct Role {
    name: String,
    url: String,
    admin: PgPool,
}

impl Role {
    async fn new(env: &TestEnv, admin: &PgPool, what: &str, grants: &str) -> Self {
        let name = format!("{}_{what}", env.db_name);
        let quoted = common::quote_ident(&name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {quoted} LOGIN; {}",
            grants.replace("{role}", &quoted)
        )))
        .execute(admin)
        .await
        .unwrap();
        let mut url = url::Url::parse(&common::pg_base()).unwrap();
        url.set_username(&name).unwrap();
        url.set_path(&format!("/{}", env.db_name));
        Self {
            name,
            url: url.to_string(),
            admin: admin.clone(),
        }
    }

    fn run(&self, env: &TestEnv, args: &[&str]) -> common::Output {
        common::Output::of(
            env.cmd()
                .env("DATABASE_URL", &self.url)
                .args(args)
                .output()
                .unwrap(),
        )
    }

    async fn grant(&self, grants: &str) {
        let sql = grants.replace("{role}", &common::quote_ident(&self.name));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.admin)
            .await
            .unwrap();
    }

    async fn drop_it(self) {
        let quoted = common::quote_ident(&self.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP OWNED BY {quoted}; DROP ROLE {quoted}"
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }
}

/// docs/security.md's grants for calls outside the database, each command run under exactly them: `consume
/// --carrier-url` refused at start without those on inboxctl_effects, naming them, and working with them; `effects`
/// with SELECT; `effects resolve` with UPDATE and the audit's INSERT; `stats` under its own grants leaves the effect
/// counts out.
#[tokio::test(flavor = "multi_thread")]
async fn the_grants_written_for_calls_outside_the_database_suffice() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let admin = env.pool().await;
    let stub = Stub::start(&env, &["--drop-next", "1"]);
    let consume = Role::new(
        &env,
        &admin,
        "effects_consume",
        "GRANT SELECT, INSERT ON inbox_messages TO {role};
         GRANT INSERT ON carrier_reservations, inboxctl_events, inboxctl_audit TO {role};
         GRANT SELECT, INSERT, UPDATE ON inboxctl_consumers, inboxctl_fingerprints TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON inboxctl_attempts TO {role};",
    )
    .await;
    let args = consume_args(&stub, "at-most-once", &[]);
    let refused = consume.run(&env, &args);
    assert_eq!(refused.code, Some(77), "{refused:?}");
    assert!(
        refused
            .stderr
            .contains("SELECT, INSERT, UPDATE on inboxctl_effects"),
        "{refused:?}"
    );
    consume
        .grant("GRANT SELECT, INSERT, UPDATE ON inboxctl_effects TO {role}")
        .await;
    publish_to(&env, "granted", 1);
    let mut consumer = env.spawn_with(&args, &[("DATABASE_URL", consume.url.as_str())]);
    common::eventually("the call in doubt", Duration::from_secs(30), || async {
        state_of(&admin, "granted").await.as_deref() == Some("in_doubt")
    })
    .await;
    consumer.terminate();
    consumer.wait(Duration::from_secs(30));

    let list = Role::new(
        &env,
        &admin,
        "effects_list",
        "GRANT SELECT ON inboxctl_effects TO {role}",
    )
    .await;
    let listed = list.run(&env, &["effects", "--in-doubt", "--json"]);
    assert_eq!(listed.code, Some(0), "{listed:?}");
    let id = message_of(&admin, "granted").await;
    assert!(listed.stdout.contains(&id.to_string()), "{listed:?}");
    let not_allowed = list.run(&env, &["effects", "resolve", &id.to_string(), "--done"]);
    assert_ne!(not_allowed.code, Some(0), "{not_allowed:?}");
    list.grant(
        "GRANT UPDATE ON inboxctl_effects TO {role}; GRANT INSERT ON inboxctl_audit TO {role}",
    )
    .await;
    let resolved = list.run(&env, &["effects", "resolve", &id.to_string(), "--done"]);
    assert_eq!(resolved.code, Some(0), "{resolved:?}");
    assert!(!resolved.stderr.contains("not audited"), "{resolved:?}");

    // Another call in doubt, settled by `effects reconcile` under exactly its grants: without INSERT on
    // carrier_reservations it fails and the call stays in doubt (its settling rolled back); with it, done.
    stub.behave(json!({"dropNext": 1})).await;
    publish_to(&env, "reconciled", 1);
    let mut consumer = env.spawn_with(&args, &[("DATABASE_URL", consume.url.as_str())]);
    common::eventually(
        "the second call in doubt",
        Duration::from_secs(30),
        || async { state_of(&admin, "reconciled").await.as_deref() == Some("in_doubt") },
    )
    .await;
    consumer.terminate();
    consumer.wait(Duration::from_secs(30));
    let reconcile = Role::new(
        &env,
        &admin,
        "effects_reconcile",
        "GRANT SELECT, UPDATE ON inboxctl_effects TO {role}; GRANT INSERT ON inboxctl_audit TO {role}; \
         GRANT SELECT ON inboxctl_consumers TO {role}",
    )
    .await;
    let reconcile_args = [
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
        "--quiet-for",
        "0s",
        "--json",
    ];
    let refused = reconcile.run(&env, &reconcile_args);
    assert_eq!(refused.code, Some(3), "{refused:?}");
    assert!(
        refused.stderr.contains("carrier_reservations"),
        "{refused:?}"
    );
    assert_eq!(
        state_of(&admin, "reconciled").await.as_deref(),
        Some("in_doubt"),
        "{refused:?}"
    );
    reconcile
        .grant("GRANT INSERT ON carrier_reservations TO {role}")
        .await;
    let reconciled = reconcile.run(&env, &reconcile_args);
    assert_eq!(reconciled.code, Some(0), "{reconciled:?}");
    assert!(!reconciled.stderr.contains("not audited"), "{reconciled:?}");
    assert_eq!(
        state_of(&admin, "reconciled").await.as_deref(),
        Some("done")
    );
    let reserved: i64 =
        sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE message_id = $1")
            .bind(message_of(&admin, "reconciled").await)
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!(reserved, 1, "the booking's reservation written");

    let stats = Role::new(
        &env,
        &admin,
        "effects_stats",
        "GRANT SELECT ON inbox_messages, inboxctl_events, inboxctl_consumers TO {role}",
    )
    .await;
    let out = stats.run(&env, &["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(json["consumers"][0]["effects_in_doubt"].is_null(), "{json}");
    for role in [consume, list, reconcile, stats] {
        role.drop_it().await;
    }
}

/// `--exit-when-idle` on an after-commit consumer whose worker lags behind its commits (a slow carrier, one call at
/// a time): the queue is empty long before the calls are made, and the run ends only once every call owed is made.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_consumer_ends_only_once_every_call_owed_after_its_commits_is_made() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    common::publish_parcels(&env, &["--count", "12"]);
    stub.behave(json!({"delayMs": 300})).await;
    let args = consume_args(&stub, "after-commit", &["--concurrency", "1"]);
    let started = Instant::now();
    let out = common::consume_until_idle(&env, &args[1..]);
    let states = effect_states(&pool).await;
    assert!(
        states == vec![("done".to_owned(), 12)],
        "every call made before the run ended, yet the effects are {states:?}; the consumer said: {}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("waiting for the calls owed after commits"),
        "the wait said: {}",
        out.stderr
    );
    // Twelve calls of 300 ms one at a time: the run cannot have ended sooner.
    assert!(started.elapsed() >= Duration::from_millis(3600), "{out:?}");
    assert_eq!(stub.bookings().await.len(), 12);
}

/// Batched consumers (`--batch-size`) call the carrier too, with one call refused (503): keyed, the calls inside the
/// batch's transaction (all or nothing), made again with the same keys (which the carrier honours); after
/// the commit, the calls a whole batch owes, against a carrier that ignores keys, the refused one made again by the
/// worker. Every parcel booked once, every call done.
#[tokio::test(flavor = "multi_thread")]
async fn batched_consumers_book_every_parcel_once_in_both_modes_with_a_refusal() {
    for (mode, ignore_keys) in [("keyed", false), ("after-commit", true)] {
        let env = TestEnv::migrated().await;
        common::ensure_endpoints(&env).await;
        let pool = env.pool().await;
        let stub = Stub::start(&env, &[]);
        common::publish_parcels(&env, &["--count", "200", "--duplicates", "0.3"]);
        stub.behave(json!({"failNext": 1, "honourKeys": !ignore_keys}))
            .await;
        // Timeouts a loaded machine never reaches: a call timed out is rightly left in doubt, which is not this
        // test's case (a refusal is).
        let args = consume_args(
            &stub,
            mode,
            &[
                "--batch-size",
                "16",
                "--max-attempts",
                "5",
                "--carrier-timeout",
                "10s",
                "--carrier-connect-timeout",
                "5s",
                "--effect-lease",
                "20s",
            ],
        );
        let out = common::consume_until_idle(&env, &args[1..]);
        // The consumer has stopped: every call it owed is done by now, or it is not and never will be.
        let states = effect_states(&pool).await;
        // The states first: a long log is cut at its end when CI shows it.
        assert!(
            states == vec![("done".to_owned(), 200)],
            "{mode}: every call done, yet the effects are {states:?}; the consumer said: {}",
            out.stderr
        );
        assert_eq!(
            stub.behaviour().await["failNext"],
            0,
            "{mode}: the carrier refused a call: {}",
            out.stderr
        );
        if mode == "after-commit" {
            let retried = "SELECT count(*) FROM inboxctl_effects WHERE attempts = 2";
            assert_eq!(
                common::count(&pool, retried).await,
                1,
                "the refused call made again"
            );
        }
        let mut per_parcel: HashMap<String, usize> = HashMap::new();
        for booking in stub.bookings().await {
            *per_parcel
                .entry(booking["parcelId"].as_str().unwrap().to_owned())
                .or_default() += 1;
        }
        assert_eq!(per_parcel.len(), 200, "{mode}");
        let twice: Vec<_> = per_parcel.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "{mode}: booked more than once: {twice:?}");
        assert_eq!(
            common::count(
                &pool,
                "SELECT count(DISTINCT parcel_id) FROM carrier_reservations"
            )
            .await,
            200,
            "{mode}"
        );
        assert_eq!(
            env.queue_counts(CARRIER_QUEUE),
            (0, 0),
            "{mode}: nothing left, nothing held"
        );
    }
}

/// The stand-in carrier's booking is one statement, which the consumer sends with the claim: stopped just before that
/// statement (the `before-commit` point), the consumer holds no transaction open. So does a batched consumer with a
/// message alone: a batch of one goes as the one statement, not as a batch's transaction. A carrier called over HTTP
/// is no statement: its consumer is stopped there inside the claim's transaction (the control, which shows the look
/// would see one).
#[tokio::test(flavor = "multi_thread")]
async fn the_stand_in_carriers_claim_and_booking_go_as_one_statement() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    for (name, args, open) in [
        ("the stand-in", vec!["consume", "carrier"], 0),
        (
            "the stand-in, batched, a message alone",
            vec!["consume", "carrier", "--batch-size", "32"],
            0,
        ),
        ("over HTTP, keyed", consume_args(&stub, "keyed", &[]), 1),
    ] {
        common::publish_parcels(&env, &["--count", "1"]);
        let mut consumer = env.spawn_with(&args, &[("INBOXCTL_FAILPOINTS", "before-commit")]);
        consumer.wait_for_stderr("failpoint before-commit reached", Duration::from_secs(30));
        let in_transaction: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state LIKE 'idle in transaction%'",
        )
        .bind(&env.db_name)
        .fetch_one(&pool)
        .await
        .unwrap();
        consumer.kill();
        assert_eq!(in_transaction, open, "{name}: {}", consumer.stderr());
        // Nothing of the killed attempt remains; the next run (no failpoint) books the parcel.
        common::consume_until_idle(&env, &args[1..]);
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        3
    );
}

/// The consumer's connections to PostgreSQL go silent (a host lost, a network cut: no close, no answer) while the
/// worker of an after-commit consumer leases calls and records their outcomes: each of its statements on a silent
/// connection is given up after `--attempt-timeout` and made again on a new one, so every call owed is made and
/// recorded once. Without the bound, the worker's leasing and records would wait for the TCP timeout (behind this
/// proxy, for ever).
#[tokio::test(flavor = "multi_thread")]
async fn the_worker_goes_on_past_connections_gone_silent() {
    const PARCELS: i64 = 30;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"delayMs": 200})).await;
    let proxy = common::Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    common::publish_parcels(&env, &["--count", &PARCELS.to_string()]);
    let args = consume_args(
        &stub,
        "after-commit",
        &[
            "--concurrency",
            "2",
            "--pool-size",
            "8",
            "--attempt-timeout",
            "3s",
            "--claim-timeout",
            "1s",
        ],
    );
    let consumer = env.spawn_with(&args, &[("DATABASE_URL", proxied.as_str())]);
    common::eventually("a first call recorded", Duration::from_secs(60), || async {
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_effects WHERE state = 'done'",
        )
        .await
            >= 3
    })
    .await;

    proxy.silence();
    let done_then = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_effects WHERE state = 'done'",
    )
    .await;
    assert!(done_then < PARCELS, "the silence must come mid-stream");
    common::eventually(
        "every call owed made and recorded",
        Duration::from_secs(90),
        || async { effect_states(&pool).await == vec![("done".to_owned(), PARCELS)] },
    )
    .await;
    let (rows, parcels): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, parcels), (PARCELS, PARCELS), "{}", consumer.stderr());
    consumer.terminate();
}

/// A stop while the effects worker has a carrier call in flight (the stub answers in 16 s; `--shutdown-timeout 1s`):
/// the process ends within the timeout and a little more, not when the call ends. The call is given up like a crash's:
/// it stays `started` for the next run (what that run does with it is the crash matrices' to prove).
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_with_a_call_in_flight_ends_within_the_shutdown_timeout() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"delayMs": 16000, "delayDestination": "Slow"}))
        .await;
    publish_to(&env, "Slow", 1);
    let mut consumer = env.spawn(&consume_args(
        &stub,
        "after-commit",
        &[
            "--carrier-timeout",
            "20s",
            "--effect-lease",
            "30s",
            "--shutdown-timeout",
            "1s",
        ],
    ));
    let pool = env.pool().await;
    common::eventually("the call under way", Duration::from_secs(30), || async {
        state_of(&pool, "Slow").await.as_deref() == Some("started")
    })
    .await;
    let asked = Instant::now();
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let took = asked.elapsed();
    // Waiting for the call would take the rest of its 16 s; the stop takes 1 s and the process's end (8 s: room for
    // a loaded box).
    assert!(took < Duration::from_secs(8), "stopped in {took:?}");
    assert!(
        consumer
            .stderr()
            .contains("abandoning the carrier calls in flight"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(state_of(&pool, "Slow").await.as_deref(), Some("started"));
}

/// `--exit-when-idle` after commit: a parcel published between the look at the queue that finds it idle and the
/// cancel (held open 3 s by a failpoint) is processed before the exit, and so is the carrier call its commit owes:
/// the process ends with no call owed, as idle means.
#[tokio::test(flavor = "multi_thread")]
async fn a_parcel_arriving_as_the_queue_is_found_idle_has_its_call_made_before_the_exit() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let stub = Stub::start(&env, &[]);
    let mut consumer = env.spawn_with(
        &consume_args(&stub, "after-commit", &["--exit-when-idle", "200ms"]),
        &[("INBOXCTL_FAILPOINTS", "idle-stopping=sleep-once-3000")],
    );
    // Published on a connection opened beforehand: within the 3 s window however slow a new process would start.
    let conn = env.amqp().await;
    consumer.wait_for_stderr("failpoint idle-stopping reached", Duration::from_secs(30));
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "Late");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        state_of(&pool, "Late").await.as_deref(),
        Some("done"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(env.queue_counts(common::CARRIER_QUEUE), (0, 0));
}

/// A call whose outcome is unknown (its connection dropped after the carrier booked) and a look-up that cannot answer
/// (nothing listens at its URL): each attempt asks the look-up first, which fails, and counts as an attempt whose
/// outcome is unknown; after `--max-attempts` the call ends `failed` (listed by `effects --failed`), and an idle run
/// ends. A failed look-up used to leave the call started without counting it, due again for ever: `--exit-when-idle`
/// waited for it for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_look_up_that_keeps_failing_ends_the_call_failed_after_max_attempts() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"dropNext": 1})).await;
    publish_to(&env, "no-look-up", 1);
    let extra = [
        LOOK_UP_QUICK[0],
        LOOK_UP_QUICK[1],
        LOOK_UP_QUICK[2],
        LOOK_UP_QUICK[3],
        LOOK_UP_QUICK[4],
        LOOK_UP_QUICK[5],
        "--lookup-url",
        "http://127.0.0.1:1",
        "--max-attempts",
        "3",
        "--exit-when-idle",
        "1s",
    ];
    let mut consumer = env.spawn(&consume_args(&stub, "after-commit", &extra));
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "the run ended idle: {}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "no-look-up").await.as_deref(),
        Some("failed"),
        "{}",
        consumer.stderr()
    );
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM inboxctl_effects WHERE request->>'destination' = 'no-look-up'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 3);
    let listed = env.run(&["effects", "--failed"]);
    let id = message_of(&pool, "no-look-up").await;
    assert!(listed.stdout.contains(&id.to_string()), "{listed:?}");
    assert!(listed.stdout.contains("look-up failed"), "{listed:?}");
}

/// A trigger on the reservations refusing every row, as an operator's foreign key might: a booking whose outcome can
/// never be recorded.
async fn refuse_every_reservation(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_reservation() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN RAISE EXCEPTION 'no reservation without its parcel'; END$$; \
         CREATE TRIGGER refuse_reservation BEFORE INSERT ON carrier_reservations \
         FOR EACH ROW EXECUTE FUNCTION refuse_reservation();",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// After the commit, a call whose outcome can never be recorded (a trigger on the reservations refusing every row,
/// as a foreign key of the operator's might) was leased again each time its lease ran out and made again, without
/// end, past `--max-attempts`: a carrier that ignores keys booked the parcel every few seconds, and the row stayed
/// `started` with no word of why. It ends `failed` after `--max-attempts` now, not called again.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_whose_outcome_cannot_be_recorded_is_not_made_again_past_max_attempts() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    refuse_every_reservation(&pool).await;
    let stub = Stub::start(&env, &["--ignore-keys"]);
    publish_to(&env, "unrecorded", 1);
    let extra = ["--max-attempts", "3", "--exit-when-idle", "1s"];
    let mut consumer = env.spawn(&consume_args(&stub, "after-commit", &extra));
    assert_eq!(
        consumer.wait(Duration::from_secs(90)),
        Some(0),
        "the run ended idle: {}",
        consumer.stderr()
    );
    assert_eq!(
        stub.bookings_to("unrecorded").await,
        3,
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "unrecorded").await.as_deref(),
        Some("failed"),
        "{}",
        consumer.stderr()
    );
    let listed = env.run(&["effects", "--failed"]);
    assert!(
        listed.stdout.contains("still unknown after 3 attempts"),
        "{listed:?}"
    );
}

/// The same with a look-up: the carrier booked once, the look-up said so at each lease after, and recording the
/// booking was refused each time. The look-up's path returned before `--max-attempts` was looked at: the call stayed
/// `started` for ever, taken again each lease, listed nowhere, and the run never ended idle. It ends `failed` after
/// `--max-attempts` now, with the slot the look-up gave, and the carrier was called once.
#[tokio::test(flavor = "multi_thread")]
async fn a_booked_call_whose_outcome_cannot_be_recorded_ends_failed_past_max_attempts_with_a_look_up()
 {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    refuse_every_reservation(&pool).await;
    let stub = Stub::start(&env, &[]);
    publish_to(&env, "unrecorded", 1);
    let mut extra = LOOK_UP_QUICK.to_vec();
    extra.extend([
        "--lookup-url",
        &stub.url,
        "--max-attempts",
        "2",
        "--exit-when-idle",
        "1s",
    ]);
    let mut consumer = env.spawn(&consume_args(&stub, "after-commit", &extra));
    assert_eq!(
        consumer.wait(Duration::from_secs(90)),
        Some(0),
        "the run ended idle: {}",
        consumer.stderr()
    );
    assert_eq!(
        stub.bookings_to("unrecorded").await,
        1,
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "unrecorded").await.as_deref(),
        Some("failed"),
        "{}",
        consumer.stderr()
    );
    let (attempts, reference): (i32, Option<String>) = sqlx::query_as(
        "SELECT attempts, reference FROM inboxctl_effects WHERE request->>'destination' = 'unrecorded'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 3, "{}", consumer.stderr());
    assert!(reference.is_some(), "the slot the look-up gave is kept");
    let listed = env.run(&["effects", "--failed"]);
    assert!(
        listed
            .stdout
            .contains("could not be recorded in 3 attempts"),
        "{listed:?}"
    );
}

/// A pending at-most-once effect for `consumer_type`, leased once: the attempt as a worker holds it.
async fn leased_once(pool: &PgPool, consumer_type: &str, mode: &str) -> external::Leased {
    let mut conn = pool.acquire().await.unwrap();
    external::insert(
        &mut conn,
        &external::NewEffect {
            message_id: Uuid::now_v7(),
            consumer_type,
            idempotency_key: Uuid::new_v4(),
            mode,
            state: "pending",
            request: r#"{"parcelId":"00000000-0000-0000-0000-000000000000","destination":"fence"}"#,
            attempts: 0,
            reference: None,
        },
    )
    .await
    .unwrap();
    let mut leased = external::lease_due(
        pool,
        consumer_type,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 1);
    leased.remove(0)
}

/// An at-most-once call of `consumer_type` leased once, its outcome unknown: in doubt.
async fn in_doubt_once(pool: &PgPool, consumer_type: &str) -> external::Leased {
    let call = leased_once(pool, consumer_type, "at-most-once").await;
    external::record_outcome(
        pool,
        &call,
        consumer_type,
        &outcome("in_doubt", "no answer"),
    )
    .await
    .unwrap();
    call
}

/// Its lease ran out (the process holding it stalled or died).
async fn lapse(pool: &PgPool, id: Uuid) {
    sqlx::query(
        "UPDATE inboxctl_effects SET lease_until = now() - interval '1 second' WHERE message_id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

fn outcome<'a>(state: &'a str, error: &'a str) -> external::Outcome<'a> {
    external::Outcome {
        state,
        due_in: Some(Duration::ZERO),
        last_error: Some(error),
        reference: None,
    }
}

/// An at-most-once attempt A whose outcome's write stalls past its lease; the call marked in doubt, an operator
/// settles it to be made again (its attempts counted afresh), and attempt B leases it — with A's number. A's late
/// write must not land on B's attempt (it would end B's lease while B's call is in flight, and a third attempt would
/// call beside it); B's own outcome is recorded. The fence used to be the attempt's number alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_late_outcome_never_lands_on_a_later_attempt_with_the_same_number() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let a = leased_once(&pool, "fence", "at-most-once").await;
    lapse(&pool, a.message_id).await;
    assert_eq!(
        external::mark_in_doubt(&pool, "fence", KEY_TTL)
            .await
            .unwrap(),
        1
    );
    let settled = external::settle(&pool, a.message_id, "fence", "pending", None, None, None)
        .await
        .unwrap();
    assert_eq!(settled.as_deref(), Some("in_doubt"));
    let mut leased = external::lease_due(
        &pool,
        "fence",
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    let b = leased.remove(0);
    assert_eq!((b.message_id, b.attempts), (a.message_id, a.attempts));
    let late = external::record_outcome(&pool, &a, "fence", &outcome("pending", "late"))
        .await
        .unwrap();
    assert!(!late, "attempt A's late outcome landed on attempt B");
    let own = external::record_outcome(&pool, &b, "fence", &outcome("pending", "b's own"))
        .await
        .unwrap();
    assert!(own, "attempt B's outcome is recorded");
}

/// `effects reconcile` asks the look-up about an after-commit call whose outcome is unknown (no booking: 404), and,
/// before it settles the call on that answer, a consumer process makes an attempt of its own (held there by a
/// failpoint; the test plays the worker: it leases the call and records its outcome unknown again). The answer is
/// about the call as it was: it must not settle it to be made again — which would count its attempts afresh and
/// have the next attempt book without asking the look-up first, while the worker's call may have booked.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_does_not_settle_a_call_on_an_answer_older_than_its_last_attempt() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let first = leased_once(&pool, CARRIER_QUEUE, "after-commit").await;
    external::record_outcome(
        &pool,
        &first,
        CARRIER_QUEUE,
        &outcome("started", "no answer"),
    )
    .await
    .unwrap();
    lapse(&pool, first.message_id).await;
    let mut reconcile = env.spawn_with(
        &[
            "effects",
            "reconcile",
            "--consumer-type",
            CARRIER_QUEUE,
            "--lookup-url",
            &stub.url,
            "--quiet-for",
            "0s",
            "--json",
        ],
        &[("INBOXCTL_FAILPOINTS", "reconcile-looked=sleep-once-3000")],
    );
    reconcile.wait_for_stderr(
        "failpoint reconcile-looked reached",
        Duration::from_secs(30),
    );
    let mut leased = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    let second = leased.remove(0);
    assert_eq!(second.was, "started");
    let recorded = external::record_outcome(
        &pool,
        &second,
        CARRIER_QUEUE,
        &outcome("started", "no answer"),
    )
    .await
    .unwrap();
    assert!(recorded);
    assert_eq!(
        reconcile.wait(Duration::from_secs(30)),
        Some(0),
        "{}{}",
        reconcile.stdout(),
        reconcile.stderr()
    );
    let (state, attempts): (String, i32) =
        sqlx::query_as("SELECT state, attempts FROM inboxctl_effects WHERE message_id = $1")
            .bind(first.message_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempts),
        ("started", 2),
        "settled on a stale answer: {}",
        reconcile.stdout()
    );
    let said: serde_json::Value = serde_json::from_str(&reconcile.stdout()).unwrap();
    assert_eq!(said[0]["now"], "changed", "{said}");
}

/// `effects reconcile` asks about up to 100,000 calls, each look-up allowed `--timeout`: it heard only a second
/// signal (exit 130, nothing reported of what it had settled). A first SIGTERM ends it now before its next look-up:
/// what it settled is reported and audited, the calls not looked at are left as they were and counted (exit 3).
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_ends_at_the_first_signal_before_its_next_look_up() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let mut owed = Vec::new();
    for destination in ["first", "second", "third"] {
        owed.push(owed_from_an_earlier_run(&pool, destination).await);
    }
    let leased = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 3);
    for call in &leased {
        external::record_outcome(&pool, call, CARRIER_QUEUE, &outcome("started", "no answer"))
            .await
            .unwrap();
    }
    for id in owed {
        lapse(&pool, id).await;
    }
    let mut reconcile = env.spawn_with(
        &[
            "effects",
            "reconcile",
            "--consumer-type",
            CARRIER_QUEUE,
            "--lookup-url",
            &stub.url,
            "--quiet-for",
            "0s",
            "--json",
        ],
        &[("INBOXCTL_FAILPOINTS", "reconcile-looked=sleep-once-3000")],
    );
    reconcile.wait_for_stderr(
        "failpoint reconcile-looked reached",
        Duration::from_secs(30),
    );
    reconcile.terminate();
    assert_eq!(
        reconcile.wait(Duration::from_secs(15)),
        Some(3),
        "{}{}",
        reconcile.stdout(),
        reconcile.stderr()
    );
    assert!(
        reconcile
            .stderr()
            .contains("interrupted: the calls not looked at yet are left as they were"),
        "{}",
        reconcile.stderr()
    );
    let said: serde_json::Value = serde_json::from_str(&reconcile.stdout()).unwrap();
    assert_eq!(said.as_array().map(Vec::len), Some(1), "{said}");
    assert_eq!(said[0]["now"], "pending", "{said}");
    assert_eq!(
        effect_states(&pool).await,
        [("pending".to_owned(), 1), ("started".to_owned(), 2)]
    );
    let (outcome, left): (String, Option<String>) = sqlx::query_as(
        "SELECT outcome, details->>'left' FROM inboxctl_audit WHERE command = 'effects reconcile'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((outcome.as_str(), left.as_deref()), ("partial", Some("2")));
}

/// Two consumer_types calling two carriers, an at-most-once call of each in doubt; `effects reconcile` with the first
/// carrier's look-up and no `--consumer-type` asked it about both, and its 404 for the other carrier's call owed that
/// call again — booked already by the other carrier, it would be booked twice. Refused now (exit 64, nothing
/// settled); with `--consumer-type`, only that one's calls are asked about.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_asks_one_carriers_look_up_only_about_that_carriers_calls() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let mut ids = Vec::new();
    for consumer_type in [CARRIER_QUEUE, "carrier-us"] {
        let call = in_doubt_once(&pool, consumer_type).await;
        ids.push(call.message_id);
    }
    let state = |id: Uuid| stored_state(&pool, id);
    let args = [
        "effects",
        "reconcile",
        "--lookup-url",
        &stub.url,
        "--quiet-for",
        "0s",
    ];
    let refused = env.run(&args);
    assert_eq!(refused.code, Some(64), "{refused:?}");
    assert!(refused.stderr.contains("--consumer-type"), "{refused:?}");
    assert_eq!(state(ids[0]).await, "in_doubt");
    assert_eq!(state(ids[1]).await, "in_doubt");
    let mut one = args.to_vec();
    one.extend(["--consumer-type", CARRIER_QUEUE]);
    let settled = env.run(&one);
    assert_eq!(settled.code, Some(0), "{settled:?}");
    assert_eq!(state(ids[0]).await, "pending");
    assert_eq!(state(ids[1]).await, "in_doubt", "the other carrier's call");
}

/// `resolve --done` on a call no consumer has attempted yet (owed, 0 attempts) is refused, nothing settled: a
/// mistaken message id marked done a call no one had made, and it was never made. `--never-attempted` settles it,
/// when it was booked some other way.
#[tokio::test(flavor = "multi_thread")]
async fn resolve_done_of_a_call_never_attempted_needs_to_be_told_so() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts) \
         VALUES ($1, $2, gen_random_uuid(), 'after-commit', 'pending', '{}', 0)",
    )
    .bind(id)
    .bind(CARRIER_QUEUE)
    .execute(&pool)
    .await
    .unwrap();
    let state = || stored_state(&pool, id);
    let id_text = id.to_string();
    let refused = env.run(&["effects", "resolve", &id_text, "--done"]);
    assert_eq!(refused.code, Some(64), "{refused:?}");
    assert!(refused.stderr.contains("never attempted"), "{refused:?}");
    assert_eq!(state().await, "pending");
    let settled = env.run(&[
        "effects",
        "resolve",
        &id_text,
        "--done",
        "--never-attempted",
    ]);
    assert_eq!(settled.code, Some(0), "{settled:?}");
    assert_eq!(state().await, "done");
}

/// A look-up answers for one carrier: `reconcile` always asks whose calls it settles. With one consumer_type's calls
/// alone to settle, it took the look-up for theirs: a URL of another carrier's answered 404 for each, and owed them
/// all again (an at-most-once call that was booked, made twice).
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_always_asks_whose_calls_the_look_up_answers_for() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let call = in_doubt_once(&pool, "carrier-us").await;
    let out = env.run(&[
        "effects",
        "reconcile",
        "--lookup-url",
        &stub.url,
        "--quiet-for",
        "0s",
    ]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("--consumer-type"), "{out:?}");
    assert_eq!(stored_state(&pool, call.message_id).await, "in_doubt");
}

/// The wait before a 404 owes a call again (`--quiet-for`) was judged on the clock of the machine running `effects
/// reconcile` against times the database wrote: a laptop 15 minutes ahead took a call whose answer never came a
/// moment ago for one quiet 15 minutes, and owed it again while the carrier might still book it. The database's clock
/// judges it now: `recent`, left in doubt. (The process's clock is set ahead by libfaketime.)
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_judges_a_calls_quiet_on_the_databases_clock() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let call = in_doubt_once(&pool, CARRIER_QUEUE).await;
    // The preload works (a library missing is ignored with a word, the clocks then agreeing: the test would prove
    // nothing): a child's clock is 15 minutes ahead.
    let ahead = std::process::Command::new("date")
        .arg("+%s")
        .env("LD_PRELOAD", common::LIBFAKETIME)
        .env("FAKETIME", "+15m")
        .output()
        .unwrap();
    let child: i64 = String::from_utf8_lossy(&ahead.stdout)
        .trim()
        .parse()
        .unwrap();
    let gap = child - chrono::Utc::now().timestamp();
    assert!(
        (14 * 60..16 * 60).contains(&gap),
        "libfaketime did not set the clock ahead: {ahead:?}"
    );
    let out = common::Output::of(
        env.cmd()
            .env("LD_PRELOAD", common::LIBFAKETIME)
            .env("FAKETIME", "+15m")
            .args([
                "effects",
                "reconcile",
                "--consumer-type",
                CARRIER_QUEUE,
                "--lookup-url",
                &stub.url,
                "--json",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(out.code, Some(3), "{out:?}");
    let said: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(said[0]["now"], "recent", "{said}");
    assert_eq!(stored_state(&pool, call.message_id).await, "in_doubt");
}

/// Two calls in doubt, quiet for an hour, the carrier (its look-up) has no booking under either key; one was written
/// 3 hours ago, past the 2 hours its consumer registered as how long the carrier keeps keys (`--effect-key-ttl`).
/// `effects reconcile` owes the young one again, and leaves the old one in doubt (`expired`, exit 3): the carrier may
/// have forgotten that key and what it booked under it. It used to owe both again, and the old one could be booked
/// twice.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_does_not_owe_again_a_call_whose_key_the_carrier_may_have_forgotten() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let mut calls = Vec::new();
    for _ in 0..2 {
        let call = in_doubt_once(&pool, CARRIER_QUEUE).await;
        calls.push(call.message_id);
    }
    let (old, young) = (calls[0], calls[1]);
    sqlx::query(
        "UPDATE inboxctl_effects SET updated_at = now() - interval '1 hour', lease_until = now() - interval '1 hour',
                created_at = CASE WHEN message_id = $1 THEN now() - interval '3 hours' ELSE created_at END",
    )
    .bind(old)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at, effect_mode, effect_key_ttl)
         VALUES ($1, $1, now(), now(), 'at-most-once', interval '2 hours')",
    )
    .bind(CARRIER_QUEUE)
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&[
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
        "--json",
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(out.stderr.contains("--effect-key-ttl"), "{}", out.stderr);
    let said: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let now_of = |id: Uuid| {
        said.as_array()
            .unwrap()
            .iter()
            .find(|r| r["message_id"] == id.to_string())
            .map(|r| r["now"].clone())
    };
    assert_eq!(now_of(old), Some(json!("expired")), "{said}");
    assert_eq!(now_of(young), Some(json!("pending")), "{said}");
    assert_eq!(stored_state(&pool, old).await, "in_doubt");
    assert_eq!(stored_state(&pool, young).await, "pending");
}

/// `effects reconcile` looks at the oldest 100,000 calls of a run, and said nothing of the rest: exit 0, as if all
/// were settled. Past that many it says so, and ends partial (exit 3): the rest are for the next run. (Here the
/// 100,001 are leased by a live process, so that none is looked up: the count is what is tested.)
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_says_when_more_calls_are_to_settle_than_one_run_looks_at() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    sqlx::query(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, lease_until)
         SELECT gen_random_uuid(), $1, gen_random_uuid(), 'after-commit', 'started', '{}', 1, now() + interval '1 hour'
         FROM generate_series(1, 100001)",
    )
    .bind(CARRIER_QUEUE)
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&[
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(out.stderr.contains("run again for the rest"), "{out:?}");
}

/// A 404 about a call whose answer never came, asked right after it: the carrier may still be working on the
/// request and book after the look-up. `effects reconcile` leaves such a call as it was (`recent`, exit 3) until its
/// last attempt is `--quiet-for` old (10 minutes by default); only then is it owed again. Owed at once, the next
/// consumer would call a second time — two bookings wherever the carrier does not honour keys.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_does_not_owe_again_a_call_the_carrier_may_still_be_making() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let call = in_doubt_once(&pool, CARRIER_QUEUE).await;
    let args = [
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
        "--json",
    ];
    let early = env.run(&args);
    assert_eq!(early.code, Some(3), "{early:?}");
    let said: serde_json::Value = serde_json::from_str(&early.stdout).unwrap();
    assert_eq!(said[0]["now"], "recent", "{said}");
    assert!(early.stderr.contains("run again later"), "{early:?}");
    let state = |pool: PgPool| async move { stored_state(&pool, call.message_id).await };
    assert_eq!(state(pool.clone()).await, "in_doubt");
    // Its last change long ago, but the lease it was made under ended a minute ago: still too recent.
    sqlx::query(
        "UPDATE inboxctl_effects SET updated_at = now() - interval '11 minutes', lease_until = now() - interval '1 minute'
         WHERE message_id = $1",
    )
    .bind(call.message_id)
    .execute(&pool)
    .await
    .unwrap();
    let leased = env.run(&args);
    assert_eq!(leased.code, Some(3), "{leased:?}");
    assert_eq!(state(pool.clone()).await, "in_doubt");
    sqlx::query(
        "UPDATE inboxctl_effects SET updated_at = now() - interval '11 minutes', lease_until = now() - interval '11 minutes'
         WHERE message_id = $1",
    )
    .bind(call.message_id)
    .execute(&pool)
    .await
    .unwrap();
    let later = env.run(&args);
    assert_eq!(later.code, Some(0), "{later:?}");
    assert_eq!(state(pool.clone()).await, "pending", "{later:?}");
}

/// A lease whose answer comes late (PostgreSQL slow to answer it: here a trigger holds the lease's statement 2 s of
/// its 3 s lease, once): no call is started that could not end within it (2.5 s, the carrier's timeouts). The call
/// used to be made anyway and still be in flight when the lease ran out; the next look leased the effect again and
/// made a second call beside the first — two bookings with a carrier that ignores keys, with no crash at all.
#[tokio::test(flavor = "multi_thread")]
async fn no_call_is_started_on_a_lease_too_short_for_it() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"honourKeys": false, "delayMs": 1500}))
        .await;
    sqlx::raw_sql(
        "CREATE TABLE slow_once (x int);
         INSERT INTO slow_once VALUES (1);
         CREATE FUNCTION slow_lease() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.state = 'pending' AND NEW.state = 'started' THEN
                 DELETE FROM slow_once;
                 IF FOUND THEN PERFORM pg_sleep(2); END IF;
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow_lease BEFORE UPDATE ON inboxctl_effects
             FOR EACH ROW EXECUTE FUNCTION slow_lease();",
    )
    .execute(&pool)
    .await
    .unwrap();
    owed_from_an_earlier_run(&pool, "late-lease").await;
    let mut consumer = env.spawn(&consume_args(
        &stub,
        "after-commit",
        &["--exit-when-idle", "2s"],
    ));
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "late-lease").await.as_deref(),
        Some("done"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        stub.bookings_to("late-lease").await,
        1,
        "{}",
        consumer.stderr()
    );
    assert!(
        consumer.stderr().contains("lease came too late"),
        "{}",
        consumer.stderr()
    );
    // The lease that came too late is not counted an attempt: the call was made once, on the next lease.
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM inboxctl_effects WHERE request->>'destination' = 'late-lease'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 1, "{}", consumer.stderr());
}

/// An at-most-once call refused once (a 503: nothing booked), made again, and its process gone before the second
/// attempt's outcome was recorded: in doubt, said so — not with the first attempt's 503, which would tell an operator
/// that nothing was booked and invite a `resolve --retry` that books twice. A new attempt used to keep the last one's
/// error.
#[tokio::test(flavor = "multi_thread")]
async fn an_attempt_in_doubt_is_not_shown_with_an_earlier_attempts_refusal() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let id = owed_from_an_earlier_run(&pool, "stale-error").await;
    sqlx::query("UPDATE inboxctl_effects SET mode = 'at-most-once' WHERE message_id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let lease = Duration::from_secs(30);
    let first = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        lease,
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(first.len(), 1);
    assert!(
        external::record_outcome(
            &pool,
            &first[0],
            CARRIER_QUEUE,
            &outcome("pending", "carrier API returned 503 Service Unavailable"),
        )
        .await
        .unwrap()
    );
    let second = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        lease,
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(second.len(), 1, "the refused call is made again");
    // The process making the second call dies; its lease runs out.
    lapse(&pool, id).await;
    assert_eq!(
        external::mark_in_doubt(&pool, CARRIER_QUEUE, KEY_TTL)
            .await
            .unwrap(),
        1
    );
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM inboxctl_effects WHERE message_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "in_doubt");
    let error = error.unwrap_or_default();
    assert!(!error.contains("503"), "{error}");
    assert!(error.contains("ended before its outcome"), "{error}");

    // After the commit, a call whose outcome is unknown keeps saying so when it is leased again: what is still not
    // known is not cleared with the lease.
    let unknown = owed_from_an_earlier_run(&pool, "unknown-kept").await;
    let first = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        lease,
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(first.len(), 1);
    assert!(
        external::record_outcome(
            &pool,
            &first[0],
            CARRIER_QUEUE,
            &outcome(
                "started",
                "no answer from the carrier within --carrier-timeout"
            ),
        )
        .await
        .unwrap()
    );
    lapse(&pool, unknown).await;
    let again = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        lease,
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(again.len(), 1);
    let error: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM inboxctl_effects WHERE message_id = $1")
            .bind(unknown)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        error.as_deref().unwrap_or_default().contains("no answer"),
        "{error:?}"
    );
}

/// At most once, a gateway's 504 (or a 500) leaves the outcome unknown — the carrier behind the gateway may have
/// booked — so the call is listed in doubt and not made again; a 503 booked nothing, so it is made again. Both 5xx
/// were taken for "nothing booked" before: a call answered 504 was made a second time; so was one answered with a
/// redirect (`303 See Other`, the booking made).
#[tokio::test(flavor = "multi_thread")]
async fn at_most_once_a_gateways_504_is_in_doubt_and_a_503_is_made_again() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"failNext": 1, "failStatus": 504})).await;
    publish_to(&env, "gateway-504", 1);
    let got = settle(
        &env,
        &pool,
        &consume_args(&stub, "at-most-once", &[]),
        "gateway-504",
    )
    .await;
    assert_eq!(got, "in_doubt");
    assert_eq!(stub.bookings_to("gateway-504").await, 0, "not made again");
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM inboxctl_effects WHERE request->>'destination' = 'gateway-504'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(error.contains("504"), "{error}");

    stub.behave(json!({"failNext": 1})).await;
    publish_to(&env, "unavailable-503", 1);
    let got = settle(
        &env,
        &pool,
        &consume_args(&stub, "at-most-once", &[]),
        "unavailable-503",
    )
    .await;
    assert_eq!(got, "done");
    assert_eq!(stub.bookings_to("unavailable-503").await, 1);

    // Booked, and answered with a redirect to the booking (post, then redirect): no refusal, in doubt.
    stub.behave(json!({"redirectNext": 1})).await;
    publish_to(&env, "redirected-303", 1);
    let got = settle(
        &env,
        &pool,
        &consume_args(&stub, "at-most-once", &[]),
        "redirected-303",
    )
    .await;
    assert_eq!(got, "in_doubt");
    assert_eq!(
        stub.bookings_to("redirected-303").await,
        1,
        "not made again"
    );
}

/// A carrier that books and answers with a body of megabytes (here 4 MiB; a stream without end would be the same):
/// the consumer reads at most 64 KiB of it and takes the outcome for unknown (at most once: in doubt, listed with
/// why). It read the whole body, whatever its size, before looking at it: a body of gigabytes filled the process's
/// memory, and an after-commit call the next process took over was read again, for ever.
#[tokio::test(flavor = "multi_thread")]
async fn an_answer_of_megabytes_is_not_read_whole_and_leaves_the_outcome_unknown() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    stub.behave(json!({"paddedNext": 1})).await;
    publish_to(&env, "answered-at-length", 1);
    let got = settle(
        &env,
        &pool,
        &consume_args(&stub, "at-most-once", &[]),
        "answered-at-length",
    )
    .await;
    assert_eq!(got, "in_doubt");
    assert_eq!(stub.bookings_to("answered-at-length").await, 1);
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM inboxctl_effects WHERE request->>'destination' = 'answered-at-length'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(error.contains("more than 64 KiB"), "{error}");
}

/// A call an earlier after-commit run made and whose outcome it never learnt (started, its lease run out).
async fn left_unknown_by_an_earlier_run(pool: &PgPool, destination: &str) -> Uuid {
    let id = owed_from_an_earlier_run(pool, destination).await;
    let leased = external::lease_due(
        pool,
        CARRIER_QUEUE,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 1);
    external::record_outcome(
        pool,
        &leased[0],
        CARRIER_QUEUE,
        &outcome("started", "no answer"),
    )
    .await
    .unwrap();
    lapse(pool, id).await;
    id
}

/// A call owed after a commit of an earlier after-commit run (pending: that run stopped before making it).
async fn owed_from_an_earlier_run(pool: &PgPool, destination: &str) -> Uuid {
    let id = Uuid::now_v7();
    let request = json!({
        "parcelId": Uuid::new_v4(),
        "trackingNumber": "PT-OWED",
        "destination": destination,
    })
    .to_string();
    let mut conn = pool.acquire().await.unwrap();
    external::insert(
        &mut conn,
        &external::NewEffect {
            message_id: id,
            consumer_type: CARRIER_QUEUE,
            idempotency_key: Uuid::new_v4(),
            mode: "after-commit",
            state: "pending",
            request: &request,
            attempts: 0,
            reference: None,
        },
    )
    .await
    .unwrap();
    id
}

/// A keyed run started with nothing owed, and a call owed after it started (an operator's `effects resolve --retry`,
/// the drain of an after-commit run stopping beside it in a rolling deploy): the running consumer makes it. Its
/// worker used to run only when calls were owed at start, and the call stayed owed with nobody to make it.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_owed_after_a_keyed_run_started_is_made_by_it() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let consumer = env.spawn(&consume_args(&stub, "keyed", &[]));
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    owed_from_an_earlier_run(&pool, "owed-later").await;
    common::eventually(
        "the call owed after the start made",
        Duration::from_secs(20),
        || async { state_of(&pool, "owed-later").await.as_deref() == Some("done") },
    )
    .await;
    assert_eq!(stub.bookings_to("owed-later").await, 1);
    consumer.terminate();
}

/// An after-commit run stopped with a call still owed, and the consumer restarted in keyed mode (the default): the
/// call is made by the new run (its worker takes the calls earlier runs owe), and `--exit-when-idle` waits for it.
/// With the stand-in carrier, which cannot make it, the run says so. The call used to be left owed for good, the
/// keyed run ending idle at once.
#[tokio::test(flavor = "multi_thread")]
async fn calls_owed_by_an_earlier_run_in_another_mode_are_made_or_said() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    owed_from_an_earlier_run(&pool, "owed-keyed").await;
    let args = consume_args(&stub, "keyed", &["--exit-when-idle", "1s"]);
    // Its first call takes 2 s (a failpoint before the request) and is refused (503): in flight when the queue is
    // first found idle, and owed again after. The run waits for both.
    stub.behave(json!({"failNext": 1})).await;
    let mut consumer = env.spawn_with(
        &args,
        &[(
            "INBOXCTL_FAILPOINTS",
            "effect-after-intent=sleep-once-2000@owed-keyed",
        )],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "owed-keyed").await.as_deref(),
        Some("done"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(stub.bookings_to("owed-keyed").await, 1);
    // A call whose outcome is unknown (started, its lease run out), which the after-commit run that left it might
    // have looked up: the keyed run, which has no look-up, leaves it and says so, and does not wait for it.
    // Beside one pending, which this run makes: its worker runs.
    makes_the_owed_and_leaves_the_unknown(
        &env,
        &pool,
        &stub,
        &args,
        "owed-keyed-again",
        "owed-unknown",
    )
    .await;

    owed_from_an_earlier_run(&pool, "owed-stand-in").await;
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert!(
        out.stderr.contains("cannot make them"),
        "the stand-in says what it cannot do: {}",
        out.stderr
    );
    assert_eq!(
        state_of(&pool, "owed-stand-in").await.as_deref(),
        Some("pending")
    );
}

/// After commit with a look-up, against a carrier that ignores keys behind a gateway: the gateway answers 504 at once
/// while the carrier books 1.5 s later. The call's outcome is unknown; its look-up waits `--lookup-quiet` (5 s here),
/// finds the booking and settles the call: one booking. Asked at once (after the retry's 200 ms), the look-up
/// answered 404 and the call was made again: two bookings, with no crash at all.
#[tokio::test(flavor = "multi_thread")]
async fn after_commit_asks_the_look_up_only_once_a_call_a_gateway_gave_up_on_has_been_quiet() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &["--ignore-keys"]);
    stub.behave(json!({"honourKeys": false, "bookLateNext": 1, "bookLateMs": 1500}))
        .await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "booked-late"]);
    let url = stub.url.clone();
    let args = consume_args(
        &stub,
        "after-commit",
        &[
            "--lookup-url",
            &url,
            LOOK_UP_QUICK[0],
            LOOK_UP_QUICK[1],
            LOOK_UP_QUICK[2],
            LOOK_UP_QUICK[3],
            "--lookup-quiet",
            "5s",
            "--exit-when-idle",
            "1s",
        ],
    );
    let mut consumer = env.spawn(&args);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    // The carrier's late booking lands 1.5 s after the call: counted after it, however soon the run ended.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        stub.bookings_to("booked-late").await,
        1,
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "booked-late").await.as_deref(),
        Some("done")
    );
}

/// After commit with a look-up, against a carrier that ignores keys behind a proxy: the carrier books, its connection
/// to the proxy is reset before it answers, and the proxy answers `503` with a page of its own. A 503 was taken for
/// "nothing booked" and the call made again: two bookings. Then a look-up whose `404` is the proxy's (no route), not
/// the carrier's: taken for "nothing booked", the call was made again too. Neither is the carrier's answer now: the
/// outcome stays unknown until the look-up (the carrier's own) finds the booking — one booking.
#[tokio::test(flavor = "multi_thread")]
async fn after_commit_takes_neither_a_proxys_503_nor_its_404_for_nothing_booked() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &["--ignore-keys"]);
    stub.behave(json!({"honourKeys": false, "proxyResetNext": 1, "lookupUnroutedNext": 1}))
        .await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "behind-a-proxy"]);
    let url = stub.url.clone();
    let args = consume_args(
        &stub,
        "after-commit",
        &[
            "--lookup-url",
            &url,
            LOOK_UP_QUICK[0],
            LOOK_UP_QUICK[1],
            LOOK_UP_QUICK[2],
            LOOK_UP_QUICK[3],
            LOOK_UP_QUICK[4],
            LOOK_UP_QUICK[5],
            "--exit-when-idle",
            "1s",
        ],
    );
    let mut consumer = env.spawn(&args);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        stub.bookings_to("behind-a-proxy").await,
        1,
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        state_of(&pool, "behind-a-proxy").await.as_deref(),
        Some("done")
    );
    assert!(
        consumer.stderr().contains("without the carrier's JSON"),
        "{}",
        consumer.stderr()
    );
}

/// An after-commit run (with a look-up, say) leaves a call whose outcome is unknown (started, its lease run out), and
/// the consumer is restarted at most once: that run does not make it again (it may have been booked: a second
/// booking is what at-most-once promises never to make), says so, and still makes a call merely owed. It made both,
/// the unknown one blind.
#[tokio::test(flavor = "multi_thread")]
async fn an_at_most_once_run_does_not_make_again_a_call_an_after_commit_run_left_unknown() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let args = consume_args(&stub, "at-most-once", &["--exit-when-idle", "1s"]);
    makes_the_owed_and_leaves_the_unknown(
        &env,
        &pool,
        &stub,
        &args,
        "left-pending",
        "left-unknown",
    )
    .await;
}

/// Two after-commit calls whose outcome an earlier run never learnt (started, the lease run out), one written longer
/// ago than the carrier keeps a key (`--effect-key-ttl`), the other within it. Sent again, the old one's key may be
/// forgotten, and the carrier would book it twice: the run puts it in doubt, saying why, and makes the other again.
/// Before, it sent both again (and a look-up by a forgotten key answers 404 too).
#[tokio::test(flavor = "multi_thread")]
async fn an_after_commit_call_older_than_its_keys_lifetime_is_put_in_doubt_not_sent_again() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let old = owed_from_an_earlier_run(&pool, "left-long-ago").await;
    let lately = owed_from_an_earlier_run(&pool, "left-lately").await;
    let leased = external::lease_due(
        &pool,
        CARRIER_QUEUE,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 2);
    for effect in &leased {
        external::record_outcome(
            &pool,
            effect,
            CARRIER_QUEUE,
            &outcome("started", "no answer"),
        )
        .await
        .unwrap();
    }
    lapse(&pool, old).await;
    lapse(&pool, lately).await;
    sqlx::query(
        "UPDATE inboxctl_effects SET created_at = now() - interval '2 hours' WHERE message_id = $1",
    )
    .bind(old)
    .execute(&pool)
    .await
    .unwrap();
    let args = consume_args(
        &stub,
        "after-commit",
        &["--effect-key-ttl", "1h", "--exit-when-idle", "1s"],
    );
    let mut consumer = env.spawn(&args);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(stub.bookings_to("left-lately").await, 1);
    assert_eq!(stub.bookings_to("left-long-ago").await, 0, "not sent again");
    let (state, error): (String, String) =
        sqlx::query_as("SELECT state, last_error FROM inboxctl_effects WHERE message_id = $1")
            .bind(old)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "in_doubt");
    assert!(error.contains("--effect-key-ttl"), "{error}");
    assert!(error.contains("no answer"), "the last error kept: {error}");
}

/// A call owed (to `owed`) and one left unknown (to `unknown`) by an earlier run; a run of `args` (ending when idle)
/// makes the owed one, leaves the unknown one started, not made again, and says so.
async fn makes_the_owed_and_leaves_the_unknown(
    env: &TestEnv,
    pool: &PgPool,
    stub: &Stub,
    args: &[&str],
    owed: &str,
    unknown: &str,
) {
    left_unknown_by_an_earlier_run(pool, unknown).await;
    owed_from_an_earlier_run(pool, owed).await;
    let mut consumer = env.spawn(args);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(
        consumer.stderr().contains("does not make them again"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(stub.bookings_to(owed).await, 1);
    assert_eq!(stub.bookings_to(unknown).await, 0, "not made again");
    assert_eq!(state_of(pool, unknown).await.as_deref(), Some("started"));
}

/// Keyed and batched, against a carrier that ignores keys: one member's call fails (its answer later than
/// `--carrier-timeout`), and the batch is done again without it, the others' work run again in each round. Each other
/// parcel is booked once: a call made again for a key takes the slot the carrier gave this process for it. Before,
/// each was booked once a round (up to four times), with no crash.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_done_again_books_its_other_members_once_with_a_carrier_ignoring_keys() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    publish_to(&env, "Berlin", 3);
    publish_to(&env, "SLOW", 1);
    publish_to(&env, "Hamburg", 3);
    stub.behave(json!({"honourKeys": false, "delayDestination": "SLOW", "delayMs": 2500}))
        .await;
    let args = consume_args(
        &stub,
        "keyed",
        &[
            "--batch-size",
            "8",
            "--carrier-timeout",
            "1s",
            "--max-attempts",
            "1",
            "--concurrency",
            "1",
            "--exit-when-idle",
            "1s",
        ],
    );
    // The batch worker's first look at its queue waits 1.5 s, so that all seven are one batch, in publish order: the
    // three to Berlin before SLOW, whose work is run again in every round.
    let mut consumer = env.spawn_with(
        &args,
        &[("INBOXCTL_FAILPOINTS", "batch-next=sleep-once-1500")],
    );
    assert_eq!(consumer.wait(Duration::from_secs(90)), Some(0));
    let stderr = consumer.stderr();
    let mut per_parcel: HashMap<String, (String, usize)> = HashMap::new();
    for booking in stub.bookings().await {
        per_parcel
            .entry(booking["parcelId"].as_str().unwrap().to_owned())
            .or_insert_with(|| (booking["destination"].as_str().unwrap_or("").to_owned(), 0))
            .1 += 1;
    }
    let twice: Vec<_> = per_parcel
        .values()
        .filter(|(destination, n)| destination != "SLOW" && *n != 1)
        .collect();
    assert!(
        twice.is_empty() && per_parcel.len() == 7,
        "each parcel but SLOW's booked once: {per_parcel:?}; {}",
        stderr
    );
    // SLOW's own call, which fails, is made in the batch's together work and once alone, where its failure is seen
    // as its own (the transaction still open after it), not a third time in a round that looks after each member.
    let slow = per_parcel
        .values()
        .find(|(d, _)| d == "SLOW")
        .map(|(_, n)| *n);
    assert_eq!(slow, Some(2), "{per_parcel:?}; {}", stderr);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        6,
        "{}",
        stderr
    );
}

/// `effects resolve --retry` owed again at once a call whose answer was lost a moment ago: an operator who looked at
/// the carrier's bookings right after the timeout saw none yet, and the call was made again while the carrier was
/// still booking the first — two bookings with a carrier that ignores keys. As `effects reconcile` does, it now waits
/// for the call's last attempt to be `--quiet-for` old (10 minutes by default), judged on the database's clock.
#[tokio::test(flavor = "multi_thread")]
async fn resolve_retry_waits_for_a_calls_last_attempt_to_be_quiet() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let call = in_doubt_once(&pool, CARRIER_QUEUE).await;
    let id = call.message_id.to_string();
    let early = env.run(&["effects", "resolve", &id, "--retry"]);
    assert_eq!(early.code, Some(64), "{early:?}");
    assert!(
        early.stderr.contains("less than --quiet-for 10m"),
        "{early:?}"
    );
    let state = || stored_state(&pool, call.message_id);
    assert_eq!(state().await, "in_doubt");
    let told = env.run(&["effects", "resolve", &id, "--retry", "--quiet-for", "0s"]);
    assert_eq!(told.code, Some(0), "{told:?}");
    assert_eq!(state().await, "pending");
}

/// `effects resolve` settles the effect as it read it: one a consumer's worker changed in between (its lease ran out
/// when read; leased again, the call made, recorded failed) is left as it is now, and the command says so. A `--retry`
/// used to owe such a call again — made blind a second time, the look-up skipped for a call owed — and the audit
/// recorded "started → pending".
#[tokio::test(flavor = "multi_thread")]
async fn a_resolve_leaves_an_effect_a_worker_changed_since_it_was_read() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, \
         lease_until, updated_at) \
         VALUES ($1, $2, $3, 'after-commit', 'started', '{}', 1, now() - interval '1 minute', now() - interval '1 minute')",
    )
    .bind(id)
    .bind(CARRIER_QUEUE)
    .bind(Uuid::new_v4())
    .execute(&pool)
    .await
    .unwrap();
    let mut resolve = env.spawn_with(
        &[
            "effects",
            "resolve",
            &id.to_string(),
            "--retry",
            "--quiet-for",
            "0s",
        ],
        &[("INBOXCTL_FAILPOINTS", "resolve-read=sleep-once-3000")],
    );
    resolve.wait_for_stderr("failpoint resolve-read reached", Duration::from_secs(30));
    // A worker leases it again, makes the call, and records its unknown outcome on its last attempt.
    sqlx::query(
        "UPDATE inboxctl_effects SET state = 'failed', attempts = attempts + 1, lease_until = NULL, \
         updated_at = now() WHERE message_id = $1",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    let code = resolve.wait(Duration::from_secs(30));
    assert_ne!(code, Some(0), "{}", resolve.stderr());
    assert!(
        resolve.stderr().contains("changed while this command ran"),
        "{}",
        resolve.stderr()
    );
    assert_eq!(
        stored_state(&pool, id).await,
        "failed",
        "left as the worker left it"
    );
}

/// `effects reconcile` whose settle of one call fails (here a trigger refusing its update; a role without INSERT on
/// the reservations does the same) reports that call with why, and goes on: the calls settled before and after it
/// stay settled, are printed and audited, and the run ends partial (exit 3). The failure used to end the command
/// with an error and nothing printed, the audit row holding no count, while an earlier call had been owed again.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_reports_what_it_settled_when_one_settle_fails() {
    let (_env, pool, ids, _, report) = reconciled_with_the_middle_refused("P0001").await;
    let refused = ids[1];
    let now_of = |id: Uuid| {
        report
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["message_id"] == id.to_string())
            .unwrap_or_else(|| panic!("{id} reported: {report:#}"))
            .clone()
    };
    assert_eq!(now_of(ids[0])["now"], "pending", "{report:#}");
    assert_eq!(now_of(ids[2])["now"], "pending", "{report:#}");
    let failed = now_of(refused);
    assert_eq!(failed["now"], "unknown", "{report:#}");
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("refused by the test"),
        "{report:#}"
    );
    let states: Vec<String> = sqlx::query_scalar(
        "SELECT state FROM inboxctl_effects WHERE message_id = ANY($1) ORDER BY message_id",
    )
    .bind(&ids)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(states, ["pending", "started", "pending"]);
    let details: serde_json::Value = sqlx::query_scalar(
        "SELECT details FROM inboxctl_audit WHERE command = 'effects reconcile'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(details["pending"], 2, "{details}");
}

/// `effects reconcile --json` (exit 3) over three calls the carrier has no booking for, the update of the middle one
/// refused by a trigger with SQLSTATE `code` ("refused by the test"): the test's database (kept while it lives), its
/// pool, the ids, the run and its report.
async fn reconciled_with_the_middle_refused(
    code: &str,
) -> (
    TestEnv,
    PgPool,
    Vec<Uuid>,
    common::Output,
    serde_json::Value,
) {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let stub = Stub::start(&env, &[]);
    let ids = three_calls_left_unknown(&pool).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.message_id = '{}' THEN RAISE EXCEPTION 'refused by the test' USING ERRCODE = '{code}'; END IF; \
           RETURN NEW; END $$; \
         CREATE TRIGGER refuse_one BEFORE UPDATE ON inboxctl_effects FOR EACH ROW EXECUTE FUNCTION refuse_one();",
        ids[1]
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&[
        "effects",
        "reconcile",
        "--consumer-type",
        CARRIER_QUEUE,
        "--lookup-url",
        &stub.url,
        "--quiet-for",
        "0s",
        "--json",
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    (env, pool, ids, out, report)
}

/// Three after-commit calls whose lease ran out after an attempt with no answer, their ids in order.
async fn three_calls_left_unknown(pool: &PgPool) -> Vec<Uuid> {
    let mut conn = pool.acquire().await.unwrap();
    for _ in 0..3 {
        external::insert(
            &mut conn,
            &external::NewEffect {
                message_id: Uuid::now_v7(),
                consumer_type: CARRIER_QUEUE,
                idempotency_key: Uuid::new_v4(),
                mode: "after-commit",
                state: "pending",
                request: r#"{"parcelId":"00000000-0000-0000-0000-000000000000","destination":"three"}"#,
                attempts: 0,
                reference: None,
            },
        )
        .await
        .unwrap();
    }
    drop(conn);
    let leased = external::lease_due(
        pool,
        CARRIER_QUEUE,
        Duration::from_secs(30),
        10,
        false,
        Duration::ZERO,
        KEY_TTL,
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 3);
    let mut ids = Vec::new();
    for call in &leased {
        external::record_outcome(pool, call, CARRIER_QUEUE, &outcome("started", "no answer"))
            .await
            .unwrap();
        lapse(pool, call.message_id).await;
        ids.push(call.message_id);
    }
    ids.sort();
    ids
}

/// `effects reconcile` whose settle meets the database going away (here the middle call's update answered as by a
/// server shutting down, 57P01) stops there, what it did reported: it does not go on asking the carrier about every
/// other call, each settle then failing after its pool's wait, for nothing it could record.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_stops_when_the_database_goes() {
    let (_env, _, _, out, report) = reconciled_with_the_middle_refused("57P01").await;
    let reported: Vec<&str> = report
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["now"].as_str().unwrap())
        .collect();
    assert_eq!(reported, ["pending", "unknown"], "{report:#}");
    assert!(out.stderr.contains("reconcile stops here"), "{out:?}");
}
