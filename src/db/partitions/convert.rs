//! Converting an unpartitioned `inbox_messages` in place (see the parent module): two columns added, a unique index
//! on the new key built concurrently, a validated check, the window's partitions made as tables of their own, then
//! one short transaction that renames the table, makes the new key its primary key, makes the partitioned one in its
//! place with the same indexes and grants, and attaches the old table as the untimed partition and the tables made
//! before as the window's partitions.

use std::collections::BTreeSet;

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::{
    AHEAD, BACK, INBOX_SCHEMA, Layout, MAX_NEW_PARTITIONS, Settings, attach_statement,
    comment_statement, create_table_statement, ensure_partitions, intervals, make_missing,
    owner_statement, partition_name, read_layout, run,
};
use crate::db::sql::{self, quote_ident};
use crate::error::{Error, Result};

statements! {
    /// The privileges granted on `inbox_messages`: grantee (null: PUBLIC; its name as it is, not quoted) and
    /// privilege, to grant the same on the partitioned table that takes its name — the owner's too, when the owner is
    /// not the role converting it (a superuser, or a member of the owner's role): the new table is this role's, and
    /// the old owner would otherwise lose every right on the inbox its service reads and writes. The default
    /// privileges when none were ever granted (the owner's).
    const INBOX_GRANTS = "\
SELECT DISTINCT CASE WHEN a.grantee = 0 THEN NULL ELSE pg_get_userbyid(a.grantee)::text END, a.privilege_type,
       a.is_grantable
FROM pg_class c CROSS JOIN LATERAL aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
WHERE c.oid = to_regclass('inbox_messages')
  AND a.grantee <> (SELECT oid FROM pg_roles WHERE rolname = current_user)";

    /// The owner of the inbox's rows from before it was partitioned (`inbox_messages_untimed`), when the
    /// partitioned `inbox_messages` is another's — this role's, which converted it —, and whether this role may hand
    /// it over (a superuser; or a member of that role, which may create in the schema).
    const OWNER_TO_RESTORE = "\
SELECT pg_get_userbyid(u.relowner)::text,
       pg_has_role(u.relowner, 'MEMBER')
       AND ((SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
            OR has_schema_privilege(u.relowner, u.relnamespace, 'CREATE'))
FROM pg_class u, pg_class p
WHERE u.oid = to_regclass('inbox_messages_untimed') AND p.oid = to_regclass('inbox_messages')
  AND u.relowner <> p.relowner AND p.relowner = (SELECT oid FROM pg_roles WHERE rolname = current_user)";

    /// The partitions of `inbox_messages` this role owns.
    const PARTITIONS_OWNED = "\
SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass('inbox_messages')
  AND c.relowner = (SELECT oid FROM pg_roles WHERE rolname = current_user)";

    /// Whether a constraint of that name exists on `inbox_messages`. `$1` name.
    const INBOX_CONSTRAINT_EXISTS = "\
SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass('inbox_messages') AND conname = $1)";

    /// Whether an index of that name exists and is valid (a concurrent build that stopped leaves it invalid). `$1`.
    const INDEX_STATE = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)";
}

/// The indexes the migrations put on `inbox_messages`: the partitioned table gets the same, and the converted
/// table's are renamed (`inbox_messages_untimed…`) and attached to them.
const INBOX_INDEXES: [(&str, &str); 3] = [
    (
        "ix_inbox_messages_unprocessed",
        "(received_at) WHERE processed_at IS NULL",
    ),
    (
        "ix_inbox_messages_consumer_type_processed_at",
        "(consumer_type, processed_at)",
    ),
    (
        "ix_inbox_messages_unprocessed_by_consumer_type",
        "(consumer_type, received_at) WHERE processed_at IS NULL",
    ),
];

/// The conversion's steps before its one short transaction, each safe to run again.
const ADD_COLUMNS: &str = "ALTER TABLE inbox_messages \
     ADD COLUMN IF NOT EXISTS message_time timestamptz NOT NULL DEFAULT '-infinity', \
     ADD COLUMN IF NOT EXISTS fingerprint bytea NULL";
