//! A partitioned inbox (`migrate --partitioned`): keyed on a time every copy of a message carries, so that a copy
//! arriving days later meets its original in its partition; messages without a usable time moved aside with the
//! reason; an inbox with rows converted in place under a running consumer; retention by dropping whole partitions.
//! (Every guarantee test of `in_both_modes!` also runs on a partitioned inbox: `…::partitioned_inbox`.)

use crate::common;

use std::time::Duration;

use chrono::{TimeDelta, Utc};
use common::{CARRIER_QUEUE, EVENT_EXCHANGE, TestEnv};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

/// A UUIDv7 whose time is `ago` before now.
fn v7_ago(ago: TimeDelta) -> Uuid {
    let at = Utc::now() - ago;
    Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        u64::try_from(at.timestamp()).unwrap(),
        at.timestamp_subsec_nanos(),
    ))
}

/// A migrated database whose inbox is partitioned by day on the message id's time (in-process, not by the binary).
async fn partitioned_by_day() -> TestEnv {
    let env = TestEnv::migrated().await;
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    inboxctl::db::schema::migrate_partitioned(
        &db,
        false,
        Some(inboxctl::db::partitions::Settings {
            interval: TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        }),
    )
    .await
    .unwrap();
    env
}

fn migrate_partitioned(env: &TestEnv, args: &[&str]) -> common::Output {
    let mut all = vec!["migrate", "--partitioned", "1d"];
    all.extend_from_slice(args);
    env.run(&all)
}

/// A message refused before the database is asked (its time, 1990, before any partition there can be) arriving while
/// PostgreSQL is unreachable does not end the outage: intake stays held until a claim answers. It used to mark
/// PostgreSQL back ("taking deliveries again") on the refusal, the next deliveries taken only to fail on the outage.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_message_refused_before_the_database_is_asked_does_not_end_an_outage() {
    let env = partitioned_by_day().await;
    common::ensure_endpoints(&env).await;
    let proxy = common::Proxy::start("127.0.0.1:5432").await;
    let proxied = proxy.postgres_url(&env.db_name);
    let ancient = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, 631_152_000, 0));
    // Held before it is read until the outage has begun.
    let hold = format!("handle=sleep-once-4000@{ancient}");
    let mut consumer = env.spawn_with(
        &["consume", "carrier", "--concurrency", "2"],
        &[
            ("DATABASE_URL", proxied.as_str()),
            ("INBOXCTL_FAILPOINTS", hold.as_str()),
        ],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(60));
    send(&env, ancient).await;
    consumer.wait_for_stderr("failpoint handle reached", Duration::from_secs(30));
    proxy.cut();
    send(&env, Uuid::now_v7()).await;
    consumer.wait_for_stderr("PostgreSQL unavailable", Duration::from_secs(30));
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::eventually(
        "the message of 1990 moved aside",
        Duration::from_secs(30),
        || async { env.queue_exists(&error_queue) && env.queue_counts(&error_queue).0 == 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !consumer.stderr().contains("PostgreSQL is back"),
        "the outage taken for over while PostgreSQL is unreachable: {}",
        consumer.stderr()
    );
    proxy.restore();
    consumer.wait_for_stderr("PostgreSQL is back", Duration::from_secs(60));
    common::eventually(
        "the message of now processed",
        Duration::from_secs(30),
        || async { env.queue_counts(CARRIER_QUEUE) == (0, 0) },
    )
    .await;
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// An adopted inbox a partitioned one could not hold — a column of the operator's (nullable, which inboxctl accepts
/// unpartitioned), or a `received_at` that may be null — is refused before anything changes, each named (exit 78).
/// The conversion used to add its columns and its index to the table, then fail at the swap on every run. So is a
/// foreign key of another table referencing the inbox (the swap drops the key it depends on, after building the new
/// one on the whole table). Once all are settled, it converts.
#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_a_partitioned_one_could_not_hold_is_refused_before_anything_changes() {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql(
        "ALTER TABLE inbox_messages ADD COLUMN note text;
         ALTER TABLE inbox_messages ADD COLUMN message_time text;
         ALTER TABLE inbox_messages ALTER COLUMN received_at DROP NOT NULL;
         CREATE TABLE receipts (id uuid, consumer_type varchar(500),
             CONSTRAINT receipts_of FOREIGN KEY (id, consumer_type) REFERENCES inbox_messages (id, consumer_type));",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr
            .contains("foreign key receipts_of of receipts references inbox_messages"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("column note (text)"), "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("database \"{}\"", env.db_name)),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("received_at may be null"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("column message_time is text"),
        "{}",
        out.stderr
    );
    let added: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_attribute WHERE attrelid = 'inbox_messages'::regclass \
         AND attname = 'fingerprint'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(added, 0, "nothing changed");
    sqlx::raw_sql(
        "DROP TABLE receipts;
         ALTER TABLE inbox_messages DROP COLUMN note;
         ALTER TABLE inbox_messages DROP COLUMN message_time;
         ALTER TABLE inbox_messages ALTER COLUMN received_at SET NOT NULL;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
}

/// What hangs on the plain table by its identity would stay with the rows from before a conversion (renamed
/// `inbox_messages_untimed`) or be lost: row-level security (the partitioned table would let every grantee read and
/// write every row), a grant on columns (a writer holding only that refused from the swap on), a trigger, a view and a
/// publication (each seeing the old rows only), a collation other than the type's (the swap failing on every run).
/// Each is refused before anything changes, named, and the conversion goes once they are gone.
#[tokio::test(flavor = "multi_thread")]
async fn what_a_conversion_would_leave_behind_or_lose_is_refused_before_anything_changes() {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let role = format!("{}_writer", env.db_name);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE inbox_messages ENABLE ROW LEVEL SECURITY;
         CREATE ROLE \"{role}\";
         GRANT INSERT (id, consumer_type, received_at) ON inbox_messages TO \"{role}\";
         CREATE FUNCTION noted() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
         CREATE TRIGGER inbox_noted BEFORE INSERT ON inbox_messages FOR EACH ROW EXECUTE FUNCTION noted();
         CREATE VIEW unprocessed_inbox AS SELECT id FROM inbox_messages WHERE processed_at IS NULL;
         CREATE PUBLICATION inbox_cdc FOR TABLE inbox_messages;
         ALTER TABLE inbox_messages ALTER COLUMN consumer_type TYPE varchar(500) COLLATE \"C\";"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(78), "{out:?}");
    for words in [
        "row-level security is enabled on inbox_messages",
        "privileges are granted on column consumer_type alone",
        "trigger inbox_noted is on inbox_messages",
        "view unprocessed_inbox reads inbox_messages",
        "publication inbox_cdc publishes inbox_messages",
        "column consumer_type has a collation other than its type's",
    ] {
        assert!(out.stderr.contains(words), "{words}: {}", out.stderr);
    }
    let added: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_attribute WHERE attrelid = 'inbox_messages'::regclass \
         AND attname = 'fingerprint'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(added, 0, "nothing changed");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE inbox_messages DISABLE ROW LEVEL SECURITY;
         REVOKE ALL (id, consumer_type, received_at) ON inbox_messages FROM \"{role}\";
         DROP TRIGGER inbox_noted ON inbox_messages;
         DROP VIEW unprocessed_inbox;
         DROP PUBLICATION inbox_cdc;
         ALTER TABLE inbox_messages ALTER COLUMN consumer_type TYPE varchar(500) COLLATE \"default\";"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP ROLE \"{role}\"")))
        .execute(&pool)
        .await
        .unwrap();
}

/// Publishes a MassTransit `ParcelCreatedEvent` with message id `id` (the same bytes each time for the same `body`).
async fn send(env: &TestEnv, id: Uuid) -> (lapin::BasicProperties, Vec<u8>) {
    let (props, body, _) = common::parcel_message(id, "Berlin");
    common::publish(&env.amqp().await, EVENT_EXCHANGE, "", props.clone(), &body).await;
    (props, body)
}

/// Which partition holds each id's carrier row.
async fn partition_of(pool: &sqlx::PgPool, id: Uuid) -> Vec<String> {
    partition_of_key(pool, id, CARRIER_QUEUE).await
}

/// Which partitions hold `id`'s rows of `consumer_type`.
async fn partition_of_key(pool: &sqlx::PgPool, id: Uuid, consumer_type: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT tableoid::regclass::text FROM inbox_messages WHERE id = $1 AND consumer_type = $2",
    )
    .bind(id)
    .bind(consumer_type)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_late_copy_meets_its_original_in_its_messages_partition_one_by_one_and_batched() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains("partitioned every 1day on the time inside the message id"),
        "{}",
        out.stdout
    );
    // Settings once chosen stay: another time would key the copies in the window elsewhere than their originals.
    let out = env.run(&[
        "migrate",
        "--partitioned",
        "1d",
        "--partition-time",
        "sent-time",
    ]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("cannot be changed"), "{}", out.stderr);
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;

    for mode in [common::ONE_BY_ONE, common::BATCHED] {
        // Messages sent three and six days ago, an hour ago, and a NewId of now.
        let ids = [
            v7_ago(TimeDelta::days(6)),
            v7_ago(TimeDelta::days(3)),
            v7_ago(TimeDelta::hours(1)),
            inboxctl::ids::new_id(),
        ];
        let mut sent = Vec::new();
        for id in ids {
            sent.push(send(&env, id).await);
        }
        let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
        assert!(
            out.stderr
                .contains("each message is claimed on the time inside the message id"),
            "the consumer says which time it uses: {}",
            out.stderr
        );
        for id in ids {
            let expected = inboxctl::db::partitions::partition_name(
                inboxctl::db::partitions::Settings {
                    interval: TimeDelta::days(1),
                    source: inboxctl::inbox::TimeSource::Id,
                }
                .floor(inboxctl::inbox::time::id_time(id)),
            );
            assert_eq!(
                partition_of(&pool, id).await,
                vec![expected],
                "{id}: the row is in the partition of the message's own time, not of when it arrived"
            );
        }
        // Copies arriving now (every one received today, days after three of the originals): all duplicates.
        let conn = env.amqp().await;
        for (props, body) in &sent {
            common::publish(&conn, EVENT_EXCHANGE, "", props.clone(), body).await;
        }
        let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));
        assert!(
            out.stderr.contains("processed=0 duplicates=4"),
            "{mode:?}: {}",
            out.stderr
        );
    }
    let (effects, parcels): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((effects, parcels), (8, 8), "each message once");
    let fingerprints: i64 = sqlx::query_scalar("SELECT count(fingerprint) FROM inbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        fingerprints, 8,
        "the fingerprint is kept in the inbox row itself"
    );
    let out = env.run(&["stats", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let carrier = json["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_type"] == CARRIER_QUEUE)
        .unwrap()
        .clone();
    assert_eq!(carrier["rows"], 8);
}

