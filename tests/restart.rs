//! The real PostgreSQL server stopped and started mid-stream, and a role with a password: on a private cluster of
//! the test's own (`pg_createcluster` on a free port), never the shared server every other test uses.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{CARRIER_QUEUE, FaultStream, TestEnv};

/// A PostgreSQL cluster of this test's own, trusting loopback except for the role `pwuser`; dropped with the guard.
struct PrivatePg {
    version: String,
    name: String,
    port: u16,
}

impl PrivatePg {
    fn start() -> Self {
        let version = std::fs::read_dir("/etc/postgresql")
            .expect("a Debian PostgreSQL installation")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .max()
            .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let name = format!("inboxctl_{}", uuid::Uuid::new_v4().simple());
        let pg = Self {
            version,
            name,
            port,
        };
        pg.ctl(
            "pg_createcluster",
            &[
                "-p",
                &port.to_string(),
                &pg.version,
                &pg.name,
                "--start",
                "--",
                "--auth-host=trust",
                "--auth-local=trust",
            ],
        );
        // The role with a password authenticates with it; everyone else is trusted on loopback, as on the shared
        // server.
        let hba = format!("/etc/postgresql/{}/{}/pg_hba.conf", pg.version, pg.name);
        let trusted = std::fs::read_to_string(&hba).unwrap();
        std::fs::write(
            &hba,
            format!("host all pwuser 127.0.0.1/32 scram-sha-256\n{trusted}"),
        )
        .unwrap();
        pg.ctl("pg_ctlcluster", &[&pg.version, &pg.name, "reload"]);
        pg
    }

    fn ctl(&self, tool: &str, args: &[&str]) {
        let out = Command::new(tool).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn stop(&self) {
        self.ctl(
            "pg_ctlcluster",
            &[&self.version, &self.name, "stop", "-m", "fast"],
        );
    }

    /// Ends the server as a crash would (`stop -m immediate`): nothing is flushed on the way.
    fn crash(&self) {
        self.ctl(
            "pg_ctlcluster",
            &[&self.version, &self.name, "stop", "-m", "immediate"],
        );
    }

    fn start_again(&self) {
        self.ctl("pg_ctlcluster", &[&self.version, &self.name, "start"]);
    }

    /// The database `parcels` set `synchronous_commit = off`, and the WAL writer told to wait 10 s between flushes:
    /// a commit not flushed by its own session is still unflushed when the server crashes right after it.
    async fn with_synchronous_commit_off(&self) {
        let admin = self.admin().await;
        for statement in [
            "ALTER SYSTEM SET wal_writer_delay = '10s'",
            "ALTER DATABASE parcels SET synchronous_commit = off",
            "SELECT pg_reload_conf()",
        ] {
            sqlx::query(statement).execute(&admin).await.unwrap();
        }
        admin.close().await;
    }

    /// One connection as the superuser, to the `postgres` database.
    async fn admin(&self) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.url("postgres", "postgres"))
            .await
            .unwrap()
    }

    fn url(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        common::report_cleanup(
            &format!("pg_dropcluster --stop {} {}", self.version, self.name),
            Command::new("pg_dropcluster")
                .args(["--stop", &self.version, &self.name])
                .output(),
        );
    }
}

/// PostgreSQL stopped (fast shutdown: every session terminated) under a running consumer, left down for a while, and
/// started again: nothing is committed or acked while it is down, nothing counts against a message, and every message
/// is processed exactly once after.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_stopped_and_started_mid_stream_every_message_once() {
    let env = TestEnv::bare().await;
    common::ensure_endpoints(&env).await;
    let pg = PrivatePg::start();
    let url = pg.url("postgres", "parcels");
    let run = |args: &[&str]| {
        env.cmd()
            .env("DATABASE_URL", &url)
            .args(args)
            .output()
            .unwrap()
    };
    assert!(run(&["migrate"]).status.success());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .unwrap();
    let stream = FaultStream {
        duplicates: Some("0.1"),
        consumer_env: &[("DATABASE_URL", url.as_str())],
        ..FaultStream::new(600, common::ONE_BY_ONE)
    }
    .start(&env, pool)
    .await;

    pg.stop();
    stream
        .consumer
        .wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    let acked = |(ready, unacked): (u64, u64)| 660 - i64::try_from(ready + unacked).unwrap();
    let acked_during = acked(env.queue_counts(CARRIER_QUEUE));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        acked(env.queue_counts(CARRIER_QUEUE)),
        acked_during,
        "nothing is acked while the server is down"
    );
    assert!(acked_during < 660, "the stop came mid-stream");

    pg.start_again();
    stream
        .end("every message processed after the restart")
        .await;
    // The outage said in inboxctl's words, not also in the driver's (its pool warned of slow acquisitions and of
    // connections that failed their test, each time, at the default level).
    let said = stream.consumer.stderr();
    for drivers in [
        "exceeded slow threshold",
        "testing the connection",
        "before_acquire",
        "slow statement",
    ] {
        assert!(!said.contains(drivers), "{said}");
    }
    assert!(said.contains("PostgreSQL is back"), "{said}");
    stream.pool.close().await;
}

