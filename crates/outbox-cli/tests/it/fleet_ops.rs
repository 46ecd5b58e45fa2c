//! Operating a fleet (issue 33): `outbox stats`, `dlq list` and `relays`
//! with `--schemas` (and `--databases`), over tenant outboxes with known
//! backlogs and dead letters, served by a fleet process or by none. Real
//! PostgreSQL, real Redis.

use outbox::{Config, Event, Outbox};
use outbox_testkit::{Postgres, Redis};
use serde_json::{Value, json};
use tokio_postgres::Client;

use crate::fleet::{holders, migrate_tenant, start_fleet, stop_fleet, tenants};
use crate::support::{LONG, run_cli, text, wait_until};

/// Writes `n` events to `config`'s outbox; ids 1..=n in a fresh outbox.
pub(crate) async fn write(client: &Client, config: &Config, n: usize) {
    let events: Vec<Event> = (0..n)
        .map(|i| Event::new("orders", format!("o{i}"), "Created", json!({"i": i})))
        .collect();
    Outbox::new(config.clone())
        .enqueue_all(client, &events)
        .await
        .unwrap();
}

/// Runs `UPDATE <outbox> SET <set> WHERE id = ANY(ids)`; asserts the rows.
pub(crate) async fn update(client: &Client, config: &Config, set: &str, ids: &[i64]) {
    let n = client
        .execute(
            &format!("UPDATE {} SET {set} WHERE id = ANY($1)", config.qualified()),
            &[&ids],
        )
        .await
        .unwrap();
    assert_eq!(n, ids.len() as u64, "{set}");
}

pub(crate) const DEAD: &str = "dead_at = now(), attempts = 5, last_error = 'x'";

/// The three tenants' known backlogs: tenant_0 5 events, one published,
/// one waiting an hour for its retry (backlog 4: 3 due, 1 waiting);
/// tenant_1 6 events, one dead (backlog 5); tenant_2 4 events, two dead,
/// one given up (backlog 1, 2 dead).
pub(crate) async fn known_backlogs(client: &Client, configs: &[Config]) {
    for (config, n) in configs.iter().zip([5, 6, 4]) {
        write(client, config, n).await;
    }
    update(client, &configs[0], "published_at = now()", &[1]).await;
    update(
        client,
        &configs[0],
        "attempts = 1, next_attempt_at = now() + interval '1 hour'",
        &[2],
    )
    .await;
    update(client, &configs[1], DEAD, &[3]).await;
    update(client, &configs[2], DEAD, &[1, 2]).await;
    update(client, &configs[2], &format!("{DEAD}, given_up_at = now()"), &[3]).await;
}

/// The CLI against `url`: stdout, asserting exit 0.
async fn ok(url: &str, args: &[&str]) -> String {
    ok_with_stderr(url, args).await.0
}

/// The CLI against `url`: stdout and stderr, asserting exit 0.
async fn ok_with_stderr(url: &str, args: &[&str]) -> (String, String) {
    let out = run_cli(args, &[("DATABASE_URL", url)]).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    (text(&out.stdout), text(&out.stderr))
}

/// The CLI's JSON output.
async fn json_of(url: &str, args: &[&str]) -> Value {
    let out = ok(url, args).await;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// The CLI against `url`, expected to fail with exit 2: its stderr.
async fn usage_error(url: &str, args: &[&str]) -> String {
    let out = run_cli(args, &[("DATABASE_URL", url)]).await;
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stdout));
    text(&out.stderr)
}

/// `(outbox, backlog, due_now, waiting, dead_letters, given_up)` of each
/// row of `stats --schemas --json`, in order.
fn rows(stats: &Value) -> Vec<(String, i64, i64, i64, i64, i64)> {
    stats["outboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_i64().unwrap_or_else(|| panic!("{k} in {r}"));
            (
                r["outbox"].as_str().unwrap().to_owned(),
                n("backlog"),
                n("due_now"),
                n("waiting"),
                n("dead_letters"),
                n("given_up"),
            )
        })
        .collect()
}

