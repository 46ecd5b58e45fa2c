//! The figures of `--source wal`: the WAL source over polling per batch
//! size, dead tuples, the sink outage, and the targets, each beside
//! its figure with met / not met (reported, never judged: only a lost event
//! fails the run).

use anyhow::bail;
use serde::Serialize;

use super::dead_tuples::DeadTuplesRun;
use super::outage::OutageRun;
use super::results::Report;
use super::throughput::Strategy;
use crate::latency::Wakeup;
use crate::report::{Col, Spread, Table};

const DEAD: [Col; 4] = [Col::Left(34), Col::Right(24), Col::Right(24), Col::Right(12)];
const OUTAGE: [Col; 8] = [
    Col::Left(28),
    Col::Right(10),
    Col::Right(12),
    Col::Right(9),
    Col::Right(9),
    Col::Right(26),
    Col::Right(11),
    Col::Right(10),
];
const TARGETS: [Col; 4] = [Col::Left(48), Col::Right(14), Col::Right(12), Col::Left(0)];

/// The batch size the throughput targets are stated at.
const TARGET_BATCH: u32 = 100;

/// The WAL source's figures over the polling relay's, at one batch size.
#[derive(Debug, Serialize)]
pub(super) struct SourceRatio {
    pub(super) batch_size: u32,
    /// Events/s, medians.
    pub(super) wal_over_poll: f64,
    pub(super) emit_over_poll: Option<f64>,
    /// WAL bytes per event, medians.
    pub(super) wal_bytes_wal_over_poll: f64,
    pub(super) wal_bytes_emit_over_poll: Option<f64>,
}

/// Dead tuples after delivering N events, one strategy.
#[derive(Debug, Serialize)]
pub(super) struct DeadTuplesRow {
    pub(super) strategy: Strategy,
    pub(super) dead: Spread,
    pub(super) live: Spread,
    pub(super) table_bytes: Spread,
    pub(super) runs: Vec<DeadTuplesRun>,
}

/// One source through a sink outage.
#[derive(Debug, Serialize)]
pub(super) struct OutageRow {
    pub(super) strategy: Strategy,
    pub(super) retained_max_bytes: Option<Spread>,
    pub(super) resume_seconds: Spread,
    pub(super) catch_up_per_second: Spread,
    pub(super) runs: Vec<OutageRun>,
}

/// One target of the issue beside what this run measured.
#[derive(Debug, Serialize)]
pub(super) struct Target {
    pub(super) figure: String,
    pub(super) measured: Option<f64>,
    pub(super) shown: String,
    pub(super) target: String,
    /// `None`: not measured in this run.
    pub(super) met: Option<bool>,
    pub(super) verdict: String,
}

/// Which side of the bound a target wants.
#[derive(Clone, Copy)]
pub(super) enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    pub(super) fn new(
        figure: String,
        measured: Option<f64>,
        shown: impl Fn(f64) -> String,
        bound: Bound,
    ) -> Self {
        let (target, met, verdict) = match (bound, measured) {
            (Bound::AtLeast(b), m) => (
                format!("≥ {}", shown(b)),
                m.map(|v| v >= b),
                m.map(|v| {
                    if v >= b {
                        "met".to_owned()
                    } else {
                        format!("NOT met: {:.0}% below", (1.0 - v / b) * 100.0)
                    }
                }),
            ),
            (Bound::AtMost(b), m) => (
                format!("≤ {}", shown(b)),
                m.map(|v| v <= b),
                m.map(|v| {
                    if v <= b {
                        "met".to_owned()
                    } else {
                        format!("NOT met: {:.0}% above", (v / b - 1.0) * 100.0)
                    }
                }),
            ),
        };
        Self {
            figure,
            measured,
            shown: measured.map_or("-".to_owned(), shown),
            target,
            met,
            verdict: verdict.unwrap_or_else(|| "not measured in this run".to_owned()),
        }
    }
}

fn times(v: f64) -> String {
    format!("{v:.2}×")
}

fn percent(v: f64) -> String {
    format!("{:.0}%", v * 100.0)
}

fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1_048_576.0)
}

