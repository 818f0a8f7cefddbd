//! `inboxctl cleanup` against real PostgreSQL: exactly the processed rows past the window go, in batches, never an
//! unprocessed one; two at once; a million rows while a consumer keeps working; interrupted cleanly.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};
use sqlx::PgPool;

/// `n` inbox rows of `consumer_type`, received and (unless `unprocessed`) processed `age` ago.
async fn seed(pool: &PgPool, consumer_type: &str, n: i64, age: &str, unprocessed: bool) {
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         SELECT gen_random_uuid(), $1, now() - $2::interval,
                CASE WHEN $4 THEN NULL ELSE now() - $2::interval END
         FROM generate_series(1, $3)",
    )
    .bind(consumer_type)
    .bind(age)
    .bind(n)
    .bind(unprocessed)
    .execute(pool)
    .await
    .unwrap();
}

async fn seed_events(pool: &PgPool, consumer_type: &str, n: i64, age: &str) {
    sqlx::query(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
         SELECT $1, 'duplicate', gen_random_uuid(), now() - $2::interval FROM generate_series(1, $3)",
    )
    .bind(consumer_type)
    .bind(age)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// Rows per (consumer_type, state) where state is old/new × processed/unprocessed, as "type state count" lines.
async fn census(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('%s %s %s', consumer_type, state, count(*)) FROM (
             SELECT consumer_type,
                    CASE WHEN processed_at IS NULL THEN 'unprocessed' ELSE 'processed' END
                    || CASE WHEN received_at < now() - interval '7 days' THEN '-old' ELSE '-new' END AS state
             FROM inbox_messages) t
         GROUP BY consumer_type, state ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn seed_both(pool: &PgPool) {
    for (ct, old, new, stuck) in [("alpha", 120, 30, 7), ("beta", 45, 10, 3)] {
        seed(pool, ct, old, "8 days", false).await;
        seed(pool, ct, new, "6 days 23 hours", false).await;
        seed(pool, ct, stuck, "9 days", true).await;
        seed_events(pool, ct, 5, "8 days").await;
        seed_events(pool, ct, 2, "1 hour").await;
    }
}

fn json(out: &common::Output) -> serde_json::Value {
    assert_eq!(out.code, Some(0), "{out:?}");
    serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

fn consumer<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == name)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn exactly_the_processed_rows_past_the_window_go() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed_both(&pool).await;
    let before = census(&pool).await;

    // --dry-run: the same counts, nothing deleted.
    let dry = json(&env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--dry-run",
        "--json",
        "--batch-size",
        "50",
    ]));
    assert_eq!(census(&pool).await, before, "a dry run changes nothing");
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_events").await,
        14
    );

    let out = env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--json",
        "--batch-size",
        "50",
    ]);
    let report = json(&out);
    for (ct, old, stuck) in [("alpha", 120, 7), ("beta", 45, 3)] {
        for r in [&report, &dry] {
            let c = consumer(r, ct);
            assert_eq!(c["deleted"], old, "{ct}");
            assert_eq!(c["events_deleted"], 5, "{ct}");
            assert_eq!(c["unprocessed_older"], stuck, "{ct}: the warning's count");
        }
        assert!(
            out.stderr.contains(&format!(
                "{stuck} messages were received more than 7days ago and never processed"
            )),
            "{}",
            out.stderr
        );
    }
    assert_eq!(report["deleted"], 165);
    assert_eq!(report["interrupted"], false);
    assert_eq!(
        census(&pool).await,
        [
            "alpha processed-new 30",
            "alpha unprocessed-old 7",
            "beta processed-new 10",
            "beta unprocessed-old 3"
        ],
        "old processed rows gone; newer and unprocessed rows kept"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_events").await,
        4,
        "old events pruned too"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_consumer_type_only() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed_both(&pool).await;
    let report = json(&env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--consumer-type",
        "beta",
        "--json",
    ]));
    assert_eq!(report["consumers"].as_array().unwrap().len(), 1);
    assert_eq!(consumer(&report, "beta")["deleted"], 45);
    assert_eq!(
        census(&pool).await,
        [
            "alpha processed-new 30",
            "alpha processed-old 120",
            "alpha unprocessed-old 7",
            "beta processed-new 10",
            "beta unprocessed-old 3"
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_table_for_people_names_each_consumer_type_inertly() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(
        &pool,
        "evil\u{1b}]0;owned\u{7}\u{1b}[2J",
        3,
        "9 days",
        false,
    )
    .await;
    let out = env.run(&["cleanup", "--retention", "7d"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains("evil\\u{1b}]0;owned\\u{7}\\u{1b}[2J"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains('\u{1b}') && !out.stderr.contains('\u{1b}'),
        "no raw escape reaches the terminal"
    );
    assert!(out.stdout.contains("deleted 3 rows"), "{}", out.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_cleanups_at_once_delete_exactly_the_expected_rows() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    for ct in ["alpha", "beta", "gamma"] {
        seed(&pool, ct, 40_000, "10 days", false).await;
        seed(&pool, ct, 1_000, "1 day", false).await;
    }
    let args = [
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "500",
        "--json",
    ];
    let mut a = env.spawn(&args);
    let mut b = env.spawn(&args);
    assert_eq!(a.wait(Duration::from_secs(120)), Some(0), "{}", a.stderr());
    assert_eq!(b.wait(Duration::from_secs(120)), Some(0), "{}", b.stderr());
    let deleted = |out: String| -> u64 {
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["deleted"]
            .as_u64()
            .unwrap()
    };
    let (a_out, b_out) = (a.stdout(), b.stdout());
    let (da, db) = (deleted(a_out.clone()), deleted(b_out.clone()));
    assert_eq!(
        da + db,
        120_000,
        "together exactly the old rows, none twice ({da} + {db})"
    );
    // Each consumer_type cleaned by one of them whole: the other found it held (its lock) or already clean. PostgreSQL
    // alone makes the sum above exact; this is what the lock adds.
    let (ra, rb): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(a_out.trim()).unwrap(),
        serde_json::from_str(b_out.trim()).unwrap(),
    );
    let of = |report: &serde_json::Value, ct: &str| -> u64 {
        report["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer_type"] == ct)
            .map_or(0, |c| c["deleted"].as_u64().unwrap_or(0))
    };
    for ct in ["alpha", "beta", "gamma"] {
        let mut split = [of(&ra, ct), of(&rb, ct)];
        split.sort_unstable();
        assert_eq!(
            split,
            [0, 40_000],
            "{ct} cleaned by one run alone\n{ra}\n{rb}"
        );
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        3_000
    );
}

/// A consumer_type another cleanup is cleaning (its advisory lock held, here by a session of the test's) is left to
/// that cleanup and reported busy, untouched; the other consumer_types are cleaned. Once the lock is released, the
/// next run cleans it.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_type_another_cleanup_holds_is_left_to_it() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed_both(&pool).await;
    let mut other = pool.acquire().await.unwrap();
    let locked = inboxctl::db::cleanup::try_lock(&mut *other, "alpha")
        .await
        .unwrap();
    assert!(locked);

    let report = json(&env.run(&["cleanup", "--retention", "7d", "--json"]));
    let alpha = consumer(&report, "alpha");
    assert_eq!(alpha["busy"], true, "{report}");
    assert_eq!(
        (&alpha["deleted"], &alpha["events_deleted"]),
        (&0.into(), &0.into())
    );
    assert_eq!(consumer(&report, "beta")["busy"], false, "{report}");
    assert_eq!(
        census(&pool).await,
        [
            "alpha processed-new 30",
            "alpha processed-old 120",
            "alpha unprocessed-old 7",
            "beta processed-new 10",
            "beta unprocessed-old 3"
        ],
        "alpha untouched; beta cleaned"
    );

    inboxctl::db::cleanup::unlock_all(&mut *other)
        .await
        .unwrap();
    let report = json(&env.run(&["cleanup", "--retention", "7d", "--json"]));
    let alpha = consumer(&report, "alpha");
    assert_eq!(alpha["busy"], false, "{report}");
    assert_eq!(alpha["deleted"], 120, "{report}");
}

/// The fingerprints the claim keeps beside inbox rows go with their rows, and only with them: a fingerprint whose row
/// is gone would be kept forever (the inbox's own cleanup being the only one that knows it).
#[tokio::test(flavor = "multi_thread")]
async fn the_fingerprints_of_deleted_rows_go_with_them() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed_both(&pool).await;
    sqlx::query(
        "INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint)
         SELECT id, consumer_type, '\\x01'::bytea FROM inbox_messages",
    )
    .execute(&pool)
    .await
    .unwrap();
    let report = json(&env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "50",
        "--json",
    ]));
    assert_eq!(report["deleted"], 165);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_fingerprints f WHERE NOT EXISTS (
                 SELECT 1 FROM inbox_messages i WHERE i.id = f.id AND i.consumer_type = f.consumer_type)"
        )
        .await,
        0,
        "no fingerprint outlives its row"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_fingerprints").await,
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        "the kept rows keep theirs"
    );
}

