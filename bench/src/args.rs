//! The command line: the bench's flags, and the consumer it runs as a child process for each mode (hidden).

use std::path::PathBuf;

use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use inboxctl::cli::GlobalOpts;
use inboxctl::cli::{MAX_COUNT, parse_fraction, parse_rate};
use inboxctl::{output, table};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::guard::ConsumeArgs;
use crate::report::{Mode, Options, Report};
use crate::{cleanup, measure};

/// Measures inboxctl's consumer beside the same consumer without an inbox, the tutorial's look-up-first shape, the
/// database's own limit and a published peer, side by side in one run, against the PostgreSQL and RabbitMQ it is
/// given (every mode gets a scratch database and queues of its own, dropped afterwards unless --keep).
#[derive(Debug, Parser)]
#[command(
    name = "inboxctl-bench",
    version,
    max_term_width = 110,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalOpts,

    #[command(flatten)]
    pub bench: Args,

    #[command(subcommand)]
    pub child: Option<Child>,
}

#[derive(Debug, Subcommand)]
pub enum Child {
    /// One mode's consumer, as the bench runs it (not for use by hand)
    #[command(hide = true)]
    Consume(ConsumeArgs),
}

/// Parses the process's command line, and notes which URLs were given a password in it (as inboxctl does, to warn).
pub fn parse() -> Result<Cli, clap::Error> {
    let matches = Cli::command().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut Cli::command()))?;
    cli.global.connect.note_passwords_in_arguments(&matches);
    Ok(cli)
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages pre-loaded for each throughput measurement (10 to 1000000)
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(10..=MAX_COUNT))]
    pub messages: u64,

    /// Repeats; the modes alternate within each
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub repeats: u32,

    /// The modes to measure, in this order within each repeat (peer needs Node.js and npm: it installs
    /// pg-transactional-outbox once into INBOXCTL_BENCH_PEER_DIR or the user's cache directory)
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Mode::Ceiling, Mode::CeilingBatched, Mode::Bare, Mode::Tutorial, Mode::Inbox, Mode::InboxBatched, Mode::Peer])]
    pub modes: Vec<Mode>,

    /// Messages processed at once, by every mode (connections, for the ceiling)
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub concurrency: u16,

    /// Prefetch of every consumer
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,

    /// Batch size of the inbox-batched mode
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(2..=64))]
    pub batch_size: u16,

    /// Messages of each warm-up run (at most 1000000)
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(0..=MAX_COUNT))]
    pub warmup: u64,

    /// Steady publish rate of the latency run, messages per second (0.001 to 1000000; with --latency-seconds, at
    /// most 1000000 messages)
    #[arg(long, default_value_t = 200.0, value_parser = parse_rate)]
    pub latency_rate: f64,

    /// Length of the latency run, seconds (1 to 86400)
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub latency_seconds: u64,

    /// Messages of the duplicate run (1 to 1000000)
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=MAX_COUNT))]
    pub duplicate_messages: u64,

    /// Fraction of them delivered twice (half at once, half after the rest)
    #[arg(long, default_value_t = 0.1, value_parser = parse_fraction)]
    pub duplicates: f64,

    /// Also measure cleanup and the dashboard's refresh queries at this many inbox rows (e.g. 10000000, at most
    /// 1000000000); 0 skips it
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    pub cleanup_rows: u64,

    /// Batch size of `inboxctl cleanup` in the cleanup measurement
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub cleanup_batch_size: i64,

    /// Pause between cleanup batches in the cleanup measurement
    #[arg(long, default_value = "0s", value_parser = inboxctl::cli::parse_duration)]
    pub cleanup_batch_pause: std::time::Duration,

    /// Which cleanup runs to measure (each with its baseline: `baseline` for `inboxctl` and `plain-delete`,
    /// `partitioned-baseline` for `partition-drop`)
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "baseline,inboxctl,plain-delete,partitioned-baseline,partition-drop"
    )]
    pub cleanup_variants: Vec<crate::cleanup::Variant>,

    /// How many times the cleanup runs are measured, each on fresh copies; their p99 ratios are reported as median,
    /// min and max
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub cleanup_repeats: u32,

    /// Measure only the cleanup and the refresh queries (with --cleanup-rows), no consumer modes
    #[arg(long, requires = "cleanup_rows")]
    pub cleanup_only: bool,

    /// Write the full results (every repeat, medians, spreads, the machine) here as JSON
    #[arg(long)]
    pub output: Option<PathBuf>,

    /// Keep the scratch databases and queues afterwards
    #[arg(long)]
    pub keep: bool,

    /// Measure the inbox modes against an inbox already holding this many processed rows (e.g. 10000000, at most
    /// 1000000000), their ids of --id-kind; 0: an empty inbox
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    pub inbox_rows: u64,

    /// With --inbox-rows: the inbox partitioned by day on the time inside the ids (`inboxctl migrate --partitioned
    /// 1d`), the rows in the partitions of their days; inbox and inbox-batched modes only (not v4 ids, which carry no
    /// time)
    #[arg(long, requires = "inbox_rows")]
    pub inbox_partitioned: bool,

    /// The kind of message ids published: MassTransit's NewId (what a MassTransit publisher sends), UUIDv7 or v4
    #[arg(long, value_enum, default_value_t = inboxctl::ids::IdKind::NewId)]
    pub id_kind: inboxctl::ids::IdKind,

    /// What the modes' queues are declared as: classic, or quorum (replicated; on one node here, its cost without
    /// the network)
    #[arg(long, value_enum, default_value_t = inboxctl::amqp::topology::QueueType::Classic)]
    pub queue_type: inboxctl::amqp::topology::QueueType,
}

