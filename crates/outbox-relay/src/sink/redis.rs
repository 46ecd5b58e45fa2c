//! Redis Streams sink: `XADD <prefix>.<aggregate_type> * event_id … payload …`.
//!
//! A batch is one pipelined round trip, with per-command results so one bad
//! stream (say, a key of the wrong type) fails only its own rows. An entry
//! counts as delivered when Redis answered it with an entry id. The
//! connection is made lazily and dropped on any connection-level failure, so
//! a Redis that is down at startup, or restarts, makes the sink unavailable
//! (no attempt spent) until a `PING` probe answers.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisResult};
use tokio::sync::Mutex;

use super::format::Formatter;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// `--stream-prefix`'s default.
const DEFAULT_STREAM_PREFIX: &str = "outbox.event";

/// The Redis sink's options. Each field is a flag of `outbox relay`, the
/// environment variable beside it, and the routes file's key of the same
/// name (the flag with underscores).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RedisOptions {
    // The doc comment is also `--help`'s text, verbatim.
    #[allow(rustdoc::invalid_html_tags)]
    /// Redis stream name prefix: streams are <prefix>.<aggregate_type>.
    #[arg(
        id = "stream_prefix",
        value_name = "STREAM_PREFIX",
        long = "stream-prefix",
        env = "OUTBOX_STREAM_PREFIX",
        default_value = DEFAULT_STREAM_PREFIX
    )]
    #[serde(rename = "stream_prefix")]
    pub stream_prefix: String,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
        }
    }
}

/// Delivers to Redis Streams.
pub struct RedisSink {
    client: Client,
    prefix: String,
    timeout: Duration,
    formatter: Formatter,
    connection: Mutex<Option<MultiplexedConnection>>,
}

impl RedisSink {
    /// A sink for `url` (`redis://host:port[/db]` or `rediss://`).
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        let client = Client::open(url).map_err(|e| SinkError::InvalidUrl {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            client,
            prefix: options.per_sink.redis.stream_prefix.clone(),
            timeout: options.timeout,
            formatter: options.formatter.clone(),
            connection: Mutex::new(None),
        })
    }

    /// The stream a row goes to.
    pub fn stream_name(&self, row: &OutboxRow) -> String {
        format!("{}.{}", self.prefix, row.aggregate_type)
    }

    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let all_failed = |message: String| -> Vec<Delivery> {
            batch
                .iter()
                .map(|_| Err(DeliveryError::unavailable(message.clone())))
                .collect()
        };
        let mut conn = match self.connection().await {
            Ok(c) => c,
            Err(e) => return all_failed(format!("connecting to redis: {e}")),
        };
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for row in batch {
            let fields = self.formatter.fields(row);
            pipe.xadd(self.stream_name(row), "*", &fields);
        }
        let answers: RedisResult<Vec<RedisResult<String>>> = pipe.query_async(&mut conn).await;
        match answers {
            Ok(answers) if answers.len() == batch.len() => answers
                .into_iter()
                .map(|a| a.map(drop).map_err(|e| classify(&e)))
                .collect(),
            Ok(answers) => all_failed(format!(
                "redis answered {} of {} commands",
                answers.len(),
                batch.len()
            )),
            Err(e) => {
                // The connection may be broken; make a new one next batch.
                *self.connection.lock().await = None;
                all_failed(format!("redis pipeline: {e}"))
            }
        }
    }
}

/// A command error Redis itself returned. Only a wrong key type is known to be
/// hopeless; anything else (OOM, LOADING, READONLY) is worth a retry.
fn classify(e: &redis::RedisError) -> DeliveryError {
    let message = format!("redis XADD: {e}");
    if e.code() == Some("WRONGTYPE") {
        DeliveryError::permanent(message)
    } else {
        DeliveryError::retryable(message)
    }
}

impl Sink for RedisSink {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let unavailable = |e: redis::RedisError| DeliveryError::unavailable(format!("redis: {e}"));
            let mut conn = self.connection().await.map_err(unavailable)?;
            let ping: RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
            if let Err(e) = ping {
                *self.connection.lock().await = None;
                return Err(unavailable(e));
            }
            Ok(())
        }
        .boxed()
    }
}
