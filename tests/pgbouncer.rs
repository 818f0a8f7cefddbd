//! Through a real PgBouncer (Debian's, 1.18) in transaction pooling, in front of the shared PostgreSQL: `consume`,
//! `cleanup`, `stats`, `top` and the triage commands with `--transaction-pooling` (eight consumer processes of sixteen
//! workers on ten server connections, every parcel once), and every command refused, naming the flag, without it.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use common::{CARRIER_QUEUE, Output, PgBouncer, Proc, TestEnv, Tmux};
use sqlx::postgres::{PgPool, PgPoolOptions};

const PARCELS: i64 = 3_000;
const PROCESSES: usize = 8;
const SERVER_CONNECTIONS: u32 = 10;

/// The test's own look at its database, directly (not through the pooler), under a name the count of the pooler's
/// sessions leaves out.
const OBSERVER: &str = "inboxctl-test-observer";

async fn observer(env: &TestEnv) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(&format!("{}?application_name={OBSERVER}", env.database_url))
        .await
        .expect("connect to the test database")
}

/// Runs inboxctl `args` through `bouncer`, `pooling` saying whether it is told (by the flag's environment variable,
/// which `consume` below gives as the flag itself).
fn through(env: &TestEnv, bouncer: &PgBouncer, pooling: bool, args: &[&str]) -> Output {
    let mut cmd = env.cmd();
    cmd.env("DATABASE_URL", bouncer.url()).args(args);
    if pooling {
        cmd.env("INBOXCTL_TRANSACTION_POOLING", "true");
    }
    Output::of(cmd.output().expect("run inboxctl"))
}

