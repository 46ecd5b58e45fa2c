//! One run of a replay job: the paced page loop, its retries and the
//! cursor saved after each acknowledged page.

use std::time::{Duration, Instant};

use anyhow::Context;
use outbox::sql::{PageParams, ReplayJob, ReplaySql, ReplayState, SaveReplay};
use outbox_relay::Sink;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::pace::{Pace, Progress};

/// The largest page: one sink call, one statement.
const MAX_PAGE: i64 = 500;
/// Ids one page statement walks at most, so a selective filter never makes
/// a long statement: a page with no match just moves the cursor.
const MIN_WINDOW: i64 = 10_000;
/// Retries of a failing sink back off from this...
const BACKOFF_BASE: Duration = Duration::from_millis(200);
/// ...doubling up to this.
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A rate for people.
pub(super) struct Rate(pub(super) f64);

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_infinite() {
            f.write_str("unlimited rate")
        } else {
            write!(f, "{}/s", self.0)
        }
    }
}

/// One run of a job: the page loop.
pub(super) struct Replay<'a> {
    client: &'a Client,
    sql: &'a ReplaySql,
    sink: Box<dyn Sink>,
    job: ReplayJob,
    pace: Pace,
    page: i64,
    window: i64,
    max_attempts: i32,
    progress: Progress,
    /// Events acknowledged in this run.
    sent_now: i64,
    started: Instant,
    /// Test-only (`OUTBOX_FAILPOINT=replay-pause-after-id=N`): park once
    /// the sink acknowledged a page reaching id N, before its cursor is
    /// saved, so a test can kill the process with a page sent and unsaved.
    pause_after_id: Option<i64>,
}

/// How a run ended, short of an error.
pub(super) enum End {
    Done,
    Stopped,
}

impl<'a> Replay<'a> {
    pub(super) fn new(
        client: &'a Client,
        sql: &'a ReplaySql,
        sink: Box<dyn Sink>,
        job: ReplayJob,
        rate: f64,
        max_attempts: i32,
    ) -> Self {
        let page = if rate.is_finite() {
            // About ten pages a second: smooth pacing, few round trips.
            // Rates are positive and finite here; the cast saturates.
            #[allow(clippy::cast_possible_truncation)]
            let p = (rate / 10.0).ceil() as i64;
            p.clamp(1, MAX_PAGE)
        } else {
            MAX_PAGE
        };
        let progress = Progress::new(&job);
        Self {
            client,
            sql,
            sink,
            pace: Pace::new(rate),
            page,
            window: (page * 20).max(MIN_WINDOW),
            max_attempts,
            progress,
            sent_now: 0,
            started: Instant::now(),
            pause_after_id: std::env::var("OUTBOX_FAILPOINT")
                .ok()
                .and_then(|v| v.strip_prefix("replay-pause-after-id=")?.parse().ok()),
            job,
        }
    }

    pub(super) async fn run(mut self) -> anyhow::Result<()> {
        let cancel = crate::commands::shutdown_token()?;
        let end = self.pages(&cancel).await;
        self.progress.finish();
        let end = match end {
            Ok(end) => end,
            Err(e) => {
                // The job stays resumable from its cursor; record why it
                // failed if PostgreSQL still answers.
                let why = format!("{e:#}");
                let _ = self.save(ReplayState::Failed, Some(&why)).await;
                return Err(e.context(format!(
                    "replay job {} failed after id {}; fix the cause, then `outbox replay --resume {}`",
                    self.job.id, self.job.cursor_id, self.job.id
                )));
            }
        };
        let secs = self.started.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let per_sec = if secs > 0.0 {
            self.sent_now as f64 / secs
        } else {
            0.0
        };
        match end {
            End::Done => {
                self.save(ReplayState::Done, None).await?;
                println!(
                    "replay job {} done: matched {}, sent {} ({} in this run), removed by cleanup {}{}, {secs:.2} s, \
                     {per_sec:.0} events/s",
                    self.job.id,
                    self.job.matched,
                    self.job.sent,
                    self.sent_now,
                    if self.job.removed.exact { "" } else { "at most " },
                    self.job.removed.count,
                );
                self.removed_meanwhile().await?;
            }
            End::Stopped => {
                self.save(ReplayState::Stopped, None).await?;
                println!(
                    "replay job {} stopped after id {} (sent {} of {}; {} in this run, {secs:.2} s, {per_sec:.0} \
                     events/s); resume with `outbox replay --resume {}`",
                    self.job.id,
                    self.job.cursor_id,
                    self.job.sent,
                    self.job.matched,
                    self.sent_now,
                    self.job.id
                );
            }
        }
        Ok(())
    }

