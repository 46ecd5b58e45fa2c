//! The relay to Amazon SQS and SNS, against a real moto server started by
//! the testkit ([`Moto`]): the conformance suite on a standard queue, a
//! FIFO queue (which drops a re-send by its `MessageDeduplicationId`, so a
//! relay killed between ack and mark leaves each event in the queue exactly
//! once) and an SNS topic subscribed to a queue with raw message delivery;
//! then what only these sinks do: a message whose attributes take it over
//! the limit, a queue that does not exist, and a throughput smoke figure.
//! The claim check through S3 is `sqs_claim_check.rs`'s, with these
//! helpers (the [`Reader`] follows its pointers).
//!
//! moto is found through `OUTBOX_MOTO_SERVER`, `PATH` or
//! `~/.cache/outbox-tools/moto`, where `scripts/deps.sh` installs it;
//! without it these tests fail with the command that installs it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use outbox_testkit::conformance::{self, Delivered, LONG, Scenario, SinkUnderTest};
use outbox_testkit::{Moto, moto};
use serde_json::json;

use crate::conformance::scenario;
use crate::support::{Db, start_relay, stop_relay, wait_until};

/// The queue (and topic) every scenario's events go to.
pub(crate) const QUEUE: &str = "outbox-orders";
/// The standard queue's `MaximumMessageSize`: SQS's historical 256 KiB.
pub(crate) const MAX_MESSAGE: usize = 256 * 1024;
/// The size attributes of a message whose body is in S3 (the extended
/// clients' of today, and the 1.x Java client's).
pub(crate) const SIZE_ATTRIBUTES: [&str; 2] = ["ExtendedPayloadSize", "SQSLargePayloadSize"];

pub(crate) fn failed(doing: &str, e: impl std::fmt::Display) -> outbox_testkit::Error {
    outbox_testkit::Error::Failed {
        doing: doing.to_owned(),
        detail: e.to_string(),
    }
}

/// A configuration builder of SDK crate `$sdk` for `moto`: its region,
/// credentials and endpoint.
macro_rules! moto_config {
    ($sdk:ident, $moto:expr) => {
        $sdk::Config::builder()
            .behavior_version($sdk::config::BehaviorVersion::latest())
            .region($sdk::config::Region::new(moto::REGION))
            .credentials_provider($sdk::config::Credentials::new(
                moto::ACCESS_KEY_ID,
                moto::SECRET_ACCESS_KEY,
                None,
                None,
                "moto",
            ))
            .endpoint_url($moto.endpoint())
    };
}

pub(crate) fn sqs_client(moto: &Moto) -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::from_conf(moto_config!(aws_sdk_sqs, moto).build())
}

pub(crate) fn sns_client(moto: &Moto) -> aws_sdk_sns::Client {
    aws_sdk_sns::Client::from_conf(moto_config!(aws_sdk_sns, moto).build())
}

pub(crate) fn s3_client(moto: &Moto) -> aws_sdk_s3::Client {
    aws_sdk_s3::Client::from_conf(moto_config!(aws_sdk_s3, moto).force_path_style(true).build())
}

pub(crate) async fn create_queue(
    moto: &Moto,
    name: &str,
    fifo: bool,
) -> Result<String, outbox_testkit::Error> {
    let mut create = sqs_client(moto)
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::MaximumMessageSize, MAX_MESSAGE.to_string());
    if fifo {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let out = create.send().await.map_err(|e| {
        failed(
            &format!("creating queue {name}"),
            aws_sdk_sqs::error::DisplayErrorContext(e),
        )
    })?;
    out.queue_url()
        .map(str::to_owned)
        .ok_or_else(|| failed(&format!("creating queue {name}"), "no queue URL"))
}

/// What a queue held, read by receiving and deleting everything (so a
/// FIFO queue hands out every group) into a cache, which `stored` counts
/// with what is still in the queue. A message with a claim check's size
/// attribute is read from S3, as the extended clients read it.
pub(crate) struct Reader {
    client: aws_sdk_sqs::Client,
    s3: aws_sdk_s3::Client,
    url: String,
    read: Mutex<Vec<Delivered>>,
}

