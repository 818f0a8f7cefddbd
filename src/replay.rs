//! Moving dead-lettered messages back to the queue they failed on, safely.
//!
//! - **A fixed snapshot.** The messages present when the replay starts (their count, read first) are taken one by one
//!   and held unacknowledged, so a message that fails again and lands back in the dead-letter queue is never taken
//!   again by the same run; what is not replayed is given back at the end, in its original order.
//! - **Nothing lost.** Each copy is published with publisher confirms (and `mandatory`, so a queue that does not
//!   exist is an error, not a silent drop); the dead-letter copy is acknowledged only after the broker confirmed it.
//!   A crash between the two leaves the message in both queues: the inbox discards the second copy.
//! - **Nothing repeated.** Body, properties and message id are republished untouched (a MassTransit envelope stays
//!   byte for byte), so the inbox recognises a message that had in fact been processed. Only the failure headers are
//!   dropped, and a replay count of inboxctl's own is kept.
//! - **Within the window.** The inbox deduplicates only while a message's row exists: a message that failed longer
//!   ago than the cleanup retention may have lost its row, so replaying it could repeat its effect; such messages are
//!   left where they are unless asked for.
//!
//! Dead-letter shapes understood: MassTransit's `<queue>_error` and `<queue>_skipped` (origin in
//! `MT-Fault-InputAddress`, else the queue name) and RabbitMQ dead-letter-exchange queues (origin in `x-death`).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Confirmation, Connection};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::amqp::{Broker, dead_letter, envelope, topology};
use crate::error::{Error, Result};
use crate::failpoint;

/// The header in which inboxctl counts how often a message was replayed. Not an `x-` header: RabbitMQ 4 reserves
/// those for itself.
pub const REPLAY_COUNT_HEADER: &str = "inboxctl-replay-count";

/// What to replay.
#[derive(Debug, Clone)]
pub struct Plan {
    pub from: String,
    /// Where every message goes, whatever its headers say.
    pub to: Option<String>,
    /// Replay at most this many messages.
    pub limit: Option<u64>,
    /// Only these message ids (empty: all).
    pub message_ids: Vec<String>,
    /// Only messages whose failure reason contains this text.
    pub reason: Option<String>,
    /// Leave messages already replayed this many times.
    pub max_replays: Option<u32>,
    /// The inbox cleanup's retention: older failures are left unless `include_expired`.
    pub retention: Duration,
    pub include_expired: bool,
    pub dry_run: bool,
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
    /// The broker refused or could not route the copy; left in place.
    PublishFailed,
    /// A copy of a message this run already sent to the same origin (a second copy in the queue, or the first back
    /// again without its replay count); left in place.
    CopyOfReplayed,
}

impl Action {
    /// Whether leaving the message is something the operator should hear about (not their own filter).
    pub fn is_problem(self) -> bool {
        matches!(
            self,
            Action::Expired
                | Action::MaxReplays
                | Action::OriginUnknown
                | Action::PublishFailed
                | Action::CopyOfReplayed
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
            Action::PublishFailed => "left: republish failed",
            Action::CopyOfReplayed => "left: a copy of a message this run already replayed",
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
    /// Dead-letter copies whose replay the broker had confirmed but whose acknowledgement was lost with the
    /// connection, seen again after a reconnect: acknowledged, not sent again.
    pub already_replayed: u64,
    /// Why the replay stopped early on an error: the connection lost and not back in time, or the broker refusing
    /// something. What was done before is in `items`; the rest is where it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Whether `stopped` is a lost connection (as opposed to a refusal).
    pub connection_lost: bool,
    pub items: Vec<Item>,
}

/// What a dead-lettered message says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub origin: Option<String>,
    pub reason: Option<String>,
    pub failed_at: Option<DateTime<Utc>>,
    pub replays: u32,
}

/// Reads origin, reason, time and replay count from a dead-lettered message's headers; `from` is the queue it was
/// read from (its name tells the origin of a MassTransit `_error`/`_skipped` copy without headers).
pub fn failure(headers: Option<&FieldTable>, from: &str) -> Failure {
    let text = |key: &str| dead_letter::header_text(headers, key);
    let x_death = headers
        .and_then(|h| h.inner().get("x-death"))
        .and_then(AMQPValue::as_array)
        .map(|a| a.as_slice().to_vec())
        .unwrap_or_default();
    let death_field = |index: usize, key: &str| {
        x_death
            .get(index)
            .and_then(AMQPValue::as_field_table)
            .and_then(|t| t.inner().get(key).cloned())
    };
    let value_text = |v: Option<AMQPValue>| match v {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_owned()),
        _ => None,
    };

