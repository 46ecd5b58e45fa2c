//! The one harness the lab and the bench share: where PostgreSQL and Redis
//! come from (`DATABASE_URL` and `--sink`, or throwaway servers started
//! here), a scratch schema with a migrated outbox and the harness's own
//! connection, and the child processes started on it and stopped, with
//! none of the user's `OUTBOX_*` settings: the production binary `outbox`
//! (`relay`, short commands; found by [`outbox_bin`]) and this binary
//! itself (the lab's `--app`, the soak's doomed writer).
//!
//! What is the lab's alone (the shop's tables, the inbox consumers) is in
//! `lab/shop.rs`; what is the bench's alone (its stream, bulk fills) in
//! `bench/mod.rs`: both as `impl Scratch` blocks.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::{Config, Event, Inbox, InboxConfig, Outbox};
use outbox_relay::pg::PgConfig;
use outbox_testkit::Spawned;
use tokio_postgres::Client;
use tokio_postgres::types::FromSql;

use crate::ConfigError;

/// How long any wait on state or on a child process may take before the
/// run fails.
pub(crate) const LONG: Duration = Duration::from_secs(60);

/// Where the lab and the bench find PostgreSQL: the CLI's `--database-url`
/// (`DATABASE_URL`) and `--connect-timeout`.
#[derive(Debug, Clone)]
pub struct Database {
    /// A connection string (URL or key=value); `None` starts a throwaway
    /// cluster (the testkit's, `fsync=off`) for the run.
    pub url: Option<String>,
    /// How long to keep trying to connect.
    pub connect_timeout: Duration,
}

/// The PostgreSQL of one run: its URL and parsed config, and the throwaway
/// cluster behind them, if any, which lives as long as this does.
pub(crate) struct Postgres {
    pub(crate) url: String,
    pub(crate) config: PgConfig,
    throwaway: Option<outbox_testkit::Postgres>,
}

impl Postgres {
    /// `DATABASE_URL`, or else a throwaway cluster started here, with
    /// `wal_level = logical` if `log_tailing` (the runs of `--source wal`
    /// need it; the others keep the server's default, `replica`, whose WAL
    /// the earlier figures were measured with).
    pub(crate) async fn start(db: &Database, log_tailing: bool) -> anyhow::Result<Self> {
        let (url, throwaway) = match &db.url {
            Some(url) => (url.clone(), None),
            None => {
                let mut settings = outbox_testkit::PgSettings::default();
                if log_tailing {
                    settings = settings.set("wal_level", "logical");
                }
                let pg = outbox_testkit::Postgres::start_with(settings)
                    .await
                    .context("starting a throwaway PostgreSQL")?;
                (pg.url("postgres"), Some(pg))
            }
        };
        Ok(Self {
            config: parse_pg_url(&url, db.connect_timeout)?,
            url,
            throwaway,
        })
    }

    /// Whether this is the run's own cluster (fsync=off).
    pub(crate) fn is_throwaway(&self) -> bool {
        self.throwaway.is_some()
    }

    /// The throwaway cluster, if this run started one.
    pub(crate) fn throwaway(&self) -> Option<&outbox_testkit::Postgres> {
        self.throwaway.as_ref()
    }
}

/// `url` parsed (a [`ConfigError`] if it does not), with the connect timeout.
pub(crate) fn parse_pg_url(url: &str, timeout: Duration) -> anyhow::Result<PgConfig> {
    outbox_relay::pg::parse_url(url, timeout)
        .map_err(|e| ConfigError(format!("{:#}", anyhow::Error::from(e))).into())
}

/// One connection (`application_name` `outbox` unless set); its driver
/// runs in a task. Retries until the connect timeout.
pub(crate) async fn connect(config: &PgConfig) -> anyhow::Result<Client> {
    Ok(outbox_relay::pg::connect(config).await?)
}

