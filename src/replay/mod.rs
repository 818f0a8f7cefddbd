//! Moving dead-lettered messages back to the queue they failed on, safely.
//!
//! - **A fixed snapshot.** The messages present when the replay starts (their count, read first) are taken one by one
//!   and held unacknowledged, so a message that fails again and lands back in the dead-letter queue is never taken
//!   again by the same run (its copy carries the run's tag); what is not replayed is given back at the end, in its
//!   original order.
//! - **Nothing lost.** Each copy is published with publisher confirms (and `mandatory`, so a queue that does not
//!   exist is an error, not a silent drop); the dead-letter copy is acknowledged only after the broker confirmed a
//!   copy with the same content on its origin (see [`machine`]). A crash between the two leaves the message in both
//!   queues: the inbox discards the second copy.
//! - **Nothing repeated.** Body, properties and message id are republished untouched (a MassTransit envelope stays
//!   byte for byte), so the inbox recognises a message that had in fact been processed. Only the failure headers are
//!   dropped, a replay count of inboxctl's own is kept, and the per-message TTL (`expiration`) is left out unless
//!   asked for: the copy must not expire on its way back.
//! - **Within the window.** The inbox deduplicates only while a message's row exists: a message that failed longer
//!   ago than the cleanup retention may have lost its row, so replaying it could repeat its effect; such messages are
//!   left where they are unless asked for.
//! - **Never a guess at the origin.** An address that cannot be read without guessing, that names another vhost, or
//!   a queue that does not exist: the message stays, and the report says why.
//!
//! Dead-letter shapes understood: MassTransit's `<queue>_error` and `<queue>_skipped` (origin in
//! `MT-Fault-InputAddress`, else the queue name) and RabbitMQ dead-letter-exchange queues (origin in `x-death`).

mod decide;
mod machine;
mod republish;
mod run;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

pub use crate::amqp::copy::{
    REPLAY_COUNT_HEADER, REPLAY_RUN_HEADER, original_expiration, replay_headers, replay_properties,
};
pub use crate::amqp::failure::{Failure, Origin, failure};
pub use run::run;

/// What to replay.
#[derive(Debug, Clone)]
pub struct Plan {
    pub from: String,
    /// Where every message goes, whatever its headers say.
    pub to: Option<String>,
    /// Replay at most this many messages.
    pub limit: Option<u64>,
    /// How many messages an operator confirmed after the dry run: at most these are replayed, as with `limit`, but
    /// the replay is still one of everything, which says what it could not reach (`unreached`).
    pub confirmed: Option<u64>,
    /// After a yes, too: the ids (by [`canonical_id`]) of the messages the dry run chose. A message whose id is not
    /// among them is not one the operator saw — it failed while the dry run looked, and on a quorum queue, where what
    /// the dry run gave back went to the tail, it comes first — and is not chosen. Messages without an id are bound by
    /// `confirmed` alone.
    pub confirmed_ids: Option<std::collections::HashSet<String>>,
    /// Only these message ids (empty: all).
    pub message_ids: Vec<String>,
    /// Only messages whose failure reason contains this text.
    pub reason: Option<String>,
    /// Leave messages already replayed this many times.
    pub max_replays: Option<u32>,
    /// The inbox cleanup's retention: older failures are left unless `include_expired`.
    pub retention: Duration,
    pub include_expired: bool,
    /// Give each copy back the per-message TTL it had before it was dead-lettered.
    pub restore_expiration: bool,
    pub dry_run: bool,
    /// Only the members of this group of a `failures` listing, as listed.
    pub group: Option<GroupPlan>,
    /// Republish at most this many messages a second.
    pub rate: Option<f64>,
    /// How long a call to the broker may wait for its answer before the connection is given up (and made again).
    pub broker_timeout: Duration,
}

/// A group of a `failures` listing, to replay as it was listed.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    pub fingerprint: String,
    /// The members' message ids, as listed.
    pub listed: Vec<String>,
    /// When each member failed, as the listing read it (by [`canonical_id`]). A copy of a listed id that failed
    /// after its member is a failure since (the member's replayed copy failing again, say), not the member the
    /// operator saw: it is left, and counted as new.
    pub member_failed_at: std::collections::BTreeMap<String, DateTime<Utc>>,
    /// How many times each member had been replayed, as the listing read it (by [`canonical_id`]; of two listed copies
    /// of one id, the more often replayed). A copy of a listed id replayed more often is a failure since: the member
    /// replayed, and failed again. It tells where no failure time does (a `_skipped` copy carries none).
    pub member_replays: std::collections::BTreeMap<String, u32>,
    /// For a member whose failure time the listing does not hold: the newest failure among the members (else when the
    /// listing was taken).
    pub failed_until: Option<DateTime<Utc>>,
}

