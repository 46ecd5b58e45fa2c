//! `outbox admin`'s JSON API (`/api/…`) and named tokens, over plain HTTP
//! against a real PostgreSQL: every endpoint's documented status codes,
//! the dry runs, the audit trail's rows (who, what, how many), and the
//! tokens file's refusals.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::admin::{TOKEN, http};
use crate::support::{Db, LONG, outbox_cmd, replay_job, run_cli, text, wait_until};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-9876543210ab";

/// `outbox admin` with `--admin-token` (named `admin`) and a tokens file
/// naming alice and bob.
async fn start(db: &Db, dir: &tempfile::TempDir) -> (outbox_testkit::Spawned, String) {
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        format!("# who may change rows\nalice@example.com {ALICE}\n\nbob {BOB}\n"),
    )
    .unwrap();
    let port = outbox_testkit::free_port();
    let mut cmd = outbox_cmd();
    cmd.args(["admin", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &db.url)
        .env("OUTBOX_ADMIN_TOKEN", TOKEN)
        .env("OUTBOX_ADMIN_TOKENS_FILE", &file);
    let admin = outbox_testkit::Spawned::spawn_notified(cmd).expect("spawn outbox admin");
    admin
        .wait_for_notification("READY=1", LONG)
        .await
        .expect("admin ready");
    (admin, format!("http://127.0.0.1:{port}"))
}

/// `n` dead letters of aggregate type `orders`, ids 1..=n.
async fn dead_letters(db: &mut Db, n: usize) {
    db.insert_events(n, 1).await;
    db.client
        .execute(
            "UPDATE outbox SET dead_at = now(), attempts = 3, last_error = 'permanent: HTTP 422'",
            &[],
        )
        .await
        .unwrap();
}

