//! `inboxctl migrate`: creates the database if needed, checks an existing `inbox_messages`, applies what is pending.

use crate::cli::{GlobalOpts, duration_between};
use crate::db::partitions::{self, Settings};
use crate::db::schema::{self, MigrateReport};
use crate::error::{Outcome, Result};
use crate::inbox::TimeSource;
use crate::{audit, output};
use tokio_util::sync::CancellationToken;

/// `parse`, refusing a duration that is not a whole number of seconds: the interval is kept in whole seconds, and
/// partitions of `1h 500ms` would drift from the boundaries a cleanup computes from what was kept, leaving gaps.
fn whole_seconds(
    parse: impl Fn(&str) -> Result<std::time::Duration, String> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<std::time::Duration, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let d = parse(s)?;
        if d.subsec_nanos() != 0 {
            return Err("must be a whole number of seconds".to_owned());
        }
        Ok(d)
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Show what would be created and run, SQL included, and change nothing
    #[arg(long)]
    pub dry_run: bool,

    /// Partition inbox_messages by range, one partition per this interval (1h to 31d), on a time every copy of a
    /// message carries (--partition-time), so that cleanup drops whole partitions instead of deleting rows. An existing
    /// inbox_messages is converted in place: its rows are not copied, and consumers go on (docs/scaling.md)
    #[arg(long, value_name = "INTERVAL",
          value_parser = whole_seconds(duration_between(std::time::Duration::from_secs(3600), std::time::Duration::from_secs(31 * 86400))))]
    pub partitioned: Option<std::time::Duration>,

    /// The time a partitioned inbox keys each message on: one that every copy of it carries. Chosen once: it cannot
    /// be changed afterwards
    #[arg(long, value_enum, default_value_t = TimeSource::Id, requires = "partitioned")]
    pub partition_time: TimeSource,

    /// How far back the conversion of an inbox makes partitions: at least the cleanup's --retention, so that a
    /// message of an older time (waiting in an error queue, say) can still be claimed. Taken only at the conversion;
    /// a partition is never made before the oldest one after it (a cleanup may have dropped it). 7d (the default) to
    /// 3650d: less would leave messages of the last week unclaimable for good
    #[arg(long, value_name = "DURATION", requires = "partitioned",
          value_parser = whole_seconds(duration_between(std::time::Duration::from_secs(7 * 86400), std::time::Duration::from_secs(3650 * 86400))))]
    pub partition_back: Option<std::time::Duration>,

    /// Make a new inbox on the search path even though another schema of the database holds an inbox_messages
    /// (refused without: that one may be a service's, which a new one would take the place of)
    #[arg(long)]
    pub new_inbox: bool,

    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// `--partition-time id|sent-time|timestamp`.
impl clap::ValueEnum for TimeSource {
    fn value_variants<'a>() -> &'a [Self] {
        &TimeSource::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let help = match self {
            TimeSource::Id => {
                "The time inside the message id: UUIDv7, else MassTransit's NewId (what MassTransit sends)"
            }
            TimeSource::SentTime => {
                "The envelope's sentTime, else the AMQP timestamp: for ids without a time (random v4)"
            }
            TimeSource::Timestamp => "The AMQP timestamp property",
        };
        Some(clap::builder::PossibleValue::new(self.name()).help(help))
    }
}

/// What an interrupted migrate says.
const INTERRUPTED: &str = "interrupted: what was applied stays; run migrate again to finish (an index build cut short is built again then)";

/// How long an interrupted migrate waits to write its audit row: it is on its way out.
const AUDIT_ON_THE_WAY_OUT: std::time::Duration = std::time::Duration::from_secs(5);

