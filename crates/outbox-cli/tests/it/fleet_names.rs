//! Operating a fleet by outbox name (issue 33, item 6): `--outbox NAME`
//! and `--all` on `stats`, `relays`, `dlq` and `replay`, over a
//! configuration file listing two outboxes (`acme` beside the tenants,
//! `beta` in another database) and a `schemas` pattern. Real PostgreSQL,
//! real Redis.

use outbox::{Config, Event, Outbox};
use outbox_testkit::{Postgres, Redis};
use serde_json::{Value, json};
use tokio_postgres::Client;

use crate::fleet::{holders, migrate_tenant, start_fleet, stop_fleet, tenants};
use crate::fleet_ops::{DEAD, update};
use crate::support::{LONG, read_stream, run_cli, text, wait_until};

/// Writes `n` events to `config`'s outbox, aggregate ids `<schema>-<i>`;
/// ids 1..=n in a fresh outbox.
async fn write(client: &Client, config: &Config, n: usize) {
    let events: Vec<Event> = (1..=n)
        .map(|i| {
            Event::new(
                "orders",
                format!("{}-{i}", config.schema),
                "Created",
                json!({"i": i}),
            )
        })
        .collect();
    Outbox::new(config.clone())
        .enqueue_all(client, &events)
        .await
        .unwrap();
}

