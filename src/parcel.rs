//! The Parcel Tracker's consumers: the carrier consumer books a pickup slot, the notification consumer sends an SMS.
//! Both reach the outside world through a trait whose stand-in here writes a row inside the consumer's transaction,
//! so a double effect is visible to anyone who counts rows.
//!
//! A real carrier or SMS API is called over the network, outside the database transaction: a crash after such a
//! call and before the commit makes the message run again and the call repeat. The idempotency key each call
//! carries — the same for every delivery of a message to a consumer — lets an API that honours keys recognise the
//! repeat; one that does not will act twice. See the README's guarantees.

use std::future::Future;

use chrono::{DateTime, DurationRound as _, TimeDelta, Utc};
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use crate::consumer::{Consumer, MessageContext};
use crate::db::effects;
use crate::failpoint;
use crate::inbox::{Effect, WorkError};

/// The MassTransit message type of [`ParcelCreatedEvent`].
pub const PARCEL_CREATED_URN: &str = "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent";

pub const CARRIER_QUEUE: &str = "parcel-created-carrier";
pub const NOTIFICATION_QUEUE: &str = "parcel-created-notification";

/// Which of the Parcel Tracker's consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Reserves a pickup slot with the carrier for each new parcel.
    Carrier,
    /// Sends an SMS for each new parcel.
    Notification,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Carrier, Kind::Notification];

    /// The queue it reads unless told otherwise.
    pub fn default_queue(self) -> &'static str {
        match self {
            Kind::Carrier => CARRIER_QUEUE,
            Kind::Notification => NOTIFICATION_QUEUE,
        }
    }

    /// The table its stand-in effect writes.
    pub fn effect_table(self) -> &'static str {
        match self {
            Kind::Carrier => "carrier_reservations",
            Kind::Notification => "notifications_sent",
        }
    }
}

/// `ParcelTracker.Domain.Events.ParcelCreatedEvent`, as MassTransit serialises it; read as MassTransit reads it, its
/// field names in any case (`ParcelId` from a fleet whose naming policy is .NET's own: [`crate::amqp::envelope::fields`]).
/// Unknown fields are ignored; a field given twice (in any case) is an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ParcelCreatedEvent {
    pub parcel_id: Uuid,
    pub tracking_number: String,
    pub destination: String,
}

/// [`ParcelCreatedEvent`]'s fields, as MassTransit writes them.
const EVENT_FIELDS: &[&str] = &["parcelId", "trackingNumber", "destination"];

impl<'de> Deserialize<'de> for ParcelCreatedEvent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use crate::amqp::envelope::fields;
        use serde::de::Error as _;

        /// A text of the event, NUL read as U+FFFD ([`storable_text`]).
        struct Storable(String);
        impl<'de> Deserialize<'de> for Storable {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                storable_text(d).map(Storable)
            }
        }

        struct Event;
        impl<'de> serde::de::Visitor<'de> for Event {
            type Value = ParcelCreatedEvent;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("struct ParcelCreatedEvent")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ParcelCreatedEvent, A::Error> {
                let (mut parcel_id, mut tracking_number, mut destination) = (None, None, None);
                fields::each(&mut map, EVENT_FIELDS, |index, map| {
                    match index {
                        0 => parcel_id = Some(map.next_value::<Uuid>()?),
                        1 => tracking_number = Some(map.next_value::<Storable>()?.0),
                        _ => destination = Some(map.next_value::<Storable>()?.0),
                    }
                    Ok(())
                })?;
                Ok(ParcelCreatedEvent {
                    parcel_id: parcel_id.ok_or_else(|| A::Error::missing_field("parcelId"))?,
                    tracking_number: tracking_number
                        .ok_or_else(|| A::Error::missing_field("trackingNumber"))?,
                    destination: destination
                        .ok_or_else(|| A::Error::missing_field("destination"))?,
                })
            }
        }
        deserializer.deserialize_struct("ParcelCreatedEvent", EVENT_FIELDS, Event)
    }
}

