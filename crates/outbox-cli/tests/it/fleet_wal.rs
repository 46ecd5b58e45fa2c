//! `outbox relay --source wal --schemas` (issue 33, item 5): one slot and
//! one publication for every tenant outbox of a database, each event
//! routed to its outbox; tenants joining (with rows committed before they
//! were published) and leaving while it runs; a SIGKILL mid-run. Real
//! PostgreSQL with `wal_level = logical`, real Redis.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sys::signal::Signal;
use outbox::{Config, Event, Outbox};
use outbox_testkit::{PgSettings, Postgres, Redis, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::fleet::{migrate_tenant, stop_fleet, tenants};
use crate::metrics::{http_addr, scrape, value};
use crate::support::{
    LONG, StreamEvent, check_first_steps, connect, first_delivery_violations, read_stream,
    relay_without_postgres, run_cli, start_relay, text, wait_until,
};

const STREAM: &str = "outbox.event.orders";
const BATCH: usize = 10;
/// The fleet's publication for `tenant_%` and `outbox`.
const PUBLICATION: &str = "fleet_tenant___outbox";

async fn logical() -> Postgres {
    Postgres::start_with(PgSettings::default().set("wal_level", "logical"))
        .await
        .expect("start postgres")
}

/// `outbox relay --source wal --schemas 'tenant_%'` on database `app_0`.
async fn start_wal_fleet(pg: &Postgres, app: &str, redis: &Redis, extra: &[&str]) -> Spawned {
    let url = format!("{}?application_name={app}", pg.url("app_0"));
    let batch = BATCH.to_string();
    let args = [
        &[
            "--source",
            "wal",
            "--schemas",
            "tenant_%",
            "--discover-interval",
            "500ms",
            "--batch-size",
            batch.as_str(),
        ][..],
        extra,
    ]
    .concat();
    start_relay(&url, &redis.url(), &args, &[]).await
}

/// Rows left in the tenants' tables: with `--wal-cleanup delete`, what is
/// not known delivered yet.
async fn left(client: &Client, configs: &[Config]) -> i64 {
    let sql = configs
        .iter()
        .map(|c| format!("SELECT count(*) AS n FROM {}", c.qualified()))
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

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.expect(sql).get(0)
}

/// Whether the fleet streams the slot.
async fn streaming(client: &Client) -> bool {
    count(client, "SELECT count(*) FROM pg_replication_slots WHERE active").await == 1
}

/// What each event was written as: its tenant's index, its aggregate and
/// its step in that aggregate.
type Written = HashMap<String, (usize, String, usize)>;

/// One writer: `events` events, one transaction each, to tenants picked in
/// a scattered order; aggregates are its own per tenant, so their order is
/// the order it committed them.
async fn writer(
    url: String,
    configs: Arc<Vec<Config>>,
    w: usize,
    events: usize,
    acked: Arc<AtomicUsize>,
) -> Written {
    let mut client = connect(&url).await;
    let mut written = HashMap::new();
    let mut steps: HashMap<String, usize> = HashMap::new();
    for i in 0..events {
        let t = (w * 7919 + i * 104_729) % configs.len();
        let aggregate = format!("{}.w{w}.a{}", configs[t].schema.as_str(), i % 3);
        let step = steps.entry(aggregate.clone()).or_default();
        let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": *step}));
        *step += 1;
        let tx = client.transaction().await.unwrap();
        let id = Outbox::new(configs[t].clone())
            .enqueue(&tx, &event)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        written.insert(id.to_string(), (t, aggregate, *step - 1));
        acked.fetch_add(1, Ordering::Relaxed);
    }
    written
}

/// `writers` writers of `events` events each to the tenants of `url`.
fn spawn_writers(
    (writers, events): (usize, usize),
    url: String,
    configs: &Arc<Vec<Config>>,
    acked: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Written>> {
    (0..writers)
        .map(|w| {
            tokio::spawn(writer(
                url.clone(),
                Arc::clone(configs),
                w,
                events,
                Arc::clone(acked),
            ))
        })
        .collect()
}

/// Every written event delivered, none invented, each aggregate's first
/// deliveries in step order, each naming its outbox. Returns the
/// duplicates.
fn check(events: &[StreamEvent], written: &Written) -> usize {
    let ids: HashSet<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    let lost = written.keys().filter(|id| !ids.contains(id.as_str())).count();
    let phantom = ids.iter().filter(|id| !written.contains_key(**id)).count();
    assert_eq!((lost, phantom), (0, 0), "lost, phantom");
    assert_eq!(first_delivery_violations(events), 0, "reordered by outbox id");
    check_first_steps(
        events,
        |id| {
            let (_, aggregate, step) = &written[id];
            (aggregate.clone(), *step)
        },
        |aggregate, header| {
            // `schema.wN.aN`: the fleet names the outbox in the `outbox`
            // header (`database/schema.outbox` across databases).
            let label = format!("{}.outbox", aggregate.split('.').next().unwrap());
            header.is_some_and(|o| o == label || o.ends_with(&format!("/{label}")))
        },
    );
    events.len() - ids.len()
}

/// 20 tenants, 5 of which hold rows written before the fleet (and its
/// slot) existed; 4 writers commit to tenants all over. Every event is
/// delivered once, in order per aggregate, and booked under its own
/// outbox's label; the database has one slot and one publication of the
/// 20 tables; the slot's retained WAL is a gauge labelled with the
/// database.
#[tokio::test]
async fn twenty_tenants_share_one_slot_and_each_event_reaches_its_outbox() {
    const TENANTS: usize = 20;
    const WRITERS: usize = 4;
    const EVENTS: usize = 250;
    const BEFORE: usize = 6;
    let pg = logical().await;
    let redis = Redis::start().await.unwrap();
    let configs = Arc::new(tenants(&pg, "app_0", TENANTS, true).await);
    let client = pg.connect("app_0").await.unwrap();
    let mut written = Written::new();
    for (t, config) in configs.iter().enumerate().take(5) {
        for step in 0..BEFORE {
            let aggregate = format!("{}.before", config.schema.as_str());
            let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": step}));
            let id = Outbox::new(config.clone())
                .enqueue(&client, &event)
                .await
                .unwrap();
            written.insert(id.to_string(), (t, aggregate, step));
        }
    }
    // The publication and the slot made ahead, as a deploy would.
    let url = pg.url("app_0");
    let out = run_cli(
        &["migrate", "--schemas", "tenant_%", "--wal"],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("slot app_0_fleet_tenant___outbox (created)"),
        "{}",
        text(&out.stdout)
    );
    let addr = http_addr();
    let fleet = start_wal_fleet(&pg, "fleet_a", &redis, &["--http", &addr]).await;
    wait_until("the fleet streams the slot", LONG, || streaming(&client)).await;

    let acked = Arc::new(AtomicUsize::new(0));
    let writers = spawn_writers((WRITERS, EVENTS), pg.url("app_0"), &configs, &acked);
    for w in writers {
        written.extend(w.await.unwrap());
    }
    assert_eq!(written.len(), WRITERS * EVENTS + 5 * BEFORE);
    wait_until("every row delivered and deleted", LONG, || async {
        left(&client, &configs).await == 0
    })
    .await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(check(&events, &written), 0, "duplicates without a crash");
    assert_eq!(events.len(), written.len());

    assert_eq!(
        count(&client, "SELECT count(*) FROM pg_replication_slots").await,
        1,
        "slots"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pg_publication").await,
        1,
        "publications"
    );
    let published = count(
        &client,
        &format!("SELECT count(*) FROM pg_publication_tables WHERE pubname = '{PUBLICATION}'"),
    )
    .await;
    assert_eq!(published, TENANTS as i64, "tables published");

    // Each outbox's deliveries under its own label, exactly.
    let mut per_tenant = [0_usize; TENANTS];
    for (t, ..) in written.values() {
        per_tenant[*t] += 1;
    }
    let (_, s) = scrape(&addr).await;
    for (t, config) in configs.iter().enumerate() {
        let label = config.display_name();
        let delivered = value(&s, "outbox_events_delivered_total", &[("outbox", label.as_str())]);
        assert_eq!(delivered, Some(per_tenant[t] as f64), "{label}");
    }
    let out = run_cli(&["relays", "--schemas", "tenant_%"], &[("DATABASE_URL", &url)]).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        said.contains("log tailing (--source wal): slot app_0_fleet_tenant___outbox, read by pid"),
        "{said}"
    );
    wait_until("the retained WAL gauge of app_0", LONG, || async {
        let (_, s) = scrape(&addr).await;
        value(&s, "outbox_wal_retained_bytes", &[("database", "app_0")]).is_some()
    })
    .await;
    stop_fleet(fleet).await;
}

/// A tenant migrated while the fleet runs: rows committed before the fleet
/// found it, and rows of a transaction under way when it joined the
/// publication (the join waits for it), are read from its table; rows
/// after, from the stream: all of them delivered, in order. A tenant
/// dropped is let go of, with no warning or error, and the others go on.
#[tokio::test]
async fn a_tenant_joining_gets_the_rows_committed_before_and_a_dropped_one_is_let_go() {
    let pg = logical().await;
    let redis = Redis::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 3, true).await;
    let fleet = start_wal_fleet(&pg, "fleet_a", &redis, &[]).await;
    let mut client = pg.connect("app_0").await.unwrap();
    wait_until("the fleet streams the slot", LONG, || streaming(&client)).await;

    // Stopped, the fleet finds nothing until everything below is written
    // or under way.
    fleet.signal(Signal::SIGSTOP).unwrap();
    let new = Config::new("tenant_new", "outbox").unwrap();
    let outbox = Outbox::new(new.clone());
    let step = |k: usize| Event::new("orders", "new-1", "Step", json!({"step": k}));
    migrate_tenant(&mut client, &new).await;
    for k in 0..20 {
        outbox.enqueue(&client, &step(k)).await.unwrap();
    }
    // A transaction under way when the fleet adds the table: the fleet
    // waits for it (its lock request shows in pg_locks), so these rows
    // commit before the table is published.
    let writer = pg.connect("app_0").await.unwrap();
    writer.batch_execute("BEGIN").await.unwrap();
    for k in 20..50 {
        outbox.enqueue(&writer, &step(k)).await.unwrap();
    }
    fleet.signal(Signal::SIGCONT).unwrap();
    wait_until("the fleet waits to publish the new table", LONG, || async {
        count(
            &client,
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'tenant_new.outbox'::regclass",
        )
        .await
            == 1
    })
    .await;
    let published_then = count(
        &client,
        &format!("SELECT count(*) FROM pg_publication_tables WHERE pubname = '{PUBLICATION}' AND schemaname = 'tenant_new'"),
    )
    .await;
    assert_eq!(published_then, 0, "not published while its writer is under way");
    writer.batch_execute("COMMIT").await.unwrap();
    wait_until("the new table published", LONG, || async {
        count(
            &client,
            &format!("SELECT count(*) FROM pg_publication_tables WHERE pubname = '{PUBLICATION}' AND schemaname = 'tenant_new'"),
        )
        .await
            == 1
    })
    .await;
    for k in 50..70 {
        outbox.enqueue(&client, &step(k)).await.unwrap();
    }
    wait_until("the new tenant's 70 events delivered", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() >= 70
    })
    .await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(events.len(), 70, "each once");
    assert_eq!(first_delivery_violations(&events), 0);

    client
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", configs[1].schema.quoted()))
        .await
        .unwrap();
    wait_until("the fleet lets the dropped tenant go", LONG, || async {
        fleet.count_lines("outbox gone; let go") == 1
    })
    .await;
    Outbox::new(configs[2].clone())
        .enqueue(&client, &Event::new("orders", "t2-1", "Created", json!({})))
        .await
        .unwrap();
    wait_until("a remaining tenant's event delivered", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() == 71
    })
    .await;
    let lines = stop_fleet(fleet).await;
    let bad: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Writers commit to 20 tenants; the fleet is SIGKILLed mid-run, a 21st
