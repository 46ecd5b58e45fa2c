//! # outbox
//!
//! A transactional outbox for PostgreSQL. Writing a business row and sending a
//! message touch two systems, and no order of the two survives a crash. The
//! outbox pattern writes the event into a table in the *same transaction* as
//! the business change; a separate relay (the `outbox relay` command, crate
//! `outbox-relay`) delivers it afterwards and marks it published; consumers
//! deduplicate on the event's id through an [`Inbox`].
//!
//! This crate is what applications add:
//!
//! | module | owns |
//! |---|---|
//! | [`Event`], [`OutboxRow`] | the event as written and as claimed |
//! | [`Outbox`] | the writer: `enqueue`, `enqueue_all` in your transaction |
//! | [`contract`] | the table contract: what a row must hold to be delivered (the writer, the CHECK constraints and the relay apply it) |
//! | [`Inbox`] | the idempotent consumer: record + side effect in one transaction |
//! | [`migrate`], [`migrate_inbox`], [`check`] | versioned, embedded migrations |
//! | [`retention`] | batched deletion of published rows and old inbox records |
//! | [`partitions`] | daily partitions: create ahead, drop fully published days |
//! | [`webhooks`] | Standard Webhooks signatures: the HTTP sink signs, receivers verify |
//! | [`worker`] | consumer workers: effect through the inbox, acknowledge after commit |
//! | [`Config`], [`InboxConfig`], [`Ident`] | table names, validated and quoted |
//! | [`sql`] | every statement, named |
//! | [`notify`] | the systemd notify protocol: `READY=1`, `STATUS`, `STOPPING=1` and test signals (a no-op off unix) |
//!
//! | feature | default | gives |
//! |---|---|---|
//! | `tokio-postgres` | yes | writer, inbox and migrations on any `GenericClient` |
//! | `sqlx` | no | writer and inbox on `&mut PgConnection` |
//! | `redis` | no | `worker::redis`: a Redis Streams consumer worker with the inbox |
//! | `nats` | no | `worker::nats`: a NATS JetStream consumer worker with the inbox |
//! | `amqp` | no | `worker::amqp`: a RabbitMQ consumer worker with the inbox |
//!
//! ```no_run
//! # async fn run(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox::{Config, Event, Outbox};
//! use serde_json::json;
//!
//! outbox::migrate(client, &Config::default()).await?; // idempotent
//! let outbox = Outbox::default();
//! let tx = client.transaction().await?;
//! tx.execute("INSERT INTO orders (id) VALUES (42)", &[]).await?;
//! outbox.enqueue(&tx, &Event::new("orders", "42", "OrderCreated", json!({"order_id": 42}))).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
// The migration runner, the inbox's statements and the writer's column
// list serve the tokio-postgres API; a build with sqlx alone (or no client)
// keeps the shared pieces without their callers.
#![cfg_attr(not(feature = "tokio-postgres"), allow(dead_code, unused_imports))]

mod config;
pub mod contract;
mod error;
mod event;
mod ident;
mod inbox;
pub mod notify;
#[cfg(feature = "tokio-postgres")]
pub mod partitions;
#[cfg(feature = "tokio-postgres")]
pub mod privileges;
#[cfg(feature = "tokio-postgres")]
pub mod retention;
mod schema;
pub mod sql;
#[cfg(feature = "tokio-postgres")]
pub mod wal;
pub mod webhooks;
#[cfg(feature = "tokio-postgres")]
pub mod worker;
mod writer;

pub use config::{Config, DEFAULT_MAX_ATTEMPTS, DEFAULT_PARTITIONS, InboxConfig, Layout, MAX_PARTITIONS};
pub use error::{Error, Violation};
pub use event::{Event, OutboxRow, payload_bytes};
pub use ident::Ident;
pub use inbox::{Inbox, Processed, Record};
pub use schema::{INBOX_VERSION, MigrationReport, OUTBOX_VERSION};
#[cfg(feature = "tokio-postgres")]
pub use schema::{check, check_inbox, existing_layout, migrate, migrate_inbox};
#[cfg(feature = "sqlx")]
pub use writer::sqlx;
pub use writer::{Outbox, Statements};
#[cfg(feature = "tokio-postgres")]
pub use writer::{enqueue, enqueue_all};

/// The README's Rust examples, compiled as doc tests so its quick start
/// cannot rot (only under `cargo test --doc`: the README is outside the
/// crate's directory, so a packaged crate never reads it).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