impl Reader {
    pub(crate) fn new(moto: &Moto, url: String) -> Reader {
        Reader {
            client: sqs_client(moto),
            s3: s3_client(moto),
            url,
            read: Mutex::new(Vec::new()),
        }
    }

    /// The queue's URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The body of `m`, and properties saying where it was when a claim
    /// check stored it (see [`claimed`](Self::claimed)).
    async fn body(
        &self,
        m: &aws_sdk_sqs::types::Message,
    ) -> Result<(Vec<u8>, Vec<(String, String)>), outbox_testkit::Error> {
        let attributes = m.message_attributes().cloned().unwrap_or_default();
        let size = SIZE_ATTRIBUTES.iter().find_map(|name| {
            let value = attributes.get(*name)?;
            assert_eq!(value.data_type(), "Number", "{name} is a Number");
            value.string_value().map(str::to_owned)
        });
        let body = m.body().unwrap_or_default();
        match size {
            Some(size) => {
                let mut claimed = Vec::new();
                let body = self.claimed(body, &size, &mut claimed).await?;
                Ok((body, claimed))
            }
            None => Ok((body.as_bytes().to_vec(), Vec::new())),
        }
    }

    /// The body a claim check stored, given the message's `body` (its
    /// pointer) and size attribute; checks the size and records where it
    /// was as properties `claim check` (`bucket/key`), `pointer class` and
    /// `object content-type`.
    async fn claimed(
        &self,
        body: &str,
        size: &str,
        properties: &mut Vec<(String, String)>,
    ) -> Result<Vec<u8>, outbox_testkit::Error> {
        let pointer: serde_json::Value =
            serde_json::from_str(body).map_err(|e| failed("reading a pointer", e))?;
        let (class, bucket, key) = (
            pointer[0].as_str().unwrap_or_default(),
            pointer[1]["s3BucketName"].as_str().unwrap_or_default(),
            pointer[1]["s3Key"].as_str().unwrap_or_default(),
        );
        let object = self
            .s3
            .get_object()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| {
                failed(
                    &format!("reading s3://{bucket}/{key}"),
                    aws_sdk_s3::error::DisplayErrorContext(e),
                )
            })?;
        let content_type = object.content_type().unwrap_or_default().to_owned();
        let bytes = object
            .body
            .collect()
            .await
            .map_err(|e| failed("reading an object", e))?
            .to_vec();
        assert_eq!(
            size,
            bytes.len().to_string(),
            "the size attribute is the stored body's size"
        );
        properties.push(("claim check".into(), format!("{bucket}/{key}")));
        properties.push(("pointer class".into(), class.to_owned()));
        properties.push(("object content-type".into(), content_type));
        Ok(bytes)
    }

    async fn in_queue(&self) -> Result<usize, outbox_testkit::Error> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| {
                failed(
                    "reading the queue's counts",
                    aws_sdk_sqs::error::DisplayErrorContext(e),
                )
            })?;
        let attributes = out.attributes().cloned().unwrap_or_default();
        let count = |name: QueueAttributeName| {
            attributes
                .get(&name)
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0)
        };
        Ok(count(QueueAttributeName::ApproximateNumberOfMessages)
            + count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
    }

    pub(crate) async fn stored(&self) -> Result<usize, outbox_testkit::Error> {
        let cached = self.read.lock().unwrap().len();
        Ok(cached + self.in_queue().await?)
    }

    pub(crate) async fn delivered(&self) -> Result<Vec<Delivered>, outbox_testkit::Error> {
        let deadline = Instant::now() + LONG;
        loop {
            let out = self
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(10)
                .visibility_timeout(300)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .map_err(|e| failed("receiving", aws_sdk_sqs::error::DisplayErrorContext(e)))?;
            let messages = out.messages();
            if messages.is_empty() {
                if self.in_queue().await? == 0 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the queue did not empty within {LONG:?}"
                );
                // In flight elsewhere (a FIFO group); poll again shortly.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let mut delete = self.client.delete_message_batch().queue_url(&self.url);
            // The stored bodies of the messages that point to S3, read
            // concurrently.
            let bodies = futures::future::join_all(messages.iter().map(|m| self.body(m))).await;
            for ((n, m), body) in messages.iter().enumerate().zip(bodies) {
                let attributes = m.message_attributes().cloned().unwrap_or_default();
                let (body, claimed) = body?;
                let mut d = Delivered::from_json(&body).map_err(|e| failed("reading a message", e))?;
                d.properties.extend(claimed);
                let text = |name: &str| {
                    attributes
                        .get(name)
                        .and_then(|v| v.string_value())
                        .map(str::to_owned)
                };
                d.dedup_id = text("id");
                let mut names: Vec<&String> = attributes.keys().collect();
                names.sort();
                d.properties.push((
                    "attributes".into(),
                    names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(","),
                ));
                for name in ["content-type", "traceparent"] {
                    if let Some(v) = text(name) {
                        d.properties.push((format!("attribute {name}"), v));
                    }
                }
                let system = m.attributes().cloned().unwrap_or_default();
                for (key, name) in [
                    (MessageSystemAttributeName::MessageGroupId, "group"),
                    (MessageSystemAttributeName::MessageDeduplicationId, "dedup"),
                ] {
                    if let Some(v) = system.get(&key) {
                        d.properties.push((name.into(), v.clone()));
                    }
                }
                self.read.lock().unwrap().push(d);
                delete = delete.entries(
                    aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                        .id(n.to_string())
                        .receipt_handle(m.receipt_handle().unwrap_or_default())
                        .build()
                        .map_err(|e| failed("deleting", e))?,
                );
            }
            delete
                .send()
                .await
                .map_err(|e| failed("deleting", aws_sdk_sqs::error::DisplayErrorContext(e)))?;
        }
        Ok(self.read.lock().unwrap().clone())
    }
}

