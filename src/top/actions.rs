//! What the detail view asks for, done off the drawing loop: loading a consumer_type's detail, and replaying a
//! failure group (audited, like every replay). Each runs as a task of its own and answers with an [`Action`].

use std::time::Duration;

use serde_json::json;
use sqlx::postgres::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::app::Action;
use super::detail::Request;
use crate::amqp::Broker;
use crate::replay::{self, Plan};

/// What the tasks need.
#[derive(Clone)]
pub struct Context {
    pub pool: PgPool,
    pub broker: Broker,
    /// The cleanup's retention: a replay from `top` leaves messages older than it, as `replay` does.
    pub retention: Duration,
    pub shutdown: CancellationToken,
}

/// Starts what `request` asks for; its answer comes back on `tx`. The dashboard waits for the task before it ends: a
/// replay stopped by the shutdown gives back what it holds and writes its audit row.
pub fn start(
    request: Request,
    context: &Context,
    tx: &mpsc::Sender<Action>,
) -> tokio::task::JoinHandle<()> {
    let (context, tx) = (context.clone(), tx.clone());
    tokio::spawn(async move {
        let answer = match request {
            Request::Load {
                consumer_type,
                queue,
            } => Action::DetailLoaded(Box::new(load(&context, &consumer_type, &queue).await)),
            Request::Replay {
                consumer_type,
                from,
                group,
            } => Action::ReplayDone(
                replay_group(&context, &consumer_type, &from, group.into()).await,
            ),
        };
        let _ = tx.send(answer).await;
    })
}

async fn connect(broker: &Broker) -> Option<crate::amqp::Connection> {
    tokio::time::timeout(Duration::from_secs(3), broker.connect("inboxctl top"))
        .await
        .ok()
        .and_then(Result::ok)
}

/// How long a look at a consumer_type's dead letters may take before it is given up (its messages given back).
pub(crate) const LOOK_LIMIT: Duration = Duration::from_secs(60);

/// Loads the detail of `consumer_type`: bounded by [`LOOK_LIMIT`] and ended by the dashboard's stop, so that a look
/// that never answers neither keeps the next one from starting nor holds the quit; its connection is closed either
/// way, which gives back what it held.
async fn load(
    context: &Context,
    consumer_type: &str,
    queue: &str,
) -> Result<crate::triage::detail::Detail, String> {
    let connection = connect(&context.broker).await;
    let looked = crate::triage::detail::load(
        &context.pool,
        connection.as_ref(),
        context.broker.vhost(),
        consumer_type,
        queue,
    );
    let detail = tokio::select! {
        looked = tokio::time::timeout(LOOK_LIMIT, looked) => match looked {
            Ok(detail) => detail.map_err(|e| crate::redact::text(&e.to_string())),
            Err(_) => Err(format!(
                "the look at the dead letters took longer than {}: given up",
                humantime::format_duration(LOOK_LIMIT)
            )),
        },
        () = context.shutdown.cancelled() => Err("stopped".to_owned()),
    };
    if let Some(c) = connection {
        crate::amqp::close(&c, "OK").await;
    }
    detail
}

/// Replays `group` of `from` as listed, writes the audit row, and says what came of it in a line.
async fn replay_group(
    context: &Context,
    consumer_type: &str,
    from: &str,
    group: replay::GroupPlan,
) -> String {
    let Some(connection) = connect(&context.broker).await else {
        return "replay failed: RabbitMQ not reachable; nothing moved".to_owned();
    };
    let plan = Plan {
        from: from.to_owned(),
        to: None,
        limit: None,
        confirmed: None,
        confirmed_ids: None,
        message_ids: Vec::new(),
        reason: None,
        max_replays: None,
        retention: context.retention,
        include_expired: false,
        restore_expiration: false,
        dry_run: false,
        group: Some(group),
        rate: None,
        broker_timeout: crate::amqp::DEFAULT_BROKER_TIMEOUT,
    };
    let report = replay::run(
        &connection,
        &context.broker,
        &plan,
        Duration::from_secs(10),
        &context.shutdown,
        |_, _| {},
    )
    .await;
    crate::amqp::close(&connection, "OK").await;
    let mut details = json!({ "from": from, "consumer_type": consumer_type, "via": "top" });
    if let (Ok(r), serde_json::Value::Object(map)) = (&report, &mut details) {
        map.insert("replayed".to_owned(), json!(r.replayed));
        map.insert("left".to_owned(), json!(r.left));
        map.insert("group".to_owned(), json!(r.group));
    }
    let entry = crate::audit::Entry::ended("replay", &report, replay::Report::outcome, details);
    // `top` keeps no log: why the row was not written is said beside the outcome (the status line is sanitised).
    let note = match crate::audit::try_record(&context.pool, &entry).await {
        Ok(()) => String::new(),
        Err(why) => format!(" (not audited: {why})"),
    };
    match report {
        Ok(r) => {
            let g = r.group.clone().unwrap_or_default();
            let mut partial = if r.outcome() == crate::error::Outcome::Partial {
                format!(
                    "; {} left in place, {} not met — see `inboxctl replay --dry-run`",
                    r.left, r.unreached
                )
            } else {
                String::new()
            };
            // A stop (the connection lost past the wait for another, a refusal) is said, and so are the replayed
            // messages whose dead-letter copy may still be in the queue beside the copy sent back.
            if let Some(why) = &r.stopped {
                partial.push_str(&format!("; stopped: {}", crate::redact::text(why)));
            } else if r.interrupted {
                partial.push_str("; interrupted");
            }
            if r.acks_in_doubt > 0 {
                partial.push_str(&format!(
                    "; {} replayed may still be in {} beside their copy",
                    r.acks_in_doubt, from
                ));
            }
            format!(
                "replayed {} of group {} ({} listed, {} gone, {} changed, {} new left{partial}){note}",
                r.replayed,
                g.fingerprint,
                g.listed,
                g.gone.len(),
                g.changed.len(),
                g.new
            )
        }
        Err(e) => format!(
            "replay failed: {}{note}",
            crate::redact::text(&e.to_string())
        ),
    }
}
