//! `inboxctl migrate` against real PostgreSQL: a fresh database, twice, twice at once, over EF Core's table, over
//! incompatible tables.

use crate::common;

use common::TestEnv;
use sqlx::PgPool;
use std::time::Duration;

const EF_CORE_DDL: &str = include_str!("fixtures/interop/efcore/ef_create_script.sql");

/// Everything a test can see of a schema: tables, columns with types, constraints, indexes.
async fn schema_snapshot(pool: &PgPool) -> Vec<String> {
    let mut rows: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s.%s %s%s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                       CASE WHEN a.attnotnull THEN ' not null' ELSE '' END)
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
         WHERE n.nspname = 'public' AND c.relkind = 'r'
         UNION ALL SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
           WHERE connamespace = 'public'::regnamespace
         UNION ALL SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.sort();
    rows
}

fn migrations() -> usize {
    inboxctl::db::schema::migrator().iter().count()
}

async fn tables(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn database_exists(name: &str) -> bool {
    let admin = common::admin_pool().await;
    let exists = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&admin)
        .await
        .unwrap();
    admin.close().await;
    exists
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fresh_database_is_created_and_gets_the_schema() {
    let env = TestEnv::bare().await;
    assert!(!database_exists(&env.db_name).await);

    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains(&format!("database {}: created", env.db_name)),
        "{}",
        out.stdout
    );
    assert_eq!(
        out.stdout.matches("applied ").count(),
        migrations(),
        "{}",
        out.stdout
    );

    let pool = env.pool().await;
    assert_eq!(
        tables(&pool).await,
        [
            "carrier_reservations",
            "inbox_messages",
            "inboxctl_attempts",
            "inboxctl_audit",
            "inboxctl_consumers",
            "inboxctl_effects",
            "inboxctl_events",
            "inboxctl_fingerprints",
            "inboxctl_migrations",
            "notifications_sent"
        ]
    );
    let snapshot = schema_snapshot(&pool).await;
    for expected in [
        "inbox_messages.id uuid not null",
        "inbox_messages.consumer_type character varying(500) not null",
        "inbox_messages.received_at timestamp with time zone not null",
        "inbox_messages.processed_at timestamp with time zone",
        "constraint pk_inbox_messages PRIMARY KEY (id, consumer_type)",
        "index CREATE INDEX ix_inbox_messages_unprocessed ON public.inbox_messages USING btree (received_at) WHERE (processed_at IS NULL)",
        "index CREATE INDEX ix_inbox_messages_consumer_type_processed_at ON public.inbox_messages USING btree (consumer_type, processed_at)",
    ] {
        assert!(
            snapshot.iter().any(|s| s == expected),
            "missing {expected:?} in {snapshot:#?}"
        );
    }
    // No unique constraint on the effects' parcel ids: a double effect must stay countable.
    assert!(
        !snapshot
            .iter()
            .any(|s| s.contains("UNIQUE") && s.contains("parcel_id")),
        "{snapshot:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_run_has_nothing_to_do_and_changes_nothing() {
    let env = TestEnv::bare().await;
    assert_eq!(env.run(&["migrate"]).code, Some(0));
    let pool = env.pool().await;
    let before = schema_snapshot(&pool).await;

    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stdout.trim(),
        format!("database {}: up to date, nothing to apply", env.db_name)
    );
    assert_eq!(schema_snapshot(&pool).await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_runs_at_once_apply_each_migration_once() {
    for _ in 0..3 {
        let env = TestEnv::bare().await;
        let mut a = env.spawn(&["migrate"]);
        let mut b = env.spawn(&["migrate"]);
        assert_eq!(
            a.wait(std::time::Duration::from_secs(60)),
            Some(0),
            "{}",
            a.stderr()
        );
        assert_eq!(
            b.wait(std::time::Duration::from_secs(60)),
            Some(0),
            "{}",
            b.stderr()
        );
        let applied =
            a.stdout().matches("applied ").count() + b.stdout().matches("applied ").count();
        assert_eq!(
            applied,
            migrations(),
            "a:\n{}\nb:\n{}",
            a.stdout(),
            b.stdout()
        );
        let created =
            a.stdout().matches(": created").count() + b.stdout().matches(": created").count();
        assert_eq!(created, 1, "a:\n{}\nb:\n{}", a.stdout(), b.stdout());
        let pool = env.pool().await;
        let versions: i64 = common::count(&pool, "SELECT count(*) FROM inboxctl_migrations").await;
        assert_eq!(versions, migrations() as i64);
        pool.close().await;
    }
}

/// A migrate stopped by a signal (here while it waits for another run's lock) ends partial, exit 3, and says so in the
/// audit: it left no row there, and an operator reading the audit could not account for the run.
#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_migrate_is_audited_as_partial() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // Another migrate's lock, held on a session of its own.
    let mut other = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(0x696e_626f_7863_746c_i64)
        .execute(&mut *other)
        .await
        .unwrap();
    let mut migrate = env.spawn(&["migrate"]);
    migrate.wait_for_stderr("another migrate is running", Duration::from_secs(30));
    migrate.terminate();
    assert_eq!(
        migrate.wait(Duration::from_secs(30)),
        Some(3),
        "{}",
        migrate.stderr()
    );
    assert!(
        migrate.stderr().contains("interrupted"),
        "{}",
        migrate.stderr()
    );
    let (outcome, exit_code, details): (String, i32, serde_json::Value) = sqlx::query_as(
        "SELECT outcome, exit_code, details FROM inboxctl_audit \
         WHERE command = 'migrate' ORDER BY occurred_at DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((outcome.as_str(), exit_code), ("partial", 3), "{details}");
    assert_eq!(details["interrupted"], true, "{details}");
    assert_eq!(details["database"], env.db_name, "{details}");
}

/// A write transaction left open on the inbox (a service's, slow, or idle in its transaction).
async fn an_open_write_transaction(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut open = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'slow', now(), NULL)")
        .execute(&mut *open)
        .await
        .unwrap();
    open
}

/// Until another session of the database waits for a lock (the migrate's, behind the open transaction).
async fn waiting_for_a_lock(pool: &PgPool) {
    common::eventually(
        "a session waiting for a lock",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND pid <> pg_backend_pid())",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
}

/// An adopted inbox without the first migration's index (EF Core's under another name, say): the migration's own
/// `CREATE INDEX` built it holding the table against every insert for the whole build, and, queued behind a write
/// transaction still open, stopped every claim until that one ended. It is built concurrently first now: while an
/// open transaction holds the table, another session's insert goes through, and the migration then finds the index.
#[tokio::test(flavor = "multi_thread")]
async fn adopting_a_table_without_the_unprocessed_index_does_not_block_inserts() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    sqlx::raw_sql(
        "DROP INDEX ix_inbox_messages_unprocessed;
         CREATE INDEX \"IX_inbox_messages_received_at\" ON inbox_messages (received_at) WHERE processed_at IS NULL;",
    )
    .execute(&pool)
    .await
    .unwrap();
    // A write transaction left open (a service's, slow).
    let open = an_open_write_transaction(&pool).await;
    let mut migrate = env.spawn(&["migrate"]);
    // Until the migration waits on the open transaction (for its lock, or for the concurrent build's snapshot).
    waiting_for_a_lock(&pool).await;
    // Another session's claim meanwhile: it must not queue behind the migration's lock.
    let mut other = pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '3s'")
        .execute(&mut *other)
        .await
        .unwrap();
    let claimed = sqlx::query(
        "INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'carrier', now(), now())",
    )
    .execute(&mut *other)
    .await;
    assert!(
        claimed.is_ok(),
        "the insert waited on the migration: {claimed:?}"
    );
    drop(other);
    open.commit().await.unwrap();
    assert_eq!(
        migrate.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        migrate.stderr()
    );
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'ix_inbox_messages_unprocessed'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid);
}

