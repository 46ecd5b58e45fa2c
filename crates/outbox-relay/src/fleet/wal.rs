//! A fleet with `--source wal`: the URL's database read as one WAL stream
//! (one publication, one slot) for every tenant outbox the pattern finds,
//! instead of a hub with a relay loop per outbox. What is per outbox stays
//! so: each event goes to its outbox's sink (the fleet's), its delivery
//! is booked under its outbox's `outbox` label, and what the relay writes
//! back goes to its own table (see `source::wal::fleet`).
//!
//! Several processes: the slot is one reader's at a time, so one process
//! streams the database and the others stand by and take over when it
//! dies (the WAL source's turn). Discovery runs in the reader, every
//! `--discover-interval`, since adding a table to the publication and
//! backfilling it must happen between two reads of the stream.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{Fleet, dbname};
use crate::error::RelayError;
use crate::relay::Relay;
use crate::source::wal::Tenants;

/// Runs the fleet's log tailing until `cancel` fires.
pub(super) async fn run(fleet: &Fleet, cancel: CancellationToken) -> Result<(), RelayError> {
    let config = &fleet.shared.config;
    let database = dbname(&fleet.pg).to_owned();
    let schemas = config
        .schemas
        .clone()
        .expect("refused by Fleet::new without --schemas");
    tracing::info!(
        schemas = %schemas,
        database = %database,
        table = %config.relay.outbox.table.as_str(),
        sink = %fleet.shared.sink.describe(),
        discover_interval_ms = u64::try_from(config.discover_interval.as_millis()).unwrap_or(u64::MAX),
        "fleet starting (log tailing)"
    );
    let tenants = Tenants::new(schemas, database.clone(), false, config.discover_interval);
    let relay = Relay::for_fleet(
        fleet.pg.clone(),
        Arc::clone(&fleet.shared.sink),
        config.relay.clone(),
        database.clone(),
    );
    let health = Arc::clone(&fleet.shared.health);
    let ready = move || {
        health.postgres(&database, None);
        fleet.ready();
    };
    relay.run_wal_fleet(tenants, ready, cancel).await
}