/// Three tenants with known backlogs: tenant_0 5 events, one published,
/// one waiting an hour for its retry; tenant_1 6 events, one dead;
/// tenant_2 4 events, two dead, one given up. A second database, app_1,
/// with one tenant of 2 events; and tenant_3, whose schema is a version
/// behind, left out. Rows by backlog, totals over all, --top,
/// --databases, text and JSON; --schemas beside --schema refused.
#[tokio::test]
async fn fleet_stats_counts_each_tenant_outbox_and_totals_them() {
    let pg = Postgres::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 3, true).await;
    let other = tenants(&pg, "app_1", 1, true).await;
    let mut client = pg.connect("app_0").await.unwrap();
    let behind = Config::new("tenant_3", "outbox").unwrap();
    migrate_tenant(&mut client, &behind).await;
    write(&client, &behind, 7).await;
    client
        .batch_execute(
            "DELETE FROM tenant_3.outbox_migrations WHERE version = (SELECT max(version) FROM tenant_3.outbox_migrations)",
        )
        .await
        .unwrap();
    known_backlogs(&client, &configs).await;
    write(&pg.connect("app_1").await.unwrap(), &other[0], 2).await;
    let url = pg.url("app_0");

    let stats = json_of(&url, &["stats", "--schemas", "tenant_%", "--json"]).await;
    assert_eq!(
        rows(&stats),
        [
            ("tenant_1.outbox".to_owned(), 5, 5, 0, 1, 0),
            ("tenant_0.outbox".to_owned(), 4, 3, 1, 0, 0),
            ("tenant_2.outbox".to_owned(), 1, 1, 0, 2, 1),
        ]
    );
    let total = &stats["total"];
    assert_eq!(
        [
            &total["outboxes"],
            &total["backlog"],
            &total["due_now"],
            &total["waiting"],
            &total["dead_letters"],
            &total["given_up"],
            &total["served"],
            &total["unserved"],
        ],
        [
            &json!(3),
            &json!(10),
            &json!(9),
            &json!(1),
            &json!(3),
            &json!(1),
            &json!(0),
            &json!(3)
        ]
    );
    for r in stats["outboxes"].as_array().unwrap() {
        assert_eq!(r["served_by"], Value::Null, "{r}");
        assert_eq!(r["database"], Value::Null, "{r}");
        assert!(
            r["oldest_unpublished_age_seconds"].as_f64().unwrap() >= 0.0,
            "{r}"
        );
    }
    let left_out = stats["left_out"].as_array().unwrap();
    assert_eq!(left_out.len(), 1, "{stats}");
    assert_eq!(left_out[0]["outbox"], "tenant_3.outbox");
    let reason = left_out[0]["reason"].as_str().unwrap();
    assert!(reason.contains("is not migrated"), "{reason}");

    // --top: the largest backlog only; the totals still count all three.
    let top = json_of(&url, &["stats", "--schemas", "tenant_%", "--top", "1", "--json"]).await;
    assert_eq!(rows(&top), [("tenant_1.outbox".to_owned(), 5, 5, 0, 1, 0)]);
    assert_eq!(
        (&top["total"]["outboxes"], &top["total"]["backlog"]),
        (&json!(3), &json!(10))
    );

    // Text: a header, one line per outbox by backlog, the totals.
    let (out, err) = ok_with_stderr(&url, &["stats", "--schemas", "tenant_%"]).await;
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("warning: tenant_3.outbox left out: "))
            .count(),
        1,
        "{err}"
    );
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert_eq!(lines[0][0], "outbox", "{out}");
    assert_eq!(
        lines[1][..6],
        ["tenant_1.outbox", "5", "5", "0", "1", "0"],
        "{out}"
    );
    assert_eq!(
        lines[2][..6],
        ["tenant_0.outbox", "4", "3", "1", "0", "0"],
        "{out}"
    );
    assert_eq!(
        lines[3][..6],
        ["tenant_2.outbox", "1", "1", "0", "2", "1"],
        "{out}"
    );
    assert_eq!(lines[1].last(), Some(&"-"), "nobody serves it: {out}");
    assert_eq!(
        lines[4][..8],
        ["total", "(3", "outboxes)", "10", "9", "1", "3", "1"],
        "{out}"
    );
    assert!(
        out.lines().last().unwrap().ends_with("0 served, 3 by nobody"),
        "{out}"
    );

    // --databases: both databases' tenants, labelled with the database.
    let all = json_of(
        &url,
        &["stats", "--schemas", "tenant_%", "--databases", "app_%", "--json"],
    )
    .await;
    assert_eq!(
        rows(&all),
        [
            ("app_0/tenant_1.outbox".to_owned(), 5, 5, 0, 1, 0),
            ("app_0/tenant_0.outbox".to_owned(), 4, 3, 1, 0, 0),
            ("app_1/tenant_0.outbox".to_owned(), 2, 2, 0, 0, 0),
            ("app_0/tenant_2.outbox".to_owned(), 1, 1, 0, 2, 1),
        ]
    );
    assert_eq!(all["outboxes"][2]["database"], "app_1");
    assert_eq!(
        (&all["total"]["outboxes"], &all["total"]["backlog"]),
        (&json!(4), &json!(12))
    );

    // A pattern matching nothing is an empty report, not an error.
    let none = json_of(&url, &["stats", "--schemas", "nobody_%", "--json"]).await;
    assert_eq!(
        (&none["outboxes"], &none["total"]["outboxes"]),
        (&json!([]), &json!(0))
    );

    // --schemas and --schema name different outboxes, in either order.
    let err = usage_error(&url, &["stats", "--schemas", "tenant_%", "--schema", "tenant_0"]).await;
    assert!(err.contains("cannot be used with"), "{err}");
    let err = usage_error(&url, &["--schema", "tenant_0", "stats", "--schemas", "tenant_%"]).await;
    assert!(err.contains("give one of them"), "{err}");
    let err = usage_error(&url, &["stats", "--top", "1"]).await;
    assert!(err.contains("--schemas"), "{err}");
}

