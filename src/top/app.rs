//! The dashboard's state: pure, so every key and every refresh can be tested without a terminal.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::stats::{Counts, Snapshot, per_second};

/// What can happen to the dashboard.
#[derive(Debug, Clone)]
pub enum Action {
    Up,
    Down,
    /// Cycle the sort column.
    Sort,
    /// Freeze the figures (new data is ignored) or unfreeze them.
    Pause,
    Help,
    Quit,
    /// Fresh figures.
    Data(Box<Snapshot>),
    /// The refresh failed (PostgreSQL unreachable, …): keep the last figures, say why.
    DataError(String),
    /// `/`: start typing a filter on the consumer_types' names.
    FilterStart,
    FilterChar(char),
    FilterBackspace,
    /// Enter: keep the filter and leave typing.
    FilterDone,
    /// Esc while typing: drop the filter.
    FilterCancel,
    /// Enter: the selected consumer_type's detail.
    Open,
    /// Esc in the detail: back to the table.
    Back,
    /// `r` in the detail: replay the selected failure group (after a confirmation).
    Replay,
    /// The confirmation's answer.
    Confirm(bool),
    /// The detail, loaded (or why it could not be).
    DetailLoaded(Box<Result<crate::triage::detail::Detail, String>>),
    /// A replay started from the detail has ended: what it did.
    ReplayDone(String),
}

/// Which keys mean what: it depends on what is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Table,
    Filtering,
    Detail,
    Confirm,
}

/// The longest filter kept: a name is at most 500 characters.
const MAX_FILTER: usize = 500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    ConsumerType,
    Deliveries,
    DuplicateRatio,
    Unprocessed,
    Errors,
}

impl SortKey {
    fn next(self) -> Self {
        match self {
            SortKey::ConsumerType => SortKey::Deliveries,
            SortKey::Deliveries => SortKey::DuplicateRatio,
            SortKey::DuplicateRatio => SortKey::Unprocessed,
            SortKey::Unprocessed => SortKey::Errors,
            SortKey::Errors => SortKey::ConsumerType,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            SortKey::ConsumerType => "consumer_type",
            SortKey::Deliveries => "deliveries/s",
            SortKey::DuplicateRatio => "duplicate ratio",
            SortKey::Unprocessed => "unprocessed",
            SortKey::Errors => "error queue",
        }
    }
}

/// One consumer_type's line, as shown.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub consumer_type: String,
    pub deliveries_per_second: Option<f64>,
    pub duplicates_per_second: Option<f64>,
    pub duplicate_ratio: Option<f64>,
    /// Messages whose id was processed before for another event, in the window.
    pub conflicts: Option<u64>,
    pub processed_per_second: Option<f64>,
    /// The rates, the ratio and the conflicts are in part estimated (`ConsumerStats::rates_estimated`).
    pub rates_estimated: bool,
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    pub rows_at_least: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    pub unprocessed_at_least: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    /// The queue for a person (spread over partitions: their range and number).
    pub queue: Option<String>,
    /// The vhost its consumer reads its queue in, when not the one `top` looks in (`ConsumerStats::other_vhost`).
    pub other_vhost: Option<String>,
    /// Its name, whose `_error` queue holds what failed: what the detail looks at.
    pub queue_name: Option<String>,
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
    pub errors: Option<u32>,
    /// How long ago the error queue's oldest message failed, and where that stands against the retention.
    pub oldest_error_seconds: Option<f64>,
    pub error_window: Option<crate::stats::Window>,
    /// Calls outside the database owed and in doubt, each with the age of its oldest.
    pub effects_pending: Option<u64>,
    pub oldest_effect_pending_seconds: Option<f64>,
    pub effects_in_doubt: Option<u64>,
    pub oldest_effect_in_doubt_seconds: Option<f64>,
    /// Deliveries and duplicates per bucket, oldest first.
    pub series: Vec<(u64, u64)>,
    // Highlights.
    pub duplicates_alert: bool,
    pub unprocessed_growing: bool,
    pub errors_alert: bool,
}