/// A database whose `synchronous_commit` is off (a setting chosen for throughput): a commit returns before it is on
/// disk. A consumer acknowledges a message once its commit returns, so its sessions set it to `local`, or — through a
/// transaction pooler, where no session setting holds — each claim transaction does (`SET LOCAL`). Either way each
/// commit of its run is flushed (a WAL flush each, one message at a time), and after the server crashes right after
/// the run (`stop -m immediate`, its WAL writer told to wait 10 s between flushes) the effect of every acknowledged
/// message is there. With the setting left off, the run flushed nothing of its own, and the crash lost the last
/// effects of messages already gone from the queue (8 of 200 directly, 3 of 200 through PgBouncer, when measured).
#[tokio::test(flavor = "multi_thread")]
async fn with_synchronous_commit_off_no_acknowledged_effect_is_lost_in_a_crash() {
    let env = TestEnv::bare().await;
    common::ensure_endpoints(&env).await;
    let pg = PrivatePg::start();
    let url = pg.url("postgres", "parcels");
    let run = |args: &[&str], vars: &[(&str, &str)]| {
        let out = env
            .cmd()
            .env("DATABASE_URL", &url)
            .envs(vars.iter().copied())
            .args(args)
            .output()
            .unwrap();
        let out = common::Output::of(out);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        out
    };
    run(&["migrate"], &[]);
    pg.with_synchronous_commit_off().await;

    // Directly, then through PgBouncer (transaction pooling): 200 messages each, a crash after each run.
    for (round, through_pooler) in [(1_i64, false), (2, true)] {
        let bouncer =
            through_pooler.then(|| common::PgBouncer::start_before(&url, "parcels", 2, &[]));
        let bouncer_url = bouncer.as_ref().map(common::PgBouncer::url);
        let mut vars = vec![];
        if let Some(bouncer_url) = &bouncer_url {
            vars = vec![
                ("DATABASE_URL", bouncer_url.as_str()),
                ("INBOXCTL_TRANSACTION_POOLING", "true"),
            ];
        }
        run(&["publish", "parcel-created", "--count", "200"], &[]);
        let admin = pg.admin().await;
        let wal_syncs = || async {
            // A fresh snapshot of the statistics each time.
            let mut conn = admin.acquire().await.unwrap();
            sqlx::query("SELECT pg_stat_clear_snapshot()")
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query_scalar::<_, i64>("SELECT wal_sync FROM pg_stat_wal")
                .fetch_one(&mut *conn)
                .await
                .unwrap()
        };
        let before = wal_syncs().await;
        let out = run(
            &[
                "consume",
                "carrier",
                "--concurrency",
                "1",
                "--exit-when-idle",
                "200ms",
            ],
            &vars,
        );
        let said = if through_pooler {
            "each of the consumer's transactions sets it to local for itself"
        } else {
            "the consumer's sessions set it to local"
        };
        assert!(out.stderr.contains(said), "round {round}: {}", out.stderr);
        assert_eq!(
            env.queue_counts(CARRIER_QUEUE),
            (0, 0),
            "round {round}: every message acknowledged"
        );
        // The consumer's sessions report their statistics as they end, just after it exits (the pooler's as it
        // closes them).
        drop(bouncer);
        common::eventually(
            "a WAL flush for each commit of the run",
            Duration::from_secs(10),
            || async { wal_syncs().await - before >= 200 },
        )
        .await;
        admin.close().await;

        pg.crash();
        pg.start_again();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        assert_eq!(
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
            200 * round,
            "round {round}: every acknowledged message's effect survived the crash"
        );
        pool.close().await;
    }
}

