use super::*;
use lapin::types::{FieldArray, LongString};

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

#[test]
fn masstransit_error_headers() {
    let mut h = FieldTable::default();
    h.insert(
        "MT-Fault-InputAddress".into(),
        long("rabbitmq://127.0.0.1/parcel-created-carrier"),
    );
    h.insert("MT-Fault-Message".into(), long("carrier API returned 503"));
    h.insert(
        "MT-Fault-Timestamp".into(),
        long("2026-11-30T20:14:50.2268983Z"),
    );
    h.insert("MT-Reason".into(), long("fault"));
    let f = failure(Some(&h), "parcel-created-carrier_error", "/");
    assert_eq!(f.origin, Origin::Queue("parcel-created-carrier".into()));
    assert_eq!(f.reason.as_deref(), Some("carrier API returned 503"));
    assert_eq!(
        f.failed_at.map(|t| t.to_rfc3339()).as_deref(),
        Some("2026-11-30T20:14:50.226898300+00:00")
    );
    assert_eq!(f.replays, 0);
}

#[test]
fn the_queue_name_tells_the_origin_of_a_skipped_copy() {
    let mut h = FieldTable::default();
    h.insert("MT-Reason".into(), long("dead-letter"));
    let f = failure(Some(&h), "parcel-created-carrier_skipped", "/");
    assert_eq!(f.origin, Origin::Queue("parcel-created-carrier".into()));
    assert_eq!(
        f.reason.as_deref(),
        Some("not handled by the consumer (skipped)")
    );
    assert_eq!(failure(None, "somewhere", "/").origin, Origin::Unknown);
}

/// A message dead-lettered into `audit` (by a dead-letter exchange on `orders`: `x-first-death-queue` and `x-death`
/// say `orders`), then skipped by `audit`'s consumer: its origin is `audit`, not the earlier hop.
#[test]
fn a_skipped_copy_goes_back_to_the_queue_that_skipped_it_not_to_an_earlier_hop() {
    let headers = |skipped: bool| {
        let mut death = FieldTable::default();
        death.insert("queue".into(), long("orders"));
        death.insert("reason".into(), long("rejected"));
        let mut h = FieldTable::default();
        if skipped {
            h.insert("MT-Reason".into(), long("dead-letter"));
        }
        h.insert("x-first-death-queue".into(), long("orders"));
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        h
    };
    let f = failure(Some(&headers(true)), "audit_skipped", "/");
    assert_eq!(f.origin, Origin::Queue("audit".into()));
    // Not a skipped copy (no `MT-Reason`): the dead-lettering's own queue.
    assert_eq!(
        failure(Some(&headers(false)), "audit_skipped", "/").origin,
        Origin::Queue("orders".into())
    );
}

/// `MT-Fault-InputAddress` beside the broker's `x-death`: taken where they agree, or where the queue the message
/// sits in is the address's `_error` (MassTransit's copy of a message that went through a delay queue first);
/// left where the broker dead-lettered it from another queue than the one the address (a producer's header) names.
#[test]
fn an_address_the_brokers_dead_lettering_contradicts_is_left() {
    let headers = |address: &str, death_queue: &str| {
        let mut death = FieldTable::default();
        death.insert("queue".into(), long(death_queue));
        death.insert("reason".into(), long("rejected"));
        let mut h = FieldTable::default();
        h.insert("MT-Fault-InputAddress".into(), long(address));
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        h
    };
    // (the address's queue, the queue x-death names, the queue it sits in, taken as the origin?)
    let cases = [
        // Forged: a consumer of orders rejected it, the broker dead-lettered it; the header names payments.
        ("payments", "orders", "orders_error", false),
        ("payments", "orders", "orders.dlq", false),
        // In the address's own `_error`: MassTransit's copy, whatever hop came before.
        ("payments", "orders", "payments_error", true),
        ("orders", "orders-delay", "orders_error", true),
        // Dead-lettered again by the broker out of the address's error queue (a TTL into an archive), and a
        // partition's copy in its queue's error queue.
        ("orders", "orders_error", "archive", true),
        ("orders.3", "orders_error", "archive", true),
        ("orders.3", "orders-delay", "orders_error", true),
        ("orders.x", "orders_error", "archive", false),
        // Agreeing: taken wherever it sits.
        ("orders", "orders", "archive", true),
    ];
    for (queue, death, from, taken) in cases {
        let address = format!("rabbitmq://localhost/{queue}");
        let origin = failure(Some(&headers(&address, death)), from, "/").origin;
        match taken {
            true => assert_eq!(
                origin,
                Origin::Queue(queue.into()),
                "{queue} {death} {from}"
            ),
            false => assert!(
                matches!(&origin, Origin::Ambiguous { why, .. }
                    if why.contains(&format!("RabbitMQ dead-lettered the message from {death}"))),
                "{queue} {death} {from}: {origin:?}"
            ),
        }
    }
}

#[test]
fn x_death_headers() {
    let mut death = FieldTable::default();
    death.insert("queue".into(), long("orders"));
    death.insert("reason".into(), long("rejected"));
    death.insert("time".into(), AMQPValue::Timestamp(1_764_533_690));
    let mut h = FieldTable::default();
    h.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
    );
    h.insert(REPLAY_COUNT_HEADER.into(), AMQPValue::LongInt(2));
    let f = failure(Some(&h), "orders.dlq", "/");
    assert_eq!(f.origin, Origin::Queue("orders".into()));
    assert_eq!(f.reason.as_deref(), Some("rejected"));
    assert_eq!(f.failed_at.map(|t| t.timestamp()), Some(1_764_533_690));
    assert_eq!(f.replays, 2);
}

