//! Asking the operator before a large replay: on a terminal only, with the count and the groups it would replay.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::amqp::{Broker, Connection};
use crate::error::{Error, Result};
use crate::replay::{self, Action, Plan};
use crate::sanitize;

/// Whether to go on with `plan`: asked on a terminal when it would replay more than `above` messages (found by a dry
/// run of the same plan, which takes nothing); without a terminal there is nobody to ask, and it goes on. Asked and
/// answered yes, or not asked for a count within `above`, `plan` is limited to the messages counted, by count and by
/// id: messages that arrive meanwhile are not replayed unseen (not asked, a burst of failures between the count and
/// the replay went back unasked, however many), nor those past where a count cut short stopped.
pub async fn replay(
    connection: &Connection,
    broker: &Broker,
    plan: &mut Plan,
    above: u64,
    shutdown: &CancellationToken,
) -> Result<bool> {
    if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
        return Ok(true);
    }
    let mut dry = plan.clone();
    dry.dry_run = true;
    dry.rate = None;
    let report = replay::run(
        connection,
        broker,
        &dry,
        Duration::ZERO,
        shutdown,
        |_, _| {},
    )
    .await?;
    if report.connection_lost {
        // The count lost its connection, the one the replay would go on with: it was closed on the way, and a count
        // cut short would ask about part of the replay. (A refusal leaves it open: the replay meets it again and
        // reports it with its own exit code.)
        return Err(Error::BrokerUnavailable {
            url: broker.display_url(),
            reason: format!(
                "counting what would be replayed, before asking, lost the connection: {}",
                report.stopped.unwrap_or_default()
            ),
        });
    }
    let would: Vec<_> = report
        .items
        .iter()
        .filter(|i| i.action == Action::WouldReplay)
        .collect();
    if would.len() as u64 <= above {
        limit_to_counted(plan, &report);
        crate::failpoint::hit("replay-counted").await;
        return Ok(true);
    }
    let mut groups: BTreeMap<&str, (u64, Option<&str>)> = BTreeMap::new();
    for item in &would {
        let entry = groups
            .entry(item.fingerprint.as_str())
            .or_insert((0, item.reason.as_deref()));
        entry.0 += 1;
    }
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.0.cmp(b.0)));
    let mut question = format!(
        "replay {} messages from {} (more than --confirm-above {above})?\n",
        would.len(),
        sanitize::text(&plan.from)
    );
    for (fingerprint, (count, reason)) in &groups {
        question.push_str(&format!(
            "  group {fingerprint}: {count} messages, e.g. {}\n",
            sanitize::text(&crate::amqp::limits::truncate(reason.unwrap_or("-"), 120))
        ));
    }
    question.push_str("replay them? [y/N] ");
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(question.as_bytes());
    let _ = err.flush();
    drop(err);
    let read = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    });
    // Ctrl-C at the question is a no (the blocked read is left to the process's end).
    let answer = tokio::select! {
        () = shutdown.cancelled() => return Ok(false),
        answer = read => answer.map_err(std::io::Error::other)??,
    };
    let yes = matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes");
    if yes {
        limit_to_counted(plan, &report);
    }
    Ok(yes)
}

/// Limits `plan` to what the dry run `counted` chose. Messages that failed after it come after these, at the queue's
/// tail; but one that failed while the dry run looked comes before them on a quorum queue, which puts what the dry run
/// gave back at its tail: the messages counted are those the dry run chose, by id, and as many. The count, as
/// `--limit`, holds every message the selection chose, those left for an obstacle (expired, replayed too often, no
/// origin) too: the limit is what the dry run chose, not only what it would replay.
fn limit_to_counted(plan: &mut Plan, counted: &replay::Report) {
    let chosen: Vec<_> = counted
        .items
        .iter()
        .filter(|i| !matches!(i.action, Action::NotSelected | Action::CopyOfReplayed))
        .collect();
    plan.confirmed = Some(chosen.len() as u64);
    plan.confirmed_ids = Some(
        chosen
            .iter()
            .filter_map(|i| i.message_id.as_deref().map(replay::canonical_id))
            .collect(),
    );
}
