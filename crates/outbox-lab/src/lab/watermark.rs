//! `watermark`: why the relay asks "not yet published" instead of "newer
//! than the last id I saw".
//!
//! Ids are taken at INSERT but become visible at COMMIT, so they commit out
//! of order. Session A inserts (id 1) and stays open; session B inserts
//! (id 2) and commits; the watermark relay reads `id > 0`, sends 2 and
//! advances to 2; A commits; `id > 2` never finds 1. The same interleaving
//! with our relay running: both are delivered, because it claims by
//! `published_at IS NULL`.

use std::collections::HashSet;

use anyhow::{Context, bail};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use super::shop::event_id;
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch};

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "watermark",
        "The watermark relay loses events; ours does not",
        "Two transactions insert events; the one with the smaller id commits last. A relay that \
         remembers the highest id it sent skips it forever; ours, claiming unpublished rows, sends both.",
        "session A: BEGIN; enqueue (smaller id); session B: enqueue, COMMIT; relay pass; A: COMMIT; relay pass. \
         Watermark relay: SELECT … WHERE id > $last ORDER BY id, POST each, last = max id. Ours: `outbox relay` \
         running throughout"
            .to_owned(),
    );

    // The watermark relay.
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let watermark_sent = {
        let (a, b) = (lab.connect().await?, lab.connect().await?);
        let mut a = a;
        let a_tx = a.transaction().await?;
        lab.outbox
            .enqueue(&a_tx, &Scratch::order_event(1, "OrderPlaced"))
            .await?;
        lab.outbox
            .enqueue(&b, &Scratch::order_event(2, "OrderPlaced"))
            .await?;
        let mut last = 0_i64;
        last = watermark_pass(lab, &receiver.url(), last).await?;
        a_tx.commit().await?;
        watermark_pass(lab, &receiver.url(), last).await?;
        receiver.received()
    };
    receiver.shutdown().await;
    let committed = lab.rows().await?;
    let watermark_lost = committed - distinct(&watermark_sent)? as i64;

    // Ours.
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let relay = lab.spawn_relay(&receiver.url(), &[], &[]).await?;
    let mut a = lab.connect().await?;
    let b = lab.connect().await?;
    let a_tx = a.transaction().await?;
    lab.outbox
        .enqueue(&a_tx, &Scratch::order_event(1, "OrderPlaced"))
        .await?;
    lab.outbox
        .enqueue(&b, &Scratch::order_event(2, "OrderPlaced"))
        .await?;
    receiver.wait_for_count(1, LONG).await?;
    // The fault is in place: the later id was delivered while the earlier
    // one was still uncommitted.
    let first = receiver.received();
    if first.len() != 1 || first[0].body["payload"]["order_id"] != json!(2) {
        bail!(
            "expected only B's event delivered before A commits, got {}",
            first.len()
        );
    }
    a_tx.commit().await?;
    lab.wait_drained("both events published").await?;
    lab.stop_relay(relay).await?;
    let ours_sent = receiver.received();
    receiver.shutdown().await;
    let ours_lost = lab.rows().await? - distinct(&ours_sent)? as i64;

    out.row(
        "watermark relay: events committed / delivered",
        format!("{committed} / {}", distinct(&watermark_sent)?),
        "2 / 1",
        Verdict::Timing,
    );
    out.row(
        "watermark relay: events lost",
        watermark_lost,
        "1",
        Verdict::naive(watermark_lost > 0),
    );
    out.row(
        "ours: events lost",
        ours_lost,
        "0",
        Verdict::check(ours_lost == 0),
    );
    out.row(
        "ours: delivery order",
        ours_sent
            .iter()
            .map(|r| format!("order {}", r.body["payload"]["order_id"]))
            .collect::<Vec<_>>()
            .join(", "),
        "-",
        Verdict::Timing,
    );
    Ok(out)
}

/// One pass of the watermark relay: everything above `last`, in id order,
/// POSTed one by one; returns the new watermark.
async fn watermark_pass(lab: &Scratch, sink: &str, last: i64) -> anyhow::Result<i64> {
    let rows = lab
        .db
        .query(
            &format!(
                "SELECT id, event_id, payload FROM {} WHERE id > $1 ORDER BY id",
                lab.table()
            ),
            &[&last],
        )
        .await
        .context("the watermark relay's SELECT")?;
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()?;
    let mut last = last;
    for row in rows {
        let (id, event_id, payload): (i64, uuid::Uuid, serde_json::Value) =
            (row.get(0), row.get(1), row.get(2));
        client
            .post(sink)
            .json(&json!({"event_id": event_id, "payload": payload}))
            .send()
            .await?
            .error_for_status()?;
        last = id;
    }
    Ok(last)
}

fn distinct(received: &[outbox_testkit::Post]) -> anyhow::Result<usize> {
    Ok(received
        .iter()
        .map(event_id)
        .collect::<Result<HashSet<_>, _>>()?
        .len())
}
