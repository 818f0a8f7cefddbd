//! `inboxctl effects`: the calls to the outside world not done — owed, in doubt, failed — and settling them.

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::cli::GlobalOpts;
use crate::db::{self, external};
use crate::effects::CarrierClient;
use crate::effects::settle::{self, OPEN, Resolution};
use crate::error::{Outcome, Result};
use crate::{output, sanitize, table};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub action: Option<Action>,

    /// Only the effects in doubt: the call may or may not have been made (at-most-once)
    #[arg(long, group = "state")]
    pub in_doubt: bool,

    /// Only the effects owed: not called yet, or being called
    #[arg(long, group = "state")]
    pub pending: bool,

    /// Only the effects that failed every attempt
    #[arg(long, group = "state")]
    pub failed: bool,

    /// Only this consumer_type's
    #[arg(long)]
    pub consumer_type: Option<String>,

    /// At most this many, the oldest first
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub limit: i64,

    /// Print them as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)
    Resolve(ResolveArgs),
    /// Ask the carrier what it booked under each unknown effect's key and settle it: done with the slot found, or
    /// pending (made again by a consumer) when the carrier has none
    Reconcile(ReconcileArgs),
}

#[derive(Debug, clap::Args)]
pub struct ResolveArgs {
    /// The message whose effect to settle
    #[arg(value_parser = parse_id)]
    pub message_id: Uuid,

    /// Its consumer_type (needed when the message has effects for several)
    #[arg(long)]
    pub consumer_type: Option<String>,

    /// The call was made: mark the effect done
    #[arg(long, required_unless_present = "retry", conflicts_with = "retry")]
    pub done: bool,

    /// The carrier's reference for it (e.g. the slot id), kept with it
    #[arg(long, requires = "done")]
    pub reference: Option<String>,

    /// With --done: settle a call no consumer has attempted yet (owed, booked some other way). Refused without: a
    /// mistaken message id would mark done a call no one made, and it would never be made
    #[arg(long, requires = "done")]
    pub never_attempted: bool,

    /// The call was not made: owe it again (a running consumer makes it)
    #[arg(long)]
    pub retry: bool,

    /// With --retry: refused unless the call's last attempt ended at least this long ago — a request whose answer
    /// never came may still be booked by the carrier after you looked
    #[arg(long, default_value = "10m", value_name = "DURATION", value_parser = crate::cli::parse_duration, requires = "retry")]
    pub quiet_for: std::time::Duration,
}

#[derive(Debug, clap::Args)]
pub struct ReconcileArgs {
    /// The carrier's base URL for look-ups: GET <url>/pickups/by-key/{key}
    #[arg(long, value_name = "URL", value_parser = crate::cli::SecretUrl)]
    pub lookup_url: url::Url,

    /// Whose calls to settle: the consumer_type whose carrier --lookup-url answers for. Always named: a look-up asked
    /// about another carrier's calls answers 404 for each, and would have them made again
    #[arg(long, required = true)]
    pub consumer_type: Option<String>,

    /// The longest one look-up may take
    #[arg(long, default_value = "10s", value_parser = crate::cli::parse_positive_duration)]
    pub timeout: std::time::Duration,

    /// Owe a call again on a 404 only when its last attempt ended at least this long ago: the carrier may still be
    /// working on a request whose answer never came
    #[arg(long, default_value = "10m", value_name = "DURATION", value_parser = crate::cli::parse_duration)]
    pub quiet_for: std::time::Duration,

    /// Print what was done as JSON
    #[arg(long)]
    pub json: bool,
}

fn parse_id(s: &str) -> std::result::Result<Uuid, String> {
    Uuid::parse_str(s.trim()).map_err(|e| format!("{s:?} is not a message id (a UUID): {e}"))
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    let database = global.connect.database()?;
    let pool = database.pool(2).await?;
    db::schema::require_tables(&pool, &database, &["inboxctl_effects"]).await?;
    let ran = match args.action {
        Some(Action::Resolve(r)) => resolve(&pool, &r).await,
        Some(Action::Reconcile(r)) => reconcile(&pool, &r, &shutdown).await,
        None => {
            super::until_stopped(
                list(&pool, &args),
                &shutdown,
                "interrupted: nothing was changed",
            )
            .await
        }
    };
    pool.close().await;
    ran
}

async fn list(pool: &sqlx::PgPool, args: &Args) -> Result<Outcome> {
    let states: &[&str] = if args.in_doubt {
        &["in_doubt"]
    } else if args.pending {
        &["pending", "started"]
    } else if args.failed {
        &["failed"]
    } else {
        &OPEN
    };
    let rows = external::list(pool, states, args.consumer_type.as_deref(), args.limit).await?;
    if args.json {
        return output::json(&rows).map(|()| Outcome::Done);
    }
    let mut t = table::new(&[
        "message id",
        "consumer_type",
        "idempotency key",
        "mode",
        "state",
        "attempts",
        "since",
        "last error",
    ]);
    for column in [1, 3, 4, 7] {
        table::align_left(&mut t, column);
    }
    for r in &rows {
        t.add_row(vec![
            r.message_id.to_string().into(),
            table::text(&r.consumer_type),
            r.idempotency_key.to_string().into(),
            // Read from the table: a constraint holds them to a few words, unless the table was made otherwise.
            table::text(&r.mode),
            table::text(&r.state),
            r.attempts.to_string().into(),
            r.created_at
                .format("%Y-%m-%d %H:%M:%S UTC")
                .to_string()
                .into(),
            table::text(r.last_error.as_deref().unwrap_or("")),
        ]);
    }
    output::line(&t.to_string())?;
    output::line(&format!("{} effects", rows.len()))?;
    Ok(Outcome::Done)
}

