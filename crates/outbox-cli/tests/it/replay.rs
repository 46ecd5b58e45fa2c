//! `outbox replay` (issue 18): published events re-delivered with their
//! event_ids, in order per aggregate, resumable after SIGKILL, counted by
//! `--dry-run`, beside a live relay that keeps delivering; what cleanup
//! removed is reported; bad targets are refused before anything is read.

use std::collections::{HashMap, HashSet};

use outbox::InboxConfig;
use outbox_testkit::{Redis, Spawned};
use redis::AsyncCommands;

use crate::support::{
    Db, LONG, connect, distinct_events, first_delivery_violations, order_violations, outbox_cmd, read_stream,
    run_cli, start_relay, stop_relay, text, wait_until,
};

const STREAM: &str = "outbox.event.orders";

/// 5,000 published events, one in five of aggregate type `orders` (20
/// aggregates of 50 events), the rest `payments`, interleaved; plus
/// `orders` events that must never be replayed: 10 unpublished, 5 dead
/// letters.
async fn five_thousand_published(db: &Db) {
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT CASE WHEN g % 5 = 0 THEN 'orders' ELSE 'payments' END, 'agg-' || (g % 100), 'Step',
                    jsonb_build_object('g', g), clock_timestamp()
               FROM generate_series(1, 5000) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, next_attempt_at)
             SELECT 'orders', 'agg-0', 'Waiting', '{}', now() + interval '1 day' FROM generate_series(1, 10) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, dead_at)
             SELECT 'orders', 'agg-5', 'Dead', '{}', 5, 'HTTP 422', now() FROM generate_series(1, 5) g;",
        )
        .await
        .unwrap();
}

