//! `outbox-lab bench`: how the relay performs on this machine, each figure next
//! to a baseline measured in the same run, so the figures are ratios.
//!
//! Phases (`--phases`):
//! 1. throughput: N pre-written events drained by the relay, by the floor
//!    (claim and mark with no sink) and by the naive per-row relay, per batch
//!    size, with duplicates, distinct deliveries, the relay's peak RSS, and
//!    PostgreSQL's CPU and WAL for writing and draining them;
//! 2. latency: commit to consumer receipt at a steady write rate, NOTIFY vs
//!    polling;
//! 3. idle: transactions per second of a relay with nothing to do, NOTIFY vs
//!    polling;
//! 4. writer: commit rate of `enqueue` and `enqueue_all`;
//! 5. pooled (`pooled.rs`): throughput direct, through PgBouncer in session
//!    mode and in transaction mode (`--pooler transaction`), and latency
//!    through the transaction pool, polling or with `--listen-url`; not in
//!    the default phases.
//!
//! `--source wal` measures log tailing (`relay --source wal`) beside the
//! polling relay instead: throughput of polling vs the WAL source vs the
//! WAL source with emitted events, latency NOTIFY vs WAL, and two phases of
//! its own, dead-tuples (what N delivered events leave for vacuum) and
//! outage (the WAL a slot retains while the sink is down, and the
//! catch-up), then the targets beside the figures.
//!
//! 7. held-snapshot (`--phases held-snapshot`, either source, not run by
//!    default): chunk after chunk drained by a running relay, polling and
//!    WAL source, clean and while another session holds a `REPEATABLE
//!    READ` snapshot for the whole run.
//! 8. fleet (`fleet.rs`, `--phases fleet`, not run by default): one `outbox
//!    relay --schemas` process serving `--tenants` outboxes in a scratch
//!    database of its own: its connections, idle cost beside a single
//!    relay's, latency at 1 event/s per tenant, and throughput of a backlog
//!    in every tenant beside a single relay draining as many from one
//!    outbox, each beside the target.
//!
//! Without `DATABASE_URL` it starts a throwaway PostgreSQL and redis-server
//! (the testkit's: `fsync=off`, so commits are cheaper than on a durable
//! server; the report says so; `wal_level = logical` with `--source wal`).
//! With `DATABASE_URL` it works in a scratch schema `outbox_bench`, dropped
//! at the end, with its replication slot. The relay runs as its own process
//! (`outbox relay`, the production binary), so its memory is its own.
//!
//! This module also holds the bench's part of the shared scratch: its
//! schema, its one Redis stream, and bulk fills.

mod cost;
pub(crate) mod dead_tuples;
mod fleet;
mod fleet_results;
pub(crate) mod held_snapshot;
mod idle;
mod latency;
mod naive_sql;
pub(crate) mod outage;
mod pooled;
mod results;
mod slot;
pub(crate) mod throughput;
mod wal_results;
mod writer;

use std::time::Duration;

use outbox::Event;
use redis::AsyncCommands;
use serde::Serialize;
use serde_json::json;

use crate::latency::Wakeup;
use crate::scratch::{Postgres, Scratch, outbox_bin, progress_bar};
use crate::{ConfigError, Database};
use latency::Clock;
use results::Report;
use throughput::Strategy;
use writer::Shape;

const SCHEMA: &str = "outbox_bench";
const CHANNEL: &str = "outbox_bench_new";
const STREAM_PREFIX: &str = "outbox_bench.event";
/// Every bench event is an `orders` event, so this is the one stream.
const STREAM: &str = "outbox_bench.event.orders";
/// Distinct aggregates the bench's events are spread over, interleaved.
const AGGREGATES: usize = 500;

