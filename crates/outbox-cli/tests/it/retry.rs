//! Failing receivers: backoff schedule, dead letters, requeue, permanent errors.

use std::time::Duration;

use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::support::{Db, LONG, run_cli, start_relay, stop_relay, text, wait_until};

#[tokio::test]
async fn receiver_failing_three_times_is_retried_with_backoff() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 3,
        status: 500,
    })
    .await
    .unwrap();
    // One aggregate, two events: the second waits behind the first.
    let tx = db.client.transaction().await.unwrap();
    Outbox::default()
        .enqueue_all(
            &tx,
            &[
                Event::new("orders", "1", "OrderCreated", json!({"n": 1})),
                Event::new("orders", "1", "OrderPaid", json!({"n": 2})),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Lease ticks (which also find due rows) every 20 s: a retry that waited
    // for one instead of its own backoff shows as a gap of seconds.
    let relay = start_relay(&db.url, &receiver.url(), &["--lease-timeout", "60s"], &[]).await;
    db.wait_drained("both events published").await;
    stop_relay(relay).await;

    // Requests: event 1 fails three times (500), then event 1 and event 2
    // succeed; event 2 is never sent before event 1 got through.
    let received = receiver.received();
    let seq: Vec<(i64, u16)> = received
        .iter()
        .map(|r| (r.body["payload"]["n"].as_i64().unwrap(), r.status))
        .collect();
    assert_eq!(seq, [(1, 500), (1, 500), (1, 500), (1, 200), (2, 200)]);
    // Backoff 200 ms, 400 ms, 800 ms (plus up to 10% jitter, never less).
    for (i, nominal) in [200u64, 400, 800].into_iter().enumerate() {
        let gap = received[i + 1].at - received[i].at;
        assert!(
            gap >= Duration::from_millis(nominal),
            "gap {i} was {gap:?}, nominal {nominal} ms"
        );
        assert!(
            gap < Duration::from_secs(10),
            "gap {i} was {gap:?}: the retry waited for a lease tick, not its backoff"
        );
    }
    let attempts: Vec<i32> = db
        .client
        .query("SELECT attempts FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(attempts, [3, 0], "held-back rows do not spend attempts");
}

/// Dead letters are recorded in the row (`dead_at`): rows dead at 3
/// attempts stay dead for a relay started with no limit, and `dlq` and
/// `stats` see them with no `--max-attempts` of their own.
#[tokio::test]
async fn dead_letters_stay_dead_whatever_the_next_relay_s_limit_and_requeue_delivers() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(500)).await.unwrap();
    db.insert_events(3, 1).await;
    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--max-attempts", "3", "--backoff-base", "20ms"],
        &[],
    )
    .await;
    wait_until("3 dead letters", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NOT NULL")
            .await
            == 3
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(receiver.count(), 9, "3 attempts each, then no more");

    // A relay with no attempt limit finds nothing due: the rows are
    // dead by their own record, not by its limit.
    receiver.set_respond(Respond::Ok);
    let url = db.url.clone();
    let env = [("DATABASE_URL", url.as_str())];
    let drain = run_cli(&["relay", "--sink", &receiver.url(), "--drain"], &env).await;
    assert_eq!(drain.status.code(), Some(0), "{}", text(&drain.stderr));
    assert_eq!(receiver.count(), 9, "no dead letter retried");

    let list = run_cli(&["dlq", "list", "--json"], &env).await;
    assert_eq!(list.status.code(), Some(0), "{}", text(&list.stderr));
    let dead: Vec<serde_json::Value> = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(dead.len(), 3);
    assert!(
        dead.iter().all(|d| d["attempts"] == 3
            && d["dead_at"].is_string()
            && d["last_error"] == "HTTP 500 Internal Server Error"),
        "{dead:?}"
    );

    let stats = run_cli(&["stats", "--json"], &env).await;
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(
        (stats["dead_letters"].as_i64(), stats["unpublished"].as_i64()),
        (Some(3), Some(0))
    );
    assert!(stats["slot"].is_null(), "no log tailing set up: {stats}");

    let dry = run_cli(&["dlq", "requeue", "--all", "--dry-run"], &env).await;
    assert!(
        text(&dry.stdout).contains("would requeue 3"),
        "{}",
        text(&dry.stdout)
    );
    assert_eq!(receiver.count(), 9);

    let requeue = run_cli(&["dlq", "requeue", "--all"], &env).await;
    assert!(
        text(&requeue.stdout).contains("requeued 3"),
        "{}",
        text(&requeue.stdout)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL OR attempts > 0")
            .await,
        0,
        "requeue clears dead_at and the attempts"
    );
    let drain = run_cli(&["relay", "--sink", &receiver.url(), "--drain"], &env).await;
    assert_eq!(drain.status.code(), Some(0), "{}", text(&drain.stderr));
    assert_eq!(db.unpublished().await, 0);
    assert_eq!(receiver.count(), 12);
}