/// A text of the event with each NUL character (JSON's `\u0000`) read as U+FFFD: PostgreSQL's text and jsonb refuse
/// NUL, and the same text goes to the carrier or the SMS, into the booking, the text sent and the record of the call.
/// Read so once, they all agree, and a parcel is not dead-lettered — a keyed carrier's booking made, its record refused
/// — for a character nobody can see.
fn storable_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let text = String::deserialize(deserializer)?;
    Ok(match crate::db::sql::storable(&text) {
        std::borrow::Cow::Borrowed(_) => text,
        std::borrow::Cow::Owned(storable) => storable,
    })
}

/// A pickup booking request to a carrier.
#[derive(Debug, Clone)]
pub struct PickupRequest {
    pub parcel_id: Uuid,
    pub tracking_number: String,
    pub destination: String,
    pub message_id: Uuid,
    /// The same on every delivery of the message: a carrier that honours it books once.
    pub idempotency_key: Uuid,
}

/// A booked slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickupSlot {
    pub slot_id: Uuid,
    pub pickup_at: DateTime<Utc>,
}

/// A carrier's booking API. `tx` is the consumer's transaction, for implementations that record the booking.
pub trait Carrier: Send + Sync + 'static {
    fn reserve_pickup<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        request: &'c PickupRequest,
    ) -> BoxFuture<'c, Result<PickupSlot, WorkError>>;

    /// The booking as one statement the inbox sends with its claim ([`Effect`]), when it is one: the booking
    /// `reserve_pickup` would record. `None` (the default): `reserve_pickup` books.
    fn pickup_effect<'c>(
        &'c self,
        request: &'c PickupRequest,
    ) -> impl Future<Output = Result<Option<Effect>, WorkError>> + Send + 'c {
        let _ = request;
        async { Ok(None) }
    }

    /// Several bookings (a batch's); all or nothing. The default books one after another.
    fn reserve_pickups<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        requests: &'c [PickupRequest],
    ) -> BoxFuture<'c, Result<(), WorkError>> {
        Box::pin(async move {
            for request in requests {
                self.reserve_pickup(&mut *tx, request).await?;
            }
            Ok(())
        })
    }
}

/// An SMS gateway.
pub trait SmsGateway: Send + Sync + 'static {
    fn send<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        sms: &'c Sms,
    ) -> BoxFuture<'c, Result<(), WorkError>>;

    /// The text as one statement the inbox sends with its claim ([`Effect`]), when it is one. `None` (the
    /// default): `send` sends it.
    fn text_effect<'c>(
        &'c self,
        sms: &'c Sms,
    ) -> impl Future<Output = Result<Option<Effect>, WorkError>> + Send + 'c {
        let _ = sms;
        async { Ok(None) }
    }

    /// Several texts (a batch's); all or nothing. The default sends one after another.
    fn send_all<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        texts: &'c [Sms],
    ) -> BoxFuture<'c, Result<(), WorkError>> {
        Box::pin(async move {
            for sms in texts {
                self.send(&mut *tx, sms).await?;
            }
            Ok(())
        })
    }
}

#[derive(Debug, Clone)]
pub struct Sms {
    pub parcel_id: Uuid,
    pub destination: String,
    pub tracking_number: String,
    pub body: String,
    pub message_id: Uuid,
    pub idempotency_key: Uuid,
}

/// The stand-in carrier: books a slot for the next morning by writing `carrier_reservations` in the consumer's
/// transaction. With `fail_destination`, it answers every booking to that destination with an error, like a carrier
/// API that is down (for demos of retries and of the error queue).
#[derive(Debug, Clone, Default)]
pub struct StandInCarrier {
    pub fail_destination: Option<String>,
}

impl StandInCarrier {
    /// The booking the stand-in makes for `request`, or the error of a carrier that is down for its destination.
    async fn booking(&self, request: &PickupRequest) -> Result<effects::Reservation, WorkError> {
        failpoint::hit_with("carrier", &request.destination).await;
        if self.fails_for(&request.destination) {
            return Err(WorkError::msg("carrier API returned 503"));
        }
        Ok(reservation(request))
    }

    /// Whether a booking to `destination` is made to fail (`fail_destination`).
    fn fails_for(&self, destination: &str) -> bool {
        self.fail_destination.as_deref() == Some(destination)
    }
}

/// The booking the stand-in records for `request`: a slot the next morning.
fn reservation(request: &PickupRequest) -> effects::Reservation {
    effects::Reservation {
        parcel_id: request.parcel_id,
        slot_id: Uuid::new_v4(),
        pickup_at: next_morning(Utc::now()),
        message_id: request.message_id,
        idempotency_key: request.idempotency_key,
    }
}

