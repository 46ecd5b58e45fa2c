//! `outbox admin`: the console in headless Chromium driven over WebDriver
//! (fantoccini + chromedriver), and its security over plain HTTP: tokens,
//! sessions, CSRF, headers, read-only mode, the loopback rule.

use std::path::PathBuf;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use outbox::{Event, Outbox};
use outbox_testkit::{Receiver, Respond, Spawned};
use reqwest::StatusCode;
use serde_json::json;

use crate::support::{Db, LONG, outbox_cmd, run_cli, start_relay, stop_relay, text, wait_until};

pub(crate) const TOKEN: &str = "test-admin-token-0123456789";
const SCRIPT: &str = "<script>alert(1)</script>";
const IMG: &str = "\"><img src=x onerror=alert(1)>";

/// `outbox admin` on a free loopback port, ready (`READY=1`).
pub async fn start_admin(url: &str, token: Option<&str>) -> (Spawned, String) {
    let port = outbox_testkit::free_port();
    let mut cmd = outbox_cmd();
    cmd.args(["admin", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", url);
    if let Some(token) = token {
        cmd.env("OUTBOX_ADMIN_TOKEN", token);
    }
    let admin = Spawned::spawn_notified(cmd).expect("spawn outbox admin");
    admin
        .wait_for_notification("READY=1", LONG)
        .await
        .expect("admin ready");
    (admin, format!("http://127.0.0.1:{port}"))
}

pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn dead(db: &Db) -> i64 {
    db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
        .await
}

/// Where screenshots go: `target/test-artifacts/admin/`.
fn artifacts() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target tmp dir is inside the target dir")
        .join("test-artifacts/admin");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// chromedriver on a free port, answering `/status` with ready.
pub(crate) async fn start_chromedriver() -> (Spawned, String) {
    let driver = ["chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("chromedriver is not installed: `apt-get install chromium chromium-driver` (scripts/test.sh installs them as root)");
    let port = outbox_testkit::free_port();
    let mut cmd = tokio::process::Command::new(driver);
    cmd.arg(format!("--port={port}"));
    let spawned = Spawned::spawn(cmd).expect("spawn chromedriver");
    let url = format!("http://127.0.0.1:{port}");
    let client = http();
    wait_until("chromedriver ready", LONG, || async {
        let Ok(r) = client.get(format!("{url}/status")).send().await else {
            return false;
        };
        r.json::<serde_json::Value>()
            .await
            .is_ok_and(|v| v["value"]["ready"] == true)
    })
    .await;
    (spawned, url)
}

pub(crate) async fn browser(webdriver: &str) -> Client {
    // fantoccini's rustls connector needs a process-wide provider; two are
    // compiled in (ring, aws-lc through other crates), so name one. Another
    // test may have installed it already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1100", "--hide-scrollbars"]
        }),
    );
    ClientBuilder::rustls()
        .expect("rustls with native roots")
        .capabilities(caps)
        .connect(webdriver)
        .await
        .expect("a WebDriver session in headless chromium")
}

pub(crate) async fn text_of(b: &Client, css: &str) -> String {
    match b.find(Locator::Css(css)).await {
        Ok(element) => element.text().await.unwrap(),
        Err(e) => panic!("{css} on {:?}: {e}", b.current_url().await),
    }
}

/// No alert is open and the page has no element an injected payload would
/// have made.
pub(crate) async fn assert_inert(b: &Client) {
    let alert = b.get_alert_text().await;
    assert!(
        alert.as_ref().is_err_and(|e| e.is_no_such_alert()),
        "an alert opened: {alert:?}"
    );
    for css in ["script", "img"] {
        assert_eq!(
            b.find_all(Locator::Css(css)).await.unwrap().len(),
            0,
            "a <{css}> element in {:?}",
            b.current_url().await
        );
    }
}

pub(crate) async fn screenshot(b: &Client, name: &str) -> PathBuf {
    let png = b.screenshot().await.unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a PNG screenshot"
    );
    let path = artifacts().join(name);
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
    path
}

