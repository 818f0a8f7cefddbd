//! `inboxctl migrate`: creates the database if needed, checks an existing `inbox_messages`, applies what is pending.

use crate::cli::GlobalOpts;
use crate::db::schema::{self, MigrateReport};
use crate::error::{Outcome, Result};
use crate::{audit, output};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Show what would be created and run, SQL included, and change nothing
    #[arg(long)]
    pub dry_run: bool,

    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    let db = global.connect.database()?;
    let report = schema::migrate(&db, args.dry_run).await;
    if !args.dry_run {
        let details = match &report {
            Ok(r) => serde_json::json!({
                "database": r.database,
                "database_created": r.database_created,
                "adopted_existing_inbox": r.adopted_existing_inbox,
                "applied": r.migrations.iter().map(|m| m.version).collect::<Vec<_>>(),
            }),
            Err(_) => serde_json::json!({ "database": db.name() }),
        };
        let entry = audit::Entry::ended("migrate", &report, |_| Outcome::Done, details);
        audit::record_in(&db, &entry).await;
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
    let db = &report.database;
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
