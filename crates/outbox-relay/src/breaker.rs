//! Circuit breakers: while a sink is unavailable the relay spends no
//! attempt on it and probes it with backoff instead of sending events.
//!
//! A batch every answer of which is [`DeliveryError::Unavailable`] (or
//! not sent because of one) opens the breaker: the sink, not the events,
//! failed. Open, the sink is [`Sink::probe`]d at 100 ms, doubling to 1 s
//! (a [`Doubling`], jittered down), so delivery resumes within one probe
//! interval of the sink's return. A
//! probe that succeeds half-opens it: the next batch decides, closing it if
//! anything was delivered and opening it again (the backoff carried on) if
//! the sink is still unavailable.
//!
//! The log says what an operator acts on: one warning when the breaker
//! opens (with the cause) and one line when it closes after delivering
//! again (`sink available again`, with how long it was down), once per
//! outage whatever happens in between. Probes, half-opening, a half-open
//! batch failing again, and a new cause while open are debug lines: while a
//! sink stays down they would repeat at every probe interval. The gauges
//! (`outbox_sink_up`, `outbox_sink_circuit_state`, labelled with the real
//! sink and its `route`) and the readiness check (`crate::health`, with
//! the current cause) follow every change.
//!
//! A sink that answers its probe and then fails every batch as unavailable,
//! [`STRIKES`] times in a row, is not simply down: most likely one event at
//! the head of the queue breaks the connection (a receiver that crashes on
//! its payload). That batch's answers then count as attempts, so such an
//! event becomes a dead letter instead of being retried for ever.
//!
//! An unavailable answer or probe that carries a `Retry-After` (an HTTP
//! 503 or 429) puts the next probe no earlier than it asks, up to
//! [`MAX_RETRY_AFTER`]: a receiver that said when to come back is not
//! probed every second meanwhile.
//!
//! Two users: the relay holds one for its sink and, while it is open,
//! claims nothing (`relay.rs`); the [`Router`] holds one per route and,
//! while a route's is open, answers its rows unavailable without calling
//! its sink, so only that route waits. The relay's breaker over a router
//! ([`Breaker::over_routes`]) only decides when to stop claiming: it logs
//! and reports nothing, since the routes' breakers speak for their sinks.
//!
//! [`Router`]: crate::sink::router::Router

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Doubling;
use crate::context::RelayContext;
use crate::metric::BreakerGauges;
use crate::route_state::RouteStatus;
use crate::sink::{DEFAULT_ROUTE, Delivery, DeliveryError, Sink};

/// The first probe interval after the breaker opens.
const FIRST_PROBE: Duration = Duration::from_millis(100);

/// The longest probe interval: delivery resumes at most this long after
/// the sink is back (plus the probe's own round trip).
pub(crate) const MAX_PROBE: Duration = Duration::from_secs(1);

/// The longest `Retry-After` a breaker waits for before its next probe, so
/// a receiver answering `Retry-After: 86400` by mistake is still probed
/// every five minutes (`--backoff-max`'s default, the longest a row waits).
pub(crate) const MAX_RETRY_AFTER: Duration = crate::defaults::BACKOFF_MAX;

/// Batches failed as unavailable right after a successful probe, in a row,
/// before their answers count as attempts.
pub(crate) const STRIKES: u32 = 3;

/// A breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CircuitState {
    /// Delivering.
    Closed,
    /// The sink is unavailable: nothing is sent, the sink is probed.
    Open,
    /// A probe succeeded: the next batch decides.
    HalfOpen,
}

impl fmt::Display for CircuitState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half-open",
        })
    }
}

/// One sink's breaker.
#[derive(Debug)]
pub(crate) struct Breaker {
    /// The sink, for logs and labels.
    sink: &'static str,
    /// A router's route name, for logs and labels; None for a sink alone
    /// (its metrics' route is [`DEFAULT_ROUTE`]).
    route: Option<String>,
    state: CircuitState,
    /// Since when and why the sink has been unavailable (set while open or
    /// half-open).
    down: Option<(Instant, String)>,
    /// The probe intervals.
    interval: Doubling,
    /// No probe before this (the sink's last `Retry-After`).
    not_before: Option<Instant>,
    /// Batches in a row found unavailable while half-open.
    strikes: u32,
    /// Whether strikes count (see [`Breaker::without_strikes`]).
    striking: bool,
    /// Whether it logs (see [`Breaker::over_routes`]).
    speaks: bool,
    /// Where its state is reported, once bound to a relay
    /// ([`Breaker::bind`]); unbound, it only logs.
    reporter: Option<(RelayContext, BreakerGauges)>,
    /// Its route's state for the console, once bound to a relay that
    /// publishes it (see `route_state`).
    status: Option<Arc<RouteStatus>>,
}

