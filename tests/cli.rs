//! The binary's contract with people and scripts: help, exit codes, clear errors, no passwords in any output.

use crate::common;

use std::process::Command;

fn run(args: &[&str], env: &[(&str, &str)]) -> common::Output {
    let mut cmd = Command::new(common::bin());
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
    let long_destination = "ü".repeat(128);
    for args in [
        &["consume"][..],
        &["consume", "shipping"],
        &["consume", "carrier", "--concurrency", "0"],
        &["consume", "carrier", "--exit-when-idle", "-5s"],
        &["consume", "carrier", "--exit-when-idle", "soon"],
        &["publish", "parcel-created", "--duplicates", "1.5"],
        &["publish", "parcel-created", "--rate", "0"],
        &["migrate", "--frobnicate"],
        // Accepted and then capped at 30s without a word, before.
        &["consume", "carrier", "--retry-delay", "5m"],
        // Kept in whole seconds: partitions of 1h 500ms drifted from what a cleanup computed, leaving gaps.
        &["migrate", "--partitioned", "1h 500ms"],
        // The routing key a partition key makes is an AMQP short string: this panicked mid-run (exit 101).
        &[
            "publish",
            "parcel-created",
            "--partition-key",
            "destination",
            "--destination",
            long_destination.as_str(),
        ],
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(out.stderr.contains("error"), "{args:?}: {}", out.stderr);
    }
}

/// With `--lookup-url`, one leased attempt asks the look-up and then makes the call: the lease must outlast both, or
/// another process could take the effect over while the call is still in flight. 20 s + the 3 s connect timeout: the
/// default 30 s lease outlasts one call (taken, and then failing only to connect), not a look-up and a call (46 s).
#[test]
fn an_effect_lease_shorter_than_a_look_up_and_a_call_is_refused() {
    let base = [
        "consume",
        "carrier",
        "--carrier-url",
        "http://127.0.0.1:1",
        "--effect-mode",
        "after-commit",
        "--carrier-timeout",
        "20s",
    ];
    let unreachable = [
        (
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:1/parceltracker",
        ),
        ("AMQP_URL", "amqp://127.0.0.1:1/%2f"),
    ];
    let with_look_up = [&base[..], &["--lookup-url", "http://127.0.0.1:1"]].concat();
    let out = run(&with_look_up, &unreachable);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("--effect-lease") && out.stderr.contains("look-up"),
        "{out:?}"
    );
    let out = run(&base, &unreachable);
    assert_eq!(out.code, Some(69), "taken, then unable to connect: {out:?}");
}

/// A usage error quotes the argument it could not take: a second node's URL given without its `--amqp-url`, or a URL
/// where a message id goes. Printed as clap wrote it, the password was in it.
#[test]
fn a_usage_error_quoting_a_url_masks_its_password() {
    let secret = "S3cretPw";
    for args in [
        &[
            "--amqp-url",
            "amqp://app:S3cretPw@rabbit1",
            "amqp://app:S3cretPw@rabbit2",
            "stats",
        ][..],
        &["find", "postgres://u:S3cretPw@db/x"],
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(out.stderr.contains("***@"), "{args:?}: {out:?}");
        assert!(
            !out.stderr.contains(secret) && !out.stdout.contains(secret),
            "{args:?}: {out:?}"
        );
    }
    // A password holding a `'` or a space: clap quotes the value in `'…'`, and the pattern pass took the quote (or the
    // space) for the URL's end, before its `@`: the password went out whole. Every URL given is registered first now.
    for (secret, args) in [
        (
            "it's-S3cret",
            &[
                "--amqp-url",
                "amqp://app:it's-S3cret@rabbit1",
                "amqp://app:it's-S3cret@rabbit2",
                "stats",
            ][..],
        ),
        ("pa ss-W0rd", &["find", "postgres://u:pa ss-W0rd@db/x"][..]),
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(
            !out.stderr.contains(secret) && !out.stdout.contains(secret),
            "{args:?}: {out:?}"
        );
    }
    // The argument clap quotes is escaped as any text inboxctl prints: an id pasted from a message header, say.
    let out = run(&["find", "\u{1b}[2J\u{9b}1m\u{202e}x\rnot-an-id"], &[]);
    assert_eq!(out.code, Some(64), "{out:?}");
    for c in ['\u{1b}', '\u{9b}', '\u{202e}', '\r'] {
        assert!(!out.stderr.contains(c), "{c:?} in {:?}", out.stderr);
    }
}

