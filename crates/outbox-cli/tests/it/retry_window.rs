//! Retries measured in time (issue 35): an unavailable receiver (502, 503,
//! 504, 429) spends no attempt however long it lasts, a failing event dies
//! when its retry window ends (`--retry-for`, from its first failed
//! attempt), `Retry-After` is waited out, and a dead letter keeps what the
//! receiver said and its attempt history (`dlq list`, `dlq show`).

use std::collections::HashMap;
use std::time::Duration;

use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond};
use serde_json::{Value, json};

use crate::support::{Db, LONG, run_cli, start_relay, stop_relay, text, wait_until};

/// `outbox <args>` printing JSON, exit 0.
async fn cli_json(url: &str, args: &[&str]) -> Value {
    let out = run_cli(args, &[("DATABASE_URL", url)]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
}

/// A load balancer answering 503 to everything (the probes too) for 20 s,
/// from just before events arrive, then the receiver: no attempt spent, no
/// dead letter, every event delivered once, in order per aggregate.
#[tokio::test]
async fn a_503_for_20_seconds_spends_no_attempt_and_makes_no_dead_letter() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    // Started first: its startup probe finds the receiver, so the outage
    // meets POSTs, not only probes.
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    wait_until("the startup probe", LONG, || async {
        receiver.probes().len() == 1
    })
    .await;
    receiver.set_outage(503, Duration::from_secs(20));
    db.insert_events(10, 2).await;
    relay
        .wait_for_notification("STATUS=sink http unavailable", LONG)
        .await
        .expect("the breaker opened on the 503s");
    relay
        .wait_for_notification("STATUS=sink http available", LONG)
        .await
        .expect("the breaker closed once the outage ended");
    db.wait_drained("every event delivered").await;
    stop_relay(relay).await;

    // The fault happened: POSTs and probes were answered 503.
    let received = receiver.received();
    let refused = received.iter().filter(|p| p.status == 503).count();
    assert!(refused > 0, "no POST met the outage");
    let probed = receiver.probes().iter().filter(|(_, s)| *s == 503).count();
    assert!(probed > 0, "no probe met the outage");

    assert_eq!(
        db.count(
            "SELECT count(*) FROM outbox WHERE attempts > 0 OR dead_at IS NOT NULL \
             OR first_failed_at IS NOT NULL OR attempt_log IS NOT NULL"
        )
        .await,
        0,
        "no attempt spent, no window started, no dead letter"
    );
    let delivered: Vec<&outbox_testkit::Post> = received.iter().filter(|p| p.status == 200).collect();
    assert_eq!(delivered.len(), 10, "each event once");
    let mut seqs: HashMap<i64, Vec<i64>> = HashMap::new();
    for p in &delivered {
        let payload = &p.body["payload"];
        seqs.entry(payload["agg"].as_i64().unwrap())
            .or_default()
            .push(payload["seq"].as_i64().unwrap());
    }
    assert_eq!(seqs.len(), 5);
    assert!(
        seqs.values().all(|s| s == &[0, 1]),
        "in order per aggregate: {seqs:?}"
    );
    let refused_last = received.iter().rposition(|p| p.status == 503).unwrap();
    let delivered_first = received.iter().position(|p| p.status == 200).unwrap();
    assert!(
        refused_last < delivered_first,
        "nothing delivered during the outage"
    );
}

/// A receiver failing with 500 for ever, a 3 s window: the event is a dead
/// letter at its first failure after the window, with the receiver's body
/// in `last_error` and its last 10 attempts in its history.
#[tokio::test]
async fn a_500_for_ever_dies_when_its_window_ends_with_the_body_and_its_history() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(500)).await.unwrap();
    receiver.set_body(Some("upstream exploded\nat line 3"));
    db.insert_events(1, 1).await;
    let args = [
        "--retry-for",
        "3s",
        "--backoff-base",
        "10ms",
        "--backoff-max",
        "100ms",
    ];
    let relay = start_relay(&db.url, &receiver.url(), &args, &[]).await;
    wait_until("the event dead", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    stop_relay(relay).await;

    let row = db
        .client
        .query_one(
            "SELECT attempts, last_error, attempt_log, \
                    extract(epoch FROM dead_at - first_failed_at)::float8 FROM outbox",
            &[],
        )
        .await
        .unwrap();
    let (attempts, last_error, log, window): (i32, String, Value, f64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        usize::try_from(attempts).unwrap(),
        receiver.count(),
        "every POST an attempt, none after the death"
    );
    assert!(attempts > 10, "{attempts} attempts: the history must be capped");
    assert!(
        window >= 3.0,
        "dead {window} s after its first failure, before its window ended"
    );
    assert_eq!(
        last_error, "HTTP 500 Internal Server Error: upstream exploded at line 3",
        "the body kept, its newline replaced"
    );
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 10, "the last 10 attempts");
    let numbers: Vec<i64> = log.iter().map(|a| a["attempt"].as_i64().unwrap()).collect();
    let last = i64::from(attempts);
    assert_eq!(numbers, ((last - 9)..=last).collect::<Vec<_>>());
    let outcomes: Vec<&str> = log.iter().map(|a| a["outcome"].as_str().unwrap()).collect();
    assert_eq!(outcomes[..9], ["retry"; 9]);
    assert_eq!(outcomes[9], "dead");
    assert!(log.iter().all(|a| a["error"] == last_error.as_str()), "{log:?}");
}