/// What every queue-read sink checks: the attributes the sink sets.
pub(crate) fn check_attributes(sink: &str, scenario: Scenario, delivered: &[Delivered], fifo: bool) {
    for d in delivered {
        if !sink.contains("claim-check") {
            assert_eq!(d.property("claim check"), None, "{sink}: no claim check");
        }
        assert_eq!(
            d.property("attribute content-type"),
            Some("application/json"),
            "{sink}: content type"
        );
        if scenario == Scenario::KillBetweenAckAndMark {
            assert_eq!(
                d.property("attribute traceparent"),
                Some(conformance::TRACEPARENT),
                "{sink}: row headers as attributes"
            );
        }
        if fifo {
            assert_eq!(
                d.property("group"),
                Some(d.aggregate_id.as_str()),
                "{sink}: MessageGroupId"
            );
            assert_eq!(
                d.property("dedup"),
                Some(d.event_id.as_str()),
                "{sink}: MessageDeduplicationId"
            );
        }
    }
}

/// A standard SQS queue, by name (`GetQueueUrl`).
pub(crate) struct SqsSink {
    moto: Moto,
    reader: Reader,
}

/// A FIFO SQS queue, by queue URL.
pub(crate) struct SqsFifoSink {
    moto: Moto,
    reader: Reader,
}

/// A standard SNS topic, by name (`ListTopics`), subscribed to a standard
/// queue with raw message delivery; the test reads the queue.
pub(crate) struct SnsSink {
    moto: Moto,
    reader: Reader,
}

/// A FIFO SNS topic, by ARN, subscribed to a FIFO queue with raw message
/// delivery: SNS passes `MessageGroupId` and `MessageDeduplicationId` on.
pub(crate) struct SnsFifoSink {
    moto: Moto,
    reader: Reader,
}

