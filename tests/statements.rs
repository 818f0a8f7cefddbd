//! Every statement of the store (`inboxctl::db::statements()`) against the schema the migrations make, before any of
//! them runs for real: a misspelt column or table, a type that does not fit, fails here with the statement's name.
//! And the list is complete: `src/db/` holds no SQL outside the `statements!` declarations that make it.

use crate::common;

use std::collections::HashSet;
use std::path::Path;

use common::TestEnv;
use sqlx::{AssertSqlSafe, Connection as _, Executor as _, PgConnection, SqlSafeStr as _};

#[tokio::test(flavor = "multi_thread")]
async fn every_statement_of_the_store_prepares_against_the_migrated_schema() {
    let plain = TestEnv::migrated().await;
    // The same schema with its inbox partitioned (`migrate --partitioned`): every statement but the unpartitioned
    // claim's must work there too, and the partitioned claim's only there.
    let partitioned = TestEnv::migrated().await;
    let db = inboxctl::db::Database::from_url(&partitioned.database_url).unwrap();
    inboxctl::db::schema::migrate_partitioned(&db, false, Some(partitioning()))
        .await
        .expect("partition the inbox");
    let statements = inboxctl::db::statements();
    let mut failed = Vec::new();
    for (env, layout) in [(&plain, "unpartitioned"), (&partitioned, "partitioned")] {
        let mut conn = PgConnection::connect(&env.database_url)
            .await
            .expect("connect to the migrated database");
        for statement in &statements {
            let timed = statement.name.ends_with("_TIMED") || statement.name.ends_with("_BETWEEN");
            let plain_only = matches!(
                statement.name.as_str(),
                "claim::CLAIM" | "claim::CLAIM_BATCH" | "claim::claim_with_effect"
            );
            if (layout == "unpartitioned" && timed) || (layout == "partitioned" && plain_only) {
                continue;
            }
            if let Err(e) = prepare(&mut conn, statement).await {
                failed.push(format!("{} ({layout}): {e}", statement.name));
            }
        }
        let _ = conn.close().await;
    }
    assert!(
        failed.is_empty(),
        "{} statements do not prepare against the migrated schema (of {}):\n{}",
        failed.len(),
        statements.len(),
        failed.join("\n")
    );
}

/// Each consumer's effects worker leases the calls due every 200 ms, and marks those of a dead process in doubt:
/// with 20,000 calls failed or in doubt (a carrier's outage, unsettled), both walked them all — a sequential scan
/// of ~13 ms a poll at 100,000 — where the calls owed or started are none. Their generic plans (the ones a prepared
/// statement settles on) read the index of the calls owed or started only.
#[tokio::test(flavor = "multi_thread")]
async fn the_effects_workers_polls_read_only_the_calls_owed_or_started() {
    let env = TestEnv::migrated().await;
    let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, created_at)
         SELECT gen_random_uuid(), 'carrier', gen_random_uuid(), 'after-commit',
                CASE WHEN g % 10 = 0 THEN 'in_doubt' ELSE 'failed' END, '{}', 5, now() - g * interval '1 ms'
         FROM generate_series(1, 20000) g;
         ANALYZE inboxctl_effects;
         SET plan_cache_mode = force_generic_plan",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let statements = inboxctl::db::statements();
    for (name, arguments) in [
        (
            "external::LEASE_DUE",
            "('carrier', 30, 10, false, 0, 86400)",
        ),
        ("external::MARK_IN_DOUBT", "('carrier', 86400)"),
    ] {
        let sql = &statements.iter().find(|s| s.name == name).unwrap().sql;
        sqlx::raw_sql(AssertSqlSafe(format!("PREPARE poll AS {sql}")))
            .execute(&mut conn)
            .await
            .unwrap();
        let plan: Vec<String> =
            sqlx::query_scalar(AssertSqlSafe(format!("EXPLAIN EXECUTE poll{arguments}")))
                .fetch_all(&mut conn)
                .await
                .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("ix_inboxctl_effects_owed"), "{name}:\n{plan}");
        sqlx::raw_sql("DEALLOCATE poll")
            .execute(&mut conn)
            .await
            .unwrap();
    }
}

