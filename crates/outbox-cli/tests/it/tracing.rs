//! OpenTelemetry traces from `outbox relay --otlp-endpoint` and `outbox
//! consume`, received by the testkit's OTLP/HTTP receiver: the batch span
//! and its claim, deliver and mark children, one event span per event sent
//! linked to the event's own `traceparent`, the inbox span as a child of
//! it; a relay killed mid-batch loses no event and no exported span; with
//! the collector down every event is delivered and the failure said once.

use nix::sys::signal::Signal;
use outbox::{Event, InboxConfig, Outbox};
use outbox_testkit::{OtlpReceiver, ReceivedSpan, Receiver, Redis, Respond, Spawned};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use uuid::Uuid;

use crate::support::{Db, LONG, outbox_cmd, read_stream, start_relay, stop_relay, wait_until};

/// The batch processor exports every 50 ms instead of every 5 s, so spans
/// arrive while the test waits for them rather than only at shutdown.
const FAST_EXPORT: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "50");

/// The `traceparent` the writer of event `i` set: a trace and span of its
/// own per event, sampled.
fn traceparent(i: usize) -> (String, String, String) {
    let trace = format!("{:032x}", 0x5eed_0000_0000_u64 + i as u64);
    let span = format!("{:016x}", 0x100 + i as u64);
    (format!("00-{trace}-{span}-01"), trace, span)
}

/// Writes `n` events of `orders` (10 aggregates), each with its own
/// `traceparent`, in one transaction.
async fn write_traced(db: &mut Db, n: usize, from: usize) {
    let events: Vec<Event> = (from..from + n)
        .map(|i| {
            Event::new("orders", format!("o-{}", i % 10), "OrderPlaced", json!({"i": i}))
                .with_header("traceparent", traceparent(i).0)
        })
        .collect();
    let tx = db.client.transaction().await.unwrap();
    Outbox::default().enqueue_all(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
}

/// event_id → the (trace id, span id) its writer set.
async fn written(db: &Db) -> HashMap<String, (String, String)> {
    let rows = db
        .client
        .query("SELECT event_id, headers->>'traceparent' FROM outbox", &[])
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let id: Uuid = r.get(0);
            let tp: String = r.get(1);
            let parts: Vec<&str> = tp.split('-').collect();
            (id.to_string(), (parts[1].to_owned(), parts[2].to_owned()))
        })
        .collect()
}

fn named<'a>(spans: &'a [ReceivedSpan], name: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn int(span: &ReceivedSpan, key: &str) -> i64 {
    span.attribute(key)
        .and_then(serde_json::Value::as_i64)
        .unwrap_or_else(|| panic!("{} has no integer {key}: {span:#?}", span.name))
}

