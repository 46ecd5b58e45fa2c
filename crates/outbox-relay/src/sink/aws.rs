//! What the SQS and SNS sinks share: the AWS SDK's configuration (the
//! default credential and region chains, an endpoint override, timeouts,
//! no retries of its own), message attributes within AWS's limit of ten,
//! the size of a message as AWS counts it, and sending a batch in batch
//! calls of ten without overtaking a failed event of the same aggregate.
//!
//! It owns no protocol: each sink builds its own entries from the
//! [`messages`] of a batch (which stores in S3 those over the limit when
//! the sink has a [`ClaimCheck`]) and makes its own call ([`deliver`] is
//! given the call), and classifies what AWS answered with
//! [`classify_entry`] and [`CallError`].
//!
//! Order: a batch goes out in *waves*, each holding at most one event per
//! aggregate (the first not yet sent), split into batch calls of up to ten
//! entries and [`MAX_BATCH_BYTES`]-or-the-queue's-limit bytes, sent
//! [`CONCURRENCY`] at a time. The next wave starts when every call of the
//! previous one answered, and an aggregate whose event failed sends nothing
//! more in this batch: its later events answer
//! [`DeliveryError::NotSent`], so no event is reported delivered while an
//! earlier one of its aggregate is not, and a FIFO queue or topic (which
//! keeps the order in which it accepted messages per `MessageGroupId`)
//! never holds an aggregate's events out of order. A batch whose
//! aggregates are all different (the common case) is one wave.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
// The SDK's error types are smithy's, the same in every service's crate;
// S3's is the one both sinks have.
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use futures::StreamExt;
use outbox::OutboxRow;
use serde_json::Value;

use super::claim_check::{self, ClaimCheck, Stored};
use super::format::{Format, Formatter, Protocol};
use super::{Delivery, DeliveryError, SinkError};

/// The most message attributes SQS (and SNS delivering to SQS) accepts on
/// one message.
pub const MAX_ATTRIBUTES: usize = 10;
/// The most entries one `SendMessageBatch` or `PublishBatch` takes.
pub const MAX_BATCH_ENTRIES: usize = 10;
/// 256 KiB: SNS's limit on a message and on a whole `PublishBatch`, and
/// the size limit of an SQS queue whose `MaximumMessageSize` cannot be read.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;
/// Batch calls in flight at once within one wave.
pub const CONCURRENCY: usize = 16;
/// The attribute holding, as a JSON object, the headers that did not fit
/// in attributes of their own.
pub const OVERFLOW_ATTRIBUTE: &str = "headers";
/// The data type of every attribute the sinks set but the claim check's.
const STRING: &str = "String";
/// The data type of the claim check's size attribute.
const NUMBER: &str = "Number";

/// The query parameters of an `sqs://` or `sns://` URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// `?region=`: else the default chain (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// `?endpoint=`: else `AWS_ENDPOINT_URL_SQS` / `_SNS`,
    /// `AWS_ENDPOINT_URL`, the profile's `endpoint_url`, or AWS's own.
    pub endpoint: Option<String>,
    /// `?account=`: the account that owns the queue or topic, when a name
    /// is given rather than its URL or ARN.
    pub account: Option<String>,
    /// `?claim-check=s3://…` and the `claim-check-…` options: where
    /// messages over the limit go (see [`claim_check`]).
    pub claim_check: Option<claim_check::Settings>,
}

/// Splits `scheme://rest?query` into `rest` and the parsed query.
pub fn split_url(url: &str, scheme: &str) -> Result<(String, Settings), SinkError> {
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let prefix = format!("{scheme}://");
    let rest = url
        .strip_prefix(&prefix)
        .ok_or_else(|| invalid(format!("not an {prefix} URL")))?;
    let (target, query) = rest.split_once('?').unwrap_or((rest, ""));
    if target.contains('#') {
        return Err(invalid("a fragment ('#') has no meaning here".to_owned()));
    }
    let mut settings = Settings::default();
    // The claim check's options, checked once its location is known.
    let mut over = None;
    let mut legacy = None;
    let mut path_style = None;
    for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
        let value = value.into_owned();
        if value.is_empty() {
            return Err(invalid(format!("?{key}= is empty")));
        }
        let slot = match key.as_ref() {
            "claim-check" => {
                settings.claim_check = Some(claim_check::Settings::location(&value).map_err(invalid)?);
                continue;
            }
            "claim-check-over" => {
                over =
                    Some(value.parse::<usize>().map_err(|_| {
                        invalid(format!("claim-check-over {value:?} is not a number of bytes"))
                    })?);
                continue;
            }
            "claim-check-legacy" => {
                legacy = Some(boolean(&key, &value).map_err(invalid)?);
                continue;
            }
            "claim-check-path-style" => {
                path_style = Some(boolean(&key, &value).map_err(invalid)?);
                continue;
            }
            "region" => {
                if !value
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                {
                    return Err(invalid(format!(
                        "region {value:?} is not a region name (e.g. us-east-1)"
                    )));
                }
                &mut settings.region
            }
            "endpoint" => {
                let parsed = url::Url::parse(&value)
                    .map_err(|e| invalid(format!("endpoint {value:?} is not a URL: {e}")))?;
                if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
                    return Err(invalid(format!(
                        "endpoint {value:?} is not an http:// or https:// URL with a host"
                    )));
                }
                &mut settings.endpoint
            }
            "account" => {
                if value.len() != 12 || !value.chars().all(|c| c.is_ascii_digit()) {
                    return Err(invalid(format!(
                        "account {value:?} is not a 12-digit AWS account id"
                    )));
                }
                &mut settings.account
            }
            other => {
                return Err(invalid(format!(
                    "unknown parameter {other:?} (known: region, endpoint, account, claim-check, \
                     claim-check-over, claim-check-legacy, claim-check-path-style)"
                )));
            }
        };
        *slot = Some(value);
    }
    match settings.claim_check.as_mut() {
        Some(claim_check) => {
            claim_check.over = over;
            claim_check.legacy = legacy.unwrap_or(false);
            claim_check.path_style = path_style;
        }
        None if over.is_some() || legacy.is_some() || path_style.is_some() => {
            return Err(invalid(
                "the claim-check-… options need ?claim-check=s3://<bucket>[/<prefix>]".to_owned(),
            ));
        }
        None => {}
    }
    Ok((target.to_owned(), settings))
}

