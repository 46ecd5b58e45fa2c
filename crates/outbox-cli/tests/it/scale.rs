//! Several relays on one outbox: even shares, per-aggregate order, takeover
//! of a killed relay's partitions, and a frozen relay fenced off.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use outbox_testkit::{Redis, Spawned};
use serde_json::Value;

use crate::support::{
    Db, LONG, distinct_events, first_delivery_violations, order_violations, read_stream, run_cli,
    start_relay, stop_relay, text, wait_until,
};

const STREAM: &str = "outbox.event.orders";
const PARTITIONS: i64 = 64;
/// Short, so takeovers happen within a test; the default is 10 s.
const LEASE: &str = "2s";
const LEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// `outbox relays --json`.
async fn relays_report(url: &str) -> Value {
    let out = run_cli(&["relays", "--json"], &[("DATABASE_URL", url)]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `n` live relays hold every partition, each N/n rounded down or up.
async fn balanced(url: &str, n: usize) -> bool {
    let report = relays_report(url).await;
    let live = report["relays"].as_array().unwrap();
    let (low, high) = (PARTITIONS / n as i64, (PARTITIONS + n as i64 - 1) / n as i64);
    live.len() == n
        && report["unowned"].as_array().unwrap().is_empty()
        && live.iter().all(|r| {
            let held = r["partitions"].as_array().unwrap().len() as i64;
            (low..=high).contains(&held)
        })
}

async fn start_relays(db: &Db, redis: &Redis, n: usize, extra: &[&str]) -> Vec<Spawned> {
    let mut relays = Vec::new();
    for i in 0..n {
        let name = format!("relay-{i}");
        let mut args = vec!["--lease-timeout", LEASE, "--relay-name", &name];
        args.extend_from_slice(extra);
        relays.push(start_relay(&db.url, &redis.url(), &args, &[]).await);
    }
    relays
}

#[tokio::test]
async fn four_relays_share_the_partitions_evenly_and_keep_every_aggregate_in_order() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let relays = start_relays(&db, &redis, 4, &[]).await;
    wait_until("4 relays hold 16 partitions each", LONG, || balanced(&db.url, 4)).await;

    db.insert_events(9_000, 3).await;
    db.wait_drained("all 9,000 published").await;

    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 9_000);
    assert_eq!(events.len(), 9_000, "nothing failed, so nothing was sent twice");
    assert_eq!(order_violations(&events), 0);
    for relay in &relays {
        assert!(
            relay.notified("OUTBOX_BATCH=committed"),
            "every relay delivered its share"
        );
    }
    for relay in relays {
        stop_relay(relay).await;
    }
    let report = relays_report(&db.url).await;
    assert_eq!(report["relays"].as_array().unwrap().len(), 0, "{report}");
    assert_eq!(
        report["unowned"].as_array().unwrap().len() as i64,
        PARTITIONS,
        "relays that stop hand their partitions back"
    );
}

#[tokio::test]
async fn ordering_none_takes_no_leases_and_reports_its_reordering() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(9_000, 3).await;
    let relays = start_relays(&db, &redis, 4, &["--ordering", "none", "--batch-size", "50"]).await;
    db.wait_drained("all 9,000 published").await;

    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 9_000);
    // Reordering is allowed here, and its count is what this mode costs;
    // it may be zero on a quiet machine.
    let violations = order_violations(&events);
    eprintln!(
        "--ordering none, 4 relays: {violations} of 9000 events arrived after a later event of their aggregate"
    );
    assert_eq!(
        relays_report(&db.url).await["relays"].as_array().unwrap().len(),
        0,
        "no relay registered"
    );
    for relay in relays {
        stop_relay(relay).await;
    }
}

