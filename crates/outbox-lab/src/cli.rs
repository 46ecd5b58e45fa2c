//! The command line of `outbox-lab`: the options every command shares,
//! one subcommand each for the lab, the bench, the soak and the demo (their
//! own flags are declared beside them, in the library), and the logging
//! each starts with.

use std::io::IsTerminal;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_lab::Database;
use tracing_subscriber::EnvFilter;

/// The outbox's lab, bench, soak and demo, on a throwaway PostgreSQL and
/// redis-server (or DATABASE_URL and --sink). Kept out of the production
/// binary: the relays and commands they drive are children of `outbox`
/// (OUTBOX_BIN, else the `outbox` beside this binary; `cargo build -p
/// outbox-cli` puts it there).
///
/// Exit codes: 0 success (every verdict and check holds); 1 runtime
/// failure, or a check that found a problem (a failed lab verdict, a soak
/// check, a bench run that lost or repeated an event, the demo's counts);
/// 2 usage or configuration error (bad flag or URL, an unknown experiment,
/// the soak on a server it was not told it owns, no `outbox` binary).
#[derive(Debug, Parser)]
#[command(name = "outbox-lab", version, max_term_width = 100)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: Global,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Options every command understands.
#[derive(Debug, Args)]
pub(crate) struct Global {
    /// PostgreSQL connection string (URL or key=value) [default: a
    /// throwaway cluster for the run].
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub(crate) database_url: Option<String>,
    /// How long to keep trying to reach PostgreSQL.
    #[arg(long, env = "OUTBOX_CONNECT_TIMEOUT", default_value = "10s",
          value_parser = humantime::parse_duration, global = true)]
    pub(crate) connect_timeout: Duration,
    /// Log format.
    #[arg(
        long,
        env = "OUTBOX_LOG_FORMAT",
        value_enum,
        default_value = "human",
        global = true
    )]
    pub(crate) log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the whole pattern end to end on a throwaway PostgreSQL and Redis
    /// (or on DATABASE_URL / OUTBOX_SINK when set).
    Demo(outbox_lab::demo::DemoArgs),
    /// Measure relay throughput against the no-sink floor and the naive
    /// per-row relay, or (--source wal) log tailing beside the polling
    /// relay, on a throwaway PostgreSQL and Redis (or DATABASE_URL /
    /// OUTBOX_SINK, in a scratch schema it drops).
    Bench(outbox_lab::bench::BenchArgs),
    /// Reproduce the reference design's experiments (dual write, crash
    /// before mark, retries, watermark relay, latency, ordering, ...) on a
    /// throwaway PostgreSQL, redis-server and HTTP receiver (or
    /// DATABASE_URL, in schema outbox_lab), each figure beside the
    /// reference's. Exit codes: 0 every correctness verdict holds; 1 one
    /// failed (a lost event, a duplicate side effect behind the inbox, an
    /// order violation where the mode promises order) or an experiment
    /// could not run; 2 an unknown experiment. Timings are never judged.
    Lab(outbox_lab::lab::LabArgs),
    /// Crash-consistency soak: writers commit events while relays are
    /// killed (also between the sink's ack and the mark), frozen past their
    /// lease and cut off, PostgreSQL restarts, the sink goes away, a slot
    /// is lost and recovered; then it drains and checks every delivery
    /// against the ledger of what committed: lost, phantom, duplicates per
    /// fault, order, dead letters, side effects behind the inbox. On a
    /// throwaway PostgreSQL and redis-server. A DATABASE_URL is refused
    /// without --i-own-this-server; even then its faults stay in its own
    /// database and connections, and the server-wide ones (restarts, ALTER
    /// SYSTEM) are skipped, as are the outages of a --sink it did not
    /// start. Exit codes: 0 every check holds; 1 one failed; 2 a usage
    /// mistake.
    Soak(outbox_lab::soak::SoakArgs),
}

impl Command {
    /// The log filter unless `RUST_LOG` says otherwise.
    pub(crate) fn default_log_filter(&self) -> &'static str {
        match self {
            // The demo prints its own story, the bench its tables; relay
            // info lines would interleave with them.
            Command::Demo(_) | Command::Bench(_) => "warn",
            // The soak's own connections retry through PostgreSQL restarts
            // it caused; their warnings would bury its progress.
            Command::Soak(_) => "warn,outbox_relay::pg=error",
            // lapin warns with the whole message, payload included, for
            // each unroutable one; the row's last_error already says so.
            Command::Lab(_) => "info,tokio_postgres=warn,lapin=error",
        }
    }
}

impl Cli {
    /// Runs the command.
    pub(crate) async fn run(self) -> anyhow::Result<()> {
        let db = Database {
            url: self.global.database_url,
            connect_timeout: self.global.connect_timeout,
        };
        match self.command {
            Command::Demo(args) => outbox_lab::demo::run(&db, args).await,
            Command::Bench(args) => outbox_lab::bench::run(&db, args).await,
            Command::Lab(args) => outbox_lab::lab::run(&db, args).await,
            Command::Soak(args) => outbox_lab::soak::run(&db, args).await,
        }
    }
}

/// How log lines look: the `outbox` binary's two formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// One readable line per event.
    Human,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Logs to stderr as the `outbox` binary does: `RUST_LOG` over
/// `default_filter`; human lines coloured only for a person at a terminal
/// without `NO_COLOR` (<https://no-color.org>), or tracing's JSON.
pub(crate) fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Overrides tracing-subscriber's own NO_COLOR check, so it is
        // repeated above.
        .with_ansi(format == LogFormat::Human && colour);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
