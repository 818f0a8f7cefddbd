//! The time a partitioned inbox keys each message on: one that **every copy of the message carries**, so that a copy
//! arriving days after its original lands in the original's partition and meets its row there. The time a copy was
//! received cannot be that key: two copies received on either side of a partition boundary would each find their
//! partition free of the other, and both be processed (see `docs/scaling.md`, "A partitioned inbox").
//!
//! Which time is the inbox's choice, made once when it is partitioned ([`TimeSource`]) and kept with the table, so that
//! every consumer reads each message's time the same way.

use chrono::{DateTime, TimeZone as _, Utc};
use uuid::Uuid;

use crate::ids;

/// Where a partitioned inbox reads a message's time from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TimeSource {
    /// The time inside the message id: a UUIDv7's (its version says so), else a MassTransit NewId's (.NET ticks; see
    /// [`crate::ids`]). Every copy has the same id, so the same time — also a re-send that re-serialised the message.
    Id,
    /// The envelope's `sentTime`, else the AMQP `timestamp` property: for producers whose ids carry no time (random
    /// v4). Copies share it when they are copies of the same bytes (redeliveries, dead-letter copies, replays,
    /// MassTransit's outbox); a producer that re-serialises a re-send with a new `sentTime` makes a new key.
    SentTime,
    /// Only the AMQP `timestamp` property (whole seconds).
    Timestamp,
}

impl TimeSource {
    pub const ALL: [TimeSource; 3] = [TimeSource::Id, TimeSource::SentTime, TimeSource::Timestamp];

    /// Its name on the command line and in the table's settings.
    pub fn name(self) -> &'static str {
        match self {
            TimeSource::Id => "id",
            TimeSource::SentTime => "sent-time",
            TimeSource::Timestamp => "timestamp",
        }
    }

    /// In words, for the consumer's start and for refusals.
    pub fn describe(self) -> &'static str {
        match self {
            TimeSource::Id => "the time inside the message id (UUIDv7, else MassTransit's NewId)",
            TimeSource::SentTime => "the envelope's sentTime, else the AMQP timestamp",
            TimeSource::Timestamp => "the AMQP timestamp property",
        }
    }

    /// The time of the message `message_id` that carries `carried`, as this source reads it; `None` when it carries
    /// none.
    pub fn time_of(self, message_id: Uuid, carried: &Carried) -> Option<DateTime<Utc>> {
        match self {
            TimeSource::Id => Some(id_time(message_id)),
            TimeSource::SentTime => carried.sent_time.or(carried.timestamp),
            TimeSource::Timestamp => carried.timestamp,
        }
    }
}

/// The times a delivery carries besides its id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// The MassTransit envelope's `sentTime`.
    pub sent_time: Option<DateTime<Utc>>,
    /// The AMQP `timestamp` property.
    pub timestamp: Option<DateTime<Utc>>,
}

/// The time inside an id: a UUIDv7's milliseconds, else the ticks of a MassTransit NewId (which is what a random id
/// is read as too: its "time" is then anywhere, and it is refused as outside the inbox's partitions).
///
/// A NewId's version nibble is a byte of its host's worker id, so one .NET host in 16 writes ids that say "version 7";
/// read as UUIDv7, their time lands anywhere in 8,900 years. An id that says version 7 is read as a NewId when its
/// UUIDv7 time is not plausible (before 2000 or from 2100) and its NewId time is; otherwise as the UUIDv7 it says it
/// is. Both readings come from the id alone, so every copy of a message gets the same time.
pub fn id_time(message_id: Uuid) -> DateTime<Utc> {
    let new_id = ticks_time(ids::new_id_ticks(message_id));
    if let (uuid::Version::SortRand, Some(ts)) = (
        message_id.get_version().unwrap_or(uuid::Version::Nil),
        message_id.get_timestamp(),
    ) {
        let (seconds, nanos) = ts.to_unix();
        if let Some(t) = i64::try_from(seconds)
            .ok()
            .and_then(|s| Utc.timestamp_opt(s, nanos).single())
            && (plausible(t) || !plausible(new_id))
        {
            return t;
        }
    }
    new_id
}

