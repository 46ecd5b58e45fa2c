//! A relay fleet: one process serving many outboxes (tenant schemas of a
//! database, in one database or in every database of a server that
//! matches a pattern), with connections per database, not per outbox.
//!
//! Per database ([`hub`]): one listening session (the insert trigger names
//! its outbox, migration 0009); one control session, which finds the
//! tenant outboxes every `discover_interval`, holds the advisory locks of
//! the outboxes this process serves (`outbox::sql::fleet`), and once per
//! poll asks which of them have rows due (their backlogs, in one
//! statement); and a [`pool`] of batch sessions the outboxes borrow a
//! batch at a time, first come first served. So a process holds
//! `2 + sessions` connections per database whatever the
//! number of outboxes, and an idle fleet costs a few statements per
//! `discover_interval` and poll, not per outbox.
//!
//! Each served outbox runs the relay's own cycle ([`Relay`]'s delivery,
//! plans, retries, dead letters, metrics labelled with the outbox) over a
//! `TenantSource`, which claims by lock on a borrowed session. Several fleet
//! processes with the same settings share the outboxes: each takes at most
//! its share (outboxes over processes, rounded up), and a dead process's
//! outboxes are taken over at the next discovery (see `outbox::sql::fleet`
//! for why two processes never deliver one outbox at once).
//!
//! A busy outbox can be served *split* instead ([`FleetConfig::split`],
//! [`Listed::split`]): every fleet process serves it at once, each with a
//! relay of its own for it (its own batch sessions and partition leases,
//! as several `outbox relay`s of one outbox share it), so its partitions
//! spread over the processes and a dead one's move within the lease
//! timeout. Its own lock is held *shared* by each of them: a process
//! configured to serve it whole cannot take it meanwhile, and one that
//! takes it whole later also waits until no relay of it beats
//! (`outbox::sql::fleet::without_live_relays`), so the two kinds never
//! deliver one outbox at once.
//!
//! With `--source wal` ([`wal`]) each database is one WAL stream instead:
//! one slot and one publication for every tenant outbox of it.
//!
//! Not (yet) in a fleet: deadline claims, strict order, retention and
//! `--drain`; with `--source wal`, outboxes listed by name and
//! `--wal-cleanup none` (refused by [`Fleet::new`]).

mod hub;
mod pool;
mod wal;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, RwLock, RwLockReadGuard};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub(crate) use self::hub::servable;
pub(crate) use self::pool::{Lent, Pool};
use crate::config::{ClaimMode, OrderMode, Pooler, RelayConfig, SourceKind, WalCleanup};
use crate::context::Signals;
use crate::error::RelayError;
use crate::health::Health;
use crate::pg::PgConfig;
use crate::sink::Sink;

/// An outbox a fleet serves by name (`[outboxes.NAME]` in the
/// configuration file), with settings and a sink of its own.
#[derive(Clone)]
pub struct Listed {
    /// Its name: its `outbox` label in metrics and logs.
    pub name: String,
    /// Its database (the fleet serves it through that database's control
    /// session and pool).
    pub pg: PgConfig,
    /// What it is served with; its `outbox` names the table.
    pub relay: RelayConfig,
    /// Where its events go.
    pub sink: Arc<dyn Sink>,
    /// Served split (see [`FleetConfig::split`]).
    pub split: bool,
}

impl std::fmt::Debug for Listed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listed")
            .field("name", &self.name)
            .field("outbox", &self.relay.outbox.display_name())
            .field("sink", &self.sink.describe())
            .field("split", &self.split)
            .finish_non_exhaustive()
    }
}

