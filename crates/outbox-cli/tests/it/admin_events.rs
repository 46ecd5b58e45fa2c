//! `outbox admin`'s `/events` and `/aggregate` (issue 36) in headless
//! Chromium, over 10,000 events in mixed states and types: each filter
//! shows exactly the rows the states' definitions select, newest first;
//! paging older to the end and newer back shows every row once; an
//! aggregate's page lists its events in order and marks the one holding
//! the rest back; markup in an aggregate id, event type, error or payload
//! shows as text. Over HTTP: a bad filter is 422 (a page, and JSON under
//! `/api/`), the JSON twins answer the same rows, and a fleet serves the
//! pages under `/o/<schema>/`.

use fantoccini::{Client, Locator};
use outbox::Config;
use reqwest::StatusCode;
use serde_json::Value;

use crate::admin::{
    TOKEN, assert_inert, browser, http, screenshot, start_admin, start_chromedriver, text_of,
};
use crate::fleet::migrate_tenant;
use crate::support::{Db, LONG, outbox_cmd, wait_until};

const SCRIPT: &str = "<script>alert(1)</script>";
const IMG: &str = "\"><img src=x onerror=alert(1)>";

/// 10,000 events, created a second apart: aggregate types by `g % 3`
/// (orders, payments, invoices), aggregates `a0`..`a96`, event types
/// `E0`..`E6`; by `g % 10`: 0..=4 delivered, 5 waiting, 6 waiting with an
/// unavailable sink's error (no attempt spent), 7 retrying (`timeout after
/// 30s`), 8 dead (`permanent: HTTP 422`), 9 given up (the same). Then one
/// dead letter holding markup everywhere a value is shown (a dead letter
/// is exempt from the table contract, so its event type may be anything).
const FILL: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, \
        published_at, attempts, last_error, next_attempt_at, dead_at, given_up_at) \
     SELECT (ARRAY['orders', 'payments', 'invoices'])[g % 3 + 1], 'a' || (g % 97), 'E' || (g % 7), \
            jsonb_build_object('g', g), now() - (10000 - g) * interval '1 second', \
            CASE WHEN g % 10 <= 4 THEN now() END, \
            CASE WHEN g % 10 >= 7 THEN 3 ELSE 0 END, \
            CASE g % 10 WHEN 6 THEN 'sink unavailable: connection refused' WHEN 7 THEN 'timeout after 30s' \
                 WHEN 8 THEN 'permanent: HTTP 422' WHEN 9 THEN 'permanent: HTTP 422' END, \
            now() + CASE WHEN g % 10 IN (6, 7) THEN interval '1 hour' ELSE interval '0' END, \
            CASE WHEN g % 10 >= 8 THEN now() END, CASE WHEN g % 10 = 9 THEN now() END \
       FROM generate_series(1, 10000) g";

/// The states as the console defines them, in SQL of their own.
fn state_sql(state: &str) -> &'static str {
    match state {
        "waiting" => "published_at IS NULL AND dead_at IS NULL AND attempts = 0",
        "retrying" => "published_at IS NULL AND dead_at IS NULL AND attempts > 0",
        "delivered" => "published_at IS NOT NULL",
        "dead" => "published_at IS NULL AND dead_at IS NOT NULL AND given_up_at IS NULL",
        "given_up" => "published_at IS NULL AND given_up_at IS NOT NULL",
        other => panic!("no state {other}"),
    }
}

async fn ids(db: &Db, condition: &str, order: &str) -> Vec<i64> {
    let sql = format!("SELECT id FROM outbox WHERE {condition} ORDER BY id {order}");
    let rows = db.client.query(&sql, &[]).await.expect(&sql);
    rows.iter().map(|r| r.get(0)).collect()
}

/// The row ids a page's table shows, in order.
async fn shown(b: &Client, table: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for row in b
        .find_all(Locator::Css(&format!("#{table} tr.event")))
        .await
        .unwrap()
    {
        let id = row.attr("id").await.unwrap().unwrap();
        out.push(id.trim_start_matches("event-").parse().unwrap());
    }
    out
}

async fn goto(b: &Client, url: &str) {
    b.goto(url).await.unwrap();
}

/// Clicks `#link` and waits for the next page to load.
async fn follow(b: &Client, link: &str) {
    let before = b.current_url().await.unwrap();
    b.find(Locator::Id(link)).await.unwrap().click().await.unwrap();
    wait_until(&format!("the page behind #{link}"), LONG, || async {
        b.current_url().await.is_ok_and(|u| u != before)
    })
    .await;
}

