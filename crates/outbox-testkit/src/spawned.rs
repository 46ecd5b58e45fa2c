//! The testkit's one child-process type, [`Spawned`]: it spawns a child
//! (optionally in a process group of its own, optionally as an unprivileged
//! user), signals it, waits for it with a timeout, stops it (signal, wait
//! until a deadline, SIGKILL if late, reap) and, when dropped, SIGKILLs it
//! and everything it started and reaps it.
//!
//! Tests run the `outbox` binary with it: stdout and stderr captured line by
//! line, and optionally a `NOTIFY_SOCKET`, so they wait for what it signals,
//! read what it says and check how it exited. The servers (PostgreSQL,
//! Redis, NATS, tansu, RabbitMQ) hold one too, started with a [`Setup`]:
//! their output goes to a log file (quoted in errors, and too much to keep
//! in memory), PostgreSQL runs as [`RunAs`], RabbitMQ (a script and the
//! Erlang VM it starts) in a process group signalled as a whole.
//!
//! One type rather than a server type beside it: whichever way its output
//! goes, a child is signalled, stopped, reaped and cleaned up the same way,
//! and that is the part worth writing once. A child whose output goes to a
//! file simply has no lines to wait for. Readiness, ports and logs are the
//! servers' (`support::boot`); this module knows processes only.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::support::{self, POLL, RunAs, lock};
use crate::{Error, Notifications};

/// Lines of output quoted in errors.
const TAIL_LINES: usize = 30;
/// How long `wait` lets the readers drain the pipes after the child exited.
/// Only a grandchild holding the pipes open makes this matter.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long processes SIGKILLed by [`Spawned::kill_and_reap`] may take to
/// die. Dying takes milliseconds; only a process stuck in the kernel (e.g.
/// on a dead NFS mount) outlasts this.
const REAP_TIMEOUT: Duration = Duration::from_secs(5);

/// A child process (e.g. the `outbox relay` binary, or a testkit server).
///
/// Unless it was started with a log file ([`Setup::log`]), its stdout and
/// stderr lines are captured: both streams go, in arrival order, into one
/// list, and with `OUTBOX_TESTKIT_ECHO` set each is also printed to our
/// stderr as `[child <pid>] <line>`. Dropping it SIGKILLs the child and the
/// processes it started, and reaps it.
#[derive(Debug)]
pub struct Spawned {
    pid: u32,
    /// What messages call it: the program, or what [`Setup::name`] says.
    name: String,
    group: Group,
    /// A mutex so `&self` methods can check whether it exited.
    child: Mutex<Child>,
    output: Arc<Output>,
    /// Set by [`Spawned::spawn_notified`].
    notifications: Option<Notifications>,
}

/// How [`Spawned::start`] sets a child up beyond its `Command`; the default
/// is what [`Spawned::spawn`] does.
#[derive(Debug, Default)]
pub(crate) struct Setup<'a> {
    /// What messages call it (default: the program), e.g.
    /// `redis-server on port 6379`.
    pub(crate) name: Option<String>,
    /// Append stdout and stderr to this file instead of capturing lines.
    pub(crate) log: Option<&'a Path>,
    pub(crate) group: Group,
    /// Run it as this user (the default: as us).
    pub(crate) run_as: Option<RunAs>,
}

impl<'a> Setup<'a> {
    /// A server's setup: called `name`, its output appended to `log`.
    pub(crate) fn server(name: String, log: &'a Path) -> Setup<'a> {
        Setup {
            name: Some(name),
            log: Some(log),
            ..Setup::default()
        }
    }
}

/// Which process group a child runs in, and so what its signals reach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Group {
    /// Ours: signals go to the child alone (kills to what it started too).
    #[default]
    Ours,
    /// One of its own: signals go to the whole group, so a wrapper script
    /// and the program it started stop together.
    Own,
}

#[derive(Debug)]
struct Output {
    lines: Mutex<Vec<String>>,
    /// How many of stdout and stderr have not reached end of file (none
    /// when they go to a log file). Readers also "modify" it after storing
    /// each line, which notifies waiters without changing it.
    open_streams: watch::Sender<usize>,
}