/// The relay's spans are shaped as docs/tracing.md says: per batch one
/// `outbox.batch` with one `outbox.claim`, `outbox.deliver` and
/// `outbox.mark` child, and under the deliver span one `outbox.event` per
/// event, linked (not parented) to the writer's span.
#[tokio::test]
async fn each_batch_is_a_span_and_each_event_links_to_its_writer() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let otlp = OtlpReceiver::start().await.unwrap();
    // Written before the relay starts: a backlog of 250 drains as 100,
    // 100, 50.
    write_traced(&mut db, 250, 0).await;
    let writers = written(&db).await;
    assert_eq!(writers.len(), 250);
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--batch-size", "100", "--otlp-endpoint", &otlp.endpoint()],
        &[FAST_EXPORT],
    )
    .await;
    db.wait_drained("the backlog delivered").await;
    let spans = otlp
        .wait_for("250 event spans", LONG, |s| named(s, "outbox.event").len() >= 250)
        .await
        .unwrap();
    let lines = stop_relay(relay).await;
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 250);
    // After the stop's flush: nothing more than what was waited for.
    let spans = {
        let after = otlp.spans();
        assert!(after.len() >= spans.len());
        after
    };
    assert!(
        lines.iter().all(|l| !l.contains("exporting spans failed")),
        "{lines:#?}"
    );

    let batches = named(&spans, "outbox.batch");
    let events = named(&spans, "outbox.event");
    assert_eq!(
        events.len(),
        250,
        "one event span per event delivered, none twice"
    );
    let mut counts: Vec<i64> = batches
        .iter()
        .map(|b| int(b, "messaging.batch.message_count"))
        .collect();
    counts.sort_unstable();
    assert_eq!(counts, [50, 100, 100], "the backlog's batches");

    let by_id: HashMap<&str, &ReceivedSpan> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    for batch in &batches {
        assert_eq!(batch.parent_span_id, None, "a batch span is a root");
        assert_eq!(batch.service.as_deref(), Some("outbox-relay"));
        assert_eq!(batch.str_attribute("outbox.table"), Some("public.outbox"));
        assert_eq!(batch.str_attribute("messaging.system"), Some("redis"));
        assert_eq!(batch.str_attribute("messaging.operation.type"), Some("send"));
        assert_eq!(batch.str_attribute("messaging.destination.name"), Some("default"));
        assert!(batch.str_attribute("outbox.relay").is_some_and(|r| !r.is_empty()));
        assert_eq!(
            int(batch, "outbox.batch.delivered"),
            int(batch, "messaging.batch.message_count")
        );
        let children: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|s| s.parent_span_id.as_deref() == Some(batch.span_id.as_str()))
            .collect();
        let mut names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["outbox.claim", "outbox.deliver", "outbox.mark"]);
        for child in &children {
            assert_eq!(child.trace_id, batch.trace_id);
            assert!(
                child.start_unix_nano >= batch.start_unix_nano && child.end_unix_nano <= batch.end_unix_nano,
                "{} inside its batch",
                child.name
            );
        }
        let deliver = children.iter().find(|s| s.name == "outbox.deliver").unwrap();
        let under: Vec<&&ReceivedSpan> = events
            .iter()
            .filter(|e| e.parent_span_id.as_deref() == Some(deliver.span_id.as_str()))
            .collect();
        assert_eq!(under.len() as i64, int(batch, "messaging.batch.message_count"));
    }

    let mut seen = HashSet::new();
    for event in &events {
        let parent = event
            .parent_span_id
            .as_deref()
            .expect("an event span has a parent");
        assert_eq!(by_id[parent].name, "outbox.deliver");
        let id = event.str_attribute("messaging.message.id").expect("message id");
        assert!(seen.insert(id.to_owned()), "event {id} has one span");
        let (trace, span) = &writers[id];
        assert_ne!(
            &event.trace_id, trace,
            "linked, not a child of the writer's trace"
        );
        assert_eq!(
            event.links,
            [(trace.clone(), span.clone())],
            "the link to the writer's span"
        );
        assert_eq!(event.str_attribute("outbox.table"), Some("public.outbox"));
        assert_eq!(event.str_attribute("outbox.aggregate_type"), Some("orders"));
        let waited = event
            .attribute("outbox.event.wait_seconds")
            .and_then(serde_json::Value::as_f64)
            .expect("how long it waited");
        assert!((0.0..60.0).contains(&waited), "waited {waited} s");
        assert!(waited > 0.0, "written before the relay started, so it waited");
    }
    assert_eq!(seen.len(), 250);

    // One real trace as a waterfall, for docs/tracing.md.
    let smallest = batches
        .iter()
        .min_by_key(|b| int(b, "messaging.batch.message_count"))
        .unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target tmp dir is inside the target dir")
        .join("test-artifacts/tracing");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("one-trace.txt"), waterfall(&spans, smallest)).unwrap();
}

/// `batch` and its descendants as text: name, start after the batch's,
/// duration, and a bar on a 48-column time axis (the first three event
/// spans, then how many more).
fn waterfall(spans: &[ReceivedSpan], batch: &ReceivedSpan) -> String {
    const WIDTH: f64 = 48.0;
    let t0 = batch.start_unix_nano;
    let total = (batch.end_unix_nano - t0).max(1) as f64;
    let ms = |ns: u64| ns as f64 / 1e6;
    let line = |depth: usize, s: &ReceivedSpan| {
        let from = ((s.start_unix_nano - t0) as f64 / total * WIDTH).round() as usize;
        let to = (((s.end_unix_nano - t0) as f64 / total * WIDTH).round() as usize).max(from + 1);
        let bar = format!("{}{}", " ".repeat(from), "█".repeat(to - from));
        format!(
            "{:<28} {:>8.2} ms {:>8.2} ms  |{bar:<48}|\n",
            format!("{}{}", "  ".repeat(depth), s.name),
            ms(s.start_unix_nano - t0),
            ms(s.end_unix_nano - s.start_unix_nano),
        )
    };
    let children = |parent: &ReceivedSpan| {
        let mut c: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|s| s.parent_span_id.as_deref() == Some(parent.span_id.as_str()))
            .collect();
        c.sort_by_key(|s| (s.start_unix_nano, s.name.clone()));
        c
    };
    let mut out = format!("{:<28} {:>11} {:>11}\n", "span", "start", "duration");
    out.push_str(&line(0, batch));
    for child in children(batch) {
        out.push_str(&line(1, child));
        let events = children(child);
        for event in events.iter().take(3) {
            out.push_str(&line(2, event));
        }
        if events.len() > 3 {
            out.push_str(&format!("    … {} more outbox.event\n", events.len() - 3));
        }
    }
    out
}

