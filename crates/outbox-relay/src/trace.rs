//! OpenTelemetry traces over OTLP/HTTP: the exporter a process sets up once
//! ([`Tracing`]), and the spans made from a relay's receipts and from an
//! inbox transaction. Off unless an endpoint is given (`--otlp-endpoint`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`):
//! then nothing is built, and the relay's only cost is one `Option` check
//! per batch (and one clock reading per claim in the polling source). The span shape, the attributes and why an event span *links*
//! to the writer's `traceparent` rather than being its child are in
//! `docs/tracing.md`.
//!
//! # Off the relay's path
//!
//! A batch's spans are made only once its receipt says it is durable
//! (`Books` in `relay.rs`): timestamps the cycle took (claim, deliver, the
//! mark's round trip) become spans with explicit start and end times, so
//! the cycle itself holds no span open and runs the same code with tracing
//! on or off. Ending a span hands it to the SDK's batch span processor, a
//! bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2048) drained by a thread of
//! its own that exports through reqwest's blocking client: the relay's
//! runtime never waits for a collector, and a full queue drops spans, never
//! events. An export that fails is said once ([`Warned`]), and once more
//! when exports work again, not once per batch.
//!
//! A batch that never becomes durable (rolled back, redelivered) has no
//! receipt, so no spans: its redelivery has them.
//!
//! # What it does not own
//!
//! The process's `tracing` logs, the `traceparent` events carry (the writer
//! sets it; every sink forwards it unchanged), and sampling decisions
//! (the SDK's, from `OTEL_TRACES_SAMPLER`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, Utc};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Link, Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter};
use outbox::OutboxRow;
use tracing::{info, warn};
use uuid::Uuid;

use crate::context::RelayContext;
use crate::sink::{Delivery, Sink};
use crate::source::Receipt;

/// The path an OTLP/HTTP collector takes traces on.
const TRACES_PATH: &str = "/v1/traces";

/// Setting up the exporter failed: a configuration error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The endpoint or a header is not usable.
    #[error("setting up the OTLP trace exporter (--otlp-endpoint / OTEL_EXPORTER_OTLP_*)")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
}

