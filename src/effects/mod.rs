//! Effects outside the database: the carrier as an HTTP API (`consume carrier --carrier-url`), called one of three
//! ways (`--effect-mode`), and what operators see and settle of those calls (`inboxctl effects`).
//!
//! - [`EffectMode::Keyed`]: the call is made inside the claim's transaction, with the idempotency key; a failure or a
//!   crash rolls the claim back and the redelivery calls again with the same key. Exactly once where the API keeps
//!   keys longer than the redelivery window.
//! - [`EffectMode::AfterCommit`]: the claim commits with a pending effect ([`crate::db::external`]); a worker in the
//!   consumer process leases it, calls with the key, retries with backoff, and records the outcome. A process that
//!   dies leaves it to the next. Exactly once with an API that honours keys, at least once otherwise — unless the API
//!   can be asked what it booked under a key (`--lookup-url`), which is asked first whenever an earlier call's outcome
//!   is unknown.
//! - [`EffectMode::AtMostOnce`]: the same, but a call whose outcome is unknown (a crash after it was leased, a timeout,
//!   a connection dropped) is never made again: it is in doubt until `effects resolve` or `effects reconcile`.

pub mod carrier;
pub mod client;
pub mod settle;
pub mod worker;

use std::time::Duration;

pub use carrier::{Answered, DeferredCarrier, HttpCarrier};
pub use client::{CallError, CarrierClient};

/// How a consumer makes its call to the outside world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EffectMode {
    #[default]
    Keyed,
    AfterCommit,
    AtMostOnce,
}

impl EffectMode {
    pub const ALL: [EffectMode; 3] = [
        EffectMode::Keyed,
        EffectMode::AfterCommit,
        EffectMode::AtMostOnce,
    ];

    /// As stored in `inboxctl_effects.mode` and named on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EffectMode::Keyed => "keyed",
            EffectMode::AfterCommit => "after-commit",
            EffectMode::AtMostOnce => "at-most-once",
        }
    }
}

pub const DEFAULT_CARRIER_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
pub const DEFAULT_KEY_TTL: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// How long a call whose outcome is unknown is left alone before the look-up is asked (`--lookup-quiet`).
pub const DEFAULT_LOOKUP_QUIET: Duration = Duration::from_secs(120);

/// A carrier reached over HTTP, and how the consumer calls it.
#[derive(Debug, Clone, PartialEq)]
pub struct CarrierApi {
    pub url: url::Url,
    /// The longest a call may take, answer included.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub mode: EffectMode,
    /// How long the API keeps idempotency keys (keyed): `replay` warns about messages older than this.
    pub key_ttl: Duration,
    /// How long a process holds an effect it is calling for (after-commit, at-most-once); longer than `timeout`, so a
    /// call has ended before another process may take the effect over.
    pub lease: Duration,
    /// Where to ask what was booked under a key (`GET <base>/pickups/by-key/{key}`), after-commit.
    pub lookup_url: Option<url::Url>,
    /// With a look-up: how long a call whose outcome is unknown is left alone before it is asked. A request whose
    /// answer never came (a timeout, a gateway's 504) may still be at work at the carrier, and a look-up before it
    /// books answers 404: the call would be made again, and a carrier that ignores keys would book twice.
    pub lookup_quiet: Duration,
}

impl CarrierApi {
    pub fn new(url: url::Url) -> Self {
        Self {
            url,
            timeout: DEFAULT_CARRIER_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            mode: EffectMode::Keyed,
            key_ttl: DEFAULT_KEY_TTL,
            lease: DEFAULT_LEASE,
            lookup_url: None,
            lookup_quiet: DEFAULT_LOOKUP_QUIET,
        }
    }
}