/// A relay killed with SIGKILL while a batch is at the sink: that batch
/// has no spans (it never became durable), the batches it committed
/// before have theirs, and a second relay delivers every event, each with
/// exactly one event span from whichever relay committed it.
#[tokio::test]
async fn a_killed_relay_loses_no_event_and_no_exported_span() {
    let mut db = Db::start().await;
    let sink = Receiver::start(Respond::Ok).await.unwrap();
    let otlp = OtlpReceiver::start().await.unwrap();
    let args = ["--batch-size", "50", "--otlp-endpoint", &otlp.endpoint()];
    write_traced(&mut db, 100, 0).await;
    let mut first = start_relay(&db.url, &sink.url(), &args, &[FAST_EXPORT]).await;
    db.wait_drained("the first 100 delivered").await;
    otlp.wait_for("the first relay's 100 event spans", LONG, |s| {
        named(s, "outbox.event").len() == 100
    })
    .await
    .unwrap();
    let first_name = named(&otlp.spans(), "outbox.batch")[0]
        .str_attribute("outbox.relay")
        .unwrap()
        .to_owned();

    // The next batch reaches the sink, which holds its answer: the relay
    // is killed with it in flight.
    sink.hold();
    let before = sink.count();
    write_traced(&mut db, 100, 100).await;
    sink.wait_for_count(before + 1, LONG).await.unwrap();
    first.signal(Signal::SIGKILL).unwrap();
    let status = first.wait(LONG).await.unwrap();
    assert_eq!(status.code(), None, "killed by a signal");
    sink.release();
    assert_eq!(db.unpublished().await, 100, "the batch in flight was not marked");

    let second = start_relay(&db.url, &sink.url(), &args, &[FAST_EXPORT]).await;
    db.wait_drained("the rest delivered by the second relay").await;
    stop_relay(second).await;

    // Every event reached the sink, those in flight at the kill twice.
    let posts = sink.received();
    let delivered: BTreeMap<String, usize> = posts.iter().fold(BTreeMap::new(), |mut m, p| {
        let id = p.header("idempotency-key").expect("idempotency key").to_owned();
        *m.entry(id).or_default() += 1;
        m
    });
    assert_eq!(delivered.len(), 200, "every event delivered");
    let twice = delivered.values().filter(|n| **n > 1).count();
    assert!(twice >= 1, "the batch in flight was sent again");

    let spans = otlp.spans();
    let events = named(&spans, "outbox.event");
    let ids: HashSet<&str> = events
        .iter()
        .map(|e| e.str_attribute("messaging.message.id").unwrap())
        .collect();
    assert_eq!(
        events.len(),
        200,
        "one span per event committed, none for the killed batch"
    );
    assert_eq!(ids.len(), 200);
    let by_first = named(&spans, "outbox.batch")
        .iter()
        .filter(|b| b.str_attribute("outbox.relay") == Some(first_name.as_str()))
        .map(|b| int(b, "messaging.batch.message_count"))
        .sum::<i64>();
    assert_eq!(
        by_first, 100,
        "the killed relay's spans: its committed batches only"
    );
}

