//! Sharing one outbox between relays: heartbeat, rebalancing and the set of
//! partitions this relay may claim.
//!
//! The outbox is split into a fixed number of logical partitions by a hash of
//! `aggregate_id` (migration 0003). A task on its own connection ticks every
//! third of the lease timeout: one call of the tick function heartbeats,
//! forgets relays silent for two thirds of the timeout (terminating their
//! batch connections), and moves this relay towards an even share. So a dead
//! relay's partitions move within the lease timeout, and a new relay gets
//! its share within a few ticks. Through a transaction-mode pooler
//! (`--pooler transaction`) the tick records no batch connections: they are
//! pooled server connections, shared with other clients, and must never be
//! terminated; a frozen relay's transactions are ended by the server
//! instead (`idle_in_transaction_session_timeout`, set per transaction by
//! `outbox::sql`), within the lease timeout.
//!
//! What keeps two relays from delivering one aggregate at once is not this
//! task but the claim: it reads the lease rows `FOR SHARE` and claims only
//! partitions whose row still names this relay, so ownership cannot change
//! while a batch is in flight (see `LEASE_CTE` in `outbox::sql`). A stale view
//! here can only make the relay claim less, never claim what it lost.
//!
//! The tick also reports whether any held partition has a row due, which
//! replaces the fallback poll: an idle relay commits one tick per interval
//! and the write of its route state (`route_state`, pipelined behind the
//! tick in the same round trip) and nothing else.
//!
//! A relay is not ready before its first tick succeeded ([`Leases::first_tick`]:
//! no `READY=1` until then), since it may claim nothing without one. Ticks
//! that fail are logged when the state changes (the first failure, a new
//! error, the first success after), not every interval; one refused for a
//! reason only an operator fixes (a privilege, a missing function:
//! `error::needs_operator`) is kept in the view as its `fault`, which stops
//! a `--drain` relay (exit 1) instead of leaving it waiting for ever.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::sql::{OutboxSql, TickParams, TickStatement};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use crate::config::Pooler;
use crate::error::{RelayError, error_chain, needs_operator, transaction_pooler};
use crate::route_state::Publisher;
use crate::wake;

/// What the last successful tick said.
#[derive(Debug, Default, Clone)]
pub(crate) struct LeaseView {
    /// Partitions this relay holds and is not handing over, ascending.
    pub(crate) claimable: Vec<i32>,
    /// The partition count; 0 until the first tick succeeded.
    pub(crate) count: i32,
    /// Until when the other relays cannot have declared this one dead: the
    /// last successful tick was sent at most `dead_after` before. None
    /// before the first tick.
    pub(crate) valid_until: Option<Instant>,
    /// Bumped whenever a tick succeeds after the last one expired: the
    /// other relays may have declared this one dead in between and taken
    /// its partitions, so a batch claimed in an earlier epoch must not be
    /// sent even if this relay holds the same partitions again.
    pub(crate) epoch: u64,
    /// A tick found a transaction-mode pooler in front of a relay run
    /// without `--pooler transaction` (`error::transaction_pooler`): what
    /// gave it away. The relay stops with it.
    pub(crate) pooler_sign: Option<String>,
    /// The last tick was refused for a reason no retry fixes (see
    /// `error::needs_operator`): why. Cleared by a tick that succeeds.
    pub(crate) fault: Option<String>,
}

impl LeaseView {
    /// Whether the other relays cannot yet have declared this one dead.
    pub(crate) fn is_valid(&self) -> bool {
        self.valid_until.is_some_and(|t| t > Instant::now())
    }
}

/// The batch connections of this relay, as (pid, backend start), which the
/// tick records so another relay can terminate them if this one is declared
/// dead while a batch of it still holds locks.
pub(crate) type Backends = Vec<(i32, DateTime<Utc>)>;

