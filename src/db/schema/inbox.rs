//! What an existing `inbox_messages` must be for inboxctl to adopt it: the four columns with their types, the key on
//! `(id, consumer_type)` under any name (EF Core's `"PK_inbox_messages"` or the tutorial's), and no extra column the
//! claim would have to fill; and where it must be ([`check_place`]).

use sqlx::postgres::PgConnection;

use crate::db::Unit;
use crate::db::sql;
use crate::error::{Error, Result};

statements! {
    /// The columns of `inbox_messages`: name, SQL type, NOT NULL, has a default.
    const INBOX_COLUMNS = "\
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
FROM pg_attribute a
WHERE a.attrelid = to_regclass('inbox_messages') AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum";

    /// The primary key of `inbox_messages`: its name and its columns in key order.
    const INBOX_PRIMARY_KEY = "\
SELECT c.conname::text, array_agg(a.attname::text ORDER BY k.ord)
FROM pg_constraint c
CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
WHERE c.conrelid = to_regclass('inbox_messages') AND c.contype = 'p'
GROUP BY c.conname";

    /// The schema of the `inbox_messages` the search path finds, and the schema new tables go to (the first on the
    /// search path that exists; null if none does).
    const INBOX_SCHEMA = "\
SELECT n.nspname::text, current_schema()::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('inbox_messages')";

    /// The schemas holding a table `inbox_messages` (the search path aside), up to five.
    const INBOX_ELSEWHERE = "\
SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'inbox_messages' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
ORDER BY 1 LIMIT 5";
}

/// Refuses an inbox `migrate` would not find where it works (`inbox_exists`: one is on the search path), naming where
/// it is: every message the service had processed would otherwise be processed again, by a second, empty inbox that
/// every later statement uses.
/// - Found on the search path, but in another schema than the one new tables go to (`CREATE TABLE IF NOT EXISTS`
///   looks there, not along the path): a .NET service's in `public`, the role's own schema first on its path.
/// - None on the path, but one in another schema (a service's own, EF Core's `HasDefaultSchema`), unless
///   `new_inbox` asks for one beside it.
pub async fn check_place(
    conn: &mut PgConnection,
    database: &str,
    inbox_exists: bool,
    new_inbox: bool,
) -> Result<()> {
    let refused = |difference: String| Error::SchemaIncompatible {
        database: database.to_owned(),
        differences: vec![difference],
    };
    if inbox_exists {
        let (found_in, creates_in): (String, Option<String>) =
            sql::query_as(INBOX_SCHEMA).fetch_one(&mut *conn).await?;
        if creates_in.as_deref() != Some(found_in.as_str()) {
            return Err(refused(format!(
                "inbox_messages is in schema {}, but the tables migrate makes would go to {} (the first schema on this \
                 role's search_path): put {} first on the search_path (ALTER ROLE … SET search_path), or run migrate \
                 as the role the inbox belongs to",
                crate::sanitize::text(&found_in),
                creates_in.as_deref().map_or_else(
                    || "no schema".to_owned(),
                    |s| crate::sanitize::text(s).into_owned()
                ),
                crate::sanitize::text(&found_in),
            )));
        }
    } else if !new_inbox {
        let elsewhere: Vec<String> = sql::query_scalar(INBOX_ELSEWHERE)
            .fetch_all(&mut *conn)
            .await?;
        if !elsewhere.is_empty() {
            let schemas: Vec<String> = elsewhere
                .iter()
                .map(|s| crate::sanitize::text(s).into_owned())
                .collect();
            return Err(refused(format!(
                "no inbox_messages on this role's search_path, but schema {} holds one: to adopt it, put its schema \
                 first on the search_path (ALTER ROLE … SET search_path, or options=-c search_path=… in the database \
                 URL); to make a new inbox on the search_path beside it, run migrate --new-inbox",
                schemas.join(", ")
            )));
        }
    }
    Ok(())
}

/// What an existing `inbox_messages` has that inboxctl cannot work with. Empty means compatible: the four columns
/// with their types, the key on (id, consumer_type) under any name, and no extra column the claim would have to fill.
pub async fn inbox_differences(conn: &mut PgConnection) -> Result<Vec<String>> {
    let columns = inbox_columns(conn).await?;
    let mut unit = Unit::of(conn).await?;
    let key = sql::query_as(INBOX_PRIMARY_KEY)
        .fetch_optional(unit.conn())
        .await;
    let key: Option<(String, Vec<String>)> = unit.end(key).await?;
    Ok(compare_inbox(&columns, key.as_ref()))
}

