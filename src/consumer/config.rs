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

/// The prefetch when none is given: [`DEFAULT_PREFETCH`], or batched, at least enough for every batch at work
/// ([`batch_workers`](super::batch_workers)) and one more being gathered. With no more than the batches at work,
/// a batch that ends waits a round trip to the broker (its acknowledgement out, the next deliveries in) before its
/// worker has anything to gather (measured at the defaults, one batch ahead gave the batched mode 1.15–1.17× the
/// throughput: `docs/performance.md`, "A batch ahead").
pub fn default_prefetch(concurrency: u16, batch_size: u16) -> u16 {
    let workers = super::batch_workers(usize::from(concurrency), usize::from(batch_size));
    prefetch_for(workers, batch_size)
}

fn prefetch_for(batch_workers: usize, batch_size: u16) -> u16 {
    match batch_size {
        0 | 1 => DEFAULT_PREFETCH,
        _ => batch_room(batch_workers, batch_size).max(DEFAULT_PREFETCH),
    }
}

/// What every batch at work and one more being gathered hold: `(batch workers + 1) × batch size`.
fn batch_room(batch_workers: usize, batch_size: u16) -> u16 {
    let room = (batch_workers + 1).saturating_mul(usize::from(batch_size));
    u16::try_from(room).unwrap_or(u16::MAX)
}

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
    /// Deliveries the broker may send ahead of acknowledgements; `None`: [`Config::prefetch`]'s default.
    pub prefetch: Option<u16>,
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
            prefetch: None,
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

    /// Deliveries the broker may send ahead of acknowledgements: `--prefetch`, or [`default_prefetch`] (of the batch
    /// workers a pool of `--pool-size` connections allows).
    pub fn prefetch(&self) -> u16 {
        self.prefetch.unwrap_or_else(|| match self.partitions {
            Some(_) => DEFAULT_PREFETCH,
            None => prefetch_for(self.batch_workers(), self.batch_size),
        })
    }

    /// Batches worked on at once ([`batch_workers`](super::batch_workers)), no more than the pool's connections.
    fn batch_workers(&self) -> usize {
        let connections = self.pool_size.unwrap_or(u32::from(self.workers()));
        super::batch_workers(usize::from(self.concurrency), usize::from(self.batch_size))
            .min(usize::try_from(connections).unwrap_or(usize::MAX))
            .max(1)
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

/// What to warn of when a batched consumer is given a prefetch under what its batches at work and one more hold:
/// then a batch that ends waits for its next deliveries (see [`default_prefetch`]).
pub(super) fn short_prefetch(config: &Config) -> Option<String> {
    if config.partitions.is_some() || config.batch_size <= 1 {
        return None;
    }
    let prefetch = config.prefetch();
    let room = batch_room(config.batch_workers(), config.batch_size);
    (prefetch < room).then(|| {
        format!(
            "--prefetch {prefetch} is under {room}, what the batches at work and one more being gathered hold: a \
             batch that ends waits for its next deliveries until the one before it is acknowledged"
        )
    })
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

    /// Batched, the prefetch by default leaves one batch ahead of those at work; one by one, partitioned, or given,
    /// it is what it was. A prefetch given under that room is warned of, never changed.
    #[test]
    fn a_batched_consumers_prefetch_leaves_one_batch_ahead_unless_given() {
        let batched = |concurrency, batch_size, prefetch| Config {
            concurrency,
            batch_size,
            prefetch,
            ..Config::default()
        };
        assert_eq!(Config::default().prefetch(), 64);
        assert_eq!(batched(16, 32, None).prefetch(), 96);
        assert_eq!(batched(128, 32, None).prefetch(), 160);
        assert_eq!(batched(16, 64, None).prefetch(), 192);
        assert_eq!(batched(8, 8, None).prefetch(), 64);
        assert_eq!(batched(1, 64, None).prefetch(), 128);
        assert_eq!(batched(1024, 64, None).prefetch(), 1088);
        assert_eq!(batched(16, 32, Some(7)).prefetch(), 7);
        let one_connection = Config {
            pool_size: Some(1),
            ..batched(16, 32, None)
        };
        assert_eq!(one_connection.prefetch(), 64);
        assert_eq!(
            short_prefetch(&Config {
                prefetch: Some(64),
                ..one_connection
            }),
            None
        );
        let partitioned = Config {
            partitions: Some(Partitions {
                count: 4,
                key: "parcelId".into(),
            }),
            ..batched(16, 32, None)
        };
        assert_eq!(partitioned.prefetch(), 64);

        assert_eq!(short_prefetch(&batched(16, 32, None)), None);
        assert_eq!(short_prefetch(&batched(16, 32, Some(96))), None);
        assert_eq!(short_prefetch(&batched(8, 8, Some(24))), None);
        assert_eq!(
            short_prefetch(&Config {
                prefetch: Some(1),
                ..Config::default()
            }),
            None
        );
        let warned = short_prefetch(&batched(16, 32, Some(64)))
            .expect("64 holds only the two batches at work");
        assert!(warned.contains("--prefetch 64 is under 96"), "{warned}");
        assert!(short_prefetch(&batched(8, 8, Some(23))).is_some());
    }

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
