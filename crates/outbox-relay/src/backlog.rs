//! The backlog gauges (`outbox_backlog_events`,
//! `outbox_oldest_unpublished_age_seconds`, `outbox_dead_letters`, per
//! aggregate type), read by one query on a schedule on a connection of its
//! own, never per scrape: a scrape only renders what the last run found, so
//! however often Prometheus (or several) scrapes, PostgreSQL sees one
//! `outbox stats` query per interval.
//!
//! Failures are logged and retried next round; they never touch delivery.
//! A type that drained away is set to 0 rather than left at its last value,
//! so an alert on it resolves. Every series carries the relay's `outbox`
//! label, and each outbox has its series from the first scrape: before any
//! type had a row waiting, one with `aggregate_type=""` at 0 (the metrics
//! facade cannot remove a series, so it stays, at 0, once types appear).

use std::collections::BTreeSet;
use std::time::Duration;

use outbox::Config;
use outbox::sql::OutboxSql;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::context::RelayContext;
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
    /// `ctx` is the relay's whose outbox it reads
    /// ([`Relay::context`](crate::Relay::context)).
    pub async fn run(
        self,
        pg: crate::pg::PgConfig,
        config: Config,
        ctx: RelayContext,
        cancel: CancellationToken,
    ) {
        let sql = OutboxSql::new(&config);
        let mut pg = pg;
        pg.postgres_mut().application_name("outbox-relay metrics");
        let mut client: Option<Client> = None;
        let outbox = ctx.outbox().to_owned();
        // Present from the first scrape, whatever the first query finds.
        set(&outbox, String::new(), 0.0, 0.0, 0.0);
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
                    Ok(Ok(stats)) => publish(&outbox, &stats, &mut seen),
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
fn publish(outbox: &str, stats: &[outbox::sql::TypeStats], seen: &mut BTreeSet<String>) {
    let now = chrono::Utc::now();
    let mut gone = std::mem::take(seen);
    for s in stats {
        gone.remove(&s.aggregate_type);
        seen.insert(s.aggregate_type.clone());
        let age = s.oldest_unpublished.map_or(0.0, |t| {
            // Microseconds: exact in an f64 for centuries.
            #[allow(clippy::cast_precision_loss)]
            let secs = (now - t).num_microseconds().unwrap_or(i64::MAX).max(0) as f64 / 1e6;
            secs
        });
        // Row counts: exact in an f64 up to 2^53.
        #[allow(clippy::cast_precision_loss)]
        let (unpublished, dead) = (s.unpublished as f64, s.dead_letters as f64);
        set(outbox, s.aggregate_type.clone(), unpublished, dead, age);
    }
    for aggregate_type in gone {
        set(outbox, aggregate_type, 0.0, 0.0, 0.0);
    }
}

/// One type's three gauges.
fn set(outbox: &str, aggregate_type: String, backlog: f64, dead: f64, age: f64) {
    let labels = [("outbox", outbox.to_owned()), ("aggregate_type", aggregate_type)];
    metrics::gauge!(BACKLOG, &labels).set(backlog);
    metrics::gauge!(DEAD_LETTERS, &labels).set(dead);
    metrics::gauge!(OLDEST_UNPUBLISHED_AGE, &labels).set(age);
}