/// A usage error written to a stderr closed under it (`inboxctl --bogus 2>&1 | head -0`) is exit 64, not a panic; and
/// the help a bare `inboxctl` prints shows its URL shapes as written, not masked as if they held passwords.
#[test]
fn a_usage_error_to_a_closed_stderr_is_no_panic_and_bare_help_is_shown_as_written() {
    let mut child = Command::new(common::bin())
        .arg("--bogus-flag")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    assert_eq!(child.wait().unwrap().code(), Some(64));
    let out = run(&[], &[]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr.contains("postgres://user[:password]@host"),
        "{}",
        out.stderr
    );
}

/// A CA file beside an `amqp://` URL verified nothing and sent the login in clear text, without a word: refused. So
/// is one that never ends (`/dev/zero`), which was read into memory without a bound.
#[test]
fn a_ca_file_with_a_url_that_is_not_amqps_is_refused() {
    let out = run(
        &[
            "--amqp-url",
            "amqp://app@127.0.0.1:1/%2f",
            "--amqp-ca-file",
            "/etc/ssl/rabbit-ca.pem",
            "publish",
            "parcel-created",
            "--count",
            "1",
        ],
        &[],
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr
            .contains("is for amqps:// URLs, and --amqp-url is not one"),
        "{out:?}"
    );
    // And a CA file that never ends (given by mistake) is refused, not read into memory without end.
    let out = run(
        &[
            "--amqp-url",
            "amqps://app@127.0.0.1:1/%2f",
            "--amqp-ca-file",
            "/dev/zero",
            "publish",
            "parcel-created",
            "--count",
            "1",
        ],
        &[],
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("longer than"), "{out:?}");
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

/// Under `--log-format json` the error a run ends with is one more JSON line (its exit code in it), masked like the
/// rest: a log shipper reading JSON lines gets the reason a consumer stopped, not a line it cannot parse.
#[test]
fn under_json_logs_the_final_error_is_a_json_line_without_the_password() {
    let secret = "Sup3rS3cretPw";
    let url = format!("postgres://app:{secret}@127.0.0.1:1/parceltracker");
    for args in [
        &["--log-format", "json", "migrate"][..],
        &["--log-format", "json", "consume", "carrier"],
    ] {
        let out = run(args, &[("DATABASE_URL", &url)]);
        assert_eq!(out.code, Some(69), "{args:?}: {out:?}");
        assert!(!out.stderr.contains(secret), "{args:?}: {out:?}");
        let lines: Vec<serde_json::Value> = out
            .stderr
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{args:?}: not a JSON line ({e}): {l:?}"))
            })
            .collect();
        let last = lines
            .last()
            .unwrap_or_else(|| panic!("{args:?}: nothing on stderr"));
        assert_eq!(last["level"], "ERROR", "{last}");
        assert_eq!(last["exit_code"], 69, "{last}");
        let message = last["message"].as_str().unwrap();
        assert!(
            message.starts_with("error: cannot connect to PostgreSQL at postgres://app:***@127.0.0.1:1/parceltracker"),
            "{last}"
        );
    }
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

/// lapin traces each frame it writes, the login's among them: under `RUST_LOG=trace` the broker password went to stderr
/// as a list of bytes (`[0, 103, 117, 101, 115, 116, …]`, "\0guest"), where no masking could see it.
#[tokio::test(flavor = "multi_thread")]
async fn a_trace_log_never_carries_the_broker_login() {
    let env = common::TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut publish = env.spawn_with(
        &["publish", "parcel-created", "--count", "1"],
        &[("RUST_LOG", "trace")],
    );
    assert_eq!(publish.wait(std::time::Duration::from_secs(60)), Some(0));
    let stderr = publish.stderr();
    assert!(stderr.contains("TRACE"), "trace logging on");
    let url = url::Url::parse(&env.amqp_url).unwrap();
    let user = if url.username().is_empty() {
        "guest"
    } else {
        url.username()
    };
    let password = url.password().unwrap_or("guest");
    let login: Vec<String> = format!("\0{user}\0{password}")
        .bytes()
        .map(|b| b.to_string())
        .collect();
    assert!(
        !stderr.contains(&login.join(", ")),
        "the login's bytes in the log"
    );
}

