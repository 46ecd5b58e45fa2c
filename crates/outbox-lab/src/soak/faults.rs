//! Injecting the schedule's faults: the relay kills on their own clock, and
//! the rarer faults one after another (the writer-side ones beside them),
//! each written to the fault log with when it struck, for how long, and
//! which source's deliveries it can make repeat.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use outbox_relay::pg::PgConfig;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::fleet::{Fleet, LEASE_TIMEOUT};
use super::names::{self, SCHEMA};
use super::schedule::{Fault, KillKind, PgStop, Planned, PlannedKill, Rng, Src};
use super::writers::Writers;
use super::{names::CONFIRMED, unix_ms};
use crate::scratch::{connect, outbox_command};

/// A fault this run cannot inject (a server it was given, a right it
/// lacks): listed as skipped, not as failed.
#[derive(Debug, thiserror::Error)]
#[error("skipped: {0}")]
struct Skipped(String);

/// What a fault can make the relays re-send, for the bound of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Hits {
    /// One relay's in-flight batches (a kill, a split brain).
    OneRelay,
    /// Every relay's at once (PostgreSQL, the sink, the slot).
    AllRelays,
}

/// One injected fault.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Record {
    /// Seconds into the run.
    pub(crate) at_s: f64,
    /// Unix milliseconds, to line up with the streams' entry ids.
    #[serde(skip)]
    pub(crate) at_ms: i64,
    pub(crate) kind: &'static str,
    pub(crate) target: String,
    pub(crate) detail: String,
    pub(crate) seconds: f64,
    /// The sources whose deliveries this fault can make repeat.
    pub(crate) scope: Vec<Src>,
    pub(crate) hits: Hits,
    /// Whether it did what it is for (a failpoint reached, a slot lost).
    pub(crate) took: bool,
}

/// What the faults share.
pub(crate) struct Chaos {
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) writers: Arc<Writers>,
    /// The run's own servers; `None` when given by URL (their faults are
    /// then skipped, and said so).
    pub(crate) pg: tokio::sync::Mutex<Option<outbox_testkit::Postgres>>,
    /// Whether PostgreSQL is the run's own: only then may a fault reach
    /// past the soak's database (`ALTER SYSTEM`, a restart).
    own_pg: bool,
    pub(crate) redis: tokio::sync::Mutex<Option<outbox_testkit::Redis>>,
    pub(crate) pg_config: PgConfig,
    pub(crate) pg_url: String,
    pub(crate) started: Instant,
    pub(crate) sources: Vec<Src>,
    /// Servers down right now: a kill then skips the failpoint, which
    /// nothing would reach.
    down: AtomicU32,
    columns: AtomicUsize,
    log: std::sync::Mutex<Vec<Record>>,
    skipped: std::sync::Mutex<Vec<String>>,
}

/// Waits until the slot confirmed `lsn` (its relays delivered everything
/// written before it), for at most 120 s.
async fn confirmed(db: &tokio_postgres::Client, slot: &str, lsn: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let caught_up: bool = db.query_one(CONFIRMED, &[&slot, &lsn]).await?.get(0);
        if caught_up {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the WAL relays did not confirm {lsn} within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A PostgreSQL error's own message (the driver's Display says only "db
/// error").
fn pg_message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned())
}

