//! A throwaway AWS emulator: one [moto] server child process on a free
//! port, for the SQS and SNS tests.
//!
//! moto keeps everything in memory, so a stopped server would come back
//! empty, which is not a broker restart. The server therefore runs with
//! moto's request recorder on, appending every request to a file in its
//! own temporary directory, and starts through a small launcher (see
//! [`LAUNCHER`]) that replays that file in-process before it listens: a
//! restarted server holds the queues, topics, subscriptions and messages
//! it had, and no client request can land before the replay (which would
//! put new messages ahead of old ones).
//!
//! moto is a Python package, installed into a virtual environment (see
//! [`INSTALL`]; `scripts/deps.sh` does it). The testkit finds its
//! `moto_server` script and runs the launcher with the Python interpreter
//! the script names.
//!
//! [moto]: https://pypi.org/project/moto/

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::spawned::Setup;
use crate::support::{self, Boot};
use crate::{Error, Spawned};

/// The commands that install moto where [`Moto::start`] looks after
/// `OUTBOX_MOTO_SERVER` and `PATH`.
pub const INSTALL: &str = "python3 -m venv ~/.cache/outbox-tools/moto && \
     ~/.cache/outbox-tools/moto/bin/pip install 'moto[server]==5.2.5' 'amazon-sqs-extended-client==1.0.1'";

/// The Python the server runs: patches three hot spots of moto's SQS and
/// its recorder's interleaved lines (see the comments in it); replays the
/// recording made by the previous run on this port (if any) into moto's
/// in-memory backends, through the WSGI app itself rather than the
/// network, with the recorder paused so the replay is not recorded twice;
/// then serves as `moto_server` does.
pub const LAUNCHER: &str = r#"
import base64, json, os, sys, threading, time
from werkzeug.test import Client
from moto.moto_api import recorder
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import main
from moto.sqs import models as sqs

# moto 5.2's SQS is quadratic: each message sent computes every queue
# attribute (three scans of the queue) to read one, each scan asks the time
# through datetime per message, and each delete scans the queue twice.
# Thousands of messages then take minutes. These are patched here, without
# changing what moto answers.
_unix_time_millis = sqs.unix_time_millis
sqs.unix_time_millis = lambda dt=None: time.time() * 1000.0 if dt is None else _unix_time_millis(dt)
_sending = threading.local()
_attributes = sqs.Queue.attributes.fget
def _queue_attributes(self):
    if getattr(_sending, "on", False):
        # All that sending reads: ContentBasedDeduplication, of a FIFO queue.
        if not self.fifo_queue:
            return {}
        value = self.content_based_deduplication
        return {"ContentBasedDeduplication": str(value).lower() if isinstance(value, bool) else value}
    return _attributes(self)
sqs.Queue.attributes = property(_queue_attributes)
def _while_sending(f):
    def wrapper(*args, **kwargs):
        before = getattr(_sending, "on", False)
        _sending.on = True
        try:
            return f(*args, **kwargs)
        finally:
            _sending.on = before
    return wrapper
sqs.SQSBackend.send_message = _while_sending(sqs.SQSBackend.send_message)
sqs.SQSBackend._validate_message = _while_sending(sqs.SQSBackend._validate_message)
# Deleting a message scanned the queue twice and rebuilt it; readers delete
# from the front, where one scan finds the message at once.
def _delete_message(self, receipt_handle):
    if receipt_handle in self.deleted_messages:
        return
    for i, message in enumerate(self._messages):
        if message.had_receipt_handle(receipt_handle):
            del self._messages[i]
            self.pending_messages.discard(message)
            self.deleted_messages.update(message.all_receipt_handles)
            return
    raise sqs.ReceiptHandleIsInvalid()
sqs.Queue.delete_message = _delete_message
# Receiving computed every attribute (three scans) per message received, to
# read the retention period.
def _retained(self, queue_name, message):
    period = int(self.get_queue(queue_name).message_retention_period)
    return period + message.sent_timestamp / 1000 > time.time()
