//! `inboxctl-bench` runs end to end on a small load and writes the JSON shape the reports are read from (the figures
//! themselves are measured by running it, not by a test: see docs/performance.md); and its command line keeps
//! inboxctl's contract: no password shown, no panic on any flag value, values that cannot work refused at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::TestEnv;

#[tokio::test(flavor = "multi_thread")]
async fn a_small_bench_writes_every_mode_and_the_machine() {
    let env = TestEnv::bare().await;
    let output = std::env::temp_dir().join(format!("{}.json", env.db_name));
    let out = env.run(&[
        "--messages",
        "300",
        "--repeats",
        "1",
        "--warmup",
        "50",
        "--latency-rate",
        "100",
        "--latency-seconds",
        "1",
        "--duplicate-messages",
        "100",
        "--concurrency",
        "4",
        "--output",
        output.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&output).unwrap()).unwrap();
    let _ = std::fs::remove_file(&output);
    assert_eq!(report["machine"]["synchronous_commit"], "on");
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);
    for mode in [
        "ceiling",
        "ceiling-batched",
        "bare",
        "tutorial",
        "inbox",
        "inbox-batched",
        "peer",
    ] {
        let m = &report["modes"][mode];
        assert!(
            m["throughput"]["median"].as_f64().unwrap() > 0.0,
            "{mode}: {m}"
        );
        assert_eq!(m["repeats"].as_array().unwrap().len(), 1);
    }
    for mode in ["inbox", "inbox-batched"] {
        assert_eq!(
            report["modes"][mode]["duplicate_effects"], 0,
            "{mode}: exactly once"
        );
        assert!(report["modes"][mode]["p99_ms"]["median"].as_f64().unwrap() > 0.0);
        assert!(report["modes"][mode]["rss_mb"].as_f64().unwrap() > 1.0);
    }
    assert!(
        report["modes"]["bare"]["duplicate_effects"]
            .as_u64()
            .unwrap()
            > 0,
        "bare repeats effects"
    );
    assert!(report["ratios"]["inbox/bare"]["median"].as_f64().unwrap() > 0.0);
    // The peer ran for real (its effects are what the throughput counts), with its settings reported beside it.
    let peer = &report["modes"]["peer"];
    assert!(peer["rss_mb"].as_f64().unwrap() > 1.0, "{peer}");
    assert!(peer["p99_ms"]["median"].as_f64().unwrap() > 0.0, "{peer}");
    assert!(peer["duplicate_effects"].as_u64().is_some(), "{peer}");
    assert_eq!(
        report["settings"]["peer"]["package"],
        "pg-transactional-outbox@0.5.7"
    );
    assert_eq!(report["settings"]["peer"]["listener"], "polling");
    assert_eq!(report["settings"]["peer"]["batch_size"], 4);
    assert!(report["ratios"]["inbox/peer"]["median"].as_f64().unwrap() > 0.0);
    // The scratch databases are gone.
    let admin = common::admin_pool().await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname LIKE $1")
        .bind(format!("{}_bench_%", env.db_name))
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

/// The bench's error path, at the most verbose logging in both formats, and its help: the passwords of both URLs
/// appear nowhere.
#[test]
fn the_bench_shows_no_password_on_its_error_path_or_in_its_help() {
    let db_secret = "DbS3cretPw9";
    let mq_secret = "MqS3cretPw9";
    let db = format!("postgres://app:{db_secret}@127.0.0.1:1/parceltracker");
    let mq = format!("amqp://app:{mq_secret}@127.0.0.1:1/%2f");
    let env = [("DATABASE_URL", db.as_str()), ("AMQP_URL", mq.as_str())];
    let args = ["--modes", "inbox", "--messages", "10", "--repeats", "1"];
    for format in ["text", "json"] {
        let mut all = vec!["-vv", "--log-format", format];
        all.extend_from_slice(&args);
        let out = common::run(&all, &env);
        assert_ne!(out.code, Some(0), "{all:?} must fail: {out:?}");
        for secret in [db_secret, mq_secret] {
            assert!(
                !out.stdout.contains(secret) && !out.stderr.contains(secret),
                "{all:?} showed a password: {out:?}"
            );
        }
    }
    let out = common::run(&["--help"], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    for secret in [db_secret, mq_secret] {
        assert!(!out.stdout.contains(secret), "--help showed a password");
    }
}

/// The hostile values every numeric and duration flag is given.
const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "0.5",
    "1e10",
    "1e-20",
    "NaN",
    "inf",
    "1e309",
    "65536",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
];
const DURATIONS: &[&str] = &[
    "0s",
    "-1s",
    "1ns",
    "1ms",
    "100y",
    "1000000y",
    "584542046090y",
    "99999999999999999999d",
];