/// The cutoff belongs to the window: a row, event or start count stamped exactly at it is not older than the window
/// (the README's "older than now - retention"), and no statement of the cleanup counts or deletes it; one stamped a
/// microsecond earlier, each of them does.
#[tokio::test(flavor = "multi_thread")]
async fn what_is_stamped_at_the_cutoff_itself_is_kept() {
    use chrono::{DateTime, TimeDelta, Utc};
    use inboxctl::db::cleanup as store;

    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let cutoff: DateTime<Utc> = store::cutoff(&pool, std::time::Duration::from_secs(7 * 86_400))
        .await
        .unwrap();
    let earlier = cutoff - TimeDelta::microseconds(1);
    for (consumer_type, at) in [("at", cutoff), ("earlier", earlier)] {
        for statement in [
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
             VALUES (gen_random_uuid(), $1, $2, $2), (gen_random_uuid(), $1 || '-unprocessed', $2, NULL)",
            "INSERT INTO inboxctl_events (consumer_type, kind, occurred_at) VALUES ($1, 'duplicate', $2)",
            "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, last_started_at)
             VALUES ($1, gen_random_uuid(), 1, $2)",
        ] {
            sqlx::query(statement)
                .bind(consumer_type)
                .bind(at)
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    for (consumer_type, unprocessed, n) in [
        ("at", "at-unprocessed", 0),
        ("earlier", "earlier-unprocessed", 1),
    ] {
        assert_eq!(
            store::count_processed_before(
                &pool,
                store::Rows::Processed,
                consumer_type,
                cutoff,
                &[]
            )
            .await
            .unwrap(),
            n,
            "{consumer_type}"
        );
        assert_eq!(
            store::count_events_before(&pool, consumer_type, cutoff)
                .await
                .unwrap(),
            n,
            "{consumer_type}"
        );
        let stuck = store::unprocessed_before(&pool, unprocessed, cutoff)
            .await
            .unwrap();
        assert_eq!(stuck.count, n, "{unprocessed}");
        assert_eq!(
            store::delete_processed_batch(
                &pool,
                store::Rows::Processed,
                consumer_type,
                cutoff,
                100
            )
            .await
            .unwrap(),
            n,
            "{consumer_type}"
        );
        assert_eq!(
            store::delete_events_batch(&pool, consumer_type, cutoff, 100)
                .await
                .unwrap(),
            n,
            "{consumer_type}"
        );
        assert_eq!(
            store::delete_old_attempts(&pool, consumer_type, cutoff)
                .await
                .unwrap(),
            n,
            "{consumer_type}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_retentions_are_usage_errors() {
    let env = TestEnv::migrated().await;
    for bad in ["0", "0s", "-1d", "soon", "7"] {
        let out = env.run(&["cleanup", "--retention", bad]);
        assert_eq!(out.code, Some(64), "{bad}: {out:?}");
    }
    let out = env.run(&["cleanup"]);
    assert_eq!(out.code, Some(64), "--retention is required: {out:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn interrupted_it_stops_after_the_current_batch_and_says_so() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(&pool, "alpha", 5_000, "8 days", false).await;
    let mut cleanup = env.spawn(&[
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "100",
        "--batch-pause",
        "100ms",
        "--json",
    ]);
    common::eventually("some batches done", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await <= 4_700
    })
    .await;
    let kill = std::process::Command::new("kill")
        .args(["-INT", &cleanup.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(
        cleanup.wait(Duration::from_secs(30)),
        Some(3),
        "partial: {}",
        cleanup.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert_eq!(report["interrupted"], true);
    let left = common::count(&pool, "SELECT count(*) FROM inbox_messages").await;
    assert!(left > 0, "it stopped early");
    assert_eq!(
        report["deleted"].as_i64().unwrap(),
        5_000 - left,
        "the report counts what is gone"
    );
    assert_eq!((5_000 - left) % 100, 0, "whole batches only");
}

/// Done calls' records past the window: 250 of them, pruned in batches of 100.
async fn seed_done_effects(pool: &PgPool, consumer_type: &str, n: i64) {
    sqlx::query(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, created_at, updated_at)
         SELECT gen_random_uuid(), $1, gen_random_uuid(), 'after-commit', 'done', '{}',
                now() - interval '10 days', now() - interval '10 days'
         FROM generate_series(1, $2)",
    )
    .bind(consumer_type)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// A cleanup failing while it pruned the done calls' records (its second batch refused by a trigger) after one batch
/// had gone: the count of what it had pruned was kept only on success, so the run said it deleted none of them —
/// and, with no inbox row deleted, failed outright (exit 1, no report, audited `failed`), the 100 records gone
/// unsaid. Now what went is counted batch by batch: partial (exit 3), 100 reported and audited.
#[tokio::test(flavor = "multi_thread")]
async fn a_cleanup_failing_while_it_prunes_the_calls_records_says_what_it_pruned() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // The consumer_type's rows are young: none of them goes.
    seed(&pool, "carrier", 10, "1 hour", false).await;
    seed_done_effects(&pool, "carrier", 250).await;
    sqlx::raw_sql(
        "CREATE SEQUENCE prunes; \
         CREATE FUNCTION refuse_second_prune() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF nextval('prunes') > 1 THEN RAISE EXCEPTION 'second prune refused by the test'; END IF; \
           RETURN NULL; END $$; \
         CREATE TRIGGER refuse_second_prune BEFORE DELETE ON inboxctl_effects FOR EACH STATEMENT \
           EXECUTE FUNCTION refuse_second_prune();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--force",
        "--batch-size",
        "100",
        "--json",
    ]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["effects_deleted"], 100, "{report:#}");
    assert!(
        report["failed"]
            .as_str()
            .is_some_and(|f| f.contains("second prune refused by the test")),
        "{report:#}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_effects").await,
        150
    );
    let (outcome, details): (String, serde_json::Value) =
        sqlx::query_as("SELECT outcome, details FROM inboxctl_audit WHERE command = 'cleanup'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(outcome, "partial", "{details}");
    assert_eq!(details["effects_deleted"], 100, "{details}");
}

/// A stop while the done calls' records are pruned (a failpoint holds the run after its first batch) ended the
/// pruning after that batch but said nothing of it: `interrupted: false`, exit 0, audited `done`. It is a stop like
/// one in the inbox's batches now: interrupted, exit 3, the batch that went reported.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_while_the_calls_records_are_pruned_ends_the_run_interrupted() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(&pool, "carrier", 10, "1 hour", false).await;
    seed_done_effects(&pool, "carrier", 250).await;
    let mut cleanup = env.spawn_with(
        &[
            "cleanup",
            "--retention",
            "7d",
            "--force",
            "--batch-size",
            "100",
            "--json",
        ],
        &[("INBOXCTL_FAILPOINTS", "effects-pruned=sleep-once-5000")],
    );
    cleanup.wait_for_stderr("failpoint effects-pruned reached", Duration::from_secs(30));
    cleanup.terminate();
    assert_eq!(
        cleanup.wait(Duration::from_secs(30)),
        Some(3),
        "{}",
        cleanup.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert_eq!(report["interrupted"], true, "{report:#}");
    assert_eq!(report["effects_deleted"], 100, "{report:#}");
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_effects").await,
        150
    );
}

/// The start counts of redelivered messages (`consume --poison-after`) left by messages that never came back go
/// with the window too; recent ones stay.
#[tokio::test(flavor = "multi_thread")]
async fn start_counts_older_than_the_window_go_too() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inboxctl_attempts (consumer_type, message_id, started, last_started_at) VALUES
         ('alpha', gen_random_uuid(), 2, now() - interval '8 days'),
         ('alpha', gen_random_uuid(), 1, now() - interval '1 hour'),
         ('beta', gen_random_uuid(), 3, now() - interval '9 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    seed(&pool, "alpha", 1, "8 days", false).await;
    seed(&pool, "beta", 1, "8 days", false).await;

    let out = env.run(&["cleanup", "--retention", "7d", "--dry-run", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_attempts").await,
        3
    );

    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["attempts_deleted"], 2, "{report}");
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_attempts WHERE last_started_at > now() - interval '1 day'"
        )
        .await,
        1
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inboxctl_attempts").await,
        1
    );
}

/// Killed with SIGKILL mid-run: every batch happened whole or not at all (the deleted count is whole batches per
/// consumer_type), no unprocessed row and no row inside the window went, the consumer_types' locks died with the
/// session (the next cleanup is not told another one is busy), and it finishes the job.
#[tokio::test(flavor = "multi_thread")]
async fn killed_mid_run_nothing_is_half_done_and_the_next_run_finishes() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    for ct in ["alpha", "beta"] {
        seed(&pool, ct, 3_000, "8 days", false).await;
        seed(&pool, ct, 50, "8 days", true).await;
        seed(&pool, ct, 50, "1 day", false).await;
    }
    // Each row with its fingerprint, as the claim writes them: a batch deletes both in one statement, so a kill leaves
    // none without the other.
    sqlx::query(
        "INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint)
         SELECT id, consumer_type, '\\x01'::bytea FROM inbox_messages",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut cleanup = env.spawn(&[
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "100",
        "--batch-pause",
        "100ms",
    ]);
    common::eventually("some batches done", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await <= 6_200 - 1_000
    })
    .await;
    cleanup.kill();
    for ct in ["alpha", "beta"] {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1 AND processed_at < now() - interval '7 days'",
        )
        .bind(ct)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(left > 0, "{ct}: killed before the end");
        assert_eq!(
            (3_000 - left) % 100,
            0,
            "{ct}: whole batches only ({left} left)"
        );
    }
    let kept = "SELECT count(*) FROM inbox_messages WHERE processed_at IS NULL OR processed_at > now() - interval '7 days'";
    assert_eq!(
        common::count(&pool, kept).await,
        200,
        "nothing it must keep went"
    );
    let unpaired = "SELECT (SELECT count(*) FROM inboxctl_fingerprints f WHERE NOT EXISTS
                        (SELECT 1 FROM inbox_messages m WHERE m.id = f.id AND m.consumer_type = f.consumer_type))
                     + (SELECT count(*) FROM inbox_messages m WHERE NOT EXISTS
                        (SELECT 1 FROM inboxctl_fingerprints f WHERE m.id = f.id AND m.consumer_type = f.consumer_type))";
    assert_eq!(
        common::count(&pool, unpaired).await,
        0,
        "killed, no row left without its fingerprint nor a fingerprint without its row"
    );

    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    for c in report["consumers"].as_array().unwrap() {
        assert_eq!(c["busy"], false, "the killed run's locks are gone: {c}");
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        200
    );
    assert_eq!(common::count(&pool, kept).await, 200);
}

