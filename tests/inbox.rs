//! The claim protocol as a library, on real PostgreSQL: a copy waiting on an in-flight attempt, and any interleaving
//! of copies and failures giving exactly one effect.

use crate::common;

use std::time::Duration;

use common::TestEnv;
use inboxctl::inbox::{
    ConsumerType, Fingerprint, Inbox, Member, MemberOutcome, Outcome, ProcessError, WorkError,
};
use proptest::prelude::*;
use sqlx::PgPool;
use tokio::sync::oneshot;
use uuid::Uuid;

pub(crate) async fn setup() -> (TestEnv, PgPool, Inbox) {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql("CREATE TABLE effects (message_id uuid NOT NULL, label text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone(), ConsumerType::new("trap-5").unwrap());
    (env, pool, inbox)
}

pub(crate) async fn insert_effect(
    tx: &mut sqlx::PgConnection,
    id: Uuid,
    label: &str,
) -> Result<(), WorkError> {
    sqlx::query("INSERT INTO effects VALUES ($1, $2)")
        .bind(id)
        .bind(label)
        .execute(tx)
        .await?;
    Ok(())
}

/// Starts a first attempt that claims `id`, writes its effect, and then holds its transaction open until told how
/// to end: `true` to succeed, `false` to fail.
pub(crate) async fn hold_first_attempt(
    inbox: &Inbox,
    id: Uuid,
) -> (
    oneshot::Sender<bool>,
    tokio::task::JoinHandle<Result<Outcome<()>, ProcessError>>,
) {
    let (claimed_tx, claimed_rx) = oneshot::channel();
    let (end_tx, end_rx) = oneshot::channel::<bool>();
    let first = inbox.clone();
    let task = tokio::spawn(async move {
        first
            .process(id, move |tx| {
                Box::pin(async move {
                    insert_effect(tx, id, "first").await?;
                    claimed_tx.send(()).unwrap();
                    if end_rx.await.unwrap() {
                        Ok(())
                    } else {
                        Err(WorkError::msg("carrier API returned 503"))
                    }
                })
            })
            .await
    });
    claimed_rx.await.unwrap();
    (end_tx, task)
}

/// Starts a second copy of `id` and waits until PostgreSQL shows it blocked on the first attempt's row lock.
async fn second_copy_waiting(
    env: &TestEnv,
    pool: &PgPool,
    inbox: &Inbox,
    id: Uuid,
) -> tokio::task::JoinHandle<Result<Outcome<()>, ProcessError>> {
    let second = inbox.clone();
    let task = tokio::spawn(async move {
        second
            .process(id, move |tx| Box::pin(insert_effect(tx, id, "second")))
            .await
    });
    wait_for_a_lock(env, pool).await;
    task
}

pub(crate) async fn effects(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT label FROM effects ORDER BY label")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_copy_waiting_on_an_attempt_that_rolls_back_does_the_work() {
    let (env, pool, inbox) = setup().await;
    let id = Uuid::new_v4();
    let (end_first, first) = hold_first_attempt(&inbox, id).await;
    let second = second_copy_waiting(&env, &pool, &inbox, id).await;

    end_first.send(false).unwrap();
    assert!(matches!(first.await.unwrap(), Err(ProcessError::Failed(_))));
    assert_eq!(
        second.await.unwrap().unwrap(),
        Outcome::Processed(()),
        "not dropped as a duplicate (docs/architecture.md: dropping a copy too early)"
    );
    assert_eq!(effects(&pool).await, ["second"]);
    let duplicates = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    assert_eq!(duplicates, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_copy_waiting_on_an_attempt_that_commits_is_a_duplicate() {
    let (env, pool, inbox) = setup().await;
    let id = Uuid::new_v4();
    let (end_first, first) = hold_first_attempt(&inbox, id).await;
    let second = second_copy_waiting(&env, &pool, &inbox, id).await;

    end_first.send(true).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(()));
    assert_eq!(second.await.unwrap().unwrap(), Outcome::Duplicate);
    assert_eq!(effects(&pool).await, ["first"]);
    let duplicates = common::count(
        &pool,
        "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'",
    )
    .await;
    assert_eq!(
        duplicates, 1,
        "the discard is counted in the transaction that made it"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn scopes_are_separate_and_a_work_error_leaves_no_trace() {
    let (_env, pool, inbox) = setup().await;
    let other = Inbox::new(pool.clone(), ConsumerType::new("other").unwrap());
    let id = Uuid::new_v4();
    let failed = inbox
        .process(id, move |tx| {
            Box::pin(async move {
                insert_effect(tx, id, "failed").await?;
                Err::<(), _>(WorkError::msg("no"))
            })
        })
        .await;
    assert!(matches!(failed, Err(ProcessError::Failed(_))));
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    for inbox in [&inbox, &other] {
        let done = inbox
            .process(id, move |tx| Box::pin(insert_effect(tx, id, "done")))
            .await
            .unwrap();
        assert_eq!(done, Outcome::Processed(()));
    }
    assert_eq!(effects(&pool).await, ["done", "done"]);
}

/// One copy of a message: when it arrives (ms after the start) and whether its work fails.
#[derive(Debug, Clone)]
struct Copy {
    delay_ms: u64,
    work_ms: u64,
    fails: bool,
}

fn copies() -> impl Strategy<Value = Vec<Copy>> {
    prop::collection::vec(
        (0u64..15, 0u64..10, prop::bool::weighted(0.3)).prop_map(|(delay_ms, work_ms, fails)| {
            Copy {
                delay_ms,
                work_ms,
                fails,
            }
        }),
        1..8,
    )
}

/// Any interleaving of concurrent copies, some of whose attempts fail, followed by redelivery of the failed ones:
/// exactly one effect, and a duplicate counted for every copy that was discarded. One database for all cases; each
/// case is a message id of its own.
#[test]
fn any_interleaving_of_copies_gives_one_effect() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_env, pool, inbox) = runtime.block_on(setup());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&copies(), |plan| {
            runtime.block_on(async {
                let id = Uuid::new_v4();
                let tasks: Vec<_> = plan
                    .iter()
                    .cloned()
                    .enumerate()
                    .map(|(n, copy)| {
                        let inbox = inbox.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(copy.delay_ms)).await;
                            inbox
                                .process(id, move |tx| {
                                    Box::pin(async move {
                                        insert_effect(tx, id, &format!("copy {n}")).await?;
                                        tokio::time::sleep(Duration::from_millis(copy.work_ms)).await;
                                        if copy.fails { Err(WorkError::msg("fails")) } else { Ok(()) }
                                    })
                                })
                                .await
                        })
                    })
                    .collect();
                let (mut processed, mut duplicates, mut failed) = (0, 0, 0);
                for task in tasks {
                    match task.await.unwrap() {
                        Ok(Outcome::Processed(())) => processed += 1,
                        Ok(Outcome::Duplicate) => duplicates += 1,
                        Ok(Outcome::Conflict(c)) => panic!("no fingerprint given, yet a conflict: {c:?}"),
                        Err(ProcessError::Failed(_)) => failed += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                // The broker delivers each failed copy again; once one committed, the rest are duplicates.
                for _ in 0..failed {
                    match inbox.process(id, move |tx| Box::pin(insert_effect(tx, id, "redelivered"))).await.unwrap() {
                        Outcome::Processed(()) => processed += 1,
                        Outcome::Duplicate => duplicates += 1,
                        Outcome::Conflict(c) => panic!("no fingerprint given, yet a conflict: {c:?}"),
                    }
                }
                let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = $1")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let counted: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate' AND message_id = $1",
                )
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
                prop_assert_eq!(processed, 1, "{:?}", plan);
                prop_assert_eq!(effects, 1);
                prop_assert_eq!(counted, duplicates);
                Ok(())
            })
        })
        .unwrap();
}

