//! Sink outage: a writer keeps committing at a steady rate while the sink
//! is down, then the sink comes back and the relay catches up.
//!
//! The sink is a redis-server of this phase's own (append-only, so what it
//! acknowledged before the stop is still there after the restart, and the
//! count of delivered events is exact): `outbox relay` to it, a writer at
//! `rate` events/s, Redis stopped for `outage`, the writer stopped, Redis
//! started again. Measured:
//!
//! - the WAL the slot holds back meanwhile (`--source wal`: nothing is read
//!   while the sink is down, so the slot's position stays where it was);
//!   polling has no slot, its backlog is rows in the table;
//! - how long after the restart the first event arrived (the relay's
//!   breaker probes the sink at most every second);
//! - the catch-up rate: the backlog's events over the time from the last
//!   look at the stream before it grew until every written event was there.
//!
//! Every written event must arrive: a loss fails the run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use redis::AsyncCommands;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::throughput::{Strategy, stream_counts};
use super::{STREAM, event};
use crate::scratch::{LONG, Scratch};

/// How often the outage is sampled (retained WAL, events written).
const SAMPLE: Duration = Duration::from_millis(250);
/// How often the stream's length is read during the catch-up.
const WATCH: Duration = Duration::from_millis(5);

/// One look at the run, seconds after the sink stopped.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Sample {
    pub(crate) t: f64,
    pub(crate) written: u64,
    /// Stream entries (`None` while the sink is down).
    pub(crate) delivered: Option<u64>,
    /// WAL the slot holds back, bytes (`None` without a slot).
    pub(crate) retained: Option<i64>,
}

/// What one outage measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutageRun {
    pub(crate) outage_seconds: f64,
    pub(crate) rate: u32,
    pub(crate) written: u64,
    pub(crate) written_during_outage: u64,
    /// Stream entries when the sink came back: what it had acknowledged
    /// before it stopped.
    pub(crate) delivered_before: u64,
    /// Distinct events in the stream at the end.
    pub(crate) delivered: u64,
    pub(crate) duplicates: u64,
    /// Most WAL the slot held back during the outage.
    pub(crate) retained_max_bytes: Option<i64>,
    /// Sink back → first event of the backlog arrived.
    pub(crate) resume_seconds: f64,
    /// Events delivered after the restart.
    pub(crate) catch_up_events: u64,
    pub(crate) catch_up_seconds: f64,
    pub(crate) catch_up_per_second: f64,
    /// Peak resident memory of the relay process, in bytes.
    pub(crate) peak_rss: Option<u64>,
    pub(crate) samples: Vec<Sample>,
}

