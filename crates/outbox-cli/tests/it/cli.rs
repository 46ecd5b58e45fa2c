//! The CLI's contract: exit codes and messages for bad input, migrate.

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
    let mut known = vec!["redis", "rediss", "http", "https", "nats", "amqp", "amqps"];
    for (on, scheme) in [
        (cfg!(feature = "kafka"), "kafka"),
        (cfg!(feature = "sqs"), "sqs"),
        (cfg!(feature = "sns"), "sns"),
    ] {
        if on {
            known.push(scheme);
        }
    }
    let unknown = format!(
        "unknown sink scheme \"ftp\" in \"ftp://host/x\" (known: {})",
        known.join(", ")
    );
    expect_config_error(&["relay", "--sink", "ftp://host/x"], &env, &unknown).await;
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
        "invalid value 'lots' in the environment variable OUTBOX_BATCH_SIZE (--batch-size)",
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

/// A statement the server refuses ends with the server's words and its
/// SQLSTATE, not tokio-postgres's bare `db error`.
#[tokio::test]
async fn a_refused_statement_is_reported_in_the_servers_words() {
    let db = Db::start().await;
    let fresh = db.pg.fresh_database().await.unwrap();
    let name = fresh
        .rsplit('/')
        .next()
        .unwrap()
        .split('?')
        .next()
        .unwrap()
        .to_owned();
    db.client
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    let out = run_cli(&["migrate"], &[("DATABASE_URL", &fresh)]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("db error"), "{stderr}");
    assert!(
        stderr.contains("read-only transaction (SQLSTATE 25006)"),
        "{stderr}"
    );
    let json = run_cli(&["--log-format", "json", "migrate"], &[("DATABASE_URL", &fresh)]).await;
    let stderr = text(&json.stderr);
    assert!(!stderr.contains("db error"), "{stderr}");
    assert!(stderr.contains("SQLSTATE 25006"), "{stderr}");
}

/// Given-up dead letters older than `--older-than` are deleted, and only
/// they: not a newer given-up row, not a dead letter nobody gave up on.
#[tokio::test]
async fn dlq_purge_deletes_only_old_given_up_rows() {
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, dead_at, given_up_at)
             VALUES ('orders', '1', 'E', '{}', 1, now() - interval '41 days', now() - interval '40 days'),
                    ('orders', '2', 'E', '{}', 1, now() - interval '2 days', now() - interval '1 day'),
                    ('orders', '3', 'E', '{}', 1, now() - interval '50 days', NULL);",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let dry = run_cli(&["dlq", "purge", "--older-than", "30d", "--dry-run"], &env).await;
    assert!(dry.status.success(), "{}", text(&dry.stderr));
    assert!(
        text(&dry.stdout).contains("would delete 1 dead letter given up on more than 30days ago"),
        "{}",
        text(&dry.stdout)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        3,
        "a dry run deletes nothing"
    );
    let purge = run_cli(&["dlq", "purge", "--older-than", "30d"], &env).await;
    assert!(purge.status.success(), "{}", text(&purge.stderr));
    assert!(
        text(&purge.stdout).contains("deleted 1 dead letter"),
        "{}",
        text(&purge.stdout)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_id IN ('2', '3')")
            .await,
        2
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 2);
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
