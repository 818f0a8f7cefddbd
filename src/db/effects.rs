//! The example consumers' effect tables: what the carrier and SMS stand-ins write in the consumer's transaction, and
//! the demo's count of it.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use super::{Exec, sql};
use crate::inbox::Effect;

statements! {
    /// The carrier stand-in's booking. `$1` parcel id, `$2` slot id, `$3` pickup time, `$4` message id,
    /// `$5` idempotency key.
    pub const INSERT_CARRIER_RESERVATION = "\
INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)
VALUES ($1, $2, $3, $4, $5)";

    /// The SMS stand-in's record. `$1` parcel id, `$2` tracking number, `$3` text, `$4` message id, `$5` idempotency
    /// key.
    const INSERT_NOTIFICATION_SENT = "\
INSERT INTO notifications_sent (parcel_id, tracking_number, body, message_id, idempotency_key)
VALUES ($1, $2, $3, $4, $5)";

    /// Several bookings in one statement (a batch's). `$1`… `$5` the columns of `INSERT_CARRIER_RESERVATION`, as
    /// arrays of one length.
    const INSERT_CARRIER_RESERVATIONS = "\
INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::timestamptz[], $4::uuid[], $5::uuid[])";

    /// Several texts in one statement (a batch's). `$1`… `$5` the columns of `INSERT_NOTIFICATION_SENT`, as arrays.
    const INSERT_NOTIFICATIONS_SENT = "\
INSERT INTO notifications_sent (parcel_id, tracking_number, body, message_id, idempotency_key)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::uuid[])";

    /// Rows each consumer wrote for a set of parcels (the demo's tally). `$1` parcel ids.
    const COUNT_CARRIER_RESERVATIONS_FOR =
    "SELECT count(*) FROM carrier_reservations WHERE parcel_id = ANY($1)";
    const COUNT_NOTIFICATIONS_SENT_FOR =
    "SELECT count(*) FROM notifications_sent WHERE parcel_id = ANY($1)";
}

/// The carrier stand-in's booking as an effect written through the claim ([`Effect`]): a row only for a delivery
/// that claims its message. `$1` parcel id, `$2` slot id, `$3` pickup time, `$4` message id, `$5` idempotency key.
pub const CARRIER_RESERVATION_EFFECT: &str = "\
INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)
SELECT $1::uuid, $2::uuid, $3::timestamptz, $4::uuid, $5::uuid FROM claimed";

/// The SMS stand-in's record as an effect written through the claim. `$1` parcel id, `$2` tracking number, `$3`
/// text, `$4` message id, `$5` idempotency key.
pub const NOTIFICATION_SENT_EFFECT: &str = "\
INSERT INTO notifications_sent (parcel_id, tracking_number, body, message_id, idempotency_key)
SELECT $1::uuid, $2::text, $3::text, $4::uuid, $5::uuid FROM claimed";

/// The effects written through the claim, each alone (see `claim::built_with_effect` for them with the claim), for
/// [`super::statements`].
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    vec![
        (
            "CARRIER_RESERVATION_EFFECT",
            super::claim::effect_alone(CARRIER_RESERVATION_EFFECT),
        ),
        (
            "NOTIFICATION_SENT_EFFECT",
            super::claim::effect_alone(NOTIFICATION_SENT_EFFECT),
        ),
    ]
}

/// A booking as one statement the inbox runs with its claim (`CARRIER_RESERVATION_EFFECT`).
pub fn carrier_reservation_effect(r: &Reservation) -> Effect {
    Effect::new(CARRIER_RESERVATION_EFFECT)
        .bind(r.parcel_id)
        .bind(r.slot_id)
        .bind(r.pickup_at)
        .bind(r.message_id)
        .bind(r.idempotency_key)
}

/// A text sent as one statement the inbox runs with its claim (`NOTIFICATION_SENT_EFFECT`).
pub fn notification_sent_effect(n: &Notification<'_>) -> Effect {
    Effect::new(NOTIFICATION_SENT_EFFECT)
        .bind(n.parcel_id)
        .bind(n.tracking_number.to_owned())
        .bind(n.body.to_owned())
        .bind(n.message_id)
        .bind(n.idempotency_key)
}

