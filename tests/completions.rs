//! The shell completion scripts in `completions/` are what the binary generates now, and the bash one parses.

use clap::ValueEnum as _;
use clap_complete::Shell;
use inboxctl::cmd::completions::{file_name, script};

fn path(shell: Shell) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("completions")
        .join(file_name(shell))
}

#[test]
fn the_committed_completion_scripts_are_current() {
    let bless = std::env::var_os("INBOXCTL_BLESS").is_some();
    for shell in Shell::value_variants() {
        let fresh = script(*shell);
        if bless {
            std::fs::write(path(*shell), &fresh).unwrap();
        }
        let committed = std::fs::read(path(*shell)).unwrap_or_default();
        assert!(
            committed == fresh,
            "completions/{} is stale: run `INBOXCTL_BLESS=1 cargo nextest run -E 'test(/^completions::/)'` and commit it",
            file_name(*shell)
        );
    }
}

#[test]
fn the_bash_script_parses() {
    let status = std::process::Command::new("bash")
        .arg("-n")
        .arg(path(Shell::Bash))
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn the_binary_prints_the_same_script() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inboxctl"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim_end(),
        String::from_utf8(script(Shell::Bash)).unwrap().trim_end()
    );
}
