//! `inboxctl stats` against real PostgreSQL and RabbitMQ: the figures are what the test put there.

use crate::common;

use common::{CARRIER_QUEUE, TestEnv};
use std::time::Duration;

fn stats(env: &TestEnv, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["stats", "--json"];
    all.extend_from_slice(args);
    let out = env.run(&all);
    assert_eq!(out.code, Some(0), "{out:?}");
    serde_json::from_str(out.stdout.trim()).unwrap()
}

fn of<'a>(report: &'a serde_json::Value, consumer_type: &str) -> &'a serde_json::Value {
    report["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == consumer_type)
        .unwrap_or_else(|| panic!("{consumer_type} missing from {report}"))
}

fn close(a: &serde_json::Value, b: f64) -> bool {
    (a.as_f64().unwrap() - b).abs() < 1e-9
}

#[tokio::test(flavor = "multi_thread")]
async fn the_figures_are_what_the_test_put_there() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    // Seeded: 10 processed two days ago (outside any window), 4 received three hours ago and never processed.
    sqlx::raw_sql(
        "INSERT INTO inbox_messages SELECT gen_random_uuid(), 'parcel-created-carrier', now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 10);
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'parcel-created-carrier', now() - interval '3 hours', NULL FROM generate_series(1, 4);",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Traffic: 30 parcels, 6 of them sent twice.
    common::publish_parcels(&env, &["--count", "30", "--duplicates", "0.2"]);
    common::consume_until_idle(&env, &["carrier"]);

    let report = stats(&env, &["--window", "5m"]);
    assert_eq!(report["window_seconds"], 300.0);
    let c = of(&report, CARRIER_QUEUE);
    assert_eq!(c["rows"], 44);
    assert_eq!(c["rows_estimated"], false);
    assert_eq!(c["unprocessed"], 4);
    let oldest = c["oldest_unprocessed_seconds"].as_f64().unwrap();
    assert!((10_800.0..10_900.0).contains(&oldest), "{oldest}");
    assert!(close(&c["deliveries_per_second"], 36.0 / 300.0), "{c}");
    assert!(close(&c["duplicates_per_second"], 6.0 / 300.0), "{c}");
    assert!(close(&c["duplicate_ratio"], 6.0 / 36.0), "{c}");
    assert!(close(&c["processed_per_second"], 30.0 / 300.0), "{c}");
    assert_eq!(
        c["queue"],
        serde_json::json!({"name": CARRIER_QUEUE, "partitions": null, "ready": 0, "consumers": 0})
    );
    assert_eq!(c["error_queue"]["name"], format!("{CARRIER_QUEUE}_error"));
    assert_eq!(c["error_queue"]["ready"], 0);

    // Pointed at a vhost that holds neither the queue nor its error queue: nothing is known of either, not "no
    // errors" (a missing error queue was taken for an empty one wherever it was looked for).
    let elsewhere = common::vhosts::take();
    let mut other = env.cmd();
    other
        .env("AMQP_URL", format!("{}/{elsewhere}", common::amqp_base()))
        .args(["stats", "--json"]);
    let out = other.output().unwrap();
    common::vhosts::give_back(&elsewhere, false);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = of(&report, CARRIER_QUEUE);
    assert!(c["queue"]["ready"].is_null(), "{c}");
    assert!(c["error_queue"]["ready"].is_null(), "{c}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_type_written_only_by_ef_core_shows_its_rows_and_unknown_rates() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(include_str!("fixtures/interop/efcore/ef_create_script.sql"))
        .execute(&pool)
        .await
        .unwrap();
    // The tutorial's rows: received, never marked processed.
    sqlx::raw_sql(
        "INSERT INTO inbox_messages VALUES
         ('2cfb215f-8752-4ee3-b6c4-5aaa7de14419', 'parcel-created-carrier', now() - interval '5 minutes', NULL),
         ('f96053db-437a-4812-968c-43d855a3071c', 'parcel-created-carrier', now() - interval '4 minutes', NULL),
         ('06ea232d-7313-4849-baf6-c93ddbad8ff4', 'parcel-created-carrier', now() - interval '3 minutes', NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    // And another service's consumer_type, its rows processed.
    sqlx::raw_sql(
        "INSERT INTO inbox_messages VALUES
         ('0f0b9a3e-5b6f-4e0c-9f7c-3c1f2a1e9d01', 'parcel-created-billing', now(), now()),
         ('0f0b9a3e-5b6f-4e0c-9f7c-3c1f2a1e9d02', 'parcel-created-billing', now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Before `migrate`, without the index: the whole table is read in one pass, and stats says so. Through statements
    // made for the index it was read once for each consumer_type found and again for each figure (at 300M rows, a
    // pass over tens of gigabytes each).
    // The set-up's sessions closed, so that their own scans (the script's index builds) reach the statistics as they
    // end, not at some moment of their idling; counted once no more come.
    pool.close().await;
    let pool = env.pool().await;
    let scans = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'inbox_messages'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let mut before = scans().await;
    loop {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let now = scans().await;
        if now == before {
            break;
        }
        before = now;
    }
    let out = env.run(&["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let after = common::within(Duration::from_secs(10), || async { scans().await > before }).await;
    assert!(after, "the inbox read: {out:?}");
    assert_eq!(
        scans().await - before,
        1,
        "one pass over the table: {out:?}"
    );
    assert!(
        out.stderr
            .contains("no index ix_inbox_messages_consumer_type_processed_at")
            && out.stderr.contains("inboxctl migrate"),
        "{}",
        out.stderr
    );
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let billing = of(&report, "parcel-created-billing");
    assert_eq!(
        (&billing["rows"], &billing["unprocessed"]),
        (&serde_json::json!(2), &serde_json::json!(0)),
        "{billing}"
    );
    assert!(billing["oldest_unprocessed_seconds"].is_null(), "{billing}");
    // Before and after `migrate`: stats works on the .NET service's database as it is. `top`, which collects every
    // second, refuses it until `migrate` built the index its figures are read through: each refresh would otherwise
    // read the whole table.
    for migrated in [false, true] {
        if migrated {
            assert_eq!(env.run(&["migrate"]).code, Some(0));
            let out = env.run(&["stats"]);
            assert!(!out.stderr.contains("no index"), "{}", out.stderr);
        }
        let live = inboxctl::stats::Range {
            live: true,
            ..inboxctl::stats::Range::rates(std::time::Duration::from_secs(60))
        };
        match inboxctl::stats::collect(&pool, None, live).await {
            Ok(_) => assert!(migrated, "collected live without the index"),
            Err(e) => {
                assert!(!migrated, "{e}");
                assert!(
                    e.to_string()
                        .contains("no index ix_inbox_messages_consumer_type_processed_at"),
                    "{e}"
                );
            }
        }
        let report = stats(&env, &[]);
        let c = of(&report, "parcel-created-carrier");
        assert_eq!(c["rows"], 3, "migrated: {migrated}");
        assert_eq!(c["unprocessed"], 3);
        assert!(c["oldest_unprocessed_seconds"].as_f64().unwrap() >= 300.0);
        for unknown in [
            "deliveries_per_second",
            "duplicates_per_second",
            "duplicate_ratio",
            "processed_per_second",
        ] {
            assert!(
                c[unknown].is_null(),
                "{unknown} must be unknown, not 0: {c}"
            );
        }
    }
}

/// A .NET service that leaves a time at `DateTime.MinValue` or `MaxValue` gets `-infinity`/`infinity` in the table
/// (Npgsql's default). One such row made `stats` (and `top`) fail whole ("cannot subtract infinite timestamps"), and
/// `cleanup` and `find` panic (the driver cannot hold it in a time). Now: the figures are there (the row at
/// `-infinity` counted, its age passed over), the cleanup deletes the row processed at `-infinity` and keeps the one
/// processed at `infinity`, and `find` says what the table holds.
#[tokio::test(flavor = "multi_thread")]
async fn rows_at_infinity_from_a_dotnet_writer_neither_blank_the_figures_nor_crash_a_command() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let at_minus_infinity = "0c0ffee0-0000-4000-8000-000000000001";
    let processed_at_infinity = "0c0ffee0-0000-4000-8000-000000000002";
    let processed_at_minus_infinity = "0c0ffee0-0000-4000-8000-000000000003";
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) VALUES
         ('{at_minus_infinity}', 'dotnet-carrier', '-infinity', NULL),
         ('0c0ffee0-0000-4000-8000-000000000004', 'dotnet-carrier', now() - interval '5 minutes', NULL),
         ('{processed_at_infinity}', 'dotnet-carrier', now() - interval '10 days', 'infinity'),
         ('{processed_at_minus_infinity}', 'dotnet-carrier', now() - interval '10 days', '-infinity'),
         ('0c0ffee0-0000-4000-8000-000000000005', 'dotnet-carrier', now() - interval '1 minute', now() - interval '1 minute')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let report = stats(&env, &[]);
    let c = of(&report, "dotnet-carrier");
    assert_eq!(c["rows"], 5, "{c}");
    assert_eq!(c["unprocessed"], 2, "{c}");
    let age = c["oldest_unprocessed_seconds"].as_f64().unwrap();
    assert!((300.0..3600.0).contains(&age), "{c}");

    let out = env.run(&["find", at_minus_infinity, processed_at_infinity]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("received (at ±infinity"), "{out:?}");
    assert!(out.stdout.contains("processed (at ±infinity"), "{out:?}");

    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT id::text FROM inbox_messages WHERE consumer_type = 'dotnet-carrier'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        !left.contains(&processed_at_minus_infinity.to_owned()),
        "{left:?}"
    );
    assert!(left.contains(&processed_at_infinity.to_owned()), "{left:?}");
    assert!(left.contains(&at_minus_infinity.to_owned()), "{left:?}");
}

/// The planner's statistics are found for an inbox in a schema whose name needs quoting (EF Core's `Messaging`).
/// `regnamespace::text` quotes the name (`"Messaging"`) where `pg_stats` holds it raw: no statistics were ever
/// matched there, and above a million rows every count fell back to the capped count (`~1.0M` for 10M rows).
#[tokio::test(flavor = "multi_thread")]
async fn estimates_are_found_in_a_schema_whose_name_needs_quoting() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "CREATE SCHEMA \"Messaging\"; SET search_path = \"Messaging\";
         CREATE TABLE inbox_messages (id uuid NOT NULL, consumer_type varchar(500) NOT NULL,
             received_at timestamptz NOT NULL, processed_at timestamptz, PRIMARY KEY (id, consumer_type));
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'carrier', now(), now() FROM generate_series(1, 2000);
         ANALYZE inbox_messages;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let estimates = inboxctl::db::stats::estimates(&mut *conn).await.unwrap();
    assert_eq!(estimates.len(), 1);
    assert_eq!(
        estimates[0].common_values.as_deref(),
        Some(&["carrier".to_owned()][..]),
        "{:?}",
        estimates[0]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn above_a_million_rows_a_count_is_an_estimate_and_says_so() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inbox_messages SELECT gen_random_uuid(), 'big', now(), now() FROM generate_series(1, 1100000);
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'small', now(), now() FROM generate_series(1, 500);
         ANALYZE inbox_messages;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let report = stats(&env, &[]);
    let big = of(&report, "big");
    assert_eq!(big["rows_estimated"], true);
    let rows = big["rows"].as_f64().unwrap();
    assert!((1_000_000.0..1_250_000.0).contains(&rows), "{rows}");
    let small = of(&report, "small");
    assert_eq!(
        (small["rows"].clone(), small["rows_estimated"].clone()),
        (500.into(), false.into())
    );
}

/// A consumer_type the statistics do not list among their most common values (more consumer_types than they keep;
/// here a statistics target of 1) is given the average share of those they do not list: on a large table (its row
/// estimate set to 10M, as after an ANALYZE of one) a consumer_type of one row was shown as millions, "estimated",
/// and never counted. It is counted now, up to a tenth of the cap, and shown exactly.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_consumer_type_the_statistics_do_not_list_is_counted_not_given_the_average_share() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "ALTER TABLE inbox_messages ALTER consumer_type SET STATISTICS 1;
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'wide-a', now(), now() FROM generate_series(1, 3000);
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'wide-b', now(), now() FROM generate_series(1, 3000);
         INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'small', now(), now());
         ANALYZE inbox_messages;
         UPDATE pg_class SET reltuples = 10000000 WHERE oid = 'inbox_messages'::regclass;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listed: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT most_common_vals::text::text[] FROM pg_stats
         WHERE tablename = 'inbox_messages' AND attname = 'consumer_type'",
    )
    .fetch_optional(&pool)
    .await
    .unwrap()
    .flatten();
    assert!(
        !listed.unwrap_or_default().iter().any(|v| v == "small"),
        "the statistics list the small consumer_type: the test's premise does not hold"
    );
    let report = stats(&env, &[]);
    let small = of(&report, "small");
    assert_eq!(
        (small["rows"].clone(), small["rows_estimated"].clone()),
        (1.into(), false.into()),
        "{small}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_table_shows_escape_sequences_inert_and_an_unreachable_broker_is_partial() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql("INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'ops' || chr(27) || '[2J' || chr(27) || ']0;pwned' || chr(7), now(), NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let out = env.run(&["stats"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains("ops\\u{1b}[2J\\u{1b}]0;pwned\\u{7}"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains('\u{1b}') && !out.stdout.contains('\u{7}'));

    let mut cmd = env.cmd();
    cmd.args(["stats", "--json"])
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f");
    let out = cmd.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["broker_error"].is_string());
    assert!(report["consumers"][0]["queue"]["ready"].is_null());
    // The same keys as a partitioned consumer_type's (`partitions` null here): a strict reader of the shape did not
    // meet the key until a consumer_type was partitioned.
    for queue in ["queue", "error_queue"] {
        let keys: Vec<&String> = report["consumers"][0][queue]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(
            keys,
            ["consumers", "name", "partitions", "ready"],
            "{report}"
        );
    }
    assert_eq!(
        report["consumers"][0]["rows"], 1,
        "the database figures are still there"
    );

    // Why it could not connect is said (each cause has its own remedy), its password masked: a refused login was
    // "RabbitMQ not reachable" like a broker that is down.
    let wrong = env
        .amqp_url
        .replacen("guest:guest@", "guest:not-the-password@", 1);
    assert_ne!(wrong, env.amqp_url, "the test's URL names guest:guest");
    let mut cmd = env.cmd();
    cmd.args(["stats", "--json"]).env("AMQP_URL", &wrong);
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let said = report["broker_error"].as_str().unwrap();
    assert!(said.contains("refused the login"), "{said}");
    assert!(!said.contains("not-the-password"), "{said}");
}

/// A window longer than PostgreSQL's timestamps reach (or shorter than a second, whose per-bucket arithmetic
/// overflows) is a usage error naming the range, for `stats` and `top` alike; the longest window taken works.
#[tokio::test(flavor = "multi_thread")]
async fn a_window_past_the_bounds_is_refused_and_names_them() {
    let env = TestEnv::migrated().await;
    // A consumer_type with inboxctl's counters, whose rates are read over the window.
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "2"]);
    common::consume_until_idle(&env, &["carrier"]);
    for (args, says) in [
        (
            &["stats", "--window", "1000000y"][..],
            "from 1s to 100years",
        ),
        (
            &["stats", "--window", "101y", "--json"],
            "from 1s to 100years",
        ),
        (&["stats", "--window", "999ms"], "from 1s to 100years"),
        (&["top", "--window", "1000000y"], "from 1s to 100years"),
        (&["top", "--interval", "1ns"], "from 100ms to 100years"),
    ] {
        let out = env.run(args);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("out of range"), "{}", out.stderr);
    }
    let report = stats(&env, &["--window", "100y"]);
    let carrier = of(&report, CARRIER_QUEUE);
    assert_eq!(carrier["rows"], 2, "{report}");
    assert!(
        carrier["deliveries_per_second"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    // A window longer than the retention (7d unless given) counts what a cleanup left: said.
    let out = env.run(&["stats", "--json", "--window", "30d"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr.contains("is longer than the retention 7days"),
        "{}",
        out.stderr
    );
    let out = env.run(&["stats", "--json", "--window", "30d", "--retention", "30d"]);
    assert!(
        !out.stderr.contains("longer than the retention"),
        "{}",
        out.stderr
    );
}

/// Past the cap of an exact count, a figure is PostgreSQL's estimate, when there is a larger one; with none (a table
/// not analyzed since it grew: a .NET service's backlog building up), the count up to the cap was shown as if it were
/// an estimate ("~11"), flat while the backlog grew. It is a floor, and says so (`≥11`, `*_at_least`).
#[tokio::test(flavor = "multi_thread")]
async fn a_count_past_its_cap_without_an_estimate_is_a_floor_not_an_estimate() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "ALTER TABLE inbox_messages SET (autovacuum_enabled = false);
         INSERT INTO inbox_messages SELECT gen_random_uuid(), 'backlog', now(), NULL FROM generate_series(1, 1000);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let range = inboxctl::stats::Range {
        exact_below: 10,
        ..inboxctl::stats::Range::rates(std::time::Duration::from_secs(60))
    };
    let snapshot = inboxctl::stats::collect(&pool, None, range).await.unwrap();
    let c = &snapshot.consumers[0];
    assert_eq!(
        (
            c.unprocessed,
            c.unprocessed_estimated,
            c.unprocessed_at_least
        ),
        (Some(11), false, true)
    );
    assert_eq!(
        (c.rows, c.rows_estimated, c.rows_at_least),
        (Some(11), false, true)
    );
    // Analyzed, the estimate is the figure.
    sqlx::raw_sql("ANALYZE inbox_messages")
        .execute(&pool)
        .await
        .unwrap();
    let snapshot = inboxctl::stats::collect(&pool, None, range).await.unwrap();
    let c = &snapshot.consumers[0];
    assert!(c.unprocessed_estimated && !c.unprocessed_at_least, "{c:?}");
    assert!(c.unprocessed.is_some_and(|n| n > 500), "{c:?}");
}

/// The broker's half cut short by its bound (`top`'s): its heads were not all looked at, and the snapshot says so —
/// it said "looked at", and the dashboard forgot the age of every error queue it had not reached (a red PAST warning
/// gone blank on one slow refresh).
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_half_cut_short_does_not_say_its_heads_were_looked_at() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         VALUES (gen_random_uuid(), 'cut-short', now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let conn = env.amqp().await;
    // No time at all: the looks' first call waits on the network, so the bound is always past when it is next looked
    // at (1 ms was enough for RabbitMQ on this machine on a fast day, and the test failed once).
    let range = inboxctl::stats::Range {
        broker_within: Some(std::time::Duration::ZERO),
        ..inboxctl::stats::Range::rates(std::time::Duration::from_secs(60))
    };
    let snapshot = inboxctl::stats::collect(&pool, Some(&conn), range)
        .await
        .unwrap();
    assert!(snapshot.broker_cut_short, "{snapshot:?}");
    assert!(!snapshot.heads_looked, "{snapshot:?}");
    assert_eq!(snapshot.consumers[0].rows, Some(1), "the database's half");
    // Unbounded, the same looks finish.
    let range = inboxctl::stats::Range {
        broker_within: None,
        ..range
    };
    let snapshot = inboxctl::stats::collect(&pool, Some(&conn), range)
        .await
        .unwrap();
    assert!(
        !snapshot.broker_cut_short && snapshot.heads_looked,
        "{snapshot:?}"
    );
}

/// Rates read every row of the window, every refresh: `top` on a consumer_type processing thousands a second read
/// hundreds of thousands of index entries a second, and `top --window 7d` the whole inbox each refresh. A refresh
/// reads the newest 50,000 processed rows (and, apart, events) at most now, and estimates the rest at their rate,
/// marked so (`rates_estimated`, `~` on the table). Here `busy` processed 60,000 over the last two minutes, 500 a
/// second, and `chatty` discarded as many duplicates: the live look reads the newest 50,000 of each and estimates the
/// rest; the one-off `stats` (1,000,000 at most) counts them all.
#[tokio::test(flavor = "multi_thread")]
async fn a_busy_consumer_types_rates_are_read_from_its_newest_rows_and_the_rest_estimated() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // The rows are timed back from the insert's own now(): each second the looks come later, 500 fewer are in their
    // window (a loaded machine took four seconds once).
    let inserted = std::time::Instant::now();
    let late = || 500 * inserted.elapsed().as_secs();
    sqlx::raw_sql(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
         VALUES ('busy', 'busy-queue', now(), now()), ('chatty', 'chatty-queue', now(), now());
         INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         SELECT gen_random_uuid(), 'busy', t, t
         FROM (SELECT now() - make_interval(secs => i / 500.0) AS t FROM generate_series(1, 60000) i) s;
         INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         VALUES (gen_random_uuid(), 'chatty', now() - interval '1 day', now() - interval '1 day');
         INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
         SELECT 'chatty', 'duplicate', gen_random_uuid(), now() - make_interval(secs => i / 500.0)
         FROM generate_series(1, 60000) i;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let window = std::time::Duration::from_secs(110);
    let live = inboxctl::stats::Range {
        live: true,
        span: std::time::Duration::from_secs(120),
        bucket: std::time::Duration::from_secs(1),
        ..inboxctl::stats::Range::rates(window)
    };
    let once = inboxctl::stats::Range::rates(window);
    // Over `top`'s default minute, the 50,000 read reach further back than the window: its rates are exact, though
    // the series beyond it is estimated.
    let minute = inboxctl::stats::Range {
        window: std::time::Duration::from_secs(60),
        ..live
    };
    let snapshot = inboxctl::stats::collect(&pool, None, minute).await.unwrap();
    let busy = snapshot
        .consumers
        .iter()
        .find(|c| c.consumer_type == "busy")
        .unwrap();
    assert!(!busy.rates_estimated, "{busy:?}");
    let n = busy.window.unwrap().processed;
    assert!((29_000 - late()..=31_000).contains(&n), "{n}");
    for (range, estimated) in [(live, true), (once, false)] {
        let snapshot = inboxctl::stats::collect(&pool, None, range).await.unwrap();
        for (name, of) in [
            (
                "busy",
                (|c: &inboxctl::stats::Counts| c.processed) as fn(&_) -> u64,
            ),
            ("chatty", |c| c.duplicates),
        ] {
            let c = snapshot
                .consumers
                .iter()
                .find(|c| c.consumer_type == name)
                .unwrap();
            assert_eq!(c.rates_estimated, estimated, "{c:?}");
            // 55,000 in the window (110 s at 500 a second), the 50,000 read reaching back 100 s; the rest estimated,
            // within a few %.
            let n = of(&c.window.unwrap());
            assert!((53_000 - late()..=57_000).contains(&n), "{n}: {c:?}");
            if estimated {
                assert_eq!(c.series.len(), 120);
                let oldest: u64 = c.series[..10].iter().map(|(d, _)| d).sum();
                // The oldest ten seconds lie past the 50,000 read: 5,000 estimated.
                assert!(
                    (4_500..=5_500).contains(&oldest),
                    "{oldest}: {:?}",
                    c.series
                );
            }
        }
    }
}

/// `top` gives up on a refresh that takes too long, but the statement it stopped waiting for went on, on the server:
/// behind a lock (a `migrate`, a `VACUUM FULL`), each refresh queued another, the pool's connections all held. Its
/// sessions carry a `statement_timeout` now (`Database::with_statement_timeout`, `top::STATEMENT_TIMEOUT`): behind a
/// lock held longer, the statement ends on the server, and the figures fail, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn a_dashboards_statement_held_behind_a_lock_ends_on_the_server() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         VALUES (gen_random_uuid(), 'held', now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE inbox_messages IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let db = inboxctl::db::Database::from_url(&env.database_url)
        .unwrap()
        .with_statement_timeout(std::time::Duration::from_secs(1));
    let dashboard = db.pool(1).await.unwrap();
    let range = inboxctl::stats::Range::rates(std::time::Duration::from_secs(60));
    let collected = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        inboxctl::stats::collect(&dashboard, None, range),
    )
    .await
    .expect("the statement ends on the server, not when the lock goes");
    let error = collected.expect_err("refused after a second behind the lock");
    assert!(error.to_string().contains("statement timeout"), "{error}");
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(waiting, 0, "nothing left waiting behind the lock");
    holder.rollback().await.unwrap();
}

