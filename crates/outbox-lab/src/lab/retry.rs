//! `retry`: a failing receiver, seen from the receiver's side.
//!
//! Part 1: the receiver answers 500 to its first three requests; two events
//! (of two orders) wait in the outbox. The relay backs off exponentially
//! per row (200 ms, then 400 ms, …, with jitter) until both are delivered.
//! The attempt log is the receiver's: time, event, status, and the delay
//! since that event's previous attempt.
//!
//! Part 2: a receiver that always answers 500 and `--max-attempts 3`: the
//! row becomes a dead letter after exactly three attempts and the relay
//! stops trying; once the receiver is fixed, `outbox dlq requeue --all`
//! requeues it and it is delivered.

use std::collections::HashMap;
use std::time::Instant;

use outbox_testkit::{Receiver, Respond};

use super::shop::{event_id, order_id};
use crate::plot::{self, Mark, Series};
use crate::report::{Outcome, Table, Verdict};
use crate::scratch::{Scratch, wait_until};

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "retry",
        "Retries with backoff, dead letters, requeue",
        "A receiver that fails is retried with exponential backoff per row, never marked published \
         before it accepted. A row that keeps failing becomes a dead letter, stops being claimed, and \
         is delivered once an operator requeues it.",
        "part 1: 2 events, receiver answers 500 to its first 3 requests, relay --backoff-base 200ms; \
         part 2: 1 event, receiver always 500, --max-attempts 3 --backoff-base 50ms, then \
         `outbox dlq requeue --all` with the receiver fixed"
            .to_owned(),
    );

    // Part 1.
    lab.reset().await?;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 3,
        status: 500,
    })
    .await?;
    let tx = lab.db.transaction().await?;
    for order in 1..=2 {
        lab.outbox
            .enqueue(&tx, &Scratch::order_event(order, "OrderPlaced"))
            .await?;
    }
    tx.commit().await?;
    let relay = lab
        .spawn_relay(&receiver.url(), &["--backoff-base", "200ms"], &[])
        .await?;
    lab.wait_drained("both events published").await?;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    receiver.shutdown().await;

    let start = received.first().map_or_else(Instant::now, |r| r.at);
    let mut last: HashMap<i64, Instant> = HashMap::new();
    let mut attempts: HashMap<i64, usize> = HashMap::new();
    let mut log = Vec::new();
    let mut series: HashMap<u16, Vec<(f64, f64)>> = HashMap::new();
    for r in &received {
        let order = order_id(r)?;
        let n = attempts.entry(order).or_default();
        *n += 1;
        let delay = last.insert(order, r.at).map_or("-".to_owned(), |prev| {
            format!("{:.0}", (r.at - prev).as_secs_f64() * 1000.0)
        });
        let t = (r.at - start).as_secs_f64() * 1000.0;
        series.entry(r.status).or_default().push((t, order as f64));
        log.push(vec![
            format!("{t:.1}"),
            format!("order {order}"),
            n.to_string(),
            r.status.to_string(),
            delay,
        ]);
    }
    out.tables.push(Table {
        title: "attempt log (receiver side)".to_owned(),
        header: [
            "t ms",
            "event",
            "attempt",
            "status",
            "delay since previous attempt ms",
        ]
        .map(str::to_owned)
        .to_vec(),
        rows: log,
    });
    let mut per_event: Vec<usize> = attempts.values().copied().collect();
    per_event.sort_unstable_by(|a, b| b.cmp(a));
    let ok = received.iter().filter(|r| r.status == 200).count();
    out.row(
        "requests: 500 / 200",
        format!("{} / {ok}", received.len() - ok),
        "3 / 2",
        Verdict::check(ok == 2),
    );
    out.row(
        "attempts until delivered, per event",
        format!("{per_event:?}"),
        "[3, 2]",
        Verdict::check(per_event == [3, 2]),
    );
    let mut delays: Vec<String> = Vec::new();
    let mut by_event: HashMap<i64, Vec<Instant>> = HashMap::new();
    for r in &received {
        by_event.entry(order_id(r)?).or_default().push(r.at);
    }
    let mut orders: Vec<_> = by_event.into_iter().collect();
    orders.sort_by_key(|(o, _)| *o);
    for (order, times) in &orders {
        let d: Vec<String> = times
            .windows(2)
            .map(|w| format!("{:.0}", (w[1] - w[0]).as_secs_f64() * 1000.0))
            .collect();
        delays.push(format!("order {order}: {} ms", d.join(" + ")));
    }
    out.row(
        "backoff delays between attempts",
        delays.join("; "),
        "200 + 400 ms",
        Verdict::Timing,
    );
    let mut points: Vec<Series> = series
        .into_iter()
        .map(|(status, points)| Series {
            name: format!("HTTP {status}"),
            points,
            mark: Mark::Points,
        })
        .collect();
    points.sort_by(|a, b| a.name.cmp(&b.name));
    out.plots.push(
        plot::xy(
            "Attempts as the receiver saw them",
            "ms since the first attempt",
            "order",
            points,
        )
        .await?,
    );

    // Part 2.
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Status(500)).await?;
    lab.outbox
        .enqueue(&lab.db, &Scratch::order_event(3, "OrderPlaced"))
        .await?;
    let relay = lab
        .spawn_relay(
            &receiver.url(),
            &["--max-attempts", "3", "--backoff-base", "50ms"],
            &[],
        )
        .await?;
    let dead = format!(
        "SELECT count(*) FROM {} WHERE published_at IS NULL AND attempts >= 3",
        lab.table()
    );
    wait_until("a dead letter", async || Ok(lab.count(&dead).await? == 1)).await?;
    lab.stop_relay(relay).await?;
    let attempts_before_dead = receiver.count();
    let listed = lab
        .run_cli(&["--max-attempts", "3", "dlq", "list", "--json"])
        .await?;
    let listed: serde_json::Value = serde_json::from_str(&listed)?;
    let listed = listed.as_array().map_or(0, Vec::len);
    receiver.set_respond(Respond::Ok);
    lab.run_cli(&["--max-attempts", "3", "dlq", "requeue", "--all"])
        .await?;
    let relay = lab
        .spawn_relay(
            &receiver.url(),
            &["--max-attempts", "3", "--backoff-base", "50ms"],
            &[],
        )
        .await?;
    lab.wait_drained("the requeued event published").await?;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    receiver.shutdown().await;
    let delivered = received.iter().filter(|r| r.status == 200).count();
    let same_event = received
        .iter()
        .map(event_id)
        .collect::<Result<std::collections::HashSet<_>, _>>()?
        .len();
    out.row(
        "attempts before the row became a dead letter (--max-attempts 3)",
        attempts_before_dead,
        "5 (max attempts 5)",
        Verdict::check(attempts_before_dead == 3),
    );
    out.row(
        "dead letters listed by `outbox dlq list`",
        listed,
        "1",
        Verdict::check(listed == 1),
    );
    out.row(
        "after `outbox dlq requeue --all`: delivered / distinct events",
        format!("{delivered} / {same_event}"),
        "1 / 1",
        Verdict::check(delivered == 1 && same_event == 1),
    );
    Ok(out)
}
