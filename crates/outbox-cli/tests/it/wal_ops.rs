//! Operating log tailing (`relay --source wal`): a sink outage spends no
//! attempt while the slot keeps (and `/metrics` and `outbox stats` report)
//! the WAL; an idle outbox in a busy database keeps the slot moving; dead
//! letters of rows and of emitted events and their requeue; TLS on the
//! replication connection. Two ignored tests reproduce bugs of the WAL
//! source found here (issue 17): gauges frozen during a sink outage, and
//! delivered rows left undeleted.

use std::time::{Duration, Instant};

use outbox::{Config, Event, Outbox};
use outbox_testkit::{PgSettings, Post, Postgres, Receiver, Redis, Respond};
use serde_json::{Value, json};
use tokio_postgres::Client;

use crate::metrics::{http_addr, promtool, promtool_check, ready, scrape, value};
use crate::support::{
    LONG, distinct_events, read_stream, run_cli, start_relay, stop_relay, text, wait_until,
};
use crate::wal::WalDb;

/// The slot `outbox migrate --wal` made for the default outbox.
const SLOT: &str = "public_outbox";

/// The server's current WAL position.
async fn wal_position(client: &Client) -> String {
    client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0)
}

/// WAL bytes written since `position`.
async fn wal_since(client: &Client, position: &str) -> i64 {
    client
        .query_one(
            "SELECT (pg_current_wal_lsn() - $1::text::pg_lsn)::int8",
            &[&position],
        )
        .await
        .unwrap()
        .get(0)
}

/// The outbox's slot as `outbox stats` reads it.
async fn slot(client: &Client) -> outbox::sql::SlotState {
    outbox::wal::slot_state(client, &Config::default())
        .await
        .unwrap()
        .expect("the slot exists")
}

/// `outbox <args> --json`, parsed.
async fn cli_json(url: &str, args: &[&str]) -> Value {
    let out = run_cli(args, &[("DATABASE_URL", url)]).await;
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {}", text(&out.stdout)))
}

/// The sum of every sample of `metric` (0 when it has none).
fn total(scrape: &prometheus_parse::Scrape, metric: &str) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// The slot's gauges on `/metrics`: (retained, lag); None until set.
async fn slot_gauges(addr: &str) -> (Option<f64>, Option<f64>) {
    let (_, s) = scrape(addr).await;
    (
        value(&s, "outbox_wal_retained_bytes", &[("slot", SLOT)]),
        value(&s, "outbox_wal_lag_bytes", &[("slot", SLOT)]),
    )
}

async fn stream_len(redis: &Redis) -> usize {
    read_stream(&redis.url(), "outbox.event.orders").await.len()
}

