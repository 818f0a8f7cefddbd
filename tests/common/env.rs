//! The test's own environment on the real servers: a database and a RabbitMQ vhost, made for one test and removed
//! when it ends, and the inboxctl binary pointed at them.

use std::process::{Command, Stdio};

use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::{PgPool, PgPoolOptions};
use uuid::Uuid;

use super::{Output, Proc, admin_pool, quote_ident, vhosts};

pub const BIN: &str = env!("CARGO_BIN_EXE_inboxctl");

/// The binary `TestEnv` runs: this build's, or the one `INBOXCTL_TEST_BIN` names — to show that a regression test
/// fails against an earlier build.
pub fn bin() -> String {
    std::env::var("INBOXCTL_TEST_BIN").unwrap_or_else(|_| BIN.to_owned())
}

pub fn pg_base() -> String {
    std::env::var("INBOXCTL_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

pub fn amqp_base() -> String {
    std::env::var("INBOXCTL_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".to_owned())
}

/// A database and a vhost of this test's own; both are removed when it is dropped.
pub struct TestEnv {
    pub db_name: String,
    pub database_url: String,
    pub vhost: String,
    pub amqp_url: String,
}

impl TestEnv {
    /// A vhost and a database name; the database is not created.
    pub async fn bare() -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let db_name = format!("inboxctl_test_{}", &id[..16]);
        let vhost = fresh_vhost().await;
        Self {
            database_url: format!("{}/{db_name}", pg_base()),
            db_name,
            amqp_url: format!("{}/{vhost}", amqp_base()),
            vhost,
        }
    }

    /// An empty database and a vhost.
    pub async fn empty() -> Self {
        let env = Self::bare().await;
        let admin = admin_pool().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {}",
            quote_ident(&env.db_name)
        )))
        .execute(&admin)
        .await
        .expect("create the test database");
        admin.close().await;
        env
    }

    /// A database migrated by inboxctl (a copy of one: [`super::template`]), and a vhost.
    pub async fn migrated() -> Self {
        let env = Self::bare().await;
        let partitioning = super::partitioning();
        let template = super::template::template(partitioning).await;
        let admin = admin_pool().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {} TEMPLATE {}",
            quote_ident(&env.db_name),
            quote_ident(&template)
        )))
        .execute(&admin)
        .await
        .expect("create the test database from the migrated template");
        admin.close().await;
        if let Some(settings) = partitioning {
            // The template's partitions reach as far ahead of the day it was made as `migrate` makes them: from
            // today, as a `migrate` of its own would have.
            let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
            let mut conn = db.connect().await.unwrap();
            let now = chrono::Utc::now();
            inboxctl::db::partitions::ensure_partitions(
                &mut conn,
                settings,
                now - chrono::TimeDelta::days(400),
                now + inboxctl::db::partitions::AHEAD,
            )
            .await
            .expect("partitions back");
        }
        env
    }

    /// The inboxctl binary with this environment's URLs.
    pub fn cmd(&self) -> Command {
        let mut cmd = Command::new(bin());
        cmd.env("DATABASE_URL", &self.database_url)
            .env("AMQP_URL", &self.amqp_url)
            .env_remove("RUST_LOG")
            .env_remove("INBOXCTL_FAILPOINTS");
        cmd
    }

    /// Runs inboxctl to its end.
    pub fn run(&self, args: &[&str]) -> Output {
        Output::of(
            self.cmd()
                .args(within_budget(args))
                .output()
                .expect("run inboxctl"),
        )
    }

    /// Starts inboxctl in the background, its stderr collected.
    pub fn spawn(&self, args: &[&str]) -> Proc {
        self.spawn_with(args, &[])
    }

    pub fn spawn_with(&self, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = self.cmd();
        cmd.args(within_budget(args))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Proc::start(cmd)
    }

    pub async fn pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(4)
            .connect(&self.database_url)
            .await
            .expect("connect to the test database")
    }

    pub async fn amqp(&self) -> Connection {
        Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .expect("connect to the test vhost")
    }
}

impl Drop for TestEnv {
    /// Drops the database and the vhost; a failure is reported (a panic here, perhaps during another, would abort
    /// the test binary) and leaves a leftover that a later run never collides with (the names are unique).
    fn drop(&mut self) {
        if std::env::var_os("INBOXCTL_TEST_KEEP").is_some() {
            eprintln!("kept database {} and vhost {}", self.db_name, self.vhost);
            vhosts::give_back(&self.vhost, true);
            return;
        }
        let drop_database = format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&self.db_name)
        );
        report_cleanup(
            &drop_database,
            Command::new("psql")
                .args([
                    &format!("{}/postgres", pg_base()),
                    "-qX",
                    "-c",
                    &drop_database,
                ])
                .output(),
        );
        vhosts::give_back(&self.vhost, false);
    }
}

/// The most PostgreSQL connections a consumer of a test opens when the test does not say (`--pool-size`).
///
/// The tests run four at a time against the shared server, whose `max_connections` is PostgreSQL's default of 100. A
/// consumer left at its defaults opens as many connections as it has workers (16), and a test that runs two of them
/// holds 32 with its own; four such tests at once (one test in each of its four modes) took every connection, and
/// the tests started meanwhile failed to connect at all. Six connections a consumer keeps four of the largest tests
/// at once under 100, and still lets as many messages be claimed at once as the races under test need.
pub const POOL_BUDGET: &str = "6";

/// `args`, with `--pool-size` [`POOL_BUDGET`] added to a `consume` (the command, perhaps after global options) that
/// does not set its own.
fn within_budget<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut args = args.to_vec();
    let command = args
        .first()
        .is_some_and(|a| *a == "consume" || a.starts_with("--"));
    let consume = command && args.contains(&"consume");
    let sized = args.iter().any(|a| a.starts_with("--pool-size"));
    if consume && !sized {
        args.extend(["--pool-size", POOL_BUDGET]);
    }
    args
}

/// A vhost from the pool ([`vhosts`]) that the broker knows (one made before the broker was reset is not).
async fn fresh_vhost() -> String {
    loop {
        let vhost = vhosts::take();
        let url = format!("{}/{vhost}", amqp_base());
        match Connection::connect(&url, ConnectionProperties::default()).await {
            Ok(connection) => {
                let _ = connection.close(200, "OK".into()).await;
                return vhost;
            }
            Err(e) if e.to_string().contains("not found") => vhosts::give_back(&vhost, false),
            Err(e) => panic!("connect to RabbitMQ at {url}: {e}"),
        }
    }
}

/// Says on stderr what a clean-up command (`what`) could not do: not run at all, or failed with its stderr.
pub fn report_cleanup(what: &str, result: std::io::Result<std::process::Output>) {
    match result {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "clean-up failed: {what}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => eprintln!("clean-up could not run: {what}: {e}"),
    }
}
