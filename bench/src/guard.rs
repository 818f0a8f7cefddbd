//! The consumers the bench compares, run as child processes (`inboxctl-bench consume`, hidden) so that their resident
//! memory can be read: inboxctl's consumer operation (`inboxctl::consumer::run`, what `inboxctl consume` runs), the
//! same for every mode — the queue, prefetch, concurrency, envelope reading, retries, effect and ack after the commit
//! — except for what guards each message's work:
//!
//! - `inbox` (and `inbox-batched`): the library's [`Inbox`], the claim protocol, a message's claim and effect sent as
//!   one statement;
//! - `inbox-transaction`: the same [`Inbox`] made to take the usual way, [`Usual`]: `BEGIN`, the claim, the effect,
//!   `COMMIT`, as it does for an effect that is not one statement;
//! - `bare`: [`Plain::bare`], no inbox at all: a transaction with the work, nothing else (at-least-once);
//! - `tutorial`: [`Plain::lookup_first`], the tutorial's shape: look the id up first, then a transaction with a plain insert
//!   of the inbox row and the work. Two first copies both pass the look-up; the second one's insert then fails on
//!   the key.
//! - `broker` (and `broker-batched`): [`Nothing`], no work at all: each delivery read, parsed and acknowledged,
//!   nothing written for it — the broker's and the consumer's own part of every other mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use inboxctl::cli::ConnectOpts;
use inboxctl::consumer::{self, Config, WorkGuard};
use inboxctl::db::is_transient;
use inboxctl::inbox::{
    Carried, ConsumerType, Effect, Fingerprint, Inbox, Member, MemberOutcome, Outcome,
    ProcessError, TogetherWork, Work, WorkError,
};
use inboxctl::parcel::Kind;
use sqlx::Connection as _;
use sqlx::postgres::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::sql;

/// What guards the child consumer's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Guard {
    Inbox,
    InboxTransaction,
    Bare,
    LookupFirst,
    Nothing,
}

/// `inboxctl-bench consume`: one mode's consumer, run by the bench itself (the carrier consumer, its consumer_type the
/// queue's name).
#[derive(Debug, Clone, clap::Args)]
pub struct ConsumeArgs {
    #[arg(long, value_enum)]
    pub guard: Guard,
    #[arg(long)]
    pub queue: String,
    #[arg(long)]
    pub exchange: String,
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub concurrency: u16,
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub batch_size: u16,
    #[arg(long, value_parser = inboxctl::cli::parse_positive_duration)]
    pub exit_when_idle: Option<Duration>,
    #[arg(long, value_enum, default_value_t = inboxctl::amqp::topology::QueueType::Classic)]
    pub queue_type: inboxctl::amqp::topology::QueueType,
    /// With `--guard nothing`: where to write, at the end, how many deliveries it took and the seconds from the
    /// first to the last ([`Span`]).
    #[arg(long)]
    pub span_file: Option<std::path::PathBuf>,
}

/// Runs the consumer until it stops: `inboxctl consume carrier`'s start, checks and defaults for everything the bench
/// does not set, with the work guarded by `args.guard`.
pub async fn consume(
    args: &ConsumeArgs,
    connect: &ConnectOpts,
    shutdown: CancellationToken,
) -> Result<()> {
    if !matches!(args.guard, Guard::Inbox | Guard::Nothing) && args.batch_size > 1 {
        return Err(Error::usage("--batch-size needs the inbox"));
    }
    let db = connect.database()?;
    let broker = connect.broker()?;
    let config = Config {
        queue: Some(args.queue.clone()),
        exchange: args.exchange.clone(),
        prefetch: args.prefetch,
        concurrency: args.concurrency,
        batch_size: args.batch_size,
        exit_when_idle: args.exit_when_idle,
        queue_type: args.queue_type,
        ..Config::of(Kind::Carrier)
    };
    let run = match args.guard {
        Guard::Inbox => consumer::consume(&config, &db, &broker, shutdown).await,
        Guard::InboxTransaction => {
            consumer::consume_guarded(&config, &db, &broker, shutdown, Usual).await
        }
        Guard::Bare => {
            consumer::consume_guarded(&config, &db, &broker, shutdown, Plain::bare).await
        }
        Guard::LookupFirst => {
            consumer::consume_guarded(&config, &db, &broker, shutdown, Plain::lookup_first).await
        }
        Guard::Nothing => {
            let span = Arc::new(Span::default());
            let run = consumer::consume_guarded(&config, &db, &broker, shutdown, |inbox| Nothing {
                pool: inbox.pool().clone(),
                consumer_type: inbox.consumer_type().clone(),
                span: Arc::clone(&span),
            })
            .await;
            if let Some(path) = &args.span_file {
                std::fs::write(path, span.line())?;
            }
            run
        }
    };
    run.map(drop).map_err(Error::from)
}