/// Redis stopped for 10 s under a streaming relay: the breaker opens, no
/// attempt is spent, so no dead letter even though five attempts at the
/// default backoff (200 ms doubling: 3 s) fit in the outage many times;
/// the slot keeps the WAL meanwhile, which `outbox stats` and `outbox
/// relays` report (the relay's own gauges: see
/// `the_wal_gauges_follow_the_slot_while_the_sink_is_down`); once
/// Redis is back every event is delivered once and `/metrics` shows the
/// confirmed position caught up.
#[tokio::test]
async fn sink_down_10_s_makes_no_dead_letter_while_the_slot_keeps_and_reports_the_wal() {
    const EVENTS: usize = 1000;
    let mut db = WalDb::start().await;
    let mut redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(&db.url, &redis.url(), &["--source", "wal", "--http", &addr], &[]).await;
    wait_until("the slot's gauges exported", LONG, || async {
        matches!(slot_gauges(&addr).await, (Some(_), Some(_)))
    })
    .await;

    redis.stop().await.unwrap();
    let outage = Instant::now();
    db.insert(100, 100).await;
    // Past the first transaction's commit: the slot must not confirm this
    // far while its events are undelivered (it may confirm into it while
    // idle: its keepalive position), so the WAL it keeps is counted from
    // here.
    let after_first = wal_position(&db.client).await;
    db.insert(EVENTS - 100, 100).await;
    let written = wal_since(&db.client, &after_first).await;
    relay
        .wait_for_notification("STATUS=sink redis unavailable", LONG)
        .await
        .expect("the relay found Redis down");

    // `outbox stats` reads the slot itself: someone streams it, and it
    // keeps at least what was written since Redis stopped.
    wait_until("outbox stats shows the WAL kept", LONG, || async {
        cli_json(&db.url, &["stats", "--json"]).await["slot"]["retained_bytes"]
            .as_i64()
            .is_some_and(|r| r >= written)
    })
    .await;
    let stats = cli_json(&db.url, &["stats", "--json"]).await;
    let s = &stats["slot"];
    assert_eq!(s["slot"], SLOT, "{stats}");
    assert_eq!(s["wal_status"], "reserved", "{stats}");
    assert!(s["active_pid"].is_i64(), "the relay streams it: {stats}");
    // While idle the relay confirms the server's keepalive position, which
    // may run into a transaction whose records were read but whose commit
    // was not yet (restarting there re-sends it whole); never past an
    // undelivered commit.
    let confirmed = s["confirmed_lsn"].as_str().unwrap().to_owned();
    let before_first_commit: bool = db
        .client
        .query_one(
            "SELECT $1::text::pg_lsn < $2::text::pg_lsn",
            &[&confirmed, &after_first],
        )
        .await
        .unwrap()
        .get(0);
    assert!(before_first_commit, "confirmed past undelivered events: {stats}");
    assert_eq!(stats["unpublished"], EVENTS, "rows not yet deleted: {stats}");
    let relays = cli_json(&db.url, &["relays", "--json"]).await;
    assert_eq!(relays["slot"]["slot"], SLOT, "{relays}");

    // The relay's own gauges during the outage: the test below.
    // The outage itself lasts 10 s (the scenario: long enough for five
    // attempts, had any been spent).
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed())).await;
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await,
        0
    );
    let (_, s) = scrape(&addr).await;
    assert_eq!(total(&s, "outbox_events_failed_total"), 0.0, "no attempt spent");

    redis.restart().await.unwrap();
    wait_until("every event delivered", LONG, || async {
        stream_len(&redis).await >= EVENTS
    })
    .await;
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(events.len(), EVENTS, "each once");
    assert_eq!(distinct_events(&events), EVENTS);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await,
        0
    );
    #[allow(clippy::cast_precision_loss)]
    let floor = written as f64;
    wait_until("the confirmed position caught up", LONG, || async {
        matches!(slot_gauges(&addr).await, (_, Some(l)) if l < floor)
    })
    .await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(total(&s, "outbox_events_dead_lettered_total"), 0.0, "{body}");
    assert_eq!(
        total(&s, "outbox_events_delivered_total"),
        EVENTS as f64,
        "{body}"
    );
    assert_eq!(value(&s, "outbox_wal_window_events", &[]), Some(0.0), "{body}");
    if promtool() {
        promtool_check(&["check", "metrics"], &body);
    }
    stop_relay(relay).await;
    // The walsender ends a moment after the relay.
    wait_until("the slot read by nobody", LONG, || async {
        slot(&db.client).await.active_pid.is_none()
    })
    .await;
    let out = run_cli(&["stats"], &[("DATABASE_URL", db.url.as_str())]).await;
    let said = text(&out.stdout);
    assert!(
        said.contains("log tailing      slot public_outbox, read by nobody, wal_status reserved")
            && said.contains("unpublished counts rows not yet deleted"),
        "{said}"
    );
}

/// The relay's slot gauges (and `--wal-retained-warn`) follow the slot
/// while the sink is down, which is when the slot grows: the relay loop
/// claims nothing then, so the slot is watched by a task of its own.
#[tokio::test]
async fn the_wal_gauges_follow_the_slot_while_the_sink_is_down() {
    let mut db = WalDb::start().await;
    let mut redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(&db.url, &redis.url(), &["--source", "wal", "--http", &addr], &[]).await;
    redis.stop().await.unwrap();
    db.insert(100, 100).await;
    // The slot may confirm into the first transaction while idle (its
    // keepalive position), never past its commit: count from there.
    let after_first = wal_position(&db.client).await;
    db.insert(900, 100).await;
    let written = wal_since(&db.client, &after_first).await;
    relay
        .wait_for_notification("STATUS=sink redis unavailable", LONG)
        .await
        .expect("the relay found Redis down");
    #[allow(clippy::cast_precision_loss)]
    let floor = written as f64;
    // Five slot checks' worth (one every 5 s); the slot itself shows it at once.
    assert!(slot(&db.client).await.retained_bytes >= written);
    wait_until("/metrics shows the WAL kept", Duration::from_secs(25), || async {
        matches!(slot_gauges(&addr).await, (Some(r), Some(l)) if r >= floor && l >= floor)
    })
    .await;
    redis.restart().await.unwrap();
    stop_relay(relay).await;
}

