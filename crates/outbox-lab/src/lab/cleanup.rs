//! `cleanup`: getting rid of published rows.
//!
//! `outbox cleanup` DELETEs published rows in short batches. DELETE leaves
//! dead tuples for (auto)vacuum and the file does not shrink: the
//! unpublished rows written since sit at its end. At high volume a table
//! partitioned by day drops a whole day instead: DETACH + DROP, no dead
//! tuple, the space back at once, after checking the day holds no
//! unpublished row. The partitioned copy is made by this experiment (same
//! columns, `PARTITION BY RANGE (created_at)`, primary key with
//! `created_at`).

use std::time::Instant;

use super::shop::SCHEMA;
use crate::report::{Outcome, Verdict};
use crate::scratch::Scratch;

const UNPUBLISHED: i64 = 50;

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let rows: i64 = if lab.quick { 20_000 } else { 200_000 };
    let mut out = Outcome::new(
        "cleanup",
        "Cleanup: DELETE vs dropping a daily partition",
        "Published rows must go, or the table grows forever. DELETE works everywhere but leaves dead \
         tuples and a file that does not shrink; a daily partition goes in one DETACH + DROP.",
        format!(
            "{rows} published rows (2 days old, ~200-byte payloads) then {UNPUBLISHED} unpublished; \
             `outbox cleanup --older-than 1d` (DELETE in batches of 10,000), VACUUM; a partitioned copy with \
             the {rows} rows in yesterday's partition and the {UNPUBLISHED} in today's: check, DETACH, DROP"
        ),
    );
    lab.reset().await?;
    let t = lab.table();
    let fill = |table: &str| {
        format!(
            "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at) \
             SELECT gen_random_uuid(), 'orders', (i % 1000)::text, 'OrderPlaced', \
                    jsonb_build_object('order_id', i, 'note', repeat('x', 160)), \
                    now() - interval '2 days', now() - interval '2 days' \
               FROM generate_series(1, $1::int8) AS i"
        )
    };
    lab.step("cleanup: filling the outbox");
    lab.db.execute(&fill(&t), &[&rows]).await?;
    let fresh: Vec<_> = (0..UNPUBLISHED)
        .map(|i| Scratch::order_event(rows + i, "OrderPlaced"))
        .collect();
    lab.outbox.enqueue_all(&lab.db, &fresh).await?;
    lab.db.batch_execute(&format!("VACUUM ANALYZE {t}")).await?;
    let size = |table: &str| format!("SELECT pg_table_size('{table}')");
    let before = lab.count(&size(&t)).await?;

    lab.step("cleanup: outbox cleanup");
    let started = Instant::now();
    lab.run_cli(&["cleanup", "--older-than", "1d"]).await?;
    let delete_ms = started.elapsed().as_secs_f64() * 1000.0;
    let after_delete = lab.count(&size(&t)).await?;
    // The cleanup process's statistics are published as its backend exits,
    // a moment after the process: wait for them (at most 5 s).
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    let mut dead = dead_tuples(lab, "outbox").await?;
    while dead < rows && Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        dead = dead_tuples(lab, "outbox").await?;
    }
    lab.db.batch_execute(&format!("VACUUM {t}")).await?;
    let after_vacuum = lab.count(&size(&t)).await?;
    let left = lab.rows().await?;

    out.row(
        "outbox: table size before",
        mb(before),
        "62 MB (200,000 rows)",
        Verdict::Timing,
    );
    out.row(
        "outbox cleanup: wall time (a process, DELETE in batches)",
        format!("{delete_ms:.0} ms"),
        "-",
        Verdict::Timing,
    );
    out.row(
        "after DELETE: table size / dead tuples",
        format!("{} / {dead}", mb(after_delete)),
        "does not shrink / 200,000",
        Verdict::Timing,
    );
    out.row(
        "after VACUUM: table size",
        mb(after_vacuum),
        "does not shrink",
        Verdict::Timing,
    );
    out.row(
        "rows left: unpublished only",
        left,
        UNPUBLISHED.to_string(),
        Verdict::check(left == UNPUBLISHED),
    );

    // The partitioned copy.
    lab.step("cleanup: partitioned copy");
    let p = format!("{SCHEMA}.outbox_daily");
    lab.db
        .batch_execute(&format!(
            "CREATE TABLE {p} (LIKE {t} INCLUDING DEFAULTS, PRIMARY KEY (id, created_at)) \
               PARTITION BY RANGE (created_at); \
             CREATE TABLE {p}_old PARTITION OF {p} \
               FOR VALUES FROM (now() - interval '3 days') TO (now() - interval '1 day'); \
             CREATE TABLE {p}_today PARTITION OF {p} \
               FOR VALUES FROM (now() - interval '1 day') TO (now() + interval '1 day'); \
             CREATE INDEX ON {p} (id) WHERE published_at IS NULL"
        ))
        .await?;
    lab.db.execute(&fill(&p), &[&rows]).await?;
    lab.db
        .execute(
            &format!(
                "INSERT INTO {p} (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid(), 'orders', i::text, 'OrderPlaced', '{{}}' \
                   FROM generate_series(1, $1::int8) AS i"
            ),
            &[&UNPUBLISHED],
        )
        .await?;
    lab.db.batch_execute(&format!("VACUUM ANALYZE {p}")).await?;
    let partition_size = lab.count(&size(&format!("{p}_old"))).await?;
    // Never drop a day that still has something to deliver.
    let pending = lab
        .count(&format!(
            "SELECT count(*) FROM {p}_old WHERE published_at IS NULL"
        ))
        .await?;
    let started = Instant::now();
    lab.db
        .batch_execute(&format!("ALTER TABLE {p} DETACH PARTITION {p}_old"))
        .await?;
    let detach_ms = started.elapsed().as_secs_f64() * 1000.0;
    let started = Instant::now();
    lab.db.batch_execute(&format!("DROP TABLE {p}_old")).await?;
    let drop_ms = started.elapsed().as_secs_f64() * 1000.0;
    let left = lab.count(&format!("SELECT count(*) FROM {p}")).await?;
    let left_unpublished = lab
        .count(&format!("SELECT count(*) FROM {p} WHERE published_at IS NULL"))
        .await?;
    let dead_after = dead_tuples(lab, "outbox_daily_today").await?;

    out.row(
        "partition: size of the dropped day",
        mb(partition_size),
        "52 MB (200,000 rows)",
        Verdict::Timing,
    );
    out.row(
        "partition: unpublished rows in the day before dropping it",
        pending,
        "0 (checked first)",
        Verdict::check(pending == 0),
    );
    out.row(
        "partition: DETACH + DROP",
        format!("{detach_ms:.1} ms + {drop_ms:.1} ms"),
        "0.7 ms + 9.9 ms",
        Verdict::Timing,
    );
    out.row(
        "partition: rows left / unpublished / dead tuples in today's",
        format!("{left} / {left_unpublished} / {dead_after}"),
        format!("{UNPUBLISHED} / {UNPUBLISHED} / 0"),
        Verdict::check(left == UNPUBLISHED && left_unpublished == UNPUBLISHED),
    );
    Ok(out)
}

/// `n_dead_tup` of a table in the lab schema, with this backend's pending
/// statistics flushed first (PostgreSQL 15+; older servers publish within
/// half a second anyway).
async fn dead_tuples(lab: &Scratch, table: &str) -> anyhow::Result<i64> {
    let _ = lab.db.batch_execute("SELECT pg_stat_force_next_flush()").await;
    lab.count(&format!(
        "SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_user_tables \
          WHERE schemaname = '{SCHEMA}' AND relname = '{table}'"
    ))
    .await
}

fn mb(bytes: i64) -> String {
    format!("{:.1} MB", bytes as f64 / 1_048_576.0)
}