/// What a fleet serves and how.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// A `LIKE` pattern: the schemas whose outbox (named
    /// `relay.outbox.table`, migrated) the fleet serves; None to serve
    /// only the listed ones.
    pub schemas: Option<String>,
    /// Outboxes served by name, each with its own settings.
    pub listed: Vec<Listed>,
    /// A `LIKE` pattern: the databases of the server it serves; None for
    /// the URL's database only.
    pub databases: Option<String>,
    /// Batch sessions per database, shared by its outboxes.
    pub sessions: usize,
    /// Claims kept prepared per batch session (see [`pool`]); 0 plans
    /// every claim on each run.
    pub prepared_claims: usize,
    /// How often each database is searched for outboxes, and the lease of
    /// outboxes between fleet processes balanced.
    pub discover_interval: Duration,
    /// The settings every outbox is served with; its `outbox` names the
    /// table and channel, not a schema.
    pub relay: RelayConfig,
    /// Serve the outboxes the pattern finds split: every fleet process
    /// serves each at once, by the partition leases several relays of one
    /// outbox share, instead of one process taking it whole. For a busy
    /// outbox, set on its listed table ([`Listed::split`]): each split one
    /// costs every process a relay's own connections.
    pub split: bool,
}

/// Batch sessions per database by default.
pub const DEFAULT_SESSIONS: usize = 4;
/// Claims kept prepared per batch session by default: every outbox's, up to
/// about 4,000 outboxes per database with the default sessions (each
/// allocates about 200 kB of the backend's memory contexts, some 35 kB of
/// it resident, measured over 1,000 tenants).
pub const DEFAULT_PREPARED_CLAIMS: usize = 1024;
/// How often outboxes are discovered by default.
pub const DEFAULT_DISCOVER_INTERVAL: Duration = Duration::from_secs(5);

impl FleetConfig {
    /// What a fleet cannot do yet, as the flag that asked for it.
    fn refused(&self) -> Option<&'static str> {
        if self.relay.source == SourceKind::Wal {
            return if !self.listed.is_empty() {
                Some("outboxes listed by name ([outboxes.NAME]) with --source wal")
            } else if self.schemas.is_none() {
                Some("--source wal without --schemas")
            } else if self.relay.wal.cleanup == WalCleanup::None {
                Some("--wal-cleanup none (its tables cannot tell undelivered rows from delivered ones)")
            } else if self.relay.drain {
                Some("--drain")
            } else if self.split {
                Some("--fleet-split (log tailing reads each database once, for every outbox)")
            } else {
                None
            };
        }
        std::iter::once(&self.relay)
            .chain(self.listed.iter().map(|l| &l.relay))
            .find_map(Self::refused_of)
    }

    fn refused_of(r: &RelayConfig) -> Option<&'static str> {
        if r.source != SourceKind::Poll {
            Some("--source wal for an outbox listed by name")
        } else if r.claim != ClaimMode::Lock {
            Some("--claim deadline")
        } else if r.ordering == OrderMode::Strict
            || r.ordering_for.iter().any(|(_, m)| *m == OrderMode::Strict)
        {
            Some("strict order")
        } else if r.pooler != Pooler::None {
            Some("--pooler transaction (a fleet holds session advisory locks)")
        } else if r.drain {
            Some("--drain")
        } else {
            None
        }
    }
}

/// One outbox a fleet finds (see [`survey`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Surveyed {
    /// `schema.table`, or `database/schema.table` across databases.
    pub outbox: String,
    /// Why the fleet would not serve it, None if it would.
    pub problem: Option<String>,
}

