//! What the relay records for Prometheus, through the `metrics` facade: the
//! metric names, their descriptions and the handles the hot path keeps.
//!
//! The library records and never serves: whoever runs the relay installs a
//! recorder (the `outbox` binary installs `metrics-exporter-prometheus` and
//! serves `/metrics`); without one every handle is a no-op. Install it before
//! [`Relay::new`](crate::Relay::new): handles are looked up once, when the
//! relay, its source, its breakers and its lease task are built, so the hot
//! path never builds a label. Per-row facts (outcomes per aggregate type) are
//! tallied per batch in the plan and recorded once per batch and type.
//!
//! Every metric a relay records carries the label `outbox` (its
//! [`RelayContext::outbox`](crate::RelayContext::outbox), `schema.table`),
//! so two relays in one process report separately; `outbox_build_info` is
//! the process's.
//!
//! What is about a sink carries the real sink (`redis`, `http`, …) and the
//! route that used it (`route`: a routes file's route name, `default` for a
//! sink alone, see [`DEFAULT_ROUTE`]); a router is never a `sink` itself. An
//! aggregate type has one route, so the event counters' handles are looked
//! up once per type ([`Sink::route_of`]) and a route adds no series to them.
//!
//! The full list, with types, labels and meaning, is in `docs/operations.md`
//! ("Metrics"); [`describe`] gives each its `# HELP` text.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{Counter, Gauge, Histogram, Unit};
use outbox::OutboxRow;

use crate::context::RelayContext;
use crate::sink::{DEFAULT_ROUTE, Delivery, Sink};

/// Events marked published (per `aggregate_type`, `sink`, `route`).
pub const EVENTS_DELIVERED: &str = "outbox_events_delivered_total";
/// Failed delivery attempts (per `aggregate_type`, `sink`, `route`).
pub const EVENTS_FAILED: &str = "outbox_events_failed_total";
/// Events that became dead letters (per `aggregate_type`, `sink`, `route`).
pub const EVENTS_DEAD_LETTERED: &str = "outbox_events_dead_lettered_total";
/// Batches committed.
pub const BATCHES: &str = "outbox_batches_total";
/// Wake-ups of the idle relay (per `cause`).
pub const WAKEUPS: &str = "outbox_wakeups_total";
/// Rows per claimed batch.
pub const BATCH_SIZE: &str = "outbox_batch_size";
/// Claim to commit of one batch.
pub const BATCH_DURATION: &str = "outbox_batch_duration_seconds";
/// One call of a sink for a batch, or for a route's part of one (per
/// `sink`, `route`).
pub const SINK_REQUEST_DURATION: &str = "outbox_sink_request_duration_seconds";
/// A row's `created_at` to the sink's acknowledgement (per `aggregate_type`).
pub const DELIVERY_LAG: &str = "outbox_delivery_lag_seconds";
/// Rows waiting for delivery (per `aggregate_type`).
pub const BACKLOG: &str = "outbox_backlog_events";
/// Age of the oldest row waiting for delivery (per `aggregate_type`).
pub const OLDEST_UNPUBLISHED_AGE: &str = "outbox_oldest_unpublished_age_seconds";
/// Dead letters nobody gave up on (per `aggregate_type`).
pub const DEAD_LETTERS: &str = "outbox_dead_letters";
/// 1 while a sink's breaker is closed (per `sink`, `route`).
pub const SINK_UP: &str = "outbox_sink_up";
/// A sink's breaker: 0 closed, 1 open, 2 half-open (per `sink`, `route`).
pub const SINK_CIRCUIT_STATE: &str = "outbox_sink_circuit_state";
/// Partitions this relay holds.
pub const PARTITIONS_HELD: &str = "outbox_partitions_held";
/// WAL bytes the replication slot holds back (per `slot`).
pub const WAL_RETAINED: &str = "outbox_wal_retained_bytes";
/// WAL bytes written since the slot's confirmed position (per `slot`).
pub const WAL_LAG: &str = "outbox_wal_lag_bytes";
/// Events the WAL source read and has not finished.
pub const WAL_WINDOW: &str = "outbox_wal_window_events";
/// Counter: replication slots the WAL source created again (per
/// `reason`: `missing` after a failover or a drop, `lost` once invalidated).
pub const WAL_SLOT_RECREATED: &str = "outbox_wal_slot_recreated_total";
/// Counter: rows the WAL source read from the table in backfills, to
/// deliver before the stream.
pub const WAL_BACKFILLED: &str = "outbox_wal_backfilled_events_total";
/// 1 while the relay delivers (after READY, until it stopped).
pub const RELAY_UP: &str = "outbox_relay_up";
/// Counter: rows whose deadline claim expired and was taken by another relay
/// before this one marked them (`--claim deadline`).
pub const CLAIMS_LOST: &str = "outbox_claims_lost_total";
/// The id the polling relay's claims start from (its claim floor; 0 right
/// after a sweep).
pub const CLAIM_FLOOR: &str = "outbox_claim_floor";
/// Age of the oldest transaction or snapshot holding back the server's
/// xmin horizon (what vacuum may remove).
pub const XMIN_HORIZON_AGE: &str = "outbox_xmin_horizon_age_seconds";
/// Dead tuples of the outbox table, its partitions summed.
pub const DEAD_TUPLES: &str = "outbox_dead_tuples";
/// Always 1, labelled with the `version` and the git `commit`.
pub const BUILD_INFO: &str = "outbox_build_info";

