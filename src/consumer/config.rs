//! What `consume` is told ([`Config`]) and the checks it must pass before anything starts: the names it derives,
//! the bound on an attempt, a carrier API where one applies.
//!
//! [`Config::default`] holds `consume`'s defaults: the face's flags start from the same values (a test in
//! `cmd::consume` keeps the two equal), so `demo`, the bench and `consume` run one and the same consumer.

use std::net::SocketAddr;
use std::time::Duration;

use super::{OnConflict, Partitions};
use crate::amqp::{self, topology};
use crate::effects::{CarrierApi, EffectMode};
use crate::error::{Error, Result};
use crate::inbox::ConsumerType;
use crate::parcel::Kind;

pub const DEFAULT_PREFETCH: u16 = 64;
pub const DEFAULT_CONCURRENCY: u16 = 16;
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(200);
pub const DEFAULT_CLAIM_TIMEOUT: Duration = Duration::from_secs(30);
/// What an attempt's bound allows beyond its longest wait on purpose, when `--attempt-timeout` is not given: with the
/// default `--claim-timeout`, 60s.
pub const ATTEMPT_MARGIN: Duration = Duration::from_secs(30);
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
pub use crate::amqp::DEFAULT_BROKER_TIMEOUT;
pub const DEFAULT_BATCH_SIZE: u16 = 1;
pub const DEFAULT_BATCH_WAIT: Duration = Duration::from_millis(5);
pub const DEFAULT_POISON_AFTER: u32 = 3;

/// Everything `consume` is told; [`Default`] is `consume carrier` with no flags.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub consumer: Kind,
    /// The queue to read; `None`: the consumer's own ([`Kind::default_queue`]).
    pub queue: Option<String>,
    /// The exchange the event is published to.
    pub exchange: String,
    /// What the queue and its dead-letter queues are declared as where they do not exist.
    pub queue_type: topology::QueueType,
    /// The deduplication scope; `None`: the queue's name.
    pub consumer_type: Option<String>,
    pub prefetch: u16,
    pub concurrency: u16,
    /// Most PostgreSQL connections; `None`: `concurrency`.
    pub pool_size: Option<u32>,
    pub max_attempts: u32,
    pub retry_delay: Duration,
    /// How long a copy waits for another process's attempt at the same message (PostgreSQL's `lock_timeout`).
    pub claim_timeout: Duration,
    /// How long one attempt at a message (or one round of a batch) may take before its connection is given up
    /// (`--attempt-timeout`); `None`: [`Config::attempt_timeout`]'s default, from the waits an attempt makes.
    pub attempt_timeout: Option<Duration>,
    pub exit_when_idle: Option<Duration>,
    pub shutdown_timeout: Duration,
    /// How long a call to RabbitMQ may take before the connection is given up (`--broker-timeout`).
    pub broker_timeout: Duration,
    pub batch_size: u16,
    pub batch_wait: Duration,
    pub poison_after: u32,
    pub on_conflict: OnConflict,
    pub metrics_addr: Option<SocketAddr>,
    /// The stand-in carrier (or SMS gateway) fails every call for parcels to this destination.
    pub fail_destination: Option<String>,
    /// Spread over partition queues, one message at a time in each (`concurrency` and `batch_size` do not apply).
    pub partitions: Option<Partitions>,
    /// The carrier as an HTTP API (the carrier consumer only); `None`: the stand-in that writes a row.
    pub carrier_api: Option<CarrierApi>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            consumer: Kind::Carrier,
            queue: None,
            exchange: topology::PARCEL_CREATED_EXCHANGE.to_owned(),
            queue_type: topology::QueueType::Classic,
            consumer_type: None,
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            pool_size: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_delay: DEFAULT_RETRY_DELAY,
            claim_timeout: DEFAULT_CLAIM_TIMEOUT,
            attempt_timeout: None,
            exit_when_idle: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            broker_timeout: DEFAULT_BROKER_TIMEOUT,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_wait: DEFAULT_BATCH_WAIT,
            poison_after: DEFAULT_POISON_AFTER,
            on_conflict: OnConflict::DeadLetter,
            metrics_addr: None,
            fail_destination: None,
            partitions: None,
            carrier_api: None,
        }
    }
}

impl Config {
    /// `consume <consumer>` with every default.
    pub fn of(consumer: Kind) -> Self {
        Self {
            consumer,
            ..Self::default()
        }
    }

    /// Messages worked on at once: `concurrency`, or partitioned, one per partition.
    pub fn workers(&self) -> u16 {
        self.partitions
            .as_ref()
            .map_or(self.concurrency, |p| p.count)
    }

    pub fn queue(&self) -> &str {
        self.queue
            .as_deref()
            .unwrap_or(self.consumer.default_queue())
    }

