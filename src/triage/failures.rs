//! `failures`: the messages of a dead-letter queue grouped by the cause of their failure (see
//! [`crate::amqp::cause`]), as they are at the moment of the listing. The listing, written to a file, is what
//! `replay --group` replays: the members the operator saw, not whatever has arrived since.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::amqp::cause::Cause;
use crate::amqp::failure::{Origin, failure};
use crate::amqp::{Connection, limits, peek, topology};
use crate::error::{Error, Result};

/// The most origins kept per group: more than a handful means the cause is not the queue's.
const MAX_ORIGINS: usize = 16;

/// The most groups listed: past them, messages of further causes are counted in one group of their own (a queue of
/// hostile messages, each with a cause of its own, must not make one group per message).
pub const MAX_GROUPS: usize = 10_000;

/// The fingerprint of that last group.
pub const OTHER_CAUSES: &str = "other";

/// The longest example reason kept per group.
const MAX_EXAMPLE: usize = 300;

/// The format of a listing file, so that a later inboxctl can tell an older one. Format 1 named each member by its
/// AMQP message id; format 2 by the id its consumer keyed it on ([`crate::amqp::envelope::keyed_id`]), which differs
/// where the property is unset or another than the envelope's: read as format 2, a format 1 listing would leave such
/// a member, and report it gone while it is still in the queue.
pub const LISTING_FORMAT: u32 = 2;

/// One cause, and the messages that failed of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Group {
    #[serde(flatten)]
    pub cause: Cause,
    /// The reason of its first member, unmasked (cut short).
    pub example: Option<String>,
    pub count: u64,
    pub first_failed_at: Option<DateTime<Utc>>,
    pub last_failed_at: Option<DateTime<Utc>>,
    /// The queues its members failed on.
    pub origins: Vec<String>,
    /// Its members' message ids, in queue order (in a listing file; left out of `--json` on stdout).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub message_ids: Vec<String>,
    /// When each of `message_ids` failed, as its headers say (in a listing file): a later copy of a member is known
    /// for a failure since by its own member's time, on the clock that wrote both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_at: Vec<Option<DateTime<Utc>>>,
    /// How many times each of `message_ids` had been replayed (in a listing file): a later copy of a member replayed
    /// more often is a failure since, also where no failure time tells (a `_skipped` copy has none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replays: Vec<u32>,
    /// Members without a message id: they cannot be chosen by id.
    pub without_id: u64,
}

/// A dead-letter queue's failures, grouped, as they were when it was listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Listing {
    pub format: u32,
    pub queue: String,
    pub vhost: String,
    pub listed_at: DateTime<Utc>,
    /// Messages ready in the queue when the listing began.
    pub depth: u64,
    /// Messages looked at (the depth, or the limit).
    pub looked: u64,
    /// A replay of the queue was running while it was looked at: the messages it held were not there to be seen, and
    /// are in no group.
    #[serde(default)]
    pub replay_running: bool,
    /// Another look at the queue (`find`, `failures`, `top`'s detail, a cleanup's guard) held messages while this one
    /// looked: those it held may be in no group.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub looked_at_elsewhere: bool,
    /// The most times a message looked at had been delivered before (`x-delivery-count`, a quorum queue's), when it
    /// nears a delivery limit ([`crate::amqp::peek::WORN`] or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub most_deliveries: Option<u32>,
    /// Groups, the largest first.
    pub groups: Vec<Group>,
}

