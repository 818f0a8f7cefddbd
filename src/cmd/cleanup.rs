//! `inboxctl cleanup --retention <duration>`: purge processed inbox rows older than the window, in small batches.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::ProgressBar;
use tokio_util::sync::CancellationToken;

use crate::cleanup::{self, Event, Plan, Progress, Report};
use crate::cli::{GlobalOpts, parse_duration, parse_positive_duration, show};
use crate::error::{Error, Outcome, Result};
use crate::inbox::ConsumerType;
use crate::metrics::{self, cleanup::Totals};
use crate::{output, sanitize, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep processed rows this long (e.g. 90m, 36h, 7d; from 1m, or shorter with --force, to 100y): a copy of a
    /// message is recognised as a duplicate only while its row exists, so make it longer than any redelivery or
    /// replay can come late
    #[arg(long, value_parser = parse_positive_duration)]
    pub retention: Duration,

    /// Clean even where it shortens the deduplication window: accept a --retention under 1m, and clean consumer_types
    /// whose dead-letter queues hold a message that failed before the cutoff (its replay would then be processed
    /// again)
    #[arg(long)]
    pub force: bool,

    /// A dead-letter-exchange queue to look at besides each consumer_type's <queue>_error and <queue>_skipped
    /// (repeatable): a message in it that failed before the cutoff keeps the rows of every consumer_type
    #[arg(long, value_name = "QUEUE")]
    pub dlq: Vec<String>,

    /// How long any call to RabbitMQ may wait for its answer while the cleanup looks at dead-letter queues (a count, a
    /// take, a mark); past it the cleanup fails, saying so, and deletes nothing
    #[arg(long, default_value = "30s", value_parser = parse_positive_duration)]
    pub broker_timeout: std::time::Duration,

    /// Keep the audit's rows (inboxctl audit) this long, from 1d; they are deleted only with this retention of their
    /// own
    #[arg(long, default_value = "90d", value_parser = parse_positive_duration)]
    pub audit_retention: Duration,

    /// How long dropping a partition of a partitioned inbox waits for the transactions that could still see it (a
    /// long query, a dump, a session idle in a transaction) before leaving it for the next cleanup
    #[arg(long, default_value = "30s", value_parser = parse_positive_duration)]
    pub detach_wait: Duration,

    /// Only this consumer_type (default: every one)
    #[arg(long)]
    pub consumer_type: Option<String>,

    /// Rows per DELETE; each batch is a short transaction of its own
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch_size: i64,

    /// Rest between batches (e.g. 50ms), to leave the database room
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub batch_pause: Duration,

    /// Count what would be deleted; delete nothing
    #[arg(long)]
    pub dry_run: bool,

    /// Keep running and clean on this schedule (e.g. 1h), as a sidecar or where there is no cron
    #[arg(long, value_parser = parse_positive_duration)]
    pub every: Option<Duration>,

    /// With --every: serve Prometheus metrics on /metrics and a health check on /health at this address
    #[arg(long, value_name = "ADDR", requires = "every")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Print the result as JSON (one line per run)
    #[arg(long)]
    pub json: bool,
}

/// The shortest `--audit-retention`: the audit is the record of who ran what, and one of minutes (`90m` typed for
/// `90d`) would empty it at the next run. Not overridden by `--force`, which is about the deduplication window.
pub const MIN_AUDIT_RETENTION: Duration = Duration::from_secs(86_400);