/// A million deletable rows purged while a consumer processes a steady stream: no error, and no gap of more than
/// 2 s between its effects.
#[tokio::test(flavor = "multi_thread")]
async fn a_million_rows_while_a_consumer_keeps_working() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    for ct in [CARRIER_QUEUE, "other-a", "other-b", "other-c"] {
        seed(&pool, ct, 250_000, "10 days", false).await;
    }
    let consumer = env.spawn(&["consume", "carrier", "--concurrency", "4"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    // A steady 20 messages/s, for longer than the cleanup takes; stopped once it is done.
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        "3000",
        "--rate",
        "20",
    ]);
    common::eventually("the consumer at work", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 20
    })
    .await;

    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    let report = json(&out);
    assert_eq!(report["deleted"], 1_000_000);
    let window: (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT now() - make_interval(secs => $1), now()")
            .bind(report["seconds"].as_f64().unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        publisher.child.try_wait().unwrap().is_none(),
        "the stream outlasted the cleanup"
    );
    publisher.kill();

    // The longest pause between two effects while the cleanup ran (and from its start and to its end).
    let gap: f64 = sqlx::query_scalar(
        "WITH t AS (SELECT reserved_at FROM carrier_reservations WHERE reserved_at BETWEEN $1 AND $2
                    UNION ALL SELECT $1 UNION ALL SELECT $2)
         SELECT COALESCE(max(extract(epoch FROM d)), 0)::float8 FROM (
             SELECT reserved_at - lag(reserved_at) OVER (ORDER BY reserved_at) AS d FROM t) g",
    )
    .bind(window.0)
    .bind(window.1)
    .fetch_one(&pool)
    .await
    .unwrap();
    eprintln!(
        "cleanup of 1M rows: {:.1}s, {:.0} rows/s; longest gap between effects {gap:.2}s",
        report["seconds"], report["rows_per_second"]
    );
    assert!(
        gap <= 2.0,
        "a gap of {gap:.2}s between effects during the cleanup"
    );
    assert!(
        !consumer.stderr().contains("ERROR"),
        "{}",
        consumer.stderr()
    );
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
}