/// `true` or `false`.
fn boolean(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{key} {value:?} is neither true nor false")),
    }
}

/// The SDK configuration: credentials from the default chain (environment,
/// shared config and credentials files, web identity, SSO, the container
/// and instance metadata), the region and endpoint from `settings` or the
/// same chains. The SDK neither retries (the relay schedules retries, so
/// each is visible in the table) nor waits longer than `timeout` for a
/// connection or a call.
pub async fn sdk_config(settings: &Settings, timeout: Duration) -> SdkConfig {
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .retry_config(RetryConfig::disabled())
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(timeout)
                .operation_timeout(timeout)
                .build(),
        );
    if let Some(region) = &settings.region {
        loader = loader.region(Region::new(region.clone()));
    }
    if let Some(endpoint) = &settings.endpoint {
        loader = loader.endpoint_url(endpoint.clone());
    }
    loader.load().await
}

/// Why `config` cannot be used, if it cannot: without a region the SDK
/// fails every call with a message that does not say how to fix it.
pub fn config_problem(config: &SdkConfig, service: &str) -> Option<String> {
    config.region().is_none().then(|| {
        format!("{service}: no AWS region: set AWS_REGION, a profile's `region`, or ?region= in the sink URL")
    })
}

/// Whether a queue or topic name is a FIFO one.
pub fn is_fifo(name: &str) -> bool {
    name.ends_with(".fifo")
}

/// Why `name` is not a queue or topic name, if it is not: 1 to `max`
/// letters, digits, `-` and `_`, with an optional `.fifo` suffix counted in.
pub fn name_problem(name: &str, max: usize) -> Option<String> {
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    if base.is_empty() {
        return Some("empty".to_owned());
    }
    if name.len() > max {
        return Some(format!("longer than {max} characters"));
    }
    base.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_')))
        .map(|c| format!("{c:?} is not allowed (only a-z, A-Z, 0-9, '-', '_', and a '.fifo' suffix)"))
}

/// Why `id` cannot be a `MessageGroupId`, if it cannot: 1 to 128 ASCII
/// letters, digits and punctuation.
pub fn group_id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        return Some("it is empty".to_owned());
    }
    if id.len() > 128 {
        return Some("it is longer than 128 characters".to_owned());
    }
    id.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || c.is_ascii_punctuation()))
        .map(|c| format!("{c:?} is not allowed (only ASCII letters, digits and punctuation)"))
}

/// One event as an SQS or SNS message: its body and string attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The body.
    pub body: String,
    /// The message attributes, at most [`MAX_ATTRIBUTES`] with
    /// [`offloaded`](Self::offloaded)'s, in order.
    pub attributes: Vec<(String, String)>,
    /// Where the claim check stored the body, when it did: the body is
    /// its pointer, and the message has one more attribute, of type `Number`.
    pub offloaded: Option<Stored>,
}

impl Message {
    /// `row` as a message. The body is what `--format` gives an HTTP
    /// receiver (native: the JSON document with every row header in
    /// `headers`; CloudEvents structured: the event; binary and Debezium:
    /// the payload). Attributes: `id` (the event_id, in every format, so a
    /// consumer of a standard queue can drop re-sends), `content-type` when
    /// the format names one, then the format's headers (CloudEvents binary
    /// `ce-…`, Debezium `key`, the row's headers) in order; those that do
    /// not fit in ten, or whose name or value SQS refuses, go together as a
    /// JSON object in the last one, `headers`. `room` is how many
    /// attributes it may have: [`MAX_ATTRIBUTES`], or one fewer to leave
    /// the claim check its own.
    pub fn of(formatter: &Formatter, row: &OutboxRow, room: usize) -> Message {
        let formatted = formatter.message(row, Protocol::Http);
        // The native HTTP body carries the headers; attributes copy them,
        // for filter policies and consumers that read only attributes.
        let headers = if formatter.format() == Format::Native {
            row_headers(&row.headers)
        } else {
            formatted.headers
        };
        let body = String::from_utf8(formatted.body)
            // The formatter writes JSON text, which is UTF-8.
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        Message {
            body,
            attributes: attributes(&row.event_id.to_string(), formatted.content_type, headers, room),
            offloaded: None,
        }
    }

    /// The `content-type` attribute, if the format gave one.
    fn content_type(&self) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(name, _)| name == "content-type")
            .map(|(_, value)| value.as_str())
    }

    /// The size AWS counts against its limit: the body plus each
    /// attribute's name, data type and value.
    pub fn bytes(&self) -> usize {
        let offloaded = self
            .offloaded
            .as_ref()
            .map_or(0, |s| number_bytes(s.attribute, s.bytes));
        self.body.len() + offloaded + self.attribute_bytes()
    }

    /// The body, and every attribute as name, data type and value (the
    /// claim check's size attribute last).
    pub fn into_parts(self) -> (String, Vec<(String, &'static str, String)>) {
        let offloaded = self
            .offloaded
            .map(|s| (s.attribute.to_owned(), NUMBER, s.bytes.to_string()));
        let attributes = self
            .attributes
            .into_iter()
            .map(|(name, value)| (name, STRING, value))
            .chain(offloaded)
            .collect();
        (self.body, attributes)
    }

    /// What the string attributes add to [`bytes`](Self::bytes).
    fn attribute_bytes(&self) -> usize {
        self.attributes
            .iter()
            .map(|(name, value)| name.len() + STRING.len() + value.len())
            .sum()
    }
}

