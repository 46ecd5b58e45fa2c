//! `ordering`: per-aggregate order with several relays, and what one
//! failure does to it.
//!
//! Plain SKIP LOCKED (`--ordering none`) lets two relays take neighbouring
//! batches and finish them in either order, so an order's later event can
//! overtake an earlier one. `partition` gives each aggregate to one relay at
//! a time (leases on hash partitions): in id order while nothing fails.
//! `strict` also never sends past an undelivered earlier event of the
//! aggregate, so a failure holds its aggregate back (head-of-line
//! blocking) instead of reordering it. A violation is an order whose three
//! events did not first arrive as #1, #2, #3.

use std::collections::HashMap;
use std::time::Instant;

use outbox::Event;
use outbox_testkit::{Post, Receiver, Respond, Spawned};
use serde_json::json;

use crate::report::{Outcome, Table, Verdict};
use crate::scratch::{Scratch, wait_until};

const PER_ORDER: i64 = 3;
/// Leases move within this; short, so a run balances in a few seconds.
const LEASE: &str = "3s";

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let orders: i64 = if lab.quick { 100 } else { 300 };
    let mut out = Outcome::new(
        "ordering",
        "Per-aggregate order: none, partition, strict",
        "Several relays speed delivery up only if they do not reorder an aggregate's events. Plain SKIP \
         LOCKED does; partition leases do not while nothing fails; strict also keeps order across a failure, \
         at the price of holding the aggregate back.",
        format!(
            "{orders} orders × {PER_ORDER} events (each order's events consecutive ids), committed at once while \
             1, 2 or 4 relays run (partition/strict: after the leases are balanced, --lease-timeout {LEASE}); \
             HTTP receiver; one-failure case: 1 relay, 2 orders × 3 events, the first request answered 500"
        ),
    );
    let mut matrix = Vec::new();
    for mode in ["none", "partition", "strict"] {
        for relays in [1, 2, 4] {
            lab.step(&format!("ordering: {mode}, {relays} relay(s)"));
            let (violations, per_second) = run_once(lab, mode, relays, orders).await?;
            // `none` promises no order; one relay of it keeps id order anyway.
            let verdict = match (mode, relays) {
                ("none", 1) => Verdict::Timing,
                ("none", _) => Verdict::naive(violations > 0),
                _ => Verdict::check(violations == 0),
            };
            let reference = match (mode, relays) {
                ("none", 1) => "0 (one relay keeps id order)",
                ("none", 2) => "25–30 of 300",
                ("none", _) => "some",
                _ => "0",
            };
            out.row(
                format!("{mode}, {relays} relay(s): orders out of order"),
                format!("{violations} of {orders}"),
                reference,
                verdict,
            );
            matrix.push(vec![
                mode.to_owned(),
                relays.to_string(),
                format!("{per_second:.0}"),
            ]);
        }
    }
    out.tables.push(Table {
        title:
            "throughput: events/s from commit to the last arrival (reference: ~10% more with more relays, \
                receiver-bound)"
                .to_owned(),
        header: ["mode", "relays", "events/s"].map(str::to_owned).to_vec(),
        rows: matrix,
    });

    for mode in ["partition", "strict"] {
        lab.step(&format!("ordering: one failure, {mode}"));
        let sequence = one_failure(lab, mode).await?;
        let shown = sequence.join(", ");
        let (reference, verdict) = if mode == "strict" {
            (
                "2#1, 2#2, 2#3, 1#1, 1#2, 1#3",
                Verdict::check(in_order(&sequence)),
            )
        } else {
            ("1#2, 1#3, 2#1, 2#2, 2#3, 1#1 (plain relay)", Verdict::Timing)
        };
        out.row(
            format!("one failure, {mode}: receive order (2xx)"),
            shown,
            reference,
            verdict,
        );
    }
    Ok(out)
}

