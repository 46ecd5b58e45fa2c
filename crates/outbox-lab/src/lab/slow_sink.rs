//! `slow-sink`: what a slow sink costs the rest of the database (issue 18).
//!
//! With `--claim lock` (the default) a batch is delivered inside the
//! transaction that claimed it. While a receiver takes 2 s per request that
//! transaction stays open, and VACUUM keeps every row version deleted after
//! it began, in every table: PostgreSQL's horizon is the oldest running
//! transaction's xid or snapshot. `--claim deadline` claims in a short
//! transaction, delivers with none open and marks in a second one.
//!
//! For each claim mode the experiment starts a relay against a receiver
//! that answers after 2 s; once the first request has arrived, four
//! sessions update an unrelated table (`accounts`, autovacuum off) in small
//! transactions, then the lab VACUUMs it while the relay is still
//! delivering and reads `n_dead_tup`, which that VACUUM sets to the dead row
//! versions it found but could not remove. A sampler reads
//! `pg_stat_activity` every 10 ms for the relay's backends
//! (`application_name` starting `outbox-relay`).
//!
//! What "the oldest snapshot" means here: a backend holds the horizon back
//! if it has a snapshot (`backend_xmin`) or an xid (`backend_xid`). A lock
//! claim's session sits idle in its transaction during delivery: in READ
//! COMMITTED it then has no snapshot, so `backend_xmin` is NULL, but its
//! xid (taken by the claim's UPDATE) holds the horizon just the same.
//! Counting only `backend_xmin` would hide exactly the case this is about,
//! so the sampler takes both: the age of the older in transactions, and
//! `clock_timestamp() - xact_start` of that backend, how long its
//! transaction has been open. A sample sees a transaction's age so far, so
//! the longest seen is short of the true one by up to one interval.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_relay::ClaimMode;
use outbox_testkit::{Receiver, Respond};
use tokio::task::{JoinHandle, JoinSet};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::shop::event_id;
use crate::plot::{self, Mark, Series};
use crate::report::{Outcome, Plot, Table, Verdict};
use crate::scratch::{LONG, Scratch};

/// How long the receiver takes to answer each request.
const DELAY: Duration = Duration::from_secs(2);
/// `--http-concurrency`'s default: requests of one batch in flight at once.
const CONCURRENCY: usize = 16;
/// How often the sampler reads `pg_stat_activity`.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// The unrelated table (in the lab's schema, dropped with it) and its size.
const ACCOUNTS: &str = "outbox_lab.accounts";
const ACCOUNT_ROWS: usize = 1000;
/// Sessions updating it at once, each on its own rows.
const WRITERS: usize = 4;
/// The plot keeps the largest sample of each bucket this wide.
const PLOT_BUCKET: f64 = 0.1;

const MODES: [ClaimMode; 2] = [ClaimMode::Lock, ClaimMode::Deadline];

/// The relay's backends: the oldest transaction among those holding an xid
/// or a snapshot, how long it has been open and its age in transactions.
/// `age()` of the xid, since the transaction's snapshot, if any, is newer.
const SAMPLE: &str = "\
    SELECT count(*)::int8, \
           count(*) FILTER (WHERE backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)::int8, \
           coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)) \
                    FILTER (WHERE backend_xid IS NOT NULL OR backend_xmin IS NOT NULL), 0)::float8, \
           coalesce(max(greatest(age(backend_xid), age(backend_xmin))), 0)::int8 \
      FROM pg_stat_activity \
     WHERE application_name LIKE 'outbox-relay%' AND datname = current_database()";

/// This run's sizes.
struct Sizes {
    events: usize,
    batch: usize,
    updates: usize,
}

impl Sizes {
    /// How long delivering every event should take: each batch in rounds
    /// of `CONCURRENCY` requests, one `DELAY` each.
    fn expected(&self) -> Duration {
        let rounds = self.events.div_ceil(self.batch) * self.batch.div_ceil(CONCURRENCY);
        DELAY * rounds as u32
    }
}

/// One read of `pg_stat_activity`.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the relay was started.
    t: f64,
    backends: i64,
    /// Backends holding an xid or a snapshot.
    holding: i64,
    /// How long the oldest of those has been in its transaction (0: none).
    xact_seconds: f64,
    /// Its age in transactions (0: none).
    xid_age: i64,
}