/// `--every`: rounds on the schedule; a round that fails after one succeeded is said and the next comes on schedule
/// (a sidecar that ended on a database restart would make no more partitions ahead); a stop ends it.
#[tokio::test(flavor = "multi_thread")]
async fn every_keeps_cleaning_on_its_schedule_until_stopped() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(&pool, "alpha", 10, "2 hours", false).await;
    let mut sidecar = env.spawn(&["cleanup", "--retention", "1h", "--every", "500ms", "--json"]);
    // The first round has ended (its report printed), not only deleted the rows: a table renamed while it still
    // cleans the events would fail the first round, which ends the sidecar.
    common::eventually("the first round", Duration::from_secs(20), || async {
        sidecar.stdout().contains("\"deleted\"")
    })
    .await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    // A round that fails (a table gone a while) is said, and the schedule goes on.
    sqlx::raw_sql("ALTER TABLE inboxctl_events RENAME TO inboxctl_events_away")
        .execute(&pool)
        .await
        .unwrap();
    sidecar.wait_for_stderr("this cleanup run failed", Duration::from_secs(20));
    assert_eq!(sidecar.try_wait(), None, "{}", sidecar.stderr());
    sqlx::raw_sql("ALTER TABLE inboxctl_events_away RENAME TO inboxctl_events")
        .execute(&pool)
        .await
        .unwrap();
    // Rows that age past the window later are taken by a later round.
    seed(&pool, "beta", 7, "3 hours", false).await;
    // Its report printed too (a round renamed away from after its delete would fail without one).
    let reported_deleted = |out: String| -> u64 {
        out.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|r| r["deleted"].as_u64())
            .sum()
    };
    common::eventually("a later round", Duration::from_secs(20), || async {
        reported_deleted(sidecar.stdout()) == 17
    })
    .await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    // Stopped after a round that failed: the last round did not happen, exit 3.
    let failed_before = sidecar.stderr().matches("this cleanup run failed").count();
    sqlx::raw_sql("ALTER TABLE inboxctl_events RENAME TO inboxctl_events_away")
        .execute(&pool)
        .await
        .unwrap();
    common::eventually("another failed round", Duration::from_secs(20), || async {
        sidecar.stderr().matches("this cleanup run failed").count() > failed_before
    })
    .await;
    sidecar.terminate();
    assert_eq!(
        sidecar.wait(Duration::from_secs(20)),
        Some(3),
        "{}",
        sidecar.stderr()
    );
    let rounds: Vec<serde_json::Value> = sidecar
        .stdout()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (failed, rounds): (Vec<_>, Vec<_>) = rounds.into_iter().partition(|r| r["failed"] == true);
    assert!(
        failed.iter().all(|f| f["error"]
            .as_str()
            .is_some_and(|e| e.contains("inboxctl_events"))),
        "each failed round a line saying why: {failed:?}"
    );
    assert!(!failed.is_empty());
    assert!(rounds.len() >= 2, "{rounds:?}");
    assert_eq!(
        rounds
            .iter()
            .map(|r| r["deleted"].as_u64().unwrap())
            .sum::<u64>(),
        17
    );
}

