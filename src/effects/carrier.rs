//! The carrier consumer's two ways to reach an HTTP carrier: [`HttpCarrier`] calls inside the claim's transaction
//! (keyed), [`DeferredCarrier`] writes the call owed in it for the worker to make after the commit.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::postgres::PgConnection;
use tokio::sync::Notify;

use super::{CarrierClient, EffectMode};
use crate::carrier_stub::SlotAnswer;
use crate::db::{effects, external};
use crate::inbox::{ConsumerType, WorkError};
use crate::parcel::{Carrier, PickupRequest, PickupSlot};
use crate::recent::Recent;

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
///
/// A call whose answer came but whose transaction then rolled back — another member of its batch failed and the
/// batch was done again without it, its commit failed, its attempt ran out of time after the call — is not made
/// again by this process: the slot the carrier gave for the key is taken from [`Answered`]. A carrier that honours
/// keys would answer the same; one that ignores them would book a second slot, with no crash.
#[derive(Debug, Clone)]
pub struct HttpCarrier {
    pub client: CarrierClient,
    pub consumer_type: ConsumerType,
    pub answered: Arc<Answered>,
}

/// The slots the carrier gave this process, by idempotency key: the latest [`Answered::KEPT`], and only for a request
/// of the same content (a message id reused for another parcel is the carrier's to answer). An entry of a call whose
/// transaction committed is never read again (a later copy of its message is a duplicate, its work not run).
#[derive(Debug)]
pub struct Answered(Recent<uuid::Uuid, (u64, SlotAnswer)>);

impl Default for Answered {
    fn default() -> Self {
        Self::new()
    }
}

impl Answered {
    /// How many answers are kept: far more than the calls one process has in flight and retrying (its prefetch,
    /// its batches), in well under a megabyte.
    pub const KEPT: usize = 8192;

    /// Answers kept by number alone, not for the carrier's key lifetime: past it, the carrier may have forgotten the
    /// key, and the call made again would book a second slot, while the one it gave is still booked.
    pub fn new() -> Self {
        Self(Recent::new(Self::KEPT, Duration::MAX))
    }

    fn get(&self, key: uuid::Uuid, request: &PickupRequest) -> Option<SlotAnswer> {
        let (content_kept, slot) = self.0.get(&key)?;
        (content_kept == content(request)).then_some(slot)
    }

    fn keep(&self, key: uuid::Uuid, request: &PickupRequest, slot: SlotAnswer) {
        self.0.insert(key, (content(request), slot));
    }
}

/// What a booking asks for, hashed: the parcel, its tracking number, its destination.
fn content(request: &PickupRequest) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    request.parcel_id.hash(&mut hasher);
    request.tracking_number.hash(&mut hasher);
    request.destination.hash(&mut hasher);
    hasher.finish()
}

impl Carrier for HttpCarrier {
    fn reserve_pickup<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        request: &'c PickupRequest,
    ) -> BoxFuture<'c, Result<PickupSlot, WorkError>> {
        Box::pin(async move {
            let key = request.idempotency_key;
            let slot = match self.answered.get(key, request) {
                Some(slot) => {
                    tracing::debug!(idempotency_key = %key, "the carrier booked this call before: its slot taken, not booked again");
                    slot
                }
                None => {
                    let slot = self
                        .client
                        .book(request)
                        .await
                        .map_err(|e| WorkError::msg(e.to_string()))?;
                    self.answered.keep(key, request, slot);
                    slot
                }
            };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn request(destination: &str) -> PickupRequest {
        PickupRequest {
            parcel_id: uuid::Uuid::nil(),
            tracking_number: "PT1".to_owned(),
            destination: destination.to_owned(),
            message_id: uuid::Uuid::nil(),
            idempotency_key: uuid::Uuid::nil(),
        }
    }

    fn slot(n: u128) -> SlotAnswer {
        SlotAnswer {
            slot_id: uuid::Uuid::from_u128(n),
            pickup_at: chrono::DateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn an_answer_is_taken_again_only_for_the_same_request_and_the_latest_kept_however_old() {
        let answered = Answered::new();
        let key = uuid::Uuid::from_u128(1);
        answered.keep(key, &request("Berlin"), slot(1));
        assert_eq!(answered.get(key, &request("Berlin")), Some(slot(1)));
        assert_eq!(
            answered.get(key, &request("Hamburg")),
            None,
            "another parcel's"
        );
        assert_eq!(
            answered.get(uuid::Uuid::from_u128(2), &request("Berlin")),
            None
        );

        // However long ago: the slot stays booked when the carrier has forgotten its key.
        let long_ago = std::time::Instant::now()
            .checked_sub(Duration::from_secs(400 * 24 * 3600))
            .unwrap_or_else(std::time::Instant::now);
        let old = Answered::new();
        old.0
            .insert_at(key, (content(&request("Berlin")), slot(1)), long_ago);
        assert_eq!(old.get(key, &request("Berlin")), Some(slot(1)));

        for n in 0..=Answered::KEPT as u128 {
            answered.keep(uuid::Uuid::from_u128(1000 + n), &request("Berlin"), slot(n));
        }
        assert_eq!(answered.0.len(), Answered::KEPT, "bounded");
        assert_eq!(
            answered.get(key, &request("Berlin")),
            None,
            "the oldest gone"
        );
        let newest = uuid::Uuid::from_u128(1000 + Answered::KEPT as u128);
        assert!(answered.get(newest, &request("Berlin")).is_some());
    }
}