/// Settings of the lease task.
#[derive(Debug, Clone)]
pub(crate) struct LeaseSettings {
    pub(crate) pg: crate::pg::PgConfig,
    pub(crate) relay_id: Uuid,
    /// The relay's context: its name for the lease table, the health its
    /// ticks report to, the label of its gauge.
    pub(crate) ctx: crate::RelayContext,
    pub(crate) timeout: Duration,
    /// The relay's fallback poll. The tick reports due rows, so it is the
    /// poll: ticking at least this often lets the relay skip a claim
    /// transaction of its own per poll.
    pub(crate) poll: Duration,
    /// Through a transaction-mode pooler the tick is unnamed, and the lanes
    /// record no backend pids (they are not the relay's own).
    pub(crate) pooler: Pooler,
}

impl LeaseSettings {
    /// Ticks come three times per lease timeout, or once per poll if that
    /// is more often.
    fn interval(&self) -> Duration {
        self.tick_timeout().min(self.poll)
    }

    /// How long one tick may take before the connection is replaced: a
    /// short poll must not turn a slow server into reconnects.
    fn tick_timeout(&self) -> Duration {
        self.timeout / 3
    }

    /// A relay silent this long is dead: with a tick every third of the
    /// timeout, a dead relay's partitions move within the timeout.
    fn dead_after(&self) -> Duration {
        self.timeout * 2 / 3
    }
}

/// The running lease task and what it shares with one relay loop (a lane:
/// a relay whose routes differ in `claim` runs a loop per claim mode, all
/// under one relay id and one set of partitions).
pub(crate) struct Leases {
    relay_id: Uuid,
    view: watch::Receiver<Arc<LeaseView>>,
    /// This lane's wake-up, and its index among the lanes.
    wake: Arc<Notify>,
    lane: usize,
    lanes: Arc<Mutex<Vec<LaneSlot>>>,
    task: Arc<Task>,
}

/// What the task keeps per lane: its wake-up and batch connections.
struct LaneSlot {
    wake: Arc<Notify>,
    backends: Backends,
}

/// The task, stopped by the last lane to leave.
struct Task {
    stop: CancellationToken,
    handle: JoinHandle<()>,
}

impl Leases {
    /// Starts ticking at once; the first tick wakes the relay loop. Each
    /// tick carries the relay's route state (`routes`) if it publishes any.
    pub(crate) fn start(settings: LeaseSettings, sql: &OutboxSql, routes: Option<Publisher>) -> Self {
        let (tx, view) = watch::channel(Arc::new(LeaseView::default()));
        let wake = Arc::new(Notify::new());
        let lanes = Arc::new(Mutex::new(vec![LaneSlot {
            wake: Arc::clone(&wake),
            backends: Backends::new(),
        }]));
        let stop = CancellationToken::new();
        settings.ctx.health().takes_leases();
        let ticker = Ticker {
            relay_id: settings.relay_id,
            sql: sql.clone(),
            view: tx,
            lanes: Arc::clone(&lanes),
            held: metrics::gauge!(crate::metric::PARTITIONS_HELD, &[settings.ctx.label()]),
            settings,
            routes,
        };
        let relay_id = ticker.relay_id;
        let handle = tokio::spawn(ticker.run(stop.clone()));
        Self {
            relay_id,
            view,
            wake,
            lane: 0,
            lanes,
            task: Arc::new(Task { stop, handle }),
        }
    }

    /// Another lane on the same leases: its own wake-up and connections.
    pub(crate) fn lane(&self) -> Self {
        let wake = Arc::new(Notify::new());
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        lanes.push(LaneSlot {
            wake: Arc::clone(&wake),
            backends: Backends::new(),
        });
        Self {
            relay_id: self.relay_id,
            view: self.view.clone(),
            wake,
            lane: lanes.len() - 1,
            lanes: Arc::clone(&self.lanes),
            task: Arc::clone(&self.task),
        }
    }

    /// This relay's id, as the lease rows name it.
    pub(crate) fn relay_id(&self) -> Uuid {
        self.relay_id
    }

    /// The latest view.
    pub(crate) fn view(&self) -> Arc<LeaseView> {
        Arc::clone(&self.view.borrow())
    }

