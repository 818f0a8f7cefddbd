//! `inboxctl stats`: the figures of `top`, once, as a table or JSON.

use std::time::Duration;

use crate::cli::{GlobalOpts, parse_window};
use crate::db::Database;
use crate::error::{Outcome, Result};
use crate::stats::{self, Json, Snapshot, display};
use crate::{output, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rates are averages over this last stretch of time (from 1s to 100y)
    #[arg(long, default_value = "1m", value_parser = parse_window)]
    pub window: Duration,

    /// Print JSON (the shape is documented in the README and stable)
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    let db = Database::from_opts(&global.connect)?;
    let broker = super::broker(&global.connect)?;
    let pool = db.pool(2).await?;
    let connection = match broker.connect("inboxctl stats").await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(
                "{}; queue figures unknown",
                crate::redact::text(&e.to_string())
            );
            None
        }
    };
    let snapshot =
        stats::collect(&pool, connection.as_ref(), stats::Range::rates(args.window)).await?;
    if let Some(c) = connection {
        crate::amqp::close(&c, "OK").await;
    }
    if args.json {
        output::json(&Json::from(&snapshot))?;
    } else {
        print(&snapshot)?;
    }
    Ok(if snapshot.broker_error.is_some() {
        Outcome::Partial
    } else {
        Outcome::Done
    })
}

fn print(s: &Snapshot) -> Result<()> {
    let window = humantime::format_duration(s.window).to_string();
    let json = Json::from(s);
    let mut t = table::new(&[
        "consumer_type",
        "rows",
        "unprocessed",
        "oldest",
        "deliveries/s",
        "duplicates/s",
        "dup ratio",
        "conflicts",
        "processed/s",
        "queue",
        "ready",
        "consumers",
        "errors",
    ]);
    table::align_left(&mut t, 9);
    for c in &json.consumers {
        t.add_row(vec![
            table::text(&c.consumer_type),
            display::count(c.rows, c.rows_estimated).into(),
            display::count(c.unprocessed, c.unprocessed_estimated).into(),
            display::age(c.oldest_unprocessed_seconds).into(),
            display::rate(c.deliveries_per_second).into(),
            display::rate(c.duplicates_per_second).into(),
            display::percent(c.duplicate_ratio).into(),
            display::count(c.conflicts, false).into(),
            display::rate(c.processed_per_second).into(),
            table::text(c.queue.name.as_deref().unwrap_or(display::UNKNOWN)),
            display::count(c.queue.ready.map(u64::from), false).into(),
            display::count(c.queue.consumers.map(u64::from), false).into(),
            display::count(c.error_queue.ready.map(u64::from), false).into(),
        ]);
    }
    output::line(&t.to_string())?;
    let mut footer = format!(
        "rates over the last {window}; ~ estimated from PostgreSQL's statistics; ? unknown"
    );
    if let Some(e) = &s.broker_error {
        footer.push_str(&format!("; RabbitMQ: {}", crate::sanitize::text(e)));
    }
    output::line(&footer)
}
