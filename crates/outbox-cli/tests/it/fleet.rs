//! `outbox relay --schemas` (issue 33): one process serving many tenant
//! outboxes, two processes sharing them by advisory lock, connections per
//! database rather than per outbox. Real PostgreSQL, real Redis.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use nix::sys::signal::Signal;
use outbox::{Config, Event, Outbox};
use outbox_testkit::{Postgres, Receiver, Redis, Respond, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::support::{
    LONG, StreamEvent, check_first_steps, connect, first_delivery_violations, read_stream, start_relay,
    wait_until,
};

const STREAM: &str = "outbox.event.orders";
/// The fairness test's small tenants' stream.
const SMALL_STREAM: &str = "outbox.event.small";
const SESSIONS: usize = 4;
const BATCH: usize = 10;

/// A database of the cluster with `n` migrated tenant outboxes
/// (`tenant_0` … in schemas of their own), created if `create`.
pub(crate) async fn tenants(pg: &Postgres, db: &str, n: usize, create: bool) -> Vec<Config> {
    if create {
        let admin = pg.connect("postgres").await.unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
    }
    let configs: Vec<Config> = (0..n)
        .map(|i| Config::new(&format!("tenant_{i}"), "outbox").unwrap())
        .collect();
    // Four connections migrating a quarter each: 200 migrations take a
    // while one after the other.
    let chunks: Vec<Vec<Config>> = configs
        .chunks(n.div_ceil(4).max(1))
        .map(<[Config]>::to_vec)
        .collect();
    let url = pg.url(db);
    let jobs = chunks.into_iter().map(|chunk| {
        let url = url.clone();
        tokio::spawn(async move {
            let mut client = connect(&url).await;
            for config in chunk {
                migrate_tenant(&mut client, &config).await;
            }
        })
    });
    for job in futures::future::join_all(jobs).await {
        job.unwrap();
    }
    configs
}

pub(crate) async fn migrate_tenant(client: &mut Client, config: &Config) {
    client
        .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", config.schema.quoted()))
        .await
        .unwrap();
    outbox::migrate(client, config).await.unwrap();
}

/// Unpublished rows over `configs` of one database.
pub(crate) async fn unpublished(client: &Client, configs: &[Config]) -> i64 {
    let sql = configs
        .iter()
        .map(|c| {
            format!(
                "SELECT count(*) AS n FROM {} WHERE published_at IS NULL",
                c.qualified()
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    client
        .query_one(
            &format!("SELECT coalesce(sum(n), 0)::int8 FROM ({sql}) AS u"),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Connections of the fleet process named `app` (its `application_name`).
async fn connections(client: &Client, app: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )
        .await
        .unwrap()
        .get(0)
}

/// The control sessions holding outbox locks in the connected database,
/// with how many each holds.
pub(crate) async fn holders(client: &Client) -> Vec<i64> {
    client
        .query(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
              AND classid::int8 = $1::int8 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             GROUP BY pid ORDER BY 1",
            &[&i64::from(outbox::sql::fleet::OWN_LOCK)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

pub(crate) async fn start_fleet(pg: &Postgres, app: &str, redis: &Redis, extra: &[&str]) -> Spawned {
    let url = format!("{}?application_name={app}", pg.url("app_0"));
    let args = [
        &[
            "--schemas",
            "tenant_%",
            "--fleet-sessions",
            "4",
            "--discover-interval",
            "500ms",
        ][..],
        extra,
    ]
    .concat();
    start_relay(&url, &redis.url(), &args, &[]).await
}

pub(crate) async fn stop_fleet(mut fleet: Spawned) -> Vec<String> {
    fleet.signal(Signal::SIGTERM).unwrap();
    let status = fleet.wait(LONG).await.unwrap();
    assert_eq!(status.code(), Some(0), "fleet exit; lines: {:#?}", fleet.lines());
    assert_eq!(fleet.count_lines("fleet stopped"), 1);
    fleet.lines()
}

/// One writer: `events` events, each its own transaction, to tenants
/// picked in a scattered order; aggregates are its own (`w<n>`), so their
/// order is the order it committed them.
async fn writer(
    pg: String,
    dbs: Arc<Vec<(String, Vec<Config>)>>,
    w: usize,
    events: usize,
    acked: Arc<AtomicUsize>,
) -> HashMap<String, (String, usize)> {
    let mut clients = Vec::new();
    for (db, _) in dbs.iter() {
        clients.push(connect(&format!("{pg}/{db}")).await);
    }
    let mut written = HashMap::new();
    let mut seq: HashMap<String, usize> = HashMap::new();
    for i in 0..events {
        let d = (w * 31 + i * 7) % dbs.len();
        let configs = &dbs[d].1;
        let t = (w * 7919 + i * 104_729) % configs.len();
        let config = &configs[t];
        let aggregate = format!("{}.{}.w{w}.a{}", dbs[d].0, config.schema.as_str(), i % 3);
        let step = seq.entry(aggregate.clone()).or_default();
        let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": *step}));
        *step += 1;
        let client = &mut clients[d];
        let tx = client.transaction().await.unwrap();
        let id = Outbox::new(config.clone()).enqueue(&tx, &event).await.unwrap();
        tx.commit().await.unwrap();
        written.insert(id.to_string(), (aggregate, *step - 1));
        acked.fetch_add(1, Ordering::Relaxed);
    }
    written
}

/// 200 tenant schemas in one database and four more databases of a few
/// tenants each, served by two fleet processes; writers commit to tenants
/// all over; one process is SIGKILLed mid-run and started again. Every
/// event delivered, none invented, none overtaken by a later one of its
/// aggregate (first deliveries); duplicates at most the killed process's
/// batches in flight; each process within its connection bound; and the
/// restarted process gets its share back.
#[tokio::test]
async fn two_fleet_processes_serve_200_tenants_in_5_databases_through_a_sigkill() {
    const TENANTS: usize = 200;
    const DATABASES: usize = 5;
    const WRITERS: usize = 4;
    const EVENTS: usize = 500;
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let mut dbs = Vec::new();
    for d in 0..DATABASES {
        let name = format!("app_{d}");
        let n = if d == 0 { TENANTS } else { 4 };
        dbs.push((name.clone(), tenants(&pg, &name, n, true).await));
    }
    let dbs = Arc::new(dbs);
    let extra = ["--databases", "app_%", "--batch-size", "10"];
    let a = start_fleet(&pg, "fleet_a", &redis, &extra).await;
    let b = start_fleet(&pg, "fleet_b", &redis, &extra).await;
    let first = pg.connect("app_0").await.unwrap();
    // Both have joined and share the 200 outboxes of app_0.
    wait_until("both processes serve app_0's outboxes", LONG, || async {
        let h = holders(&first).await;
        h.len() == 2 && h.iter().sum::<i64>() == TENANTS as i64
    })
    .await;

    let acked = Arc::new(AtomicUsize::new(0));
    let base = format!("postgres://postgres@127.0.0.1:{}", pg.port());
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            tokio::spawn(writer(
                base.clone(),
                Arc::clone(&dbs),
                w,
                EVENTS,
                Arc::clone(&acked),
            ))
        })
        .collect();
    // Per process: a control session, a listening session and at most 4
    // batch sessions per database, and one session listing the databases.
    let bound = (DATABASES * (2 + SESSIONS) + 1) as i64;
    wait_until("a third of the events written", LONG, || async {
        acked.load(Ordering::Relaxed) >= WRITERS * EVENTS / 3
    })
    .await;
    for app in ["fleet_a", "fleet_b"] {
        let n = connections(&first, app).await;
        assert!(n >= 1 && n <= bound, "{app}: {n} connections, bound {bound}");
    }
    let mut a = a;
    a.kill().unwrap();
    a.wait(LONG).await.unwrap();
    let a = start_fleet(&pg, "fleet_a", &redis, &extra).await;
    let mut written = HashMap::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    assert_eq!(written.len(), WRITERS * EVENTS);
    for (db, configs) in dbs.iter() {
        let client = pg.connect(db).await.unwrap();
        wait_until(&format!("{db} drained"), LONG, || async {
            unpublished(&client, configs).await == 0
        })
        .await;
    }
    wait_until("the restarted process has its share again", LONG, || async {
        let h = holders(&first).await;
        h.len() == 2 && h.iter().all(|n| *n == (TENANTS / 2) as i64)
    })
    .await;
    for app in ["fleet_a", "fleet_b"] {
        let n = connections(&first, app).await;
        assert!(n >= 1 && n <= bound, "{app}: {n} connections, bound {bound}");
    }
    stop_fleet(a).await;
    stop_fleet(b).await;

    let events = read_stream(&redis.url(), STREAM).await;
    let ids: HashSet<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    let lost = written.keys().filter(|id| !ids.contains(id.as_str())).count();
    let phantom = ids.iter().filter(|id| !written.contains_key(**id)).count();
    assert_eq!((lost, phantom), (0, 0), "lost, phantom");
    assert_eq!(first_delivery_violations(&events), 0, "reordered");
    let duplicates = events.len() - ids.len();
    // At most the killed process's batches in flight: one per batch
    // session of each database.
    assert!(
        duplicates <= DATABASES * SESSIONS * BATCH,
        "{duplicates} duplicates"
    );
    eprintln!("{} events, {duplicates} delivered twice", written.len());
    check_steps(&events, &written);
}

/// Each first delivery of an aggregate carries the next step (what
/// `first_delivery_violations` checks by outbox id, here by the writer's
/// own count, across tenants whose ids are separate sequences), and names
/// the outbox it came from.
fn check_steps(events: &[StreamEvent], written: &HashMap<String, (String, usize)>) {
    check_first_steps(
        events,
        |id| written[id].clone(),
        |aggregate, header| {
            // `database.schema.wN.aN`: the fleet names its outbox
            // `database/schema.outbox` in the `outbox` header.
            let mut parts = aggregate.split('.');
            let (db, schema) = (parts.next().unwrap(), parts.next().unwrap());
            header == Some(format!("{db}/{schema}.outbox").as_str())
        },
    );
}

/// A tenant migrated while the fleet runs is served within a few
/// discovery intervals (10 s at most); a dropped one is let go of, and the
/// fleet says nothing worse than that.
#[tokio::test]
async fn a_new_tenant_is_served_within_seconds_and_a_dropped_one_let_go() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 3, true).await;
    let fleet = start_fleet(&pg, "fleet_a", &redis, &[]).await;
    let mut client = pg.connect("app_0").await.unwrap();
    wait_until("the three tenants served", LONG, || async {
        holders(&client).await.iter().sum::<i64>() == 3
    })
    .await;

    let new = Config::new("tenant_new", "outbox").unwrap();
    migrate_tenant(&mut client, &new).await;
    let migrated = std::time::Instant::now();
    Outbox::new(new.clone())
        .enqueue(&client, &Event::new("orders", "new-1", "Created", json!({})))
        .await
        .unwrap();
    wait_until(
        "the new tenant's event delivered",
        Duration::from_secs(10),
        || async { read_stream(&redis.url(), STREAM).await.len() == 1 },
    )
    .await;
    eprintln!(
        "the new tenant served {:?} after its migration",
        migrated.elapsed()
    );

    client
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", configs[1].schema.quoted()))
        .await
        .unwrap();
    wait_until("the dropped tenant let go", LONG, || async {
        holders(&client).await.iter().sum::<i64>() == 3
    })
    .await;
    wait_until("the fleet says so", LONG, || async {
        fleet.count_lines("outbox gone; let go") == 1
    })
    .await;
    // The others are still served.
    Outbox::new(configs[2].clone())
        .enqueue(&client, &Event::new("orders", "t2-1", "Created", json!({})))
        .await
        .unwrap();
    wait_until("a remaining tenant's event delivered", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() == 2
    })
    .await;
    let lines = stop_fleet(fleet).await;
    let bad: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// An outbox's claim is prepared on its batch session once: after DDL
/// that PostgreSQL replans it for (a column added) it goes on; after DDL
/// that changes what it returns (a column's type), its run fails once,
/// the batch is rolled back and retried with the claim prepared again, and
/// the event arrives once.
#[tokio::test]
async fn a_prepared_claim_follows_its_table_through_ddl() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 2, true).await;
    let fleet = start_fleet(&pg, "fleet_a", &redis, &[]).await;
    let client = pg.connect("app_0").await.unwrap();
    wait_until("both tenants served", LONG, || async {
        holders(&client).await.iter().sum::<i64>() == 2
    })
    .await;
    let outbox = Outbox::new(configs[0].clone());
    let table = configs[0].qualified();
    let steps = [
        None,
        Some(format!("ALTER TABLE {table} ADD COLUMN note text")),
        Some(format!(
            "ALTER TABLE {table} ALTER COLUMN event_type TYPE varchar(200)"
        )),
    ];
    for (i, ddl) in steps.iter().enumerate() {
        if let Some(ddl) = ddl {
            client.batch_execute(ddl).await.unwrap();
        }
        outbox
            .enqueue(
                &client,
                &Event::new("orders", format!("a-{i}"), "Created", json!({})),
            )
            .await
            .unwrap();
        wait_until("the event delivered", LONG, || async {
            read_stream(&redis.url(), STREAM).await.len() == i + 1
        })
        .await;
    }
    let events = read_stream(&redis.url(), STREAM).await;
    let ids: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(ids, ["a-0", "a-1", "a-2"], "each once, in order");
    let lines = stop_fleet(fleet).await;
    let failed = lines.iter().filter(|l| l.contains("batch failed")).count();
    assert!(failed <= 1, "the changed claim fails once at most: {lines:#?}");
}

/// 200 tenants in one database: one fleet process holds its control
/// session, its listening session and at most --fleet-sessions batch
/// sessions, and an idle fleet's statements do not grow with the tenants.
#[tokio::test]
async fn one_fleet_process_holds_at_most_six_connections_for_200_tenants() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 200, true).await;
    let fleet = start_fleet(&pg, "fleet_a", &redis, &[]).await;
    let client = pg.connect("app_0").await.unwrap();
    wait_until("every tenant served", LONG, || async {
        holders(&client).await.iter().sum::<i64>() == 200
    })
    .await;
    // Every tenant gets events at once: all batch sessions busy.
    for (i, config) in configs.iter().enumerate() {
        let events: Vec<Event> = (0..25)
            .map(|k| Event::new("orders", format!("t{i}"), "Step", json!({"step": k})))
            .collect();
        Outbox::new(config.clone())
            .enqueue_all(&client, &events)
            .await
            .unwrap();
    }
    let most = std::sync::atomic::AtomicI64::new(0);
    wait_until("every event delivered", LONG, || async {
        most.fetch_max(connections(&client, "fleet_a").await, Ordering::Relaxed);
        unpublished(&client, &configs).await == 0
    })
    .await;
    let most = most.into_inner();
    assert!(most >= 3, "batch sessions were used: {most}");
    assert!(
        most <= (2 + SESSIONS) as i64,
        "{most} connections for 200 tenants"
    );
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 200 * 25);
    stop_fleet(fleet).await;
}

