//! The backlog gauges (`outbox_backlog_events`,
//! `outbox_oldest_unpublished_age_seconds`, `outbox_dead_letters`, per
//! aggregate type), read by one query on a schedule on a connection of its
//! own, never per scrape: a scrape only renders what the last run found, so
//! however often Prometheus (or several) scrapes, PostgreSQL sees one
//! `outbox stats` query per interval.
//!
//! Failures are logged and retried next round; they never touch delivery.
//! A type that drained away is set to 0 rather than left at its last value,
//! so an alert on it resolves.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox::Config;
use outbox::sql::OutboxSql;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::error::error_chain;
use crate::metric::{BACKLOG, DEAD_LETTERS, OLDEST_UNPUBLISHED_AGE};

/// How often the backlog gauges are refreshed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Time between two queries.
    pub interval: Duration,
}

impl Default for Backlog {
    /// Every 5 s: a fresh enough age for an alert measured in minutes.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(5),
        }
    }
}

impl Backlog {
    /// Refreshes the gauges every `interval` until `cancel`. Never fails.
    pub async fn run(self, pg: crate::pg::PgConfig, config: Config, cancel: CancellationToken) {
        let sql = OutboxSql::new(&config);
        let mut pg = pg;
        pg.postgres_mut().application_name("outbox-relay metrics");
        let mut client: Option<Client> = None;
        let mut seen = BTreeSet::new();
        loop {
            if client.as_ref().is_none_or(Client::is_closed) {
                client = match crate::pg::connect_once(&pg).await {
                    Ok(c) => Some(c),
                    Err(error) => {
                        warn!(error = %error_chain(&error), "metrics connection failed; retrying");
                        None
                    }
                };
            }
            if let Some(c) = &client {
                // A query that hangs must not freeze the gauges for good.
                match tokio::time::timeout(self.interval.max(Duration::from_secs(1)), sql.stats(c)).await {
                    Ok(Ok(stats)) => publish(&stats, &mut seen),
                    Ok(Err(error)) => warn!(error = %error_chain(&error), "reading the backlog failed"),
                    Err(_) => {
                        warn!("reading the backlog timed out; reconnecting");
                        client = None;
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

/// Sets the gauges of every type in `stats`, and 0 for types seen before
/// that are gone.
fn publish(stats: &[outbox::sql::TypeStats], seen: &mut BTreeSet<String>) {
    let now = chrono::Utc::now();
    let mut gone = std::mem::take(seen);
    for s in stats {
        gone.remove(&s.aggregate_type);
        seen.insert(s.aggregate_type.clone());
        let label = [("aggregate_type", s.aggregate_type.clone())];
        let age = s.oldest_unpublished.map_or(0.0, |t| {
            // Microseconds: exact in an f64 for centuries.
            #[allow(clippy::cast_precision_loss)]
            let secs = (now - t).num_microseconds().unwrap_or(i64::MAX).max(0) as f64 / 1e6;
            secs
        });
        // Row counts: exact in an f64 up to 2^53.
        #[allow(clippy::cast_precision_loss)]
        {
            metrics::gauge!(BACKLOG, &label).set(s.unpublished as f64);
            metrics::gauge!(DEAD_LETTERS, &label).set(s.dead_letters as f64);
        }
        metrics::gauge!(OLDEST_UNPUBLISHED_AGE, &label).set(age);
    }
    for aggregate_type in gone {
        let label = [("aggregate_type", aggregate_type)];
        metrics::gauge!(BACKLOG, &label).set(0.0);
        metrics::gauge!(DEAD_LETTERS, &label).set(0.0);
        metrics::gauge!(OLDEST_UNPUBLISHED_AGE, &label).set(0.0);
    }
}
