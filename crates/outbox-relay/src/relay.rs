//! The relay loop: wait, claim, deliver, mark, commit.
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
//!   took are sent twice. That is the bounded duplicate (at most the batch in
//!   flight) which consumers absorb with an inbox.
//! - A row is never marked before its sink acknowledged it, so no crash can
//!   leave a row "published" that was never sent.
//! - Shutdown (SIGINT/SIGTERM) is only honoured between batches: a batch in
//!   flight is delivered, marked and committed first.
//!
//! When a batch was full, its COMMIT travels in one round trip with the
//! BEGIN and claim of the next batch, so a relay working through a backlog
//! pays one PostgreSQL round trip and one sink round trip per batch.
//!
//! Several relays share one table through partition leases (see `lease`):
//! each claim is restricted to the partitions this relay holds, which it
//! locks `FOR SHARE` for the batch, so no other relay can take them over
//! until the batch committed or rolled back. `OrderMode::None` skips the
//! leases and just skips rows another relay holds. A row failing
//! `max_attempts` times is a dead letter: the claim no
//! longer sees it until `outbox dlq retry` requeues it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::sql::OutboxSql;
use outbox::{Config as OutboxConfig, OutboxRow};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::failpoint::Failpoint;
use crate::lease::{LeaseSettings, Leases};
use crate::plan::{self, Blocked, Failures};
use crate::sink::Sink;
use crate::wake::{self, Wake, Wakeups};

/// How the relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The outbox table and NOTIFY channel.
    pub outbox: OutboxConfig,
    /// Rows claimed per transaction (default 100).
    pub batch_size: u32,
    /// Retry schedule and dead-letter limit.
    pub backoff: Backoff,
    /// Fallback poll interval (default 5 s). With `notify` it only covers
    /// what NOTIFY cannot: rows committed with triggers disabled, and retries
    /// another relay scheduled before it died. Without `notify` it is the
    /// delivery latency, so set it lower (the CLI defaults to 1 s then).
    pub poll_interval: Duration,
    /// LISTEN for the insert trigger's notifications (default true).
    pub notify: bool,
    /// How long to keep trying PostgreSQL at startup (default 10 s).
    pub connect_timeout: Duration,
    /// Exit once nothing is due instead of waiting for more (cron jobs,
    /// scripts, `outbox bench`).
    pub drain: bool,
    /// Per-aggregate ordering. `Partition` and `Strict` share the outbox
    /// with other relays through partition leases; `None` claims any row.
    pub ordering: OrderMode,
    /// Aggregate types whose ordering differs from `ordering` (`Partition`
    /// or `Strict` each; `None` has no per-type form, as it takes no leases).
    pub ordering_for: Vec<(String, OrderMode)>,
    /// How soon a dead relay's partitions move to the others (default 10 s).
    pub lease_timeout: Duration,
    /// How this relay shows in `outbox relays` (default `host:pid`).
    pub name: Option<String>,
    /// A test-only pause point.
    pub failpoint: Option<Failpoint>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            outbox: OutboxConfig::default(),
            batch_size: 100,
            backoff: Backoff::default(),
            poll_interval: Duration::from_secs(5),
            notify: true,
            connect_timeout: Duration::from_secs(10),
            drain: false,
            ordering: OrderMode::Partition,
            ordering_for: Vec::new(),
            lease_timeout: Duration::from_secs(10),
            name: None,
            failpoint: None,
        }
    }
}

