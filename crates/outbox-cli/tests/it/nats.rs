//! The relay to NATS JetStream, what only NATS has: a missing stream, bad
//! subject templates. Volume and order, the server going away, a re-send
//! dropped by `Nats-Msg-Id`, headers, an oversized message and bad URLs are
//! the conformance suite's (`conformance_nats_*`).

use std::time::Duration;

use async_nats::jetstream::{self, stream::Stream};
use outbox::Event;
use outbox_testkit::Nats;
use serde_json::json;

use crate::cli::expect_config_error;
use crate::support::{Db, LONG, start_relay, stop_relay, wait_until};

pub(crate) const STREAM: &str = "OUTBOX";

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

/// No stream captures the subject ("no responders"): the stream is the
/// operator's to create, so the sink counts as unavailable: no attempt is
/// spent while it is missing, and the row goes out once it exists.
#[tokio::test]
async fn nats_without_a_stream_waits_without_spending_attempts_until_one_is_created() {
    let db = Db::start().await;
    let nats = Nats::start().await.unwrap();
    outbox::enqueue(&db.client, &Event::new("orders", "1", "OrderPlaced", json!({})))
        .await
        .unwrap();
    let relay = start_relay(&db.url, &nats.url(), &[], &[]).await;
    wait_until("the sink found unavailable", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE last_error LIKE 'sink unavailable: %'")
            .await
            == 1
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
    assert_eq!(
        db.count("SELECT attempts::int8 FROM outbox").await,
        0,
        "no attempt spent"
    );

    create_stream(&nats).await;
    wait_until(
        "published once the stream exists",
        Duration::from_secs(30),
        || async { db.unpublished().await == 0 },
    )
    .await;
    stop_relay(relay).await;
    assert_eq!(stored(&nats).await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0
    );
}

#[tokio::test]
async fn nats_bad_subjects_exit_2() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    // Bad URLs: `conformance_nats_bad_urls`.
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
