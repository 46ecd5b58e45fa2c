//! What a stretch of work cost PostgreSQL: CPU time of the server's
//! processes and WAL bytes written, read before and after.
//!
//! CPU is read from `/proc`: the postmaster's own time plus the time of the
//! children it reaped (`cutime`, `cstime`), plus each live (or not yet
//! reaped) child's. That counts every backend, the WAL sender decoding for
//! `--source wal`, autovacuum and the background writers, including those
//! that exited in between. It needs the server on this host, in this PID
//! namespace: the harness's backend pid must be a `postgres` process here;
//! otherwise CPU is `None` and only WAL bytes are reported.
//!
//! WAL is the difference of `pg_current_wal_insert_lsn()`: everything the
//! cluster wrote, so other databases' writes count too (the throwaway
//! cluster has none).

use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use tokio_postgres::Client;

/// Clock ticks per second of `/proc/<pid>/stat`'s times: the kernel
/// exports them in `USER_HZ`, which is 100 on every architecture Linux
/// exposes `/proc` times for (unlike the kernel's own `HZ`).
const USER_HZ: f64 = 100.0;

/// Attempts at a snapshot in which no child was reaped midway.
const SNAPSHOT_ATTEMPTS: usize = 10;

/// Readings taken at the start of the measured work.
pub(crate) struct Meter {
    postmaster: Option<u32>,
    ticks: Option<u64>,
    lsn: u64,
}

/// What the work between [`Meter::start`] and [`Meter::stop`] cost.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Cost {
    /// CPU seconds of all the cluster's processes; `None` when the server
    /// is not on this host.
    pub(crate) pg_cpu_seconds: Option<f64>,
    /// WAL bytes written.
    pub(crate) wal_bytes: u64,
}

impl Cost {
    /// PostgreSQL CPU milliseconds per 1,000 of `events`.
    pub(crate) fn cpu_ms_per_1000(&self, events: u64) -> Option<f64> {
        self.pg_cpu_seconds
            .map(|s| s * 1_000_000.0 / events.max(1) as f64)
    }

    /// WAL bytes per one of `events`.
    pub(crate) fn wal_bytes_per_event(&self, events: u64) -> f64 {
        self.wal_bytes as f64 / events.max(1) as f64
    }
}

impl Meter {
    /// Takes the first readings through `db`.
    pub(crate) async fn start(db: &Client) -> anyhow::Result<Self> {
        let postmaster = postmaster(db).await?;
        Ok(Self {
            postmaster,
            ticks: postmaster.and_then(cluster_ticks),
            lsn: insert_lsn(db).await?,
        })
    }

    /// Takes the second readings and returns the difference.
    pub(crate) async fn stop(self, db: &Client) -> anyhow::Result<Cost> {
        let lsn = insert_lsn(db).await?;
        let ticks = self.postmaster.and_then(cluster_ticks);
        let pg_cpu_seconds = match (self.ticks, ticks) {
            (Some(before), Some(after)) => Some(after.saturating_sub(before) as f64 / USER_HZ),
            _ => None,
        };
        Ok(Cost {
            pg_cpu_seconds,
            wal_bytes: lsn.saturating_sub(self.lsn),
        })
    }
}

/// The WAL insert position, as a byte offset.
async fn insert_lsn(db: &Client) -> anyhow::Result<u64> {
    let row = db
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .context("reading the WAL insert position")?;
    parse_lsn(row.get(0))
}

/// `16/B374D848` as a byte offset.
pub(crate) fn parse_lsn(lsn: &str) -> anyhow::Result<u64> {
    let (hi, lo) = lsn
        .split_once('/')
        .with_context(|| format!("not an LSN: {lsn:?}"))?;
    let hi = u64::from_str_radix(hi, 16).with_context(|| format!("not an LSN: {lsn:?}"))?;
    let lo = u64::from_str_radix(lo, 16).with_context(|| format!("not an LSN: {lsn:?}"))?;
    Ok(hi << 32 | lo)
}

/// The postmaster's pid, if the harness's backend runs on this host: its
/// parent, both `postgres` processes.
async fn postmaster(db: &Client) -> anyhow::Result<Option<u32>> {
    let backend: i32 = db
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .context("reading the backend's pid")?
        .get(0);
    let Ok(backend) = u32::try_from(backend) else {
        return Ok(None);
    };
    let is_postgres =
        |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres");
    if !is_postgres(backend) {
        return Ok(None);
    }
    Ok(read_stat(Path::new(&format!("/proc/{backend}/stat")))
        .map(|s| s.ppid)
        .filter(|&pid| is_postgres(pid)))
}

/// CPU seconds process `pid` has used so far (its own, not its
/// children's); None once it is gone.
pub(crate) fn process_cpu_seconds(pid: u32) -> Option<f64> {
    read_stat(Path::new(&format!("/proc/{pid}/stat"))).map(|s| s.own as f64 / USER_HZ)
}

/// The fields of `/proc/<pid>/stat` used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    ppid: u32,
    /// `utime + stime`.
    own: u64,
    /// `cutime + cstime`: reaped children.
    children: u64,
}

fn read_stat(path: &Path) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(path).ok()?)
}

/// Parses a `stat` line; the command name (field 2) may hold spaces and
/// parentheses, so fields are counted from its last `)`.
fn parse_stat(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): ppid is field 4, utime..cstime 14..17.
    let num = |i: usize| f.get(i)?.parse::<u64>().ok();
    Some(Stat {
        ppid: u32::try_from(num(1)?).ok()?,
        own: num(11)? + num(12)?,
        children: num(13)? + num(14)?,
    })
}

/// CPU ticks of the postmaster and all its children, live or reaped. A
/// child reaped between reading the postmaster and listing the children
/// would be missed, so the snapshot is retried until the postmaster's
/// reaped total did not move across it.
fn cluster_ticks(postmaster: u32) -> Option<u64> {
    let path = format!("/proc/{postmaster}/stat");
    for _ in 0..SNAPSHOT_ATTEMPTS {
        let before = read_stat(Path::new(&path))?;
        let children: u64 = std::fs::read_dir("/proc")
            .ok()?
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter_map(|e| read_stat(&e.path().join("stat")))
            .filter(|s| s.ppid == postmaster)
            .map(|s| s.own)
            .sum();
        let after = read_stat(Path::new(&path))?;
        if after.children == before.children {
            return Some(after.own + after.children + children);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{Stat, parse_lsn, parse_stat};

    #[test]
    fn lsn_as_bytes() {
        assert_eq!(parse_lsn("0/10").unwrap(), 16);
        assert_eq!(parse_lsn("16/B374D848").unwrap(), (0x16 << 32) + 0xB374_D848);
        assert!(parse_lsn("16B374D848").is_err());
    }

    #[test]
    fn stat_fields_after_the_command_name() {
        let line = "4242 (postgres: a) b) S 17 4242 4242 0 -1 4194560 520 0 0 0 7 3 11 5 20 0 1 0 \
                    100 220000000 3000 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                ppid: 17,
                own: 10,
                children: 16
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }
}