impl Report {
    /// Once a batch size has the polling relay and the WAL source: their
    /// ratios (again, as each strategy arrives).
    pub(super) fn add_source_ratio(&mut self, batch_size: u32) {
        let (Some(poll), Some(wal)) = (
            self.row(Strategy::Relay, batch_size),
            self.row(Strategy::Wal, batch_size),
        ) else {
            return;
        };
        let emit = self.row(Strategy::Emit, batch_size);
        let speed = |r: &super::results::Row| r.events_per_second.median / poll.events_per_second.median;
        let bytes = |r: &super::results::Row| r.wal_bytes_per_event.median / poll.wal_bytes_per_event.median;
        let ratio = SourceRatio {
            batch_size,
            wal_over_poll: speed(wal),
            emit_over_poll: emit.map(speed),
            wal_bytes_wal_over_poll: bytes(wal),
            wal_bytes_emit_over_poll: emit.map(bytes),
        };
        self.source_ratios.retain(|r| r.batch_size != batch_size);
        self.source_ratios.push(ratio);
    }

    pub(super) fn add_dead_tuples(&mut self, strategy: Strategy, runs: Vec<DeadTuplesRun>) {
        self.dead_tuples.push(DeadTuplesRow {
            strategy,
            dead: Spread::of(runs.iter().map(|r| r.dead as f64)),
            live: Spread::of(runs.iter().map(|r| r.live as f64)),
            table_bytes: Spread::of(runs.iter().map(|r| r.table_bytes as f64)),
            runs,
        });
    }

    pub(super) fn add_outage(&mut self, strategy: Strategy, runs: Vec<OutageRun>) {
        let retained: Option<Vec<f64>> = runs
            .iter()
            .map(|r| r.retained_max_bytes.map(|b| b as f64))
            .collect();
        self.outage.push(OutageRow {
            strategy,
            retained_max_bytes: retained.map(Spread::of),
            resume_seconds: Spread::of(runs.iter().map(|r| r.resume_seconds)),
            catch_up_per_second: Spread::of(runs.iter().map(|r| r.catch_up_per_second)),
            runs,
        });
    }

    /// The targets for log tailing beside this run's figures.
    pub(super) fn set_targets(&mut self) {
        let ratio = self.source_ratios.iter().find(|r| r.batch_size == TARGET_BATCH);
        let wal_latency = self.latency.iter().find(|r| r.wakeup == Wakeup::Wal);
        let latency_figure = match wal_latency {
            Some(r) if r.rate != 200 => format!("latency p99, WAL source, at {}/s (target at 200/s)", r.rate),
            _ => "latency p99, WAL source, 200 events/s".to_owned(),
        };
        let catch_up = self.outage.iter().find(|r| r.strategy == Strategy::Wal);
        let rss = self
            .throughput
            .iter()
            .filter(|r| r.strategy.reads_wal())
            .flat_map(|r| r.runs.iter().filter_map(|x| x.peak_rss))
            .chain(
                self.outage
                    .iter()
                    .filter(|r| r.strategy.reads_wal())
                    .flat_map(|r| r.runs.iter().filter_map(|x| x.peak_rss)),
            )
            .max();
        self.targets = vec![
            Target::new(
                format!("throughput, batch {TARGET_BATCH}: WAL source ÷ polling"),
                ratio.map(|r| r.wal_over_poll),
                times,
                Bound::AtLeast(1.5),
            ),
            Target::new(
                format!("throughput, batch {TARGET_BATCH}: emit ÷ polling"),
                ratio.and_then(|r| r.emit_over_poll),
                times,
                Bound::AtLeast(2.0),
            ),
            Target::new(
                latency_figure,
                wal_latency.map(|r| r.p99_ms.median),
                |v| format!("{v:.2} ms"),
                Bound::AtMost(10.0),
            ),
            Target::new(
                format!("WAL bytes per event, batch {TARGET_BATCH}: WAL source ÷ polling"),
                ratio.map(|r| r.wal_bytes_wal_over_poll),
                percent,
                Bound::AtMost(0.6),
            ),
            Target::new(
                "catch-up after the sink outage, WAL source".to_owned(),
                catch_up.map(|r| r.catch_up_per_second.median),
                |v| format!("{v:.0} ev/s"),
                Bound::AtLeast(30_000.0),
            ),
            Target::new(
                "relay peak RSS, WAL source (all its runs)".to_owned(),
                rss.map(|b| b as f64),
                mb,
                Bound::AtMost(20.0 * 1_048_576.0),
            ),
        ];
    }

    pub(super) fn print_source_ratios(&self) {
        for r in &self.source_ratios {
            let emit = r
                .emit_over_poll
                .map_or(String::new(), |e| format!(", emit = {e:.2} × polling"));
            let emit_bytes = r
                .wal_bytes_emit_over_poll
                .map_or(String::new(), |e| format!(", emit {}", percent(e)));
            println!(
                "batch {:>5}: WAL source = {:.2} × polling{emit}; WAL bytes per event: WAL source {}{emit_bytes} of polling's",
                r.batch_size,
                r.wal_over_poll,
                percent(r.wal_bytes_wal_over_poll)
            );
        }
    }

