//! One error policy for every command (docs/commands.md, "Exit codes"): each command run against each condition a
//! new user meets — a server down, the database or its schema missing, a login refused, the vhost missing — exits
//! with the condition's code and names the fix, with the URL masked and nothing of the server's internals (no
//! PostgreSQL source line, `at line N`) in it. `top` is not in the table: it keeps running and retrying, and says what
//! is wrong in its status line (`top::top_says_when_postgres_is_gone_keeps_retrying_and_recovers`).

use crate::common::{self, TestEnv, admin_pool, quote_ident};

/// What a condition does to the environment the command runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Condition {
    PostgresDown,
    DatabaseMissing,
    SchemaMissing,
    /// A role the server does not know: its login is refused (SQLSTATE 28000), as a wrong password is (28P01, on a
    /// server that checks passwords: `restart::a_wrong_password_is_named_and_a_password_file_works`).
    PostgresLoginRefused,
    RabbitDown,
    VhostMissing,
    RabbitWrongPassword,
}

use Condition::*;

const CONDITIONS: [Condition; 7] = [
    PostgresDown,
    DatabaseMissing,
    SchemaMissing,
    PostgresLoginRefused,
    RabbitDown,
    VhostMissing,
    RabbitWrongPassword,
];

/// A password that must never be shown.
const SECRET: &str = "Wr0ng-S3cret-Pw";

/// What a condition must make a command that meets it say: its exit code and the words of the fix.
fn policy(condition: Condition) -> (i32, &'static [&'static str]) {
    match condition {
        PostgresDown => (
            69,
            &[
                "cannot connect to PostgreSQL at postgres://postgres@127.0.0.1:1/",
                "scripts/services.sh",
            ],
        ),
        DatabaseMissing => (78, &["does not exist", "run `inboxctl migrate`"]),
        SchemaMissing => (
            78,
            &["inbox_messages does not exist", "run `inboxctl migrate`"],
        ),
        PostgresLoginRefused => (
            77,
            &["refused the login of role \"nobody_", "check the password"],
        ),
        RabbitDown => (
            69,
            &[
                "cannot connect to RabbitMQ at amqp://",
                "scripts/services.sh",
            ],
        ),
        VhostMissing => (78, &["has no vhost", "rabbitmqctl add_vhost"]),
        RabbitWrongPassword => (
            77,
            &[
                "refused the login of user \"guest\"",
                "amqp://guest:***@",
                "--amqp-password-file",
            ],
        ),
    }
}

/// Which servers a command uses, in the order it meets them.
#[derive(Debug, Clone, Copy)]
struct Command {
    args: &'static [&'static str],
    postgres: bool,
    rabbit: Rabbit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rabbit {
    No,
    Required,
    /// Used for some figures only: a broker that cannot be used is a warning naming the fix, and exit 3.
    Optional,
}

const COMMANDS: [Command; 7] = [
    Command {
        args: &["migrate"],
        postgres: true,
        rabbit: Rabbit::No,
    },
    Command {
        args: &["consume", "carrier", "--exit-when-idle", "300ms"],
        postgres: true,
        rabbit: Rabbit::Required,
    },
    Command {
        // It looks at the dead-letter queues' oldest messages before deleting (the window of a waiting replay).
        args: &["cleanup", "--retention", "7d"],
        postgres: true,
        rabbit: Rabbit::Required,
    },
    Command {
        args: &["stats"],
        postgres: true,
        rabbit: Rabbit::Optional,
    },
    Command {
        args: &[
            "replay",
            "--from",
            "parcel-created-carrier_error",
            "--dry-run",
        ],
        postgres: false,
        rabbit: Rabbit::Required,
    },
    Command {
        args: &["publish", "parcel-created", "--count", "1"],
        postgres: false,
        rabbit: Rabbit::Required,
    },
    Command {
        args: &["demo", "--parcels", "3"],
        postgres: true,
        rabbit: Rabbit::Required,
    },
];

impl Command {
    fn name(&self) -> String {
        self.args.join(" ")
    }

