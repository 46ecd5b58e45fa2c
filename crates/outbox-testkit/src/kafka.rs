//! A throwaway Kafka-protocol broker: one [tansu] child process on a free
//! port, storing in a SQLite file in its own temporary directory, which
//! survives a restart (so do topics and records).
//!
//! tansu is a single-binary Apache-Kafka-compatible broker written in Rust;
//! the real Apache Kafka needs a JVM and jars from Maven Central, which this
//! project's machines cannot reach. tansu is installed with cargo (see
//! [`INSTALL`]). Readiness is a Kafka `Metadata` request answered with our
//! cluster id and port, so no Kafka client is needed here.
//!
//! [tansu]: https://crates.io/crates/tansu

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::spawned::Setup;
use crate::support::{self, Boot};
use crate::{Error, Spawned};

/// The command that installs the broker where [`Kafka::start`] looks first
/// after `OUTBOX_TANSU` and `PATH` (the `sqlite` storage engine comes with
/// the `libsql` feature).
pub const INSTALL: &str = "cargo install --locked --root ~/.cache/outbox-tools tansu@0.6.0 --features libsql";

/// How long a start or restart may take.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long SIGTERM may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the port may keep accepting after the broker was reaped.
const PORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How many fresh ports `start` tries when the chosen one gets taken.
const PORT_ATTEMPTS: usize = 5;
/// Lines of broker log quoted in errors.
const LOG_LINES: usize = 30;

/// One throwaway tansu broker on 127.0.0.1, owned by this value.
///
/// Its SQLite store and log are in a temporary directory removed on drop;
/// a restart keeps them, so topics and records survive it. Dropping it
/// SIGKILLs the broker.
#[derive(Debug)]
pub struct Kafka {
    exe: PathBuf,
    port: u16,
    log: PathBuf,
    server: Option<Spawned>,
    // Declared last: fields drop in order, so the directory goes after the
    // broker was killed.
    dir: TempDir,
}

impl Kafka {
    /// Starts a broker on a free port and returns once it answers a Kafka
    /// `Metadata` request (up to 30 s). If the port picked is taken before
    /// the broker binds it, a new one is tried.
    ///
    /// The broker is `$OUTBOX_TANSU`, else `tansu` on `PATH`, else
    /// `~/.cache/outbox-tools/bin/tansu` (where [`INSTALL`] puts it).
    pub async fn start() -> Result<Kafka, Error> {
        let exe = find_exe().ok_or(Error::KafkaNotInstalled { install: INSTALL })?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-kafka-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for tansu in {}",
                base.display()
            )))?;
        let mut kafka = Kafka {
            exe,
            port: 0,
            log: dir.path().join("tansu.log"),
            server: None,
            dir,
        };
        support::start_on_free_port(&mut kafka, PORT_ATTEMPTS).await?;
        Ok(kafka)
    }

    /// The TCP port the broker listens on (127.0.0.1); it stays the same
    /// across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`, for a Kafka client's `bootstrap.servers`.
    pub fn bootstrap_servers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `kafka://127.0.0.1:<port>`, the relay's sink URL.
    pub fn url(&self) -> String {
        format!("kafka://127.0.0.1:{}", self.port)
    }

    /// Creates `topic` with `partitions` partitions, with tansu's own
    /// `topic create` (librdkafka's admin client waits in vain for a
    /// controller that tansu 0.6 does not report).
    pub async fn create_topic(&self, topic: &str, partitions: u32) -> Result<(), Error> {
        let doing = format!(
            "creating topic {topic:?} on tansu at {}",
            self.bootstrap_servers()
        );
        let out = tokio::time::timeout(
            READY_TIMEOUT,
            tokio::process::Command::new(&self.exe)
                .args(["topic", "create", "--broker"])
                .arg(format!("tcp://127.0.0.1:{}", self.port))
                .arg("--partitions")
                .arg(partitions.to_string())
                .arg(topic)
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .map_err(|_| Error::Timeout {
            waiting_for: doing.clone(),
            timeout: READY_TIMEOUT,
            detail: "`tansu topic create` did not finish".into(),
        })?
        .map_err(Error::io(doing.clone()))?;
        if !out.status.success() {
            return Err(Error::Failed {
                doing,
                detail: format!(
                    "`tansu topic create` exited with {}: {}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        Ok(())
    }

    /// Stops the broker (SIGTERM, SIGKILL after 10 s), reaps it and waits
    /// until its port refuses connections. Stopping a stopped broker does
    /// nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        support::stop_server(self, STOP_TIMEOUT, PORT_TIMEOUT).await
    }

    /// Starts the broker again on the same port and store (a running one is
    /// stopped first) and waits until it is ready. Topics and records survive.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        support::restart_server(self).await
    }

    /// A cluster id unique to this value, so the probe can tell our broker
    /// from another test's that won a race for the port.
    fn cluster_id(&self) -> String {
        let dir = self.dir.path().file_name().unwrap_or_default();
        format!("{}-{}", dir.to_string_lossy(), self.port)
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.arg("broker")
            .arg("--cluster-id")
            .arg(self.cluster_id())
            .arg("--listener-url")
            .arg(&listener)
            .arg("--advertised-listener-url")
            .arg(&listener)
            // Relative to the working directory: the temporary directory.
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(self.dir.path())
            // tansu reads its settings from the environment too; keep a
            // developer's from leaking in.
            .env_remove("CLUSTER_ID")
            .env_remove("LISTENER_URL")
            .env_remove("ADVERTISED_LISTENER_URL")
            .env_remove("STORAGE_ENGINE");
        let name = format!("{} on port {}", self.exe.display(), self.port);
        Spawned::start(cmd, Setup::server(name, &self.log))
    }
}

impl support::ChildServer for Kafka {
    const NAME: &'static str = "tansu";
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
            name: "tansu",
            port: self.port,
            log: &self.log,
            port_taken: "Address already in use",
            ready_means: "answer a Kafka Metadata request",
            timeout: READY_TIMEOUT,
            deadline,
            log_lines: LOG_LINES,
            log_offset,
        };
        let (port, cluster) = (self.port, self.cluster_id());
        support::boot(&mut self.server, child, |_| probe(port, &cluster), spec).await
    }
}

