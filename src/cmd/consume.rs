//! `inboxctl consume <carrier|notification>`: one Parcel Tracker consumer in the foreground until SIGINT/SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, Broker, topology};
use crate::cli::{GlobalOpts, parse_duration, parse_positive_duration};
use crate::consumer::{self, ConsumerOptions, OnConflict, RunCounts, RunSummary};
use crate::db::{Database, schema};
use crate::error::{Error, Outcome, Result};
use crate::inbox::{ConsumerType, Inbox};
use crate::metrics;
use crate::parcel::{
    CARRIER_QUEUE, CarrierConsumer, NOTIFICATION_QUEUE, NotificationConsumer, StandInCarrier,
    StandInSms,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Reserves a pickup slot with the carrier for each new parcel (queue parcel-created-carrier)
    Carrier,
    /// Sends an SMS for each new parcel (queue parcel-created-notification)
    Notification,
}

impl Kind {
    pub fn default_queue(self) -> &'static str {
        match self {
            Kind::Carrier => CARRIER_QUEUE,
            Kind::Notification => NOTIFICATION_QUEUE,
        }
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

    /// The deduplication scope written to inbox_messages.consumer_type (default: the queue name, as the .NET
    /// tutorial does, so inboxctl can take over a queue from a .NET consumer without reprocessing)
    #[arg(long)]
    pub consumer_type: Option<String>,

    /// Deliveries the broker may send ahead of acknowledgements
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,

    /// Messages processed at once
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub concurrency: u16,

    /// Most PostgreSQL connections (default: --concurrency)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub pool_size: Option<u32>,

    /// Attempts of a message whose processing fails, before it moves to <queue>_error
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_attempts: u32,

    /// Delay before the second attempt; doubles for each further one, up to 30s
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub retry_delay: Duration,

    /// How long a copy waits for another process's in-flight attempt at the same message before it backs off
    /// (from 100ms to 24 days)
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_lock_timeout)]
    pub claim_timeout: Duration,

    /// End once nothing arrived and nothing was in flight for this long and the queue is empty (scripts, tests)
    #[arg(long, value_parser = parse_positive_duration)]
    pub exit_when_idle: Option<Duration>,

    /// After SIGINT/SIGTERM, how long in-flight messages may take; past it they are rolled back and redelivered
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// Up to this many deliveries share one transaction, each in a savepoint of its own (1: one transaction per
    /// message). At most 64
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub batch_size: u16,

    /// How long a batch waits to fill, only while another batch is running (a lone message never waits)
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub batch_wait: Duration,

    /// A redelivered message that started this many times without an outcome, each start ending the consumer process
    /// (an abort, a crash, a kill), goes to <queue>_error at its next delivery
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub poison_after: u32,

    /// What to do with a message whose id was processed before for another event (a producer reusing ids): it is
    /// never processed, and always counted and logged as a conflict; dead-letter moves it to <queue>_error for a look,
    /// discard drops it like a duplicate
    #[arg(long, value_enum, default_value_t = OnConflict::DeadLetter)]
    pub on_conflict: OnConflict,

    /// Serve Prometheus metrics on /metrics and a health check on /health at this address (e.g. 127.0.0.1:9464)
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Make the stand-in carrier (or SMS gateway) fail every call for parcels to this destination, like an API that
    /// is down: shows retries and the error queue
    #[arg(long, value_name = "DESTINATION")]
    pub fail_destination: Option<String>,
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
    /// The arguments `consume <kind>` would have with every default.
    pub fn defaults(consumer: Kind) -> Self {
        Self {
            consumer,
            queue: None,
            exchange: topology::PARCEL_CREATED_EXCHANGE.to_owned(),
            consumer_type: None,
            prefetch: 64,
            concurrency: 16,
            pool_size: None,
            max_attempts: 5,
            retry_delay: Duration::from_millis(200),
            claim_timeout: Duration::from_secs(30),
            exit_when_idle: None,
            shutdown_timeout: Duration::from_secs(30),
            batch_size: 1,
            batch_wait: Duration::from_millis(5),
            poison_after: 3,
            on_conflict: OnConflict::DeadLetter,
            metrics_addr: None,
            fail_destination: None,
        }
    }

    pub fn queue(&self) -> &str {
        self.queue
            .as_deref()
            .unwrap_or(self.consumer.default_queue())
    }
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    run_consumer(&args, &db, &broker, shutdown).await?;
    Ok(Outcome::Done)
}

