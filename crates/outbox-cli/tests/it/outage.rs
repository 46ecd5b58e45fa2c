//! A sink that is unavailable is not an event failure: wrong credentials
//! spend no attempt and say why, a drain that meets them exits 1, and an
//! event over `--max-event-bytes` is a dead letter that never reaches the
//! sink while its neighbours are delivered. (Each broker stopped and
//! restarted: the conformance suite's `broker_down`.)

use outbox::Event;
use outbox_testkit::{Nats, Receiver, Redis, Respond};
use serde_json::json;

use crate::support::{Db, LONG, read_stream, run_cli, start_relay, stop_relay, text, wait_until};

/// The relay with a sink whose credentials are refused: as a service it
/// starts, reports the sink unavailable with the broker's words and claims
/// nothing; as a drain it exits 1 naming the cause. No row spends an
/// attempt either way.
async fn refused_credentials(db: &mut Db, sink: &str, cause: &str) {
    db.insert_events(3, 1).await;
    let relay = start_relay(&db.url, sink, &[], &[]).await;
    let name = sink.split(':').next().unwrap();
    relay
        .wait_for_notification(&format!("STATUS=sink {name} unavailable"), LONG)
        .await
        .expect("the breaker opened");
    let said = relay.lines().join("\n");
    assert!(said.contains(cause), "the log names {cause:?}: {said}");
    stop_relay(relay).await;

    let env = [("DATABASE_URL", db.url.as_str())];
    let drain = run_cli(&["relay", "--sink", sink, "--drain"], &env).await;
    let stderr = text(&drain.stderr);
    assert_eq!(drain.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the sink is unavailable"), "{stderr}");
    assert!(stderr.contains(cause), "{stderr}");

    assert_eq!(db.unpublished().await, 3, "nothing delivered");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0 OR dead_at IS NOT NULL")
            .await,
        0,
        "no attempt spent, no dead letter"
    );
}

#[tokio::test]
async fn wrong_amqp_password_spends_no_attempt_and_says_why() {
    let mut db = Db::start().await;
    // The machine's broker (guest/guest); see scripts/deps.sh.
    refused_credentials(&mut db, "amqp://guest:wrong@127.0.0.1:5672/%2f", "ACCESS_REFUSED").await;
}

#[tokio::test]
async fn wrong_nats_password_spends_no_attempt_and_says_why() {
    let mut db = Db::start().await;
    let nats = Nats::start_with_user("outbox", "right").await.unwrap();
    let sink = format!("nats://outbox:wrong@127.0.0.1:{}", nats.port());
    refused_credentials(&mut db, &sink, "authorization violation").await;
}

#[tokio::test]
async fn an_event_over_max_event_bytes_is_a_dead_letter_and_its_neighbours_are_delivered() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let events = [
        Event::new("orders", "1", "OrderPlaced", json!({"n": 1})),
        // 2 MiB of payload, over the default 1 MiB.
        Event::new("orders", "2", "OrderPlaced", json!({"blob": "x".repeat(2 << 20)})),
        Event::new("orders", "3", "OrderPlaced", json!({"n": 3})),
    ];
    outbox::enqueue_all(&db.client, &events).await.unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let drain = run_cli(&["relay", "--sink", &redis.url(), "--drain"], &env).await;
    let stderr = text(&drain.stderr);
    assert_eq!(drain.status.code(), Some(1), "a dead letter made: {stderr}");
    assert!(stderr.contains("the drain made 1 dead letter(s)"), "{stderr}");

    let stream = read_stream(&redis.url(), "outbox.event.orders").await;
    let ids: Vec<&str> = stream.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(
        ids,
        ["1", "3"],
        "the neighbours delivered, the big one never sent"
    );
    let (attempts, error, dead) = dead_letter_of(&db, "2").await;
    assert_eq!((attempts, dead), (1, true));
    assert!(
        error.starts_with(
            "permanent: redis: event too large: its payload is 2097163 bytes, over the limit of 1048576"
        ),
        "{error}"
    );
}

