//! Logs fit for a log pipeline (issue 15, item 8): no ANSI colour into a
//! pipe; `--log-format json` lines carry display values, never Rust's debug
//! syntax, and the fatal error is JSON too; a dropped connection logs the
//! server's words, not `db error`. Waiting on log lines is fine here: the
//! lines are what is under test.

use outbox_testkit::Redis;
use serde_json::Value;

use crate::support::{
    Db, LONG, relay_without_postgres, run_cli, start_relay, stop_relay, text, unreachable_postgres,
};

/// Parses every line as one JSON object, failing on any that is not.
fn parse_lines(lines: &[String]) -> Vec<Value> {
    lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Every string anywhere in `v`, inside objects and arrays too.
fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
        Value::Object(o) => o.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn json_logs_carry_display_values_not_debug_syntax() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(100, 10).await;
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--log-format", "json", "--batch-size", "10"],
        &[],
    )
    .await;
    db.wait_drained("the 100 events published").await;
    let lines = stop_relay(relay).await;
    let logs = parse_lines(&lines);

    let ready = logs
        .iter()
        .find(|l| l["fields"]["message"] == "relay ready")
        .unwrap_or_else(|| panic!("no relay ready line in {lines:#?}"));
    let fields = &ready["fields"];
    assert_eq!(fields["ordering"], "partition", "{ready}");
    let relay_id = fields["relay_id"]
        .as_str()
        .unwrap_or_else(|| panic!("relay_id: {ready}"));
    uuid::Uuid::parse_str(relay_id).unwrap_or_else(|e| panic!("relay_id {relay_id:?} is no bare UUID ({e})"));
    assert_eq!(relay_id.len(), 36, "hyphenated, nothing around it: {relay_id:?}");
    // The debug lines logged each batch's duration (they once printed a
    // Debug `Duration`): now seconds, a number.
    let committed: Vec<_> = logs
        .iter()
        .filter(|l| l["fields"]["message"] == "batch committed")
        .collect();
    assert!(!committed.is_empty(), "no batch committed line in {lines:#?}");
    assert!(
        committed.iter().all(|l| l["fields"]["seconds"].is_f64()),
        "{committed:#?}"
    );

    for log in &logs {
        let mut values = Vec::new();
        strings(&log["fields"], &mut values);
        for v in values {
            assert!(
                !v.starts_with("Some(") && !v.contains("{ ") && !v.contains('\u{1b}'),
                "debug syntax in {log}"
            );
        }
    }
}

#[tokio::test]
async fn a_fatal_error_is_one_json_line_with_the_same_exit_code() {
    let url = unreachable_postgres();
    let env = [("DATABASE_URL", url.as_str())];
    let out = run_cli(&["relay", "--sink", "ftp://host/x", "--log-format", "json"], &env).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<String> = stderr.lines().map(String::from).collect();
    let logs = parse_lines(&lines);
    let fatal = logs.last().unwrap_or_else(|| panic!("nothing on stderr"));
    assert_eq!(fatal["level"], "ERROR", "{fatal}");
    assert_eq!(fatal["fields"]["exit_code"], 2, "{fatal}");
    let chain = std::iter::once(&fatal["fields"]["message"])
        .chain(fatal["fields"]["causes"].as_array().unwrap())
        .map(|v| v.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(chain.contains("unknown sink scheme \"ftp\""), "{fatal}");
    assert!(
        fatal["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{fatal}"
    );

    // Runtime failures keep exit 1; the retries before it are JSON too.
    let out = relay_without_postgres(&["--log-format", "json"], &[]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<String> = stderr.lines().map(String::from).collect();
    let logs = parse_lines(&lines);
    assert!(
        logs.iter().any(
            |l| l["fields"]["message"] == "postgres not reachable yet; retrying"
                && l["fields"]["retry_in_ms"].is_u64()
        ),
        "{stderr}"
    );
    assert_eq!(logs.last().unwrap()["fields"]["exit_code"], 1, "{stderr}");

    // The human format is unchanged.
    let out = run_cli(&["relay", "--sink", "ftp://host/x"], &env).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
}

#[tokio::test]
async fn human_logs_into_a_pipe_have_no_colour() {
    // NO_COLOR would hide the fault: the child's stderr is a pipe, and that
    // alone must turn colour off.
    let out = relay_without_postgres(&[], &[("NO_COLOR", "")]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("postgres not reachable yet; retrying"),
        "{stderr}"
    );
    assert!(!stderr.contains('\u{1b}'), "ANSI escapes into a pipe: {stderr:?}");
}

#[tokio::test]
async fn a_dropped_connection_logs_the_servers_message() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(&db.url, &redis.url(), &["--log-format", "json"], &[]).await;
    let terminated = db
        .count(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name LIKE 'outbox-relay%' AND pid <> pg_backend_pid()) t",
        )
        .await;
    // The batch sessions and the lease connection.
    assert!(terminated >= 2, "{terminated} relay backends terminated");
    relay
        .wait_for_line("terminating connection due to administrator command", LONG)
        .await
        .unwrap();
    relay
        .wait_for_notification("STATUS=reconnected", LONG)
        .await
        .unwrap();
    let lines = stop_relay(relay).await;
    let logs = parse_lines(&lines);

    let closed: Vec<_> = logs
        .iter()
        .filter(|l| l["fields"]["message"] == "postgres connection closed")
        .collect();
    assert!(!closed.is_empty(), "{lines:#?}");
    const SERVER: &str = "FATAL: terminating connection due to administrator command (SQLSTATE 57P01)";
    assert!(
        closed.iter().any(|l| l["fields"]["error"] == SERVER),
        "the server's words: {closed:#?}"
    );
    // A connection whose socket closed (or was reset) before the server's
    // message was read (the backend sends it, then exits) can only say so.
    for l in &closed {
        let error = l["fields"]["error"].as_str().unwrap_or_default();
        assert!(
            error == SERVER
                || error == "connection closed"
                || error.starts_with("error communicating with the server: Connection reset by peer"),
            "{l}"
        );
    }
    assert!(
        lines.iter().all(|l| !l.contains("db error")),
        "a bare `db error` logged: {lines:#?}"
    );
}
