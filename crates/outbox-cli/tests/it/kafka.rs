//! The relay to Kafka (a real Kafka-protocol broker, tansu, started by the
//! testkit): volume and per-aggregate order per key, the broker going away
//! for 10 s, a re-send carrying the same `id` header, headers and keys,
//! librdkafka properties passed through, bad URLs, topics and properties.
//!
//! tansu is found through `OUTBOX_TANSU`, `PATH` or `~/.cache/outbox-tools`,
//! where `scripts/deps.sh` builds it once; without it these tests fail with
//! the command that installs it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox::{Event, Outbox};
use outbox_testkit::Kafka;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;

use crate::cli::expect_config_error;
use crate::support::{
    Db, LONG, OUTAGE_FLAGS, StreamEvent, distinct_events, first_delivery_violations, order_violations,
    start_relay, stop_relay, wait_until,
};

const TOPIC: &str = "outbox.event.orders";
/// More than one, so keys really are spread and order is per partition.
const PARTITIONS: i32 = 4;
/// Timeout of one broker request made by the test itself.
const REQUEST: Duration = Duration::from_secs(10);

/// One record as a consumer sees it.
#[derive(Debug)]
struct Record {
    partition: i32,
    event: StreamEvent,
    key: String,
    /// Every header, in order (a name may repeat).
    headers: Vec<(String, String)>,
}

impl Record {
    fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

fn client_config(bootstrap_servers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap_servers);
    config
}

async fn create_topic(kafka: &Kafka) {
    kafka
        .create_topic(TOPIC, PARTITIONS as u32)
        .await
        .expect("create topic");
}

/// Every record of the test topic, partition by partition in offset order,
/// and the broker's own count (the sum of the high watermarks).
async fn read_all(kafka: &Kafka) -> (i64, Vec<Record>) {
    let (stored, raw) = read_topic(kafka, TOPIC, PARTITIONS).await;
    let records = raw
        .into_iter()
        .map(|r| {
            let body: serde_json::Value = serde_json::from_slice(&r.value).expect("JSON body");
            Record {
                partition: r.partition,
                event: StreamEvent {
                    event_id: body["event_id"].as_str().unwrap().to_owned(),
                    aggregate_id: body["aggregate_id"].as_str().unwrap().to_owned(),
                    outbox_id: body["outbox_id"].as_i64().unwrap(),
                },
                key: r.key,
                headers: r.headers,
            }
        })
        .collect();
    (stored, records)
}

/// One record as stored: partition, key, value bytes, headers in order.
#[derive(Debug)]
pub(crate) struct RawRecord {
    pub(crate) partition: i32,
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
}

/// Every record of `topic`, partition by partition in offset order, and the
/// broker's own count (the sum of the high watermarks).
pub(crate) async fn read_topic(kafka: &Kafka, topic: &str, partitions: i32) -> (i64, Vec<RawRecord>) {
    let servers = kafka.bootstrap_servers();
    let topic = topic.to_owned();
    // librdkafka's consumer API blocks.
    tokio::task::spawn_blocking(move || read_topic_blocking(&servers, &topic, partitions))
        .await
        .expect("reader")
}

fn read_topic_blocking(bootstrap_servers: &str, topic: &str, partitions: i32) -> (i64, Vec<RawRecord>) {
    let consumer: BaseConsumer = client_config(bootstrap_servers)
        .set("group.id", "outbox-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut stored = 0;
    let mut ends = HashMap::new();
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, REQUEST).expect("watermarks");
        assert_eq!(low, 0, "nothing deleted from partition {p}");
        stored += high;
        if high > 0 {
            ends.insert(p, high);
            assignment
                .add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
        }
    }
    consumer.assign(&assignment).expect("assign");

    let mut by_partition: HashMap<i32, Vec<RawRecord>> = HashMap::new();
    let mut done: HashSet<i32> = HashSet::new();
    let deadline = Instant::now() + LONG;
    while done.len() < ends.len() {
        assert!(
            Instant::now() < deadline,
            "read only {} of {stored} records within {LONG:?}",
            by_partition.values().map(Vec::len).sum::<usize>()
        );
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.expect("consume");
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| {
                        let value = String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned();
                        (h.key.to_owned(), value)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let record = RawRecord {
            partition: m.partition(),
            key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
            value: m.payload().unwrap_or_default().to_vec(),
            headers,
        };
        by_partition.entry(m.partition()).or_default().push(record);
        if m.offset() + 1 >= ends[&m.partition()] {
            done.insert(m.partition());
        }
    }
    let mut order: Vec<i32> = by_partition.keys().copied().collect();
    order.sort_unstable();
    let records = order
        .into_iter()
        .flat_map(|p| by_partition.remove(&p).unwrap_or_default())
        .collect();
    (stored, records)
}

