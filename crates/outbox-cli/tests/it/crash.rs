//! kill -9 between "the sink acknowledged" and "marked published", as the
//! conformance suite's scenario does it for HTTP (8 received, 5 distinct,
//! the same event_id and `Idempotency-Key` on the re-send), then what a
//! consumer makes of it: a naive receiver ships 8, behind the inbox 5.
//! And the failpoint those kills stop at: only after an acknowledgement.

use outbox::{Inbox, Processed};
use outbox_testkit::conformance::{self, HttpSink};
use outbox_testkit::{Receiver, Respond};
use uuid::Uuid;

use crate::conformance::relay;
use crate::support::{Db, LONG, start_relay, stop_relay, wait_until};

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

/// The failpoint that crash tests kill at waits for an acknowledgement: a
/// batch the sink refused goes on to be marked (an attempt spent), and the
/// relay parks only at the first batch the sink took. Parked on a refused
/// batch, a kill there would re-send nothing, and a test (the soak's
/// "relay SIGKILL after the sink's ack") would count no duplicate.
#[tokio::test]
async fn the_after_deliver_failpoint_parks_only_once_the_sink_acknowledged() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(500)).await.unwrap();
    db.insert_events(3, 1).await;
    let mut relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--batch-size", "3"],
        &[("OUTBOX_FAILPOINT", "pause-after-deliver")],
    )
    .await;

    // Refused: marked with an attempt each (more, if their retries came
    // due meanwhile), not parked before the mark.
    wait_until("the refused batch marked", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE attempts >= 1").await == 3
    })
    .await;
    assert!(!relay.notified("OUTBOX_FAILPOINT=pause-after-deliver reached"));
    assert!(receiver.received().iter().all(|p| p.status == 500));

    // Taken: parked with what it sent (the retries come due apart, so 1 to
    // 3 rows) and none marked; killed there, a fresh relay sends them again.
    let taken = || receiver.received().into_iter().filter(|p| p.status == 200);
    receiver.set_respond(Respond::Ok);
    relay
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-deliver reached", LONG)
        .await
        .unwrap();
    let before = taken().count();
    assert!(before >= 1, "parked after an acknowledgement");
    assert_eq!(db.unpublished().await, 3);
    relay.kill().unwrap();
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    db.wait_drained("the re-sent batch published").await;
    stop_relay(relay).await;
    let ids: Vec<String> = taken()
        .map(|p| p.body["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        ids.len(),
        before + 3,
        "{before} acknowledged before the kill, 3 after: {ids:?}"
    );
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 3);
}
