//! How fast a replay goes: the pacer over pages.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

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

    /// After a wait for the sink: the pace starts again, no burst.
    pub(super) fn reset(&mut self) {
        self.since = Instant::now();
        self.admitted = 0.0;
    }
}
