//! The operator's statements with typed parameters and rows: statistics,
//! dead letters (list, page, requeue, give up), the live relays and the
//! backlog of each partition, throughput, and one event's story (what keeps
//! it where it is). `outbox stats`, `dlq`, `relays` and the admin console
//! use them. None of them is on the relay's path.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::{Error, GenericClient, Row};
use uuid::Uuid;

use super::OutboxSql;
use super::typed::{Typed, typed};

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
    /// The payload the writer stored.
    pub payload: serde_json::Value,
    /// The headers the writer stored.
    pub headers: serde_json::Value,
    /// When its first failed attempt was: where its retry window started.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// Its last failed attempts, oldest first (see [`Attempt`]).
    pub attempt_log: Vec<Attempt>,
}

/// One failed attempt in a row's history (`attempt_log`, migration 0007):
/// the relay keeps the last [`ATTEMPT_LOG_LEN`](super::ATTEMPT_LOG_LEN) of
/// them, attempts that the sink being unavailable did not spend left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// When the relay recorded it (the database's clock).
    pub at: DateTime<Utc>,
    /// The row's attempt count after it.
    #[serde(default)]
    pub attempt: Option<i32>,
    /// `retry` (the row waits for its next attempt) or `dead` (it made the
    /// row a dead letter).
    pub outcome: String,
    /// What went wrong, cut at
    /// [`ATTEMPT_LOG_ERROR`](super::ATTEMPT_LOG_ERROR) characters.
    #[serde(default)]
    pub error: Option<String>,
}

/// A row's `attempt_log` as attempts. The relay alone writes it; an entry
/// it cannot read (none should be) is left out rather than failing the
/// whole listing.
fn attempts(log: Option<serde_json::Value>) -> Vec<Attempt> {
    match log {
        Some(serde_json::Value::Array(entries)) => entries
            .into_iter()
            .filter_map(|e| serde_json::from_value(e).ok())
            .collect(),
        _ => Vec::new(),
    }
}

/// Which dead letters a requeue (or its dry run, or a page of the console)
/// touches. Every filter set narrows; none set means all of them.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeadFilter<'a> {
    /// Only these row ids.
    pub ids: Option<&'a [i64]>,
    /// Only this aggregate type.
    pub aggregate_type: Option<&'a str>,
    /// Only rows whose last error contains this text.
    pub error_contains: Option<&'a str>,
    /// Only this event type.
    pub event_type: Option<&'a str>,
    /// Only rows that became dead letters at or before this instant.
    pub dead_before: Option<DateTime<Utc>>,
    /// Only rows that became dead letters at or after this instant.
    pub dead_after: Option<DateTime<Utc>>,
}

impl DeadFilter<'_> {
    fn params(&self) -> [Typed<'_>; 6] {
        [
            typed(&self.ids),
            typed(&self.aggregate_type),
            typed(&self.error_contains),
            typed(&self.event_type),
            typed(&self.dead_before),
            typed(&self.dead_after),
        ]
    }
}

/// A whole outbox row, payload and headers included, for inspection.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventDetail {
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
    /// The payload the writer stored.
    pub payload: serde_json::Value,
    /// The headers the writer stored.
    pub headers: serde_json::Value,
    /// Failed deliveries so far.
    pub attempts: i32,
    /// The last delivery error.
    pub last_error: Option<String>,
    /// When the writer inserted it.
    pub created_at: DateTime<Utc>,
    /// When it is due (again).
    pub next_attempt_at: DateTime<Utc>,
    /// When a relay delivered it.
    pub published_at: Option<DateTime<Utc>>,
    /// When it became a dead letter.
    pub dead_at: Option<DateTime<Utc>>,
    /// When someone gave up on it.
    pub given_up_at: Option<DateTime<Utc>>,
    /// When its first failed attempt was: where its retry window started.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// Its last failed attempts, oldest first.
    pub attempt_log: Vec<Attempt>,
}

/// One page of dead letters, oldest first.
#[derive(Debug, Clone, Copy)]
pub struct DeadPage<'a> {
    /// Which dead letters.
    pub filter: DeadFilter<'a>,
    /// The last id of the previous page (0: the first page).
    pub after_id: i64,
    /// At most this many rows.
    pub limit: i64,
}

/// Dead letters nobody gave up on with one aggregate type and last error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadByError {
    /// The aggregate type.
    pub aggregate_type: String,
    /// The last error (empty if none was recorded).
    pub last_error: String,
    /// How many.
    pub count: i64,
}

