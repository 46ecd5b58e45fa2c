//! The polling source: `FOR UPDATE SKIP LOCKED` claims over two connections,
//! restricted to the partitions this relay leases, woken by LISTEN/NOTIFY,
//! a retry timer, a lease tick or the fallback poll.
//!
//! # The two-connection overlap
//!
//! Each batch lives in a transaction of its own connection. While the batch
//! on one connection is at the sink, the other connection, in one round
//! trip, marks the previous batch's failures, commits it, and (when the
//! batch at the sink was full) begins and claims the next. So a relay
//! working through a backlog pays one PostgreSQL round trip and one sink
//! round trip per batch. The [`Pipeline`] holds the three batches this
//! involves and keeps one invariant:
//!
//! > at most one transaction is open per connection, and the batch at the
//! > sink is never on the connection whose commit is in flight.
//!
//! A batch claimed during the previous one's delivery may hold later events
//! of aggregates that batch failed, which is why [`Batch::overlapped`] tells
//! the relay to hold them back.
//!
//! # Deadline claims
//!
//! With `--claim deadline` the same pipeline runs without transactions: the
//! claim writes a deadline on its rows and commits at once (it is its own
//! statement), and the marks of a settled batch are one statement that
//! checks the claim is still this relay's ([`Fence`]). So no transaction,
//! and no snapshot, is open while a batch is at the sink. The batch is
//! vouched for until its deadline rather than by the partition lease: a
//! partition may move meanwhile, and the claim's probe keeps the new owner
//! behind this relay's claims (`CLAIM_PROBE` in `outbox::sql`).
//!
//! What differs between the two claims (how a round trip marks and claims,
//! how a batch is given back, whether its connection holds locks) is in
//! [`claim`]: [`ByLock`] and [`ByDeadline`] behind [`Claiming`]. This
//! module owns the pipeline, the connections and the waiting, the same for
//! both.
//!
//! # The claim floor
//!
//! Claims walk the partial index from a floor rather than from its start,
//! so rows published since the oldest snapshot still held (whose index
//! entries vacuum cannot remove yet) are not visited again and again.
//! [`floor`] keeps it: when it rises, and which events make the next claim
//! a sweep from 0. This module reports those events to it and sends the
//! floor statement in a claim's round trip when it asks.

use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::sql::{
    ClaimParams, ClaimScope, ClaimSpec, ClaimedRows, Fence, OutboxSql, Partitions, RelayStatements, Strict,
};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

mod claim;
mod floor;

use self::claim::{Ask, ByDeadline, ByLock, Claiming, RoundTrip};
pub use self::floor::SETTLE as CLAIM_FLOOR_SETTLE;
use self::floor::{Asked, Floor};
use super::{Batch, Claim, Outcomes, Receipts, Source, SourceError};
use crate::config::{OrderMode, Pooler, RelayConfig};
use crate::context::RelayContext;
use crate::error::{RelayError, error_chain, needs_operator, transaction_pooler};
use crate::lease::{LeaseSettings, Leases};
use crate::metric::{WakeCause, WakeMetrics};
use crate::pg::{PgConfig, Startup};
use crate::plan::Plan;
use crate::wake::{self, Wake, Wakeups};

/// One connection with its statements and notifications.
struct Session {
    client: Client,
    /// (pid, backend start), recorded in the relays table; None through a
    /// transaction-mode pooler, whose server connections are not the
    /// relay's to terminate.
    backend: Option<(i32, chrono::DateTime<chrono::Utc>)>,
    wakeups: Wakeups,
    statements: RelayStatements,
}

/// The source's two connections, by role. Batches alternate between them
/// while a backlog lasts.
struct Sessions {
    /// LISTENs (unless through a transaction-mode pooler), and takes every
    /// fresh claim (one after a wait).
    listening: Session,
    /// Takes the claims made while a batch of the listening one is at the
    /// sink, and its claims alternate with it while the backlog lasts.
    other: Session,
    /// Through a transaction-mode pooler, with `--listen-url`: a direct
    /// connection that only LISTENs, whose notifications wake the relay.
    listener: Option<Listener>,
}

/// A connection kept open only for its notifications.
struct Listener {
    /// Kept so the connection stays open.
    _client: Client,
    wakeups: Wakeups,
}

/// Which of the two [`Sessions`] a batch lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conn {
    Listening,
    Other,
}

impl Conn {
    /// The connection the next batch goes to while this one is at the sink.
    fn other(self) -> Self {
        match self {
            Self::Listening => Self::Other,
            Self::Other => Self::Listening,
        }
    }
}

impl Sessions {
    fn get(&self, conn: Conn) -> &Session {
        match conn {
            Conn::Listening => &self.listening,
            Conn::Other => &self.other,
        }
    }

    fn both(&self) -> [&Session; 2] {
        [&self.listening, &self.other]
    }

    /// The notifications that wake the relay: the listener's, else the
    /// listening session's (none arrive there through a transaction-mode
    /// pooler: it does not LISTEN).
    fn wakeups(&mut self) -> &mut Wakeups {
        match &mut self.listener {
            Some(listener) => &mut listener.wakeups,
            None => &mut self.listening.wakeups,
        }
    }
}

/// A batch claimed during the last delivery, not yet handed out.
struct Claimed {
    conn: Conn,
    rows: ClaimedRows,
    /// The lease epoch it was claimed in (0 without leases).
    epoch: u64,
    /// When its claim was sent: a deadline claim's deadline counts from here.
    sent: Instant,
    /// When the claim's round trip was answered.
    answered: Instant,
}