/// The event_ids of the published `orders` rows, in id order.
async fn published_orders(db: &Db) -> Vec<String> {
    db.client
        .query(
            "SELECT event_id::text FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every row's delivery state, to show a replay changed none of it.
async fn delivery_state(db: &Db) -> String {
    db.client
        .query_one(
            "SELECT md5(string_agg(id || ':' || coalesce(published_at::text, '-') || ':' || attempts || ':' \
                    || coalesce(dead_at::text, '-') || ':' || next_attempt_at::text, ',' ORDER BY id)) FROM outbox",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The one replay job's state, cursor, bound and sent count.
async fn job(db: &Db) -> (String, i64, i64, i64) {
    let row = db
        .client
        .query_one("SELECT state, cursor_id, upto_id, sent FROM outbox_replays", &[])
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

async fn redis_keys(redis: &Redis) -> Vec<String> {
    let mut r = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut keys: Vec<String> = r.keys("*").await.unwrap();
    keys.sort();
    keys
}

fn replay_cmd(db: &Db, args: &[&str]) -> tokio::process::Command {
    let mut cmd = outbox_cmd();
    cmd.arg("replay").args(args).env("DATABASE_URL", &db.url);
    cmd
}

#[tokio::test]
async fn replay_sends_exactly_the_matching_events_in_order_with_their_event_ids() {
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let before = delivery_state(&db).await;
    let redis = Redis::start().await.unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];

    let out = run_cli(
        &[
            "replay",
            "--to",
            &redis.url(),
            "--aggregate-type",
            "orders",
            "--rate",
            "unlimited",
        ],
        &env,
    )
    .await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("replay job 1: 1000 events with ids up to 5015"),
        "{stdout}"
    );
    assert!(stdout.contains("matched 1000, sent 1000"), "{stdout}");

    let got = read_stream(&redis.url(), STREAM).await;
    let ids: Vec<String> = got.iter().map(|e| e.event_id.clone()).collect();
    assert_eq!(
        ids,
        published_orders(&db).await,
        "exactly those 1000, in id order"
    );
    assert_eq!(order_violations(&got), 0);
    assert_eq!(
        got.iter()
            .map(|e| e.aggregate_id.as_str())
            .collect::<HashSet<_>>()
            .len(),
        20
    );
    assert_eq!(redis_keys(&redis).await, [STREAM], "no other stream");
    assert_eq!(
        delivery_state(&db).await,
        before,
        "live delivery's columns untouched"
    );
    let (state, cursor, upto, sent) = job(&db).await;
    assert_eq!((state.as_str(), cursor, upto, sent), ("done", 5015, 5015, 1000));

    // Done is done: a resume says so and sends nothing more.
    let again = run_cli(&["replay", "--resume", "1"], &env).await;
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert!(
        text(&again.stdout).contains("done already"),
        "{}",
        text(&again.stdout)
    );
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 1000);
}

#[tokio::test]
async fn a_replay_killed_at_half_resumes_and_the_inbox_applies_each_event_once() {
    let (db, redis, half) = to_kill_at_half().await;

    // 500/s: pages of 50, about two seconds for the 1000.
    let mut replay = Spawned::spawn(replay_cmd(
        &db,
        &[
            "--to",
            &redis.url(),
            "--aggregate-type",
            "orders",
            "--rate",
            "500/s",
        ],
    ))
    .unwrap();
    wait_until("the job's cursor past half", LONG, || async {
        db.client
            .query_opt("SELECT cursor_id FROM outbox_replays WHERE id = 1", &[])
            .await
            .unwrap()
            .is_some_and(|r| r.get::<_, i64>(0) >= half)
    })
    .await;
    replay.kill().unwrap();
    let (state, cursor, upto, sent) = job(&db).await;
    assert_eq!(state, "running", "killed, not stopped");
    assert!(
        cursor >= half && cursor < upto,
        "cursor {cursor}, half {half}, upto {upto}"
    );
    assert!((500..1000).contains(&sent), "sent {sent}");

    let env = [("DATABASE_URL", db.url.as_str())];
    let list = run_cli(&["replay", "--list"], &env).await;
    assert_eq!(list.status.code(), Some(0), "{}", text(&list.stderr));
    assert!(
        text(&list.stdout).contains("running (no process)"),
        "{}",
        text(&list.stdout)
    );

    let resumed = run_cli(&["replay", "--resume", "1"], &env).await;
    let stdout = text(&resumed.stdout);
    assert_eq!(
        resumed.status.code(),
        Some(0),
        "{stdout}{}",
        text(&resumed.stderr)
    );
    assert!(
        stdout.contains(&format!("resuming after id {cursor}")),
        "{stdout}"
    );
    let (state, _, _, sent) = job(&db).await;
    assert_eq!(
        (state.as_str(), sent),
        ("done", 1000),
        "acknowledged once each, by count"
    );

    // Each at least once, nothing else, order kept for first deliveries.
    let got = read_stream(&redis.url(), STREAM).await;
    let expected = published_orders(&db).await;
    let distinct: HashSet<&str> = got.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(
        distinct,
        expected.iter().map(String::as_str).collect::<HashSet<_>>()
    );
    assert!(got.len() >= 1000);
    assert_eq!(first_delivery_violations(&got), 0);
    let duplicates = got.len() - 1000;
    println!(
        "stream: {} entries, {duplicates} re-sent after the kill",
        got.len()
    );

    // The inbox-backed consumer: side effects exactly once.
    let stopped = consume_all(&db, &redis).await;
    assert_eq!(stopped["processed"], 1000, "{stopped}");
    assert_eq!(stopped["duplicates"], duplicates, "{stopped}");
}

/// The kill tests' setup: 5000 published events, the inbox, a Redis, and
/// the id of the 500th published order (half of the 1000 replayed).
async fn to_kill_at_half() -> (Db, Redis, i64) {
    let mut db = Db::start().await;
    five_thousand_published(&db).await;
    inbox(&mut db).await;
    let redis = Redis::start().await.unwrap();
    let half: i64 = db
        .count("SELECT id FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NOT NULL ORDER BY id OFFSET 499 LIMIT 1")
        .await;
    (db, redis, half)
}

/// An inbox and a `shipments` table for the side effect.
async fn inbox(db: &mut Db) {
    outbox::migrate_inbox(&mut db.client, &InboxConfig::default())
        .await
        .unwrap();
    db.client
        .batch_execute("CREATE TABLE shipments (event_id uuid, order_id text)")
        .await
        .unwrap();
}

/// Runs `outbox consume` on the stream until it read and acknowledged every
/// entry; asserts the side effect ran once per event (1000 events); returns
/// the consumer's summary fields.
async fn consume_all(db: &Db, redis: &Redis) -> serde_json::Value {
    let mut cmd = outbox_cmd();
    cmd.args([
        "consume",
        "--from",
        &redis.url(),
        "--stream",
        STREAM,
        "--group",
        "shipping",
    ])
    .args([
        "--apply",
        "INSERT INTO shipments (event_id, order_id) VALUES ($1, $2)",
    ])
    .args(["--log-format", "json"])
    .env("DATABASE_URL", &db.url);
    let mut consumer = Spawned::spawn_notified(cmd).unwrap();
    consumer.wait_for_notification("READY=1", LONG).await.unwrap();
    let mut r = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let last: redis::streams::StreamRangeReply = r.xrevrange_count(STREAM, "+", "-", 1).await.unwrap();
    let last = last.ids[0].id.clone();
    wait_until("the consumer read and acknowledged every entry", LONG, || async {
        let mut r = r.clone();
        // The group appears when the consumer first reads.
        let groups: redis::streams::StreamInfoGroupsReply = r.xinfo_groups(STREAM).await.unwrap();
        let Some(group) = groups.groups.iter().find(|g| g.name == "shipping") else {
            return false;
        };
        let pending: redis::streams::StreamPendingReply = r.xpending(STREAM, "shipping").await.unwrap();
        group.last_delivered_id == last && pending.count() == 0
    })
    .await;
    consumer.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(consumer.wait(LONG).await.unwrap().success());
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 1000);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        1000
    );
    let stopped = consumer
        .lines()
        .into_iter()
        .find(|l| l.contains("consumer stopped"))
        .expect("a summary line");
    let stopped: serde_json::Value = serde_json::from_str(&stopped).unwrap();
    stopped["fields"].clone()
}

