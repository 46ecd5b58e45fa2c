//! An OTLP/HTTP trace receiver: a real HTTP server that takes what an
//! OpenTelemetry exporter sends to `POST /v1/traces` (protobuf
//! `ExportTraceServiceRequest`, decoded with the official definitions of
//! the `opentelemetry-proto` crate) and keeps every span for assertions, the
//! way a collector would receive it. It answers 200 with an empty
//! `ExportTraceServiceResponse`; other paths get 404, JSON bodies 415 (the
//! relay sends protobuf). It owns no opinion on what the spans mean: tests
//! do the asserting.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::Error;
use crate::support::lock;

/// One span as the receiver got it, its ids in lowercase hex.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: Option<String>,
    /// The instrumentation scope's name (the tracer's).
    pub scope: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// None for a root span.
    pub parent_span_id: Option<String>,
    /// The span's name.
    pub name: String,
    /// The OTLP `SpanKind` number (1 internal, 2 server, 3 client, 4
    /// producer, 5 consumer).
    pub kind: i32,
    /// Unix nanoseconds.
    pub start_unix_nano: u64,
    /// Unix nanoseconds.
    pub end_unix_nano: u64,
    /// Attributes, their values as JSON (strings, numbers, booleans).
    pub attributes: Vec<(String, serde_json::Value)>,
    /// Links: (trace id, span id).
    pub links: Vec<(String, String)>,
    /// The OTLP status code (0 unset, 1 ok, 2 error).
    pub status: i32,
}

impl ReceivedSpan {
    /// The value of attribute `key`.
    pub fn attribute(&self, key: &str) -> Option<&serde_json::Value> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The value of string attribute `key`.
    pub fn str_attribute(&self, key: &str) -> Option<&str> {
        self.attribute(key).and_then(serde_json::Value::as_str)
    }
}

/// The receiver: start it, give its [`endpoint`](Self::endpoint) to the
/// exporter (as `OTEL_EXPORTER_OTLP_ENDPOINT`, or a relay's
/// `--otlp-endpoint`), read [`spans`](Self::spans). Dropping it stops the
/// server.
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: SocketAddr,
    state: Arc<Shared>,
    _stop: oneshot::Sender<()>,
    _server: JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    spans: Mutex<Vec<ReceivedSpan>>,
    /// How many spans are in `spans`; waiters watch it.
    count: watch::Sender<usize>,
    /// Export requests taken.
    requests: Mutex<usize>,
}

impl OtlpReceiver {
    /// Starts the server on 127.0.0.1 and a free port; returns once it is
    /// listening.
    pub async fn start() -> Result<Self, Error> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(Error::io("binding the OTLP receiver to 127.0.0.1"))?;
        let addr = listener
            .local_addr()
            .map_err(Error::io("reading the OTLP receiver's address"))?;
        let state = Arc::new(Shared {
            spans: Mutex::new(Vec::new()),
            count: watch::Sender::new(0),
            requests: Mutex::new(0),
        });
        let app = Router::new()
            .route("/v1/traces", post(export))
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::clone(&state));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::warn!(error = %e, "testkit OTLP receiver failed");
            }
        });
        Ok(Self {
            addr,
            state,
            _stop: stop,
            _server: server,
        })
    }

    /// The base URL an exporter takes (`http://127.0.0.1:PORT`); spans go to
    /// its `/v1/traces`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        lock(&self.state.spans).clone()
    }

    /// Export requests received so far.
    pub fn requests(&self) -> usize {
        *lock(&self.state.requests)
    }

    /// Waits until `done` holds for the spans received, and returns them.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Result<Vec<ReceivedSpan>, Error> {
        let mut count = self.state.count.subscribe();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                // The guard of `borrow_and_update` is dropped before the
                // spans are locked (`export` locks them, then the channel).
                let _ = *count.borrow_and_update();
                let spans = self.spans();
                if done(&spans) {
                    return spans;
                }
                if count.changed().await.is_err() {
                    // The sender lives in `self.state`: never closed while
                    // we borrow `self`.
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        waited.map_err(|_| Error::Timeout {
            waiting_for: format!("{what} at {}", self.endpoint()),
            timeout,
            detail: format!(
                "{} span(s) in {} request(s) arrived",
                lock(&self.state.spans).len(),
                self.requests()
            ),
        })
    }
}

/// `POST /v1/traces`: decodes the request and keeps its spans.
async fn export(State(state): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let protobuf = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-protobuf"));
    if !protobuf {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "protobuf only").into_response();
    }
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(request) => request,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans.resource.as_ref().and_then(|r| {
            r.attributes
                .iter()
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| json(kv.value.as_ref()).as_str().map(str::to_owned))
        });
        for scope_spans in resource_spans.scope_spans {
            let scope = scope_spans.scope.map(|s| s.name).unwrap_or_default();
            for span in scope_spans.spans {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    scope: scope.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: (!span.parent_span_id.is_empty()).then(|| hex(&span.parent_span_id)),
                    name: span.name,
                    kind: span.kind,
                    start_unix_nano: span.start_time_unix_nano,
                    end_unix_nano: span.end_time_unix_nano,
                    attributes: attributes(&span.attributes),
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    status: span.status.map_or(0, |s| s.code),
                });
            }
        }
    }
    *lock(&state.requests) += 1;
    let mut spans = lock(&state.spans);
    spans.extend(received);
    state.count.send_replace(spans.len());
    drop(spans);
    let answer = ExportTraceServiceResponse {
        partial_success: None,
    };
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        answer.encode_to_vec(),
    )
        .into_response()
}

fn attributes(kvs: &[KeyValue]) -> Vec<(String, serde_json::Value)> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), json(kv.value.as_ref())))
        .collect()
}

/// An attribute's value as JSON; arrays and maps as JSON arrays and
/// objects, bytes as hex.
fn json(value: Option<&AnyValue>) -> serde_json::Value {
    use serde_json::Value as J;
    match value.and_then(|v| v.value.as_ref()) {
        None => J::Null,
        Some(any_value::Value::StringValue(s)) => J::String(s.clone()),
        Some(any_value::Value::BoolValue(b)) => J::Bool(*b),
        Some(any_value::Value::IntValue(i)) => J::from(*i),
        Some(any_value::Value::DoubleValue(d)) => J::from(*d),
        Some(any_value::Value::BytesValue(b)) => J::String(hex(b)),
        Some(any_value::Value::ArrayValue(a)) => J::Array(a.values.iter().map(|v| json(Some(v))).collect()),
        Some(any_value::Value::KvlistValue(kv)) => J::Object(
            kv.values
                .iter()
                .map(|kv| (kv.key.clone(), json(kv.value.as_ref())))
                .collect(),
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
