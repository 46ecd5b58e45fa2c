//! The bench report: medians with ranges, ratios, a table and JSON.

use anyhow::bail;
use serde::Serialize;

use super::throughput::{Run, Strategy};

/// Median, minimum and maximum of one figure over the repetitions.
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct Spread {
    pub(super) median: f64,
    pub(super) min: f64,
    pub(super) max: f64,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        let median = if values.len() % 2 == 1 {
            values[mid]
        } else {
            (values[mid - 1] + values[mid]) / 2.0
        };
        Self {
            median,
            min: values[0],
            max: values[values.len() - 1],
        }
    }
}

/// One strategy at one batch size.
#[derive(Debug, Serialize)]
pub(super) struct Row {
    pub(super) strategy: Strategy,
    pub(super) batch_size: u32,
    pub(super) events_per_second: Spread,
    pub(super) seconds: Spread,
    pub(super) runs: Vec<Run>,
    #[serde(skip)]
    events: usize,
}

impl Row {
    pub(super) fn new(strategy: Strategy, batch_size: u32, events: usize, runs: Vec<Run>) -> Self {
        Self {
            strategy,
            batch_size,
            events_per_second: Spread::of(runs.iter().map(|r| events as f64 / r.seconds).collect()),
            seconds: Spread::of(runs.iter().map(|r| r.seconds).collect()),
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

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) events: usize,
    pub(super) reps: usize,
    /// True when PostgreSQL was the bench's own throwaway cluster (fsync=off).
    pub(super) throwaway_postgres: bool,
    pub(super) throughput: Vec<Row>,
    pub(super) ratios: Vec<Ratio>,
}

impl Report {
    pub(super) fn new(events: usize, reps: usize, throwaway_postgres: bool, throughput: Vec<Row>) -> Self {
        let median = |s: Strategy, b: u32| {
            throughput
                .iter()
                .find(|r| r.strategy == s && r.batch_size == b)
                .map(|r| r.events_per_second.median)
        };
        let mut ratios = Vec::new();
        for row in throughput.iter().filter(|r| r.strategy == Strategy::Relay) {
            let b = row.batch_size;
            if let (Some(relay), Some(floor), Some(naive)) = (
                median(Strategy::Relay, b),
                median(Strategy::Floor, b),
                median(Strategy::Naive, b),
            ) {
                ratios.push(Ratio {
                    batch_size: b,
                    relay_over_floor: relay / floor,
                    relay_over_naive: relay / naive,
                });
            }
        }
        Self {
            events,
            reps,
            throwaway_postgres,
            throughput,
            ratios,
        }
    }

    pub(super) fn print(&self) {
        println!(
            "throughput: {} events per drain, median [min–max] of {} rep(s){}",
            self.events,
            self.reps,
            if self.throwaway_postgres {
                "; throwaway PostgreSQL with fsync=off"
            } else {
                ""
            }
        );
        println!(
            "{:<30} {:>6} {:>28} {:>9} {:>10} {:>5} {:>10}",
            "strategy", "batch", "events/s", "wall s", "delivered", "dup", "relay RSS"
        );
        for r in &self.throughput {
            let e = r.events_per_second;
            let delivered = r.runs.iter().map(|x| x.delivered).min().unwrap_or(0);
            let dup = r.runs.iter().map(|x| x.duplicates).max().unwrap_or(0);
            let rss = r
                .runs
                .iter()
                .filter_map(|x| x.peak_rss)
                .max()
                .map_or("-".to_owned(), |b| format!("{:.1} MB", b as f64 / 1_048_576.0));
            println!(
                "{:<30} {:>6} {:>28} {:>9.3} {:>10} {:>5} {:>10}",
                r.strategy.label(),
                r.batch_size,
                format!("{:.0} [{:.0}–{:.0}]", e.median, e.min, e.max),
                r.seconds.median,
                if r.strategy == Strategy::Floor {
                    "-".to_owned()
                } else {
                    delivered.to_string()
                },
                dup,
                rss
            );
        }
        println!();
        for ratio in &self.ratios {
            println!(
                "batch {:>5}: relay = {:.2} × floor, {:.1} × naive",
                ratio.batch_size, ratio.relay_over_floor, ratio.relay_over_naive
            );
        }
    }

    /// Fails (exit 1) if any drain lost or failed to mark an event: speed is
    /// reported, never judged; correctness is.
    pub(super) fn check(&self) -> anyhow::Result<()> {
        for r in &self.throughput {
            for run in &r.runs {
                let expected = r.events as u64;
                let delivered_ok = r.strategy == Strategy::Floor || run.delivered == expected;
                if run.marked != expected || !delivered_ok {
                    bail!(
                        "{} at batch {}: {} marked and {} delivered of {expected}",
                        r.strategy.label(),
                        r.batch_size,
                        run.marked,
                        run.delivered
                    );
                }
            }
        }
        Ok(())
    }
}
