//! Scheduled retention (`outbox relay --retention`): cleanup or partition
//! maintenance inside the relay process, by one relay at a time.
//!
//! Every relay runs the schedule, but a run first takes a session advisory
//! lock on its own connection (`pg_try_advisory_lock`), so with several
//! relays one does the work and the others skip that round. Failures are
//! logged and retried next round; they never stop delivery.

use std::time::Duration;

use outbox::Config;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::error::error_chain;

/// Batch size of scheduled deletes on a plain outbox.
const BATCH: i64 = 10_000;
/// The first run waits this long, so a restarting fleet does not all clean
/// up at once at startup and delivery comes first.
const FIRST_RUN: Duration = Duration::from_secs(5);

/// What scheduled retention keeps and how often it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Published rows (or daily partitions) older than this go.
    pub keep: Duration,
    /// Time between runs.
    pub interval: Duration,
}

/// Why one run failed; the schedule logs it and tries again next round.
#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error("connecting to postgres")]
    Connect(#[source] tokio_postgres::Error),
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
}

impl Retention {
    /// Runs every `interval` until `cancel`, on a connection of its own
    /// per run. Never fails: errors are logged and retried next round.
    pub async fn run(self, pg: crate::pg::PgConfig, config: Config, cancel: CancellationToken) {
        let mut wait = FIRST_RUN.min(self.interval);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            wait = self.interval;
            if let Err(error) = self.once(&pg, &config).await {
                warn!(error = %error_chain(&error), "retention failed; retrying next round");
            }
        }
    }

    async fn once(&self, pg: &crate::pg::PgConfig, config: &Config) -> Result<(), RunError> {
        let mut client = crate::pg::connect_once(pg).await.map_err(RunError::Connect)?;
        if !outbox::retention::try_lock(&client, config).await? {
            info!("retention skipped: another relay is running it");
            return Ok(());
        }
        match outbox::existing_layout(&client, config).await? {
            Some(outbox::Layout::Daily) => {
                let done = outbox::partitions::maintain(&mut client, config, Some(self.keep), 3).await?;
                info!(
                    created = done.created.len(),
                    dropped = done.dropped.len(),
                    kept = done.kept.len(),
                    busy = done.busy.len(),
                    in_default = done.in_default,
                    "partition maintenance done"
                );
                for (name, unpublished) in &done.kept {
                    warn!(partition = %name, unpublished, "past partition kept: it holds unpublished rows");
                }
            }
            _ => {
                let done =
                    outbox::retention::delete_published(&client, config, self.keep, BATCH, |_| {}).await?;
                info!(
                    deleted = done.deleted,
                    batches = done.batches,
                    "retention cleanup done"
                );
            }
        }
        // Closing the connection releases the advisory lock.
        Ok(())
    }
}