/// An outbox taken over while the previous owner's batch is at the sink is
/// not claimed by the new owner until that batch has ended (the barrier).
/// Fleet A (a role of its own) has a batch at a receiver that holds it;
/// the role loses LOGIN and A's control session is ended, so A cannot come
/// back. Fleet B takes the outbox's lock and waits, claiming nothing, until
/// A's batch was answered and committed; then it delivers the rest, in
/// order after A's.
#[tokio::test]
async fn a_takeover_waits_for_the_previous_owners_batch() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 1, true).await;
    let client = pg.connect("app_0").await.unwrap();
    client
        .batch_execute("CREATE ROLE fleet_a LOGIN SUPERUSER")
        .await
        .unwrap();
    let events: Vec<Event> = (0..20)
        .map(|k| Event::new("orders", "a-1", "Step", json!({"step": k})))
        .collect();
    Outbox::new(configs[0].clone())
        .enqueue_all(&client, &events)
        .await
        .unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.hold();
    let url_a = format!(
        "postgres://fleet_a@127.0.0.1:{}/app_0?application_name=fleet_a",
        pg.port()
    );
    let args = [
        "--schemas",
        "tenant_%",
        "--batch-size",
        "5",
        "--discover-interval",
        "200ms",
    ];
    let a = start_relay(&url_a, &receiver.url(), &args, &[]).await;
    receiver.wait_for_count(1, LONG).await.unwrap();

    client.batch_execute("ALTER ROLE fleet_a NOLOGIN").await.unwrap();
    let own = i64::from(outbox::sql::fleet::OWN_LOCK);
    let ended: i64 = client
        .query_one(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_locks \
              WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::int8 = $1::int8",
            &[&own],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ended, 1, "A's control session");
    let b = start_fleet(&pg, "fleet_b", &redis, &[]).await;
    b.wait_for_notification("OUTBOX_FLEET=takeover-waiting", LONG)
        .await
        .unwrap();
    let holder: String = client
        .query_one(
            "SELECT a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) \
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid::int8 = $1::int8",
            &[&own],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, "fleet_b", "B holds the outbox's lock");
    assert_eq!(
        read_stream(&redis.url(), STREAM).await.len(),
        0,
        "B claimed nothing while A's batch is at the sink"
    );
    receiver.release();
    wait_until("every event delivered", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    let by_a: Vec<i64> = receiver
        .received()
        .iter()
        .map(|p| p.body["payload"]["step"].as_i64().unwrap())
        .collect();
    assert_eq!(by_a, (0..5).collect::<Vec<i64>>(), "A's batch, once");
    let by_b = read_stream(&redis.url(), STREAM).await;
    assert_eq!(by_b.len(), 15, "B delivered the rest, once");
    assert_eq!(first_delivery_violations(&by_b), 0);
    stop_fleet(b).await;
    let mut a = a;
    a.signal(Signal::SIGTERM).unwrap();
    a.wait(LONG).await.unwrap();
}