/// A deadline claim in flight: its fence, its rows, and the local instant
/// by which it must be marked (before the server's deadline: the claim
/// was written after it was sent).
struct Held {
    fence: Fence,
    ids: Vec<i64>,
    deadline: Instant,
}

/// The batch at the sink.
struct AtSink {
    batch: u64,
    conn: Conn,
    epoch: u64,
    rows: usize,
    started: Instant,
    held: Option<Held>,
}

/// A batch whose outcomes are known, waiting for its marks and COMMIT.
struct Settled {
    batch: u64,
    conn: Conn,
    claimed: usize,
    outcomes: Outcomes,
    started: Instant,
    held: Option<Held>,
}

/// How a source claims: the statements' rendering, the types it takes or
/// leaves, and the id a deadline claim is written under (the relay's id in
/// the lease table, when it takes leases).
pub(crate) struct Lane {
    pub(crate) spec: ClaimSpec,
    pub(crate) types: Vec<String>,
    pub(crate) owner: Uuid,
    /// The relay serves a fleet's outbox split (see `crate::fleet`): every
    /// event carries the `outbox` header, as the fleet's others do.
    pub(crate) name_outbox: bool,
}

impl Lane {
    /// The types it takes, for its `relay ready` line; None when it takes
    /// every type.
    pub(crate) fn types_display(&self) -> Option<String> {
        match self.spec.types {
            None => None,
            Some(true) => Some(self.types.join(",")),
            Some(false) => Some(format!("all but {}", self.types.join(","))),
        }
    }
}

/// The batches in flight across the two connections (see the module docs
/// for the invariant).
#[derive(Default)]
struct Pipeline {
    /// Claimed on its connection during the last delivery.
    prefetched: Option<Claimed>,
    /// Handed out by the last claim.
    at_sink: Option<AtSink>,
    /// Delivered and planned; committed by the next round trip on its
    /// connection.
    settled: Option<Settled>,
    /// The last claim was neither full nor cut by the byte bound: wait for
    /// a wake-up before the next.
    idle: bool,
}

/// The polling source. Open with [`PollSource::open`].
pub(crate) struct PollSource {
    config: RelayConfig,
    pg: PgConfig,
    sql: OutboxSql,
    ctx: RelayContext,
    /// The lane's name in the relay's health (`""` for the relay's own).
    lane: String,
    /// See [`Lane::name_outbox`].
    name_outbox: bool,
    wake_metrics: WakeMetrics,
    receipts: Receipts,
    /// None after a lost connection, until the next claim reconnects.
    sessions: Option<Sessions>,
    pipeline: Pipeline,
    /// The earliest `next_attempt_at` this relay set, so it wakes for the
    /// retry instead of waiting out the fallback poll.
    earliest_retry: Option<Instant>,
    /// Partition leases, unless the ordering is `None`.
    leases: Option<Leases>,
    /// The aggregate types whose ordering is not the default, and whether
    /// the default is strict.
    exceptions: Vec<String>,
    default_strict: bool,
    /// The aggregate types its claims take or leave (`ClaimSpec::types`).
    types: Vec<String>,
    /// By lock or by deadline.
    claiming: Box<dyn Claiming>,
    /// Where claims start (see [`floor`]).
    floor: Floor,
    /// The partitions the last claim was for, and their epoch: a change
    /// makes the next claim a sweep.
    partitions_seen: (Vec<i32>, u64),
    /// Batches failing in a row with one error (see [`Streak`]).
    streak: Streak,
    /// A batch failed on a sign of a transaction-mode pooler in front of a
    /// relay run without `--pooler transaction`, or a `--drain` relay's
    /// batch was refused for a reason no retry fixes: the next claim stops
    /// the relay with it.
    pooler: Option<RelayError>,
}

/// Batches that failed in a row with the same error. A few of them make the
/// relay unready and say so at error level, once, instead of retrying in
/// silence for ever; a committed batch makes it ready again.
#[derive(Debug, Default)]
struct Streak {
    /// The last failure's error chain.
    error: String,
    /// How many batches in a row failed with it.
    count: u32,
}

impl Streak {
    /// Failures in a row with one error that make the relay unready.
    const UNREADY_AFTER: u32 = 3;

    /// Counts a failure; true when this one makes the streak long enough
    /// to report (once per streak).
    fn failed(&mut self, error: &str) -> bool {
        if self.error == error {
            self.count += 1;
        } else {
            self.error = error.to_owned();
            self.count = 1;
        }
        self.count == Self::UNREADY_AFTER
    }

    /// A batch committed: the streak is over. True if it had been reported.
    fn broken(&mut self) -> bool {
        let reported = self.count >= Self::UNREADY_AFTER;
        *self = Streak::default();
        reported
    }
}

/// What a round trip's claim needs of the floor: where it starts, and the
/// floor statement if due.
#[derive(Clone, Copy)]
struct FloorUse {
    at: i64,
    asked: Option<Asked>,
}