fn member(id: Uuid, label: &'static str, fails: bool) -> Member<()> {
    Member {
        message_id: id,
        fingerprint: None,
        carried: Default::default(),
        work: Box::new(move |tx| {
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

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_commits_once_and_a_failing_member_is_rolled_back_alone() {
    let (_env, pool, inbox) = setup().await;
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let labels = ["m0", "m1", "m2", "m3", "m4"];
    let members = ids
        .iter()
        .zip(labels)
        .map(|(id, label)| member(*id, label, label == "m2"))
        .collect();
    let outcomes = inbox.process_batch(members).await.unwrap();
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|o| match o {
            MemberOutcome::Processed(()) => "processed",
            MemberOutcome::Duplicate => "duplicate",
            MemberOutcome::Conflict(_) => "conflict",
            MemberOutcome::Failed(_) => "failed",
            MemberOutcome::Unclaimable(_) => "unclaimable",
        })
        .collect();
    assert_eq!(
        kinds,
        ["processed", "processed", "failed", "processed", "processed"]
    );
    assert_eq!(
        effects(&pool).await,
        ["m0", "m1", "m3", "m4"],
        "the failed member's write is rolled back"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        4,
        "and its claim taken back"
    );
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(DISTINCT xmin::text) FROM inbox_messages"
        )
        .await,
        1,
        "one transaction for the batch"
    );
    // Retried alone, it is processed.
    let retried = inbox
        .process(ids[2], move |tx| {
            Box::pin(insert_effect(tx, ids[2], "m2 again"))
        })
        .await
        .unwrap();
    assert_eq!(retried, Outcome::Processed(()));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_member_waiting_on_an_attempt_that_rolls_back_does_the_work() {
    let (env, pool, inbox) = setup().await;
    let (held, other) = (Uuid::new_v4(), Uuid::new_v4());
    let (end_first, first) = hold_first_attempt(&inbox, held).await;
    let batch = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            inbox
                .process_batch(vec![
                    member(other, "other", false),
                    member(held, "batch", false),
                ])
                .await
        })
    };
    let db = env.db_name.clone();
    common::eventually("the batch waits on the first attempt's lock", Duration::from_secs(10), || {
        let db = db.clone();
        let pool = pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
            )
            .bind(db)
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == 1
        }
    })
    .await;
    end_first.send(false).unwrap();
    assert!(first.await.unwrap().is_err());
    let outcomes = batch.await.unwrap().unwrap();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, MemberOutcome::Processed(()))),
        "{outcomes:?}"
    );
    assert_eq!(effects(&pool).await, ["batch", "other"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_batch_committed_copies_are_duplicates_and_one_id_twice_is_refused() {
    let (_env, pool, inbox) = setup().await;
    let (done, new) = (Uuid::new_v4(), Uuid::new_v4());
    inbox
        .process(done, move |tx| Box::pin(insert_effect(tx, done, "before")))
        .await
        .unwrap();
    let outcomes = inbox
        .process_batch(vec![
            member(done, "again", false),
            member(new, "new", false),
        ])
        .await
        .unwrap();
    assert!(
        matches!(
            outcomes[..],
            [MemberOutcome::Duplicate, MemberOutcome::Processed(())]
        ),
        "{outcomes:?}"
    );
    assert_eq!(effects(&pool).await, ["before", "new"]);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate'"
        )
        .await,
        1
    );

    let twice = Uuid::new_v4();
    let refused = inbox
        .process_batch(vec![member(twice, "a", false), member(twice, "b", false)])
        .await;
    assert!(matches!(refused, Err(ProcessError::Failed(_))));
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        2,
        "nothing of it committed"
    );
}