pub struct App {
    pub lines: Vec<Line>,
    /// The consumer_type selected (kept across refreshes and re-sorts).
    pub selected: Option<String>,
    pub sort: SortKey,
    pub paused: bool,
    pub show_help: bool,
    pub quit: bool,
    /// A duplicate ratio above this is highlighted.
    pub alert_duplicates: f64,
    pub updated_at: Option<DateTime<Utc>>,
    pub window_seconds: f64,
    pub bucket_seconds: f64,
    /// Why the last refresh failed, if it did.
    pub error: Option<String>,
    /// Why the broker figures are missing, if they are.
    pub broker_error: Option<String>,
    /// Only consumer_types whose name contains this are shown (empty: all).
    pub filter: String,
    /// Keys go to the filter.
    pub filtering: bool,
    /// The detail view, when open.
    pub detail: Option<super::detail::DetailState>,
    /// `--read-only`: no action changes anything.
    pub read_only: bool,
    /// A replay started from the detail is running (one at a time, wherever the view is).
    pub replaying: bool,
    /// The outcome of the last action, on the status line.
    pub status: Option<String>,
    /// What the loop must fetch or do next.
    pub request: Option<super::detail::Request>,
    /// The consumer_type whose dead letters are being looked at, while a look is under way: one at a time (each
    /// holds up to 10,000 messages unacknowledged, hiding them from another, and counts a delivery of each on a
    /// quorum queue).
    loading: Option<String>,
    /// Every line of the last figures; `lines` is those the filter lets through.
    all: Vec<Line>,
    previous_unprocessed: HashMap<String, u64>,
    growing: HashSet<String>,
    /// The error queues' oldest messages as last looked at: (age then, when), for the refreshes between two looks.
    heads: HashMap<String, (f64, DateTime<Utc>)>,
}

impl App {
    pub fn new(alert_duplicates: f64) -> Self {
        Self {
            lines: Vec::new(),
            selected: None,
            sort: SortKey::ConsumerType,
            paused: false,
            show_help: false,
            quit: false,
            alert_duplicates,
            updated_at: None,
            window_seconds: 60.0,
            bucket_seconds: 1.0,
            error: None,
            broker_error: None,
            filter: String::new(),
            filtering: false,
            detail: None,
            read_only: false,
            replaying: false,
            status: None,
            request: None,
            loading: None,
            all: Vec::new(),
            previous_unprocessed: HashMap::new(),
            growing: HashSet::new(),
            heads: HashMap::new(),
        }
    }

    pub fn update(&mut self, action: Action) {
        match action {
            Action::Up => match &mut self.detail {
                Some(d) => d.step(-1),
                None => self.step(-1),
            },
            Action::Down => match &mut self.detail {
                Some(d) => d.step(1),
                None => self.step(1),
            },
            Action::Sort => {
                self.sort = self.sort.next();
                self.show();
            }
            Action::Pause => self.paused = !self.paused,
            Action::Help => self.show_help = !self.show_help,
            Action::Quit => self.quit = true,
            Action::Data(snapshot) => {
                if !self.paused {
                    self.absorb(&snapshot);
                }
            }
            Action::DataError(reason) => self.error = Some(reason),
            Action::FilterStart => self.filtering = true,
            Action::FilterChar(c) => {
                if self.filter.chars().count() < MAX_FILTER && !c.is_control() {
                    self.filter.push(c);
                    self.show();
                }
            }
            Action::FilterBackspace => {
                self.filter.pop();
                self.show();
            }
            Action::FilterDone => self.filtering = false,
            Action::FilterCancel => {
                self.filtering = false;
                self.filter.clear();
                self.show();
            }
            Action::Open
            | Action::Back
            | Action::Replay
            | Action::Confirm(_)
            | Action::DetailLoaded(_)
            | Action::ReplayDone(_) => self.detail_action(action),
        }
    }

