//! Held snapshot: how fast a running relay drains chunk after chunk while
//! another session holds one `REPEATABLE READ` snapshot for the whole run,
//! against the same run with none (issue 32).
//!
//! A snapshot that old keeps vacuum from removing anything the relay
//! leaves behind: the polling relay's marks (an update per event, whose
//! old version's entry stays in the partial index) and the WAL source's
//! deletes. Per run: one relay (`--batch-size` as the phase's batch), then
//! `chunks` times a chunk of events inserted in one transaction and timed
//! from its commit until the stream holds every event so far. The
//! snapshot, when held, is taken before the first chunk (after the WAL
//! source's slot was created: creating one waits for the transactions in
//! progress) and released after the last. The figure is each chunk's
//! events per second; what matters is how the last compares with the
//! first, and with the clean run's last.
//!
//! Both sources, in the same run: the WAL source only where the server
//! has `wal_level = logical` (the bench's throwaway server does when this
//! phase runs), else its rows are left out and the report says why.
//! Every event must arrive: a loss fails the run.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use redis::AsyncCommands;
use serde::Serialize;

use super::results::Report;
use super::throughput::{Strategy, stream_counts};
use super::{STREAM, event};
use crate::report::{Col, Spread, Table};
use crate::scratch::{LONG, Scratch};

/// How often the stream's length is read while a chunk drains.
const WATCH: Duration = Duration::from_millis(5);

/// The sources this phase measures, each clean then with a snapshot held.
pub(crate) const SOURCES: [Strategy; 2] = [Strategy::Relay, Strategy::Wal];

/// One run of `chunks` chunks by one source, with or without a snapshot.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct HeldRun {
    /// Events per chunk.
    pub(crate) chunk: usize,
    /// Each chunk's events per second, from its commit to its last event
    /// in the stream.
    pub(crate) per_second: Vec<f64>,
    /// Distinct events in the stream at the end, and entries beyond them.
    pub(crate) delivered: u64,
    pub(crate) duplicates: u64,
    pub(crate) written: u64,
}

/// Whether the server can run the WAL source (`wal_level = logical`).
pub(crate) async fn logical(scratch: &Scratch) -> anyhow::Result<bool> {
    let row = scratch.db.query_one("SHOW wal_level", &[]).await?;
    Ok(row.get::<_, String>(0) == "logical")
}

/// Drains `chunks` chunks of `chunk` events with `strategy`'s relay at
/// `--batch-size batch`, a `REPEATABLE READ` snapshot held throughout if
/// `held`.
pub(crate) async fn measure(
    scratch: &mut Scratch,
    strategy: Strategy,
    held: bool,
    chunks: usize,
    chunk: usize,
    batch: u32,
) -> anyhow::Result<HeldRun> {
    scratch.prepare(strategy).await?;
    let mut redis = scratch.redis().await?;
    let b = batch.to_string();
    let mut args = vec!["--batch-size", b.as_str()];
    args.extend(strategy.relay_args());
    let relay = scratch.spawn_bench_relay(&args).await?;
    // The snapshot of a REPEATABLE READ transaction is taken by its first
    // statement and kept until it ends; a read-only one has no
    // transaction id, as a report or a backup's would not.
    let snapshot = if held {
        let client = scratch.connect().await?;
        client
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM {}",
                scratch.table()
            ))
            .await
            .context("taking the held snapshot")?;
        Some(client)
    } else {
        None
    };
    let mut per_second = Vec::with_capacity(chunks);
    let mut written = 0_u64;
    for c in 0..chunks {
        let events: Vec<_> = (c * chunk..(c + 1) * chunk).map(event).collect();
        let tx = scratch.db.transaction().await?;
        for part in events.chunks(1000) {
            scratch.outbox.enqueue_all(&tx, part).await?;
        }
        tx.commit().await?;
        let committed = Instant::now();
        written += chunk as u64;
        loop {
            let len: u64 = redis.xlen(STREAM).await?;
            if len >= written {
                break;
            }
            if committed.elapsed() > LONG * 5 {
                bail!(
                    "{}: {len} of {written} events reached the stream within {:?} of chunk {}'s commit",
                    strategy.label(),
                    LONG * 5,
                    c + 1
                );
            }
            tokio::time::sleep(WATCH).await;
        }
        per_second.push(chunk as f64 / committed.elapsed().as_secs_f64());
    }
    if let Some(client) = snapshot {
        client.batch_execute("ROLLBACK").await?;
    }
    scratch.stop_relay(relay).await?;
    let (entries, delivered) = stream_counts(&mut redis).await?;
    Ok(HeldRun {
        chunk,
        per_second,
        delivered,
        duplicates: entries - delivered,
        written,
    })
}

