//! A streaming standby of a testkit [`Postgres`] and its promotion: what a
//! failover test needs besides killing the primary ([`Postgres::kill`],
//! [`Postgres::stop_immediate`]).
//!
//! The standby is a `pg_basebackup -R` of the primary, in a temporary
//! directory and on a port of its own, run as the same unprivileged user.
//! The primary needs nothing beyond the testkit's defaults: PostgreSQL 15's
//! `wal_level = replica` and `max_wal_senders = 10`, and a `pg_hba.conf`
//! that lets `postgres` replicate from 127.0.0.1 (initdb's, or the line
//! [`PgSettings::hba`](crate::PgSettings::hba) always adds).
//!
//! A synchronous standby ([`Replication::Sync`]) is what a failover test
//! wants: with it, a commit the primary acknowledged is on the standby, so
//! killing the primary and promoting the standby loses no acknowledged
//! commit. Not the primary's settings files: the primary is told with
//! `ALTER SYSTEM` once the standby streams, and the standby's copy of them
//! names no synchronous standby of its own, or its writes would wait for
//! one once promoted.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::postgres::{Cluster, cluster_dir};
use crate::support::POLL;
use crate::{Error, Postgres};

/// How long the base backup, the standby reaching `streaming` (and
/// `sync`), and a promotion may take.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Whether the primary waits for the standby at each commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// The primary does not wait: a commit acknowledged just before the
    /// primary died may be missing on the standby.
    Async,
    /// `synchronous_standby_names` names the standby on the primary
    /// (`synchronous_commit = on`, the testkit's): a commit returns once
    /// the standby flushed it.
    Sync,
}