async fn resolve(pool: &sqlx::PgPool, args: &ResolveArgs) -> Result<Outcome> {
    let resolution = match args.done {
        true => Resolution::Done {
            reference: args.reference.clone(),
            never_attempted: args.never_attempted,
        },
        false => Resolution::Retry,
    };
    let result = settle::resolve(
        pool,
        args.message_id,
        args.consumer_type.as_deref(),
        &resolution,
        args.quiet_for,
    )
    .await;
    let now = if args.done { "done" } else { "pending" };
    let details = serde_json::json!({
        "message_id": args.message_id,
        "consumer_type": result.as_ref().ok().map(|r| r.consumer_type.clone()),
        "was": result.as_ref().ok().map(|r| r.state.clone()),
        "now": now,
        "reference": args.reference,
    });
    let entry = crate::audit::Entry::ended("effects resolve", &result, |_| Outcome::Done, details);
    crate::audit::record(pool, &entry).await;
    let before = result?;
    output::line(&format!(
        "effect of message {} ({}): {} → {now}",
        args.message_id,
        sanitize::text(&before.consumer_type),
        sanitize::text(&before.state)
    ))?;
    Ok(Outcome::Done)
}

async fn reconcile(
    pool: &sqlx::PgPool,
    args: &ReconcileArgs,
    shutdown: &CancellationToken,
) -> Result<Outcome> {
    let client = CarrierClient::new(&args.lookup_url, args.timeout, args.timeout)?;
    let result = settle::reconcile(
        pool,
        &client,
        args.consumer_type.as_deref(),
        args.quiet_for,
        shutdown,
    )
    .await;
    let details = match &result {
        Ok(settle::Reconciliation { done, left, beyond }) => serde_json::json!({
            "consumer_type": args.consumer_type,
            "done": done.iter().filter(|r| r.now == "done").count(),
            "pending": done.iter().filter(|r| r.now == "pending").count(),
            "unknown": done.iter().filter(|r| r.now == "unknown").count(),
            "changed": done.iter().filter(|r| r.now == "changed").count(),
            "recent": done.iter().filter(|r| r.now == settle::RECENT).count(),
            "expired": done.iter().filter(|r| r.now == settle::EXPIRED).count(),
            "left": left,
            "more_than_a_run": beyond,
        }),
        Err(_) => serde_json::json!({"consumer_type": args.consumer_type}),
    };
    let unfinished = |run: &settle::Reconciliation| {
        run.left > 0
            || run.beyond
            || run
                .done
                .iter()
                .any(|r| r.now == "unknown" || r.now == settle::RECENT || r.now == settle::EXPIRED)
    };
    let entry = crate::audit::Entry::ended(
        "effects reconcile",
        &result,
        |run| match unfinished(run) {
            true => Outcome::Partial,
            false => Outcome::Done,
        },
        details,
    );
    crate::audit::record(pool, &entry).await;
    let run = result?;
    let done = &run.done;
    if args.json {
        output::json(done)?;
    } else {
        for r in done {
            output::line(&format!(
                "{} ({}): {} → {}{}",
                r.message_id,
                sanitize::text(&r.consumer_type),
                sanitize::text(&r.was),
                sanitize::text(&r.now),
                r.error
                    .as_deref()
                    .map_or(String::new(), |e| format!(" ({})", sanitize::text(e)))
            ))?;
        }
        output::line(&format!("{} effects reconciled", done.len()))?;
    }
    let recent = done.iter().filter(|r| r.now == settle::RECENT).count();
    if recent > 0 {
        tracing::warn!(
            calls = recent,
            quiet_for = %humantime::format_duration(args.quiet_for),
            "the carrier has no booking for some calls whose last attempt is too recent to be sure; they are left \
             as they were: run again later"
        );
    }
    let expired = done.iter().filter(|r| r.now == settle::EXPIRED).count();
    if expired > 0 {
        tracing::warn!(
            calls = expired,
            "the carrier has no booking under some calls' keys, but those keys are older than its consumers' \
             --effect-key-ttl: it may have forgotten them, and what it booked under them; they are left as they were: \
             ask the carrier, and settle each with `inboxctl effects resolve` (--done if it booked, --retry if not)"
        );
    }
    if done.iter().any(|r| r.now == "unknown") {
        tracing::warn!(
            "some calls could not be looked up, or not settled on the answer; they are left as they were"
        );
    }
    if run.left > 0 {
        tracing::warn!(
            calls = run.left,
            "interrupted: the calls not looked at yet are left as they were; what was settled stays: run again to \
             settle the rest"
        );
    }
    if run.beyond {
        tracing::warn!(
            "more calls are to settle than one run looks at (100,000, the oldest first): run again for the rest"
        );
    }
    if unfinished(&run) {
        return Ok(Outcome::Partial);
    }
    Ok(Outcome::Done)
}
