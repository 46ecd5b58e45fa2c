//! `outbox relay --retention`: cleanup or partition maintenance on a
//! schedule, inside the relay process, by one relay at a time.
//!
//! Every relay runs the schedule, but a run first takes a session advisory
//! lock on its own connection (`pg_try_advisory_lock`), so with several
//! relays one does the work and the others skip that round. Failures are
//! logged and retried next round; they never stop delivery.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Batch size of `--retention` deletes on a plain outbox.
const BATCH: i64 = 10_000;
/// The first run waits this long, so a restarting fleet does not all clean
/// up at once at startup and delivery comes first.
const FIRST_RUN: Duration = Duration::from_secs(5);

pub(crate) async fn run(
    pg: tokio_postgres::Config,
    config: outbox::Config,
    keep: Duration,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut wait = FIRST_RUN.min(interval);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = interval;
        if let Err(error) = once(&pg, &config, keep).await {
            warn!(
                error = format!("{error:#}"),
                "retention failed; retrying next round"
            );
        }
    }
}

async fn once(pg: &tokio_postgres::Config, config: &outbox::Config, keep: Duration) -> anyhow::Result<()> {
    let mut client = super::connect(pg).await?;
    let locked: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('outbox retention ' || $1))",
            &[&config.qualified()],
        )
        .await?
        .get(0);
    if !locked {
        info!("retention skipped: another relay is running it");
        return Ok(());
    }
    match outbox::existing_layout(&client, config).await? {
        Some(outbox::Layout::Daily) => {
            let done = outbox::partitions::maintain(&mut client, config, Some(keep), 3).await?;
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
            let done = outbox::retention::delete_published(&client, config, keep, BATCH, |_| {}).await?;
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
