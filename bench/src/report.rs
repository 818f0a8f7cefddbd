//! What a run measured: per mode and repeat, with medians, spreads and ratios, and the machine it ran on. Its JSON is
//! what `--output` writes and what the results in `bench/results-*.json` hold.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{cleanup, peer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Ceiling,
    CeilingBatched,
    Bare,
    Tutorial,
    Inbox,
    /// `inbox` with the claim and the effect as statements of their own between `BEGIN` and `COMMIT` (four round
    /// trips), as an effect that is not one statement is made: what sending them as one statement saves.
    InboxTransaction,
    InboxBatched,
    /// `inbox` on a quorum queue: what replicating the queue costs (on one node here: the cost without the network).
    InboxQuorum,
    /// The same consumer with no work and no inbox: every delivery read, its envelope parsed, acknowledged, nothing
    /// written for it. The broker's and the consumer's own part: the most this consumer does on this machine.
    Broker,
    /// `broker` in batches of the `inbox-batched` size, each acknowledged with one `basic.ack multiple`.
    BrokerBatched,
    Peer,
}

impl Mode {
    /// Every mode, in the order the tables show them.
    pub const ALL: [Mode; 11] = [
        Mode::Ceiling,
        Mode::CeilingBatched,
        Mode::Bare,
        Mode::Tutorial,
        Mode::Inbox,
        Mode::InboxTransaction,
        Mode::InboxBatched,
        Mode::InboxQuorum,
        Mode::Broker,
        Mode::BrokerBatched,
        Mode::Peer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Ceiling => "ceiling",
            Mode::CeilingBatched => "ceiling-batched",
            Mode::Bare => "bare",
            Mode::Tutorial => "tutorial",
            Mode::Inbox => "inbox",
            Mode::InboxTransaction => "inbox-transaction",
            Mode::InboxBatched => "inbox-batched",
            Mode::InboxQuorum => "inbox-quorum",
            Mode::Broker => "broker",
            Mode::BrokerBatched => "broker-batched",
            Mode::Peer => "peer",
        }
    }

    /// Whether the mode claims in the inbox (and so is measured against a prefilled one with `--inbox-rows`).
    pub fn claims(self) -> bool {
        matches!(
            self,
            Mode::Inbox
                | Mode::InboxTransaction
                | Mode::InboxBatched
                | Mode::InboxQuorum
                | Mode::Ceiling
                | Mode::CeilingBatched
        )
    }

    /// Whether the mode does no work for a message: nothing written, so its throughput is the consumer's own count
    /// of what it acknowledged ([`crate::guard::Span`]), not the effects' times.
    pub fn writes_nothing(self) -> bool {
        matches!(self, Mode::Broker | Mode::BrokerBatched)
    }

    pub fn database_suffix(self) -> &'static str {
        match self {
            Mode::InboxBatched => "inbox_batched",
            Mode::InboxTransaction => "inbox_transaction",
            Mode::InboxQuorum => "inbox_quorum",
            Mode::CeilingBatched => "ceiling_batched",
            Mode::BrokerBatched => "broker_batched",
            other => other.name(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub modes: Vec<Mode>,
    pub messages: u64,
    pub repeats: u32,
    pub concurrency: u16,
    pub prefetch: u16,
    pub batch_size: u16,
    pub warmup: u64,
    /// Steady rate for the latency run, messages per second, for `latency_seconds`.
    pub latency_rate: f64,
    pub latency_seconds: u64,
    /// Messages of the duplicate run, and the fraction of them that arrive twice.
    pub duplicate_messages: u64,
    pub duplicates: f64,
    /// Keep the scratch databases and queues afterwards.
    pub keep: bool,
    /// The kind of message ids published.
    pub ids: inboxctl::ids::IdKind,
    /// Rows the inbox modes' inbox holds before they are measured.
    pub inbox_rows: u64,
    /// That inbox partitioned by day on the time inside the ids.
    pub inbox_partitioned: bool,
    /// The `inboxctl cleanup` settings measured at many rows.
    pub cleanup_batch_size: i64,
    pub cleanup_batch_pause: Duration,
    /// The cleanup runs measured, and how many times.
    pub cleanup_variants: Vec<crate::cleanup::Variant>,
    pub cleanup_repeats: u32,
    /// What the modes' queues are declared as.
    pub queue_type: inboxctl::amqp::topology::QueueType,
}

/// One measurement of one mode.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Repeat {
    pub throughput: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub duplicate_effects: Option<u64>,
    pub rss_mb: Option<f64>,
}

