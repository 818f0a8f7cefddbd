//! `inboxctl consume` against real PostgreSQL and RabbitMQ: exactly one effect per (message, consumer), MassTransit's
//! wire format both ways, bad input to the error and skipped queues with nothing lost.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{CARRIER_QUEUE, EVENT_EXCHANGE, NOTIFICATION_QUEUE, TestEnv};
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use uuid::Uuid;

async fn scalar(pool: &sqlx::PgPool, sql: &'static str, consumer_type: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(consumer_type)
        .fetch_one(pool)
        .await
        .unwrap()
}

in_both_modes!(
    carrier_and_notification_each_take_every_message_once_in_one_transaction,
    carrier_and_notification_each_take_every_message_once_in_one_transaction_in
);

async fn carrier_and_notification_each_take_every_message_once_in_one_transaction_in(
    mode: &[&str],
) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    common::record_inserting_transactions(&pool).await;
    let report = common::publish_parcels(&env, &["--count", "40", "--duplicates", "0.5"]);
    assert_eq!(report["published"], 40);
    assert_eq!(report["duplicates"], 20);

    let mut carrier = env.spawn(&common::with_mode(
        &["consume", "carrier", "--exit-when-idle", "1s"],
        mode,
    ));
    let mut notification = env.spawn(&common::with_mode(
        &["consume", "notification", "--exit-when-idle", "1s"],
        mode,
    ));
    assert_eq!(
        carrier.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        carrier.stderr()
    );
    assert_eq!(
        notification.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        notification.stderr()
    );

    for (consumer_type, effects) in [
        (CARRIER_QUEUE, "carrier_reservations"),
        (NOTIFICATION_QUEUE, "notifications_sent"),
    ] {
        let rows = |sql: &str| sql.replace("EFFECTS", effects);
        let count_effects: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(rows("SELECT count(*) FROM EFFECTS")))
                .fetch_one(&pool)
                .await
                .unwrap();
        let distinct_parcels: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(rows(
            "SELECT count(DISTINCT parcel_id) FROM EFFECTS",
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (count_effects, distinct_parcels),
            (40, 40),
            "{consumer_type}: one effect per parcel"
        );

        let inbox = scalar(
            &pool,
            "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1",
            consumer_type,
        )
        .await;
        let processed = scalar(
            &pool,
            "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1 AND processed_at IS NOT NULL",
            consumer_type,
        )
        .await;
        assert_eq!(
            (inbox, processed),
            (40, 40),
            "{consumer_type}: every row we write has processed_at (docs/architecture.md: `processed_at` never set)"
        );

        let transactions = scalar(
            &pool,
            "SELECT count(DISTINCT xmin::text) FROM inbox_messages WHERE consumer_type = $1",
            consumer_type,
        )
        .await;
        if mode == common::BATCHED {
            // Batched: a batch's claims and effects commit in one transaction.
            assert!(
                transactions < 40,
                "{consumer_type}: {transactions} transactions for 40 messages"
            );
        } else {
            // One transaction per message (docs/architecture.md: extra transactions).
            assert_eq!(
                transactions, 40,
                "{consumer_type}: one transaction per message"
            );
        }
        // The inbox row and the effect in the same transaction (no split transaction), and no savepoint between
        // them (a savepoint's writes carry its subtransaction's xmin).
        let same_transaction: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(rows(
            "SELECT count(*) FROM inbox_messages i JOIN EFFECTS e ON e.message_id = i.id
             WHERE i.consumer_type = $1 AND i.xmin::text = e.xmin::text",
        )))
        .bind(consumer_type)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            same_transaction, 40,
            "{consumer_type}: effect and inbox row commit together"
        );

        // In either mode, each effect commits with its own inbox row: the row of its message id and consumer_type
        // was inserted by the same top-level transaction (told by `committed_in`, whatever a subtransaction would
        // make of xmin; see `common::record_inserting_transactions`).
        let apart: Vec<(Uuid, Option<String>, Option<String>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(rows(
                "SELECT e.message_id, e.committed_in::text, i.committed_in::text FROM EFFECTS e
                 LEFT JOIN inbox_messages i ON i.id = e.message_id AND i.consumer_type = $1
                 WHERE i.committed_in IS DISTINCT FROM e.committed_in OR e.committed_in IS NULL",
            )))
            .bind(consumer_type)
            .fetch_all(&pool)
            .await
            .unwrap();
        assert!(
            apart.is_empty(),
            "{consumer_type}: effects not committed with their own inbox row \
             (message id, effect's transaction, inbox row's transaction): {apart:?}"
        );

        let duplicates = scalar(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE consumer_type = $1 AND kind = 'duplicate'",
            consumer_type,
        )
        .await;
        assert_eq!(
            duplicates, 20,
            "{consumer_type}: the duplicate counter equals the copies discarded"
        );
        assert_eq!(env.queue_counts(consumer_type), (0, 0), "every copy acked");
    }
    // Separate scopes: each consumer processed each message id once.
    let both = common::count(
        &pool,
        "SELECT count(*) FROM (SELECT id FROM inbox_messages GROUP BY id HAVING count(*) = 2) t",
    )
    .await;
    assert_eq!(both, 40);
    assert!(
        carrier.stderr().contains("duplicate discarded"),
        "duplicates are logged at WARN"
    );
}

in_both_modes!(
    every_masstransit_fixture_is_consumed_with_the_id_of_its_envelope,
    every_masstransit_fixture_is_consumed_with_the_id_of_its_envelope_in
);

