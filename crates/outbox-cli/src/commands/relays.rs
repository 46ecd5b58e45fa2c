//! `outbox relays`: the live relays, the partitions each holds, and the
//! backlog of every partition; with log tailing set up, the replication
//! slot and who reads it (the WAL source holds no partitions); of
//! `--outbox NAME`'s. With --schemas or --all, the fleet processes instead
//! (`super::fleet_ops`).

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::cli::{Global, RelaysArgs};

#[derive(Debug, Serialize)]
struct LiveRelay {
    relay_id: Uuid,
    name: String,
    started_at: DateTime<Utc>,
    /// Seconds since its last heartbeat.
    silent_for_seconds: f64,
    partitions: Vec<i32>,
    /// Pending rows (not published, not dead) in its partitions.
    backlog: i64,
}

#[derive(Debug, Serialize)]
struct Relays {
    table: String,
    partitions: usize,
    /// Partitions no live relay holds (between a relay's death and the
    /// takeover, or with no relay running).
    unowned: Vec<i32>,
    relays: Vec<LiveRelay>,
    by_partition: Vec<outbox::sql::PartitionRow>,
    /// The replication slot of `relay --source wal`; null without one.
    slot: Option<outbox::sql::SlotState>,
    /// The fleet process serving the outbox (`relay --schemas`, or
    /// `[outboxes.NAME]`), which holds no partitions; null when none does.
    fleet_process: Option<super::fleet_ops::ServedBy>,
}

pub(crate) async fn run(g: &Global, args: RelaysArgs) -> anyhow::Result<()> {
    if let Some(selection) = super::fleet_ops::many(g, &args.fleet).await? {
        return super::fleet_ops::relays(selection, args.json).await;
    }
    let super::selection::Chosen { pg, config } = super::fleet_ops::one(g, &args.fleet).await?;
    let client = super::connect(&pg).await?;
    super::require(&client, &config, &[outbox::privileges::Role::AdminRead]).await?;
    outbox::check(&client, &config).await?;
    let sql = outbox::sql::OutboxSql::new(&config);
    let by_partition = sql
        .partition_backlog(&client)
        .await
        .context("reading the partition backlog")?;
    let relays: Vec<LiveRelay> = sql
        .relays(&client)
        .await
        .context("reading the relays")?
        .into_iter()
        .map(|r| LiveRelay {
            backlog: r
                .partitions
                .iter()
                .filter_map(|p| by_partition.get(usize::try_from(*p).ok()?))
                .map(|p| p.backlog)
                .sum(),
            relay_id: r.relay_id,
            name: r.name,
            started_at: r.started_at,
            silent_for_seconds: r.silent_for_seconds,
            partitions: r.partitions,
        })
        .collect();
    let unowned = by_partition
        .iter()
        .filter(|p| p.owner.is_none_or(|o| !relays.iter().any(|r| r.relay_id == o)))
        .map(|p| p.partition)
        .collect();
    let slot = outbox::wal::slot_state(&client, &config)
        .await
        .context("reading the replication slot")?;
    let fleet_process = super::fleet_ops::serving(&client, &config).await?;
    let report = Relays {
        fleet_process,
        table: config.display_name(),
        partitions: by_partition.len(),
        unowned,
        relays,
        by_partition,
        slot,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "outbox {}: {}, {}",
        report.table,
        super::counted(report.partitions as u64, "partition", "partitions"),
        super::counted(report.relays.len() as u64, "live relay", "live relays")
    );
    if let Some(process) = &report.fleet_process {
        println!("served by the fleet process {process}, which holds no partitions");
    }
    if let Some(slot) = &report.slot {
        // A relay reading the slot is the backend streaming it; standbys
        // wait for its turn and show nowhere.
        println!("log tailing: {slot}");
    }
    println!();
    println!(
        "  {:<36} {:<24} {:>10} {:>10} {:>9}  partitions",
        "relay_id", "name", "heartbeat", "held", "backlog"
    );
    for r in &report.relays {
        println!(
            "  {:<36} {:<24} {:>9.1}s {:>10} {:>9}  {}",
            r.relay_id,
            r.name,
            r.silent_for_seconds,
            r.partitions.len(),
            r.backlog,
            outbox::sql::partition_ranges(&r.partitions)
        );
    }
    if !report.unowned.is_empty() {
        let backlog: i64 = report
            .unowned
            .iter()
            .filter_map(|p| report.by_partition.get(usize::try_from(*p).ok()?))
            .map(|p| p.backlog)
            .sum();
        println!(
            "  {:<36} {:<24} {:>10} {:>10} {:>9}  {}",
            "(nobody)",
            "",
            "",
            report.unowned.len(),
            backlog,
            outbox::sql::partition_ranges(&report.unowned)
        );
    }
    Ok(())
}
