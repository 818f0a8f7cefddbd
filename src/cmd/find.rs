//! `inboxctl find <message-id>…`: everything known about a message, in one view.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::cli::GlobalOpts;
use crate::error::{Outcome, Result};
use crate::triage::find::{self, Found, Plan, Report};
use crate::{amqp, db, output, sanitize, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The message ids (UUIDs, any spelling)
    #[arg(required = true, num_args = 1..=100, value_name = "MESSAGE_ID", value_parser = parse_id)]
    pub ids: Vec<Uuid>,

    /// A dead-letter-exchange queue to look in too, beside each known consumer_type's <queue>_error and
    /// <queue>_skipped (repeatable)
    #[arg(long, value_name = "QUEUE")]
    pub dlq: Vec<String>,

    /// Look at no more than this many messages per dead-letter queue (the oldest)
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub limit: u64,

    /// How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails,
    /// saying so, and what it held goes back
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_positive_duration)]
    pub broker_timeout: std::time::Duration,

    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

fn parse_id(s: &str) -> std::result::Result<Uuid, String> {
    Uuid::parse_str(s.trim()).map_err(|e| format!("{s:?} is not a message id (a UUID): {e}"))
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    for dlq in &args.dlq {
        amqp::validate_name("--dlq", dlq)?;
    }
    let database = global.connect.database()?;
    let pool = database.pool(2).await?;
    let tables = [
        "inbox_messages",
        "inboxctl_events",
        "inboxctl_attempts",
        "inboxctl_consumers",
        "carrier_reservations",
        "notifications_sent",
    ];
    db::schema::require_tables(&pool, &database, &tables).await?;
    let broker = global.connect.broker()?;
    let connection = broker.connect("inboxctl find").await?;
    let plan = Plan {
        ids: args.ids.clone(),
        dlqs: args.dlq.clone(),
        limit: args.limit,
        broker_timeout: args.broker_timeout,
    };
    let report = find::find(&pool, &broker, &connection, &plan).await;
    amqp::close(&connection, "OK").await;
    pool.close().await;
    let report = report?;
    if args.json {
        output::json(&report)?;
    } else {
        print(&report)?;
    }
    let missing: Vec<_> = report.messages.iter().filter(|m| !m.found).collect();
    for m in &missing {
        tracing::warn!(
            "message {}: found nowhere (inbox, events, effects, dead-letter queues)",
            m.message_id
        );
    }
    let crowded: Vec<_> = report
        .queues
        .iter()
        .filter(|q| q.looked_at_elsewhere)
        .map(|q| sanitize::text(&q.queue).into_owned())
        .collect();
    if !crowded.is_empty() {
        tracing::warn!(
            queues = %crowded.join(", "),
            "another look at these dead-letter queues held messages while this one looked: a copy it held may not \
             have been seen; look again when it has ended"
        );
    }
    // A queue that could not be looked at may hold a copy: not the whole story either.
    let unlooked = report.queues.iter().any(|q| q.error.is_some());
    Ok(if missing.is_empty() && crowded.is_empty() && !unlooked {
        Outcome::Done
    } else {
        Outcome::Partial
    })
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string(),
    )
}

fn print(report: &Report) -> Result<()> {
    for m in &report.messages {
        output::line(&format!("message {}", m.message_id))?;
        if !m.found {
            output::line("  found nowhere")?;
            continue;
        }
        output::line(&rows(m).to_string())?;
        if m.copies_cut {
            output::line(&format!(
                "  (the first {} dead-letter copies shown)",
                find::MAX_COPIES
            ))?;
        }
        if m.events_cut {
            output::line(&format!(
                "  (the newest {} events of each consumer_type shown, {} in all at most)",
                db::triage::MAX_EVENTS,
                db::triage::MAX_EVENTS_IN_ALL
            ))?;
        }
    }
    let queues: Vec<String> = report
        .queues
        .iter()
        .map(|q| {
            let name = match &q.vhost {
                Some(vhost) => format!("{} (in vhost {})", q.queue, vhost),
                None => q.queue.clone(),
            };
            let q = find::Looked {
                queue: name,
                ..q.clone()
            };
            let shown = match q.depth {
                Some(depth) if q.looked < depth => format!(
                    "{} (oldest {} of {depth})",
                    sanitize::text(&q.queue),
                    q.looked
                ),
                Some(_) => sanitize::text(&q.queue).into_owned(),
                None => format!("{} (absent)", sanitize::text(&q.queue)),
            };
            if let Some(why) = &q.error {
                format!(
                    "{} (could not be looked at: {})",
                    sanitize::text(&q.queue),
                    sanitize::text(why)
                )
            } else if q.replay_running {
                format!("{shown} (a replay of it is running: what it holds is not seen)")
            } else if q.looked_at_elsewhere {
                format!(
                    "{shown} (another look held messages meanwhile: what it held may not be seen)"
                )
            } else {
                shown
            }
        })
        .collect();
    output::line(&format!(
        "dead-letter queues looked in: {}; {}",
        if queues.is_empty() {
            "none known".to_owned()
        } else {
            queues.join(", ")
        },
        super::failures::REDELIVERED_NOTE
    ))
}

