//! The soak's findings as a table (the terminal), JSON (`--json`) and a
//! self-contained HTML page (`--report`) whose timeline plots mark every
//! fault; the page is the lab's (`report.rs`), with the soak as its one
//! section.

use std::collections::BTreeMap;

use serde::Serialize;

use super::check::{InboxCheck, SourceCheck};
use super::faults::Record;
use super::fleet::Exit;
use super::schedule::Src;
use super::timeline::Sample;
use super::writers::Written;
use crate::plot::{self, Mark, Series};
use crate::report::{Outcome, Plot, Table, Verdict, percentile};

/// Everything a run found.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) seed: u64,
    pub(crate) setup: String,
    /// Unix ms of the run's start (the streams' clock).
    pub(crate) started_ms: i64,
    /// ERROR lines of the relays and consumers (the first 200).
    pub(crate) errors: Vec<String>,
    pub(crate) seconds: f64,
    pub(crate) written: Written,
    pub(crate) faults: Vec<Record>,
    /// Fault kinds that could not run here (servers given by URL).
    pub(crate) skipped: Vec<String>,
    pub(crate) sources: Vec<SourceCheck>,
    pub(crate) inbox: Vec<InboxCheck>,
    pub(crate) exits: Vec<Exit>,
    /// Whether the drain finished before its timeout.
    pub(crate) drained: bool,
    pub(crate) samples: Vec<Sample>,
    /// Deliveries per second and the p99 latency of first deliveries, per
    /// second of the run, per source.
    pub(crate) per_second: BTreeMap<String, Vec<(f64, f64, f64)>>,
    pub(crate) passed: bool,
}

/// A named correctness check and whether it holds.
pub(crate) struct Check {
    pub(crate) measure: String,
    pub(crate) value: String,
    pub(crate) target: String,
    pub(crate) holds: bool,
}

fn check(measure: impl Into<String>, value: impl ToString, target: &str, holds: bool) -> Check {
    Check {
        measure: measure.into(),
        value: value.to_string(),
        target: target.to_owned(),
        holds,
    }
}

