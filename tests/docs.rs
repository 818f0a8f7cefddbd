//! The shell blocks of README.md and docs/*.md run as written. Every `bash` block says, in the comment line before
//! it, whether the tests run it (`<!-- runnable … -->`) or why not (`<!-- not run by the tests: … -->`); a block
//! that says neither fails here. The runnable ones run in a test environment of their own (a migrated database and a
//! vhost; `inboxctl` on the PATH, a scratch HOME), one after another, each under `bash -euo pipefail`.

use std::path::{Path, PathBuf};

use crate::common::{self, TestEnv};

#[derive(Debug)]
struct Block {
    file: String,
    line: usize,
    /// The comment before the block.
    note: String,
    script: String,
}

fn blocks() -> Vec<Block> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut found = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            if lines[i].trim_end() == "```bash" {
                let start = i;
                let mut script = String::new();
                i += 1;
                while i < lines.len() && lines[i].trim_end() != "```" {
                    script.push_str(lines[i]);
                    script.push('\n');
                    i += 1;
                }
                let note = start
                    .checked_sub(1)
                    .map(|n| lines[n].trim().to_owned())
                    .unwrap_or_default();
                found.push(Block {
                    file: path.strip_prefix(root).unwrap().display().to_string(),
                    line: start + 1,
                    note,
                    script,
                });
            }
            i += 1;
        }
    }
    found
}

#[test]
fn every_shell_block_says_whether_the_tests_run_it() {
    let blocks = blocks();
    assert!(blocks.len() >= 8, "{blocks:?}");
    let unsaid: Vec<String> = blocks
        .iter()
        .filter(|b| {
            !(b.note.starts_with("<!-- runnable")
                || b.note.starts_with("<!-- not run by the tests: "))
                || !b.note.ends_with("-->")
        })
        .map(|b| format!("{}:{}", b.file, b.line))
        .collect();
    assert!(
        unsaid.is_empty(),
        "say before each of these `<!-- runnable -->` or `<!-- not run by the tests: why -->`: {unsaid:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runnable_shell_blocks_run_as_written() {
    let env = TestEnv::migrated().await;
    // What the replay block reads: messages the carrier failed with, and a dead-letter-exchange queue.
    let failing = "Atlantis";
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "3", "--destination", failing]);
    let out = env.run(&[
        "consume",
        "carrier",
        "--fail-destination",
        failing,
        "--max-attempts",
        "1",
        "--exit-when-idle",
        "1s",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    common::capture_queue(&env.amqp().await, "amq.direct", "orders.dlq").await;

    let home = std::env::temp_dir().join(format!("inboxctl-docs-{}", env.db_name));
    std::fs::create_dir_all(&home).unwrap();
    let bin_dir = Path::new(&common::bin()).parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let runnable: Vec<Block> = blocks()
        .into_iter()
        .filter(|b| b.note.starts_with("<!-- runnable"))
        .collect();
    assert!(runnable.len() >= 3, "{runnable:?}");
    let mut failures = Vec::new();
    for block in &runnable {
        let out = std::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &block.script])
            .env("DATABASE_URL", &env.database_url)
            .env("AMQP_URL", &env.amqp_url)
            .env("HOME", &home)
            .env("PATH", &path)
            .env_remove("RUST_LOG")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        if out.status.code() != Some(0) {
            failures.push(format!(
                "{}:{} exited {:?}:\n{}\n{}",
                block.file,
                block.line,
                out.status.code(),
                block.script,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&home);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `compose.yaml` is a valid Compose file (Debian's `docker-compose` checks it offline; no image can be pulled here,
/// so it is validated, not run), and it offers what the demo and the tests expect: PostgreSQL 15 and RabbitMQ on
/// their loopback ports.
#[test]
fn the_compose_file_is_valid_and_offers_both_services_on_their_ports() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("docker-compose")
        .args(["-f", "compose.yaml", "config"])
        .current_dir(root)
        .output()
        .expect("docker-compose (Debian's package; scripts/services.sh --for-tests installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "image: postgres:15",
        "image: rabbitmq:3",
        "127.0.0.1:5432:5432",
        "127.0.0.1:5672:5672",
        "POSTGRES_HOST_AUTH_METHOD: trust",
    ] {
        assert!(config.contains(needle), "{needle} in\n{config}");
    }
}

/// The docs stand alone: every relative link of README.md and docs/*.md names a file of this repository (the link's
/// anchor aside), and none leaves it (`..` past the root); the web links are left alone.
#[test]
fn every_link_in_the_docs_points_at_a_file_of_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .canonicalize()
        .unwrap();
    let mut files: Vec<PathBuf> = vec![root.join("README.md")];
    files.extend(
        std::fs::read_dir(root.join("docs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md")),
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("](") {
                rest = &rest[at + 2..];
                let Some(end) = rest.find(')') else { break };
                let target = &rest[..end];
                rest = &rest[end..];
                if target.contains("://")
                    || target.starts_with('#')
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let path = target.split('#').next().unwrap();
                checked += 1;
                let resolved = file.parent().unwrap().join(path).canonicalize();
                if !resolved.is_ok_and(|p| p.starts_with(&root)) {
                    broken.push(format!(
                        "{}:{}: {target}",
                        file.strip_prefix(&root).unwrap().display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(checked > 10, "the scan found the links ({checked})");
    assert!(
        broken.is_empty(),
        "links that leave the repository or name nothing: {broken:#?}"
    );
}
