//! `inboxctl consume <carrier|notification>`: one Parcel Tracker consumer in the foreground until SIGINT/SIGTERM.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::amqp::topology::{self, QueueType};
use crate::cli::{GlobalOpts, parse_duration, parse_positive_duration};
use crate::consumer::OnConflict;
use crate::consumer::config::{
    Config, DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, DEFAULT_MAX_ATTEMPTS, DEFAULT_POISON_AFTER,
    DEFAULT_PREFETCH,
};
use crate::consumer::start;
use crate::effects::{CarrierApi, EffectMode};
use crate::error::{Outcome, Result};
use crate::parcel::Kind;

/// `consume carrier|notification`.
impl clap::ValueEnum for Kind {
    fn value_variants<'a>() -> &'a [Self] {
        &Kind::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            Kind::Carrier => clap::builder::PossibleValue::new("carrier").help(
                "Reserves a pickup slot with the carrier for each new parcel (queue parcel-created-carrier)",
            ),
            Kind::Notification => clap::builder::PossibleValue::new("notification")
                .help("Sends an SMS for each new parcel (queue parcel-created-notification)"),
        })
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Which consumer
    #[arg(value_enum)]
    pub consumer: Kind,

    /// The queue to read (default: parcel-created-carrier or parcel-created-notification)
    #[arg(long)]
    pub queue: Option<String>,

    /// The exchange the event is published to; the queue is bound to it through an exchange of its own name
    #[arg(long, default_value = topology::PARCEL_CREATED_EXCHANGE)]
    pub exchange: String,

    /// What the queue and its <queue>_error and <queue>_skipped are declared as where they do not exist (an existing
    /// queue is used as it is)
    #[arg(long, value_enum, default_value_t = QueueType::Classic)]
    pub queue_type: QueueType,

    /// The deduplication scope written to inbox_messages.consumer_type (default: the queue name, as the .NET
    /// tutorial does, so inboxctl can take over a queue from a .NET consumer without reprocessing)
    #[arg(long)]
    pub consumer_type: Option<String>,

    /// Deliveries the broker may send ahead of acknowledgements
    #[arg(long, default_value_t = DEFAULT_PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,

    /// Messages processed at once
    #[arg(long, default_value_t = DEFAULT_CONCURRENCY, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub concurrency: u16,

    /// Most PostgreSQL connections (default: --concurrency)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub pool_size: Option<u32>,

    /// Attempts of a message whose processing fails, before it moves to <queue>_error
    #[arg(long, default_value_t = DEFAULT_MAX_ATTEMPTS, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_attempts: u32,

    /// Delay before the second attempt; doubles for each further one, up to 30s (so at most 30s itself)
    #[arg(long, default_value = "200ms",
          value_parser = crate::cli::duration_between(Duration::ZERO, crate::consumer::MAX_RETRY_DELAY))]
    pub retry_delay: Duration,

    /// How long a copy waits for another process's in-flight attempt at the same message before it backs off
    /// (from 100ms to 24 days)
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_lock_timeout)]
    pub claim_timeout: Duration,

    /// How long one attempt at a message (a batch, batched) may take before it is given up: its
    /// connection is dropped and the message tried again, not counted against it (twice in a row, with PostgreSQL then
    /// answering, it is: the work is slow or stuck on that message). Bounds a connection that died
    /// without a word (a host lost, a network cut), which would otherwise hold its message until the kernel's TCP
    /// timeout; the server also ends a consumer's session idle inside a transaction for this long. Longer than
    /// --claim-timeout (plus, with --effect-mode keyed, --carrier-timeout and its connect timeout for each member of a
    /// batch) [default: 30s more than that, 60s with the other defaults]
    #[arg(long, value_parser = crate::cli::parse_lock_timeout)]
    pub attempt_timeout: Option<Duration>,

    /// End once nothing arrived and nothing was in flight for this long, the queue is empty and no call to the
    /// carrier is owed (scripts, tests)
    #[arg(long, value_parser = parse_positive_duration)]
    pub exit_when_idle: Option<Duration>,

    /// After SIGINT/SIGTERM, how long in-flight messages may take; past it they are rolled back and redelivered
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// How long any call to RabbitMQ may take (an ack or nack, a dead-letter copy's confirm, setting a connection
    /// up); past it the connection is dropped and opened again, and what was not settled comes back as duplicates. A
    /// dead-letter copy the broker blocks (a memory or disk alarm) may wait for the alarm to end, in at most half the
    /// workers (on a partition queue, always)
    #[arg(long, default_value = "30s", value_parser = parse_positive_duration)]
    pub broker_timeout: Duration,

    /// Up to this many deliveries share one transaction, their effects written together (1: one transaction per
    /// message). At most 64
    #[arg(long, default_value_t = DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub batch_size: u16,

    /// How long a batch waits to fill, only while another batch is running (a lone message never waits)
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub batch_wait: Duration,

    /// A redelivered message that started this many times without an outcome, each start ending the consumer process
    /// (an abort, a crash, a kill), goes to <queue>_error at its next delivery
    #[arg(long, default_value_t = DEFAULT_POISON_AFTER, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub poison_after: u32,

    /// What to do with a message whose id was processed before for another event (a producer reusing ids): it is
    /// never processed, and always counted and logged as a conflict; dead-letter moves it to <queue>_error for a look,
    /// discard drops it like a duplicate
    #[arg(long, value_enum, default_value_t = OnConflict::DeadLetter)]
    pub on_conflict: OnConflict,

    /// Serve Prometheus metrics on /metrics and a health check on /health at this address (e.g. 127.0.0.1:9464)
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Spread the queue over this many partition queues (<queue>.0 …) fed by a consistent-hash exchange
    /// (<queue>.partitions) on the routing key, each read by one active consumer one message at a time: messages of
    /// one key are processed in the order they were published, N keys at once. Needs --partition-key
    #[arg(long, value_name = "N", requires = "partition_key", conflicts_with_all = ["concurrency", "batch_size"],
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub partitions: Option<u16>,

    /// The message field publishers set as the routing key (e.g. parcelId): the consumer checks each message
    /// against it and says when a publisher did not
    #[arg(long, value_name = "FIELD", requires = "partitions")]
    pub partition_key: Option<String>,

    /// Make the stand-in carrier (or SMS gateway) fail every call for parcels to this destination, like an API that
    /// is down: shows retries and the error queue
    #[arg(long, value_name = "DESTINATION")]
    pub fail_destination: Option<String>,

    /// Book pickups with the carrier's HTTP API at this base URL (POST <url>/pickups, with an Idempotency-Key)
    /// instead of the stand-in that writes a row. Carrier consumer only
    #[arg(long, value_name = "URL", conflicts_with = "fail_destination", value_parser = crate::cli::SecretUrl)]
    pub carrier_url: Option<url::Url>,

    /// The longest a call to the carrier may take, its answer included
    #[arg(long, default_value = "10s", requires = "carrier_url", value_parser = crate::cli::duration_between(Duration::from_millis(100), Duration::from_secs(600)))]
    pub carrier_timeout: Duration,

    /// The longest connecting to the carrier may take
    #[arg(long, default_value = "3s", requires = "carrier_url", value_parser = crate::cli::duration_between(Duration::from_millis(100), Duration::from_secs(600)))]
    pub carrier_connect_timeout: Duration,

    /// How the call to the carrier is made (see the README's "Effects outside the database")
    #[arg(long, value_enum, default_value_t = EffectMode::Keyed, requires = "carrier_url")]
    pub effect_mode: EffectMode,

    /// How long the carrier keeps idempotency keys: `replay` warns about messages older than this (keyed), and an
    /// after-commit call whose outcome is unknown is not sent again once its key is this old, but put in doubt
    #[arg(long, default_value = "24h", requires = "carrier_url", value_parser = parse_positive_duration)]
    pub effect_key_ttl: Duration,

    /// How long a process holds an effect while it calls (after-commit, at-most-once): past it, another process may
    /// take the effect over. Longer than --carrier-timeout plus --carrier-connect-timeout
    #[arg(long, default_value = "30s", requires = "carrier_url", value_parser = parse_positive_duration)]
    pub effect_lease: Duration,

    /// after-commit: where to ask the carrier what it booked under a key (GET <url>/pickups/by-key/{key}) before
    /// calling again for an effect whose earlier call has an unknown outcome; without it, such a call is made again
    #[arg(long, value_name = "URL", requires = "carrier_url", value_parser = crate::cli::SecretUrl)]
    pub lookup_url: Option<url::Url>,

    /// With --lookup-url: how long a call whose outcome is unknown (a timeout, a gateway's 504, a crash) is left
    /// alone before the look-up is asked. The carrier may still be at work on a request whose answer never came; a
    /// look-up before it books answers 404 and the call is made again. At least how long the carrier may go on with
    /// a request its caller gave up on
    #[arg(long, default_value = "2m", requires = "lookup_url", value_parser = crate::cli::parse_duration)]
    pub lookup_quiet: Duration,
}

