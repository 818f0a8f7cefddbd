//! The carrier consumer's two ways to reach an HTTP carrier: [`HttpCarrier`] calls inside the claim's transaction
//! (keyed), [`DeferredCarrier`] writes the call owed in it for the worker to make after the commit.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use sqlx::postgres::PgConnection;
use tokio::sync::Notify;

use super::{CarrierClient, EffectMode};
use crate::carrier_stub::SlotAnswer;
use crate::db::{effects, external};
use crate::inbox::{ConsumerType, WorkError};
use crate::parcel::{Carrier, PickupRequest, PickupSlot};

/// The request as kept in `inboxctl_effects.request`, enough to make the call again.
pub(crate) fn request_json(request: &PickupRequest) -> String {
    serde_json::json!({
        "parcelId": request.parcel_id,
        "trackingNumber": request.tracking_number,
        "destination": request.destination,
    })
    .to_string()
}

/// The `carrier_reservations` row of the slot the carrier booked for `request`.
pub(crate) fn reservation(request: &PickupRequest, slot: &SlotAnswer) -> effects::Reservation {
    effects::Reservation {
        parcel_id: request.parcel_id,
        slot_id: slot.slot_id,
        pickup_at: slot.pickup_at,
        message_id: request.message_id,
        idempotency_key: request.idempotency_key,
    }
}

/// Keyed: books inside the claim's transaction, with the key; records the slot in `carrier_reservations` and the call
/// in `inboxctl_effects` (done) on the same transaction. A failure of the call fails the attempt.
#[derive(Debug, Clone)]
pub struct HttpCarrier {
    pub client: CarrierClient,
    pub consumer_type: ConsumerType,
}

impl Carrier for HttpCarrier {
    fn reserve_pickup<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        request: &'c PickupRequest,
    ) -> BoxFuture<'c, Result<PickupSlot, WorkError>> {
        Box::pin(async move {
            let slot = self
                .client
                .book(request)
                .await
                .map_err(|e| WorkError::msg(e.to_string()))?;
            effects::insert_carrier_reservation(&mut *tx, &reservation(request, &slot)).await?;
            let reference = slot.slot_id.to_string();
            external::insert(
                tx,
                &external::NewEffect {
                    message_id: request.message_id,
                    consumer_type: self.consumer_type.as_str(),
                    idempotency_key: request.idempotency_key,
                    mode: EffectMode::Keyed.name(),
                    state: "done",
                    request: &request_json(request),
                    attempts: 1,
                    reference: Some(&reference),
                },
            )
            .await?;
            Ok(PickupSlot {
                slot_id: slot.slot_id,
                pickup_at: slot.pickup_at,
            })
        })
    }
}

/// After-commit or at-most-once: writes the call owed (pending) in the claim's transaction and wakes the worker,
/// which makes it once the claim committed. The slot is not known yet: the returned one is nil.
#[derive(Debug, Clone)]
pub struct DeferredCarrier {
    pub mode: EffectMode,
    pub consumer_type: ConsumerType,
    pub wake: Arc<Notify>,
}

impl Carrier for DeferredCarrier {
    fn reserve_pickup<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        request: &'c PickupRequest,
    ) -> BoxFuture<'c, Result<PickupSlot, WorkError>> {
        Box::pin(async move {
            external::insert(
                tx,
                &external::NewEffect {
                    message_id: request.message_id,
                    consumer_type: self.consumer_type.as_str(),
                    idempotency_key: request.idempotency_key,
                    mode: self.mode.name(),
                    state: "pending",
                    request: &request_json(request),
                    attempts: 0,
                    reference: None,
                },
            )
            .await?;
            // Wakes the worker, which finds the effect once the claim committed (or at its next look, if it woke first).
            self.wake.notify_one();
            Ok(PickupSlot {
                slot_id: uuid::Uuid::nil(),
                pickup_at: chrono::DateTime::UNIX_EPOCH,
            })
        })
    }
}