/// The most sessions PostgreSQL had on the test's database other than the observer's (pg_stat_activity) and the most
/// server connections pgbouncer held for it (its admin console), sampled until `stop`.
struct Peak {
    sessions: Arc<AtomicI64>,
    pooled: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Peak {
    fn watch(env: &TestEnv, bouncer: &PgBouncer, pool: PgPool) -> Self {
        let (sessions, pooled, stop) = (
            Arc::new(AtomicI64::new(0)),
            Arc::new(AtomicI64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let db = env.db_name.clone();
        let (s, p, halt) = (sessions.clone(), pooled.clone(), stop.clone());
        let console = bouncer.console();
        let task = tokio::spawn(async move {
            let mut round = 0u32;
            while !halt.load(Ordering::SeqCst) {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend' \
                     AND application_name <> $2",
                )
                .bind(&db)
                .bind(OBSERVER)
                .fetch_one(&pool)
                .await
                .unwrap();
                s.fetch_max(n, Ordering::SeqCst);
                if round.is_multiple_of(5) {
                    let console = console.clone();
                    let held = tokio::task::spawn_blocking(move || console.server_connections());
                    let held = i64::try_from(held.await.unwrap()).unwrap();
                    p.fetch_max(held, Ordering::SeqCst);
                }
                round += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self {
            sessions,
            pooled,
            stop,
            task,
        }
    }

    /// (PostgreSQL's sessions, pgbouncer's server connections), at their most.
    async fn end(self) -> (i64, i64) {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        (
            self.sessions.load(Ordering::SeqCst),
            self.pooled.load(Ordering::SeqCst),
        )
    }
}

fn consumers(env: &TestEnv, bouncer: &PgBouncer) -> Vec<Proc> {
    let url = bouncer.url();
    let consumers: Vec<Proc> = (0..PROCESSES)
        .map(|_| {
            env.spawn_with(
                &[
                    "consume",
                    "carrier",
                    "--transaction-pooling",
                    "--concurrency",
                    "16",
                ],
                &[("DATABASE_URL", url.as_str())],
            )
        })
        .collect();
    for c in &consumers {
        c.wait_for_stderr("consuming", Duration::from_secs(60));
    }
    consumers
}

/// The acceptance test: eight consumer processes of sixteen workers each (128 client connections) through a PgBouncer
/// with ten server connections, 3,000 parcels and 600 copies: every parcel's effect once, every copy discarded, never
/// more than ten sessions on PostgreSQL; then `stats`, `top` and `cleanup` through the same PgBouncer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_consumers_of_sixteen_through_ten_server_connections_every_parcel_once() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let bouncer = PgBouncer::start(&env, SERVER_CONNECTIONS, &[]);
    let pool = observer(&env).await;
    let mut consumers = consumers(&env, &bouncer);
    let peak = Peak::watch(&env, &bouncer, pool.clone());
    let started = Instant::now();
    common::publish_parcels(
        &env,
        &["--count", &PARCELS.to_string(), "--duplicates", "0.2"],
    );
    common::eventually(
        "every parcel's effect, and an empty queue",
        Duration::from_secs(240),
        || async {
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= PARCELS
                && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        },
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let (sessions, pooled) = peak.end().await;
    for c in &mut consumers {
        c.terminate();
        assert_eq!(c.wait(Duration::from_secs(60)), Some(0), "{}", c.stderr());
        assert!(!c.stderr().contains("ERROR"), "{}", c.stderr());
    }
    common::assert_carrier_exactly_once(&pool, PARCELS).await;
    let discarded = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    assert!(
        discarded >= PARCELS / 5,
        "every copy discarded: {discarded}"
    );
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
    eprintln!(
        "{PROCESSES} consumers × 16 through {SERVER_CONNECTIONS} server connections: {PARCELS} parcels and {} copies \
         in {seconds:.1} s ({:.0} deliveries/s), {discarded} copies discarded; at most {sessions} sessions on \
         PostgreSQL, {pooled} server connections in pgbouncer",
        PARCELS / 5,
        (PARCELS + PARCELS / 5) as f64 / seconds
    );
    assert!(
        (1..=i64::from(SERVER_CONNECTIONS)).contains(&sessions),
        "PostgreSQL saw {sessions} sessions"
    );
    assert!(
        (1..=i64::from(SERVER_CONNECTIONS)).contains(&pooled),
        "pgbouncer held {pooled} server connections"
    );
    stats_and_top(&env, &bouncer);
    cleanup(&env, &bouncer, &pool).await;
}

/// `stats --json` and `top` through the pooler show the run's figures.
fn stats_and_top(env: &TestEnv, bouncer: &PgBouncer) {
    let out = through(env, bouncer, true, &["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let carrier = report["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == CARRIER_QUEUE)
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(carrier["rows"], PARCELS, "{carrier}");
    assert_eq!(carrier["unprocessed"], 0, "{carrier}");

    let tmux = Tmux::of(env);
    let script = format!(
        "DATABASE_URL='{}' AMQP_URL='{}' '{}' top --transaction-pooling --interval 500ms; echo EXITED=$?; sleep 60",
        bouncer.url(),
        env.amqp_url,
        common::bin()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "160",
        "-y",
        "40",
        &script,
    ]);
    tmux.wait_for("the carrier's row with its 3,000 rows", |s| {
        s.lines()
            .any(|l| l.contains(CARRIER_QUEUE) && l.contains(&PARCELS.to_string()))
    });
    tmux.run(&["send-keys", "-t", "top", "q"]);
    let after = tmux.wait_for("top to exit", |s| s.contains("EXITED="));
    assert!(after.contains("EXITED=0"), "{after}");
}

/// `cleanup` through the pooler: a run that finds nothing past its window, then one that takes every row.
async fn cleanup(env: &TestEnv, bouncer: &PgBouncer, pool: &PgPool) {
    let report = |out: Output| -> serde_json::Value {
        assert_eq!(out.code, Some(0), "{out:?}");
        serde_json::from_str(out.stdout.trim()).unwrap()
    };
    let nothing = report(through(
        env,
        bouncer,
        true,
        &["cleanup", "--retention", "1h", "--json"],
    ));
    assert_eq!(nothing["deleted"], 0, "{nothing}");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let all = report(through(
        env,
        bouncer,
        true,
        &[
            "cleanup",
            "--retention",
            "1s",
            "--force",
            "--batch-size",
            "500",
            "--json",
        ],
    ));
    assert_eq!(all["deleted"], PARCELS, "{all}");
    assert_eq!(
        common::count(pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert_eq!(
        common::count(pool, "SELECT count(*) FROM inboxctl_fingerprints").await,
        0
    );
}

/// Seeds `n` processed rows of each of three consumer_types, ten days old.
async fn seed_old_rows(pool: &PgPool, n: i64) {
    for ct in ["alpha", "beta", "gamma"] {
        sqlx::query(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
             SELECT gen_random_uuid(), $1, now() - interval '10 days', now() - interval '10 days'
             FROM generate_series(1, $2)",
        )
        .bind(ct)
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
    }
}

/// Two cleanups at once through the pooler, whose locks are each batch's (no session lasts): together they delete
/// exactly the old rows, none twice, and neither fails.
#[tokio::test(flavor = "multi_thread")]
async fn two_cleanups_at_once_through_the_pooler_delete_exactly_the_old_rows() {
    let env = TestEnv::migrated().await;
    let bouncer = PgBouncer::start(&env, 4, &[]);
    let pool = observer(&env).await;
    seed_old_rows(&pool, 10_000).await;
    let args = [
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "200",
        "--json",
    ];
    let spawn = || {
        env.spawn_with(
            &args,
            &[
                ("DATABASE_URL", bouncer.url().as_str()),
                ("INBOXCTL_TRANSACTION_POOLING", "1"),
            ],
        )
    };
    let (mut a, mut b) = (spawn(), spawn());
    assert_eq!(a.wait(Duration::from_secs(120)), Some(0), "{}", a.stderr());
    assert_eq!(b.wait(Duration::from_secs(120)), Some(0), "{}", b.stderr());
    let deleted = |out: String| -> u64 {
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["deleted"]
            .as_u64()
            .unwrap()
    };
    let (da, db) = (deleted(a.stdout()), deleted(b.stdout()));
    eprintln!("two cleanups through the pooler: {da} + {db} rows");
    assert_eq!(
        da + db,
        30_000,
        "together every old row, none twice ({da} + {db})"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
}

/// A consumer_type whose cleanup lock another cleanup holds (here the test's own session, directly on PostgreSQL, as
/// a cleanup without the pooler holds it) is left alone by a cleanup through the pooler, whose batches take the same
/// lock for their transaction, and cleaned once it is free.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_type_another_cleanup_holds_is_left_to_it_through_the_pooler() {
    let env = TestEnv::migrated().await;
    let bouncer = PgBouncer::start(&env, 2, &[]);
    let pool = observer(&env).await;
    seed_old_rows(&pool, 100).await;
    let mut other = pool.acquire().await.unwrap();
    assert!(
        inboxctl::db::cleanup::try_lock(&mut *other, "alpha")
            .await
            .unwrap()
    );
    let run = || {
        let out = through(
            &env,
            &bouncer,
            true,
            &["cleanup", "--retention", "7d", "--json"],
        );
        assert_eq!(out.code, Some(0), "{out:?}");
        serde_json::from_str::<serde_json::Value>(out.stdout.trim()).unwrap()
    };
    let consumer = |report: &serde_json::Value, ct: &str| {
        report["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer_type"] == ct)
            .cloned()
            .unwrap_or_else(|| panic!("{ct} in {report}"))
    };
    let report = run();
    let alpha = consumer(&report, "alpha");
    assert_eq!(
        (&alpha["busy"], &alpha["deleted"]),
        (&true.into(), &0.into()),
        "{report}"
    );
    for ct in ["beta", "gamma"] {
        let c = consumer(&report, ct);
        assert_eq!(
            (&c["busy"], &c["deleted"]),
            (&false.into(), &100.into()),
            "{report}"
        );
    }
    inboxctl::db::cleanup::unlock_all(&mut *other)
        .await
        .unwrap();
    let alpha = consumer(&run(), "alpha");
    assert_eq!(
        (&alpha["busy"], &alpha["deleted"]),
        (&false.into(), &100.into()),
        "{alpha}"
    );
}

/// Without `--transaction-pooling`, every command is refused before it does anything, and says to give it: by a
/// PgBouncer as configured out of the box, which refuses the startup parameters inboxctl sends; and by one told to
/// ignore them, where the pooler is seen at connection start (a session's setting seen by another connection's
/// transaction). Nothing consumed, nothing acknowledged. `migrate` refuses the flag.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_flag_every_command_is_refused_and_names_it() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "20"]);
    let strict = PgBouncer::start(&env, 2, &[]);
    let lenient = PgBouncer::start(
        &env,
        2,
        &["ignore_startup_parameters = extra_float_digits, options"],
    );
    for (bouncer, cause) in [
        (&strict, "unsupported startup parameter"),
        (
            &lenient,
            "another connection's transaction saw a setting of this session",
        ),
    ] {
        for args in [
            &["consume", "carrier", "--exit-when-idle", "1s"][..],
            &["stats", "--json"],
            &["cleanup", "--retention", "7d", "--force"],
            &["audit"],
        ] {
            let out = through(&env, bouncer, false, args);
            assert_eq!(out.code, Some(78), "{args:?}: {out:?}");
            for words in [cause, "--transaction-pooling", "docs/scaling.md"] {
                assert!(
                    out.stderr.contains(words),
                    "{args:?}: {words:?} in {}",
                    out.stderr
                );
            }
        }
        let out = through(&env, bouncer, true, &["migrate"]);
        assert_eq!(out.code, Some(64), "{out:?}");
        assert!(
            out.stderr.contains("run it against PostgreSQL itself"),
            "{}",
            out.stderr
        );
    }
    let pool = observer(&env).await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (20, 0), "nothing taken");
}

/// In session pooling a client keeps its server connection, so without the flag `stats` works; but a PgBouncer told
/// to ignore the startup parameter `options` drops `consume`'s claim timeout, which `consume` sees and refuses, naming
/// the flag (with which it sets the timeout in each claim transaction, and consumes).
#[tokio::test(flavor = "multi_thread")]
async fn in_session_pooling_a_lost_claim_timeout_is_refused() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "20"]);
    let session = PgBouncer::start(
        &env,
        4,
        &[
            "pool_mode = session",
            "ignore_startup_parameters = extra_float_digits, options",
        ],
    );
    let out = through(&env, &session, false, &["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let consume = ["consume", "carrier", "--exit-when-idle", "1s"];
    let out = through(&env, &session, false, &consume);
    assert_eq!(out.code, Some(78), "{out:?}");
    for words in ["lock_timeout", "did not arrive", "--transaction-pooling"] {
        assert!(out.stderr.contains(words), "{words:?} in {}", out.stderr);
    }
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (20, 0), "nothing taken");
    // Session pooling gives each client connection a server connection for its life: a pool within its four.
    let flagged = [&consume[..], &["--concurrency", "2"]].concat();
    let out = through(&env, &session, true, &flagged);
    assert_eq!(out.code, Some(0), "{out:?}");
    common::assert_carrier_exactly_once(&observer(&env).await, 20).await;
}

/// The errors a pooler causes a client that prepares named statements are reported as the pooler's, naming the flag:
/// sqlx's own named statements through a PgBouncer that hands consecutive transactions to alternate server
/// connections (`server_round_robin`), and the error it gets, as inboxctl's diagnosis says it.
#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_statement_lost_by_the_pooler_is_reported_as_the_poolers() {
    let env = TestEnv::migrated().await;
    let bouncer = PgBouncer::start(
        &env,
        2,
        &[
            "server_round_robin = 1",
            "min_pool_size = 2",
            "ignore_startup_parameters = extra_float_digits",
        ],
    );
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&bouncer.url())
        .await
        .unwrap();
    let mut lost = None;
    for i in 0..50 {
        // min_pool_size brings the second server connection in a moment after the first.
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Err(e) = sqlx::query_scalar::<_, i64>("SELECT $1::int8 + 1")
            .bind(i64::from(i))
            .fetch_one(&pool)
            .await
        {
            lost = Some(e);
            break;
        }
    }
    let error = lost.expect("a named statement lost between two server connections in 50 tries");
    assert!(inboxctl::db::pooler::is_pooler_error(&error), "{error}");
    let said = inboxctl::db::diagnose(error, None).to_string();
    for words in [
        "prepared statement",
        "--transaction-pooling",
        "docs/scaling.md",
    ] {
        assert!(said.contains(words), "{words:?} in {said}");
    }
}