/// `--effect-mode keyed|after-commit|at-most-once`.
impl clap::ValueEnum for EffectMode {
    fn value_variants<'a>() -> &'a [Self] {
        &EffectMode::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            EffectMode::Keyed => clap::builder::PossibleValue::new("keyed").help(
                "Call inside the claim's transaction with the idempotency key; a failure or crash rolls back and the \
                 redelivery calls again with the same key. For APIs that honour keys",
            ),
            EffectMode::AfterCommit => clap::builder::PossibleValue::new("after-commit").help(
                "Commit the claim with the call owed, then call (with the key), retrying until done; a process that \
                 dies leaves it to the next. Exactly once with keyed APIs, at least once otherwise",
            ),
            EffectMode::AtMostOnce => clap::builder::PossibleValue::new("at-most-once").help(
                "Commit the intent, call once, commit the outcome; a call whose outcome is unknown is never made \
                 again but listed in doubt (`inboxctl effects --in-doubt`)",
            ),
        })
    }
}

/// `--queue-type classic|quorum`.
impl clap::ValueEnum for QueueType {
    fn value_variants<'a>() -> &'a [Self] {
        &[QueueType::Classic, QueueType::Quorum]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            QueueType::Classic => clap::builder::PossibleValue::new("classic")
                .help("On one node, as MassTransit declares by default"),
            QueueType::Quorum => clap::builder::PossibleValue::new("quorum").help(
                "Replicated over the cluster's nodes; the broker counts each message's deliveries",
            ),
        })
    }
}

