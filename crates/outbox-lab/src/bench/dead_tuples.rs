//! Dead tuples: what N delivered events leave in the outbox table for
//! vacuum, by strategy.
//!
//! The polling relay marks each row (an UPDATE: the old version is dead,
//! the new one stays until `outbox cleanup` deletes it, another dead tuple
//! each). The WAL source deletes what it delivered (one dead tuple per
//! event, no live row). Emitted events never touch the table.
//!
//! Each run gets a new table (fresh statistics) with autovacuum off, so the
//! figure is what the writes left, not what a vacuum happened to clear
//! meanwhile; page pruning during the run still removes some, as it would
//! anywhere. Statistics are published asynchronously: the relay's backends
//! publish theirs as they exit, so the figures are read once those are gone
//! and the table's update and delete counts reached what the strategy must
//! have done (N updates, N deletes, none).

use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;

use super::throughput::Strategy;
use crate::scratch::{LONG, Scratch};

/// What one strategy left after delivering `events`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeadTuplesRun {
    pub(crate) events: u64,
    /// Distinct events that reached Redis.
    pub(crate) delivered: u64,
    /// `pg_stat_user_tables.n_dead_tup`.
    pub(crate) dead: i64,
    /// `pg_stat_user_tables.n_live_tup`.
    pub(crate) live: i64,
    /// `pg_table_size`, bytes.
    pub(crate) table_bytes: i64,
    /// Rows in the table (`count(*)`).
    pub(crate) rows: i64,
    /// `n_tup_ins`, `n_tup_upd`, `n_tup_del`.
    pub(crate) inserted: i64,
    pub(crate) updated: i64,
    pub(crate) deleted: i64,
}

/// Writes `events` events, drains them with `strategy` (a relay with
/// `--batch-size batch`) and reads the table's statistics.
pub(crate) async fn measure(
    scratch: &mut Scratch,
    strategy: Strategy,
    events: usize,
    batch: u32,
) -> anyhow::Result<DeadTuplesRun> {
    // A new table: its counters start at zero. The publication goes with
    // the old one, so it is made again too.
    scratch.drop_wal().await?;
    scratch.reset_outbox().await?;
    scratch.prepare(strategy).await?;
    let t = scratch.table();
    scratch
        .db
        .batch_execute(&format!("ALTER TABLE {t} SET (autovacuum_enabled = off)"))
        .await?;
    scratch.write(strategy, events).await?;
    // The inserts' statistics before the relay's: PostgreSQL clamps
    // n_live_tup at zero as it adds each backend's share, so deletes
    // published first would be lost against inserts published later.
    let _ = scratch
        .db
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await;
    scratch.drain_relay(strategy, batch).await?;
    let (_, delivered) = scratch.stream_counts().await?;
    // Each row is marked (polling) or deleted (WAL) once; emitted events
    // have none.
    let expected = if strategy == Strategy::Emit {
        0
    } else {
        events as i64
    };
    let counts = format!(
        "SELECT n_tup_upd + n_tup_del, n_dead_tup, n_live_tup, pg_table_size('{t}'), \
                (SELECT count(*) FROM pg_stat_activity \
                  WHERE application_name LIKE 'outbox-relay%' AND datname = current_database()), \
                (SELECT count(*) FROM {t}), n_tup_ins, n_tup_upd, n_tup_del \
           FROM pg_stat_user_tables WHERE relid = '{t}'::regclass"
    );
    let deadline = Instant::now() + LONG;
    let row = loop {
        // This backend's own pending statistics first (PostgreSQL 15+).
        let _ = scratch
            .db
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        let row = scratch.db.query_one(&counts, &[]).await?;
        if row.get::<_, i64>(4) == 0 && row.get::<_, i64>(0) >= expected {
            break row;
        }
        if Instant::now() > deadline {
            bail!("timed out after {LONG:?} waiting for the relay's backends to publish their statistics");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    scratch
        .db
        .batch_execute(&format!("ALTER TABLE {t} RESET (autovacuum_enabled)"))
        .await?;
    Ok(DeadTuplesRun {
        events: events as u64,
        delivered,
        dead: row.get(1),
        live: row.get(2),
        table_bytes: row.get(3),
        rows: row.get(5),
        inserted: row.get(6),
        updated: row.get(7),
        deleted: row.get(8),
    })
}