impl GroupPlan {
    /// The group `group` of `listing`, to replay. Failure times are the failing host's or the broker's: a copy's is
    /// compared with its own member's (the same clock wrote both), not with when the listing was taken (this
    /// machine's) — a consumer host's clock ahead of the operator's made the members of the last minutes "failed
    /// since": left, and reported gone from the queue — nor with the group's newest (one member's clock ahead would
    /// make a later failure of another member the member itself).
    pub fn of(listing: &crate::triage::Listing, group: &crate::triage::Group) -> Self {
        // Of two listed copies of one id, the later failure: both are members.
        let mut member_failed_at = std::collections::BTreeMap::new();
        if group.failed_at.len() == group.message_ids.len() {
            for (id, at) in group.message_ids.iter().zip(&group.failed_at) {
                if let Some(at) = *at {
                    member_failed_at
                        .entry(canonical_id(id))
                        .and_modify(|t: &mut DateTime<Utc>| *t = (*t).max(at))
                        .or_insert(at);
                }
            }
        }
        let mut member_replays = std::collections::BTreeMap::new();
        if group.replays.len() == group.message_ids.len() {
            for (id, replays) in group.message_ids.iter().zip(&group.replays) {
                member_replays
                    .entry(canonical_id(id))
                    .and_modify(|n: &mut u32| *n = (*n).max(*replays))
                    .or_insert(*replays);
            }
        }
        Self {
            fingerprint: group.cause.fingerprint.clone(),
            listed: group.message_ids.clone(),
            member_failed_at,
            member_replays,
            failed_until: Some(group.last_failed_at.unwrap_or(listing.listed_at)),
        }
    }

    /// Whether a copy of `id` that failed at `failed_at`, replayed `replays` times before, failed after its member was
    /// listed: it failed later than its member, or was replayed more often (a time nothing tells and a count the
    /// listing does not hold: not after).
    pub(crate) fn failed_since(
        &self,
        id: Option<&str>,
        failed_at: Option<DateTime<Utc>>,
        replays: u32,
    ) -> bool {
        let id = id.map(canonical_id);
        let member = id
            .as_ref()
            .and_then(|id| self.member_failed_at.get(id).copied());
        let later = matches!(
            (failed_at, member.or(self.failed_until)),
            (Some(failed), Some(until)) if failed > until
        );
        let replayed_since = id
            .as_ref()
            .and_then(|id| self.member_replays.get(id))
            .is_some_and(|listed| replays > *listed);
        later || replayed_since
    }

    /// The listed ids, each in the one spelling [`canonical_id`] gives.
    pub(crate) fn listed_set(&self) -> std::collections::HashSet<String> {
        self.listed.iter().map(|id| canonical_id(id)).collect()
    }
}

/// A message id in one spelling: a UUID as lower-case hyphenated (however it was written), anything else as it is.
pub fn canonical_id(id: &str) -> String {
    uuid::Uuid::parse_str(id.trim()).map_or_else(|_| id.to_owned(), |u| u.to_string())
}

/// How a group replay compares with its listing.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GroupCheck {
    pub fingerprint: String,
    /// Members in the listing.
    pub listed: u64,
    /// Listed members no longer in the queue (replayed or removed since the listing). Only known of a replay that
    /// went through its whole snapshot: one interrupted or stopped did not meet every member, and says none gone.
    pub gone: Vec<String>,
    /// Listed members still in the queue but failed of another cause now: left in place.
    pub changed: Vec<String>,
    /// Messages of the group's cause that arrived after the listing (or were not listed): left in place.
    pub new: u64,
}

