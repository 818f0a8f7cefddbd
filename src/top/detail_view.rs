//! Drawing the detail view: a function of its state. Everything from the database or the broker is escaped.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize as _};
use ratatui::text::Line as TextLine;
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState, Wrap};

use super::detail::DetailState;
use crate::sanitize;
use crate::triage::detail::Detail;

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%m-%d %H:%M:%S UTC").to_string()
}

/// The detail of one consumer_type, in `area`.
pub fn render(d: &DetailState, frame: &mut Frame, area: Rect) {
    let name = sanitize::text(&d.consumer_type);
    let [groups_area, lower] =
        Layout::vertical([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(area);
    let [failures_area, right] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(lower);
    let [unprocessed_area, audit_area] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(right);
    let detail = match &d.data {
        None => {
            frame.render_widget(
                Paragraph::new(format!("loading the detail of {name}…")).block(
                    Block::new()
                        .borders(Borders::ALL)
                        .title(format!(" {name} ")),
                ),
                area,
            );
            return;
        }
        Some(Err(e)) => {
            frame.render_widget(
                Paragraph::new(format!(
                    "the detail could not be loaded: {}",
                    sanitize::text(e)
                ))
                .wrap(Wrap { trim: true })
                .block(
                    Block::new()
                        .borders(Borders::ALL)
                        .title(format!(" {name} ")),
                ),
                area,
            );
            return;
        }
        Some(Ok(detail)) => detail,
    };
    let queue = sanitize::text(&detail.error_queue);
    render_groups(d, detail, &name, &queue, frame, groups_area);
    render_lists(detail, frame, [failures_area, unprocessed_area, audit_area]);
    if let Some(pending) = &d.confirm {
        confirm(frame, area, pending);
    }
}

/// The error queue's failure groups, the selected one highlighted.
fn render_groups(
    d: &DetailState,
    detail: &Detail,
    name: &str,
    queue: &str,
    frame: &mut Frame,
    groups_area: Rect,
) {
    match &detail.groups {
        Ok(listing) => {
            let rows = listing.groups.iter().map(|g| {
                Row::new(vec![
                    Cell::from(sanitize::text(&g.cause.fingerprint).into_owned()),
                    Cell::from(g.count.to_string()),
                    Cell::from(sanitize::text(&g.cause.exception_type).into_owned()),
                    Cell::from(sanitize::text(&g.cause.reason).into_owned()),
                    Cell::from(g.last_failed_at.map(time).unwrap_or_default()),
                ])
            });
            let table = Table::new(
                rows,
                [
                    Constraint::Length(11),
                    Constraint::Length(7),
                    Constraint::Percentage(30),
                    Constraint::Percentage(50),
                    Constraint::Length(15),
                ],
            )
            .header(
                Row::new([
                    "fingerprint",
                    "count",
                    "exception type",
                    "reason (masked)",
                    "last failed",
                ])
                .bold()
                .underlined(),
            )
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
            .block(Block::new().borders(Borders::ALL).title(format!(
                " {name}: failure groups of {queue} ({} messages{}; r replays the selected group) ",
                listing.looked,
                match (listing.replay_running, listing.looked_at_elsewhere) {
                    (true, _) => ", and those a running replay holds",
                    (false, true) => ", not those another look may have held",
                    (false, false) => "",
                }
            )));
            let mut state =
                TableState::new().with_selected((!listing.groups.is_empty()).then_some(d.selected));
            frame.render_stateful_widget(table, groups_area, &mut state);
        }
        Err(why) => frame.render_widget(
            Paragraph::new(format!("no groups: {}", sanitize::text(why))).block(
                Block::new()
                    .borders(Borders::ALL)
                    .title(format!(" {name}: failure groups ")),
            ),
            groups_area,
        ),
    }
}

/// The latest failures, the oldest unprocessed rows and the last audit entries.
fn render_lists(
    detail: &Detail,
    frame: &mut Frame,
    [failures_area, unprocessed_area, audit_area]: [Rect; 3],
) {
    let failures: Vec<TextLine> = detail
        .failures
        .iter()
        .map(|f| {
            TextLine::from(format!(
                "{} {} {} {}",
                time(f.occurred_at),
                sanitize::text(&f.kind.replace('_', " ")),
                f.message_id.map(|i| i.to_string()).unwrap_or_default(),
                sanitize::text(f.detail.as_deref().unwrap_or(""))
            ))
        })
        .collect();
    list(frame, failures_area, " recent failures ", failures);
    let unprocessed: Vec<TextLine> = detail
        .oldest_unprocessed
        .iter()
        .map(|(id, at)| {
            // A time of ±infinity in the table (.NET's DateTime.MinValue/MaxValue) is shown as what it is.
            let at = at.map_or_else(|| "±infinity".to_owned(), time);
            TextLine::from(format!("{at} {id}"))
        })
        .collect();
    list(
        frame,
        unprocessed_area,
        " oldest unprocessed rows ",
        unprocessed,
    );
    let audit: Vec<TextLine> = match &detail.audit {
        Ok(rows) => rows
            .iter()
            .map(|r| {
                TextLine::from(format!(
                    "{} {} {} ({})",
                    time(r.occurred_at),
                    sanitize::text(&r.command),
                    sanitize::text(&r.outcome),
                    sanitize::text(r.os_user.as_deref().unwrap_or("?"))
                ))
            })
            .collect(),
        Err(why) => {
            vec![TextLine::from(format!("cannot be read: {}", sanitize::text(why))).italic()]
        }
    };
    list(frame, audit_area, " last audit entries ", audit);
}

fn list(frame: &mut Frame, area: Rect, title: &str, lines: Vec<TextLine<'static>>) {
    let lines = if lines.is_empty() {
        vec![TextLine::from("none").italic()]
    } else {
        lines
    };
    frame.render_widget(
        Paragraph::new(lines).block(Block::new().borders(Borders::ALL).title(title.to_owned())),
        area,
    );
}

/// The question before a group is replayed: its count, its cause, where from.
fn confirm(frame: &mut Frame, area: Rect, p: &super::detail::Pending) {
    let text = vec![
        TextLine::from(format!(
            "replay {} messages of group {} from {}?",
            p.count,
            sanitize::text(&p.fingerprint),
            sanitize::text(&p.from)
        )),
        TextLine::from(format!(
            "{}: {}",
            sanitize::text(&p.exception_type),
            sanitize::text(&p.reason)
        )),
        TextLine::from("only the members listed now; newer failures of the cause stay"),
        TextLine::from(""),
        TextLine::from("y replay · n or Esc cancel"),
    ];
    let popup = super::ui::centred(area, 80, 7);
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: true })
            .style(Style::new().fg(Color::White).bg(Color::Blue))
            .block(Block::new().borders(Borders::ALL).title(" confirm ")),
        popup,
    );
}