/// Each look at a quorum queue's message raises its `x-delivery-count` (every return counts, before RabbitMQ 4.3), and
/// RabbitMQ 4.0–4.2 drop a message past its queue's delivery-limit, 20 by default: `top`, looking at each error
/// queue's head every 30 s, got a dead-lettered message there in about ten minutes. A head delivered 10 times or more
/// is not looked at again by the process now (one `collect` after another here, as `top`'s refreshes are), and
/// `failures` says how near the limit the messages it looked at are.
#[tokio::test(flavor = "multi_thread")]
async fn a_dashboard_stops_looking_at_a_head_delivered_ten_times() {
    use lapin::options::{BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
         VALUES ('worn', 'worn', now(), now());
         INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         VALUES (gen_random_uuid(), 'worn', now(), now());",
    )
    .execute(&pool)
    .await
    .unwrap();
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    let mut quorum = lapin::types::FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            "worn_error".into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            quorum,
        )
        .await
        .unwrap();
    common::publish(
        &conn,
        "",
        "worn_error",
        lapin::BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_timestamp(chrono::Utc::now().timestamp().unsigned_abs()),
        b"{}",
    )
    .await;
    // A look of the test's: the message's count of earlier deliveries, and one more.
    let look = || async {
        let got = channel
            .basic_get("worn_error".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("the message is there");
        let before =
            inboxctl::amqp::failure::delivery_count(got.delivery.properties.headers().as_ref());
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
        before.unwrap_or(0)
    };
    // Each return is applied by the queue after the nack that asked for it: waited for before the next look.
    let back = || {
        common::eventually(
            "the message back in the queue",
            std::time::Duration::from_secs(10),
            || async { env.queue_counts("worn_error") == (1, 0) },
        )
    };
    for _ in 0..10 {
        look().await;
        back().await;
    }
    let range = inboxctl::stats::Range::rates(std::time::Duration::from_secs(60));
    let first = inboxctl::stats::collect(&pool, Some(&conn), range)
        .await
        .unwrap();
    back().await;
    let c = &first.consumers[0];
    assert!(
        c.head_looked && c.oldest_dead_letter_seconds.is_some(),
        "{c:?}"
    );
    let again = inboxctl::stats::collect(&pool, Some(&conn), range)
        .await
        .unwrap();
    assert!(!again.consumers[0].head_looked, "{:?}", again.consumers[0]);
    back().await;
    assert_eq!(
        look().await,
        11,
        "ten looks of the test's and one of the dashboard's"
    );
    back().await;

    let out = env.run(&["failures", "--from", "worn_error", "--json"]);
    let listing: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(listing["most_deliveries"], 12, "{out:?}");
    assert!(out.stderr.contains("delivered 12 times before"), "{out:?}");
    let out = env.run(&["cleanup", "--retention", "7d", "--dry-run"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("delivered 13 times before"), "{out:?}");
}

/// A consumer_type whose consumer reads its queue in another vhost (`prod`) while `stats` looks in this one, where a
/// queue of the same name exists (a staging copy): its depths, error count and oldest failure came from the other
/// environment's queues, and the look at that error queue's head took one of its messages. The recorded vhost is
/// compared now: those figures are unknown (`other_vhost` says why), and nothing of this vhost's queue is taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_type_read_in_another_vhost_shows_no_figures_from_a_queue_of_the_same_name_here()
{
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, vhost, first_seen_at, last_seen_at)
         VALUES ('elsewhere', 'shared-name', 'prod-elsewhere', now(), now());
         INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         VALUES (gen_random_uuid(), 'elsewhere', now(), now());",
    )
    .execute(&pool)
    .await
    .unwrap();
    let conn = env.amqp().await;
    for queue in ["shared-name", "shared-name_error"] {
        inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, queue, common::queue_type())
            .await
            .unwrap();
    }
    common::publish(
        &conn,
        "",
        "shared-name_error",
        lapin::BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_timestamp(chrono::Utc::now().timestamp().unsigned_abs()),
        b"{}",
    )
    .await;
    let report = stats(&env, &[]);
    let c = of(&report, "elsewhere");
    assert_eq!(c["other_vhost"], "prod-elsewhere", "{c}");
    assert!(c["error_queue"]["ready"].is_null(), "{c}");
    assert!(c["queue"]["ready"].is_null(), "{c}");
    assert!(c["oldest_dead_letter_seconds"].is_null(), "{c}");
    let held = common::peek(&conn, "shared-name_error").await;
    assert_eq!(held.len(), 1);
    assert!(!held[0].redelivered, "the message here was not looked at");
    let out = env.run(&["stats"]);
    assert!(out.stdout.contains("(in vhost prod-elsewhere)"), "{out:?}");
}

