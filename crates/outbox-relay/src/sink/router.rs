//! Routing by aggregate type: a [`Sink`] made of sinks.
//!
//! [`Router`] owns the split and the merge: it sends each row to the sink
//! its `aggregate_type` is routed to (or the default route), delivers the
//! parts concurrently and answers one [`Delivery`] per row in the batch's
//! order, each the answer of that row's own sink. The relay core is
//! unchanged: a row is marked only when its own sink acknowledged it.
//!
//! Each route has its own circuit breaker (`breaker`): a route whose sink
//! answered a whole part unavailable is open, its rows are answered
//! unavailable at once (no attempt spent, due again after one probe
//! interval) without calling its sink, and a task probes that sink with
//! backoff until it answers. So a sink that is down costs the other routes
//! nothing, not even a connection timeout per batch.
//!
//! A route an operator paused (`route_state`) is answered as an open one
//! is, unsent, without touching its breaker (its sink said nothing), and
//! is not up for the relay's probe.
//!
//! Order is kept per aggregate because an aggregate has one type, so all its
//! rows of a batch go to one sink, in batch order.
//!
//! Each route has a name (its aggregate type unless given one; the default
//! route's is [`DEFAULT_ROUTE`] unless given one): the `route` label of its
//! metrics beside its sink's real name, never `router`. The router times
//! each route's part of a batch itself (`outbox_sink_request_duration_seconds`
//! per sink and route) and tells the relay which route takes an aggregate
//! type ([`Sink::route_of`]), so the event counters are per route too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use metrics::Histogram;
use outbox::OutboxRow;

use super::{DEFAULT_ROUTE, Delivery, DeliveryError, Sink};
use crate::breaker::{Breaker, CircuitState};
use crate::route_state::{RouteStatus, sink_text};

/// Delivers each row to the sink of its aggregate type.
pub struct Router {
    /// Aggregate type → index into `sinks`.
    routes: HashMap<String, usize>,
    /// Index of the default route's sink.
    default: usize,
    sinks: Vec<Arc<Route>>,
    /// Index of a route's sink → the route's own retry window (its
    /// table's `retry_for`), where it has one.
    windows: HashMap<usize, Duration>,
    /// Route name → its sink's address without secrets, for route state.
    addresses: HashMap<String, String>,
    /// The types the default route takes, when the router's claim names
    /// them (a lane's): None, every type no route names.
    default_types: Option<Vec<String>>,
}

/// One route's sink and breaker.
struct Route {
    /// The route's name, for labels and logs.
    name: String,
    sink: Box<dyn Sink>,
    /// A std mutex: held for a few instructions, never across an await.
    breaker: Mutex<Breaker>,
    /// The time of each call of its sink, once bound to a relay.
    request: OnceLock<Histogram>,
    /// Its state for the console and whether it is paused, once bound.
    status: OnceLock<Arc<RouteStatus>>,
}

impl Route {
    fn new(sink: Box<dyn Sink>, name: String) -> Arc<Self> {
        let breaker = Mutex::new(Breaker::new(sink.name(), Some(name.clone())));
        Arc::new(Self {
            name,
            sink,
            breaker,
            request: OnceLock::new(),
            status: OnceLock::new(),
        })
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        // The breaker is plain state; a panic elsewhere leaves it usable.
        self.breaker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// While an operator's pause of the route is honoured: why, to answer
    /// its rows with. Its breaker is left alone: the sink said nothing.
    fn paused(&self) -> Option<String> {
        self.status
            .get()
            .is_some_and(|s| s.is_paused())
            .then(|| format!("route {} is paused", self.name))
    }

    /// While the route is open: why, to answer its rows with.
    fn open_cause(&self) -> Option<String> {
        let breaker = self.breaker();
        (breaker.state() == CircuitState::Open).then(|| breaker.cause().unwrap_or_default().to_owned())
    }

    /// Probes the sink with backoff until it answers, then half-opens the
    /// route; the next part sent to it decides. Runs as a task, one per
    /// opening, holding the route weakly: it ends with the router.
    fn spawn_prober(self: &Arc<Self>) {
        let route = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(wait) = route.upgrade().map(|r| r.breaker().next_probe()) else {
                    return;
                };
                tokio::time::sleep(wait).await;
                let Some(r) = route.upgrade() else {
                    return;
                };
                let probe = r.sink.probe().await;
                let mut breaker = r.breaker();
                match probe {
                    Ok(()) => {
                        breaker.half_open();
                        return;
                    }
                    Err(error) => breaker.open_after(&error),
                }
            }
        });
    }

    /// Delivers `rows`, or answers them unavailable while the route is open.
    async fn deliver(self: &Arc<Self>, rows: &[OutboxRow]) -> Vec<Delivery> {
        if let Some(cause) = self.paused().or_else(|| self.open_cause()) {
            return rows
                .iter()
                .map(|_| Err(DeliveryError::unavailable(cause.clone())))
                .collect();
        }
        let started = Instant::now();
        let mut answers = self.sink.deliver(rows).await;
        if let Some(request) = self.request.get() {
            request.record(started.elapsed().as_secs_f64());
        }
        let opened = {
            let mut breaker = self.breaker();
            let was = breaker.state();
            breaker.record(&mut answers) && was != CircuitState::Open
        };
        if opened {
            self.spawn_prober();
        }
        answers
    }
}

