//! `inboxctl replay --from <queue>`: move dead-lettered messages back where they failed, safely.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::amqp;
use crate::cli::{GlobalOpts, parse_positive_duration};
use crate::error::{Outcome, Result};
use crate::replay::{self, Plan, Report};
use crate::{output, sanitize, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue
    #[arg(long)]
    pub from: String,

    /// Send every message here instead of where its headers say it failed
    #[arg(long)]
    pub to: Option<String>,

    /// Replay at most this many messages
    #[arg(long)]
    pub limit: Option<u64>,

    /// Only this message id (repeatable)
    #[arg(long = "message-id", value_name = "ID")]
    pub message_ids: Vec<String>,

    /// Only messages whose failure reason contains this text
    #[arg(long)]
    pub reason: Option<String>,

    /// Leave messages that were already replayed this many times
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_replays: Option<u32>,

    /// The inbox cleanup's retention: a message that failed longer ago may have lost its inbox row, so replaying it
    /// could repeat its effect; such messages are left where they are
    #[arg(long, default_value = "7d", value_parser = parse_positive_duration)]
    pub retention: Duration,

    /// Replay messages that failed before the retention window too
    #[arg(long)]
    pub include_expired: bool,

    /// Give each copy back the per-message TTL (expiration) it had before it was dead-lettered; by default a replayed
    /// copy has none, so that it cannot expire on its way back
    #[arg(long)]
    pub restore_expiration: bool,

    /// Only the members of this failure group (its fingerprint, or a unique prefix), as the listing of --listing
    /// holds them: messages of its cause that arrived since are left, and members gone since are reported
    #[arg(long, value_name = "FINGERPRINT", requires = "listing")]
    pub group: Option<String>,

    /// The listing `inboxctl failures --from <queue> --output <file>` wrote, which --group chooses from
    #[arg(long, value_name = "FILE", requires = "group")]
    pub listing: Option<std::path::PathBuf>,

    /// Republish at most this many messages a second, so that a large replay does not flood the consumers
    #[arg(long, value_parser = crate::cli::parse_rate)]
    pub rate: Option<f64>,

    /// On a terminal, ask before replaying more than this many messages, showing the count and the groups
    #[arg(long, default_value_t = 100)]
    pub confirm_above: u64,

    /// Do not ask (for scripts run on a terminal; without a terminal nothing is asked)
    #[arg(long, short = 'y')]
    pub yes: bool,

    /// List what would be replayed; move nothing (the broker marks inspected messages redelivered)
    #[arg(long)]
    pub dry_run: bool,

    /// After a lost connection, how long to keep connecting again to go on (0: stop at once, saying what was done)
    #[arg(long, default_value = "60s", value_parser = crate::cli::parse_duration)]
    pub reconnect_timeout: Duration,

    /// How long any call to RabbitMQ may wait for its answer (a copy's confirm, a get, an ack); past it the
    /// connection is given up and made again as after a loss (--reconnect-timeout), and what it held goes back to the
    /// dead-letter queue. On a connection the broker blocks (a memory or disk alarm) the replay stops instead
    #[arg(long, default_value = "30s", value_parser = crate::cli::parse_positive_duration)]
    pub broker_timeout: Duration,

    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<Outcome> {
    amqp::validate_name("--from", &args.from)?;
    if let Some(to) = &args.to {
        amqp::validate_name("--to", to)?;
        if let Some(why) = amqp::topology::not_a_replay_destination(to) {
            return Err(crate::error::Error::Usage(format!("--to {to}: {why}")));
        }
        if *to == args.from {
            return Err(crate::error::Error::Usage(format!(
                "--to {to} is the queue replayed from: its messages would only go round"
            )));
        }
    }
    let broker = global.connect.broker()?;
    let group = match (&args.group, &args.listing) {
        (Some(fingerprint), Some(path)) => {
            Some(group_plan(&args.from, broker.vhost(), fingerprint, path)?)
        }
        _ => None,
    };
    let connection = broker.connect("inboxctl replay").await?;
    let mut plan = Plan {
        from: args.from.clone(),
        to: args.to.clone(),
        limit: args.limit,
        confirmed: None,
        confirmed_ids: None,
        message_ids: args.message_ids.clone(),
        reason: args.reason.clone(),
        max_replays: args.max_replays,
        retention: args.retention,
        include_expired: args.include_expired,
        restore_expiration: args.restore_expiration,
        dry_run: args.dry_run,
        group,
        rate: args.rate,
        broker_timeout: args.broker_timeout,
    };
    if !args.dry_run && !args.yes {
        match super::confirm::replay(
            &connection,
            &broker,
            &mut plan,
            args.confirm_above,
            &shutdown,
        )
        .await
        {
            Ok(true) => {}
            Ok(false) => {
                crate::amqp::close(&connection, "OK").await;
                output::line("nothing replayed")?;
                return Ok(Outcome::Partial);
            }
            Err(e) => {
                crate::amqp::close(&connection, "OK").await;
                return Err(e);
            }
        }
    }
    let bar = super::progress::counter(!args.json, "messages");
    let report = replay::run(
        &connection,
        &broker,
        &plan,
        args.reconnect_timeout,
        &shutdown,
        |done, of| {
            bar.set_length(of);
            bar.set_position(done);
        },
    )
    .await;
    bar.finish_and_clear();
    crate::amqp::close(&connection, "OK").await;
    if !args.dry_run {
        let stopped = report.as_ref().ok().and_then(|r| stopped_error(r, &broker));
        audit(global, &plan, &report, stopped.as_ref()).await;
    }
    let report = report?;
    if let Some(most) = report.most_deliveries {
        tracing::warn!(queue = %crate::sanitize::text(&plan.from), "{}", crate::amqp::peek::worn(most));
    }
    if let Ok(database) = global.connect.database() {
        // Bounded, as the audit is: the replay is done, and a database that takes the connection and never answers
        // must not keep its report from being printed.
        let warned = crate::effects::settle::warn_past_key_lifetime(&database, &report);
        if tokio::time::timeout(AFTER_THE_REPLAY, warned)
            .await
            .is_err()
        {
            tracing::warn!(
                "could not look for keyed consumers whose keys the replayed messages outlived: PostgreSQL did not \
                 answer within {}",
                humantime::format_duration(AFTER_THE_REPLAY)
            );
        }
    }

    if args.json {
        output::json(&report)?;
    } else {
        print(&report)?;
    }
    if let Some(e) = stopped_error(&report, &broker) {
        return Err(e);
    }
    Ok(report.outcome())
}

/// How long the database is waited for once the replay is done (its audit row, the look for keys it outlived).
const AFTER_THE_REPLAY: std::time::Duration = std::time::Duration::from_secs(10);

fn print(report: &Report) -> Result<()> {
    // A dry run lists every message; a real run the ones it did not move, with why.
    let rows: Vec<_> = report
        .items
        .iter()
        .filter(|i| report.dry_run || i.action.is_problem())
        .collect();
    if !rows.is_empty() {
        let mut t = table::new(&[
            "message id",
            "reason",
            "failed at",
            "origin",
            "replays",
            "action",
        ]);
        for item in rows {
            let mut action = item.action.describe().to_owned();
            if let Some(e) = &item.error {
                action.push_str(": ");
                action.push_str(e);
            }
            t.add_row(vec![
                table::text(item.message_id.as_deref().unwrap_or("-")),
                table::text(item.reason.as_deref().unwrap_or("-")),
                item.failed_at
                    .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                    .unwrap_or_else(|| "-".to_owned())
                    .into(),
                table::text(item.origin.as_deref().unwrap_or("-")),
                item.replays.into(),
                table::text(&action),
            ]);
        }
        output::line(&t.to_string())?;
    }
    output::line(&summary(report))
}

/// The line under the table: what the replay did, and what it left.
fn summary(report: &Report) -> String {
    let from = sanitize::text(&report.from);
    let mut summary = if report.dry_run {
        let would = report
            .items
            .iter()
            .filter(|i| i.action == replay::Action::WouldReplay)
            .count();
        format!(
            "{from}: {} messages; would replay {would}, move nothing",
            report.snapshot
        )
    } else {
        format!(
            "{from}: {} messages; replayed {}",
            report.snapshot, report.replayed
        )
    };
    if report.left > 0 {
        summary.push_str(&format!("; {} left in place (see above)", report.left));
    }
    if report.unreached > 0 {
        summary.push_str(&format!(
            "; {} of them were not there to take (another client took them, or holds them unacknowledged now): run \
             replay again",
            report.unreached
        ));
    }
    if let Some(after) = report.in_queue_after.filter(|after| *after > report.left) {
        summary.push_str(&format!(
            "; {after} in the queue now: new failures since it began (its own replayed messages failing again among \
             them), messages another client held unacknowledged when it began, which it could not see, and what it \
             left; look at them (failures --from) before replaying again"
        ));
    }
    if report.already_replayed > 0 {
        summary.push_str(&format!(
            "; {} copies of messages it had already sent acknowledged, not sent again",
            report.already_replayed
        ));
    }
    if report.reconnects > 0 {
        summary.push_str(&format!(
            "; the connection was lost {} times and made again",
            report.reconnects
        ));
    }
    // A replay that went on to its end, a channel having closed under it after an acknowledgement.
    if !report.interrupted && report.acks_in_doubt > 0 {
        summary.push_str(&format!(
            "; but the acknowledgement of {} replayed message(s) is not known to have arrived before the channel \
             closed: such a message may still be in the dead-letter queue beside its copy (a second replay sends it \
             again, and the inbox discards the copy)",
            report.acks_in_doubt
        ));
    }
    if report.interrupted && report.stopped.is_none() {
        summary.push_str("; interrupted: the rest is where it was");
        if report.acks_in_doubt > 0 {
            summary.push_str(&format!(
                ", but the acknowledgement of {} replayed message(s) is not known to have arrived before the \
                 channel closed or the connection was lost: such a message may still be in the dead-letter queue \
                 beside its copy",
                report.acks_in_doubt
            ));
        }
    }
    if !report.unmatched.is_empty() {
        let ids: Vec<String> = report
            .unmatched
            .iter()
            .map(|id| sanitize::text(id).into_owned())
            .collect();
        summary.push_str(&format!(
            "; no message chosen for --message-id {}: not in the queue while it ran (replayed or removed already, held \
             by another client), or not chosen by --reason, --group or --limit",
            ids.join(", ")
        ));
    }
    if let Some(g) = &report.group {
        summary.push_str(&format!(
            "; group {}: {} listed, {} gone since the listing, {} now failed of another cause, {} new of its cause \
             (left)",
            crate::sanitize::text(&g.fingerprint),
            g.listed,
            g.gone.len(),
            g.changed.len(),
            g.new
        ));
    }
    summary
}

/// The error a replay that stopped early ends with: what was done, and why the rest was not.
fn stopped_error(report: &Report, broker: &crate::amqp::Broker) -> Option<crate::error::Error> {
    let reason = report.stopped.as_ref()?;
    let mut done = format!(
        "stopped after {} of {} messages ({} replayed); the rest are where they were: run replay again",
        report.items.len(),
        report.snapshot,
        report.replayed
    );
    if report.acks_in_doubt > 0 {
        done.push_str(&format!(
            "; the acknowledgement of {} replayed message(s) is not known to have arrived before the channel closed \
             or the connection was lost: such a message may still be in the dead-letter queue beside its copy, and a \
             second replay sends it again (the inbox discards the copy)",
            report.acks_in_doubt
        ));
    }
    Some(if report.connection_lost {
        crate::error::Error::BrokerUnavailable {
            url: broker.display_url(),
            reason: format!("{reason}; {done}"),
        }
    } else if report.refused {
        crate::error::Error::PrivilegeRefused {
            service: "RabbitMQ",
            reason: format!("{reason}; {done}"),
            fix: "grant the user the permission with `rabbitmqctl set_permissions` (docs/security.md lists \
                  what each command needs)"
                .to_owned(),
        }
    } else {
        crate::error::Error::Topology(format!("{reason}; {done}"))
    })
}

/// Writes the replay to the audit: what it replayed, from where, of which group.
async fn audit(
    global: &GlobalOpts,
    plan: &Plan,
    report: &Result<Report>,
    stopped: Option<&crate::error::Error>,
) {
    let mut details = serde_json::json!({
        "from": plan.from,
        "to": plan.to,
        "rate": plan.rate,
    });
    if let (Ok(r), serde_json::Value::Object(map)) = (report, &mut details) {
        for (key, value) in [
            ("snapshot", serde_json::json!(r.snapshot)),
            ("replayed", serde_json::json!(r.replayed)),
            ("left", serde_json::json!(r.left)),
            ("stopped", serde_json::json!(r.stopped)),
            ("interrupted", serde_json::json!(r.interrupted)),
            (
                "group",
                serde_json::json!(r.group.as_ref().map(|g| serde_json::json!({
                    "fingerprint": g.fingerprint,
                    "listed": g.listed,
                    "gone": g.gone.len(),
                    "changed": g.changed.len(),
                    "new": g.new,
                }))),
            ),
        ] {
            map.insert(key.to_owned(), value);
        }
    }
    let mut entry = crate::audit::Entry::ended("replay", report, Report::outcome, details);
    if let Some(e) = stopped {
        entry.outcome = "failed";
        entry.exit_code = Some(i32::from(e.exit_code()));
    }
    match global.connect.database() {
        Ok(db) => {
            crate::audit::record_within(&db, &entry, AFTER_THE_REPLAY).await;
        }
        Err(e) => tracing::warn!("this replay was not written to the audit: {e}"),
    }
}

/// The group `--group` names in the listing of `--listing`, which must be a listing of `--from` in `vhost`.
fn group_plan(
    from: &str,
    vhost: &str,
    fingerprint: &str,
    path: &std::path::Path,
) -> Result<replay::GroupPlan> {
    let listing = crate::triage::Listing::read(path)?;
    if listing.vhost != vhost {
        return Err(crate::error::Error::Usage(format!(
            "{} is a listing of {} in vhost {:?}, not in the vhost connected to, {:?}: its members are other \
             messages",
            path.display(),
            sanitize::text(&listing.queue),
            sanitize::text(&listing.vhost),
            sanitize::text(vhost)
        )));
    }
    if listing.queue != from {
        return Err(crate::error::Error::Usage(format!(
            "{} is a listing of {}, not of --from {}",
            path.display(),
            sanitize::text(&listing.queue),
            sanitize::text(from)
        )));
    }
    let group = listing.group(fingerprint)?;
    // The group of the causes past the listing's first ones: its members have causes of their own, none of which is
    // its fingerprint, so a replay of it would replay nothing and call every member changed.
    if group.cause.fingerprint == crate::triage::failures::OTHER_CAUSES {
        return Err(crate::error::Error::Usage(format!(
            "--group {}: this group gathers the causes past the listing's first {}; replay its members by id \
             (--message-id) or by reason (--reason)",
            crate::triage::failures::OTHER_CAUSES,
            crate::triage::failures::MAX_GROUPS
        )));
    }
    Ok(replay::GroupPlan::of(&listing, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(left: u64, in_queue_after: Option<u64>) -> Report {
        Report {
            replayed: 5 - left,
            left,
            in_queue_after,
            ..Report::begun("orders_error".to_owned(), false, 5)
        }
    }

    #[test]
    fn the_summary_says_what_is_in_the_queue_after_beyond_what_the_replay_left() {
        let said = "in the queue now";
        let two = summary(&report(0, Some(2)));
        assert!(two.contains("; 2 in the queue now"), "{two}");
        assert!(
            two.contains("its own replayed messages failing again")
                && two.contains("failures --from"),
            "what they may be, and to look before replaying: {two}"
        );
        assert!(summary(&report(1, Some(3))).contains("; 3 in the queue now"));
        assert!(
            !summary(&report(2, Some(2))).contains(said),
            "only what it left"
        );
        assert!(!summary(&report(0, Some(0))).contains(said));
        assert!(!summary(&report(0, None)).contains(said), "not looked at");
    }

    /// Interrupted by a stop asked for, with an acknowledgement of an earlier loss still in doubt: said.
    #[test]
    fn an_interrupted_replay_says_the_acknowledgements_in_doubt() {
        let mut r = report(0, None);
        r.interrupted = true;
        let said = "the acknowledgement of 1 replayed message(s) is not known to have arrived";
        assert!(!summary(&r).contains(said));
        r.acks_in_doubt = 1;
        let with = summary(&r);
        assert!(
            with.contains("interrupted: the rest is where it was") && with.contains(said),
            "{with}"
        );
    }

    /// A replay that went on to its end, a channel having closed under it after an acknowledgement: said too.
    #[test]
    fn a_replay_ended_with_an_acknowledgement_in_doubt_says_so() {
        let mut r = report(0, None);
        r.acks_in_doubt = 1;
        let with = summary(&r);
        assert!(
            with.contains("the acknowledgement of 1 replayed message(s) is not known to have arrived before the channel closed"),
            "{with}"
        );
        assert!(!with.contains("interrupted"), "{with}");
    }
}