sqs.SQSBackend.is_message_valid_based_on_retention_period = _retained

# The recorder writes an entry in two writes, from the thread serving the
# request: concurrent requests interleaved their lines.
_record_lock = threading.Lock()
_record_request = type(recorder)._record_request
def _record_request_locked(self, *args, **kwargs):
    with _record_lock:
        return _record_request(self, *args, **kwargs)
type(recorder)._record_request = _record_request_locked

path = os.environ["MOTO_RECORDER_FILEPATH"]
if os.path.exists(path):
    recorder._user_enabled = False
    client = Client(DomainDispatcherApplication(create_backend_app))
    with open(path) as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines):
        if not line:
            continue
        try:
            e = json.loads(line)
        except ValueError:
            # Only the last entry can be cut short, by a server stopped while
            # it was being written; it was never answered.
            if n >= len(lines) - 2:
                break
            raise
        body = e.get("body") or ""
        if e.get("body_encoded"):
            body = base64.b64decode(body)
        skip = ("content-length", "transfer-encoding")
        headers = {k: v for k, v in e["headers"].items() if k.lower() not in skip}
        client.open(e["url"], method=e["method"], headers=headers, data=body)
    recorder._user_enabled = True
print("outbox-testkit: replayed, serving", flush=True)
sys.exit(main(sys.argv[1:]))
"#;

/// How long a start or restart may take (Python imports all of moto).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long SIGTERM may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the port may keep accepting after the server was reaped.
const PORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How many fresh ports `start` tries when the chosen one gets taken.
const PORT_ATTEMPTS: usize = 5;
/// Lines of server log quoted in errors.
const LOG_LINES: usize = 30;

/// The region every test resource lives in.
pub const REGION: &str = "us-east-1";
/// The account moto puts every resource in.
pub const ACCOUNT: &str = "123456789012";
/// Credentials moto accepts (any are; these are its documented ones).
pub const ACCESS_KEY_ID: &str = "testing";
/// See [`ACCESS_KEY_ID`].
pub const SECRET_ACCESS_KEY: &str = "testing";

/// One throwaway moto server on 127.0.0.1, owned by this value. Dropping
/// it SIGKILLs the server and removes its directory.
#[derive(Debug)]
pub struct Moto {
    python: PathBuf,
    port: u16,
    log: PathBuf,
    recording: PathBuf,
    server: Option<Spawned>,
    // Declared last: the directory goes after the server was killed.
    dir: TempDir,
}

