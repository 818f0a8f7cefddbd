//! A stand-in carrier API on HTTP, for the demo and the tests (`inboxctl carrier-stub`): it books pickup slots,
//! remembers every booking it made, and can be told — at start or while it runs — to behave like the carriers a
//! consumer meets: one that honours `Idempotency-Key` (a repeated key gets the first answer again, no new booking),
//! one that ignores it (books again: the seed's carrier), a slow one, one that answers 503, and one that books and
//! then drops the connection without answering (done, and the caller cannot know).
//!
//! API (JSON):
//! - `POST /pickups` `{parcelId, trackingNumber, destination}` with `Idempotency-Key` → `{slotId, pickupAt}`;
//! - `GET /pickups/by-key/{key}` → the booking made with that key (`{slotId, pickupAt}`), 404 if none: the look-up
//!   `effects reconcile` uses;
//! - `GET /_stub/bookings` → every booking made, in order (`parcelId`, `idempotencyKey`, `slotId`, `destination`);
//! - `GET|POST /_stub/behaviour` → the behaviour now / a new one (every field optional, defaults below).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{Error, Result};

/// The largest request body read; a booking is a few hundred bytes.
const MAX_BODY: usize = 16 * 1024;
/// The longest `Idempotency-Key` kept; a longer one is refused (400).
const MAX_KEY: usize = 255;
/// The longest text field of a booking kept.
const MAX_FIELD: usize = 1024;

/// How the stand-in answers. Every field may be left out of `POST /_stub/behaviour` (then it takes its default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Behaviour {
    /// Replay the first answer for a repeated `Idempotency-Key` (true), or book again (false).
    pub honour_keys: bool,
    /// Answer this many milliseconds late, after booking.
    pub delay_ms: u64,
    /// Only bookings to this destination are answered late (none: all).
    pub delay_destination: Option<String>,
    /// Answer 503 to this many requests from now on, booking nothing.
    pub fail_next: u32,
    /// Answer 503 to every request.
    pub fail_always: bool,
    /// The status `failNext` and `failAlways` answer instead of 503 (a 500, a gateway's 502 or 504), booking nothing.
    pub fail_status: Option<u16>,
    /// Book, then drop the connection without answering, for this many requests from now on.
    pub drop_next: u32,
    /// Book, then answer `303 See Other` (post, then redirect to the booking), for this many requests from now on.
    pub redirect_next: u32,
    /// Answer `504 Gateway Timeout` at once to this many requests from now on, and book each `bookLateMs` later: a
    /// gateway that gave up in front of a carrier still at work.
    pub book_late_next: u32,
    pub book_late_ms: u64,
    /// Book, then answer `200` with the slot padded to 4 MiB, for this many requests from now on.
    pub padded_next: u32,
    /// Book, then answer `503` with a proxy's plain-text page (its upstream reset after it took the request), for
    /// this many requests from now on.
    pub proxy_reset_next: u32,
    /// Answer the look-up with a proxy's `404` (a plain-text page: no route), whatever was booked, for this many
    /// look-ups from now on.
    pub lookup_unrouted_next: u32,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            honour_keys: true,
            delay_ms: 0,
            delay_destination: None,
            fail_next: 0,
            fail_always: false,
            fail_status: None,
            drop_next: 0,
            redirect_next: 0,
            book_late_next: 0,
            book_late_ms: 0,
            padded_next: 0,
            proxy_reset_next: 0,
            lookup_unrouted_next: 0,
        }
    }
}

/// One booking the stand-in made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Booking {
    pub parcel_id: Uuid,
    pub idempotency_key: Option<String>,
    pub slot_id: Uuid,
    pub pickup_at: DateTime<Utc>,
    pub destination: String,
}

/// A booking request, as the carrier API takes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PickupBody {
    pub parcel_id: Uuid,
    pub tracking_number: String,
    pub destination: String,
}

/// A booked slot, as the carrier API answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotAnswer {
    pub slot_id: Uuid,
    pub pickup_at: DateTime<Utc>,
}

#[derive(Debug, Default)]
struct Ledger {
    behaviour: Behaviour,
    bookings: Vec<Booking>,
    /// Each key's first booking, an index into `bookings`.
    by_key: HashMap<String, usize>,
}

type Shared = Arc<Mutex<Ledger>>;

fn ledger(shared: &Shared) -> std::sync::MutexGuard<'_, Ledger> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// A stand-in being served.
#[derive(Debug, Clone)]
pub struct Serving {
    /// The address bound (the port the system chose for port 0).
    pub addr: SocketAddr,
    ledger: Shared,
}

impl Serving {
    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every booking it made so far.
    pub fn bookings(&self) -> Vec<Booking> {
        ledger(&self.ledger).bookings.clone()
    }
}

/// Binds `addr` (so a bad or busy address is an error at once) and serves the stand-in with `behaviour` until
/// `shutdown`, in a task of its own.
pub async fn serve(
    addr: SocketAddr,
    behaviour: Behaviour,
    shutdown: CancellationToken,
) -> Result<Serving> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Usage(format!("--listen {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    let shared: Shared = Arc::new(Mutex::new(Ledger {
        behaviour,
        ..Ledger::default()
    }));
    let app = Router::new()
        .route("/pickups", post(book))
        .route("/pickups/by-key/{key}", get(by_key))
        .route("/_stub/bookings", get(bookings))
        .route("/_stub/behaviour", get(behaviour_now).post(set_behaviour))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(Arc::clone(&shared));
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "the stand-in carrier stopped serving");
        }
    });
    Ok(Serving {
        addr: bound,
        ledger: shared,
    })
}

