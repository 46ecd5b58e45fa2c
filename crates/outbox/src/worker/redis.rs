//! A Redis Streams consumer-group worker.
//!
//! It reads with `XREADGROUP`, runs each entry through the inbox and sends
//! `XACK` only after the inbox transaction committed. Entries another
//! consumer read but never acknowledged (it crashed, or its effect failed)
//! are taken over with `XAUTOCLAIM` once idle for `claim_idle`, and so are
//! this consumer's own, so a failed effect is retried after `claim_idle`.
//! An entry that is not an outbox event (no parsable `event_id`) is copied
//! to `<stream>.malformed` and acknowledged, so it cannot block the group.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::streams::{
    StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
};
use redis::{AsyncCommands, AsyncConnectionConfig};
use tokio_postgres::{Client, Transaction};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Applied, Received, WorkerError, WorkerStats};
use crate::Inbox;

/// A consumer in a Redis consumer group.
#[derive(Debug, Clone)]
pub struct RedisWorker {
    client: redis::Client,
    stream: String,
    group: String,
    consumer: String,
    inbox: Inbox,
    /// How long an entry may stay unacknowledged before it is taken over.
    pub claim_idle: Duration,
    /// Entries per read.
    pub count: usize,
    /// How long one `XREADGROUP` blocks.
    pub block: Duration,
    /// Test hook: park forever after a commit, before the `XACK`.
    #[doc(hidden)]
    pub pause_after_commit: bool,
    /// Told of each inbox transaction, e.g. to trace it (`outbox consume`
    /// makes a span of each). None by default.
    pub observer: Option<std::sync::Arc<dyn super::Observe>>,
}

impl RedisWorker {
    /// A worker `consumer` of `group` on `stream`, recording into `inbox`.
    pub fn new(
        redis_url: &str,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
        inbox: Inbox,
    ) -> Result<Self, WorkerError> {
        let client =
            redis::Client::open(redis_url).map_err(|e| WorkerError::broker("opening the Redis URL", &e))?;
        Ok(Self {
            client,
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            inbox,
            claim_idle: Duration::from_secs(30),
            count: 100,
            block: Duration::from_secs(1),
            pause_after_commit: false,
            observer: None,
        })
    }

    /// Runs until `cancel` fires. `effect` runs once per event_id, inside
    /// the inbox transaction; an `Err` rolls it back and leaves the entry
    /// unacknowledged, to be retried after `claim_idle`. A Redis that is
    /// down or restarts means waiting and reconnecting; a PostgreSQL error
    /// ends the run (the caller owns that connection).
    pub async fn run<E>(
        &self,
        db: &mut Client,
        cancel: CancellationToken,
        mut effect: impl AsyncFnMut(&Transaction<'_>, &Received) -> Result<(), E>,
    ) -> Result<WorkerStats, WorkerError>
    where
        E: std::fmt::Display,
    {
        let mut stats = WorkerStats::default();
        let mut redis = None;
        let mut next_claim = tokio::time::Instant::now();
        while !cancel.is_cancelled() {
            let conn = match redis.as_mut() {
                Some(c) => c,
                None => match self.connect().await {
                    Ok(c) => redis.insert(c),
                    Err(error) => {
                        tracing::warn!(%error, "Redis unavailable; retrying in 1 s");
                        if pause(&cancel).await {
                            break;
                        }
                        continue;
                    }
                },
            };
            match self
                .round(db, conn, &mut next_claim, &mut effect, &mut stats, &cancel)
                .await
            {
                Ok(()) => {}
                // PostgreSQL errors end the worker: the connection is the
                // caller's, and nothing was acknowledged that is not done.
                Err(e @ WorkerError::Outbox(_)) => return Err(e),
                Err(error) => {
                    // Unacknowledged entries stay pending and come back.
                    tracing::warn!(%error, "Redis failed; reconnecting in 1 s");
                    redis = None;
                    if pause(&cancel).await {
                        break;
                    }
                }
            }
        }
        Ok(stats)
    }

    async fn connect(&self) -> Result<MultiplexedConnection, WorkerError> {
        // XREADGROUP blocks for `block`: the response timeout must outlast it.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(10)))
            .set_response_timeout(Some(self.block + Duration::from_secs(10)));
        let mut redis = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| WorkerError::broker("connecting to Redis", &e))?;
        self.create_group(&mut redis).await?;
        Ok(redis)
    }

