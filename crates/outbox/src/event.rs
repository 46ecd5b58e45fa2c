//! The event as the writer builds it ([`Event`]) and as the relay claims it
//! ([`OutboxRow`]).
//!
//! An event's identity is its `event_id`, chosen when the event is built (a
//! random UUID unless the caller brings one), so the writer can return it
//! without a round trip and every sink and inbox deduplicates on the same key.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::Error;

/// An event to be written into the outbox in the caller's transaction.
///
/// ```
/// use outbox::Event;
/// use serde_json::json;
///
/// let event = Event::new("orders", "42", "OrderCreated", json!({"order_id": 42}))
///     .with_header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// assert_eq!(event.aggregate_type, "orders");
/// assert_eq!(event.headers["traceparent"], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The idempotency key that consumers deduplicate on.
    pub event_id: Uuid,
    /// The kind of aggregate, e.g. `orders`; sinks derive stream and topic names from it.
    pub aggregate_type: String,
    /// The aggregate's id: the unit of ordering.
    pub aggregate_id: String,
    /// What happened, e.g. `OrderCreated`.
    pub event_type: String,
    /// The event body; keep it small (ids, change kind, key facts, schema version).
    pub payload: Value,
    /// Trace context and user metadata, carried to every sink.
    pub headers: Map<String, Value>,
}

impl Event {
    /// An event with a fresh random `event_id` and no headers.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
    ) -> Self {
        Self {
            event_id: Uuid::new_v4(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Map::new(),
        }
    }

    /// Uses the caller's `event_id`, e.g. one derived from an incoming request
    /// so a retried request produces the same event.
    pub fn with_event_id(mut self, event_id: Uuid) -> Self {
        self.event_id = event_id;
        self
    }

    /// Adds one header.
    pub fn with_header(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(key.into(), value.into());
        self
    }

    /// Replaces all headers.
    pub fn with_headers(mut self, headers: Map<String, Value>) -> Self {
        self.headers = headers;
        self
    }

    /// Refuses an event whose payload (as JSON text) is over `max_bytes`,
    /// the relay's `--max-event-bytes` (1 MiB by default): the relay would
    /// make it a dead letter without sending it, so a writer that checks
    /// first can refuse it while the caller can still react.
    ///
    /// ```
    /// use outbox::Event;
    /// use serde_json::json;
    ///
    /// let event = Event::new("orders", "42", "OrderCreated", json!({"note": "x".repeat(100)}));
    /// assert!(event.check_size(1024 * 1024).is_ok());
    /// let err = event.check_size(64).unwrap_err();
    /// assert!(err.to_string().contains("payload is 111 bytes, over the limit of 64"), "{err}");
    /// ```
    pub fn check_size(&self, max_bytes: u64) -> Result<(), Error> {
        let bytes = payload_bytes(&self.payload);
        if bytes > max_bytes {
            return Err(Error::InvalidEvent(format!(
                "its payload is {bytes} bytes, over the limit of {max_bytes} (the relay's --max-event-bytes)"
            )));
        }
        Ok(())
    }

    /// Refuses events that no sink could deliver as written, before any
    /// SQL: the table contract ([`crate::contract`], which the table's
    /// CHECK constraints enforce too), and an empty or NUL-holding
    /// `aggregate_id` (the unit of ordering).
    ///
    /// ```
    /// use outbox::Event;
    /// use serde_json::json;
    ///
    /// let event = Event::new("billing / eu", "7", "Invoiced", json!({}));
    /// let err = event.validate().unwrap_err();
    /// assert!(err.to_string().starts_with("invalid event: aggregate_type \"billing / eu\" is not a name"), "{err}");
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        crate::contract::check_name("aggregate_type", &self.aggregate_type)?;
        if self.aggregate_id.is_empty() {
            return Err(Error::InvalidEvent("aggregate_id is empty".to_owned()));
        }
        if self.aggregate_id.contains('\0') {
            return Err(Error::InvalidEvent("aggregate_id contains a NUL byte".to_owned()));
        }
        crate::contract::check_name("event_type", &self.event_type)?;
        crate::contract::check_header_map(&self.headers)?;
        Ok(())
    }
}

/// The size of a payload as compact JSON text, the measure of the relay's
/// `--max-event-bytes` and of [`Event::check_size`]; counted without
/// building the text.
pub fn payload_bytes(payload: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing to a counter cannot fail, and a `Value` always serializes.
    let _ = serde_json::to_writer(&mut count, payload);
    count.0
}

/// An unpublished row as the relay claims it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutboxRow {
    /// The row's position in the outbox; delivery order follows it.
    pub id: i64,
    /// The idempotency key.
    pub event_id: Uuid,
    /// See [`Event::aggregate_type`].
    pub aggregate_type: String,
    /// See [`Event::aggregate_id`].
    pub aggregate_id: String,
    /// See [`Event::event_type`].
    pub event_type: String,
    /// See [`Event::payload`].
    pub payload: Value,
    /// See [`Event::headers`].
    pub headers: Value,
    /// When the writer inserted the row (`clock_timestamp()`).
    pub created_at: DateTime<Utc>,
    /// Failed deliveries so far.
    pub attempts: i32,
    /// When its first failed attempt was (None: none yet, or requeued
    /// since): where its retry window (`outbox relay --retry-for`) starts.
    #[serde(default)]
    pub first_failed_at: Option<DateTime<Utc>>,
}
