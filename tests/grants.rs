//! docs/security.md's "What to grant": each command run through the binary as a PostgreSQL role and a RabbitMQ user that
//! have exactly the table's grants and nothing more, doing its whole job; and key grants shown necessary by taking
//! each away alone: the command names the permission it lacks and loses nothing.
//!
//! The grants taken away are the rows of one table per command ([`MIGRATE_REFUSALS`], [`CONSUME_REFUSALS`], …):
//! what is missing, the command, its exit code and the words its error must name, and what must be as it was. One
//! runner ([`Subject::refused`]) takes the grant away, runs the command, checks all that and gives the grant back.
//!
//! Roles and users are named after the test's database (unique per run, so a leftover of a killed run never
//! collides) and dropped with [`Principals`], also when the test fails. A `none` in the table is run against an
//! unreachable URL for that server: the command succeeding proves it never connects there.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{CARRIER_QUEUE, EVENT_EXCHANGE, NOTIFICATION_QUEUE, Output, TestEnv};
use lapin::BasicProperties;
use sqlx::PgPool;
use uuid::Uuid;

/// docs/security.md's table, row by row, as the tests below prove it: a changed row fails here until they prove it.
const SECURITY_ROWS: [&str; 6] = [
    "| `migrate` | `CREATE` on the database's schema (and `CREATEDB` only if it should create the database); to add its indexes beside an existing `inbox_messages`, the table's owner; with `--partitioned`, the table's owner (it renames the table and makes the partitioned one, granting on it what the old table granted; made by another role — a superuser, a member of the owner's role — it and its partitions are handed back to the old owner, or, where that role may not, it says so) | none |",
    "| `consume` | `SELECT, INSERT` on `inbox_messages`; `INSERT` on its effect table (`carrier_reservations` or `notifications_sent`), `inboxctl_events` and `inboxctl_audit`; `SELECT, INSERT, UPDATE` on `inboxctl_consumers` and `inboxctl_fingerprints`; `SELECT, INSERT, UPDATE, DELETE` on `inboxctl_attempts` | configure `^(<queue>(_error\\|_skipped)?\\|<event exchange>)$` (only to declare what is absent), write `^<queue>(_error\\|_skipped)?$`, read `^(<queue>(_error\\|_skipped)?\\|<event exchange>)$` (it binds the queue to its exchange and that to the event exchange at every start, and a dead-letter queue to its exchange at its first use) |",
    "| `publish` | none | write on the event exchange (configure it, if absent) |",
    "| `cleanup` | `SELECT, DELETE` on `inbox_messages`, `inboxctl_events`, `inboxctl_attempts`, `inboxctl_fingerprints`, `inboxctl_audit`; `SELECT` on `inboxctl_consumers`; `INSERT` on `inboxctl_audit`; on a partitioned inbox, to make and drop its partitions, the table's owner and `CREATE` on its schema (without them it deletes in batches, and says so) | read `^<queue>(_error\\|_skipped)$` for the queue of each consumer_type it cleans, in the vhost its consumer reads in, and each `--dlq` (it looks at their messages, up to 10,000 each, and gives them back); configure and read `^inboxctl\\.looking\\.<queue>(_error\\|_skipped)$` (its look's mark, by which another cleanup sees it; without it, it says so and goes on); none with `--force` |",
    "| `replay` | none | configure `^inboxctl\\.replaying\\.<dead-letter queue>$` (the marker that keeps `cleanup` off the rows of what it holds; without it the replay goes on and says it is not marked), read `^<dead-letter queue>$`, write `^amq\\.default$` (the default exchange, which routes to the origin queues; they need none) |",
    "| `stats`, `top` | `SELECT` on `inbox_messages`, `inboxctl_events`, `inboxctl_consumers` (estimates come from `pg_class`/`pg_stats`, visible to whoever may read the table) | access to the vhost, with configure and write empty (`\"\"`), read `^<queue>_error$` for each consumer_type's error queue: the queue depths come from passive declares, which need none, and the age of an error queue's oldest message from looking at it (and giving it back); without read that age is unknown, `stats` says why and exits 3, every other figure shown (RabbitMQ's read also lets a role purge a queue or take its messages: leave it out where the monitoring role must not be able to); `top`'s detail view lists an error queue's failures unmarked under these grants (a cleanup's guard meanwhile cannot see what it holds): add configure and read `^inboxctl\\.looking\\.<queue>_error$` to mark it |",
];

/// `migrate`'s row, PostgreSQL (`{role}` is the role's quoted name).
const MIGRATE_GRANTS: &str = "GRANT CREATE ON SCHEMA public TO {role}";

/// `consume`'s row, PostgreSQL, for the consumer whose effects go to `effect_table`.
fn consume_grants(effect_table: &str) -> String {
    format!(
        "GRANT SELECT, INSERT ON inbox_messages TO {{role}};
         GRANT INSERT ON {effect_table}, inboxctl_events, inboxctl_audit TO {{role}};
         GRANT SELECT, INSERT, UPDATE ON inboxctl_consumers, inboxctl_fingerprints TO {{role}};
         GRANT SELECT, INSERT, UPDATE, DELETE ON inboxctl_attempts TO {{role}};"
    )
}

/// `cleanup`'s row, PostgreSQL.
const CLEANUP_GRANTS: &str = concat!(
    "GRANT SELECT, DELETE ON inbox_messages, inboxctl_events, inboxctl_attempts, inboxctl_fingerprints, inboxctl_audit ",
    "TO {role};",
    "GRANT SELECT ON inboxctl_consumers TO {role};",
    "GRANT INSERT ON inboxctl_audit TO {role};",
);

/// `stats`' row, PostgreSQL.
const STATS_GRANTS: &str =
    "GRANT SELECT ON inbox_messages, inboxctl_events, inboxctl_consumers TO {role}";

/// Puts in the dead-letter queue `queue` (declared if absent) a message that failed an hour ago.
async fn failed_an_hour_ago(env: &TestEnv, queue: &str) {
    let conn = env.amqp().await;
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, queue, common::queue_type())
        .await
        .unwrap();
    let mut headers = lapin::types::FieldTable::default();
    let an_hour_ago =
        inboxctl::amqp::envelope::format_time(chrono::Utc::now() - chrono::TimeDelta::hours(1));
    headers.insert(
        "MT-Fault-Timestamp".into(),
        lapin::types::AMQPValue::LongString(an_hour_ago.into_bytes().into()),
    );
    let props = BasicProperties::default()
        .with_message_id(Uuid::new_v4().to_string().into())
        .with_headers(headers);
    common::publish(&conn, "", queue, props, b"{}").await;
    let _ = conn.close(200, "OK".into()).await;
}