/// A receiver that drops the connection on one event (it crashes on that
/// payload) while delivering the others: that event looks like an outage
/// each time, but the receiver answers its probe, so after three batches
/// in a row the failures count as attempts and the event becomes a dead
/// letter instead of being retried for ever (at its window's end, a day by
/// default; here at `--max-attempts 5`). Its neighbours are delivered.
#[tokio::test]
async fn an_event_that_breaks_the_connection_every_time_becomes_a_dead_letter() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_poison(Some("poison"));
    let events = [
        Event::new("orders", "1", "OrderPlaced", json!({"n": 1})),
        Event::new("orders", "2", "OrderPlaced", json!({"note": "poison"})),
        Event::new("orders", "3", "OrderPlaced", json!({"n": 3})),
    ];
    outbox::enqueue_all(&db.client, &events).await.unwrap();
    let args = ["--backoff-base", "50ms", "--max-attempts", "5"];
    let relay = start_relay(&db.url, &receiver.url(), &args, &[]).await;
    wait_until("the poisoned event dead", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_id = '2' AND dead_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    stop_relay(relay).await;
    let row = db
        .client
        .query_one(
            "SELECT attempts, last_error FROM outbox WHERE aggregate_id = '2'",
            &[],
        )
        .await
        .unwrap();
    let (attempts, error): (i32, String) = (row.get(0), row.get(1));
    assert_eq!(attempts, 5, "--max-attempts, one attempt per three strikes");
    assert!(error.contains("failed 3 batches in a row"), "{error}");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        2
    );
    let ids: Vec<String> = receiver
        .received()
        .iter()
        .map(|r| r.body["aggregate_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 2, "the neighbours, once each: {ids:?}");
}

/// A payload or headers PostgreSQL accepts but the relay cannot read (a
/// number beyond f64: jsonb keeps it exactly, serde_json cannot) make a
/// dead letter that names the cause, and never stop the relay: the
/// neighbours are delivered. Headers hold only strings since migration 8
/// (`outbox_headers_are_string_tokens`): such headers predate it, or
/// bypassed it, as here with the constraint dropped.
#[tokio::test]
async fn an_event_the_relay_cannot_read_is_a_dead_letter_and_its_neighbours_are_delivered() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_headers_are_string_tokens;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
               ('orders', '1', 'OrderPlaced', '{\"n\": 1}'),
               ('orders', '2', 'OrderPlaced', '{\"n\": 1e400}'),
               ('orders', '3', 'OrderPlaced', '{\"n\": 3}');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
               ('orders', '4', 'OrderPlaced', '{\"n\": 4}', '{\"x\": 1e400}'),
               ('orders', '5', 'OrderPlaced', '{\"n\": 5}', '{}');",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let drain = run_cli(&["relay", "--sink", &redis.url(), "--drain"], &env).await;
    let stderr = text(&drain.stderr);
    assert_eq!(drain.status.code(), Some(1), "a dead letter made: {stderr}");
    assert!(stderr.contains("the drain made 2 dead letter(s)"), "{stderr}");

    let stream = read_stream(&redis.url(), "outbox.event.orders").await;
    let ids: Vec<&str> = stream.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(ids, ["1", "3", "5"], "the neighbours delivered");
    let (attempts, error, dead) = dead_letter_of(&db, "2").await;
    assert_eq!((attempts, dead), (1, true));
    assert!(
        error.starts_with("permanent: the event cannot be read: payload:"),
        "{error}"
    );
    let (attempts, error, dead) = dead_letter_of(&db, "4").await;
    assert_eq!((attempts, dead), (1, true));
    assert!(
        error.starts_with("permanent: the event cannot be read: headers:"),
        "{error}"
    );
}

/// Attempts, last error and whether it is dead, of aggregate `id`'s event.
async fn dead_letter_of(db: &Db, id: &str) -> (i32, String, bool) {
    let row = db
        .client
        .query_one(
            "SELECT attempts, last_error, dead_at IS NOT NULL FROM outbox WHERE aggregate_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}
