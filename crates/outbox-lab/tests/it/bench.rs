//! `outbox-lab bench`: the relay's figures beside their baselines, with
//! exact counts of what each run delivered, marked and left.

use crate::support::{lab_cmd, run_lab, text};

#[tokio::test]
async fn bench_quick_reports_exact_counts() {
    let out = run_lab(&["bench", "--quick", "--json"], &[]).await;
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

/// `bench --phases held-snapshot --quick` (issue 32): both sources, clean
/// and with a snapshot held, every event of every chunk delivered once, a
/// rate per chunk, and the held runs set against the clean ones.
#[tokio::test]
async fn bench_held_snapshot_quick_drains_every_chunk_of_both_sources() {
    let mut cmd = lab_cmd();
    cmd.args(["bench", "--phases", "held-snapshot", "--quick", "--json"]);
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .expect("outbox-lab bench --phases held-snapshot --quick within 5 minutes")
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json");
    assert_eq!(report["wal_level_logical"], true, "the bench's own cluster");
    let rows = report["held_snapshot"].as_array().unwrap();
    let kinds: Vec<(String, bool)> = rows
        .iter()
        .map(|r| {
            (
                r["strategy"].as_str().unwrap().to_owned(),
                r["held"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("relay".to_owned(), false),
            ("relay".to_owned(), true),
            ("wal".to_owned(), false),
            ("wal".to_owned(), true)
        ]
    );
    for row in rows {
        let run = &row["runs"][0];
        assert_eq!(
            (run["written"].as_u64(), run["delivered"].as_u64()),
            (Some(1500), Some(1500)),
            "{row}"
        );
        assert_eq!(run["duplicates"], 0, "{row}");
        assert_eq!(row["per_chunk"].as_array().unwrap().len(), 3, "{row}");
        assert_eq!(row["last_over_clean_last"].is_f64(), row["held"] == true, "{row}");
    }
}

/// `bench --source wal --quick` (issue 17): polling, the WAL source and
/// emit side by side in one run, every event delivered, what each left in
/// the table counted exactly, PostgreSQL's CPU and WAL measured, the outage
/// recovered, and each target reported beside its figure.
#[tokio::test]
async fn bench_source_wal_quick_measures_each_source_beside_polling() {
    let mut cmd = lab_cmd();
    cmd.args(["bench", "--source", "wal", "--quick", "--json"]);
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .expect("outbox-lab bench --source wal --quick within 5 minutes")
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

/// `bench --phases pooled --quick` (issue 32): the relay direct, through
/// PgBouncer in session mode and in transaction mode, each route and claim
/// mode delivering every event once; latency through the transaction pool,
/// polling and with `--listen-url`, every event received.
#[tokio::test]
async fn issue_32_bench_pooled_quick_delivers_every_event_on_every_route() {
    let out = run_lab(&["bench", "--phases", "pooled", "--quick", "--json"], &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json");
    let rows = report["pooled"].as_array().unwrap();
    assert_eq!(rows.len(), 16, "4 routes × 2 claim modes × batch sizes 1, 100");
    let routes: std::collections::BTreeSet<&str> = rows.iter().filter_map(|r| r["route"].as_str()).collect();
    assert_eq!(
        routes.into_iter().collect::<Vec<_>>(),
        ["direct", "direct_unnamed", "session", "transaction"]
    );
    for row in rows {
        let run = &row["runs"][0];
        assert_eq!(run["delivered"], 300, "{row}");
        assert_eq!(run["marked"], 300, "{row}");
        assert_eq!(run["duplicates"], 0, "{row}");
        assert!(row["events_per_second"]["median"].as_f64().unwrap() > 0.0);
    }
    let latency = report["pooled_latency"].as_array().unwrap();
    assert_eq!(latency.len(), 3, "{latency:?}");
    for row in latency {
        let run = &row["runs"][0];
        assert_eq!(run["received"], run["written"], "{row}");
        assert_eq!(run["duplicates"], 0, "{row}");
    }
    assert!(
        report["throughput"].as_array().unwrap().is_empty(),
        "only the phase asked for"
    );
}

#[tokio::test]
async fn bench_phases_of_log_tailing_need_source_wal() {
    let out = run_lab(&["bench", "--phases", "outage"], &[]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("add --source wal"),
        "{}",
        text(&out.stderr)
    );
}

/// Without the production binary the bench cannot run a relay: it says so
/// before it starts anything, naming both ways to fix it.
#[tokio::test]
async fn the_lab_names_the_outbox_binary_it_cannot_find() {
    let missing = [("OUTBOX_BIN", "/nonexistent/outbox")];
    let out = run_lab(&["bench", "--quick"], &missing).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OUTBOX_BIN is /nonexistent/outbox"), "{stderr}");
    assert!(stderr.contains("cargo build -p outbox-cli"), "{stderr}");
}

/// `outbox-lab bench <args>` to completion, within 5 minutes.
async fn run_bench(args: &[&str]) -> std::process::Output {
    let mut cmd = lab_cmd();
    cmd.arg("bench").args(args);
    tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .expect("outbox-lab bench within 5 minutes")
        .unwrap()
}

/// `bench --phases fleet --tenants 20 --quick` (issue 33): one `outbox
/// relay --schemas` process serving 20 tenant outboxes; the table has
/// every figure beside its target, and every event written was delivered
/// and marked, by the fleet and by the single relay beside it. Speeds are
/// not judged.
#[tokio::test]
async fn issue_33_bench_fleet_quick_reports_every_figure_with_exact_counts() {
    let out = run_bench(&["--phases", "fleet", "--tenants", "20", "--quick", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json");
    assert!(
        report["throughput"].as_array().unwrap().is_empty(),
        "only the phase asked for"
    );
    let fleet = &report["fleet"];
    assert_eq!(
        (fleet["tenants"].as_u64(), fleet["sessions"].as_u64()),
        (Some(20), Some(4))
    );
    let runs = fleet["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "--quick: one rep");
    let run = &runs[0];
    // A control session, a listening session and at most 4 batch
    // sessions, at least one used.
    let connections = run["connections_max"].as_i64().unwrap();
    assert!((3..=6).contains(&connections), "{connections} connections");
    // Latency: 20 tenants, one event a second each, for 2 s.
    let latency = &run["latency"];
    assert_eq!(
        (
            latency["written"].as_u64(),
            latency["received"].as_u64(),
            latency["duplicates"].as_u64()
        ),
        (Some(40), Some(40), Some(0)),
        "{latency}"
    );
    let (p50, p99, max) = (
        latency["p50_ms"].as_f64().unwrap(),
        latency["p99_ms"].as_f64().unwrap(),
        latency["max_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{latency}");
    // Throughput: 10 events per tenant, and as many through one outbox.
    for drain in ["drain_fleet", "drain_single"] {
        let d = &run[drain];
        assert_eq!(
            ["events", "delivered", "marked", "duplicates"].map(|k| d[k].as_u64().unwrap()),
            [200, 200, 200, 0],
            "{drain}: {d}"
        );
        assert!(d["per_second"].as_f64().unwrap() > 0.0, "{drain}: {d}");
    }
    for idle in ["idle_fleet", "idle_single"] {
        assert!(run[idle]["transactions"].is_i64(), "{idle}: {run}");
    }
    let targets: Vec<&str> = fleet["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            assert!(t["met"].is_boolean() && t["measured"].is_f64(), "{t}");
            t["figure"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        targets.len(),
        4,
        "connections, idle, latency, throughput: {targets:?}"
    );

    // The table: every figure, with the counts.
    let out = run_bench(&["--phases", "fleet", "--tenants", "20", "--quick"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let row = |label: &str| {
        table
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label:?} in\n{table}"))
            .to_owned()
    };
    assert!(row("connections, most seen").contains("≤ 20"), "{table}");
    assert!(row("idle: server transactions/s").contains("≤ 1.00/s"), "{table}");
    row("latency: events/s written");
    row("latency p50, ms");
    assert!(row("latency p99, ms").contains("≤ 50.0 ms"), "{table}");
    row("latency max, ms");
    assert!(row("latency: received").contains("40/40"), "{table}");
    assert!(row("throughput, events/s").contains("≥ 80%"), "{table}");
    let counts = row("throughput: delivered, marked");
    assert_eq!(
        counts.matches("200/200, 200 marked, 0 dup").count(),
        2,
        "fleet and single relay: {counts}"
    );
    row("peak RSS, draining");
}