/// Median, smallest and largest of the repeats.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let median = if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
        };
        Some(Self {
            median,
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    pub throughput: Option<Spread>,
    pub p50_ms: Option<Spread>,
    pub p99_ms: Option<Spread>,
    /// The largest count of any repeat.
    pub duplicate_effects: Option<u64>,
    /// The largest peak of any repeat.
    pub rss_mb: Option<f64>,
    pub repeats: Vec<Repeat>,
}

impl ModeReport {
    pub fn of(repeats: Vec<Repeat>) -> Self {
        let collect =
            |f: fn(&Repeat) -> Option<f64>| repeats.iter().filter_map(f).collect::<Vec<_>>();
        Self {
            throughput: Spread::of(&collect(|r| Some(r.throughput))),
            p50_ms: Spread::of(&collect(|r| r.p50_ms)),
            p99_ms: Spread::of(&collect(|r| r.p99_ms)),
            duplicate_effects: repeats.iter().filter_map(|r| r.duplicate_effects).max(),
            rss_mb: collect(|r| r.rss_mb).into_iter().reduce(f64::max),
            repeats,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub os: String,
    pub postgres_version: String,
    pub synchronous_commit: String,
    pub rabbitmq_version: Option<String>,
    pub inboxctl_version: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub messages: u64,
    pub repeats: u32,
    pub concurrency: u16,
    pub prefetch: u16,
    pub batch_size: u16,
    pub warmup: u64,
    pub latency_rate: f64,
    pub latency_seconds: u64,
    pub duplicate_messages: u64,
    pub duplicates: f64,
    /// The kind of message ids (`newid`, `v7`, `v4`).
    pub id_kind: &'static str,
    /// Rows the inbox modes' inbox held before they were measured.
    pub inbox_rows: u64,
    /// That inbox partitioned by day on the time inside the ids.
    pub inbox_partitioned: bool,
    /// What the modes' queues were declared as (`classic`, `quorum`).
    pub queue_type: &'static str,
    /// The peer's configuration, when it ran.
    pub peer: Option<peer::PeerSettings>,
}

impl Settings {
    pub fn of(options: &Options, peer: Option<&peer::Peer>) -> Self {
        Self {
            messages: options.messages,
            repeats: options.repeats,
            concurrency: options.concurrency,
            prefetch: options.prefetch,
            batch_size: options.batch_size,
            warmup: options.warmup,
            latency_rate: options.latency_rate,
            latency_seconds: options.latency_seconds,
            duplicate_messages: options.duplicate_messages,
            duplicates: options.duplicates,
            id_kind: crate::prefill::kind_name(options.ids),
            inbox_rows: options.inbox_rows,
            inbox_partitioned: options.inbox_partitioned,
            queue_type: options.queue_type.name(),
            peer: peer.map(|p| p.settings(options.concurrency)),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub settings: Settings,
    pub started_at: DateTime<Utc>,
    pub modes: BTreeMap<&'static str, ModeReport>,
    /// Each mode's throughput over another's, per repeat (same repeat), with their median.
    pub ratios: BTreeMap<String, Spread>,
    pub cleanup: Option<cleanup::CleanupReport>,
    pub refresh_ms: Option<BTreeMap<String, Spread>>,
}

pub fn ms(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.1} ms"))
}

/// Throughput ratios per repeat, e.g. `inbox/bare`.
pub fn ratios(repeats: &BTreeMap<Mode, Vec<Repeat>>) -> BTreeMap<String, Spread> {
    let pairs = [
        (Mode::Inbox, Mode::Bare),
        (Mode::InboxBatched, Mode::Bare),
        (Mode::Inbox, Mode::Tutorial),
        (Mode::Inbox, Mode::Peer),
        (Mode::Inbox, Mode::Ceiling),
        (Mode::InboxBatched, Mode::Ceiling),
        (Mode::InboxBatched, Mode::CeilingBatched),
        (Mode::Bare, Mode::Ceiling),
        (Mode::InboxQuorum, Mode::Inbox),
        (Mode::Inbox, Mode::InboxTransaction),
        (Mode::InboxTransaction, Mode::Bare),
        (Mode::Inbox, Mode::Broker),
        (Mode::Bare, Mode::Broker),
        (Mode::InboxBatched, Mode::BrokerBatched),
    ];
    let mut out = BTreeMap::new();
    for (a, b) in pairs {
        let (Some(ra), Some(rb)) = (repeats.get(&a), repeats.get(&b)) else {
            continue;
        };
        let per_repeat: Vec<f64> = ra
            .iter()
            .zip(rb)
            .filter(|(_, y)| y.throughput > 0.0)
            .map(|(x, y)| x.throughput / y.throughput)
            .collect();
        if let Some(spread) = Spread::of(&per_repeat) {
            out.insert(format!("{}/{}", a.name(), b.name()), spread);
        }
    }
    out
}

/// The value below which `q` of the sorted `values` lie (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_and_percentiles() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).expect("spread");
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(
            Spread::of(&[1.0, 2.0, 3.0, 4.0]).map(|s| s.median),
            Some(2.5)
        );
        assert!(Spread::of(&[]).is_none());
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.5), Some(50.0));
        assert_eq!(percentile(&sorted, 0.99), Some(99.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn ratios_pair_the_same_repeats() {
        let r = |t: f64| Repeat {
            throughput: t,
            ..Repeat::default()
        };
        let mut repeats = BTreeMap::new();
        repeats.insert(Mode::Bare, vec![r(100.0), r(200.0), r(100.0)]);
        repeats.insert(Mode::Inbox, vec![r(80.0), r(100.0), r(90.0)]);
        let ratios = ratios(&repeats);
        let s = ratios["inbox/bare"];
        assert_eq!((s.median, s.min, s.max), (0.8, 0.5, 0.9));
    }
}
