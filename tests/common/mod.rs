//! Shared set-up for the integration tests: a database and a RabbitMQ vhost of the test's own on the real servers,
//! the inboxctl binary as a child process, AMQP helpers and a loopback TCP proxy that can cut connections.
//!
//! The servers are taken from `INBOXCTL_TEST_PG` (a `postgres://` URL without a database) and `INBOXCTL_TEST_AMQP`
//! (an `amqp://` URL without a vhost), by default the loopback services. A test that cannot reach them fails.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod raw_amqp;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sqlx::postgres::{PgPool, PgPoolOptions};
use uuid::Uuid;

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
        let vhost = format!("inboxctl-test-{}", &id[..16]);
        rabbitmqctl(&["add_vhost", &vhost]);
        rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
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
            "CREATE DATABASE \"{}\"",
            env.db_name
        )))
        .execute(&admin)
        .await
        .expect("create the test database");
        admin.close().await;
        env
    }

    /// A database migrated by inboxctl, and a vhost.
    pub async fn migrated() -> Self {
        let env = Self::bare().await;
        let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
        inboxctl::db::schema::migrate(&db, false)
            .await
            .expect("migrate");
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
        let out = self.cmd().args(args).output().expect("run inboxctl");
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Starts inboxctl in the background, its stderr collected.
    pub fn spawn(&self, args: &[&str]) -> Proc {
        self.spawn_with(args, &[])
    }

    pub fn spawn_with(&self, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = self.cmd();
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
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

    /// `(ready, unacknowledged)` of a queue, from the broker's own books.
    pub fn queue_counts(&self, queue: &str) -> (u64, u64) {
        let out = rabbitmqctl(&[
            "-q",
            "list_queues",
            "-p",
            &self.vhost,
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ]);
        for line in out.lines() {
            let cols: Vec<&str> = line.split('\t').collect();
            if cols.len() == 3 && cols[0] == queue {
                return (cols[1].parse().unwrap(), cols[2].parse().unwrap());
            }
        }
        panic!("queue {queue} not found in vhost {}:\n{out}", self.vhost)
    }

    /// `host:port` of the broker, for [`raw_amqp`].
    pub fn amqp_addr(&self) -> String {
        let url = url::Url::parse(&amqp_base()).unwrap();
        format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5672))
    }

    /// Whether a queue exists in the vhost.
    pub fn queue_exists(&self, queue: &str) -> bool {
        rabbitmqctl(&["-q", "list_queues", "-p", &self.vhost, "name"])
            .lines()
            .any(|l| l.trim() == queue)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if std::env::var_os("INBOXCTL_TEST_KEEP").is_some() {
            eprintln!("kept database {} and vhost {}", self.db_name, self.vhost);
            return;
        }
        let _ = Command::new("psql")
            .args([
                &format!("{}/postgres", pg_base()),
                "-q",
                "-c",
                &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.db_name),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "delete_vhost", &self.vhost])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

pub async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect to PostgreSQL: is it running on 127.0.0.1:5432?")
}

pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// A child inboxctl whose stderr lines are collected as they come; killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stdout: Arc<Mutex<String>>,
}

impl Proc {
    fn start(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn inboxctl");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let stdout_text = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().unwrap();
        let sink = Arc::clone(&stdout_text);
        std::thread::spawn(move || {
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
        }
    }

    pub fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Waits until a stderr line contains `needle`; panics with what was seen after `timeout`.
    pub fn wait_for_stderr(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self
                .lines
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.contains(needle))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "no stderr line with {needle:?} within {timeout:?}; stderr:\n{}",
            self.stderr()
        );
    }

    /// Waits for the process to end; panics (after killing it) if it takes longer than `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader threads drain what is left.
                std::thread::sleep(Duration::from_millis(50));
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "inboxctl did not end within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
        self.child.try_wait().unwrap().map(|status| status.code())
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The check every fault test ends with: `parcels` rows in `carrier_reservations`, one per parcel, and nothing (a
/// failed attempt, a dead-lettering, a skip) counted against any message.
pub async fn assert_carrier_exactly_once(pool: &PgPool, parcels: i64) {
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, distinct),
        (parcels, parcels),
        "(effects, parcels): exactly one effect per parcel"
    );
    let against = count(
        pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind <> 'duplicate'",
    )
    .await;
    assert_eq!(against, 0, "nothing counted against a message");
}