#[tokio::test]
async fn a_replay_killed_between_send_and_save_resends_one_page_the_inbox_drops() {
    let (db, redis, half) = to_kill_at_half().await;
    let mut cmd = replay_cmd(
        &db,
        &[
            "--to",
            &redis.url(),
            "--aggregate-type",
            "orders",
            "--rate",
            "500/s",
        ],
    );
    cmd.env("OUTBOX_FAILPOINT", format!("replay-pause-after-id={half}"));
    let mut replay = Spawned::spawn_notified(cmd).unwrap();
    replay
        .wait_for_notification("OUTBOX_FAILPOINT=replay-pause-after-id reached", LONG)
        .await
        .unwrap();
    replay.kill().unwrap();
    // The page reaching the half (50 events at 500/s) is in the stream,
    // not in the cursor.
    let (state, cursor, _, sent) = job(&db).await;
    assert_eq!((state.as_str(), sent), ("running", 450));
    assert!(cursor < half);
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 500);

    let env = [("DATABASE_URL", db.url.as_str())];
    let resumed = run_cli(&["replay", "--resume", "1"], &env).await;
    assert_eq!(resumed.status.code(), Some(0), "{}", text(&resumed.stderr));
    let got = read_stream(&redis.url(), STREAM).await;
    assert_eq!(got.len(), 1050, "one page sent twice");
    assert_eq!(distinct_events(&got), 1000);
    assert_eq!(first_delivery_violations(&got), 0);
    let stopped = consume_all(&db, &redis).await;
    assert_eq!(stopped["processed"], 1000, "{stopped}");
    assert_eq!(
        stopped["duplicates"], 50,
        "the inbox dropped the page sent twice: {stopped}"
    );
}