/// Through a transaction pooler, on a database whose `synchronous_commit` is off, the effects worker's own commits are
/// on disk before it goes on too: the record that a call was done, and an at-most-once call's lease (`started`, taken
/// before its request goes out), each survive a PostgreSQL crash right after them, with nothing committed between to
/// flush them. Without, the done call's row went back to `started` (to be called again once its lease ran out, a second
/// booking from a carrier ignoring keys), and the at-most-once call's to `pending`, to be made a second time.
#[tokio::test(flavor = "multi_thread")]
async fn through_a_pooler_with_synchronous_commit_off_no_call_made_is_forgotten_in_a_crash() {
    let env = TestEnv::bare().await;
    common::ensure_endpoints(&env).await;
    let pg = PrivatePg::start();
    let url = pg.url("postgres", "parcels");
    let run = |args: &[&str]| {
        let out = env
            .cmd()
            .env("DATABASE_URL", &url)
            .args(args)
            .output()
            .unwrap();
        let out = common::Output::of(out);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
    };
    run(&["migrate"]);
    pg.with_synchronous_commit_off().await;
    let stub = common::Stub::start(&env, &[]);
    let state_of = |destination: &'static str| {
        let url = url.clone();
        async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap();
            let state: Option<String> = sqlx::query_scalar(
                "SELECT state FROM inboxctl_effects WHERE request->>'destination' = $1",
            )
            .bind(destination)
            .fetch_optional(&pool)
            .await
            .unwrap();
            pool.close().await;
            state
        }
    };
    // A consumer through the pooler calling the carrier, at most once; the call bounded well past any wait here.
    let consume = || {
        let bouncer = common::PgBouncer::start_before(&url, "parcels", 2, &[]);
        let consumer = env.spawn_with(
            &[
                "consume",
                "carrier",
                "--carrier-url",
                &stub.url,
                "--effect-mode",
                "at-most-once",
                "--carrier-timeout",
                "30s",
                "--effect-lease",
                "40s",
            ],
            &[
                ("DATABASE_URL", &bouncer.url()),
                ("INBOXCTL_TRANSACTION_POOLING", "true"),
            ],
        );
        (bouncer, consumer)
    };

    // A call done, PostgreSQL crashing right after its record.
    let (bouncer, mut consumer) = consume();
    run(&["publish", "parcel-created", "--destination", "done"]);
    common::eventually(
        "the call recorded done",
        Duration::from_secs(30),
        || async { state_of("done").await.as_deref() == Some("done") },
    )
    .await;
    pg.crash();
    consumer.kill();
    drop(bouncer);
    pg.start_again();
    assert_eq!(stub.bookings_to("done").await, 1);
    assert_eq!(
        state_of("done").await.as_deref(),
        Some("done"),
        "the record of a call done survived the crash: {}",
        consumer.stderr()
    );

    // A call made, the carrier holding its answer, PostgreSQL crashing meanwhile.
    stub.behave(serde_json::json!({"delayMs": 60_000})).await;
    let (bouncer, mut consumer) = consume();
    run(&["publish", "parcel-created", "--destination", "held"]);
    common::eventually(
        "the carrier booked, holding its answer",
        Duration::from_secs(30),
        || async { stub.bookings_to("held").await == 1 },
    )
    .await;
    pg.crash();
    consumer.kill();
    drop(bouncer);
    pg.start_again();
    stub.behave(serde_json::json!({"delayMs": 0})).await;
    assert_eq!(
        state_of("held").await.as_deref(),
        Some("started"),
        "the lease of a call made survived the crash (pending: it would be made again): {}",
        consumer.stderr()
    );
}