const DROP_UNTIMED_KEY: &str = "DROP INDEX CONCURRENTLY IF EXISTS inbox_messages_untimed_key";
const BUILD_UNTIMED_KEY: &str = "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS inbox_messages_untimed_key \
     ON inbox_messages (id, consumer_type, message_time)";
const ADD_UNTIMED_CHECK: &str = "ALTER TABLE inbox_messages ADD CONSTRAINT inbox_messages_untimed_time \
     CHECK (message_time < '2000-01-01 00:00:00+00') NOT VALID";
const VALIDATE_UNTIMED_CHECK: &str =
    "ALTER TABLE inbox_messages VALIDATE CONSTRAINT inbox_messages_untimed_time";
/// How long the conversion's steps wait for a lock the consumers' transactions hold before trying again: never
/// long enough to stall the claims queued behind it.
const SET_LOCK_TIMEOUT: &str = "SET lock_timeout = '2s'";
pub(super) const RESET_LOCK_TIMEOUT: &str = "RESET lock_timeout";
pub(super) const SET_LOCAL_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";
const LOCK_INBOX: &str = "LOCK TABLE inbox_messages IN ACCESS EXCLUSIVE MODE";
const RENAME_TO_UNTIMED: &str = "ALTER TABLE inbox_messages RENAME TO inbox_messages_untimed";
/// The new key, built beforehand, made the untimed partition's primary key in place of the old one, so that the
/// attach pairs it with the partitioned table's primary key: PostgreSQL 17 pairs only constraints of one kind, and
/// would otherwise build a key of its own under the swap's lock — and fail at it, a table having one primary key.
/// Its rows all have `message_time = '-infinity'` (the check), so the new key is as unique as the old one was.
const UNTIMED_KEY_CONSTRAINT: &str = "ALTER TABLE inbox_messages_untimed \
     ADD CONSTRAINT inbox_messages_untimed_pk PRIMARY KEY USING INDEX inbox_messages_untimed_key";
const ATTACH_UNTIMED: &str = "ALTER TABLE inbox_messages ATTACH PARTITION inbox_messages_untimed \
     FOR VALUES FROM (MINVALUE) TO ('2000-01-01 00:00:00+00')";

fn drop_key_statement(key: &str) -> String {
    format!(
        "ALTER TABLE inbox_messages_untimed DROP CONSTRAINT {}",
        quote_ident(key)
    )
}

fn rename_index_statement(index: &str) -> String {
    format!(
        "ALTER INDEX IF EXISTS {} RENAME TO {}",
        quote_ident(index),
        quote_ident(&index.replace("inbox_messages", "inbox_messages_untimed"))
    )
}

/// The columns of the partitioned inbox, and of each of its partitions.
const PARTITIONED_COLUMNS: &str = "\
     id uuid NOT NULL, \
     consumer_type character varying(500) NOT NULL, \
     received_at timestamp with time zone NOT NULL, \
     processed_at timestamp with time zone, \
     message_time timestamp with time zone NOT NULL DEFAULT '-infinity', \
     fingerprint bytea";

fn create_partitioned_statement(key: &str) -> String {
    format!(
        "CREATE TABLE inbox_messages ({PARTITIONED_COLUMNS}, \
             CONSTRAINT {} PRIMARY KEY (id, consumer_type, message_time)\
         ) PARTITION BY RANGE (message_time)",
        quote_ident(key)
    )
}

/// A partition of the window made before the swap, as the table it will be once attached: its key and indexes those
/// the partitioned table will have, so that attaching it under the swap's lock only pairs them. (`IF NOT EXISTS`: one
/// made by a conversion that stopped before its swap is taken as it is.)
fn premade_table_statement(name: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} ({PARTITIONED_COLUMNS}, PRIMARY KEY (id, consumer_type, message_time))",
        quote_ident(name)
    )
}

