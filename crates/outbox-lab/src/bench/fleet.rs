//! The `fleet` phase (issue 33): one `outbox relay --schemas` process
//! serving N tenant outboxes, each figure beside the target and,
//! where the issue names one, a single relay measured in the same run.
//!
//! Setup, once: a scratch database (`outbox_bench_fleet`, dropped at the
//! end, also when a figure failed) on the bench's server with N tenant
//! schemas `bench_t0` … (`--tenants`), each with a migrated outbox, and
//! one more outbox, `bench_single`, for the single relay (the pattern
//! `bench_t%` does not match it). Then, per repetition:
//!
//! 1. **idle**: transactions of the whole server (`pg_stat_database`,
//!    commits and rollbacks, every database) while the fleet idles for
//!    `--fleet-duration`; the single relay on its empty outbox beside it.
//!    As in `idle.rs`, PostgreSQL publishes a backend's counters lazily
//!    but surely when it exits, so each figure is the difference of two
//!    whole lifetimes read once the process's backends are gone: one that
//!    settles (its sessions idle, no autovacuum worker at work) and idles
//!    the window, one that settles and stops. Start-up cancels out, and so
//!    do the bench's own reads but its probes, which are counted and taken
//!    off. The tables are emptied, vacuumed and analysed first, so
//!    autovacuum has nothing to do in them;
//! 2. **latency**: the fleet started and settled, then every tenant gets
//!    one event per second (N per second in all, spread evenly over the
//!    second by four writers, one per transaction) for `--fleet-duration`;
//!    commit (the row's `created_at`) to arrival in the Redis stream, read
//!    by the latency phase's consumer;
//! 3. **throughput**: the fleet started on empty outboxes and settled,
//!    then `--fleet-backlog` events for every tenant committed in one
//!    transaction, timed until the stream holds them all; the single relay
//!    the same way on one outbox, the same total. A fleet has no
//!    `--drain`, so both are timed alike: from the first entry's arrival
//!    to the last's, in Redis's own clock (stream ids). Start-up (the
//!    fleet finding N outboxes) is not throughput, so it comes first;
//! 4. **connections**: the most backends of the fleet process (its
//!    `application_name`) seen in `pg_stat_activity`, sampled every 50 ms
//!    while it works in 2 and 3.
//!
//! What the figures are compared with is `fleet_results.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::{Config, Event, Outbox};
use outbox_relay::pg::PgConfig;
use outbox_testkit::Spawned;
use redis::AsyncCommands;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::fleet_results::{Drain, FleetRun, LatencyCpu};
use super::idle::IdleRun;
use super::latency::{Clock, LatencyRun, consume};
use super::throughput::stream_counts;
use super::{STREAM, STREAM_PREFIX, event};
use crate::ConfigError;
use crate::latency::latencies_ms;
use crate::report::percentile;
use crate::scratch::{LONG, Scratch, connect, outbox_command, with_application_name};

/// The scratch database of the phase.
const DATABASE: &str = "outbox_bench_fleet";
/// The tenant schemas' pattern, as the fleet is given it.
const PATTERN: &str = "bench_t%";
/// The single relay's outbox: a schema `PATTERN` does not match.
const SINGLE: &str = "bench_single";
/// Progress steps per repetition: idle twice, latency, throughput twice.
pub(super) const STEPS: usize = 5;
/// The fleet's batch sessions (`--fleet-sessions`).
pub(super) const SESSIONS: u32 = 4;
/// How each process shows in `pg_stat_activity`.
const FLEET_APP: &str = "outbox-bench-fleet";
const SINGLE_APP: &str = "outbox-bench-single";
/// Connections migrating, filling and writing in parallel.
const WRITERS: usize = 4;
/// How long a fleet of many outboxes may take to find them all and say
/// READY, and a drain or a latency run to arrive.
const START: Duration = Duration::from_secs(300);

/// What the phase measures, after `--quick`.
pub(super) struct FleetPlan {
    pub(super) tenants: usize,
    /// The idle window and the latency run.
    pub(super) window: Duration,
    /// Events per tenant in the throughput runs.
    pub(super) backlog: usize,
}

