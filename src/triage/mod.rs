//! Triage: what an operator asks at night. Where is message X, and what happened to it (`find`)? What failed, grouped
//! by cause (`failures`)? Each looks at dead-letter queues without taking anything from them (see
//! [`crate::amqp::peek`]): the broker marks what was looked at redelivered, and nothing else changes.

pub mod detail;
pub mod failures;
pub mod find;

pub use failures::{Group, Listing};
