//! Drawing the dashboard: a function of the state. Every text that came from the database or the broker passes
//! through [`sanitize::text`] on its way to the screen.

use ratatui::Frame;
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize as _};
use ratatui::text::{Line as TextLine, Span, Text};
use ratatui::widgets::{
    Block, Borders, Cell, Clear, Paragraph, Row, Sparkline, Table, TableState, Wrap,
};

use super::app::{App, Line};
use crate::sanitize;
use crate::stats::{Window, display};

/// Below this height the sparklines give their room to the table.
const MIN_HEIGHT_FOR_CHARTS: u16 = 16;

pub fn render(app: &App, frame: &mut Frame) {
    let area = frame.area();
    if let Some(detail) = &app.detail {
        let [main, status_area] =
            Layout::vertical([Constraint::Min(3), Constraint::Length(1)]).areas(area);
        super::detail_view::render(detail, frame, main);
        render_status(app, frame, status_area);
        if app.show_help {
            render_help(frame, area);
        }
        return;
    }
    let charts = area.height >= MIN_HEIGHT_FOR_CHARTS && app.selected_line().is_some();
    let [table_area, chart_area, status_area] = Layout::vertical([
        Constraint::Min(3),
        Constraint::Length(if charts { 7 } else { 0 }),
        Constraint::Length(1),
    ])
    .areas(area);

    render_table(app, frame, table_area);
    if charts && let Some(line) = app.selected_line() {
        render_charts(app, line, frame, chart_area);
    }
    render_status(app, frame, status_area);
    if app.show_help {
        render_help(frame, area);
    }
}

/// The columns, widest first to go when the terminal is narrow: (header, width, priority).
const COLUMNS: [(&str, u16, u8); 16] = [
    ("consumer_type", 28, 0),
    ("deliv/s", 7, 0),
    ("dup/s", 7, 1),
    ("dup %", 7, 0),
    ("confl", 6, 0),
    ("proc/s", 8, 2),
    ("rows", 8, 2),
    ("unproc", 9, 0),
    ("oldest", 7, 1),
    ("queue", 24, 3),
    ("ready", 7, 1),
    ("cons", 5, 2),
    ("errors", 7, 0),
    ("err age", 7, 1),
    ("owed", 9, 3),
    ("doubt", 9, 2),
];

/// Which columns fit in `width`: drop the least important first.
fn visible_columns(width: u16) -> Vec<usize> {
    for max_priority in (0..=3).rev() {
        let chosen: Vec<usize> = (0..COLUMNS.len())
            .filter(|&i| COLUMNS[i].2 <= max_priority)
            .collect();
        let needed: u16 = chosen.iter().map(|&i| COLUMNS[i].1 + 1).sum::<u16>() + 4;
        if needed <= width || max_priority == 0 {
            return chosen;
        }
    }
    Vec::new()
}

fn cells(line: &Line) -> [String; 16] {
    let mut unprocessed = display::count_of(
        line.unprocessed,
        line.unprocessed_estimated,
        line.unprocessed_at_least,
    );
    if line.unprocessed_growing {
        unprocessed.push('↑');
    }
    [
        sanitize::text(&line.consumer_type).into_owned(),
        display::rate_of(line.deliveries_per_second, line.rates_estimated),
        display::rate_of(line.duplicates_per_second, line.rates_estimated),
        display::percent_of(line.duplicate_ratio, line.rates_estimated),
        display::count(line.conflicts, line.rates_estimated),
        display::rate_of(line.processed_per_second, line.rates_estimated),
        display::count_of(line.rows, line.rows_estimated, line.rows_at_least),
        unprocessed,
        display::age(line.oldest_unprocessed_seconds),
        line.queue
            .as_deref()
            .map(|q| sanitize::text(q).into_owned())
            .unwrap_or_else(|| display::UNKNOWN.into()),
        display::count(line.ready.map(u64::from), false),
        display::count(line.consumers.map(u64::from), false),
        display::count(line.errors.map(u64::from), false),
        display::age(line.oldest_error_seconds),
        effects(line.effects_pending, line.oldest_effect_pending_seconds),
        effects(line.effects_in_doubt, line.oldest_effect_in_doubt_seconds),
    ]
}

