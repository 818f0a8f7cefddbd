//! The binary's contract with people and scripts: help, exit codes, clear errors, no passwords in any output.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

fn run(args: &[&str], env: &[(&str, &str)]) -> common::Output {
    let mut cmd = Command::new(common::BIN);
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("AMQP_URL")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    common::Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn help_and_version_exit_zero() {
    for args in [
        &["--help"][..],
        &["consume", "--help"],
        &["migrate", "--help"],
        &["publish", "parcel-created", "--help"],
        &["--version"],
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        assert!(!out.stdout.is_empty());
    }
    let help = run(&["consume", "--help"], &[]).stdout;
    for flag in [
        "--queue",
        "--consumer-type",
        "--prefetch",
        "--concurrency",
        "--max-attempts",
        "--exit-when-idle",
        "--shutdown-timeout",
        "--database-url",
        "--amqp-url",
    ] {
        assert!(help.contains(flag), "{flag} missing from consume --help");
    }
}

#[test]
fn bad_flags_and_values_are_usage_errors() {
    for args in [
        &["consume"][..],
        &["consume", "shipping"],
        &["consume", "carrier", "--concurrency", "0"],
        &["consume", "carrier", "--exit-when-idle", "-5s"],
        &["consume", "carrier", "--exit-when-idle", "soon"],
        &["publish", "parcel-created", "--duplicates", "1.5"],
        &["publish", "parcel-created", "--rate", "0"],
        &["migrate", "--frobnicate"],
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(out.stderr.contains("error"), "{args:?}: {}", out.stderr);
    }
}

#[test]
fn an_unreachable_database_is_named_without_its_password() {
    let secret = "Sup3rS3cretPw";
    let url = format!("postgres://app:{secret}@127.0.0.1:1/parceltracker");
    for args in [&["migrate"][..], &["consume", "carrier"], &["demo"]] {
        let out = run(args, &[("DATABASE_URL", &url)]);
        assert_eq!(out.code, Some(69), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains(
                "cannot connect to PostgreSQL at postgres://app:***@127.0.0.1:1/parceltracker"
            ),
            "{}",
            out.stderr
        );
        assert!(
            !out.stderr.contains(secret) && !out.stdout.contains(secret),
            "{args:?}: {out:?}"
        );
    }
    let help = run(&["--help"], &[("DATABASE_URL", &url)]);
    assert!(
        !help.stdout.contains(secret),
        "--help must not show the environment's password"
    );

    // libpq's URLs also take the password as a parameter.
    let url = format!("postgres://app@127.0.0.1:1/parceltracker?password={secret}&sslmode=disable");
    let out = run(&["migrate"], &[("DATABASE_URL", &url)]);
    assert_eq!(out.code, Some(69), "{out:?}");
    assert!(
        out.stderr
            .contains("postgres://app@127.0.0.1:1/parceltracker?password=***&sslmode=disable"),
        "{out:?}"
    );
    assert!(!out.stderr.contains(secret), "{out:?}");
}

#[test]
fn an_unreachable_broker_is_named_without_its_password() {
    let secret = "An0therS3cret";
    let url = format!("amqp://app:{secret}@127.0.0.1:1/%2f");
    let out = run(&["publish", "parcel-created"], &[("AMQP_URL", &url)]);
    assert_eq!(out.code, Some(69), "{out:?}");
    assert!(
        out.stderr
            .contains("cannot connect to RabbitMQ at amqp://app:***@127.0.0.1:1/%2f"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains(secret));
}

#[test]
fn a_malformed_url_is_a_usage_error_without_its_password() {
    let out = run(
        &["migrate"],
        &[(
            "DATABASE_URL",
            "postgres://app:Pw0rdSecret@host:notaport/db",
        )],
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("invalid --database-url"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("Pw0rdSecret"), "{}", out.stderr);
}

#[test]
fn a_closed_stdout_is_not_a_crash() {
    let mut child = Command::new(common::BIN)
        .args(["migrate", "--dry-run"])
        .env(
            "DATABASE_URL",
            format!(
                "{}/inboxctl_never_created_{}",
                common::pg_base(),
                std::process::id()
            ),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn top_without_a_terminal_points_to_stats() {
    let out = run(&["top"], &[]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("not one") && out.stderr.contains("inboxctl stats"),
        "{}",
        out.stderr
    );
}

/// Every command's error path, at the most verbose logging in both formats, and every command's help: the passwords
/// of both URLs appear nowhere.
#[test]
fn no_command_shows_a_password_on_any_error_path_or_in_its_help() {
    let db_secret = "DbS3cretPw9";
    let mq_secret = "MqS3cretPw9";
    let db = format!("postgres://app:{db_secret}@127.0.0.1:1/parceltracker");
    let mq = format!("amqp://app:{mq_secret}@127.0.0.1:1/%2f");
    let env = [("DATABASE_URL", db.as_str()), ("AMQP_URL", mq.as_str())];
    let commands: [&[&str]; 11] = [
        &["migrate"],
        &["migrate", "--dry-run", "--json"],
        &["consume", "carrier"],
        &["consume", "notification", "--batch-size", "8"],
        &["publish", "parcel-created", "--count", "1"],
        &["cleanup", "--retention", "7d", "--json"],
        &["replay", "--from", "parcel-created-carrier_error", "--json"],
        &["stats", "--json"],
        &["stats"],
        &["demo"],
        &[
            "bench",
            "--modes",
            "inbox",
            "--messages",
            "10",
            "--repeats",
            "1",
        ],
    ];
    for args in commands {
        for format in ["text", "json"] {
            let mut all = vec!["-vv", "--log-format", format];
            all.extend_from_slice(args);
            let out = run(&all, &env);
            assert_ne!(out.code, Some(0), "{all:?} must fail: {out:?}");
            for secret in [db_secret, mq_secret] {
                assert!(
                    !out.stdout.contains(secret) && !out.stderr.contains(secret),
                    "{all:?} showed a password: {out:?}"
                );
            }
        }
        let mut help = vec![args[0]];
        if args[0] == "consume" || args[0] == "publish" {
            help.push(args[1]);
        }
        help.push("--help");
        let out = run(&help, &env);
        assert_eq!(out.code, Some(0), "{help:?}: {out:?}");
        for secret in [db_secret, mq_secret] {
            assert!(!out.stdout.contains(secret), "{help:?} showed a password");
        }
    }
}

/// A vhost that does not exist, and a wrong broker password: each named clearly, exit 69, no password shown, nothing
/// consumed.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_vhost_or_broker_password_is_named() {
    let env = common::TestEnv::migrated().await;
    let secret = "WrongPw7";
    let base = common::amqp_base();
    let wrong_vhost = format!("{base}/no-such-vhost-{}", env.db_name);
    let wrong_password =
        base.replacen("guest:guest@", &format!("guest:{secret}@"), 1) + "/" + &env.vhost;
    for (url, says) in [
        (wrong_vhost.as_str(), "vhost no-such-vhost"),
        (wrong_password.as_str(), "ACCESS_REFUSED"),
    ] {
        for args in [
            &["consume", "carrier"][..],
            &["replay", "--from", "q"],
            &["publish", "parcel-created"],
        ] {
            let out = env.cmd().env("AMQP_URL", url).args(args).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(69), "{args:?}: {stderr}");
            assert!(stderr.contains(says), "{args:?}: {stderr}");
            assert!(!stderr.contains(secret), "{args:?}: {stderr}");
        }
    }
}

/// The broker's password from `--amqp-password-file` (or `AMQP_PASSWORD_FILE`), with a URL that names only the user:
/// the right one works, a wrong one is refused and never shown, and a password in both places is a usage error.
#[tokio::test(flavor = "multi_thread")]
async fn the_broker_password_can_come_from_a_file() {
    let env = common::TestEnv::migrated().await;
    let base = common::amqp_base();
    assert!(base.contains("guest:guest@"), "{base}");
    let without_password = base.replacen("guest:guest@", "guest@", 1) + "/" + &env.vhost;
    let dir = std::env::temp_dir().join(format!("inboxctl-pwfile-{}", env.db_name));
    std::fs::create_dir_all(&dir).unwrap();
    let right = dir.join("right");
    let wrong = dir.join("wrong");
    std::fs::write(&right, "guest\n").unwrap();
    std::fs::write(&wrong, "Wrong-File-Pw-3\n").unwrap();
    for file in [&right, &wrong] {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    // The flag, then the environment variable.
    let out = env
        .cmd()
        .env("AMQP_URL", &without_password)
        .args(["--amqp-password-file", right.to_str().unwrap()])
        .args(["publish", "parcel-created", "--count", "2", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // No queue is bound yet: published, and unroutable (exit 3) — but connected and authenticated.
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["published"], 2, "{report}");
    let out = env
        .cmd()
        .env("AMQP_URL", &without_password)
        .env("AMQP_PASSWORD_FILE", &right)
        .args(["consume", "carrier", "--exit-when-idle", "1s"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    for args in [
        &["consume", "carrier"][..],
        &["replay", "--from", "q"],
        &["publish", "parcel-created"],
    ] {
        let out = env
            .cmd()
            .env("AMQP_URL", &without_password)
            .env("AMQP_PASSWORD_FILE", &wrong)
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {stderr}");
        assert!(stderr.contains("ACCESS_REFUSED"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Wrong-File-Pw-3"), "{args:?}: {stderr}");
    }

    let out = env
        .cmd()
        .env("AMQP_URL", format!("{base}/{}", env.vhost))
        .env("AMQP_PASSWORD_FILE", &right)
        .args(["publish", "parcel-created"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("give it in one place"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Passwords holding what a URL reserves (`@ # / ? : %`), spaces, quotes and non-ASCII, written into either URL
/// unencoded, from the environment or the command line: never shown, at -vv in either log format (nor JSON-escaped,
/// nor percent-encoded). A URL that does not parse is a usage error saying to percent-encode the password or use the
/// password file, and one that parses but whose credentials are ambiguous gets the same advice as a warning.
#[test]
fn a_password_with_reserved_characters_is_never_shown() {
    let passwords = [
        "pa#ss-W0rd9",
        "pa/ss?W0rd9",
        "p@ss#w/rd?x9",
        "pä:ss€😀#x9",
        "50%off#now9",
        "a?b#c/d@e:f%g9",
        "rtl\u{202e}#pass9",
        "sp ace#Pw9",
        "quo\"te#Pw9",
        "back\\slash#9",
    ];
    for password in passwords {
        let db = format!("postgres://app:{password}@127.0.0.1:1/parceltracker");
        let mq = format!("amqp://app:{password}@127.0.0.1:1/%2f");
        let shown_forms = [
            password.to_owned(),
            serde_json::to_string(password)
                .unwrap()
                .trim_matches('"')
                .to_owned(),
            url::form_urlencoded::byte_serialize(password.as_bytes()).collect(),
        ];
        for command in [&["migrate"][..], &["publish", "parcel-created"], &["stats"]] {
            for format in ["text", "json"] {
                for in_arguments in [false, true] {
                    let mut args = vec!["-vv", "--log-format", format];
                    let mut env = Vec::new();
                    if in_arguments {
                        args.extend(["--database-url", db.as_str(), "--amqp-url", mq.as_str()]);
                    } else {
                        env.extend([("DATABASE_URL", db.as_str()), ("AMQP_URL", mq.as_str())]);
                    }
                    args.extend_from_slice(command);
                    let out = run(&args, &env);
                    let what =
                        format!("{password:?} {command:?} {format} in arguments: {in_arguments}");
                    assert!(
                        !matches!(out.code, Some(0 | 101)) && !out.stderr.contains("panicked"),
                        "{what}: {out:?}"
                    );
                    for shown in &shown_forms {
                        assert!(
                            !out.stderr.contains(shown.as_str())
                                && !out.stdout.contains(shown.as_str()),
                            "{what} showed {shown:?}: {out:?}"
                        );
                    }
                    assert!(
                        out.stderr.contains("percent-encode"),
                        "{what}: {}",
                        out.stderr
                    );
                    if out.code == Some(64) {
                        assert!(
                            out.stderr.contains("error: invalid --"),
                            "{what}: {}",
                            out.stderr
                        );
                    }
                    assert_eq!(
                        out.stderr.contains("where `ps` shows it"),
                        in_arguments,
                        "{what}: {}",
                        out.stderr
                    );
                }
            }
        }
    }
}

/// A password in a URL typed on the command line (where `ps` shows it) is warned about once per URL, pointing to the
/// environment variable and the password file; not when the URL came from the environment, nor without a password.
#[test]
fn a_password_on_the_command_line_is_warned_about_once() {
    let db = "postgres://app:Cm4ndL1nePw@127.0.0.1:1/parceltracker";
    let out = run(&["migrate", "--database-url", db], &[]);
    assert_eq!(out.code, Some(69), "{out:?}");
    assert_eq!(
        out.stderr.matches("where `ps` shows it").count(),
        1,
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("--database-url holds a password in the command line")
            && out.stderr.contains("DATABASE_URL")
            && out.stderr.contains("--database-password-file"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("Cm4ndL1nePw"), "{}", out.stderr);
    let out = run(
        &[
            "--amqp-url",
            "amqp://app:Cm4ndL1nePw@127.0.0.1:1/%2f",
            "publish",
            "parcel-created",
        ],
        &[],
    );
    assert!(
        out.stderr
            .contains("--amqp-url holds a password in the command line")
            && out.stderr.contains("AMQP_URL")
            && out.stderr.contains("--amqp-password-file"),
        "{}",
        out.stderr
    );
    for (args, env) in [
        (&["migrate"][..], &[("DATABASE_URL", db)][..]),
        (
            &[
                "migrate",
                "--database-url",
                "postgres://app@127.0.0.1:1/parceltracker",
            ],
            &[],
        ),
    ] {
        let out = run(args, env);
        assert_eq!(out.code, Some(69), "{out:?}");
        assert!(
            !out.stderr.contains("where `ps` shows it"),
            "{args:?}: {}",
            out.stderr
        );
    }
}