impl Postgres {
    /// Starts a streaming standby of this server, returning once it
    /// streams (and, with [`Replication::Sync`], once the primary counts
    /// it as its synchronous standby). The standby is a `Postgres` of its
    /// own: read-only until [`promote`](Self::promote)d, its own port,
    /// directory and log, gone when dropped.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), outbox_testkit::Error> {
    /// use outbox_testkit::{Postgres, Replication};
    ///
    /// let mut primary = Postgres::start().await?;
    /// let mut standby = primary.start_standby(Replication::Sync).await?;
    /// primary.stop_immediate().await?; // the primary dies
    /// standby.promote().await?; // the standby takes writes
    /// # Ok(()) }
    /// ```
    pub async fn start_standby(&self, replication: Replication) -> Result<Postgres, Error> {
        let (bin, run_as, primary_data) = self.parts();
        let dir = cluster_dir(run_as)?;
        let data = dir.path().join("data");
        // Unique among the primary's standbys: how pg_stat_replication and
        // synchronous_standby_names tell it apart.
        let name = format!("standby_{}", uuid::Uuid::new_v4().simple());
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name={name}",
            self.port()
        );
        let basebackup = bin.dir.join("pg_basebackup");
        let mut cmd = tokio::process::Command::new(&basebackup);
        cmd.arg("-D")
            .arg(&data)
            .args(["-d", &conninfo])
            // -R: standby.signal and primary_conninfo; a fast checkpoint so
            // the backup starts at once; WAL streamed alongside.
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        run_as.apply(&mut cmd);
        let doing = format!(
            "taking a base backup of PostgreSQL on port {} with {}",
            self.port(),
            basebackup.display()
        );
        let out = tokio::time::timeout(TIMEOUT, cmd.output())
            .await
            .map_err(|_| Error::Timeout {
                waiting_for: doing.clone(),
                timeout: TIMEOUT,
                detail: String::new(),
            })?
            .map_err(Error::io(doing.clone()))?;
        if !out.status.success() {
            return Err(Error::Failed {
                doing,
                detail: format!(
                    "{}; output:\n{}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        // Later lines win over what the backup copied and -R wrote.
        append_auto_conf(
            &data,
            &format!("primary_conninfo = '{conninfo}'\nsynchronous_standby_names = ''\nhot_standby = on\n"),
        )?;
        let standby = Postgres::launch(Cluster {
            bin,
            run_as,
            dir,
            data,
            origin: primary_data.to_path_buf(),
        })
        .await?;

        let primary = self.connect("postgres").await?;
        self.wait_replication(&primary, &name, "streaming", None).await?;
        if replication == Replication::Sync {
            // The name is hex and a prefix: it needs no quoting beyond the
            // identifier's.
            // Two statements: ALTER SYSTEM refuses a multi-statement string
            // (an implicit transaction block).
            for sql in [
                &format!("ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'"),
                "SELECT pg_reload_conf()",
            ] {
                primary
                    .batch_execute(sql)
                    .await
                    .map_err(Error::pg("naming the synchronous standby on the primary"))?;
            }
            self.wait_replication(&primary, &name, "streaming", Some("sync"))
                .await?;
        }
        Ok(standby)
    }

    /// Waits until `pg_stat_replication` on this (the primary) shows the
    /// standby called `name` in `state`, and `sync_state` if given.
    async fn wait_replication(
        &self,
        primary: &tokio_postgres::Client,
        name: &str,
        state: &str,
        sync_state: Option<&str>,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + TIMEOUT;
        let mut seen = None;
        loop {
            let row = primary
                .query_opt(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                    &[&name],
                )
                .await
                .map_err(Error::pg("reading pg_stat_replication"))?;
            if let Some(row) = row {
                let (s, sync): (String, String) = (row.get(0), row.get(1));
                if s == state && sync_state.is_none_or(|want| want == sync) {
                    return Ok(());
                }
                seen = Some(format!("state {s}, sync_state {sync}"));
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    waiting_for: format!(
                        "the standby {name} to be {state}{} on the primary (port {})",
                        sync_state.map(|s| format!(" and {s}")).unwrap_or_default(),
                        self.port()
                    ),
                    timeout: TIMEOUT,
                    detail: seen.unwrap_or_else(|| "not in pg_stat_replication".to_owned()),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Promotes this standby (`pg_ctl promote`) and returns once it accepts
    /// writes: out of recovery, `transaction_read_only` off. A server that
    /// is not a standby is refused by `pg_ctl`.
    pub async fn promote(&mut self) -> Result<(), Error> {
        let (bin, run_as, data) = self.parts();
        let pg_ctl = bin.dir.join("pg_ctl");
        let mut cmd = tokio::process::Command::new(&pg_ctl);
        cmd.arg("promote")
            .arg("-D")
            .arg(data)
            .args(["-w", "-t", &TIMEOUT.as_secs().to_string()])
            .current_dir(data.parent().unwrap_or(data))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        run_as.apply(&mut cmd);
        let doing = format!("promoting the standby on port {}", self.port());
        let out = cmd.output().await.map_err(Error::io(doing.clone()))?;
        if !out.status.success() {
            return Err(Error::Failed {
                doing,
                detail: format!(
                    "{} exited with {}: {}{}",
                    pg_ctl.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let client = self.connect("postgres").await?;
            let row = client
                .query_one(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')",
                    &[],
                )
                .await
                .map_err(Error::pg("asking whether the promoted server takes writes"))?;
            let (recovering, read_only): (bool, String) = (row.get(0), row.get(1));
            if !recovering && read_only == "off" {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    waiting_for: format!("the standby on port {} to take writes", self.port()),
                    timeout: TIMEOUT,
                    detail: format!("pg_is_in_recovery {recovering}, transaction_read_only {read_only}"),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Appends `lines` to a data directory's `postgresql.auto.conf` (the
/// server's user owns it and may read it; we write it as root or as that
/// same user, and keep the owner).
fn append_auto_conf(data: &std::path::Path, lines: &str) -> Result<(), Error> {
    use std::io::Write;
    let path = data.join("postgresql.auto.conf");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(lines.as_bytes()))
        .map_err(Error::io(format!("writing {}", path.display())))
}
