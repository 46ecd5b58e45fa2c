//! `--format`: golden tests through the real brokers. One fixed event (fixed
//! event_id, created_at, payload and traceparent) is relayed with each
//! format, and the exact body and headers a consumer reads back are
//! compared with literals: Redis stream fields, the HTTP request, the NATS
//! message from the stream, the AMQP message from a bound queue, the Kafka
//! record (key, value, headers) read back by a consumer.

use lapin::options::BasicGetOptions;
use lapin::types::AMQPValue;
use outbox::Event;
use outbox_testkit::{Nats, Receiver, Redis, Respond};
use serde_json::json;
use uuid::Uuid;

use crate::amqp::{MACHINE_BROKER, Topology};
use crate::nats::{STREAM, create_stream, jetstream};
use crate::support::{Db, run_cli, text};

const ID: &str = "0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const PAYLOAD: &str = r#"{"order_id":42,"total":"9.90"}"#;
const HEADERS_JSON: &str = r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#;
const STRUCTURED: &str = concat!(
    r#"{"data":{"order_id":42,"total":"9.90"},"datacontenttype":"application/json","#,
    r#""id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","source":"/outbox/public.outbox","#,
    r#""specversion":"1.0","subject":"42","time":"2026-01-02T03:04:05.123456Z","#,
    r#""traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","type":"OrderPlaced"}"#
);
const NATIVE_BROKER_BODY: &str = concat!(
    r#"{"aggregate_id":"42","aggregate_type":"orders","created_at":"2026-01-02T03:04:05.123456Z","#,
    r#""event_id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","event_type":"OrderPlaced","#,
    r#""outbox_id":1,"payload":{"order_id":42,"total":"9.90"}}"#
);
const NATIVE_HTTP_BODY: &str = concat!(
    r#"{"aggregate_id":"42","aggregate_type":"orders","created_at":"2026-01-02T03:04:05.123456Z","#,
    r#""event_id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","event_type":"OrderPlaced","#,
    r#""headers":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},"#,
    r#""outbox_id":1,"payload":{"order_id":42,"total":"9.90"}}"#
);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Native,
    Structured,
    Binary,
    Debezium,
}

const VARIANTS: [Variant; 4] = [
    Variant::Native,
    Variant::Structured,
    Variant::Binary,
    Variant::Debezium,
];

impl Variant {
    fn args(self) -> &'static [&'static str] {
        match self {
            Variant::Native => &[],
            Variant::Structured => &["--format", "cloudevents"],
            Variant::Binary => &["--format", "cloudevents", "--cloudevents-mode", "binary"],
            Variant::Debezium => &["--format", "debezium"],
        }
    }

    /// The headers the format adds, with `prefix` on CloudEvents attributes.
    fn headers(self, prefix: &str) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = match self {
            Variant::Native | Variant::Structured => vec![],
            Variant::Binary => [
                ("specversion", "1.0"),
                ("id", ID),
                ("source", "/outbox/public.outbox"),
                ("type", "OrderPlaced"),
                ("subject", "42"),
                ("time", "2026-01-02T03:04:05.123456Z"),
                ("datacontenttype", "application/json"),
                ("traceparent", TRACEPARENT),
            ]
            .iter()
            .map(|(k, v)| (format!("{prefix}{k}"), (*v).to_owned()))
            .collect(),
            Variant::Debezium => vec![("id".into(), ID.into()), ("key".into(), "42".into())],
        };
        h.push(("traceparent".into(), TRACEPARENT.into()));
        h
    }

    fn content_type(self) -> &'static str {
        if self == Variant::Structured {
            "application/cloudevents+json"
        } else {
            "application/json"
        }
    }

    fn broker_body(self) -> &'static str {
        match self {
            Variant::Native => NATIVE_BROKER_BODY,
            Variant::Structured => STRUCTURED,
            Variant::Binary | Variant::Debezium => PAYLOAD,
        }
    }
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn sorted(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
    v.sort();
    v
}