/// A member whose event has `fingerprint`, and whose work writes its effect.
fn member_of_event(id: Uuid, fingerprint: Fingerprint, label: &'static str) -> Member<()> {
    Member {
        message_id: id,
        fingerprint: Some(fingerprint),
        carried: Default::default(),
        work: Box::new(move |tx| Box::pin(insert_effect(tx, id, label))),
    }
}

/// What became of each member, in a word.
pub(crate) fn kinds(outcomes: &[MemberOutcome<()>]) -> Vec<&'static str> {
    outcomes
        .iter()
        .map(|o| match o {
            MemberOutcome::Processed(()) => "processed",
            MemberOutcome::Duplicate => "duplicate",
            MemberOutcome::Conflict(_) => "conflict",
            MemberOutcome::Failed(_) => "failed",
            MemberOutcome::Unclaimable(_) => "unclaimable",
        })
        .collect()
}

/// A fingerprint left behind by an inbox row deleted elsewhere (the purge of an adopted table's own application,
/// which knows nothing of inboxctl's fingerprints) gives way to the next claim's: a later copy of the event claimed
/// then is a duplicate, not a conflict — one by one and in a batch.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_replaces_a_fingerprint_its_row_left_behind() {
    let (_env, pool, inbox) = setup().await;
    let (single, batched) = (Uuid::new_v4(), Uuid::new_v4());
    let (old, new) = (
        Fingerprint::from_bytes([1; 16]),
        Fingerprint::from_bytes([2; 16]),
    );
    let process = |id: Uuid, fingerprint, label: &'static str| {
        inbox.process_event(id, Some(fingerprint), move |tx| {
            Box::pin(insert_effect(tx, id, label))
        })
    };
    for id in [single, batched] {
        assert_eq!(
            process(id, old, "old").await.unwrap(),
            Outcome::Processed(())
        );
    }
    sqlx::query("DELETE FROM inbox_messages")
        .execute(&pool)
        .await
        .unwrap();

    assert_eq!(
        process(single, new, "new").await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        process(single, new, "copy").await.unwrap(),
        Outcome::Duplicate
    );
    let claimed = inbox
        .process_batch(vec![member_of_event(batched, new, "new")])
        .await
        .unwrap();
    assert_eq!(kinds(&claimed), ["processed"]);
    let copy = inbox
        .process_batch(vec![member_of_event(batched, new, "copy")])
        .await
        .unwrap();
    assert_eq!(kinds(&copy), ["duplicate"]);
    assert_eq!(
        common::count(
            &pool,
            "SELECT count(*) FROM inboxctl_events WHERE kind = 'conflict'"
        )
        .await,
        0
    );
}

/// A copy of a message claimed without a fingerprint (by EF Core, or by an inboxctl from before fingerprints) is an
/// ordinary duplicate, and recorded as one: with nothing to tell the two events apart, it is never a conflict.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_of_a_claim_without_a_fingerprint_is_recorded_as_a_duplicate() {
    let (_env, pool, inbox) = setup().await;
    let (single, batched) = (Uuid::new_v4(), Uuid::new_v4());
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
         SELECT unnest($1::uuid[]), 'trap-5', now(), now()",
    )
    .bind([single, batched])
    .execute(&pool)
    .await
    .unwrap();
    let fingerprint = Fingerprint::from_bytes([7; 16]);

    let outcome = inbox
        .process_event(single, Some(fingerprint), move |tx| {
            Box::pin(insert_effect(tx, single, "single"))
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Duplicate);
    let outcomes = inbox
        .process_batch(vec![member_of_event(batched, fingerprint, "batched")])
        .await
        .unwrap();
    assert_eq!(kinds(&outcomes), ["duplicate"]);
    assert!(effects(&pool).await.is_empty());
    let recorded: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM inboxctl_events ORDER BY kind")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, ["duplicate", "duplicate"]);
}