/// Events of `orders` orders through `relays` relays in `mode`: returns
/// (orders out of order, events/s).
async fn run_once(lab: &mut Scratch, mode: &str, relays: usize, orders: i64) -> anyhow::Result<(usize, f64)> {
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let running = start_relays(lab, &receiver, mode, relays).await?;
    let events: Vec<Event> = (1..=orders)
        .flat_map(|o| (1..=PER_ORDER).map(move |seq| step(o, seq)))
        .collect();
    let started = Instant::now();
    let tx = lab.db.transaction().await?;
    for chunk in events.chunks(1000) {
        lab.outbox.enqueue_all(&tx, chunk).await?;
    }
    tx.commit().await?;
    lab.wait_drained("every event published").await?;
    let seconds = started.elapsed().as_secs_f64();
    for relay in running {
        lab.stop_relay(relay).await?;
    }
    let received = receiver.received();
    receiver.shutdown().await;
    Ok((violations(&received), events.len() as f64 / seconds))
}

/// Starts `n` relays; with leases, returns once they share the partitions.
async fn start_relays(
    lab: &Scratch,
    receiver: &Receiver,
    mode: &str,
    n: usize,
) -> anyhow::Result<Vec<Spawned>> {
    let mut relays = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("lab-{i}");
        relays.push(
            lab.spawn_relay(
                &receiver.url(),
                &[
                    "--ordering",
                    mode,
                    "--lease-timeout",
                    LEASE,
                    "--relay-name",
                    &name,
                ],
                &[],
            )
            .await?,
        );
    }
    if mode != "none" {
        wait_until("the relays to share the partitions", async || {
            balanced(lab, n).await
        })
        .await?;
    }
    Ok(relays)
}

/// `n` live relays hold every partition, each its fair share rounded.
async fn balanced(lab: &Scratch, n: usize) -> anyhow::Result<bool> {
    let report: serde_json::Value = serde_json::from_str(&lab.run_cli(&["relays", "--json"]).await?)?;
    let live = report["relays"].as_array().cloned().unwrap_or_default();
    let held: Vec<usize> = live
        .iter()
        .map(|r| r["partitions"].as_array().map_or(0, Vec::len))
        .collect();
    let total: usize = held.iter().sum::<usize>() + report["unowned"].as_array().map_or(0, Vec::len);
    let (low, high) = (total / n, total.div_ceil(n));
    Ok(live.len() == n
        && report["unowned"].as_array().is_some_and(Vec::is_empty)
        && held.iter().all(|h| (low..=high).contains(h)))
}

/// One relay, two orders of three events, the very first request failing.
/// Returns the accepted events in arrival order, as `order#seq`.
async fn one_failure(lab: &mut Scratch, mode: &str) -> anyhow::Result<Vec<String>> {
    lab.reset().await?;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 1,
        status: 500,
    })
    .await?;
    let events: Vec<Event> = (1..=2)
        .flat_map(|o| (1..=PER_ORDER).map(move |seq| step(o, seq)))
        .collect();
    lab.outbox.enqueue_all(&lab.db, &events).await?;
    let relays = start_relays(lab, &receiver, mode, 1).await?;
    lab.wait_drained("every event published").await?;
    for relay in relays {
        lab.stop_relay(relay).await?;
    }
    let received = receiver.received();
    receiver.shutdown().await;
    Ok(received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| format!("{}#{}", r.body["payload"]["order_id"], r.body["payload"]["seq"]))
        .collect())
}

fn step(order: i64, seq: i64) -> Event {
    Event::new(
        "orders",
        order.to_string(),
        format!("Step{seq}"),
        json!({"order_id": order, "seq": seq}),
    )
}

/// Orders whose events did not first arrive in sequence.
fn violations(received: &[Post]) -> usize {
    let mut seen: HashMap<i64, Vec<i64>> = HashMap::new();
    for r in received.iter().filter(|r| r.status == 200) {
        let (Some(order), Some(seq)) = (
            r.body["payload"]["order_id"].as_i64(),
            r.body["payload"]["seq"].as_i64(),
        ) else {
            continue;
        };
        let arrivals = seen.entry(order).or_default();
        if !arrivals.contains(&seq) {
            arrivals.push(seq);
        }
    }
    seen.values()
        .filter(|seqs| seqs.windows(2).any(|w| w[0] > w[1]))
        .count()
}

/// Each order's events in sequence within `order#seq` labels.
fn in_order(sequence: &[String]) -> bool {
    let mut last: HashMap<&str, i64> = HashMap::new();
    sequence.iter().all(|label| {
        let (order, seq) = label.split_once('#').unwrap_or((label, "0"));
        let seq: i64 = seq.parse().unwrap_or(0);
        let previous = last.insert(order, seq).unwrap_or(0);
        seq > previous
    })
}