    let origin = text("MT-Fault-InputAddress")
        .and_then(|address| queue_of_address(&address))
        .or_else(|| text("x-first-death-queue"))
        .or_else(|| value_text(death_field(x_death.len().saturating_sub(1), "queue")))
        .or_else(|| {
            from.strip_suffix("_error")
                .or_else(|| from.strip_suffix("_skipped"))
                .filter(|q| !q.is_empty())
                .map(str::to_owned)
        });
    let reason = text("MT-Fault-Message")
        .or_else(|| {
            (text("MT-Reason").as_deref() == Some("dead-letter"))
                .then(|| "not handled by the consumer (skipped)".to_owned())
        })
        .or_else(|| value_text(death_field(0, "reason")))
        .or_else(|| text("x-first-death-reason"));
    let failed_at = text("MT-Fault-Timestamp")
        .as_deref()
        .and_then(envelope::parse_time)
        .or_else(|| match death_field(0, "time") {
            Some(AMQPValue::Timestamp(seconds)) => {
                DateTime::from_timestamp(i64::try_from(seconds).unwrap_or(i64::MAX), 0)
            }
            _ => None,
        });
    let replays = headers
        .and_then(|h| h.inner().get(REPLAY_COUNT_HEADER))
        .and_then(as_u32)
        .unwrap_or(0);
    Failure {
        origin,
        reason,
        failed_at,
        replays,
    }
}

/// `rabbitmq://host[:port]/[vhost/]queue[?…]` → `queue`. The address names no vhost for `/`, and the replay runs in
/// the vhost it is connected to anyway.
fn queue_of_address(address: &str) -> Option<String> {
    let path = address.split_once("://").map_or(address, |(_, rest)| rest);
    let path = path.split(['?', '#']).next().unwrap_or_default();
    path.rsplit('/')
        .next()
        .filter(|q| !q.is_empty() && path.contains('/'))
        .map(str::to_owned)
}

fn as_u32(value: &AMQPValue) -> Option<u32> {
    match *value {
        AMQPValue::LongInt(v) => u32::try_from(v).ok(),
        AMQPValue::LongUInt(v) => Some(v),
        AMQPValue::LongLongInt(v) => u32::try_from(v).ok(),
        AMQPValue::ShortInt(v) => u32::try_from(v).ok(),
        AMQPValue::ShortUInt(v) => Some(u32::from(v)),
        AMQPValue::ShortShortInt(v) => u32::try_from(v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u32::from(v)),
        _ => None,
    }
}