/// A process's tracer and the provider that exports its spans. Cloning is
/// cheap (the SDK's handles are shared); give a clone to each relay
/// ([`Relay::with_tracing`](crate::Relay::with_tracing)) and call
/// [`Tracing::shutdown`] once, on the way out.
#[derive(Debug, Clone)]
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Tracing {
    /// The exporter `endpoint` (`--otlp-endpoint`) or the standard
    /// variables ask for, or None when tracing is off: no endpoint at all,
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
    ///
    /// `endpoint` is a collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// is (`/v1/traces` is added unless it ends so already); it wins over
    /// the variables. `service` is `service.name` unless `OTEL_SERVICE_NAME`
    /// (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) says otherwise.
    /// Headers (`OTEL_EXPORTER_OTLP_HEADERS`), the timeout, the sampler
    /// (`OTEL_TRACES_SAMPLER`, `_ARG`) and the batch processor's settings
    /// (`OTEL_BSP_*`) are read from the environment by the SDK.
    ///
    /// The exporter builds its blocking HTTP client on a short-lived thread
    /// of its own and waits for it (reqwest's blocking client must not be
    /// made on a runtime thread): call this once, at startup.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), outbox_relay::trace::TraceError> {
    /// let tracing = outbox_relay::trace::Tracing::from_env(Some("http://collector:4318"), "outbox-relay")?;
    /// // … Relay::new(…).with_tracing(tracing.clone()) …
    /// if let Some(tracing) = tracing {
    ///     tracing.shutdown(std::time::Duration::from_secs(5));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn from_env(endpoint: Option<&str>, service: &str) -> Result<Option<Self>, TraceError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let endpoint = endpoint.map(str::trim).filter(|e| !e.is_empty());
        let configured = endpoint.is_some()
            || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
            || var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
        let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
        if !configured || disabled {
            return Ok(None);
        }
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
        if let Some(endpoint) = endpoint {
            builder = builder.with_endpoint(traces_url(endpoint));
        }
        let exporter = builder.build().map_err(TraceError::Exporter)?;
        let named = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|v| v.contains("service.name="));
        let mut resource = Resource::builder();
        if !named {
            resource = resource.with_service_name(service.to_owned());
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(Warned::new(exporter))
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("outbox");
        Ok(Some(Self { provider, tracer }))
    }

    /// Exports what is queued and stops the exporter, waiting at most
    /// `timeout`: on every way out of the process. Blocks, so run it off a
    /// runtime thread (`spawn_blocking`). False if it timed out or failed
    /// (said at debug level: the export's own failure was said already).
    pub fn shutdown(&self, timeout: Duration) -> bool {
        match self.provider.shutdown_with_timeout(timeout) {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, "shutting the trace exporter down");
                false
            }
        }
    }

    /// The span of one inbox transaction of `outbox consume`: a child of the
    /// event's own context (its `traceparent` header), as the processing
    /// of a message continues the trace that wrote it. `outcome` is
    /// `processed`, `duplicate` or `failed` (status error).
    pub fn inbox(&self, inbox: &InboxSpan<'_>) {
        let parent = remote_context(inbox.headers);
        let mut attributes = vec![
            KeyValue::new("messaging.system", inbox.system),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.destination.name", inbox.destination.to_owned()),
            KeyValue::new("messaging.message.id", inbox.event_id.to_string()),
            KeyValue::new("outbox.event_type", inbox.event_type.to_owned()),
            KeyValue::new("outbox.inbox.outcome", inbox.outcome),
        ];
        if let Some(group) = inbox.group {
            attributes.push(KeyValue::new("messaging.consumer.group.name", group.to_owned()));
        }
        let builder = self
            .tracer
            .span_builder("outbox.inbox")
            .with_kind(SpanKind::Consumer)
            .with_start_time(inbox.started)
            .with_attributes(attributes);
        let mut span = self.tracer.build_with_context(builder, &parent);
        if inbox.outcome == "failed" {
            span.set_status(Status::error("the side effect failed and was rolled back"));
        }
        span.end_with_timestamp(inbox.ended);
    }

    /// The spans of one durable batch, from its receipt and the timings the
    /// cycle took ([`BatchTrace`]): `outbox.batch`, its children
    /// `outbox.claim`, `outbox.deliver` (with one `outbox.event` per event
    /// sent, linked to the event's own context) and `outbox.mark`.
    pub(crate) fn batch(&self, ctx: &RelayContext, receipt: &Receipt, trace: BatchTrace) {
        let clock = Clock::now();
        let start = trace.claim.map_or(receipt.claimed_at, |(sent, _)| sent);
        let claim_at = clock.at(start);
        let relay = [
            KeyValue::new("outbox.table", ctx.outbox().to_owned()),
            KeyValue::new("outbox.relay", ctx.name().to_owned()),
        ];
        let destination = trace.destination();
        let mut messaging = vec![
            KeyValue::new("messaging.system", trace.system),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new("messaging.batch.message_count", trace.events.len() as i64),
        ];
        if let Some(destination) = destination {
            messaging.push(KeyValue::new(
                "messaging.destination.name",
                destination.to_owned(),
            ));
        }
        let mut batch_attributes: Vec<KeyValue> = relay.to_vec();
        batch_attributes.extend(messaging.iter().cloned());
        batch_attributes.extend([
            KeyValue::new("outbox.batch", receipt.batch as i64),
            KeyValue::new("outbox.batch.claimed", receipt.claimed as i64),
            KeyValue::new("outbox.batch.delivered", receipt.published as i64),
            KeyValue::new("outbox.batch.failed", receipt.failures.failed as i64),
            KeyValue::new("outbox.batch.dead_lettered", receipt.failures.dead as i64),
        ]);
        let root = self
            .tracer
            .span_builder("outbox.batch")
            .with_kind(SpanKind::Internal)
            .with_start_time(claim_at)
            .with_attributes(batch_attributes);
        let mut root = self.tracer.build_with_context(root, &Context::new());
        if !root.span_context().is_sampled() {
            // Sampled out (`OTEL_TRACES_SAMPLER`): its children share its
            // trace id, so the standard samplers drop them too; not
            // building them is what makes sampling cheap.
            root.end_with_timestamp(clock.at(receipt.durable_at));
            return;
        }
        let cx = Context::new().with_span(root);

        if let Some((sent, claimed)) = trace.claim {
            self.child(
                &cx,
                "outbox.claim",
                SpanKind::Client,
                clock.at(sent),
                clock.at(claimed),
                {
                    let mut a = relay.to_vec();
                    a.extend([
                        KeyValue::new("db.system.name", "postgresql"),
                        KeyValue::new("outbox.batch.claimed", receipt.claimed as i64),
                    ]);
                    a
                },
            );
        }

        let (delivering, delivered) = (clock.at(trace.deliver.0), clock.at(trace.deliver.1));
        let deliver = self
            .tracer
            .span_builder("outbox.deliver")
            .with_kind(SpanKind::Producer)
            .with_start_time(delivering)
            .with_attributes(messaging.iter().cloned().chain(relay.iter().cloned()));
        let mut deliver = self.tracer.build_with_context(deliver, &cx);
        if trace.events.iter().any(|e| e.error.is_some()) {
            deliver.set_status(Status::error("the sink refused some events"));
        }
        let deliver_cx = cx.with_span(deliver);
        for event in trace.events {
            // Waited in the outbox from the writer's commit (created_at is
            // the insert's clock_timestamp) until the claim was sent. The
            // clocks are PostgreSQL's and this host's: never below zero.
            let waited = (DateTime::<Utc>::from(claim_at) - event.created_at)
                .to_std()
                .unwrap_or_default();
            let link = remote_context(&event.headers);
            let link = link.span().span_context().clone();
            let links = if link.is_valid() {
                vec![Link::with_context(link)]
            } else {
                Vec::new()
            };
            let builder = self
                .tracer
                .span_builder("outbox.event")
                .with_kind(SpanKind::Producer)
                .with_start_time(delivering)
                .with_links(links)
                .with_attributes([
                    KeyValue::new("messaging.system", event.system),
                    KeyValue::new("messaging.operation.type", "send"),
                    KeyValue::new("messaging.destination.name", event.route),
                    KeyValue::new("messaging.message.id", event.event_id.to_string()),
                    KeyValue::new("outbox.event.id", event.id),
                    KeyValue::new("outbox.aggregate_type", event.aggregate_type),
                    KeyValue::new("outbox.event_type", event.event_type),
                    KeyValue::new("outbox.event.wait_seconds", waited.as_secs_f64()),
                    KeyValue::new("outbox.table", ctx.outbox().to_owned()),
                ]);
            let mut span = self.tracer.build_with_context(builder, &deliver_cx);
            if let Some(error) = event.error {
                span.set_status(Status::error(error));
            }
            span.end_with_timestamp(delivered);
        }
        deliver_cx.span().end_with_timestamp(delivered);

        let marking = clock.at(trace.marking.max(trace.deliver.1));
        let durable = clock.at(receipt.durable_at);
        self.child(&cx, "outbox.mark", SpanKind::Client, marking, durable, {
            let mut a = relay.to_vec();
            a.extend([
                KeyValue::new("db.system.name", "postgresql"),
                KeyValue::new("outbox.batch.delivered", receipt.published as i64),
                KeyValue::new("outbox.batch.failed", receipt.failures.failed as i64),
            ]);
            a
        });
        cx.span().end_with_timestamp(durable);
    }

    /// A child of `cx` from `start` to `end`.
    fn child(
        &self,
        cx: &Context,
        name: &'static str,
        kind: SpanKind,
        start: SystemTime,
        end: SystemTime,
        attributes: Vec<KeyValue>,
    ) {
        let builder = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_start_time(start)
            .with_attributes(attributes);
        self.tracer
            .build_with_context(builder, cx)
            .end_with_timestamp(end);
    }
}