    /// The detail view's actions.
    fn detail_action(&mut self, action: Action) {
        use super::detail::{DetailState, Request};
        match action {
            Action::Open => {
                let chosen = self.selected_line().map(|line| {
                    // The queue's name, not its label: spread over partitions, the label names no queue.
                    let queue = line
                        .queue_name
                        .clone()
                        .unwrap_or_else(|| line.consumer_type.clone());
                    (line.consumer_type.clone(), queue)
                });
                if let Some(vhost) = self.selected_line().and_then(|l| l.other_vhost.clone()) {
                    // Its dead-letter queues are in that vhost: a queue of the same name here is another's, whose
                    // messages this view would hold, list and replay as its own.
                    self.status = Some(format!(
                        "its consumer reads its queue in vhost {}, not the one top looks in: its dead letters are \
                         not shown here (run top against that vhost)",
                        crate::sanitize::text(&vhost)
                    ));
                    return;
                }
                if let Some((consumer_type, queue)) = chosen {
                    match &self.loading {
                        // Its look is under way: its answer fills the view opened again.
                        Some(looking) if *looking == consumer_type => {}
                        Some(looking) => {
                            self.status = Some(format!(
                                "still looking at the dead letters of {}: open this one when it is done",
                                crate::sanitize::text(looking)
                            ));
                            return;
                        }
                        None => {
                            self.loading = Some(consumer_type.clone());
                            self.request = Some(Request::Load {
                                consumer_type: consumer_type.clone(),
                                queue: queue.clone(),
                            });
                        }
                    }
                    self.detail = Some(DetailState::new(consumer_type, queue));
                }
            }
            Action::Back => self.detail = None,
            Action::Replay => {
                let Some(d) = &mut self.detail else { return };
                if self.read_only {
                    self.status = Some("read-only (--read-only): replay is off".to_owned());
                } else if self.replaying {
                    self.status = Some("a replay is running".to_owned());
                } else if let Some(pending) = d.pending() {
                    if pending.fingerprint == crate::triage::failures::OTHER_CAUSES {
                        self.status = Some(
                            "this group gathers the causes past the listing's first ones: replay them with \
                             `inboxctl replay`"
                                .to_owned(),
                        );
                    } else {
                        d.confirm = Some(pending);
                    }
                }
            }
            Action::Confirm(yes) => {
                let Some(d) = &mut self.detail else { return };
                let Some(pending) = d.confirm.take() else {
                    return;
                };
                if yes {
                    self.replaying = true;
                    self.status = Some(format!("replaying {} messages…", pending.count));
                    self.request = Some(pending.request);
                } else {
                    self.status = Some("replay cancelled: nothing moved".to_owned());
                }
            }
            Action::DetailLoaded(loaded) => {
                self.loading = None;
                if let Some(d) = &mut self.detail
                    && loaded
                        .as_ref()
                        .as_ref()
                        .map_or(true, |l| l.consumer_type == d.consumer_type)
                    && d.reloaded(*loaded)
                {
                    self.status = Some("the groups changed: press r again".to_owned());
                }
            }
            Action::ReplayDone(what) => {
                self.status = Some(what);
                self.replaying = false;
                if let Some(d) = &mut self.detail
                    && self.loading.is_none()
                {
                    self.loading = Some(d.consumer_type.clone());
                    self.request = Some(Request::Load {
                        consumer_type: d.consumer_type.clone(),
                        queue: d.queue.clone(),
                    });
                }
            }
            _ => {}
        }
    }

    /// The lines the filter lets through, sorted; the selection stays where it was if it can.
    fn show(&mut self) {
        let filter = self.filter.to_lowercase();
        self.lines = self
            .all
            .iter()
            .filter(|l| filter.is_empty() || l.consumer_type.to_lowercase().contains(&filter))
            .cloned()
            .collect();
        self.sort_lines();
        if self.selected_index().is_none() {
            self.selected = self.lines.first().map(|l| l.consumer_type.clone());
        }
    }

    /// Whether any consumer_type is known, whatever the filter lets through.
    pub fn has_consumer_types(&self) -> bool {
        !self.all.is_empty()
    }

    pub fn mode(&self) -> Mode {
        match &self.detail {
            Some(d) if d.confirm.is_some() => Mode::Confirm,
            Some(_) => Mode::Detail,
            None if self.filtering => Mode::Filtering,
            None => Mode::Table,
        }
    }

    /// Index of the selected line.
    pub fn selected_index(&self) -> Option<usize> {
        let selected = self.selected.as_ref()?;
        self.lines.iter().position(|l| &l.consumer_type == selected)
    }

    pub fn selected_line(&self) -> Option<&Line> {
        self.selected_index().map(|i| &self.lines[i])
    }

    fn step(&mut self, by: isize) {
        if self.lines.is_empty() {
            return;
        }
        let last = self.lines.len() - 1;
        let next = match self.selected_index() {
            None => 0,
            Some(i) => i.saturating_add_signed(by).min(last),
        };
        self.selected = Some(self.lines[next].consumer_type.clone());
    }