/// An adopted inbox that has the first migration's index (EF Core's script makes it): the migration changes nothing,
/// but its `CREATE INDEX IF NOT EXISTS` takes the table's SHARE lock before it looks. Behind a write transaction left
/// open, it held every other session's insert for as long as that transaction lasted. It waits a moment at a time
/// now, says what it waits for, and the inserts go through between.
#[tokio::test(flavor = "multi_thread")]
async fn adopting_a_table_behind_an_open_write_transaction_holds_other_writes_back_a_moment_at_most()
 {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    // A write transaction left open (a service's, slow, or idle in its transaction).
    let open = an_open_write_transaction(&pool).await;
    let mut migrate = env.spawn(&["migrate"]);
    waiting_for_a_lock(&pool).await;
    // Other sessions' claims meanwhile, for three seconds: none waits for the open transaction's end.
    let mut other = pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '3s'")
        .execute(&mut *other)
        .await
        .unwrap();
    for _ in 0..6 {
        let claimed = sqlx::query(
            "INSERT INTO inbox_messages VALUES (gen_random_uuid(), 'carrier', now(), now())",
        )
        .execute(&mut *other)
        .await;
        assert!(
            claimed.is_ok(),
            "the insert waited on the migration: {claimed:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(other);
    assert_eq!(
        migrate.try_wait(),
        None,
        "migrate ended while the table was held: {}",
        migrate.stderr()
    );
    open.commit().await.unwrap();
    assert_eq!(
        migrate.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        migrate.stderr()
    );
    assert!(
        migrate
            .stderr()
            .contains("inbox_messages is held by transactions still open"),
        "{}",
        migrate.stderr()
    );
    assert!(
        migrate.stderr().contains("idle in transaction"),
        "{}",
        migrate.stderr()
    );
    // Said in inboxctl's words only: not also by the driver, a warning of a slow statement with the statement's text.
    assert!(
        !migrate.stderr().contains("slow statement"),
        "{}",
        migrate.stderr()
    );
    let rows: i64 = common::count(&pool, "SELECT count(*) FROM inbox_messages").await;
    assert_eq!(rows, 7);
}

/// Waiting for the table's lock (or anything else), `migrate` heard a first SIGTERM or Ctrl-C and went on: only a
/// second ended it. The first ends it now, saying what stays (exit 3), and a later run finishes.
#[tokio::test(flavor = "multi_thread")]
async fn a_migrate_kept_waiting_ends_at_the_first_signal_and_a_later_run_finishes() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    let open = an_open_write_transaction(&pool).await;
    let mut migrate = env.spawn(&["migrate"]);
    migrate.wait_for_stderr(
        "inbox_messages is held by transactions still open",
        Duration::from_secs(30),
    );
    migrate.terminate();
    assert_eq!(
        migrate.wait(Duration::from_secs(10)),
        Some(3),
        "{}",
        migrate.stderr()
    );
    assert!(
        migrate
            .stderr()
            .contains("interrupted: what was applied stays"),
        "{}",
        migrate.stderr()
    );
    open.commit().await.unwrap();
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let versions: i64 = common::count(&pool, "SELECT count(*) FROM inboxctl_migrations").await;
    assert_eq!(versions, migrations() as i64);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ef_core_table_with_rows_is_adopted_untouched() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    // The rows EF Core wrote in the capture (tests/fixtures/interop/efcore/rows_select.txt).
    sqlx::raw_sql(
        "INSERT INTO inbox_messages VALUES
         ('de0d43d6-149b-4594-8c0e-ce3cbcb67ee2', 'parcel-created-notification', '2026-11-30 20:14:59.454677+00', '2026-11-30 20:15:04.454685+00'),
         ('2cfb215f-8752-4ee3-b6c4-5aaa7de14419', 'parcel-created-carrier', '2026-11-30 20:15:04.374647+00', NULL),
         ('f96053db-437a-4812-968c-43d855a3071c', 'parcel-created-carrier', '2026-11-30 20:15:04.45418+00', NULL),
         ('06ea232d-7313-4849-baf6-c93ddbad8ff4', 'parcel-created-carrier', '2026-11-30 20:15:04.454639+00', NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let rows = "SELECT string_agg(format('%s|%s|%s|%s', id, consumer_type, received_at, processed_at), ',' ORDER BY id) FROM inbox_messages";
    let rows_before: String = sqlx::query_scalar(rows).fetch_one(&pool).await.unwrap();
    let inbox_before: Vec<String> = schema_snapshot(&pool)
        .await
        .into_iter()
        .filter(|s| s.contains("inbox_messages"))
        .collect();

    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains("the existing inbox_messages table is compatible"),
        "{}",
        out.stdout
    );

    let rows_after: String = sqlx::query_scalar(rows).fetch_one(&pool).await.unwrap();
    assert_eq!(rows_after, rows_before);
    let added = [
        "index CREATE INDEX ix_inbox_messages_consumer_type_processed_at ON public.inbox_messages USING btree (consumer_type, processed_at)",
        "index CREATE INDEX ix_inbox_messages_unprocessed_by_consumer_type ON public.inbox_messages USING btree (consumer_type, received_at) WHERE (processed_at IS NULL)",
    ];
    let inbox_after: Vec<String> = schema_snapshot(&pool)
        .await
        .into_iter()
        .filter(|s| s.contains("inbox_messages"))
        .collect();
    for index in added {
        assert!(
            inbox_after.iter().any(|s| s == index),
            "the cleanup and dashboard indexes are added beside: {inbox_after:#?}"
        );
    }
    let inbox_after: Vec<String> = inbox_after
        .into_iter()
        .filter(|s| !added.contains(&s.as_str()))
        .collect();
    assert_eq!(
        inbox_after, inbox_before,
        "the EF Core table (its \"PK_inbox_messages\" key included) is kept as it is"
    );
    assert!(
        inbox_after
            .iter()
            .any(|s| s == "constraint PK_inbox_messages PRIMARY KEY (id, consumer_type)")
    );
    assert!(tables(&pool).await.contains(&"inboxctl_events".to_owned()));
}

/// An EF Core inbox in `public`, and a role whose search path puts another schema first (its own, as PostgreSQL 15
/// invites now that `public` takes no one's tables by default): migrate refuses, naming both schemas, and makes no
/// second inbox. It used to take the table found along the path for the inbox, then create an empty one in the first
/// schema, which every later statement used: every message the .NET service had processed would be processed again.
#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_in_another_schema_than_the_one_migrate_creates_in_is_refused() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA shadow; ALTER DATABASE \"{}\" SET search_path = shadow, public",
        env.db_name
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("inbox_messages is in schema public")
            && out.stderr.contains("would go to shadow"),
        "{}",
        out.stderr
    );
    let inboxes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname = 'inbox_messages'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(inboxes, 1);
}

