//! The sink conformance suite (`outbox_testkit::conformance`) run against
//! every sink: one test per sink and scenario, so they run in parallel.
//! What only one broker does stays in its own file (`nats.rs`, `amqp.rs`,
//! `kafka.rs`, `relay.rs` for Redis, `webhooks.rs` and `retry.rs` for HTTP).

use std::path::Path;

use outbox_testkit::conformance::{AmqpSink, HttpSink, NatsSink, RedisSink};

#[cfg(feature = "kafka")]
use crate::kafka::KafkaSink;

/// The relay the scenarios run.
pub(crate) fn relay() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_outbox"))
}

/// `scenario!(test_name, scenario_fn, Sink)`: one test running one scenario
/// (also for the sinks whose tests live elsewhere, as SQS's and SNS's).
macro_rules! scenario {
    ($(#[$attr:meta])* $test:ident, $scenario:ident, $sink:ty) => {
        $(#[$attr])*
        #[tokio::test]
        async fn $test() {
            let _ = outbox_testkit::conformance::$scenario::<$sink>($crate::conformance::relay()).await;
        }
    };
}
pub(crate) use scenario;

scenario!(conformance_redis_in_order, in_order, RedisSink);
scenario!(conformance_redis_broker_down, broker_down, RedisSink);
scenario!(
    conformance_redis_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    RedisSink
);
// Redis has no size limit of its own: the relay's --max-event-bytes is it.
scenario!(conformance_redis_oversized, oversized, RedisSink);
scenario!(conformance_redis_bad_urls, bad_urls, RedisSink);

scenario!(conformance_http_in_order, in_order, HttpSink);
scenario!(conformance_http_broker_down, broker_down, HttpSink);
scenario!(
    conformance_http_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    HttpSink
);
scenario!(conformance_http_oversized, oversized, HttpSink);
scenario!(conformance_http_bad_urls, bad_urls, HttpSink);

scenario!(conformance_nats_in_order, in_order, NatsSink);
scenario!(conformance_nats_broker_down, broker_down, NatsSink);
scenario!(
    conformance_nats_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    NatsSink
);
scenario!(conformance_nats_oversized, oversized, NatsSink);
scenario!(conformance_nats_bad_urls, bad_urls, NatsSink);

scenario!(conformance_amqp_in_order, in_order, AmqpSink);
scenario!(conformance_amqp_broker_down, broker_down, AmqpSink);
scenario!(
    conformance_amqp_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    AmqpSink
);
scenario!(conformance_amqp_oversized, oversized, AmqpSink);
scenario!(conformance_amqp_bad_urls, bad_urls, AmqpSink);

scenario!(
    #[cfg(feature = "kafka")]
    conformance_kafka_in_order,
    in_order,
    KafkaSink
);
scenario!(
    #[cfg(feature = "kafka")]
    conformance_kafka_broker_down,
    broker_down,
    KafkaSink
);
scenario!(
    #[cfg(feature = "kafka")]
    conformance_kafka_kill_between_ack_and_mark,
    kill_between_ack_and_mark,
    KafkaSink
);
scenario!(
    #[cfg(feature = "kafka")]
    conformance_kafka_oversized,
    oversized,
    KafkaSink
);
scenario!(
    #[cfg(feature = "kafka")]
    conformance_kafka_bad_urls,
    bad_urls,
    KafkaSink
);
