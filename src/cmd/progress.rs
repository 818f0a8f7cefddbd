//! Progress on a terminal, drawn with indicatif on stderr and cleared when done; nothing at all when stderr is not a
//! terminal (a pipe, a file, the tests) or when the command prints JSON.

use std::io::IsTerminal as _;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar counting `what` up to a known total (set with `set_length`); hidden unless `wanted` on a terminal.
pub fn counter(wanted: bool, what: &str) -> ProgressBar {
    styled(wanted, &format!("{{bar:30}} {{pos}} of {{len}} {what}"))
}

/// A line that says what is happening, in its message, without a known end; hidden unless `wanted` on a terminal.
pub fn line(wanted: bool) -> ProgressBar {
    styled(wanted, "{spinner} {msg}")
}

fn styled(wanted: bool, template: &str) -> ProgressBar {
    if !wanted || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}