/// How [`Breaker::wait`] ended.
pub(crate) enum Probed {
    /// The sink answered its probe: half-open, deliver again.
    Available,
    /// Shutdown was requested.
    Cancelled,
}

/// Whether every answer of a batch says the sink is unavailable: why, and
/// the longest `Retry-After` among them.
fn unavailable(answers: &[Delivery]) -> Option<(&str, Option<Duration>)> {
    // Rows the sink did not try (behind an unavailable one of their
    // aggregate) say nothing either way.
    let all = answers.iter().all(|a| {
        matches!(
            a,
            Err(DeliveryError::Unavailable { .. } | DeliveryError::NotSent { .. })
        )
    });
    if !all {
        return None;
    }
    let retry_after = answers
        .iter()
        .filter_map(|a| a.as_ref().err().and_then(DeliveryError::retry_after))
        .max();
    answers.iter().find_map(|a| match a {
        Err(DeliveryError::Unavailable { message, .. }) => Some((message.as_str(), retry_after)),
        _ => None,
    })
}

impl Breaker {
    /// A closed breaker for `sink` (and, in a router, its route named
    /// `route`).
    pub(crate) fn new(sink: &'static str, route: Option<String>) -> Self {
        Self {
            sink,
            route,
            state: CircuitState::Closed,
            down: None,
            interval: Doubling::new(FIRST_PROBE, MAX_PROBE),
            not_before: None,
            strikes: 0,
            striking: true,
            speaks: true,
            reporter: None,
            status: None,
        }
    }

    /// Reports to `ctx` from now on: the relay's health, its gauges (with
    /// its `outbox` label) and its signals. A router's breakers are built
    /// with the router, before any relay, and bound when the relay starts.
    pub(crate) fn bind(&mut self, ctx: &RelayContext) {
        let route = self.route.as_deref().unwrap_or(DEFAULT_ROUTE);
        let gauges = BreakerGauges::new(ctx, self.sink, route);
        self.reporter = Some((ctx.clone(), gauges));
        self.status = ctx.routes().get(route);
        self.report();
    }

    /// The gauges and the readiness check, after a change of state.
    fn report(&self) {
        let Some((ctx, gauges)) = &self.reporter else {
            return;
        };
        gauges.set(match self.state {
            CircuitState::Closed => 0,
            CircuitState::Open => 1,
            CircuitState::HalfOpen => 2,
        });
        let problem = self.down.as_ref().map(|(_, cause)| cause.clone());
        ctx.health().sink(self.label(), problem);
        if let Some(status) = &self.status {
            status.breaker(
                self.state,
                self.down.as_ref().map(|(at, cause)| (*at, cause.as_str())),
            );
        }
    }

    /// A `STATUS=` line to the bound relay's signals.
    fn signal(&self, state: &str) {
        if let Some((ctx, _)) = &self.reporter {
            ctx.signal(state);
        }
    }

    /// A breaker that never turns unavailable answers into attempts: for a
    /// sink whose routes keep breakers of their own (the [`Router`]), whose
    /// unavailable answers may be a route's breaker speaking rather than a
    /// failed call; each route's breaker counts its own strikes.
    pub(crate) fn without_strikes(mut self) -> Self {
        self.striking = false;
        self
    }

    /// The breaker of a sink made of routes (the [`Router`]), each with a
    /// breaker of its own: without strikes, and silent. Its sink is no
    /// sink an operator knows; the routes' breakers log, signal and report
    /// (leave it unbound).
    pub(crate) fn over_routes(self) -> Self {
        Self {
            speaks: false,
            ..self.without_strikes()
        }
    }

    pub(crate) fn state(&self) -> CircuitState {
        self.state
    }

    /// Why the sink is unavailable, while open or half-open.
    pub(crate) fn cause(&self) -> Option<&str> {
        self.down.as_ref().map(|(_, cause)| cause.as_str())
    }