/// The window is measured on `processed_at`, never `received_at`: a .NET service's (EF Core's, the tutorial's) rows
/// are received long before they are processed. A row processed inside the window stays however long ago it was
/// received; one processed before it goes however recently it was received. The same for `--dry-run`'s count.
#[tokio::test(flavor = "multi_thread")]
async fn the_window_is_measured_from_processing_not_from_receipt() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // (name, received ago, processed ago, kept by --retention 7d)
    let rows = [
        ("received-30d-processed-1m", "30 days", "1 minute", true),
        ("received-8d-processed-6d", "8 days", "6 days", true),
        ("received-10d-processed-8d", "10 days", "8 days", false),
        // Not a real history, but a statement reading received_at would keep it.
        ("received-1m-processed-8d", "1 minute", "8 days", false),
    ];
    for (name, received, processed, _) in rows {
        sqlx::query(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
             VALUES (gen_random_uuid(), $1, now() - $2::interval, now() - $3::interval)",
        )
        .bind(name)
        .bind(received)
        .bind(processed)
        .execute(&pool)
        .await
        .unwrap();
    }
    let dry = json(&env.run(&["cleanup", "--retention", "7d", "--dry-run", "--json"]));
    let out = json(&env.run(&["cleanup", "--retention", "7d", "--json"]));
    for (name, _, _, kept) in rows {
        let expected = u64::from(!kept);
        assert_eq!(consumer(&dry, name)["deleted"], expected, "dry run: {name}");
        assert_eq!(consumer(&out, name)["deleted"], expected, "{name}");
    }
    let left: Vec<String> =
        sqlx::query_scalar("SELECT consumer_type FROM inbox_messages ORDER BY consumer_type")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        ["received-30d-processed-1m", "received-8d-processed-6d"]
    );
}

