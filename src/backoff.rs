//! Waiting out an outage: one backoff for every loop that tries again (the consumer waiting for PostgreSQL or
//! RabbitMQ, `publish` and `replay` connecting again), and one way to sleep that a stop cuts short.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Delays that double from `min` to `max`, each taken up to a quarter shorter at random, so that many workers
/// waiting out one outage do not all try again in the same instant.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            next: min,
        }
    }

    /// The delay to wait now; the one after is twice as long, up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        jitter(delay)
    }

    /// After a success: the next wait is the shortest again.
    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

/// Up to a quarter off.
fn jitter(delay: Duration) -> Duration {
    let random = u64::from(uuid::Uuid::new_v4().as_u128() as u16);
    delay - delay.mul_f64(random as f64 / f64::from(u16::MAX) / 4.0)
}

/// Sleeps for `delay`; `true` if `shutdown` was cancelled first.
pub async fn sleep_or_cancel(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_maximum_less_at_most_a_quarter() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let expected = [100, 200, 400, 500, 500];
        for ms in expected {
            let d = backoff.next_delay();
            let full = Duration::from_millis(ms);
            assert!(d <= full && d >= full * 3 / 4, "{d:?} for {full:?}");
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
