//! Routing by aggregate type: a [`Sink`] made of sinks.
//!
//! [`Router`] owns the split and the merge, nothing else: it sends each row
//! to the sink its `aggregate_type` is routed to (or the default route),
//! delivers the parts concurrently and answers one [`Delivery`] per row in
//! the batch's order, each the answer of that row's own sink. The relay
//! core is unchanged: a row is marked only when its own sink acknowledged
//! it, and a sink that is down fails only its own rows, which the relay
//! retries while the other sinks' rows are marked.
//!
//! Order is kept per aggregate because an aggregate has one type, so all its
//! rows of a batch go to one sink, in batch order.

use std::collections::HashMap;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;

use super::{Delivery, DeliveryError, Sink};

/// Delivers each row to the sink of its aggregate type.
pub struct Router {
    /// Aggregate type → index into `sinks`.
    routes: HashMap<String, usize>,
    /// Index of the default route's sink.
    default: usize,
    sinks: Vec<Box<dyn Sink>>,
}

impl Router {
    /// A router sending `default` everything no route names.
    pub fn new(default: Box<dyn Sink>) -> Self {
        Self {
            routes: HashMap::new(),
            default: 0,
            sinks: vec![default],
        }
    }

    /// Routes the events of `aggregate_type` to `sink`. A later route for the
    /// same type replaces an earlier one; the CLI refuses duplicates first.
    pub fn route(mut self, aggregate_type: impl Into<String>, sink: Box<dyn Sink>) -> Self {
        self.sinks.push(sink);
        self.routes.insert(aggregate_type.into(), self.sinks.len() - 1);
        self
    }

    fn sink_of(&self, row: &OutboxRow) -> usize {
        self.routes
            .get(&row.aggregate_type)
            .copied()
            .unwrap_or(self.default)
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        // Row indices per sink, in batch order.
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); self.sinks.len()];
        for (i, row) in batch.iter().enumerate() {
            parts[self.sink_of(row)].push(i);
        }
        // A sink takes a slice, so each part is copied out; rows are small
        // next to a network round trip.
        let deliveries = parts
            .iter()
            .enumerate()
            .filter(|(_, part)| !part.is_empty())
            .map(|(s, part)| {
                let rows: Vec<OutboxRow> = part.iter().map(|&i| batch[i].clone()).collect();
                let sink = &self.sinks[s];
                async move {
                    let answers = sink.deliver(&rows).await;
                    (part, answers)
                }
            });
        let mut out: Vec<Option<Delivery>> = vec![None; batch.len()];
        for (part, answers) in futures::future::join_all(deliveries).await {
            for (&i, answer) in part.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        // A sink that answered fewer rows than it got broke the trait's
        // contract; its missing rows are retried rather than marked.
        out.into_iter()
            .map(|d| d.unwrap_or_else(|| Err(DeliveryError::retryable("router: the sink gave no answer"))))
            .collect()
    }
}

impl Sink for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use chrono::Utc;
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    /// Records what it got; fails every row when `down`.
    struct Fake {
        name: &'static str,
        down: bool,
        seen: Mutex<Vec<i64>>,
    }

    impl Fake {
        fn new(name: &'static str, down: bool) -> Box<Self> {
            Box::new(Self {
                name,
                down,
                seen: Mutex::new(Vec::new()),
            })
        }
    }

    impl Sink for Fake {
        fn name(&self) -> &'static str {
            self.name
        }

        fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
            self.seen.lock().unwrap().extend(batch.iter().map(|r| r.id));
            let answers = batch
                .iter()
                .map(|_| {
                    if self.down {
                        Err(DeliveryError::retryable(format!("{} down", self.name)))
                    } else {
                        Ok(())
                    }
                })
                .collect();
            async move { answers }.boxed()
        }
    }

    fn row(id: i64, aggregate_type: &str) -> OutboxRow {
        OutboxRow {
            id,
            event_id: Uuid::new_v4(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: "1".into(),
            event_type: "E".into(),
            payload: json!({}),
            headers: json!({}),
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    #[tokio::test]
    async fn each_row_gets_its_own_sinks_answer_in_batch_order() {
        let router = Router::new(Fake::new("http", false)).route("orders", Fake::new("redis", true));
        let batch = [
            row(1, "orders"),
            row(2, "invoices"),
            row(3, "orders"),
            row(4, "payments"),
        ];
        let answers = router.deliver(&batch).await;
        let ok: Vec<bool> = answers.iter().map(Result::is_ok).collect();
        assert_eq!(ok, [false, true, false, true]);
        assert_eq!(answers[0].as_ref().unwrap_err().to_string(), "redis down");
    }
}