/// The fence a batch runs before its claim passes while the control
/// session it names lives, and fails once that session is gone, even for
/// a session that draws a tag afterwards: tags are drawn among keys no
/// live session holds.
#[tokio::test]
async fn a_batch_fence_passes_only_while_its_control_session_holds_its_tag() {
    use outbox::sql::fleet;
    let pg = Postgres::start().await.unwrap();
    let control = pg.connect("postgres").await.unwrap();
    let other = pg.connect("postgres").await.unwrap();
    let batch = pg.connect("postgres").await.unwrap();
    let tag = fleet::take_tag(&control).await.unwrap();
    let other_tag = fleet::take_tag(&other).await.unwrap();
    assert!(tag > 0 && other_tag > 0);
    assert_ne!(tag, other_tag, "one tag per live session");
    let fenced = |tag: i32| {
        let batch = &batch;
        async move {
            batch.batch_execute("BEGIN").await.unwrap();
            let passed = fleet::fence(batch, 7, tag).await.unwrap();
            batch.batch_execute("ROLLBACK").await.unwrap();
            passed
        }
    };
    assert!(fenced(tag).await, "the control session holds its tag");

    // The barrier of a process taking the outbox over holds the batch
    // lock exclusively for a moment: a fence then fails too.
    other
        .execute("SELECT pg_advisory_lock($1, 7)", &[&fleet::BATCH_LOCK])
        .await
        .unwrap();
    assert!(!fenced(tag).await, "the batch lock is taken exclusively");
    other
        .execute("SELECT pg_advisory_unlock($1, 7)", &[&fleet::BATCH_LOCK])
        .await
        .unwrap();
    assert!(fenced(tag).await);

    let admin = pg.connect("postgres").await.unwrap();
    let (pid, _) = outbox::sql::backend_identity(&control).await.unwrap();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    wait_until("the control session gone", LONG, || async {
        let rows = admin
            .query("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .unwrap();
        rows.is_empty()
    })
    .await;
    assert!(!fenced(tag).await, "its tag went with the control session");
}

/// Fairness: one tenant with a backlog of 100,000 events and 50 tenants
/// writing 5 events/s each. The 50 are served in turn with the backlog, a
/// batch each, instead of after it: every one of their events is delivered
/// while the backlog still has rows left. Their commit-to-stream latency
/// is printed (the bound is the bench's business, not a test's).
#[tokio::test]
async fn fifty_small_tenants_are_served_while_a_100k_backlog_drains() {
    const SMALL: usize = 50;
    const EACH: usize = 20;
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", SMALL + 1, true).await;
    let (big, small) = configs.split_first().unwrap();
    let client = pg.connect("app_0").await.unwrap();
    client
        .batch_execute(&format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'orders', 'big-' || (g % 100), 'Step', jsonb_build_object('step', g) \
               FROM generate_series(1, 100000) AS g",
            big.qualified()
        ))
        .await
        .unwrap();
    let fleet = start_fleet(&pg, "fleet_a", &redis, &["--batch-size", "100"]).await;
    wait_until("the backlog is being drained", LONG, || async {
        unpublished(&client, std::slice::from_ref(big)).await < 100_000
    })
    .await;
    // 5 events/s per small tenant: a round of one event each every 200 ms.
    let mut written: HashMap<String, std::time::SystemTime> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    for round in 0..EACH {
        tick.tick().await;
        for (i, config) in small.iter().enumerate() {
            // A stream of their own: the backlog's is 100,000 entries long.
            let event = Event::new("small", format!("small-{i}"), "Step", json!({"step": round}));
            let id = Outbox::new(config.clone())
                .enqueue(&client, &event)
                .await
                .unwrap();
            written.insert(id.to_string(), std::time::SystemTime::now());
        }
    }
    let small_delivered = || async {
        let ids: HashSet<String> = read_stream(&redis.url(), SMALL_STREAM)
            .await
            .into_iter()
            .map(|e| e.event_id)
            .collect();
        written.keys().filter(|id| ids.contains(*id)).count()
    };
    wait_until("every small tenant's event delivered", LONG, || async {
        small_delivered().await == SMALL * EACH
    })
    .await;
    let left = unpublished(&client, std::slice::from_ref(big)).await;
    assert!(
        left > 0,
        "the backlog drained before the small tenants were served"
    );
    eprintln!(
        "small tenants: p99 {:?} commit to stream, with {left} of 100,000 backlog events left",
        small_latency_p99(&redis.url(), &written).await
    );
    stop_fleet(fleet).await;
}