/// One by one and batched: batched, the claim of a batch whose member has a time no partition holds fails for all,
/// and is not taken for the present missing its partition (which holds every message, as an outage) because another
/// member is of now — the member found one by one and moved aside.
#[tokio::test]
async fn a_message_without_a_usable_time_is_moved_aside_with_the_reason_and_the_rest_flow() {
    common::clear_of_midnight().await;
    for mode in [common::ONE_BY_ONE, &["--batch-size", "8"][..]] {
        moved_aside_without_a_usable_time(mode).await;
    }
}

async fn moved_aside_without_a_usable_time(mode: &[&str]) {
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    common::ensure_endpoints(&env).await;
    // A random id read as a NewId: its "time" in the year 58000; a UUIDv7 of 2099; one of 1990.
    let random = Uuid::from_u128(0x0123_4567_89ab_4cde_8f01_ffff_ffff_ffff);
    let future = Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        4_070_908_800,
        0,
    ));
    let ancient = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, 631_152_000, 0));
    // A UUIDv7 of 2020: after 2000, before the oldest partition (one cleanup dropped, as it were).
    let dropped = Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        1_577_836_800,
        0,
    ));
    for id in [random, future, ancient, dropped, Uuid::now_v7()] {
        send(&env, id).await;
    }
    // A pool of one connection: what the refusal means is read on the attempt's own connection (on another, the
    // pool's only one being the attempt's, the read timed out and the message was held for ever as if the partitions
    // ahead ran out).
    let out = common::consume_until_idle(
        &env,
        &common::with_mode(&["carrier", "--concurrency", "1", "--pool-size", "1"], mode),
    );
    assert!(out.stderr.contains("processed=1"), "{}", out.stderr);
    let conn = env.amqp().await;
    let dead = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    let mut reasons: Vec<(String, String)> = dead
        .iter()
        .map(|d| {
            (
                d.properties.message_id().as_ref().unwrap().to_string(),
                common::header_text(&d.properties, "MT-Fault-Message").unwrap(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 4, "{reasons:#?}");
    for (id, reason) in &reasons {
        assert!(
            reason.starts_with("the inbox cannot claim this message"),
            "{id}: {reason}"
        );
        let expected = if *id == ancient.to_string() {
            "is before 2000"
        } else {
            "is in no partition of the inbox"
        };
        assert!(reason.contains(expected), "{id}: {reason}");
    }
    assert_eq!(
        common::header_text(&dead[0].properties, "MT-Fault-ExceptionType").as_deref(),
        Some("inboxctl::UnclaimableMessage")
    );
    if !mode.is_empty() {
        return;
    }

    // Partitioned on the sent time: a plain JSON message carries none.
    let env = TestEnv::bare().await;
    assert_eq!(
        migrate_partitioned(&env, &["--partition-time", "sent-time"]).code,
        Some(0)
    );
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let plain =
        lapin::BasicProperties::default().with_message_id(Uuid::new_v4().to_string().into());
    let body = br#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT1", "destination": "Berlin"}"#;
    common::publish(&conn, EVENT_EXCHANGE, "", plain, body).await;
    send(&env, Uuid::new_v4()).await;
    let out = common::consume_until_idle(&env, &["carrier", "--batch-size", "8"]);
    assert!(out.stderr.contains("processed=1"), "{}", out.stderr);
    let dead = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(dead.len(), 1);
    let reason = common::header_text(&dead[0].properties, "MT-Fault-Message").unwrap();
    assert!(
        reason.contains("partitioned on the envelope's sentTime, else the AMQP timestamp, which this message does not carry"),
        "{reason}"
    );
}

#[tokio::test]
async fn an_inbox_with_rows_is_converted_in_place_under_a_running_consumer_and_old_copies_stay_duplicates()
 {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    // 200 messages processed before the conversion, their rows in the unpartitioned table.
    let mut before = Vec::new();
    for _ in 0..200 {
        before.push(send(&env, Uuid::now_v7()).await);
    }
    common::consume_until_idle(&env, &["carrier"]);
    let table: (i64, i64) = sqlx::query_as(
        "SELECT relfilenode::int8, (SELECT count(*) FROM inbox_messages) FROM pg_class \
         WHERE oid = 'inbox_messages'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(table.1, 200);

    // A consumer running through the conversion, with messages flowing.
    let mut consumer = env.spawn(&["consume", "carrier", "--concurrency", "8"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        "2000",
        "--duplicates",
        "0.1",
        "--rate",
        "400",
    ]);
    common::eventually("a stream under way", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 600
    })
    .await;
    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("converted in place"), "{}", out.stdout);
    assert_eq!(publisher.wait(Duration::from_secs(180)), Some(0));

    // Copies of the messages processed before the conversion: their rows are untimed, and still their claims.
    let conn = env.amqp().await;
    for (props, body) in &before {
        common::publish(&conn, EVENT_EXCHANGE, "", props.clone(), body).await;
    }
    let done = common::within(Duration::from_secs(180), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 2200
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    if !done {
        let effects = common::count(&pool, "SELECT count(*) FROM carrier_reservations").await;
        let unprocessed = common::count(
            &pool,
            "SELECT count(*) FROM inbox_messages WHERE processed_at IS NULL",
        )
        .await;
        let error_queue = format!("{CARRIER_QUEUE}_error");
        let dead = if env.queue_exists(&error_queue) {
            Some(env.queue_counts(&error_queue))
        } else {
            None
        };
        panic!(
            "not every parcel's effect after 180 s: {effects} effects of 2200, {unprocessed} inbox rows unprocessed, \
             queue (ready, unacked) {:?}, error queue {dead:?}; migrate said: {out:?}; the consumer said: {}",
            env.queue_counts(CARRIER_QUEUE),
            consumer.stderr()
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
    let (effects, parcels): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (effects, parcels),
        (2200, 2200),
        "every parcel once, across the conversion"
    );
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error"))
            || env.queue_counts(&format!("{CARRIER_QUEUE}_error")) == (0, 0),
        "nothing dead-lettered by the conversion"
    );
    // The old table is the untimed partition, the same file: not a row was copied.
    let untimed: (i64, i64) = sqlx::query_as(
        "SELECT relfilenode::int8, (SELECT count(*) FROM inbox_messages_untimed) FROM pg_class \
         WHERE oid = 'inbox_messages_untimed'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        untimed.0, table.0,
        "the unpartitioned table became the untimed partition as it was"
    );
    assert!(
        untimed.1 >= 200,
        "its rows, and those written before the swap: {}",
        untimed.1
    );
    // Its key is the partition of the partitioned table's primary key, and a primary key itself: PostgreSQL 17
    // attaches a partition's key to the parent's only when both are of one kind (else it builds another under the
    // swap's lock, and fails, a table having one primary key).
    let keys: Vec<(String, String)> = sqlx::query_as(
        "SELECT conname::text, contype::text FROM pg_constraint \
         WHERE conrelid = 'inbox_messages_untimed'::regclass AND contype IN ('p', 'u') \
           AND conparentid = (SELECT oid FROM pg_constraint \
                              WHERE conrelid = 'inbox_messages'::regclass AND contype = 'p')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        keys,
        [("inbox_messages_untimed_pk".to_owned(), "p".to_owned())],
        "the untimed partition's key, attached to the parent's"
    );
    let stderr = consumer.stderr();
    let copies = stderr.matches("duplicate discarded").count();
    assert!(
        copies >= 200 + 200,
        "the old copies and the published ones were discarded: {copies}"
    );
}

/// A consumer running through the conversion meets the partitioned layout the moment its swap commits, and claims
/// with each message's time from then on: the partitions of the window must be there at that moment, not made after
/// it, or a message arriving in between is refused as unclaimable and dead-lettered (seen once in CI). The conversion
/// is held just after its swap while messages arrive.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn messages_arriving_just_after_the_conversions_swap_are_claimed_not_refused() {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let mut consumer = env.spawn(&["consume", "carrier", "--concurrency", "4"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    let mut migrate = env.spawn_with(
        &["migrate", "--partitioned", "1d"],
        &[("INBOXCTL_FAILPOINTS", "partitioned-swapped=sleep-once-4000")],
    );
    migrate.wait_for_stderr(
        "failpoint partitioned-swapped reached",
        Duration::from_secs(60),
    );
    for _ in 0..40 {
        send(&env, Uuid::now_v7()).await;
    }
    assert_eq!(
        migrate.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        migrate.stderr()
    );
    let done = common::within(Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await >= 40
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let dead = env
        .queue_exists(&error_queue)
        .then(|| env.queue_counts(&error_queue));
    assert!(
        done && dead.is_none_or(|counts| counts == (0, 0)),
        "every message claimed across the swap: {} effects of 40, error queue {dead:?}; the consumer said: {}",
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A repeated `migrate --partitioned` (at every deploy, say) made the window's past partitions again, those a cleanup
/// had dropped included: a late copy of a message of those days was then claimed as a message never seen and
/// processed again, where the partition's absence moves it aside. Only those after the newest there is are made
/// now: where the partitions ran out (no cleanup made them ahead), the days since, whose messages are held for them.
#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_migrate_does_not_make_again_the_partitions_a_cleanup_dropped() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let pool = env.pool().await;
    let attached = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname <> 'inbox_messages_untimed'",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let before = attached().await;
    let out = env.run(&["cleanup", "--retention", "2d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let after_cleanup = attached().await;
    let dropped: Vec<&String> = before
        .iter()
        .filter(|p| !after_cleanup.contains(p))
        .collect();
    assert!(
        dropped.len() >= 4,
        "the cleanup drops the days past its window: {out:?}"
    );

    // And the partitions ran out meanwhile (no cleanup made them ahead): none from yesterday on.
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let yesterday =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() - TimeDelta::days(1)));
    let today = inboxctl::db::partitions::partition_name(settings.floor(Utc::now()));
    for name in after_cleanup.iter().filter(|p| **p >= yesterday) {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE \"{name}\"")))
            .execute(&pool)
            .await
            .unwrap();
    }

    // One made far ahead (an operator's, a clock ahead) does not end the days that ran out before it.
    let far = a_partition_far_ahead(&env).await;

    // A cleanup first (what the held messages' log line says to run), then a migrate: each makes the partitions
    // from the newest begun on, and neither those it dropped.
    for run in [
        &["cleanup", "--retention", "2d", "--force", "--json"][..],
        &["migrate", "--partitioned", "1d"],
    ] {
        let out = env.run(run);
        assert_eq!(out.code, Some(0), "{out:?}");
        let again = attached().await;
        let made_again: Vec<&&String> = dropped.iter().filter(|p| again.contains(p)).collect();
        assert!(
            made_again.is_empty(),
            "made again by {run:?}: {made_again:?}"
        );
        // From the newest there was on: the messages held for the days the partitions ran out have theirs.
        assert!(again.contains(&yesterday), "{run:?}: {again:?}");
        assert!(again.contains(&today), "{run:?}: {again:?}");
        for name in again
            .iter()
            .filter(|p| **p >= yesterday && **p < far_name(&settings, far))
        {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE \"{name}\"")))
                .execute(&pool)
                .await
                .unwrap();
        }
    }

    // With a retention shorter than the days run out: yesterday is past the window, yet messages of yesterday are
    // held for its partition (never processed). A cleanup that made partitions from its cutoff only left them to be
    // moved aside once today's partition was made; it makes yesterday's too now, and keeps it this run. The retention
    // is an hour, or in the first hour of the day less than the time since midnight: its cutoff is in today.
    let since_midnight = (Utc::now() - settings.floor(Utc::now())).num_seconds();
    let retention = format!("{}s", (since_midnight - 2).clamp(1, 3600));
    let out = env.run(&["cleanup", "--retention", &retention, "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let again = attached().await;
    assert!(again.contains(&yesterday), "{again:?}: {out:?}");
    assert!(
        out.stdout.contains("made by this run for messages held"),
        "{out:?}"
    );
}

fn far_name(settings: &inboxctl::db::partitions::Settings, at: chrono::DateTime<Utc>) -> String {
    inboxctl::db::partitions::partition_name(settings.floor(at))
}

/// A day's partition 60 days ahead (an operator's; one a clock ahead made), on an inbox partitioned by day; its time.
async fn a_partition_far_ahead(env: &TestEnv) -> chrono::DateTime<Utc> {
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    let mut conn = db.connect().await.unwrap();
    let far = Utc::now() + TimeDelta::days(60);
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    inboxctl::db::partitions::ensure_partitions(&mut conn, settings, far, far)
        .await
        .unwrap();
    far
}

/// The tables of the window's partitions (`relispartition`) and those of their names that are tables of their own.
#[cfg(feature = "failpoints")]
async fn partition_tables(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE relispartition), count(*) FILTER (WHERE NOT relispartition) FROM pg_class \
         WHERE relname ~ '^inbox_messages_p[0-9]{8}_[0-9]{6}$' AND relkind = 'r'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The conversion makes the window's partitions, with their key and indexes, before its swap: made under the swap's
/// lock, they held every claim behind it for as long (measured at `1h`, 241 partitions: claims held 1.8–2.7 s, where
/// attaching tables made beforehand holds them 0.4–0.6 s). A conversion killed between the two leaves those tables;
/// the next one takes those of its window as they are and attaches them.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn the_conversion_makes_its_partitions_before_its_swap_and_a_stopped_one_leaves_them_for_the_next()
 {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let mut migrate = env.spawn_with(
        &["migrate", "--partitioned", "1d"],
        &[("INBOXCTL_FAILPOINTS", "partitions-premade")],
    );
    migrate.wait_for_stderr(
        "failpoint partitions-premade reached",
        Duration::from_secs(60),
    );
    let (attached, own) = partition_tables(&pool).await;
    assert_eq!(attached, 0, "nothing attached before the swap");
    assert!(
        own >= 11,
        "the window's 11 days made before the swap: {own}"
    );
    let indexes = common::count(
        &pool,
        "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid \
         WHERE c.relname ~ '^inbox_messages_p[0-9]{8}_[0-9]{6}$'",
    )
    .await;
    assert_eq!(
        indexes,
        own * 4,
        "each with the key and the three indexes of the partitioned table"
    );
    migrate.kill();
    let layout: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'inbox_messages'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(layout, "r", "killed before its swap: the inbox as it was");

    let out = migrate_partitioned(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    // Attached, none keeps the mark of a table to be dropped: detached by an operator later, it is theirs.
    let marked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i WHERE i.inhparent = 'inbox_messages'::regclass \
         AND obj_description(i.inhrelid, 'pg_class') = $1",
    )
    .bind(inboxctl::db::partitions::DETACHING)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(marked, 0);
    // Every table of the window made before is attached; one left a table of its own can only be of a day the window
    // no longer holds (the day turned between the two runs), empty, for a cleanup to drop as a leftover.
    let (attached, left) = partition_tables(&pool).await;
    if left > 0 {
        let first_day = (Utc::now() - TimeDelta::days(7))
            .format("%Y%m%d")
            .to_string();
        let outside: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_class WHERE relname ~ '^inbox_messages_p[0-9]{8}_[0-9]{6}$' \
             AND relkind = 'r' AND NOT relispartition AND substr(relname, 17, 8) < $1",
        )
        .bind(first_day)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(left, outside, "a table of the window left unattached");
    }
    assert!(
        attached + left >= own,
        "{attached} partitions of {own} made"
    );
    // Each partition's key and indexes are those made before the swap, paired with the partitioned table's.
    let attached_indexes = common::count(
        &pool,
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE c.relname ~ '^ix_inbox_messages_p[0-9]{8}_[0-9]{6}_'",
    )
    .await;
    assert!(attached_indexes >= (own - left) * 3, "{attached_indexes}");
}