async fn get(base: &str, path: &str, token: &str) -> (StatusCode, Value) {
    let r = http()
        .get(format!("{base}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn post(base: &str, path: &str, token: &str, body: Value) -> (StatusCode, Value) {
    let r = http()
        .post(format!("{base}{path}"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn audit(db: &Db) -> Vec<(String, String, i64)> {
    db.client
        .query("SELECT who, action, affected FROM outbox_audit ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

#[tokio::test]
async fn the_api_answers_the_documented_codes_and_every_change_is_audited_under_its_token_name() {
    let mut db = Db::start().await;
    dead_letters(&mut db, 4).await;
    let dir = tempfile::tempdir().unwrap();
    let (_admin, base) = start(&db, &dir).await;

    // Who: each token's name.
    let (status, me) = get(&base, "/api/whoami", ALICE).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(me["who"], "alice@example.com");
    assert_eq!(get(&base, "/api/whoami", TOKEN).await.1["who"], "admin");
    assert_eq!(get(&base, "/api/whoami", BOB).await.1["who"], "bob");

    // 401 without or with a wrong token, as JSON.
    let none = http().get(format!("{base}/api/overview")).send().await.unwrap();
    assert_eq!(none.status(), StatusCode::UNAUTHORIZED);
    assert!(
        none.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .contains("Bearer")
    );
    let (status, wrong) = get(&base, "/api/overview", "not-a-token-of-anyone").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(wrong["error"], "wrong token");

    // Reads.
    let (status, overview) = get(&base, "/api/overview", BOB).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(overview["backlog"][0]["aggregate_type"], "orders");
    assert_eq!(overview["backlog"][0]["dead_letters"], 4);
    let (status, dead) = get(&base, "/api/dead?limit=3", BOB).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(dead["total"], 4);
    assert_eq!(dead["dead_letters"].as_array().unwrap().len(), 3);
    let next = dead["next"].as_i64().unwrap();
    let (_, rest) = get(&base, &format!("/api/dead?limit=3&after={next}"), BOB).await;
    assert_eq!(rest["dead_letters"].as_array().unwrap().len(), 1);
    assert_eq!(rest["next"], Value::Null);
    let (status, story) = get(&base, "/api/event?id=1", BOB).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(story["story"]["event"]["id"], 1);
    assert_eq!(story["reasons"][0]["reason"], "dead");
    // The story of an event with three failed attempts shows each, with
    // what the receiver answered.
    db.client
        .execute(
            "UPDATE outbox SET attempt_log = jsonb_build_array( \
               jsonb_build_object('at', now() - interval '3 minutes', 'attempt', 1, 'outcome', 'retry', 'error', 'HTTP 500: {\"why\": \"db down\"}'), \
               jsonb_build_object('at', now() - interval '2 minutes', 'attempt', 2, 'outcome', 'retry', 'error', 'HTTP 500: <b>still</b>'), \
               jsonb_build_object('at', now() - interval '1 minute', 'attempt', 3, 'outcome', 'dead', 'error', 'permanent: HTTP 422')) \
             WHERE id = 1",
            &[],
        )
        .await
        .unwrap();
    let (_, story) = get(&base, "/api/event?id=1", BOB).await;
    let attempts = story["story"]["event"]["attempt_log"].as_array().unwrap();
    assert_eq!(attempts.len(), 3, "{story}");
    assert_eq!(attempts[2]["outcome"], "dead");
    let page = http()
        .get(format!("{base}/event?id=1"))
        .bearer_auth(BOB)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let table = &page[page.find("<table id=\"attempts\"").expect("the attempts table")..];
    let table = &table[..table.find("</table>").unwrap()];
    assert_eq!(
        table.matches("<tr>").count(),
        4,
        "a header and three attempts: {table}"
    );
    assert!(
        table.contains("HTTP 500: {&quot;why&quot;: &quot;db down&quot;}"),
        "{table}"
    );
    assert!(
        table.contains("HTTP 500: &lt;b&gt;still&lt;/b&gt;"),
        "escaped: {table}"
    );

    // 422: filters and ids that do not parse; 404: no such event or
    // endpoint.
    for path in [
        "/api/dead?older_than=banana",
        "/api/dead?after=x",
        "/api/event?id=nope",
        "/api/event",
        "/api/audit?before=x",
    ] {
        let (status, body) = get(&base, path, BOB).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{path}: {body}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    let (status, body) = get(&base, "/api/event?id=999999", BOB).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, _) = get(&base, "/api/nope", BOB).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // A dry run counts and changes nothing.
    let (status, dry) = post(
        &base,
        "/api/dead/requeue",
        ALICE,
        json!({"scope": "filtered", "aggregate_type": "orders", "dry_run": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{dry}");
    assert_eq!(dry["requeued"], 4);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await,
        4
    );
    assert!(audit(&db).await.is_empty(), "a dry run is not a change");

    // 422 for bodies that do not parse or widen; nothing changes.
    for body in [
        json!({"ids": [1]}),
        json!({"scope": "everything"}),
        json!({"scope": "selected", "ids": []}),
        json!({"scope": "selected", "ids": [1], "surprise": true}),
    ] {
        let (status, answer) = post(&base, "/api/dead/requeue", ALICE, body.clone()).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
    }
    let (status, _) = post(&base, "/api/dead/give-up", ALICE, json!({"scope": "filtered"})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "give-up takes ids only");

    // Changes: 200 with the count and the audit row; 404 when nothing
    // matched, as `outbox dlq` exits 1.
    let (status, done) = post(
        &base,
        "/api/dead/requeue",
        ALICE,
        json!({"scope": "selected", "ids": [1]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done["requeued"], 1);
    assert!(done["audit_id"].as_i64().unwrap() > 0);
    let (status, again) = post(
        &base,
        "/api/dead/requeue",
        ALICE,
        json!({"scope": "selected", "ids": [1]}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{again}");
    assert_eq!(again["requeued"], 0);
    let (status, gave) = post(
        &base,
        "/api/dead/give-up",
        BOB,
        json!({"scope": "selected", "ids": [2, 3]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{gave}");
    assert_eq!(gave["given_up"], 2);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE given_up_at IS NOT NULL")
            .await,
        2
    );

    // Purge: given up on more than a day ago; none yet (200, 0, as the
    // CLI), then the two are backdated and go.
    let (status, none) = post(&base, "/api/dead/purge", BOB, json!({"older_than": 1})).await;
    assert_eq!(status, StatusCode::OK, "{none}");
    assert_eq!(none["deleted"], 0);
    db.client
        .execute(
            "UPDATE outbox SET given_up_at = now() - interval '2 days' WHERE given_up_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let (_, dry) = post(
        &base,
        "/api/dead/purge",
        BOB,
        json!({"older_than": "1d", "dry_run": true}),
    )
    .await;
    assert_eq!(dry["deleted"], 2);
    let (status, purged) = post(&base, "/api/dead/purge", BOB, json!({"older_than": "1d"})).await;
    assert_eq!(status, StatusCode::OK, "{purged}");
    assert_eq!(purged["deleted"], 2);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 2);
    for older_than in [json!("soon"), json!(u64::MAX), json!("100000000d")] {
        let (status, body) = post(&base, "/api/dead/purge", BOB, json!({ "older_than": older_than })).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{older_than}: {body}");
    }

    // Routes: pause, 409 when paused already; resume, 409 when not paused.
    let (status, paused) = post(
        &base,
        "/api/routes/pause",
        ALICE,
        json!({"route": "orders", "reason": "sink migration"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{paused}");
    let (status, _) = post(&base, "/api/routes/pause", ALICE, json!({"route": "orders"})).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (_, routes) = get(&base, "/api/routes", BOB).await;
    let orders = &routes["routes"][0];
    assert_eq!(orders["route"], "orders");
    assert_eq!(orders["pause"]["paused_by"], "alice@example.com");
    assert_eq!(orders["pause"]["reason"], "sink migration");
    // No relay serves it here: the page says nothing honours the pause.
    let page = http()
        .get(format!("{base}/routes"))
        .bearer_auth(BOB)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("nothing honours the pause"), "{page}");
    let (status, _) = post(&base, "/api/routes/resume", BOB, json!({"route": "orders"})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = post(&base, "/api/routes/resume", BOB, json!({"route": "orders"})).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, _) = post(&base, "/api/routes/pause", BOB, json!({"route": ""})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);

    // The audit trail: who, what, how many, in order.
    let expected: Vec<(String, String, i64)> = [
        ("alice@example.com", "requeue", 1),
        ("alice@example.com", "requeue", 0),
        ("bob", "give-up", 2),
        ("bob", "purge", 0),
        ("bob", "purge", 2),
        ("alice@example.com", "pause", 1),
        ("alice@example.com", "pause", 0),
        ("bob", "resume", 1),
        ("bob", "resume", 0),
    ]
    .into_iter()
    .map(|(w, a, n)| (w.to_owned(), a.to_owned(), n))
    .collect();
    assert_eq!(audit(&db).await, expected);
    let (status, trail) = get(&base, "/api/audit?limit=2", TOKEN).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(trail["audit"][0]["action"], "resume");
    assert_eq!(trail["audit"][1]["action"], "resume");
    assert!(trail["next"].is_i64());

    // A browser session's cookie cannot change rows through the API: it
    // would be an ambient credential without a CSRF token.
    let signed_in = http()
        .post(format!("{base}/login"))
        .form(&[("token", ALICE)])
        .send()
        .await
        .unwrap();
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let refused = http()
        .post(format!("{base}/api/dead/requeue"))
        .header("cookie", &cookie)
        .json(&json!({"scope": "selected", "ids": [4]}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let page = http()
        .get(format!("{base}/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("signed in as alice@example.com"), "{page}");
    assert_eq!(audit(&db).await.len(), expected.len(), "nothing more changed");
}

#[tokio::test]
async fn a_read_only_console_answers_403_to_every_change_and_bad_token_files_are_exit_2() {
    let mut db = Db::start().await;
    dead_letters(&mut db, 1).await;
    let (_admin, base) = crate::admin::start_admin(&db.url, None).await;
    let (status, me) = get(&base, "/api/whoami", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(me["may_change"], false);
    for (path, body) in [
        ("/api/dead/requeue", json!({"scope": "selected", "ids": [1]})),
        ("/api/dead/give-up", json!({"scope": "selected", "ids": [1]})),
        ("/api/dead/purge", json!({"older_than": 0})),
        ("/api/routes/pause", json!({"route": "orders"})),
        (
            "/api/replays",
            json!({"to": "http://127.0.0.1:1/", "dry_run": true}),
        ),
        ("/api/replays/resume", json!({"id": 1})),
        ("/api/replays/cancel", json!({"id": 1})),
    ] {
        let r = http()
            .post(format!("{base}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "{path}");
    }
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
            .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox_audit").await, 0);

    let dir = tempfile::tempdir().unwrap();
    for (content, says) in [
        ("alice short", "shorter than 16"),
        ("alice", "expected `name token`"),
        ("a/b 0123456789abcdef", "must be 1 to 64"),
        ("a 0123456789abcdef\na 0123456789abcdeX", "already given"),
        ("# nobody\n", "holds no token"),
        (&format!("admin {ALICE}"), "--admin-token's"),
        (
            &format!("carol {TOKEN}"),
            "the token of \"carol\" is --admin-token's",
        ),
    ] {
        let file = dir.path().join("tokens");
        std::fs::write(&file, content).unwrap();
        let out = run_cli(
            &["admin", "--listen", "127.0.0.1:0"],
            &[
                ("DATABASE_URL", db.url.as_str()),
                ("OUTBOX_ADMIN_TOKEN", TOKEN),
                ("OUTBOX_ADMIN_TOKENS_FILE", file.to_str().unwrap()),
            ],
        )
        .await;
        assert_eq!(out.status.code(), Some(2), "{content:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains(says),
            "{content:?}: {}",
            text(&out.stderr)
        );
    }
}

#[tokio::test]
async fn replay_jobs_start_cancel_and_resume_through_the_api_with_the_documented_codes() {
    let mut db = Db::start().await;
    db.insert_events(30, 1).await;
    db.client
        .execute("UPDATE outbox SET published_at = now()", &[])
        .await
        .unwrap();
    let receiver = outbox_testkit::Receiver::start(outbox_testkit::Respond::Ok)
        .await
        .unwrap();
    let url = receiver.url();
    let dir = tempfile::tempdir().unwrap();
    let (_admin, base) = start(&db, &dir).await;

    // A dry run counts, creates nothing, sends nothing.
    let (status, dry) = post(&base, "/api/replays", ALICE, json!({"to": url, "dry_run": true})).await;
    assert_eq!(status, StatusCode::OK, "{dry}");
    assert_eq!(
        (dry["would"]["matched"].as_i64(), dry["would"]["upto_id"].as_i64()),
        (Some(30), Some(30))
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox_replays").await, 0);

    // Bad requests are 422, naming what is wrong; nothing is created.
    for (body, says) in [
        (json!({"to": "nope://x"}), "unknown sink scheme"),
        (json!({"to": url, "rate": "fast"}), "rate:"),
        (json!({"to": url, "rate": 0}), "rate:"),
        (json!({"to": url, "colour": "red"}), "unknown field"),
        (json!({"to": url, "since": "last tuesday"}), "since:"),
        (
            json!({"to": url, "since": "2026-01-02", "until": "2026-01-01"}),
            "since must be before until",
        ),
        (json!({"to": "route:orders"}), "--config"),
        (json!({"to": url, "format": "xml"}), "format"),
        (json!({}), "missing field `to`"),
    ] {
        let (status, answer) = post(&base, "/api/replays", ALICE, body.clone()).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(
            error.to_lowercase().contains(&says.to_lowercase()),
            "{body}: {error}"
        );
    }
    assert_eq!(db.count("SELECT count(*) FROM outbox_replays").await, 0);

    // A job at one event a second is running when bob cancels it.
    let (status, started) = post(&base, "/api/replays", ALICE, json!({"to": url, "rate": "1/s"})).await;
    assert_eq!(status, StatusCode::OK, "{started}");
    assert_eq!(
        (started["job"]["id"].as_i64(), started["job"]["matched"].as_i64()),
        (Some(1), Some(30))
    );
    wait_until("the first event replayed", LONG, || async {
        receiver.count() >= 1
    })
    .await;
    let (status, again) = post(&base, "/api/replays/resume", BOB, json!({"id": 1})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{again}");
    assert!(
        again["error"]
            .as_str()
            .unwrap()
            .contains("running in this console already")
    );
    let (status, cancelled) = post(&base, "/api/replays/cancel", BOB, json!({"id": 1})).await;
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["job"]["state"], "stopped");
    let sent = cancelled["job"]["sent"].as_i64().unwrap();
    assert!((1..30).contains(&sent), "{cancelled}");
    assert_eq!(replay_job(&db, 1).await, ("stopped".to_owned(), sent));
    assert_eq!(receiver.count(), usize::try_from(sent).unwrap());
    let (status, twice) = post(&base, "/api/replays/cancel", BOB, json!({"id": 1})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{twice}");
    assert!(
        twice["error"]
            .as_str()
            .unwrap()
            .contains("is not running (stopped)"),
        "{twice}"
    );

    // Resumed unpaced: the rest, once each.
    let (status, resumed) = post(
        &base,
        "/api/replays/resume",
        ALICE,
        json!({"id": 1, "rate": "unlimited"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{resumed}");
    wait_until("the job done", LONG, || async {
        replay_job(&db, 1).await.0 == "done"
    })
    .await;
    assert_eq!(replay_job(&db, 1).await, ("done".to_owned(), 30));
    assert_eq!(receiver.count(), 30);
    let (status, listed) = get(&base, "/api/replays", ALICE).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed["replays"][0]["state"], "done");

    // Done, unknown, malformed.
    for (path, body, code) in [
        ("/api/replays/resume", json!({"id": 1}), StatusCode::CONFLICT),
        ("/api/replays/cancel", json!({"id": 1}), StatusCode::CONFLICT),
        ("/api/replays/resume", json!({"id": 99}), StatusCode::NOT_FOUND),
        ("/api/replays/cancel", json!({"id": 99}), StatusCode::NOT_FOUND),
        (
            "/api/replays/resume",
            json!({"id": "one"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "/api/replays/resume",
            json!({"id": 1, "rate": "-1"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ] {
        let (status, answer) = post(&base, path, ALICE, body.clone()).await;
        assert_eq!(status, code, "{path} {body}: {answer}");
    }
    assert_eq!(
        audit(&db).await,
        [
            ("alice@example.com".to_owned(), "replay-start".to_owned(), 30),
            ("bob".to_owned(), "replay-cancel".to_owned(), 1),
            (
                "alice@example.com".to_owned(),
                "replay-resume".to_owned(),
                30 - sent
            ),
        ]
    );
}