impl Router {
    /// A router sending `default` everything no route names, on a route
    /// named [`DEFAULT_ROUTE`].
    pub fn new(default: Box<dyn Sink>) -> Self {
        Self::named(DEFAULT_ROUTE, default)
    }

    /// A router sending `default` everything no route names, on a route
    /// named `name`.
    pub fn named(name: impl Into<String>, default: Box<dyn Sink>) -> Self {
        Self {
            routes: HashMap::new(),
            default: 0,
            sinks: vec![Route::new(default, name.into())],
            windows: HashMap::new(),
            addresses: HashMap::new(),
            default_types: None,
        }
    }

    /// Gives the route of `aggregate_type` (None: the default route) its
    /// own retry window, over the relay's `--retry-for`. Call it after the
    /// route is added.
    pub fn with_retry_for(mut self, aggregate_type: Option<&str>, window: Duration) -> Self {
        let at = aggregate_type
            .and_then(|t| self.routes.get(t).copied())
            .unwrap_or(self.default);
        self.windows.insert(at, window);
        self
    }

    /// Names the address of the sink of the route `route` (without
    /// secrets: [`crate::redact::url`]), as route state shows it.
    pub fn with_address(mut self, route: impl Into<String>, address: impl Into<String>) -> Self {
        self.addresses.insert(route.into(), address.into());
        self
    }

    /// The default route takes only `types`: a router whose claim names
    /// its types (a lane's), so its first route stands as the default.
    pub fn with_default_types(mut self, types: Vec<String>) -> Self {
        self.default_types = Some(types);
        self
    }

    /// Routes the events of `aggregate_type` to `sink`, on a route named
    /// after the type. A later route for the same type replaces an earlier
    /// one; the CLI refuses duplicates first.
    pub fn route(self, aggregate_type: impl Into<String>, sink: Box<dyn Sink>) -> Self {
        let aggregate_type = aggregate_type.into();
        let name = aggregate_type.clone();
        self.route_named(aggregate_type, name, sink)
    }

    /// Routes the events of `aggregate_type` to `sink`, on a route named
    /// `name` (the CLI refuses two routes of one name).
    pub fn route_named(
        mut self,
        aggregate_type: impl Into<String>,
        name: impl Into<String>,
        sink: Box<dyn Sink>,
    ) -> Self {
        self.sinks.push(Route::new(sink, name.into()));
        self.routes.insert(aggregate_type.into(), self.sinks.len() - 1);
        self
    }

