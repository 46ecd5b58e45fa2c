//! Test-only pause points, switched on by `OUTBOX_FAILPOINT`.
//!
//! Crash tests need the relay stopped at an exact place (after the sink
//! acknowledged a batch, before the batch is marked) so they can `kill -9` it
//! there, or freeze it there, instead of hoping a sleep lines up. A failpoint
//! logs that it was reached, sends `OUTBOX_FAILPOINT=<name> reached` to
//! `NOTIFY_SOCKET` (see `outbox::notify`) and parks the relay: for ever, or
//! once for a while. With the variable unset this is one `Option` check per batch.
//!
//! Not the `fail` crate: its `pause` and `sleep` block the OS thread (here a
//! tokio worker, which other tasks share), it sends nothing a test could
//! wait on, and its points compile to nothing without a feature, while the
//! crash tests drive the binary as shipped.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Where the relay can be parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failpoint {
    /// After the sink acknowledged rows of a batch, before marking it
    /// published: parks for ever.
    PauseAfterDeliver,
    /// The same place, once per process, for this long; then the relay goes
    /// on to commit (`sleep-after-deliver-ms=N`).
    SleepAfterDeliver(Duration),
}

impl FromStr for Failpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || {
            format!(
                "unknown failpoint {s:?} in OUTBOX_FAILPOINT \
                 (known: pause-after-deliver, sleep-after-deliver-ms=N)"
            )
        };
        match s.split_once('=') {
            None if s == "pause-after-deliver" => Ok(Self::PauseAfterDeliver),
            Some(("sleep-after-deliver-ms", ms)) => ms
                .parse()
                .map(|ms| Self::SleepAfterDeliver(Duration::from_millis(ms)))
                .map_err(|_| unknown()),
            _ => Err(unknown()),
        }
    }
}

/// Whether the one-shot sleep already happened.
static SLEPT: AtomicBool = AtomicBool::new(false);

impl Failpoint {
    /// Logs, tells `NOTIFY_SOCKET` (`OUTBOX_FAILPOINT=<name> reached`, and
    /// `… over` when a sleep ends) and parks, once the sink acknowledged
    /// `acked` of the batch's `rows`.
    ///
    /// A batch the sink acknowledged none of passes: a test that kills the
    /// relay here means to leave sent rows unmarked, and a batch the sink
    /// refused, could not take (an outage begun since the test looked) or
    /// never saw (rows kept back, a lease lapsed) would re-send nothing.
    pub(crate) async fn park(self, rows: usize, acked: usize, signals: &crate::Signals) {
        if acked == 0 {
            return;
        }
        match self {
            Self::PauseAfterDeliver => {
                tracing::warn!(
                    rows,
                    acked,
                    "failpoint pause-after-deliver reached; parked before marking"
                );
                signals.send("OUTBOX_FAILPOINT=pause-after-deliver reached");
                std::future::pending::<()>().await;
            }
            Self::SleepAfterDeliver(d) => {
                if SLEPT.swap(true, Ordering::Relaxed) {
                    return;
                }
                tracing::warn!(
                    rows,
                    acked,
                    seconds = d.as_secs_f64(),
                    "failpoint sleep-after-deliver reached; sleeping before marking"
                );
                signals.send("OUTBOX_FAILPOINT=sleep-after-deliver reached");
                tokio::time::sleep(d).await;
                tracing::warn!("failpoint sleep-after-deliver over; committing");
                signals.send("OUTBOX_FAILPOINT=sleep-after-deliver over");
            }
        }
    }
}
