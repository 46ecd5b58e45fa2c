//! The soak's processes: the relays (polling and log-tailing) and the
//! inbox consumers, each an `outbox relay` or `outbox consume` child (of
//! the production binary), started, killed, frozen and restarted by the
//! faults, and watched for exits nobody asked for (those are restarted too,
//! and reported). Each connects with an `application_name` of its own
//! (`outbox-soak-<name>`), never the production default `outbox-relay`, so
//! a fault on a shared server finds the soak's backends and no others.

use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::Signal;
use outbox_testkit::Spawned;
use serde::Serialize;
use tokio::sync::Mutex;

use super::names::{self, SCHEMA};
use super::schedule::Src;
use crate::scratch::{outbox_command, with_application_name};

/// How long a child may take to say `READY=1` (a relay waits for
/// PostgreSQL, which may be restarting).
const READY: Duration = Duration::from_secs(90);
/// How long a relay restarted with the failpoint may take to park there.
const PARK: Duration = Duration::from_secs(20);
/// The relays' lease timeout: short, so a split brain and a kill are
/// settled within seconds.
pub(crate) const LEASE_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest payload the relays send; the soak's poison events are
/// larger, so each is a dead letter at once.
pub(crate) const MAX_EVENT_BYTES: &str = "16KiB";

/// The `application_name` the child `name` connects with.
fn application_name(name: &str) -> String {
    format!("outbox-soak-{name}")
}

/// What a child is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    Relay(Src),
    /// An `outbox consume` of one stream; a slow one sleeps 2 ms per event.
    Consumer {
        stream: String,
        slow: bool,
    },
}

/// One child.
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) role: Role,
    pub(crate) child: Option<Spawned>,
}

/// A child that exited without being told to.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Exit {
    pub(crate) at_s: f64,
    pub(crate) name: String,
    pub(crate) status: String,
    /// Its last log lines (warnings and errors).
    pub(crate) last_lines: Vec<String>,
}

/// The run's children.
pub(crate) struct Fleet {
    pg_url: String,
    redis_url: String,
    batch_size: u32,
    started: Instant,
    pub(crate) procs: Vec<Mutex<Proc>>,
    /// Each child's role and name, by index (fixed at birth, readable while
    /// a fault holds the child).
    roles: Vec<Role>,
    names: Vec<String>,
    exits: std::sync::Mutex<Vec<Exit>>,
    /// The children's ERROR lines, the first `ERRORS_KEPT`.
    errors: std::sync::Mutex<Vec<String>>,
}

const ERRORS_KEPT: usize = 200;

impl Fleet {
    /// `relays` polling relays and two log-tailing ones (a reader and a
    /// standby) per source asked for, and the consumers; none started.
    pub(crate) fn new(
        pg_url: String,
        redis_url: String,
        batch_size: u32,
        relays: u32,
        sources: &[Src],
        started: Instant,
    ) -> Self {
        let mut procs = Vec::new();
        for &src in sources {
            let n = match src {
                Src::Poll => relays,
                Src::Wal => 2,
            };
            for i in 0..n {
                procs.push(Proc {
                    name: format!("{}-relay-{i}", src.name()),
                    role: Role::Relay(src),
                    child: None,
                });
            }
            for (i, aggregate_type) in names::TYPES.iter().enumerate() {
                let stream = names::stream(src, aggregate_type);
                // Two consumers share the polled orders: the inbox has to
                // hold while a dead one's pending entries move over.
                let slows: &[bool] = if src == Src::Poll && i == 0 {
                    &[false, true]
                } else {
                    &[i % 2 == 1]
                };
                for (j, &slow) in slows.iter().enumerate() {
                    procs.push(Proc {
                        name: format!("{}-{aggregate_type}-consumer-{j}", src.name()),
                        role: Role::Consumer {
                            stream: stream.clone(),
                            slow,
                        },
                        child: None,
                    });
                }
            }
        }
        Self {
            pg_url,
            redis_url,
            batch_size,
            started,
            roles: procs.iter().map(|p| p.role.clone()).collect(),
            names: procs.iter().map(|p| p.name.clone()).collect(),
            procs: procs.into_iter().map(Mutex::new).collect(),
            exits: std::sync::Mutex::new(Vec::new()),
            errors: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Starts every child, relays first.
    pub(crate) async fn start_all(&self) -> anyhow::Result<()> {
        for p in &self.procs {
            let mut p = p.lock().await;
            self.start(&mut p, None).await?;
        }
        Ok(())
    }

    /// The indexes of the relays (of `src`, or all).
    pub(crate) fn relays(&self, src: Option<Src>) -> Vec<usize> {
        self.roles
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r, Role::Relay(s) if src.is_none_or(|want| want == *s)))
            .map(|(i, _)| i)
            .collect()
    }

