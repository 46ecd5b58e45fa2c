//! A throwaway cluster and database, outboxes in it, and an in-memory sink
//! whose answers a test chooses.

use std::sync::Mutex;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::{Config, Event, Outbox, OutboxRow};
use outbox_relay::{Delivery, DeliveryError, Sink};
use outbox_testkit::Postgres;
use tokio_postgres::Client;

pub struct Db {
    // Held so the cluster outlives the test.
    _pg: Postgres,
    pub url: String,
    pub client: Client,
}

impl Db {
    pub async fn start() -> Db {
        let pg = Postgres::start().await.expect("start postgres");
        let url = pg.fresh_database().await.expect("create database");
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        Db { _pg: pg, url, client }
    }

    /// Creates `schema` if needed and migrates an outbox `schema.outbox`.
    pub async fn outbox(&mut self, schema: &str) -> Config {
        let config = Config::new(schema, "outbox").expect("a valid outbox name");
        let create = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
        self.client.batch_execute(&create).await.expect(&create);
        outbox::migrate(&mut self.client, &config).await.expect("migrate");
        config
    }

    /// Writes `n` events of aggregate type `orders` into `config`'s outbox.
    pub async fn write(&self, config: &Config, n: usize) {
        let writer = Outbox::new(config.clone());
        for i in 0..n {
            let event = Event::new(
                "orders",
                format!("o{i}"),
                "OrderPlaced",
                serde_json::json!({"n": i}),
            );
            writer.enqueue(&self.client, &event).await.expect("enqueue");
        }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }
}

/// How the [`Memory`] sink answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Every row acknowledged.
    Ok,
    /// Every row unavailable: the sink is down.
    Down,
}

/// A sink that keeps the ids it acknowledged.
pub struct Memory {
    answer: Answer,
    pub acked: Mutex<Vec<i64>>,
}

impl Memory {
    pub fn new(answer: Answer) -> Self {
        Self {
            answer,
            acked: Mutex::default(),
        }
    }

    pub fn acked(&self) -> Vec<i64> {
        self.acked.lock().expect("not poisoned").clone()
    }
}

impl Sink for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        async move {
            match self.answer {
                Answer::Ok => {
                    let mut acked = self.acked.lock().expect("not poisoned");
                    batch
                        .iter()
                        .map(|row| {
                            acked.push(row.id);
                            Ok(())
                        })
                        .collect()
                }
                Answer::Down => batch
                    .iter()
                    .map(|_| Err(DeliveryError::unavailable("memory sink is down")))
                    .collect(),
            }
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        let answer = self.answer;
        async move {
            match answer {
                Answer::Ok => Ok(()),
                Answer::Down => Err(DeliveryError::unavailable("memory sink is down")),
            }
        }
        .boxed()
    }
}
