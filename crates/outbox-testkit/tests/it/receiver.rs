//! The receiver answers as scripted and records what it answered.

use std::time::Duration;

use outbox_testkit::{Error, Receiver, Respond};
use serde_json::json;

use crate::LONG;

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(LONG).build().unwrap()
}

async fn post(client: &reqwest::Client, url: &str, n: u64) -> reqwest::Response {
    client
        .post(url)
        .header("X-Test", n.to_string())
        .json(&json!({ "n": n }))
        .send()
        .await
        .expect("post")
}

#[tokio::test]
async fn fail_first_then_ok() {
    let receiver = Receiver::start(Respond::FailFirst {
        times: 3,
        status: 500,
    })
    .await
    .unwrap();
    assert_eq!(
        receiver.url(),
        format!("http://127.0.0.1:{}/events", receiver.port())
    );
    let client = client();
    let mut answered = Vec::new();
    for n in 0..4 {
        answered.push(post(&client, &receiver.url(), n).await.status().as_u16());
    }
    assert_eq!(answered, [500, 500, 500, 200]);

    let received = receiver.wait_for_count(4, LONG).await.unwrap();
    let statuses: Vec<u16> = received.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [500, 500, 500, 200]);
    assert_eq!(received[2].body, json!({ "n": 2 }));
    assert_eq!(received[2].path, "/events");
    assert_eq!(received[2].header("x-test"), Some("2"));
    assert!(received.windows(2).all(|w| w[0].at <= w[1].at));
    assert_eq!(receiver.count(), 4);
    receiver.shutdown().await;
}

#[tokio::test]
async fn sequence_retry_after_and_reset() {
    let receiver = Receiver::start(Respond::Sequence(vec![503, 429])).await.unwrap();
    receiver.set_retry_after(Some(7));
    let client = client();

    let first = post(&client, &receiver.url(), 0).await;
    assert_eq!(first.status().as_u16(), 503);
    assert_eq!(first.headers()["retry-after"], "7");
    assert_eq!(post(&client, &receiver.url(), 1).await.status().as_u16(), 429);
    let ok = post(&client, &receiver.url(), 2).await;
    assert_eq!(ok.status().as_u16(), 200);
    assert!(
        ok.headers().get("retry-after").is_none(),
        "only failures carry Retry-After"
    );

    receiver.set_respond(Respond::FailFirst {
        times: 1,
        status: 502,
    });
    receiver.set_retry_after(None);
    let failed = post(&client, &receiver.url(), 3).await;
    assert_eq!(failed.status().as_u16(), 502, "set_respond resets the counter");
    assert!(failed.headers().get("retry-after").is_none());

    let text = client
        .post(format!("http://127.0.0.1:{}/other", receiver.port()))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(text.status().as_u16(), 200);
    let received = receiver.wait_for_count(5, LONG).await.unwrap();
    assert_eq!(received[4].path, "/other");
    assert_eq!(received[4].body, serde_json::Value::Null);
}

#[tokio::test]
async fn wait_for_count_wakes_on_arrival_and_times_out_with_the_count() {
    let receiver = Receiver::start(Respond::Status(404)).await.unwrap();
    let url = receiver.url();
    let waiter = receiver.wait_for_count(2, LONG);
    let sender = async {
        let client = client();
        post(&client, &url, 0).await;
        post(&client, &url, 1).await;
    };
    let (received, ()) = tokio::join!(waiter, sender);
    assert_eq!(received.unwrap().len(), 2);

    let err = receiver
        .wait_for_count(3, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("2 arrived"), "{err}");
}

#[tokio::test]
async fn a_delayed_post_is_recorded_on_arrival_and_answered_after_the_delay() {
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let url = receiver.url();

    // Recorded while its answer waits: the client still has none.
    receiver.set_delay(Some(LONG * 10));
    let parked = tokio::spawn({
        let url = url.clone();
        async move { post(&client(), &url, 0).await.status().as_u16() }
    });
    let received = receiver.wait_for_count(1, LONG).await.unwrap();
    assert_eq!(received[0].body, json!({ "n": 0 }));
    assert!(!parked.is_finished(), "answered before its delay");
    parked.abort();

    // A tokio sleep lasts at least its duration, so this bound holds.
    let delay = Duration::from_millis(200);
    receiver.set_delay(Some(delay));
    let started = std::time::Instant::now();
    assert_eq!(post(&client(), &url, 1).await.status().as_u16(), 200);
    assert!(
        started.elapsed() >= delay,
        "answered after {:?}",
        started.elapsed()
    );

    receiver.set_delay(None);
    assert_eq!(post(&client(), &url, 2).await.status().as_u16(), 200);
    assert_eq!(receiver.count(), 3);
}

#[tokio::test]
async fn an_outage_answers_every_method_and_failures_carry_the_body() {
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_body(Some("{\"error\":\"down for a rollout\"}"));
    receiver.set_outage(503, Duration::from_secs(3600));
    let client = client();
    let refused = post(&client, &receiver.url(), 0).await;
    assert_eq!(refused.status().as_u16(), 503);
    assert_eq!(
        refused.text().await.unwrap(),
        "{\"error\":\"down for a rollout\"}"
    );
    let probe = client.head(receiver.url()).send().await.unwrap();
    assert_eq!(probe.status().as_u16(), 503, "a probe meets the outage too");

    // An outage of no length is over: the script (200) and 405 again, and
    // the script did not count the requests the outage answered.
    receiver.set_outage(503, Duration::ZERO);
    let ok = post(&client, &receiver.url(), 1).await;
    assert_eq!(ok.status().as_u16(), 200);
    assert_eq!(ok.text().await.unwrap(), "", "a success carries no scripted body");
    let probe = client.head(receiver.url()).send().await.unwrap();
    assert_eq!(probe.status().as_u16(), 405);

    let statuses: Vec<u16> = receiver.received().iter().map(|p| p.status).collect();
    assert_eq!(statuses, [503, 200]);
    let probes: Vec<u16> = receiver.probes().iter().map(|(_, s)| *s).collect();
    assert_eq!(probes, [503, 405]);
}

#[tokio::test]
async fn a_held_post_is_recorded_and_answered_only_once_released() {
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let url = receiver.url();
    receiver.hold();
    let held = tokio::spawn({
        let url = url.clone();
        async move { post(&client(), &url, 0).await.status().as_u16() }
    });
    let received = receiver.wait_for_count(1, LONG).await.unwrap();
    assert_eq!(received[0].body, json!({ "n": 0 }));
    assert!(!held.is_finished(), "answered while held");
    receiver.release();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(
        post(&client(), &url, 1).await.status().as_u16(),
        200,
        "no longer held"
    );
}