/// One of [`INBOX_INDEXES`] on a partition made before the swap, named after the partitioned table's.
fn premade_index_statement(partition: &str, index: &str, definition: &str) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} {definition}",
        quote_ident(&index.replace("inbox_messages", partition)),
        quote_ident(partition)
    )
}

fn create_index_statement(name: &str, definition: &str) -> String {
    format!(
        "CREATE INDEX {} ON inbox_messages {definition}",
        quote_ident(name)
    )
}

/// The grant of `privilege` to `grantee` (none: PUBLIC) on the new `inbox_messages`, `WITH GRANT OPTION` if it was
/// so granted; none for a privilege this version does not know: granting another in its place would widen access.
fn grant_statement(privilege: &str, grantee: Option<&str>, grantable: bool) -> Option<String> {
    let privilege = privilege.to_ascii_uppercase();
    let privilege = match privilege.as_str() {
        p @ ("SELECT" | "INSERT" | "UPDATE" | "DELETE" | "TRUNCATE" | "REFERENCES" | "TRIGGER"
        | "MAINTAIN") => p,
        other => {
            tracing::warn!(
                privilege = %crate::sanitize::text(other),
                "a privilege on inbox_messages this version does not know is not carried over to the partitioned \
                 table: grant it again"
            );
            return None;
        }
    };
    Some(format!(
        "GRANT {privilege} ON inbox_messages TO {}{}",
        grantee.map_or_else(|| "PUBLIC".to_owned(), quote_ident),
        if grantable { " WITH GRANT OPTION" } else { "" }
    ))
}

/// The conversion's statements built around a name, each with a sample one.
pub(super) fn built_statements() -> Vec<(&'static str, String)> {
    vec![
        (
            "grant_statement",
            grant_statement("select", Some("inboxctl"), true).unwrap_or_default(),
        ),
        (
            "drop_key_statement",
            drop_key_statement("pk_inbox_messages"),
        ),
        (
            "rename_index_statement",
            rename_index_statement(INBOX_INDEXES[0].0),
        ),
        (
            "create_partitioned_statement",
            create_partitioned_statement("pk_inbox_messages"),
        ),
        (
            "create_index_statement",
            create_index_statement(INBOX_INDEXES[0].0, INBOX_INDEXES[0].1),
        ),
        (
            "premade_table_statement",
            premade_table_statement("inbox_messages_p20270519_000000"),
        ),
        (
            "premade_index_statement",
            premade_index_statement(
                "inbox_messages_p20270519_000000",
                INBOX_INDEXES[2].0,
                INBOX_INDEXES[2].1,
            ),
        ),
        ("ADD_COLUMNS", ADD_COLUMNS.to_owned()),
        ("DROP_UNTIMED_KEY", DROP_UNTIMED_KEY.to_owned()),
        ("BUILD_UNTIMED_KEY", BUILD_UNTIMED_KEY.to_owned()),
        ("ADD_UNTIMED_CHECK", ADD_UNTIMED_CHECK.to_owned()),
        ("VALIDATE_UNTIMED_CHECK", VALIDATE_UNTIMED_CHECK.to_owned()),
        ("SET_LOCK_TIMEOUT", SET_LOCK_TIMEOUT.to_owned()),
        ("RESET_LOCK_TIMEOUT", RESET_LOCK_TIMEOUT.to_owned()),
        ("SET_LOCAL_LOCK_TIMEOUT", SET_LOCAL_LOCK_TIMEOUT.to_owned()),
        ("LOCK_INBOX", LOCK_INBOX.to_owned()),
        ("RENAME_TO_UNTIMED", RENAME_TO_UNTIMED.to_owned()),
        ("UNTIMED_KEY_CONSTRAINT", UNTIMED_KEY_CONSTRAINT.to_owned()),
        ("ATTACH_UNTIMED", ATTACH_UNTIMED.to_owned()),
    ]
}