/// Books `request` (or, a key honoured, finds the booking made under it first).
fn make_booking(l: &mut Ledger, request: &PickupBody, key: Option<String>) -> SlotAnswer {
    let replayed = match (&key, l.behaviour.honour_keys) {
        (Some(k), true) => l
            .by_key
            .get(k)
            .map(|&i| &l.bookings[i])
            .map(|b| SlotAnswer {
                slot_id: b.slot_id,
                pickup_at: b.pickup_at,
            }),
        _ => None,
    };
    if let Some(answer) = replayed {
        return answer;
    }
    let booking = Booking {
        parcel_id: request.parcel_id,
        idempotency_key: key.clone(),
        slot_id: Uuid::new_v4(),
        pickup_at: crate::parcel::next_morning(Utc::now()),
        destination: request.destination.clone(),
    };
    let answer = SlotAnswer {
        slot_id: booking.slot_id,
        pickup_at: booking.pickup_at,
    };
    l.bookings.push(booking);
    let index = l.bookings.len() - 1;
    if let Some(k) = key {
        l.by_key.entry(k).or_insert(index);
    }
    answer
}

fn bad_request(reason: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({"error": reason.into()})),
    )
        .into_response()
}

async fn book(State(shared): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let request: PickupBody = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("not a pickup request: {e}")),
    };
    if request.tracking_number.len() > MAX_FIELD || request.destination.len() > MAX_FIELD {
        return bad_request("a field is longer than 1024 bytes");
    }
    let key = match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_KEY => Some(k.to_owned()),
        Some(_) => return bad_request("Idempotency-Key must be 1 to 255 visible ASCII characters"),
    };
    let (answer, delay, drop_connection, redirect, padded) = {
        let mut l = ledger(&shared);
        if l.behaviour.fail_always || l.behaviour.fail_next > 0 {
            l.behaviour.fail_next = l.behaviour.fail_next.saturating_sub(1);
            let status = l
                .behaviour
                .fail_status
                .and_then(|s| StatusCode::from_u16(s).ok())
                .filter(|s| s.is_client_error() || s.is_server_error())
                .unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return (
                status,
                Json(serde_json::json!({"error": "carrier unavailable, try again later"})),
            )
                .into_response();
        }
        if l.behaviour.book_late_next > 0 {
            l.behaviour.book_late_next -= 1;
            let late = Duration::from_millis(l.behaviour.book_late_ms);
            let shared = Arc::clone(&shared);
            tokio::spawn(async move {
                tokio::time::sleep(late).await;
                let _ = make_booking(&mut ledger(&shared), &request, key);
            });
            return (
                StatusCode::GATEWAY_TIMEOUT,
                Json(serde_json::json!({"error": "the upstream did not answer in time"})),
            )
                .into_response();
        }
        let answer = make_booking(&mut l, &request, key);
        let b = &l.behaviour;
        let slow = b.delay_ms > 0
            && b.delay_destination
                .as_deref()
                .is_none_or(|d| d == request.destination);
        let delay = slow.then(|| Duration::from_millis(b.delay_ms));
        let drop_connection = l.behaviour.drop_next > 0;
        l.behaviour.drop_next = l.behaviour.drop_next.saturating_sub(1);
        let redirect = l.behaviour.redirect_next > 0;
        l.behaviour.redirect_next = l.behaviour.redirect_next.saturating_sub(1);
        let padded = l.behaviour.padded_next > 0;
        l.behaviour.padded_next = l.behaviour.padded_next.saturating_sub(1);
        if l.behaviour.proxy_reset_next > 0 {
            l.behaviour.proxy_reset_next -= 1;
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                [(axum::http::header::CONTENT_TYPE, "text/plain")],
                "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            )
                .into_response();
        }
        (answer, delay, drop_connection, redirect, padded)
    };
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    if drop_connection {
        // Unwinding the connection's task closes its socket with nothing written: the booking is made and the caller
        // never hears of it. `resume_unwind` skips the panic hook: nothing is printed, nothing went wrong.
        std::panic::resume_unwind(Box::new("the stand-in drops the connection"));
    }
    if redirect {
        return (
            StatusCode::SEE_OTHER,
            [(
                axum::http::header::LOCATION,
                format!("/pickups/{}", answer.slot_id),
            )],
        )
            .into_response();
    }
    if padded {
        return Json(serde_json::json!({
            "slotId": answer.slot_id,
            "pickupAt": answer.pickup_at,
            "padding": " ".repeat(4 << 20),
        }))
        .into_response();
    }
    Json(answer).into_response()
}

async fn by_key(State(shared): State<Shared>, Path(key): Path<String>) -> Response {
    let mut l = ledger(&shared);
    if l.behaviour.lookup_unrouted_next > 0 {
        l.behaviour.lookup_unrouted_next -= 1;
        return (
            StatusCode::NOT_FOUND,
            [(axum::http::header::CONTENT_TYPE, "text/plain")],
            "404 page not found",
        )
            .into_response();
    }
    match l.by_key.get(&key).map(|&i| &l.bookings[i]) {
        Some(b) => Json(SlotAnswer {
            slot_id: b.slot_id,
            pickup_at: b.pickup_at,
        })
        .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "no booking with this key"})),
        )
            .into_response(),
    }
}

async fn bookings(State(shared): State<Shared>) -> Json<Vec<Booking>> {
    Json(ledger(&shared).bookings.clone())
}

async fn behaviour_now(State(shared): State<Shared>) -> Json<Behaviour> {
    Json(ledger(&shared).behaviour.clone())
}

async fn set_behaviour(State(shared): State<Shared>, body: Bytes) -> Response {
    match serde_json::from_slice::<Behaviour>(&body) {
        Ok(behaviour) => {
            ledger(&shared).behaviour = behaviour.clone();
            Json(behaviour).into_response()
        }
        Err(e) => bad_request(format!("not a behaviour: {e}")),
    }
}
