//! What the three worker examples share: the database connection, the
//! tables, the side effect, Ctrl-C. The side effect is the only part a user
//! writes; everything else in the examples is setup.

use std::error::Error;

use outbox::worker::Received;
use outbox::{Inbox, InboxConfig};
use tokio_postgres::{Client, NoTls, Transaction};
use tokio_util::sync::CancellationToken;

/// The side effect: ship the order. It runs inside the inbox transaction,
/// so it commits together with the event_id that marks it done, and a
/// redelivered event does not reach it again.
pub(crate) async fn ship(tx: &Transaction<'_>, m: &Received) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)",
        &[&m.aggregate_id, &m.event_id],
    )
    .await
    .map(drop)
}

/// `DATABASE_URL`, with the inbox table and `shipments` created.
pub(crate) async fn database() -> Result<(Client, Inbox), Box<dyn Error>> {
    let url = var("DATABASE_URL")?;
    let (mut db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    let config = InboxConfig::default();
    outbox::migrate_inbox(&mut db, &config).await?;
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS shipments (
             id bigserial PRIMARY KEY,
             order_id text NOT NULL,
             -- Not unique on purpose: the inbox, not a constraint, keeps
             -- a redelivery from shipping twice.
             event_id uuid NOT NULL,
             shipped_at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;
    Ok((db, Inbox::new(config)))
}

/// A token cancelled by Ctrl-C (SIGINT): the worker finishes the message
/// in hand and returns.
pub(crate) fn ctrl_c() -> CancellationToken {
    let cancel = CancellationToken::new();
    let token = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        token.cancel();
    });
    cancel
}

/// An environment variable, or an error naming it.
pub(crate) fn var(name: &str) -> Result<String, Box<dyn Error>> {
    std::env::var(name).map_err(|_| format!("set {name}").into())
}