impl PollSource {
    /// Connects (retrying until the connect timeout; a schema problem fails
    /// at once). None if cancelled first. The partition leases, if any,
    /// come with [`PollSource::attach_leases`].
    pub(crate) async fn open(
        config: RelayConfig,
        pg: PgConfig,
        ctx: RelayContext,
        receipts: Receipts,
        lane: Lane,
        cancel: &CancellationToken,
    ) -> Result<Option<Self>, RelayError> {
        let sql = OutboxSql::with_claims(&config.outbox, lane.spec);
        let exceptions = config
            .ordering_for
            .iter()
            .filter(|(_, mode)| *mode != config.ordering)
            .map(|(t, _)| t.clone())
            .collect();
        let claiming: Box<dyn Claiming> = if lane.spec.deadline {
            Box::new(ByDeadline {
                claimer: lane.owner,
                claimed: Default::default(),
                abandoned: Vec::new(),
                timeout: config.claim_timeout,
                claims_lost: metrics::counter!(crate::metric::CLAIMS_LOST, &[ctx.label()]),
            })
        } else {
            Box::new(ByLock)
        };
        // The relay's own lane reports its floor; a lane of routes keeps
        // its own, unreported.
        let gauge = lane
            .spec
            .types
            .is_none_or(|take| !take)
            .then(|| metrics::gauge!(crate::metric::CLAIM_FLOOR, &[ctx.label()]));
        let mut source = Self {
            floor: Floor::new(gauge, Instant::now()),
            partitions_seen: (Vec::new(), 0),
            default_strict: config.ordering == OrderMode::Strict,
            exceptions,
            config,
            pg,
            sql,
            lane: lane
                .types_display()
                .map(|t| format!("lane {t}"))
                .unwrap_or_default(),
            name_outbox: lane.name_outbox,
            wake_metrics: WakeMetrics::new(&ctx),
            claiming,
            ctx,
            receipts,
            sessions: None,
            pipeline: Pipeline::default(),
            earliest_retry: None,
            leases: None,
            types: lane.types,
            streak: Streak::default(),
            pooler: None,
        };
        let Some(sessions) = source.connect_at_startup(cancel).await? else {
            return Ok(None);
        };
        source.use_sessions(sessions);
        Ok(Some(source))
    }

    /// Claims under `leases` from now on, and records the connections for
    /// their next tick (before the first one: the caller has not yielded
    /// since starting them).
    pub(crate) fn attach_leases(&mut self, leases: Leases) {
        self.leases = Some(leases);
        if let Some(sessions) = self.sessions.take() {
            self.use_sessions(sessions);
        }
    }

    /// This relay's id in the lease table, if it takes leases.
    pub(crate) fn relay_id(&self) -> Option<Uuid> {
        self.leases.as_ref().map(Leases::relay_id)
    }

    fn use_sessions(&mut self, sessions: Sessions) {
        // A deadline claim holds no lock across delivery: nothing for another
        // relay to terminate if this one is declared dead. Nor may anything
        // behind a transaction-mode pooler be (`backend` is None there).
        if let Some(leases) = self.leases.as_ref().filter(|_| self.claiming.holds_locks()) {
            leases.set_backends(sessions.both().iter().filter_map(|s| s.backend).collect());
        }
        self.ctx.health().postgres(&self.lane, None);
        self.sessions = Some(sessions);
        // Whatever was in flight on the old connections was rolled back.
        self.floor.sweep_next();
    }

    /// Whether any aggregate type is held to strict order.
    fn any_strict(&self) -> bool {
        self.config.ordering == OrderMode::Strict
            || self
                .config
                .ordering_for
                .iter()
                .any(|(_, m)| *m == OrderMode::Strict)
    }

    /// The lease epoch a claim made now belongs to.
    fn lease_epoch(&self) -> u64 {
        self.leases.as_ref().map_or(0, |l| l.view().epoch)
    }

    /// Whether the leases say this relay holds no partition (after the first
    /// tick), so a `--drain` relay has nothing left to do.
    fn holds_nothing(&self) -> bool {
        self.leases.as_ref().is_some_and(|l| {
            let view = l.view();
            view.count > 0 && view.claimable.is_empty()
        })
    }

    /// The connections, reconnecting first if they were lost. None if
    /// cancelled while reconnecting.
    async fn sessions(&mut self, cancel: &CancellationToken) -> Result<Option<&mut Sessions>, SourceError> {
        if self.sessions.is_none() {
            let Some(sessions) = self.reconnect(cancel).await? else {
                return Ok(None);
            };
            self.use_sessions(sessions);
        }
        Ok(self.sessions.as_mut())
    }

    /// Stops the relay if the lease task found a transaction-mode pooler in
    /// front (see `error::transaction_pooler`), and a `--drain` relay whose
    /// lease tick is refused for a reason no retry fixes (its `fault`).
    fn check_lease_pooler(&self) -> Result<(), SourceError> {
        let Some(view) = self.leases.as_ref().map(Leases::view) else {
            return Ok(());
        };
        if let Some(sign) = view.pooler_sign.clone() {
            return Err(self.pooler_found(RelayError::TransactionPooler { sign }));
        }
        match view.fault.clone() {
            Some(fault) if self.config.drain => Err(self.pooler_found(RelayError::Drain {
                reason: format!("the lease tick failed: {fault}"),
            })),
            _ => Ok(()),
        }
    }

    /// A transaction-mode pooler sits in front of a relay run without
    /// `--pooler transaction`: unready, and stopping with `error`.
    fn pooler_found(&self, error: RelayError) -> SourceError {
        self.ctx.health().postgres(&self.lane, Some(error.to_string()));
        SourceError::Fatal(error)
    }