/// A fresh database holding only the golden event, as outbox id 1.
async fn golden_db() -> Db {
    let db = Db::start().await;
    let event = Event::new(
        "orders",
        "42",
        "OrderPlaced",
        json!({"order_id": 42, "total": "9.90"}),
    )
    .with_event_id(Uuid::parse_str(ID).unwrap())
    .with_header("traceparent", TRACEPARENT);
    outbox::enqueue_all(&db.client, &[event]).await.unwrap();
    db.client
        .execute(
            "UPDATE outbox SET created_at = '2026-01-02T03:04:05.123456Z'",
            &[],
        )
        .await
        .unwrap();
    db
}

/// `outbox relay --drain` with the variant's flags; asserts it exits 0 and
/// marked the one row.
async fn drain(db: &Db, sink: &str, variant: Variant, extra: &[&str]) {
    let mut args = vec!["relay", "--drain", "--sink", sink];
    args.extend_from_slice(variant.args());
    args.extend_from_slice(extra);
    let out = run_cli(&args, &[("DATABASE_URL", &db.url)]).await;
    assert_eq!(out.status.code(), Some(0), "{variant:?}: {}", text(&out.stderr));
    assert_eq!(db.unpublished().await, 0, "{variant:?}: the row is marked");
}

#[tokio::test]
async fn formats_golden_redis() {
    let redis = Redis::start().await.unwrap();
    for variant in VARIANTS {
        let db = golden_db().await;
        let stream = format!("fmt{variant:?}");
        drain(&db, &redis.url(), variant, &["--stream-prefix", &stream]).await;

        let client = redis::Client::open(redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(format!("{stream}.orders"))
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(entries.len(), 1, "{variant:?}: one entry");
        let fields: Vec<(String, String)> = entries[0]
            .1
            .chunks(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect();
        let mut want = match variant {
            Variant::Native => pairs(&[
                ("event_id", ID),
                ("aggregate_id", "42"),
                ("event_type", "OrderPlaced"),
                ("payload", PAYLOAD),
                ("outbox_id", "1"),
            ]),
            Variant::Structured => pairs(&[("cloudevent", STRUCTURED)]),
            Variant::Binary => {
                let mut f: Vec<_> = variant
                    .headers("ce_")
                    .into_iter()
                    .filter(|(k, _)| k != "traceparent")
                    .collect();
                f.push(("data".into(), PAYLOAD.into()));
                f
            }
            Variant::Debezium => pairs(&[("id", ID), ("key", "42"), ("value", PAYLOAD)]),
        };
        want.push(("headers".into(), HEADERS_JSON.into()));
        assert_eq!(fields, want, "{variant:?}");
    }
}

#[tokio::test]
async fn formats_golden_http() {
    // Transport headers reqwest adds on its own; everything else is compared.
    const TRANSPORT: [&str; 4] = ["host", "content-length", "user-agent", "accept"];
    for variant in VARIANTS {
        let receiver = Receiver::start(Respond::Ok).await.unwrap();
        let db = golden_db().await;
        drain(&db, &receiver.url(), variant, &[]).await;

        let received = receiver.received();
        assert_eq!(received.len(), 1, "{variant:?}: one request");
        let r = &received[0];
        let body = String::from_utf8(r.raw.clone()).unwrap();
        let want_body = match variant {
            Variant::Native => NATIVE_HTTP_BODY,
            other => other.broker_body(),
        };
        assert_eq!(body, want_body, "{variant:?}");
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .filter(|(k, _)| !TRANSPORT.contains(&k.as_str()))
            .cloned()
            .collect();
        let mut want = if variant == Variant::Native {
            vec![]
        } else {
            variant.headers("ce-")
        };
        want.push(("content-type".into(), variant.content_type().into()));
        want.push(("idempotency-key".into(), ID.into()));
        assert_eq!(sorted(headers), sorted(want), "{variant:?}");
    }
}

#[tokio::test]
async fn formats_golden_nats() {
    let nats = Nats::start().await.unwrap();
    for variant in VARIANTS {
        let js = jetstream(&nats).await;
        // A fresh stream per format, so each holds exactly one message.
        let _ = js.delete_stream(STREAM).await;
        let stream = create_stream(&nats).await;
        let db = golden_db().await;
        drain(&db, &nats.url(), variant, &[]).await;

        let mut stream = stream;
        assert_eq!(stream.info().await.unwrap().state.messages, 1, "{variant:?}");
        let m = stream.get_raw_message(1).await.expect("message 1");
        assert_eq!(m.subject.as_str(), "outbox.event.orders");
        assert_eq!(
            String::from_utf8(m.payload.to_vec()).unwrap(),
            variant.broker_body(),
            "{variant:?}"
        );
        let headers: Vec<(String, String)> = m
            .headers
            .iter()
            .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
            .collect();
        let mut want = variant.headers("ce-");
        want.push(("Nats-Msg-Id".into(), ID.into()));
        if variant != Variant::Native {
            want.push(("content-type".into(), variant.content_type().into()));
        }
        assert_eq!(sorted(headers), sorted(want), "{variant:?}");
    }
}

#[tokio::test]
async fn formats_golden_amqp() {
    for variant in VARIANTS {
        let topology = Topology::new(MACHINE_BROKER, "#", false).await;
        let db = golden_db().await;
        drain(
            &db,
            MACHINE_BROKER,
            variant,
            &["--amqp-exchange", &topology.exchange],
        )
        .await;

        let got = topology
            .channel
            .basic_get(topology.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("one message in the queue");
        assert_eq!(got.message_count, 0, "{variant:?}: exactly one message");
        let d = &got.delivery;
        assert_eq!(d.routing_key.as_str(), "orders.OrderPlaced");
        assert_eq!(
            String::from_utf8(d.data.clone()).unwrap(),
            variant.broker_body(),
            "{variant:?}"
        );
        let p = &d.properties;
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), ID);
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            variant.content_type(),
            "{variant:?}"
        );
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "OrderPlaced");
        assert_eq!(p.delivery_mode(), &Some(2));
        let headers: Vec<(String, String)> = p
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .iter()
            .map(|(k, v)| match v {
                AMQPValue::LongString(s) => {
                    (k.to_string(), String::from_utf8(s.as_bytes().to_vec()).unwrap())
                }
                other => panic!("{k}: not a long string: {other:?}"),
            })
            .collect();
        assert_eq!(
            sorted(headers),
            sorted(variant.headers("cloudEvents_")),
            "{variant:?}"
        );
        topology.delete_exchange().await;
    }
}