/// What a `Number` attribute adds to a message's size.
fn number_bytes(name: &str, value: usize) -> usize {
    name.len() + NUMBER.len() + value.to_string().len()
}

/// A row's `headers` object as pairs: strings as they are, anything else
/// as its JSON text.
fn row_headers(headers: &Value) -> Vec<(String, String)> {
    headers
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
        .collect()
}

/// The attributes of a message: see [`Message::of`].
fn attributes(
    event_id: &str,
    content_type: Option<&str>,
    headers: Vec<(String, String)>,
    room: usize,
) -> Vec<(String, String)> {
    let mut out = vec![("id".to_owned(), event_id.to_owned())];
    if let Some(content_type) = content_type {
        out.push(("content-type".to_owned(), content_type.to_owned()));
    }
    let reserved = ["id", "content-type", OVERFLOW_ATTRIBUTE];
    // The extended clients take a message with a size attribute for a
    // pointer to S3, so no row header may pose as one.
    let claim_check = [claim_check::SIZE_ATTRIBUTE, claim_check::LEGACY_SIZE_ATTRIBUTE];
    let mut fitting = Vec::new();
    let mut overflow = Vec::new();
    for (name, value) in headers {
        if reserved.contains(&name.as_str()) {
            // The sink's own: a row header cannot replace them (the
            // Debezium `id` is the event_id anyway).
            continue;
        }
        if attribute_name_problem(&name).is_none()
            && value_ok(&value)
            && !claim_check.contains(&name.as_str())
        {
            fitting.push((name, value));
        } else {
            overflow.push((name, value));
        }
    }
    let room = room.min(MAX_ATTRIBUTES) - out.len();
    if fitting.len() > room || (!overflow.is_empty() && fitting.len() == room) {
        let keep = room - 1;
        let mut rest = fitting.split_off(keep);
        rest.extend(overflow);
        overflow = rest;
    }
    out.extend(fitting);
    if !overflow.is_empty() {
        let object: serde_json::Map<String, Value> =
            overflow.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
        out.push((OVERFLOW_ATTRIBUTE.to_owned(), Value::Object(object).to_string()));
    }
    out
}

/// Why SQS would refuse `name` as a message attribute name, if it would:
/// 1 to 256 of `[A-Za-z0-9_.-]`, no leading, trailing or double `.`, not
/// starting with `AWS.` or `Amazon.` in any case.
pub fn attribute_name_problem(name: &str) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    if name.is_empty() || name.len() > 256 {
        Some("must be 1 to 256 characters")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some("only a-z, A-Z, 0-9, '_', '-' and '.' are allowed")
    } else if name.starts_with('.') || name.ends_with('.') || name.contains("..") {
        Some("no leading, trailing or double '.'")
    } else if lower.starts_with("aws.") || lower.starts_with("amazon.") {
        Some("the prefixes AWS. and Amazon. are reserved")
    } else {
        None
    }
}

/// Whether SQS takes `value` as a string attribute's value: not empty, and
/// only the characters it allows in a message.
fn value_ok(value: &str) -> bool {
    !value.is_empty() && value.chars().all(char_ok)
}

/// The characters SQS allows in a message: `#x9 | #xA | #xD | #x20 to
/// #xD7FF | #xE000 to #xFFFD | #x10000 to #x10FFFF`.
fn char_ok(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

/// The permanent failure of a message over `limit` bytes.
pub fn too_large(service: &str, bytes: usize, limit: usize, what: &str) -> DeliveryError {
    DeliveryError::permanent(format!(
        "{service}: message too large: {bytes} bytes (body and attributes), over the limit of {limit} bytes \
         ({what}); it was not sent"
    ))
}

/// Each row of `batch` as the message to send (`service`'s, to a queue or
/// topic that takes `limit` bytes, the limit being `what`), or why it
/// cannot be sent. A message over the limit is a permanent failure, unless
/// the sink has a claim check: then it, and any over the claim check's
/// threshold, is stored in S3 (up to [`CONCURRENCY`] at once) and replaced
/// by its pointer; that failing leaves its row unsent (see
/// [`claim_check`]).
pub async fn messages(
    service: &str,
    formatter: &Formatter,
    batch: &[OutboxRow],
    (limit, what): (usize, &str),
    claim_check: Option<&ClaimCheck>,
) -> Vec<Result<Message, DeliveryError>> {
    let room = MAX_ATTRIBUTES - usize::from(claim_check.is_some());
    let mut out: Vec<Result<Message, DeliveryError>> = batch
        .iter()
        .map(|row| Ok(Message::of(formatter, row, room)))
        .collect();
    let Some(claim_check) = claim_check else {
        for message in &mut out {
            let bytes = message.as_ref().map_or(0, Message::bytes);
            if bytes > limit {
                *message = Err(too_large(service, bytes, limit, what));
            }
        }
        return out;
    };
    let threshold = claim_check.threshold(limit);
    for message in &mut out {
        let Ok(m) = message else { continue };
        if m.bytes() <= threshold {
            continue;
        }
        // Refused before its body is stored for nothing.
        let stored = m.attribute_bytes()
            + claim_check.pointer_bytes()
            + number_bytes(claim_check.size_attribute(), m.body.len());
        if stored > limit {
            *message = Err(DeliveryError::permanent(format!(
                "{service}: message too large even with its body in S3: {stored} bytes (the pointer and \
                 attributes), over the limit of {limit} bytes ({what}); it was not sent"
            )));
        }
    }
    // Futures built in a loop, not by closures over the iterator: those
    // would make the sink's future not `Send` (their lifetimes are not
    // general enough).
    let mut stores = Vec::new();
    for (i, message) in out.iter().enumerate() {
        if let Ok(m) = message
            && m.bytes() > threshold
        {
            stores.push(async move {
                let stored = claim_check
                    .store(service, &batch[i], &m.body, m.content_type())
                    .await;
                (i, stored)
            });
        }
    }
    let stored: Vec<(usize, Result<Stored, DeliveryError>)> = futures::stream::iter(stores)
        .buffered(CONCURRENCY)
        .collect()
        .await;
    for (i, stored) in stored {
        match (stored, &mut out[i]) {
            (Ok(stored), Ok(message)) => {
                message.body.clone_from(&stored.pointer);
                message.offloaded = Some(stored);
            }
            (Err(e), _) => out[i] = Err(e),
            // Only messages were stored.
            (Ok(_), Err(_)) => {}
        }
    }
    out
}

/// Why a whole batch call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// Not about the events: no connection, a timeout, throttling, a 5xx,
    /// refused credentials, no such queue or topic.
    Unavailable(String),
    /// Worth another attempt later.
    Retryable(String),
    /// The request was refused as invalid (a 4xx sender fault): some entry
    /// is at fault, but the answer does not say which, so each entry is
    /// sent again on its own to find out.
    Refused(String),
}

