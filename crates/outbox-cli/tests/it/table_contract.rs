//! The table contract from the writer's side (issue 35, item 4): the psql
//! example of docs/schema.md, run by the real `psql`, has every column it
//! sets delivered to Redis; a row that bypasses the constraints is a dead
//! letter naming the column, and its neighbours are delivered.

use std::collections::HashMap;

use outbox_testkit::Redis;
use serde_json::{Value, json};

use crate::support::{Db, run_cli, text};

/// The SQL of docs/schema.md's "Writing from psql", taken from the page
/// itself so the test fails when the page drifts.
fn documented_example() -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/schema.md"))
        .expect("docs/schema.md");
    doc.split("<!-- table_contract.rs runs this example -->")
        .nth(1)
        .and_then(|rest| rest.split("```sql\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("the psql example in docs/schema.md")
        .to_owned()
}

/// Runs `sql` through the real `psql` against `url`, stopping at the
/// first error.
async fn psql(url: &str, sql: &str) {
    let path = std::env::temp_dir().join(format!("outbox-{}.sql", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, sql).unwrap();
    let out = tokio::process::Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f"])
        .arg(&path)
        .output()
        .await
        .expect("run psql");
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "psql: {}", text(&out.stderr));
}

/// `outbox relay --drain` to `sink`; returns its exit code and stderr.
async fn drain(db: &Db, sink: &str) -> (Option<i32>, String) {
    let out = run_cli(
        &["relay", "--sink", sink, "--drain"],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    (out.status.code(), text(&out.stderr))
}

/// Every entry of `stream`, its fields by name.
async fn entries(redis: &Redis, stream: &str) -> Vec<HashMap<String, String>> {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| {
            fields
                .chunks(2)
                .map(|kv| (kv[0].clone(), kv[1].clone()))
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn the_documented_psql_writer_has_every_column_delivered() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.client
        .batch_execute("CREATE TABLE orders (id bigint PRIMARY KEY, total bigint NOT NULL)")
        .await
        .unwrap();
    let example = documented_example();
    assert!(example.contains("INSERT INTO outbox"), "{example}");
    psql(&db.url, &example).await;
    assert_eq!(db.count("SELECT count(*) FROM orders").await, 1);

    let (code, stderr) = drain(&db, &redis.url()).await;
    assert_eq!(code, Some(0), "{stderr}");
    let got = entries(&redis, "outbox.event.orders").await;
    assert_eq!(got.len(), 1, "{got:?}");
    let e = &got[0];
    let id: i64 = db.count("SELECT id FROM outbox").await;
    assert_eq!(e["event_id"], "0b7e0d4c-5f55-4d77-9f7a-3c1a3c4f0c42");
    assert_eq!(e["aggregate_id"], "42");
    assert_eq!(e["event_type"], "OrderCreated");
    assert_eq!(e["outbox_id"], id.to_string());
    assert_eq!(
        serde_json::from_str::<Value>(&e["payload"]).unwrap(),
        json!({"order_id": 42, "total": 990})
    );
    assert_eq!(
        serde_json::from_str::<Value>(&e["headers"]).unwrap(),
        json!({
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tenant": "acme"
        })
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        1
    );
}

/// Rows the constraints would refuse, written with them dropped (as rows
/// written before migration 8 are): each is a dead letter whose error
/// names the column, unsent; the rows around them are delivered.
#[tokio::test]
async fn a_row_that_bypasses_the_constraints_is_a_dead_letter_naming_the_column() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_headers_are_string_tokens,
                                DROP CONSTRAINT outbox_aggregate_type_is_a_name;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
               ('orders', '1', 'OrderPlaced', '{}', '{\"traceparent\": \"x\"}'),
               ('orders', 'array', 'OrderPlaced', '{}', '[\"traceparent\"]'),
               ('orders', 'space', 'OrderPlaced', '{}', '{\"trace parent\": \"x\"}'),
               ('billing / eu', 'stream', 'Invoiced', '{}', '{}'),
               ('orders', '2', 'OrderPlaced', '{}', '{}');",
        )
        .await
        .unwrap();
    let (code, stderr) = drain(&db, &redis.url()).await;
    assert_eq!(code, Some(1), "a dead letter made: {stderr}");
    assert!(stderr.contains("the drain made 3 dead letter(s)"), "{stderr}");

    let delivered: Vec<String> = entries(&redis, "outbox.event.orders")
        .await
        .iter()
        .map(|e| e["aggregate_id"].clone())
        .collect();
    assert_eq!(delivered, ["1", "2"], "the neighbours, once each");
    assert!(
        entries(&redis, "outbox.event.billing / eu").await.is_empty(),
        "no stream named after a bad aggregate_type"
    );
    let rows = db
        .client
        .query(
            "SELECT aggregate_id, last_error FROM outbox WHERE dead_at IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let dead: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let said = |why: &str| format!("permanent: the event cannot be read: {why}; it was not sent");
    assert_eq!(
        dead,
        [
            (
                "array".to_owned(),
                said("headers: expected a JSON object of strings, got an array")
            ),
            (
                "space".to_owned(),
                said(
                    "headers: name \"trace parent\" is not an HTTP token (letters, digits and !#$%&'*+-.^_`|~)"
                )
            ),
            (
                "stream".to_owned(),
                said(
                    "aggregate_type \"billing / eu\" is not a name: expected letters, digits, '_' and '-', \
                     in segments joined by single dots (what Redis, NATS, AMQP and Kafka names all accept)"
                )
            ),
        ]
    );
}
