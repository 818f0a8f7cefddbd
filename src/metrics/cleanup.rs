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

/// The most consumer_types a metric has a series of: the rest are summed under [`OTHERS`]. A table written by a
/// service that makes one consumer_type a tenant (or a message) would otherwise give the scrape one series each, for
/// the life of the process.
const MAX_SERIES: usize = 256;

/// The label of what is summed past [`MAX_SERIES`].
const OTHERS: &str = "(others)";

/// What the cleanups of this process did.
#[derive(Debug, Default)]
pub struct Totals {
    runs: u64,
    failed_runs: u64,
    deleted: BTreeMap<String, u64>,
    events_deleted: u64,
    /// On a partitioned inbox, whole partitions dropped and the rows they held (as estimated): of every
    /// consumer_type at once, and not in `deleted`, which counts the rows deleted one by one.
    partitions_dropped: u64,
    partition_rows_dropped: u64,
    unprocessed_older: BTreeMap<String, u64>,
    /// Consumer_types the last run's guard kept whole (a replay waiting needs their rows).
    refused: u64,
    last_success: Option<f64>,
}

impl Totals {
    /// A run of `--every` that failed (said, and the schedule went on).
    /// Counts a run that failed before it had a report: a run, and a failed one (`runs_failed` never above `runs`).
    pub fn failed(&mut self) {
        self.runs += 1;
        self.failed_runs += 1;
    }

    /// Counts a finished run. The rows never processed are the last run's, each consumer_type it measured: one whose
    /// rows went since (an operator deleted them) is no longer exported, rather than its old figure for good. A
    /// complete run's success is stamped when it ended: one whose guard kept a consumer_type's rows is not complete
    /// (a dead-lettered message left waiting holds cleanup back until it is replayed or the run forced), so an alert
    /// on the stamp growing old sees it.
    pub fn add(&mut self, report: &Report) {
        self.add_at(report, chrono::Utc::now());
    }

    fn add_at(&mut self, report: &Report, ended: chrono::DateTime<chrono::Utc>) {
        self.runs += 1;
        self.unprocessed_older = BTreeMap::new();
        for c in &report.consumers {
            *bounded_entry(&mut self.unprocessed_older, &c.consumer_type) += c.unprocessed_older;
        }
        self.refused = report.refused;
        // A run that failed after deleting counts as failed too (what it deleted is counted all the same); a dry run
        // that failed too.
        if report.failed.is_some() {
            self.failed_runs += 1;
        }
        // A dry run (`--every --dry-run`) deletes nothing: its "would delete" counts are no deletions, and it is no
        // success an alert on the stamp may take for one (what it measured, above, it did measure).
        if report.dry_run {
            return;
        }
        self.events_deleted += report.events_deleted;
        if let Some(work) = &report.partitions {
            // Leftovers of a stopped drop, dropped now, too (their rows are not estimated).
            self.partitions_dropped += (work.dropped.len() + work.leftovers.len()) as u64;
            self.partition_rows_dropped += work.rows_dropped();
        }
        for c in &report.consumers {
            *bounded_entry(&mut self.deleted, &c.consumer_type) += c.deleted;
        }
        if report.outcome() == crate::error::Outcome::Done {
            self.last_success = Some(ended.timestamp_millis() as f64 / 1000.0);
        }
    }
}

