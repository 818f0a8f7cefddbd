//! The carrier's booking API over HTTP (reqwest with rustls): a booking, sent with its idempotency key, and the
//! look-up of what was booked under a key. What the server says is masked of passwords and bounded before it is kept;
//! like all text from outside, it is escaped where it is shown (a table, a log line), and only there.

use std::time::Duration;

use reqwest::StatusCode;
use uuid::Uuid;

use crate::carrier_stub::{PickupBody, SlotAnswer};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::parcel::PickupRequest;
use crate::redact;

/// The most of a server's error text kept.
const MAX_ERROR_TEXT: usize = 300;

/// Why a call did not give a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The carrier answered with an error, or the request never reached it: nothing was booked.
    #[error("{0}")]
    Refused(String),
    /// The request may have reached the carrier, and no answer came (a timeout, a connection dropped, an answer that
    /// cannot be read): it may or may not have booked.
    #[error("{0}")]
    Unknown(String),
}

/// A carrier's HTTP API at a base URL.
#[derive(Debug, Clone)]
pub struct CarrierClient {
    http: reqwest::Client,
    base: url::Url,
    /// The longest one call may take: its timeout and its connect timeout.
    longest: Duration,
}

impl CarrierClient {
    pub fn new(base: &url::Url, timeout: Duration, connect_timeout: Duration) -> Result<Self> {
        if !matches!(base.scheme(), "http" | "https") {
            return Err(Error::Usage(format!(
                "the carrier URL must be http:// or https://, not {}://",
                base.scheme()
            )));
        }
        redact::register_url(base.as_str());
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Error::Usage(format!("the carrier's HTTP client: {e}")))?;
        let mut base = base.clone();
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        Ok(Self {
            http,
            base,
            longest: timeout + connect_timeout,
        })
    }

    /// The longest one call may take (`--carrier-timeout` plus the connect timeout).
    pub fn longest_call(&self) -> Duration {
        self.longest
    }

    fn url(&self, path: &str) -> std::result::Result<url::Url, CallError> {
        self.base
            .join(path)
            .map_err(|e| CallError::Refused(format!("carrier URL: {e}")))
    }

    /// Books a pickup with the request's idempotency key.
    pub async fn book(
        &self,
        request: &PickupRequest,
    ) -> std::result::Result<SlotAnswer, CallError> {
        failpoint::hit_with("effect-after-intent", &request.destination).await;
        let body = PickupBody {
            parcel_id: request.parcel_id,
            tracking_number: request.tracking_number.clone(),
            destination: request.destination.clone(),
        };
        let sent = self
            .http
            .post(self.url("pickups")?)
            .header("Idempotency-Key", request.idempotency_key.to_string())
            .json(&body)
            .send()
            .await;
        let answer = answer(sent).await?;
        failpoint::hit_with("effect-after-response", &request.destination).await;
        Ok(answer)
    }

    /// What was booked under `key`, if anything.
    pub async fn lookup(&self, key: Uuid) -> std::result::Result<Option<SlotAnswer>, CallError> {
        let sent = self
            .http
            .get(self.url(&format!("pickups/by-key/{key}"))?)
            .send()
            .await;
        match sent {
            // The carrier's own "no booking under this key". A 404 that is not its answer — a proxy's page for a
            // path it has no route for, a look-up URL set wrong — says nothing of the booking: taken for "none", the
            // call would be made again on every look-up, and booked twice.
            Ok(response) if response.status() == StatusCode::NOT_FOUND && carriers_own(&response) => {
                Ok(None)
            }
            Ok(response) if response.status() == StatusCode::NOT_FOUND => {
                Err(CallError::Unknown(
                    "the look-up answered 404 without the carrier's JSON (a proxy with no route for it, a look-up \
                     URL set wrong?): not taken for \"nothing booked\""
                        .to_owned(),
                ))
            }
            other => answer(other).await.map(Some),
        }
    }
}

/// A slot from a response, or why there is none.
async fn answer(
    sent: reqwest::Result<reqwest::Response>,
) -> std::result::Result<SlotAnswer, CallError> {
    let response = match sent {
        Ok(response) => response,
        // Never connected: the request cannot have reached the carrier.
        Err(e) if e.is_connect() => {
            return Err(CallError::Refused(bounded(&format!(
                "carrier unreachable: {}",
                chain(&e)
            ))));
        }
        Err(e) if e.is_timeout() => {
            return Err(CallError::Unknown(
                "no answer from the carrier within --carrier-timeout".to_owned(),
            ));
        }
        Err(e) => {
            return Err(CallError::Unknown(bounded(&format!(
                "the carrier's answer was lost: {}",
                chain(&e)
            ))));
        }
    };
    let status = response.status();
    if !status.is_success() {
        let own = carriers_own(&response);
        // Only its first bytes are read (what is shown is cut to a few hundred characters anyway).
        let (body, _) = read_bounded(response, MAX_ERROR_BODY).await;
        let text = String::from_utf8_lossy(&body);
        let said = bounded(&format!("carrier API returned {status}: {}", text.trim()));
        return Err(if refused(status, own) {
            CallError::Refused(said)
        } else {
            CallError::Unknown(said)
        });
    }
    let (body, whole) = read_bounded(response, MAX_ANSWER).await;
    match whole {
        Ok(true) => {}
        Ok(false) => {
            return Err(CallError::Unknown(format!(
                "the carrier answered {status} with more than {} KiB: not read",
                MAX_ANSWER / 1024
            )));
        }
        Err(e) => {
            return Err(CallError::Unknown(bounded(&format!(
                "the carrier's answer was lost: {}",
                chain(&e)
            ))));
        }
    }
    let slot = serde_json::from_slice::<SlotAnswer>(&body).map_err(|e| {
        CallError::Unknown(bounded(&format!(
            "the carrier answered {status} with no slot it could read: {e}"
        )))
    })?;
    plausible(slot)
}