/// A retention longer than PostgreSQL's timestamps reach is a usage error that names the longest one taken (instead
/// of "timestamp out of range"); one under a minute, which empties the deduplication window, is refused unless
/// `--force`, and nothing is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_retention_past_the_bounds_is_refused_and_names_them() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(&pool, "alpha", 3, "2 seconds", false).await;
    for huge in ["1000000y", "101y"] {
        let out = env.run(&["cleanup", "--retention", huge]);
        assert_eq!(out.code, Some(64), "{huge}: {out:?}");
        assert!(
            out.stderr.contains("at most 100years"),
            "{huge}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("timestamp"), "{}", out.stderr);
    }
    let out = env.run(&["cleanup", "--retention", "100y", "--json"]);
    assert_eq!(json(&out)["deleted"], 0, "the longest is taken: {out:?}");

    for short in ["1ns", "1ms", "59s"] {
        for dry_run in [false, true] {
            let mut args = vec!["cleanup", "--retention", short];
            if dry_run {
                args.push("--dry-run");
            }
            let out = env.run(&args);
            assert_eq!(out.code, Some(64), "{short}: {out:?}");
            assert!(
                out.stderr.contains("is under 1m") && out.stderr.contains("--force"),
                "{short}: {}",
                out.stderr
            );
        }
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        3,
        "nothing deleted"
    );
    // An audit retention of minutes (`90m` typed for `90d`) would empty the audit at once: refused, --force or not.
    sqlx::query(
        "INSERT INTO inboxctl_audit (occurred_at, command, command_line, outcome) \
         VALUES (now() - interval '2 hours', 'migrate', 'inboxctl migrate', 'done')",
    )
    .execute(&pool)
    .await
    .unwrap();
    for force in [false, true] {
        let mut args = vec!["cleanup", "--retention", "7d", "--audit-retention", "90m"];
        if force {
            args.push("--force");
        }
        let out = env.run(&args);
        assert_eq!(out.code, Some(64), "{out:?}");
        assert!(
            out.stderr
                .contains("--audit-retention 1h 30m is under 1day"),
            "{out:?}"
        );
    }
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_audit WHERE command = 'migrate'"
        )
        .await,
        1,
        "the audit kept"
    );
    let help = env.run(&["cleanup", "--help"]);
    assert!(help.stdout.contains("--force"), "{}", help.stdout);
    let out = env.run(&["cleanup", "--retention", "1ms", "--force", "--json"]);
    assert_eq!(json(&out)["deleted"], 3, "{out:?}");
}

