//! A throwaway PgBouncer in front of a testkit [`Postgres`]: one child
//! process on a free port, in session or transaction pool mode, trusting
//! every client, its configuration written into a temporary directory.
//!
//! It runs as the unprivileged user the testkit runs PostgreSQL as
//! (PgBouncer refuses root too). Readiness is a `SELECT 1` through it, once
//! the pidfile names the child: after a lost port race another test's
//! PgBouncer may be the one answering on the port.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio_postgres::NoTls;

use crate::spawned::Setup;
use crate::support::{self, Boot, RunAs};
use crate::{Error, Postgres, Spawned};

/// How long a start or restart may take.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long SIGTERM may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the port may keep accepting after the server was reaped.
const PORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How many fresh ports `start` tries when the chosen one gets taken.
const PORT_ATTEMPTS: usize = 5;
/// Lines of its log quoted in errors.
const LOG_LINES: usize = 30;

/// When PgBouncer gives a client's server connection back to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// When the client disconnects: a server connection per client, as if
    /// direct (`pool_mode = session`).
    Session,
    /// After each transaction: the next may run on another server
    /// connection, which other clients use in between
    /// (`pool_mode = transaction`).
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// One throwaway PgBouncer on 127.0.0.1, in front of one [`Postgres`],
/// owned by this value.
///
/// Every database of the cluster is reachable through it under its own
/// name ([`url`](Self::url)), as user `postgres` without a password
/// (`auth_type = trust`). It passes on the startup parameters tokio-postgres
/// and sqlx send: `client_encoding`, `DateStyle`, `TimeZone` and
/// `application_name` it tracks itself, and sqlx's `extra_float_digits` it
/// is told to ignore (`ignore_startup_parameters`), as a deployment serving
/// sqlx clients must be; anything else (`options`) it refuses. Its
/// configuration and log are in a temporary directory removed on drop;
/// dropping it SIGKILLs the process. Found as `pgbouncer` on `PATH`, else in
/// `/usr/sbin` (Debian's).
///
/// ```no_run
/// # async fn run() -> Result<(), outbox_testkit::Error> {
/// use outbox_testkit::{PgBouncer, PoolMode, Postgres};
///
/// let pg = Postgres::start().await?;
/// let mut bouncer = PgBouncer::start(&pg, PoolMode::Transaction).await?;
/// let url = bouncer.url("postgres"); // through the pool
/// bouncer.kill()?; // clients lose their connections
/// bouncer.restart().await?; // same port
/// # let _ = url; Ok(()) }
/// ```
#[derive(Debug)]
pub struct PgBouncer {
    exe: PathBuf,
    run_as: RunAs,
    port: u16,
    mode: PoolMode,
    config: PathBuf,
    pidfile: PathBuf,
    log: PathBuf,
    /// The server's settings beside the testkit's own, `(name, value)`.
    settings: Vec<(String, String)>,
    pg_port: u16,
    server: Option<Spawned>,
    // Declared last: fields drop in order, so the directory goes after the
    // process was killed.
    dir: TempDir,
}

impl PgBouncer {
    /// Starts PgBouncer in front of `pg` in `mode`, on a free port, and
    /// returns once a query goes through it (up to 20 s).
    pub async fn start(pg: &Postgres, mode: PoolMode) -> Result<PgBouncer, Error> {
        Self::start_with(pg, mode, &[]).await
    }