/// A copy in a dead-letter queue, as a line of the table.
fn dead_letter_line(d: &find::DeadLetterCopy) -> (Option<DateTime<Utc>>, String, String, String) {
    let replays = if d.replays > 0 {
        format!("; replayed {} times", d.replays)
    } else {
        String::new()
    };
    (
        d.failed_at,
        "dead-letter queue".into(),
        d.queue.clone(),
        format!(
            "position {}; failed on {}: {} [{} {}]{replays}",
            d.position,
            d.origin,
            d.reason.as_deref().unwrap_or("-"),
            d.exception_type.as_deref().unwrap_or("-"),
            d.fingerprint,
        ),
    )
}

/// One message's findings, oldest first.
fn rows(m: &Found) -> comfy_table::Table {
    let mut t = table::new(&["when", "where", "consumer_type / queue", "what"]);
    for column in [1, 2, 3] {
        table::align_left(&mut t, column);
    }
    let mut lines: Vec<(Option<DateTime<Utc>>, String, String, String)> = Vec::new();
    for r in &m.inbox {
        // A time of ±infinity in the table (.NET's DateTime.MinValue/MaxValue as Npgsql writes them) has no place
        // in time: said, and listed last, with the lines of no time.
        lines.push((
            r.received_at,
            "inbox".into(),
            r.consumer_type.clone(),
            if r.received_at.is_some() {
                "received".into()
            } else {
                "received (at ±infinity, as the table says)".into()
            },
        ));
        if r.processed {
            lines.push((
                r.processed_at,
                "inbox".into(),
                r.consumer_type.clone(),
                if r.processed_at.is_some() {
                    "processed".into()
                } else {
                    "processed (at ±infinity, as the table says)".into()
                },
            ));
        } else {
            lines.push((
                None,
                "inbox".into(),
                r.consumer_type.clone(),
                "not processed".into(),
            ));
        }
    }
    for e in &m.events {
        let what = match &e.detail {
            Some(d) if !d.is_empty() => format!("{}: {d}", e.kind.replace('_', " ")),
            _ => e.kind.replace('_', " "),
        };
        lines.push((
            Some(e.occurred_at),
            "event".into(),
            e.consumer_type.clone(),
            what,
        ));
    }
    for a in &m.attempts {
        lines.push((
            Some(a.last_started_at),
            "poison detection".into(),
            a.consumer_type.clone(),
            format!(
                "{} starts without an outcome ({} alone)",
                a.started, a.alone
            ),
        ));
    }
    for e in &m.effects {
        lines.push((
            Some(e.at),
            "effect".into(),
            e.table.clone(),
            format!("parcel {}", e.parcel_id),
        ));
    }
    for c in &m.calls {
        let mut what = format!(
            "{} call ({}), key {}, {} attempt(s)",
            c.state, c.mode, c.idempotency_key, c.attempts
        );
        if let Some(reference) = &c.reference {
            what.push_str(&format!(", reference {reference}"));
        }
        if let Some(error) = &c.last_error {
            what.push_str(&format!(", last error: {error}"));
        }
        lines.push((
            Some(c.updated_at),
            "call".into(),
            c.consumer_type.clone(),
            what,
        ));
    }
    lines.extend(m.dead_letters.iter().map(dead_letter_line));
    lines.sort_by_key(|l| l.0.map_or(i64::MAX, |t| t.timestamp_micros()));
    for (when, place, name, what) in lines {
        t.add_row(vec![
            time(when).into(),
            table::text(&place),
            table::text(&name),
            table::text(&what),
        ]);
    }
    t
}
