//! A throwaway PostgreSQL cluster: finding the server binaries, the cached
//! `initdb` template, and one cluster's life (start, stop, crash, restart).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio_postgres::{Client, NoTls};

use crate::spawned::Setup;
use crate::support::{self, POLL, RunAs};
use crate::{Error, Spawned};

/// How long a start or restart may take before we give up.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a fast shutdown may take before we SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How many fresh ports `start` tries when the chosen one gets taken between
/// `free_port` and the server binding it.
const PORT_ATTEMPTS: usize = 5;
/// Lines of server log quoted in errors.
const LOG_LINES: usize = 30;
/// Bump when the `initdb` options change, so stale templates are not reused.
const TEMPLATE_LAYOUT: u32 = 1;

/// One throwaway PostgreSQL cluster, owned by this value.
///
/// The cluster lives in a temporary directory (data directory, server log,
/// Unix socket) that is removed on drop. The server listens on 127.0.0.1 on a
/// free port, trusts every local connection, has superuser `postgres`, and is
/// tuned for tests rather than durability against OS crashes (`fsync=off`,
/// `full_page_writes=off`; `max_connections=200`). `synchronous_commit`
/// stays on, so a transaction whose commit returned survives
/// [`kill`](Self::kill).
///
/// When the current user is root, the data directory is owned by, and the
/// server runs as, the `postgres` system user (else `nobody`), because
/// PostgreSQL refuses to run as root.
///
/// Where the directories go: `OUTBOX_TESTKIT_TMPDIR` if set, else `TMPDIR` if
/// set, else `/dev/shm` when it has at least 1 GiB free, else the system
/// temporary directory. The server binaries come from `OUTBOX_PG_BIN` if set,
/// else the newest `/usr/lib/postgresql/*/bin`, else `pg_config --bindir`,
/// else `PATH`.
#[derive(Debug)]
pub struct Postgres {
    bin: &'static PgBin,
    run_as: RunAs,
    port: u16,
    data: PathBuf,
    socket_dir: Option<PathBuf>,
    log: PathBuf,
    /// Where `data` was copied from (named in errors, since a damaged
    /// template would break every start).
    template: PathBuf,
    /// The postmaster.
    server: Option<Spawned>,
    // Declared last: fields drop in order, so the directory goes after the
    // server was killed.
    dir: TempDir,
}

impl Postgres {
    /// Creates a cluster and starts it, returning once it accepts
    /// connections.
    ///
    /// The data directory is a copy of an `initdb`'d template cached per
    /// PostgreSQL version and user under the base directory
    /// (`outbox-testkit-template-<version>-t<layout>-<uid>`), created on first
    /// use. If the port picked is taken before the server binds it, a new
    /// one is tried.
    pub async fn start() -> Result<Postgres, Error> {
        Self::start_with(PgSettings::default()).await
    }

    /// Like [`start`](Self::start), with TLS, a `pg_hba.conf` or server
    /// settings of its own (see [`PgSettings`]), written into the data
    /// directory before the first start, so they survive restarts.
    pub async fn start_with(settings: PgSettings) -> Result<Postgres, Error> {
        let bin = PgBin::get().await?;
        let run_as = RunAs::unprivileged()?;
        let dir = cluster_dir(run_as)?;
        let data = dir.path().join("data");

        let started = Instant::now();
        let template = template(bin, run_as).await?;
        copy_dir(&template, &data, run_as).await?;
        settings.write(&data, run_as)?;
        tracing::debug!(
            elapsed = ?started.elapsed(),
            template = %template.display(),
            "prepared a PostgreSQL data directory"
        );
        Self::launch(Cluster {
            bin,
            run_as,
            dir,
            data,
            origin: template,
        })
        .await
    }