    /// The longest an attempt waits on purpose: up to `--claim-timeout` for another attempt at its message before its
    /// own work starts, and keyed, a call to the carrier inside its transaction (`--carrier-timeout`, after a connect
    /// of up to its own timeout) — batched, one for each member of the batch, in turn.
    fn attempt_waits(&self) -> Duration {
        let members = match self.partitions {
            Some(_) => 1,
            None => u32::from(self.batch_size.max(1)),
        };
        let keyed_calls = self
            .carrier_api
            .as_ref()
            .filter(|api| api.mode == EffectMode::Keyed)
            .map(|api| (api.timeout + api.connect_timeout) * members);
        self.claim_timeout + keyed_calls.unwrap_or_default()
    }

    /// The bound on one attempt: `--attempt-timeout` when given, else [`ATTEMPT_MARGIN`] beyond what the attempt
    /// waits for on purpose (60s with the defaults), so that a longer `--claim-timeout` or `--carrier-timeout` never
    /// needs a second flag.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
            .unwrap_or_else(|| self.attempt_waits() + ATTEMPT_MARGIN)
    }
}

/// The queue to consume and the consumer_type to claim under, checked: the queue and its dead-letter queues must be
/// valid AMQP names.
pub(super) fn names(config: &Config) -> Result<(String, ConsumerType)> {
    let queue = config.queue().to_owned();
    amqp::validate_name("--queue", &queue)?;
    // The dead-letter queues' (and partitioned, the partitions' exchange's) names are the queue's with a suffix:
    // they must be valid too, or the first message to move aside would find no name to go to.
    let (longest, what) = match config.partitions {
        Some(_) => (
            topology::partition_exchange(&queue),
            "its partitions' exchange <queue>.partitions",
        ),
        None => (
            topology::skipped_queue(&queue),
            "its dead-letter queue <queue>_skipped",
        ),
    };
    if longest.len() > 255 {
        let suffix = longest.len() - queue.len();
        return Err(Error::Usage(format!(
            "--queue is {} bytes long; the name of {what} would be {} bytes, past AMQP's 255: at most {} bytes",
            queue.len(),
            longest.len(),
            255 - suffix
        )));
    }
    let consumer_type = ConsumerType::new(
        config
            .consumer_type
            .clone()
            .unwrap_or_else(|| queue.clone()),
    )
    .map_err(|e| Error::Usage(format!("--consumer-type: {e}")))?;
    Ok((queue, consumer_type))
}

/// A bound on the whole attempt no longer than what it waits for on purpose would give up attempts that are only
/// waiting their turn, or a call in progress — as the database unavailable, tried again for ever, never counted
/// against the message.
pub(super) fn check_attempt_timeout(config: &Config) -> Result<()> {
    let waits = config.attempt_waits();
    let limit = config.attempt_timeout();
    if limit <= waits {
        return Err(Error::Usage(format!(
            "--attempt-timeout ({}) must be longer than --claim-timeout{} ({}): an attempt may wait that long before \
             it is done",
            crate::cli::show(limit),
            if waits > config.claim_timeout {
                " plus the keyed calls to the carrier a batch makes, with their connects"
            } else {
                ""
            },
            crate::cli::show(waits),
        )));
    }
    Ok(())
}