/// A role with a password: a wrong one is named as such (exit 77, the password shown nowhere); the right one can come
/// from libpq's password file instead of the URL, so it need not appear on a command line.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_password_is_named_and_a_password_file_works() {
    let env = TestEnv::bare().await;
    let pg = PrivatePg::start();
    let admin = pg.admin().await;
    for statement in [
        "CREATE ROLE pwuser LOGIN PASSWORD 'Right-Pw-42'",
        "CREATE DATABASE parcels OWNER pwuser",
    ] {
        sqlx::raw_sql(statement).execute(&admin).await.unwrap();
    }

    let wrong_url = format!(
        "postgres://pwuser:Wrong-Pw-17@127.0.0.1:{}/parcels",
        pg.port
    );
    for args in [
        &["migrate"][..],
        &["stats", "--json"],
        &["consume", "carrier"],
    ] {
        let out = env
            .cmd()
            .env("DATABASE_URL", &wrong_url)
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(77), "{args:?}: {stderr}");
        assert!(
            stderr.contains("password authentication failed for user \"pwuser\"")
                && stderr.contains("refused the login of role \"pwuser\"")
                && stderr.contains("--database-password-file"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("Wrong-Pw-17"), "{args:?}: {stderr}");
    }

    let passfile = std::env::temp_dir().join(format!("{}.pgpass", pg.name));
    std::fs::write(
        &passfile,
        format!("127.0.0.1:{}:*:pwuser:Right-Pw-42\n", pg.port),
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let out = env
        .cmd()
        .env("DATABASE_URL", pg.url("pwuser", "parcels"))
        .env("PGPASSFILE", &passfile)
        .args(["migrate"])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&passfile);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("applied"));

    // inboxctl's own password file: the flag and its environment variable, right and wrong.
    let right = std::env::temp_dir().join(format!("{}.right", pg.name));
    let wrong = std::env::temp_dir().join(format!("{}.wrong", pg.name));
    std::fs::write(&right, "Right-Pw-42\n").unwrap();
    std::fs::write(&wrong, "Wrong-File-Pw-19\n").unwrap();
    for file in [&right, &wrong] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let out = env
        .cmd()
        .env("DATABASE_URL", pg.url("pwuser", "parcels"))
        .args(["--database-password-file", right.to_str().unwrap()])
        .args(["stats", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = env
        .cmd()
        .env("DATABASE_URL", pg.url("pwuser", "parcels"))
        .env("DATABASE_PASSWORD_FILE", &wrong)
        .args(["migrate"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "{stderr}");
    assert!(
        stderr.contains("password authentication failed for user \"pwuser\""),
        "{stderr}"
    );
    assert!(!stderr.contains("Wrong-File-Pw-19"), "{stderr}");
    let out = env
        .cmd()
        .env("DATABASE_URL", &wrong_url)
        .env("DATABASE_PASSWORD_FILE", &right)
        .args(["migrate"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("give it in one place"), "{stderr}");
    assert!(
        !stderr.contains("Right-Pw-42") && !stderr.contains("Wrong-Pw-17"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(right);
    let _ = std::fs::remove_file(wrong);
    admin.close().await;
}

/// TLS to PostgreSQL: a private cluster that refuses unencrypted connections, with a certificate from a test-made
/// authority. `sslmode=verify-full` with that authority's certificate works; another authority is refused with the
/// reason; `sslmode=disable` is refused by the server, and said so.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_over_tls_verified_against_a_ca_file() {
    let env = TestEnv::bare().await;
    let pg = PrivatePg::start();
    let certs = std::env::temp_dir().join(format!("{}-tls", pg.name));
    std::fs::create_dir_all(&certs).unwrap();
    common::certificates(&certs);
    let data = format!("/var/lib/postgresql/{}/{}", pg.version, pg.name);
    for file in ["server.pem", "server.key"] {
        std::fs::copy(certs.join(file), format!("{data}/{file}")).unwrap();
    }
    pg.ctl(
        "sh",
        &[
            "-ec",
            &format!("chown postgres:postgres {data}/server.pem {data}/server.key; chmod 600 {data}/server.key"),
        ],
    );
    let conf = format!("/etc/postgresql/{}/{}/postgresql.conf", pg.version, pg.name);
    let mut settings = std::fs::read_to_string(&conf).unwrap();
    settings.push_str(&format!(
        "\nssl = on\nssl_cert_file = '{data}/server.pem'\nssl_key_file = '{data}/server.key'\n"
    ));
    std::fs::write(&conf, settings).unwrap();
    let hba = format!("/etc/postgresql/{}/{}/pg_hba.conf", pg.version, pg.name);
    let rules = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(
        &hba,
        format!("hostnossl all all 127.0.0.1/32 reject\n{rules}"),
    )
    .unwrap();
    pg.ctl(
        "pg_ctlcluster",
        &[&pg.version, &pg.name, "restart", "-m", "fast"],
    );

    let ca = certs.join("ca.pem");
    let other = certs.join("other.pem");
    let url = |mode: &str, root: Option<&std::path::Path>| {
        let mut u = format!("{}?sslmode={mode}", pg.url("postgres", "parcels"));
        if let Some(root) = root {
            u.push_str(&format!("&sslrootcert={}", root.display()));
        }
        u
    };
    let run = |url: &str, args: &[&str]| {
        let out = env
            .cmd()
            .env("DATABASE_URL", url)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // Only an encrypted connection gets in, so a migrate that works went over TLS.
    let (code, stdout, stderr) = run(&url("verify-full", Some(&ca)), &["migrate"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("applied"), "{stdout}");
    let (code, _, stderr) = run(&url("verify-full", Some(&ca)), &["stats", "--json"]);
    assert!(code == Some(0) || code == Some(3), "{stderr}");

    let (code, _, stderr) = run(&url("verify-full", Some(&other)), &["migrate"]);
    assert_eq!(
        code,
        Some(69),
        "a certificate from another authority: {stderr}"
    );
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");

    // The server refuses the login itself (pg_hba.conf): a refused login, exit 77, naming pg_hba.conf.
    let (code, _, stderr) = run(&url("disable", None), &["migrate"]);
    assert_eq!(code, Some(77), "{stderr}");
    assert!(
        stderr.contains("no encryption") && stderr.contains("pg_hba.conf"),
        "{stderr}"
    );

    let _ = std::fs::remove_dir_all(&certs);
}
