//! The console's audit trail (`<table>_audit`, migration 0011): one row per
//! change an operator made from `outbox admin` or its API, written in the
//! change's own transaction, so a change without its row (or a row without
//! its change) cannot be committed.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::{Error, GenericClient, Row};

use super::typed::typed;
use crate::Config;

/// `$1` who, `$2` action, `$3` detail (JSON text), `$4` rows changed.
const RECORD: &str = "INSERT INTO {audit} (who, action, detail, affected) VALUES ($1, $2, $3::jsonb, $4) \
     RETURNING id";

/// `$1` below this id (keyset, newest first), `$2` limit. Walks the
/// primary key backwards.
const RECENT: &str = "SELECT id, at, who, action, detail, affected FROM {audit} \
     WHERE id < $1 ORDER BY id DESC LIMIT $2";

/// The audit trail's statements for one outbox.
#[derive(Debug, Clone)]
pub struct AuditSql {
    record: String,
    recent: String,
}

/// One change an operator made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditRow {
    /// Its id, increasing.
    pub id: i64,
    /// When it was committed (the statement's clock).
    pub at: DateTime<Utc>,
    /// Who: a named token, or `admin` for `--admin-token`.
    pub who: String,
    /// What: `requeue`, `give-up`, `purge`, `pause`, `resume`, …
    pub action: String,
    /// To which rows: the selection, as the console described it.
    pub detail: serde_json::Value,
    /// How many rows (or routes) it changed.
    pub affected: i64,
}

impl AuditSql {
    /// The statements for `config`'s audit table.
    pub fn new(config: &Config) -> Self {
        // The name is validated by the migration that creates the table; a
        // table name too long for it fails the schema check first.
        let audit = format!("{}.\"{}_audit\"", config.schema.quoted(), config.table);
        let render = |s: &str| s.replace("{audit}", &audit);
        AuditSql {
            record: render(RECORD),
            recent: render(RECENT),
        }
    }

    /// Records a change; run it in the change's transaction. Returns the
    /// row's id.
    pub async fn record(
        &self,
        client: &impl GenericClient,
        who: &str,
        action: &str,
        detail: &serde_json::Value,
        affected: i64,
    ) -> Result<i64, Error> {
        let detail = detail.to_string();
        client
            .query_typed_one(
                &self.record,
                &[
                    typed(&who),
                    typed(&action),
                    typed(&detail.as_str()),
                    typed(&affected),
                ],
            )
            .await?
            .try_get(0)
    }

    /// The newest `limit` changes with ids below `before` (`i64::MAX`: the
    /// newest of all).
    pub async fn recent(
        &self,
        client: &impl GenericClient,
        before: i64,
        limit: i64,
    ) -> Result<Vec<AuditRow>, Error> {
        let rows = client
            .query_typed(&self.recent, &[typed(&before), typed(&limit)])
            .await?;
        rows.iter().map(audit_row).collect()
    }
}

fn audit_row(r: &Row) -> Result<AuditRow, Error> {
    Ok(AuditRow {
        id: r.try_get("id")?,
        at: r.try_get("at")?,
        who: r.try_get("who")?,
        action: r.try_get("action")?,
        detail: r.try_get("detail")?,
        affected: r.try_get("affected")?,
    })
}
