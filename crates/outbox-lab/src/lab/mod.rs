//! `outbox-lab lab`: the reference design's experiments, reproduced on this
//! machine, each figure printed beside the reference's.
//!
//! Each experiment is one module that reads as a story: what it breaks, what
//! it shows. It rebuilds the scratch schema (the shared `scratch.rs`, with
//! the shop's tables of `shop.rs`), runs real processes (the relay, the shop
//! app of `app.rs`) against a real HTTP receiver (the testkit's), and returns
//! an `Outcome` (of `report.rs`): a table `measure | ours | reference |
//! verdict`, logs and plots.
//!
//! Without `DATABASE_URL` it starts a throwaway PostgreSQL (the testkit's,
//! `fsync=off`; `wal_level = logical` when `wal` runs); with it, it works in
//! schema `outbox_lab`, dropped at the end.
//!
//! Exit code: 1 if any correctness verdict failed (a lost event, a duplicate
//! side effect behind the inbox, a row left behind by a rollback); timings
//! are reported, never judged. 2 for an unknown experiment name.

mod app;
mod batch_size;
mod cleanup;
mod crash_before_mark;
mod dual_write;
mod idle;
mod index;
mod latency;
mod ordering;
mod redis_group;
mod retry;
mod rollback;
mod shop;
mod slow_sink;
mod wal;
mod watermark;

use std::time::Instant;

use anyhow::{Context, bail};

use crate::report::{self, Outcome};
use crate::scratch::{Postgres, Scratch, outbox_bin, progress_bar};
use crate::{ConfigError, Database};

/// `outbox-lab lab`'s arguments.
#[derive(Debug, clap::Args)]
pub struct LabArgs {
    /// `list`, `all`, or experiment names (see `outbox-lab lab list`).
    #[arg(default_value = "list")]
    pub experiments: Vec<String>,
    /// Smaller sizes, for CI.
    #[arg(long)]
    pub quick: bool,
    /// Also write a self-contained HTML report (tables and SVG plots) here.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Internal: run one step of the lab's order-placing application (a
    /// child process the lab may kill -9), e.g. `naive:crash-after-commit`.
    #[arg(long, hide = true, requires = "app_sink")]
    pub app: Option<String>,
    /// Internal: where the application's naive POST goes.
    #[arg(long, hide = true)]
    pub app_sink: Option<String>,
}

/// Every experiment, in the order `all` runs them, with a one-line summary.
const EXPERIMENTS: [(&str, &str); 14] = [
    (
        "dual-write",
        "commit-then-POST under five failure paths vs the outbox: ghost and missing shipments",
    ),
    (
        "rollback",
        "ROLLBACK and a writer killed before COMMIT leave no order and no event",
    ),
    (
        "crash-before-mark",
        "relay killed after the sink acked 3 of 5: redelivery, and the inbox ships once",
    ),
    (
        "retry",
        "receiver answers 500 three times: attempt log, backoff, dead letter and requeue",
    ),
    (
        "watermark",
        "an `id > last_seen` relay loses an event of an interleaved transaction; ours does not",
    ),
    (
        "latency",
        "polling at 1000/200/100 ms vs NOTIFY: p50/p99/max and a CDF plot",
    ),
    (
        "idle",
        "transactions an idle relay commits per 10 s, polling vs NOTIFY",
    ),
    (
        "batch-size",
        "events/s at batch 1/10/100/1000, and re-sends after a crash per batch size",
    ),
    (
        "index",
        "EXPLAIN (ANALYZE, BUFFERS) of the claim with and without the partial index",
    ),
    (
        "ordering",
        "300 orders × 3 events, 1/2/4 relays, none/partition/strict, and one failure",
    ),
    (
        "cleanup",
        "DELETE of published rows (size, dead tuples) vs DETACH + DROP of a daily partition",
    ),
    (
        "redis-group",
        "a Redis consumer dies before XACK: pending, XAUTOCLAIM, the inbox ships once",
    ),
    (
        "wal",
        "log tailing vs polling: events/s, WAL per event, dead tuples, retained WAL in a sink outage",
    ),
    (
        "slow-sink",
        "a 2 s receiver, --claim lock vs lease: oldest relay transaction, VACUUM of an unrelated table",
    ),
];

