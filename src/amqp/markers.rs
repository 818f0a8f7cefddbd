//! The queues that say what holds a dead-letter queue's messages out of sight, for the cleanup's guard: a replay's
//! marker (an exclusive queue, gone with the replay's connection) and a look's (`find`, `failures`, `top`'s detail, a
//! guard: a consumer on a queue of its own while it looks), and the names no replay may go to.

use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};

use super::is_not_found;
use crate::error::Result;

/// The queue that says a replay of `queue` is running: exclusive to the replay's connection, so that it goes when the
/// replay ends, however it ends (a crash, a lost connection). The messages a replay holds unacknowledged cannot be
/// seen by anyone else, and the cleanup's guard must know they are there ([`replay_running`]).
pub fn replay_marker(queue: &str) -> String {
    marker_name("inboxctl.replaying.", queue)
}

/// `prefix` and the queue's name, or — past AMQP's 255 bytes — `prefix`, `sha256.` and the SHA-256 of the name in 64
/// lowercase hex digits.
fn marker_name(prefix: &str, queue: &str) -> String {
    let name = format!("{prefix}{queue}");
    if name.len() <= 255 {
        return name;
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(queue.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}sha256.{hex}")
}

/// Why `queue` is no place to replay a message to, if it is not: a replay's marker (a replay's own answers a look as
/// present, being its connection's, and what it took would go with it), a look's marker (the same, gone with its last
/// look) or a name the broker reserves (`amq.`: its server-named queues, exclusive to a connection and gone with it).
pub fn not_a_replay_destination(queue: &str) -> Option<&'static str> {
    if queue.starts_with("inboxctl.replaying.") {
        Some("a replay's marker, not a consumer's queue")
    } else if queue.starts_with("inboxctl.looking.") {
        // A look's marker: present while a look runs, deleted with its last look, and what went into it with it.
        Some("a look's marker, not a consumer's queue")
    } else if queue.starts_with("amq.") {
        Some("a name the broker reserves (amq.), not a consumer's queue")
    } else {
        None
    }
}

/// What became of a replay's marker ([`mark_replay`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// Set, for as long as the connection is open.
    Set,
    /// Another open connection's: a replay of the same queue is running (the broker's `RESOURCE_LOCKED`).
    Held,
    /// The user may not declare it (no configure permission on its name).
    Refused,
}

/// Says, for as long as `conn` is open, that a replay of `queue` is running.
pub async fn mark_replay(conn: &Connection, queue: &str) -> Result<Marker> {
    let channel = conn.create_channel().await?;
    let options = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(
            replay_marker(queue).as_str().into(),
            options,
            FieldTable::default(),
        )
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "OK".into()).await;
            Ok(Marker::Set)
        }
        Err(e) if crate::amqp::is_locked(&e) => Ok(Marker::Held),
        Err(e) => {
            let e = crate::amqp::BrokerError::from(e);
            if e.is_access_refused() {
                Ok(Marker::Refused)
            } else {
                Err(e.into())
            }
        }
    }
}

/// Takes a replay's marker down before its connection closes (a confirmation's dry run, whose connection the replay
/// goes on with after a question that may wait long): best effort, within 2 s; the close takes it down anyway.
pub async fn unmark_replay(conn: &Connection, queue: &str) {
    let unmark = async {
        let channel = conn.create_channel().await?;
        channel
            .queue_delete(
                replay_marker(queue).as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await?;
        let _ = channel.close(200, "OK".into()).await;
        Ok::<(), lapin::Error>(())
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), unmark).await;
}

/// The queue that says, while it has a consumer, that a look at `queue` holds some of its messages out of sight:
/// each look (`find`, `failures`, `stats` and `top`, a cleanup's guard) consumes from it while it looks ([`mark_look`]).
pub fn look_marker(queue: &str) -> String {
    marker_name("inboxctl.looking.", queue)
}