impl Spawned {
    /// Spawns `cmd` with stdout and stderr piped, stdin from `/dev/null`,
    /// and `kill_on_drop(true)`. Must be called inside a tokio runtime.
    pub fn spawn(cmd: Command) -> Result<Spawned, Error> {
        Spawned::start(cmd, Setup::default())
    }

    /// Spawns `cmd` as `setup` says, with stdin from `/dev/null` and
    /// `kill_on_drop(true)` (a backstop: our `Drop` kills more).
    pub(crate) fn start(mut cmd: Command, setup: Setup<'_>) -> Result<Spawned, Error> {
        let name = setup
            .name
            .unwrap_or_else(|| cmd.as_std().get_program().to_string_lossy().into_owned());
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        let streams = match setup.log {
            Some(log) => {
                let (stdout, stderr) = support::log_handles(log)?;
                cmd.stdout(stdout).stderr(stderr);
                0
            }
            None => {
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
                2
            }
        };
        if setup.group == Group::Own {
            cmd.process_group(0);
        }
        if let Some(user) = setup.run_as {
            user.apply(&mut cmd);
        }
        let mut child = cmd.spawn().map_err(Error::io(format!("spawning {name}")))?;
        let pid = child
            .id()
            .expect("a child that was just spawned has not been reaped, so it has a pid");
        let output = Arc::new(Output {
            lines: Mutex::new(Vec::new()),
            open_streams: watch::Sender::new(streams),
        });
        let echo = std::env::var_os("OUTBOX_TESTKIT_ECHO").is_some();
        if let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) {
            tokio::spawn(read_lines(stdout, Arc::clone(&output), pid, echo));
            tokio::spawn(read_lines(stderr, Arc::clone(&output), pid, echo));
        }
        Ok(Spawned {
            pid,
            name,
            group: setup.group,
            child: Mutex::new(child),
            output,
            notifications: None,
        })
    }

    /// Like [`spawn`](Self::spawn), with `NOTIFY_SOCKET` set to a fresh
    /// [`Notifications`] socket, so
    /// [`wait_for_notification`](Self::wait_for_notification) can wait for
    /// `READY=1` and the like.
    pub fn spawn_notified(mut cmd: Command) -> Result<Spawned, Error> {
        let notifications = Notifications::bind()?;
        cmd.env("NOTIFY_SOCKET", notifications.path());
        let mut spawned = Spawned::spawn(cmd)?;
        spawned.notifications = Some(notifications);
        Ok(spawned)
    }

    /// The notify socket, if it was spawned with
    /// [`spawn_notified`](Self::spawn_notified).
    pub fn notifications(&self) -> Option<&Notifications> {
        self.notifications.as_ref()
    }

    /// Waits for a notification, already received or future, with the line
    /// `key_value` (e.g. `READY=1`). Fails early if the child closed its
    /// output (it exited) without sending one, and at once if it was not
    /// spawned with [`spawn_notified`](Self::spawn_notified).
    pub async fn wait_for_notification(&self, key_value: &str, timeout: Duration) -> Result<(), Error> {
        let waiting_for = format!("{key_value} from {} (pid {})", self.name, self.pid);
        let Some(notifications) = &self.notifications else {
            return Err(Error::Failed {
                doing: format!("waiting for {waiting_for}"),
                detail: "it was not spawned with Spawned::spawn_notified".into(),
            });
        };
        let mut open_streams = self.output.open_streams.subscribe();
        tokio::select! {
            came = notifications.wait_for(key_value, timeout) => {
                came.map_err(|_| self.missing_error(waiting_for, Some(timeout)))
            }
            // A datagram sent before the exit is queued by now.
            _ = open_streams.wait_for(|&open| open == 0) => {
                if notifications.has(key_value) {
                    Ok(())
                } else {
                    Err(self.missing_error(waiting_for, None))
                }
            }
        }
    }

    /// Whether a notification so far had the line `key_value`; `false` if
    /// it was not spawned with [`spawn_notified`](Self::spawn_notified).
    pub fn notified(&self, key_value: &str) -> bool {
        self.notifications.as_ref().is_some_and(|n| n.has(key_value))
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's peak resident set so far (`VmHWM`), in bytes; None once
    /// it has exited.
    pub fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?;
        Some(kb * 1024)
    }

    /// Waits for the first line, already seen or future, containing
    /// `needle`, and returns it. Fails early if the child closed its output
    /// without printing it.
    pub async fn wait_for_line(&self, needle: &str, timeout: Duration) -> Result<String, Error> {
        let mut open_streams = self.output.open_streams.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut scanned = 0;
        loop {
            // Marked seen before scanning, so a line stored after the scan
            // wakes us below.
            let open = *open_streams.borrow_and_update();
            {
                let lines = lock(&self.output.lines);
                if let Some(line) = lines[scanned..].iter().find(|l| l.contains(needle)) {
                    return Ok(line.clone());
                }
                scanned = lines.len();
            }
            if open == 0 {
                return Err(self.missing_error(self.line_wanted(needle), None));
            }
            match tokio::time::timeout_at(deadline, open_streams.changed()).await {
                Ok(Ok(())) => {}
                // The sender lives in `self.output`, so this cannot happen
                // while we borrow `self`; treat it like the deadline.
                Ok(Err(_)) | Err(_) => {
                    return Err(self.missing_error(self.line_wanted(needle), Some(timeout)));
                }
            }
        }
    }

    /// How the child exited, or `None` while it runs.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        lock(&self.child).try_wait().ok().flatten()
    }

    /// Every line so far, stdout and stderr interleaved in arrival order.
    pub fn lines(&self) -> Vec<String> {
        lock(&self.output.lines).clone()
    }

    /// How many lines so far contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        lock(&self.output.lines)
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Sends `sig` to the child, or to its process group if it has one of
    /// its own. Fails if it has already exited (its pid may belong to
    /// someone else by now).
    pub fn signal(&self, sig: Signal) -> Result<(), Error> {
        let mut child = lock(&self.child);
        let doing = || format!("sending {sig} to {} (pid {})", self.name, self.pid);
        // Holding the lock keeps anyone else from reaping it between this
        // check and the signal, so the pid is still the child's.
        match child.try_wait() {
            Ok(None) => {}
            Ok(Some(status)) => {
                return Err(Error::Failed {
                    doing: doing(),
                    detail: format!("it already exited ({status})"),
                });
            }
            Err(e) => {
                return Err(Error::Io {
                    doing: doing(),
                    source: e,
                });
            }
        }
        self.send(sig).map_err(Error::sys(doing()))
    }

    /// Sends SIGKILL now to the child and to the processes it started
    /// (nothing if it already exited); [`wait`](Self::wait) reaps it.
    ///
    /// The descendants matter for wrappers like `sh -c '…; sleep 30'`: a
    /// surviving `sleep` would hold the output pipes open.
    pub fn kill(&mut self) -> Result<(), Error> {
        self.kill_all(Vec::new()).map(drop)
    }

    /// Waits for the child to exit, then for its output to be read to the
    /// end (so [`lines`](Self::lines) is complete). On timeout the child is
    /// killed and an error returned.
    pub async fn wait(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        let doing = format!("waiting for {} (pid {}) to exit", self.name, self.pid);
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        let status = match tokio::time::timeout(timeout, child.wait()).await {
            Ok(status) => status.map_err(Error::io(doing))?,
            Err(_) => {
                let _ = self.kill_all(Vec::new());
                let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
                let _ = tokio::time::timeout(DRAIN_TIMEOUT, child.wait()).await;
                return Err(Error::Timeout {
                    waiting_for: format!("{} (pid {}) to exit", self.name, self.pid),
                    timeout,
                    detail: format!("killed it; its last lines:\n{}", self.tail(TAIL_LINES)),
                });
            }
        };
        let mut open_streams = self.output.open_streams.subscribe();
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, open_streams.wait_for(|&open| open == 0)).await;
        Ok(status)
    }

    /// Stops the child: sends `sig` (to its group, if it has its own), then
    /// waits until `timeout` for it to exit and for the processes it had
    /// started to die; if they are late, SIGKILLs them all. Either way the
    /// child is reaped. Stopping an exited child does nothing.
    pub(crate) async fn stop(&mut self, sig: Signal, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        let doing = format!("stopping {} (pid {}) with {sig}", self.name, self.pid);
        if self.exit_status().is_some() {
            return Ok(());
        }
        // Listed before the signal: once the child exits, what it started
        // is reparented and no longer found below it.
        let tree = descendants(self.nix_pid());
        // Not reaped (only `&mut self` could, and we hold it), so the pid is
        // still the child's.
        match self.send(sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(source) => return Err(Error::Sys { doing, source }),
        }
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Ok(status) = tokio::time::timeout(timeout, child.wait()).await {
            status.map_err(Error::io(doing))?;
            while !all_dead(&tree) && Instant::now() < deadline {
                tokio::time::sleep(POLL).await;
            }
            if all_dead(&tree) {
                return Ok(());
            }
        }
        tracing::warn!(process = %self.name, pid = self.pid, %sig, ?timeout, "a child ignored a request to stop; killing it");
        self.kill_and_reap_with(tree)
    }

    /// SIGKILLs the child (its group too, if it has its own) and every
    /// process it started, reaps it, and waits (up to 5 s) for the others to
    /// die, so nothing holds its port, shared memory or files afterwards.
    /// Dying after SIGKILL takes milliseconds, so this blocks, and `Drop`
    /// and sync callers can use it. A child already reaped is left alone.
    pub(crate) fn kill_and_reap(&mut self) -> Result<(), Error> {
        self.kill_and_reap_with(Vec::new())
    }

    /// [`kill_and_reap`](Self::kill_and_reap), also killing `listed`.
    fn kill_and_reap_with(&mut self, listed: Vec<Pid>) -> Result<(), Error> {
        let others = self.kill_all(listed)?;
        let deadline = Instant::now() + REAP_TIMEOUT;
        let doing = || format!("reaping {} (pid {}) after SIGKILL", self.name, self.pid);
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        while child.try_wait().map_err(Error::io(doing()))?.is_none() {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    waiting_for: format!("{} (pid {}) to die after SIGKILL", self.name, self.pid),
                    timeout: REAP_TIMEOUT,
                    detail: "it is stuck in the kernel (state D)".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // Only a lying /proc makes this bound matter.
        while !all_dead(&others) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// SIGKILLs, unless it was reaped, the child, its group (if it has its
    /// own) and the processes below it, and in any case `listed` (the tree
    /// as it was earlier). Returns the pids killed besides the child's.
    fn kill_all(&mut self, mut listed: Vec<Pid>) -> Result<Vec<Pid>, Error> {
        let pid = self.nix_pid();
        let doing = || format!("killing {} (pid {})", self.name, self.pid);
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        if child.try_wait().map_err(Error::io(doing()))?.is_none() {
            // Listed first: once the child dies, its children are reparented.
            listed.extend(descendants(pid));
            if self.group == Group::Own {
                let _ = killpg(pid, Signal::SIGKILL);
            }
            child.start_kill().map_err(Error::io(doing()))?;
        }
        for &pid in &listed {
            let _ = kill(pid, Signal::SIGKILL);
        }
        Ok(listed)
    }

    /// Sends `sig` to the child or its group. Only while it is not reaped:
    /// after that, its pid may be someone else's.
    fn send(&self, sig: Signal) -> nix::Result<()> {
        match self.group {
            Group::Ours => kill(self.nix_pid(), sig),
            Group::Own => killpg(self.nix_pid(), sig),
        }
    }

    fn nix_pid(&self) -> Pid {
        // Pids fit in pid_t.
        Pid::from_raw(self.pid as i32)
    }

    fn line_wanted(&self, needle: &str) -> String {
        format!(
            "a line containing {needle:?} from {} (pid {})",
            self.name, self.pid
        )
    }

    /// The error for a line or notification that did not come: `timeout`
    /// if we gave up waiting, `None` if the output ended.
    fn missing_error(&self, waiting_for: String, timeout: Option<Duration>) -> Error {
        let state = match lock(&self.child).try_wait() {
            Ok(Some(status)) => format!("the process exited ({status})"),
            Ok(None) => "the process is still running".to_string(),
            Err(e) => format!("the process state is unknown ({e})"),
        };
        let tail = self.tail(TAIL_LINES);
        match timeout {
            Some(timeout) => Error::Timeout {
                waiting_for,
                timeout,
                detail: format!("{state}; its last lines:\n{tail}"),
            },
            None => Error::Failed {
                doing: format!("waiting for {waiting_for}"),
                detail: format!("its output ended first; {state}; its last lines:\n{tail}"),
            },
        }
    }

    fn tail(&self, n: usize) -> String {
        let lines = lock(&self.output.lines);
        if lines.is_empty() {
            return "(none)".into();
        }
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // kill_on_drop would get the child only, not what it started, and
        // would not wait until its port and files are free.
        if let Err(e) = self.kill_and_reap() {
            tracing::warn!(error = %e, "killing a testkit child process on drop");
        }
    }
}

/// Every process below `root`, from one pass over `/proc` (none where there
/// is no `/proc`).
fn descendants(root: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(i32, i32)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, proc_stat(pid)?.1)))
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![root.as_raw()];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &parents {
            if ppid == parent {
                found.push(Pid::from_raw(pid));
                frontier.push(pid);
            }
        }
    }
    found
}