/// Every numeric and duration flag of the bench, given each value of a hostile list (overflowing, NaN, infinite, zero,
/// negative, tiny, centuries), against servers that refuse at once: no panic (exit 101, "panicked"), no abort, no
/// hang — each value is either refused as a usage error or taken and the bench fails to connect. (A bench takes
/// minutes, so the values are bounded before anything connects; they are not run against the real servers.)
#[test]
fn no_hostile_flag_value_makes_the_bench_panic() {
    const FLAGS: &[&str] = &[
        "--messages",
        "--repeats",
        "--concurrency",
        "--prefetch",
        "--batch-size",
        "--warmup",
        "--latency-rate",
        "--latency-seconds",
        "--duplicate-messages",
        "--duplicates",
        "--cleanup-rows",
        "--cleanup-batch-size",
        "--cleanup-batch-pause",
        "--cleanup-repeats",
    ];
    // What makes a run end by itself.
    let ends = ["--modes", "ceiling", "--messages", "10", "--repeats", "1"];
    let mut runs: Vec<Vec<String>> = Vec::new();
    for flag in FLAGS {
        let values = if *flag == "--cleanup-batch-pause" {
            DURATIONS
        } else {
            NUMBERS
        };
        for value in values {
            let mut args = Vec::new();
            // The flag under test replaces the same flag among the ones that end the run.
            for pair in ends.chunks(2) {
                if pair[0] != *flag {
                    args.extend(pair.iter().map(|s| (*s).to_owned()));
                }
            }
            // `--flag=value`, so that a value starting with `-` is taken as one.
            args.push(format!("{flag}={value}"));
            runs.push(args);
        }
    }
    let refused = refused_servers();
    let refused = &refused;
    std::thread::scope(|scope| {
        for chunk in runs.chunks(runs.len().div_ceil(4)) {
            scope.spawn(move || {
                for args in chunk {
                    let out = common::run_for(&args_of(args), refused, 30);
                    let panicked =
                        matches!(out.code, Some(101 | 134)) || out.stderr.contains("panicked");
                    assert!(!panicked, "{args:?}: {out:?}");
                    assert!(
                        out.code.is_some(),
                        "{args:?} hung, refused by the servers: {out:?}"
                    );
                }
            });
        }
    });
}

/// Values that panicked, aborted or looped once — some only minutes into a bench — are refused before anything
/// connects (exit 64).
#[test]
fn values_that_cannot_work_are_refused_at_once() {
    let refused = refused_servers();
    for args in [
        &["--warmup=18446744073709551615"][..],
        &["--messages=18446744073709551615"],
        &["--duplicate-messages=18446744073709551615"],
        &["--latency-rate=NaN"],
        &["--latency-rate=1e10"],
        &["--latency-seconds=18446744073709551615"],
        &["--latency-rate=1000000", "--latency-seconds=86400"],
        // A cleanup measured without the baseline its p99 is set against.
        &["--cleanup-rows=1000", "--cleanup-variants=partition-drop"],
    ] {
        let out = common::run_for(args, &refused, 30);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
    }
}

fn args_of(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A role and a vhost that do not exist: the servers refuse at once, and nothing can be created.
fn refused_servers() -> [(&'static str, String); 2] {
    [
        (
            "DATABASE_URL",
            format!("{}/parceltracker", common::pg_base()).replacen(
                "postgres@",
                "inboxctl_no_such_role@",
                1,
            ),
        ),
        (
            "AMQP_URL",
            format!("{}/inboxctl-no-such-vhost", common::amqp_base()),
        ),
    ]
}
