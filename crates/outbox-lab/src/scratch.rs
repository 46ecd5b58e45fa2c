//! The lab's scratch world: schema `outbox_lab` (an outbox with its own
//! NOTIFY channel, a processed_events table, and the shop's `orders` and
//! `shipments`), rebuilt from nothing by every experiment, and the `outbox
//! relay` and `outbox lab --app` child processes the experiments start and
//! kill.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::{Config, Event, Inbox, InboxConfig, Outbox, Processed};
use outbox_testkit::{Received, Spawned};
use serde_json::json;
use tokio_postgres::Client;
use uuid::Uuid;

pub(super) const SCHEMA: &str = "outbox_lab";
const CHANNEL: &str = "outbox_lab_new";
/// How long any wait on state may take before the experiment fails.
pub(super) const LONG: Duration = Duration::from_secs(60);

/// The scratch schema and what the experiments share.
pub(super) struct Lab {
    pub(super) pg: tokio_postgres::Config,
    pub(super) pg_url: String,
    /// A throwaway redis-server, started by the first experiment that needs one.
    redis: Option<outbox_testkit::Redis>,
    /// The run's progress bar, for experiments with long phases.
    pub(super) progress: Option<indicatif::ProgressBar>,
    /// The lab's own connection, for setup and counting.
    pub(super) db: Client,
    pub(super) config: Config,
    pub(super) outbox: Outbox,
    pub(super) inbox: Inbox,
    pub(super) quick: bool,
}

impl Lab {
    pub(super) async fn new(
        pg: &tokio_postgres::Config,
        pg_url: String,
        quick: bool,
    ) -> anyhow::Result<Self> {
        let db = super::super::connect(pg).await?;
        let config = Config::new(SCHEMA, "outbox")?.with_channel(CHANNEL)?;
        Ok(Self {
            pg: pg.clone(),
            pg_url,
            redis: None,
            progress: None,
            db,
            outbox: Outbox::new(config.clone()),
            config,
            inbox: Inbox::new(InboxConfig::new(SCHEMA, "processed_events")?),
            quick,
        })
    }

    /// Drops and recreates the scratch schema: a migrated outbox and inbox,
    /// and empty `orders` and `shipments`.
    pub(super) async fn reset(&mut self) -> anyhow::Result<()> {
        self.db
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await
            .context("dropping the lab schema")?;
        outbox::migrate(&mut self.db, &self.config).await?;
        outbox::migrate_inbox(&mut self.db, self.inbox.config()).await?;
        self.db
            .batch_execute(&format!(
                "CREATE TABLE {SCHEMA}.orders (id bigserial PRIMARY KEY, customer text NOT NULL); \
                 CREATE TABLE {SCHEMA}.shipments (order_id bigint NOT NULL)"
            ))
            .await
            .context("creating the shop's tables")?;
        Ok(())
    }

    /// The URL of the lab's redis-server, started on first use.
    pub(super) async fn redis_url(&mut self) -> anyhow::Result<String> {
        if self.redis.is_none() {
            let redis = outbox_testkit::Redis::start()
                .await
                .context("starting a throwaway redis-server")?;
            self.redis = Some(redis);
        }
        Ok(self.redis.as_ref().map(|r| r.url()).unwrap_or_default())
    }

    /// Shows the phase a long experiment is in.
    pub(super) fn step(&self, phase: &str) {
        if let Some(p) = &self.progress {
            p.set_message(phase.to_owned());
        }
    }

    /// `DATABASE_URL` with another database name.
    pub(super) fn url_of(&self, dbname: &str) -> String {
        match url::Url::parse(&self.pg_url) {
            Ok(mut u) if u.scheme().starts_with("postgres") => {
                u.set_path(dbname);
                u.to_string()
            }
            // key=value form: a later key wins.
            _ => format!("{} dbname={dbname}", self.pg_url),
        }
    }

    /// A connection to another database.
    pub(super) async fn connect_to(&self, dbname: &str) -> anyhow::Result<Client> {
        let mut pg = self.pg.clone();
        pg.dbname(dbname);
        super::super::connect(&pg).await
    }

    /// Another connection, for a second session.
    pub(super) async fn connect(&self) -> anyhow::Result<Client> {
        super::super::connect(&self.pg).await
    }

    pub(super) async fn drop_all(&self) -> anyhow::Result<()> {
        self.db
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await
            .context("dropping the lab schema")
    }

    /// The outbox table, qualified and quoted.
    pub(super) fn table(&self) -> String {
        self.config.qualified()
    }

    /// The single bigint a query returns.
    pub(super) async fn count(&self, sql: &str) -> anyhow::Result<i64> {
        let row = self
            .db
            .query_one(sql, &[])
            .await
            .with_context(|| sql.to_owned())?;
        Ok(row.get(0))
    }

    pub(super) async fn unpublished(&self) -> anyhow::Result<i64> {
        self.count(&format!(
            "SELECT count(*) FROM {} WHERE published_at IS NULL",
            self.table()
        ))
        .await
    }

    pub(super) async fn rows(&self) -> anyhow::Result<i64> {
        self.count(&format!("SELECT count(*) FROM {}", self.table()))
            .await
    }

