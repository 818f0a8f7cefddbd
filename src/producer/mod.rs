//! The Parcel Tracker's producer side: `ParcelCreatedEvent`s published as MassTransit 8 envelopes, for demos, tests
//! and benchmarks.

use chrono::Utc;
use uuid::Uuid;

use crate::ids::IdKind;

use crate::amqp::envelope::{EnvelopeOut, HostInfo, format_json_time, masstransit_properties};
use crate::amqp::{BasicProperties, Broker};
use crate::parcel::{PARCEL_CREATED_URN, ParcelCreatedEvent};

mod send;

pub use send::{publish, publish_showing};

const DESTINATIONS: [&str; 8] = [
    "Berlin",
    "Amsterdam",
    "Paris",
    "Madrid",
    "Rome",
    "Vienna",
    "Prague",
    "Warsaw",
];

/// One message to publish: its id and its event.
#[derive(Debug, Clone)]
pub struct Message {
    pub message_id: Uuid,
    pub event: ParcelCreatedEvent,
}

/// What to publish.
#[derive(Debug, Clone)]
pub struct Plan {
    pub count: u64,
    /// Fraction of the messages published a second time with the same message id: half of them right after the
    /// original, half after all the originals.
    pub duplicates: f64,
    /// Messages per second (copies included); as fast as the broker confirms when `None`.
    pub rate: Option<f64>,
    /// Every parcel's destination; a rotation of cities when `None`.
    pub destination: Option<String>,
    /// The kind of message ids: MassTransit's NewId by default, as a MassTransit publisher sends.
    pub ids: IdKind,
    /// Events per parcel, published one after another (each its own message id): the ordered events a partitioned
    /// consumer keeps in order. `count` counts parcels.
    pub events_per_parcel: u32,
    /// The event field each copy's routing key is set to (a consistent-hash exchange spreads on it); none: `""`, as
    /// MassTransit publishes by default.
    pub routing_key: Option<ParcelField>,
    /// How long a call to the broker (a copy's confirm above all) may wait for its answer before the connection is
    /// given up and made again.
    pub broker_timeout: std::time::Duration,
}

/// A field of [`ParcelCreatedEvent`], by its name in the message (camelCase, as MassTransit writes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParcelField {
    ParcelId,
    TrackingNumber,
    Destination,
}

impl ParcelField {
    pub const ALL: [ParcelField; 3] = [
        ParcelField::ParcelId,
        ParcelField::TrackingNumber,
        ParcelField::Destination,
    ];

    /// Its name in the message.
    pub fn name(self) -> &'static str {
        match self {
            ParcelField::ParcelId => "parcelId",
            ParcelField::TrackingNumber => "trackingNumber",
            ParcelField::Destination => "destination",
        }
    }

    /// Its value in `event`, as a routing key carries it.
    pub fn of(self, event: &ParcelCreatedEvent) -> String {
        match self {
            ParcelField::ParcelId => event.parcel_id.to_string(),
            ParcelField::TrackingNumber => event.tracking_number.clone(),
            ParcelField::Destination => event.destination.clone(),
        }
    }
}

impl Plan {
    /// `count` parcels, one event each, no copies, at full speed, MassTransit's ids, no routing key, the default bound
    /// on a broker call.
    pub fn parcels(count: u64) -> Self {
        Self {
            count,
            duplicates: 0.0,
            rate: None,
            destination: None,
            ids: IdKind::NewId,
            events_per_parcel: 1,
            routing_key: None,
            broker_timeout: crate::amqp::DEFAULT_BROKER_TIMEOUT,
        }
    }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// Distinct messages (parcels).
    pub published: u64,
    /// Copies published again with an id already sent.
    pub duplicates: u64,
    /// Copies the broker returned because no queue was bound (nothing consumes them).
    pub unroutable: u64,
    /// Times the connection was lost and made again.
    pub reconnects: u32,
    /// Copies sent again after a reconnect because their confirm had not arrived (some may have arrived twice).
    pub resent: u64,
    /// Copies the run meant to send (messages and their copies).
    pub planned: u64,
    /// Stopped early by a signal: `published` and `duplicates` count the copies the broker confirmed, the first ones
    /// of the run's order.
    pub interrupted: bool,
    pub exchange: String,
    #[serde(skip)]
    pub messages: Vec<Message>,
}

/// The messages of a plan: for each new parcel, `events_per_parcel` events one after another.
pub fn messages(plan: &Plan) -> Vec<Message> {
    let run = Uuid::new_v4().simple().to_string();
    let events = u64::from(plan.events_per_parcel.max(1));
    (0..plan.count)
        .flat_map(|i| {
            let event = ParcelCreatedEvent {
                parcel_id: Uuid::new_v4(),
                tracking_number: format!("PT{}{:08}NL", &run[..4].to_uppercase(), i + 1),
                destination: plan.destination.clone().unwrap_or_else(|| {
                    DESTINATIONS[usize::try_from(i).unwrap_or_default() % DESTINATIONS.len()]
                        .to_owned()
                }),
            };
            (0..events).map(move |_| Message {
                message_id: plan.ids.next(),
                event: event.clone(),
            })
        })
        .collect()
}

