//! One drain of N pre-written events by one strategy at one batch size,
//! and what writing and draining them cost PostgreSQL (`cost.rs`).
//!
//! - `Relay`: `outbox relay` as a child process, to Redis Streams.
//! - `Floor`: one client running `claim_and_mark` (of `naive_sql.rs`) until
//!   nothing is left: the cost of the claim and the mark alone, no sink.
//! - `Naive`: the reference relay's shape: claim a batch, then per row one
//!   XADD round trip and one `UPDATE … WHERE id = $1`.
//! - `Wal`: `outbox relay --source wal` (a fresh slot, `outbox migrate
//!   --wal`) reading the same inserts from the WAL and deleting the
//!   delivered rows (`--wal-cleanup delete`, the default).
//! - `Emit`: the same relay, the events written with `Outbox::emit_all`
//!   (logical decoding messages, no row).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::{Event, OutboxRow};
use redis::AsyncCommands;
use serde::Serialize;

use super::cost::{Cost, Meter};
use super::naive_sql::NaiveSql;
use super::{STREAM, event};
use crate::scratch::{Scratch, connect};

/// How the outbox is drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Strategy {
    Relay,
    Floor,
    Naive,
    Wal,
    Emit,
}

impl Strategy {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Strategy::Relay => "relay → redis",
            Strategy::Floor => "floor (claim+mark, no sink)",
            Strategy::Naive => "naive per-row → redis",
            Strategy::Wal => "relay --source wal → redis",
            Strategy::Emit => "relay --source wal, emit → redis",
        }
    }

    /// Whether the events come through a replication slot.
    pub(crate) fn reads_wal(self) -> bool {
        matches!(self, Strategy::Wal | Strategy::Emit)
    }

    /// Whether anything reaches Redis (the floor has no sink).
    pub(crate) fn delivers(self) -> bool {
        self != Strategy::Floor
    }

    /// The relay's source flags.
    pub(crate) fn relay_args(self) -> &'static [&'static str] {
        if self.reads_wal() {
            &["--source", "wal"]
        } else {
            &[]
        }
    }
}

/// What one drain measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Run {
    pub(crate) seconds: f64,
    /// Distinct event_ids that reached Redis (the floor sends nothing: 0).
    pub(crate) delivered: u64,
    /// Stream entries beyond the distinct ones.
    pub(crate) duplicates: u64,
    /// Rows the drain finished: marked published, or deleted by the WAL
    /// source; 0 for emitted events, which have no row.
    pub(crate) marked: u64,
    /// Rows in the table after the drain.
    pub(crate) rows_left: u64,
    /// Peak resident memory of the relay process, in bytes.
    pub(crate) peak_rss: Option<u64>,
    /// What writing and draining the events cost PostgreSQL.
    pub(crate) cost: Cost,
}

impl Scratch {
    /// Empties the outbox, writes `n` events (inserted, or emitted for
    /// `Emit`) and drains them with `strategy`.
    pub(crate) async fn drain(&mut self, strategy: Strategy, n: usize, batch: u32) -> anyhow::Result<Run> {
        self.prepare(strategy).await?;
        let meter = Meter::start(&self.db).await?;
        self.write(strategy, n).await?;
        let (seconds, peak_rss) = match strategy {
            Strategy::Relay | Strategy::Wal | Strategy::Emit => self.drain_relay(strategy, batch).await?,
            Strategy::Floor => (self.drain_floor(batch).await?, None),
            Strategy::Naive => (self.drain_naive(batch).await?, None),
        };
        let cost = meter.stop(&self.db).await?;
        let rows_left = self.rows().await? as u64;
        let marked = match strategy {
            Strategy::Wal => n as u64 - rows_left,
            Strategy::Emit => 0,
            _ => self.published().await? as u64,
        };
        let (entries, delivered) = if strategy.delivers() {
            self.stream_counts().await?
        } else {
            (0, 0)
        };
        Ok(Run {
            seconds,
            delivered,
            duplicates: entries - delivered,
            marked,
            rows_left,
            peak_rss,
            cost,
        })
    }

    /// Empties the table and the stream; a fresh slot for the WAL source,
    /// none for the others.
    pub(crate) async fn prepare(&mut self, strategy: Strategy) -> anyhow::Result<()> {
        self.clear().await?;
        if strategy.reads_wal() {
            self.fresh_slot().await
        } else {
            self.drop_slot().await
        }
    }

