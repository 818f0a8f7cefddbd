//! The batched claim on real PostgreSQL, without savepoints: a batch is one transaction whose rows all carry one
//! transaction id (a savepoint would give its rows a subtransaction's); a failing member — first, in the middle, last,
//! or two of them — costs the batch a redo without it, and it alone is left unprocessed; the members' work done
//! together in one statement falls back to each member's own when it fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use inboxctl::inbox::{Member, MemberOutcome, TogetherWork, WorkError};
use uuid::Uuid;

use crate::common;
use crate::inbox::{effects, insert_effect, kinds, setup};

/// A member whose work writes its effect and then fails if `fails`; `runs` counts its runs.
fn member(id: Uuid, label: &'static str, fails: bool, runs: &Arc<AtomicUsize>) -> Member<()> {
    let runs = Arc::clone(runs);
    Member {
        message_id: id,
        fingerprint: None,
        carried: Default::default(),
        work: Box::new(move |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                insert_effect(tx, id, label).await?;
                if fails {
                    Err(WorkError::msg("carrier API returned 503"))
                } else {
                    Ok(())
                }
            })
        }),
    }
}

/// The members' effects in one statement, failing as a whole if any of them fails (the stand-in carrier's shape).
fn together(labels: Vec<(Uuid, &'static str, bool)>, runs: &Arc<AtomicUsize>) -> TogetherWork<()> {
    let runs = Arc::clone(runs);
    Box::new(move |tx, ids| {
        runs.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let picked: Vec<&(Uuid, &str, bool)> = labels
                .iter()
                .filter(|(id, _, _)| ids.contains(id))
                .collect();
            let (idv, labelv): (Vec<Uuid>, Vec<String>) = picked
                .iter()
                .map(|(id, l, _)| (*id, (*l).to_owned()))
                .unzip();
            sqlx::query("INSERT INTO effects SELECT * FROM unnest($1::uuid[], $2::text[])")
                .bind(&idv)
                .bind(&labelv)
                .execute(&mut *tx)
                .await?;
            if picked.iter().any(|(_, _, fails)| *fails) {
                return Err(WorkError::msg("one of the bookings returned 503"));
            }
            Ok(vec![(); ids.len()])
        })
    })
}

