//! What of an unpartitioned `inbox_messages` a conversion could not keep, found before anything is changed: each
//! refused with what to do, rather than the conversion failing half way or losing it silently.

use sqlx::postgres::PgConnection;

use crate::db::sql;
use crate::error::Result;

statements! {
    /// The foreign keys of other tables that reference `inbox_messages`: name and table. The conversion drops the key
    /// they depend on, and a partitioned inbox keyed on the message's time has none on `(id, consumer_type)`.
    const INBOX_REFERENCED_BY = "\
SELECT conname::text, conrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass('inbox_messages')";

    /// What hangs on the plain `inbox_messages` by its identity, which the conversion's rename leaves on the rows from
    /// before it (`inbox_messages_untimed`) or loses: a kind and a name each. Row-level security (enabled: the
    /// partitioned table would have none), privileges granted on a column (not carried over: a writer that holds
    /// only those is refused), triggers and rules of the operator's, views that read the table, publications that
    /// name it, and a column whose collation is not its type's (PostgreSQL attaches no partition whose collation
    /// differs from its parent's: the swap would fail on every run).
    const INBOX_NOT_CARRIED = "\
SELECT 'rls', '' FROM pg_class WHERE oid = to_regclass('inbox_messages') AND relrowsecurity
UNION ALL
SELECT 'column grant', attname::text FROM pg_attribute
WHERE attrelid = to_regclass('inbox_messages') AND attnum > 0 AND NOT attisdropped AND cardinality(attacl) > 0
UNION ALL
SELECT 'trigger', tgname::text FROM pg_trigger WHERE tgrelid = to_regclass('inbox_messages') AND NOT tgisinternal
UNION ALL
SELECT 'rule', rulename::text FROM pg_rewrite WHERE ev_class = to_regclass('inbox_messages')
UNION ALL
SELECT DISTINCT 'view', r.ev_class::regclass::text FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid
WHERE d.classid = 'pg_rewrite'::regclass AND d.refclassid = 'pg_class'::regclass
  AND d.refobjid = to_regclass('inbox_messages') AND r.ev_class <> to_regclass('inbox_messages')
UNION ALL
SELECT 'publication', p.pubname::text FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
WHERE pr.prrelid = to_regclass('inbox_messages')
UNION ALL
SELECT 'collation', a.attname::text FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass('inbox_messages') AND a.attnum > 0 AND NOT a.attisdropped
  AND a.attcollation <> t.typcollation
ORDER BY 1, 2";
}

/// Every refusal of a conversion of the unpartitioned inbox, each a sentence naming what to do; none: it may go.
pub(super) async fn refusals(conn: &mut PgConnection) -> Result<Vec<String>> {
    let mut refused =
        what_partitioning_cannot_keep(&crate::db::schema::inbox_columns(&mut *conn).await?);
    let references: Vec<(String, String)> = sql::query_as(INBOX_REFERENCED_BY)
        .fetch_all(&mut *conn)
        .await?;
    refused.extend(references.into_iter().map(|(key, table)| {
        format!(
            "foreign key {} of {} references inbox_messages: a partitioned inbox has no key on (id, \
             consumer_type) to reference (drop it, or keep the inbox unpartitioned)",
            crate::sanitize::text(&key),
            crate::sanitize::text(&table)
        )
    }));
    let not_carried: Vec<(String, String)> = sql::query_as(INBOX_NOT_CARRIED)
        .fetch_all(&mut *conn)
        .await?;
    refused.extend(
        not_carried
            .iter()
            .map(|(kind, name)| not_carried_refusal(kind, name)),
    );
    Ok(refused)
}

/// What of an adopted inbox a conversion could not keep, found before anything is changed: the old table becomes a
/// partition of one made with inboxctl's columns only, and PostgreSQL attaches no table with a column its parent
/// lacks, nor one that lets a row have no `received_at` where the parent requires one. (It used to add its two
/// columns and its index to the table first, and then fail at the swap on every run.)
fn what_partitioning_cannot_keep(columns: &[(String, String, bool, bool)]) -> Vec<String> {
    const KEPT: [&str; 6] = [
        "id",
        "consumer_type",
        "received_at",
        "processed_at",
        "message_time",
        "fingerprint",
    ];
    let mut refused = Vec::new();
    for (name, type_name, not_null, _) in columns {
        if !KEPT.contains(&name.as_str()) {
            refused.push(format!(
                "column {} ({}) is not inboxctl's: a partitioned inbox holds inboxctl's columns only (drop it, or \
                 keep the inbox unpartitioned)",
                crate::sanitize::text(name),
                crate::sanitize::text(type_name)
            ));
        } else if (name == "message_time" && (type_name != "timestamp with time zone" || !not_null))
            || (name == "fingerprint" && type_name != "bytea")
        {
            // Left by an earlier conversion, or the operator's own: `ADD COLUMN IF NOT EXISTS` keeps it as it is.
            refused.push(format!(
                "column {name} is {type_name}{}, not what a partitioned inbox holds ({})",
                if *not_null { " NOT NULL" } else { "" },
                if name == "message_time" {
                    "timestamp with time zone NOT NULL"
                } else {
                    "bytea"
                }
            ));
        } else if name == "received_at" && !not_null {
            refused.push(
                "column received_at may be null: a partitioned inbox requires it (SET NOT NULL, once no row lacks it)"
                    .to_owned(),
            );
        }
    }
    refused
}

/// What the operator is told of one thing [`INBOX_NOT_CARRIED`] found: what the conversion would do to it, and what
/// to do instead.
fn not_carried_refusal(kind: &str, name: &str) -> String {
    let name = crate::sanitize::text(name);
    let after = "the conversion renames the table to inbox_messages_untimed, which keeps the rows from before it \
                 only";
    match kind {
        "rls" => "row-level security is enabled on inbox_messages: the partitioned table that takes its name would \
                  have none, and every role granted it would read and write every row (disable it, or keep the \
                  inbox unpartitioned)"
            .to_owned(),
        "column grant" => format!(
            "privileges are granted on column {name} alone: they are not carried to the partitioned table, and a \
             role writing through them would be refused (grant on the table instead, or keep the inbox \
             unpartitioned)"
        ),
        "trigger" | "rule" => format!(
            "{kind} {name} is on inbox_messages: {after}, so it would no longer see the rows written (drop it, and \
             make it again on the partitioned table after)"
        ),
        "view" => format!(
            "view {name} reads inbox_messages: {after}, so it would read those only (drop it, and make it again \
             after)"
        ),
        "publication" => format!(
            "publication {name} publishes inbox_messages: {after}, so it would publish those only (take the table \
             out of it, and add the partitioned one after, with publish_via_partition_root)"
        ),
        _ => format!(
            "column {name} has a collation other than its type's: PostgreSQL attaches no partition whose collation \
             differs from its parent's, and the conversion would fail at its swap on every run (ALTER COLUMN … \
             TYPE … COLLATE \"default\", or keep the inbox unpartitioned)"
        ),
    }
}
