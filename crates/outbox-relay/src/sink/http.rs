//! HTTP sink: one `POST` per event, its body and headers as `--format` says
//! ([`super::format`]).
//!
//! Events of one aggregate are sent in id order, each only after the previous
//! one was acknowledged; if one fails, the rest of that aggregate in the batch
//! is held back (not sent, not counted as an attempt) so nothing overtakes
//! it. Different aggregates are sent concurrently, up to `--http-concurrency`.
//!
//! Status mapping ([`Answer::of`]):
//!
//! - 2xx: delivered.
//! - 502, 503, 504, 429: the receiver (or the proxy in front of it) is
//!   unavailable, not the event failing: no attempt is spent, the relay's
//!   breaker opens and probes the receiver before sending again, so an
//!   outage or a rollout of any length makes no dead letter.
//! - 408, 500 and the other 5xx: the event failed and is retried, an
//!   attempt each, until the retry window ends (`--retry-for`).
//! - Any other status (4xx, 3xx): permanent, the receiver refused the event
//!   itself; a dead letter at once.
//!
//! A `Retry-After` header (seconds or an HTTP date) on a failed answer sets
//! the earliest next attempt, and on an unavailable one the earliest next
//! probe too. No answer at all (refused, reset, DNS, TLS, a timeout) is
//! unavailable as well.
//!
//! The failure recorded (`last_error`) keeps the status and the first KiB
//! of the answer's body, where receivers say why (`HTTP 400 Bad Request:
//! {"error":"schema v2 required"}`). The body is untrusted: cut on a char
//! boundary, control characters replaced, so it cannot forge log lines.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use outbox::OutboxRow;
use outbox::webhooks::{self, WebhookSecret};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Client, StatusCode};
use url::Url;

use super::format::{Formatter, Protocol};
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};
use crate::error::error_chain;

/// `--http-concurrency`'s default.
const DEFAULT_CONCURRENCY: u16 = 16;

/// The HTTP sink's options. Each field is a flag of `outbox relay`, the
/// environment variable beside it, and the routes file's key of the same
/// name (the flag with underscores).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct HttpOptions {
    // The doc comment is also `--help`'s text, verbatim.
    #[allow(rustdoc::invalid_html_tags)]
    /// Sign HTTP requests with this Standard Webhooks secret (whsec_<base64>).
    #[arg(
        id = "http_secret",
        value_name = "HTTP_SECRET",
        long = "http-secret",
        env = "OUTBOX_HTTP_SECRET",
        hide_env_values = true
    )]
    #[serde(rename = "http_secret")]
    pub secret: Option<String>,
    /// Aggregates an HTTP batch sends to concurrently.
    #[arg(
        id = "http_concurrency",
        value_name = "HTTP_CONCURRENCY",
        long = "http-concurrency",
        env = "OUTBOX_HTTP_CONCURRENCY",
        default_value_t = DEFAULT_CONCURRENCY,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    #[serde(rename = "http_concurrency")]
    pub concurrency: u16,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            secret: None,
            concurrency: DEFAULT_CONCURRENCY,
        }
    }
}

/// Delivers to an HTTP endpoint.
pub struct HttpSink {
    client: Client,
    url: Url,
    concurrency: usize,
    secret: Option<WebhookSecret>,
    formatter: Formatter,
}

impl HttpSink {
    /// A request that got no answer, for `last_error` and the logs: the
    /// URL with its query values masked (they may hold the receiver's
    /// token), then reqwest's causes without the URL it would repeat.
    fn failed(&self, e: reqwest::Error) -> String {
        let url = crate::redact::url(self.url.as_str());
        format!("http {url}: {}", error_chain(&e.without_url()))
    }

    /// A sink posting to `url`.
    pub fn new(url: Url, options: &SinkOptions) -> Result<Self, SinkError> {
        let client = Client::builder()
            .timeout(options.timeout)
            .connect_timeout(options.timeout)
            .user_agent(concat!("outbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| SinkError::InvalidUrl {
                url: url.to_string(),
                reason: format!("building the HTTP client: {e}"),
            })?;
        let own = &options.per_sink.http;
        let secret = own
            .secret
            .as_deref()
            .map(WebhookSecret::parse)
            .transpose()
            .map_err(|e| SinkError::InvalidOption {
                option: "--http-secret",
                reason: e.to_string(),
            })?;
        Ok(Self {
            client,
            url,
            concurrency: usize::from(own.concurrency).max(1),
            secret,
            formatter: options.formatter.clone(),
        })
    }