/// The histograms with their units, for the exporter's bucket settings.
pub const HISTOGRAMS: [&str; 4] = [BATCH_SIZE, BATCH_DURATION, SINK_REQUEST_DURATION, DELIVERY_LAG];

/// Registers every metric's `# HELP` text and unit with the installed
/// recorder. Call once, after installing it.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        CLAIMS_LOST,
        "Rows a deadline claim lost before its mark: the claim expired and another relay took them, so they were delivered twice."
    );
    describe_counter!(
        EVENTS_DELIVERED,
        "Events marked published, per aggregate type, sink and route."
    );
    describe_counter!(
        EVENTS_FAILED,
        "Failed delivery attempts (held-back rows not included), per aggregate type, sink and route."
    );
    describe_counter!(
        EVENTS_DEAD_LETTERED,
        "Events that became dead letters, per aggregate type, sink and route."
    );
    describe_counter!(BATCHES, "Batches committed.");
    describe_counter!(
        WAKEUPS,
        "Wake-ups of the idle relay, by cause: notify, poll, retry, lease."
    );
    describe_histogram!(BATCH_SIZE, Unit::Count, "Rows per claimed batch.");
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "From a batch's claim to its commit."
    );
    describe_histogram!(
        SINK_REQUEST_DURATION,
        Unit::Seconds,
        "One call of a sink for a batch (a route's part of it, with a routes file)."
    );
    describe_histogram!(
        DELIVERY_LAG,
        Unit::Seconds,
        "From an event's created_at to the sink's acknowledgement, per aggregate type."
    );
    describe_gauge!(
        BACKLOG,
        "Events waiting for delivery (not dead letters), per aggregate type."
    );
    describe_gauge!(
        OLDEST_UNPUBLISHED_AGE,
        Unit::Seconds,
        "Age of the oldest event waiting for delivery."
    );
    describe_gauge!(
        DEAD_LETTERS,
        "Dead letters nobody gave up on, per aggregate type."
    );
    describe_gauge!(SINK_UP, "1 while the sink's circuit breaker is closed, else 0.");
    describe_gauge!(
        SINK_CIRCUIT_STATE,
        "The sink's circuit breaker: 0 closed, 1 open, 2 half-open."
    );
    describe_gauge!(PARTITIONS_HELD, "Partitions this relay holds.");
    describe_gauge!(
        WAL_RETAINED,
        Unit::Bytes,
        "WAL the replication slot keeps PostgreSQL from removing (log tailing)."
    );
    describe_gauge!(
        WAL_LAG,
        Unit::Bytes,
        "WAL written since the slot's confirmed position (log tailing)."
    );
    describe_gauge!(
        WAL_WINDOW,
        "Events the WAL source read and has not finished (delivered or dead)."
    );
    describe_counter!(
        WAL_SLOT_RECREATED,
        "Replication slots the WAL source created again, by reason: missing (a failover, a drop), lost (invalidated)."
    );
    describe_counter!(
        WAL_BACKFILLED,
        "Rows the WAL source read from the table in backfills (after a failover or a lost slot), delivered before the stream."
    );
    describe_gauge!(
        RELAY_UP,
        "1 while the relay delivers, 0 before READY and after it stopped."
    );
    describe_gauge!(
        CLAIM_FLOOR,
        "The id the polling relay's claims start their walk of the unpublished index from (0 right after a sweep)."
    );
    describe_gauge!(
        XMIN_HORIZON_AGE,
        Unit::Seconds,
        "Age of the oldest transaction, snapshot or prepared transaction holding back what vacuum may remove (0: none)."
    );
    describe_gauge!(
        DEAD_TUPLES,
        "Dead tuples of the outbox table (pg_stat_user_tables.n_dead_tup, partitions summed)."
    );
    describe_gauge!(
        BUILD_INFO,
        "Always 1; the version and the git commit it was built from are labels."
    );
}