/// Polls `f` until it returns `true`; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Publishes with publisher confirms to an exchange (`""` for the default exchange, routing by queue name).
pub async fn publish(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
    props: BasicProperties,
    body: &[u8],
) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let routed =
        inboxctl::amqp::publish::publish_confirmed(&channel, exchange, routing_key, body, props)
            .await
            .unwrap();
    assert_eq!(
        routed,
        inboxctl::amqp::publish::Routed::Queued,
        "the broker must route and confirm it"
    );
    let _ = channel.close(200, "OK".into()).await;
}

/// Declares a durable queue bound to a fanout exchange (both declared if absent) and returns its name.
pub async fn capture_queue(conn: &Connection, exchange: &str, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "OK".into()).await;
}

/// Takes every message from a queue (acknowledging each).
pub async fn drain(conn: &Connection, queue: &str) -> Vec<lapin::message::Delivery> {
    let channel = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(msg) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push(msg.delivery);
    }
    let _ = channel.close(200, "OK".into()).await;
    out
}

pub fn header_text(props: &BasicProperties, key: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

/// One captured delivery from `tests/fixtures/interop/messages`.
pub struct Fixture {
    pub name: String,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
    pub message_id: String,
    pub json: serde_json::Value,
}

pub fn fixture(path: &str) -> Fixture {
    let full = format!(
        "{}/tests/fixtures/interop/messages/{path}",
        env!("CARGO_MANIFEST_DIR")
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&full).unwrap()).unwrap();
    let body = base64::engine::general_purpose::STANDARD
        .decode(json["body_base64"].as_str().unwrap())
        .unwrap();
    let p = &json["properties"];
    let mut properties = BasicProperties::default()
        .with_content_type(p["content_type"].as_str().unwrap().into())
        .with_delivery_mode(u8::try_from(p["delivery_mode"].as_u64().unwrap()).unwrap())
        .with_message_id(p["message_id"].as_str().unwrap().into());
    let mut headers = FieldTable::default();
    for (key, value) in json["headers"].as_object().unwrap() {
        let v = if let Some(text) = value.get("text") {
            AMQPValue::LongString(LongString::from(text.as_str().unwrap().as_bytes().to_vec()))
        } else if value["amqp_type"].as_str().unwrap().starts_with("I ") {
            AMQPValue::LongInt(i32::try_from(value["value"].as_i64().unwrap()).unwrap())
        } else {
            AMQPValue::LongLongInt(value["value"].as_i64().unwrap())
        };
        headers.insert(key.as_str().into(), v);
    }
    properties = properties.with_headers(headers);
    Fixture {
        name: path.to_owned(),
        message_id: p["message_id"].as_str().unwrap().to_owned(),
        properties,
        body,
        json,
    }
}

/// The fixtures of one folder, by name.
pub fn fixtures(folder: &str) -> Vec<Fixture> {
    let dir = format!(
        "{}/tests/fixtures/interop/messages/{folder}",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| fixture(&format!("{folder}/{n}")))
        .collect()
}

/// A loopback TCP proxy to `upstream` that a test can cut (every connection dropped, new ones refused by closing
/// them at once) and restore.
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<ProxyState>>,
    task: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    open: bool,
    connections: Vec<tokio::task::AbortHandle>,
}