/// The failure among several dead-letterings is the newest reject (or quorum count of returns), else the newest:
/// not the first hop of a chain, nor a later expiry (a dead-letter queue's TTL into an archive, a retry loop's
/// wait queue).
#[test]
fn the_origin_is_the_queue_of_the_newest_reject_else_of_the_newest_death() {
    let with = |deaths: &[(&str, &str, u64)]| {
        let entries = deaths
            .iter()
            .map(|(queue, reason, time)| {
                let mut death = FieldTable::default();
                death.insert("queue".into(), long(queue));
                death.insert("reason".into(), long(reason));
                death.insert("time".into(), AMQPValue::Timestamp(*time));
                AMQPValue::FieldTable(death)
            })
            .collect::<Vec<_>>();
        let mut h = FieldTable::default();
        h.insert(
            "x-first-death-queue".into(),
            long(deaths.last().map_or("", |d| d.0)),
        );
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(entries)),
        );
        failure(Some(&h), "somewhere", "/")
    };
    for deaths in [
        &[("orders", "rejected", 20), ("orders.delay", "expired", 10)][..],
        &[("orders.dlq", "expired", 30), ("orders", "rejected", 20)],
        &[
            ("orders.retry", "expired", 30),
            ("orders", "rejected", 20),
            ("orders.retry", "expired", 10),
        ],
        &[("orders", "delivery_limit", 20)],
    ] {
        let f = with(deaths);
        assert_eq!(f.origin, Origin::Queue("orders".into()), "{deaths:?}");
        assert_eq!(f.failed_at.map(|t| t.timestamp()), Some(20), "{deaths:?}");
    }
    let expired = with(&[("orders", "expired", 40), ("orders.in", "expired", 30)]);
    assert_eq!(expired.origin, Origin::Queue("orders".into()));
    assert_eq!(expired.reason.as_deref(), Some("expired"));
}

/// Found by the `replay_failure` fuzz target: `x-first-death-queue` (or `x-death`'s `queue`) written by a producer
/// as a long string of 256 bytes became an origin no AMQP frame can name.
#[test]
fn a_death_queue_past_255_bytes_or_empty_is_no_origin() {
    let origin = |key: &str, name: &str| {
        let mut h = FieldTable::default();
        if key == "x-death" {
            let mut death = FieldTable::default();
            death.insert("queue".into(), long(name));
            h.insert(
                "x-death".into(),
                AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
            );
        } else {
            h.insert(key.into(), long(name));
        }
        failure(Some(&h), "orders_error", "/").origin
    };
    for key in ["x-first-death-queue", "x-death"] {
        let long_name = "q".repeat(256);
        assert!(
            matches!(&origin(key, &long_name), Origin::Ambiguous { why, .. } if why.contains("256 bytes")),
            "{key}"
        );
        assert_eq!(
            origin(key, &"q".repeat(255)),
            Origin::Queue("q".repeat(255)),
            "{key}"
        );
        assert_eq!(
            origin(key, ""),
            Origin::Queue("orders".into()),
            "{key}: the queue's own name tells"
        );
    }
}

#[test]
fn the_input_address_decides_and_is_never_guessed_at() {
    let origin = |address: &str, vhost: &str| {
        let mut h = FieldTable::default();
        h.insert("MT-Fault-InputAddress".into(), long(address));
        failure(Some(&h), "orders_error", vhost).origin
    };
    let queue = |q: &str| Origin::Queue(q.to_owned());
    assert_eq!(
        origin("rabbitmq://h:5673/shop/orders?bind=true", "shop"),
        queue("orders")
    );
    // No vhost in the address: the one the replay is connected to.
    assert_eq!(origin("rabbitmq://h/orders", "shop"), queue("orders"));
    assert_eq!(
        origin("rabbitmq://h/probe%3Fq/eu%2Forders", "probe?q"),
        queue("eu/orders")
    );
    assert_eq!(
        origin("rabbitmq://h/eu/orders", "shop"),
        Origin::OtherVhost {
            vhost: "eu".into(),
            queue: "orders".into()
        }
    );
    // Unreadable: left, and not replaced by the dead-letter queue's name.
    for address in [
        "rabbitmq://h/shop/eu/orders",
        "rabbitmq://h/probe?q/orders",
        "rabbitmq://h/orders#x",
        "rabbitmq://h/",
    ] {
        assert!(
            matches!(origin(address, "shop"), Origin::Ambiguous { .. }),
            "{address}"
        );
    }
    // Kept for the report as written, but for a password in it.
    let Origin::Ambiguous { address, .. } = origin("rabbitmq://ops:hunter2@h/a/b/c", "shop") else {
        panic!("read");
    };
    assert!(!address.contains("hunter2"), "{address}");
    assert!(address.contains("@h/a/b/c"), "{address}");
    // One longer than a report keeps is not shown at all (neither a password cut in half, nor the masking's scan
    // of a frame of parameters).
    let long = format!("rabbitmq://h/q#?password=x{}=", "&".repeat(130_000));
    let Origin::Ambiguous { address, .. } = origin(&long, "shop") else {
        panic!("read");
    };
    assert_eq!(
        address,
        format!("(an address of {} bytes, not shown)", long.len())
    );
}