/// Dead letters in tenant_0 (ids 1 and 2) and tenant_2 (id 2), none in
/// tenant_1: `dlq list --schemas` lists the three, labelled, by outbox;
/// --limit counts over all outboxes; the other dlq subcommands refuse
/// --schemas.
#[tokio::test]
async fn fleet_dlq_list_labels_every_tenants_dead_letters() {
    let pg = Postgres::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 3, true).await;
    let client = pg.connect("app_0").await.unwrap();
    for config in &configs {
        write(&client, config, 3).await;
    }
    update(&client, &configs[0], DEAD, &[1, 2]).await;
    update(&client, &configs[2], DEAD, &[2]).await;
    let url = pg.url("app_0");

    let listed = json_of(&url, &["dlq", "list", "--schemas", "tenant_%", "--json"]).await;
    let found: Vec<(&str, i64, i64, &str)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["outbox"].as_str().unwrap(),
                d["id"].as_i64().unwrap(),
                d["attempts"].as_i64().unwrap(),
                d["last_error"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            ("tenant_0.outbox", 1, 5, "x"),
            ("tenant_0.outbox", 2, 5, "x"),
            ("tenant_2.outbox", 2, 5, "x"),
        ]
    );
    assert_eq!(listed[2]["aggregate_id"], "o1");

    let out = ok(&url, &["dlq", "list", "--schemas", "tenant_%"]).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[0].starts_with("outbox "), "{out}");
    for (line, (outbox, id, ..)) in lines[1..].iter().zip(&found) {
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((words[0], words[1]), (*outbox, id.to_string().as_str()), "{out}");
        assert_eq!(words.last(), Some(&"x"), "{out}");
    }

    let out = ok(&url, &["dlq", "list", "--schemas", "tenant_%", "--limit", "2"]).await;
    assert_eq!(out.lines().count(), 4, "header, 2 rows, the limit's note: {out}");
    assert!(out.lines().all(|l| !l.starts_with("tenant_2")), "{out}");
    assert!(out.contains("--limit 2 reached"), "{out}");

    let out = ok(&url, &["dlq", "list", "--schemas", "nobody_%"]).await;
    assert_eq!(out.trim(), "no dead letters in 0 outboxes matching \"nobody_%\"");

    for args in [
        &["dlq", "requeue", "--all", "--schemas", "tenant_%"][..],
        &["dlq", "--schemas", "tenant_%", "give-up", "--id", "1"],
        &["dlq", "show", "1", "--schemas", "tenant_%"],
    ] {
        let err = usage_error(&url, args).await;
        assert!(
            err.contains("changes one outbox: name it with --outbox NAME or --schema"),
            "{args:?}: {err}"
        );
    }
    let err = usage_error(
        &url,
        &["dlq", "list", "--schemas", "tenant_%", "--schema", "tenant_0"],
    )
    .await;
    assert!(err.contains("cannot be used with"), "{err}");
    // Nothing was requeued.
    let dead: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE dead_at IS NOT NULL",
                configs[0].qualified()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead, 2);
}