    /// Records the lane's batch connections for the next tick.
    pub(crate) fn set_backends(&self, backends: Backends) {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())[self.lane].backends = backends;
    }

    /// Whether the other relays may already have declared this one dead, so
    /// that a batch it claimed may have been taken over: then it must not
    /// be sent.
    pub(crate) fn expired(&self) -> bool {
        !self.view().is_valid()
    }

    /// Resolves when the lease runs out: the other relays may then declare
    /// this one dead and take its partitions. Each tick pushes the end back.
    /// Owned, so it can run beside the batch's delivery.
    pub(crate) fn lapse(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut changes = self.view.clone();
        async move {
            loop {
                let Some(until) = changes.borrow_and_update().valid_until else {
                    return;
                };
                // Both branches are cancel-safe.
                tokio::select! {
                    () = tokio::time::sleep_until(until) => return,
                    changed = changes.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Resolves once a tick succeeded (at once if one did): the relay may
    /// claim, and reports READY, only then. With `drain`, fails as soon as
    /// a tick is refused for a reason no retry fixes (the view's `fault`):
    /// a drain must end, not wait for an operator. Fails too on a
    /// transaction-mode pooler found in front. Owned, so it can be awaited
    /// after the leases went to the claim loops.
    pub(crate) fn first_tick(
        &self,
        drain: bool,
    ) -> impl Future<Output = Result<(), RelayError>> + Send + 'static {
        let mut changes = self.view.clone();
        async move {
            loop {
                {
                    let view = changes.borrow_and_update();
                    if view.valid_until.is_some() {
                        return Ok(());
                    }
                    if let Some(sign) = &view.pooler_sign {
                        return Err(RelayError::TransactionPooler { sign: sign.clone() });
                    }
                    if drain && let Some(fault) = &view.fault {
                        return Err(RelayError::Drain {
                            reason: format!("the lease tick failed: {fault}"),
                        });
                    }
                }
                if changes.changed().await.is_err() {
                    return Ok(());
                }
            }
        }
    }

    /// Resolves when a tick found a due row or gained partitions.
    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Once the last lane left: stops ticking and hands every partition
    /// back, so the others take them at their next tick instead of waiting
    /// for the heartbeat to expire. Call after the lane's last batch
    /// committed.
    pub(crate) async fn leave(self) {
        let Some(task) = Arc::into_inner(self.task) else {
            return;
        };
        task.stop.cancel();
        if let Err(error) = task.handle.await {
            warn!(%error, "lease task failed");
        }
    }
}

/// The task's side.
struct Ticker {
    relay_id: Uuid,
    settings: LeaseSettings,
    sql: OutboxSql,
    view: watch::Sender<Arc<LeaseView>>,
    lanes: Arc<Mutex<Vec<LaneSlot>>>,
    held: metrics::Gauge,
    /// The relay's route state, written behind each tick.
    routes: Option<Publisher>,
}

impl Ticker {
    async fn run(mut self, stop: CancellationToken) {
        let mut routes = self.routes.take();
        let mut client: Option<(Client, TickStatement)> = None;
        // Without a connection the next try comes sooner than the next
        // tick: after a failover the lease must be back within seconds of
        // the promotion, or the relay, reconnected, may not claim.
        let mut reconnect =
            crate::backoff::Doubling::new(crate::backoff::RECONNECT_FIRST, crate::backoff::RECONNECT_MAX);
        // What the last failure said, so a failure is logged once per
        // change of state, not once per interval.
        let mut failing: Option<String> = None;
        loop {
            if client.as_ref().is_none_or(|(c, _)| c.is_closed()) {
                client = match self.connect().await {
                    Ok(c) => Some(c),
                    Err(error) => {
                        self.pooler_sign(&error);
                        self.fault(&error);
                        let error = format!("connecting: {}", error_chain(&error));
                        self.settings.ctx.health().lease_failed(error.clone());
                        if failing.as_ref() != Some(&error) {
                            warn!(%error, "lease connection failed; retrying");
                            failing = Some(error);
                        }
                        None
                    }
                };
            }
            if let Some((c, tick)) = &client {
                // The route state goes behind the tick in the same round
                // trip (sent second, so the tick's answer comes first and
                // its view is out before the write's ends); each with its
                // own timeout, so a slow write never holds the lease back.
                let ticked = tokio::time::timeout(self.settings.tick_timeout(), self.tick(c, tick));
                let published = async {
                    match routes.as_mut() {
                        Some(routes) => tokio::time::timeout(self.settings.tick_timeout(), routes.publish(c))
                            .await
                            .is_ok(),
                        None => true,
                    }
                };
                let (ticked, published) = tokio::join!(ticked, published);
                if !published {
                    // Its statement may still hold the session; the next
                    // tick must not queue behind it.
                    warn!("writing route state timed out; reconnecting");
                    client = None;
                }
                // A tick that hangs must not stop the heartbeat for good.
                match ticked {
                    Ok(Ok(())) => {
                        if failing.take().is_some() {
                            info!("lease tick succeeded again");
                        }
                    }
                    Ok(Err(error)) => {
                        self.pooler_sign(&error);
                        self.fault(&error);
                        let error = error_chain(&error);
                        self.settings.ctx.health().lease_failed(error.clone());
                        if failing.as_ref() != Some(&error) {
                            error!(
                                %error,
                                "lease tick failed: the relay claims nothing once its heartbeat runs out, \
                                 and is unready until a tick succeeds"
                            );
                            failing = Some(error);
                        } else {
                            debug!(%error, "lease tick failed again");
                        }
                    }
                    Err(_) => {
                        self.settings
                            .ctx
                            .health()
                            .lease_failed("the tick timed out".to_owned());
                        warn!("lease tick timed out; reconnecting");
                        client = None;
                    }
                }
            }
            let next = if client.as_ref().is_none_or(|(c, _)| c.is_closed()) {
                reconnect.next_delay().min(self.settings.interval())
            } else {
                reconnect.reset();
                wake::jittered(self.settings.interval())
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(next) => {}
            }
        }
        if let Some((c, _)) = client.filter(|(c, _)| !c.is_closed()) {
            let gone = async {
                if let Some(routes) = &routes {
                    routes.leave(&c).await;
                }
            };
            let (left, ()) = tokio::join!(self.sql.relay_leave(&c, self.relay_id), gone);
            match left {
                Ok(n) => info!(partitions = n, "relay left; partitions handed back"),
                Err(error) => {
                    warn!(error = %error_chain(&error), "handing partitions back failed; they move when the heartbeat expires");
                }
            }
        }
    }

    /// Passes a sign of a transaction-mode pooler in front of a relay run
    /// without `--pooler transaction` on to the relay, which stops with it:
    /// every tick would fail the same way.
    fn pooler_sign(&self, error: &tokio_postgres::Error) {
        if self.settings.pooler != Pooler::None {
            return;
        }
        let Some(RelayError::TransactionPooler { sign }) = transaction_pooler(error) else {
            return;
        };
        self.view
            .send_modify(|view| Arc::make_mut(view).pooler_sign = Some(sign));
        for lane in self.lanes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            lane.wake.notify_one();
        }
    }

    /// Keeps a refusal no retry fixes in the view as its `fault`, and wakes
    /// the lanes: a `--drain` relay stops with it.
    fn fault(&self, error: &tokio_postgres::Error) {
        if !needs_operator(error) {
            return;
        }
        let fault = error_chain(error);
        self.view
            .send_modify(|view| Arc::make_mut(view).fault = Some(fault));
        for lane in self.lanes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            lane.wake.notify_one();
        }
    }

    /// The lease connection with the tick prepared (an untyped query would
    /// cost a second round trip, and a second transaction, per tick), or
    /// through a transaction-mode pooler unnamed (typed: one of each too).
    async fn connect(&self) -> Result<(Client, TickStatement), tokio_postgres::Error> {
        let (c, _) = wake::connect(&self.settings.pg).await?;
        let tick = match self.settings.pooler {
            Pooler::None => self.sql.prepare_tick(&c).await?,
            Pooler::Transaction => self.sql.unprepared_tick(),
        };
        Ok((c, tick))
    }

    async fn tick(&self, c: &Client, tick: &TickStatement) -> Result<(), tokio_postgres::Error> {
        let (pids, starts): (Vec<i32>, Vec<DateTime<Utc>>) = self
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .flat_map(|l| l.backends.iter().copied())
            .unzip();
        let sent = Instant::now();
        let rows = tick
            .run(
                c,
                &TickParams {
                    relay_id: self.relay_id,
                    name: self.settings.ctx.name(),
                    dead_after_secs: self.settings.dead_after().as_secs_f64(),
                    backend_pids: &pids,
                    backend_starts: &starts,
                },
            )
            .await?;
        let mut next = LeaseView {
            valid_until: Some(sent + self.settings.dead_after()),
            pooler_sign: self.view.borrow().pooler_sign.clone(),
            ..LeaseView::default()
        };
        let mut due = false;
        let mut releasing = 0;
        for row in &rows {
            if row.releasing {
                releasing += 1;
            } else {
                next.claimable.push(row.partition);
            }
            due |= row.due;
            next.count = row.partitions;
        }
        let previous = self.view.borrow().clone();
        next.epoch = if previous.valid_until.is_some_and(|t| t > sent) {
            previous.epoch
        } else {
            previous.epoch + 1
        };
        let gained = next
            .claimable
            .iter()
            .any(|p| previous.claimable.binary_search(p).is_err());
        if next.claimable != previous.claimable {
            info!(
                holding = next.claimable.len(),
                releasing,
                partitions = next.count.max(previous.count),
                "partition share changed"
            );
        } else {
            debug!(holding = next.claimable.len(), due, "lease tick");
        }
        // An empty answer leaves the count unknown; keep the last one.
        if next.count == 0 {
            next.count = previous.count;
        }
        #[allow(clippy::cast_precision_loss)] // a partition count
        self.held.set(next.claimable.len() as f64);
        if let Some(until) = next.valid_until {
            self.settings
                .ctx
                .health()
                .lease_tick(until, next.claimable.len(), next.count);
        }
        self.view.send_replace(Arc::new(next));
        // A tick with the partition count still unknown wakes the relay: a
        // `--drain` relay that got no partition learns that it has nothing
        // to do. Not the first success: the relay starts claiming only
        // after it (`first_tick`), with this view already in hand, and a
        // wake-up now would cost one more empty claim.
        let first = previous.valid_until.is_none();
        if !first && (due || gained || previous.count == 0) {
            for lane in self.lanes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                lane.wake.notify_one();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(timeout: Duration, poll: Duration) -> LeaseSettings {
        LeaseSettings {
            pg: tokio_postgres::Config::new().into(),
            relay_id: Uuid::nil(),
            ctx: crate::RelayContext::new(
                Some("test".to_owned()),
                "public.outbox".to_owned(),
                crate::Signals::Process,
            ),
            timeout,
            poll,
            pooler: Pooler::None,
        }
    }

    #[test]
    fn the_tick_is_the_poll_when_the_poll_is_shorter() {
        let s = |t, p| settings(Duration::from_secs(t), Duration::from_millis(p));
        // Defaults: a tick every third of 10 s, sooner than the 5 s poll.
        assert_eq!(s(10, 5_000).interval(), Duration::from_secs(10) / 3);
        // `--poll-interval 1s`: one tick per poll, no claim of its own.
        assert_eq!(s(10, 1_000).interval(), Duration::from_secs(1));
        // A short poll never shortens the tick's own timeout.
        assert_eq!(s(10, 100).tick_timeout(), Duration::from_secs(10) / 3);
        assert_eq!(s(10, 100).dead_after(), Duration::from_secs(10) * 2 / 3);
    }
}