/// A name as a regular expression that matches it alone.
fn literal(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Configure, write and read permissions.
type Permissions = [String; 3];

fn permissions(configure: &str, write: &str, read: &str) -> Permissions {
    [configure.to_owned(), write.to_owned(), read.to_owned()]
}

/// RabbitMQ permissions written with the names of the carrier's endpoint left out (see [`expand`]).
type PermissionTemplates = [&'static str; 3];

/// `consume`'s row, RabbitMQ.
const CONSUME_PERMISSIONS: PermissionTemplates = [
    "^({q}(_error|_skipped)?|{x})$",
    "^{q}(_error|_skipped)?$",
    "^({q}(_error|_skipped)?|{x})$",
];

/// `publish`'s row, RabbitMQ: write on the event exchange, and configure too while it is absent.
const PUBLISH_PERMISSIONS: PermissionTemplates = ["", "^{x}$", ""];
const PUBLISH_PERMISSIONS_TO_DECLARE: PermissionTemplates = ["^{x}$", "^{x}$", ""];

/// `replay`'s row, RabbitMQ.
const REPLAY_PERMISSIONS: PermissionTemplates = [
    "^inboxctl\\.replaying\\.{dlq}$",
    "^amq\\.default$",
    "^{dlq}$",
];

/// `consume`'s row, RabbitMQ, for `queue` fed by the Parcel Tracker's event exchange.
fn consume_permissions(queue: &str) -> Permissions {
    CONSUME_PERMISSIONS.map(|t| expand_for(queue, t, ""))
}

/// A server `none` in the table: nothing listens on port 1, so a command that connected would fail.
const NOWHERE_PG: &str = "postgres://nobody@127.0.0.1:1/nothing";
const NOWHERE_AMQP: &str = "amqp://nobody:nothing@127.0.0.1:1/nothing";

/// `template` with the names of `queue`'s endpoint in it: `{queue}`, `{error_queue}` and `{exchange}` (the event
/// exchange) as they are, `{q}`, `{dlq}` (the error queue) and `{x}` as regular expressions matching them alone;
/// `{database}` is `database`.
fn expand_for(queue: &str, template: &str, database: &str) -> String {
    let error_queue = format!("{queue}_error");
    template
        .replace("{queue}", queue)
        .replace("{error_queue}", &error_queue)
        .replace("{exchange}", EVENT_EXCHANGE)
        .replace("{q}", &literal(queue))
        .replace("{dlq}", &literal(&error_queue))
        .replace("{x}", &literal(EVENT_EXCHANGE))
        .replace("{database}", database)
}

/// One grant (or a few, named together) taken away alone: the command is refused, names what it lacks, and changes
/// nothing. The text may name the carrier's endpoint (see [`expand_for`]).
struct Refusal {
    /// What is missing, in words.
    missing: &'static str,
    without: Without,
    /// The command.
    args: &'static [&'static str],
    /// Its exit code, and the words its stderr must hold.
    code: i32,
    names: &'static [&'static str],
    /// What is as it was after it.
    unchanged: Unchanged,
}

enum Without {
    /// SQL on the database the command uses, as the superuser, `{role}` standing for the role: the revoke (empty when
    /// the role never had it) and the grant that gives it back.
    Sql {
        revoke: &'static str,
        grant: &'static str,
    },
    /// The user's RabbitMQ permissions while the command runs, and what they are set to after.
    Permissions {
        during: PermissionTemplates,
        after: PermissionTemplates,
    },
}

enum Unchanged {
    /// Nothing to look at: refused at its start, before it touches anything.
    Nothing,
    /// A count on the database the command uses is this.
    Count(&'static str, i64),
    /// Queues' `(ready, unacknowledged)` are these.
    Queues(&'static [(&'static str, (u64, u64))]),
    /// The rows a cleanup may touch are what they were ([`census`]).
    Census,
}

/// `migrate`'s grants taken away, each on a database of its own: the test's (empty), one to create, one holding EF
/// Core's `inbox_messages` (owned by the service's role).
const MIGRATE_REFUSALS: [Refusal; 3] = [
    Refusal {
        missing: "CREATE on the schema (PUBLIC has none on PostgreSQL 15's public)",
        without: Without::Sql {
            revoke: "",
            grant: MIGRATE_GRANTS,
        },
        args: &["migrate"],
        code: 77,
        names: &["permission denied for schema public"],
        unchanged: Unchanged::Count(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace",
            0,
        ),
    },
    Refusal {
        missing: "CREATEDB, for a database to create",
        without: Without::Sql {
            revoke: "",
            grant: "ALTER ROLE {role} CREATEDB",
        },
        args: &["migrate"],
        code: 77,
        names: &["permission denied to create database"],
        unchanged: Unchanged::Count(
            "SELECT count(*) FROM pg_database WHERE datname = '{database}'",
            0,
        ),
    },
    Refusal {
        missing: "the ownership of an existing inbox_messages, for its indexes",
        without: Without::Sql {
            revoke: "",
            grant: "ALTER TABLE inbox_messages OWNER TO {role}",
        },
        args: &["migrate"],
        code: 77,
        names: &["must be owner of table inbox_messages"],
        unchanged: Unchanged::Count(
            "SELECT count(*) FROM pg_class WHERE relname LIKE 'ix_inbox_messages%'",
            0,
        ),
    },
];

/// `consume`'s grants taken away, refused at start before any delivery.
const CONSUME_REFUSALS: [Refusal; 2] = [
    Refusal {
        missing: "SELECT on inboxctl_consumers (its registration is an upsert) and INSERT on inbox_messages (the claim)",
        without: Without::Sql {
            revoke: "REVOKE SELECT ON inboxctl_consumers FROM {role}; REVOKE INSERT ON inbox_messages FROM {role}",
            grant: "GRANT SELECT ON inboxctl_consumers TO {role}; GRANT INSERT ON inbox_messages TO {role}",
        },
        args: &["consume", "carrier", "--exit-when-idle", "500ms"],
        code: 77,
        names: &[
            "lacks privileges that consume needs: INSERT on inbox_messages; SELECT on inboxctl_consumers",
            "docs/security.md",
        ],
        unchanged: Unchanged::Nothing,
    },
    Refusal {
        missing: "write on the queue (the binding to its exchange)",
        without: Without::Permissions {
            during: [
                CONSUME_PERMISSIONS[0],
                "^{q}_(error|skipped)$",
                CONSUME_PERMISSIONS[2],
            ],
            after: CONSUME_PERMISSIONS,
        },
        args: &["consume", "carrier", "--exit-when-idle", "500ms"],
        code: 77,
        names: &["ACCESS_REFUSED", "queue '{queue}'"],
        unchanged: Unchanged::Nothing,
    },
];

/// `publish`'s permissions taken away.
const PUBLISH_REFUSALS: [Refusal; 2] = [
    Refusal {
        missing: "configure on the event exchange, while it is absent",
        without: Without::Permissions {
            during: PUBLISH_PERMISSIONS,
            after: PUBLISH_PERMISSIONS_TO_DECLARE,
        },
        args: &["publish", "parcel-created", "--count", "3"],
        code: 77,
        names: &["ACCESS_REFUSED", "exchange '{exchange}'"],
        unchanged: Unchanged::Nothing,
    },
    Refusal {
        missing: "write on the event exchange, once it exists",
        without: Without::Permissions {
            during: ["", "", ""],
            after: PUBLISH_PERMISSIONS,
        },
        args: &["publish", "parcel-created", "--count", "3"],
        code: 77,
        names: &["ACCESS_REFUSED", "exchange '{exchange}'"],
        unchanged: Unchanged::Queues(&[("{queue}", (0, 0))]),
    },
];

