//! Observability with a routes file (issue 35): metrics name the real sink
//! and the route of each event, never a `router` pseudo-sink, and a
//! route's outage is two log lines, one when it starts and one when it
//! ends, however long it lasts.

use std::time::Duration;

use outbox::Event;
use outbox_testkit::{Receiver, Redis, Respond};
use prometheus_parse::Scrape;
use serde_json::json;

use crate::metrics::{http_addr, promtool, promtool_check, ready, scrape, value};
use crate::routing::config_file;
use crate::support::{Db, LONG, start_relay, stop_relay, wait_until};

/// Every sample whose `label` is `bad`, as `metric{labels}` text.
fn with_label(s: &Scrape, label: &str, bad: &str) -> Vec<String> {
    s.samples
        .iter()
        .filter(|m| m.labels.get(label) == Some(bad))
        .map(|m| format!("{}{:?}", m.metric, m.labels))
        .collect()
}

/// Orders go to Redis on a route named `stream`, everything else to HTTP
/// on the default route; 2 invoices are refused (413) and become dead
/// letters. One batch (`--ordering none`: one claim takes every row), so
/// each route's sink is called exactly once.
#[tokio::test]
async fn routed_metrics_carry_the_real_sink_and_route_of_each_event() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_max_body(Some(1000));
    let mut events: Vec<Event> = (0..6)
        .map(|i| Event::new("orders", format!("o{i}"), "OrderPlaced", json!({"i": i})))
        .collect();
    events.extend((0..4).map(|i| Event::new("invoices", format!("i{i}"), "InvoiceSent", json!({"i": i}))));
    events.extend((4..6).map(|i| {
        Event::new(
            "invoices",
            format!("i{i}"),
            "InvoiceSent",
            json!({"blob": "x".repeat(2000)}),
        )
    }));
    outbox::enqueue_all(&db.client, &events).await.unwrap();
    let config = config_file(&format!(
        "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}\"\nname = \"stream\"\n",
        receiver.url(),
        redis.url()
    ));
    let addr = http_addr();
    let relay = start_relay(
        &db.url,
        "unused://x",
        &["--config", &config, "--http", &addr, "--ordering", "none"],
        &[],
    )
    .await;
    wait_until("10 published and 2 dead letters", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 10
            && db
                .count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 2
    })
    .await;
    wait_until("the batch booked", LONG, || {
        let addr = addr.clone();
        async move { value(&scrape(&addr).await.1, "outbox_batches_total", &[]).unwrap_or(0.0) >= 1.0 }
    })
    .await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(value(&s, "outbox_batches_total", &[]), Some(1.0), "{body}");

    let orders = [
        ("aggregate_type", "orders"),
        ("sink", "redis"),
        ("route", "stream"),
    ];
    let invoices = [
        ("aggregate_type", "invoices"),
        ("sink", "http"),
        ("route", "default"),
    ];
    for (metric, labels, n) in [
        ("outbox_events_delivered_total", &orders, 6.0),
        ("outbox_events_failed_total", &orders, 0.0),
        ("outbox_events_dead_lettered_total", &orders, 0.0),
        ("outbox_events_delivered_total", &invoices, 4.0),
        ("outbox_events_failed_total", &invoices, 2.0),
        ("outbox_events_dead_lettered_total", &invoices, 2.0),
    ] {
        assert_eq!(value(&s, metric, labels), Some(n), "{metric}{labels:?}: {body}");
    }
    for metric in [
        "outbox_events_delivered_total",
        "outbox_events_failed_total",
        "outbox_events_dead_lettered_total",
    ] {
        let series = s.samples.iter().filter(|m| m.metric == metric).count();
        assert_eq!(series, 2, "one series per type, on its route: {metric} in {body}");
    }
    // Each route's sink was called once, and timed on its own series.
    for (sink, route) in [("redis", "stream"), ("http", "default")] {
        assert_eq!(
            value(
                &s,
                "outbox_sink_request_duration_seconds_count",
                &[("sink", sink), ("route", route)]
            ),
            Some(1.0),
            "{sink} {route}: {body}"
        );
        assert_eq!(
            value(&s, "outbox_sink_up", &[("sink", sink), ("route", route)]),
            Some(1.0),
            "{body}"
        );
    }
    let requests = s
        .samples
        .iter()
        .filter(|m| m.metric == "outbox_sink_request_duration_seconds_count")
        .count();
    assert_eq!(requests, 2, "no request series but the routes': {body}");
    // The lag per aggregate type: one sample per acknowledged event.
    for (aggregate_type, n) in [("orders", 6.0), ("invoices", 4.0)] {
        assert_eq!(
            value(
                &s,
                "outbox_delivery_lag_seconds_count",
                &[("aggregate_type", aggregate_type)]
            ),
            Some(n),
            "{body}"
        );
    }
    // No router pseudo-sink, no route without a name, anywhere.
    assert_eq!(with_label(&s, "sink", "router"), Vec::<String>::new(), "{body}");
    assert_eq!(with_label(&s, "route", ""), Vec::<String>::new(), "{body}");
    assert!(!body.contains("router"), "{body}");
    // The process's own metrics, and the build's commit.
    for metric in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "process_threads",
    ] {
        assert!(value(&s, metric, &[]).is_some(), "{metric}: {body}");
    }
    assert!(
        value(&s, "process_resident_memory_bytes", &[]).is_some_and(|v| v > 0.0),
        "{body}"
    );
    let build = s
        .samples
        .iter()
        .find(|m| m.metric == "outbox_build_info")
        .expect("outbox_build_info");
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    assert!(
        build.labels.get("commit").is_some_and(|c| !c.is_empty()),
        "{body}"
    );
    // Readiness names each route's sink, and no router.
    let (status, checks) = ready(&addr).await;
    assert_eq!(status, 200, "{checks}");
    assert_eq!(checks["checks"]["sink redis route stream"], "ok", "{checks}");
    assert_eq!(checks["checks"]["sink http route default"], "ok", "{checks}");
    assert!(!checks.to_string().contains("router"), "{checks}");
    if promtool() {
        promtool_check(&["check", "metrics"], &body);
    }

    let lines = stop_relay(relay).await;
    // The batch's line says what became of its rows: 2 dead letters, not
    // "will be retried".
    let failed: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains(" WARN ") && l.contains("delivered"))
        .collect();
    assert_eq!(failed.len(), 1, "{lines:#?}");
    assert!(failed[0].contains("10 delivered, 2 dead-lettered"), "{failed:?}");
    assert!(!failed[0].contains("retried"), "{failed:?}");
    let _ = std::fs::remove_file(config);
}

