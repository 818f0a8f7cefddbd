//! What `consume --metrics-addr` exports, every metric labelled with the consumer's consumer_type: the run's counters
//! and whether it holds a broker connection (read from its [`RunCounts`] at each scrape), and two histograms it feeds
//! as it goes through [`Timings`].

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use sqlx::PgPool;

use super::{ConsumerLabel, Health, SECONDS_BUCKETS, encode_family};
use crate::consumer::RunCounts;
use crate::inbox::{ClaimObserver, ConsumerType};

/// The consumer's histograms, fed as it goes: the time each delivery's handling took (by the consumer) and the time
/// each claim statement took (by its inbox, as its [`ClaimObserver`]). Cheap to clone: the clones feed the same
/// histograms.
#[derive(Debug, Clone)]
pub struct Timings {
    processing: Histogram,
    claim_wait: Histogram,
}

impl Timings {
    /// A delivery reached its outcome after `took`.
    pub fn handled(&self, took: Duration) {
        self.processing.observe(took.as_secs_f64());
    }
}

impl ClaimObserver for Timings {
    fn claimed(&self, took: Duration) {
        self.claim_wait.observe(took.as_secs_f64());
    }
}

fn seconds_histogram() -> Histogram {
    Histogram::new(SECONDS_BUCKETS)
}

/// The registry of a consumer's metrics, and the timings it is to feed.
pub fn registry(consumer_type: &ConsumerType, counts: Arc<RunCounts>) -> (Registry, Timings) {
    let label = ConsumerLabel {
        consumer_type: consumer_type.to_string(),
    };
    let mut registry = Registry::default();
    let mut histogram = |name: &str, help: &str| {
        let family = Family::<ConsumerLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            seconds_histogram,
        );
        registry.register(name, help, family.clone());
        // Created now, so that both are exported (with a count of 0) before the first message.
        family.get_or_create_owned(&label)
    };
    // The registry ends each help text with a full stop.
    let timings = Timings {
        processing: histogram(
            "inbox_processing_seconds",
            "Time to handle a delivery that reached an outcome, from when a worker took it up (alone, or in its \
             batch) to its outcome committed or its dead-letter copy confirmed, retries included",
        ),
        claim_wait: histogram(
            "inbox_claim_wait_seconds",
            "Time the claim statement took (one per message, or per batch; with the effect when the two go as one \
             statement): how long a copy waited on another attempt at its message",
        ),
    };
    registry.register_collector(Box::new(Counts { label, counts }));
    (registry, timings)
}

/// The run's counters, read at each scrape.
#[derive(Debug)]
struct Counts {
    label: ConsumerLabel,
    counts: Arc<RunCounts>,
}

impl Collector for Counts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = self.counts.summary();
        let deliveries = s.processed + s.duplicates + s.conflicts + s.dead_lettered + s.skipped;
        // Counters are named without `_total`: the encoder adds it.
        for (name, help, value) in [
            (
                "inbox_deliveries",
                "Deliveries that reached an outcome (processed, duplicate, conflict, dead-lettered, skipped).",
                deliveries,
            ),
            (
                "inbox_messages_processed",
                "Messages processed: their effects committed with their inbox row.",
                s.processed,
            ),
            (
                "inbox_duplicates_discarded",
                "Copies recognised by the inbox and discarded.",
                s.duplicates,
            ),
            (
                "inbox_attempts_failed",
                "Attempts whose work failed and was rolled back (retried or dead-lettered).",
                s.failed_attempts,
            ),
            (
                "inbox_messages_dead_lettered",
                "Messages moved to <queue>_error.",
                s.dead_lettered,
            ),
            (
                "inbox_messages_skipped",
                "Messages of a type the consumer does not handle, moved to <queue>_skipped.",
                s.skipped,
            ),
            (
                "inbox_conflicts",
                "Messages whose id was processed before for another event (an id reused by a producer): not processed.",
                s.conflicts,
            ),
        ] {
            let sample = (self.label.clone(), ConstCounter::new(value));
            encode_family(&mut encoder, name, help, MetricType::Counter, [sample])?;
        }
        let up = i64::from(self.counts.broker_connected());
        encode_family(
            &mut encoder,
            "inbox_broker_connected",
            "1 while the consumer consumes its queue (partitioned: every one of its partitions) on a working RabbitMQ connection.",
            MetricType::Gauge,
            [(self.label.clone(), ConstGauge::new(up))],
        )
    }
}

/// A consumer depends on PostgreSQL and RabbitMQ.
pub struct ConsumerHealth {
    /// A pool of its own for the look (one connection): on the messages' pool, a look would wait for a connection
    /// every worker holds (a claim waiting on a key, a keyed call) and report a healthy database down.
    pub pool: PgPool,
    pub counts: Arc<RunCounts>,
}

impl Health for ConsumerHealth {
    fn check(&self) -> BoxFuture<'_, Vec<(&'static str, bool)>> {
        Box::pin(async move {
            vec![
                // Up when it answers and no queue holds its deliveries for it: a consumer whose claims the
                // database refuses (a grant taken away) answers a `SELECT 1` and processes nothing.
                (
                    "database",
                    self.counts.database_taken() && super::database_up(&self.pool).await,
                ),
                ("broker", self.counts.broker_connected()),
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::prometheus_text;

    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let counts = Arc::new(RunCounts::default());
        counts
            .duplicates
            .store(3, std::sync::atomic::Ordering::Relaxed);
        let label = ConsumerLabel {
            consumer_type: "a\"b\\c\nd".to_owned(),
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Counts { label, counts }));
        let mut out = String::new();
        prometheus_text::encode(&mut out, &registry).expect("encoded");
        assert!(
            out.contains(
                "# HELP inbox_duplicates_discarded_total Copies recognised by the inbox and discarded.\n\
                 # TYPE inbox_duplicates_discarded_total counter\n\
                 inbox_duplicates_discarded_total{consumer_type=\"a\\\"b\\\\c\\nd\"} 3\n"
            ),
            "{out}"
        );
    }
}