/// `outbox-lab bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// What to measure: `poll`, the polling relay against its baselines;
    /// `wal`, log tailing (`relay --source wal`) beside the polling relay.
    #[arg(long, value_enum, default_value = "poll")]
    pub source: Measured,
    /// Events per drain.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub events: u32,
    /// Batch sizes to measure, comma-separated [default: 1,10,100,1000;
    /// with --source wal: 100].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_sizes: Vec<u32>,
    /// Repetitions of each figure (reported as median [min–max]).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub reps: u32,
    /// A few hundred events, one repetition: checks the bench itself.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Redis to deliver to (redis://…); without it the bench starts its own.
    #[arg(long = "sink", env = "OUTBOX_SINK")]
    pub redis_url: Option<String>,
    /// Phases to run, comma-separated [default: throughput,latency,idle,writer;
    /// with --source wal: throughput,latency,dead-tuples,outage].
    #[arg(long, value_delimiter = ',')]
    pub phases: Vec<Phase>,
    /// Events per second the latency phase writes.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub rate: u32,
    /// How long the latency phase writes.
    #[arg(long, default_value = "10s", value_parser = crate::positive_duration)]
    pub latency_duration: Duration,
    /// The polling relay's interval in the latency and idle phases.
    #[arg(long, default_value = "1s", value_parser = crate::positive_duration)]
    pub poll_interval: Duration,
    /// How long the idle phase watches an idle relay.
    #[arg(long, default_value = "10s", value_parser = crate::positive_duration)]
    pub idle_duration: Duration,
    /// Events per writer figure (one transaction each for `enqueue`; the
    /// 100-event shapes commit a hundredth as many transactions).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(10..=1_000_000))]
    pub writer_transactions: u32,
    /// Events the dead-tuples phase writes and delivers per strategy.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub dead_tuple_events: u32,
    /// How long the outage phase keeps the sink down.
    #[arg(long, default_value = "60s", value_parser = crate::positive_duration)]
    pub outage: Duration,
    /// Events per second written through the outage phase (transactions
    /// of a hundredth of it, every 10 ms).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub outage_rate: u32,
    /// Chunks the held-snapshot phase drains per run.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub held_snapshot_chunks: u32,
    /// Events per chunk of the held-snapshot phase (one transaction each).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub held_snapshot_events: u32,
    /// Tenant outboxes of the fleet phase [default: 1000; with --quick:
    /// 20].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub tenants: Option<u32>,
    /// How long the fleet phase watches the idle fleet, and writes 1 event
    /// per second to every tenant [with --quick: 2s].
    #[arg(long, default_value = "30s", value_parser = crate::positive_duration)]
    pub fleet_duration: Duration,
    /// Events pre-written in every tenant for the fleet phase's throughput
    /// (the single relay drains as many in all from one outbox) [with
    /// --quick: 10].
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub fleet_backlog: u32,
}

/// What `outbox-lab bench` measures (`--source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Measured {
    /// The polling relay against its baselines (the floor, the naive relay,
    /// polling vs NOTIFY).
    Poll,
    /// Log tailing (`relay --source wal`, table inserts and emitted events)
    /// beside the polling relay, in the same run.
    Wal,
}

/// A part of `outbox-lab bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// Drain N events at each batch size: relay, floor, naive (with
    /// --source wal: polling, WAL source, emit).
    Throughput,
    /// Commit-to-consumer latency, NOTIFY and polling (with --source wal:
    /// NOTIFY and WAL).
    Latency,
    /// Transactions per second of an idle relay.
    Idle,
    /// Commit rate of the writer API.
    Writer,
    /// Dead tuples after N delivered events: polling, WAL source, emit
    /// (--source wal).
    DeadTuples,
    /// Retained WAL during a sink outage and the catch-up after it,
    /// polling and WAL source (--source wal).
    Outage,
    /// Chunks drained by a running relay, polling and WAL source, clean
    /// and with a REPEATABLE READ snapshot held by another session (the
    /// WAL source where wal_level = logical).
    HeldSnapshot,
    /// The relay direct, through PgBouncer in session mode and in
    /// transaction mode: throughput at batch 1 and 100, latency polling or
    /// with --listen-url (the bench's own PostgreSQL only).
    Pooled,
    /// One `outbox relay --schemas` process serving --tenants outboxes
    /// (issue 33): connections, idle cost, latency at 1 event/s per
    /// tenant, throughput beside a single relay; in a scratch database.
    Fleet,
}

