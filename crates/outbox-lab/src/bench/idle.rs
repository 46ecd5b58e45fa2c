//! Idle cost: transactions a relay with nothing to do commits per second,
//! from `pg_stat_database.xact_commit`.
//!
//! Backends publish their counters lazily (PostgreSQL 15 flushes an idle
//! backend's stats up to 10 s late, and skips a flush when no relation
//! stats are pending), but when they exit. So each figure is the difference
//! of two whole relay lifetimes read after the relay exited: one that idles
//! `seconds`, one that stops at once. Start-up, shutdown and the bench's own
//! reads cancel out; what is left is idling.
//! Other clients of the same database (and autovacuum) add noise, which is
//! why this runs on a quiet, empty scratch table.

use std::time::Duration;

use serde::Serialize;

use crate::latency::Wakeup;
use crate::scratch::Scratch;

/// What one idle measurement found.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct IdleRun {
    /// Transactions of a relay idling `seconds`, minus one that stopped at once.
    pub(super) transactions: i64,
    pub(super) seconds: f64,
    pub(super) per_second: f64,
}

pub(super) async fn measure(scratch: &mut Scratch, wakeup: Wakeup, seconds: f64) -> anyhow::Result<IdleRun> {
    scratch.clear().await?;
    let idle = lifetime_transactions(scratch, wakeup, Duration::from_secs_f64(seconds)).await?;
    let baseline = lifetime_transactions(scratch, wakeup, Duration::ZERO).await?;
    let transactions = idle - baseline;
    Ok(IdleRun {
        transactions,
        seconds,
        per_second: transactions as f64 / seconds,
    })
}

/// Transactions committed in the database while one relay lived `idle` past
/// its start-up, counted once its backend is gone.
async fn lifetime_transactions(scratch: &mut Scratch, wakeup: Wakeup, idle: Duration) -> anyhow::Result<i64> {
    let before = xact_commit(scratch).await?;
    let args = wakeup.relay_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = scratch.spawn_bench_relay(&args).await?;
    // The backend outlives the process by a moment; its counters are
    // published as it exits.
    let gone = "SELECT count(*) FROM pg_stat_activity \
                WHERE application_name LIKE 'outbox-relay%' AND datname = current_database()";
    // Each probe is two transactions of ours (prepare, execute), and their
    // number varies.
    let probes = 2 * scratch.idle_and_stop(relay, idle, gone).await?;
    // Leaving pg_stat_activity and publishing the counters are two steps of
    // the backend's exit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(xact_commit(scratch).await? - before - probes)
}

/// The database's committed transactions, with this backend's own flushed
/// first (`pg_stat_force_next_flush`, PostgreSQL 15+; older servers publish
/// through the stats collector within half a second).
async fn xact_commit(scratch: &Scratch) -> anyhow::Result<i64> {
    // A backend skips its flush when no relation stats are pending, keeping
    // its transaction count for later; reading pg_database makes some.
    let _ = scratch
        .db
        .batch_execute("SELECT pg_stat_force_next_flush() FROM pg_database LIMIT 1")
        .await;
    let row = scratch
        .db
        .query_one(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok(row.get(0))
}
