//! The reference generated from the command line — the manual pages in `man/` and `docs/cli.md` — is what the
//! binary generates now (bless with `INBOXCTL_BLESS=1`), and the manual page renders; `--version` names the commit.

use std::path::{Path, PathBuf};

use inboxctl::cmd::reference;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

const BLESS: &str =
    "run `INBOXCTL_BLESS=1 cargo nextest run -E 'test(/^reference::/)'` and commit it";

/// Compares (or with `INBOXCTL_BLESS`, writes) one generated file.
fn check(path: &Path, fresh: &[u8]) {
    if std::env::var_os("INBOXCTL_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, fresh).unwrap();
    }
    let committed = std::fs::read(path).unwrap_or_default();
    assert!(
        committed == fresh,
        "{} is stale: {BLESS}",
        path.strip_prefix(root()).unwrap_or(path).display()
    );
}

#[test]
fn the_committed_manual_pages_are_current_and_nothing_else_is_in_man() {
    let pages = reference::man_pages();
    let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
    for sub in [
        "inboxctl.1",
        "inboxctl-consume.1",
        "inboxctl-publish-parcel-created.1",
    ] {
        assert!(names.contains(&sub), "{sub} in {names:?}");
    }
    for (name, page) in &pages {
        check(&root().join("man").join(name), page);
    }
    let mut committed: Vec<String> = std::fs::read_dir(root().join("man"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    committed.sort();
    let mut expected: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    expected.sort();
    assert_eq!(
        committed, expected,
        "man/ holds a page no command generates: remove it"
    );
}

#[test]
fn the_command_line_reference_page_is_current() {
    let page = reference::markdown();
    for heading in [
        "## `inboxctl`",
        "## `inboxctl consume`",
        "## `inboxctl publish parcel-created`",
    ] {
        assert!(page.contains(heading), "{heading}");
    }
    assert!(page.contains("--batch-size"), "the flags are in it");
    check(&root().join("docs/cli.md"), page.as_bytes());
}

#[test]
fn man_renders_the_manual_page() {
    let page: PathBuf = root().join("man/inboxctl.1");
    let out = std::process::Command::new("man")
        .arg("-l")
        .arg(&page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .output()
        .expect("man (Debian's man-db; scripts/services.sh --for-tests installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("inboxctl"), "{text}");
    for section in ["NAME", "SYNOPSIS", "OPTIONS", "SUBCOMMANDS"] {
        assert!(text.contains(section), "{section} in\n{text}");
    }
    assert!(
        text.contains("inboxctl-consume(1)"),
        "the subcommands' pages are named:\n{text}"
    );
    let consume = std::process::Command::new("man")
        .arg("-l")
        .arg(root().join("man/inboxctl-consume.1"))
        .env("MANPAGER", "cat")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&consume.stdout).contains("--claim-timeout"));
}

#[test]
fn the_version_names_the_commit_it_was_built_from() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inboxctl"))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let line = String::from_utf8(out.stdout).unwrap();
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root())
        .output()
        .unwrap();
    let head = String::from_utf8(head.stdout).unwrap();
    assert_eq!(
        line.trim(),
        format!(
            "inboxctl {} (commit {})",
            env!("CARGO_PKG_VERSION"),
            head.trim()
        )
    );
}