#[tokio::test]
async fn a_dry_run_counts_and_sends_nothing() {
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let redis = Redis::start().await.unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let out = run_cli(
        &[
            "replay",
            "--to",
            &redis.url(),
            "--aggregate-type",
            "orders",
            "--dry-run",
        ],
        &env,
    )
    .await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("would replay 1000 events with ids up to 5015"),
        "{stdout}"
    );
    let all = run_cli(&["replay", "--to", &redis.url(), "--dry-run"], &env).await;
    assert!(
        text(&all.stdout).contains("would replay 5000 events"),
        "{}",
        text(&all.stdout)
    );
    assert_eq!(redis_keys(&redis).await, Vec::<String>::new(), "nothing sent");
    assert_eq!(db.count("SELECT count(*) FROM outbox_replays").await, 0, "no job");
}

#[tokio::test]
async fn live_delivery_goes_on_during_a_replay() {
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let live_redis = Redis::start().await.unwrap();
    let replay_redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &live_redis.url(), &[], &[]).await;
    let writer = connect(&db.url).await;

    // 5,000 events at 2,000/s: a replay of about 2.5 s.
    let mut replay = Spawned::spawn(replay_cmd(
        &db,
        &["--to", &replay_redis.url(), "--rate", "2000/s"],
    ))
    .unwrap();
    wait_until("the replay job to start", LONG, || async {
        db.count("SELECT count(*) FROM outbox_replays WHERE sent > 0")
            .await
            == 1
    })
    .await;
    let (mut written, mut during) = (0, 0);
    loop {
        let running = job(&db).await.0 == "running";
        writer
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('live', $1, 'E', '{}')",
                &[&format!("live-{}", written % 10)],
            )
            .await
            .unwrap();
        written += 1;
        if running {
            during += 1;
        } else {
            break;
        }
        // Load, not synchronisation: about 50 live events a second.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        replay.wait(LONG).await.unwrap().success(),
        "{:#?}",
        replay.lines()
    );
    let summary = replay
        .lines()
        .into_iter()
        .find(|l| l.contains(" done: "))
        .unwrap();
    println!("{summary}");
    wait_until("the live relay to deliver every live event", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'live' AND published_at IS NULL")
            .await
            == 0
    })
    .await;
    stop_relay(relay).await;
    assert!(during > 0, "live events written while the replay ran");

    let keys = redis_keys(&replay_redis).await;
    assert_eq!(
        keys,
        ["outbox.event.orders", "outbox.event.payments"].map(String::from)
    );
    let mut r = redis::Client::open(replay_redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let orders: usize = r.xlen("outbox.event.orders").await.unwrap();
    let payments: usize = r.xlen("outbox.event.payments").await.unwrap();
    assert_eq!(orders + payments, 5000, "the bound: no live event replayed");

    // Latency of the live events: the stream entry's time (Redis's clock)
    // minus created_at (PostgreSQL's), one host.
    let created: HashMap<i64, i64> = db
        .client
        .query(
            "SELECT id, (extract(epoch FROM created_at) * 1000)::int8 FROM outbox WHERE aggregate_type = 'live'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut live = redis::Client::open(live_redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let entries: redis::streams::StreamRangeReply = live.xrange_all("outbox.event.live").await.unwrap();
    assert_eq!(entries.ids.len(), written, "every live event delivered, once");
    let mut latency: Vec<i64> = entries
        .ids
        .iter()
        .map(|e| {
            let at: i64 = e.id.split('-').next().unwrap().parse().unwrap();
            let id: i64 = e.get::<String>("outbox_id").unwrap().parse().unwrap();
            at - created[&id]
        })
        .collect();
    latency.sort_unstable();
    let pct = |p: usize| latency[(latency.len() * p / 100).min(latency.len() - 1)];
    println!(
        "live delivery during the replay: {written} events ({during} while it ran), latency p50 {} ms, p99 {} ms, max {} ms",
        pct(50),
        pct(99),
        latency[latency.len() - 1]
    );
}

#[tokio::test]
async fn replay_says_how_many_matching_events_cleanup_removed() {
    let db = Db::start().await;
    // 3,000 published ten days ago, created in one past hour: 1,000 orders.
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT CASE WHEN g % 3 = 0 THEN 'orders' ELSE 'payments' END, 'agg-' || (g % 10), 'E', '{}',
                    date_trunc('hour', now()) - interval '10 days', now() - interval '10 days'
               FROM generate_series(1, 3000) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', 'agg-' || (g % 10), 'E', '{}', now() FROM generate_series(1, 40) g;",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let cleanup = run_cli(&["cleanup", "--older-than", "7d", "--batch-size", "700"], &env).await;
    assert!(
        text(&cleanup.stdout).contains("deleted 3000 rows"),
        "{}",
        text(&cleanup.stdout)
    );

    let dry = |extra: &'static [&'static str]| async move {
        let mut args = vec![
            "replay",
            "--to",
            "redis://127.0.0.1:1",
            "--aggregate-type",
            "orders",
            "--dry-run",
        ];
        args.extend_from_slice(extra);
        let out = run_cli(&args, &env).await;
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let exact = dry(&[]).await;
    assert!(exact.contains("would replay 40 events"), "{exact}");
    assert!(
        exact.contains("1000 matching events were removed by cleanup before this replay"),
        "{exact}"
    );
    let by_aggregate = dry(&["--aggregate-id", "agg-1"]).await;
    assert!(by_aggregate.contains("would replay 4 events"), "{by_aggregate}");
    assert!(
        by_aggregate.contains("up to 1000 matching events were removed")
            && by_aggregate.contains("not exact"),
        "{by_aggregate}"
    );
    let later = dry(&["--since", "9d"]).await;
    assert!(!later.contains("removed"), "{later}");

    // The real thing says it too, and sends what is left.
    let redis = Redis::start().await.unwrap();
    let out = run_cli(
        &["replay", "--to", &redis.url(), "--aggregate-type", "orders"],
        &env,
    )
    .await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("1000 matching events were removed by cleanup"),
        "{stdout}"
    );
    assert!(
        stdout.contains("matched 40, sent 40 (40 in this run), removed by cleanup 1000"),
        "{stdout}"
    );
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 40);
    let listed = run_cli(&["replay", "--list", "--json"], &env).await;
    let jobs: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(
        jobs[0]["removed"],
        serde_json::json!({"count": 1000, "exact": true})
    );
    assert_eq!(jobs[0]["state"], "done");
    assert_eq!(jobs[0]["filter"]["aggregate_type"], "orders");
}

