//! How a message's work is guarded against its other deliveries: the one thing the run loop asks of the inbox.
//!
//! The run loop, dispatch, retries, batching and dead-lettering are the same whatever guards the work; a
//! [`WorkGuard`] says what happens around it — for the [`Inbox`], the claim protocol: one transaction holding the
//! inbox row and the work, a copy recognised by its committed claim. [`Inbox`] is the only guard this library has;
//! another implementation (a consumer with another deduplication, or none, to compare against) plugs in here and
//! keeps everything else of the consumer.

use futures_util::future::BoxFuture;
use sqlx::postgres::PgPool;
use uuid::Uuid;

use crate::inbox::{
    Carried, ConsumerType, Effect, Fingerprint, Inbox, Member, MemberOutcome, Outcome,
    ProcessError, TogetherWork, Work,
};

/// What guards a consumer's work on each message. The contract is [`Inbox::process_event`]'s and
/// [`Inbox::process_batch`]'s: `Ok` means the outcome is committed (the delivery may be acknowledged); `Err` means
/// nothing committed.
pub trait WorkGuard: Send + Sync + 'static {
    /// The deduplication scope, also the name the consumer's bookkeeping goes by.
    fn consumer_type(&self) -> &ConsumerType;

    /// The consumer's PostgreSQL connections (for its bookkeeping beside the work).
    fn pool(&self) -> &PgPool;

    /// Runs `work` for one delivery of `message_id`; see [`Inbox::process_event`].
    fn process_event(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>>;

    /// Runs one delivery's work written as one statement, `effect`, with `work` the same effect made the usual way;
    /// see [`Inbox::process_effect`]. The default ignores `effect` and runs `work` ([`WorkGuard::process_event`]).
    fn process_effect(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        effect: Effect,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        drop(effect);
        self.process_event(message_id, fingerprint, carried, work)
    }

    /// Runs several deliveries' work in one transaction, all of it in one call by `together` if it succeeds; see
    /// [`Inbox::process_batch_with`].
    fn process_batch(
        &self,
        members: Vec<Member<()>>,
        together: Option<TogetherWork<()>>,
    ) -> BoxFuture<'_, Result<Vec<MemberOutcome<()>>, ProcessError>>;
}

impl WorkGuard for Inbox {
    fn consumer_type(&self) -> &ConsumerType {
        Inbox::consumer_type(self)
    }

    fn pool(&self) -> &PgPool {
        Inbox::pool(self)
    }

    fn process_event(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        Box::pin(async move {
            Inbox::process_carried(self, message_id, fingerprint, &carried, work).await
        })
    }

    fn process_effect(
        &self,
        message_id: Uuid,
        fingerprint: Option<Fingerprint>,
        carried: Carried,
        effect: Effect,
        work: Work<()>,
    ) -> BoxFuture<'_, Result<Outcome<()>, ProcessError>> {
        Box::pin(async move {
            Inbox::process_effect(self, message_id, fingerprint, &carried, effect, work).await
        })
    }

    fn process_batch(
        &self,
        members: Vec<Member<()>>,
        together: Option<TogetherWork<()>>,
    ) -> BoxFuture<'_, Result<Vec<MemberOutcome<()>>, ProcessError>> {
        Box::pin(Inbox::process_batch_with(self, members, together))
    }
}
