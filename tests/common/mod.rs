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
//! - `proxy`: [`Proxy`], a loopback TCP proxy a test cuts for an outage;
//! - `fixtures`: captured deliveries, fresh parcel events, test-made certificates;
//! - `modes`: the two modes every guarantee test runs in (`in_both_modes!`);
//! - `wait`: [`eventually`]; `faults`: the fault tests' choreography and the exactly-once check they end with;
//! - [`raw_amqp`]: a frame-by-frame publisher for what lapin cannot send.
//!
//! Every test binary compiles all of this and uses a part of it, and rustc judges dead code per binary: what one
//! leaves unused, another uses. So `dead_code` (and `unused_imports` on the re-exports) is allowed on each module's
//! declaration below, with that reason, and nowhere else. Whether a helper is used by no test at all is another
//! question, which rustc answers over every binary with the allowance overridden:
//! `for t in <each tests/*.rs that has mod common>; do cargo rustc --features failpoints --test $t -- --force-warn
//! dead_code; done` — an item named in every binary's warnings is dead. None was when common was split into modules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code, reason = "each test binary uses a part")]
pub mod raw_amqp;

#[allow(dead_code, reason = "each test binary uses a part")]
mod broker;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use broker::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod db;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use db::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod env;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use env::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod faults;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use faults::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod fixtures;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use fixtures::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod modes;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use modes::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod process;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use process::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod proxy;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use proxy::*;

#[allow(dead_code, reason = "each test binary uses a part")]
mod wait;
#[allow(unused_imports, reason = "each test binary uses a part")]
pub use wait::*;