    fn absorb(&mut self, snapshot: &Snapshot) {
        self.error = None;
        self.broker_error = snapshot.broker_error.clone();
        self.updated_at = Some(snapshot.taken_at);
        self.window_seconds = snapshot.window.as_secs_f64();
        self.bucket_seconds = snapshot.bucket.as_secs_f64();
        let mut lines = Vec::with_capacity(snapshot.consumers.len());
        for c in &snapshot.consumers {
            let rate = |f: fn(&Counts) -> u64| {
                c.window.as_ref().map(|w| per_second(f(w), snapshot.window))
            };
            let ratio = c.window.as_ref().and_then(Counts::duplicate_ratio);
            // Growing: more unprocessed rows than at the last refresh; it stays marked until they shrink.
            if let Some(now) = c.unprocessed {
                match self
                    .previous_unprocessed
                    .insert(c.consumer_type.clone(), now)
                {
                    Some(before) if now > before => {
                        self.growing.insert(c.consumer_type.clone());
                    }
                    Some(before) if now < before || now == 0 => {
                        self.growing.remove(&c.consumer_type);
                    }
                    _ => {}
                }
            }
            let errors = c.error_queue.as_ref().and_then(|q| q.ready);
            let oldest_error = self.oldest_error(snapshot, c, errors);
            lines.push(Line {
                consumer_type: c.consumer_type.clone(),
                deliveries_per_second: rate(Counts::deliveries),
                duplicates_per_second: rate(|w| w.duplicates),
                duplicate_ratio: ratio,
                conflicts: c.window.as_ref().map(|w| w.conflicts),
                processed_per_second: rate(|w| w.processed),
                rates_estimated: c.rates_estimated,
                rows: c.rows,
                rows_estimated: c.rows_estimated,
                rows_at_least: c.rows_at_least,
                unprocessed: c.unprocessed,
                unprocessed_estimated: c.unprocessed_estimated,
                unprocessed_at_least: c.unprocessed_at_least,
                oldest_unprocessed_seconds: c.oldest_unprocessed_seconds,
                other_vhost: c.other_vhost.clone(),
                queue: c.queue.as_ref().map(|q| match &c.other_vhost {
                    Some(vhost) => format!("{} (in vhost {vhost})", q.label()),
                    None => q.label(),
                }),
                queue_name: c.queue.as_ref().map(|q| q.name.clone()),
                ready: c.queue.as_ref().and_then(|q| q.ready),
                consumers: c.queue.as_ref().and_then(|q| q.consumers),
                errors,
                oldest_error_seconds: oldest_error,
                error_window: oldest_error
                    .map(|age| crate::stats::Window::of(age, snapshot.retention)),
                effects_pending: c.effects.map(|e| e.pending),
                oldest_effect_pending_seconds: c.effects.and_then(|e| e.oldest_pending_seconds),
                effects_in_doubt: c.effects.map(|e| e.in_doubt),
                oldest_effect_in_doubt_seconds: c.effects.and_then(|e| e.oldest_in_doubt_seconds),
                series: c.series.clone(),
                duplicates_alert: ratio.is_some_and(|r| r > self.alert_duplicates),
                unprocessed_growing: self.growing.contains(&c.consumer_type),
                errors_alert: errors.is_some_and(|e| e > 0),
            });
        }
        self.all = lines;
        self.show();
    }

    /// The age of an error queue's oldest message: as looked at now, or as last looked at and aged since; none once
    /// the queue is empty.
    fn oldest_error(
        &mut self,
        snapshot: &Snapshot,
        c: &crate::stats::ConsumerStats,
        errors: Option<u32>,
    ) -> Option<f64> {
        if errors == Some(0) {
            self.heads.remove(&c.consumer_type);
            return None;
        }
        if (snapshot.heads_looked && !c.head_skipped) || c.head_looked {
            match c.oldest_dead_letter_seconds {
                Some(age) => {
                    self.heads
                        .insert(c.consumer_type.clone(), (age, snapshot.taken_at));
                }
                None => {
                    self.heads.remove(&c.consumer_type);
                }
            }
            return c.oldest_dead_letter_seconds;
        }
        let (age, at) = self.heads.get(&c.consumer_type)?;
        Some(age + (snapshot.taken_at - *at).num_milliseconds().max(0) as f64 / 1000.0)
    }

    fn sort_lines(&mut self) {
        let desc = |a: Option<f64>, b: Option<f64>| {
            b.unwrap_or(f64::NEG_INFINITY)
                .total_cmp(&a.unwrap_or(f64::NEG_INFINITY))
        };
        match self.sort {
            SortKey::ConsumerType => self
                .lines
                .sort_by(|a, b| a.consumer_type.cmp(&b.consumer_type)),
            SortKey::Deliveries => self
                .lines
                .sort_by(|a, b| desc(a.deliveries_per_second, b.deliveries_per_second)),
            SortKey::DuplicateRatio => self
                .lines
                .sort_by(|a, b| desc(a.duplicate_ratio, b.duplicate_ratio)),
            SortKey::Unprocessed => self.lines.sort_by(|a, b| {
                desc(
                    a.unprocessed.map(|u| u as f64),
                    b.unprocessed.map(|u| u as f64),
                )
            }),
            SortKey::Errors => self
                .lines
                .sort_by(|a, b| desc(a.errors.map(f64::from), b.errors.map(f64::from))),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