async fn every_masstransit_fixture_is_consumed_with_the_id_of_its_envelope_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let published = common::fixtures("published");
    let sent = common::fixtures("sent");
    let errors = common::fixtures("error");
    for f in &published {
        common::publish(&conn, EVENT_EXCHANGE, "", f.properties.clone(), &f.body).await;
    }
    // A MassTransit Send goes to the endpoint's exchange; the error copies are what an operator would shovel back.
    for f in sent.iter().chain(&errors) {
        common::publish(&conn, CARRIER_QUEUE, "", f.properties.clone(), &f.body).await;
    }

    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));

    let pool = env.pool().await;
    let rows: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT message_id, parcel_id FROM carrier_reservations")
            .fetch_all(&pool)
            .await
            .unwrap();
    let got: BTreeMap<String, String> = rows
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(
        rows.len(),
        7,
        "six published and one sent ParcelCreatedEvent: {got:#?}"
    );
    for f in published.iter().chain(&sent[..1]) {
        let envelope_id = f.json["body_text"]
            .as_str()
            .map(|b| serde_json::from_str::<serde_json::Value>(b).unwrap())
            .unwrap();
        let id = envelope_id["messageId"].as_str().unwrap();
        assert_eq!(id, f.message_id);
        assert_eq!(
            got.get(id).map(String::as_str),
            envelope_id["message"]["parcelId"].as_str(),
            "{}: effect recorded with the envelope's id and parcel",
            f.name
        );
    }
    // The error-queue copies carry the ids of sent-01, published-03 and -06: all three are recognised.
    let duplicates = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    assert_eq!(duplicates, 3, "{}", out.stderr);

    // ParcelLabelPrinted is handled by no consumer here: moved to _skipped as MassTransit does.
    let skipped = common::drain(&conn, &format!("{CARRIER_QUEUE}_skipped")).await;
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].data, sent[1].body, "body byte for byte");
    assert_eq!(
        skipped[0]
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some(sent[1].message_id.as_str())
    );
    assert_eq!(
        common::header_text(&skipped[0].properties, "MT-Reason").as_deref(),
        Some("dead-letter")
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// A fleet whose MassTransit serialiser writes .NET's own PascalCase (a `PropertyNamingPolicy` of null): `MessageId`,
/// `MessageType`, `Message`, `ParcelId`, … MassTransit reads names whatever their case, and so does inboxctl: such a
/// message is processed under its envelope's id (a copy of it a duplicate), and so is one whose names are all lower
/// case. Names given twice in two cases are refused as a name given twice (which of two message ids counts is not
/// something to guess). They were all moved to the error queue: "the MassTransit envelope has no message". (A copy
/// serialised again under another naming policy is another event to the fingerprint, which keeps names as written: a
/// conflict, not a duplicate — docs/commands.md.)
#[tokio::test(flavor = "multi_thread")]
async fn names_in_any_case_are_read_as_masstransit_reads_them() {
    fn recase(value: &serde_json::Value, case: &dyn Fn(&str) -> String) -> serde_json::Value {
        match value {
            serde_json::Value::Object(map) => map
                .iter()
                .map(|(k, v)| (case(k), recase(v, case)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
            serde_json::Value::Array(items) => items.iter().map(|v| recase(v, case)).collect(),
            other => other.clone(),
        }
    }
    let pascal = |k: &str| {
        let mut chars = k.chars();
        chars
            .next()
            .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
            .unwrap_or_default()
    };
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let f = common::fixture("published/published-01.json");
    let camel: serde_json::Value = serde_json::from_slice(&f.body).unwrap();
    let id = camel["messageId"].as_str().unwrap().to_owned();
    let parcel = camel["message"]["parcelId"].as_str().unwrap().to_owned();
    let in_pascal = serde_json::to_vec_pretty(&recase(&camel, &pascal)).unwrap();
    assert!(String::from_utf8_lossy(&in_pascal).contains("\"MessageId\""));
    common::publish(&conn, EVENT_EXCHANGE, "", f.properties.clone(), &in_pascal).await;
    let mut lower = recase(&camel, &|k: &str| k.to_ascii_lowercase());
    let other = Uuid::now_v7();
    lower["messageid"] = other.to_string().into();
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        inboxctl::amqp::envelope::masstransit_properties(other),
        &serde_json::to_vec(&lower).unwrap(),
    )
    .await;
    common::publish(&conn, EVENT_EXCHANGE, "", f.properties.clone(), &in_pascal).await;
    let twice = Uuid::now_v7();
    let mut both = camel.clone();
    both["messageId"] = twice.to_string().into();
    let both = serde_json::to_string(&both).unwrap().replacen(
        "{",
        &format!("{{\"MessageId\":\"{}\",", Uuid::now_v7()),
        1,
    );
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        inboxctl::amqp::envelope::masstransit_properties(twice),
        both.as_bytes(),
    )
    .await;

    let out = common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    let rows: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT message_id, parcel_id FROM carrier_reservations ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut expected = vec![
        (
            Uuid::parse_str(&id).unwrap(),
            Uuid::parse_str(&parcel).unwrap(),
        ),
        (other, Uuid::parse_str(&parcel).unwrap()),
    ];
    expected.sort();
    assert_eq!(rows, expected, "{}", out.stderr);
    assert!(out.stderr.contains("duplicates=1"), "{}", out.stderr);
    let dead = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(dead.len(), 1, "{}", out.stderr);
    let reason = common::header_text(&dead[0].properties, "MT-Fault-Message").unwrap();
    assert!(reason.contains("duplicate field `messageId`"), "{reason}");
}

/// A MassTransit envelope that declares no message type (none given, or an empty list) is no consumer's to
/// MassTransit, which moves it to `_skipped`: so does inboxctl, nothing processed. It took it for its own type and
/// processed it, where a .NET consumer of the same queue would have skipped it.
#[tokio::test(flavor = "multi_thread")]
async fn an_envelope_that_declares_no_type_is_skipped_as_masstransit_skips_it() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let event = r#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT1", "destination": "Berlin"}"#;
    let (none, empty) = (Uuid::now_v7(), Uuid::now_v7());
    for (id, types) in [(none, ""), (empty, r#""messageType": [], "#)] {
        let body = format!(r#"{{"messageId": "{id}", {types}"message": {event}}}"#);
        common::publish(
            &conn,
            CARRIER_QUEUE,
            "",
            inboxctl::amqp::envelope::masstransit_properties(id),
            body.as_bytes(),
        )
        .await;
    }
    let out = common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0,
        "{}",
        out.stderr
    );
    let skipped = common::drain(&conn, &format!("{CARRIER_QUEUE}_skipped")).await;
    let mut ids: Vec<String> = skipped
        .iter()
        .map(|d| d.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    ids.sort();
    let mut expected = vec![none.to_string(), empty.to_string()];
    expected.sort();
    assert_eq!(ids, expected, "{}", out.stderr);
    assert_eq!(
        common::header_text(&skipped[0].properties, "MT-Reason").as_deref(),
        Some("dead-letter")
    );
}

/// A plain JSON message from MassTransit's raw JSON serialiser names its types in the `MT-MessageType` header (no
/// AMQP `type`): one naming another type (`ParcelLabelPrinted`, its fields those of a parcel here) goes to `_skipped`;
/// one naming the consumer's type is processed. The header was not read: the first was processed as a parcel.
#[tokio::test(flavor = "multi_thread")]
async fn a_raw_json_message_is_typed_by_its_masstransit_header() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let event = r#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT1", "destination": "Berlin"}"#;
    let (other, ours) = (Uuid::now_v7(), Uuid::now_v7());
    for (id, types) in [
        (
            other,
            "urn:message:ParcelTracker.Domain.Events:ParcelLabelPrinted",
        ),
        (
            ours,
            "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent;urn:message:ParcelTracker.Domain:IEvent",
        ),
    ] {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(
            "MT-MessageType".into(),
            AMQPValue::LongString(types.as_bytes().to_vec().into()),
        );
        common::publish(
            &conn,
            CARRIER_QUEUE,
            "",
            plain(Some(&id.to_string())).with_headers(headers),
            event.as_bytes(),
        )
        .await;
    }
    let out = common::consume_until_idle(&env, &["carrier"]);
    let pool = env.pool().await;
    let booked: Vec<Uuid> = sqlx::query_scalar("SELECT message_id FROM carrier_reservations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(booked, vec![ours], "{}", out.stderr);
    let skipped = common::drain(&conn, &format!("{CARRIER_QUEUE}_skipped")).await;
    assert_eq!(skipped.len(), 1, "{}", out.stderr);
    assert_eq!(
        skipped[0]
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some(other.to_string().as_str())
    );
}

/// `publish --id-kind`: MassTransit's NewId by default (one process part, its time the envelope's `sentTime`),
/// UUIDv7 or random v4 when asked; a kind it does not know is refused before anything is sent.
#[tokio::test(flavor = "multi_thread")]
async fn publish_makes_the_ids_it_is_asked_for() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    common::capture_queue(&conn, EVENT_EXCHANGE, "capture").await;
    for (flag, kind) in [
        (None, "newid"),
        (Some("newid"), "newid"),
        (Some("v7"), "v7"),
        (Some("v4"), "v4"),
    ] {
        let mut args = vec!["--count", "3"];
        if let Some(flag) = flag {
            args.extend(["--id-kind", flag]);
        }
        common::publish_parcels(&env, &args);
        let ours = common::drain(&conn, "capture").await;
        assert_eq!(ours.len(), 3, "{kind}");
        let ids: Vec<(Uuid, chrono::DateTime<chrono::Utc>)> = ours
            .iter()
            .map(|d| {
                let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
                let sent = body["sentTime"].as_str().unwrap().parse().unwrap();
                (body["messageId"].as_str().unwrap().parse().unwrap(), sent)
            })
            .collect();
        // A NewId's time, as .NET ticks, against the envelope's sentTime (written from the same clock).
        let ticks_apart = |(id, sent): &(Uuid, chrono::DateTime<chrono::Utc>)| {
            let sent =
                621_355_968_000_000_000_u64 + u64::try_from(sent.timestamp_micros()).unwrap() * 10;
            inboxctl::ids::new_id_ticks(*id).abs_diff(sent)
        };
        match kind {
            "newid" => {
                assert!(ids.iter().all(|i| ticks_apart(i) < 10_000_000), "{ids:?}");
                assert!(
                    ids.iter()
                        .all(|(id, _)| id.as_bytes()[..8] == ids[0].0.as_bytes()[..8])
                );
            }
            "v7" => assert!(
                ids.iter().all(|(id, _)| id.get_version_num() == 7),
                "{ids:?}"
            ),
            _ => {
                assert!(
                    ids.iter().all(|(id, _)| id.get_version_num() == 4),
                    "{ids:?}"
                );
                assert!(
                    ids.iter().all(|i| ticks_apart(i) > 10_000_000),
                    "random, not NewIds"
                );
            }
        }
    }
    let out = env.run(&[
        "publish",
        "parcel-created",
        "--count",
        "1",
        "--id-kind",
        "v5",
    ]);
    assert_eq!(out.code, Some(64), "a bad flag: {out:?}");
    assert!(out.stderr.contains("v5"), "{}", out.stderr);
    assert!(
        common::drain(&conn, "capture").await.is_empty(),
        "nothing sent"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_writes_what_masstransit_writes() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    common::capture_queue(&conn, EVENT_EXCHANGE, "capture").await;
    common::publish_parcels(&env, &["--count", "3"]);
    let ours = common::drain(&conn, "capture").await;
    assert_eq!(ours.len(), 3);

    let theirs = common::fixture("published/published-01.json");
    let keys = |body: &[u8], indent: &str| -> Vec<String> {
        String::from_utf8(body.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix(indent))
            .filter(|l| l.starts_with('"'))
            .map(|l| l.split('"').nth(1).unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        keys(&theirs.body, "  ").len(),
        15,
        "the fixture's envelope fields"
    );
    for delivery in &ours {
        let p = &delivery.properties;
        assert_eq!(p.content_type(), theirs.properties.content_type());
        assert_eq!(p.delivery_mode(), &Some(2));
        let body: serde_json::Value = serde_json::from_slice(&delivery.data).unwrap();
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str()),
            body["messageId"].as_str(),
            "id in both places"
        );
        // The same fields in the same order, indented the same way, at every level.
        assert_eq!(
            keys(&delivery.data, "  "),
            keys(&theirs.body, "  "),
            "envelope keys"
        );
        assert_eq!(
            keys(&delivery.data, "    "),
            keys(&theirs.body, "    "),
            "message and host keys"
        );
        assert!(delivery.data.starts_with(b"{\n  \"messageId\": \""));
        assert!(!delivery.data.ends_with(b"\n"), "no trailing newline");
        assert_eq!(
            body["messageType"],
            theirs.json["body_text"]
                .as_str()
                .map(
                    |t| serde_json::from_str::<serde_json::Value>(t).unwrap()["messageType"]
                        .clone()
                )
                .unwrap()
        );
        // Up to 7 digits, no trailing zero, and Z, as MassTransit's JSON writes it (its published-02 has 6).
        let sent = body["sentTime"].as_str().unwrap();
        let fraction = sent.split('.').nth(1).unwrap_or("Z");
        assert!(fraction.len() <= 8 && fraction.ends_with('Z'), "{sent}");
        assert!(!fraction.ends_with("0Z"), "{sent}");
        assert_eq!(body["headers"], serde_json::json!({}));
        // And inboxctl reads it back with the same code that reads MassTransit's.
        let incoming = inboxctl::amqp::envelope::parse(p, &delivery.data).unwrap();
        assert_eq!(
            incoming.message_id.to_string(),
            body["messageId"].as_str().unwrap()
        );
        assert!(incoming.masstransit);
    }
}

struct Bad {
    label: &'static str,
    properties: BasicProperties,
    body: Vec<u8>,
    reason: &'static str,
}

fn plain(id: Option<&str>) -> BasicProperties {
    let p = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    match id {
        Some(id) => p.with_message_id(id.into()),
        None => p,
    }
}

fn mt_envelope(id: Uuid, message: &str) -> Vec<u8> {
    format!(
        "{{\n  \"messageId\": \"{id}\",\n  \"messageType\": [\n    \"urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent\"\n  ],\n  \"message\": {message}\n}}"
    )
    .into_bytes()
}

in_both_modes!(
    unreadable_and_unhandled_messages_are_moved_with_their_reason_and_nothing_is_lost,
    unreadable_and_unhandled_messages_are_moved_with_their_reason_and_nothing_is_lost_in
);

async fn unreadable_and_unhandled_messages_are_moved_with_their_reason_and_nothing_is_lost_in(
    mode: &[&str],
) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let mt = |id: Uuid| inboxctl::amqp::envelope::masstransit_properties(id);
    let good_parcel = r#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT1", "destination": "Berlin"}"#;
    let bad = vec![
        Bad {
            label: "no id",
            properties: plain(None),
            body: good_parcel.as_bytes().to_vec(),
            reason: "has no message id",
        },
        Bad {
            label: "not JSON",
            properties: plain(Some(&Uuid::now_v7().to_string())),
            body: b"PT1;Berlin".to_vec(),
            reason: "is not JSON",
        },
        Bad {
            label: "empty",
            properties: plain(Some(&Uuid::now_v7().to_string())),
            body: Vec::new(),
            reason: "body is empty",
        },
        Bad {
            label: "id not a UUID",
            properties: plain(Some("order-17")),
            body: good_parcel.as_bytes().to_vec(),
            reason: "is not a UUID",
        },
        Bad {
            label: "parcelId not a UUID",
            properties: mt(Uuid::now_v7()),
            body: mt_envelope(
                Uuid::now_v7(),
                r#"{"parcelId": "nope", "trackingNumber": "PT2", "destination": "Rome"}"#,
            ),
            reason: "cannot be read as ParcelTracker.Domain.Events.ParcelCreatedEvent",
        },
        Bad {
            label: "parcelId missing",
            properties: mt(Uuid::now_v7()),
            body: mt_envelope(
                Uuid::now_v7(),
                r#"{"trackingNumber": "PT3", "destination": "Rome"}"#,
            ),
            reason: "missing field `parcelId`",
        },
        Bad {
            label: "invalid UTF-8",
            properties: mt(Uuid::now_v7()),
            body: b"{\"messageId\": \"\xff\xfe\"}".to_vec(),
            reason: "not JSON",
        },
        Bad {
            label: "JSON that is not an envelope nor an event",
            properties: plain(Some(&Uuid::now_v7().to_string())),
            body: br#"[{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad"}]"#.to_vec(),
            reason: "cannot be read as ParcelTracker.Domain.Events.ParcelCreatedEvent",
        },
        Bad {
            label: "duplicate keys",
            properties: plain(Some(&Uuid::now_v7().to_string())),
            body: br#"{"parcelId": "0ce06342-59c9-484e-badb-b581a07f00ad", "parcelId": "1ce06342-59c9-484e-badb-b581a07f00ad", "trackingNumber": "PT4", "destination": "Oslo"}"#.to_vec(),
            reason: "duplicate field `parcelId`",
        },
        Bad {
            label: "envelope with duplicate message ids",
            properties: mt(Uuid::now_v7()),
            body: format!(
                r#"{{"messageId": "{}", "messageId": "{}", "messageType": ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"], "message": {good_parcel}}}"#,
                Uuid::now_v7(),
                Uuid::now_v7()
            )
            .into_bytes(),
            reason: "duplicate field `messageId`",
        },
    ];
    for b in &bad {
        common::publish(&conn, CARRIER_QUEUE, "", b.properties.clone(), &b.body).await;
    }
    let good_id = Uuid::now_v7();
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        mt(good_id),
        &mt_envelope(good_id, good_parcel),
    )
    .await;
    let unhandled = common::fixture("sent/sent-02.json");
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        unhandled.properties.clone(),
        &unhandled.body,
    )
    .await;

    common::consume_until_idle(&env, &common::with_mode(&["carrier"], mode));

    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(
        errors.len(),
        bad.len(),
        "every unreadable message is in the error queue"
    );
    for b in &bad {
        let copy = errors
            .iter()
            .find(|e| e.data == b.body && e.properties.message_id() == b.properties.message_id())
            .unwrap_or_else(|| {
                panic!(
                    "{}: not in the error queue with its body and id unchanged",
                    b.label
                )
            });
        let p = &copy.properties;
        assert_eq!(
            common::header_text(p, "MT-Reason").as_deref(),
            Some("fault"),
            "{}",
            b.label
        );
        let message = common::header_text(p, "MT-Fault-Message").unwrap();
        assert!(
            message.contains(b.reason),
            "{}: {message:?} should say {:?}",
            b.label,
            b.reason
        );
        assert_eq!(
            p.headers()
                .as_ref()
                .unwrap()
                .inner()
                .get("MT-Fault-RetryCount"),
            Some(&AMQPValue::LongInt(0))
        );
        assert_eq!(
            common::header_text(p, "MT-Fault-InputAddress").as_deref(),
            Some(format!("rabbitmq://127.0.0.1/{}/{CARRIER_QUEUE}", env.vhost).as_str())
        );
        assert_eq!(
            common::header_text(p, "MT-Fault-ConsumerType").as_deref(),
            Some(CARRIER_QUEUE)
        );
        assert_eq!(
            p.content_type(),
            b.properties.content_type(),
            "properties kept"
        );
    }
    let skipped = common::drain(&conn, &format!("{CARRIER_QUEUE}_skipped")).await;
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].data, unhandled.body);

    let pool = env.pool().await;
    let effects: Vec<Uuid> = sqlx::query_scalar("SELECT message_id FROM carrier_reservations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        effects,
        vec![good_id],
        "the good message among them was processed"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    let moved = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind IN ('dead_lettered', 'skipped')",
    )
    .await;
    assert_eq!(moved, bad.len() as i64 + 1);
}

