//! The bench's figures: medians with ranges per phase, ratios, their
//! tables (rendered by the shared `report.rs`) and JSON, and the correctness
//! check that decides the exit code (speed never does). The figures only
//! `--source wal` measures (dead tuples, outage, the targets) are in
//! `wal_results.rs`.

use anyhow::bail;
use serde::Serialize;

use super::Measured;
use super::fleet_results::FleetRow;
use super::held_snapshot::HeldRow;
use super::idle::IdleRun;
use super::latency::{Clock, LatencyRun};
use super::pooled::{PooledLatencyRow, PooledRow, Route};
use super::throughput::{Run, Strategy};
use super::wal_results::{DeadTuplesRow, OutageRow, SourceRatio, Target};
use super::writer::{Shape, WriterRun};
use crate::latency::Wakeup;
use crate::report::{Col, Spread, Table};

const LATENCY: [Col; 6] = [
    Col::Left(18),
    Col::Right(6),
    Col::Right(26),
    Col::Right(26),
    Col::Right(26),
    Col::Right(9),
];
/// The last column is the unit.
const IDLE: [Col; 3] = [Col::Left(14), Col::Right(26), Col::Left(0)];
const WRITER: [Col; 3] = [Col::Left(34), Col::Right(24), Col::Right(24)];
const THROUGHPUT: [Col; 9] = [
    Col::Left(32),
    Col::Right(6),
    Col::Right(28),
    Col::Right(9),
    Col::Right(10),
    Col::Right(5),
    Col::Right(10),
    Col::Right(12),
    Col::Right(9),
];

const POOLED: [Col; 7] = [
    Col::Left(30),
    Col::Left(9),
    Col::Right(6),
    Col::Right(28),
    Col::Right(10),
    Col::Right(10),
    Col::Right(5),
];
const POOLED_LATENCY: [Col; 6] = [
    Col::Left(36),
    Col::Right(6),
    Col::Right(26),
    Col::Right(26),
    Col::Right(26),
    Col::Right(9),
];
/// The batch size the target (transaction pool ≥ 70% of direct)
/// is stated at.
const POOLED_TARGET_BATCH: u32 = 100;

/// One strategy at one batch size.
#[derive(Debug, Serialize)]
pub(super) struct Row {
    pub(super) strategy: Strategy,
    pub(super) batch_size: u32,
    pub(super) events_per_second: Spread,
    pub(super) seconds: Spread,
    /// PostgreSQL CPU ms per 1,000 events, writing and draining them;
    /// `None` when the server is not on this host.
    pub(super) pg_cpu_ms_per_1000: Option<Spread>,
    /// WAL bytes per event, writing and draining them.
    pub(super) wal_bytes_per_event: Spread,
    pub(super) runs: Vec<Run>,
    #[serde(skip)]
    events: usize,
}

impl Row {
    fn new(strategy: Strategy, batch_size: u32, events: usize, runs: Vec<Run>) -> Self {
        let n = events as u64;
        let cpu: Option<Vec<f64>> = runs.iter().map(|r| r.cost.cpu_ms_per_1000(n)).collect();
        Self {
            strategy,
            batch_size,
            events_per_second: Spread::of(runs.iter().map(|r| events as f64 / r.seconds)),
            seconds: Spread::of(runs.iter().map(|r| r.seconds)),
            pg_cpu_ms_per_1000: cpu.map(Spread::of),
            wal_bytes_per_event: Spread::of(runs.iter().map(|r| r.cost.wal_bytes_per_event(n))),
            runs,
            events,
        }
    }
}

/// Relay throughput as a share of another strategy's, at one batch size.
#[derive(Debug, Serialize)]
pub(super) struct Ratio {
    pub(super) batch_size: u32,
    pub(super) relay_over_floor: f64,
    pub(super) relay_over_naive: f64,
}

/// Latency in one wake-up mode.
#[derive(Debug, Serialize)]
pub(super) struct LatencyRow {
    pub(super) wakeup: Wakeup,
    pub(super) rate: u32,
    pub(super) p50_ms: Spread,
    pub(super) p99_ms: Spread,
    pub(super) max_ms: Spread,
    pub(super) runs: Vec<LatencyRun>,
}

/// Idle transactions in one wake-up mode.
#[derive(Debug, Serialize)]
pub(super) struct IdleRow {
    pub(super) wakeup: Wakeup,
    pub(super) transactions_per_second: Spread,
    pub(super) runs: Vec<IdleRun>,
}

