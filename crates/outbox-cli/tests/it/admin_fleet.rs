//! `outbox admin --schemas` (issue 33): the console of a fleet's tenant
//! outboxes. Three tenants with known backlogs and dead letters, one of
//! them held by a session standing in for a fleet process; the list over
//! plain HTTP, and in headless Chromium the list, a tenant's pages and a
//! requeue that changes that tenant's row only.

use fantoccini::Locator;
use outbox::Config;
use outbox_testkit::{Postgres, Spawned};
use reqwest::StatusCode;
use tokio_postgres::Client;

use crate::admin::{TOKEN, browser, http, screenshot, start_chromedriver, text_of};
use crate::fleet::{migrate_tenant, tenants};
use crate::fleet_ops::{known_backlogs, write};
use crate::support::{LONG, outbox_cmd, run_cli, text, wait_until};

/// tenant_0: 5 events, one published, one waiting an hour for its retry
/// (backlog 4: 3 due, 1 waiting); tenant_1: 6 events, one dead (backlog
/// 5); tenant_2: 4 events, two dead, one given up (backlog 1, 2 dead).
/// other_0, outside the pattern, holds an outbox of 3 events.
async fn three_tenants(pg: &Postgres) -> (Client, Vec<Config>) {
    let configs = tenants(pg, "app_0", 3, true).await;
    let mut client = pg.connect("app_0").await.unwrap();
    known_backlogs(&client, &configs).await;
    let other = Config::new("other_0", "outbox").unwrap();
    migrate_tenant(&mut client, &other).await;
    write(&client, &other, 3).await;
    (client, configs)
}

/// A session holding tenant_2's own lock, as a fleet process's control
/// session does, named `fleet-a`: its pid.
async fn hold_tenant_2(pg: &Postgres) -> (Client, i32) {
    let holder = pg.connect("app_0").await.unwrap();
    holder
        .batch_execute("SET application_name = 'fleet-a'")
        .await
        .unwrap();
    let pid: i32 = holder
        .query_one(
            "SELECT pg_advisory_lock($1, hashtext('tenant_2.outbox') & 2147483647), pg_backend_pid()",
            &[&outbox::sql::fleet::OWN_LOCK],
        )
        .await
        .unwrap()
        .get(1);
    (holder, pid)
}

/// `outbox admin --schemas tenant_%` with the token, ready.
async fn start_fleet_admin(url: &str) -> (Spawned, String) {
    let port = outbox_testkit::free_port();
    let mut cmd = outbox_cmd();
    cmd.args([
        "admin",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--schemas",
        "tenant_%",
    ])
    .env("DATABASE_URL", url)
    .env("OUTBOX_ADMIN_TOKEN", TOKEN);
    let admin = Spawned::spawn_notified(cmd).expect("spawn outbox admin");
    admin
        .wait_for_notification("READY=1", LONG)
        .await
        .expect("admin ready");
    (admin, format!("http://127.0.0.1:{port}"))
}

/// The list's row of `schema` as maud renders it, up to its oldest-unpublished
/// cell (whose age depends on the clock), and its served-by cell.
fn row(schema: &str, [backlog, due, waiting, dead]: [i64; 4], served: &str) -> (String, String) {
    (
        format!(
            "<tr class=\"outbox\" id=\"outbox-{schema}\"><td><a class=\"outbox-link\" href=\"/o/{schema}/\">{schema}.outbox</a></td>\
             <td class=\"num backlog\">{backlog}</td><td class=\"num due\">{due}</td><td class=\"num waiting\">{waiting}</td>\
             <td class=\"num dead\">{dead}</td>"
        ),
        format!("<td class=\"served\">{served}</td></tr>"),
    )
}