/// Runs one outage of `outage` with the relay of `strategy` (`Relay` or
/// `Wal`) at `--batch-size batch`, written to at `rate` events/s.
pub(crate) async fn measure(
    scratch: &mut Scratch,
    strategy: Strategy,
    outage: Duration,
    rate: u32,
    batch: u32,
) -> anyhow::Result<OutageRun> {
    let mut sink = outbox_testkit::Redis::start_persistent()
        .await
        .context("starting the outage phase's redis-server")?;
    let mut redis = connect(&sink.url()).await?;
    scratch.prepare(strategy).await?;
    let b = batch.to_string();
    let mut args = vec!["--batch-size", b.as_str()];
    args.extend(strategy.relay_args());
    let relay = scratch.spawn_bench_relay_to(&sink.url(), &args).await?;

    let written = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let writer = tokio::spawn(write(
        scratch.connect().await?,
        scratch.outbox.clone(),
        rate,
        Arc::clone(&written),
        stop.clone(),
    ));

    // Events flow before the sink goes.
    let warm = u64::from(rate / 10).max(1);
    let deadline = Instant::now() + LONG;
    while xlen(&mut redis).await? < warm {
        if writer.is_finished() {
            writer.await.context("the writer task")??;
            bail!("the writer stopped before the outage");
        }
        if Instant::now() > deadline {
            bail!("no event reached the sink within {LONG:?}, before the outage");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    sink.stop().await.context("stopping the sink")?;
    let stopped = Instant::now();
    let at_stop = written.load(Ordering::Relaxed);
    let mut samples = Vec::new();
    loop {
        samples.push(Sample {
            t: stopped.elapsed().as_secs_f64(),
            written: written.load(Ordering::Relaxed),
            delivered: None,
            retained: scratch.retained_wal().await?,
        });
        let left = outage.saturating_sub(stopped.elapsed());
        if left.is_zero() {
            break;
        }
        tokio::time::sleep(left.min(SAMPLE)).await;
    }
    stop.cancel();
    let total = writer.await.context("the writer task")??;
    let outage_seconds = stopped.elapsed().as_secs_f64();

    sink.restart().await.context("starting the sink again")?;
    let back = Instant::now();
    let mut redis = connect(&sink.url()).await?;
    let before = xlen(&mut redis).await?;
    // The last look at which the backlog had not started moving, and when
    // all of it was there.
    let mut still = back;
    let mut resumed = None;
    let mut last_sample = back;
    let done = loop {
        let now = Instant::now();
        let len = xlen(&mut redis).await?;
        if len == before {
            still = now;
        } else if resumed.is_none() {
            resumed = Some(still);
        }
        if now.duration_since(last_sample) >= SAMPLE / 5 {
            last_sample = now;
            samples.push(Sample {
                t: now.duration_since(stopped).as_secs_f64(),
                written: total,
                delivered: Some(len),
                retained: scratch.retained_wal().await?,
            });
        }
        if len >= total && stream_counts(&mut redis).await?.1 >= total {
            break now;
        }
        if back.elapsed() > LONG {
            bail!("{len} of {total} events reached the sink within {LONG:?} of its restart");
        }
        tokio::time::sleep(WATCH).await;
    };
    let peak_rss = relay.peak_rss();
    scratch.stop_relay(relay).await?;
    let (entries, delivered) = stream_counts(&mut redis).await?;
    let resumed = resumed.unwrap_or(still);
    let catch_up_events = entries - before;
    let catch_up_seconds = done.duration_since(resumed).as_secs_f64();
    let retained_max_bytes = samples.iter().filter_map(|s| s.retained).max();
    Ok(OutageRun {
        outage_seconds,
        rate,
        written: total,
        written_during_outage: total - at_stop,
        delivered_before: before,
        delivered,
        duplicates: entries - delivered,
        retained_max_bytes,
        resume_seconds: resumed.duration_since(back).as_secs_f64(),
        catch_up_events,
        catch_up_seconds,
        catch_up_per_second: catch_up_events as f64 / catch_up_seconds.max(f64::EPSILON),
        peak_rss,
        samples,
    })
}

async fn connect(url: &str) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
        .context("connecting to the outage phase's Redis")
}

async fn xlen(redis: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    Ok(redis.xlen(STREAM).await?)
}

/// Writes bench events at `rate` per second until `stop`: a transaction of
/// `rate / 100` events every 10 ms (one event per transaction below 100/s).
/// Returns how many it wrote.
async fn write(
    mut db: tokio_postgres::Client,
    outbox: outbox::Outbox,
    rate: u32,
    written: Arc<AtomicU64>,
    stop: CancellationToken,
) -> anyhow::Result<u64> {
    let per_tx = (rate / 100).max(1) as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(per_tx as f64 / f64::from(rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0;
    while !stop.is_cancelled() {
        tick.tick().await;
        let events: Vec<_> = (n..n + per_tx).map(event).collect();
        let tx = db.transaction().await?;
        outbox.enqueue_all(&tx, &events).await?;
        tx.commit().await?;
        n += per_tx;
        written.store(n as u64, Ordering::Relaxed);
    }
    Ok(n as u64)
}
