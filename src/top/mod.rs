//! `inboxctl top`: the live dashboard. State in [`app`] (pure), drawing in [`ui`] (a function of the state), and here
//! the loop that merges keys, fresh figures and signals. The figures are collected by a task of their own, so a slow
//! or unreachable database never holds up the screen.

mod actions;
pub mod app;
pub mod detail;
mod detail_view;
pub mod ui;

use std::time::Duration;

use crate::amqp::Connection;
use crossterm::event::{Event, EventStream, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use futures_util::StreamExt as _;
use sqlx::postgres::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use self::app::{Action, App, Mode};
use crate::amqp::Broker;
use crate::error::Result;
use crate::stats::{self, Range};

/// How often `top` looks at the error queues' oldest messages: each look is a get and a requeue, which a quorum queue
/// counts as a delivery of that message (and past its `delivery-limit`, drops or dead-letters it).
const HEADS_EVERY: Duration = Duration::from_secs(30);

/// The longest any statement of the dashboard's runs on the server: what it waits for the longest (a detail's look).
pub const STATEMENT_TIMEOUT: Duration = actions::LOOK_LIMIT;

/// How long the series under the table reaches back.
const SERIES_SPAN: Duration = Duration::from_secs(120);

/// The most buckets the series has: a long `--window` makes the buckets longer rather than more numerous (a bucket per
/// second over a day would be 86,400 groups per consumer_type and refresh; over 100 years, more than memory holds).
const MAX_BUCKETS: u32 = 600;

pub struct Options {
    pub interval: Duration,
    pub window: Duration,
    pub alert_duplicates: f64,
    /// The cleanup's retention, which the oldest dead-lettered message is compared with.
    pub retention: Duration,
    /// No action that changes anything (the detail view's replay).
    pub read_only: bool,
}

/// Restores the terminal however the dashboard ends: return, error or panic (ratatui's panic hook), and before an
/// exit at once on a second signal — out of raw mode and the alternate screen, or the shell is left unusable.
struct Restore;

impl Restore {
    fn guard() -> Self {
        crate::shutdown::before_exit(Some(ratatui::restore));
        Self
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        // Unwinding from a panic, the panic hook (`try_init`'s) has given the terminal back and printed the panic:
        // given back again, the cursor saved on entering the alternate screen was restored once more, and what the
        // shell wrote next covered the panic's text.
        if !std::thread::panicking() {
            ratatui::restore();
        }
        crate::shutdown::before_exit(None);
    }
}

pub async fn run(
    pool: PgPool,
    broker: Broker,
    options: Options,
    shutdown: CancellationToken,
) -> Result<()> {
    let (tx, mut rx) = mpsc::channel(2);
    let collector_stop = shutdown.child_token();
    let range = range(options.interval, options.window, options.retention);
    let context = actions::Context {
        pool: pool.clone(),
        broker: broker.clone(),
        retention: options.retention,
        shutdown: collector_stop.clone(),
    };
    // The guard first: `try_init` turns on raw mode before it enters the alternate screen, and a failure after that
    // would leave the terminal raw.
    let restore = Restore::guard();
    let mut terminal = ratatui::try_init()?;
    // Started once the panic hook that gives the terminal back is in place (`try_init` installs it): a panic of the
    // collector is taken below for one the hook has answered.
    let collector = tokio::spawn(collect(
        pool,
        broker,
        range,
        options.interval,
        tx.clone(),
        collector_stop.clone(),
    ));
    let mut app = App::new(options.alert_duplicates);
    app.read_only = options.read_only;
    let mut events = EventStream::new();
    let mut tasks: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    let mut collector = Some(collector);
    // A background task panicked: the panic hook gave the terminal back then, and giving it back again would restore
    // the cursor saved on entering the alternate screen, the error then written over what the panic printed.
    let mut given_back = false;
    let result = loop {
        if let Err(e) = terminal.draw(|frame| ui::render(&app, frame)) {
            break Err(e.into());
        }
        tokio::select! {
            () = shutdown.cancelled() => {
                // Tests hold the dashboard here to send the second signal while it still owns the terminal.
                crate::failpoint::hit("top-stopping").await;
                break Ok(());
            }
            event = events.next() => match event {
                Some(Ok(Event::Key(key))) => {
                    // A panic in the dashboard's own loop (a test's, at a key).
                    crate::failpoint::hit("top-key").await;
                    if let Some(action) = action_for(key, app.mode()) {
                        app.update(action);
                    }
                }
                Some(Ok(_)) => {} // a resize: the next draw fits the new size
                Some(Err(e)) => break Err(e.into()),
                None => break Ok(()),
            },
            Some(action) = rx.recv() => app.update(action),
            // The collector ends only when stopped: ended here, it panicked — and the panic hook has given the
            // terminal back already, so drawing on would draw into a terminal out of raw mode.
            ended = async { collector.as_mut()?.await.err() }, if collector.is_some() => {
                collector = None;
                if let Some(e) = ended {
                    given_back = e.is_panic();
                    break Err(background_failed("the data collection", &e));
                }
            }
        }
        if let Some(panicked) = finished_badly(&mut tasks) {
            given_back = panicked.is_panic();
            break Err(background_failed("an action (a look, a replay)", &panicked));
        }
        if let Some(request) = app.request.take() {
            tasks.push(actions::start(request, &context, &tx));
        }
        if app.quit {
            break Ok(());
        }
    };
    collector_stop.cancel();
    // The terminal back at once: what is left to wait for draws nothing.
    drop(terminal);
    if given_back {
        crate::shutdown::before_exit(None);
        std::mem::forget(restore);
    } else {
        drop(restore);
    }
    // Nobody reads the answers any more: a sender must not wait on a full channel.
    drop(rx);
    if let Some(collector) = collector {
        let _ = collector.await;
    }
    // A replay stopped here gives back what it holds and writes its audit row; a look just ends.
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    }
    result
}