/// One aggregate type's outcomes in one batch, tallied by the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) aggregate_type: String,
    pub(crate) delivered: u64,
    pub(crate) failed: u64,
    pub(crate) dead: u64,
    /// The first error of its failed rows (route state's `last_error`).
    pub(crate) error: Option<String>,
}

/// The tally of `aggregate_type`, added on its first row. A batch holds few
/// types (usually one), so a linear search beats hashing, and only a new
/// type allocates.
pub(crate) fn tally<'a>(tallies: &'a mut Vec<Tally>, aggregate_type: &str) -> &'a mut Tally {
    let at = match tallies.iter().position(|t| t.aggregate_type == aggregate_type) {
        Some(at) => at,
        None => {
            tallies.push(Tally {
                aggregate_type: aggregate_type.to_owned(),
                delivered: 0,
                failed: 0,
                dead: 0,
                error: None,
            });
            tallies.len() - 1
        }
    };
    &mut tallies[at]
}

/// The event counters of one aggregate type.
struct TypeCounters {
    delivered: Counter,
    failed: Counter,
    dead: Counter,
}

/// Why an idle relay woke up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WakeCause {
    /// A NOTIFY from the insert trigger.
    Notify,
    /// The fallback poll.
    Poll,
    /// A retry came due.
    Retry,
    /// The lease tick found due rows or gained partitions.
    Lease,
}

/// The handles of the batch side (receipts and wake-ups).
pub(crate) struct BatchMetrics {
    /// Which route (and so which sink) takes each aggregate type.
    sink: Arc<dyn Sink>,
    outbox: String,
    /// Looked up by `&str`, so a known type costs no allocation.
    by_type: HashMap<String, TypeCounters>,
    batches: Counter,
    batch_size: Histogram,
    batch_duration: Histogram,
}

impl BatchMetrics {
    pub(crate) fn new(ctx: &RelayContext, sink: Arc<dyn Sink>) -> Self {
        let outbox = ctx.outbox().to_owned();
        let label = [ctx.label()];
        Self {
            sink,
            by_type: HashMap::new(),
            batches: metrics::counter!(BATCHES, &label),
            batch_size: metrics::histogram!(BATCH_SIZE, &label),
            batch_duration: metrics::histogram!(BATCH_DURATION, &label),
            outbox,
        }
    }

    /// A committed batch: its size, claim-to-commit time and outcomes.
    pub(crate) fn committed(&mut self, claimed: usize, seconds: f64, tallies: &[Tally]) {
        self.batches.increment(1);
        // Rows, a count: exact in an f64 far beyond any batch size.
        #[allow(clippy::cast_precision_loss)]
        self.batch_size.record(claimed as f64);
        self.batch_duration.record(seconds);
        for t in tallies {
            let counters = match self.by_type.get(t.aggregate_type.as_str()) {
                Some(c) => c,
                None => {
                    // A type's route is fixed for the sink's life: asked once.
                    let (route, sink) = self.sink.route_of(&t.aggregate_type);
                    let labels = [
                        ("outbox", self.outbox.clone()),
                        ("aggregate_type", t.aggregate_type.clone()),
                        ("sink", sink.to_owned()),
                        ("route", route.to_owned()),
                    ];
                    let c = TypeCounters {
                        delivered: metrics::counter!(EVENTS_DELIVERED, &labels),
                        failed: metrics::counter!(EVENTS_FAILED, &labels),
                        dead: metrics::counter!(EVENTS_DEAD_LETTERED, &labels),
                    };
                    self.by_type.entry(t.aggregate_type.clone()).or_insert(c)
                }
            };
            counters.delivered.increment(t.delivered);
            counters.failed.increment(t.failed);
            counters.dead.increment(t.dead);
        }
    }
}

/// The wake-ups of an idle source, by cause.
pub(crate) struct WakeMetrics {
    wakeups: [Counter; 4],
}