impl Report {
    /// Fault counts by kind, in the order they first struck.
    pub(crate) fn fault_counts(&self) -> Vec<(&'static str, usize, usize)> {
        let mut out: Vec<(&'static str, usize, usize)> = Vec::new();
        for f in &self.faults {
            match out.iter_mut().find(|(k, _, _)| *k == f.kind) {
                Some((_, n, took)) => {
                    *n += 1;
                    *took += usize::from(f.took);
                }
                None => out.push((f.kind, 1, usize::from(f.took))),
            }
        }
        out
    }

    /// The checks the run is judged by.
    pub(crate) fn checks(&self) -> Vec<Check> {
        let mut c = vec![check(
            "drained before the timeout",
            self.drained,
            "true",
            self.drained,
        )];
        for s in &self.sources {
            let n = s.source.name();
            c.push(check(format!("lost ({n})"), s.lost, "0", s.lost == 0));
            c.push(check(format!("phantom ({n})"), s.phantom, "0", s.phantom == 0));
            c.push(check(
                format!("poison events delivered ({n})"),
                s.poison_delivered,
                "0",
                s.poison_delivered == 0,
            ));
            c.push(check(
                format!("duplicates no fault explains ({n})"),
                s.unexplained_duplicates,
                "0",
                s.unexplained_duplicates == 0,
            ));
            c.push(check(
                format!("faults re-sending more than a window ({n})"),
                s.over_bound,
                "0",
                s.over_bound == 0,
            ));
            c.push(check(
                format!("order violations, first deliveries ({n})"),
                s.order_violations,
                "0",
                s.order_violations == 0,
            ));
            c.push(check(
                format!("dead letters not injected ({n})"),
                s.dead_letters_unexplained,
                "0",
                s.dead_letters_unexplained == 0,
            ));
            c.push(check(
                format!("poison events not dead letters ({n})"),
                s.poison_not_dead,
                "0",
                s.poison_not_dead == 0,
            ));
            c.push(check(
                format!("rows left unpublished ({n})"),
                s.left_behind,
                "0",
                s.left_behind == 0,
            ));
        }
        for i in &self.inbox {
            let n = i.source.name();
            c.push(check(
                format!("duplicate side effects behind the inbox ({n})"),
                i.duplicate_side_effects,
                "0",
                i.duplicate_side_effects == 0,
            ));
            c.push(check(
                format!("delivered events no consumer applied ({n})"),
                i.unapplied,
                "0",
                i.unapplied == 0,
            ));
        }
        c
    }

    /// The headline table (the README's): faults, events, the checks.
    pub(crate) fn print(&self) {
        println!("\noutbox-lab soak, seed {} ({:.0} s)", self.seed, self.seconds);
        println!("{}", self.setup);
        let faults: usize = self.faults.len();
        println!("\nfaults injected: {faults}");
        for (kind, n, took) in self.fault_counts() {
            let note = if took < n {
                format!(" ({took} took effect)")
            } else {
                String::new()
            };
            println!("  {n:>5}  {kind}{note}");
        }
        for s in &self.skipped {
            println!("  skipped: {s}");
        }
        let w = &self.written;
        println!(
            "\nevents committed: {} in {} transactions ({} emitted, {} poison); rolled back: {}; \
             killed before COMMIT: {}; broken by a fault before COMMIT: {}; COMMIT unanswered: {}",
            w.committed,
            w.committed_txns,
            w.emitted,
            w.poison,
            w.rolled_back,
            w.killed_before_commit,
            w.aborted,
            w.in_doubt
        );
        for s in &self.sources {
            println!(
                "\n{}: {} committed, {} delivered ({} deliveries, {} duplicates), {} lost, {} phantom, \
                 {} order violations, {} dead letters; latency p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                s.source.name(),
                s.committed,
                s.delivered,
                s.deliveries,
                s.duplicates,
                s.lost,
                s.phantom,
                s.order_violations,
                s.dead_letters,
                s.latency_ms.p50,
                s.latency_ms.p99,
                s.latency_ms.max
            );
            for (before, again) in &s.unexplained_at_ms {
                println!(
                    "  unexplained repeat: delivered at {:.3} s, again at {:.3} s",
                    (before - self.started_ms) as f64 / 1000.0,
                    (again - self.started_ms) as f64 / 1000.0
                );
            }
            println!(
                "  re-sent per fault: kind | faults | total | max | bound | distribution (re-sent: faults)"
            );
            for d in &s.duplicates_by_fault {
                println!(
                    "    {} | {} | {} | {} | {} | {}",
                    d.kind,
                    d.faults,
                    d.total,
                    d.max_per_fault,
                    d.bound,
                    d.buckets()
                );
            }
        }
        if !self.exits.is_empty() {
            println!(
                "\nchildren that exited by themselves (restarted): {}",
                self.exits.len()
            );
            for e in self.exits.iter().take(10) {
                println!(
                    "  {:.0} s {} ({}): {}",
                    e.at_s,
                    e.name,
                    e.status,
                    e.last_lines.join(" | ")
                );
            }
        }
        if !self.errors.is_empty() {
            println!("\nerrors the children logged: {}", self.errors.len());
            for e in self.errors.iter().take(20) {
                println!("  {e}");
            }
        }
        println!("\nchecks:");
        for c in self.checks() {
            println!(
                "  {:<4} {:<48} {:>10}  (target {})",
                if c.holds { "ok" } else { "FAIL" },
                c.measure,
                c.value,
                c.target
            );
        }
        println!("\nreproduce the schedule: outbox-lab soak --seed {}", self.seed);
    }

    /// The report page's one section.
    pub(crate) async fn outcome(&self) -> anyhow::Result<Outcome> {
        let mut o = Outcome::new(
            "soak",
            "Crash-consistency soak",
            "Writers commit events (some rolled back, some killed before COMMIT, some huge, some emitted) \
             while relays and consumers are killed, frozen and cut off, PostgreSQL restarts, the sink goes \
             away and a slot is lost; then everything drains and each delivery is checked against the \
             ledger of what committed.",
            self.setup.clone(),
        );
        o.seconds = self.seconds;
        for c in self.checks() {
            o.row(c.measure, c.value, c.target, Verdict::check(c.holds));
        }
        let mut counts = Table::new("Faults injected", &["fault", "count", "took effect"]);
        for (kind, n, took) in self.fault_counts() {
            counts
                .rows
                .push(vec![kind.to_owned(), n.to_string(), took.to_string()]);
        }
        o.tables.push(counts);
        for s in &self.sources {
            let mut t = Table::new(
                format!("Duplicates by fault ({})", s.source.name()),
                &[
                    "fault",
                    "faults",
                    "re-sent, total",
                    "max per fault",
                    "bound",
                    "distribution (re-sent: faults)",
                ],
            );
            for d in &s.duplicates_by_fault {
                t.rows.push(vec![
                    d.kind.to_owned(),
                    d.faults.to_string(),
                    d.total.to_string(),
                    d.max_per_fault.to_string(),
                    d.bound.to_string(),
                    d.buckets(),
                ]);
            }
            o.tables.push(t);
        }
        let mut log = Table::new("Fault log", &["t (s)", "fault", "target", "lasted (s)", "detail"]);
        for f in self
            .faults
            .iter()
            .filter(|f| !f.kind.starts_with("relay SIGKILL"))
        {
            log.rows.push(vec![
                format!("{:.1}", f.at_s),
                f.kind.to_owned(),
                f.target.clone(),
                format!("{:.1}", f.seconds),
                f.detail.clone(),
            ]);
        }
        o.tables.push(log);
        if !self.exits.is_empty() {
            let mut t = Table::new(
                "Children that exited by themselves",
                &["t (s)", "child", "status", "last lines"],
            );
            for e in &self.exits {
                t.rows.push(vec![
                    format!("{:.1}", e.at_s),
                    e.name.clone(),
                    e.status.clone(),
                    e.last_lines.join("\n"),
                ]);
            }
            o.tables.push(t);
        }
        o.plots = self.plots().await?;
        Ok(o)
    }

    /// One vertical rule per fault, a colour per kind; relay kills, the
    /// most frequent, as ticks along the bottom.
    fn rules(&self) -> Vec<Series> {
        let mut by_kind: Vec<Series> = Vec::new();
        for f in &self.faults {
            let (name, mark) = if f.kind.starts_with("relay SIGKILL") {
                ("relay kills", Mark::Ticks)
            } else {
                (f.kind, Mark::Rules)
            };
            match by_kind.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((f.at_s, 0.0)),
                None => by_kind.push(Series {
                    name: name.to_owned(),
                    points: vec![(f.at_s, 0.0)],
                    mark,
                }),
            }
        }
        by_kind
    }