/// `--on-conflict dead-letter|discard`.
impl clap::ValueEnum for OnConflict {
    fn value_variants<'a>() -> &'a [Self] {
        &[OnConflict::DeadLetter, OnConflict::Discard]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            OnConflict::DeadLetter => clap::builder::PossibleValue::new("dead-letter")
                .help("Moved to <queue>_error with the reason, for someone to look at: it is a bug upstream"),
            OnConflict::Discard => {
                clap::builder::PossibleValue::new("discard").help("Acknowledged and dropped, like a duplicate")
            }
        })
    }
}

impl Args {
    /// The consumer these arguments describe.
    pub fn config(&self) -> Config {
        Config {
            consumer: self.consumer,
            queue: self.queue.clone(),
            exchange: self.exchange.clone(),
            queue_type: self.queue_type,
            consumer_type: self.consumer_type.clone(),
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            pool_size: self.pool_size,
            max_attempts: self.max_attempts,
            retry_delay: self.retry_delay,
            claim_timeout: self.claim_timeout,
            attempt_timeout: self.attempt_timeout,
            exit_when_idle: self.exit_when_idle,
            shutdown_timeout: self.shutdown_timeout,
            broker_timeout: self.broker_timeout,
            batch_size: self.batch_size,
            batch_wait: self.batch_wait,
            poison_after: self.poison_after,
            on_conflict: self.on_conflict,
            metrics_addr: self.metrics_addr,
            fail_destination: self.fail_destination.clone(),
            partitions: self
                .partitions
                .zip(self.partition_key.clone())
                .map(|(count, key)| crate::consumer::Partitions { count, key }),
            carrier_api: self.carrier_url.clone().map(|url| CarrierApi {
                url,
                timeout: self.carrier_timeout,
                connect_timeout: self.carrier_connect_timeout,
                mode: self.effect_mode,
                key_ttl: self.effect_key_ttl,
                lease: self.effect_lease,
                lookup_url: self.lookup_url.clone(),
                lookup_quiet: self.lookup_quiet,
            }),
        }
    }
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    start::consume(&args.config(), &db, &broker, shutdown).await?;
    Ok(Outcome::Done)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Consume {
        #[command(flatten)]
        args: Args,
    }

    /// The flags' defaults are the operation's: `demo` and the bench, which start from `Config::default()`, run the
    /// consumer `consume` runs.
    #[test]
    fn the_flags_defaults_are_the_operations() {
        for (name, kind) in [
            ("carrier", Kind::Carrier),
            ("notification", Kind::Notification),
        ] {
            let parsed = Consume::try_parse_from(["consume", name]).expect("defaults parse");
            assert_eq!(parsed.args.config(), Config::of(kind));
        }
    }