/// A batch claims its keys in id order, whatever order its members came in: waiting on a key another attempt holds,
/// it holds none of the keys after it, so a copy of a later member goes ahead meanwhile — and two batches never wait
/// on each other in a cycle.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_waiting_on_a_key_holds_none_after_it() {
    let (env, pool, inbox) = setup().await;
    let mut ids = [Uuid::new_v4(), Uuid::new_v4()];
    ids.sort();
    let [low, high] = ids;
    let (end_first, first) = hold_first_attempt(&inbox, low).await;
    let batch = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            inbox
                .process_batch(vec![
                    member(high, "batch high", false),
                    member(low, "batch low", false),
                ])
                .await
        })
    };
    let db = env.db_name.clone();
    common::eventually("the batch waits on the first attempt's lock", Duration::from_secs(10), || {
        let db = db.clone();
        let pool = pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
            )
            .bind(db)
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == 1
        }
    })
    .await;

    let copy = tokio::time::timeout(
        Duration::from_secs(10),
        inbox.process(high, move |tx| Box::pin(insert_effect(tx, high, "copy"))),
    )
    .await
    .expect("a copy of the batch's later member is not held up by the waiting batch")
    .unwrap();
    assert_eq!(copy, Outcome::Processed(()));
    end_first.send(false).unwrap();
    assert!(first.await.unwrap().is_err());
    let outcomes = batch.await.unwrap().unwrap();
    assert_eq!(kinds(&outcomes), ["duplicate", "processed"]);
    assert_eq!(effects(&pool).await, ["batch low", "copy"]);
}

/// The test's effect written through the claim: one row of `effects`, only for the delivery that claims the message.
const EFFECT: &str =
    "INSERT INTO effects (message_id, label) SELECT $1::uuid, $2::text FROM claimed";

fn one_statement(id: Uuid, label: &str) -> inboxctl::inbox::Effect {
    inboxctl::inbox::Effect::new(EFFECT).bind(id).bind(label)
}

/// The same effect the usual way, counting its runs: with a statement that succeeds it never runs.
fn usual(
    id: Uuid,
    label: &'static str,
    runs: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> impl for<'c> FnOnce(
    &'c mut sqlx::PgConnection,
) -> futures_util::future::BoxFuture<'c, Result<(), WorkError>>
+ Send
+ 'static {
    let runs = std::sync::Arc::clone(runs);
    move |tx| {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(insert_effect(tx, id, label))
    }
}

/// Sixteen copies of each of ten messages at once, each claim and effect in one statement: one effect a message, made
/// by the statement (the usual way never ran), and fifteen duplicates counted — outside a transaction, and in the
/// `BEGIN`/`COMMIT` a claim timeout per transaction needs (a transaction pooler's connections).
#[tokio::test(flavor = "multi_thread")]
async fn copies_at_once_in_one_statement_give_one_effect_each() {
    let (_env, pool, plain) = setup().await;
    let timed_out = plain
        .clone()
        .with_claim_timeout(Some(Duration::from_secs(30)));
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for (name, inbox) in [
        ("one statement", &plain),
        ("between BEGIN and COMMIT", &timed_out),
    ] {
        for _ in 0..10 {
            let id = Uuid::new_v4();
            let fingerprint = Fingerprint::from_bytes(*id.as_bytes());
            let copies: Vec<_> = (0..16)
                .map(|_| {
                    let (inbox, runs) = (inbox.clone(), runs.clone());
                    tokio::spawn(async move {
                        inbox
                            .process_effect(
                                id,
                                Some(fingerprint),
                                &Default::default(),
                                one_statement(id, "statement"),
                                usual(id, "usual", &runs),
                            )
                            .await
                    })
                })
                .collect();
            let mut outcomes = Vec::new();
            for copy in copies {
                outcomes.push(copy.await.unwrap().unwrap());
            }
            let processed = outcomes
                .iter()
                .filter(|o| **o == Outcome::Processed(()))
                .count();
            let duplicates = outcomes
                .iter()
                .filter(|o| **o == Outcome::Duplicate)
                .count();
            assert_eq!((processed, duplicates), (1, 15), "{name}: {outcomes:?}");
            let made: Vec<String> =
                sqlx::query_scalar("SELECT label FROM effects WHERE message_id = $1")
                    .bind(id)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            assert_eq!(made, ["statement"], "{name}");
            let counted: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate' AND message_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(counted, 15, "{name}");
        }
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the usual way ran though every statement succeeded"
    );
}

