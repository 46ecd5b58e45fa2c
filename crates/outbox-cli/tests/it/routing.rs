//! `relay --config`: routing by aggregate type. Two real sinks, one down:
//! the other's rows are delivered and marked while the down one's wait
//! (spending no attempt), and go out once it is back. Bad files exit 2 naming what is wrong.

use outbox::Event;
use outbox_testkit::{Receiver, Redis, Respond};
use serde_json::json;

use crate::cli::expect_config_error;
use crate::support::{Db, LONG, distinct_events, read_stream, start_relay, stop_relay, wait_until};

/// Writes `text` to a fresh file and returns its path.
pub fn config_file(text: &str) -> String {
    let path = std::env::temp_dir().join(format!("outbox-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

#[tokio::test]
async fn routing_one_sink_down_delays_only_its_own_rows() {
    let db = Db::start().await;
    let mut redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let events: Vec<Event> = (0..10)
        .flat_map(|i| {
            [
                Event::new("orders", format!("o{i}"), "OrderPlaced", json!({"i": i})),
                Event::new("invoices", format!("i{i}"), "InvoiceSent", json!({"i": i})),
            ]
        })
        .collect();
    outbox::enqueue_all(&db.client, &events).await.unwrap();
    let config = config_file(&format!(
        "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}\"\n",
        receiver.url(),
        redis.url()
    ));
    redis.stop().await.unwrap();

    // Default settings: an outage of any length spends no attempt.
    let relay = start_relay(
        &db.url,
        // --config takes precedence over --sink.
        "unused://x",
        &["--config", &config],
        &[],
    )
    .await;
    wait_until("invoices delivered, orders found unavailable", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'invoices' AND published_at IS NOT NULL")
            .await
            == 10
            && db
                .count(
                    "SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' \
                      AND last_error LIKE 'sink unavailable: %redis%'",
                )
                .await
                == 10
    })
    .await;
    // Only the route that is down waits: invoices written now go out.
    let more: Vec<Event> = (10..20)
        .map(|i| Event::new("invoices", format!("i{i}"), "InvoiceSent", json!({"i": i})))
        .collect();
    outbox::enqueue_all(&db.client, &more).await.unwrap();
    wait_until("the later invoices delivered too", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'invoices' AND published_at IS NOT NULL")
            .await
            == 20
    })
    .await;
    // The fault happened: no order went anywhere, and none spent an attempt.
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NULL")
            .await,
        10
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0
    );
    assert_eq!(receiver.count(), 20, "the HTTP sink got the invoices only");

    redis.restart().await.unwrap();
    db.wait_drained("every row published").await;
    stop_relay(relay).await;

    let stream = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(stream.len(), 10, "10 orders in the stream");
    assert_eq!(distinct_events(&stream), 10);
    let received = receiver.received();
    assert_eq!(received.len(), 20, "no invoice sent twice");
    assert!(
        received.iter().all(|r| r.body["aggregate_type"] == "invoices"),
        "no order went to the default route"
    );
    let _ = std::fs::remove_file(config);
}

#[tokio::test]
async fn routing_bad_config_files_exit_2() {
    let env = [("DATABASE_URL", "postgres://127.0.0.1:1/nowhere")];
    let cases = [
        ("[default]\nsink = \"redis://x\"\nsubjekt = \"a\"\n", "subjekt"),
        ("[default]\nsink = \"ftp://x\"\n", "\"ftp\""),
        (
            "[default]\nsink = \"redis://x\"\n[routes.orders]\nsink = \"nats://x:4222\"\nnats_subject = \"a.{nope}\"\n",
            "[routes.orders]",
        ),
        ("[routes.orders]\nsink = \"redis://x\"\n", "no [default]"),
        ("[default]\nsink = \"redis://x\"\nformat = \"avro\"\n", "avro"),
        ("[default\n", "--config"),
    ];
    for (text, needle) in cases {
        let path = config_file(text);
        expect_config_error(&["relay", "--config", &path], &env, needle).await;
        let _ = std::fs::remove_file(path);
    }
}
