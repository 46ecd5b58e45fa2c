//! The soak's once-a-second samples of the database side: each outbox's
//! backlog and the WAL the slot retains. (Throughput and latency come from
//! the deliveries themselves, read back at the end.)

use std::time::{Duration, Instant};

use outbox_relay::pg::PgConfig;
use serde::Serialize;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::names;
use super::schedule::Src;
use crate::scratch::connect;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sample {
    /// Seconds into the run.
    pub(crate) t: f64,
    /// Rows waiting in the polled outbox (unpublished, not dead).
    pub(crate) poll_backlog: Option<i64>,
    /// Rows waiting in the log-tailed outbox (delivered ones are deleted).
    pub(crate) wal_backlog: Option<i64>,
    /// WAL the slot holds back, in bytes.
    pub(crate) retained: Option<i64>,
}

async fn one(db: &Client, sources: &[Src], t: f64, slot: &str) -> Result<Sample, tokio_postgres::Error> {
    let mut s = Sample {
        t,
        poll_backlog: None,
        wal_backlog: None,
        retained: None,
    };
    if sources.contains(&Src::Poll) {
        s.poll_backlog = Some(db.query_one(&names::waiting(Src::Poll), &[]).await?.get(0));
    }
    if sources.contains(&Src::Wal) {
        s.wal_backlog = Some(db.query_one(&names::waiting(Src::Wal), &[]).await?.get(0));
        s.retained = db
            .query_opt(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 FROM pg_replication_slots \
                  WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .and_then(|r| r.get(0));
    }
    Ok(s)
}

/// Samples every second until stopped; a second PostgreSQL does not answer
/// (it is restarting) has no sample.
pub(crate) async fn sample(
    pg: PgConfig,
    sources: Vec<Src>,
    started: Instant,
    stop: CancellationToken,
) -> Vec<Sample> {
    let slot = names::config(Src::Wal)
        .and_then(|c| Ok(c.wal_slot()?))
        .unwrap_or_default();
    let mut samples = Vec::new();
    let mut db: Option<Client> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => break,
        }
        if db.as_ref().is_none_or(Client::is_closed) {
            db = tokio::time::timeout(Duration::from_secs(1), connect(&pg))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some(c) = &db else { continue };
        if let Ok(s) = one(c, &sources, started.elapsed().as_secs_f64(), &slot).await {
            samples.push(s);
        }
    }
    samples
}
