//! The redelivery count of poison-message detection (`inboxctl_attempts`): starts of redelivered messages that have
//! not reached an outcome, and those of them made alone.

use uuid::Uuid;

use super::{Exec, sql};
use crate::inbox::ConsumerType;

statements! {
    /// A redelivered message starts: counts the starts that have not reached an outcome, and returns them with those
    /// made alone. `$1` consumer_type, `$2` message id. Committed on its own, before the work, so a start that ends
    /// the process stays counted.
    const REDELIVERED_START = "\
INSERT INTO inboxctl_attempts (consumer_type, message_id, started) VALUES ($1, $2, 1)
ON CONFLICT (consumer_type, message_id)
DO UPDATE SET started = inboxctl_attempts.started + 1, last_started_at = now()
RETURNING started, alone";

    /// A redelivered message starts alone (nothing else in flight in its process). `$1` consumer_type, `$2` message id.
    const REDELIVERED_ALONE =
    "UPDATE inboxctl_attempts SET alone = alone + 1 WHERE consumer_type = $1 AND message_id = $2";

    /// A redelivered message's attempt alone returned (its process alive): not counted alone any more. `$1`
    /// consumer_type, `$2` message id.
    const REDELIVERED_ALONE_RETURNED = "\
UPDATE inboxctl_attempts SET alone = greatest(alone - 1, 0) WHERE consumer_type = $1 AND message_id = $2";

    /// Starts abandoned by a clean stop (not ended by a crash) taken back. `$1` consumer_type, `$2` message ids, `$3`
    /// for each, 1 if the start was also counted as made alone. An id may come more than once (two copies of one
    /// message in flight): each start is taken back (an update joins a row once, so they are summed first).
    const REDELIVERED_ABANDONED = "\
UPDATE inboxctl_attempts a
SET started = greatest(a.started - s.starts, 0), alone = greatest(a.alone - s.alone, 0)
FROM (SELECT message_id, count(*)::int AS starts, sum(alone)::int AS alone
      FROM unnest($2::uuid[], $3::int[]) AS u(message_id, alone) GROUP BY message_id) s
WHERE a.consumer_type = $1 AND a.message_id = s.message_id";

    /// A redelivered message came through an attempt alive: its count goes. `$1` consumer_type, `$2` message id.
    const REDELIVERED_DONE =
    "DELETE FROM inboxctl_attempts WHERE consumer_type = $1 AND message_id = $2";
}

/// A redelivered message's starts without an outcome so far (the one just counted included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Starts {
    pub started: u32,
    /// Those of them made alone.
    pub alone: u32,
}

/// Counts a start of a redelivered message (`REDELIVERED_START`).
pub async fn start(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    message_id: Uuid,
) -> sqlx::Result<Starts> {
    let (started, alone): (i32, i32) = unit!(executor, |conn| sql::query_as(REDELIVERED_START)
        .bind(consumer_type.as_str())
        .bind(message_id)
        .fetch_one(conn))?;
    Ok(Starts {
        started: u32::try_from(started).unwrap_or(0),
        alone: u32::try_from(alone).unwrap_or(0),
    })
}

/// Counts the current start of a redelivered message as made alone (`REDELIVERED_ALONE`).
pub async fn started_alone(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    message_id: Uuid,
) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(REDELIVERED_ALONE)
        .bind(consumer_type.as_str())
        .bind(message_id)
        .execute(conn))
    .map(drop)
}

/// Takes back the count alone of an attempt that returned (`REDELIVERED_ALONE_RETURNED`).
pub async fn returned_alone(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    message_id: Uuid,
) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(REDELIVERED_ALONE_RETURNED)
        .bind(consumer_type.as_str())
        .bind(message_id)
        .execute(conn))
    .map(drop)
}

/// Forgets a redelivered message's count: it came through an attempt alive (`REDELIVERED_DONE`).
pub async fn done(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    message_id: Uuid,
) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(REDELIVERED_DONE)
        .bind(consumer_type.as_str())
        .bind(message_id)
        .execute(conn))
    .map(drop)
}

/// Takes back the starts a clean stop abandoned (`REDELIVERED_ABANDONED`): each message id, and whether its start
/// was also counted as made alone.
pub async fn abandoned(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    starts: &[(Uuid, bool)],
) -> sqlx::Result<()> {
    let (ids, alone): (Vec<Uuid>, Vec<i32>) = starts
        .iter()
        .map(|(id, alone)| (*id, i32::from(*alone)))
        .unzip();
    unit!(executor, |conn| sql::query(REDELIVERED_ABANDONED)
        .bind(consumer_type.as_str())
        .bind(&ids)
        .bind(&alone)
        .execute(conn))
    .map(drop)
}