/// The 99th percentile of commit-to-stream time of `written`, by the
/// stream entry's id (Redis's clock, milliseconds).
async fn small_latency_p99(redis_url: &str, written: &HashMap<String, std::time::SystemTime>) -> Duration {
    use redis::AsyncCommands;
    let client = redis::Client::open(redis_url).unwrap();
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(LONG));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    let reply: redis::streams::StreamRangeReply = conn.xrange_all(SMALL_STREAM).await.unwrap();
    let mut latencies: Vec<Duration> = reply
        .ids
        .iter()
        .filter_map(|e| {
            let id: String = e.get("event_id")?;
            let at = written.get(&id)?;
            let ms: u64 = e.id.split('-').next()?.parse().ok()?;
            let arrived = std::time::UNIX_EPOCH + Duration::from_millis(ms);
            Some(arrived.duration_since(*at).unwrap_or_default())
        })
        .collect();
    latencies.sort();
    latencies
        .get(latencies.len() * 99 / 100)
        .copied()
        .unwrap_or_default()
}

/// A tenant whose outbox the fleet's role may not use is not served (one
/// warning naming the missing grant) while the others are; once granted,
/// the next discovery serves it.
#[tokio::test]
async fn a_tenant_without_grants_is_skipped_until_granted() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 2, true).await;
    let client = pg.connect("app_0").await.unwrap();
    client.batch_execute("CREATE ROLE fleet_r LOGIN").await.unwrap();
    let grant = |schema: &str| {
        let url = pg.url("app_0");
        let schema = schema.to_owned();
        async move {
            let out = crate::support::run_cli(
                &[
                    "migrate", "--grant", "fleet_r", "--as", "relay", "--schema", &schema,
                ],
                &[("DATABASE_URL", &url)],
            )
            .await;
            assert_eq!(
                out.status.code(),
                Some(0),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    grant("tenant_0").await;
    for (i, config) in configs.iter().enumerate() {
        Outbox::new(config.clone())
            .enqueue(
                &client,
                &Event::new("orders", format!("t{i}"), "Created", json!({})),
            )
            .await
            .unwrap();
    }
    let url = format!("postgres://fleet_r@127.0.0.1:{}/app_0", pg.port());
    let fleet = start_relay(
        &url,
        &redis.url(),
        &["--schemas", "tenant_%", "--discover-interval", "200ms"],
        &[],
    )
    .await;
    wait_until("tenant_0's event delivered", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() == 1
    })
    .await;
    assert_eq!(holders(&client).await, [1], "only tenant_0 is served");
    assert_eq!(
        fleet.count_lines("outbox not served: this role lacks privileges on it"),
        1,
        "{:#?}",
        fleet.lines()
    );
    assert!(
        fleet
            .lines()
            .iter()
            .any(|l| l.contains("tenant_1") && l.contains("--grant")),
        "the warning names the outbox and the fix: {:#?}",
        fleet.lines()
    );
    // `config show` lists what the fleet would serve, and why not.
    let shown = crate::support::run_cli(
        &["config", "show", "--schemas", "tenant_%", "--sink", &redis.url()],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert_eq!(
        shown.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("[outboxes] 1 of 2 found would be served"),
        "{shown}"
    );
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("tenant_0.outbox") && l.ends_with("  served")),
        "{shown}"
    );
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("tenant_1.outbox") && l.contains("this role lacks privileges")),
        "{shown}"
    );
    grant("tenant_1").await;
    wait_until("tenant_1's event delivered once granted", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() == 2
    })
    .await;
    stop_fleet(fleet).await;
}

