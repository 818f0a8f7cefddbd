//! A real terminal for the tests: a tmux server of the test's own.

use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server of the test's own (its socket), whose session `top` runs what is tested in a real terminal.
pub struct Tmux {
    pub socket: String,
}

impl Tmux {
    /// A tmux server of `env`'s own.
    pub fn of(env: &super::TestEnv) -> Self {
        Self {
            socket: format!("inboxctl-{}", env.db_name),
        }
    }

    /// Runs inboxctl `args` (shell words) with `env`'s URLs in a new session `top` of 200×50, then says its exit
    /// code (`EXITED=`) and stays, for the screen to be read.
    pub fn start(&self, env: &super::TestEnv, args: &str) {
        self.start_with(env, "", args);
    }

    /// [`Tmux::start`], with more of the environment given first (shell words, `NAME='value' …`).
    pub fn start_with(&self, env: &super::TestEnv, vars: &str, args: &str) {
        let script = format!(
            "DATABASE_URL='{}' AMQP_URL='{}' {vars} '{}' {args}; echo EXITED=$?; sleep 60",
            env.database_url,
            env.amqp_url,
            super::bin()
        );
        self.run(&[
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "200",
            "-y",
            "50",
            &script,
        ]);
        // A test that kills this session to start the next one must not race the server's exit in between.
        self.run(&["set-option", "-g", "exit-empty", "off"]);
    }

    pub fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux (Debian package tmux)");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "top"])
    }

    pub fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let screen = self.screen();
            if ok(&screen) {
                return screen;
            }
            assert!(Instant::now() < deadline, "no {what} on screen:\n{screen}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .status();
    }
}