    /// Writes `n` bench events, 1000 per transaction: rows, or for `Emit`
    /// logical decoding messages.
    pub(crate) async fn write(&mut self, strategy: Strategy, n: usize) -> anyhow::Result<()> {
        let events: Vec<Event> = (0..n).map(event).collect();
        if strategy != Strategy::Emit {
            return self.insert(&events).await;
        }
        for chunk in events.chunks(1000) {
            let tx = self.db.transaction().await?;
            self.outbox.emit_all(&tx, chunk).await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// Entries in the bench's stream, and distinct event ids among them.
    pub(crate) async fn stream_counts(&mut self) -> anyhow::Result<(u64, u64)> {
        stream_counts(&mut self.redis().await?).await
    }

    /// Runs `outbox relay --drain` (with `strategy`'s source) to the end;
    /// returns the seconds it reports and its peak RSS.
    pub(crate) async fn drain_relay(
        &mut self,
        strategy: Strategy,
        batch: u32,
    ) -> anyhow::Result<(f64, Option<u64>)> {
        let batch = batch.to_string();
        let mut args = vec!["--batch-size", batch.as_str(), "--drain"];
        args.extend(strategy.relay_args());
        let relay = self.spawn_bench_relay(&args).await?;
        self.relay_drained(relay).await
    }

    /// Waits for a `--drain` relay to report its drain, and stops it;
    /// returns the seconds it reports and its peak RSS.
    pub(crate) async fn relay_drained(
        &mut self,
        relay: outbox_testkit::Spawned,
    ) -> anyhow::Result<(f64, Option<u64>)> {
        // The relay times its own drain, from its first claim to its last
        // commit, as the floor is timed: process start-up is not the relay's
        // throughput. Watching for the log line costs the database nothing.
        let started = Instant::now();
        let mut peak = None;
        let drained = loop {
            peak = relay.peak_rss().or(peak);
            if let Some(line) = relay.lines().into_iter().find(|l| l.contains("relay drained")) {
                break line;
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("the relay did not drain the outbox within 10 minutes");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        self.stop_relay(relay).await?;
        let seconds = serde_json::from_str::<serde_json::Value>(&drained)
            .ok()
            .and_then(|v| v["fields"]["seconds"].as_f64())
            .with_context(|| format!("no seconds in the relay's last line: {drained}"))?;
        Ok((seconds, peak))
    }

    async fn drain_floor(&self, batch: u32) -> anyhow::Result<f64> {
        let client = connect(&self.pg).await?;
        let stmt = client
            .prepare(&NaiveSql::new(&self.config).claim_and_mark)
            .await?;
        let limit = i64::from(batch);
        let started = Instant::now();
        while client.execute(&stmt, &[&limit]).await? > 0 {}
        Ok(started.elapsed().as_secs_f64())
    }

    async fn drain_naive(&mut self, batch: u32) -> anyhow::Result<f64> {
        let mut client = connect(&self.pg).await?;
        let mut redis = self.redis().await?;
        let sql = NaiveSql::new(&self.config);
        let claim = client.prepare(&sql.select_batch).await?;
        let mark = client.prepare(&sql.mark_one).await?;
        let limit = i64::from(batch);
        let started = Instant::now();
        loop {
            let tx = client.transaction().await?;
            let rows = tx.query(&claim, &[&limit]).await?;
            if rows.is_empty() {
                break;
            }
            for row in &rows {
                let row = OutboxRow::try_from(row)?;
                let fields = [
                    ("event_id", row.event_id.to_string()),
                    ("aggregate_id", row.aggregate_id.clone()),
                    ("event_type", row.event_type.clone()),
                    ("payload", row.payload.to_string()),
                    ("outbox_id", row.id.to_string()),
                ];
                let _: String = redis.xadd(STREAM, "*", &fields).await?;
                tx.execute(&mark, &[&row.id]).await?;
            }
            tx.commit().await?;
        }
        Ok(started.elapsed().as_secs_f64())
    }
}

/// Entries in the bench's stream on `redis`, and distinct event ids among
/// them. Read in pages: one reply of 200,000 entries outlasts the
/// client's response timeout.
pub(crate) async fn stream_counts(
    redis: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<(u64, u64)> {
    const PAGE: usize = 10_000;
    let (mut entries, mut ids) = (0_u64, HashSet::new());
    let mut from = "-".to_owned();
    loop {
        let reply: redis::streams::StreamRangeReply = redis.xrange_count(STREAM, &from, "+", PAGE).await?;
        entries += reply.ids.len() as u64;
        ids.extend(reply.ids.iter().filter_map(|e| e.get::<String>("event_id")));
        match reply.ids.last() {
            // Exclusive from the last entry read (Redis 6.2).
            Some(last) if reply.ids.len() == PAGE => from = format!("({}", last.id),
            _ => break,
        }
    }
    Ok((entries, ids.len() as u64))
}