/// A busy table elsewhere in the database (100,000 updates) and an idle
/// outbox: the relay confirms the server's position on its keepalives, so
/// once a checkpoint logged the running transactions the slot lets the WAL
/// go. A slot nobody reads keeps all of it.
#[tokio::test]
async fn an_idle_outbox_in_a_busy_database_keeps_the_slot_s_wal_bounded() {
    let mut db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), &["--source", "wal"], &[]).await;
    db.client
        .batch_execute(
            "CREATE TABLE busy (id int PRIMARY KEY, n int NOT NULL);
             INSERT INTO busy SELECT g, 0 FROM generate_series(1, 1000) AS g;",
        )
        .await
        .unwrap();
    // Alone: a slot cannot be created in a transaction that wrote.
    db.client
        .batch_execute("SELECT pg_create_logical_replication_slot('unread', 'pgoutput')")
        .await
        .unwrap();
    let before = wal_position(&db.client).await;
    for _ in 0..100 {
        db.client
            .batch_execute("UPDATE busy SET n = n + 1")
            .await
            .unwrap();
    }
    assert_eq!(
        db.count("SELECT sum(n) FROM busy").await,
        100_000,
        "100,000 updates"
    );
    let written = wal_since(&db.client, &before).await;
    // The relay confirms the server's position on its keepalives: the
    // confirmed position follows the busy table's WAL.
    let bound = written / 10;
    wait_until(
        "the confirmed position passed the busy table's WAL",
        LONG,
        || async { slot(&db.client).await.lag_bytes < bound },
    )
    .await;
    // restart_lsn moves only at a logged xl_running_xacts that the reader
    // confirmed past: PostgreSQL 15's bgwriter logs one every 15 s while
    // WAL is written, a checkpoint logs one at once.
    db.client.batch_execute("CHECKPOINT").await.unwrap();
    wait_until("the slot let the busy table's WAL go", LONG, || async {
        let s = slot(&db.client).await;
        s.retained_bytes < bound && s.lag_bytes < bound
    })
    .await;
    let ours = slot(&db.client).await;
    let unread: i64 = db
        .client
        .query_one(
            "SELECT (pg_current_wal_lsn() - restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'unread'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    eprintln!(
        "the updates wrote {written} bytes of WAL; the relay's slot retains {} and lags {}; the unread slot retains {unread}",
        ours.retained_bytes, ours.lag_bytes
    );
    assert!(
        unread >= written,
        "the slot nobody reads keeps it all: {unread} < {written}"
    );

    // The console's overview says the same in one line.
    let (admin, base) = crate::admin::start_admin(&db.url, None).await;
    let page = reqwest::get(format!("{base}/"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = page
        .split_once(r#"<p id="wal-slot">"#)
        .and_then(|(_, rest)| rest.split_once("</p>"))
        .map(|(line, _)| line)
        .unwrap_or_else(|| panic!("no slot line in the overview: {page}"));
    assert!(
        line.starts_with("Log tailing: slot public_outbox, read by pid ") && line.contains(" of WAL, "),
        "{line}"
    );
    eprintln!("the overview: {line}");
    drop(admin);

    // Confirming past the busy WAL skipped nothing of the outbox's.
    db.insert(10, 2).await;
    wait_until("10 delivered", LONG, || async { stream_len(&redis).await >= 10 }).await;
    assert_eq!(stream_len(&redis).await, 10);
    db.client
        .batch_execute("SELECT pg_drop_replication_slot('unread')")
        .await
        .unwrap();
    stop_relay(relay).await;
}

/// The requests whose body names `aggregate`, with their index in the log.
fn of_aggregate<'a>(received: &'a [Post], aggregate: &str) -> Vec<(usize, &'a Post)> {
    received
        .iter()
        .enumerate()
        .filter(|(_, r)| r.body["aggregate_id"] == aggregate)
        .collect()
}

/// Statuses, in order, of the requests carrying `event_id`.
fn statuses_of(received: &[Post], event_id: &str) -> Vec<u16> {
    received
        .iter()
        .filter(|r| r.body["event_id"] == event_id)
        .map(|r| r.status)
        .collect()
}

/// `outbox dlq list --json`.
async fn dead_letters(url: &str) -> Vec<Value> {
    serde_json::from_value(cli_json(url, &["dlq", "list", "--json"]).await).unwrap()
}

/// `outbox dlq requeue --all`, which must requeue exactly one.
async fn requeue_one(url: &str) {
    let out = run_cli(&["dlq", "requeue", "--all"], &[("DATABASE_URL", url)]).await;
    assert!(
        text(&out.stdout).contains("requeued 1"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// A receiver that refuses one event (500, retryable) through the WAL
/// source: it is retried in memory up to `--max-attempts`, its later
/// siblings wait and then go in order once it is dead, other aggregates
/// are delivered meanwhile; the dead letter is a row `outbox dlq` lists,
/// and `dlq requeue` re-inserts it so the source reads and delivers it
/// again. The same for an emitted event, which has no row until it dies.
#[tokio::test]
async fn dead_letters_of_rows_and_of_emitted_events_in_wal_mode_and_their_requeue() {
    let db = WalDb::start().await;
    let mut writer = crate::support::connect(&db.url).await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_refuse(Some(("refuse-me", 500)));
    let args = ["--source", "wal", "--max-attempts", "3", "--backoff-base", "50ms"];
    let relay = start_relay(&db.url, &receiver.url(), &args, &[]).await;

    // An inserted event.
    let poisoned = Event::new("orders", "a", "Placed", json!({"note": "refuse-me"}));
    let events = [
        poisoned.clone(),
        Event::new("orders", "b", "Placed", json!({"seq": 0})),
        Event::new("orders", "a", "Paid", json!({"seq": 1})),
        Event::new("orders", "a", "Shipped", json!({"seq": 2})),
        Event::new("orders", "b", "Paid", json!({"seq": 1})),
    ];
    let tx = writer.transaction().await.unwrap();
    Outbox::default().enqueue_all(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    wait_until(
        "the refused event dead and the others delivered",
        LONG,
        || async {
            db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 1
                && receiver.received().iter().filter(|r| r.status == 200).count() == 4
        },
    )
    .await;
    let received = receiver.received();
    let poisoned_id = poisoned.event_id.to_string();
    assert_eq!(
        statuses_of(&received, &poisoned_id),
        [500, 500, 500],
        "--max-attempts 3"
    );
    let a = of_aggregate(&received, "a");
    let last_try = a
        .iter()
        .filter(|(_, r)| r.status == 500)
        .map(|(i, _)| *i)
        .max()
        .unwrap();
    let siblings: Vec<(usize, &str)> = a
        .iter()
        .filter(|(_, r)| r.status == 200)
        .map(|(i, r)| (*i, r.body["event_type"].as_str().unwrap()))
        .collect();
    assert_eq!(
        siblings.iter().map(|(_, t)| *t).collect::<Vec<_>>(),
        ["Paid", "Shipped"],
        "once each, in order"
    );
    assert!(
        siblings.iter().all(|(i, _)| *i > last_try),
        "a's later events waited for its dead letter: {a:?}"
    );
    let b = of_aggregate(&received, "b");
    assert_eq!(b.len(), 2, "b's events once each");
    assert!(
        b.iter().all(|(i, _)| *i < last_try),
        "b did not wait for a: {b:?}"
    );
    let dead = dead_letters(&db.url).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["event_id"], poisoned_id.as_str(), "{dead:?}");
    assert_eq!(dead[0]["attempts"], 3, "{dead:?}");
    assert_eq!(
        dead[0]["last_error"], "HTTP 500 Internal Server Error",
        "{dead:?}"
    );
    assert!(dead[0]["dead_at"].is_string(), "{dead:?}");
    // Its attempts, kept in memory by the source, written with its death.
    let outcomes: Vec<&str> = dead[0]["attempt_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["retry", "retry", "dead"], "{dead:?}");
    assert!(dead[0]["first_failed_at"].is_string(), "{dead:?}");

    receiver.set_refuse(None);
    requeue_one(&db.url).await;
    wait_until("the requeued event delivered", LONG, || async {
        statuses_of(&receiver.received(), &poisoned_id).last() == Some(&200)
    })
    .await;
    assert_eq!(
        statuses_of(&receiver.received(), &poisoned_id),
        [500, 500, 500, 200]
    );

    // An emitted event: no row until it is dead.
    receiver.set_refuse(Some(("refuse-me", 500)));
    let emitted = Event::new("orders", "c", "Placed", json!({"note": "refuse-me"}));
    let sibling = Event::new("orders", "c", "Paid", json!({}));
    let tx = writer.transaction().await.unwrap();
    Outbox::default().emit(&tx, &emitted).await.unwrap();
    Outbox::default().emit(&tx, &sibling).await.unwrap();
    tx.commit().await.unwrap();
    let emitted_id = emitted.event_id.to_string();
    let sibling_id = sibling.event_id.to_string();
    wait_until(
        "the emitted event dead and its sibling delivered",
        LONG,
        || async {
            db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 1
                && statuses_of(&receiver.received(), &sibling_id) == [200]
        },
    )
    .await;
    let received = receiver.received();
    assert_eq!(statuses_of(&received, &emitted_id), [500, 500, 500]);
    let c = of_aggregate(&received, "c");
    assert_eq!(
        c.last().unwrap().1.body["event_id"],
        sibling_id.as_str(),
        "the sibling waited: {c:?}"
    );
    let dead = dead_letters(&db.url).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0]["event_id"].as_str(), dead[0]["attempts"].as_i64()),
        (Some(emitted_id.as_str()), Some(3)),
        "{dead:?}"
    );
    assert_eq!(
        dead[0]["attempt_log"].as_array().map(Vec::len),
        Some(3),
        "{dead:?}"
    );
    let rows = db
        .client
        .query_one(
            "SELECT count(*) FROM outbox WHERE event_id = $1::text::uuid AND dead_at IS NOT NULL",
            &[&emitted_id],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(rows, 1, "the emitted event is a row now");

    receiver.set_refuse(None);
    requeue_one(&db.url).await;
    wait_until("the requeued emitted event delivered", LONG, || async {
        statuses_of(&receiver.received(), &emitted_id).last() == Some(&200)
    })
    .await;
    assert_eq!(
        statuses_of(&receiver.received(), &emitted_id),
        [500, 500, 500, 200]
    );
    assert_eq!(receiver.count(), 4 + 3 + 1 + 1 + 3 + 1, "nothing else sent");
    stop_relay(relay).await;
}

/// `relay --source wal` against a cluster that takes only TLS with a client
/// certificate (`hostssl … cert`): the replication session goes through
/// TLS with the certificate (the server says so) and delivers. A wrong CA
/// at startup is refused at once, naming the cause; a wrong CA when the
/// replication connection is opened again mid-run (the walsender was
/// terminated, the CA file replaced) is reported on `/readyz` and retried,
/// and reading resumes once the file is right again.
#[tokio::test]
async fn wal_source_over_tls_verify_full_and_a_wrong_ca() {
    use crate::tls::{Ca, url};
    let ca = Ca::new("outbox test CA");
    let server = ca.server();
    let pg = Postgres::start_with(
        PgSettings::default()
            .set("wal_level", "logical")
            .tls(server.cert_pem, server.key_pem)
            .client_ca(ca.issuer.pem())
            .hba("hostssl all all 127.0.0.1/32 cert"),
    )
    .await
    .unwrap();
    let db_url = pg.fresh_database().await.unwrap();
    let db = db_url.rsplit('/').next().unwrap().to_owned();
    let me = ca.client("postgres");
    // The relay's own copy of the root, replaced below.
    let roots = tempfile::tempdir().unwrap();
    let root = roots.path().join("root.crt");
    std::fs::write(&root, ca.issuer.pem()).unwrap();
    let params = |root: &str| {
        format!(
            "sslmode=verify-full&sslrootcert={root}&sslcert={}&sslkey={}",
            me.cert.display(),
            me.key.display()
        )
    };
    let relay_url = url(&pg, "localhost", &db, &params(&root.display().to_string()));
    let env = [("DATABASE_URL", relay_url.as_str())];
    for args in [&["migrate"][..], &["migrate", "--wal"]] {
        let out = run_cli(args, &env).await;
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out.stderr));
    }
    let client = crate::tls::connect(&relay_url).await.unwrap();
    let redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(
        &relay_url,
        &redis.url(),
        &["--source", "wal", "--http", &addr],
        &[],
    )
    .await;
    let events: Vec<Event> = (0..25)
        .map(|i| Event::new("orders", format!("order-{}", i % 5), "Placed", json!({ "i": i })))
        .collect();
    Outbox::default().enqueue_all(&client, &events).await.unwrap();
    wait_until("25 delivered", LONG, || async { stream_len(&redis).await >= 25 }).await;
    let row = client
        .query_one(
            "SELECT s.ssl, s.client_dn FROM pg_replication_slots AS r JOIN pg_stat_ssl AS s ON s.pid = r.active_pid \
              WHERE r.slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap();
    let (ssl, dn): (bool, Option<String>) = (row.get(0), row.get(1));
    assert!(ssl, "the replication session is encrypted");
    assert_eq!(dn.as_deref(), Some("/CN=postgres"), "with our certificate");

    // A wrong CA at startup: the relay's first connection refuses the
    // server at once.
    let other = Ca::new("another CA");
    let wrong = tempfile::tempdir().unwrap();
    let wrong_root = wrong.path().join("root.crt");
    std::fs::write(&wrong_root, other.issuer.pem()).unwrap();
    let wrong_url = url(&pg, "localhost", &db, &params(&wrong_root.display().to_string()));
    let started = Instant::now();
    let out = run_cli(
        &[
            "relay",
            "--sink",
            &redis.url(),
            "--source",
            "wal",
            "--connect-timeout",
            "60s",
        ],
        &[("DATABASE_URL", wrong_url.as_str())],
    )
    .await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "not retried: {:?}",
        started.elapsed()
    );

    // A wrong CA mid-run: only the replication connection is opened again.
    std::fs::write(&root, other.issuer.pem()).unwrap();
    let terminated: bool = client
        .query_one(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    wait_until("/readyz names the refused certificate", LONG, || async {
        let (status, body) = ready(&addr).await;
        status == 503
            && body["checks"]["postgres"]
                .as_str()
                .is_some_and(|p| p.contains("UnknownIssuer"))
    })
    .await;
    let (_, body) = ready(&addr).await;
    eprintln!("/readyz with a wrong CA mid-run: {body}");
    assert!(relay.exit_status().is_none(), "the relay keeps retrying");
    let warnings = relay.count_lines("UnknownIssuer");
    eprintln!("lines naming UnknownIssuer so far: {warnings}");

    std::fs::write(&root, ca.issuer.pem()).unwrap();
    let more: Vec<Event> = (0..5)
        .map(|i| Event::new("orders", "after", "Placed", json!({ "i": i })))
        .collect();
    Outbox::default().enqueue_all(&client, &more).await.unwrap();
    wait_until("30 delivered after the CA was right again", LONG, || async {
        distinct_events(&read_stream(&redis.url(), "outbox.event.orders").await) == 30
    })
    .await;
    wait_until("/readyz 200 again", LONG, || async {
        ready(&addr).await.0 == 200
    })
    .await;
    stop_relay(relay).await;
}

/// Logical decoding sends a commit as soon as its record is flushed, a
/// moment before the transaction is visible to other sessions, so the
/// relay's delete can miss a row it has just delivered. Eight writers
/// committing one event each, 2,000 in all, left 10 to 242 delivered rows
/// behind before the relay checked what its deletes found and tried the
/// rest again, holding the slot's position until they were found.
#[tokio::test]
async fn every_delivered_row_is_deleted_under_concurrent_commits() {
    const WRITERS: usize = 8;
    const EACH: usize = 250;
    let db = WalDb::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), &["--source", "wal"], &[]).await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let url = db.url.clone();
            tokio::spawn(async move {
                let client = crate::support::connect(&url).await;
                for i in 0..EACH {
                    let event = Event::new("orders", format!("w{w}"), "Placed", json!({ "i": i }));
                    outbox::enqueue(&client, &event).await.unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    wait_until("every event delivered", LONG, || async {
        distinct_events(&read_stream(&redis.url(), "outbox.event.orders").await) == WRITERS * EACH
    })
    .await;
    wait_until("every delivered row deleted", Duration::from_secs(15), || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    stop_relay(relay).await;
}
