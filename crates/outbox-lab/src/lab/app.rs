//! The shop application the experiments break: one request places one
//! order. It runs as its own process (`outbox-lab lab --app <style>:<path>:<customer>`)
//! so that "the process died here" is a real kill -9 of a real process with
//! an open connection, not a simulation.
//!
//! Two styles:
//! - `naive`: the reference's code. `INSERT order; COMMIT; POST /events`,
//!   and its reordered sibling `POST; COMMIT`, which fails the other way;
//! - `outbox`: `INSERT order; INSERT event; COMMIT`, nothing sent.
//!
//! At a crash point the app prints `parked …`, sends
//! `OUTBOX_FAILPOINT=parked <where> reached` to `NOTIFY_SOCKET`, and waits
//! to be killed.

use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::json;
use uuid::Uuid;

use super::shop::SCHEMA;
use crate::scratch::{Scratch, connect, parse_pg_url};
use crate::{ConfigError, Database};

/// `application_name` of the app's connection, so the lab can see its
/// backend in `pg_stat_activity`.
pub(super) const APP_NAME: &str = "outbox-lab-app";

/// Crash points.
pub(super) const BEFORE_COMMIT: &str = "before commit";
pub(super) const AFTER_COMMIT: &str = "after commit";

/// Which way a request goes wrong (the reference's five paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// Nothing fails.
    Ok,
    /// The process dies right after COMMIT, before the POST.
    CrashAfterCommit,
    /// POST first, then the transaction fails and rolls back.
    SendThenRollback,
    /// POST first, then the process dies before COMMIT.
    SendThenCrash,
    /// COMMIT, then the receiver refuses the connection.
    ReceiverDown,
}

impl Path {
    pub(super) const ALL: [Path; 5] = [
        Path::Ok,
        Path::CrashAfterCommit,
        Path::SendThenRollback,
        Path::SendThenCrash,
        Path::ReceiverDown,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Path::Ok => "ok",
            Path::CrashAfterCommit => "crash-after-commit",
            Path::SendThenRollback => "send-then-rollback",
            Path::SendThenCrash => "send-then-crash",
            Path::ReceiverDown => "receiver-down",
        }
    }

    /// Whether the app parks at a crash point (and the lab kills it).
    pub(super) fn crashes(self) -> bool {
        self.crash_point().is_some()
    }

    /// Where the app parks, in both styles.
    pub(super) fn crash_point(self) -> Option<&'static str> {
        match self {
            Path::CrashAfterCommit => Some(AFTER_COMMIT),
            Path::SendThenCrash => Some(BEFORE_COMMIT),
            _ => None,
        }
    }

    fn parse(s: &str) -> Option<Path> {
        Path::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Runs one request of the app: `spec` is `<naive|outbox>:<path>:<customer>`.
pub(super) async fn run(db: &Database, spec: &str, sink: &str) -> anyhow::Result<()> {
    let mut parts = spec.splitn(3, ':');
    let (Some(style), Some(path), Some(customer)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("--app wants <naive|outbox>:<path>:<customer>, not {spec:?}");
    };
    let path = Path::parse(path).with_context(|| format!("unknown app path {path:?}"))?;
    let url = db.url.as_deref().ok_or_else(|| {
        ConfigError("no database given: set DATABASE_URL or pass --database-url".to_owned())
    })?;
    let mut pg = parse_pg_url(url, db.connect_timeout)?;
    pg.postgres_mut().application_name(APP_NAME);
    let mut db = connect(&pg).await?;
    let insert = format!("INSERT INTO {SCHEMA}.orders (customer) VALUES ($1) RETURNING id");
    let tx = db.transaction().await?;
    let order_id: i64 = tx.query_one(&insert, &[&customer]).await?.get(0);
    match style {
        "naive" => {
            if matches!(path, Path::SendThenRollback | Path::SendThenCrash) {
                post(sink, order_id).await?;
                println!("order {order_id} sent");
                if path == Path::SendThenCrash {
                    park(BEFORE_COMMIT).await;
                }
                // E.g. a constraint or serialization failure after the POST.
                tx.rollback().await?;
                bail!("order {order_id} failed after it was sent; rolled back");
            }
            tx.commit().await?;
            println!("order {order_id} committed");
            if path == Path::CrashAfterCommit {
                park(AFTER_COMMIT).await;
            }
            post(sink, order_id)
                .await
                .with_context(|| format!("order {order_id} is committed, but notifying shipping failed"))?;
            println!("order {order_id} sent");
        }
        "outbox" => {
            let outbox = outbox::Outbox::new(outbox::Config::new(SCHEMA, "outbox")?);
            outbox
                .enqueue(&tx, &Scratch::order_event(order_id, "OrderPlaced"))
                .await?;
            match path {
                Path::SendThenRollback => {
                    tx.rollback().await?;
                    bail!("order {order_id} failed; rolled back with its event");
                }
                Path::SendThenCrash => park(BEFORE_COMMIT).await,
                _ => {}
            }
            tx.commit().await?;
            println!("order {order_id} committed with its event");
            if path == Path::CrashAfterCommit {
                park(AFTER_COMMIT).await;
            }
        }
        other => bail!("unknown app style {other:?}"),
    }
    Ok(())
}

/// What the app sends to `NOTIFY_SOCKET` when it parks at `at`.
pub(super) fn parked(at: &str) -> String {
    format!("OUTBOX_FAILPOINT=parked {at} reached")
}

/// Says where it stopped (on stdout, and `OUTBOX_FAILPOINT=parked <at>
/// reached` to `NOTIFY_SOCKET`) and waits to be killed (at most a minute, in
/// case the lab itself died).
async fn park(at: &str) {
    println!("parked {at}");
    outbox::notify::send(&parked(at));
    tokio::time::sleep(Duration::from_secs(60)).await;
    std::process::exit(3);
}

/// The reference's `send(order_id)`: POST /events to the shipping service.
async fn post(sink: &str, order_id: i64) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    client
        .post(sink)
        .json(&json!({"event_id": Uuid::new_v4(), "order_id": order_id}))
        .send()
        .await
        .with_context(|| format!("POST {sink}"))?
        .error_for_status()?;
    Ok(())
}
