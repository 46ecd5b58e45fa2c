//! A throwaway redis-server: one child process on a free port, no
//! persistence, spoken to with raw RESP so no Redis client is needed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
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

/// One throwaway redis-server on 127.0.0.1, owned by this value.
///
/// It runs with `--save "" --appendonly no`, so a restart comes back empty.
/// Its working directory and log are in a temporary directory removed on
/// drop; dropping it SIGKILLs the server.
#[derive(Debug)]
pub struct Redis {
    exe: PathBuf,
    port: u16,
    log: PathBuf,
    server: Option<Spawned>,
    /// Whether the data is kept in an append-only file across restarts.
    persistent: bool,
    // Declared last: fields drop in order, so the directory goes after the
    // server was killed.
    dir: TempDir,
}

impl Redis {
    /// Starts a redis-server on a free port and returns once it answers
    /// `PING` (up to 20 s). If the port picked is taken before the server
    /// binds it, a new one is tried.
    pub async fn start() -> Result<Redis, Error> {
        Redis::start_with(false).await
    }

    /// [`start`](Self::start), but with an append-only file written on every
    /// command (`--appendonly yes --appendfsync always`), so what the server
    /// acknowledged survives [`restart`](Self::restart).
    pub async fn start_persistent() -> Result<Redis, Error> {
        Redis::start_with(true).await
    }

    async fn start_with(persistent: bool) -> Result<Redis, Error> {
        let exe = support::find_on_path("redis-server").ok_or(Error::RedisNotInstalled)?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-redis-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for redis-server in {}",
                base.display()
            )))?;
        let mut redis = Redis {
            exe,
            port: 0,
            log: dir.path().join("redis.log"),
            server: None,
            persistent,
            dir,
        };
        support::start_on_free_port(&mut redis, PORT_ATTEMPTS).await?;
        Ok(redis)
    }

    /// The TCP port the server listens on (127.0.0.1); it stays the same
    /// across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGTERM, SIGKILL after 10 s), reaps it and waits
    /// until its port refuses connections. Stopping a stopped server does
    /// nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        support::stop_server(self, STOP_TIMEOUT, PORT_TIMEOUT).await
    }

    /// Starts the server again on the same port (a running one is stopped
    /// first) and waits until it answers `PING`. Data survives only when it
    /// was started with [`start_persistent`](Self::start_persistent).
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        support::restart_server(self).await
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(if self.persistent {
                ["--appendonly", "yes", "--appendfsync", "always"].as_slice()
            } else {
                ["--appendonly", "no"].as_slice()
            })
            .args(["--daemonize", "no", "--dir"])
            .arg(self.dir.path())
            .current_dir(self.dir.path());
        let name = format!("{} on port {}", self.exe.display(), self.port);
        Spawned::start(cmd, Setup::server(name, &self.log))
    }
}

impl support::ChildServer for Redis {
    const NAME: &'static str = "redis-server";
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
            name: "redis-server",
            port: self.port,
            log: &self.log,
            port_taken: "Address already in use",
            ready_means: "answer PING",
            timeout: READY_TIMEOUT,
            deadline,
            log_lines: LOG_LINES,
            log_offset,
        };
        let port = self.port;
        support::boot(&mut self.server, child, |pid| probe(port, pid), spec).await
    }
}

/// Whether the redis-server with `pid` answers on `port`: `PING` must get
/// `+PONG`, and `INFO server` must name our pid, because after a lost port
/// race another test's redis-server may be the one answering.
async fn probe(port: u16, pid: u32) -> std::io::Result<bool> {
    let stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut stream = BufReader::new(stream);
    stream.get_mut().write_all(b"PING\r\n").await?;
    let mut line = String::new();
    stream.read_line(&mut line).await?;
    if !line.starts_with("+PONG") {
        // e.g. "-LOADING": not ready yet.
        return Ok(false);
    }
    stream.get_mut().write_all(b"INFO server\r\n").await?;
    line.clear();
    stream.read_line(&mut line).await?;
    let Some(len) = line
        .strip_prefix('$')
        .and_then(|n| n.trim_end().parse::<usize>().ok())
    else {
        return Ok(false);
    };
    let mut info = vec![0; len + 2];
    stream.read_exact(&mut info).await?;
    let info = String::from_utf8_lossy(&info);
    Ok(info.lines().any(|l| l.trim_end() == format!("process_id:{pid}")))
}