/// `outbox migrate --schemas` makes the outbox in every matching schema
/// (and with `--databases` in every matching database), one transaction
/// each, and says so; run again it changes nothing.
#[tokio::test]
async fn migrate_schemas_makes_every_tenants_outbox_once() {
    let pg = Postgres::start().await.unwrap();
    let admin = pg.connect("postgres").await.unwrap();
    for db in ["app_0", "app_1", "other"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        let client = pg.connect(db).await.unwrap();
        client
            .batch_execute("CREATE SCHEMA tenant_0; CREATE SCHEMA tenant_1; CREATE SCHEMA billing;")
            .await
            .unwrap();
    }
    let url = pg.url("app_0");
    let migrate = |args: &'static [&'static str]| {
        let url = url.clone();
        async move {
            let out = crate::support::run_cli(args, &[("DATABASE_URL", &url)]).await;
            assert_eq!(
                out.status.code(),
                Some(0),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    let out = migrate(&["migrate", "--schemas", "tenant_%"]).await;
    assert!(
        out.ends_with("2 outboxes migrated, 0 already up to date (schema version 11)\n"),
        "{out}"
    );
    assert!(
        out.starts_with("tenant_0.outbox is at schema version 11\ntenant_1.outbox is at schema version 11\n"),
        "{out}"
    );
    let out = migrate(&["migrate", "--schemas", "tenant_%", "--databases", "app_%"]).await;
    assert!(out.starts_with("app_1/"), "app_0's are up to date: {out}");
    assert!(
        out.ends_with("2 outboxes migrated, 2 already up to date (schema version 11)\n"),
        "{out}"
    );
    let out = migrate(&["migrate", "--schemas", "tenant_%", "--databases", "app_%"]).await;
    assert_eq!(
        out,
        "0 outboxes migrated, 4 already up to date (schema version 11)\n"
    );
    for (db, outboxes) in [("app_0", 2), ("app_1", 2), ("other", 0)] {
        let client = pg.connect(db).await.unwrap();
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                  WHERE c.relname = 'outbox' AND c.relkind = 'r'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, outboxes, "{db}");
    }
}

/// PostgreSQL killed (no shutdown: crash recovery on start) under a fleet
/// delivering the events of 20 tenants: its control session and batch
/// sessions come back on their own, every outbox is served again, and
/// every event, those written before and after, is delivered, none
/// reordered, duplicates at most the batches in flight.
#[tokio::test]
async fn a_fleet_comes_back_after_postgres_is_killed_mid_delivery() {
    const TENANTS: usize = 20;
    const EACH: usize = 50;
    let mut pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", TENANTS, true).await;
    let app_url = pg.url("app_0");
    let write = |round: usize| {
        let url = app_url.clone();
        let configs = configs.clone();
        async move {
            let client = connect(&url).await;
            for (t, config) in configs.iter().enumerate() {
                let events: Vec<Event> = (0..EACH)
                    .map(|k| {
                        Event::new(
                            "orders",
                            format!("t{t}-r{round}-a{}", k % 5),
                            "Step",
                            json!({"step": k}),
                        )
                    })
                    .collect();
                Outbox::new(config.clone())
                    .enqueue_all(&client, &events)
                    .await
                    .unwrap();
            }
        }
    };
    write(0).await;
    let fleet = start_fleet(&pg, "fleet_a", &redis, &["--batch-size", "10"]).await;
    wait_until("deliveries under way", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() >= 100
    })
    .await;
    pg.kill().unwrap();
    pg.restart().await.unwrap();
    write(1).await;
    let client = pg.connect("app_0").await.unwrap();
    wait_until("every event delivered after the restart", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    assert_eq!(
        holders(&client).await,
        [TENANTS as i64],
        "every outbox served again"
    );
    assert!(fleet.exit_status().is_none(), "the fleet kept running");
    assert!(
        fleet.count_lines("fleet control session up") >= 2,
        "the control session came back: {:#?}",
        fleet.lines()
    );
    let events = read_stream(&redis.url(), STREAM).await;
    let distinct = events
        .iter()
        .map(|e| e.event_id.as_str())
        .collect::<HashSet<_>>()
        .len();
    assert_eq!(distinct, 2 * TENANTS * EACH, "nothing lost");
    assert!(
        events.len() - distinct <= SESSIONS * 10,
        "{} duplicates",
        events.len() - distinct
    );
    assert_eq!(first_delivery_violations(&events), 0);
    stop_fleet(fleet).await;
}

/// SIGTERM while a fleet delivers the backlogs of 20 tenants: every batch
/// in flight is committed before the process exits, so what Redis holds is
/// exactly what is marked published, and a fleet started again finishes
/// with no event delivered twice.
#[tokio::test]
async fn sigterm_commits_every_batch_in_flight_of_every_outbox() {
    const TENANTS: usize = 20;
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", TENANTS, true).await;
    let client = pg.connect("app_0").await.unwrap();
    for (t, config) in configs.iter().enumerate() {
        let events: Vec<Event> = (0..500)
            .map(|k| Event::new("orders", format!("t{t}-a{}", k % 5), "Step", json!({"step": k})))
            .collect();
        Outbox::new(config.clone())
            .enqueue_all(&client, &events)
            .await
            .unwrap();
    }
    let total = (TENANTS * 500) as i64;
    let args = ["--batch-size", "10"];
    let fleet = start_fleet(&pg, "fleet_a", &redis, &args).await;
    wait_until("deliveries under way", LONG, || async {
        unpublished(&client, &configs).await < total - 500
    })
    .await;
    stop_fleet(fleet).await;
    let published = total - unpublished(&client, &configs).await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert!(published < total, "stopped before the end");
    assert_eq!(
        events.len() as i64,
        published,
        "delivered = published: no batch left unmarked"
    );
    let fleet = start_fleet(&pg, "fleet_a", &redis, &args).await;
    wait_until("the rest delivered", LONG, || async {
        unpublished(&client, &configs).await == 0
    })
    .await;
    stop_fleet(fleet).await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(events.len() as i64, total, "each event once");
    assert_eq!(first_delivery_violations(&events), 0);
}

/// Two fleets serving different outboxes of one database (other schema
/// patterns) do not count each other as members: each serves all of its
/// own.
#[tokio::test]
async fn fleets_of_different_patterns_in_one_database_each_serve_all_of_theirs() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    tenants(&pg, "app_0", 3, true).await;
    let mut client = pg.connect("app_0").await.unwrap();
    for schema in ["billing_0", "billing_1", "billing_2"] {
        migrate_tenant(&mut client, &Config::new(schema, "outbox").unwrap()).await;
    }
    let tenants_fleet = start_fleet(&pg, "fleet_t", &redis, &[]).await;
    let url = format!("{}?application_name=fleet_b", pg.url("app_0"));
    let billing_fleet = start_relay(
        &url,
        &redis.url(),
        &["--schemas", "billing_%", "--discover-interval", "500ms"],
        &[],
    )
    .await;
    wait_until("each fleet serves its three outboxes", LONG, || async {
        holders(&client).await == [3, 3]
    })
    .await;
    stop_fleet(tenants_fleet).await;
    stop_fleet(billing_fleet).await;
}