/// The database's name is the URL's path, percent-decoded: `migrate` printed it as it was, escape sequences and all.
#[test]
fn migrate_shows_a_database_name_of_control_characters_inert() {
    let out = run(
        &["migrate", "--dry-run"],
        &[(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/inboxctl_x%1b%5d0%3bowned%07",
        )],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains("inboxctl_x\\u{1b}]0;owned\\u{7}"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains('\u{1b}'), "{}", out.stdout);
}

/// The carrier's URLs are flags parsed at the command line, where clap's own message quoted the value whole, password
/// and all.
#[test]
fn a_malformed_carrier_url_is_a_usage_error_without_its_password() {
    for args in [
        &[
            "consume",
            "carrier",
            "--carrier-url",
            "https://ops:CarrierPw0rd@carrier.example:8443x/",
        ][..],
        &[
            "effects",
            "reconcile",
            "--consumer-type",
            "carrier",
            "--lookup-url",
            "https://ops:CarrierPw0rd@carrier.example:8443x/",
        ],
    ] {
        let out = run(args, &[]);
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("invalid value for --"),
            "{}",
            out.stderr
        );
        assert!(out.stderr.contains("invalid port number"), "{}", out.stderr);
        assert!(!out.stderr.contains("CarrierPw0rd"), "{}", out.stderr);
    }
}

