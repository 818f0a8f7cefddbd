//! The rates of a consumer_type: its window's counters and a series per bucket over the span, read from its newest
//! processed rows and events (a bounded number each look) and estimated past them at the rate of those read.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Counts, Range, SERIES_AT_MOST, SERIES_AT_MOST_LIVE};
use crate::db;
use crate::error::Result;

/// The window's counters and a series of (deliveries, duplicates) per bucket over the span, oldest first, and whether
/// they are in part estimated (more rows or events in the span than one look reads: see [`unread`]).
pub(super) async fn counters(
    conn: &mut sqlx::PgConnection,
    consumer_type: &str,
    range: Range,
) -> Result<(Counts, Vec<(u64, u64)>, bool)> {
    let buckets = range.buckets(range.span);
    let in_window = range.buckets(range.window);
    let at_most = if range.live {
        SERIES_AT_MOST_LIVE
    } else {
        SERIES_AT_MOST
    };
    let mut per_bucket: BTreeMap<usize, Counts> = BTreeMap::new();
    let processed =
        db::stats::processed_series(&mut *conn, consumer_type, range.span, range.bucket, at_most)
            .await?;
    let mut estimated = false;
    // Estimated: the window's figures, when a bucket of the window is (the series beyond it may be, the rates not).
    for (age, n) in unread(&processed, at_most, range.bucket, buckets) {
        per_bucket.entry(age).or_default().processed += n;
        estimated |= age < in_window;
    }
    for b in processed {
        per_bucket
            .entry(usize::try_from(b.age).unwrap_or(0))
            .or_default()
            .processed += b.count.unsigned_abs();
    }
    let events =
        db::stats::event_series(&mut *conn, consumer_type, range.span, range.bucket, at_most)
            .await?;
    let read: u64 = events.iter().map(|b| b.count.unsigned_abs()).sum();
    if read >= at_most {
        // The newest events of every kind together were read up to the cap: each kind's rest is estimated at its own
        // rate over the stretch they reach back.
        let reach = events.iter().map(|b| b.oldest).fold(0.0, f64::max);
        let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
        for b in &events {
            *kinds.entry(b.kind.as_str()).or_default() += b.count.unsigned_abs();
        }
        for (kind, n) in kinds {
            for (age, more) in rest(n, reach, range.bucket, buckets) {
                per_bucket.entry(age).or_default().add(kind, more);
                estimated |= age < in_window;
            }
        }
    }
    for b in events {
        per_bucket
            .entry(usize::try_from(b.age).unwrap_or(0))
            .or_default()
            .add(&b.kind, b.count.unsigned_abs());
    }
    let mut total = Counts::default();
    let mut series = vec![(0, 0); buckets];
    for (age, c) in &per_bucket {
        if *age < in_window {
            total.processed += c.processed;
            total.duplicates += c.duplicates;
            total.failed += c.failed;
            total.dead_lettered += c.dead_lettered;
            total.skipped += c.skipped;
            total.conflicts += c.conflicts;
        }
        // Bucket 0 is the newest; the series runs oldest first.
        if let Some(slot) = buckets.checked_sub(age + 1).and_then(|i| series.get_mut(i)) {
            *slot = (c.deliveries(), c.duplicates);
        }
    }
    Ok((total, series, estimated))
}

/// What a read of a series capped at `at_most` rows left unread, estimated per bucket: nothing when it read fewer
/// (every row of the span); else, the rows read reaching back only so far, the buckets (or their parts) beyond at
/// the rate of those read.
fn unread(
    read: &[db::stats::Bucket],
    at_most: u64,
    bucket: Duration,
    buckets: usize,
) -> Vec<(usize, u64)> {
    let n: u64 = read.iter().map(|b| b.count.unsigned_abs()).sum();
    if n < at_most {
        return Vec::new();
    }
    let reach = read.iter().map(|b| b.oldest).fold(0.0, f64::max);
    rest(n, reach, bucket, buckets)
}

/// `n` rows read over the last `reach` seconds: the rows at that rate in each bucket's stretch beyond `reach`. A
/// reach under a second counts as a second (rows stamped together, a batch's, give no rate of their own).
fn rest(n: u64, reach: f64, bucket: Duration, buckets: usize) -> Vec<(usize, u64)> {
    let reach = reach.max(1.0);
    let per_second = n as f64 / reach;
    let width = bucket.as_secs_f64();
    (0..buckets)
        .filter_map(|age| {
            let (newest, oldest) = (age as f64 * width, (age + 1) as f64 * width);
            let beyond = oldest - reach.max(newest);
            let more = (per_second * beyond).round();
            (beyond > 0.0 && more >= 1.0).then_some((age, more as u64))
        })
        .collect()
}