/// The shortest `--retention` taken without `--force`. A retention is the deduplication window, and one of
/// milliseconds (as easy to type as `0s`, which is refused) empties it: every late copy would be processed again.
pub const MIN_RETENTION: Duration = Duration::from_secs(60);

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    if args.retention < MIN_RETENTION && !args.force {
        return Err(Error::Usage(format!(
            "--retention {} is under {}: the retention is the deduplication window, and a copy of a message that \
             arrives after its row was deleted is processed again; give --force to clean with it anyway",
            show(args.retention),
            show(MIN_RETENTION)
        )));
    }
    if args.audit_retention < MIN_AUDIT_RETENTION {
        return Err(Error::Usage(format!(
            "--audit-retention {} is under {}: the audit's rows older than that would go at this run (90m typed \
             for 90d?)",
            show(args.audit_retention),
            show(MIN_AUDIT_RETENTION)
        )));
    }
    if let Some(consumer_type) = &args.consumer_type {
        ConsumerType::new(consumer_type.as_str())
            .map_err(|e| Error::Usage(format!("--consumer-type: {e}")))?;
    }
    for dlq in &args.dlq {
        crate::amqp::validate_name("--dlq", dlq)?;
    }
    let guard = if args.force {
        None
    } else {
        Some(cleanup::Guard {
            broker: global.connect.broker()?,
            dlqs: args.dlq.clone(),
            broker_timeout: args.broker_timeout,
        })
    };
    let db = global.connect.database()?;
    let pool = db.pool(3).await?;
    cleanup::check_schema(&pool, &db).await?;
    let plan = Plan {
        retention: args.retention,
        consumer_type: args.consumer_type.clone(),
        batch_size: args.batch_size,
        batch_pause: args.batch_pause,
        dry_run: args.dry_run,
        guard,
        audit_retention: args.audit_retention,
        detach_wait: args.detach_wait,
    };
    let mut partial = false;
    let mut last_failed = false;
    let totals = Arc::new(Mutex::new(Totals::default()));
    if let Some(addr) = args.metrics_addr {
        let registry = metrics::cleanup::registry(Arc::clone(&totals));
        let health = metrics::cleanup::CleanupHealth { pool: pool.clone() };
        metrics::serve(addr, registry, Arc::new(health), shutdown.clone()).await?;
    }
    let show_progress = !args.json && !args.dry_run;
    let mut meter = ProgressBar::hidden();
    let interrupted = cleanup::scheduled(&pool, &plan, args.every, &shutdown, |event| {
        match event {
            Event::Started => meter = super::progress::line(show_progress),
            Event::Progress(p) => draw(&meter, &p),
            Event::Failed(e) => {
                meter.finish_and_clear();
                last_failed = true;
                totals.lock().unwrap_or_else(|p| p.into_inner()).failed();
                if args.json {
                    output::json(&serde_json::json!({
                        "failed": true,
                        "error": crate::redact::text(&e.to_string()),
                    }))?;
                }
            }
            Event::Finished(report) => {
                last_failed = false;
                meter.finish_and_clear();
                warn_unprocessed(report, args.retention);
                warn_refused(report);
                partial = report.outcome() == Outcome::Partial;
                totals.lock().unwrap_or_else(|p| p.into_inner()).add(report);
                if args.json {
                    output::json(report)?;
                } else {
                    print(report, args.retention)?;
                }
            }
        }
        Ok(())
    })
    .await?;
    // A stop after a run that failed: the last run did not happen.
    Ok(if interrupted || partial || last_failed {
        Outcome::Partial
    } else {
        Outcome::Done
    })
}

fn warn_unprocessed(report: &Report, retention: Duration) {
    for c in report.consumers.iter().filter(|c| c.unprocessed_older > 0) {
        tracing::warn!(
            consumer_type = %sanitize::text(&c.consumer_type),
            unprocessed = c.unprocessed_older,
            oldest = ?c.oldest_unprocessed,
            "{} messages were received more than {} ago and never processed (kept): a stuck consumer, or a filter that never sets processed_at",
            c.unprocessed_older,
            humantime::format_duration(retention)
        );
    }
}

fn warn_refused(report: &Report) {
    for c in &report.consumers {
        if let Some(why) = &c.refused {
            tracing::warn!(
                consumer_type = %sanitize::text(&c.consumer_type),
                "not cleaned: {}",
                why.describe()
            );
        }
    }
}

