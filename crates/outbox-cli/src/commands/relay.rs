//! `outbox relay`: deliver until SIGINT/SIGTERM (or, with `--drain`, until
//! nothing is due), then finish the batch in flight. First, the role's
//! privileges for the source, claim mode and retention (`outbox::privileges`:
//! exit 2 naming what is missing). `--check` checks the setup and exits
//! (`check.rs`).

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use outbox_relay::health::Registry;
use outbox_relay::{
    Backlog, Backoff, ClaimMode, Counters, Failpoint, Pooler, Relay, RelayConfig, SourceKind, WalSettings,
};

use outbox::privileges::{Needs, Role};

use crate::cli::{Global, RelayArgs};
use crate::config::{ConfigFile, Layered, OtherLane};
use crate::endpoint::Endpoint;
use crate::exit::ConfigError;

/// With no NOTIFY the poll interval is the delivery latency, so the default
/// is shorter than the fallback poll's.
pub(crate) const POLL_WITHOUT_NOTIFY: Duration = outbox_relay::defaults::POLL_INTERVAL_WITHOUT_NOTIFY;

/// The fleet flags (`--schemas` and its companions).
pub(crate) struct Fleet {
    pub(crate) schemas: Option<String>,
    pub(crate) listed: Vec<outbox_relay::fleet::Listed>,
    pub(crate) databases: Option<String>,
    pub(crate) sessions: usize,
    pub(crate) prepared_claims: usize,
    pub(crate) discover_interval: Duration,
    pub(crate) split: bool,
}

/// What the relay runs with, checked: `outbox config show` checks the same.
pub(crate) struct Prepared {
    pub(crate) config: RelayConfig,
    /// None when no sink was given: `outbox config show` says so, the relay
    /// refuses to start.
    pub(crate) sink: Option<Box<dyn outbox_relay::Sink>>,
    /// Routes claimed the other way (`claim` in their table).
    pub(crate) lane: Option<OtherLane>,
    pub(crate) retention: Option<outbox_relay::Retention>,
    /// With `--check`: each sink alone, with its table's name and URL.
    pub(crate) probes: Vec<crate::config::NamedSink>,
    /// A sink alone's URL without secrets, for route state (a router
    /// names its routes' own).
    pub(crate) address: Option<String>,
}

impl Prepared {
    /// What the relay runs with.
    pub(crate) fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Whether it runs retention.
    pub(crate) fn retains(&self) -> bool {
        self.retention.is_some()
    }
}

/// What the relay's work needs of its role: its source's, the partition
/// leases' unless `--ordering none`, and with `--retention` cleanup's (a
/// plain outbox) or partition maintenance's (a daily partitioned one).
pub(crate) async fn needs(
    client: &tokio_postgres::Client,
    config: &RelayConfig,
    retention: bool,
) -> anyhow::Result<(Vec<Role>, Needs)> {
    let mut roles = vec![match config.source {
        SourceKind::Poll => Role::Relay,
        SourceKind::Wal => Role::RelayWal,
    }];
    if retention {
        roles.push(match outbox::existing_layout(client, &config.outbox).await? {
            Some(outbox::Layout::Daily) => Role::Partitions,
            _ => Role::Cleanup,
        });
    }
    let needs = Needs::of(&roles);
    let needs = if config.ordering == outbox_relay::OrderMode::None {
        needs.without_leases()
    } else {
        needs
    };
    Ok((roles, needs))
}

/// The `[outboxes.NAME]` tables of `--config`, each layered (its keys over
/// the file's top-level ones, under flags and environment) and checked as a
/// relay's settings are.
pub(crate) fn listed(layered: &Layered) -> anyhow::Result<Vec<outbox_relay::fleet::Listed>> {
    let Some(file) = &layered.file else {
        return Ok(Vec::new());
    };
    let mut listed = Vec::new();
    for (name, at, mine) in each_listed(file, &std::env::args_os().collect::<Vec<_>>())? {
        let (g, args, file) = mine.into_relay();
        let split = args.fleet_split;
        let pg = super::pg_config(&g).with_context(|| format!("[outboxes.{name}]"))?;
        let prepared = prepare(&g, args, file).with_context(|| format!("[outboxes.{name}]"))?;
        let sink = prepared.sink.ok_or_else(|| {
            ConfigError(format!(
                "--config {at}: [outboxes.{name}] has no sink, nor has the file"
            ))
        })?;
        if prepared.lane.is_some() || prepared.retention.is_some() {
            return Err(ConfigError(format!(
                "--config {at}: [outboxes.{name}]: a fleet's outbox takes no retention and no route of its own claim mode"
            ))
            .into());
        }
        listed.push(outbox_relay::fleet::Listed {
            name,
            pg,
            relay: prepared.config,
            sink: Arc::from(sink),
            split,
        });
    }
    Ok(listed)
}

