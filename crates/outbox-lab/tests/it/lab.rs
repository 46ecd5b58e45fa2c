//! `outbox-lab lab all --quick` (issue 6): every correctness verdict holds with
//! the reference's exact counts, the HTML report is well formed (an XML
//! parser reads it), has each experiment's table and an `<svg>` per plot,
//! and a real headless chromium opens it and takes a screenshot. And
//! `outbox-lab lab slow-sink --quick` (issue 18): a deadline claim holds no
//! transaction open through a slow delivery, a lock claim does.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::support::{lab_cmd, open_in_chromium, text};

/// Every experiment `all` runs.
const EXPERIMENTS: [&str; 14] = [
    "dual-write",
    "rollback",
    "crash-before-mark",
    "retry",
    "watermark",
    "latency",
    "idle",
    "batch-size",
    "index",
    "ordering",
    "cleanup",
    "redis-group",
    "wal",
    "slow-sink",
];

#[tokio::test]
async fn lab_all_quick_holds_its_verdicts_and_the_report_opens_in_chromium() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lab");
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("lab.html");
    let _ = std::fs::remove_file(&report);

    let mut cmd = lab_cmd();
    cmd.args(["lab", "all", "--quick", "--json", "--report"])
        .arg(&report);
    let out = tokio::time::timeout(Duration::from_secs(600), cmd.output())
        .await
        .expect("outbox-lab lab all --quick within 10 minutes")
        .unwrap();
    assert!(
        out.status.success(),
        "outbox-lab lab failed: {}\n{}",
        text(&out.stderr),
        text(&out.stdout)
    );
    let outcomes: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    let outcomes = outcomes.as_array().unwrap();
    let names: Vec<&str> = outcomes.iter().map(|o| o["name"].as_str().unwrap()).collect();
    assert_eq!(names, EXPERIMENTS);
    for o in outcomes {
        for row in o["rows"].as_array().unwrap() {
            assert_ne!(row["verdict"], "fail", "{}: {row}", o["name"]);
        }
    }

    // The reference's figures, exactly.
    let ours = |experiment: &str, measure: &str| -> String {
        let o = outcomes.iter().find(|o| o["name"] == experiment).unwrap();
        let row = o["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["measure"] == measure)
            .unwrap_or_else(|| panic!("{experiment} has no row {measure:?}"));
        row["ours"].as_str().unwrap().to_owned()
    };
    assert_eq!(ours("dual-write", "naive: ghost shipments"), "2");
    assert_eq!(ours("dual-write", "naive: orders without shipment"), "2");
    assert_eq!(
        ours("dual-write", "outbox: orders / events / shipments"),
        "3 / 3 / 3"
    );
    assert_eq!(ours("dual-write", "outbox: ghost shipments"), "0");
    assert_eq!(ours("dual-write", "outbox: orders without shipment"), "0");
    assert_eq!(ours("rollback", "ROLLBACK: orders / outbox rows"), "0 / 0");
    assert_eq!(
        ours(
            "rollback",
            "writer killed (SIGKILL) before COMMIT: orders / outbox rows"
        ),
        "0 / 0"
    );
    assert_eq!(ours("crash-before-mark", "requests received"), "8");
    assert_eq!(ours("crash-before-mark", "distinct events received"), "5");
    assert_eq!(
        ours(
            "crash-before-mark",
            "naive consumer: shipments / orders shipped twice"
        ),
        "8 / 3"
    );
    assert_eq!(
        ours(
            "crash-before-mark",
            "inbox consumer: shipments / orders shipped twice / duplicates skipped"
        ),
        "5 / 0 / 3"
    );
    assert_eq!(ours("retry", "requests: 500 / 200"), "3 / 2");
    assert_eq!(ours("retry", "attempts until delivered, per event"), "[3, 2]");
    assert_eq!(ours("watermark", "watermark relay: events lost"), "1");
    assert_eq!(ours("watermark", "ours: events lost"), "0");
    for mode in ["partition", "strict"] {
        for relays in [1, 2, 4] {
            let measure = format!("{mode}, {relays} relay(s): orders out of order");
            assert_eq!(ours("ordering", &measure), "0 of 100");
        }
    }
    assert_eq!(ours("cleanup", "rows left: unpublished only"), "50");
    assert_eq!(ours("redis-group", "shipments / orders shipped twice"), "5 / 0");
    assert_eq!(
        ours(
            "wal",
            "rows left after the drain: polling (published) / WAL source / emit"
        ),
        "300 / 0 / 0"
    );
    assert_eq!(ours("wal", "emit: dead tuples / rows in the table"), "0 / 0");

    let html = std::fs::read_to_string(&report).expect("the report was written");
    check_well_formed(&html, outcomes);
    open_in_chromium(&report, &dir.join("lab-report.png"), &EXPERIMENTS).await;
}

