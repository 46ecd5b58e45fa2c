//! Shared test plumbing: a migrated database, the `outbox` binary, waiting on
//! state with a timeout.

use std::future::Future;
use std::process::Output;
use std::time::{Duration, Instant};

use outbox::{Config, Event, Outbox};
use outbox_testkit::{Postgres, Spawned};
use serde_json::json;
use tokio_postgres::Client;

pub const LONG: Duration = Duration::from_secs(60);

/// A throwaway cluster with a fresh, migrated database.
pub struct Db {
    pub pg: Postgres,
    pub url: String,
    pub client: Client,
}

impl Db {
    pub async fn start() -> Db {
        let pg = Postgres::start().await.expect("start postgres");
        let url = pg.fresh_database().await.expect("create database");
        let mut client = connect(&url).await;
        outbox::migrate(&mut client, &Config::default())
            .await
            .expect("migrate");
        Db { pg, url, client }
    }

    /// Reconnects after the server was restarted.
    pub async fn reconnect(&mut self) {
        self.client = connect(&self.url).await;
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    pub async fn unpublished(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await
    }

    /// Waits until no row is left unpublished; `what` names the wait in
    /// the timeout's panic.
    pub async fn wait_drained(&self, what: &str) {
        wait_until(what, LONG, || async { self.unpublished().await == 0 }).await;
    }

    /// Inserts `n` events, `per_aggregate` per aggregate, aggregates interleaved.
    pub async fn insert_events(&mut self, n: usize, per_aggregate: usize) {
        let aggregates = n.div_ceil(per_aggregate);
        let events: Vec<Event> = (0..n)
            .map(|i| {
                let agg = i % aggregates;
                let seq = i / aggregates;
                Event::new(
                    "orders",
                    format!("order-{agg}"),
                    format!("Step{seq}"),
                    json!({"agg": agg, "seq": seq}),
                )
            })
            .collect();
        let outbox = Outbox::default();
        for chunk in events.chunks(1000) {
            let tx = self.client.transaction().await.unwrap();
            outbox.enqueue_all(&tx, chunk).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
}

pub async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
}

/// The `outbox` binary with a clean environment (no inherited OUTBOX_*,
/// DATABASE_URL or NOTIFY_SOCKET).
pub fn outbox_cmd() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"));
    for (key, _) in std::env::vars() {
        if key.starts_with("OUTBOX_") || ["DATABASE_URL", "RUST_LOG", "NOTIFY_SOCKET"].contains(&key.as_str())
        {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUST_LOG", "info,outbox_relay=debug");
    cmd.kill_on_drop(true);
    cmd
}

/// Runs the CLI to completion.
pub async fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = outbox_cmd();
    cmd.args(args).envs(envs.iter().copied());
    tokio::time::timeout(LONG, cmd.output())
        .await
        .expect("outbox command timed out")
        .expect("run outbox")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Starts `outbox relay` with a `NOTIFY_SOCKET` and waits for `READY=1`.
pub async fn start_relay(url: &str, sink: &str, extra: &[&str], envs: &[(&str, &str)]) -> Spawned {
    let mut cmd = outbox_cmd();
    cmd.arg("relay")
        .arg("--sink")
        .arg(sink)
        .args(extra)
        .env("DATABASE_URL", url);
    cmd.envs(envs.iter().copied());
    let relay = Spawned::spawn_notified(cmd).expect("spawn relay");
    relay
        .wait_for_notification("READY=1", LONG)
        .await
        .expect("relay ready");
    relay
}

/// Starts `outbox relay` parked between its first delivery and its mark
/// (`OUTBOX_FAILPOINT=pause-after-deliver`), and waits until it got there.
pub async fn start_relay_paused(url: &str, sink: &str, extra: &[&str]) -> Spawned {
    let relay = start_relay(url, sink, extra, &[("OUTBOX_FAILPOINT", "pause-after-deliver")]).await;
    relay
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-deliver reached", LONG)
        .await
        .unwrap();
    relay
}

/// Polls `check` every 20 ms until it is true; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops a relay with SIGTERM and asserts the documented exit code 0 and
/// one `relay stopped`; returns everything the relay printed.
pub async fn stop_relay(mut relay: Spawned) -> Vec<String> {
    relay.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = relay.wait(LONG).await.unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "relay exit status; lines: {:#?}",
        relay.lines()
    );
    assert_eq!(relay.count_lines("relay stopped"), 1);
    relay.lines()
}

/// A connection string nothing answers on (a free port).
pub fn unreachable_postgres() -> String {
    format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        outbox_testkit::free_port()
    )
}

/// `outbox relay <extra>` against a PostgreSQL nothing answers on, giving
/// up after 1 s: the startup retries, then exit 1.
pub async fn relay_without_postgres(extra: &[&str], envs: &[(&str, &str)]) -> Output {
    let url = unreachable_postgres();
    let mut args = vec![
        "relay",
        "--sink",
        "redis://127.0.0.1:1",
        "--connect-timeout",
        "1s",
    ];
    args.extend_from_slice(extra);
    let mut env = vec![("DATABASE_URL", url.as_str())];
    env.extend_from_slice(envs);
    run_cli(&args, &env).await
}

/// One entry of an `outbox.event.*` stream.
#[derive(Debug, Clone)]
pub struct StreamEvent {
    pub event_id: String,
    pub aggregate_id: String,
    pub outbox_id: i64,
    /// The `outbox` header a fleet sets (from the entry's `headers` field).
    pub outbox: Option<String>,
}

/// Every entry of `stream`, in stream order.
pub async fn read_stream(redis_url: &str, stream: &str) -> Vec<StreamEvent> {
    use redis::AsyncCommands;
    let client = redis::Client::open(redis_url).unwrap();
    // The default reply timeout is short for a stream of tens of thousands
    // of entries on a loaded machine.
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(LONG));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    let reply: redis::streams::StreamRangeReply = conn.xrange_all(stream).await.unwrap();
    reply
        .ids
        .iter()
        .map(|e| StreamEvent {
            event_id: e.get("event_id").unwrap(),
            aggregate_id: e.get("aggregate_id").unwrap(),
            outbox_id: e.get::<String>("outbox_id").unwrap().parse().unwrap(),
            outbox: e.get::<String>("headers").and_then(|h| {
                let h: serde_json::Value = serde_json::from_str(&h).unwrap();
                h["outbox"].as_str().map(str::to_owned)
            }),
        })
        .collect()
}