/// The order copies go out in: each message once, a fraction of them twice — half of those right after the
/// original, the other half after every original was sent.
pub fn schedule(count: usize, duplicates: f64) -> Vec<usize> {
    let copies = ((count as f64) * duplicates.clamp(0.0, 1.0)).round() as usize;
    let mut order = Vec::with_capacity(count + copies);
    let mut late = Vec::new();
    let mut chosen = 0;
    for i in 0..count {
        order.push(i);
        // Spread the duplicated messages evenly over the run.
        if (i + 1) * copies / count.max(1) > i * copies / count.max(1) {
            if chosen % 2 == 0 {
                order.push(i);
            } else {
                late.push(i);
            }
            chosen += 1;
        }
    }
    order.extend(late);
    order
}

/// What differs between two sends of one message by MassTransit but not between the copies of one send (its
/// redeliveries, a retry, its dead-letter copy, the outbox's re-send): when it was sent and in which conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub sent_time: chrono::DateTime<Utc>,
    pub conversation_id: Uuid,
}

impl Stamp {
    pub fn now() -> Self {
        Self {
            sent_time: Utc::now(),
            conversation_id: Uuid::now_v7(),
        }
    }
}

/// The AMQP properties and body MassTransit would write for `message` published to `exchange` on `broker`, now.
pub fn envelope(
    message: &Message,
    broker: &Broker,
    exchange: &str,
    host: &HostInfo,
) -> (BasicProperties, Vec<u8>) {
    envelope_stamped(message, broker, exchange, host, Stamp::now())
}

/// [`envelope`], sent at `stamp`'s time in its conversation: the copies of a message `publish` sends again carry its
/// first copy's, as MassTransit's copies do (a partitioned inbox may key a message on its `sentTime`).
pub fn envelope_stamped(
    message: &Message,
    broker: &Broker,
    exchange: &str,
    host: &HostInfo,
    stamp: Stamp,
) -> (BasicProperties, Vec<u8>) {
    let body = EnvelopeOut {
        message_id: message.message_id.to_string(),
        request_id: None,
        correlation_id: None,
        conversation_id: Some(stamp.conversation_id.to_string()),
        initiator_id: None,
        source_address: Some(format!(
            "{}?temporary=true",
            broker.queue_address(&format!(
                "{}_inboxctl_bus_{}",
                host.machine_name,
                host.bus_id.simple()
            ))
        )),
        destination_address: Some(broker.queue_address(exchange)),
        response_address: None,
        fault_address: None,
        message_type: vec![PARCEL_CREATED_URN.to_owned()],
        message: &message.event,
        expiration_time: None,
        sent_time: format_json_time(stamp.sent_time),
        headers: serde_json::Map::new(),
        host,
    }
    .to_body();
    (masstransit_properties(message.message_id), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_sends_every_message_and_the_right_number_of_copies() {
        let order = schedule(100, 0.2);
        assert_eq!(order.len(), 120);
        let mut counts = [0; 100];
        for &i in &order {
            counts[i] += 1;
        }
        assert!(counts.iter().all(|&c| c == 1 || c == 2));
        assert_eq!(counts.iter().filter(|&&c| c == 2).count(), 20);
        // Half right after their original, half after all originals.
        let immediate = order.windows(2).filter(|w| w[0] == w[1]).count();
        assert_eq!(immediate, 10);
        assert_eq!(order[110..].len(), 10, "the late copies come last");
    }

    #[test]
    fn no_duplicates_and_all_duplicates() {
        assert_eq!(schedule(5, 0.0), vec![0, 1, 2, 3, 4]);
        assert_eq!(schedule(4, 1.0).len(), 8);
        assert!(schedule(0, 0.5).is_empty());
    }

    #[test]
    fn a_parcels_events_go_out_one_after_another_each_with_its_own_id() {
        let plan = Plan {
            events_per_parcel: 3,
            ..Plan::parcels(2)
        };
        let all = messages(&plan);
        assert_eq!(all.len(), 6);
        assert!(all[..3].iter().all(|m| m.event == all[0].event));
        assert!(all[3..].iter().all(|m| m.event == all[3].event));
        assert_ne!(all[0].event.parcel_id, all[3].event.parcel_id);
        let ids: std::collections::HashSet<_> = all.iter().map(|m| m.message_id).collect();
        assert_eq!(ids.len(), 6);
        assert_eq!(
            ParcelField::ParcelId.of(&all[0].event),
            all[0].event.parcel_id.to_string()
        );
    }

    #[test]
    fn an_envelope_reads_back_with_the_same_id_and_event() {
        let broker = Broker::from_url("amqp://127.0.0.1:5672/%2f").expect("url");
        let plan = Plan::parcels(1);
        let message = messages(&plan).remove(0);
        let (props, body) = envelope(&message, &broker, "X:Y", &HostInfo::current());
        let incoming = crate::amqp::envelope::parse(&props, &body).expect("readable");
        assert_eq!(incoming.message_id, message.message_id);
        let event: ParcelCreatedEvent =
            serde_json::from_str(incoming.payload.get()).expect("event");
        assert_eq!(event, message.event);
    }
}
