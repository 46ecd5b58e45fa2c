//! The receiving end of the systemd notify protocol: a datagram socket a
//! child is told about through `NOTIFY_SOCKET`, so tests wait for what the
//! code signals on purpose (`READY=1`, `OUTBOX_FAILPOINT=… reached`; see
//! `outbox::notify`) instead of for log text.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::net::UnixDatagram;

use crate::Error;
use crate::support::lock;

/// Largest datagram kept; the outbox's are a few dozen bytes.
const MAX_DATAGRAM: usize = 4096;

/// A bound `UnixDatagram` in a temporary directory, and every datagram it
/// received. Must be created inside a tokio runtime.
#[derive(Debug)]
pub struct Notifications {
    socket: UnixDatagram,
    path: PathBuf,
    /// Kept so a signal that came before the wait still counts.
    received: Mutex<Vec<String>>,
    _dir: tempfile::TempDir,
}

impl Notifications {
    /// Binds a fresh socket.
    pub fn bind() -> Result<Notifications, Error> {
        let dir = tempfile::Builder::new()
            .prefix("outbox-notify")
            .tempdir()
            .map_err(Error::io("creating a directory for NOTIFY_SOCKET"))?;
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).map_err(Error::io(format!("binding {}", path.display())))?;
        Ok(Notifications {
            socket,
            path,
            received: Mutex::new(Vec::new()),
            _dir: dir,
        })
    }

    /// What to put in the child's `NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a datagram received so far has the line `key_value` (e.g.
    /// `READY=1`). Reads what is queued first, without waiting.
    pub fn has(&self, key_value: &str) -> bool {
        self.drain();
        lock(&self.received)
            .iter()
            .any(|d| d.lines().any(|l| l == key_value))
    }

    /// Every datagram so far, oldest first.
    pub fn received(&self) -> Vec<String> {
        self.drain();
        lock(&self.received).clone()
    }

    /// Waits for a datagram, already received or future, with the line
    /// `key_value`.
    pub async fn wait_for(&self, key_value: &str, timeout: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.has(key_value) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, self.socket.readable()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Error::io(format!("reading {}", self.path.display()))(e)),
                Err(_) => {
                    return Err(Error::Timeout {
                        waiting_for: format!("{key_value} on NOTIFY_SOCKET"),
                        timeout,
                        detail: format!("received: {:?}", self.received()),
                    });
                }
            }
        }
    }

    /// Moves every queued datagram into `received`.
    fn drain(&self) {
        let mut buf = [0; MAX_DATAGRAM];
        while let Ok(n) = self.socket.try_recv(&mut buf) {
            let datagram = String::from_utf8_lossy(&buf[..n]).into_owned();
            lock(&self.received).push(datagram);
        }
    }
}
