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

mod machine;

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher as _, Hasher};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::amqp::dead_letter::{self, ORIGINAL_EXPIRATION_HEADER};
use crate::amqp::publish::{self, PublishError, Routed};
use crate::amqp::{Broker, address, envelope, topology};
use crate::error::{Error, Result};
use crate::failpoint;
use machine::{Key, Machine, Outcome, Seen, Step};

/// The header in which inboxctl counts how often a message was replayed. Not an `x-` header: RabbitMQ 4 reserves
/// those for itself.
pub const REPLAY_COUNT_HEADER: &str = "inboxctl-replay-count";

/// The header that tags each copy with the replay run that sent it, so that the run knows its own copies when they
/// fail again and come back.
pub const REPLAY_RUN_HEADER: &str = "inboxctl-replay-run";

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
    /// Give each copy back the per-message TTL it had before it was dead-lettered.
    pub restore_expiration: bool,
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
    pub items: Vec<Item>,
}

/// Where a dead-lettered message came from, as its headers (or the dead-letter queue's name) tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Queue(String),
    /// Nothing tells.
    Unknown,
    /// `MT-Fault-InputAddress` cannot be read without guessing.
    Ambiguous {
        address: String,
        why: String,
    },
    /// `MT-Fault-InputAddress` names a vhost other than the one the replay is connected to.
    OtherVhost {
        vhost: String,
        queue: String,
    },
}

/// What a dead-lettered message says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub origin: Origin,
    pub reason: Option<String>,
    pub failed_at: Option<DateTime<Utc>>,
    pub replays: u32,
}

