//! What a dead-lettered message says about its failure: where it came from (MassTransit's `MT-Fault-InputAddress`,
//! RabbitMQ's `x-death`, or the name of the `<queue>_error`/`<queue>_skipped` queue it sits in), why, when, and how
//! often inboxctl replayed it already.

use chrono::{DateTime, Utc};
use lapin::types::{AMQPValue, FieldTable};

use super::copy::REPLAY_COUNT_HEADER;
use super::{address, dead_letter, envelope};

/// Where a dead-lettered message came from, as its headers (or the dead-letter queue's name) tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Queue(String),
    /// Nothing tells.
    Unknown,
    /// `MT-Fault-InputAddress` cannot be read without guessing, or the headers name no possible queue.
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
    /// What kind of failure: MassTransit's `MT-Fault-ExceptionType`, or the reason RabbitMQ dead-lettered it for
    /// (`rejected`, `expired`, `maxlen`, `delivery_limit`) as `rabbitmq:<reason>`, or `skipped` for a message no
    /// consumer handled.
    pub exception_type: Option<String>,
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
    // The dead-lettering that was the failure: the newest by a consumer's reject (or a quorum queue's count of its
    // returns), else the newest of all. `x-death` holds the newest first (an entry repeated is moved to the front).
    // Through a chain, the first death's queue is an earlier hop (a delay queue expiring into `orders`, rejected
    // there into `orders.dlq`: replayed to the delay queue, it reached no consumer); and the newest may be a later
    // one (`orders.dlq` expiring its messages into an archive; a retry loop's wait queue before the message was
    // parked): replayed there, the same.
    let failing = (0..x_death.len())
        .find(|&i| {
            matches!(
                value_text(death_field(i, "reason")).as_deref(),
                Some("rejected" | "delivery_limit")
            )
        })
        .unwrap_or(0);

    // A copy moved to `<queue>_skipped` (MassTransit's, or inboxctl's: `MT-Reason: dead-letter`, no fault headers)
    // came from `<queue>`, whatever dead-lettering brought it there before: the `x-death` headers it keeps are of an
    // earlier hop, and replayed there it would reach another consumer than the one that skipped it.
    let skipped_from = (text("MT-Reason").as_deref() == Some("dead-letter"))
        .then(|| from.strip_suffix("_skipped"))
        .flatten()
        .filter(|q| !q.is_empty());
    // The queue the failing dead-lettering took it from; without `x-death`, RabbitMQ 3.13's `x-last-death-queue`,
    // else the first death's.
    let death_queue = value_text(death_field(failing, "queue"))
        .filter(|q| !q.is_empty())
        .or_else(|| text("x-last-death-queue"))
        .filter(|q| !q.is_empty())
        .or_else(|| text("x-first-death-queue"))
        .filter(|q| !q.is_empty());
    let origin = match (text("MT-Fault-InputAddress"), skipped_from) {
        (Some(input_address), _) => {
            let origin = origin_of_address(input_address.clone(), vhost);
            address_beside_death(origin, &input_address, death_queue, from)
        }
        (None, Some(queue)) => Origin::Queue(queue.to_owned()),
        (None, None) => death_queue
            .map(origin_of_death_queue)
            .or_else(|| {
                from.strip_suffix("_error")
                    .or_else(|| from.strip_suffix("_skipped"))
                    .filter(|q| !q.is_empty())
                    .map(|q| Origin::Queue(q.to_owned()))
            })
            .unwrap_or(Origin::Unknown),
    };
    // The broker's reason for the failing dead-lettering (without `x-death`: RabbitMQ 3.13's last, else the first).
    let death_reason = value_text(death_field(failing, "reason"))
        .or_else(|| text("x-last-death-reason"))
        .or_else(|| text("x-first-death-reason"));
    let reason = text("MT-Fault-Message")
        .or_else(|| {
            (text("MT-Reason").as_deref() == Some("dead-letter"))
                .then(|| "not handled by the consumer (skipped)".to_owned())
        })
        .or_else(|| death_reason.clone());
    let exception_type = text("MT-Fault-ExceptionType")
        .or_else(|| {
            (text("MT-Reason").as_deref() == Some("dead-letter")).then(|| "skipped".to_owned())
        })
        .or_else(|| death_reason.map(|r| format!("rabbitmq:{r}")));
    let failed_at = text("MT-Fault-Timestamp")
        .as_deref()
        .and_then(envelope::parse_time)
        .or_else(|| match death_field(failing, "time") {
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
        exception_type,
        failed_at,
        replays,
    }
}

