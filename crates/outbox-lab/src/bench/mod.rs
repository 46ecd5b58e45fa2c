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

mod idle;
pub(crate) mod latency;
mod report;
pub(crate) mod scratch;
pub(crate) mod throughput;
mod writer;

use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_testkit::Redis;

use crate::cli::{BenchArgs, Global, Phase};
use crate::exit::ConfigError;
use latency::Wakeup;
use report::Report;
use scratch::Scratch;
use throughput::Strategy;
use writer::Shape;

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

pub(crate) async fn run(g: &Global, args: BenchArgs) -> anyhow::Result<()> {
    let plan = Plan::new(&args);
    let mut phases = args.phases.clone();
    phases.dedup();
    let (pg_url, _postgres) = super::database_or_throwaway(g).await?;
    let throwaway_pg = _postgres.is_some();
    let mut _redis = None;
    let redis_url = match &args.redis_url {
        Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => url.clone(),
        Some(url) => {
            return Err(ConfigError(format!(
                "the bench delivers to Redis Streams, so OUTBOX_SINK must be a redis:// URL, not {url:?}"
            ))
            .into());
        }
        None => {
            let redis = Redis::start()
                .await
                .context("starting a throwaway redis-server")?;
            let url = redis.url();
            _redis = Some(redis);
            url
        }
    };
    let pg = super::parse_pg_url(&pg_url, g)?;
    let mut scratch = Scratch::new(pg, pg_url.clone(), redis_url).await?;

    let progress = ProgressBar::new(plan.steps(&phases)).with_style(
        ProgressStyle::with_template("{spinner} {msg:<48} [{bar:30}] {pos}/{len}")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(120));
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