/// The triage commands through the pooler with the flag: a message that cannot be read is dead-lettered by a consumer
/// going through it; `failures` groups it, `find` traces it, `replay` moves it back (its audit row written through the
/// pooler too), and `audit` lists the replay.
#[tokio::test(flavor = "multi_thread")]
async fn triage_find_replay_and_audit_through_the_pooler() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let bouncer = PgBouncer::start(&env, 2, &[]);
    common::publish_parcels(&env, &["--count", "5"]);
    let unreadable = uuid::Uuid::now_v7();
    let conn = env.amqp().await;
    let props = lapin::BasicProperties::default().with_message_id(unreadable.to_string().into());
    common::publish(&conn, "", CARRIER_QUEUE, props, b"not json").await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let run = |args: &[&str]| {
        let out = through(&env, &bouncer, true, args);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        out
    };
    // Commits that return before they are on disk: a consumer cannot set it for sessions a pooler shares out, so each
    // claim transaction sets it for itself (`restart::with_synchronous_commit_off_…` shows each commit flushed).
    let pool = env.pool().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {} SET synchronous_commit = off",
        common::quote_ident(&env.db_name)
    )))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let consumed = run(&["consume", "carrier", "--exit-when-idle", "1s"]);
    assert!(
        consumed
            .stderr
            .contains("each of the consumer's transactions sets it to local for itself (SET"),
        "{consumed:?}"
    );
    assert_eq!(env.queue_counts(&error_queue), (1, 0), "dead-lettered");

    let failures = run(&["failures", "--from", &error_queue, "--json"]);
    assert!(
        failures.stdout.contains("inboxctl::UnreadableMessage"),
        "{failures:?}"
    );
    let found = run(&["find", &unreadable.to_string(), "--json"]);
    let found: serde_json::Value = serde_json::from_str(found.stdout.trim()).unwrap();
    assert!(
        found.to_string().contains("dead_lettered"),
        "its dead-lettering found in the events: {found:#}"
    );
    let replayed = run(&["replay", "--from", &error_queue, "--json"]);
    assert_eq!(env.queue_counts(&error_queue), (0, 0), "{replayed:?}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (1, 0), "{replayed:?}");
    assert!(!replayed.stderr.contains("not audited"), "{replayed:?}");
    let audit = run(&["audit", "--command", "replay", "--json"]);
    assert!(
        audit.stdout.contains(&error_queue),
        "the replay audited through the pooler: {audit:?}"
    );
    assert_eq!(
        common::count(
            &observer(&env).await,
            "SELECT count(*) FROM carrier_reservations"
        )
        .await,
        5
    );
}

