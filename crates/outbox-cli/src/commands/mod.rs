//! One module per subcommand, and the few things they share: turning global
//! flags into validated configs and a PostgreSQL connection.

mod admin;
mod check;
mod cleanup;
mod config;
mod consume;
mod dlq;
mod fleet;
mod fleet_ops;
mod migrate;
mod partitions;
mod relay;
mod relays;
mod replay;
mod selection;
mod stats;

use anyhow::Context;
use outbox::privileges::{Needs, Role};
use outbox_relay::pg::PgConfig;
use outbox_relay::trace::Tracing;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, Command, ConfigCommand, Global};
use crate::config::Layered;
use crate::exit::ConfigError;

pub(crate) async fn run(cli: Cli) -> anyhow::Result<()> {
    let g = &cli.global;
    match cli.command {
        // Both layer --config under the command line: they parse it again.
        Command::Relay(_) => relay::run(Layered::parse(std::env::args_os())?).await,
        Command::Config(ConfigCommand::Show(_)) => config::show(Layered::parse(std::env::args_os())?).await,
        Command::Migrate(args) => migrate::run(g, args).await,
        Command::Stats(args) => stats::run(g, args).await,
        Command::Relays(args) => relays::run(g, args).await,
        Command::Cleanup(args) => cleanup::run(g, args).await,
        Command::Consume(args) => consume::run(g, args).await,
        Command::Dlq(args) => dlq::run(g, args).await,
        Command::Replay(args) => replay::run(g, args).await,
        Command::Partitions(command) => partitions::run(g, command).await,
        Command::Admin(args) => admin::run(g, args).await,
    }
}

/// The outbox table named by `--schema`, `--table`, `--channel`.
pub(crate) fn outbox_config(g: &Global) -> anyhow::Result<outbox::Config> {
    Ok(outbox::Config::new(&g.schema, &g.table)?.with_channel(&g.channel)?)
}

/// The sink flags' options, the CloudEvents source defaulting to the
/// name of `outbox`: what `relay` and `replay` send with.
pub(crate) fn sink_options(
    outbox: &outbox::Config,
    flags: crate::cli::SinkArgs,
) -> outbox_relay::SinkOptions {
    flags.options(|| format!("/outbox/{}", outbox.display_name()))
}

/// `DATABASE_URL` parsed (TLS parameters included), with the connect
/// timeout.
pub(crate) fn pg_config(g: &Global) -> anyhow::Result<PgConfig> {
    let url = g.database_url.as_deref().ok_or_else(|| {
        ConfigError("no database given: set DATABASE_URL or pass --database-url".to_owned())
    })?;
    parse_pg_url(url, g)
}

/// `url` parsed; a [`outbox_relay::pg::UrlError`] is exit code 2. With
/// several hosts, only one that takes writes (`PgConfig::prefer_primary`):
/// every command but the read-only reports writes, and those should read
/// what the relay and the writers see.
pub(crate) fn parse_pg_url(url: &str, g: &Global) -> anyhow::Result<PgConfig> {
    let mut config = outbox_relay::pg::parse_url(url, g.connect_timeout)?;
    config.prefer_primary();
    Ok(config)
}

/// One connection for a short command, retrying until `--connect-timeout`
/// (a permanent failure, exit code 2, at once); its driver runs in a task.
pub(crate) async fn connect(config: &PgConfig) -> anyhow::Result<Client> {
    Ok(outbox_relay::pg::connect(config).await?)
}

/// Fails with exit code 2, naming what is missing and the `outbox migrate
/// --grant` that fixes it, unless the connected role may do the work of
/// `roles` on the outbox `config`: run at startup, before the schema
/// check, so a missing grant is not a `permission denied` later.
pub(crate) async fn require(client: &Client, config: &outbox::Config, roles: &[Role]) -> anyhow::Result<()> {
    let tables = outbox::privileges::Tables::outbox(config.clone());
    Ok(outbox::privileges::check(client, &tables, &Needs::of(roles)).await?)
}

/// [`require`] for the inbox `inbox`.
pub(crate) async fn require_inbox(
    client: &Client,
    inbox: &outbox::InboxConfig,
    roles: &[Role],
) -> anyhow::Result<()> {
    let tables = outbox::privileges::Tables::new(outbox::Config::default(), inbox.clone());
    Ok(outbox::privileges::check(client, &tables, &Needs::of(roles)).await?)
}

/// What a `dlq` subcommand does: `list` reads, the others write.
pub(crate) fn dlq_role(command: &crate::cli::DlqCommand) -> Role {
    match command {
        crate::cli::DlqCommand::List { .. } => Role::Stats,
        _ => Role::Admin,
    }
}

/// A token cancelled by the first SIGINT or SIGTERM.
pub(crate) fn shutdown_token() -> anyhow::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: finishing the batch in flight"),
            _ = int.recv() => tracing::info!("SIGINT: finishing the batch in flight"),
        }
        outbox::notify::send("STOPPING=1");
        cancel.cancel();
    });
    Ok(token)
}

/// The OTLP trace exporter `endpoint` (`--otlp-endpoint`) or the
/// `OTEL_EXPORTER_OTLP_*` variables ask for, named `service` unless
/// `OTEL_SERVICE_NAME` says otherwise; None when tracing is off. A bad
/// endpoint or header is a configuration error (exit 2).
pub(crate) fn start_traces(endpoint: Option<&str>, service: &str) -> anyhow::Result<Option<Tracing>> {
    let tracing = Tracing::from_env(endpoint, service).map_err(|e| {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        ConfigError(message)
    })?;
    if tracing.is_some() {
        tracing::info!("exporting traces over OTLP/HTTP");
    }
    Ok(tracing)
}

/// How long the exporter may take, on the way out, to send the spans it
/// still holds: a collector that is down must not hold up a stop.
const TRACES_FLUSH: std::time::Duration = std::time::Duration::from_secs(5);

/// Sends the spans still queued and stops the exporter, on every way out
/// of a command that traces; at most [`TRACES_FLUSH`]. Off the runtime's
/// thread: the SDK's shutdown blocks.
pub(crate) async fn flush_traces(tracing: Option<Tracing>) {
    if let Some(tracing) = tracing {
        let _ = tokio::task::spawn_blocking(move || tracing.shutdown(TRACES_FLUSH)).await;
    }
}

/// `1 live relay`, `3 live relays`: counts in the commands' own lines.
pub(crate) fn counted(n: u64, one: &str, many: &str) -> String {
    match n {
        1 => format!("1 {one}"),
        n => format!("{n} {many}"),
    }
}
