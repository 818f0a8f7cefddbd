//! The real RabbitMQ restarted under a running consumer: the application stopped and started (`stop_app` /
//! `start_app`), then the whole node stopped and started again. On a private node of the test's own (its own ports,
//! directories and configuration), never the shared broker every other test uses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{CARRIER_QUEUE, TestEnv};

struct PrivateRabbit {
    node: String,
    port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PrivateRabbit {
    fn start() -> Self {
        Self::start_with(|port, _| format!("listeners.tcp.local = 127.0.0.1:{port}\n"))
    }

    /// A node whose configuration `conf` writes, given its port and its directory.
    fn start_with(conf: impl FnOnce(u16, &std::path::Path) -> String) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("inboxctl-rabbit-{id}"));
        std::fs::create_dir_all(dir.join("mnesia")).unwrap();
        std::fs::create_dir_all(dir.join("log")).unwrap();
        std::fs::write(dir.join("plugins"), "[].\n").unwrap();
        let port = free_port();
        std::fs::write(dir.join("rabbitmq.conf"), conf(port, &dir)).unwrap();
        std::fs::write(dir.join("env.conf"), "ERL_EPMD_ADDRESS=127.0.0.1\n").unwrap();
        // The Debian scripts run the broker as the rabbitmq user.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq", dir.to_str().unwrap()])
            .status();
        let rabbit = Self {
            node: format!("inboxctl-{}@localhost", &id[..12]),
            port,
            dir,
        };
        rabbit.boot();
        rabbit
    }

    fn boot(&self) {
        let d = |p: &str| self.dir.join(p).to_str().unwrap().to_owned();
        let status = Command::new("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("plugins"))
            .env("RABBITMQ_PID_FILE", d("pid"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf"))
            .env("RABBITMQ_CONF_ENV_FILE", d("env.conf"))
            .status()
            .unwrap();
        assert!(status.success());
        self.wait_until("the private node running", |r| {
            r.ctl(&["await_startup", "--timeout", "5"]).is_ok()
        });
    }

    fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("rabbitmqctl")
            .args(["-q", "-n", &self.node])
            .args(args)
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn wait_until(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while !f(self) {
            assert!(Instant::now() < deadline, "{what}: not within 90 s");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `(ready, unacknowledged)` of a queue; `None` when it does not exist.
    fn queue(&self, name: &str) -> Option<(u64, u64)> {
        let out = self
            .ctl(&[
                "list_queues",
                "name",
                "messages_ready",
                "messages_unacknowledged",
            ])
            .ok()?;
        out.lines().find_map(|line| {
            let cols: Vec<&str> = line.split('\t').collect();
            (cols.len() == 3 && cols[0] == name)
                .then(|| (cols[1].parse().unwrap(), cols[2].parse().unwrap()))
        })
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let _ = self.ctl(&["stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_restarted_twice_mid_stream_every_message_once() {
    let env = TestEnv::migrated().await;
    let rabbit = PrivateRabbit::start();
    let amqp = rabbit.url();
    let run = |args: &[&str]| {
        let out = env
            .cmd()
            .env("AMQP_URL", &amqp)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // Declares the topology; then the first 2,000 parcels (with 10 % copies), durable, on the queue: enough that the
    // consumer is still at them when stop_app (which takes seconds) has stopped the broker, even on a loaded machine.
    run(&["consume", "carrier", "--exit-when-idle", "1s"]);
    run(&[
        "publish",
        "parcel-created",
        "--count",
        "2000",
        "--duplicates",
        "0.1",
    ]);
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "2",
            "--prefetch",
            "8",
        ],
        &[("AMQP_URL", amqp.as_str())],
    );
    let pool = env.pool().await;
    let effects = || common::count(&pool, "SELECT count(*) FROM carrier_reservations");
    common::eventually(
        "a first part processed",
        Duration::from_secs(60),
        || async { effects().await >= 50 },
    )
    .await;

    // 1. The application stopped and started.
    rabbit.ctl(&["stop_app"]).unwrap();
    consumer.wait_for_stderr("RabbitMQ connection lost", Duration::from_secs(30));
    let during = effects().await;
    assert!(during < 2_000, "the stop came mid-stream ({during} done)");
    rabbit.ctl(&["start_app"]).unwrap();
    common::eventually(
        "all 2,000 after start_app",
        Duration::from_secs(120),
        || async { effects().await >= 2_000 && rabbit.queue(CARRIER_QUEUE) == Some((0, 0)) },
    )
    .await;

    // 2. The whole node stopped and started: the durable queue and its messages survive; the consumer reconnects.
    run(&[
        "publish",
        "parcel-created",
        "--count",
        "600",
        "--duplicates",
        "0.1",
    ]);
    common::eventually(
        "a part of the second 600",
        Duration::from_secs(60),
        || async { effects().await >= 2_050 },
    )
    .await;
    rabbit.ctl(&["stop"]).unwrap();
    rabbit.wait_until("the node gone", |r| r.ctl(&["status"]).is_err());
    rabbit.boot();
    let report = async {
        eprintln!(
            "effects {}, queue {:?}, consumer stderr:\n{}",
            effects().await,
            rabbit.queue(CARRIER_QUEUE),
            consumer.stderr()
        );
    };
    report.await;
    common::eventually(
        "all 2,600 after the restart",
        Duration::from_secs(120),
        || async { effects().await >= 2_600 && rabbit.queue(CARRIER_QUEUE) == Some((0, 0)) },
    )
    .await;

    common::assert_carrier_exactly_once(&pool, 2_600).await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    assert!(matches!(rabbit.queue(&error_queue), None | Some((0, 0))));
    consumer.terminate();
}

/// TLS to RabbitMQ: a private node that listens only on TLS, with a certificate from a test-made authority.
/// `amqps://` with `--amqp-ca-file` of that authority works end to end (publish, consume, one effect each); verified
/// by default, so the system's roots or another authority are refused with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn amqps_verified_against_a_ca_file() {
    let env = TestEnv::migrated().await;
    let rabbit = PrivateRabbit::start_with(|port, dir| {
        common::certificates(dir);
        let f = |name: &str| dir.join(name).display().to_string();
        format!(
            "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
             ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
             ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
            f("ca.pem"),
            f("server.pem"),
            f("server.key")
        )
    });
    let url = format!("amqps://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
    let ca = rabbit.dir.join("ca.pem");
    let other = rabbit.dir.join("other.pem");
    let run = |ca: Option<&std::path::Path>, args: &[&str]| {
        let mut cmd = env.cmd();
        cmd.env("AMQP_URL", &url).args(args);
        if let Some(ca) = ca {
            cmd.arg("--amqp-ca-file").arg(ca);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, stderr) = run(Some(&ca), &["consume", "carrier", "--exit-when-idle", "1s"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = run(Some(&ca), &["publish", "parcel-created", "--count", "3"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = run(Some(&ca), &["consume", "carrier", "--exit-when-idle", "1s"]);
    assert_eq!(code, Some(0), "{stderr}");
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        3,
        "published and consumed over TLS"
    );

    for (label, ca) in [
        ("the system's roots", None),
        ("another authority", Some(other.as_path())),
    ] {
        let (code, stderr) = run(ca, &["publish", "parcel-created", "--count", "1"]);
        assert_eq!(code, Some(69), "{label}: {stderr}");
        assert!(
            stderr.to_lowercase().contains("certificate") || stderr.contains("UnknownIssuer"),
            "{label}: {stderr}"
        );
    }
    let (code, stderr) = run(
        Some(&rabbit.dir.join("plugins")),
        &["publish", "parcel-created"],
    );
    assert_eq!(
        code,
        Some(64),
        "a CA file with no certificate is a usage error: {stderr}"
    );
}