impl Listing {
    /// The group with this fingerprint (or a unique prefix of it, of at least 4 digits).
    pub fn group(&self, fingerprint: &str) -> Result<&Group> {
        let fingerprint = fingerprint.trim().to_ascii_lowercase();
        let matching: Vec<&Group> = self
            .groups
            .iter()
            .filter(|g| {
                g.cause.fingerprint == fingerprint
                    || (fingerprint.len() >= 4 && g.cause.fingerprint.starts_with(&fingerprint))
            })
            .collect();
        match matching.as_slice() {
            [one] => Ok(one),
            [] => Err(Error::Usage(format!(
                "the listing of {} has no group {}; its groups: {}",
                crate::sanitize::text(&self.queue),
                crate::sanitize::text(&fingerprint),
                self.groups
                    .iter()
                    .map(|g| g.cause.fingerprint.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
            _ => Err(Error::Usage(format!(
                "{} names more than one group of the listing; give more of the fingerprint",
                crate::sanitize::text(&fingerprint)
            ))),
        }
    }

    /// Reads a listing file written by `failures --output`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Usage(format!("cannot read the listing {}: {e}", path.display()))
        })?;
        let listing: Self = serde_json::from_str(&text).map_err(|e| {
            Error::Usage(format!(
                "{} is not a listing written by `inboxctl failures --output`: {e}",
                path.display()
            ))
        })?;
        if listing.format != LISTING_FORMAT {
            return Err(Error::Usage(format!(
                "{} is a listing of format {}; this inboxctl reads format {LISTING_FORMAT} (it names members by the \
                 ids their consumers keyed them on): list the queue again with `failures --output`",
                path.display(),
                listing.format
            )));
        }
        // A fingerprint is hex, or the group of other causes' (`failures` writes them so); any other text in a file
        // someone else may have written is refused rather than printed.
        if let Some(bad) = listing.groups.iter().find(|g| {
            let f = &g.cause.fingerprint;
            f != OTHER_CAUSES && (f.is_empty() || !f.bytes().all(|b| b.is_ascii_hexdigit()))
        }) {
            return Err(Error::Usage(format!(
                "{} is not a listing written by `inboxctl failures --output`: a group's fingerprint is not hex ({})",
                path.display(),
                crate::sanitize::text(&bad.cause.fingerprint)
            )));
        }
        Ok(listing)
    }

    /// Writes the listing, member ids included, for `replay --group`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Usage(format!("cannot write the listing: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| Error::Usage(format!("cannot write the listing {}: {e}", path.display())))
    }

    /// The listing without member ids, for stdout.
    pub fn without_ids(&self) -> Self {
        let mut short = self.clone();
        for g in &mut short.groups {
            g.message_ids = Vec::new();
            g.failed_at = Vec::new();
            g.replays = Vec::new();
        }
        short
    }
}

/// Lists the failures of `queue` (at most `limit` messages), grouped by cause; `vhost` is the one connected to, for
/// reading origins. The queue must exist.
pub async fn list(
    connection: &Connection,
    queue: &str,
    vhost: &str,
    limit: u64,
    within: std::time::Duration,
) -> Result<Listing> {
    let listed_at = Utc::now();
    // Before the look and after it: a replay beginning in between marks the queue before it takes.
    let running = || {
        crate::amqp::answered(
            "a look for a replay's marker",
            within,
            topology::replay_running(connection, queue),
        )
    };
    let mut replay_running = running().await??;
    let mut groups: Vec<Group> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut origins: Vec<BTreeSet<String>> = Vec::new();
    let looked = peek::each(connection, queue, limit, within, |delivery| {
        let failure = failure(delivery.properties.headers().as_ref(), queue, vhost);
        let mut cause = Cause::of(&failure);
        if groups.len() >= MAX_GROUPS && !index.contains_key(&cause.fingerprint) {
            cause = Cause {
                fingerprint: OTHER_CAUSES.to_owned(),
                exception_type: format!("(causes beyond the first {MAX_GROUPS})"),
                reason: "-".to_owned(),
            };
        }
        let i = *index.entry(cause.fingerprint.clone()).or_insert_with(|| {
            groups.push(Group {
                // Another service's fault text may quote a URL with its password: masked, as inboxctl's own.
                example: failure
                    .reason
                    .as_deref()
                    .map(|r| crate::redact::text_cut(r, MAX_EXAMPLE)),
                cause,
                count: 0,
                first_failed_at: None,
                last_failed_at: None,
                origins: Vec::new(),
                message_ids: Vec::new(),
                failed_at: Vec::new(),
                replays: Vec::new(),
                without_id: 0,
            });
            origins.push(BTreeSet::new());
            groups.len() - 1
        });
        let group = &mut groups[i];
        group.count += 1;
        if let Some(at) = failure.failed_at {
            group.first_failed_at = Some(group.first_failed_at.map_or(at, |t| t.min(at)));
            group.last_failed_at = Some(group.last_failed_at.map_or(at, |t| t.max(at)));
        }
        match crate::amqp::envelope::keyed_id(&delivery.properties, &delivery.data) {
            Some(id) => {
                group
                    .message_ids
                    .push(limits::truncate(&id, 255).into_owned());
                group.failed_at.push(failure.failed_at);
                group.replays.push(failure.replays);
            }
            None => group.without_id += 1,
        }
        if origins[i].len() < MAX_ORIGINS {
            origins[i].insert(origin_name(&failure.origin));
        }
    })
    .await?
    .ok_or_else(|| Error::QueueNotFound(queue.to_owned()))?;
    replay_running = replay_running || running().await??;
    for (group, origins) in groups.iter_mut().zip(origins) {
        group.origins = origins.into_iter().collect();
    }
    groups.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.cause.fingerprint.cmp(&b.cause.fingerprint))
    });
    Ok(Listing {
        format: LISTING_FORMAT,
        queue: queue.to_owned(),
        vhost: vhost.to_owned(),
        listed_at,
        depth: looked.depth,
        looked: looked.looked,
        replay_running,
        looked_at_elsewhere: looked.crowded,
        most_deliveries: looked
            .most_deliveries
            .filter(|&n| n >= crate::amqp::peek::WORN),
        groups,
    })
}