    /// The tables only `--source wal` fills.
    pub(super) fn print_wal(&self) {
        if let Some(first) = self.dead_tuples.first() {
            let events = first.runs.first().map_or(0, |r| r.events);
            let mut t = Table::new(
                format!("dead tuples after {events} events delivered (autovacuum off on the table)"),
                &["strategy", "n_dead_tup", "n_live_tup", "table size"],
            );
            for r in &self.dead_tuples {
                t.rows.push(vec![
                    r.strategy.label().to_owned(),
                    r.dead.show(0),
                    r.live.show(0),
                    mb(r.table_bytes.median),
                ]);
            }
            t.print_fixed(&DEAD);
        }
        if let Some(first) = self.outage.first().and_then(|r| r.runs.first()) {
            let mut t = Table::new(
                format!(
                    "sink outage: Redis down {:.0} s while writing {} events/s, then catch-up",
                    first.outage_seconds, first.rate
                ),
                &[
                    "relay",
                    "backlog",
                    "retained",
                    "B/ev",
                    "resumed",
                    "catch-up events/s",
                    "delivered",
                    "relay RSS",
                ],
            );
            for r in &self.outage {
                let run = r.runs.first().expect("a row has runs");
                let backlog = r.runs.iter().map(|x| x.catch_up_events).max().unwrap_or(0);
                let delivered = r.runs.iter().map(|x| x.delivered).min().unwrap_or(0);
                let written = r.runs.iter().map(|x| x.written).max().unwrap_or(0);
                let rss = r.runs.iter().filter_map(|x| x.peak_rss).max();
                t.rows.push(vec![
                    r.strategy.label().trim_end_matches(" → redis").to_owned(),
                    backlog.to_string(),
                    r.retained_max_bytes.map_or("-".to_owned(), |s| mb(s.median)),
                    r.retained_max_bytes.map_or("-".to_owned(), |s| {
                        format!("{:.0}", s.median / run.written_during_outage.max(1) as f64)
                    }),
                    format!("{:.2} s", r.resume_seconds.median),
                    r.catch_up_per_second.show(0),
                    format!("{delivered}/{written}"),
                    rss.map_or("-".to_owned(), |b| mb(b as f64)),
                ]);
            }
            t.print_fixed(&OUTAGE);
        }
        if !self.targets.is_empty() {
            let mut t = Table::new(
                "targets (reported, not asserted)",
                &["figure", "measured", "target", "verdict"],
            );
            for x in &self.targets {
                t.rows.push(vec![
                    x.figure.clone(),
                    x.shown.clone(),
                    x.target.clone(),
                    x.verdict.clone(),
                ]);
            }
            t.print_fixed(&TARGETS);
        }
    }

    /// Fails if a dead-tuples run or an outage lost an event.
    pub(super) fn check_wal(&self) -> anyhow::Result<()> {
        for r in &self.dead_tuples {
            for run in &r.runs {
                if run.delivered != run.events {
                    bail!(
                        "dead tuples, {}: {} of {} events delivered",
                        r.strategy.label(),
                        run.delivered,
                        run.events
                    );
                }
            }
        }
        for r in &self.outage {
            for run in &r.runs {
                if run.delivered != run.written {
                    bail!(
                        "outage, {}: {} of {} events delivered",
                        r.strategy.label(),
                        run.delivered,
                        run.written
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Bound, Target, times};

    #[test]
    fn targets_say_by_how_much_they_were_missed() {
        let met = Target::new("x".into(), Some(1.6), times, Bound::AtLeast(1.5));
        assert_eq!((met.met, met.verdict.as_str()), (Some(true), "met"));
        let short = Target::new("x".into(), Some(1.2), times, Bound::AtLeast(1.5));
        assert_eq!(short.met, Some(false));
        assert_eq!(short.verdict, "NOT met: 20% below");
        assert_eq!(short.target, "≥ 1.50×");
        let over = Target::new("x".into(), Some(15.0), times, Bound::AtMost(10.0));
        assert_eq!(over.verdict, "NOT met: 50% above");
        let none = Target::new("x".into(), None, times, Bound::AtMost(10.0));
        assert_eq!((none.met, none.shown.as_str()), (None, "-"));
    }
}
