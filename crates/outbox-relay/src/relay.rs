//! The relay's cycle: wait, claim, deliver, mark, commit.
//!
//! # Why delivery is at least once
//!
//! Each batch is one transaction. The claim (`FOR UPDATE SKIP LOCKED`) locks
//! up to `batch_size` unpublished, due, not-dead rows in id order and marks
//! them published, a mark nobody else can see yet. The batch goes to the
//! sink, and only then, in the same transaction, are the rows the sink did
//! not acknowledge turned back into unpublished rows with their retry time.
//! The commit, sent after the sink answered, makes both durable at once.
//!
//! - If the relay dies before the commit (crash, kill -9, lost connection),
//!   PostgreSQL rolls the transaction back and releases the locks: the rows
//!   are still unpublished and are claimed again, so events the sink already
//!   took are sent twice. That is the bounded duplicate (at most the batches
//!   in flight, two) which consumers absorb with an inbox.
//! - A row is never marked before its sink acknowledged it, so no crash can
//!   leave a row "published" that was never sent.
//! - Shutdown (SIGINT/SIGTERM) is only honoured between batches: a batch in
//!   flight is delivered, marked and committed first.
//!
//! The cycle below reads in that order. What it does not show is where the
//! batches live between two cycles: the `Source` (see
//! `source::poll` for its two-connection overlap, which commits
//! one batch and claims the next while a third is at the sink).
//!
//! Several relays share one table through partition leases (see `lease`):
//! each claim is restricted to the partitions this relay holds, which it
//! locks `FOR SHARE` for the batch, so no other relay can take them over
//! until the batch committed or rolled back. [`OrderMode::None`] skips the
//! leases and just skips rows another relay holds. A row still failing
//! when its retry window ends (`--retry-for`, from its first failed
//! attempt; or at `--max-attempts` if set), or refused permanently, is a
//! dead letter (its
//! `dead_at` is set in the same commit): the claim no longer sees it until
//! `outbox dlq requeue` requeues it.
//!
//! With `--source wal` the same cycle runs over the WAL source
//! (`source::wal`): there the claim is the replication slot and the commit
//! is its confirmed position, which passes a transaction only once every
//! event of it was acknowledged or recorded as a dead letter (the argument
//! is in `source::wal::window`).
//!
//! A sink that is unavailable (see `breaker`) is not an event failure: the
//! rows it answered so are given back with their attempts unchanged, and
//! while its breaker is open the relay commits what it settled, claims
//! nothing and probes the sink. The argument above is untouched: those rows
//! were never marked, so they are simply claimed again later.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::breaker::{Breaker, CircuitState, Probed};
use crate::config::{ClaimMode, SourceKind};
pub use crate::config::{OrderMode, RelayConfig};
use crate::context::{RelayContext, Signals};
pub use crate::counters::Counters;
pub use crate::error::RelayError;
use crate::metric::{BatchMetrics, DeliveryMetrics};
use crate::pg::PgConfig;
use crate::plan::{self, Blocked, Failures};
use crate::route_state::{RouteStatus, sink_text};
use crate::sink::{DEFAULT_ROUTE, Delivery, DeliveryError, Sink};
use crate::source::poll::{self, Lane, PollSource};
use crate::source::tenant::TenantSource;
use crate::source::wal::WalSource;
use crate::source::{Book, Claim, Receipt, Receipts, Source, SourceError};
use crate::trace::BatchTrace;
use outbox::sql::ClaimSpec;

/// How a cycle ended.
enum Step {
    /// Go on with the next cycle.
    Continue,
    /// Shutdown was requested while waiting.
    Cancelled,
    /// Nothing left to do and the relay runs with `drain`.
    Drained,
    /// The sink was unavailable for the whole batch (its breaker is open),
    /// or, in a drain, for any of it.
    Unavailable,
}