    #[test]
    fn every_flag_reaches_the_config() {
        let parsed = Consume::try_parse_from([
            "consume",
            "notification",
            "--queue=q",
            "--exchange=e",
            "--queue-type=quorum",
            "--consumer-type=t",
            "--prefetch=7",
            "--concurrency=3",
            "--pool-size=4",
            "--max-attempts=9",
            "--retry-delay=1s",
            "--claim-timeout=2s",
            "--attempt-timeout=7s",
            "--exit-when-idle=3s",
            "--shutdown-timeout=4s",
            "--broker-timeout=5s",
            "--batch-size=8",
            "--batch-wait=6ms",
            "--poison-after=2",
            "--on-conflict=discard",
            "--metrics-addr=127.0.0.1:9",
            "--fail-destination=FAIL",
        ])
        .expect("flags parse");
        let expected = Config {
            consumer: Kind::Notification,
            queue: Some("q".into()),
            exchange: "e".into(),
            queue_type: QueueType::Quorum,
            consumer_type: Some("t".into()),
            prefetch: 7,
            concurrency: 3,
            pool_size: Some(4),
            max_attempts: 9,
            retry_delay: Duration::from_secs(1),
            claim_timeout: Duration::from_secs(2),
            attempt_timeout: Some(Duration::from_secs(7)),
            exit_when_idle: Some(Duration::from_secs(3)),
            shutdown_timeout: Duration::from_secs(4),
            broker_timeout: Duration::from_secs(5),
            batch_size: 8,
            batch_wait: Duration::from_millis(6),
            poison_after: 2,
            on_conflict: OnConflict::Discard,
            metrics_addr: Some("127.0.0.1:9".parse().expect("address")),
            fail_destination: Some("FAIL".into()),
            partitions: None,
            carrier_api: None,
        };
        assert_eq!(parsed.args.config(), expected);
    }

    #[test]
    fn the_carrier_flags_reach_the_config_and_need_a_url() {
        let parsed = Consume::try_parse_from([
            "consume",
            "carrier",
            "--carrier-url=http://127.0.0.1:8089",
            "--carrier-timeout=4s",
            "--carrier-connect-timeout=1s",
            "--effect-mode=after-commit",
            "--effect-key-ttl=2h",
            "--effect-lease=9s",
            "--lookup-url=http://127.0.0.1:8090",
        ])
        .expect("flags parse");
        let api = parsed.args.config().carrier_api.expect("an API");
        assert_eq!(api.url.as_str(), "http://127.0.0.1:8089/");
        assert_eq!(api.timeout, Duration::from_secs(4));
        assert_eq!(api.connect_timeout, Duration::from_secs(1));
        assert_eq!(api.mode, EffectMode::AfterCommit);
        assert_eq!(api.key_ttl, Duration::from_secs(7200));
        assert_eq!(api.lease, Duration::from_secs(9));
        assert_eq!(
            api.lookup_url.map(String::from).as_deref(),
            Some("http://127.0.0.1:8090/")
        );
        for refused in [
            &["consume", "carrier", "--effect-mode=at-most-once"][..],
            &["consume", "carrier", "--lookup-url=http://x"],
            &[
                "consume",
                "carrier",
                "--carrier-url=http://x",
                "--fail-destination=A",
            ],
        ] {
            assert!(Consume::try_parse_from(refused).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn partitions_take_a_key_and_exclude_concurrency_and_batches() {
        let parsed = Consume::try_parse_from([
            "consume",
            "carrier",
            "--partitions=8",
            "--partition-key=parcelId",
        ])
        .expect("flags parse");
        assert_eq!(
            parsed.args.config().partitions,
            Some(crate::consumer::Partitions {
                count: 8,
                key: "parcelId".into()
            })
        );
        for refused in [
            &["consume", "carrier", "--partitions=8"][..],
            &["consume", "carrier", "--partition-key=parcelId"],
            &["consume", "carrier", "--partitions=0", "--partition-key=p"],
            &[
                "consume",
                "carrier",
                "--partitions=8",
                "--partition-key=p",
                "--concurrency=4",
            ],
            &[
                "consume",
                "carrier",
                "--partitions=8",
                "--partition-key=p",
                "--batch-size=4",
            ],
        ] {
            assert!(Consume::try_parse_from(refused).is_err(), "{refused:?}");
        }
    }
}
