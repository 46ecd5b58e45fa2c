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

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use tempfile::TempDir;
use tokio::net::TcpStream;

use crate::Error;
use crate::support::{self, POLL};

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
    server: Option<Child>,
    // Declared last so the directory goes after `Drop` has killed the node.
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
        let what = format!("rabbitmq node on port {}", self.port);
        let vm = support::children_of(support::pid_of(&server));
        signal_group(&server, Signal::SIGTERM, &what)?;
        let exited = support::wait_exit(&mut server, STOP_TIMEOUT, &what).await?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        while exited.is_some() && !vm.iter().all(|&pid| support::is_dead(pid)) {
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(POLL).await;
        }
        if exited.is_none() || !vm.iter().all(|&pid| support::is_dead(pid)) {
            signal_group(&server, Signal::SIGKILL, &what)?;
            support::kill_and_reap(&mut server, &what)?;
        }
        self.wait_port_closed().await
    }

    /// Boots the node again on the same ports and data (a running one is
    /// stopped first).
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await?;
        self.boot().await
    }

    async fn boot(&mut self) -> Result<(), Error> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let offset = support::file_len(&self.log);
        self.server = Some(self.spawn()?);
        loop {
            let server = self.server.as_mut().ok_or_else(|| Error::Failed {
                doing: format!("starting a rabbitmq node on port {}", self.port),
                detail: "the node vanished while starting".into(),
            })?;
            let status = server.try_wait().map_err(Error::io(format!(
                "watching a rabbitmq node start on port {}",
                self.port
            )))?;
            if let Some(status) = status {
                self.server = None;
                return Err(Error::Failed {
                    doing: format!("starting a rabbitmq node on port {}", self.port),
                    detail: format!(
                        "it exited during startup ({status}); last lines of {}:\n{}",
                        self.log.display(),
                        support::last_lines(&support::log_since(&self.log, offset), LOG_LINES)
                    ),
                });
            }
            // RabbitMQ opens its AMQP listener as the last boot step.
            if TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                if let Some(mut server) = self.server.take() {
                    let _ = signal_group(&server, Signal::SIGKILL, "rabbitmq node");
                    support::kill_and_reap(&mut server, "rabbitmq node")?;
                }
                return Err(support::not_ready(
                    format!("a rabbitmq node to listen on 127.0.0.1:{}", self.port),
                    READY_TIMEOUT,
                    &self.log,
                    LOG_LINES,
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn spawn(&self) -> Result<Child, Error> {
        let (log, stderr) = support::log_handles(&self.log)?;
        let dir = self.dir.path();
        let mut cmd = std::process::Command::new(&self.exe);
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
        .current_dir(dir)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr);
        cmd.spawn().map_err(Error::io(format!(
            "spawning {} on port {}",
            self.exe.display(),
            self.port
        )))
    }

    async fn wait_port_closed(&self) -> Result<(), Error> {
        support::wait_port_closed(self.port, PORT_TIMEOUT, "the rabbitmq node").await
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = signal_group(&server, Signal::SIGKILL, "rabbitmq node");
            if let Err(e) = support::kill_and_reap(&mut server, "rabbitmq node") {
                tracing::warn!(error = %e, "killing a testkit rabbitmq node on drop");
            }
        }
    }
}

/// The script starts the Erlang VM as a child; both are in the group whose
/// id is the script's pid, which we have not reaped yet.
fn signal_group(child: &Child, signal: Signal, what: &str) -> Result<(), Error> {
    match killpg(support::pid_of(child), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => Err(Error::Sys {
            doing: format!("sending {signal} to {what} (process group {})", child.id()),
            source: e,
        }),
    }
}

fn find_exe() -> Option<PathBuf> {
    let debian = PathBuf::from(DEBIAN_SCRIPT);
    if support::is_executable(&debian) {
        return Some(debian);
    }
    support::find_on_path("rabbitmq-server")
}
