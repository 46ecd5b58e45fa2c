//! The console's operations pages in headless Chromium against a real
//! relay, PostgreSQL and HTTP receivers: a route paused from the console
//! stops delivering within a heartbeat while the other route goes on, and
//! resumes; a purge through its dry run writes an audit row; the replay
//! jobs with their progress; the audit trail; live pages; and a pause
//! reason holding markup shown as text.

use fantoccini::{Client, Locator};
use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::admin::{TOKEN, assert_inert, browser, screenshot, start_admin, start_chromedriver, text_of};
use crate::support::{Db, LONG, replay_job, run_cli, start_relay, stop_relay, text, wait_until};

const SCRIPT: &str = "<script>alert(1)</script>";

async fn write(db: &mut Db, aggregate_type: &str, n: usize) {
    let tx = db.client.transaction().await.unwrap();
    let events: Vec<Event> = (0..n)
        .map(|i| {
            Event::new(
                aggregate_type,
                format!("{aggregate_type}-{i}"),
                "Happened",
                json!({ "i": i }),
            )
        })
        .collect();
    Outbox::default().enqueue_all(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
}

async fn waiting(db: &Db, aggregate_type: &str) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_type = $1",
            &[&aggregate_type],
        )
        .await
        .unwrap()
        .get(0)
}

async fn sign_in(b: &Client, base: &str) {
    b.goto(&format!("{base}/login")).await.unwrap();
    b.form(Locator::Css("form.login"))
        .await
        .unwrap()
        .set_by_name("token", TOKEN)
        .await
        .unwrap()
        .submit()
        .await
        .unwrap();
    wait_until("the overview after sign-in", LONG, || async {
        b.find(Locator::Id("backlog-total")).await.is_ok()
    })
    .await;
}

async fn click(b: &Client, css: &str) {
    b.find(Locator::Css(css)).await.unwrap().click().await.unwrap();
}

/// The routes page's state cell of `route`, after a reload.
async fn route_state(b: &Client, base: &str, route: &str) -> String {
    b.goto(&format!("{base}/routes?live=0")).await.unwrap();
    match b.find(Locator::Css(&format!("#route-{route} td.state"))).await {
        Ok(cell) => cell.text().await.unwrap(),
        Err(_) => String::new(),
    }
}