/// tenant is migrated and written to while it is down, and it is started
/// again. Every event delivered (the late tenant's from its table), none
/// invented, none overtaken by a later one of its aggregate; duplicates
/// within the window (events read whose position the server had not been
/// sent), the documented bound.
#[tokio::test]
async fn a_fleet_killed_mid_run_loses_nothing_and_resends_at_most_its_window() {
    const TENANTS: usize = 20;
    const WRITERS: usize = 4;
    const EVENTS: usize = 400;
    const WINDOW: usize = 200;
    let pg = logical().await;
    let redis = Redis::start().await.unwrap();
    let configs = Arc::new(tenants(&pg, "app_0", TENANTS, true).await);
    let client = pg.connect("app_0").await.unwrap();
    let window = WINDOW.to_string();
    let extra = ["--wal-window", window.as_str()];
    let mut fleet = start_wal_fleet(&pg, "fleet_a", &redis, &extra).await;
    wait_until("the fleet streams the slot", LONG, || streaming(&client)).await;
    let acked = Arc::new(AtomicUsize::new(0));
    let writers = spawn_writers((WRITERS, EVENTS), pg.url("app_0"), &configs, &acked);
    wait_until("a third written and some delivered", LONG, || async {
        acked.load(Ordering::Relaxed) >= WRITERS * EVENTS / 3
            && read_stream(&redis.url(), STREAM).await.len() >= BATCH
    })
    .await;
    fleet.kill().unwrap();
    fleet.wait(LONG).await.unwrap();
    let delivered_before = read_stream(&redis.url(), STREAM).await.len();
    // A tenant migrated and written to while no fleet runs: the restarted
    // one finds it before it streams, and reads its table.
    let late = Config::new("tenant_late", "outbox").unwrap();
    let mut admin = pg.connect("app_0").await.unwrap();
    migrate_tenant(&mut admin, &late).await;
    let mut written = Written::new();
    for step in 0..30 {
        let event = Event::new("orders", "tenant_late.a", "Step", json!({"step": step}));
        let id = Outbox::new(late.clone()).enqueue(&admin, &event).await.unwrap();
        written.insert(id.to_string(), (TENANTS, "tenant_late.a".to_owned(), step));
    }
    let fleet = start_wal_fleet(&pg, "fleet_a", &redis, &extra).await;
    for w in writers {
        written.extend(w.await.unwrap());
    }
    let all: Vec<Config> = configs.iter().cloned().chain([late]).collect();
    wait_until("every row delivered and deleted", LONG, || async {
        left(&client, &all).await == 0
    })
    .await;
    stop_fleet(fleet).await;
    let events = read_stream(&redis.url(), STREAM).await;
    let duplicates = check(&events, &written);
    eprintln!(
        "{} events, {delivered_before} delivered before the kill, {duplicates} delivered twice",
        written.len()
    );
    assert!(duplicates <= WINDOW + BATCH, "{duplicates} duplicates");
}

