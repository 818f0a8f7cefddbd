//! `inboxctl bench` runs end to end on a small load and writes the JSON shape the reports are read from. (The figures
//! themselves are measured by running it, not by a test: see docs/performance.md.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::TestEnv;

#[tokio::test(flavor = "multi_thread")]
async fn a_small_bench_writes_every_mode_and_the_machine() {
    let env = TestEnv::bare().await;
    let output = std::env::temp_dir().join(format!("{}.json", env.db_name));
    let out = env.run(&[
        "bench",
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
