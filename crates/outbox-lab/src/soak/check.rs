//! The soak's verdict: every delivery, read back from the streams, checked
//! against the ledger of what committed (lost, phantom), against itself
//! (duplicates, each put down to the fault that caused it; per-aggregate
//! order of first deliveries), against the outboxes (dead letters, rows
//! left behind) and against the consumers' side effects.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use redis::AsyncCommands;
use redis::streams::StreamRangeReply;
use serde::Serialize;
use tokio_postgres::Client;
use uuid::Uuid;

use super::faults::{Hits, Record};
use super::names::{self, SCHEMA};
use super::schedule::Src;
use crate::report::percentile;

/// One entry of a stream.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    /// When Redis appended it (the entry id's milliseconds).
    pub(crate) ms: i64,
    pub(crate) event_id: Uuid,
    pub(crate) aggregate_id: String,
    pub(crate) seq: i64,
    /// When the writer built the event (unix ms).
    pub(crate) written_ms: i64,
}

/// Every entry of `stream`, in stream order.
pub(crate) async fn read_stream(
    redis: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> anyhow::Result<Vec<Delivery>> {
    let mut out = Vec::new();
    let mut from = "-".to_owned();
    loop {
        let page: StreamRangeReply = redis
            .xrange_count(stream, &from, "+", 10_000)
            .await
            .with_context(|| format!("XRANGE {stream}"))?;
        let Some(last) = page.ids.last().map(|e| e.id.clone()) else {
            break;
        };
        for entry in &page.ids {
            let field = |name: &str| -> anyhow::Result<String> {
                entry
                    .get::<String>(name)
                    .with_context(|| format!("entry {} of {stream} has no {name}", entry.id))
            };
            let payload: serde_json::Value = serde_json::from_str(&field("payload")?)?;
            out.push(Delivery {
                ms: entry.id.split('-').next().unwrap_or("0").parse()?,
                event_id: field("event_id")?.parse()?,
                aggregate_id: field("aggregate_id")?,
                seq: payload["seq"].as_i64().unwrap_or(-1),
                written_ms: payload["t"].as_i64().unwrap_or(0),
            });
        }
        if page.ids.len() < 10_000 {
            break;
        }
        // Exclusive range from the last id read.
        from = format!("({last}");
    }
    Ok(out)
}

/// What one fault kind re-sent.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DupStat {
    pub(crate) kind: &'static str,
    pub(crate) faults: usize,
    /// Faults that re-sent anything.
    pub(crate) with_duplicates: usize,
    pub(crate) total: u64,
    pub(crate) max_per_fault: u64,
    /// What one such fault may re-send at most: two batches per relay it
    /// hits, or the WAL source's window (or one larger transaction).
    pub(crate) bound: u64,
    /// Each fault's re-sent events, in the order they struck.
    pub(crate) per_fault: Vec<u64>,
}