in_both_modes!(
    failing_work_is_retried_then_moved_with_its_retry_count,
    failing_work_is_retried_then_moved_with_its_retry_count_in
);

async fn failing_work_is_retried_then_moved_with_its_retry_count_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "4"]);
    let failing = common::publish_parcels(&env, &["--count", "1", "--destination", "FAIL"]);
    assert_eq!(failing["published"], 1);

    let out = common::consume_until_idle(
        &env,
        &common::with_mode(
            &[
                "carrier",
                "--fail-destination",
                "FAIL",
                "--max-attempts",
                "3",
                "--retry-delay",
                "10ms",
            ],
            mode,
        ),
    );
    assert_eq!(
        out.stderr.matches("attempt failed").count(),
        2,
        "{}",
        out.stderr
    );

    let conn = env.amqp().await;
    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(errors.len(), 1);
    let p = &errors[0].properties;
    assert_eq!(
        common::header_text(p, "MT-Fault-Message").as_deref(),
        Some("carrier API returned 503")
    );
    assert_eq!(
        p.headers()
            .as_ref()
            .unwrap()
            .inner()
            .get("MT-Fault-RetryCount"),
        Some(&AMQPValue::LongInt(2))
    );
    assert_eq!(
        common::header_text(p, "MT-Fault-MessageType").as_deref(),
        Some("ParcelTracker.Domain.Events.ParcelCreatedEvent")
    );
    let failed_id = Uuid::parse_str(p.message_id().as_ref().unwrap().as_str()).unwrap();

    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        4
    );
    let failed_attempts = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'",
    )
    .await;
    assert_eq!(failed_attempts, 3);
    let claimed: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE id = $1)")
            .bind(failed_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        !claimed,
        "a failed attempt leaves no inbox row, so a replay will be processed"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// A message listing several types, the consumer's not first (a subtype published as such, MassTransit listing its
/// base types after it): its error copy's `MT-Fault-MessageType` names the type consumed, as MassTransit's does, not
/// the envelope's first (which it used to).
#[tokio::test(flavor = "multi_thread")]
async fn a_fault_names_the_type_consumed_not_the_envelopes_first() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let (props, body, _) = common::parcel_message(Uuid::new_v4(), "FAIL");
    let mut envelope: serde_json::Value = serde_json::from_slice(&body).unwrap();
    envelope["messageType"] = serde_json::json!([
        "urn:message:Shop.Parcels:ExpressParcelCreated",
        "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"
    ]);
    let body = serde_json::to_vec(&envelope).unwrap();
    common::publish(&conn, "", CARRIER_QUEUE, props, &body).await;
    common::consume_until_idle(
        &env,
        &[
            "carrier",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "1",
        ],
    );
    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(errors.len(), 1);
    assert_eq!(
        common::header_text(&errors[0].properties, "MT-Fault-MessageType").as_deref(),
        Some("ParcelTracker.Domain.Events.ParcelCreatedEvent")
    );
}