#[tokio::test]
async fn a_dropped_partition_is_counted_as_removed() {
    let db = Db::start().await;
    let url = db.pg.fresh_database().await.unwrap();
    let env = [("DATABASE_URL", url.as_str())];
    let out = run_cli(&["migrate", "--partition-by", "day"], &env).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let client = connect(&url).await;
    let day = (chrono::Utc::now() - chrono::Duration::days(10)).date_naive();
    let next = day + chrono::Days::new(1);
    client
        .batch_execute(&format!(
            "CREATE TABLE outbox_p{name} PARTITION OF outbox FOR VALUES FROM ('{day} 00:00+00') TO ('{next} 00:00+00');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT 'orders', 'a-' || g, 'E', '{{}}', '{day} 12:00+00', '{day} 12:01+00' FROM generate_series(1, 30) g;",
            name = day.format("%Y%m%d")
        ))
        .await
        .unwrap();
    let maintain = run_cli(
        &["partitions", "maintain", "--keep", "7d", "--premake", "0"],
        &env,
    )
    .await;
    assert!(
        text(&maintain.stdout).contains("(30 published rows)"),
        "{}",
        text(&maintain.stdout)
    );
    let dry = run_cli(&["replay", "--to", "redis://127.0.0.1:1", "--dry-run"], &env).await;
    let stdout = text(&dry.stdout);
    assert!(stdout.contains("would replay 0 events"), "{stdout}");
    assert!(
        stdout.contains("30 matching events were removed by cleanup"),
        "{stdout}"
    );
}

