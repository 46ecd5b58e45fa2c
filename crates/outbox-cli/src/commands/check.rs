//! `outbox relay --check`: the relay's setup, checked once with its own
//! flags and configuration file, sending and claiming nothing.
//!
//! PostgreSQL once (the connection, the role's privileges for the source,
//! claim mode and retention, the schema version, and for `--source wal`
//! `wal_level`, REPLICATION and the slot), then every sink once, each
//! route's alone (`Sink::check`: a refused connection or a wrong port is a
//! failure, not an outage the relay would wait out; a claim check's bucket
//! gets its empty probe object). One line per check,
//! `ok` or `FAIL` with the fix. The exit code is the worst found: 0 all
//! ok, 1 a service unreachable, 2 configuration (privileges, schema,
//! flags; a bad flag never gets this far).

use std::time::Duration;

use outbox_relay::SourceKind;
use outbox_relay::pg::PgConfig;

use super::relay::Prepared;
use crate::exit::ConfigError;

/// How long one sink's probe may take beyond its own timeouts.
const PROBE_LIMIT: Duration = Duration::from_secs(60);

/// The worst outcome so far, as an exit code.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    #[default]
    Ok,
    Unreachable,
    Config,
}

/// The lines printed so far and the worst outcome.
#[derive(Default)]
struct Report {
    worst: Outcome,
    problems: usize,
}

impl Report {
    fn ok(&mut self, what: &str, detail: &str) {
        println!("ok    {what}: {detail}");
    }

    /// A failed check: `error` may carry its fix after a `\nfix: ` (as
    /// `outbox::Error::MissingPrivileges` does), else `fix` gives one.
    fn fail(&mut self, what: &str, outcome: Outcome, error: &str, fix: &str) {
        let (error, fix) = match error.split_once("\nfix: ") {
            Some((error, own)) => (error, own),
            None => (error, fix),
        };
        println!("FAIL  {what}: {error}");
        println!("      fix: {fix}");
        self.worst = self.worst.max(outcome);
        self.problems += 1;
    }

    /// An error's outcome: configuration (exit 2) or a service (1).
    fn outcome(e: &anyhow::Error) -> Outcome {
        let config = e.chain().any(|c| c.is::<ConfigError>()) || outbox_relay::exit::is_config(e.as_ref());
        if config {
            Outcome::Config
        } else {
            Outcome::Unreachable
        }
    }
}

/// The error and its causes on one line.
fn chain(e: &anyhow::Error) -> String {
    e.chain().map(ToString::to_string).collect::<Vec<_>>().join(": ")
}

/// Runs every check and prints it; fails with the worst outcome's exit
/// code.
pub(crate) async fn run(pg: &PgConfig, prepared: Prepared) -> anyhow::Result<()> {
    let mut report = Report::default();
    postgres(pg, &prepared, &mut report).await;
    sinks(&prepared, &mut report).await;
    match report.worst {
        Outcome::Ok => {
            println!("all checks passed");
            Ok(())
        }
        Outcome::Unreachable => anyhow::bail!(
            "relay --check: {} check(s) failed: a service is unreachable",
            report.problems
        ),
        Outcome::Config => Err(ConfigError(format!(
            "relay --check: {} check(s) failed: the configuration",
            report.problems
        ))
        .into()),
    }
}

/// The connection, the privileges, the schema and, for `--source wal`,
/// log tailing's prerequisites and slot.
async fn postgres(pg: &PgConfig, prepared: &Prepared, report: &mut Report) {
    let config = prepared.config();
    let user = pg.postgres().get_user().unwrap_or("(default user)").to_owned();
    let client = match super::connect(pg).await {
        Ok(client) => {
            report.ok("postgres", &format!("connected as {user}"));
            client
        }
        Err(e) => {
            let outcome = Report::outcome(&e);
            let fix = if outcome == Outcome::Config {
                "check DATABASE_URL: user, password, database, TLS settings"
            } else {
                "check DATABASE_URL's host and port, and that PostgreSQL is up (waited --connect-timeout)"
            };
            report.fail("postgres", outcome, &chain(&e), fix);
            return;
        }
    };
    let what = format!("privileges of {user}");
    match super::relay::needs(&client, config, prepared.retains()).await {
        Ok((roles, needs)) => {
            let tables = outbox::privileges::Tables::outbox(config.outbox.clone());
            let kinds: Vec<&str> = roles.iter().map(|r| r.name()).collect();
            match outbox::privileges::check(&client, &tables, &needs).await {
                Ok(()) => report.ok(&what, &format!("everything {} needs", kinds.join(" and "))),
                Err(e) => {
                    let e = anyhow::Error::new(e);
                    report.fail(&what, Report::outcome(&e), &chain(&e), "see docs/privileges.md");
                }
            }
        }
        Err(e) => report.fail(&what, Report::outcome(&e), &chain(&e), "see docs/privileges.md"),
    }
    let table = config.outbox.display_name();
    match outbox::check(&client, &config.outbox).await {
        Ok(()) => report.ok(
            "schema",
            &format!("{table} at version {}", outbox::OUTBOX_VERSION),
        ),
        Err(e) => {
            let fix = if e.is_permission_denied() {
                "grant the privileges above (docs/privileges.md)"
            } else {
                "run `outbox migrate` as the table's owner"
            };
            let e = anyhow::Error::new(e);
            report.fail("schema", Report::outcome(&e), &chain(&e), fix);
        }
    }
    if config.source == SourceKind::Wal {
        match outbox::wal::check_wal(&client, &config.outbox).await {
            Ok(slot) => report.ok("log tailing", &format!("wal_level logical, {slot}")),
            Err(e) => {
                let e = anyhow::Error::new(e);
                report.fail(
                    "log tailing",
                    Report::outcome(&e),
                    &chain(&e),
                    "see docs/relay.md (log tailing)",
                );
            }
        }
    }
}

/// Every sink, each alone.
async fn sinks(prepared: &Prepared, report: &mut Report) {
    if prepared.probes.is_empty() {
        report.fail(
            "sink",
            Outcome::Config,
            "no sink",
            "give --sink or OUTBOX_SINK, or in --config a top-level sink = \"…\" or a [default] table",
        );
    }
    for (name, url, sink) in &prepared.probes {
        let what = format!("sink {name} {}", outbox_relay::redact::url(url));
        match tokio::time::timeout(PROBE_LIMIT, sink.check()).await {
            Ok(Ok(())) => report.ok(&what, &format!("{} reachable", sink.name())),
            Ok(Err(e)) => report.fail(
                &what,
                Outcome::Unreachable,
                &e.to_string(),
                "check the URL's host and port, and that the service is up",
            ),
            Err(_) => report.fail(
                &what,
                Outcome::Unreachable,
                &format!("no answer within {PROBE_LIMIT:?}"),
                "check the URL's host and port, and that the service is up",
            ),
        }
    }
}
