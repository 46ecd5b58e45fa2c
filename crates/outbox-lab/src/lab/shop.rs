//! The lab's world in the shared scratch: schema `outbox_lab` (an outbox
//! with its own NOTIFY channel, a processed_events table, and the shop's
//! `orders` and `shipments`), rebuilt from nothing by every experiment, and
//! the shop's two consumers, naive and idempotent.

use anyhow::Context;
use outbox::{Event, Processed};
use outbox_testkit::Post;
use serde_json::json;
use uuid::Uuid;

use crate::scratch::Scratch;

pub(super) const SCHEMA: &str = "outbox_lab";
pub(super) const CHANNEL: &str = "outbox_lab_new";

impl Scratch {
    /// Drops and recreates the scratch schema: a migrated outbox and inbox,
    /// and empty `orders` and `shipments`.
    pub(super) async fn reset(&mut self) -> anyhow::Result<()> {
        self.reset_outbox().await?;
        outbox::migrate_inbox(&mut self.db, self.inbox.config()).await?;
        self.db
            .batch_execute(&format!(
                "CREATE TABLE {SCHEMA}.orders (id bigserial PRIMARY KEY, customer text NOT NULL); \
                 CREATE TABLE {SCHEMA}.shipments (order_id bigint NOT NULL)"
            ))
            .await
            .context("creating the shop's tables")?;
        Ok(())
    }

    /// Orders, shipments, ghost shipments (of an order that does not exist)
    /// and orders without shipment.
    pub(super) async fn shop(&self) -> anyhow::Result<Shop> {
        let row = self
            .db
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM {SCHEMA}.orders), \
                            (SELECT count(*) FROM {SCHEMA}.shipments), \
                            (SELECT count(*) FROM {SCHEMA}.shipments s \
                              WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.orders o WHERE o.id = s.order_id)), \
                            (SELECT count(*) FROM {SCHEMA}.orders o \
                              WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.shipments s WHERE s.order_id = o.id)), \
                            (SELECT count(*) FROM (SELECT order_id FROM {SCHEMA}.shipments \
                              GROUP BY order_id HAVING count(*) > 1) d)"
                ),
                &[],
            )
            .await
            .context("counting orders and shipments")?;
        Ok(Shop {
            orders: row.get(0),
            shipments: row.get(1),
            ghosts: row.get(2),
            unshipped: row.get(3),
            shipped_twice: row.get(4),
        })
    }

    /// The naive consumer: one shipment per request that got a 2xx.
    pub(super) async fn ship_naively(&self, received: &[Post]) -> anyhow::Result<()> {
        for r in received.iter().filter(|r| (200..300).contains(&r.status)) {
            let order_id = order_id(r)?;
            self.db
                .execute(
                    &format!("INSERT INTO {SCHEMA}.shipments VALUES ($1)"),
                    &[&order_id],
                )
                .await?;
        }
        Ok(())
    }

    /// The idempotent consumer: the shipment and the inbox record in one
    /// transaction per request that got a 2xx. Returns the duplicates it
    /// skipped.
    pub(super) async fn ship_through_inbox(&mut self, received: &[Post]) -> anyhow::Result<usize> {
        let mut duplicates = 0;
        let insert = format!("INSERT INTO {SCHEMA}.shipments VALUES ($1)");
        for r in received.iter().filter(|r| (200..300).contains(&r.status)) {
            let order_id = order_id(r)?;
            let tx = self.db.transaction().await?;
            let outcome = self
                .inbox
                .process(&tx, event_id(r)?, async |tx| {
                    tx.execute(&insert, &[&order_id])
                        .await
                        .map_err(anyhow::Error::from)
                })
                .await?;
            tx.commit().await?;
            if outcome == Processed::Duplicate {
                duplicates += 1;
            }
        }
        Ok(duplicates)
    }

    /// An `orders` event for order `order_id` of aggregate `order_id`.
    pub(super) fn order_event(order_id: i64, event_type: &str) -> Event {
        Event::new(
            "orders",
            order_id.to_string(),
            event_type,
            json!({"order_id": order_id}),
        )
    }
}

/// The shop's books after an experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shop {
    pub(super) orders: i64,
    pub(super) shipments: i64,
    pub(super) ghosts: i64,
    pub(super) unshipped: i64,
    pub(super) shipped_twice: i64,
}

/// `payload.order_id` of a relay request, or `order_id` of a naive one.
pub(super) fn order_id(r: &Post) -> anyhow::Result<i64> {
    r.body["payload"]["order_id"]
        .as_i64()
        .or_else(|| r.body["order_id"].as_i64())
        .with_context(|| format!("no order_id in {}", r.body))
}

/// `event_id` of a request.
pub(super) fn event_id(r: &Post) -> anyhow::Result<Uuid> {
    r.body["event_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no event_id in {}", r.body))
}
