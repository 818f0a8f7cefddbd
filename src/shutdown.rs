//! SIGINT and SIGTERM as a cancellation token: the first asks long-running commands to stop cleanly, a second one ends
//! the process at once (exit 130; nothing unfinished was acknowledged, so the broker delivers it again).

use std::io::Write as _;
use std::sync::Mutex;

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// What must run before the process exits at once on a second signal (a full-screen UI giving the terminal back).
static BEFORE_EXIT: Mutex<Option<fn()>> = Mutex::new(None);

/// Sets (or with `None`, clears) what runs before an exit at once.
pub fn before_exit(hook: Option<fn()>) {
    *BEFORE_EXIT.lock().unwrap_or_else(|p| p.into_inner()) = hook;
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
                let hook = *BEFORE_EXIT.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(hook) = hook {
                    hook();
                }
                let said =
                    "inboxctl: stopping at once; unfinished messages will be delivered again";
                if crate::logging::json_lines() {
                    crate::logging::write_json_event("WARN", said, serde_json::Map::new());
                } else {
                    let _ = writeln!(std::io::stderr(), "{said}");
                }
                std::process::exit(130);
            }
        }
    });
    token
}
