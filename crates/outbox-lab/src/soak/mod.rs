//! `outbox-lab soak`: the crash-consistency soak. Writers commit events into a
//! polled outbox and a log-tailed one while relays are killed (also between
//! the sink's ack and the mark), frozen past their lease, cut off with
//! `pg_terminate_backend`; PostgreSQL restarts (fast, immediate, crash);
//! the sink goes away; a consumer dies; columns are added; the slot is
//! invalidated and recovered. Then it drains and checks every delivery
//! against the ledger of what committed (`check.rs`).
//!
//! It touches only what it started, unless told otherwise: a `DATABASE_URL`
//! (a server it did not start) is refused unless `--i-own-this-server`
//! says the server is the caller's to disturb, and even then every fault
//! stays in the soak's own database and on its own connections (its
//! children's `application_name`s, `outbox-soak-…`). The faults that act
//! on the whole server (a restart, `ALTER SYSTEM` for the slot) strike only
//! a server it started; on any other they are listed as skipped, like the
//! outages of a `--sink` it was given.
//!
//! The parts: `schedule` (the seeded faults), `fleet` (the relay and
//! consumer processes), `writers` (the writers and the ledger), `faults`
//! (injecting them), `timeline` (the samples), `check` (the verdict) and
//! `output` (table, JSON, HTML).
//!
//! Exit code: 1 if any check fails, 2 for a usage mistake.

mod check;
mod faults;
mod fleet;
mod names;
mod output;
mod schedule;
mod timeline;
mod writers;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::InboxConfig;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use self::check::Bounds;
use self::faults::Chaos;
use self::fleet::Fleet;
use self::names::SCHEMA;
use self::output::Report;
use self::schedule::{Budget, Rng, Src};
use self::writers::Writers;
use crate::scratch::{connect, parse_pg_url, progress_bar, wait_until};
use crate::{ConfigError, Database};

/// Which outboxes a run drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SoakSource {
    /// The polling relays (`--relays` of them, `partition` order, one
    /// aggregate type `strict`).
    Poll,
    /// Two log-tailing relays: a reader and a standby.
    Wal,
    /// Both, on separate tables.
    Both,
}

/// `outbox-lab soak`'s arguments.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// How long the writers write and the faults strike, before the drain
    /// and the checks [default: 10m; 75s with --quick].
    #[arg(long, value_parser = crate::positive_duration)]
    pub duration: Option<Duration>,
    /// Events per second the writers commit, all outboxes together
    /// [default: 500; 300 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub rate: Option<u32>,
    /// Polling relays.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub relays: u32,
    /// The outboxes: `poll`, `wal` or `both` (separate tables).
    #[arg(long, value_enum, default_value = "both")]
    pub source: SoakSource,
    /// The seed of the fault schedule [default: drawn, and printed].
    #[arg(long)]
    pub seed: Option<u64>,
    /// A short run (75 s, fewer and shorter faults) for CI.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also write a self-contained HTML report (checks, fault log, timeline
    /// plots with each fault marked) here.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// A Redis URL for the relays' streams [default: a throwaway
    /// redis-server, which the sink outages stop; a given one is never
    /// stopped].
    #[arg(long)]
    pub sink: Option<String>,
    /// Run on DATABASE_URL, a PostgreSQL this soak did not start: says
    /// the server is yours to disturb. Without it a DATABASE_URL is
    /// refused (exit 2). Even with it the faults stay in the soak's own
    /// database and connections (its relays' backends are terminated, its
    /// schema altered), and the server-wide ones (restarts, ALTER SYSTEM
    /// for the slot fault) are skipped.
    #[arg(long)]
    pub i_own_this_server: bool,
    /// The relays' --batch-size.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: u32,
    /// Internal: be a writer that opens a transaction and waits to be
    /// SIGKILLed (`poll` or `wal`).
    #[arg(long, hide = true)]
    pub doomed_writer: Option<String>,
}

/// The WAL relays' default `--wal-window`.
const WAL_WINDOW: u64 = 5000;
/// Writers per outbox.
const WRITERS: u32 = 2;

fn budget(args: &SoakArgs) -> Budget {
    if args.quick {
        Budget {
            duration: args.duration.unwrap_or(Duration::from_secs(75)),
            pg_restarts: 2,
            terminations: 1,
            outages: 1,
            outage_seconds: (4.0, 8.0),
            split_brains: 1,
            add_columns: 1,
            slot_invalidation: true,
            big_transactions: 1,
            big_events: 10_000,
            doomed_writers: 2,
            consumer_dead_seconds: 10.0,
            kill_every: (1.5, 3.0),
        }
    } else {
        Budget {
            duration: args.duration.unwrap_or(Duration::from_secs(600)),
            pg_restarts: 4,
            terminations: 4,
            outages: 3,
            outage_seconds: (10.0, 60.0),
            split_brains: 3,
            add_columns: 2,
            slot_invalidation: true,
            big_transactions: 3,
            big_events: 10_000,
            doomed_writers: 5,
            consumer_dead_seconds: 60.0,
            kill_every: (1.2, 2.4),
        }
    }
}