#[tokio::test]
async fn a_bad_target_is_refused_before_anything_is_read() {
    let db = Db::start().await;
    let env = [("DATABASE_URL", db.url.as_str())];
    for (to, says) in [
        ("nope://host:1", "unknown sink scheme \"nope\""),
        ("redis://", "no host"),
        ("route:orders", "give it with --config"),
    ] {
        let out = run_cli(&["replay", "--to", to], &env).await;
        assert_eq!(out.status.code(), Some(2), "{to}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{to}: {}", text(&out.stderr));
    }
    let none = run_cli(&["replay", "--resume", "7"], &env).await;
    assert_eq!(none.status.code(), Some(2), "{}", text(&none.stderr));
    assert!(
        text(&none.stderr).contains("no replay job 7"),
        "{}",
        text(&none.stderr)
    );
    let clash = run_cli(&["replay", "--resume", "7", "--aggregate-type", "x"], &env).await;
    assert_eq!(clash.status.code(), Some(2), "{}", text(&clash.stderr));
    assert_eq!(db.count("SELECT count(*) FROM outbox_replays").await, 0);

    // A job whose URL held a password: the password was never stored.
    db.client
        .batch_execute(
            "INSERT INTO outbox_replays (target, format, rate, upto_id, state)
             VALUES ('redis://:***@127.0.0.1:1', 'native', 1000, 10, 'stopped')",
        )
        .await
        .unwrap();
    let out = run_cli(&["replay", "--resume", "1"], &env).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("which are never stored: give the URL again with --to"),
        "{}",
        text(&out.stderr)
    );
    let other = run_cli(
        &["replay", "--resume", "1", "--to", "redis://:pw@127.0.0.1:2"],
        &env,
    )
    .await;
    assert_eq!(other.status.code(), Some(2), "{}", text(&other.stderr));
    assert!(
        text(&other.stderr).contains("is not replay job 1's target redis://:***@127.0.0.1:1"),
        "{}",
        text(&other.stderr)
    );
    let stored: String = db
        .client
        .query_one("SELECT state FROM outbox_replays", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, "stopped", "refusals change nothing");
}