/// A libpq key/value string is not a URL, and nothing in it can be told apart as its password: none of it is shown
/// (it was echoed whole, password and all). A passphrase given as `sslpassword=` (a parameter sqlx does not know and
/// logs as it ignores it) is masked wherever it would be shown.
#[test]
fn a_key_value_string_or_an_sslpassword_never_shows_its_secret() {
    let out = run(
        &["migrate"],
        &[(
            "DATABASE_URL",
            "host=127.0.0.1 user=app password=Kv0Secret dbname=x",
        )],
    );
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("not a URL"), "{}", out.stderr);
    assert!(!out.stderr.contains("Kv0Secret"), "{}", out.stderr);
    // Form-encoded as a driver would decode it (`+` a space), beside a password file: not taken for a second login
    // password, never shown in any form.
    let file = std::env::temp_dir().join(format!("inboxctl-pw-{}", std::process::id()));
    std::fs::write(&file, "FilePw9\n").unwrap();
    let out = run(
        &["migrate"],
        &[
            (
                "DATABASE_URL",
                "postgres://app@127.0.0.1:1/x?sslpassword=Key+Phr4se&connect_timeout=1",
            ),
            ("DATABASE_PASSWORD_FILE", file.to_str().unwrap()),
        ],
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(out.code, Some(69), "{out:?}");
    for shown in ["Key+Phr4se", "Key Phr4se", "Phr4se", "FilePw9"] {
        assert!(!out.stderr.contains(shown), "{shown}: {}", out.stderr);
    }
    assert!(
        out.stderr.contains("ignoring the URL's sslpassword"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_closed_stdout_is_not_a_crash() {
    let mut child = Command::new(common::bin())
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

/// The same for stderr: an error whose reader has gone (`inboxctl migrate 2>&1 | head -0`) used to panic in printing
/// it, exit 101; the error's own code is the answer.
#[test]
fn a_closed_stderr_is_not_a_crash() {
    // The reader (`true`) is gone before inboxctl starts (the sleep): its error meets a pipe with no reader.
    let script = format!(
        "(sleep 0.5; exec '{}' migrate) 2>&1 >/dev/null | true; echo \"exit=${{PIPESTATUS[0]}}\"",
        common::bin()
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .env("DATABASE_URL", "postgres://app@127.0.0.1:1/parceltracker")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(said.trim(), "exit=69", "{out:?}");
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
    let commands: [&[&str]; 10] = [
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
    ];
    // Most runs wait for PostgreSQL to refuse them for seconds: the commands run side by side.
    std::thread::scope(|scope| {
        for args in commands {
            let env = &env;
            scope.spawn(move || {
                for format in ["text", "json"] {
                    let mut all = vec!["-vv", "--log-format", format];
                    all.extend_from_slice(args);
                    let out = run(&all, env);
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
                let out = run(&help, env);
                assert_eq!(out.code, Some(0), "{help:?}: {out:?}");
                for secret in [db_secret, mq_secret] {
                    assert!(!out.stdout.contains(secret), "{help:?} showed a password");
                }
            });
        }
    });
}

/// A vhost that does not exist (exit 78), and a wrong broker password (exit 77): each named clearly with its fix, no
/// password shown, nothing consumed.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_vhost_or_broker_password_is_named() {
    let env = common::TestEnv::migrated().await;
    let secret = "WrongPw7";
    let base = common::amqp_base();
    let wrong_vhost = format!("{base}/no-such-vhost-{}", env.db_name);
    let wrong_password =
        base.replacen("guest:guest@", &format!("guest:{secret}@"), 1) + "/" + &env.vhost;
    for (url, code, says) in [
        (wrong_vhost.as_str(), 78, "has no vhost \"no-such-vhost"),
        (wrong_password.as_str(), 77, "ACCESS_REFUSED"),
    ] {
        for args in [
            &["consume", "carrier"][..],
            &["replay", "--from", "q"],
            &["publish", "parcel-created"],
        ] {
            let out = env.cmd().env("AMQP_URL", url).args(args).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
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
        assert_eq!(out.status.code(), Some(77), "{args:?}: {stderr}");
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

/// Runs the binary with a time limit, its output collected; `None` for the exit code when it had to be killed.
fn run_for(mut cmd: Command, limit: std::time::Duration) -> common::Output {
    use std::io::Read as _;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + limit;
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    common::Output {
        code,
        stdout: String::from_utf8_lossy(&out.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&err.join().unwrap()).into_owned(),
    }
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

/// `publish --rate` outside what can be timed (a tick rounded to zero, or longer than a clock holds) is a usage
/// error naming the range, not a panic.
#[test]
fn a_publish_rate_out_of_range_is_a_usage_error() {
    for rate in ["1e10", "1e-20", "NaN", "inf", "0", "-5"] {
        let out = run(
            &["publish", "parcel-created", &format!("--rate={rate}")],
            &[],
        );
        assert_eq!(out.code, Some(64), "{rate}: {out:?}");
        assert!(
            out.stderr
                .contains("from 0.001 to 1000000 messages per second"),
            "{rate}: {}",
            out.stderr
        );
    }
}

/// Every numeric and duration flag of every subcommand, given each value of a hostile list (overflowing, NaN,
/// infinite, zero, negative, tiny, centuries): no panic (exit 101, "panicked") and no abort, ever. First against
/// servers that do not answer — each value is either refused as a usage error or taken and the command fails to
/// connect — then, for the values taken, against the real servers with a time limit (a command that runs past it
/// was working, not crashing). `top` needs a terminal, so it is held to the first part: its values are bounded before
/// anything connects. (The bench's flags have the same test in its own crate, bench/tests/bench.rs.)
#[tokio::test(flavor = "multi_thread")]
async fn no_hostile_flag_value_makes_any_command_panic() {
    const NUMBERS: &[&str] = &[
        "0",
        "-1",
        "0.5",
        "1e10",
        "1e-20",
        "NaN",
        "inf",
        "1e309",
        "65536",
        "4294967296",
        "18446744073709551615",
        "18446744073709551616",
    ];
    const DURATIONS: &[&str] = &[
        "0s",
        "-1s",
        "1ns",
        "1ms",
        "100y",
        "1000000y",
        "584542046090y",
        "99999999999999999999d",
    ];
    const FOR_DURATIONS: &[&str] = &[
        "--retry-delay",
        "--claim-timeout",
        "--exit-when-idle",
        "--shutdown-timeout",
        "--batch-wait",
        "--retention",
        "--batch-pause",
        "--every",
        "--reconnect-timeout",
        "--window",
        "--interval",
    ];
    // The command and the flags it takes, with what makes a run of it end by itself.
    let commands: &[(&[&str], &[&str], &[&str])] = &[
        (
            &["consume", "carrier"],
            &["--exit-when-idle", "1s", "--concurrency", "2"],
            &[
                "--prefetch",
                "--concurrency",
                "--pool-size",
                "--max-attempts",
                "--retry-delay",
                "--claim-timeout",
                "--exit-when-idle",
                "--shutdown-timeout",
                "--batch-size",
                "--batch-wait",
                "--poison-after",
            ],
        ),
        (
            &["cleanup"],
            &["--retention", "7d"],
            &["--retention", "--batch-size", "--batch-pause", "--every"],
        ),
        (
            &[
                "replay",
                "--from",
                "parcel-created-carrier_error",
                "--dry-run",
            ],
            &[],
            &[
                "--limit",
                "--max-replays",
                "--retention",
                "--reconnect-timeout",
            ],
        ),
        (
            &["publish", "parcel-created", "--exchange", "hostile-values"],
            &["--count", "3"],
            &["--count", "--duplicates", "--rate", "--reconnect-timeout"],
        ),
        (&["stats"], &[], &["--window"]),
        (
            &["demo"],
            &["--parcels", "5"],
            &["--parcels", "--duplicates"],
        ),
        (
            &["top"],
            &[],
            &["--interval", "--window", "--alert-duplicates"],
        ),
    ];
    let mut runs: Vec<(Vec<String>, bool)> = Vec::new();
    for (command, ends, flags) in commands {
        for flag in *flags {
            let values = if FOR_DURATIONS.contains(flag) {
                DURATIONS
            } else {
                NUMBERS
            };
            for value in values {
                let mut args: Vec<String> = command.iter().map(|s| (*s).to_owned()).collect();
                // The flag under test replaces the same flag among the ones that end the run.
                for pair in ends.chunks(2) {
                    if pair[0] != *flag {
                        args.extend(pair.iter().map(|s| (*s).to_owned()));
                    }
                }
                // `--flag=value`, so that a value starting with `-` is taken as one.
                args.push(format!("{flag}={value}"));
                let real = command[0] != "top";
                runs.push((args, real));
            }
        }
    }
    runs.push((
        vec!["-".to_owned() + &"v".repeat(300), "stats".to_owned()],
        true,
    ));

    let panicked = |out: &common::Output| {
        matches!(out.code, Some(101 | 134)) || out.stderr.contains("panicked")
    };
    // Part one: the servers refuse at once (a role and a vhost that do not exist), and nothing can be created.
    let refused = [
        (
            "DATABASE_URL",
            format!("{}/parceltracker", common::pg_base()).replacen(
                "postgres@",
                "inboxctl_no_such_role@",
                1,
            ),
        ),
        (
            "AMQP_URL",
            format!("{}/inboxctl-no-such-vhost", common::amqp_base()),
        ),
    ];
    let refused = &refused;
    let taken: Vec<Vec<String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .chunks(runs.len().div_ceil(4))
            .map(|chunk| {
                scope.spawn(move || {
                    let mut taken = Vec::new();
                    for (args, real) in chunk {
                        let mut cmd = Command::new(common::bin());
                        cmd.args(args).env_remove("RUST_LOG");
                        for (k, v) in refused {
                            cmd.env(k, v);
                        }
                        let out = run_for(cmd, std::time::Duration::from_secs(30));
                        assert!(!panicked(&out), "{args:?}: {out:?}");
                        assert!(
                            out.code.is_some(),
                            "{args:?} hung, refused by the servers: {out:?}"
                        );
                        if out.code != Some(64) && *real {
                            taken.push(args.clone());
                        }
                    }
                    taken
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });

    // Values that panicked, aborted or looped once are refused before anything connects.
    for args in [
        &["publish", "parcel-created", "--rate=1e10"][..],
        &["publish", "parcel-created", "--rate=1e-20"],
        &["publish", "parcel-created", "--count=4294967296"],
        &["consume", "carrier", "--claim-timeout=100y"],
        &["stats", "--window=1000000y"],
    ] {
        let mut cmd = Command::new(common::bin());
        cmd.args(args);
        for (k, v) in refused {
            cmd.env(k, v);
        }
        let out = run_for(cmd, std::time::Duration::from_secs(30));
        assert_eq!(out.code, Some(64), "{args:?}: {out:?}");
    }

    // Part two: the real servers, for the values taken.
    let env = common::TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Atlantis"]);
    let out = env.run(&[
        "consume",
        "carrier",
        "--fail-destination",
        "Atlantis",
        "--max-attempts",
        "1",
        "--exit-when-idle",
        "1s",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(env.queue_counts("parcel-created-carrier_error").0, 1);
    let (demo, rest): (Vec<_>, Vec<_>) = taken.into_iter().partition(|a| a[0] == "demo");
    std::thread::scope(|scope| {
        for chunk in rest.chunks(rest.len().div_ceil(4).max(1)) {
            let env = &env;
            scope.spawn(move || {
                for args in chunk {
                    let mut cmd = env.cmd();
                    cmd.args(args);
                    let out = run_for(cmd, std::time::Duration::from_secs(5));
                    assert!(!panicked(&out), "{args:?}: {out:?}");
                }
            });
        }
    });
    // A demo fills the endpoints' queues, and one stopped at the time limit leaves them full: each run gets a vhost
    // and a database of its own.
    for args in demo {
        let demo_env = common::TestEnv::bare().await;
        let mut cmd = demo_env.cmd();
        cmd.args(&args);
        let out = run_for(cmd, std::time::Duration::from_secs(10));
        assert!(!panicked(&out), "{args:?}: {out:?}");
    }
}

/// A queue name holding a right-to-left override reaches the log only escaped, as the tables show it: `\u{202e}` in
/// text lines, `\u202e` in JSON lines (which read back to the name as given). No log line carries a raw control
/// character or override. As a consumer_type — given, or taken from such a queue's name — it is refused: a scope that
/// looks like another would process the same messages again.
#[tokio::test(flavor = "multi_thread")]
async fn a_bidi_override_in_a_name_reaches_the_log_escaped() {
    let env = common::TestEnv::migrated().await;
    let consumer_type = "carrier-reversed";
    let queue = "carrier-queue\u{202e}reversed";
    for format in ["text", "json"] {
        let out = env.run(&[
            "--log-format",
            format,
            "consume",
            "carrier",
            "--queue",
            queue,
            "--consumer-type",
            consumer_type,
            "--exit-when-idle",
            "1s",
        ]);
        assert_eq!(out.code, Some(0), "{format}: {out:?}");
        assert!(
            !out.stderr
                .chars()
                .any(|c| c != '\n' && inboxctl::sanitize::is_unsafe(c)),
            "{format}: {:?}",
            out.stderr
        );
        let consuming = out
            .stderr
            .lines()
            .find(|l| l.contains("consuming"))
            .unwrap_or_else(|| panic!("{format}: {}", out.stderr));
        if format == "text" {
            assert!(
                consuming.contains("queue=carrier-queue\\u{202e}reversed"),
                "{consuming}"
            );
        } else {
            assert!(
                consuming.contains("carrier-queue\\u202ereversed"),
                "{consuming}"
            );
            let line: serde_json::Value = serde_json::from_str(consuming).unwrap();
            assert_eq!(line["consumer_type"], consumer_type, "{line}");
            assert_eq!(line["queue"], queue, "{line}");
        }
    }
    for scope in [vec!["--consumer-type", "carrier\u{202e}reversed"], vec![]] {
        let mut args = vec![
            "consume",
            "carrier",
            "--queue",
            queue,
            "--exit-when-idle",
            "1s",
        ];
        args.extend(scope);
        let out = env.run(&args);
        assert_eq!(out.code, Some(64), "{out:?}");
        assert!(out.stderr.contains("looks like another"), "{out:?}");
        assert!(
            !out.stderr
                .chars()
                .any(|c| c != '\n' && inboxctl::sanitize::is_unsafe(c)),
            "{:?}",
            out.stderr
        );
    }
}