/// The headers a replayed copy carries: the original's without the failure headers, with the replay count raised.
pub fn replay_headers(original: Option<&FieldTable>, replays: u32) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(original) = original {
        for (key, value) in original.inner() {
            let k = key.as_str();
            let failure = k.starts_with("MT-Fault-")
                || k.starts_with("MT-Host-")
                || k == "MT-Reason"
                || k == "x-death"
                || k.starts_with("x-first-death-")
                || k.starts_with("x-last-death-")
                || k == "x-dotnet-pub-seq-no"
                || k == REPLAY_COUNT_HEADER;
            if !failure {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers.insert(
        REPLAY_COUNT_HEADER.into(),
        AMQPValue::LongInt(i32::try_from(replays.saturating_add(1)).unwrap_or(i32::MAX)),
    );
    headers
}

/// Replays `plan.from`. `progress` is called after each message with (done, snapshot).
///
/// When the connection is lost on the way (the broker restarted, the network broke), the messages it held go back to
/// the dead-letter queue by themselves; it connects again for up to `reconnect_for` and goes on with the snapshot,
/// stepping over the messages it had already looked at and left, and acknowledging (without sending again) a
/// dead-letter copy whose replay the broker had confirmed but whose acknowledgement was lost. Out of time, it returns
/// what it did so far with `stopped` and `connection_lost` set. Another error after the first message also returns
/// what was done, with `stopped` set.
pub async fn run(
    connection: &Connection,
    broker: &Broker,
    plan: &Plan,
    reconnect_for: Duration,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(u64, u64),
) -> Result<Report> {
    let snapshot = match topology::queue_depth(connection, &plan.from).await? {
        Some((ready, _)) => u64::from(ready),
        None => return Err(Error::QueueNotFound(plan.from.clone())),
    };
    let mut state = State {
        plan,
        now: Utc::now(),
        window: TimeDelta::from_std(plan.retention).unwrap_or(TimeDelta::MAX),
        report: Report {
            from: plan.from.clone(),
            dry_run: plan.dry_run,
            snapshot,
            replayed: 0,
            left: 0,
            interrupted: false,
            reconnects: 0,
            already_replayed: 0,
            stopped: None,
            connection_lost: false,
            items: Vec::new(),
        },
        selected: 0,
        pass: 0,
        republished: HashMap::new(),
        left_in_place: HashMap::new(),
    };
    let mut reconnected: Option<Connection> = None;
    let mut fruitless = 0;
    loop {
        let current = reconnected.as_ref().unwrap_or(connection);
        let done_before = state.report.items.len() as u64 + state.report.already_replayed;
        match state.pass(current, shutdown, &mut progress).await {
            Ok(()) => break,
            Err(e) if !crate::amqp::is_connection_lost(current, &e) => {
                if state.report.items.is_empty() {
                    return Err(e);
                }
                state.report.interrupted = true;
                state.report.stopped = Some(crate::redact::text(&e.to_string()));
                break;
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    done = state.report.items.len(),
                    of = snapshot,
                    "lost the connection to RabbitMQ; connecting again to go on (the messages held go back to {} by themselves)",
                    crate::sanitize::text(&plan.from)
                );
                // Closed for certain, so that nothing it held stays unacknowledged out of the next pass's sight.
                crate::amqp::close(current, "reconnecting").await;
                let done_after = state.report.items.len() as u64 + state.report.already_replayed;
                fruitless = if done_after > done_before {
                    0
                } else {
                    fruitless + 1
                };
                if fruitless >= crate::amqp::MAX_FRUITLESS_RECONNECTS {
                    state.report.interrupted = true;
                    state.report.connection_lost = true;
                    state.report.stopped = Some(format!(
                        "the connection was lost {fruitless} times in a row without any progress: {}",
                        crate::redact::text(&e.to_string())
                    ));
                    break;
                }
                match broker
                    .reconnect("inboxctl replay", reconnect_for, Some(shutdown))
                    .await
                {
                    Ok(again) => {
                        state.report.reconnects += 1;
                        if let Some(old) = reconnected.replace(again) {
                            crate::amqp::close(&old, "OK").await;
                        }
                    }
                    Err(last) => {
                        state.report.interrupted = true;
                        state.report.connection_lost = true;
                        state.report.stopped = Some(format!(
                            "{} (not back within {})",
                            crate::redact::text(&last.to_string()),
                            humantime::format_duration(reconnect_for)
                        ));
                        break;
                    }
                }
            }
        }
    }
    if let Some(own) = reconnected {
        crate::amqp::close(&own, "OK").await;
    }
    Ok(state.report)
}

/// A replay's progress, kept across reconnects.
struct State<'a> {
    plan: &'a Plan,
    now: DateTime<Utc>,
    window: TimeDelta,
    report: Report,
    /// Messages chosen so far (for `--limit`).
    selected: u64,
    /// The pass over one connection this is (1 before the first reconnect).
    pass: u32,
    /// Messages republished by this run with the broker's confirm: the replay count their dead-letter copy had, and
    /// the pass they were sent in.
    republished: HashMap<Key, (u32, u32)>,
    /// Messages looked at and left where they were, and the pass they were looked at in.
    left_in_place: HashMap<Key, u32>,
}

/// How a message is recognised when it is seen again: its id and where it goes (one dead-letter queue can collect
/// the copies of one event from several queues: each is a message of its own), or for a message without an id, its
/// body.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Id { id: String, origin: Option<String> },
    Body(u64),
}

fn key(delivery: &Delivery, message_id: Option<&str>, origin: Option<&str>) -> Key {
    match message_id {
        Some(id) => Key::Id {
            id: id.to_owned(),
            origin: origin.map(str::to_owned),
        },
        None => {
            use std::hash::{Hash as _, Hasher as _};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            delivery.data.hash(&mut hasher);
            Key::Body(hasher.finish())
        }
    }
}

