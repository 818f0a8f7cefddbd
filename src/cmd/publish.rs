//! `inboxctl publish parcel-created`: the Parcel Tracker's producer, as MassTransit 8 would publish.

use crate::amqp::topology;
use crate::cli::{GlobalOpts, MAX_COUNT, parse_fraction, parse_rate};
use crate::error::{Error, Outcome, Result};
use crate::ids::IdKind;
use crate::producer::{self, ParcelField, Plan};
use crate::{output, sanitize};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub event: Event,
}

#[derive(Debug, clap::Subcommand)]
pub enum Event {
    /// ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel
    ParcelCreated(ParcelCreated),
}

#[derive(Debug, clap::Args)]
pub struct ParcelCreated {
    /// How many parcels, at most 1000000 (each is held until the broker confirmed it)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=MAX_COUNT))]
    pub count: u64,

    /// Fraction of them published twice with the same message id (half at once, half after the rest), 0 to 1
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub duplicates: f64,

    /// Messages per second, copies included, from 0.001 to 1000000 (default: as fast as the broker confirms)
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,

    /// Every parcel's destination (default: a rotation of cities)
    #[arg(long)]
    pub destination: Option<String>,

    /// The kind of message ids: MassTransit's NewId (what a MassTransit publisher sends), UUIDv7 (time first) or
    /// random v4
    #[arg(long, value_enum, default_value_t = IdKind::NewId)]
    pub id_kind: IdKind,

    /// Events per parcel, published one after another, each with its own message id (what a partitioned consumer
    /// keeps in order); --count counts parcels
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub events_per_parcel: u32,

    /// Set each message's routing key to this field of the event (what a consistent-hash exchange spreads on, see
    /// consume --partitions); default: no routing key, as MassTransit publishes
    #[arg(long, value_enum, value_name = "FIELD")]
    pub partition_key: Option<ParcelField>,

    /// The exchange to publish to
    #[arg(long, default_value = topology::PARCEL_CREATED_EXCHANGE)]
    pub exchange: String,

    /// After a lost connection, how long to keep connecting again to send the unconfirmed rest (0: fail at once)
    #[arg(long, default_value = "60s", value_parser = crate::cli::parse_duration)]
    pub reconnect_timeout: std::time::Duration,

    /// How long any call to RabbitMQ may wait for its answer (a publish or its confirm); past it the connection is
    /// given up and made again as after a loss, and what was not confirmed is sent again. On a connection the broker
    /// blocks (a memory or disk alarm) it stops instead, saying how many copies were confirmed
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_positive_duration)]
    pub broker_timeout: std::time::Duration,

    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// `--partition-key parcelId|trackingNumber|destination`.
impl clap::ValueEnum for ParcelField {
    fn value_variants<'a>() -> &'a [Self] {
        &ParcelField::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

pub async fn run(
    args: Args,
    global: &GlobalOpts,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<Outcome> {
    let Event::ParcelCreated(args) = args.event;
    crate::amqp::validate_name("--exchange", &args.exchange)?;
    if let Some(d) = &args.destination
        && d.chars().any(char::is_control)
    {
        return Err(Error::Usage(
            "--destination must not contain control characters".to_owned(),
        ));
    }
    // The routing key is an AMQP short string: a destination longer than 255 bytes cannot be one.
    if let (Some(crate::producer::ParcelField::Destination), Some(d)) =
        (args.partition_key, &args.destination)
        && d.len() > 255
    {
        return Err(Error::Usage(format!(
            "--destination is {} bytes long; with --partition-key destination it is the routing key, which AMQP \
             allows at most 255",
            d.len()
        )));
    }
    if args.count.saturating_mul(u64::from(args.events_per_parcel)) > MAX_COUNT {
        return Err(Error::Usage(format!(
            "--count {} × --events-per-parcel {} is more than {MAX_COUNT} messages (each is held until the broker \
             confirmed it)",
            args.count, args.events_per_parcel
        )));
    }
    let broker = global.connect.broker()?;
    let connection = broker.connect("inboxctl publish").await?;
    let ensure = topology::ensure_event_exchange(&connection, &args.exchange);
    crate::amqp::answered("the exchange's declaration", args.broker_timeout, ensure).await??;
    let plan = Plan {
        count: args.count,
        duplicates: args.duplicates,
        rate: args.rate,
        destination: args.destination,
        ids: args.id_kind,
        events_per_parcel: args.events_per_parcel,
        routing_key: args.partition_key,
        broker_timeout: args.broker_timeout,
    };
    let bar = super::progress::counter(!args.json, "copies confirmed");
    let report = producer::publish_showing(
        &connection,
        &broker,
        &args.exchange,
        &plan,
        args.reconnect_timeout,
        &shutdown,
        |done, of| {
            bar.set_length(of);
            bar.set_position(done);
        },
    )
    .await;
    bar.finish_and_clear();
    let report = report?;
    crate::amqp::close(&connection, "OK").await;

    if args.json {
        output::json(&report)?;
    } else {
        let mut line = format!(
            "published {} parcel-created events ({} copies again with the same message id) to exchange {} on vhost {}",
            report.published,
            report.duplicates,
            sanitize::text(&report.exchange),
            sanitize::text(broker.vhost())
        );
        if report.interrupted {
            line.push_str(&format!(
                "; interrupted: these are the copies the broker confirmed, {} of the {} planned",
                report.published + report.duplicates,
                report.planned
            ));
        }
        if report.reconnects > 0 {
            line.push_str(&format!(
                "; the connection was lost {} times and made again, {} unconfirmed copies sent again",
                report.reconnects, report.resent
            ));
        }
        if report.unroutable > 0 {
            line.push_str(&format!(
                "; {} of them reached no queue (none bound to the exchange) and were dropped",
                report.unroutable
            ));
        }
        output::line(&line)?;
    }
    if report.interrupted {
        return Ok(Outcome::Partial);
    }
    if report.unroutable > 0 {
        tracing::warn!(
            unroutable = report.unroutable,
            "no queue is bound to the exchange, so these messages were dropped; start a consumer once to create its queue"
        );
        return Ok(Outcome::Partial);
    }
    Ok(Outcome::Done)
}

/// `--id-kind newid|v7|v4`.
impl clap::ValueEnum for IdKind {
    fn value_variants<'a>() -> &'a [Self] {
        &[IdKind::NewId, IdKind::V7, IdKind::V4]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            IdKind::NewId => clap::builder::PossibleValue::new("newid"),
            IdKind::V7 => clap::builder::PossibleValue::new("v7"),
            IdKind::V4 => clap::builder::PossibleValue::new("v4"),
        })
    }
}
