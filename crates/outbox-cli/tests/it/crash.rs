//! kill -9 between "the sink acknowledged" and "marked published": the seed's
//! 8 received, 5 distinct, and behind the inbox 5 shipped.

use std::collections::HashSet;

use outbox::{Event, Inbox, Outbox, Processed};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;
use uuid::Uuid;

use crate::support::{Db, LONG, start_relay, stop_relay};

#[tokio::test]
async fn kill_after_send_before_mark_redelivers_and_the_inbox_ships_once() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let outbox = Outbox::default();
    let tx = db.client.transaction().await.unwrap();
    for order in 1..=5 {
        outbox
            .enqueue(
                &tx,
                &Event::new(
                    "orders",
                    order.to_string(),
                    "OrderPaid",
                    json!({"order_id": order}),
                ),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    // Batch of 3, parked after the receiver acknowledged it.
    let mut relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--batch-size", "3"],
        &[("OUTBOX_FAILPOINT", "pause-after-deliver")],
    )
    .await;
    relay
        .wait_for_line("failpoint pause-after-deliver reached", LONG)
        .await
        .unwrap();
    // The fault happened: 3 sent, none marked.
    assert_eq!(receiver.count(), 3);
    assert_eq!(db.unpublished().await, 5);
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();
    assert_eq!(
        db.unpublished().await,
        5,
        "the killed batch was rolled back, not marked"
    );

    let relay = start_relay(&db.url, &receiver.url(), &["--batch-size", "3"], &[]).await;
    db.wait_drained("all 5 published after the restart").await;
    stop_relay(relay).await;

    let received = receiver.received();
    let ids: Vec<Uuid> = received
        .iter()
        .map(|r| r.body["event_id"].as_str().unwrap().parse().unwrap())
        .collect();
    let distinct: HashSet<Uuid> = ids.iter().copied().collect();
    assert_eq!((received.len(), distinct.len()), (8, 5), "8 received, 5 distinct");
    assert!(received.iter().all(|r| {
        r.headers
            .iter()
            .any(|(k, v)| k == "idempotency-key" && v == r.body["event_id"].as_str().unwrap())
    }));

    // A naive receiver ships on every request; the inbox ships once per event.
    db.client
        .batch_execute(
            "CREATE TABLE naive_shipments (order_id bigint); CREATE TABLE shipments (order_id bigint)",
        )
        .await
        .unwrap();
    let inbox = Inbox::default();
    outbox::migrate_inbox(&mut db.client, inbox.config())
        .await
        .unwrap();
    let mut duplicates = 0;
    for r in &received {
        let order_id = r.body["payload"]["order_id"].as_i64().unwrap();
        let event_id: Uuid = r.body["event_id"].as_str().unwrap().parse().unwrap();
        db.client
            .execute("INSERT INTO naive_shipments VALUES ($1)", &[&order_id])
            .await
            .unwrap();
        let tx = db.client.transaction().await.unwrap();
        let outcome = inbox
            .process(&tx, event_id, async |tx| {
                tx.execute("INSERT INTO shipments VALUES ($1)", &[&order_id])
                    .await
                    .map_err(anyhow::Error::from)
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        if outcome == Processed::Duplicate {
            duplicates += 1;
        }
    }
    assert_eq!(
        db.count("SELECT count(*) FROM naive_shipments").await,
        8,
        "naive ships 3 orders twice"
    );
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 5);
    assert_eq!(
        db.count("SELECT count(DISTINCT order_id) FROM shipments").await,
        5
    );
    assert_eq!(duplicates, 3);
}
