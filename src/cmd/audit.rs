//! `inboxctl audit`: the operator actions that changed state, newest first.

use std::time::Duration;

use crate::cli::{GlobalOpts, parse_positive_duration};
use crate::error::{Outcome, Result};
use crate::{output, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Actions of this last while (e.g. 90m, 24h, 30d)
    #[arg(long, default_value = "24h", value_parser = parse_positive_duration)]
    pub since: Duration,

    /// Only this command's actions (migrate, cleanup, replay, consume)
    #[arg(long)]
    pub command: Option<String>,

    /// At most this many rows
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub limit: i64,

    /// Print the rows as JSON
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts) -> Result<Outcome> {
    let database = global.connect.database()?;
    let pool = database.pool(1).await?;
    let rows = crate::audit::list(
        &pool,
        &database,
        args.since,
        args.command.as_deref(),
        args.limit,
    )
    .await;
    pool.close().await;
    let rows = rows?;
    if args.json {
        return output::json(&rows).map(|()| Outcome::Done);
    }
    let mut t = table::new(&[
        "when",
        "command",
        "outcome",
        "exit",
        "who",
        "what",
        "command line",
    ]);
    for column in [1, 2, 4, 5, 6] {
        table::align_left(&mut t, column);
    }
    for r in &rows {
        let who = format!(
            "{} (role {}) on {}",
            r.os_user.as_deref().unwrap_or("?"),
            r.database_role,
            r.host.as_deref().unwrap_or("?")
        );
        t.add_row(vec![
            r.occurred_at
                .format("%Y-%m-%d %H:%M:%S UTC")
                .to_string()
                .into(),
            table::text(&r.command),
            table::text(&r.outcome),
            r.exit_code
                .map_or_else(|| "-".to_owned(), |c| c.to_string())
                .into(),
            table::text(&who),
            table::text(&crate::audit::summary(&r.details)),
            table::text(&r.command_line),
        ]);
    }
    output::line(&t.to_string())?;
    output::line(&format!(
        "{} actions in the last {}",
        rows.len(),
        humantime::format_duration(args.since)
    ))?;
    Ok(Outcome::Done)
}