#[tokio::test]
async fn cleanup_drops_whole_partitions_past_the_window_and_keeps_those_it_must() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let pool = env.pool().await;
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let mut conn = db.connect().await.unwrap();
    inboxctl::db::partitions::ensure_partitions(
        &mut conn,
        settings,
        Utc::now() - TimeDelta::days(14),
        Utc::now(),
    )
    .await
    .unwrap();
    let day = |n: i64| settings.floor(Utc::now() - TimeDelta::days(n)) + TimeDelta::hours(12);
    let name = |n: i64| inboxctl::db::partitions::partition_name(settings.floor(day(n)));
    // Rows: (message day, consumer_type, processed how long ago; None: unprocessed).
    let rows: Vec<(i64, &str, Option<i64>)> = vec![
        (12, "a", Some(12)),
        (12, "b", Some(12)),
        (11, "a", Some(11)),
        (10, "a", None),     // unprocessed: its partition stays
        (10, "a", Some(10)), // beside it, processed long ago: deleted by batch
        (9, "a", Some(0)),   // a late copy processed now: its partition stays
        (8, "c", Some(8)),   // a consumer_type the run below leaves: its partition stays
        (3, "a", Some(3)),   // inside the window
    ];
    for (message_day, consumer_type, processed) in &rows {
        sqlx::query(
            "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
             VALUES ($1, $2, now(), now() - make_interval(days => $3), $4)",
        )
        .bind(Uuid::new_v4())
        .bind(consumer_type)
        .bind(processed.map(|d| d as i32))
        .bind(day(*message_day))
        .execute(&pool)
        .await
        .unwrap();
    }
    // A row from before the partitioning (untimed), processed long ago: deleted by batch. Its id has a timed row
    // too, processed yesterday (a writer that keys by another time, a re-send with another sentTime): another key,
    // which the batched delete must leave (it deletes by the whole key, not by the id).
    let shared = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         VALUES ($1, 'a', now() - interval '20 days', now() - interval '20 days')",
    )
    .bind(shared)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES ($1, 'a', now(), now() - interval '1 day', $2)",
    )
    .bind(shared)
    .bind(day(1))
    .execute(&pool)
    .await
    .unwrap();
    // A row past the window in the partition that holds the cutoff: it waits for its partition to go whole.
    let holds_cutoff = settings.floor(Utc::now() - TimeDelta::days(7));
    let waiting = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES ($1, 'a', $2, $2, $2)",
    )
    .bind(waiting)
    .bind(holds_cutoff)
    .execute(&pool)
    .await
    .unwrap();
    // The leftover of a drop that stopped between its detach and its drop (marked as a drop marks what it detaches);
    // and an operator's copy whose name begins the same way, none of the cleanup's business (it was dropped as a
    // leftover).
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE inbox_messages_p19990101_000000 (LIKE inbox_messages);
         COMMENT ON TABLE inbox_messages_p19990101_000000 IS '{}';
         CREATE TABLE inbox_messages_pre_partitioning (LIKE inbox_messages)",
        inboxctl::db::partitions::DETACHING
    )))
    .execute(&pool)
    .await
    .unwrap();

    let cleanup = |args: &[&str]| {
        let mut all = vec!["cleanup", "--retention", "7d", "--force", "--json"];
        all.extend_from_slice(args);
        let out = env.run(&all);
        assert!(matches!(out.code, Some(0 | 3)), "{out:?}");
        serde_json::from_str::<serde_json::Value>(&out.stdout).unwrap()
    };
    let dropped = |report: &serde_json::Value| -> Vec<String> {
        report["partitions"]["dropped"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["partition"].as_str().unwrap().to_owned())
            .collect()
    };
    let exists = |table: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
                .bind(table)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // A dry run drops nothing and says what it would.
    let report = cleanup(&["--dry-run"]);
    let would: Vec<String> = dropped(&report);
    assert!(
        would.contains(&name(12)) && would.contains(&name(11)),
        "{report:#}"
    );
    assert!(exists(name(12)).await);

    // Only "a" cleaned: the partitions holding "b" or "c" stay. Its dry run says what it does: the rows of the
    // partitions it would drop counted with them, not again among the rows deleted by batch (they were).
    let would = cleanup(&["--consumer-type", "a", "--dry-run"]);
    let report = cleanup(&["--consumer-type", "a"]);
    assert_eq!(dropped(&would), dropped(&report), "{would:#}\n{report:#}");
    assert_eq!(would["deleted"], report["deleted"], "{would:#}\n{report:#}");
    assert!(report["deleted"].as_u64().unwrap() >= 1, "{report:#}");
    let gone = dropped(&report);
    assert!(
        gone.contains(&name(11)) && gone.contains(&name(13)),
        "and the empty ones: {report:#}"
    );
    assert!(
        !gone.contains(&name(12)) && !gone.contains(&name(8)),
        "{report:#}"
    );
    assert!(
        report["partitions"]["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["partition"] == name(12) && k["why"].as_str().unwrap().contains("\"b\"")),
        "{report:#}"
    );
    let report = cleanup(&[]);
    let gone = dropped(&report);
    for dropped in [name(12), name(8)] {
        assert!(gone.contains(&dropped), "{dropped} dropped: {report:#}");
    }
    for kept in [name(10), name(9)] {
        assert!(!gone.contains(&kept), "{kept} kept: {report:#}");
    }
    assert!(!exists(name(12)).await && !exists(name(11)).await && !exists(name(8)).await);
    assert!(exists(name(10)).await && exists(name(9)).await && exists(name(3)).await);
    let kept: Vec<String> = report["partitions"]["kept"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| format!("{} {}", k["partition"], k["why"]))
        .collect();
    assert!(
        kept.iter()
            .any(|k| k.contains(&name(10)) && k.contains("unprocessed")),
        "{kept:#?}"
    );
    assert!(
        kept.iter()
            .any(|k| k.contains(&name(9)) && k.contains("within the window")),
        "{kept:#?}"
    );
    assert!(
        !exists("inbox_messages_p19990101_000000".to_owned()).await,
        "the leftover was dropped"
    );
    assert!(
        exists("inbox_messages_pre_partitioning".to_owned()).await,
        "the operator's table was kept"
    );
    // The untimed row went by the batched delete.
    let left: Vec<(String, String)> = sqlx::query_as(
        "SELECT tableoid::regclass::text, consumer_type::text FROM inbox_messages ORDER BY message_time",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        !left.iter().any(|(t, _)| t == "inbox_messages_untimed"),
        "{left:?}"
    );
    assert_eq!(
        left.iter()
            .filter(|row| **row == (name(10), "a".to_owned()))
            .count(),
        1,
        "the unprocessed row stays, and the processed one beside it in its kept partition went by batch: {left:?}"
    );
    let next = inboxctl::db::partitions::partition_name(holds_cutoff);
    assert_eq!(
        partition_of_key(&pool, waiting, "a").await,
        vec![next.clone()],
        "the row past the window in the partition holding the cutoff waits for the partition: {report:#}"
    );
    assert_eq!(
        report["partitions"]["next"]["partition"],
        next.as_str(),
        "{report:#}"
    );
    assert_eq!(
        partition_of_key(&pool, shared, "a").await,
        vec![name(1)],
        "the untimed row went, its id's timed row stays"
    );
    assert!(
        left.contains(&(name(9), "a".to_owned())),
        "the late copy's row stays: {left:?}"
    );
    assert!(
        left.contains(&(name(3), "a".to_owned())),
        "the row inside the window stays: {left:?}"
    );
    let audited: serde_json::Value = sqlx::query_scalar(
        "SELECT details FROM inboxctl_audit WHERE command = 'cleanup' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        audited["partitions_dropped"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{audited:#}"
    );
}

