//! The bench's scratch outbox (schema `outbox_bench`, its own NOTIFY channel
//! and Redis stream) and the `outbox relay` child processes every phase runs.

use std::time::Duration;

use anyhow::{Context, bail};
use outbox::sql::OutboxSql;
use outbox::{Config, Event, Outbox};
use outbox_testkit::Spawned;
use redis::AsyncCommands;
use serde_json::json;
use tokio_postgres::Client;

const SCHEMA: &str = "outbox_bench";
const CHANNEL: &str = "outbox_bench_new";
const STREAM_PREFIX: &str = "outbox_bench.event";
/// Every bench event is an `orders` event, so this is the one stream.
pub(super) const STREAM: &str = "outbox_bench.event.orders";
/// Distinct aggregates the bench's events are spread over, interleaved.
const AGGREGATES: usize = 500;

/// The scratch outbox and the services the phases use.
pub(crate) struct Scratch {
    pub(super) pg: tokio_postgres::Config,
    pg_url: String,
    redis_url: String,
    /// The bench's own connection, for setup and counting.
    pub(super) db: Client,
    pub(super) config: Config,
    pub(super) sql: OutboxSql,
}

impl Scratch {
    pub(crate) async fn new(
        pg: tokio_postgres::Config,
        pg_url: String,
        redis_url: String,
    ) -> anyhow::Result<Self> {
        let mut db = super::super::connect(&pg).await?;
        db.batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await
            .context("dropping an old bench schema")?;
        let config = Config::new(SCHEMA, "outbox")?.with_channel(CHANNEL)?;
        outbox::migrate(&mut db, &config).await?;
        Ok(Self {
            pg,
            pg_url,
            redis_url,
            db,
            sql: OutboxSql::new(&config),
            config,
        })
    }

    pub(crate) async fn drop_all(&self) -> anyhow::Result<()> {
        self.db
            .batch_execute(&format!("DROP SCHEMA {SCHEMA} CASCADE"))
            .await
            .context("dropping the bench schema")?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    pub(super) async fn redis(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.redis_url.as_str())?
            .get_multiplexed_async_connection()
            .await
            .context("connecting to Redis")
    }

    /// Empties the table and the stream.
    pub(super) async fn clear(&mut self) -> anyhow::Result<()> {
        let t = self.config.qualified();
        // Separate calls: VACUUM cannot run in the implicit transaction of a
        // multi-statement string.
        self.db.batch_execute(&format!("TRUNCATE {t}")).await?;
        self.db.batch_execute(&format!("VACUUM ANALYZE {t}")).await?;
        self.redis().await?.del::<_, i64>(STREAM).await?;
        Ok(())
    }

    /// Empties the table and the stream, then inserts `n` events.
    pub(super) async fn fill(&mut self, n: usize) -> anyhow::Result<()> {
        self.clear().await?;
        let outbox = Outbox::new(self.config.clone());
        let events: Vec<Event> = (0..n).map(event).collect();
        for chunk in events.chunks(1000) {
            let tx = self.db.transaction().await?;
            outbox.enqueue_all(&tx, chunk).await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// Rows marked published.
    pub(super) async fn marked(&self) -> anyhow::Result<u64> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
            self.config.qualified()
        );
        Ok(self.db.query_one(&sql, &[]).await?.get::<_, i64>(0) as u64)
    }

    /// Starts `outbox relay` on the scratch outbox with JSON logs, plus
    /// `args`, and returns once it logged that it is ready.
    pub(super) async fn spawn_relay(&self, args: &[&str]) -> anyhow::Result<Spawned> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(["relay", "--sink", &self.redis_url, "--schema", SCHEMA])
            .args(["--channel", CHANNEL, "--stream-prefix", STREAM_PREFIX])
            .args(["--log-format", "json"])
            .args(args)
            .env("DATABASE_URL", &self.pg_url)
            .env("RUST_LOG", "info");
        // The user's relay settings must not leak into the bench's relay.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("OUTBOX_") {
                cmd.env_remove(key);
            }
        }
        let relay = Spawned::spawn(cmd)?;
        relay
            .wait_for_line("relay ready", Duration::from_secs(30))
            .await
            .context("starting the relay")?;
        Ok(relay)
    }

    /// SIGTERMs a relay and checks it exited cleanly.
    pub(super) async fn stop_relay(&self, mut relay: Spawned) -> anyhow::Result<()> {
        if relay.lines().iter().all(|l| !l.contains("relay drained")) {
            relay.signal(nix::sys::signal::Signal::SIGTERM)?;
        }
        let status = relay.wait(Duration::from_secs(30)).await?;
        if !status.success() {
            bail!("the relay exited with {status}: {:?}", relay.lines());
        }
        Ok(())
    }
}

/// The `i`-th bench event: `orders` aggregates interleaved, a small payload.
pub(super) fn event(i: usize) -> Event {
    Event::new(
        "orders",
        (i % AGGREGATES).to_string(),
        "OrderPlaced",
        json!({"n": i}),
    )
}