/// A pooler that ends a session idle in its transaction past `idle_transaction_timeout` (2 s here) while a batch's
/// member waits on a slow call to the outside world (keyed mode: the call inside the transaction; the stand-in
/// carrier's answer to `Slow` takes 5 s, past `--carrier-timeout 4s`). The member's failure is its own: the batch
/// goes one by one, the other members are booked and the slow one alone is retried and moved to `_error`. The
/// session's end under the failed member used to be taken for PostgreSQL gone: the batch was held and tried again as
/// a whole for ever, none of its members committed and the failure never counted.
/// The slow member first (its rollback refused) and last (the look at the transaction after it refused). And a call
/// that succeeds, in 3.5 s: its member's next statement refused by the pooler ("idle transaction timeout") was taken
/// for an outage, the batch held and tried again whole for ever; the member's failure now, the batch goes one by one,
/// where a keyed call is made before its one statement opens a transaction: all eight booked.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_member_whose_slow_call_outlived_the_poolers_idle_limit_fails_alone() {
    // At once: each case has its database, vhost, pooler, stand-in and consumer of its own.
    futures_util::future::join_all(
        [(true, 3500), (true, 5000), (false, 5000)]
            .map(|(slow_first, delay)| slow_member_past_the_idle_limit(slow_first, delay)),
    )
    .await;
}