impl CallError {
    /// The failure of each event of the call.
    pub fn delivery(&self) -> DeliveryError {
        match self {
            Self::Unavailable(m) => DeliveryError::unavailable(m.clone()),
            Self::Retryable(m) => DeliveryError::retryable(m.clone()),
            Self::Refused(m) => DeliveryError::permanent(m.clone()),
        }
    }
}

/// Error codes AWS answers when it throttles.
const THROTTLING: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "KMSThrottlingException",
    "KMSThrottling",
    // SQS spells its KMS codes so (the SDK's `KmsThrottled`).
    "KMS.ThrottlingException",
    // S3's, for the claim check.
    "SlowDown",
];

/// Error codes that mean the credentials or the key, not the event, are at
/// fault: an operator fixes them, and the rows wait without spending an
/// attempt.
const REFUSED_CREDENTIALS: &[&str] = &[
    "AccessDenied",
    "AccessDeniedException",
    "AuthorizationError",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "IncompleteSignature",
    "InvalidSecurity",
    "ExpiredToken",
    "ExpiredTokenException",
    "MissingAuthenticationToken",
    "KMSAccessDeniedException",
    "KMSAccessDenied",
    "KMSDisabledException",
    "KMSDisabled",
    "KMSInvalidStateException",
    "KMSInvalidState",
    "KMSNotFoundException",
    "KMSNotFound",
    "KMSOptInRequired",
    // SQS's, answered with a 400: without them a key the relay may not
    // use made every event a dead letter at once.
    "KMS.AccessDeniedException",
    "KMS.DisabledException",
    "KMS.InvalidKeyUsageException",
    "KMS.InvalidStateException",
    "KMS.NotFoundException",
    "KMS.OptInRequired",
];

/// Error codes that mean the queue or topic does not exist (yet).
const NOT_FOUND: &[&str] = &[
    "QueueDoesNotExist",
    "AWS.SimpleQueueService.NonExistentQueue",
    "NonExistentQueue",
    "NotFound",
    "NotFoundException",
];

/// A whole call's failure, from what the SDK said: `kind` is the SDK's
/// error variant, `code` and `status` are AWS's answer when there was one,
/// `detail` the error with its causes.
pub fn classify_call(service: &str, code: Option<&str>, status: Option<u16>, detail: &str) -> CallError {
    let message = format!("{service}: {detail}");
    match (code, status) {
        (Some(code), _) if THROTTLING.contains(&code) => CallError::Unavailable(message),
        (Some(code), _) if REFUSED_CREDENTIALS.contains(&code) => CallError::Unavailable(message),
        (Some(code), _) if NOT_FOUND.contains(&code) => CallError::Unavailable(format!(
            "{message} (create it, or fix the sink URL; the sink never creates queues or topics)"
        )),
        (_, Some(429)) => CallError::Unavailable(message),
        (_, Some(s)) if s >= 500 => CallError::Unavailable(message),
        (_, Some(s)) if (400..500).contains(&s) => CallError::Refused(message),
        // No answer at all: no connection, a timeout, a response that was
        // not AWS's (a proxy), missing credentials.
        (_, None) => CallError::Unavailable(message),
        _ => CallError::Retryable(message),
    }
}

/// An SDK error of a whole call to `service`, classified: only an answer
/// from AWS (a service error) has a code and status; anything else (no
/// connection, a timeout, a response cut off) got no answer.
pub fn call_error<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    service: &str,
    e: &SdkError<E>,
) -> CallError {
    match e {
        SdkError::ServiceError(context) => {
            let status = context.raw().status().as_u16();
            let detail = format!(
                "{} (HTTP {status}): {}",
                e.code().unwrap_or("unknown error"),
                e.message().unwrap_or("no message")
            );
            classify_call(service, e.code(), Some(status), &detail)
        }
        _ => classify_call(service, None, None, &error_chain(e)),
    }
}

/// A failed lookup (`doing`) of `service`'s queue or topic: the sink cannot
/// deliver yet, whatever AWS said (a missing queue or topic may still be
/// created).
pub fn unavailable<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    service: &str,
    doing: &str,
    e: &SdkError<E>,
) -> DeliveryError {
    let detail = match call_error(service, e) {
        CallError::Unavailable(m) | CallError::Retryable(m) | CallError::Refused(m) => m,
    };
    DeliveryError::unavailable(format!("{doing}: {detail}"))
}

/// `error` and its causes, each once: the SDK's own display repeats a
/// cause's debug form, response and all, which `last_error` need not hold.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// A FIFO entry's `MessageGroupId` (the aggregate id) and
/// `MessageDeduplicationId` (the event id, so AWS drops a re-send within
/// its five-minute window), or why the aggregate id cannot be a group id.
pub fn fifo_ids(service: &str, row: &OutboxRow) -> Result<(String, String), DeliveryError> {
    if let Some(problem) = group_id_problem(&row.aggregate_id) {
        return Err(DeliveryError::permanent(format!(
            "{service}: aggregate id {:?} cannot be a FIFO MessageGroupId: {problem}",
            row.aggregate_id
        )));
    }
    Ok((row.aggregate_id.clone(), row.event_id.to_string()))
}