/// What the span of one inbox transaction says (see [`Tracing::inbox`]).
#[derive(Debug)]
pub struct InboxSpan<'a> {
    /// The broker: `redis`, `nats`, `rabbitmq`.
    pub system: &'static str,
    /// The stream or queue read.
    pub destination: &'a str,
    /// The consumer group (Redis) or durable consumer (NATS).
    pub group: Option<&'a str>,
    /// The event's id.
    pub event_id: Uuid,
    /// The event's type.
    pub event_type: &'a str,
    /// The event's headers, where its `traceparent` is.
    pub headers: &'a serde_json::Value,
    /// `processed`, `duplicate` or `failed`.
    pub outcome: &'static str,
    /// When the transaction began.
    pub started: SystemTime,
    /// When it committed (or rolled back).
    pub ended: SystemTime,
}

/// The timings and events of one batch, taken by the cycle only while
/// tracing is on, carried with its plan to its receipt.
#[derive(Debug)]
pub(crate) struct BatchTrace {
    /// The claim's round trip: sent, answered. None for a source without
    /// a claim of its own (the WAL's stream).
    pub(crate) claim: Option<(Instant, Instant)>,
    /// The sink's call: started, answered.
    pub(crate) deliver: (Instant, Instant),
    /// When the round trip that makes the outcomes durable was sent (the
    /// polling source stamps it, see [`crate::source::Outcomes::marking`]);
    /// until then, when the batch was planned.
    pub(crate) marking: Instant,
    /// The batch's sink (`Sink::name`): a router's is `router`, its
    /// events' are their routes' sinks.
    pub(crate) system: &'static str,
    /// The events sent, in order.
    pub(crate) events: Vec<EventTrace>,
}