/// What a consumer that writes nothing took: how many deliveries, and when the first and the last were done (the
/// other modes' throughput comes from their effects' times, first to last).
#[derive(Default)]
pub struct Span {
    taken: AtomicU64,
    /// Microseconds since `origin`, of the first and the last.
    first: AtomicU64,
    last: AtomicU64,
    origin: std::sync::OnceLock<Instant>,
}

impl Span {
    fn took(&self, n: u64) {
        let origin = *self.origin.get_or_init(Instant::now);
        let at = u64::try_from(origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        if self.taken.fetch_add(n, Ordering::Relaxed) == 0 {
            self.first.store(at, Ordering::Relaxed);
        }
        self.last.fetch_max(at, Ordering::Relaxed);
    }

    /// `<deliveries> <seconds from the first to the last>`.
    fn line(&self) -> String {
        let seconds = self
            .last
            .load(Ordering::Relaxed)
            .saturating_sub(self.first.load(Ordering::Relaxed)) as f64
            / 1e6;
        format!("{} {seconds}\n", self.taken.load(Ordering::Relaxed))
    }

    /// Reads [`Span::line`]: the throughput it says, counted as the effects' spans are (first to last).
    pub fn throughput(line: &str) -> Option<f64> {
        let mut parts = line.split_whitespace();
        let taken: u64 = parts.next()?.parse().ok()?;
        let seconds: f64 = parts.next()?.parse().ok()?;
        (taken > 1 && seconds > 0.0).then(|| (taken - 1) as f64 / seconds)
    }
}

/// No work and no guard: every delivery is done as soon as it is read, and nothing is written for it.
pub struct Nothing {
    pool: PgPool,
    consumer_type: ConsumerType,
    span: Arc<Span>,
}

impl WorkGuard for Nothing {
    fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn process_event(
        &self,
        _message_id: Uuid,
        _fingerprint: Option<Fingerprint>,
        _carried: Carried,
        _work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        self.span.took(1);
        Box::pin(async { Ok(Outcome::Processed(())) })
    }

    fn process_batch(
        &self,
        members: Vec<Member<()>>,
        _together: Option<TogetherWork<()>>,
    ) -> BoxFuture<'_, Result<Vec<MemberOutcome<()>>, ProcessError>> {
        self.span.took(members.len() as u64);
        Box::pin(async move {
            Ok(members
                .iter()
                .map(|_| MemberOutcome::Processed(()))
                .collect())
        })
    }
}

/// The inbox, made to take the usual way for every message: an effect given as one statement is ignored
/// ([`WorkGuard::process_effect`]'s default), and the consumer's work runs after the claim in the claim's transaction.
pub struct Usual(Inbox);

impl WorkGuard for Usual {
    fn consumer_type(&self) -> &ConsumerType {
        self.0.consumer_type()
    }

    fn pool(&self) -> &PgPool {
        self.0.pool()
    }

    fn process_event(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        WorkGuard::process_event(&self.0, message_id, fingerprint, carried, work)
    }

    fn process_batch(
        &self,
        members: Vec<Member<()>>,
        together: Option<TogetherWork<()>>,
    ) -> BoxFuture<'_, Result<Vec<MemberOutcome<()>>, ProcessError>> {
        WorkGuard::process_batch(&self.0, members, together)
    }
}

/// The consumers without the claim protocol: each message's work in a transaction of its own.
pub struct Plain {
    pool: PgPool,
    consumer_type: ConsumerType,
    look_up_first: bool,
}

impl Plain {
    /// No inbox at all: the transaction holds the work and nothing else. A copy repeats the effect. It takes the
    /// connections and consumer_type `inbox` would have used.
    pub fn bare(inbox: Inbox) -> Self {
        Self {
            pool: inbox.pool().clone(),
            consumer_type: inbox.consumer_type().clone(),
            look_up_first: false,
        }
    }