    /// Starts the server of a prepared data directory on a free port,
    /// trying a new one if the port picked is taken before the server binds
    /// it.
    pub(crate) async fn launch(cluster: Cluster) -> Result<Postgres, Error> {
        let started = Instant::now();
        let Cluster {
            bin,
            run_as,
            dir,
            data,
            origin,
        } = cluster;
        let socket_dir = dir.path().to_path_buf();
        let mut pg = Postgres {
            bin,
            run_as,
            port: 0,
            data,
            // A Unix socket path is limited to ~107 bytes and the setting is a
            // comma-separated list; past either limit we go TCP-only.
            socket_dir: usable_socket_dir(&socket_dir).then_some(socket_dir),
            log: dir.path().join("postgres.log"),
            template: origin,
            server: None,
            dir,
        };

        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::new();
        for _ in 0..PORT_ATTEMPTS {
            pg.port = support::try_free_port()?;
            match pg.boot(deadline).await? {
                Boot::Ready => {
                    tracing::debug!(port = pg.port, elapsed = ?started.elapsed(), "PostgreSQL ready");
                    return Ok(pg);
                }
                Boot::Retry(why) => last = why,
            }
        }
        Err(Error::Failed {
            doing: "starting PostgreSQL".into(),
            detail: format!("{PORT_ATTEMPTS} ports in a row were taken; last attempt: {last}"),
        })
    }

    /// The server binaries, the user the server runs as, and its data
    /// directory: what a standby of it is made with.
    pub(crate) fn parts(&self) -> (&'static PgBin, RunAs, &Path) {
        (self.bin, self.run_as, &self.data)
    }

    /// The TCP port the server listens on (127.0.0.1); it stays the same
    /// across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection URL for `database` as superuser `postgres` (no password).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Creates an empty database with a unique name (`t_<uuid>`) and returns
    /// its URL.
    pub async fn fresh_database(&self) -> Result<String, Error> {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let client = self.connect("postgres").await?;
        // The name is lowercase hex, so it needs no quoting.
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .map_err(Error::pg(format!("creating database {name}")))?;
        Ok(self.url(&name))
    }