#[cfg(feature = "kafka")]
#[tokio::test]
async fn formats_golden_kafka() {
    let kafka = outbox_testkit::Kafka::start().await.unwrap();
    for variant in VARIANTS {
        // A topic per format, so each holds exactly one record.
        let topic = format!("fmt.{variant:?}");
        kafka.create_topic(&topic, 1).await.unwrap();
        let db = golden_db().await;
        drain(&db, &kafka.url(), variant, &["--kafka-topic", &topic]).await;

        let (stored, records) = crate::kafka::read_topic(&kafka, &topic, 1).await;
        assert_eq!((stored, records.len()), (1, 1), "{variant:?}: one record");
        let r = &records[0];
        assert_eq!(r.key, "42", "{variant:?}: the key is the aggregate id");
        assert_eq!(
            String::from_utf8(r.value.clone()).unwrap(),
            variant.broker_body(),
            "{variant:?}"
        );
        // The record key is Debezium's key: no `key` header beside it.
        let mut want: Vec<(String, String)> = variant
            .headers("ce_")
            .into_iter()
            .filter(|(k, _)| !(variant == Variant::Debezium && (k == "key" || k == "id")))
            .collect();
        want.push(("id".into(), ID.into()));
        if variant != Variant::Native {
            want.push(("content-type".into(), variant.content_type().into()));
        }
        assert_eq!(sorted(r.headers.clone()), sorted(want), "{variant:?}");
    }
}
