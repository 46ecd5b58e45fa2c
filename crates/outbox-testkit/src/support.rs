//! Plumbing the services share: where their throwaway directories go, which
//! user runs them, finding programs, reading log tails, and booting,
//! stopping and restarting a server on its port (its process is a
//! [`Spawned`]).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::{Error, Spawned};

/// How often we look at something that cannot notify us (a process exiting,
/// a server starting to accept connections).
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// tmpfs with less room than this is not worth using: a cluster takes ~40 MB,
/// and a full tmpfs fails in confusing ways.
const MIN_SHM_FREE: u64 = 1 << 30;

/// The directory under which throwaway directories and the PostgreSQL
/// template go.
///
/// `OUTBOX_TESTKIT_TMPDIR` wins; an explicit `TMPDIR` is honoured next. Without
/// either we prefer `/dev/shm` when it has room, because creating files on the
/// disk-backed `/tmp` of a small VM costs ~0.5 ms each and a cluster has ~1000.
pub(crate) fn base_dir() -> &'static Path {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        if let Some(dir) = std::env::var_os("OUTBOX_TESTKIT_TMPDIR") {
            return absolute(PathBuf::from(dir));
        }
        let shm = Path::new("/dev/shm");
        if std::env::var_os("TMPDIR").is_none() && has_room(shm) {
            return shm.to_path_buf();
        }
        absolute(std::env::temp_dir())
    })
}

fn absolute(path: PathBuf) -> PathBuf {
    std::path::absolute(&path).unwrap_or(path)
}

fn has_room(dir: &Path) -> bool {
    let writable = nix::unistd::access(
        dir,
        nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
    )
    .is_ok();
    let free = nix::sys::statvfs::statvfs(dir)
        .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
        .unwrap_or(0);
    writable && free >= MIN_SHM_FREE
}

/// The user a service's processes run as.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunAs {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    /// Whether the child must switch to `uid`/`gid` (we are root).
    switch: bool,
}

impl RunAs {
    /// The current user; when that is root, the `postgres` system user (or
    /// `nobody`), because PostgreSQL refuses to run as root.
    pub(crate) fn unprivileged() -> Result<RunAs, Error> {
        let euid = nix::unistd::geteuid();
        if !euid.is_root() {
            return Ok(RunAs {
                uid: euid.as_raw(),
                gid: nix::unistd::getegid().as_raw(),
                switch: false,
            });
        }
        for name in ["postgres", "nobody"] {
            let user = nix::unistd::User::from_name(name)
                .map_err(Error::sys(format!("looking up the system user {name:?}")))?;
            if let Some(user) = user {
                return Ok(RunAs {
                    uid: user.uid.as_raw(),
                    gid: user.gid.as_raw(),
                    switch: true,
                });
            }
        }
        Err(Error::Failed {
            doing: "choosing an unprivileged user to run PostgreSQL as (we are root)".into(),
            detail: "neither a `postgres` nor a `nobody` user exists; create one \
                     (`apt-get install postgresql` creates `postgres`)"
                .into(),
        })
    }

    /// Makes `cmd` run as this user.
    pub(crate) fn apply(&self, cmd: &mut tokio::process::Command) {
        if self.switch {
            cmd.uid(self.uid).gid(self.gid);
        }
    }

    /// Gives `path` to this user, so its processes can write there.
    pub(crate) fn own(&self, path: &Path) -> Result<(), Error> {
        if !self.switch {
            return Ok(());
        }
        std::os::unix::fs::chown(path, Some(self.uid), Some(self.gid)).map_err(Error::io(format!(
            "giving {} to uid {}",
            path.display(),
            self.uid
        )))
    }
}

/// `name` on `PATH`, if it is there.
pub(crate) fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

pub(crate) fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The last `n` lines of a log file, for error messages; a note instead if it
/// cannot be read.
pub(crate) fn log_tail(path: &Path, n: usize) -> String {
    // Logs of long runs can be large; the tail is all we show.
    const WINDOW: u64 = 64 * 1024;
    let read = || -> std::io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => last_lines(&text, n),
        Err(e) => format!("(could not read {}: {e})", path.display()),
    }
}