    async fn send(&self, row: &OutboxRow) -> Delivery {
        let message = self.formatter.message(row, Protocol::Http);
        let body = message.body;
        let event_id = row.event_id.to_string();
        let mut headers = HeaderMap::new();
        for (name, value) in &message.headers {
            let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) else {
                return Err(DeliveryError::permanent(format!(
                    "header {name:?} cannot be an HTTP header"
                )));
            };
            headers.append(name, value);
        }
        if let Some(content_type) = message.content_type {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        }
        // `insert` after the format's headers, so a row header cannot
        // replace the dedup key or the signature.
        let value = |v: &str| HeaderValue::try_from(v).map_err(|e| DeliveryError::permanent(e.to_string()));
        headers.insert("Idempotency-Key", value(&event_id)?);
        if let Some(secret) = &self.secret {
            // A fresh timestamp and signature per attempt, the same id on
            // every one, as the specification asks.
            let timestamp = chrono::Utc::now().timestamp();
            headers.insert(webhooks::ID_HEADER, value(&event_id)?);
            headers.insert(webhooks::TIMESTAMP_HEADER, value(&timestamp.to_string())?);
            headers.insert(
                webhooks::SIGNATURE_HEADER,
                value(&secret.sign(&event_id, timestamp, &body))?,
            );
        }
        let request = self.client.post(self.url.clone()).headers(headers);
        let response = request.body(body).send().await;
        let response = match response {
            Ok(r) => r,
            Err(e) if e.is_builder() => {
                return Err(DeliveryError::permanent(format!(
                    "building the request: {}",
                    e.without_url()
                )));
            }
            // No status at all (refused, reset, closed mid-request, DNS,
            // TLS, a timeout): the receiver, not this event, is the problem.
            // reqwest's top-level message is often just "error sending
            // request"; the cause is what an operator needs. Without the
            // URL: its query may hold a token, and this goes to
            // `last_error` and the logs.
            Err(e) => return Err(DeliveryError::unavailable(self.failed(e))),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let answer = Answer::of(status);
        let retry_after = retry_after(response.headers());
        let message = match body_excerpt(response).await {
            Some(body) => format!("HTTP {status}: {body}"),
            None => format!("HTTP {status}"),
        };
        Err(answer.error(message, retry_after))
    }

    /// Sends one aggregate's rows in order; after a failure the rest are held back.
    async fn send_in_order(&self, batch: &[OutboxRow], group: Vec<usize>) -> Vec<(usize, Delivery)> {
        let mut out = Vec::with_capacity(group.len());
        let mut failed: Option<i64> = None;
        for i in group {
            let row = &batch[i];
            let delivery = match failed {
                Some(id) => Err(DeliveryError::NotSent {
                    message: format!("held back: earlier event {id} of aggregate failed"),
                }),
                None => self.send(row).await,
            };
            if delivery.is_err() && failed.is_none() {
                failed = Some(row.id);
            }
            out.push((i, delivery));
        }
        out
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        // Indices, not references: a stream of borrowed groups trips the
        // compiler's higher-ranked lifetime inference.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut index: HashMap<(&str, &str), usize> = HashMap::new();
        for (i, row) in batch.iter().enumerate() {
            let key = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
            let g = *index.entry(key).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(i);
        }
        let mut results: Vec<Option<Delivery>> = vec![None; batch.len()];
        let mut sent = futures::stream::iter(groups)
            .map(|g| self.send_in_order(batch, g))
            .buffer_unordered(self.concurrency);
        while let Some(group) = sent.next().await {
            for (i, d) in group {
                results[i] = Some(d);
            }
        }
        results
            .into_iter()
            .map(|d| d.unwrap_or_else(|| Err(DeliveryError::retryable("not sent"))))
            .collect()
    }
}

/// What a status that is not a success says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The receiver is not there to take events: no attempt spent.
    Unavailable,
    /// The event failed; worth an attempt later.
    Retryable,
    /// The receiver refused the event.
    Permanent,
}

impl Answer {
    fn of(status: StatusCode) -> Self {
        match status {
            StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
            | StatusCode::TOO_MANY_REQUESTS => Self::Unavailable,
            StatusCode::REQUEST_TIMEOUT => Self::Retryable,
            s if s.is_server_error() => Self::Retryable,
            _ => Self::Permanent,
        }
    }

    fn error(self, message: String, retry_after: Option<Duration>) -> DeliveryError {
        match self {
            Self::Unavailable => DeliveryError::Unavailable { message, retry_after },
            Self::Retryable => DeliveryError::Retryable { message, retry_after },
            Self::Permanent => DeliveryError::permanent(message),
        }
    }
}

