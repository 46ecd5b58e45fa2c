//! What one relay instance owns and reports, as one value passed down.
//!
//! A [`RelayContext`] is built in [`Relay::new`](crate::Relay::new): the
//! relay's name (as `outbox relays` lists it), its outbox (the `outbox`
//! label of every metric it records), its readiness ([`Health`]), its
//! running totals ([`Counters`]), its routes' state for the console
//! (`route_state::RouteBoard`), where its signals go ([`Signals`]) and
//! its spans' exporter, if tracing is on ([`Tracing`]).
//! The source, the lease task, the breakers and the backlog gauges all
//! take it from the relay instead of reaching for a process global, so two
//! relays in one process never overwrite each other's health, metrics or
//! signals (the way mini-redis passes its `Db` handle down).
//!
//! It owns no connection and no task: cloning it is an `Arc` clone.
//! Aggregating the relays of a process (`/readyz`) is
//! [`health::Registry`](crate::health::Registry)'s job.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::mpsc;

use crate::counters::Counters;
use crate::health::Health;
use crate::route_state::RouteBoard;
use crate::trace::Tracing;

/// See the [module docs](self).
#[derive(Debug, Clone)]
pub struct RelayContext {
    inner: Arc<Inner>,
}

/// Cloned only to make a context that differs in one part: the health,
/// counters and routes stay shared (they are `Arc`s).
#[derive(Debug, Clone)]
struct Inner {
    name: String,
    outbox: String,
    health: Arc<Health>,
    counters: Arc<Counters>,
    routes: Arc<RouteBoard>,
    signals: Signals,
    /// Its spans' exporter; None: tracing is off.
    tracing: Option<Tracing>,
}

impl RelayContext {
    /// The context of a relay named `name` (None: `host:pid`, with a
    /// sequence number from the second relay of a process on) over the
    /// outbox shown as `outbox` (`schema.table`).
    pub(crate) fn new(name: Option<String>, outbox: String, signals: Signals) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: name.unwrap_or_else(default_name),
                outbox,
                health: Arc::default(),
                counters: Arc::default(),
                routes: Arc::default(),
                signals,
                tracing: None,
            }),
        }
    }

    /// The same relay (name, outbox, health, counters), its signals sent
    /// to `signals`.
    pub(crate) fn with_signals(&self, signals: Signals) -> Self {
        Self {
            inner: Arc::new(Inner {
                signals,
                ..(*self.inner).clone()
            }),
        }
    }

    /// The same relay, its batches traced by `tracing`.
    pub(crate) fn with_tracing(&self, tracing: Tracing) -> Self {
        Self {
            inner: Arc::new(Inner {
                tracing: Some(tracing),
                ..(*self.inner).clone()
            }),
        }
    }

    /// Its spans' exporter, if tracing is on: the one check the cycle
    /// makes per batch when it is off.
    pub(crate) fn tracing(&self) -> Option<&Tracing> {
        self.inner.tracing.as_ref()
    }

    /// How this relay shows in `outbox relays` and in its logs.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The outbox it serves (`schema.table`): the `outbox` label of its
    /// metrics.
    pub fn outbox(&self) -> &str {
        &self.inner.outbox
    }

    /// Its readiness, as `/readyz` reports it.
    pub fn health(&self) -> &Arc<Health> {
        &self.inner.health
    }

    /// Its running totals.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.inner.counters
    }

    /// Its routes, as its heartbeat reports them (see `route_state`).
    pub(crate) fn routes(&self) -> &Arc<RouteBoard> {
        &self.inner.routes
    }

    /// Sends `state` where this relay's signals go (see [`Signals`]).
    pub fn signal(&self, state: &str) {
        self.inner.signals.send(state);
    }

    /// Its signal sender, for parts that outlive a borrow of the context.
    pub(crate) fn signals(&self) -> &Signals {
        &self.inner.signals
    }

    /// The label every metric of this relay carries.
    pub(crate) fn label(&self) -> (&'static str, String) {
        ("outbox", self.inner.outbox.clone())
    }
}

/// Where a relay's signals go: `READY=1`, `STATUS=…`, and the `OUTBOX_*`
/// states tests wait on (see `outbox::notify`).
#[derive(Debug, Clone, Default)]
pub enum Signals {
    /// The process's systemd notify socket (`NOTIFY_SOCKET`): what a relay
    /// run by the `outbox` binary uses.
    #[default]
    Process,
    /// A channel, one message per signal: for a process that runs several
    /// relays and tells them apart, and for tests in process.
    Channel(mpsc::UnboundedSender<String>),
}

impl Signals {
    /// A channel and its receiving end.
    pub fn channel() -> (Self, mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self::Channel(tx), rx)
    }

    /// Sends `state`; never fails the caller (a closed channel drops it).
    pub fn send(&self, state: &str) {
        match self {
            Self::Process => outbox::notify::send(state),
            Self::Channel(tx) => {
                let _ = tx.send(state.to_owned());
            }
        }
    }
}

/// `host:pid`, how a relay shows in `outbox relays` unless named; the
/// second relay of a process and later ones get `host:pid/2`, `/3`, … so
/// no two relays of one process share a name.
fn default_name() -> String {
    static RELAYS: AtomicU32 = AtomicU32::new(0);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    let pid = std::process::id();
    match RELAYS.fetch_add(1, Ordering::Relaxed) {
        0 => format!("{host}:{pid}"),
        n => format!("{host}:{pid}/{}", n + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relays_of_one_process_get_distinct_default_names() {
        let a = RelayContext::new(None, "public.outbox".to_owned(), Signals::Process);
        let b = RelayContext::new(None, "tenant.outbox".to_owned(), Signals::Process);
        assert_ne!(a.name(), b.name());
        let (signals, _rx) = Signals::channel();
        assert_eq!(a.with_signals(signals).name(), a.name(), "the same relay");
        let named = RelayContext::new(
            Some("r1".to_owned()),
            "public.outbox".to_owned(),
            Signals::Process,
        );
        assert_eq!(named.name(), "r1");
    }

    #[test]
    fn a_channel_receives_each_signal() {
        let (signals, mut rx) = Signals::channel();
        let ctx = RelayContext::new(None, "public.outbox".to_owned(), signals);
        ctx.signal("READY=1");
        ctx.signal("OUTBOX_BATCH=committed");
        assert_eq!(rx.try_recv().as_deref(), Ok("READY=1"));
        assert_eq!(rx.try_recv().as_deref(), Ok("OUTBOX_BATCH=committed"));
    }
}