/// Removes the tasks that have ended; the error of one that panicked (or was cancelled), if one did.
fn finished_badly(tasks: &mut Vec<tokio::task::JoinHandle<()>>) -> Option<tokio::task::JoinError> {
    use futures_util::FutureExt as _;
    let mut panicked = None;
    tasks.retain_mut(|t| {
        if !t.is_finished() {
            return true;
        }
        if let Some(Err(e)) = t.now_or_never() {
            panicked.get_or_insert(e);
        }
        false
    });
    panicked
}

/// A background task of the dashboard that ended in a panic (inboxctl's bug): the dashboard ends with it, an error.
fn background_failed(what: &str, ended: &tokio::task::JoinError) -> crate::error::Error {
    crate::error::Error::Io(std::io::Error::other(format!(
        "{what} of the dashboard failed ({ended}): this is inboxctl's bug; the dashboard has stopped"
    )))
}

/// How long one refresh may take: twice the interval, and never less than 15 s (a database of hundreds of
/// consumer_types, a broker some milliseconds away, take seconds).
fn refresh_limit(interval: Duration) -> Duration {
    (interval * 2).max(Duration::from_secs(15))
}

/// What a refresh collects: rates over `window`, and a series over at least the last two minutes in buckets of about
/// `interval` (at least a second, and about [`MAX_BUCKETS`] of them at most). The window is a whole number of buckets:
/// the rates count the buckets within it and divide by it, so a bucket longer than the window (`--interval 2m` over a
/// 1m window), or one that does not divide it, would count more than the window and show rates too high.
fn range(interval: Duration, window: Duration, retention: Duration) -> Range {
    let span = SERIES_SPAN.max(window);
    let wanted = interval.max(Duration::from_secs(1)).max(span / MAX_BUCKETS);
    let per_window = window.as_nanos().div_ceil(wanted.as_nanos().max(1)).max(1);
    Range {
        exact_below: stats::EXACT_BELOW_LIVE,
        window,
        span,
        bucket: window / u32::try_from(per_window).unwrap_or(u32::MAX),
        retention,
        look_at_heads: true,
        broker_within: Some(refresh_limit(interval) / 2),
        live: true,
    }
}

