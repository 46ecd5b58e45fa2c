//! The crate's one error type: what was being done, and why it failed.

use std::time::Duration;

/// Everything that can go wrong while starting, stopping or watching a
/// throwaway service.
///
/// Messages say what was being done; the underlying cause, when there is
/// one, is kept as the error's [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No PostgreSQL server binaries (`initdb`, `postgres`) were found.
    #[error(
        "no PostgreSQL server binaries found (looked in {looked}); install them with \
         `apt-get install postgresql`, or set OUTBOX_PG_BIN to the directory holding initdb and postgres"
    )]
    PostgresNotInstalled {
        /// Where we looked, in order.
        looked: String,
    },
    /// `redis-server` is not on `PATH`.
    #[error("redis-server not found on PATH; install it with `apt-get install redis-server`")]
    RedisNotInstalled,
    /// `nats-server` is neither on `PATH` nor in `/usr/sbin`.
    #[error("nats-server not found on PATH or in /usr/sbin; install it with `apt-get install nats-server`")]
    NatsNotInstalled,
    /// The Kafka-protocol broker (tansu) is not installed.
    #[error(
        "tansu (the Kafka-protocol broker the Kafka tests use) not found in OUTBOX_TANSU, on PATH \
         or in ~/.cache/outbox-tools/bin; install it with `{install}` (or run scripts/test.sh, which does)"
    )]
    KafkaNotInstalled {
        /// The command that installs it.
        install: &'static str,
    },
    /// moto (the AWS emulator the SQS and SNS tests use) is not installed.
    #[error(
        "moto_server (the AWS emulator the SQS and SNS tests use) not found in OUTBOX_MOTO_SERVER, \
         on PATH or in ~/.cache/outbox-tools/moto/bin; install it with `{install}` (or run \
         scripts/test.sh, which does)"
    )]
    MotoNotInstalled {
        /// The commands that install it.
        install: &'static str,
    },
    /// `pgbouncer` is neither on `PATH` nor in `/usr/sbin`.
    #[error("pgbouncer not found on PATH or in /usr/sbin; install it with `apt-get install pgbouncer`")]
    PgBouncerNotInstalled,
    /// `rabbitmq-server` is not installed.
    #[error("rabbitmq-server not found; install it with `apt-get install rabbitmq-server`")]
    RabbitMqNotInstalled,
    /// An I/O operation (a file, a socket, spawning a process) failed.
    #[error("{doing}")]
    Io {
        /// What was being done.
        doing: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A system call made through `nix` (a signal, a user lookup) failed.
    #[error("{doing}")]
    Sys {
        /// What was being done.
        doing: String,
        /// The operating system's error.
        #[source]
        source: nix::Error,
    },
    /// A statement or connection to a throwaway PostgreSQL failed.
    #[error("{doing}")]
    Postgres {
        /// What was being done.
        doing: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A program we ran failed, or a server exited while it should not have.
    #[error("{doing}: {detail}")]
    Failed {
        /// What was being done.
        doing: String,
        /// What happened, with the program's output or log tail.
        detail: String,
    },
    /// Something did not happen within its deadline.
    #[error("timed out after {timeout:?} {waiting_for}; {detail}")]
    Timeout {
        /// What we were waiting for.
        waiting_for: String,
        /// How long we waited.
        timeout: Duration,
        /// What was seen instead (counts, the last log lines).
        detail: String,
    },
}

impl Error {
    pub(crate) fn io(doing: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let doing = doing.into();
        move |source| Error::Io { doing, source }
    }

    pub(crate) fn sys(doing: impl Into<String>) -> impl FnOnce(nix::Error) -> Error {
        let doing = doing.into();
        move |source| Error::Sys { doing, source }
    }

    pub(crate) fn pg(doing: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
        let doing = doing.into();
        move |source| Error::Postgres { doing, source }
    }
}
