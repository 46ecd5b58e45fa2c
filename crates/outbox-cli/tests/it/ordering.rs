//! `--ordering strict`: an aggregate never gets past its earliest
//! undelivered event, a dead letter blocks only its own aggregate, and
//! `dlq give-up` unblocks it. The seed's case, with `partition` beside it.

use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::support::{Db, LONG, run_cli, start_relay, stop_relay, text, wait_until};

/// Orders 1 and 2, three events each, order 1's first.
async fn two_orders(db: &mut Db) {
    let events: Vec<Event> = [1, 2]
        .into_iter()
        .flat_map(|order| {
            (1..=3).map(move |step| {
                Event::new(
                    "orders",
                    order.to_string(),
                    "Step",
                    json!({"order": order, "step": step}),
                )
            })
        })
        .collect();
    let tx = db.client.transaction().await.unwrap();
    Outbox::default().enqueue_all(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
}

/// `order#step` of every request the receiver answered 2xx, in arrival order.
fn delivered(receiver: &Receiver) -> Vec<String> {
    receiver
        .received()
        .iter()
        .filter(|r| r.status < 300)
        .map(|r| format!("{}#{}", r.body["payload"]["order"], r.body["payload"]["step"]))
        .collect()
}

/// Order 1's first event fails once. Batch size 1 makes the claim order the
/// delivery order; the 2 s backoff leaves order 2 ample time to go first.
async fn first_event_fails_once(ordering: &str) -> Vec<String> {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 1,
        status: 500,
    })
    .await
    .unwrap();
    two_orders(&mut db).await;
    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &[
            "--ordering",
            ordering,
            "--batch-size",
            "1",
            "--backoff-base",
            "2s",
        ],
        &[],
    )
    .await;
    db.wait_drained("everything published").await;
    stop_relay(relay).await;
    delivered(&receiver)
}

#[tokio::test]
async fn strict_waits_for_the_failed_event_partition_does_not() {
    assert_eq!(
        first_event_fails_once("strict").await,
        ["2#1", "2#2", "2#3", "1#1", "1#2", "1#3"],
        "strict: order 1 resumes only with its first event"
    );
    // `partition` promises nothing across a retry (here the relay happens to
    // hold order 1 back, because its later events were claimed while the
    // failed one was in flight); it only promises every event.
    let mut partition = first_event_fails_once("partition").await;
    partition.sort();
    assert_eq!(partition, ["1#1", "1#2", "1#3", "2#1", "2#2", "2#3"]);
}

#[tokio::test]
async fn a_dead_letter_blocks_only_its_aggregate_until_skipped() {
    let mut db = Db::start().await;
    // The first request (order 1's first event) is refused for good.
    let receiver = Receiver::start(Respond::Sequence(vec![422])).await.unwrap();
    two_orders(&mut db).await;
    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--ordering", "strict", "--batch-size", "1"],
        &[],
    )
    .await;
    let env = [("DATABASE_URL", db.url.as_str())];

    // With batch size 1 the claim goes by id, so had order 1's later events
    // been claimable they would have gone before any of order 2's.
    wait_until("order 2 delivered", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_id = '2' AND published_at IS NOT NULL")
            .await
            == 3
    })
    .await;
    assert_eq!(delivered(&receiver), ["2#1", "2#2", "2#3"]);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_id = '1' AND published_at IS NULL")
            .await,
        3,
        "order 1 is held back behind its dead letter"
    );
    let stats = run_cli(&["stats", "--json"], &env).await;
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["dead_letters"], 1, "{stats}");
    assert_eq!(stats["blocked_aggregates"], 1, "{stats}");

    let skip = run_cli(&["dlq", "give-up", "--id", "1"], &env).await;
    assert_eq!(skip.status.code(), Some(0), "{}", text(&skip.stderr));
    assert!(text(&skip.stdout).contains("gave up on 1 dead letter in"));
    wait_until("order 1's later events delivered", LONG, || async {
        db.unpublished().await == 1
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(delivered(&receiver), ["2#1", "2#2", "2#3", "1#2", "1#3"]);

    // The given-up event stays for inspection and no longer blocks.
    let list = run_cli(&["dlq", "list", "--json"], &env).await;
    let list: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert!(list[0]["given_up_at"].is_string(), "{list}");
    let stats = run_cli(&["stats", "--json"], &env).await;
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["given_up"], 1, "{stats}");
    assert_eq!(stats["blocked_aggregates"], 0, "{stats}");
}

#[tokio::test]
async fn ordering_for_holds_only_the_listed_type_to_strict_order() {
    let mut db = Db::start().await;
    // The first two requests, the first event of each type, are refused
    // for good: two dead letters.
    let receiver = Receiver::start(Respond::Sequence(vec![422, 422])).await.unwrap();
    let events: Vec<Event> = ["orders", "payments"]
        .into_iter()
        .flat_map(|kind| {
            (1..=3).map(move |step| Event::new(kind, "1", "Step", json!({"kind": kind, "step": step})))
        })
        .collect();
    let tx = db.client.transaction().await.unwrap();
    Outbox::default().enqueue_all(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--ordering-for", "orders=strict", "--batch-size", "1"],
        &[],
    )
    .await;
    wait_until(
        "payments 2 and 3 delivered past their dead letter",
        LONG,
        || async {
            db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
                .await
                == 2
        },
    )
    .await;
    let delivered: Vec<String> = receiver
        .received()
        .iter()
        .filter(|r| r.status < 300)
        .map(|r| {
            format!(
                "{}#{}",
                r.body["payload"]["kind"].as_str().unwrap(),
                r.body["payload"]["step"]
            )
        })
        .collect();
    assert_eq!(delivered, ["payments#2", "payments#3"]);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NULL AND attempts = 0")
            .await,
        2,
        "orders, strict, wait behind their dead letter without an attempt"
    );
    stop_relay(relay).await;

    for bad in [
        &["--ordering-for", "orders=none"][..],
        &["--ordering", "none", "--ordering-for", "orders=strict"][..],
        &["--ordering-for", "orders"][..],
    ] {
        let mut args = vec!["relay", "--sink", "http://127.0.0.1:9"];
        args.extend_from_slice(bad);
        let out = run_cli(&args, &[("DATABASE_URL", db.url.as_str())]).await;
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("orders"), "{}", text(&out.stderr));
    }
}
