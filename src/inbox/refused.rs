//! Why a claim is refused: a message with no time to key it on (a partitioned inbox), or one whose time no partition
//! holds — the message's fault, or, when the partitions ahead ran out, the database's state, held like an outage.

use uuid::Uuid;

use super::{Carried, Fingerprint, Inbox, Keying, ProcessError, time};
use crate::db;
use crate::failpoint;

impl Inbox {
    /// The claim's key of a message: on a partitioned inbox with its time, refused when it has no usable one.
    pub(super) fn key(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: &Carried,
    ) -> Result<db::claim::Key, ProcessError> {
        let time = match self.keying() {
            Keying::Plain => None,
            Keying::Timed(source) => match source.time_of(message_id, carried) {
                None => {
                    return Err(ProcessError::Unclaimable(format!(
                        "the inbox is partitioned on {}, which this message does not carry",
                        source.describe()
                    )));
                }
                Some(t) if t < time::earliest() => {
                    return Err(ProcessError::Unclaimable(format!(
                        "its time {} ({}) is before 2000: no partition of the inbox holds it",
                        t.to_rfc3339(),
                        source.describe()
                    )));
                }
                Some(t) => Some(t),
            },
        };
        Ok(db::claim::Key {
            message_id,
            fingerprint,
            time,
        })
    }

    /// What a failed claim statement of `keys` (one message's, or a batch's) means: the inbox's layout changed
    /// (learnt again; tried again), the partitions ahead run out (held), a time no partition holds (unclaimable), else
    /// the database's doing. Keys in the same order as the statement's: the first stands for the message's text.
    ///
    /// `conn` is the attempt's own connection, its transaction rolled back: what the error means is read on it, not
    /// on another of the pool's, which a pool of one (`--concurrency 1`) would never give while the attempt holds it.
    pub(super) async fn claim_error(
        &self,
        conn: &mut sqlx::PgConnection,
        e: sqlx::Error,
        keys: &[db::claim::Key],
    ) -> ProcessError {
        let Some(key) = keys.first() else {
            return ProcessError::Unavailable(e);
        };
        match db::sqlstate(&e).as_deref() {
            // ON CONFLICT (id, consumer_type) on a partitioned inbox, or message_time on an unpartitioned one.
            Some("42P10" | "42703") => {
                self.learn_keying(conn).await;
                ProcessError::Unavailable(e)
            }
            // No partition for now: the partitions ahead ran out (no cleanup made them). Every message would be
            // refused and moved aside, the whole stream: the database's state, held like an outage until a
            // partition holds the time (the claims made to look at the outage's end see it).
            Some("23514") if key.time.is_some() && self.ran_out(conn, keys).await => {
                ProcessError::Unavailable(db::no_partition_for_now(&crate::sanitize::text(
                    &db::describe(&e),
                )))
            }
            // No partition for the row's time.
            Some("23514") if key.time.is_some() => ProcessError::Unclaimable(format!(
                "its time {} is in no partition of the inbox: its producer's clock is off, or its id carries no \
                 time (the inbox is partitioned on {}); `inboxctl cleanup` makes the partitions ahead",
                key.time.map(|t| t.to_rfc3339()).unwrap_or_default(),
                match self.keying() {
                    Keying::Timed(source) => source.describe(),
                    Keying::Plain => "a time",
                }
            )),
            _ => ProcessError::Unavailable(e),
        }
    }

    /// Whether the keys whose time no partition holds are all past the newest partition and no later than now (give
    /// or take five minutes of producers' clocks): the partitions ahead ran out, and these are messages of now — not
    /// a late copy of an old message whose partition went (nor one from a clock far off), whatever its age, so a
    /// message held this way stays held until a partition is made. A layout that cannot be read, or one that holds
    /// every time now (made since the claim failed): as run out, and tried again.
    async fn ran_out(&self, conn: &mut sqlx::PgConnection, keys: &[db::claim::Key]) -> bool {
        // Between the refused claim and the look at the partitions (a test makes the partition here).
        failpoint::hit("claim-refused").await;
        let Ok(partitions) = db::partitions::partitions(&mut *conn).await else {
            return true;
        };
        // A partition whose `DETACH … CONCURRENTLY` has not finished (cancelled in its second phase, or waiting there)
        // is listed but takes no row: its range is held by none. Cleanup detaches only partitions past the window, so
        // a message of its range is an old one, refused as such, not held as if the partitions ahead had run out.
        // The newest that has begun, as the makers read it: one made far ahead (by an operator, a clock ahead) does
        // not end the run-out times before it, whose messages are held for the partitions a migrate or a cleanup
        // makes there (`make_missing`).
        // "Now" is the database's, as the makers' is (`make_missing`): a consumer's host clock off by minutes would
        // take messages of now for ones of the future (moved aside), or hold old ones.
        let Ok(now) = db::external::database_now(&mut *conn).await else {
            return true;
        };
        let newest = db::partitions::newest_begun(&partitions, now);
        let partitions: Vec<_> = partitions.iter().filter(|p| !p.detach_pending).collect();
        let latest = now + chrono::TimeDelta::minutes(5);
        let covered = |t: chrono::DateTime<chrono::Utc>| {
            partitions
                .iter()
                .any(|p| p.from.is_none_or(|f| f <= t) && p.to.is_some_and(|to| t < to))
        };
        // None missing now: a partition was made since the claim failed (a cleanup, a migrate making those that ran
        // out) — held this once, and the next try claims.
        keys.iter()
            .filter_map(|k| k.time)
            .filter(|t| !covered(*t))
            .all(|t| newest.is_none_or(|n| t >= n) && t <= latest)
    }
}