/// Each entry's answer to a batch call (`call`, e.g. `SendMessageBatch`),
/// in the order of `ids`: delivered when `succeeded` lists it, its failure
/// classified when `failed` gives its code, sender fault and message, and
/// retryable when the answer names it nowhere.
pub fn answers<'a>(
    service: &str,
    call: &str,
    ids: &[String],
    succeeded: impl Fn(&str) -> bool,
    failed: impl Fn(&str) -> Option<(&'a str, bool, Option<&'a str>)>,
) -> Vec<Delivery> {
    ids.iter()
        .map(|id| {
            if succeeded(id) {
                return Ok(());
            }
            match failed(id) {
                Some((code, sender_fault, message)) => {
                    Err(classify_entry(service, code, sender_fault, message))
                }
                None => Err(DeliveryError::retryable(format!(
                    "{service}: {call} did not answer for the entry"
                ))),
            }
        })
        .collect()
}

/// One entry's failure inside a batch answer. A sender fault is the
/// event's (too large, invalid characters, a bad attribute): permanent,
/// unless AWS says it throttled, or refused the credentials or the key
/// (then the sink is unavailable, as for a whole call). Anything else is
/// AWS's: retryable.
pub fn classify_entry(service: &str, code: &str, sender_fault: bool, message: Option<&str>) -> DeliveryError {
    let text = match message {
        Some(m) if !m.is_empty() => format!("{service}: {code}: {m}"),
        _ => format!("{service}: {code}"),
    };
    if REFUSED_CREDENTIALS.contains(&code) {
        DeliveryError::unavailable(text)
    } else if THROTTLING.contains(&code) || !sender_fault {
        DeliveryError::retryable(text)
    } else {
        DeliveryError::permanent(text)
    }
}

/// One entry ready to send: the batch row it is for, its size, and the
/// sink's own request entry (whose batch id is the row's index, unique in
/// any call).
#[derive(Debug, Clone)]
pub struct Entry<T> {
    /// Index of the row in the batch.
    pub row: usize,
    /// [`Message::bytes`].
    pub bytes: usize,
    /// The request entry.
    pub item: T,
}

/// Delivers `batch` given each row's prepared entry (or why it cannot be
/// sent): in waves of one event per aggregate, batch calls of at most
/// [`MAX_BATCH_ENTRIES`] entries and `max_batch_bytes`, as the module
/// documentation says. `send` makes one batch call and answers one
/// [`Delivery`] per entry, in order, or the call's failure.
pub async fn deliver<T, F, Fut>(
    batch: &[OutboxRow],
    prepared: Vec<Result<Entry<T>, DeliveryError>>,
    max_batch_bytes: usize,
    send: F,
) -> Vec<Delivery>
where
    T: Clone,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Result<Vec<Delivery>, CallError>>,
{
    let mut out: Vec<Option<Delivery>> = vec![None; batch.len()];
    // Each aggregate's rows in batch order; `queue_of[i]` is row i's.
    let mut queues: Vec<VecDeque<usize>> = Vec::new();
    let mut queue_of = vec![0; batch.len()];
    let mut index: HashMap<(&str, &str), usize> = HashMap::new();
    for (i, row) in batch.iter().enumerate() {
        let key = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
        let q = *index.entry(key).or_insert_with(|| {
            queues.push(VecDeque::new());
            queues.len() - 1
        });
        queues[q].push_back(i);
        queue_of[i] = q;
    }
    let mut prepared: Vec<Option<Result<Entry<T>, DeliveryError>>> = prepared.into_iter().map(Some).collect();
    let hold_back = |queue: &mut VecDeque<usize>, out: &mut Vec<Option<Delivery>>, failed: &OutboxRow| {
        for j in queue.drain(..) {
            out[j] = Some(Err(DeliveryError::NotSent {
                message: format!(
                    "held back: earlier event {} of aggregate {:?} failed",
                    failed.id, failed.aggregate_id
                ),
            }));
        }
    };

    loop {
        let mut wave: Vec<Entry<T>> = Vec::new();
        for queue in &mut queues {
            let Some(i) = queue.pop_front() else { continue };
            match prepared[i].take() {
                Some(Ok(entry)) => wave.push(entry),
                Some(Err(e)) => {
                    out[i] = Some(Err(e));
                    hold_back(queue, &mut out, &batch[i]);
                }
                // Every row has one prepared entry, taken once.
                None => out[i] = Some(Err(DeliveryError::retryable("internal: no entry prepared"))),
            }
        }
        if wave.is_empty() {
            break;
        }
        wave.sort_by_key(|e| e.row);
        let calls = chunks(wave, max_batch_bytes);
        let answers: Vec<Vec<(usize, Delivery)>> = futures::stream::iter(calls)
            .map(|call| send_call(call, &send))
            .buffered(CONCURRENCY)
            .collect()
            .await;
        let mut unavailable: Option<DeliveryError> = None;
        for (i, delivery) in answers.into_iter().flatten() {
            if let Err(e) = &delivery {
                if e.is_unavailable() {
                    // Its aggregate's later rows answer the same, below.
                    unavailable.get_or_insert_with(|| e.clone());
                } else {
                    hold_back(&mut queues[queue_of[i]], &mut out, &batch[i]);
                }
            }
            out[i] = Some(delivery);
        }
        // The sink is down: what is left would fail the same way, so it is
        // not sent, and answers the same (no attempt spent).
        if let Some(e) = unavailable {
            for queue in &mut queues {
                for j in queue.drain(..) {
                    out[j] = Some(Err(e.clone()));
                }
            }
            break;
        }
    }
    out.into_iter()
        .map(|d| d.unwrap_or_else(|| Err(DeliveryError::retryable("internal: the row was not answered"))))
        .collect()
}

