//! `outbox bench`: how fast the relay drains the outbox on this machine,
//! next to the floor (claim and mark with no sink) and the naive per-row
//! relay, measured in the same run so the figures are ratios.
//!
//! Without `DATABASE_URL` it starts a throwaway PostgreSQL and redis-server
//! (the testkit's: `fsync=off`, so commits are cheaper than on a durable
//! server; the report says so). With `DATABASE_URL` it works in a scratch
//! schema `outbox_bench`, dropped at the end. The relay runs as its own
//! process (this binary's `relay` command), so its peak RSS is its own.
//!
//! Phases so far: throughput per batch size for the relay, the floor and the
//! naive baseline, with duplicates, distinct deliveries and peak relay RSS.

mod report;
mod throughput;

use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_testkit::{Postgres, Redis};

use crate::cli::{BenchArgs, Global};
use crate::exit::ConfigError;
use report::{Report, Row};
use throughput::{Scratch, Strategy};

pub(crate) async fn run(g: &Global, args: BenchArgs) -> anyhow::Result<()> {
    let (events, reps, batch_sizes) = if args.quick {
        (300, 1, vec![1, 10, 100])
    } else {
        (args.events as usize, args.reps as usize, args.batch_sizes.clone())
    };
    let mut _postgres = None;
    let (pg_url, throwaway_pg) = match &g.database_url {
        Some(url) => (url.clone(), false),
        None => {
            let pg = Postgres::start()
                .await
                .context("starting a throwaway PostgreSQL")?;
            let url = pg.url("postgres");
            _postgres = Some(pg);
            (url, true)
        }
    };
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

    let strategies = [Strategy::Relay, Strategy::Floor, Strategy::Naive];
    let total = (strategies.len() * batch_sizes.len() * reps) as u64;
    let progress = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{spinner} {msg:<40} [{bar:30}] {pos}/{len}")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(120));

    let mut rows = Vec::new();
    for &batch in &batch_sizes {
        for strategy in strategies {
            let mut runs = Vec::with_capacity(reps);
            for rep in 1..=reps {
                progress.set_message(format!("{} batch {batch} rep {rep}/{reps}", strategy.label()));
                runs.push(scratch.drain(strategy, events, batch).await?);
                progress.inc(1);
            }
            rows.push(Row::new(strategy, batch, events, runs));
        }
    }
    progress.finish_and_clear();
    scratch.drop_all().await?;

    let report = Report::new(events, reps, throwaway_pg, rows);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    report.check()
}
