//! `inboxctl-bench`: what exactly-once costs, measured side by side in one run (docs/performance.md).
//!
//! A crate of its own, on inboxctl's public API: the modes it compares are inboxctl's consumer operation with the
//! library's [`Inbox`](inboxctl::inbox::Inbox), and the same operation with the work guarded otherwise ([`guard`]).

mod args;
mod cleanup;
mod error;
mod guard;
mod measure;
mod peer;
mod prefill;
mod report;
mod scratch;
mod sql;
mod template;

use std::process::ExitCode;

use inboxctl::error::exit;
use inboxctl::logging::{self, Target};

fn main() -> ExitCode {
    let cli = match args::parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // --help and --version are not errors; a bad flag or value is a usage error.
            return ExitCode::from(if e.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
        }
    };
    logging::init(&cli.global, Target::Stderr);
    match run(cli) {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            e.report();
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(cli: args::Cli) -> error::Result<()> {
    cli.global.connect.register_secrets();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let shutdown = inboxctl::shutdown::on_signals();
        match cli.child {
            Some(args::Child::Consume(consume)) => {
                guard::consume(&consume, &cli.global.connect, shutdown).await
            }
            None => args::run(cli.bench, &cli.global, shutdown).await,
        }
    });
    // Whatever the tasks still wait on must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}
