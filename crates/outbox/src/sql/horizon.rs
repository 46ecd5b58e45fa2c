//! What keeps vacuum from cleaning the outbox, for operators: the oldest
//! transaction or snapshot holding the server's xmin horizon back, and the
//! table's dead tuples. `outbox stats`, the admin console's overview and
//! the relay's periodic gauges (`outbox_xmin_horizon_age_seconds`,
//! `outbox_dead_tuples`) read them. Neither is on the relay's path.
//!
//! Vacuum removes a dead row version only once no snapshot can still see
//! it. One long `REPEATABLE READ` transaction, a `pg_dump`, a session idle
//! in a transaction after a write, a forgotten prepared transaction or a
//! standby's feedback through a replication slot keeps every version
//! made since from being removed, in every table: the outbox's marks pile
//! up as dead tuples (the polling relay's claim floor keeps claims from
//! walking them; the table still grows).

use serde::Serialize;
use tokio_postgres::{Error, GenericClient};

use super::OutboxSql;

/// The oldest holders of the xmin horizon, by kind: the oldest transaction
/// with a snapshot or a transaction id (`pg_stat_activity`: its age from
/// `xact_start`) or prepared transaction (from `prepared`), whichever began
/// first; then each replication slot holding an `xmin` (a standby's
/// `hot_standby_feedback`: no time is recorded for it, only its age in
/// transactions). A slot's `catalog_xmin` (every logical slot has one, the
/// WAL source's too) holds back the system catalogs only, not the outbox,
/// so it is left out. This session is left out; without
/// `pg_read_all_stats` (or `pg_monitor`) other roles' sessions show no
/// transaction and are missed.
const XMIN_HOLDERS: &str = "(SELECT 'transaction' AS kind, a.pid, coalesce(a.application_name, '')::text, \
            coalesce(a.state, '')::text, \
            extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS age_seconds, \
            age(coalesce(a.backend_xid, a.backend_xmin))::int8 AS age_xids \
       FROM pg_stat_activity AS a \
      WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL) AND a.xact_start IS NOT NULL \
        AND a.pid <> pg_backend_pid() \
     UNION ALL \
     SELECT 'prepared transaction', NULL::int4, p.gid, 'prepared', \
            extract(epoch FROM clock_timestamp() - p.prepared)::float8, age(p.transaction)::int8 \
       FROM pg_prepared_xacts AS p \
     ORDER BY age_seconds DESC LIMIT 1) \
     UNION ALL \
     SELECT 'replication slot', s.active_pid, s.slot_name::text, \
            CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL::float8, age(s.xmin)::int8 \
       FROM pg_replication_slots AS s WHERE s.xmin IS NOT NULL";

/// Dead tuples of the outbox table as the statistics count them, the
/// partitions of a daily-partitioned outbox summed (the parent has none of
/// its own). Statistics lag by up to a second or so behind the writes.
pub(super) const DEAD_TUPLES: &str = "SELECT coalesce(sum(s.n_dead_tup), 0)::int8 FROM pg_stat_user_tables AS s \
      WHERE s.relid = '{t}'::regclass \
         OR s.relid IN (SELECT i.inhrelid FROM pg_inherits AS i WHERE i.inhparent = '{t}'::regclass)";

/// Something holding the xmin horizon back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HorizonHolder {
    /// `transaction`, `prepared transaction` or `replication slot`.
    pub kind: String,
    /// The backend: the session's, or the process reading the slot.
    pub pid: Option<i32>,
    /// The session's `application_name`, the prepared transaction's gid,
    /// or the slot's name.
    pub name: String,
    /// The session's state (`idle in transaction`, `active`, …),
    /// `prepared`, or whether the slot is `active`.
    pub state: String,
    /// How long it has held the horizon, in seconds (from its transaction's
    /// start); None for a slot, whose hold has no recorded time.
    pub age_seconds: Option<f64>,
    /// Its age in transactions (`age(xmin)`).
    pub age_xids: i64,
}

impl OutboxSql {
    /// Who holds the xmin horizon back: the oldest transaction or prepared
    /// transaction first (if any), then each replication slot with an
    /// `xmin`. Typed, so one round trip and one transaction (the relay's
    /// gauges run it every 5 s).
    pub async fn xmin_holders(&self, client: &impl GenericClient) -> Result<Vec<HorizonHolder>, Error> {
        let rows = client.query_typed(XMIN_HOLDERS, &[]).await?;
        rows.iter()
            .map(|r| {
                Ok(HorizonHolder {
                    kind: r.try_get::<_, String>(0)?,
                    pid: r.try_get(1)?,
                    name: r.try_get(2)?,
                    state: r.try_get(3)?,
                    age_seconds: r.try_get(4)?,
                    age_xids: r.try_get(5)?,
                })
            })
            .collect()
    }

    /// Dead tuples of the outbox table, its partitions summed.
    pub async fn dead_tuples(&self, client: &impl GenericClient) -> Result<i64, Error> {
        client
            .query_typed(self.dead_tuples.as_str(), &[])
            .await?
            .first()
            .map_or(Ok(0), |r| r.try_get(0))
    }
}

impl HorizonHolder {
    /// Whether it is a transaction (or prepared one) whose age in seconds
    /// is known.
    pub fn is_transaction(&self) -> bool {
        self.age_seconds.is_some()
    }
}

impl std::fmt::Display for HorizonHolder {
    /// `transaction of pid 4711 (psql, idle in transaction), 12m 3s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.kind)?;
        if self.kind == "replication slot" {
            write!(f, " {} ({})", self.name, self.state)?;
        } else {
            if let Some(pid) = self.pid {
                write!(f, " of pid {pid}")?;
            }
            write!(f, " ({}, {})", self.name, self.state)?;
        }
        match self.age_seconds {
            Some(s) => write!(f, ", {} old", duration(s)),
            None => write!(f, ", {} transactions old", self.age_xids),
        }
    }
}

/// `3h 2m`, `12m 3s`, `4.2s`.
fn duration(secs: f64) -> String {
    // Whole seconds of an age: far inside u64.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let whole = secs.max(0.0) as u64;
    match whole {
        0..60 => format!("{secs:.1}s"),
        60..3600 => format!("{}m {}s", whole / 60, whole % 60),
        _ => format!("{}h {}m", whole / 3600, whole % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_as_who_and_how_old() {
        let t = HorizonHolder {
            kind: "transaction".into(),
            pid: Some(4711),
            name: "psql".into(),
            state: "idle in transaction".into(),
            age_seconds: Some(723.4),
            age_xids: 12,
        };
        assert_eq!(
            t.to_string(),
            "transaction of pid 4711 (psql, idle in transaction), 12m 3s old"
        );
        let slot = HorizonHolder {
            kind: "replication slot".into(),
            pid: None,
            name: "standby1".into(),
            state: "inactive".into(),
            age_seconds: None,
            age_xids: 5000,
        };
        assert_eq!(
            slot.to_string(),
            "replication slot standby1 (inactive), 5000 transactions old"
        );
        assert_eq!(duration(4.24), "4.2s");
        assert_eq!(duration(3.0 * 3600.0 + 125.0), "3h 2m");
    }
}
