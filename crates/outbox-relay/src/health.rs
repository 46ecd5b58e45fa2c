//! Whether the relay is ready to deliver, as `/readyz` reports it: connected
//! to PostgreSQL (its batch session, which also LISTENs), holding its
//! partition leases (when it takes leases), and every sink's breaker closed.
//!
//! The parts that know a fact report it here as it changes (the source on
//! connect and on a lost connection, the lease task on each tick, each
//! breaker on open and close); a probe only reads. It is one table per
//! relay ([`Health`], in the relay's [`RelayContext`](crate::RelayContext));
//! a process that runs several relays aggregates them in a [`Registry`].
//! It holds no HTTP: the binary serves it.
//!
//! Leases: a relay is unready until its first tick succeeded, and again
//! once its heartbeat ran out while ticks fail (the lease task reports
//! both); the other relays may take its partitions then, so it claims
//! nothing until a tick succeeds.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

/// One relay's readiness table.
#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    relay: Phase,
    /// Per claim loop (`""` for the relay's own, else its lane's label):
    /// what is wrong with its PostgreSQL session, if anything. Lanes have
    /// sessions of their own, so one lane's lost connection is not
    /// another's.
    postgres: BTreeMap<String, Option<String>>,
    /// None when the relay takes no leases (`--ordering none`).
    leases: Option<Leases>,
    /// Per sink label (`redis`, `http route orders`): why it is unavailable.
    sinks: BTreeMap<String, Option<String>>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    #[default]
    Starting,
    Running,
    Stopped,
}

#[derive(Debug, Default, Clone)]
struct Leases {
    /// Until when the heartbeat vouches for this relay; None before the
    /// first tick.
    valid_until: Option<Instant>,
    held: usize,
    count: i32,
    /// The last tick's error, if it failed.
    error: Option<String>,
}

/// The answer to a readiness probe.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Readiness {
    /// Every check passed.
    pub ready: bool,
    /// Each check by name (`relay`, `postgres`, `leases`, `sink <name>`):
    /// `ok`, or what is not ready.
    pub checks: BTreeMap<String, String>,
}

/// The relays of one process, for `/readyz`: ready when every relay is.
#[derive(Debug, Default)]
pub struct Registry {
    relays: Mutex<Vec<(String, Arc<Health>)>>,
}

impl Registry {
    /// Adds the relay serving `outbox` (its [`RelayContext::outbox`](crate::RelayContext::outbox)).
    pub fn register(&self, outbox: &str, health: Arc<Health>) {
        self.relays
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((outbox.to_owned(), health));
    }

    /// Every relay's checks now. With one relay the checks keep their own
    /// names (`postgres`); with several each is prefixed by its outbox
    /// (`public.outbox postgres`). No relay registered is not ready.
    pub fn readiness(&self) -> Readiness {
        let relays = self
            .relays
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let [(_, only)] = relays.as_slice() {
            return only.readiness();
        }
        let mut checks = BTreeMap::new();
        let mut ready = !relays.is_empty();
        for (outbox, health) in relays.iter() {
            let r = health.readiness();
            ready &= r.ready;
            for (name, check) in r.checks {
                checks.insert(format!("{outbox} {name}"), check);
            }
        }
        if relays.is_empty() {
            checks.insert("relay".to_owned(), "no relay".to_owned());
        }
        Readiness { ready, checks }
    }
}

impl Health {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every writer leaves the table consistent, so a panic elsewhere
        // while holding the lock poisons nothing that matters.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The relay is ready (READY=1) or has stopped.
    pub(crate) fn running(&self, running: bool) {
        self.state().relay = if running { Phase::Running } else { Phase::Stopped };
    }

    /// The PostgreSQL session of the claim loop `lane` (`""` for the
    /// relay's own) is up (None) or why not.
    pub(crate) fn postgres(&self, lane: &str, problem: Option<String>) {
        self.state().postgres.insert(lane.to_owned(), problem);
    }

    /// The relay takes leases: not ready until the first tick.
    pub(crate) fn takes_leases(&self) {
        self.state().leases.get_or_insert_with(Leases::default);
    }

    /// A tick succeeded: the heartbeat vouches until `valid_until`.
    pub(crate) fn lease_tick(&self, valid_until: Instant, held: usize, count: i32) {
        self.state().leases = Some(Leases {
            valid_until: Some(valid_until),
            held,
            count,
            error: None,
        });
    }

