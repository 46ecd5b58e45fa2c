//! Issue 32: the polling relay's claim floor. A session holding an old
//! snapshot keeps vacuum from removing the index entries of published rows,
//! so claims start at a floor instead of walking them; these tests check
//! what the floor must never do: lose an event, reorder an aggregate, or
//! pass an id that may still commit, and that it does move past what it
//! may pass. The floor is read from `outbox_claim_floor` on `/metrics`.
//!
//! The floor moves only in a claim's round trip, so where a test waits for
//! it to move it writes an event per look: the relay claims, and the look
//! after sees what that round trip found.

use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Redis, Respond, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::metrics::{http_addr, promtool, promtool_check, scrape, value};
use crate::support::{
    Db, LONG, connect, distinct_events, order_violations, read_stream, run_cli, start_relay, stop_relay,
    text, wait_until,
};

const STREAM: &str = "outbox.event.orders";

/// A relay with small batches (the floor moves often) serving `/metrics`
/// (where the floor shows), and the address it serves on.
async fn floor_relay(db: &Db, redis: &Redis) -> (Spawned, String) {
    let addr = http_addr();
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--http", &addr, "--batch-size", "10"],
        &[],
    )
    .await;
    (relay, addr)
}

/// Waits until row `id` matches `cond` (SQL over the outbox's columns).
async fn wait_for_row(db: &Db, id: i64, cond: &str, what: &str) {
    let sql = format!("SELECT count(*) FROM outbox WHERE id = {id} AND {cond}");
    wait_until(what, LONG, || async { db.count(&sql).await == 1 }).await;
}

/// The relay's claim floor as `/metrics` shows it.
async fn floor(addr: &str) -> f64 {
    let (_, scrape) = scrape(addr).await;
    value(&scrape, "outbox_claim_floor", &[("outbox", "public.outbox")]).expect("outbox_claim_floor")
}

/// Writes one committed `orders` event of aggregate `agg` (its own
/// transaction) and returns its id.
async fn write_one(client: &Client, agg: &str) -> i64 {
    outbox::enqueue(client, &Event::new("orders", agg, "Ticked", json!({"agg": agg})))
        .await
        .unwrap();
    client
        .query_one("SELECT max(id) FROM outbox", &[])
        .await
        .unwrap()
        .get(0)
}