/// Makes one batch call; when AWS refused the whole request as invalid,
/// sends each entry on its own, so only the one at fault fails (for good).
async fn send_call<T, F, Fut>(call: Vec<Entry<T>>, send: &F) -> Vec<(usize, Delivery)>
where
    T: Clone,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Result<Vec<Delivery>, CallError>>,
{
    let rows: Vec<usize> = call.iter().map(|e| e.row).collect();
    let items: Vec<T> = call.iter().map(|e| e.item.clone()).collect();
    match send(items).await {
        Ok(answers) => rows.into_iter().zip(answers).collect(),
        Err(CallError::Refused(_)) if call.len() > 1 => {
            let mut out = Vec::with_capacity(call.len());
            for entry in call {
                let delivery = match send(vec![entry.item]).await {
                    Ok(mut answers) => answers
                        .pop()
                        .unwrap_or_else(|| Err(DeliveryError::retryable("no answer for the entry"))),
                    Err(e) => Err(e.delivery()),
                };
                out.push((entry.row, delivery));
            }
            out
        }
        Err(e) => rows.into_iter().map(|i| (i, Err(e.delivery()))).collect(),
    }
}

/// Splits a wave into batch calls in order: at most [`MAX_BATCH_ENTRIES`]
/// entries, and at most `max_bytes` together (an entry is never larger
/// than that on its own: it was refused as too large before).
fn chunks<T>(wave: Vec<Entry<T>>, max_bytes: usize) -> Vec<Vec<Entry<T>>> {
    let mut calls: Vec<Vec<Entry<T>>> = Vec::new();
    let mut bytes = 0;
    for entry in wave {
        let fits = calls
            .last()
            .is_some_and(|c| c.len() < MAX_BATCH_ENTRIES && bytes + entry.bytes <= max_bytes);
        if !fits {
            calls.push(Vec::new());
            bytes = 0;
        }
        bytes += entry.bytes;
        // Pushed just above when there was none.
        if let Some(call) = calls.last_mut() {
            call.push(entry);
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use serde_json::json;

    use super::*;
    use crate::sink::format::CloudEventsMode;
    use crate::sink::template::tests::row;

    #[test]
    fn splits_urls_and_refuses_bad_parameters() {
        let (target, s) = split_url(
            "sqs://orders?region=eu-west-1&endpoint=http://127.0.0.1:5000&account=123456789012",
            "sqs",
        )
        .unwrap();
        assert_eq!(target, "orders");
        assert_eq!(s.region.as_deref(), Some("eu-west-1"));
        assert_eq!(s.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(s.account.as_deref(), Some("123456789012"));
        for (url, needle) in [
            ("sqs://q?colour=red", "unknown parameter \"colour\""),
            ("sqs://q?region=", "empty"),
            ("sqs://q?region=EU_WEST", "not a region"),
            ("sqs://q?endpoint=localhost:1", "not an http"),
            ("sqs://q?endpoint=ftp://h", "not an http"),
            ("sqs://q?account=12", "12-digit"),
            ("sqs://q#x", "fragment"),
            ("sns://q", "not an sqs://"),
        ] {
            let e = split_url(url, "sqs").unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }

    #[test]
    fn splits_claim_check_parameters() {
        let (_, s) = split_url(
            "sqs://q?claim-check=s3://payloads/orders&claim-check-over=0&claim-check-legacy=true\
             &claim-check-path-style=false",
            "sqs",
        )
        .unwrap();
        let c = s.claim_check.unwrap();
        assert_eq!((c.bucket.as_str(), c.prefix.as_str()), ("payloads", "orders/"));
        assert_eq!((c.over, c.legacy, c.path_style), (Some(0), true, Some(false)));
        let (_, s) = split_url("sqs://q?claim-check=s3://payloads", "sqs").unwrap();
        let c = s.claim_check.unwrap();
        assert_eq!((c.over, c.legacy, c.path_style), (None, false, None));
        for (url, needle) in [
            ("sqs://q?claim-check-legacy=true", "need ?claim-check="),
            (
                "sqs://q?claim-check=s3://payloads&claim-check-over=-1",
                "not a number",
            ),
            (
                "sqs://q?claim-check=s3://payloads&claim-check-path-style=1",
                "neither true nor false",
            ),
            ("sqs://q?claim-check=https://payloads", "not an s3://"),
        ] {
            let e = split_url(url, "sqs").unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }

    #[test]
    fn checks_names_and_group_ids() {
        assert_eq!(name_problem("orders", 80), None);
        assert_eq!(name_problem("Orders_1-x.fifo", 80), None);
        assert!(is_fifo("a.fifo") && !is_fifo("a"));
        for bad in ["", ".fifo", "a.b", "a b", "ä"] {
            assert!(name_problem(bad, 80).is_some(), "{bad:?}");
        }
        assert!(name_problem(&"a".repeat(81), 80).is_some());
        assert_eq!(group_id_problem("order-42/x"), None);
        for bad in ["", "a b", "é"] {
            assert!(group_id_problem(bad).is_some(), "{bad:?}");
        }
        assert!(group_id_problem(&"a".repeat(129)).is_some());
    }

    #[test]
    fn attributes_stay_within_ten_and_overflow_into_headers() {
        let headers: Vec<(String, String)> = (0..12).map(|i| (format!("h{i:02}"), format!("v{i}"))).collect();
        let a = attributes("E", Some("application/json"), headers, MAX_ATTRIBUTES);
        assert_eq!(a.len(), MAX_ATTRIBUTES);
        assert_eq!(a[0], ("id".into(), "E".into()));
        assert_eq!(a[1], ("content-type".into(), "application/json".into()));
        assert_eq!(a[2], ("h00".into(), "v0".into()));
        assert_eq!(a[8], ("h06".into(), "v6".into()));
        let (name, rest) = &a[9];
        assert_eq!(name, OVERFLOW_ATTRIBUTE);
        let rest: Value = serde_json::from_str(rest).unwrap();
        assert_eq!(rest.as_object().unwrap().len(), 5, "{rest}");
        assert_eq!(rest["h11"], "v11");

        // With a claim check, nine, the tenth being the size attribute's.
        let headers: Vec<(String, String)> = (0..12).map(|i| (format!("h{i:02}"), format!("v{i}"))).collect();
        let a = attributes("E", Some("application/json"), headers, MAX_ATTRIBUTES - 1);
        assert_eq!(a.len(), MAX_ATTRIBUTES - 1);
        assert_eq!(a[7], ("h05".into(), "v5".into()));
        assert_eq!(a[8].0, OVERFLOW_ATTRIBUTE);

        // Exactly ten fit without an overflow attribute.
        let headers: Vec<(String, String)> = (0..8).map(|i| (format!("h{i}"), "v".into())).collect();
        let a = attributes("E", Some("application/json"), headers, MAX_ATTRIBUTES);
        assert_eq!(a.len(), 10);
        assert!(a.iter().all(|(n, _)| n != OVERFLOW_ATTRIBUTE));

        // Names and values SQS refuses, and the sink's own names, do not
        // become attributes; a row header cannot replace the id.
        let headers = vec![
            ("id".to_owned(), "spoofed".to_owned()),
            ("AWS.x".to_owned(), "1".to_owned()),
            ("a b".to_owned(), "2".to_owned()),
            ("empty".to_owned(), String::new()),
            ("traceparent".to_owned(), "t".to_owned()),
            ("ExtendedPayloadSize".to_owned(), "3".to_owned()),
            ("SQSLargePayloadSize".to_owned(), "4".to_owned()),
        ];
        let a = attributes("E", None, headers, MAX_ATTRIBUTES);
        assert_eq!(a[0], ("id".into(), "E".into()));
        assert_eq!(a[1], ("traceparent".into(), "t".into()));
        let rest: Value = serde_json::from_str(&a[2].1).unwrap();
        assert_eq!(
            rest,
            json!({"AWS.x": "1", "a b": "2", "empty": "", "ExtendedPayloadSize": "3", "SQSLargePayloadSize": "4"}),
            "no header poses as a claim check's size attribute"
        );
        assert_eq!(a.len(), 3);
    }

    #[test]
    fn messages_per_format() {
        let mut r = row();
        r.headers = json!({"traceparent": "t", "n": 1});
        let native = Message::of(&Formatter::default(), &r, MAX_ATTRIBUTES);
        let body: Value = serde_json::from_str(&native.body).unwrap();
        assert_eq!(body["event_id"], r.event_id.to_string());
        assert_eq!(
            body["headers"]["traceparent"], "t",
            "the body carries every header"
        );
        assert_eq!(native.attributes[0], ("id".into(), r.event_id.to_string()));
        assert!(native.attributes.contains(&("n".into(), "1".into())));
        assert_eq!(
            native.bytes(),
            native.body.len()
                + native
                    .attributes
                    .iter()
                    .map(|(n, v)| n.len() + v.len() + 6)
                    .sum::<usize>()
        );

        // Stored by a claim check: the size attribute is a Number, last,
        // and counted.
        let mut stored = native.clone();
        stored.body = "[]".to_owned();
        stored.offloaded = Some(Stored {
            pointer: "[]".to_owned(),
            attribute: claim_check::SIZE_ATTRIBUTE,
            bytes: native.body.len(),
        });
        let size = native.body.len().to_string();
        assert_eq!(
            stored.bytes(),
            2 + stored.attribute_bytes() + "ExtendedPayloadSize".len() + "Number".len() + size.len()
        );
        let (body, attributes) = stored.into_parts();
        assert_eq!(body, "[]");
        assert_eq!(attributes[0], ("id".into(), "String", r.event_id.to_string()));
        assert_eq!(
            attributes.last(),
            Some(&("ExtendedPayloadSize".into(), "Number", size))
        );

        let debezium = Message::of(
            &Formatter::new(Format::Debezium, CloudEventsMode::Structured, "s"),
            &r,
            MAX_ATTRIBUTES,
        );
        assert_eq!(debezium.body, r.payload.to_string());
        assert!(
            debezium
                .attributes
                .contains(&("key".into(), r.aggregate_id.clone()))
        );

        let binary = Message::of(
            &Formatter::new(Format::CloudEvents, CloudEventsMode::Binary, "s"),
            &r,
            MAX_ATTRIBUTES,
        );
        assert_eq!(binary.body, r.payload.to_string());
        assert!(binary.attributes.len() <= MAX_ATTRIBUTES);
        assert!(
            binary
                .attributes
                .contains(&("ce-specversion".into(), "1.0".into()))
        );
    }

    fn rows(aggregates: &[&str]) -> Vec<OutboxRow> {
        aggregates
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let mut r = row();
                r.id = i as i64 + 1;
                r.aggregate_id = (*a).to_owned();
                r
            })
            .collect()
    }

    fn entries(batch: &[OutboxRow], bytes: usize) -> Vec<Result<Entry<usize>, DeliveryError>> {
        (0..batch.len())
            .map(|i| {
                Ok(Entry {
                    row: i,
                    bytes,
                    item: i,
                })
            })
            .collect()
    }

    /// A send that records each call's rows and fails the rows in `fail`.
    async fn run(
        batch: &[OutboxRow],
        prepared: Vec<Result<Entry<usize>, DeliveryError>>,
        max_bytes: usize,
        answer: impl Fn(&[usize]) -> Result<Vec<Delivery>, CallError>,
    ) -> (Vec<Delivery>, Vec<Vec<usize>>) {
        let calls = Mutex::new(Vec::new());
        let out = deliver(batch, prepared, max_bytes, |items: Vec<usize>| {
            calls.lock().unwrap().push(items.clone());
            let answer = answer(&items);
            async move { answer }
        })
        .await;
        (out, calls.into_inner().unwrap())
    }

    #[tokio::test]
    async fn sends_one_event_per_aggregate_per_wave_in_calls_of_ten() {
        // 25 aggregates, the first twice: one wave of 25 (3 calls), then one of 1.
        let mut names: Vec<String> = (0..25).map(|i| format!("a{i}")).collect();
        names.push("a0".into());
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let batch = rows(&names);
        let (out, calls) = run(&batch, entries(&batch, 10), 1000, |items| {
            Ok(items.iter().map(|_| Ok(())).collect())
        })
        .await;
        assert!(out.iter().all(Result::is_ok));
        let sizes: Vec<usize> = calls.iter().map(Vec::len).collect();
        assert_eq!(sizes, [10, 10, 5, 1]);
        assert_eq!(calls[3], [25], "the second event of a0 goes after the first wave");

        // The byte limit splits calls too.
        let (_, calls) = run(&batch[..4], entries(&batch[..4], 400), 1000, |items| {
            Ok(items.iter().map(|_| Ok(())).collect())
        })
        .await;
        assert_eq!(calls.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2]);
    }

    #[tokio::test]
    async fn a_failed_event_holds_back_its_aggregate_only() {
        let batch = rows(&["a", "b", "a", "b", "a"]);
        let (out, calls) = run(&batch, entries(&batch, 10), 1000, |items| {
            Ok(items
                .iter()
                .map(|&i| {
                    if i == 0 {
                        Err(DeliveryError::retryable("nope"))
                    } else {
                        Ok(())
                    }
                })
                .collect())
        })
        .await;
        assert!(out[0].as_ref().is_err_and(DeliveryError::is_retryable));
        assert!(
            matches!(out[2], Err(DeliveryError::NotSent { .. })),
            "{:?}",
            out[2]
        );
        assert!(
            matches!(out[4], Err(DeliveryError::NotSent { .. })),
            "{:?}",
            out[4]
        );
        assert!(out[1].is_ok() && out[3].is_ok());
        assert_eq!(calls, [vec![0, 1], vec![3]], "a's later events were never sent");
    }

    #[tokio::test]
    async fn an_unavailable_call_stops_the_batch() {
        let batch = rows(&["a", "b", "a"]);
        let (out, calls) = run(&batch, entries(&batch, 10), 1000, |_| {
            Err(CallError::Unavailable("sqs: connection refused".into()))
        })
        .await;
        assert!(
            out.iter()
                .all(|d| d.as_ref().is_err_and(DeliveryError::is_unavailable))
        );
        assert_eq!(calls.len(), 1);
    }

    #[tokio::test]
    async fn a_refused_call_is_retried_entry_by_entry() {
        let batch = rows(&["a", "b", "c"]);
        let (out, calls) = run(&batch, entries(&batch, 10), 1000, |items| {
            if items.len() > 1 || items == [1] {
                Err(CallError::Refused("sqs: InvalidParameterValue".into()))
            } else {
                Ok(vec![Ok(())])
            }
        })
        .await;
        assert!(out[0].is_ok() && out[2].is_ok());
        assert!(out[1].as_ref().is_err_and(|e| !e.is_retryable()));
        assert_eq!(calls.len(), 4);
    }

    #[tokio::test]
    async fn a_row_that_cannot_be_sent_holds_back_its_aggregate() {
        let batch = rows(&["a", "a", "b"]);
        let mut prepared = entries(&batch, 10);
        prepared[0] = Err(too_large(
            "sqs",
            300_000,
            262_144,
            "the queue's MaximumMessageSize",
        ));
        let (out, calls) = run(&batch, prepared, 1000, |items| {
            Ok(items.iter().map(|_| Ok(())).collect())
        })
        .await;
        let e = out[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("too large") && e.contains("262144"), "{e}");
        assert!(matches!(out[1], Err(DeliveryError::NotSent { .. })));
        assert!(out[2].is_ok());
        assert_eq!(calls, [vec![2]]);
    }

    #[test]
    fn classifies_answers() {
        let c = |code, status| classify_call("sqs", code, status, "x");
        assert!(matches!(
            c(Some("ThrottlingException"), Some(400)),
            CallError::Unavailable(_)
        ));
        assert!(matches!(
            c(Some("AccessDenied"), Some(403)),
            CallError::Unavailable(_)
        ));
        assert!(matches!(
            c(Some("QueueDoesNotExist"), Some(400)),
            CallError::Unavailable(_)
        ));
        assert!(matches!(
            c(Some("InternalError"), Some(500)),
            CallError::Unavailable(_)
        ));
        assert!(matches!(c(None, Some(503)), CallError::Unavailable(_)));
        assert!(matches!(c(None, None), CallError::Unavailable(_)));
        assert!(matches!(
            c(Some("InvalidParameterValue"), Some(400)),
            CallError::Refused(_)
        ));
        assert!(!classify_entry("sqs", "InvalidMessageContents", true, None).is_retryable());
        assert!(classify_entry("sqs", "InternalError", false, None).is_retryable());
        assert!(classify_entry("sqs", "ThrottlingException", true, None).is_retryable());
        assert!(classify_entry("sns", "KMSAccessDenied", true, None).is_unavailable());
    }

    /// Every KMS error the SDKs model for `SendMessageBatch` and
    /// `PublishBatch`, as their deserializers spell the codes (SQS with a
    /// dot, answered with a 400): the key, not the event, is at fault.
    #[test]
    fn kms_errors_leave_the_event_waiting() {
        let sqs = [
            "KMS.AccessDeniedException",
            "KMS.DisabledException",
            "KMS.InvalidKeyUsageException",
            "KMS.InvalidStateException",
            "KMS.NotFoundException",
            "KMS.OptInRequired",
            "KMS.ThrottlingException",
        ];
        let sns = [
            "KMSAccessDenied",
            "KMSDisabled",
            "KMSInvalidState",
            "KMSNotFound",
            "KMSOptInRequired",
            "KMSThrottling",
        ];
        for code in sqs.into_iter().chain(sns) {
            assert!(
                matches!(
                    classify_call("sqs", Some(code), Some(400), "x"),
                    CallError::Unavailable(_)
                ),
                "{code}"
            );
        }
    }
}