    /// Commits the settled batch on its own, before a wait or a fresh claim.
    async fn commit_settled(&mut self) -> Result<(), SourceError> {
        let Some(mut settled) = self.pipeline.settled.take() else {
            return Ok(());
        };
        settled.outcomes.marking();
        let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
        let done = self.round_trip(ss.get(settled.conn), Some(settled), None).await?;
        self.committed(done.settled);
        Ok(())
    }

    /// Sleeps until a notification, a due retry, a lease tick that found
    /// work, the fallback poll, or shutdown.
    async fn wait(&mut self, cancel: &CancellationToken) -> Result<bool, SourceError> {
        let (wait, timer) = self.next_wait();
        let ss = self.sessions.as_mut().ok_or(SourceError::ConnectionLost)?;
        let wakeups = ss.wakeups();
        let woken = async {
            match &self.leases {
                Some(leases) => leases.woken().await,
                None => std::future::pending().await,
            }
        };
        // Both branches are cancel-safe: `wait` loses no notification and
        // `woken` is a `Notify` permit, kept if not consumed.
        let (wake, cause) = tokio::select! {
            wake = wakeups.wait(wait, cancel) => (wake, WakeCause::Notify),
            () = woken => (Wake::Notified, WakeCause::Lease),
        };
        match wake {
            Wake::Cancelled => Ok(false),
            Wake::ConnectionLost => Err(SourceError::ConnectionLost),
            Wake::Notified => {
                self.wake_metrics.woke(cause);
                if cause == WakeCause::Lease {
                    // The tick found due rows: perhaps below the floor
                    // (another relay's retries, in a partition gained).
                    self.floor.sweep_next();
                }
                Ok(true)
            }
            Wake::Timer => {
                self.wake_metrics.woke(timer);
                // A retry came due or the fallback poll: either may be
                // for rows below the floor.
                self.floor.sweep_next();
                Ok(true)
            }
        }
    }

    /// Where the next claim starts, and whether its round trip carries the
    /// floor statement; first tells the floor what happened that makes the
    /// claim a sweep (partitions changed, a notification asked for one).
    fn floor_for_claim(&mut self) -> FloorUse {
        if let Some(leases) = &self.leases {
            let view = leases.view();
            if view.claimable != self.partitions_seen.0 || view.epoch != self.partitions_seen.1 {
                self.partitions_seen = (view.claimable.clone(), view.epoch);
                self.floor.sweep_next();
            }
        }
        if self.sessions.as_mut().is_some_and(|ss| ss.wakeups().take_sweep()) {
            self.floor.sweep_next();
        }
        let now = Instant::now();
        let at = self.floor.for_claim(now);
        FloorUse {
            at,
            asked: self.floor.ask(now),
        }
    }

    /// What the floor statement of a round trip found, if it was sent.
    fn floor_found(&mut self, use_: Option<FloorUse>, trip: &mut RoundTrip) {
        let (Some(asked), Some(found)) = (use_.and_then(|u| u.asked), trip.floor.take()) else {
            return;
        };
        match found {
            Ok(found) => self.floor.found(asked, found, Instant::now()),
            // The floor stays where it was, which is still correct.
            Err(error) => warn!(error = %error_chain(&error), "finding the claim floor"),
        }
    }

    /// On one connection, in one round trip: the outcomes of `settled` (if
    /// any) made durable, then, with `claim`, the floor statement if due and
    /// the next claim from the floor (see [`Claiming::round_trip`]).
    async fn round_trip(
        &self,
        s: &Session,
        settled: Option<Settled>,
        claim: Option<FloorUse>,
    ) -> Result<RoundTrip, SourceError> {
        let lease = self.leases.as_ref().map(|l| (l.relay_id(), l.view()));
        let params = ClaimParams {
            types: &self.types,
            deadline: self.claiming.deadline(),
            floor: claim.map_or(0, |c| c.at),
            limit: i64::from(self.config.batch_size),
            max_bytes: i64::try_from(self.config.batch_max_bytes).unwrap_or(i64::MAX),
            scope: match &lease {
                None => ClaimScope::All,
                Some((relay_id, view)) => ClaimScope::Partitions(Partitions {
                    relay_id: *relay_id,
                    claimable: &view.claimable,
                    count: i64::from(view.count),
                    strict: self.any_strict().then_some(Strict {
                        by_default: self.default_strict,
                        exceptions: &self.exceptions,
                    }),
                }),
            },
        };
        // Holding no partition, there is nothing to claim: no transaction.
        // With the lease lapsed, a batch could not be sent: none either.
        let claim = claim.filter(|_| {
            lease
                .as_ref()
                .is_none_or(|(_, v)| !v.claimable.is_empty() && v.is_valid())
        });
        let floor = claim.and_then(|c| c.asked).map(|a| a.params);
        let ask = Ask {
            claim: claim.map(|_| &params),
            floor: floor.as_ref(),
        };
        self.claiming.round_trip(s, settled, ask).await
    }

    /// Gives a batch on `conn` back unsent (see [`Claiming::release`]);
    /// `held`: a deadline claim's row ids and fence. Its rows are due again,
    /// perhaps below the floor (a deadline claim's were passed as not due):
    /// the next claim sweeps.
    async fn release(&mut self, conn: Conn, held: Option<(&[i64], Fence)>) -> Result<(), SourceError> {
        self.floor.sweep_next();
        let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
        self.claiming.release(ss.get(conn), held).await
    }

