//! `wal`: log tailing beside polling, at lab scale.
//!
//! The polling relay claims rows: each is marked published by an UPDATE
//! (a dead tuple, and a published row `outbox cleanup` deletes later). The
//! WAL source (`relay --source wal`) reads the inserts from a replication
//! slot and deletes what it delivered; `Outbox::emit` writes no row at
//! all, only a logical decoding message. The experiment drains the same
//! events the three ways (the bench's drain, `outbox-lab bench --source wal`
//! at lab scale), counts the WAL and the dead tuples each leaves, and
//! stops the sink while a writer keeps going: the slot holds the WAL back
//! until the sink returns, then the relay catches up. The reference design
//! has no log tailing; the reference column gives the targets.

use std::time::Duration;

use crate::bench::dead_tuples::{self, DeadTuplesRun};
use crate::bench::outage::{self, OutageRun};
use crate::bench::throughput::{Run, Strategy};
use crate::plot::{self, Mark, Series};
use crate::report::{Outcome, Verdict};
use crate::scratch::Scratch;

const BATCH: u32 = 100;
const DRAINS: [Strategy; 3] = [Strategy::Relay, Strategy::Wal, Strategy::Emit];

/// This run's sizes.
struct Sizes {
    events: usize,
    dead_events: usize,
    outage: Duration,
    rate: u32,
}

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let sizes = if lab.quick {
        Sizes {
            events: 300,
            dead_events: 1000,
            outage: Duration::from_secs(3),
            rate: 500,
        }
    } else {
        Sizes {
            events: 10_000,
            dead_events: 10_000,
            outage: Duration::from_secs(10),
            rate: 1000,
        }
    };
    let out = Outcome::new(
        "wal",
        "Log tailing: the WAL source and emit beside polling",
        "Polling marks every row it delivers, an UPDATE that leaves a dead tuple and a published row \
         to delete later. Reading the inserts from the WAL needs no claim: the WAL source deletes what \
         it delivered, and an emitted event never had a row. While the sink is down nothing is read, \
         so the replication slot holds the WAL back until the sink returns.",
        format!(
            "throughput: {} events written, then drained at batch {BATCH} to a Redis stream by `outbox relay` \
             (polling), `outbox relay --source wal` (a fresh slot; delivered rows deleted) and the same with \
             the events written by `Outbox::emit_all`; WAL and PostgreSQL CPU from before the writes to after \
             the drain. Dead tuples: {} events each, autovacuum off on the table. Outage: its own \
             redis-server stopped for {} s while a writer commits {} events/s, then started again",
            sizes.events,
            sizes.dead_events,
            sizes.outage.as_secs(),
            sizes.rate
        ),
    );
    let redis_url = lab.redis_url().await?;
    let mut bench = Scratch::bench(lab.pg.clone(), lab.pg_url.clone(), Some(redis_url)).await?;
    let result = measure(lab, &mut bench, &sizes, out).await;
    // The slot goes also when a step failed: it would keep WAL forever.
    let dropped = bench.drop_all().await;
    let out = result?;
    dropped?;
    Ok(out)
}

async fn measure(
    lab: &Scratch,
    bench: &mut Scratch,
    sizes: &Sizes,
    mut out: Outcome,
) -> anyhow::Result<Outcome> {
    let mut drains = Vec::new();
    for strategy in DRAINS {
        lab.step(&format!("wal: drain, {}", strategy.label()));
        drains.push(bench.drain(strategy, sizes.events, BATCH).await?);
    }
    throughput_rows(&mut out, sizes.events as u64, &drains);

    let mut dead = Vec::new();
    for strategy in DRAINS {
        lab.step(&format!("wal: dead tuples, {}", strategy.label()));
        dead.push(dead_tuples::measure(bench, strategy, sizes.dead_events, BATCH).await?);
    }
    dead_tuple_rows(&mut out, sizes.dead_events, &dead);

    let mut outages = Vec::new();
    for strategy in [Strategy::Relay, Strategy::Wal] {
        lab.step(&format!("wal: sink outage, {}", strategy.label()));
        outages.push(outage::measure(bench, strategy, sizes.outage, sizes.rate, BATCH).await?);
    }
    let [poll, wal] = &outages[..] else {
        unreachable!("two outages were measured")
    };
    outage_rows(&mut out, poll, wal, &drains);
    out.plots.push(backlog_plot(poll, wal).await?);
    out.plots.push(retained_plot(wal).await?);
    Ok(out)
}

/// `a / b / c` of the three drains.
fn three(drains: &[Run], f: impl Fn(&Run) -> String) -> String {
    drains.iter().map(f).collect::<Vec<_>>().join(" / ")
}

