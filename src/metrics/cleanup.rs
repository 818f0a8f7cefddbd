//! What `cleanup --every --metrics-addr` exports: what the cleanups of this process did, read from its [`Totals`] at
//! each scrape.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{ConsumerLabel, Health, UNLABELLED, encode_family};
use crate::cleanup::Report;

/// What the cleanups of this process did.
#[derive(Debug, Default)]
pub struct Totals {
    runs: u64,
    failed_runs: u64,
    deleted: BTreeMap<String, u64>,
    events_deleted: u64,
    unprocessed_older: BTreeMap<String, u64>,
    last_success: Option<f64>,
}

impl Totals {
    /// A run of `--every` that failed (said, and the schedule went on).
    pub fn failed(&mut self) {
        self.failed_runs += 1;
    }

    pub fn add(&mut self, report: &Report) {
        self.runs += 1;
        self.events_deleted += report.events_deleted;
        for c in &report.consumers {
            *self.deleted.entry(c.consumer_type.clone()).or_default() += c.deleted;
            self.unprocessed_older
                .insert(c.consumer_type.clone(), c.unprocessed_older);
        }
        if !report.interrupted {
            self.last_success =
                Some(report.cutoff.timestamp() as f64 + report.retention_seconds as f64);
        }
    }
}

/// The registry of the cleanups' metrics.
pub fn registry(totals: Arc<Mutex<Totals>>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(TotalsCollector(totals)));
    registry
}

#[derive(Debug)]
struct TotalsCollector(Arc<Mutex<Totals>>);

/// One sample per consumer_type.
fn per_type(m: &BTreeMap<String, u64>) -> impl Iterator<Item = (ConsumerLabel, u64)> + '_ {
    m.iter().map(|(consumer_type, v)| {
        let label = ConsumerLabel {
            consumer_type: consumer_type.clone(),
        };
        (label, *v)
    })
}

impl Collector for TotalsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let e = &mut encoder;
        // Counters are named without `_total`: the encoder adds it.
        let counter = MetricType::Counter;
        let runs = [(UNLABELLED, ConstCounter::new(t.runs))];
        encode_family(
            e,
            "inbox_cleanup_runs",
            "Cleanup runs finished.",
            counter,
            runs,
        )?;
        let failed = [(UNLABELLED, ConstCounter::new(t.failed_runs))];
        let help = "Cleanup runs that failed (--every goes on to the next).";
        encode_family(e, "inbox_cleanup_runs_failed", help, counter, failed)?;
        let deleted = per_type(&t.deleted).map(|(l, v)| (l, ConstCounter::new(v)));
        let help = "Processed inbox rows deleted.";
        encode_family(e, "inbox_cleanup_rows_deleted", help, counter, deleted)?;
        let events = [(UNLABELLED, ConstCounter::new(t.events_deleted))];
        let help = "inboxctl event rows deleted.";
        encode_family(e, "inbox_cleanup_events_deleted", help, counter, events)?;
        let unprocessed = per_type(&t.unprocessed_older).map(|(l, v)| (l, ConstGauge::new(v)));
        let help = "Rows received before the cutoff and never processed, at the last run.";
        let name = "inbox_unprocessed_older_than_retention_rows";
        encode_family(e, name, help, MetricType::Gauge, unprocessed)?;
        if let Some(at) = t.last_success {
            let help = "When the last complete cleanup ran (Unix time).";
            let name = "inbox_cleanup_last_success_timestamp_seconds";
            let at = [(UNLABELLED, ConstGauge::new(at))];
            encode_family(e, name, help, MetricType::Gauge, at)?;
        }
        Ok(())
    }
}

/// A cleanup depends on PostgreSQL alone.
pub struct CleanupHealth {
    pub pool: sqlx::PgPool,
}

impl Health for CleanupHealth {
    fn check(&self) -> BoxFuture<'_, Vec<(&'static str, bool)>> {
        Box::pin(async move { vec![("database", super::database_up(&self.pool).await)] })
    }
}
