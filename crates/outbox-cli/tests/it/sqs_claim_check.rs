//! The SQS and SNS sinks' claim check (`?claim-check=s3://bucket/prefix`)
//! against moto's S3, SQS and SNS: the conformance suite with every message
//! stored in S3 (a standard queue with today's extended-client names; a
//! FIFO topic with the 1.x Java client's, killed between ack and mark),
//! all but `in_order` (see below); a payload over the queue's or
//! topic's limit arriving whole, read by AWS's own Python extended client;
//! and a missing bucket, which holds back only the events it would store
//! and spends no attempt.

use std::process::Stdio;

use outbox_testkit::conformance::{self, Delivered, LONG, Scenario, SinkUnderTest};
use outbox_testkit::{Moto, moto};
use serde_json::{Value, json};

use crate::conformance::scenario;
use crate::metrics::{http_addr, ready};
use crate::sqs::{
    MAX_MESSAGE, QUEUE, Reader, check_attributes, common, create_queue, enqueue, env_refs, failed, s3_client,
    topic_with_queue,
};
use crate::support::{Db, run_cli, start_relay, stop_relay, text, wait_until};

/// The bucket the claim checks store in.
const BUCKET: &str = "outbox-payloads";
/// The relay's `--max-event-bytes` in the oversized scenario: with a claim
/// check the sink sets no limit of its own, so the relay's is the limit.
const RELAY_LIMIT: usize = 512 * 1024;

async fn create_bucket(moto: &Moto, name: &str) -> Result<(), outbox_testkit::Error> {
    s3_client(moto)
        .create_bucket()
        .bucket(name)
        .send()
        .await
        .map_err(|e| {
            failed(
                &format!("creating bucket {name}"),
                aws_sdk_s3::error::DisplayErrorContext(e),
            )
        })?;
    Ok(())
}

/// The keys of the objects under `prefix`.
async fn objects(moto: &Moto, prefix: &str) -> Vec<String> {
    let out = s3_client(moto)
        .list_objects_v2()
        .bucket(BUCKET)
        .prefix(prefix)
        .send()
        .await
        .map_err(|e| aws_sdk_s3::error::DisplayErrorContext(e).to_string())
        .expect("list the bucket");
    out.contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_owned))
        .collect()
}

/// What every claim-check sink checks besides the attributes: every
/// message was stored under `prefix/<event_id>/`, with the pointer class
/// of `legacy` or today's, and the body's content type.
fn check_claimed(sink: &str, delivered: &[Delivered], prefix: &str, legacy: bool) {
    let class = if legacy {
        "com.amazon.sqs.javamessaging.MessageS3Pointer"
    } else {
        "software.amazon.payloadoffloading.PayloadS3Pointer"
    };
    for d in delivered {
        let at = d
            .property("claim check")
            .unwrap_or_else(|| panic!("{sink}: {} was not stored", d.event_id));
        assert!(
            at.starts_with(&format!("{BUCKET}/{prefix}/{}/", d.event_id)),
            "{sink}: {at}"
        );
        assert_eq!(d.property("pointer class"), Some(class), "{sink}");
        assert_eq!(
            d.property("object content-type"),
            Some("application/json"),
            "{sink}"
        );
    }
}

/// With a claim check the sink sets no size limit: the relay's
/// `--max-event-bytes` is the limit.
macro_rules! relay_limit {
    () => {
        fn max_message_bytes(&self) -> Option<usize> {
            Some(RELAY_LIMIT)
        }

        fn oversize_flags(&self) -> Vec<String> {
            vec!["--max-event-bytes".into(), RELAY_LIMIT.to_string()]
        }
    };
}

/// A standard SQS queue whose every message goes through S3
/// (`claim-check-over=0`), with today's extended-client names.
pub(crate) struct SqsClaimCheckSink {
    moto: Moto,
    reader: Reader,
}

/// A FIFO SNS topic (subscribed to a FIFO queue, raw delivery) whose every
/// message goes through S3, with the 1.x Java client's names.
pub(crate) struct SnsFifoClaimCheckSink {
    moto: Moto,
    reader: Reader,
}

