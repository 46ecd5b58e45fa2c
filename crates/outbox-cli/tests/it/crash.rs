//! kill -9 between "the sink acknowledged" and "marked published", as the
//! conformance suite's scenario does it for HTTP (8 received, 5 distinct,
//! the same event_id and `Idempotency-Key` on the re-send), then what a
//! consumer makes of it: a naive receiver ships 8, behind the inbox 5.

use outbox::{Inbox, Processed};
use outbox_testkit::conformance::{self, HttpSink};
use uuid::Uuid;

use crate::conformance::relay;

#[tokio::test]
async fn kill_after_send_before_mark_redelivers_and_the_inbox_ships_once() {
    let mut run = conformance::kill_between_ack_and_mark::<HttpSink>(relay()).await;
    let received = run.sink.receiver.received();
    assert_eq!(received.len(), 8, "8 received");

    // A naive receiver ships on every request; the inbox ships once per event.
    let db = &mut run.client;
    db.batch_execute(
        "CREATE TABLE naive_shipments (order_id bigint); CREATE TABLE shipments (order_id bigint)",
    )
    .await
    .unwrap();
    let inbox = Inbox::default();
    outbox::migrate_inbox(db, inbox.config()).await.unwrap();
    let mut duplicates = 0;
    for d in &run.delivered {
        let order_id = d.payload["order_id"].as_i64().unwrap();
        let event_id: Uuid = d.event_id.parse().unwrap();
        db.execute("INSERT INTO naive_shipments VALUES ($1)", &[&order_id])
            .await
            .unwrap();
        let tx = db.transaction().await.unwrap();
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
    let count = async |sql: &str| -> i64 { run.client.query_one(sql, &[]).await.unwrap().get(0) };
    assert_eq!(
        count("SELECT count(*) FROM naive_shipments").await,
        8,
        "naive ships 3 orders twice"
    );
    assert_eq!(count("SELECT count(*) FROM shipments").await, 5);
    assert_eq!(count("SELECT count(DISTINCT order_id) FROM shipments").await, 5);
    assert_eq!(duplicates, 3);
}
