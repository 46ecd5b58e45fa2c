//! `outbox relay --http`: `/metrics` counts exactly what happened (parsed
//! as the Prometheus text format, and checked by `promtool` where it is
//! installed), `/readyz` follows PostgreSQL and the sink, a bad address is a
//! configuration error.

use std::time::Duration;

use outbox::Event;
use outbox_testkit::{Receiver, Redis, Respond};
use prometheus_parse::{Scrape, Value};
use serde_json::json;

use crate::support::{Db, LONG, relay_without_postgres, start_relay, stop_relay, text, wait_until};

/// `127.0.0.1:<free port>` for `--http`.
pub fn http_addr() -> String {
    format!("127.0.0.1:{}", outbox_testkit::free_port())
}

/// GET `http://<addr><path>`: status and body; None while nothing answers.
pub async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let response = client.get(format!("http://{addr}{path}")).send().await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// `/readyz`: status (0 while nothing answers) and body.
pub async fn ready(addr: &str) -> (u16, serde_json::Value) {
    let (status, body) = get(addr, "/readyz").await.unwrap_or((0, "null".to_owned()));
    (
        status,
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// `/metrics`, parsed.
pub async fn scrape(addr: &str) -> (String, Scrape) {
    let (status, body) = get(addr, "/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200, "{body}");
    let scrape = Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("Prometheus text format");
    (body, scrape)
}

/// The value of `metric` with exactly these `labels` (a counter, gauge or
/// a histogram's `_count`); None if absent.
pub fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .find_map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
            Value::Histogram(_) | Value::Summary(_) => None,
        })
}

/// Whether `promtool` is on the PATH; says why a check is skipped if not.
pub fn promtool() -> bool {
    let found = std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!(
            "skipped: promtool is not installed (apt-get install prometheus; scripts/deps.sh does as root)"
        );
    }
    found
}

