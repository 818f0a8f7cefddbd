//! The modes every guarantee test runs in: one transaction per message and batched, on classic queues; and one
//! transaction per message on quorum queues (a single-node quorum queue on the shared broker: the queue type's
//! own behaviour — its delivery count, its redeliveries — without a cluster; the cluster tests add the nodes).

use std::sync::OnceLock;

use inboxctl::amqp::topology::QueueType;

/// `consume` flags of the modes every guarantee test runs in.
pub const ONE_BY_ONE: &[&str] = &[];
pub const BATCHED: &[&str] = &["--batch-size", "32"];
pub const QUORUM: &[&str] = &["--queue-type", "quorum"];

/// The type of the queues this test process declares (each test runs in a process of its own).
static QUEUE_TYPE: OnceLock<QueueType> = OnceLock::new();

/// What the test's helpers declare queues as: quorum in the quorum mode, else classic.
pub fn queue_type() -> QueueType {
    QUEUE_TYPE.get().copied().unwrap_or_default()
}

/// Makes this test process's queues quorum queues; the test's consumers get `--queue-type quorum` from the mode.
pub fn on_quorum_queues() {
    let _ = QUEUE_TYPE.set(QueueType::Quorum);
}

/// Whether this test process's database has a partitioned inbox (each test runs in a process of its own).
static PARTITIONED_INBOX: OnceLock<()> = OnceLock::new();

/// Makes this test process's databases partitioned inboxes ([`partitioning`]).
pub fn on_partitioned_inbox() {
    let _ = PARTITIONED_INBOX.set(());
}

/// The partitioning of this test process's inboxes, if it runs on a partitioned one: on the time inside the message
/// ids (what inboxctl publishes and MassTransit sends are NewIds; the tests' own are UUIDv7), a month a partition and
/// a year and more of them back, so that the captured fixtures' ids (November 2026) find their partition for a
/// year.
pub fn partitioning() -> Option<inboxctl::db::partitions::Settings> {
    PARTITIONED_INBOX
        .get()
        .map(|()| inboxctl::db::partitions::Settings {
            interval: chrono::TimeDelta::days(31),
            source: inboxctl::inbox::TimeSource::Id,
        })
}

/// Declares a test that runs `$body(mode)` once per mode, as `$name::one_by_one`, `$name::batched`, `$name::quorum`
/// and `$name::partitioned_inbox` (one by one, the inbox partitioned on the time inside the message ids).
#[macro_export]
macro_rules! in_both_modes {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_by_one() {
                super::$body(super::common::ONE_BY_ONE).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batched() {
                super::$body(super::common::BATCHED).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn quorum() {
                super::common::on_quorum_queues();
                super::$body(super::common::QUORUM).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn partitioned_inbox() {
                super::common::on_partitioned_inbox();
                super::$body(super::common::ONE_BY_ONE).await;
            }
        }
    };
}

/// `args` followed by `mode`.
pub fn with_mode<'a>(args: &[&'a str], mode: &[&'a str]) -> Vec<&'a str> {
    args.iter().chain(mode).copied().collect()
}
