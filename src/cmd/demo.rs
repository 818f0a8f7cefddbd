//! `inboxctl demo`: migrate, publish parcels with duplicates, run both consumers until idle, count the effects.

use tokio_util::sync::CancellationToken;

use crate::cli::{GlobalOpts, parse_fraction};
use crate::demo::{self, Demo, DemoCarrier};
use crate::error::{Outcome, Result};
use crate::output;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Parcels to register (one ParcelCreatedEvent each)
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub parcels: u64,

    /// Fraction of the events delivered twice (the same message id again), 0 to 1
    #[arg(long, default_value_t = 0.2, value_parser = parse_fraction)]
    pub duplicates: f64,

    /// The carrier the carrier consumer books with: the stand-in that writes a row, or the stand-in carrier API on
    /// HTTP, started in this process on loopback and called keyed (the JSON line then adds the bookings it counted)
    #[arg(long, value_enum, default_value_t = DemoCarrier::StandIn)]
    pub carrier: DemoCarrier,
}

/// `--carrier stand-in|http`.
impl clap::ValueEnum for DemoCarrier {
    fn value_variants<'a>() -> &'a [Self] {
        &[DemoCarrier::StandIn, DemoCarrier::Http]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            DemoCarrier::StandIn => clap::builder::PossibleValue::new("stand-in")
                .help("Writes carrier_reservations in the consumer's transaction"),
            DemoCarrier::Http => clap::builder::PossibleValue::new("http")
                .help("Books over HTTP with an idempotency key, against a stand-in carrier API on loopback"),
        })
    }
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    let demo = Demo {
        parcels: args.parcels,
        duplicates: args.duplicates,
        carrier: args.carrier,
    };
    let tally = demo::run(&demo, &db, &broker, &shutdown).await?;
    output::json(&tally)?;
    if shutdown.is_cancelled() {
        return Ok(Outcome::Partial);
    }
    let gaps = tally.gaps();
    for gap in &gaps {
        tracing::warn!("the demo did not show one effect per parcel: {gap}");
    }
    Ok(if gaps.is_empty() {
        Outcome::Done
    } else {
        Outcome::Partial
    })
}