async fn slow_member_past_the_idle_limit(slow_first: bool, delay: u64) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let bouncer = PgBouncer::start(&env, 4, &["idle_transaction_timeout = 2"]);
    let stub = common::Stub::start(&env, &[]);
    stub.behave(serde_json::json!({"delayMs": delay, "delayDestination": "Slow"}))
        .await;
    let slow: &[&str] = &["--count", "1", "--destination", "Slow"];
    let others: &[&str] = &["--count", "7"];
    let order = if slow_first {
        [slow, others]
    } else {
        [others, slow]
    };
    for args in order {
        common::publish_parcels(&env, args);
    }
    let url = bouncer.url();
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--transaction-pooling",
            "--batch-size",
            "8",
            "--effect-mode",
            "keyed",
            "--carrier-url",
            &stub.url,
            "--carrier-timeout",
            "4s",
            "--carrier-connect-timeout",
            "500ms",
            "--max-attempts",
            "2",
            "--retry-delay",
            "100ms",
        ],
        &[("DATABASE_URL", url.as_str())],
    );
    let pool = env.pool().await;
    let deadline = Instant::now() + Duration::from_secs(40);
    let booked = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    // A call within --carrier-timeout succeeds: its parcel is booked too.
    let expected = if delay < 4000 { 8 } else { 7 };
    while booked().await < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        booked().await,
        expected,
        "slow first: {slow_first}, {delay} ms: booked: {}",
        consumer.stderr()
    );
    if expected == 8 {
        consumer.terminate();
        return;
    }
    // Moved aside once its attempts are spent (the error queue is made by the first message moved there).
    let conn = env.amqp().await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let channel = conn.create_channel().await.unwrap();
        let declared = channel
            .queue_declare(
                error_queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await;
        if declared.is_ok_and(|q| q.message_count() > 0) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dead = common::drain(&conn, &error_queue).await;
    consumer.terminate();
    let stderr = consumer.stderr();
    assert_eq!(dead.len(), 1, "the slow one moved aside: {stderr}");
    assert!(
        String::from_utf8_lossy(&dead[0].data).contains("Slow"),
        "{stderr}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        7
    );
}

