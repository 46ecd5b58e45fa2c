//! One database of a fleet: its control session and the outboxes it serves.
//!
//! A listening session beside it receives the outboxes' notifications
//! and wakes the outbox each names. The control session joins the
//! database's fleet (membership lock) and, every discover interval, finds
//! the tenant outboxes, lets go of the dropped ones and balances the served
//! ones against the other fleet processes (see `outbox::sql::fleet`); every
//! poll interval it reads the served outboxes' backlogs, in one statement,
//! wakes those with rows due and sets their backlog gauges.
//!
//! An outbox this process serves runs a relay loop of its own (spawned when
//! served, cancelled when let go); one it does not serve costs nothing but
//! its entry here. If the control session fails, its locks are gone with
//! it: every outbox stops being served at once and the hub reconnects.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use outbox::sql::fleet as sql;
use outbox::sql::{ClaimSpec, OutboxSql};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, warn};

use super::{Database, Listed, Pool, Shared, Tenant};
use crate::config::RelayConfig;
use crate::error::error_chain;
use crate::pg::PgConfig;
use crate::relay::Relay;
use crate::sink::Sink;

/// Whether this process serves an outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Own {
    /// Someone else does, or nobody yet.
    No,
    /// Its own lock is ours; the barrier has not passed yet.
    TakingOver,
    Serving,
}

/// One outbox of the database: found by the pattern, or listed by name.
struct Entry {
    config: outbox::Config,
    /// What it is served with: the fleet's settings, or a listed
    /// outbox's own.
    relay: RelayConfig,
    sink: Arc<dyn Sink>,
    /// Its `outbox` label in metrics and logs.
    label: String,
    tenant: Arc<Tenant>,
    /// Served split ([`super::FleetConfig::split`]): its own lock is held
    /// shared, by every process serving it, and its relay is a relay of
    /// its own with partition leases, not a loop over the pool.
    split: bool,
    /// Split: this process sets its backlog gauges (the lowest-numbered
    /// control session serving it does, so they are not summed twice).
    reports: bool,
    own: Own,
    /// Its relay loop while served.
    running: Option<(CancellationToken, JoinHandle<()>)>,
}

/// See the [module docs](self).
pub(super) struct Hub {
    shared: Arc<Shared>,
    pg: PgConfig,
    name: String,
    /// Several databases: outbox labels are `database/schema.table`.
    prefixed: bool,
    /// The schema pattern this database is searched with; None for a
    /// database only listed outboxes are in.
    schemas: Option<String>,
    /// The listed outboxes of this database, with their lock keys once
    /// known (asked of the server once).
    listed: Vec<(Listed, Option<i32>)>,
    db: Arc<Database>,
    /// By `schema.table`.
    outboxes: BTreeMap<String, Entry>,
    /// Outboxes not served for their privileges or version: said once.
    refused: BTreeSet<String>,
    /// The served outboxes and their names, in one order: what the scan
    /// reads.
    due: (Vec<outbox::Config>, Vec<String>),
    /// The scan of `due`, prepared on the control session once per served
    /// set (see `outbox::sql::fleet::prepare_summaries`); None until the
    /// next scan after the set or the session changed.
    scan: Option<tokio_postgres::Statement>,
    /// An outbox taken over waits for the previous owner's batch, and the
    /// fleet said so.
    waiting: bool,
    /// Relay loops told to stop that may still commit their batch: awaited
    /// when the hub stops, so SIGTERM finishes every batch in flight.
    stopping: Vec<JoinHandle<()>>,
    /// The served outboxes by `schema.table`: the control connection's
    /// reader wakes the outbox a notification names itself, so a wake-up
    /// never waits for a discovery or a scan the hub is running (with
    /// 1,000 outboxes, hundreds of milliseconds every few seconds).
    wakers: Wakers,
}

/// See [`Hub::wakers`].
type Wakers = Arc<std::sync::Mutex<HashMap<String, Arc<Tenant>>>>;

/// A database's sessions of the hub, while connected.
struct Connected {
    /// The control session.
    client: Client,
    /// Kept open: dropped, it stops listening.
    _listener: Client,
    /// Payloads the listener's reader did not handle itself.
    notes: mpsc::UnboundedReceiver<String>,
}

