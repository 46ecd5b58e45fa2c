//! Envelopes: what a row looks like on the wire, `--format native |
//! cloudevents | debezium`, for every sink.
//!
//! This module owns the bytes and header names; the sinks own the protocol.
//! [`Formatter::message`] turns a row into a protocol-neutral [`Message`]
//! (body, content type, headers with their final names) that the HTTP, NATS,
//! RabbitMQ and Kafka sinks map onto a request or message one to one;
//! [`Formatter::fields`] gives Redis Streams, which has no body or headers,
//! its entry fields. Dedup keys a protocol has of its own (`Nats-Msg-Id`,
//! AMQP `message_id`, HTTP `Idempotency-Key`) are set by the sinks in every
//! format, after these headers, so a row header cannot replace them.
//!
//! - `native`: the bytes each sink sent before formats existed, unchanged.
//! - `cloudevents`: [CloudEvents 1.0] with `id = event_id`, `source` from
//!   `--cloudevents-source`, `type = event_type`, `subject = aggregate_id`,
//!   `time = created_at` (RFC 3339, UTC), `datacontenttype =
//!   application/json`, `data = payload`, and the row's `traceparent` /
//!   `tracestate` as the [distributed tracing extension] attributes.
//!   Structured mode is one JSON document (`application/cloudevents+json`);
//!   binary mode puts the attributes in headers (`ce-` for HTTP and NATS;
//!   `cloudEvents_` for AMQP, the prefix the [AMQP binding] now prefers over
//!   `cloudEvents:`; `ce_` for Kafka, its binding's) and the payload in the
//!   body. Redis has no binding:
//!   structured mode is one field `cloudevent`, binary mode one field per
//!   attribute (`ce_id`, `ce_source`, …) and `data`.
//! - `debezium`: what Debezium's outbox event router emits: value = payload,
//!   key = aggregate_id, header `id` = event_id. Kafka's record key has no
//!   twin elsewhere, so outside Kafka it travels as header `key` (field `key`
//!   in Redis, where the value is field `value`). The topic per aggregate type is the
//!   sinks' default already (`outbox.event.<aggregate_type>`).
//!
//! In every format but native the row's other headers travel as plain
//! headers too (Redis: a `headers` JSON field), so `traceparent` reaches
//! every sink in every format.
//!
//! [CloudEvents 1.0]: https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md
//! [distributed tracing extension]: https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/extensions/distributed-tracing.md
//! [AMQP binding]: https://github.com/cloudevents/spec/blob/main/cloudevents/bindings/amqp-protocol-binding.md

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use chrono::SecondsFormat;
use outbox::OutboxRow;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

/// `--format`: the envelope around each event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Format {
    /// The fields each sink always sent.
    #[default]
    Native,
    /// CloudEvents 1.0.
    CloudEvents,
    /// Debezium's outbox event router.
    Debezium,
}

/// `--cloudevents-mode`: where the CloudEvents attributes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CloudEventsMode {
    /// The whole event as one JSON document.
    #[default]
    Structured,
    /// Attributes as headers, the payload as the body.
    Binary,
}

/// A `--format` or `--cloudevents-mode` value that names nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?} (known: {known})")]
pub struct UnknownName {
    what: &'static str,
    value: String,
    known: &'static str,
}

impl FromStr for Format {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "native" => Ok(Self::Native),
            "cloudevents" => Ok(Self::CloudEvents),
            "debezium" => Ok(Self::Debezium),
            _ => Err(UnknownName {
                what: "format",
                value: s.to_owned(),
                known: "native, cloudevents, debezium",
            }),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Native => "native",
            Self::CloudEvents => "cloudevents",
            Self::Debezium => "debezium",
        })
    }
}

impl FromStr for CloudEventsMode {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "structured" => Ok(Self::Structured),
            "binary" => Ok(Self::Binary),
            _ => Err(UnknownName {
                what: "cloudevents mode",
                value: s.to_owned(),
                known: "structured, binary",
            }),
        }
    }
}

impl fmt::Display for CloudEventsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Structured => "structured",
            Self::Binary => "binary",
        })
    }
}

/// The protocol a [`Message`] is for: header prefixes and the native body
/// differ between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// HTTP `POST`.
    Http,
    /// NATS JetStream.
    Nats,
    /// RabbitMQ (AMQP 0-9-1).
    Amqp,
    /// Kafka: the record key is the aggregate id in every format.
    Kafka,
}