/// What a log file holds from byte `offset` on (what one start attempt wrote).
pub(crate) fn log_since(path: &Path, offset: u64) -> String {
    let read = || -> std::io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    read().unwrap_or_default()
}

pub(crate) fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

pub(crate) fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    if lines.is_empty() {
        return "(empty)".into();
    }
    lines[start..].join("\n")
}

/// Locks a mutex whose data stays consistent even if a holder panicked (every
/// critical section here is a single push, swap or read).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A port nobody listens on right now (someone may take it before we do;
/// the servers retry with another).
pub(crate) fn try_free_port() -> Result<u16, Error> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(Error::io("binding 127.0.0.1:0 to find a free port"))
}

/// The server log opened for appending, as two handles (stdout, stderr), so
/// both streams of a server end up in one file.
pub(crate) fn log_handles(path: &Path) -> Result<(std::fs::File, std::fs::File), Error> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(Error::io(format!("opening the server log {}", path.display())))?;
    let other = log
        .try_clone()
        .map_err(Error::io("duplicating the server log handle"))?;
    Ok((log, other))
}

/// The error for a server that did not become ready in time, quoting its log.
pub(crate) fn not_ready(waiting_for: String, timeout: Duration, log: &Path, lines: usize) -> Error {
    Error::Timeout {
        waiting_for,
        timeout,
        detail: format!("last lines of {}:\n{}", log.display(), log_tail(log, lines)),
    }
}

/// Waits until nothing accepts on `port` any more (the server `what` was
/// reaped, but the kernel may take a moment to release the port).
pub(crate) async fn wait_port_closed(port: u16, timeout: Duration, what: &str) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                waiting_for: format!("port {port} to refuse connections"),
                timeout,
                detail: format!("{what} has exited, so another process is listening there"),
            });
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

/// How one boot of a server child ended.
pub(crate) enum Boot {
    Ready,
    /// It exited because its port was taken: try another.
    PortTaken(String),
}

/// What [`boot`] needs to know about one server.
pub(crate) struct BootSpec<'a> {
    /// e.g. `redis-server`.
    pub(crate) name: &'a str,
    pub(crate) port: u16,
    pub(crate) log: &'a Path,
    /// Text its log shows when the port was taken.
    pub(crate) port_taken: &'a str,
    /// What readiness means, for the timeout message.
    pub(crate) ready_means: &'a str,
    pub(crate) timeout: Duration,
    pub(crate) deadline: Instant,
    pub(crate) log_lines: usize,
    /// The log's length before the child was spawned: what it writes
    /// after this is its own.
    pub(crate) log_offset: u64,
}