/// The key bindings, by what is open (`mode`): while a filter is typed, keys go to it; in the detail view, Esc goes
/// back and `r` replays the selected group; in the confirmation, `y` or `n`.
pub fn action_for(key: KeyEvent, mode: Mode) -> Option<Action> {
    if key.kind != KeyEventKind::Press {
        return None;
    }
    let ctrl_c = key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
    if ctrl_c {
        return Some(Action::Quit);
    }
    match mode {
        Mode::Filtering => {
            return match key.code {
                KeyCode::Char(c) => Some(Action::FilterChar(c)),
                KeyCode::Backspace => Some(Action::FilterBackspace),
                KeyCode::Enter => Some(Action::FilterDone),
                KeyCode::Esc => Some(Action::FilterCancel),
                _ => None,
            };
        }
        Mode::Confirm => {
            return match key.code {
                KeyCode::Char('y' | 'Y') => Some(Action::Confirm(true)),
                KeyCode::Char('n' | 'N') | KeyCode::Esc => Some(Action::Confirm(false)),
                _ => None,
            };
        }
        Mode::Detail => {
            return match key.code {
                KeyCode::Esc => Some(Action::Back),
                KeyCode::Char('q') => Some(Action::Quit),
                KeyCode::Char('r') => Some(Action::Replay),
                KeyCode::Up | KeyCode::Char('k') => Some(Action::Up),
                KeyCode::Down | KeyCode::Char('j') => Some(Action::Down),
                KeyCode::Char('?') | KeyCode::Char('h') => Some(Action::Help),
                _ => None,
            };
        }
        Mode::Table => {}
    }
    match key.code {
        KeyCode::Char('/') => Some(Action::FilterStart),
        KeyCode::Enter => Some(Action::Open),
        KeyCode::Char('q') | KeyCode::Esc => Some(Action::Quit),
        KeyCode::Up | KeyCode::Char('k') => Some(Action::Up),
        KeyCode::Down | KeyCode::Char('j') => Some(Action::Down),
        KeyCode::Char('s') => Some(Action::Sort),
        KeyCode::Char('p') => Some(Action::Pause),
        KeyCode::Char('?') | KeyCode::Char('h') => Some(Action::Help),
        _ => None,
    }
}