/// The relay. Build with [`Relay::new`], run with [`Relay::run`].
pub struct Relay {
    config: RelayConfig,
    pg: PgConfig,
    sink: Arc<dyn Sink>,
    ctx: RelayContext,
    metrics: DeliveryMetrics,
    /// Further lanes (see [`Relay::with_lane`]).
    lanes: Vec<ExtraLane>,
    /// One outbox of a fleet: its start and stop are the fleet's to report
    /// (one line for hundreds of outboxes), so its own lines are debug.
    in_fleet: bool,
    /// The sink's address without secrets, for route state (a router
    /// knows its routes' own).
    address: Option<String>,
}

/// Turns a source's receipts into the relay's counters, metrics, log lines
/// and first-batch signal: the one place a batch's bookkeeping is written,
/// whichever source it came from. A batch some of whose rows failed is one
/// warning, written once its outcomes are durable, in the words of what
/// happens next (see [`failed_line`]).
struct Books {
    ctx: RelayContext,
    metrics: BatchMetrics,
    /// The sink, to find each aggregate type's route.
    sink: Arc<dyn Sink>,
    /// Aggregate type → its route's state, looked up once per type (None:
    /// the relay publishes no route state).
    routes: std::collections::HashMap<String, Option<Arc<RouteStatus>>>,
    /// `OUTBOX_BATCH=committed` was sent: once per loop, since a datagram
    /// per batch would cost a syscall per batch here and a message per
    /// batch to systemd, which reads every one.
    signalled: bool,
}

impl Books {
    fn new(ctx: &RelayContext, sink: Arc<dyn Sink>) -> Self {
        Self {
            ctx: ctx.clone(),
            metrics: BatchMetrics::new(ctx, Arc::clone(&sink)),
            sink,
            routes: std::collections::HashMap::new(),
            signalled: false,
        }
    }
}

impl Book for Books {
    fn book(&mut self, mut r: Receipt) {
        if let Some(trace) = r.trace.take()
            && let Some(tracing) = self.ctx.tracing()
        {
            tracing.batch(&self.ctx, &r, *trace);
        }
        let counters = self.ctx.counters();
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters
            .delivered
            .fetch_add(r.published as u64, Ordering::Relaxed);
        counters.failed.fetch_add(r.failures.failed, Ordering::Relaxed);
        counters
            .dead_lettered
            .fetch_add(r.failures.dead, Ordering::Relaxed);
        let seconds = r.durable_at.duration_since(r.claimed_at).as_secs_f64();
        self.metrics.committed(r.claimed, seconds, &r.tallies);
        for t in &r.tallies {
            let route = match self.routes.get(t.aggregate_type.as_str()) {
                Some(route) => route,
                None => {
                    // A type's route is fixed for the sink's life: asked once.
                    let route = self.ctx.routes().get(self.sink.route_of(&t.aggregate_type).0);
                    self.routes.entry(t.aggregate_type.clone()).or_insert(route)
                }
            };
            if let Some(route) = route {
                route.booked(t.delivered, t.failed, t.dead, t.error.as_deref());
            }
        }
        debug!(
            batch = r.batch,
            claimed = r.claimed,
            delivered = r.published,
            failed = r.failures.ids.len(),
            seconds,
            "batch committed"
        );
        if let Some(line) = failed_line(r.published, &r.failures, chrono::Utc::now()) {
            warn!(
                batch = r.batch,
                error = r.failures.first_error.as_deref().unwrap_or_default(),
                "{line}"
            );
        }
        if !self.signalled {
            self.signalled = true;
            self.ctx.signal("OUTBOX_BATCH=committed");
        }
    }
}

/// The books of a source that reads several outboxes (a fleet's WAL
/// stream): each receipt booked under its outbox's label, as the polling
/// fleet's relay of that outbox would book it; a receipt of no outbox under
/// the relay's own.
struct Routed {
    own: Books,
    sink: Arc<dyn Sink>,
    by_outbox: std::collections::HashMap<String, Books>,
}

impl Book for Routed {
    fn book(&mut self, r: Receipt) {
        let Some(label) = r.outbox.clone() else {
            self.own.book(r);
            return;
        };
        let books = self.by_outbox.entry(label).or_insert_with_key(|label| {
            // Its signals go nowhere: the fleet signals for the process.
            let (signals, _) = Signals::channel();
            let mut ctx = RelayContext::new(Some(label.clone()), label.clone(), signals);
            // Traced as the fleet is, under the outbox's own label.
            if let Some(tracing) = self.own.ctx.tracing() {
                ctx = ctx.with_tracing(tracing.clone());
            }
            Books::new(&ctx, Arc::clone(&self.sink))
        });
        books.book(r);
    }
}

