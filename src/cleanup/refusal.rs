//! Why the cleanup's guard left a consumer_type's rows (a dead-lettered message waiting for its replay, a replay
//! running, a queue it could not look at), and what it says of it.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// Why a consumer_type was not cleaned.
#[derive(Debug, Clone, Serialize)]
pub struct Refusal {
    /// The dead-letter queue holding the message.
    pub queue: String,
    pub message_id: Option<String>,
    /// When it failed, as its headers say (else when it was published, else sent); none when nothing says.
    pub failed_at: Option<DateTime<Utc>>,
    /// Its age, in seconds, when the cleanup looked.
    pub age_seconds: Option<i64>,
    /// On a partitioned inbox, the message's own time, the one its claim is keyed on (its partition's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_time: Option<DateTime<Utc>>,
    pub cutoff: DateTime<Utc>,
    /// A replay of the queue was running: the messages it holds cannot be looked at (no message is named then).
    pub replay_running: bool,
    /// Another look at the queue (`find`, `failures`, `top`'s detail, another cleanup) held its messages out of sight
    /// for as long as the cleanup waited, or whether one did could not be read (no message is named then).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub looked_at_elsewhere: bool,
    /// The queue held more messages than the guard looks at (10,000), none of those it looked at too old: whether one
    /// further on is, it cannot tell (no message is named then).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub beyond_the_look: bool,
    /// Another client consumed the queue (this many consumers: a fault monitor, a shovel, a script): the messages it
    /// holds unacknowledged are out of the cleanup's sight (no message is named then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumers: Option<u32>,
    /// The queue (a `--dlq`) is not in the vhost the cleanup looked in: whether a message waits in it is unknown.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub absent: bool,
    /// The vhost the consumer_type's consumer reads its queue in, another than the cleanup's, when the cleanup could
    /// not look there (no message is named then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other_vhost: Option<OtherVhost>,
}

/// A vhost the cleanup could not look in, and why.
#[derive(Debug, Clone, Serialize)]
pub struct OtherVhost {
    pub vhost: String,
    pub why: String,
}

impl Refusal {
    /// A refusal on account of `queue`, naming no message (the fields that say why are set by the caller).
    pub(super) fn of(queue: &str, cutoff: DateTime<Utc>) -> Self {
        Refusal {
            queue: queue.to_owned(),
            message_id: None,
            failed_at: None,
            age_seconds: None,
            message_time: None,
            cutoff,
            replay_running: false,
            looked_at_elsewhere: false,
            beyond_the_look: false,
            consumers: None,
            absent: false,
            other_vhost: None,
        }
    }

    /// One line for the operator.
    pub fn describe(&self) -> String {
        if let Some(other) = &self.other_vhost {
            return format!(
                "its consumer reads its queue in vhost {}, where the cleanup could not look at its dead-letter \
                 queues (such as {}): {}; their replay may need their inbox rows; let this user read them there, or \
                 give --force",
                crate::sanitize::text(&other.vhost),
                crate::sanitize::text(&self.queue),
                crate::sanitize::text(&other.why)
            );
        }
        if self.absent {
            return format!(
                "--dlq {} is not in the vhost the cleanup looked in (a name mistyped, another vhost, a queue being \
                 made again): whether a message waits in it for its replay is unknown; fix --dlq, or give --force",
                crate::sanitize::text(&self.queue)
            );
        }
        if self.beyond_the_look {
            return format!(
                "{} holds more messages than the cleanup looks at (10,000), and none of those it looked at failed \
                 before the cutoff: whether one further on did, it cannot tell (on a quorum queue the ones looked at \
                 go behind the rest); replay or remove them first, or give --force",
                crate::sanitize::text(&self.queue)
            );
        }
        if let Some(consumers) = self.consumers {
            return format!(
                "{} has {consumers} consumer(s) of another client (a fault monitor, a shovel, a script): the messages \
                 it holds unacknowledged are out of the cleanup's sight, and one of them may wait for its replay; \
                 stop it, or give --force",
                crate::sanitize::text(&self.queue)
            );
        }
        if self.looked_at_elsewhere {
            return format!(
                "another look at {} (inboxctl find, failures, top's detail, or another cleanup) held its messages \
                 out of sight for as long as the cleanup waited (or whether one did could not be read): one of them \
                 may wait for its replay; clean again when it has ended, or give --force",
                crate::sanitize::text(&self.queue)
            );
        }
        if self.replay_running {
            return format!(
                "a replay of {} is running, and the messages it holds cannot be looked at: their replay may need \
                 their inbox rows; clean again when it has ended, or give --force",
                crate::sanitize::text(&self.queue)
            );
        }
        let id = self.message_id.as_deref().unwrap_or("(no message id)");
        let age = match self.age_seconds {
            Some(s) => format!(
                "failed {} ago",
                humantime::format_duration(std::time::Duration::from_secs(s.unsigned_abs()))
            ),
            None => "of an age nothing in it tells".to_owned(),
        };
        // A failure stamped within the margin after the cutoff (a host's clock ahead) is said as such.
        let when = if self.failed_at.is_some_and(|t| t >= self.cutoff) {
            "within five minutes after the cutoff (a failing host's clock may be ahead of the database's)"
        } else {
            "before the cutoff"
        };
        format!(
            "{} holds message {} {age}, {when} {}: its replay needs its inbox row; replay or remove it first, or \
             give --force",
            crate::sanitize::text(&self.queue),
            crate::sanitize::text(id),
            self.cutoff.format("%Y-%m-%d %H:%M:%S UTC")
        )
    }
}