/// A scratch schema with its outbox (own NOTIFY channel) and inbox table,
/// the harness's own connection, the run's Redis and progress bar.
pub(crate) struct Scratch {
    pub(crate) pg: PgConfig,
    pub(crate) pg_url: String,
    schema: &'static str,
    channel: &'static str,
    /// Given (`--sink`), or a throwaway redis-server started on first use.
    redis_url: Option<String>,
    redis: Option<outbox_testkit::Redis>,
    /// The run's progress bar, for long phases.
    pub(crate) progress: Option<indicatif::ProgressBar>,
    /// The harness's own connection, for setup and counting.
    pub(crate) db: Client,
    pub(crate) config: Config,
    pub(crate) outbox: Outbox,
    /// `processed_events` in the scratch schema (the lab's consumers).
    pub(crate) inbox: Inbox,
    /// Smaller sizes (`--quick`).
    pub(crate) quick: bool,
    /// Whether this run created the publication of the WAL source (and so
    /// drops it at the end; see `bench/slot.rs`).
    pub(crate) created_publication: bool,
}

impl Scratch {
    /// Connects; the schema is built by [`Scratch::reset_outbox`] (or the
    /// lab's `reset`).
    pub(crate) async fn new(
        pg: PgConfig,
        pg_url: String,
        schema: &'static str,
        channel: &'static str,
        redis_url: Option<String>,
        quick: bool,
    ) -> anyhow::Result<Self> {
        let db = connect(&pg).await?;
        let config = Config::new(schema, "outbox")?.with_channel(channel)?;
        Ok(Self {
            pg,
            pg_url,
            schema,
            channel,
            redis_url,
            redis: None,
            progress: None,
            db,
            outbox: Outbox::new(config.clone()),
            config,
            inbox: Inbox::new(InboxConfig::new(schema, "processed_events")?),
            quick,
            created_publication: false,
        })
    }

    /// Drops the scratch schema and migrates a fresh outbox into it.
    pub(crate) async fn reset_outbox(&mut self) -> anyhow::Result<()> {
        self.drop_schema().await?;
        outbox::migrate(&mut self.db, &self.config).await?;
        Ok(())
    }

    /// Drops the scratch schema, if there is one.
    pub(crate) async fn drop_schema(&self) -> anyhow::Result<()> {
        self.db
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .await
            .with_context(|| format!("dropping schema {}", self.schema))
    }

    /// The run's Redis URL, starting a throwaway redis-server on first use
    /// if none was given.
    pub(crate) async fn redis_url(&mut self) -> anyhow::Result<String> {
        if let Some(url) = &self.redis_url {
            return Ok(url.clone());
        }
        let redis = outbox_testkit::Redis::start()
            .await
            .context("starting a throwaway redis-server")?;
        let url = redis.url();
        self.redis = Some(redis);
        self.redis_url = Some(url.clone());
        Ok(url)
    }

    /// A connection to the run's Redis.
    pub(crate) async fn redis(&mut self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        let url = self.redis_url().await?;
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await
            .context("connecting to Redis")
    }

    /// Shows the phase a long experiment is in.
    pub(crate) fn step(&self, phase: &str) {
        if let Some(p) = &self.progress {
            p.set_message(phase.to_owned());
        }
    }

    /// `DATABASE_URL` with another database name.
    pub(crate) fn url_of(&self, dbname: &str) -> String {
        match url::Url::parse(&self.pg_url) {
            Ok(mut u) if u.scheme().starts_with("postgres") => {
                u.set_path(dbname);
                u.to_string()
            }
            // key=value form: a later key wins.
            _ => format!("{} dbname={dbname}", self.pg_url),
        }
    }

    /// A connection to another database.
    pub(crate) async fn connect_to(&self, dbname: &str) -> anyhow::Result<Client> {
        let mut pg = self.pg.clone();
        pg.postgres_mut().dbname(dbname);
        connect(&pg).await
    }

