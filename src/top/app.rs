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
    pub rows: Option<u64>,
    pub rows_estimated: bool,
    pub unprocessed: Option<u64>,
    pub unprocessed_estimated: bool,
    pub oldest_unprocessed_seconds: Option<f64>,
    pub queue: Option<String>,
    pub ready: Option<u32>,
    pub consumers: Option<u32>,
    pub errors: Option<u32>,
    /// How long ago the error queue's oldest message failed, and where that stands against the retention.
    pub oldest_error_seconds: Option<f64>,
    pub error_window: Option<crate::stats::Window>,
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
    /// Every line of the last figures; `lines` is those the filter lets through.
    all: Vec<Line>,
    previous_unprocessed: HashMap<String, u64>,
    growing: HashSet<String>,
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
            all: Vec::new(),
            previous_unprocessed: HashMap::new(),
            growing: HashSet::new(),
        }
    }

    pub fn update(&mut self, action: Action) {
        match action {
            Action::Up => self.step(-1),
            Action::Down => self.step(1),
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
            lines.push(Line {
                consumer_type: c.consumer_type.clone(),
                deliveries_per_second: rate(Counts::deliveries),
                duplicates_per_second: rate(|w| w.duplicates),
                duplicate_ratio: ratio,
                conflicts: c.window.as_ref().map(|w| w.conflicts),
                processed_per_second: rate(|w| w.processed),
                rows: c.rows,
                rows_estimated: c.rows_estimated,
                unprocessed: c.unprocessed,
                unprocessed_estimated: c.unprocessed_estimated,
                oldest_unprocessed_seconds: c.oldest_unprocessed_seconds,
                queue: c.queue.as_ref().map(|q| q.name.clone()),
                ready: c.queue.as_ref().and_then(|q| q.ready),
                consumers: c.queue.as_ref().and_then(|q| q.consumers),
                errors,
                oldest_error_seconds: c.oldest_dead_letter_seconds,
                error_window: c
                    .oldest_dead_letter_seconds
                    .map(|age| crate::stats::Window::of(age, snapshot.retention)),
                series: c.series.clone(),
                duplicates_alert: ratio.is_some_and(|r| r > self.alert_duplicates),
                unprocessed_growing: self.growing.contains(&c.consumer_type),
                errors_alert: errors.is_some_and(|e| e > 0),
            });
        }
        self.all = lines;
        self.show();
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
pub(crate) mod tests {
    use super::*;
    use crate::stats::{ConsumerStats, QueueDepth};
    use std::time::Duration;

    pub(crate) fn consumer(
        name: &str,
        processed: u64,
        duplicates: u64,
        unprocessed: u64,
        errors: u32,
    ) -> ConsumerStats {
        ConsumerStats {
            consumer_type: name.to_owned(),
            rows: Some(1000 + processed),
            rows_estimated: false,
            unprocessed: Some(unprocessed),
            unprocessed_estimated: false,
            oldest_unprocessed_seconds: (unprocessed > 0).then_some(75.0),
            window: Some(Counts {
                processed,
                duplicates,
                ..Counts::default()
            }),
            series: vec![(1, 0), (3, 1), (2, 0)],
            queue: Some(QueueDepth {
                name: name.to_owned(),
                ready: Some(4),
                consumers: Some(2),
                exists: true,
            }),
            error_queue: Some(QueueDepth {
                name: format!("{name}_error"),
                ready: Some(errors),
                consumers: None,
                exists: errors > 0,
            }),
            oldest_dead_letter_seconds: (errors > 0).then_some(3600.0),
        }
    }

    pub(crate) fn snapshot(consumers: Vec<ConsumerStats>) -> Box<Snapshot> {
        Box::new(Snapshot {
            taken_at: Utc::now(),
            window: Duration::from_secs(60),
            bucket: Duration::from_secs(2),
            consumers,
            retention: Duration::from_secs(4000),
            broker_error: None,
        })
    }

    #[test]
    fn a_filter_shows_the_matching_names_and_esc_drops_it() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("orders-carrier", 1, 0, 0, 0),
            consumer("orders-sms", 1, 0, 0, 0),
            consumer("billing", 1, 0, 0, 0),
        ])));
        app.update(Action::FilterStart);
        for c in "ORDERS".chars() {
            app.update(Action::FilterChar(c));
        }
        assert_eq!(names(&app), ["orders-carrier", "orders-sms"]);
        app.update(Action::FilterChar('\u{1b}'));
        assert_eq!(app.filter, "ORDERS", "control characters are not typed in");
        app.update(Action::FilterDone);
        assert!(!app.filtering);
        // Fresh figures keep the filter; the selection stays among what is shown.
        app.update(Action::Data(snapshot(vec![
            consumer("orders-carrier", 1, 0, 0, 0),
            consumer("billing", 1, 0, 0, 0),
        ])));
        assert_eq!(names(&app), ["orders-carrier"]);
        assert_eq!(app.selected.as_deref(), Some("orders-carrier"));
        app.update(Action::FilterStart);
        app.update(Action::FilterChar('x'));
        assert!(names(&app).is_empty());
        app.update(Action::FilterBackspace);
        assert_eq!(names(&app), ["orders-carrier"]);
        app.update(Action::FilterCancel);
        assert_eq!(names(&app), ["billing", "orders-carrier"]);
        assert!(app.filter.is_empty());
    }

    fn names(app: &App) -> Vec<&str> {
        app.lines.iter().map(|l| l.consumer_type.as_str()).collect()
    }

    #[test]
    fn rates_come_from_the_window_counters() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![consumer("a", 54, 6, 0, 0)])));
        let l = &app.lines[0];
        assert_eq!(l.deliveries_per_second, Some(1.0));
        assert_eq!(l.duplicates_per_second, Some(0.1));
        assert_eq!(l.processed_per_second, Some(0.9));
        assert_eq!(l.duplicate_ratio, Some(0.1));
    }

    #[test]
    fn without_counters_the_rates_are_unknown_not_zero() {
        let mut c = consumer("dotnet", 0, 0, 3, 0);
        c.window = None;
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![c])));
        let l = &app.lines[0];
        assert_eq!((l.deliveries_per_second, l.duplicate_ratio), (None, None));
        assert!(!l.duplicates_alert);
    }

    #[test]
    fn alerts() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("calm", 100, 5, 0, 0),
            consumer("dupes", 90, 10, 0, 0),
            consumer("failing", 10, 0, 0, 3),
        ])));
        let by = |n: &str| {
            app.lines
                .iter()
                .find(|l| l.consumer_type == n)
                .cloned()
                .expect("line")
        };
        assert!(!by("calm").duplicates_alert, "5/105 is under 5 %");
        assert!(by("dupes").duplicates_alert, "10 % is over 5 %");
        assert!(by("failing").errors_alert);
        // An hour old, against a retention of 4000 s: nearing the window.
        assert_eq!(by("failing").error_window, Some(crate::stats::Window::Near));
        assert_eq!(by("calm").error_window, None);
        assert!(!by("calm").errors_alert);
    }

    #[test]
    fn growing_unprocessed_rows_are_marked_until_they_shrink() {
        let mut app = App::new(0.05);
        for (unprocessed, growing) in [(5, false), (9, true), (9, true), (4, false)] {
            app.update(Action::Data(snapshot(vec![consumer(
                "a",
                1,
                0,
                unprocessed,
                0,
            )])));
            assert_eq!(
                app.lines[0].unprocessed_growing, growing,
                "at {unprocessed}"
            );
        }
    }

    #[test]
    fn selection_moves_within_bounds_and_follows_the_consumer_type_across_sorts() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("b", 10, 0, 0, 0),
            consumer("a", 1, 0, 0, 0),
            consumer("c", 50, 0, 0, 0),
        ])));
        assert_eq!(names(&app), ["a", "b", "c"]);
        assert_eq!(app.selected.as_deref(), Some("a"));
        app.update(Action::Up);
        assert_eq!(app.selected.as_deref(), Some("a"), "stays at the top");
        app.update(Action::Down);
        app.update(Action::Down);
        app.update(Action::Down);
        assert_eq!(app.selected.as_deref(), Some("c"), "stays at the bottom");
        app.update(Action::Sort);
        assert_eq!(app.sort, SortKey::Deliveries);
        assert_eq!(names(&app), ["c", "b", "a"]);
        assert_eq!(
            app.selected_index(),
            Some(0),
            "c is still selected, now first"
        );
    }

    #[test]
    fn sort_cycles_through_every_column() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("a", 10, 5, 1, 0),
            consumer("b", 100, 1, 7, 2),
        ])));
        let mut seen = Vec::new();
        for _ in 0..5 {
            app.update(Action::Sort);
            seen.push((app.sort, names(&app).join("")));
        }
        assert_eq!(
            seen,
            [
                (SortKey::Deliveries, "ba".to_owned()),
                (SortKey::DuplicateRatio, "ab".to_owned()),
                (SortKey::Unprocessed, "ba".to_owned()),
                (SortKey::Errors, "ba".to_owned()),
                (SortKey::ConsumerType, "ab".to_owned()),
            ]
        );
    }

    #[test]
    fn paused_it_ignores_new_figures_and_errors_keep_the_last_ones() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![consumer("a", 60, 0, 0, 0)])));
        app.update(Action::Pause);
        app.update(Action::Data(snapshot(vec![consumer("a", 600, 0, 0, 0)])));
        assert_eq!(app.lines[0].deliveries_per_second, Some(1.0));
        app.update(Action::Pause);
        app.update(Action::DataError("PostgreSQL unreachable".into()));
        assert_eq!(app.lines.len(), 1, "the last figures stay");
        assert_eq!(app.error.as_deref(), Some("PostgreSQL unreachable"));
        app.update(Action::Data(snapshot(vec![consumer("a", 600, 0, 0, 0)])));
        assert_eq!(app.error, None);
        assert_eq!(app.lines[0].deliveries_per_second, Some(10.0));
    }

    #[test]
    fn help_and_quit() {
        let mut app = App::new(0.05);
        app.update(Action::Help);
        assert!(app.show_help);
        app.update(Action::Help);
        assert!(!app.show_help);
        app.update(Action::Quit);
        assert!(app.quit);
    }
}