/// A 429 with `Retry-After: 2`: the receiver hears nothing (no POST, no
/// probe) for 2 s, by its own clock, and the 429 costs no attempt.
#[tokio::test]
async fn retry_after_on_a_429_keeps_posts_and_probes_away_for_that_long() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 1,
        status: 429,
    })
    .await
    .unwrap();
    receiver.set_retry_after(Some(2));
    db.insert_events(1, 1).await;
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    db.wait_drained("the event delivered").await;
    stop_relay(relay).await;

    let received = receiver.received();
    assert_eq!(received.iter().map(|p| p.status).collect::<Vec<_>>(), [429, 200]);
    let refused_at = received[0].at;
    let next = receiver
        .probes()
        .iter()
        .map(|(at, _)| *at)
        .chain([received[1].at])
        .filter(|at| *at > refused_at)
        .min()
        .unwrap();
    assert!(
        next - refused_at >= Duration::from_secs(2),
        "the next request {:?} after the 429",
        next - refused_at
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0,
        "a 429 is the receiver unavailable, not the event failing"
    );
}

/// A 400 with a JSON body: a dead letter at once whose `last_error` keeps
/// the body; `dlq show --json` has it, the history, the payload and the
/// headers, and so has `dlq list --json`.
#[tokio::test]
async fn a_400_with_a_json_body_is_a_dead_letter_that_keeps_it() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(400)).await.unwrap();
    let body = r#"{"error":"bad request: schema v2 required"}"#;
    receiver.set_body(Some(body));
    let event = Event::new("orders", "42", "OrderPlaced", json!({"order": 42, "schema": 1})).with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    Outbox::default().enqueue(&db.client, &event).await.unwrap();
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    wait_until("the event dead", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(receiver.count(), 1, "a 400 is not retried");
    let expected = format!("permanent: HTTP 400 Bad Request: {body}");

    let id: i64 = db
        .client
        .query_one("SELECT id FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    let shown = cli_json(&db.url, &["dlq", "show", &id.to_string(), "--json"]).await;
    assert_eq!(shown["last_error"], expected.as_str(), "{shown}");
    assert_eq!(shown["event_id"], event.event_id.to_string().as_str());
    assert_eq!(shown["payload"], json!({"order": 42, "schema": 1}));
    assert_eq!(shown["headers"]["traceparent"], event.headers["traceparent"]);
    assert_eq!(shown["attempts"], 1);
    assert!(
        shown["dead_at"].is_string() && shown["first_failed_at"].is_string(),
        "{shown}"
    );
    let log = shown["attempt_log"].as_array().unwrap();
    assert_eq!(log.len(), 1, "{shown}");
    assert_eq!(
        (&log[0]["attempt"], &log[0]["outcome"], &log[0]["error"]),
        (&json!(1), &json!("dead"), &json!(expected)),
    );

    let listed = cli_json(&db.url, &["dlq", "list", "--json"]).await;
    let listed = &listed.as_array().unwrap()[0];
    for key in [
        "payload",
        "headers",
        "attempt_log",
        "last_error",
        "first_failed_at",
    ] {
        assert_eq!(listed[key], shown[key], "{key}");
    }

    let env = [("DATABASE_URL", db.url.as_str())];
    let out = run_cli(&["dlq", "show", &id.to_string()], &env).await;
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(said.contains("dead letter") && said.contains(&expected), "{said}");
    assert!(
        said.contains("\"schema\": 1") && said.contains("traceparent"),
        "{said}"
    );
    let missing = run_cli(&["dlq", "show", "999"], &env).await;
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing.stderr).contains("no event with id 999"),
        "{}",
        text(&missing.stderr)
    );
}

/// The same record on a daily-partitioned outbox (`migrate --partition-by
/// day`): migration 0007 added the columns to the partitioned table, and
/// the mark of a failed batch writes them on the day's partition.
#[tokio::test]
async fn a_partitioned_outbox_keeps_the_answer_and_the_history_too() {
    let db = Db::start().await;
    let url = db.pg.fresh_database().await.unwrap();
    let env = [("DATABASE_URL", url.as_str())];
    let out = run_cli(&["migrate", "--partition-by", "day"], &env).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let client = crate::support::connect(&url).await;
    Outbox::default()
        .enqueue(&client, &Event::new("orders", "1", "Placed", json!({"n": 1})))
        .await
        .unwrap();
    let receiver = Receiver::start(Respond::Status(422)).await.unwrap();
    receiver.set_body(Some("amount must be positive"));
    let drain = run_cli(&["relay", "--sink", &receiver.url(), "--drain"], &env).await;
    assert_eq!(drain.status.code(), Some(1), "a drain that made a dead letter");
    let row = client
        .query_one(
            "SELECT last_error, jsonb_array_length(attempt_log), tableoid::regclass::text \
             FROM outbox WHERE dead_at IS NOT NULL AND first_failed_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let (error, entries, partition): (String, i32, String) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(
        error,
        "permanent: HTTP 422 Unprocessable Entity: amount must be positive"
    );
    assert_eq!(entries, 1);
    assert!(
        partition.starts_with("outbox_p"),
        "on a day's partition: {partition}"
    );
}