/// With nothing listening at the endpoint the relay delivers every event
/// and says once, not once per export, that spans are dropped.
#[tokio::test]
async fn with_the_collector_down_every_event_is_delivered_and_the_failure_said_once() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let nowhere = format!("http://127.0.0.1:{}", outbox_testkit::free_port());
    write_traced(&mut db, 300, 0).await;
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--batch-size", "20", "--otlp-endpoint", &nowhere],
        // Exports of 50 spans: 300 events make about 20 failed exports.
        &[FAST_EXPORT, ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "50")],
    )
    .await;
    db.wait_drained("every event delivered").await;
    relay
        .wait_for_line("exporting spans failed", LONG)
        .await
        .expect("the failure said");
    let lines = stop_relay(relay).await;
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 300);
    let said: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("exporting spans failed"))
        .collect();
    assert_eq!(said.len(), 1, "said once: {said:#?}");
}

/// `outbox consume`'s span of an inbox transaction is a child of the
/// event's context: same trace, the writer's span as its parent.
#[tokio::test]
async fn the_inbox_span_is_a_child_of_the_event_context() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let otlp = OtlpReceiver::start().await.unwrap();
    outbox::migrate_inbox(&mut db.client, &InboxConfig::default())
        .await
        .unwrap();
    db.client
        .batch_execute("CREATE TABLE shipments (event_id uuid)")
        .await
        .unwrap();
    write_traced(&mut db, 5, 0).await;
    let writers = written(&db).await;
    let relay = start_relay(&db.url, &redis.url(), &[], &[]).await;
    db.wait_drained("published").await;
    stop_relay(relay).await;

    let mut cmd = outbox_cmd();
    cmd.args([
        "consume",
        "--from",
        &redis.url(),
        "--stream",
        "outbox.event.orders",
    ])
    .args(["--group", "shipping", "--otlp-endpoint", &otlp.endpoint()])
    .args(["--apply", "INSERT INTO shipments (event_id) VALUES ($1)"])
    .env("DATABASE_URL", &db.url)
    .env(FAST_EXPORT.0, FAST_EXPORT.1);
    let mut worker = Spawned::spawn_notified(cmd).expect("spawn consumer");
    worker.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("5 events shipped", LONG, || async {
        db.count("SELECT count(*) FROM shipments").await == 5
    })
    .await;
    worker.signal(Signal::SIGTERM).unwrap();
    assert!(worker.wait(LONG).await.unwrap().success());

    // The stop flushed the exporter.
    let spans = otlp.spans();
    let inbox = named(&spans, "outbox.inbox");
    assert_eq!(inbox.len(), 5, "one span per inbox transaction");
    for span in inbox {
        let id = span.str_attribute("messaging.message.id").unwrap();
        let (trace, parent) = &writers[id];
        assert_eq!(&span.trace_id, trace, "in the writer's trace");
        assert_eq!(
            span.parent_span_id.as_ref(),
            Some(parent),
            "the writer's span is its parent"
        );
        assert_eq!(span.kind, 5, "a consumer span");
        assert_eq!(span.service.as_deref(), Some("outbox-consume"));
        assert_eq!(span.str_attribute("messaging.operation.type"), Some("process"));
        assert_eq!(span.str_attribute("outbox.inbox.outcome"), Some("processed"));
    }
}

/// `OTEL_TRACES_SAMPLER=always_off`: the relay delivers as usual and
/// exports nothing (a sampled-out batch builds no children either).
#[tokio::test]
async fn a_relay_sampled_out_exports_nothing() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let otlp = OtlpReceiver::start().await.unwrap();
    write_traced(&mut db, 120, 0).await;
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--batch-size", "50", "--otlp-endpoint", &otlp.endpoint()],
        &[FAST_EXPORT, ("OTEL_TRACES_SAMPLER", "always_off")],
    )
    .await;
    db.wait_drained("every event delivered").await;
    // The stop flushes the exporter: whatever it held has arrived.
    stop_relay(relay).await;
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 120);
    assert_eq!(otlp.spans().len(), 0, "nothing sampled, nothing exported");
}

