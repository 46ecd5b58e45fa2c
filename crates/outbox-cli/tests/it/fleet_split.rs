//! A busy outbox of a fleet served split (issue 33, item 4): with
//! `fleet_split = true` every fleet process serves it at once, sharing it
//! by the partition leases several relays of one outbox share, while the
//! other outboxes stay whole (one process each). A process serving an
//! outbox whole and processes serving it split never deliver it at once.
//! Real PostgreSQL, real Redis.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use outbox::{Config, Event, Outbox};
use outbox_testkit::{Postgres, Redis, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::fleet::{stop_fleet, tenants, unpublished};
use crate::support::{LONG, StreamEvent, check_first_steps, connect, outbox_cmd, read_stream, wait_until};

const STREAM: &str = "outbox.event.orders";
const BATCH: usize = 10;
const SESSIONS: usize = 4;
/// The partitions of an outbox `outbox migrate` makes.
const PARTITIONS: i64 = 64;

/// A configuration file: the tenants found by pattern, `tenant_0` listed
/// as `big`, split if `split`.
fn config_file(dir: &Path, redis: &Redis, split: bool) -> PathBuf {
    let file = dir.join(if split { "split.toml" } else { "whole.toml" });
    let big = if split {
        "\n[outboxes.big]\nschema = \"tenant_0\"\nfleet_split = true\n"
    } else {
        ""
    };
    std::fs::write(
        &file,
        format!(
            "sink = \"{redis}\"\nschemas = \"tenant_%\"\ndiscover_interval = \"300ms\"\n\
             lease_timeout = \"3s\"\nbatch_size = {BATCH}\nfleet_sessions = {SESSIONS}\n{big}",
            redis = redis.url(),
        ),
    )
    .unwrap();
    file
}

async fn start(pg: &Postgres, app: &str, file: &Path) -> Spawned {
    let mut cmd = outbox_cmd();
    cmd.arg("relay").arg("--config").arg(file).env(
        "DATABASE_URL",
        format!("{}?application_name={app}", pg.url("app_0")),
    );
    let fleet = Spawned::spawn_notified(cmd).unwrap();
    fleet.wait_for_notification("READY=1", LONG).await.unwrap();
    fleet
}

/// Partitions of `tenant_0` per live relay holding any, ascending.
async fn lease_owners(client: &Client) -> Vec<i64> {
    client
        .query(
            "SELECT count(*) FROM tenant_0.outbox_leases AS l JOIN tenant_0.outbox_relays AS r \
                 ON r.relay_id = l.owner GROUP BY l.owner ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The relays with a row in `tenant_0`'s relays table.
async fn relay_rows(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM tenant_0.outbox_relays", &[])
        .await
        .unwrap()
        .get(0)
}

/// The modes in which the control session of `app` holds `tenant_0`'s own
/// lock (`ExclusiveLock` served whole, `ShareLock` split).
async fn own_lock_modes(client: &Client, app: &str) -> Vec<String> {
    client
        .query(
            "SELECT l.mode FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
                AND l.classid::int8 = $1::int8 AND a.application_name = $2 \
                AND l.objid::int8 = (hashtext('tenant_0.outbox') & 2147483647)::int8",
            &[&i64::from(outbox::sql::fleet::OWN_LOCK), &app],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Own locks of any outbox the control session of `app` holds.
async fn own_locks(client: &Client, app: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
                AND l.classid::int8 = $1::int8 AND a.application_name = $2",
            &[&i64::from(outbox::sql::fleet::OWN_LOCK), &app],
        )
        .await
        .unwrap()
        .get(0)
}

/// One writer: `events` events, each its own transaction, four in five to
/// `tenant_0`, on aggregates of its own (`<schema>.w<w>.a<n>`), so their
/// order is the order it committed them. Returns event id → (aggregate,
/// step).
async fn writer(
    url: String,
    configs: Arc<Vec<Config>>,
    w: usize,
    events: usize,
    acked: Arc<AtomicUsize>,
) -> HashMap<String, (String, usize)> {
    let mut client = connect(&url).await;
    let mut written = HashMap::new();
    let mut seq: HashMap<String, usize> = HashMap::new();
    for i in 0..events {
        let t = if i % 5 == 4 {
            1 + i / 5 % (configs.len() - 1)
        } else {
            0
        };
        let config = &configs[t];
        let aggregate = format!("{}.w{w}.a{}", config.schema.as_str(), i % 20);
        let step = seq.entry(aggregate.clone()).or_default();
        let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": *step}));
        *step += 1;
        let tx = client.transaction().await.unwrap();
        let id = Outbox::new(config.clone()).enqueue(&tx, &event).await.unwrap();
        tx.commit().await.unwrap();
        written.insert(id.to_string(), (aggregate, *step - 1));
        acked.fetch_add(1, Ordering::Relaxed);
    }
    written
}

/// Writes `n` events to `tenant_0` on aggregates `tenant_0.s.a<k>`,
/// continuing the steps in `written`.
async fn write_big(client: &Client, written: &mut HashMap<String, (String, usize)>, n: usize) {
    let config = Config::new("tenant_0", "outbox").unwrap();
    for _ in 0..n {
        let k = written.len() % 5;
        let aggregate = format!("tenant_0.s.a{k}");
        let step = written.values().filter(|(a, _)| *a == aggregate).count();
        let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": step}));
        let id = Outbox::new(config.clone()).enqueue(client, &event).await.unwrap();
        written.insert(id.to_string(), (aggregate, step));
    }
}

/// Every event written delivered, none invented; each aggregate's first
/// deliveries in the order written; the `outbox` header names `big` or
/// `tenant_0.outbox` for `tenant_0`'s events (`headers`), the found
/// outbox's label for the others'. Returns the duplicates.
fn check(events: &[StreamEvent], written: &HashMap<String, (String, usize)>, headers: &[&str]) -> usize {
    let ids: HashSet<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    let lost = written.keys().filter(|id| !ids.contains(id.as_str())).count();
    let phantom = ids.iter().filter(|id| !written.contains_key(**id)).count();
    assert_eq!((lost, phantom), (0, 0), "lost, phantom");
    check_first_steps(
        events,
        |id| written[id].clone(),
        |aggregate, header| {
            let schema = aggregate.split('.').next().unwrap();
            let header = header.unwrap_or_default();
            if schema == "tenant_0" {
                headers.contains(&header)
            } else {
                header == format!("{schema}.outbox")
            }
        },
    );
    events.len() - ids.len()
}

/// Two fleet processes serve `tenant_0` split (its partitions half each)
/// and the other tenants whole; writers commit to it mostly; one process
/// is SIGKILLed mid-run and started again. Every event delivered, in
/// order per aggregate, duplicates at most the killed process's batches
/// in flight, and the restarted process gets its half back.
#[tokio::test]
async fn a_split_outbox_is_served_by_both_fleet_processes_through_a_sigkill() {
    const WRITERS: usize = 3;
    const EVENTS: usize = 400;
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = Arc::new(tenants(&pg, "app_0", 4, true).await);
    let dir = tempfile::tempdir().unwrap();
    let file = config_file(dir.path(), &redis, true);
    let a = start(&pg, "fleet_a", &file).await;
    let b = start(&pg, "fleet_b", &file).await;
    let client = pg.connect("app_0").await.unwrap();
    let half = PARTITIONS / 2;
    wait_until("both processes hold half of tenant_0", LONG, || async {
        lease_owners(&client).await == [half, half]
    })
    .await;
    for app in ["fleet_a", "fleet_b"] {
        assert_eq!(own_lock_modes(&client, app).await, ["ShareLock"], "{app}");
    }

    let acked = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            tokio::spawn(writer(
                pg.url("app_0"),
                Arc::clone(&configs),
                w,
                EVENTS,
                Arc::clone(&acked),
            ))
        })
        .collect();
    wait_until("a third of the events written", LONG, || async {
        acked.load(Ordering::Relaxed) >= WRITERS * EVENTS / 3
    })
    .await;
    let mut a = a;
    a.kill().unwrap();
    a.wait(LONG).await.unwrap();
    wait_until("fleet_b holds all of tenant_0", LONG, || async {
        lease_owners(&client).await == [PARTITIONS]
    })
    .await;
    let a = start(&pg, "fleet_a", &file).await;
    let mut written = HashMap::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    assert_eq!(written.len(), WRITERS * EVENTS);
    wait_until("every tenant drained", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    wait_until("the restarted process has its half again", LONG, || async {
        lease_owners(&client).await == [half, half]
    })
    .await;
    stop_fleet(a).await;
    stop_fleet(b).await;
    assert_eq!(relay_rows(&client).await, 0, "split relays leave at SIGTERM");

    let events = read_stream(&redis.url(), STREAM).await;
    let duplicates = check(&events, &written, &["big"]);
    // At most the killed process's batches in flight: two of its split
    // relay's, one per batch session of the pool.
    assert!(duplicates <= (2 + SESSIONS) * BATCH, "{duplicates} duplicates");
    eprintln!("{} events, {duplicates} delivered twice", written.len());
}

/// A process configured to serve `tenant_0` split waits while another
/// serves it whole, takes it when that one is gone; a process configured
/// to serve it whole does not take it from the split one, and takes it
/// once that one was SIGKILLed and its relay's heartbeat went stale. Every
/// event delivered in order throughout.
#[tokio::test]
async fn whole_and_split_processes_never_serve_one_outbox_at_once() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 3, true).await;
    let dir = tempfile::tempdir().unwrap();
    let (whole, split) = (
        config_file(dir.path(), &redis, false),
        config_file(dir.path(), &redis, true),
    );
    let client = pg.connect("app_0").await.unwrap();
    let mut written = HashMap::new();

    let w = start(&pg, "fleet_w", &whole).await;
    wait_until("fleet_w serves every tenant", LONG, || async {
        own_locks(&client, "fleet_w").await == 3
    })
    .await;
    let s = start(&pg, "fleet_s", &split).await;
    // fleet_s balanced (took a tenant fleet_w handed over), and left
    // tenant_0 to fleet_w.
    wait_until("fleet_s serves a whole tenant", LONG, || async {
        own_locks(&client, "fleet_s").await >= 1
    })
    .await;
    assert_eq!(own_lock_modes(&client, "fleet_w").await, ["ExclusiveLock"]);
    assert!(own_lock_modes(&client, "fleet_s").await.is_empty());
    assert_eq!(relay_rows(&client).await, 0, "no split relay while served whole");
    write_big(&client, &mut written, 30).await;
    wait_until("served whole: delivered", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;

    stop_fleet(w).await;
    wait_until("fleet_s serves tenant_0 split", LONG, || async {
        lease_owners(&client).await == [PARTITIONS]
    })
    .await;
    write_big(&client, &mut written, 30).await;
    wait_until("served split: delivered", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;

    let w = start(&pg, "fleet_w", &whole).await;
    wait_until("fleet_w serves a whole tenant again", LONG, || async {
        own_locks(&client, "fleet_w").await >= 1
    })
    .await;
    assert!(
        own_lock_modes(&client, "fleet_w").await.is_empty(),
        "fleet_w took tenant_0 while fleet_s serves it split"
    );
    assert_eq!(own_lock_modes(&client, "fleet_s").await, ["ShareLock"]);

    let mut s = s;
    s.kill().unwrap();
    s.wait(LONG).await.unwrap();
    write_big(&client, &mut written, 30).await;
    wait_until("fleet_w serves tenant_0 whole", LONG, || async {
        own_lock_modes(&client, "fleet_w").await == ["ExclusiveLock"]
    })
    .await;
    wait_until("served whole again: delivered", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    stop_fleet(w).await;

    let events = read_stream(&redis.url(), STREAM).await;
    check(&events, &written, &["big", "tenant_0.outbox"]);
    let by = |h: &str| events.iter().filter(|e| e.outbox.as_deref() == Some(h)).count();
    assert!(by("big") >= 30, "the split process delivered the second 30");
    assert!(by("tenant_0.outbox") >= 60, "the whole one the first and last 30");
}

/// A relay run for `tenant_0` alone (partition leases, no fleet) is
/// waited for: a fleet process takes `tenant_0` whole only once that relay
/// stopped beating, so the two never deliver it at once.
#[tokio::test]
async fn a_fleet_takes_an_outbox_whole_only_once_its_own_relay_is_gone() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 2, true).await;
    let dir = tempfile::tempdir().unwrap();
    let whole = config_file(dir.path(), &redis, false);
    let client = pg.connect("app_0").await.unwrap();
    let mut written = HashMap::new();

    let alone = crate::support::start_relay(
        &pg.url("app_0"),
        &redis.url(),
        &["--schema", "tenant_0", "--lease-timeout", "3s"],
        &[],
    )
    .await;
    let fleet = start(&pg, "fleet_w", &whole).await;
    fleet
        .wait_for_notification("OUTBOX_FLEET=takeover-waiting", LONG)
        .await
        .unwrap();
    // Its lock is the fleet's, yet it waits for the relay.
    assert_eq!(own_lock_modes(&client, "fleet_w").await, ["ExclusiveLock"]);
    write_big(&client, &mut written, 20).await;
    wait_until("delivered by the relay alone", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    let before = read_stream(&redis.url(), STREAM).await;
    assert_eq!(before.len(), 20);
    assert!(
        before.iter().all(|e| e.outbox.is_none()),
        "the fleet delivered tenant_0 while its own relay served it"
    );

    stop_fleet_relay(alone).await;
    write_big(&client, &mut written, 20).await;
    wait_until("delivered by the fleet", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    stop_fleet(fleet).await;
    let events = read_stream(&redis.url(), STREAM).await;
    check(&events, &written, &["", "tenant_0.outbox"]);
    assert!(
        events[20..]
            .iter()
            .all(|e| e.outbox.as_deref() == Some("tenant_0.outbox"))
    );
}

/// SIGTERM, and a clean exit.
async fn stop_fleet_relay(mut relay: Spawned) {
    relay.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = relay.wait(LONG).await.unwrap();
    assert_eq!(status.code(), Some(0), "{:#?}", relay.lines());
}