/// Creates topic `name` subscribed to a new queue `<name>-subscriber`
/// (both FIFO when `fifo`), raw message delivery; the queue's reader.
pub(crate) async fn topic_with_queue(
    moto: &Moto,
    name: &str,
    fifo: bool,
) -> Result<Reader, outbox_testkit::Error> {
    let queue = match name.strip_suffix(".fifo") {
        Some(base) => format!("{base}-subscriber.fifo"),
        None => format!("{name}-subscriber"),
    };
    let url = create_queue(moto, &queue, fifo).await?;
    let sns = sns_client(moto);
    let mut create = sns.create_topic().name(name);
    if fifo {
        create = create.attributes("FifoTopic", "true");
    }
    let topic = create
        .send()
        .await
        .map_err(|e| failed("creating the topic", aws_sdk_sns::error::DisplayErrorContext(e)))?;
    sns.subscribe()
        .topic_arn(topic.topic_arn().unwrap_or_default())
        .protocol("sqs")
        .endpoint(format!("arn:aws:sqs:{}:{}:{queue}", moto::REGION, moto::ACCOUNT))
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .map_err(|e| {
            failed(
                "subscribing the queue",
                aws_sdk_sns::error::DisplayErrorContext(e),
            )
        })?;
    Ok(Reader::new(moto, url))
}

/// The SinkUnderTest methods every one of them shares.
macro_rules! common {
    () => {
        fn relay_env(&self) -> Vec<(String, String)> {
            self.moto.client_env()
        }

        async fn stop(&mut self) -> Result<(), outbox_testkit::Error> {
            self.moto.stop().await
        }

        async fn restart(&mut self) -> Result<(), outbox_testkit::Error> {
            self.moto.restart().await
        }

        async fn stored(&self) -> Result<usize, outbox_testkit::Error> {
            self.reader.stored().await
        }

        async fn delivered(&self) -> Result<Vec<Delivered>, outbox_testkit::Error> {
            self.reader.delivered().await
        }
    };
}
pub(crate) use common;

impl SinkUnderTest for SqsSink {
    const NAME: &'static str = "sqs";
    const ERROR_WORD: &'static str = "sqs";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let url = create_queue(&moto, QUEUE, false).await?;
        let reader = Reader::new(&moto, url);
        Ok(SqsSink { moto, reader })
    }

    fn url(&self) -> String {
        format!("sqs://{QUEUE}?endpoint={}", self.moto.endpoint())
    }

    common!();

    fn max_message_bytes(&self) -> Option<usize> {
        Some(MAX_MESSAGE)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sqs://", "no queue"),
            ("sqs://my queue", "is not allowed"),
            ("sqs://orders?colour=red", "unknown parameter \"colour\""),
            (
                "sqs://orders?endpoint=localhost:4566",
                "not an http:// or https:// URL",
            ),
            (
                "sqs://sqs.us-east-1.amazonaws.com/12345/orders",
                "12-digit AWS account id",
            ),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, false);
    }
}

impl SinkUnderTest for SqsFifoSink {
    const NAME: &'static str = "sqs-fifo";
    const ERROR_WORD: &'static str = "sqs";
    const DEDUPLICATES: bool = true;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let url = create_queue(&moto, &format!("{QUEUE}.fifo"), true).await?;
        let reader = Reader::new(&moto, url);
        Ok(SqsFifoSink { moto, reader })
    }

    fn url(&self) -> String {
        // The queue URL form, with the region in the URL too.
        format!(
            "sqs://127.0.0.1:{}/{}/{QUEUE}.fifo?region={}&endpoint={}",
            self.moto.port(),
            moto::ACCOUNT,
            moto::REGION,
            self.moto.endpoint()
        )
    }

    common!();

    fn max_message_bytes(&self) -> Option<usize> {
        Some(MAX_MESSAGE)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sqs://orders.txt", "'.' is not allowed"),
            ("sqs://h/123456789012/q?account=123456789012", "names the account"),
            ("sqs://a/b", "expected sqs://<queue-name>"),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, true);
    }
}

