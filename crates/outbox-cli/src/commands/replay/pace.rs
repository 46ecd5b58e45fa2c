//! How fast a replay goes and what it shows meanwhile: the pacer and the
//! progress bar (or log lines).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use outbox::sql::ReplayJob;
use tokio_util::sync::CancellationToken;

/// How often progress is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// The pacer: events go out no faster than the rate, page by page.
pub(super) struct Pace {
    rate: f64,
    since: Instant,
    /// Events admitted since `since`.
    admitted: f64,
}

impl Pace {
    pub(super) fn new(rate: f64) -> Self {
        Self {
            rate,
            since: Instant::now(),
            admitted: 0.0,
        }
    }

    /// Waits until `n` more events may go; false if cancelled meanwhile.
    /// A page goes at the time its first event is due, so the average over
    /// the run is the rate.
    pub(super) async fn admit(&mut self, n: usize, cancel: &CancellationToken) -> bool {
        if self.rate.is_infinite() {
            return true;
        }
        let due = self.since + Duration::from_secs_f64(self.admitted / self.rate);
        let now = Instant::now();
        // Behind by more than a second (a slow sink): start again rather
        // than burst to catch up.
        if now > due + Duration::from_secs(1) {
            self.reset();
        }
        #[allow(clippy::cast_precision_loss)]
        {
            self.admitted += n as f64;
        }
        // Cancel-safe: a sleep.
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep_until(due.max(now).into()) => true,
        }
    }

    pub(super) fn reset(&mut self) {
        self.since = Instant::now();
        self.admitted = 0.0;
    }
}

/// A bar with an ETA on a terminal, a log line every few seconds otherwise.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    matched: i64,
    last_log: Instant,
}

impl Progress {
    pub(super) fn new(job: &ReplayJob) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(u64::try_from(job.matched).unwrap_or(0)),
                ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:40} {pos}/{len} events, {per_sec}, ETA {eta} (after id {msg})",
            ) {
                bar.set_style(style);
            }
            bar.set_position(u64::try_from(job.sent).unwrap_or(0));
            bar.reset_eta();
            bar
        });
        Self {
            bar,
            matched: job.matched,
            last_log: Instant::now(),
        }
    }

    pub(super) fn sent(&mut self, sent: i64, cursor: i64) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(u64::try_from(sent).unwrap_or(0));
                bar.set_message(cursor.to_string());
            }
            None if self.last_log.elapsed() >= LOG_EVERY => {
                self.last_log = Instant::now();
                tracing::info!(sent, matched = self.matched, cursor, "replay progress");
            }
            None => {}
        }
    }

    pub(super) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
