//! `index`: what the partial index buys.
//!
//! A healthy outbox is almost all published rows and a handful of pending
//! ones. The claim reads only pending rows, so its index holds only them
//! (`WHERE published_at IS NULL AND dead_at IS NULL`): a few kB however big the table grows.
//! Without it, the same claim scans the whole table. Both plans are run
//! for real (`EXPLAIN (ANALYZE, BUFFERS)` inside a transaction that is
//! rolled back, since the claim marks what it takes).

use anyhow::Context;
use serde_json::Value;

use super::shop::SCHEMA;
use crate::report::{Outcome, Table, Verdict};
use crate::scratch::Scratch;

const UNPUBLISHED: usize = 50;

/// What one EXPLAIN ANALYZE of the claim showed.
struct Explained {
    ms: f64,
    buffers: i64,
    rows: i64,
    scans: Vec<String>,
}

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let published: i64 = if lab.quick { 20_000 } else { 200_000 };
    let mut out = Outcome::new(
        "index",
        "The claim with and without the partial index",
        "Published rows pile up until cleanup; the claim must not read them. The partial index on \
         unpublished rows keeps the claim's cost proportional to the backlog, not to the table.",
        format!(
            "{published} published rows (~200-byte payloads) + {UNPUBLISHED} unpublished; VACUUM ANALYZE; \
             our claim statement (ordering none: batch 100; it marks what it locks, so it also \
             writes new row versions and index entries) and the reference's SELECT … FOR UPDATE SKIP LOCKED, \
             each under EXPLAIN (ANALYZE, BUFFERS) and rolled back; then the partial indexes dropped and the same again"
        ),
    );
    lab.reset().await?;
    lab.db
        .execute(
            &format!(
                "INSERT INTO {} (event_id, aggregate_type, aggregate_id, event_type, payload, published_at) \
                 SELECT gen_random_uuid(), 'orders', (i % 1000)::text, 'OrderPlaced', \
                        jsonb_build_object('order_id', i, 'note', repeat('x', 160)), clock_timestamp() \
                   FROM generate_series(1, $1::int8) AS i",
                lab.table()
            ),
            &[&published],
        )
        .await
        .context("inserting published rows")?;
    let events: Vec<_> = (0..UNPUBLISHED as i64)
        .map(|i| Scratch::order_event(published + i, "OrderPlaced"))
        .collect();
    lab.outbox.enqueue_all(&lab.db, &events).await?;
    lab.db
        .batch_execute(&format!("VACUUM ANALYZE {}", lab.table()))
        .await?;
    let table_bytes = lab
        .count(&format!(
            "SELECT pg_table_size('{}')",
            lab.table().replace('\'', "''")
        ))
        .await?;

    let partial = format!(
        "SELECT indexname::text, pg_relation_size(format('%I.%I', schemaname, indexname)::regclass) \
           FROM pg_indexes WHERE schemaname = '{SCHEMA}' AND tablename = 'outbox' \
            AND indexdef LIKE '%WHERE ((published_at IS NULL) AND (dead_at IS NULL))%' ORDER BY indexname"
    );
    let indexes: Vec<(String, i64)> = lab
        .db
        .query(&partial, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let seed = format!(
        "SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload FROM {} \
          WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
          ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
        lab.table()
    );
    let with = explain_ours(lab).await?;
    let seed_with = explain(lab, &seed).await?;
    for (name, _) in &indexes {
        lab.db
            .batch_execute(&format!("DROP INDEX {SCHEMA}.\"{name}\""))
            .await?;
    }
    lab.db.batch_execute(&format!("ANALYZE {}", lab.table())).await?;
    let without = explain_ours(lab).await?;
    let seed_without = explain(lab, &seed).await?;

    let unpublished_idx = indexes
        .iter()
        .find(|(n, _)| n.ends_with("_unpublished_idx"))
        .map_or(0, |(_, b)| *b);
    out.row(
        "table size",
        format!("{:.1} MB", table_bytes as f64 / 1_048_576.0),
        "62 MB (200,000 rows)",
        Verdict::Timing,
    );
    out.row(
        "with partial index: execution time / buffers",
        format!("{:.2} ms / {}", with.ms, with.buffers),
        "0.1 ms / 60",
        Verdict::Timing,
    );
    out.row(
        "partial index size (unpublished_idx)",
        format!("{} kB", unpublished_idx / 1024),
        "16 kB",
        Verdict::Timing,
    );
    out.row(
        "with partial index: scan",
        with.scans.join(", "),
        "Index Scan on the partial index",
        Verdict::Timing,
    );
    out.row(
        "without: execution time / buffers",
        format!("{:.2} ms / {}", without.ms, without.buffers),
        "34 ms / 7,979",
        Verdict::Timing,
    );
    out.row(
        "without: scan",
        without.scans.join(", "),
        "Seq Scan",
        Verdict::Timing,
    );
    out.row(
        "reference's SELECT … FOR UPDATE SKIP LOCKED alone, with / without: ms / buffers",
        format!(
            "{:.2} / {} — {:.2} / {}",
            seed_with.ms, seed_with.buffers, seed_without.ms, seed_without.buffers
        ),
        "0.1 / 60 — 34 / 7,979",
        Verdict::Timing,
    );
    let all = [&with, &without, &seed_with, &seed_without].map(|e| e.rows);
    out.row(
        "rows claimed: ours with / without, reference's with / without",
        format!("{all:?}"),
        "50 each",
        Verdict::check(all.iter().all(|&n| n == UNPUBLISHED as i64)),
    );
    out.tables.push(Table {
        title: "partial indexes dropped for the second run".to_owned(),
        header: vec!["index".to_owned(), "size".to_owned()],
        rows: indexes
            .iter()
            .map(|(n, b)| vec![n.clone(), format!("{} kB", b / 1024)])
            .collect(),
    });
    Ok(out)
}