/// One writer shape.
#[derive(Debug, Serialize)]
pub(super) struct WriterRow {
    pub(super) shape: Shape,
    pub(super) events_per_transaction: usize,
    pub(super) transactions_per_second: Spread,
    pub(super) events_per_second: Spread,
    pub(super) runs: Vec<WriterRun>,
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) source: Measured,
    pub(super) events: usize,
    pub(super) reps: usize,
    /// True when PostgreSQL was the bench's own throwaway cluster (fsync=off).
    pub(super) throwaway_postgres: bool,
    pub(super) throughput: Vec<Row>,
    pub(super) ratios: Vec<Ratio>,
    /// `--source wal`: the WAL source over the polling relay, per batch size.
    pub(super) source_ratios: Vec<SourceRatio>,
    pub(super) latency: Vec<LatencyRow>,
    pub(super) idle: Vec<IdleRow>,
    pub(super) writer: Vec<WriterRow>,
    pub(super) dead_tuples: Vec<DeadTuplesRow>,
    pub(super) outage: Vec<OutageRow>,
    pub(super) held_snapshot: Vec<HeldRow>,
    /// Whether the server could run the WAL source (the held-snapshot
    /// phase leaves it out otherwise).
    pub(super) wal_level_logical: bool,
    /// `--source wal`: each target beside its figure (reported, never
    /// judged).
    pub(super) targets: Vec<Target>,
    /// The pooled phase: each route, claim mode and batch size.
    pub(super) pooled: Vec<PooledRow>,
    /// The pooled phase's latency, each way of waking.
    pub(super) pooled_latency: Vec<PooledLatencyRow>,
    /// The fleet phase (`fleet_results.rs`).
    pub(super) fleet: Option<FleetRow>,
}

impl Report {
    pub(super) fn new(source: Measured, events: usize, reps: usize, throwaway_postgres: bool) -> Self {
        Self {
            source,
            events,
            reps,
            throwaway_postgres,
            throughput: Vec::new(),
            ratios: Vec::new(),
            source_ratios: Vec::new(),
            latency: Vec::new(),
            idle: Vec::new(),
            writer: Vec::new(),
            dead_tuples: Vec::new(),
            outage: Vec::new(),
            held_snapshot: Vec::new(),
            wal_level_logical: false,
            targets: Vec::new(),
            pooled: Vec::new(),
            pooled_latency: Vec::new(),
            fleet: None,
        }
    }

    pub(super) fn add_pooled(&mut self, row: PooledRow) {
        self.pooled.push(row);
    }

    pub(super) fn add_pooled_latency(&mut self, row: PooledLatencyRow) {
        self.pooled_latency.push(row);
    }

    /// The median rate of `row` as a share of the direct relay's with the
    /// same claim mode and batch size.
    fn of_direct(&self, row: &PooledRow) -> Option<f64> {
        let direct = self
            .pooled
            .iter()
            .find(|r| r.route == Route::Direct && r.claim == row.claim && r.batch_size == row.batch_size)?;
        Some(row.events_per_second.median / direct.events_per_second.median)
    }

    fn print_pooled(&self) {
        let Some(events) = self.pooled.first().map(|r| r.events) else {
            return;
        };
        let mut t = Table::new(
            format!("pooled: {events} events per drain, relay → redis"),
            &[
                "route",
                "claim",
                "batch",
                "events/s",
                "of direct",
                "delivered",
                "dup",
            ],
        );
        for r in &self.pooled {
            let delivered = r.runs.iter().map(|x| x.delivered).min().unwrap_or(0);
            let dup = r.runs.iter().map(|x| x.duplicates).max().unwrap_or(0);
            t.rows.push(vec![
                r.route.label().to_owned(),
                r.claim.to_owned(),
                r.batch_size.to_string(),
                r.events_per_second.show(0),
                self.of_direct(r)
                    .map_or("-".to_owned(), |x| format!("{:.0}%", x * 100.0)),
                delivered.to_string(),
                dup.to_string(),
            ]);
        }
        t.print_fixed(&POOLED);
        for r in self
            .pooled
            .iter()
            .filter(|r| r.route == Route::Transaction && r.batch_size == POOLED_TARGET_BATCH)
        {
            if let Some(share) = self.of_direct(r) {
                println!(
                    "target (issue 32): PgBouncer transaction ≥ 70% of direct at batch {POOLED_TARGET_BATCH}, {} claims: {:.0}%, {}",
                    r.claim,
                    share * 100.0,
                    if share >= 0.7 { "met" } else { "not met" }
                );
            }
        }
        if !self.pooled_latency.is_empty() {
            let mut t = Table::new(
                "pooled latency: created_at → consumer XREAD, one event per transaction",
                &["wake-up", "ev/s", "p50 ms", "p99 ms", "max ms", "received"],
            );
            for r in &self.pooled_latency {
                let received = r.runs.iter().map(|x| x.received).min().unwrap_or(0);
                let written = r.runs.iter().map(|x| x.written).max().unwrap_or(0);
                t.rows.push(vec![
                    r.waking.label().to_owned(),
                    r.rate.to_string(),
                    r.p50_ms.show(2),
                    r.p99_ms.show(2),
                    r.max_ms.show(2),
                    format!("{received}/{written}"),
                ]);
            }
            t.print_fixed(&POOLED_LATENCY);
        }
    }