/// `replay`'s permissions taken away, with three messages in the carrier's error queue.
const REPLAY_REFUSALS: [Refusal; 2] = [
    // The first copy is refused, and the broker closes the channel with the cause, so the replay stops there (exit
    // 1), its report naming the cause; every message is left where it is.
    Refusal {
        missing: "write on amq.default",
        without: Without::Permissions {
            during: ["", "", REPLAY_PERMISSIONS[2]],
            after: REPLAY_PERMISSIONS,
        },
        args: &["replay", "--from", "{error_queue}", "--json"],
        code: 77,
        names: &[
            "ACCESS_REFUSED - access to exchange 'amq.default'",
            "stopped after 1 of 3 messages (0 replayed)",
        ],
        unchanged: Unchanged::Queues(&[("{error_queue}", (3, 0)), ("{queue}", (0, 0))]),
    },
    Refusal {
        missing: "read on the dead-letter queue",
        without: Without::Permissions {
            during: ["", REPLAY_PERMISSIONS[1], ""],
            after: REPLAY_PERMISSIONS,
        },
        args: &["replay", "--from", "{error_queue}", "--json"],
        code: 77,
        names: &["ACCESS_REFUSED", "queue '{error_queue}'"],
        unchanged: Unchanged::Queues(&[("{error_queue}", (3, 0))]),
    },
];

/// `cleanup`'s grants taken away.
const CLEANUP_REFUSALS: [Refusal; 2] = [
    Refusal {
        missing: "DELETE on inbox_messages",
        without: Without::Sql {
            revoke: "REVOKE DELETE ON inbox_messages FROM {role}",
            grant: "GRANT DELETE ON inbox_messages TO {role}",
        },
        args: &["cleanup", "--retention", "7d", "--json"],
        code: 77,
        names: &["permission denied for table inbox_messages"],
        unchanged: Unchanged::Census,
    },
    Refusal {
        missing: "SELECT on inboxctl_consumers (where consumer_types with nothing else to show are found)",
        without: Without::Sql {
            revoke: "REVOKE SELECT ON inboxctl_consumers FROM {role}",
            grant: "GRANT SELECT ON inboxctl_consumers TO {role}",
        },
        args: &["cleanup", "--retention", "7d", "--json"],
        code: 77,
        names: &["permission denied for table inboxctl_consumers"],
        unchanged: Unchanged::Census,
    },
];

/// `stats`' grants taken away.
const STATS_REFUSALS: [Refusal; 1] = [Refusal {
    missing: "SELECT on inboxctl_events (the rates)",
    without: Without::Sql {
        revoke: "REVOKE SELECT ON inboxctl_events FROM {role}",
        grant: "GRANT SELECT ON inboxctl_events TO {role}",
    },
    args: &["stats", "--json"],
    code: 77,
    names: &["permission denied for table inboxctl_events"],
    unchanged: Unchanged::Nothing,
}];

/// Whom a test's refusals take grants from and run as, and where.
struct Subject<'a> {
    env: &'a TestEnv,
    principals: &'a Principals,
    runs_as: &'a As,
    /// The role, and the superuser's pool on the database the command uses.
    role: Option<(&'a Login, &'a PgPool)>,
    user: Option<&'a Login>,
    /// The database the command uses (`{database}`).
    database: String,
}

impl<'a> Subject<'a> {
    fn new(env: &'a TestEnv, principals: &'a Principals, runs_as: &'a As) -> Self {
        Self {
            env,
            principals,
            runs_as,
            role: None,
            user: None,
            database: env.db_name.clone(),
        }
    }

    fn role(mut self, role: &'a Login, pool: &'a PgPool) -> Self {
        self.role = Some((role, pool));
        self
    }

    fn user(mut self, user: &'a Login) -> Self {
        self.user = Some(user);
        self
    }

    fn database(mut self, database: &str) -> Self {
        database.clone_into(&mut self.database);
        self
    }

    fn expand(&self, template: &str) -> String {
        expand_for(CARRIER_QUEUE, template, &self.database)
    }

    fn pool(&self) -> &'a PgPool {
        self.role.expect("a refusal on PostgreSQL needs the role").1
    }

    /// Takes the row's grant away, runs its command, asserts it was refused as the row says and changed nothing, and
    /// gives the grant back; returns what the command printed.
    async fn refused(&self, row: &Refusal) -> Output {
        let census_before = match row.unchanged {
            Unchanged::Census => Some(census(self.pool()).await),
            _ => None,
        };
        self.set(&row.without, true).await;
        let args: Vec<String> = row.args.iter().map(|a| self.expand(a)).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.runs_as.run(self.env, &args);
        let names: Vec<String> = row.names.iter().map(|n| self.expand(n)).collect();
        assert_refused(&out, row.code, &names, row.missing);
        match &row.unchanged {
            Unchanged::Nothing => {}
            Unchanged::Count(sql, n) => {
                let sql = self.expand(sql);
                let now: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
                    .fetch_one(self.pool())
                    .await
                    .unwrap();
                assert_eq!(now, *n, "without {}: {sql}", row.missing);
            }
            Unchanged::Queues(queues) => {
                for (queue, counts) in *queues {
                    let queue = self.expand(queue);
                    assert_eq!(
                        self.env.queue_counts(&queue),
                        *counts,
                        "without {}: {queue} as it was",
                        row.missing
                    );
                }
            }
            Unchanged::Census => assert_eq!(
                Some(census(self.pool()).await),
                census_before,
                "without {}: nothing deleted",
                row.missing
            ),
        }
        self.set(&row.without, false).await;
        out
    }

    /// Takes the grant away (`during`) or gives it back.
    async fn set(&self, without: &Without, during: bool) {
        match without {
            Without::Sql {
                revoke,
                grant: give,
            } => {
                let sql = if during { revoke } else { give };
                if !sql.is_empty() {
                    let (role, pool) = self.role.expect("a refusal on PostgreSQL needs the role");
                    grant(pool, &role.name, sql).await;
                }
            }
            Without::Permissions { during: d, after } => {
                let templates = if during { d } else { after };
                let user = self.user.expect("a refusal on RabbitMQ needs the user");
                self.principals
                    .permit(user, &templates.map(|t| self.expand(t)));
            }
        }
    }
}

/// What a command runs as: a database URL and a broker URL.
struct As {
    database_url: String,
    amqp_url: String,
}

impl As {
    fn new(database_url: &str, amqp_url: &str) -> Self {
        Self {
            database_url: database_url.to_owned(),
            amqp_url: amqp_url.to_owned(),
        }
    }