/// A copy sent as one statement while an attempt holds the key waits for it, as the usual claim does: it takes the
/// key and makes its effect if that attempt rolls back, and is a duplicate if it commits.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_in_one_statement_waits_for_the_attempt_in_flight() {
    let (env, pool, inbox) = setup().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for commits in [false, true] {
        sqlx::raw_sql("TRUNCATE effects")
            .execute(&pool)
            .await
            .unwrap();
        let id = Uuid::new_v4();
        let (end_first, first) = hold_first_attempt(&inbox, id).await;
        let second = {
            let (inbox, runs) = (inbox.clone(), runs.clone());
            tokio::spawn(async move {
                inbox
                    .process_effect(
                        id,
                        None,
                        &Default::default(),
                        one_statement(id, "second"),
                        usual(id, "usual", &runs),
                    )
                    .await
            })
        };
        wait_for_a_lock(&env, &pool).await;
        end_first.send(commits).unwrap();
        let first = first.await.unwrap();
        let second = second.await.unwrap().unwrap();
        if commits {
            assert_eq!(first.unwrap(), Outcome::Processed(()));
            assert_eq!(second, Outcome::Duplicate);
            assert_eq!(effects(&pool).await, ["first"]);
        } else {
            assert!(matches!(first, Err(ProcessError::Failed(_))));
            assert_eq!(second, Outcome::Processed(()), "not dropped too early");
            assert_eq!(effects(&pool).await, ["second"]);
        }
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
}

async fn wait_for_a_lock(env: &TestEnv, pool: &PgPool) {
    let db = env.db_name.clone();
    common::eventually("a copy waits on the other attempt's lock", Duration::from_secs(10), || {
        let db = db.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
            )
            .bind(db)
            .fetch_one(pool)
            .await
            .unwrap();
            waiting == 1
        }
    })
    .await;
}

/// A statement that fails for a reason of its own (here the effect breaks a NOT NULL) leaves nothing and sends the
/// message the usual way: a failure there is the work's (`Failed`, nothing committed, the claim included), and a
/// usual way that succeeds commits claim and effect.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_that_fails_is_done_again_the_usual_way() {
    let (_env, pool, inbox) = setup().await;
    let id = Uuid::new_v4();
    let broken = || {
        inboxctl::inbox::Effect::new(EFFECT)
            .bind(id)
            .bind(None::<String>)
    };
    let failed = inbox
        .process_effect(id, None, &Default::default(), broken(), move |tx| {
            Box::pin(async move {
                insert_effect(tx, id, "usual, failing").await?;
                Err::<(), _>(WorkError::msg("carrier API returned 503"))
            })
        })
        .await;
    assert!(
        matches!(&failed, Err(ProcessError::Failed(e)) if e.to_string().contains("503")),
        "{failed:?}"
    );
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
    assert!(effects(&pool).await.is_empty());

    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let done = inbox
        .process_effect(
            id,
            None,
            &Default::default(),
            broken(),
            usual(id, "usual", &runs),
        )
        .await
        .unwrap();
    assert_eq!(done, Outcome::Processed(()));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(effects(&pool).await, ["usual"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        1
    );
    // And a copy of it now, in one statement, is a duplicate.
    let copy = inbox
        .process_effect(
            id,
            None,
            &Default::default(),
            one_statement(id, "copy"),
            usual(id, "copy", &runs),
        )
        .await
        .unwrap();
    assert_eq!(copy, Outcome::Duplicate);
    assert_eq!(effects(&pool).await, ["usual"]);
}

/// A statement sent the usual way whose work begins a transaction and leaves it open fails (its COMMIT only released
/// a savepoint), and its connection is never handed out again: on a pool of one, the next messages' claims with their
/// effects would otherwise run inside that transaction, be acked, and vanish with it when the session ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_the_usual_way_leaves_open_is_no_commit_of_the_next_effects() {
    let (env, pool, _) = setup().await;
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.database_url)
        .await
        .unwrap();
    let inbox = Inbox::new(one.clone(), ConsumerType::new("left-open").unwrap());
    let a = Uuid::new_v4();
    // Unfit for the claim (it does not read `claimed`): sent the usual way.
    let unfit = || inboxctl::inbox::Effect::new("INSERT INTO effects VALUES ($1, $2)").bind(a);
    let forgot = inbox
        .process_effect(a, None, &Default::default(), unfit(), move |tx| {
            Box::pin(async move {
                insert_effect(tx, a, "forgot").await?;
                std::mem::forget(sqlx::Connection::begin(&mut *tx).await?);
                Ok(())
            })
        })
        .await;
    assert!(matches!(forgot, Err(ProcessError::Failed(_))), "{forgot:?}");
    let b = Uuid::new_v4();
    let again = inbox
        .process_effect(a, None, &Default::default(), one_statement(a, "a"), |_| {
            Box::pin(async { Ok(()) })
        })
        .await;
    let next = inbox
        .process_effect(b, None, &Default::default(), one_statement(b, "b"), |_| {
            Box::pin(async { Ok(()) })
        })
        .await;
    assert_eq!(
        (again.unwrap(), next.unwrap()),
        (Outcome::Processed(()), Outcome::Processed(()))
    );
    // Whatever the pool holds is closed: only what was committed stays.
    one.close().await;
    assert_eq!(effects(&pool).await, ["a", "b"]);
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        2
    );
}