/// What [`partition`] did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PartitionReport {
    /// An unpartitioned `inbox_messages` was converted (its rows now in `inbox_messages_untimed`).
    pub converted: bool,
    /// Converted: the start of its oldest partition. A message of an earlier time is not claimed: no partition holds
    /// it, and it is moved aside as unclaimable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub back_to: Option<DateTime<Utc>>,
    /// Partitions created, by name.
    pub created: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settings: Option<Settings>,
}

/// Makes `inbox_messages` partitioned with `settings` — converting an unpartitioned one in place, or checking that a
/// partitioned one has these settings — and its partitions cover `[now - back, now + AHEAD]` once converted (`back`:
/// [`BACK`] unless given, see [`check_back`]), and from the newest one's end (within that) on a later run: what a
/// cleanup dropped stays dropped. Safe to repeat, and to run again after it stopped half way. The caller holds the
/// migrate lock and has applied the migrations. `database`: its name, for the refusals.
pub async fn partition(
    conn: &mut PgConnection,
    settings: Settings,
    back: Option<TimeDelta>,
    database: &str,
) -> Result<PartitionReport> {
    let mut report = PartitionReport {
        settings: Some(settings),
        ..PartitionReport::default()
    };
    let given_back = back;
    let back = back.unwrap_or(BACK);
    check_back(settings, back)?;
    require_server(conn).await?;
    match read_layout(&mut *conn).await? {
        // Partitioned, its settings lost: written again, as the operator gives them.
        Some(None) => {
            tracing::warn!(
                "inbox_messages is partitioned but its settings were gone; writing the ones given, which must be \
                 those it was partitioned with"
            );
            run(conn, &comment_statement(&settings)).await?;
        }
        Some(Some(Layout::Partitioned(existing))) if existing != settings => {
            return Err(Error::Usage(format!(
                "inbox_messages is partitioned every {} on {}; it cannot be changed to every {} on {}: copies of \
                 the messages in the window would be keyed on another time than their originals and processed again",
                humantime::format_duration(existing.interval.to_std().unwrap_or_default()),
                existing.source.name(),
                humantime::format_duration(settings.interval.to_std().unwrap_or_default()),
                settings.source.name(),
            )));
        }
        Some(Some(Layout::Partitioned(_))) => {}
        Some(Some(Layout::Plain)) => {
            let refused = super::refusals::refusals(&mut *conn).await?;
            if !refused.is_empty() {
                return Err(Error::SchemaIncompatible {
                    database: database.to_owned(),
                    differences: refused,
                });
            }
            convert(conn, settings, back, database).await?;
            report.converted = true;
        }
        None => {
            return Err(Error::SchemaMissing {
                database: None,
                table: None,
            });
        }
    }
    // The window's past partitions at the conversion; on an inbox partitioned already (a migrate at every deploy),
    // only those after the newest there is (`make_missing`).
    report.created = if report.converted {
        let now = crate::db::external::database_now(&mut *conn).await?;
        report.back_to = intervals(settings, now - back, now + AHEAD)
            .next()
            .map(|(start, _)| start);
        ensure_partitions(&mut *conn, settings, now - back, now + AHEAD).await?
    } else {
        // Partitions before the oldest there is are not made again: a cleanup dropped them, their rows with them,
        // and a copy of one of their messages made anew would be taken for a message never seen.
        if given_back.is_some() {
            tracing::warn!(
                "--partition-back is taken only when the inbox is converted; this one is partitioned already, and \
                 no partition is made before its oldest (a cleanup may have dropped those, and their rows)"
            );
        }
        make_missing(&mut *conn, settings).await?
    };
    restore_owner(conn).await?;
    Ok(report)
}

