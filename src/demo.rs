//! The whole story in one run: migrate, publish parcels with duplicates, run both Parcel Tracker consumers until
//! their queues are idle, and count what the database holds for this run's parcels.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::{self, Broker, topology};
use crate::consumer::{self, Config};
use crate::db::{self, Database, schema};
use crate::error::Result;
use crate::parcel::Kind;
use crate::producer::{self, Plan};

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Demo {
    /// Parcels to register (one `ParcelCreatedEvent` each).
    pub parcels: u64,
    /// Fraction of the events delivered twice, with the same message id.
    pub duplicates: f64,
}

/// The demo's verdict.
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

/// How long a consumer waits with nothing arriving and its queue empty before the demo calls it done.
const IDLE: Duration = Duration::from_secs(1);

pub async fn run(
    demo: &Demo,
    db: &Database,
    broker: &Broker,
    shutdown: &CancellationToken,
) -> Result<Tally> {
    let started = Instant::now();
    let report = schema::migrate(db, false).await?;
    if !report.migrations.is_empty() {
        tracing::info!(database = %report.database, applied = report.migrations.len(), "migrated");
    }

    let connection = broker.connect("inboxctl demo").await?;
    for kind in Kind::ALL {
        topology::ensure_endpoint(
            &connection,
            topology::PARCEL_CREATED_EXCHANGE,
            kind.default_queue(),
            topology::QueueType::Classic,
        )
        .await?;
    }
    let plan = Plan {
        duplicates: demo.duplicates,
        ..Plan::parcels(demo.parcels)
    };
    let published = producer::publish(
        &connection,
        broker,
        topology::PARCEL_CREATED_EXCHANGE,
        &plan,
        Duration::from_secs(30),
        shutdown,
    )
    .await?;
    amqp::close(&connection, "OK").await;
    tracing::info!(
        parcels = published.published,
        duplicates = published.duplicates,
        "published; consuming until both queues are idle"
    );

    let [carrier, notification] = Kind::ALL.map(|kind| Config {
        exit_when_idle: Some(IDLE),
        ..Config::of(kind)
    });
    let (carrier, notification) = tokio::join!(
        consumer::consume(&carrier, db, broker, shutdown.clone()),
        consumer::consume(&notification, db, broker, shutdown.clone()),
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
    Ok(Tally {
        parcels: published.published,
        carrier_reservations: db::effects::count_carrier_reservations_for(&mut conn, &parcel_ids)
            .await?,
        notifications_sent: db::effects::count_notifications_sent_for(&mut conn, &parcel_ids)
            .await?,
        duplicates_discarded: db::events::count_duplicates_for(&mut conn, &message_ids).await?,
        seconds: (started.elapsed().as_secs_f64() * 100.0).round() / 100.0,
    })
}