#[cfg(feature = "failpoints")]
in_both_modes!(
    a_panic_fails_its_message_not_the_process,
    a_panic_fails_its_message_not_the_process_in
);

#[cfg(feature = "failpoints")]
async fn a_panic_fails_its_message_not_the_process_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "3"]);
    common::publish_parcels(&env, &["--count", "1", "--destination", "PANIC"]);
    common::publish_parcels(&env, &["--count", "3"]);

    let mut consumer = env.spawn_with(
        &common::with_mode(
            &[
                "consume",
                "carrier",
                "--max-attempts",
                "2",
                "--retry-delay",
                "10ms",
                "--exit-when-idle",
                "1s",
            ],
            mode,
        ),
        &[("INBOXCTL_FAILPOINTS", "carrier=panic@PANIC")],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );

    let conn = env.amqp().await;
    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(errors.len(), 1);
    let reason = common::header_text(&errors[0].properties, "MT-Fault-Message").unwrap();
    assert!(reason.contains("panicked: failpoint carrier"), "{reason}");
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        6
    );
}

/// A batched consumer's message alone goes as one statement; a panic of the consumer's code there (its `effect`) is a
/// failed attempt of that message, counted as one by one counts it: retried to `--max-attempts` and moved aside with
/// its retry count. Were the panic to escape it (or send the batch one by one from its first attempt), the worker's
/// last resort would give the message back after a pause, uncounted, and the work would run once more than allowed.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_of_a_batched_message_alone_is_a_counted_attempt() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "PANIC"]);
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--batch-size",
            "8",
            "--max-attempts",
            "3",
            "--retry-delay",
            "10ms",
            "--exit-when-idle",
            "1s",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier-effect=panic@PANIC")],
    );
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert!(!stderr.contains("handling a batch panicked"), "{stderr}");
    assert_eq!(
        stderr.matches("attempt failed").count(),
        2,
        "two retries, then moved aside: {stderr}"
    );

    let conn = env.amqp().await;
    let errors = common::drain(&conn, &format!("{CARRIER_QUEUE}_error")).await;
    assert_eq!(errors.len(), 1);
    let p = &errors[0].properties;
    let reason = common::header_text(p, "MT-Fault-Message").unwrap();
    assert!(
        reason.contains("panicked: failpoint carrier-effect"),
        "{reason}"
    );
    assert_eq!(
        p.headers()
            .as_ref()
            .unwrap()
            .inner()
            .get("MT-Fault-RetryCount"),
        Some(&AMQPValue::LongInt(2))
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'"
        )
        .await,
        3
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ef_core_inbox_is_claimed_through_its_own_key() {
    let env = TestEnv::empty().await;
    let pool = env.pool().await;
    sqlx::raw_sql(include_str!("fixtures/interop/efcore/ef_create_script.sql"))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(env.run(&["migrate"]).code, Some(0));
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "5", "--duplicates", "1"]);
    common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        5
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        5
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        5
    );
}

