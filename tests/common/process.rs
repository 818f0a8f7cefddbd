//! The inboxctl binary as a child process: run to its end ([`Output`]) or in the background ([`Proc`]), and the two
//! commands most tests run through it.
//!
//! [`Proc`]'s waits block the calling thread. The tests call them from the test's own thread, which
//! `#[tokio::test]` drives with `block_on` (not a runtime worker), so tasks the test spawned (a [`super::Proxy`])
//! keep running; an async fn must not call them with a `current_thread` runtime that has such tasks.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::TestEnv;

/// libfaketime (Debian's `faketime`, which `scripts/services.sh` installs): preloaded with `FAKETIME=+15m`, a
/// process's clock runs that far apart from the database's.
#[cfg(feature = "failpoints")]
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// What a finished process left: its exit code and its output as text.
    pub fn of(out: std::process::Output) -> Self {
        Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// A child inboxctl whose stderr lines are collected as they come; killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stdout: Arc<Mutex<String>>,
    /// The threads reading stderr and stdout: each ends when the process's end closes its pipe.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub(super) fn start(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn inboxctl");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = Arc::clone(&lines);
        let errors = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let stdout_text = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().unwrap();
        let sink = Arc::clone(&stdout_text);
        let output = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Self {
            child,
            lines,
            stdout: stdout_text,
            readers: vec![errors, output],
        }
    }

    pub fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Whether a stderr line so far contains `needle`.
    pub fn has_said(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Waits until a stderr line contains `needle`; panics with what was seen after `timeout`. Blocks the thread
    /// (see the module's documentation).
    pub fn wait_for_stderr(&self, needle: &str, timeout: Duration) {
        self.wait_for_stderr_times(needle, 1, timeout);
    }

    /// Waits until `needle` was said `times` times on stderr; panics with what was seen after `timeout`. Blocks the
    /// thread.
    pub fn wait_for_stderr_times(&self, needle: &str, times: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let said = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(needle))
                .count();
            if said >= times {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "not {times} stderr lines with {needle:?} within {timeout:?}; stderr:\n{}",
            self.stderr()
        );
    }

    /// Waits for the process to end; panics (after killing it) if it takes longer than `timeout`. Blocks the thread
    /// (see the module's documentation).
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.drain();
                return status.code();
            }
            if Instant::now() > deadline {
                if let Err(e) = self.child.kill() {
                    eprintln!("could not kill inboxctl (pid {}): {e}", self.child.id());
                }
                panic!(
                    "inboxctl did not end within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Whether the process has ended (its exit code, if it has one).
    pub fn try_wait(&mut self) -> Option<Option<i32>> {
        let status = self.child.try_wait().unwrap()?;
        self.drain();
        Some(status.code())
    }

    /// Once the process has ended: waits until every line it wrote is read (its last is often the report), however
    /// long a loaded machine takes to run the reader threads.
    fn drain(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self
            .readers
            .iter()
            .all(std::thread::JoinHandle::is_finished)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Killing a process that has ended already succeeds; an error here means one may be left running.
        if let Err(e) = self.child.kill().and_then(|()| self.child.wait().map(drop)) {
            eprintln!("could not end inboxctl (pid {}): {e}", self.child.id());
        }
    }
}

/// `inboxctl publish parcel-created` with extra flags; returns its JSON report.
pub fn publish_parcels(env: &TestEnv, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["publish", "parcel-created", "--json"];
    all.extend_from_slice(args);
    let out = env.run(&all);
    assert_eq!(out.code, Some(0), "{out:?}");
    serde_json::from_str(&out.stdout).unwrap()
}

/// Runs a consumer until its queue has been idle for a second; asserts it ended with exit code 0.
pub fn consume_until_idle(env: &TestEnv, args: &[&str]) -> Output {
    let mut all = vec!["consume"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--exit-when-idle", "1s"]);
    // Four workers are plenty for these tests and keep the shared server's connections for the tests that need many.
    if !args.contains(&"--concurrency") {
        all.extend_from_slice(&["--concurrency", "4"]);
    }
    let out = env.run(&all);
    assert_eq!(out.code, Some(0), "{out:?}");
    out
}
