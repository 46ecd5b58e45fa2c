//! The backlog gauges (`outbox_backlog_events`,
//! `outbox_oldest_unpublished_age_seconds`, `outbox_dead_letters`, per
//! aggregate type) and what keeps vacuum from cleaning the table
//! (`outbox_xmin_horizon_age_seconds`, `outbox_dead_tuples`), read by one
//! round trip on a schedule on a connection of its own, never per scrape: a
//! scrape only renders what the last run found, so however often
//! Prometheus (or several) scrapes, PostgreSQL sees one `outbox stats`
//! query (and the two others) per interval.
//!
//! A transaction holding the horizon for longer than [`HORIZON_WARN`] is
//! named once in a warning (pid, `application_name`, state), as `outbox
//! stats` names it: a label per holder would make a series per pid.
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
use crate::metric::{BACKLOG, DEAD_LETTERS, DEAD_TUPLES, OLDEST_UNPUBLISHED_AGE, XMIN_HORIZON_AGE};

/// A transaction holding the xmin horizon this long is named in a warning,
/// once: by then the outbox has piled up dead tuples for ten minutes (the
/// example alert's threshold, `OutboxXminHorizonHeld`).
pub const HORIZON_WARN: Duration = Duration::from_secs(600);

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
        let vacuum = Vacuum {
            horizon: metrics::gauge!(XMIN_HORIZON_AGE, &[ctx.label()]),
            dead: metrics::gauge!(DEAD_TUPLES, &[ctx.label()]),
            warned: None,
        };
        vacuum.horizon.set(0.0);
        vacuum.dead.set(0.0);
        let mut vacuum = vacuum;
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
                // One round trip (pipelined). A query that hangs must not
                // freeze the gauges for good.
                let read = async { tokio::join!(sql.stats(c), sql.xmin_holders(c), sql.dead_tuples(c)) };
                match tokio::time::timeout(self.interval.max(Duration::from_secs(1)), read).await {
                    Ok((stats, holders, dead)) => {
                        match stats {
                            Ok(stats) => publish(&outbox, &stats, &mut seen),
                            Err(error) => warn!(error = %error_chain(&error), "reading the backlog failed"),
                        }
                        match holders {
                            Ok(holders) => vacuum.horizon(&holders),
                            Err(error) => {
                                warn!(error = %error_chain(&error), "reading the xmin horizon failed");
                            }
                        }
                        match dead {
                            // A count: exact in an f64 up to 2^53.
                            #[allow(clippy::cast_precision_loss)]
                            Ok(dead) => vacuum.dead.set(dead as f64),
                            Err(error) => warn!(error = %error_chain(&error), "reading dead tuples failed"),
                        }
                    }
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

/// The gauges of what keeps vacuum from cleaning the table, and the
/// holder last named in a warning.
struct Vacuum {
    horizon: metrics::Gauge,
    dead: metrics::Gauge,
    warned: Option<(String, Option<i32>, String)>,
}

impl Vacuum {
    /// Sets the horizon's age (0 with no transaction holding it) and names
    /// a holder past [`HORIZON_WARN`], once.
    fn horizon(&mut self, holders: &[outbox::sql::HorizonHolder]) {
        let oldest = holders.iter().find(|h| h.is_transaction());
        let age = oldest.and_then(|h| h.age_seconds).unwrap_or(0.0);
        self.horizon.set(age.max(0.0));
        let Some(h) = oldest.filter(|_| age >= HORIZON_WARN.as_secs_f64()) else {
            return;
        };
        let who = (h.kind.clone(), h.pid, h.name.clone());
        if self.warned.as_ref() != Some(&who) {
            warn!(
                kind = %h.kind,
                pid = h.pid,
                application_name = %h.name,
                state = %h.state,
                age_seconds = age,
                "a transaction holds the xmin horizon: vacuum cannot remove the outbox's dead tuples until it ends"
            );
            self.warned = Some(who);
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