/// On a partitioned inbox the claim sent with its effect as one statement keys the message on its time: sixteen
/// copies at once meet in their partition and give one effect; a time no partition holds fails the statement, which
/// sends the message the usual way, and that refuses it as unclaimable, nothing written.
#[tokio::test(flavor = "multi_thread")]
async fn in_one_statement_copies_meet_in_their_partition_and_a_time_without_one_is_refused() {
    common::clear_of_midnight().await;
    let env = partitioned_by_day().await;
    let pool = env.pool().await;
    sqlx::raw_sql("CREATE TABLE effects (message_id uuid NOT NULL, label text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = inboxctl::inbox::Inbox::new(
        pool.clone(),
        inboxctl::inbox::ConsumerType::new("partitioned").unwrap(),
    )
    .with_keying(inboxctl::inbox::Keying::Timed(
        inboxctl::inbox::TimeSource::Id,
    ));
    let effect = |id: Uuid| {
        inboxctl::inbox::Effect::new(
            "INSERT INTO effects (message_id, label) SELECT $1::uuid, 'statement' FROM claimed",
        )
        .bind(id)
    };
    let send = |id: Uuid| {
        let inbox = inbox.clone();
        async move {
            inbox
                .process_effect(id, None, &Default::default(), effect(id), move |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effects VALUES ($1, 'usual')")
                            .bind(id)
                            .execute(tx)
                            .await?;
                        Ok(())
                    })
                })
                .await
        }
    };
    let id = v7_ago(TimeDelta::hours(1));
    let copies: Vec<_> = (0..16).map(|_| tokio::spawn(send(id))).collect();
    let mut processed = 0;
    for copy in copies {
        match copy.await.unwrap().unwrap() {
            inboxctl::inbox::Outcome::Processed(()) => processed += 1,
            inboxctl::inbox::Outcome::Duplicate => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(processed, 1);
    let made: Vec<String> = sqlx::query_scalar("SELECT label FROM effects WHERE message_id = $1")
        .bind(id)
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(made, ["statement"]);

    let future = v7_ago(-TimeDelta::days(400));
    let refused = send(future).await;
    assert!(
        matches!(&refused, Err(inboxctl::inbox::ProcessError::Unclaimable(why)) if why.contains("no partition")),
        "{refused:?}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM effects").await,
        1,
        "nothing written for the refused one"
    );
}

/// A cleanup that began on a plain inbox goes on with its plain batches after `migrate --partitioned` converted the
/// inbox under it: there a tuple id names a row in every partition. The batch deletes only the rows it picked — past
/// the window, of its consumer_type — not a fresh row, nor another consumer_type's, that sits at the same place in
/// another partition (whose deletion would let its message's next copy through as new).
#[tokio::test]
async fn a_plain_cleanup_batch_on_a_converted_inbox_deletes_only_rows_past_the_window() {
    common::clear_of_midnight().await;
    let env = partitioned_by_day().await;
    let pool = env.pool().await;
    let insert = |id: Uuid, consumer_type: &'static str, ago: TimeDelta| {
        let pool = pool.clone();
        async move {
            let at = Utc::now() - ago;
            sqlx::query(
                "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
                 VALUES ($1, $2, $3, $3, $3)",
            )
            .bind(id)
            .bind(consumer_type)
            .bind(at)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // Each the first row of its partition: the same tuple id, (0,1), in each.
    let old = v7_ago(TimeDelta::days(5));
    insert(old, "cleaned", TimeDelta::days(5)).await;
    let fresh = v7_ago(TimeDelta::zero());
    insert(fresh, "cleaned", TimeDelta::zero()).await;
    let others = v7_ago(TimeDelta::days(4));
    insert(others, "another", TimeDelta::days(4)).await;
    let places: Vec<String> =
        sqlx::query_scalar("SELECT ctid::text FROM inbox_messages ORDER BY message_time")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        places,
        ["(0,1)", "(0,1)", "(0,1)"],
        "one place in three partitions"
    );

    let deleted = inboxctl::db::cleanup::delete_processed_batch(
        &pool,
        inboxctl::db::cleanup::Rows::Processed,
        "cleaned",
        Utc::now() - TimeDelta::days(2),
        100,
    )
    .await
    .unwrap();
    let left: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM inbox_messages ORDER BY message_time")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, [others, fresh], "only the row past the window went");
    assert_eq!(deleted, 1);
}

