//! `inboxctl carrier-stub`: the stand-in carrier API on HTTP (a testing aid), until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::carrier_stub::{self, Behaviour};
use crate::cli::{GlobalOpts, parse_duration};
use crate::error::{Outcome, Result};
use crate::output;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The address to listen on (port 0: one the system chooses); the first line printed is its URL
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Book again for a repeated Idempotency-Key, as a carrier that does not honour keys does
    #[arg(long)]
    pub ignore_keys: bool,

    /// Answer this late, after booking
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub delay: Duration,

    /// Only bookings to this destination are answered late
    #[arg(long, value_name = "DESTINATION")]
    pub delay_destination: Option<String>,

    /// Answer 503 to this many requests, booking nothing
    #[arg(long, default_value_t = 0)]
    pub fail_next: u32,

    /// Answer 503 to every request
    #[arg(long)]
    pub fail_always: bool,

    /// Book, then drop the connection without answering, for this many requests
    #[arg(long, default_value_t = 0)]
    pub drop_next: u32,
}

impl Args {
    pub fn behaviour(&self) -> Behaviour {
        Behaviour {
            honour_keys: !self.ignore_keys,
            delay_ms: u64::try_from(self.delay.as_millis()).unwrap_or(u64::MAX),
            delay_destination: self.delay_destination.clone(),
            fail_next: self.fail_next,
            fail_always: self.fail_always,
            // Another status than 503: through `POST /_stub/behaviour` (the tests' way), not a flag.
            fail_status: None,
            drop_next: self.drop_next,
            // Through `POST /_stub/behaviour` too.
            redirect_next: 0,
            book_late_next: 0,
            book_late_ms: 0,
            padded_next: 0,
            proxy_reset_next: 0,
            lookup_unrouted_next: 0,
        }
    }
}

pub async fn run(args: Args, _global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    if !args.listen.ip().is_loopback() {
        tracing::warn!(
            listen = %args.listen,
            "the stand-in carrier is a testing aid with no authentication; anyone who reaches it can book and change \
             its behaviour"
        );
    }
    let serving = carrier_stub::serve(args.listen, args.behaviour(), shutdown.clone()).await?;
    output::line(&serving.url())?;
    tracing::info!(bound = %serving.addr, "stand-in carrier listening");
    shutdown.cancelled().await;
    Ok(Outcome::Done)
}