/// Two fleet processes on one database: one streams the slot, the other
/// stands by; the reader is SIGKILLed mid-run and the standby takes over.
/// Every event delivered, none invented, in order per aggregate.
#[tokio::test]
async fn a_standby_fleet_process_takes_the_slot_over_when_the_reader_dies() {
    const WRITERS: usize = 2;
    const EVENTS: usize = 300;
    let pg = logical().await;
    let redis = Redis::start().await.unwrap();
    let configs = Arc::new(tenants(&pg, "app_0", 5, true).await);
    let client = pg.connect("app_0").await.unwrap();
    let extra = ["--lease-timeout", "3s"];
    let mut a = start_wal_fleet(&pg, "fleet_a", &redis, &extra).await;
    wait_until("fleet A streams the slot", LONG, || streaming(&client)).await;
    let b = start_wal_fleet(&pg, "fleet_b", &redis, &extra).await;
    assert_eq!(a.count_lines("streaming the slot"), 1);
    let acked = Arc::new(AtomicUsize::new(0));
    let writers = spawn_writers((WRITERS, EVENTS), pg.url("app_0"), &configs, &acked);
    wait_until("a third written", LONG, || async {
        acked.load(Ordering::Relaxed) >= WRITERS * EVENTS / 3
    })
    .await;
    assert_eq!(b.count_lines("streaming the slot"), 0, "B stands by");
    a.kill().unwrap();
    a.wait(LONG).await.unwrap();
    wait_until("fleet B streams the slot", LONG, || async {
        b.count_lines("streaming the slot") == 1
    })
    .await;
    let mut written = Written::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    wait_until("every row delivered and deleted", LONG, || async {
        left(&client, &configs).await == 0
    })
    .await;
    stop_fleet(b).await;
    let events = read_stream(&redis.url(), STREAM).await;
    let duplicates = check(&events, &written);
    eprintln!("{} events, {duplicates} delivered twice", written.len());
    assert!(duplicates <= 5_000, "{duplicates} duplicates, over --wal-window");
}

