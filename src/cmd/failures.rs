//! `inboxctl failures --from <queue>`: a dead-letter queue's messages grouped by the cause of their failure.

use std::path::PathBuf;

use crate::cli::GlobalOpts;
use crate::error::{Outcome, Result};
use crate::triage::{self, Listing};
use crate::{amqp, output, sanitize, table};

/// What is said under every listing: looking is not free.
pub const REDELIVERED_NOTE: &str =
    "looked at without taking anything; the broker now marks the messages looked at redelivered";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue
    #[arg(long)]
    pub from: String,

    /// Look at no more than this many messages (the oldest)
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub limit: u64,

    /// Write the listing, with every member's message id, to this file: `replay --group <fingerprint> --listing
    /// <file>` replays exactly those members
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails,
    /// saying so, and what it held goes back
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_positive_duration)]
    pub broker_timeout: std::time::Duration,

    /// Print the listing as JSON (without the member ids; --output has them)
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    amqp::validate_name("--from", &args.from)?;
    let broker = global.connect.broker()?;
    let connection = broker.connect("inboxctl failures").await?;
    let listing = triage::failures::list(
        &connection,
        &args.from,
        broker.vhost(),
        args.limit,
        args.broker_timeout,
    )
    .await;
    amqp::close(&connection, "OK").await;
    let listing = listing?;
    if let Some(most) = listing.most_deliveries {
        tracing::warn!(queue = %sanitize::text(&listing.queue), "{}", amqp::peek::worn(most));
    }
    if let Some(path) = &args.output {
        listing.write(path)?;
    }
    if args.json {
        output::json(&listing.without_ids())?;
    } else {
        print(&listing)?;
        if let Some(path) = &args.output {
            output::line(&format!(
                "listing written to {} (replay a group with: inboxctl replay --from {} --group <fingerprint> \
                 --listing {})",
                path.display(),
                sanitize::text(&listing.queue),
                path.display()
            ))?;
        }
    }
    // What a running replay holds is in no group: the listing is not the queue's whole story.
    Ok(if listing.replay_running || listing.looked_at_elsewhere {
        Outcome::Partial
    } else {
        Outcome::Done
    })
}

/// The groups as a table, then a line saying what was looked at.
pub fn print(listing: &Listing) -> Result<()> {
    if !listing.groups.is_empty() {
        output::line(&groups_table(listing).to_string())?;
    }
    let mut summary = format!(
        "{}: {} messages in {} groups",
        sanitize::text(&listing.queue),
        listing.looked,
        listing.groups.len()
    );
    if listing.looked < listing.depth {
        summary.push_str(&format!(
            " (the oldest {} of {}: raise --limit to see all)",
            listing.looked, listing.depth
        ));
    }
    if listing.replay_running {
        summary.push_str(
            "; a replay of it was running: the messages it holds were not seen, and are in no group",
        );
    }
    if listing.looked_at_elsewhere {
        summary.push_str(
            "; another look at it held messages meanwhile: those it held may be in no group (list again when it has \
             ended)",
        );
    }
    output::line(&format!("{summary}; {REDELIVERED_NOTE}"))
}

/// The groups of a listing, the largest first.
pub fn groups_table(listing: &Listing) -> comfy_table::Table {
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or_else(
            || "-".to_owned(),
            |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        )
    };
    let mut t = table::new(&[
        "fingerprint",
        "count",
        "exception type",
        "reason (masked)",
        "first failed",
        "last failed",
        "origin",
    ]);
    for column in [2, 3, 6] {
        table::align_left(&mut t, column);
    }
    for g in &listing.groups {
        t.add_row(vec![
            table::text(&g.cause.fingerprint),
            g.count.into(),
            table::text(&g.cause.exception_type),
            table::text(&g.cause.reason),
            time(g.first_failed_at).into(),
            time(g.last_failed_at).into(),
            table::text(&g.origins.join(", ")),
        ]);
    }
    t
}
