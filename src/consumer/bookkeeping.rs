//! inboxctl's own bookkeeping beside a message's outcome (its events, for `stats` and `top`): it never holds up a
//! message, and a failure of it is said, not hidden.

use uuid::Uuid;

use super::Consumer;
use super::{Shared, lock};
use crate::amqp::limits::{self, MAX_HEADER_TEXT};
use crate::db;

/// A bookkeeping statement (the redelivery count, an event counter) failed. It never holds up a message; during an
/// outage that is expected and said at debug level. Any other failure (a grant or a table missing) is a warning,
/// once per process and statement, so that it is neither silent nor one line per message.
pub(super) fn bookkeeping_failed(
    what: &'static str,
    consequence: &'static str,
    id: Option<Uuid>,
    error: &sqlx::Error,
) {
    static WARNED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let text = crate::redact::text(&crate::db::describe(error));
    let first = !crate::db::is_transient(error) && {
        let mut warned = lock(&WARNED);
        !warned.contains(&what) && {
            warned.push(what);
            true
        }
    };
    if first {
        tracing::warn!(message_id = ?id, error = %text, "{what}: {consequence} (said once; the rest at -v)");
    } else {
        tracing::debug!(message_id = ?id, error = %text, "{what}");
    }
}

/// Runs one bookkeeping statement (written `bounded!(shared, |conn| statement(conn, …))`) within `--attempt-timeout`
/// ([`db::bounded`]): a connection that died without a word must not hold up the message the statement is about,
/// any more than its attempt may.
macro_rules! bounded {
    ($shared:expr, |$conn:ident| $statement:expr) => {
        $crate::db::bounded!(
            $shared.inbox.pool(),
            $shared.options.attempt_timeout,
            |$conn| $statement
        )
    };
}
pub(super) use bounded;

pub(super) async fn record_event<C: Consumer>(
    shared: &Shared<C>,
    kind: &str,
    message_id: Option<Uuid>,
    detail: &str,
) {
    let detail = limits::truncate(detail, MAX_HEADER_TEXT);
    let recorded = bounded!(shared, |conn| db::events::record(
        conn,
        shared.inbox.consumer_type(),
        kind,
        message_id,
        detail.as_ref(),
    ))
    .await;
    if let Err(e) = recorded {
        bookkeeping_failed(
            "could not record an event in inboxctl_events",
            "the counters that stats and top show miss it (a grant on inboxctl_events missing?)",
            message_id,
            &e,
        );
    }
}
