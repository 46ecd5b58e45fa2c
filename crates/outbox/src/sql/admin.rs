//! The operator's statements with typed parameters and rows: statistics,
//! dead letters (list, requeue, give up), the live relays and the backlog
//! of each partition. None of them is on the relay's path.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, GenericClient, Row};
use uuid::Uuid;

use super::OutboxSql;

type Param<'p> = &'p (dyn ToSql + Sync);

/// Unpublished rows of one aggregate type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TypeStats {
    /// The aggregate type.
    pub aggregate_type: String,
    /// Rows waiting for delivery (not dead letters).
    pub unpublished: i64,
    /// Dead letters (`dead_at` set) that nobody gave up on.
    pub dead_letters: i64,
    /// Dead letters given up on (`dlq give-up`).
    pub given_up: i64,
    /// Aggregates a dead letter holds back under strict order.
    pub blocked_aggregates: i64,
    /// The oldest row waiting for delivery.
    pub oldest_unpublished: Option<DateTime<Utc>>,
}

/// One dead letter, for inspection.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    /// Row id.
    pub id: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate id.
    pub aggregate_id: String,
    /// Its event type.
    pub event_type: String,
    /// Failed deliveries.
    pub attempts: i32,
    /// The last delivery error.
    pub last_error: Option<String>,
    /// When the writer inserted it.
    pub created_at: DateTime<Utc>,
    /// When it became a dead letter (its last attempt, or a permanent
    /// failure).
    pub dead_at: Option<DateTime<Utc>>,
    /// Set by `dlq give-up`: kept for the record, no longer blocking.
    pub given_up_at: Option<DateTime<Utc>>,
}

/// Which dead letters a requeue (or its dry run) touches. Every filter set
/// narrows; none set means all of them.
#[derive(Debug, Clone, Copy)]
pub struct DeadFilter<'a> {
    /// Only these row ids.
    pub ids: Option<&'a [i64]>,
    /// Only this aggregate type.
    pub aggregate_type: Option<&'a str>,
    /// Only rows whose last error contains this text.
    pub error_contains: Option<&'a str>,
}

impl DeadFilter<'_> {
    fn params(&self) -> [Param<'_>; 3] {
        [&self.ids, &self.aggregate_type, &self.error_contains]
    }
}

/// A live relay.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayRow {
    /// Its id.
    pub relay_id: Uuid,
    /// Its display name.
    pub name: String,
    /// When it joined.
    pub started_at: DateTime<Utc>,
    /// Seconds since its last heartbeat.
    pub silent_for_seconds: f64,
    /// The partitions it holds, ascending.
    pub partitions: Vec<i32>,
}

/// One partition, its owner and its backlog.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionRow {
    /// The partition.
    pub partition: i32,
    /// The relay holding it, if any.
    pub owner: Option<Uuid>,
    /// Unpublished rows (not dead letters) in it.
    pub backlog: i64,
}

impl OutboxSql {
    /// Unpublished rows per aggregate type, types in order.
    pub async fn stats(&self, client: &impl GenericClient) -> Result<Vec<TypeStats>, Error> {
        let rows = client.query(self.stats.as_str(), &[]).await?;
        rows.iter()
            .map(|r| {
                Ok(TypeStats {
                    aggregate_type: r.try_get(0)?,
                    unpublished: r.try_get(1)?,
                    dead_letters: r.try_get(2)?,
                    given_up: r.try_get(3)?,
                    blocked_aggregates: r.try_get(4)?,
                    oldest_unpublished: r.try_get(5)?,
                })
            })
            .collect()
    }

    /// Up to `limit` dead letters, oldest first.
    pub async fn dead_letters(
        &self,
        client: &impl GenericClient,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        let rows = client.query(self.list_dead.as_str(), &[&limit]).await?;
        rows.iter().map(dead_letter).collect()
    }

    /// Gives up on the dead letters among `ids`: they stay for inspection
    /// but no longer hold their aggregate back. Returns rows changed.
    pub async fn give_up(&self, client: &impl GenericClient, ids: &[i64]) -> Result<u64, Error> {
        client.execute(self.give_up_dead.as_str(), &[&ids]).await
    }

    /// How many dead letters `filter` matches.
    pub async fn count_dead(
        &self,
        client: &impl GenericClient,
        filter: &DeadFilter<'_>,
    ) -> Result<i64, Error> {
        client
            .query_one(self.count_dead.as_str(), &filter.params())
            .await?
            .try_get(0)
    }

    /// Puts the dead letters `filter` matches back in line (`last_error`
    /// stays for the record). Returns rows requeued.
    pub async fn requeue_dead(
        &self,
        client: &impl GenericClient,
        filter: &DeadFilter<'_>,
    ) -> Result<u64, Error> {
        client.execute(self.requeue_dead.as_str(), &filter.params()).await
    }

    /// Wakes the relays listening on `channel`: a requeue or a give-up makes
    /// rows claimable without the INSERT the trigger notifies for.
    pub async fn notify(&self, client: &impl GenericClient, channel: &str) -> Result<(), Error> {
        client.execute(self.notify, &[&channel]).await.map(drop)
    }

    /// The live relays, oldest first.
    pub async fn relays(&self, client: &impl GenericClient) -> Result<Vec<RelayRow>, Error> {
        let rows = client.query(self.relays.as_str(), &[]).await?;
        rows.iter()
            .map(|r| {
                Ok(RelayRow {
                    relay_id: r.try_get(0)?,
                    name: r.try_get(1)?,
                    started_at: r.try_get(2)?,
                    silent_for_seconds: r.try_get(3)?,
                    partitions: r.try_get(4)?,
                })
            })
            .collect()
    }

    /// Every partition with its owner and backlog. Reads every row waiting
    /// for delivery.
    pub async fn partition_backlog(&self, client: &impl GenericClient) -> Result<Vec<PartitionRow>, Error> {
        let rows = client.query(self.partition_backlog.as_str(), &[]).await?;
        rows.iter()
            .map(|r| {
                Ok(PartitionRow {
                    partition: r.try_get(0)?,
                    owner: r.try_get(1)?,
                    backlog: r.try_get(2)?,
                })
            })
            .collect()
    }
}

fn dead_letter(r: &Row) -> Result<DeadLetter, Error> {
    Ok(DeadLetter {
        id: r.try_get(0)?,
        event_id: r.try_get(1)?,
        aggregate_type: r.try_get(2)?,
        aggregate_id: r.try_get(3)?,
        event_type: r.try_get(4)?,
        attempts: r.try_get(5)?,
        last_error: r.try_get(6)?,
        created_at: r.try_get(7)?,
        dead_at: r.try_get(8)?,
        given_up_at: r.try_get(9)?,
    })
}