/// Rows published per time bucket.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    /// Bucket width in seconds.
    pub bucket_seconds: f64,
    /// How many buckets, back from now.
    pub buckets: i32,
}

/// One event and what decides where it is (see `EVENT_STORY`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventStory {
    /// The row.
    pub event: EventDetail,
    /// The database's clock when it was read.
    pub now: DateTime<Utc>,
    /// The earliest earlier event of its aggregate that is not published
    /// and not given up on: under strict order it goes first.
    pub held_behind: Option<i64>,
    /// Its partition (None: the outbox has no lease rows).
    pub partition: Option<i32>,
    /// The partition count.
    pub partitions: i32,
    /// The live relay holding its partition, if any.
    pub owner: Option<Uuid>,
    /// That relay's name.
    pub owner_name: Option<String>,
    /// Seconds since that relay's last heartbeat.
    pub owner_silent_for: Option<f64>,
}

/// Sorted partitions as ranges, `0-15,32,40-41`: how `outbox relays` and
/// the console print the partitions of a [`RelayRow`] or those no relay
/// holds.
///
/// ```
/// assert_eq!(outbox::sql::partition_ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
/// assert_eq!(outbox::sql::partition_ranges(&[]), "");
/// ```
pub fn partition_ranges(partitions: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < partitions.len() {
        let start = partitions[i];
        let mut end = start;
        while i + 1 < partitions.len() && partitions[i + 1] == end + 1 {
            i += 1;
            end = partitions[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// A live relay.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// Unpublished rows per aggregate type, types in order. Unprepared but
    /// typed (it takes no parameters): one round trip and one transaction,
    /// where `query` would prepare first (the relay's backlog gauges run it
    /// every 5 s).
    pub async fn stats(&self, client: &impl GenericClient) -> Result<Vec<TypeStats>, Error> {
        let rows = client.query_typed(self.stats.as_str(), &[]).await?;
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

    /// Up to `limit` dead letters, oldest first, with payloads, headers
    /// and attempt histories.
    pub async fn dead_letters(
        &self,
        client: &impl GenericClient,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        let rows = client.query_typed(&self.list_dead, &[typed(&limit)]).await?;
        rows.iter().map(dead_letter).collect()
    }

    /// Gives up on the dead letters among `ids`: they stay for inspection
    /// but no longer hold their aggregate back. Returns rows changed.
    pub async fn give_up(&self, client: &impl GenericClient, ids: &[i64]) -> Result<u64, Error> {
        client.execute_typed(&self.give_up_dead, &[typed(&ids)]).await
    }

    /// How many dead letters `filter` matches.
    pub async fn count_dead(
        &self,
        client: &impl GenericClient,
        filter: &DeadFilter<'_>,
    ) -> Result<i64, Error> {
        client
            .query_typed_one(&self.count_dead, &filter.params())
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
        let requeued: i64 = client
            .query_typed_one(&self.requeue_dead, &filter.params())
            .await?
            .try_get(0)?;
        Ok(requeued.unsigned_abs())
    }

    /// Deletes the dead letters given up on longer than `older_than` ago,
    /// a batch of at most 1,000 rows per call; returns how many went (call
    /// again until 0).
    pub async fn purge_given_up(
        &self,
        client: &impl GenericClient,
        older_than: std::time::Duration,
    ) -> Result<u64, Error> {
        let gone: i64 = client
            .query_typed_one(&self.purge_given_up, &[typed(&older_than.as_secs_f64())])
            .await?
            .try_get(0)?;
        Ok(gone.unsigned_abs())
    }

    /// How many rows [`purge_given_up`](Self::purge_given_up) would delete.
    pub async fn count_purge_given_up(
        &self,
        client: &impl GenericClient,
        older_than: std::time::Duration,
    ) -> Result<i64, Error> {
        client
            .query_typed_one(&self.count_purge_given_up, &[typed(&older_than.as_secs_f64())])
            .await?
            .try_get(0)
    }

    /// How many dead letters among `ids` [`give_up`](Self::give_up) would
    /// change (its dry run).
    pub async fn count_give_up(&self, client: &impl GenericClient, ids: &[i64]) -> Result<i64, Error> {
        client
            .query_typed_one(&self.count_give_up, &[typed(&ids)])
            .await?
            .try_get(0)
    }

    /// One page of dead letters with payloads and headers.
    pub async fn dead_page(
        &self,
        client: &impl GenericClient,
        page: &DeadPage<'_>,
    ) -> Result<Vec<EventDetail>, Error> {
        let mut params = page.filter.params().to_vec();
        params.extend([typed(&page.after_id), typed(&page.limit)]);
        let rows = client.query_typed(&self.list_dead_page, &params).await?;
        rows.iter().map(event_detail).collect()
    }

    /// Dead letters nobody gave up on, per aggregate type and error, at most
    /// `limit` groups, largest first.
    pub async fn dead_by_error(
        &self,
        client: &impl GenericClient,
        limit: i64,
    ) -> Result<Vec<DeadByError>, Error> {
        let rows = client.query_typed(&self.dead_by_error, &[typed(&limit)]).await?;
        rows.iter()
            .map(|r| {
                Ok(DeadByError {
                    aggregate_type: r.try_get(0)?,
                    last_error: r.try_get(1)?,
                    count: r.try_get(2)?,
                })
            })
            .collect()
    }

    /// Rows published per bucket, most recent bucket first; every bucket
    /// present, empty ones as 0. Reads the whole table (see `THROUGHPUT`).
    pub async fn throughput(
        &self,
        client: &impl GenericClient,
        span: &Throughput,
    ) -> Result<Vec<i64>, Error> {
        let rows = client
            .query_typed(
                &self.throughput,
                &[typed(&span.bucket_seconds), typed(&span.buckets)],
            )
            .await?;
        let mut counts = vec![0; usize::try_from(span.buckets).unwrap_or(0)];
        for r in &rows {
            let bucket: i32 = r.try_get(0)?;
            // A row published in the instant between the WHERE and the
            // bucket's clock reading can land one past the end.
            if let Some(c) = usize::try_from(bucket).ok().and_then(|b| counts.get_mut(b)) {
                *c += r.try_get::<_, i64>(1)?;
            }
        }
        Ok(counts)
    }

    /// The event with this row id or event id and what decides where it is;
    /// None if no row has it (never written, or delivered and cleaned up).
    pub async fn event_story(
        &self,
        client: &impl GenericClient,
        id: Option<i64>,
        event_id: Option<Uuid>,
    ) -> Result<Option<EventStory>, Error> {
        let Some(r) = client
            .query_typed_opt(&self.event_story, &[typed(&id), typed(&event_id)])
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(EventStory {
            event: event_detail(&r)?,
            now: r.try_get(16)?,
            held_behind: r.try_get(17)?,
            partition: r.try_get(18)?,
            partitions: r.try_get(19)?,
            owner: r.try_get(20)?,
            owner_name: r.try_get(21)?,
            owner_silent_for: r.try_get(22)?,
        }))
    }

    /// Wakes the relays listening on `channel`: a requeue or a give-up makes
    /// rows claimable without the INSERT the trigger notifies for.
    pub async fn notify(&self, client: &impl GenericClient, channel: &str) -> Result<(), Error> {
        client
            .execute_typed(self.notify, &[typed(&channel)])
            .await
            .map(drop)
    }

    /// The live relays, oldest first.
    pub async fn relays(&self, client: &impl GenericClient) -> Result<Vec<RelayRow>, Error> {
        let rows = client.query_typed(&self.relays, &[]).await?;
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
        let rows = client.query_typed(&self.partition_backlog, &[]).await?;
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
        payload: r.try_get(10)?,
        headers: r.try_get(11)?,
        first_failed_at: r.try_get(12)?,
        attempt_log: attempts(r.try_get(13)?),
    })
}

fn event_detail(r: &Row) -> Result<EventDetail, Error> {
    Ok(EventDetail {
        id: r.try_get(0)?,
        event_id: r.try_get(1)?,
        aggregate_type: r.try_get(2)?,
        aggregate_id: r.try_get(3)?,
        event_type: r.try_get(4)?,
        payload: r.try_get(5)?,
        headers: r.try_get(6)?,
        attempts: r.try_get(7)?,
        last_error: r.try_get(8)?,
        created_at: r.try_get(9)?,
        next_attempt_at: r.try_get(10)?,
        published_at: r.try_get(11)?,
        dead_at: r.try_get(12)?,
        given_up_at: r.try_get(13)?,
        first_failed_at: r.try_get(14)?,
        attempt_log: attempts(r.try_get(15)?),
    })
}