/// How many different event_ids `events` holds.
pub fn distinct_events(events: &[StreamEvent]) -> usize {
    events
        .iter()
        .map(|e| e.event_id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// Counts per-aggregate order violations: an entry whose outbox id is lower
/// than one already seen for the same aggregate.
pub fn order_violations(events: &[StreamEvent]) -> usize {
    let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    let mut violations = 0;
    for e in events {
        let prev = last.entry(&e.aggregate_id).or_insert(i64::MIN);
        if e.outbox_id < *prev {
            violations += 1;
        }
        *prev = (*prev).max(e.outbox_id);
    }
    violations
}

/// Each aggregate's first deliveries in the order written: `step_of` gives
/// an event id's aggregate and its step (0, 1, … per aggregate, as its
/// writer counted them), and each event's `outbox` header must satisfy
/// `header_ok(aggregate, header)`. For fleets, whose tenants' ids are
/// separate sequences, so `first_delivery_violations` cannot compare them.
pub fn check_first_steps(
    events: &[StreamEvent],
    step_of: impl Fn(&str) -> (String, usize),
    header_ok: impl Fn(&str, Option<&str>) -> bool,
) {
    let mut seen = std::collections::HashSet::new();
    let mut next: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for e in events {
        if !seen.insert(e.event_id.as_str()) {
            continue;
        }
        let (aggregate, step) = step_of(&e.event_id);
        assert!(
            header_ok(&aggregate, e.outbox.as_deref()),
            "{aggregate} came with the outbox header {:?}",
            e.outbox
        );
        let expected = next.entry(aggregate.clone()).or_default();
        assert_eq!(
            step, *expected,
            "{aggregate}: step {step} delivered first when {expected} was next"
        );
        *expected += 1;
    }
}

/// Order violations as a consumer behind an inbox sees them: a re-sent event
/// is dropped there, so only each event's first delivery counts.
pub fn first_delivery_violations(events: &[StreamEvent]) -> usize {
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<StreamEvent> = events
        .iter()
        .filter(|e| seen.insert(e.event_id.clone()))
        .cloned()
        .collect();
    order_violations(&firsts)
}

/// Replay job `id`'s state and sent count, from `outbox_replays`.
pub async fn replay_job(db: &Db, id: i64) -> (String, i64) {
    let row = db
        .client
        .query_one("SELECT state, sent FROM outbox_replays WHERE id = $1", &[&id])
        .await
        .unwrap();
    (row.get(0), row.get(1))
}