/// A work that waits on the outside world inside its transaction longer than the pooler's idle limit: its next
/// statement is refused ("idle transaction timeout"). That is the work's slowness — a failed attempt, counted, so
/// that a message whose work is always so slow ends in the error queue — not PostgreSQL gone: taken for an outage
/// (an `Unavailable`, never counted), its message was held and tried again for ever, each try as slow. One by one
/// and batched (the batch then goes one by one, where the member fails alone).
#[tokio::test(flavor = "multi_thread")]
async fn a_work_idle_in_its_transaction_past_the_poolers_limit_fails_its_attempt() {
    use inboxctl::inbox::{ConsumerType, Inbox, Member, ProcessError};
    let env = TestEnv::migrated().await;
    let bouncer = PgBouncer::start(
        &env,
        4,
        &[
            "pool_mode = session",
            "idle_transaction_timeout = 1",
            "ignore_startup_parameters = extra_float_digits",
        ],
    );
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&bouncer.url())
        .await
        .expect("connect through the pooler");
    let inbox = Inbox::new(pool, ConsumerType::new("slow-work").unwrap());
    fn slow(
        tx: &mut sqlx::PgConnection,
    ) -> futures_util::future::BoxFuture<'_, Result<(), inboxctl::inbox::WorkError>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            sqlx::query("SELECT 1").execute(&mut *tx).await?;
            Ok(())
        })
    }
    let alone = inbox.process(uuid::Uuid::new_v4(), slow).await;
    assert!(
        matches!(alone, Err(ProcessError::Failed(_))),
        "one by one: {alone:?}"
    );
    let batch = inbox
        .process_batch(vec![Member {
            message_id: uuid::Uuid::new_v4(),
            fingerprint: None,
            carried: Default::default(),
            work: Box::new(slow),
        }])
        .await;
    assert!(
        matches!(batch, Err(ProcessError::Failed(_))),
        "batched: {:?}",
        batch.map(|o| o.len())
    );
}
