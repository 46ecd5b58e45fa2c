//! The daily-partitioned layout: writer and relay unchanged, past days
//! dropped only when fully published, a drop racing a late insert, and
//! retention run by the relay.

use chrono::{Days, NaiveDate, Utc};
use outbox::{Config, Event, Outbox};
use outbox_testkit::{Redis, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::support::{
    Db, LONG, connect, outbox_cmd, read_stream, run_cli, start_relay, stop_relay, text, wait_until,
};

/// A fresh database migrated with `--partition-by day` through the CLI.
async fn partitioned(db: &Db) -> (String, Client) {
    let url = db.pg.fresh_database().await.unwrap();
    let out = run_cli(&["migrate", "--partition-by", "day"], &[("DATABASE_URL", &url)]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.matches("created partition").count(), 4, "{stdout}");
    (url.clone(), connect(&url).await)
}

fn day_name(day: NaiveDate) -> String {
    format!("outbox_p{}", day.format("%Y%m%d"))
}

/// Creates the partition of a past `day` and fills it: `published` rows
/// delivered, `pending` waiting, `dead` dead letters.
async fn past_day(client: &Client, day: NaiveDate, published: i64, pending: i64, dead: i64) {
    let next = day + Days::new(1);
    client
        .batch_execute(&format!(
            "CREATE TABLE {name} PARTITION OF outbox FOR VALUES FROM ('{day} 00:00+00') TO ('{next} 00:00+00');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT 'orders', 'old-' || g, 'E', '{{}}', '{day} 12:00+00', '{day} 12:01+00' FROM generate_series(1, {published}) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT 'orders', 'pending-' || g, 'E', '{{}}', '{day} 12:00+00' FROM generate_series(1, {pending}) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, attempts, last_error, dead_at)
             SELECT 'orders', 'dead-' || g, 'E', '{{}}', '{day} 12:00+00', 5, 'HTTP 422', '{day} 12:01+00' FROM generate_series(1, {dead}) g;",
            name = day_name(day)
        ))
        .await
        .unwrap();
}

async fn exists(client: &Client, name: &str) -> bool {
    client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
        .await
        .unwrap()
        .get(0)
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_partitioned_outbox_delivers_unchanged_and_keeps_days_with_unpublished_rows() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let (url, mut client) = partitioned(&db).await;
    let kind: i8 = client
        .query_one("SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(kind as u8, b'p');

    // The writer and the relay work as on the plain table.
    let events: Vec<Event> = (0..100)
        .map(|i| Event::new("orders", format!("o{}", i % 10), "E", json!({"i": i})))
        .collect();
    let tx = client.transaction().await.unwrap();
    Outbox::new(Config::default())
        .enqueue_all(&tx, &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let out = run_cli(
        &["relay", "--drain", "--sink", &redis.url()],
        &[("DATABASE_URL", &url)],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(read_stream(&redis.url(), "outbox.event.orders").await.len(), 100);
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox WHERE published_at IS NULL").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox_default").await,
        0,
        "today has a partition"
    );

    let today = Utc::now().date_naive();
    let (gone, pending, dead) = (today - Days::new(10), today - Days::new(9), today - Days::new(8));
    past_day(&client, gone, 50, 0, 0).await;
    past_day(&client, pending, 10, 1, 0).await;
    past_day(&client, dead, 5, 0, 1).await;

    let out = run_cli(
        &["partitions", "maintain", "--keep", "7d"],
        &[("DATABASE_URL", &url)],
    )
    .await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "dropped partition {} (50 published rows)",
            day_name(gone)
        )),
        "{stdout}"
    );
    for kept in [pending, dead] {
        assert!(
            stderr.contains(&format!("kept partition {}: 1 unpublished rows", day_name(kept))),
            "{stderr}"
        );
        assert!(exists(&client, &day_name(kept)).await);
    }
    assert!(!exists(&client, &day_name(gone)).await);
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox WHERE published_at IS NULL").await,
        2,
        "the pending row and the dead letter are still there"
    );
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, 100 + 11 + 6);
}

#[tokio::test]
async fn a_drop_racing_a_late_insert_into_that_day_loses_nothing() {
    let db = Db::start().await;
    let (url, mut client) = partitioned(&db).await;
    let day = Utc::now().date_naive() - Days::new(10);
    past_day(&client, day, 20, 0, 0).await;

    // A late writer inserts into that day and has not committed yet.
    let late = client.transaction().await.unwrap();
    late.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('orders', 'late', 'E', '{}', $1::text::timestamptz)",
        &[&format!("{day} 23:00+00")],
    )
    .await
    .unwrap();

    let mut maintain = outbox_cmd();
    maintain
        .args(["partitions", "maintain", "--keep", "7d"])
        .env("DATABASE_URL", &url);
    let mut maintain = Spawned::spawn(maintain).unwrap();
    let observer = connect(&url).await;
    wait_until("maintenance waits for the outbox lock", LONG, || async {
        count(
            &observer,
            "SELECT count(*) FROM pg_locks WHERE relation = 'outbox'::regclass AND NOT granted",
        )
        .await
            > 0
    })
    .await;
    late.commit().await.unwrap();

    let status = maintain.wait(LONG).await.unwrap();
    assert!(status.success(), "{:#?}", maintain.lines());
    let lines = maintain.lines().join("\n");
    assert!(
        lines.contains(&format!("kept partition {}: 1 unpublished rows", day_name(day))),
        "{lines}"
    );
    assert!(exists(&client, &day_name(day)).await);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'late' AND published_at IS NULL"
        )
        .await,
        1,
        "the late event is kept for delivery"
    );
}

#[tokio::test]
async fn partitioning_a_plain_outbox_or_maintaining_one_is_refused() {
    let db = Db::start().await;
    for args in [
        &["migrate", "--partition-by", "day"][..],
        &["partitions", "maintain", "--keep", "7d"][..],
    ] {
        let out = run_cli(args, &[("DATABASE_URL", &db.url)]).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("plain table") || stderr.contains("not partitioned"),
            "{stderr}"
        );
    }
}

#[tokio::test]
async fn the_relay_runs_retention_on_either_layout() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT 'orders', g::text, 'E', '{}', now() - interval '3 days', now() - interval '3 days'
               FROM generate_series(1, 30) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, attempts, dead_at)
             SELECT 'orders', 'dead', 'E', '{}', now() - interval '3 days', 5, now() - interval '3 days';",
        )
        .await
        .unwrap();
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--retention", "1d", "--retention-interval", "1s"],
        &[],
    )
    .await;
    wait_until("the relay deleted the old published rows", LONG, || async {
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
            == 0
    })
    .await;
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        1,
        "the dead letter stays"
    );
    stop_relay(relay).await;

    let (url, client) = partitioned(&db).await;
    let day = Utc::now().date_naive() - Days::new(5);
    past_day(&client, day, 10, 0, 0).await;
    let relay: Spawned = start_relay(
        &url,
        &redis.url(),
        &["--retention", "2d", "--retention-interval", "1s"],
        &[],
    )
    .await;
    wait_until("the relay dropped the published day", LONG, || async {
        !exists(&client, &day_name(day)).await
    })
    .await;
    stop_relay(relay).await;
}