/// A 10 MB event is nothing special: read, processed once, acked; the consumer's memory stays bounded by what it
/// holds in flight (a prefetch of 2 here).
#[tokio::test(flavor = "multi_thread")]
async fn a_ten_megabyte_message_is_processed_once() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let id = Uuid::now_v7();
    let destination = "x".repeat(10 * 1024 * 1024);
    let body = mt_envelope(
        id,
        &format!(
            r#"{{"parcelId": "{}", "trackingNumber": "PT10MB", "destination": "{destination}"}}"#,
            Uuid::now_v7()
        ),
    );
    assert!(body.len() > 10 * 1024 * 1024);
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        inboxctl::amqp::envelope::masstransit_properties(id),
        &body,
    )
    .await;
    let out = common::consume_until_idle(&env, &["carrier", "--prefetch", "2"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let pool = env.pool().await;
    let effects: Vec<Uuid> = sqlx::query_scalar("SELECT message_id FROM carrier_reservations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(effects, vec![id]);
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
    assert!(
        !env.queue_exists(&format!("{CARRIER_QUEUE}_error"))
            || env.queue_counts(&format!("{CARRIER_QUEUE}_error")) == (0, 0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_type_over_500_characters_is_refused_at_start() {
    let env = TestEnv::migrated().await;
    let long = "c".repeat(501);
    let out = env.run(&["consume", "carrier", "--consumer-type", &long]);
    assert_eq!(out.code, Some(64), "{out:?}");
    assert!(out.stderr.contains("501 characters"), "{}", out.stderr);
    assert!(out.stderr.contains("at most 500"), "{}", out.stderr);
    assert!(
        !env.queue_exists(CARRIER_QUEUE),
        "refused before touching the broker"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn consuming_before_migrate_says_to_migrate() {
    let env = TestEnv::empty().await;
    let out = env.run(&["consume", "carrier"]);
    assert_eq!(out.code, Some(78), "{out:?}");
    assert!(
        out.stderr.contains("run `inboxctl migrate` first"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_consumer_cleanly() {
    let env = TestEnv::migrated().await;
    let mut consumer = env.spawn(&["consume", "notification"]);
    consumer.wait_for_stderr("consuming", Duration::from_secs(30));
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(consumer.stderr().contains("consumer stopped"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_custom_consumer_type_is_its_own_scope() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let report = common::publish_parcels(&env, &["--count", "3"]);
    assert_eq!(report["published"], 3);
    common::consume_until_idle(&env, &["carrier", "--consumer-type", "carrier-v2"]);
    let pool = env.pool().await;
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM inbox_messages WHERE consumer_type = $1",
            "carrier-v2"
        )
        .await,
        3
    );
    let (queue, vhost): (String, Option<String>) = sqlx::query_as(
        "SELECT queue, vhost FROM inboxctl_consumers WHERE consumer_type = 'carrier-v2'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(queue, CARRIER_QUEUE);
    assert_eq!(
        vhost,
        Some(env.vhost.clone()),
        "cleanup's guard looks there"
    );
}

/// A consumer deployed before `migrate` added the vhost it records (a rolling upgrade): it registers without it, says
/// to run `migrate`, and consumes.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_on_a_database_without_the_vhost_column_runs_and_says_to_migrate() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    sqlx::query("ALTER TABLE inboxctl_consumers DROP COLUMN vhost")
        .execute(&pool)
        .await
        .unwrap();
    common::publish_parcels(&env, &["--count", "3"]);
    let out = common::consume_until_idle(&env, &["carrier"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr.contains("run `inboxctl migrate`"),
        "{}",
        out.stderr
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        3
    );
}

/// An argument that is not UTF-8 (a path is the operator's to give as any bytes): the audit row written as consuming
/// starts read the command line with `std::env::args`, which panicked, and the consumer never consumed.
#[tokio::test(flavor = "multi_thread")]
async fn an_argument_that_is_not_utf8_is_audited_not_a_panic() {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "2"]);
    let mut file = std::env::temp_dir()
        .join(format!("{}-pw", env.db_name))
        .into_os_string();
    file.push(std::ffi::OsStr::from_bytes(b"\xff"));
    std::fs::write(&file, "unused-by-trust\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = common::Output::of(
        env.cmd()
            .arg("--database-password-file")
            .arg(&file)
            .args(["consume", "carrier", "--exit-when-idle", "1s"])
            .output()
            .unwrap(),
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        2
    );
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inboxctl_audit WHERE command = 'consume' AND command_line LIKE '%\u{FFFD}%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        audited >= 1,
        "the start audited, the odd byte shown as U+FFFD"
    );
}

/// A publish the broker keeps refusing (a queue bound to its exchange that takes nothing, `reject-publish`) stops
/// once `--reconnect-timeout` runs out; it used to stop saying only "refused", leaving the operator to guess what was
/// on the queue. It says how many copies were confirmed.
#[tokio::test(flavor = "multi_thread")]
async fn a_publish_the_broker_keeps_refusing_says_how_far_it_got() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    common::declare_queue_that_refuses_everything(&conn, "refusing").await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_bind(
            "refusing".into(),
            EVENT_EXCHANGE.into(),
            "".into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let out = env.run(&[
        "publish",
        "parcel-created",
        "--count",
        "5",
        "--reconnect-timeout",
        "2s",
    ]);
    assert_ne!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr
            .contains("the broker had confirmed 0 of 5 copies"),
        "{}",
        out.stderr
    );
}

/// Copies that reached no queue are said in the line a person reads, not only in a warning a log filter can hide.
#[tokio::test(flavor = "multi_thread")]
async fn a_publish_to_an_exchange_nothing_is_bound_to_says_so_in_its_line() {
    let env = TestEnv::migrated().await;
    let out = env.run(&["publish", "parcel-created", "--count", "2"]);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stdout.contains("2 of them reached no queue"),
        "{}",
        out.stdout
    );
}

/// `publish` stopped by SIGTERM midway: it stops sending, waits for the confirms of what it sent, and says how far it
/// got (exit 3, `interrupted`); exactly those copies are on the queue.
#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_publish_says_how_many_the_broker_confirmed() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--count",
        "2000",
        "--rate",
        "100",
        "--json",
    ]);
    common::eventually("some published", Duration::from_secs(30), || async {
        env.queue_counts(CARRIER_QUEUE).0 >= 50
    })
    .await;
    publisher.terminate();
    assert_eq!(
        publisher.wait(Duration::from_secs(20)),
        Some(3),
        "{}",
        publisher.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(publisher.stdout().trim()).unwrap();
    assert_eq!(report["interrupted"], true, "{report}");
    assert_eq!(report["planned"], 2000, "{report}");
    let published = report["published"].as_u64().unwrap();
    assert!((50..2000).contains(&published), "{report}");
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (published, 0));
}

/// A publish stopped while it waits to send again a copy the broker refused (a queue full with `reject-publish`, as a
/// quorum queue electing a leader refuses for a moment): interrupted, its confirmed copies reported (exit 3). It
/// ended with exit 1 and no report, the count of what the broker had confirmed lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_publish_stopped_while_the_broker_refuses_copies_reports_what_was_confirmed() {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let env = TestEnv::migrated().await;
    let declared = env.run(&[
        "publish",
        "parcel-created",
        "--exchange",
        "full-x",
        "--count",
        "0",
    ]);
    assert_eq!(declared.code, Some(0), "{declared:?}");
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare("full-q".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    channel
        .queue_bind(
            "full-q".into(),
            "full-x".into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut publisher = env.spawn(&[
        "publish",
        "parcel-created",
        "--exchange",
        "full-x",
        "--count",
        "20",
        "--json",
    ]);
    publisher.wait_for_stderr("RabbitMQ refused a copy", Duration::from_secs(30));
    publisher.terminate();
    assert_eq!(
        publisher.wait(Duration::from_secs(20)),
        Some(3),
        "{}",
        publisher.stderr()
    );
    let report: serde_json::Value = serde_json::from_str(publisher.stdout().trim()).unwrap();
    assert_eq!(report["interrupted"], true, "{report}");
    assert_eq!(report["published"], 1, "{report}");
}

// A stop that comes while a failed message waits for its next attempt: the wait is cut short and the message given
// back to the broker, neither acknowledged (it would be lost: no effect, no error-queue copy) nor held for the whole
// delay. The delay (30 s, the cap) and the shutdown timeout (60 s) are far longer than the stop may take, so a prompt
// exit with the message ready again can only be the backoff's own way out.
in_both_modes!(
    a_stop_during_a_retry_backoff_gives_the_message_back,
    a_stop_during_a_retry_backoff_gives_the_message_back_in
);

async fn a_stop_during_a_retry_backoff_gives_the_message_back_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "FAIL"]);

    let mut consumer = env.spawn(&common::with_mode(
        &[
            "consume",
            "carrier",
            "--fail-destination",
            "FAIL",
            "--retry-delay",
            "30s",
            "--max-attempts",
            "5",
            "--shutdown-timeout",
            "60s",
        ],
        mode,
    ));
    consumer.wait_for_stderr("attempt failed", Duration::from_secs(30));
    let asked = std::time::Instant::now();
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "the backoff is cut short by the stop ({:?})",
        asked.elapsed()
    );
    assert!(
        !consumer.stderr().contains("shutdown timeout reached"),
        "given back, not abandoned: {}",
        consumer.stderr()
    );

    common::eventually(
        "no delivery left unsettled once the process is gone",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE).1 == 0 },
    )
    .await;
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (1, 0),
        "the message given back, not acknowledged:\n{}",
        consumer.stderr()
    );
    let error_queue = format!("{CARRIER_QUEUE}_error");
    assert!(
        !env.queue_exists(&error_queue) || env.queue_counts(&error_queue) == (0, 0),
        "a stop is not a failure: nothing in {error_queue}"
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        0,
        "no effect"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0,
        "no claim left behind"
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'failed'"
        )
        .await,
        1,
        "the one attempt made"
    );
}

