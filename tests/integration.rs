//! The integration tests, one binary with a module per area (as ripgrep and just do): each area used to be a test
//! binary of its own, which linked the crate and its dependencies once per area and compiled `common` once per
//! area. Every test runs against the real PostgreSQL and RabbitMQ (see `common`); nextest runs each in a process of
//! its own, so the areas share nothing at run time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

/// The checks the fuzz targets run, replayed over their corpus by `fuzz_corpus`.
#[path = "../fuzz/checks.rs"]
mod fuzz_checks;

mod batch;
mod chaos;
mod cleanup;
mod cli;
mod cluster;
mod completions;
mod concurrency;
mod consume;
mod crash;
mod demo;
mod docs;
mod effects;
mod errors;
mod fuzz_corpus;
mod grants;
mod hostile;
mod inbox;
mod limits;
mod metrics;
mod migrate;
mod outage;
mod partitioned_inbox;
mod partitions;
mod pgbouncer;
mod rabbit_restart;
mod reference;
mod replay;
mod restart;
mod statements;
mod stats;
mod top;
mod triage;