/// Only a cleanup makes the partitions ahead, and a claim whose time none holds is refused: it makes them before
/// anything that may refuse or fail. Here its guard cannot reach RabbitMQ (to look at the dead-letter queues), and the
/// run fails — with the day after tomorrow's partition made. (It was made after the guard, so a cleanup failing there
/// every day left messages to be refused once the partitions ahead ran out.)
#[tokio::test]
async fn a_cleanup_whose_guard_fails_has_made_the_partitions_ahead() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let pool = env.pool().await;
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let ahead =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() + TimeDelta::days(2)));
    let exists = || async {
        sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
            .bind(&ahead)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE \"{ahead}\"")))
        .execute(&pool)
        .await
        .unwrap();
    assert!(!exists().await);
    // Something for the guard to look at: a consumer_type with a row past the window.
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES (gen_random_uuid(), 'a', now() - interval '9 days', now() - interval '9 days', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = common::Output::of(
        env.cmd()
            .env("AMQP_URL", "amqp://nobody:nothing@127.0.0.1:1/nothing")
            .args(["cleanup", "--retention", "7d", "--json"])
            .output()
            .unwrap(),
    );
    assert_ne!(out.code, Some(0), "the guard could not look: {out:?}");
    assert!(exists().await, "made before the guard failed: {out:?}");
}

/// A cleanup run by a role whose search path puts another schema first (its own, say) made the partitions ahead in
/// that schema: attached all the same, but where a cleanup run by another role (the owner, its path on `public`)
/// does not find them by name, nor a stopped drop's leftovers. They are made beside the inbox now.
#[tokio::test(flavor = "multi_thread")]
async fn a_cleanup_with_another_schema_first_on_its_path_makes_its_partitions_beside_the_inbox() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let pool = env.pool().await;
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let ahead =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() + TimeDelta::days(2)));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE \"{ahead}\"; CREATE SCHEMA shadow; ALTER DATABASE \"{}\" SET search_path = shadow, public",
        env.db_name
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["cleanup", "--retention", "7d", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let schemas: Vec<String> = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = $1",
    )
    .bind(&ahead)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(schemas, ["public"], "{out:?}");
}

/// A partitioned inbox with partitions from 14 days back, and the oldest of them (empty, past the window): its name
/// and its start.
async fn with_an_old_empty_partition(env: &TestEnv) -> (String, chrono::DateTime<Utc>) {
    assert_eq!(migrate_partitioned(env, &[]).code, Some(0));
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    let mut conn = db.connect().await.unwrap();
    inboxctl::db::partitions::ensure_partitions(
        &mut conn,
        inboxctl::db::partitions::Settings {
            interval: TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        },
        Utc::now() - TimeDelta::days(14),
        Utc::now(),
    )
    .await
    .unwrap();
    let oldest = inboxctl::db::partitions::partitions(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.from.is_some())
        .unwrap();
    (oldest.name, oldest.from.unwrap())
}

/// A row processed now (a late copy of an old message) in the partition at `start`; its id.
async fn a_row_processed_now(pool: &sqlx::PgPool, start: chrono::DateTime<Utc>) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES ($1, 'a', now(), now(), $2)",
    )
    .bind(id)
    .bind(start + TimeDelta::hours(1))
    .execute(pool)
    .await
    .unwrap();
    id
}

/// How many rows of the inbox hold `id`.
async fn rows_of(pool: &sqlx::PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether `name` is a partition of the inbox now.
async fn attached(pool: &sqlx::PgPool, name: &str) -> bool {
    catalog_flag(
        pool,
        "SELECT (SELECT relispartition FROM pg_class WHERE oid = to_regclass($1))",
        name,
    )
    .await
}

/// What `query` (of the catalogs, by a table's name) says of `name`: false when it says nothing (no such table).
async fn catalog_flag(pool: &sqlx::PgPool, query: &'static str, name: &str) -> bool {
    sqlx::query_scalar::<_, Option<bool>>(query)
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
        .unwrap_or(false)
}

/// A claim may write into an old partition between the cleanup's look at it and its detach (a late copy of an old
/// message, processed now; a failpoint holds the cleanup there while the test writes it). The detached table is
/// looked at again: the partition is attached again and kept, its row still the message's claim. It was dropped with
/// the row. (Its consumer_type has a row past the window elsewhere, so that the cleanup cleans it: what keeps the
/// partition is the row processed within the window.)
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_written_to_between_the_cleanups_look_and_its_detach_is_kept() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    a_row_processed_now(&pool, start + TimeDelta::days(4)).await;
    sqlx::query("UPDATE inbox_messages SET processed_at = now() - interval '10 days'")
        .execute(&pool)
        .await
        .unwrap();
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "7d", "--force", "--json"],
        &[("INBOXCTL_FAILPOINTS", "partition-looked=sleep-once-10000")],
    );
    cleanup.wait_for_stderr(
        "failpoint partition-looked reached",
        Duration::from_secs(30),
    );
    let id = a_row_processed_now(&pool, start).await;
    assert_eq!(
        cleanup.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        cleanup.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert!(attached(&pool, &oldest).await, "{report:#}");
    assert_eq!(rows_of(&pool, id).await, 1);
    assert!(
        report["partitions"]["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["partition"] == oldest.as_str()
                && k["why"].as_str().unwrap().contains("within the window")
                && k["why"].as_str().unwrap().contains("attached again")),
        "{report:#}"
    );
}

/// Two cleanups at once: one detaches a partition to drop it, and before it looks at the detached table the other
/// (played by the test) takes it for the leftover of a stopped drop and attaches it again, and a claim writes there.
/// The first leaves it to the other: the partition stays, with its row. (It looked at the table and dropped it,
/// attached and all, or failed the run.)
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_another_cleanup_attached_again_is_not_dropped_under_it() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "7d", "--force", "--json"],
        &[("INBOXCTL_FAILPOINTS", "partition-detached=sleep-once-10000")],
    );
    cleanup.wait_for_stderr(
        "failpoint partition-detached reached",
        Duration::from_secs(30),
    );
    assert!(!attached(&pool, &oldest).await, "detached by the cleanup");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE inbox_messages ATTACH PARTITION \"{oldest}\" FOR VALUES FROM ('{}') TO ('{}')",
        start.to_rfc3339(),
        (start + TimeDelta::days(1)).to_rfc3339()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let id = a_row_processed_now(&pool, start).await;
    assert_eq!(
        cleanup.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        cleanup.stderr()
    );
    assert!(attached(&pool, &oldest).await, "{}", cleanup.stderr());
    assert_eq!(rows_of(&pool, id).await, 1, "{}", cleanup.stderr());
    assert!(
        !cleanup.stderr().contains("could not be attached again"),
        "left to the other, not acted on: {}",
        cleanup.stderr()
    );
}

/// A partition the cleanup detached to drop, whose lock another session holds past the cleanup's wait (an
/// autovacuum, a dump; here the test, holding it while the cleanup is paused by a failpoint): left detached for the
/// next cleanup, and the run says so and ends partial (exit 3), since a message whose time falls in that range cannot
/// be claimed until then. It ended 0, as if everything was done. The next cleanup, the lock gone, drops it.
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_left_detached_for_a_lock_held_elsewhere_ends_the_cleanup_partial() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, _) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "7d", "--force", "--json"],
        &[("INBOXCTL_FAILPOINTS", "partition-detached=sleep-once-10000")],
    );
    cleanup.wait_for_stderr(
        "failpoint partition-detached reached",
        Duration::from_secs(30),
    );
    let mut holder = pool.begin().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN ACCESS SHARE MODE",
        common::quote_ident(&oldest)
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let code = cleanup.wait(Duration::from_secs(60));
    holder.rollback().await.unwrap();
    assert_eq!(code, Some(3), "{}", cleanup.stderr());
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert!(
        report["partitions"]["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["partition"] == oldest.as_str() && k["detached"] == true),
        "{report:#}"
    );
    assert!(!attached(&pool, &oldest).await, "{report:#}");
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        report["partitions"]["leftovers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l == oldest.as_str()),
        "{report:#}"
    );
}

/// A partition a stopped drop left detached, holding a row processed within the window: attached again by the next
/// cleanup, not dropped as a leftover.
#[tokio::test(flavor = "multi_thread")]
async fn a_leftover_partition_holding_a_row_within_the_window_is_attached_again() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    let id = a_row_processed_now(&pool, start).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "COMMENT ON TABLE \"{oldest}\" IS '{}'; ALTER TABLE inbox_messages DETACH PARTITION \"{oldest}\"",
        inboxctl::db::partitions::DETACHING
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(attached(&pool, &oldest).await, "{out:?}");
    assert_eq!(rows_of(&pool, id).await, 1, "{out:?}");
    // Attached again, it is unmarked: detached later by an operator, it is theirs.
    assert_eq!(comment_of(&pool, &oldest).await, None);
}

/// The comment on a table.
async fn comment_of(pool: &sqlx::PgPool, name: &str) -> Option<String> {
    sqlx::query_scalar("SELECT obj_description(to_regclass($1), 'pg_class')")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The leftover of a drop an earlier version stopped carries no mark: a cleanup now would leave it detached for good,
/// its range out of the inbox. Migration 16 marks the unmarked ones there when it runs (as that version would have
/// taken them), and the next cleanup drops it. (The migration's text is run again on a table detached by hand after
/// `migrate`: the test's stand-in for one left before the upgrade.)
#[tokio::test(flavor = "multi_thread")]
async fn a_leftover_of_an_earlier_versions_stopped_drop_is_marked_by_the_migration_and_dropped() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, _) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE inbox_messages DETACH PARTITION \"{oldest}\"; CREATE TABLE inbox_messages_p19990101_000000 (LIKE inbox_messages); \
         COMMENT ON TABLE inbox_messages_p19990101_000000 IS 'an operator''s'"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::raw_sql(include_str!(
        "../migrations/20261206000016_inboxctl_mark_detached_leftovers.sql"
    ))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        comment_of(&pool, &oldest).await.as_deref(),
        Some(inboxctl::db::partitions::DETACHING)
    );
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        report["partitions"]["leftovers"],
        serde_json::json!([oldest]),
        "{report:#}"
    );
    assert_eq!(
        comment_of(&pool, "inbox_messages_p19990101_000000")
            .await
            .as_deref(),
        Some("an operator's"),
        "a table with a comment of its own is left alone"
    );
}