/// An EF Core inbox in a schema of the service's own (`HasDefaultSchema("shipping")`), off the migrating role's search
/// path: migrate refuses, naming the schema and the two ways on, and makes no inbox. It used to see no inbox, make a
/// new, empty one in `public` — no "adopted" line — and every message the service had processed would have been
/// processed again. `--new-inbox` makes one beside it, when that is what is meant.
#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_off_the_search_path_is_named_not_replaced_by_a_new_one() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql("CREATE SCHEMA shipping")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET search_path = shipping; {EF_CORE_DDL}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let inboxes = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_class WHERE relname = 'inbox_messages'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(inboxes().await, 1);
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("schema shipping holds one") && out.stderr.contains("--new-inbox"),
        "{}",
        out.stderr
    );
    assert_eq!(inboxes().await, 1, "no second inbox");
    let out = env.run(&["migrate", "--new-inbox"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(inboxes().await, 2, "one beside it, as asked");
}

/// A `statement_timeout` on the database (100 ms, a bound for the service's queries) and an EF Core inbox of 300,000
/// rows: migrate's index builds take longer, and run to their end. They were cancelled, left invalid, and built again
/// and cancelled again at every run.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_timeout_of_the_database_does_not_cut_migrates_index_builds() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(EF_CORE_DDL).execute(&pool).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         SELECT gen_random_uuid(), 'carrier', now(), now() FROM generate_series(1, 300000); \
         ALTER DATABASE \"{}\" SET statement_timeout = '100ms'",
        env.db_name
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let invalid: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_index WHERE NOT indisvalid")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(invalid, 0);
}