/// `relays --schemas` with no fleet process (all three outboxes served by
/// nobody), then with one serving all three: its control session's pid
/// (the holder of the outboxes' locks), application_name and address, and
/// `stats --schemas` naming it for each outbox; and nobody again once it
/// stopped.
#[tokio::test]
async fn fleet_relays_shows_the_fleet_process_serving_each_outbox() {
    let pg = Postgres::start().await.unwrap();
    let redis = Redis::start().await.unwrap();
    tenants(&pg, "app_0", 3, true).await;
    let client = pg.connect("app_0").await.unwrap();
    let url = pg.url("app_0");
    let nobody = json!([{"database": "app_0", "outboxes": 3, "processes": [], "unserved": 3}]);

    let relays = json_of(&url, &["relays", "--schemas", "tenant_%", "--json"]).await;
    assert_eq!(relays, nobody);

    let fleet = start_fleet(&pg, "fleet_a", &redis, &[]).await;
    wait_until("the three tenants served", LONG, || async {
        holders(&client).await == [3]
    })
    .await;
    let pid: i32 = client
        .query_one(
            "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND classid::int8 = $1",
            &[&i64::from(outbox::sql::fleet::OWN_LOCK)],
        )
        .await
        .unwrap()
        .get(0);

    let relays = json_of(&url, &["relays", "--schemas", "tenant_%", "--json"]).await;
    let processes = relays[0]["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 1, "{relays}");
    let p = &processes[0];
    assert_eq!(
        (&p["pid"], &p["application_name"], &p["client_addr"], &p["serves"]),
        (&json!(pid), &json!("fleet_a"), &json!("127.0.0.1"), &json!(3)),
        "{relays}"
    );
    assert!(p["backend_start"].is_string(), "{relays}");
    assert_eq!(
        (&relays[0]["outboxes"], &relays[0]["unserved"]),
        (&json!(3), &json!(0))
    );

    let out = ok(&url, &["relays", "--schemas", "tenant_%"]).await;
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert_eq!(
        out.lines().next(),
        Some("database app_0: 3 outboxes matching \"tenant_%\", 1 fleet process")
    );
    let (row, last) = (&lines[2], &lines[3]);
    assert_eq!(
        (row[0], row[1], row[2], row.last().copied()),
        (pid.to_string().as_str(), "fleet_a", "127.0.0.1", Some("3")),
        "{out}"
    );
    assert_eq!(last[..], ["(nobody)", "0"], "{out}");

    let stats = json_of(&url, &["stats", "--schemas", "tenant_%", "--json"]).await;
    for r in stats["outboxes"].as_array().unwrap() {
        assert_eq!(
            r["served_by"],
            json!({"pid": pid, "application_name": "fleet_a"}),
            "{r}"
        );
    }
    assert_eq!(
        (&stats["total"]["served"], &stats["total"]["unserved"]),
        (&json!(3), &json!(0))
    );
    let out = ok(&url, &["stats", "--schemas", "tenant_%"]).await;
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .ends_with(&format!("fleet_a (pid {pid})")),
        "{out}"
    );

    stop_fleet(fleet).await;
    wait_until("the fleet's locks gone with its sessions", LONG, || async {
        holders(&client).await.is_empty()
    })
    .await;
    let relays = json_of(&url, &["relays", "--schemas", "tenant_%", "--json"]).await;
    assert_eq!(relays, nobody);
}