    /// Gives back a batch claimed ahead, not handed out.
    async fn release_claimed(&mut self, claimed: &Claimed) -> Result<(), SourceError> {
        let ids: Vec<i64> = claimed.rows.rows.iter().map(|r| r.id).collect();
        let lease = claimed.rows.fence.map(|fence| (ids.as_slice(), fence));
        self.release(claimed.conn, lease).await
    }

    /// A batch was committed: wakes for its soonest retry, tells the floor
    /// when each of its failed rows comes due, and makes its receipt.
    fn committed(&mut self, done: Option<Settled>) {
        let Some(d) = done else { return };
        if self.streak.broken() {
            info!("a batch committed again; the relay is ready");
            self.ctx.health().postgres(&self.lane, None);
        }
        if let Some(soonest) = d.outcomes.failures.soonest {
            // Measured from after the commit, so the wake-up is never before
            // the time PostgreSQL recorded.
            let now = Instant::now();
            self.retry_at(now + soonest);
            let f = &d.outcomes.failures;
            let mut delays: Vec<f64> = f
                .delay_ms
                .iter()
                .zip(&f.dead_letter)
                .filter(|(_, dead)| !**dead)
                .map(|(ms, _)| *ms)
                .collect();
            delays.sort_unstable_by(f64::total_cmp);
            delays.dedup();
            for ms in delays {
                self.floor
                    .retry_at(now + Duration::from_secs_f64(ms.max(0.0) / 1000.0));
            }
        }
        self.receipts.durable(d.batch, d.claimed, d.started, d.outcomes);
    }

    /// Wakes for a retry due at `at`, unless one is due sooner. A wake-up
    /// already in the past was spent by the claim that came before: keeping
    /// it would win every `min` and drop this retry to the next poll.
    fn retry_at(&mut self, at: Instant) {
        let pending = self.earliest_retry.filter(|e| *e > Instant::now());
        self.earliest_retry = Some(pending.map_or(at, |e| e.min(at)));
    }

    /// How long to sleep, and what it means if the sleep runs out: the
    /// fallback poll, or less if a retry is due sooner.
    /// With leases, the lease tick (at least once per poll interval) reports
    /// due rows and wakes the relay, so there is no poll of its own: an idle
    /// poll costs the tick's one short transaction, not a second for a claim.
    fn next_wait(&mut self) -> (Duration, WakeCause) {
        let poll = if self.leases.is_some() {
            NO_POLL
        } else {
            wake::jittered(self.config.poll_interval)
        };
        // The floor keeps every retry time this source set, not only the
        // soonest, until a claim sweeps for it: an idle relay wakes for each.
        let floor_retry = self.floor.next_retry();
        match self.earliest_retry.into_iter().chain(floor_retry).min() {
            Some(at) => {
                let until = at.saturating_duration_since(Instant::now());
                if until.is_zero() {
                    self.earliest_retry = None;
                }
                if until < poll {
                    (until, WakeCause::Retry)
                } else {
                    (poll, WakeCause::Poll)
                }
            }
            None => (poll, WakeCause::Poll),
        }
    }

    /// Sets one batch connection up as a session; `listen`: the one that
    /// LISTENs (on a session of its own) and checks the schema. `backend`:
    /// its identity, unless through a transaction-mode pooler.
    async fn set_up(
        &self,
        (client, wakeups): (Client, Wakeups),
        backend: Option<(i32, chrono::DateTime<chrono::Utc>)>,
        listen: bool,
    ) -> Result<Session, SessionError> {
        let statements = match self.config.pooler {
            Pooler::Transaction => {
                if listen {
                    // tokio-postgres prepares the check's statements and
                    // closes them after use: in one transaction, that is
                    // all on one server connection.
                    client.batch_execute("BEGIN").await?;
                    outbox::check(&client, &self.config.outbox)
                        .await
                        .map_err(SessionError::Schema)?;
                    client.batch_execute("COMMIT").await?;
                }
                self.sql.unprepared_relay(self.config.lease_timeout).await?
            }
            Pooler::None => {
                // One transaction: outside one, each statement prepared
                // (Parse, Sync) commits one of its own, 15 per session, which
                // PostgreSQL 15 publishes late enough to pass for idle cost
                // (tests/it/idle.rs). A SET in it outlives its commit; a
                // LISTEN starts with it.
                client.batch_execute("BEGIN").await?;
                let channel = (listen && self.config.notify).then_some(&self.config.outbox.channel);
                outbox::sql::setup_batch_session(&client, channel).await?;
                if listen {
                    outbox::check(&client, &self.config.outbox)
                        .await
                        .map_err(SessionError::Schema)?;
                }
                let statements = self.sql.prepare_relay(&client).await?;
                client.batch_execute("COMMIT").await?;
                statements
            }
        };
        Ok(Session {
            client,
            backend,
            wakeups,
            statements,
        })
    }