/// A collector that takes connections and never answers (a blackhole)
/// holds up neither delivery nor the stop: the exporter's thread waits for
/// it, the relay does not, and the flush on the way out gives up after
/// its 5 s bound instead of the export's 10 s timeout.
#[tokio::test]
async fn a_collector_that_never_answers_holds_up_neither_delivery_nor_the_stop() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    // Listening, never accepting: connections complete in the backlog and
    // every request waits for an answer that never comes.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", blackhole.local_addr().unwrap());
    write_traced(&mut db, 300, 0).await;
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--batch-size", "20", "--otlp-endpoint", &endpoint],
        &[FAST_EXPORT, ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "50")],
    )
    .await;
    db.wait_drained("every event delivered while exports hang").await;
    let stopping = std::time::Instant::now();
    stop_relay(relay).await;
    let took = stopping.elapsed();
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 300);
    assert!(
        took < std::time::Duration::from_secs(9),
        "the stop waited {took:?} for a collector that never answers"
    );
    drop(blackhole);
}

/// A fleet (`--schemas`) traces every tenant's batches as a relay of that
/// outbox alone would: each batch and event span carries its own outbox in
/// `outbox.table`, every event has exactly one span, linked to its writer.
#[tokio::test]
async fn a_fleet_traces_each_tenants_batches_under_its_own_outbox() {
    use outbox_testkit::Postgres;
    const PER_TENANT: usize = 20;
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    let otlp = OtlpReceiver::start().await.unwrap();
    let configs = crate::fleet::tenants(&pg, "app_0", 3, true).await;
    let client = pg.connect("app_0").await.unwrap();
    // event_id → (its outbox, its writer's trace and span).
    let mut writers: HashMap<String, (String, String, String)> = HashMap::new();
    for (t, config) in configs.iter().enumerate() {
        let events: Vec<Event> = (0..PER_TENANT)
            .map(|i| {
                let (tp, trace, span) = traceparent(t * 1000 + i);
                let event = Event::new(
                    "orders",
                    format!("t{t}-{}", i % 4),
                    "OrderPlaced",
                    json!({"i": i}),
                )
                .with_header("traceparent", tp);
                writers.insert(event.event_id.to_string(), (config.display_name(), trace, span));
                event
            })
            .collect();
        Outbox::new(config.clone())
            .enqueue_all(&client, &events)
            .await
            .unwrap();
    }
    let url = format!("{}?application_name=fleet_traced", pg.url("app_0"));
    let fleet = start_relay(
        &url,
        &redis.url(),
        &[
            "--schemas",
            "tenant_%",
            "--discover-interval",
            "500ms",
            "--otlp-endpoint",
            &otlp.endpoint(),
        ],
        &[FAST_EXPORT],
    )
    .await;
    wait_until("every tenant's events delivered", LONG, || async {
        crate::fleet::unpublished(&client, &configs).await == 0
    })
    .await;
    let total = PER_TENANT * configs.len();
    otlp.wait_for("an event span per event", LONG, |s| {
        named(s, "outbox.event").len() >= total
    })
    .await
    .unwrap();
    crate::fleet::stop_fleet(fleet).await;
    let spans = otlp.spans();

    let events = named(&spans, "outbox.event");
    assert_eq!(events.len(), total, "one span per event, none twice");
    let mut per_outbox: BTreeMap<String, usize> = BTreeMap::new();
    for event in &events {
        let id = event.str_attribute("messaging.message.id").expect("message id");
        let (outbox, trace, span) = &writers[id];
        assert_eq!(event.str_attribute("outbox.table"), Some(outbox.as_str()), "{id}");
        assert_eq!(event.links, [(trace.clone(), span.clone())], "{id}");
        *per_outbox.entry(outbox.clone()).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> = configs.iter().map(|c| (c.display_name(), PER_TENANT)).collect();
    assert_eq!(per_outbox, expected);
    let batches = named(&spans, "outbox.batch");
    let mut batched: BTreeMap<String, i64> = BTreeMap::new();
    for batch in &batches {
        let outbox = batch
            .str_attribute("outbox.table")
            .expect("its outbox")
            .to_owned();
        *batched.entry(outbox).or_default() += int(batch, "messaging.batch.message_count");
        let children: HashSet<&str> = spans
            .iter()
            .filter(|s| s.parent_span_id.as_deref() == Some(batch.span_id.as_str()))
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(
            children,
            HashSet::from(["outbox.claim", "outbox.deliver", "outbox.mark"]),
            "{}",
            batch.span_id
        );
    }
    let per_tenant = i64::try_from(PER_TENANT).unwrap();
    assert_eq!(
        batched,
        configs
            .iter()
            .map(|c| (c.display_name(), per_tenant))
            .collect::<BTreeMap<_, _>>()
    );
}
