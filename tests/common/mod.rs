//! Shared set-up for the integration tests: a database and a RabbitMQ vhost of the test's own on the real servers,
//! the inboxctl binary as a child process, AMQP helpers and a loopback TCP proxy that can cut connections.
//!
//! The servers are taken from `INBOXCTL_TEST_PG` (a `postgres://` URL without a database) and `INBOXCTL_TEST_AMQP`
//! (an `amqp://` URL without a vhost), by default the loopback services. A test that cannot reach them fails.
//!
//! One module per area; everything public is re-exported here, so a test names it `common::<name>`:
//!
//! - `env`: [`TestEnv`] (a scratch database and vhost, dropped with it) and the binary pointed at them;
//! - `process`: [`Proc`] (inboxctl in the background), [`Output`] (run to its end), `publish_parcels`,
//!   `consume_until_idle`;
//! - `db`: the superuser's pool, counts, identifier quoting; `broker`: topology, publishing with confirms, draining,
//!   the broker's queue counts;
//! - `proxy`: [`Proxy`], a loopback TCP proxy a test cuts for an outage, or whose connections it silences;
//! - `fixtures`: captured deliveries, fresh parcel events, test-made certificates;
//! - `modes`: the two modes every guarantee test runs in (`in_both_modes!`);
//! - `vhosts`: the tests' RabbitMQ vhosts, made and removed in bulk (a `rabbitmqctl` call costs 1.5 s of CPU);
//! - `erl`: an Erlang node of the test process's own that reads the broker's books without a `rabbitmqctl` call;
//! - `cluster`: [`Cluster`], three private RabbitMQ nodes clustered on loopback;
//! - `pgbouncer`: [`PgBouncer`], a private PgBouncer in transaction pooling in front of the test's database;
//! - `tmux`: [`Tmux`], a real terminal;
//! - `wait`: [`eventually`], [`clear_of_midnight`]; `faults`: the fault tests' choreography and the exactly-once check they end with;
//! - [`raw_amqp`]: a frame-by-frame publisher for what lapin cannot send.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod raw_amqp;

mod broker;
pub use broker::*;

mod cluster;
pub use cluster::*;

mod db;
pub use db::*;

mod env;
pub use env::*;

pub mod erl;

mod faults;
pub use faults::*;

mod fixtures;
pub use fixtures::*;

#[macro_use]
mod modes;
pub use modes::*;

mod pgbouncer;
pub use pgbouncer::*;

mod process;
pub use process::*;

mod proxy;
pub use proxy::*;

mod stub;
pub use stub::*;

mod tmux;
pub use tmux::*;

/// The migrated database each test's is copied from.
pub mod template;
pub mod vhosts;

mod wait;
pub use wait::*;