impl SinkUnderTest for SqsClaimCheckSink {
    const NAME: &'static str = "sqs-claim-check";
    const ERROR_WORD: &'static str = "sqs";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let url = create_queue(&moto, QUEUE, false).await?;
        create_bucket(&moto, BUCKET).await?;
        let reader = Reader::new(&moto, url);
        Ok(SqsClaimCheckSink { moto, reader })
    }

    fn url(&self) -> String {
        format!(
            "sqs://{QUEUE}?endpoint={}&claim-check=s3://{BUCKET}/orders&claim-check-over=0",
            self.moto.endpoint()
        )
    }

    common!();

    relay_limit!();

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sqs://orders?claim-check=payloads", "not an s3://"),
            ("sqs://orders?claim-check=s3://Payloads", "only a-z"),
            ("sqs://orders?claim-check=s3://ab", "3 to 63"),
            (
                "sqs://orders?claim-check=s3://payloads&claim-check-over=lots",
                "not a number of bytes",
            ),
            (
                "sqs://orders?claim-check=s3://payloads&claim-check-legacy=yes",
                "neither true nor false",
            ),
            ("sqs://orders?claim-check-over=0", "need ?claim-check="),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, false);
        check_claimed(Self::NAME, delivered, "orders", false);
    }
}

impl SinkUnderTest for SnsFifoClaimCheckSink {
    const NAME: &'static str = "sns-fifo-claim-check";
    const ERROR_WORD: &'static str = "sns";
    const DEDUPLICATES: bool = true;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, outbox_testkit::Error> {
        let moto = Moto::start().await?;
        let reader = topic_with_queue(&moto, &format!("{QUEUE}.fifo"), true).await?;
        create_bucket(&moto, BUCKET).await?;
        Ok(SnsFifoClaimCheckSink { moto, reader })
    }

    fn url(&self) -> String {
        format!(
            "sns://arn:aws:sns:{}:{}:{QUEUE}.fifo?endpoint={}&claim-check=s3://{BUCKET}/topic/&claim-check-over=0\
             &claim-check-legacy=true",
            moto::REGION,
            moto::ACCOUNT,
            self.moto.endpoint()
        )
    }

    common!();

    relay_limit!();

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sns://t?claim-check=s3://payloads/a//b", "empty segments"),
            ("sns://t?claim-check-path-style=true", "need ?claim-check="),
        ]
    }

    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        check_attributes(Self::NAME, scenario, delivered, true);
        check_claimed(Self::NAME, delivered, "topic", true);
    }
}

// Not `in_order`: its 5,000 objects take moto's S3 (7 ms a `PutObject`,
// one request at a time) over a minute, near the scenario's 90 s wait on a
// loaded machine; `order_is_kept_through_s3` below is its smaller twin.
scenario!(
    conformance_sqs_claim_check_broker_down,
    broker_down,
    SqsClaimCheckSink
);
scenario!(
    conformance_sqs_claim_check_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SqsClaimCheckSink
);
scenario!(
    conformance_sqs_claim_check_oversized,
    oversized,
    SqsClaimCheckSink
);
scenario!(conformance_sqs_claim_check_bad_urls, bad_urls, SqsClaimCheckSink);

scenario!(
    conformance_sns_fifo_claim_check_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    SnsFifoClaimCheckSink
);
scenario!(
    conformance_sns_fifo_claim_check_bad_urls,
    bad_urls,
    SnsFifoClaimCheckSink
);

/// Reads a queue with AWS's Python extended client (`sqs_extended_client`,
/// installed beside moto), as a consumer of the extended clients would:
/// one JSON line per message, its body (the client fetched it from S3
/// where the message pointed there) and its attribute names.
const EXTENDED_READER: &str = r#"
import json, sys
from sqs_extended_client import SQSExtendedClientSession
sqs = SQSExtendedClientSession().client("sqs")
sqs.large_payload_support = sys.argv[2]
while True:
    answer = sqs.receive_message(QueueUrl=sys.argv[1], MaxNumberOfMessages=10, MessageAttributeNames=["All"])
    messages = answer.get("Messages", [])
    if not messages:
        break
    for m in messages:
        print(json.dumps({"body": m["Body"], "attributes": sorted(m.get("MessageAttributes", {}))}), flush=True)
        sqs.delete_message(QueueUrl=sys.argv[1], ReceiptHandle=m["ReceiptHandle"])
"#;

