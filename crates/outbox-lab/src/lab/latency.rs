//! `latency`: what NOTIFY buys over polling.
//!
//! A writer commits one event per transaction at irregular intervals while
//! the relay runs; latency is the receiver's arrival time minus the row's
//! `created_at` (the INSERT's `clock_timestamp()`, just before COMMIT).
//! A polling relay finds a row on its next poll: on average half an
//! interval late, at worst a whole one. With LISTEN/NOTIFY the commit
//! wakes it. Both clocks are this host's; with a remote `DATABASE_URL`,
//! clock skew is part of the figure.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_testkit::{Receiver, Respond};

use super::super::bench::latency::percentile;
use super::plot::{self, Mark, Series};
use super::report::{Outcome, Verdict};
use super::scratch::{Lab, event_id, wait_until};

/// How the relay learns about new rows.
#[derive(Debug, Clone, Copy)]
enum Wakeup {
    Poll(u64),
    Notify,
}

impl Wakeup {
    fn label(self) -> String {
        match self {
            Wakeup::Poll(ms) => format!("poll {ms} ms"),
            Wakeup::Notify => "NOTIFY (+1 s fallback poll)".to_owned(),
        }
    }

    fn args(self) -> Vec<String> {
        match self {
            Wakeup::Poll(ms) => vec!["--no-notify".into(), "--poll-interval".into(), format!("{ms}ms")],
            Wakeup::Notify => vec!["--poll-interval".into(), "1s".into()],
        }
    }

    fn reference(self) -> &'static str {
        match self {
            Wakeup::Poll(1000) => "p50 507.6 ms, max 1003.0 ms",
            Wakeup::Poll(_) => "p50 ≈ interval/2, max ≈ interval",
            Wakeup::Notify => "about 6 ms",
        }
    }
}

pub(super) async fn run(lab: &mut Lab) -> anyhow::Result<Outcome> {
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
        Wakeup::Poll(1000),
        Wakeup::Poll(200),
        Wakeup::Poll(100),
        Wakeup::Notify,
    ] {
        let mut latencies = measure(lab, wakeup, events).await?;
        latencies.sort_by(f64::total_cmp);
        let n = latencies.len();
        out.row(
            format!("{}: p50 / p99 / max ms", wakeup.label()),
            format!(
                "{:.1} / {:.1} / {:.1}",
                percentile(&latencies, 0.50),
                percentile(&latencies, 0.99),
                latencies.last().copied().unwrap_or(f64::NAN)
            ),
            wakeup.reference(),
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

/// Latencies in ms of `events` events, each its first arrival.
async fn measure(lab: &mut Lab, wakeup: Wakeup, events: usize) -> anyhow::Result<Vec<f64>> {
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let args = wakeup.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = lab.spawn_relay(&receiver.url(), &args, &[]).await?;
    for i in 0..events {
        // Irregular gaps: 30..75 ms in a fixed pseudo-random sequence.
        tokio::time::sleep(Duration::from_millis(30 + (i as u64 * 37) % 46)).await;
        lab.outbox
            .enqueue(&lab.db, &Lab::order_event(i as i64, "OrderPlaced"))
            .await?;
    }
    wait_until(
        "every event published",
        async || Ok(lab.unpublished().await? == 0),
    )
    .await?;
    lab.stop_relay(relay).await?;
    // Instants to wall-clock time, through one reading of both clocks.
    let (now_instant, now_epoch) = (Instant::now(), epoch_seconds());
    let mut arrived: HashMap<uuid::Uuid, f64> = HashMap::new();
    for r in receiver.received() {
        let at = now_epoch - (now_instant - r.at).as_secs_f64();
        arrived.entry(event_id(&r)?).or_insert(at);
    }
    receiver.shutdown().await;
    let rows = lab
        .db
        .query(
            &format!(
                "SELECT event_id, extract(epoch FROM created_at)::float8 FROM {}",
                lab.table()
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .filter_map(|row| {
            let (id, created): (uuid::Uuid, f64) = (row.get(0), row.get(1));
            arrived.get(&id).map(|at| (at - created) * 1000.0)
        })
        .collect())
}

fn epoch_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