impl StandInCarrier {}

impl Carrier for StandInCarrier {
    fn reserve_pickup<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        request: &'c PickupRequest,
    ) -> BoxFuture<'c, Result<PickupSlot, WorkError>> {
        Box::pin(async move {
            let reservation = self.booking(request).await?;
            effects::insert_carrier_reservation(tx, &reservation).await?;
            Ok(PickupSlot {
                slot_id: reservation.slot_id,
                pickup_at: reservation.pickup_at,
            })
        })
    }

    /// The booking written through the claim: one statement for claim and booking — unless the booking is made to
    /// fail or held by a test, which then happens where a real carrier's call would, after the claim.
    async fn pickup_effect<'c>(
        &'c self,
        request: &'c PickupRequest,
    ) -> Result<Option<Effect>, WorkError> {
        failpoint::hit_with("carrier-effect", &request.destination).await;
        if self.fails_for(&request.destination) || failpoint::armed("carrier", &request.destination)
        {
            return Ok(None);
        }
        Ok(Some(effects::carrier_reservation_effect(&reservation(
            request,
        ))))
    }

    /// Every booking in one statement.
    fn reserve_pickups<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        requests: &'c [PickupRequest],
    ) -> BoxFuture<'c, Result<(), WorkError>> {
        Box::pin(async move {
            let mut reservations = Vec::with_capacity(requests.len());
            for request in requests {
                reservations.push(self.booking(request).await?);
            }
            effects::insert_carrier_reservations(tx, &reservations).await?;
            Ok(())
        })
    }
}

/// The stand-in SMS gateway: writes `notifications_sent` in the consumer's transaction; fails for
/// `fail_destination` like [`StandInCarrier`].
#[derive(Debug, Clone, Default)]
pub struct StandInSms {
    pub fail_destination: Option<String>,
}

impl StandInSms {
    /// The error of a gateway that is down for `sms`'s destination, if it is.
    async fn check(&self, sms: &Sms) -> Result<(), WorkError> {
        failpoint::hit_with("sms", &sms.destination).await;
        if self.fail_destination.as_deref() == Some(sms.destination.as_str()) {
            return Err(WorkError::msg("SMS gateway returned 503"));
        }
        Ok(())
    }
}

fn notification(sms: &Sms) -> effects::Notification<'_> {
    effects::Notification {
        parcel_id: sms.parcel_id,
        tracking_number: &sms.tracking_number,
        body: &sms.body,
        message_id: sms.message_id,
        idempotency_key: sms.idempotency_key,
    }
}

impl SmsGateway for StandInSms {
    fn send<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        sms: &'c Sms,
    ) -> BoxFuture<'c, Result<(), WorkError>> {
        Box::pin(async move {
            self.check(sms).await?;
            effects::insert_notification_sent(tx, &notification(sms)).await?;
            Ok(())
        })
    }

    /// The text written through the claim: one statement for claim and text — unless the gateway is made to fail
    /// for its destination or a test holds it, which then happens after the claim.
    async fn text_effect<'c>(&'c self, sms: &'c Sms) -> Result<Option<Effect>, WorkError> {
        if self.fail_destination.as_deref() == Some(sms.destination.as_str())
            || failpoint::armed("sms", &sms.destination)
        {
            return Ok(None);
        }
        Ok(Some(effects::notification_sent_effect(&notification(sms))))
    }

    /// Every text in one statement.
    fn send_all<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        texts: &'c [Sms],
    ) -> BoxFuture<'c, Result<(), WorkError>> {
        Box::pin(async move {
            for sms in texts {
                self.check(sms).await?;
            }
            let rows: Vec<effects::Notification<'_>> = texts.iter().map(notification).collect();
            effects::insert_notifications_sent(tx, &rows).await?;
            Ok(())
        })
    }
}

/// 09:00 UTC of the day after `now`.
pub(crate) fn next_morning(now: DateTime<Utc>) -> DateTime<Utc> {
    let midnight = now.duration_trunc(TimeDelta::days(1)).unwrap_or(now);
    midnight + TimeDelta::days(1) + TimeDelta::hours(9)
}