/// Writes an event per look (every 20 ms) until the floor satisfies `ok`;
/// returns it. Panics with `what` after `LONG`.
async fn drive_until(db: &Db, addr: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let deadline = std::time::Instant::now() + LONG;
    loop {
        write_one(&db.client, "driver").await;
        let at = floor(addr).await;
        if ok(at) {
            return at;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {LONG:?} waiting for {what} (the floor is at {at})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A `REPEATABLE READ` session holds its snapshot from before the first
/// event to after the last (nothing it held back can be vacuumed): every
/// event is delivered exactly once and in order per aggregate, the floor
/// moves past the published rows all the same, and the horizon's age and
/// the table's dead tuples show on `/metrics`, the holder named by
/// `outbox stats`. The alert on the age is checked by its promtool unit
/// test (ten minutes of age cannot be waited for here).
#[tokio::test]
async fn a_held_snapshot_loses_nothing_and_the_floor_passes_what_it_keeps() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let holder = connect(&db.url).await;
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox")
        .await
        .unwrap();
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let (relay, addr) = floor_relay(&db, &redis).await;

    let mut first_of_last = 0;
    for round in 0..5 {
        first_of_last = db.count("SELECT coalesce(max(id), 0) + 1 FROM outbox").await;
        db.insert_events(400, 20).await;
        db.wait_drained(&format!("round {round} delivered")).await;
    }
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        0
    );
    // Every row the rounds published is still in the partial index (the
    // snapshot keeps it), and the floor is past the last round's start.
    let at = drive_until(&db, &addr, "the floor past the earlier rounds", |f| {
        f >= first_of_last as f64
    })
    .await;
    assert!(at >= first_of_last as f64);

    let (_, s) = scrape(&addr).await;
    let metric = |name: &str| value(&s, name, &[("outbox", "public.outbox")]);
    assert!(metric("outbox_xmin_horizon_age_seconds").is_some());
    assert!(metric("outbox_dead_tuples").is_some());
    wait_until(
        "the horizon's age and the dead tuples on /metrics",
        LONG,
        || async {
            let (_, s) = scrape(&addr).await;
            let metric = |name: &str| value(&s, name, &[("outbox", "public.outbox")]).unwrap_or(0.0);
            metric("outbox_xmin_horizon_age_seconds") > 0.0 && metric("outbox_dead_tuples") >= 2000.0
        },
    )
    .await;
    let url = db.url.clone();
    let stats = run_cli(&["stats", "--json"], &[("DATABASE_URL", url.as_str())]).await;
    assert_eq!(stats.status.code(), Some(0), "{}", text(&stats.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    let oldest = &stats["xmin_horizon"][0];
    assert_eq!(oldest["kind"], "transaction", "{stats}");
    assert_eq!(oldest["pid"], holder_pid, "{stats}");
    assert_eq!(oldest["state"], "idle in transaction", "{stats}");
    assert!(stats["dead_tuples"].as_i64().unwrap() >= 2000, "{stats}");
    if promtool() {
        let tests = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/prometheus/outbox-alerts.test.yml"
        );
        promtool_check(&["test", "rules", tests], "");
    }

    stop_relay(relay).await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    let events = read_stream(&redis.url(), STREAM).await;
    let written = db.count("SELECT count(*) FROM outbox").await as usize;
    assert_eq!(events.len(), written, "each event once");
    assert_eq!(distinct_events(&events), written);
    assert_eq!(order_violations(&events), 0);
    // The five rounds and the driver's events.
    assert!(written > 2000);
}

/// Two transactions insert (taking low ids) and stay open while later rows
/// commit and are delivered past them, for longer than the floor's settle
/// time: the floor stops at the first open id and never passes it; once
/// they commit (in the other order) their rows are delivered, none lost,
/// each aggregate in order.
#[tokio::test]
async fn the_floor_waits_for_interleaved_transactions_and_their_rows_arrive() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let (relay, addr) = floor_relay(&db, &redis).await;
    db.insert_events(50, 5).await;
    db.wait_drained("the first 50").await;
    // The floor past them first: a gap is passed only once the
    // transactions running a settle time after it was first seen ended,
    // and the ones opened below would be among them.
    drive_until(&db, &addr, "the floor past the first rows", |f| f > 50.0).await;

    let outbox = Outbox::default();
    let mut open = Vec::new();
    for name in ["late-a", "late-b"] {
        let client = connect(&db.url).await;
        client.batch_execute("BEGIN").await.unwrap();
        let events: Vec<Event> = (0..3)
            .map(|seq| Event::new("orders", name, format!("Step{seq}"), json!({"seq": seq})))
            .collect();
        outbox.enqueue_all(&client, &events).await.unwrap();
        let first: i64 = client
            .query_one("SELECT min(id) FROM outbox WHERE aggregate_id = $1", &[&name])
            .await
            .unwrap()
            .get(0);
        open.push((client, first));
    }
    let gap = open[0].1;
    let pid_a: i32 = open[0]
        .0
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    // Rows after them commit and are delivered, until the first open
    // transaction has run for twice the settle time: at every look the
    // floor is at most its first id.
    let settle = outbox_relay::CLAIM_FLOOR_SETTLE.as_secs_f64();
    let mut looks = 0;
    let mut reached = false;
    loop {
        write_one(&db.client, &format!("after-{looks}")).await;
        // The open transactions' rows are not visible here: drained means
        // every row after them was delivered.
        db.wait_drained("the rows after the open ones").await;
        let at = floor(&addr).await;
        assert!(at <= gap as f64, "the floor {at} passed the open id {gap}");
        reached |= at == gap as f64;
        looks += 1;
        let open_for: f64 = db
            .client
            .query_one(
                "SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 \
                   FROM pg_stat_activity WHERE pid = $1",
                &[&pid_a],
            )
            .await
            .unwrap()
            .get(0);
        if open_for > 2.0 * settle && reached {
            break;
        }
        assert!(looks < 3000, "the floor never reached the open id {gap}");
    }

    // The later one commits first.
    for (client, _) in open.into_iter().rev() {
        client.batch_execute("COMMIT").await.unwrap();
    }
    db.wait_drained("the late rows").await;
    stop_relay(relay).await;
    let events = read_stream(&redis.url(), STREAM).await;
    let written = db.count("SELECT count(*) FROM outbox").await as usize;
    assert_eq!(events.len(), written, "each event once");
    assert_eq!(distinct_events(&events), written);
    assert_eq!(order_violations(&events), 0);
    let late: Vec<i64> = events
        .iter()
        .filter(|e| e.aggregate_id.starts_with("late-"))
        .map(|e| e.outbox_id)
        .collect();
    assert_eq!(late.len(), 6, "{late:?}");
}

/// An id taken by a transaction that rolled back never gets a row: once it
/// stayed a gap for the settle time and the transactions running then
/// ended, the floor moves past it.
#[tokio::test]
async fn a_rolled_back_id_does_not_hold_the_floor() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let (relay, addr) = floor_relay(&db, &redis).await;
    db.insert_events(20, 5).await;
    let rolled_back = {
        let client = connect(&db.url).await;
        client.batch_execute("BEGIN").await.unwrap();
        let id = write_one(&client, "rolled-back").await;
        client.batch_execute("ROLLBACK").await.unwrap();
        id
    };
    db.insert_events(20, 5).await;
    db.wait_drained("40 events").await;
    drive_until(&db, &addr, "the floor past the rolled-back id", |f| {
        f > rolled_back as f64
    })
    .await;
    stop_relay(relay).await;
    let events = read_stream(&redis.url(), STREAM).await;
    let written = db.count("SELECT count(*) FROM outbox").await as usize;
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM outbox WHERE id = {rolled_back}"))
            .await,
        0
    );
    assert_eq!(events.len(), written, "each event once");
    assert_eq!(distinct_events(&events), written);
    assert_eq!(order_violations(&events), 0);
}

