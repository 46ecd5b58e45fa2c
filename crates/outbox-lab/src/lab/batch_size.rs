//! `batch-size`: the one knob that trades speed for re-sends.
//!
//! At batch size 1 the relay pays a claim, a mark and a COMMIT per event;
//! bigger batches share them, until the sink is the limit and throughput
//! plateaus. The price of a big batch shows after a crash between deliver
//! and mark: the whole batch is sent again. Throughput is the bench's own
//! drain (`outbox-lab bench`'s relay strategy: N events pre-inserted, drained
//! to a Redis stream by `outbox relay` as a child process); the re-sends are
//! counted at the HTTP receiver after a kill -9 at the
//! `pause-after-deliver` failpoint.

use std::collections::HashSet;

use outbox_testkit::{Receiver, Respond};

use super::shop::event_id;
use crate::bench::throughput::Strategy;
use crate::plot::{self, Mark, Series};
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch};

const BATCHES: [u32; 4] = [1, 10, 100, 1000];

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    // The reference drains 10,000, as here; `--quick` shrinks it for CI.
    let events: usize = if lab.quick { 300 } else { 10_000 };
    let mut out = Outcome::new(
        "batch-size",
        "Batch size: throughput vs re-sends after a crash",
        "Bigger batches amortise the claim, the mark and the COMMIT; past the sink's own limit they \
         buy nothing but more re-sends when the relay dies between delivering and marking.",
        format!(
            "throughput: {events} events (reference: 10,000) pre-inserted, drained by `outbox relay --batch-size B` to a Redis \
             stream (the bench's drain); re-sends: 2×B events, relay killed at the pause-after-deliver \
             failpoint after its first batch, then a fresh relay, counted at an HTTP receiver"
        ),
    );
    let redis_url = lab.redis_url().await?;
    let mut bench = Scratch::bench(lab.pg.clone(), lab.pg_url.clone(), Some(redis_url)).await?;
    let mut throughput = Vec::new();
    let mut resends = Vec::new();
    for batch in BATCHES {
        lab.step(&format!("batch-size: drain at batch {batch}"));
        let run = bench.drain(Strategy::Relay, events, batch).await?;
        let per_second = events as f64 / run.seconds;
        out.row(
            format!("batch {batch}: events/s"),
            format!("{per_second:.0}"),
            "plateau from ~100",
            Verdict::Timing,
        );
        out.row(
            format!("batch {batch}: delivered / marked / duplicates"),
            format!("{} / {} / {}", run.delivered, run.marked, run.duplicates),
            format!("{events} / {events} / 0"),
            Verdict::check(run.delivered == events as u64 && run.marked == events as u64),
        );
        lab.step(&format!("batch-size: crash at batch {batch}"));
        let (sent_again, lost) = crash(lab, batch).await?;
        out.row(
            format!("batch {batch}: re-sent after a crash before mark / lost"),
            format!("{sent_again} / {lost}"),
            "grows with the batch / 0",
            Verdict::check(lost == 0),
        );
        throughput.push((f64::from(batch).log10(), per_second));
        resends.push((f64::from(batch).log10(), sent_again as f64));
    }
    bench.drop_all().await?;
    out.plots.push(
        plot::xy(
            "Relay throughput by batch size",
            "log10(batch size)",
            "events/s",
            vec![Series {
                name: "outbox relay → Redis".to_owned(),
                points: throughput,
                mark: Mark::Line,
            }],
        )
        .await?,
    );
    out.plots.push(
        plot::xy(
            "Events sent twice after one crash before mark",
            "log10(batch size)",
            "re-sent events",
            vec![Series {
                name: "re-sends".to_owned(),
                points: resends,
                mark: Mark::Line,
            }],
        )
        .await?,
    );
    Ok(out)
}

/// 2×`batch` events; the relay parked after delivering its first batch is
/// killed, a fresh one delivers the rest. Returns (events received more
/// than once, events never received).
async fn crash(lab: &mut Scratch, batch: u32) -> anyhow::Result<(usize, usize)> {
    lab.reset().await?;
    let n = 2 * batch as usize;
    let events: Vec<_> = (0..n as i64)
        .map(|i| Scratch::order_event(i, "OrderPlaced"))
        .collect();
    lab.insert(&events).await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let b = batch.to_string();
    let mut relay = lab
        .spawn_relay_parked(&receiver.url(), &["--batch-size", &b], "pause-after-deliver")
        .await?;
    relay.kill()?;
    relay.wait(LONG).await?;
    let relay = lab
        .spawn_relay(&receiver.url(), &["--batch-size", &b], &[])
        .await?;
    lab.wait_drained("every event published after the crash").await?;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    receiver.shutdown().await;
    let distinct: HashSet<_> = received.iter().map(event_id).collect::<Result<_, _>>()?;
    Ok((received.len() - distinct.len(), n - distinct.len()))
}