/// One event, ready for a protocol: the sink copies it onto the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The body.
    pub body: Vec<u8>,
    /// The body's media type, if the protocol should say it (none for a
    /// native NATS message, which never carried one).
    pub content_type: Option<&'static str>,
    /// Headers (AMQP: header table entries) with their final names, in order.
    pub headers: Vec<(String, String)>,
}

/// `application/json`.
pub const JSON: &str = "application/json";
/// The media type of a structured-mode CloudEvent.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";
/// The CloudEvents attribute for the W3C trace context.
const TRACE_ATTRIBUTES: [&str; 2] = ["traceparent", "tracestate"];

/// Builds the envelope of each row for one sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formatter {
    format: Format,
    mode: CloudEventsMode,
    source: String,
}

impl Formatter {
    /// A formatter; `source` is the CloudEvents `source` attribute.
    pub fn new(format: Format, mode: CloudEventsMode, source: impl Into<String>) -> Self {
        Self {
            format,
            mode,
            source: source.into(),
        }
    }

    /// The format it writes.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Format, CloudEvents mode and source, for building a variant of it.
    pub fn parts(&self) -> (Format, CloudEventsMode, &str) {
        (self.format, self.mode, &self.source)
    }

    /// `row` as a message for `protocol`.
    ///
    /// ```
    /// use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter, Protocol};
    /// # let row = outbox::OutboxRow { id: 1, event_id: uuid::Uuid::nil(),
    /// #   aggregate_type: "orders".into(), aggregate_id: "42".into(),
    /// #   event_type: "OrderPlaced".into(), payload: serde_json::json!({"n": 1}),
    /// #   headers: serde_json::json!({}), created_at: chrono::Utc::now(), attempts: 0,
    /// #   first_failed_at: None };
    /// let f = Formatter::new(Format::Debezium, CloudEventsMode::Structured, "outbox");
    /// let m = f.message(&row, Protocol::Http);
    /// assert_eq!(m.body, br#"{"n":1}"#);
    /// assert!(m.headers.contains(&("key".to_owned(), "42".to_owned())));
    /// ```
    pub fn message(&self, row: &OutboxRow, protocol: Protocol) -> Message {
        match self.format {
            Format::Native => native(row, protocol),
            Format::Debezium => {
                let mut headers = vec![("id".to_owned(), row.event_id.to_string())];
                // Kafka carries the key as the record key itself.
                if protocol != Protocol::Kafka {
                    headers.push(("key".to_owned(), row.aggregate_id.clone()));
                }
                headers.extend(row_headers(row, &["id", "key"]));
                Message {
                    body: row.payload.to_string().into_bytes(),
                    content_type: Some(JSON),
                    headers,
                }
            }
            Format::CloudEvents => match self.mode {
                CloudEventsMode::Structured => Message {
                    body: to_json(&self.cloud_event(row)).into_bytes(),
                    content_type: Some(CLOUDEVENTS_JSON),
                    headers: row_headers(row, &[]),
                },
                CloudEventsMode::Binary => {
                    let prefix = match protocol {
                        Protocol::Http | Protocol::Nats => "ce-",
                        Protocol::Amqp => "cloudEvents_",
                        // The Kafka binding's prefix.
                        Protocol::Kafka => "ce_",
                    };
                    let mut headers: Vec<(String, String)> = self
                        .attributes(row)
                        .into_iter()
                        .map(|(k, v)| (format!("{prefix}{k}"), v))
                        .collect();
                    headers.extend(row_headers(row, &[]));
                    Message {
                        body: row.payload.to_string().into_bytes(),
                        // datacontenttype maps to the protocol's content type.
                        content_type: Some(JSON),
                        headers,
                    }
                }
            },
        }
    }

    /// `row` as Redis stream entry fields, in order.
    pub fn fields(&self, row: &OutboxRow) -> Vec<(String, String)> {
        let mut fields: Vec<(String, String)> = match self.format {
            Format::Native => vec![
                ("event_id".into(), row.event_id.to_string()),
                ("aggregate_id".into(), row.aggregate_id.clone()),
                ("event_type".into(), row.event_type.clone()),
                ("payload".into(), row.payload.to_string()),
                ("outbox_id".into(), row.id.to_string()),
            ],
            Format::Debezium => vec![
                ("id".into(), row.event_id.to_string()),
                ("key".into(), row.aggregate_id.clone()),
                ("value".into(), row.payload.to_string()),
            ],
            Format::CloudEvents => match self.mode {
                CloudEventsMode::Structured => {
                    vec![("cloudevent".into(), to_json(&self.cloud_event(row)))]
                }
                CloudEventsMode::Binary => {
                    let mut f: Vec<(String, String)> = self
                        .attributes(row)
                        .into_iter()
                        .map(|(k, v)| (format!("ce_{k}"), v))
                        .collect();
                    f.push(("data".into(), row.payload.to_string()));
                    f
                }
            },
        };
        if row.headers.as_object().is_some_and(|h| !h.is_empty()) {
            fields.push(("headers".into(), row.headers.to_string()));
        }
        fields
    }