// The consumer's own dead-lettering when the broker refuses the copy with a nack: `<queue>_error` and
// `<queue>_skipped` exist already, declared by someone else with `x-max-length=0` and `x-overflow=reject-publish`
// (inboxctl uses an existing queue as it is), so every copy published to them is nacked. An unreadable message and
// one of a type the consumer does not handle must then stay on their own queue — never acknowledged, since no copy
// of them exists anywhere else — while the consumer keeps working on the rest.
in_both_modes!(
    a_dead_letter_copy_the_broker_nacks_leaves_the_message_on_its_queue,
    a_dead_letter_copy_the_broker_nacks_leaves_the_message_on_its_queue_in
);

async fn a_dead_letter_copy_the_broker_nacks_leaves_the_message_on_its_queue_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let error_queue = format!("{CARRIER_QUEUE}_error");
    let skipped_queue = format!("{CARRIER_QUEUE}_skipped");
    common::declare_queue_that_refuses_everything(&conn, &error_queue).await;
    common::declare_queue_that_refuses_everything(&conn, &skipped_queue).await;
    let id = Uuid::now_v7();
    let body = b"PT1;Berlin".to_vec();
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        plain(Some(&id.to_string())),
        &body,
    )
    .await;
    let unhandled = common::fixture("sent/sent-02.json");
    common::publish(
        &conn,
        CARRIER_QUEUE,
        "",
        unhandled.properties.clone(),
        &unhandled.body,
    )
    .await;

    let mut consumer = env.spawn(&common::with_mode(
        &["consume", "carrier", "--concurrency", "4"],
        mode,
    ));
    let refused = |queue: &str| format!("could not move a message to {queue}");
    // Whichever comes first — both refusals said, or a message gone — comes within seconds; then judge.
    common::eventually(
        "both copies refused, or a message gone from its queue",
        Duration::from_secs(30),
        || async {
            let stderr = consumer.stderr();
            let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
            (stderr.contains(&refused(&error_queue)) && stderr.contains(&refused(&skipped_queue)))
                || ready + unacked < 2
        },
    )
    .await;
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(
        ready + unacked,
        2,
        "the broker refused the copies: neither message may be acknowledged\n{}",
        consumer.stderr()
    );

    // It keeps running: a healthy message published now is processed.
    common::publish_parcels(&env, &["--count", "1"]);
    let pool = env.pool().await;
    common::eventually(
        "the healthy message processed beside the refused one",
        Duration::from_secs(30),
        || async { common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 1 },
    )
    .await;
    assert!(
        consumer.try_wait().is_none(),
        "the consumer runs on: {}",
        consumer.stderr()
    );
    let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
    assert_eq!(ready + unacked, 2, "still there, still not acknowledged");
    assert_eq!(env.queue_counts(&error_queue), (0, 0));
    assert_eq!(env.queue_counts(&skipped_queue), (0, 0));
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind IN ('dead_lettered', 'skipped')"
        )
        .await,
        0,
        "nothing counted as dead-lettered or skipped"
    );

    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    common::eventually(
        "no delivery left unsettled once the process is gone",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE).1 == 0 },
    )
    .await;
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (2, 0),
        "the messages given back at the stop"
    );
    let left = common::drain(&conn, CARRIER_QUEUE).await;
    assert_eq!(left.len(), 2);
    let unreadable = left
        .iter()
        .find(|d| d.data == body)
        .expect("the unreadable message itself, byte for byte");
    assert_eq!(
        unreadable
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some(id.to_string().as_str())
    );
    assert!(
        left.iter().any(|d| d.data == unhandled.body),
        "the unhandled message itself, byte for byte"
    );
}

// A stop that comes while a message's work is under way: the work finishes within the shutdown timeout, commits, and
// its delivery is acknowledged before the connection closes. Given back instead, every message in flight at every
// deploy would come round again as a duplicate (the inbox would absorb it, but the duplicate rate would say
// something that did not happen, and a slow effect would be looked up again).
in_both_modes!(
    a_stop_lets_the_work_in_flight_finish_and_acknowledges_it,
    a_stop_lets_the_work_in_flight_finish_and_acknowledges_it_in
);

