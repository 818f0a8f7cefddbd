//! `inboxctl demo`: migrate, publish parcels with duplicates, run both consumers until idle, count the effects.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::topology;
use crate::cli::GlobalOpts;
use crate::cmd::consume::{self, Kind};
use crate::cmd::publish::parse_fraction;
use crate::db::{self, schema};
use crate::error::{Outcome, Result};
use crate::output;
use crate::producer::{self, Plan};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Parcels to register (one ParcelCreatedEvent each)
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub parcels: u64,

    /// Fraction of the events delivered twice (the same message id again), 0 to 1
    #[arg(long, default_value_t = 0.2, value_parser = parse_fraction)]
    pub duplicates: f64,
}

/// The demo's last line.
#[derive(Debug, serde::Serialize)]
pub struct Tally {
    /// Parcels this run published.
    pub parcels: u64,
    /// Rows in carrier_reservations for those parcels.
    pub carrier_reservations: i64,
    /// Rows in notifications_sent for those parcels.
    pub notifications_sent: i64,
    /// Copies the two consumers recognised and discarded (each consumer discards each duplicate copy once).
    pub duplicates_discarded: i64,
    pub seconds: f64,
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let started = Instant::now();
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;

    let report = schema::migrate(&db, false).await?;
    if !report.migrations.is_empty() {
        tracing::info!(database = %report.database, applied = report.migrations.len(), "migrated");
    }

    let connection = broker.connect("inboxctl demo").await?;
    for kind in [Kind::Carrier, Kind::Notification] {
        topology::ensure_endpoint(
            &connection,
            topology::PARCEL_CREATED_EXCHANGE,
            kind.default_queue(),
        )
        .await?;
    }
    let plan = Plan {
        count: args.parcels,
        duplicates: args.duplicates,
        rate: None,
        destination: None,
    };
    let published = producer::publish(
        &connection,
        &broker,
        topology::PARCEL_CREATED_EXCHANGE,
        &plan,
        Duration::from_secs(30),
        &shutdown,
    )
    .await?;
    crate::amqp::close(&connection, "OK").await;
    tracing::info!(
        parcels = published.published,
        duplicates = published.duplicates,
        "published; consuming until both queues are idle"
    );

    let consumers = [Kind::Carrier, Kind::Notification].map(|kind| {
        let mut args = consume::Args::defaults(kind);
        args.exit_when_idle = Some(Duration::from_secs(1));
        args
    });
    let (carrier, notification) = tokio::join!(
        consume::run_consumer(&consumers[0], &db, &broker, shutdown.clone()),
        consume::run_consumer(&consumers[1], &db, &broker, shutdown.clone()),
    );
    let (carrier, notification) = (carrier?, notification?);
    tracing::info!(
        processed = carrier.processed + notification.processed,
        duplicates = carrier.duplicates + notification.duplicates,
        "both consumers idle"
    );

    let parcel_ids: Vec<Uuid> = published
        .messages
        .iter()
        .map(|m| m.event.parcel_id)
        .collect();
    let message_ids: Vec<Uuid> = published.messages.iter().map(|m| m.message_id).collect();
    let mut conn = db.connect().await?;
    let tally = Tally {
        parcels: published.published,
        carrier_reservations: db::effects::count_carrier_reservations_for(&mut conn, &parcel_ids)
            .await?,
        notifications_sent: db::effects::count_notifications_sent_for(&mut conn, &parcel_ids)
            .await?,
        duplicates_discarded: db::events::count_duplicates_for(&mut conn, &message_ids).await?,
        seconds: (started.elapsed().as_secs_f64() * 100.0).round() / 100.0,
    };
    output::json(&tally)?;
    if shutdown.is_cancelled() {
        return Ok(Outcome::Partial);
    }
    Ok(Outcome::Done)
}
