//! The soak's writers and its ledger.
//!
//! Each writer owns its aggregates and writes them one transaction at a
//! time, so an aggregate's `seq` rises in commit order. Every event's
//! ledger row (`outbox_soak.ledger`: event id, source, aggregate, seq,
//! poison) is inserted *in the event's transaction*: the ledger holds
//! exactly what committed, whatever happened to the writer's connection
//! around its COMMIT. A COMMIT whose answer was lost (PostgreSQL restarted
//! under it) is *in doubt* to the writer but not to the ledger; that is the
//! transactional outbox's own argument, used to check it.
//!
//! Some transactions roll back, some carry a poison event (larger than the
//! relays' `--max-event-bytes`, so a dead letter at once), and on the WAL
//! table a third use the table-less `emit`. The large transactions and the
//! writers SIGKILLed before COMMIT (a child process, `soak --doomed-writer`)
//! are faults of the schedule.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::{Event, Outbox};
use outbox_relay::pg::PgConfig;
use serde::Serialize;
use serde_json::json;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::names;
use super::schedule::{Rng, Src};
use super::unix_ms;
use crate::scratch::{connect, lab_command};

/// Bytes of a poison event's payload: over the relays' 16 KiB limit.
const POISON_BYTES: usize = 20_000;
/// Aggregates per writer and type.
const AGGREGATES: u64 = 100;
/// Events in the transaction a doomed writer holds open.
const DOOMED_EVENTS: usize = 100;

/// What the writers did, as they saw it.
#[derive(Debug, Default)]
pub(crate) struct WriteStats {
    pub(crate) committed_txns: AtomicU64,
    pub(crate) committed: AtomicU64,
    pub(crate) emitted: AtomicU64,
    pub(crate) poison: AtomicU64,
    pub(crate) rolled_back: AtomicU64,
    /// Events of transactions a fault broke before COMMIT.
    pub(crate) aborted: AtomicU64,
    /// Events whose COMMIT got no answer.
    pub(crate) in_doubt: AtomicU64,
    /// Events of doomed writers' open transactions, SIGKILLed.
    pub(crate) killed_before_commit: AtomicU64,
}

/// [`WriteStats`] as numbers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Written {
    pub(crate) committed_txns: u64,
    pub(crate) committed: u64,
    pub(crate) emitted: u64,
    pub(crate) poison: u64,
    pub(crate) rolled_back: u64,
    pub(crate) aborted: u64,
    pub(crate) in_doubt: u64,
    pub(crate) killed_before_commit: u64,
}

impl WriteStats {
    pub(crate) fn snapshot(&self) -> Written {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Written {
            committed_txns: g(&self.committed_txns),
            committed: g(&self.committed),
            emitted: g(&self.emitted),
            poison: g(&self.poison),
            rolled_back: g(&self.rolled_back),
            aborted: g(&self.aborted),
            in_doubt: g(&self.in_doubt),
            killed_before_commit: g(&self.killed_before_commit),
        }
    }
}

fn add(a: &AtomicU64, n: usize) {
    a.fetch_add(n as u64, Ordering::Relaxed);
}

impl WriteStats {
    /// `n` events of a transaction a fault broke: in doubt if its COMMIT
    /// got no answer, aborted if it broke before.
    fn broken(&self, committing: bool, n: usize) {
        add(if committing { &self.in_doubt } else { &self.aborted }, n);
    }
}

/// What the writers share.
pub(crate) struct Writers {
    pub(crate) pg: PgConfig,
    pub(crate) pg_url: String,
    pub(crate) stats: WriteStats,
    /// Writers stop when cancelled.
    pub(crate) stop: CancellationToken,
    /// While set, the WAL writers do not `emit` (an emitted event in WAL a
    /// slot loses has no row to recover it from; see the slot fault).
    pub(crate) emit_paused: AtomicBool,
    /// While set, nothing is written to the WAL outbox (`outbox migrate
    /// --wal --recover` keeps order only for aggregates nobody writes
    /// while it runs).
    pub(crate) wal_held: AtomicBool,
    /// Transactions on the WAL outbox under way.
    pub(crate) wal_in_flight: AtomicU32,
}