/// An origin as a listing shows it.
pub fn origin_name(origin: &Origin) -> String {
    match origin {
        Origin::Queue(q) => q.clone(),
        Origin::OtherVhost { vhost, queue } => format!("{queue} (vhost {vhost})"),
        Origin::Unknown => "-".to_owned(),
        Origin::Ambiguous { address, .. } => format!("{address} (ambiguous)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing someone else may have written: a fingerprint that is not hex (here an escape sequence that would
    /// retitle the terminal in the replay's summary) is refused, shown inert.
    #[test]
    fn a_listing_whose_fingerprint_is_not_hex_is_refused() {
        let listing = |fingerprint: &str| {
            serde_json::json!({
                "format": LISTING_FORMAT, "queue": "q_error", "vhost": "/", "listed_at": "2026-12-05T00:00:00Z",
                "depth": 1, "looked": 1,
                "groups": [{
                    "fingerprint": fingerprint, "exception_type": "-", "reason": "-", "example": null, "count": 1,
                    "first_failed_at": null, "last_failed_at": null, "origins": [], "without_id": 0
                }]
            })
        };
        let path =
            std::env::temp_dir().join(format!("inboxctl-listing-{}.json", uuid::Uuid::new_v4()));
        for fine in ["99adf73960", OTHER_CAUSES] {
            std::fs::write(&path, listing(fine).to_string()).unwrap();
            assert!(Listing::read(&path).is_ok(), "{fine}");
        }
        std::fs::write(&path, listing("99adf73960\u{1b}]0;x\u{7}").to_string()).unwrap();
        let refused = Listing::read(&path).expect_err("refused").to_string();
        let _ = std::fs::remove_file(&path);
        assert!(refused.contains("not hex"), "{refused}");
        assert!(!refused.contains('\u{1b}'), "{refused}");
    }

    /// A listing of an older inboxctl named its members by their AMQP message ids: read as today's, a member whose
    /// consumer keyed it on its envelope's id would be left and reported gone. Refused, saying to list again.
    #[test]
    fn a_listing_that_names_members_by_their_amqp_ids_is_refused() {
        let path =
            std::env::temp_dir().join(format!("inboxctl-listing-{}.json", uuid::Uuid::new_v4()));
        let older = serde_json::json!({
            "format": 1, "queue": "q_error", "vhost": "/", "listed_at": "2026-12-05T00:00:00Z",
            "depth": 0, "looked": 0, "groups": []
        });
        std::fs::write(&path, older.to_string()).unwrap();
        let refused = Listing::read(&path).expect_err("refused").to_string();
        let _ = std::fs::remove_file(&path);
        assert!(refused.contains("list the queue again"), "{refused}");
    }
}