/// Whether every one of `pids` is gone or a zombie (it holds no memory,
/// sockets or files any more).
fn all_dead(pids: &[Pid]) -> bool {
    pids.iter().all(|&pid| match proc_stat(pid.as_raw()) {
        Some((state, _)) => state == 'Z' || state == 'X',
        None => !Path::new("/proc").join(pid.as_raw().to_string()).exists(),
    })
}

/// (state, ppid) of a process, from `/proc/<pid>/stat`.
fn proc_stat(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain ") ".
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

async fn read_lines(stream: impl AsyncRead + Unpin, output: Arc<Output>, pid: u32, echo: bool) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        // Bytes, not `lines()`: a child printing invalid UTF-8 must not end
        // the capture.
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&buf);
        let line = text.trim_end_matches(['\n', '\r']).to_owned();
        if echo {
            eprintln!("[child {pid}] {line}");
        }
        lock(&output.lines).push(line);
        output.open_streams.send_modify(|_| {});
    }
    output.open_streams.send_modify(|open| *open -= 1);
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    const LONG: Duration = Duration::from_secs(30);

    /// `sh` in a group of its own, with a `sleep` it started; returns the
    /// `sleep`'s pid too.
    async fn sh_and_sleep(script: &str) -> (Spawned, Pid) {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!("{script} sleep 30 & echo $!; wait"));
        let setup = Setup {
            group: Group::Own,
            ..Setup::default()
        };
        let sh = Spawned::start(cmd, setup).unwrap();
        let line = sh.wait_for_line("", LONG).await.unwrap();
        (sh, Pid::from_raw(line.parse().unwrap()))
    }

    #[tokio::test]
    async fn stop_signals_the_group() {
        let (mut sh, sleep) = sh_and_sleep("").await;
        let started = Instant::now();
        sh.stop(Signal::SIGTERM, LONG).await.unwrap();
        assert!(
            started.elapsed() < LONG / 2,
            "stopped by SIGTERM, not by the deadline"
        );
        assert_eq!(sh.exit_status().unwrap().signal(), Some(Signal::SIGTERM as i32));
        assert!(all_dead(&[sleep]), "the sleep got SIGTERM too");
    }

    #[tokio::test]
    async fn stop_kills_what_ignores_the_signal_once_late() {
        // Ignored signals stay ignored across exec, so the sleep ignores
        // SIGTERM too.
        let (mut sh, sleep) = sh_and_sleep("trap '' TERM;").await;
        sh.stop(Signal::SIGTERM, Duration::from_millis(200))
            .await
            .unwrap();
        assert_eq!(sh.exit_status().unwrap().signal(), Some(Signal::SIGKILL as i32));
        assert!(all_dead(&[sleep]), "the sleep was killed too");
    }

    #[tokio::test]
    async fn drop_kills_and_reaps_what_it_started() {
        let (sh, sleep) = sh_and_sleep("").await;
        let pid = sh.nix_pid();
        drop(sh);
        assert!(all_dead(&[sleep]), "the sleep was killed");
        assert_eq!(
            nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG)),
            Err(Errno::ECHILD),
            "the child was reaped"
        );
    }
}