    /// The context attributes (everything but `data`), in spec order.
    fn attributes(&self, row: &OutboxRow) -> Vec<(&'static str, String)> {
        let mut a = vec![
            ("specversion", "1.0".to_owned()),
            ("id", row.event_id.to_string()),
            ("source", self.source.clone()),
            ("type", row.event_type.clone()),
            ("subject", row.aggregate_id.clone()),
            (
                "time",
                row.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true),
            ),
            ("datacontenttype", JSON.to_owned()),
        ];
        for name in TRACE_ATTRIBUTES {
            if let Some(v) = row.headers.get(name).and_then(Value::as_str) {
                a.push((name, v.to_owned()));
            }
        }
        a
    }

    /// The structured-mode JSON document, keys in order as a JSON object
    /// sorts them. It borrows the payload: a copy would double the memory
    /// a large event takes.
    fn cloud_event<'r>(&self, row: &'r OutboxRow) -> BTreeMap<&'static str, Attribute<'r>> {
        let mut doc: BTreeMap<&'static str, Attribute<'r>> = self
            .attributes(row)
            .into_iter()
            .map(|(k, v)| (k, Attribute::Text(v)))
            .collect();
        doc.insert("data", Attribute::Json(&row.payload));
        doc
    }
}

impl Default for Formatter {
    fn default() -> Self {
        Self::new(Format::Native, CloudEventsMode::Structured, "outbox")
    }
}

/// What each sink sent before formats existed; kept byte for byte.
fn native(row: &OutboxRow, protocol: Protocol) -> Message {
    match protocol {
        // The HTTP body carries the headers; the brokers carry them as
        // message headers instead.
        Protocol::Http => Message {
            body: to_json(&NativeEnvelope::of(row, Some(&row.headers))).into_bytes(),
            content_type: Some(JSON),
            headers: Vec::new(),
        },
        Protocol::Nats | Protocol::Amqp | Protocol::Kafka => Message {
            body: to_json(&NativeEnvelope::of(row, None)).into_bytes(),
            content_type: (protocol == Protocol::Amqp).then_some(JSON),
            headers: row_headers(row, &[]),
        },
    }
}

/// The native envelope, borrowing the row. Fields in alphabetical order:
/// the bytes of the `json!` object it replaces, whose keys a JSON object
/// sorts, without copying the payload into it first.
#[derive(Serialize)]
struct NativeEnvelope<'r> {
    aggregate_id: &'r str,
    aggregate_type: &'r str,
    created_at: &'r chrono::DateTime<chrono::Utc>,
    event_id: &'r uuid::Uuid,
    event_type: &'r str,
    /// HTTP only: brokers carry the headers as message headers.
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<&'r Value>,
    outbox_id: i64,
    payload: &'r Value,
}

impl<'r> NativeEnvelope<'r> {
    fn of(row: &'r OutboxRow, headers: Option<&'r Value>) -> Self {
        Self {
            aggregate_id: &row.aggregate_id,
            aggregate_type: &row.aggregate_type,
            created_at: &row.created_at,
            event_id: &row.event_id,
            event_type: &row.event_type,
            headers,
            outbox_id: row.id,
            payload: &row.payload,
        }
    }
}

/// A CloudEvents attribute: text, or `data`, the payload borrowed.
#[derive(Serialize)]
#[serde(untagged)]
enum Attribute<'r> {
    Text(String),
    Json(&'r Value),
}

/// `value` as JSON text.
fn to_json(value: &impl Serialize) -> String {
    // Serializing these types cannot fail: their keys are strings and a
    // `Value` always serializes.
    serde_json::to_string(value).unwrap_or_default()
}

