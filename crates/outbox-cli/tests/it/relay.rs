//! The relay against real PostgreSQL and Redis: wake-ups, the watermark
//! pitfall, PostgreSQL going away, SIGTERM. Volume and order, Redis going
//! away, a kill between ack and mark and bad URLs are the conformance
//! suite's (`conformance_redis_*`).

use std::time::Duration;

use outbox::{Event, Outbox};
use outbox_testkit::Redis;
use serde_json::json;

use crate::support::{Db, LONG, connect, distinct_events, read_stream, start_relay, stop_relay, wait_until};

#[tokio::test]
async fn notify_wakes_the_relay_long_before_the_fallback_poll() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), &["--poll-interval", "60s"], &[]).await;
    // The relay polled once when it became ready; from now on only a NOTIFY
    // can wake it within the 60 s fallback.
    wait_until("the startup claim", LONG, || async {
        !relay.notified("OUTBOX_BATCH=committed")
    })
    .await;
    outbox::enqueue(&db.client, &Event::new("orders", "1", "OrderCreated", json!({})))
        .await
        .unwrap();
    wait_until(
        "the event published by a NOTIFY wake-up",
        Duration::from_secs(20),
        || async { db.unpublished().await == 0 },
    )
    .await;
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 1);
    stop_relay(relay).await;
}

#[tokio::test]
async fn watermark_lower_id_committed_later_is_still_delivered() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), &["--poll-interval", "100ms"], &[]).await;
    let outbox = Outbox::default();

    // Session A takes the lower id but commits last.
    let mut a = connect(&db.url).await;
    let mut b = connect(&db.url).await;
    let tx_a = a.transaction().await.unwrap();
    outbox
        .enqueue(&tx_a, &Event::new("orders", "a", "A", json!({})))
        .await
        .unwrap();
    let tx_b = b.transaction().await.unwrap();
    outbox
        .enqueue(&tx_b, &Event::new("orders", "b", "B", json!({})))
        .await
        .unwrap();
    tx_b.commit().await.unwrap();

    wait_until("B delivered", LONG, || async {
        read_stream(&redis.url(), "outbox.event.orders").await.len() == 1
    })
    .await;
    let seen = read_stream(&redis.url(), "outbox.event.orders").await;
    let last_seen = seen[0].outbox_id;
    tx_a.commit().await.unwrap();
    let a_id: i64 = db
        .client
        .query_one("SELECT id FROM outbox WHERE event_type = 'A'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(a_id < last_seen, "A holds the lower id ({a_id} < {last_seen})");

    // The naive watermark relay would now ask for id > last_seen and find nothing.
    let naive = db
        .count(&format!("SELECT count(*) FROM outbox WHERE id > {last_seen}"))
        .await;
    assert_eq!(naive, 0, "a watermark relay loses A");

    db.wait_drained("A delivered too").await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(events.len(), 2);
    assert_eq!(events[1].outbox_id, a_id);
    stop_relay(relay).await;
}

#[tokio::test]
async fn postgres_restart_mid_stream_loses_nothing() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(3_000, 3).await;
    let relay = start_relay(&db.url, &redis.url(), &["--batch-size", "50"], &[]).await;
    wait_until("the relay under way", LONG, || async {
        read_stream(&redis.url(), "outbox.event.orders").await.len() >= 500
    })
    .await;

    db.pg.kill().unwrap();
    db.pg.restart().await.unwrap();
    db.reconnect().await;
    relay
        .wait_for_notification("STATUS=reconnected", LONG)
        .await
        .unwrap();
    db.insert_events(1_000, 1).await;

    db.wait_drained("everything published after the restart").await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    let distinct = distinct_events(&events);
    assert_eq!(distinct, 4_000, "nothing lost");
    // kill -9 interrupts at most two batches: the one at the sink and the
    // one delivered but not yet committed.
    assert!(
        events.len() - distinct <= 2 * 50,
        "{} duplicates",
        events.len() - distinct
    );
    stop_relay(relay).await;
}

#[tokio::test]
async fn sigterm_drains_the_batch_in_flight_so_delivered_equals_marked() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(20_000, 4).await;
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--batch-size", "1000", "--log-format", "json"],
        &[],
    )
    .await;
    // Output capture, not synchronisation: the line is logged before
    // READY=1, so it is read already or about to be.
    let ready = relay.wait_for_line("relay ready", LONG).await.unwrap();
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("--log-format json");
    assert_eq!(ready["fields"]["batch_size"], 1000);

    // Stop while batches are flowing: the one in flight must be marked.
    relay
        .wait_for_notification("OUTBOX_BATCH=committed", LONG)
        .await
        .unwrap();
    stop_relay(relay).await;

    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    let distinct = distinct_events(&events);
    let published = db
        .count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .await;
    assert_eq!(events.len(), distinct, "no duplicates");
    assert_eq!(
        events.len() as i64,
        published,
        "every delivered event is marked, and only those"
    );
    assert!(published > 0);
}
