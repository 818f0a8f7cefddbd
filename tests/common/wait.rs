//! Waiting on what the servers and processes do, by polling without blocking the runtime.

use std::time::{Duration, Instant};

/// Polls `f` until it returns `true`; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    assert!(
        within(timeout, f).await,
        "timed out after {timeout:?} waiting for: {what}"
    );
}

/// Polls `f` until it returns `true` or `timeout` passes; says whether it came true (for a test that has more to say
/// than `eventually` when it does not).
pub async fn within<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// For a test that names days (a partitioned inbox's daily partitions: today's, yesterday's): started within
/// [`MIDNIGHT_MARGIN`] of midnight UTC, it waits for the next day first, so that it does not name the days of one date
/// and run its commands on the next (a CI run crossing midnight failed that way).
pub async fn clear_of_midnight() {
    let now = chrono::Utc::now();
    let tomorrow = (now + chrono::TimeDelta::days(1))
        .date_naive()
        .and_hms_opt(0, 0, 1)
        .expect("a time of day")
        .and_utc();
    let left = tomorrow - now;
    if left <= MIDNIGHT_MARGIN {
        tokio::time::sleep(left.to_std().unwrap_or_default()).await;
    }
}

/// Longer than a test of daily partitions takes (40 s at most in CI runs), and short enough that the wait and the test
/// stay well within nextest's `slow-timeout` (240 s; 300 s in CI).
const MIDNIGHT_MARGIN: chrono::TimeDelta = chrono::TimeDelta::minutes(2);