    /// The throughput row of `strategy` at `batch_size`, if measured.
    pub(super) fn row(&self, strategy: Strategy, batch_size: u32) -> Option<&Row> {
        self.throughput
            .iter()
            .find(|r| r.strategy == strategy && r.batch_size == batch_size)
    }

    /// Adds a throughput row; once a batch size has all three strategies,
    /// its ratios.
    pub(super) fn add_throughput(&mut self, strategy: Strategy, batch_size: u32, runs: Vec<Run>) {
        self.throughput
            .push(Row::new(strategy, batch_size, self.events, runs));
        self.add_source_ratio(batch_size);
        let median = |s: Strategy| self.row(s, batch_size).map(|r| r.events_per_second.median);
        if let (Some(relay), Some(floor), Some(naive)) = (
            median(Strategy::Relay),
            median(Strategy::Floor),
            median(Strategy::Naive),
        ) && !self.ratios.iter().any(|r| r.batch_size == batch_size)
        {
            self.ratios.push(Ratio {
                batch_size,
                relay_over_floor: relay / floor,
                relay_over_naive: relay / naive,
            });
        }
    }

    pub(super) fn add_latency(&mut self, wakeup: Wakeup, rate: u32, runs: Vec<LatencyRun>) {
        self.latency.push(LatencyRow {
            wakeup,
            rate,
            p50_ms: Spread::of(runs.iter().map(|r| r.p50_ms)),
            p99_ms: Spread::of(runs.iter().map(|r| r.p99_ms)),
            max_ms: Spread::of(runs.iter().map(|r| r.max_ms)),
            runs,
        });
    }

    pub(super) fn add_idle(&mut self, wakeup: Wakeup, runs: Vec<IdleRun>) {
        self.idle.push(IdleRow {
            wakeup,
            transactions_per_second: Spread::of(runs.iter().map(|r| r.per_second)),
            runs,
        });
    }

    pub(super) fn add_writer(&mut self, shape: Shape, runs: Vec<WriterRun>) {
        self.writer.push(WriterRow {
            shape,
            events_per_transaction: shape.events_per_tx(),
            transactions_per_second: Spread::of(runs.iter().map(|r| r.transactions as f64 / r.seconds)),
            events_per_second: Spread::of(runs.iter().map(|r| r.events as f64 / r.seconds)),
            runs,
        });
    }

    pub(super) fn print(&self) {
        println!(
            "median [min–max] of {} rep(s){}",
            self.reps,
            if self.throwaway_postgres {
                "; throwaway PostgreSQL with fsync=off"
            } else {
                ""
            }
        );
        if !self.throughput.is_empty() {
            self.print_throughput();
        }
        if !self.latency.is_empty() {
            let sent = self
                .latency
                .iter()
                .flat_map(|r| &r.runs)
                .any(|r| r.clock == Clock::Sent);
            let title = if sent {
                "latency: writer's send → consumer XREAD, one event per transaction"
            } else {
                "latency: created_at → consumer XREAD, one event per transaction"
            };
            let mut t = Table::new(
                title,
                &["wake-up", "ev/s", "p50 ms", "p99 ms", "max ms", "received"],
            );
            for r in &self.latency {
                let received = r.runs.iter().map(|x| x.received).min().unwrap_or(0);
                let written = r.runs.iter().map(|x| x.written).max().unwrap_or(0);
                t.rows.push(vec![
                    r.wakeup.label(),
                    r.rate.to_string(),
                    r.p50_ms.show(2),
                    r.p99_ms.show(2),
                    r.max_ms.show(2),
                    format!("{received}/{written}"),
                ]);
            }
            t.print_fixed(&LATENCY);
        }
        if !self.idle.is_empty() {
            let mut t = Table::new(
                "idle: transactions committed per second with nothing to do (pg_stat_database)",
                &[],
            );
            for r in &self.idle {
                let tps = r.transactions_per_second.show(2);
                t.rows.push(vec![r.wakeup.label(), tps, "tx/s".to_owned()]);
            }
            t.print_fixed(&IDLE);
        }
        if !self.writer.is_empty() {
            let mut t = Table::new(
                "writer: one connection, each transaction committed",
                &["shape", "transactions/s", "events/s"],
            );
            for r in &self.writer {
                t.rows.push(vec![
                    r.shape.label().to_owned(),
                    r.transactions_per_second.show(0),
                    r.events_per_second.show(0),
                ]);
            }
            t.print_fixed(&WRITER);
        }
        self.print_pooled();
        self.print_wal();
        self.print_held_snapshot();
        self.print_fleet();
    }