/// The entry of `consumer_type` in `m`, or of [`OTHERS`] once `m` holds [`MAX_SERIES`] (theirs included).
fn bounded_entry<'m>(m: &'m mut BTreeMap<String, u64>, consumer_type: &str) -> &'m mut u64 {
    let key = if m.contains_key(consumer_type) || m.len() < MAX_SERIES - 1 {
        consumer_type
    } else {
        OTHERS
    };
    m.entry(key.to_owned()).or_default()
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
            "Cleanup runs, however they ended (failed ones too).",
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
        let dropped = [(UNLABELLED, ConstCounter::new(t.partitions_dropped))];
        let help = "Partitions of a partitioned inbox dropped whole, every row past the window.";
        encode_family(
            e,
            "inbox_cleanup_partitions_dropped",
            help,
            counter,
            dropped,
        )?;
        let rows = [(UNLABELLED, ConstCounter::new(t.partition_rows_dropped))];
        let help = "Inbox rows the dropped partitions held, as the planner estimated them (not in \
                    inbox_cleanup_rows_deleted, which counts rows deleted by batch).";
        encode_family(
            e,
            "inbox_cleanup_partition_rows_dropped",
            help,
            counter,
            rows,
        )?;
        let unprocessed = per_type(&t.unprocessed_older).map(|(l, v)| (l, ConstGauge::new(v)));
        let help = "Rows received before the cutoff and never processed, at the last run.";
        let name = "inbox_unprocessed_older_than_retention_rows";
        encode_family(e, name, help, MetricType::Gauge, unprocessed)?;
        let refused = [(UNLABELLED, ConstGauge::new(t.refused))];
        let help = "Consumer_types whose rows the last run kept whole: a dead-lettered message waiting for replay \
                    needs them.";
        let name = "inbox_cleanup_refused_consumer_types";
        encode_family(e, name, help, MetricType::Gauge, refused)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cleanup::ConsumerReport;

    fn report(consumers: &[(&str, u64)]) -> Report {
        Report {
            consumers: consumers
                .iter()
                .map(|(consumer_type, unprocessed_older)| ConsumerReport {
                    consumer_type: (*consumer_type).to_owned(),
                    unprocessed_older: *unprocessed_older,
                    ..ConsumerReport::default()
                })
                .collect(),
            ..Report::default()
        }
    }

    /// A table of ten thousand consumer_types (one a tenant, say) gives the scrape at most 256 series a metric, the
    /// rest summed under `(others)`; the gauge of the rows never processed is the last run's, bounded alike.
    #[test]
    fn the_series_per_consumer_type_are_bounded() {
        let mut totals = Totals::default();
        let many: Vec<(String, u64)> = (0..10_000).map(|i| (format!("c{i:05}"), 1)).collect();
        let many: Vec<(&str, u64)> = many.iter().map(|(c, n)| (c.as_str(), *n)).collect();
        totals.add(&report(&many));
        assert_eq!(totals.deleted.len(), MAX_SERIES);
        assert_eq!(totals.unprocessed_older.len(), MAX_SERIES);
        assert_eq!(totals.unprocessed_older.values().sum::<u64>(), 10_000);
        assert_eq!(
            totals.unprocessed_older[OTHERS],
            10_000 - (MAX_SERIES as u64 - 1)
        );
        totals.add(&report(&[("carrier", 0)]));
        assert_eq!(
            totals.deleted.len(),
            MAX_SERIES,
            "no new series past the bound"
        );
        assert!(totals.deleted.contains_key(OTHERS));
        assert_eq!(
            totals.unprocessed_older,
            BTreeMap::from([("carrier".to_owned(), 0)])
        );
    }

    #[test]
    fn the_rows_never_processed_are_the_last_runs_and_success_is_stamped_at_the_end() {
        let mut totals = Totals::default();
        let start = chrono::Utc::now();
        totals.add_at(&report(&[("legacy", 10_000_000), ("carrier", 0)]), start);
        let end = start + chrono::TimeDelta::hours(2);
        totals.add_at(&report(&[("carrier", 0)]), end);
        assert_eq!(
            totals.unprocessed_older,
            BTreeMap::from([("carrier".to_owned(), 0)]),
            "legacy's rows went: its gauge with them"
        );
        assert_eq!(totals.runs, 2);
        assert_eq!(
            totals.last_success,
            Some(end.timestamp_millis() as f64 / 1000.0)
        );
    }

    /// A dry run counts as a run, and nothing else: what it would delete is not deleted, and it is no success.
    #[test]
    fn a_dry_run_deletes_nothing_and_is_no_success() {
        let mut totals = Totals::default();
        let mut dry = report(&[("carrier", 0)]);
        dry.dry_run = true;
        dry.events_deleted = 7;
        dry.consumers[0].deleted = 50;
        totals.add_at(&dry, chrono::Utc::now());
        assert_eq!(totals.runs, 1);
        assert_eq!(totals.last_success, None);
        assert_eq!(totals.events_deleted, 0);
        assert!(
            totals.deleted.values().all(|d| *d == 0),
            "{:?}",
            totals.deleted
        );
    }

    /// A run that failed after deleting counts what it deleted, and as a failed run, not a success.
    #[test]
    fn a_run_that_failed_after_deleting_counts_its_rows_and_its_failure() {
        let mut totals = Totals::default();
        let mut failed = report(&[("carrier", 0)]);
        failed.failed = Some("audit pruning refused".to_owned());
        failed.consumers[0].deleted = 100;
        totals.add_at(&failed, chrono::Utc::now());
        assert_eq!(totals.failed_runs, 1);
        assert_eq!(totals.last_success, None);
        assert_eq!(totals.deleted.get("carrier"), Some(&100));
        // One that failed before it had a report, and a dry run that failed: runs, and failed ones.
        totals.failed();
        let mut dry = report(&[("carrier", 0)]);
        dry.dry_run = true;
        dry.failed = Some("refused".to_owned());
        totals.add_at(&dry, chrono::Utc::now());
        assert_eq!((totals.runs, totals.failed_runs), (3, 3));
    }

    /// On a partitioned inbox the old rows go with whole partitions: counted (partitions, and their rows as
    /// estimated) beside the rows deleted by batch, which stayed near 0 while millions of rows went.
    #[test]
    fn partitions_dropped_and_their_rows_are_counted() {
        let mut totals = Totals::default();
        let mut run = report(&[("carrier", 0)]);
        let dropped = |name: &str, rows| crate::cleanup::partitions::Dropped {
            partition: name.to_owned(),
            from: None,
            to: None,
            rows_estimated: rows,
        };
        run.partitions = Some(crate::cleanup::partitions::PartitionWork {
            dropped: vec![dropped("p1", Some(4_000_000)), dropped("p2", None)],
            leftovers: vec!["p0".to_owned()],
            ..Default::default()
        });
        totals.add_at(&run, chrono::Utc::now());
        let mut dry = run.clone();
        dry.dry_run = true;
        totals.add_at(&dry, chrono::Utc::now());
        assert_eq!(totals.partitions_dropped, 3);
        assert_eq!(totals.partition_rows_dropped, 4_000_000);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(
            &mut text,
            &registry(Arc::new(Mutex::new(totals))),
        )
        .expect("encode");
        assert!(
            text.contains("inbox_cleanup_partitions_dropped_total 3"),
            "{text}"
        );
        assert!(
            text.contains("inbox_cleanup_partition_rows_dropped_total 4000000"),
            "{text}"
        );
    }

    /// A run whose guard kept a consumer_type's rows is not a complete one: the stamp stays at the last that was,
    /// and the refusals are a gauge of their own.
    #[test]
    fn a_run_that_kept_rows_for_a_waiting_replay_is_not_a_success() {
        let mut totals = Totals::default();
        let start = chrono::Utc::now();
        totals.add_at(&report(&[("carrier", 0)]), start);
        let mut refused = report(&[("carrier", 0)]);
        refused.refused = 1;
        totals.add_at(&refused, start + chrono::TimeDelta::hours(1));
        assert_eq!(
            totals.last_success,
            Some(start.timestamp_millis() as f64 / 1000.0)
        );
        assert_eq!(totals.refused, 1);
        totals.add_at(
            &report(&[("carrier", 0)]),
            start + chrono::TimeDelta::hours(2),
        );
        assert_eq!(totals.refused, 0);
    }
}