// Each step is its own transaction, or an index built concurrently: a stop drops the run with its connection, what
// was done stays, what was under way is rolled back (an index build cut short is left invalid, and built again by the
// next run), and the session's lock goes with the connection. The stop is audited as a partial run (exit 3), as every
// other command's is: a migrate that leaves no row was one an operator could not account for.
pub async fn run(args: Args, global: &GlobalOpts, shutdown: &CancellationToken) -> Result<Outcome> {
    let db = global.connect.database()?;
    let partitioning = args.partitioned.map(|interval| Settings {
        interval: chrono::TimeDelta::from_std(interval).unwrap_or(partitions::MIN_INTERVAL),
        source: args.partition_time,
    });
    let back = args
        .partition_back
        .map(|back| chrono::TimeDelta::from_std(back).unwrap_or(partitions::BACK));
    let migrated = schema::migrate_with(&db, args.dry_run, partitioning, back, args.new_inbox);
    let report = tokio::select! {
        report = migrated => report,
        () = shutdown.cancelled() => {
            tracing::warn!("{INTERRUPTED}");
            if !args.dry_run {
                let details = serde_json::json!({ "database": db.name(), "interrupted": true });
                let entry = audit::Entry::ended("migrate", &Ok(()), |()| Outcome::Partial, details);
                audit::record_within(&db, &entry, AUDIT_ON_THE_WAY_OUT).await;
            }
            return Ok(Outcome::Partial);
        }
    };
    if !args.dry_run {
        let details = match &report {
            Ok(r) => serde_json::json!({
                "database": r.database,
                "database_created": r.database_created,
                "adopted_existing_inbox": r.adopted_existing_inbox,
                "applied": r.migrations.iter().map(|m| m.version).collect::<Vec<_>>(),
                "partitioning": r.partitioning,
            }),
            Err(_) => serde_json::json!({ "database": db.name() }),
        };
        let entry = audit::Entry::ended("migrate", &report, |_| Outcome::Done, details);
        // A stop now, the run done, ends the write: a database that went away meanwhile would otherwise hold the
        // first signal up for as long as it does not answer.
        tokio::select! {
            _ = audit::record_in(&db, &entry) => {}
            () = shutdown.cancelled() => {
                tracing::warn!("stopped while the audit row was written: the run itself ended as reported; its row not written");
            }
        }
    }
    let report = report?;
    if args.json {
        output::json(&report)?;
    } else {
        print(&report)?;
    }
    Ok(Outcome::Done)
}

fn print(report: &MigrateReport) -> Result<()> {
    // The URL's path, percent-decoded: it can hold anything.
    let db = crate::sanitize::text(&report.database);
    let (will, done, created) = if report.dry_run {
        ("would ", "would apply", "would create")
    } else {
        ("", "applied", "created")
    };
    if report.database_created {
        output::line(&format!("database {db}: {created}"))?;
    }
    if report.adopted_existing_inbox {
        output::line(&format!(
            "database {db}: the existing inbox_messages table is compatible; {will}keep it as it is, rows included"
        ))?;
    }
    if report.migrations.is_empty() {
        output::line(&format!("database {db}: up to date, nothing to apply"))?;
    }
    if let Some(p) = &report.partitioning {
        print_partitioning(&db, p, report.dry_run)?;
    }
    for m in &report.migrations {
        let outside = if m.no_transaction {
            " (outside a transaction)"
        } else {
            ""
        };
        output::line(&format!("{done} {} {}{outside}", m.version, m.description))?;
        if report.dry_run {
            for sql_line in m.sql.lines() {
                output::line(&format!("    {sql_line}"))?;
            }
        }
    }
    Ok(())
}

fn print_partitioning(db: &str, p: &partitions::PartitionReport, dry_run: bool) -> Result<()> {
    let Some(settings) = p.settings else {
        return Ok(());
    };
    let every = humantime::format_duration(settings.interval.to_std().unwrap_or_default());
    let how = format!(
        "partitioned every {every} on {}",
        settings.source.describe()
    );
    if dry_run {
        return output::line(&format!("database {db}: inbox_messages would be {how}"));
    }
    if p.converted {
        output::line(&format!(
            "database {db}: inbox_messages converted in place: its rows are now partition {}, below every time",
            partitions::UNTIMED
        ))?;
        if let Some(from) = p.back_to {
            output::line(&format!(
                "database {db}: partitions from {}: a message of an earlier time is not claimed (moved aside)",
                from.format("%Y-%m-%d %H:%M:%S UTC")
            ))?;
        }
    }
    output::line(&format!(
        "database {db}: inbox_messages is {how}; {} partitions created",
        p.created.len()
    ))
}
