//! Log tailing (`relay --source wal`) against a real PostgreSQL with
//! `wal_level = logical`: volume and order, the watermark interleaving,
//! the table-less `emit`, kill -9 and a PostgreSQL restart mid-stream, and
//! a server that cannot do it.

use std::time::Duration;

use outbox::{Config, Event, Outbox};
use outbox_testkit::{PgSettings, Postgres, Redis};
use serde_json::json;
use tokio_postgres::Client;

use crate::support::{
    LONG, connect, distinct_events, order_violations, read_stream, run_cli, start_relay, stop_relay, text,
    wait_until,
};

/// A cluster with `wal_level = logical` and a migrated outbox with its
/// publication and slot.
pub struct WalDb {
    pub pg: Postgres,
    pub url: String,
    pub client: Client,
}

impl WalDb {
    pub async fn start() -> WalDb {
        let pg = Postgres::start_with(PgSettings::default().set("wal_level", "logical"))
            .await
            .expect("start postgres");
        let url = pg.fresh_database().await.expect("create database");
        let mut client = connect(&url).await;
        outbox::migrate(&mut client, &Config::default()).await.expect("migrate");
        outbox::wal::migrate_wal(&client, &Config::default())
            .await
            .expect("migrate --wal");
        WalDb { pg, url, client }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    /// Inserts `n` events over `aggregates` aggregates, interleaved, in
    /// transactions of 100.
    pub async fn insert(&mut self, n: usize, aggregates: usize) {
        let events: Vec<Event> = (0..n)
            .map(|i| {
                let agg = i % aggregates;
                Event::new("orders", format!("order-{agg}"), "Step", json!({"agg": agg, "seq": i / aggregates}))
            })
            .collect();
        for chunk in events.chunks(100) {
            let tx = self.client.transaction().await.unwrap();
            Outbox::default().enqueue_all(&tx, chunk).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
}

/// The relay's arguments for log tailing.
const WAL: &[&str] = &["--source", "wal"];

async fn stream_len(redis: &Redis) -> usize {
    read_stream(&redis.url(), "outbox.event.orders").await.len()
}

#[tokio::test]
async fn the_wal_source_delivers_5000_events_of_500_aggregates_once_each_in_order_and_deletes_them() {
    let mut db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), WAL, &[]).await;
    db.insert(5000, 500).await;
    wait_until("5000 delivered", LONG, || async { stream_len(&redis).await >= 5000 }).await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(events.len(), 5000, "each exactly once");
    assert_eq!(distinct_events(&events), 5000);
    assert_eq!(order_violations(&events), 0, "in order per aggregate");
    wait_until("delivered rows deleted", LONG, || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL").await, 0);
    stop_relay(relay).await;
}

#[tokio::test]
async fn an_earlier_id_committed_later_is_delivered_in_commit_order() {
    let db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), WAL, &[]).await;
    let outbox = Outbox::default();
    let mut a = connect(&db.url).await;
    let mut b = connect(&db.url).await;
    let tx_a = a.transaction().await.unwrap();
    outbox
        .enqueue(&tx_a, &Event::new("orders", "x", "First", json!({})))
        .await
        .unwrap();
    let tx_b = b.transaction().await.unwrap();
    outbox
        .enqueue(&tx_b, &Event::new("orders", "x", "Second", json!({})))
        .await
        .unwrap();
    tx_b.commit().await.unwrap();
    wait_until("B delivered", LONG, || async { stream_len(&redis).await == 1 }).await;
    tx_a.commit().await.unwrap();
    wait_until("A delivered", LONG, || async { stream_len(&redis).await == 2 }).await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert!(
        events[0].outbox_id > events[1].outbox_id,
        "commit order: the higher id first"
    );
    stop_relay(relay).await;
}

#[tokio::test]
async fn an_emitted_event_is_delivered_once_if_committed_and_never_if_rolled_back() {
    let mut db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), WAL, &[]).await;
    let outbox = Outbox::default();
    let rolled_back = Event::new("orders", "1", "Never", json!({}));
    let tx = db.client.transaction().await.unwrap();
    outbox.emit(&tx, &rolled_back).await.unwrap();
    tx.rollback().await.unwrap();
    let kept = Event::new("orders", "1", "Kept", json!({"n": 1}));
    let tx = db.client.transaction().await.unwrap();
    outbox.emit(&tx, &kept).await.unwrap();
    tx.commit().await.unwrap();
    // From plain SQL, as other languages write it.
    db.client
        .batch_execute(
            "SELECT pg_logical_emit_message(true, 'outbox:public.outbox', json_build_object(\
             'event_id', gen_random_uuid(), 'aggregate_type', 'orders', 'aggregate_id', '2', \
             'event_type', 'FromSql', 'payload', '{\"n\": 2}'::jsonb)::text)",
        )
        .await
        .unwrap();
    wait_until("2 delivered", LONG, || async { stream_len(&redis).await >= 2 }).await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].event_id, kept.event_id.to_string());
    assert!(events.iter().all(|e| e.event_id != rolled_back.event_id.to_string()));
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0, "no row, ever");
    stop_relay(relay).await;
}

#[tokio::test]
async fn kill_9_mid_stream_loses_nothing_and_resends_at_most_the_window() {
    let mut db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let args = ["--source", "wal", "--wal-window", "200", "--batch-size", "50"];
    let mut relay = start_relay(&db.url, &redis.url(), &args, &[]).await;
    db.insert(3000, 100).await;
    wait_until("some delivered", LONG, || async { stream_len(&redis).await >= 500 }).await;
    relay.kill().unwrap();
    let at_kill = stream_len(&redis).await;
    let relay = start_relay(&db.url, &redis.url(), &args, &[]).await;
    let events = loop {
        let events = read_stream(&redis.url(), "outbox.event.orders").await;
        if distinct_events(&events) == 3000 {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let duplicates = events.len() - 3000;
    assert!(
        duplicates <= 200,
        "{duplicates} re-sent, more than the window (killed at {at_kill})"
    );
    assert_eq!(crate::support::first_delivery_violations(&events), 0);
    stop_relay(relay).await;
}

#[tokio::test]
async fn postgres_restarted_mid_stream_loses_nothing() {
    let mut db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), WAL, &[]).await;
    db.insert(2000, 100).await;
    wait_until("some delivered", LONG, || async { stream_len(&redis).await >= 200 }).await;
    db.pg.restart().await.unwrap();
    db.client = connect(&db.url).await;
    db.insert(1000, 100).await;
    wait_until("all delivered", LONG, || async {
        distinct_events(&read_stream(&redis.url(), "outbox.event.orders").await) == 3000
    })
    .await;
    stop_relay(relay).await;
}

#[tokio::test]
async fn without_wal_level_logical_the_relay_and_migrate_exit_2_naming_the_setting() {
    let pg = Postgres::start().await.unwrap();
    let url = pg.fresh_database().await.unwrap();
    let env = [("DATABASE_URL", url.as_str())];
    let out = run_cli(&["migrate", "--wal"], &env).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("wal_level is replica") && stderr.contains("ALTER SYSTEM SET wal_level = logical"),
        "{stderr}"
    );
    let out = run_cli(&["relay", "--sink", "redis://127.0.0.1:1", "--source", "wal"], &env).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("wal_level is replica"), "{}", text(&out.stderr));
}