/// How an outbox was found.
enum Found {
    /// By the schema pattern: served with the fleet's settings.
    Pattern(outbox::Config),
    /// Listed by name: the listed outbox at this index.
    Listed(usize),
}

/// Why an outbox found is not served.
pub(crate) struct NotServable {
    /// What is wrong, for the log line.
    pub(crate) reason: &'static str,
    /// The error chain, naming the fix.
    pub(crate) error: String,
}

/// What a relay checks at startup, per outbox as it is found: the role's
/// privileges first (without them the version check itself is refused),
/// then the schema version. A tenant failing either is skipped, said once,
/// instead of failing every batch. One served `split` takes partition
/// leases, and needs their privileges too.
pub(crate) async fn servable(
    client: &Client,
    outbox: &outbox::Config,
    split: bool,
) -> Result<(), NotServable> {
    use outbox::privileges::{Needs, Role, Tables};
    let needs = Needs::of(&[Role::Relay]);
    let needs = if split { needs } else { needs.without_leases() };
    if let Err(error) = outbox::privileges::check(client, &Tables::outbox(outbox.clone()), &needs).await {
        return Err(NotServable {
            reason: "this role lacks privileges on it",
            error: error_chain(&error),
        });
    }
    outbox::check(client, outbox).await.map_err(|error| NotServable {
        reason: "its schema is not this relay's version (run `outbox migrate`)",
        error: error_chain(&error),
    })
}

/// Why the control session is being replaced.
#[derive(Debug, thiserror::Error)]
enum HubError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("the control session's connection was lost")]
    ConnectionLost,
}

impl Hub {
    pub(super) fn new(
        shared: Arc<Shared>,
        pg: PgConfig,
        name: String,
        prefixed: bool,
        schemas: Option<String>,
        listed: Vec<Listed>,
    ) -> Self {
        let pool = Pool::new(pg.clone(), shared.config.sessions, shared.config.prepared_claims);
        Self {
            shared,
            pg,
            name,
            prefixed,
            schemas,
            listed: listed.into_iter().map(|l| (l, None)).collect(),
            db: Arc::new(Database {
                pool,
                control_pid: Default::default(),
                tag: Default::default(),
            }),
            outboxes: BTreeMap::new(),
            refused: BTreeSet::new(),
            due: Default::default(),
            scan: None,
            waiting: false,
            stopping: Vec::new(),
            wakers: Wakers::default(),
        }
    }