/// Books a pickup slot for each new parcel.
pub struct CarrierConsumer<K: Carrier> {
    pub carrier: K,
}

fn pickup_request(context: &MessageContext, event: &ParcelCreatedEvent) -> PickupRequest {
    PickupRequest {
        parcel_id: event.parcel_id,
        tracking_number: event.tracking_number.clone(),
        destination: event.destination.clone(),
        message_id: context.message_id,
        idempotency_key: context.idempotency_key(),
    }
}

impl<K: Carrier> Consumer for CarrierConsumer<K> {
    type Message = ParcelCreatedEvent;
    const MESSAGE_TYPE: &'static str = PARCEL_CREATED_URN;

    async fn consume<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        context: &'c MessageContext,
        event: &'c ParcelCreatedEvent,
    ) -> Result<(), WorkError> {
        let slot = self
            .carrier
            .reserve_pickup(tx, &pickup_request(context, event))
            .await?;
        tracing::debug!(parcel_id = %event.parcel_id, slot_id = %slot.slot_id, "pickup reserved");
        Ok(())
    }

    async fn effect<'c>(
        &'c self,
        context: &'c MessageContext,
        event: &'c ParcelCreatedEvent,
    ) -> Result<Option<Effect>, WorkError> {
        self.carrier
            .pickup_effect(&pickup_request(context, event))
            .await
    }

    async fn consume_batch<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [&'c (MessageContext, ParcelCreatedEvent)],
    ) -> Result<(), WorkError> {
        let requests: Vec<PickupRequest> = batch
            .iter()
            .map(|(context, event)| pickup_request(context, event))
            .collect();
        self.carrier.reserve_pickups(tx, &requests).await
    }
}

/// Texts the recipient of each new parcel.
pub struct NotificationConsumer<G: SmsGateway> {
    pub gateway: G,
}

impl<G: SmsGateway> Consumer for NotificationConsumer<G> {
    type Message = ParcelCreatedEvent;
    const MESSAGE_TYPE: &'static str = PARCEL_CREATED_URN;

    async fn consume<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        context: &'c MessageContext,
        event: &'c ParcelCreatedEvent,
    ) -> Result<(), WorkError> {
        self.gateway.send(tx, &sms(context, event)).await
    }

    async fn effect<'c>(
        &'c self,
        context: &'c MessageContext,
        event: &'c ParcelCreatedEvent,
    ) -> Result<Option<Effect>, WorkError> {
        self.gateway.text_effect(&sms(context, event)).await
    }

    async fn consume_batch<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [&'c (MessageContext, ParcelCreatedEvent)],
    ) -> Result<(), WorkError> {
        let texts: Vec<Sms> = batch
            .iter()
            .map(|(context, event)| sms(context, event))
            .collect();
        self.gateway.send_all(tx, &texts).await
    }
}

fn sms(context: &MessageContext, event: &ParcelCreatedEvent) -> Sms {
    Sms {
        parcel_id: event.parcel_id,
        destination: event.destination.clone(),
        tracking_number: event.tracking_number.clone(),
        body: format!(
            "Your parcel {} to {} is registered.",
            event.tracking_number, event.destination
        ),
        message_id: context.message_id,
        idempotency_key: context.idempotency_key(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_morning_is_nine_the_next_day() {
        let now = DateTime::parse_from_rfc3339("2026-11-30T22:13:24Z")
            .expect("time")
            .with_timezone(&Utc);
        assert_eq!(next_morning(now).to_rfc3339(), "2026-12-01T09:00:00+00:00");
    }

    #[test]
    fn the_event_reads_masstransits_camel_case() {
        let e: ParcelCreatedEvent = serde_json::from_str(
            r#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT00000001NL", "destination": "Berlin"}"#,
        )
        .expect("event");
        assert_eq!(e.tracking_number, "PT00000001NL");
        assert!(
            serde_json::from_str::<ParcelCreatedEvent>(
                r#"{"trackingNumber": "x", "destination": "y"}"#
            )
            .is_err()
        );
        assert!(
            serde_json::from_str::<ParcelCreatedEvent>(
                r#"{"parcelId": "nope", "trackingNumber": "x", "destination": "y"}"#
            )
            .is_err()
        );
    }
}