/// The outboxes a fleet of `config` over `pg` would serve now, and those it
/// would skip with why: what `outbox config show` lists. Connects once per
/// database; changes nothing.
pub async fn survey(pg: &PgConfig, config: &FleetConfig) -> Result<Vec<Surveyed>, tokio_postgres::Error> {
    let server = crate::pg::connect_once(pg).await?;
    let databases = match &config.databases {
        None => vec![None],
        Some(pattern) => outbox::sql::fleet::matching_databases(&server, pattern)
            .await?
            .into_iter()
            .map(Some)
            .collect(),
    };
    let mut found = Vec::new();
    for database in databases {
        let other = match &database {
            None => None,
            Some(name) => {
                let mut pg = pg.clone();
                pg.postgres_mut().dbname(name);
                Some(crate::pg::connect_once(&pg).await?)
            }
        };
        let client = other.as_ref().unwrap_or(&server);
        let table = &config.relay.outbox.table;
        let Some(pattern) = &config.schemas else {
            break;
        };
        for tenant in outbox::sql::fleet::tenant_outboxes(client, pattern, table).await? {
            let mut outbox = config.relay.outbox.clone();
            outbox.schema = tenant.schema;
            let label = label(database.as_deref(), &outbox);
            found.push(Surveyed {
                outbox: label,
                problem: hub::servable(client, &outbox, config.split)
                    .await
                    .err()
                    .map(|why| format!("{}: {}", why.reason, why.error)),
            });
        }
    }
    for listed in &config.listed {
        let client = crate::pg::connect_once(&listed.pg).await?;
        found.push(Surveyed {
            outbox: format!("{} ({})", listed.name, listed.relay.outbox.display_name()),
            problem: hub::servable(&client, &listed.relay.outbox, listed.split)
                .await
                .err()
                .map(|why| format!("{}: {}", why.reason, why.error)),
        });
    }
    Ok(found)
}

/// One outbox of a fleet, as its hub and its source share it.
#[derive(Debug)]
pub(crate) struct Tenant {
    /// Its key in the fleet's advisory locks.
    pub(crate) key: i32,
    wake: Notify,
    served: AtomicBool,
    /// Read by a batch from its look at `served` to its fence; written by
    /// the hub before it lets go of the own lock (see
    /// `outbox::sql::fleet`'s module docs).
    gate: RwLock<()>,
}

impl Tenant {
    fn new(key: i32) -> Self {
        Self {
            key,
            wake: Notify::new(),
            served: AtomicBool::new(false),
            gate: RwLock::new(()),
        }
    }

    /// Something may be due: the next claim goes ahead.
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Until [`Tenant::wake`] (at once if it was called since the last).
    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Whether this process serves the outbox now.
    pub(crate) fn served(&self) -> bool {
        self.served.load(Ordering::Acquire)
    }

    /// A batch's look at whether the outbox is served: Some while it is,
    /// to be held until the batch's fence ran. The hub lets go of the
    /// outbox only after every look taken before it stopped serving it
    /// ended, so a fence that passes on a live control session's tag is
    /// one whose process still meant to serve the outbox.
    pub(crate) async fn look(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let look = self.gate.read().await;
        self.served().then_some(look)
    }

    /// Until no batch is between its look and its fence. After
    /// `serve(false)`, before the own lock is let go of.
    async fn quiesce(&self) {
        drop(self.gate.write().await);
    }

    fn serve(&self, served: bool) {
        self.served.store(served, Ordering::Release);
        if served {
            self.wake();
        }
    }
}

/// One database of a fleet, as its outboxes' sources see it.
pub(crate) struct Database {
    pool: Arc<Pool>,
    /// The control session's backend pid, 0 while it is not connected.
    control_pid: AtomicI32,
    /// The control session's tag (`outbox::sql::fleet::take_tag`), 0
    /// while it is not connected.
    tag: AtomicI32,
}

impl Database {
    /// The database's batch sessions.
    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The control session's backend pid. None while it is reconnecting.
    pub(crate) fn control_pid(&self) -> Option<i32> {
        match self.control_pid.load(Ordering::Acquire) {
            0 => None,
            pid => Some(pid),
        }
    }

    /// The control session's tag: what a batch's fence checks is still
    /// held. None while it is reconnecting.
    pub(crate) fn tag(&self) -> Option<i32> {
        match self.tag.load(Ordering::Acquire) {
            0 => None,
            tag => Some(tag),
        }
    }
}