    /// Pages until the bound, a signal or a failure.
    pub(super) async fn pages(&mut self, cancel: &CancellationToken) -> anyhow::Result<End> {
        // The failing event and how often it failed (not counting
        // unavailable answers, which say nothing about it).
        let mut strikes: (i64, i32) = (0, 0);
        let mut outage = 0_u32;
        loop {
            if cancel.is_cancelled() {
                return Ok(End::Stopped);
            }
            let cursor = self.job.cursor_id;
            if cursor >= self.job.upto_id {
                return Ok(End::Done);
            }
            let through = cursor.saturating_add(self.window).min(self.job.upto_id);
            let rows = self
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
                .context("reading a page of events")?;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= self.page;
            let Some(last) = rows.last() else {
                self.job.cursor_id = through;
                self.save(ReplayState::Running, None).await?;
                continue;
            };
            // A full page may end before the window: the next starts after it.
            let next = if full { last.id } else { through };
            if !self.pace.admit(rows.len(), cancel).await {
                return Ok(End::Stopped);
            }
            // Not raced with the signal: the page is finished (every sink
            // call has a timeout) and its acknowledgements saved.
            let answers = self.sink.deliver(&rows).await;
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
                self.progress.sent(self.job.sent, self.job.cursor_id);
                outage = 0;
            }
            let Some(i) = failed else { continue };
            let row = &rows[i];
            let Err(error) = &answers[i] else {
                unreachable!("position found an error")
            };
            let what = format!(
                "event id {} (event_id {}, {}/{})",
                row.id, row.event_id, row.aggregate_type, row.aggregate_id
            );
            if !error.is_retryable() {
                anyhow::bail!("the sink refused {what}: {error}");
            }
            let delay = if error.is_unavailable() {
                outage += 1;
                tracing::warn!(sink = self.sink.name(), error = %error, "sink unavailable; retrying");
                backoff(outage)
            } else {
                strikes = if strikes.0 == row.id {
                    (row.id, strikes.1 + 1)
                } else {
                    (row.id, 1)
                };
                if strikes.1 >= self.max_attempts {
                    anyhow::bail!(
                        "the sink failed {what} {} times (--max-attempts): {error}",
                        strikes.1
                    );
                }
                tracing::warn!(event = %what, attempt = strikes.1, error = %error, "delivery failed; retrying");
                backoff(u32::try_from(strikes.1).unwrap_or(u32::MAX))
            };
            // Cancel-safe: a sleep.
            tokio::select! {
                () = cancel.cancelled() => return Ok(End::Stopped),
                () = tokio::time::sleep(delay) => {}
            }
            self.pace.reset();
        }
    }

    /// Saves the cursor, the count and the state: one UPDATE.
    pub(super) async fn save(&self, state: ReplayState, last_error: Option<&str>) -> anyhow::Result<()> {
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
            .context("saving the replay job's cursor")?;
        Ok(())
    }

    /// Warns if cleanup removed matching events while the job ran: those
    /// past the cursor then were never sent.
    pub(super) async fn removed_meanwhile(&self) -> anyhow::Result<()> {
        let now = self
            .sql
            .removed(self.client, &self.job.filter)
            .await
            .context("reading what cleanup removed")?;
        let more = now.count - self.job.removed.count;
        if more > 0 {
            eprintln!(
                "warning: cleanup removed {more} more matching events while replay job {} ran; those it had not \
                 sent yet were not sent",
                self.job.id
            );
        }
        Ok(())
    }
}

/// The delay before retry `n` (1-based): 200 ms doubling to 30 s.
pub(super) fn backoff(n: u32) -> Duration {
    BACKOFF_BASE
        .saturating_mul(2_u32.saturating_pow(n.saturating_sub(1)))
        .min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap() {
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(3), Duration::from_millis(800));
        assert_eq!(backoff(40), BACKOFF_MAX);
    }
}