#[tokio::test]
async fn a_route_of_the_routes_file_replays_its_own_aggregate_type() {
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let (default, orders) = (Redis::start().await.unwrap(), Redis::start().await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("outbox.toml");
    std::fs::write(
        &file,
        format!(
            "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}\"\nstream_prefix = \"replayed\"\n",
            default.url(),
            orders.url()
        ),
    )
    .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let config = file.to_str().unwrap();
    let out = run_cli(
        &[
            "replay",
            "--to",
            "route:orders",
            "--config",
            config,
            "--rate",
            "unlimited",
        ],
        &env,
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("matched 1000, sent 1000"),
        "{}",
        text(&out.stdout)
    );
    let got = read_stream(&orders.url(), "replayed.orders").await;
    assert_eq!(
        got.iter().map(|e| e.event_id.clone()).collect::<Vec<_>>(),
        published_orders(&db).await
    );
    assert_eq!(redis_keys(&default).await, Vec::<String>::new());

    // The default route: every type no route names.
    let out = run_cli(
        &[
            "replay",
            "--to",
            "route:default",
            "--config",
            config,
            "--rate",
            "unlimited",
        ],
        &env,
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("matched 4000, sent 4000"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(redis_keys(&default).await, ["outbox.event.payments"]);

    let clash = run_cli(
        &[
            "replay",
            "--to",
            "route:orders",
            "--config",
            config,
            "--aggregate-type",
            "payments",
        ],
        &env,
    )
    .await;
    assert_eq!(clash.status.code(), Some(2), "{}", text(&clash.stderr));
    let missing = run_cli(&["replay", "--to", "route:refunds", "--config", config], &env).await;
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing.stderr));
    assert!(
        text(&missing.stderr).contains("no [routes.refunds] table"),
        "{}",
        text(&missing.stderr)
    );
}

#[tokio::test]
async fn sigterm_stops_a_replay_at_its_saved_cursor() {
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let redis = Redis::start().await.unwrap();
    // 100/s: pages of 10, ten seconds for the 1000.
    let mut replay = Spawned::spawn(replay_cmd(
        &db,
        &[
            "--to",
            &redis.url(),
            "--aggregate-type",
            "orders",
            "--rate",
            "100",
        ],
    ))
    .unwrap();
    wait_until("a first page acknowledged", LONG, || async {
        db.count("SELECT count(*) FROM outbox_replays WHERE sent > 0")
            .await
            == 1
    })
    .await;
    replay.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = replay.wait(LONG).await.unwrap();
    assert_eq!(status.code(), Some(0), "{:#?}", replay.lines());
    let (state, cursor, upto, sent) = job(&db).await;
    assert_eq!(state, "stopped");
    assert!(sent < 1000 && cursor < upto, "sent {sent}, cursor {cursor}");
    assert!(
        replay
            .lines()
            .iter()
            .any(|l| l.contains(&format!("stopped after id {cursor}"))
                && l.contains("outbox replay --resume 1")),
        "{:#?}",
        replay.lines()
    );
    // The page at the sink was finished and saved: what the stream holds
    // is exactly what the job counts, up to its cursor.
    let got = read_stream(&redis.url(), STREAM).await;
    assert_eq!(got.len() as i64, sent);
    assert_eq!(got.last().unwrap().outbox_id, cursor);
}

#[tokio::test]
async fn a_refused_event_fails_the_job_before_it_and_a_resume_finishes() {
    use outbox_testkit::{Receiver, Respond};
    let db = Db::start().await;
    five_thousand_published(&db).await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_refuse(Some(("\"g\":250}", 422)));
    let env = [("DATABASE_URL", db.url.as_str())];
    let args = [
        "replay",
        "--to",
        &receiver.url(),
        "--aggregate-type",
        "orders",
        "--rate",
        "unlimited",
    ];
    let out = run_cli(&args, &env).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the sink refused event id 250"), "{stderr}");
    assert!(stderr.contains("outbox replay --resume 1"), "{stderr}");
    let (state, cursor, _, sent) = job(&db).await;
    assert_eq!(
        (state.as_str(), cursor, sent),
        ("failed", 245, 49),
        "just before the refused event"
    );
    let error: String = db
        .client
        .query_one("SELECT last_error FROM outbox_replays", &[])
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("event id 250") && error.contains("422"), "{error}");

    receiver.set_refuse(None);
    let out = run_cli(&["replay", "--resume", "1"], &env).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (state, _, _, sent) = job(&db).await;
    assert_eq!((state.as_str(), sent), ("done", 1000));
    let received = receiver.received();
    let delivered: HashSet<String> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.header("idempotency-key").unwrap().to_owned())
        .collect();
    assert_eq!(
        delivered,
        published_orders(&db).await.into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(received.iter().filter(|r| r.status == 422).count(), 1);
}

/// The replay rate, for docs/replay.md: 100,000 published events of 1 KiB
/// payloads to Redis and to the HTTP receiver at `--rate unlimited`. Run
/// with a release binary:
/// `OUTBOX_BIN=target/release/outbox cargo nextest run -p outbox-cli --test it --run-ignored only -E 'test(/measure_replay_rate/)' --no-capture`.
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn measure_replay_rate() {
    use outbox_testkit::{Receiver, Respond};
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', 'agg-' || (g % 1000), 'Step', jsonb_build_object('g', g, 'pad', repeat('x', 1000)),
                    clock_timestamp()
               FROM generate_series(1, 100000) g",
        )
        .await
        .unwrap();
    db.client.batch_execute("VACUUM ANALYZE outbox").await.unwrap();
    let redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let bin = std::env::var("OUTBOX_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_outbox").to_owned());
    for to in [redis.url(), receiver.url()] {
        let out = tokio::process::Command::new(&bin)
            .args(["replay", "--to", &to, "--rate", "unlimited"])
            .env("DATABASE_URL", &db.url)
            .env_remove("OUTBOX_CONFIG")
            .output()
            .await
            .unwrap();
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
        let summary = stdout.lines().find(|l| l.contains(" done: ")).unwrap();
        println!("{bin} to {to}: {summary}");
    }
    assert_eq!(receiver.count(), 100_000);
}
