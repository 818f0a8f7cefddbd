//! The fault tests' choreography: what every one of them ends with.

use sqlx::postgres::PgPool;

use super::count;

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