#[tokio::test]
async fn a_killed_relays_partitions_move_within_the_lease_timeout_and_nothing_is_lost() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let mut relays = start_relays(&db, &redis, 3, &[]).await;
    wait_until("3 relays share the partitions", LONG, || balanced(&db.url, 3)).await;
    let victim = relays[0].pid();

    db.insert_events(9_000, 3).await;
    wait_until("a sixth delivered", LONG, || async {
        db.unpublished().await <= 7_500
    })
    .await;
    relays[0].kill().unwrap();
    let killed = Instant::now();
    wait_until("the killed relay's partitions taken over", LONG, || {
        balanced(&db.url, 2)
    })
    .await;
    let takeover = killed.elapsed();
    eprintln!("takeover after kill -9: {takeover:?} (lease timeout {LEASE_TIMEOUT:?})");
    // Ticks every third of the timeout and a dead relay after two thirds:
    // within the timeout, plus scheduling slack on a loaded machine.
    assert!(takeover < LEASE_TIMEOUT * 3, "takeover took {takeover:?}");
    let report = relays_report(&db.url).await;
    assert!(
        !report["relays"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "relay-0"),
        "relay {victim} is gone from the live relays: {report}"
    );

    // A relay joining later gets its share.
    let late = start_relay(
        &db.url,
        &redis.url(),
        &["--lease-timeout", LEASE, "--relay-name", "late"],
        &[],
    )
    .await;
    db.wait_drained("all 9,000 published").await;
    wait_until("3 relays share the partitions again", LONG, || {
        balanced(&db.url, 3)
    })
    .await;

    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 9_000, "nothing lost");
    assert_eq!(
        first_delivery_violations(&events),
        0,
        "behind an inbox, every aggregate arrives in order"
    );
    // At most the killed relay's two batches in flight were sent again.
    assert!(events.len() - 9_000 <= 200, "{} duplicates", events.len() - 9_000);
    relays.remove(0).wait(LONG).await.unwrap();
    for relay in relays {
        stop_relay(relay).await;
    }
    stop_relay(late).await;
}

#[tokio::test]
async fn a_frozen_relay_cut_from_its_lease_is_fenced_off_and_marks_nothing() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(200, 10).await;

    // A delivers its first batch of 50, then stops before the commit.
    let a = start_relay(
        &db.url,
        &redis.url(),
        &[
            "--lease-timeout",
            LEASE,
            "--relay-name",
            "a",
            "--batch-size",
            "50",
        ],
        &[("OUTBOX_FAILPOINT", "sleep-after-deliver-ms=3000")],
    )
    .await;
    a.wait_for_notification("OUTBOX_FAILPOINT=sleep-after-deliver reached", LONG)
        .await
        .unwrap();
    // Cut its lease connection, and freeze it so it cannot reconnect.
    let cut = db
        .count(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
              WHERE application_name = 'outbox-relay lease'",
        )
        .await;
    assert_eq!(cut, 1);
    a.signal(Signal::SIGSTOP).unwrap();
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 50);
    assert_eq!(db.unpublished().await, 200, "A's batch is not marked");

    // B declares A dead, terminates A's batch connections (releasing the
    // rows A holds), takes every partition and delivers everything.
    let b = start_relay(
        &db.url,
        &redis.url(),
        &["--lease-timeout", LEASE, "--relay-name", "b"],
        &[],
    )
    .await;
    db.wait_drained("B published all 200").await;
    let marks_before: Vec<(i64, String)> = published_marks(&db).await;

    // A wakes up: its commit fails, and the batch it had claimed next is
    // given back unsent, as its lease ran out.
    a.signal(Signal::SIGCONT).unwrap();
    a.wait_for_notification("OUTBOX_FAILPOINT=sleep-after-deliver over", LONG)
        .await
        .unwrap();
    wait_until("A rejoined after losing its connections", LONG, || async {
        a.notified("STATUS=reconnected")
    })
    .await;
    wait_until("A and B share the partitions", LONG, || balanced(&db.url, 2)).await;
    assert_eq!(
        published_marks(&db).await,
        marks_before,
        "A marked nothing after it lost its partitions"
    );

    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 200);
    // A's 50 first, then B's 200: no aggregate was delivered by both at once.
    assert_eq!(events.len(), 250, "{} entries", events.len());
    let a_ids: Vec<i64> = events[..50].iter().map(|e| e.outbox_id).collect();
    assert_eq!(a_ids, (1..=50).collect::<Vec<_>>());
    assert_eq!(order_violations(&events[50..]), 0);
    assert_eq!(distinct_events(&events[50..]), 200);
    stop_relay(a).await;
    stop_relay(b).await;
}

/// Every row's id and `published_at`, as text so any change shows.
async fn published_marks(db: &Db) -> Vec<(i64, String)> {
    db.client
        .query("SELECT id, published_at::text FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}
