//! A relay fleet: one process serving many outboxes (tenant schemas of a
//! database, in one database or in every database of a server that
//! matches a pattern), with connections per database, not per outbox.
//!
//! Per database ([`hub`]): one control session, which LISTENs (the insert
//! trigger names its outbox, migration 0009), finds the tenant outboxes
//! every `discover_interval`, holds the advisory locks of the outboxes this
//! process serves (`outbox::sql::fleet`), and once per poll asks which of
//! them have rows due, in one statement; and a [`pool`] of batch sessions
//! the outboxes borrow a batch at a time, first come first served. So a
//! process holds `1 + sessions` connections per database whatever the
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
//! Not (yet) in a fleet: the WAL source, deadline claims, strict order,
//! retention and `--drain` (refused by [`Fleet::new`]).

mod hub;
mod pool;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub(crate) use self::pool::{Lent, Pool};
use crate::config::{ClaimMode, OrderMode, Pooler, RelayConfig, SourceKind};
use crate::context::Signals;
use crate::error::RelayError;
use crate::health::Health;
use crate::pg::PgConfig;
use crate::sink::Sink;

/// What a fleet serves and how.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// A `LIKE` pattern: the schemas whose outbox (named
    /// `relay.outbox.table`, migrated) the fleet serves.
    pub schemas: String,
    /// A `LIKE` pattern: the databases of the server it serves; None for
    /// the URL's database only.
    pub databases: Option<String>,
    /// Batch sessions per database, shared by its outboxes.
    pub sessions: usize,
    /// How often each database is searched for outboxes, and the lease of
    /// outboxes between fleet processes balanced.
    pub discover_interval: Duration,
    /// The settings every outbox is served with; its `outbox` names the
    /// table and channel, not a schema.
    pub relay: RelayConfig,
}

/// Batch sessions per database by default.
pub const DEFAULT_SESSIONS: usize = 4;
/// How often outboxes are discovered by default.
pub const DEFAULT_DISCOVER_INTERVAL: Duration = Duration::from_secs(5);

impl FleetConfig {
    /// What a fleet cannot do yet, as the flag that asked for it.
    fn refused(&self) -> Option<&'static str> {
        let r = &self.relay;
        if r.source != SourceKind::Poll {
            Some("--source wal")
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
        for tenant in outbox::sql::fleet::tenant_outboxes(client, &config.schemas, table).await? {
            let mut outbox = config.relay.outbox.clone();
            outbox.schema = tenant.schema;
            let label = match &database {
                Some(name) => format!("{name}/{}", outbox.display_name()),
                None => outbox.display_name(),
            };
            found.push(Surveyed {
                outbox: label,
                problem: hub::servable(client, &outbox)
                    .await
                    .err()
                    .map(|why| format!("{}: {}", why.reason, why.error)),
            });
        }
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
}

impl Tenant {
    fn new(key: i32) -> Self {
        Self {
            key,
            wake: Notify::new(),
            served: AtomicBool::new(false),
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
}

impl Database {
    /// The database's batch sessions.
    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The control session's backend pid: what a batch's fence checks
    /// holds the outbox's lock. None while it is reconnecting.
    pub(crate) fn control_pid(&self) -> Option<i32> {
        match self.control_pid.load(Ordering::Acquire) {
            0 => None,
            pid => Some(pid),
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
        info!(
            schemas = %config.schemas,
            databases = config.databases.as_deref().unwrap_or("(the URL's)"),
            table = %config.relay.outbox.table.as_str(),
            sink = %self.shared.sink.describe(),
            sessions = config.sessions,
            discover_interval_ms = u64::try_from(config.discover_interval.as_millis()).unwrap_or(u64::MAX),
            "fleet starting"
        );
        match config.databases.clone() {
            None => {
                let name = self.pg.postgres().get_dbname().unwrap_or("postgres").to_owned();
                let (first, ticked) = tokio::sync::oneshot::channel();
                let hub = hub::Hub::new(Arc::clone(&self.shared), self.pg.clone(), name, false);
                let task = tokio::spawn(hub.run(cancel.clone(), Some(first)));
                if tokio::select! { t = ticked => t.is_ok(), () = cancel.cancelled() => false } {
                    self.ready();
                }
                let _ = task.await;
            }
            Some(pattern) => self.run_databases(&pattern, cancel).await?,
        }
        self.shared.health.running(false);
        info!("fleet stopped");
        Ok(())
    }

    fn ready(&self) {
        self.shared.health.running(true);
        self.shared.signals.send("READY=1\nSTATUS=fleet ready");
        info!("fleet ready");
    }

    /// One hub per database matching `pattern`, started and stopped as
    /// databases come and go.
    async fn run_databases(&self, pattern: &str, cancel: CancellationToken) -> Result<(), RelayError> {
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
            let mut firsts = Vec::new();
            for name in found {
                if hubs.contains_key(&name) {
                    continue;
                }
                let mut pg = self.pg.clone();
                pg.postgres_mut().dbname(&name);
                let stop = cancel.child_token();
                let (first, ticked) = tokio::sync::oneshot::channel();
                firsts.push(ticked);
                let hub = hub::Hub::new(Arc::clone(&self.shared), pg, name.clone(), true);
                let task = tokio::spawn(hub.run(stop.clone(), Some(first)));
                hubs.insert(name, (stop, task));
            }
            if !readied {
                let all = futures::future::join_all(firsts);
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