/// Each `[outboxes.NAME]` table of `file`: its name, where it stands
/// (`path:line`), and the relay command line `argv` layered for it (its
/// keys over the file's top-level ones, under flags and environment).
/// The relay serves them; `--outbox NAME` and `--all` name them
/// (`super::selection`).
pub(crate) fn each_listed(
    file: &ConfigFile,
    argv: &[OsString],
) -> anyhow::Result<Vec<(String, String, Layered)>> {
    let mut listed = Vec::new();
    for name in file.body().outbox_names() {
        let at = file
            .body()
            .outbox_span(&name)
            .map(|span| file.at(&span))
            .unwrap_or_default();
        if file.body().own_setting(&name, "schema").is_none() {
            return Err(ConfigError(format!("--config {at}: [outboxes.{name}] needs schema = \"…\"")).into());
        }
        let mine = Layered::parse_for(argv.iter().cloned(), Some(&name))?;
        listed.push((name, at, mine));
    }
    Ok(listed)
}

/// Runs the relay with the settings of flags, environment and `--config`.
pub(crate) async fn run(layered: Layered) -> anyhow::Result<()> {
    let listed = listed(&layered)?;
    let (g, args, file) = layered.into_relay();
    let otlp_endpoint = args.otlp_endpoint.clone();
    let pg = super::pg_config(&g)?;
    if args.check {
        return super::check::run(&pg, prepare(&g, args, file)?).await;
    }
    // Before the sinks and the relay are built: their metric handles are
    // looked up once, from the recorder installed by then.
    let endpoint = match args.http {
        Some(addr) => Some(Endpoint::bind(addr).await?),
        None => None,
    };
    if args.schemas.is_some() || !listed.is_empty() {
        let fleet = Fleet {
            schemas: args.schemas.clone(),
            listed,
            databases: args.databases.clone(),
            sessions: args.fleet_sessions as usize,
            prepared_claims: args.fleet_prepared_claims as usize,
            discover_interval: args.discover_interval,
            split: args.fleet_split,
        };
        return super::fleet::run(
            pg,
            prepare(&g, args, file)?,
            fleet,
            endpoint,
            otlp_endpoint.as_deref(),
        )
        .await;
    }
    if args.fleet_split {
        return Err(ConfigError(
            "--fleet-split applies to a fleet: give --schemas, or list outboxes as [outboxes.NAME] in --config"
                .to_owned(),
        )
        .into());
    }
    let Prepared {
        config,
        sink,
        lane,
        retention,
        probes: _,
        address,
    } = prepare(&g, args, file)?;
    let sink = sink.ok_or_else(|| {
        ConfigError(
            "no sink: give --sink or OUTBOX_SINK, or in --config a top-level sink = \"…\" or a \
             [default] table"
                .to_owned(),
        )
    })?;
    {
        // Before READY and before the schema check: a missing grant is a
        // configuration error naming itself, not `permission denied` in a
        // loop.
        let client = super::connect(&pg).await?;
        let (_, needs) = needs(&client, &config, retention.is_some()).await?;
        let tables = outbox::privileges::Tables::outbox(config.outbox.clone());
        outbox::privileges::check(&client, &tables, &needs).await?;
    }
    let cancel = super::shutdown_token()?;
    let retention = retention
        .map(|schedule| tokio::spawn(schedule.run(pg.clone(), config.outbox.clone(), cancel.clone())));
    let drain = config.drain;
    let outbox = config.outbox.clone();
    let mut relay = Relay::new(pg.clone(), Arc::from(sink), config);
    if let Some(address) = address {
        relay = relay.with_sink_address(address);
    }
    if let Some(lane) = lane {
        relay = relay.with_lane(Arc::new(lane.router), lane.claim, lane.types);
    }
    let counters = relay.counters();
    let served = match endpoint {
        Some(endpoint) => {
            tracing::info!(address = %endpoint.local_addr()?, "serving /metrics, /healthz and /readyz");
            let ctx = relay.context().clone();
            let relays = Arc::new(Registry::default());
            relays.register(ctx.outbox(), Arc::clone(ctx.health()));
            let backlog = Backlog::default().run(pg, outbox, ctx, cancel.clone());
            Some((endpoint.serve(relays, cancel.clone()), tokio::spawn(backlog)))
        }
        None => None,
    };
    // From here every way out goes through `flush_traces`.
    let traces = super::start_traces(otlp_endpoint.as_deref(), "outbox-relay")?;
    if let Some(traces) = &traces {
        relay = relay.with_tracing(traces.clone());
    }
    let result = relay.run(cancel.clone()).await.context("running the relay");
    cancel.cancel();
    if let Some(task) = retention {
        let _ = task.await;
    }
    if let Some((server, backlog)) = served {
        let _ = backlog.await;
        // A scraper holding a connection open must not hold up the exit.
        let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    }
    // SIGTERM, a drain's end and a failure alike: the relay has returned.
    super::flush_traces(traces).await;
    result?;
    if drain {
        drain_verdict(&counters)?;
    }
    Ok(())
}

