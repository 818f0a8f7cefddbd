//! A PgBouncer of the test's own (Debian's `pgbouncer` package, which `scripts/services.sh --for-tests` installs) in
//! front of the shared PostgreSQL: its configuration in a scratch folder, a free port on loopback, the test's database
//! only, transaction pooling. Stopped when dropped.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{TestEnv, pg_base, report_cleanup};

/// A running pgbouncer, in pool_mode = transaction, for one test's database.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    pub port: u16,
    user: String,
    db_name: String,
}

impl PgBouncer {
    /// Starts one for `env`'s database with `pool_size` server connections (`default_pool_size`), and `extra` lines
    /// for its `[pgbouncer]` section (`ignore_startup_parameters = …`, say; a later line wins: `pool_mode = session`).
    pub fn start(env: &TestEnv, pool_size: u32, extra: &[&str]) -> Self {
        Self::start_before(&pg_base(), &env.db_name, pool_size, extra)
    }

    /// Starts one for the database `db_name` of the PostgreSQL at `server` (a URL: its user, host and port), as
    /// [`PgBouncer::start`] does: a test's private cluster, say.
    pub fn start_before(server: &str, db_name: &str, pool_size: u32, extra: &[&str]) -> Self {
        let server = url::Url::parse(server).expect("the server is a URL");
        let user = server.username().to_owned();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("inboxctl-pgbouncer-{db_name}-{port}"));
        std::fs::create_dir_all(&dir).expect("the pgbouncer folder");
        let config = format!(
            "[databases]\n\
             {db} = host={host} port={pg_port} dbname={db}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             admin_users = {user}\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 1000\n\
             logfile = {dir}/pgbouncer.log\n\
             {extra}\n",
            db = db_name,
            host = server.host_str().unwrap_or("127.0.0.1"),
            pg_port = server.port().unwrap_or(5432),
            dir = dir.display(),
            extra = extra.join("\n"),
        );
        std::fs::write(dir.join("pgbouncer.ini"), config).expect("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).expect("users.txt");
        let mut cmd = Command::new(binary());
        // PgBouncer refuses to run as root: as root, it runs as the database server's own user.
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres", &dir.display().to_string()])
                .status()
                .expect("chown");
            assert!(status.success(), "chown the pgbouncer folder to postgres");
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run pgbouncer (Debian package pgbouncer; scripts/services.sh --for-tests installs it)");
        let mut bouncer = Self {
            child,
            dir,
            port,
            user,
            db_name: db_name.to_owned(),
        };
        bouncer.wait_until_listening();
        bouncer
    }

    fn wait_until_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.try_wait().expect("pgbouncer's status") {
                panic!("pgbouncer ended ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer not listening on {} after 15 s:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The test's database, through this pgbouncer.
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            self.user, self.port, self.db_name
        )
    }

    /// What pgbouncer logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    /// Its admin console, for the test's database.
    pub fn console(&self) -> Console {
        Console {
            port: self.port,
            user: self.user.clone(),
            db_name: self.db_name.clone(),
        }
    }
}

/// A pgbouncer's admin console (the database `pgbouncer`), by psql; owned, for a watch on another thread.
#[derive(Debug, Clone)]
pub struct Console {
    port: u16,
    user: String,
    db_name: String,
}

impl Console {
    /// One command (`SHOW POOLS`): each row as its columns by name.
    pub fn show(&self, command: &str) -> Vec<std::collections::HashMap<String, String>> {
        let out = Command::new("psql")
            .arg(format!(
                "postgres://{}@127.0.0.1:{}/pgbouncer",
                self.user, self.port
            ))
            .args(["-X", "-A", "-F", "\t", "-P", "footer=off", "-c", command])
            .output()
            .expect("psql (Debian package postgresql-client)");
        assert!(
            out.status.success(),
            "{command}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap_or_default().split('\t').collect();
        lines
            .map(|line| {
                header
                    .iter()
                    .map(|h| (*h).to_owned())
                    .zip(line.split('\t').map(str::to_owned))
                    .collect()
            })
            .collect()
    }

    /// The server connections pgbouncer holds for the test's database, in any state (`SHOW POOLS`: active, idle,
    /// used, tested, logging in).
    pub fn server_connections(&self) -> u64 {
        self.show("SHOW POOLS")
            .iter()
            .filter(|row| row.get("database") == Some(&self.db_name))
            .map(|row| {
                ["sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login"]
                    .iter()
                    .filter_map(|column| row.get(*column)?.parse::<u64>().ok())
                    .sum::<u64>()
            })
            .sum()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Err(e) = self.child.kill().and_then(|()| self.child.wait().map(drop)) {
            eprintln!("could not stop pgbouncer (pid {}): {e}", self.child.id());
        }
        if std::env::var_os("INBOXCTL_TEST_KEEP").is_none() {
            report_cleanup(
                "remove the pgbouncer folder",
                Command::new("rm")
                    .args(["-rf", &self.dir.display().to_string()])
                    .output(),
            );
        }
    }
}

/// Debian installs pgbouncer in /usr/sbin, which a user's PATH may lack.
fn binary() -> String {
    ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("pgbouncer")
        .to_owned()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