/// The index of calls done, built beforehand by the operator (concurrently, as commands.md suggests for a large
/// table) and cut short: left invalid. The migration that builds it (`IF NOT EXISTS`) took the leftover for built, and
/// cleanup's look for done calls read the whole table from then on. `migrate` drops it first and builds it again.
#[tokio::test(flavor = "multi_thread")]
async fn an_index_of_done_calls_left_invalid_by_hand_is_built_again() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    // A database at the migration before it: the index not there, its migration not applied.
    sqlx::raw_sql(
        "DROP INDEX ix_inboxctl_effects_done; \
         DELETE FROM inboxctl_migrations WHERE version = 20261203000012; \
         INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts) \
         SELECT gen_random_uuid(), 'c', gen_random_uuid(), 'after-commit', 'done', '{}', 1 FROM generate_series(1, 2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    // A build of that name cut short (here: one that fails, on two rows it cannot hold apart) leaves it invalid.
    let cut = sqlx::raw_sql(
        "CREATE UNIQUE INDEX CONCURRENTLY ix_inboxctl_effects_done ON inboxctl_effects (consumer_type) \
         WHERE state = 'done'",
    )
    .execute(&pool)
    .await;
    assert!(cut.is_err());
    let valid = || async {
        sqlx::query_scalar::<_, Option<bool>>(
            "SELECT (SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE c.relname = 'ix_inboxctl_effects_done')",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(valid().await, Some(false));
    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(valid().await, Some(true), "{out:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_incompatible_table_is_named_and_nothing_changes() {
    let cases = [
        (
            EF_CORE_DDL.replace(
                "received_at timestamp with time zone",
                "received_at timestamp without time zone",
            ),
            "column received_at is timestamp without time zone, expected timestamp with time zone",
        ),
        (
            EF_CORE_DDL.replace("character varying(500)", "character varying(200)"),
            "column consumer_type is character varying(200), expected character varying(500)",
        ),
        (
            EF_CORE_DDL.replace("PRIMARY KEY (id, consumer_type)", "PRIMARY KEY (id)"),
            "primary key PK_inbox_messages is on (id), expected (id, consumer_type)",
        ),
        (
            EF_CORE_DDL
                .replace("    processed_at timestamp with time zone,\n", "")
                .replace(" WHERE processed_at IS NULL", ""),
            "column processed_at is missing",
        ),
        (
            EF_CORE_DDL.replace("id uuid NOT NULL", "id text NOT NULL"),
            "column id is text, expected uuid",
        ),
    ];
    for (ddl, expected) in cases {
        let env = TestEnv::empty().await;
        let pool = env.pool().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone()))
            .execute(&pool)
            .await
            .unwrap();
        let before = schema_snapshot(&pool).await;

        let out = env.run(&["migrate"]);
        assert_eq!(out.code, Some(78), "{ddl}\n{out:?}");
        assert!(
            out.stderr
                .contains("is not compatible with inboxctl; nothing was changed"),
            "{}",
            out.stderr
        );
        assert!(
            out.stderr.contains(expected),
            "expected {expected:?} in:\n{}",
            out.stderr
        );
        assert_eq!(schema_snapshot(&pool).await, before, "nothing may change");
        assert_eq!(tables(&pool).await, ["inbox_messages"]);
        pool.close().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_shows_the_sql_and_creates_nothing() {
    let env = TestEnv::bare().await;
    let out = env.run(&["migrate", "--dry-run"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("would create"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("CREATE TABLE IF NOT EXISTS inbox_messages"),
        "{}",
        out.stdout
    );
    assert_eq!(out.stdout.matches("would apply ").count(), migrations());
    assert!(!database_exists(&env.db_name).await);

    assert_eq!(env.run(&["migrate"]).code, Some(0));
    let out = env.run(&["migrate", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["migrations"].as_array().map(Vec::len), Some(0));
    assert_eq!(report["dry_run"], true);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_index_left_by_an_interrupted_build_is_rebuilt() {
    let env = TestEnv::bare().await;
    assert_eq!(env.run(&["migrate"]).code, Some(0));
    let pool = env.pool().await;
    // What an interrupted CREATE INDEX CONCURRENTLY leaves: the index there but invalid, the migration unrecorded.
    sqlx::raw_sql(
        "UPDATE pg_index SET indisvalid = false
         WHERE indexrelid = 'ix_inbox_messages_consumer_type_processed_at'::regclass;
         DELETE FROM inboxctl_migrations WHERE version = 20261201000004;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let valid = "SELECT count(*) FROM pg_index WHERE indexrelid = 'ix_inbox_messages_consumer_type_processed_at'::regclass AND indisvalid";
    assert_eq!(common::count(&pool, valid).await, 0);

    let out = env.run(&["migrate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr.contains("dropping an invalid index"),
        "{}",
        out.stderr
    );
    assert_eq!(common::count(&pool, valid).await, 1, "rebuilt, valid");
}