/// How long a look's marker outlives its last look (`x-expires`): a classic queue, not deleted with its last consumer
/// (two looks marking at once would race its deletion, the second's consume answered NOT_FOUND), but after this long
/// unused; what tells a look is under way is its consumers, not the queue.
const LOOK_MARKER_EXPIRES_MS: i64 = 60_000;

/// Whether this process was refused a look's mark once (no configure or read on the marker's name): it does not ask
/// again, each refusal being a channel error in the broker's log.
static MARK_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A look's mark on a queue: a consumer on its look marker, for as long as this is kept (dropped, the consumer is
/// cancelled; [`LookMark::end`] closes its channel too).
pub struct LookMark {
    channel: lapin::Channel,
    _consumer: lapin::Consumer,
}

impl LookMark {
    pub async fn end(self) {
        let _ = self.channel.close(200, "OK".into()).await;
    }
}

/// Marks `queue` as looked at, for as long as the mark returned is kept: a consumer on its look marker. Any number of
/// looks mark it at once. `None` when it cannot be marked — this user may not (configure and read on the marker's
/// name), or the broker refused it otherwise (a node down, a limit on queues) — said (with `say`; else in the debug
/// log), and a refusal asked no more in this process: the look goes on unmarked, and a cleanup's guard looking
/// meanwhile cannot see what it holds.
pub async fn mark_look(conn: &Connection, queue: &str, say: bool) -> Option<LookMark> {
    use std::sync::atomic::Ordering;
    if MARK_REFUSED.load(Ordering::Relaxed) {
        return None;
    }
    let marker = look_marker(queue);
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("classic".into()),
    );
    arguments.insert(
        "x-expires".into(),
        AMQPValue::LongLongInt(LOOK_MARKER_EXPIRES_MS),
    );
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let marked = async {
        let channel = conn.create_channel().await?;
        channel
            .queue_declare(marker.as_str().into(), options, arguments)
            .await?;
        let consumer = channel
            .basic_consume(
                marker.as_str().into(),
                "".into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..lapin::options::BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok::<_, lapin::Error>(LookMark {
            channel,
            _consumer: consumer,
        })
    }
    .await;
    match marked {
        Ok(mark) => Some(mark),
        Err(e) => {
            let e = crate::amqp::BrokerError::from(e);
            if e.is_access_refused() {
                MARK_REFUSED.store(true, Ordering::Relaxed);
            }
            let why = "this look at a dead-letter queue could not be marked (it needs configure and read on the \
                       marker's name): a cleanup running meanwhile cannot see the messages it holds";
            let marker = crate::sanitize::text(&marker);
            match say {
                true => tracing::warn!(%marker, error = %e, "{why}"),
                false => tracing::debug!(%marker, error = %e, "{why}"),
            }
            None
        }
    }
}

/// How many looks hold `queue` marked now (the consumers of its look marker; 0 when it has none); `None` when the
/// broker would not tell (its marker's node down, say).
pub async fn looks_at(conn: &Connection, queue: &str) -> Option<u32> {
    let marker = super::topology::queue_depth(conn, &look_marker(queue)).await;
    marker
        .ok()
        .map(|marker| marker.map_or(0, |(_, looks)| looks))
}

/// Whether a replay of `queue` is running ([`mark_replay`]): its marker exists (or is locked, the broker's answer
/// to a passive declare of another connection's exclusive queue).
pub async fn replay_running(conn: &Connection, queue: &str) -> Result<bool> {
    let channel = conn.create_channel().await?;
    match channel
        .queue_declare(
            replay_marker(queue).as_str().into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        )
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "OK".into()).await;
            Ok(true)
        }
        Err(e) if crate::amqp::is_locked(&e) => Ok(true),
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replay's marker and a look's are gone with their connections, and what went into them with them.
    #[test]
    fn neither_marker_is_a_replay_destination() {
        assert!(not_a_replay_destination(&replay_marker("orders_error")).is_some());
        assert!(not_a_replay_destination(&look_marker("orders_error")).is_some());
        assert!(not_a_replay_destination(&look_marker(&"q".repeat(250))).is_some());
        assert!(not_a_replay_destination("orders").is_none());
    }
}