/// Runs `outbox-lab lab`: lists the experiments, runs the named ones, or (with
/// `--app`) is one step of the shop application an experiment started.
pub async fn run(db: &Database, args: LabArgs) -> anyhow::Result<()> {
    if let Some(spec) = &args.app {
        // `requires = "app_sink"` in the flag's definition.
        let sink = args.app_sink.as_deref().unwrap_or_default();
        return app::run(db, spec, sink).await;
    }
    let names = selected(&args.experiments)?;
    if names.is_empty() {
        println!("experiments (outbox-lab lab all | outbox-lab lab <name>...):");
        for (name, summary) in EXPERIMENTS {
            println!("  {name:<18} {summary}");
        }
        return Ok(());
    }
    // The relays are `outbox`'s: a missing binary is told before anything starts.
    outbox_bin()?;

    let pg = Postgres::start(db, names.contains(&"wal")).await?;
    let throwaway = pg.is_throwaway();
    let mut lab = Scratch::new(
        pg.config.clone(),
        pg.url.clone(),
        shop::SCHEMA,
        shop::CHANNEL,
        None,
        args.quick,
    )
    .await?;
    let version: String = lab.db.query_one("SHOW server_version", &[]).await?.get(0);
    let context = format!(
        "PostgreSQL {version}{}; {} cores; {}; reference: PostgreSQL 16, Python relay, 2 CPUs",
        if throwaway { " (throwaway, fsync=off)" } else { "" },
        std::thread::available_parallelism().map_or(0, usize::from),
        if args.quick { "--quick sizes" } else { "full sizes" },
    );

    let progress = progress_bar(
        names.len() as u64,
        "{spinner} {msg:<40} [{bar:20}] {pos}/{len} {elapsed}",
    )?;
    if args.json {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    lab.progress = Some(progress.clone());
    let mut outcomes = Vec::with_capacity(names.len());
    for name in names {
        progress.set_message(name);
        let started = Instant::now();
        let mut outcome = experiment(&mut lab, name)
            .await
            .with_context(|| format!("experiment {name}"))?;
        outcome.seconds = started.elapsed().as_secs_f64();
        progress.inc(1);
        if !args.json {
            progress.suspend(|| outcome.print());
        }
        outcomes.push(outcome);
    }
    progress.finish_and_clear();
    lab.drop_schema().await?;

    if args.json {
        println!("{}", serde_json::to_string_pretty(&outcomes)?);
    } else {
        println!("\n{context}");
    }
    if let Some(path) = &args.report {
        let page = report::html("outbox-lab lab", &outcomes, &context);
        tokio::fs::write(path, page)
            .await
            .with_context(|| format!("writing the report to {}", path.display()))?;
        if !args.json {
            println!("report: {}", path.display());
        }
    }
    let failed: Vec<String> = outcomes
        .iter()
        .flat_map(|o| {
            o.failed()
                .map(move |r| format!("{}: {} = {}", o.name, r.measure, r.ours))
        })
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} correctness verdict(s) failed: {}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(())
}

/// The experiments named on the command line, in `all`'s order; empty for
/// `list`.
fn selected(requested: &[String]) -> anyhow::Result<Vec<&'static str>> {
    if requested.iter().any(|r| r == "list") {
        return Ok(Vec::new());
    }
    if requested.iter().any(|r| r == "all") {
        return Ok(EXPERIMENTS.iter().map(|(n, _)| *n).collect());
    }
    for r in requested {
        if !EXPERIMENTS.iter().any(|(n, _)| n == r) {
            return Err(ConfigError(format!("unknown experiment {r:?}; see `outbox-lab lab list`")).into());
        }
    }
    Ok(EXPERIMENTS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| requested.iter().any(|r| r == n))
        .collect())
}

async fn experiment(lab: &mut Scratch, name: &str) -> anyhow::Result<Outcome> {
    match name {
        "dual-write" => dual_write::run(lab).await,
        "rollback" => rollback::run(lab).await,
        "crash-before-mark" => crash_before_mark::run(lab).await,
        "retry" => retry::run(lab).await,
        "watermark" => watermark::run(lab).await,
        "latency" => latency::run(lab).await,
        "idle" => idle::run(lab).await,
        "batch-size" => batch_size::run(lab).await,
        "index" => index::run(lab).await,
        "ordering" => ordering::run(lab).await,
        "cleanup" => cleanup::run(lab).await,
        "redis-group" => redis_group::run(lab).await,
        "wal" => wal::run(lab).await,
        "slow-sink" => slow_sink::run(lab).await,
        other => bail!("no experiment {other:?}"),
    }
}
