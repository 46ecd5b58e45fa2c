//! A throwaway `nats-server -js`: one child process on a free port with its
//! own JetStream store directory, which survives a restart (so do streams).
//! Readiness is read from the server's `INFO` line, so no NATS client is
//! needed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;

use crate::spawned::Setup;
use crate::support::{self, Boot};
use crate::{Error, Spawned};

/// How long a start or restart may take.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long SIGTERM may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the port may keep accepting after the server was reaped.
const PORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How many fresh ports `start` tries when the chosen one gets taken.
const PORT_ATTEMPTS: usize = 5;
/// Lines of server log quoted in errors.
const LOG_LINES: usize = 30;

/// One throwaway nats-server with JetStream on 127.0.0.1, owned by this value.
///
/// Its store (`-sd`) and log are in a temporary directory removed on drop;
/// a restart keeps them, so streams and their messages survive it. Dropping
/// it SIGKILLs the server.
#[derive(Debug)]
pub struct Nats {
    exe: PathBuf,
    port: u16,
    log: PathBuf,
    server: Option<Spawned>,
    /// `max_payload` in bytes, when not the server's default (1 MiB).
    max_payload: Option<usize>,
    /// The one user and password clients must give, if any.
    auth: Option<(String, String)>,
    // Declared last: fields drop in order, so the directory goes after the
    // server was killed.
    dir: TempDir,
}

impl Nats {
    /// Starts a nats-server with JetStream on a free port and returns once
    /// it greets clients with JetStream enabled (up to 20 s). If the port
    /// picked is taken before the server binds it, a new one is tried.
    pub async fn start() -> Result<Nats, Error> {
        Nats::start_with(None).await
    }

    /// [`start`](Self::start) with the server's `max_payload` set to `bytes`:
    /// it refuses larger messages (clients learn the limit from `INFO`).
    pub async fn start_with_max_payload(bytes: usize) -> Result<Nats, Error> {
        Nats::start_with(Some(bytes)).await
    }

    /// [`start`](Self::start) with one user: clients must give `user` and
    /// `password` (`nats://user:password@…`); others are refused with
    /// `Authorization Violation`.
    pub async fn start_with_user(user: &str, password: &str) -> Result<Nats, Error> {
        Nats::start_inner(None, Some((user.to_owned(), password.to_owned()))).await
    }

    async fn start_with(max_payload: Option<usize>) -> Result<Nats, Error> {
        Nats::start_inner(max_payload, None).await
    }

    async fn start_inner(max_payload: Option<usize>, auth: Option<(String, String)>) -> Result<Nats, Error> {
        let exe = find_exe().ok_or(Error::NatsNotInstalled)?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-nats-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for nats-server in {}",
                base.display()
            )))?;
        let mut nats = Nats {
            exe,
            port: 0,
            log: dir.path().join("nats.log"),
            server: None,
            max_payload,
            auth,
            dir,
        };
        if let Some(bytes) = max_payload {
            let config = nats.dir.path().join("nats.conf");
            std::fs::write(&config, format!("max_payload: {bytes}\n"))
                .map_err(Error::io(format!("writing {}", config.display())))?;
        }
        support::start_on_free_port(&mut nats, PORT_ATTEMPTS).await?;
        Ok(nats)
    }

    /// The TCP port the server listens on (127.0.0.1); it stays the same
    /// across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGTERM, SIGKILL after 10 s), reaps it and waits
    /// until its port refuses connections. Stopping a stopped server does
    /// nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        support::stop_server(self, STOP_TIMEOUT, PORT_TIMEOUT).await
    }

    /// Starts the server again on the same port and store (a running one is
    /// stopped first) and waits until it is ready. Streams survive.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        support::restart_server(self).await
    }

    /// A server name unique to this value, so the probe can tell our server
    /// from another test's that won a race for the port.
    fn name(&self) -> String {
        let dir = self.dir.path().file_name().unwrap_or_default();
        format!("{}-{}", dir.to_string_lossy(), self.port)
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let mut cmd = tokio::process::Command::new(&self.exe);
        if self.max_payload.is_some() {
            cmd.arg("-c").arg(self.dir.path().join("nats.conf"));
        }
        if let Some((user, password)) = &self.auth {
            cmd.arg("--user").arg(user).arg("--pass").arg(password);
        }
        cmd.args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-n")
            .arg(self.name())
            .arg("-sd")
            .arg(self.dir.path().join("store"))
            .current_dir(self.dir.path());
        let name = format!("{} on port {}", self.exe.display(), self.port);
        Spawned::start(cmd, Setup::server(name, &self.log))
    }
}

impl support::ChildServer for Nats {
    const NAME: &'static str = "nats-server";
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
            name: "nats-server",
            port: self.port,
            log: &self.log,
            port_taken: "address already in use",
            ready_means: "enable JetStream",
            timeout: READY_TIMEOUT,
            deadline,
            log_lines: LOG_LINES,
            log_offset,
        };
        let (port, name) = (self.port, self.name());
        support::boot(&mut self.server, child, |_| probe(port, &name), spec).await
    }
}

/// nats-server on `PATH`, else where Debian puts it (`/usr/sbin`, which is
/// not on a normal user's `PATH`).
fn find_exe() -> Option<PathBuf> {
    support::find_on_path("nats-server").or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/nats-server");
        support::is_executable(&sbin).then_some(sbin)
    })
}

/// Whether the nats-server named `name` answers on `port` with JetStream on:
/// a server greets every client with one `INFO {json}` line.
async fn probe(port: u16, name: &str) -> std::io::Result<bool> {
    let stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut stream = BufReader::new(stream);
    let mut line = String::new();
    stream.read_line(&mut line).await?;
    let Some(info) = line.strip_prefix("INFO ") else {
        return Ok(false);
    };
    let Ok(info) = serde_json::from_str::<serde_json::Value>(info.trim_end()) else {
        return Ok(false);
    };
    Ok(info["server_name"] == name && info["jetstream"] == true)
}
