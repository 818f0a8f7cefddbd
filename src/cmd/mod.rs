//! One file per subcommand, each with its `Args` and one `run`.

pub mod audit;
pub mod carrier_stub;
pub mod cleanup;
pub mod completions;
mod confirm;
pub mod consume;
pub mod demo;
pub mod effects;
pub mod failures;
pub mod find;
pub mod migrate;
mod progress;
pub mod publish;
pub mod reference;
pub mod replay;
pub mod stats;
pub mod top;

use clap::Subcommand;
use tokio_util::sync::CancellationToken;

use crate::cli::GlobalOpts;
use crate::error::{Outcome, Result};

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)
    Migrate(migrate::Args),
    /// Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)
    Consume(Box<consume::Args>),
    /// Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)
    Cleanup(cleanup::Args),
    /// Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)
    Replay(replay::Args),
    /// Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues
    Find(find::Args),
    /// A dead-letter queue's messages grouped by the cause of their failure, as they are now (nothing is taken)
    Failures(failures::Args),
    /// Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)
    Publish(publish::Args),
    /// Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues
    Top(top::Args),
    /// Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON
    Stats(stats::Args),
    /// The whole story in one command: migrate, publish with duplicates, consume, count the effects
    Demo(demo::Args),
    /// Calls to the outside world not done (owed, in doubt, failed), and settling them
    Effects(effects::Args),
    /// The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it
    Audit(audit::Args),
    /// A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request
    CarrierStub(carrier_stub::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completions(completions::Args),
}

pub async fn run(
    command: Command,
    global: &GlobalOpts,
    shutdown: CancellationToken,
) -> Result<Outcome> {
    match command {
        Command::Migrate(args) => migrate::run(args, global, &shutdown).await,
        Command::Consume(args) => consume::run(*args, global, shutdown).await,
        Command::Cleanup(args) => cleanup::run(args, global, shutdown).await,
        Command::Find(args) => until_stopped(find::run(args, global), &shutdown, LOOKED).await,
        Command::Failures(args) => {
            until_stopped(failures::run(args, global), &shutdown, LOOKED).await
        }
        Command::Publish(args) => publish::run(args, global, shutdown).await,
        Command::Replay(args) => replay::run(args, global, shutdown).await,
        Command::Stats(args) => until_stopped(stats::run(args, global), &shutdown, LOOKED).await,
        Command::Top(args) => top::run(args, global, shutdown).await,
        Command::Demo(args) => demo::run(args, global, shutdown).await,
        Command::Effects(args) => effects::run(args, global, shutdown).await,
        Command::Audit(args) => {
            until_stopped(
                audit::run(args, global),
                &shutdown,
                "interrupted: nothing was changed",
            )
            .await
        }
        Command::CarrierStub(args) => carrier_stub::run(args, global, shutdown).await,
        Command::Completions(args) => completions::run(&args),
    }
}

/// What an interrupted look at queues says: it takes messages to look at them, and gives them back.
const LOOKED: &str = "interrupted: nothing was taken; the messages looked at go back to their queues as the connection closes";

/// A command ended at once by a stop, saying `said` (exit 3): its future is dropped with its connections, the
/// database rolling back what was under way and the broker giving back every message it held, each to its place.
async fn until_stopped(
    look: impl Future<Output = Result<Outcome>>,
    shutdown: &CancellationToken,
    said: &str,
) -> Result<Outcome> {
    tokio::select! {
        outcome = look => outcome,
        () = shutdown.cancelled() => {
            tracing::warn!("{said}");
            Ok(Outcome::Partial)
        }
    }
}