/// What every hub of a fleet shares.
pub(crate) struct Shared {
    config: FleetConfig,
    sink: Arc<dyn Sink>,
    health: Arc<Health>,
    /// `READY=1`, and `OUTBOX_FLEET=takeover-waiting` when an outbox taken
    /// over waits for the previous owner's batch (tests wait for it).
    signals: Signals,
    /// Every outbox's relay traces its batches with it, labelled by outbox.
    tracing: Option<crate::trace::Tracing>,
}

/// See the [module docs](self). Build with [`Fleet::new`], run with
/// [`Fleet::run`].
pub struct Fleet {
    pg: PgConfig,
    shared: Arc<Shared>,
}

impl Fleet {
    /// A fleet over the server and database of `pg`, delivering to `sink`.
    /// Fails on settings a fleet cannot serve.
    pub fn new(
        pg: impl Into<PgConfig>,
        sink: Arc<dyn Sink>,
        config: FleetConfig,
    ) -> Result<Self, RelayError> {
        if let Some(what) = config.refused() {
            return Err(RelayError::Fleet(format!(
                "a fleet (--schemas) does not take {what} yet; run a relay per outbox for it"
            )));
        }
        let mut pg = pg.into();
        pg.prefer_primary();
        if pg.postgres().get_application_name().is_none() {
            pg.postgres_mut().application_name("outbox-fleet");
        }
        Ok(Self {
            pg,
            shared: Arc::new(Shared {
                config,
                sink,
                health: Arc::default(),
                signals: Signals::Process,
                tracing: None,
            }),
        })
    }

