//! `inboxctl stats`: the figures of `top`, once, as a table or JSON.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::cli::{GlobalOpts, parse_window};
use crate::error::{Outcome, Result};
use crate::stats::{self, Counts, QueueDepth, Snapshot, display, per_second};
use crate::{output, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rates are averages over this last stretch of time (from 1s to 100y)
    #[arg(long, default_value = "1m", value_parser = parse_window)]
    pub window: Duration,

    /// The cleanup's retention: an error queue's oldest message nearing it is flagged (its replay needs its inbox row)
    #[arg(long, default_value = "7d", value_parser = crate::cli::parse_positive_duration)]
    pub retention: Duration,

    /// Print JSON (the shape is documented in docs/commands.md and stable)
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    if args.window > args.retention {
        // The cleanup deletes the events older than its retention: rates over a longer window count what is left.
        tracing::warn!(
            "--window {} is longer than the retention {}: where the cleanup runs with it, the events before it are \
             gone and the rates read low (give --retention the cleanup's own)",
            humantime::format_duration(args.window),
            humantime::format_duration(args.retention)
        );
    }
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    let pool = db.pool(2).await?;
    stats::check_schema(&pool, &db).await?;
    let (connection, unreachable) = match broker.connect("inboxctl stats").await {
        Ok(c) => (Some(c), None),
        Err(e) => {
            let why = crate::redact::text(&e.to_string());
            tracing::warn!("{why}; queue figures unknown");
            (None, Some(why))
        }
    };
    let range = stats::Range {
        retention: args.retention,
        ..stats::Range::rates(args.window)
    };
    let mut snapshot =
        stats::collect_in(&pool, connection.as_ref(), Some(broker.vhost()), range).await?;
    if let Some(why) = unreachable {
        snapshot.broker_error = Some(stats::unreachable(&why));
    }
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
        "oldest error",
        "calls owed",
        "in doubt",
    ]);
    table::align_left(&mut t, 9);
    for c in &json.consumers {
        t.add_row(vec![
            table::text(&c.consumer_type),
            display::count_of(c.rows, c.rows_estimated, c.rows_at_least).into(),
            display::count_of(
                c.unprocessed,
                c.unprocessed_estimated,
                c.unprocessed_at_least,
            )
            .into(),
            display::age(c.oldest_unprocessed_seconds).into(),
            display::rate_of(c.deliveries_per_second, c.rates_estimated).into(),
            display::rate_of(c.duplicates_per_second, c.rates_estimated).into(),
            display::percent_of(c.duplicate_ratio, c.rates_estimated).into(),
            display::count(c.conflicts, c.rates_estimated).into(),
            display::rate_of(c.processed_per_second, c.rates_estimated).into(),
            table::text(&c.queue.name.as_deref().map_or_else(
                || display::UNKNOWN.to_owned(),
                |name| match &c.other_vhost {
                    Some(vhost) => format!(
                        "{} (in vhost {vhost})",
                        stats::queue_label(name, c.queue.partitions)
                    ),
                    None => stats::queue_label(name, c.queue.partitions),
                },
            )),
            display::count(c.queue.ready.map(u64::from), false).into(),
            display::count(c.queue.consumers.map(u64::from), false).into(),
            display::count(c.error_queue.ready.map(u64::from), false).into(),
            match c.dead_letter_window {
                Some(stats::Window::Past) => {
                    format!("{} PAST", display::age(c.oldest_dead_letter_seconds))
                }
                Some(stats::Window::Near) => {
                    format!("{} near", display::age(c.oldest_dead_letter_seconds))
                }
                _ => display::age(c.oldest_dead_letter_seconds),
            }
            .into(),
            effect_cell(c.effects_pending, c.oldest_effect_pending_seconds, ""),
            effect_cell(
                c.effects_in_doubt,
                c.oldest_effect_in_doubt_seconds,
                " IN DOUBT",
            ),
        ]);
    }
    output::line(&t.to_string())?;
    let mut footer = format!(
        "rates over the last {window}; ~ estimated from PostgreSQL's statistics; ≥ at least (counted that far, no \
         estimate beyond it yet); ? unknown; oldest error: when the \
         error queue's oldest message failed, against the retention {} (near: past {:.0} % of it; PAST: its inbox row \
         may be gone, so its replay may be processed again)",
        humantime::format_duration(s.retention),
        stats::NEAR_WINDOW * 100.0
    );
    if let Some(e) = &s.broker_error {
        footer.push_str(&format!("; RabbitMQ: {}", crate::sanitize::text(e)));
    }
    output::line(&footer)
}

/// A count of calls outside the database and the age of the oldest (`-` where nothing says), marked when non-zero;
/// `≥` when it is a floor (its count stopped at [`stats::EFFECTS_AT_MOST`]).
fn effect_cell(count: Option<u64>, oldest: Option<f64>, mark: &str) -> comfy_table::Cell {
    match count {
        Some(n) if n > 0 => {
            let floor = if n >= stats::EFFECTS_AT_MOST {
                "≥"
            } else {
                ""
            };
            format!("{floor}{n} ({}){mark}", display::age(oldest)).into()
        }
        other => display::count(other, false).into(),
    }
}