/// `--databases`: one slot per database (named after it), each event
/// booked under `database/schema.table`, and a retained-WAL gauge per
/// database.
#[tokio::test]
async fn with_databases_each_database_has_its_own_slot_and_labels() {
    let pg = logical().await;
    let redis = Redis::start().await.unwrap();
    let mut dbs = Vec::new();
    for d in 0..2 {
        let name = format!("app_{d}");
        dbs.push((name.clone(), tenants(&pg, &name, 3, true).await));
    }
    let addr = http_addr();
    let fleet = start_wal_fleet(&pg, "fleet_a", &redis, &["--databases", "app_%", "--http", &addr]).await;
    let server = pg.connect("postgres").await.unwrap();
    wait_until("both databases streamed", LONG, || async {
        count(&server, "SELECT count(*) FROM pg_replication_slots WHERE active").await == 2
    })
    .await;
    let mut written = Written::new();
    for (d, (db, configs)) in dbs.iter().enumerate() {
        let client = pg.connect(db).await.unwrap();
        for (t, config) in configs.iter().enumerate() {
            let aggregate = format!("{db}/{}", config.schema.as_str());
            for step in 0..5 {
                let event = Event::new("orders", aggregate.clone(), "Step", json!({"step": step}));
                let id = Outbox::new(config.clone())
                    .enqueue(&client, &event)
                    .await
                    .unwrap();
                written.insert(id.to_string(), (d * 3 + t, aggregate.clone(), step));
            }
        }
    }
    wait_until("30 events delivered", LONG, || async {
        read_stream(&redis.url(), STREAM).await.len() >= 30
    })
    .await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(check(&events, &written), 0);
    let slots: Vec<String> = server
        .query("SELECT slot_name::text FROM pg_replication_slots ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        slots,
        ["app_0_fleet_tenant___outbox", "app_1_fleet_tenant___outbox"]
    );
    wait_until(
        "every outbox's deliveries and each database's gauge",
        LONG,
        || async {
            let (_, s) = scrape(&addr).await;
            let booked = dbs.iter().all(|(db, configs)| {
                configs.iter().all(|c| {
                    let label = format!("{db}/{}", c.display_name());
                    value(&s, "outbox_events_delivered_total", &[("outbox", label.as_str())]) == Some(5.0)
                })
            });
            booked
                && ["app_0", "app_1"]
                    .iter()
                    .all(|db| value(&s, "outbox_wal_retained_bytes", &[("database", db)]).is_some())
        },
    )
    .await;
    stop_fleet(fleet).await;
}

/// What a WAL fleet does not serve yet is refused before it connects:
/// exit 2 naming the flag.
#[tokio::test]
async fn a_wal_fleet_refuses_drain_and_cleanup_none_with_exit_2() {
    for (extra, named) in [
        (&["--drain"][..], "--drain"),
        (&["--wal-cleanup", "none"][..], "--wal-cleanup none"),
    ] {
        let args = [&["--source", "wal", "--schemas", "tenant_%"][..], extra].concat();
        let out = relay_without_postgres(&args, &[]).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(named), "{stderr}");
    }
}