/// The whole operator story in a real browser: sign in with the token, see
/// the dead letters a refusing sink made (payloads holding markup shown as
/// text, nothing run), read an event's story, requeue them all through the
/// dry-run page once the sink accepts, and watch the backlog drain; a
/// request without the token and a POST without the CSRF token change
/// nothing.
#[tokio::test]
async fn admin_console_in_chromium_requeues_dead_letters_and_payloads_stay_inert() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Status(422)).await.unwrap();
    let tx = db.client.transaction().await.unwrap();
    Outbox::default()
        .enqueue_all(
            &tx,
            &[
                Event::new("orders", "o-1", "OrderPlaced", json!({"note": SCRIPT}))
                    .with_header("x-note", IMG),
                Event::new("orders", "o-2", "OrderPlaced", json!({"note": IMG})),
                Event::new("payments", "p-1", "PaymentTaken", json!({"amount": 3})),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let drain = run_cli(&["relay", "--sink", &receiver.url(), "--drain"], &env).await;
    assert_eq!(drain.status.code(), Some(1), "{}", text(&drain.stderr));
    assert_eq!(receiver.count(), 3, "the sink refused each event once");
    assert_eq!(dead(&db).await, 3, "three dead letters");
    // A later event of o-1, behind its dead letter.
    let tx = db.client.transaction().await.unwrap();
    Outbox::default()
        .enqueue(&tx, &Event::new("orders", "o-1", "OrderShipped", json!({})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let first: i64 = db
        .client
        .query_one("SELECT min(id) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    let later: i64 = db
        .client
        .query_one("SELECT max(id) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);

    let (admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let (_driver, webdriver) = start_chromedriver().await;
    let b = browser(&webdriver).await;

    // Without the token: the sign-in form, 401, and a POST changes nothing.
    let h = http();
    let anonymous = h.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let anonymous = h
        .post(format!("{base}/dead/requeue"))
        .form(&[("scope", "filtered")])
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(dead(&db).await, 3, "an anonymous POST requeued nothing");

    // Sign in.
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
    wait_until("the overview after sign-in", LONG, || async {
        b.find(Locator::Id("dead-total")).await.is_ok()
    })
    .await;
    assert_eq!(text_of(&b, "#dead-total").await, "3");
    assert_eq!(text_of(&b, "#backlog-total").await, "1");
    assert!(
        text_of(&b, "#dead-by-error")
            .await
            .contains("permanent: HTTP 422 Unprocessable Entity")
    );
    screenshot(&b, "overview-dead-letters.png").await;

    // The session cookie alone cannot change anything: no CSRF token, 403.
    let cookie = b.get_named_cookie("outbox_admin").await.unwrap();
    assert_eq!(cookie.http_only(), Some(true));
    let session = format!("outbox_admin={}", cookie.value());
    for csrf in [None, Some("forged")] {
        let mut form = vec![("scope", "filtered")];
        form.extend(csrf.map(|c| ("csrf", c)));
        let refused = h
            .post(format!("{base}/dead/requeue"))
            .header("cookie", &session)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::FORBIDDEN, "csrf {csrf:?}");
        assert!(refused.text().await.unwrap().contains("CSRF token"));
    }
    assert_eq!(
        dead(&db).await,
        3,
        "a POST without the CSRF token requeued nothing"
    );

    // The dead letters, payloads shown as text.
    b.goto(&format!("{base}/dead")).await.unwrap();
    assert_eq!(b.find_all(Locator::Css("tr.dead")).await.unwrap().len(), 3);
    assert!(
        text_of(&b, "#dead-count")
            .await
            .starts_with("3 dead letters match")
    );
    for summary in b.find_all(Locator::Css("details summary")).await.unwrap() {
        summary.click().await.unwrap();
    }
    let payloads: Vec<String> = {
        let mut out = Vec::new();
        for p in b
            .find_all(Locator::Css("pre.payload, pre.headers"))
            .await
            .unwrap()
        {
            out.push(p.text().await.unwrap());
        }
        out
    };
    let all = payloads.join("\n");
    assert!(all.contains(SCRIPT), "the script payload shows as text: {all}");
    assert!(all.contains("<img src=x onerror=alert(1)>"), "{all}");
    assert_inert(&b).await;
    screenshot(&b, "dead-letters.png").await;

    // An event's story: the dead letter, and the event held behind it.
    b.goto(&format!("{base}/event?id={first}")).await.unwrap();
    let story = text_of(&b, "#story").await;
    assert!(story.starts_with("Dead letter since"), "{story}");
    assert!(story.contains("permanent: HTTP 422"), "{story}");
    assert_eq!(
        text_of(&b, "#payload").await,
        format!("{{\n  \"note\": \"{SCRIPT}\"\n}}")
    );
    assert_inert(&b).await;
    b.goto(&format!("{base}/event?id={later}")).await.unwrap();
    let story = text_of(&b, "#story").await;
    assert!(
        story.contains(&format!("event {first} is not delivered")),
        "{story}"
    );
    assert!(story.contains("which no live relay holds"), "{story}");
    b.find(Locator::Id("held-behind"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the held-behind link leads to the dead letter", LONG, || async {
        b.current_url()
            .await
            .is_ok_and(|u| u.query() == Some(&format!("id={first}")))
    })
    .await;
    screenshot(&b, "event-story.png").await;

    // The sink accepts now; a relay runs (and delivers the later event).
    receiver.set_respond(Respond::Ok);
    let relay = start_relay(&db.url, &receiver.url(), &[], &[]).await;
    wait_until("the later event delivered", LONG, || async {
        db.unpublished().await == 3
    })
    .await;
    assert_eq!(receiver.count(), 4);

    // Requeue every dead letter: the dry run first, then the POST.
    b.goto(&format!("{base}/dead")).await.unwrap();
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
    assert_eq!(text_of(&b, "#dry-run").await, "3 dead letters will be requeued.");
    assert_eq!(text_of(&b, "#confirm").await, "Yes, requeue 3 dead letters");
    assert_eq!(dead(&db).await, 3, "the dry run changed nothing");
    screenshot(&b, "requeue-dry-run.png").await;
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
    assert!(
        text_of(&b, "#result")
            .await
            .starts_with("Requeued 3 dead letters")
    );

    // The backlog drains: reload the overview until it says 0.
    wait_until("the overview's backlog at 0", LONG, || async {
        b.goto(&format!("{base}/")).await.unwrap();
        text_of(&b, "#backlog-total").await == "0" && text_of(&b, "#dead-total").await == "0"
    })
    .await;
    assert_eq!(db.unpublished().await, 0);
    assert_eq!(receiver.count(), 7, "3 refused, 1 later event, 3 requeued");
    assert_inert(&b).await;
    screenshot(&b, "overview.png").await;
    let audited: (String, String, i64) = {
        let r = db
            .client
            .query_one("SELECT who, action, affected FROM outbox_audit", &[])
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(
        audited,
        ("admin".to_owned(), "requeue".to_owned(), 3),
        "the audit row"
    );
    assert_eq!(
        admin.count_lines("admin: requeued 3 dead letters"),
        1,
        "{:#?}",
        admin.lines()
    );
    assert!(
        admin.lines().iter().all(|l| !l.contains(TOKEN)),
        "the token never reaches the log"
    );
    b.close().await.unwrap();
    stop_relay(relay).await;
}

/// Makes `n` dead letters directly, as the relay would record them.
async fn dead_letters(db: &mut Db, n: usize) {
    db.insert_events(n, 1).await;
    db.client
        .execute(
            "UPDATE outbox SET dead_at = now(), attempts = 1, last_error = 'permanent: HTTP 422 <b>bold</b>'",
            &[],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn admin_console_takes_bearer_tokens_refuses_wrong_ones_and_sets_strict_headers() {
    let mut db = Db::start().await;
    dead_letters(&mut db, 2).await;
    let (_admin, base) = start_admin(&db.url, Some(TOKEN)).await;
    let h = http();
    let ok = h
        .get(format!("{base}/dead"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let headers = ok.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'; style-src 'self';"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    let page = ok.text().await.unwrap();
    assert!(
        page.contains("permanent: HTTP 422 &lt;b&gt;bold&lt;/b&gt;"),
        "errors are escaped"
    );

    let wrong = h
        .get(format!("{base}/"))
        .bearer_auth("not-the-token-at-all")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let none = h.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(none.status(), StatusCode::UNAUTHORIZED);
    let css = h.get(format!("{base}/admin.css")).send().await.unwrap();
    assert_eq!(css.status(), StatusCode::OK, "the stylesheet is open");

    // A script requeues with the bearer token (no CSRF token: no cookie).
    let wrong = h
        .post(format!("{base}/dead/requeue"))
        .bearer_auth("not-the-token-at-all")
        .form(&[("scope", "selected"), ("id", "1")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(dead(&db).await, 2);
    let no_scope = h
        .post(format!("{base}/dead/requeue"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(
        no_scope.status(),
        StatusCode::BAD_REQUEST,
        "no scope never means all"
    );
    assert_eq!(dead(&db).await, 2);
    let one = h
        .post(format!("{base}/dead/requeue"))
        .bearer_auth(TOKEN)
        .form(&[("scope", "selected"), ("id", "1")])
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), StatusCode::OK);
    assert!(one.text().await.unwrap().contains("Requeued 1 dead letter ("));
    assert_eq!(dead(&db).await, 1);
    let gave_up = h
        .post(format!("{base}/dead/give-up"))
        .bearer_auth(TOKEN)
        .form(&[("scope", "selected"), ("id", "2")])
        .send()
        .await
        .unwrap();
    assert!(
        gave_up
            .text()
            .await
            .unwrap()
            .contains("Gave up on 1 dead letter (")
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE given_up_at IS NOT NULL")
            .await,
        1
    );

    // A browser signs in: a wrong token is refused; the right one gets a
    // session cookie, not `Secure` on loopback.
    let wrong = h
        .post(format!("{base}/login"))
        .form(&[("token", "not-the-token-at-all")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get("set-cookie").is_none());
    let signed_in = h
        .post(format!("{base}/login"))
        .form(&[("token", TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), StatusCode::SEE_OTHER);
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("; HttpOnly; SameSite=Strict; Path=/;"),
        "{cookie}"
    );
    assert!(!cookie.contains("Secure"), "{cookie}");
    let session = cookie.split(';').next().unwrap().to_owned();
    let page = h
        .get(format!("{base}/"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let forged = format!("{session}x");
    let page = h
        .get(format!("{base}/"))
        .header("cookie", &forged)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::UNAUTHORIZED, "an edited cookie");
}

#[tokio::test]
async fn admin_console_without_a_token_is_read_only_and_only_on_loopback() {
    let mut db = Db::start().await;
    dead_letters(&mut db, 2).await;
    let (_admin, base) = start_admin(&db.url, None).await;
    let h = http();
    let page = h.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.text().await.unwrap().contains("read-only: no --admin-token"));
    let dry_run = h
        .get(format!("{base}/dead/confirm?action=requeue-filtered"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(dry_run.contains("2 dead letters will be requeued."), "{dry_run}");
    assert!(
        !dry_run.contains("confirm-form"),
        "no confirmation form when read-only"
    );
    let refused = h
        .post(format!("{base}/dead/requeue"))
        .form(&[("scope", "filtered")])
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    assert!(refused.text().await.unwrap().contains("--admin-token"));
    assert_eq!(dead(&db).await, 2, "a read-only console changed nothing");

    // Not on loopback without a token, nor with a short one: exit 2.
    let public = run_cli(
        &["admin", "--listen", "0.0.0.0:9188"],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(public.status.code(), Some(2), "{}", text(&public.stderr));
    assert!(
        text(&public.stderr).contains("--admin-token"),
        "{}",
        text(&public.stderr)
    );
    let short = run_cli(
        &["admin", "--listen", "0.0.0.0:9188"],
        &[("DATABASE_URL", db.url.as_str()), ("OUTBOX_ADMIN_TOKEN", "short")],
    )
    .await;
    assert_eq!(short.status.code(), Some(2), "{}", text(&short.stderr));
    assert!(text(&short.stderr).contains("at least 16 characters"));
}
