//! Watching the slot: its state read every few seconds on a connection of
//! its own, for the gauges (`outbox_wal_retained_bytes`,
//! `outbox_wal_lag_bytes`) and the warning above `--wal-retained-warn`.
//! Not what happens when the slot is gone or invalidated: the stream fails
//! then (PostgreSQL ends the session of a slot it invalidates; a failover
//! ends every session), and the source finds out when it opens it again
//! (`backfill`).
//!
//! A task of its own because the relay loop stops calling the source while
//! a sink is down, which is exactly when the retained WAL grows and the
//! warning must fire.

use std::sync::Arc;
use std::time::Duration;

use metrics::Gauge;
use outbox::sql::{SlotState, WalSql};
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::error::error_chain;
use crate::metric;
use crate::pg::PgConfig;

/// How often the slot's state is read.
const EVERY: Duration = Duration::from_secs(5);

/// The running watch. Dropping it stops the task.
pub(crate) struct SlotWatch {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Drop for SlotWatch {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

impl SlotWatch {
    /// Starts watching `sql`'s slot; warns above `retained_warn` bytes. A
    /// fleet's slot (one per database) is labelled with its `database`.
    pub(crate) fn start(
        pg: PgConfig,
        sql: Arc<WalSql>,
        retained_warn: u64,
        ctx: &crate::RelayContext,
        database: Option<String>,
    ) -> SlotWatch {
        let stop = CancellationToken::new();
        let mut labels = vec![ctx.label(), ("slot", sql.slot().to_owned())];
        labels.extend(database.map(|d| ("database", d)));
        let gauges = Gauges {
            retained: metrics::gauge!(metric::WAL_RETAINED, &labels[..]),
            lag: metrics::gauge!(metric::WAL_LAG, &labels[..]),
        };
        let task = tokio::spawn(run(pg, sql, retained_warn, gauges, stop.clone()));
        SlotWatch { stop, task }
    }
}

struct Gauges {
    retained: Gauge,
    lag: Gauge,
}

async fn run(pg: PgConfig, sql: Arc<WalSql>, retained_warn: u64, gauges: Gauges, stop: CancellationToken) {
    let mut client: Option<Client> = None;
    let mut over = false;
    loop {
        if client.as_ref().is_none_or(Client::is_closed) {
            client = crate::pg::connect_once(&pg).await.ok();
        }
        if let Some(c) = &client {
            match sql.slot_state(c).await {
                // Gone or invalidated: the source makes it again; the
                // gauges wait for that.
                Ok(state) => {
                    if let Some(state) = state.filter(|s| !s.is_lost()) {
                        over = show(&state, &gauges, retained_warn, over);
                    }
                }
                Err(error) => {
                    warn!(error = %error_chain(&error), "reading the replication slot's state failed");
                    client = None;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(EVERY) => {}
        }
    }
}

/// Sets the gauges and warns when the retained WAL crosses the limit;
/// returns whether it is over.
fn show(state: &SlotState, gauges: &Gauges, retained_warn: u64, was_over: bool) -> bool {
    // Bytes: exact in an f64 up to 8 PiB.
    #[allow(clippy::cast_precision_loss)]
    {
        gauges.retained.set(state.retained_bytes as f64);
        gauges.lag.set(state.lag_bytes as f64);
    }
    let over = u64::try_from(state.retained_bytes).unwrap_or(0) > retained_warn;
    if over && !was_over {
        warn!(
            slot = %state.slot,
            retained_bytes = state.retained_bytes,
            limit = retained_warn,
            "the slot holds back more WAL than --wal-retained-warn: is the sink down, or the relay too slow?"
        );
    } else if !over && was_over {
        info!(
            slot = %state.slot,
            retained_bytes = state.retained_bytes,
            "the slot's retained WAL is below --wal-retained-warn again"
        );
    }
    over
}