/// Refuses a carrier API where it cannot apply: on the notification consumer, and with a lease no longer than a call
/// may take (another process could take over an effect whose call is still in flight).
pub(super) fn check_carrier_api(config: &Config) -> Result<()> {
    let Some(api) = &config.carrier_api else {
        return Ok(());
    };
    if config.consumer != Kind::Carrier {
        return Err(Error::Usage(
            "--carrier-url applies to the carrier consumer only".to_owned(),
        ));
    }
    // One leased attempt makes the call, and, with a look-up, asks the look-up first: both within the lease.
    let calls = if api.lookup_url.is_some() { 2 } else { 1 };
    let longest = (api.timeout + api.connect_timeout).saturating_mul(calls);
    if api.mode != EffectMode::Keyed && api.lease <= longest {
        return Err(Error::Usage(format!(
            "--effect-lease ({}) must be longer than {}--carrier-timeout plus the connect timeout ({}): a call must \
             have ended before another process may take its effect over",
            crate::cli::show(api.lease),
            if calls == 2 {
                "the look-up (--lookup-url) and the call: twice "
            } else {
                ""
            },
            crate::cli::show(longest)
        )));
    }
    // Each key's order is kept for what its messages' transactions do, one at a time on its partition; calls made
    // after the commit are leased and made several at once, a call refused once made again after the next one.
    if config.partitions.is_some() && api.mode != EffectMode::Keyed {
        return Err(Error::Usage(format!(
            "--partitions keeps each key's order for work done in its messages' transactions: --effect-mode {} makes \
             the carrier's calls after the commit, several at once and in any order; use --effect-mode keyed",
            api.mode.name()
        )));
    }
    if api.lookup_url.is_some() && api.mode != EffectMode::AfterCommit {
        return Err(Error::Usage(
            "--lookup-url applies to --effect-mode after-commit (an at-most-once effect in doubt is settled by \
             `inboxctl effects reconcile`)"
                .to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_api(consumer: Kind, mode: EffectMode) -> Config {
        let mut api = CarrierApi::new(url::Url::parse("http://127.0.0.1:1").expect("url"));
        api.mode = mode;
        Config {
            carrier_api: Some(api),
            ..Config::of(consumer)
        }
    }

    #[test]
    fn an_attempt_timeout_outlasts_what_an_attempt_waits_for() {
        let default = Config::default();
        assert_eq!(default.attempt_timeout(), Duration::from_secs(60));
        assert!(check_attempt_timeout(&default).is_ok());
        // A longer claim wait, or a keyed call, moves the default along: no second flag needed.
        let long_claim = Config {
            claim_timeout: Duration::from_secs(600),
            ..Config::default()
        };
        assert_eq!(long_claim.attempt_timeout(), Duration::from_secs(630));
        assert!(check_attempt_timeout(&long_claim).is_ok());
        let keyed = with_api(Kind::Carrier, EffectMode::Keyed);
        assert_eq!(
            keyed.attempt_timeout(),
            Duration::from_secs(30 + 10 + 3 + 30)
        );
        // Batched, keyed: a call for each member, in turn, in one transaction.
        let keyed_batches = Config {
            batch_size: 8,
            ..keyed.clone()
        };
        assert_eq!(
            keyed_batches.attempt_timeout(),
            Duration::from_secs(30 + 8 * 13 + 30)
        );
        // After commit, the call is outside the attempt.
        let after_commit = with_api(Kind::Carrier, EffectMode::AfterCommit);
        assert_eq!(after_commit.attempt_timeout(), Duration::from_secs(60));

        // Given, it must be longer than those waits.
        for (config, given, named) in [
            (Config::default(), 30, "--claim-timeout (30s)"),
            (Config::default(), 10, "--claim-timeout (30s)"),
            (
                keyed.clone(),
                40,
                "keyed calls to the carrier a batch makes, with their connects (43s)",
            ),
        ] {
            let short = Config {
                attempt_timeout: Some(Duration::from_secs(given)),
                ..config
            };
            let err = check_attempt_timeout(&short).expect_err("no longer than the waits");
            assert!(matches!(err, Error::Usage(_)), "{err}");
            assert!(
                err.to_string().contains("--attempt-timeout") && err.to_string().contains(named),
                "{err}"
            );
        }
        let given = Config {
            attempt_timeout: Some(Duration::from_secs(44)),
            ..keyed
        };
        assert!(check_attempt_timeout(&given).is_ok());
        assert_eq!(given.attempt_timeout(), Duration::from_secs(44));
    }

    #[test]
    fn partitions_take_only_calls_made_in_the_transaction() {
        let partitioned = |mode| Config {
            partitions: Some(crate::consumer::Partitions {
                count: 4,
                key: "parcelId".into(),
            }),
            ..with_api(Kind::Carrier, mode)
        };
        assert!(check_carrier_api(&partitioned(EffectMode::Keyed)).is_ok());
        for mode in [EffectMode::AfterCommit, EffectMode::AtMostOnce] {
            let err = check_carrier_api(&partitioned(mode)).expect_err("calls made out of order");
            assert!(
                matches!(err, Error::Usage(_)) && err.to_string().contains(mode.name()),
                "{err}"
            );
        }
    }

    #[test]
    fn a_carrier_api_is_refused_where_it_cannot_apply() {
        assert!(check_carrier_api(&with_api(Kind::Carrier, EffectMode::Keyed)).is_ok());
        assert!(check_carrier_api(&with_api(Kind::Notification, EffectMode::Keyed)).is_err());
        let mut short = with_api(Kind::Carrier, EffectMode::AfterCommit);
        assert!(check_carrier_api(&short).is_ok(), "the defaults fit");
        if let Some(api) = short.carrier_api.as_mut() {
            api.lease = api.timeout;
        }
        let err = check_carrier_api(&short).expect_err("a lease no longer than a call");
        assert!(err.to_string().contains("--effect-lease"), "{err}");
        let mut lookup = with_api(Kind::Carrier, EffectMode::AtMostOnce);
        if let Some(api) = lookup.carrier_api.as_mut() {
            api.lookup_url = Some(api.url.clone());
        }
        assert!(
            check_carrier_api(&lookup).is_err(),
            "at-most-once takes no look-up"
        );
    }
}
