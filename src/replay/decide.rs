//! What one dead-letter copy is, for the decision: where it would go (its origin, or `--to`), whether the plan chose
//! it, and what keeps it where it is.

use super::machine::{Key, Seen};
use super::run::State;
use super::{Action, Failure, Origin, REPLAY_RUN_HEADER, canonical_id, failure, replay_properties};
use crate::amqp::cause::Cause;
use crate::amqp::copy::uncopyable;
use crate::amqp::dead_letter;
use crate::amqp::topology;
use crate::amqp::{Delivery, limits};

/// What one delivery says, for the machine and for the report.
pub(super) struct Read {
    pub(super) seen: Seen,
    pub(super) message_id: Option<String>,
    pub(super) failure: Failure,
    /// Its failure's cause, as `failures` groups them.
    pub(super) fingerprint: String,
    /// Where it would go: `--to`, else its origin's queue.
    pub(super) origin: Option<String>,
    /// Why it cannot be replayed (its origin, or the message itself), for the report.
    pub(super) obstacle_error: Option<String>,
}

impl State<'_> {
    /// Where a message would go (`--to`, else its origin's queue), and if it cannot: why, for the machine and for
    /// the report.
    fn destination(&self, origin: &Origin) -> (Option<String>, Option<Action>, Option<String>) {
        match (&self.plan.to, origin) {
            (Some(to), _) => (Some(to.clone()), None, None),
            // Sent back where it is, it would go round for nothing: reported replayed, its failure's headers gone.
            (None, Origin::Queue(queue)) if *queue == self.plan.from => (
                None,
                Some(Action::OriginAmbiguous),
                Some(format!(
                    "its headers name {} itself as its origin",
                    crate::sanitize::text(queue)
                )),
            ),
            (None, Origin::Queue(queue)) => match topology::not_a_replay_destination(queue) {
                None => (Some(queue.clone()), None, None),
                Some(why) => (
                    None,
                    Some(Action::OriginAmbiguous),
                    Some(format!(
                        "its headers name {} as its origin: {why}",
                        crate::sanitize::text(queue)
                    )),
                ),
            },
            (None, Origin::Unknown) => (None, Some(Action::OriginUnknown), None),
            (None, Origin::Ambiguous { address, why }) => (
                None,
                Some(Action::OriginAmbiguous),
                Some(format!("MT-Fault-InputAddress {address}: {why}")),
            ),
            (None, Origin::OtherVhost { vhost, queue }) => (
                Some(queue.clone()),
                Some(Action::OriginOtherVhost),
                Some(format!(
                    "MT-Fault-InputAddress names vhost {vhost}; the replay is connected to {}",
                    self.vhost
                )),
            ),
        }
    }

    /// Everything the decision needs from one delivery.
    pub(super) fn read(&self, delivery: &Delivery) -> Read {
        let plan = self.plan;
        let headers = delivery.properties.headers().as_ref();
        let message_id = crate::amqp::envelope::keyed_id(&delivery.properties, &delivery.data);
        let failure = failure(headers, &plan.from, &self.vhost);
        let (origin, origin_obstacle, mut obstacle_error) = self.destination(&failure.origin);
        let uncopyable = uncopyable(&delivery.properties, &self.user).or_else(|| {
            // The broker took the original, but the copy carries the replay's headers too: sent, a copy past the
            // frame would close the connection, at this message every time, and nothing behind it would be replayed.
            let copy = replay_properties(
                &delivery.properties,
                failure.replays,
                &self.run,
                plan.restore_expiration,
            );
            let needed = limits::content_header_len(&copy);
            (needed > self.frame_max).then(|| {
                format!(
                    "its replayed copy needs a {needed}-byte header frame (its headers and the replay's), more than \
                     the connection's {}-byte frames",
                    self.frame_max
                )
            })
        });
        let obstacle = if let Some(why) = uncopyable {
            obstacle_error = Some(why);
            Some(Action::Uncopyable)
        } else if plan.max_replays.is_some_and(|max| failure.replays >= max) {
            Some(Action::MaxReplays)
        } else if !plan.include_expired
            // Aged as the cleanup's guard ages it: a copy whose headers say nothing of its failure by when it was
            // published (never after it failed), lest one past the window — its row maybe gone — be taken for new.
            && crate::amqp::failure::failed_at(delivery, &failure)
                .is_some_and(|t| self.now - t > self.window)
        {
            Some(Action::Expired)
        } else {
            origin_obstacle
        };
        let fingerprint = Cause::of(&failure).fingerprint;
        let in_group = match (&plan.group, &self.listed) {
            (Some(group), Some(listed)) => {
                fingerprint == group.fingerprint
                    && !group.failed_since(
                        message_id.as_deref(),
                        failure.failed_at,
                        failure.replays,
                    )
                    && message_id
                        .as_deref()
                        .is_some_and(|id| listed.contains(&canonical_id(id)))
            }
            _ => true,
        };
        let confirmed = plan.confirmed_ids.as_ref().is_none_or(|ids| {
            message_id
                .as_deref()
                .is_none_or(|id| ids.contains(&canonical_id(id)))
        });
        let chosen = in_group
            && confirmed
            && (plan.message_ids.is_empty()
                || message_id
                    .as_ref()
                    .is_some_and(|id| plan.message_ids.iter().any(|m| same_id(m, id))))
            && plan.reason.as_ref().is_none_or(|r| {
                failure
                    .reason
                    .as_ref()
                    .is_some_and(|text| text.contains(r.as_str()))
            });
        // Where it would go, for recognising its copies: nowhere, if its origin cannot be used.
        let destination = origin_obstacle.is_none().then(|| origin.clone()).flatten();
        let key = match &message_id {
            Some(id) => Key::Id {
                id: id.clone(),
                origin: destination.clone(),
            },
            None => Key::Body {
                body: self.fingerprints.body(&delivery.data),
                origin: destination.clone(),
            },
        };
        let from_this_run =
            dead_letter::header_text(headers, REPLAY_RUN_HEADER).as_deref() == Some(&self.run);
        Read {
            seen: Seen {
                content: self.fingerprints.content(delivery),
                key,
                redelivered: delivery.redelivered,
                from_this_run,
                chosen,
                obstacle,
            },
            message_id,
            failure,
            fingerprint,
            origin,
            obstacle_error,
        }
    }
}

/// Message ids compared as UUIDs when both are (any spelling), else as text.
fn same_id(a: &str, b: &str) -> bool {
    match (
        uuid::Uuid::parse_str(a.trim()),
        uuid::Uuid::parse_str(b.trim()),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_compare_as_uuids() {
        assert!(same_id(
            "1A280000-161D-4C08-9E18-08DF4F1E91B6",
            "1a280000161d4c089e1808df4f1e91b6"
        ));
        assert!(!same_id("order-1", "order-2"));
    }
}