impl State<'_> {
    /// Takes the rest of the snapshot over one connection; gives back what it held and did not replay.
    async fn pass(
        &mut self,
        connection: &Connection,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        self.pass += 1;
        let inbound = connection.create_channel().await?;
        let outbound = connection.create_channel().await?;
        outbound
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let mut held: Option<u64> = None;
        self.take(&inbound, &outbound, shutdown, progress, &mut held)
            .await?;
        // Give back everything not replayed, at once: the broker puts each back in its place, in order.
        if let Some(last) = held {
            inbound
                .basic_nack(
                    last,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await?;
        }
        let _ = inbound.close(200, "OK".into()).await;
        let _ = outbound.close(200, "OK".into()).await;
        Ok(())
    }

    async fn take(
        &mut self,
        inbound: &lapin::Channel,
        outbound: &lapin::Channel,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
        held: &mut Option<u64>,
    ) -> Result<()> {
        let plan = self.plan;
        while (self.report.items.len() as u64) < self.report.snapshot {
            if shutdown.is_cancelled() {
                self.report.interrupted = true;
                break;
            }
            let Some(message) = inbound
                .basic_get(plan.from.as_str().into(), BasicGetOptions { no_ack: false })
                .await?
            else {
                break;
            };
            let delivery = message.delivery;
            let message_id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned());
            let failure = failure(delivery.properties.headers().as_ref(), &plan.from);
            let origin = plan.to.clone().or(failure.origin.clone());
            let key = key(&delivery, message_id.as_deref(), origin.as_deref());
            let mut copy_of_replayed = false;
            if let Some(&(replays, pass)) = self.republished.get(&key) {
                if failure.replays > replays {
                    // A copy this run republished that failed again and is back (its replay count is higher): not
                    // taken again by this run.
                    *held = Some(delivery.delivery_tag);
                    continue;
                }
                if pass < self.pass && delivery.redelivered {
                    // The dead-letter copy of a message this run sent, with the broker's confirm, before the
                    // connection was lost with its acknowledgement: acknowledged now, not sent again.
                    inbound
                        .basic_ack(delivery.delivery_tag, BasicAckOptions::default())
                        .await?;
                    self.report.already_replayed += 1;
                    continue;
                }
                // A second copy of a message already sent to this origin, or the first back again from a path that
                // dropped its replay count: which, cannot be told, so it is left where it is, and said.
                copy_of_replayed = true;
            }
            if self
                .left_in_place
                .get(&key)
                .is_some_and(|&pass| pass < self.pass)
            {
                // Looked at before the connection was lost, and left: step over it again.
                *held = Some(delivery.delivery_tag);
                continue;
            }
            let chosen = (plan.message_ids.is_empty()
                || message_id
                    .as_ref()
                    .is_some_and(|id| plan.message_ids.iter().any(|m| same_id(m, id))))
                && plan.reason.as_ref().is_none_or(|r| {
                    failure
                        .reason
                        .as_ref()
                        .is_some_and(|text| text.contains(r.as_str()))
                })
                && plan.limit.is_none_or(|limit| self.selected < limit);

            let mut error = None;
            let mut refused = None;
            let action = if copy_of_replayed {
                Action::CopyOfReplayed
            } else if !chosen {
                Action::NotSelected
            } else if plan.max_replays.is_some_and(|max| failure.replays >= max) {
                Action::MaxReplays
            } else if !plan.include_expired
                && failure
                    .failed_at
                    .is_some_and(|t| self.now - t > self.window)
            {
                Action::Expired
            } else if origin.is_none() {
                Action::OriginUnknown
            } else if plan.dry_run {
                Action::WouldReplay
            } else {
                match republish(
                    outbound,
                    &delivery,
                    origin.as_deref().unwrap_or_default(),
                    failure.replays,
                )
                .await
                {
                    Ok(()) => Action::Replayed,
                    // The broker refused the copy and closed the channel with its reason (a permission, say): every
                    // later copy would fail the same way. This one is left, with the reason, and the replay stops.
                    Err(Error::Broker(e)) if e.is_amqp_soft_error() => {
                        error = Some(crate::redact::text(&e.to_string()));
                        refused = Some(Error::Broker(e));
                        Action::PublishFailed
                    }
                    // The connection failed: stop this pass (and connect again).
                    Err(e @ Error::Broker(_)) => return Err(e),
                    Err(e) => {
                        error = Some(crate::redact::text(&e.to_string()));
                        Action::PublishFailed
                    }
                }
            };
            if chosen && !copy_of_replayed {
                self.selected += 1;
            }
            match action {
                Action::Replayed => {
                    self.report.replayed += 1;
                    self.republished
                        .insert(key.clone(), (failure.replays, self.pass));
                }
                other => {
                    if other.is_problem() {
                        self.report.left += 1;
                    }
                    *held = Some(delivery.delivery_tag);
                    self.left_in_place.entry(key).or_insert(self.pass);
                }
            }
            self.report.items.push(Item {
                message_id,
                reason: failure.reason,
                failed_at: failure.failed_at,
                origin,
                replays: failure.replays,
                action,
                error,
            });
            // The copy is confirmed and counted: only now may the dead-letter copy go. A crash or a lost connection
            // before this leaves it in both queues, and the inbox discards the second.
            if action == Action::Replayed {
                failpoint::hit("replay-after-publish").await;
                inbound
                    .basic_ack(delivery.delivery_tag, BasicAckOptions::default())
                    .await?;
            }
            progress(self.report.items.len() as u64, self.report.snapshot);
            if let Some(e) = refused {
                return Err(e);
            }
        }
        Ok(())
    }
}

