//! Replay: re-delivering published events to a sink, resumably, a page at
//! a time. The engine behind `outbox replay`, which parses the flags,
//! creates or resumes the job (its SQL is `outbox::sql::ReplaySql`'s),
//! shows progress and picks the exit code.
//!
//! Owns one run of a job: the paced page loop (`pace.rs`), the cursor
//! saved after each acknowledged page, and what a failed delivery does.
//! Failures go the relay's way, through its parts: the `Breaker` opens
//! when a page is all unavailable and probes the sink until it answers
//! (no attempt spent, unless the sink answers its probes but keeps failing
//! pages: then they count); `plan` turns the first failed row's answer
//! into its attempt count, retry delay and whether it is dead, by the
//! relay's [`Backoff`] and `--max-attempts`. A row the relay would make a
//! dead letter fails the job instead: replay marks nothing.
//!
//! What it keeps: every matching published row with an id up to the job's
//! bound is acknowledged by the sink at least once, with its original
//! `event_id`, in id order (so in order per aggregate: a page is sent only
//! after the previous one was acknowledged, and a failure is retried from
//! the failed row, never past it). The cursor is saved only after the
//! sink acknowledged everything up to it, so a crash or SIGKILL re-sends
//! at most the page in flight. Live delivery is untouched: no row is
//! claimed, locked or marked, and no transaction stays open while the sink
//! has a page.
//!
//! ```no_run
//! # async fn run(client: &tokio_postgres::Client, config: &outbox::Config) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_relay::replay::{End, Replay, Settings};
//! use tokio_util::sync::CancellationToken;
//!
//! let sql = outbox::sql::ReplaySql::new(config)?;
//! let job = sql.job(client, 3).await?.expect("job 3");
//! let sink = outbox_relay::sink::from_url("redis://127.0.0.1:6379", &Default::default())?;
//! let mut replay = Replay::new(client, &sql, sink, job, Settings::default());
//! let end = replay
//!     .run(&CancellationToken::new(), &mut |job| println!("sent {}", job.sent))
//!     .await?;
//! assert!(matches!(end, End::Done | End::Stopped));
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use outbox::OutboxRow;
use outbox::sql::{PageParams, ReplayJob, ReplaySql, ReplayState, SaveReplay};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::breaker::{Breaker, CircuitState, Probed};
use crate::error::error_chain;
use crate::plan::{self, Blocked, Outcome};
use crate::sink::{Delivery, DeliveryError, Sink};

mod pace;

use pace::Pace;

/// Events per second when no rate is given: about a fiftieth of what one
/// relay delivers to Redis at batch 100 (docs/bench.md), so the sink and
/// PostgreSQL keep nearly all their room for live delivery, and still 3.6
/// million events an hour.
pub const DEFAULT_RATE: f64 = 1000.0;

/// A rate as people write it: `N/s`, `N` (events per second, positive),
/// or `unlimited` (infinite), for `outbox replay --rate` and the console's
/// replay form.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let s = s.trim();
    if s == "unlimited" {
        return Ok(f64::INFINITY);
    }
    let n = s.strip_suffix("/s").unwrap_or(s);
    match n.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a rate (examples: 500/s, 2000, unlimited)")),
    }
}

/// The largest page: one sink call, one statement.
const MAX_PAGE: i64 = 500;

/// Ids one page statement walks at most, so a selective filter never makes
/// a long statement: a page with no match just moves the cursor.
const MIN_WINDOW: i64 = 10_000;

/// How a run goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Events per second at most ([`DEFAULT_RATE`]; infinite: unpaced).
    pub rate: f64,
    /// Retry delays of a failed event, and how many attempts fail the job
    /// (the relay's `--max-attempts`).
    pub backoff: Backoff,
    /// Test-only (`OUTBOX_FAILPOINT=replay-pause-after-id=N`): park once
    /// the sink acknowledged a page reaching id N, before its cursor is
    /// saved, so a test can kill the process with a page sent and unsaved.
    pub pause_after_id: Option<i64>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            rate: DEFAULT_RATE,
            backoff: Backoff::default(),
            pause_after_id: None,
        }
    }
}

/// How a run ended, short of an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Every row up to the job's bound was acknowledged.
    Done,
    /// Cancelled: the cursor is saved, the job is resumable.
    Stopped,
}

/// Why a run failed. The job is saved as failed with this as its
/// `last_error`, and resumes from its cursor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A statement failed (`doing` says which).
    #[error("{doing}")]
    Postgres {
        /// What was being done: `reading a page of events`.
        doing: &'static str,
        /// PostgreSQL's error.
        source: tokio_postgres::Error,
    },
    /// The sink refused an event permanently.
    #[error("the sink refused {event}: {error}")]
    Refused {
        /// The event: `event id 250 (event_id …, orders/42)`.
        event: String,
        /// The sink's answer.
        error: DeliveryError,
    },
    /// An event failed `--max-attempts` times.
    #[error("the sink failed {event} {attempts} times (--max-attempts): {error}")]
    Exhausted {
        /// The event, as in [`ReplayError::Refused`].
        event: String,
        /// Attempts made in this run.
        attempts: i32,
        /// The last answer.
        error: DeliveryError,
    },
    /// An event still failed when its retry window (`--retry-for`, from
    /// its first failed attempt in this run) ended.
    #[error(
        "the sink failed {event} {attempts} times over {} (--retry-for): {error}",
        humantime::format_duration(.window.to_owned())
    )]
    Expired {
        /// The event, as in [`ReplayError::Refused`].
        event: String,
        /// Attempts made in this run.
        attempts: i32,
        /// The window that ended.
        window: Duration,
        /// The last answer.
        error: DeliveryError,
    },
}