/// Refuses a `back` (`--partition-back`) whose partitions, with those [`AHEAD`], are more than a conversion makes
/// ([`MAX_NEW_PARTITIONS`]): it makes the oldest first, and would leave out the present.
pub fn check_back(settings: Settings, back: TimeDelta) -> Result<()> {
    let interval = settings.interval.num_seconds().max(1);
    // Whole intervals from `now - back` to `now + AHEAD`, the one each end falls in included.
    let needed = (back + AHEAD).num_seconds().div_euclid(interval) + 2;
    let most = i64::try_from(MAX_NEW_PARTITIONS).unwrap_or(i64::MAX);
    if needed > most {
        let longest = TimeDelta::seconds((most - 2) * interval) - AHEAD;
        return Err(Error::Usage(format!(
            "--partition-back {} would make {needed} partitions of {} with the {} ahead; a conversion makes at most \
             {MAX_NEW_PARTITIONS}: give a --partition-back of at most {}, or a longer --partitioned interval",
            humantime::format_duration(back.to_std().unwrap_or_default()),
            humantime::format_duration(settings.interval.to_std().unwrap_or_default()),
            humantime::format_duration(AHEAD.to_std().unwrap_or_default()),
            humantime::format_duration(longest.to_std().unwrap_or_default()),
        )));
    }
    Ok(())
}

/// Refuses a server older than a partitioned inbox needs: dropping a partition detaches it concurrently, and reading
/// the layout asks which are being detached, both PostgreSQL 14's. `migrate` asks before anything changes (its
/// migrations, and a dry run, included), rather than converting, then failing at every step after.
pub async fn require_server(conn: &mut PgConnection) -> Result<()> {
    let version = crate::db::server_version(&mut *conn).await?;
    if version < MIN_SERVER_VERSION {
        return Err(Error::Usage(format!(
            "a partitioned inbox needs PostgreSQL 14 or later; this server is {}.{}",
            version / 10_000,
            version % 10_000
        )));
    }
    Ok(())
}

/// The oldest PostgreSQL a partitioned inbox runs on (`DETACH PARTITION … CONCURRENTLY`, `pg_inherits.inhdetachpending`).
const MIN_SERVER_VERSION: i32 = 140_000;

/// Hands the partitioned inbox and its partitions to the owner of the table it was converted from, when another role
/// (a superuser, a member of the owner's role) converted it: made by this role, they were this role's, and only the
/// owner makes and drops partitions — a cleanup run as the service's own role would make none ahead, and past them
/// every claim is refused. Where this role may not hand them over, it says so. (Run again on a later `migrate`: a
/// conversion that stopped after its swap is handed over then.)
async fn restore_owner(conn: &mut PgConnection) -> Result<()> {
    let Some((owner, may)): Option<(String, bool)> = sql::query_as(OWNER_TO_RESTORE)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(());
    };
    if !may {
        tracing::warn!(
            owner = %crate::sanitize::text(&owner),
            "the partitioned inbox_messages belongs to this role, not to the owner of the table it was converted \
             from, and this role may not hand it over: only its owner makes the partitions ahead, so run cleanup as \
             this role, or hand the table and its partitions over (ALTER TABLE ... OWNER TO)"
        );
        return Ok(());
    }
    // Each table in a transaction of its own (its lock waited for at most `SET_LOCAL_LOCK_TIMEOUT`, and tried again),
    // the partitions first and the parent last: one busy partition holds up no claim for long, and a run that stops
    // half way is finished by the next `migrate` (the parent still this role's).
    let partitions: Vec<String> = sql::query_scalar(PARTITIONS_OWNED)
        .fetch_all(&mut *conn)
        .await?;
    for table in partitions
        .iter()
        .map(String::as_str)
        .chain(["inbox_messages"])
    {
        if let Err(e) = hand_over(conn, table, &owner).await {
            if crate::db::sqlstate(&e).as_deref() != Some("42501") {
                return Err(e.into());
            }
            tracing::warn!(
                owner = %crate::sanitize::text(&owner),
                table,
                error = %crate::db::errors::describe(&e),
                "the partitioned inbox_messages could not be handed back to its owner: only its owner makes the \
                 partitions ahead, so run cleanup as this role, or hand the table and its partitions over \
                 (ALTER TABLE ... OWNER TO)"
            );
            return Ok(());
        }
    }
    Ok(())
}

