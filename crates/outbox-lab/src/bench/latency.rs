//! Commit-to-consumer latency: a writer commits one event per transaction at
//! a steady rate while the relay runs, and a consumer blocked in `XREAD`
//! notes when each event arrives. Latency is arrival minus the row's
//! `created_at` (the INSERT's `clock_timestamp()`, a little before its
//! commit), so both clocks must be this host's: with a remote
//! `DATABASE_URL`, clock skew is part of the figure.
//!
//! Run once with LISTEN/NOTIFY (the relay's default) and once polling, so
//! the report shows what NOTIFY buys.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use outbox::Outbox;
use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::scratch::{STREAM, Scratch, event};

/// How the relay learns about new rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Wakeup {
    /// LISTEN/NOTIFY with the default fallback poll.
    Notify,
    /// `--no-notify --poll-interval <ms>`.
    Poll { interval_ms: u64 },
}

impl Wakeup {
    pub(super) fn label(self) -> String {
        match self {
            Wakeup::Notify => "NOTIFY".to_owned(),
            Wakeup::Poll { interval_ms } => format!("poll {interval_ms} ms"),
        }
    }

    pub(super) fn relay_args(self) -> Vec<String> {
        match self {
            Wakeup::Notify => Vec::new(),
            Wakeup::Poll { interval_ms } => vec![
                "--no-notify".to_owned(),
                "--poll-interval".to_owned(),
                format!("{interval_ms}ms"),
            ],
        }
    }
}

/// What one latency run measured.
#[derive(Debug, Clone, Serialize)]
pub(super) struct LatencyRun {
    pub(super) written: u64,
    /// Distinct events the consumer received.
    pub(super) received: u64,
    pub(super) duplicates: u64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
}

/// Writes `rate` events per second for `seconds` with the relay running in
/// `wakeup` mode, and measures each event's way to the consumer.
pub(super) async fn measure(
    scratch: &mut Scratch,
    wakeup: Wakeup,
    rate: u32,
    seconds: f64,
) -> anyhow::Result<LatencyRun> {
    scratch.clear().await?;
    let args = wakeup.relay_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = scratch.spawn_relay(&args).await?;

    let received = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let consumer = tokio::spawn(consume(
        scratch.redis().await?,
        Arc::clone(&received),
        stop.clone(),
    ));

    let outbox = Outbox::new(scratch.config.clone());
    let written = (f64::from(rate) * seconds).round() as u64;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for i in 0..written {
        tick.tick().await;
        // Autocommit: the INSERT is its own transaction, as in an
        // application that writes one business change and one event.
        outbox.enqueue(&scratch.db, &event(i as usize)).await?;
    }

    // Everything written must arrive; a poll interval plus slack is plenty.
    let deadline = Instant::now() + Duration::from_secs(60);
    while received.load(Ordering::Relaxed) < written && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    let arrivals = consumer.await.context("the consumer task")??;
    scratch.stop_relay(relay).await?;

    let created = created_at(scratch).await?;
    let mut latencies = Vec::with_capacity(arrivals.len());
    let mut first_arrival: HashMap<i64, f64> = HashMap::new();
    for (id, at) in &arrivals {
        first_arrival.entry(*id).or_insert(*at);
    }
    for (id, at) in &first_arrival {
        if let Some(c) = created.get(id) {
            latencies.push((at - c) * 1000.0);
        }
    }
    latencies.sort_by(f64::total_cmp);
    Ok(LatencyRun {
        written,
        received: first_arrival.len() as u64,
        duplicates: (arrivals.len() - first_arrival.len()) as u64,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
    })
}

/// Reads the stream from the start until `stop`, noting (outbox id, arrival
/// time in epoch seconds) per entry.
async fn consume(
    mut redis: redis::aio::MultiplexedConnection,
    received: Arc<AtomicU64>,
    stop: CancellationToken,
) -> anyhow::Result<Vec<(i64, f64)>> {
    let options = StreamReadOptions::default().block(100).count(1000);
    let mut last = "0".to_owned();
    let mut arrivals = Vec::new();
    while !stop.is_cancelled() {
        let reply: Option<StreamReadReply> = redis
            .xread_options(&[STREAM], &[last.as_str()], &options)
            .await
            .context("XREAD on the bench stream")?;
        let now = epoch_seconds();
        for entry in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids) {
            if let Some(id) = entry.get::<i64>("outbox_id") {
                arrivals.push((id, now));
            }
            last = entry.id;
        }
        received.store(arrivals.len() as u64, Ordering::Relaxed);
    }
    Ok(arrivals)
}

/// Each row's `created_at` in epoch seconds.
async fn created_at(scratch: &Scratch) -> anyhow::Result<HashMap<i64, f64>> {
    let sql = format!(
        "SELECT id, extract(epoch FROM created_at)::float8 FROM {}",
        scratch.config.qualified()
    );
    Ok(scratch
        .db
        .query(&sql, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

fn epoch_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Nearest-rank percentile of sorted values.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