/// A count of calls outside the database, with the age of the oldest when there are any: the count in at most four
/// characters, rounded down, so that the two fit the column (a right-aligned cell too wide loses its left end: 1,500
/// calls showed as 500); `≥` before a floor (a count stopped at `EFFECTS_AT_MOST`).
fn effects(count: Option<u64>, oldest: Option<f64>) -> String {
    match count {
        Some(n) if n > 0 => {
            let n = match n {
                0..1_000 => n.to_string(),
                1_000..10_000 => format!("{}.{}k", n / 1_000, n % 1_000 / 100),
                10_000..1_000_000 => format!("{}k", n / 1_000),
                1_000_000..10_000_000 => format!("{}.{}M", n / 1_000_000, n % 1_000_000 / 100_000),
                _ => format!("{}M", n / 1_000_000),
            };
            let floor = if count >= Some(crate::stats::EFFECTS_AT_MOST) {
                "≥"
            } else {
                ""
            };
            format!("{floor}{n} {}", display::age(oldest))
        }
        other => display::count(other, false),
    }
}

fn render_table(app: &App, frame: &mut Frame, area: Rect) {
    let columns = visible_columns(area.width);
    let alert = Style::new().fg(Color::Red).add_modifier(Modifier::BOLD);
    let warn = Style::new().fg(Color::Yellow);
    let rows = app.lines.iter().map(|line| {
        let texts = cells(line);
        Row::new(columns.iter().map(|&i| {
            // Names to the left, figures to the right.
            let text = if matches!(i, 0 | 9) {
                Text::from(texts[i].clone())
            } else {
                Text::from(texts[i].clone()).alignment(Alignment::Right)
            };
            let cell = Cell::from(text);
            match i {
                3 if line.duplicates_alert => cell.style(alert),
                4 if line.conflicts.is_some_and(|n| n > 0) => cell.style(alert),
                7 if line.unprocessed_growing => cell.style(warn),
                12 if line.errors_alert => cell.style(alert),
                13 if line.error_window == Some(Window::Past) => cell.style(alert),
                13 if line.error_window == Some(Window::Near) => cell.style(warn),
                14 if line.effects_pending.is_some_and(|n| n > 0) => cell.style(warn),
                15 if line.effects_in_doubt.is_some_and(|n| n > 0) => cell.style(alert),
                _ => cell,
            }
        }))
    });
    let header = Row::new(columns.iter().map(|&i| {
        let text = Text::from(COLUMNS[i].0);
        Cell::from(if matches!(i, 0 | 9) {
            text
        } else {
            text.alignment(Alignment::Right)
        })
    }))
    .bold()
    .underlined();
    let widths = columns.iter().map(|&i| {
        if i == 0 {
            Constraint::Min(12)
        } else {
            Constraint::Length(COLUMNS[i].1)
        }
    });
    let title = format!(
        " inboxctl top — rates over {} — sorted by {}{} ",
        humantime::format_duration(std::time::Duration::from_secs_f64(app.window_seconds)),
        app.sort.label(),
        if app.paused { " — PAUSED" } else { "" }
    );
    let table = Table::new(rows, widths)
        .header(header)
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol("▶ ")
        .block(Block::new().borders(Borders::ALL).title(title));
    let mut state = TableState::new().with_selected(app.selected_index());
    frame.render_stateful_widget(table, area, &mut state);
    if app.lines.is_empty() {
        let inner = area.inner(ratatui::layout::Margin::new(2, 2));
        let text = if app.updated_at.is_none() {
            "waiting for the first figures…".to_owned()
        } else if app.has_consumer_types() {
            format!(
                "no consumer_type matches the filter {}",
                sanitize::text(&app.filter)
            )
        } else {
            "no consumer_type yet: inbox_messages is empty".to_owned()
        };
        frame.render_widget(Paragraph::new(text).italic(), inner);
    }
}