/// The line of a durable batch in which rows failed (an attempt spent):
/// `8 delivered, 1 will be retried at <time>, 1 dead-lettered`. Every row
/// not delivered is either given back (retried, at its own time: the
/// earliest is named, `from` when they differ) or a dead letter; clauses of
/// no row are left out. None when no row failed: rows that only wait for an
/// unavailable sink are its breaker's to report.
fn failed_line(published: usize, failures: &Failures, now: chrono::DateTime<chrono::Utc>) -> Option<String> {
    if failures.failed == 0 {
        return None;
    }
    let mut line = format!("{published} delivered");
    let retried: Vec<f64> = failures
        .delay_ms
        .iter()
        .zip(&failures.dead_letter)
        .filter(|(_, dead)| !**dead)
        .map(|(ms, _)| *ms)
        .collect();
    if let (Some(first), Some(last)) = (
        retried.iter().copied().reduce(f64::min),
        retried.iter().copied().reduce(f64::max),
    ) {
        // A delay in milliseconds, at most days: exact in an i64.
        #[allow(clippy::cast_possible_truncation)]
        let at = now + chrono::Duration::milliseconds(first.round() as i64);
        let when = if first == last { "at" } else { "from" };
        line.push_str(&format!(
            ", {} will be retried {when} {}",
            retried.len(),
            at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
        ));
    }
    if failures.dead > 0 {
        line.push_str(&format!(", {} dead-lettered", failures.dead));
    }
    Some(line)
}

/// Every loop of the relay ended.
fn stopped(ctx: &RelayContext, relay_up: &metrics::Gauge) {
    ctx.health().running(false);
    relay_up.set(0.0);
    info!("relay stopped");
}

/// A lane besides the relay's own: a sink, how it claims, and the
/// aggregate types it takes.
struct ExtraLane {
    sink: Arc<dyn Sink>,
    claim: ClaimMode,
    types: Vec<String>,
}

impl Relay {
    /// A relay from `pg` ([`crate::pg::parse_url`], or a
    /// `tokio_postgres::Config`) to `sink`. A `metrics` recorder, if any,
    /// must be installed before (see [`crate::metric`]).
    pub fn new(pg: impl Into<PgConfig>, sink: Arc<dyn Sink>, config: RelayConfig) -> Self {
        let mut pg = pg.into();
        // Several hosts: a primary and its standbys, of which the relay
        // needs the primary, and the one promoted after a failover.
        pg.prefer_primary();
        if pg.postgres().get_application_name().is_none() {
            // So operators can tell relays apart in pg_stat_activity.
            pg.postgres_mut().application_name("outbox-relay");
        }
        let ctx = RelayContext::new(
            config.name.clone(),
            config.outbox.display_name().to_string(),
            Signals::Process,
        );
        Self::with_context(pg, sink, config, ctx, false)
    }

    fn with_context(
        pg: PgConfig,
        sink: Arc<dyn Sink>,
        config: RelayConfig,
        ctx: RelayContext,
        in_fleet: bool,
    ) -> Self {
        Self {
            pg,
            metrics: DeliveryMetrics::new(&ctx, sink.as_ref()),
            ctx,
            sink,
            config,
            lanes: Vec::new(),
            in_fleet,
            address: None,
        }
    }

    /// The relay of one outbox of a fleet (see `crate::fleet`), labelled
    /// `label` in its metrics and logs; its signals go nowhere (the fleet
    /// signals for the process).
    pub(crate) fn for_fleet(
        pg: PgConfig,
        sink: Arc<dyn Sink>,
        config: RelayConfig,
        label: String,
        tracing: Option<&crate::trace::Tracing>,
    ) -> Self {
        let (signals, _) = Signals::channel();
        let mut ctx = RelayContext::new(Some(label.clone()), label, signals);
        if let Some(tracing) = tracing {
            ctx = ctx.with_tracing(tracing.clone());
        }
        Self::with_context(pg, sink, config, ctx, true)
    }

