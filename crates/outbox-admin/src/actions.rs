//! Every change the console makes, shared by its pages and its API: each
//! runs on a connection of its own, in one transaction with its audit row
//! (who, what, which rows, how many) and the NOTIFY that wakes the relays,
//! so the change, its record and the wake-up commit together or not at
//! all. The same typed statements as `outbox dlq` change the rows.

use serde_json::json;
use tokio_postgres::Transaction;

use crate::AppState;
use crate::dead::Selection;
use crate::view::{self, Failure};

/// What a change did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Changed {
    /// Rows it changed.
    pub(crate) rows: u64,
    /// Its audit row.
    pub(crate) audit_id: i64,
}

fn fail(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Failure {
    move |e| Failure(what.to_owned(), e)
}

/// How an action is recorded: its name in the audit trail, whether it
/// wakes the relays, and its log line for a count of rows.
pub(crate) struct Kind {
    pub(crate) action: &'static str,
    pub(crate) wake: bool,
    pub(crate) said: fn(u64) -> String,
}

/// A connection of its own for one change; the caller opens the
/// transaction on it (a transaction borrows its client).
pub(crate) async fn begin(state: &AppState) -> Result<tokio_postgres::Client, Failure> {
    state.db.own().await.map_err(fail("connecting to PostgreSQL"))
}

pub(crate) async fn transaction(client: &mut tokio_postgres::Client) -> Result<Transaction<'_>, Failure> {
    client.transaction().await.map_err(fail("starting a transaction"))
}

/// Records the change `tx` made to `rows` rows as `kind` by `who` with
/// `detail`, notifies the relays when it wakes them and changed rows, and
/// commits.
pub(crate) async fn finish(
    state: &AppState,
    tx: Transaction<'_>,
    who: &str,
    kind: Kind,
    detail: serde_json::Value,
    rows: u64,
) -> Result<Changed, Failure> {
    let action = kind.action;
    let affected = i64::try_from(rows).unwrap_or(i64::MAX);
    let audit_id = state
        .audit
        .record(&tx, who, action, &detail, affected)
        .await
        .map_err(fail("recording the change in the audit table"))?;
    if kind.wake && rows > 0 {
        // A give-up makes an aggregate's later events claimable without
        // any insert; a NOTIFY in the transaction is sent at commit, so
        // relays wake when the change is visible, never before.
        state
            .sql
            .notify(&tx, state.outbox.channel.as_str())
            .await
            .map_err(fail("notifying relays"))?;
    }
    tx.commit().await.map_err(fail("committing the change"))?;
    tracing::info!(
        action,
        outbox = %state.outbox.display_name(),
        rows,
        audit_id,
        who,
        detail = %detail,
        "admin: {}", (kind.said)(rows)
    );
    Ok(Changed { rows, audit_id })
}

/// `outbox dlq requeue` of `selection`.
pub(crate) async fn requeue(state: &AppState, who: &str, selection: &Selection) -> Result<Changed, Failure> {
    let kind = Kind {
        action: "requeue",
        wake: true,
        said: |n| format!("requeued {}", view::dead_letters(n)),
    };
    let mut client = begin(state).await?;
    let tx = transaction(&mut client).await?;
    let rows = state
        .sql
        .requeue_dead(&tx, &selection.filter())
        .await
        .map_err(fail("requeueing dead letters"))?;
    finish(state, tx, who, kind, selection.detail(), rows).await
}

/// `outbox dlq give-up` of the selected rows.
pub(crate) async fn give_up(state: &AppState, who: &str, selection: &Selection) -> Result<Changed, Failure> {
    let kind = Kind {
        action: "give-up",
        wake: true,
        said: |n| format!("gave up on {}", view::dead_letters(n)),
    };
    let mut client = begin(state).await?;
    let tx = transaction(&mut client).await?;
    let rows = state
        .sql
        .give_up(&tx, &selection.ids)
        .await
        .map_err(fail("giving up on dead letters"))?;
    finish(state, tx, who, kind, selection.detail(), rows).await
}

/// `outbox dlq purge --older-than`: deletes the dead letters given up on
/// before `before`, 1,000 rows per statement, in one transaction (so an
/// audit row never counts a purge that rolled back).
pub(crate) async fn purge(
    state: &AppState,
    who: &str,
    before: chrono::DateTime<chrono::Utc>,
) -> Result<Changed, Failure> {
    let detail = json!({ "given_up_before": before.to_rfc3339() });
    let kind = Kind {
        action: "purge",
        wake: false,
        said: |n| format!("purged {}", view::dead_letters(n)),
    };
    let mut client = begin(state).await?;
    let tx = transaction(&mut client).await?;
    let mut rows = 0;
    loop {
        // The statement takes an age; the instant was fixed by the dry
        // run, so the age grows with the time since.
        let age = (chrono::Utc::now() - before).to_std().unwrap_or_default();
        let n = state
            .sql
            .purge_given_up(&tx, age)
            .await
            .map_err(fail("deleting given-up dead letters"))?;
        rows += n;
        if n == 0 {
            break;
        }
    }
    finish(state, tx, who, kind, detail, rows).await
}

/// Pauses `route`: the relays stop delivering it within one heartbeat.
/// `rows` is 0 when it was paused already (nothing changed).
pub(crate) async fn pause(
    state: &AppState,
    routes: &outbox::sql::RouteSql,
    who: &str,
    route: &str,
    reason: Option<&str>,
) -> Result<Changed, Failure> {
    let detail = json!({ "route": route, "reason": reason });
    let kind = Kind {
        action: "pause",
        wake: false,
        said: |n| {
            if n == 0 {
                "pause: the route was paused already".to_owned()
            } else {
                "paused a route".to_owned()
            }
        },
    };
    let mut client = begin(state).await?;
    let tx = transaction(&mut client).await?;
    let rows = u64::from(
        routes
            .pause(&tx, route, who, reason)
            .await
            .map_err(fail("pausing the route"))?,
    );
    finish(state, tx, who, kind, detail, rows).await
}

/// Resumes `route`: the relays deliver it again from their next heartbeat.
/// `rows` is 0 when it was not paused.
pub(crate) async fn resume(
    state: &AppState,
    routes: &outbox::sql::RouteSql,
    who: &str,
    route: &str,
) -> Result<Changed, Failure> {
    let detail = json!({ "route": route });
    let kind = Kind {
        action: "resume",
        wake: false,
        said: |n| {
            if n == 0 {
                "resume: the route was not paused".to_owned()
            } else {
                "resumed a route".to_owned()
            }
        },
    };
    let mut client = begin(state).await?;
    let tx = transaction(&mut client).await?;
    let rows = u64::from(
        routes
            .resume(&tx, route)
            .await
            .map_err(fail("resuming the route"))?,
    );
    finish(state, tx, who, kind, detail, rows).await
}
