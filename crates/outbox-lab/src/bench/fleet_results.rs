//! The fleet phase's figures (issue 33): medians with ranges over the
//! repetitions, each beside the target (reported, never judged)
//! and, for idle cost and throughput, beside the single relay measured in
//! the same run; their table and JSON, and the counts that decide the exit
//! code (every event written delivered and marked).

use anyhow::bail;
use serde::Serialize;

use super::idle::IdleRun;
use super::latency::LatencyRun;
use super::results::Report;
use super::wal_results::{Bound, Target};
use crate::report::{Col, Spread, Table};

const FLEET: [Col; 5] = [
    Col::Left(40),
    Col::Right(34),
    Col::Right(34),
    Col::Right(10),
    Col::Left(0),
];

/// The targets.
const MAX_CONNECTIONS: f64 = 20.0;
const MAX_IDLE_PER_SECOND: f64 = 1.0;
const MAX_P99_MS: f64 = 50.0;
const MIN_OF_SINGLE: f64 = 0.8;

/// One drain of a backlog, by the fleet or the single relay.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Drain {
    /// Events written before the process started.
    pub(super) events: u64,
    /// From the first arrival in the stream to the last.
    pub(super) seconds: f64,
    pub(super) per_second: f64,
    /// Distinct event ids in the stream.
    pub(super) delivered: u64,
    /// Stream entries beyond the distinct ones.
    pub(super) duplicates: u64,
    /// Rows marked published.
    pub(super) marked: u64,
    /// Peak resident memory of the process, in bytes.
    pub(super) peak_rss: Option<u64>,
    /// The most backends of the process seen while it drained.
    pub(super) connections_max: i64,
}

/// CPU milliseconds per 1,000 events of a latency run (the writers'
/// backends included in PostgreSQL's): a figure to compare builds by on a
/// machine whose speed varies from run to run, where the latency of a run
/// at the edge of its capacity swings with it.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct LatencyCpu {
    /// Every process of the cluster; None when it is not on this host.
    pub(super) postgres_ms_per_1000: Option<f64>,
    /// The fleet process.
    pub(super) relay_ms_per_1000: Option<f64>,
}

/// One repetition of the phase.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FleetRun {
    /// The most backends of the fleet process seen while it worked
    /// (latency and throughput).
    pub(super) connections_max: i64,
    /// Transactions of the whole server while the fleet idled.
    pub(super) idle_fleet: IdleRun,
    /// The same for one single relay on one empty outbox.
    pub(super) idle_single: IdleRun,
    /// 1 event per second per tenant, created_at to arrival.
    pub(super) latency: LatencyRun,
    /// The events per second the latency run's writers kept.
    pub(super) write_rate: f64,
    /// What the latency run cost, in CPU.
    pub(super) latency_cpu: LatencyCpu,
    pub(super) drain_fleet: Drain,
    pub(super) drain_single: Drain,
}

/// The phase over its repetitions.
#[derive(Debug, Serialize)]
pub(super) struct FleetRow {
    pub(super) tenants: usize,
    pub(super) sessions: u32,
    /// The idle window and the latency run, in seconds.
    pub(super) window_seconds: f64,
    /// Events per tenant in the throughput runs.
    pub(super) backlog_per_tenant: usize,
    pub(super) connections_max: Spread,
    pub(super) idle_fleet_per_second: Spread,
    pub(super) idle_single_per_second: Spread,
    pub(super) latency_p50_ms: Spread,
    pub(super) latency_p99_ms: Spread,
    pub(super) latency_max_ms: Spread,
    pub(super) write_rate: Spread,
    pub(super) latency_postgres_cpu: Spread,
    pub(super) latency_relay_cpu: Spread,
    pub(super) fleet_events_per_second: Spread,
    pub(super) single_events_per_second: Spread,
    /// Median over median.
    pub(super) fleet_over_single: f64,
    pub(super) targets: Vec<Target>,
    pub(super) runs: Vec<FleetRun>,
}

impl FleetRow {
    pub(super) fn new(
        tenants: usize,
        window_seconds: f64,
        backlog_per_tenant: usize,
        runs: Vec<FleetRun>,
    ) -> Self {
        let of = |f: fn(&FleetRun) -> f64| Spread::of(runs.iter().map(f));
        let connections_max = of(|r| r.connections_max as f64);
        let idle_fleet_per_second = of(|r| r.idle_fleet.per_second);
        let latency_p99_ms = of(|r| r.latency.p99_ms);
        let fleet_events_per_second = of(|r| r.drain_fleet.per_second);
        let single_events_per_second = of(|r| r.drain_single.per_second);
        let fleet_over_single = fleet_events_per_second.median / single_events_per_second.median;
        // The worst run against each bound, so a median cannot hide one
        // that missed; the ratio is of the medians.
        let targets = vec![
            Target::new(
                "connections of the fleet process, most seen".to_owned(),
                Some(connections_max.max),
                |v| format!("{v:.0}"),
                Bound::AtMost(MAX_CONNECTIONS),
            ),
            Target::new(
                "idle: transactions/s of the server".to_owned(),
                Some(idle_fleet_per_second.max),
                |v| format!("{v:.2}/s"),
                Bound::AtMost(MAX_IDLE_PER_SECOND),
            ),
            Target::new(
                "latency p99, 1 event/s per tenant".to_owned(),
                Some(latency_p99_ms.max),
                |v| format!("{v:.1} ms"),
                Bound::AtMost(MAX_P99_MS),
            ),
            Target::new(
                "throughput, fleet ÷ single relay".to_owned(),
                Some(fleet_over_single),
                |v| format!("{:.0}%", v * 100.0),
                Bound::AtLeast(MIN_OF_SINGLE),
            ),
        ];
        Self {
            tenants,
            sessions: super::fleet::SESSIONS,
            window_seconds,
            backlog_per_tenant,
            connections_max,
            idle_fleet_per_second,
            idle_single_per_second: of(|r| r.idle_single.per_second),
            latency_p50_ms: of(|r| r.latency.p50_ms),
            latency_p99_ms,
            latency_max_ms: of(|r| r.latency.max_ms),
            write_rate: of(|r| r.write_rate),
            latency_postgres_cpu: of(|r| r.latency_cpu.postgres_ms_per_1000.unwrap_or(f64::NAN)),
            latency_relay_cpu: of(|r| r.latency_cpu.relay_ms_per_1000.unwrap_or(f64::NAN)),
            fleet_events_per_second,
            single_events_per_second,
            fleet_over_single,
            targets,
            runs,
        }
    }
}

