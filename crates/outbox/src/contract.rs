//! The table contract: what a row must hold for every sink to deliver it
//! as written (`docs/schema.md`, "The table contract").
//!
//! One rule, three places: migration 8's CHECK constraints refuse a row
//! that breaks it at `INSERT` (`outbox_aggregate_type_is_a_name`,
//! `outbox_event_type_is_a_name`, `outbox_headers_are_string_tokens`), the
//! writer refuses an [`Event`](crate::Event) that breaks it before any SQL
//! ([`Error::Contract`](crate::Error::Contract)), and the relay makes a row
//! that still breaks it (written before the migration, or emitted to the
//! write-ahead log, where no constraint applies) a dead letter naming the
//! column, never sending it half. A test feeds the same values to the SQL
//! functions and to these, so the two cannot drift apart.
//!
//! - `aggregate_type` and `event_type` name streams, subjects, routing keys
//!   and topics (`outbox.event.{aggregate_type}`, `{aggregate_type}.{event_type}`):
//!   [`is_name`] accepts what a Redis stream, a NATS subject, an AMQP routing
//!   key or queue and a Kafka topic all accept, at most [`MAX_NAME_CHARS`].
//! - `headers` travel as HTTP, NATS, AMQP and Kafka headers:
//!   [`check_headers`] accepts a JSON object whose names are HTTP tokens
//!   ([RFC 9110 `tchar`]) and whose values are strings.
//!
//! [RFC 9110 `tchar`]: https://www.rfc-editor.org/rfc/rfc9110#name-tokens

use serde_json::{Map, Value};

use crate::OutboxRow;
pub use crate::error::Violation;

/// The longest `aggregate_type` or `event_type`, in characters: the default
/// names (`outbox.event.{aggregate_type}`, 13 more) and the AMQP routing
/// key `{aggregate_type}.{event_type}` stay within Kafka's 249 characters
/// and AMQP's 255 bytes.
pub const MAX_NAME_CHARS: usize = 100;