/// Reads origin, reason, time and replay count from a dead-lettered message's headers; `from` is the queue it was
/// read from (its name tells the origin of a MassTransit `_error`/`_skipped` copy without headers), `vhost` the one
/// the replay is connected to.
pub fn failure(headers: Option<&FieldTable>, from: &str, vhost: &str) -> Failure {
    let text = |key: &str| dead_letter::header_text(headers, key);
    let x_death = x_death(headers);
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

    let origin = match text("MT-Fault-InputAddress") {
        Some(input_address) => origin_of_address(input_address, vhost),
        None => text("x-first-death-queue")
            .or_else(|| value_text(death_field(x_death.len().saturating_sub(1), "queue")))
            .or_else(|| {
                from.strip_suffix("_error")
                    .or_else(|| from.strip_suffix("_skipped"))
                    .filter(|q| !q.is_empty())
                    .map(str::to_owned)
            })
            .map_or(Origin::Unknown, Origin::Queue),
    };
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

fn x_death(headers: Option<&FieldTable>) -> Vec<AMQPValue> {
    headers
        .and_then(|h| h.inner().get("x-death"))
        .and_then(AMQPValue::as_array)
        .map(|a| a.as_slice().to_vec())
        .unwrap_or_default()
}

/// The origin `MT-Fault-InputAddress` names. An address that names no vhost (MassTransit's way of writing `/`) is
/// taken to be the vhost the replay is connected to: a consumer only dead-letters into its own vhost.
fn origin_of_address(input_address: String, vhost: &str) -> Origin {
    match address::parse(&input_address) {
        Ok(address::Address {
            vhost: Some(named),
            queue,
        }) if named != vhost => Origin::OtherVhost {
            vhost: named,
            queue,
        },
        Ok(address) => Origin::Queue(address.queue),
        Err(why) => Origin::Ambiguous {
            address: input_address,
            why: why.to_string(),
        },
    }
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

/// The per-message TTL a message had before it was dead-lettered: its `expiration` property (a MassTransit copy may
/// keep it), else inboxctl's header, else what RabbitMQ's dead-lettering kept in `x-death` (newest death first).
/// Only a value RabbitMQ accepts (milliseconds, digits only).
pub fn original_expiration(properties: &BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref();
    let in_death = || {
        x_death(headers).iter().find_map(|death| {
            let value = death.as_field_table()?.inner().get("original-expiration")?;
            match value {
                AMQPValue::LongString(s) => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
                _ => None,
            }
        })
    };
    properties
        .expiration()
        .as_ref()
        .map(|e| e.as_str().to_owned())
        .or_else(|| dead_letter::header_text(headers, ORIGINAL_EXPIRATION_HEADER))
        .or_else(in_death)
        .filter(|e| !e.is_empty() && e.len() <= 10 && e.bytes().all(|b| b.is_ascii_digit()))
}

/// The headers a replayed copy carries: the original's without the failure headers, with the replay count raised and
/// the run's tag; and the original per-message TTL in [`ORIGINAL_EXPIRATION_HEADER`] when the copy does not carry it
/// as its `expiration`, so that a later replay can still give it back.
pub fn replay_headers(
    original: Option<&FieldTable>,
    replays: u32,
    run: &str,
    kept_expiration: Option<&str>,
) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(original) = original {
        for (key, value) in original.inner() {
            let k = key.as_str();
            let failure = dead_letter::is_failure_header(k)
                || dead_letter::is_death_header(k)
                || k == REPLAY_COUNT_HEADER
                || k == REPLAY_RUN_HEADER
                || k == ORIGINAL_EXPIRATION_HEADER;
            if !failure {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers.insert(
        REPLAY_COUNT_HEADER.into(),
        AMQPValue::LongInt(i32::try_from(replays.saturating_add(1)).unwrap_or(i32::MAX)),
    );
    headers.insert(REPLAY_RUN_HEADER.into(), long_string(run));
    if let Some(expiration) = kept_expiration {
        headers.insert(ORIGINAL_EXPIRATION_HEADER.into(), long_string(expiration));
    }
    headers
}

fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// The properties of a replayed copy: the original's, untouched, but for the headers and the per-message TTL, which
/// is left out unless `restore_expiration` (then the original one is given back, wherever it was kept).
pub fn replay_properties(
    original: &BasicProperties,
    replays: u32,
    run: &str,
    restore_expiration: bool,
) -> BasicProperties {
    let expiration = original_expiration(original);
    let kept = (!restore_expiration)
        .then_some(expiration.as_deref())
        .flatten();
    let headers = replay_headers(original.headers().as_ref(), replays, run, kept);
    // AMQP properties are all optional and lapin has no way to unset one: the copy is built field by field.
    let mut copy = BasicProperties::default().with_headers(headers);
    let text = |v: &Option<ShortString>| v.clone();
    if let Some(v) = text(original.content_type()) {
        copy = copy.with_content_type(v);
    }
    if let Some(v) = text(original.content_encoding()) {
        copy = copy.with_content_encoding(v);
    }
    if let Some(v) = *original.delivery_mode() {
        copy = copy.with_delivery_mode(v);
    }
    if let Some(v) = *original.priority() {
        copy = copy.with_priority(v);
    }
    if let Some(v) = text(original.correlation_id()) {
        copy = copy.with_correlation_id(v);
    }
    if let Some(v) = text(original.reply_to()) {
        copy = copy.with_reply_to(v);
    }
    if let Some(v) = expiration.filter(|_| restore_expiration) {
        copy = copy.with_expiration(v.into());
    }
    if let Some(v) = text(original.message_id()) {
        copy = copy.with_message_id(v);
    }
    if let Some(v) = *original.timestamp() {
        copy = copy.with_timestamp(v);
    }
    if let Some(v) = text(original.kind()) {
        copy = copy.with_type(v);
    }
    if let Some(v) = text(original.user_id()) {
        copy = copy.with_user_id(v);
    }
    if let Some(v) = text(original.app_id()) {
        copy = copy.with_app_id(v);
    }
    if let Some(v) = text(original.cluster_id()) {
        copy = copy.with_cluster_id(v);
    }
    copy
}

/// Replays `plan.from`. `progress` is called after each message with (done, snapshot).
///
/// When the connection is lost on the way (the broker restarted, the network broke), the messages it held go back to
/// the dead-letter queue by themselves; it connects again for up to `reconnect_for` and goes on with the snapshot,
/// stepping over the messages it had already looked at and left, and acknowledging (without sending again) a
/// dead-letter copy whose replay the broker had confirmed but whose acknowledgement may have been lost. Out of time,
/// it returns what it did so far with `stopped` and `connection_lost` set. Another error after the first message also
/// returns what was done, with `stopped` set.
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
        vhost: broker.vhost().to_owned(),
        user: broker.username().to_owned(),
        now: Utc::now(),
        window: TimeDelta::from_std(plan.retention).unwrap_or(TimeDelta::MAX),
        run: uuid::Uuid::new_v4().to_string(),
        fingerprints: Fingerprints::new(),
        machine: Machine::new(snapshot, plan.limit),
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
    };
    run_passes(
        &mut state,
        connection,
        broker,
        reconnect_for,
        shutdown,
        &mut progress,
    )
    .await?;
    let mut report = state.report;
    report.replayed = state.machine.replayed();
    report.left = state.machine.left();
    report.already_replayed = state.machine.already_replayed();
    Ok(report)
}

/// One pass per connection until the snapshot is done, connecting again after a lost connection.
async fn run_passes(
    state: &mut State<'_>,
    connection: &Connection,
    broker: &Broker,
    reconnect_for: Duration,
    shutdown: &CancellationToken,
    progress: &mut impl FnMut(u64, u64),
) -> Result<()> {
    let (plan, snapshot) = (state.plan, state.report.snapshot);
    let mut reconnected: Option<Connection> = None;
    let mut fruitless = 0;
    loop {
        let current = reconnected.as_ref().unwrap_or(connection);
        let done_before = state.machine.progress();
        match state.pass(current, shutdown, progress).await {
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
                state.machine.connection_lost();
                tracing::warn!(
                    error = %e,
                    done = state.report.items.len(),
                    of = snapshot,
                    "lost the connection to RabbitMQ; connecting again to go on (the messages held go back to {} by themselves)",
                    crate::sanitize::text(&plan.from)
                );
                // Closed for certain, so that nothing it held stays unacknowledged out of the next pass's sight.
                crate::amqp::close(current, "reconnecting").await;
                fruitless = if state.machine.progress() > done_before {
                    0
                } else {
                    fruitless + 1
                };
                if fruitless >= crate::amqp::MAX_FRUITLESS_RECONNECTS {
                    state.stop_lost(format!(
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
                        state.stop_lost(format!(
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
    Ok(())
}

/// A replay's progress, kept across reconnects.
struct State<'a> {
    plan: &'a Plan,
    /// The vhost the replay is connected to.
    vhost: String,
    /// The user it publishes as.
    user: String,
    now: DateTime<Utc>,
    window: TimeDelta,
    /// This run's tag, in [`REPLAY_RUN_HEADER`] of every copy it sends.
    run: String,
    fingerprints: Fingerprints,
    machine: Machine,
    report: Report,
}

/// What one delivery says, for the machine and for the report.
struct Read {
    seen: Seen,
    message_id: Option<String>,
    failure: Failure,
    /// Where it would go: `--to`, else its origin's queue.
    origin: Option<String>,
    /// Why it cannot be replayed (its origin, or the message itself), for the report.
    obstacle_error: Option<String>,
}

impl State<'_> {
    /// Stops the replay on a connection lost for good, saying why.
    fn stop_lost(&mut self, why: String) {
        self.report.interrupted = true;
        self.report.connection_lost = true;
        self.report.stopped = Some(why);
    }

    /// Takes the rest of the snapshot over one connection; gives back what it held and did not replay.
    async fn pass(
        &mut self,
        connection: &Connection,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        self.machine.pass_started();
        let inbound = connection.create_channel().await?;
        let outbound = connection.create_channel().await?;
        outbound
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let mut channels = Channels {
            inbound,
            outbound,
            probe: Probe {
                connection,
                channel: None,
                known: HashMap::new(),
            },
            held: None,
        };
        self.take(&mut channels, shutdown, progress).await?;
        // Give back everything not replayed, at once: the broker puts each back in its place, in order.
        if let Some(last) = channels.held {
            channels
                .inbound
                .basic_nack(
                    last,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await?;
        }
        match channels.inbound.close(200, "OK".into()).await {
            // Answered after every acknowledgement sent on the channel: they all arrived.
            Ok(()) => self.machine.settled(),
            Err(e) => {
                let e = Error::from(e);
                if crate::amqp::is_connection_lost(connection, &e) {
                    return Err(e);
                }
            }
        }
        let _ = channels.outbound.close(200, "OK".into()).await;
        channels.probe.close().await;
        Ok(())
    }

    async fn take(
        &mut self,
        channels: &mut Channels<'_>,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        while self.machine.wants_more() {
            if shutdown.is_cancelled() {
                self.report.interrupted = true;
                break;
            }
            failpoint::hit_with("replay-before-get", &self.machine.decided().to_string()).await;
            let got = channels
                .inbound
                .basic_get(
                    self.plan.from.as_str().into(),
                    BasicGetOptions { no_ack: false },
                )
                .await?;
            // Answered after every acknowledgement sent before it on this channel: those arrived.
            self.machine.settled();
            let Some(message) = got else {
                break;
            };
            let delivery = message.delivery;
            let read = self.read(&delivery);
            match self.machine.delivered(&read.seen) {
                Step::Hold => channels.held = Some(delivery.delivery_tag),
                Step::AckAgain => {
                    channels
                        .inbound
                        .basic_ack(delivery.delivery_tag, BasicAckOptions::default())
                        .await?;
                }
                Step::Leave(action) => {
                    channels.held = Some(delivery.delivery_tag);
                    let error = read.obstacle_error.clone();
                    self.record(read, action, error);
                }
                Step::Publish => self.replay_one(channels, &delivery, read).await?,
                // Only ever the answer to a republish.
                Step::Ack => {}
            }
            progress(self.machine.decided(), self.report.snapshot);
        }
        Ok(())
    }

    /// Republishes one message (in a dry run, only checks its origin) and acknowledges its dead-letter copy once the
    /// broker confirmed the republished one.
    async fn replay_one(
        &mut self,
        channels: &mut Channels<'_>,
        delivery: &Delivery,
        read: Read,
    ) -> Result<()> {
        let origin = read.origin.clone().unwrap_or_default();
        let mut refused = None;
        let (outcome, error) = if !channels.probe.exists(&origin).await? {
            (
                Outcome::Missing,
                Some(format!("queue {origin} does not exist")),
            )
        } else if self.plan.dry_run {
            (Outcome::WouldReplay, None)
        } else {
            failpoint::hit("replay-before-publish").await;
            let properties = replay_properties(
                &delivery.properties,
                read.failure.replays,
                &self.run,
                self.plan.restore_expiration,
            );
            match republish(&channels.outbound, delivery, &origin, properties).await {
                Ok(Outcome::Missing) => {
                    channels.probe.known.insert(origin.clone(), false);
                    (
                        Outcome::Missing,
                        Some(format!(
                            "the copy came back unroutable: queue {origin} does not exist"
                        )),
                    )
                }
                Ok(Outcome::Failed) => (
                    Outcome::Failed,
                    Some(format!("the broker refused the copy to {origin} (nack)")),
                ),
                Ok(outcome) => (outcome, None),
                // The broker refused the copy and closed the channel with its reason (a permission, say): every
                // later copy would fail the same way. This one is left, with the reason, and the replay stops.
                Err(Error::Broker(e)) if e.is_amqp_soft_error() => {
                    let error = crate::redact::text(&e.to_string());
                    refused = Some(Error::Broker(e));
                    (Outcome::Failed, Some(error))
                }
                // The connection failed: stop this pass (and connect again).
                Err(e @ Error::Broker(_)) => return Err(e),
                Err(e) => (Outcome::Failed, Some(crate::redact::text(&e.to_string()))),
            }
        };
        match self.machine.outcome(outcome) {
            Step::Ack => {
                self.record(read, Action::Replayed, None);
                // The copy is confirmed and counted: only now may the dead-letter copy go. A crash or a lost
                // connection before this leaves it in both queues, and the inbox discards the second.
                failpoint::hit("replay-after-publish").await;
                channels
                    .inbound
                    .basic_ack(delivery.delivery_tag, BasicAckOptions::default())
                    .await?;
            }
            Step::Leave(action) => {
                channels.held = Some(delivery.delivery_tag);
                self.record(read, action, error);
            }
            Step::Hold | Step::AckAgain | Step::Publish => {}
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn record(&mut self, read: Read, action: Action, error: Option<String>) {
        self.report.items.push(Item {
            message_id: read.message_id,
            reason: read.failure.reason,
            failed_at: read.failure.failed_at,
            origin: read.origin,
            replays: read.failure.replays,
            action,
            error,
        });
    }

    /// Where a message would go (`--to`, else its origin's queue), and if it cannot: why, for the machine and for
    /// the report.
    fn destination(&self, origin: &Origin) -> (Option<String>, Option<Action>, Option<String>) {
        match (&self.plan.to, origin) {
            (Some(to), _) => (Some(to.clone()), None, None),
            (None, Origin::Queue(queue)) => (Some(queue.clone()), None, None),
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
    fn read(&self, delivery: &Delivery) -> Read {
        let plan = self.plan;
        let headers = delivery.properties.headers().as_ref();
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned());
        let failure = failure(headers, &plan.from, &self.vhost);
        let (origin, origin_obstacle, mut obstacle_error) = self.destination(&failure.origin);
        let uncopyable = uncopyable(&delivery.properties, &self.user);
        let obstacle = if let Some(why) = uncopyable {
            obstacle_error = Some(why);
            Some(Action::Uncopyable)
        } else if plan.max_replays.is_some_and(|max| failure.replays >= max) {
            Some(Action::MaxReplays)
        } else if !plan.include_expired
            && failure
                .failed_at
                .is_some_and(|t| self.now - t > self.window)
        {
            Some(Action::Expired)
        } else {
            origin_obstacle
        };
        let chosen = (plan.message_ids.is_empty()
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
            origin,
            obstacle_error,
        }
    }
}

/// Why a dead-lettered message cannot be republished as it is, if it cannot: a copy would not be the message.
fn uncopyable(properties: &lapin::BasicProperties, user: &str) -> Option<String> {
    let depth = properties
        .headers()
        .as_ref()
        .map_or(0, crate::amqp::limits::header_depth);
    if depth > crate::amqp::limits::MAX_HEADER_DEPTH {
        return Some(format!(
            "its headers nest {depth} levels deep; inboxctl reads at most {}",
            crate::amqp::limits::MAX_HEADER_DEPTH
        ));
    }
    match properties.user_id() {
        Some(other) if other.as_str() != user => Some(format!(
            "its user_id {:?} is not the user the replay publishes as, and the broker would refuse it",
            crate::amqp::limits::truncate(other.as_str(), 64)
        )),
        _ => None,
    }
}

/// The channels of one pass.
struct Channels<'c> {
    /// Takes the dead-letter copies, and acknowledges them.
    inbound: Channel,
    /// Republishes, with publisher confirms.
    outbound: Channel,
    probe: Probe<'c>,
    /// The last delivery tag held, to give everything held back at once.
    held: Option<u64>,
}

/// Whether origin queues exist, asked once per queue and pass (a passive declare, which needs no permission).
struct Probe<'c> {
    connection: &'c Connection,
    /// A failed passive declare closes its channel: a new one is made for the next.
    channel: Option<Channel>,
    known: HashMap<String, bool>,
}

impl Probe<'_> {
    async fn exists(&mut self, queue: &str) -> Result<bool> {
        if let Some(&known) = self.known.get(queue) {
            return Ok(known);
        }
        let channel = match self.channel.take() {
            Some(channel) if channel.status().connected() => channel,
            _ => self.connection.create_channel().await?,
        };
        let exists = match channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
        {
            Ok(_) => {
                self.channel = Some(channel);
                true
            }
            Err(e) if crate::amqp::is_not_found(&e) => false,
            // Another refusal (an exclusive queue of another connection, say) is not an absence: the republish
            // tells, its copy coming back unroutable if the queue is missing after all.
            Err(e) if e.is_amqp_soft_error() => true,
            Err(e) => return Err(e.into()),
        };
        self.known.insert(queue.to_owned(), exists);
        Ok(exists)
    }

    async fn close(self) {
        if let Some(channel) = self.channel {
            let _ = channel.close(200, "OK".into()).await;
        }
    }
}

/// Publishes a copy to `queue` through the default exchange and waits for the broker's confirm: `Confirmed`,
/// `Missing` (returned as unroutable: no such queue) or `Failed` (nacked).
async fn republish(
    channel: &Channel,
    delivery: &Delivery,
    queue: &str,
    properties: BasicProperties,
) -> Result<Outcome> {
    match publish::publish_confirmed(channel, "", queue, &delivery.data, properties).await {
        Ok(Routed::Queued) => Ok(Outcome::Confirmed),
        Ok(Routed::Returned) => Ok(Outcome::Missing),
        Err(PublishError::Nacked) => Ok(Outcome::Failed),
        Err(PublishError::ConfirmsOff) => {
            Err(Error::Topology("publisher confirms are off".to_owned()))
        }
        Err(PublishError::Broker(e)) => Err(e.into()),
    }
}

/// Fingerprints of what copies carry, keyed at random for each run: 128 bits from two keyed hashes, so that neither
/// chance nor a crafted message makes two different copies look identical.
struct Fingerprints {
    keys: [RandomState; 2],
}

/// Both keyed hashes at once.
struct Pair([std::collections::hash_map::DefaultHasher; 2]);

impl Hasher for Pair {
    fn write(&mut self, bytes: &[u8]) {
        self.0[0].write(bytes);
        self.0[1].write(bytes);
    }

    fn finish(&self) -> u64 {
        self.0[0].finish()
    }
}

impl Pair {
    fn finish128(&self) -> u128 {
        (u128::from(self.0[0].finish()) << 64) | u128::from(self.0[1].finish())
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.write_usize(bytes.len());
        self.write(bytes);
    }

    fn text(&mut self, text: Option<&ShortString>) {
        match text {
            None => self.write_u8(0),
            Some(s) => {
                self.write_u8(1);
                self.bytes(s.as_str().as_bytes());
            }
        }
    }
}

impl Fingerprints {
    fn new() -> Self {
        Self {
            keys: [RandomState::new(), RandomState::new()],
        }
    }

    fn hasher(&self) -> Pair {
        Pair([self.keys[0].build_hasher(), self.keys[1].build_hasher()])
    }

    fn body(&self, body: &[u8]) -> u128 {
        let mut h = self.hasher();
        h.bytes(body);
        h.finish128()
    }

    /// Body, every property and every header but the broker's own delivery count (which changes as a copy is
    /// delivered again, while the copy stays the same). Where a copy goes follows from these.
    fn content(&self, delivery: &Delivery) -> u128 {
        let p = &delivery.properties;
        let mut h = self.hasher();
        h.bytes(&delivery.data);
        for text in [
            p.content_type(),
            p.content_encoding(),
            p.correlation_id(),
            p.reply_to(),
            p.expiration(),
            p.message_id(),
            p.kind(),
            p.user_id(),
            p.app_id(),
            p.cluster_id(),
        ] {
            h.text(text.as_ref());
        }
        for number in [p.delivery_mode(), p.priority()] {
            h.write_u16(number.map_or(u16::MAX, u16::from));
        }
        h.write_u8(u8::from(p.timestamp().is_some()));
        h.write_u64(p.timestamp().unwrap_or(0));
        let headers: Vec<_> = p
            .headers()
            .iter()
            .flat_map(|t| t.inner())
            .filter(|(key, _)| key.as_str() != "x-delivery-count")
            .collect();
        h.write_usize(headers.len());
        for (key, value) in headers {
            h.bytes(key.as_str().as_bytes());
            hash_value(&mut h, value);
        }
        h.finish128()
    }
}

/// Hashes a header value, nested tables and arrays included, without recursion: a header nested as deep as a frame
/// allows must not exhaust the stack.
fn hash_value(h: &mut Pair, root: &AMQPValue) {
    enum Next<'v> {
        Value(&'v AMQPValue),
        Key(&'v str),
    }
    let mut stack = vec![Next::Value(root)];
    while let Some(next) = stack.pop() {
        let value = match next {
            Next::Key(key) => {
                h.bytes(key.as_bytes());
                continue;
            }
            Next::Value(value) => value,
        };
        // A tag for the type, then a fixed-width number or a length-prefixed run of bytes: no two values alike.
        let (tag, number) = match value {
            AMQPValue::Boolean(v) => (1, u64::from(*v)),
            AMQPValue::ShortShortInt(v) => (2, i64::from(*v).cast_unsigned()),
            AMQPValue::ShortShortUInt(v) => (3, u64::from(*v)),
            AMQPValue::ShortInt(v) => (4, i64::from(*v).cast_unsigned()),
            AMQPValue::ShortUInt(v) => (5, u64::from(*v)),
            AMQPValue::LongInt(v) => (6, i64::from(*v).cast_unsigned()),
            AMQPValue::LongUInt(v) => (7, u64::from(*v)),
            AMQPValue::LongLongInt(v) => (8, v.cast_unsigned()),
            AMQPValue::Float(v) => (9, u64::from(v.to_bits())),
            AMQPValue::Double(v) => (10, v.to_bits()),
            AMQPValue::DecimalValue(v) => (11, (u64::from(v.scale) << 32) | u64::from(v.value)),
            AMQPValue::Timestamp(v) => (12, *v),
            AMQPValue::Void => (13, 0),
            AMQPValue::ShortString(v) => {
                h.write_u8(14);
                h.bytes(v.as_str().as_bytes());
                continue;
            }
            AMQPValue::LongString(v) => {
                h.write_u8(15);
                h.bytes(v.as_bytes());
                continue;
            }
            AMQPValue::ByteArray(v) => {
                h.write_u8(16);
                h.bytes(v.as_slice());
                continue;
            }
            AMQPValue::FieldArray(v) => {
                h.write_u8(17);
                h.write_usize(v.as_slice().len());
                stack.extend(v.as_slice().iter().rev().map(Next::Value));
                continue;
            }
            AMQPValue::FieldTable(v) => {
                h.write_u8(18);
                h.write_usize(v.inner().len());
                for (key, value) in v.inner().iter().rev() {
                    stack.push(Next::Value(value));
                    stack.push(Next::Key(key.as_str()));
                }
                continue;
            }
        };
        h.write_u8(tag);
        h.write_u64(number);
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
        let f = failure(Some(&h), "parcel-created-carrier_error", "/");
        assert_eq!(f.origin, Origin::Queue("parcel-created-carrier".into()));
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
        let f = failure(Some(&h), "parcel-created-carrier_skipped", "/");
        assert_eq!(f.origin, Origin::Queue("parcel-created-carrier".into()));
        assert_eq!(
            f.reason.as_deref(),
            Some("not handled by the consumer (skipped)")
        );
        assert_eq!(failure(None, "somewhere", "/").origin, Origin::Unknown);
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
        let f = failure(Some(&h), "orders.dlq", "/");
        assert_eq!(f.origin, Origin::Queue("orders".into()));
        assert_eq!(f.reason.as_deref(), Some("rejected"));
        assert_eq!(f.failed_at.map(|t| t.timestamp()), Some(1_764_533_690));
        assert_eq!(f.replays, 2);
    }

    #[test]
    fn the_input_address_decides_and_is_never_guessed_at() {
        let origin = |address: &str, vhost: &str| {
            let mut h = FieldTable::default();
            h.insert("MT-Fault-InputAddress".into(), long(address));
            failure(Some(&h), "orders_error", vhost).origin
        };
        let queue = |q: &str| Origin::Queue(q.to_owned());
        assert_eq!(
            origin("rabbitmq://h:5673/shop/orders?bind=true", "shop"),
            queue("orders")
        );
        // No vhost in the address: the one the replay is connected to.
        assert_eq!(origin("rabbitmq://h/orders", "shop"), queue("orders"));
        assert_eq!(
            origin("rabbitmq://h/probe%3Fq/eu%2Forders", "probe?q"),
            queue("eu/orders")
        );
        assert_eq!(
            origin("rabbitmq://h/eu/orders", "shop"),
            Origin::OtherVhost {
                vhost: "eu".into(),
                queue: "orders".into()
            }
        );
        // Unreadable: left, and not replaced by the dead-letter queue's name.
        for address in [
            "rabbitmq://h/shop/eu/orders",
            "rabbitmq://h/probe?q/orders",
            "rabbitmq://h/orders#x",
            "rabbitmq://h/",
        ] {
            assert!(
                matches!(origin(address, "shop"), Origin::Ambiguous { .. }),
                "{address}"
            );
        }
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
        h.insert(REPLAY_RUN_HEADER.into(), long("an earlier run"));
        h.insert("x-delivery-count".into(), AMQPValue::LongInt(3));
        let out = replay_headers(Some(&h), 1, "this run", None);
        let keys: Vec<&str> = out.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, [REPLAY_COUNT_HEADER, REPLAY_RUN_HEADER, "tenant"]);
        assert_eq!(out.inner().get(REPLAY_RUN_HEADER), Some(&long("this run")));
        assert_eq!(
            out.inner().get(REPLAY_COUNT_HEADER),
            Some(&AMQPValue::LongInt(2))
        );
    }

    #[test]
    fn a_copy_carries_no_ttl_unless_asked_and_keeps_the_original_in_a_header() {
        let mut death = FieldTable::default();
        death.insert("original-expiration".into(), long("8000"));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        let from_death = BasicProperties::default()
            .with_message_id("m".into())
            .with_headers(h);
        let mut h = FieldTable::default();
        h.insert(ORIGINAL_EXPIRATION_HEADER.into(), long("7000"));
        let from_header = BasicProperties::default().with_headers(h);
        let from_property = BasicProperties::default()
            .with_expiration("6000".into())
            .with_priority(3);
        for (original, ttl) in [
            (&from_death, "8000"),
            (&from_header, "7000"),
            (&from_property, "6000"),
        ] {
            let copy = replay_properties(original, 0, "run", false);
            assert_eq!(copy.expiration(), &None, "{original:?}");
            assert_eq!(
                dead_letter::header_text(copy.headers().as_ref(), ORIGINAL_EXPIRATION_HEADER)
                    .as_deref(),
                Some(ttl)
            );
            let restored = replay_properties(original, 0, "run", true);
            assert_eq!(
                restored.expiration().as_ref().map(ShortString::as_str),
                Some(ttl)
            );
            assert!(
                !restored
                    .headers()
                    .as_ref()
                    .is_some_and(|h| h.contains_key(ORIGINAL_EXPIRATION_HEADER))
            );
        }
        assert_eq!(
            replay_properties(&from_death, 0, "run", false).message_id(),
            from_death.message_id()
        );
        assert_eq!(
            replay_properties(&from_property, 0, "run", true).priority(),
            &Some(3)
        );
        // A value RabbitMQ would refuse (and close the channel for) is not given back.
        let odd = BasicProperties::default().with_expiration("soon".into());
        assert_eq!(replay_properties(&odd, 0, "run", true).expiration(), &None);
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
