//! Test-only pause points, switched on by `OUTBOX_FAILPOINT`.
//!
//! Crash tests need the relay stopped at an exact place (after the sink
//! acknowledged a batch, before the batch is marked) so they can `kill -9` it
//! there instead of hoping a sleep lines up. A failpoint logs that it was
//! reached and parks the relay forever; the test waits for the log line and
//! kills the process. With the variable unset this is one `Option` check per
//! batch.

use std::str::FromStr;

/// Where the relay can be parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failpoint {
    /// After the sink answered for a batch, before marking it published.
    PauseAfterDeliver,
}

impl FromStr for Failpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pause-after-deliver" => Ok(Self::PauseAfterDeliver),
            other => Err(format!(
                "unknown failpoint {other:?} in OUTBOX_FAILPOINT (known: pause-after-deliver)"
            )),
        }
    }
}

impl Failpoint {
    /// Logs and never returns.
    pub(crate) async fn park(self, rows: usize) {
        tracing::warn!(
            rows,
            "failpoint pause-after-deliver reached; parked before marking"
        );
        std::future::pending::<()>().await;
    }
}