/// The list over plain HTTP: rows by backlog with exact numbers and who
/// serves each, the totals; a tenant's pages under `/o/<schema>/`; an
/// unknown, invalid or non-matching schema 404; no token, 401; --databases
/// refused (exit 2).
#[tokio::test]
async fn admin_fleet_list_over_http_shows_each_tenant_by_backlog_with_totals() {
    let pg = Postgres::start().await.unwrap();
    let (_client, _configs) = three_tenants(&pg).await;
    let (_holder, pid) = hold_tenant_2(&pg).await;
    let url = pg.url("app_0");
    let (_admin, base) = start_fleet_admin(&url).await;
    let h = http();

    let anonymous = h.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let anonymous = h.get(format!("{base}/o/tenant_1/")).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);

    let list = h.get(format!("{base}/")).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(list.status(), StatusCode::OK);
    let page = list.text().await.unwrap();
    // Each row in order, then its served-by cell after its age.
    let rows = [
        (
            "tenant_1",
            [5, 5, 0, 1],
            "<span class=\"error\">nobody</span>".to_owned(),
        ),
        (
            "tenant_0",
            [4, 3, 1, 0],
            "<span class=\"error\">nobody</span>".to_owned(),
        ),
        ("tenant_2", [1, 1, 0, 2], format!("fleet-a (pid {pid})")),
    ];
    let mut at = 0;
    for (schema, cells, served) in &rows {
        let (start, served) = row(schema, *cells, served);
        let found = page[at..]
            .find(&start)
            .unwrap_or_else(|| panic!("{start} after byte {at} in {page}"));
        at += found + start.len();
        let cell = page[at..].find("<td class=\"served\">").unwrap();
        assert!(
            page[at + cell..].starts_with(&served),
            "{schema}: {served} in {page}"
        );
    }
    assert_eq!(page.matches("<tr class=\"outbox\"").count(), 3, "{page}");
    assert!(!page.contains("other_0"), "outside the pattern: {page}");
    assert!(
        page.contains(
            "<td class=\"num backlog\">10</td><td class=\"num due\">9</td><td class=\"num waiting\">1</td><td class=\"num dead\">3</td>"
        ),
        "the totals: {page}"
    );
    assert!(page.contains("1 served, 2 by nobody"), "{page}");
    assert!(page.contains("<th>total (3 outboxes)</th>"), "{page}");
    assert!(!page.contains("id=\"more\""), "all three shown: {page}");

    // A tenant's pages, its links under its prefix.
    let overview = h
        .get(format!("{base}/o/tenant_1/"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(overview.status(), StatusCode::OK);
    let overview = overview.text().await.unwrap();
    assert!(overview.contains("<span class=\"table\" id=\"outbox-label\">tenant_1.outbox</span>"));
    assert!(
        overview.contains("<span id=\"backlog-total\">5</span>"),
        "{overview}"
    );
    assert!(
        overview.contains("<span id=\"dead-total\">1</span>"),
        "{overview}"
    );
    assert!(overview.contains("href=\"/o/tenant_1/dead\""), "{overview}");
    assert!(overview.contains("id=\"fleet-list\" href=\"/\""), "{overview}");
    let dead = h
        .get(format!("{base}/o/tenant_2/dead"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(dead.contains("3 dead letters match"), "given up ones too: {dead}");
    let no_slash = h
        .get(format!("{base}/o/tenant_0"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(no_slash.status(), StatusCode::OK);
    assert!(
        no_slash
            .text()
            .await
            .unwrap()
            .contains("<span id=\"backlog-total\">4</span>")
    );

    // Unknown, outside the pattern, not a schema name, not a page: 404.
    for path in [
        "/o/tenant_9/",
        "/o/other_0/",
        "/o/other_0/dead",
        "/o/Tenant_1/",
        "/o/tenant_1%22/",
        "/o/tenant_1/nope",
        "/o/",
    ] {
        let r = h
            .get(format!("{base}{path}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
    }
    // A requeue posted to a schema outside the pattern changes nothing.
    let r = h
        .post(format!("{base}/o/other_0/dead/requeue"))
        .bearer_auth(TOKEN)
        .form(&[("scope", "filtered")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    // The picker in every page's header opens a tenant's outbox; its API
    // is under the same prefix, and a schema outside the pattern is 404.
    let picked = h
        .get(format!("{base}/pick?schema=tenant_1"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(picked.status(), StatusCode::SEE_OTHER);
    assert_eq!(picked.headers()["location"], "/o/tenant_1/");
    let api = h
        .get(format!("{base}/o/tenant_1/api/whoami"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(api.status(), StatusCode::OK);
    let me: serde_json::Value = api.json().await.unwrap();
    assert_eq!(me["outbox"], "tenant_1.outbox");
    let api = h
        .get(format!("{base}/o/other_0/api/overview"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(api.status(), StatusCode::NOT_FOUND);

    let refused = run_cli(
        &["admin", "--schemas", "tenant_%", "--databases", "app_%"],
        &[("DATABASE_URL", url.as_str())],
    )
    .await;
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("--databases"),
        "{}",
        text(&refused.stderr)
    );
}

async fn dead_in(client: &Client, schema: &str) -> i64 {
    client
        .query_one(
            &format!(
                "SELECT count(*) FROM {schema}.outbox WHERE dead_at IS NOT NULL AND given_up_at IS NULL"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The cells of the list's row of `schema`: outbox, backlog, due now,
/// waiting, dead letters.
async fn cells(b: &fantoccini::Client, schema: &str) -> Vec<String> {
    let mut out = Vec::new();
    for td in b
        .find_all(Locator::Css(&format!("#outbox-{schema} td")))
        .await
        .unwrap()
        .into_iter()
        .take(5)
    {
        out.push(td.text().await.unwrap());
    }
    out
}

/// In Chromium: sign in, the list in order, a row's link to that tenant's
/// overview, and a requeue of tenant_1's dead letter from its page (with
/// the session's CSRF token) that changes tenant_1's row only.
#[tokio::test]
async fn admin_fleet_in_chromium_lists_tenants_and_requeues_one_tenants_dead_letter() {
    let pg = Postgres::start().await.unwrap();
    let (client, _configs) = three_tenants(&pg).await;
    let url = pg.url("app_0");
    let (admin, base) = start_fleet_admin(&url).await;
    let (_driver, webdriver) = start_chromedriver().await;
    let b = browser(&webdriver).await;

    b.goto(&format!("{base}/")).await.unwrap();
    b.form(Locator::Css("form.login"))
        .await
        .unwrap()
        .set_by_name("token", TOKEN)
        .await
        .unwrap()
        .submit()
        .await
        .unwrap();
    wait_until("the list after sign-in", LONG, || async {
        b.find(Locator::Id("outboxes")).await.is_ok()
    })
    .await;
    let mut order = Vec::new();
    for a in b.find_all(Locator::Css("a.outbox-link")).await.unwrap() {
        order.push(a.text().await.unwrap());
    }
    assert_eq!(order, ["tenant_1.outbox", "tenant_0.outbox", "tenant_2.outbox"]);
    assert_eq!(
        cells(&b, "tenant_1").await,
        ["tenant_1.outbox", "5", "5", "0", "1"]
    );
    assert_eq!(
        cells(&b, "tenant_0").await,
        ["tenant_0.outbox", "4", "3", "1", "0"]
    );
    assert_eq!(
        cells(&b, "tenant_2").await,
        ["tenant_2.outbox", "1", "1", "0", "2"]
    );
    assert_eq!(text_of(&b, "#outbox-tenant_1 td.served").await, "nobody");
    screenshot(&b, "fleet-list.png").await;

    // tenant_0's row leads to tenant_0's overview.
    b.find(Locator::Css("#outbox-tenant_0 a.outbox-link"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("tenant_0's overview", LONG, || async {
        b.find(Locator::Id("backlog-total")).await.is_ok()
    })
    .await;
    assert_eq!(b.current_url().await.unwrap().path(), "/o/tenant_0/");
    assert_eq!(text_of(&b, "#outbox-label").await, "tenant_0.outbox");
    assert_eq!(text_of(&b, "#backlog-total").await, "4");
    assert_eq!(text_of(&b, "#dead-total").await, "0");

    // Back to the list, then tenant_1's dead letters: requeue them. The
    // link is clicked until it takes: under load a click can land while
    // the page is still being replaced (a stale element).
    wait_until("the link back to the list clicked", LONG, || async {
        match b.find(Locator::Id("fleet-list")).await {
            Ok(link) => link.click().await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    wait_until("the list again", LONG, || async {
        b.find(Locator::Id("outboxes")).await.is_ok()
    })
    .await;
    b.find(Locator::Css("#outbox-tenant_1 a.outbox-link"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("tenant_1's overview", LONG, || async {
        b.find(Locator::Id("dead-total")).await.is_ok()
    })
    .await;
    assert_eq!(text_of(&b, "#dead-total").await, "1");
    b.find(Locator::LinkText("Dead letters"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("tenant_1's dead letters", LONG, || async {
        b.find(Locator::Id("dead-count")).await.is_ok()
    })
    .await;
    assert_eq!(b.current_url().await.unwrap().path(), "/o/tenant_1/dead");
    assert_eq!(b.find_all(Locator::Css("tr.dead")).await.unwrap().len(), 1);
    b.find(Locator::Css("button[value=requeue-filtered]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the dry-run page", LONG, || async {
        b.find(Locator::Id("dry-run")).await.is_ok()
    })
    .await;
    assert_eq!(text_of(&b, "#dry-run").await, "1 dead letter will be requeued.");
    assert_eq!(
        dead_in(&client, "tenant_1").await,
        1,
        "the dry run changed nothing"
    );
    b.find(Locator::Id("confirm"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the requeue's result", LONG, || async {
        b.find(Locator::Id("result")).await.is_ok()
    })
    .await;
    assert_eq!(b.current_url().await.unwrap().path(), "/o/tenant_1/dead/requeue");
    assert!(text_of(&b, "#result").await.starts_with("Requeued 1 dead letter"));
    assert_eq!(dead_in(&client, "tenant_1").await, 0);
    assert_eq!(dead_in(&client, "tenant_2").await, 2, "tenant_2 untouched");

    // The list: tenant_1's row changed, the others did not.
    b.goto(&format!("{base}/")).await.unwrap();
    assert_eq!(
        cells(&b, "tenant_1").await,
        ["tenant_1.outbox", "6", "6", "0", "0"]
    );
    assert_eq!(
        cells(&b, "tenant_0").await,
        ["tenant_0.outbox", "4", "3", "1", "0"]
    );
    assert_eq!(
        cells(&b, "tenant_2").await,
        ["tenant_2.outbox", "1", "1", "0", "2"]
    );
    screenshot(&b, "fleet-list-after-requeue.png").await;
    assert_eq!(
        admin.count_lines("admin: requeued 1 dead letter"),
        1,
        "{:#?}",
        admin.lines()
    );
    assert!(
        admin
            .lines()
            .iter()
            .any(|l| l.contains("admin: requeued 1 dead letter") && l.contains("tenant_1.outbox")),
        "the log names the outbox: {:#?}",
        admin.lines()
    );
    b.close().await.unwrap();
}
