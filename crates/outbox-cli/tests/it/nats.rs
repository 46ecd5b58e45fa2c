//! The relay to NATS JetStream: volume and per-aggregate order, the server
//! going away, a re-send dropped by `Nats-Msg-Id`, headers, a missing
//! stream, bad URLs.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull::OrderedConfig, stream::Stream};
use futures::StreamExt;
use outbox::{Event, Outbox};
use outbox_testkit::Nats;
use serde_json::json;

use crate::cli::expect_config_error;
use crate::support::{
    Db, LONG, OUTAGE_FLAGS, StreamEvent, distinct_events, order_violations, start_relay, stop_relay,
    wait_until,
};

pub(crate) const STREAM: &str = "OUTBOX";

/// One message as a consumer sees it.
struct Received {
    event: StreamEvent,
    msg_id: String,
    headers: async_nats::HeaderMap,
}

pub(crate) async fn jetstream(nats: &Nats) -> jetstream::Context {
    let client = async_nats::connect(nats.url()).await.expect("connect to nats");
    jetstream::new(client)
}

pub(crate) async fn create_stream(nats: &Nats) -> Stream {
    jetstream(nats)
        .await
        .create_stream(jetstream::stream::Config {
            name: STREAM.into(),
            subjects: vec!["outbox.event.>".into()],
            ..Default::default()
        })
        .await
        .expect("create stream")
}

/// How many messages the stream holds (the server's count, not ours).
async fn stored(nats: &Nats) -> u64 {
    let stream = jetstream(nats)
        .await
        .get_stream(STREAM)
        .await
        .expect("get stream");
    stream.get_info().await.expect("stream info").state.messages
}

/// Every message of the stream, in stream order, read with an ordered consumer.
async fn read_all(nats: &Nats) -> Vec<Received> {
    let n = stored(nats).await as usize;
    let stream = jetstream(nats).await.get_stream(STREAM).await.unwrap();
    let consumer = stream
        .create_consumer(OrderedConfig::default())
        .await
        .expect("create consumer");
    let mut messages = consumer.messages().await.expect("consume").take(n);
    let mut out = Vec::with_capacity(n);
    while let Some(m) = tokio::time::timeout(LONG, messages.next())
        .await
        .expect("the consumer got every stored message")
    {
        let m = m.expect("message");
        let body: serde_json::Value = serde_json::from_slice(&m.payload).expect("JSON body");
        let headers = m.headers.clone().unwrap_or_default();
        out.push(Received {
            event: StreamEvent {
                event_id: body["event_id"].as_str().unwrap().to_owned(),
                aggregate_id: body["aggregate_id"].as_str().unwrap().to_owned(),
                outbox_id: body["outbox_id"].as_i64().unwrap(),
            },
            msg_id: headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default(),
            headers,
        });
    }
    out
}

fn events(received: &[Received]) -> Vec<StreamEvent> {
    received.iter().map(|r| r.event.clone()).collect()
}

#[tokio::test]
async fn nats_delivers_5000_events_exactly_once_in_aggregate_order() {
    let mut db = Db::start().await;
    let nats = Nats::start().await.unwrap();
    create_stream(&nats).await;
    db.insert_events(5_000, 10).await;

    let relay = start_relay(&db.url, &nats.url(), &["--batch-size", "500"], &[]).await;
    db.wait_drained("all 5,000 events published").await;
    stop_relay(relay).await;

    assert_eq!(stored(&nats).await, 5_000, "the stream's own count");
    let received = read_all(&nats).await;
    let events = events(&received);
    assert_eq!(events.len(), 5_000);
    assert_eq!(distinct_events(&events), 5_000);
    assert_eq!(order_violations(&events), 0);
    let aggregates: std::collections::HashSet<&str> =
        events.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(aggregates.len(), 500);
    assert!(
        received.iter().all(|r| r.msg_id == r.event.event_id),
        "Nats-Msg-Id is the event_id"
    );
}