async fn a_stop_lets_the_work_in_flight_finish_and_acknowledges_it_in(mode: &[&str]) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Slow"]);
    let mut consumer = env.spawn_with(
        &common::with_mode(&["consume", "carrier", "--shutdown-timeout", "60s"], mode),
        &[("INBOXCTL_FAILPOINTS", "carrier=sleep-once-2000@Slow")],
    );
    consumer.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1,
        "the work in flight finished:\n{}",
        consumer.stderr()
    );
    common::eventually(
        "no delivery left unsettled once the process is gone",
        Duration::from_secs(10),
        || async { env.queue_counts(CARRIER_QUEUE).1 == 0 },
    )
    .await;
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (0, 0),
        "what was processed was acknowledged, not given back:\n{}",
        consumer.stderr()
    );
}

/// Batched, a member whose work hangs (a carrier call that never answers) past `--attempt-timeout`: the batch goes
/// one by one, the hung member is tried again alone, and the others are processed. The batch used to be tried again
/// whole on every timeout, none of its members ever committed, its worker held for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_a_member_stuck_past_the_attempt_timeout_holds_up_only_itself() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "1", "--destination", "Stuck"]);
    common::publish_parcels(&env, &["--count", "7"]);
    let consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--batch-size",
            "8",
            // One batch at a time, so that the stuck member shares its batch with the seven (two at once, it may go
            // alone in one).
            "--concurrency",
            "1",
            "--claim-timeout",
            "1s",
            "--attempt-timeout",
            "3s",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier=pause@Stuck")],
    );
    let pool = env.pool().await;
    common::eventually(
        "the seven beside the stuck one processed",
        Duration::from_secs(40),
        || async { common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 7 },
    )
    .await;
    assert!(
        consumer
            .stderr()
            .contains("processing its messages one by one"),
        "{}",
        consumer.stderr()
    );
    consumer.terminate();
}

/// A message whose work outlasts every attempt (a carrier call that never answers, for this message only) while
/// PostgreSQL answers: each attempt given up past `--attempt-timeout` was taken for an outage — intake paused,
/// `/health` down, the attempt never counted — and the message tried for ever, the run never idle. From its second
/// time in a row (the first may be a connection gone silent) it is a failed attempt now: after `--max-attempts` it is
/// in the error queue and the run ends idle, the others processed. One by
/// one, then batched (the batch given up goes one by one, and the stuck member the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_work_outlasts_every_attempt_ends_in_the_error_queue() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let pool = env.pool().await;
    for (round, mode) in [common::ONE_BY_ONE, common::BATCHED].iter().enumerate() {
        common::publish_parcels(&env, &["--count", "1", "--destination", "Stuck"]);
        common::publish_parcels(&env, &["--count", "7"]);
        let args = common::with_mode(
            &[
                "consume",
                "carrier",
                "--claim-timeout",
                "1s",
                "--attempt-timeout",
                "2s",
                "--max-attempts",
                "2",
                "--exit-when-idle",
                "2s",
            ],
            mode,
        );
        let mut consumer = env.spawn_with(&args, &[("INBOXCTL_FAILPOINTS", "carrier=pause@Stuck")]);
        let code = consumer.wait(Duration::from_secs(90));
        let said = consumer.stderr();
        assert_eq!(code, Some(0), "{mode:?}: {said}");
        let done = i64::try_from(7 * (round + 1)).unwrap();
        assert_eq!(
            common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
            done,
            "{mode:?}: {said}"
        );
        assert_eq!(
            env.queue_counts("parcel-created-carrier_error").0,
            u64::try_from(round + 1).unwrap(),
            "{mode:?}: {said}"
        );
        assert!(
            said.contains("the attempt did not end within --attempt-timeout (2s), twice in a row, while PostgreSQL answered"),
            "{mode:?}: {said}"
        );
    }
}

/// A stop while one message is worked on and 19 more wait in the consumer (`--concurrency 1`, prefetch 20): the 19
/// go back to the queue at once, for the other consumers, not after the drain (here 12 s of work) when the connection
/// closes. The one in the consume loop's hand waiting for a worker is given back too, and the one under way finishes
/// and is acknowledged. (12 s: each look at the queue is a `rabbitmqctl` call, seconds on a loaded machine, and the
/// looks must all come before the work ends. The one still unacknowledged in `(19, 1)` is the work in flight: the
/// process is still draining then.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_gives_back_at_once_what_no_worker_has_taken() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "20"]);
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "1",
            "--prefetch",
            "20",
            "--shutdown-timeout",
            "60s",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier=sleep-once-12000")],
    );
    consumer.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    let reached = std::time::Instant::now();
    common::eventually("all 20 with it", Duration::from_secs(5), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 20)
    })
    .await;
    consumer.terminate();
    common::eventually(
        "the 19 not taken given back while the first is still worked on",
        Duration::from_secs(6),
        || async { env.queue_counts(CARRIER_QUEUE) == (19, 1) },
    )
    .await;
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    // The drain waited for the work held 12 s.
    assert!(
        reached.elapsed() >= Duration::from_secs(11),
        "{:?}",
        reached.elapsed()
    );
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (19, 0),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1,
        "the one under way finished"
    );
}

/// The same in batched mode: the deliveries queued for the batch workers, not in a batch yet, went on into batches
/// while the stop drained, though the documentation said they went back. A stop while the first batch is held before
/// its commit (20 s: the looks at the queue are `rabbitmqctl` calls, seconds each on a loaded machine): the rest go
/// back at once; the batch under way commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_gives_back_at_once_what_no_batch_has_taken() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "20"]);
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--batch-size",
            "4",
            // One batch at a time: the one held is all that a batch has taken.
            "--concurrency",
            "1",
            "--prefetch",
            "20",
            "--shutdown-timeout",
            "60s",
        ],
        &[("INBOXCTL_FAILPOINTS", "before-commit=sleep-once-20000")],
    );
    consumer.wait_for_stderr("failpoint before-commit reached", Duration::from_secs(30));
    common::eventually("all 20 with it", Duration::from_secs(5), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 20)
    })
    .await;
    consumer.terminate();
    common::eventually(
        "those in no batch given back while the first batch is held",
        Duration::from_secs(6),
        || async {
            let (ready, unacked) = env.queue_counts(CARRIER_QUEUE);
            ready >= 16 && ready + unacked == 20
        },
    )
    .await;
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    let booked = common::count(&pool, "SELECT count(*) FROM carrier_reservations").await;
    assert!((1..=4).contains(&booked), "the batch under way: {booked}");
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (20 - booked as u64, 0),
        "{}",
        consumer.stderr()
    );
}

