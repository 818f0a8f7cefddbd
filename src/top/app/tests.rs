//! The dashboard state's tests: every key and refresh, without a terminal.
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
        rows_at_least: false,
        unprocessed: Some(unprocessed),
        unprocessed_estimated: false,
        unprocessed_at_least: false,
        oldest_unprocessed_seconds: (unprocessed > 0).then_some(75.0),
        window: Some(Counts {
            processed,
            duplicates,
            ..Counts::default()
        }),
        rates_estimated: false,
        series: vec![(1, 0), (3, 1), (2, 0)],
        queue: Some(QueueDepth {
            name: name.to_owned(),
            partitions: None,
            ready: Some(4),
            consumers: Some(2),
            exists: true,
        }),
        error_queue: Some(QueueDepth {
            name: format!("{name}_error"),
            partitions: None,
            ready: Some(errors),
            consumers: None,
            exists: errors > 0,
        }),
        oldest_dead_letter_seconds: (errors > 0).then_some(3600.0),
        head_looked: false,
        head_skipped: false,
        effects: None,
        other_vhost: None,
    }
}

pub(crate) fn snapshot(consumers: Vec<ConsumerStats>) -> Box<Snapshot> {
    Box::new(Snapshot {
        taken_at: Utc::now(),
        window: Duration::from_secs(60),
        bucket: Duration::from_secs(2),
        consumers,
        retention: Duration::from_secs(4000),
        heads_looked: true,
        broker_cut_short: false,
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

/// When the listings of [`detail_of`] were taken.
fn listed_at() -> chrono::DateTime<Utc> {
    chrono::DateTime::from_timestamp(1_796_000_000, 0).expect("a time")
}

fn detail_of(name: &str, groups: &[(&str, u64, &[&str])]) -> crate::triage::detail::Detail {
    use crate::amqp::cause::Cause;
    crate::triage::detail::Detail {
        consumer_type: name.to_owned(),
        error_queue: format!("{name}_error"),
        failures: Vec::new(),
        groups: Ok(crate::triage::Listing {
            format: crate::triage::failures::LISTING_FORMAT,
            queue: format!("{name}_error"),
            vhost: "/".to_owned(),
            listed_at: listed_at(),
            depth: 3,
            looked: 3,
            replay_running: false,
            looked_at_elsewhere: false,
            most_deliveries: None,
            groups: groups
                .iter()
                .map(|(fp, count, ids)| crate::triage::Group {
                    cause: Cause {
                        fingerprint: (*fp).to_owned(),
                        exception_type: "E".to_owned(),
                        reason: "r".to_owned(),
                    },
                    example: None,
                    count: *count,
                    first_failed_at: None,
                    last_failed_at: None,
                    origins: Vec::new(),
                    message_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
                    failed_at: Vec::new(),
                    replays: Vec::new(),
                    without_id: 0,
                })
                .collect(),
        }),
        oldest_unprocessed: Vec::new(),
        audit: Ok(Vec::new()),
    }
}

/// A consumer spread over partition queues opens the detail of its queue's name, whose `_error` queue holds what
/// failed — not of its label (`orders.0–3 (4 partitions)`), which names no queue: the detail said "nothing failed".
#[test]
fn the_detail_of_a_partitioned_consumer_looks_at_its_queues_name() {
    use crate::top::detail::Request;
    let mut app = App::new(0.05);
    let mut partitioned = consumer("orders", 1, 0, 0, 2);
    if let Some(q) = partitioned.queue.as_mut() {
        q.partitions = Some(4);
    }
    app.update(Action::Data(snapshot(vec![partitioned])));
    app.update(Action::Open);
    assert_eq!(
        app.request.take(),
        Some(Request::Load {
            consumer_type: "orders".into(),
            queue: "orders".into()
        })
    );
}

/// Enter, Esc, Enter… started a look at the dead letters each time, every one holding up to 10,000 messages
/// unacknowledged and hiding them from the others: one look at a time now.
#[test]
fn one_look_at_the_dead_letters_at_a_time() {
    use crate::top::detail::Request;
    let mut app = App::new(0.05);
    app.update(Action::Data(snapshot(vec![
        consumer("orders", 1, 0, 0, 2),
        consumer("sms", 1, 0, 0, 2),
    ])));
    app.update(Action::Open);
    assert!(matches!(app.request.take(), Some(Request::Load { .. })));
    app.update(Action::Back);
    app.update(Action::Open);
    assert_eq!(app.request.take(), None, "the look under way answers");
    assert_eq!(app.mode(), Mode::Detail);
    app.update(Action::Back);
    app.update(Action::Down);
    app.update(Action::Open);
    assert_eq!(app.request.take(), None);
    assert_eq!(app.mode(), Mode::Table);
    assert!(
        app.status
            .as_deref()
            .is_some_and(|s| s.contains("still looking")),
        "{:?}",
        app.status
    );
    app.update(Action::DetailLoaded(Box::new(Err("gone".to_owned()))));
    app.update(Action::Open);
    assert!(matches!(app.request.take(), Some(Request::Load { .. })));
}

#[test]
fn the_detail_asks_before_a_replay_and_replays_the_listed_members_of_the_selected_group() {
    use crate::top::detail::{GroupPlanEq, Request};
    let mut app = App::new(0.05);
    app.update(Action::Data(snapshot(vec![consumer("orders", 1, 0, 0, 2)])));
    app.update(Action::Open);
    assert_eq!(app.mode(), Mode::Detail);
    assert_eq!(
        app.request.take(),
        Some(Request::Load {
            consumer_type: "orders".into(),
            queue: "orders".into()
        })
    );
    // Nothing to replay while loading.
    app.update(Action::Replay);
    assert_eq!(app.mode(), Mode::Detail);
    app.update(Action::DetailLoaded(Box::new(Ok(detail_of(
        "orders",
        &[("aaaa", 2, &["m1", "m2"]), ("bbbb", 1, &["m3"])],
    )))));
    app.update(Action::Down);
    app.update(Action::Replay);
    assert_eq!(app.mode(), Mode::Confirm);
    app.update(Action::Confirm(false));
    assert_eq!(app.mode(), Mode::Detail);
    assert!(app.request.is_none(), "a no moves nothing");
    assert!(
        app.status
            .as_deref()
            .is_some_and(|s| s.contains("cancelled"))
    );
    app.update(Action::Replay);
    app.update(Action::Confirm(true));
    assert_eq!(
        app.request.take(),
        Some(Request::Replay {
            consumer_type: "orders".into(),
            from: "orders_error".into(),
            group: GroupPlanEq {
                fingerprint: "bbbb".into(),
                listed: vec!["m3".into()],
                member_failed_at: Default::default(),
                member_replays: Default::default(),
                failed_until: Some(listed_at()),
            },
        })
    );
    app.update(Action::Replay);
    assert_eq!(
        app.mode(),
        Mode::Detail,
        "not a second replay while one runs"
    );
    app.update(Action::ReplayDone("replayed 1".into()));
    assert_eq!(app.status.as_deref(), Some("replayed 1"));
    assert!(
        matches!(app.request.take(), Some(Request::Load { .. })),
        "the groups are listed again"
    );
    app.update(Action::Back);
    assert_eq!(app.mode(), Mode::Table);
}

#[test]
fn read_only_refuses_the_replay() {
    let mut app = App::new(0.05);
    app.read_only = true;
    app.update(Action::Data(snapshot(vec![consumer("orders", 1, 0, 0, 2)])));
    app.update(Action::Open);
    app.update(Action::DetailLoaded(Box::new(Ok(detail_of(
        "orders",
        &[("aaaa", 2, &["m1", "m2"])],
    )))));
    app.request = None;
    app.update(Action::Replay);
    assert_eq!(app.mode(), Mode::Detail);
    assert!(app.request.is_none());
    assert!(
        app.status
            .as_deref()
            .is_some_and(|s| s.contains("read-only"))
    );
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

#[test]
fn between_two_looks_the_oldest_error_ages_and_an_empty_queue_forgets_it() {
    let mut app = App::new(0.05);
    app.update(Action::Data(snapshot(vec![consumer("orders", 1, 0, 0, 2)])));
    assert_eq!(app.lines[0].oldest_error_seconds, Some(3600.0));
    let mut later = snapshot(vec![consumer("orders", 1, 0, 0, 2)]);
    later.heads_looked = false;
    later.taken_at += chrono::TimeDelta::seconds(10);
    for c in &mut later.consumers {
        c.oldest_dead_letter_seconds = None;
    }
    app.update(Action::Data(later));
    let age = app.lines[0].oldest_error_seconds.unwrap();
    assert!((3609.0..3611.0).contains(&age), "{age}");
    let mut empty = snapshot(vec![consumer("orders", 1, 0, 0, 0)]);
    empty.heads_looked = false;
    app.update(Action::Data(empty));
    assert_eq!(app.lines[0].oldest_error_seconds, None);
}

/// A broker half cut short (its heads not all looked at): the age of a head it did look at is this snapshot's; the
/// others keep what was known, aged. Without a look's own mark, a broker slow on every round showed no new age at all.
#[test]
fn a_cut_short_look_takes_the_ages_it_found_and_keeps_the_others() {
    let mut app = App::new(0.05);
    app.update(Action::Data(snapshot(vec![
        consumer("billing", 1, 0, 0, 2),
        consumer("orders", 1, 0, 0, 2),
    ])));
    let mut cut = snapshot(vec![
        consumer("billing", 1, 0, 0, 2),
        consumer("orders", 1, 0, 0, 2),
    ]);
    cut.heads_looked = false;
    cut.broker_cut_short = true;
    cut.taken_at += chrono::TimeDelta::seconds(10);
    for c in &mut cut.consumers {
        c.oldest_dead_letter_seconds = None;
    }
    // billing's head looked at, and younger now (its oldest replayed meanwhile); orders' not reached.
    cut.consumers[0].head_looked = true;
    cut.consumers[0].oldest_dead_letter_seconds = Some(60.0);
    app.update(Action::Data(cut));
    let age = |name: &str| {
        app.lines
            .iter()
            .find(|l| l.consumer_type == name)
            .and_then(|l| l.oldest_error_seconds)
    };
    assert_eq!(age("billing"), Some(60.0));
    let orders = age("orders").unwrap();
    assert!((3609.0..3611.0).contains(&orders), "{orders}");
}

#[test]
fn a_reload_under_an_open_question_closes_it_and_the_selection_follows_its_group() {
    use crate::top::detail::Request;
    let mut app = App::new(0.05);
    app.update(Action::Data(snapshot(vec![consumer("orders", 1, 0, 0, 2)])));
    app.update(Action::Open);
    app.update(Action::DetailLoaded(Box::new(Ok(detail_of(
        "orders",
        &[("aaaa", 2, &["m1", "m2"]), ("bbbb", 1, &["m3"])],
    )))));
    app.update(Action::Down);
    app.update(Action::Replay);
    assert_eq!(app.mode(), Mode::Confirm);
    // The listing changes under the question: bbbb is now first. The question closes; `y` does nothing.
    app.update(Action::DetailLoaded(Box::new(Ok(detail_of(
        "orders",
        &[
            ("bbbb", 5, &["m3", "m4", "m5", "m6", "m7"]),
            ("aaaa", 2, &["m1", "m2"]),
        ],
    )))));
    assert_eq!(app.mode(), Mode::Detail);
    assert!(
        app.status
            .as_deref()
            .is_some_and(|s| s.contains("press r again"))
    );
    app.update(Action::Confirm(true));
    assert!(!matches!(app.request, Some(Request::Replay { .. })));
    let d = app.detail.as_ref().unwrap();
    assert_eq!(
        d.selected_group().unwrap().cause.fingerprint,
        "bbbb",
        "the selection follows its group"
    );
    // A replay runs: leaving the detail and coming back does not allow a second one.
    app.update(Action::Replay);
    app.update(Action::Confirm(true));
    assert!(matches!(app.request.take(), Some(Request::Replay { .. })));
    app.update(Action::Back);
    app.update(Action::Open);
    app.update(Action::DetailLoaded(Box::new(Ok(detail_of(
        "orders",
        &[("bbbb", 5, &["m3"])],
    )))));
    app.update(Action::Replay);
    assert_eq!(app.mode(), Mode::Detail);
    assert_eq!(app.status.as_deref(), Some("a replay is running"));
}

/// A consumer_type whose consumer reads its queue in another vhost: its detail would list, hold and replay the
/// messages of a queue of the same name in top's vhost — another environment's — as its own. Refused, said.
#[test]
fn the_detail_of_a_consumer_reading_in_another_vhost_is_not_opened_here() {
    let mut app = App::new(0.05);
    let mut elsewhere = consumer("orders", 1, 0, 0, 2);
    elsewhere.other_vhost = Some("prod".into());
    app.update(Action::Data(snapshot(vec![elsewhere])));
    app.update(Action::Open);
    assert_eq!(app.request.take(), None, "nothing looked at");
    assert!(app.detail.is_none());
    assert!(
        app.status
            .as_deref()
            .is_some_and(|s| s.contains("vhost prod")),
        "{:?}",
        app.status
    );
}

/// A head left alone because it was delivered too often (`head_skipped`) keeps its last age, aging, though the other
/// heads of the snapshot were looked at: it was blanked, the oldest waiting message's warning gone.
#[test]
fn a_worn_heads_age_stands_and_ages() {
    let mut app = App::new(0.05);
    let mut looked = consumer("orders", 1, 0, 0, 2);
    looked.head_looked = true;
    app.update(Action::Data(snapshot(vec![looked])));
    let mut worn = consumer("orders", 1, 0, 0, 2);
    worn.oldest_dead_letter_seconds = None;
    worn.head_skipped = true;
    let mut later = snapshot(vec![worn]);
    later.taken_at += chrono::TimeDelta::seconds(30);
    app.update(Action::Data(later));
    let age = app.all[0].oldest_error_seconds;
    assert!(
        age.is_some_and(|a| (3629.0..3631.0).contains(&a)),
        "{age:?}"
    );
}