impl Writers {
    /// Writers of `pg`, none paused or held.
    pub(crate) fn new(pg: PgConfig, pg_url: String) -> Self {
        Self {
            pg,
            pg_url,
            stats: WriteStats::default(),
            stop: CancellationToken::new(),
            emit_paused: AtomicBool::new(false),
            wal_held: AtomicBool::new(false),
            wal_in_flight: AtomicU32::new(0),
        }
    }
}

/// A transaction on the WAL outbox counted while it runs: entered only
/// when the outbox is not held.
struct Entry<'a>(Option<&'a Writers>);

impl<'a> Entry<'a> {
    /// `None` while `src` is held. Counts first and checks after, so a hold
    /// that saw no transaction under way sees none start.
    fn enter(w: &'a Writers, src: Src) -> Option<Self> {
        if src != Src::Wal {
            return Some(Self(None));
        }
        w.wal_in_flight.fetch_add(1, Ordering::SeqCst);
        if w.wal_held.load(Ordering::SeqCst) {
            w.wal_in_flight.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Self(Some(w)))
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0 {
            w.wal_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// One event of a transaction, with its ledger facts.
struct Planned {
    event: Event,
    seq: i32,
    poison: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    Commit,
    Emit,
    Rollback,
}

/// The ledger row of each event, inserted in the event's transaction.
const LEDGER: &str = "INSERT INTO outbox_soak.ledger (event_id, source, aggregate_id, seq, poison) \
     SELECT e, $2, a, s, p FROM unnest($1::uuid[], $3::text[], $4::int4[], $5::bool[]) AS u(e, a, s, p)";

/// Writes `events` and their ledger rows in `tx`, inserted or emitted.
async fn write(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &Outbox,
    src: Src,
    events: &[Planned],
    how: How,
) -> Result<(), String> {
    let ids: Vec<uuid::Uuid> = events.iter().map(|p| p.event.event_id).collect();
    let aggregates: Vec<&str> = events.iter().map(|p| p.event.aggregate_id.as_str()).collect();
    let seqs: Vec<i32> = events.iter().map(|p| p.seq).collect();
    let poison: Vec<bool> = events.iter().map(|p| p.poison).collect();
    tx.execute(LEDGER, &[&ids, &src.name(), &aggregates, &seqs, &poison])
        .await
        .map_err(|e| e.to_string())?;
    let batch: Vec<Event> = events.iter().map(|p| p.event.clone()).collect();
    for chunk in batch.chunks(1000) {
        let written = match how {
            How::Emit => outbox.emit_all(tx, chunk).await.map(drop),
            How::Commit | How::Rollback => outbox.enqueue_all(tx, chunk).await.map(drop),
        };
        written.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Writes one transaction ([`write`]), then COMMIT or ROLLBACK.
/// `Err((committing, e))` says whether the error came from the COMMIT
/// itself (an unknown outcome) or before it.
async fn transaction(
    client: &mut Client,
    outbox: &Outbox,
    src: Src,
    events: &[Planned],
    how: How,
) -> Result<(), (bool, String)> {
    let tx = client.transaction().await.map_err(|e| (false, e.to_string()))?;
    write(&tx, outbox, src, events, how)
        .await
        .map_err(|e| (false, e))?;
    match how {
        How::Rollback => tx.rollback().await.map_err(|e| (false, e.to_string())),
        How::Commit | How::Emit => tx.commit().await.map_err(|e| (true, e.to_string())),
    }
}

fn event(aggregate_type: &str, aggregate_id: String, seq: i32, poison: bool) -> Planned {
    let payload = if poison {
        json!({ "seq": seq, "t": unix_ms(), "poison": true, "pad": "p".repeat(POISON_BYTES) })
    } else {
        json!({ "seq": seq, "t": unix_ms() })
    };
    Planned {
        event: Event::new(aggregate_type, aggregate_id, "Soaked", payload),
        seq,
        poison,
    }
}

/// A connection, or `None` after a failed attempt (the caller retries).
async fn reconnect(pg: &PgConfig) -> Option<Client> {
    match connect(pg).await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::debug!(error = %e, "soak writer: reconnecting");
            tokio::time::sleep(Duration::from_millis(200)).await;
            None
        }
    }
}

impl Writers {
    /// One writer of `src` at about `per_second` events per second (1–5
    /// per transaction), until stopped.
    pub(crate) async fn writer(self: Arc<Self>, src: Src, idx: u32, per_second: f64, mut rng: Rng) {
        let outbox = match names::config(src) {
            Ok(c) => Outbox::new(c),
            Err(e) => panic!("the soak's outbox config: {e}"),
        };
        let mut seqs: HashMap<String, i32> = HashMap::new();
        let mut client: Option<Client> = None;
        let mut next = Instant::now();
        while !self.stop.is_cancelled() {
            let n = 1 + rng.below(5) as usize;
            next += Duration::from_secs_f64(n as f64 / per_second);
            let now = Instant::now();
            if next > now {
                tokio::select! {
                    () = tokio::time::sleep_until(next.into()) => {}
                    () = self.stop.cancelled() => break,
                }
            } else if now - next > Duration::from_secs(1) {
                // Behind after an outage: carry on at the rate, no burst.
                next = now;
            }
            let Some(c) = client.as_mut() else {
                client = reconnect(&self.pg).await;
                continue;
            };
            let Some(_entry) = Entry::enter(&self, src) else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let how = if rng.chance(0.05) {
                How::Rollback
            } else if src == Src::Wal && rng.chance(1.0 / 3.0) && !self.emit_paused.load(Ordering::Relaxed) {
                How::Emit
            } else {
                How::Commit
            };
            let poison_at = (how == How::Commit && rng.chance(0.004)).then(|| rng.below(n as u64) as usize);
            let events: Vec<Planned> = (0..n)
                .map(|i| {
                    let ty = names::TYPES[rng.below(2) as usize];
                    let poison = poison_at == Some(i) && ty == names::TYPES[0];
                    let aggregate = format!("{}-w{idx}-{ty}-{}", src.name(), rng.below(AGGREGATES));
                    let seq = seqs.entry(aggregate.clone()).or_insert(0);
                    *seq += 1;
                    event(ty, aggregate, *seq, poison)
                })
                .collect();
            match transaction(c, &outbox, src, &events, how).await {
                Ok(()) => match how {
                    How::Rollback => add(&self.stats.rolled_back, n),
                    How::Commit | How::Emit => {
                        add(&self.stats.committed_txns, 1);
                        add(&self.stats.committed, n);
                        if how == How::Emit {
                            add(&self.stats.emitted, n);
                        }
                        add(&self.stats.poison, events.iter().filter(|p| p.poison).count());
                    }
                },
                Err((committing, e)) => {
                    self.stats.broken(committing, n);
                    tracing::debug!(error = %e, committing, "soak writer: transaction failed");
                    if c.is_closed() {
                        client = None;
                    }
                }
            }
        }
    }

    /// One transaction of `n` events over 50 aggregates of its own.
    pub(crate) async fn big_transaction(&self, src: Src, n: u32, tag: usize) -> anyhow::Result<String> {
        let outbox = Outbox::new(names::config(src)?);
        let _entry = loop {
            match Entry::enter(self, src) {
                Some(e) => break e,
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let mut client = connect(&self.pg).await?;
        let events: Vec<Planned> = (0..n as i32)
            .map(|i| {
                event(
                    names::TYPES[0],
                    format!("{}-big{tag}-{}", src.name(), i % 50),
                    i / 50 + 1,
                    false,
                )
            })
            .collect();
        match transaction(&mut client, &outbox, src, &events, How::Commit).await {
            Ok(()) => {
                add(&self.stats.committed_txns, 1);
                add(&self.stats.committed, events.len());
                Ok(format!(
                    "{n} events committed in one transaction ({})",
                    src.name()
                ))
            }
            Err((committing, e)) => {
                self.stats.broken(committing, events.len());
                Ok(format!("{n} events, broken by another fault ({e})"))
            }
        }
    }

    /// Holds the WAL outbox's writers off, once every transaction under way
    /// ended; [`Writers::release_wal`] lets them go on.
    pub(crate) async fn hold_wal(&self) -> anyhow::Result<()> {
        self.wal_held.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.wal_in_flight.load(Ordering::SeqCst) > 0 {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the WAL writers did not pause within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    pub(crate) fn release_wal(&self) {
        self.wal_held.store(false, Ordering::SeqCst);
    }

    /// Starts a writer process that opens a transaction of 100 events on
    /// `src`'s outbox (ledger rows included), and SIGKILLs it there;
    /// whether it opened the transaction, and what happened.
    pub(crate) async fn doomed(&self, src: Src) -> anyhow::Result<(bool, String)> {
        // A child of this binary: the doomed writer is the soak's own.
        let mut cmd = lab_command(&self.pg_url)?;
        cmd.args(["soak", "--doomed-writer", src.name()]);
        let mut child = outbox_testkit::Spawned::spawn_notified(cmd)?;
        let opened = child
            .wait_for_notification("SOAK_WRITER=open", Duration::from_secs(30))
            .await
            .is_ok();
        child.kill()?;
        let _ = child.wait(Duration::from_secs(30)).await;
        if opened {
            add(&self.stats.killed_before_commit, DOOMED_EVENTS);
            Ok((
                true,
                format!(
                    "{DOOMED_EVENTS} events inserted, SIGKILLed before COMMIT ({})",
                    src.name()
                ),
            ))
        } else {
            Ok((
                false,
                format!("did not open its transaction within 30 s: {:?}", child.lines()),
            ))
        }
    }
}

/// `outbox-lab soak --doomed-writer <src>`: inserts 100 events and their ledger
/// rows in one transaction, says `SOAK_WRITER=open` and waits to be killed.
pub(crate) async fn doomed_writer(pg: &PgConfig, src: Src) -> anyhow::Result<()> {
    let mut client = connect(pg).await?;
    let outbox = Outbox::new(names::config(src)?);
    let tx = client.transaction().await?;
    let pid = std::process::id();
    let events: Vec<Planned> = (0..DOOMED_EVENTS as i32)
        .map(|i| {
            event(
                names::TYPES[0],
                format!("doomed-{pid}-{}", i % 10),
                i / 10 + 1,
                false,
            )
        })
        .collect();
    write(&tx, &outbox, src, &events, How::Commit)
        .await
        .map_err(|e| anyhow::anyhow!("the doomed writer's events: {e}"))?;
    outbox::notify::send("SOAK_WRITER=open");
    std::future::pending::<()>().await;
    // The transaction stays open until the process dies; it never commits.
    drop(tx);
    Ok(())
}

/// The soak's own tables: the ledger, the consumers' side effects (no
/// unique key, so a duplicate side effect shows), and the filler the slot
/// fault writes WAL with.
pub(crate) const TABLES: &str = "CREATE TABLE outbox_soak.ledger ( \
       event_id uuid PRIMARY KEY, source text NOT NULL, aggregate_id text NOT NULL, \
       seq int4 NOT NULL, poison bool NOT NULL); \
     CREATE TABLE outbox_soak.effects (event_id uuid NOT NULL, stream text NOT NULL, \
       at timestamptz NOT NULL DEFAULT clock_timestamp()); \
     CREATE TABLE outbox_soak.filler (n int8, pad text)";