/// What one claim mode showed.
struct ModeRun {
    mode: ClaimMode,
    samples: Vec<Sample>,
    max_xact_seconds: f64,
    max_xid_age: i64,
    /// The relay's backends seen at once, at most.
    backends: i64,
    /// The share of samples in which some relay backend held the horizon.
    holding_share: f64,
    /// Seconds the updates took.
    update_seconds: f64,
    /// `n_dead_tup` right after the VACUUM: dead but not removable.
    dead_after_vacuum: i64,
    /// The table's size before the updates and after the VACUUM.
    size_before: i64,
    size_after: i64,
    /// Requests that had arrived at the receiver when the VACUUM ended.
    arrived_at_vacuum: usize,
    /// When the VACUUM ran, seconds since the relay was started.
    vacuum_at: f64,
    events_per_second: f64,
    requests: usize,
    distinct: usize,
}

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let sizes = if lab.quick {
        Sizes {
            events: 128,
            batch: 32,
            updates: 10_000,
        }
    } else {
        Sizes {
            events: 300,
            batch: 100,
            updates: 50_000,
        }
    };
    let mut out = Outcome::new(
        "slow-sink",
        "Slow sink: a claim held open through delivery holds back VACUUM",
        "With --claim lock a batch is delivered inside the transaction that claimed it, so a slow \
         sink keeps a transaction open, and VACUUM cannot remove row versions deleted after it \
         began, in any table. With --claim deadline the claim commits before delivery and the marks \
         go in a second short transaction: no relay transaction outlives a round trip, and VACUUM \
         cleans the unrelated table while the sink is still busy.",
        format!(
            "per claim mode: {} events (distinct aggregates) to an HTTP receiver answering each request \
             after {} s, relay --claim lock|lease --batch-size {} --http-concurrency {CONCURRENCY} (the \
             default); once the first request arrived, {} single-row UPDATEs of a {ACCOUNT_ROWS}-row \
             table (autovacuum off) in autocommit transactions from {WRITERS} sessions \
             (synchronous_commit off), then VACUUM of it while the relay is still delivering, and its \
             n_dead_tup after. pg_stat_activity sampled every {} ms for backends named outbox-relay*: \
             the oldest transaction holding an xid or a snapshot (backend_xid or backend_xmin), its \
             age in transactions and clock_timestamp() - xact_start. Events/s from the relay's READY \
             to the last event marked.",
            sizes.events,
            DELAY.as_secs(),
            sizes.batch,
            sizes.updates,
            SAMPLE_EVERY.as_millis(),
        ),
    );
    let mut runs = Vec::with_capacity(MODES.len());
    for mode in MODES {
        lab.step(&format!("slow-sink: --claim {mode}"));
        runs.push(
            measure(lab, mode, &sizes)
                .await
                .with_context(|| format!("--claim {mode}"))?,
        );
    }
    rows(&mut out, &sizes, &runs);
    out.tables.push(side_by_side(&sizes, &runs));
    out.plots.push(xact_plot(&runs).await?);
    Ok(out)
}

async fn measure(lab: &mut Scratch, mode: ClaimMode, sizes: &Sizes) -> anyhow::Result<ModeRun> {
    lab.reset().await?;
    lab.db
        .batch_execute(&format!(
            "CREATE TABLE {ACCOUNTS} (id int8 PRIMARY KEY, balance int8 NOT NULL) \
               WITH (autovacuum_enabled = off); \
             INSERT INTO {ACCOUNTS} SELECT i, 0 FROM generate_series(1, {ACCOUNT_ROWS}) AS i"
        ))
        .await
        .context("creating the unrelated table")?;
    // Its own statement: VACUUM cannot run in the implicit transaction of
    // a multi-statement query.
    lab.db.batch_execute(&format!("VACUUM {ACCOUNTS}")).await?;
    let size_before = table_size(lab).await?;
    let events: Vec<_> = (1..=sizes.events as i64)
        .map(|i| Scratch::order_event(i, "OrderPlaced"))
        .collect();
    lab.insert(&events).await?;

    let receiver = Receiver::start(Respond::Ok).await?;
    receiver.set_delay(Some(DELAY));
    let stop = CancellationToken::new();
    // Stops the sampler also when a step below fails.
    let _stop_on_exit = stop.clone().drop_guard();
    let origin = Instant::now();
    let sampler = sample(lab.connect().await?, origin, stop.clone());
    let batch = sizes.batch.to_string();
    let relay = lab
        .spawn_relay(
            &receiver.url(),
            &["--claim", mode.as_str(), "--batch-size", &batch],
            &[],
        )
        .await?;
    let ready = Instant::now();

    // Delivery is under way: the relay has a batch at the receiver.
    receiver.wait_for_count(1, LONG).await?;
    let update_seconds = update(lab, sizes.updates).await?;
    let vacuum_at = origin.elapsed().as_secs_f64();
    lab.db.batch_execute(&format!("VACUUM {ACCOUNTS}")).await?;
    let arrived_at_vacuum = receiver.count();
    if arrived_at_vacuum >= sizes.events {
        bail!(
            "the last requests had arrived before the VACUUM ended ({} updates took {update_seconds:.1} s): \
             it did not run during delivery",
            sizes.updates
        );
    }
    // VACUUM sets n_dead_tup to what it found dead but could not remove,
    // in shared memory at once (PostgreSQL 15+).
    let dead_after_vacuum = lab
        .count(&format!(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = '{ACCOUNTS}'::regclass"
        ))
        .await?;
    let size_after = table_size(lab).await?;
    let committed = lab
        .count(&format!("SELECT sum(balance)::int8 FROM {ACCOUNTS}"))
        .await?;
    if committed != sizes.updates as i64 {
        bail!("{committed} updates committed of {}", sizes.updates);
    }

    receiver
        .wait_for_count(sizes.events, sizes.expected() * 2 + LONG)
        .await?;
    lab.wait_drained("every event marked published").await?;
    let seconds = ready.elapsed().as_secs_f64();
    stop.cancel();
    let samples = sampler.await.context("the sampler panicked")??;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    receiver.shutdown().await;
    let distinct: HashSet<_> = received.iter().map(event_id).collect::<Result<_, _>>()?;

    let backends = samples.iter().map(|s| s.backends).max().unwrap_or(0);
    if backends == 0 {
        bail!("the sampler saw no backend named outbox-relay*");
    }
    Ok(ModeRun {
        mode,
        max_xact_seconds: samples.iter().map(|s| s.xact_seconds).fold(0.0, f64::max),
        max_xid_age: samples.iter().map(|s| s.xid_age).max().unwrap_or(0),
        holding_share: samples.iter().filter(|s| s.holding > 0).count() as f64 / samples.len().max(1) as f64,
        samples,
        backends,
        update_seconds,
        dead_after_vacuum,
        size_before,
        size_after,
        arrived_at_vacuum,
        vacuum_at,
        events_per_second: sizes.events as f64 / seconds,
        requests: received.len(),
        distinct: distinct.len(),
    })
}

