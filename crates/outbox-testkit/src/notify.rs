//! The receiving end of the systemd notify protocol: a datagram socket a
//! child is told about through `NOTIFY_SOCKET`, so tests wait for what the
//! code signals on purpose (`READY=1`, `OUTBOX_FAILPOINT=… reached`; see
//! `outbox::notify`) instead of for log text.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixDatagram;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::Error;
use crate::support::lock;

/// Largest datagram kept; the outbox's are a few dozen bytes.
const MAX_DATAGRAM: usize = 4096;

/// A bound `UnixDatagram` in a temporary directory, and every datagram it
/// received. Must be created inside a tokio runtime.
///
/// A task reads the socket as datagrams come, so a sender (which drops
/// datagrams rather than block on a full queue) never finds it full.
#[derive(Debug)]
pub struct Notifications {
    inner: Arc<Inner>,
    reader: JoinHandle<()>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

#[derive(Debug)]
struct Inner {
    socket: UnixDatagram,
    /// Kept so a signal that came before the wait still counts.
    received: Mutex<Vec<String>>,
    /// "Modified" after each read, to wake waiters.
    arrived: watch::Sender<()>,
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
        let inner = Arc::new(Inner {
            socket,
            received: Mutex::new(Vec::new()),
            arrived: watch::Sender::new(()),
        });
        let reader = tokio::spawn(read(Arc::clone(&inner)));
        Ok(Notifications {
            inner,
            reader,
            path,
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
        self.inner
            .drain()
            .iter()
            .any(|d| d.lines().any(|l| l == key_value))
    }

    /// Every datagram so far, oldest first.
    pub fn received(&self) -> Vec<String> {
        self.inner.drain().clone()
    }

    /// Waits for a datagram, already received or future, with the line
    /// `key_value`.
    pub async fn wait_for(&self, key_value: &str, timeout: Duration) -> Result<(), Error> {
        let mut arrived = self.inner.arrived.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Marked seen before looking, so a datagram read after the
            // look wakes us below.
            arrived.borrow_and_update();
            if self.has(key_value) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, arrived.changed()).await {
                Ok(Ok(())) => {}
                // The sender lives in `self.inner`; treat it like the deadline.
                Ok(Err(_)) | Err(_) => {
                    return Err(Error::Timeout {
                        waiting_for: format!("{key_value} on NOTIFY_SOCKET"),
                        timeout,
                        detail: format!("received: {:?}", self.received()),
                    });
                }
            }
        }
    }
}

impl Drop for Notifications {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Inner {
    /// Moves every queued datagram into `received`, and returns it. Reading
    /// under the lock keeps them in arrival order.
    fn drain(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        let mut received = lock(&self.received);
        let mut buf = [0; MAX_DATAGRAM];
        let mut any = false;
        while let Ok(n) = self.socket.try_recv(&mut buf) {
            received.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            any = true;
        }
        if any {
            self.arrived.send_modify(|()| {});
        }
        received
    }
}

/// Reads datagrams as they come, until aborted or the socket fails.
async fn read(inner: Arc<Inner>) {
    while inner.socket.readable().await.is_ok() {
        drop(inner.drain());
    }
}