/// One transaction, no savepoint: every row the batch wrote, inbox rows and effects, has the same `xmin`.
async fn transaction_ids(pool: &sqlx::PgPool) -> i64 {
    common::count(
        pool,
        "SELECT count(DISTINCT x) FROM (SELECT xmin::text AS x FROM inbox_messages \
         UNION ALL SELECT xmin::text FROM effects) t",
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_without_failures_is_one_transaction_without_savepoints_and_its_work_runs_once() {
    for with_together in [false, true] {
        let (_env, pool, inbox) = setup().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let spec: Vec<(Uuid, &'static str, bool)> = ["a", "b", "c", "d"]
            .iter()
            .map(|l| (Uuid::new_v4(), *l, false))
            .collect();
        let members = spec
            .iter()
            .map(|(id, l, f)| member(*id, l, *f, &runs))
            .collect();
        let together_runs = Arc::new(AtomicUsize::new(0));
        let work = with_together.then(|| together(spec.clone(), &together_runs));
        let outcomes = inbox.process_batch_with(members, work).await.unwrap();
        assert_eq!(kinds(&outcomes), ["processed"; 4]);
        assert_eq!(effects(&pool).await, ["a", "b", "c", "d"]);
        assert_eq!(
            transaction_ids(&pool).await,
            1,
            "one transaction, no subtransaction"
        );
        if with_together {
            assert_eq!(together_runs.load(Ordering::SeqCst), 1);
            assert_eq!(runs.load(Ordering::SeqCst), 0, "no member's own work ran");
        } else {
            assert_eq!(
                runs.load(Ordering::SeqCst),
                4,
                "each member's work ran once"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn failing_members_first_middle_last_or_two_are_left_alone_and_the_rest_commit_together() {
    let labels = ["m0", "m1", "m2", "m3", "m4"];
    let (_env, pool, inbox) = setup().await;
    for failing in [&[0][..], &[2], &[4], &[1, 3], &[0, 1, 2, 3, 4]] {
        for with_together in [false, true] {
            let case = format!("failing {failing:?}, together {with_together}");
            sqlx::raw_sql(
                "TRUNCATE inbox_messages, inboxctl_fingerprints, inboxctl_events, effects",
            )
            .execute(&pool)
            .await
            .unwrap();
            let runs = Arc::new(AtomicUsize::new(0));
            let spec: Vec<(Uuid, &'static str, bool)> = labels
                .iter()
                .enumerate()
                .map(|(i, l)| (Uuid::new_v4(), *l, failing.contains(&i)))
                .collect();
            let members = spec
                .iter()
                .map(|(id, l, f)| member(*id, l, *f, &runs))
                .collect();
            let work =
                with_together.then(|| together(spec.clone(), &Arc::new(AtomicUsize::new(0))));
            let outcomes = inbox.process_batch_with(members, work).await.unwrap();
            let expected: Vec<&str> = (0..labels.len())
                .map(|i| {
                    if failing.contains(&i) {
                        "failed"
                    } else {
                        "processed"
                    }
                })
                .collect();
            assert_eq!(kinds(&outcomes), expected, "{case}");
            for (i, outcome) in outcomes.iter().enumerate() {
                if let MemberOutcome::Failed(e) = outcome {
                    assert!(e.to_string().contains("503"), "{case}: member {i}: {e}");
                }
            }
            let kept: Vec<&str> = (0..labels.len())
                .filter(|i| !failing.contains(i))
                .map(|i| labels[i])
                .collect();
            assert_eq!(
                effects(&pool).await,
                kept,
                "{case}: the failed members' writes are rolled back"
            );
            assert_eq!(
                common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
                kept.len() as i64,
                "{case}: and their claims"
            );
            if !kept.is_empty() {
                assert_eq!(
                    transaction_ids(&pool).await,
                    1,
                    "{case}: the rest in one transaction"
                );
            }
            assert_eq!(
                common::count(&pool, "SELECT count(*) FROM inboxctl_events").await,
                0,
                "{case}: nothing recorded for the redone tries"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redone_batch_records_its_copies_once() {
    let (_env, pool, inbox) = setup().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let done = Uuid::new_v4();
    inbox
        .process(done, move |tx| Box::pin(insert_effect(tx, done, "before")))
        .await
        .unwrap();
    let fails = Uuid::new_v4();
    let new = Uuid::new_v4();
    let outcomes = inbox
        .process_batch(vec![
            member(done, "again", false, &runs),
            member(fails, "fails", true, &runs),
            member(new, "new", false, &runs),
        ])
        .await
        .unwrap();
    assert_eq!(kinds(&outcomes), ["duplicate", "failed", "processed"]);
    assert_eq!(effects(&pool).await, ["before", "new"]);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        1,
        "the copy recorded once, by the try that committed"
    );
}

/// A member's work whose statement fails and that goes on as if it had not (the "ignore a duplicate key" idiom) leaves
/// the transaction aborted. PostgreSQL answers the `COMMIT` of an aborted transaction with `ROLLBACK` and no error,
/// and sqlx's commit does not look: the batch was reported committed — every member processed, so acknowledged —
/// while nothing had committed, and the healthy member after it was blamed for the refusal its first statement met.
/// Now the member that aborted the transaction alone fails, and the others commit; with the members' work done
/// together, too.
#[tokio::test(flavor = "multi_thread")]
async fn a_member_that_swallows_a_statement_error_fails_alone_and_the_others_commit() {
    // One by one, done together, and one by one with the member after the swallowing one wrapping the refusal it
    // meets in an error of its own, its source kept or only its text (it was blamed for it: failed, though nothing
    // was wrong with it).
    for (with_together, wrapping) in [
        (false, Wrapping::None),
        (true, Wrapping::None),
        (false, Wrapping::Source),
        (false, Wrapping::Text),
    ] {
        let (_env, pool, inbox) = with_a_customer().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let swallowing = Member {
            message_id: b,
            fingerprint: None,
            carried: Default::default(),
            work: Box::new(move |tx| {
                Box::pin(async move {
                    insert_effect(tx, b, "b").await?;
                    // "The customer may exist already: fine, carry on."
                    let _ = sqlx::query("INSERT INTO customers VALUES ('a@b.c')")
                        .execute(&mut *tx)
                        .await;
                    Ok(())
                })
            }),
        };
        let wrapped = Member {
            message_id: c,
            fingerprint: None,
            carried: Default::default(),
            work: Box::new(move |tx| {
                Box::pin(async move {
                    insert_effect(tx, c, "c").await.map_err(|e| match wrapping {
                        Wrapping::Text => inboxctl::inbox::WorkError::msg(e.to_string()),
                        _ => inboxctl::inbox::WorkError::Failed(Box::new(Wrapped(e))),
                    })
                })
            }),
        };
        let members = vec![
            member(a, "a", false, &runs),
            swallowing,
            if wrapping == Wrapping::None {
                member(c, "c", false, &runs)
            } else {
                wrapped
            },
        ];
        // Done together, the swallowing happens in the statement for all: the members one by one find whose it is.
        let together = with_together.then(swallowing_together);
        let outcomes = inbox
            .process_batch_with(members, together)
            .await
            .expect("the batch commits without its failing member");
        assert_eq!(
            kinds(&outcomes),
            ["processed", "failed", "processed"],
            "together: {with_together}, {wrapping:?}"
        );
        let MemberOutcome::Failed(error) = &outcomes[1] else {
            unreachable!()
        };
        assert!(
            error.to_string().contains("the transaction was aborted"),
            "{error}"
        );
        let mut rows: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM inbox_messages")
            .fetch_all(&pool)
            .await
            .unwrap();
        rows.sort();
        let mut expected = vec![a, c];
        expected.sort();
        assert_eq!(rows, expected, "together: {with_together}");
        assert_eq!(
            effects(&pool).await,
            ["a", "c"],
            "together: {with_together}"
        );
    }
}

/// How a member's work gives back the error its statement met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrapping {
    /// As it is.
    None,
    /// In an error of its own, whose source it is.
    Source,
    /// Its text only, in an error of its own.
    Text,
}

/// A consumer's own error around the one its work met.
#[derive(Debug)]
struct Wrapped(inboxctl::inbox::WorkError);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "booking the effect failed")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0 {
            inboxctl::inbox::WorkError::Database(e) => Some(e),
            inboxctl::inbox::WorkError::Failed(e) => Some(e.as_ref()),
        }
    }
}

/// `setup`, with a customer whose insert a work may meet again: the statement whose error it swallows.
async fn with_a_customer() -> (common::TestEnv, sqlx::PgPool, inboxctl::inbox::Inbox) {
    let (env, pool, inbox) = setup().await;
    sqlx::raw_sql(
        "CREATE TABLE customers (email text PRIMARY KEY); INSERT INTO customers VALUES ('a@b.c')",
    )
    .execute(&pool)
    .await
    .unwrap();
    (env, pool, inbox)
}

/// The members' work done together, its statement's error swallowed.
fn swallowing_together() -> TogetherWork<()> {
    Box::new(|tx, ids| {
        Box::pin(async move {
            let _ = sqlx::query("INSERT INTO customers VALUES ('a@b.c')")
                .execute(&mut *tx)
                .await;
            Ok(vec![(); ids.len()])
        })
    })
}

/// The same one message at a time: a failed attempt (retried, never acknowledged), not a message reported processed
/// whose claim and effect rolled back.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_whose_work_swallows_a_statement_error_is_a_failed_attempt() {
    let (_env, pool, inbox) = with_a_customer().await;
    let id = Uuid::new_v4();
    let outcome = inbox
        .process(id, move |tx| {
            Box::pin(async move {
                insert_effect(tx, id, "one").await?;
                let _ = sqlx::query("INSERT INTO customers VALUES ('a@b.c')")
                    .execute(&mut *tx)
                    .await;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(&outcome, Err(inboxctl::inbox::ProcessError::Failed(e)) if e.to_string().contains("aborted")),
        "{outcome:?}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert!(effects(&pool).await.is_empty());
}

/// A work that ends the claim's transaction itself (a `ROLLBACK` of its own) and returns `Ok`: the claim and the effect
/// are rolled back, and sqlx's commit (which counts transactions itself) sent a `COMMIT` that PostgreSQL answered with
/// a warning only — the message was taken as processed, acknowledged, and lost. It is a failed attempt.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_whose_work_rolls_the_transaction_back_itself_is_a_failed_attempt() {
    let (_env, pool, inbox) = with_a_customer().await;
    let id = Uuid::new_v4();
    let outcome = inbox
        .process(id, move |tx| {
            Box::pin(async move {
                insert_effect(tx, id, "one").await?;
                sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await?;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(&outcome, Err(inboxctl::inbox::ProcessError::Failed(e)) if e.to_string().contains("ended the claim's transaction itself")),
        "{outcome:?}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert!(effects(&pool).await.is_empty());
    // Ended and begun again, its work written again in a transaction of its own: that transaction is not the claim's
    // (before, it was committed as if it were: the effect in, no inbox row, and the next copy did the work again).
    let again = Uuid::new_v4();
    let outcome = inbox
        .process(again, move |tx| {
            Box::pin(async move {
                insert_effect(tx, again, "one").await?;
                sqlx::raw_sql("ROLLBACK; BEGIN").execute(&mut *tx).await?;
                insert_effect(tx, again, "one").await?;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(&outcome, Err(inboxctl::inbox::ProcessError::Failed(e)) if e.to_string().contains("ended the claim's transaction itself")),
        "{outcome:?}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert!(effects(&pool).await.is_empty());
    // The connection it went back to the pool on is fit for the next message.
    let next = Uuid::new_v4();
    let outcome = inbox
        .process(next, move |tx| {
            Box::pin(async move { insert_effect(tx, next, "next").await })
        })
        .await;
    assert!(
        matches!(outcome, Ok(inboxctl::inbox::Outcome::Processed(()))),
        "{outcome:?}"
    );
}

/// An id reused for another event whose only difference is a number beyond what a double holds exactly (a .NET
/// `decimal` of 20 digits): both once rounded to one double in the fingerprint's canonical form, and the second
/// event was discarded as a duplicate, silently. It is a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_id_whose_events_differ_in_a_long_number_is_a_conflict() {
    use common::{EVENT_EXCHANGE, TestEnv};
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    let conn = env.amqp().await;
    let id = Uuid::now_v7();
    let parcel = Uuid::now_v7();
    let props = inboxctl::amqp::envelope::masstransit_properties(id);
    let body = |amount: &str| {
        format!(
            r#"{{"messageId": "{id}", "messageType": ["urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"], "message": {{"parcelId": "{parcel}", "trackingNumber": "PT1", "destination": "Berlin", "declaredValue": {amount}}}, "sentTime": "2026-12-01T10:00:00Z", "headers": {{}}}}"#
        )
        .into_bytes()
    };
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        props.clone(),
        &body("1234567890.1234567891"),
    )
    .await;
    common::consume_until_idle(&env, &common::with_mode(&["carrier"], common::BATCHED));
    // The same id, another event: the declared value differs in its 20th digit.
    common::publish(
        &conn,
        EVENT_EXCHANGE,
        "",
        props,
        &body("1234567890.1234567899"),
    )
    .await;
    let out = common::consume_until_idle(&env, &common::with_mode(&["carrier"], common::BATCHED));
    let pool = env.pool().await;
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM inboxctl_events WHERE kind IN ('duplicate', 'conflict') ORDER BY kind",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        ["conflict"],
        "another event under a reused id must be reported as a conflict, not dropped as a duplicate:\n{}",
        out.stderr
    );
}

/// A statement with more parameters than one statement may carry: refused by the driver before it is sent, as a
/// protocol error, the session left as it was.
async fn too_many_parameters(tx: &mut sqlx::PgConnection) -> Result<(), WorkError> {
    let mut query = sqlx::query("SELECT 1");
    for i in 0..65_536_i32 {
        query = query.bind(i);
    }
    query.execute(&mut *tx).await?;
    Ok(())
}

/// A work whose statement the driver refuses as a protocol error (too many parameters) while its session lives on:
/// the message's own failure, counted — one by one, as a batch member, and done together (the members then one by
/// one). It was taken for an outage: tried again for ever, never counted, the consumer's intake paused each time; a
/// batch done together never got past it.
#[tokio::test(flavor = "multi_thread")]
async fn a_protocol_error_the_session_outlives_is_the_messages_not_an_outage() {
    let (_env, pool, inbox) = setup().await;
    let single = inbox
        .process(Uuid::new_v4(), |tx| Box::pin(too_many_parameters(tx)))
        .await;
    assert!(
        matches!(single, Err(inboxctl::inbox::ProcessError::Failed(_))),
        "{single:?}"
    );
    for with_together in [false, true] {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let runs = Arc::new(AtomicUsize::new(0));
        let failing = Member {
            message_id: b,
            fingerprint: None,
            carried: Default::default(),
            work: Box::new(|tx| Box::pin(too_many_parameters(tx))),
        };
        let members = vec![member(a, "a", false, &runs), failing];
        let together: Option<TogetherWork<()>> = with_together.then(|| -> TogetherWork<()> {
            Box::new(|tx, _ids| {
                Box::pin(async move {
                    too_many_parameters(tx).await?;
                    Ok(vec![])
                })
            })
        });
        let outcomes = inbox.process_batch_with(members, together).await;
        let outcomes = outcomes.unwrap_or_else(|e| panic!("together {with_together}: {e:?}"));
        assert_eq!(
            kinds(&outcomes),
            ["processed", "failed"],
            "together {with_together}"
        );
    }
    assert_eq!(effects(&pool).await, ["a", "a"]);
}

/// A work that begins a transaction of its own (sqlx's `begin`: a savepoint under the claim's) and forgets it: the
/// claim's COMMIT then only releases that savepoint. It was taken as processed — acked with nothing committed — and
/// the connection went back to its pool inside the claim's transaction, where the next claim on it became a savepoint
/// too, committing nothing either. Now: failed (one by one; a batch as a whole, its members then one by one), the
/// connection closed, and the next message on the same one-connection pool commits.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_the_work_leaves_open_is_no_commit() {
    let (env, pool, _) = setup().await;
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.database_url)
        .await
        .unwrap();
    let inbox = inboxctl::inbox::Inbox::new(
        one,
        inboxctl::inbox::ConsumerType::new("left-open").unwrap(),
    );
    let forgets = |id: Uuid, label: &'static str| -> inboxctl::inbox::MemberWork<()> {
        Box::new(move |tx| {
            Box::pin(async move {
                insert_effect(tx, id, label).await?;
                std::mem::forget(sqlx::Connection::begin(&mut *tx).await?);
                Ok(())
            })
        })
    };
    let id = Uuid::new_v4();
    let single = inbox.process(id, forgets(id, "forgot")).await;
    assert!(
        matches!(single, Err(inboxctl::inbox::ProcessError::Failed(_))),
        "{single:?}"
    );
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let members = vec![
        Member {
            message_id: a,
            fingerprint: None,
            carried: Default::default(),
            work: forgets(a, "forgot in a batch"),
        },
        member(b, "b", false, &Arc::new(AtomicUsize::new(0))),
    ];
    let batch = inbox.process_batch(members).await;
    assert!(
        matches!(batch, Err(inboxctl::inbox::ProcessError::Failed(_))),
        "{:?}",
        batch.map(|o| kinds(&o))
    );
    // Beside a member that fails: the round without it would begin inside the transaction left open.
    let (c, d) = (Uuid::new_v4(), Uuid::new_v4());
    let members = vec![
        Member {
            message_id: c,
            fingerprint: None,
            carried: Default::default(),
            work: forgets(c, "forgot beside a failure"),
        },
        member(d, "d", true, &Arc::new(AtomicUsize::new(0))),
    ];
    let batch = inbox.process_batch(members).await;
    assert!(
        matches!(batch, Err(inboxctl::inbox::ProcessError::Failed(_))),
        "{:?}",
        batch.map(|o| kinds(&o))
    );
    let next = Uuid::new_v4();
    let done = inbox
        .process(next, move |tx| Box::pin(insert_effect(tx, next, "next")))
        .await;
    assert!(
        matches!(done, Ok(inboxctl::inbox::Outcome::Processed(()))),
        "{done:?}"
    );
    assert_eq!(effects(&pool).await, ["next"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        1
    );
}

/// A batch of more than `MAX_BATCH` members is refused before anything runs or is claimed: each round's claim locks
/// every key left, and a failing member costs a round, so the size is bounded where it is documented.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_larger_than_the_most_a_batch_holds_is_refused_before_anything_runs() {
    let (_env, pool, inbox) = setup().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let members: Vec<Member<()>> = (0..=inboxctl::inbox::MAX_BATCH)
        .map(|_| member(Uuid::new_v4(), "one", false, &runs))
        .collect();
    let batch = inbox.process_batch(members).await;
    assert!(
        matches!(&batch, Err(inboxctl::inbox::ProcessError::Failed(e)) if e.to_string().contains("at most 64")),
        "{:?}",
        batch.map(|o| kinds(&o))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
}