/// Reads `pg_stat_activity` every `SAMPLE_EVERY` on `client` until `stop`.
fn sample(
    client: Client,
    origin: Instant,
    stop: CancellationToken,
) -> JoinHandle<anyhow::Result<Vec<Sample>>> {
    tokio::spawn(async move {
        let statement = client.prepare(SAMPLE).await?;
        let mut samples = Vec::new();
        while !stop.is_cancelled() {
            let row = client
                .query_one(&statement, &[])
                .await
                .context("sampling pg_stat_activity")?;
            samples.push(Sample {
                t: origin.elapsed().as_secs_f64(),
                backends: row.get(0),
                holding: row.get(1),
                xact_seconds: row.get(2),
                xid_age: row.get(3),
            });
            // Both futures are cancel-safe: a sleep and a token.
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(SAMPLE_EVERY) => {}
            }
        }
        Ok(samples)
    })
}

/// Commits `updates` single-row UPDATEs of the unrelated table from
/// `WRITERS` sessions, each on its own rows (no lock waits); returns the
/// seconds they took.
async fn update(lab: &Scratch, updates: usize) -> anyhow::Result<f64> {
    let mut writers = Vec::with_capacity(WRITERS);
    for _ in 0..WRITERS {
        let client = lab.connect().await?;
        // The updates stand for an application's traffic; not waiting
        // for the WAL flush keeps them quick on a server with fsync on.
        client.batch_execute("SET synchronous_commit = off").await?;
        let statement = client
            .prepare(&format!(
                "UPDATE {ACCOUNTS} SET balance = balance + 1 WHERE id = $1"
            ))
            .await?;
        writers.push((client, statement));
    }
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for (w, (client, statement)) in writers.into_iter().enumerate() {
        let n = updates / WRITERS + usize::from(w < updates % WRITERS);
        tasks.spawn(async move {
            for i in 0..n {
                // Writer w's rows are those ≡ w mod WRITERS.
                let id = ((i * WRITERS + w) % ACCOUNT_ROWS + 1) as i64;
                client.execute(&statement, &[&id]).await?;
            }
            // The dead tuples these updates counted reach the shared
            // statistics before this answer (PostgreSQL 15+): flushed
            // later, they would be added to what the VACUUM sets. Older
            // servers lack the function and flush within a second.
            let _ = client.batch_execute("SELECT pg_stat_force_next_flush()").await;
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("an updater panicked")??;
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn table_size(lab: &Scratch) -> anyhow::Result<i64> {
    lab.count(&format!("SELECT pg_relation_size('{ACCOUNTS}')")).await
}

/// `lock / lease` of one figure.
fn both(runs: &[ModeRun], f: impl Fn(&ModeRun) -> String) -> String {
    runs.iter().map(f).collect::<Vec<_>>().join(" / ")
}

fn rows(out: &mut Outcome, sizes: &Sizes, runs: &[ModeRun]) {
    out.row(
        "oldest relay transaction holding an xid or snapshot, longest seen: lock / lease",
        both(runs, |r| format!("{:.3} s", r.max_xact_seconds)),
        "lock: up to two batches' delivery (the next batch is claimed during one); lease ≤ 0.1 s (target)",
        Verdict::Timing,
    );
    out.row(
        "its age in transactions (age of backend_xid or backend_xmin), largest: lock / lease",
        both(runs, |r| r.max_xid_age.to_string()),
        format!("lock: up to the {} updates; lease: a few", sizes.updates),
        Verdict::Timing,
    );
    out.row(
        format!(
            "{} updates during delivery, then VACUUM: dead row versions it could not remove: lock / lease",
            sizes.updates
        ),
        both(runs, |r| r.dead_after_vacuum.to_string()),
        "lease: 0 (target)",
        Verdict::Timing,
    );
    out.row(
        "the unrelated table's size before the updates → after that VACUUM: lock / lease",
        both(runs, |r| format!("{} → {}", kb(r.size_before), kb(r.size_after))),
        "lock: a row version per update; lease: pruned as it goes",
        Verdict::Timing,
    );
    out.row(
        "events/s delivered: lock / lease",
        both(runs, |r| format!("{:.1}", r.events_per_second)),
        format!(
            "≤ {:.1} (the receiver's pace: {CONCURRENCY} requests per {} s)",
            CONCURRENCY as f64 / DELAY.as_secs_f64(),
            DELAY.as_secs()
        ),
        Verdict::Timing,
    );
    out.row(
        "distinct events received of written: lock / lease",
        both(runs, |r| format!("{}/{}", r.distinct, sizes.events)),
        "all",
        Verdict::check(runs.iter().all(|r| r.distinct == sizes.events)),
    );
}

/// The figures of both modes, one row each, plain numbers (the lab's test
/// reads them from `--json`).
fn side_by_side(sizes: &Sizes, runs: &[ModeRun]) -> Table {
    let mut t = Table::new(
        "Lock and lease side by side",
        &[
            "claim",
            "oldest relay xact, s",
            "xid age",
            "holding, % of samples",
            "relay backends",
            "updates",
            "updates took, s",
            "VACUUM at, s",
            "arrived by then",
            "dead after VACUUM",
            "table kB after",
            "events/s",
            "requests",
            "distinct events",
        ],
    );
    for r in runs {
        t.rows.push(vec![
            r.mode.as_str().to_owned(),
            format!("{:.3}", r.max_xact_seconds),
            r.max_xid_age.to_string(),
            format!("{:.1}", r.holding_share * 100.0),
            r.backends.to_string(),
            sizes.updates.to_string(),
            format!("{:.2}", r.update_seconds),
            format!("{:.2}", r.vacuum_at),
            r.arrived_at_vacuum.to_string(),
            r.dead_after_vacuum.to_string(),
            (r.size_after / 1024).to_string(),
            format!("{:.2}", r.events_per_second),
            r.requests.to_string(),
            r.distinct.to_string(),
        ]);
    }
    t
}

/// The oldest relay transaction's age over time, the largest sample of
/// each `PLOT_BUCKET` (the peaks stay, the page stays small).
async fn xact_plot(runs: &[ModeRun]) -> anyhow::Result<Plot> {
    let series = runs
        .iter()
        .map(|r| {
            let mut points: Vec<(f64, f64)> = Vec::new();
            for s in &r.samples {
                let x = (s.t / PLOT_BUCKET).floor() * PLOT_BUCKET;
                match points.last_mut() {
                    Some(last) if last.0 == x => last.1 = last.1.max(s.xact_seconds),
                    _ => points.push((x, s.xact_seconds)),
                }
            }
            Series {
                name: format!("--claim {}", r.mode),
                points,
                mark: Mark::Line,
            }
        })
        .collect();
    plot::xy(
        "Oldest relay transaction holding back VACUUM, receiver answering in 2 s",
        "seconds since the relay started",
        "open for, s",
        series,
    )
    .await
}

fn kb(bytes: i64) -> String {
    format!("{:.0} kB", bytes as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::super::shop::SCHEMA;
    use super::*;

    #[test]
    fn the_unrelated_table_is_in_the_lab_schema() {
        assert_eq!(ACCOUNTS, format!("{SCHEMA}.accounts"));
    }

    #[test]
    fn expected_counts_rounds_of_each_batch() {
        let quick = Sizes {
            events: 128,
            batch: 32,
            updates: 0,
        };
        // 4 batches of 2 rounds.
        assert_eq!(quick.expected(), Duration::from_secs(16));
        let full = Sizes {
            events: 300,
            batch: 100,
            updates: 0,
        };
        // 3 batches of 7 rounds.
        assert_eq!(full.expected(), Duration::from_secs(42));
    }
}