async fn sign_in(b: &Client, base: &str) {
    goto(b, &format!("{base}/events")).await;
    b.form(Locator::Css("form.login"))
        .await
        .unwrap()
        .set_by_name("token", TOKEN)
        .await
        .unwrap()
        .submit()
        .await
        .unwrap();
    wait_until("signed in", LONG, || async {
        b.find(Locator::Id("overview-link")).await.is_ok()
    })
    .await;
}

#[tokio::test]
async fn admin_events_filters_pages_and_aggregates_in_chromium() {
    let db = Db::start().await;
    db.client.batch_execute(FILL).await.unwrap();
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, dead_at) \
             VALUES ('orders', $1, $2, jsonb_build_object('note', $2::text), 1, $3, now())",
            &[&IMG, &SCRIPT, &format!("permanent: {SCRIPT} {IMG}")],
        )
        .await
        .unwrap();
    db.client.batch_execute("ANALYZE outbox").await.unwrap();
    let marked: i64 = db.count("SELECT max(id) FROM outbox").await;
    let (_admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let (_driver, webdriver) = start_chromedriver().await;
    let b = browser(&webdriver).await;
    sign_in(&b, &base).await;

    // Every event, newest first: the first page is the 50 highest ids.
    goto(&b, &format!("{base}/events")).await;
    let all = ids(&db, "true", "DESC").await;
    assert_eq!(all.len(), 10_001);
    assert_eq!(shown(&b, "events").await, all[..50]);
    assert!(b.find(Locator::Id("newer")).await.is_err(), "no newer page");

    // Each filter through the form: exactly the rows it selects.
    let filtered = [
        (
            vec![("state", "dead"), ("aggregate_type", "payments")],
            format!("{} AND aggregate_type = 'payments'", state_sql("dead")),
        ),
        (
            vec![("state", "waiting"), ("event_type", "E3")],
            format!("{} AND event_type = 'E3'", state_sql("waiting")),
        ),
        (vec![("aggregate_id", "a17")], "aggregate_id = 'a17'".to_owned()),
        (
            vec![("state", "retrying"), ("error", "timeout")],
            format!("{} AND last_error LIKE '%timeout%'", state_sql("retrying")),
        ),
        (
            vec![("error", "unavailable"), ("aggregate_type", "invoices")],
            "last_error LIKE '%unavailable%' AND aggregate_type = 'invoices'".to_owned(),
        ),
        (vec![("state", "given_up")], state_sql("given_up").to_owned()),
        (vec![("state", "delivered")], state_sql("delivered").to_owned()),
    ];
    for (fields, condition) in &filtered {
        goto(&b, &format!("{base}/events")).await;
        let form = b.form(Locator::Id("events-filters")).await.unwrap();
        for (name, value) in fields {
            form.set_by_name(name, value).await.unwrap();
        }
        form.submit().await.unwrap();
        wait_until("the filtered list", LONG, || async {
            b.current_url()
                .await
                .is_ok_and(|u| u.query().is_some_and(|q| q.contains(fields[0].0)))
        })
        .await;
        let want = ids(&db, condition, "DESC").await;
        assert!(want.len() > 5, "{fields:?} selects {}", want.len());
        let got = shown(&b, "events").await;
        assert_eq!(got, want[..want.len().min(50)], "{fields:?}");
        // Each row shows its state.
        let first = text_of(&b, &format!("#event-{} td.state", got[0])).await;
        let word = match fields.iter().find(|(k, _)| *k == "state").map(|(_, v)| *v) {
            Some("dead") => "dead letter",
            Some("given_up") => "given up",
            Some(s) => s,
            None => "",
        };
        assert!(first.starts_with(word), "{fields:?}: {first}");
    }
    screenshot(&b, "events-filtered.png").await;

    // Paging a filtered result older to the end, then newer back: every
    // row once, in order, pages of 50.
    let condition = format!("{} AND aggregate_type = 'orders'", state_sql("retrying"));
    let want = ids(&db, &condition, "DESC").await;
    assert_eq!(want.len(), 333, "g % 10 = 7 and g % 3 = 0 among 10,000");
    goto(&b, &format!("{base}/events?state=retrying&aggregate_type=orders")).await;
    let mut pages = vec![shown(&b, "events").await];
    while b.find(Locator::Id("older")).await.is_ok() {
        follow(&b, "older").await;
        pages.push(shown(&b, "events").await);
    }
    assert_eq!(
        pages.iter().map(Vec::len).collect::<Vec<_>>(),
        [50, 50, 50, 50, 50, 50, 33]
    );
    assert_eq!(pages.concat(), want, "older: no row missed or repeated");
    let mut back = pages.pop().unwrap();
    while b.find(Locator::Id("newer")).await.is_ok() {
        follow(&b, "newer").await;
        let page = shown(&b, "events").await;
        assert_eq!(page, pages.pop().unwrap(), "newer shows the same pages");
        back.splice(0..0, page);
    }
    assert!(pages.is_empty(), "newer went back to the first page");
    assert_eq!(back, want, "newer: no row missed or repeated");
    assert!(
        b.current_url()
            .await
            .unwrap()
            .query()
            .unwrap()
            .contains("state=retrying"),
        "the links carry the filters"
    );

    // An aggregate: its events oldest first, the first pending one marked
    // and the later pending ones held behind it; reached from a list row.
    goto(
        &b,
        &format!("{base}/events?aggregate_id=a5&aggregate_type=orders"),
    )
    .await;
    b.find(Locator::Css("a.aggregate-link"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the aggregate page", LONG, || async {
        b.find(Locator::Id("aggregate-events")).await.is_ok()
    })
    .await;
    let want = ids(&db, "aggregate_id = 'a5' AND aggregate_type = 'orders'", "ASC").await;
    assert_eq!(shown(&b, "aggregate-events").await, want);
    let blocker: i64 = db
        .count(
            "SELECT min(id) FROM outbox WHERE aggregate_id = 'a5' AND aggregate_type = 'orders' \
              AND published_at IS NULL AND given_up_at IS NULL",
        )
        .await;
    let marked_rows = b.find_all(Locator::Css("tr.blocker")).await.unwrap();
    assert_eq!(marked_rows.len(), 1);
    assert_eq!(
        marked_rows[0].attr("id").await.unwrap(),
        Some(format!("event-{blocker}"))
    );
    assert!(
        text_of(&b, "#blocker")
            .await
            .starts_with(&format!("Event {blocker} (orders) is the first"))
    );
    let held = db
        .count(&format!(
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'a5' AND aggregate_type = 'orders' AND id > {blocker} \
               AND published_at IS NULL AND given_up_at IS NULL"
        ))
        .await;
    assert_eq!(
        b.find_all(Locator::Css("tr.held")).await.unwrap().len() as i64,
        held
    );
    screenshot(&b, "aggregate.png").await;
    // The story links to its aggregate.
    goto(&b, &format!("{base}/event?id={blocker}")).await;
    follow(&b, "aggregate-link").await;
    assert_eq!(shown(&b, "aggregate-events").await, want);

    // Markup in an aggregate id, event type, error and payload is text.
    goto(
        &b,
        &format!(
            "{base}/events?{}",
            encoded(&[("aggregate_id", IMG), ("error", SCRIPT)])
        ),
    )
    .await;
    assert_eq!(shown(&b, "events").await, [marked]);
    let row = text_of(&b, &format!("#event-{marked}")).await;
    assert!(row.contains(SCRIPT) && row.contains(IMG), "{row}");
    assert_inert(&b).await;
    b.find(Locator::Css("#events a.aggregate-link"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the marked aggregate's page", LONG, || async {
        b.find(Locator::Id("aggregate-events")).await.is_ok()
    })
    .await;
    assert_eq!(shown(&b, "aggregate-events").await, [marked]);
    assert!(text_of(&b, "#aggregate-events").await.contains(SCRIPT));
    assert_inert(&b).await;
    goto(&b, &format!("{base}/event?id={marked}")).await;
    assert!(text_of(&b, "#payload").await.contains(SCRIPT));
    assert_inert(&b).await;
    b.close().await.unwrap();
}