    /// The index of the route taking `aggregate_type`.
    fn route_index(&self, aggregate_type: &str) -> usize {
        self.routes.get(aggregate_type).copied().unwrap_or(self.default)
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        // Row indices per sink, in batch order.
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); self.sinks.len()];
        for (i, row) in batch.iter().enumerate() {
            parts[self.route_index(&row.aggregate_type)].push(i);
        }
        // A sink takes a slice, so each part is copied out; rows are small
        // next to a network round trip.
        let deliveries = parts
            .iter()
            .enumerate()
            .filter(|(_, part)| !part.is_empty())
            .map(|(s, part)| {
                let rows: Vec<OutboxRow> = part.iter().map(|&i| batch[i].clone()).collect();
                let route = &self.sinks[s];
                async move {
                    let answers = route.deliver(&rows).await;
                    (part, answers)
                }
            });
        let mut out: Vec<Option<Delivery>> = vec![None; batch.len()];
        for (part, answers) in futures::future::join_all(deliveries).await {
            for (&i, answer) in part.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        // A sink that answered fewer rows than it got broke the trait's
        // contract; its missing rows are retried rather than marked.
        out.into_iter()
            .map(|d| d.unwrap_or_else(|| Err(DeliveryError::retryable("router: the sink gave no answer"))))
            .collect()
    }

    /// Probes every route's sink; available if any route is, so the relay
    /// claims again for the routes that are up (the rows of the others are
    /// answered unavailable without a call).
    async fn probe_all(&self) -> Result<(), DeliveryError> {
        let probes = self.sinks.iter().map(|route| async move {
            // A paused route is not up for the relay, whatever its sink.
            if let Some(paused) = route.paused() {
                return Err(DeliveryError::unavailable(paused));
            }
            let probe = route.sink.probe().await;
            let mut breaker = route.breaker();
            match &probe {
                Ok(()) => breaker.half_open(),
                Err(error) => {
                    let opened = breaker.state() != CircuitState::Open;
                    breaker.open_after(error);
                    if opened {
                        route.spawn_prober();
                    }
                }
            }
            probe
        });
        let mut first_error = None;
        for probe in futures::future::join_all(probes).await {
            match probe {
                Ok(()) => return Ok(()),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Sink for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        self.probe_all().boxed()
    }

    fn has_route_breakers(&self) -> bool {
        true
    }

    fn retry_for(&self, aggregate_type: &str) -> Option<Duration> {
        let route = self.routes.get(aggregate_type).copied().unwrap_or(self.default);
        self.windows.get(&route).copied()
    }

    fn route_of(&self, aggregate_type: &str) -> (&str, &'static str) {
        let route = &self.sinks[self.route_index(aggregate_type)];
        (&route.name, route.sink.name())
    }

    fn describe(&self) -> String {
        let routes: Vec<String> = self
            .sinks
            .iter()
            .map(|r| format!("{} route {}", r.sink.name(), r.name))
            .collect();
        routes.join(", ")
    }

    fn bind(&self, ctx: &crate::RelayContext) {
        for (i, route) in self.sinks.iter().enumerate() {
            let types = if i == self.default {
                self.default_types.clone()
            } else {
                let mut types: Vec<String> = self
                    .routes
                    .iter()
                    .filter(|(_, at)| **at == i)
                    .map(|(t, _)| t.clone())
                    .collect();
                types.sort();
                Some(types)
            };
            let sink = sink_text(
                route.sink.name(),
                self.addresses.get(&route.name).map(String::as_str),
            );
            let _ = route.status.set(ctx.routes().register(&route.name, sink, types));
            // After the route is registered: the breaker reports to it.
            route.breaker().bind(ctx);
            let _ = route
                .request
                .set(crate::metric::sink_request(ctx, route.sink.name(), &route.name));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chrono::Utc;
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    /// Records what it got; fails every row when `down`, as unavailable
    /// when `unavailable`.
    struct Fake {
        name: &'static str,
        down: bool,
        unavailable: bool,
        seen: Arc<Mutex<Vec<i64>>>,
    }

    impl Fake {
        fn new(name: &'static str, down: bool) -> Box<Self> {
            Box::new(Self {
                name,
                down,
                unavailable: false,
                seen: Arc::default(),
            })
        }
    }

    impl Sink for Fake {
        fn name(&self) -> &'static str {
            self.name
        }

        fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
            self.seen.lock().unwrap().extend(batch.iter().map(|r| r.id));
            let answers = batch
                .iter()
                .map(|_| {
                    if self.unavailable {
                        Err(DeliveryError::unavailable(format!("{} refused", self.name)))
                    } else if self.down {
                        Err(DeliveryError::retryable(format!("{} down", self.name)))
                    } else {
                        Ok(())
                    }
                })
                .collect();
            async move { answers }.boxed()
        }
    }

    fn row(id: i64, aggregate_type: &str) -> OutboxRow {
        OutboxRow {
            id,
            event_id: Uuid::new_v4(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: "1".into(),
            event_type: "E".into(),
            payload: json!({}),
            headers: json!({}),
            created_at: Utc::now(),
            attempts: 0,
            first_failed_at: None,
        }
    }

    #[tokio::test]
    async fn each_row_gets_its_own_sinks_answer_in_batch_order() {
        let router = Router::new(Fake::new("http", false)).route("orders", Fake::new("redis", true));
        let batch = [
            row(1, "orders"),
            row(2, "invoices"),
            row(3, "orders"),
            row(4, "payments"),
        ];
        let answers = router.deliver(&batch).await;
        let ok: Vec<bool> = answers.iter().map(Result::is_ok).collect();
        assert_eq!(ok, [false, true, false, true]);
        assert_eq!(answers[0].as_ref().unwrap_err().to_string(), "redis down");
    }

    #[tokio::test]
    async fn a_route_whose_sink_is_unavailable_is_not_called_again_until_a_probe_succeeds() {
        let mut down = Fake::new("redis", false);
        down.unavailable = true;
        let seen = Arc::clone(&down.seen);
        let router = Router::new(Fake::new("http", false)).route("orders", down);
        let batch = [row(1, "orders"), row(2, "invoices")];
        for _ in 0..3 {
            let answers = router.deliver(&batch).await;
            assert!(answers[0].as_ref().is_err_and(DeliveryError::is_unavailable));
            assert!(answers[1].is_ok(), "the other route delivers");
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [1],
            "called once; then answered by its breaker"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_answers_lets_the_route_be_tried_again() {
        let mut down = Fake::new("redis", false);
        down.unavailable = true;
        let seen = Arc::clone(&down.seen);
        let router = Router::new(Fake::new("http", false)).route("orders", down);
        let batch = [row(1, "orders")];
        router.deliver(&batch).await;
        router.deliver(&batch).await;
        assert_eq!(*seen.lock().unwrap(), [1], "open: not called");
        // The prober's first probe is due after 100 ms; the fake answers it.
        tokio::time::sleep(Duration::from_millis(150)).await;
        router.deliver(&batch).await;
        assert_eq!(*seen.lock().unwrap(), [1, 1], "half-open: tried again");
    }
}
