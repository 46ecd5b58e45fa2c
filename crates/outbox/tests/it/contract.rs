//! The table contract (issue 35): migration 8's CHECK constraints, the
//! same rules in Rust (`outbox::contract`) agreeing with them value for
//! value, the writer refusing before any SQL, and the upgrade from
//! version 6 on a table holding rows, in both layouts.

use outbox::contract::{self, samples};
use outbox::{Config, Event, Layout, Outbox, Violation};
use serde_json::{Value, json};
use tokio_postgres::error::SqlState;

use crate::support::Db;

/// An INSERT of the four required columns and `headers`.
const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) \
                      VALUES ($1, '1', $2, '{}', $3::text::jsonb)";

/// The constraint that refused `INSERT` with these values, if one did.
async fn refused_by(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
    event_type: &str,
    headers: &str,
) -> Option<String> {
    let err = client
        .execute(INSERT, &[&aggregate_type, &event_type, &headers])
        .await
        .err()?;
    let db = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a database error: {err}"));
    assert_eq!(db.code(), &SqlState::CHECK_VIOLATION, "{db}");
    Some(db.constraint().expect("the constraint's name").to_owned())
}

#[tokio::test]
async fn each_constraint_refuses_its_bad_row_by_name() {
    let db = Db::start().await;
    let c = &db.client;
    assert_eq!(
        refused_by(c, "orders", "OrderCreated", r#"{"traceparent": "00-x-01"}"#).await,
        None
    );
    for (aggregate_type, event_type, headers, constraint) in [
        ("", "E", "{}", "outbox_aggregate_type_is_a_name"),
        ("billing / eu", "E", "{}", "outbox_aggregate_type_is_a_name"),
        ("orders", "Order Created", "{}", "outbox_event_type_is_a_name"),
        (
            "orders",
            "E",
            r#"["traceparent"]"#,
            "outbox_headers_are_string_tokens",
        ),
        (
            "orders",
            "E",
            r#"{"trace parent": "x"}"#,
            "outbox_headers_are_string_tokens",
        ),
        ("orders", "E", r#"{"n": 1}"#, "outbox_headers_are_string_tokens"),
    ] {
        assert_eq!(
            refused_by(c, aggregate_type, event_type, headers)
                .await
                .as_deref(),
            Some(constraint),
            "{aggregate_type:?} {event_type:?} {headers}"
        );
    }
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1);
}

/// Published rows are exempt, as dead letters are (migration 10): a
/// claim marks its rows published, so the relay's UPDATE checks nothing,
/// while a row turned back into an unpublished one is checked again.
#[tokio::test]
async fn published_rows_are_exempt_and_checked_again_once_unpublished() {
    let db = Db::start().await;
    let c = &db.client;
    c.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, published_at) \
         VALUES ('billing / eu', '1', 'E', '{}', '{\"n\": 1}', now())",
        &[],
    )
    .await
    .expect("a published row is not checked");
    let err = c
        .execute("UPDATE outbox SET published_at = NULL", &[])
        .await
        .unwrap_err();
    let db_error = err.as_db_error().expect("a database error");
    assert_eq!(db_error.code(), &SqlState::CHECK_VIOLATION);
    assert_eq!(db_error.constraint(), Some("outbox_aggregate_type_is_a_name"));
}

/// The SQL functions (migration 8's constraints called them) and
/// `outbox::contract` answer the same for every sample, and so do the
/// constraints themselves (written out since migration 10).
#[tokio::test]
async fn the_sql_and_rust_rules_agree() {
    let db = Db::start().await;
    let c = &db.client;
    let long = "a".repeat(contract::MAX_NAME_CHARS);
    let too_long = format!("{long}a");
    let names = samples::NAMES
        .iter()
        .map(|&(v, ok)| (v, ok))
        .chain([(long.as_str(), true), (too_long.as_str(), false)]);
    for (value, ok) in names {
        let sql: bool = c
            .query_one("SELECT outbox_is_name($1)", &[&value])
            .await
            .unwrap()
            .get(0);
        assert_eq!((sql, contract::is_name(value)), (ok, ok), "{value:?}");
        let aggregate = refused_by(c, value, "E", "{}").await;
        let event = refused_by(c, "orders", value, "{}").await;
        assert_eq!((aggregate.is_none(), event.is_none()), (ok, ok), "{value:?}");
    }
    for &(text, ok) in samples::HEADERS {
        let sql: bool = c
            .query_one("SELECT outbox_headers_ok($1::text::jsonb)", &[&text])
            .await
            .unwrap()
            .get(0);
        let headers: Value = serde_json::from_str(text).unwrap();
        assert_eq!(
            (sql, contract::check_headers(&headers).is_ok()),
            (ok, ok),
            "{text}"
        );
        assert_eq!(refused_by(c, "orders", "E", text).await.is_none(), ok, "{text}");
    }
}

/// The writer's error is typed and comes before any SQL: inside a
/// transaction that already failed, a statement would answer "current
/// transaction is aborted" instead.
#[tokio::test]
async fn the_writer_refuses_before_any_sql() {
    let mut db = Db::start().await;
    let outbox = Outbox::default();
    let tx = db.client.transaction().await.unwrap();
    assert!(tx.execute("SELECT 1/0", &[]).await.is_err());
    let bad_header = Event::new("orders", "1", "OrderCreated", json!({})).with_header("trace parent", "x");
    let err = outbox.enqueue(&tx, &bad_header).await.unwrap_err();
    assert!(
        matches!(&err, outbox::Error::Contract(Violation::HeaderName { name }) if name == "trace parent"),
        "{err}"
    );
    let number = Event::new("orders", "1", "OrderCreated", json!({})).with_header("n", 1);
    let err = outbox.enqueue_all(&tx, &[number]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid event: headers: \"n\" is a number, expected a string"
    );
    let bad_type = Event::new("billing / eu", "1", "Invoiced", json!({}));
    let err = outbox.emit(&tx, &bad_type).await.unwrap_err();
    assert!(
        matches!(
            &err,
            outbox::Error::Contract(Violation::NotAName {
                column: "aggregate_type",
                ..
            })
        ),
        "{err}"
    );
    tx.rollback().await.unwrap();
}

