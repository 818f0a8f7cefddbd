//! The detail view's state: one consumer_type up close, its failure groups to choose from, and the confirmation before
//! a group is replayed. Pure, like [`super::app`]: what must be fetched or done is left in [`super::app::App::request`]
//! for the loop.

use crate::replay::GroupPlan;
use crate::triage::Group;
use crate::triage::detail::Detail;

/// What the loop is asked to do for the view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Load (or reload) the detail of a consumer_type that reads `queue`.
    Load {
        consumer_type: String,
        queue: String,
    },
    /// Replay one group of `from` as it was listed.
    Replay {
        consumer_type: String,
        from: String,
        group: GroupPlanEq,
    },
}

/// A group to replay, comparable (for the tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlanEq {
    pub fingerprint: String,
    pub listed: Vec<String>,
    pub member_failed_at: std::collections::BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    pub member_replays: std::collections::BTreeMap<String, u32>,
    pub failed_until: Option<chrono::DateTime<chrono::Utc>>,
}

impl From<GroupPlanEq> for GroupPlan {
    fn from(g: GroupPlanEq) -> Self {
        GroupPlan {
            fingerprint: g.fingerprint,
            listed: g.listed,
            member_failed_at: g.member_failed_at,
            member_replays: g.member_replays,
            failed_until: g.failed_until,
        }
    }
}

impl From<GroupPlan> for GroupPlanEq {
    fn from(g: GroupPlan) -> Self {
        GroupPlanEq {
            fingerprint: g.fingerprint,
            listed: g.listed,
            member_failed_at: g.member_failed_at,
            member_replays: g.member_replays,
            failed_until: g.failed_until,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DetailState {
    pub consumer_type: String,
    pub queue: String,
    /// `None` while loading.
    pub data: Option<Result<Detail, String>>,
    /// The failure group selected.
    pub selected: usize,
    /// The confirmation before a replay, when open: exactly what `y` replays (fixed when `r` was pressed).
    pub confirm: Option<Pending>,
}

/// A replay asked about: the request and what the question shows of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub request: Request,
    pub count: u64,
    pub fingerprint: String,
    pub exception_type: String,
    pub reason: String,
    pub from: String,
}

impl DetailState {
    pub fn new(consumer_type: String, queue: String) -> Self {
        Self {
            consumer_type,
            queue,
            data: None,
            selected: 0,
            confirm: None,
        }
    }

    /// The error queue's groups, when they are known.
    pub fn groups(&self) -> &[Group] {
        match &self.data {
            Some(Ok(d)) => d.groups.as_ref().map_or(&[], |l| l.groups.as_slice()),
            _ => &[],
        }
    }

    pub fn selected_group(&self) -> Option<&Group> {
        self.groups().get(self.selected)
    }

    pub fn step(&mut self, by: isize) {
        let last = self.groups().len().saturating_sub(1);
        self.selected = self.selected.saturating_add_signed(by).min(last);
    }

    /// The replay of the selected group, as listed now: what the confirmation asks about.
    pub fn pending(&self) -> Option<Pending> {
        let group = self.selected_group()?;
        let Some(Ok(detail)) = &self.data else {
            return None;
        };
        let listing = detail.groups.as_ref().ok()?;
        Some(Pending {
            request: Request::Replay {
                consumer_type: self.consumer_type.clone(),
                from: detail.error_queue.clone(),
                group: GroupPlan::of(listing, group).into(),
            },
            // Members without a message id cannot be chosen by id, and stay: not counted in what would move.
            count: u64::try_from(group.message_ids.len()).unwrap_or(u64::MAX),
            fingerprint: group.cause.fingerprint.clone(),
            exception_type: group.cause.exception_type.clone(),
            reason: group.cause.reason.clone(),
            from: detail.error_queue.clone(),
        })
    }

    /// Takes a fresh listing: the selection follows its group by fingerprint, and an open confirmation is closed
    /// (what it asked about may have changed). Returns whether one was closed.
    pub fn reloaded(&mut self, data: Result<Detail, String>) -> bool {
        let selected = self.selected_group().map(|g| g.cause.fingerprint.clone());
        self.data = Some(data);
        self.selected = selected
            .and_then(|fp| self.groups().iter().position(|g| g.cause.fingerprint == fp))
            .unwrap_or(0);
        self.confirm.take().is_some()
    }
}