/// Whether `t` could be when a message was sent: from 2000 (see [`earliest`]), before 2100.
fn plausible(t: DateTime<Utc>) -> bool {
    let end = Utc
        .with_ymd_and_hms(2100, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    t >= earliest() && t < end
}

/// .NET ticks (100 ns since 0001-01-01 UTC) as a time; out of range reads as the earliest time, which no partition
/// holds.
fn ticks_time(ticks: u64) -> DateTime<Utc> {
    const UNIX_EPOCH_TICKS: i128 = 621_355_968_000_000_000;
    let since_epoch = i128::from(ticks) - UNIX_EPOCH_TICKS;
    let seconds = since_epoch.div_euclid(10_000_000);
    let nanos = u32::try_from(since_epoch.rem_euclid(10_000_000) * 100).unwrap_or(0);
    i64::try_from(seconds)
        .ok()
        .and_then(|s| Utc.timestamp_opt(s, nanos).single())
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The earliest time a partitioned inbox keys a message on: its rows from before it was partitioned (and rows written
/// by services that set no time) lie below it, in the untimed partition, which no message time may reach.
pub fn earliest() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v7_id_gives_its_milliseconds_and_a_new_id_its_ticks() {
        let at = Utc
            .with_ymd_and_hms(2026, 12, 2, 10, 30, 0)
            .single()
            .expect("time");
        let v7 = Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            u64::try_from(at.timestamp()).expect("after 1970"),
            0,
        ));
        assert_eq!(id_time(v7), at);
        // A captured MassTransit NewId and the sentTime MassTransit wrote beside it: 2026-11-30T20:14:42.2177304Z.
        let new_id = Uuid::parse_str("1a280000-161d-4c08-9e18-08df4f1e91b6").expect("uuid");
        let sent = DateTime::parse_from_rfc3339("2026-11-30T20:14:42.2177304Z")
            .expect("time")
            .with_timezone(&Utc);
        assert!((id_time(new_id) - sent).num_milliseconds().abs() < 5);
        // The same NewId from a host whose worker id puts a 7 where a UUID's version goes: still its NewId time.
        let sevenish = Uuid::parse_str("1a280000-161d-7c08-9e18-08df4f1e91b6").expect("uuid");
        assert_eq!(sevenish.get_version_num(), 7);
        assert!((id_time(sevenish) - sent).num_milliseconds().abs() < 5);
        // The process's own NewIds read back as now.
        let now = id_time(ids::new_id());
        assert!((now - Utc::now()).num_seconds().abs() < 5);
    }

    #[test]
    fn each_source_reads_its_own_time_and_copies_read_the_same() {
        let id = ids::new_id();
        let sent = Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).single();
        let stamp = Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 6).single();
        let both = Carried {
            sent_time: sent,
            timestamp: stamp,
        };
        assert_eq!(TimeSource::SentTime.time_of(id, &both), sent);
        assert_eq!(TimeSource::Timestamp.time_of(id, &both), stamp);
        let only_stamp = Carried {
            sent_time: None,
            timestamp: stamp,
        };
        assert_eq!(TimeSource::SentTime.time_of(id, &only_stamp), stamp);
        assert_eq!(TimeSource::Timestamp.time_of(id, &Carried::default()), None);
        // The id's time does not depend on what else a copy carries (a re-send with a new sentTime).
        assert_eq!(
            TimeSource::Id.time_of(id, &both),
            TimeSource::Id.time_of(id, &Carried::default())
        );
    }

    #[test]
    fn ticks_out_of_range_read_as_no_time_any_partition_holds() {
        assert!(ticks_time(0) < earliest());
        assert!(ticks_time(u64::MAX) > Utc::now());
    }
}
