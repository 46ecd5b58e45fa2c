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
//! Rows locked by another relay are skipped, not waited for, so several
//! relays can share one table (ordering across them is the next issue's
//! concern). A row failing `max_attempts` times is a dead letter: the claim no
//! longer sees it until `outbox dlq retry` requeues it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::sql::OutboxSql;
use outbox::{Config as OutboxConfig, OutboxRow};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::failpoint::Failpoint;
use crate::sink::{Delivery, DeliveryError, Sink};
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
            failpoint: None,
        }
    }
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
}

impl RelayError {
    /// True when the cause is configuration or schema (CLI exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(self, RelayError::Schema(e) if e.is_config())
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
    wakeups: Wakeups,
    claim: Statement,
    mark_failed: Statement,
    next_retry: Statement,
}

/// What one batch did.
struct Batch {
    /// Rows claimed.
    claimed: usize,
    /// The next batch, already claimed in a transaction that is still open.
    next: Option<Vec<OutboxRow>>,
}

/// The failed rows of a batch as the arrays `MARK_FAILED` binds.
#[derive(Default)]
struct Failures {
    ids: Vec<i64>,
    errors: Vec<String>,
    attempts: Vec<i32>,
    delay_ms: Vec<f64>,
    /// The shortest retry delay among rows that are not dead letters.
    soonest: Option<Duration>,
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
            config,
            pg,
            sink,
            sql,
            counters: Arc::default(),
            earliest_retry: None,
        }
    }

    /// Totals shared with the running relay.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// Runs until `cancel` fires, then returns after the batch in flight is
    /// committed. Fails only at startup; later connection losses reconnect.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), RelayError> {
        let Some(first) = self.connect_at_startup(&cancel).await? else {
            return Ok(());
        };
        info!(
            table = %self.config.outbox.display_name(),
            sink = self.sink.name(),
            batch_size = self.config.batch_size,
            notify = self.config.notify,
            "relay ready"
        );
        let started = Instant::now();
        let mut session = Some(first);
        // The next batch when it was claimed with the previous COMMIT; its
        // transaction is open and its rows are locked.
        let mut prefetched: Option<Vec<OutboxRow>> = None;
        while !cancel.is_cancelled() {
            let s = match session.as_mut() {
                Some(s) => s,
                None => match self.reconnect(&cancel).await {
                    Some(s) => session.insert(s),
                    None => break,
                },
            };
            if prefetched.is_none() && !s.wakeups.drain() {
                session = None;
                continue;
            }
            match self.run_batch(s, prefetched.take()).await {
                Ok(batch) if batch.next.is_some() => {
                    prefetched = batch.next;
                    continue;
                }
                Ok(batch) if self.config.drain && batch.claimed == 0 => {
                    info!(
                        delivered = self.counters.delivered.load(Ordering::Relaxed),
                        batches = self.counters.batches.load(Ordering::Relaxed),
                        seconds = started.elapsed().as_secs_f64(),
                        "relay drained"
                    );
                    break;
                }
                Ok(batch) if self.config.drain || batch.claimed == self.config.batch_size as usize => {
                    continue;
                }
                Ok(_) => {}
                Err(error) if s.client.is_closed() => {
                    warn!(error = %error_chain(&error), "lost the postgres connection; the batch in flight will be redelivered");
                    session = None;
                    continue;
                }
                Err(error) => {
                    warn!(error = %error_chain(&error), "batch failed; retrying");
                    let pause = self.config.poll_interval.min(Duration::from_secs(1));
                    if wait_or_cancel(pause, &cancel).await {
                        break;
                    }
                    continue;
                }
            }
            match s.wakeups.wait(self.next_wait(), &cancel).await {
                Wake::Cancelled => break,
                Wake::ConnectionLost => session = None,
                Wake::Notified | Wake::Timer => {}
            }
        }
        if let (Some(_), Some(s)) = (prefetched, session.as_ref()) {
            // Claimed but never sent: give the rows back at once rather than
            // when the connection closes.
            let _ = s.client.batch_execute("ROLLBACK").await;
        }
        info!("relay stopped");
        Ok(())
    }

    /// How long to sleep: the fallback poll, or less if a retry is due sooner.
    fn next_wait(&mut self) -> Duration {
        let poll = wake::jittered(self.config.poll_interval);
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

    async fn open_session(&self) -> Result<Session, SessionError> {
        let channel = self.config.notify.then_some(&self.config.outbox.channel);
        let (client, wakeups) = wake::connect(&self.pg, channel).await?;
        outbox::check(&client, &self.config.outbox)
            .await
            .map_err(SessionError::Schema)?;
        Ok(Session {
            claim: client.prepare(&self.sql.claim_batch).await?,
            mark_failed: client.prepare(&self.sql.mark_failed).await?,
            next_retry: client.prepare(&self.sql.next_retry).await?,
            client,
            wakeups,
        })
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
                    self.earliest_retry = Some(self.earliest_retry.map_or(at, |e| e.min(at)));
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
    ) -> Result<Option<Session>, RelayError> {
        let deadline = Instant::now() + self.config.connect_timeout;
        let mut delay = Duration::from_millis(100);
        loop {
            match self.open_session().await {
                Ok(s) => {
                    self.learn_next_retry(&s).await;
                    return Ok(Some(s));
                }
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
    async fn reconnect(&mut self, cancel: &CancellationToken) -> Option<Session> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.open_session().await {
                Ok(s) => {
                    // Notifications sent while we were away are lost; the
                    // loop claims at once, which covers them.
                    info!("relay reconnected");
                    self.learn_next_retry(&s).await;
                    return Some(s);
                }
                Err(error) => warn!(error = %error, retry_in = ?delay, "reconnecting to postgres"),
            }
            if wait_or_cancel(delay, cancel).await {
                return None;
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// One transaction: claim (unless `prefetched` holds the rows of an open
    /// one), deliver, take back the mark of failed rows, commit.
    ///
    /// The transaction is driven by hand rather than through
    /// `tokio_postgres::Transaction` so that BEGIN travels with the claim and
    /// COMMIT with the failure marks and the next claim: tokio-postgres
    /// pipelines requests whose futures are polled together. If a statement
    /// fails, PostgreSQL answers the pipelined COMMIT with a rollback, so
    /// nothing is marked and the batch is redelivered.
    async fn run_batch(
        &mut self,
        s: &mut Session,
        prefetched: Option<Vec<OutboxRow>>,
    ) -> Result<Batch, tokio_postgres::Error> {
        let result = self.run_batch_pipelined(s, prefetched).await;
        if result.is_err() && !s.client.is_closed() {
            // Leave no transaction open for the next batch (the failed one,
            // or the next claim that travelled with a failed commit); outside
            // a transaction this is a harmless warning.
            let _ = s.client.batch_execute("ROLLBACK").await;
        }
        result
    }

    async fn run_batch_pipelined(
        &mut self,
        s: &mut Session,
        prefetched: Option<Vec<OutboxRow>>,
    ) -> Result<Batch, tokio_postgres::Error> {
        let started = Instant::now();
        let client = &s.client;
        let limit = i64::from(self.config.batch_size);
        let max_attempts = self.config.backoff.max_attempts;
        let claim_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&max_attempts, &limit];
        let rows = match prefetched {
            Some(rows) => rows,
            None => {
                let (begun, claimed) = tokio::join!(
                    client.batch_execute("BEGIN"),
                    client.query(&s.claim, &claim_params)
                );
                begun?;
                let rows = to_rows(claimed?)?;
                if rows.is_empty() {
                    client.batch_execute("COMMIT").await?;
                    return Ok(Batch {
                        claimed: 0,
                        next: None,
                    });
                }
                rows
            }
        };

        let deliveries = self.sink.deliver(&rows).await;
        if let Some(failpoint) = self.config.failpoint {
            failpoint.park(rows.len()).await;
        }

        let (published, failures) = self.plan(&rows, deliveries);
        // A full batch says more rows are waiting: claim the next batch in the
        // same round trip as this commit. Notifications up to here are
        // covered by that claim.
        let chain = rows.len() == self.config.batch_size as usize && s.wakeups.drain();
        // Polled in this order, so sent in this order.
        let (failed, committed, begun, next) = tokio::join!(
            async {
                if failures.ids.is_empty() {
                    return Ok(0);
                }
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
                    &failures.ids,
                    &failures.errors,
                    &failures.attempts,
                    &failures.delay_ms,
                ];
                client.execute(&s.mark_failed, &params).await
            },
            client.batch_execute("COMMIT"),
            async {
                if chain {
                    client.batch_execute("BEGIN").await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            },
            async {
                if chain {
                    return client.query(&s.claim, &claim_params).await.map(Some);
                }
                Ok(None)
            },
        );
        failed?;
        committed?;
        if let Some(soonest) = failures.soonest {
            // Measured from after the commit, so the wake-up is never before
            // the time PostgreSQL recorded.
            let at = Instant::now() + soonest;
            self.earliest_retry = Some(self.earliest_retry.map_or(at, |e| e.min(at)));
        }

        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters
            .delivered
            .fetch_add(published as u64, Ordering::Relaxed);
        debug!(
            claimed = rows.len(),
            delivered = published,
            failed = failures.ids.len(),
            elapsed = ?started.elapsed(),
            "batch committed"
        );

        begun?;
        let next = match next? {
            Some(claimed) => Some(to_rows(claimed)?),
            None => None,
        };
        let next = match next {
            Some(rows) if rows.is_empty() => {
                client.batch_execute("COMMIT").await?;
                None
            }
            other => other,
        };
        Ok(Batch {
            claimed: rows.len(),
            next,
        })
    }

    /// Splits a batch's outcomes into rows to mark published and failures to
    /// record, computing each failure's attempts and retry delay.
    /// Returns how many rows were delivered.
    fn plan(&self, rows: &[OutboxRow], deliveries: Vec<Delivery>) -> (usize, Failures) {
        let backoff = self.config.backoff;
        let mut published = 0;
        let mut failures = Failures::default();
        // The delay given to the last failed row of each aggregate, which rows
        // held back behind it inherit so they come due together, in order.
        let mut blocked: HashMap<(&str, &str), Duration> = HashMap::new();
        let mut first_error: Option<String> = None;
        let mut dead = 0u64;
        for (row, delivery) in rows.iter().zip(deliveries) {
            let key = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
            let (message, attempts, delay) = match delivery {
                Ok(()) => {
                    published += 1;
                    continue;
                }
                Err(DeliveryError::Retryable { message, retry_after }) => {
                    let attempts = row.attempts.saturating_add(1);
                    // Never due before an earlier failed row of the same
                    // aggregate in this batch, whatever the jitter drew.
                    let delay = backoff
                        .delay(attempts)
                        .max(retry_after.unwrap_or_default())
                        .max(blocked.get(&key).copied().unwrap_or_default());
                    (message, attempts, delay)
                }
                Err(DeliveryError::Permanent { message }) => {
                    let attempts = row.attempts.saturating_add(1).max(backoff.max_attempts);
                    (format!("permanent: {message}"), attempts, Duration::ZERO)
                }
                Err(DeliveryError::HeldBack { message }) => {
                    let delay = blocked.get(&key).copied().unwrap_or_default();
                    failures.push(row.id, message, row.attempts, delay);
                    continue;
                }
            };
            blocked.insert(key, delay);
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
            if backoff.is_dead(attempts) {
                dead += 1;
                warn!(id = row.id, event_id = %row.event_id, attempts, error = %message, "dead letter");
            } else {
                failures.soonest = Some(failures.soonest.map_or(delay, |s| s.min(delay)));
            }
            first_error.get_or_insert_with(|| message.clone());
            failures.push(row.id, message, attempts, delay);
        }
        if let Some(error) = first_error {
            self.counters.dead_lettered.fetch_add(dead, Ordering::Relaxed);
            warn!(
                failed = failures.ids.len(),
                delivered = published,
                sink = self.sink.name(),
                %error,
                "delivery failed; rows will be retried"
            );
        }
        (published, failures)
    }
}

impl Failures {
    fn push(&mut self, id: i64, error: String, attempts: i32, delay: Duration) {
        self.ids.push(id);
        self.errors.push(error);
        self.attempts.push(attempts);
        self.delay_ms.push(delay.as_secs_f64() * 1000.0);
    }
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