impl Phase {
    fn needs_wal(self) -> bool {
        matches!(self, Phase::DeadTuples | Phase::Outage)
    }
}

/// What to measure, after `--quick` is applied.
struct Plan {
    source: Measured,
    events: usize,
    reps: usize,
    batch_sizes: Vec<u32>,
    /// The pooled phase's: `--batch-sizes`, else 1 and 100.
    pooled_batch_sizes: Vec<u32>,
    rate: u32,
    latency_seconds: f64,
    idle_seconds: f64,
    writer_transactions: usize,
    poll: Wakeup,
    dead_tuple_events: usize,
    outage: Duration,
    outage_rate: u32,
    held_chunks: usize,
    held_events: usize,
    fleet: fleet::FleetPlan,
}

impl Plan {
    fn new(args: &BenchArgs) -> Self {
        let poll = Wakeup::Poll {
            interval_ms: args.poll_interval.as_millis().max(1) as u64,
        };
        let pooled_batch_sizes = if args.batch_sizes.is_empty() {
            vec![1, 100]
        } else {
            args.batch_sizes.clone()
        };
        let batch_sizes = match (args.batch_sizes.is_empty(), args.source, args.quick) {
            (false, _, _) => args.batch_sizes.clone(),
            (true, Measured::Wal, _) => vec![100],
            (true, Measured::Poll, true) => vec![1, 10, 100],
            (true, Measured::Poll, false) => vec![1, 10, 100, 1000],
        };
        if args.quick {
            let fleet = fleet::FleetPlan {
                tenants: args.tenants.map_or(20, |n| n as usize),
                window: Duration::from_secs(2),
                backlog: 10,
            };
            return Self {
                source: args.source,
                events: 300,
                reps: 1,
                batch_sizes,
                pooled_batch_sizes,
                rate: 100,
                latency_seconds: 1.0,
                idle_seconds: 1.0,
                writer_transactions: 50,
                poll: Wakeup::Poll { interval_ms: 100 },
                dead_tuple_events: 1000,
                outage: Duration::from_secs(5),
                outage_rate: 500,
                held_chunks: 3,
                held_events: 500,
                fleet,
            };
        }
        Self {
            source: args.source,
            events: args.events as usize,
            reps: args.reps as usize,
            batch_sizes,
            pooled_batch_sizes,
            rate: args.rate,
            latency_seconds: args.latency_duration.as_secs_f64(),
            idle_seconds: args.idle_duration.as_secs_f64(),
            writer_transactions: args.writer_transactions as usize,
            poll,
            dead_tuple_events: args.dead_tuple_events as usize,
            outage: args.outage,
            outage_rate: args.outage_rate,
            held_chunks: args.held_snapshot_chunks as usize,
            held_events: args.held_snapshot_events as usize,
            fleet: fleet::FleetPlan {
                tenants: args.tenants.map_or(1000, |n| n as usize),
                window: args.fleet_duration,
                backlog: args.fleet_backlog as usize,
            },
        }
    }

    /// The throughput phase's strategies.
    fn strategies(&self) -> &'static [Strategy] {
        match self.source {
            Measured::Poll => &[Strategy::Relay, Strategy::Floor, Strategy::Naive],
            Measured::Wal => &[Strategy::Relay, Strategy::Wal, Strategy::Emit],
        }
    }

    /// The latency phase's relays, and where their latencies start.
    fn latency(&self) -> ([Wakeup; 2], Clock) {
        match self.source {
            Measured::Poll => ([Wakeup::Notify, self.poll], Clock::CreatedAt),
            Measured::Wal => ([Wakeup::Notify, Wakeup::Wal], Clock::Sent),
        }
    }

    /// The batch size of the dead-tuples and outage phases: 100 if
    /// measured, else the first one given.
    fn batch(&self) -> u32 {
        if self.batch_sizes.contains(&100) {
            100
        } else {
            self.batch_sizes[0]
        }
    }

    fn steps(&self, phases: &[Phase]) -> u64 {
        let per_phase = |p: &Phase| match p {
            Phase::Throughput => self.strategies().len() * self.batch_sizes.len(),
            Phase::Latency | Phase::Idle | Phase::Outage => 2,
            Phase::Writer => Shape::ALL.len(),
            Phase::DeadTuples => DEAD_TUPLES.len(),
            Phase::HeldSnapshot => held_snapshot::SOURCES.len() * 2,
            Phase::Pooled => {
                POOLED_CLAIMS.len() * pooled::Route::ALL.len() * self.pooled_batch_sizes.len()
                    + pooled::Waking::ALL.len()
            }
            Phase::Fleet => fleet::STEPS,
        };
        (phases.iter().map(per_phase).sum::<usize>() * self.reps) as u64
    }
}