/// One source, clean or held: each chunk's rate over the repetitions.
#[derive(Debug, Serialize)]
pub(crate) struct HeldRow {
    pub(crate) strategy: Strategy,
    pub(crate) held: bool,
    pub(crate) batch_size: u32,
    /// Events per second of each chunk, in order.
    pub(crate) per_chunk: Vec<Spread>,
    /// The last chunk's median over the first's.
    pub(crate) last_over_first: f64,
    /// Held rows: the last chunk's median over the clean run's last.
    pub(crate) last_over_clean_last: Option<f64>,
    pub(crate) runs: Vec<HeldRun>,
}

/// The source's name in the table.
fn source(strategy: Strategy) -> &'static str {
    if strategy.reads_wal() { "wal" } else { "poll" }
}

impl Report {
    pub(super) fn add_held_snapshot(
        &mut self,
        strategy: Strategy,
        held: bool,
        batch: u32,
        runs: Vec<HeldRun>,
    ) {
        let chunks = runs.iter().map(|r| r.per_second.len()).min().unwrap_or(0);
        let per_chunk: Vec<Spread> = (0..chunks)
            .map(|i| Spread::of(runs.iter().map(|r| r.per_second[i])))
            .collect();
        let (first, last) = match (per_chunk.first(), per_chunk.last()) {
            (Some(f), Some(l)) => (f.median, l.median),
            _ => (f64::NAN, f64::NAN),
        };
        let clean_last = self
            .held_snapshot
            .iter()
            .find(|r| r.strategy == strategy && !r.held)
            .and_then(|r| r.per_chunk.last())
            .map(|s| s.median);
        self.held_snapshot.push(HeldRow {
            strategy,
            held,
            batch_size: batch,
            per_chunk,
            last_over_first: last / first,
            last_over_clean_last: clean_last.filter(|_| held).map(|c| last / c),
            runs,
        });
    }

    pub(super) fn print_held_snapshot(&self) {
        let Some(first) = self.held_snapshot.first() else {
            return;
        };
        let run = first.runs.first().expect("a row has runs");
        let chunks = first.per_chunk.len();
        let mut header = vec!["source".to_owned(), "snapshot".to_owned()];
        header.extend((1..=chunks).map(|c| c.to_string()));
        header.extend(["last/first".to_owned(), "last/clean".to_owned()]);
        let mut cols = vec![Col::Left(6), Col::Left(8)];
        cols.extend((0..chunks).map(|_| Col::Right(7)));
        cols.extend([Col::Right(10), Col::Right(10)]);
        let mut t = Table::new(
            format!(
                "held snapshot: {chunks} chunks of {} events, each inserted in one transaction then drained \
                 (events/s, median of {} rep(s)), batch {}",
                run.chunk,
                first.runs.len(),
                first.batch_size
            ),
            &[],
        );
        t.header = header;
        for r in &self.held_snapshot {
            let mut row = vec![
                source(r.strategy).to_owned(),
                if r.held { "held" } else { "none" }.to_owned(),
            ];
            row.extend(r.per_chunk.iter().map(|s| format!("{:.0}", s.median)));
            row.push(format!("{:.0}%", r.last_over_first * 100.0));
            row.push(
                r.last_over_clean_last
                    .map_or("-".to_owned(), |x| format!("{:.0}%", x * 100.0)),
            );
            t.rows.push(row);
        }
        t.print_fixed(&cols);
        if !self.wal_level_logical {
            println!("(wal: not measured, the server's wal_level is not logical)");
        }
    }

    /// Fails if a held-snapshot run lost an event.
    pub(super) fn check_held_snapshot(&self) -> anyhow::Result<()> {
        for r in &self.held_snapshot {
            for run in &r.runs {
                if run.delivered != run.written {
                    bail!(
                        "held snapshot, {} ({}): {} of {} events delivered",
                        r.strategy.label(),
                        if r.held { "held" } else { "clean" },
                        run.delivered,
                        run.written
                    );
                }
            }
        }
        Ok(())
    }
}
