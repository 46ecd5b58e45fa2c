//! The writer and the inbox, through both drivers, and the schema checks.

use outbox::{Config, Event, Inbox, InboxConfig, Outbox, Processed, Record};
use serde_json::json;
use uuid::Uuid;

use crate::support::{Db, connect};

const ORDERS: &str = "CREATE TABLE orders (id bigint PRIMARY KEY, total bigint NOT NULL)";

#[tokio::test]
async fn rollback_leaves_no_order_and_no_event() {
    let mut db = Db::start().await;
    db.client.batch_execute(ORDERS).await.unwrap();
    let outbox = Outbox::default();

    let tx = db.client.transaction().await.unwrap();
    tx.execute("INSERT INTO orders VALUES (1, 100)", &[])
        .await
        .unwrap();
    outbox
        .enqueue(&tx, &Event::new("orders", "1", "OrderCreated", json!({"id": 1})))
        .await
        .unwrap();
    // Inside the transaction both rows exist: the rollback is what removes them.
    assert_eq!(
        tx.query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        1
    );
    tx.rollback().await.unwrap();

    assert_eq!(db.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn writer_killed_before_commit_leaves_nothing() {
    let db = Db::start().await;
    db.client.batch_execute(ORDERS).await.unwrap();

    // A writer session that dies mid-transaction: the server kills its
    // backend, as it would after a crash of the application process.
    let writer = connect(&db.url).await;
    writer.batch_execute("BEGIN").await.unwrap();
    writer
        .execute("INSERT INTO orders VALUES (1, 100)", &[])
        .await
        .unwrap();
    outbox::enqueue(&writer, &Event::new("orders", "1", "OrderCreated", json!({})))
        .await
        .unwrap();
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let killed: bool = db
        .client
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    assert!(
        writer.batch_execute("COMMIT").await.is_err(),
        "the killed session cannot commit"
    );

    assert_eq!(db.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn enqueue_writes_every_column_and_enqueue_all_keeps_order() {
    let mut db = Db::start().await;
    let outbox = Outbox::default();
    let own_id = Uuid::new_v4();
    let tx = db.client.transaction().await.unwrap();
    let event = Event::new("orders", "7", "OrderCreated", json!({"total": 5}))
        .with_event_id(own_id)
        .with_header("traceparent", "00-abc-def-01");
    assert_eq!(outbox.enqueue(&tx, &event).await.unwrap(), own_id);
    let batch: Vec<Event> = (0..50)
        .map(|i| Event::new("orders", "8", format!("E{i}"), json!(i)))
        .collect();
    let ids = outbox.enqueue_all(&tx, &batch).await.unwrap();
    tx.commit().await.unwrap();

    let row = db
        .client
        .query_one("SELECT * FROM outbox WHERE event_id = $1", &[&own_id])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>("aggregate_type"), "orders");
    assert_eq!(row.get::<_, String>("aggregate_id"), "7");
    assert_eq!(row.get::<_, serde_json::Value>("payload"), json!({"total": 5}));
    assert_eq!(
        row.get::<_, serde_json::Value>("headers"),
        json!({"traceparent": "00-abc-def-01"})
    );
    assert_eq!(row.get::<_, i32>("attempts"), 0);
    assert!(
        row.get::<_, Option<chrono::DateTime<chrono::Utc>>>("published_at")
            .is_none()
    );

    let stored: Vec<Uuid> = db
        .column("SELECT event_id FROM outbox WHERE aggregate_id = '8' ORDER BY id")
        .await;
    assert_eq!(stored, ids, "enqueue_all keeps the caller's order");
}

#[tokio::test]
async fn invalid_events_are_refused_before_the_database() {
    let db = Db::start().await;
    let err = outbox::enqueue(&db.client, &Event::new("", "1", "X", json!({})))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("aggregate_type is empty"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn inbox_runs_the_side_effect_once_per_event() {
    let mut db = Db::start().await;
    let inbox = Inbox::new(InboxConfig::new("consumer", "processed_events").unwrap());
    outbox::migrate_inbox(&mut db.client, inbox.config())
        .await
        .unwrap();
    db.client
        .batch_execute("CREATE TABLE shipments (order_id bigint NOT NULL)")
        .await
        .unwrap();

    let event_id = Uuid::new_v4();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let tx = db.client.transaction().await.unwrap();
        let outcome = inbox
            .process(&tx, event_id, async |tx| {
                tx.execute("INSERT INTO shipments VALUES (42)", &[])
                    .await
                    .map_err(anyhow::Error::from)
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcomes.push(outcome);
    }
    assert_eq!(
        outcomes,
        [Processed::New(1), Processed::Duplicate, Processed::Duplicate]
    );
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 1);

    // A side effect that fails rolls back the record too: the retry runs it.
    let other = Uuid::new_v4();
    let tx = db.client.transaction().await.unwrap();
    assert_eq!(inbox.record(&tx, other).await.unwrap(), Record::New);
    tx.rollback().await.unwrap();
    let tx = db.client.transaction().await.unwrap();
    assert_eq!(inbox.record(&tx, other).await.unwrap(), Record::New);
    tx.commit().await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM consumer.processed_events").await,
        2
    );
}

// With the `sqlx` feature, which the workspace build turns on (the CLI
// tests use it).
#[cfg(feature = "sqlx")]
#[tokio::test]
async fn sqlx_writer_and_inbox() {
    let db = Db::start().await;
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&db.url).await.unwrap();
    let inbox = Inbox::default();
    let mut client = connect(&db.url).await;
    outbox::migrate_inbox(&mut client, inbox.config()).await.unwrap();

    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let id = outbox::sqlx::enqueue(&mut tx, &Event::new("orders", "1", "A", json!({})))
        .await
        .unwrap();
    let ids = outbox::sqlx::enqueue_all(
        &mut tx,
        &[
            Event::new("orders", "1", "B", json!({})),
            Event::new("orders", "1", "C", json!({})),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let types: Vec<String> = db
        .client
        .query("SELECT event_type FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(types, ["A", "B", "C"]);
    assert_eq!(ids.len(), 2);

    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let first = inbox
        .process_sqlx(&mut tx, id, async |_conn| Ok::<_, outbox::Error>("shipped"))
        .await
        .unwrap();
    let second = inbox
        .process_sqlx(&mut tx, id, async |_conn| Ok::<_, outbox::Error>("shipped"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((first, second), (Processed::New("shipped"), Processed::Duplicate));

    // Rolled back through sqlx: nothing stays.
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    outbox::sqlx::enqueue(&mut tx, &Event::new("orders", "2", "D", json!({})))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 3);
}

#[tokio::test]
async fn migrate_is_idempotent_and_refuses_a_newer_schema() {
    let mut db = Db::start().await;
    let config = Config::default();
    let again = outbox::migrate(&mut db.client, &config).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.version, outbox::OUTBOX_VERSION);
    outbox::check(&db.client, &config).await.unwrap();

    let other = Config::new("app", "events").unwrap();
    let err = outbox::check(&db.client, &other).await.unwrap_err();
    assert!(
        matches!(err, outbox::Error::NotMigrated { found: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("outbox migrate"));

    db.client
        .execute(
            "INSERT INTO outbox_migrations (version, name, checksum) VALUES (99, 'future', 'x')",
            &[],
        )
        .await
        .unwrap();
    let err = outbox::migrate(&mut db.client, &config).await.unwrap_err();
    assert!(
        matches!(err, outbox::Error::SchemaTooNew { found: 99, .. }),
        "{err}"
    );
    assert!(outbox::check(&db.client, &config).await.unwrap_err().is_config());
}

/// Migration 0004 on an outbox of version 3 with old dead letters (rows
/// whose attempts reached the old limit): it marks them `dead_at` by
/// `Config::dead_after_attempts`, and leaves the others claimable.
#[tokio::test]
async fn the_dead_at_migration_marks_old_dead_letters() {
    let mut db = Db::start().await;
    // Back to version 3: what 0004 to 0008 added, undone.
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_aggregate_type_is_a_name,
                                DROP CONSTRAINT outbox_event_type_is_a_name,
                                DROP CONSTRAINT outbox_headers_are_string_tokens;
             DROP FUNCTION outbox_is_name(text), outbox_headers_ok(jsonb);
             DROP INDEX outbox_dead_idx; DROP INDEX outbox_unpublished_idx;
             ALTER TABLE outbox DROP COLUMN dead_at;
             CREATE INDEX outbox_unpublished_idx ON outbox (id) WHERE published_at IS NULL;
             ALTER TABLE outbox DROP COLUMN claimed_until, DROP COLUMN claimed_by;
             DROP TABLE outbox_replays, outbox_removed;
             ALTER TABLE outbox DROP COLUMN first_failed_at, DROP COLUMN attempt_log;
             DROP TABLE outbox_routes, outbox_route_state, outbox_rollup, outbox_audit;
             DROP INDEX outbox_by_aggregate_idx;
             DELETE FROM outbox_migrations WHERE version IN (4, 5, 6, 7, 8, 9, 10, 11);
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts)
             SELECT 'orders', g::text, 'E', '{}', g FROM generate_series(0, 6) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, published_at)
             VALUES ('orders', 'sent', 'E', '{}', 5, now());",
        )
        .await
        .unwrap();
    let config = Config::default().with_dead_after_attempts(4);
    let report = outbox::migrate(&mut db.client, &config).await.unwrap();
    assert_eq!(
        report.applied,
        [
            (4, "dead_at"),
            (5, "lease_claims"),
            (6, "replays"),
            (7, "attempt_history"),
            (8, "table_contract"),
            (9, "notify_names_the_outbox"),
            (10, "contract_inline"),
            (11, "operations")
        ]
    );
    let dead: Vec<i32> = db
        .column("SELECT attempts FROM outbox WHERE dead_at IS NOT NULL ORDER BY attempts")
        .await;
    assert_eq!(dead, [4, 5, 6], "unpublished rows with 4 attempts or more");
    let sql = outbox::sql::OutboxSql::new(&config);
    let stats = sql.stats(&db.client).await.unwrap();
    assert_eq!((stats[0].unpublished, stats[0].dead_letters), (4, 3));
}

/// Migration 0007 on an outbox of version 6 with rows, failed ones among
/// them: it adds the retry window's start and the attempt history, empty
/// (the relay's next mark of a failed row fills them).
#[tokio::test]
async fn the_attempt_history_migration_upgrades_a_version_6_outbox() {
    let mut db = Db::start().await;
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_aggregate_type_is_a_name,
                                DROP CONSTRAINT outbox_event_type_is_a_name,
                                DROP CONSTRAINT outbox_headers_are_string_tokens;
             DROP FUNCTION outbox_is_name(text), outbox_headers_ok(jsonb);
             ALTER TABLE outbox DROP COLUMN first_failed_at, DROP COLUMN attempt_log;
             DROP TABLE outbox_routes, outbox_route_state, outbox_rollup, outbox_audit;
             DROP INDEX outbox_by_aggregate_idx;
             DELETE FROM outbox_migrations WHERE version IN (7, 8, 9, 10, 11);
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error)
             SELECT 'orders', g::text, 'E', '{}', g, 'HTTP 500' FROM generate_series(0, 2) g;",
        )
        .await
        .unwrap();
    let config = Config::default();
    assert!(
        outbox::check(&db.client, &config).await.is_err(),
        "version 6 is too old"
    );
    let report = outbox::migrate(&mut db.client, &config).await.unwrap();
    assert_eq!(
        report.applied,
        [
            (7, "attempt_history"),
            (8, "table_contract"),
            (9, "notify_names_the_outbox"),
            (10, "contract_inline"),
            (11, "operations")
        ]
    );
    assert_eq!(report.version, outbox::OUTBOX_VERSION);
    let empty: Vec<i64> = db
        .column(
            "SELECT count(*) FROM outbox WHERE first_failed_at IS NULL AND attempt_log IS NULL \
              AND attempts = ANY('{0,1,2}')",
        )
        .await;
    assert_eq!(empty, [3], "old rows: no window started, no history");
    outbox::check(&db.client, &config).await.unwrap();
}

#[tokio::test]
async fn claim_uses_the_partial_index() {
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', g::text, 'E', '{}', now() FROM generate_series(1, 200000) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'orders', g::text, 'E', '{}' FROM generate_series(1, 50) g;
             ANALYZE outbox;",
        )
        .await
        .unwrap();
    let sql = outbox::sql::OutboxSql::new(&Config::default());
    // The leased claim as a relay sharing the outbox binds it: its id, the
    // partitions it holds, the partition count.
    let leased = outbox::sql::ClaimScope::Partitions(outbox::sql::Partitions {
        relay_id: uuid::Uuid::nil(),
        claimable: &[0, 1, 2],
        count: 64,
        strict: None,
    });
    // A batch of 1 over all 64 partitions takes the peeking claim.
    let every: Vec<i32> = (0..64).collect();
    let few = outbox::sql::ClaimScope::Partitions(outbox::sql::Partitions {
        relay_id: uuid::Uuid::nil(),
        claimable: &every,
        count: 64,
        strict: None,
    });
    // A deadline claim (`--claim deadline`) walks the same index: a claimed row
    // is skipped as not yet due, an expired one found due, with no scan of
    // the claimed rows; its probe for earlier claimed events of the
    // aggregate is an index probe too.
    let deadline_sql = outbox::sql::OutboxSql::with_claims(
        &Config::default(),
        outbox::sql::ClaimSpec {
            deadline: true,
            types: None,
        },
    );
    let deadline = Some(outbox::sql::DeadlineClaim {
        owner: uuid::Uuid::nil(),
        timeout_ms: 60_000.0,
    });
    let strict = outbox::sql::ClaimScope::Partitions(outbox::sql::Partitions {
        relay_id: uuid::Uuid::nil(),
        claimable: &[0, 1, 2],
        count: 64,
        strict: Some(outbox::sql::Strict {
            by_default: true,
            exceptions: &[],
        }),
    });
    let shapes = [
        (outbox::sql::ClaimScope::All, 100),
        (leased, 100),
        (few, 1),
        (strict, 100),
    ];
    for ((scope, limit), (sql, deadline)) in shapes
        .into_iter()
        .flat_map(|shape| [(shape, (&sql, None)), (shape, (&deadline_sql, deadline))])
    {
        // The walk starts at the claim floor: an index condition, not a
        // filter applied to every entry below it.
        let claim = outbox::sql::ClaimParams {
            types: &[],
            deadline,
            floor: 200_001,
            limit,
            max_bytes: 16 << 20,
            scope,
        };
        let plan = sql.explain_claim(&db.client, &claim, false).await.unwrap();
        let nodes = plan_nodes(&plan[0]["Plan"]);
        assert!(
            nodes.contains(&("Index Scan".to_owned(), "outbox_unpublished_idx".to_owned())),
            "{plan:#}"
        );
        let conds = index_conds(&plan[0]["Plan"], "outbox_unpublished_idx");
        assert!(
            !conds.is_empty() && conds.iter().all(|c| c.contains("id >=")),
            "{conds:?} {plan:#}"
        );
        // The 64-row lease table may be scanned whole; the outbox never.
        assert!(
            !nodes.contains(&("Seq Scan".to_owned(), "outbox".to_owned())),
            "{plan:#}"
        );
    }
}

/// The index conditions of every scan of `index` in a JSON plan.
fn index_conds(node: &serde_json::Value, index: &str) -> Vec<String> {
    let own = (node["Index Name"].as_str() == Some(index))
        .then(|| node["Index Cond"].as_str().unwrap_or_default().to_owned());
    let children = node["Plans"].as_array().into_iter().flatten();
    own.into_iter()
        .chain(children.flat_map(|c| index_conds(c, index)))
        .collect()
}

/// Every node of a JSON plan as (node type, index name or relation name).
fn plan_nodes(node: &serde_json::Value) -> Vec<(String, String)> {
    let kind = node["Node Type"].as_str().unwrap_or_default().to_owned();
    let target = node["Index Name"]
        .as_str()
        .or(node["Relation Name"].as_str())
        .unwrap_or_default()
        .to_owned();
    let children = node["Plans"].as_array().into_iter().flatten();
    std::iter::once((kind, target))
        .chain(children.flat_map(plan_nodes))
        .collect()
}

/// The batch session's plan pins price the claim's sort of its locked rows
/// at 10^10, past `jit_above_cost`: with JIT on, every claim was compiled
/// by LLVM (about a second each). The session turns JIT off.
#[tokio::test]
async fn claims_in_a_batch_session_are_not_jit_compiled() {
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'orders', g::text, 'E', '{}' FROM generate_series(1, 50) g;",
        )
        .await
        .unwrap();
    let client = crate::support::connect(&db.url).await;
    outbox::sql::setup_batch_session(&client, None).await.unwrap();
    let sql = outbox::sql::OutboxSql::new(&Config::default());
    let every: Vec<i32> = (0..64).collect();
    let jit = |plan: &serde_json::Value| plan[0].get("JIT").is_some();
    let explain = |limit: i64, scope| {
        let (client, sql) = (&client, &sql);
        async move {
            let claim = outbox::sql::ClaimParams {
                types: &[],
                deadline: None,
                floor: 0,
                limit,
                max_bytes: 16 << 20,
                scope,
            };
            client.batch_execute("BEGIN").await.unwrap();
            let plan = sql.explain_claim(client, &claim, true).await.unwrap();
            client.batch_execute("ROLLBACK").await.unwrap();
            plan
        }
    };
    let partitions = |strict| {
        outbox::sql::ClaimScope::Partitions(outbox::sql::Partitions {
            relay_id: uuid::Uuid::nil(),
            claimable: &every,
            count: 64,
            strict,
        })
    };
    let strict = outbox::sql::Strict {
        by_default: true,
        exceptions: &[],
    };
    let shapes = [
        (100, outbox::sql::ClaimScope::All),
        (100, partitions(None)),
        (1, partitions(None)),
        (100, partitions(Some(strict))),
    ];
    for (limit, scope) in shapes {
        let plan = explain(limit, scope).await;
        assert!(!jit(&plan), "{plan:#}");
    }
    // Where the server has JIT, the same claim with it on is compiled: the
    // check above can fail.
    let available: bool = client
        .query_one("SELECT pg_jit_available()", &[])
        .await
        .unwrap()
        .get(0);
    if available {
        client.batch_execute("SET jit = on").await.unwrap();
        let plan = explain(100, outbox::sql::ClaimScope::All).await;
        assert!(jit(&plan), "{plan:#}");
    }
}
