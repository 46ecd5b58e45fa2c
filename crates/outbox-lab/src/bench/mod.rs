//! `outbox bench`: how the relay performs on this machine, each figure next
//! to a baseline measured in the same run, so the figures are ratios.
//!
//! Phases (`--phases`):
//! 1. throughput: N pre-inserted events drained by the relay, by the floor
//!    (claim and mark with no sink) and by the naive per-row relay, per batch
//!    size, with duplicates, distinct deliveries and the relay's peak RSS;
//! 2. latency: commit to consumer receipt at a steady write rate, NOTIFY vs
//!    polling;
//! 3. idle: transactions per second of a relay with nothing to do, NOTIFY vs
//!    polling;
//! 4. writer: commit rate of `enqueue` and `enqueue_all`.
//!
//! Without `DATABASE_URL` it starts a throwaway PostgreSQL and redis-server
//! (the testkit's: `fsync=off`, so commits are cheaper than on a durable
//! server; the report says so). With `DATABASE_URL` it works in a scratch
//! schema `outbox_bench`, dropped at the end. The relay runs as its own
//! process (this binary's `relay` command), so its memory is its own.
//!
//! This module also holds the bench's part of the shared scratch: its
//! schema, its one Redis stream, and bulk fills.

mod idle;
mod latency;
mod naive_sql;
mod results;
pub(crate) mod throughput;
mod writer;

use std::time::Duration;

use outbox::Event;
use redis::AsyncCommands;
use serde_json::json;

use crate::latency::Wakeup;
use crate::scratch::{Postgres, Scratch, progress_bar};
use crate::{ConfigError, Database};
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

/// `outbox bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Events per drain.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub events: u32,
    /// Batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,1000",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
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
    /// Phases to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "throughput,latency,idle,writer")]
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
}

/// A part of `outbox bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// Drain N events at each batch size: relay, floor, naive.
    Throughput,
    /// Commit-to-consumer latency, NOTIFY and polling.
    Latency,
    /// Transactions per second of an idle relay.
    Idle,
    /// Commit rate of the writer API.
    Writer,
}

/// What to measure, after `--quick` is applied.
struct Plan {
    events: usize,
    reps: usize,
    batch_sizes: Vec<u32>,
    rate: u32,
    latency_seconds: f64,
    idle_seconds: f64,
    writer_transactions: usize,
    poll: Wakeup,
}

impl Plan {
    fn new(args: &BenchArgs) -> Self {
        let poll = Wakeup::Poll {
            interval_ms: args.poll_interval.as_millis().max(1) as u64,
        };
        if args.quick {
            return Self {
                events: 300,
                reps: 1,
                batch_sizes: vec![1, 10, 100],
                rate: 100,
                latency_seconds: 1.0,
                idle_seconds: 1.0,
                writer_transactions: 50,
                poll: Wakeup::Poll { interval_ms: 100 },
            };
        }
        Self {
            events: args.events as usize,
            reps: args.reps as usize,
            batch_sizes: args.batch_sizes.clone(),
            rate: args.rate,
            latency_seconds: args.latency_duration.as_secs_f64(),
            idle_seconds: args.idle_duration.as_secs_f64(),
            writer_transactions: args.writer_transactions as usize,
            poll,
        }
    }

    fn steps(&self, phases: &[Phase]) -> u64 {
        let per_phase = |p: &Phase| match p {
            Phase::Throughput => 3 * self.batch_sizes.len(),
            Phase::Latency | Phase::Idle => 2,
            Phase::Writer => Shape::ALL.len(),
        };
        (phases.iter().map(per_phase).sum::<usize>() * self.reps) as u64
    }
}

/// Runs `outbox bench`: the phases, then the report; fails (exit 1) only
/// if a run lost or duplicated an event, never for speed.
pub async fn run(db: &Database, args: BenchArgs) -> anyhow::Result<()> {
    let plan = Plan::new(&args);
    let mut phases = args.phases.clone();
    phases.dedup();
    if let Some(url) = &args.redis_url
        && !(url.starts_with("redis://") || url.starts_with("rediss://"))
    {
        return Err(ConfigError(format!(
            "the bench delivers to Redis Streams, so OUTBOX_SINK must be a redis:// URL, not {url:?}"
        ))
        .into());
    }
    let pg = Postgres::start(db).await?;
    let throwaway_pg = pg.is_throwaway();
    let mut scratch = Scratch::bench(pg.config.clone(), pg.url.clone(), args.redis_url.clone()).await?;

    let progress = progress_bar(plan.steps(&phases), "{spinner} {msg:<48} [{bar:30}] {pos}/{len}")?;
    let mut report = Report::new(plan.events, plan.reps, throwaway_pg);
    let reps = plan.reps;
    for phase in &phases {
        match phase {
            Phase::Throughput => {
                for &batch in &plan.batch_sizes {
                    for strategy in [Strategy::Relay, Strategy::Floor, Strategy::Naive] {
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
                for wakeup in [Wakeup::Notify, plan.poll] {
                    let mut runs = Vec::with_capacity(reps);
                    for rep in 1..=reps {
                        progress.set_message(format!("latency, {} rep {rep}/{reps}", wakeup.label()));
                        runs.push(
                            latency::measure(&mut scratch, wakeup, plan.rate, plan.latency_seconds).await?,
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
                        runs.push(idle::measure(&mut scratch, wakeup, plan.idle_seconds).await?);
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
                        runs.push(writer::measure(&mut scratch, shape, transactions).await?);
                        progress.inc(1);
                    }
                    report.add_writer(shape, runs);
                }
            }
        }
    }
    progress.finish_and_clear();
    scratch.drop_all().await?;

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    report.check()
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

    /// Drops the bench's schema and its stream.
    pub(crate) async fn drop_all(&mut self) -> anyhow::Result<()> {
        self.drop_schema().await?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    /// Empties the table and the stream.
    async fn clear(&mut self) -> anyhow::Result<()> {
        let t = self.table();
        // Separate calls: VACUUM cannot run in the implicit transaction of a
        // multi-statement string.
        self.db.batch_execute(&format!("TRUNCATE {t}")).await?;
        self.db.batch_execute(&format!("VACUUM ANALYZE {t}")).await?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    /// Empties the table and the stream, then inserts `n` events.
    async fn fill(&mut self, n: usize) -> anyhow::Result<()> {
        self.clear().await?;
        let events: Vec<Event> = (0..n).map(event).collect();
        self.insert(&events).await
    }

    /// Starts `outbox relay` to the bench's stream with `args`, and returns
    /// once it is ready.
    async fn spawn_bench_relay(&mut self, args: &[&str]) -> anyhow::Result<outbox_testkit::Spawned> {
        let sink = self.redis_url().await?;
        let args: Vec<&str> = ["--stream-prefix", STREAM_PREFIX]
            .iter()
            .chain(args)
            .copied()
            .collect();
        self.spawn_relay(&sink, &args, &[]).await
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