    fn args<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = args.to_vec();
        all.extend_from_slice(&[
            "--database-url",
            &self.database_url,
            "--amqp-url",
            &self.amqp_url,
        ]);
        all
    }

    /// Runs inboxctl to its end with these URLs only (the test's superuser and guest URLs removed from its
    /// environment).
    fn run(&self, env: &TestEnv, args: &[&str]) -> Output {
        let out = env
            .cmd()
            .env_remove("DATABASE_URL")
            .env_remove("AMQP_URL")
            .args(self.args(args))
            .output()
            .unwrap();
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Starts inboxctl in the background with these URLs only.
    fn spawn(&self, env: &TestEnv, args: &[&str]) -> common::Proc {
        env.spawn_with(
            &self.args(args),
            &[
                ("DATABASE_URL", self.database_url.as_str()),
                ("AMQP_URL", self.amqp_url.as_str()),
            ],
        )
    }

    /// `consume` until its queue stays empty for half a second (a consumer that holds its deliveries instead is
    /// killed after 60 s, failing the test); asserts exit code 0 and returns its stderr.
    fn consume(&self, env: &TestEnv, args: &[&str]) -> String {
        let mut all = vec!["consume"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--exit-when-idle", "500ms", "--concurrency", "4"]);
        let mut consumer = self.spawn(env, &all);
        let code = consumer.wait(Duration::from_secs(60));
        assert_eq!(code, Some(0), "{}", consumer.stderr());
        consumer.stderr()
    }
}

/// A login role or a user, and the URL that logs in as it.
struct Login {
    name: String,
    url: String,
}

/// The PostgreSQL roles, RabbitMQ users and extra databases of one test; all dropped with it.
struct Principals {
    db: String,
    vhost: String,
    password: String,
    roles: Vec<String>,
    users: Vec<String>,
    databases: Vec<String>,
}

impl Principals {
    fn new(env: &TestEnv) -> Self {
        Self {
            db: env.db_name.clone(),
            vhost: env.vhost.clone(),
            password: Uuid::new_v4().simple().to_string(),
            roles: Vec::new(),
            users: Vec::new(),
            databases: Vec::new(),
        }
    }

    fn name(&self, what: &str) -> String {
        format!("{}_{what}", self.db)
    }

    /// A login role with nothing but `grants` (SQL on the test database as the superuser, `{role}` standing for
    /// the role), and its URL for the test database.
    async fn role(&mut self, admin: &PgPool, what: &str, grants: &str) -> Login {
        let name = self.name(what);
        self.roles.push(name.clone());
        execute(
            admin,
            &format!("CREATE ROLE {} LOGIN", common::quote_ident(&name)),
        )
        .await;
        if !grants.is_empty() {
            grant(admin, &name, grants).await;
        }
        Login {
            url: pg_url(&name, &self.db),
            name,
        }
    }

    /// A RabbitMQ user with a password of this run and `permissions` on the test's vhost, and its URL.
    fn user(&mut self, what: &str, permissions: &Permissions) -> Login {
        let name = self.name(what);
        common::add_user(&name, &self.password);
        self.users.push(name.clone());
        let login = Login {
            url: amqp_url(&name, &self.password, &self.vhost),
            name,
        };
        self.permit(&login, permissions);
        login
    }

    /// Sets a user's permissions on the test's vhost (replacing what it had).
    fn permit(&self, user: &Login, [configure, write, read]: &Permissions) {
        common::set_permissions(&self.vhost, &user.name, configure, write, read);
    }
}

impl Drop for Principals {
    fn drop(&mut self) {
        let psql = |db: &str, sql: &str| {
            common::report_cleanup(
                sql,
                Command::new("psql")
                    .args([&format!("{}/{db}", common::pg_base()), "-qXc", sql])
                    .output(),
            );
        };
        for db in &self.databases {
            psql(
                "postgres",
                &format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    common::quote_ident(db)
                ),
            );
        }
        if !self.roles.is_empty() {
            let roles: Vec<String> = self.roles.iter().map(|r| common::quote_ident(r)).collect();
            let roles = roles.join(", ");
            // What the roles own or were granted in the test database (it may be gone already: nothing left then).
            psql(&self.db, &format!("DROP OWNED BY {roles}"));
            psql("postgres", &format!("DROP ROLE IF EXISTS {roles}"));
        }
        for user in &self.users {
            common::delete_user(user);
        }
    }
}

fn pg_url(role: &str, db: &str) -> String {
    let mut url = url::Url::parse(&common::pg_base()).unwrap();
    url.set_username(role).unwrap();
    url.set_password(None).unwrap();
    url.set_path(&format!("/{db}"));
    url.to_string()
}

fn amqp_url(user: &str, password: &str, vhost: &str) -> String {
    let mut url = url::Url::parse(&common::amqp_base()).unwrap();
    url.set_username(user).unwrap();
    url.set_password(Some(password)).unwrap();
    url.set_path(&format!("/{vhost}"));
    url.to_string()
}

async fn execute(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Runs `grants` (GRANT or REVOKE statements, `{role}` standing for the role) on the test database.
async fn grant(admin: &PgPool, role: &str, grants: &str) {
    execute(admin, &grants.replace("{role}", &common::quote_ident(role))).await;
}

/// Inserted, updated and deleted rows of a table, as PostgreSQL's statistics count them once the sessions that
/// wrote them have reported (at the latest when they end).
async fn tuples(pool: &PgPool, table: &str) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    common::count(pool, sql).await
}

/// Asserts a command run `without` something failed (exit code `code`) with stderr naming every one of `needles`.
fn assert_refused(out: &Output, code: i32, needles: &[String], without: &str) {
    assert_eq!(out.code, Some(code), "without {without}: {out:?}");
    for needle in needles {
        assert!(
            out.stderr.contains(needle.as_str()),
            "without {without}: stderr does not name {needle:?}: {out:?}"
        );
    }
}

/// Waits until a stopped consumer's deliveries are all back on `queue`, ready.
async fn given_back(env: &TestEnv, queue: &str, messages: u64) {
    common::eventually(
        "the deliveries given back",
        Duration::from_secs(10),
        || async { env.queue_counts(queue) == (messages, 0) },
    )
    .await;
}

/// A message no consumer can read: a message id, but a body that is not JSON.
fn unreadable() -> (BasicProperties, Vec<u8>) {
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(Uuid::new_v4().to_string().into());
    (props, b"PT1;Berlin".to_vec())
}