/// Hands `table` to `owner`, its lock waited for at most `SET_LOCAL_LOCK_TIMEOUT` and tried again while busy.
async fn hand_over(conn: &mut PgConnection, table: &str, owner: &str) -> sqlx::Result<()> {
    let mut tries = 0;
    loop {
        tries += 1;
        let handed = async {
            let mut tx = conn.begin().await?;
            run(&mut tx, SET_LOCAL_LOCK_TIMEOUT).await?;
            run(&mut tx, &owner_statement(table, owner)).await?;
            tx.commit().await
        }
        .await;
        match handed {
            Err(e) if tries < 30 && crate::db::sqlstate(&e).as_deref() == Some("55P03") => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// The conversion (see the module documentation): every step but the last takes no lock that stops the consumers.
async fn convert(
    conn: &mut PgConnection,
    settings: Settings,
    back: TimeDelta,
    database: &str,
) -> Result<()> {
    with_lock_retries(conn, ADD_COLUMNS).await?;
    if index_state(conn, "inbox_messages_untimed_key").await? == Some(false) {
        run(conn, DROP_UNTIMED_KEY).await?;
    }
    run(conn, BUILD_UNTIMED_KEY).await?;
    let exists: bool = sql::query_scalar(INBOX_CONSTRAINT_EXISTS)
        .bind("inbox_messages_untimed_time")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        with_lock_retries(conn, ADD_UNTIMED_CHECK).await?;
    }
    run(conn, VALIDATE_UNTIMED_CHECK).await?;
    let key = crate::db::schema::inbox_primary_key(conn)
        .await?
        .ok_or_else(|| Error::SchemaIncompatible {
            database: database.to_owned(),
            differences: vec!["inbox_messages has no primary key".to_owned()],
        })?;
    let grants: Vec<(Option<String>, String, bool)> =
        sql::query_as(INBOX_GRANTS).fetch_all(&mut *conn).await?;
    let premade = premake(conn, settings, back).await?;
    crate::failpoint::hit("partitions-premade").await;
    let mut tries = 0;
    loop {
        tries += 1;
        match swap(conn, &key, &grants, settings, back, &premade).await {
            Ok(()) => {
                // Between the swap and what `partition` does next (a test holds the conversion here).
                crate::failpoint::hit("partitioned-swapped").await;
                return Ok(());
            }
            Err(e) if tries < 30 && crate::db::sqlstate(&e).as_deref() == Some("55P03") => {
                tracing::info!(
                    "inbox_messages is busy (a long transaction holds it); trying again"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Makes the window's partitions as tables of their own, each statement its own transaction, before the swap: made
/// under the swap's lock they held every claim behind it for as long (241 tables at `1h`, seconds), where attaching
/// tables made beforehand takes a fraction of it. (A swap that comes an interval later, tried again behind a long
/// transaction, makes the one partition ahead it then needs under its lock.) The starts of those made.
async fn premake(
    conn: &mut PgConnection,
    settings: Settings,
    back: TimeDelta,
) -> Result<BTreeSet<DateTime<Utc>>> {
    // The database's time, as every maker of partitions reads it (`make_missing`).
    let now = crate::db::external::database_now(&mut *conn).await?;
    let mut made = BTreeSet::new();
    for (start, _) in intervals(settings, now - back, now + AHEAD).take(MAX_NEW_PARTITIONS) {
        let name = partition_name(start);
        run(conn, &premade_table_statement(&name)).await?;
        for (index, definition) in INBOX_INDEXES {
            run(conn, &premade_index_statement(&name, index, definition)).await?;
        }
        // Marked as a drop marks what it detaches: one a stopped conversion leaves, whose interval the window no
        // longer holds when the next one runs, is a cleanup's to drop; the mark is taken off as it is attached.
        run(conn, &super::drop::mark_statement(&name)).await?;
        made.insert(start);
    }
    Ok(made)
}

/// The conversion's one transaction: the table renamed `inbox_messages_untimed`, a partitioned `inbox_messages` made
/// in its place with the same grants, the old table attached below every time, and the window's partitions attached
/// (`premade`: the starts of those made beforehand, each attached, none left a table of its own). The lock is waited for at most `SET_LOCK_TIMEOUT`, so the claims queued
/// behind it never wait longer; how long it was held is logged.
async fn swap(
    conn: &mut PgConnection,
    key: &str,
    grants: &[(Option<String>, String, bool)],
    settings: Settings,
    back: TimeDelta,
    premade: &BTreeSet<DateTime<Utc>>,
) -> sqlx::Result<()> {
    let mut tx = conn.begin().await?;
    // The database's time (the transaction's start, the same all through it), read before the lock is taken.
    let now = crate::db::external::database_now(&mut *tx).await?;
    run(&mut tx, SET_LOCAL_LOCK_TIMEOUT).await?;
    run(&mut tx, LOCK_INBOX).await?;
    let locked = std::time::Instant::now();
    run(&mut tx, RENAME_TO_UNTIMED).await?;
    run(&mut tx, &drop_key_statement(key)).await?;
    for (index, _) in INBOX_INDEXES {
        run(&mut tx, &rename_index_statement(index)).await?;
    }
    run(&mut tx, UNTIMED_KEY_CONSTRAINT).await?;
    run(&mut tx, &create_partitioned_statement(key)).await?;
    for (index, definition) in INBOX_INDEXES {
        run(&mut tx, &create_index_statement(index, definition)).await?;
    }
    for (grantee, privilege, grantable) in grants {
        if let Some(grant) = grant_statement(privilege, grantee.as_deref(), *grantable) {
            run(&mut tx, &grant).await?;
        }
    }
    run(&mut tx, ATTACH_UNTIMED).await?;
    // The window's time partitions in the same transaction: once the partitioned layout is seen, a consumer claims
    // with the message's time, and a time no partition held yet would be refused as unclaimable (seen: messages of a
    // consumer running through the conversion dead-lettered in the moment between this commit and the partitions).
    let mut starts = premade.clone();
    starts.extend(
        intervals(settings, now - back, now + AHEAD)
            .take(MAX_NEW_PARTITIONS)
            .map(|(start, _)| start),
    );
    let schema: String = sql::query_scalar(INBOX_SCHEMA).fetch_one(&mut *tx).await?;
    for start in starts {
        if !premade.contains(&start) {
            run(&mut tx, &create_table_statement(&schema, start)).await?;
        }
        run(
            &mut tx,
            &attach_statement(&schema, start, start + settings.interval),
        )
        .await?;
        if premade.contains(&start) {
            run(
                &mut tx,
                &super::drop::unmark_statement(&partition_name(start)),
            )
            .await?;
        }
    }
    run(&mut tx, &comment_statement(&settings)).await?;
    tx.commit().await?;
    tracing::info!(
        held_ms = locked.elapsed().as_millis(),
        "inbox_messages swapped for the partitioned table: its lock held this long, the claims behind it waiting"
    );
    Ok(())
}

/// Runs `statement` with a short lock timeout, trying again while the consumers' transactions hold the table.
async fn with_lock_retries(conn: &mut PgConnection, statement: &str) -> Result<()> {
    run(conn, SET_LOCK_TIMEOUT).await?;
    let mut tries = 0;
    let result = loop {
        tries += 1;
        match run(conn, statement).await {
            Err(e) if tries < 30 && crate::db::sqlstate(&e).as_deref() == Some("55P03") => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            other => break other,
        }
    };
    run(conn, RESET_LOCK_TIMEOUT).await?;
    Ok(result?)
}

async fn index_state(conn: &mut PgConnection, name: &str) -> sqlx::Result<Option<bool>> {
    sql::query_scalar(INDEX_STATE)
        .bind(name)
        .fetch_optional(conn)
        .await
}
