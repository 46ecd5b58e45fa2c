//! Two relays in one process, over two outboxes: each reports its own
//! health, metrics, totals and signals (issue 31, the relay context).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_relay::health::Registry;
use outbox_relay::{OrderMode, Relay, RelayConfig, Signals};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::support::{Answer, Db, Memory};

/// Every signal received so far.
fn drain(rx: &mut UnboundedReceiver<String>) -> Vec<String> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

/// The value of `metric` whose labels include every one of `labels`.
fn value(scrape: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let rest = line.strip_prefix(metric)?;
        let (labelset, number) = rest.strip_prefix('{')?.rsplit_once("} ")?;
        let all = labels
            .iter()
            .all(|(k, v)| labelset.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        all.then(|| number.trim().parse().ok()).flatten()
    })
}

#[tokio::test]
async fn issue_31_two_relays_in_one_process_report_separately() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this test process");
    let mut db = Db::start().await;
    let (public, tenant) = (db.outbox("public").await, db.outbox("tenant").await);
    db.write(&public, 3).await;
    db.write(&tenant, 5).await;

    let config = |outbox| RelayConfig {
        outbox,
        drain: true,
        ordering: OrderMode::Partition,
        poll_interval: Duration::from_millis(200),
        ..RelayConfig::default()
    };
    let pg = outbox_relay::pg::parse_url(&db.url, Duration::from_secs(10)).expect("the test's URL");
    let (up, down) = (
        Arc::new(Memory::new(Answer::Ok)),
        Arc::new(Memory::new(Answer::Down)),
    );
    let (signals_a, mut rx_a) = Signals::channel();
    let (signals_b, mut rx_b) = Signals::channel();
    let a = Relay::new(pg.clone(), up.clone(), config(public)).with_signals(signals_a);
    let b = Relay::new(pg, down.clone(), config(tenant)).with_signals(signals_b);
    let (ctx_a, ctx_b) = (a.context().clone(), b.context().clone());
    assert_ne!(ctx_a.name(), ctx_b.name(), "two relays of one process, two names");
    let relays = Registry::default();
    relays.register(ctx_a.outbox(), Arc::clone(ctx_a.health()));
    relays.register(ctx_b.outbox(), Arc::clone(ctx_b.health()));

    let cancel = CancellationToken::new();
    let (ra, rb) = tokio::time::timeout(
        Duration::from_secs(60),
        futures::future::join(a.run(cancel.clone()), b.run(cancel.clone())),
    )
    .await
    .expect("both drains end within 60 s");
    ra.expect("relay a");
    rb.expect("relay b");

    // The fault happened where it should: b's sink took nothing and left
    // its 5 rows; a delivered its 3, each once.
    assert_eq!(down.acked(), Vec::<i64>::new());
    assert_eq!(up.acked().len(), 3, "{:?}", up.acked());
    assert_eq!(
        db.count("SELECT count(*) FROM public.outbox WHERE published_at IS NOT NULL")
            .await,
        3
    );
    assert_eq!(
        db.count("SELECT count(*) FROM tenant.outbox WHERE published_at IS NULL")
            .await,
        5
    );

    // Totals.
    let (ca, cb) = (ctx_a.counters(), ctx_b.counters());
    assert_eq!(ca.delivered.load(Ordering::Relaxed), 3);
    assert_eq!(cb.delivered.load(Ordering::Relaxed), 0);
    assert!(ca.sink_unavailable.get().is_none());
    assert!(cb.sink_unavailable.get().is_some(), "b stopped for its sink");
    // b's one batch was committed with every row given back, no attempt spent.
    assert_eq!(cb.batches.load(Ordering::Relaxed), 1);
    assert_eq!(cb.failed.load(Ordering::Relaxed), 0);
    assert_eq!(
        db.count("SELECT coalesce(sum(attempts), 0)::int8 FROM tenant.outbox")
            .await,
        0
    );

    // Health: b's sink is down, a's is not; the registry prefixes each.
    let ready = relays.readiness();
    assert_eq!(ready.checks["public.outbox sink memory"], "ok", "{ready:?}");
    assert_eq!(
        ready.checks["tenant.outbox sink memory"], "unavailable: memory sink is down",
        "{ready:?}"
    );
    assert_eq!(ready.checks["public.outbox relay"], "stopped");
    assert!(!ready.ready);

    // Signals: each relay's own channel.
    let (sa, sb) = (drain(&mut rx_a), drain(&mut rx_b));
    assert!(sa.iter().any(|s| s.starts_with("READY=1")), "{sa:?}");
    assert!(sb.iter().any(|s| s.starts_with("READY=1")), "{sb:?}");
    assert!(sa.contains(&"OUTBOX_BATCH=committed".to_owned()), "{sa:?}");
    assert!(
        sb.contains(&"STATUS=sink memory unavailable".to_owned()),
        "{sb:?}"
    );
    assert!(!sa.iter().any(|s| s.contains("unavailable")), "{sa:?}");

    // Metrics: one series per outbox.
    let scrape = recorder.render();
    let delivered = |outbox| value(&scrape, "outbox_events_delivered_total", &[("outbox", outbox)]);
    assert_eq!(delivered("public.outbox"), Some(3.0), "{scrape}");
    assert_eq!(delivered("tenant.outbox"), None, "{scrape}");
    let sink_up = |outbox| {
        value(
            &scrape,
            "outbox_sink_up",
            &[("outbox", outbox), ("sink", "memory")],
        )
    };
    assert_eq!(sink_up("public.outbox"), Some(1.0), "{scrape}");
    assert_eq!(sink_up("tenant.outbox"), Some(0.0), "{scrape}");
}