/// The counts of a consumer_type's calls not done read every such call on every refresh: millions after a carrier's
/// outage, `failed` or `in_doubt` until an operator settles them. Each count stops at 10,000 now (a floor, marked), each
/// read through an index of its own state — so calls in doubt made after a mass of failed ones are counted and aged,
/// not hidden behind them.
#[tokio::test(flavor = "multi_thread")]
async fn the_counts_of_calls_not_done_stop_at_a_cap_and_still_see_the_ones_in_doubt() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
         VALUES ('carrier', 'carrier', now(), now());
         INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         VALUES (gen_random_uuid(), 'carrier', now(), now());
         INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, created_at)
         SELECT gen_random_uuid(), 'carrier', gen_random_uuid(), 'at-most-once', 'failed', '{}', 5,
                now() - interval '2 days' + g * interval '1 ms'
         FROM generate_series(1, 10050) g;
         INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, created_at)
         SELECT gen_random_uuid(), 'carrier', gen_random_uuid(), 'at-most-once', s, '{}', 1, now() - interval '1 hour'
         FROM unnest(ARRAY['in_doubt', 'in_doubt', 'pending']) s;
         ANALYZE inboxctl_effects;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let range = inboxctl::stats::Range::rates(std::time::Duration::from_secs(60));
    let snapshot = inboxctl::stats::collect(&pool, None, range).await.unwrap();
    let effects = snapshot.consumers[0].effects.unwrap();
    assert_eq!(
        (effects.failed, effects.at_least),
        (10_000, true),
        "{effects:?}"
    );
    assert_eq!((effects.in_doubt, effects.pending), (2, 1), "{effects:?}");
    assert!(
        effects
            .oldest_in_doubt_seconds
            .is_some_and(|s| (3_500.0..3_700.0).contains(&s)),
        "{effects:?}"
    );
    let report = stats(&env, &[]);
    assert_eq!(of(&report, "carrier")["effects_at_least"], true, "{report}");
    let out = env.run(&["stats"]);
    assert!(
        out.stdout.contains("2 (60m) IN DOUBT") && !out.stdout.contains("≥2"),
        "an exact count is not marked:\n{}",
        out.stdout
    );
}