fn find_exe() -> Option<PathBuf> {
    if let Some(exe) = std::env::var_os("OUTBOX_TANSU") {
        let exe = PathBuf::from(exe);
        return support::is_executable(&exe).then_some(exe);
    }
    support::find_on_path("tansu").or_else(|| {
        let cached = PathBuf::from(std::env::var_os("HOME")?).join(".cache/outbox-tools/bin/tansu");
        support::is_executable(&cached).then_some(cached)
    })
}

/// Whether the broker of cluster `cluster` answers on `port`: a Kafka
/// `Metadata` v2 request for no topics, whose response names the cluster
/// and advertises this port.
async fn probe(port: u16, cluster: &str) -> std::io::Result<bool> {
    const CORRELATION_ID: i32 = 0x6f75_7462; // "outb"
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let client_id = b"outbox-testkit";
    let mut request = Vec::new();
    request.extend_from_slice(&3i16.to_be_bytes()); // api key: Metadata
    request.extend_from_slice(&2i16.to_be_bytes()); // api version
    request.extend_from_slice(&CORRELATION_ID.to_be_bytes());
    request.extend_from_slice(&(client_id.len() as i16).to_be_bytes());
    request.extend_from_slice(client_id);
    request.extend_from_slice(&0i32.to_be_bytes()); // topics: none
    let len = i32::try_from(request.len()).unwrap_or(i32::MAX);
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(&request).await?;

    let len = stream.read_i32().await?;
    let Ok(len) = usize::try_from(len) else {
        return Ok(false);
    };
    if len > 1 << 20 {
        return Ok(false);
    }
    let mut body = vec![0; len];
    stream.read_exact(&mut body).await?;
    Ok(parse_metadata_v2(&body).is_some_and(|(correlation, ports, id)| {
        correlation == CORRELATION_ID && ports.contains(&i32::from(port)) && id.as_deref() == Some(cluster)
    }))
}

/// (correlation id, broker ports, cluster id) of a `Metadata` v2 response.
fn parse_metadata_v2(body: &[u8]) -> Option<(i32, Vec<i32>, Option<String>)> {
    let mut r = Reader(body);
    let correlation = r.i32()?;
    let brokers = r.i32()?;
    let mut ports = Vec::new();
    for _ in 0..brokers {
        r.i32()?; // node id
        r.string()?; // host
        ports.push(r.i32()?);
        r.string()?; // rack
    }
    let cluster = r.string()?;
    Some((correlation, ports, cluster))
}

/// Big-endian reads off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    /// A nullable string: length -1 is null.
    fn string(&mut self) -> Option<Option<String>> {
        let len = self.i16()?;
        let Ok(len) = usize::try_from(len) else {
            return Some(None);
        };
        Some(Some(String::from_utf8_lossy(self.take(len)?).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_metadata_v2_response() {
        let mut body = Vec::new();
        body.extend_from_slice(&7i32.to_be_bytes());
        body.extend_from_slice(&1i32.to_be_bytes());
        body.extend_from_slice(&111i32.to_be_bytes());
        body.extend_from_slice(&9i16.to_be_bytes());
        body.extend_from_slice(b"127.0.0.1");
        body.extend_from_slice(&9092i32.to_be_bytes());
        body.extend_from_slice(&(-1i16).to_be_bytes());
        body.extend_from_slice(&3i16.to_be_bytes());
        body.extend_from_slice(b"abc");
        assert_eq!(
            parse_metadata_v2(&body),
            Some((7, vec![9092], Some("abc".to_owned())))
        );
        assert_eq!(parse_metadata_v2(&body[..10]), None);
    }
}