fn print(report: &Report, retention: Duration) -> Result<()> {
    let verb = if report.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    let window = humantime::format_duration(retention).to_string();
    let mut t = table::new(&[
        "consumer_type",
        &format!("rows {verb}"),
        &format!("events {verb}"),
        &format!("unprocessed older than {window}"),
        "oldest unprocessed",
    ]);
    for c in &report.consumers {
        let name = if c.busy {
            format!("{} (left to another cleanup running now)", c.consumer_type)
        } else if let Some(why) = &c.refused {
            let what = if why.other_vhost.is_some() {
                "its dead-letter queues could not be looked at in its consumer's vhost"
            } else if why.absent {
                "a --dlq is not in this vhost"
            } else if why.replay_running {
                "a replay of its dead letters is running"
            } else if why.consumers.is_some() {
                "another client consumes a dead-letter queue of it"
            } else if why.looked_at_elsewhere {
                "another look held its dead letters out of sight"
            } else if why.beyond_the_look {
                "a dead-letter queue holds more than the cleanup looks at"
            } else {
                "a dead-lettered message older than the cutoff waits for replay"
            };
            format!("{} (not cleaned: {what})", c.consumer_type)
        } else {
            c.consumer_type.clone()
        };
        t.add_row(vec![
            table::text(&name),
            c.deleted.into(),
            c.events_deleted.into(),
            c.unprocessed_older.into(),
            c.oldest_unprocessed
                .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                .unwrap_or_default()
                .into(),
        ]);
    }
    output::line(&t.to_string())?;
    if let Some(p) = &report.partitions {
        for kept in &p.kept {
            output::line(&format!(
                "partition {} kept: {}",
                sanitize::text(&kept.partition),
                sanitize::text(&kept.why)
            ))?;
        }
        if let Some(next) = &p.next {
            output::line(&format!(
                "partition {} holds the cutoff: its rows past the window go with it, whole, after {}",
                sanitize::text(&next.partition),
                next.whole_past_window_at.format("%Y-%m-%d %H:%M:%S UTC")
            ))?;
        }
    }
    let mut summary = format!(
        "cutoff {} (retention {window}): {verb} {} rows and {} events",
        report.cutoff.format("%Y-%m-%d %H:%M:%S UTC"),
        report.deleted,
        report.events_deleted
    );
    if !report.dry_run {
        summary.push_str(&format!(
            " in {:.1}s ({:.0} rows/s)",
            report.seconds, report.rows_per_second
        ));
    }
    if let Some(p) = &report.partitions {
        let dropped = if report.dry_run {
            "would drop"
        } else {
            "dropped"
        };
        summary.push_str(&format!(
            "; partitions: {dropped} {} (~{} rows), kept {} older than the cutoff, created {} ahead",
            p.dropped.len(),
            p.rows_dropped(),
            p.kept.len(),
            p.created.len()
        ));
    }
    if report.effects_deleted > 0 {
        summary.push_str(&format!(
            "; {} records of calls done outside the database",
            report.effects_deleted
        ));
    }
    if let Some(why) = &report.effects_left {
        summary.push_str(&format!("; {why}"));
    }
    if report.audit_deleted > 0 {
        summary.push_str(&format!(
            "; {} audit rows past the audit's retention",
            report.audit_deleted
        ));
    }
    if report.refused > 0 {
        summary.push_str(&format!(
            "; {} consumer_types not cleaned, to keep the window of a waiting replay (see the warnings; --force cleans them)",
            report.refused
        ));
    }
    if let Some(why) = &report.failed {
        summary.push_str(&format!(
            "; then failed (what is above was deleted): {}",
            crate::sanitize::text(why)
        ));
    }
    if report.interrupted {
        summary.push_str("; interrupted: every batch either completed or did not start, and the rest is left for the next run");
    }
    output::line(&summary)
}

/// How far the cleanup got, on the progress line.
fn draw(meter: &ProgressBar, p: &Progress<'_>) {
    let rate = p.deleted as f64 / p.elapsed.as_secs_f64().max(0.001);
    meter.set_message(format!(
        "cleaning {}: {} rows deleted ({rate:.0} rows/s)",
        sanitize::text(p.consumer_type),
        p.deleted
    ));
}
