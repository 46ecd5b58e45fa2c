//! `outbox cleanup`: published rows and inbox records go by age, in batches;
//! unpublished rows and dead letters stay, whatever their age.

use outbox::InboxConfig;

use crate::support::{Db, run_cli, text};

#[tokio::test]
async fn cleanup_deletes_only_old_published_rows_in_batches() {
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT 'orders', g::text, 'E', '{}', now() - interval '11 days', now() - interval '10 days'
               FROM generate_series(1, 2500) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', g::text, 'E', '{}', now() - interval '1 hour' FROM generate_series(1, 300) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT 'orders', g::text, 'E', '{}', now() - interval '30 days' FROM generate_series(1, 200) g;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, attempts, last_error, dead_at)
             SELECT 'orders', g::text, 'E', '{}', now() - interval '30 days', 5, 'boom', now() - interval '30 days'
               FROM generate_series(1, 50) g;",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];

    let out = run_cli(&["cleanup", "--older-than", "7d", "--batch-size", "1000"], &env).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(stdout.contains("deleted 2500 rows"), "{stdout}");
    assert!(stdout.contains("in 3 batches"), "{stdout}");

    let left = |sql: &'static str| db.count(sql);
    assert_eq!(left("SELECT count(*) FROM outbox").await, 550);
    assert_eq!(
        left("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await,
        300
    );
    assert_eq!(
        left("SELECT count(*) FROM outbox WHERE published_at IS NULL AND attempts = 0").await,
        200
    );
    assert_eq!(
        left("SELECT count(*) FROM outbox WHERE attempts >= 5").await,
        50,
        "dead letters kept"
    );

    let again = run_cli(&["cleanup", "--older-than", "7d"], &env).await;
    assert!(
        text(&again.stdout).contains("deleted 0 rows"),
        "{}",
        text(&again.stdout)
    );

    let bad = run_cli(&["cleanup", "--older-than", "soon"], &env).await;
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}

#[tokio::test]
async fn cleanup_inbox_deletes_old_records_only() {
    let mut db = Db::start().await;
    let config = InboxConfig::default();
    outbox::migrate_inbox(&mut db.client, &config).await.unwrap();
    db.client
        .batch_execute(
            "INSERT INTO processed_events (event_id, processed_at)
             SELECT gen_random_uuid(), now() - interval '40 days' FROM generate_series(1, 1200);
             INSERT INTO processed_events (event_id) SELECT gen_random_uuid() FROM generate_series(1, 100);",
        )
        .await
        .unwrap();
    let env = [("DATABASE_URL", db.url.as_str())];
    let out = run_cli(
        &["cleanup", "--inbox", "--older-than", "30d", "--batch-size", "500"],
        &env,
    )
    .await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(stdout.contains("deleted 1200 rows"), "{stdout}");
    assert!(stdout.contains("in 3 batches"), "{stdout}");
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 100);
}
