//! Secrets never printed (issue 35, item 5): every query value of a sink
//! URL is masked in `outbox config show`, in sink errors, in `replay
//! --list` and in the replay job's stored target, whatever its name; a
//! resumed job takes the full URL from the operator again.

use outbox_testkit::{Receiver, Respond};

use crate::support::{Db, LONG, run_cli, text};

/// The names the issue lists, and one no list would hold.
const NAMES: [&str; 10] = [
    "token",
    "access_token",
    "api_key",
    "apikey",
    "key",
    "sig",
    "auth",
    "secret",
    "password",
    "foo",
];

/// A query with each name, each value `s3cr3t-<name>` (`foo=bar` as the
/// issue has it).
fn query() -> String {
    NAMES
        .iter()
        .map(|n| match *n {
            "foo" => "foo=bar".to_owned(),
            n => format!("{n}=s3cr3t-{n}"),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Panics if `output` shows any value of [`query`].
fn assert_masked(what: &str, output: &str) {
    assert!(
        !output.contains("s3cr3t") && !output.contains("=bar"),
        "{what} shows a query value:\n{output}"
    );
}

#[tokio::test]
async fn config_show_and_sink_errors_mask_every_query_value() {
    let sink = format!("https://example.com/hook?{}", query());
    let env = [("OUTBOX_SINK", sink.as_str())];
    for args in [&["config", "show"][..], &["config", "show", "--json"]] {
        let out = run_cli(args, &env).await;
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let masked: Vec<String> = NAMES.iter().map(|n| format!("{n}=***")).collect();
        assert!(
            stdout.contains(&format!("https://example.com/hook?{}", masked.join("&"))),
            "{stdout}"
        );
        assert_masked("config show", &stdout);
        assert_masked("config show's stderr", &stderr);
    }
    // A sink URL refused is named in the error, masked.
    let bad = format!("nope://example.com/hook?{}", query());
    let out = run_cli(&["config", "show", "--sink", &bad], &[]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown sink scheme \"nope\""), "{stderr}");
    assert_masked("a sink error", &stderr);
}

#[tokio::test]
async fn replay_stores_and_lists_its_target_masked_and_resumes_with_the_full_url() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', g::text, 'E', '{}', now() FROM generate_series(1, 3) g",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let to = format!("{}?{}", receiver.url(), query());
    let out = run_cli(&["replay", "--to", &to], &env).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_masked("replay", &text(&out.stdout));
    receiver.wait_for_count(3, LONG).await.unwrap();

    let stored: Vec<String> = db
        .client
        .query("SELECT target FROM outbox_replays", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(stored.len(), 1);
    assert_masked("outbox_replays.target", &stored[0]);
    for args in [&["replay", "--list"][..], &["replay", "--list", "--json"]] {
        let out = run_cli(args, &env).await;
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains("token=***"), "{}", text(&out.stdout));
        assert_masked("replay --list", &text(&out.stdout));
    }

    // Stopped before its end: resuming needs the URL again, and sends with it.
    db.client
        .batch_execute("UPDATE outbox_replays SET state = 'stopped', cursor_id = 0, sent = 0")
        .await
        .unwrap();
    let out = run_cli(&["replay", "--resume", "1"], &env).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "held a password or query values, which are never stored: give the URL again with --to"
        ),
        "{stderr}"
    );
    assert_masked("the refused resume", &stderr);
    let out = run_cli(&["replay", "--resume", "1", "--to", &to], &env).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_masked("the resume", &text(&out.stdout));
    receiver.wait_for_count(6, LONG).await.unwrap();
    assert_eq!(receiver.count(), 6, "three events, twice");
}