    /// Both connections (and the listener, if any), then when the next
    /// retry is due.
    async fn open_sessions(&mut self) -> Result<Sessions, SessionError> {
        let listening = wake::connect(&self.pg).await?;
        let other = wake::connect(&self.pg).await?;
        let (a, b) = match self.config.pooler {
            Pooler::Transaction => (None, None),
            Pooler::None => {
                // Two sessions of one relay never share a server connection,
                // unless a transaction-mode pooler hands each transaction
                // whichever is free. Both identities are read one after the
                // other, each its own transaction, before anything (a named
                // statement, a SET) is left on either session: PgBouncer
                // hands the second the server connection the first just
                // freed, so this catches it in most cases.
                let a = outbox::sql::backend_identity(&listening.0).await?;
                let b = outbox::sql::backend_identity(&other.0).await?;
                if a.0 == b.0 {
                    return Err(SessionError::Pooler(RelayError::TransactionPooler {
                        sign: format!(
                            "the relay's two batch connections ran on one server connection (backend pid {})",
                            a.0
                        ),
                    }));
                }
                (Some(a), Some(b))
            }
        };
        let listening = self.set_up(listening, a, true).await?;
        let other = self.set_up(other, b, false).await?;
        let listener = match (&self.config.listen, self.config.notify, self.config.pooler) {
            (Some(pg), true, Pooler::Transaction) => {
                let (client, wakeups) = wake::connect(pg).await?;
                outbox::sql::listen(&client, &self.config.outbox.channel).await?;
                Some(Listener {
                    _client: client,
                    wakeups,
                })
            }
            _ => None,
        };
        self.learn_next_retry(&listening).await;
        if let Some(found) = self.pooler.take() {
            return Err(SessionError::Pooler(found));
        }
        Ok(Sessions {
            listening,
            other,
            listener,
        })
    }

    /// Learns when the next row waiting for a retry comes due, whoever
    /// scheduled it, so an idle relay wakes for it instead of relying on the
    /// fallback poll. Run once per (re)connect: this relay tracks the retries
    /// it schedules itself.
    async fn learn_next_retry(&mut self, s: &Session) {
        let due_in = s.statements.next_retry(&s.client).await;
        match due_in {
            Ok(due_in) => {
                if let Some(secs) = due_in.filter(|s| *s > 0.0) {
                    let at = Instant::now() + Duration::from_secs_f64(secs);
                    self.retry_at(at);
                    self.floor.retry_at(at);
                }
            }
            Err(error) => {
                if self.config.pooler == Pooler::None
                    && let Some(found) = transaction_pooler(&error)
                {
                    // `open_sessions` stops the relay with it.
                    self.pooler = Some(found);
                    return;
                }
                // Not fatal: the fallback poll still finds the row.
                warn!(error = %error_chain(&error), "reading the next retry time");
            }
        }
    }

    /// Keeps trying until `connect_timeout`, logging each attempt; a
    /// schema problem or a permanent failure (`pg::startup::classify`: wrong
    /// password, no such database, a certificate refused) fails at once.
    async fn connect_at_startup(
        &mut self,
        cancel: &CancellationToken,
    ) -> Result<Option<Sessions>, RelayError> {
        let mut startup = Startup::new(&self.pg, self.config.connect_timeout);
        loop {
            let delay = match self.open_sessions().await.map_err(|e| self.fatal(e)) {
                Ok(ss) => return Ok(Some(ss)),
                Err(SessionError::Schema(e)) => return Err(RelayError::Schema(e)),
                Err(SessionError::Pooler(e)) => return Err(e),
                Err(SessionError::Postgres(e)) => startup.failed(e).map_err(RelayError::Connect)?,
            };
            if wait_or_cancel(delay, cancel).await {
                return Ok(None);
            }
        }
    }

    /// A statement error that says a transaction-mode pooler sits in front
    /// of a relay run without `--pooler transaction` becomes a reason to
    /// stop (see `error::transaction_pooler`).
    fn fatal(&self, error: SessionError) -> SessionError {
        match &error {
            SessionError::Postgres(e) if self.config.pooler == Pooler::None => {
                transaction_pooler(e).map_or(error, SessionError::Pooler)
            }
            _ => error,
        }
    }

    /// Reconnects with backoff until it works or `cancel` fires (then
    /// None); fails only when a transaction-mode pooler turned up.
    async fn reconnect(&mut self, cancel: &CancellationToken) -> Result<Option<Sessions>, SourceError> {
        let mut wait =
            crate::backoff::Doubling::new(crate::backoff::RECONNECT_FIRST, crate::backoff::RECONNECT_MAX);
        loop {
            let delay = wait.next_delay();
            match self.open_sessions().await.map_err(|e| self.fatal(e)) {
                Ok(ss) => {
                    // Notifications sent while we were away are lost; the
                    // loop claims at once, which covers them.
                    info!("relay reconnected");
                    self.ctx.signal("STATUS=reconnected");
                    return Ok(Some(ss));
                }
                Err(SessionError::Pooler(e)) => return Err(self.pooler_found(e)),
                Err(error) => {
                    let error = error_chain(&error);
                    let problem = Some(format!("reconnecting: {error}"));
                    self.ctx.health().postgres(&self.lane, problem);
                    warn!(
                        %error,
                        retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        "reconnecting to postgres"
                    );
                }
            }
            if wait_or_cancel(delay, cancel).await {
                return Ok(None);
            }
        }
    }