fn events(records: &[Record]) -> Vec<StreamEvent> {
    records.iter().map(|r| r.event.clone()).collect()
}

/// Aggregates whose records landed in more than one partition.
fn split_aggregates(records: &[Record]) -> usize {
    let mut partitions: HashMap<&str, HashSet<i32>> = HashMap::new();
    for r in records {
        partitions.entry(&r.key).or_default().insert(r.partition);
    }
    partitions.values().filter(|ps| ps.len() > 1).count()
}

#[tokio::test]
async fn kafka_delivers_5000_events_exactly_once_in_aggregate_order() {
    let mut db = Db::start().await;
    let kafka = Kafka::start().await.unwrap();
    create_topic(&kafka).await;
    db.insert_events(5_000, 10).await;

    let relay = start_relay(&db.url, &kafka.url(), &["--batch-size", "500"], &[]).await;
    db.wait_drained("all 5,000 events published").await;
    stop_relay(relay).await;

    let (stored, records) = read_all(&kafka).await;
    assert_eq!(stored, 5_000, "the broker's own count");
    let events = events(&records);
    assert_eq!(events.len(), 5_000);
    assert_eq!(distinct_events(&events), 5_000);
    // Records are read partition by partition, each in offset order, and
    // an aggregate lives in one partition: this is order per key.
    assert_eq!(split_aggregates(&records), 0);
    assert_eq!(order_violations(&events), 0);
    let aggregates: HashSet<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(aggregates.len(), 500);
    let used: HashSet<i32> = records.iter().map(|r| r.partition).collect();
    assert_eq!(
        used.len(),
        PARTITIONS as usize,
        "500 keys spread over every partition"
    );
    for r in &records {
        assert_eq!(r.key, r.event.aggregate_id, "the key is the aggregate id");
        assert_eq!(
            r.header("id"),
            [r.event.event_id.as_str()],
            "the id header is the event_id"
        );
    }
}