    /// Runs one outbox of a fleet until `cancel` fires: the relay's cycle
    /// over a [`TenantSource`].
    pub(crate) async fn run_tenant(
        self,
        tenant: Arc<crate::fleet::Tenant>,
        database: Arc<crate::fleet::Database>,
        statements: outbox::sql::RelayStatements,
        cancel: CancellationToken,
    ) -> Result<(), RelayError> {
        let source = TenantSource::new(
            self.config.clone(),
            self.ctx.clone(),
            tenant,
            database,
            statements,
            Receipts::new(Books::new(&self.ctx, Arc::clone(&self.sink))),
        );
        self.ctx.health().running(true);
        self.metrics.relay_up.set(1.0);
        let (ctx, relay_up) = (self.ctx.clone(), self.metrics.relay_up.clone());
        let result = self.drive(source, cancel).await;
        ctx.health().running(false);
        relay_up.set(0.0);
        debug!("relay stopped");
        result
    }

    /// Runs the log tailing of one database of a fleet until `cancel`
    /// fires: the relay's cycle over a WAL source reading every tenant
    /// outbox `tenants` finds (see `source::wal::fleet`), its batches
    /// booked under their outboxes' labels. `ready` is called once the
    /// source is open (a standby is ready too: it waits for its turn).
    pub(crate) async fn run_wal_fleet(
        self,
        tenants: crate::source::wal::Tenants,
        ready: impl FnOnce() + Send,
        cancel: CancellationToken,
    ) -> Result<(), RelayError> {
        self.sink.bind(&self.ctx);
        let books = Routed {
            own: Books::new(&self.ctx, Arc::clone(&self.sink)),
            sink: Arc::clone(&self.sink),
            by_outbox: Default::default(),
        };
        let source = WalSource::open_fleet(
            self.config.clone(),
            self.pg.clone(),
            tenants,
            self.ctx.clone(),
            Receipts::new(books),
            &cancel,
        );
        let Some(source) = source.await? else {
            return Ok(());
        };
        info!(
            table = %self.config.outbox.table.as_str(),
            sink = %self.sink.describe(),
            source = "wal",
            slot = source.slot(),
            batch_size = self.config.batch_size,
            window = self.config.wal.window,
            "fleet log tailing ready"
        );
        ready();
        self.ctx.health().running(true);
        self.metrics.relay_up.set(1.0);
        let (ctx, relay_up) = (self.ctx.clone(), self.metrics.relay_up.clone());
        let result = self.drive(source, cancel).await;
        stopped(&ctx, &relay_up);
        result
    }

    /// Sends this relay's signals to `signals` instead of the process's
    /// notify socket (a process running several relays, tests).
    #[must_use]
    pub fn with_signals(mut self, signals: Signals) -> Self {
        self.ctx = self.ctx.with_signals(signals);
        self
    }

    /// Traces this relay's batches with `tracing` (see [`crate::trace`]):
    /// a span per batch, its claim, delivery and mark, and one per event
    /// sent. Without it the cycle takes no timing for spans.
    #[must_use]
    pub fn with_tracing(mut self, tracing: crate::trace::Tracing) -> Self {
        self.ctx = self.ctx.with_tracing(tracing);
        self
    }

    /// What this relay owns and reports: its name, outbox, health,
    /// counters and signals.
    pub fn context(&self) -> &RelayContext {
        &self.ctx
    }

    /// Delivers the aggregate types `types` to `sink`, claimed as `claim`
    /// says, in a loop of their own beside the relay's: for routes whose
    /// claim mode differs from the relay's (a slow HTTP route on leases, the
    /// others locked), so a slow route's batches neither hold a transaction
    /// open nor wait with the others'. The relay's own sink takes every
    /// type no lane names. The lanes share the relay's partition leases and
    /// counters. The polling source only: the WAL source has no claim.
    #[must_use]
    pub fn with_lane(mut self, sink: Arc<dyn Sink>, claim: ClaimMode, types: Vec<String>) -> Self {
        self.lanes.push(ExtraLane { sink, claim, types });
        self
    }