async fn republish(
    channel: &lapin::Channel,
    delivery: &Delivery,
    queue: &str,
    replays: u32,
) -> Result<()> {
    let headers = replay_headers(delivery.properties.headers().as_ref(), replays);
    let properties = delivery.properties.clone().with_headers(headers);
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &delivery.data,
            properties,
        )
        .await?
        .await?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::Topology(format!(
            "queue {queue} does not exist; the copy was returned"
        ))),
        Confirmation::Nack(_) => Err(Error::Topology(format!(
            "the broker refused the copy to {queue}"
        ))),
        Confirmation::NotRequested => Err(Error::Topology("publisher confirms are off".to_owned())),
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
    use lapin::types::{FieldArray, LongString};

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
    }

    #[test]
    fn masstransit_error_headers() {
        let mut h = FieldTable::default();
        h.insert(
            "MT-Fault-InputAddress".into(),
            long("rabbitmq://127.0.0.1/parcel-created-carrier"),
        );
        h.insert("MT-Fault-Message".into(), long("carrier API returned 503"));
        h.insert(
            "MT-Fault-Timestamp".into(),
            long("2026-11-30T20:14:50.2268983Z"),
        );
        h.insert("MT-Reason".into(), long("fault"));
        let f = failure(Some(&h), "parcel-created-carrier_error");
        assert_eq!(f.origin.as_deref(), Some("parcel-created-carrier"));
        assert_eq!(f.reason.as_deref(), Some("carrier API returned 503"));
        assert_eq!(
            f.failed_at.map(|t| t.to_rfc3339()).as_deref(),
            Some("2026-11-30T20:14:50.226898300+00:00")
        );
        assert_eq!(f.replays, 0);
    }

    #[test]
    fn the_queue_name_tells_the_origin_of_a_skipped_copy() {
        let mut h = FieldTable::default();
        h.insert("MT-Reason".into(), long("dead-letter"));
        let f = failure(Some(&h), "parcel-created-carrier_skipped");
        assert_eq!(f.origin.as_deref(), Some("parcel-created-carrier"));
        assert_eq!(
            f.reason.as_deref(),
            Some("not handled by the consumer (skipped)")
        );
        assert_eq!(failure(None, "somewhere").origin, None);
    }

    #[test]
    fn x_death_headers() {
        let mut death = FieldTable::default();
        death.insert("queue".into(), long("orders"));
        death.insert("reason".into(), long("rejected"));
        death.insert("time".into(), AMQPValue::Timestamp(1_764_533_690));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        h.insert(REPLAY_COUNT_HEADER.into(), AMQPValue::LongInt(2));
        let f = failure(Some(&h), "orders.dlq");
        assert_eq!(f.origin.as_deref(), Some("orders"));
        assert_eq!(f.reason.as_deref(), Some("rejected"));
        assert_eq!(f.failed_at.map(|t| t.timestamp()), Some(1_764_533_690));
        assert_eq!(f.replays, 2);
    }

    #[test]
    fn addresses_with_a_vhost_or_a_query() {
        assert_eq!(
            queue_of_address("rabbitmq://h:5673/shop/orders?bind=true").as_deref(),
            Some("orders")
        );
        assert_eq!(
            queue_of_address("rabbitmq://h/orders").as_deref(),
            Some("orders")
        );
        assert_eq!(queue_of_address("rabbitmq://h/"), None);
    }

    #[test]
    fn replay_headers_drop_failures_and_count() {
        let mut h = FieldTable::default();
        h.insert("MT-Fault-Message".into(), long("x"));
        h.insert("MT-Host-MachineName".into(), long("vm"));
        h.insert("MT-Reason".into(), long("fault"));
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::default()),
        );
        h.insert("x-first-death-queue".into(), long("orders"));
        h.insert("tenant".into(), long("acme"));
        h.insert(REPLAY_COUNT_HEADER.into(), AMQPValue::LongInt(1));
        let out = replay_headers(Some(&h), 1);
        let keys: Vec<&str> = out.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, [REPLAY_COUNT_HEADER, "tenant"]);
        assert_eq!(
            out.inner().get(REPLAY_COUNT_HEADER),
            Some(&AMQPValue::LongInt(2))
        );
    }

    #[test]
    fn ids_compare_as_uuids() {
        assert!(same_id(
            "1A280000-161D-4C08-9E18-08DF4F1E91B6",
            "1a280000161d4c089e1808df4f1e91b6"
        ));
        assert!(!same_id("order-1", "order-2"));
    }
}