impl SinkUnderTest for SnsSink {
    const NAME: &'static str = "sns";
    const ERROR_WORD: &'static str = "sns";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let reader = topic_with_queue(&moto, QUEUE, false).await?;
        Ok(SnsSink { moto, reader })
    }

    fn url(&self) -> String {
        format!("sns://{QUEUE}?endpoint={}", self.moto.endpoint())
    }

    common!();

    fn max_message_bytes(&self) -> Option<usize> {
        Some(256 * 1024)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sns://", "no topic"),
            (
                "sns://arn:aws:sqs:us-east-1:123456789012:q",
                "not an SNS topic ARN",
            ),
            ("sns://arn:aws:sns:us-east-1:123456789012", "expected an ARN"),
            ("sns://orders?region=Mars", "not a region name"),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, false);
    }
}

impl SinkUnderTest for SnsFifoSink {
    const NAME: &'static str = "sns-fifo";
    const ERROR_WORD: &'static str = "sns";
    const DEDUPLICATES: bool = true;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let reader = topic_with_queue(&moto, &format!("{QUEUE}.fifo"), true).await?;
        Ok(SnsFifoSink { moto, reader })
    }

    fn url(&self) -> String {
        format!(
            "sns://arn:aws:sns:{}:{}:{QUEUE}.fifo?endpoint={}",
            moto::REGION,
            moto::ACCOUNT,
            self.moto.endpoint()
        )
    }

    common!();

    fn max_message_bytes(&self) -> Option<usize> {
        Some(256 * 1024)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            (
                "sns://arn:aws:sns:us-east-1:123456789012:t?account=123456789012",
                "the ARN names the account",
            ),
            ("sns://arn:aws:sns::123456789012:t", "no region"),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, true);
    }
}

scenario!(conformance_sqs_in_order, in_order, SqsSink);
scenario!(conformance_sqs_broker_down, broker_down, SqsSink);
scenario!(
    conformance_sqs_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SqsSink
);
scenario!(conformance_sqs_oversized, oversized, SqsSink);
scenario!(conformance_sqs_bad_urls, bad_urls, SqsSink);

scenario!(conformance_sqs_fifo_in_order, in_order, SqsFifoSink);
scenario!(conformance_sqs_fifo_broker_down, broker_down, SqsFifoSink);
scenario!(
    conformance_sqs_fifo_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SqsFifoSink
);
scenario!(conformance_sqs_fifo_oversized, oversized, SqsFifoSink);
scenario!(conformance_sqs_fifo_bad_urls, bad_urls, SqsFifoSink);

scenario!(conformance_sns_in_order, in_order, SnsSink);
scenario!(conformance_sns_broker_down, broker_down, SnsSink);
scenario!(
    conformance_sns_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SnsSink
);
scenario!(conformance_sns_oversized, oversized, SnsSink);
scenario!(conformance_sns_bad_urls, bad_urls, SnsSink);

scenario!(conformance_sns_fifo_in_order, in_order, SnsFifoSink);
scenario!(conformance_sns_fifo_broker_down, broker_down, SnsFifoSink);
scenario!(
    conformance_sns_fifo_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SnsFifoSink
);
scenario!(conformance_sns_fifo_oversized, oversized, SnsFifoSink);
scenario!(conformance_sns_fifo_bad_urls, bad_urls, SnsFifoSink);

/// Commits `events` in one transaction.
pub(crate) async fn enqueue(db: &mut Db, events: &[outbox::Event]) {
    let tx = db.client.transaction().await.expect("begin");
    outbox::Outbox::default()
        .enqueue_all(&tx, events)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
}