/// `outbox-lab lab slow-sink --quick` (a receiver answering in 2 s, 10,000
/// updates of an unrelated table during delivery, then a VACUUM of it):
/// under `--claim lock` a relay transaction outlives the receiver's 2 s and
/// the VACUUM leaves the updates' dead tuples; under `--claim deadline` no
/// relay transaction seen lasts over 100 ms and the VACUUM removes them.
/// The figures are the experiment's side-by-side table in `--json`.
#[tokio::test]
async fn issue_18_slow_sink_lease_claims_hold_back_no_vacuum() {
    let mut cmd = lab_cmd();
    cmd.args(["lab", "slow-sink", "--quick", "--json"]);
    let out = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .expect("outbox-lab lab slow-sink --quick within 5 minutes")
        .unwrap();
    assert!(
        out.status.success(),
        "outbox-lab lab slow-sink failed: {}\n{}",
        text(&out.stderr),
        text(&out.stdout)
    );
    let outcomes: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    let [outcome] = outcomes.as_array().unwrap().as_slice() else {
        panic!("one experiment: {outcomes}")
    };
    assert_eq!(outcome["name"], "slow-sink");
    let table = outcome["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["title"] == "Lock and lease side by side")
        .expect("the side-by-side table");
    let header: Vec<&str> = table["header"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    let figure = |claim: &str, column: &str| -> f64 {
        let i = header
            .iter()
            .position(|h| *h == column)
            .unwrap_or_else(|| panic!("no column {column:?} in {header:?}"));
        let row = table["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r[0] == claim)
            .unwrap_or_else(|| panic!("no row {claim}"));
        row[i].as_str().unwrap().parse().unwrap()
    };

    for claim in ["lock", "deadline"] {
        // The sampler found the relay's backends, and every event arrived.
        assert!(
            figure(claim, "relay backends") >= 1.0,
            "{claim}: relay backends seen"
        );
        assert_eq!(figure(claim, "distinct events"), 128.0, "{claim}");
        assert_eq!(figure(claim, "updates"), 10_000.0, "{claim}");
    }
    // Lock: the fault happens. A transaction stays open through a batch's
    // delivery, longer than one request, and the VACUUM keeps the updates.
    let lock_open = figure("lock", "oldest relay xact, s");
    assert!(lock_open > 2.0, "lock: oldest relay transaction {lock_open} s");
    let lock_dead = figure("lock", "dead after VACUUM");
    assert!(lock_dead > 0.0, "lock: the VACUUM removed every dead tuple");
    // Lease: claim and mark are short transactions; delivery holds none.
    let lease_open = figure("deadline", "oldest relay xact, s");
    assert!(
        lease_open <= 0.1,
        "lease: a relay transaction open {lease_open} s"
    );
    // ≈ 0, not 0: a snapshot of another backend's (the sampler's own
    // query) running as the VACUUM starts may keep the last few updates.
    let lease_dead = figure("deadline", "dead after VACUUM");
    assert!(
        lease_dead <= 100.0,
        "lease: {lease_dead} dead tuples of 10,000 updates left by the VACUUM"
    );
}

/// Parses the page as XML and finds, per experiment, its section, a table
/// with one row per verdict, and one `<svg>` per plot.
fn check_well_formed(html: &str, outcomes: &[Value]) {
    // `<!DOCTYPE html>` is the one declaration; roxmltree refuses DTDs by default.
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..roxmltree::ParsingOptions::default()
    };
    let doc = roxmltree::Document::parse_with_options(html, options).expect("the report parses as XML");
    assert!(!html.contains("<script"), "no JavaScript in the report");
    for o in outcomes {
        let name = o["name"].as_str().unwrap();
        let section = doc
            .descendants()
            .find(|n| n.has_tag_name("section") && n.attribute("id") == Some(name))
            .unwrap_or_else(|| panic!("no section for {name}"));
        let table = section
            .descendants()
            .find(|n| n.has_tag_name("table") && n.attribute("class") == Some("verdicts"))
            .unwrap_or_else(|| panic!("no verdict table for {name}"));
        let body_rows = table
            .descendants()
            .filter(|n| n.has_tag_name("tr") && n.parent().is_some_and(|p| p.has_tag_name("tbody")))
            .count();
        assert_eq!(body_rows, o["rows"].as_array().unwrap().len(), "{name}'s table");
        let svgs = section
            .descendants()
            .filter(|n| n.tag_name().name() == "svg")
            .count();
        assert_eq!(svgs, o["plots"].as_array().unwrap().len(), "{name}'s plots");
    }
    assert!(
        outcomes
            .iter()
            .any(|o| !o["plots"].as_array().unwrap().is_empty()),
        "at least one plot"
    );
}
