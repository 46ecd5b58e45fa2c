//! Where a replay sends: a sink URL or a route of the routes file, and the
//! envelope a job keeps.

use std::path::Path;

use anyhow::Context;
use outbox::sql::ReplayFilter;
use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::{Sink, SinkOptions};

use crate::config::ConfigFile;
use crate::exit::ConfigError;

/// Where a replay sends.
pub(crate) enum Target {
    /// A sink URL, as `relay --sink` takes it.
    Url(String),
    /// A sink table of the routes file: an aggregate type, or `default`.
    Route(String),
}

impl Target {
    pub(crate) fn parse(to: &str) -> Self {
        match to.strip_prefix("route:") {
            Some(name) => Self::Route(name.to_owned()),
            None => Self::Url(to.to_owned()),
        }
    }

    /// As the job row keeps it: never a password nor a query value
    /// (`outbox_relay::redact::url`), so a resume asks for those again.
    pub(crate) fn stored(&self) -> String {
        match self {
            Self::Url(url) => outbox_relay::redact::url(url),
            Self::Route(name) => format!("route:{name}"),
        }
    }

    /// A job row's target as shown: masked again, for a job stored
    /// before every query value was (issue 35).
    pub(crate) fn shown(stored: &str) -> String {
        Self::parse(stored).stored()
    }

    /// The sink, built (no connection made). For a new job, `filter` is
    /// narrowed to the route's events.
    pub(crate) fn sink(
        &self,
        config_path: Option<&Path>,
        options: &SinkOptions,
        filter: Option<&mut ReplayFilter>,
    ) -> anyhow::Result<Box<dyn Sink>> {
        let name = match self {
            Self::Url(url) => return outbox_relay::sink::from_url(url, options).context("--to"),
            Self::Route(name) => name,
        };
        let path = config_path.ok_or_else(|| {
            ConfigError(format!(
                "--to route:{name} names a sink table of a routes file: give it with --config"
            ))
        })?;
        let file = ConfigFile::read(path)?.into_body();
        let tables = file.tables();
        let routed: Vec<String> = tables
            .iter()
            .filter_map(|(header, _)| header.strip_prefix("[routes.")?.strip_suffix(']'))
            .map(str::to_owned)
            .collect();
        let header = if name == "default" {
            "[default]".to_owned()
        } else {
            format!("[routes.{name}]")
        };
        let Some((_, entries)) = tables.iter().find(|(h, _)| *h == header) else {
            return Err(ConfigError(format!(
                "--to route:{name}: {} has no {header} table (its tables: {})",
                path.display(),
                tables
                    .iter()
                    .map(|(h, _)| h.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into());
        };
        let url = entries
            .iter()
            .find(|(key, ..)| *key == "sink")
            .and_then(|(_, values, _)| values.first().cloned());
        if let Some(filter) = filter {
            if name == "default" {
                filter.exclude_types = Some(routed);
            } else {
                match &filter.aggregate_type {
                    Some(t) if t != name => {
                        return Err(ConfigError(format!(
                            "--to route:{name} carries aggregate type {name} only, not --aggregate-type {t}"
                        ))
                        .into());
                    }
                    _ => filter.aggregate_type = Some(name.clone()),
                }
            }
        }
        // The router sends each row to its type's table; with the filter
        // above every row is of this route. Without a [default] table the
        // route's own sink stands in as the default the router needs.
        let router = file
            .router(url.as_deref(), options)
            .with_context(|| format!("--to route:{name}"))?;
        Ok(Box::new(router))
    }
}

/// `native`, `cloudevents`, `cloudevents:binary`, `debezium`: the envelope
/// as the job row keeps it.
pub(crate) fn format_name(formatter: &Formatter) -> String {
    match formatter.parts() {
        (Format::CloudEvents, CloudEventsMode::Binary, _) => "cloudevents:binary".to_owned(),
        (format, ..) => format.to_string(),
    }
}

pub(crate) fn parse_format(name: &str) -> anyhow::Result<(Format, CloudEventsMode)> {
    let (format, mode) = match name.split_once(':') {
        Some((f, "binary")) => (f, CloudEventsMode::Binary),
        _ => (name, CloudEventsMode::Structured),
    };
    let format = format
        .parse::<Format>()
        .map_err(|e| ConfigError(format!("the job's format {name:?}: {e}")))?;
    Ok((format, mode))
}

#[cfg(test)]
mod tests {
    use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};

    use super::*;

    #[test]
    fn formats_round_trip() {
        for (format, mode) in [
            (Format::Native, CloudEventsMode::Structured),
            (Format::CloudEvents, CloudEventsMode::Structured),
            (Format::CloudEvents, CloudEventsMode::Binary),
            (Format::Debezium, CloudEventsMode::Structured),
        ] {
            let name = format_name(&Formatter::new(format, mode, "s"));
            assert_eq!(parse_format(&name).unwrap(), (format, mode), "{name}");
        }
    }

    #[test]
    fn passwords_and_query_values_are_not_stored() {
        assert_eq!(
            Target::parse("amqp://user:pw@rabbit:5672/%2f").stored(),
            "amqp://user:***@rabbit:5672/%2f"
        );
        assert_eq!(
            Target::parse("https://example.com/hook?token=abc123&v=2").stored(),
            "https://example.com/hook?token=***&v=***"
        );
        assert_eq!(Target::parse("route:orders").stored(), "route:orders");
    }
}