/// Runs the bench, prints its table and writes its JSON.
pub async fn run(args: Args, global: &GlobalOpts, shutdown: CancellationToken) -> Result<()> {
    // The latency run's messages are made up front, like every run's.
    if args.latency_rate * args.latency_seconds as f64 > MAX_COUNT as f64 {
        return Err(Error::usage(format!(
            "--latency-rate × --latency-seconds is more than {MAX_COUNT} messages"
        )));
    }
    if args.inbox_partitioned
        && args
            .modes
            .iter()
            .any(|m| matches!(m, Mode::Ceiling | Mode::CeilingBatched))
    {
        return Err(Error::usage(
            "--inbox-partitioned measures the consumer's modes (inbox, inbox-batched, inbox-quorum): the ceilings \
             claim without the partition key",
        ));
    }
    let db = global.connect.database()?;
    let broker = global.connect.broker()?;
    let options = Options {
        modes: if args.cleanup_only {
            Vec::new()
        } else {
            args.modes.clone()
        },
        messages: args.messages,
        repeats: args.repeats,
        concurrency: args.concurrency,
        prefetch: args.prefetch,
        batch_size: args.batch_size,
        warmup: args.warmup,
        latency_rate: args.latency_rate,
        latency_seconds: args.latency_seconds,
        duplicate_messages: args.duplicate_messages,
        duplicates: args.duplicates,
        keep: args.keep,
        ids: args.id_kind,
        inbox_rows: args.inbox_rows,
        inbox_partitioned: args.inbox_partitioned,
        cleanup_batch_size: args.cleanup_batch_size,
        cleanup_batch_pause: args.cleanup_batch_pause,
        cleanup_variants: crate::cleanup::Variant::checked(&args.cleanup_variants)?,
        cleanup_repeats: args.cleanup_repeats,
        queue_type: args.queue_type,
    };
    let say = |line: &str| eprintln!("{line}");
    let mut report = measure::run(&db, &broker, &options, &shutdown, say).await?;
    if args.cleanup_rows > 0 {
        let (cleanup, refresh) =
            cleanup::run(&db, &broker, &options, args.cleanup_rows, &shutdown, say).await?;
        report.cleanup = Some(cleanup);
        report.refresh_ms = Some(refresh);
    }
    print(&report)?;
    if let Some(path) = &args.output {
        std::fs::write(
            path,
            serde_json::to_vec_pretty(&report).map_err(std::io::Error::other)?,
        )?;
        output::line(&format!("results written to {}", path.display()))?;
    }
    Ok(())
}

fn print(report: &Report) -> Result<()> {
    let mut t = table::new(&[
        "mode",
        "msg/s (median)",
        "min–max",
        "p50 ms",
        "p99 ms",
        "duplicate effects",
        "RSS MB",
    ]);
    let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    for (mode, m) in Mode::ALL
        .iter()
        .filter_map(|m| report.modes.get(m.name()).map(|r| (m.name(), r)))
    {
        t.add_row(vec![
            comfy_table::Cell::new(mode),
            m.throughput
                .map_or("-".to_owned(), |s| format!("{:.0}", s.median))
                .into(),
            m.throughput
                .map_or("-".to_owned(), |s| format!("{:.0}–{:.0}", s.min, s.max))
                .into(),
            f(m.p50_ms.map(|s| s.median)).into(),
            f(m.p99_ms.map(|s| s.median)).into(),
            m.duplicate_effects
                .map_or("-".to_owned(), |d| d.to_string())
                .into(),
            f(m.rss_mb).into(),
        ]);
    }
    output::line(&t.to_string())?;
    for (pair, s) in &report.ratios {
        output::line(&format!(
            "{pair}: {:.2} (repeats {:.2}–{:.2})",
            s.median, s.min, s.max
        ))?;
    }
    Ok(())
}
