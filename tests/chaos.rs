//! Chaos: two consumer processes per consumer (carrier and notification), one of the four killed with SIGKILL at
//! random every second or two and started again, while 2,000 parcels with 30 % duplicates (half of the copies at
//! once, half after the rest) flow through at a steady rate. The end is the same check as every fault test: exactly
//! one effect per parcel per consumer, nothing left on the queues, nothing in the error or skipped queues. In both
//! modes: one transaction per message, and batched.

use crate::common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{CARRIER_QUEUE, NOTIFICATION_QUEUE, Proc, TestEnv};

const PARCELS: i64 = 2_000;

/// A small xorshift generator: the test prints its seed, so a failing run can be replayed (`CHAOS_SEED`).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn consumer(env: &TestEnv, kind: &str, mode: &[&str]) -> Proc {
    env.spawn(&common::with_mode(
        &["consume", kind, "--concurrency", "4", "--prefetch", "16"],
        mode,
    ))
}

// In both modes: batched, a kill takes a whole uncommitted batch down with it, and its members come back redelivered.
in_both_modes!(
    two_processes_per_consumer_one_killed_at_random_every_effect_once,
    chaos
);

async fn chaos(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("chaos seed {seed} (CHAOS_SEED={seed} replays the same kill schedule)");
    let mut rng = Rng(seed);

    let kinds = ["carrier", "carrier", "notification", "notification"];
    let mut consumers: Vec<Proc> = kinds.iter().map(|k| consumer(&env, k, mode)).collect();
    let started = Instant::now();
    // 2,600 deliveries per queue at 200/s: about 13 s of traffic to kill consumers in.
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        &PARCELS.to_string(),
        "--duplicates",
        "0.3",
        "--rate",
        "200",
    ]);

    let mut kills = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(1_000 + rng.below(1_000))).await;
        let victim = usize::try_from(rng.below(kinds.len() as u64)).unwrap();
        consumers[victim].kill();
        kills += 1;
        consumers[victim] = consumer(&env, kinds[victim], mode);
        if publisher.try_wait().is_some() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the publisher did not finish"
        );
    }
    assert_eq!(publisher.wait(Duration::from_secs(10)), Some(0));

    let pool = env.pool().await;
    common::eventually(
        "every parcel's effects, and empty queues",
        Duration::from_secs(120),
        || async {
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= PARCELS
                && common::count(&pool, "SELECT count(*) FROM notifications_sent").await >= PARCELS
                && env.queue_counts(CARRIER_QUEUE) == (0, 0)
                && env.queue_counts(NOTIFICATION_QUEUE) == (0, 0)
        },
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    for table in ["carrier_reservations", "notifications_sent"] {
        let (rows, parcels): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT parcel_id) FROM {table}"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((rows, parcels), (PARCELS, PARCELS), "{table}: exactly once");
    }
    for queue in [CARRIER_QUEUE, NOTIFICATION_QUEUE] {
        for dead in [format!("{queue}_error"), format!("{queue}_skipped")] {
            assert!(
                !env.queue_exists(&dead) || env.queue_counts(&dead) == (0, 0),
                "{dead} must stay empty: a message in flight when its process was killed is not poison"
            );
        }
    }
    let discarded = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    let failed = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind <> 'duplicate'",
    )
    .await;
    assert_eq!(failed, 0, "a kill never counts against a message");
    // 600 copies per consumer were published; kills after a commit and before its ack add redeliveries.
    assert!(
        discarded >= 2 * 600,
        "every published copy was discarded: {discarded}"
    );
    assert!(kills >= 5, "only {kills} kills");
    eprintln!(
        "chaos {mode:?}: {PARCELS} parcels, {} effects, {discarded} duplicates discarded, {kills} kills, {seconds:.1} s",
        2 * PARCELS
    );
    for mut c in consumers {
        c.terminate();
        c.wait(Duration::from_secs(30));
    }
}