#[tokio::test]
async fn a_route_paused_from_the_console_stops_within_a_heartbeat_and_every_change_is_audited() {
    let mut db = Db::start().await;
    let orders = Receiver::start(Respond::Ok).await.unwrap();
    let others = Receiver::start(Respond::Ok).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("outbox.toml");
    std::fs::write(
        &config,
        format!(
            "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}\"\n",
            others.url(),
            orders.url()
        ),
    )
    .unwrap();
    write(&mut db, "orders", 3).await;
    write(&mut db, "payments", 2).await;
    let relay = start_relay(
        &db.url,
        &others.url(),
        &["--config", config.to_str().unwrap()],
        &[],
    )
    .await;
    db.wait_drained("the first events").await;
    assert_eq!((orders.count(), others.count()), (3, 2));

    let (_admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let (_driver, webdriver) = start_chromedriver().await;
    let b = browser(&webdriver).await;
    sign_in(&b, &base).await;

    // Live pages say so and carry the refresh; `live=0` stops it.
    assert!(text_of(&b, "#live").await.starts_with("Refreshes every 5 s."));
    assert_eq!(
        b.find_all(Locator::Css("meta[http-equiv=refresh]"))
            .await
            .unwrap()
            .len(),
        1
    );
    b.goto(&format!("{base}/?live=0")).await.unwrap();
    assert_eq!(
        b.find_all(Locator::Css("meta[http-equiv=refresh]"))
            .await
            .unwrap()
            .len(),
        0
    );

    // Both routes, as the relay reports them on its heartbeat.
    wait_until("both routes reported with their deliveries", LONG, || async {
        b.goto(&format!("{base}/routes?live=0")).await.unwrap();
        let delivered = |route: &'static str| {
            let b = &b;
            async move {
                match b
                    .find(Locator::Css(&format!("#route-{route} td.delivered")))
                    .await
                {
                    Ok(cell) => cell.text().await.unwrap(),
                    Err(_) => String::new(),
                }
            }
        };
        delivered("orders").await == "3" && delivered("default").await == "2"
    })
    .await;
    assert_eq!(route_state(&b, &base, "orders").await, "delivering");
    // The overview's chart comes from the same rollup, not from rows.
    b.goto(&format!("{base}/?live=0")).await.unwrap();
    let source = text_of(&b, "#throughput-source").await;
    assert!(
        source.starts_with("5 events delivered (the relays' rollup"),
        "{source}"
    );
    b.goto(&format!("{base}/routes?live=0")).await.unwrap();

    // Pause orders from the console, with a reason holding markup.
    click(&b, "#pause-orders").await;
    wait_until("the pause's confirmation", LONG, || async {
        b.find(Locator::Id("dry-run")).await.is_ok()
    })
    .await;
    let dry = text_of(&b, "#dry-run").await;
    assert!(dry.starts_with("Pausing orders stops its delivery to"), "{dry}");
    b.form(Locator::Id("route-form"))
        .await
        .unwrap()
        .set_by_name("reason", SCRIPT)
        .await
        .unwrap();
    click(&b, "#confirm").await;
    wait_until("the pause's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    assert!(text_of(&b, "#result").await.starts_with("Paused route orders"));
    wait_until("the relay honours the pause", LONG, || async {
        route_state(&b, &base, "orders")
            .await
            .contains("every relay honours it")
    })
    .await;
    let state = route_state(&b, &base, "orders").await;
    assert!(state.contains("by admin"), "{state}");
    assert!(state.contains(SCRIPT), "the reason shows as text: {state}");
    assert_inert(&b).await;
    screenshot(&b, "routes-paused.png").await;

    // Orders wait, payments go on: once the later payments arrived, the
    // orders written before them were claimed and left waiting.
    write(&mut db, "orders", 5).await;
    write(&mut db, "payments", 4).await;
    wait_until("the payments delivered", LONG, || async { others.count() == 6 }).await;
    assert_eq!(waiting(&db, "payments").await, 0);
    assert_eq!(waiting(&db, "orders").await, 5, "a paused route delivers nothing");
    assert_eq!(orders.count(), 3);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND attempts > 0")
            .await,
        0,
        "a pause spends no attempt"
    );

    // Resume: every waiting order arrives, once.
    click(&b, "#resume-orders").await;
    wait_until("the resume's confirmation", LONG, || async {
        b.find(Locator::Id("confirm")).await.is_ok()
    })
    .await;
    click(&b, "#confirm").await;
    wait_until("the resume's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    wait_until("the orders delivered", LONG, || async {
        waiting(&db, "orders").await == 0
    })
    .await;
    assert_eq!(orders.count(), 8);
    assert_eq!(others.count(), 6);
    wait_until("the route delivering again", LONG, || async {
        route_state(&b, &base, "orders").await == "delivering"
    })
    .await;
    screenshot(&b, "routes.png").await;

    // Purge: two dead letters given up on long ago, through the dry run.
    db.client
        .execute(
            "UPDATE outbox SET published_at = NULL, dead_at = now() - interval '40 days', \
             given_up_at = now() - interval '40 days', attempts = 1, last_error = 'permanent: HTTP 422' \
             WHERE id IN (SELECT id FROM outbox WHERE aggregate_type = 'payments' ORDER BY id LIMIT 2)",
            &[],
        )
        .await
        .unwrap();
    let before = db.count("SELECT count(*) FROM outbox").await;
    b.goto(&format!("{base}/dead")).await.unwrap();
    b.form(Locator::Id("purge"))
        .await
        .unwrap()
        .submit()
        .await
        .unwrap();
    wait_until("the purge's dry run", LONG, || async {
        b.find(Locator::Id("dry-run")).await.is_ok()
    })
    .await;
    assert!(
        text_of(&b, "#dry-run")
            .await
            .starts_with("2 dead letters given up on before")
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        before,
        "the dry run deleted nothing"
    );
    click(&b, "#confirm").await;
    wait_until("the purge's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    assert!(text_of(&b, "#result").await.starts_with("Deleted 2 dead letters"));
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, before - 2);

    // The audit trail: who did what to how many.
    b.goto(&format!("{base}/audit")).await.unwrap();
    let rows = b.find_all(Locator::Css("#audit tbody tr")).await.unwrap();
    let mut trail = Vec::new();
    for row in rows {
        let action = row
            .find(Locator::Css("td.act"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let who = row
            .find(Locator::Css("td.by"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let affected = row
            .find(Locator::Css("td.affected"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        trail.push(format!("{who} {action} {affected}"));
    }
    assert_eq!(trail, ["admin purge 2", "admin resume 1", "admin pause 1"]);
    assert_inert(&b).await;
    screenshot(&b, "audit.png").await;

    // A replay job and its progress.
    let replay = run_cli(
        &["replay", "--to", &others.url(), "--aggregate-type", "payments"],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(replay.status.code(), Some(0), "{}", text(&replay.stderr));
    b.goto(&format!("{base}/replays")).await.unwrap();
    let job = text_of(&b, "#replay-1").await;
    assert!(job.contains("done"), "{job}");
    assert!(job.contains("4 of 4 sent"), "{job}");
    b.close().await.unwrap();
    stop_relay(relay).await;
}

/// "… S of M sent …" of a replays row.
fn sent_of(row: &str) -> i64 {
    let before = row.split(" of ").next().unwrap_or_default();
    before
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

#[tokio::test]
async fn a_replay_started_from_the_console_delivers_its_events_and_shows_progress() {
    let mut db = Db::start().await;
    write(&mut db, "orders", 200).await;
    write(&mut db, "payments", 7).await;
    db.client
        .execute("UPDATE outbox SET published_at = now()", &[])
        .await
        .unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    // A query value stands for a secret: used, never stored.
    let url = format!("{}?token=s3cret", receiver.url());
    let (_admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let (_driver, webdriver) = start_chromedriver().await;
    let b = browser(&webdriver).await;
    sign_in(&b, &base).await;

    // The form's dry run counts and creates nothing.
    b.goto(&format!("{base}/replays")).await.unwrap();
    assert_eq!(text_of(&b, "#replays-empty").await, "No replay job yet.");
    let form = b.form(Locator::Id("replay-form")).await.unwrap();
    form.set_by_name("to", &url).await.unwrap();
    form.set_by_name("aggregate_type", "orders").await.unwrap();
    // Five a second: a page of one event each, slow enough to cancel.
    form.set_by_name("rate", "5/s").await.unwrap();
    form.submit().await.unwrap();
    wait_until("the replay's dry run", LONG, || async {
        b.find(Locator::Id("dry-run")).await.is_ok()
    })
    .await;
    let dry = text_of(&b, "#dry-run").await;
    assert!(
        dry.starts_with("Would replay 200 events with ids up to 207 to "),
        "{dry}"
    );
    assert!(dry.contains("?token=*** (native, 5/s)"), "{dry}");
    assert_eq!(db.count("SELECT count(*) FROM outbox_replays").await, 0);
    assert_eq!(receiver.count(), 0, "a dry run sends nothing");
    click(&b, "#confirm").await;
    wait_until("the replay's start", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    let started = text_of(&b, "#result").await;
    assert!(
        started.starts_with("Started replay job 1: 200 events with ids up to 207 to "),
        "{started}"
    );

    // Progress: the page refreshes itself while the job runs here.
    wait_until("the first events replayed", LONG, || async {
        receiver.count() >= 2
    })
    .await;
    wait_until("the job's progress on its page", LONG, || async {
        b.goto(&format!("{base}/replays")).await.unwrap();
        let row = text_of(&b, "#replay-1").await;
        row.contains("running here") && sent_of(&row) >= 1
    })
    .await;
    assert_eq!(
        b.find_all(Locator::Css("meta[http-equiv=refresh]"))
            .await
            .unwrap()
            .len(),
        1,
        "live while a job runs"
    );
    screenshot(&b, "replays-running.png").await;

    // Cancel: it stops at a page boundary, every acknowledged event saved.
    click(&b, "#cancel-1").await;
    wait_until("the cancel's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    let cancelled = text_of(&b, "#result").await;
    assert!(
        cancelled.starts_with("Cancelled replay job 1: stopped after id"),
        "{cancelled}"
    );
    let (state, sent) = replay_job(&db, 1).await;
    assert_eq!(state, "stopped");
    assert!((1..200).contains(&sent), "{sent}");
    assert_eq!(
        receiver.count(),
        usize::try_from(sent).unwrap(),
        "the cursor holds every acknowledged event and nothing else"
    );

    // Resume: the masked target needs its URL again, and only its own.
    b.goto(&format!("{base}/replays")).await.unwrap();
    click(&b, "#resume-1").await;
    wait_until("the resume's form", LONG, || async {
        b.find(Locator::Id("replay-resume")).await.is_ok()
    })
    .await;
    let form = b.form(Locator::Id("replay-resume")).await.unwrap();
    form.set_by_name(
        "to",
        &format!(
            "{}?token=s3cret",
            Receiver::start(Respond::Ok).await.unwrap().url()
        ),
    )
    .await
    .unwrap();
    form.submit().await.unwrap();
    wait_until("the refusal", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    let refused = text_of(&b, "#result").await;
    assert!(refused.contains("is not replay job 1's target"), "{refused}");
    assert_eq!(replay_job(&db, 1).await, ("stopped".to_owned(), sent));
    b.goto(&format!("{base}/replays/resume?id=1")).await.unwrap();
    let form = b.form(Locator::Id("replay-resume")).await.unwrap();
    form.set_by_name("to", &url).await.unwrap();
    form.set_by_name("rate", "unlimited").await.unwrap();
    form.submit().await.unwrap();
    wait_until("the resume's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    let resumed = text_of(&b, "#result").await;
    assert!(resumed.starts_with("Resumed replay job 1"), "{resumed}");
    wait_until("the job done", LONG, || async {
        replay_job(&db, 1).await.0 == "done"
    })
    .await;

    // Every order once, none of the payments; the secret nowhere stored.
    let ids: std::collections::BTreeSet<String> = receiver
        .received()
        .iter()
        .map(|p| p.header("idempotency-key").unwrap().to_owned())
        .collect();
    assert_eq!((receiver.count(), ids.len()), (200, 200));
    assert_eq!(replay_job(&db, 1).await, ("done".to_owned(), 200));
    b.goto(&format!("{base}/replays")).await.unwrap();
    let row = text_of(&b, "#replay-1").await;
    assert!(row.contains("done") && row.contains("200 of 200 sent"), "{row}");
    assert!(row.contains("?token=***"), "{row}");
    screenshot(&b, "replays.png").await;
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outbox_replays r, outbox_audit a \
             WHERE r.target LIKE '%s3cret%' OR a.detail::text LIKE '%s3cret%'"
        )
        .await,
        0
    );
    let trail: Vec<(String, String, i64)> = db
        .client
        .query("SELECT who, action, affected FROM outbox_audit ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        trail,
        [
            ("admin".to_owned(), "replay-start".to_owned(), 200),
            ("admin".to_owned(), "replay-cancel".to_owned(), 1),
            ("admin".to_owned(), "replay-resume".to_owned(), 200 - sent),
        ]
    );
    b.close().await.unwrap();
}