/// Back to version 6 (what migration 8 added, undone), with rows that
/// break the contract, published and not, and a replay job whose target
/// kept a token: the upgrade dead-letters the unpublished ones naming the
/// column, leaves the published ones, masks the job's target, and refuses
/// new bad rows.
#[tokio::test]
async fn migrating_from_6_dead_letters_what_breaks_the_contract() {
    let mut db = Db::start().await;
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_aggregate_type_is_a_name,
                                DROP CONSTRAINT outbox_event_type_is_a_name,
                                DROP CONSTRAINT outbox_headers_are_string_tokens;
             DROP FUNCTION outbox_is_name(text), outbox_headers_ok(jsonb);
             DROP TABLE outbox_routes, outbox_route_state, outbox_rollup, outbox_audit;
             DROP INDEX outbox_by_aggregate_idx;
             DELETE FROM outbox_migrations WHERE version IN (8, 9, 10, 11);
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
                 ('orders', 'good', 'OrderCreated', '{}', '{\"traceparent\": \"x\"}'),
                 ('billing / eu', 'space', 'Invoiced', '{}', '{}'),
                 ('orders', 'array', 'OrderCreated', '{}', '[\"traceparent\"]');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, published_at)
                 VALUES ('', 'sent', 'E', '{}', '[]', now());
             INSERT INTO outbox_replays (target, format, rate, upto_id)
                 VALUES ('https://example.com/hook?token=abc123&v=2', 'native', 100, 1);",
        )
        .await
        .unwrap();
    let report = outbox::migrate(&mut db.client, &Config::default()).await.unwrap();
    assert_eq!(
        report.applied,
        [
            (8, "table_contract"),
            (9, "notify_names_the_outbox"),
            (10, "contract_inline"),
            (11, "operations")
        ]
    );
    let rows = db
        .client
        .query(
            "SELECT aggregate_id, dead_at IS NOT NULL, published_at IS NOT NULL, last_error FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let rows: Vec<(String, bool, bool, Option<String>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let error = |what: &str| {
        Some(format!(
            "permanent: the event breaks the table contract (migration 8): {what}; it was not sent"
        ))
    };
    assert_eq!(
        rows,
        [
            ("good".to_owned(), false, false, None),
            (
                "space".to_owned(),
                true,
                false,
                error("aggregate_type \"billing / eu\" is not a name")
            ),
            (
                "array".to_owned(),
                true,
                false,
                error("headers: expected a JSON object of strings whose names are HTTP tokens")
            ),
            ("sent".to_owned(), false, true, None),
        ]
    );
    let target: Vec<String> = db.column("SELECT target FROM outbox_replays").await;
    assert_eq!(target, ["https://example.com/hook?token=***&v=***"]);
    // A dead letter that breaks the contract can be given up, not
    // requeued until fixed.
    let c = &db.client;
    c.execute(
        "UPDATE outbox SET given_up_at = now() WHERE aggregate_id = 'array'",
        &[],
    )
    .await
    .unwrap();
    let err = c
        .execute(
            "UPDATE outbox SET dead_at = NULL WHERE aggregate_id = 'array'",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.as_db_error().and_then(|e| e.constraint()),
        Some("outbox_headers_are_string_tokens")
    );
    c.execute(
        "UPDATE outbox SET headers = '{}', dead_at = NULL WHERE aggregate_id = 'array'",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        refused_by(c, "orders", "E", "[]").await.as_deref(),
        Some("outbox_headers_are_string_tokens")
    );
}

/// The daily layout: the constraints are on the partitioned table, so on
/// its default partition and on every day made later.
#[tokio::test]
async fn the_partitioned_outbox_has_the_constraints() {
    let mut db = Db::start().await;
    let mut config = Config::new("public", "daily").unwrap();
    config.layout = Layout::Daily;
    let report = outbox::migrate(&mut db.client, &config).await.unwrap();
    assert_eq!(report.version, outbox::OUTBOX_VERSION);
    outbox::partitions::maintain(&mut db.client, &config, None, 1)
        .await
        .unwrap();
    // Today's partition, and the default one (a day long past).
    for created_at in ["now", "2001-01-01 00:00:00+00"] {
        let err = db
            .client
            .execute(
                "INSERT INTO daily (aggregate_type, aggregate_id, event_type, payload, headers, created_at) \
                 VALUES ('orders', '1', 'E', '{}', '[\"x\"]', $1::text::timestamptz)",
                &[&created_at],
            )
            .await
            .unwrap_err();
        assert_eq!(
            err.as_db_error().and_then(|e| e.constraint()),
            Some("outbox_headers_are_string_tokens"),
            "{created_at}"
        );
    }
    let partitions: i64 = db
        .count(
            "SELECT count(*) FROM pg_constraint c JOIN pg_inherits i ON i.inhrelid = c.conrelid \
             WHERE i.inhparent = 'daily'::regclass AND c.conname = 'outbox_headers_are_string_tokens'",
        )
        .await;
    assert_eq!(partitions, 3, "the default partition, today and tomorrow");
}
