//! `outbox-lab demo`: the whole pattern end to end, printed as it happens.
//!
//! A shop writes orders and their events in one transaction (some
//! transactions roll back), the relay delivers the events to a Redis Stream,
//! and a shipping consumer reads the stream through a consumer group and
//! ships each paid order through the inbox. Then it replays deliveries to
//! show that duplicates change nothing, checks the counts, and cleans up.
//!
//! Without `DATABASE_URL` it starts a throwaway PostgreSQL cluster and a
//! redis-server (the testkit's), which vanish when it exits. With
//! `DATABASE_URL` everything lives in the schema `outbox_demo`, dropped at
//! the end, so the demo never touches other tables. It runs the relay in
//! this process (the library's `Relay`), so it needs no `outbox` binary.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::worker::redis::RedisWorker;
use outbox::worker::{Received, WorkerStats};
use outbox::{Config, Event, Inbox, InboxConfig, Outbox, Processed};
use outbox_relay::{Relay, RelayConfig, SinkOptions};
use outbox_testkit::{Postgres, Redis};
use redis::AsyncCommands;
use serde_json::json;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::scratch::{connect, parse_pg_url};
use crate::{ConfigError, Database};

const SCHEMA: &str = "outbox_demo";
const STREAM_PREFIX: &str = "outbox_demo.event";
const GROUP: &str = "shipping";

/// `outbox-lab demo`'s arguments.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub orders: u32,
    /// Where events go; must be Redis (the demo consumes a Redis stream).
    /// Without it the demo starts its own redis-server.
    #[arg(long, env = "OUTBOX_SINK")]
    pub sink: Option<String>,
}

