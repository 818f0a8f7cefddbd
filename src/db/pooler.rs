//! Speaking to PostgreSQL through a transaction pooler (PgBouncer's `pool_mode = transaction`).
//!
//! A transaction pooler hands each of its clients a server connection for one transaction at a time: between two
//! transactions, the next statement may go to another server connection, one that other clients used meanwhile.
//! Nothing of a session lasts: session settings, session advisory locks, and prepared statements. So through one
//! ([`active`]), every statement of the store is unnamed ([`super::sql::query`]) and runs inside a transaction: the
//! caller's, or one of its own around the store function ([`super::Unit`]).

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this process speaks to PostgreSQL as through a transaction pooler. Process-wide because the store's
/// statements are sent by functions that are handed a connection and nothing else.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Whether the store's statements go unnamed, each in a transaction (see the module documentation).
pub fn active() -> bool {
    ACTIVE.load(Ordering::SeqCst)
}
