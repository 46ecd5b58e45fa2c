//! The CLI's contract: exit codes and messages for bad input, migrate, demo.

use outbox_testkit::Postgres;

use crate::support::{Db, relay_without_postgres, run_cli, text};

/// Runs `args` and asserts exit code 2 with `needle` in the message.
pub async fn expect_config_error(args: &[&str], envs: &[(&str, &str)], needle: &str) {
    let out = run_cli(args, envs).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.contains(needle),
        "{args:?}: expected {needle:?} in {stderr}"
    );
}

#[tokio::test]
async fn configuration_errors_exit_2_naming_the_value() {
    let db = Db::start().await;
    let url = db.url.as_str();
    let env = [("DATABASE_URL", url)];
    // The schemes offered instead are the ones this binary was built with.
    let unknown = if cfg!(feature = "kafka") {
        "unknown sink scheme \"ftp\" in \"ftp://host/x\" \
         (known: redis, rediss, http, https, nats, amqp, amqps, kafka)"
    } else {
        "unknown sink scheme \"ftp\" in \"ftp://host/x\" \
         (known: redis, rediss, http, https, nats, amqp, amqps)"
    };
    expect_config_error(&["relay", "--sink", "ftp://host/x"], &env, unknown).await;
    expect_config_error(&["relay", "--sink", "not a url"], &env, "not a url").await;
    expect_config_error(&["relay", "--sink", "redis://"], &env, "redis://").await;
    expect_config_error(
        &["relay", "--sink", "redis://x", "--table", "outbox; drop table x"],
        &env,
        "outbox; drop table x",
    )
    .await;
    expect_config_error(
        &["relay", "--sink", "redis://x", "--poll-interval", "5 parsecs"],
        &env,
        "5 parsecs",
    )
    .await;
    expect_config_error(
        &["relay", "--sink", "redis://x", "--batch-size", "0"],
        &env,
        "batch-size",
    )
    .await;
    expect_config_error(&["relay", "--sink", "redis://x"], &[], "DATABASE_URL").await;
    expect_config_error(
        &["relay", "--sink", "redis://x"],
        &[("DATABASE_URL", "postgres://u@h:notaport/db")],
        "notaport",
    )
    .await;
    expect_config_error(
        &["relay", "--sink", "redis://x"],
        &[("DATABASE_URL", url), ("OUTBOX_BATCH_SIZE", "lots")],
        "lots",
    )
    .await;
    expect_config_error(&["migrate", "--schema", "Bad-Name"], &env, "Bad-Name").await;
    expect_config_error(&["dlq", "requeue"], &env, "--all").await;
    // `skip`: the old name of `give-up`, kept as a hidden alias.
    expect_config_error(&["dlq", "skip"], &env, "--id").await;
    // The table exists untouched after all that.
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn schema_not_migrated_or_too_new_exits_2() {
    let mut db = Db::start().await;
    let fresh = db.pg.fresh_database().await.unwrap();
    expect_config_error(
        &["relay", "--sink", "redis://127.0.0.1:1"],
        &[("DATABASE_URL", &fresh)],
        "outbox migrate",
    )
    .await;
    expect_config_error(&["stats"], &[("DATABASE_URL", &fresh)], "outbox migrate").await;

    db.client
        .execute(
            "INSERT INTO outbox_migrations (version, name, checksum) VALUES (1000, 'future', 'x')",
            &[],
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    expect_config_error(
        &["relay", "--sink", "redis://127.0.0.1:1"],
        &env,
        "newer than this binary",
    )
    .await;
    expect_config_error(&["migrate"], &env, "newer than this binary").await;
    db.reconnect().await;
}

#[tokio::test]
async fn unreachable_postgres_exits_1_after_the_connect_timeout() {
    let out = relay_without_postgres(&[], &[]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("connecting to postgres"), "{stderr}");
}

#[tokio::test]
async fn migrate_creates_outbox_and_inbox_idempotently() {
    let pg = Postgres::start().await.unwrap();
    let url = pg.fresh_database().await.unwrap();
    let env = [("DATABASE_URL", url.as_str())];
    let first = run_cli(&["migrate", "--schema", "app", "--table", "events"], &env).await;
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    assert!(text(&first.stdout).contains("app.events: applied 0001_create_outbox"));
    let again = run_cli(&["migrate", "--schema", "app", "--table", "events"], &env).await;
    assert!(
        text(&again.stdout).contains("app.events is up to date"),
        "{}",
        text(&again.stdout)
    );
    let inbox = run_cli(&["migrate", "--inbox", "--inbox-schema", "consumer"], &env).await;
    assert_eq!(inbox.status.code(), Some(0), "{}", text(&inbox.stderr));

    let client = crate::support::connect(&url).await;
    for table in ["app.events", "consumer.processed_events", "app.events_migrations"] {
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await
            .unwrap()
            .get(0);
        assert!(exists, "{table}");
    }
    let trigger: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'events_notify'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(trigger, 1);
}

#[tokio::test]
async fn demo_runs_end_to_end_on_throwaway_services() {
    let out = run_cli(&["demo", "--orders", "30"], &[]).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("every paid order shipped exactly once"),
        "{stdout}"
    );
    assert!(
        stdout.contains("5 replayed, 0 processed again, 5 answered as duplicates"),
        "{stdout}"
    );
}

#[tokio::test]
async fn bench_quick_reports_exact_counts() {
    let out = run_cli(&["bench", "--quick", "--json"], &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json");
    assert_eq!(report["events"], 300);
    let rows = report["throughput"].as_array().unwrap();
    assert_eq!(rows.len(), 9, "3 strategies × batch sizes 1, 10, 100");
    for row in rows {
        let run = &row["runs"][0];
        assert_eq!(run["marked"], 300, "{row}");
        if row["strategy"] != "floor" {
            assert_eq!(run["delivered"], 300, "{row}");
            assert_eq!(run["duplicates"], 0, "{row}");
        }
        assert!(row["events_per_second"]["median"].as_f64().unwrap() > 0.0);
        assert_eq!(run["peak_rss"].is_u64(), row["strategy"] == "relay", "{row}");
    }
    assert_eq!(report["ratios"].as_array().unwrap().len(), 3);

    // Latency: every event written at the steady rate reached the consumer,
    // once, in both wake-up modes.
    let latency = report["latency"].as_array().unwrap();
    assert_eq!(latency.len(), 2, "{latency:?}");
    assert_eq!(latency[0]["wakeup"], "notify");
    assert_eq!(latency[1]["wakeup"]["poll"]["interval_ms"], 100);
    for row in latency {
        let run = &row["runs"][0];
        assert_eq!(run["written"], 100, "{row}");
        assert_eq!(run["received"], 100, "{row}");
        assert_eq!(run["duplicates"], 0, "{row}");
        let (p50, p99, max) = (
            run["p50_ms"].as_f64().unwrap(),
            run["p99_ms"].as_f64().unwrap(),
            run["max_ms"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{row}");
    }

    // Idle: a count per mode (its value is a measurement, not judged here).
    let idle = report["idle"].as_array().unwrap();
    assert_eq!(idle.len(), 2, "{idle:?}");
    for row in idle {
        assert!(row["runs"][0]["transactions"].is_i64(), "{row}");
    }

    // Writer: each shape left exactly the rows it enqueued.
    let writer = report["writer"].as_array().unwrap();
    assert_eq!(writer.len(), 3, "{writer:?}");
    for row in writer {
        let run = &row["runs"][0];
        assert_eq!(run["rows"], run["events"], "{row}");
        assert!(run["events"].as_u64().unwrap() >= 50, "{row}");
    }
}

/// `bench --source wal --quick` (issue 17): polling, the WAL source and
/// emit side by side in one run, every event delivered, what each left in
/// the table counted exactly, PostgreSQL's CPU and WAL measured, the outage
/// recovered, and each target reported beside its figure.
#[tokio::test]
async fn bench_source_wal_quick_measures_each_source_beside_polling() {
    let mut cmd = crate::support::outbox_cmd();
    cmd.args(["bench", "--source", "wal", "--quick", "--json"]);
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .expect("outbox bench --source wal --quick within 5 minutes")
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json");
    assert_eq!(report["source"], "wal");

    // Throughput at batch 100: the three strategies drained all 300 events
    // once each; polling leaves its rows marked, the WAL source deletes
    // them, emitted events never had one.
    let rows = report["throughput"].as_array().unwrap();
    let strategies: Vec<&str> = rows.iter().map(|r| r["strategy"].as_str().unwrap()).collect();
    assert_eq!(strategies, ["relay", "wal", "emit"]);
    let mut wal_bytes = Vec::new();
    for row in rows {
        assert_eq!(row["batch_size"], 100, "{row}");
        let run = &row["runs"][0];
        assert_eq!(run["delivered"], 300, "{row}");
        assert_eq!(run["duplicates"], 0, "{row}");
        let (marked, left) = match row["strategy"].as_str().unwrap() {
            "relay" => (300, 300),
            "wal" => (300, 0),
            _ => (0, 0),
        };
        assert_eq!(
            (run["marked"].as_u64(), run["rows_left"].as_u64()),
            (Some(marked), Some(left)),
            "{row}"
        );
        assert!(run["peak_rss"].is_u64(), "{row}");
        // The throwaway cluster runs on this host, so its CPU is read.
        assert!(run["cost"]["pg_cpu_seconds"].is_f64(), "{row}");
        wal_bytes.push(run["cost"]["wal_bytes"].as_u64().unwrap());
    }
    // An insert and its UPDATE, an insert and its DELETE, one message.
    assert!(
        wal_bytes[0] > wal_bytes[1] && wal_bytes[1] > wal_bytes[2] && wal_bytes[2] > 0,
        "{wal_bytes:?}"
    );
    assert_eq!(report["source_ratios"].as_array().unwrap().len(), 1);

    // Latency: NOTIFY beside the WAL source, every event received once.
    let latency = report["latency"].as_array().unwrap();
    let wakeups: Vec<&serde_json::Value> = latency.iter().map(|r| &r["wakeup"]).collect();
    assert_eq!(wakeups, ["notify", "wal"]);
    for row in latency {
        let run = &row["runs"][0];
        assert_eq!(run["clock"], "sent", "{row}");
        assert_eq!(
            (run["written"].as_u64(), run["received"].as_u64()),
            (Some(100), Some(100)),
            "{row}"
        );
        assert_eq!(run["duplicates"], 0, "{row}");
        let (p50, p99) = (run["p50_ms"].as_f64().unwrap(), run["p99_ms"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p99, "{row}");
    }

    // Dead tuples after 1,000 events, from PostgreSQL's exact counters.
    let dead = report["dead_tuples"].as_array().unwrap();
    let counts: Vec<[i64; 6]> = dead
        .iter()
        .map(|r| {
            let run = &r["runs"][0];
            assert_eq!(run["delivered"], 1000, "{r}");
            ["inserted", "updated", "deleted", "rows", "live", "dead"].map(|k| run[k].as_i64().unwrap())
        })
        .collect();
    assert_eq!(counts[0][..5], [1000, 1000, 0, 1000, 1000], "polling: {counts:?}");
    assert_eq!(counts[1][..5], [1000, 0, 1000, 0, 0], "WAL source: {counts:?}");
    assert!(
        counts[0][5] > 0 && counts[1][5] > 0,
        "updates and deletes leave dead tuples: {counts:?}"
    );
    assert_eq!(counts[2], [0; 6], "emit never touches the table");

    // The outage: everything written arrived; only the WAL source has a
    // slot holding WAL back.
    let outage = report["outage"].as_array().unwrap();
    assert_eq!(outage.len(), 2);
    for row in outage {
        let run = &row["runs"][0];
        let written = run["written"].as_u64().unwrap();
        assert_eq!(run["delivered"].as_u64(), Some(written), "{row}");
        assert!(run["written_during_outage"].as_u64().unwrap() > 0, "{row}");
        assert!(run["catch_up_events"].as_u64().unwrap() > 0, "{row}");
        assert!(run["catch_up_per_second"].as_f64().unwrap() > 0.0, "{row}");
        let retained = &run["retained_max_bytes"];
        match row["strategy"].as_str().unwrap() {
            "relay" => assert!(retained.is_null(), "{row}"),
            _ => assert!(retained.as_i64().unwrap() > 0, "{row}"),
        }
    }

    // Each target beside its figure: all measured in this run.
    let targets = report["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 6);
    for t in targets {
        assert!(t["met"].is_boolean() && t["measured"].is_f64(), "{t}");
    }
}

#[tokio::test]
async fn bench_phases_of_log_tailing_need_source_wal() {
    let out = run_cli(&["bench", "--phases", "outage"], &[]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("add --source wal"),
        "{}",
        text(&out.stderr)
    );
}

/// The configuration reference cannot drift from the option declarations:
/// every flag and environment variable `outbox relay --help` prints, and
/// every sink-table key the sinks declare and every top-level key of the
/// configuration file, is in `docs/configuration.md`.
#[tokio::test]
async fn the_configuration_reference_lists_every_relay_flag_variable_and_key() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration.md"
    ))
    .expect("docs/configuration.md");
    let help = run_cli(&["relay", "--help"], &[]).await;
    assert_eq!(help.status.code(), Some(0));
    let help = text(&help.stdout);
    let mut missing = Vec::new();
    let mut flags = 0;
    for line in help.lines() {
        let line = line.trim_start();
        let flag = line
            .strip_prefix("--")
            .or_else(|| line.get(4..).and_then(|l| l.strip_prefix("--")))
            .map(|rest| rest.split([' ', '=', '<', ',']).next().unwrap_or_default());
        if let Some(flag) = flag.filter(|f| !f.is_empty() && *f != "help") {
            flags += 1;
            // Relay flags as `relay --x`, the global ones as `--x`.
            if !doc.contains(&format!("`relay --{flag}`")) && !doc.contains(&format!("| `--{flag}` |")) {
                missing.push(format!("--{flag}"));
            }
        }
        if let Some(var) = line.strip_prefix("[env: ") {
            let var = var.split(['=', ']']).next().unwrap_or_default();
            if !doc.contains(&format!("`{var}`")) {
                missing.push(var.to_owned());
            }
        }
    }
    let keys = serde_json::to_value(outbox_relay::PerSinkOptions::default()).unwrap();
    for key in keys.as_object().expect("a table of keys").keys() {
        if !doc.contains(&format!("`{key}`")) {
            missing.push(key.clone());
        }
    }
    // Every top-level key of the configuration file, as `config show`
    // lists them.
    let show = run_cli(&["config", "show", "--json"], &[]).await;
    assert_eq!(show.status.code(), Some(0), "{}", text(&show.stderr));
    let show: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    let settings = show["settings"].as_object().expect("settings");
    assert!(settings.len() > 30, "{settings:?}");
    for key in settings.keys() {
        if !doc.contains(&format!("`{key}`")) {
            missing.push(key.clone());
        }
    }
    assert!(flags > 20, "parsed {flags} flags from:\n{help}");
    assert!(missing.is_empty(), "not in docs/configuration.md: {missing:?}");
}