    /// Hands a claimed batch to the relay.
    fn hand_out(
        &mut self,
        conn: Conn,
        claimed: ClaimedRows,
        epoch: u64,
        (sent, answered): (Instant, Instant),
        overlapped: bool,
    ) -> Claim {
        let ClaimedRows {
            mut rows,
            unreadable,
            cut,
            fence,
        } = claimed;
        if self.name_outbox {
            for row in &mut rows {
                super::name_the_outbox(row, self.ctx.outbox());
            }
        }
        // Stops vouching a little before the server's deadline, so this
        // relay is done with the batch before another may claim it.
        let timeout = self.config.claim_timeout;
        let held = fence.map(|fence| Held {
            fence,
            ids: rows.iter().map(|r| r.id).collect(),
            deadline: sent + timeout - (timeout / 10).min(Duration::from_secs(1)),
        });
        // A cut batch is not `full`: nothing is claimed while it is at the
        // sink (its connection holds locks on rows past the cut), but the
        // next claim follows its commit at once.
        let full = rows.len() == self.config.batch_size as usize;
        // Under strict order this batch's commit makes its aggregates' next
        // events claimable, and nothing notifies about that: without a
        // claim right after it, each would wait for the next lease tick (an
        // aggregate with ten queued events took ten ticks, 30 s).
        let unblocks = self.any_strict() && !rows.is_empty();
        self.pipeline.idle = !full && !cut && !unblocks && !self.config.drain;
        self.pipeline.at_sink = Some(AtSink {
            batch: self.receipts.next_batch(),
            conn,
            epoch,
            rows: rows.len(),
            started: Instant::now(),
            held,
        });
        Claim::Batch(Batch {
            rows: rows.into(),
            unreadable,
            full,
            overlapped,
            claim: Some((sent, answered)),
        })
    }
}

impl Source for PollSource {
    async fn claim(&mut self, cancel: &CancellationToken) -> Result<Claim, SourceError> {
        if let Some(error) = self.pooler.take() {
            return Err(self.pooler_found(error));
        }
        self.check_lease_pooler()?;
        if self.sessions(cancel).await?.is_none() {
            return Ok(Claim::Cancelled);
        }
        if let Some(c) = self.pipeline.prefetched.take() {
            return Ok(self.hand_out(c.conn, c.rows, c.epoch, (c.sent, c.answered), true));
        }
        self.commit_settled().await?;
        let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
        self.claiming.give_back_abandoned(&ss.listening).await?;
        if self.pipeline.idle && !self.wait(cancel).await? {
            return Ok(Claim::Cancelled);
        }
        self.check_lease_pooler()?;
        let ss = self.sessions.as_mut().ok_or(SourceError::ConnectionLost)?;
        if !ss.wakeups().drain() {
            return Err(SourceError::ConnectionLost);
        }
        loop {
            let epoch = self.lease_epoch();
            let sent = Instant::now();
            let floor = self.floor_for_claim();
            let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
            let mut trip = self.round_trip(&ss.listening, None, Some(floor)).await?;
            self.floor_found(Some(floor), &mut trip);
            let claimed = trip.claimed.is_some();
            let rows = trip.claimed.unwrap_or_default();
            if !rows.rows.is_empty() {
                return Ok(self.hand_out(Conn::Listening, rows, epoch, (sent, Instant::now()), false));
            }
            if claimed {
                let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
                self.claiming.close_empty(&ss.listening).await?;
            }
            if self.config.drain && claimed && floor.at > 0 {
                // A drain ends on a claim that found nothing from 0, not
                // above a floor that may have passed a row due since.
                self.floor.sweep_next();
                continue;
            }
            if self.config.drain && (claimed || self.holds_nothing()) {
                return Ok(Claim::Drained);
            }
            self.pipeline.idle = true;
            return Ok(Claim::Empty);
        }
    }

    fn may_deliver(&self) -> bool {
        if let Some(held) = self.pipeline.at_sink.as_ref().and_then(|a| a.held.as_ref()) {
            // A deadline claim is its own warrant, whatever the partitions do.
            return Instant::now() < held.deadline;
        }
        let epoch = self.pipeline.at_sink.as_ref().map_or(0, |a| a.epoch);
        // Claimed before the heartbeat lapsed: another relay may own these
        // rows now.
        self.leases
            .as_ref()
            .is_none_or(|l| !l.expired() && l.view().epoch == epoch)
    }

    async fn give_back(&mut self) -> Result<(), SourceError> {
        let Some(at_sink) = self.pipeline.at_sink.take() else {
            return Ok(());
        };
        if at_sink.held.is_some() {
            warn!(
                rows = at_sink.rows,
                "the claim's deadline passed before delivery; giving the batch back"
            );
        } else {
            warn!(
                rows = at_sink.rows,
                "lease expired before delivery; giving the batch back"
            );
        }
        self.pipeline.idle = true;
        let lease = at_sink.held.as_ref().map(|h| (h.ids.as_slice(), h.fence));
        self.release(at_sink.conn, lease).await
    }