    /// [`start`](Self::start) with more `[pgbouncer]` settings, e.g.
    /// `("server_round_robin", "1")`; a later one wins over the testkit's.
    pub async fn start_with(
        pg: &Postgres,
        mode: PoolMode,
        settings: &[(&str, &str)],
    ) -> Result<PgBouncer, Error> {
        let exe = find_exe().ok_or(Error::PgBouncerNotInstalled)?;
        let run_as = RunAs::unprivileged()?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-pgbouncer-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for PgBouncer in {}",
                base.display()
            )))?;
        run_as.own(dir.path())?;
        let mut bouncer = PgBouncer {
            exe,
            run_as,
            port: 0,
            mode,
            config: dir.path().join("pgbouncer.ini"),
            pidfile: dir.path().join("pgbouncer.pid"),
            log: dir.path().join("pgbouncer.log"),
            settings: settings
                .iter()
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
            pg_port: pg.port(),
            server: None,
            dir,
        };
        let users = bouncer.dir.path().join("users.txt");
        // `trust` still wants the user listed.
        write_owned(&users, "\"postgres\" \"\"\n", run_as)?;
        support::start_on_free_port(&mut bouncer, PORT_ATTEMPTS).await?;
        Ok(bouncer)
    }

    /// The TCP port it listens on (127.0.0.1); it stays the same across
    /// restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its pool mode.
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// A connection URL for `database` through the pool, as superuser
    /// `postgres` (no password).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Kills it now (SIGKILL): every client loses its connection, and the
    /// server connections it held are closed by PostgreSQL (rolling back
    /// what they had open). Killing a stopped one does nothing.
    pub fn kill(&mut self) -> Result<(), Error> {
        match self.server.take() {
            Some(mut server) => server.kill_and_reap(),
            None => Ok(()),
        }
    }

    /// Stops it (SIGTERM: an immediate shutdown, SIGKILL if it is late),
    /// reaps it and waits until its port refuses connections. Stopping a
    /// stopped one does nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        support::stop_server(self, STOP_TIMEOUT, PORT_TIMEOUT).await
    }

    /// Starts it again on the same port with the same configuration (a
    /// running one is stopped first) and waits until a query goes through.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        support::restart_server(self).await
    }

    /// The configuration for the current port.
    fn config_text(&self) -> String {
        let mut settings: Vec<(String, String)> = [
            ("listen_addr", "127.0.0.1".to_owned()),
            ("listen_port", self.port.to_string()),
            // TCP only: a socket directory would be one more shared path.
            ("unix_socket_dir", String::new()),
            ("auth_type", "trust".to_owned()),
            (
                "auth_file",
                self.dir.path().join("users.txt").display().to_string(),
            ),
            ("pool_mode", self.mode.as_str().to_owned()),
            // sqlx sends it at startup; PgBouncer refuses what it neither
            // tracks nor ignores.
            ("ignore_startup_parameters", "extra_float_digits".to_owned()),
            ("pidfile", self.pidfile.display().to_string()),
            ("max_client_conn", "500".to_owned()),
            ("default_pool_size", "20".to_owned()),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
        for (name, value) in &self.settings {
            settings.retain(|(n, _)| n != name);
            settings.push((name.clone(), value.clone()));
        }
        let mut text = format!(
            "[databases]\n* = host=127.0.0.1 port={}\n\n[pgbouncer]\n",
            self.pg_port
        );
        for (name, value) in settings {
            text.push_str(&format!("{name} = {value}\n"));
        }
        text
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        write_owned(&self.config, &self.config_text(), self.run_as)?;
        // A stale pidfile (of a killed run) would stop it from starting.
        let _ = std::fs::remove_file(&self.pidfile);
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.arg(&self.config).current_dir(self.dir.path());
        let name = format!("{} on port {}", self.exe.display(), self.port);
        let setup = Setup {
            run_as: Some(self.run_as),
            ..Setup::server(name, &self.log)
        };
        Spawned::start(cmd, setup)
    }
}

impl support::ChildServer for PgBouncer {
    const NAME: &'static str = "pgbouncer";
    const READY_TIMEOUT: Duration = READY_TIMEOUT;

    fn port(&self) -> u16 {
        self.port
    }

    fn set_port(&mut self, port: u16) {
        self.port = port;
    }

    fn child(&mut self) -> &mut Option<Spawned> {
        &mut self.server
    }

    async fn boot(&mut self, deadline: Instant) -> Result<Boot, Error> {
        let log_offset = support::file_len(&self.log);
        let child = self.spawn()?;
        let spec = support::BootSpec {
            name: "pgbouncer",
            port: self.port,
            log: &self.log,
            port_taken: "Address already in use",
            ready_means: "pass a query to PostgreSQL",
            timeout: READY_TIMEOUT,
            deadline,
            log_lines: LOG_LINES,
            log_offset,
        };
        let (port, pidfile) = (self.port, self.pidfile.clone());
        support::boot(
            &mut self.server,
            child,
            |pid| probe(port, pidfile.clone(), pid),
            spec,
        )
        .await
    }
}

/// Whether the PgBouncer with `pid` passes a query on `port`: its pidfile
/// names it (written once it listens), and `SELECT 1` goes through.
async fn probe(port: u16, pidfile: PathBuf, pid: u32) -> std::io::Result<bool> {
    let written = std::fs::read_to_string(&pidfile).unwrap_or_default();
    if written.trim() != pid.to_string() {
        return Ok(false);
    }
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(port)
        .user("postgres")
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(2));
    let Ok((client, connection)) = config.connect(NoTls).await else {
        return Ok(false);
    };
    let connection = tokio::spawn(connection);
    let ok = client.simple_query("SELECT 1").await.is_ok();
    drop(client);
    let _ = connection.await;
    Ok(ok)
}

/// `pgbouncer` on `PATH`, else where Debian puts it (`/usr/sbin`, which is
/// not on a normal user's `PATH`).
fn find_exe() -> Option<PathBuf> {
    support::find_on_path("pgbouncer").or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/pgbouncer");
        support::is_executable(&sbin).then_some(sbin)
    })
}

/// Writes `text` to `path` (replacing it), readable by `run_as`.
fn write_owned(path: &std::path::Path, text: &str, run_as: RunAs) -> Result<(), Error> {
    std::fs::write(path, text).map_err(Error::io(format!("writing {}", path.display())))?;
    run_as.own(path)
}