/// `delivered/written, marked` over the runs: the fewest.
fn counts(drains: impl Iterator<Item = Drain> + Clone) -> String {
    let events = drains.clone().map(|d| d.events).max().unwrap_or(0);
    let delivered = drains.clone().map(|d| d.delivered).min().unwrap_or(0);
    let marked = drains.clone().map(|d| d.marked).min().unwrap_or(0);
    let dup = drains.map(|d| d.duplicates).max().unwrap_or(0);
    format!("{delivered}/{events}, {marked} marked, {dup} dup")
}

fn mb(bytes: Option<u64>) -> String {
    bytes.map_or("-".to_owned(), |b| format!("{:.1} MB", b as f64 / 1_048_576.0))
}

impl Report {
    pub(super) fn add_fleet(&mut self, row: FleetRow) {
        self.fleet = Some(row);
    }

    pub(super) fn print_fleet(&self) {
        let Some(f) = &self.fleet else {
            return;
        };
        let mut t = Table::new(
            format!(
                "fleet: {} tenant outboxes, one `outbox relay --schemas` process, --fleet-sessions {} \
                 (targets of issue 33: reported, not asserted)",
                f.tenants, f.sessions
            ),
            &["figure", "fleet", "single relay", "target", "verdict"],
        );
        let target = |i: usize| {
            let x = &f.targets[i];
            (x.target.clone(), x.verdict.clone())
        };
        let mut row = |figure: String, fleet: String, single: String, (target, verdict): (String, String)| {
            t.rows.push(vec![figure, fleet, single, target, verdict]);
        };
        let none = || (String::new(), String::new());
        let dash = || "-".to_owned();
        row(
            "connections, most seen while working".to_owned(),
            f.connections_max.show(0),
            dash(),
            target(0),
        );
        row(
            format!("idle: server transactions/s ({:.0} s)", f.window_seconds),
            f.idle_fleet_per_second.show(2),
            f.idle_single_per_second.show(2),
            target(1),
        );
        let received = f.runs.iter().map(|r| r.latency.received).min().unwrap_or(0);
        let written = f.runs.iter().map(|r| r.latency.written).max().unwrap_or(0);
        row(
            format!("latency: events/s written (goal {})", f.tenants),
            f.write_rate.show(0),
            dash(),
            none(),
        );
        row(
            "latency p50, ms (created_at → XREAD)".to_owned(),
            f.latency_p50_ms.show(2),
            dash(),
            none(),
        );
        row(
            "latency p99, ms".to_owned(),
            f.latency_p99_ms.show(2),
            dash(),
            target(2),
        );
        row(
            "latency max, ms".to_owned(),
            f.latency_max_ms.show(2),
            dash(),
            none(),
        );
        row(
            "latency: PostgreSQL CPU ms per 1,000 events".to_owned(),
            f.latency_postgres_cpu.show(1),
            dash(),
            none(),
        );
        row(
            "latency: fleet process CPU ms per 1,000 events".to_owned(),
            f.latency_relay_cpu.show(1),
            dash(),
            none(),
        );
        row(
            "latency: received".to_owned(),
            format!("{received}/{written}"),
            dash(),
            none(),
        );
        row(
            format!("throughput, events/s ({} per tenant)", f.backlog_per_tenant),
            f.fleet_events_per_second.show(0),
            f.single_events_per_second.show(0),
            target(3),
        );
        row(
            "throughput: delivered, marked".to_owned(),
            counts(f.runs.iter().map(|r| r.drain_fleet.clone())),
            counts(f.runs.iter().map(|r| r.drain_single.clone())),
            none(),
        );
        row(
            "peak RSS, draining".to_owned(),
            mb(f.runs.iter().filter_map(|r| r.drain_fleet.peak_rss).max()),
            mb(f.runs.iter().filter_map(|r| r.drain_single.peak_rss).max()),
            none(),
        );
        t.print_fixed(&FLEET);
        println!(
            "(targets against the worst run, the throughput ratio of the medians: {:.0}%)",
            f.fleet_over_single * 100.0
        );
    }

    /// Fails if a fleet run lost an event or left one unmarked.
    pub(super) fn check_fleet(&self) -> anyhow::Result<()> {
        let Some(f) = &self.fleet else {
            return Ok(());
        };
        for run in &f.runs {
            if run.latency.received != run.latency.written {
                bail!(
                    "fleet latency: {} of {} events reached the consumer",
                    run.latency.received,
                    run.latency.written
                );
            }
            for (who, d) in [("fleet", &run.drain_fleet), ("single relay", &run.drain_single)] {
                if d.delivered != d.events || d.marked != d.events {
                    bail!(
                        "fleet throughput, {who}: {} delivered and {} marked of {}",
                        d.delivered,
                        d.marked,
                        d.events
                    );
                }
            }
        }
        Ok(())
    }
}