/// `top`'s detail reads a consumer_type's latest failures: through the index of all its events it walked past every
/// duplicate discarded since the last failure (millions, where an upstream re-sends). Migration 17's index holds the
/// failures alone, and the statement's generic plan reads it.
#[tokio::test(flavor = "multi_thread")]
async fn the_latest_failures_are_read_without_walking_the_duplicates() {
    let env = TestEnv::migrated().await;
    let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO inboxctl_events (consumer_type, kind, message_id, occurred_at)
         SELECT 'carrier', CASE WHEN g % 10000 = 0 THEN 'failed' ELSE 'duplicate' END, gen_random_uuid(),
                now() - g * interval '1 ms'
         FROM generate_series(1, 50000) g;
         ANALYZE inboxctl_events;
         SET plan_cache_mode = force_generic_plan",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let plan = plan_of(&mut conn, "triage::RECENT_FAILURES", "('carrier', 20)").await;
    assert!(plan.contains("ix_inboxctl_events_failures"), "{plan}");
    assert!(
        !plan.contains("Rows Removed by Filter"),
        "the five failures read alone, no duplicate passed over:\n{plan}"
    );
}

/// `find` looks up a message's effects by its id in the stand-in consumers' tables, which are never pruned: through
/// their only index, the parcel's, each id read the whole of both tables. Migrations 19 and 20 index the message id,
/// and the statement's generic plan reads them.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_s_effects_are_found_without_reading_the_effect_tables() {
    let env = TestEnv::migrated().await;
    let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)
         SELECT gen_random_uuid(), gen_random_uuid(), now(), gen_random_uuid(), gen_random_uuid()
         FROM generate_series(1, 20000);
         INSERT INTO notifications_sent (parcel_id, tracking_number, body, message_id, idempotency_key)
         SELECT gen_random_uuid(), 'PT' || g, 'body', gen_random_uuid(), gen_random_uuid()
         FROM generate_series(1, 20000) g;
         ANALYZE carrier_reservations;
         ANALYZE notifications_sent;
         SET plan_cache_mode = force_generic_plan",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let plan = plan_of(
        &mut conn,
        "triage::EFFECTS_OF",
        "('0190c0de-0000-7000-8000-000000000001')",
    )
    .await;
    assert!(!plan.contains("Seq Scan"), "{plan}");
    assert!(
        plan.contains("ix_carrier_reservations_message_id"),
        "{plan}"
    );
    assert!(plan.contains("ix_notifications_sent_message_id"), "{plan}");
}

/// `stats` and `top` count each consumer_type's calls in doubt and failed every refresh: through migration 18's index
/// of those states, not a walk of every call not done (millions after a carrier's outage) — nor of a backlog of calls
/// owed, to find the at-most-once ones started past their lease.
#[tokio::test(flavor = "multi_thread")]
async fn the_calls_in_doubt_are_counted_through_their_own_index() {
    let env = TestEnv::migrated().await;
    let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, created_at)
         SELECT gen_random_uuid(), 'carrier', gen_random_uuid(), 'at-most-once',
                CASE WHEN g % 1000 = 0 THEN 'in_doubt' ELSE 'failed' END, '{}', 5, now() - g * interval '1 ms'
         FROM generate_series(1, 50000) g;
         INSERT INTO inboxctl_effects (message_id, consumer_type, idempotency_key, mode, state, request, attempts, created_at)
         SELECT gen_random_uuid(), 'carrier', gen_random_uuid(), 'after-commit', 'pending', '{}', 0,
                now() - g * interval '1 ms'
         FROM generate_series(1, 30000) g;
         ANALYZE inboxctl_effects;
         SET plan_cache_mode = force_generic_plan",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let plan = plan_of(
        &mut conn,
        "external::OPEN_EFFECTS",
        "(ARRAY['carrier'], 10000)",
    )
    .await;
    assert!(plan.contains("ix_inboxctl_effects_unsettled"), "{plan}");
    // No node of it reads more than the cap (the failed ones' count may be a scan that stops there).
    let most = plan
        .split("actual time=")
        .skip(1)
        .filter_map(|node| {
            let rows = node.split(" rows=").nth(1)?;
            rows.split_whitespace().next()?.parse::<u64>().ok()
        })
        .max();
    assert!(most.is_some_and(|n| n <= 10_000), "{most:?}\n{plan}");
    // The at-most-once calls started past their lease (in doubt) are found through the index of started calls, not by
    // a walk of the 30,000 owed ones, filtered (which returns nothing and reads them all).
    let lines: Vec<&str> = plan.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.contains("Filter:") && line.contains("lease_until < now()") {
            let removed = lines
                .get(i + 1)
                .and_then(|next| next.split("Rows Removed by Filter: ").nth(1))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .unwrap_or(0);
            assert!(removed <= 10_000, "{removed}\n{plan}");
        }
    }
}

