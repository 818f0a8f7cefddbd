//! SIGINT and SIGTERM as a cancellation token: the first asks long-running commands to stop cleanly, a second one ends
//! the process at once (exit 130; nothing unfinished was acknowledged, so the broker delivers it again).

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Set while a full-screen terminal UI (`top`) owns the terminal: an exit at once must give it back first.
static TERMINAL_TAKEN: AtomicBool = AtomicBool::new(false);

/// Says whether the terminal is in raw mode on the alternate screen, for the exit at a second signal.
pub fn terminal_taken(taken: bool) {
    TERMINAL_TAKEN.store(taken, Ordering::SeqCst);
}

/// A token cancelled by the first SIGINT or SIGTERM. Must be called inside a tokio runtime.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let (Ok(mut interrupt), Ok(mut terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot listen for SIGINT/SIGTERM; stop with SIGKILL");
            return;
        };
        let mut signals = 0;
        loop {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            signals += 1;
            if signals == 1 {
                tracing::info!(
                    "stopping: finishing what is in flight (signal again to stop at once)"
                );
                cancel.cancel();
            } else {
                if TERMINAL_TAKEN.load(Ordering::SeqCst) {
                    // Out of raw mode and the alternate screen, or the shell is left unusable.
                    ratatui::restore();
                }
                eprintln!(
                    "inboxctl: stopping at once; unfinished messages will be delivered again"
                );
                std::process::exit(130);
            }
        }
    });
    token
}
