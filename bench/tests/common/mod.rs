//! What the bench's tests need of the real servers: a vhost and a database name of the test's own, removed
//! afterwards, and the bench's binary as a child process (with a time limit when asked).
//!
//! The servers are taken from `INBOXCTL_TEST_PG` (a `postgres://` URL without a database) and `INBOXCTL_TEST_AMQP`
//! (an `amqp://` URL without a vhost), by default the loopback services, as inboxctl's own tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgPool, PgPoolOptions};
use uuid::Uuid;

pub const BIN: &str = env!("CARGO_BIN_EXE_inboxctl-bench");

pub fn pg_base() -> String {
    std::env::var("INBOXCTL_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

pub fn amqp_base() -> String {
    std::env::var("INBOXCTL_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".to_owned())
}

pub async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect to PostgreSQL: is it running on 127.0.0.1:5432?")
}

fn rabbitmqctl(args: &[&str]) -> Result<String, String> {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("run rabbitmqctl: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "rabbitmqctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A vhost of this test's own and a database name (the bench makes its scratch databases from it); both are removed
/// when it is dropped.
pub struct TestEnv {
    pub db_name: String,
    pub database_url: String,
    pub vhost: String,
    pub amqp_url: String,
}

impl TestEnv {
    pub async fn bare() -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let db_name = format!("inboxctl_test_{}", &id[..16]);
        let vhost = format!("inboxctl-test-{}", &id[..16]);
        rabbitmqctl(&["add_vhost", &vhost]).unwrap();
        rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]).unwrap();
        Self {
            database_url: format!("{}/{db_name}", pg_base()),
            db_name,
            amqp_url: format!("{}/{vhost}", amqp_base()),
            vhost,
        }
    }

    /// Runs the bench to its end with this environment's URLs.
    pub fn run(&self, args: &[&str]) -> Output {
        let out = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("AMQP_URL", &self.amqp_url)
            .env_remove("RUST_LOG")
            .env_remove("INBOXCTL_FAILPOINTS")
            .output()
            .expect("run inboxctl-bench");
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if std::env::var_os("INBOXCTL_TEST_KEEP").is_some() {
            eprintln!("kept database {} and vhost {}", self.db_name, self.vhost);
            return;
        }
        let dropped = Command::new("psql")
            .args([
                &format!("{}/postgres", pg_base()),
                "-q",
                "-c",
                &format!(
                    "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                    self.db_name.replace('"', "\"\"")
                ),
            ])
            .stdout(Stdio::null())
            .output();
        match dropped {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "could not drop database {}: {}",
                self.db_name,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("could not drop database {}: {e}", self.db_name),
        }
        if let Err(e) = rabbitmqctl(&["-q", "delete_vhost", &self.vhost]) {
            eprintln!("could not delete vhost {}: {e}", self.vhost);
        }
    }
}

#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the bench with `env` (and none of the caller's URLs or log settings) to its end.
pub fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("AMQP_URL")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the bench with `env`, killed after `seconds` (`code` is then `None`).
pub fn run_for(args: &[&str], env: &[(&str, String)], seconds: u64) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        code,
        stdout: String::from_utf8_lossy(&out.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&err.join().unwrap()).into_owned(),
    }
}