/// How much of an answer's body the failure keeps.
const BODY_EXCERPT: usize = 1024;

/// The first [`BODY_EXCERPT`] bytes of a failed answer's body as text (cut
/// on a char boundary, `…` if cut), control characters replaced by spaces;
/// None if empty. Reads no more of the body than that, whatever the
/// receiver sends, within the request's timeout; a body that breaks off
/// keeps what arrived.
async fn body_excerpt(mut response: reqwest::Response) -> Option<String> {
    let mut bytes: Vec<u8> = Vec::new();
    // A char is at most 4 bytes: enough to finish the one at the cut.
    while bytes.len() < BODY_EXCERPT + 4 {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                bytes.extend_from_slice(&chunk[..chunk.len().min(BODY_EXCERPT + 4 - bytes.len())])
            }
            Ok(None) | Err(_) => break,
        }
    }
    excerpt(&bytes)
}

/// See [`body_excerpt`].
fn excerpt(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    // `str::floor_char_boundary` is newer than the workspace's MSRV.
    let mut cut = BODY_EXCERPT.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out: String = text[..cut]
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_owned();
    if out.is_empty() {
        return None;
    }
    if cut < text.len() {
        out.push('…');
    }
    Some(out)
}

/// `Retry-After` as delta-seconds or an HTTP date.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

impl Sink for HttpSink {
    fn name(&self) -> &'static str {
        "http"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    /// A `HEAD` request to the URL: an answer says the receiver is there
    /// (a 404 or 405 too: many receivers take only `POST`), except an
    /// unavailable one (502, 503, 504, 429), which a load balancer gives
    /// for every method while the receiver is down or rolling out. Its
    /// `Retry-After` sets the next probe.
    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            match self.client.head(self.url.clone()).send().await {
                Ok(r) if Answer::of(r.status()) == Answer::Unavailable => Err(DeliveryError::Unavailable {
                    message: format!("HTTP {} (probe)", r.status()),
                    retry_after: retry_after(r.headers()),
                }),
                Ok(_) => Ok(()),
                Err(e) => Err(DeliveryError::unavailable(self.failed(e))),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_statuses() {
        let of = |s: u16| Answer::of(StatusCode::from_u16(s).unwrap());
        for s in [502, 503, 504, 429] {
            assert_eq!(of(s), Answer::Unavailable, "{s}");
        }
        for s in [408, 500, 501, 505, 599] {
            assert_eq!(of(s), Answer::Retryable, "{s}");
        }
        for s in [301, 400, 401, 403, 404, 409, 410, 413, 422] {
            assert_eq!(of(s), Answer::Permanent, "{s}");
        }
    }

    #[test]
    fn keeps_a_kib_of_the_body_on_a_char_boundary_without_control_characters() {
        assert_eq!(
            excerpt(br#"{"error":"bad request: schema v2 required"}"#).as_deref(),
            Some(r#"{"error":"bad request: schema v2 required"}"#)
        );
        assert_eq!(excerpt(b""), None);
        assert_eq!(excerpt(b" \r\n"), None);
        assert_eq!(
            excerpt(b"line 1\nWARN forged\x1b[31m").as_deref(),
            Some("line 1 WARN forged [31m")
        );
        // 1023 ASCII bytes, then a 3-byte char across the cut: left out.
        let mut long = vec![b'a'; BODY_EXCERPT - 1];
        long.extend("€€".as_bytes());
        let cut = excerpt(&long).unwrap();
        assert_eq!(cut, format!("{}…", "a".repeat(BODY_EXCERPT - 1)));
        // Invalid UTF-8 is replaced, not refused.
        assert_eq!(excerpt(b"ok \xff").as_deref(), Some("ok \u{fffd}"));
    }

    #[test]
    fn parses_retry_after() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), None);
    }

    /// A refused connection is reported without the URL: its query may
    /// carry the receiver's token, and the message goes to `last_error`
    /// and the logs.
    #[tokio::test]
    async fn a_failure_does_not_repeat_the_urls_token() {
        // A port nothing listens on: bind one, then let it go.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = Url::parse(&format!("http://127.0.0.1:{port}/hook?token=s3cr3t")).unwrap();
        let sink = HttpSink::new(url, &SinkOptions::default()).unwrap();
        let row = crate::plan::tests::row(1, "1");
        let answers = sink.deliver(std::slice::from_ref(&row)).await;
        let message = answers[0].clone().unwrap_err().to_string();
        assert!(!message.contains("s3cr3t"), "{message}");
        let probe = sink.probe().await.unwrap_err().to_string();
        assert!(!probe.contains("s3cr3t"), "{probe}");
    }
}