    /// Records a batch's answers; true if the breaker is open after them.
    /// After [`STRIKES`] half-open batches in a row that were all
    /// unavailable, turns their unavailable answers into retryable failures
    /// (an attempt each).
    pub(crate) fn record(&mut self, answers: &mut [Delivery]) -> bool {
        match unavailable(answers).map(|(cause, after)| (cause.to_owned(), after)) {
            Some((cause, retry_after)) => {
                if self.striking && self.state == CircuitState::HalfOpen {
                    self.strikes += 1;
                }
                if self.strikes >= STRIKES {
                    warn!(
                        sink = self.sink,
                        route = self.route.as_deref(),
                        error = %cause,
                        strikes = self.strikes,
                        "the sink answers its probe but fails every batch; counting this batch's failures as attempts"
                    );
                    self.strikes = 0;
                    for answer in answers.iter_mut() {
                        if let Err(DeliveryError::Unavailable { message, retry_after }) = answer {
                            *answer = Err(DeliveryError::Retryable {
                                message: format!(
                                    "{message} (the sink answers its probe but failed {STRIKES} batches in a row)"
                                ),
                                retry_after: *retry_after,
                            });
                        }
                    }
                }
                self.open(&cause);
                self.wait_at_least(retry_after);
                true
            }
            None => {
                if answers.iter().any(Result::is_ok) {
                    self.close();
                }
                false
            }
        }
    }

    /// The sink failed its probe or a batch: open. Logged when it was
    /// closed; a new cause while down is a debug line (and the readiness
    /// check's new text).
    pub(crate) fn open(&mut self, cause: &str) {
        match (&mut self.down, self.state) {
            (Some((_, last)), CircuitState::Open | CircuitState::HalfOpen) => {
                if last != cause {
                    if self.speaks {
                        debug!(sink = self.sink, route = self.route.as_deref(), error = %cause, "sink still unavailable");
                    }
                    cause.clone_into(last);
                    self.state = CircuitState::Open;
                    self.report();
                }
            }
            _ => {
                if self.speaks {
                    warn!(
                        sink = self.sink,
                        route = self.route.as_deref(),
                        error = %cause,
                        "sink unavailable; sending it nothing until a probe succeeds (no attempts are spent)"
                    );
                }
                self.signal(&format!("STATUS=sink {} unavailable", self.label()));
                self.down = Some((Instant::now(), cause.to_owned()));
                self.interval.reset();
                self.state = CircuitState::Open;
                self.report();
            }
        }
        if self.state != CircuitState::Open {
            self.state = CircuitState::Open;
            self.report();
        }
    }

    /// The sink failed its probe or a batch with this answer: open, and
    /// no probe before its `Retry-After`.
    pub(crate) fn open_after(&mut self, error: &DeliveryError) {
        self.open(&error.to_string());
        self.wait_at_least(error.retry_after());
    }

    /// No probe sooner than `retry_after` from now (at most
    /// [`MAX_RETRY_AFTER`]).
    fn wait_at_least(&mut self, retry_after: Option<Duration>) {
        if let Some(after) = retry_after {
            self.not_before = Some(Instant::now() + after.min(MAX_RETRY_AFTER));
        }
    }

    /// How long to wait before the next probe; backs off, and waits out the
    /// sink's last `Retry-After`.
    pub(crate) fn next_probe(&mut self) -> Duration {
        let wait = self.interval.next_delay();
        match self.not_before.take() {
            Some(at) => wait.max(at.saturating_duration_since(Instant::now())),
            None => wait,
        }
    }

    /// A probe succeeded: half-open. Not worth a line: while the sink
    /// answers probes and fails batches this would repeat at every probe
    /// interval; closing is.
    pub(crate) fn half_open(&mut self) {
        if self.state == CircuitState::Open {
            if self.speaks {
                debug!(
                    sink = self.sink,
                    route = self.route.as_deref(),
                    "sink answered its probe; trying a batch"
                );
            }
            self.state = CircuitState::HalfOpen;
            self.report();
        }
    }

    /// A delivery went through: closed again.
    fn close(&mut self) {
        let was = self.state;
        self.state = CircuitState::Closed;
        self.strikes = 0;
        self.not_before = None;
        let down = self.down.take();
        if was != CircuitState::Closed || down.is_some() {
            self.report();
        }
        if let Some((since, _)) = down
            && self.speaks
        {
            info!(
                sink = self.sink,
                route = self.route.as_deref(),
                seconds = since.elapsed().as_secs_f64(),
                "sink available again"
            );
            self.signal(&format!("STATUS=sink {} available", self.label()));
        }
    }

