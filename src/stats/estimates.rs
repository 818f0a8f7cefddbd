//! How a count is known: exactly (under a cap), from PostgreSQL's statistics (the planner's estimates, per table
//! holding the inbox's rows), or as a floor (past the cap, with no larger estimate).

use std::collections::HashMap;

use crate::db;
use crate::error::Result;

/// A count as far as it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Figure {
    Exact(u64),
    Estimated(u64),
    /// Counted up to the cap and past it, with no larger estimate to show: at least this many.
    AtLeast(u64),
}

impl Figure {
    /// What a count capped at `cap` (it reads at most one past) and the planner's estimate make: exact under the cap;
    /// past it, the estimate if it is larger, else a floor — the estimate stale (not analyzed since the table grew)
    /// or absent would otherwise show the cap as if estimated, flat while the backlog grows.
    pub(super) fn past_the_cap(counted: u64, cap: u64, estimate: Option<u64>) -> Self {
        if counted <= cap {
            return Self::Exact(counted);
        }
        match estimate.filter(|e| *e > counted) {
            Some(estimate) => Self::Estimated(estimate),
            None => Self::AtLeast(counted),
        }
    }

    pub(super) fn value(self) -> u64 {
        match self {
            Self::Exact(n) | Self::Estimated(n) | Self::AtLeast(n) => n,
        }
    }
}

/// The planner's statistics: per table holding the inbox's rows (the table, or each partition), its rows, its
/// unprocessed rows, and each consumer_type's share of it.
#[derive(Debug, Default)]
pub(super) struct Estimates {
    parts: Vec<Part>,
}

#[derive(Debug, Default)]
struct Part {
    rows: Option<f64>,
    unprocessed: Option<f64>,
    shares: HashMap<String, f64>,
    /// The share of a consumer_type not among the most common values.
    other_share: Option<f64>,
}

impl Part {
    fn of(e: db::stats::Estimates) -> Self {
        // reltuples is -1 until the table was first vacuumed or analyzed: no estimate then.
        let known = |v: f64| (v >= 0.0).then_some(v);
        let mut shares = HashMap::new();
        let mut common = 0.0;
        if let (Some(values), Some(freqs)) = (e.common_values, e.common_freqs) {
            for (v, f) in values.into_iter().zip(freqs) {
                common += f64::from(f);
                shares.insert(v, f64::from(f));
            }
        }
        let rest = (1.0 - common - f64::from(e.null_frac.unwrap_or(0.0))).max(0.0);
        let distinct = f64::from(e.n_distinct.unwrap_or(0.0));
        let others = if distinct > 0.0 {
            distinct - shares.len() as f64
        } else {
            0.0
        };
        Self {
            rows: known(e.rows),
            unprocessed: e.unprocessed.and_then(known),
            // Every distinct value among the most common ones (a partition holding a few consumer_types, analyzed):
            // one not among them has no row here. Unknown only when the statistics do not say how many there are.
            other_share: if others >= 1.0 {
                Some(rest / others)
            } else if distinct > 0.0 {
                Some(0.0)
            } else {
                None
            },
            shares,
        }
    }

    /// The consumer_type's share; an empty table's is 0 whatever its statistics say.
    fn share(&self, consumer_type: &str) -> Option<f64> {
        if self.rows == Some(0.0) {
            return Some(0.0);
        }
        self.shares.get(consumer_type).copied().or(self.other_share)
    }
}

impl Estimates {
    pub(super) async fn read(conn: &mut sqlx::PgConnection) -> Result<Self> {
        let parts = db::stats::estimates(&mut *conn).await?;
        Ok(Self {
            parts: parts.into_iter().map(Part::of).collect(),
        })
    }

    /// The sum over the parts whose figure is known of figure × share; unknown when no part's is known, or a part
    /// with rows has no share to tell. Parts never analyzed (a partition made a moment ago) are left out.
    fn sum(&self, consumer_type: &str, figure: impl Fn(&Part) -> Option<f64>) -> Option<u64> {
        let mut total = None;
        for part in &self.parts {
            let Some(n) = figure(part) else { continue };
            let share = if n == 0.0 {
                0.0
            } else {
                part.share(consumer_type)?
            };
            total = Some(total.unwrap_or(0.0) + n * share);
        }
        total.map(|t: f64| t.round() as u64)
    }