/// The settings the partitioned schema of these tests is made with.
fn partitioning() -> inboxctl::db::partitions::Settings {
    inboxctl::db::partitions::Settings {
        interval: chrono::TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    }
}

/// Prepares a statement; a simple query of several commands (the claim's `BEGIN; SET LOCAL …`) cannot be prepared:
/// it runs, and what it began is rolled back.
async fn prepare(conn: &mut PgConnection, statement: &inboxctl::db::Statement) -> sqlx::Result<()> {
    let sql = AssertSqlSafe(statement.sql.to_string()).into_sql_str();
    if statement.simple_query {
        sqlx::raw_sql(sql).execute(&mut *conn).await?;
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut *conn)
            .await
            .map(drop)
    } else {
        (&mut *conn).prepare(sql).await.map(drop)
    }
}

#[test]
fn statement_names_are_unique() {
    let statements = inboxctl::db::statements();
    let names: HashSet<&str> = statements.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), statements.len());
}

/// The bench's statements, which stay in `db/sql.rs` until the bench leaves the library; not the store's.
fn bench_only(item: &str) -> bool {
    item.starts_with("BENCH_") || item == "SERVER_VERSION"
}

/// Nothing in `src/db/` sends a statement that `statements()` does not list: every SQL text is declared in a
/// `statements!` block (which lists it), built by a function `statements()` lists with a sample, or one of the
/// bench's in `sql.rs`; every `sql::query*` and `raw_sql` call takes a listed statement (or a parameter holding one);
/// and no statement goes around `sql::query*` (which leaves it unnamed through a transaction pooler) with
/// `sqlx::query*`, but in `sql.rs` itself.
#[test]
fn the_list_holds_every_statement_in_src_db() {
    let statements = inboxctl::db::statements();
    let listed: HashSet<&str> = statements
        .iter()
        .filter_map(|s| s.name.rsplit("::").next())
        .collect();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/db");
    let mut problems = Vec::new();
    let mut files = 0;
    // Every source file of src/db, its folders' (an area split in two, `partitions/`) included.
    let mut paths = Vec::new();
    let mut folders = vec![dir.clone()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).expect("a folder of src/db") {
            let path = entry.expect("an entry of src/db").path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                paths.push(path);
            }
        }
    }
    for path in paths {
        files += 1;
        let file = path.file_name().unwrap_or_default().to_string_lossy();
        let text = std::fs::read_to_string(&path).expect("a source file");
        // Unit tests may hold any text.
        let text = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        for literal in scan(text) {
            let sql = literal.text.trim_start_matches('\\').trim_start();
            let is_sql = SQL_STARTS.iter().any(|k| {
                sql.strip_prefix(k)
                    .is_some_and(|rest| rest.starts_with([' ', '\n', '(']) || rest.is_empty())
            });
            let allowed = literal.in_statements_block
                || listed.contains(literal.item.as_str())
                || (file == "sql.rs" && bench_only(&literal.item));
            if is_sql && !allowed {
                problems.push(format!(
                    "{file}:{}: SQL outside a statements! block, in {}: {:?}",
                    literal.line, literal.item, literal.text
                ));
            }
        }
        if file != "sql.rs" {
            for (n, line) in text.lines().enumerate() {
                if line.contains("sqlx::query") && !line.trim_start().starts_with("//") {
                    problems.push(format!(
                        "{file}:{}: sqlx::query* around sql::query*, which leaves a statement unnamed through a \
                         transaction pooler: {}",
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
        for (line, argument) in query_arguments(text) {
            let name = argument.trim_start_matches("AssertSqlSafe(");
            let name = name
                .split(['(', ')', ','])
                .next()
                .unwrap_or_default()
                .trim();
            if !(listed.contains(name) || name == "statement") {
                problems.push(format!(
                    "{file}:{line}: a query of {argument:?}, which statements() does not list"
                ));
            }
        }
    }
    assert!(files >= 9, "found only {files} files in {}", dir.display());
    assert!(
        problems.is_empty(),
        "statements the list misses:\n{}",
        problems.join("\n")
    );
}

/// The first word of every statement inboxctl sends (or might).
const SQL_STARTS: &[&str] = &[
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "WITH",
    "CREATE",
    "DROP",
    "ALTER",
    "TRUNCATE",
    "SAVEPOINT",
    "ROLLBACK",
    "RELEASE",
    "BEGIN",
    "COMMIT",
    "VACUUM",
    "ANALYZE",
    "CHECKPOINT",
    "LOCK",
    "GRANT",
    "REVOKE",
    "SET",
    "COPY",
];

/// A string literal of a source file.
struct Literal {
    text: String,
    line: usize,
    /// The last `fn` or `const` declared before it: the item it belongs to.
    item: String,
    in_statements_block: bool,
}

/// The string literals of a Rust source file, outside comments, each with the item it is in and whether it is inside
/// a `statements! { … }` block.
fn scan(source: &str) -> Vec<Literal> {
    let chars: Vec<char> = source.chars().collect();
    let (mut i, mut line, mut depth) = (0, 1, 0usize);
    let mut block_depth: Option<usize> = None;
    let mut item = String::new();
    let mut literals = Vec::new();
    let word_at =
        |i: usize, word: &str| chars[i..].iter().take(word.len()).copied().eq(word.chars());
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
        }
        if word_at(i, "//") {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if word_at(i, "/*") {
            while i < chars.len() && !word_at(i, "*/") {
                line += usize::from(chars[i] == '\n');
                i += 1;
            }
            i += 2;
            continue;
        }
        if c == '\'' {
            // A char literal ('x', '\n', '"'), or a lifetime.
            if chars.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
            continue;
        }
        if c == '"' {
            let start_line = line;
            let mut text = String::new();
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    text.push(chars[i]);
                    i += 1;
                }
                line += usize::from(chars[i] == '\n');
                text.push(chars[i]);
                i += 1;
            }
            i += 1;
            literals.push(Literal {
                text,
                line: start_line,
                item: item.clone(),
                in_statements_block: block_depth.is_some(),
            });
            continue;
        }
        if word_at(i, "statements!") {
            block_depth = Some(depth);
        }
        for keyword in ["fn ", "const "] {
            if word_at(i, keyword) && (i == 0 || !chars[i - 1].is_alphanumeric()) {
                let rest = &chars[i + keyword.len()..];
                item = rest
                    .iter()
                    .take_while(|c| c.is_alphanumeric() || **c == '_')
                    .collect();
            }
        }
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if block_depth == Some(depth) {
                    block_depth = None;
                }
            }
            _ => {}
        }
        i += 1;
    }
    literals
}