    /// The exit code and the words this command must show under `condition`; `None` where the condition does not
    /// touch it (its code is then the one it has in a healthy environment).
    fn expects(&self, condition: Condition) -> Option<(i32, &'static [&'static str])> {
        let first = self.args[0];
        match condition {
            // `migrate` (and the demo, which starts with it) creates what is missing.
            DatabaseMissing | SchemaMissing if matches!(first, "migrate" | "demo") => {
                Some((0, &[]))
            }
            PostgresDown | DatabaseMissing | SchemaMissing | PostgresLoginRefused => {
                self.postgres.then(|| policy(condition))
            }
            RabbitDown | VhostMissing | RabbitWrongPassword => match self.rabbit {
                Rabbit::No => None,
                Rabbit::Required => Some(policy(condition)),
                Rabbit::Optional => Some((3, &policy(condition).1[1..])),
            },
        }
    }
}

/// The environment a condition makes out of a healthy one: the URLs to use, and a database to drop afterwards.
fn urls(env: &TestEnv, condition: Condition) -> (String, String) {
    let pg = common::pg_base();
    let amqp = common::amqp_base();
    let with_secret = amqp.replacen("guest:guest@", &format!("guest:{SECRET}@"), 1);
    let suffix = &env.db_name["inboxctl_test_".len()..];
    match condition {
        PostgresDown => (
            format!("postgres://postgres@127.0.0.1:1/{}", env.db_name),
            env.amqp_url.clone(),
        ),
        DatabaseMissing => (
            format!("{pg}/{}_missing", env.db_name),
            env.amqp_url.clone(),
        ),
        SchemaMissing => (format!("{pg}/{}_empty", env.db_name), env.amqp_url.clone()),
        PostgresLoginRefused => (
            format!(
                "postgres://nobody_{suffix}:{SECRET}@127.0.0.1:5432/{}",
                env.db_name
            ),
            env.amqp_url.clone(),
        ),
        RabbitDown => (
            env.database_url.clone(),
            format!("amqp://guest:{SECRET}@127.0.0.1:1/{}", env.vhost),
        ),
        VhostMissing => (
            env.database_url.clone(),
            format!("{amqp}/{}-missing", env.vhost),
        ),
        RabbitWrongPassword => (
            env.database_url.clone(),
            format!("{with_secret}/{}", env.vhost),
        ),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_command_names_the_fix_for_each_condition() {
    let env = TestEnv::migrated().await;
    let admin = admin_pool().await;
    let empty = format!("{}_empty", env.db_name);
    let missing = format!("{}_missing", env.db_name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {}",
        quote_ident(&empty)
    )))
    .execute(&admin)
    .await
    .unwrap();
    // The queue replay reads, so that its healthy run has something to look at.
    common::consume_until_idle(&env, &["carrier"]);

    let mut failures = Vec::new();
    for command in COMMANDS {
        let healthy = env.run(command.args);
        for condition in CONDITIONS {
            let (database_url, amqp_url) = urls(&env, condition);
            if condition == SchemaMissing {
                // A fresh empty database each time: migrate and the demo fill it.
                let drop = format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    quote_ident(&empty)
                );
                sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                    .execute(&admin)
                    .await
                    .unwrap();
                let create = format!("CREATE DATABASE {}", quote_ident(&empty));
                sqlx::raw_sql(sqlx::AssertSqlSafe(create))
                    .execute(&admin)
                    .await
                    .unwrap();
            }
            let out = common::Output::of(
                env.cmd()
                    .env("DATABASE_URL", &database_url)
                    .env("AMQP_URL", &amqp_url)
                    .args(command.args)
                    .output()
                    .unwrap(),
            );
            let (code, needles) = command
                .expects(condition)
                .unwrap_or((healthy.code.unwrap_or(-1), &[]));
            let everything = format!("{}{}", out.stdout, out.stderr);
            let mut wrong = Vec::new();
            if out.code != Some(code) {
                wrong.push(format!("exit {:?}, expected {code}", out.code));
            }
            for needle in needles {
                if !out.stderr.contains(needle) {
                    wrong.push(format!("no {needle:?}"));
                }
            }
            if everything.contains("at line") {
                wrong.push("a server-internal `at line`".to_owned());
            }
            if everything.contains(SECRET) {
                wrong.push("the password".to_owned());
            }
            if !wrong.is_empty() {
                failures.push(format!(
                    "{} under {condition:?}: {}\n  stderr: {}",
                    command.name(),
                    wrong.join("; "),
                    out.stderr.trim()
                ));
            }
        }
        // A database the demo or migrate created under DatabaseMissing goes before the next command meets it.
        let drop = format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&missing)
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&admin)
            .await
            .unwrap();
    }
    for name in [&empty, &missing] {
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name));
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&admin)
            .await
            .unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
