//! A RabbitMQ cluster of three private nodes on loopback (`scripts/cluster.sh`): its own node names, ports and
//! directories, never the shared broker. Stopped and removed when dropped.

use std::path::PathBuf;
use std::process::Command;

pub struct Cluster {
    dir: PathBuf,
    /// One AMQP URL per node (guest, the vhost `/`).
    pub urls: Vec<String>,
}

fn script(args: &[&str]) -> String {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh"))
        .args(args)
        .output()
        .expect("run scripts/cluster.sh");
    assert!(
        out.status.success(),
        "scripts/cluster.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Cluster {
    /// Starts three nodes and joins them into one cluster.
    pub fn start() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("inboxctl-cluster-{}", &id[..12]));
        let urls = script(&["start", dir.to_str().unwrap(), "3"])
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>();
        assert_eq!(urls.len(), 3);
        Self { dir, urls }
    }

    fn dir(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    /// One URL holding every node, `first` (1-based) first: `amqp://guest:guest@h:p1,h:p2,h:p3/%2f`.
    pub fn url_from(&self, first: usize) -> String {
        let hosts: Vec<String> = (0..self.urls.len())
            .map(|k| {
                let url = &self.urls[(first - 1 + k) % self.urls.len()];
                let authority = url.split('@').nth(1).unwrap();
                authority.split('/').next().unwrap().to_owned()
            })
            .collect();
        format!("amqp://guest:guest@{}/%2f", hosts.join(","))
    }

    /// The node (1-based) holding `queue`'s quorum leader.
    pub fn leader(&self, queue: &str) -> usize {
        script(&["leader", self.dir(), queue])
            .trim()
            .parse()
            .unwrap()
    }

    /// SIGKILLs node `n` (1-based): no clean shutdown.
    pub fn kill(&self, n: usize) {
        script(&["kill", self.dir(), &n.to_string()]);
    }

    /// Starts node `n` again; it rejoins the cluster.
    pub fn boot(&self, n: usize) {
        script(&["boot", self.dir(), &n.to_string()]);
    }

    /// `rabbitmqctl` at node `n`, in the vhost `/`.
    pub fn ctl(&self, n: usize, args: &[&str]) -> String {
        let id = std::fs::read_to_string(self.dir.join("id")).unwrap();
        let node = format!("{}-{n}@localhost", id.trim());
        let out = Command::new("rabbitmqctl")
            .args(["-q", "-n", &node])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `(type, ready messages)` of a queue, asked at node `n`; `None` when it does not exist.
    pub fn queue(&self, n: usize, queue: &str) -> Option<(String, u64)> {
        self.ctl(
            n,
            &[
                "list_queues",
                "name",
                "type",
                "messages_ready",
                "--no-table-headers",
            ],
        )
        .lines()
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .find(|cols| cols.len() == 3 && cols[0] == queue)
        .map(|cols| (cols[1].to_owned(), cols[2].parse().unwrap()))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh"))
            .args(["stop", self.dir()])
            .output();
    }
}
