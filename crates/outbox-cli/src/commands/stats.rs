//! `outbox stats`: what is waiting, what is dead, and how old the oldest is;
//! what keeps vacuum from cleaning the table (its dead tuples, who holds
//! the xmin horizon back); with log tailing set up, the replication slot
//! too; of `--outbox NAME`'s. With --schemas or --all, one line per outbox
//! instead (`super::fleet_ops`).

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;

use outbox::sql::{HorizonHolder, SlotState, TypeStats};

use crate::cli::{Global, StatsArgs};

#[derive(Debug, Serialize)]
struct Stats {
    table: String,
    unpublished: i64,
    dead_letters: i64,
    given_up: i64,
    blocked_aggregates: i64,
    oldest_unpublished: Option<DateTime<Utc>>,
    oldest_unpublished_age_seconds: Option<f64>,
    by_aggregate_type: Vec<TypeStats>,
    /// The replication slot of `relay --source wal`; null without one.
    slot: Option<SlotState>,
    /// Dead tuples of the table (partitions summed), as the statistics
    /// count them.
    dead_tuples: i64,
    /// What holds the xmin horizon back: the oldest transaction or prepared
    /// transaction first, then replication slots with an xmin.
    xmin_horizon: Vec<HorizonHolder>,
}

pub(crate) async fn run(g: &Global, args: StatsArgs) -> anyhow::Result<()> {
    if let Some(selection) = super::fleet_ops::many(g, &args.fleet).await? {
        return super::fleet_ops::stats(selection, args.top, args.json).await;
    }
    let super::selection::Chosen { pg, config } = super::fleet_ops::one(g, &args.fleet).await?;
    let client = super::connect(&pg).await?;
    super::require(&client, &config, &[outbox::privileges::Role::Stats]).await?;
    outbox::check(&client, &config).await?;
    let sql = outbox::sql::OutboxSql::new(&config);
    let by_type = sql.stats(&client).await.context("reading outbox statistics")?;
    let slot = outbox::wal::slot_state(&client, &config)
        .await
        .context("reading the replication slot")?;
    let dead_tuples = sql.dead_tuples(&client).await.context("reading dead tuples")?;
    let xmin_horizon = sql
        .xmin_holders(&client)
        .await
        .context("reading who holds the xmin horizon")?;
    let oldest = by_type.iter().filter_map(|t| t.oldest_unpublished).min();
    let stats = Stats {
        table: config.display_name(),
        unpublished: by_type.iter().map(|t| t.unpublished).sum(),
        dead_letters: by_type.iter().map(|t| t.dead_letters).sum(),
        given_up: by_type.iter().map(|t| t.given_up).sum(),
        blocked_aggregates: by_type.iter().map(|t| t.blocked_aggregates).sum(),
        oldest_unpublished: oldest,
        oldest_unpublished_age_seconds: oldest.map(|o| (Utc::now() - o).num_milliseconds() as f64 / 1000.0),
        by_aggregate_type: by_type,
        slot,
        dead_tuples,
        xmin_horizon,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(());
    }
    println!("outbox {}", stats.table);
    println!("  unpublished      {}", stats.unpublished);
    println!("  dead letters     {}", stats.dead_letters);
    println!("  given up         {}", stats.given_up);
    println!(
        "  blocked aggregates  {} (aggregates with a dead letter: their later events wait only under --ordering strict)",
        stats.blocked_aggregates
    );
    match stats.oldest_unpublished_age_seconds {
        Some(age) => println!("  oldest unpublished  {age:.1}s ago"),
        None => println!("  oldest unpublished  -"),
    }
    println!("  dead tuples      {}", stats.dead_tuples);
    if stats.xmin_horizon.is_empty() {
        println!("  xmin horizon     not held");
    }
    for (i, holder) in stats.xmin_horizon.iter().enumerate() {
        let label = if i == 0 { "xmin horizon" } else { "" };
        println!("  {label:<16} held by {holder}");
    }
    if let Some(slot) = &stats.slot {
        println!("  log tailing      {slot}");
        // The WAL source never marks rows published: it deletes them once
        // delivered (--wal-cleanup delete) or leaves them (none).
        println!(
            "                   (unpublished counts rows not yet deleted; with --wal-cleanup none, every row: \
             what waits is the slot's WAL not confirmed)"
        );
    }
    if !stats.by_aggregate_type.is_empty() {
        println!();
        println!(
            "  {:<24} {:>12} {:>12} {:>10} {:>8}",
            "aggregate_type", "unpublished", "dead", "given up", "blocked"
        );
        for t in &stats.by_aggregate_type {
            println!(
                "  {:<24} {:>12} {:>12} {:>10} {:>8}",
                t.aggregate_type, t.unpublished, t.dead_letters, t.given_up, t.blocked_aggregates
            );
        }
    }
    Ok(())
}