    /// Connects to `database`; the connection is driven by a spawned task
    /// that ends when the client is dropped or the server goes away.
    pub async fn connect(&self, database: &str) -> Result<Client, Error> {
        let (client, connection) = tokio_postgres::connect(&self.url(database), NoTls)
            .await
            .map_err(Error::pg(format!(
                "connecting to database {database:?} on 127.0.0.1:{}",
                self.port
            )))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "testkit PostgreSQL connection ended");
            }
        });
        Ok(client)
    }

    /// Stops the server with a fast shutdown (SIGINT: sessions are
    /// disconnected, open transactions roll back, a checkpoint is written),
    /// SIGKILLing it if it has not exited within 30 s. Stopping a stopped
    /// server does nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        match self.server.take() {
            Some(mut server) => server.stop(Signal::SIGINT, STOP_TIMEOUT).await,
            None => Ok(()),
        }
    }

    /// Stops the server with an immediate shutdown (SIGQUIT: every process
    /// exits at once, no checkpoint; the next start runs crash recovery),
    /// SIGKILLing it if it has not exited within 30 s. Stopping a stopped
    /// server does nothing.
    pub async fn stop_immediate(&mut self) -> Result<(), Error> {
        match self.server.take() {
            Some(mut server) => server.stop(Signal::SIGQUIT, STOP_TIMEOUT).await,
            None => Ok(()),
        }
    }

    /// Crashes the server now: SIGKILL to the postmaster and to every
    /// process it had forked (backends, checkpointer, …), like a power cut
    /// minus the lost page cache. Returns once the postmaster is reaped and
    /// the others have died (so a [`restart`](Self::restart) finds the port
    /// and shared memory free). Committed transactions survive; the next
    /// start runs crash recovery. Killing a stopped server does nothing.
    pub fn kill(&mut self) -> Result<(), Error> {
        match self.server.take() {
            Some(mut server) => server.kill_and_reap(),
            None => Ok(()),
        }
    }

    /// Starts the server again on the same port and data directory (after
    /// [`stop`](Self::stop) or [`kill`](Self::kill); a running server is
    /// stopped first) and waits until it accepts connections. Clients of the
    /// previous run must reconnect.
    pub async fn restart(&mut self) -> Result<(), Error> {
        if self.is_running() {
            self.stop().await?;
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.boot(deadline).await? {
                Boot::Ready => return Ok(()),
                // The port is ours to keep, so wait for whoever holds it (an
                // orphaned backend of a killed server, a foreign process).
                Boot::Retry(why) if Instant::now() < deadline => {
                    tracing::debug!(port = self.port, %why, "PostgreSQL restart retrying");
                    tokio::time::sleep(POLL).await;
                }
                Boot::Retry(why) => {
                    return Err(Error::Timeout {
                        waiting_for: format!("PostgreSQL to restart on port {}", self.port),
                        timeout: READY_TIMEOUT,
                        detail: why,
                    });
                }
            }
        }
    }

    /// Whether the postmaster is alive (it may still be starting up or
    /// shutting down).
    pub fn is_running(&self) -> bool {
        // An exited postmaster is reaped here; a later `kill` or `stop` then
        // has nothing to do.
        self.server
            .as_ref()
            .is_some_and(|server| server.exit_status().is_none())
    }

    /// Spawns the postmaster on `self.port` and waits until it accepts
    /// connections, or until it exits for a reason worth retrying.
    async fn boot(&mut self, deadline: Instant) -> Result<Boot, Error> {
        let offset = support::file_len(&self.log);
        self.server = Some(self.spawn()?);
        loop {
            if let Some(status) = self.server.as_ref().and_then(Spawned::exit_status) {
                self.server = None;
                let log = support::log_since(&self.log, offset);
                if let Some(why) = retryable(&log) {
                    return Ok(Boot::Retry(format!("port {}: {why}", self.port)));
                }
                return Err(Error::Failed {
                    doing: format!("starting PostgreSQL on port {}", self.port),
                    detail: format!(
                        "postgres exited during startup ({status}){}; last lines of {}:\n{}",
                        self.template_note(),
                        self.log.display(),
                        support::last_lines(&log, LOG_LINES)
                    ),
                });
            }
            if self.is_ours().await {
                return Ok(Boot::Ready);
            }
            if Instant::now() >= deadline {
                self.kill()?;
                return Err(support::not_ready(
                    format!("PostgreSQL on 127.0.0.1:{} to accept connections", self.port),
                    READY_TIMEOUT,
                    &self.log,
                    LOG_LINES,
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let socket_dirs = match &self.socket_dir {
            Some(dir) => format!("unix_socket_directories={}", dir.display()),
            None => "unix_socket_directories=".to_string(),
        };
        let mut cmd = tokio::process::Command::new(self.bin.dir.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data)
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", &socket_dirs])
            // No fsync: durability against an OS crash is not what tests
            // test. synchronous_commit stays on: with fsync off it costs one
            // write() per commit, and turning it off would let `kill` lose
            // commits still in the WAL buffers, which crash tests rely on.
            .args(["-c", "fsync=off", "-c", "synchronous_commit=on"])
            .args(["-c", "full_page_writes=off", "-c", "max_connections=200"])
            .args(["-c", "logging_collector=off"])
            // postgres complains when started from a directory it cannot read.
            .current_dir(self.dir.path());
        let name = format!(
            "{} on port {}",
            self.bin.dir.join("postgres").display(),
            self.port
        );
        let setup = Setup {
            run_as: Some(self.run_as),
            ..Setup::server(name, &self.log)
        };
        Spawned::start(cmd, setup)
    }

    /// Whether our server answers on our port. Checking the data directory
    /// matters: after a lost port race another test's cluster may be the one
    /// answering there.
    async fn is_ours(&self) -> bool {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user("postgres")
            .dbname("postgres")
            .connect_timeout(Duration::from_secs(2));
        let Ok((client, connection)) = config.connect(NoTls).await else {
            return false;
        };
        let connection = tokio::spawn(connection);
        let ours = match client.query_one("SHOW data_directory", &[]).await {
            Ok(row) => row
                .try_get::<_, String>(0)
                .is_ok_and(|dir| Path::new(&dir) == self.data),
            Err(_) => false,
        };
        drop(client);
        let _ = connection.await;
        ours
    }

    fn template_note(&self) -> String {
        format!(
            " (data directory copied from {}; if that is a template, delete it if it is damaged)",
            self.template.display()
        )
    }
}

/// What [`Postgres::start_with`] adds to a cluster.
///
/// ```no_run
/// # async fn run(cert: String, key: String, ca: String) -> Result<(), outbox_testkit::Error> {
/// use outbox_testkit::{PgSettings, Postgres};
///
/// let pg = Postgres::start_with(
///     PgSettings::default()
///         .tls(cert, key) // ssl=on with this certificate chain and key
///         .client_ca(ca) // clients' certificates are checked against it
///         .hba("hostssl all all 127.0.0.1/32 cert"),
/// )
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct PgSettings {
    tls: Option<(String, String)>,
    client_ca: Option<String>,
    hba: Option<String>,
    settings: Vec<(String, String)>,
}

impl PgSettings {
    /// Serves TLS (`ssl=on`) with this certificate (PEM, the server's
    /// first, then any intermediates) and private key (PEM).
    pub fn tls(mut self, cert_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        self.tls = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Checks the certificates clients present against these roots (PEM;
    /// `ssl_ca_file`), as `pg_hba.conf`'s `cert` method and `clientcert=`
    /// need.
    pub fn client_ca(mut self, ca_pem: impl Into<String>) -> Self {
        self.client_ca = Some(ca_pem.into());
        self
    }

    /// Replaces `pg_hba.conf` with these lines, after three of the
    /// testkit's own, which it needs to see that the server is up, to create
    /// databases and to take a standby's base backup and stream to it:
    /// `local all all trust`, `host postgres postgres 127.0.0.1/32 trust`
    /// (so the superuser reaches the database `postgres` without TLS; every
    /// other database and user get only what `lines` allow) and
    /// `host replication postgres 127.0.0.1/32 trust` (physical replication
    /// only: a logical replication connection matches its database's lines).
    pub fn hba(mut self, lines: impl Into<String>) -> Self {
        self.hba = Some(lines.into());
        self
    }

    /// Sets a server parameter (`postgresql.auto.conf`), e.g.
    /// `("ssl_min_protocol_version", "TLSv1.3")`.
    pub fn set(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Writes the files and settings into a data directory not yet
    /// started, owned by the server's user.
    fn write(&self, data: &Path, run_as: RunAs) -> Result<(), Error> {
        let mut settings = self.settings.clone();
        let mut files: Vec<(&str, &str)> = Vec::new();
        if let Some((cert, key)) = &self.tls {
            files.push(("server.crt", cert));
            files.push(("server.key", key));
            settings.push(("ssl".into(), "on".into()));
            settings.push(("ssl_cert_file".into(), "server.crt".into()));
            settings.push(("ssl_key_file".into(), "server.key".into()));
        }
        if let Some(ca) = &self.client_ca {
            files.push(("client_ca.crt", ca));
            settings.push(("ssl_ca_file".into(), "client_ca.crt".into()));
        }
        let hba;
        if let Some(lines) = &self.hba {
            hba = format!(
                "# outbox-testkit\nlocal all all trust\nhost postgres postgres 127.0.0.1/32 trust\n\
                 host replication postgres 127.0.0.1/32 trust\n{lines}\n"
            );
            files.push(("pg_hba.conf", &hba));
        }
        if settings.is_empty() && files.is_empty() {
            // Plain `start`: the template's files as they are.
            return Ok(());
        }
        let conf: String = settings
            .iter()
            .map(|(name, value)| format!("{name} = '{}'\n", value.replace('\'', "''")))
            .collect();
        let auto_conf = data.join("postgresql.auto.conf");
        let mut auto = std::fs::read_to_string(&auto_conf).unwrap_or_default();
        auto.push_str(&conf);
        files.push(("postgresql.auto.conf", &auto));
        for (name, contents) in files {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let path = data.join(name);
            let doing = format!("writing {}", path.display());
            // The server refuses a key others can read; the rest need no more.
            let _ = std::fs::remove_file(&path);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .and_then(|mut f| f.write_all(contents.as_bytes()))
                .map_err(Error::io(doing))?;
            run_as.own(&path)?;
        }
        Ok(())
    }
}

/// A data directory ready to start: what [`Postgres::launch`] takes.
pub(crate) struct Cluster {
    pub(crate) bin: &'static PgBin,
    pub(crate) run_as: RunAs,
    /// The temporary directory holding `data`, the log and the socket.
    pub(crate) dir: TempDir,
    pub(crate) data: PathBuf,
    /// Where `data` came from, named in errors (the template, or the
    /// primary a base backup was taken of).
    pub(crate) origin: PathBuf,
}

enum Boot {
    Ready,
    /// The server exited for a transient reason (port or shared memory still
    /// held by someone else).
    Retry(String),
}

/// A new temporary directory for one cluster, owned by the server's user.
pub(crate) fn cluster_dir(run_as: RunAs) -> Result<TempDir, Error> {
    let base = support::base_dir();
    let dir = tempfile::Builder::new()
        .prefix("outbox-testkit-pg-")
        .tempdir_in(base)
        .map_err(Error::io(format!(
            "creating a temporary directory for PostgreSQL in {}",
            base.display()
        )))?;
    run_as.own(dir.path())?;
    Ok(dir)
}

/// Startup failures that go away by themselves or with another port.
fn retryable(log: &str) -> Option<&'static str> {
    if log.contains("Address already in use") {
        Some("the port is in use")
    } else if log.contains("pre-existing shared memory block") {
        Some("processes of the previous server still hold its shared memory")
    } else {
        None
    }
}

fn usable_socket_dir(dir: &Path) -> bool {
    let text = dir.to_string_lossy();
    // ".s.PGSQL.65535" plus the separator must fit in sun_path (108 bytes).
    text.len() + 16 < 108 && !text.contains([',', '"', '\'', ' ', '\\'])
}

/// The PostgreSQL server binaries in use.
#[derive(Debug)]
pub(crate) struct PgBin {
    pub(crate) dir: PathBuf,
    /// `postgres --version`'s number, e.g. `15.20`.
    version: String,
}

impl PgBin {
    pub(crate) async fn get() -> Result<&'static PgBin, Error> {
        static BIN: OnceLock<PgBin> = OnceLock::new();
        if let Some(bin) = BIN.get() {
            return Ok(bin);
        }
        let dir = find_bin_dir().await?;
        let version = server_version(&dir).await?;
        Ok(BIN.get_or_init(|| PgBin { dir, version }))
    }
}

fn has_server(dir: &Path) -> bool {
    support::is_executable(&dir.join("initdb")) && support::is_executable(&dir.join("postgres"))
}

async fn find_bin_dir() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("OUTBOX_PG_BIN") {
        let dir = PathBuf::from(dir);
        if has_server(&dir) {
            return Ok(dir);
        }
        // An explicit choice that does not work must not silently fall back.
        return Err(Error::PostgresNotInstalled {
            looked: format!("OUTBOX_PG_BIN={} (no initdb and postgres there)", dir.display()),
        });
    }

    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((major, e.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .collect();
    versions.sort();
    if let Some((_, dir)) = versions.pop() {
        return Ok(dir);
    }

    if let Ok(out) = tokio::process::Command::new("pg_config")
        .arg("--bindir")
        .stdin(Stdio::null())
        .output()
        .await
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_server(&dir) {
            return Ok(dir);
        }
    }

    let on_path = support::find_on_path("initdb").and_then(|p| Some(p.parent()?.to_path_buf()));
    if let Some(dir) = on_path.filter(|dir| has_server(dir)) {
        return Ok(dir);
    }

    Err(Error::PostgresNotInstalled {
        looked: "OUTBOX_PG_BIN, /usr/lib/postgresql/*/bin, `pg_config --bindir`, PATH".into(),
    })
}

async fn server_version(dir: &Path) -> Result<String, Error> {
    let postgres = dir.join("postgres");
    let out = tokio::process::Command::new(&postgres)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(Error::io(format!("running {} --version", postgres.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "postgres (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)"
    let number = text
        .split_whitespace()
        .find(|word| word.starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or(text.trim());
    let version: String = number
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if !out.status.success() || version.is_empty() {
        return Err(Error::Failed {
            doing: format!("running {} --version", postgres.display()),
            detail: format!(
                "{}; output: {text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(version)
}

/// The `initdb`'d template for this server version and user, creating it if
/// needed.
///
/// Created atomically (initdb into a unique directory, then rename), so a
/// template that exists is complete. Processes racing to create it each run
/// initdb and all but one lose the rename, which is fine; within a process
/// the creation is serialised.
async fn template(bin: &PgBin, run_as: RunAs) -> Result<PathBuf, Error> {
    static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let base = support::base_dir();
    let path = base.join(format!(
        "outbox-testkit-template-{}-t{TEMPLATE_LAYOUT}-{}",
        bin.version, run_as.uid
    ));
    if is_template(&path, run_as) {
        return Ok(path);
    }
    let _creating = CREATING.lock().await;
    if is_template(&path, run_as) {
        return Ok(path);
    }

    let started = Instant::now();
    let staging = tempfile::Builder::new()
        .prefix("outbox-testkit-template-staging-")
        .tempdir_in(base)
        .map_err(Error::io(format!(
            "creating a staging directory for the PostgreSQL template in {}",
            base.display()
        )))?;
    run_as.own(staging.path())?;
    let data = staging.path().join("data");
    initdb(bin, run_as, &data, staging.path()).await?;
    if let Err(e) = std::fs::rename(&data, &path)
        && !is_template(&path, run_as)
    {
        return Err(Error::Io {
            doing: format!("moving the new PostgreSQL template to {}", path.display()),
            source: e,
        });
    }
    tracing::debug!(elapsed = ?started.elapsed(), template = %path.display(), "created a PostgreSQL template");
    Ok(path)
}

fn is_template(path: &Path, run_as: RunAs) -> bool {
    use std::os::unix::fs::MetadataExt;
    // Owned by the user the server runs as, or the copy would not be
    // readable by it (the data directory is 0700).
    std::fs::metadata(path).is_ok_and(|m| m.is_dir() && m.uid() == run_as.uid)
        && path.join("PG_VERSION").is_file()
        && path.join("global/pg_control").is_file()
}

async fn initdb(bin: &PgBin, run_as: RunAs, data: &Path, cwd: &Path) -> Result<(), Error> {
    let initdb = bin.dir.join("initdb");
    let mut cmd = tokio::process::Command::new(&initdb);
    cmd.arg("-D")
        .arg(data)
        .args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale",
            "C",
        ])
        .current_dir(cwd)
        .stdin(Stdio::null());
    run_as.apply(&mut cmd);
    let out = cmd
        .output()
        .await
        .map_err(Error::io(format!("running {}", initdb.display())))?;
    if !out.status.success() {
        return Err(Error::Failed {
            doing: format!("running {} -D {}", initdb.display(), data.display()),
            detail: format!(
                "{}; output:\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(())
}

/// Copies the template to a new data directory, as the server's user so the
/// copy is its own.
async fn copy_dir(from: &Path, to: &Path, run_as: RunAs) -> Result<(), Error> {
    let mut cmd = tokio::process::Command::new("cp");
    cmd.arg("-a")
        .arg(from)
        .arg(to)
        .current_dir(to.parent().unwrap_or(Path::new("/")))
        .stdin(Stdio::null());
    run_as.apply(&mut cmd);
    let doing = format!(
        "copying the PostgreSQL template {} to {}",
        from.display(),
        to.display()
    );
    let out = cmd.output().await.map_err(Error::io(doing.clone()))?;
    if !out.status.success() {
        return Err(Error::Failed {
            doing,
            detail: format!(
                "cp exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(())
}