/// The fingerprint goes with the claim in one statement as in the usual way: a later copy of another event under the
/// same id is a conflict, a copy of the same event a duplicate, and neither writes.
#[tokio::test(flavor = "multi_thread")]
async fn in_one_statement_a_copy_of_another_event_is_a_conflict() {
    let (_env, pool, inbox) = setup().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let id = Uuid::new_v4();
    let [first, other] = [1u8, 2].map(|b| Fingerprint::from_bytes([b; 16]));
    let carried = inboxctl::inbox::Carried::default();
    let send = |fingerprint: Fingerprint, label: &'static str| {
        inbox.process_effect(
            id,
            Some(fingerprint),
            &carried,
            one_statement(id, label),
            usual(id, label, &runs),
        )
    };
    assert_eq!(send(first, "first").await.unwrap(), Outcome::Processed(()));
    assert_eq!(send(first, "same").await.unwrap(), Outcome::Duplicate);
    assert!(matches!(
        send(other, "other").await.unwrap(),
        Outcome::Conflict(_)
    ));
    assert_eq!(effects(&pool).await, ["first"]);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// An effect that cannot be guarded by the claim is never sent with it: a statement that does not read `claimed`, or
/// reads it only where it makes no row of its own (the optional side of an outer join, a subquery: it would write for
/// every copy), a `SELECT` (inside `WITH` it would never run, and the message would count as done
/// with nothing written), one that uses more parameters than it was given (it would read the claim's own). The
/// message goes the usual way (its work after the claim), and a copy writes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_effect_the_claim_cannot_guard_is_never_sent_with_it() {
    let (_env, pool, inbox) = setup().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    type Make = fn(Uuid) -> inboxctl::inbox::Effect;
    let unfit: [(&str, Make); 5] = [
        ("claimed the optional side of an outer join", |id| {
            inboxctl::inbox::Effect::new(
                "INSERT INTO effects (message_id, label) SELECT $1::uuid, $2::text FROM (VALUES (1)) v LEFT JOIN claimed ON true",
            )
            .bind(id)
            .bind("outer")
        }),
        ("claimed in a subquery", |id| {
            inboxctl::inbox::Effect::new(
                "INSERT INTO effects (message_id, label) SELECT $1::uuid, $2::text WHERE NOT EXISTS (SELECT FROM claimed WHERE false)",
            )
            .bind(id)
            .bind("subquery")
        }),
        ("no claimed", |id| {
            inboxctl::inbox::Effect::new(
                "INSERT INTO effects (message_id, label) VALUES ($1::uuid, $2::text)",
            )
            .bind(id)
            .bind("unguarded")
        }),
        ("a SELECT", |id| {
            inboxctl::inbox::Effect::new("SELECT $1::uuid, $2::text FROM claimed")
                .bind(id)
                .bind("selected")
        }),
        ("a parameter unbound", |id| {
            inboxctl::inbox::Effect::new(
                "INSERT INTO effects (message_id, label) SELECT $1::uuid, $2::text FROM claimed",
            )
            .bind(id)
        }),
    ];
    for (name, effect) in unfit {
        sqlx::raw_sql("TRUNCATE effects")
            .execute(&pool)
            .await
            .unwrap();
        let id = Uuid::new_v4();
        let mut outcomes = Vec::new();
        for _ in 0..2 {
            outcomes.push(
                inbox
                    .process_effect(
                        id,
                        None,
                        &Default::default(),
                        effect(id),
                        usual(id, "usual", &runs),
                    )
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(
            outcomes,
            [Outcome::Processed(()), Outcome::Duplicate],
            "{name}"
        );
        assert_eq!(effects(&pool).await, ["usual"], "{name}");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 5);
}

/// Ends every session of inboxctl's own on the test's database and waits until PostgreSQL shows none left.
async fn end_inboxctl_sessions(env: &TestEnv, admin: &PgPool) {
    const INBOXCTL_SESSIONS: &str =
        "FROM pg_stat_activity WHERE datname = $1 AND application_name = 'inboxctl'";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_terminate_backend(pid) {INBOXCTL_SESSIONS}"
    )))
    .bind(&env.db_name)
    .execute(admin)
    .await
    .unwrap();
    for _ in 0..200 {
        let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) {INBOXCTL_SESSIONS}"
        )))
        .bind(&env.db_name)
        .fetch_one(admin)
        .await
        .unwrap();
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("inboxctl's sessions did not end");
}

/// Processes `id` with an effect of its own.
async fn process_on(inbox: &Inbox, id: Uuid) -> Result<Outcome<()>, ProcessError> {
    inbox
        .process(id, move |tx| Box::pin(insert_effect(tx, id, "effect")))
        .await
}

