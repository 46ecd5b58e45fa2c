//! Least privilege (issue 35): a role given exactly what `outbox migrate
//! --grant ROLE --as KIND` grants runs each command; each of the relay's
//! grants taken away alone is a configuration error (exit 2) naming it and
//! the fix; a lease tick refused at runtime makes the relay unready and
//! a `--drain` fail (exit 1) instead of waiting for ever; `relay --check`
//! tells a missing grant (2) from a sink on a closed port (1).
//!
//! The outbox lives in schema `app`, not `public`, so the schema's USAGE
//! is the grant's to give (PUBLIC has it on `public`); PUBLIC's EXECUTE on
//! the tick function is revoked for the same reason.

use std::process::Output;

use outbox::{Config, Event, InboxConfig, Outbox};
use outbox_testkit::{PgSettings, Postgres, Receiver, Redis, Respond, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::metrics::{http_addr, ready};
use crate::support::{LONG, connect, outbox_cmd, read_stream, run_cli, text, wait_until};

const SCHEMA: &str = "app";

/// A fresh database with the outbox in schema `app`, and a login role
/// with no privilege of its own.
struct Setup {
    _pg: Postgres,
    /// The superuser's URL.
    url: String,
    client: Client,
    role: String,
    role_url: String,
}

impl Setup {
    async fn start() -> Setup {
        Setup::on(Postgres::start().await.expect("start postgres")).await
    }

    async fn on(pg: Postgres) -> Setup {
        let url = pg.fresh_database().await.expect("create database");
        let mut client = connect(&url).await;
        outbox::migrate(&mut client, &config()).await.expect("migrate");
        client
            .batch_execute(
                "REVOKE EXECUTE ON FUNCTION app.outbox_relay_tick(uuid, text, interval, int4, int4[], \
                 timestamptz[]) FROM PUBLIC",
            )
            .await
            .unwrap();
        let role = format!("r_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        client
            .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
            .await
            .unwrap();
        let role_url = url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
        Setup {
            _pg: pg,
            url,
            client,
            role,
            role_url,
        }
    }

    /// The superuser's environment.
    fn owner(&self) -> [(&str, &str); 2] {
        [("DATABASE_URL", &self.url), ("OUTBOX_SCHEMA", SCHEMA)]
    }

    /// The role's environment.
    fn as_role(&self) -> [(&str, &str); 2] {
        [("DATABASE_URL", &self.role_url), ("OUTBOX_SCHEMA", SCHEMA)]
    }

    /// `outbox migrate --grant <role> --as <kinds>` as the superuser.
    async fn grant(&self, kinds: &str) -> Output {
        let out = run_cli(&["migrate", "--grant", &self.role, "--as", kinds], &self.owner()).await;
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        out
    }

    async fn sql(&self, statement: &str) {
        self.client.batch_execute(statement).await.expect(statement);
    }

    async fn may(&self, object: &str, privilege: &str) -> bool {
        self.client
            .query_one(
                "SELECT has_table_privilege($1, $2, $3)",
                &[&self.role, &object, &privilege],
            )
            .await
            .unwrap()
            .get(0)
    }

    async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    /// `n` events of `n` aggregates, as the superuser.
    async fn insert(&mut self, n: usize) {
        let events: Vec<Event> = (0..n)
            .map(|i| Event::new("orders", format!("order-{i}"), "Placed", json!({ "i": i })))
            .collect();
        let tx = self.client.transaction().await.unwrap();
        Outbox::new(config()).enqueue_all(&tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }

    async fn unpublished(&self) -> i64 {
        self.count("SELECT count(*) FROM app.outbox WHERE published_at IS NULL")
            .await
    }
}

fn config() -> Config {
    Config::new(SCHEMA, "outbox").unwrap()
}

/// `outbox relay --drain` as the role, to `sink`, with `extra` flags.
async fn drain_as_role(setup: &Setup, sink: &str, extra: &[&str]) -> Output {
    let mut args = vec!["relay", "--sink", sink, "--drain"];
    args.extend_from_slice(extra);
    run_cli(&args, &setup.as_role()).await
}

#[tokio::test]
async fn dry_run_changes_nothing_and_grant_is_idempotent() {
    let setup = Setup::start().await;
    let out = run_cli(
        &["migrate", "--grant", &setup.role, "--as", "relay", "--dry-run"],
        &setup.owner(),
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    let role = &setup.role;
    for line in [
        format!("GRANT USAGE ON SCHEMA \"app\" TO \"{role}\";"),
        format!("GRANT SELECT ON TABLE \"app\".\"outbox_migrations\" TO \"{role}\";"),
        format!("GRANT SELECT, UPDATE ON TABLE \"app\".\"outbox\" TO \"{role}\";"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"app\".\"outbox_relays\" TO \"{role}\";"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"app\".\"outbox_leases\" TO \"{role}\";"),
        format!(
            "GRANT EXECUTE ON FUNCTION \"app\".\"outbox_relay_tick\"(uuid, text, interval, int4, int4[], \
             timestamptz[]) TO \"{role}\";"
        ),
        format!("GRANT SELECT ON TABLE \"app\".\"outbox_routes\" TO \"{role}\";"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"app\".\"outbox_route_state\" TO \"{role}\";"
        ),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"app\".\"outbox_rollup\" TO \"{role}\";"),
    ] {
        assert!(printed.contains(&line), "{line} in {printed}");
    }
    assert_eq!(printed.matches(';').count(), 9, "{printed}");
    assert!(
        !setup.may("app.outbox", "UPDATE").await,
        "a dry run grants nothing"
    );
    assert!(!setup.may("app.outbox_relays", "INSERT").await);

    let acl = format!(
        "SELECT count(*) FROM pg_class AS c, aclexplode(c.relacl) AS a \
         WHERE c.relnamespace = 'app'::regnamespace AND a.grantee = '{}'::regrole",
        setup.role
    );
    let acl = acl.as_str();
    assert_eq!(setup.count(acl).await, 0);
    let first = setup.grant("relay").await;
    assert!(setup.may("app.outbox", "UPDATE").await);
    assert!(!setup.may("app.outbox", "DELETE").await, "least privilege");
    let granted = setup.count(acl).await;
    // SELECT on the ledger, SELECT and UPDATE on the outbox, four on each
    // lease table, SELECT on the routes, four on route state and rollup.
    assert_eq!(granted, 20);
    let second = setup.grant("relay").await;
    assert_eq!(setup.count(acl).await, granted, "twice is once");
    assert_eq!(text(&first.stdout), text(&second.stdout));

    // A name that is no plain identifier is refused before anything runs.
    let bad = run_cli(
        &["migrate", "--grant", "app; DROP TABLE x", "--as", "relay"],
        &setup.owner(),
    )
    .await;
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
    let unknown = run_cli(
        &["migrate", "--grant", &setup.role, "--as", "relays"],
        &setup.owner(),
    )
    .await;
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        text(&unknown.stderr).contains("relay-wal"),
        "{}",
        text(&unknown.stderr)
    );
}

#[tokio::test]
async fn a_role_with_exactly_the_grants_runs_the_relay_in_both_claim_modes() {
    let mut setup = Setup::start().await;
    let redis = Redis::start().await.unwrap();
    setup.grant("relay").await;
    setup.insert(5).await;
    let out = drain_as_role(&setup, &redis.url(), &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(setup.unpublished().await, 0);
    setup.insert(5).await;
    let out = drain_as_role(&setup, &redis.url(), &["--claim", "deadline"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(setup.unpublished().await, 0);
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 10);
}

#[tokio::test]
async fn cleanup_and_retention_run_with_their_grants() {
    let mut setup = Setup::start().await;
    let redis = Redis::start().await.unwrap();
    setup.grant("relay").await;
    setup.insert(3).await;
    // `--retention` on a plain outbox is cleanup's work too.
    let refused = drain_as_role(&setup, &redis.url(), &["--retention", "1h"]).await;
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    let stderr = text(&refused.stderr);
    assert!(stderr.contains("DELETE on table app.outbox"), "{stderr}");
    assert!(stderr.contains("--as cleanup --schema app"), "{stderr}");
    setup.grant("cleanup").await;
    let out = drain_as_role(&setup, &redis.url(), &["--retention", "1h"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(setup.unpublished().await, 0);

    let out = run_cli(&["cleanup", "--older-than", "1ms"], &setup.as_role()).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(setup.count("SELECT count(*) FROM app.outbox").await, 0);
    assert_eq!(
        setup
            .count("SELECT coalesce(sum(removed), 0)::int8 FROM app.outbox_removed")
            .await,
        3
    );
}

#[tokio::test]
async fn the_wal_source_runs_with_its_grants() {
    let pg = Postgres::start_with(PgSettings::default().set("wal_level", "logical"))
        .await
        .expect("start postgres");
    let mut setup = Setup::on(pg).await;
    outbox::wal::migrate_wal(&setup.client, &config())
        .await
        .expect("migrate --wal");
    let redis = Redis::start().await.unwrap();
    let refused = drain_as_role(&setup, &redis.url(), &["--source", "wal"]).await;
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("the REPLICATION attribute"),
        "{}",
        text(&refused.stderr)
    );
    setup.grant("relay-wal").await;
    setup.insert(4).await;
    let out = drain_as_role(&setup, &redis.url(), &["--source", "wal"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 4);
    // --wal-cleanup delete: the delivered rows are gone.
    assert_eq!(setup.count("SELECT count(*) FROM app.outbox").await, 0);
}

#[tokio::test]
async fn consume_and_admin_run_with_their_grants() {
    let mut setup = Setup::start().await;
    let redis = Redis::start().await.unwrap();
    // The relay publishes as the owner; the role only consumes.
    setup.insert(6).await;
    let out = run_cli(&["relay", "--sink", &redis.url(), "--drain"], &setup.owner()).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    outbox::migrate_inbox(&mut setup.client, &InboxConfig::default())
        .await
        .unwrap();
    // The side effect's table is the application's to grant.
    let role = setup.role.clone();
    setup
        .sql(&format!(
            "CREATE TABLE shipments (id bigserial, event_id uuid); \
             GRANT INSERT ON shipments TO {role}; GRANT USAGE ON SEQUENCE shipments_id_seq TO {role}"
        ))
        .await;
    let consume = |setup: &Setup| {
        let mut cmd = outbox_cmd();
        cmd.args([
            "consume",
            "--from",
            &redis.url(),
            "--stream",
            "outbox.event.orders",
        ])
        .args(["--group", "shipping", "--consumer", "a"])
        .args(["--apply", "INSERT INTO shipments (event_id) VALUES ($1)"])
        .envs(setup.as_role());
        cmd
    };
    let refused = tokio::time::timeout(LONG, consume(&setup).output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("INSERT on table public.processed_events"),
        "{}",
        text(&refused.stderr)
    );
    setup.grant("consume").await;
    let mut worker = Spawned::spawn_notified(consume(&setup)).unwrap();
    worker.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("6 shipments", LONG, || async {
        setup.count("SELECT count(*) FROM shipments").await == 6
    })
    .await;
    assert_eq!(setup.count("SELECT count(*) FROM processed_events").await, 6);
    worker.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_eq!(worker.wait(LONG).await.unwrap().code(), Some(0));

    // The console: read-only without a token, with its actions with one.
    for (kind, token) in [
        ("admin-read", None),
        ("admin", Some("test-admin-token-0123456789")),
    ] {
        let port = outbox_testkit::free_port();
        let listen = format!("127.0.0.1:{port}");
        let admin = |token: Option<&str>| {
            let mut cmd = outbox_cmd();
            cmd.args(["admin", "--listen", &listen]).envs(setup.as_role());
            if let Some(token) = token {
                cmd.env("OUTBOX_ADMIN_TOKEN", token);
            }
            cmd
        };
        let refused = tokio::time::timeout(LONG, admin(token).output())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            refused.status.code(),
            Some(2),
            "{kind}: {}",
            text(&refused.stderr)
        );
        assert!(
            text(&refused.stderr).contains(&format!("--as {kind} --schema app")),
            "{}",
            text(&refused.stderr)
        );
        setup.grant(kind).await;
        let console = Spawned::spawn_notified(admin(token)).unwrap();
        console.wait_for_notification("READY=1", LONG).await.unwrap();
        let mut request = reqwest::Client::new().get(format!("http://{listen}/"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let page = request.send().await.unwrap();
        assert_eq!(page.status().as_u16(), 200, "{kind}");
        let h = reqwest::Client::new();
        let with_token = |r: reqwest::RequestBuilder| match token {
            Some(token) => r.bearer_auth(token),
            None => r,
        };
        for path in ["/routes", "/audit", "/replays", "/api/routes", "/api/audit"] {
            let page = with_token(h.get(format!("http://{listen}{path}")))
                .send()
                .await
                .unwrap();
            assert_eq!(page.status().as_u16(), 200, "{kind} {path}");
        }
        if token.is_some() {
            // Changes and their audit rows, under the role's grants.
            for (path, body) in [
                ("/api/routes/pause", serde_json::json!({"route": "orders"})),
                ("/api/routes/resume", serde_json::json!({"route": "orders"})),
                ("/api/dead/purge", serde_json::json!({"older_than": 0})),
            ] {
                let done = with_token(h.post(format!("http://{listen}{path}")).json(&body))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(
                    done.status().as_u16(),
                    200,
                    "{kind} {path}: {}",
                    done.text().await.unwrap()
                );
            }
            // A replay job started from the console runs under them too:
            // created, counted against what cleanup removed, saved done.
            let receiver = outbox_testkit::Receiver::start(outbox_testkit::Respond::Ok)
                .await
                .unwrap();
            let body = serde_json::json!({"to": receiver.url(), "rate": "unlimited"});
            let started = with_token(h.post(format!("http://{listen}/api/replays")).json(&body))
                .send()
                .await
                .unwrap();
            assert_eq!(
                started.status().as_u16(),
                200,
                "{kind} replay: {}",
                started.text().await.unwrap()
            );
            wait_until("the console's replay job done", LONG, || async {
                setup
                    .count("SELECT count(*) FROM app.outbox_replays WHERE state = 'done'")
                    .await
                    == 1
            })
            .await;
            let published = setup
                .count("SELECT count(*) FROM app.outbox WHERE published_at IS NOT NULL")
                .await;
            assert_eq!(receiver.count(), usize::try_from(published).unwrap());
            assert_eq!(setup.count("SELECT count(*) FROM app.outbox_audit").await, 4);
        }
        drop(console);
    }
    let out = run_cli(&["stats"], &setup.as_role()).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = run_cli(&["relays"], &setup.as_role()).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// Every grant of the relay's list, revoked alone: exit 2 before anything
/// runs, naming that privilege and the fix.
#[tokio::test]
async fn each_missing_grant_of_the_relay_is_named_with_its_fix() {
    let setup = Setup::start().await;
    setup.grant("relay").await;
    let role = &setup.role;
    let tick = "FUNCTION app.outbox_relay_tick(uuid, text, interval, int4, int4[], timestamptz[])";
    let mut cases: Vec<(String, String)> = vec![
        ("USAGE ON SCHEMA app".to_owned(), "USAGE on schema app".to_owned()),
        (
            format!("EXECUTE ON {tick}"),
            "EXECUTE on function app.outbox_relay_tick".to_owned(),
        ),
        (
            "SELECT ON app.outbox_migrations".to_owned(),
            "SELECT on table app.outbox_migrations".to_owned(),
        ),
        (
            "SELECT ON app.outbox".to_owned(),
            "SELECT on table app.outbox".to_owned(),
        ),
        (
            "UPDATE ON app.outbox".to_owned(),
            "UPDATE on table app.outbox".to_owned(),
        ),
    ];
    for table in ["outbox_relays", "outbox_leases"] {
        for privilege in ["SELECT", "INSERT", "UPDATE", "DELETE"] {
            cases.push((
                format!("{privilege} ON app.{table}"),
                format!("{privilege} on table app.{table}"),
            ));
        }
    }
    assert_eq!(cases.len(), 13);
    for (grant, named) in &cases {
        setup.sql(&format!("REVOKE {grant} FROM {role}")).await;
        let out = run_cli(&["relay", "--sink", "redis://127.0.0.1:1"], &setup.as_role()).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "without {grant}: {stderr}");
        assert!(
            stderr.contains(&format!("error: role {role} lacks {named}\n")),
            "without {grant}: {stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "fix: outbox migrate --grant {role} --as relay --schema app (run as the table's owner)"
            )),
            "{stderr}"
        );
        setup.sql(&format!("GRANT {grant} TO {role}")).await;
    }
    // With everything back, `--check` passes the privileges.
    let out = run_cli(
        &["relay", "--sink", "redis://127.0.0.1:1", "--check"],
        &setup.as_role(),
    )
    .await;
    assert!(
        text(&out.stdout).contains("ok    privileges of"),
        "{}",
        text(&out.stdout)
    );
}

/// The lease tick refused after the relay was ready: `/readyz` 503 naming
/// why, one ERROR line; a `--drain` relay then fails (exit 1) rather than
/// waiting for ever.
#[tokio::test]
async fn a_lease_tick_refused_at_runtime_makes_the_relay_unready_and_a_drain_fail() {
    let mut setup = Setup::start().await;
    let redis = Redis::start().await.unwrap();
    setup.grant("relay").await;
    let addr = http_addr();
    let mut cmd = outbox_cmd();
    cmd.args([
        "relay",
        "--sink",
        &redis.url(),
        "--lease-timeout",
        "1s",
        "--http",
        &addr,
    ])
    .envs(setup.as_role());
    let relay = Spawned::spawn_notified(cmd).unwrap();
    relay.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("/readyz 200", LONG, || async { ready(&addr).await.0 == 200 }).await;
    setup
        .sql(&format!("REVOKE INSERT ON app.outbox_relays FROM {}", setup.role))
        .await;
    wait_until("/readyz 503", LONG, || async { ready(&addr).await.0 == 503 }).await;
    let (_, body) = ready(&addr).await;
    let leases = body["checks"]["leases"].as_str().unwrap().to_owned();
    assert!(
        leases.contains("permission denied for table outbox_relays"),
        "{body}"
    );
    assert_eq!(
        relay.count_lines("lease tick failed: the relay"),
        1,
        "{:#?}",
        relay.lines()
    );
    drop(relay);

    // A drain busy with a slow sink when its tick is refused.
    setup
        .sql(&format!("GRANT INSERT ON app.outbox_relays TO {}", setup.role))
        .await;
    setup.insert(1000).await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    receiver.set_delay(Some(std::time::Duration::from_millis(200)));
    let mut cmd = outbox_cmd();
    cmd.args(["relay", "--sink", &receiver.url(), "--drain", "--batch-size", "1"])
        .args(["--lease-timeout", "1s"])
        .envs(setup.as_role());
    let mut drain = Spawned::spawn_notified(cmd).unwrap();
    receiver.wait_for_count(1, LONG).await.unwrap();
    setup
        .sql(&format!("REVOKE INSERT ON app.outbox_relays FROM {}", setup.role))
        .await;
    let status = drain.wait(LONG).await.unwrap();
    let lines = drain.lines().join("\n");
    assert_eq!(status.code(), Some(1), "{lines}");
    assert!(
        lines.contains("error: running the relay")
            && lines.contains("the drain cannot finish: the lease tick failed"),
        "{lines}"
    );
    assert!(setup.unpublished().await > 0, "it stopped before the end");
}

#[tokio::test]
async fn relay_check_tells_configuration_from_an_unreachable_sink() {
    let setup = Setup::start().await;
    let redis = Redis::start().await.unwrap();
    let check = |sink: String| {
        let env = setup.as_role();
        async move { run_cli(&["relay", "--sink", &sink, "--check"], &env).await }
    };
    let out = check(redis.url()).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("FAIL  privileges of"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "      fix: outbox migrate --grant {} --as relay",
            setup.role
        )),
        "{stdout}"
    );
    assert!(stdout.contains("ok    sink --sink"), "{stdout}");

    setup.grant("relay").await;
    let out = check(redis.url()).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert_eq!(stdout.matches("ok    ").count(), 4, "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");

    let closed = format!("redis://127.0.0.1:{}", outbox_testkit::free_port());
    let out = check(closed.clone()).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(&format!("FAIL  sink --sink {closed}")),
        "{stdout}"
    );
    assert_eq!(stdout.matches("FAIL").count(), 1, "{stdout}");
    assert_eq!(
        setup.count("SELECT count(*) FROM app.outbox_relays").await,
        0,
        "claimed nothing"
    );
}

/// Partition maintenance is DDL: the role gets membership in the table
/// owner's role, and CREATE on the schema, and then creates days ahead.
#[tokio::test]
async fn partition_maintenance_runs_with_its_grants() {
    let setup = Setup::start().await;
    let daily = [
        ("DATABASE_URL", setup.url.as_str()),
        ("OUTBOX_SCHEMA", SCHEMA),
        ("OUTBOX_TABLE", "daily"),
    ];
    let out = run_cli(
        &["migrate", "--partition-by", "day", "--channel", "daily_new"],
        &daily,
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let as_role = [
        ("DATABASE_URL", setup.role_url.as_str()),
        ("OUTBOX_SCHEMA", SCHEMA),
        ("OUTBOX_TABLE", "daily"),
    ];
    let maintain = ["partitions", "maintain", "--premake", "5"];
    let refused = run_cli(&maintain, &as_role).await;
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    let stderr = text(&refused.stderr);
    assert!(stderr.contains("lacks USAGE, CREATE on schema app\n"), "{stderr}");
    // With the schema open, the ownership is what is missing.
    setup
        .sql(&format!("GRANT USAGE, CREATE ON SCHEMA app TO {}", setup.role))
        .await;
    let refused = run_cli(&maintain, &as_role).await;
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("; ownership of table app.daily (membership in its owner's role);"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "--grant {} --as partitions --schema app --table daily",
            setup.role
        )),
        "{stderr}"
    );
    let grant = run_cli(&["migrate", "--grant", &setup.role, "--as", "partitions"], &daily).await;
    assert_eq!(grant.status.code(), Some(0), "{}", text(&grant.stderr));
    assert!(text(&grant.stdout).contains(&format!("GRANT postgres TO \"{}\";", setup.role)));
    let partitions = "SELECT count(*) FROM pg_inherits WHERE inhparent = 'app.daily'::regclass";
    let before = setup.count(partitions).await;
    let out = run_cli(&maintain, &as_role).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(setup.count(partitions).await, before + 2, "days 4 and 5 ahead");
}