    /// The `application_name` of the relays' connections: their batch
    /// sessions and WAL streams (the lease, turn and watch connections name
    /// themselves `outbox-relay …`, as in production).
    pub(crate) fn relay_application_names(&self) -> Vec<String> {
        self.relays(None)
            .into_iter()
            .map(|i| application_name(&self.names[i]))
            .collect()
    }

    /// The indexes of the consumers.
    pub(crate) fn consumers(&self) -> Vec<usize> {
        self.roles
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r, Role::Consumer { .. }))
            .map(|(i, _)| i)
            .collect()
    }

    /// Starts `p` (with `OUTBOX_FAILPOINT=failpoint` if given) and waits
    /// for its `READY=1`.
    pub(crate) async fn start(&self, p: &mut Proc, failpoint: Option<&str>) -> anyhow::Result<()> {
        let mut cmd = outbox_command(&with_application_name(&self.pg_url, &application_name(&p.name)))?;
        match &p.role {
            Role::Relay(src) => {
                cmd.args(["relay", "--sink", &self.redis_url, "--log-format", "json"])
                    .args(["--schema", SCHEMA, "--table", names::table(*src)])
                    .args(["--channel", names::channel(*src)])
                    .args(["--stream-prefix", &names::prefix(*src)])
                    .args(["--relay-name", &p.name])
                    .args(["--batch-size", &self.batch_size.to_string()])
                    .args(["--max-event-bytes", MAX_EVENT_BYTES])
                    .args(["--lease-timeout", &format!("{}s", LEASE_TIMEOUT.as_secs())])
                    .args(["--http-timeout", "2s", "--backoff-max", "2s"]);
                match src {
                    Src::Poll => cmd
                        .args(["--ordering", "partition", "--ordering-for"])
                        .arg(format!("{}=strict", names::TYPES[1])),
                    Src::Wal => cmd.args(["--source", "wal"]),
                };
            }
            Role::Consumer { stream, slow } => {
                let apply = if *slow {
                    format!(
                        "INSERT INTO {SCHEMA}.effects (event_id, stream) SELECT $1, '{stream}' FROM pg_sleep(0.002)"
                    )
                } else {
                    format!("INSERT INTO {SCHEMA}.effects (event_id, stream) VALUES ($1, '{stream}')")
                };
                cmd.args(["consume", "--from", &self.redis_url, "--stream", stream])
                    .args(["--group", "soak", "--consumer", &p.name, "--apply", &apply])
                    .args(["--inbox-schema", SCHEMA, "--inbox-table", "processed_events"])
                    .args(["--claim-idle", "5s", "--log-format", "json"]);
            }
        }
        // Warnings and errors only: a child lives for the whole run and
        // its lines are kept in memory.
        cmd.env("RUST_LOG", "warn");
        if let Some(f) = failpoint {
            cmd.env("OUTBOX_FAILPOINT", f);
        }
        let child = Spawned::spawn_notified(cmd)?;
        child
            .wait_for_notification("READY=1", READY)
            .await
            .with_context(|| format!("starting {}", p.name))?;
        p.child = Some(child);
        Ok(())
    }

    /// SIGKILLs `p`'s child and reaps it.
    pub(crate) async fn kill(&self, p: &mut Proc) -> anyhow::Result<()> {
        if let Some(mut child) = p.child.take() {
            child.kill()?;
            let _ = child.wait(READY).await;
            self.harvest(&p.name, &child);
        }
        Ok(())
    }

    /// Stops `p`'s child with SIGTERM (it finishes its batch and exits),
    /// SIGKILL after 30 s.
    pub(crate) async fn stop(&self, p: &mut Proc) -> anyhow::Result<()> {
        if let Some(mut child) = p.child.take() {
            if child.signal(Signal::SIGTERM).is_ok() {
                let _ = child.wait(Duration::from_secs(30)).await;
            }
            self.harvest(&p.name, &child);
        }
        Ok(())
    }

    /// Stops `p` cleanly and starts it again with the `pause-after-deliver`
    /// failpoint; returns whether it parked there (after the sink acknowledged
    /// rows of a batch, before marking them) within `PARK`. Either way it is killed
    /// there (or wherever it is) and started plain: what it re-sends is one
    /// process's in flight.
    pub(crate) async fn kill_after_ack(&self, p: &mut Proc) -> anyhow::Result<bool> {
        self.stop(p).await?;
        self.start(p, Some("pause-after-deliver")).await?;
        let parked = match &p.child {
            Some(child) => child
                .wait_for_notification("OUTBOX_FAILPOINT=pause-after-deliver reached", PARK)
                .await
                .is_ok(),
            None => false,
        };
        self.kill(p).await?;
        self.start(p, None).await?;
        Ok(parked)
    }

    /// Sends `sig` to `p`'s child.
    pub(crate) fn signal(&self, p: &Proc, sig: Signal) -> anyhow::Result<()> {
        if let Some(child) = &p.child {
            child.signal(sig)?;
        }
        Ok(())
    }

    /// Restarts every child that exited by itself, recording why. Children
    /// a fault holds are left to it.
    pub(crate) async fn supervise(&self) -> anyhow::Result<()> {
        for p in &self.procs {
            let Ok(mut p) = p.try_lock() else { continue };
            self.restart_if_exited(&mut p).await?;
        }
        Ok(())
    }

    /// [`Fleet::supervise`] for one child, waiting for the lock.
    pub(crate) async fn restart_if_exited(&self, p: &mut Proc) -> anyhow::Result<()> {
        match p.child.as_ref().map(Spawned::exit_status) {
            // Running.
            Some(None) => return Ok(()),
            Some(Some(status)) => {
                let lines = p.child.as_ref().map(Spawned::lines).unwrap_or_default();
                if let Some(child) = &p.child {
                    self.harvest(&p.name, child);
                }
                let last_lines = lines[lines.len().saturating_sub(5)..].to_vec();
                tracing::warn!(name = %p.name, %status, "a soak child exited by itself; restarting it");
                self.exits
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(Exit {
                        at_s: self.started.elapsed().as_secs_f64(),
                        name: p.name.clone(),
                        status: status.to_string(),
                        last_lines,
                    });
                p.child = None;
            }
            // A start that failed (not ready in time): try again.
            None => {}
        }
        self.start(p, None).await
    }

    /// Keeps `child`'s ERROR lines, up to `ERRORS_KEPT` in all.
    fn harvest(&self, name: &str, child: &Spawned) {
        let mut errors = self
            .errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for line in child.lines() {
            if errors.len() >= ERRORS_KEPT {
                break;
            }
            if line.contains("\"level\":\"ERROR\"") {
                errors.push(format!("{name}: {line}"));
            }
        }
    }

    /// The children's ERROR lines so far.
    pub(crate) fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The exits nobody asked for, so far.
    pub(crate) fn exits(&self) -> Vec<Exit> {
        self.exits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Makes sure every child runs (none frozen: a SIGCONT to each), for
    /// the drain.
    pub(crate) async fn all_running(&self) -> anyhow::Result<()> {
        for p in &self.procs {
            let mut p = p.lock().await;
            if p.child.is_some() {
                let _ = self.signal(&p, Signal::SIGCONT);
            }
            self.restart_if_exited(&mut p).await?;
        }
        Ok(())
    }

    /// Stops every child (SIGTERM, then SIGKILL after 30 s).
    pub(crate) async fn stop_all(&self) {
        for p in &self.procs {
            let mut p = p.lock().await;
            let _ = self.stop(&mut p).await;
        }
    }

    /// Stops the relays, leaving the consumers running.
    pub(crate) async fn stop_relays(&self) {
        for i in self.relays(None) {
            let mut p = self.procs[i].lock().await;
            let _ = self.stop(&mut p).await;
        }
    }
}
