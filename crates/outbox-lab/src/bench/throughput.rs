//! One drain of N pre-inserted events by one strategy at one batch size.
//!
//! - `Relay`: `outbox relay` as a child process, to Redis Streams.
//! - `Floor`: one client running `claim_and_mark` (of `naive_sql.rs`) until
//!   nothing is left: the cost of the claim and the mark alone, no sink.
//! - `Naive`: the reference relay's shape: claim a batch, then per row one
//!   XADD round trip and one `UPDATE … WHERE id = $1`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::OutboxRow;
use redis::AsyncCommands;
use serde::Serialize;

use super::STREAM;
use super::naive_sql::NaiveSql;
use crate::scratch::{Scratch, connect};

/// How the outbox is drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Strategy {
    Relay,
    Floor,
    Naive,
}

impl Strategy {
    pub(super) fn label(self) -> &'static str {
        match self {
            Strategy::Relay => "relay → redis",
            Strategy::Floor => "floor (claim+mark, no sink)",
            Strategy::Naive => "naive per-row → redis",
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
    /// Rows marked published.
    pub(crate) marked: u64,
    /// Peak resident memory of the relay process, in bytes.
    pub(super) peak_rss: Option<u64>,
}

impl Scratch {
    pub(crate) async fn drain(&mut self, strategy: Strategy, n: usize, batch: u32) -> anyhow::Result<Run> {
        self.fill(n).await?;
        let (seconds, peak_rss) = match strategy {
            Strategy::Relay => self.drain_relay(batch).await?,
            Strategy::Floor => (self.drain_floor(batch).await?, None),
            Strategy::Naive => (self.drain_naive(batch).await?, None),
        };
        let marked = self.published().await? as u64;
        let (entries, delivered) = if strategy == Strategy::Floor {
            (0, 0)
        } else {
            self.stream_counts().await?
        };
        Ok(Run {
            seconds,
            delivered,
            duplicates: entries - delivered,
            marked,
            peak_rss,
        })
    }

    async fn stream_counts(&mut self) -> anyhow::Result<(u64, u64)> {
        let reply: redis::streams::StreamRangeReply = self.redis().await?.xrange_all(STREAM).await?;
        let ids: HashSet<String> = reply
            .ids
            .iter()
            .filter_map(|e| e.get::<String>("event_id"))
            .collect();
        Ok((reply.ids.len() as u64, ids.len() as u64))
    }

    async fn drain_relay(&mut self, batch: u32) -> anyhow::Result<(f64, Option<u64>)> {
        let batch = batch.to_string();
        let relay = self
            .spawn_bench_relay(&["--batch-size", &batch, "--drain"])
            .await?;
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
