//! The fault tests' choreography: parcels (and copies) on the carrier's queue, a consumer taking them, a fault the
//! test makes mid-stream, and the end every fault test asserts — each parcel's effect exactly once, nothing left on
//! the queue, nothing dead-lettered or counted against a message.
//!
//! ```text
//! let stream = FaultStream::new(600, mode).start(&env, env.pool().await).await; // a first part processed
//! // … the fault, and its end, with stream.consumer, stream.pool, stream.effects() …
//! stream.end("every message processed after the outage").await;
//! ```

use std::time::Duration;

use sqlx::postgres::PgPool;

use super::{CARRIER_QUEUE, Proc, TestEnv, count, eventually, publish_parcels, with_mode};

/// What flows: `parcels` parcels published to both endpoints (declared by the test) before the carrier consumer
/// starts, in `mode`.
pub struct FaultStream<'a> {
    pub parcels: i64,
    /// `publish --duplicates`: the share of parcels published a second time.
    pub duplicates: Option<&'a str>,
    pub mode: &'a [&'a str],
    /// The consumer's environment beyond the test's: a URL through a proxy, or to a private server.
    pub consumer_env: &'a [(&'a str, &'a str)],
}

impl<'a> FaultStream<'a> {
    pub fn new(parcels: i64, mode: &'a [&'a str]) -> Self {
        Self {
            parcels,
            duplicates: None,
            mode,
            consumer_env: &[],
        }
    }
}

impl FaultStream<'_> {
    /// Publishes, starts the consumer (`--concurrency 2 --prefetch 8`), and returns once a first part (50
    /// effects) is processed, seen through `pool` (on the database the consumer uses).
    pub async fn start(self, env: &TestEnv, pool: PgPool) -> MidStream<'_> {
        let parcels = self.parcels.to_string();
        let mut publish = vec!["--count", parcels.as_str()];
        if let Some(share) = self.duplicates {
            publish.extend(["--duplicates", share]);
        }
        publish_parcels(env, &publish);
        let consumer = env.spawn_with(
            &with_mode(
                &[
                    "consume",
                    "carrier",
                    "--concurrency",
                    "2",
                    "--prefetch",
                    "8",
                ],
                self.mode,
            ),
            self.consumer_env,
        );
        let stream = MidStream {
            env,
            consumer,
            pool,
            parcels: self.parcels,
        };
        eventually(
            "a first part processed",
            Duration::from_secs(60),
            || async { stream.effects().await >= 50 },
        )
        .await;
        stream
    }
}

/// A consumer mid-stream: the time for the fault.
pub struct MidStream<'a> {
    env: &'a TestEnv,
    pub consumer: Proc,
    pub pool: PgPool,
    pub parcels: i64,
}

impl MidStream<'_> {
    /// Effects committed so far (rows in `carrier_reservations`).
    pub async fn effects(&self) -> i64 {
        count(&self.pool, "SELECT count(*) FROM carrier_reservations").await
    }

    /// Waits (up to 120 s, for `what`) until every parcel has its effect and the queue is empty, then asserts
    /// exactly once and stops the consumer.
    pub async fn end(&self, what: &str) {
        self.end_when(what, || async {
            self.effects().await >= self.parcels && self.env.queue_counts(CARRIER_QUEUE) == (0, 0)
        })
        .await;
    }

    /// [`MidStream::end`], with the test's own `done` (which may assert as it polls) for when it is over.
    pub async fn end_when<F, Fut>(&self, what: &str, done: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        eventually(what, Duration::from_secs(120), done).await;
        assert_carrier_exactly_once(&self.pool, self.parcels).await;
        assert!(
            !self.env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
            "nothing dead-lettered"
        );
        self.consumer.terminate();
    }
}

/// The check every fault test ends with: `parcels` rows in `carrier_reservations`, one per parcel, and nothing (a
/// failed attempt, a dead-lettering, a skip) counted against any message.
pub async fn assert_carrier_exactly_once(pool: &PgPool, parcels: i64) {
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, distinct),
        (parcels, parcels),
        "(effects, parcels): exactly one effect per parcel"
    );
    let against = count(
        pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind <> 'duplicate'",
    )
    .await;
    assert_eq!(against, 0, "nothing counted against a message");
}
