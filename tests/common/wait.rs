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