    /// Whether the consumer_type's share is its own in every part holding rows: listed among its most common values,
    /// or absent from a part whose statistics list every value it holds (its share there 0) — not the average of the
    /// consumer_types the statistics do not list.
    pub(super) fn among_the_most_common(&self, consumer_type: &str) -> bool {
        let mut holding = self
            .parts
            .iter()
            .filter(|p| p.rows.is_some_and(|n| n > 0.0))
            .peekable();
        holding.peek().is_some()
            && holding.all(|p| p.shares.contains_key(consumer_type) || p.other_share == Some(0.0))
    }

    pub(super) fn rows(&self, consumer_type: &str) -> Option<u64> {
        self.sum(consumer_type, |p| p.rows)
    }

    pub(super) fn unprocessed(&self, consumer_type: &str) -> Option<u64> {
        self.sum(consumer_type, |p| p.unprocessed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer_type absent from one partition (added after the inbox was partitioned: not in the untimed one) whose
    /// statistics list every value it holds: its share there is 0, and its rows are the sum of the others'. The whole
    /// estimate used to be unknown, and the capped count shown instead (10M rows as "~1.0M").
    #[test]
    fn a_consumer_type_absent_from_a_partition_has_no_share_there() {
        let part = |rows: f64, values: &[&str], freqs: &[f32]| {
            Part::of(db::stats::Estimates {
                rows,
                unprocessed: None,
                common_values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
                common_freqs: Some(freqs.to_vec()),
                null_frac: Some(0.0),
                n_distinct: Some(values.len() as f32),
            })
        };
        let estimates = Estimates {
            parts: vec![
                part(1_000_000.0, &["a"], &[1.0]),
                part(4_000_000.0, &["a", "b"], &[0.25, 0.75]),
            ],
        };
        assert_eq!(estimates.rows("b"), Some(3_000_000));
        assert_eq!(estimates.rows("a"), Some(2_000_000));
        // Its share its own in both: listed in one, and absent from one that lists all it holds.
        assert!(estimates.among_the_most_common("b"));
    }

    #[test]
    fn estimates_share_the_table_by_the_most_common_values() {
        let e = Estimates {
            parts: vec![Part {
                rows: Some(10_000_000.0),
                unprocessed: Some(1000.0),
                shares: [("a".to_owned(), 0.5), ("b".to_owned(), 0.3)]
                    .into_iter()
                    .collect(),
                other_share: Some(0.1),
            }],
        };
        assert_eq!(e.rows("a"), Some(5_000_000));
        assert_eq!(e.rows("b"), Some(3_000_000));
        assert_eq!(e.rows("zzz"), Some(1_000_000));
        assert!(e.among_the_most_common("a") && !e.among_the_most_common("zzz"));
        assert_eq!(e.unprocessed("a"), Some(500));
        assert_eq!(Estimates::default().rows("a"), None);
    }

    #[test]
    fn a_partitioned_inboxs_estimates_add_up_its_partitions() {
        let part = |rows: Option<f64>, a: f64| Part {
            rows,
            unprocessed: Some(0.0),
            shares: [("a".to_owned(), a)].into_iter().collect(),
            other_share: None,
        };
        let e = Estimates {
            parts: vec![
                part(Some(1_000_000.0), 0.5),
                part(Some(3_000_000.0), 1.0),
                // A partition never analyzed, and an empty one without statistics: left out, and 0.
                part(None, 0.0),
                Part {
                    rows: Some(0.0),
                    ..Part::default()
                },
            ],
        };
        assert_eq!(e.rows("a"), Some(3_500_000));
        assert_eq!(e.rows("b"), None, "a part with rows and no share for b");
        assert_eq!(e.unprocessed("a"), Some(0));
    }
}