/// Validates `args`, checks the schema, and runs the consumer until it stops.
pub async fn run_consumer(
    args: &Args,
    db: &Database,
    broker: &Broker,
    shutdown: CancellationToken,
) -> Result<RunSummary> {
    let (queue, consumer_type) = names(args)?;

    let pool_size = args.pool_size.unwrap_or(u32::from(args.concurrency));
    let pool = db
        .with_lock_timeout(args.claim_timeout)
        .pool(pool_size)
        .await?;
    check_schema(&pool, db).await?;
    check_privileges(&pool, db, args.consumer).await?;

    let counts = Arc::new(RunCounts::default());
    let mut inbox = Inbox::new(pool.clone(), consumer_type.clone());
    let mut timings = None;
    if let Some(addr) = args.metrics_addr {
        let (registry, fed) = metrics::consume::registry(&consumer_type, Arc::clone(&counts));
        let health = metrics::consume::ConsumerHealth {
            pool: pool.clone(),
            counts: Arc::clone(&counts),
        };
        metrics::serve(addr, registry, Arc::new(health), shutdown.clone()).await?;
        inbox = inbox.with_claim_observer(Arc::new(fed.clone()));
        timings = Some(fed);
    }
    let options = ConsumerOptions {
        queue,
        event_exchange: args.exchange.clone(),
        prefetch: args.prefetch,
        concurrency: usize::from(args.concurrency),
        max_attempts: args.max_attempts,
        retry_delay: args.retry_delay,
        exit_when_idle: args.exit_when_idle,
        shutdown_timeout: args.shutdown_timeout,
        counts,
        batch_size: usize::from(args.batch_size),
        batch_wait: args.batch_wait,
        poison_after: args.poison_after,
        on_conflict: args.on_conflict,
        timings,
    };
    let fail_destination = args.fail_destination.clone();
    let summary = match args.consumer {
        Kind::Carrier => {
            let carrier = StandInCarrier { fail_destination };
            consumer::run(
                inbox,
                CarrierConsumer { carrier },
                broker,
                options,
                shutdown,
            )
            .await
        }
        Kind::Notification => {
            let gateway = StandInSms { fail_destination };
            consumer::run(
                inbox,
                NotificationConsumer { gateway },
                broker,
                options,
                shutdown,
            )
            .await
        }
    };
    close_pool(pool).await;
    summary
}

/// The queue to consume and the consumer_type to claim under, checked: the queue and its dead-letter queues must be
/// valid AMQP names.
fn names(args: &Args) -> Result<(String, ConsumerType)> {
    let queue = args.queue().to_owned();
    amqp::validate_name("--queue", &queue)?;
    // The dead-letter queues' names are the queue's with a suffix: they must be valid too, or the first message to
    // move aside would find no name to go to.
    let longest = topology::skipped_queue(&queue);
    if longest.len() > 255 {
        let suffix = longest.len() - queue.len();
        return Err(Error::Usage(format!(
            "--queue is {} bytes long; the name of its dead-letter queue <queue>_skipped would be {} bytes, past \
             AMQP's 255: at most {} bytes",
            queue.len(),
            longest.len(),
            255 - suffix
        )));
    }
    let consumer_type =
        ConsumerType::new(args.consumer_type.clone().unwrap_or_else(|| queue.clone()))
            .map_err(|e| Error::Usage(format!("--consumer-type: {e}")))?;
    Ok((queue, consumer_type))
}

/// Closes the pool, waiting a bounded time.
async fn close_pool(pool: PgPool) {
    // Bounded: a connection abandoned mid-statement at the shutdown timeout (work stuck on a lock) is never given
    // back, and the pool would wait for it for ever. The server rolls it back when the process is gone.
    if tokio::time::timeout(Duration::from_secs(2), pool.close())
        .await
        .is_err()
    {
        tracing::debug!(
            "PostgreSQL connections still busy after the stop; left to the server to roll back"
        );
    }
}

/// Refuses to start on a database `migrate` has not prepared, or whose `inbox_messages` inboxctl cannot use.
async fn check_schema(pool: &PgPool, db: &Database) -> Result<()> {
    let mut conn = pool.acquire().await.map_err(|e| db.unavailable(e))?;
    for table in [
        "inbox_messages",
        "inboxctl_events",
        "inboxctl_consumers",
        "inboxctl_fingerprints",
    ] {
        if !schema::table_exists(&mut conn, table).await? {
            return Err(Error::SchemaMissing {
                database: db.name(),
            });
        }
    }
    let differences = schema::inbox_differences(&mut conn).await?;
    if !differences.is_empty() {
        return Err(Error::SchemaIncompatible {
            database: db.name(),
            differences,
        });
    }
    Ok(())
}

impl Kind {
    /// The table its stand-in effect writes.
    fn effect_table(self) -> &'static str {
        match self {
            Kind::Carrier => "carrier_reservations",
            Kind::Notification => "notifications_sent",
        }
    }
}

/// Refuses to start when the role lacks a privilege the claim or the effect needs (the README's security section),
/// naming each: otherwise every delivery would be held with the same error. A missing privilege on
/// `inboxctl_attempts` turns off only the poison-message guard: said, not refused.
async fn check_privileges(pool: &PgPool, db: &Database, kind: Kind) -> Result<()> {
    let needs: [(&str, &str); 6] = [
        ("inbox_messages", "SELECT,INSERT,DELETE"),
        ("inboxctl_fingerprints", "SELECT,INSERT,UPDATE,DELETE"),
        (kind.effect_table(), "INSERT"),
        ("inboxctl_events", "INSERT"),
        ("inboxctl_consumers", "SELECT,INSERT,UPDATE"),
        ("inboxctl_attempts", "SELECT,INSERT,UPDATE,DELETE"),
    ];
    let missing = crate::db::grants::missing_privileges(pool, &needs)
        .await
        .map_err(|e| match crate::db::is_transient(&e) {
            true => db.unavailable(e),
            false => Error::Database(e),
        })?;
    let (attempts, required): (Vec<_>, Vec<_>) = missing
        .into_iter()
        .partition(|m| m.table == "inboxctl_attempts");
    if let Some(crate::db::grants::Missing { privileges, .. }) = attempts.first() {
        tracing::warn!(
            missing = %privileges,
            "the role lacks privileges on inboxctl_attempts: poison-message detection is off (a message that ends \
             the process every time will keep coming back)"
        );
    }
    if required.is_empty() {
        return Ok(());
    }
    Err(Error::PermissionMissing {
        role: db.options().get_username().to_owned(),
        command: "consume",
        missing: required
            .into_iter()
            .map(|m| format!("{} on {}", m.privileges, m.table))
            .collect(),
    })
}
