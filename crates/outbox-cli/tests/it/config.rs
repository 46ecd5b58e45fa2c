//! `relay --config`: every relay setting from one file, under the
//! environment and the flags; `outbox config show`. Issue 15, item 7.

use outbox_testkit::{Redis, Spawned};
use serde_json::Value;

use crate::cli::expect_config_error;
use crate::support::{Db, LONG, distinct_events, outbox_cmd, read_stream, run_cli, stop_relay, text};

/// Writes `text` to a fresh file and returns its path.
fn config_file(text: &str) -> String {
    let path = std::env::temp_dir().join(format!("outbox-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

/// `outbox config show --json ARGS`: exit 0, the parsed document.
async fn show(args: &[&str], envs: &[(&str, &str)]) -> Value {
    let mut all = vec!["config", "show", "--json"];
    all.extend_from_slice(args);
    let out = run_cli(&all, envs).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
}

#[tokio::test]
async fn config_file_alone_configures_the_relay() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(30, 3).await;
    // No flag and no variable: the database, the sink and the relay-wide
    // settings all come from the file.
    let path = config_file(&format!(
        "database_url = \"{}\"\nsink = \"{}\"\nstream_prefix = \"from.file\"\nbatch_size = 7\n\
         ordering = \"strict\"\nmax_attempts = 3\n",
        db.url,
        redis.url()
    ));
    let mut cmd = outbox_cmd();
    cmd.args(["relay", "--config", &path, "--log-format", "json"]);
    let relay = Spawned::spawn_notified(cmd).expect("spawn relay");
    relay
        .wait_for_notification("READY=1", LONG)
        .await
        .unwrap_or_else(|e| panic!("{e}: {:#?}", relay.lines()));
    // Output capture, not synchronisation: the line is logged before READY=1.
    let ready = relay.wait_for_line("relay ready", LONG).await.unwrap();
    let ready: Value = serde_json::from_str(&ready).expect("--log-format json");
    assert_eq!(ready["fields"]["batch_size"], 7, "{ready}");
    assert_eq!(ready["fields"]["ordering"], "strict", "{ready}");
    assert_eq!(
        relay.count_lines("database_url is set in"),
        1,
        "the password in the file is warned about: {:#?}",
        relay.lines()
    );
    db.wait_drained("every row published").await;
    stop_relay(relay).await;

    let stream = read_stream(&redis.url(), "from.file.orders").await;
    assert_eq!(stream.len(), 30, "30 events in the file's stream");
    assert_eq!(distinct_events(&stream), 30);
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn environment_beats_the_file_and_a_flag_beats_both() {
    let path = config_file(
        "# relay settings\nsink = \"redis://127.0.0.1:6379\"\nbatch_size = 50\nschema = \"shop\"\n\
         backoff_max = \"1m\"\n",
    );
    let config = ["--config", path.as_str()];

    let file = show(&config, &[]).await;
    let settings = &file["settings"];
    assert_eq!(settings["batch_size"]["value"], "50");
    assert_eq!(settings["batch_size"]["source"], format!("file {path}:3"));
    assert_eq!(settings["schema"]["value"], "shop");
    assert_eq!(settings["schema"]["source"], format!("file {path}:4"));
    assert_eq!(settings["backoff_max"]["source"], format!("file {path}:5"));
    assert_eq!(settings["lease_timeout"]["value"], "10s");
    assert_eq!(settings["lease_timeout"]["source"], "default");
    assert_eq!(file["config"]["source"], "flag");

    let env = [("OUTBOX_BATCH_SIZE", "60"), ("OUTBOX_SCHEMA", "billing")];
    let from_env = show(&config, &env).await;
    let settings = &from_env["settings"];
    assert_eq!(settings["batch_size"]["value"], "60");
    assert_eq!(settings["batch_size"]["source"], "env OUTBOX_BATCH_SIZE");
    assert_eq!(settings["schema"]["value"], "billing");
    assert_eq!(settings["schema"]["source"], "env OUTBOX_SCHEMA");
    // What the environment leaves out still comes from the file.
    assert_eq!(settings["backoff_max"]["value"], "1m");

    // A global flag before the subcommand counts as a flag too.
    let args = [
        "--schema",
        "audit",
        "config",
        "show",
        "--json",
        "--batch-size",
        "70",
        "--config",
        &path,
    ];
    let out = run_cli(&args, &env).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let from_flags: Value = serde_json::from_slice(&out.stdout).unwrap();
    let settings = &from_flags["settings"];
    assert_eq!(settings["batch_size"]["value"], "70");
    assert_eq!(settings["batch_size"]["source"], "flag");
    assert_eq!(settings["schema"]["value"], "audit");
    assert_eq!(settings["schema"]["source"], "flag");

    // The relay layers the same way: the file's backoff_max (1m) under a
    // flag's --backoff-base (2m) is refused by the relay's own check.
    expect_config_error(
        &["relay", "--config", &path, "--backoff-base", "2m"],
        &[("DATABASE_URL", "postgres://127.0.0.1:1/nowhere")],
        "--backoff-max (60s) is shorter than --backoff-base (120s)",
    )
    .await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn unknown_keys_and_bad_values_name_the_key_and_line() {
    let env = [("DATABASE_URL", "postgres://127.0.0.1:1/nowhere")];
    let cases = [
        (
            "sink = \"redis://x\"\n\nbatchsize = 5\n",
            ":3: unknown key `batchsize`: did you mean `batch_size`? (every key: docs/configuration.md)",
        ),
        (
            "sink = \"redis://x\"\nbatch_size = \"x\"\n",
            ":2: batch_size = \"x\": invalid digit found in string",
        ),
        ("batch_size = 0\n", ":1: batch_size = 0: 0 is not in 1..=10000"),
        (
            "sink = \"redis://x\"\nordering = \"sideways\"\n",
            ":2: ordering = \"sideways\": expected one of none, partition, strict",
        ),
        ("poll_interval = 5\n", ":1: poll_interval = 5: time unit needed"),
        (
            "no_notify = \"yes\"\n",
            ":1: no_notify = \"yes\": expected true or false",
        ),
        (
            "sink = \"redis://x\"\n[routes.orders]\nsink = \"redis://y\"\nsubjekt = \"a\"\n",
            ":4: unknown key `subjekt`: did you mean `nats_subject`?",
        ),
        (
            "sink = \"redis://x\"\n\n[routes.orders]\nsink = \"ftp://y\"\n",
            ":4: [routes.orders] sink: unknown sink scheme \"ftp\"",
        ),
        (
            "[default]\nsink = \"http://x\"\nstream_prefix = \"s.\"\n",
            ":3: [default] stream_prefix: a key of the redis sink, but this table's sink is http://…",
        ),
    ];
    for (body, needle) in cases {
        let path = config_file(body);
        let needle = format!("--config {path}{needle}");
        expect_config_error(&["relay", "--config", &path], &env, &needle).await;
        // The same error from `config show`.
        expect_config_error(&["config", "show", "--config", &path], &[], &needle).await;
        let _ = std::fs::remove_file(path);
    }
    // No sink anywhere.
    let path = config_file("batch_size = 5\n");
    expect_config_error(&["relay", "--config", &path], &env, "no sink").await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn config_show_redacts_secrets_and_names_every_source() {
    let path = config_file(
        "database_url = \"postgres://app:pg-pass@db.internal:5432/shop\"\n\
         sink = \"amqp://relay:amqp-pass@rabbit:5672/%2f\"\n\
         http_secret = \"whsec_c2VjcmV0LXNpZ25pbmc=\"\n\
         format = \"cloudevents\"\n\
         \n\
         [routes.orders]\n\
         sink = \"https://hooks.example/orders?client_secret=hook-pass\"\n\
         http_concurrency = 4\n\
         \n\
         [ordering]\n\
         orders = \"strict\"\n",
    );
    let args = ["config", "show", "--config", &path];
    let env = [("OUTBOX_NATS_SUBJECT", "n.{event_type}")];
    let out = run_cli(&args, &env).await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // The secrets are gone, what they belong to is not.
    for secret in ["pg-pass", "amqp-pass", "c2VjcmV0LXNpZ25pbmc", "hook-pass"] {
        assert!(!stdout.contains(secret), "{secret} shown:\n{stdout}");
    }
    let database_url = stdout
        .lines()
        .find(|l| l.starts_with("database_url "))
        .unwrap_or_else(|| panic!("no database_url line:\n{stdout}"));
    assert!(
        database_url.contains("postgres://app:***@db.internal:5432/shop")
            && database_url.ends_with(&format!("file {path}:1")),
        "{database_url}"
    );
    for line in [
        "amqp://relay:***@rabbit:5672/%2f",
        "https://hooks.example/orders?client_secret=***",
        "[routes.orders]",
        "[ordering]",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    assert!(
        stderr.contains(&format!("database_url is set in {path}:1")),
        "{stderr}"
    );

    let json = show(&args[2..], &env).await;
    let settings = &json["settings"];
    assert_eq!(settings["http_secret"]["value"], "***");
    assert_eq!(settings["http_secret"]["source"], format!("file {path}:3"));
    assert_eq!(settings["nats_subject"]["source"], "env OUTBOX_NATS_SUBJECT");
    assert_eq!(settings["batch_size"]["source"], "default");
    assert_eq!(settings["batch_size"]["value"], "100");
    assert_eq!(settings["cloudevents_source"]["value"], "/outbox/public.outbox");
    // A route's own key wins for its route; the rest is the top level's.
    let orders = &json["tables"]["[routes.orders]"];
    assert_eq!(orders["http_concurrency"]["value"], "4");
    assert_eq!(orders["http_concurrency"]["source"], format!("file {path}:8"));
    assert_eq!(orders["format"]["value"], "cloudevents");
    assert_eq!(orders["format"]["source"], format!("file {path}:4"));
    assert_eq!(orders["nats_subject"]["source"], "env OUTBOX_NATS_SUBJECT");
    assert_eq!(orders["http_secret"]["value"], "***");
    assert_eq!(json["ordering"]["orders"]["value"], "strict");
    assert_eq!(json["ordering"]["orders"]["source"], format!("file {path}:11"));
    let _ = std::fs::remove_file(path);
}

/// The full example of docs/configuration.md is a valid file, and every
/// key in it takes effect from the file.
#[tokio::test]
async fn the_documented_example_is_a_valid_file() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration.md"
    ))
    .expect("docs/configuration.md");
    let section = doc
        .split("## The configuration file")
        .nth(1)
        .expect("the section");
    let example = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a toml example");
    let path = config_file(example);
    let json = show(&["--config", &path], &[]).await;
    let top_level: Vec<&str> = example
        .lines()
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.trim()))
        .collect();
    assert!(top_level.len() > 20, "{top_level:?}");
    for key in top_level {
        let source = json["settings"][key]["source"].as_str().unwrap_or_default();
        assert!(source.starts_with("file "), "{key}: {source}");
    }
    assert_eq!(json["tables"]["[routes.orders]"]["format"]["value"], "native");
    assert_eq!(json["settings"]["ordering_for"]["value"][0], "orders=strict");
    let _ = std::fs::remove_file(path);
}