/// The row's `headers` as (name, value) pairs, minus `reserved` names the
/// format sets itself. The writer stores strings; any other JSON value
/// travels as its JSON text rather than being dropped.
fn row_headers(row: &OutboxRow, reserved: &[&str]) -> Vec<(String, String)> {
    row.headers
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| !reserved.contains(&k.as_str()))
        .map(|(k, v)| {
            let v = match v {
                Value::String(s) => Cow::Borrowed(s.as_str()),
                other => Cow::Owned(other.to_string()),
            };
            (k.clone(), v.into_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// The fixed event every golden test formats.
    pub(crate) fn golden_row() -> OutboxRow {
        OutboxRow {
            id: 7,
            event_id: Uuid::parse_str("0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f").unwrap(),
            aggregate_type: "orders".into(),
            aggregate_id: "42".into(),
            event_type: "OrderPlaced".into(),
            payload: json!({"order_id": 42, "total": "9.90"}),
            headers: json!({"traceparent": TRACEPARENT}),
            created_at: DateTime::parse_from_rfc3339("2026-01-02T03:04:05.123456Z")
                .unwrap()
                .with_timezone(&Utc),
            attempts: 0,
            first_failed_at: None,
        }
    }

    fn f(format: Format, mode: CloudEventsMode) -> Formatter {
        Formatter::new(format, mode, "/outbox/public.outbox")
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const PAYLOAD: &str = r#"{"order_id":42,"total":"9.90"}"#;
    const ID: &str = "0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f";
    const STRUCTURED: &str = concat!(
        r#"{"data":{"order_id":42,"total":"9.90"},"datacontenttype":"application/json","#,
        r#""id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","source":"/outbox/public.outbox","#,
        r#""specversion":"1.0","subject":"42","time":"2026-01-02T03:04:05.123456Z","#,
        r#""traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","type":"OrderPlaced"}"#
    );

    #[test]
    fn native_is_the_old_bytes() {
        let m = f(Format::Native, CloudEventsMode::Structured).message(&golden_row(), Protocol::Http);
        assert_eq!(
            String::from_utf8(m.body).unwrap(),
            concat!(
                r#"{"aggregate_id":"42","aggregate_type":"orders","created_at":"2026-01-02T03:04:05.123456Z","#,
                r#""event_id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","event_type":"OrderPlaced","#,
                r#""headers":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},"#,
                r#""outbox_id":7,"payload":{"order_id":42,"total":"9.90"}}"#
            )
        );
        assert_eq!(m.content_type, Some(JSON));
        assert!(m.headers.is_empty());
        let m = f(Format::Native, CloudEventsMode::Structured).message(&golden_row(), Protocol::Nats);
        assert_eq!(
            String::from_utf8(m.body).unwrap(),
            concat!(
                r#"{"aggregate_id":"42","aggregate_type":"orders","created_at":"2026-01-02T03:04:05.123456Z","#,
                r#""event_id":"0190c1a4-7b2e-7c3d-8e4f-5a6b7c8d9e0f","event_type":"OrderPlaced","#,
                r#""outbox_id":7,"payload":{"order_id":42,"total":"9.90"}}"#
            )
        );
        assert_eq!(m.content_type, None);
        assert_eq!(m.headers, pairs(&[("traceparent", TRACEPARENT)]));
        assert_eq!(
            f(Format::Native, CloudEventsMode::Structured).fields(&golden_row()),
            pairs(&[
                ("event_id", ID),
                ("aggregate_id", "42"),
                ("event_type", "OrderPlaced"),
                ("payload", PAYLOAD),
                ("outbox_id", "7"),
                (
                    "headers",
                    r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
                ),
            ])
        );
    }

    #[test]
    fn cloudevents_structured_golden() {
        for protocol in [Protocol::Http, Protocol::Nats, Protocol::Amqp, Protocol::Kafka] {
            let m = f(Format::CloudEvents, CloudEventsMode::Structured).message(&golden_row(), protocol);
            assert_eq!(String::from_utf8(m.body).unwrap(), STRUCTURED);
            assert_eq!(m.content_type, Some(CLOUDEVENTS_JSON));
            assert_eq!(m.headers, pairs(&[("traceparent", TRACEPARENT)]));
        }
        assert_eq!(
            f(Format::CloudEvents, CloudEventsMode::Structured).fields(&golden_row()),
            pairs(&[
                ("cloudevent", STRUCTURED),
                (
                    "headers",
                    r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
                ),
            ])
        );
    }

    fn binary_attributes(prefix: &str) -> Vec<(String, String)> {
        [
            ("specversion", "1.0"),
            ("id", ID),
            ("source", "/outbox/public.outbox"),
            ("type", "OrderPlaced"),
            ("subject", "42"),
            ("time", "2026-01-02T03:04:05.123456Z"),
            ("datacontenttype", "application/json"),
            ("traceparent", TRACEPARENT),
        ]
        .iter()
        .map(|(k, v)| (format!("{prefix}{k}"), (*v).to_owned()))
        .collect()
    }

    #[test]
    fn cloudevents_binary_golden() {
        for (protocol, prefix) in [
            (Protocol::Http, "ce-"),
            (Protocol::Nats, "ce-"),
            (Protocol::Amqp, "cloudEvents_"),
            (Protocol::Kafka, "ce_"),
        ] {
            let m = f(Format::CloudEvents, CloudEventsMode::Binary).message(&golden_row(), protocol);
            assert_eq!(String::from_utf8(m.body).unwrap(), PAYLOAD);
            assert_eq!(m.content_type, Some(JSON));
            let mut want = binary_attributes(prefix);
            want.push(("traceparent".into(), TRACEPARENT.into()));
            assert_eq!(m.headers, want, "{protocol:?}");
        }
        let mut want = binary_attributes("ce_");
        want.push(("data".into(), PAYLOAD.into()));
        want.push((
            "headers".into(),
            r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#.into(),
        ));
        assert_eq!(
            f(Format::CloudEvents, CloudEventsMode::Binary).fields(&golden_row()),
            want
        );
    }

    /// The spec's REQUIRED attributes are present and non-empty in both modes.
    #[test]
    fn cloudevents_required_attributes_present() {
        let required = ["id", "source", "specversion", "type"];
        let m = f(Format::CloudEvents, CloudEventsMode::Structured).message(&golden_row(), Protocol::Http);
        let doc: Value = serde_json::from_slice(&m.body).unwrap();
        for a in required {
            assert!(doc[a].as_str().is_some_and(|s| !s.is_empty()), "{a}");
        }
        assert_eq!(doc["specversion"], "1.0");
        let m = f(Format::CloudEvents, CloudEventsMode::Binary).message(&golden_row(), Protocol::Http);
        for a in required {
            let name = format!("ce-{a}");
            assert!(
                m.headers.iter().any(|(k, v)| *k == name && !v.is_empty()),
                "{name}"
            );
        }
    }

    #[test]
    fn debezium_golden() {
        for protocol in [Protocol::Http, Protocol::Nats, Protocol::Amqp] {
            let m = f(Format::Debezium, CloudEventsMode::Structured).message(&golden_row(), protocol);
            assert_eq!(String::from_utf8(m.body).unwrap(), PAYLOAD);
            assert_eq!(m.content_type, Some(JSON));
            assert_eq!(
                m.headers,
                pairs(&[("id", ID), ("key", "42"), ("traceparent", TRACEPARENT)])
            );
        }
        // Kafka's record key is the key itself, so no `key` header.
        let m = f(Format::Debezium, CloudEventsMode::Structured).message(&golden_row(), Protocol::Kafka);
        assert_eq!(String::from_utf8(m.body).unwrap(), PAYLOAD);
        assert_eq!(m.headers, pairs(&[("id", ID), ("traceparent", TRACEPARENT)]));
        assert_eq!(
            f(Format::Debezium, CloudEventsMode::Structured).fields(&golden_row()),
            pairs(&[
                ("id", ID),
                ("key", "42"),
                ("value", PAYLOAD),
                (
                    "headers",
                    r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
                ),
            ])
        );
    }

    #[test]
    fn debezium_row_headers_cannot_replace_id_or_key() {
        let mut row = golden_row();
        row.headers = json!({"id": "forged", "key": "forged"});
        let m = f(Format::Debezium, CloudEventsMode::Structured).message(&row, Protocol::Nats);
        assert_eq!(m.headers, pairs(&[("id", ID), ("key", "42")]));
    }

    #[test]
    fn parses_names() {
        assert_eq!("cloudevents".parse::<Format>().unwrap(), Format::CloudEvents);
        assert_eq!(
            "binary".parse::<CloudEventsMode>().unwrap(),
            CloudEventsMode::Binary
        );
        let e = "avro".parse::<Format>().unwrap_err().to_string();
        assert!(e.contains("avro") && e.contains("debezium"), "{e}");
    }
}