/// Rows that become due below the floor: a failed row waiting for its
/// retry, passed while it waits, is delivered when it comes due; a dead
/// letter, passed as dead, is delivered once requeued (`dlq requeue`
/// inserts it again under its old id and notifies the relays to sweep).
#[tokio::test]
async fn a_retry_and_a_requeued_dead_letter_below_the_floor_are_delivered() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_refuse(Some(("retry-me", 500)));
    let addr = http_addr();
    let relay = start_relay(
        &db.url,
        &receiver.url(),
        &["--http", &addr, "--batch-size", "10", "--backoff-base", "5s"],
        &[],
    )
    .await;
    let client = &db.client;
    let add = |agg: &'static str, payload: serde_json::Value| async move {
        outbox::enqueue(client, &Event::new("orders", agg, "Special", payload))
            .await
            .unwrap();
        client
            .query_one("SELECT max(id) FROM outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let retried = add("retried", json!({"note": "retry-me"})).await;
    let row = |id: i64| {
        format!("SELECT count(*) FROM outbox WHERE id = {id} AND attempts = 1 AND published_at IS NULL")
    };
    wait_until("the row failed once", LONG, || async {
        db.count(&row(retried)).await == 1
    })
    .await;
    receiver.set_refuse(Some(("dead-me", 422)));
    let dead = add("dead", json!({"note": "dead-me"})).await;
    wait_for_row(&db, dead, "dead_at IS NOT NULL", "the dead letter").await;

    // The floor passes both while the retry waits.
    drive_until(&db, &addr, "the floor past the retry and the dead letter", |f| {
        f > dead.max(retried) as f64
    })
    .await;
    assert_eq!(
        db.count(&row(retried)).await,
        1,
        "the floor passed the row before its retry (--backoff-base too short for this machine?)"
    );
    wait_for_row(&db, retried, "published_at IS NOT NULL", "the retry delivered").await;

    receiver.set_refuse(None);
    let url = db.url.clone();
    let requeue = run_cli(
        &["dlq", "requeue", "--id", &dead.to_string()],
        &[("DATABASE_URL", url.as_str())],
    )
    .await;
    assert_eq!(requeue.status.code(), Some(0), "{}", text(&requeue.stderr));
    wait_for_row(
        &db,
        dead,
        "published_at IS NOT NULL",
        "the requeued dead letter delivered",
    )
    .await;
    db.wait_drained("everything").await;
    stop_relay(relay).await;
    let answers = |note: &str| -> Vec<u16> {
        receiver
            .received()
            .iter()
            .filter(|p| p.body["payload"]["note"] == note)
            .map(|p| p.status)
            .collect()
    };
    assert_eq!(answers("retry-me"), [500, 200]);
    assert_eq!(answers("dead-me"), [422, 200]);
}
