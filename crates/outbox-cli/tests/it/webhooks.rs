//! `--http-secret`: every request carries Standard Webhooks headers that the
//! library's verifier accepts, with the same `webhook-id` on every retry.

use std::time::Duration;

use outbox::webhooks::{self, WebhookSecret};
use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::support::{Db, run_cli, start_relay, stop_relay, text};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[tokio::test]
async fn signed_requests_verify_and_keep_their_id_across_retries() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 1,
        status: 503,
    })
    .await
    .unwrap();
    let tx = db.client.transaction().await.unwrap();
    let ids = Outbox::default()
        .enqueue_all(
            &tx,
            &[
                Event::new("orders", "1", "OrderCreated", json!({"n": 1})),
                Event::new("orders", "2", "OrderCreated", json!({"n": 2})),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--http-secret", SECRET, "--backoff-base", "100ms"],
        &[],
    )
    .await;
    db.wait_drained("both published").await;
    stop_relay(relay).await;

    let secret = WebhookSecret::parse(SECRET).unwrap();
    let now = chrono::Utc::now().timestamp();
    let received = receiver.received();
    assert_eq!(received.len(), 3, "one 503, then two deliveries");
    for r in &received {
        let id = r.header(webhooks::ID_HEADER).expect("webhook-id");
        let verified = webhooks::verify(
            &secret,
            id,
            r.header(webhooks::TIMESTAMP_HEADER).expect("webhook-timestamp"),
            r.header(webhooks::SIGNATURE_HEADER).expect("webhook-signature"),
            &r.raw,
            now,
            Duration::from_secs(300),
        );
        assert_eq!(verified, Ok(()), "{id}");
        assert_eq!(id, r.body["event_id"].as_str().unwrap());
        assert_eq!(r.header("idempotency-key"), Some(id));
    }
    // The refused attempt and its retry carry the same id.
    let first = received[0].header(webhooks::ID_HEADER).unwrap();
    assert_eq!(
        received
            .iter()
            .filter(|r| r.header(webhooks::ID_HEADER) == Some(first))
            .count(),
        2
    );
    let mut seen: Vec<String> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.body["event_id"].as_str().unwrap().to_owned())
        .collect();
    seen.sort();
    let mut expected: Vec<String> = ids.iter().map(|u| u.to_string()).collect();
    expected.sort();
    assert_eq!(seen, expected);

    // A tampered body fails verification.
    let r = &received[1];
    let mut tampered = r.raw.clone();
    tampered.push(b' ');
    assert!(
        webhooks::verify(
            &secret,
            r.header(webhooks::ID_HEADER).unwrap(),
            r.header(webhooks::TIMESTAMP_HEADER).unwrap(),
            r.header(webhooks::SIGNATURE_HEADER).unwrap(),
            &tampered,
            now,
            Duration::from_secs(300),
        )
        .is_err()
    );
}

#[tokio::test]
async fn a_bad_secret_is_a_configuration_error() {
    let db = Db::start().await;
    let out = run_cli(
        &[
            "relay",
            "--sink",
            "http://127.0.0.1:1/x",
            "--http-secret",
            "whsec_not base64",
        ],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--http-secret"),
        "{}",
        text(&out.stderr)
    );
}