/// The dead-tuples phase's strategies.
const DEAD_TUPLES: [Strategy; 3] = [Strategy::Relay, Strategy::Wal, Strategy::Emit];
/// The outage phase's relays.
const OUTAGE: [Strategy; 2] = [Strategy::Relay, Strategy::Wal];
/// The pooled phase's claim modes.
const POOLED_CLAIMS: [&str; 2] = ["lock", "deadline"];

/// Runs `outbox-lab bench`: the phases, then the report; fails (exit 1) only
/// if a run lost or duplicated an event, never for speed.
pub async fn run(db: &Database, args: BenchArgs) -> anyhow::Result<()> {
    let plan = Plan::new(&args);
    let mut phases = args.phases.clone();
    if phases.is_empty() {
        phases = match args.source {
            Measured::Poll => vec![Phase::Throughput, Phase::Latency, Phase::Idle, Phase::Writer],
            Measured::Wal => vec![
                Phase::Throughput,
                Phase::Latency,
                Phase::DeadTuples,
                Phase::Outage,
            ],
        };
    }
    phases.dedup();
    if let Some(url) = &args.redis_url
        && !(url.starts_with("redis://") || url.starts_with("rediss://"))
    {
        return Err(ConfigError(format!(
            "the bench delivers to Redis Streams, so OUTBOX_SINK must be a redis:// URL, not {url:?}"
        ))
        .into());
    }
    if args.source == Measured::Poll
        && let Some(p) = phases.iter().find(|p| p.needs_wal())
    {
        return Err(ConfigError(format!(
            "--phases {}: that phase measures log tailing; add --source wal",
            clap::ValueEnum::to_possible_value(p).map_or_else(String::new, |v| v.get_name().to_owned())
        ))
        .into());
    }
    if phases.contains(&Phase::Pooled) && db.url.is_some() {
        return Err(ConfigError(
            "--phases pooled puts PgBouncer in front of the bench's own throwaway PostgreSQL: run it \
             without DATABASE_URL"
                .to_owned(),
        )
        .into());
    }
    // The relays are `outbox`'s: a missing binary is told before anything starts.
    outbox_bin()?;
    // The held-snapshot phase runs the WAL source whatever `--source` says.
    let logical = plan.source == Measured::Wal || phases.contains(&Phase::HeldSnapshot);
    let pg = Postgres::start(db, logical).await?;
    let throwaway_pg = pg.is_throwaway();
    let mut scratch = Scratch::bench(pg.config.clone(), pg.url.clone(), args.redis_url.clone()).await?;

    let progress = progress_bar(plan.steps(&phases), "{spinner} {msg:<48} [{bar:30}] {pos}/{len}")?;
    if args.json {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut report = Report::new(plan.source, plan.events, plan.reps, throwaway_pg);
    let measured = measure(&mut scratch, &pg, &plan, &phases, &progress, &mut report).await;
    progress.finish_and_clear();
    // The slot goes also when a phase failed: it would keep WAL forever.
    let dropped = scratch.drop_all().await;
    measured?;
    dropped?;
    if plan.source == Measured::Wal {
        report.set_targets();
    }

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    report.check()
}

/// Runs the phases into `report`.
async fn measure(
    scratch: &mut Scratch,
    pg: &Postgres,
    plan: &Plan,
    phases: &[Phase],
    progress: &indicatif::ProgressBar,
    report: &mut Report,
) -> anyhow::Result<()> {
    let reps = plan.reps;
    for phase in phases {
        match phase {
            Phase::Throughput => {
                for &batch in &plan.batch_sizes {
                    for &strategy in plan.strategies() {
                        let mut runs = Vec::with_capacity(reps);
                        for rep in 1..=reps {
                            progress
                                .set_message(format!("{} batch {batch} rep {rep}/{reps}", strategy.label()));
                            runs.push(scratch.drain(strategy, plan.events, batch).await?);
                            progress.inc(1);
                        }
                        report.add_throughput(strategy, batch, runs);
                    }
                }
            }
            Phase::Latency => {
                let (wakeups, clock) = plan.latency();
                for wakeup in wakeups {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("latency, {} rep {rep}/{reps}", wakeup.label()));
                        runs.push(
                            latency::measure(scratch, wakeup, plan.rate, plan.latency_seconds, clock).await?,
                        );
                        progress.inc(1);
                    }
                    report.add_latency(wakeup, plan.rate, runs);
                }
            }
            Phase::Idle => {
                for wakeup in [Wakeup::Notify, Wakeup::Poll { interval_ms: 1000 }] {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("idle, {} rep {rep}/{reps}", wakeup.label()));
                        runs.push(idle::measure(scratch, wakeup, plan.idle_seconds).await?);
                        progress.inc(1);
                    }
                    report.add_idle(wakeup, runs);
                }
            }
            Phase::Writer => {
                for shape in Shape::ALL {
                    let transactions = (plan.writer_transactions / shape.events_per_tx()).max(5);
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("writer, {} rep {rep}/{reps}", shape.label()));
                        runs.push(writer::measure(scratch, shape, transactions).await?);
                        progress.inc(1);
                    }
                    report.add_writer(shape, runs);
                }
            }
            Phase::DeadTuples => {
                for strategy in DEAD_TUPLES {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("dead tuples, {} rep {rep}/{reps}", strategy.label()));
                        runs.push(
                            dead_tuples::measure(scratch, strategy, plan.dead_tuple_events, plan.batch())
                                .await?,
                        );
                        progress.inc(1);
                    }
                    report.add_dead_tuples(strategy, runs);
                }
            }
            Phase::Pooled => {
                let throwaway = pg.throwaway().ok_or_else(|| {
                    ConfigError("--phases pooled needs the bench's own PostgreSQL".to_owned())
                })?;
                let pools = pooled::Pools::start(throwaway, &pg.url).await?;
                for &batch in &plan.pooled_batch_sizes {
                    for claim in POOLED_CLAIMS {
                        for route in pooled::Route::ALL {
                            let mut runs = Vec::with_capacity(reps);
                            for rep in 1..=reps {
                                progress.set_message(format!(
                                    "{}, {claim}, batch {batch} rep {rep}/{reps}",
                                    route.label()
                                ));
                                runs.push(
                                    pooled::drain(scratch, &pools, route, claim, plan.events, batch).await?,
                                );
                                progress.inc(1);
                            }
                            report.add_pooled(pooled::PooledRow::new(route, claim, batch, plan.events, runs));
                        }
                    }
                }
                for waking in pooled::Waking::ALL {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("latency, {} rep {rep}/{reps}", waking.label()));
                        runs.push(
                            pooled::latency(scratch, &pools, waking, plan.rate, plan.latency_seconds).await?,
                        );
                        progress.inc(1);
                    }
                    report.add_pooled_latency(pooled::PooledLatencyRow::new(waking, plan.rate, runs));
                }
            }
            Phase::Outage => {
                for strategy in OUTAGE {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("outage, {} rep {rep}/{reps}", strategy.label()));
                        runs.push(
                            outage::measure(scratch, strategy, plan.outage, plan.outage_rate, plan.batch())
                                .await?,
                        );
                        progress.inc(1);
                    }
                    report.add_outage(strategy, runs);
                }
            }
            Phase::Fleet => {
                let f = &plan.fleet;
                let runs = fleet::measure(scratch, f, reps, progress).await?;
                report.add_fleet(fleet_results::FleetRow::new(
                    f.tenants,
                    f.window.as_secs_f64(),
                    f.backlog,
                    runs,
                ));
            }
            Phase::HeldSnapshot => {
                let logical = held_snapshot::logical(scratch).await?;
                for strategy in held_snapshot::SOURCES {
                    for held in [false, true] {
                        if strategy.reads_wal() && !logical {
                            progress.inc(reps as u64);
                            continue;
                        }
                        let what = if held { "held" } else { "clean" };
                        let mut runs = Vec::with_capacity(reps);
                        for rep in 1..=reps {
                            progress.set_message(format!(
                                "held snapshot, {} {what} rep {rep}/{reps}",
                                strategy.label()
                            ));
                            runs.push(
                                held_snapshot::measure(
                                    scratch,
                                    strategy,
                                    held,
                                    plan.held_chunks,
                                    plan.held_events,
                                    plan.batch(),
                                )
                                .await?,
                            );
                            progress.inc(1);
                        }
                        report.add_held_snapshot(strategy, held, plan.batch(), runs);
                    }
                }
                report.wal_level_logical = logical;
            }
        }
    }
    Ok(())
}