    /// Takes over idle entries when due, else reads new ones, and handles them.
    async fn round<E: std::fmt::Display>(
        &self,
        db: &mut Client,
        redis: &mut MultiplexedConnection,
        next_claim: &mut tokio::time::Instant,
        effect: &mut impl AsyncFnMut(&Transaction<'_>, &Received) -> Result<(), E>,
        stats: &mut WorkerStats,
        cancel: &CancellationToken,
    ) -> Result<(), WorkerError> {
        let mut entries = Vec::new();
        if tokio::time::Instant::now() >= *next_claim {
            let claimed = self.autoclaim(redis).await?;
            stats.claimed += claimed.len() as u64;
            entries.extend(claimed);
            *next_claim = tokio::time::Instant::now() + self.claim_idle / 2;
        }
        if entries.is_empty() {
            entries = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                read = self.read_new(redis) => read?,
            };
        }
        for entry in entries {
            if cancel.is_cancelled() {
                // The rest stay pending for this consumer or another.
                break;
            }
            self.handle(db, redis, entry, effect, stats).await?;
        }
        Ok(())
    }

    async fn handle<E: std::fmt::Display>(
        &self,
        db: &mut Client,
        redis: &mut MultiplexedConnection,
        entry: StreamId,
        effect: &mut impl AsyncFnMut(&Transaction<'_>, &Received) -> Result<(), E>,
        stats: &mut WorkerStats,
    ) -> Result<(), WorkerError> {
        let Some(message) = message(&entry) else {
            let aside = format!("{}.malformed", self.stream);
            let fields: Vec<(String, String)> = entry
                .map
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        redis::from_redis_value_ref::<String>(v).unwrap_or_default(),
                    )
                })
                .collect();
            let _: String = redis
                .xadd(&aside, "*", &fields)
                .await
                .map_err(|e| WorkerError::broker("moving a malformed entry aside", &e))?;
            self.ack(redis, &entry.id).await?;
            stats.malformed += 1;
            crate::notify::send("OUTBOX_MESSAGE=rejected");
            tracing::warn!(entry = %entry.id, stream = %self.stream, to = %aside, "not an outbox event; moved aside");
            return Ok(());
        };
        match super::apply(
            db,
            &self.inbox,
            &message,
            effect,
            stats,
            self.pause_after_commit,
            self.observer.as_deref(),
        )
        .await?
        {
            Applied::Committed => self.ack(redis, &entry.id).await,
            // The entry stays pending and is retried after `claim_idle`.
            Applied::EffectFailed => Ok(()),
        }
    }

    async fn create_group(&self, redis: &mut MultiplexedConnection) -> Result<(), WorkerError> {
        let created: redis::RedisResult<()> =
            redis.xgroup_create_mkstream(&self.stream, &self.group, "0").await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => {
                Err(WorkerError::broker("creating the consumer group", &e))
            }
            _ => Ok(()),
        }
    }

    async fn read_new(&self, redis: &mut MultiplexedConnection) -> Result<Vec<StreamId>, WorkerError> {
        let options = StreamReadOptions::default()
            .group(&self.group, &self.consumer)
            .count(self.count)
            .block(self.block.as_millis() as usize);
        let reply: Option<StreamReadReply> = redis
            .xread_options(&[&self.stream], &[">"], &options)
            .await
            .map_err(|e| WorkerError::broker("XREADGROUP", &e))?;
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .collect())
    }

    /// Entries idle for `claim_idle` in anyone's pending list, this
    /// consumer's own included.
    async fn autoclaim(&self, redis: &mut MultiplexedConnection) -> Result<Vec<StreamId>, WorkerError> {
        let mut start = "0-0".to_owned();
        let mut claimed = Vec::new();
        loop {
            let reply: StreamAutoClaimReply = redis
                .xautoclaim_options(
                    &self.stream,
                    &self.group,
                    &self.consumer,
                    self.claim_idle.as_millis() as u64,
                    &start,
                    StreamAutoClaimOptions::default().count(self.count),
                )
                .await
                .map_err(|e| WorkerError::broker("XAUTOCLAIM", &e))?;
            claimed.extend(reply.claimed);
            if reply.next_stream_id == "0-0" || claimed.len() >= self.count {
                return Ok(claimed);
            }
            start = reply.next_stream_id;
        }
    }

    async fn ack(&self, redis: &mut MultiplexedConnection, id: &str) -> Result<(), WorkerError> {
        let _: i64 = redis
            .xack(&self.stream, &self.group, &[id])
            .await
            .map_err(|e| WorkerError::broker("XACK", &e))?;
        Ok(())
    }
}

/// An entry as the relay's Redis sink writes it; `None` if it is not an
/// outbox event (no parsable `event_id`).
pub fn message(entry: &StreamId) -> Option<Received> {
    let text = |name: &str| entry.get::<String>(name);
    let json = |name: &str| text(name).and_then(|s| serde_json::from_str(&s).ok());
    Some(Received {
        event_id: text("event_id")?.parse::<Uuid>().ok()?,
        aggregate_id: text("aggregate_id").unwrap_or_default(),
        event_type: text("event_type").unwrap_or_default(),
        payload: json("payload").unwrap_or(serde_json::Value::Null),
        headers: json("headers").unwrap_or_else(|| serde_json::json!({})),
        position: entry.id.clone(),
    })
}

/// Sleeps a second; true if `cancel` fired first.
async fn pause(cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(Duration::from_secs(1)) => false,
    }
}
