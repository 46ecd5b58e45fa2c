//! The relay to RabbitMQ, what only AMQP has: an unroutable message (with
//! headers and message_id), bad templates. Volume and order, the broker
//! going away, a re-send after a kill and bad URLs are the conformance
//! suite's (`conformance_amqp_*`, each on a private node).
//!
//! These tests use the machine's broker (`scripts/test.sh` starts it), each
//! with its own exchange and an exclusive queue, named with a random suffix.

use std::collections::HashSet;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::Event;
use serde_json::json;

use crate::cli::expect_config_error;
use crate::support::{Db, LONG, StreamEvent, start_relay, stop_relay, wait_until};

/// The machine's broker, as `scripts/test.sh` ensures it.
pub(crate) const MACHINE_BROKER: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// One message as a consumer sees it.
struct Consumed {
    event: StreamEvent,
    properties: BasicProperties,
}

/// A broker connection with an exchange declared as the sink declares it
/// and a queue bound to it with `binding`.
pub(crate) struct Topology {
    _connection: Connection,
    pub(crate) channel: Channel,
    pub(crate) exchange: String,
    pub(crate) queue: String,
}

impl Topology {
    /// `durable`: a durable queue that survives a broker restart; otherwise
    /// an exclusive one that goes with this connection.
    pub(crate) async fn new(url: &str, binding: &str, durable: bool) -> Topology {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let exchange = format!("outbox-test-{suffix}");
        let queue = format!("outbox-test-{suffix}");
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connect to rabbitmq");
        let channel = connection.create_channel().await.unwrap();
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let options = QueueDeclareOptions {
            durable,
            exclusive: !durable,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), options, FieldTable::default())
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Topology {
            _connection: connection,
            channel,
            exchange,
            queue,
        }
    }

    /// Messages in the queue, by the broker's count.
    async fn depth(&self) -> u32 {
        self.channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive queue declare")
            .message_count()
    }

    /// Every message in the queue, in queue order.
    async fn read_all(&self) -> Vec<Consumed> {
        let n = self.depth().await as usize;
        let consumer = self
            .channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut consumer = consumer.take(n);
        let mut out = Vec::with_capacity(n);
        while let Some(d) = tokio::time::timeout(LONG, consumer.next())
            .await
            .expect("the consumer got every queued message")
        {
            let d = d.expect("delivery");
            let body: serde_json::Value = serde_json::from_slice(&d.data).expect("JSON body");
            out.push(Consumed {
                event: StreamEvent {
                    event_id: body["event_id"].as_str().unwrap().to_owned(),
                    aggregate_id: body["aggregate_id"].as_str().unwrap().to_owned(),
                    outbox_id: body["outbox_id"].as_i64().unwrap(),
                    outbox: None,
                },
                properties: d.properties.clone(),
            });
        }
        out
    }

    pub(crate) async fn delete_exchange(&self) {
        self.channel
            .exchange_delete(self.exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn amqp_unroutable_rows_fail_with_a_clear_error_and_headers_arrive() {
    let db = Db::start().await;
    // Only orders are bound; invoices have nowhere to go.
    let topology = Topology::new(MACHINE_BROKER, "orders.#", false).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // Interleaved in one batch, so the broker's acks (often one `multiple`
    // ack for a run of messages) cover routed and returned messages alike.
    let events: Vec<Event> = (1..=200)
        .map(|i| {
            let (aggregate_type, event_type) = if i % 2 == 0 {
                ("invoices", "InvoiceSent")
            } else {
                ("orders", "OrderPlaced")
            };
            Event::new(aggregate_type, i.to_string(), event_type, json!({"i": i}))
                .with_header("traceparent", traceparent)
        })
        .collect();
    outbox::enqueue_all(&db.client, &events).await.unwrap();

    let relay = start_relay(
        &db.url,
        MACHINE_BROKER,
        &[
            "--amqp-exchange",
            &topology.exchange,
            "--batch-size",
            "200",
            "--backoff-base",
            "1h",
            "--backoff-max",
            "2h",
        ],
        &[],
    )
    .await;
    wait_until("100 orders published, 100 invoices failed", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 100
            && db.count("SELECT count(*) FROM outbox WHERE attempts = 1").await == 100
    })
    .await;
    stop_relay(relay).await;

    let rows = db
        .client
        .query(
            "SELECT aggregate_type, last_error FROM outbox WHERE published_at IS NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 100);
    for row in rows {
        assert_eq!(row.get::<_, String>(0), "invoices");
        let error: String = row.get(1);
        assert_eq!(
            error,
            format!(
                "unroutable: no queue bound to exchange \"{}\" for routing key \
                 \"invoices.InvoiceSent\" (312 NO_ROUTE)",
                topology.exchange
            )
        );
    }

    let received = topology.read_all().await;
    assert_eq!(received.len(), 100, "only the orders were routed");
    let published: HashSet<String> = db
        .client
        .query(
            "SELECT event_id::text FROM outbox WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let queued: HashSet<String> = received.iter().map(|r| r.event.event_id.clone()).collect();
    assert_eq!(published, queued, "marked published = in the queue");
    for r in &received {
        let p = &r.properties;
        assert_eq!(
            p.message_id().as_ref().map(|m| m.as_str()),
            Some(r.event.event_id.as_str())
        );
        let headers = p.headers().as_ref().expect("headers");
        let value = headers.inner().get("traceparent").expect("traceparent header");
        let AMQPValue::LongString(value) = value else {
            panic!("traceparent is {value:?}");
        };
        assert_eq!(value.to_string(), traceparent);
    }
    topology.delete_exchange().await;
}

#[tokio::test]
async fn amqp_bad_templates_exit_2() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    // Bad URLs: `conformance_amqp_bad_urls`.
    expect_config_error(
        &[
            "relay",
            "--sink",
            MACHINE_BROKER,
            "--amqp-routing-key",
            "{aggregate}.x",
        ],
        &env,
        "--amqp-routing-key",
    )
    .await;
    expect_config_error(
        &[
            "relay",
            "--sink",
            MACHINE_BROKER,
            "--amqp-exchange",
            "outbox.{event_type",
        ],
        &env,
        "--amqp-exchange",
    )
    .await;
}