    /// Sends the fleet's signals (`READY=1`) to `signals` instead of the
    /// process's notify socket.
    #[must_use]
    pub fn with_signals(mut self, signals: Signals) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("not running yet: the only reference")
            .signals = signals;
        self
    }

    /// Traces every outbox's batches with `tracing`, as
    /// [`Relay::with_tracing`](crate::Relay::with_tracing) does one relay's:
    /// each span carries its outbox in `outbox.table`.
    #[must_use]
    pub fn with_tracing(mut self, tracing: crate::trace::Tracing) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("not running yet: the only reference")
            .tracing = Some(tracing);
        self
    }

    /// The fleet's readiness: its control sessions, and running once every
    /// database was searched.
    pub fn health(&self) -> Arc<Health> {
        Arc::clone(&self.shared.health)
    }

    /// Serves until `cancel` fires; every batch in flight is committed first.
    /// Fails at startup if PostgreSQL cannot be reached within the connect
    /// timeout or refuses the login; later losses reconnect.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), RelayError> {
        // As a single relay: a wrong URL or password stops it now (exit 2),
        // an unreachable server after `--connect-timeout` (exit 1).
        drop(crate::pg::connect(&self.pg).await.map_err(RelayError::Connect)?);
        let config = &self.shared.config;
        if config.relay.source == SourceKind::Wal {
            let result = match config.databases.clone() {
                None => wal::run(&self, cancel).await,
                Some(pattern) => self.run_databases(&pattern, Vec::new(), cancel).await,
            };
            self.shared.health.running(false);
            info!("fleet stopped");
            return result;
        }
        info!(
            schemas = config.schemas.as_deref().unwrap_or("(none)"),
            listed = config.listed.len(),
            databases = config.databases.as_deref().unwrap_or("(the URL's)"),
            table = %config.relay.outbox.table.as_str(),
            sink = %self.shared.sink.describe(),
            sessions = config.sessions,
            discover_interval_ms = u64::try_from(config.discover_interval.as_millis()).unwrap_or(u64::MAX),
            "fleet starting"
        );
        // Listed outboxes of databases the pattern does not cover get
        // hubs of their own (those of the URL's database, or of a database
        // --databases matches, join its hub).
        let mut elsewhere: Vec<(PgConfig, Vec<Listed>)> = Vec::new();
        for listed in &config.listed {
            let covered = match &config.databases {
                None => same_database(&listed.pg, &self.pg),
                Some(pattern) => like(pattern, dbname(&listed.pg)),
            };
            if covered {
                continue;
            }
            match elsewhere.iter_mut().find(|(pg, _)| same_database(pg, &listed.pg)) {
                Some((_, list)) => list.push(listed.clone()),
                None => elsewhere.push((listed.pg.clone(), vec![listed.clone()])),
            }
        }
        let mut tasks = Vec::new();
        let mut firsts = Vec::new();
        for (pg, listed) in elsewhere {
            let (first, ticked) = tokio::sync::oneshot::channel();
            firsts.push(ticked);
            let name = dbname(&pg).to_owned();
            let hub = hub::Hub::new(Arc::clone(&self.shared), pg, name, true, None, listed);
            tasks.push(tokio::spawn(hub.run(cancel.clone(), Some(first))));
        }
        match config.databases.clone() {
            None => {
                let name = dbname(&self.pg).to_owned();
                let (first, ticked) = tokio::sync::oneshot::channel();
                firsts.push(ticked);
                let listed = self.listed_in(&self.pg);
                let prefixed = !tasks.is_empty();
                let hub = hub::Hub::new(
                    Arc::clone(&self.shared),
                    self.pg.clone(),
                    name,
                    prefixed,
                    config.schemas.clone(),
                    listed,
                );
                tasks.push(tokio::spawn(hub.run(cancel.clone(), Some(first))));
                let all = futures::future::join_all(firsts);
                if tokio::select! { t = all => t.iter().all(Result::is_ok), () = cancel.cancelled() => false }
                {
                    self.ready();
                }
            }
            Some(pattern) => self.run_databases(&pattern, firsts, cancel.clone()).await?,
        }
        for task in tasks {
            let _ = task.await;
        }
        self.shared.health.running(false);
        info!("fleet stopped");
        Ok(())
    }

    /// Serves one database `--databases` found until `cancel` fires: its
    /// hub, or with `--source wal` its log tailing. `first` is told once it
    /// searched for outboxes (or, log tailing, opened its source).
    fn spawn_database(
        &self,
        pg: PgConfig,
        name: String,
        cancel: CancellationToken,
        first: tokio::sync::oneshot::Sender<()>,
    ) -> tokio::task::JoinHandle<()> {
        if self.shared.config.relay.source == SourceKind::Wal {
            return tokio::spawn(wal::serve_database(
                Arc::clone(&self.shared),
                pg,
                name,
                cancel,
                first,
            ));
        }
        let listed = self.listed_in(&pg);
        let schemas = self.shared.config.schemas.clone();
        let hub = hub::Hub::new(Arc::clone(&self.shared), pg, name, true, schemas, listed);
        tokio::spawn(hub.run(cancel, Some(first)))
    }

    /// The listed outboxes in the database of `pg`.
    fn listed_in(&self, pg: &PgConfig) -> Vec<Listed> {
        self.shared
            .config
            .listed
            .iter()
            .filter(|l| same_database(&l.pg, pg))
            .cloned()
            .collect()
    }

    fn ready(&self) {
        self.shared.health.running(true);
        self.shared.signals.send("READY=1\nSTATUS=fleet ready");
        info!("fleet ready");
    }

    /// One hub per database matching `pattern`, started and stopped as
    /// databases come and go.
    async fn run_databases(
        &self,
        pattern: &str,
        mut firsts: Vec<tokio::sync::oneshot::Receiver<()>>,
        cancel: CancellationToken,
    ) -> Result<(), RelayError> {
        let mut hubs: std::collections::BTreeMap<String, (CancellationToken, tokio::task::JoinHandle<()>)> =
            Default::default();
        let mut client = None;
        let mut readied = false;
        let mut every = tokio::time::interval(self.shared.config.discover_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                () = cancel.cancelled() => break,
            }
            let c: &tokio_postgres::Client = match &client {
                Some(c) => c,
                None => match crate::pg::connect_once(&self.pg).await {
                    Ok(c) => client.insert(c),
                    Err(error) => {
                        let error = crate::error::error_chain(&error);
                        self.shared.health.postgres("server", Some(error.clone()));
                        warn!(%error, "listing the databases: connecting failed; retrying");
                        continue;
                    }
                },
            };
            let found = match outbox::sql::fleet::matching_databases(c, pattern).await {
                Ok(found) => found,
                Err(error) => {
                    let error = crate::error::error_chain(&error);
                    self.shared.health.postgres("server", Some(error.clone()));
                    warn!(%error, "listing the databases failed; retrying");
                    client = None;
                    continue;
                }
            };
            self.shared.health.postgres("server", None);
            hubs.retain(|name, (stop, _)| {
                let keep = found.contains(name);
                if !keep {
                    info!(database = %name, "database gone; its outboxes are let go");
                    stop.cancel();
                }
                keep
            });
            for name in found {
                if hubs.contains_key(&name) {
                    continue;
                }
                let mut pg = self.pg.clone();
                pg.postgres_mut().dbname(&name);
                let stop = cancel.child_token();
                let (first, ticked) = tokio::sync::oneshot::channel();
                firsts.push(ticked);
                let task = self.spawn_database(pg, name.clone(), stop.clone(), first);
                hubs.insert(name, (stop, task));
            }
            if !readied {
                let all = futures::future::join_all(std::mem::take(&mut firsts));
                tokio::select! {
                    _ = all => {}
                    () = cancel.cancelled() => break,
                }
                readied = true;
                self.ready();
            }
        }
        for (_, (stop, task)) in hubs {
            stop.cancel();
            let _ = task.await;
        }
        Ok(())
    }
}