impl Proxy {
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(ProxyState {
            open: true,
            connections: Vec::new(),
        }));
        let upstream = upstream.to_owned();
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                if !shared.lock().unwrap().open {
                    drop(inbound);
                    continue;
                }
                let upstream = upstream.clone();
                let handle = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                let mut s = shared.lock().unwrap();
                s.connections.retain(|h| !h.is_finished());
                s.connections.push(handle.abort_handle());
            }
        });
        Self { port, state, task }
    }

    /// Drops every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        let mut s = self.state.lock().unwrap();
        s.open = false;
        for c in s.connections.drain(..) {
            c.abort();
        }
    }

    pub fn restore(&self) {
        self.state.lock().unwrap().open = true;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

pub const CARRIER_QUEUE: &str = "parcel-created-carrier";
pub const NOTIFICATION_QUEUE: &str = "parcel-created-notification";
pub const EVENT_EXCHANGE: &str = "ParcelTracker.Domain.Events:ParcelCreatedEvent";

/// Declares the MassTransit topology of both Parcel Tracker endpoints in the test's vhost.
pub async fn ensure_endpoints(env: &TestEnv) {
    let conn = env.amqp().await;
    for queue in [CARRIER_QUEUE, NOTIFICATION_QUEUE] {
        inboxctl::amqp::topology::ensure_endpoint(&conn, EVENT_EXCHANGE, queue)
            .await
            .unwrap();
    }
    let _ = conn.close(200, "OK".into()).await;
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

/// Publishes `copies` copies of one body at once (confirms awaited together).
pub async fn publish_copies(
    conn: &Connection,
    exchange: &str,
    props: BasicProperties,
    body: &[u8],
    copies: usize,
) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..copies {
        // Not awaited one by one: the copies go out back to back and are confirmed together below.
        let _unconfirmed: lapin::PublisherConfirm = channel
            .basic_publish(
                exchange.into(),
                "".into(),
                BasicPublishOptions::default(),
                body,
                props.clone(),
            )
            .await
            .unwrap();
    }
    let returned = channel.wait_for_confirms().await.unwrap();
    assert!(returned.is_empty());
    let _ = channel.close(200, "OK".into()).await;
}

/// A MassTransit `ParcelCreatedEvent` for a new parcel: (properties, body, parcel id).
pub fn parcel_message(message_id: Uuid, destination: &str) -> (BasicProperties, Vec<u8>, Uuid) {
    let broker = inboxctl::amqp::Broker::from_url("amqp://127.0.0.1:5672/%2f").unwrap();
    let message = inboxctl::producer::Message {
        message_id,
        event: inboxctl::parcel::ParcelCreatedEvent {
            parcel_id: Uuid::new_v4(),
            tracking_number: "PT00000001NL".to_owned(),
            destination: destination.to_owned(),
        },
    };
    let host = inboxctl::amqp::envelope::HostInfo::current();
    let (props, body) = inboxctl::producer::envelope(&message, &broker, EVENT_EXCHANGE, &host);
    (props, body, message.event.parcel_id)
}

/// `consume` flags of the two modes every guarantee test runs in: one transaction per message, and batched.
pub const ONE_BY_ONE: &[&str] = &[];
pub const BATCHED: &[&str] = &["--batch-size", "32"];

/// Declares a test that runs `$body(mode)` once per mode, as `$name::one_by_one` and `$name::batched`.
#[macro_export]
macro_rules! in_both_modes {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_by_one() {
                super::$body(super::common::ONE_BY_ONE).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batched() {
                super::$body(super::common::BATCHED).await;
            }
        }
    };
}

/// `args` followed by `mode`.
pub fn with_mode<'a>(args: &[&'a str], mode: &[&'a str]) -> Vec<&'a str> {
    args.iter().chain(mode).copied().collect()
}

/// Makes a certificate authority and a server certificate for 127.0.0.1 / localhost signed by it, and a second,
/// unrelated authority, in `dir`, with openssl.
pub fn certificates(dir: &std::path::Path) {
    let sh = |script: &str| {
        let out = std::process::Command::new("sh")
            .args(["-ec", script])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj '/CN=inboxctl test CA' 2>/dev/null
        openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem -days 2 -subj '/CN=another CA' 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj '/CN=localhost' 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nbasicConstraints=CA:FALSE\\nkeyUsage=digitalSignature,keyEncipherment\\nextendedKeyUsage=serverAuth\\n' > ext.cnf
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf 2>/dev/null");
}

/// Declares a durable queue that the broker refuses every message for (`x-max-length=0`,
/// `x-overflow=reject-publish`): a publish routed to it is nacked.
pub async fn declare_queue_that_refuses_everything(conn: &Connection, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    let _ = channel.close(200, "OK".into()).await;
}

/// Sessions that inboxctl processes hold on the database `db_name` (inboxctl names its sessions `inboxctl`; the
/// tests' own pools do not), seen through `pool`.
pub async fn inboxctl_sessions(pool: &PgPool, db_name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'inboxctl'",
    )
    .bind(db_name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Gives `inbox_messages` and both effect tables a column `committed_in` holding the top-level transaction that
/// inserted each row (`pg_current_xact_id()` names the top-level transaction even inside a savepoint, where `xmin`
/// names the savepoint's subtransaction). inboxctl's statements list their columns, so it does not see the column.
pub async fn record_inserting_transactions(pool: &PgPool) {
    for table in [
        "inbox_messages",
        "carrier_reservations",
        "notifications_sent",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table} ADD COLUMN committed_in xid8 DEFAULT pg_current_xact_id()"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
}