    async fn plots(&self) -> anyhow::Result<Vec<Plot>> {
        let line = |name: String, points: Vec<(f64, f64)>| Series {
            name,
            points,
            mark: Mark::Line,
        };
        let per_second = |col: fn(&(f64, f64, f64)) -> f64| {
            self.per_second
                .iter()
                .map(|(src, rows)| line(src.clone(), rows.iter().map(|r| (r.0, col(r))).collect()))
                .collect::<Vec<_>>()
        };
        let with_rules = |mut series: Vec<Series>| {
            series.extend(self.rules());
            series
        };
        let backlog = |pick: fn(&Sample) -> Option<i64>| {
            self.samples
                .iter()
                .filter_map(|s| pick(s).map(|v| (s.t, v as f64)))
                .collect::<Vec<_>>()
        };
        let mut backlogs = Vec::new();
        if self.sources.iter().any(|s| s.source == Src::Poll) {
            backlogs.push(line("poll".to_owned(), backlog(|s| s.poll_backlog)));
        }
        if self.sources.iter().any(|s| s.source == Src::Wal) {
            backlogs.push(line("wal".to_owned(), backlog(|s| s.wal_backlog)));
        }
        let retained = vec![line(
            "retained by the slot".to_owned(),
            self.samples
                .iter()
                .filter_map(|s| s.retained.map(|r| (s.t, r as f64 / (1024.0 * 1024.0))))
                .collect(),
        )];
        Ok(vec![
            plot::timeline(
                "Deliveries per second",
                "deliveries/s",
                with_rules(per_second(|r| r.1)),
            )
            .await?,
            plot::timeline(
                "Latency p99 of first deliveries, per second",
                "ms",
                with_rules(per_second(|r| r.2)),
            )
            .await?,
            plot::timeline("Backlog (rows waiting)", "rows", with_rules(backlogs)).await?,
            plot::timeline("WAL retained by the slot", "MiB", with_rules(retained)).await?,
        ])
    }
}

/// Deliveries per second and the p99 latency of first deliveries in that
/// second: `(t, deliveries, p99 ms)` from `(t, latency ms if first)`.
pub(crate) fn per_second(points: &[(f64, Option<f64>)]) -> Vec<(f64, f64, f64)> {
    let mut buckets: BTreeMap<i64, (f64, Vec<f64>)> = BTreeMap::new();
    for &(t, latency) in points {
        let b = buckets.entry(t.floor() as i64).or_default();
        b.0 += 1.0;
        if let Some(l) = latency {
            b.1.push(l);
        }
    }
    buckets
        .into_iter()
        .map(|(t, (n, mut l))| {
            l.sort_by(f64::total_cmp);
            let p99 = if l.is_empty() { 0.0 } else { percentile(&l, 0.99) };
            (t as f64, n, p99)
        })
        .collect()
}