/// An outbox found by the pattern as metrics and logs name it:
/// `schema.table`, or `database/schema.table` when the fleet spans
/// databases.
pub(crate) fn label(database: Option<&str>, outbox: &outbox::Config) -> String {
    match database {
        Some(name) => format!("{name}/{}", outbox.display_name()),
        None => outbox.display_name(),
    }
}

/// The database `pg` names.
fn dbname(pg: &PgConfig) -> &str {
    pg.postgres().get_dbname().unwrap_or("postgres")
}

/// Whether `a` and `b` connect to one database (hosts, ports, database).
fn same_database(a: &PgConfig, b: &PgConfig) -> bool {
    let (a, b) = (a.postgres(), b.postgres());
    a.get_hosts() == b.get_hosts() && a.get_ports() == b.get_ports() && a.get_dbname() == b.get_dbname()
}

/// SQL's `LIKE` (`%` any run, `_` any one character, `\` escapes), for
/// telling whether `--databases` covers a listed outbox's database as the
/// server would.
fn like(pattern: &str, name: &str) -> bool {
    fn matches(p: &[char], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some(('%', rest)) => (0..=n.len()).any(|i| matches(rest, &n[i..])),
            Some(('_', rest)) => !n.is_empty() && matches(rest, &n[1..]),
            Some(('\\', rest)) if !rest.is_empty() => {
                n.first() == Some(&rest[0]) && matches(&rest[1..], &n[1..])
            }
            Some((c, rest)) => n.first() == Some(c) && matches(rest, &n[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    matches(&p, &n)
}

#[cfg(test)]
mod tests {
    use super::like;

    #[test]
    fn like_matches_as_sql_does() {
        assert!(like("app_%", "app_1"));
        assert!(like("app_%", "app_"));
        assert!(!like("app_%", "app"));
        assert!(like("a_c", "abc"));
        assert!(!like("a_c", "ac"));
        assert!(like("%", ""));
        assert!(like("a\\_c", "a_c"));
        assert!(!like("a\\_c", "abc"));
        assert!(like("%tenant%", "my_tenant_db"));
    }
}