/// An operator detaches an old partition by hand (to dump it, to keep it as an archive): a cleanup took it for the
/// leftover of a stopped drop, and dropped it, its rows past the window. A drop marks what it detaches now, and a
/// table without the mark is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_an_operator_detached_by_hand_is_left_to_them() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES (gen_random_uuid(), 'a', $1, $1, $1)",
    )
    .bind(start + TimeDelta::hours(1))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE inbox_messages DETACH PARTITION \"{oldest}\""
    )))
    .execute(&pool)
    .await
    .unwrap();
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        report["partitions"]["leftovers"],
        serde_json::json!([]),
        "{report:#}"
    );
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        common::quote_ident(&oldest)
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 1, "the operator's table and its row: {out:?}");
    assert!(!attached(&pool, &oldest).await, "{out:?}");
}

/// A reader of the inbox keeps a detach of `partition` in its second phase, and the detach is cancelled there: left
/// half detached (pending), as a drop stopped there leaves it, or an operator's.
async fn left_half_detached(pool: &sqlx::PgPool, partition: &str) {
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM inbox_messages LIMIT 1")
        .execute(&mut *reader)
        .await
        .unwrap();
    let detacher = {
        let pool = pool.clone();
        let sql = format!(
            "ALTER TABLE inbox_messages DETACH PARTITION {} CONCURRENTLY",
            common::quote_ident(partition)
        );
        tokio::spawn(async move { sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await })
    };
    common::eventually(
        "the detach in its second phase",
        Duration::from_secs(30),
        || async { pending(pool, partition).await },
    )
    .await;
    sqlx::query(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'ALTER TABLE inbox_messages DETACH%'",
    )
    .execute(pool)
    .await
    .unwrap();
    assert!(detacher.await.unwrap().is_err(), "the detach was cancelled");
    reader.rollback().await.unwrap();
    assert!(pending(pool, partition).await, "left half detached");
}

/// Whether `partition` is a partition left half detached.
async fn pending(pool: &sqlx::PgPool, partition: &str) -> bool {
    catalog_flag(
        pool,
        "SELECT (SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1))",
        partition,
    )
    .await
}

/// A session idle in a transaction that read the inbox (a forgotten `BEGIN` in psql; a dump) holds a partition's
/// `DETACH … CONCURRENTLY` in its second step for as long as it stays. The cleanup gives the detach up after
/// `--detach-wait`, leaves the partition half detached, tries no other (they would wait for the same session), and
/// ends partial (exit 3), saying so; the next cleanup, the session gone, finishes the detach and drops it. The cleanup
/// waited as long as the session stayed, and no later run of `--every` began, to make the partitions ahead.
#[tokio::test(flavor = "multi_thread")]
async fn a_detach_held_by_a_reader_of_the_inbox_is_given_up_and_finished_by_the_next_cleanup() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    // A row processed past the window in the next partition, which this run does not try: left to the next run's
    // drop, not deleted row by row meanwhile.
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time) \
         VALUES ($1, 'a', now() - interval '10 days', now() - interval '10 days', $2)",
    )
    .bind(id)
    .bind(start + TimeDelta::days(1) + TimeDelta::hours(1))
    .execute(&pool)
    .await
    .unwrap();
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM inbox_messages LIMIT 1")
        .execute(&mut *reader)
        .await
        .unwrap();
    let mut cleanup = env.spawn(&[
        "cleanup",
        "--retention",
        "7d",
        "--force",
        "--json",
        "--detach-wait",
        "3s",
    ]);
    let code = cleanup.wait(Duration::from_secs(60));
    reader.rollback().await.unwrap();
    assert_eq!(code, Some(3), "{}", cleanup.stderr());
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert!(kept_saying(&report, &oldest, "--detach-wait"), "{report:#}");
    assert!(
        report["partitions"]["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["partition"] == oldest.as_str() && k["detached"] == true),
        "{report:#}"
    );
    assert_eq!(
        report["partitions"]["dropped"],
        serde_json::json!([]),
        "{report:#}"
    );
    assert_eq!(
        report["partitions"]["given_up"]["partition"],
        oldest.as_str(),
        "{report:#}"
    );
    // The next one past the window is not tried: its detach would wait for the same session.
    assert!(
        report["partitions"]["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["why"].as_str().unwrap().contains("not tried this run")),
        "{report:#}"
    );
    assert!(pending(&pool, &oldest).await, "{report:#}");
    assert_eq!(comment_of(&pool, &oldest).await, None, "unmarked");
    assert_eq!(
        rows_of(&pool, id).await,
        1,
        "not deleted by batch: {report:#}"
    );

    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        report["partitions"]["dropped"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["partition"] == oldest.as_str()),
        "{report:#}"
    );
    assert!(!attached(&pool, &oldest).await, "{report:#}");
    assert_eq!(
        rows_of(&pool, id).await,
        0,
        "its partition dropped: {report:#}"
    );
}

/// A partition left half detached holds a row that must stay, while a run that cleans one consumer_type holds every
/// partition back. The run finishes the detach and, looking at the table itself, attaches it again: its range takes
/// rows again, and its row is the message's claim. It was kept as it was, half detached, for as long as anything held
/// the partitions back: every late copy of a message of its range refused and moved aside.
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_left_half_detached_is_finished_while_the_others_are_held() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, start) = with_an_old_empty_partition(&env).await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let id = a_row_processed_now(&pool, start).await;
    left_half_detached(&pool, &oldest).await;
    let out = env.run(&[
        "cleanup",
        "--retention",
        "7d",
        "--consumer-type",
        "carrier",
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        kept_saying(&report, &oldest, "attached again"),
        "{report:#}"
    );
    assert!(attached(&pool, &oldest).await, "{report:#}");
    assert!(!pending(&pool, &oldest).await, "{report:#}");
    assert_eq!(rows_of(&pool, id).await, 1, "{report:#}");
    assert_eq!(comment_of(&pool, &oldest).await, None, "unmarked");
}

/// Another partition's detach is pending (an operator's, cancelled half way), and PostgreSQL detaches one at a time.
/// The cleanup's drops are refused: each partition is kept, unmarked, and the report says why and what to do. They were
/// taken for detached by another cleanup and skipped without a word, their mark left on: once an operator detached one
/// by hand, the next cleanup took it for its own leftover and dropped it.
#[tokio::test(flavor = "multi_thread")]
async fn a_drop_refused_for_another_partitions_pending_detach_leaves_the_partition_unmarked() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, _) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    let within = inboxctl::db::partitions::partition_name(
        inboxctl::db::partitions::Settings {
            interval: TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        }
        .floor(Utc::now() - TimeDelta::days(2)),
    );
    left_half_detached(&pool, &within).await;
    let out = env.run(&["cleanup", "--retention", "7d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        kept_saying(&report, &oldest, "another partition's detach is pending"),
        "{report:#}"
    );
    assert!(attached(&pool, &oldest).await, "{report:#}");
    assert_eq!(
        comment_of(&pool, &oldest).await,
        None,
        "unmarked: {report:#}"
    );
}