/// Waits until a connection of `pool` is back in it (it goes back after the outcome is returned, with a ping of its
/// own), so that the connection a test ends is the pooled one.
async fn back_in(pool: &PgPool) {
    for _ in 0..100 {
        if pool.num_idle() >= 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the connection did not go back to its pool");
}

/// A pooled connection used a moment ago is handed out without a ping first (a round trip a message, saved); one that
/// died meanwhile fails its message as the database unavailable — nothing claimed, nothing written, so the retry the
/// consumer makes of it does the work — and is not handed out again. A connection idle for longer is pinged first,
/// and one found dead is replaced before anyone sees it.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_that_died_fails_its_message_as_unavailable_and_is_replaced() {
    let (env, admin, _) = setup().await;
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    let pool = db.message_pool(1).await.unwrap();
    let inbox = Inbox::new(pool.clone(), ConsumerType::new("trap-5").unwrap());
    let process = |id: Uuid| process_on(&inbox, id);
    let [second, third] = [Uuid::new_v4(), Uuid::new_v4()];

    // Used a moment ago: not pinged, so its death is the message's to see. (Ending the session must take less than
    // the second a connection is trusted for; on a machine too slow for that, the step is taken again.)
    let mut used_a_moment_ago = false;
    for _ in 0..5 {
        let first = Uuid::new_v4();
        assert!(matches!(process(first).await, Ok(Outcome::Processed(()))));
        back_in(&pool).await;
        let used = std::time::Instant::now();
        end_inboxctl_sessions(&env, &admin).await;
        if used.elapsed() < Duration::from_millis(700) {
            used_a_moment_ago = true;
            break;
        }
        // Let the pool find the dead connection (pinged, being idle for long) before the next try.
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    assert!(
        used_a_moment_ago,
        "PostgreSQL took too long to end a session, five times"
    );
    let outcome = process(second).await;
    assert!(
        matches!(outcome, Err(ProcessError::Unavailable(_))),
        "a dead connection used a moment ago: {outcome:?}"
    );
    let written: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM effects WHERE message_id = $1) \
              + (SELECT count(*) FROM inbox_messages WHERE id = $1)",
    )
    .bind(second)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(written, 0, "the failed attempt left nothing behind");
    assert!(matches!(process(second).await, Ok(Outcome::Processed(()))));

    // Idle for longer: pinged, found dead, replaced before the message sees it.
    back_in(&pool).await;
    end_inboxctl_sessions(&env, &admin).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let outcome = process(third).await;
    assert!(
        matches!(outcome, Ok(Outcome::Processed(()))),
        "a dead connection idle for long: {outcome:?}"
    );
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = ANY($1)")
            .bind(vec![second, third])
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!(effects, 2);

    // Every other command's pool pings each time, so a connection that died is never its statement's to see.
    let pool = db.pool(1).await.unwrap();
    let pinged = Inbox::new(pool.clone(), ConsumerType::new("trap-5").unwrap());
    let before = process_on(&pinged, Uuid::new_v4()).await;
    assert!(matches!(before, Ok(Outcome::Processed(()))));
    back_in(&pool).await;
    end_inboxctl_sessions(&env, &admin).await;
    let outcome = process_on(&pinged, Uuid::new_v4()).await;
    assert!(
        matches!(outcome, Ok(Outcome::Processed(()))),
        "a command's pool, a dead connection used a moment ago: {outcome:?}"
    );
}

/// `attempt`'s outcome, failing the test if there is none within 15 s (a wait without a bound).
async fn not_forever<T>(attempt: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .expect("no outcome within 15s: the wait has no bound")
}

/// Whether an attempt was given up by the bound, as the database unavailable, after about `bound` (it took `took`).
/// `false` when the pool pinged the silent connection first (idle for over a second: a slow machine between the
/// test's steps) and the acquire timed out instead: the step is to be taken again.
fn given_up_in_time<T: std::fmt::Debug>(
    what: &str,
    outcome: &Result<T, ProcessError>,
    bound: Duration,
    took: Duration,
) -> bool {
    match outcome {
        Err(ProcessError::Unavailable(sqlx::Error::PoolTimedOut)) => return false,
        Err(ProcessError::Unavailable(e)) => assert!(
            e.to_string().contains("did not answer within 2s"),
            "{what}: {e}"
        ),
        other => panic!("{what}: given up as the database unavailable, not {other:?}"),
    }
    assert!(
        took >= bound && took < bound + Duration::from_secs(3),
        "{what}: given up after {took:?}"
    );
    true
}