/// RabbitMQ closes a consuming channel alone, its connection left up — as it does to a delivery held past its
/// `consumer_timeout` (here: an ack of an unknown delivery tag done on the consumer's channel inside the broker, the
/// same 406 close). The consumer, its one worker held 10 s and its loop waiting for it with the next delivery, sees
/// the channel lost within seconds and consumes again on a new connection; it used to look at the connection only,
/// and stayed away from the queue until the worker was free, then handed the next delivery over on the dead channel.
/// Every parcel booked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consuming_channel_the_broker_closes_is_seen_while_the_loop_waits_for_a_worker() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "3"]);
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--concurrency",
            "1",
            "--prefetch",
            "10",
        ],
        &[("INBOXCTL_FAILPOINTS", "carrier=sleep-once-10000")],
    );
    consumer.wait_for_stderr("failpoint carrier reached", Duration::from_secs(30));
    common::eventually("all 3 with it", Duration::from_secs(5), || async {
        env.queue_counts(CARRIER_QUEUE) == (0, 3)
    })
    .await;
    // Through the test process's own Erlang node (milliseconds; a `rabbitmqctl` call can take seconds on a loaded
    // box, and everything up to the close must fit in the worker's 10 s hold).
    let ask = |expression: String| {
        common::erl::eval(&expression)
            .unwrap_or_else(|| common::rabbitmqctl(&["-q", "eval", &expression]))
    };
    let consumers = || {
        ask(format!(
            "case rabbit_amqqueue:lookup(rabbit_misc:r({}, queue, {})) of \
               {{ok, Q}} -> [{{consumers, C}}] = rabbit_amqqueue:info(Q, [consumers]), C; _ -> none end.",
            common::erl::binary(&env.vhost),
            common::erl::binary(CARRIER_QUEUE)
        ))
        .trim()
        .to_owned()
    };
    assert_eq!(consumers(), "1");
    // Other tests' channels come and go on the shared broker: one that closes between `list()` and `info()` exits
    // the call, and `catch` passes over it (its `{'EXIT', _}` matches no pattern).
    let closed = ask(format!(
        "[rabbit_channel:do(P, {{'basic.ack', 999999, false}}) || P <- rabbit_channel:list(), \
         [{{vhost, V}}, {{consumer_count, C}}] <- [(catch rabbit_channel:info(P, [vhost, consumer_count]))], \
         V =:= {}, C > 0].",
        common::erl::binary(&env.vhost)
    ));
    assert_eq!(closed.trim(), "[ok]", "one consuming channel closed");
    // Seen while the loop waits for the worker held 10 s: said at once, not once the worker is free.
    let closed_at = std::time::Instant::now();
    consumer.wait_for_stderr(
        "RabbitMQ connection lost while waiting for a free worker",
        Duration::from_secs(6),
    );
    assert!(
        closed_at.elapsed() < Duration::from_secs(6),
        "{:?}",
        closed_at.elapsed()
    );
    common::eventually(
        "consuming again on a new connection",
        Duration::from_secs(20),
        || async { consumers() == "1" },
    )
    .await;
    let pool = env.pool().await;
    common::eventually("every parcel booked", Duration::from_secs(30), || async {
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await == 3
    })
    .await;
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        3,
        "{}",
        consumer.stderr()
    );
}

/// `--exit-when-idle`: a message that arrives between the look at the queue that finds it idle and the cancel (the
/// window held open 3 s by a failpoint) is delivered to the stopping consumer. It is processed before the process
/// ends, not left on the queue for the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_arriving_as_the_queue_is_found_idle_is_processed_before_the_exit() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut consumer = env.spawn_with(
        &["consume", "carrier", "--exit-when-idle", "200ms"],
        &[("INBOXCTL_FAILPOINTS", "idle-stopping=sleep-once-3000")],
    );
    // Published on a connection opened beforehand: within the 3 s window however slow a new process would start.
    let conn = env.amqp().await;
    consumer.wait_for_stderr("failpoint idle-stopping reached", Duration::from_secs(30));
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "Berlin");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let pool = env.pool().await;
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM carrier_reservations").await,
        1,
        "processed before the exit:\n{}",
        consumer.stderr()
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0));
}

/// The same, the late message failing and retried past `--shutdown-timeout`: no stop was asked for, so the timeout
/// does not cut it short — it is retried and moved aside before the exit, not abandoned and left on the queue while
/// the process says the queue was idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_message_retried_past_the_shutdown_timeout_is_finished_before_the_idle_exit() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--exit-when-idle",
            "200ms",
            "--shutdown-timeout",
            "1s",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "2",
            "--retry-delay",
            "3s",
        ],
        &[("INBOXCTL_FAILPOINTS", "idle-stopping=sleep-once-3000")],
    );
    let conn = env.amqp().await;
    consumer.wait_for_stderr("failpoint idle-stopping reached", Duration::from_secs(30));
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    assert_eq!(
        consumer.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(
        !consumer.stderr().contains("abandoning"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(
        env.queue_counts(CARRIER_QUEUE),
        (0, 0),
        "{}",
        consumer.stderr()
    );
    assert_eq!(env.queue_counts(&format!("{CARRIER_QUEUE}_error")).0, 1);
}

/// The same, the connection closed (by the broker) while the late message waits for its retry: the message is left to
/// its redelivery, so the run is not idle — it connects again, the message comes round and is finished there, and
/// only then does the process end. Before, the wait for the work to finish looked at the connection on a tick of its
/// own: when the message's task saw the loss first and ended, the work looked done, and the process ended "idle"
/// with the message back on the queue (about half the runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_while_the_idle_exit_finishes_a_late_message_is_not_taken_for_idle() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let mut consumer = env.spawn_with(
        &[
            "consume",
            "carrier",
            "--exit-when-idle",
            "200ms",
            "--fail-destination",
            "FAIL",
            "--max-attempts",
            "2",
            "--retry-delay",
            "8s",
        ],
        // The late message's first attempt takes 0.9 s: the connection checks of its retry wait then come 0.9 s
        // after those of the wait for the work to finish (both once a second), i.e. a tenth of a second before them.
        &[(
            "INBOXCTL_FAILPOINTS",
            "idle-stopping=sleep-once-3000,carrier=sleep-once-900@FAIL",
        )],
    );
    let conn = env.amqp().await;
    consumer.wait_for_stderr("failpoint idle-stopping reached", Duration::from_secs(30));
    let (props, body, _) = common::parcel_message(Uuid::now_v7(), "FAIL");
    common::publish(&conn, common::EVENT_EXCHANGE, "", props, &body).await;
    // Found while the message's first attempt runs, so that the close below is one quick call well inside the retry
    // wait (8 s).
    let pid = common::connection_pid(&env.vhost, "inboxctl consume");
    consumer.wait_for_stderr("attempt failed", Duration::from_secs(30));
    common::close_connection_by_pid(&pid);
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    let stderr = consumer.stderr();
    assert!(
        stderr.contains("not idle until it is done"),
        "the loss was seen: {stderr}"
    );
    assert_eq!(env.queue_counts(CARRIER_QUEUE), (0, 0), "{stderr}");
    assert_eq!(
        env.queue_counts(&format!("{CARRIER_QUEUE}_error")).0,
        1,
        "{stderr}"
    );
}

/// `--exit-when-idle`: a stop (SIGTERM) that comes while the idle check waits on the broker's answer about the queue's
/// depth (held for ever by a failpoint, as by a broker that stopped answering) ends the process at once, not after
/// `--broker-timeout` (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_not_held_by_the_idle_checks_look_at_the_queue() {
    a_stop_is_not_held_by_the_broker_answering(
        &["consume", "carrier", "--exit-when-idle", "200ms"],
        "a look at the queue's depth",
    )
    .await;
}

/// A stop (SIGTERM) that comes while the consumer waits for the broker to start its consuming (`basic.consume`, held
/// for ever by a failpoint, as by a broker that stopped answering) ends the process at once, not after
/// `--broker-timeout` (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_not_held_by_the_start_of_consuming() {
    a_stop_is_not_held_by_the_broker_answering(&["consume", "carrier"], "the start of consuming")
        .await;
}

/// Runs `args` with the broker's answer to `call` held for ever, then stops it: it must end at once.
async fn a_stop_is_not_held_by_the_broker_answering(args: &[&str], call: &str) {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let held = format!("broker-answer=pause@{call}");
    let mut consumer = env.spawn_with(args, &[("INBOXCTL_FAILPOINTS", held.as_str())]);
    consumer.wait_for_stderr("failpoint broker-answer reached", Duration::from_secs(30));
    let asked = std::time::Instant::now();
    consumer.terminate();
    assert_eq!(
        consumer.wait(Duration::from_secs(60)),
        Some(0),
        "{}",
        consumer.stderr()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stopped in {:?}:\n{}",
        asked.elapsed(),
        consumer.stderr()
    );
}