/// The records of calls made outside the database (`inboxctl_effects`) go with the window once done: a done call
/// settled before the cutoff is deleted (in batches), one settled inside it stays, and a call owed, started, in
/// doubt or failed stays however old, until it is settled. A dry run counts without deleting.
#[tokio::test(flavor = "multi_thread")]
async fn records_of_done_calls_past_the_window_go_and_unsettled_ones_stay() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // (consumer_type, state, settled how long ago)
    let rows = [
        ("alpha", "done", "8 days"),
        ("alpha", "done", "9 days"),
        ("alpha", "done", "10 days"),
        ("alpha", "done", "1 hour"),
        ("alpha", "pending", "8 days"),
        ("alpha", "started", "8 days"),
        ("alpha", "in_doubt", "8 days"),
        ("alpha", "failed", "8 days"),
        ("beta", "done", "8 days"),
    ];
    for (consumer_type, state, age) in rows {
        sqlx::query(
            "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request,
                                           created_at, updated_at)
             VALUES (gen_random_uuid(), $1, gen_random_uuid(), 'after-commit', $2, '{}',
                     now() - $3::interval, now() - $3::interval)",
        )
        .bind(consumer_type)
        .bind(state)
        .bind(age)
        .execute(&pool)
        .await
        .unwrap();
    }
    seed(&pool, "alpha", 1, "8 days", false).await;
    seed(&pool, "beta", 1, "8 days", false).await;
    let states = || async {
        let left: Vec<(String, String)> = sqlx::query_as(
            "SELECT consumer_type::text, state FROM inboxctl_effects ORDER BY consumer_type, state, updated_at",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        left
    };

    let out = env.run(&["cleanup", "--retention", "7d", "--dry-run", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["effects_deleted"], 4, "{report}");
    assert_eq!(states().await.len(), 9, "a dry run deletes nothing");

    let out = env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "2",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["effects_deleted"], 4, "{report}");
    assert!(report.get("effects_left").is_none(), "{report}");
    let left: Vec<(String, String)> = states().await;
    let expected: Vec<(String, String)> = [
        ("alpha", "done"),
        ("alpha", "failed"),
        ("alpha", "in_doubt"),
        ("alpha", "pending"),
        ("alpha", "started"),
    ]
    .iter()
    .map(|(c, s)| ((*c).to_owned(), (*s).to_owned()))
    .collect();
    assert_eq!(left, expected);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_effects WHERE state = 'done' AND updated_at > now() - interval '1 day'"
        )
        .await,
        1,
        "the call done inside the window stays"
    );
}