/// What became of one message of the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Replayed,
    WouldReplay,
    /// Not chosen by `--message-id`, `--reason` or `--limit`; left in place.
    NotSelected,
    /// Failed longer ago than the retention; left in place.
    Expired,
    /// Already replayed `--max-replays` times; left in place.
    MaxReplays,
    /// No `--to`, and neither headers nor queue name tell where it came from; left in place.
    OriginUnknown,
    /// No `--to`, and its `MT-Fault-InputAddress` cannot be read without guessing; left in place.
    OriginAmbiguous,
    /// No `--to`, and its origin is in another vhost than the one the replay is connected to; left in place.
    OriginOtherVhost,
    /// Its origin queue does not exist (checked first, or the copy came back unroutable); left in place.
    OriginMissing,
    /// The broker refused the copy; left in place.
    PublishFailed,
    /// A copy of a message this run already sent to the same origin (a second copy in the queue, or the first back
    /// again without its replay count); left in place.
    CopyOfReplayed,
    /// It cannot be republished as it is (headers nested deeper than inboxctl reads, a `user_id` of another user
    /// the broker would refuse); left in place.
    Uncopyable,
}

impl Action {
    /// Whether leaving the message is something the operator should hear about (not their own filter).
    pub fn is_problem(self) -> bool {
        !matches!(
            self,
            Action::Replayed | Action::WouldReplay | Action::NotSelected
        )
    }

    pub fn describe(self) -> &'static str {
        match self {
            Action::Replayed => "replayed",
            Action::WouldReplay => "would replay",
            Action::NotSelected => "not selected",
            Action::Expired => "left: failed before the retention window",
            Action::MaxReplays => "left: replayed too often",
            Action::OriginUnknown => "left: origin unknown (use --to)",
            Action::OriginAmbiguous => "left: origin address ambiguous (use --to)",
            Action::OriginOtherVhost => "left: origin in another vhost (replay from there)",
            Action::OriginMissing => "left: origin queue does not exist",
            Action::PublishFailed => "left: republish failed",
            Action::CopyOfReplayed => "left: a copy of a message this run already replayed",
            Action::Uncopyable => "left: cannot be republished as it is",
        }
    }
}

/// One message of the snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub message_id: Option<String>,
    pub reason: Option<String>,
    pub failed_at: Option<DateTime<Utc>>,
    pub origin: Option<String>,
    /// Replays before this one.
    pub replays: u32,
    /// The fingerprint of its failure's cause (as `failures` groups them).
    pub fingerprint: String,
    pub action: Action,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub from: String,
    pub dry_run: bool,
    /// Messages in the queue when the replay started.
    pub snapshot: u64,
    pub replayed: u64,
    /// Left in place for a reason the operator should know (expired, replayed too often, origin unknown, refused).
    pub left: u64,
    pub interrupted: bool,
    /// Times the connection was lost and made again.
    pub reconnects: u32,
    /// Dead-letter copies acknowledged without being sent again: an identical copy had been republished with the
    /// broker's confirm, and the acknowledgement that followed was lost with the connection.
    pub already_replayed: u64,
    /// Why the replay stopped early on an error: the connection lost and not back in time, or the broker refusing
    /// something. What was done before is in `items`; the rest is where it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Whether `stopped` is a lost connection (as opposed to a refusal).
    pub connection_lost: bool,
    /// When it stopped on a lost connection: replayed messages whose dead-letter copy's acknowledgement is not known
    /// to have arrived before it was lost. Each may still be in the dead-letter queue beside its replayed copy; a
    /// second replay sends it again, and the inbox discards the copy.
    pub acks_in_doubt: u64,
    /// Whether `stopped` is the broker refusing for want of a permission (exit 77).
    #[serde(skip)]
    pub refused: bool,
    /// Messages of the snapshot the replay never met: the queue ran dry before its count (another client took them,
    /// or holds them unacknowledged — a look of `failures` or `find` running now). They were not replayed.
    pub unreached: u64,
    /// Messages ready in the queue once the replay ended (not counted on a dry run, or when the look failed): what it
    /// left, what arrived since it began, and what another client held unacknowledged when it began — which the
    /// replay could not see, and did not replay. The messages it left may not be back yet when it looks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_queue_after: Option<u64>,
    /// `--message-id`s no message of its whole snapshot both carried and was chosen by: not in the queue while it
    /// ran (replayed or removed already, mistyped, held unacknowledged by another client), or not chosen by the
    /// other filters (`--reason`, `--group`, past `--limit`). Only known of a replay that went through its whole
    /// snapshot.
    pub unmatched: Vec<String>,
    /// With `--group`: how the queue compared with the listing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupCheck>,
    /// The most times a message the replay met had been delivered before (`x-delivery-count`), when 10 or more
    /// ([`crate::amqp::peek::WORN`]): on a quorum queue every message a replay gives back (a dry run's, or one not
    /// chosen) is a delivery more, which RabbitMQ 4.0–4.2 drop past their delivery limit (20 by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub most_deliveries: Option<u32>,
    pub items: Vec<Item>,
}

