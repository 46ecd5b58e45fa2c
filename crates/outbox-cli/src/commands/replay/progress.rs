//! What a replay shows while it runs: a progress bar on a terminal, log
//! lines otherwise. (The pace is the engine's, `outbox_relay::replay`.)

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use outbox::sql::ReplayJob;

/// How often progress is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

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