/// Every message in queue `url`, as [`EXTENDED_READER`] reads it.
async fn read_with_extended_client(moto: &Moto, url: &str) -> Vec<Value> {
    let mut cmd = tokio::process::Command::new(moto.python());
    cmd.arg("-c")
        .arg(EXTENDED_READER)
        .args([url, BUCKET])
        .envs(moto.client_env())
        .env("AWS_ENDPOINT_URL", moto.endpoint())
        .stdin(Stdio::null());
    let out = cmd.output().await.expect("run the extended client");
    assert!(
        out.status.success(),
        "the extended client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

/// An event over the queue's (or topic's) 256 KiB goes to S3 and arrives
/// whole, and the small one beside it inline; AWS's Python extended client
/// reads both unchanged: from an SQS queue with today's names, and from a
/// queue subscribed to an SNS topic with the 1.x Java client's. Only the
/// big one is stored, under `<prefix>/<event_id>/`.
#[tokio::test]
async fn a_payload_over_the_limit_arrives_whole_through_s3_for_the_extended_client() {
    let moto = Moto::start().await.expect("start moto");
    create_bucket(&moto, BUCKET).await.expect("create the bucket");
    let queue = create_queue(&moto, QUEUE, false).await.expect("create the queue");
    let topic = "outbox-events";
    let subscriber = topic_with_queue(&moto, topic, false)
        .await
        .expect("create the topic");
    let env = moto.client_env();
    let mut db = Db::start().await;
    for (sink, prefix, read_from) in [
        (
            format!("sqs://{QUEUE}?claim-check=s3://{BUCKET}/sqs"),
            "sqs",
            queue.clone(),
        ),
        (
            format!("sns://{topic}?claim-check=s3://{BUCKET}/sns&claim-check-legacy=true"),
            "sns",
            subscriber.url().to_owned(),
        ),
    ] {
        let sink = format!("{sink}&endpoint={}", moto.endpoint());
        let blob = "x".repeat(MAX_MESSAGE + 40 * 1024);
        let mut big = outbox::Event::new("orders", "big", "OrderPlaced", json!({"blob": blob})).with_header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        // More headers than attributes: nine of the message's own, the
        // tenth the size attribute.
        for i in 0..10 {
            big = big.with_header(format!("h{i}"), "v");
        }
        let small = outbox::Event::new("orders", "small", "OrderPlaced", json!({"n": 1}));
        let (big_id, small_id) = (big.event_id.to_string(), small.event_id.to_string());
        enqueue(&mut db, &[big, small]).await;
        let relay = start_relay(&db.url, &sink, &[], &env_refs(&env)).await;
        db.wait_drained("both published").await;
        stop_relay(relay).await;

        let stored = objects(&moto, &format!("{prefix}/")).await;
        assert_eq!(
            stored.len(),
            1,
            "{prefix}: only the big one is stored: {stored:?}"
        );
        assert!(
            stored[0].starts_with(&format!("{prefix}/{big_id}/")),
            "{stored:?}"
        );

        let mut read = read_with_extended_client(&moto, &read_from).await;
        assert_eq!(read.len(), 2, "{prefix}: {read:?}");
        read.sort_by_key(|m| m["body"].as_str().map(str::len));
        let bodies: Vec<Value> = read
            .iter()
            .map(|m| serde_json::from_str(m["body"].as_str().unwrap_or_default()).expect("a native document"))
            .collect();
        assert_eq!(bodies[0]["event_id"], small_id.as_str());
        assert_eq!(bodies[0]["payload"], json!({"n": 1}));
        assert_eq!(bodies[1]["event_id"], big_id.as_str());
        assert_eq!(
            bodies[1]["payload"]["blob"].as_str().map(str::len),
            Some(MAX_MESSAGE + 40 * 1024),
            "{prefix}: the payload arrived whole"
        );
        // The client took its size attribute away; the sink's own nine
        // stay, the headers that did not fit in `headers`.
        let names: Vec<&str> = read[1]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(names.len(), 9, "{prefix}: {names:?}");
        for name in ["content-type", "id", "headers"] {
            assert!(names.contains(&name), "{prefix}: {names:?}");
        }
        assert_eq!(read[0]["attributes"], json!(["content-type", "id"]), "{prefix}");
    }
}

/// A bucket that does not exist is the sink's failure, not the event's:
/// the event it would store waits unsent with no attempt spent, naming the
/// bucket; another aggregate's small event is delivered meanwhile; one
/// whose attributes alone pass the limit is a dead letter at once, nothing
/// stored; and once the bucket exists, the big one arrives whole.
///
/// The big one alone in its batches opens the sink's breaker, and the
/// sink's probe then asks the bucket too: a probe asking only the queue
/// would pass, and three failed batches after passing probes would count
/// as the event's attempts. `relay --check` finds the bucket missing, and
/// then there.
#[tokio::test]
async fn a_missing_bucket_holds_back_only_what_it_would_store() {
    let moto = Moto::start().await.expect("start moto");
    let queue = create_queue(&moto, QUEUE, false).await.expect("create the queue");
    let mut db = Db::start().await;
    let big = outbox::Event::new(
        "orders",
        "big",
        "OrderPlaced",
        json!({"blob": "x".repeat(MAX_MESSAGE)}),
    );
    let mut headed = outbox::Event::new("orders", "headed", "OrderPlaced", json!({"n": 2}));
    for i in 0..9 {
        headed = headed.with_header(format!("h{i}"), "h".repeat(MAX_MESSAGE / 8).as_str());
    }
    let small = outbox::Event::new("orders", "small", "OrderPlaced", json!({"n": 1}));
    enqueue(&mut db, &[big, headed, small]).await;
    let sink = format!(
        "sqs://{QUEUE}?endpoint={}&claim-check=s3://{BUCKET}/orders",
        moto.endpoint()
    );
    let env = moto.client_env();
    let check = run_cli(
        &["relay", "--sink", &sink, "--check"],
        &[&env_refs(&env)[..], &[("DATABASE_URL", &db.url)]].concat(),
    )
    .await;
    let said = text(&check.stdout);
    assert_eq!(check.status.code(), Some(1), "{said}{}", text(&check.stderr));
    assert!(
        said.contains(&format!("s3://{BUCKET}/orders/outbox-probe")) && said.contains("NoSuchBucket"),
        "{said}"
    );
    let addr = http_addr();
    let relay = start_relay(&db.url, &sink, &["--http", &addr], &env_refs(&env)).await;
    wait_until("small published, headed dead, big waiting on the bucket", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 1
            && db
                .count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 1
            && db
                .count(
                    "SELECT count(*) FROM outbox WHERE aggregate_id = 'big' AND last_error LIKE '%NoSuchBucket%'",
                )
                .await
                == 1
    })
    .await;
    let row = db
        .client
        .query_one(
            "SELECT attempts, last_error FROM outbox WHERE aggregate_id = 'big'",
            &[],
        )
        .await
        .expect("the big row");
    let (attempts, error): (i32, String) = (row.get(0), row.get(1));
    assert_eq!(attempts, 0, "no attempt spent: {error}");
    assert!(
        error.contains("sink unavailable") && error.contains(&format!("s3://{BUCKET}/orders/")),
        "{error}"
    );
    wait_until("the breaker's probe asking the bucket", LONG, || async {
        let (_, body) = ready(&addr).await;
        body["checks"]["sink sqs"]
            .as_str()
            .is_some_and(|c| c.contains("outbox-probe") && c.contains("NoSuchBucket"))
    })
    .await;
    let (attempts, error): (i32, String) = {
        let row = db
            .client
            .query_one(
                "SELECT attempts, last_error FROM outbox WHERE aggregate_id = 'headed'",
                &[],
            )
            .await
            .expect("the headed row");
        (row.get(0), row.get(1))
    };
    assert_eq!(attempts, 1, "a dead letter at its first attempt");
    assert!(
        error.starts_with("permanent: sqs: message too large even with its body in S3"),
        "{error}"
    );

    create_bucket(&moto, BUCKET).await.expect("create the bucket");
    wait_until("big published once the bucket exists", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(
        db.count("SELECT attempts::bigint FROM outbox WHERE aggregate_id = 'big'")
            .await,
        0,
        "the bucket's absence spent no attempt"
    );
    let mut stored = objects(&moto, "orders/").await;
    assert!(stored.contains(&"orders/outbox-probe".to_owned()), "{stored:?}");
    stored.retain(|key| key != "orders/outbox-probe");
    assert_eq!(stored.len(), 1, "only big was stored: {stored:?}");
    let check = run_cli(
        &["relay", "--sink", &sink, "--check"],
        &[&env_refs(&env)[..], &[("DATABASE_URL", &db.url)]].concat(),
    )
    .await;
    assert_eq!(check.status.code(), Some(0), "{}", text(&check.stdout));
    let delivered = Reader::new(&moto, queue)
        .delivered()
        .await
        .expect("read the queue");
    let mut aggregates: Vec<(&str, bool)> = delivered
        .iter()
        .map(|d| (d.aggregate_id.as_str(), d.property("claim check").is_some()))
        .collect();
    aggregates.sort_unstable();
    assert_eq!(aggregates, [("big", true), ("small", false)]);
}

/// `in_order` through S3, smaller: 600 events of 60 aggregates in batches
/// of 100, every message stored (`claim-check-over=0`), arrive once each,
/// each aggregate's in order, each stored under its event id.
#[tokio::test]
async fn order_is_kept_through_s3() {
    let sink = SqsClaimCheckSink::start().await.expect("start moto");
    let mut db = Db::start().await;
    db.insert_events(600, 10).await;
    let env = sink.relay_env();
    let relay = start_relay(&db.url, &sink.url(), &["--batch-size", "100"], &env_refs(&env)).await;
    db.wait_drained("600 published").await;
    stop_relay(relay).await;
    let delivered = sink.delivered().await.expect("read the queue");
    assert_eq!(delivered.len(), 600, "no duplicates without a crash");
    assert_eq!(conformance::distinct(&delivered), 600, "every event");
    assert_eq!(
        conformance::order_violations(&delivered),
        0,
        "per-aggregate order"
    );
    check_claimed(SqsClaimCheckSink::NAME, &delivered, "orders", false);
}