    /// Orders, shipments, ghost shipments (of an order that does not exist)
    /// and orders without shipment.
    pub(super) async fn shop(&self) -> anyhow::Result<Shop> {
        let row = self
            .db
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM {SCHEMA}.orders), \
                            (SELECT count(*) FROM {SCHEMA}.shipments), \
                            (SELECT count(*) FROM {SCHEMA}.shipments s \
                              WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.orders o WHERE o.id = s.order_id)), \
                            (SELECT count(*) FROM {SCHEMA}.orders o \
                              WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.shipments s WHERE s.order_id = o.id)), \
                            (SELECT count(*) FROM (SELECT order_id FROM {SCHEMA}.shipments \
                              GROUP BY order_id HAVING count(*) > 1) d)"
                ),
                &[],
            )
            .await
            .context("counting orders and shipments")?;
        Ok(Shop {
            orders: row.get(0),
            shipments: row.get(1),
            ghosts: row.get(2),
            unshipped: row.get(3),
            shipped_twice: row.get(4),
        })
    }

    /// The naive consumer: one shipment per request that got a 2xx.
    pub(super) async fn ship_naively(&self, received: &[Received]) -> anyhow::Result<()> {
        for r in received.iter().filter(|r| (200..300).contains(&r.status)) {
            let order_id = order_id(r)?;
            self.db
                .execute(
                    &format!("INSERT INTO {SCHEMA}.shipments VALUES ($1)"),
                    &[&order_id],
                )
                .await?;
        }
        Ok(())
    }

    /// The idempotent consumer: the shipment and the inbox record in one
    /// transaction per request that got a 2xx. Returns the duplicates it
    /// skipped.
    pub(super) async fn ship_through_inbox(&mut self, received: &[Received]) -> anyhow::Result<usize> {
        let mut duplicates = 0;
        let insert = format!("INSERT INTO {SCHEMA}.shipments VALUES ($1)");
        for r in received.iter().filter(|r| (200..300).contains(&r.status)) {
            let order_id = order_id(r)?;
            let tx = self.db.transaction().await?;
            let outcome = self
                .inbox
                .process(&tx, event_id(r)?, async |tx| {
                    tx.execute(&insert, &[&order_id])
                        .await
                        .map_err(anyhow::Error::from)
                })
                .await?;
            tx.commit().await?;
            if outcome == Processed::Duplicate {
                duplicates += 1;
            }
        }
        Ok(duplicates)
    }

    /// This binary with the scratch outbox's flags and `DATABASE_URL`, and
    /// none of the user's `OUTBOX_*` settings.
    pub(super) fn outbox_cmd(&self, args: &[&str]) -> anyhow::Result<tokio::process::Command> {
        self.outbox_cmd_on(&self.pg_url, args)
    }

    /// [`Lab::outbox_cmd`] on another database.
    pub(super) fn outbox_cmd_on(
        &self,
        pg_url: &str,
        args: &[&str],
    ) -> anyhow::Result<tokio::process::Command> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut cmd = tokio::process::Command::new(exe);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("OUTBOX_") {
                cmd.env_remove(key);
            }
        }
        cmd.args(args)
            .args(["--schema", SCHEMA, "--channel", CHANNEL])
            .env("DATABASE_URL", pg_url)
            .env("RUST_LOG", "info")
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// Starts `outbox relay --sink <sink> <args>` (JSON logs) with `envs`,
    /// and returns once it logged that it is ready.
    pub(super) async fn spawn_relay(
        &self,
        sink: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Spawned> {
        self.spawn_relay_on(&self.pg_url, sink, args, envs).await
    }

    /// [`Lab::spawn_relay`] on another database.
    pub(super) async fn spawn_relay_on(
        &self,
        pg_url: &str,
        sink: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Spawned> {
        let mut cmd = self.outbox_cmd_on(pg_url, &["relay", "--sink", sink, "--log-format", "json"])?;
        cmd.args(args).envs(envs.iter().copied());
        let relay = Spawned::spawn(cmd)?;
        relay
            .wait_for_line("relay ready", LONG)
            .await
            .context("starting the relay")?;
        Ok(relay)
    }

    /// SIGTERMs a relay and checks it drained and exited 0.
    pub(super) async fn stop_relay(&self, mut relay: Spawned) -> anyhow::Result<()> {
        relay.signal(nix::sys::signal::Signal::SIGTERM)?;
        let status = relay.wait(LONG).await?;
        if !status.success() {
            bail!("the relay exited with {status}: {:?}", relay.lines());
        }
        Ok(())
    }

    /// Runs `outbox <args>` on the scratch outbox to completion.
    pub(super) async fn run_cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = self.outbox_cmd(args)?;
        let out = tokio::time::timeout(LONG, cmd.output())
            .await
            .with_context(|| format!("outbox {} timed out", args.join(" ")))??;
        if !out.status.success() {
            bail!(
                "outbox {} exited with {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// An `orders` event for order `order_id` of aggregate `order_id`.
    pub(super) fn order_event(order_id: i64, event_type: &str) -> Event {
        Event::new(
            "orders",
            order_id.to_string(),
            event_type,
            json!({"order_id": order_id}),
        )
    }
}

/// The shop's books after an experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shop {
    pub(super) orders: i64,
    pub(super) shipments: i64,
    pub(super) ghosts: i64,
    pub(super) unshipped: i64,
    pub(super) shipped_twice: i64,
}

/// Waits until `check` holds, polling state every 20 ms, for at most `LONG`.
pub(super) async fn wait_until<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + LONG;
    while !check().await? {
        if Instant::now() > deadline {
            bail!("timed out after {LONG:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `payload.order_id` of a relay request, or `order_id` of a naive one.
pub(super) fn order_id(r: &Received) -> anyhow::Result<i64> {
    r.body["payload"]["order_id"]
        .as_i64()
        .or_else(|| r.body["order_id"].as_i64())
        .with_context(|| format!("no order_id in {}", r.body))
}

/// `event_id` of a request.
pub(super) fn event_id(r: &Received) -> anyhow::Result<Uuid> {
    r.body["event_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no event_id in {}", r.body))
}