    /// Another connection, for a second session.
    pub(crate) async fn connect(&self) -> anyhow::Result<Client> {
        connect(&self.pg).await
    }

    /// Inserts `events` in order, 1000 per transaction (`enqueue_all`).
    pub(crate) async fn insert(&mut self, events: &[Event]) -> anyhow::Result<()> {
        for chunk in events.chunks(1000) {
            let tx = self.db.transaction().await?;
            self.outbox.enqueue_all(&tx, chunk).await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// The outbox table, qualified and quoted.
    pub(crate) fn table(&self) -> String {
        self.config.qualified()
    }

    /// The single bigint a query returns.
    pub(crate) async fn count(&self, sql: &str) -> anyhow::Result<i64> {
        let row = self
            .db
            .query_one(sql, &[])
            .await
            .with_context(|| sql.to_owned())?;
        Ok(row.get(0))
    }

    pub(crate) async fn unpublished(&self) -> anyhow::Result<i64> {
        self.count(&format!(
            "SELECT count(*) FROM {} WHERE published_at IS NULL",
            self.table()
        ))
        .await
    }

    /// Waits until no row of the scratch outbox is unpublished; `what`
    /// names it in the timeout message.
    pub(crate) async fn wait_drained(&self, what: &str) -> anyhow::Result<()> {
        wait_until(what, async || Ok(self.unpublished().await? == 0)).await
    }

    pub(crate) async fn published(&self) -> anyhow::Result<i64> {
        self.count(&format!(
            "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
            self.table()
        ))
        .await
    }

    pub(crate) async fn rows(&self) -> anyhow::Result<i64> {
        self.count(&format!("SELECT count(*) FROM {}", self.table()))
            .await
    }

    /// Each row's `created_at` in epoch seconds, by `key` (`id` or
    /// `event_id`).
    pub(crate) async fn created_at<K>(&self, key: &str) -> anyhow::Result<HashMap<K, f64>>
    where
        K: for<'a> FromSql<'a> + Eq + Hash,
    {
        let sql = format!(
            "SELECT {key}, extract(epoch FROM created_at)::float8 FROM {}",
            self.table()
        );
        let rows = self.db.query(&sql, &[]).await.with_context(|| sql.clone())?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The `outbox` binary with the scratch outbox's flags and
    /// `DATABASE_URL`, and none of the user's `OUTBOX_*` settings.
    pub(crate) fn outbox_cmd(&self, args: &[&str]) -> anyhow::Result<tokio::process::Command> {
        self.outbox_cmd_on(&self.pg_url, args)
    }

    /// [`Scratch::outbox_cmd`] on another database.
    pub(crate) fn outbox_cmd_on(
        &self,
        pg_url: &str,
        args: &[&str],
    ) -> anyhow::Result<tokio::process::Command> {
        let mut cmd = outbox_command(pg_url)?;
        cmd.args(args)
            .args(["--schema", self.schema, "--channel", self.channel]);
        Ok(cmd)
    }

    /// This binary (`outbox-lab <args>`) on the scratch's `DATABASE_URL`,
    /// for the lab's own child processes (`lab --app`).
    pub(crate) fn lab_cmd(&self, args: &[&str]) -> anyhow::Result<tokio::process::Command> {
        let mut cmd = lab_command(&self.pg_url)?;
        cmd.args(args);
        Ok(cmd)
    }

    /// Starts `outbox relay --sink <sink> <args>` (JSON logs) with `envs`,
    /// and returns once it signalled `READY=1` on its `NOTIFY_SOCKET`.
    pub(crate) async fn spawn_relay(
        &self,
        sink: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Spawned> {
        self.spawn_relay_on(&self.pg_url, sink, args, envs).await
    }

    /// [`Scratch::spawn_relay`] on another database.
    pub(crate) async fn spawn_relay_on(
        &self,
        pg_url: &str,
        sink: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Spawned> {
        let mut cmd = self.outbox_cmd_on(pg_url, &["relay", "--sink", sink, "--log-format", "json"])?;
        cmd.args(args).envs(envs.iter().copied());
        let relay = Spawned::spawn_notified(cmd)?;
        relay
            .wait_for_notification("READY=1", LONG)
            .await
            .context("starting the relay")?;
        Ok(relay)
    }

    /// Starts a relay like [`Scratch::spawn_relay`] with the failpoint
    /// `OUTBOX_FAILPOINT=<failpoint>`, and returns once it parked there.
    pub(crate) async fn spawn_relay_parked(
        &self,
        sink: &str,
        args: &[&str],
        failpoint: &str,
    ) -> anyhow::Result<Spawned> {
        let relay = self
            .spawn_relay(sink, args, &[("OUTBOX_FAILPOINT", failpoint)])
            .await?;
        // `sleep-after-deliver-ms=N` signals as `sleep-after-deliver`.
        let name = failpoint.split_once("-ms=").map_or(failpoint, |(name, _)| name);
        relay
            .wait_for_notification(&format!("OUTBOX_FAILPOINT={name} reached"), LONG)
            .await?;
        Ok(relay)
    }

    /// SIGTERMs a relay (unless it drained and stopped by itself, with
    /// `--drain`) and checks it exited 0.
    pub(crate) async fn stop_relay(&self, mut relay: Spawned) -> anyhow::Result<()> {
        if relay.lines().iter().all(|l| !l.contains("relay drained")) {
            relay.signal(nix::sys::signal::Signal::SIGTERM)?;
        }
        let status = relay.wait(LONG).await?;
        if !status.success() {
            bail!("the relay exited with {status}: {:?}", relay.lines());
        }
        Ok(())
    }

    /// Lets `relay` idle for `idle`, stops it, and waits until `gone` (a
    /// count over `pg_stat_activity`) finds none of its backends: a backend
    /// publishes its transaction counters as it exits. Returns how many
    /// times it ran `gone` (each is two transactions: prepare, execute).
    pub(crate) async fn idle_and_stop(
        &self,
        relay: Spawned,
        idle: Duration,
        gone: &str,
    ) -> anyhow::Result<i64> {
        tokio::time::sleep(idle).await;
        self.stop_relay(relay).await?;
        let deadline = Instant::now() + LONG;
        let mut probes = 1;
        while self.count(gone).await? > 0 {
            probes += 1;
            if Instant::now() > deadline {
                bail!("the relay's backends did not exit within {LONG:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(probes)
    }

    /// Runs `outbox <args>` on the scratch outbox to completion.
    pub(crate) async fn run_cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = self.outbox_cmd(args)?;
        let out = tokio::time::timeout(LONG, cmd.output())
            .await
            .with_context(|| format!("outbox {} timed out", args.join(" ")))??;
        if !out.status.success() {
            bail!(
                "outbox {} exited with {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The `outbox` binary ([`outbox_bin`]) on `pg_url` (`DATABASE_URL`,
/// `RUST_LOG=info`), with none of the user's `OUTBOX_*` settings and no
/// `NOTIFY_SOCKET`; killed on drop.
pub(crate) fn outbox_command(pg_url: &str) -> anyhow::Result<tokio::process::Command> {
    Ok(child_command(outbox_bin()?, pg_url))
}

/// [`outbox_command`] for this binary itself (`outbox-lab`): the children
/// that are the lab's own commands (`lab --app`, `soak --doomed-writer`).
pub(crate) fn lab_command(pg_url: &str) -> anyhow::Result<tokio::process::Command> {
    let exe = std::env::current_exe().context("locating this binary")?;
    Ok(child_command(exe, pg_url))
}

fn child_command(exe: PathBuf, pg_url: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(exe);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("OUTBOX_") || key == "NOTIFY_SOCKET" {
            cmd.env_remove(key);
        }
    }
    cmd.env("DATABASE_URL", pg_url)
        .env("RUST_LOG", "info")
        .kill_on_drop(true);
    cmd
}

/// The production binary, `outbox`, that runs the relays and the other
/// commands the lab, the bench and the soak drive: `OUTBOX_BIN` if set,
/// else the `outbox` beside this executable (where `cargo build` puts
/// both). Missing, it is a [`ConfigError`] naming both ways to fix that.
pub(crate) fn outbox_bin() -> anyhow::Result<PathBuf> {
    const FIX: &str = "build it with `cargo build -p outbox-cli` (the same profile as outbox-lab), \
                       or set OUTBOX_BIN to its path";
    if let Some(path) = std::env::var_os("OUTBOX_BIN") {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        return Err(ConfigError(format!(
            "OUTBOX_BIN is {}, which is not a file: {FIX}",
            path.display()
        ))
        .into());
    }
    let exe = std::env::current_exe().context("locating this binary")?;
    let beside = exe.with_file_name("outbox");
    if beside.is_file() {
        return Ok(beside);
    }
    Err(ConfigError(format!(
        "the relay binary `outbox` is not at {} and OUTBOX_BIN is not set: {FIX}",
        beside.display()
    ))
    .into())
}

/// `pg_url` with `application_name` set to `name` (replacing any), so the
/// harness can tell its own children's backends apart in
/// `pg_stat_activity`. `name` needs no quoting or encoding: ASCII letters,
/// digits, `-` and `_`.
pub(crate) fn with_application_name(pg_url: &str, name: &str) -> String {
    debug_assert!(
        name.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "{name:?}"
    );
    match url::Url::parse(pg_url) {
        Ok(mut u) if u.scheme().starts_with("postgres") => {
            let kept: Vec<(String, String)> = u
                .query_pairs()
                .filter(|(k, _)| k != "application_name")
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            u.query_pairs_mut()
                .clear()
                .extend_pairs(kept)
                .append_pair("application_name", name);
            u.to_string()
        }
        // key=value form: a later key wins.
        _ => format!("{pg_url} application_name={name}"),
    }
}

/// The run's progress bar: `len` steps drawn by `template`, ticking.
pub(crate) fn progress_bar(len: u64, template: &str) -> anyhow::Result<indicatif::ProgressBar> {
    let style = indicatif::ProgressStyle::with_template(template)
        .context("progress bar template")?
        .progress_chars("=> ");
    let progress = indicatif::ProgressBar::new(len).with_style(style);
    progress.enable_steady_tick(Duration::from_millis(120));
    Ok(progress)
}

/// Waits until `check` holds, polling state every 20 ms, for at most `LONG`.
pub(crate) async fn wait_until<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + LONG;
    while !check().await? {
        if Instant::now() > deadline {
            bail!("timed out after {LONG:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_name_replaces_the_urls_own_and_keeps_the_rest() {
        assert_eq!(
            with_application_name(
                "postgres://u:p@127.0.0.1:5432/db?application_name=shop&sslmode=disable",
                "outbox-soak-poll-relay-0"
            ),
            "postgres://u:p@127.0.0.1:5432/db?sslmode=disable&application_name=outbox-soak-poll-relay-0"
        );
        assert_eq!(
            with_application_name("postgresql://127.0.0.1/db", "a_1"),
            "postgresql://127.0.0.1/db?application_name=a_1"
        );
        assert_eq!(
            with_application_name("host=127.0.0.1 dbname=db application_name=shop", "a"),
            "host=127.0.0.1 dbname=db application_name=shop application_name=a"
        );
        // What the relay parses is what was meant, both ways.
        for url in [
            "postgres://u@127.0.0.1/db?application_name=shop",
            "host=127.0.0.1 user=u dbname=db application_name=shop",
        ] {
            let pg = parse_pg_url(&with_application_name(url, "outbox-soak-x"), LONG).unwrap();
            assert_eq!(pg.postgres().get_application_name(), Some("outbox-soak-x"));
        }
    }
}