#[tokio::test]
async fn kafka_down_10s_loses_nothing() {
    let mut db = Db::start().await;
    let mut kafka = Kafka::start().await.unwrap();
    create_topic(&kafka).await;
    db.insert_events(2_000, 4).await;
    let relay = start_relay(&db.url, &kafka.url(), OUTAGE_FLAGS, &[]).await;
    db.wait_published(200).await;

    kafka.stop().await.unwrap();
    let stopped = Instant::now();
    // Each attempt waits out the 2 s timeout while the broker is down, so
    // 10 s down is about 4 attempts of the oldest row.
    wait_until("10 s down and a row failed 3 times", LONG, || async {
        stopped.elapsed() >= Duration::from_secs(10)
            && db
                .count("SELECT count(*) FROM outbox WHERE published_at IS NULL AND attempts >= 3")
                .await
                > 0
    })
    .await;
    let left = db.unpublished().await;
    assert!(left > 0 && left < 2_000, "{left} rows left while Kafka is down");
    let error: String = db
        .client
        .query_one(
            "SELECT last_error FROM outbox WHERE published_at IS NULL ORDER BY attempts DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("kafka"), "{error}");

    kafka.restart().await.unwrap();
    db.wait_drained("everything published once Kafka is back").await;
    stop_relay(relay).await;

    let (stored, records) = read_all(&kafka).await;
    let events = events(&records);
    assert_eq!(stored as usize, events.len(), "read every stored record");
    assert_eq!(distinct_events(&events), 2_000, "nothing lost");
    // A record the broker kept but whose report was lost with the broker
    // is sent again: at most the one batch in flight when it stopped.
    let duplicates = events.len() - 2_000;
    eprintln!(
        "kafka down 10 s: {} records, 2000 distinct, {duplicates} duplicates, \
         {} first-delivery order violations",
        events.len(),
        first_delivery_violations(&events)
    );
    assert!(duplicates <= 50, "{duplicates} duplicates");
    assert_eq!(split_aggregates(&records), 0);
}

#[tokio::test]
async fn kafka_resend_after_a_kill_carries_the_same_id_key_and_headers() {
    let db = Db::start().await;
    let kafka = Kafka::start().await.unwrap();
    create_topic(&kafka).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let outbox = Outbox::default();
    for order in 1..=5 {
        let event = Event::new(
            "orders",
            order.to_string(),
            "OrderPlaced",
            json!({"order": order}),
        )
        .with_header("traceparent", traceparent)
        // Must not replace the sink's own `id` header.
        .with_header("id", "spoofed");
        outbox.enqueue(&db.client, &event).await.unwrap();
    }

    // A batch of 3 is written and acknowledged, then the relay parks before marking.
    let mut relay = start_relay(
        &db.url,
        &kafka.url(),
        &["--batch-size", "3"],
        &[("OUTBOX_FAILPOINT", "pause-after-deliver")],
    )
    .await;
    relay
        .wait_for_line("failpoint pause-after-deliver reached", LONG)
        .await
        .unwrap();
    assert_eq!(read_all(&kafka).await.0, 3, "the fault: 3 stored");
    assert_eq!(db.unpublished().await, 5, "none marked");
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();

    let relay = start_relay(&db.url, &kafka.url(), &["--batch-size", "3"], &[]).await;
    db.wait_drained("all 5 published after the restart").await;
    stop_relay(relay).await;

    // 8 records, 5 events: Kafka keeps re-sends, and the `id` header is
    // what lets a consumer (the inbox) drop them.
    let (stored, records) = read_all(&kafka).await;
    assert_eq!(stored, 8);
    assert_eq!(records.len(), 8);
    let ids: HashSet<&str> = records.iter().flat_map(|r| r.header("id")).collect();
    assert_eq!(ids.len(), 5);
    for r in &records {
        assert_eq!(r.header("id"), [r.event.event_id.as_str()]);
        assert_eq!(r.key, r.event.aggregate_id);
        assert_eq!(r.header("traceparent"), [traceparent]);
    }
}

#[tokio::test]
async fn kafka_options_reach_librdkafka_and_an_oversized_record_dead_letters_at_once() {
    let mut db = Db::start().await;
    let kafka = Kafka::start().await.unwrap();
    create_topic(&kafka).await;
    let small = |i: usize| Event::new("orders", format!("order-{i}"), "OrderPlaced", json!({"i": i}));
    let big = Event::new("orders", "big", "OrderPlaced", json!({"blob": "x".repeat(5_000)}));
    let tx = db.client.transaction().await.unwrap();
    Outbox::default()
        .enqueue_all(&tx, &[small(0), big, small(1), small(2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // librdkafka refuses a record over message.max.bytes before sending it;
    // the relay must take that as permanent, not retry it for ever.
    let relay = start_relay(
        &db.url,
        &kafka.url(),
        &["--kafka-option", "message.max.bytes=2000,linger.ms=1"],
        &[],
    )
    .await;
    wait_until("3 delivered and the big one dead", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 3
            && db.count("SELECT count(*) FROM outbox WHERE attempts >= 5").await == 1
    })
    .await;
    stop_relay(relay).await;

    let (attempts, error): (i32, String) = db
        .client
        .query_one(
            "SELECT attempts, last_error FROM outbox WHERE aggregate_id = 'big'",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert!(
        error.starts_with("permanent: kafka") && error.contains("too large"),
        "{error}"
    );
    assert_eq!(attempts, 5, "dead-lettered on its first attempt");
    let (stored, records) = read_all(&kafka).await;
    assert_eq!(stored, 3);
    let mut keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["order-0", "order-1", "order-2"]);
}

#[tokio::test]
async fn kafka_bad_urls_and_topics_exit_2() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    expect_config_error(&["relay", "--sink", "kafka://"], &env, "kafka://").await;
    expect_config_error(
        &["relay", "--sink", "kafka://127.0.0.1:notaport"],
        &env,
        "notaport",
    )
    .await;
    expect_config_error(
        &["relay", "--sink", "kafka://127.0.0.1:9092,127.0.0.1"],
        &env,
        "has no port",
    )
    .await;
    expect_config_error(
        &[
            "relay",
            "--sink",
            "kafka://127.0.0.1:9092",
            "--kafka-topic",
            "a.{aggregate}",
        ],
        &env,
        "--kafka-topic",
    )
    .await;
    expect_config_error(
        &[
            "relay",
            "--sink",
            "kafka://127.0.0.1:9092",
            "--kafka-topic",
            "outbox events",
        ],
        &env,
        "not allowed",
    )
    .await;
    let kafka = ["relay", "--sink", "kafka://127.0.0.1:9092"];
    for (option, needle) in [
        ("acks=1", "acks=all"),
        ("enable.idempotence=false", "idempotent"),
        ("no.such.property=1", "no.such.property"),
        ("compression.type=rot13", "rot13"),
        ("linger.ms", "KEY=VALUE"),
    ] {
        expect_config_error(&[&kafka[..], &["--kafka-option", option]].concat(), &env, needle).await;
    }
}
