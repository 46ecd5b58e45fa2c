//! A fleet with `--source wal`: each database read as one WAL stream (one
//! publication, one slot) for every tenant outbox the pattern finds in it,
//! instead of a hub with a relay loop per outbox. What is per outbox stays
//! so: each event goes to its outbox's sink (the fleet's), its delivery
//! is booked under its outbox's `outbox` label, and what the relay writes
//! back goes to its own table (see `source::wal::fleet`).
//!
//! Several processes: the slot is one reader's at a time, so one process
//! streams a database and the others stand by and take over when it dies
//! (the WAL source's turn). Discovery runs in the reader, every
//! `--discover-interval`, since adding a table to the publication and
//! backfilling it must happen between two reads of the stream. With
//! `--databases`, `Fleet::run_databases` starts and stops one such
//! stream per database as databases come and go.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info};

use super::{Fleet, Shared, dbname};
use crate::error::{RelayError, error_chain};
use crate::pg::PgConfig;
use crate::relay::Relay;
use crate::source::wal::Tenants;

/// Runs the log tailing of the URL's database until `cancel` fires; a
/// failure (the server or the role cannot do log tailing) stops the fleet.
pub(super) async fn run(fleet: &Fleet, cancel: CancellationToken) -> Result<(), RelayError> {
    let database = dbname(&fleet.pg).to_owned();
    run_database(
        &fleet.shared,
        fleet.pg.clone(),
        database,
        false,
        || fleet.ready(),
        cancel,
    )
    .await
}

/// Runs the log tailing of one database `--databases` found until `cancel`
/// fires (the database gone, or shutdown); tells `first` once its source
/// is open. A failure is logged: the other databases go on.
pub(super) async fn serve_database(
    shared: Arc<Shared>,
    pg: PgConfig,
    database: String,
    cancel: CancellationToken,
    first: oneshot::Sender<()>,
) {
    let span = tracing::info_span!("database", database = %database);
    let ready = move || {
        let _ = first.send(());
    };
    let result = run_database(&shared, pg, database, true, ready, cancel)
        .instrument(span)
        .await;
    if let Err(error) = result {
        error!(error = %error_chain(&error), "the database's log tailing stopped");
    }
}

/// One database's stream: a relay over a fleet WAL source; labels name
/// the database if `prefixed`.
async fn run_database(
    shared: &Shared,
    pg: PgConfig,
    database: String,
    prefixed: bool,
    ready: impl FnOnce() + Send,
    cancel: CancellationToken,
) -> Result<(), RelayError> {
    let config = &shared.config;
    let schemas = config
        .schemas
        .clone()
        .expect("refused by Fleet::new without --schemas");
    info!(
        schemas = %schemas,
        database = %database,
        table = %config.relay.outbox.table.as_str(),
        sink = %shared.sink.describe(),
        discover_interval_ms = u64::try_from(config.discover_interval.as_millis()).unwrap_or(u64::MAX),
        "fleet starting (log tailing)"
    );
    let tenants = Tenants::new(schemas, database.clone(), prefixed, config.discover_interval);
    let relay = Relay::for_fleet(
        pg,
        Arc::clone(&shared.sink),
        config.relay.clone(),
        database.clone(),
        shared.tracing.as_ref(),
    );
    let health = Arc::clone(&shared.health);
    let ready = move || {
        health.postgres(&database, None);
        ready();
    };
    relay.run_wal_fleet(tenants, ready, cancel).await
}