#[tokio::test]
async fn nats_down_10s_loses_nothing_and_resends_are_deduplicated() {
    let mut db = Db::start().await;
    let mut nats = Nats::start().await.unwrap();
    create_stream(&nats).await;
    db.insert_events(2_000, 4).await;
    let relay = start_relay(&db.url, &nats.url(), OUTAGE_FLAGS, &[]).await;
    db.wait_published(200).await;

    nats.stop().await.unwrap();
    // 12 failed attempts at 100 ms doubling, capped at 1 s: ~10 s down.
    // Events behind a failed one of the same aggregate may be held back
    // rather than attempted, so not every row reaches 12.
    wait_until("a row failed 12 times while NATS is down", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL AND attempts >= 12")
            .await
            > 0
    })
    .await;
    let left = db.unpublished().await;
    assert!(left > 0 && left < 2_000, "{left} rows left while NATS is down");
    let error: String = db
        .client
        .query_one(
            "SELECT last_error FROM outbox WHERE published_at IS NULL ORDER BY attempts DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("nats"), "{error}");

    nats.restart().await.unwrap();
    db.wait_drained("everything published once NATS is back").await;
    stop_relay(relay).await;

    assert_eq!(
        stored(&nats).await,
        2_000,
        "exactly N: re-sends were dropped by Nats-Msg-Id"
    );
    let events = events(&read_all(&nats).await);
    assert_eq!(distinct_events(&events), 2_000);
}

#[tokio::test]
async fn nats_resend_after_a_kill_is_dropped_by_msg_id_and_headers_arrive() {
    let db = Db::start().await;
    let nats = Nats::start().await.unwrap();
    create_stream(&nats).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let outbox = Outbox::default();
    for order in 1..=5 {
        let event = Event::new(
            "orders",
            order.to_string(),
            "OrderPlaced",
            json!({"order": order}),
        )
        .with_header("traceparent", traceparent);
        outbox.enqueue(&db.client, &event).await.unwrap();
    }

    // A batch of 3 is published and acked, then the relay parks before marking.
    let mut relay = start_relay(
        &db.url,
        &nats.url(),
        &["--batch-size", "3"],
        &[("OUTBOX_FAILPOINT", "pause-after-deliver")],
    )
    .await;
    relay
        .wait_for_line("failpoint pause-after-deliver reached", LONG)
        .await
        .unwrap();
    assert_eq!(stored(&nats).await, 3, "the fault: 3 stored");
    assert_eq!(db.unpublished().await, 5, "none marked");
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();

    let relay = start_relay(&db.url, &nats.url(), &["--batch-size", "3"], &[]).await;
    db.wait_drained("all 5 published after the restart").await;
    stop_relay(relay).await;

    // 8 publishes, 5 stored: without the Msg-Id the stream would hold 8.
    assert_eq!(stored(&nats).await, 5);
    let received = read_all(&nats).await;
    assert_eq!(received.len(), 5);
    for r in &received {
        assert_eq!(r.msg_id, r.event.event_id);
        assert_eq!(
            r.headers.get("traceparent").map(|v| v.as_str()),
            Some(traceparent)
        );
    }
}

#[tokio::test]
async fn nats_without_a_stream_retries_until_one_is_created() {
    let db = Db::start().await;
    let nats = Nats::start().await.unwrap();
    outbox::enqueue(&db.client, &Event::new("orders", "1", "OrderPlaced", json!({})))
        .await
        .unwrap();
    let relay = start_relay(
        &db.url,
        &nats.url(),
        &[
            "--backoff-base",
            "100ms",
            "--backoff-max",
            "200ms",
            "--max-attempts",
            "1000",
        ],
        &[],
    )
    .await;
    wait_until("a failed attempt", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE attempts >= 1").await == 1
    })
    .await;
    let error: String = db
        .client
        .query_one("SELECT last_error FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        error.contains("no JetStream stream captures subject \"outbox.event.orders\""),
        "{error}"
    );
    assert_eq!(db.unpublished().await, 1);

    create_stream(&nats).await;
    wait_until(
        "published once the stream exists",
        Duration::from_secs(30),
        || async { db.unpublished().await == 0 },
    )
    .await;
    stop_relay(relay).await;
    assert_eq!(stored(&nats).await, 1);
}

#[tokio::test]
async fn nats_bad_urls_and_subjects_exit_2() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    expect_config_error(&["relay", "--sink", "nats://"], &env, "nats://").await;
    expect_config_error(
        &["relay", "--sink", "nats://127.0.0.1:notaport"],
        &env,
        "notaport",
    )
    .await;
    expect_config_error(
        &[
            "relay",
            "--sink",
            "nats://127.0.0.1:4222",
            "--nats-subject",
            "a.{aggregate}",
        ],
        &env,
        "--nats-subject",
    )
    .await;
    expect_config_error(
        &[
            "relay",
            "--sink",
            "nats://127.0.0.1:4222",
            "--nats-subject",
            "outbox.>",
        ],
        &env,
        "wildcard",
    )
    .await;
}