    /// A tick failed; the lease holds until its heartbeat runs out.
    pub(crate) fn lease_failed(&self, error: String) {
        self.state().leases.get_or_insert_with(Leases::default).error = Some(error);
    }

    /// A sink's breaker: `problem` while open or half-open.
    pub(crate) fn sink(&self, label: String, problem: Option<String>) {
        self.state().sinks.insert(label, problem);
    }

    /// Reads every check now.
    pub fn readiness(&self) -> Readiness {
        let state = self.state();
        let mut checks = BTreeMap::new();
        let ok = || "ok".to_owned();
        checks.insert(
            "relay".to_owned(),
            match state.relay {
                Phase::Starting => "starting".to_owned(),
                Phase::Running => ok(),
                Phase::Stopped => "stopped".to_owned(),
            },
        );
        if state.postgres.is_empty() {
            let check = match state.relay {
                Phase::Starting => "connecting".to_owned(),
                _ => ok(),
            };
            checks.insert("postgres".to_owned(), check);
        }
        for (lane, problem) in &state.postgres {
            let check = match (problem, state.relay) {
                (Some(problem), _) => problem.clone(),
                (None, Phase::Starting) => "connecting".to_owned(),
                (None, _) => ok(),
            };
            let name = if lane.is_empty() {
                "postgres".to_owned()
            } else {
                format!("postgres {lane}")
            };
            checks.insert(name, check);
        }
        if let Some(l) = &state.leases {
            let check = match (l.valid_until, &l.error) {
                (Some(until), _) if until > Instant::now() => ok(),
                (None, None) => "waiting for the first lease tick".to_owned(),
                (None, Some(error)) => format!("no lease tick has succeeded: {error}"),
                (_, Some(error)) => format!("heartbeat expired: {error}"),
                (Some(_), None) => "heartbeat expired".to_owned(),
            };
            let check = if check == "ok" {
                format!("ok: holding {} of {} partitions", l.held, l.count)
            } else {
                check
            };
            checks.insert("leases".to_owned(), check);
        }
        for (label, problem) in &state.sinks {
            let check = problem.as_ref().map_or_else(ok, |p| format!("unavailable: {p}"));
            checks.insert(format!("sink {label}"), check);
        }
        let ready = checks.values().all(|c| c.starts_with("ok"));
        Readiness { ready, checks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_check_is_ok() {
        let h = Health::default();
        assert!(!h.readiness().ready, "starting");
        h.running(true);
        h.postgres("", None);
        h.sink("redis".to_owned(), None);
        assert!(h.readiness().ready, "{:?}", h.readiness());
        h.takes_leases();
        assert_eq!(h.readiness().checks["leases"], "waiting for the first lease tick");
        h.lease_tick(Instant::now() + std::time::Duration::from_secs(5), 3, 16);
        assert_eq!(h.readiness().checks["leases"], "ok: holding 3 of 16 partitions");
        assert!(h.readiness().ready);
        h.sink("redis".to_owned(), Some("connection refused".to_owned()));
        let r = h.readiness();
        assert!(!r.ready);
        assert_eq!(r.checks["sink redis"], "unavailable: connection refused");
        h.sink("redis".to_owned(), None);
        h.postgres("", Some("connection lost: db shut down".to_owned()));
        assert!(!h.readiness().ready);
        h.postgres("", None);
        h.postgres("lane orders", Some("reconnecting: refused".to_owned()));
        assert_eq!(
            h.readiness().checks["postgres lane orders"],
            "reconnecting: refused"
        );
        assert_eq!(h.readiness().checks["postgres"], "ok");
        h.postgres("lane orders", None);
        h.running(false);
        assert_eq!(h.readiness().checks["relay"], "stopped");
    }

    #[test]
    fn a_registry_is_ready_when_every_relay_is() {
        let registry = Registry::default();
        assert!(!registry.readiness().ready, "no relay");
        let (a, b) = (Arc::new(Health::default()), Arc::new(Health::default()));
        registry.register("public.outbox", Arc::clone(&a));
        a.running(true);
        assert_eq!(
            registry.readiness().checks["postgres"],
            "ok",
            "one relay keeps plain names"
        );
        registry.register("tenant.outbox", Arc::clone(&b));
        let r = registry.readiness();
        assert!(!r.ready);
        assert_eq!(r.checks["public.outbox relay"], "ok");
        assert_eq!(r.checks["tenant.outbox relay"], "starting");
        b.running(true);
        assert!(registry.readiness().ready);
    }
}