/// The dead letters of `config`'s outbox, by id.
async fn dead_ids(client: &Client, config: &Config) -> Vec<i64> {
    client
        .query(
            &format!(
                "SELECT id FROM {} WHERE dead_at IS NOT NULL ORDER BY id",
                config.qualified()
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The fleet: in app_0 the tenants tenant_0 (5 events, id 1 published:
/// backlog 4) and tenant_1 (6 events, id 1 dead: backlog 5), and `acme`
/// (4 events: 1 and 2 dead, 3 published: backlog 1); in the database
/// `other`, `beta`, schema tenant_0 (4 events, 1 dead, 2 published:
/// backlog 2). Every
/// outbox has a dead letter or a row with id 1, so a command that reached
/// the wrong one shows.
struct Fixture {
    pg: Postgres,
    url: String,
    file: String,
    _dir: tempfile::TempDir,
    app: Client,
    other: Client,
    tenant_0: Config,
    tenant_1: Config,
    acme: Config,
    beta: Config,
}

impl Fixture {
    async fn start() -> Self {
        let pg = Postgres::start().await.unwrap();
        let found = tenants(&pg, "app_0", 2, true).await;
        let mut app = pg.connect("app_0").await.unwrap();
        let acme = Config::new("acme", "outbox").unwrap();
        migrate_tenant(&mut app, &acme).await;
        let beta = tenants(&pg, "other", 1, true).await.remove(0);
        let other = pg.connect("other").await.unwrap();
        let (tenant_0, tenant_1) = (found[0].clone(), found[1].clone());
        write(&app, &tenant_0, 5).await;
        update(&app, &tenant_0, "published_at = now()", &[1]).await;
        write(&app, &tenant_1, 6).await;
        update(&app, &tenant_1, DEAD, &[1]).await;
        write(&app, &acme, 4).await;
        update(&app, &acme, DEAD, &[1, 2]).await;
        update(&app, &acme, "published_at = now()", &[3]).await;
        write(&other, &beta, 4).await;
        update(&other, &beta, DEAD, &[1]).await;
        update(&other, &beta, "published_at = now()", &[2]).await;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet.toml");
        std::fs::write(
            &file,
            format!(
                "schemas = \"tenant_%\"\n\n\
                 [outboxes.acme]\nschema = \"acme\"\n\n\
                 [outboxes.beta]\nschema = \"tenant_0\"\ndatabase_url = \"{}\"\n",
                pg.url("other")
            ),
        )
        .unwrap();
        Self {
            url: pg.url("app_0"),
            file: file.to_str().unwrap().to_owned(),
            _dir: dir,
            pg,
            app,
            other,
            tenant_0,
            tenant_1,
            acme,
            beta,
        }
    }

    /// The CLI with `--config` the fleet's file, against app_0.
    async fn run(&self, args: &[&str]) -> std::process::Output {
        let args: Vec<&str> = args.iter().copied().chain(["--config", &self.file]).collect();
        run_cli(&args, &[("DATABASE_URL", &self.url)]).await
    }

    /// Stdout, asserting exit 0.
    async fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    async fn json(&self, args: &[&str]) -> Value {
        let out = self.ok(args).await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }

    /// Stderr, asserting exit 2.
    async fn usage_error(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stderr)
    }
}

/// `stats --all` reports the two listed outboxes (one in another database)
/// and the two the pattern finds, each with its own backlog; `stats
/// --outbox` reads just the one named, by listed name or by label, with
/// its own connection; an unknown name is exit 2 with the closest name,
/// or the list.
#[tokio::test]
async fn stats_by_outbox_name_and_all_of_the_fleet() {
    let f = Fixture::start().await;

    let stats = f.json(&["stats", "--all", "--json"]).await;
    let rows: Vec<(&str, &Value, i64, i64)> = stats["outboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["outbox"].as_str().unwrap(),
                &r["database"],
                r["backlog"].as_i64().unwrap(),
                r["dead_letters"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("tenant_1.outbox", &Value::Null, 5, 1),
            ("tenant_0.outbox", &Value::Null, 4, 0),
            ("beta", &json!("other"), 2, 1),
            ("acme", &Value::Null, 1, 2),
        ],
        "{stats:#}"
    );
    assert_eq!(
        (
            &stats["total"]["outboxes"],
            &stats["total"]["backlog"],
            &stats["total"]["dead_letters"]
        ),
        (&json!(4), &json!(12), &json!(4))
    );
    let beta = &stats["outboxes"][2];
    assert_eq!(
        (&beta["schema"], &beta["table"]),
        (&json!("tenant_0"), &json!("outbox"))
    );

    // Text: one line per outbox and the totals, labelled as the fleet does.
    let out = f.ok(&["stats", "--all", "--top", "2"]).await;
    let labels: Vec<&str> = out.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(
        labels,
        ["outbox", "tenant_1.outbox", "tenant_0.outbox", "total"],
        "{out}"
    );

    // One outbox by its listed name: acme's table in app_0, beta's in
    // `other` (app_0's tenant_0 has 4 pending, beta 2).
    for (name, table, unpublished, dead) in [
        ("acme", "acme.outbox", 1, 2),
        ("beta", "tenant_0.outbox", 2, 1),
        ("tenant_1.outbox", "tenant_1.outbox", 5, 1),
        ("tenant_0.outbox", "tenant_0.outbox", 4, 0),
    ] {
        let one = f.json(&["stats", "--outbox", name, "--json"]).await;
        assert_eq!(
            (&one["table"], &one["unpublished"], &one["dead_letters"]),
            (&json!(table), &json!(unpublished), &json!(dead)),
            "{name}: {one:#}"
        );
    }

    // Unknown names: the closest when one is near, else the list.
    let err = f.usage_error(&["stats", "--outbox", "acne"]).await;
    assert!(err.contains("did you mean \"acme\"?"), "{err}");
    let err = f.usage_error(&["stats", "--outbox", "tenant_1"]).await;
    assert!(err.contains("did you mean \"tenant_1.outbox\"?"), "{err}");
    let err = f.usage_error(&["stats", "--outbox", "zebra"]).await;
    assert!(
        err.contains("its outboxes: acme, tenant_0.outbox, tenant_1.outbox, beta"),
        "{err}"
    );
    // --outbox names one outbox; --schema and --all do too.
    let err = f.usage_error(&["stats", "--outbox", "acme", "--all"]).await;
    assert!(err.contains("cannot be used with"), "{err}");
    let err = f
        .usage_error(&["--schema", "acme", "stats", "--outbox", "acme"])
        .await;
    assert!(err.contains("give one of them"), "{err}");
    let _ = &f.pg;
}

/// `dlq list --all` lists every outbox's dead letters, labelled; `dlq
/// --outbox acme` lists, shows and requeues acme's only, though every
/// outbox has a dead letter or a row with id 1; `--all` on a command that
/// changes rows is refused with why.
#[tokio::test]
async fn dlq_by_outbox_name_changes_only_that_outbox() {
    let f = Fixture::start().await;

    let listed = f.json(&["dlq", "list", "--all", "--json"]).await;
    let found: Vec<(&str, i64)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["outbox"].as_str().unwrap(), d["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(
        found,
        [("acme", 1), ("acme", 2), ("tenant_1.outbox", 1), ("beta", 1)]
    );
    let acme = f.json(&["dlq", "--outbox", "acme", "list", "--json"]).await;
    let ids: Vec<i64> = acme
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [1, 2]);
    let shown = f.json(&["dlq", "show", "1", "--outbox", "beta", "--json"]).await;
    // app_0's tenant_0 has a row 1 too, published; beta's is dead.
    assert!(
        shown["dead_at"].is_string() && shown["published_at"].is_null(),
        "beta's row 1: {shown:#}"
    );

    // Refused: requeue --all meaning one outbox beside a fleet's file;
    // --all on a command of one outbox.
    let err = f.usage_error(&["dlq", "requeue", "--all"]).await;
    assert!(
        err.contains("describes a fleet: name the outbox with --outbox NAME"),
        "{err}"
    );
    let err = f.usage_error(&["dlq", "give-up", "--id", "1", "--all"]).await;
    assert!(err.contains("is for `dlq list` only"), "{err}");
    let err = f
        .usage_error(&["dlq", "--outbox", "acmee", "requeue", "--id", "1"])
        .await;
    assert!(err.contains("did you mean \"acme\"?"), "{err}");
    for (client, config, dead) in [
        (&f.app, &f.acme, &[1, 2][..]),
        (&f.app, &f.tenant_1, &[1]),
        (&f.other, &f.beta, &[1]),
    ] {
        assert_eq!(
            dead_ids(client, config).await,
            dead,
            "nothing requeued yet: {config:?}"
        );
    }

    let out = f.ok(&["dlq", "--outbox", "acme", "requeue", "--id", "1"]).await;
    assert_eq!(out.trim(), "requeued 1 dead letter in acme.outbox");
    assert_eq!(dead_ids(&f.app, &f.acme).await, [2]);
    assert_eq!(
        dead_ids(&f.app, &f.tenant_1).await,
        [1],
        "tenant_1's id 1 untouched"
    );
    assert_eq!(dead_ids(&f.other, &f.beta).await, [1], "beta's id 1 untouched");
    assert_eq!(dead_ids(&f.app, &f.tenant_0).await, Vec::<i64>::new());
    // --all with --outbox is the requeue's own: every dead letter of acme.
    let out = f.ok(&["dlq", "--outbox", "acme", "requeue", "--all"]).await;
    assert_eq!(out.trim(), "requeued 1 dead letter in acme.outbox");
    assert_eq!(dead_ids(&f.other, &f.beta).await, [1]);
}

/// `replay --outbox acme` replays acme's one published event and no other
/// outbox's (tenant_0 and beta have published rows too); `replay --list
/// --all` lists the job labelled acme; `replay --all` starting a job is
/// refused; `relays --all` counts each database's outboxes.
#[tokio::test]
async fn replay_and_relays_by_outbox_name() {
    let f = Fixture::start().await;
    let redis = Redis::start().await.unwrap();

    let err = f
        .usage_error(&["replay", "--all", "--to", &redis.url(), "--rate", "unlimited"])
        .await;
    assert!(
        err.contains("--outbox NAME") && err.contains("not offered"),
        "{err}"
    );
    let out = f
        .ok(&[
            "replay",
            "--outbox",
            "acme",
            "--to",
            &redis.url(),
            "--rate",
            "unlimited",
        ])
        .await;
    assert!(out.contains("matched 1, sent 1"), "{out}");
    let got = read_stream(&redis.url(), "outbox.event.orders").await;
    let aggregates: Vec<&str> = got.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(aggregates, ["acme-3"], "acme's published row only");

    let jobs = f.json(&["replay", "--list", "--all", "--json"]).await;
    let jobs: Vec<(&str, i64, &str)> = jobs
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["outbox"].as_str().unwrap(),
                j["sent"].as_i64().unwrap(),
                j["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(jobs, [("acme", 1, "done")]);
    let one = f.json(&["replay", "--list", "--outbox", "beta", "--json"]).await;
    assert_eq!(one, json!([]), "beta has no job");

    let relays = f.json(&["relays", "--all", "--json"]).await;
    assert_eq!(
        relays,
        json!([
            {"database": "app_0", "outboxes": 3, "processes": [], "unserved": 3},
            {"database": "other", "outboxes": 1, "processes": [], "unserved": 1},
        ])
    );
    let out = f.ok(&["relays", "--all"]).await;
    assert!(
        out.starts_with("database app_0: 3 outboxes of the fleet, 0 fleet processes\n"),
        "{out}"
    );

    // A fleet of the pattern alone serves the tenants, not acme: `relays
    // --all` counts it against the fleet of the file, and `relays
    // --outbox` names it for a tenant, nobody for acme.
    let fleet = start_fleet(&f.pg, "fleet_a", &redis, &[]).await;
    wait_until("the two tenants served", LONG, || async {
        holders(&f.app).await == [2]
    })
    .await;
    let relays = f.json(&["relays", "--all", "--json"]).await;
    assert_eq!(
        (
            &relays[0]["outboxes"],
            &relays[0]["unserved"],
            &relays[0]["processes"][0]["serves"]
        ),
        (&json!(3), &json!(1), &json!(2)),
        "{relays:#}"
    );
    let one = f.json(&["relays", "--outbox", "tenant_1.outbox", "--json"]).await;
    assert_eq!(one["fleet_process"]["application_name"], "fleet_a", "{one:#}");
    let out = f.ok(&["relays", "--outbox", "tenant_1.outbox"]).await;
    assert!(out.contains("served by the fleet process fleet_a (pid "), "{out}");
    let one = f.json(&["relays", "--outbox", "acme", "--json"]).await;
    assert_eq!(one["fleet_process"], Value::Null, "{one:#}");
    stop_fleet(fleet).await;
}

/// A listed outbox the pattern also finds is served as the listed one, so
/// `stats --all` shows it once, by its name; `--outbox` takes its name or
/// its `schema.table`. Without a pattern or a listed outbox, `--all` is
/// the relay's one outbox.
#[tokio::test]
async fn a_listed_outbox_the_pattern_finds_too_is_reported_once_by_its_name() {
    let pg = Postgres::start().await.unwrap();
    let configs = tenants(&pg, "app_0", 2, true).await;
    let app = pg.connect("app_0").await.unwrap();
    write(&app, &configs[0], 1).await;
    write(&app, &configs[1], 3).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fleet.toml");
    std::fs::write(
        &file,
        "schemas = \"tenant_%\"\n\n[outboxes.big]\nschema = \"tenant_1\"\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let url = pg.url("app_0");
    let stats = json_of(&url, &["stats", "--all", "--config", file, "--json"]).await;
    let rows: Vec<(&str, i64)> = stats["outboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["outbox"].as_str().unwrap(), r["backlog"].as_i64().unwrap()))
        .collect();
    assert_eq!(rows, [("big", 3), ("tenant_0.outbox", 1)]);
    for name in ["big", "tenant_1.outbox"] {
        let one = json_of(&url, &["stats", "--outbox", name, "--config", file, "--json"]).await;
        assert_eq!(
            (&one["table"], &one["unpublished"]),
            (&json!("tenant_1.outbox"), &json!(3)),
            "{name}"
        );
    }

    // No file: --schemas is the fleet's pattern; without one, a label is
    // refused, saying where a fleet's outboxes come from.
    let one = json_of(
        &url,
        &[
            "stats",
            "--outbox",
            "tenant_0.outbox",
            "--schemas",
            "tenant_%",
            "--json",
        ],
    )
    .await;
    assert_eq!(
        (&one["table"], &one["unpublished"]),
        (&json!("tenant_0.outbox"), &json!(1))
    );
    let out = run_cli(
        &["dlq", "--outbox", "tenant_0.outbox", "list"],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("its outboxes: public.outbox (a fleet's outboxes are --config's"),
        "{}",
        text(&out.stderr)
    );
    // No file: the relay of DATABASE_URL and --schema serves one outbox,
    // here public.outbox, which was never migrated: left out.
    let none = json_of(&url, &["stats", "--all", "--json"]).await;
    assert_eq!(
        (&none["total"]["outboxes"], &none["left_out"][0]["outbox"]),
        (&json!(0), &json!("public.outbox")),
        "{none:#}"
    );
    let one = json_of(
        &url,
        &[
            "stats",
            "--all",
            "--table",
            "outbox",
            "--schemas",
            "tenant_0",
            "--json",
        ],
    )
    .await;
    assert_eq!(one["total"]["outboxes"], json!(1), "{one:#}");
}

/// The CLI's JSON output, asserting exit 0.
async fn json_of(url: &str, args: &[&str]) -> Value {
    let out = run_cli(args, &[("DATABASE_URL", url)]).await;
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}