/// The relay's config and sink from its settings; every check but
/// PostgreSQL's.
pub(crate) fn prepare(g: &Global, args: RelayArgs, file: Option<ConfigFile>) -> anyhow::Result<Prepared> {
    let outbox = super::outbox_config(g)?;
    if args.backoff_max < args.backoff_base {
        return Err(ConfigError(format!(
            "--backoff-max ({:?}) is shorter than --backoff-base ({:?})",
            args.backoff_max, args.backoff_base
        ))
        .into());
    }
    let options = super::sink_options(&outbox, *args.sink_options);
    let mut ordering_for = args.ordering_for;
    let file = file.map(ConfigFile::into_body).unwrap_or_default();
    // The file's [ordering] table wins over ordering_for.
    for (aggregate_type, mode) in file.ordering()? {
        ordering_for.retain(|(t, _)| *t != aggregate_type);
        ordering_for.push((aggregate_type, mode));
    }
    let probes = match &args.sink {
        _ if !args.check => Vec::new(),
        _ if file.routes() => file.sinks(args.sink.as_deref(), &options)?,
        Some(url) => vec![(
            "--sink".to_owned(),
            url.clone(),
            outbox_relay::sink::from_url(url, &options)?,
        )],
        None => Vec::new(),
    };
    let address = match &args.sink {
        Some(url) if !file.routes() => Some(outbox_relay::redact::url(url)),
        _ => None,
    };
    let mut claim = args.claim;
    let mut lane = None;
    let sink: Option<Box<dyn outbox_relay::Sink>> = match &args.sink {
        _ if file.routes() => {
            let split = args.source == SourceKind::Poll;
            let (router, own, other) = file.lanes(args.sink.as_deref(), &options, claim, split)?;
            claim = own;
            lane = other;
            Some(Box::new(router))
        }
        Some(url) => Some(outbox_relay::sink::from_url(url, &options)?),
        None => None,
    };
    let leases =
        claim == ClaimMode::Deadline || lane.as_ref().is_some_and(|l| l.claim == ClaimMode::Deadline);
    if leases && args.source == SourceKind::Poll && args.claim_timeout < options.timeout * 2 {
        // Not an error: a sink that answers well within its timeout is
        // served. But a batch whose requests run into it outlives its claim.
        tracing::warn!(
            claim_timeout = %humantime::format_duration(args.claim_timeout),
            http_timeout = %humantime::format_duration(options.timeout),
            "--claim-timeout is under twice the sink's timeout: a batch whose requests time out \
             outlives its claim, is abandoned and sent again; raise --claim-timeout"
        );
    }
    let failpoint = match std::env::var("OUTBOX_FAILPOINT") {
        Ok(v) if !v.is_empty() => Some(v.parse::<Failpoint>().map_err(ConfigError)?),
        _ => None,
    };
    let listen = match (&args.listen_url, args.pooler) {
        (None, _) => None,
        (Some(url), Pooler::Transaction) => Some(super::parse_pg_url(url, g).context("--listen-url")?),
        (Some(_), Pooler::None) => {
            return Err(ConfigError(
                "--listen-url is for --pooler transaction; without a transaction-mode pooler the relay \
                 LISTENs on its own session"
                    .to_owned(),
            )
            .into());
        }
    };
    // Through a transaction-mode pooler, without a listen connection, the
    // poll is the delivery latency, as with --no-notify.
    let polls = args.no_notify || (args.pooler == Pooler::Transaction && listen.is_none());
    let config = RelayConfig {
        outbox,
        batch_size: args.batch_size,
        backoff: Backoff {
            base: args.backoff_base,
            max: args.backoff_max,
            max_attempts: g.max_attempts,
            retry_for: args.retry_for,
        },
        poll_interval: args.poll_interval.unwrap_or(if polls {
            POLL_WITHOUT_NOTIFY
        } else {
            RelayConfig::default().poll_interval
        }),
        notify: !args.no_notify,
        connect_timeout: g.connect_timeout,
        drain: args.drain,
        ordering: args.ordering,
        ordering_for,
        lease_timeout: args.lease_timeout,
        name: args.relay_name,
        max_event_bytes: args.max_event_bytes,
        batch_max_bytes: args.batch_max_bytes,
        failpoint,
        source: args.source,
        wal: WalSettings {
            window: args.wal_window as usize,
            cleanup: args.wal_cleanup,
            retained_warn: args.wal_retained_warn,
        },
        claim,
        claim_timeout: args.claim_timeout,
        pooler: args.pooler,
        listen,
    };
    if args.retention.is_some() && args.pooler == Pooler::Transaction {
        return Err(ConfigError(
            "--retention takes a session advisory lock (one relay at a time runs it), which a \
             transaction-mode pooler would leave on a shared server connection; run `outbox cleanup` \
             on a schedule instead (it works through the pooler)"
                .to_owned(),
        )
        .into());
    }
    let retention = args.retention.map(|keep| outbox_relay::Retention {
        keep,
        interval: args.retention_interval,
    });
    Ok(Prepared {
        config,
        sink,
        lane,
        retention,
        probes,
        address,
    })
}