impl WakeMetrics {
    pub(crate) fn new(ctx: &RelayContext) -> Self {
        let wake = |cause: &'static str| metrics::counter!(WAKEUPS, "outbox" => ctx.outbox().to_owned(), "cause" => cause);
        Self {
            wakeups: [wake("notify"), wake("poll"), wake("retry"), wake("lease")],
        }
    }

    pub(crate) fn woke(&self, cause: WakeCause) {
        let i = match cause {
            WakeCause::Notify => 0,
            WakeCause::Poll => 1,
            WakeCause::Retry => 2,
            WakeCause::Lease => 3,
        };
        self.wakeups[i].increment(1);
    }
}

/// The handles of the delivery side (the relay's cycle).
pub(crate) struct DeliveryMetrics {
    /// One call of the sink, unless the sink times its routes' calls
    /// itself ([`Sink::has_route_breakers`]).
    pub(crate) sink_request: Option<Histogram>,
    pub(crate) lag: Lag,
    pub(crate) relay_up: Gauge,
}

impl DeliveryMetrics {
    pub(crate) fn new(ctx: &RelayContext, sink: &dyn Sink) -> Self {
        let label = [ctx.label()];
        Self {
            sink_request: (!sink.has_route_breakers()).then(|| sink_request(ctx, sink.name(), DEFAULT_ROUTE)),
            lag: Lag::new(ctx),
            relay_up: metrics::gauge!(RELAY_UP, &label),
        }
    }
}

/// The request histogram of `sink` on `route`.
pub(crate) fn sink_request(ctx: &RelayContext, sink: &'static str, route: &str) -> Histogram {
    let labels = [
        ctx.label(),
        ("sink", sink.to_owned()),
        ("route", route.to_owned()),
    ];
    metrics::histogram!(SINK_REQUEST_DURATION, &labels)
}

/// The delivery lag histograms, one per aggregate type, each looked up
/// once.
pub(crate) struct Lag {
    outbox: String,
    /// A std mutex, taken once per batch and never across an await.
    by_type: Mutex<HashMap<String, Histogram>>,
}

impl Lag {
    fn new(ctx: &RelayContext) -> Self {
        Self {
            outbox: ctx.outbox().to_owned(),
            by_type: Mutex::new(HashMap::new()),
        }
    }

    /// Each acknowledged row's lag, from its `created_at` to `acked`: one
    /// sample per row. The batch's few types are kept beside it, found by
    /// a linear search (as [`tally`] does); the map is asked once per type
    /// and batch, and only a new type builds labels.
    pub(crate) fn record(
        &self,
        rows: &[OutboxRow],
        answers: &[Delivery],
        acked: chrono::DateTime<chrono::Utc>,
    ) {
        let mut by_type = self.by_type.lock().unwrap_or_else(PoisonError::into_inner);
        let mut seen: Vec<(&str, Histogram)> = Vec::new();
        for (row, answer) in rows.iter().zip(answers) {
            if answer.is_err() {
                continue;
            }
            let at = match seen.iter().position(|(t, _)| *t == row.aggregate_type) {
                Some(at) => at,
                None => {
                    // Looked up by `&str`: a known type allocates nothing.
                    let h = match by_type.get(row.aggregate_type.as_str()) {
                        Some(h) => h.clone(),
                        None => {
                            let labels = [
                                ("outbox", self.outbox.clone()),
                                ("aggregate_type", row.aggregate_type.clone()),
                            ];
                            let h = metrics::histogram!(DELIVERY_LAG, &labels);
                            by_type.insert(row.aggregate_type.clone(), h.clone());
                            h
                        }
                    };
                    seen.push((row.aggregate_type.as_str(), h));
                    seen.len() - 1
                }
            };
            let lag = (acked - row.created_at).num_microseconds().unwrap_or(i64::MAX);
            // Microseconds of lag: far inside f64's exact integers.
            #[allow(clippy::cast_precision_loss)]
            seen[at].1.record(lag.max(0) as f64 / 1e6);
        }
    }
}

/// A breaker's gauges.
#[derive(Debug)]
pub(crate) struct BreakerGauges {
    up: Gauge,
    state: Gauge,
}

impl BreakerGauges {
    pub(crate) fn new(ctx: &RelayContext, sink: &'static str, route: &str) -> Self {
        let labels = [
            ctx.label(),
            ("sink", sink.to_owned()),
            ("route", route.to_owned()),
        ];
        let gauges = Self {
            up: metrics::gauge!(SINK_UP, &labels),
            state: metrics::gauge!(SINK_CIRCUIT_STATE, &labels),
        };
        gauges.set(0);
        gauges
    }