    /// While open: probes `sink` with backoff until it answers (half-open)
    /// or `cancel` fires.
    pub(crate) async fn wait(&mut self, sink: &dyn Sink, cancel: &CancellationToken) -> Probed {
        while self.state == CircuitState::Open {
            // Both futures are cancel-safe: a dropped probe sends nothing.
            tokio::select! {
                () = tokio::time::sleep(self.next_probe()) => {}
                () = cancel.cancelled() => return Probed::Cancelled,
            }
            let probe = tokio::select! {
                probe = sink.probe() => probe,
                () = cancel.cancelled() => return Probed::Cancelled,
            };
            match probe {
                Ok(()) => self.half_open(),
                Err(error) => self.open_after(&error),
            }
        }
        Probed::Available
    }

    /// `sink` or `sink route`, as the notify status names it.
    fn label(&self) -> String {
        match &self.route {
            Some(route) => format!("{} route {route}", self.sink),
            None => self.sink.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> Delivery {
        Err(DeliveryError::unavailable("connection refused"))
    }

    #[test]
    fn a_batch_all_unavailable_opens_and_a_delivery_closes() {
        let mut b = Breaker::new("redis", None);
        assert!(!b.record(&mut [Ok(()), down()]), "a mixed batch does not open it");
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.record(&mut [down(), down()]));
        assert_eq!(b.state(), CircuitState::Open);
        assert_eq!(b.cause(), Some("connection refused"));
        b.half_open();
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert!(b.record(&mut [down()]), "half-open, unavailable again: open");
        b.half_open();
        assert!(!b.record(&mut [Ok(())]));
        assert_eq!(b.state(), CircuitState::Closed);
        assert_eq!(b.cause(), None);
    }

    #[test]
    fn rows_not_sent_say_nothing_and_a_permanent_failure_does_not_open_it() {
        let mut b = Breaker::new("http", None);
        let not_sent = Err(DeliveryError::NotSent {
            message: "behind".into(),
        });
        assert!(b.record(&mut [down(), not_sent.clone()]));
        let mut b = Breaker::new("http", None);
        assert!(
            !b.record(&mut [not_sent]),
            "nothing unavailable: nothing to open for"
        );
        assert!(!b.record(&mut [Err(DeliveryError::permanent("413"))]));
        assert_eq!(b.state(), CircuitState::Closed);
    }

    #[test]
    fn probes_back_off_to_one_second_and_restart_after_closing() {
        let mut b = Breaker::new("nats", None);
        b.open("no responders");
        let nominal = [100, 200, 400, 800, 1000, 1000].map(Duration::from_millis);
        for n in nominal {
            let wait = b.next_probe();
            assert!(wait <= n && wait >= n.mul_f64(0.8), "{wait:?}, nominal {n:?}");
        }
        b.half_open();
        b.record(&mut [Ok(())]);
        b.open("no responders");
        assert!(b.next_probe() <= FIRST_PROBE, "back to the first interval");
    }

    #[test]
    fn retry_after_puts_off_the_next_probe_up_to_a_cap() {
        let mut b = Breaker::new("http", None);
        let mut answers = [Err(DeliveryError::Unavailable {
            message: "HTTP 503 Service Unavailable".into(),
            retry_after: Some(Duration::from_secs(30)),
        })];
        assert!(b.record(&mut answers));
        let wait = b.next_probe();
        assert!(
            wait > Duration::from_secs(29) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        assert!(b.next_probe() <= Duration::from_millis(200), "only the next one");
        b.open_after(&DeliveryError::Unavailable {
            message: "HTTP 429 Too Many Requests (probe)".into(),
            retry_after: Some(Duration::from_secs(86_400)),
        });
        let wait = b.next_probe();
        assert!(
            wait <= MAX_RETRY_AFTER && wait > MAX_RETRY_AFTER - Duration::from_secs(1),
            "capped: {wait:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn wait_probes_until_the_sink_answers() {
        use std::sync::atomic::{AtomicUsize, Ordering};

        use futures::future::BoxFuture;

        /// Unavailable for its first three probes.
        struct Flaky(AtomicUsize);
        impl Sink for Flaky {
            fn name(&self) -> &'static str {
                "flaky"
            }
            fn deliver<'a>(&'a self, batch: &'a [outbox::OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
                Box::pin(async move { batch.iter().map(|_| Ok(())).collect() })
            }
            fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
                let n = self.0.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    if n < 3 {
                        Err(DeliveryError::unavailable("refused"))
                    } else {
                        Ok(())
                    }
                })
            }
        }
        let sink = Flaky(AtomicUsize::new(0));
        let mut b = Breaker::new("flaky", None);
        b.open("refused");
        let started = tokio::time::Instant::now();
        assert!(matches!(
            b.wait(&sink, &CancellationToken::new()).await,
            Probed::Available
        ));
        assert_eq!(
            sink.0.load(Ordering::SeqCst),
            4,
            "3 failed probes, then one answered"
        );
        // Jitter takes up to a fifth off each wait, never adds.
        let nominal = Duration::from_millis(100 + 200 + 400 + 800);
        let elapsed = started.elapsed();
        assert!(
            elapsed <= nominal && elapsed >= nominal.mul_f64(0.8),
            "{elapsed:?}"
        );
        assert_eq!(b.state(), CircuitState::HalfOpen);
    }

    #[test]
    fn a_sink_that_answers_probes_but_fails_every_batch_costs_attempts_after_three() {
        let mut b = Breaker::new("http", None);
        assert!(b.record(&mut [down()]));
        for strike in 1..STRIKES {
            b.half_open();
            let mut answers = [down()];
            assert!(b.record(&mut answers));
            assert!(
                answers[0].as_ref().is_err_and(DeliveryError::is_unavailable),
                "strike {strike}"
            );
        }
        b.half_open();
        let mut answers = [
            down(),
            Err(DeliveryError::NotSent {
                message: "behind".into(),
            }),
        ];
        assert!(b.record(&mut answers), "still open");
        assert!(
            matches!(&answers[0], Err(DeliveryError::Retryable { message, .. }) if message.contains("failed 3 batches in a row")),
            "{answers:?}"
        );
        assert!(
            matches!(answers[1], Err(DeliveryError::NotSent { .. })),
            "rows not sent stay so"
        );
        // Without strikes (a router's own breaker speaks for its routes).
        let mut b = Breaker::new("router", None).without_strikes();
        for _ in 0..=STRIKES {
            b.half_open();
            let mut answers = [down()];
            assert!(b.record(&mut answers));
            assert!(answers[0].as_ref().is_err_and(DeliveryError::is_unavailable));
        }
        // A plain outage (probes failing, never half-open) never strikes.
        let mut b = Breaker::new("redis", None);
        for _ in 0..10 {
            let mut answers = [down()];
            assert!(b.record(&mut answers));
            assert!(answers[0].as_ref().is_err_and(DeliveryError::is_unavailable));
        }
    }

    /// The lines at info level and above that `f` logs, as text.
    fn logged(f: impl FnOnce()) -> Vec<String> {
        use std::sync::{Arc, Mutex};

        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .without_time()
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    /// A route's sink down for a while: probes failing (for one cause,
    /// then another), probes answering and batches failing again, then a
    /// delivery. One line when it opened, one when it closed, nothing in
    /// between.
    #[test]
    fn an_outage_logs_one_line_when_it_opens_and_one_when_it_closes() {
        let outage = |b: &mut Breaker| {
            assert!(b.record(&mut [down()]));
            for _ in 0..10 {
                b.open("connection refused");
            }
            b.open("connection reset by peer");
            for _ in 0..STRIKES - 1 {
                b.half_open();
                assert!(b.record(&mut [down()]), "half-open, unavailable again: open");
            }
            b.half_open();
            assert!(!b.record(&mut [Ok(())]));
            assert_eq!(b.state(), CircuitState::Closed);
        };
        let lines = logged(|| outage(&mut Breaker::new("redis", Some("orders".to_owned()))));
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(
            lines[0].contains("WARN")
                && lines[0].contains("sink unavailable")
                && lines[0].contains("error=connection refused"),
            "{lines:#?}"
        );
        assert!(
            lines[0].contains("sink=\"redis\"") && lines[0].contains("route=\"orders\""),
            "{lines:#?}"
        );
        assert!(
            lines[1].contains("INFO") && lines[1].contains("sink available again"),
            "{lines:#?}"
        );
        // A second outage is a second pair.
        let lines = logged(|| {
            let mut b = Breaker::new("redis", None);
            outage(&mut b);
            outage(&mut b);
        });
        assert_eq!(lines.len(), 4, "{lines:#?}");
        // The breaker over a router's routes says nothing: they do.
        let lines = logged(|| outage(&mut Breaker::new("router", None).over_routes()));
        assert!(lines.is_empty(), "{lines:#?}");
    }
}