/// Collects figures every `interval` until stopped; a failure is reported and the next refresh tries again. The broker
/// connection is reopened when it was lost.
async fn collect(
    pool: PgPool,
    broker: Broker,
    range: Range,
    interval: Duration,
    tx: mpsc::Sender<Action>,
    stop: CancellationToken,
) {
    let mut connection: Option<Connection> = None;
    // Why the last connect failed, for the status line.
    let mut unreachable: Option<String> = None;
    let mut heads_looked_at: Option<tokio::time::Instant> = None;
    loop {
        let look = heads_looked_at.is_none_or(|t| t.elapsed() >= HEADS_EVERY);
        let range = Range {
            look_at_heads: look,
            ..range
        };
        if connection.as_ref().is_none_or(|c| !c.status().connected()) {
            let connected =
                tokio::time::timeout(Duration::from_secs(2), broker.connect("inboxctl top")).await;
            (connection, unreachable) = match connected {
                Ok(Ok(c)) => (Some(c), None),
                Ok(Err(e)) => (None, Some(crate::redact::text(&e.to_string()))),
                Err(_) => (None, Some("no answer within 2s".to_owned())),
            };
        }
        // A refresh is bounded, and given up when the dashboard quits: a statement waiting behind a lock (a
        // `VACUUM FULL`, a migration) or a host that went silent would otherwise freeze the figures without a word,
        // and hold the quit — the terminal left raw — until it answered.
        let limit = refresh_limit(interval);
        let collected = tokio::select! {
            () = stop.cancelled() => break,
            collected = tokio::time::timeout(limit, stats::collect_in(&pool, connection.as_ref(), Some(broker.vhost()), range)) => collected,
        };
        let action = match collected {
            Ok(Ok(mut snapshot)) => {
                if let Some(why) = unreachable.as_deref().filter(|_| connection.is_none()) {
                    snapshot.broker_error = Some(stats::unreachable(why));
                }
                // Looks cut short are not tried again at once either: they would be cut short again.
                if snapshot.heads_looked || (look && snapshot.broker_cut_short) {
                    heads_looked_at = Some(tokio::time::Instant::now());
                }
                Action::Data(Box::new(snapshot))
            }
            Ok(Err(e)) => Action::DataError(crate::redact::text(&e.to_string())),
            Err(_) => {
                // Its looks at the heads are not what held it (they are bounded apart), but they are not tried again
                // at once either.
                if look {
                    heads_looked_at = Some(tokio::time::Instant::now());
                }
                Action::DataError(format!(
                    "a refresh took longer than {} (the database or RabbitMQ did not answer: a lock, a host gone \
                 silent); trying again",
                    humantime::format_duration(limit)
                ))
            }
        };
        if tx.send(action).await.is_err() {
            break;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(interval) => {}
        }
    }
    if let Some(c) = connection {
        crate::amqp::close(&c, "OK").await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_a_whole_number_of_buckets_whatever_the_interval() {
        let minute = Duration::from_secs(60);
        for interval in [120, 45, 7, 1, 0].map(Duration::from_secs) {
            let r = range(interval, minute, Duration::from_secs(3600));
            assert!(r.bucket <= r.window, "{interval:?}: {:?}", r.bucket);
            let covered = r.bucket * u32::try_from(r.buckets(r.window)).unwrap();
            assert!(
                covered.abs_diff(r.window) < Duration::from_millis(1),
                "{interval:?}: {:?} buckets of {:?}",
                r.buckets(r.window),
                r.bucket
            );
        }
        let week = range(
            Duration::from_secs(1),
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(7 * 86_400),
        );
        assert!(week.buckets(week.span) <= 2 * MAX_BUCKETS as usize);
    }

    fn action_for_(key: KeyEvent) -> Option<Action> {
        action_for(key, Mode::Table)
    }

    #[test]
    fn while_filtering_keys_are_typed_and_esc_ends_it() {
        let none = KeyModifiers::NONE;
        assert!(matches!(
            action_for_(key(KeyCode::Char('/'), none)),
            Some(Action::FilterStart)
        ));
        assert!(matches!(
            action_for(key(KeyCode::Char('q'), none), Mode::Filtering),
            Some(Action::FilterChar('q'))
        ));
        assert!(matches!(
            action_for(key(KeyCode::Esc, none), Mode::Filtering),
            Some(Action::FilterCancel)
        ));
        assert!(matches!(
            action_for(key(KeyCode::Enter, none), Mode::Filtering),
            Some(Action::FilterDone)
        ));
        assert!(matches!(
            action_for(
                key(KeyCode::Char('c'), KeyModifiers::CONTROL),
                Mode::Filtering
            ),
            Some(Action::Quit)
        ));
    }

    fn key(code: KeyCode, modifiers: KeyModifiers) -> KeyEvent {
        KeyEvent::new(code, modifiers)
    }

    #[test]
    fn the_series_has_a_bounded_number_of_buckets_whatever_the_window() {
        let r = range(
            Duration::from_millis(500),
            Duration::from_secs(60),
            stats::DEFAULT_RETENTION,
        );
        assert_eq!((r.span, r.bucket), (SERIES_SPAN, Duration::from_secs(1)));
        for window in [Duration::from_secs(86_400), crate::cli::MAX_DURATION] {
            let r = range(Duration::from_secs(1), window, stats::DEFAULT_RETENTION);
            assert_eq!(r.span, window);
            let buckets = r.span.as_secs_f64() / r.bucket.as_secs_f64();
            assert!(
                buckets <= f64::from(MAX_BUCKETS) + 1.0,
                "{window:?}: {buckets}"
            );
        }
    }

    #[test]
    fn keys() {
        let none = KeyModifiers::NONE;
        assert!(matches!(
            action_for_(key(KeyCode::Char('q'), none)),
            Some(Action::Quit)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Esc, none)),
            Some(Action::Quit)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Char('j'), none)),
            Some(Action::Down)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Up, none)),
            Some(Action::Up)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Char('s'), none)),
            Some(Action::Sort)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Char('p'), none)),
            Some(Action::Pause)
        ));
        assert!(matches!(
            action_for_(key(KeyCode::Char('?'), none)),
            Some(Action::Help)
        ));
        assert!(action_for_(key(KeyCode::Char('x'), none)).is_none());
        assert!(
            action_for_(key(KeyCode::Char('c'), none)).is_none(),
            "plain c does nothing"
        );
    }
}