/// When a dead-lettered copy failed, as far as it tells: its failure headers' time ([`failure`]), else when it was
/// published (the AMQP `timestamp`), else its envelope's `sentTime`. A copy moved aside unhandled (`_skipped`, by
/// MassTransit or by inboxctl) carries no failure time, and often no timestamp; when it was sent is never after it
/// failed, so an age read from it is never too young. `None` when nothing tells.
///
/// A source more than a day ahead of this machine's clock (a timestamp in milliseconds, a host's clock far off, a
/// header written by hand) tells nothing: the next one is asked.
pub fn failed_at(delivery: &super::Delivery, failure: &Failure) -> Option<DateTime<Utc>> {
    let latest = Utc::now() + chrono::TimeDelta::days(1);
    let plausible = |t: &DateTime<Utc>| *t <= latest;
    failure
        .failed_at
        .filter(plausible)
        .or_else(|| {
            delivery
                .properties
                .timestamp()
                .and_then(|t| DateTime::from_timestamp(i64::try_from(t).ok()?, 0))
                .filter(plausible)
        })
        .or_else(|| {
            envelope::parse(&delivery.properties, &delivery.data)
                .ok()
                .and_then(|m| m.sent_time)
                .filter(plausible)
        })
}

pub(super) fn x_death(headers: Option<&FieldTable>) -> Vec<AMQPValue> {
    headers
        .and_then(|h| h.inner().get("x-death"))
        .and_then(AMQPValue::as_array)
        .map(|a| a.as_slice().to_vec())
        .unwrap_or_default()
}

/// The origin RabbitMQ's `x-death` names. The broker never writes a queue name longer than AMQP's 255 bytes, but a
/// producer can write any header: such a name is no queue, so the message is left, not sent anywhere.
fn origin_of_death_queue(queue: String) -> Origin {
    if queue.len() <= address::MAX_NAME {
        return Origin::Queue(queue);
    }
    Origin::Ambiguous {
        address: super::limits::truncate(&queue, super::limits::MAX_LOGGED_TEXT).into_owned(),
        why: format!(
            "x-death names a queue of {} bytes, longer than AMQP's 255",
            queue.len()
        ),
    }
}

/// Whether a queue the broker names (`name`: the one its dead-lettering took the message from, or the one the message
/// sits in) bears out an address naming `queue`: `queue` itself, its `_error` or `_skipped` (an error copy the broker
/// dead-lettered again, out of the error queue into an archive), or those of the queue a partition `queue` belongs to
/// (`<queue>.N`: its consumer's copies go to `<queue>_error`).
fn vouches(queue: &str, name: &str) -> bool {
    use super::topology::{error_queue, skipped_queue};
    let base = queue
        .rsplit_once('.')
        .filter(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map(|(base, _)| base);
    name == queue
        || name == error_queue(queue)
        || name == skipped_queue(queue)
        || base.is_some_and(|base| name == error_queue(base) || name == skipped_queue(base))
}

/// The origin `MT-Fault-InputAddress` (`input_address`) names (`origin`), beside the queue RabbitMQ's dead-lettering took the message
/// from (`death_queue`) and the dead-letter queue it sits in (`from`). Any producer can write the address into its
/// message: rejected by a consumer of `orders` and dead-lettered by the broker into `orders_error`, a message whose
/// address names `payments` would be replayed there. So an address that names another queue than the broker's
/// dead-lettering did is taken only where that queue or the one it sits in bears it out ([`vouches`]: MassTransit's
/// copy in `<queue>_error` of a message that went through a delay queue before it failed, an error copy the broker
/// moved on into an archive); elsewhere it is left, saying why (`--to` sends it where the operator says).
fn address_beside_death(
    origin: Origin,
    input_address: &str,
    death_queue: Option<String>,
    from: &str,
) -> Origin {
    match (&origin, death_queue) {
        (Origin::Queue(queue), Some(death)) if !vouches(queue, &death) && !vouches(queue, from) => {
            Origin::Ambiguous {
                address: shown_address(input_address),
                why: format!(
                    "MT-Fault-InputAddress names queue {}, but RabbitMQ dead-lettered the message from {} (x-death), \
                     and it sits in {}, not in that queue's _error or _skipped: a header any producer can write is \
                     not taken over the broker's",
                    super::limits::truncate(queue, super::limits::MAX_LOGGED_TEXT),
                    super::limits::truncate(&death, super::limits::MAX_LOGGED_TEXT),
                    super::limits::truncate(from, super::limits::MAX_LOGGED_TEXT),
                ),
            }
        }
        _ => origin,
    }
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
            address: shown_address(&input_address),
            why: why.to_string(),
        },
    }
}

/// How many times a quorum queue delivered the message before (its `x-delivery-count`); `None` on a classic queue
/// or a first delivery.
pub fn delivery_count(headers: Option<&FieldTable>) -> Option<u32> {
    as_u32(
        headers?
            .inner()
            .get(super::topology::DELIVERY_COUNT_HEADER)?,
    )
}

pub(crate) fn as_u32(value: &AMQPValue) -> Option<u32> {
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

/// An unreadable address as a report shows it: a password a producer wrote into it masked. Unparsed, it is as long
/// as the header was (a frame): one longer than any text kept for a report is not shown — cut, a password past the
/// cut's start would show in part; masked whole first, a hostile one costs the masking's scan of every parameter.
fn shown_address(address: &str) -> String {
    if address.len() > super::limits::MAX_LOGGED_TEXT {
        return format!("(an address of {} bytes, not shown)", address.len());
    }
    crate::redact::url(address)
}

#[cfg(test)]
mod tests;