/// Runs `outbox-lab soak`.
pub async fn run(db: &Database, args: SoakArgs) -> anyhow::Result<()> {
    if let Some(src) = &args.doomed_writer {
        let src = match src.as_str() {
            "poll" => Src::Poll,
            "wal" => Src::Wal,
            other => bail!(ConfigError(format!("--doomed-writer poll|wal, not {other:?}"))),
        };
        let url = db
            .url
            .as_deref()
            .ok_or_else(|| ConfigError("--doomed-writer needs DATABASE_URL".to_owned()))?;
        return writers::doomed_writer(&parse_pg_url(url, db.connect_timeout)?, src).await;
    }
    if let Some(sink) = &args.sink
        && !(sink.starts_with("redis://") || sink.starts_with("rediss://"))
    {
        bail!(ConfigError(format!(
            "--sink must be a redis:// or rediss:// URL, not {sink:?}"
        )));
    }
    if db.url.is_some() && !args.i_own_this_server {
        bail!(ConfigError(
            "the soak injects faults (it terminates backends, kills relays, invalidates a slot), and \
             DATABASE_URL names a server it did not start: unset DATABASE_URL to run on a throwaway \
             PostgreSQL, or pass --i-own-this-server if that server is yours to disturb (the faults \
             then stay in its database; restarts and ALTER SYSTEM are skipped)"
                .to_owned()
        ));
    }
    crate::scratch::outbox_bin()?;
    let sources = match args.source {
        SoakSource::Poll => vec![Src::Poll],
        SoakSource::Wal => vec![Src::Wal],
        SoakSource::Both => vec![Src::Poll, Src::Wal],
    };
    let budget = budget(&args);
    let rate = args.rate.unwrap_or(if args.quick { 300 } else { 500 });
    let seed = args.seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Rng::new(now ^ u64::from(std::process::id())).next_u64() % 1_000_000
    });
    let mut rng = Rng::new(seed);
    let (planned, kills) = schedule::draw(&budget, &sources, &mut rng);
    if !args.json {
        eprintln!(
            "outbox-lab soak: seed {seed}, {:?} of load, {} faults and {} relay kills planned",
            budget.duration,
            planned.len(),
            kills.len()
        );
    }

    // The servers: the run's own (the faults stop them) or the given ones.
    let (pg, pg_url) = match &db.url {
        Some(url) => (None, url.clone()),
        None => {
            let settings = outbox_testkit::PgSettings::default()
                .set("wal_level", "logical")
                // A frozen or killed reader's slot is free again soon.
                .set("wal_sender_timeout", "5s");
            let pg = outbox_testkit::Postgres::start_with(settings)
                .await
                .context("starting a throwaway PostgreSQL")?;
            let url = pg.url("postgres");
            (Some(pg), url)
        }
    };
    let pg_config = parse_pg_url(&pg_url, db.connect_timeout)?;
    let (redis, redis_url) = match &args.sink {
        Some(url) => (None, url.clone()),
        None => {
            let r = outbox_testkit::Redis::start_persistent()
                .await
                .context("starting a throwaway redis-server")?;
            let url = r.url();
            (Some(r), url)
        }
    };
    let mut db_client = connect(&pg_config).await?;
    prepare(&mut db_client, &sources, &redis_url).await?;
    let version: String = db_client.query_one("SHOW server_version", &[]).await?.get(0);
    let setup = format!(
        "PostgreSQL {version}{}; {} cores; {:?} of writes at {rate} events/s into {}; {} polling relays \
         (partition order, `payments` strict, batch {}, lease {} s){}; consumers behind the inbox; \
         seed {seed}",
        if pg.is_some() {
            " (throwaway, fsync=off)"
        } else {
            ""
        },
        std::thread::available_parallelism().map_or(0, usize::from),
        budget.duration,
        sources.iter().map(|s| s.name()).collect::<Vec<_>>().join(" + "),
        if sources.contains(&Src::Poll) {
            args.relays
        } else {
            0
        },
        args.batch_size,
        fleet::LEASE_TIMEOUT.as_secs(),
        if sources.contains(&Src::Wal) {
            ", a WAL reader and a standby (window 5000)"
        } else {
            ""
        },
    );

    let started = Instant::now();
    let fleet = Arc::new(Fleet::new(
        pg_url.clone(),
        redis_url.clone(),
        args.batch_size,
        args.relays,
        &sources,
        started,
    ));
    fleet.start_all().await?;

    let writers = Arc::new(Writers::new(pg_config.clone(), pg_url.clone()));
    let per_writer = f64::from(rate) / (sources.len() as f64 * f64::from(WRITERS));
    let mut writing = tokio::task::JoinSet::new();
    for &src in &sources {
        for i in 0..WRITERS {
            writing.spawn(writers.clone().writer(src, i, per_writer, rng.fork()));
        }
    }
    let sampling_stop = CancellationToken::new();
    let sampler = tokio::spawn(timeline::sample(
        pg_config.clone(),
        sources.clone(),
        started,
        sampling_stop.clone(),
    ));

    let chaos = Arc::new(Chaos::new(
        fleet.clone(),
        writers.clone(),
        pg,
        redis,
        pg_config.clone(),
        pg_url.clone(),
        started,
        sources.clone(),
    ));
    let stop_faults = CancellationToken::new();
    let killing = tokio::spawn(chaos.clone().kills(kills, stop_faults.clone()));
    let faulting = tokio::spawn(chaos.clone().faults(planned, rng.fork(), stop_faults.clone()));

    let progress = progress_bar(
        budget.duration.as_secs(),
        "{spinner} {msg:<28} [{bar:30}] {pos}/{len} s {elapsed}",
    )?;
    if args.json {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    progress.set_message("writing, faults striking");
    while started.elapsed() < budget.duration {
        tokio::time::sleep(Duration::from_millis(500)).await;
        progress.set_position(started.elapsed().as_secs().min(budget.duration.as_secs()));
    }
    writers.stop.cancel();
    stop_faults.cancel();
    progress.set_message("last faults settling");
    while writing.join_next().await.is_some() {}
    killing.await.context("the relay kills")?;
    faulting.await.context("the faults")?;

    progress.set_message("draining");
    fleet.all_running().await?;
    let drained = drain(&pg_config, &sources).await;
    if let Err(e) = &drained {
        tracing::warn!(error = %format!("{e:#}"), "soak: the drain did not finish");
    }

    // No relay may add a late repeat the checks would not see.
    fleet.stop_relays().await;
    progress.set_message("reading the deliveries");
    let (streams, distinct) = deliveries(&redis_url, &sources).await?;
    progress.set_message("waiting for the consumers");
    let db_client = connect(&pg_config).await?;
    let consumed = wait_until("the consumers to apply every delivered event", async || {
        let applied = check::applied(&db_client).await?;
        Ok(distinct
            .iter()
            .all(|(stream, n)| applied.get(stream).is_some_and(|(_, d)| *d as u64 >= *n)))
    })
    .await;
    if let Err(e) = &consumed {
        tracing::warn!(error = %format!("{e:#}"), "soak: the consumers did not catch up");
    }
    sampling_stop.cancel();
    let samples = sampler.await.context("the sampler")?;
    fleet.stop_all().await;
    progress.finish_and_clear();

    let ledger = check::ledger(&db_client).await?;
    let records = chaos.records();
    let bounds = Bounds {
        batch: u64::from(args.batch_size),
        relays: u64::from(args.relays),
        wal_window: WAL_WINDOW.max(u64::from(budget.big_events)),
    };
    let applied = check::applied(&db_client).await?;
    let mut source_checks = Vec::new();
    let mut inbox = Vec::new();
    let mut per_second = std::collections::BTreeMap::new();
    let epoch_ms = unix_ms() - started.elapsed().as_millis() as i64;
    for &src in &sources {
        let s = &streams[&src];
        source_checks.push(check::check_source(&db_client, src, s, &ledger, &records, &bounds).await?);
        inbox.push(check::inbox(src, &distinct, &applied));
        let mut seen = std::collections::HashSet::new();
        let mut points: Vec<(f64, Option<f64>)> = s
            .iter()
            .flatten()
            .map(|d| {
                let first = seen.insert(d.event_id);
                (
                    (d.ms - epoch_ms) as f64 / 1000.0,
                    first.then_some((d.ms - d.written_ms) as f64),
                )
            })
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        per_second.insert(src.name().to_owned(), output::per_second(&points));
    }
    let mut report = Report {
        seed,
        setup,
        started_ms: epoch_ms,
        errors: fleet.errors(),
        seconds: started.elapsed().as_secs_f64(),
        written: writers.stats.snapshot(),
        faults: records,
        skipped: chaos.skipped(),
        sources: source_checks,
        inbox,
        exits: fleet.exits(),
        drained: drained.is_ok() && consumed.is_ok(),
        samples,
        per_second,
        passed: false,
    };
    report.passed = report.checks().iter().all(|c| c.holds);

    if db.url.is_some() {
        cleanup(&db_client, &sources).await?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    if let Some(path) = &args.report {
        let page = crate::report::html("outbox-lab soak", &[report.outcome().await?], &report.setup);
        tokio::fs::write(path, page)
            .await
            .with_context(|| format!("writing the report to {}", path.display()))?;
        if !args.json {
            println!("report: {}", path.display());
        }
    }
    if !report.passed {
        let failed: Vec<String> = report
            .checks()
            .into_iter()
            .filter(|c| !c.holds)
            .map(|c| format!("{} = {}", c.measure, c.value))
            .collect();
        bail!(
            "{} soak check(s) failed (seed {seed}): {}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(())
}

pub(crate) fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Every stream's entries, by source, and the distinct events per stream.
#[allow(clippy::type_complexity)]
async fn deliveries(
    redis_url: &str,
    sources: &[Src],
) -> anyhow::Result<(HashMap<Src, Vec<Vec<check::Delivery>>>, HashMap<String, u64>)> {
    let mut redis = redis::Client::open(redis_url)?
        .get_multiplexed_async_connection()
        .await
        .context("connecting to Redis")?;
    let mut streams: HashMap<Src, Vec<Vec<check::Delivery>>> = HashMap::new();
    let mut distinct = HashMap::new();
    for &src in sources {
        for ty in names::TYPES {
            let stream = names::stream(src, ty);
            let entries = check::read_stream(&mut redis, &stream).await?;
            let ids: std::collections::HashSet<_> = entries.iter().map(|d| d.event_id).collect();
            distinct.insert(stream, ids.len() as u64);
            streams.entry(src).or_default().push(entries);
        }
    }
    Ok((streams, distinct))
}

/// A fresh schema: both outboxes, the WAL source's slot and publication,
/// the inbox, the ledger and the side effects; and no soak streams left in
/// Redis from an earlier run.
async fn prepare(db: &mut Client, sources: &[Src], redis_url: &str) -> anyhow::Result<()> {
    cleanup(db, sources).await?;
    db.batch_execute(&format!("CREATE SCHEMA {SCHEMA}")).await?;
    for src in [Src::Poll, Src::Wal] {
        outbox::migrate(db, &names::config(src)?).await?;
    }
    if sources.contains(&Src::Wal) {
        outbox::wal::migrate_wal(db, &names::config(Src::Wal)?).await?;
    }
    outbox::migrate_inbox(db, &InboxConfig::new(SCHEMA, "processed_events")?).await?;
    db.batch_execute(writers::TABLES).await?;
    let mut redis = redis::Client::open(redis_url)?
        .get_multiplexed_async_connection()
        .await
        .context("connecting to Redis")?;
    for src in [Src::Poll, Src::Wal] {
        for ty in names::TYPES {
            let _: i64 = redis::cmd("DEL")
                .arg(names::stream(src, ty))
                .query_async(&mut redis)
                .await?;
        }
    }
    Ok(())
}

/// Drops the WAL source's slot and publication, and the schema.
async fn cleanup(db: &Client, sources: &[Src]) -> anyhow::Result<()> {
    let config = names::config(Src::Wal)?;
    let slot = config.wal_slot()?;
    if sources.contains(&Src::Wal)
        || db
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .is_some()
    {
        wait_until("the WAL relays to let go of the slot", async || {
            Ok(db
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&slot],
                )
                .await?
                .is_none())
        })
        .await?;
        db.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    }
    db.batch_execute(&format!(
        "DROP PUBLICATION IF EXISTS {}; DROP SCHEMA IF EXISTS {SCHEMA} CASCADE",
        config.wal_publication()?.quoted()
    ))
    .await?;
    Ok(())
}

/// Waits until nothing is left to deliver: no row waiting in either
/// outbox, and the slot confirmed past the WAL written before the drain
/// (emitted events have no row).
async fn drain(pg: &outbox_relay::pg::PgConfig, sources: &[Src]) -> anyhow::Result<()> {
    let db = connect(pg).await?;
    let lsn: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let slot = names::config(Src::Wal)?.wal_slot()?;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let mut waiting = 0i64;
        for &src in sources {
            waiting += db.query_one(&names::waiting(src), &[]).await?.get::<_, i64>(0);
        }
        if sources.contains(&Src::Wal) {
            let confirmed: bool = db.query_one(names::CONFIRMED, &[&slot, &lsn]).await?.get(0);
            waiting += i64::from(!confirmed);
        }
        if waiting == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{waiting} rows (or the slot) still waiting after 180 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