/// A slot whose pickup time PostgreSQL can store, and which can be a pickup's: a year before 1970 or past 9999 (JSON
/// takes any, PostgreSQL refuses those before 4713 BC) could never be recorded, and the call would be leased again
/// and again for a booking it cannot write down. Such an answer leaves the outcome unknown.
fn plausible(slot: SlotAnswer) -> std::result::Result<SlotAnswer, CallError> {
    use chrono::Datelike as _;
    if (1970..=9999).contains(&slot.pickup_at.year()) {
        Ok(slot)
    } else {
        Err(CallError::Unknown(format!(
            "the carrier answered a pickup time no pickup can have ({}): not recorded",
            slot.pickup_at.year()
        )))
    }
}

/// The most of a successful answer read: a slot is a few hundred bytes.
const MAX_ANSWER: usize = 64 * 1024;
/// The most of an error's body read.
const MAX_ERROR_BODY: usize = 4 * 1024;

/// At most `limit` bytes of `response`'s body, and whether that was all of it (`Err`: reading it failed). A body
/// of any size (a stream without end, gigabytes) costs at most `limit` bytes of memory: reading stops there.
async fn read_bounded(
    mut response: reqwest::Response,
    limit: usize,
) -> (Vec<u8>, reqwest::Result<bool>) {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    body.extend_from_slice(&chunk[..limit - body.len()]);
                    return (body, Ok(false));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return (body, Ok(true)),
            Err(e) => return (body, Err(e)),
        }
    }
}

/// Whether a status the carrier answered with says that nothing was booked: a client error (4xx: the request was
/// refused as it stands, by the carrier or by a proxy before it), or 503 (the service would not take it) — the
/// carrier's own, with its JSON: a proxy answers 503 too when its upstream reset the connection after taking the
/// request ("reset before headers"), the booking maybe made. Any other — a 500 that may have come after the booking
/// was made, a gateway's 502 or 504 whose carrier behind it may have booked, a redirect (a `303 See Other` to the
/// booking made, redirects not being followed) — leaves the outcome unknown: an at-most-once call is then in doubt,
/// not made again, and an after-commit one asks the look-up first. `own`: [`carriers_own`].
fn refused(status: StatusCode, own: bool) -> bool {
    status.is_client_error() || (status == StatusCode::SERVICE_UNAVAILABLE && own)
}

/// Whether an answer is the carrier API's own (JSON), not a page a proxy or gateway in front of it made (HTML, plain
/// text, nothing).
fn carriers_own(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|v| v == "application/json" || v.ends_with("+json"))
}

/// An error and its causes on one line, without the URL (which may hold a password).
fn chain(e: &reqwest::Error) -> String {
    let mut text = String::new();
    let first: &dyn std::error::Error = e;
    for cause in std::iter::successors(Some(first), |c| c.source()).take(crate::MAX_CAUSES) {
        let line = cause.to_string();
        if !text.contains(&line) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&line);
        }
    }
    text
}

/// Server or network text made fit to keep (a call's `last_error`, a failure's reason): no password, and at most
/// [`MAX_ERROR_TEXT`] characters. Not escaped: what shows it escapes it (escaped here as well, a `\u{1b}` the server
/// sent was shown as `\\u{1b}`, and a backslash as four).
fn bounded(text: &str) -> String {
    let masked = redact::text(text);
    match masked.char_indices().nth(MAX_ERROR_TEXT) {
        Some((at, _)) => format!("{}…", &masked[..at]),
        None => masked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_text_is_bounded_and_masked_and_kept_unescaped() {
        let long = format!(
            "bad\u{1b}[2J C:\\carrier amqp://ops:hunter2@mq/ {}",
            "x".repeat(1000)
        );
        let out = bounded(&long);
        assert!(out.chars().count() <= MAX_ERROR_TEXT + 1);
        assert!(!out.contains("hunter2"), "{out}");
        // Escaped only where it is shown: once here, it was escaped a second time there.
        assert!(out.starts_with("bad\u{1b}[2J C:\\carrier "), "{out:?}");
        let shown = crate::sanitize::text(&out);
        assert!(shown.starts_with("bad\\u{1b}[2J C:\\\\carrier "), "{shown}");
    }

    #[test]
    fn a_pickup_time_no_pickup_can_have_leaves_the_outcome_unknown() {
        let slot = |at: &str| SlotAnswer {
            slot_id: Uuid::nil(),
            pickup_at: at.parse().expect("time"),
        };
        assert!(plausible(slot("2026-12-07T08:00:00Z")).is_ok());
        for odd in [
            "-5000-01-01T00:00:00Z",
            "0001-01-01T00:00:00Z",
            "+10000-01-01T00:00:00Z",
        ] {
            assert!(
                matches!(plausible(slot(odd)), Err(CallError::Unknown(_))),
                "{odd}"
            );
        }
    }

    #[test]
    fn only_http_urls() {
        let url = url::Url::parse("ftp://example.invalid/").expect("url");
        assert!(CarrierClient::new(&url, Duration::from_secs(1), Duration::from_secs(1)).is_err());
    }
}
