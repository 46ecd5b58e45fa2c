//! The relay to Kafka (a real Kafka-protocol broker, tansu, started by the
//! testkit): the conformance suite's [`KafkaSink`] (volume and order per
//! key, the broker going away, a re-send after a kill, an oversized record
//! refused by librdkafka's `message.max.bytes`, passed with
//! `--kafka-option`), and what only Kafka has: bad topics and properties.
//!
//! tansu is found through `OUTBOX_TANSU`, `PATH` or `~/.cache/outbox-tools`,
//! where `scripts/deps.sh` builds it once; without it these tests fail with
//! the command that installs it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_testkit::Kafka;
use outbox_testkit::conformance::{Delivered, Scenario, SinkUnderTest};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::cli::expect_config_error;
use crate::support::{Db, LONG};

const TOPIC: &str = "outbox.event.orders";
/// More than one, so keys really are spread and order is per partition.
const PARTITIONS: i32 = 4;
/// Timeout of one broker request made by the test itself.
const REQUEST: Duration = Duration::from_secs(10);

/// librdkafka's `message.max.bytes` in the oversized scenario.
const MAX_MESSAGE_BYTES: usize = 2000;

/// Kafka for the conformance suite: a tansu broker with topic
/// `outbox.event.orders` of 4 partitions, read back partition by partition
/// in offset order. Kafka keeps re-sends; the `id` header is what lets a
/// consumer drop them. The size limit is librdkafka's, set with
/// `--kafka-option`.
pub(crate) struct KafkaSink {
    kafka: Kafka,
}

impl SinkUnderTest for KafkaSink {
    const NAME: &'static str = "kafka";
    const ERROR_WORD: &'static str = "kafka";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let kafka = Kafka::start().await?;
        kafka.create_topic(TOPIC, PARTITIONS as u32).await?;
        Ok(KafkaSink { kafka })
    }

    fn url(&self) -> String {
        self.kafka.url()
    }

    async fn stop(&mut self) -> Result<(), outbox_testkit::Error> {
        self.kafka.stop().await
    }

    async fn restart(&mut self) -> Result<(), outbox_testkit::Error> {
        self.kafka.restart().await
    }

    async fn stored(&self) -> Result<usize, outbox_testkit::Error> {
        let servers = self.kafka.bootstrap_servers();
        let stored = tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = client_config(&servers).create().expect("consumer");
            (0..PARTITIONS)
                .map(|p| {
                    consumer
                        .fetch_watermarks(TOPIC, p, REQUEST)
                        .expect("watermarks")
                        .1
                })
                .sum::<i64>()
        })
        .await
        .expect("watermark reader");
        Ok(stored as usize)
    }

    async fn delivered(&self) -> Result<Vec<Delivered>, outbox_testkit::Error> {
        let (stored, records) = read_topic(&self.kafka, TOPIC, PARTITIONS).await;
        assert_eq!(stored as usize, records.len(), "read every stored record");
        records
            .into_iter()
            .map(|r| {
                let mut d =
                    Delivered::from_json(&r.value).map_err(|detail| outbox_testkit::Error::Failed {
                        doing: format!("reading topic {TOPIC}"),
                        detail,
                    })?;
                let ids: Vec<&str> = r
                    .headers
                    .iter()
                    .filter(|(k, _)| k == "id")
                    .map(|(_, v)| v.as_str())
                    .collect();
                d.dedup_id = (!ids.is_empty()).then(|| ids.join(","));
                d.headers = r.headers.iter().filter(|(k, _)| k != "id").cloned().collect();
                d.properties = vec![
                    ("key".into(), r.key.clone()),
                    ("partition".into(), r.partition.to_string()),
                ];
                Ok(d)
            })
            .collect()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(MAX_MESSAGE_BYTES)
    }

    fn oversize_flags(&self) -> Vec<String> {
        // librdkafka refuses a record over message.max.bytes before sending
        // it: the option reached it.
        vec![
            "--kafka-option".into(),
            format!("message.max.bytes={MAX_MESSAGE_BYTES},linger.ms=1"),
        ]
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("kafka://", "kafka://"),
            ("kafka://127.0.0.1:notaport", "notaport"),
            ("kafka://127.0.0.1:9092,127.0.0.1", "has no port"),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        let mut partitions: HashMap<&str, HashSet<&str>> = HashMap::new();
        for d in delivered {
            let key = d.property("key").expect("key");
            assert_eq!(key, d.aggregate_id, "kafka: the key is the aggregate id");
            partitions
                .entry(key)
                .or_default()
                .insert(d.property("partition").expect("partition"));
        }
        // Records are read partition by partition, each in offset order:
        // with every aggregate in one partition, the suite's order check is
        // order per key.
        let split = partitions.values().filter(|ps| ps.len() > 1).count();
        assert_eq!(split, 0, "kafka: aggregates split over partitions");
        if scenario == Scenario::InOrder {
            let used: HashSet<&str> = partitions.values().flatten().copied().collect();
            assert_eq!(
                used.len(),
                PARTITIONS as usize,
                "kafka: 500 keys spread over every partition"
            );
        }
    }
}

fn client_config(bootstrap_servers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap_servers);
    config
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

#[tokio::test]
async fn kafka_bad_topics_and_options_exit_2() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    // Bad URLs: `conformance_kafka_bad_urls`.
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