/// The phase's database, tenants and Redis.
pub(super) struct FleetScratch {
    pg: PgConfig,
    url: String,
    /// The bench's connection to the phase's database, for setup and
    /// counting.
    db: Client,
    tenants: Vec<Config>,
    single: Config,
    redis_url: String,
}

/// Which process a figure is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Process {
    Fleet,
    Single,
}

impl Process {
    fn app(self) -> &'static str {
        match self {
            Process::Fleet => FLEET_APP,
            Process::Single => SINGLE_APP,
        }
    }
}

/// Creates the phase's database and tenants (dropping a leftover of an
/// earlier run first), runs `reps` repetitions, and drops the database,
/// also when a repetition failed.
pub(super) async fn measure(
    scratch: &mut Scratch,
    plan: &FleetPlan,
    reps: usize,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<FleetRun>> {
    drop_database(&scratch.db).await?;
    scratch
        .db
        .batch_execute(&format!("CREATE DATABASE {DATABASE}"))
        .await
        .map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
                anyhow::Error::from(ConfigError(format!(
                    "--phases fleet creates a scratch database {DATABASE}: DATABASE_URL's role needs CREATEDB ({e})"
                )))
            } else {
                anyhow::Error::from(e).context(format!("creating the scratch database {DATABASE}"))
            }
        })?;
    let runs = async {
        let fleet = FleetScratch::new(scratch, plan, progress).await?;
        let mut runs = Vec::with_capacity(reps);
        for rep in 1..=reps {
            runs.push(fleet.run(plan, rep, reps, progress).await?);
        }
        anyhow::Ok(runs)
    }
    .await;
    let dropped = drop_database(&scratch.db).await;
    let runs = runs?;
    dropped?;
    Ok(runs)
}

