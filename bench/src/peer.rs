//! The `peer` mode: a published inbox implementation on the same PostgreSQL and RabbitMQ, measured like ours.
//!
//! The peer is `pg-transactional-outbox` (npm), run by `peer.js` under Node.js: the bench installs it with npm into a
//! directory of its own (pinned versions, once), creates its inbox table and polling function in the mode's scratch
//! database, and runs its consumer as a child process, as it runs `inboxctl consume` for the other modes. How it is
//! configured, and why its guarantee is weaker than ours, is in `peer.js` and in [`PeerSettings`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Serialize;

use crate::error::{Error, Result};

pub const PACKAGE: &str = "pg-transactional-outbox";
pub const VERSION: &str = "0.5.7";

/// The consumer: set-up and consume commands (see its header).
const SCRIPT: &str = include_str!("peer.js");

/// Exact versions, so that every run measures the same code.
const PACKAGE_JSON: &str = r#"{
  "name": "inboxctl-bench-peer",
  "private": true,
  "description": "inboxctl bench: the peer mode's consumer",
  "dependencies": {
    "amqplib": "2.3.1",
    "async-mutex": "0.4.1",
    "pg": "8.23.1",
    "pg-transactional-outbox": "0.5.7"
  }
}
"#;

/// The library's settings that matter for the figures, reported beside them.
#[derive(Debug, Clone, Serialize)]
pub struct PeerSettings {
    pub package: String,
    pub node_version: String,
    /// The polling listener: the replication listener needs `wal_level=logical`.
    pub listener: &'static str,
    /// Messages fetched and handled at once: the bench's `--concurrency`.
    pub batch_size: u16,
    /// The library's defaults.
    pub polling_interval_ms: u32,
    pub lock_ms: u32,
    pub max_attempts: u32,
    pub max_poisonous_attempts: u32,
    pub concurrency: &'static str,
    /// When the broker's copy is acked.
    pub ack: &'static str,
}

/// An installed peer.
#[derive(Debug, Clone)]
pub struct Peer {
    dir: PathBuf,
    node_version: String,
}

impl Peer {
    /// Installs the peer (once: later runs find it in place) into `INBOXCTL_BENCH_PEER_DIR`, else the user's cache
    /// directory.
    pub fn install(say: &mut impl FnMut(&str)) -> Result<Self> {
        let node_version = tool_version("node")?;
        tool_version("npm")?;
        let dir = directory();
        std::fs::create_dir_all(&dir)?;
        let manifest = dir.join("package.json");
        let installed = dir
            .join("node_modules")
            .join(PACKAGE)
            .join("package.json")
            .exists();
        if !installed || std::fs::read_to_string(&manifest).ok().as_deref() != Some(PACKAGE_JSON) {
            say(&format!(
                "peer: installing {PACKAGE}@{VERSION} with npm into {}",
                dir.display()
            ));
            std::fs::write(&manifest, PACKAGE_JSON)?;
            let out = Command::new("npm")
                .args([
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--loglevel=error",
                    "--omit=dev",
                ])
                .current_dir(&dir)
                .stdin(Stdio::null())
                .output()?;
            if !out.status.success() {
                // Let the next run try again rather than trust a half-installed tree.
                let _ = std::fs::remove_file(&manifest);
                return Err(Error::Tool(format!(
                    "the peer mode could not install {PACKAGE}@{VERSION} with npm ({}): {}",
                    out.status,
                    inboxctl::sanitize::multiline(String::from_utf8_lossy(&out.stderr).trim())
                )));
            }
        }
        std::fs::write(dir.join("peer.js"), SCRIPT)?;
        Ok(Self { dir, node_version })
    }

    /// Creates the library's inbox table and polling function in the database at `database_url`.
    pub fn setup(&self, database_url: &str) -> Result<()> {
        let out = self
            .node("setup")
            .env("DATABASE_URL", database_url)
            .stdin(Stdio::null())
            .output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::Tool(format!(
                "the peer's set-up failed ({}): {}",
                out.status,
                inboxctl::sanitize::multiline(String::from_utf8_lossy(&out.stderr).trim())
            )))
        }
    }

    /// `node peer.js <command>`.
    pub fn node(&self, command: &str) -> Command {
        let mut cmd = Command::new("node");
        cmd.arg(self.dir.join("peer.js"))
            .arg(command)
            .current_dir(&self.dir);
        cmd
    }

    /// Where a consumer's output goes (read when it fails).
    pub fn log(&self) -> PathBuf {
        self.dir.join("consume.log")
    }

    pub fn settings(&self, concurrency: u16) -> PeerSettings {
        PeerSettings {
            package: format!("{PACKAGE}@{VERSION}"),
            node_version: self.node_version.clone(),
            listener: "polling",
            batch_size: concurrency,
            polling_interval_ms: 500,
            lock_ms: 5000,
            max_attempts: 5,
            max_poisonous_attempts: 3,
            concurrency: "parallel",
            ack: "after the inbox insert commits, before the handler runs (as the library's RabbitMQ example): \
                  a weaker guarantee than inboxctl's, which acks after the effect commits",
        }
    }
}

fn directory() -> PathBuf {
    if let Some(dir) = std::env::var_os("INBOXCTL_BENCH_PEER_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache
        .join("inboxctl")
        .join(format!("bench-peer-{PACKAGE}-{VERSION}"))
}

fn tool_version(tool: &str) -> Result<String> {
    match Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        _ => Err(Error::Tool(format!(
            "the peer mode needs {tool} (Node.js 18 or later) on PATH; install it, or leave the mode out: \
             --modes ceiling,bare,tutorial,inbox,inbox-batched"
        ))),
    }
}
