//! `outbox config show`: every effective relay setting, where it came from
//! (`flag`, `env OUTBOX_X`, `file outbox.toml:12`, `default`), and each
//! sink table's; secrets redacted (a URL's password and every query value,
//! through `outbox_relay::redact`).
//!
//! It takes the relay's flags and layers `--config` the same way
//! (`crate::config::Layered`), then runs the relay's own checks
//! (`relay::prepare`) without connecting anywhere: a file `outbox relay`
//! refuses, this refuses with the same error.

use std::io::Write;

use anyhow::Context;

use outbox_relay::redact::HIDDEN;
use serde_json::{Map, Value, json};

use super::relay::{self, POLL_WITHOUT_NOTIFY};
use crate::cli::{Command, ConfigCommand};
use crate::config::{Layered, Origin, setting_keys, table_keys};

/// One line of the output.
struct Row {
    key: String,
    /// A string, a list (repeatable flags) or null (unset).
    value: Value,
    source: String,
}

pub(crate) async fn show(layered: Layered) -> anyhow::Result<()> {
    let Command::Config(ConfigCommand::Show(args)) = &layered.cli.command else {
        unreachable!("dispatched for `outbox config show`")
    };
    let json = args.json;
    let settings = settings(&layered);
    let tables = tables(&layered);
    let ordering = ordering(&layered);
    let config = layered
        .file
        .as_ref()
        .map(|_| (layered.raw("config").join(""), layered.source("config")));
    if let Some(url) = &layered.cli.global.database_url {
        super::parse_pg_url(url, &layered.cli.global)?;
    }
    // The relay's own checks, sinks built but not connected; each listed
    // outbox's too.
    let listed = relay::listed(&layered)?;
    let own = listed_settings(&layered, &listed);
    let (g, relay_args, file) = layered.into_relay();
    let fleet = (relay_args.schemas.is_some() || !listed.is_empty()).then(|| {
        (
            relay_args.schemas.clone(),
            relay_args.databases.clone(),
            relay_args.fleet_sessions as usize,
            relay_args.fleet_prepared_claims as usize,
            relay_args.discover_interval,
            relay_args.fleet_split,
        )
    });
    let prepared = relay::prepare(&g, relay_args, file)?;
    // A fleet's outboxes are found, not configured: listing them connects.
    let outboxes = match fleet {
        Some((schemas, databases, sessions, prepared_claims, discover_interval, split)) => {
            let config = outbox_relay::fleet::FleetConfig {
                schemas,
                listed,
                databases,
                sessions,
                prepared_claims,
                discover_interval,
                relay: prepared.config,
                split,
            };
            let pg = super::pg_config(&g)?;
            Some(
                outbox_relay::fleet::survey(&pg, &config)
                    .await
                    .context("finding the fleet's outboxes")?,
            )
        }
        None => None,
    };

    let mut out = if json {
        as_json(
            config.as_ref(),
            &settings,
            &tables,
            &ordering,
            outboxes.as_deref(),
            &own,
        )?
    } else {
        let mut tables = tables;
        tables.extend(
            own.into_iter()
                .map(|(name, rows)| (format!("[outboxes.{name}]"), rows)),
        );
        as_text(config.as_ref(), &settings, &tables, &ordering)
    };
    if let (Some(outboxes), false) = (&outboxes, json) {
        out.push_str(&outboxes_text(outboxes));
    }
    // `outbox config show | head` closes the pipe early: not an error.
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

type Tables = [(String, Vec<Row>)];

/// Each listed outbox's own settings (its table's keys, over the
/// top-level ones), with the line each stands on.
fn listed_settings(layered: &Layered, listed: &[outbox_relay::fleet::Listed]) -> Vec<(String, Vec<Row>)> {
    let Some(file) = &layered.file else {
        return Vec::new();
    };
    listed
        .iter()
        .map(|l| {
            let rows = file
                .body()
                .outbox_entries(&l.name)
                .into_iter()
                .map(|(key, value, span)| Row {
                    key: key.to_owned(),
                    value: Value::String(value),
                    source: Origin::File(file.at(&span)).to_string(),
                })
                .collect();
            (l.name.clone(), rows)
        })
        .collect()
}

/// The fleet's outboxes, each served with the settings above, or why not.
fn outboxes_text(outboxes: &[outbox_relay::fleet::Surveyed]) -> String {
    let width = outboxes
        .iter()
        .map(|o| o.outbox.chars().count())
        .max()
        .unwrap_or(0);
    let served = outboxes.iter().filter(|o| o.problem.is_none()).count();
    let mut out = format!(
        "\n[outboxes] {served} of {} found would be served, each with the settings above\n",
        outboxes.len()
    );
    for o in outboxes {
        let status = o.problem.as_deref().unwrap_or("served");
        out.push_str(&format!("{:width$}  {status}\n", o.outbox));
    }
    out
}

fn as_json(
    config: Option<&(String, Origin)>,
    settings: &[Row],
    tables: &Tables,
    ordering: &[Row],
    outboxes: Option<&[outbox_relay::fleet::Surveyed]>,
    listed: &Tables,
) -> anyhow::Result<String> {
    let rows = |rows: &[Row]| -> Value {
        Value::Object(
            rows.iter()
                .map(|r| (r.key.clone(), json!({"value": r.value, "source": r.source})))
                .collect::<Map<_, _>>(),
        )
    };
    let out = json!({
        "config": config.map(|(path, source)| json!({"value": path, "source": source.to_string()})),
        "settings": rows(settings),
        "tables": Value::Object(tables.iter().map(|(name, t)| (name.clone(), rows(t))).collect()),
        "ordering": rows(ordering),
        "outboxes": outboxes,
        "listed": Value::Object(listed.iter().map(|(name, t)| (name.clone(), rows(t))).collect()),
    });
    Ok(serde_json::to_string_pretty(&out)? + "\n")
}

/// Three columns: key, value (lists comma-separated, `–` for none), source.
fn as_text(config: Option<&(String, Origin)>, settings: &[Row], tables: &Tables, ordering: &[Row]) -> String {
    let text = |v: &Value| match v {
        Value::Null => "–".to_owned(),
        Value::String(s) => s.clone(),
        Value::Array(items) if items.is_empty() => "–".to_owned(),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(","),
        other => other.to_string(),
    };
    let all = || {
        settings
            .iter()
            .chain(tables.iter().flat_map(|(_, t)| t))
            .chain(ordering)
    };
    let keys = all().map(|r| r.key.chars().count()).max().unwrap_or(0);
    let values = all()
        .map(|r| text(&r.value).chars().count())
        .max()
        .unwrap_or(0)
        .min(60);
    let mut out = match config {
        Some((path, source)) => format!("config: {path} ({source})\n"),
        None => "config: none (no --config or OUTBOX_CONFIG)\n".to_owned(),
    };
    let mut section = |name: Option<&str>, rows: &[Row]| {
        out.push('\n');
        if let Some(name) = name {
            out.push_str(name);
            out.push('\n');
        }
        for r in rows {
            out.push_str(&format!(
                "{:keys$}  {:values$}  {}\n",
                r.key,
                text(&r.value),
                r.source
            ));
        }
    };
    section(None, settings);
    for (name, rows) in tables {
        section(Some(name), rows);
    }
    if !ordering.is_empty() {
        section(Some("[ordering]"), ordering);
    }
    out
}

/// Every top-level setting.
fn settings(layered: &Layered) -> Vec<Row> {
    setting_keys()
        .iter()
        .map(|&key| Row {
            key: key.to_owned(),
            value: value(layered, key),
            source: layered.source(key).to_string(),
        })
        .collect()
}

/// `key`'s effective value, redacted; for a setting with no value, what the
/// relay makes of its absence.
fn value(layered: &Layered, key: &str) -> Value {
    let raw: Vec<String> = layered.raw(key).iter().map(|v| redact(key, v)).collect();
    if layered.is_list(key) {
        return raw.into();
    }
    if let Some(v) = raw.into_iter().next() {
        return v.into();
    }
    let g = &layered.cli.global;
    match key {
        // Polling is the latency then (see `relay::prepare`).
        "poll_interval"
            if layered.raw("no_notify") == ["true"]
                || (layered.raw("pooler") == ["transaction"] && layered.raw("listen_url").is_empty()) =>
        {
            humantime::format_duration(POLL_WITHOUT_NOTIFY).to_string().into()
        }
        "poll_interval" => humantime::format_duration(outbox_relay::RelayConfig::default().poll_interval)
            .to_string()
            .into(),
        "cloudevents_source" => format!("/outbox/{}.{}", g.schema, g.table).into(),
        _ => Value::Null,
    }
}

/// Each sink table: every sink key, the table's own or the top-level one.
fn tables(layered: &Layered) -> Vec<(String, Vec<Row>)> {
    let Some(file) = &layered.file else {
        return Vec::new();
    };
    file.body()
        .tables()
        .into_iter()
        .map(|(name, own)| {
            let rows = table_keys()
                .iter()
                .map(|&key| match own.iter().find(|(k, ..)| *k == key) {
                    Some((_, values, span)) => {
                        let mut values: Vec<String> = values.iter().map(|v| redact(key, v)).collect();
                        Row {
                            key: key.to_owned(),
                            value: if layered.is_list(key) {
                                values.into()
                            } else {
                                values.pop().into()
                            },
                            source: Origin::File(file.at(span)).to_string(),
                        }
                    }
                    None => Row {
                        key: key.to_owned(),
                        value: value(layered, key),
                        source: layered.source(key).to_string(),
                    },
                })
                .collect();
            (name, rows)
        })
        .collect()
}

/// The `[ordering]` table's entries.
fn ordering(layered: &Layered) -> Vec<Row> {
    let Some(file) = &layered.file else {
        return Vec::new();
    };
    file.body()
        .ordering_entries()
        .map(|(aggregate_type, mode, span)| Row {
            key: aggregate_type.to_owned(),
            value: mode.into(),
            source: Origin::File(file.at(&span)).to_string(),
        })
        .collect()
}

/// `value` of `key` with its secrets replaced by `***`.
fn redact(key: &str, value: &str) -> String {
    match key {
        "database_url" | "listen_url" => outbox_relay::pg::redact(value),
        "sink" => outbox_relay::redact::url(value),
        "http_secret" => HIDDEN.to_owned(),
        "kafka_options" => match value.split_once('=') {
            Some((property, _)) if secret_name(property) => format!("{property}={HIDDEN}"),
            _ => value.to_owned(),
        },
        _ => value.to_owned(),
    }
}

/// Whether a parameter or property of this name holds a secret
/// (`password`, `sasl.password`, `ssl.key.password`, `sasl.oauthbearer.client.secret`).
fn secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "secret", "jaas"].iter().any(|w| name.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted() {
        assert_eq!(
            redact("sink", "amqp://user:pw@rabbit:5672/%2f"),
            "amqp://user:***@rabbit:5672/%2f"
        );
        assert_eq!(
            redact("sink", "redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        // Every query value, not only secret-named ones (issue 35).
        assert_eq!(
            redact("sink", "https://h/x?token=1&client_secret=s&foo=bar"),
            "https://h/x?token=***&client_secret=***&foo=***"
        );
        assert_eq!(
            redact("database_url", "postgres://u:secret@h:5432/db?sslmode=require"),
            "postgres://u:***@h:5432/db?sslmode=require"
        );
        // The relay's own redaction (`outbox_relay::pg::redact`), which
        // quotes what it keeps.
        assert_eq!(
            redact("database_url", "host=h user=u password=secret dbname=d"),
            "host='h' user='u' password=*** dbname='d'"
        );
        assert_eq!(
            redact("database_url", "host=h password='a b'"),
            "host='h' password=***"
        );
        assert_eq!(redact("http_secret", "whsec_c2VjcmV0"), "***");
        assert_eq!(redact("kafka_options", "sasl.password=p"), "sasl.password=***");
        assert_eq!(redact("kafka_options", "linger.ms=5"), "linger.ms=5");
    }
}