/// Redis (route `orders`) stopped for 10 s while HTTP (the default route)
/// takes invoices: the route's breaker opens, its probes fail, its orders
/// come due every second and are answered by its breaker, and the relay's
/// claim pauses and resumes each time a batch holds only orders. Once
/// Redis is back everything is delivered. The log has exactly one line
/// saying the route is unavailable and one saying it is available again.
#[tokio::test]
async fn a_route_down_for_10_s_logs_once_when_it_opens_and_once_when_it_closes() {
    let db = Db::start().await;
    let mut redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let config = config_file(&format!(
        "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}\"\n",
        receiver.url(),
        redis.url()
    ));
    let addr = http_addr();
    let relay = start_relay(
        &db.url,
        "unused://x",
        &["--config", &config, "--http", &addr],
        &[],
    )
    .await;
    let order = |i: usize| Event::new("orders", format!("o{i}"), "OrderPlaced", json!({"i": i}));
    let invoice = |i: usize| Event::new("invoices", format!("i{i}"), "InvoiceSent", json!({"i": i}));
    outbox::enqueue_all(&db.client, &[order(0), invoice(0)])
        .await
        .unwrap();
    db.wait_drained("the first order and invoice delivered").await;

    redis.stop().await.unwrap();
    outbox::enqueue_all(&db.client, &(1..4).map(order).collect::<Vec<_>>())
        .await
        .unwrap();
    relay
        .wait_for_notification("STATUS=sink redis route orders unavailable", LONG)
        .await
        .expect("the route's breaker opened");
    let route = [("sink", "redis"), ("route", "orders")];
    wait_until("outbox_sink_up of the route at 0", LONG, || {
        let addr = addr.clone();
        async move { value(&scrape(&addr).await.1, "outbox_sink_up", &route) == Some(0.0) }
    })
    .await;
    // The other route delivers meanwhile.
    outbox::enqueue_all(&db.client, &(1..4).map(invoice).collect::<Vec<_>>())
        .await
        .unwrap();
    wait_until("the invoices delivered while Redis is down", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'invoices' AND published_at IS NOT NULL")
            .await
            == 4
    })
    .await;
    // The outage lasts: ten probe intervals and more, each a chance to log.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(
        value(&s, "outbox_sink_up", &route),
        Some(0.0),
        "still down: {body}"
    );
    assert_eq!(
        value(&s, "outbox_sink_up", &[("sink", "http"), ("route", "default")]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NULL")
            .await,
        3,
        "the fault happened: no order delivered while Redis was down"
    );

    redis.restart().await.unwrap();
    relay
        .wait_for_notification("STATUS=sink redis route orders available", LONG)
        .await
        .expect("the route's breaker closed");
    db.wait_drained("the orders delivered once Redis is back").await;
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0,
        "the outage spent no attempt"
    );
    let lines = stop_relay(relay).await;

    let said = |level: &str, text: &str| -> Vec<&String> {
        lines
            .iter()
            .filter(|l| l.contains(&format!(" {level} ")) && l.contains(text))
            .collect()
    };
    let unavailable = said("WARN", "sink unavailable");
    assert_eq!(unavailable.len(), 1, "{lines:#?}");
    assert!(
        unavailable[0].contains("sink=\"redis\"") && unavailable[0].contains("route=\"orders\""),
        "{unavailable:?}"
    );
    let available = said("INFO", "sink available again");
    assert_eq!(available.len(), 1, "{lines:#?}");
    assert!(available[0].contains("route=\"orders\""), "{available:?}");
    let noisy: Vec<&String> = lines
        .iter()
        .filter(|l| !l.contains(" DEBUG ") && (l.contains("unavailable") || l.contains("probe")))
        .filter(|l| !l.contains("sink unavailable; sending it nothing"))
        .collect();
    assert!(noisy.is_empty(), "no other line about the outage: {noisy:#?}");
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("router") && !l.contains(" DEBUG ")),
        "{lines:#?}"
    );
    let _ = std::fs::remove_file(config);
}