/// One event sent, as its span needs it.
#[derive(Debug)]
pub(crate) struct EventTrace {
    id: i64,
    event_id: Uuid,
    aggregate_type: String,
    event_type: String,
    /// `traceparent` and `tracestate` (if any) of the row's headers.
    headers: serde_json::Value,
    created_at: DateTime<Utc>,
    /// The route that sent it, and its sink.
    route: String,
    system: &'static str,
    /// The sink's refusal, if it refused it.
    error: Option<String>,
}

impl BatchTrace {
    /// The trace of `sent` (the rows given to the sink) and the sink's
    /// answers, one per row.
    pub(crate) fn new(
        sink: &dyn Sink,
        claim: Option<(Instant, Instant)>,
        deliver: (Instant, Instant),
        sent: &[OutboxRow],
        answers: &[Delivery],
    ) -> Self {
        let events = sent
            .iter()
            .zip(answers)
            .map(|(row, answer)| {
                let (route, system) = sink.route_of(&row.aggregate_type);
                let mut headers = serde_json::Map::new();
                for key in ["traceparent", "tracestate"] {
                    if let Some(value) = row.headers.get(key) {
                        headers.insert(key.to_owned(), value.clone());
                    }
                }
                EventTrace {
                    id: row.id,
                    event_id: row.event_id,
                    aggregate_type: row.aggregate_type.clone(),
                    event_type: row.event_type.clone(),
                    headers: serde_json::Value::Object(headers),
                    created_at: row.created_at,
                    route: route.to_owned(),
                    system,
                    error: answer.as_ref().err().map(ToString::to_string),
                }
            })
            .collect();
        Self {
            claim,
            deliver,
            marking: Instant::now(),
            system: sink.name(),
            events,
        }
    }

    /// The route every event went to, if they share one.
    fn destination(&self) -> Option<&str> {
        let first = self.events.first()?.route.as_str();
        self.events.iter().all(|e| e.route == first).then_some(first)
    }
}

/// The context in an event's headers (`traceparent`, `tracestate`, W3C
/// trace context); an empty context when there is none or it is invalid.
fn remote_context(headers: &serde_json::Value) -> Context {
    let mut carrier = HashMap::new();
    for key in ["traceparent", "tracestate"] {
        if let Some(value) = headers.get(key).and_then(serde_json::Value::as_str) {
            carrier.insert(key.to_owned(), value.to_owned());
        }
    }
    if carrier.is_empty() {
        return Context::new();
    }
    TraceContextPropagator::new().extract_with_context(&Context::new(), &carrier)
}

/// `endpoint` as the traces URL: a base URL gets `/v1/traces`.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with(TRACES_PATH) {
        base.to_owned()
    } else {
        format!("{base}{TRACES_PATH}")
    }
}

/// Monotonic instants as wall-clock times, from one reading of both.
struct Clock {
    instant: Instant,
    system: SystemTime,
}

impl Clock {
    fn now() -> Self {
        Self {
            instant: Instant::now(),
            system: SystemTime::now(),
        }
    }

    fn at(&self, instant: Instant) -> SystemTime {
        match self.instant.checked_duration_since(instant) {
            Some(ago) => self.system - ago,
            None => self.system + instant.duration_since(self.instant),
        }
    }
}

/// The OTLP exporter, saying once that exports fail (with the endpoint
/// down every batch's export fails: one line, not one per batch) and once
/// that they work again. The SDK's own logs are off (no `internal-logs`).
#[derive(Debug)]
struct Warned {
    inner: opentelemetry_otlp::SpanExporter,
    failing: AtomicBool,
}

impl Warned {
    fn new(inner: opentelemetry_otlp::SpanExporter) -> Self {
        Self {
            inner,
            failing: AtomicBool::new(false),
        }
    }
}

impl SpanExporter for Warned {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Err(error) if !self.failing.swap(true, Ordering::Relaxed) => warn!(
                %error,
                spans,
                "exporting spans failed; spans are dropped until the collector takes them again \
                 (said once; events are delivered as usual)"
            ),
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => info!("exporting spans again"),
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_gets_the_traces_path() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    }

    #[test]
    fn the_event_context_is_read_from_its_headers() {
        let headers = serde_json::json!({
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        });
        let cx = remote_context(&headers);
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_remote());
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(!remote_context(&serde_json::json!({"traceparent": "junk"})).has_active_span());
        assert!(!remote_context(&serde_json::json!({})).has_active_span());
    }
}