pub(crate) fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// A payload under the queue's limit whose message is over it once its
/// attributes are counted (nine row headers of 2 KiB): the sink itself
/// refuses it, a dead letter at once naming the limit, not sent; the
/// small event beside it is delivered.
#[tokio::test]
async fn sqs_attributes_count_toward_the_size_limit() {
    let sink = SqsSink::start().await.expect("start moto");
    let mut db = Db::start().await;
    let header = "h".repeat(2048);
    let mut big = outbox::Event::new(
        "orders",
        "big",
        "OrderPlaced",
        json!({"blob": "x".repeat(MAX_MESSAGE - 4096)}),
    );
    for i in 0..9 {
        big = big.with_header(format!("h{i}"), header.as_str());
    }
    let small = outbox::Event::new("orders", "small", "OrderPlaced", json!({"n": 1}));
    enqueue(&mut db, &[big, small]).await;
    let env = sink.relay_env();
    let relay = start_relay(&db.url, &sink.url(), &[], &env_refs(&env)).await;
    wait_until("one delivered and one dead letter", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 1
            && db
                .count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 1
    })
    .await;
    stop_relay(relay).await;
    let row = db
        .client
        .query_one(
            "SELECT last_error, attempts FROM outbox WHERE aggregate_id = 'big'",
            &[],
        )
        .await
        .expect("the big row");
    let (error, attempts): (String, i32) = (row.get(0), row.get(1));
    assert!(
        error.starts_with("permanent: sqs: message too large")
            && error.contains(&format!("limit of {MAX_MESSAGE} bytes")),
        "{error}"
    );
    assert_eq!(attempts, 1, "a dead letter at its first attempt");
    let delivered = sink.delivered().await.expect("read the queue");
    let aggregates: Vec<&str> = delivered.iter().map(|d| d.aggregate_id.as_str()).collect();
    assert_eq!(aggregates, ["small"]);
}

/// A queue that does not exist is an unavailable sink, not a failure of
/// the events: the relay says so naming the queue, claims nothing for it
/// and spends no attempt, and delivers once the queue is created.
#[tokio::test]
async fn sqs_missing_queue_spends_no_attempt() {
    let moto = Moto::start().await.expect("start moto");
    let mut db = Db::start().await;
    enqueue(
        &mut db,
        &[outbox::Event::new("orders", "1", "OrderPlaced", json!({"n": 1}))],
    )
    .await;
    let url = format!("sqs://not-yet?endpoint={}", moto.endpoint());
    let env = moto.client_env();
    let relay = start_relay(&db.url, &url, &[], &env_refs(&env)).await;
    let line = relay
        .wait_for_line("not-yet", LONG)
        .await
        .expect("the relay names the missing queue");
    assert!(
        line.contains("sink unavailable") && line.contains("does not exist"),
        "{line}"
    );
    assert_eq!(
        db.count("SELECT coalesce(sum(attempts), 0)::bigint FROM outbox WHERE published_at IS NULL")
            .await,
        0,
        "no attempt spent"
    );
    let queue = create_queue(&moto, "not-yet", false)
        .await
        .expect("create the queue");
    wait_until("published once the queue exists", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(Reader::new(&moto, queue).stored().await.expect("count"), 1);
}

/// Not a benchmark: 5,000 events (500 aggregates) through the relay into
/// moto on this machine, batches of 500, printed as events per second;
/// asserts only that all arrived.
#[tokio::test]
async fn sqs_smoke_throughput() {
    for fifo in [false, true] {
        let moto = Moto::start().await.expect("start moto");
        let name = if fifo {
            format!("{QUEUE}.fifo")
        } else {
            QUEUE.to_owned()
        };
        let queue = create_queue(&moto, &name, fifo).await.expect("create the queue");
        let mut db = Db::start().await;
        db.insert_events(5_000, 10).await;
        let url = format!("sqs://{name}?endpoint={}", moto.endpoint());
        let env = moto.client_env();
        let started = Instant::now();
        let relay = start_relay(&db.url, &url, &["--batch-size", "500"], &env_refs(&env)).await;
        db.wait_drained("5,000 published").await;
        let took = started.elapsed();
        stop_relay(relay).await;
        assert_eq!(Reader::new(&moto, queue).stored().await.expect("count"), 5_000);
        eprintln!(
            "sqs smoke ({}): 5,000 events in {:.2} s, {:.0} events/s (relay start included; moto on this machine)",
            if fifo { "fifo" } else { "standard" },
            took.as_secs_f64(),
            5_000.0 / took.as_secs_f64()
        );
    }
}