    fn lapse(&self) -> BoxFuture<'static, ()> {
        if let Some(held) = self.pipeline.at_sink.as_ref().and_then(|a| a.held.as_ref()) {
            return tokio::time::sleep_until(held.deadline.into()).boxed();
        }
        match &self.leases {
            Some(leases) => leases.lapse().boxed(),
            None => std::future::pending().boxed(),
        }
    }

    async fn overlap(&mut self, full: bool) -> Result<(), SourceError> {
        let Some(conn) = self.pipeline.at_sink.as_ref().map(|a| a.conn) else {
            return Ok(());
        };
        let other = conn.other();
        let mut settled = self.pipeline.settled.take();
        debug_assert!(settled.as_ref().is_none_or(|s| s.conn == other));
        if let Some(settled) = &mut settled {
            settled.outcomes.marking();
        }
        let epoch = self.lease_epoch();
        let ss = self.sessions.as_mut().ok_or(SourceError::ConnectionLost)?;
        // Notifications up to here are covered by the next claim.
        let chain = full && ss.wakeups().drain();
        let sent = Instant::now();
        let floor = chain.then(|| self.floor_for_claim());
        let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
        let mut trip = self.round_trip(ss.get(other), settled, floor).await?;
        self.floor_found(floor, &mut trip);
        self.committed(trip.settled);
        self.pipeline.prefetched = match trip.claimed {
            Some(rows) if rows.rows.is_empty() => {
                let ss = self.sessions.as_ref().ok_or(SourceError::ConnectionLost)?;
                self.claiming.close_empty(ss.get(other)).await?;
                None
            }
            Some(rows) => Some(Claimed {
                conn: other,
                rows,
                epoch,
                sent,
                answered: Instant::now(),
            }),
            None => None,
        };
        Ok(())
    }

    fn settle(&mut self, plan: Plan) {
        let Some(at_sink) = self.pipeline.at_sink.take() else {
            return;
        };
        self.pipeline.settled = Some(Settled {
            batch: at_sink.batch,
            conn: at_sink.conn,
            claimed: at_sink.rows,
            outcomes: Outcomes::from_plan(plan),
            started: at_sink.started,
            held: at_sink.held,
        });
    }

    async fn hold(&mut self) -> Result<(), SourceError> {
        if let Some(claimed) = self.pipeline.prefetched.take() {
            self.release_claimed(&claimed).await?;
        }
        self.commit_settled().await?;
        self.pipeline.idle = false;
        Ok(())
    }

    async fn recover(&mut self, error: SourceError, cancel: &CancellationToken) -> bool {
        self.pipeline = Pipeline::default();
        self.claiming.reset();
        // Everything in flight is rolled back, due again, perhaps below the
        // floor.
        self.floor.sweep_next();
        if let SourceError::Postgres(e) = &error
            && self.config.pooler == Pooler::None
            && let Some(found) = transaction_pooler(e)
        {
            // Not one more statement: a name this relay prepared may stand
            // for another client's statement on the server connection the
            // pooler hands it next. Dropping the connections rolls back
            // what they had open; the next claim stops the relay.
            self.sessions = None;
            self.pooler = Some(found);
            return true;
        }
        let lost = matches!(error, SourceError::ConnectionLost)
            || self
                .sessions
                .as_ref()
                .is_none_or(|ss| ss.both().iter().any(|s| s.client.is_closed()));
        if lost {
            let error = error_chain(&error);
            let problem = Some(format!("connection lost: {error}"));
            self.ctx.health().postgres(&self.lane, problem);
            warn!(%error, "lost the postgres connection; batches in flight will be redelivered");
            // Dropping both connections rolls back whatever the surviving
            // one had open.
            self.sessions = None;
            return !cancel.is_cancelled();
        }
        let chain = error_chain(&error);
        if self.config.drain && needs_operator(&error) {
            // A drain must end: the next claim stops the relay with this.
            self.pooler = Some(RelayError::Drain {
                reason: format!("a batch failed: {chain}"),
            });
        }
        if self.streak.failed(&chain) {
            // Retrying goes on (the cause may pass), but not in silence:
            // unready until a batch commits.
            tracing::error!(
                error = %chain,
                failures = Streak::UNREADY_AFTER,
                "batches keep failing with the same error; the relay is unready until one commits"
            );
            let problem = format!("batches keep failing: {chain}");
            self.ctx.health().postgres(&self.lane, Some(problem));
        } else {
            warn!(error = %chain, "batch failed; retrying");
        }
        if let Some(ss) = &self.sessions {
            for s in ss.both() {
                // Outside a transaction this is a harmless warning.
                let _ = s.client.batch_execute("ROLLBACK").await;
            }
        }
        let pause = self.config.poll_interval.min(Duration::from_secs(1));
        !wait_or_cancel(pause, cancel).await
    }

    async fn finish(&mut self) {
        if self.sessions.is_some() {
            if let Some(claimed) = self.pipeline.prefetched.take() {
                let _ = self.release_claimed(&claimed).await;
            }
            if let Err(error) = self.commit_settled().await {
                warn!(error = %error_chain(&error), "committing the last batch failed; it will be redelivered");
            }
        }
        if let Some(leases) = self.leases.take() {
            leases.leave().await;
        }
    }
}

/// The partition leases a relay with `config`'s ordering takes, started;
/// None under `--ordering none`. Shared by the relay's lanes
/// ([`Leases::lane`]).
pub(crate) fn start_leases(
    config: &RelayConfig,
    pg: &PgConfig,
    ctx: &RelayContext,
    relay_id: Uuid,
) -> Option<Leases> {
    if config.ordering == OrderMode::None {
        return None;
    }
    let mut pg = pg.clone();
    pg.postgres_mut().application_name("outbox-relay lease");
    let settings = LeaseSettings {
        pg,
        relay_id,
        ctx: ctx.clone(),
        timeout: config.lease_timeout,
        poll: config.poll_interval,
        pooler: config.pooler,
    };
    let routes = crate::route_state::Publisher::new(&config.outbox, ctx, relay_id);
    Some(Leases::start(settings, &OutboxSql::new(&config.outbox), routes))
}

/// The idle wait when nothing but a notification, a retry or a lease tick
/// should wake the relay.
const NO_POLL: Duration = Duration::from_secs(3600);

/// Opening a session fails on the connection, on the schema check, or on
/// finding a transaction-mode pooler in front of a relay not told so.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Schema(outbox::Error),
    #[error(transparent)]
    Pooler(RelayError),
}

/// Sleeps for `d`; true if `cancel` fired first.
async fn wait_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}
