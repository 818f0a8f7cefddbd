//! `inboxctl demo`: migrate, publish parcels with duplicates, run both consumers until idle, count the effects.

use tokio_util::sync::CancellationToken;

use crate::cli::{GlobalOpts, parse_fraction};
use crate::demo::{self, Demo};
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
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    let demo = Demo {
        parcels: args.parcels,
        duplicates: args.duplicates,
    };
    let tally = demo::run(&demo, &db, &broker, &shutdown).await?;
    output::json(&tally)?;
    if shutdown.is_cancelled() {
        return Ok(Outcome::Partial);
    }
    Ok(Outcome::Done)
}
