//! Commit-to-consumer latency: a writer commits one event per transaction at
//! a steady rate while the relay runs, and a consumer blocked in `XREAD`
//! notes when each event arrives. Latency is arrival minus the row's
//! `created_at` (the INSERT's `clock_timestamp()`, a little before its
//! commit), so both clocks must be this host's: with a remote
//! `DATABASE_URL`, clock skew is part of the figure.
//!
//! Run once with LISTEN/NOTIFY (the relay's default) and once polling, so
//! the report shows what NOTIFY buys; with `--source wal`, NOTIFY beside
//! the WAL source. The WAL source deletes the rows it delivered, so there
//! the start of each latency is the writer's own clock just before it sent
//! the INSERT ([`Clock::Sent`]), for both relays of the pair.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{STREAM, event};
use crate::latency::{Wakeup, epoch_seconds, latencies_ms};
use crate::report::percentile;
use crate::scratch::{LONG, Scratch};

/// Where a latency starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Clock {
    /// The row's `created_at`, read back by outbox id after the run.
    CreatedAt,
    /// The writer's clock just before it sent the INSERT, by event id.
    Sent,
}

/// What one latency run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LatencyRun {
    pub(super) clock: Clock,
    pub(super) written: u64,
    /// Distinct events the consumer received.
    pub(super) received: u64,
    pub(super) duplicates: u64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
}

/// Writes `rate` events per second for `seconds` with the relay running in
/// `wakeup` mode, and measures each event's way to the consumer, from
/// `clock`.
pub(super) async fn measure(
    scratch: &mut Scratch,
    wakeup: Wakeup,
    rate: u32,
    seconds: f64,
    clock: Clock,
) -> anyhow::Result<LatencyRun> {
    scratch.clear().await?;
    if wakeup == Wakeup::Wal {
        scratch.fresh_slot().await?;
    } else {
        scratch.drop_slot().await?;
    }
    let args = wakeup.relay_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let url = scratch.pg_url.clone();
    measure_on(scratch, &url, &args, rate, seconds, clock).await
}

/// [`measure`] with a relay on `url` (the bench's database, directly or
/// through a pooler) started with `args`, on a cleared outbox.
pub(super) async fn measure_on(
    scratch: &mut Scratch,
    url: &str,
    args: &[&str],
    rate: u32,
    seconds: f64,
    clock: Clock,
) -> anyhow::Result<LatencyRun> {
    let relay = scratch.spawn_bench_relay_on(url, args).await?;

    let received = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let consumer = tokio::spawn(consume(
        scratch.redis().await?,
        Arc::clone(&received),
        stop.clone(),
    ));

    let written = (f64::from(rate) * seconds).round() as u64;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = HashMap::with_capacity(written as usize);
    for i in 0..written {
        tick.tick().await;
        let event = event(i as usize);
        sent.insert(event.event_id.to_string(), epoch_seconds());
        // Autocommit: the INSERT is its own transaction, as in an
        // application that writes one business change and one event.
        scratch.outbox.enqueue(&scratch.db, &event).await?;
    }

    // Everything written must arrive; a poll interval plus slack is plenty.
    let deadline = Instant::now() + LONG;
    while received.load(Ordering::Relaxed) < written && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    let arrivals = consumer.await.context("the consumer task")??;
    scratch.stop_relay(relay).await?;

    let arrived = arrivals.len();
    let (latencies, received) = match clock {
        Clock::CreatedAt => {
            let created = scratch.created_at::<i64>("id").await?;
            latencies_ms(arrivals.into_iter().map(|a| (a.outbox_id, a.at)), &created)
        }
        Clock::Sent => latencies_ms(arrivals.into_iter().map(|a| (a.event_id, a.at)), &sent),
    };
    Ok(LatencyRun {
        clock,
        written,
        received: received as u64,
        duplicates: (arrived - received) as u64,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
    })
}

/// One stream entry as the consumer saw it.
pub(super) struct Arrival {
    pub(super) outbox_id: i64,
    pub(super) event_id: String,
    /// Epoch seconds.
    pub(super) at: f64,
}

/// Reads the stream from the start until `stop`, noting each entry's ids
/// and arrival time.
pub(super) async fn consume(
    mut redis: redis::aio::MultiplexedConnection,
    received: Arc<AtomicU64>,
    stop: CancellationToken,
) -> anyhow::Result<Vec<Arrival>> {
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
            if let (Some(outbox_id), Some(event_id)) =
                (entry.get::<i64>("outbox_id"), entry.get::<String>("event_id"))
            {
                arrivals.push(Arrival {
                    outbox_id,
                    event_id,
                    at: now,
                });
            }
            last = entry.id;
        }
        received.store(arrivals.len() as u64, Ordering::Relaxed);
    }
    Ok(arrivals)
}
