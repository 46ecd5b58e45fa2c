//! `latency`: what NOTIFY buys over polling.
//!
//! A writer commits one event per transaction at irregular intervals while
//! the relay runs; latency is the receiver's arrival time minus the row's
//! `created_at` (the INSERT's `clock_timestamp()`, just before COMMIT).
//! A polling relay finds a row on its next poll: on average half an
//! interval late, at worst a whole one. With LISTEN/NOTIFY the commit
//! wakes it. Both clocks are this host's; with a remote `DATABASE_URL`,
//! clock skew is part of the figure.

use std::time::{Duration, Instant};

use outbox_testkit::{Receiver, Respond};

use super::shop::event_id;
use crate::latency::{Wakeup, epoch_seconds, latencies_ms};
use crate::plot::{self, Mark, Series};
use crate::report::percentile;
use crate::report::{Outcome, Verdict};
use crate::scratch::Scratch;

/// What the reference measured in each mode.
fn reference(wakeup: Wakeup) -> &'static str {
    match wakeup {
        Wakeup::Poll { interval_ms: 1000 } => "p50 507.6 ms, max 1003.0 ms",
        Wakeup::Poll { .. } => "p50 ≈ interval/2, max ≈ interval",
        Wakeup::Notify | Wakeup::NotifyOrPoll { .. } | Wakeup::Wal => "about 6 ms",
    }
}

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let events: usize = if lab.quick { 20 } else { 100 };
    let mut out = Outcome::new(
        "latency",
        "Latency: polling vs LISTEN/NOTIFY",
        "Polling trades latency for load: a row waits for the next poll. NOTIFY from the insert \
         trigger, delivered at commit, wakes the relay at once; a slow fallback poll covers \
         notifications lost while the relay reconnects.",
        format!(
            "{events} events per mode, one per transaction, 30–75 ms apart (irregular, so writes do not \
             line up with polls); relay → HTTP receiver; latency = arrival − created_at"
        ),
    );
    let mut curves = Vec::new();
    for wakeup in [
        Wakeup::Poll { interval_ms: 1000 },
        Wakeup::Poll { interval_ms: 200 },
        Wakeup::Poll { interval_ms: 100 },
        Wakeup::NotifyOrPoll { fallback_ms: 1000 },
    ] {
        let latencies = measure(lab, wakeup, events).await?;
        let n = latencies.len();
        out.row(
            format!("{}: p50 / p99 / max ms", wakeup.label()),
            format!(
                "{:.1} / {:.1} / {:.1}",
                percentile(&latencies, 0.50),
                percentile(&latencies, 0.99),
                latencies.last().copied().unwrap_or(f64::NAN)
            ),
            reference(wakeup),
            Verdict::Timing,
        );
        out.row(
            format!("{}: events delivered", wakeup.label()),
            format!("{n} of {events}"),
            "all",
            Verdict::check(n == events),
        );
        curves.push(Series {
            name: wakeup.label(),
            points: latencies
                .iter()
                .enumerate()
                .map(|(i, &ms)| (ms, (i + 1) as f64 / n as f64))
                .collect(),
            mark: Mark::Line,
        });
    }
    out.plots.push(
        plot::xy(
            "Commit-to-receiver latency, CDF",
            "latency ms",
            "fraction of events",
            curves,
        )
        .await?,
    );
    Ok(out)
}

/// Latencies in ms of `events` events, each its first arrival, sorted.
async fn measure(lab: &mut Scratch, wakeup: Wakeup, events: usize) -> anyhow::Result<Vec<f64>> {
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let args = wakeup.relay_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = lab.spawn_relay(&receiver.url(), &args, &[]).await?;
    for i in 0..events {
        // Irregular gaps: 30..75 ms in a fixed pseudo-random sequence.
        tokio::time::sleep(Duration::from_millis(30 + (i as u64 * 37) % 46)).await;
        lab.outbox
            .enqueue(&lab.db, &Scratch::order_event(i as i64, "OrderPlaced"))
            .await?;
    }
    lab.wait_drained("every event published").await?;
    lab.stop_relay(relay).await?;
    // Instants to wall-clock time, through one reading of both clocks.
    let (now_instant, now_epoch) = (Instant::now(), epoch_seconds());
    let arrivals = receiver
        .received()
        .iter()
        .map(|r| Ok((event_id(r)?, now_epoch - (now_instant - r.at).as_secs_f64())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    receiver.shutdown().await;
    let created = lab.created_at::<uuid::Uuid>("event_id").await?;
    Ok(latencies_ms(arrivals, &created).0)
}