/// The partitions ran out nine days ago (no cleanup ran since), and consumers hold the messages of the times since for
/// theirs. A cleanup makes them from where they ran out, not only from a week back: the messages of the first two days
/// would otherwise be moved aside as of a time no partition holds once the others were made. The next cleanup, with a
/// window of a day, keeps them, empty as they are (the backlog has not reached them): their window runs from when they
/// were made. Dropped by their range, as before, the held messages of those days were left unclaimable. The empty
/// partitions made in their time are dropped as ever.
#[tokio::test(flavor = "multi_thread")]
async fn partitions_that_ran_out_long_ago_are_made_from_where_they_ran_out() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let (oldest, _) = with_an_old_empty_partition(&env).await;
    let pool = env.pool().await;
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let ran_out =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() - TimeDelta::days(9)));
    let since: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname >= $1
           AND c.relname <> 'inbox_messages_untimed'",
    )
    .bind(&ran_out)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(since.len() >= 12, "{since:?}");
    for name in &since {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE {}",
            common::quote_ident(name)
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    let out = env.run(&["cleanup", "--retention", "30d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for name in &since {
        assert!(attached(&pool, name).await, "{name} made again: {out:?}");
    }
    let out = env.run(&["cleanup", "--retention", "1d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for name in &since {
        assert!(attached(&pool, name).await, "{name} kept: {out:?}");
    }
    assert!(
        out.stdout.contains("kept a whole window from then"),
        "{out:?}"
    );
    assert!(!attached(&pool, &oldest).await, "{oldest} dropped: {out:?}");
}

/// A partitioned inbox whose partitions from today's on are gone (ran out, no cleanup made them).
async fn with_the_partitions_ahead_gone(env: &TestEnv) -> sqlx::PgPool {
    assert_eq!(migrate_partitioned(env, &[]).code, Some(0));
    let pool = env.pool().await;
    let today = inboxctl::db::partitions::partition_name(
        inboxctl::db::partitions::Settings {
            interval: TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        }
        .floor(Utc::now()),
    );
    let ahead: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname >= $1
           AND c.relname <> 'inbox_messages_untimed'",
    )
    .bind(&today)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(ahead.contains(&today), "{ahead:?}");
    for name in &ahead {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE {}",
            common::quote_ident(name)
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    // And one made far ahead (an operator's; a clock ahead): it does not end the times that ran out before it, whose
    // messages are held all the same (taken for the newest, it had them moved aside as of no partition's time).
    a_partition_far_ahead(env).await;
    pool
}

/// The partition made between a claim refused for want of it and the look at the partitions that tells why (a
/// failpoint holds the consumer there while the test runs `migrate --partitioned`): the message is held once and
/// claimed on the next try. It was taken for a time no partition would ever hold, and moved aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_made_just_after_a_refused_claim_lets_the_message_through() {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = with_the_partitions_ahead_gone(&env).await;
    common::publish_parcels(&env, &["--count", "1"]);
    let mut consumer = env.spawn_with(
        &["consume", "carrier"],
        &[("INBOXCTL_FAILPOINTS", "claim-refused=sleep-once-8000")],
    );
    consumer.wait_for_stderr("failpoint claim-refused reached", Duration::from_secs(30));
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let done = common::within(Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 1
            && env.queue_counts(CARRIER_QUEUE) == (0, 0)
    })
    .await;
    assert!(done, "processed: {}", consumer.stderr());
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error")),
        "nothing moved aside: {}",
        consumer.stderr()
    );
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// The partitions ahead ran out (no cleanup made them): no partition holds the present. A message of now was refused
/// as unclaimable and moved aside — every message, the whole stream. It is held, as in an outage, saying why; once
/// a partition holds the present again (here `migrate --partitioned`, as a cleanup would), it is processed. One by
/// one and batched; among them one whose id is up to ten minutes old (a backlog's: held like the others, not taken
/// for a late copy of an old message because of its age).
#[tokio::test(flavor = "multi_thread")]
async fn messages_of_now_with_no_partition_for_them_are_held_until_one_is_made() {
    common::clear_of_midnight().await;
    for mode in [common::ONE_BY_ONE, common::BATCHED] {
        let env = TestEnv::migrated().await;
        common::ensure_endpoints(&env).await;
        let pool = with_the_partitions_ahead_gone(&env).await;
        // The backlog's message first: the first claim the consumer makes. Of today, whose partition is gone: ten
        // minutes old, or in the first minutes of a day (when that would be yesterday's, whose partition is there)
        // half as old as the day.
        let today = Utc::now()
            - Utc::now()
                .date_naive()
                .and_time(chrono::NaiveTime::MIN)
                .and_utc();
        send(&env, v7_ago((today / 2).min(TimeDelta::minutes(10)))).await;
        let mut consumer = env.spawn(&common::with_mode(&["consume", "carrier"], mode));
        consumer.wait_for_stderr("consuming", Duration::from_secs(30));
        common::publish_parcels(&env, &["--count", "3"]);
        consumer.wait_for_stderr(
            "no partition of inbox_messages holds the current time",
            Duration::from_secs(30),
        );
        // Held on the sessions it has: a held claim is not a session that failed (each used to be closed, and a new
        // one opened for every held message's next try).
        let sessions = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        // The pool's sessions opened first (the held messages taking theirs), then counted over 8 s.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = sessions().await;
        tokio::time::sleep(Duration::from_secs(8)).await;
        let ended = sessions().await - before;
        assert!(
            ended <= 2,
            "{ended} sessions ended while held ({mode:?}): {}",
            consumer.stderr()
        );
        // Said as it is: not behind the driver's "encountered unexpected or invalid data".
        assert!(
            !consumer.stderr().contains("unexpected or invalid data"),
            "{}",
            consumer.stderr()
        );
        let error_queue = format!("{CARRIER_QUEUE}_error");
        assert!(
            !env.queue_exists(&error_queue) || env.queue_counts(&error_queue).0 == 0,
            "nothing moved aside: {}",
            consumer.stderr()
        );
        assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
        let done = common::within(Duration::from_secs(60), || async {
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 4
                && env.queue_counts(CARRIER_QUEUE) == (0, 0)
        })
        .await;
        assert!(
            done,
            "the four processed ({mode:?}): {} reservations, queue {:?}, error queue {:?}\n{}",
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
            env.queue_counts(CARRIER_QUEUE),
            env.queue_exists(&error_queue)
                .then(|| env.queue_counts(&error_queue)),
            consumer.stderr()
        );
        consumer.terminate();
        assert_eq!(
            consumer.wait(Duration::from_secs(30)),
            Some(0),
            "{}",
            consumer.stderr()
        );
    }
}

/// A batch whose claim fails for a member's time no partition holds (2099), beside a member of now: the batch is the
/// member's failure (the caller then goes one by one and finds it), not the present missing its partition — which
/// would hold every message as an outage. The member whose time lies farthest from now stands for the batch.
#[tokio::test]
async fn a_batch_with_one_member_of_a_time_no_partition_holds_is_not_held_as_an_outage() {
    common::clear_of_midnight().await;
    let env = partitioned_by_day().await;
    let pool = env.pool().await;
    let inbox = inboxctl::inbox::Inbox::new(
        pool.clone(),
        inboxctl::inbox::ConsumerType::new("partitioned").unwrap(),
    )
    .with_keying(inboxctl::inbox::Keying::Timed(
        inboxctl::inbox::TimeSource::Id,
    ));
    let member = |id: Uuid| inboxctl::inbox::Member::<()> {
        message_id: id,
        fingerprint: None,
        carried: Default::default(),
        work: Box::new(|_| Box::pin(async { Ok(()) })),
    };
    let future = Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        4_070_908_800,
        0,
    ));
    // Keys are claimed in id order: the member of now first.
    let outcome = inbox
        .process_batch_with(vec![member(Uuid::now_v7()), member(future)], None)
        .await;
    assert!(
        matches!(&outcome, Err(inboxctl::inbox::ProcessError::Failed(e)) if e.to_string().contains("no partition")),
        "{outcome:?}"
    );
}

/// A dead-lettered message that failed before the cutoff waits for its replay, and its claim will land in the
/// partition of its own time (3 days ago), which holds no row at all. The guard refuses its consumer_type and no
/// partition goes, said for each kept one; replayed, the message is processed once. The empty partition was dropped,
/// and the replayed message was moved aside again as unclaimable ("its time is in no partition"): its effect never
/// made. So too for a message that failed recently (no refusal) whose own time is past the window: its partition
/// was dropped, the guard reading only when it failed.
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_a_waiting_replay_needs_is_kept_while_the_guard_refuses() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    with_an_old_empty_partition(&env).await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let pool = env.pool().await;
    // A message of now processed: the carrier's consumer_type is in the inbox, its error queue declared.
    let (props, body, _) = common::parcel_message(v7_ago(TimeDelta::zero()), "Berlin");
    common::publish(&conn, EVENT_EXCHANGE, "", props, &body).await;
    common::consume_until_idle(&env, &["carrier"]);
    let x = v7_ago(TimeDelta::days(3));
    let error_queue = format!("{CARRIER_QUEUE}_error");
    inboxctl::amqp::topology::ensure_dead_letter_queue(&conn, &error_queue, common::queue_type())
        .await
        .unwrap();
    dead_lettered(&conn, x, TimeDelta::days(3)).await;
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let its_day = Utc::now() - TimeDelta::days(3);
    let partition = inboxctl::db::partitions::partition_name(settings.floor(its_day));
    let older =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() - TimeDelta::days(10)));

    // A run of another consumer_type alone looks at that one's dead-letter queues only: it drops no partition.
    let out = env.run(&[
        "cleanup",
        "--retention",
        "2d",
        "--consumer-type",
        common::NOTIFICATION_QUEUE,
        "--json",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        attached(&pool, &partition).await,
        "kept by a narrowed run: {out:?}"
    );
    assert!(
        out.stdout.contains("looked at its dead-letter queues only"),
        "{out:?}"
    );

    let out = env.run(&["cleanup", "--retention", "2d", "--json"]);
    assert_eq!(out.code, Some(3), "the guard refuses: {out:?}");
    assert!(attached(&pool, &partition).await, "its day kept: {out:?}");
    assert!(attached(&pool, &older).await, "none goes: {out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(
        kept_saying(&report, &partition, "waits for its replay"),
        "{report}"
    );
    replayed_once(&env, &pool, x).await;

    // A message of 4 days ago that failed an hour ago (a replay of it that failed again; a delayed redelivery): no
    // refusal, its failure is young, but its claim lands in the partition of its own time, empty and past the
    // window. That partition stays, and says why.
    let y = v7_ago(TimeDelta::days(4));
    dead_lettered(&conn, y, TimeDelta::hours(1)).await;
    let its_day =
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() - TimeDelta::days(4)));
    let out = env.run(&["cleanup", "--retention", "2d", "--json"]);
    assert_eq!(out.code, Some(0), "nothing refused: {out:?}");
    assert!(attached(&pool, &its_day).await, "its day kept: {out:?}");
    let report: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert!(kept_saying(&report, &its_day, "whose own time"), "{report}");
    replayed_once(&env, &pool, y).await;
}

/// Publishes parcel `id` to the carrier's error queue as MassTransit dead-letters it, failed `ago`.
async fn dead_lettered(conn: &lapin::Connection, id: Uuid, ago: TimeDelta) {
    let (props, body, _) = common::parcel_message(id, "Hamburg");
    let text = |s: &str| {
        lapin::types::AMQPValue::LongString(lapin::types::LongString::from(s.as_bytes().to_vec()))
    };
    let mut headers = lapin::types::FieldTable::default();
    headers.insert("MT-Fault-Message".into(), text("carrier API returned 503"));
    headers.insert(
        "MT-Fault-InputAddress".into(),
        text(&format!("rabbitmq://127.0.0.1/{CARRIER_QUEUE}")),
    );
    let failed = inboxctl::amqp::envelope::format_time(Utc::now() - ago);
    headers.insert("MT-Fault-Timestamp".into(), text(&failed));
    let error_queue = format!("{CARRIER_QUEUE}_error");
    common::publish(conn, "", &error_queue, props.with_headers(headers), &body).await;
}

