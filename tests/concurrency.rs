//! Parallel copies of one message id, delivered at once to two consumer processes: one effect, every copy acked.

use crate::common;

use std::time::Duration;

use common::{CARRIER_QUEUE, TestEnv};
use uuid::Uuid;

in_both_modes!(
    sixteen_copies_at_once_to_two_processes_give_one_effect_fifty_rounds,
    sixteen_copies
);

async fn sixteen_copies(mode: &[&str]) {
    const ROUNDS: i64 = 50;
    const COPIES: i64 = 16;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let args = common::with_mode(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "16",
            "--prefetch",
            "64",
        ],
        mode,
    );
    let a = env.spawn(&args);
    let b = env.spawn(&args);
    a.wait_for_stderr("consuming", Duration::from_secs(30));
    b.wait_for_stderr("consuming", Duration::from_secs(30));

    let conn = env.amqp().await;
    let pool = env.pool().await;
    for round in 1..=ROUNDS {
        let (props, body, parcel) = common::parcel_message(Uuid::now_v7(), "Berlin");
        common::publish_copies(&conn, CARRIER_QUEUE, props, &body, COPIES as usize).await;
        common::eventually(
            &format!("round {round}: one effect and 15 duplicates"),
            Duration::from_secs(30),
            || async {
                common::count(
                    &pool,
                    "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
                )
                .await
                    == round * (COPIES - 1)
            },
        )
        .await;
        let effects: i64 =
            sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE parcel_id = $1")
                .bind(parcel)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(effects, 1, "round {round}");
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        ROUNDS
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        ROUNDS
    );

    // Every copy acknowledged: nothing ready, nothing held.
    common::eventually("all copies acked", Duration::from_secs(10), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    // Both processes got copies of the same ids and discarded some.
    assert!(a.stderr().contains("duplicate discarded"), "{}", a.stderr());
    assert!(b.stderr().contains("duplicate discarded"), "{}", b.stderr());
    assert!(!env.queue_exists(&format!("{CARRIER_QUEUE}_error")));
    a.terminate();
    b.terminate();
}