    /// The tutorial's shape: a look-up of the id first, then a transaction with a plain insert of the inbox row
    /// before the work — all on the message's one connection, as the tutorial's one DbContext does. (The look-up once
    /// took a second pooled connection while the message's own was held: with the pool as large as the concurrency,
    /// every worker then held one connection and waited for another until the pool's acquire timeout, and the mode
    /// measured that stall, idle cores and all, rather than its transaction.)
    pub fn lookup_first(inbox: Inbox) -> Self {
        Self {
            look_up_first: true,
            ..Self::bare(inbox)
        }
    }

    /// Errors told apart as the inbox tells them: the database's doing, or the work's.
    async fn on(
        &self,
        conn: &mut PgConnection,
        message_id: Uuid,
        work: Work<()>,
    ) -> Result<Outcome<()>, ProcessError> {
        if self.look_up_first {
            // Planned with its values each time, as EF Core's unprepared statements through Npgsql are: the
            // tutorial's scratch database sets `plan_cache_mode` (see `sql::TUTORIAL_PLANNING`).
            let seen: bool = sqlx::query_scalar(sql::TUTORIAL_LOOKUP)
                .bind(message_id)
                .bind(self.consumer_type.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(ProcessError::Unavailable)?;
            if seen {
                return Ok(Outcome::Duplicate);
            }
        }
        let mut tx = conn.begin().await.map_err(ProcessError::Unavailable)?;
        if self.look_up_first {
            sqlx::query(sql::TUTORIAL_INSERT)
                .bind(message_id)
                .bind(self.consumer_type.as_str())
                .execute(&mut *tx)
                .await
                .map_err(|e| ProcessError::Failed(WorkError::Database(e)))?;
        }
        if let Err(error) = work(&mut tx).await {
            // Rolled back now rather than when the connection is next used.
            let _ = tx.rollback().await;
            return Err(match error {
                WorkError::Database(e) if is_transient(&e) => ProcessError::Unavailable(e),
                other => ProcessError::Failed(other),
            });
        }
        tx.commit().await.map_err(|e| {
            if is_transient(&e) {
                ProcessError::Unavailable(e)
            } else {
                ProcessError::Failed(WorkError::Database(e))
            }
        })?;
        Ok(Outcome::Processed(()))
    }
}

impl WorkGuard for Plain {
    fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn process_event(
        &self,
        message_id: Uuid,
        _fingerprint: Option<Fingerprint>,
        _carried: Carried,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        Box::pin(async move {
            let mut conn = self
                .pool
                .acquire()
                .await
                .map_err(ProcessError::Unavailable)?;
            let result = self.on(&mut conn, message_id, work).await;
            if matches!(result, Err(ProcessError::Unavailable(_))) {
                // As the inbox does: a session that failed is never handed out again.
                conn.close_on_drop();
            }
            result
        })
    }

    /// `bare` makes the effect as the inbox sends it, one statement, without the claim: `inbox/bare` is the price of
    /// the claim alone. The tutorial's shape has no such statement: it looks up and inserts as it always does.
    fn process_effect(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        effect: Effect,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        if self.look_up_first {
            return self.process_event(message_id, fingerprint, carried, work);
        }
        Box::pin(async move {
            let mut conn = self
                .pool
                .acquire()
                .await
                .map_err(ProcessError::Unavailable)?;
            match effect.make_unguarded(&mut conn).await {
                Ok(()) => Ok(Outcome::Processed(())),
                Err(WorkError::Database(e)) if is_transient(&e) => {
                    conn.close_on_drop();
                    Err(ProcessError::Unavailable(e))
                }
                Err(other) => Err(ProcessError::Failed(other)),
            }
        })
    }

    /// A batch needs the inbox's savepoints and batched claim: the consumer is told to take the members one by one.
    fn process_batch(
        &self,
        _members: Vec<Member<()>>,
        _together: Option<TogetherWork<()>>,
    ) -> BoxFuture<'_, Result<Vec<MemberOutcome<()>>, ProcessError>> {
        Box::pin(async {
            Err(ProcessError::Failed(WorkError::msg(
                "only the inbox processes batches",
            )))
        })
    }
}