/// The row failing in a run: its id, its attempts in this run, its first
/// failed attempt.
type Failing = (i64, i32, Option<chrono::DateTime<chrono::Utc>>);

/// A failed statement, saying what it was doing.
fn postgres(doing: &'static str) -> impl FnOnce(tokio_postgres::Error) -> ReplayError {
    move |source| ReplayError::Postgres { doing, source }
}

/// One run of a job: the page loop.
pub struct Replay<'a> {
    client: &'a Client,
    sql: &'a ReplaySql,
    sink: Box<dyn Sink>,
    job: ReplayJob,
    pace: Pace,
    page: i64,
    window: i64,
    backoff: Backoff,
    /// Events acknowledged in this run.
    sent_now: i64,
    pause_after_id: Option<i64>,
}

impl<'a> Replay<'a> {
    /// A run of `job` (created or resumed, and locked, by the caller) to
    /// `sink`, from the job's cursor.
    pub fn new(
        client: &'a Client,
        sql: &'a ReplaySql,
        sink: Box<dyn Sink>,
        job: ReplayJob,
        settings: Settings,
    ) -> Self {
        let rate = settings.rate;
        let page = if rate.is_finite() {
            // About ten pages a second: smooth pacing, few round trips.
            // Rates are positive and finite here; the cast saturates.
            #[allow(clippy::cast_possible_truncation)]
            let p = (rate / 10.0).ceil() as i64;
            p.clamp(1, MAX_PAGE)
        } else {
            MAX_PAGE
        };
        Self {
            client,
            sql,
            sink,
            job,
            pace: Pace::new(rate),
            page,
            window: (page * 20).max(MIN_WINDOW),
            backoff: settings.backoff,
            sent_now: 0,
            pause_after_id: settings.pause_after_id,
        }
    }

    /// The job as it stands: its cursor and counts.
    pub fn job(&self) -> &ReplayJob {
        &self.job
    }

    /// Events the sink acknowledged in this run.
    pub fn sent_now(&self) -> i64 {
        self.sent_now
    }

    /// Pages until the job's bound, `cancel`, or a failure, calling
    /// `progress` after each saved page; saves the job's state at the end
    /// (done, stopped, or failed with the error as its `last_error`).
    pub async fn run(
        &mut self,
        cancel: &CancellationToken,
        progress: &mut (dyn FnMut(&ReplayJob) + Send),
    ) -> Result<End, ReplayError> {
        match self.pages(cancel, progress).await {
            Ok(end) => {
                let state = match end {
                    End::Done => ReplayState::Done,
                    End::Stopped => ReplayState::Stopped,
                };
                self.save(state, None).await?;
                Ok(end)
            }
            Err(error) => {
                // The job stays resumable from its cursor; record why it
                // failed if PostgreSQL still answers.
                let _ = self.save(ReplayState::Failed, Some(&error_chain(&error))).await;
                Err(error)
            }
        }
    }

    /// Matching events cleanup removed since the job was created: those
    /// past the cursor then were never sent.
    pub async fn removed_meanwhile(&self) -> Result<i64, ReplayError> {
        let now = self
            .sql
            .removed(self.client, &self.job.filter)
            .await
            .map_err(postgres("reading what cleanup removed"))?;
        Ok(now.count - self.job.removed.count)
    }