/// The first argument of every `sql::query(…)`, `sql::query_as(…)`, `sql::query_scalar(…)` and `raw_sql(…)` call
/// (turbofish allowed), with its line.
fn query_arguments(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in source.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = ["sql::query", "raw_sql"]
            .iter()
            .filter_map(|call| rest.find(call).map(|at| at + call.len()))
            .min()
        {
            rest = &rest[at..];
            let call = rest
                .trim_start_matches("_as")
                .trim_start_matches("_scalar")
                .trim_start_matches("_with");
            let call = match call.strip_prefix("::<") {
                Some(generic) => generic.split_once(">(").map_or("", |(_, after)| after),
                None => call.strip_prefix('(').unwrap_or(""),
            };
            // An argument on the next line shows as an empty one, which no statement is called: write it on the line.
            found.push((n + 1, call.to_owned()));
        }
    }
    found
}

/// The plan the store's statement `name` runs with on `conn`, prepared and executed with `arguments` (SQL literals, in
/// parentheses): `EXPLAIN (ANALYZE, BUFFERS)`'s text. The caller forces the generic plan (`plan_cache_mode`), as a
/// prepared statement gets after its fifth run.
async fn plan_of(conn: &mut PgConnection, name: &str, arguments: &str) -> String {
    let statements = inboxctl::db::statements();
    let sql = &statements.iter().find(|s| s.name == name).unwrap().sql;
    sqlx::raw_sql(AssertSqlSafe(format!("PREPARE plan_of AS {sql}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT TEXT) EXECUTE plan_of{arguments}"
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    plan.join("\n")
}