    fn print_throughput(&self) {
        let mut t = Table::new(
            format!("throughput: {} events per drain", self.events),
            &[
                "strategy",
                "batch",
                "events/s",
                "wall s",
                "delivered",
                "dup",
                "relay RSS",
                "PG CPU ms/1k",
                "WAL B/ev",
            ],
        );
        for r in &self.throughput {
            let delivered = r.runs.iter().map(|x| x.delivered).min().unwrap_or(0);
            let dup = r.runs.iter().map(|x| x.duplicates).max().unwrap_or(0);
            let rss = r
                .runs
                .iter()
                .filter_map(|x| x.peak_rss)
                .max()
                .map_or("-".to_owned(), |b| format!("{:.1} MB", b as f64 / 1_048_576.0));
            t.rows.push(vec![
                r.strategy.label().to_owned(),
                r.batch_size.to_string(),
                r.events_per_second.show(0),
                format!("{:.3}", r.seconds.median),
                if r.strategy.delivers() {
                    delivered.to_string()
                } else {
                    "-".to_owned()
                },
                dup.to_string(),
                rss,
                r.pg_cpu_ms_per_1000
                    .map_or("-".to_owned(), |s| format!("{:.1}", s.median)),
                format!("{:.0}", r.wal_bytes_per_event.median),
            ]);
        }
        t.print_fixed(&THROUGHPUT);
        println!("(PG CPU and WAL: writing and draining the events, medians)");
        println!();
        for ratio in &self.ratios {
            println!(
                "batch {:>5}: relay = {:.2} × floor, {:.1} × naive",
                ratio.batch_size, ratio.relay_over_floor, ratio.relay_over_naive
            );
        }
        self.print_source_ratios();
    }

    /// Fails (exit 1) if any run lost an event, failed to mark one, or the
    /// writer left a different number of rows: speed is reported, never
    /// judged; correctness is.
    pub(super) fn check(&self) -> anyhow::Result<()> {
        for r in &self.throughput {
            for run in &r.runs {
                let expected = r.events as u64;
                let delivered_ok = !r.strategy.delivers() || run.delivered == expected;
                // Emitted events have no row to finish; the WAL source
                // deletes the rows it delivered.
                let marked_ok = match r.strategy {
                    Strategy::Emit => run.marked == 0 && run.rows_left == 0,
                    Strategy::Wal => run.marked == expected && run.rows_left == 0,
                    _ => run.marked == expected,
                };
                if !marked_ok || !delivered_ok {
                    bail!(
                        "{} at batch {}: {} finished, {} rows left and {} delivered of {expected}",
                        r.strategy.label(),
                        r.batch_size,
                        run.marked,
                        run.rows_left,
                        run.delivered
                    );
                }
            }
        }
        for r in &self.latency {
            for run in &r.runs {
                if run.received != run.written {
                    bail!(
                        "latency, {}: {} of {} events reached the consumer",
                        r.wakeup.label(),
                        run.received,
                        run.written
                    );
                }
            }
        }
        for r in &self.pooled {
            for run in &r.runs {
                let expected = r.events as u64;
                if run.delivered != expected || run.marked != expected {
                    bail!(
                        "{}, {} claims, at batch {}: {} marked and {} delivered of {expected}",
                        r.route.label(),
                        r.claim,
                        r.batch_size,
                        run.marked,
                        run.delivered
                    );
                }
            }
        }
        for r in &self.pooled_latency {
            for run in &r.runs {
                if run.received != run.written {
                    bail!(
                        "pooled latency, {}: {} of {} events reached the consumer",
                        r.waking.label(),
                        run.received,
                        run.written
                    );
                }
            }
        }
        for r in &self.writer {
            for run in &r.runs {
                if run.rows != run.events as u64 {
                    bail!(
                        "writer, {}: {} rows for {} events",
                        r.shape.label(),
                        run.rows,
                        run.events
                    );
                }
            }
        }
        self.check_wal()?;
        self.check_held_snapshot()?;
        self.check_fleet()
    }
}