/// How strictly the relay keeps each aggregate's events in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderMode {
    /// No order promised: every relay claims any row (plain `SKIP LOCKED`),
    /// so two relays can deliver one aggregate's events at once, in either
    /// order. The fastest with several relays.
    None,
    /// One relay at a time delivers a partition of aggregates (leases), in
    /// id order while nothing fails. Events behind a failed event of the
    /// same aggregate in the same or the next batch are held back with it;
    /// events claimed after its batch committed may overtake its retry.
    #[default]
    Partition,
    /// An event is never delivered while an earlier event of its aggregate
    /// is pending: due later, waiting for a retry, a dead letter nobody gave
    /// up on (`outbox dlq skip`), or in flight. At most one event per
    /// aggregate per batch.
    Strict,
}

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// PostgreSQL could not be reached within the connect timeout at startup.
    #[error("connecting to postgres (gave up after {timeout:?})")]
    Connect {
        /// The connect timeout.
        timeout: Duration,
        /// The last connection error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The outbox table is missing, outdated or too new.
    #[error("checking the outbox schema")]
    Schema(#[source] outbox::Error),
    /// Per-type ordering that cannot be honoured.
    #[error("invalid ordering for aggregate type {aggregate_type:?}: {reason}")]
    Ordering {
        /// The aggregate type.
        aggregate_type: String,
        /// Why.
        reason: &'static str,
    },
}

impl RelayError {
    /// True when the cause is configuration or schema (CLI exit code 2).
    pub fn is_config(&self) -> bool {
        match self {
            RelayError::Schema(e) => e.is_config(),
            RelayError::Ordering { .. } => true,
            RelayError::Connect { .. } => false,
        }
    }
}

/// Running totals, readable while the relay runs.
#[derive(Debug, Default)]
pub struct Counters {
    /// Rows marked published.
    pub delivered: AtomicU64,
    /// Failed delivery attempts (held-back rows not included).
    pub failed: AtomicU64,
    /// Rows that became dead letters.
    pub dead_lettered: AtomicU64,
    /// Batches committed with at least one row.
    pub batches: AtomicU64,
}

/// One connection with its prepared statements and notifications.
struct Session {
    client: Client,
    /// (pid, backend start), recorded in the relays table.
    backend: (i32, chrono::DateTime<chrono::Utc>),
    wakeups: Wakeups,
    claim: Statement,
    mark_failed: Statement,
    next_retry: Statement,
}

/// The relay's two connections. The first LISTENs. Batches alternate
/// between them, so one batch can be committed and the next claimed while
/// another is at the sink.
type Sessions = [Session; 2];

/// A claimed batch: its rows are locked, and marked, by the open transaction
/// of connection `conn`.
struct Claimed {
    conn: usize,
    rows: Vec<OutboxRow>,
    /// The lease epoch it was claimed in (0 without leases).
    epoch: u64,
}

/// A batch the sink has answered for, waiting for its COMMIT on `conn`.
struct Delivered {
    conn: usize,
    claimed: usize,
    published: usize,
    failures: Failures,
    started: Instant,
}

/// The batches in flight between steps.
#[derive(Default)]
struct Flow {
    /// Claimed, not yet sent.
    current: Option<Claimed>,
    /// Sent, not yet committed.
    previous: Option<Delivered>,
    /// Aggregates the previous batch blocked, which `current` must hold
    /// back when it was claimed before that batch committed.
    blocked: Blocked,
    /// The last claim was not full: wait for a wake-up before the next.
    idle: bool,
}

/// How a step ended.
enum Step {
    Continue,
    Cancelled,
    Drained,
    ConnectionLost,
}

/// The relay. Build with [`Relay::new`], run with [`Relay::run`].
pub struct Relay {
    config: RelayConfig,
    pg: tokio_postgres::Config,
    sink: Arc<dyn Sink>,
    sql: OutboxSql,
    counters: Arc<Counters>,
    /// The earliest `next_attempt_at` this relay set, so it wakes for the
    /// retry instead of waiting out the fallback poll.
    earliest_retry: Option<Instant>,
    /// Partition leases, unless the ordering is `None`.
    leases: Option<Leases>,
    /// The aggregate types whose ordering is not the default, and whether
    /// the default is strict: `$6` and `$7` of the strict claim.
    exceptions: Vec<String>,
    default_strict: bool,
}

impl Relay {
    /// A relay from `pg` to `sink`.
    pub fn new(mut pg: tokio_postgres::Config, sink: Arc<dyn Sink>, config: RelayConfig) -> Self {
        let sql = OutboxSql::new(&config.outbox);
        if pg.get_application_name().is_none() {
            // So operators can tell relays apart in pg_stat_activity.
            pg.application_name("outbox-relay");
        }
        Self {
            pg,
            sink,
            sql,
            counters: Arc::default(),
            earliest_retry: None,
            leases: None,
            exceptions: config
                .ordering_for
                .iter()
                .filter(|(_, mode)| *mode != config.ordering)
                .map(|(t, _)| t.clone())
                .collect(),
            default_strict: config.ordering == OrderMode::Strict,
            config,
        }
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

    fn check_ordering(&self) -> Result<(), RelayError> {
        for (aggregate_type, mode) in &self.config.ordering_for {
            let reason = if *mode == OrderMode::None {
                "`none` applies to a whole relay (it takes no leases), not to one aggregate type"
            } else if self.config.ordering == OrderMode::None {
                "per-type ordering needs a relay with leases: use `partition` or `strict` as the default"
            } else {
                continue;
            };
            return Err(RelayError::Ordering {
                aggregate_type: aggregate_type.clone(),
                reason,
            });
        }
        Ok(())
    }

    fn start_leases(&mut self) {
        if self.config.ordering == OrderMode::None {
            return;
        }
        let mut pg = self.pg.clone();
        pg.application_name("outbox-relay lease");
        let settings = LeaseSettings {
            pg,
            relay_id: Uuid::new_v4(),
            name: self.config.name.clone().unwrap_or_else(default_name),
            timeout: self.config.lease_timeout,
            max_attempts: self.config.backoff.max_attempts,
        };
        self.leases = Some(Leases::start(settings, &self.sql));
    }

    /// Totals shared with the running relay.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// Runs until `cancel` fires, then returns after the batch at the sink is
    /// committed. Fails only at startup; later connection losses reconnect.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), RelayError> {
        self.check_ordering()?;
        let Some(first) = self.connect_at_startup(&cancel).await? else {
            return Ok(());
        };
        self.start_leases();
        if let Some(leases) = &self.leases {
            leases.set_backends(first.iter().map(|s| s.backend).collect());
        }
        info!(
            table = %self.config.outbox.display_name(),
            sink = self.sink.name(),
            batch_size = self.config.batch_size,
            notify = self.config.notify,
            ordering = ?self.config.ordering,
            ordering_for = ?self.config.ordering_for,
            relay_id = ?self.leases.as_ref().map(Leases::relay_id),
            "relay ready"
        );
        let started = Instant::now();
        let mut sessions = Some(first);
        let mut flow = Flow::default();
        while !cancel.is_cancelled() {
            let ss = match sessions.as_mut() {
                Some(ss) => ss,
                None => match self.reconnect(&cancel).await {
                    Some(ss) => {
                        if let Some(leases) = &self.leases {
                            leases.set_backends(ss.iter().map(|s| s.backend).collect());
                        }
                        sessions.insert(ss)
                    }
                    None => break,
                },
            };
            match self.step(ss, &mut flow, &cancel).await {
                Ok(Step::Continue) => {}
                Ok(Step::Cancelled) => break,
                Ok(Step::Drained) => {
                    info!(
                        delivered = self.counters.delivered.load(Ordering::Relaxed),
                        batches = self.counters.batches.load(Ordering::Relaxed),
                        seconds = started.elapsed().as_secs_f64(),
                        "relay drained"
                    );
                    break;
                }
                Ok(Step::ConnectionLost) => {
                    warn!("lost the postgres connection; batches in flight will be redelivered");
                    flow = Flow::default();
                    sessions = None;
                }
                Err(error) if ss.iter().any(|s| s.client.is_closed()) => {
                    warn!(error = %error_chain(&error), "lost the postgres connection; batches in flight will be redelivered");
                    // Dropping both connections rolls back whatever the
                    // surviving one had open.
                    flow = Flow::default();
                    sessions = None;
                }
                Err(error) => {
                    warn!(error = %error_chain(&error), "batch failed; retrying");
                    flow = Flow::default();
                    for s in ss.iter() {
                        // Outside a transaction this is a harmless warning.
                        let _ = s.client.batch_execute("ROLLBACK").await;
                    }
                    let pause = self.config.poll_interval.min(Duration::from_secs(1));
                    if wait_or_cancel(pause, &cancel).await {
                        break;
                    }
                }
            }
        }
        if let Some(ss) = sessions.as_mut() {
            self.finish(ss, flow).await;
        }
        if let Some(leases) = self.leases.take() {
            leases.leave().await;
        }
        info!("relay stopped");
        Ok(())
    }

    /// At shutdown: commits the batch the sink already took, gives back the
    /// one claimed but not sent.
    async fn finish(&mut self, ss: &Sessions, flow: Flow) {
        if let Some(claimed) = flow.current {
            let _ = ss[claimed.conn].client.batch_execute("ROLLBACK").await;
        }
        if let Some(delivered) = flow.previous {
            let conn = delivered.conn;
            match self.commit(&ss[conn], Some(delivered), false).await {
                Ok((done, _)) => self.account(done),
                Err(error) => {
                    warn!(error = %error_chain(&error), "committing the last batch failed; it will be redelivered");
                }
            }
        }
    }

    /// One batch at the sink. Before it, commit the previous batch and claim
    /// a fresh one when nothing is claimed yet; during it, on the other
    /// connection, commit the previous batch and, if this one is full, claim
    /// the next.
    async fn step(
        &mut self,
        ss: &mut Sessions,
        flow: &mut Flow,
        cancel: &CancellationToken,
    ) -> Result<Step, tokio_postgres::Error> {
        let current = match flow.current.take() {
            Some(claimed) => claimed,
            None => {
                if let Some(delivered) = flow.previous.take() {
                    let conn = delivered.conn;
                    let (done, _) = self.commit(&ss[conn], Some(delivered), false).await?;
                    self.account(done);
                }
                if flow.idle {
                    let wait = self.next_wait();
                    let woken = async {
                        match &self.leases {
                            Some(leases) => leases.woken().await,
                            None => std::future::pending().await,
                        }
                    };
                    let wake = tokio::select! {
                        wake = ss[0].wakeups.wait(wait, cancel) => wake,
                        () = woken => Wake::Notified,
                    };
                    match wake {
                        Wake::Cancelled => return Ok(Step::Cancelled),
                        Wake::ConnectionLost => return Ok(Step::ConnectionLost),
                        Wake::Notified | Wake::Timer => {}
                    }
                }
                if !ss[0].wakeups.drain() {
                    return Ok(Step::ConnectionLost);
                }
                // Claimed after every earlier batch committed, so rows behind
                // a failure are not due and nothing needs holding back here.
                flow.blocked.clear();
                let epoch = self.lease_epoch();
                let (_, rows) = self.commit(&ss[0], None, true).await?;
                let claimed = rows.is_some();
                let rows = rows.unwrap_or_default();
                if rows.is_empty() {
                    if claimed {
                        ss[0].client.batch_execute("COMMIT").await?;
                    }
                    if self.config.drain && (claimed || self.holds_nothing()) {
                        return Ok(Step::Drained);
                    }
                    flow.idle = true;
                    return Ok(Step::Continue);
                }
                Claimed { conn: 0, rows, epoch }
            }
        };
        if self
            .leases
            .as_ref()
            .is_some_and(|l| l.expired() || l.view().epoch != current.epoch)
        {
            // Claimed before the heartbeat lapsed: another relay may own
            // these rows now. Give them back unsent and wait for a tick.
            warn!(
                rows = current.rows.len(),
                "lease expired before delivery; giving the batch back"
            );
            ss[current.conn].client.batch_execute("ROLLBACK").await?;
            flow.blocked.clear();
            flow.idle = true;
            return Ok(Step::Continue);
        }
        let started = Instant::now();
        let full = current.rows.len() == self.config.batch_size as usize;
        flow.idle = !full && !self.config.drain;
        let other = 1 - current.conn;
        let previous = flow.previous.take();
        let epoch = self.lease_epoch();
        debug_assert!(previous.as_ref().is_none_or(|p| p.conn == other));
        // Notifications up to here are covered by the next claim.
        let chain = full && ss[0].wakeups.drain();

        let held_back = plan::sendable(&current.rows, &flow.blocked);
        let to_send = held_back.as_deref().unwrap_or(&current.rows);
        let (sent, committed) = tokio::join!(
            async {
                if to_send.is_empty() {
                    return Vec::new();
                }
                match &self.leases {
                    Some(leases) => leases.deliver_within(self.sink.as_ref(), to_send).await,
                    None => self.sink.deliver(to_send).await,
                }
            },
            self.commit(&ss[other], previous, chain),
        );
        let deliveries = plan::merge(&current.rows, &flow.blocked, sent);
        if let Some(failpoint) = self.config.failpoint {
            failpoint.park(current.rows.len()).await;
        }
        let (done, next) = committed?;
        self.account(done);

        let plan = plan::plan(self.config.backoff, &current.rows, deliveries, &flow.blocked);
        if let Some(error) = &plan.failures.first_error {
            self.counters
                .failed
                .fetch_add(plan.failures.failed, Ordering::Relaxed);
            self.counters
                .dead_lettered
                .fetch_add(plan.failures.dead, Ordering::Relaxed);
            warn!(
                failed = plan.failures.ids.len(),
                delivered = plan.published,
                sink = self.sink.name(),
                %error,
                "delivery failed; rows will be retried"
            );
        }
        flow.blocked = plan.blocked;
        flow.previous = Some(Delivered {
            conn: current.conn,
            claimed: current.rows.len(),
            published: plan.published,
            failures: plan.failures,
            started,
        });
        flow.current = match next {
            Some(rows) if rows.is_empty() => {
                ss[other].client.batch_execute("COMMIT").await?;
                None
            }
            Some(rows) => Some(Claimed {
                conn: other,
                rows,
                epoch,
            }),
            None => None,
        };
        Ok(Step::Continue)
    }

    /// On one connection, in one round trip: the failure marks and COMMIT of
    /// `delivered` (if any), then, if `claim`, BEGIN and the next claim.
    ///
    /// The transaction is driven by hand rather than through
    /// `tokio_postgres::Transaction` because tokio-postgres pipelines
    /// requests whose futures are polled together, in the order polled. If
    /// a mark fails, PostgreSQL answers the COMMIT with a rollback, so
    /// nothing of the batch is marked and it is redelivered; the caller then
    /// rolls back the claim that followed.
    async fn commit(
        &self,
        s: &Session,
        delivered: Option<Delivered>,
        claim: bool,
    ) -> Result<(Option<Delivered>, Option<Vec<OutboxRow>>), tokio_postgres::Error> {
        let client = &s.client;
        let limit = i64::from(self.config.batch_size);
        let max_attempts = self.config.backoff.max_attempts;
        let lease = self.leases.as_ref().map(|l| (l.relay_id(), l.view()));
        let count = lease.as_ref().map_or(0, |(_, v)| i64::from(v.count));
        type Param<'p> = &'p (dyn tokio_postgres::types::ToSql + Sync);
        let mut claim_params: Vec<Param<'_>> = vec![&max_attempts, &limit];
        if let Some((relay_id, view)) = &lease {
            let leased: [Param<'_>; 3] = [relay_id, &view.claimable, &count];
            claim_params.extend(leased);
            if self.any_strict() {
                let strict: [Param<'_>; 2] = [&self.exceptions, &self.default_strict];
                claim_params.extend(strict);
            }
        }
        // Holding no partition, there is nothing to claim: no transaction.
        // With the lease lapsed, a batch could not be sent: none either.
        let claim = claim
            && lease
                .as_ref()
                .is_none_or(|(_, v)| !v.claimable.is_empty() && v.is_valid());
        let failures = delivered.as_ref().map(|d| &d.failures);
        let (failed, committed, begun, claimed) = tokio::join!(
            async {
                match failures {
                    Some(f) if !f.ids.is_empty() => {
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                            [&f.ids, &f.errors, &f.attempts, &f.delay_ms];
                        client.execute(&s.mark_failed, &params).await
                    }
                    _ => Ok(0),
                }
            },
            async {
                if delivered.is_some() {
                    client.batch_execute("COMMIT").await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            },
            async {
                if claim {
                    client.batch_execute("BEGIN").await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            },
            async {
                if claim {
                    return client.query(&s.claim, &claim_params).await.map(Some);
                }
                Ok(None)
            },
        );
        failed?;
        committed?;
        begun?;
        let rows = match claimed? {
            Some(rows) => Some(to_rows(rows)?),
            None => None,
        };
        Ok((delivered, rows))
    }

    /// Books a committed batch: counters, the retry wake-up, a debug line.
    fn account(&mut self, done: Option<Delivered>) {
        let Some(d) = done else { return };
        if let Some(soonest) = d.failures.soonest {
            // Measured from after the commit, so the wake-up is never before
            // the time PostgreSQL recorded.
            let at = Instant::now() + soonest;
            self.retry_at(at);
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters
            .delivered
            .fetch_add(d.published as u64, Ordering::Relaxed);
        debug!(
            claimed = d.claimed,
            delivered = d.published,
            failed = d.failures.ids.len(),
            elapsed = ?d.started.elapsed(),
            "batch committed"
        );
    }

    /// Wakes for a retry due at `at`, unless one is due sooner. A wake-up
    /// already in the past was spent by the claim that came before: keeping
    /// it would win every `min` and drop this retry to the next poll.
    fn retry_at(&mut self, at: Instant) {
        let pending = self.earliest_retry.filter(|e| *e > Instant::now());
        self.earliest_retry = Some(pending.map_or(at, |e| e.min(at)));
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

    /// How long to sleep: the fallback poll, or less if a retry is due sooner.
    /// With leases and NOTIFY, the lease tick reports due rows, so there is
    /// no fallback poll of its own.
    fn next_wait(&mut self) -> Duration {
        let poll = if self.leases.is_some() && self.config.notify {
            NO_POLL
        } else {
            wake::jittered(self.config.poll_interval)
        };
        match self.earliest_retry {
            Some(at) => {
                let until = at.saturating_duration_since(Instant::now());
                if until.is_zero() {
                    self.earliest_retry = None;
                }
                poll.min(until)
            }
            None => poll,
        }
    }

    async fn open_session(&self, listen: bool) -> Result<Session, SessionError> {
        let channel = (listen && self.config.notify).then_some(&self.config.outbox.channel);
        let (client, wakeups) = wake::connect(&self.pg, wake::Purpose::Batches(channel)).await?;
        if listen {
            outbox::check(&client, &self.config.outbox)
                .await
                .map_err(SessionError::Schema)?;
        }
        let me = client
            .query_one(
                "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                &[],
            )
            .await?;
        Ok(Session {
            backend: (me.try_get(0)?, me.try_get(1)?),
            claim: client
                .prepare(if self.config.ordering == OrderMode::None {
                    &self.sql.claim_batch
                } else if self.any_strict() {
                    &self.sql.claim_batch_strict_leased
                } else {
                    &self.sql.claim_batch_leased
                })
                .await?,
            mark_failed: client.prepare(&self.sql.mark_failed).await?,
            next_retry: client.prepare(&self.sql.next_retry).await?,
            client,
            wakeups,
        })
    }

    /// Both connections, then when the next retry is due.
    async fn open_sessions(&mut self) -> Result<Sessions, SessionError> {
        let listening = self.open_session(true).await?;
        let other = self.open_session(false).await?;
        self.learn_next_retry(&listening).await;
        Ok([listening, other])
    }

    /// Learns when the next row waiting for a retry comes due, whoever
    /// scheduled it, so an idle relay wakes for it instead of relying on the
    /// fallback poll. Run once per (re)connect: this relay tracks the retries
    /// it schedules itself.
    async fn learn_next_retry(&mut self, s: &Session) {
        let max_attempts = self.config.backoff.max_attempts;
        let due_in = s
            .client
            .query_one(&s.next_retry, &[&max_attempts])
            .await
            .and_then(|row| row.try_get::<_, Option<f64>>(0));
        match due_in {
            Ok(due_in) => {
                if let Some(secs) = due_in.filter(|s| *s > 0.0) {
                    let at = Instant::now() + Duration::from_secs_f64(secs);
                    self.retry_at(at);
                }
            }
            // Not fatal: the fallback poll still finds the row.
            Err(error) => warn!(error = %error_chain(&error), "reading the next retry time"),
        }
    }

    /// Keeps trying until `connect_timeout`; a schema problem fails at once.
    async fn connect_at_startup(
        &mut self,
        cancel: &CancellationToken,
    ) -> Result<Option<Sessions>, RelayError> {
        let deadline = Instant::now() + self.config.connect_timeout;
        let mut delay = Duration::from_millis(100);
        loop {
            match self.open_sessions().await {
                Ok(ss) => return Ok(Some(ss)),
                Err(SessionError::Schema(e)) => return Err(RelayError::Schema(e)),
                Err(SessionError::Postgres(source)) => {
                    if Instant::now() + delay >= deadline {
                        return Err(RelayError::Connect {
                            timeout: self.config.connect_timeout,
                            source,
                        });
                    }
                    debug!(error = %error_chain(&source), "postgres not reachable yet");
                }
            }
            if wait_or_cancel(delay, cancel).await {
                return Ok(None);
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// Reconnects with backoff until it works or `cancel` fires.
    async fn reconnect(&mut self, cancel: &CancellationToken) -> Option<Sessions> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.open_sessions().await {
                Ok(ss) => {
                    // Notifications sent while we were away are lost; the
                    // loop claims at once, which covers them.
                    info!("relay reconnected");
                    return Some(ss);
                }
                Err(error) => warn!(error = %error, retry_in = ?delay, "reconnecting to postgres"),
            }
            if wait_or_cancel(delay, cancel).await {
                return None;
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }
}

/// The idle wait when nothing but a notification, a retry or a lease tick
/// should wake the relay.
const NO_POLL: Duration = Duration::from_secs(3600);

/// `host:pid`, how a relay shows in `outbox relays` unless named.
fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("{host}:{}", std::process::id())
}

/// Decodes claimed rows in id order, which is delivery order: the claim's
/// `RETURNING` does not promise one.
fn to_rows(rows: Vec<tokio_postgres::Row>) -> Result<Vec<OutboxRow>, tokio_postgres::Error> {
    let mut rows = rows
        .iter()
        .map(OutboxRow::try_from)
        .collect::<Result<Vec<_>, _>>()?;
    rows.sort_unstable_by_key(|r| r.id);
    Ok(rows)
}

/// Opening a session fails either on the connection or on the schema check.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Schema(outbox::Error),
}

/// Sleeps for `d`; true if `cancel` fired first.
async fn wait_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// The error and its sources on one line, for logs.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
