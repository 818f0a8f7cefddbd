//! Speaking to PostgreSQL through a transaction pooler (PgBouncer's `pool_mode = transaction`).
//!
//! A transaction pooler hands each of its clients a server connection for one transaction at a time: between two
//! transactions, the next statement may go to another server connection, one that other clients used meanwhile.
//! Nothing of a session lasts: session settings, session advisory locks, and prepared statements. So through one
//! ([`active`]), every statement of the store is unnamed ([`super::sql::query`]) and runs inside a transaction: the
//! caller's, or one of its own around the store function ([`super::Unit`]); inside a transaction a client keeps its
//! server connection. Nothing depends on a session setting (the claim sets its `lock_timeout` with `SET LOCAL`,
//! [`super::claim::begin`]), and cleanup's per-consumer_type lock is a transaction-scoped one taken by each batch.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this process speaks to PostgreSQL as through a transaction pooler: set for good by the first connection a
/// [`super::Database`] with `--transaction-pooling` opens. Process-wide because the store's statements are sent by
/// functions that are handed a connection and nothing else; the other way round it would only cost speed (unnamed
/// statements and their transactions, on a direct connection too), never correctness.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Whether the store's statements go unnamed, each in a transaction (see the module documentation).
pub fn active() -> bool {
    ACTIVE.load(Ordering::SeqCst)
}

/// From now on, this process speaks as through a transaction pooler.
pub(super) fn enable() {
    ACTIVE.store(true, Ordering::SeqCst);
}