/// A drain that left due rows behind or made dead letters fails (exit 1),
/// so a cron job notices.
fn drain_verdict(counters: &Counters) -> anyhow::Result<()> {
    if let Some(cause) = counters.sink_unavailable.get() {
        anyhow::bail!("the drain stopped with due events undelivered: the sink is unavailable ({cause})");
    }
    let dead = counters.dead_lettered.load(Ordering::Relaxed);
    if dead > 0 {
        anyhow::bail!("the drain made {dead} dead letter(s): see `outbox dlq list`");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    /// The flags' defaults are the library's, every one: `outbox relay` with
    /// no flags makes exactly `RelayConfig::default()`. Compared whole (as
    /// its `Debug`), so a field added later is covered without a line here.
    #[test]
    fn the_flags_defaults_are_the_librarys() {
        // Only the variables `outbox relay` reads: the test runner's own
        // (`OUTBOX_TANSU` from scripts/test.sh) change nothing here.
        let command = <Cli as clap::CommandFactory>::command();
        let set: Vec<String> = command
            .get_arguments()
            .chain(
                command
                    .find_subcommand("relay")
                    .expect("the relay command")
                    .get_arguments(),
            )
            .filter_map(|arg| arg.get_env())
            .filter_map(|var| var.to_str())
            .filter(|var| std::env::var_os(var).is_some())
            .map(str::to_owned)
            .collect();
        assert!(
            set.is_empty(),
            "unset {set:?}: they change the defaults this test compares"
        );
        let cli = Cli::try_parse_from(["outbox", "relay"]).expect("no flags parse");
        let Command::Relay(args) = cli.command else {
            panic!("parsed as another command")
        };
        let prepared = prepare(&cli.global, args, None).expect("the defaults are valid");
        assert_eq!(
            format!("{:#?}", prepared.config),
            format!("{:#?}", RelayConfig::default())
        );
        // `--no-notify` polls at its own default.
        let cli = Cli::try_parse_from(["outbox", "relay", "--no-notify"]).expect("parses");
        let Command::Relay(args) = cli.command else {
            panic!("parsed as another command")
        };
        let prepared = prepare(&cli.global, args, None).expect("valid");
        assert_eq!(
            prepared.config.poll_interval,
            outbox_relay::defaults::POLL_INTERVAL_WITHOUT_NOTIFY
        );
    }
}