/// A booked pickup, as the carrier stand-in records it.
#[derive(Debug, Clone, Copy)]
pub struct Reservation {
    pub parcel_id: Uuid,
    pub slot_id: Uuid,
    pub pickup_at: DateTime<Utc>,
    pub message_id: Uuid,
    pub idempotency_key: Uuid,
}

/// A text sent, as the SMS stand-in records it.
#[derive(Debug, Clone, Copy)]
pub struct Notification<'a> {
    pub parcel_id: Uuid,
    pub tracking_number: &'a str,
    pub body: &'a str,
    pub message_id: Uuid,
    pub idempotency_key: Uuid,
}

/// Writes a booking (`INSERT_CARRIER_RESERVATION`).
pub async fn insert_carrier_reservation(
    conn: &mut PgConnection,
    r: &Reservation,
) -> sqlx::Result<()> {
    unit!(conn, |conn| sql::query(INSERT_CARRIER_RESERVATION)
        .bind(r.parcel_id)
        .bind(r.slot_id)
        .bind(r.pickup_at)
        .bind(r.message_id)
        .bind(r.idempotency_key)
        .execute(conn))
    .map(drop)
}

/// Writes a text sent (`INSERT_NOTIFICATION_SENT`).
pub async fn insert_notification_sent(
    conn: &mut PgConnection,
    n: &Notification<'_>,
) -> sqlx::Result<()> {
    unit!(conn, |conn| sql::query(INSERT_NOTIFICATION_SENT)
        .bind(n.parcel_id)
        .bind(n.tracking_number)
        .bind(n.body)
        .bind(n.message_id)
        .bind(n.idempotency_key)
        .execute(conn))
    .map(drop)
}

/// Writes several bookings in one statement (`INSERT_CARRIER_RESERVATIONS`).
pub async fn insert_carrier_reservations(
    conn: &mut PgConnection,
    rs: &[Reservation],
) -> sqlx::Result<()> {
    let column = |f: fn(&Reservation) -> Uuid| rs.iter().map(f).collect::<Vec<_>>();
    let pickups: Vec<DateTime<Utc>> = rs.iter().map(|r| r.pickup_at).collect();
    unit!(conn, |conn| sql::query(INSERT_CARRIER_RESERVATIONS)
        .bind(column(|r| r.parcel_id))
        .bind(column(|r| r.slot_id))
        .bind(pickups)
        .bind(column(|r| r.message_id))
        .bind(column(|r| r.idempotency_key))
        .execute(conn))
    .map(drop)
}

/// Writes several texts in one statement (`INSERT_NOTIFICATIONS_SENT`).
pub async fn insert_notifications_sent(
    conn: &mut PgConnection,
    ns: &[Notification<'_>],
) -> sqlx::Result<()> {
    let ids = |f: fn(&Notification<'_>) -> Uuid| ns.iter().map(f).collect::<Vec<_>>();
    let tracking: Vec<&str> = ns.iter().map(|n| n.tracking_number).collect();
    let bodies: Vec<&str> = ns.iter().map(|n| n.body).collect();
    unit!(conn, |conn| sql::query(INSERT_NOTIFICATIONS_SENT)
        .bind(ids(|n| n.parcel_id))
        .bind(tracking)
        .bind(bodies)
        .bind(ids(|n| n.message_id))
        .bind(ids(|n| n.idempotency_key))
        .execute(conn))
    .map(drop)
}

/// Bookings written for these parcels (`COUNT_CARRIER_RESERVATIONS_FOR`).
pub async fn count_carrier_reservations_for(
    executor: impl Into<Exec<'_>>,
    parcel_ids: &[Uuid],
) -> sqlx::Result<i64> {
    let query = sql::query_scalar(COUNT_CARRIER_RESERVATIONS_FOR).bind(parcel_ids);
    unit!(executor, |conn| query.fetch_one(conn))
}

/// Texts written for these parcels (`COUNT_NOTIFICATIONS_SENT_FOR`).
pub async fn count_notifications_sent_for(
    executor: impl Into<Exec<'_>>,
    parcel_ids: &[Uuid],
) -> sqlx::Result<i64> {
    let query = sql::query_scalar(COUNT_NOTIFICATIONS_SENT_FOR).bind(parcel_ids);
    unit!(executor, |conn| query.fetch_one(conn))
}