#[test]
fn the_documented_table_is_the_one_proved_here() {
    let security =
        std::fs::read_to_string(format!("{}/docs/security.md", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
    for row in SECURITY_ROWS {
        assert!(
            security.lines().any(|l| l == row),
            "docs/security.md's table no longer has this row; prove the new one in tests/grants.rs:\n{row}"
        );
    }
    let rows = security
        .lines()
        .skip_while(|l| !l.starts_with("| command |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .count();
    assert_eq!(rows, SECURITY_ROWS.len(), "a row was added to the table");
}

/// `migrate --partitioned` needs the table's owner; the partitioned table keeps the old one's grants (a cleanup role
/// granted on the unpartitioned table goes on working); a cleanup that is not the owner cannot make or drop partitions
/// and deletes in batches instead, saying so.
#[tokio::test(flavor = "multi_thread")]
async fn partitioning_needs_the_tables_owner_and_keeps_its_grants() {
    let env = TestEnv::migrated().await;
    let admin = env.pool().await;
    let mut principals = Principals::new(&env);
    // Everything but the table's ownership: the migrations it finds applied, readable.
    let migrate_role = principals
        .role(
            &admin,
            "migrate",
            &format!("{MIGRATE_GRANTS}; GRANT SELECT ON inboxctl_migrations TO {{role}}"),
        )
        .await;
    let cleanup_role = principals.role(&admin, "cleanup", CLEANUP_GRANTS).await;

    let out =
        As::new(&migrate_role.url, NOWHERE_AMQP).run(&env, &["migrate", "--partitioned", "1d"]);
    assert_refused(&out, 77, &["owner".to_owned()], "the table's ownership");
    let layout: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'inbox_messages'::regclass",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(layout, "r", "nothing was converted");

    // A reader whose name must be quoted, and the table handed to the service's own role, so that the admin who
    // converts it (a superuser) is not its owner: both keep their rights on the partitioned table, which goes back
    // to its owner. (The reader's grant was quoted twice, and the conversion failed; the owner lost every right on
    // its inbox, and the partitioned table was the admin's.)
    let reader = principals
        .role(
            &admin,
            "Billing-Reader",
            "GRANT SELECT ON inbox_messages TO {role}",
        )
        .await;
    let service = principals
        .role(
            &admin,
            "service",
            "ALTER TABLE inbox_messages OWNER TO {role}",
        )
        .await;
    let out = env.run(&["migrate", "--partitioned", "1d"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for (role, privilege) in [
        (&reader.name, "SELECT"),
        (&service.name, "SELECT"),
        (&service.name, "INSERT"),
        (&service.name, "UPDATE"),
        (&service.name, "DELETE"),
    ] {
        let has: bool = sqlx::query_scalar("SELECT has_table_privilege($1, 'inbox_messages', $2)")
            .bind(role)
            .bind(privilege)
            .fetch_one(&admin)
            .await
            .unwrap();
        assert!(has, "{role} lost {privilege} on the partitioned inbox");
    }
    let reader_has_insert: bool =
        sqlx::query_scalar("SELECT has_table_privilege($1, 'inbox_messages', 'INSERT')")
            .bind(&reader.name)
            .fetch_one(&admin)
            .await
            .unwrap();
    assert!(!reader_has_insert, "nothing more than it had");
    // The partitioned table and its partitions handed over to the owner (only the owner makes partitions ahead).
    let owners: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT pg_get_userbyid(c.relowner)::text FROM pg_class c
         WHERE c.oid = 'inbox_messages'::regclass
            OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'inbox_messages'::regclass)",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        owners,
        std::slice::from_ref(&service.name),
        "the table and its partitions are the service's"
    );

    // A row of nine days ago in its own partition, processed then.
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    let now = chrono::Utc::now();
    inboxctl::db::partitions::ensure_partitions(
        &mut db.connect().await.unwrap(),
        inboxctl::db::partitions::Settings {
            interval: chrono::TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        },
        now - chrono::TimeDelta::days(10),
        now,
    )
    .await
    .unwrap();
    execute(
        &admin,
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time)
         VALUES (gen_random_uuid(), 'alpha', now() - interval '9 days', now() - interval '9 days',
                 now() - interval '9 days')",
    )
    .await;
    // The newest partition ahead gone, for the cleanup to make again: it may not, and says what follows.
    let newest: String = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname <> 'inbox_messages_untimed'
         ORDER BY c.relname DESC LIMIT 1",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    execute(
        &admin,
        &format!("DROP TABLE {}", common::quote_ident(&newest)),
    )
    .await;
    let out = As::new(&cleanup_role.url, NOWHERE_AMQP)
        .run(&env, &["cleanup", "--retention", "7d", "--force", "--json"]);
    assert!(
        out.stderr
            .contains("every message is refused as unclaimable"),
        "{out:?}"
    );
    assert_eq!(
        out.code,
        Some(0),
        "the grants on the old table carried over: {out:?}"
    );
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(
        report["partitions"]["refused"]
            .as_str()
            .is_some_and(|r| r.contains("must be owner") || r.contains("permission denied")),
        "{report:#}"
    );
    assert_eq!(
        report["deleted"], 1,
        "deleted in batches instead: {report:#}"
    );
    assert!(
        out.stderr
            .contains("deleting the old rows in batches instead"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_needs_create_on_the_schema_createdb_to_create_and_ownership_to_adopt() {
    let env = TestEnv::empty().await;
    let admin = env.pool().await;
    let mut principals = Principals::new(&env);
    let role = principals.role(&admin, "migrate", "").await;
    let migrate = As::new(&role.url, NOWHERE_AMQP);
    let new_db = format!("{}_made", env.db_name);
    let adopt_db = format!("{}_ef", env.db_name);
    principals
        .databases
        .extend([new_db.clone(), adopt_db.clone()]);
    let [without_create, without_createdb, not_owner] = &MIGRATE_REFUSALS;

    // Without CREATE on the schema: named, and nothing is created; with it, the migrations.
    Subject::new(&env, &principals, &migrate)
        .role(&role, &admin)
        .refused(without_create)
        .await;
    let out = migrate.run(&env, &["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let migrations = inboxctl::db::schema::migrator().iter().count();
    assert_eq!(
        out.stdout.matches("applied ").count(),
        migrations,
        "{out:?}"
    );
    let out = migrate.run(&env, &["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("up to date"), "{out:?}");

    // A database to create: CREATEDB, and only then.
    let new_db = format!("{}_made", env.db_name);
    principals.databases.push(new_db.clone());
    let exists = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
        )
        .bind(&new_db)
        .fetch_one(&admin)
        .await
        .unwrap()
    };
    let create = As::new(&pg_url(&role.name, &new_db), NOWHERE_AMQP);
    Subject::new(&env, &principals, &create)
        .role(&role, &admin)
        .database(&new_db)
        .refused(without_createdb)
        .await;
    assert!(!exists().await);
    let out = create.run(&env, &["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("created"), "{out:?}");
    assert!(exists().await);
    execute(
        &admin,
        &format!("ALTER ROLE {} NOCREATEDB", common::quote_ident(&role.name)),
    )
    .await;

    // An existing inbox_messages (EF Core's, owned by the service's role): its indexes need the table's owner.
    execute(
        &admin,
        &format!("CREATE DATABASE {}", common::quote_ident(&adopt_db)),
    )
    .await;
    let ef = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}/{adopt_db}", common::pg_base()))
        .await
        .unwrap();
    execute(
        &ef,
        "CREATE TABLE inbox_messages (
             id uuid NOT NULL, consumer_type varchar(500) NOT NULL,
             received_at timestamptz NOT NULL, processed_at timestamptz NULL,
             CONSTRAINT \"PK_inbox_messages\" PRIMARY KEY (id, consumer_type));
         INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'billing', now(), now());",
    )
    .await;
    grant(&ef, &role.name, MIGRATE_GRANTS).await;
    let adopt = As::new(&pg_url(&role.name, &adopt_db), NOWHERE_AMQP);
    Subject::new(&env, &principals, &adopt)
        .role(&role, &ef)
        .database(&adopt_db)
        .refused(not_owner)
        .await;
    let out = adopt.run(&env, &["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("compatible"), "{out:?}");
    assert_eq!(
        count(&ef, "SELECT count(*) FROM inbox_messages").await,
        1,
        "the service's rows are kept"
    );
    ef.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn consume_with_exactly_its_grants_takes_every_message_once_and_moves_bad_ones_aside() {
    let env = TestEnv::migrated().await;
    let admin = env.pool().await;
    let amqp = env.amqp().await;
    let mut principals = Principals::new(&env);
    let carrier_role = principals
        .role(&admin, "carrier", &consume_grants("carrier_reservations"))
        .await;
    let notification_role = principals
        .role(
            &admin,
            "notification",
            &consume_grants("notifications_sent"),
        )
        .await;
    let carrier_user = principals.user("carrier", &consume_permissions(CARRIER_QUEUE));
    let notification_user =
        principals.user("notification", &consume_permissions(NOTIFICATION_QUEUE));
    let carrier = As::new(&carrier_role.url, &carrier_user.url);
    let notification = As::new(&notification_role.url, &notification_user.url);
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let skipped_queue = format!("{CARRIER_QUEUE}_skipped");

    // Refused at start, before any delivery, each missing privilege named.
    let subject = Subject::new(&env, &principals, &carrier)
        .role(&carrier_role, &admin)
        .user(&carrier_user);
    for row in &CONSUME_REFUSALS {
        subject.refused(row).await;
    }
    let [configure, write, read] = consume_permissions(CARRIER_QUEUE);
    let q = literal(CARRIER_QUEUE);

    // Exactly the grants: each consumer declares what is missing of its topology.
    carrier.consume(&env, &["carrier"]);
    notification.consume(&env, &["notification"]);

    // INSERT on inbox_messages (the claim) taken away under a running consumer: deliveries are held with the cause
    // named, nothing is acked or written, and a stop gives them all back.
    let mut held = carrier.spawn(
        &env,
        &[
            "consume",
            "carrier",
            "--concurrency",
            "4",
            "--shutdown-timeout",
            "5s",
        ],
    );
    held.wait_for_stderr("consuming", Duration::from_secs(30));
    grant(
        &admin,
        &carrier_role.name,
        "REVOKE INSERT ON inbox_messages FROM {role}",
    )
    .await;
    common::publish_parcels(&env, &["--count", "5"]);
    // The one-statement claim's failure is logged first (it names the same error); the message then goes the usual
    // way, and that attempt's failure is the one said for what it is.
    held.wait_for_stderr(
        "PostgreSQL refuses the inbox's own statements (a grant or the schema",
        Duration::from_secs(30),
    );
    assert!(
        held.stderr()
            .contains("permission denied for table inbox_messages"),
        "the cause named: {}",
        held.stderr()
    );
    assert!(
        !held.stderr().contains("PostgreSQL unavailable"),
        "said for what it is, not as an outage: {}",
        held.stderr()
    );
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 5, "nothing acked");
    held.terminate();
    assert_eq!(
        held.wait(Duration::from_secs(20)),
        Some(0),
        "{}",
        held.stderr()
    );
    given_back(&env, CARRIER_QUEUE, 5).await;
    assert_eq!(
        count(&admin, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert_eq!(
        count(&admin, "SELECT count(*) FROM carrier_reservations").await,
        0
    );
    grant(
        &admin,
        &carrier_role.name,
        "GRANT INSERT ON inbox_messages TO {role}",
    )
    .await;

    // Exactly the grants: the five come back redelivered, so their starts are counted in inboxctl_attempts (an
    // upsert returning the count, hence SELECT) and the counts deleted once they are through. A count that cannot be
    // kept is logged at debug level only, so -v, and no such line.
    let stderr = carrier.consume(&env, &["carrier", "-v"]);
    for silent in [
        "redelivery not counted",
        "redelivery count not kept",
        "could not record",
    ] {
        assert!(!stderr.contains(silent), "{silent}: {stderr}");
    }
    common::eventually(
        "five starts counted in inboxctl_attempts, and deleted",
        Duration::from_secs(10),
        || async { tuples(&admin, "inboxctl_attempts").await == (5, 0, 5) },
    )
    .await;
    assert_eq!(
        count(&admin, "SELECT count(*) FROM carrier_reservations").await,
        5
    );

    // Batched, with copies, a failing carrier (its members left out of their batch's commit), an unreadable message
    // (to the error queue) and a message of another type (to the skipped queue).
    let published = common::publish_parcels(&env, &["--count", "20", "--duplicates", "0.25"]);
    let copies = published["duplicates"].as_i64().unwrap();
    assert!(copies > 0, "{published}");
    common::publish_parcels(&env, &["--count", "2", "--destination", "Atlantis"]);
    let (props, body) = unreadable();
    common::publish(&amqp, CARRIER_QUEUE, "", props, &body).await;
    let unhandled = common::fixture("sent/sent-02.json");
    common::publish(
        &amqp,
        CARRIER_QUEUE,
        "",
        unhandled.properties.clone(),
        &unhandled.body,
    )
    .await;
    carrier.consume(
        &env,
        &[
            "carrier",
            "--batch-size",
            "8",
            "--fail-destination",
            "Atlantis",
            "--max-attempts",
            "1",
        ],
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    assert_eq!(env.queue_counts(&error_queue), (3, 0));
    assert_eq!(env.queue_counts(&skipped_queue), (1, 0));
    // The failing members' batches were done again without them (no DELETE: the role has none), and they left no
    // row.
    let without_effect: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox_messages m WHERE m.consumer_type = $1 \
         AND NOT EXISTS (SELECT 1 FROM carrier_reservations r WHERE r.message_id = m.id)",
    )
    .bind(CARRIER_QUEUE)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(
        without_effect, 0,
        "no inbox row without its effect: none is a failing member's"
    );
    assert_eq!(
        tuples(&admin, "inbox_messages").await.2,
        0,
        "nothing deleted"
    );
    let events: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM inboxctl_events WHERE consumer_type = $1 GROUP BY kind ORDER BY kind",
    )
    .bind(CARRIER_QUEUE)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        events,
        [
            ("dead_lettered".to_owned(), 3),
            ("duplicate".to_owned(), copies),
            ("failed".to_owned(), 2),
            ("skipped".to_owned(), 1),
        ]
    );

    // Without grants on inboxctl_attempts: redelivered messages cannot have their starts counted, so poison-message
    // detection is off. Said at start, and once when it happens; the messages are processed all the same. (Two
    // messages made redelivered the way the claim's missing grant did above.)
    grant(
        &admin,
        &carrier_role.name,
        "REVOKE ALL ON inboxctl_attempts FROM {role}",
    )
    .await;
    let mut held = carrier.spawn(&env, &["consume", "carrier", "--shutdown-timeout", "5s"]);
    held.wait_for_stderr("consuming", Duration::from_secs(30));
    assert!(
        held.stderr().contains(
            "the role lacks privileges on inboxctl_attempts: poison-message detection is off"
        ),
        "{}",
        held.stderr()
    );
    grant(
        &admin,
        &carrier_role.name,
        "REVOKE INSERT ON inbox_messages FROM {role}",
    )
    .await;
    common::publish_parcels(&env, &["--count", "2"]);
    held.wait_for_stderr(
        "permission denied for table inbox_messages",
        Duration::from_secs(30),
    );
    held.terminate();
    assert_eq!(
        held.wait(Duration::from_secs(20)),
        Some(0),
        "{}",
        held.stderr()
    );
    given_back(&env, CARRIER_QUEUE, 2).await;
    grant(
        &admin,
        &carrier_role.name,
        "GRANT INSERT ON inbox_messages TO {role}",
    )
    .await;
    let before = count(&admin, "SELECT count(*) FROM carrier_reservations").await;
    let stderr = carrier.consume(&env, &["carrier"]);
    assert_eq!(
        stderr.matches("redelivery not counted").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("permission denied for table inboxctl_attempts")
            && stderr.contains("poison-message detection is off"),
        "{stderr}"
    );
    assert_eq!(
        count(&admin, "SELECT count(*) FROM carrier_reservations").await,
        before + 2
    );
    grant(
        &admin,
        &carrier_role.name,
        "GRANT SELECT, INSERT, UPDATE, DELETE ON inboxctl_attempts TO {role}",
    )
    .await;

    // Without read on the dead-letter exchange (its binding to its queue, at first use): the copy is refused with
    // the cause named, and the message stays on its queue.
    principals.permit(
        &carrier_user,
        &permissions(
            &configure,
            &write,
            &format!("^({q}|{})$", literal(EVENT_EXCHANGE)),
        ),
    );
    let (props, body) = unreadable();
    common::publish(&amqp, CARRIER_QUEUE, "", props, &body).await;
    let mut refused = carrier.spawn(
        &env,
        &[
            "consume",
            "carrier",
            "--concurrency",
            "4",
            "--shutdown-timeout",
            "5s",
        ],
    );
    refused.wait_for_stderr(
        &format!("could not move a message to {error_queue}"),
        Duration::from_secs(30),
    );
    assert!(
        refused.stderr().contains(&format!(
            "ACCESS_REFUSED - access to exchange '{error_queue}'"
        )),
        "{}",
        refused.stderr()
    );
    refused.terminate();
    assert_eq!(
        refused.wait(Duration::from_secs(20)),
        Some(0),
        "{}",
        refused.stderr()
    );
    given_back(&env, CARRIER_QUEUE, 1).await;
    assert_eq!(env.queue_counts(&error_queue), (3, 0));

    // Configure is only for declaring what is absent: with everything there, none is needed.
    principals.permit(&carrier_user, &permissions("", &write, &read));
    carrier.consume(&env, &["carrier"]);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    assert_eq!(env.queue_counts(&error_queue), (4, 0));

    // Every parcel once, in both consumers.
    let parcels = 5 + 20 + 2;
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!((rows, distinct), (parcels, parcels));
    notification.consume(&env, &["notification"]);
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM notifications_sent")
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!(
        (rows, distinct),
        (parcels + 2, parcels + 2),
        "the two Atlantis parcels too"
    );
    assert_eq!(env.queue_counts(NOTIFICATION_QUEUE), (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_needs_write_on_the_event_exchange_and_configure_only_to_declare_it() {
    let env = TestEnv::bare().await;
    let mut principals = Principals::new(&env);
    let user = principals.user(
        "publish",
        &PUBLISH_PERMISSIONS.map(|t| expand_for(CARRIER_QUEUE, t, "")),
    );
    let publish = As::new(NOWHERE_PG, &user.url);
    let subject = Subject::new(&env, &principals, &publish).user(&user);
    let [without_configure, without_write] = &PUBLISH_REFUSALS;

    // The exchange is absent: declaring it needs configure.
    subject.refused(without_configure).await;
    let out = publish.run(
        &env,
        &["publish", "parcel-created", "--count", "3", "--json"],
    );
    assert_eq!(
        out.code,
        Some(3),
        "declared, but no queue is bound yet: {out:?}"
    );

    // It exists (and the consumers' queues are bound): write alone.
    common::ensure_endpoints(&env).await;
    subject.refused(without_write).await;
    let out = publish.run(
        &env,
        &["publish", "parcel-created", "--count", "10", "--json"],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (10, 0));
    assert_eq!(env.queue_counts(NOTIFICATION_QUEUE), (10, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_needs_read_on_the_dead_letter_queue_and_write_on_the_default_exchange() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::publish_parcels(&env, &["--count", "3", "--destination", "Atlantis"]);
    common::consume_until_idle(
        &env,
        &[
            "carrier",
            "--fail-destination",
            "Atlantis",
            "--max-attempts",
            "1",
        ],
    );
    assert_eq!(env.queue_counts(&error_queue), (3, 0));

    let mut principals = Principals::new(&env);
    let full = REPLAY_PERMISSIONS.map(|t| expand_for(CARRIER_QUEUE, t, ""));
    let user = principals.user("replay", &permissions("", "", &full[2]));
    let replay = As::new(NOWHERE_PG, &user.url);
    let args = ["replay", "--from", error_queue.as_str(), "--json"];

    // Without write on amq.default, or read on the dead-letter queue: refused, every message left where it is.
    let subject = Subject::new(&env, &principals, &replay).user(&user);
    let mut refused = Vec::new();
    for row in &REPLAY_REFUSALS {
        refused.push(subject.refused(row).await);
    }
    // Without write, the report names the cause of the refused first copy.
    let out = &refused[0];
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["replayed"], 0, "{report}");
    assert_eq!(report["left"], 1, "{report}");
    assert_eq!(report["connection_lost"], false, "{report}");
    let first = report["items"][0]["error"].as_str().unwrap_or_default();
    assert!(
        first.contains("ACCESS_REFUSED - access to exchange 'amq.default'"),
        "{report}"
    );

    // Exactly the grants: all three go back to their queue, and the consumer takes each once; the replay marked on
    // the broker (without configure on the marker, the refusals above went on, saying so).
    for out in &refused {
        assert!(
            out.stderr.contains("not marked on the broker"),
            "{}",
            out.stderr
        );
    }
    let out = replay.run(&env, &args);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stderr.contains("not marked"), "{}", out.stderr);
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(env.queue_counts(&error_queue), (0, 0));
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (3, 0));
    common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, distinct), (3, 3));
}

/// Rows per (table, state): what a cleanup may and may not touch.
async fn census(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT 'inbox ' || consumer_type || CASE WHEN processed_at IS NULL THEN ' unprocessed' ELSE '' END
                || CASE WHEN received_at < now() - interval '7 days' THEN ' old' ELSE ' new' END, count(*)
         FROM inbox_messages GROUP BY 1
         UNION ALL
         SELECT 'events ' || CASE WHEN occurred_at < now() - interval '7 days' THEN 'old' ELSE 'new' END, count(*)
         FROM inboxctl_events GROUP BY 1
         UNION ALL
         SELECT 'attempts ' || CASE WHEN last_started_at < now() - interval '7 days' THEN 'old' ELSE 'new' END,
                count(*)
         FROM inboxctl_attempts GROUP BY 1
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_needs_select_and_delete_and_read_on_the_dead_letter_queues() {
    let env = TestEnv::migrated().await;
    let admin = env.pool().await;
    execute(
        &admin,
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         SELECT gen_random_uuid(), ct, now() - age, CASE WHEN stuck THEN NULL ELSE now() - age END
         FROM (VALUES ('alpha', interval '8 days', false, 30), ('alpha', interval '1 hour', false, 10),
                      ('alpha', interval '9 days', true, 4), ('beta', interval '8 days', false, 20))
              AS s(ct, age, stuck, n),
              generate_series(1, n);
         INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
         SELECT ct, 'duplicate', gen_random_uuid(), now() - age
         FROM (VALUES ('alpha', interval '8 days', 5), ('alpha', interval '1 hour', 2),
                      ('gamma', interval '8 days', 3)) AS s(ct, age, n),
              generate_series(1, n);
         INSERT INTO inboxctl_attempts (consumer_type, message_id, started, last_started_at)
         SELECT 'alpha', gen_random_uuid(), 1, now() - age
         FROM (VALUES (interval '8 days'), (interval '8 days'), (interval '1 hour')) AS s(age);
         INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at)
         VALUES ('gamma', 'gamma-queue', now(), now());",
    )
    .await;
    // gamma's error queue holds a message that failed an hour ago, well inside the window: the cleanup must look at
    // it (read) to know that.
    failed_an_hour_ago(&env, "gamma-queue_error").await;

    let mut principals = Principals::new(&env);
    let role = principals.role(&admin, "cleanup", CLEANUP_GRANTS).await;
    let user = principals.user(
        "cleanup",
        &permissions(
            r"^inboxctl\.looking\.gamma-queue(_error|_skipped)$",
            "",
            r"^(inboxctl\.looking\.)?gamma-queue(_error|_skipped)$",
        ),
    );
    let cleanup = As::new(&role.url, &user.url);
    let args = ["cleanup", "--retention", "7d", "--json"];
    let before = census(&admin).await;

    // Without the broker, or without read on the dead-letter queue: refused, nothing deleted; --force cleans without
    // looking (proved on the superuser's side by tests/cleanup.rs).
    let nowhere = As::new(&role.url, NOWHERE_AMQP).run(&env, &args);
    assert_refused(&nowhere, 69, &["RabbitMQ".to_owned()], "a broker");
    let unread = principals.user("cleanup-unread", &permissions("", "", ""));
    let unread = As::new(&role.url, &unread.url).run(&env, &args);
    assert_refused(
        &unread,
        77,
        &["gamma-queue_error".to_owned()],
        "read on gamma-queue_error",
    );
    assert_eq!(
        census(&admin).await,
        before,
        "a refused cleanup deleted something"
    );

    // Without configure and read on its look's marker: it looks unmarked, and says so (a dry run: nothing deleted).
    let unmarked = principals.user(
        "cleanup-unmarked",
        &permissions("", "", "^gamma-queue(_error|_skipped)$"),
    );
    let unmarked =
        As::new(&role.url, &unmarked.url).run(&env, &["cleanup", "--retention", "7d", "--dry-run"]);
    assert_eq!(unmarked.code, Some(0), "{unmarked:?}");
    assert!(
        unmarked.stderr.contains("could not be marked"),
        "{unmarked:?}"
    );

    // Without DELETE on inbox_messages, or SELECT on inboxctl_consumers: refused, nothing deleted.
    let subject = Subject::new(&env, &principals, &cleanup).role(&role, &admin);
    for row in &CLEANUP_REFUSALS {
        subject.refused(row).await;
    }

    // Exactly the grants: the processed rows, events and start counts past the window go; the message looked at
    // is back in its queue, and the run is audited.
    let out = cleanup.run(&env, &args);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stderr.contains("audit"), "{out:?}");
    assert!(
        !out.stderr.contains("could not be marked"),
        "its look marked: {out:?}"
    );
    assert_eq!(env.queue_counts("gamma-queue_error"), (1, 0));
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(report["deleted"], 50, "{report}");
    assert_eq!(report["events_deleted"], 8, "{report}");
    assert_eq!(report["attempts_deleted"], 2, "{report}");
    // The row's grants hold none on inboxctl_effects: the records of done calls are left, and the report says so.
    assert!(
        report["effects_left"]
            .as_str()
            .is_some_and(|why| why.contains("SELECT, DELETE")),
        "{report}"
    );
    let after: Vec<(String, i64)> = census(&admin).await;
    assert_eq!(
        after,
        [
            ("attempts new".to_owned(), 1),
            ("events new".to_owned(), 2),
            ("inbox alpha new".to_owned(), 10),
            ("inbox alpha unprocessed old".to_owned(), 4),
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_needs_select_and_only_access_to_the_vhost() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "4", "--duplicates", "0.5"]);
    common::consume_until_idle(&env, &["carrier"]);
    common::consume_until_idle(&env, &["notification"]);
    common::publish_parcels(&env, &["--count", "2"]);
    // The carrier's error queue holds a message that failed an hour ago: its age is read by looking at it (read).
    let error_queue = format!("{CARRIER_QUEUE}_error");
    failed_an_hour_ago(&env, &error_queue).await;
    let admin = env.pool().await;
    let mut principals = Principals::new(&env);
    let role = principals.role(&admin, "stats", STATS_GRANTS).await;
    let user = principals.user("stats", &permissions("", "", "^.*_error$"));
    let stats = As::new(&role.url, &user.url);
    let figures = |out: &Output, consumer_type: &str| -> serde_json::Value {
        let json: serde_json::Value =
            serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        json["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer_type"] == consumer_type)
            .cloned()
            .unwrap_or_else(|| panic!("no {consumer_type} figures: {out:?}"))
    };
    let carrier = |out: &Output| figures(out, CARRIER_QUEUE);

    // Exactly the grants: every figure, the queues' depths and the age of the oldest failure included.
    let out = stats.run(&env, &["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("\"broker_error\":null"), "{out:?}");
    let c = carrier(&out);
    assert_eq!(c["rows"], 4, "{c}");
    assert_eq!(c["unprocessed"], 0, "{c}");
    assert!(c["duplicates_per_second"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(c["queue"]["ready"], 2, "{c}");
    assert_eq!(c["queue"]["consumers"], 0, "{c}");
    assert_eq!(c["error_queue"]["ready"], 1, "{c}");
    let age = c["oldest_dead_letter_seconds"].as_f64().unwrap_or_default();
    assert!((3500.0..3700.0).contains(&age), "{c}");

    // Without read on the error queues: that age unknown, and why; every other figure, the next consumer_type's
    // queue included (one refused look used to end the broker's part there).
    let unread = principals.user("stats-unread", &permissions("", "", ""));
    let out = As::new(&role.url, &unread.url).run(&env, &["stats", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stdout.contains(&format!(
            "the oldest message of {error_queue} could not be looked at"
        )),
        "{out:?}"
    );
    let c = carrier(&out);
    assert!(c["oldest_dead_letter_seconds"].is_null(), "{c}");
    assert_eq!(c["error_queue"]["ready"], 1, "{c}");
    let n = figures(&out, NOTIFICATION_QUEUE);
    assert_eq!(n["queue"]["ready"], 2, "{n}");
    assert_eq!(n["error_queue"]["ready"], 0, "{n}");
    assert_eq!(env.queue_counts(&error_queue), (1, 0), "given back");

    // Without SELECT on inboxctl_events (the rates): refused.
    let subject = Subject::new(&env, &principals, &stats)
        .role(&role, &admin)
        .user(&user);
    for row in &STATS_REFUSALS {
        subject.refused(row).await;
    }

    // Without access to the vhost: the database's figures, the queues' unknown, and why.
    common::clear_permissions(&env.vhost, &user.name);
    let out = stats.run(&env, &["stats", "--json"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stderr
            .contains(&format!("access to vhost '{}' refused", env.vhost)),
        "{out:?}"
    );
    let c = carrier(&out);
    assert_eq!(c["rows"], 4, "{c}");
    assert!(c["queue"]["ready"].is_null(), "{c}");

    // `top`'s detail view under the same role, which may not read the audit: the rest of it shown, the audit's part
    // saying why not (the whole view used to fail on it).
    let pool = sqlx::PgPool::connect(&role.url).await.unwrap();
    let detail =
        inboxctl::triage::detail::load(&pool, None, &env.vhost, CARRIER_QUEUE, CARRIER_QUEUE)
            .await
            .expect("the detail, the audit's part aside");
    let why = detail.audit.expect_err("the audit may not be read");
    assert!(why.contains("inboxctl_audit"), "{why}");
}