/// A cleanup that fails after it deleted rows (here pruning the audit is refused, as for a role kept from deleting
/// audit rows) reports what it deleted, audits it, and ends partial (exit 3), saying what failed. It ended with an
/// error alone: the rows gone, the audit row saying "failed" with no count, the report lost.
#[tokio::test]
async fn a_cleanup_that_fails_after_deleting_says_what_it_deleted() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    seed(&pool, "carrier", 100, "10 days", false).await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_prune() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE EXCEPTION 'audit pruning refused by the test'; END $$; \
         CREATE TRIGGER refuse_prune BEFORE DELETE ON inboxctl_audit FOR EACH STATEMENT \
           EXECUTE FUNCTION refuse_prune();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["deleted"], 100, "{report:#}");
    assert!(
        report["failed"]
            .as_str()
            .unwrap()
            .contains("audit pruning refused by the test"),
        "{report:#}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    let (outcome, details): (String, serde_json::Value) =
        sqlx::query_as("SELECT outcome, details FROM inboxctl_audit WHERE command = 'cleanup'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(outcome, "partial", "{details}");
    assert_eq!(details["deleted"], 100, "{details}");

    // For people, and on a schedule: said after what was deleted, and a first run so failed ends `--every`, as a
    // first run that fails outright does (a grant to fix).
    seed(&pool, "carrier", 10, "10 days", false).await;
    let mut every = env.spawn(&["cleanup", "--retention", "7d", "--force", "--every", "1s"]);
    assert_eq!(
        every.wait(Duration::from_secs(60)),
        Some(3),
        "{}",
        every.stderr()
    );
    assert!(
        every
            .stdout()
            .contains("then failed (what is above was deleted)")
            && every.stdout().contains("audit pruning refused by the test"),
        "{}",
        every.stdout()
    );
}