impl DupStat {
    /// The distribution in buckets, the empty ones left out: `0 ×12,
    /// 1–10 ×3, 101–1000 ×1`.
    pub(crate) fn buckets(&self) -> String {
        let edges: [(u64, u64, &str); 6] = [
            (0, 0, "0"),
            (1, 10, "1–10"),
            (11, 100, "11–100"),
            (101, 1000, "101–1000"),
            (1001, 10_000, "1001–10000"),
            (10_001, u64::MAX, ">10000"),
        ];
        edges
            .iter()
            .filter_map(|&(lo, hi, label)| {
                let n = self.per_fault.iter().filter(|&&c| (lo..=hi).contains(&c)).count();
                (n > 0).then(|| format!("{label} ×{n}"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The checks of one source.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SourceCheck {
    pub(crate) source: Src,
    /// Events in the ledger (committed), poison events left out.
    pub(crate) committed: u64,
    pub(crate) poison: u64,
    pub(crate) deliveries: u64,
    pub(crate) delivered: u64,
    pub(crate) lost: u64,
    pub(crate) phantom: u64,
    pub(crate) poison_delivered: u64,
    pub(crate) duplicates: u64,
    /// Duplicates no fault in scope explains.
    pub(crate) unexplained_duplicates: u64,
    /// The first of them: (unix ms of the delivery before, of the repeat).
    pub(crate) unexplained_at_ms: Vec<(i64, i64)>,
    pub(crate) duplicates_by_fault: Vec<DupStat>,
    pub(crate) over_bound: u64,
    pub(crate) order_violations: u64,
    pub(crate) dead_letters: u64,
    pub(crate) dead_letters_unexplained: u64,
    pub(crate) poison_not_dead: u64,
    pub(crate) left_behind: u64,
    pub(crate) latency_ms: Latency,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Latency {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

/// The consumers' side effects on one source's streams.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct InboxCheck {
    pub(crate) source: Src,
    pub(crate) side_effects: u64,
    pub(crate) duplicate_side_effects: u64,
    /// Delivered events no consumer applied.
    pub(crate) unapplied: u64,
}

/// The ledger: each committed event's source and whether it is poison.
pub(crate) async fn ledger(db: &Client) -> anyhow::Result<HashMap<Uuid, (Src, bool)>> {
    let rows = db
        .query(
            &format!("SELECT event_id, source, poison FROM {SCHEMA}.ledger"),
            &[],
        )
        .await
        .context("reading the ledger")?;
    Ok(rows
        .iter()
        .map(|r| {
            let src = if r.get::<_, &str>(1) == "wal" {
                Src::Wal
            } else {
                Src::Poll
            };
            (r.get(0), (src, r.get(2)))
        })
        .collect())
}

/// How a source's deliveries are bounded per fault.
pub(crate) struct Bounds {
    pub(crate) batch: u64,
    pub(crate) relays: u64,
    pub(crate) wal_window: u64,
}

impl Bounds {
    fn of(&self, src: Src, hits: Hits) -> u64 {
        // A polling relay has two batches in flight: one at the sink, the
        // one before it waiting for its commit (the README's guarantee).
        match (src, hits) {
            (Src::Wal, _) => self.wal_window,
            (Src::Poll, Hits::OneRelay) => 2 * self.batch,
            (Src::Poll, Hits::AllRelays) => 2 * self.batch * self.relays,
        }
    }
}

/// Checks one source: `streams` its deliveries, stream by stream; then
/// its outbox's dead letters and leftovers.
pub(crate) async fn check_source(
    db: &Client,
    src: Src,
    streams: &[Vec<Delivery>],
    ledger: &HashMap<Uuid, (Src, bool)>,
    faults: &[Record],
    bounds: &Bounds,
) -> anyhow::Result<SourceCheck> {
    let mut check = tally(src, streams, ledger, faults, bounds);
    let poison = of(ledger, src, true);
    let table = format!("{SCHEMA}.{}", names::table(src));
    let dead: HashSet<Uuid> = db
        .query(
            &format!("SELECT event_id FROM {table} WHERE dead_at IS NOT NULL"),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let left_behind: i64 = db.query_one(&names::waiting(src), &[]).await?.get(0);
    check.dead_letters = dead.len() as u64;
    check.dead_letters_unexplained = dead.difference(&poison).count() as u64;
    check.poison_not_dead = poison.difference(&dead).count() as u64;
    check.left_behind = left_behind as u64;
    Ok(check)
}

/// The ledger's events of `src`: the poison ones, or the others.
fn of(ledger: &HashMap<Uuid, (Src, bool)>, src: Src, poison: bool) -> HashSet<Uuid> {
    ledger
        .iter()
        .filter(|(_, (s, p))| *s == src && *p == poison)
        .map(|(id, _)| *id)
        .collect()
}

/// The deliveries' part of [`check_source`].
fn tally(
    src: Src,
    streams: &[Vec<Delivery>],
    ledger: &HashMap<Uuid, (Src, bool)>,
    faults: &[Record],
    bounds: &Bounds,
) -> SourceCheck {
    let committed = of(ledger, src, false);
    let poison = of(ledger, src, true);

    let mut seen: HashMap<Uuid, (i64, u32)> = HashMap::new();
    let mut order_violations = 0;
    let mut latencies = Vec::new();
    let mut deliveries = 0u64;
    // (previous delivery, repeat) times of each repeated delivery.
    let mut repeats: Vec<(i64, i64)> = Vec::new();
    for stream in streams {
        let mut last_seq: HashMap<&str, i64> = HashMap::new();
        for d in stream {
            deliveries += 1;
            match seen.get_mut(&d.event_id) {
                Some((last, n)) => {
                    *n += 1;
                    repeats.push((*last, d.ms));
                    *last = d.ms;
                }
                None => {
                    seen.insert(d.event_id, (d.ms, 1));
                    latencies.push((d.ms - d.written_ms) as f64);
                    let last = last_seq.entry(&d.aggregate_id).or_insert(0);
                    if d.seq < *last {
                        order_violations += 1;
                    }
                    *last = (*last).max(d.seq);
                }
            }
        }
    }
    let delivered: HashSet<Uuid> = seen.keys().copied().collect();

    // Each repeat is put down to the first fault in scope that was still
    // going after the delivery before it and had begun by the repeat.
    let scoped: Vec<&Record> = faults.iter().filter(|f| f.scope.contains(&src)).collect();
    let mut per_fault: HashMap<usize, u64> = HashMap::new();
    let mut unexplained = 0;
    let mut unexplained_at_ms = Vec::new();
    for (first, again) in &repeats {
        let cause = scoped
            .iter()
            .enumerate()
            .filter(|(_, f)| f.at_ms <= *again && f.at_ms + (f.seconds * 1000.0) as i64 >= *first)
            .min_by_key(|(_, f)| f.at_ms + (f.seconds * 1000.0) as i64)
            .map(|(i, _)| i);
        match cause {
            Some(i) => *per_fault.entry(i).or_default() += 1,
            None => {
                unexplained += 1;
                if unexplained_at_ms.len() < 10 {
                    unexplained_at_ms.push((*first, *again));
                }
            }
        }
    }
    let mut kinds: Vec<&'static str> = scoped.iter().map(|f| f.kind).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let mut over_bound = 0;
    let by_fault = kinds
        .into_iter()
        .map(|kind| {
            let counts: Vec<u64> = scoped
                .iter()
                .enumerate()
                .filter(|(_, f)| f.kind == kind)
                .map(|(i, _)| per_fault.get(&i).copied().unwrap_or(0))
                .collect();
            // Faults of one kind reach the same relays.
            let bound = scoped
                .iter()
                .find(|f| f.kind == kind)
                .map_or(0, |f| bounds.of(src, f.hits));
            over_bound += counts.iter().filter(|&&c| c > bound).count() as u64;
            DupStat {
                kind,
                faults: counts.len(),
                with_duplicates: counts.iter().filter(|&&c| c > 0).count(),
                total: counts.iter().sum(),
                max_per_fault: counts.iter().copied().max().unwrap_or(0),
                bound,
                per_fault: counts,
            }
        })
        .collect();

    latencies.sort_by(f64::total_cmp);
    SourceCheck {
        source: src,
        committed: committed.len() as u64,
        poison: poison.len() as u64,
        deliveries,
        delivered: delivered.len() as u64,
        lost: committed.difference(&delivered).count() as u64,
        phantom: delivered.iter().filter(|id| !ledger.contains_key(id)).count() as u64,
        poison_delivered: poison.intersection(&delivered).count() as u64,
        duplicates: deliveries - delivered.len() as u64,
        unexplained_duplicates: unexplained,
        unexplained_at_ms,
        duplicates_by_fault: by_fault,
        over_bound,
        order_violations,
        dead_letters: 0,
        dead_letters_unexplained: 0,
        poison_not_dead: 0,
        left_behind: 0,
        latency_ms: Latency {
            p50: percentile(&latencies, 0.5),
            p99: percentile(&latencies, 0.99),
            max: latencies.last().copied().unwrap_or(0.0),
        },
    }
}

/// Distinct side effects applied per stream.
pub(crate) async fn applied(db: &Client) -> anyhow::Result<HashMap<String, (i64, i64)>> {
    let rows = db
        .query(
            &format!(
                "SELECT stream, count(*), count(DISTINCT event_id) FROM {SCHEMA}.effects GROUP BY stream"
            ),
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect())
}

/// The inbox check of `src`: `delivered` distinct events per stream.
pub(crate) fn inbox(
    src: Src,
    delivered: &HashMap<String, u64>,
    applied: &HashMap<String, (i64, i64)>,
) -> InboxCheck {
    let mut check = InboxCheck {
        source: src,
        side_effects: 0,
        duplicate_side_effects: 0,
        unapplied: 0,
    };
    for ty in names::TYPES {
        let stream = names::stream(src, ty);
        let (count, distinct) = applied.get(&stream).copied().unwrap_or((0, 0));
        check.side_effects += count as u64;
        check.duplicate_side_effects += (count - distinct) as u64;
        check.unapplied += delivered
            .get(&stream)
            .copied()
            .unwrap_or(0)
            .saturating_sub(distinct as u64);
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ms: i64, id: u128, aggregate: &str, seq: i64) -> Delivery {
        Delivery {
            ms,
            event_id: Uuid::from_u128(id),
            aggregate_id: aggregate.to_owned(),
            seq,
            written_ms: ms - 5,
        }
    }

    fn fault(at_ms: i64, seconds: f64, kind: &'static str, hits: Hits) -> Record {
        Record {
            at_s: 0.0,
            at_ms,
            kind,
            target: String::new(),
            detail: String::new(),
            seconds,
            scope: vec![Src::Poll],
            hits,
            took: true,
        }
    }

    const BOUNDS: Bounds = Bounds {
        batch: 1,
        relays: 2,
        wal_window: 10,
    };

    fn ledger(ids: &[u128], poison: &[u128]) -> HashMap<Uuid, (Src, bool)> {
        ids.iter()
            .map(|&i| (Uuid::from_u128(i), (Src::Poll, poison.contains(&i))))
            .collect()
    }

    #[test]
    fn lost_phantom_and_poison_are_told_apart() {
        let stream = vec![
            d(10, 1, "a", 1),
            d(11, 2, "a", 2),
            d(12, 9, "b", 1),
            d(13, 4, "b", 2),
        ];
        let c = tally(Src::Poll, &[stream], &ledger(&[1, 2, 3, 4], &[4]), &[], &BOUNDS);
        assert_eq!((c.committed, c.poison, c.delivered), (3, 1, 4));
        assert_eq!(c.lost, 1, "event 3 never arrived");
        assert_eq!(c.phantom, 1, "event 9 was never committed");
        assert_eq!(c.poison_delivered, 1);
        assert_eq!((c.duplicates, c.order_violations), (0, 0));
    }

    #[test]
    fn order_is_judged_on_first_deliveries_only() {
        // a#2 before a#1 is a violation; a#1 again after a#3 (a repeat) is not.
        let stream = vec![
            d(10, 2, "a", 2),
            d(11, 1, "a", 1),
            d(12, 3, "a", 3),
            d(13, 1, "a", 1),
            d(14, 5, "b", 1),
        ];
        let c = tally(
            Src::Poll,
            &[stream],
            &ledger(&[1, 2, 3, 5], &[]),
            &[fault(12, 0.5, "relay SIGKILL", Hits::OneRelay)],
            &BOUNDS,
        );
        assert_eq!(c.order_violations, 1);
        assert_eq!(c.duplicates, 1);
    }

    #[test]
    fn repeats_are_put_down_to_the_fault_after_the_first_delivery() {
        let stream = vec![
            d(100, 1, "a", 1),
            d(101, 2, "a", 2),
            d(102, 3, "a", 3),
            // A kill at 150 made 1-3 repeat; a repeat at 400 has no fault.
            d(200, 1, "a", 1),
            d(201, 2, "a", 2),
            d(202, 3, "a", 3),
            d(400, 2, "a", 2),
        ];
        let faults = [
            fault(150, 0.01, "relay SIGKILL", Hits::OneRelay),
            fault(300, 0.01, "PostgreSQL crash (SIGKILL)", Hits::AllRelays),
        ];
        let c = tally(Src::Poll, &[stream], &ledger(&[1, 2, 3], &[]), &faults, &BOUNDS);
        assert_eq!(c.duplicates, 4);
        let kill = c
            .duplicates_by_fault
            .iter()
            .find(|s| s.kind == "relay SIGKILL")
            .unwrap();
        assert_eq!((kill.total, kill.max_per_fault, kill.bound), (3, 3, 2));
        assert_eq!(kill.buckets(), "1–10 ×1");
        assert_eq!(c.over_bound, 1, "3 repeats of one kill exceed two batches of 1");
        // The repeat at 400 ms: the crash began after event 2's first
        // delivery and before the repeat, so it is the crash's.
        let crash = c
            .duplicates_by_fault
            .iter()
            .find(|s| s.kind.starts_with("PostgreSQL"))
            .unwrap();
        assert_eq!(
            (crash.total, crash.bound),
            (1, 4),
            "two batches of 1 for each of 2 relays"
        );
        assert_eq!(c.unexplained_duplicates, 0);
        let lonely = tally(
            Src::Poll,
            &[vec![d(1, 1, "a", 1), d(2, 1, "a", 1)]],
            &ledger(&[1], &[]),
            &[],
            &BOUNDS,
        );
        assert_eq!(lonely.unexplained_duplicates, 1);
    }
}