/// Whether a cleanup's JSON report says `partition` was kept, for a reason saying `words`.
fn kept_saying(report: &serde_json::Value, partition: &str, words: &str) -> bool {
    report["partitions"]["kept"]
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k["partition"] == partition && k["why"].as_str().unwrap().contains(words))
}

/// Replays the carrier's error queue, consumes, and checks `id` was processed once and the queue left empty.
async fn replayed_once(env: &TestEnv, pool: &sqlx::PgPool, id: Uuid) {
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let replay = env.run(&["replay", "--from", &error_queue]);
    assert_eq!(replay.code, Some(0), "{replay:?}");
    common::consume_until_idle(env, &["carrier"]);
    let reservations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM carrier_reservations WHERE message_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(reservations, 1, "processed once, replayed");
    assert_eq!(env.queue_counts(&error_queue), (0, 0));
}

/// A partition whose `DETACH … CONCURRENTLY` was cancelled in its second phase (a `statement_timeout`, a cancel, a
/// restart) stays listed, "detach pending": its rows out of sight, an insert of its range refused as "no partition".
/// A message of that range is one older than the window (cleanup detaches only such partitions): moved aside as
/// unclaimable, and the rest go on. It was held as if the partitions ahead had run out — the partition still listed,
/// its time counted as held by one — tried for ever, and the intake paused again at each try.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_of_a_partition_left_half_detached_is_moved_aside_not_held_as_an_outage() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    let old = v7_ago(TimeDelta::days(3));
    let at = Utc::now() - TimeDelta::days(3);
    let partition = format!("inbox_messages_p{}_000000", at.format("%Y%m%d"));
    assert!(attached(&pool, &partition).await, "{partition}");

    left_half_detached(&pool, &partition).await;

    let now = Uuid::now_v7();
    send(&env, old).await;
    send(&env, now).await;
    let mut consumer = env.spawn(&["consume", "carrier", "--exit-when-idle", "1s"]);
    let code = consumer.wait(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{}", consumer.stderr());
    assert!(
        consumer.stderr().contains("processed=1"),
        "{}",
        consumer.stderr()
    );
    let dead = common::drain(&env.amqp().await, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0]
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string(),
        old.to_string()
    );
    let reason = common::header_text(&dead[0].properties, "MT-Fault-Message").unwrap();
    assert!(
        reason.contains("is in no partition of the inbox"),
        "{reason}"
    );
    assert_eq!(partition_of(&pool, now).await.len(), 1);
}

/// A cleanup that fails between two partition drops (its sessions cut after the first went) reports the partition it
/// dropped with what failed (exit 3), in its output and its audit: that partition and its rows are gone. The failure
/// was reported alone, the drop nowhere.
#[tokio::test(flavor = "multi_thread")]
async fn a_cleanup_failing_between_two_drops_reports_the_one_it_dropped() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let pool = env.pool().await;
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let day = |ago: i64| {
        inboxctl::db::partitions::partition_name(settings.floor(Utc::now() - TimeDelta::days(ago)))
    };
    let (first, second) = (day(7), day(6));
    assert!(attached(&pool, &first).await && attached(&pool, &second).await);
    let mut cleanup = env.spawn_with(
        &["cleanup", "--retention", "2d", "--force", "--json"],
        &[(
            "INBOXCTL_FAILPOINTS",
            &format!("partition-looked=sleep-once-5000@{second}"),
        )],
    );
    cleanup.wait_for_stderr(
        "failpoint partition-looked reached",
        Duration::from_secs(30),
    );
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'inboxctl'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let code = cleanup.wait(Duration::from_secs(60));
    assert_eq!(code, Some(3), "{}", cleanup.stderr());
    let report: serde_json::Value = serde_json::from_str(cleanup.stdout().trim()).unwrap();
    assert!(report["failed"].is_string(), "{report:#}");
    let dropped: Vec<&str> = report["partitions"]["dropped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["partition"].as_str().unwrap())
        .collect();
    assert_eq!(dropped, [first.as_str()], "{report:#}");
    let pool = env.pool().await;
    let gone: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
        .bind(&first)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(gone, "{first} dropped");
    let details: serde_json::Value =
        sqlx::query_scalar("SELECT details FROM inboxctl_audit WHERE command = 'cleanup'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        details["partitions_dropped"],
        serde_json::json!([first]),
        "{details}"
    );
}

/// A cleanup run on a host whose clock is far behind the database's (ten days) makes no partition past the window:
/// which partitions are missing is judged on the database's clock, as the window is. Before 2026-12-07 the host's
/// clock decided: no partition had begun by its "now", so it made the week before it — ranges past the window, where
/// a late copy of a message processed long ago would be claimed as a message never seen, its effect made again.
#[cfg(feature = "failpoints")] // for common::LIBFAKETIME, which the test command builds with
#[tokio::test(flavor = "multi_thread")]
async fn a_cleanup_on_a_host_whose_clock_is_behind_makes_no_partition_past_the_window() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let out = env.run(&["cleanup", "--retention", "2d", "--force", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let pool = env.pool().await;
    let oldest = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT min(c.relname::text) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname <> 'inbox_messages_untimed'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = oldest().await;
    let out = common::Output::of(
        env.cmd()
            .env("LD_PRELOAD", common::LIBFAKETIME)
            .env("FAKETIME", "-10d")
            .args(["cleanup", "--retention", "2d", "--force", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        report["partitions"]["created"],
        serde_json::json!([]),
        "{report}"
    );
    assert_eq!(oldest().await, before);
}

/// A consumer whose host clock is ten minutes behind the database's holds the messages of now when the partitions
/// ran out, as one on time does: "now" is the database's. Before 2026-12-07 its own clock decided, and a message of
/// the present looked like one from more than five minutes in its future: unclaimable, moved aside — the whole
/// stream, while the partitions were out.
#[cfg(feature = "failpoints")] // for common::LIBFAKETIME, which the test command builds with
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_whose_clock_is_behind_holds_the_messages_of_now_when_the_partitions_ran_out() {
    common::clear_of_midnight().await;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = with_the_partitions_ahead_gone(&env).await;
    let mut consumer = env.spawn_with(
        &["consume", "carrier"],
        &[("LD_PRELOAD", common::LIBFAKETIME), ("FAKETIME", "-10m")],
    );
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    common::publish_parcels(&env, &["--count", "3"]);
    consumer.wait_for_stderr(
        "no partition of inbox_messages holds the current time",
        Duration::from_secs(30),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    assert!(
        !env.queue_exists(&error_queue) || env.queue_counts(&error_queue).0 == 0,
        "nothing moved aside: {}",
        consumer.stderr()
    );
    assert_eq!(migrate_partitioned(&env, &[]).code, Some(0));
    let done = common::within(Duration::from_secs(60), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 3
    })
    .await;
    assert!(done, "the three processed: {}", consumer.stderr());
    consumer.terminate();
    assert_eq!(consumer.wait(Duration::from_secs(30)), Some(0));
}

/// A conversion makes its partitions as far back as `--partition-back` says (a week unless told): a message of 20 days
/// ago — one waiting in an error queue through the conversion of an inbox cleaned at 30 days, say — is claimed and
/// processed after it, where with the week it never could be (no partition holds its time, and none is ever made
/// before the oldest). One older than that is moved aside as unclaimable; a back too long for the interval is refused
/// before anything is made; and given to an inbox partitioned already, it makes nothing before the oldest.
#[tokio::test]
async fn a_conversion_makes_partitions_as_far_back_as_told_and_a_message_of_then_is_claimed() {
    common::clear_of_midnight().await;
    let env = TestEnv::bare().await;
    let out = env.run(&["migrate", "--partitioned", "1h", "--partition-back", "60d"]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(
        out.stderr
            .contains("a conversion makes at most 1000: give a --partition-back of at most"),
        "{out:?}"
    );
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&env.db_name)
        .fetch_one(&common::admin_pool().await)
        .await
        .unwrap();
    assert_eq!(made, 0, "refused before anything is made");

    let out = migrate_partitioned(&env, &["--partition-back", "30d"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let settings = inboxctl::db::partitions::Settings {
        interval: TimeDelta::days(1),
        source: inboxctl::inbox::TimeSource::Id,
    };
    let oldest = settings.floor(Utc::now() - TimeDelta::days(30));
    assert!(
        out.stdout.contains(&format!(
            "partitions from {}",
            oldest.format("%Y-%m-%d %H:%M:%S UTC")
        )),
        "{out:?}"
    );
    common::ensure_endpoints(&env).await;
    let within = v7_ago(TimeDelta::days(20));
    let before = v7_ago(TimeDelta::days(40));
    send(&env, within).await;
    send(&env, before).await;
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert!(out.stderr.contains("processed=1"), "{}", out.stderr);
    let pool = env.pool().await;
    assert_eq!(
        partition_of(&pool, within).await,
        vec![inboxctl::db::partitions::partition_name(
            settings.floor(Utc::now() - TimeDelta::days(20))
        )],
        "the message of 20 days ago is processed in its day's partition"
    );
    let dead = common::drain(&env.amqp().await, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0]
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        Some(before.to_string())
    );
    let reason = common::header_text(&dead[0].properties, "MT-Fault-Message").unwrap();
    assert!(
        reason.contains("is in no partition of the inbox"),
        "{reason}"
    );

    // Given again to the partitioned inbox: nothing before its oldest (a cleanup may have dropped those).
    let out = migrate_partitioned(&env, &["--partition-back", "60d"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr
            .contains("--partition-back is taken only when the inbox is converted"),
        "{out:?}"
    );
    let older: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'inbox_messages'::regclass AND c.relname < $1 \
           AND c.relname <> 'inbox_messages_untimed'",
    )
    .bind(inboxctl::db::partitions::partition_name(oldest))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(older, 0);
}