/// Runs `promtool <args>` with `stdin`; panics with its output on failure.
pub fn promtool_check(args: &[&str], stdin: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// 7 orders delivered, 3 payments refused permanently (413: their payload
/// is over the receiver's limit), so dead letters at once: `/metrics` says
/// exactly 7 and 3, under the right labels, and the backlog gauges, from
/// their own query, catch up.
#[tokio::test]
async fn metrics_count_exactly_the_events_delivered_and_dead_lettered() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_max_body(Some(1000));
    let mut events: Vec<Event> = (0..7)
        .map(|i| Event::new("orders", format!("o{i}"), "OrderPlaced", json!({"n": i})))
        .collect();
    events.extend((0..3).map(|i| {
        Event::new(
            "payments",
            format!("p{i}"),
            "PaymentTaken",
            json!({"blob": "x".repeat(2000)}),
        )
    }));
    outbox::enqueue_all(&db.client, &events).await.unwrap();
    let addr = http_addr();
    let relay = start_relay(&db.url, &receiver.url(), &["--http", &addr], &[]).await;
    wait_until("7 published and 3 dead letters", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 7
            && db
                .count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 3
    })
    .await;
    assert_eq!(receiver.count(), 10, "each event sent once");

    let orders = [("aggregate_type", "orders"), ("sink", "http")];
    let payments = [("aggregate_type", "payments"), ("sink", "http")];
    // The counters follow each commit; wait for them to reach the totals,
    // then assert they did not pass them.
    wait_until("the counters caught up", LONG, || {
        let addr = addr.clone();
        async move {
            let (_, s) = scrape(&addr).await;
            value(&s, "outbox_events_delivered_total", &orders).unwrap_or(0.0) >= 7.0
                && value(&s, "outbox_events_dead_lettered_total", &payments).unwrap_or(0.0) >= 3.0
        }
    })
    .await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(
        value(&s, "outbox_events_delivered_total", &orders),
        Some(7.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_events_delivered_total", &payments),
        Some(0.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_events_dead_lettered_total", &payments),
        Some(3.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_events_dead_lettered_total", &orders),
        Some(0.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_events_failed_total", &payments),
        Some(3.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_delivery_lag_seconds_count", &[]),
        Some(7.0),
        "one sample per acknowledged event"
    );
    let batches = value(&s, "outbox_batches_total", &[]).expect("outbox_batches_total");
    assert!(batches >= 1.0, "{body}");
    assert_eq!(value(&s, "outbox_batch_size_count", &[]), Some(batches), "{body}");
    assert_eq!(
        value(&s, "outbox_batch_size_sum", &[]),
        Some(10.0),
        "every row claimed once"
    );
    assert!(
        value(
            &s,
            "outbox_sink_request_duration_seconds_count",
            &[("sink", "http")]
        )
        .is_some_and(|n| n >= 1.0)
    );
    assert_eq!(
        value(&s, "outbox_sink_up", &[("sink", "http")]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_sink_circuit_state", &[("sink", "http")]),
        Some(0.0)
    );
    assert_eq!(value(&s, "outbox_relay_up", &[]), Some(1.0));
    assert_eq!(
        value(&s, "outbox_partitions_held", &[]),
        Some(f64::from(outbox::DEFAULT_PARTITIONS)),
        "the only relay holds all"
    );
    assert_eq!(
        value(&s, "outbox_build_info", &[("version", env!("CARGO_PKG_VERSION"))]),
        Some(1.0)
    );
    assert!(
        value(&s, "outbox_wakeups_total", &[("cause", "lease")]).is_some(),
        "every cause is exported: {body}"
    );

    // The backlog gauges come from their own query every 5 s.
    wait_until("the backlog gauges caught up", Duration::from_secs(15), || {
        let addr = addr.clone();
        async move {
            let (_, s) = scrape(&addr).await;
            value(&s, "outbox_dead_letters", &[("aggregate_type", "payments")]) == Some(3.0)
                && value(&s, "outbox_backlog_events", &[("aggregate_type", "orders")]).unwrap_or(0.0) == 0.0
        }
    })
    .await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(
        value(&s, "outbox_backlog_events", &[("aggregate_type", "payments")]),
        Some(0.0),
        "{body}"
    );
    assert_eq!(
        value(
            &s,
            "outbox_oldest_unpublished_age_seconds",
            &[("aggregate_type", "payments")]
        ),
        Some(0.0),
        "dead letters are not waiting: {body}"
    );
    if promtool() {
        promtool_check(&["check", "metrics"], &body);
    }
    stop_relay(relay).await;
}

/// `/readyz` answers 503 within 5 s of PostgreSQL stopping, naming it, and
/// 200 again after it restarts; it names a sink that is down.
/// Every metric of the relay carries its outbox, and the outbox's backlog
/// gauges exist from the first scrape after READY, at 0, though no row was
/// ever written (issue 31).
#[tokio::test]
async fn issue_31_the_first_scrape_has_the_outbox_label_and_its_backlog_gauges() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(&db.url, &redis.url(), &["--http", &addr], &[]).await;
    let (body, s) = scrape(&addr).await;
    let outbox = [("outbox", "public.outbox"), ("aggregate_type", "")];
    for gauge in [
        "outbox_backlog_events",
        "outbox_dead_letters",
        "outbox_oldest_unpublished_age_seconds",
    ] {
        assert_eq!(
            value(&s, gauge, &outbox),
            Some(0.0),
            "{gauge} in the first scrape: {body}"
        );
    }
    assert_eq!(
        value(&s, "outbox_relay_up", &[("outbox", "public.outbox")]),
        Some(1.0),
        "{body}"
    );
    let unlabelled: Vec<_> = s
        .samples
        .iter()
        // The process's own: the build and the `process_*` metrics.
        .filter(|m| m.metric != "outbox_build_info" && !m.metric.starts_with("process_"))
        .filter(|m| m.labels.get("outbox") != Some("public.outbox"))
        .map(|m| m.metric.clone())
        .collect();
    assert!(
        unlabelled.is_empty(),
        "without outbox=\"public.outbox\": {unlabelled:?}"
    );
    drop(relay);
}

#[tokio::test]
async fn readyz_follows_postgres_and_the_sink() {
    let mut db = Db::start().await;
    let mut redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(&db.url, &redis.url(), &["--http", &addr], &[]).await;
    wait_until("/readyz 200", LONG, || async { ready(&addr).await.0 == 200 }).await;
    let (_, body) = ready(&addr).await;
    assert_eq!(body["ready"], true, "{body}");
    assert_eq!(body["checks"]["postgres"], "ok", "{body}");
    assert_eq!(body["checks"]["sink redis"], "ok", "{body}");
    assert!(
        body["checks"]["leases"].as_str().unwrap().starts_with("ok"),
        "{body}"
    );
    let (status, alive) = get(&addr, "/healthz").await.unwrap();
    assert_eq!((status, alive.as_str()), (200, r#"{"alive":true}"#));

    db.pg.stop().await.unwrap();
    wait_until(
        "/readyz 503 after PostgreSQL stopped",
        Duration::from_secs(5),
        || async { ready(&addr).await.0 == 503 },
    )
    .await;
    let (_, body) = ready(&addr).await;
    assert_eq!(body["ready"], false, "{body}");
    let postgres = body["checks"]["postgres"].as_str().unwrap();
    assert!(
        postgres.starts_with("connection lost") || postgres.starts_with("reconnecting"),
        "{body}"
    );
    let (status, _) = get(&addr, "/healthz").await.unwrap();
    assert_eq!(status, 200, "alive all the same");

    db.pg.restart().await.unwrap();
    db.reconnect().await;
    wait_until("/readyz 200 after PostgreSQL restarted", LONG, || async {
        ready(&addr).await.0 == 200
    })
    .await;

    // The sink goes down: the relay finds out on its next delivery.
    redis.stop().await.unwrap();
    outbox::enqueue(&db.client, &Event::new("orders", "1", "OrderPlaced", json!({})))
        .await
        .unwrap();
    relay
        .wait_for_notification("STATUS=sink redis unavailable", LONG)
        .await
        .expect("the breaker opened");
    let (status, body) = ready(&addr).await;
    assert_eq!(status, 503, "{body}");
    let sink = body["checks"]["sink redis"].as_str().unwrap();
    assert!(sink.starts_with("unavailable: "), "{body}");
    assert_eq!(body["checks"]["postgres"], "ok", "only the sink is down: {body}");
    let (_, s) = scrape(&addr).await;
    assert_eq!(value(&s, "outbox_sink_up", &[("sink", "redis")]), Some(0.0));
    assert_eq!(
        value(&s, "outbox_sink_circuit_state", &[("sink", "redis")]),
        Some(1.0)
    );

    redis.restart().await.unwrap();
    db.wait_drained("the event delivered once Redis is back").await;
    wait_until("/readyz 200 after Redis came back", LONG, || async {
        ready(&addr).await.0 == 200
    })
    .await;
    stop_relay(relay).await;
}

#[tokio::test]
async fn a_bad_http_address_exits_2_naming_the_flag() {
    let out = relay_without_postgres(&["--http", "localhost:notaport"], &[]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--http"), "{stderr}");

    // A port already taken: found when binding, before PostgreSQL.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = relay_without_postgres(&["--http", &addr], &[]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--http") && stderr.contains(&addr), "{stderr}");
}

#[test]
fn the_alert_rules_pass_promtool() {
    if !promtool() {
        return;
    }
    let rules = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/prometheus/outbox-alerts.yml"
    );
    promtool_check(&["check", "rules", rules], "");
}

/// What recording costs: the same drain of 20,000 events (batches of 100,
/// to Redis) with and without `--http`, alternating, three times each.
/// A measurement, not a check: run with `--ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement; prints timings"]
async fn measure_the_cost_of_recording_metrics() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let url = db.url.clone();
    let env = [("DATABASE_URL", url.as_str())];
    let sink = redis.url();
    const EVENTS: usize = 2_000;
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, with) in [false, true].into_iter().enumerate() {
            db.insert_events(EVENTS, 4).await;
            let addr = http_addr();
            let mut args = vec!["relay", "--sink", &sink, "--drain", "--batch-size", "100"];
            if with {
                args.extend(["--http", addr.as_str()]);
            }
            let started = std::time::Instant::now();
            let out = crate::support::run_cli(&args, &env).await;
            assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
            times[i].push(started.elapsed().as_secs_f64());
            eprintln!("with --http: {with}: {:?}", started.elapsed());
            assert_eq!(db.unpublished().await, 0);
        }
    }
    eprintln!(
        "drain of {EVENTS} events, seconds: without --http {:?}, with --http {:?}",
        times[0], times[1]
    );
}