/// The documented JSON of `stats --json`.
#[derive(Debug, Serialize)]
pub struct Json {
    pub taken_at: DateTime<Utc>,
    pub window_seconds: f64,
    pub retention_seconds: f64,
    pub broker_error: Option<String>,
    pub consumers: Vec<ConsumerJson>,
}

#[derive(Debug, Serialize)]
pub struct ConsumerJson {
    pub consumer_type: String,
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    /// `rows` is a floor: counted up to the cap, no larger estimate in PostgreSQL's statistics.
    pub rows_at_least: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    pub unprocessed_at_least: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    pub deliveries_per_second: Option<f64>,
    pub duplicates_per_second: Option<f64>,
    pub duplicate_ratio: Option<f64>,
    pub processed_per_second: Option<f64>,
    pub failed_per_second: Option<f64>,
    /// The rates, the ratio and the conflicts are in part estimated: more rows in the window than one `stats` reads
    /// (the newest 1,000,000 processed rows and as many events), the rest at the rate of those.
    pub rates_estimated: bool,
    /// Messages whose id had been processed before for another event, in the window: a producer reusing ids.
    pub conflicts: Option<u64>,
    pub queue: QueueJson,
    pub error_queue: QueueJson,
    /// The vhost its consumer reads its queue in, when it is not the one `stats` looked in: the queues' figures are
    /// then unknown (null), not read from a queue of the same name in this vhost.
    pub other_vhost: Option<String>,
    /// How long ago the error queue's oldest message failed (none: empty, or nothing says).
    pub oldest_dead_letter_seconds: Option<f64>,
    /// Where that stands against the retention: `ok`, `near` or `past`.
    pub dead_letter_window: Option<stats::Window>,
    /// Calls outside the database owed (pending or being made), and how old the oldest is (none: no
    /// `inboxctl_effects` to read).
    pub effects_pending: Option<u64>,
    pub oldest_effect_pending_seconds: Option<f64>,
    /// Calls in doubt (made or not, nobody knows), and how old the oldest is.
    pub effects_in_doubt: Option<u64>,
    pub oldest_effect_in_doubt_seconds: Option<f64>,
    /// Calls that failed every attempt.
    pub effects_failed: Option<u64>,
    /// A count of the calls not done stopped at 10,000 (the most one look counts): the three counts are floors.
    pub effects_at_least: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct QueueJson {
    pub name: Option<String>,
    /// Spread over this many partition queues (`<name>.0` …): `ready` sums them. `null` for a queue of its own:
    /// written always, so that the shape is the same whether a consumer_type is partitioned or not.
    pub partitions: Option<u16>,
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
}

impl From<&Snapshot> for Json {
    fn from(s: &Snapshot) -> Self {
        let queue = |q: &Option<QueueDepth>| QueueJson {
            name: q.as_ref().map(|q| q.name.clone()),
            partitions: q.as_ref().and_then(|q| q.partitions),
            ready: q.as_ref().and_then(|q| q.ready),
            consumers: q.as_ref().and_then(|q| q.consumers),
        };
        Json {
            taken_at: s.taken_at,
            window_seconds: s.window.as_secs_f64(),
            retention_seconds: s.retention.as_secs_f64(),
            broker_error: s.broker_error.clone(),
            consumers: s
                .consumers
                .iter()
                .map(|c| {
                    let rate = |n: fn(&Counts) -> u64| {
                        c.window.as_ref().map(|w| per_second(n(w), s.window))
                    };
                    ConsumerJson {
                        consumer_type: c.consumer_type.clone(),
                        rows: c.rows,
                        rows_estimated: c.rows_estimated,
                        rows_at_least: c.rows_at_least,
                        unprocessed: c.unprocessed,
                        unprocessed_estimated: c.unprocessed_estimated,
                        unprocessed_at_least: c.unprocessed_at_least,
                        oldest_unprocessed_seconds: c.oldest_unprocessed_seconds,
                        deliveries_per_second: rate(Counts::deliveries),
                        duplicates_per_second: rate(|w| w.duplicates),
                        duplicate_ratio: c.window.as_ref().and_then(Counts::duplicate_ratio),
                        processed_per_second: rate(|w| w.processed),
                        failed_per_second: rate(|w| w.failed),
                        rates_estimated: c.rates_estimated,
                        conflicts: c.window.as_ref().map(|w| w.conflicts),
                        queue: queue(&c.queue),
                        other_vhost: c.other_vhost.clone(),
                        error_queue: {
                            let mut q = queue(&c.error_queue);
                            q.consumers = None;
                            q
                        },
                        oldest_dead_letter_seconds: c.oldest_dead_letter_seconds,
                        dead_letter_window: c
                            .oldest_dead_letter_seconds
                            .map(|age| stats::Window::of(age, s.retention)),
                        effects_pending: c.effects.map(|e| e.pending),
                        oldest_effect_pending_seconds: c
                            .effects
                            .and_then(|e| e.oldest_pending_seconds),
                        effects_in_doubt: c.effects.map(|e| e.in_doubt),
                        oldest_effect_in_doubt_seconds: c
                            .effects
                            .and_then(|e| e.oldest_in_doubt_seconds),
                        effects_failed: c.effects.map(|e| e.failed),
                        effects_at_least: c.effects.map(|e| e.at_least),
                    }
                })
                .collect(),
        }
    }
}