/// Whether `value` may name a stream, subject, routing key or topic:
/// segments of ASCII letters, digits, `_` and `-`, joined by single dots.
/// Kafka takes only `[a-zA-Z0-9._-]`; NATS splits subjects at dots and
/// refuses empty tokens, spaces, `*` and `>`; so no leading, trailing or
/// doubled dot. The SQL twin is migration 8's regular expression.
///
/// ```
/// use outbox::contract::is_name;
///
/// assert!(is_name("orders") && is_name("billing.eu") && is_name("Order-Created_v2"));
/// assert!(!is_name("") && !is_name("billing / eu") && !is_name("a..b") && !is_name("orders.*"));
/// ```
pub fn is_name(value: &str) -> bool {
    value.chars().count() <= MAX_NAME_CHARS
        && value.split('.').all(|segment| {
            !segment.is_empty()
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

/// Whether `name` is an HTTP field name (RFC 9110 `token`: one or more of
/// ASCII letters, digits and ``!#$%&'*+-.^_`|~``), which every sink's
/// headers accept.
///
/// ```
/// use outbox::contract::is_header_name;
///
/// assert!(is_header_name("traceparent") && is_header_name("x-tenant_id"));
/// assert!(!is_header_name("") && !is_header_name("trace parent") && !is_header_name("a:b"));
/// ```
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Checks an `aggregate_type` or `event_type` (`column` names which).
pub fn check_name(column: &'static str, value: &str) -> Result<(), Violation> {
    if value.is_empty() {
        return Err(Violation::Empty { column });
    }
    let chars = value.chars().count();
    if chars > MAX_NAME_CHARS {
        return Err(Violation::NameTooLong { column, chars });
    }
    if !is_name(value) {
        return Err(Violation::NotAName {
            column,
            value: value.to_owned(),
        });
    }
    Ok(())
}

/// Checks a row's `headers`: a JSON object of strings whose names are HTTP
/// tokens.
///
/// ```
/// use outbox::contract::check_headers;
/// use serde_json::json;
///
/// assert!(check_headers(&json!({"traceparent": "00-…-01"})).is_ok());
/// let e = check_headers(&json!(["traceparent"])).unwrap_err();
/// assert_eq!(e.to_string(), "headers: expected a JSON object of strings, got an array");
/// ```
pub fn check_headers(headers: &Value) -> Result<(), Violation> {
    match headers {
        Value::Object(map) => check_header_map(map),
        other => Err(Violation::HeadersNotAnObject { got: kind(other) }),
    }
}

/// Checks headers as the writer holds them ([`Event::headers`](crate::Event::headers)).
pub fn check_header_map(map: &Map<String, Value>) -> Result<(), Violation> {
    for (name, value) in map {
        if !is_header_name(name) {
            return Err(Violation::HeaderName { name: name.clone() });
        }
        if !value.is_string() {
            return Err(Violation::HeaderValue {
                name: name.clone(),
                got: kind(value),
            });
        }
    }
    Ok(())
}

/// Checks the columns of a claimed or decoded row the contract covers, in
/// the order the constraints are listed: `aggregate_type`, `event_type`,
/// `headers`.
pub fn check_row(row: &OutboxRow) -> Result<(), Violation> {
    check_name("aggregate_type", &row.aggregate_type)?;
    check_name("event_type", &row.event_type)?;
    check_headers(&row.headers)
}

/// A JSON value's kind, with its article, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Values on both sides of each rule, shared with the test that runs them
/// through migration 8's SQL functions.
#[doc(hidden)]
pub mod samples {
    /// `(value, is a name)`.
    pub const NAMES: &[(&str, bool)] = &[
        ("orders", true),
        ("billing.eu", true),
        ("Order-Created_v2", true),
        ("a.b.c", true),
        ("0", true),
        ("", false),
        ("billing / eu", false),
        ("billing eu", false),
        (".orders", false),
        ("orders.", false),
        ("a..b", false),
        ("orders.*", false),
        ("orders.>", false),
        ("orders:created", false),
        ("orders/created", false),
        ("ordérs", false),
        ("ＯＲＤＥＲＳ", false),
        ("tab\there", false),
        ("new\nline", false),
    ];

    /// `(headers as JSON text, follows the rule)`.
    pub const HEADERS: &[(&str, bool)] = &[
        (r#"{}"#, true),
        (
            r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#,
            true,
        ),
        (r#"{"x-tenant_id": "7", "A!#$%&'*+-.^_`|~9": ""}"#, true),
        (r#"{"note": "any text, even with spaces: ünïcode"}"#, true),
        (r#"["traceparent"]"#, false),
        (r#""traceparent""#, false),
        (r#"null"#, false),
        (r#"42"#, false),
        (r#"{"trace parent": "x"}"#, false),
        (r#"{"": "x"}"#, false),
        (r#"{"a:b": "x"}"#, false),
        (r#"{"é": "x"}"#, false),
        (r#"{"n": 1}"#, false),
        (r#"{"n": null}"#, false),
        (r#"{"n": true}"#, false),
        (r#"{"n": {"nested": "x"}}"#, false),
        (r#"{"n": ["x"]}"#, false),
    ];
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn samples_follow_the_rust_rules() {
        for &(value, ok) in samples::NAMES {
            assert_eq!(check_name("aggregate_type", value).is_ok(), ok, "{value:?}");
        }
        let long = "a".repeat(MAX_NAME_CHARS);
        assert!(check_name("event_type", &long).is_ok());
        assert_eq!(
            check_name("event_type", &format!("{long}a")).unwrap_err(),
            Violation::NameTooLong {
                column: "event_type",
                chars: MAX_NAME_CHARS + 1
            }
        );
        for &(text, ok) in samples::HEADERS {
            let headers: Value = serde_json::from_str(text).unwrap();
            assert_eq!(check_headers(&headers).is_ok(), ok, "{text}");
        }
    }

    #[test]
    fn messages_name_the_column() {
        let said = |r: Result<(), Violation>| r.unwrap_err().to_string();
        assert_eq!(said(check_name("aggregate_type", "")), "aggregate_type is empty");
        assert_eq!(
            said(check_name("aggregate_type", "billing / eu")),
            "aggregate_type \"billing / eu\" is not a name: expected letters, digits, '_' and '-', \
             in segments joined by single dots (what Redis, NATS, AMQP and Kafka names all accept)"
        );
        assert_eq!(
            said(check_headers(&json!(["a"]))),
            "headers: expected a JSON object of strings, got an array"
        );
        assert_eq!(
            said(check_headers(&json!({"trace parent": "x"}))),
            "headers: name \"trace parent\" is not an HTTP token (letters, digits and !#$%&'*+-.^_`|~)"
        );
        assert_eq!(
            said(check_headers(&json!({"n": 1}))),
            "headers: \"n\" is a number, expected a string"
        );
    }
}
