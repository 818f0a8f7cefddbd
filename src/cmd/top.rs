//! `inboxctl top`: the live dashboard per consumer_type.

use std::io::IsTerminal as _;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::cli::{GlobalOpts, MAX_DURATION, duration_between, parse_window};
use crate::error::{Error, Outcome, Result};
use crate::top;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How often the figures are refreshed (from 100ms to 100y)
    #[arg(long, default_value = "1s", value_parser = duration_between(MIN_INTERVAL, MAX_DURATION))]
    pub interval: Duration,

    /// Rates are averages over this last stretch of time (from 1s to 100y)
    #[arg(long, default_value = "1m", value_parser = parse_window)]
    pub window: Duration,

    /// The cleanup's retention: an error queue's oldest message nearing it is flagged (its replay needs its inbox row)
    #[arg(long, default_value = "7d", value_parser = crate::cli::parse_positive_duration)]
    pub retention: Duration,

    /// Look only: the detail view's replay (r) is off
    #[arg(long)]
    pub read_only: bool,

    /// Highlight a duplicate ratio above this, in percent
    #[arg(long, default_value_t = 5.0, value_parser = parse_percent)]
    pub alert_duplicates: f64,
}

/// The shortest refresh interval: each refresh queries every consumer_type, and a shorter one keeps the database
/// busy for a screen that cannot change faster than it is read.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

fn parse_percent(s: &str) -> Result<f64, String> {
    let p: f64 = s
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if !(0.0..=100.0).contains(&p) {
        return Err("must be between 0 and 100".to_owned());
    }
    Ok(p)
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    if !(std::io::stdout().is_terminal() && std::io::stdin().is_terminal()) {
        return Err(Error::Usage(
            "top draws on a terminal, and this is not one; for the same figures as text or JSON use `inboxctl stats` \
             (or `inboxctl stats --json`)"
                .to_owned(),
        ));
    }
    // A dumb terminal (Emacs's shell, some CI consoles) cannot move the cursor: a full-screen dashboard, ASCII or not,
    // would come out as a scroll of escape codes. The same figures as lines are what `stats` prints.
    if std::env::var_os("TERM").is_some_and(|term| term == "dumb") {
        return Err(Error::Usage(
            "top redraws the screen in place, and TERM=dumb says this terminal cannot; for the same figures as text use \
             `inboxctl stats` (or set TERM to what the terminal is, e.g. TERM=xterm-256color)"
                .to_owned(),
        ));
    }
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    // Lazily: an unreachable database is shown on the dashboard and retried, not a reason to refuse to start. A pooler
    // that was not declared is one.
    db.check_pooler().await?;
    // No statement of the dashboard's outlives what it waits for one (a refresh, a detail's look): one given up on
    // would go on on the server.
    let pool = db
        .with_statement_timeout(top::STATEMENT_TIMEOUT)
        .lazy_pool(2);
    let options = top::Options {
        interval: args.interval,
        window: args.window,
        alert_duplicates: args.alert_duplicates / 100.0,
        retention: args.retention,
        read_only: args.read_only,
    };
    top::run(pool, broker, options, shutdown).await?;
    Ok(Outcome::Done)
}