/// The name of `inbox_messages`' primary key, if it has one.
pub async fn inbox_primary_key(conn: &mut PgConnection) -> Result<Option<String>> {
    let mut unit = Unit::of(conn).await?;
    let key = sql::query_as(INBOX_PRIMARY_KEY)
        .fetch_optional(unit.conn())
        .await;
    let key: Option<(String, Vec<String>)> = unit.end(key).await?;
    Ok(key.map(|(name, _)| name))
}

const EXPECTED_COLUMNS: [(&str, &str); 4] = [
    ("id", "uuid"),
    ("consumer_type", "character varying(500)"),
    ("received_at", "timestamp with time zone"),
    ("processed_at", "timestamp with time zone"),
];

/// The columns of `inbox_messages`: name, SQL type, NOT NULL, has a default.
pub async fn inbox_columns(conn: &mut PgConnection) -> Result<Vec<(String, String, bool, bool)>> {
    let mut unit = Unit::of(conn).await?;
    let columns = sql::query_as(INBOX_COLUMNS).fetch_all(unit.conn()).await;
    Ok(unit.end(columns).await?)
}

fn compare_inbox(
    columns: &[(String, String, bool, bool)],
    key: Option<&(String, Vec<String>)>,
) -> Vec<String> {
    let mut differences = Vec::new();
    for (name, expected) in EXPECTED_COLUMNS {
        match columns.iter().find(|c| c.0 == name) {
            None => differences.push(format!("column {name} is missing (expected {expected})")),
            Some((_, actual, ..)) if actual != expected => {
                differences.push(format!("column {name} is {actual}, expected {expected}"))
            }
            Some(_) => {}
        }
    }
    for (name, type_name, not_null, has_default) in columns {
        let ours = EXPECTED_COLUMNS.iter().any(|(n, _)| n == name);
        if !ours && *not_null && !has_default {
            differences.push(format!(
                "column {name} ({type_name}) is NOT NULL without a default, so inboxctl's claim could not insert a row"
            ));
        }
    }
    match key {
        None => differences
            .push("there is no primary key; expected one on (id, consumer_type)".to_owned()),
        Some((name, key_columns)) => {
            let mut sorted = key_columns.clone();
            sorted.sort();
            // A partitioned inbox (`migrate --partitioned`) has the partitioning time in its key too.
            if sorted != ["consumer_type", "id"]
                && sorted != ["consumer_type", "id", "message_time"]
            {
                differences.push(format!(
                    "primary key {name} is on ({}), expected (id, consumer_type)",
                    key_columns.join(", ")
                ));
            }
        }
    }
    differences
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, type_name: &str) -> (String, String, bool, bool) {
        (name.to_owned(), type_name.to_owned(), true, false)
    }

    fn seed_columns() -> Vec<(String, String, bool, bool)> {
        EXPECTED_COLUMNS.iter().map(|(n, t)| col(n, t)).collect()
    }

    fn key(name: &str, cols: &[&str]) -> (String, Vec<String>) {
        (
            name.to_owned(),
            cols.iter().map(|c| (*c).to_owned()).collect(),
        )
    }

    #[test]
    fn both_key_names_are_the_same_schema() {
        for name in ["pk_inbox_messages", "PK_inbox_messages"] {
            assert!(
                compare_inbox(&seed_columns(), Some(&key(name, &["id", "consumer_type"])))
                    .is_empty()
            );
        }
    }

    #[test]
    fn extra_nullable_or_defaulted_columns_are_fine() {
        let mut columns = seed_columns();
        columns.push(("note".into(), "text".into(), false, false));
        columns.push(("tenant".into(), "text".into(), true, true));
        assert!(compare_inbox(&columns, Some(&key("pk", &["id", "consumer_type"]))).is_empty());
    }

    #[test]
    fn each_difference_is_named() {
        let columns = vec![
            col("id", "uuid"),
            col("consumer_type", "character varying(200)"),
            col("received_at", "timestamp without time zone"),
            col("tenant", "text"),
        ];
        let found = compare_inbox(&columns, Some(&key("pk", &["id"])));
        assert_eq!(found.len(), 5, "{found:#?}");
        assert!(found[0].contains("consumer_type is character varying(200)"));
        assert!(found[1].contains("received_at is timestamp without time zone"));
        assert!(found[2].contains("processed_at is missing"));
        assert!(found[3].contains("tenant"));
        assert!(found[4].contains("primary key pk is on (id)"));
    }

    #[test]
    fn no_primary_key_is_a_difference() {
        let found = compare_inbox(&seed_columns(), None);
        assert_eq!(
            found,
            vec!["there is no primary key; expected one on (id, consumer_type)"]
        );
    }
}
