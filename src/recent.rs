//! What a process keeps of its recent messages between their rounds (a copy owed to the error queue, a carrier's
//! answer): at most so many entries, each for so long. Beyond the number, the expired go first, then the oldest.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Recent<K, V> {
    most: usize,
    kept_for: Duration,
    entries: Mutex<HashMap<K, (V, Instant)>>,
}

impl<K: Hash + Eq + Clone, V: Clone> Recent<K, V> {
    /// At most `most` entries, each for `kept_for`.
    pub fn new(most: usize, kept_for: Duration) -> Self {
        Self {
            most,
            kept_for,
            entries: Mutex::new(HashMap::new()),
        }
    }

    pub fn insert(&self, key: K, value: V) {
        self.insert_at(key, value, Instant::now());
    }

    /// Keeps `value` under `key` from `now` (replacing what was there).
    pub fn insert_at(&self, key: K, value: V, now: Instant) {
        let mut entries = self.entries();
        if entries.len() >= self.most && !entries.contains_key(&key) {
            entries.retain(|_, (_, at)| now.duration_since(*at) < self.kept_for);
            if entries.len() >= self.most
                && let Some(oldest) = entries
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
            {
                entries.remove(&oldest);
            }
        }
        entries.insert(key, (value, now));
    }

    /// What is kept under `key`, if not expired.
    pub fn get(&self, key: &K) -> Option<V> {
        self.get_at(key, Instant::now())
    }

    pub fn get_at(&self, key: &K, now: Instant) -> Option<V> {
        let entries = self.entries();
        let (value, at) = entries.get(key)?;
        (now.duration_since(*at) < self.kept_for).then(|| value.clone())
    }

    /// What is kept under `key`, if not expired, taken.
    pub fn take(&self, key: &K) -> Option<V> {
        self.take_at(key, Instant::now())
    }

    pub fn take_at(&self, key: &K, now: Instant) -> Option<V> {
        let (value, at) = self.entries().remove(key)?;
        (now.duration_since(at) < self.kept_for).then_some(value)
    }

    /// How many entries are kept, expired ones included.
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<K, (V, Instant)>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_go_when_expired_or_the_oldest_beyond_the_bound() {
        let recent = Recent::new(3, Duration::from_secs(10));
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        recent.insert_at(1, "a", at(0));
        assert_eq!(recent.get_at(&1, at(1)), Some("a"));
        assert_eq!(recent.get_at(&1, at(1)), Some("a"), "a get leaves it");
        assert_eq!(recent.get_at(&1, at(10_000)), None, "expired");
        for key in 2..=4 {
            recent.insert_at(key, "b", at(key));
        }
        assert_eq!(recent.len(), 3);
        assert_eq!(recent.get_at(&1, at(5)), None, "the oldest went");
        assert_eq!(recent.take_at(&2, at(5)), Some("b"));
        assert_eq!(recent.take_at(&2, at(5)), None, "taken");
        recent.insert_at(3, "c", at(6));
        assert_eq!(recent.len(), 2, "a key kept again is not a new entry");
        assert_eq!(recent.get_at(&3, at(7)), Some("c"));

        let none_kept = Recent::new(3, Duration::ZERO);
        none_kept.insert_at(1, "a", start);
        assert_eq!(none_kept.get_at(&1, start), None);
    }
}