/// Runs `outbox-lab demo`; fails (exit 1) if the counts do not add up.
pub async fn run(db: &Database, args: DemoArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    // Keep the throwaway servers alive until the end; dropping them stops them.
    let mut _postgres = None;
    let pg_url = match &db.url {
        Some(url) => {
            println!("using DATABASE_URL (everything goes into schema {SCHEMA}, dropped at the end)");
            url.clone()
        }
        None => {
            println!("starting a throwaway PostgreSQL cluster…");
            let pg = Postgres::start()
                .await
                .context("starting a throwaway PostgreSQL")?;
            println!("  PostgreSQL on 127.0.0.1:{}", pg.port());
            let url = pg.url("postgres");
            _postgres = Some(pg);
            url
        }
    };
    let mut _redis = None;
    let sink_url = match args.sink {
        Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => url,
        Some(url) => {
            return Err(ConfigError(format!(
                "the demo consumes a Redis stream, so OUTBOX_SINK must be a redis:// URL, not {url:?}"
            ))
            .into());
        }
        None => {
            println!("starting a throwaway redis-server…");
            let redis = Redis::start()
                .await
                .context("starting a throwaway redis-server")?;
            println!("  Redis on 127.0.0.1:{}", redis.port());
            let url = redis.url();
            _redis = Some(redis);
            url
        }
    };

    let pg = parse_pg_url(&pg_url, db.connect_timeout)?;
    let shared_services = db.url.is_some();
    let mut db = connect(&pg).await?;
    let outbox_config = Config::new(SCHEMA, "outbox")?.with_channel("outbox_demo_new")?;
    let inbox_config = InboxConfig::new(SCHEMA, "processed_events")?;
    prepare_schema(&mut db, &outbox_config, &inbox_config).await?;

    println!(
        "\n1. writer: placing {} orders (order row + events in one transaction)",
        args.orders
    );
    let (committed, rolled_back) =
        place_orders(&mut db, &Outbox::new(outbox_config.clone()), args.orders).await?;
    println!(
        "   {committed} committed, {rolled_back} rolled back (payment declined: no order, no event left behind)"
    );
    let written: i64 = db
        .query_one(
            &format!("SELECT count(*) FROM {}", outbox_config.qualified()),
            &[],
        )
        .await?
        .get(0);
    println!("   outbox rows: {written}");

    println!("\n2. relay: delivering to Redis Streams ({STREAM_PREFIX}.orders)");
    let mut options = SinkOptions::default();
    options.per_sink.redis.stream_prefix = STREAM_PREFIX.to_owned();
    let sink = outbox_relay::sink::from_url(&sink_url, &options)?;
    let relay = Relay::new(
        pg.clone(),
        Arc::from(sink),
        RelayConfig {
            outbox: outbox_config.clone(),
            ..RelayConfig::default()
        },
    );
    let counters = relay.counters();
    let cancel = CancellationToken::new();
    let relay_task = tokio::spawn(relay.run(cancel.clone()));

    println!("\n3. consumer: group {GROUP:?} ships each paid order through the inbox");
    let stream = format!("{STREAM_PREFIX}.orders");
    let inbox = Inbox::new(inbox_config.clone());
    let mut worker = RedisWorker::new(&sink_url, &stream, GROUP, "demo-1", inbox.clone())?;
    worker.block = Duration::from_millis(200);
    // The worker runs until cancelled: stop it after the last event's effect
    // (its commit and XACK still complete).
    let all_read = CancellationToken::new();
    let mut shipped_events = 0;
    let consumed = tokio::time::timeout(
        Duration::from_secs(60),
        worker.run(&mut db, all_read.clone(), async |tx, event| {
            ship(tx, event).await?;
            shipped_events += 1;
            if shipped_events == written {
                all_read.cancel();
            }
            Ok::<(), anyhow::Error>(())
        }),
    )
    .await
    .context("not every event arrived within 60 s")??;
    println!(
        "   {} entries read, {} processed, {} duplicates",
        consumed.processed + consumed.duplicates,
        consumed.processed,
        consumed.duplicates
    );

    println!("\n4. at-least-once: replaying the first 5 stream entries to the consumer");
    let mut redis = redis::Client::open(sink_url.as_str())
        .context("opening the Redis URL")?
        .get_multiplexed_async_connection()
        .await
        .context("connecting to Redis")?;
    let replay: redis::streams::StreamRangeReply = redis
        .xrange_count(&stream, "-", "+", 5)
        .await
        .context("reading the stream for the replay")?;
    let mut replayed = WorkerStats::default();
    for event in replay.ids.iter().filter_map(outbox::worker::redis::message) {
        let tx = db.transaction().await?;
        let outcome = inbox
            .process(&tx, event.event_id, async |tx| ship(tx, &event).await)
            .await?;
        tx.commit().await?;
        match outcome {
            Processed::New(()) => replayed.processed += 1,
            Processed::Duplicate => replayed.duplicates += 1,
        }
    }
    println!(
        "   {} replayed, {} processed again, {} answered as duplicates",
        replayed.processed + replayed.duplicates,
        replayed.processed,
        replayed.duplicates
    );

    cancel.cancel();
    relay_task.await.context("joining the relay")??;

    let count = |sql: String| {
        let db = &db;
        async move { Ok::<i64, anyhow::Error>(db.query_one(&sql, &[]).await?.get(0)) }
    };
    let orders = count(format!("SELECT count(*) FROM {SCHEMA}.orders")).await?;
    let paid = count(format!("SELECT count(*) FROM {SCHEMA}.orders WHERE paid")).await?;
    let shipments = count(format!("SELECT count(*) FROM {SCHEMA}.shipments")).await?;
    let distinct_shipped = count(format!("SELECT count(DISTINCT order_id) FROM {SCHEMA}.shipments")).await?;
    let published = count(format!(
        "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
        outbox_config.qualified()
    ))
    .await?;
    let processed = count(format!("SELECT count(*) FROM {}", inbox_config.qualified())).await?;

    println!("\nsummary");
    println!("  orders committed          {orders}");
    println!("  events written            {written}");
    println!(
        "  events published          {published} (relay delivered {})",
        counters.delivered.load(Ordering::Relaxed)
    );
    println!(
        "  stream entries consumed   {}",
        consumed.processed + consumed.duplicates + replayed.processed + replayed.duplicates
    );
    println!("  processed_events rows     {processed}");
    println!("  shipments                 {shipments} for {distinct_shipped} orders ({paid} paid)");
    println!(
        "  took                      {:.2}s",
        started.elapsed().as_secs_f64()
    );

    cleanup(&db, &mut redis, &stream, shared_services).await?;

    if published != written || shipments != paid || distinct_shipped != paid || processed != written {
        bail!("the counts do not add up: see the summary above");
    }
    println!("\nevery committed event was delivered; every paid order shipped exactly once");
    Ok(())
}

