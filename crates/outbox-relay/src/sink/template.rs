//! Names built from a row: the NATS subject, the AMQP exchange and routing
//! key. Owns the `{aggregate_type}` / `{event_type}` placeholder syntax and
//! checks it once, at startup, so a typo is a configuration error (exit 2)
//! instead of a stream of failed rows.

use outbox::OutboxRow;

use super::SinkError;

/// A name with `{aggregate_type}` and `{event_type}` placeholders, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    AggregateType,
    EventType,
}

impl Template {
    /// Parses `text`; `flag` names the option it came from, for the error.
    ///
    /// ```
    /// use outbox_relay::sink::template::Template;
    ///
    /// let t = Template::parse("outbox.event.{aggregate_type}", "--nats-subject").unwrap();
    /// assert!(Template::parse("x.{aggregate}", "--nats-subject").is_err());
    /// # let _ = t;
    /// ```
    pub fn parse(text: &str, flag: &'static str) -> Result<Self, SinkError> {
        let invalid = |reason: String| SinkError::InvalidTemplate {
            flag,
            template: text.to_owned(),
            reason,
        };
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find(['{', '}']) {
            if rest[open..].starts_with('}') {
                return Err(invalid("unmatched '}'".to_owned()));
            }
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| invalid("unclosed '{'".to_owned()))?;
            parts.push(match &rest[open + 1..open + close] {
                "aggregate_type" => Part::AggregateType,
                "event_type" => Part::EventType,
                other => {
                    return Err(invalid(format!(
                        "unknown placeholder {{{other}}} (known: {{aggregate_type}}, {{event_type}})"
                    )));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Self { parts })
    }

    /// The name for `row`.
    pub fn render(&self, row: &OutboxRow) -> String {
        let mut out = String::new();
        for part in &self.parts {
            out.push_str(match part {
                Part::Text(t) => t,
                Part::AggregateType => &row.aggregate_type,
                Part::EventType => &row.event_type,
            });
        }
        out
    }

    /// Whether the name is the same for every row.
    pub fn is_constant(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Text(_)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use chrono::Utc;
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    /// A row of `orders`/`OrderPlaced`, for the sinks' template tests too.
    pub(crate) fn row() -> OutboxRow {
        OutboxRow {
            id: 1,
            event_id: Uuid::nil(),
            aggregate_type: "orders".into(),
            aggregate_id: "1".into(),
            event_type: "OrderPlaced".into(),
            payload: json!({}),
            headers: json!({}),
            created_at: Utc::now(),
            attempts: 0,
            first_failed_at: None,
        }
    }

    #[test]
    fn renders_placeholders() {
        let t = Template::parse("{aggregate_type}.{event_type}", "--x").unwrap();
        assert_eq!(t.render(&row()), "orders.OrderPlaced");
        assert!(!t.is_constant());
        let t = Template::parse("outbox", "--x").unwrap();
        assert_eq!(t.render(&row()), "outbox");
        assert!(t.is_constant());
        assert_eq!(Template::parse("", "--x").unwrap().render(&row()), "");
    }

    #[test]
    fn refuses_bad_templates_naming_the_flag() {
        for bad in ["a.{nope}", "a.{aggregate_type", "a.}", "{}"] {
            let e = Template::parse(bad, "--nats-subject").unwrap_err().to_string();
            assert!(e.contains("--nats-subject") && e.contains(bad), "{e}");
        }
    }
}
