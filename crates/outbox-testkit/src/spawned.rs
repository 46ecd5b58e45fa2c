//! A child process whose output is captured line by line, and which can be
//! given a `NOTIFY_SOCKET`, so tests can wait for what it signals, read what
//! it says, signal it and check how it exited.

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::support::{self, lock};
use crate::{Error, Notifications};

/// Lines of output quoted in errors.
const TAIL_LINES: usize = 30;
/// How long `wait` lets the readers drain the pipes after the child exited.
/// Only a grandchild holding the pipes open makes this matter.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A child process (e.g. the `outbox relay` binary) whose stdout and stderr
/// lines are captured.
///
/// Lines from both streams go, in arrival order, into one list. With
/// `OUTBOX_TESTKIT_ECHO` set, each is also printed to our stderr as
/// `[child <pid>] <line>`. Dropping it SIGKILLs the child and the processes
/// it started.
#[derive(Debug)]
pub struct Spawned {
    pid: u32,
    program: String,
    /// A mutex so `&self` methods can check whether it exited.
    child: Mutex<Child>,
    output: Arc<Output>,
    /// Set by [`Spawned::spawn_notified`].
    notifications: Option<Notifications>,
}

#[derive(Debug)]
struct Output {
    lines: Mutex<Vec<String>>,
    /// How many of stdout and stderr have not reached end of file. Readers
    /// also "modify" it after storing each line, which notifies waiters
    /// without changing it.
    open_streams: watch::Sender<usize>,
}

impl Spawned {
    /// Spawns `cmd` with stdout and stderr piped, stdin from `/dev/null`,
    /// and `kill_on_drop(true)`. Must be called inside a tokio runtime.
    pub fn spawn(mut cmd: Command) -> Result<Spawned, Error> {
        let program = cmd.as_std().get_program().to_string_lossy().into_owned();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(Error::io(format!("spawning {program}")))?;
        let pid = child
            .id()
            .expect("a child that was just spawned has not been reaped, so it has a pid");
        let output = Arc::new(Output {
            lines: Mutex::new(Vec::new()),
            open_streams: watch::Sender::new(2),
        });
        let echo = std::env::var_os("OUTBOX_TESTKIT_ECHO").is_some();
        let stdout = child.stdout.take().expect("stdout was set to piped above");
        let stderr = child.stderr.take().expect("stderr was set to piped above");
        tokio::spawn(read_lines(stdout, Arc::clone(&output), pid, echo));
        tokio::spawn(read_lines(stderr, Arc::clone(&output), pid, echo));
        Ok(Spawned {
            pid,
            program,
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
        let waiting_for = format!("{key_value} from {} (pid {})", self.program, self.pid);
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

    /// Sends `sig` to the child. Fails if it has already exited (its pid may
    /// belong to someone else by now).
    pub fn signal(&self, sig: Signal) -> Result<(), Error> {
        let mut child = lock(&self.child);
        let doing = || format!("sending {sig} to {} (pid {})", self.program, self.pid);
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
        // Pids fit in pid_t.
        kill(Pid::from_raw(self.pid as i32), sig).map_err(Error::sys(doing()))
    }

    /// Sends SIGKILL now to the child and to the processes it started
    /// (nothing if it already exited); [`wait`](Self::wait) reaps it.
    ///
    /// The descendants matter for wrappers like `sh -c '…; sleep 30'`: a
    /// surviving `sleep` would hold the output pipes open.
    pub fn kill(&mut self) -> Result<(), Error> {
        let doing = format!("killing {} (pid {})", self.program, self.pid);
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        match child.try_wait() {
            Ok(Some(_)) => Ok(()),
            Ok(None) => kill_tree(child, self.pid).map_err(Error::io(doing)),
            Err(e) => Err(Error::Io { doing, source: e }),
        }
    }

    /// Waits for the child to exit, then for its output to be read to the
    /// end (so [`lines`](Self::lines) is complete). On timeout the child is
    /// killed and an error returned.
    pub async fn wait(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        let doing = format!("waiting for {} (pid {}) to exit", self.program, self.pid);
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        let status = match tokio::time::timeout(timeout, child.wait()).await {
            Ok(status) => status.map_err(Error::io(doing))?,
            Err(_) => {
                let _ = kill_tree(child, self.pid);
                let _ = tokio::time::timeout(DRAIN_TIMEOUT, child.wait()).await;
                return Err(Error::Timeout {
                    waiting_for: format!("{} (pid {}) to exit", self.program, self.pid),
                    timeout,
                    detail: format!("killed it; its last lines:\n{}", self.tail(TAIL_LINES)),
                });
            }
        };
        let mut open_streams = self.output.open_streams.subscribe();
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, open_streams.wait_for(|&open| open == 0)).await;
        Ok(status)
    }

    fn line_wanted(&self, needle: &str) -> String {
        format!(
            "a line containing {needle:?} from {} (pid {})",
            self.program, self.pid
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
        // kill_on_drop would get the child only, not what it started.
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Ok(None) = child.try_wait() {
            let _ = kill_tree(child, self.pid);
        }
    }
}

/// SIGKILLs a child we have not reaped and everything below it. The tree is
/// listed first: once the child dies its children are reparented.
fn kill_tree(child: &mut Child, pid: u32) -> std::io::Result<()> {
    let mut descendants = Vec::new();
    // Pids fit in pid_t.
    let mut frontier = vec![Pid::from_raw(pid as i32)];
    while let Some(parent) = frontier.pop() {
        for grandchild in support::children_of(parent) {
            descendants.push(grandchild);
            frontier.push(grandchild);
        }
    }
    child.start_kill()?;
    for pid in descendants {
        let _ = kill(pid, Signal::SIGKILL);
    }
    Ok(())
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