impl Scratch {
    /// The bench's scratch: schema `outbox_bench` with a fresh outbox, its
    /// own NOTIFY channel and Redis stream, and a running Redis.
    pub(crate) async fn bench(
        pg: outbox_relay::pg::PgConfig,
        pg_url: String,
        redis_url: Option<String>,
    ) -> anyhow::Result<Self> {
        let mut scratch = Scratch::new(pg, pg_url, SCHEMA, CHANNEL, redis_url, false).await?;
        scratch.redis_url().await?;
        scratch.reset_outbox().await?;
        Ok(scratch)
    }

    /// Drops the bench's replication slot and publication, its schema and
    /// its stream.
    pub(crate) async fn drop_all(&mut self) -> anyhow::Result<()> {
        self.drop_wal().await?;
        self.drop_schema().await?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    /// Empties the table and the stream.
    pub(crate) async fn clear(&mut self) -> anyhow::Result<()> {
        let t = self.table();
        // Separate calls: VACUUM cannot run in the implicit transaction of a
        // multi-statement string.
        self.db.batch_execute(&format!("TRUNCATE {t}")).await?;
        self.db.batch_execute(&format!("VACUUM ANALYZE {t}")).await?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    /// Starts `outbox relay` to the bench's stream with `args`, and returns
    /// once it is ready.
    async fn spawn_bench_relay(&mut self, args: &[&str]) -> anyhow::Result<outbox_testkit::Spawned> {
        let sink = self.redis_url().await?;
        self.spawn_bench_relay_to(&sink, args).await
    }

    /// [`Scratch::spawn_bench_relay`] on another connection string (the
    /// same database through a pooler).
    async fn spawn_bench_relay_on(
        &mut self,
        pg_url: &str,
        args: &[&str],
    ) -> anyhow::Result<outbox_testkit::Spawned> {
        let sink = self.redis_url().await?;
        let args: Vec<&str> = ["--stream-prefix", STREAM_PREFIX]
            .iter()
            .chain(args)
            .copied()
            .collect();
        self.spawn_relay_on(pg_url, &sink, &args, &[]).await
    }

    /// [`Scratch::spawn_bench_relay`] to the bench's stream on another Redis.
    async fn spawn_bench_relay_to(
        &self,
        sink: &str,
        args: &[&str],
    ) -> anyhow::Result<outbox_testkit::Spawned> {
        let args: Vec<&str> = ["--stream-prefix", STREAM_PREFIX]
            .iter()
            .chain(args)
            .copied()
            .collect();
        self.spawn_relay(sink, &args, &[]).await
    }
}

/// The `i`-th bench event: `orders` aggregates interleaved, a small payload.
fn event(i: usize) -> Event {
    Event::new(
        "orders",
        (i % AGGREGATES).to_string(),
        "OrderPlaced",
        json!({"n": i}),
    )
}