impl Chaos {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        fleet: Arc<Fleet>,
        writers: Arc<Writers>,
        pg: Option<outbox_testkit::Postgres>,
        redis: Option<outbox_testkit::Redis>,
        pg_config: PgConfig,
        pg_url: String,
        started: Instant,
        sources: Vec<Src>,
    ) -> Self {
        Self {
            fleet,
            writers,
            own_pg: pg.is_some(),
            pg: tokio::sync::Mutex::new(pg),
            redis: tokio::sync::Mutex::new(redis),
            pg_config,
            pg_url,
            started,
            sources,
            down: AtomicU32::new(0),
            columns: AtomicUsize::new(0),
            log: std::sync::Mutex::new(Vec::new()),
            skipped: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn records(&self) -> Vec<Record> {
        let mut r = self
            .log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        r.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        r
    }

    pub(crate) fn skipped(&self) -> Vec<String> {
        self.skipped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn record(
        &self,
        begun: (f64, i64, Instant),
        kind: &'static str,
        target: String,
        detail: String,
        (scope, hits): (Vec<Src>, Hits),
        took: bool,
    ) {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Record {
                at_s: begun.0,
                at_ms: begun.1,
                kind,
                target,
                detail,
                seconds: begun.2.elapsed().as_secs_f64(),
                scope,
                hits,
                took,
            });
    }

    fn begin(&self) -> (f64, i64, Instant) {
        (self.started.elapsed().as_secs_f64(), unix_ms(), Instant::now())
    }

    fn skip(&self, what: String) {
        let mut s = self
            .skipped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !s.contains(&what) {
            s.push(what);
        }
    }

    /// Sleeps until `at` into the run; false if stopped first.
    async fn until(&self, at: Duration, stop: &CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep_until((self.started + at).into()) => true,
            () = stop.cancelled() => false,
        }
    }

    /// The relay kills, on their own clock, restarting any child that
    /// exited by itself along the way.
    pub(crate) async fn kills(self: Arc<Self>, kills: Vec<PlannedKill>, stop: CancellationToken) {
        for kill in kills {
            if !self.until(kill.at, &stop).await {
                break;
            }
            if let Err(e) = self.fleet.supervise().await {
                tracing::warn!(error = %format!("{e:#}"), "soak: restarting a child");
            }
            let relays = self.fleet.relays(None);
            let first = (kill.relay % relays.len() as u64) as usize;
            // The planned relay, or the next one no other fault holds.
            let mut held = None;
            for k in 0..relays.len() {
                let i = relays[(first + k) % relays.len()];
                if let Ok(guard) = self.fleet.procs[i].try_lock() {
                    held = Some(guard);
                    break;
                }
            }
            let Some(mut p) = held else { continue };
            let begun = self.begin();
            let after_ack = kill.kind == KillKind::AfterAck && self.down.load(Ordering::Relaxed) == 0;
            let scope = match p.role {
                super::fleet::Role::Relay(src) => vec![src],
                super::fleet::Role::Consumer { .. } => Vec::new(),
            };
            let outcome = if after_ack {
                self.fleet.kill_after_ack(&mut p).await
            } else {
                self.fleet.kill(&mut p).await.map(|()| true)
            };
            let restarted = if p.child.is_none() {
                self.fleet.start(&mut p, None).await
            } else {
                Ok(())
            };
            let (took, detail) = match (outcome, restarted) {
                (Ok(true), Ok(())) if after_ack => {
                    (true, "parked after the sink's ack, before the mark".to_owned())
                }
                (Ok(false), Ok(())) => (
                    false,
                    "failpoint not reached within 20 s; killed anyway".to_owned(),
                ),
                (Ok(_), Ok(())) => (true, String::new()),
                (Err(e), _) | (_, Err(e)) => (false, format!("restart failed: {e:#}")),
            };
            let kind = if after_ack {
                "relay SIGKILL after the sink's ack"
            } else {
                "relay SIGKILL"
            };
            let name = p.name.clone();
            drop(p);
            self.record(begun, kind, name, detail, (scope, Hits::OneRelay), took);
        }
    }

    /// The rare faults, in turn (the writer-side ones in tasks of their
    /// own); returns once all ran.
    pub(crate) async fn faults(
        self: Arc<Self>,
        planned: Vec<Planned>,
        mut rng: Rng,
        stop: CancellationToken,
    ) {
        let mut beside = tokio::task::JoinSet::new();
        for (n, p) in planned.into_iter().enumerate() {
            if !self.until(p.at, &stop).await {
                break;
            }
            let mut rng = rng.fork();
            if p.fault.concurrent() {
                let me = self.clone();
                beside.spawn(async move { me.inject(p.fault, n, &mut rng).await });
            } else {
                self.inject(p.fault, n, &mut rng).await;
            }
        }
        while beside.join_next().await.is_some() {}
    }

    async fn inject(&self, fault: Fault, n: usize, rng: &mut Rng) {
        let begun = self.begin();
        let all = self.sources.clone();
        let (target, scope, result) = match fault {
            Fault::PgRestart { stop } => ("PostgreSQL".to_owned(), all, self.pg_restart(stop, rng).await),
            Fault::TerminateBackends => ("relay connections".to_owned(), all, self.terminate().await),
            Fault::SinkOutage { seconds } => ("redis-server".to_owned(), all, self.outage(seconds).await),
            Fault::SplitBrain => {
                let (name, r) = self.split_brain(rng).await;
                (name, vec![Src::Poll], r)
            }
            // No relay should re-send for a new column: any duplicate it
            // caused would show as unexplained.
            Fault::AddColumn => ("both outboxes".to_owned(), Vec::new(), self.add_column().await),
            Fault::SlotInvalidation => (
                "the WAL source's slot".to_owned(),
                vec![Src::Wal],
                self.slot().await,
            ),
            Fault::BigTransaction { src, events } => (
                format!("{} writer", src.name()),
                Vec::new(),
                self.writers
                    .big_transaction(src, events, n)
                    .await
                    .map(|d| (true, d)),
            ),
            Fault::WriterKilledBeforeCommit { src } => (
                format!("{} writer", src.name()),
                Vec::new(),
                self.writers.doomed(src).await,
            ),
            Fault::ConsumerDead { seconds } => {
                let (name, r) = self.consumer_dead(seconds).await;
                (name, Vec::new(), r)
            }
        };
        // A split brain freezes one relay; the others reach them all.
        let hits = if fault == Fault::SplitBrain {
            Hits::OneRelay
        } else {
            Hits::AllRelays
        };
        match result {
            Ok((took, detail)) => self.record(begun, fault.label(), target, detail, (scope, hits), took),
            Err(e) => {
                let detail = format!("{e:#}");
                if e.is::<Skipped>() {
                    self.skip(format!("{}: {detail}", fault.label()));
                } else {
                    tracing::warn!(fault = fault.label(), error = %detail, "soak: a fault failed");
                    self.record(
                        begun,
                        fault.label(),
                        target,
                        format!("failed: {detail}"),
                        (scope, hits),
                        false,
                    );
                }
            }
        }
    }

    async fn pg_restart(&self, stop: PgStop, rng: &mut Rng) -> anyhow::Result<(bool, String)> {
        let mut pg = self.pg.lock().await;
        let Some(cluster) = pg.as_mut() else {
            bail!(Skipped("PostgreSQL was given by URL".to_owned()));
        };
        self.down.fetch_add(1, Ordering::Relaxed);
        let stopped = match stop {
            PgStop::Fast => cluster.stop().await,
            PgStop::Immediate => cluster.stop_immediate().await,
            PgStop::Crash => cluster.kill(),
        };
        let pause = Duration::from_secs_f64(rng.between(0.5, 3.0));
        tokio::time::sleep(pause).await;
        let restarted = cluster.restart().await;
        self.down.fetch_sub(1, Ordering::Relaxed);
        drop(pg);
        stopped.context("stopping PostgreSQL")?;
        restarted.context("starting PostgreSQL again")?;
        let back = self.relays_back().await?;
        Ok((
            true,
            format!("down {:.1} s; relays back {back}", pause.as_secs_f64()),
        ))
    }

    /// Waits (30 s at most) until every polling relay running has beaten
    /// its heartbeat again and a WAL relay streams the slot: a fault on
    /// their connections lasts until then, for a relay finds out only when
    /// it next uses one (a lease lapsing mid-delivery re-sends that batch).
    async fn relays_back(&self) -> anyhow::Result<String> {
        let db = connect(&self.pg_config).await?;
        let since: std::time::SystemTime = db.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
        let began = Instant::now();
        let polling = self.fleet.relays(Some(Src::Poll)).len() as i64;
        let relays = names::config(Src::Poll)?.companion("_relays")?;
        let beating = format!("SELECT count(*) FROM {relays} WHERE heartbeat_at > $1");
        let slot = names::config(Src::Wal)?.wal_slot()?;
        while began.elapsed() < Duration::from_secs(30) {
            let mut back = true;
            if self.sources.contains(&Src::Poll) {
                let n: i64 = db.query_one(&beating, &[&since]).await?.get(0);
                back &= n >= polling;
            }
            if self.sources.contains(&Src::Wal) {
                back &= db
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
                        &[&slot],
                    )
                    .await?
                    .is_some();
            }
            if back {
                return Ok(format!("after {:.1} s", began.elapsed().as_secs_f64()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok("not within 30 s".to_owned())
    }

    /// Terminates the relays' backends: only the soak's own (its
    /// database, its relays' `application_name`s), whoever else shares the
    /// server.
    async fn terminate(&self) -> anyhow::Result<(bool, String)> {
        let db = connect(&self.pg_config).await?;
        let relays = self.fleet.relay_application_names();
        let n: i64 = db
            .query_one(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                  WHERE datname = current_database() AND application_name = ANY($1) \
                    AND pid <> pg_backend_pid()",
                &[&relays],
            )
            .await?
            .get(0);
        let back = self.relays_back().await?;
        Ok((n > 0, format!("{n} backends terminated; relays back {back}")))
    }

    async fn outage(&self, seconds: f64) -> anyhow::Result<(bool, String)> {
        let mut redis = self.redis.lock().await;
        let Some(server) = redis.as_mut() else {
            bail!(Skipped("the sink was given by URL".to_owned()));
        };
        self.down.fetch_add(1, Ordering::Relaxed);
        let stopped = server.stop().await;
        tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
        let restarted = server.restart().await;
        self.down.fetch_sub(1, Ordering::Relaxed);
        stopped.context("stopping redis-server")?;
        restarted.context("starting redis-server again")?;
        Ok((true, format!("{seconds:.0} s without a sink")))
    }

    async fn split_brain(&self, rng: &mut Rng) -> (String, anyhow::Result<(bool, String)>) {
        let relays = self.fleet.relays(Some(Src::Poll));
        let i = relays[rng.below(relays.len() as u64) as usize];
        let mut p = self.fleet.procs[i].lock().await;
        let name = p.name.clone();
        // Past the lease, and past the time the others take to see it.
        let frozen = LEASE_TIMEOUT * 2 + Duration::from_secs(1);
        let result = async {
            self.fleet.restart_if_exited(&mut p).await?;
            self.fleet.signal(&p, Signal::SIGSTOP)?;
            tokio::time::sleep(frozen).await;
            self.fleet.signal(&p, Signal::SIGCONT)?;
            Ok((
                true,
                format!(
                    "frozen {:.0} s (lease {} s)",
                    frozen.as_secs_f64(),
                    LEASE_TIMEOUT.as_secs()
                ),
            ))
        }
        .await;
        (name, result)
    }

    async fn add_column(&self) -> anyhow::Result<(bool, String)> {
        let n = self.columns.fetch_add(1, Ordering::Relaxed);
        let db = connect(&self.pg_config).await?;
        let mut done = Vec::new();
        for &src in &self.sources {
            // A column with a default, so every decoded row changes shape.
            let sql = format!(
                "ALTER TABLE {SCHEMA}.{} ADD COLUMN soak_extra_{n} int4 DEFAULT {n}",
                names::table(src)
            );
            db.batch_execute(&sql).await.with_context(|| sql.clone())?;
            done.push(format!("{}.soak_extra_{n}", names::table(src)));
        }
        Ok((true, format!("added {}", done.join(", "))))
    }

    async fn consumer_dead(&self, seconds: f64) -> (String, anyhow::Result<(bool, String)>) {
        let i = self.fleet.consumers()[0];
        let mut p = self.fleet.procs[i].lock().await;
        let name = p.name.clone();
        let result = async {
            self.fleet.kill(&mut p).await?;
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
            self.fleet.start(&mut p, None).await?;
            Ok((true, format!("SIGKILLed, restarted {seconds:.0} s later")))
        }
        .await;
        (name, result)
    }

    /// Stops the WAL relays, makes PostgreSQL invalidate their slot (a
    /// small `max_slot_wal_keep_size`, WAL written past it, a checkpoint),
    /// runs the documented `outbox migrate --wal --recover` and starts them
    /// again. The WAL writers hold their `emit` meanwhile: an emitted event
    /// in lost WAL has no row to recover from (docs/wal.md says so). Only
    /// on the run's own PostgreSQL: `ALTER SYSTEM` and the checkpoints
    /// reach every slot of the server.
    async fn slot(&self) -> anyhow::Result<(bool, String)> {
        if !self.own_pg {
            bail!(Skipped(
                "PostgreSQL was given by URL, and ALTER SYSTEM SET max_slot_wal_keep_size would reach \
                 every slot on it"
                    .to_owned()
            ));
        }
        let db = connect(&self.pg_config).await?;
        let slot = names::config(Src::Wal)?.wal_slot()?;
        self.writers.emit_paused.store(true, Ordering::Relaxed);
        let result = async {
            // Every event emitted so far delivered before the slot goes.
            let lsn: String = db.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
            confirmed(&db, &slot, &lsn).await?;
            // One statement per call: ALTER SYSTEM refuses a transaction
            // block, which a multi-statement query is. Tried before the
            // relays stop, so a role without the right skips the fault
            // having stopped nothing.
            db.batch_execute("ALTER SYSTEM SET max_slot_wal_keep_size = '32MB'")
                .await
                .map_err(|e| Skipped(format!("cannot ALTER SYSTEM ({})", pg_message(&e))))?;
            db.batch_execute("SELECT pg_reload_conf()").await?;
            let mut held = Vec::new();
            let invalidated = async {
                for i in self.fleet.relays(Some(Src::Wal)) {
                    let mut p = self.fleet.procs[i].lock().await;
                    self.fleet.kill(&mut p).await?;
                    held.push(p);
                }
                let mut written_mb = 0;
                for _ in 0..40 {
                    db.batch_execute(&format!(
                        "INSERT INTO {SCHEMA}.filler SELECT g, repeat('x', 1000) FROM generate_series(1, 16000) g; \
                         TRUNCATE {SCHEMA}.filler; SELECT pg_switch_wal(); CHECKPOINT"
                    ))
                    .await?;
                    written_mb += 16;
                    let status: Option<String> = db
                        .query_opt("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
                        .await?
                        .and_then(|r| r.get(0));
                    if status.as_deref() == Some("lost") {
                        return Ok::<_, anyhow::Error>((true, written_mb));
                    }
                }
                Ok((false, written_mb))
            }
            .await;
            // Reset whatever happened: the setting outlives the soak.
            db.batch_execute("ALTER SYSTEM RESET max_slot_wal_keep_size").await?;
            db.batch_execute("SELECT pg_reload_conf()").await?;
            let (lost, written_mb) = invalidated?;
            if !lost {
                bail!("the slot was not invalidated after {written_mb} MB of WAL");
            }
            // The recovery keeps order only for aggregates nobody writes
            // while it runs (docs/wal.md): hold the writers off, as the
            // docs tell an operator who needs order.
            self.writers.hold_wal().await?;
            let out = outbox_command(&self.pg_url)?
                .args(["migrate", "--wal", "--recover", "--schema", SCHEMA])
                .args(["--table", names::table(Src::Wal), "--channel", names::channel(Src::Wal)])
                .output()
                .await
                .context("running outbox migrate --wal --recover");
            self.writers.release_wal();
            let out = out?;
            if !out.status.success() {
                bail!(
                    "outbox migrate --wal --recover exited with {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            for p in &mut held {
                self.fleet.start(p, None).await?;
            }
            drop(held);
            // The fault lasts until the relays delivered what the recovery
            // re-inserted: its re-sends are the fault's.
            let recovered: String = db.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
            confirmed(&db, &slot, &recovered).await?;
            let said = String::from_utf8_lossy(&out.stdout);
            Ok((
                true,
                format!(
                    "lost after ~{written_mb} MB of WAL; recover: {}",
                    said.lines()
                        .find(|l| l.contains("re-inserted"))
                        .unwrap_or_default()
                        .trim()
                ),
            ))
        }
        .await;
        self.writers.emit_paused.store(false, Ordering::Relaxed);
        result
    }
}