    /// Serves the database until `cancel` fires, reconnecting the control
    /// session as needed. `first` is told after the first discovery.
    pub(super) async fn run(mut self, cancel: CancellationToken, mut first: Option<oneshot::Sender<()>>) {
        let mut wait =
            crate::backoff::Doubling::new(crate::backoff::RECONNECT_FIRST, crate::backoff::RECONNECT_MAX);
        let span = tracing::info_span!("database", database = %self.name);
        async {
            while !cancel.is_cancelled() {
                let result = match self.connect().await {
                    Ok(Connected { client, _listener, notes }) => {
                        wait = crate::backoff::Doubling::new(
                            crate::backoff::RECONNECT_FIRST,
                            crate::backoff::RECONNECT_MAX,
                        );
                        self.serve(&client, notes, &cancel, &mut first).await
                    }
                    Err(error) => Err(error),
                };
                self.lost().await;
                match result {
                    Ok(()) => break,
                    Err(error) => {
                        let error = error_chain(&error);
                        self.shared
                            .health
                            .postgres(&self.name, Some(format!("control session: {error}")));
                        warn!(%error, "fleet control session failed; its outboxes are let go until it is back");
                    }
                }
                let delay = wait.next_delay();
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = cancel.cancelled() => break,
                }
            }
            self.lost().await;
            let stopping = self.stopping.len();
            for task in std::mem::take(&mut self.stopping) {
                let _ = task.await;
            }
            debug!(outboxes = stopping, "every outbox's last batch committed");
            self.db.pool().close();
        }
        .instrument(span)
        .await;
    }

    /// The control session, a member of the database's fleet, and the
    /// listening session beside it.
    async fn connect(&self) -> Result<Connected, HubError> {
        let (client, connection) = crate::pg::open(&self.pg).await?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                warn!(error = %error_chain(&error), "fleet control connection closed");
            }
        });
        let (listener, notes) = self.listen().await?;
        let config = &self.shared.config;
        let pattern = config.schemas.as_deref().unwrap_or_default();
        sql::join(&client, pattern, &config.relay.outbox.table).await?;
        let (pid, _) = outbox::sql::backend_identity(&client).await?;
        let tag = sql::take_tag(&client).await?;
        self.db.control_pid.store(pid, Ordering::Release);
        self.db.tag.store(tag, Ordering::Release);
        self.shared.health.postgres(&self.name, None);
        info!(pid, "fleet control session up");
        Ok(Connected {
            client,
            _listener: listener,
            notes,
        })
    }

    /// A session that only LISTENs. PostgreSQL delivers a notification to
    /// a session between its transactions, so the control session, busy
    /// for hundreds of milliseconds with a discovery or a scan of 1,000
    /// outboxes, would hold every wake-up back that long (the bench's p99
    /// was 830 ms with a p50 of 3 ms). Its reader wakes the served outbox
    /// a notification names itself and hands any other payload to the hub.
    /// The channel closes with the connection.
    async fn listen(&self) -> Result<(Client, mpsc::UnboundedReceiver<String>), HubError> {
        let (listener, mut connection) = crate::pg::open(&self.pg).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let wakers = Arc::clone(&self.wakers);
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        let served = wakers.lock().expect("not poisoned").get(n.payload()).cloned();
                        match served {
                            Some(tenant) => tenant.wake(),
                            // Not an outbox served here: the hub decides.
                            None => {
                                let _ = tx.send(n.payload().to_owned());
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(error) => {
                        warn!(error = %error_chain(&error), "fleet listening connection closed");
                        break;
                    }
                }
            }
        });
        outbox::sql::listen(&listener, &self.shared.config.relay.outbox.channel).await?;
        Ok((listener, rx))
    }

    async fn serve(
        &mut self,
        client: &Client,
        mut notes: mpsc::UnboundedReceiver<String>,
        cancel: &CancellationToken,
        first: &mut Option<oneshot::Sender<()>>,
    ) -> Result<(), HubError> {
        let config = &self.shared.config;
        let mut discover = tokio::time::interval(config.discover_interval);
        discover.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll = tokio::time::interval(crate::wake::jittered(config.relay.poll_interval));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first poll comes right after the first discovery.
        poll.reset();
        loop {
            tokio::select! {
                () = cancel.cancelled() => {
                    self.finish_split().await;
                    return Ok(());
                }
                _ = discover.tick() => {
                    self.discover(client).await?;
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                        self.scan(client).await?;
                    }
                }
                _ = poll.tick() => self.scan(client).await?,
                note = notes.recv() => match note {
                    Some(payload) => self.notified(client, &payload).await?,
                    None => return Err(HubError::ConnectionLost),
                },
            }
        }
    }

    /// A notification the listener did not handle: one naming an outbox
    /// found here but not served by this process is another's (one served
    /// since the listener looked was woken by `start`); any other (a `dlq
    /// requeue` sweep, a single relay's) makes a due scan.
    async fn notified(&mut self, client: &Client, payload: &str) -> Result<(), HubError> {
        if self.outboxes.contains_key(payload) {
            return Ok(());
        }
        self.scan(client).await
    }

    /// Reads the served outboxes' backlogs, in one statement: wakes those
    /// with a row due and sets their backlog gauges (the fleet's
    /// `outbox_backlog_events`, `outbox_dead_letters` and
    /// `outbox_oldest_unpublished_age_seconds`, per outbox, all aggregate
    /// types in one series with `aggregate_type=""`).
    async fn scan(&mut self, client: &Client) -> Result<(), HubError> {
        if self.due.0.is_empty() {
            return Ok(());
        }
        let scanned = match &self.scan {
            Some(statement) => sql::prepared_summaries(client, statement).await,
            None => match sql::prepare_summaries(client, &self.due.0).await {
                Ok(statement) => {
                    let read = sql::prepared_summaries(client, &statement).await;
                    self.scan = Some(statement);
                    read
                }
                Err(error) => Err(error),
            },
        };
        let names = &self.due.1;
        let read = match scanned {
            Ok(read) => read,
            Err(error) if error.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
                // A tenant dropped since the last discovery: find out now.
                self.scan = None;
                return self.discover(client).await;
            }
            Err(error) => return Err(error.into()),
        };
        for (name, read) in names.iter().zip(read) {
            let Some(entry) = self.outboxes.get(name) else {
                continue;
            };
            let s = read.summary;
            if s.due_now > 0 {
                entry.tenant.wake();
            }
            // Row counts: exact in an f64 up to 2^53.
            #[allow(clippy::cast_precision_loss)]
            gauges(
                &entry.label,
                s.backlog as f64,
                s.dead_letters as f64,
                s.oldest_unpublished_age_seconds.unwrap_or(0.0),
            );
        }
        Ok(())
    }

    /// Finds the outboxes, then balances them (see the module docs), in
    /// one transaction, not one per statement: an idle fleet's cost is
    /// counted in transactions. Session advisory locks taken in it outlive
    /// its commit; a failure drops the session, which rolls it back.
    async fn discover(&mut self, client: &Client) -> Result<(), HubError> {
        client.batch_execute("BEGIN").await?;
        self.discover_and_balance(client).await?;
        client.batch_execute("COMMIT").await?;
        Ok(())
    }

    async fn discover_and_balance(&mut self, client: &Client) -> Result<(), HubError> {
        let shared = Arc::clone(&self.shared);
        let base = &shared.config.relay;
        // Found by the pattern, each with the fleet's settings.
        let mut found: HashMap<String, (Found, i32)> = HashMap::new();
        if let Some(pattern) = &self.schemas {
            for t in sql::tenant_outboxes(client, pattern, &base.outbox.table).await? {
                let mut config = base.outbox.clone();
                config.schema = t.schema;
                found.insert(config.display_name(), (Found::Pattern(config), t.key));
            }
        }
        // Listed ones win over the pattern, with their own settings.
        for i in 0..self.listed.len() {
            let key = match self.listed[i].1 {
                Some(key) => key,
                None => {
                    let key = sql::outbox_key(client, &self.listed[i].0.relay.outbox).await?;
                    self.listed[i].1 = Some(key);
                    key
                }
            };
            let name = self.listed[i].0.relay.outbox.display_name();
            found.insert(name, (Found::Listed(i), key));
        }
        let gone: Vec<String> = self
            .outboxes
            .keys()
            .filter(|name| !found.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            let mut entry = self.outboxes.remove(&name).expect("known");
            info!(outbox = %entry.label, "outbox gone; let go");
            if entry.split {
                self.finish(&mut entry).await;
                if entry.own != Own::No {
                    sql::unshare(client, &[entry.tenant.key]).await?;
                }
                continue;
            }
            self.stop(&mut entry);
            if entry.own != Own::No {
                entry.tenant.quiesce().await;
                sql::disown(client, &[entry.tenant.key]).await?;
            }
        }
        for (name, (how, key)) in found {
            if self.outboxes.contains_key(&name) {
                continue;
            }
            let (relay, sink, label, split) = match how {
                Found::Pattern(config) => {
                    let label = self.label(&config);
                    let relay = RelayConfig {
                        outbox: config,
                        ..base.clone()
                    };
                    (relay, Arc::clone(&shared.sink), label, shared.config.split)
                }
                Found::Listed(i) => {
                    let listed = &self.listed[i].0;
                    (
                        listed.relay.clone(),
                        Arc::clone(&listed.sink),
                        listed.name.clone(),
                        listed.split,
                    )
                }
            };
            // A check refused by the server must not abort the discovery's
            // transaction.
            client.batch_execute("SAVEPOINT servable").await?;
            let checked = servable(client, &relay.outbox, split).await;
            client
                .batch_execute(match checked {
                    Ok(()) => "RELEASE SAVEPOINT servable",
                    Err(_) => "ROLLBACK TO SAVEPOINT servable",
                })
                .await?;
            if let Err(why) = checked {
                if self.refused.insert(name.clone()) {
                    warn!(outbox = %label, error = %why.error, "outbox not served: {}", why.reason);
                }
                continue;
            }
            self.refused.remove(&name);
            debug!(outbox = %label, "outbox found");
            self.outboxes.insert(
                name,
                Entry {
                    config: relay.outbox.clone(),
                    relay,
                    sink,
                    label,
                    tenant: Arc::new(Tenant::new(key)),
                    split,
                    reports: false,
                    own: Own::No,
                    running: None,
                },
            );
        }
        self.balance(client).await
    }

    /// Takes this process's share of the outboxes served whole, lets go
    /// of what is over it, joins every outbox served split, and starts
    /// serving those whose barrier passed.
    async fn balance(&mut self, client: &Client) -> Result<(), HubError> {
        let pid = self.db.control_pid().unwrap_or(0);
        // An outbox served split has several holders (shared), one served
        // whole one.
        let mut holders: HashMap<i32, Vec<i32>> = HashMap::new();
        for (key, holder) in sql::owners(client).await? {
            holders.entry(key).or_default().push(holder);
        }
        let config = &self.shared.config;
        let pattern = config.schemas.as_deref().unwrap_or_default();
        let members = sql::members(client, pattern, &config.relay.outbox.table)
            .await?
            .max(1);
        // Ours by our records but not by PostgreSQL's: not ours.
        let mut lost = Vec::new();
        for (name, entry) in &mut self.outboxes {
            let held = holders.get(&entry.tenant.key);
            if entry.own != Own::No && !held.is_some_and(|h| h.contains(&pid)) {
                lost.push(name.clone());
            }
            let reports = entry.split && held.and_then(|h| h.iter().min()) == Some(&pid);
            if entry.reports && !reports {
                // Another process reports it now: a sum stays right.
                gauges(&entry.label, 0.0, 0.0, 0.0);
            }
            entry.reports = reports;
        }
        for name in lost {
            let mut entry = self.outboxes.remove(&name).expect("known");
            warn!(outbox = %entry.label, "outbox no longer held by this process; let go");
            self.stop(&mut entry);
            entry.own = Own::No;
            self.outboxes.insert(name, entry);
        }
        let whole = self.outboxes.values().filter(|e| !e.split).count();
        let share = whole.div_ceil(members);
        let mine = self
            .outboxes
            .values()
            .filter(|e| !e.split && e.own != Own::No)
            .count();
        if mine > share {
            let over: Vec<String> = self
                .outboxes
                .iter()
                .rev()
                .filter(|(_, e)| !e.split && e.own != Own::No)
                .take(mine - share)
                .map(|(s, _)| s.clone())
                .collect();
            let mut keys = Vec::new();
            for name in over {
                let mut entry = self.outboxes.remove(&name).expect("known");
                self.stop(&mut entry);
                entry.tenant.quiesce().await;
                entry.own = Own::No;
                keys.push(entry.tenant.key);
                debug!(outbox = %entry.label, members, "outbox handed over to another fleet process");
                self.outboxes.insert(name, entry);
            }
            sql::disown(client, &keys).await?;
        } else if mine < share {
            // Free ones, starting at a place of this process's own so two
            // processes starting together do not try the same ones first.
            let free: Vec<i32> = self
                .outboxes
                .values()
                .filter(|e| !e.split && e.own == Own::No && !holders.contains_key(&e.tenant.key))
                .map(|e| e.tenant.key)
                .collect();
            let start = usize::try_from(pid).unwrap_or(0) % free.len().max(1);
            let wanted: Vec<i32> = free
                .iter()
                .cycle()
                .skip(start)
                .take((share - mine).min(free.len()))
                .copied()
                .collect();
            let taken: BTreeSet<i32> = sql::try_own(client, &wanted).await?.into_iter().collect();
            for entry in self.outboxes.values_mut() {
                if taken.contains(&entry.tenant.key) {
                    entry.own = Own::TakingOver;
                }
            }
        }
        // Every process serves a split outbox; its shared lock is refused
        // while a process with other settings serves it whole.
        let joining: Vec<i32> = self
            .outboxes
            .values()
            .filter(|e| e.split && e.own == Own::No)
            .map(|e| e.tenant.key)
            .collect();
        if !joining.is_empty() {
            let joined: BTreeSet<i32> = sql::try_share(client, &joining).await?.into_iter().collect();
            for entry in self.outboxes.values_mut() {
                if entry.split && joined.contains(&entry.tenant.key) {
                    entry.own = Own::TakingOver;
                }
            }
        }
        let taking: Vec<i32> = self
            .outboxes
            .values()
            .filter(|e| e.own == Own::TakingOver)
            .map(|e| e.tenant.key)
            .collect();
        if !taking.is_empty() {
            let mut passed: BTreeSet<i32> = sql::barrier(client, &taking).await?.into_iter().collect();
            // One taken whole also waits for the relays that partition it
            // (a process serving it split, a relay of its own) to be gone.
            let whole: Vec<(i32, outbox::Config, std::time::Duration)> = self
                .outboxes
                .values()
                .filter(|e| !e.split && e.own == Own::TakingOver && passed.contains(&e.tenant.key))
                .map(|e| (e.tenant.key, e.config.clone(), e.relay.lease_timeout))
                .collect();
            if !whole.is_empty() {
                let configs: Vec<outbox::Config> = whole.iter().map(|(_, c, _)| c.clone()).collect();
                let within = whole.iter().map(|(_, _, t)| *t).max().unwrap_or_default();
                let free: BTreeSet<usize> = sql::without_live_relays(client, &configs, within)
                    .await?
                    .into_iter()
                    .collect();
                for (i, (key, _, _)) in whole.iter().enumerate() {
                    if !free.contains(&i) {
                        passed.remove(key);
                    }
                }
            }
            let names: Vec<String> = self
                .outboxes
                .iter()
                .filter(|(_, e)| passed.contains(&e.tenant.key) && e.own == Own::TakingOver)
                .map(|(name, _)| name.clone())
                .collect();
            for name in names {
                self.start(&name).await;
            }
            let waiting = taking.len() > passed.len();
            if waiting && !self.waiting {
                info!(
                    outboxes = taking.len() - passed.len(),
                    "outboxes taken over wait for the previous owner's batches to end"
                );
                self.shared.signals.send("OUTBOX_FLEET=takeover-waiting");
            }
            self.waiting = waiting;
        } else {
            self.waiting = false;
        }
        if self.rebuild_due() {
            let served = self.outboxes.values().filter(|e| e.own == Own::Serving).count();
            info!(
                served,
                found = self.outboxes.len(),
                processes = members,
                "serving {served} of {} outboxes",
                self.outboxes.len()
            );
        }
        Ok(())
    }

    /// What the scan reads: the outboxes served now. Returns whether the
    /// served set changed.
    fn rebuild_due(&mut self) -> bool {
        // A split outbox's relay finds its rows itself; the scan reads it
        // for its gauges, in one process.
        let served: Vec<(&String, &Entry)> = self
            .outboxes
            .iter()
            .filter(|(_, e)| e.own == Own::Serving && (!e.split || e.reports))
            .collect();
        if served.len() == self.due.1.len() && served.iter().zip(&self.due.1).all(|((s, _), d)| *s == d) {
            return false;
        }
        let configs: Vec<outbox::Config> = served.iter().map(|(_, e)| e.config.clone()).collect();
        self.due = (configs, served.iter().map(|(s, _)| (*s).clone()).collect());
        self.scan = None;
        true
    }

    /// `schema.table`, or `database/schema.table` across databases.
    fn label(&self, outbox: &outbox::Config) -> String {
        super::label(self.prefixed.then_some(self.name.as_str()), outbox)
    }

    /// Starts serving the outbox `name`: its relay loop.
    async fn start(&mut self, name: &str) {
        let db = Arc::clone(&self.db);
        let pg = self.pg.clone();
        let entry = self.outboxes.get_mut(name).expect("known");
        let config = entry.relay.clone();
        let label = entry.label.clone();
        if entry.split {
            // A relay of its own, as `outbox relay` for this outbox alone
            // would run: its partition leases share the outbox with the
            // other processes' relays for it.
            entry.own = Own::Serving;
            let stop = CancellationToken::new();
            let relay = Relay::for_fleet(
                pg,
                Arc::clone(&entry.sink),
                config,
                label.clone(),
                self.shared.tracing.as_ref(),
            );
            entry.running = Some((stop.clone(), spawn_relay(&label, relay.run(stop))));
            debug!(outbox = %label, "serving outbox split");
            return;
        }
        // Unprepared (see `pool`); a batch transaction left idle longer
        // than a claim may last is ended by the server.
        let statements = match OutboxSql::with_claims(&config.outbox, ClaimSpec::default())
            .unprepared_relay(config.claim_timeout)
            .await
        {
            Ok(statements) => statements,
            Err(error) => {
                error!(outbox = %label, error = %error_chain(&error), "outbox not served");
                return;
            }
        };
        entry.own = Own::Serving;
        let tenant = Arc::clone(&entry.tenant);
        let stop = CancellationToken::new();
        let relay = Relay::for_fleet(
            pg,
            Arc::clone(&entry.sink),
            config,
            label.clone(),
            self.shared.tracing.as_ref(),
        );
        let run = relay.run_tenant(Arc::clone(&tenant), db, statements, stop.clone());
        entry.running = Some((stop, spawn_relay(&label, run)));
        tenant.serve(true);
        self.wakers
            .lock()
            .expect("not poisoned")
            .insert(name.to_owned(), tenant);
        debug!(outbox = %label, "serving outbox");
    }

    /// Stops serving `entry`: no new claim, and its relay loop ends after
    /// committing the batch in flight (not awaited: the next owner's
    /// barrier waits for that batch).
    fn stop(&mut self, entry: &mut Entry) {
        entry.tenant.serve(false);
        self.wakers
            .lock()
            .expect("not poisoned")
            .remove(&entry.config.display_name());
        // Whoever serves it next reports it: a sum over processes stays
        // right.
        gauges(&entry.label, 0.0, 0.0, 0.0);
        if let Some((stop, task)) = entry.running.take() {
            stop.cancel();
            // Not awaited here: it commits its batch and ends on its own.
            self.stopping.retain(|t| !t.is_finished());
            self.stopping.push(task);
        }
    }

    /// Stops serving `entry` and waits until its relay loop ended: a split
    /// outbox's relay commits its batches in flight before its shared own
    /// lock may be let go of (its batches take no batch lock for a
    /// barrier to wait for).
    async fn finish(&mut self, entry: &mut Entry) {
        entry.tenant.serve(false);
        if entry.reports {
            gauges(&entry.label, 0.0, 0.0, 0.0);
        }
        if let Some((stop, task)) = entry.running.take() {
            stop.cancel();
            let _ = task.await;
        }
    }

    /// Before the control session closes at shutdown: every split outbox's
    /// relay has ended (see [`Hub::finish`]).
    async fn finish_split(&mut self) {
        let names: Vec<String> = self
            .outboxes
            .iter()
            .filter(|(_, e)| e.split && e.running.is_some())
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            let mut entry = self.outboxes.remove(&name).expect("known");
            self.finish(&mut entry).await;
            self.outboxes.insert(name, entry);
        }
    }

    /// The control session is gone (or the hub stops): its locks went with
    /// it, so nothing is served until it is back.
    async fn lost(&mut self) {
        // Prepared on the session that is gone.
        self.scan = None;
        self.db.control_pid.store(0, Ordering::Release);
        self.db.tag.store(0, Ordering::Release);
        let names: Vec<String> = self.outboxes.keys().cloned().collect();
        for name in names {
            let mut entry = self.outboxes.remove(&name).expect("known");
            self.stop(&mut entry);
            entry.own = Own::No;
            self.outboxes.insert(name, entry);
        }
        self.rebuild_due();
    }
}

/// Runs one outbox's relay loop in a task of its own, in its `outbox`
/// span; its failure is logged there.
fn spawn_relay(
    label: &str,
    run: impl Future<Output = Result<(), crate::error::RelayError>> + Send + 'static,
) -> JoinHandle<()> {
    let span = tracing::info_span!("outbox", outbox = %label);
    tokio::spawn(
        async move {
            if let Err(error) = run.await {
                error!(error = %error_chain(&error), "outbox relay stopped");
            }
        }
        .instrument(span),
    )
}

/// One outbox's backlog gauges, all aggregate types together.
fn gauges(outbox: &str, backlog: f64, dead: f64, age: f64) {
    use crate::metric::{BACKLOG, DEAD_LETTERS, OLDEST_UNPUBLISHED_AGE};
    let labels = [("outbox", outbox.to_owned()), ("aggregate_type", String::new())];
    metrics::gauge!(BACKLOG, &labels).set(backlog);
    metrics::gauge!(DEAD_LETTERS, &labels).set(dead);
    metrics::gauge!(OLDEST_UNPUBLISHED_AGE, &labels).set(age);
}