/// Drops the phase's database, ending what is left connected to it (a
/// process of a failed run, killed on drop a moment ago).
async fn drop_database(db: &Client) -> anyhow::Result<()> {
    db.batch_execute(&format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
        .await
        .with_context(|| format!("dropping the scratch database {DATABASE}"))
}

impl FleetScratch {
    /// Migrates the tenants' outboxes, `WRITERS` connections at a time, and
    /// the single relay's.
    async fn new(
        scratch: &mut Scratch,
        plan: &FleetPlan,
        progress: &indicatif::ProgressBar,
    ) -> anyhow::Result<Self> {
        let mut pg = scratch.pg.clone();
        pg.postgres_mut().dbname(DATABASE);
        let url = scratch.url_of(DATABASE);
        let tenants = (0..plan.tenants)
            .map(|i| Config::new(&format!("bench_t{i}"), "outbox"))
            .collect::<Result<Vec<_>, _>>()?;
        let single = Config::new(SINGLE, "outbox")?;
        progress.set_message(format!("fleet: migrating {} tenant outboxes", plan.tenants));
        let all: Vec<Config> = tenants.iter().cloned().chain([single.clone()]).collect();
        parallel(&pg, &all, |mut client, config| async move {
            client
                .batch_execute(&format!("CREATE SCHEMA {}", config.schema.quoted()))
                .await?;
            outbox::migrate(&mut client, &config)
                .await
                .with_context(|| format!("migrating {}", config.display_name()))?;
            Ok(client)
        })
        .await?;
        Ok(Self {
            db: connect(&pg).await?,
            pg,
            url,
            tenants,
            single,
            redis_url: scratch.redis_url().await?,
        })
    }

    /// One repetition of every figure.
    async fn run(
        &self,
        plan: &FleetPlan,
        rep: usize,
        reps: usize,
        progress: &indicatif::ProgressBar,
    ) -> anyhow::Result<FleetRun> {
        let step = |what: &str| progress.set_message(format!("fleet, {what} rep {rep}/{reps}"));
        step("idle fleet");
        let idle_fleet = self.idle(Process::Fleet, plan.window).await?;
        progress.inc(1);
        step("idle single relay");
        let idle_single = self.idle(Process::Single, plan.window).await?;
        progress.inc(1);
        step("latency");
        let (latency, write_rate, latency_connections, latency_cpu) = self.latency(plan.window).await?;
        progress.inc(1);
        step("throughput fleet");
        let drain_fleet = self.drain(Process::Fleet, plan.backlog).await?;
        progress.inc(1);
        step("throughput single relay");
        let drain_single = self.drain(Process::Single, plan.backlog).await?;
        progress.inc(1);
        Ok(FleetRun {
            connections_max: latency_connections.max(drain_fleet.connections_max),
            idle_fleet,
            idle_single,
            latency,
            write_rate,
            latency_cpu,
            drain_fleet,
            drain_single,
        })
    }

    /// Starts `process`, and returns once it said READY.
    async fn spawn(&self, process: Process) -> anyhow::Result<Spawned> {
        let url = with_application_name(&self.url, process.app());
        let mut cmd = outbox_command(&url)?;
        cmd.args([
            "relay",
            "--sink",
            &self.redis_url,
            "--log-format",
            "json",
            "--stream-prefix",
            STREAM_PREFIX,
        ]);
        let sessions = SESSIONS.to_string();
        match process {
            Process::Fleet => cmd.args(["--schemas", PATTERN, "--fleet-sessions", sessions.as_str()]),
            Process::Single => cmd.args(["--schema", SINGLE]),
        };
        let spawned = Spawned::spawn_notified(cmd)?;
        spawned
            .wait_for_notification("READY=1", START)
            .await
            .with_context(|| format!("starting the {}", label(process)))?;
        Ok(spawned)
    }

    /// SIGTERMs `process` and checks it exited 0.
    async fn stop(&self, mut spawned: Spawned, process: Process) -> anyhow::Result<()> {
        spawned.signal(nix::sys::signal::Signal::SIGTERM)?;
        let status = spawned.wait(LONG).await?;
        if !status.success() {
            bail!(
                "the {} exited with {status}: {:?}",
                label(process),
                spawned.lines()
            );
        }
        Ok(())
    }

    /// Backends of `process` in `pg_stat_activity`, `busy` ones only (not
    /// `idle`) or all.
    async fn backends(&self, process: Process, busy: bool) -> anyhow::Result<i64> {
        let sql = if busy {
            // Idle, and for a while: between two of the fleet's first
            // claims (one per outbox, after READY) a session is idle for
            // a moment, and a look in such a moment let the idle window
            // start while hundreds of first claims were still to come,
            // counting them as idle cost (13 per second instead of 0.4).
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
               AND (state <> 'idle' OR state_change > clock_timestamp() - interval '300 milliseconds')"
        } else {
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
        };
        Ok(self.db.query_one(sql, &[&process.app()]).await?.get(0))
    }

    /// Autovacuum workers of the server at work now.
    async fn autovacuum_workers(&self) -> anyhow::Result<i64> {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'";
        Ok(self.db.query_one(sql, &[]).await?.get(0))
    }

    /// Transactions per second of the whole server while `process` idles
    /// `window` (see the module docs).
    async fn idle(&self, process: Process, window: Duration) -> anyhow::Result<IdleRun> {
        // Vacuumed and analysed by the bench, so autovacuum finds nothing
        // to do in the window: after a throughput run it would visit every
        // tenant's table, a transaction or two each.
        self.fresh(std::slice::from_ref(&self.single)).await?;
        self.fresh(&self.tenants).await?;
        let idled = self.lifetime_transactions(process, window).await?;
        let baseline = self.lifetime_transactions(process, Duration::ZERO).await?;
        let transactions = idled - baseline;
        let seconds = window.as_secs_f64();
        Ok(IdleRun {
            transactions,
            seconds,
            per_second: transactions as f64 / seconds,
        })
    }

    /// Transactions the server committed or rolled back while `process`
    /// started, settled, idled `idle` and exited, less the bench's probes.
    async fn lifetime_transactions(&self, process: Process, idle: Duration) -> anyhow::Result<i64> {
        let before = self.server_transactions().await?;
        let spawned = self.spawn(process).await?;
        let mut probes = self.settle(process).await?;
        tokio::time::sleep(idle).await;
        self.stop(spawned, process).await?;
        // A backend publishes its counters as it exits.
        let deadline = Instant::now() + LONG;
        loop {
            probes += 1;
            if self.backends(process, false).await? == 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the {}'s backends did not exit within {LONG:?}", label(process));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Leaving pg_stat_activity and publishing the counters are two steps
        // of the backend's exit.
        tokio::time::sleep(Duration::from_millis(500)).await;
        // Each probe is two transactions of ours (prepare, execute).
        Ok(self.server_transactions().await? - before - 2 * probes)
    }

    /// Waits until none of `process`'s sessions is busy or was in the last
    /// 300 ms, nor an autovacuum worker is, at three looks in a row, 100 ms
    /// apart: the fleet's first claim of every outbox comes after READY. Returns how many looks it
    /// took.
    async fn settle(&self, process: Process) -> anyhow::Result<i64> {
        let mut probes = 0_i64;
        let mut quiet = 0;
        let deadline = Instant::now() + START;
        while quiet < 3 {
            // Two queries a look.
            probes += 2;
            quiet = if self.backends(process, true).await? == 0 && self.autovacuum_workers().await? == 0 {
                quiet + 1
            } else {
                0
            };
            if Instant::now() > deadline {
                bail!("the {} did not settle within {START:?}", label(process));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(probes)
    }

    /// Commits and rollbacks of every database of the server, with this
    /// backend's own flushed first (see `idle.rs`).
    async fn server_transactions(&self) -> anyhow::Result<i64> {
        let _ = self
            .db
            .batch_execute("SELECT pg_stat_force_next_flush() FROM pg_database LIMIT 1")
            .await;
        let row = self
            .db
            .query_one(
                "SELECT coalesce(sum(xact_commit + xact_rollback), 0)::int8 FROM pg_stat_database",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Every tenant one event per second for `window`, spread evenly, with
    /// the fleet running; latency from `created_at` to arrival. Returns it,
    /// the rate the writers kept, and the most connections the fleet held
    /// meanwhile.
    async fn latency(&self, window: Duration) -> anyhow::Result<(LatencyRun, f64, i64, LatencyCpu)> {
        self.truncate(&self.tenants).await?;
        self.clear_stream().await?;
        let fleet = self.spawn(Process::Fleet).await?;
        // As before a drain: start-up (the first claim of every outbox,
        // each preparing it on its session) is not the steady latency.
        self.settle(Process::Fleet).await?;
        let sampler = Sampler::start(&self.pg, Process::Fleet).await?;
        // CPU per event: what the run cost, less sensitive than its
        // latency to how busy the machine is otherwise.
        let meter = super::cost::Meter::start(&self.db).await?;
        let relay_cpu = super::cost::process_cpu_seconds(fleet.pid());
        let received = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let consumer = tokio::spawn(consume(
            self.consumer_redis().await?,
            Arc::clone(&received),
            stop.clone(),
        ));

        let seconds = window.as_secs_f64().round().max(1.0) as usize;
        let n = self.tenants.len();
        let writers = WRITERS.min(n);
        let mut jobs = Vec::with_capacity(writers);
        for w in 0..writers {
            // Writer w writes to tenants w, w + writers, …, each once a
            // second, its ticks offset so the writers interleave.
            let mine: Vec<Config> = self.tenants.iter().skip(w).step_by(writers).cloned().collect();
            let client = connect(&self.pg).await?;
            let period = Duration::from_secs_f64(1.0 / mine.len() as f64);
            let offset = Duration::from_secs_f64(w as f64 / n as f64);
            jobs.push(tokio::spawn(async move {
                let outboxes: Vec<Outbox> = mine.into_iter().map(Outbox::new).collect();
                let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for second in 0..seconds {
                    for outbox in &outboxes {
                        tick.tick().await;
                        // Autocommit: each event its own transaction.
                        outbox.enqueue(&client, &event(second)).await?;
                    }
                }
                anyhow::Ok(())
            }));
        }
        let writing = Instant::now();
        for job in jobs {
            job.await.context("a writer task")??;
        }
        let write_seconds = writing.elapsed().as_secs_f64();
        let written = (n * seconds) as u64;
        let deadline = Instant::now() + LONG;
        while received.load(Ordering::Relaxed) < written && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.cancel();
        let cost = meter.stop(&self.db).await?;
        let relay_cpu = relay_cpu
            .zip(super::cost::process_cpu_seconds(fleet.pid()))
            .map(|(before, after)| after - before);
        let arrivals = consumer.await.context("the consumer task")??;
        let connections = sampler.stop().await?;
        self.stop(fleet, Process::Fleet).await?;

        let created = self.created_at().await?;
        let arrived = arrivals.len();
        let (latencies, received) = latencies_ms(arrivals.into_iter().map(|a| (a.event_id, a.at)), &created);
        let run = LatencyRun {
            clock: Clock::CreatedAt,
            written,
            received: received as u64,
            duplicates: (arrived - received) as u64,
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        };
        let per_1000 = |seconds: f64| seconds * 1_000_000.0 / written.max(1) as f64;
        let cpu = LatencyCpu {
            postgres_ms_per_1000: cost.cpu_ms_per_1000(written),
            relay_ms_per_1000: relay_cpu.map(per_1000),
        };
        // Writers that fell behind their ticks wrote at a lower rate: the
        // report shows the rate they kept.
        Ok((run, written as f64 / write_seconds, connections, cpu))
    }

    /// `backlog` events in every tenant drained by the fleet, or as many in
    /// all in the single relay's outbox drained by it. The process is
    /// started on empty outboxes and settled first; the backlog is then
    /// committed in one transaction, so each drain starts from a running
    /// process woken by NOTIFY, and the fleet's start-up (finding N
    /// outboxes) is not in its time.
    async fn drain(&self, process: Process, backlog: usize) -> anyhow::Result<Drain> {
        let events = backlog * self.tenants.len();
        let (outboxes, per_outbox) = match process {
            Process::Fleet => (self.tenants.clone(), backlog),
            Process::Single => (vec![self.single.clone()], events),
        };
        self.fresh(&outboxes).await?;
        self.clear_stream().await?;
        let spawned = self.spawn(process).await?;
        self.settle(process).await?;
        let sampler = Sampler::start(&self.pg, process).await?;

        let mut client = connect(&self.pg).await?;
        let tx = client.transaction().await?;
        for config in &outboxes {
            let outbox = Outbox::new(config.clone());
            let all: Vec<Event> = (0..per_outbox).map(event).collect();
            for chunk in all.chunks(1000) {
                outbox.enqueue_all(&tx, chunk).await?;
            }
        }
        tx.commit().await?;

        let mut redis = self.redis().await?;
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut peak_rss = None;
        loop {
            peak_rss = spawned.peak_rss().or(peak_rss);
            let len: u64 = redis.xlen(STREAM).await?;
            if len >= events as u64 {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "the {} delivered {len} of {events} events in 10 minutes",
                    label(process)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let connections_max = sampler.stop().await?;
        // Every batch marked before the stop, so the count is the drain's.
        let deadline = Instant::now() + LONG;
        while self.published(&outboxes).await? < events as i64 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.stop(spawned, process).await?;
        let seconds = arrival_span(&mut redis).await?;
        let (entries, delivered) = stream_counts(&mut redis).await?;
        Ok(Drain {
            events: events as u64,
            seconds,
            per_second: events as f64 / seconds,
            delivered,
            duplicates: entries - delivered,
            marked: self.published(&outboxes).await? as u64,
            peak_rss,
            connections_max,
        })
    }

    /// Empties `configs`' tables.
    async fn truncate(&self, configs: &[Config]) -> anyhow::Result<()> {
        for chunk in configs.chunks(200) {
            let tables: Vec<String> = chunk.iter().map(Config::qualified).collect();
            self.db
                .batch_execute(&format!("TRUNCATE {}", tables.join(", ")))
                .await?;
        }
        Ok(())
    }

    /// Empties `configs`' tables and vacuums and analyses them, as the
    /// throughput phase does its one (`Scratch::clear`).
    async fn fresh(&self, configs: &[Config]) -> anyhow::Result<()> {
        self.truncate(configs).await?;
        for config in configs {
            // One each: VACUUM cannot run in a multi-statement string.
            self.db
                .batch_execute(&format!("VACUUM ANALYZE {}", config.qualified()))
                .await?;
        }
        Ok(())
    }

    /// Published rows over `configs`.
    async fn published(&self, configs: &[Config]) -> anyhow::Result<i64> {
        let mut total = 0;
        for chunk in configs.chunks(200) {
            let counts: Vec<String> = chunk
                .iter()
                .map(|c| {
                    format!(
                        "SELECT count(*) AS n FROM {} WHERE published_at IS NOT NULL",
                        c.qualified()
                    )
                })
                .collect();
            let sql = format!(
                "SELECT coalesce(sum(n), 0)::int8 FROM ({}) AS u",
                counts.join(" UNION ALL ")
            );
            total += self.db.query_one(&sql, &[]).await?.get::<_, i64>(0);
        }
        Ok(total)
    }

    /// Every tenant row's `created_at` in epoch seconds, by event id (the
    /// tenants' ids are separate sequences).
    async fn created_at(&self) -> anyhow::Result<HashMap<String, f64>> {
        let mut created = HashMap::new();
        for chunk in self.tenants.chunks(200) {
            let selects: Vec<String> = chunk
                .iter()
                .map(|c| {
                    format!(
                        "SELECT event_id::text, extract(epoch FROM created_at)::float8 FROM {}",
                        c.qualified()
                    )
                })
                .collect();
            let rows = self.db.query(&selects.join(" UNION ALL "), &[]).await?;
            created.extend(rows.iter().map(|r| (r.get(0), r.get(1))));
        }
        Ok(created)
    }

    async fn redis(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.redis_url.as_str())?
            .get_multiplexed_async_connection()
            .await
            .context("connecting to Redis")
    }

    /// A connection for the consumer: at N events per second on 2 cores an
    /// `XREAD` reply can outlast the client's default response timeout,
    /// which would fail the run rather than slow it.
    async fn consumer_redis(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(10)))
            .set_response_timeout(Some(Duration::from_secs(10)));
        redis::Client::open(self.redis_url.as_str())?
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .context("connecting to Redis")
    }

    async fn clear_stream(&self) -> anyhow::Result<()> {
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }
}

fn label(process: Process) -> &'static str {
    match process {
        Process::Fleet => "fleet (`outbox relay --schemas`)",
        Process::Single => "single relay",
    }
}

/// Runs `job` for each of `configs` on `WRITERS` connections in parallel,
/// each taking a contiguous share.
async fn parallel<F, Fut>(pg: &PgConfig, configs: &[Config], job: F) -> anyhow::Result<()>
where
    F: Fn(Client, Config) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Client>> + Send,
{
    let share = configs.len().div_ceil(WRITERS).max(1);
    let mut tasks = Vec::new();
    for chunk in configs.chunks(share) {
        let chunk = chunk.to_vec();
        let mut client = connect(pg).await?;
        let job = job.clone();
        tasks.push(tokio::spawn(async move {
            for config in chunk {
                client = job(client, config).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await.context("a setup task")??;
    }
    Ok(())
}

/// Seconds from the first entry of the bench's stream to the last, by the
/// milliseconds of their ids (Redis's clock, when it took each); at least
/// one millisecond.
async fn arrival_span(redis: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<f64> {
    let first: redis::streams::StreamRangeReply = redis.xrange_count(STREAM, "-", "+", 1).await?;
    let last: redis::streams::StreamRangeReply = redis.xrevrange_count(STREAM, "+", "-", 1).await?;
    let ms = |reply: &redis::streams::StreamRangeReply| {
        reply
            .ids
            .first()
            .and_then(|e| e.id.split_once('-'))
            .and_then(|(ms, _)| ms.parse::<u64>().ok())
            .context("the bench stream is empty")
    };
    let span = ms(&last)?.saturating_sub(ms(&first)?).max(1);
    Ok(span as f64 / 1000.0)
}

/// Samples a process's backends every 50 ms on a connection of its own,
/// keeping the most seen.
struct Sampler {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<i64>>,
}

impl Sampler {
    async fn start(pg: &PgConfig, process: Process) -> anyhow::Result<Self> {
        let client = connect(pg).await?;
        let stop = CancellationToken::new();
        let cancel = stop.clone();
        let task = tokio::spawn(async move {
            let mut most = 0_i64;
            let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
            loop {
                let n: i64 = client.query_one(sql, &[&process.app()]).await?.get(0);
                most = most.max(n);
                // Cancel-safe: a sleep and a token.
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    () = cancel.cancelled() => break,
                }
            }
            anyhow::Ok(most)
        });
        Ok(Self { stop, task })
    }

    async fn stop(self) -> anyhow::Result<i64> {
        self.stop.cancel();
        self.task.await.context("the connection sampler")?
    }
}