fn throughput_rows(out: &mut Outcome, events: u64, drains: &[Run]) {
    let [poll, wal, emit] = drains else {
        unreachable!("three drains were measured")
    };
    let rate = |r: &Run| events as f64 / r.seconds;
    out.row(
        format!("events/s at batch {BATCH}: polling / WAL source / emit"),
        three(drains, |r| format!("{:.0}", rate(r))),
        "WAL ≥ 1.5 × polling, emit ≥ 2 × (targets)",
        Verdict::Timing,
    );
    out.row(
        "WAL source ÷ polling / emit ÷ polling",
        format!("{:.2} / {:.2}", rate(wal) / rate(poll), rate(emit) / rate(poll)),
        "≥ 1.5 / ≥ 2",
        Verdict::Timing,
    );
    out.row(
        "delivered (distinct) / duplicates: polling; WAL source; emit",
        drains
            .iter()
            .map(|r| format!("{} / {}", r.delivered, r.duplicates))
            .collect::<Vec<_>>()
            .join("; "),
        format!("{events} each"),
        Verdict::check(drains.iter().all(|r| r.delivered == events)),
    );
    out.row(
        "rows left after the drain: polling (published) / WAL source / emit",
        three(drains, |r| r.rows_left.to_string()),
        format!("{events} / 0 / 0"),
        Verdict::check(poll.marked == events && wal.rows_left == 0 && emit.rows_left == 0),
    );
    out.row(
        "WAL bytes per event, writing and draining: polling / WAL source / emit",
        three(drains, |r| format!("{:.0}", r.cost.wal_bytes_per_event(events))),
        "WAL source ≤ 60% of polling (target)",
        Verdict::Timing,
    );
    out.row(
        "PostgreSQL CPU ms per 1,000 events: polling / WAL source / emit",
        three(drains, |r| {
            r.cost
                .cpu_ms_per_1000(events)
                .map_or("-".to_owned(), |ms| format!("{ms:.1}"))
        }),
        "-",
        Verdict::Timing,
    );
    let rss = [wal, emit].iter().filter_map(|r| r.peak_rss).max();
    out.row(
        "relay peak RSS: polling / WAL source",
        format!(
            "{} / {}",
            poll.peak_rss.map_or("-".to_owned(), mb),
            rss.map_or("-".to_owned(), mb)
        ),
        "≤ 20 MB (target)",
        Verdict::Timing,
    );
}

fn dead_tuple_rows(out: &mut Outcome, events: usize, dead: &[DeadTuplesRun]) {
    let [_, _, emit] = dead else {
        unreachable!("three strategies were measured")
    };
    out.row(
        format!("after {events} events: dead / live tuples, polling; WAL source; emit"),
        dead.iter()
            .map(|r| format!("{} / {}", r.dead, r.live))
            .collect::<Vec<_>>()
            .join("; "),
        format!("up to {events} / {events}; up to {events} / 0; 0 / 0"),
        Verdict::Timing,
    );
    out.row(
        "emit: dead tuples / rows in the table",
        format!("{} / {}", emit.dead, emit.live),
        "0 / 0",
        Verdict::check(emit.dead == 0 && emit.live == 0),
    );
    out.row(
        "dead-tuple runs: delivered of written",
        dead.iter()
            .map(|r| format!("{}/{}", r.delivered, r.events))
            .collect::<Vec<_>>()
            .join("; "),
        "all",
        Verdict::check(dead.iter().all(|r| r.delivered == r.events)),
    );
}

fn outage_rows(out: &mut Outcome, poll: &OutageRun, wal: &OutageRun, drains: &[Run]) {
    let retained = wal.retained_max_bytes.unwrap_or(0);
    out.row(
        format!(
            "sink down {:.0} s, {} events written meanwhile: WAL the slot retained",
            wal.outage_seconds, wal.written_during_outage
        ),
        format!(
            "{} ({:.0} bytes per event)",
            mb(retained.max(0) as u64),
            retained as f64 / wal.written_during_outage.max(1) as f64
        ),
        "grows with the backlog",
        Verdict::Timing,
    );
    out.row(
        "catch-up after the sink returned, events/s: polling / WAL source",
        format!("{:.0} / {:.0}", poll.catch_up_per_second, wal.catch_up_per_second),
        "≥ 30,000 (WAL source, target)",
        Verdict::Timing,
    );
    out.row(
        "sink back → first delivery: polling / WAL source",
        format!("{:.2} s / {:.2} s", poll.resume_seconds, wal.resume_seconds),
        "the breaker probes at most every 1 s",
        Verdict::Timing,
    );
    out.row(
        "after the outage: delivered of written, polling; WAL source",
        format!(
            "{}/{}; {}/{}",
            poll.delivered, poll.written, wal.delivered, wal.written
        ),
        "all",
        Verdict::check(poll.delivered == poll.written && wal.delivered == wal.written),
    );
    let peak = wal
        .peak_rss
        .into_iter()
        .chain(drains.iter().skip(1).filter_map(|r| r.peak_rss))
        .max();
    out.row(
        "relay peak RSS through the outage and catch-up, WAL source",
        peak.map_or("-".to_owned(), mb),
        "≤ 20 MB (target)",
        Verdict::Timing,
    );
}

/// Events written and not yet in the stream, over time.
async fn backlog_plot(poll: &OutageRun, wal: &OutageRun) -> anyhow::Result<crate::report::Plot> {
    let series = |name: &str, run: &OutageRun| Series {
        name: name.to_owned(),
        points: run
            .samples
            .iter()
            .map(|s| {
                let delivered = s.delivered.unwrap_or(run.delivered_before);
                (s.t, s.written.saturating_sub(delivered) as f64)
            })
            .collect(),
        mark: Mark::Line,
    };
    plot::xy(
        "Undelivered events through a sink outage and the catch-up",
        "seconds since the sink stopped",
        "events written, not delivered",
        vec![series("polling relay", poll), series("WAL source", wal)],
    )
    .await
}

/// The WAL the slot held back, over time.
async fn retained_plot(wal: &OutageRun) -> anyhow::Result<crate::report::Plot> {
    plot::xy(
        "WAL the replication slot retains through a sink outage",
        "seconds since the sink stopped",
        "retained WAL, MB",
        vec![Series {
            name: "WAL source".to_owned(),
            points: wal
                .samples
                .iter()
                .filter_map(|s| s.retained.map(|b| (s.t, b as f64 / 1_048_576.0)))
                .collect(),
            mark: Mark::Line,
        }],
    )
    .await
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1_048_576.0)
}
