//! A throwaway RabbitMQ node: its own node name, AMQP and distribution
//! ports, Mnesia directory and logs in a temporary directory, no plugins,
//! so stopping it disturbs no other test and no broker on the machine.
//!
//! The node is `rabbitmq-server` run in the foreground in a process group of
//! its own (the script and the Erlang VM it starts), signalled as a group.
//! Its Mnesia directory survives a restart, so durable exchanges, queues
//! and persistent messages do too. Booting takes seconds (Erlang), so tests
//! that only need a broker use the machine's, and this is for the ones that
//! stop it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio::net::TcpStream;

use crate::spawned::{Group, Setup};
use crate::support::{self, Boot};
use crate::{Error, Spawned};

/// How long a boot may take; a first boot creates the Mnesia schema.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a graceful stop may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the port may keep accepting after the node was reaped.
const PORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of log quoted in errors.
const LOG_LINES: usize = 30;
/// Where Debian puts the real script (`/usr/sbin/rabbitmq-server` is a
/// wrapper that switches to the `rabbitmq` user and the system node).
const DEBIAN_SCRIPT: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// One throwaway RabbitMQ node on 127.0.0.1, owned by this value; user
/// `guest`, password `guest`, vhost `/`. Dropping it SIGKILLs the node and
/// removes its directory.
#[derive(Debug)]
pub struct RabbitMq {
    exe: PathBuf,
    port: u16,
    dist_port: u16,
    log: PathBuf,
    server: Option<Spawned>,
    // Declared last: fields drop in order, so the directory goes after the
    // node was killed.
    dir: TempDir,
}

impl RabbitMq {
    /// Boots a node on free ports and returns once it accepts AMQP
    /// connections (up to 90 s).
    pub async fn start() -> Result<RabbitMq, Error> {
        Self::start_with(None).await
    }

    /// [`start`](Self::start) with `max_message_size` set: the node refuses
    /// a larger message by closing the channel (406 PRECONDITION_FAILED).
    pub async fn start_with_max_message_size(bytes: usize) -> Result<RabbitMq, Error> {
        Self::start_with(Some(bytes)).await
    }

    async fn start_with(max_message_size: Option<usize>) -> Result<RabbitMq, Error> {
        let exe = find_exe().ok_or(Error::RabbitMqNotInstalled)?;
        let base = support::base_dir();
        let dir = tempfile::Builder::new()
            .prefix("outbox-testkit-rabbitmq-")
            .tempdir_in(base)
            .map_err(Error::io(format!(
                "creating a temporary directory for rabbitmq-server in {}",
                base.display()
            )))?;
        // No plugins: the management plugin would want port 15672, which
        // the machine's broker may hold.
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").map_err(Error::io(
            "writing the enabled_plugins file of a throwaway rabbitmq node",
        ))?;
        if let Some(bytes) = max_message_size {
            // `RABBITMQ_CONFIG_FILE` is `<dir>/rabbitmq`; the node reads
            // `<dir>/rabbitmq.conf`.
            std::fs::write(
                dir.path().join("rabbitmq.conf"),
                format!("max_message_size = {bytes}\n"),
            )
            .map_err(Error::io(
                "writing the rabbitmq.conf of a throwaway rabbitmq node",
            ))?;
        }
        let mut node = RabbitMq {
            exe,
            port: support::try_free_port()?,
            dist_port: support::try_free_port()?,
            log: dir.path().join("rabbitmq.log"),
            server: None,
            dir,
        };
        node.boot().await?;
        Ok(node)
    }

    /// The AMQP port (127.0.0.1); it stays the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Stops the node gracefully (SIGTERM to its process group, SIGKILL
    /// after 30 s) and waits until its port refuses connections. Stopping a
    /// stopped node does nothing.
    pub async fn stop(&mut self) -> Result<(), Error> {
        let Some(mut server) = self.server.take() else {
            return Ok(());
        };
        server.stop(Signal::SIGTERM, STOP_TIMEOUT).await?;
        self.wait_port_closed().await
    }

    /// Boots the node again on the same ports and data (a running one is
    /// stopped first).
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        self.boot().await
    }

    async fn boot(&mut self) -> Result<(), Error> {
        let spec = support::BootSpec {
            name: "rabbitmq node",
            port: self.port,
            log: &self.log,
            port_taken: "eaddrinuse",
            ready_means: "listen",
            timeout: READY_TIMEOUT,
            deadline: Instant::now() + READY_TIMEOUT,
            log_lines: LOG_LINES,
            log_offset: support::file_len(&self.log),
        };
        let child = self.spawn()?;
        let port = self.port;
        // RabbitMQ opens its AMQP listener as the last boot step.
        let probe = |_| async move { TcpStream::connect(("127.0.0.1", port)).await.map(|_| true) };
        match support::boot(&mut self.server, child, probe, spec).await? {
            Boot::Ready => Ok(()),
            Boot::PortTaken(why) => Err(Error::Failed {
                doing: format!("starting a rabbitmq node on port {port}"),
                detail: why,
            }),
        }
    }

    fn spawn(&self) -> Result<Spawned, Error> {
        let dir = self.dir.path();
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.env(
            "RABBITMQ_NODENAME",
            format!("outbox-testkit-{}@localhost", self.port),
        )
        .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
        .env("RABBITMQ_NODE_PORT", self.port.to_string())
        .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
        .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", dir.join("log"))
        .env("RABBITMQ_PID_FILE", dir.join("rabbitmq.pid"))
        .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
        .env("RABBITMQ_PLUGINS_EXPAND_DIR", dir.join("plugins-expand"))
        // Files of its own (absent unless a test writes them): the
        // machine's configuration stays out.
        .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq"))
        .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
        .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
        // The Erlang cookie goes to $HOME; ours is private.
        .env("HOME", dir)
        .current_dir(dir);
        let name = format!("{} on port {}", self.exe.display(), self.port);
        // The script starts the Erlang VM as a child: a group of their own
        // is signalled as one.
        let setup = Setup {
            group: Group::Own,
            ..Setup::server(name, &self.log)
        };
        Spawned::start(cmd, setup)
    }

    async fn wait_port_closed(&self) -> Result<(), Error> {
        support::wait_port_closed(self.port, PORT_TIMEOUT, "the rabbitmq node").await
    }
}

fn find_exe() -> Option<PathBuf> {
    let debian = PathBuf::from(DEBIAN_SCRIPT);
    if support::is_executable(&debian) {
        return Some(debian);
    }
    support::find_on_path("rabbitmq-server")
}