    /// Pages until the bound, a signal or a failure.
    async fn pages(
        &mut self,
        cancel: &CancellationToken,
        progress: &mut (dyn FnMut(&ReplayJob) + Send),
    ) -> Result<End, ReplayError> {
        let mut breaker = Breaker::new(self.sink.name(), None);
        if self.sink.has_route_breakers() {
            breaker = breaker.over_routes();
        }
        // The failing row, its attempts in this run and its first failed
        // attempt: replay marks nothing, so they live here, where the
        // relay's live in the row.
        let mut failing: Failing = (0, 0, None);
        loop {
            if cancel.is_cancelled() {
                return Ok(End::Stopped);
            }
            if breaker.state() == CircuitState::Open {
                if let Probed::Cancelled = breaker.wait(self.sink.as_ref(), cancel).await {
                    return Ok(End::Stopped);
                }
                self.pace.reset();
            }
            let cursor = self.job.cursor_id;
            if cursor >= self.job.upto_id {
                return Ok(End::Done);
            }
            let through = cursor.saturating_add(self.window).min(self.job.upto_id);
            let mut rows = self
                .sql
                .page(
                    self.client,
                    &PageParams {
                        filter: &self.job.filter,
                        after_id: cursor,
                        through_id: through,
                        limit: self.page,
                    },
                )
                .await
                .map_err(postgres("reading a page of events"))?;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= self.page;
            let Some(last) = rows.last() else {
                self.job.cursor_id = through;
                self.save(ReplayState::Running, None).await?;
                continue;
            };
            // A full page may end before the window: the next starts after it.
            let next = if full { last.id } else { through };
            // A row's attempts are this run's, not the outbox's (those were
            // the live relay's, before it was published).
            for row in &mut rows {
                (row.attempts, row.first_failed_at) = if row.id == failing.0 {
                    (failing.1, failing.2)
                } else {
                    (0, None)
                };
            }
            if !self.pace.admit(rows.len(), cancel).await {
                return Ok(End::Stopped);
            }
            // Not raced with the signal: the page is finished (every sink
            // call has a timeout) and its acknowledgements saved.
            let mut answers = self.sink.deliver(&rows).await;
            // A page all unavailable opens the breaker: the loop's top
            // waits for the sink. After repeated strikes it turns the
            // answers into retryable failures, which cost attempts.
            breaker.record(&mut answers);
            let failed = answers.iter().position(Result::is_err);
            let acked = failed.unwrap_or(rows.len());
            if let Some(at) = self.pause_after_id
                && acked > 0
                && rows[acked - 1].id >= at
            {
                tracing::warn!("failpoint replay-pause-after-id reached; parked before saving the cursor");
                outbox::notify::send("OUTBOX_FAILPOINT=replay-pause-after-id reached");
                std::future::pending::<()>().await;
            }
            if acked > 0 {
                self.job.cursor_id = if failed.is_none() {
                    next
                } else {
                    rows[acked - 1].id
                };
                let n = i64::try_from(acked).unwrap_or(i64::MAX);
                self.job.sent += n;
                self.sent_now += n;
                self.save(ReplayState::Running, None).await?;
                progress(&self.job);
            }
            let Some(i) = failed else { continue };
            let delay = self.retry(&rows[i], &answers[i], &mut failing)?;
            if breaker.state() == CircuitState::Open {
                // The loop's top waits for the sink instead.
                continue;
            }
            // Cancel-safe: a sleep.
            tokio::select! {
                () = cancel.cancelled() => return Ok(End::Stopped),
                () = tokio::time::sleep(delay) => {}
            }
            self.pace.reset();
        }
    }

    /// The first failed row of a page, planned as the relay plans it: the
    /// job fails where the relay would make a dead letter; otherwise how
    /// long to wait before the page is read again from this row (the
    /// relay's backoff; one probe interval if the sink was unavailable).
    /// Only this row is planned: every row after it is sent again anyway.
    fn retry(
        &self,
        row: &OutboxRow,
        answer: &Delivery,
        failing: &mut Failing,
    ) -> Result<Duration, ReplayError> {
        let Err(error) = answer else {
            unreachable!("the first failed row failed")
        };
        let planned = plan::decide(
            self.backoff,
            self.sink.as_ref(),
            std::slice::from_ref(row),
            vec![Outcome::Sent(answer.clone())],
            &Blocked::new(),
        );
        let f = &planned.failures;
        let (attempts, dead) = (f.attempts[0], f.dead_letter[0]);
        let event = || {
            format!(
                "event id {} (event_id {}, {}/{})",
                row.id, row.event_id, row.aggregate_type, row.aggregate_id
            )
        };
        if dead && !error.is_retryable() {
            return Err(ReplayError::Refused {
                event: event(),
                error: error.clone(),
            });
        }
        if dead && attempts >= self.backoff.max_attempts {
            return Err(ReplayError::Exhausted {
                event: event(),
                attempts,
                error: error.clone(),
            });
        }
        if dead {
            return Err(ReplayError::Expired {
                event: event(),
                attempts,
                window: self.backoff.retry_for,
                error: error.clone(),
            });
        }
        // An unavailable answer spends no attempt.
        if attempts > row.attempts {
            *failing = (row.id, attempts, f.first_failed[0]);
            tracing::warn!(event = %event(), attempt = attempts, %error, "delivery failed; retrying");
        }
        // A row the sink did not try (behind an unavailable one) has no
        // delay of its own: wait at least the first retry's.
        Ok(Duration::from_secs_f64(f.delay_ms[0] / 1000.0).max(self.backoff.base))
    }

    /// Saves the cursor, the count and the state: one UPDATE.
    async fn save(&self, state: ReplayState, last_error: Option<&str>) -> Result<(), ReplayError> {
        self.sql
            .save_job(
                self.client,
                &SaveReplay {
                    id: self.job.id,
                    cursor_id: self.job.cursor_id,
                    sent: self.job.sent,
                    state,
                    last_error,
                },
            )
            .await
            .map_err(postgres("saving the replay job's cursor"))?;
        Ok(())
    }
}