fn render_charts(app: &App, line: &Line, frame: &mut Frame, area: Rect) {
    if line.series.is_empty() {
        let text = format!(
            "{}: no counters — no inboxctl consumer has run as this consumer_type, so its rates are unknown",
            sanitize::text(&line.consumer_type)
        );
        frame.render_widget(
            Paragraph::new(text)
                .wrap(Wrap { trim: true })
                .block(Block::new().borders(Borders::ALL)),
            area,
        );
        return;
    }
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    // In whole seconds: buckets that divide the window may be a fraction of a second long (6.67 s of a minute).
    let span = humantime::format_duration(std::time::Duration::from_secs(
        (app.bucket_seconds * line.series.len() as f64).round() as u64,
    ));
    let name = sanitize::text(&line.consumer_type);
    let deliveries: Vec<u64> = line.series.iter().map(|p| p.0).collect();
    let duplicates: Vec<u64> = line.series.iter().map(|p| p.1).collect();
    let max = deliveries.iter().copied().max().unwrap_or(0).max(1);
    frame.render_widget(
        Sparkline::default()
            .data(tail(&deliveries, left.width.saturating_sub(2)))
            .max(max)
            .style(Style::new().fg(Color::Green))
            .block(
                Block::new()
                    .borders(Borders::ALL)
                    .title(format!(" {name}: deliveries, last {span} ")),
            ),
        left,
    );
    frame.render_widget(
        Sparkline::default()
            .data(tail(&duplicates, right.width.saturating_sub(2)))
            .max(max)
            .style(Style::new().fg(if line.duplicates_alert {
                Color::Red
            } else {
                Color::Yellow
            }))
            .block(
                Block::new()
                    .borders(Borders::ALL)
                    .title(" duplicates (same scale) "),
            ),
        right,
    );
}

/// The newest `width` points.
fn tail(points: &[u64], width: u16) -> Vec<u64> {
    points[points.len().saturating_sub(usize::from(width))..].to_vec()
}

fn render_status(app: &App, frame: &mut Frame, area: Rect) {
    let mut spans = Vec::new();
    match &app.error {
        Some(e) => spans.push(Span::styled(
            format!(" {} — retrying ", sanitize::text(e)),
            Style::new().fg(Color::White).bg(Color::Red),
        )),
        None => match app.updated_at {
            Some(t) => spans.push(Span::raw(format!(" updated {} UTC ", t.format("%H:%M:%S")))),
            None => spans.push(Span::raw(" connecting… ")),
        },
    }
    if let Some(e) = &app.broker_error {
        spans.push(Span::styled(
            format!(" RabbitMQ: {} ", sanitize::text(e)),
            Style::new().fg(Color::Black).bg(Color::Yellow),
        ));
    }
    if app.filtering || !app.filter.is_empty() {
        let cursor = if app.filtering { "▏" } else { "" };
        spans.push(Span::styled(
            format!(" filter: {}{cursor} ", sanitize::text(&app.filter)),
            Style::new().fg(Color::Black).bg(Color::Cyan),
        ));
    }
    if let Some(status) = &app.status {
        spans.push(Span::styled(
            format!(" {} ", sanitize::text(status)),
            Style::new().fg(Color::Black).bg(Color::Green),
        ));
    }
    if app.read_only {
        spans.push(Span::styled(
            " read-only: actions off ",
            Style::new().fg(Color::Black).bg(Color::Yellow),
        ));
    }
    if app.detail.is_some() {
        let keys = if app.read_only {
            " Esc back · ↑↓/jk group · q quit"
        } else {
            " Esc back · ↑↓/jk group · r replay group · q quit"
        };
        spans.push(Span::raw(keys).dim());
    } else if app.filtering {
        spans.push(Span::raw(" type a name · Enter keep · Esc clear").dim());
    } else {
        spans
            .push(Span::raw(" ↑↓/jk select · / filter · s sort · p pause · ? help · q quit").dim());
    }
    frame.render_widget(Paragraph::new(TextLine::from(spans)), area);
}

/// A box of at most `width` × `height` in the middle of `area`, for a popup.
pub(super) fn centred(area: Rect, width: u16, height: u16) -> Rect {
    let (width, height) = (width.min(area.width), height.min(area.height));
    Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height - height) / 2,
        width,
        height,
    }
}