impl Report {
    /// The report of a replay of `from` that counted `snapshot` messages and has done nothing yet.
    pub(crate) fn begun(from: String, dry_run: bool, snapshot: u64) -> Self {
        Self {
            from,
            dry_run,
            snapshot,
            replayed: 0,
            left: 0,
            interrupted: false,
            reconnects: 0,
            already_replayed: 0,
            stopped: None,
            connection_lost: false,
            acks_in_doubt: 0,
            refused: false,
            unreached: 0,
            in_queue_after: None,
            unmatched: Vec::new(),
            group: None,
            most_deliveries: None,
            items: Vec::new(),
        }
    }

    /// Partial (exit 3) when anything of the snapshot was not replayed for a reason the operator should know: it
    /// stopped, was interrupted, left messages, did not meet some, or the group drifted from its listing.
    pub fn outcome(&self) -> crate::error::Outcome {
        let group_drifted = self
            .group
            .as_ref()
            .is_some_and(|g| !g.gone.is_empty() || !g.changed.is_empty());
        if self.stopped.is_some()
            || self.interrupted
            || self.left > 0
            || self.unreached > 0
            || !self.unmatched.is_empty()
            || group_drifted
        {
            crate::error::Outcome::Partial
        } else {
            crate::error::Outcome::Done
        }
    }

    /// The ids of `asked` (`--message-id`) that no message the replay chose carries, each as asked (once).
    pub(crate) fn ids_unmatched(&self, asked: &[String]) -> Vec<String> {
        let met: std::collections::HashSet<String> = self
            .items
            .iter()
            .filter(|i| i.action != Action::NotSelected)
            .filter_map(|i| i.message_id.as_deref().map(canonical_id))
            .collect();
        let mut seen = std::collections::HashSet::new();
        asked
            .iter()
            .filter(|id| !met.contains(&canonical_id(id)) && seen.insert(canonical_id(id)))
            .cloned()
            .collect()
    }

    /// Compares what the replay met with the group's listing; `whole`: it went through its whole snapshot (not
    /// interrupted, not stopped), so a listed member it did not meet is gone.
    pub(crate) fn check_group(&self, group: &GroupPlan, whole: bool) -> GroupCheck {
        let listed = group.listed_set();
        // Each id's item; of two copies of one id, the one of the group's cause (the member replayed), not whichever
        // came last. A copy that failed after the listing is not the listed member (it is counted as new).
        let mut seen: std::collections::HashMap<String, &Item> = std::collections::HashMap::new();
        for item in self
            .items
            .iter()
            .filter(|i| !group.failed_since(i.message_id.as_deref(), i.failed_at, i.replays))
        {
            let Some(id) = item.message_id.as_deref() else {
                continue;
            };
            let entry = seen.entry(canonical_id(id)).or_insert(item);
            if entry.fingerprint != group.fingerprint {
                *entry = item;
            }
        }
        let mut check = GroupCheck {
            fingerprint: group.fingerprint.clone(),
            listed: group.listed.len() as u64,
            ..GroupCheck::default()
        };
        for id in &group.listed {
            match seen.get(&canonical_id(id)) {
                None if whole => check.gone.push(id.clone()),
                None => {}
                Some(item) if item.fingerprint != group.fingerprint => {
                    check.changed.push(id.clone())
                }
                Some(_) => {}
            }
        }
        check.new = self
            .items
            .iter()
            .filter(|i| {
                i.fingerprint == group.fingerprint
                    && (group.failed_since(i.message_id.as_deref(), i.failed_at, i.replays)
                        || i.message_id
                            .as_deref()
                            .is_none_or(|id| !listed.contains(&canonical_id(id))))
            })
            .count() as u64;
        check
    }
}