    /// 0 closed, 1 open, 2 half-open.
    pub(crate) fn set(&self, state: u8) {
        self.up.set(if state == 0 { 1.0 } else { 0.0 });
        self.state.set(f64::from(state));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A sink that takes everything, for its name.
    struct Named(&'static str);

    impl Sink for Named {
        fn name(&self) -> &'static str {
            self.0
        }
        fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> futures::future::BoxFuture<'a, Vec<Delivery>> {
            Box::pin(async move { batch.iter().map(|_| Ok(())).collect() })
        }
    }

    fn rows(types: &[&str], n: usize) -> Vec<OutboxRow> {
        (0..n)
            .map(|i| OutboxRow {
                id: i64::try_from(i).unwrap_or_default(),
                event_id: uuid::Uuid::new_v4(),
                aggregate_type: types[i % types.len()].to_owned(),
                aggregate_id: "1".to_owned(),
                event_type: "E".to_owned(),
                payload: serde_json::json!({}),
                headers: serde_json::json!({}),
                created_at: chrono::Utc::now(),
                attempts: 0,
                first_failed_at: None,
            })
            .collect()
    }

    /// The counters of a type carry its route's sink and name; the lag
    /// histogram carries the type; nothing carries a router.
    #[test]
    fn labels_are_the_real_sink_its_route_and_the_type() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let ctx = RelayContext::new(None, "public.outbox".to_owned(), crate::Signals::Process);
            let router = crate::sink::router::Router::new(Box::new(Named("http")))
                .route("orders", Box::new(Named("redis")));
            let sink: Arc<dyn Sink> = Arc::new(router);
            let mut batch = BatchMetrics::new(&ctx, Arc::clone(&sink));
            let mut tallies = Vec::new();
            tally(&mut tallies, "orders").delivered += 2;
            tally(&mut tallies, "invoices").dead += 1;
            batch.committed(3, 0.01, &tallies);
            let delivery = DeliveryMetrics::new(&ctx, sink.as_ref());
            assert!(delivery.sink_request.is_none(), "the router times its routes");
            let rows = rows(&["orders", "orders", "invoices"], 3);
            delivery
                .lag
                .record(&rows, &[Ok(()), Ok(()), Ok(())], chrono::Utc::now());
        });
        let text = handle.render();
        for line in [
            r#"outbox_events_delivered_total{outbox="public.outbox",aggregate_type="orders",sink="redis",route="orders"} 2"#,
            r#"outbox_events_dead_lettered_total{outbox="public.outbox",aggregate_type="invoices",sink="http",route="default"} 1"#,
            r#"outbox_delivery_lag_seconds_count{outbox="public.outbox",aggregate_type="orders"} 2"#,
            r#"outbox_delivery_lag_seconds_count{outbox="public.outbox",aggregate_type="invoices"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(!text.contains("router"), "{text}");
    }

    /// What one batch of 100 rows costs to record, with the Prometheus
    /// recorder and without any: the tally of 100 rows of two types, the
    /// batch's counters and histograms, 100 lag samples. A measurement:
    /// `cargo test -p outbox-relay --release metric -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement; prints timings"]
    fn measure_recording_one_batch() {
        const BATCHES: u32 = 20_000;
        let rows = rows(&["orders", "payments"], 100);
        let answers: Vec<Delivery> = rows.iter().map(|_| Ok(())).collect();
        let run = || {
            let ctx = RelayContext::new(None, "public.outbox".to_owned(), crate::Signals::Process);
            let mut batch = BatchMetrics::new(&ctx, Arc::new(Named("redis")));
            let delivery = DeliveryMetrics::new(&ctx, &Named("redis"));
            let started = Instant::now();
            for _ in 0..BATCHES {
                let mut tallies = Vec::new();
                for row in &rows {
                    tally(&mut tallies, &row.aggregate_type).delivered += 1;
                }
                delivery.lag.record(&rows, &answers, chrono::Utc::now());
                batch.committed(100, 0.01, &tallies);
            }
            started.elapsed() / BATCHES
        };
        let none = run();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(&[0.001, 0.01, 0.1, 1.0, 10.0])
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        let prometheus = metrics::with_local_recorder(&recorder, run);
        assert!(handle.render().contains("outbox_events_delivered_total"));
        eprintln!("one batch of 100 rows: no recorder {none:?}, Prometheus {prometheus:?}");
    }
}