/// Our claim (a batch of 100), run and rolled back.
async fn explain_ours(lab: &mut Scratch) -> anyhow::Result<Explained> {
    let defaults = outbox_relay::RelayConfig::default();
    let claim = outbox::sql::ClaimParams {
        types: &[],
        deadline: None,
        // From the start, as a relay's first claim (a sweep).
        floor: 0,
        limit: i64::from(defaults.batch_size),
        max_bytes: i64::try_from(defaults.batch_max_bytes)?,
        scope: outbox::sql::ClaimScope::All,
    };
    let tx = lab.db.transaction().await?;
    let plan = lab
        .outbox
        .sql()
        .explain_claim(&tx, &claim, true)
        .await
        .context("EXPLAIN of the claim")?;
    tx.rollback().await?;
    Ok(explained(&plan))
}

/// The reference relay's claim, which has literals, run and rolled back.
async fn explain(lab: &mut Scratch, statement: &str) -> anyhow::Result<Explained> {
    let sql = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}");
    let tx = lab.db.transaction().await?;
    let row = tx.query_one(&sql, &[]).await.context("EXPLAIN of the claim")?;
    tx.rollback().await?;
    Ok(explained(&row.get(0)))
}

fn explained(plan: &Value) -> Explained {
    let top = &plan[0];
    let root = &top["Plan"];
    let mut scans = Vec::new();
    walk(root, &mut scans);
    Explained {
        ms: top["Execution Time"].as_f64().unwrap_or(f64::NAN),
        buffers: root["Shared Hit Blocks"].as_i64().unwrap_or(0)
            + root["Shared Read Blocks"].as_i64().unwrap_or(0),
        rows: root["Actual Rows"].as_i64().unwrap_or(-1),
        scans,
    }
}

/// The scan nodes of a plan: `Index Scan using outbox_unpublished_idx`.
fn walk(node: &Value, scans: &mut Vec<String>) {
    let kind = node["Node Type"].as_str().unwrap_or("?");
    if kind.contains("Scan") && node["Relation Name"].as_str() == Some("outbox") {
        match node["Index Name"].as_str() {
            Some(index) => scans.push(format!("{kind} using {index}")),
            None => scans.push(kind.to_owned()),
        }
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        walk(child, scans);
    }
}