impl Moto {
    /// Starts a server on a free port and returns once it answers HTTP
    /// (up to 60 s).
    ///
    /// moto is `$OUTBOX_MOTO_SERVER`, else `moto_server` on `PATH`, else
    /// `~/.cache/outbox-tools/moto/bin/moto_server` (where [`INSTALL`] puts
    /// it); a missing one is [`Error::MotoNotInstalled`].
    pub async fn start() -> Result<Moto, Error> {
        let python = find_python()?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-moto-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for moto in {}",
                base.display()
            )))?;
        let mut moto = Moto {
            python,
            port: 0,
            log: dir.path().join("moto.log"),
            recording: dir.path().join("recording.jsonl"),
            server: None,
            dir,
        };
        support::start_on_free_port(&mut moto, PORT_ATTEMPTS).await?;
        Ok(moto)
    }

    /// The TCP port (127.0.0.1); the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The Python interpreter moto runs with, which also has AWS's Python
    /// SQS extended client (see [`INSTALL`]).
    pub fn python(&self) -> &Path {
        &self.python
    }

    /// `http://127.0.0.1:<port>`: the endpoint URL for AWS clients.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Environment for a process that talks to this server with the
    /// default AWS chains: its credentials and region, and nothing read
    /// from the machine (no profile files, no instance metadata).
    pub fn client_env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY),
            ("AWS_REGION", REGION),
            // Python's botocore reads only this one.
            ("AWS_DEFAULT_REGION", REGION),
            ("AWS_EC2_METADATA_DISABLED", "true"),
            ("AWS_CONFIG_FILE", "/dev/null"),
            ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
    }

    /// Stops the server (SIGTERM, SIGKILL after 10 s), reaps it and waits
    /// until its port refuses connections. Stopping a stopped one does
    /// nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        support::stop_server(self, STOP_TIMEOUT, PORT_TIMEOUT).await
    }

    /// Starts the server again on the same port (stopping a running one
    /// first), with everything it held, and waits until it is ready.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        support::restart_server(self).await
    }

    /// The file every request is recorded in.
    pub fn recording(&self) -> &Path {
        &self.recording
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let mut cmd = tokio::process::Command::new(&self.python);
        cmd.arg("-c")
            .arg(LAUNCHER)
            .args(["-H", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .current_dir(self.dir.path())
            .env("MOTO_ENABLE_RECORDING", "true")
            .env("MOTO_RECORDER_FILEPATH", &self.recording)
            // A developer's settings must not change the server.
            .env_remove("MOTO_PORT")
            .env_remove("PYTHONPATH");
        let name = format!("moto_server on port {}", self.port);
        Spawned::start(cmd, Setup::server(name, &self.log))
    }
}

impl support::ChildServer for Moto {
    const NAME: &'static str = "moto_server";
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
            name: "moto_server",
            port: self.port,
            log: &self.log,
            port_taken: "Address already in use",
            ready_means: "answer HTTP",
            timeout: READY_TIMEOUT,
            deadline,
            log_lines: LOG_LINES,
            log_offset,
        };
        let port = self.port;
        support::boot(&mut self.server, child, |_| probe(port), spec).await
    }
}

/// The Python of `$OUTBOX_MOTO_SERVER`, else of the first `moto_server`
/// written by pip: on `PATH` (a wrapper there, such as a pyenv shim, names
/// no interpreter and is passed over), else the cached venv's.
fn find_python() -> Result<PathBuf, Error> {
    if let Some(exe) = std::env::var_os("OUTBOX_MOTO_SERVER") {
        let exe = PathBuf::from(exe);
        if !support::is_executable(&exe) {
            return Err(Error::MotoNotInstalled { install: INSTALL });
        }
        return interpreter(&exe);
    }
    let cached = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/outbox-tools/moto/bin/moto_server"));
    let candidates: Vec<PathBuf> = support::find_on_path("moto_server")
        .into_iter()
        .chain(cached.filter(|c| support::is_executable(c)))
        .collect();
    let mut last = Err(Error::MotoNotInstalled { install: INSTALL });
    for script in candidates {
        last = interpreter(&script);
        if last.is_ok() {
            break;
        }
    }
    last
}

/// The Python interpreter a `moto_server` script runs with: its `#!` line
/// (pip writes the virtual environment's interpreter there).
fn interpreter(script: &Path) -> Result<PathBuf, Error> {
    let text = std::fs::read_to_string(script).map_err(Error::io(format!("reading {}", script.display())))?;
    let python = text
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("#!"))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.contains(' '))
        .map(PathBuf::from)
        .filter(|p| support::is_executable(p));
    python.ok_or_else(|| Error::Failed {
        doing: format!("finding the Python interpreter of {}", script.display()),
        detail: format!(
            "its first line names no executable interpreter; reinstall moto with `{INSTALL}`, \
             or set OUTBOX_MOTO_SERVER to a moto_server installed by pip"
        ),
    })
}

/// Whether a moto server answers on `port`: its own API's `GET
/// /moto-api/data.json` answered 200.
async fn probe(port: u16) -> std::io::Result<bool> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let request = format!("GET /moto-api/data.json HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await?;
    Ok(head.starts_with(b"HTTP/1.") && &head[9..12] == b"200")
}