fn encoded(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// Over plain HTTP: 422 for each malformed filter (page and JSON), the
/// JSON twins' rows and keysets, 404 for an unknown aggregate, and a
/// fleet's `/o/<schema>/events`.
#[tokio::test]
async fn admin_events_http_422_json_twins_and_fleet_pages() {
    let mut db = Db::start().await;
    db.client.batch_execute(FILL).await.unwrap();
    let (_admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let h = http();
    let get = |path: String| {
        let h = h.clone();
        let base = base.clone();
        async move {
            h.get(format!("{base}{path}"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
        }
    };

    for (query, says) in [
        ("state=nope", "unknown state \"nope\""),
        ("created_from=yesterday", "created_from \"yesterday\""),
        ("before=ten", "before \"ten\" is not a row id"),
        ("after=1&before=2", "not both"),
    ] {
        let page = get(format!("/events?{query}")).await;
        assert_eq!(page.status(), StatusCode::UNPROCESSABLE_ENTITY, "{query}");
        let text = page.text().await.unwrap();
        assert!(text.contains(&says.replace('"', "&quot;")), "{query}: {text}");
        let api = get(format!("/api/events?{query}")).await;
        assert_eq!(api.status(), StatusCode::UNPROCESSABLE_ENTITY, "{query}");
        let body: Value = api.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains(says), "{body}");
    }
    let api = get("/api/aggregate".to_owned()).await;
    assert_eq!(api.status(), StatusCode::UNPROCESSABLE_ENTITY);

    // The JSON twins: the same rows, and keysets that page on.
    let want = ids(
        &db,
        &format!("{} AND aggregate_type = 'payments'", state_sql("dead")),
        "DESC",
    )
    .await;
    let page: Value = get("/api/events?state=dead&aggregate_type=payments".to_owned())
        .await
        .json()
        .await
        .unwrap();
    let got: Vec<i64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_i64().unwrap())
        .collect();
    assert_eq!(got, want[..50]);
    assert_eq!(page["events"][0]["state"], "dead");
    assert_eq!(page["events"][0]["last_error"], "permanent: HTTP 422");
    assert_eq!(page["next"], want[49]);
    assert_eq!(page["prev"], Value::Null);
    let older: Value = get(format!(
        "/api/events?state=dead&aggregate_type=payments&before={}",
        want[49]
    ))
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(older["events"][0]["id"], want[50]);
    assert_eq!(older["prev"], want[50]);

    // A time range: created in [id 2000's instant, id 2100's).
    let from: String = db
        .client
        .query_one(
            "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox WHERE id = 2000",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let until: String = db
        .client
        .query_one(
            "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox WHERE id = 2100",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let page: Value = get(format!("/api/events?created_from={from}&created_before={until}"))
        .await
        .json()
        .await
        .unwrap();
    let got: Vec<i64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_i64().unwrap())
        .collect();
    assert_eq!(got, (2050..2100).rev().collect::<Vec<_>>());

    let agg: Value = get("/api/aggregate?id=a5&type=orders".to_owned())
        .await
        .json()
        .await
        .unwrap();
    let want = ids(&db, "aggregate_id = 'a5' AND aggregate_type = 'orders'", "ASC").await;
    let got: Vec<i64> = agg["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_i64().unwrap())
        .collect();
    assert_eq!(got, want);
    let blockers: Vec<&Value> = agg["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["blocker"] == true)
        .collect();
    assert_eq!(blockers.len(), 1);
    let unknown = get("/api/aggregate?id=nobody".to_owned()).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    assert!(unknown.json::<Value>().await.unwrap()["error"].is_string());
    let unknown = get("/aggregate?id=nobody".to_owned()).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);

    // A fleet serves the same pages under /o/<schema>/.
    let tenant = Config::new("tenant_0", "outbox").unwrap();
    migrate_tenant(&mut db.client, &tenant).await;
    db.client
        .batch_execute(
            "INSERT INTO tenant_0.outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('orders', 't-1', 'Placed', '{}'), ('orders', 't-1', 'Shipped', '{}')",
        )
        .await
        .unwrap();
    let port = outbox_testkit::free_port();
    let mut cmd = outbox_cmd();
    cmd.args([
        "admin",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--schemas",
        "tenant_%",
    ])
    .env("DATABASE_URL", &db.url)
    .env("OUTBOX_ADMIN_TOKEN", TOKEN);
    let fleet = outbox_testkit::Spawned::spawn_notified(cmd).expect("spawn outbox admin");
    fleet
        .wait_for_notification("READY=1", LONG)
        .await
        .expect("admin ready");
    let page = h
        .get(format!(
            "http://127.0.0.1:{port}/o/tenant_0/events?aggregate_id=t-1"
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let text = page.text().await.unwrap();
    assert_eq!(
        (
            text.matches("<tr class=\"event\"").count(),
            text.contains("href=\"/o/tenant_0/aggregate?id=t-1")
        ),
        (2, true),
        "{text}"
    );
}