/// A connection that dies without a word (a host lost, a network cut: no FIN, no RST) is given up after the attempt's
/// bound, on every way of processing — nothing else would end the wait before the kernel's TCP timeout. And the
/// transaction it left open on the server, holding its claim, is ended by the server (`idle in transaction` for as
/// long), so that the message's next attempt, on a new connection, takes the key instead of waiting on it.
#[tokio::test(flavor = "multi_thread")]
async fn an_attempt_whose_connection_goes_silent_is_given_up_and_its_claim_released() {
    const BOUND: Duration = Duration::from_secs(2);
    let (env, admin, _) = setup().await;
    let proxy = std::sync::Arc::new(common::Proxy::start("127.0.0.1:5432").await);
    let proxied = proxy.postgres_url(&env.db_name);
    let db = inboxctl::db::Database::from_url(&proxied)
        .unwrap()
        .with_idle_in_transaction_timeout(BOUND);
    let pool = db.message_pool(2).await.unwrap();
    let inbox = Inbox::new(pool.clone(), ConsumerType::new("trap-5").unwrap())
        .with_attempt_timeout(Some(BOUND));

    // The usual way, silenced after the claim and the effect: the server holds the transaction open.
    let id = Uuid::new_v4();
    let silencer = std::sync::Arc::clone(&proxy);
    let started = std::time::Instant::now();
    let outcome = not_forever(inbox.process(id, move |tx| {
        Box::pin(async move {
            insert_effect(tx, id, "silenced").await?;
            silencer.silence();
            sqlx::query("SELECT 1").execute(&mut *tx).await?;
            Ok(())
        })
    }))
    .await;
    // Silenced after the connection was taken: never a wait for the pool.
    assert!(given_up_in_time(
        "the usual way",
        &outcome,
        BOUND,
        started.elapsed()
    ));
    let started = std::time::Instant::now();
    let retried = not_forever(process_on(&inbox, id)).await;
    assert!(
        matches!(retried, Ok(Outcome::Processed(()))),
        "the retry takes the key the silent attempt held: {retried:?}"
    );
    assert!(
        started.elapsed() < BOUND + Duration::from_secs(3),
        "the retry waited {:?}",
        started.elapsed()
    );
    let labels: Vec<String> = sqlx::query_scalar("SELECT label FROM effects WHERE message_id = $1")
        .bind(id)
        .fetch_all(&admin)
        .await
        .unwrap();
    assert_eq!(
        labels,
        ["effect"],
        "the silenced attempt's effect rolled back"
    );

    // One statement, then a batch: each silenced before it is sent, on a pooled connection used a moment ago.
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for way in ["one statement", "a batch"] {
        let mut given_up = false;
        for _ in 0..3 {
            let warm = process_on(&inbox, Uuid::new_v4()).await;
            assert!(matches!(warm, Ok(Outcome::Processed(()))), "{warm:?}");
            back_in(&pool).await;
            proxy.silence();
            let id = Uuid::new_v4();
            let started = std::time::Instant::now();
            let took = |outcome: Result<(), ProcessError>| (outcome, started.elapsed());
            let (outcome, took) = match way {
                "one statement" => took(
                    not_forever(inbox.process_effect(
                        id,
                        None,
                        &Default::default(),
                        one_statement(id, "one"),
                        usual(id, "one", &runs),
                    ))
                    .await
                    .map(drop),
                ),
                _ => took(
                    not_forever(inbox.process_batch(vec![member(id, "b0", false)]))
                        .await
                        .map(drop),
                ),
            };
            if given_up_in_time(way, &outcome, BOUND, took) {
                given_up = true;
                break;
            }
        }
        assert!(given_up, "{way}: never met the silent connection");
    }

    // Every connection given up was closed, none left behind on its way back to the pool (sqlx pings a connection
    // given back, with no bound of its own: behind this proxy, for ever).
    common::eventually(
        "every connection of the pool back in it or closed",
        Duration::from_secs(10),
        || async { pool.size() == u32::try_from(pool.num_idle()).unwrap() },
    )
    .await;
}

/// The server's half of the bound is what PostgreSQL can hold: a longer one (`--claim-timeout` at its 24 days, plus
/// the margin) is clamped, not a connection refused for an invalid setting.
#[tokio::test(flavor = "multi_thread")]
async fn the_servers_bound_on_a_silent_transaction_is_set_and_clamped() {
    let env = TestEnv::migrated().await;
    let db = inboxctl::db::Database::from_url(&env.database_url).unwrap();
    for (bound, shown) in [
        (Duration::from_secs(63), "63s"),
        (Duration::from_secs(25 * 24 * 3600), "2147483647ms"),
    ] {
        let pool = db
            .with_idle_in_transaction_timeout(bound)
            .message_pool(1)
            .await
            .unwrap();
        let set: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(set, shown);
        pool.close().await;
    }
}

/// A statement of the work that goes past a limit of its own making (53400, `configuration_limit_exceeded`: a
/// `temp_file_limit` its sort went past) is the message's failure, counted: the server is fine, and the statement
/// meets the limit again every time. Before 2026-12-07 every SQLSTATE of class 53 was taken for PostgreSQL being
/// down: never counted, the message was tried again for ever, never dead-lettered, the consumer's intake paused each
/// time. A class 53 of the server's own (53300, too many connections) is still the database's doing.
#[tokio::test(flavor = "multi_thread")]
async fn a_limit_the_works_statement_goes_past_is_its_failure_not_an_outage() {
    let (_env, pool, inbox) = setup().await;
    for (code, failure) in [("53400", true), ("53300", false)] {
        let id = Uuid::new_v4();
        let sql = format!("DO $$ BEGIN RAISE EXCEPTION 'limit' USING ERRCODE = '{code}'; END $$");
        let result = inbox
            .process(id, move |tx| {
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await?;
                    Ok::<(), WorkError>(())
                })
            })
            .await;
        if failure {
            assert!(
                matches!(result, Err(ProcessError::Failed(_))),
                "{code}: {result:?}"
            );
        } else {
            assert!(
                matches!(result, Err(ProcessError::Unavailable(_))),
                "{code}: {result:?}"
            );
        }
    }
    assert_eq!(
        common::count(&pool, "SELECT count(*) FROM inbox_messages").await,
        0
    );
}