/// `relay --drain` that made dead letters exits 1 and says so, so a cron
/// job notices.
#[tokio::test]
async fn a_drain_that_makes_dead_letters_exits_1() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(422)).await.unwrap();
    db.insert_events(2, 1).await;
    let env = [("DATABASE_URL", db.url.as_str())];
    let drain = run_cli(&["relay", "--sink", &receiver.url(), "--drain"], &env).await;
    let stderr = text(&drain.stderr);
    assert_eq!(drain.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the drain made 2 dead letter(s)"), "{stderr}");
    assert_eq!(receiver.count(), 2);
}

#[tokio::test]
async fn permanent_refusal_dead_letters_at_once_and_retry_filters_select() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(422)).await.unwrap();
    let tx = db.client.transaction().await.unwrap();
    Outbox::default()
        .enqueue_all(
            &tx,
            &[
                Event::new("orders", "1", "A", json!({})),
                Event::new("payments", "2", "B", json!({})),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    wait_until("both dead", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    assert_eq!(receiver.count(), 2, "a 4xx is not retried");
    let error: String = db
        .client
        .query_one("SELECT last_error FROM outbox LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(error, "permanent: HTTP 422 Unprocessable Entity");

    receiver.set_respond(Respond::Ok);
    let env = [("DATABASE_URL", db.url.as_str())];
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts = 1").await,
        2,
        "a permanent failure costs one attempt"
    );
    // `retry`: the old name of `requeue`, kept as a hidden alias. A selector
    // that matches nothing says so and exits 1.
    let none = run_cli(&["dlq", "retry", "--error-contains", "HTTP 500"], &env).await;
    assert_eq!(none.status.code(), Some(1));
    assert!(
        text(&none.stderr).contains("no dead letter in public.outbox matches --error-contains \"HTTP 500\""),
        "{}",
        text(&none.stderr)
    );
    let none = run_cli(&["dlq", "give-up", "--id", "999"], &env).await;
    assert_eq!(none.status.code(), Some(1), "{}", text(&none.stderr));
    let one = run_cli(&["dlq", "requeue", "--aggregate-type", "payments"], &env).await;
    assert!(text(&one.stdout).contains("requeued 1"), "{}", text(&one.stdout));
    wait_until("the payments event delivered", LONG, || async {
        db.unpublished().await == 1
    })
    .await;
    let left: String = db
        .client
        .query_one(
            "SELECT aggregate_type FROM outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, "orders");
    stop_relay(relay).await;
}

#[tokio::test]
async fn retry_after_sets_the_earliest_next_attempt() {
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
    db.wait_drained("the event published").await;
    stop_relay(relay).await;
    let received = receiver.received();
    assert_eq!(received.iter().map(|r| r.status).collect::<Vec<_>>(), [429, 200]);
    let gap = received[1].at - received[0].at;
    // The backoff alone would retry after 200 ms; the receiver asked for 2 s.
    assert!(gap >= Duration::from_secs(2), "retried after {gap:?}");
}
