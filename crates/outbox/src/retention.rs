//! Retention: deleting published outbox rows and old inbox records in
//! batches, each batch its own short transaction, so cleanup never holds
//! locks for long, never bloats one transaction's WAL, and can be stopped
//! at any point without losing work already done.
//!
//! What it never deletes: an unpublished row or a dead letter (their
//! `published_at` is NULL). What it deletes leaves a trace: counts per
//! aggregate type, event type and hour in `<table>_removed`, written by the
//! same statement, which `outbox replay` reads to say how many matching
//! events were no longer there. Inbox records must outlive any redelivery of
//! their event; keep them longer than the longest outage you retry through.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::sql::typed::typed;
use crate::sql::{CUTOFF, InboxSql, OutboxSql, RETENTION_LOCK};
use crate::{Config, Error, InboxConfig};

/// What a cleanup deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cleanup {
    /// Rows deleted.
    pub deleted: u64,
    /// Transactions (batches) it took.
    pub batches: u64,
}

/// Deletes published outbox rows whose `published_at` is older than
/// `older_than`, `batch_size` rows per transaction. `progress` is called
/// after each batch with the running total. Run it on a connection that is
/// not inside a transaction: each batch commits on its own.
pub async fn delete_published<C: GenericClient>(
    client: &C,
    config: &Config,
    older_than: Duration,
    batch_size: i64,
    mut progress: impl FnMut(u64),
) -> Result<Cleanup, Error> {
    let sql = OutboxSql::new(config);
    let cutoff = cutoff(client, older_than).await?;
    let mut done = Cleanup {
        deleted: 0,
        batches: 0,
    };
    let mut last_id = 0i64;
    loop {
        // Unnamed, each batch its own transaction: one round trip each, and
        // nothing left on a session a transaction-mode pooler shares.
        let row = client
            .query_typed_one(
                &sql.delete_published,
                &[typed(&last_id), typed(&cutoff), typed(&batch_size)],
            )
            .await
            .map_err(Error::pg("deleting published outbox rows"))?;
        let deleted: i64 = row.get(0);
        if deleted == 0 {
            return Ok(done);
        }
        last_id = row.get(1);
        done.deleted += deleted as u64;
        done.batches += 1;
        progress(done.deleted);
    }
}

/// Deletes inbox records processed longer ago than `older_than`, in batches
/// as [`delete_published`] does.
pub async fn delete_processed<C: GenericClient>(
    client: &C,
    config: &InboxConfig,
    older_than: Duration,
    batch_size: i64,
    mut progress: impl FnMut(u64),
) -> Result<Cleanup, Error> {
    let sql = InboxSql::new(config);
    let cutoff = cutoff(client, older_than).await?;
    let mut done = Cleanup {
        deleted: 0,
        batches: 0,
    };
    loop {
        let deleted: i64 = client
            .query_typed_one(&sql.delete_processed, &[typed(&cutoff), typed(&batch_size)])
            .await
            .map_err(Error::pg("deleting processed inbox records"))?
            .get(0);
        if deleted == 0 {
            return Ok(done);
        }
        done.deleted += deleted as u64;
        done.batches += 1;
        progress(done.deleted);
    }
}

/// Takes the session advisory lock that lets one process at a time run
/// scheduled retention on `config`'s table; false if another holds it.
/// Closing the connection releases it. Not through a transaction-mode
/// pooler: the lock would stay on a server connection the pooler keeps.
pub async fn try_lock<C: GenericClient>(client: &C, config: &Config) -> Result<bool, Error> {
    client
        .query_one(RETENTION_LOCK, &[&config.qualified()])
        .await
        .and_then(|row| row.try_get(0))
        .map_err(Error::pg("taking the retention lock"))
}

/// The database's now minus `older_than`: the server's clock decides, as it
/// wrote the timestamps.
async fn cutoff<C: GenericClient>(client: &C, older_than: Duration) -> Result<DateTime<Utc>, Error> {
    Ok(client
        .query_typed_one(CUTOFF, &[typed(&older_than.as_secs_f64())])
        .await
        .map_err(Error::pg("computing the retention cutoff"))?
        .get(0))
}