/// A fleet checks PostgreSQL at startup as a single relay does: a server
/// that does not answer within --connect-timeout is exit 1, a database
/// that does not exist exit 2, each with the reason; settings a fleet
/// cannot serve are exit 2 naming them.
#[tokio::test]
async fn a_fleet_that_cannot_start_says_why_with_the_documented_exit_code() {
    let pg = Postgres::start().await.unwrap();
    let run = |url: String, extra: &'static [&'static str]| async move {
        let mut args = vec![
            "--connect-timeout",
            "1s",
            "relay",
            "--schemas",
            "tenant_%",
            "--sink",
            "redis://127.0.0.1:1",
        ];
        args.extend_from_slice(extra);
        let out = crate::support::run_cli(&args, &[("DATABASE_URL", &url)]).await;
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = run(crate::support::unreachable_postgres(), &[]).await;
    assert_eq!(code, Some(1), "{stderr}");
    let (code, stderr) = run(pg.url("no_such_database"), &[]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no_such_database"), "{stderr}");
    let (code, stderr) = run(pg.url("postgres"), &["--claim", "deadline"]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--claim deadline"), "{stderr}");
    let (code, stderr) = run(pg.url("postgres"), &["--source", "wal", "--fleet-split"]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--fleet-split"), "{stderr}");
    // Splitting is a fleet's: a relay of one outbox refuses it.
    let out = crate::support::run_cli(
        &["relay", "--sink", "redis://127.0.0.1:1", "--fleet-split"],
        &[("DATABASE_URL", &pg.url("postgres"))],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--fleet-split applies to a fleet"), "{stderr}");
    // A listed outbox without a schema, or with a key no relay takes.
    let dir = tempfile::tempdir().unwrap();
    for (text, expected, line) in [
        (
            "[outboxes.acme]\nbatch_size = 3\n",
            "[outboxes.acme] needs schema",
            ":1",
        ),
        (
            "[outboxes.acme]\nschema = \"acme\"\nbatch_sise = 3\n",
            "batch_sise",
            ":3",
        ),
    ] {
        let file = dir.path().join("fleet.toml");
        std::fs::write(&file, text).unwrap();
        let out = crate::support::run_cli(
            &[
                "relay",
                "--sink",
                "redis://127.0.0.1:1",
                "--config",
                file.to_str().unwrap(),
            ],
            &[("DATABASE_URL", &pg.url("postgres"))],
        )
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(expected) && stderr.contains(line),
            "{expected}: {stderr}"
        );
    }
}

/// `[outboxes.NAME]` tables list outboxes by name, each with settings of
/// its own over the file's: `acme` (its own HTTP sink, batch size 3) beside
/// the tenants the pattern finds (to Redis), and `beta` in another
/// database. `config show` lists each with where its settings came from.
#[tokio::test]
async fn listed_outboxes_take_settings_of_their_own_beside_the_found_ones() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let found = tenants(&pg, "app_0", 2, true).await;
    let mut client = pg.connect("app_0").await.unwrap();
    let acme = Config::new("acme", "outbox").unwrap();
    migrate_tenant(&mut client, &acme).await;
    let beta = tenants(&pg, "other", 1, true).await.remove(0);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fleet.toml");
    std::fs::write(
        &file,
        format!(
            "sink = \"{redis}\"\nschemas = \"tenant_%\"\ndiscover_interval = \"200ms\"\n\n\
             [outboxes.acme]\nschema = \"acme\"\nsink = \"{http}\"\nbatch_size = 3\n\n\
             [outboxes.beta]\nschema = \"tenant_0\"\ndatabase_url = \"{other}\"\n",
            redis = redis.url(),
            http = receiver.url(),
            other = pg.url("other"),
        ),
    )
    .unwrap();
    for config in found.iter().chain([&acme]) {
        let events: Vec<Event> = (0..7)
            .map(|k| Event::new("orders", config.schema.as_str(), "Step", json!({"step": k})))
            .collect();
        Outbox::new(config.clone())
            .enqueue_all(&client, &events)
            .await
            .unwrap();
    }
    let other = pg.connect("other").await.unwrap();
    Outbox::new(beta.clone())
        .enqueue(&other, &Event::new("orders", "beta", "Created", json!({})))
        .await
        .unwrap();
    let config = file.to_str().unwrap();
    let url = pg.url("app_0");
    let shown = crate::support::run_cli(
        &["config", "show", "--json", "--config", config],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert_eq!(
        shown.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["listed"]["acme"]["batch_size"]["value"], "3", "{shown:#}");
    assert!(
        shown["listed"]["acme"]["batch_size"]["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("file ") && s.ends_with(":8")),
        "{shown:#}"
    );
    let listed: Vec<(&str, bool)> = shown["outboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["outbox"].as_str().unwrap(), o["problem"].is_null()))
        .collect();
    assert_eq!(
        listed,
        [
            ("tenant_0.outbox", true),
            ("tenant_1.outbox", true),
            ("acme (acme.outbox)", true),
            ("beta (tenant_0.outbox)", true)
        ]
    );

    let mut cmd = crate::support::outbox_cmd();
    cmd.args(["relay", "--config", config]).env("DATABASE_URL", &url);
    let fleet = Spawned::spawn_notified(cmd).unwrap();
    fleet.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("the found tenants' and beta's events in Redis", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() == 2 * 7 + 1
    })
    .await;
    receiver.wait_for_count(7, LONG).await.unwrap();
    let to_http: HashSet<String> = receiver
        .received()
        .iter()
        .map(|p| p.body["aggregate_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        to_http,
        HashSet::from(["acme".to_owned()]),
        "only acme's events over HTTP"
    );
    wait_until("everything published", LONG, || async {
        unpublished(&client, &found).await == 0
            && unpublished(&client, std::slice::from_ref(&acme)).await == 0
    })
    .await;
    stop_fleet(fleet).await;
}

/// A fleet's `/metrics` has each served outbox's backlog, dead letters and
/// oldest age (all aggregate types in one series), read by its one scan
/// statement per poll, and `/readyz` answers for the fleet.
#[tokio::test]
async fn each_served_outbox_has_its_backlog_gauges() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 2, true).await;
    let client = pg.connect("app_0").await.unwrap();
    // tenant_0: 3 rows waiting an hour for a retry, 1 dead letter;
    // tenant_1: nothing.
    client
        .batch_execute(
            "INSERT INTO tenant_0.outbox (aggregate_type, aggregate_id, event_type, payload, next_attempt_at, created_at) \
             SELECT 'orders', 'a' || g, 'E', '{}', now() + interval '1 hour', now() - interval '1 minute' \
               FROM generate_series(1, 3) AS g; \
             INSERT INTO tenant_0.outbox (aggregate_type, aggregate_id, event_type, payload, dead_at, attempts, last_error) \
             VALUES ('orders', 'd', 'E', '{}', now(), 5, 'x');",
        )
        .await
        .unwrap();
    let addr = crate::metrics::http_addr();
    let fleet = start_fleet(
        &pg,
        "fleet_a",
        &redis,
        &["--http", &addr, "--poll-interval", "200ms"],
    )
    .await;
    let gauge = |outbox: &'static str, metric: &'static str| {
        let addr = addr.clone();
        async move {
            let (_, scrape) = crate::metrics::scrape(&addr).await;
            crate::metrics::value(&scrape, metric, &[("outbox", outbox), ("aggregate_type", "")])
        }
    };
    wait_until("tenant_0's backlog gauge", LONG, || async {
        gauge("tenant_0.outbox", "outbox_backlog_events").await == Some(3.0)
    })
    .await;
    assert_eq!(gauge("tenant_0.outbox", "outbox_dead_letters").await, Some(1.0));
    let age = gauge("tenant_0.outbox", "outbox_oldest_unpublished_age_seconds")
        .await
        .unwrap();
    assert!(age >= 60.0, "a minute old: {age}");
    assert_eq!(gauge("tenant_1.outbox", "outbox_backlog_events").await, Some(0.0));
    let (status, body) = crate::metrics::get(&addr, "/readyz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    drop(configs);
    stop_fleet(fleet).await;
}
