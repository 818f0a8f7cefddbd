//! `inboxctl demo`: one line of JSON from the database, R = S = N, also on a second run against the same database
//! and broker.

use crate::common;

use common::TestEnv;

#[tokio::test(flavor = "multi_thread")]
async fn demo_ends_with_one_effect_per_parcel_twice_in_a_row() {
    let env = TestEnv::bare().await;
    for run in 1..=2 {
        let out = env.run(&["demo", "--parcels", "60", "--duplicates", "0.25"]);
        assert_eq!(out.code, Some(0), "run {run}: {out:?}");
        let lines: Vec<&str> = out.stdout.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stdout: {:?}", out.stdout);
        let tally: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(tally["parcels"], 60, "run {run}");
        assert_eq!(tally["carrier_reservations"], 60, "run {run}");
        assert_eq!(tally["notifications_sent"], 60, "run {run}");
        // 15 copies sent again, each discarded once by each of the two consumers.
        assert_eq!(tally["duplicates_discarded"], 30, "run {run}");
        assert!(tally["seconds"].as_f64().unwrap() > 0.0);
    }
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        120
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT parcel_id) FROM notifications_sent"
        )
        .await,
        120
    );
}

/// `demo --carrier http`: the carrier consumer books with a stand-in carrier API on loopback; the JSON line adds the
/// bookings it counted, one per parcel.
#[tokio::test(flavor = "multi_thread")]
async fn demo_against_a_carrier_on_http_counts_its_bookings() {
    let env = TestEnv::bare().await;
    let out = env.run(&[
        "demo",
        "--parcels",
        "40",
        "--duplicates",
        "0.25",
        "--carrier",
        "http",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let tally: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(tally["parcels"], 40, "{tally}");
    assert_eq!(tally["carrier_bookings"], 40, "{tally}");
    assert_eq!(tally["carrier_reservations"], 40, "{tally}");
    assert_eq!(tally["notifications_sent"], 40, "{tally}");
    let pool = env.pool().await;
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_effects WHERE mode = 'keyed' AND state = 'done'"
        )
        .await,
        40
    );
}

/// A demo that did not show one effect per parcel says so and ends 3, not 0: here another consumer of the carrier's
/// queue (booking with the stand-in that writes a row) takes some of the run's messages, so the stand-in carrier on
/// HTTP counts fewer bookings than parcels.
#[tokio::test(flavor = "multi_thread")]
async fn a_demo_whose_counts_fall_short_says_so_and_does_not_end_zero() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let other = env.spawn(&["consume", "carrier"]);
    other.wait_for_stderr("consuming", std::time::Duration::from_secs(20));
    let out = env.run(&[
        "demo",
        "--parcels",
        "200",
        "--duplicates",
        "0",
        "--carrier",
        "http",
    ]);
    other.terminate();
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stderr.contains("another process already consumes"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("the demo did not show one effect per parcel: the carrier counted"),
        "{}",
        out.stderr
    );
    let tally: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(tally["carrier_bookings"].as_u64().unwrap() < 200, "{tally}");
}