async fn prepare_schema(db: &mut Client, outbox: &Config, inbox: &InboxConfig) -> anyhow::Result<()> {
    db.batch_execute(&format!(
        "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
         CREATE SCHEMA {SCHEMA};
         CREATE TABLE {SCHEMA}.orders (
             id bigserial PRIMARY KEY, customer text NOT NULL,
             total_cents bigint NOT NULL, paid boolean NOT NULL);
         CREATE TABLE {SCHEMA}.shipments (
             id bigserial PRIMARY KEY, order_id bigint NOT NULL, event_id uuid NOT NULL);"
    ))
    .await
    .context("creating the demo tables")?;
    outbox::migrate(db, outbox).await?;
    outbox::migrate_inbox(db, inbox).await?;
    Ok(())
}

/// Every order writes OrderPlaced; most also pay (OrderPaid). One in seven
/// payments is declined, which rolls the whole transaction back.
async fn place_orders(db: &mut Client, outbox: &Outbox, n: u32) -> anyhow::Result<(u32, u32)> {
    let (mut committed, mut rolled_back) = (0, 0);
    for i in 0..n {
        let tx = db.transaction().await?;
        let paid = i % 5 != 4;
        let total = 1_000 + i64::from(i) * 250;
        let id: i64 = tx
            .query_one(
                &format!("INSERT INTO {SCHEMA}.orders (customer, total_cents, paid) VALUES ($1, $2, $3) RETURNING id"),
                &[&format!("customer-{}", i % 7), &total, &paid],
            )
            .await?
            .get(0);
        let aggregate = id.to_string();
        let mut events = vec![Event::new(
            "orders",
            &aggregate,
            "OrderPlaced",
            json!({"order_id": id, "total_cents": total}),
        )];
        if paid {
            events.push(Event::new(
                "orders",
                &aggregate,
                "OrderPaid",
                json!({"order_id": id}),
            ));
        }
        outbox.enqueue_all(&tx, &events).await?;
        if i % 7 == 3 {
            tx.rollback().await?;
            rolled_back += 1;
        } else {
            tx.commit().await?;
            committed += 1;
        }
    }
    Ok((committed, rolled_back))
}

/// The shipping side effect: an `OrderPaid` event ships its order. Run
/// inside the inbox transaction, so a redelivered event ships nothing.
async fn ship(tx: &tokio_postgres::Transaction<'_>, event: &Received) -> anyhow::Result<()> {
    if let ("OrderPaid", Some(order_id)) = (event.event_type.as_str(), event.payload["order_id"].as_i64()) {
        tx.execute(
            &format!("INSERT INTO {SCHEMA}.shipments (order_id, event_id) VALUES ($1, $2)"),
            &[&order_id, &event.event_id],
        )
        .await?;
    }
    Ok(())
}

async fn cleanup(
    db: &Client,
    redis: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    shared_services: bool,
) -> anyhow::Result<()> {
    if shared_services {
        db.batch_execute(&format!("DROP SCHEMA {SCHEMA} CASCADE"))
            .await
            .context("dropping the demo schema")?;
    }
    let _: i64 = redis.del(stream).await.context("deleting the demo stream")?;
    println!("\ncleaned up (schema {SCHEMA} and stream {stream})");
    Ok(())
}