/// Puts a just-spawned server child into `slot` and polls until
/// `probe(pid)` says it is ready, it exits (port taken, or a startup failure
/// quoted from its log), or `spec.deadline` passes (the child is killed).
pub(crate) async fn boot<P, F>(
    slot: &mut Option<Spawned>,
    child: Spawned,
    probe: P,
    spec: BootSpec<'_>,
) -> Result<Boot, Error>
where
    P: Fn(u32) -> F,
    F: std::future::Future<Output = std::io::Result<bool>>,
{
    let offset = spec.log_offset;
    let doing = || format!("starting {} on port {}", spec.name, spec.port);
    *slot = Some(child);
    loop {
        let server = slot.as_mut().ok_or_else(|| Error::Failed {
            doing: doing(),
            detail: "the server vanished while starting".into(),
        })?;
        let pid = server.pid();
        if let Some(status) = server.exit_status() {
            *slot = None;
            let log = log_since(spec.log, offset);
            if log.contains(spec.port_taken) {
                return Ok(Boot::PortTaken(format!("port {} is in use", spec.port)));
            }
            return Err(Error::Failed {
                doing: doing(),
                detail: format!(
                    "it exited during startup ({status}); last lines of {}:\n{}",
                    spec.log.display(),
                    last_lines(&log, spec.log_lines)
                ),
            });
        }
        if matches!(
            tokio::time::timeout(Duration::from_secs(2), probe(pid)).await,
            Ok(Ok(true))
        ) {
            return Ok(Boot::Ready);
        }
        if Instant::now() >= spec.deadline {
            if let Some(mut server) = slot.take() {
                server.kill_and_reap()?;
            }
            return Err(not_ready(
                format!("{} on 127.0.0.1:{} to {}", spec.name, spec.port, spec.ready_means),
                spec.timeout,
                spec.log,
                spec.log_lines,
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A server child the testkit starts on a free port, stops and restarts
/// on the same port: what [`start_on_free_port`], [`stop_server`] and
/// [`restart_server`] need from redis-server and nats-server alike.
pub(crate) trait ChildServer {
    /// e.g. `redis-server`.
    const NAME: &'static str;
    /// How long a boot may take.
    const READY_TIMEOUT: Duration;
    fn port(&self) -> u16;
    fn set_port(&mut self, port: u16);
    fn child(&mut self) -> &mut Option<Spawned>;
    /// Spawns the child and waits for it: [`boot`] with its own spec.
    fn boot(&mut self, deadline: Instant) -> impl std::future::Future<Output = Result<Boot, Error>>;
}

/// Boots `server` on a free port, trying a fresh one up to `attempts` times
/// when the chosen one gets taken before the server binds it.
pub(crate) async fn start_on_free_port<S: ChildServer>(server: &mut S, attempts: usize) -> Result<(), Error> {
    let deadline = Instant::now() + S::READY_TIMEOUT;
    let mut last = String::new();
    for _ in 0..attempts {
        server.set_port(try_free_port()?);
        match server.boot(deadline).await? {
            Boot::Ready => return Ok(()),
            Boot::PortTaken(why) => last = why,
        }
    }
    Err(Error::Failed {
        doing: format!("starting {}", S::NAME),
        detail: format!("{attempts} ports in a row were taken; last attempt: {last}"),
    })
}

/// SIGTERM, SIGKILL after `stop_timeout`, reap, then wait until the port
/// refuses connections. Stopping a stopped server does nothing. The port
/// stays held until [`restart_server`] (see [`hold_port`]).
pub(crate) async fn stop_server<S: ChildServer>(
    server: &mut S,
    stop_timeout: Duration,
    port_timeout: Duration,
) -> Result<(), Error> {
    let Some(mut child) = server.child().take() else {
        return Ok(());
    };
    child.stop(Signal::SIGTERM, stop_timeout).await?;
    wait_port_closed(server.port(), port_timeout, S::NAME).await?;
    hold_port(server.port());
    Ok(())
}

/// Ports of servers this process stopped and may start again, each held
/// by a socket bound to it but not listening: a client is refused, as by
/// a stopped server, and no other test's server (tests run in processes
/// of their own, so only the kernel can keep them apart) is given the port
/// by [`try_free_port`] meanwhile. Without it, a test whose broker was
/// down saw its relay deliver into another test's new broker on that port.
static HELD: std::sync::Mutex<Vec<(u16, tokio::net::TcpSocket)>> = std::sync::Mutex::new(Vec::new());

/// Holds `port` (see [`HELD`]); best effort: a port a lingering connection
/// of the old server still keeps (`TIME_WAIT`) is not held.
fn hold_port(port: u16) {
    let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
        return;
    };
    if socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .is_ok()
    {
        HELD.lock().expect("not poisoned").push((port, socket));
    }
}

/// Lets go of `port` for its server to bind it again.
fn release_port(port: u16) {
    HELD.lock().expect("not poisoned").retain(|(p, _)| *p != port);
}

/// Boots `server` again on its port (stop it first), retrying while the
/// old process's port is still held, until `S::READY_TIMEOUT`.
pub(crate) async fn restart_server<S: ChildServer>(server: &mut S) -> Result<(), Error> {
    release_port(server.port());
    let deadline = Instant::now() + S::READY_TIMEOUT;
    loop {
        match server.boot(deadline).await? {
            Boot::Ready => return Ok(()),
            Boot::PortTaken(_) if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            Boot::PortTaken(why) => {
                return Err(Error::Timeout {
                    waiting_for: format!("{} to restart on port {}", S::NAME, server.port()),
                    timeout: S::READY_TIMEOUT,
                    detail: why,
                });
            }
        }
    }
}
