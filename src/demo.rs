//! The whole story in one run: migrate, publish parcels with duplicates, run both Parcel Tracker consumers until
//! their queues are idle, and count what the database holds for this run's parcels.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::{self, Broker, topology};
use crate::carrier_stub;
use crate::consumer::{self, Config};
use crate::db::{self, Database, schema};
use crate::effects::CarrierApi;
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
    /// Which carrier the carrier consumer books with.
    pub carrier: DemoCarrier,
}

/// The carrier of a demo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DemoCarrier {
    /// The stand-in that writes a row in the consumer's transaction.
    #[default]
    StandIn,
    /// The stand-in carrier API on HTTP ([`crate::carrier_stub`]), started in this process on loopback and called
    /// keyed.
    Http,
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
    /// With the carrier on HTTP: the bookings the stand-in carrier counted for those parcels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub carrier_bookings: Option<u64>,
    pub seconds: f64,
    /// Copies this run published again (the same message id).
    #[serde(skip)]
    pub duplicates_published: u64,
}

impl Tally {
    /// Where the run did not show what it is for — one effect per parcel in each table (and one booking), each copy
    /// sent again discarded by both consumers — each said in a sentence; empty when it did. A copy delivered again
    /// by the broker is discarded once more, so more discards than copies is no gap.
    pub fn gaps(&self) -> Vec<String> {
        let parcels = i64::try_from(self.parcels).unwrap_or(i64::MAX);
        let mut gaps = Vec::new();
        for (what, count) in [
            ("carrier_reservations", self.carrier_reservations),
            ("notifications_sent", self.notifications_sent),
        ] {
            if count != parcels {
                gaps.push(format!("{what} holds {count} rows for {parcels} parcels"));
            }
        }
        if let Some(bookings) = self.carrier_bookings.filter(|b| *b != self.parcels) {
            gaps.push(format!(
                "the carrier counted {bookings} bookings for {parcels} parcels"
            ));
        }
        let expected = self.duplicates_published.saturating_mul(2);
        if u64::try_from(self.duplicates_discarded).unwrap_or(0) < expected {
            gaps.push(format!(
                "{} copies discarded where {} were sent again (each discarded by both consumers: {expected})",
                self.duplicates_discarded, self.duplicates_published
            ));
        }
        gaps
    }
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
        if let Some((_, readers @ 1..)) =
            topology::queue_depth(&connection, kind.default_queue()).await?
        {
            tracing::warn!(
                queue = kind.default_queue(),
                consumers = readers,
                "another process already consumes this queue: it may take some of this run's messages, and the \
                 demo's counts then fall short"
            );
        }
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

    let stub_stop = CancellationToken::new();
    let stub = match demo.carrier {
        DemoCarrier::StandIn => None,
        DemoCarrier::Http => Some(
            carrier_stub::serve(
                std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                carrier_stub::Behaviour::default(),
                stub_stop.clone(),
            )
            .await?,
        ),
    };
    let [mut carrier, notification] = Kind::ALL.map(|kind| Config {
        exit_when_idle: Some(IDLE),
        ..Config::of(kind)
    });
    if let Some(stub) = &stub {
        let url = url::Url::parse(&stub.url())
            .map_err(|e| crate::error::Error::Usage(format!("the stand-in's URL: {e}")))?;
        carrier.carrier_api = Some(CarrierApi::new(url));
    }
    let (carrier, notification) = tokio::join!(
        consumer::consume(&carrier, db, broker, shutdown.clone()),
        consumer::consume(&notification, db, broker, shutdown.clone()),
    );
    let bookings = stub.map(|stub| stub.bookings());
    stub_stop.cancel();
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
        carrier_bookings: bookings.map(|bookings| {
            let ours: std::collections::HashSet<Uuid> = parcel_ids.iter().copied().collect();
            bookings
                .iter()
                .filter(|b| ours.contains(&b.parcel_id))
                .count() as u64
        }),
        seconds: (started.elapsed().as_secs_f64() * 100.0).round() / 100.0,
        duplicates_published: published.duplicates,
    })
}