    /// Names the sink's address, without secrets ([`crate::redact::url`]),
    /// as the relay's route state shows it. A [`Router`](crate::sink::router::Router)
    /// names its routes' own ([`with_address`](crate::sink::router::Router::with_address)).
    #[must_use]
    pub fn with_sink_address(mut self, address: impl Into<String>) -> Self {
        self.address = Some(address.into());
        self
    }

    /// Totals shared with the running relay.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(self.ctx.counters())
    }

    /// Runs until `cancel` fires, then returns after the batch at the sink is
    /// committed. Fails at startup, or when the WAL source's slot is gone
    /// and `--wal-cleanup none` keeps it from making it again; connection
    /// losses reconnect, failovers included.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), RelayError> {
        self.config.check_ordering()?;
        self.config.check_pooler()?;
        // Route breakers report to this relay's health and gauges; not a
        // fleet's, whose outboxes share their sink (see `run_tenant`).
        if !self.in_fleet {
            if !self.sink.has_route_breakers() {
                // A sink alone is one route, every type's.
                let sink = sink_text(self.sink.name(), self.address.as_deref());
                self.ctx.routes().register(DEFAULT_ROUTE, sink, None);
            }
            self.sink.bind(&self.ctx);
        }
        for lane in &self.lanes {
            lane.sink.bind(&self.ctx);
        }
        match self.config.source {
            SourceKind::Poll => self.run_lanes(cancel).await,
            SourceKind::Wal => {
                let source = WalSource::open(
                    self.config.clone(),
                    self.pg.clone(),
                    self.ctx.clone(),
                    Receipts::new(Books::new(&self.ctx, Arc::clone(&self.sink))),
                    &cancel,
                );
                let Some(source) = source.await? else {
                    return Ok(());
                };
                info!(
                    table = %self.config.outbox.display_name(),
                    sink = %self.sink.describe(),
                    source = "wal",
                    slot = source.slot(),
                    batch_size = self.config.batch_size,
                    window = self.config.wal.window,
                    "relay ready"
                );
                self.started();
                let (ctx, relay_up) = (self.ctx.clone(), self.metrics.relay_up.clone());
                let result = self.drive(source, cancel).await;
                stopped(&ctx, &relay_up);
                result
            }
        }
    }

    /// The polling source's loops, one per lane, on shared partition leases;
    /// the first to fail stops the others.
    async fn run_lanes(mut self, cancel: CancellationToken) -> Result<(), RelayError> {
        let owner = uuid::Uuid::new_v4();
        let extra = std::mem::take(&mut self.lanes);
        let taken: Vec<String> = extra.iter().flat_map(|l| l.types.iter().cloned()).collect();
        let mut loops = Vec::with_capacity(extra.len() + 1);
        for lane in extra {
            let relay = Relay {
                config: RelayConfig {
                    claim: lane.claim,
                    ..self.config.clone()
                },
                pg: self.pg.clone(),
                metrics: DeliveryMetrics::new(&self.ctx, lane.sink.as_ref()),
                sink: lane.sink,
                ctx: self.ctx.clone(),
                lanes: Vec::new(),
                in_fleet: false,
                address: None,
            };
            let lane = Lane {
                spec: ClaimSpec {
                    deadline: lane.claim == ClaimMode::Deadline,
                    types: Some(true),
                },
                types: lane.types,
                owner,
                name_outbox: false,
            };
            loops.push((relay, lane));
        }
        let own = Lane {
            spec: ClaimSpec {
                deadline: self.config.claim == ClaimMode::Deadline,
                types: (!taken.is_empty()).then_some(false),
            },
            types: taken,
            owner,
            name_outbox: self.in_fleet,
        };
        loops.insert(0, (self, own));
        // Every lane connects before the lease task starts: its first tick
        // must record their batch connections, which another relay
        // terminates if it declares this one dead while a batch holds locks.
        let mut opened = Vec::with_capacity(loops.len());
        for (relay, lane) in loops {
            let types = lane.types_display();
            match relay.open_lane(lane, &cancel).await? {
                Some(source) => opened.push((relay, source, types)),
                None => return Ok(()),
            }
        }
        let first = &opened[0].0;
        let mut first_tick = None;
        if let Some(leases) = poll::start_leases(&first.config, &first.pg, &first.ctx, owner) {
            first_tick = Some(leases.first_tick(first.config.drain));
            let mut handles: Vec<_> = (1..opened.len()).map(|_| leases.lane()).collect();
            handles.insert(0, leases);
            for ((_, source, _), handle) in opened.iter_mut().zip(handles) {
                source.attach_leases(handle);
            }
        }
        // Not ready before the first tick: until then nothing is claimed.
        // Shutdown meanwhile goes on to the loops, which stop at once.
        if let Some(tick) = first_tick {
            // Both branches are cancel-safe.
            let ticked = tokio::select! {
                ticked = tick => ticked,
                () = cancel.cancelled() => Ok(()),
            };
            if let Err(error) = ticked {
                for (_, source, _) in &mut opened {
                    source.finish().await;
                }
                return Err(error);
            }
        }
        opened[0].0.started();
        let ctx = opened[0].0.ctx.clone();
        let relay_up = opened[0].0.metrics.relay_up.clone();
        let stop = cancel.child_token();
        let runs = opened.into_iter().map(|(relay, source, types)| {
            let stop = stop.clone();
            async move {
                relay.ready(&source, types);
                let result = relay.drive(source, stop.clone()).await;
                if result.is_err() {
                    stop.cancel();
                }
                result
            }
        });
        let result = futures::future::join_all(runs).await.into_iter().collect();
        stopped(&ctx, &relay_up);
        result
    }

    /// Every loop is connected: READY, once per relay.
    fn started(&self) {
        self.ctx.signal("READY=1\nSTATUS=relay ready");
        self.ctx.health().running(true);
        self.metrics.relay_up.set(1.0);
    }

    /// Connects one lane of the polling source. None if cancelled first.
    async fn open_lane(
        &self,
        lane: Lane,
        cancel: &CancellationToken,
    ) -> Result<Option<PollSource>, RelayError> {
        PollSource::open(
            self.config.clone(),
            self.pg.clone(),
            self.ctx.clone(),
            Receipts::new(Books::new(&self.ctx, Arc::clone(&self.sink))),
            lane,
            cancel,
        )
        .await
    }

    /// The lane's `relay ready` line.
    fn ready(&self, source: &PollSource, types: Option<String>) {
        if self.config.notify && !self.config.listens() {
            info!(
                poll_interval_ms = u64::try_from(self.config.poll_interval.as_millis()).unwrap_or(u64::MAX),
                "no LISTEN through a transaction-mode pooler: new events are found by polling \
                 (give --listen-url, a direct connection, to be woken at once)"
            );
        }
        info!(
            table = %self.config.outbox.display_name(),
            sink = %self.sink.describe(),
            batch_size = self.config.batch_size,
            notify = self.config.listens(),
            ordering = %self.config.ordering,
            ordering_for = %self.config.ordering_for_display(),
            claim = %self.config.claim,
            pooler = %self.config.pooler,
            // No field at all unless the relay has lanes.
            types,
            // A bare UUID, and no field at all under `--ordering none`.
            relay_id = source.relay_id().map(tracing::field::display),
            "relay ready"
        );
    }

    /// The loop over cycles, from READY until shutdown.
    async fn drive(self, mut source: impl Source, cancel: CancellationToken) -> Result<(), RelayError> {
        let started = Instant::now();
        let mut blocked = Blocked::default();
        let mut breaker = Breaker::new(self.sink.name(), None);
        if self.sink.has_route_breakers() {
            // The routes' breakers report; this one only pauses the claim.
            breaker = breaker.over_routes();
        } else {
            breaker.bind(&self.ctx);
        }
        // The relay starts whether or not the sink is up, and says which.
        match self.sink.probe().await {
            Ok(()) if self.in_fleet => debug!(sink = %self.sink.describe(), "sink reachable"),
            Ok(()) => info!(sink = %self.sink.describe(), "sink reachable"),
            // A drain lets its first batch find out, and stops there.
            Err(error) if self.config.drain => {
                warn!(sink = %self.sink.describe(), %error, "sink not reachable")
            }
            Err(error) => breaker.open(&error.to_string()),
        }
        // A sink alone is paused by not claiming, as while its breaker is
        // open: answering its rows unavailable would count strikes against
        // a sink that said nothing (a router answers its paused routes).
        let own_route = match self.sink.has_route_breakers() {
            true => None,
            false => self.ctx.routes().get(DEFAULT_ROUTE),
        };
        let mut fatal = None;
        while !cancel.is_cancelled() {
            if let Some(route) = own_route.as_ref().filter(|r| r.is_paused()) {
                blocked.clear();
                let cause = format!("route {} is paused", route.name());
                if !self.pause(&mut source, Some(&cause), &cancel).await {
                    break;
                }
                // Both are cancel-safe.
                tokio::select! {
                    () = route.resumed() => continue,
                    () = cancel.cancelled() => break,
                }
            }
            if breaker.state() == CircuitState::Open
                && let Probed::Cancelled = breaker.wait(self.sink.as_ref(), &cancel).await
            {
                break;
            }
            match self
                .cycle(
                    &mut source,
                    &mut blocked,
                    &mut breaker,
                    own_route.as_deref(),
                    &cancel,
                )
                .await
            {
                Ok(Step::Continue) => {}
                Ok(Step::Unavailable) => {
                    blocked.clear();
                    if !self.pause(&mut source, breaker.cause(), &cancel).await {
                        break;
                    }
                }
                Ok(Step::Cancelled) => break,
                Ok(Step::Drained) => {
                    let counters = self.ctx.counters();
                    info!(
                        delivered = counters.delivered.load(Ordering::Relaxed),
                        batches = counters.batches.load(Ordering::Relaxed),
                        seconds = started.elapsed().as_secs_f64(),
                        "relay drained"
                    );
                    break;
                }
                Err(SourceError::Fatal(error)) => {
                    fatal = Some(error);
                    break;
                }
                Err(error) => {
                    // Everything in flight was given back, so nothing
                    // blocked by it is in flight either.
                    blocked.clear();
                    if !source.recover(error, &cancel).await {
                        break;
                    }
                }
            }
        }
        source.finish().await;
        fatal.map_or(Ok(()), Err)
    }

    /// After a batch the sink was unavailable for (`cause`), or while the
    /// route of a sink alone is paused: claims nothing more meanwhile. Commits the outcomes (no attempt spent) and gives
    /// back the batch claimed ahead, so no transaction stays open; the loop
    /// then waits on the breaker. False when the relay should stop: a drain
    /// cannot wait, and records why it stopped.
    async fn pause(&self, source: &mut impl Source, cause: Option<&str>, cancel: &CancellationToken) -> bool {
        if let Err(error) = source.hold().await {
            return source.recover(error, cancel).await;
        }
        if !self.config.drain {
            return true;
        }
        let cause = cause.unwrap_or("a route's sink is unavailable");
        warn!(
            sink = %self.sink.describe(),
            error = cause,
            "relay drain stopped: the sink is unavailable, due rows are left undelivered"
        );
        let _ = self
            .ctx
            .counters()
            .sink_unavailable
            .set(format!("{}: {cause}", self.sink.describe()));
        false
    }

    /// One batch, top to bottom. `blocked` carries the aggregates the last
    /// batch failed, whose later events must not overtake the failure;
    /// `own_route` is a sink alone's route (None behind a router), whose
    /// pause gives a claimed batch back unsent.
    async fn cycle(
        &self,
        source: &mut impl Source,
        blocked: &mut Blocked,
        breaker: &mut Breaker,
        own_route: Option<&RouteStatus>,
        cancel: &CancellationToken,
    ) -> Result<Step, SourceError> {
        // 1. Wait and claim: the rows are locked and provisionally marked
        //    published in a transaction nobody else sees.
        let batch = match source.claim(cancel).await? {
            Claim::Batch(batch) => batch,
            Claim::Empty => return Ok(Step::Continue),
            Claim::Drained => return Ok(Step::Drained),
            Claim::Cancelled => return Ok(Step::Cancelled),
        };
        if !batch.overlapped {
            // Claimed after every earlier batch committed: rows behind a
            // failure are not due yet, so nothing needs holding back.
            blocked.clear();
        }
        if !source.may_deliver() {
            // Another relay may own these rows now: send nothing.
            blocked.clear();
            source.give_back().await?;
            return Ok(Step::Continue);
        }
        if own_route.is_some_and(RouteStatus::is_paused) {
            // Paused while this claim waited for work (a heartbeat read
            // the pause meanwhile): give the rows back unsent, no attempt
            // spent; the loop's top holds until the route is resumed.
            blocked.clear();
            source.give_back().await?;
            return Ok(Step::Continue);
        }

        // 2. Deliver what no earlier failure holds back and is not too
        //    large. Meanwhile the source commits the previous batch and
        //    claims the next.
        let screened = plan::screen(&batch.rows, &batch.unreadable, blocked, self.max_event_bytes());
        let sendable = screened.sendable(&batch.rows);
        let to_send = sendable.as_deref().unwrap_or(&batch.rows);
        // Timings for spans only while tracing is on: one check per batch.
        let traced = self.ctx.tracing().is_some();
        let delivering = traced.then(Instant::now);
        let (mut sent, overlapped) =
            tokio::join!(self.deliver(to_send, source.lapse()), source.overlap(batch.full),);
        let trace = delivering.map(|started| {
            let deliver = (started, Instant::now());
            Box::new(BatchTrace::new(
                self.sink.as_ref(),
                batch.claim,
                deliver,
                to_send,
                &sent,
            ))
        });
        let open = breaker.record(&mut sent);
        let answers = screened.merge(batch.rows.len(), sent);
        if let Some(failpoint) = self.config.failpoint {
            let acked = answers
                .iter()
                .filter(|a| matches!(a, plan::Outcome::Sent(Ok(()))))
                .count();
            failpoint.park(batch.rows.len(), acked, self.ctx.signals()).await;
        }
        overlapped?;

        // 3. Mark: what became of each row, and when failed rows come due.
        let mut plan = plan::plan(
            self.config.backoff,
            self.sink.as_ref(),
            &batch.rows,
            answers,
            blocked,
        );
        *blocked = std::mem::take(&mut plan.blocked);
        plan.trace = trace;
        // A drain stops at the first sink outage, even of one route: it
        // cannot wait for the route to come back, and must say so.
        let pause = open || (self.config.drain && plan.failures.unavailable > 0);

        // 4. Commit: the source makes the outcomes durable in the next round
        //    trip on the batch's connection. Until then a crash redelivers.
        source.settle(plan);
        Ok(if pause { Step::Unavailable } else { Step::Continue })
    }

    /// Sends `rows`, unless the source stops vouching for them first
    /// (`lapse`): then every row is a retryable failure, so another relay
    /// never delivers an aggregate while this one still is.
    async fn deliver(&self, rows: &[OutboxRow], lapse: BoxFuture<'static, ()>) -> Vec<Delivery> {
        if rows.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        // `deliver` is polled to completion or dropped with the batch, which
        // is then given back unmarked: dropping it loses nothing.
        tokio::select! {
            answers = self.sink.deliver(rows) => {
                if let Some(request) = &self.metrics.sink_request {
                    request.record(started.elapsed().as_secs_f64());
                }
                self.metrics.lag.record(rows, &answers, chrono::Utc::now());
                answers
            }
            () = lapse => {
                warn!(
                    rows = rows.len(),
                    "the lease ran out during delivery; the batch is abandoned"
                );
                rows.iter()
                    .map(|_| {
                        Err(DeliveryError::retryable(
                            "abandoned: this relay's lease ran out during delivery",
                        ))
                    })
                    .collect()
            }
        }
    }

    /// The largest payload sent: `--max-event-bytes`, or the sink's own
    /// limit where it is lower and the sink knows it.
    fn max_event_bytes(&self) -> u64 {
        let own = self.sink.max_event_bytes().unwrap_or(u64::MAX);
        self.config.max_event_bytes.min(own)
    }
}

#[cfg(test)]
mod tests;