fn render_help(frame: &mut Frame, area: Rect) {
    let text = vec![
        TextLine::from("↑ ↓ or j k   select a consumer_type (its charts below)"),
        TextLine::from(
            "/            filter consumer_types by name (Enter keeps it, Esc clears it)",
        ),
        TextLine::from("s            sort by the next column"),
        TextLine::from("p            pause / resume the refresh"),
        TextLine::from("?            this help"),
        TextLine::from("q Esc Ctrl-C quit"),
        TextLine::from(""),
        TextLine::from("~ estimated from PostgreSQL's statistics · ≥ at least · ? unknown"),
        TextLine::from("red dup %: above --alert-duplicates · ↑ unprocessed growing"),
        TextLine::from("red errors: the error queue is not empty"),
        TextLine::from(
            "err age: its oldest message; yellow near the retention, red past it (a replay may repeat)",
        ),
    ];
    let popup = centred(area, 66, text.len() as u16 + 2);
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: false })
            .block(Block::new().borders(Borders::ALL).title(" help ")),
        popup,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top::app::tests::{consumer, snapshot};
    use crate::top::app::{Action, App};
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn draw(app: &App, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("terminal");
        terminal.draw(|f| render(app, f)).expect("draw");
        let buffer = terminal.backend().buffer().clone();
        let mut out = String::new();
        for y in 0..buffer.area.height {
            for x in 0..buffer.area.width {
                out.push_str(buffer[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    fn app() -> App {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("parcel-created-carrier", 120, 30, 0, 0),
            consumer("parcel-created-notification", 60, 0, 7, 2),
        ])));
        app
    }

    /// Buckets a fraction of a second long (a minute cut in nine, `--interval 7s`): the chart's span in whole
    /// seconds, not "1m 59s 999ms 999us 988ns".
    #[test]
    fn a_chart_over_fractional_buckets_names_its_span_in_seconds() {
        let mut app = App::new(0.05);
        let mut shot = snapshot(vec![consumer("parcel-created-carrier", 120, 30, 0, 0)]);
        shot.bucket = std::time::Duration::from_secs(60) / 9;
        if let Some(c) = shot.consumers.first_mut() {
            c.series = vec![(1, 0); 18];
        }
        app.update(Action::Data(shot));
        let screen = draw(&app, 140, 30);
        assert!(
            screen.contains("deliveries, last 2m "),
            "the chart's title:\n{screen}"
        );
    }

    #[test]
    fn rows_and_figures_are_drawn() {
        let screen = draw(&app(), 140, 30);
        let carrier = screen
            .lines()
            .find(|l| l.contains("parcel-created-carrier "))
            .expect("carrier row");
        // 150 deliveries and 30 duplicates over 60 s: 2.5/s and 0.5/s, 20 %.
        for figure in ["2.5", "0.5", "20.0%", "1120"] {
            assert!(carrier.contains(figure), "{figure} in {carrier:?}");
        }
        let notification = screen
            .lines()
            .find(|l| l.contains("parcel-created-notification "))
            .expect("row");
        assert!(
            notification.contains("1.0")
                && notification.contains("75s")
                && notification.contains(" 2 "),
            "{notification:?}"
        );
        assert!(
            screen.contains("deliveries, last 6s"),
            "charts of the selected consumer:\n{screen}"
        );
        assert!(screen.contains("sorted by consumer_type"));
    }

    #[test]
    fn an_escape_sequence_is_shown_inert() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![consumer(
            "evil\u{1b}]0;pwned\u{7}\u{1b}[2J",
            1,
            0,
            0,
            0,
        )])));
        let screen = draw(&app, 140, 30);
        assert!(
            screen.contains("evil\\u{1b}]0;pwned\\u{7}\\u{1b}[2J"),
            "{screen}"
        );
        assert!(!screen.contains('\u{1b}') && !screen.contains('\u{7}'));
    }

    #[test]
    fn effects_in_doubt_are_shown_in_red() {
        let mut carrier = consumer("parcel-created-carrier", 1, 0, 0, 0);
        carrier.effects = Some(crate::stats::EffectCounts {
            pending: 2,
            oldest_pending_seconds: Some(30.0),
            in_doubt: 1,
            oldest_in_doubt_seconds: Some(90.0),
            failed: 0,
            at_least: false,
        });
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![carrier])));
        let mut terminal = Terminal::new(TestBackend::new(200, 30)).expect("terminal");
        terminal.draw(|f| render(&app, f)).expect("draw");
        let buffer = terminal.backend().buffer().clone();
        let row = (0..buffer.area.height)
            .find(|&y| {
                (0..buffer.area.width)
                    .map(|x| buffer[(x, y)].symbol())
                    .collect::<String>()
                    .contains("parcel-created-carrier ")
            })
            .expect("carrier row");
        let text: String = (0..buffer.area.width)
            .map(|x| buffer[(x, row)].symbol())
            .collect();
        assert!(text.contains("2 30s") && text.contains("1 90s"), "{text}");
        let at = text.find("1 90s").expect("doubt cell");
        let x = u16::try_from(text[..at].chars().count()).expect("column");
        assert_eq!(buffer[(x, row)].fg, Color::Red, "{text}");
    }

    /// Right-aligned, a cell wider than its column loses its left end: 1,500 calls owed 45 s showed as `500 45s`.
    #[test]
    fn a_count_of_calls_and_its_age_fit_their_column_rounded_down() {
        let width = usize::from(COLUMNS[14].1);
        assert_eq!(COLUMNS[15].1, COLUMNS[14].1);
        for (n, shown) in [
            (7, "7"),
            (999, "999"),
            (1_500, "1.5k"),
            (9_999, "9.9k"),
            (10_000, "≥10k"),
            (12_345, "≥12k"),
            (20_000, "≥20k"),
        ] {
            for age in [45.0, 7_000.0, 100_000.0, 8_000_000.0] {
                let cell = effects(Some(n), Some(age));
                // A floor (a count stopped at its cap: never past twice it, the in-doubt count being two), marked.
                assert!(cell.starts_with(&format!("{shown} ")), "{cell}");
                assert!(cell.chars().count() <= width, "{cell}");
            }
        }
        assert_eq!(effects(Some(0), None), "0");
    }

    #[test]
    fn a_small_terminal_degrades_gracefully() {
        let screen = draw(&app(), 50, 10);
        assert!(screen.contains("parcel-creat"), "{screen}");
        assert!(!screen.contains("deliveries, last"), "no room for charts");
        assert!(!screen.contains("queue"), "low-priority columns go first");
        // Tiny and empty sizes must not panic either.
        draw(&app(), 10, 3);
        draw(&app(), 1, 1);
    }

    #[test]
    fn help_pause_and_errors_show() {
        let mut app = app();
        app.update(Action::Help);
        assert!(draw(&app, 120, 30).contains("pause / resume the refresh"));
        app.update(Action::Help);
        app.update(Action::Pause);
        assert!(draw(&app, 120, 30).contains("PAUSED"));
        app.update(Action::DataError(
            "PostgreSQL unreachable: connection refused".into(),
        ));
        assert!(
            draw(&app, 120, 30).contains("PostgreSQL unreachable: connection refused — retrying")
        );
    }

    #[test]
    fn a_filter_is_shown_on_the_status_line() {
        let mut app = App::new(0.05);
        app.update(Action::Data(snapshot(vec![
            consumer("orders-carrier", 1, 0, 0, 0),
            consumer("billing", 1, 0, 0, 0),
        ])));
        app.update(Action::FilterStart);
        for c in "ord".chars() {
            app.update(Action::FilterChar(c));
        }
        let screen = draw(&app, 160, 30);
        assert!(screen.contains("filter: ord"), "{screen}");
        assert!(screen.contains("Esc clear"), "{screen}");
        assert!(
            screen.contains("orders-carrier") && !screen.contains("billing"),
            "{screen}"
        );
        app.update(Action::FilterDone);
        let screen = draw(&app, 160, 30);
        assert!(
            screen.contains("filter: ord ") && screen.contains("/ filter"),
            "{screen}"
        );
        // A filter that matches nothing says so, not that the inbox is empty.
        app.update(Action::FilterStart);
        app.update(Action::FilterChar('z'));
        let screen = draw(&app, 160, 30);
        assert!(
            screen.contains("no consumer_type matches the filter ordz"),
            "{screen}"
        );
        assert!(!screen.contains("inbox_messages is empty"), "{screen}");
    }
}
