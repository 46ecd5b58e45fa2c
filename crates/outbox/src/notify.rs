//! The systemd notify protocol (`sd_notify(3)`), in a few lines of std.
//!
//! When `NOTIFY_SOCKET` is set (systemd does it for `Type=notify` units),
//! [`send`] writes one datagram of newline-separated `KEY=VALUE` lines to
//! that socket; a leading `@` names a Linux abstract socket. The relay and
//! `outbox consume` send `READY=1`, `STATUS=…` and `STOPPING=1`; tests wait
//! for these and for keys systemd ignores: `OUTBOX_FAILPOINT=<name> reached`
//! / `over`, `OUTBOX_BATCH=committed`, `OUTBOX_MESSAGE=rejected`,
//! `OUTBOX_CONNECT=retrying` (any command, `outbox_relay::pg`).
//!
//! The variable is read once, at the first send; unset, a send is one
//! check of an `Option`. Sending never fails the caller. Every state is
//! rare (the relay signals only its first batch), and a datagram socket
//! queues only a few datagrams (`net.unix.max_dgram_qlen`, 10 by default),
//! so a send waits up to [`PATIENCE`] for a listener to make room, then
//! drops the datagram. Drops and errors are logged at debug where this
//! crate has `tracing`.
//!
//! Portable by `cfg`, not by a feature: the protocol is std alone, so there
//! is nothing to switch off, only platforms without its sockets.
//!
//! | platform | `send` |
//! |---|---|
//! | Linux | path and abstract (`@name`) sockets |
//! | other unix | path sockets; an `@name` is dropped (systemd is Linux-only) |
//! | not unix (Windows) | does nothing: there is no `NOTIFY_SOCKET` to serve |
//!
//! `scripts/check-portable.sh` keeps every OS-specific path of this crate
//! under a `cfg` and checks it for Windows and FreeBSD.
//!
//! Not the `sd-notify` crate: it connects to `NOTIFY_SOCKET` as a path (an
//! `@name`, which the tests use, would not be found), sends blocking (a
//! listener that stops reading would stall the relay for good, where this
//! waits [`PATIENCE`]), and uses `std::os::unix` unconditionally.

use std::time::Duration;

/// Sends `state` (e.g. `"READY=1\nSTATUS=relay ready"`) to `NOTIFY_SOCKET`,
/// if it is set, waiting up to [`PATIENCE`] for room in a full queue. On a
/// platform without unix sockets it does nothing.
pub fn send(state: &str) {
    #[cfg(unix)]
    unix::send(state);
    #[cfg(not(unix))]
    let _ = state;
}

/// How long [`send`] waits for a listener that has not read its queue.
pub const PATIENCE: Duration = Duration::from_secs(1);

/// The sender over a unix datagram socket.
#[cfg(unix)]
mod unix {
    use std::ffi::OsStr;
    use std::io;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use super::PATIENCE;

    pub(super) fn send(state: &str) {
        static NOTIFIER: OnceLock<Option<Notifier>> = OnceLock::new();
        let Some(notifier) =
            NOTIFIER.get_or_init(|| Notifier::open(&std::env::var_os("NOTIFY_SOCKET")?).ok())
        else {
            return;
        };
        let until = Instant::now() + PATIENCE;
        let result = loop {
            match notifier.send(state) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                other => break other,
            }
        };
        if let Err(_error) = result {
            #[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
            tracing::debug!(error = %_error, state, "sd_notify dropped");
        }
    }

    /// An unbound datagram socket and where to send.
    pub(super) struct Notifier {
        socket: UnixDatagram,
        to: SocketAddr,
    }

    impl Notifier {
        pub(super) fn open(path: &OsStr) -> io::Result<Notifier> {
            let to = match path.as_bytes().strip_prefix(b"@") {
                Some(name) => abstract_address(name)?,
                None => SocketAddr::from_pathname(path)?,
            };
            let socket = UnixDatagram::unbound()?;
            // Nonblocking, so a listener that does not read stalls a send
            // for at most `PATIENCE`, not for good.
            socket.set_nonblocking(true)?;
            Ok(Notifier { socket, to })
        }

        pub(super) fn send(&self, state: &str) -> io::Result<()> {
            self.socket.send_to_addr(state.as_bytes(), &self.to).map(drop)
        }
    }

    /// `@name`: a socket in Linux's abstract namespace.
    #[cfg(target_os = "linux")]
    pub(super) fn abstract_address(name: &[u8]) -> io::Result<SocketAddr> {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name)
    }

    /// Abstract sockets exist only on Linux (and Android, which runs no
    /// systemd), so elsewhere an `@name` is an address that cannot be.
    #[cfg(not(target_os = "linux"))]
    pub(super) fn abstract_address(_name: &[u8]) -> io::Result<SocketAddr> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "NOTIFY_SOCKET names an abstract socket, which only Linux has",
        ))
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::ffi::OsStr;
    use std::io;
    use std::os::unix::net::UnixDatagram;

    use super::unix::Notifier;

    fn received(listener: &UnixDatagram) -> String {
        let mut buf = [0; 256];
        let n = listener.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn one_datagram_of_key_value_lines_to_a_path() {
        let dir = std::env::temp_dir().join(format!("outbox-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).unwrap();
        let notifier = Notifier::open(path.as_os_str()).unwrap();
        notifier.send("READY=1\nSTATUS=relay ready").unwrap();
        notifier.send("STOPPING=1").unwrap();
        assert_eq!(received(&listener), "READY=1\nSTATUS=relay ready");
        assert_eq!(received(&listener), "STOPPING=1");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A listener on an abstract name, and the `@name` that reaches it.
    #[cfg(target_os = "linux")]
    fn abstract_listener(name: &str) -> (UnixDatagram, String) {
        let name = format!("{name}-{}", std::process::id());
        let addr = super::unix::abstract_address(name.as_bytes()).unwrap();
        (UnixDatagram::bind_addr(&addr).unwrap(), format!("@{name}"))
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_leading_at_names_an_abstract_socket() {
        let (listener, at) = abstract_listener("outbox-notify-test");
        let notifier = Notifier::open(OsStr::new(&at)).unwrap();
        notifier.send("OUTBOX_BATCH=committed").unwrap();
        assert_eq!(received(&listener), "OUTBOX_BATCH=committed");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_listener_that_does_not_read_does_not_block_the_sender() {
        let (_listener, at) = abstract_listener("outbox-notify-full");
        let notifier = Notifier::open(OsStr::new(&at)).unwrap();
        let failed = (0..100_000)
            .map(|_| notifier.send("OUTBOX_BATCH=committed"))
            .find_map(Result::err)
            .expect("the queue fills");
        assert_eq!(failed.kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    #[cfg(not(target_os = "linux"))]
    fn an_abstract_name_off_linux_is_an_error_not_a_panic() {
        let error = Notifier::open(OsStr::new("@outbox-notify")).err().unwrap();
        assert_eq!(error.kind(), io::ErrorKind::Unsupported);
    }

    #[test]
    fn nowhere_to_send_is_an_error_not_a_panic() {
        let notifier = Notifier::open(OsStr::new("/nonexistent/outbox/notify.sock")).unwrap();
        assert!(notifier.send("READY=1").is_err());
    }
}
