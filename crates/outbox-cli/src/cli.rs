//! The command line: every flag, its environment variable and default.
//!
//! Durations take humantime syntax (`200ms`, `5m`, `1h 30m`). Each flag reads
//! the environment variable named beside it, so a relay can be configured
//! entirely from its environment; the relay's are keys of its `--config`
//! file too, under both (`crate::config`).

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_relay::{ClaimMode, OrderMode, Pooler, SourceKind, WalCleanup};

use crate::logging::LogFormat;

/// Transactional outbox for PostgreSQL: migrate the schema, run the relay,
/// inspect and requeue dead letters.
///
/// Exit codes: 0 success (including a drain after SIGINT/SIGTERM); 1 runtime
/// failure (e.g. PostgreSQL unreachable; `relay --drain` made a dead letter or
/// met an unavailable sink; a `dlq` selector matched nothing; a replay's sink
/// refused an event); 2 usage or
/// configuration error (bad flag, URL, identifier or duration; schema not
/// migrated or too new; a privilege the role lacks, see `migrate --grant`;
/// a transaction-mode pooler in front of a relay not run with --pooler
/// transaction).
#[derive(Debug, Parser)]
#[command(name = "outbox", version, max_term_width = 100)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: Global,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Options every command understands.
#[derive(Debug, Args)]
pub(crate) struct Global {
    /// PostgreSQL connection string (URL or key=value).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub(crate) database_url: Option<String>,
    /// Schema of the outbox table.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public", global = true)]
    pub(crate) schema: String,
    /// Name of the outbox table.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox", global = true)]
    pub(crate) table: String,
    /// NOTIFY channel of the insert trigger.
    #[arg(long, env = "OUTBOX_CHANNEL", default_value = "outbox_new", global = true)]
    pub(crate) channel: String,
    /// Failed attempts after which the relay makes a row a dead letter even
    /// within its --retry-for window (recorded in the row, `dead_at`: other
    /// commands need not agree on it); `none`: no count, the window
    /// decides. `migrate` marks rows with this many attempts as dead letters
    /// when it first records them in the row (schema version 4).
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value = "none",
          value_parser = max_attempts, global = true)]
    pub(crate) max_attempts: i32,
    /// How long to keep trying to reach PostgreSQL at startup.
    #[arg(long, env = "OUTBOX_CONNECT_TIMEOUT", default_value = "10s",
          value_parser = humantime::parse_duration, global = true)]
    pub(crate) connect_timeout: Duration,
    /// Log format.
    #[arg(
        long,
        env = "OUTBOX_LOG_FORMAT",
        value_enum,
        default_value = "human",
        global = true
    )]
    pub(crate) log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create or upgrade the outbox table (or, with --inbox, the consumer's
    /// processed_events table). Idempotent.
    Migrate(MigrateArgs),
    /// Deliver unpublished events to a sink until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Backlog, dead letters and oldest unpublished age, per aggregate type
    /// (of --outbox NAME's outbox); with --schemas or --all, one row per
    /// outbox of a fleet and who serves it.
    Stats(StatsArgs),
    /// The live relays, the partitions each holds, and per-partition backlog;
    /// with --schemas or --all, the fleet processes and the outboxes each
    /// serves.
    Relays(RelaysArgs),
    /// Delete published rows (or, with --inbox, processed-event records)
    /// older than --older-than, in short batches. Never touches unpublished
    /// rows or dead letters.
    Cleanup(CleanupArgs),
    /// Inspect and requeue dead letters.
    Dlq(DlqArgs),
    /// Re-deliver published events to a sink, with their original event_ids,
    /// in id order (so in order per aggregate), paced, resumable; live
    /// delivery is untouched. Exit codes: 0 done, or stopped by
    /// SIGINT/SIGTERM (resume it with --resume ID); 1 the sink refused an
    /// event or kept failing (the job is failed, resumable), or the job is
    /// running elsewhere; 2 a bad --to, filter or job id.
    Replay(ReplayArgs),
    /// Daily partitions of an outbox migrated with --partition-by day.
    #[command(subcommand)]
    Partitions(PartitionsCommand),
    /// Serve a web console until SIGINT/SIGTERM: backlog, throughput, dead
    /// letters (requeue, give up), relays, and any event's story. Without
    /// --admin-token it is read-only and listens on loopback only (else exit 2).
    Admin(AdminArgs),
    /// Apply events from a Redis stream, a NATS JetStream stream or a
    /// RabbitMQ queue to
    /// PostgreSQL exactly once: run --apply per event inside the inbox
    /// transaction, acknowledge after commit.
    Consume(ConsumeArgs),
    /// The relay's settings as flags, environment and --config combine.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Debug, Subcommand)]
pub(crate) enum ConfigCommand {
    /// Print every effective relay setting, and each sink table's, with
    /// where it came from (flag, env, file:line, default); secrets
    /// redacted. Takes the relay's flags: `outbox relay ARGS` and
    /// `outbox config show ARGS` see the same settings.
    Show(ShowArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) relay: RelayArgs,
}

#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    /// Migrate the consumer's processed_events table instead of the outbox.
    #[arg(long)]
    pub(crate) inbox: bool,
    /// Logical partitions relays share the outbox by; read only when the
    /// lease table is created (schema version 3).
    #[arg(long, default_value_t = outbox::DEFAULT_PARTITIONS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(outbox::MAX_PARTITIONS)))]
    pub(crate) partitions: u32,
    /// Create the outbox as daily RANGE (created_at) partitions, dropped
    /// whole by `outbox partitions maintain` (only when creating the table).
    #[arg(long, value_enum)]
    pub(crate) partition_by: Option<PartitionBy>,
    #[command(flatten)]
    pub(crate) inbox_table: InboxTableArgs,
    /// Also set up log tailing (`relay --source wal`): a publication of the
    /// outbox's inserts and a logical replication slot (pgoutput) named
    /// <schema>_<table>. Needs wal_level = logical and a role with
    /// REPLICATION.
    #[arg(long, conflicts_with = "inbox")]
    pub(crate) wal: bool,
    /// With --wal, after PostgreSQL invalidated the slot: drop it, create it
    /// again, and re-insert every undelivered row still in the table so the
    /// new slot delivers it (stop the relay first).
    #[arg(long, requires = "wal")]
    pub(crate) recover: bool,
    /// With --recover, re-send only rows created at or after this RFC 3339
    /// instant (useful with --wal-cleanup none, which keeps delivered rows).
    #[arg(long, requires = "recover")]
    pub(crate) since: Option<chrono::DateTime<chrono::Utc>>,
    /// Instead of migrating: grant ROLE what the kinds of --as need on this
    /// outbox (and, for consume and cleanup-inbox, the inbox of
    /// --inbox-table), in least privilege; idempotent. Run as the tables'
    /// owner (relay-wal: a superuser). See docs/privileges.md.
    #[arg(long, value_name = "ROLE", requires = "grant_as", conflicts_with_all = ["wal", "partition_by"])]
    pub(crate) grant: Option<String>,
    /// With --grant, what the role does, comma-separated: writer, relay,
    /// relay-wal, consume, stats, admin-read, admin, cleanup,
    /// cleanup-inbox, partitions, replay, migrate.
    #[arg(
        long = "as",
        id = "grant_as",
        value_name = "KIND",
        value_delimiter = ',',
        requires = "grant"
    )]
    pub(crate) grant_as: Vec<outbox::privileges::Role>,
    /// With --grant, print the statements and change nothing.
    #[arg(long, requires = "grant")]
    pub(crate) dry_run: bool,
    /// Migrate the outbox (--table) in every existing schema whose name
    /// matches this LIKE pattern (`tenant_%`), each in a transaction of its
    /// own: what `relay --schemas` serves. Idempotent. With --wal, per
    /// database one publication of every such outbox and one slot, as
    /// `relay --source wal --schemas` reads them (docs/fleet.md).
    #[arg(long, value_name = "PATTERN", conflicts_with_all = ["inbox", "recover", "grant"])]
    pub(crate) schemas: Option<String>,
    /// With --schemas: in every database of the server whose name matches
    /// this LIKE pattern, not only the URL's.
    #[arg(long, value_name = "PATTERN", requires = "schemas")]
    pub(crate) databases: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    /// Where events go: redis://host:port[/db], rediss://…, http://…, https://…,
    /// nats://host:port, amqp://user:pass@host:port/vhost, amqps://…,
    /// kafka://host:port[,host:port…]. Required, here or in --config.
    #[arg(help_heading = "Sink", long, env = "OUTBOX_SINK")]
    pub(crate) sink: Option<String>,
    /// TOML file of relay settings: any flag of this command (and --schema,
    /// --table, --channel, --max-attempts, --connect-timeout,
    /// --database-url) as a key of the same name with underscores
    /// (`batch_size = 50`), under flags and environment variables; and
    /// optionally sink tables routing aggregate types ([default],
    /// [routes.<aggregate_type>], whose own keys win for their route).
    /// `outbox config show` prints the result.
    #[arg(help_heading = "Sink", long, env = "OUTBOX_CONFIG")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Rows claimed and delivered per transaction.
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_BATCH_SIZE", default_value_t = outbox_relay::defaults::BATCH_SIZE,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) batch_size: u32,
    /// Poll interval [default: 5s as a fallback to NOTIFY, 1s with --no-notify].
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_POLL_INTERVAL", value_parser = positive_duration)]
    pub(crate) poll_interval: Option<Duration>,
    /// Do not LISTEN; poll only.
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_NO_NOTIFY")]
    pub(crate) no_notify: bool,
    /// Deliver everything that is due, then exit: 0 if all of it was
    /// delivered, 1 if anything became a dead letter or a sink was
    /// unavailable (for cron jobs and scripts).
    #[arg(help_heading = "Running", long)]
    pub(crate) drain: bool,
    /// Check the setup and exit, sending and claiming nothing: PostgreSQL
    /// (schema version, this role's privileges for the source, claim mode
    /// and retention; wal_level and the slot for --source wal) and every
    /// route's sink, one line each with ok or FAIL and the fix. Exit 0 all
    /// ok, 1 a service unreachable, 2 a configuration problem.
    #[arg(help_heading = "Running", long, conflicts_with = "drain")]
    pub(crate) check: bool,
    /// The largest payload (as JSON text) sent to a sink; a larger event is
    /// a dead letter at once and never reaches the sink. Lowered to the
    /// sink's own limit where the sink reports one (NATS max_payload).
    /// Bytes, or with a unit: 512KiB, 1MiB, 1MB.
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_MAX_EVENT_BYTES", default_value = "1MiB", value_parser = byte_size)]
    pub(crate) max_event_bytes: u64,
    /// The payload bytes one batch may hold: a claim takes rows in id order
    /// while their payloads fit, and always the first, so the relay's
    /// memory is bounded by this or by one event. Bytes, or with a unit.
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_BATCH_MAX_BYTES", default_value = "16MiB", value_parser = byte_size)]
    pub(crate) batch_max_bytes: u64,
    /// Where events come from: `poll` claims unpublished rows from the
    /// table; `wal` tails the write-ahead log through the slot `outbox
    /// migrate --wal` created (one reader at a time, the others standbys).
    #[arg(
        help_heading = "Log tailing (--source wal)",
        long,
        env = "OUTBOX_SOURCE",
        value_enum,
        default_value = "poll"
    )]
    pub(crate) source: SourceKind,
    /// With --source wal: events read and not yet delivered (or dead) at
    /// most; the slot's position stays behind them, so a crash re-sends at
    /// most this many (or one larger transaction).
    #[arg(help_heading = "Log tailing (--source wal)", long, env = "OUTBOX_WAL_WINDOW", default_value_t = outbox_relay::defaults::WAL_WINDOW,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) wal_window: u32,
    /// With --source wal: `delete` delivered rows by primary key, or leave
    /// them (`none`) for daily partition drops.
    #[arg(
        help_heading = "Log tailing (--source wal)",
        long,
        env = "OUTBOX_WAL_CLEANUP",
        value_enum,
        default_value = "delete"
    )]
    pub(crate) wal_cleanup: WalCleanup,
    /// With --source wal: warn when the slot holds back more WAL than this
    /// (bytes, or with a unit).
    #[arg(help_heading = "Log tailing (--source wal)", long, env = "OUTBOX_WAL_RETAINED_WARN", default_value = "1GiB", value_parser = byte_size)]
    pub(crate) wal_retained_warn: u64,
    /// How a batch is claimed: `lock` keeps it locked in a transaction open
    /// while the sink has it (one round trip per batch); `lease` writes a
    /// deadline on its rows in a short transaction and delivers with none
    /// open, so a slow sink holds back no VACUUM. A route's `claim` key in
    /// --config overrides it for that route.
    #[arg(
        help_heading = "Claiming",
        long,
        env = "OUTBOX_CLAIM",
        value_enum,
        default_value = "lock"
    )]
    pub(crate) claim: ClaimMode,
    /// With --claim deadline: how long a claim holds its rows. Rows of a relay
    /// that died are claimed again once it runs out; a delivery still
    /// running then is abandoned, so make it longer than the slowest batch.
    #[arg(help_heading = "Claiming", long, env = "OUTBOX_CLAIM_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub(crate) claim_timeout: Duration,
    /// What sits between the relay and PostgreSQL: `none` (a direct
    /// connection, or a session-mode pool) or `transaction` (a
    /// transaction-mode pool such as PgBouncer's pool_mode = transaction:
    /// no prepared statements, plans pinned per transaction, no LISTEN
    /// unless --listen-url, no --source wal).
    #[arg(
        help_heading = "Connection pooler",
        long,
        env = "OUTBOX_POOLER",
        value_enum,
        default_value = "none"
    )]
    pub(crate) pooler: Pooler,
    /// With --pooler transaction: a direct connection to PostgreSQL (not
    /// through the pooler) used only to LISTEN for new events, so the relay
    /// is woken at once instead of at the next poll [default: poll].
    #[arg(
        help_heading = "Connection pooler",
        long,
        env = "OUTBOX_LISTEN_URL",
        hide_env_values = true,
        conflicts_with = "no_notify"
    )]
    pub(crate) listen_url: Option<String>,
    /// Per-aggregate ordering: `partition` (one relay per partition of
    /// aggregates, id order while nothing fails), `strict` (never past an
    /// undelivered earlier event of the aggregate) or `none` (any relay, any
    /// order; no leases).
    #[arg(
        help_heading = "Ordering and several relays",
        long,
        env = "OUTBOX_ORDERING",
        value_enum,
        default_value = "partition"
    )]
    pub(crate) ordering: OrderMode,
    /// Per-aggregate-type ordering, overriding --ordering for those types:
    /// `orders=strict,payments=partition`.
    #[arg(help_heading = "Ordering and several relays", long, env = "OUTBOX_ORDERING_FOR", value_delimiter = ',', value_parser = ordering_for)]
    pub(crate) ordering_for: Vec<(String, OrderMode)>,
    /// How soon the partitions of a relay that died (or froze, or lost its
    /// connection) move to the other relays.
    #[arg(help_heading = "Ordering and several relays", long, env = "OUTBOX_LEASE_TIMEOUT", default_value = "10s", value_parser = lease_timeout)]
    pub(crate) lease_timeout: Duration,
    /// Serve many outboxes (a fleet): every schema whose name matches this
    /// LIKE pattern (`tenant_%`) and holds an outbox named --table that
    /// `outbox migrate` made, found again every --discover-interval. One
    /// control session and --fleet-sessions batch sessions per database,
    /// whatever the number of outboxes.
    #[arg(help_heading = "Many tenants (a fleet)", long, env = "OUTBOX_SCHEMAS")]
    pub(crate) schemas: Option<String>,
    /// With --schemas: serve the tenant schemas of every database of the
    /// server whose name matches this LIKE pattern, not only the URL's.
    #[arg(
        help_heading = "Many tenants (a fleet)",
        long,
        env = "OUTBOX_DATABASES",
        requires = "schemas"
    )]
    pub(crate) databases: Option<String>,
    /// With --schemas: batch sessions per database, shared by its outboxes
    /// (one batch of an outbox at a time each).
    #[arg(help_heading = "Many tenants (a fleet)", long, env = "OUTBOX_FLEET_SESSIONS",
          default_value_t = outbox_relay::fleet::DEFAULT_SESSIONS as u32,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) fleet_sessions: u32,
    /// With --schemas: claims kept prepared per batch session, one per
    /// outbox, so PostgreSQL plans an outbox's claim once, not at every
    /// batch (about 200 kB of the backend's memory each; the least recently
    /// used is closed first). 0 plans every claim.
    #[arg(help_heading = "Many tenants (a fleet)", long, env = "OUTBOX_FLEET_PREPARED_CLAIMS",
          default_value_t = outbox_relay::fleet::DEFAULT_PREPARED_CLAIMS as u32,
          value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub(crate) fleet_prepared_claims: u32,
    /// In a fleet: serve the outboxes split, not whole. Every fleet
    /// process then serves each of them at once, sharing it by partition
    /// leases as several relays of one outbox do, at the cost of a relay's
    /// own connections per outbox per process. For a busy outbox: give it
    /// as `fleet_split = true` in its [outboxes.NAME] table.
    #[arg(help_heading = "Many tenants (a fleet)", long, env = "OUTBOX_FLEET_SPLIT")]
    pub(crate) fleet_split: bool,
    /// With --schemas: how often outboxes are searched for (a new tenant is
    /// served within about this long) and shared out again between fleet
    /// processes (a dead one's outboxes move within about this long).
    #[arg(help_heading = "Many tenants (a fleet)", long, env = "OUTBOX_DISCOVER_INTERVAL", default_value = "5s", value_parser = positive_duration)]
    pub(crate) discover_interval: Duration,
    /// How this relay shows in `outbox relays` [default: host:pid].
    #[arg(help_heading = "Running", long, env = "OUTBOX_RELAY_NAME")]
    pub(crate) relay_name: Option<String>,
    /// Run retention from the relay: delete published rows older than this
    /// (plain outbox) or drop fully published days older than this and
    /// create the coming days (partitioned outbox). One relay at a time.
    #[arg(help_heading = "Running", long, env = "OUTBOX_RETENTION", value_parser = positive_duration)]
    pub(crate) retention: Option<Duration>,
    /// Serve Prometheus metrics (`/metrics`) and the probes (`/healthz`,
    /// `/readyz`) over HTTP on this address, e.g. 127.0.0.1:9187 [default:
    /// off]. Bound before the relay reports ready; a bind error is a
    /// configuration error.
    #[arg(help_heading = "Running", long, env = "OUTBOX_HTTP")]
    pub(crate) http: Option<std::net::SocketAddr>,
    /// Export OpenTelemetry traces (OTLP/HTTP, protobuf) to this collector,
    /// e.g. http://127.0.0.1:4318 (`/v1/traces` is added) [default: off,
    /// unless OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    /// is set]. A span per batch and per event: docs/tracing.md.
    #[arg(
        help_heading = "Running",
        long,
        env = "OUTBOX_OTLP_ENDPOINT",
        value_name = "URL"
    )]
    pub(crate) otlp_endpoint: Option<String>,
    /// How often `--retention` runs.
    #[arg(help_heading = "Running", long, env = "OUTBOX_RETENTION_INTERVAL", default_value = "1h", value_parser = positive_duration)]
    pub(crate) retention_interval: Duration,
    /// Delay after the first failed attempt; doubles per attempt.
    #[arg(help_heading = "Retries", long, env = "OUTBOX_BACKOFF_BASE", default_value = "200ms", value_parser = positive_duration)]
    pub(crate) backoff_base: Duration,
    /// Cap on the retry delay (and on the Retry-After a receiver asks for).
    #[arg(help_heading = "Retries", long, env = "OUTBOX_BACKOFF_MAX", default_value = "5m", value_parser = positive_duration)]
    pub(crate) backoff_max: Duration,
    /// How long a failing event is retried, from its first failed attempt:
    /// its first failure after that makes it a dead letter. An unavailable
    /// sink (refused, 502, 503, 504, 429) spends no attempt and never ends
    /// it. A route's `retry_for` in --config overrides it for that route.
    #[arg(help_heading = "Retries", long, env = "OUTBOX_RETRY_FOR", default_value = "24h", value_parser = positive_duration)]
    pub(crate) retry_for: Duration,
    /// Boxed: the largest part of the largest command.
    #[command(flatten, next_help_heading = "Sink options")]
    pub(crate) sink_options: Box<SinkArgs>,
}

/// The flags sinks are built with: each sink's own (declared beside the sink,
/// in `outbox_relay::sink`), then the ones they share.
#[derive(Debug, Args)]
pub(crate) struct SinkArgs {
    #[command(flatten)]
    pub(crate) per_sink: outbox_relay::PerSinkOptions,
    /// Timeout of one HTTP request (and of one Redis round trip, NATS ack,
    /// AMQP confirm or Kafka delivery report).
    #[arg(long, env = "OUTBOX_HTTP_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub(crate) http_timeout: Duration,
    /// Envelope of each event: native, cloudevents or debezium.
    #[arg(long, env = "OUTBOX_FORMAT", default_value = "native")]
    pub(crate) format: outbox_relay::sink::format::Format,
    /// Where CloudEvents attributes go: structured (one JSON document) or
    /// binary (ce-* headers, payload as body).
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_MODE", default_value = "structured")]
    pub(crate) cloudevents_mode: outbox_relay::sink::format::CloudEventsMode,
    /// CloudEvents `source` attribute [default: /outbox/<schema>.<table>].
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_SOURCE")]
    pub(crate) cloudevents_source: Option<String>,
}

impl SinkArgs {
    /// The options; `source` is the CloudEvents source when the flag is absent.
    pub(crate) fn options(self, source: impl FnOnce() -> String) -> outbox_relay::SinkOptions {
        let source = self.cloudevents_source.unwrap_or_else(source);
        outbox_relay::SinkOptions {
            timeout: self.http_timeout,
            formatter: outbox_relay::sink::format::Formatter::new(self.format, self.cloudevents_mode, source),
            per_sink: self.per_sink,
        }
    }
}

/// How `migrate --partition-by` splits the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PartitionBy {
    /// One partition per UTC day of created_at.
    Day,
}

#[derive(Debug, Subcommand)]
pub(crate) enum PartitionsCommand {
    /// Create the coming days' partitions and drop past days that hold no
    /// unpublished row (pending, retrying or dead); keep and report the rest.
    Maintain {
        /// Drop days that ended longer ago than this, e.g. 7d. Without it
        /// nothing is dropped.
        #[arg(long, value_parser = positive_duration)]
        keep: Option<Duration>,
        /// Days after today to create partitions for.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=366))]
        premake: u32,
    },
}

#[derive(Debug, Args)]
pub(crate) struct CleanupArgs {
    /// Age past which rows go, e.g. 7d, 12h.
    #[arg(long, value_parser = positive_duration)]
    pub(crate) older_than: Duration,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub(crate) batch_size: i64,
    /// Clean the consumer's processed_events table instead of the outbox.
    #[arg(long)]
    pub(crate) inbox: bool,
    #[command(flatten)]
    pub(crate) inbox_table: InboxTableArgs,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("filter").multiple(true)
    .args(["aggregate_type", "aggregate_id", "event_type", "since", "until"])))]
pub(crate) struct ReplayArgs {
    /// Where to send: a sink URL, as `relay --sink` takes it
    /// (redis://…, http://…, nats://…, amqp://…, kafka://…), or
    /// route:<aggregate_type> / route:default for a sink table of --config.
    /// With --resume, needed again only if the job's URL held a password.
    #[arg(long, required_unless_present_any = ["resume", "list", "all"])]
    pub(crate) to: Option<String>,
    /// The routes file `route:<name>` refers to (the relay's --config).
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Only events of this aggregate type.
    #[arg(long)]
    pub(crate) aggregate_type: Option<String>,
    /// Only events of this aggregate id.
    #[arg(long)]
    pub(crate) aggregate_id: Option<String>,
    /// Only events of this event type.
    #[arg(long)]
    pub(crate) event_type: Option<String>,
    /// Only events created at or after this time: RFC 3339
    /// (2026-12-05T00:00:00Z) or a duration ago (24h).
    #[arg(long, value_parser = instant)]
    pub(crate) since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time: RFC 3339 or a duration ago.
    #[arg(long, value_parser = instant)]
    pub(crate) until: Option<chrono::DateTime<chrono::Utc>>,
    /// Events per second at most, `N/s` or `N`, or `unlimited`
    /// [default: 1000/s, or the job's rate with --resume].
    #[arg(long, value_parser = rate)]
    pub(crate) rate: Option<f64>,
    /// Count the matching events (and those cleanup removed); send
    /// nothing, create no job.
    #[arg(long, conflicts_with_all = ["resume", "list"])]
    pub(crate) dry_run: bool,
    /// Continue job ID from its cursor, with its filter, target and format.
    #[arg(long, value_name = "ID", conflicts_with_all = ["filter", "list"])]
    pub(crate) resume: Option<i64>,
    /// List the replay jobs, newest first (with --all: of every outbox
    /// of the fleet, labelled).
    #[arg(long)]
    pub(crate) list: bool,
    #[command(flatten)]
    pub(crate) named: OutboxNames,
    /// With --list, print JSON instead of a table.
    #[arg(long, requires = "list")]
    pub(crate) json: bool,
    /// The sink flags `outbox relay` takes (--format, --stream-prefix, …).
    #[command(flatten)]
    pub(crate) sink_options: Box<SinkArgs>,
}

#[derive(Debug, Args)]
pub(crate) struct ConsumeArgs {
    /// What to read: redis://host:port[/db], nats://host:port or
    /// amqp://user:pass@host:port/vhost.
    #[arg(long)]
    pub(crate) from: String,
    /// The Redis stream (e.g. outbox.event.orders) or JetStream stream (e.g.
    /// OUTBOX); for redis:// and nats://.
    #[arg(long)]
    pub(crate) stream: Option<String>,
    /// The Redis consumer group or JetStream durable consumer (created if
    /// missing); for redis:// and nats://.
    #[arg(long)]
    pub(crate) group: Option<String>,
    /// The RabbitMQ queue (must exist, bound to the relay's exchange); for amqp://.
    #[arg(long)]
    pub(crate) queue: Option<String>,
    /// Unacknowledged RabbitMQ messages this worker holds at once (basic.qos).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: u16,
    /// This consumer's name in a Redis group [default: <hostname>-<pid>].
    #[arg(long)]
    pub(crate) consumer: Option<String>,
    /// The side effect: one SQL statement run once per event, in the inbox
    /// transaction, with $1 event_id (uuid), $2 aggregate_id (text),
    /// $3 event_type (text), $4 payload (jsonb), $5 headers (jsonb).
    #[arg(long)]
    pub(crate) apply: String,
    /// Take over entries left unacknowledged this long by a dead consumer
    /// (for NATS: the durable consumer's ack_wait, set when it is created).
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    pub(crate) claim_idle: Duration,
    /// Export a span per inbox transaction, a child of the event's
    /// `traceparent`, over OTLP/HTTP to this collector (as `outbox relay
    /// --otlp-endpoint`) [default: off, unless OTEL_EXPORTER_OTLP_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set].
    #[arg(long, env = "OUTBOX_OTLP_ENDPOINT", value_name = "URL")]
    pub(crate) otlp_endpoint: Option<String>,
    #[command(flatten)]
    pub(crate) inbox_table: InboxTableArgs,
}

/// Where the consumer's processed_events table is.
#[derive(Debug, Args)]
pub(crate) struct InboxTableArgs {
    /// Schema of the processed_events table.
    #[arg(long, env = "OUTBOX_INBOX_SCHEMA", default_value = "public")]
    pub(crate) inbox_schema: String,
    /// Name of the processed_events table.
    #[arg(long, env = "OUTBOX_INBOX_TABLE", default_value = "processed_events")]
    pub(crate) inbox_table: String,
}

impl InboxTableArgs {
    /// The validated table names.
    pub(crate) fn config(&self) -> Result<outbox::InboxConfig, outbox::Error> {
        outbox::InboxConfig::new(&self.inbox_schema, &self.inbox_table)
    }
}

/// The outboxes of a fleet, for the commands that report on many at once.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("many").multiple(true).args(["schemas", "all"])))]
pub(crate) struct FleetScope {
    /// Every outbox named --table in a schema whose name matches this LIKE
    /// pattern (`tenant_%`) that `outbox migrate` made: what `relay
    /// --schemas` serves. Labels are `schema.table`. With --all or
    /// --outbox, the fleet's pattern, over --config's `schemas`.
    #[arg(long, value_name = "PATTERN", conflicts_with = "schema")]
    pub(crate) schemas: Option<String>,
    /// With --schemas: in every database of the server whose name matches
    /// this LIKE pattern, not only the URL's. Labels are
    /// `database/schema.table`.
    #[arg(long, value_name = "PATTERN", requires = "schemas")]
    pub(crate) databases: Option<String>,
    #[command(flatten)]
    pub(crate) named: OutboxNames,
    /// The relay's configuration file: its `[outboxes.NAME]` tables and
    /// its fleet settings (`schemas`, `databases`, `table`,
    /// `database_url`) are what --outbox and --all name.
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub(crate) config: Option<std::path::PathBuf>,
}

/// `--outbox NAME` and `--all`: outboxes of the fleet the relay's
/// configuration (--config, flags, environment) describes, by name.
#[derive(Debug, Args)]
pub(crate) struct OutboxNames {
    /// One outbox of the fleet, with its own connection settings: the
    /// name of an `[outboxes.NAME]` table of --config, or the label a
    /// fleet prints for an outbox it found (`schema.table`,
    /// `database/schema.table`). An unknown name is exit 2.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["schema", "all"])]
    pub(crate) outbox: Option<String>,
    /// Every outbox the fleet of this configuration serves: --config's
    /// `[outboxes.NAME]` tables and the outboxes its `schemas` pattern
    /// (or --schemas) finds, one report labelled by outbox.
    #[arg(long, conflicts_with = "schema")]
    pub(crate) all: bool,
}

#[derive(Debug, Args)]
pub(crate) struct StatsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) fleet: FleetScope,
    /// With --schemas or --all: only the N outboxes with the largest
    /// backlog (the totals still count every outbox).
    #[arg(long, value_name = "N", requires = "many")]
    pub(crate) top: Option<usize>,
}

#[derive(Debug, Args)]
pub(crate) struct RelaysArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) fleet: FleetScope,
}

#[derive(Debug, Args)]
pub(crate) struct DlqArgs {
    /// `dlq list` only: the dead letters of every outbox named --table in a
    /// schema matching this LIKE pattern (`tenant_%`), each line labelled
    /// with its outbox. The other subcommands change one outbox: name it
    /// with --outbox or --schema. With --outbox or `list --all`, the
    /// fleet's pattern, over --config's `schemas`.
    #[arg(long, value_name = "PATTERN", global = true, conflicts_with = "schema")]
    pub(crate) schemas: Option<String>,
    /// With --schemas: in every database of the server whose name matches
    /// this LIKE pattern, not only the URL's.
    #[arg(long, value_name = "PATTERN", global = true, requires = "schemas")]
    pub(crate) databases: Option<String>,
    /// The outbox of a fleet to read or change: the name of an
    /// `[outboxes.NAME]` table of --config, or a label a fleet prints
    /// (`schema.table`, `database/schema.table`). An unknown name is exit 2.
    #[arg(long, value_name = "NAME", global = true, conflicts_with = "schema")]
    pub(crate) outbox: Option<String>,
    /// The relay's configuration file, whose fleet --outbox and `list
    /// --all` name.
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    pub(crate) config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub(crate) command: DlqCommand,
}

#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// List dead letters, oldest first (with --schemas: by outbox, then
    /// oldest first).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// At most this many rows (with --schemas or --all: over all
        /// outboxes).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
        /// Every outbox of the fleet --config describes, each line
        /// labelled with its outbox.
        #[arg(long, conflicts_with_all = ["schema", "outbox"])]
        all: bool,
    },
    /// One event (a dead letter or not) by its row id: every column, the
    /// attempt history, payload and headers.
    Show {
        /// The outbox row id.
        id: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Refused with why: one event is in one outbox.
        #[arg(long, hide = true)]
        all: bool,
    },
    /// Requeue dead letters: attempts = 0, a new retry window, due now.
    #[command(alias = "retry")]
    Requeue(RequeueArgs),
    /// Give up on dead letters: they stay for inspection but no longer hold
    /// their aggregate back under `--ordering strict`.
    #[command(alias = "skip")]
    GiveUp {
        /// These outbox ids.
        #[arg(long, num_args = 1.., required = true)]
        id: Vec<i64>,
        /// Refused with why: ids name rows of one outbox.
        #[arg(long, hide = true)]
        all: bool,
    },
    /// Delete dead letters given up on longer ago than --older-than: the
    /// rows an operator decided will never be sent, kept until then for
    /// inspection. In batches of 1,000.
    Purge {
        /// Given up on longer ago than this, e.g. 30d.
        #[arg(long, value_parser = positive_duration)]
        older_than: Duration,
        /// Only count what would be deleted.
        #[arg(long)]
        dry_run: bool,
        /// Refused with why: a purge changes one outbox.
        #[arg(long, hide = true)]
        all: bool,
    },
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("selector").required(true).multiple(true)
    .args(["all", "id", "aggregate_type", "error_contains"])))]
pub(crate) struct RequeueArgs {
    /// Every dead letter.
    #[arg(long)]
    pub(crate) all: bool,
    /// These outbox ids.
    #[arg(long, num_args = 1..)]
    pub(crate) id: Vec<i64>,
    /// Dead letters of this aggregate type.
    #[arg(long)]
    pub(crate) aggregate_type: Option<String>,
    /// Dead letters whose last error contains this text.
    #[arg(long)]
    pub(crate) error_contains: Option<String>,
    /// Only count what would be requeued.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

#[derive(Debug, Args)]
pub(crate) struct AdminArgs {
    /// Address to serve the console on. Without --admin-token it must be a
    /// loopback address.
    #[arg(long, env = "OUTBOX_ADMIN_LISTEN", default_value = "127.0.0.1:9188")]
    pub(crate) listen: std::net::SocketAddr,
    /// Token that signs browsers in and that scripts send as
    /// `Authorization: Bearer <token>`; at least 16 characters. Needed to
    /// requeue or give up, and then for every page. Prefer the environment
    /// variable: arguments show in `ps`.
    #[arg(long, env = "OUTBOX_ADMIN_TOKEN", hide_env_values = true)]
    pub(crate) admin_token: Option<String>,
    /// A file of named tokens, one `name token` per line (`#` comments):
    /// each signs in as its name, which the audit trail records for every
    /// change. With --admin-token beside it, that token is named `admin`.
    #[arg(long, env = "OUTBOX_ADMIN_TOKENS_FILE", value_name = "FILE")]
    pub(crate) admin_tokens_file: Option<std::path::PathBuf>,
    /// Serve every tenant outbox of the URL's database in a schema matching
    /// this LIKE pattern (`tenant_%`), what `relay --schemas` serves: `/`
    /// lists them by backlog, each one's pages are under `/o/<schema>/`.
    #[arg(long, value_name = "PATTERN", conflicts_with = "schema")]
    pub(crate) schemas: Option<String>,
    /// Not supported by the console: run one `outbox admin --schemas` per
    /// database (refused with exit 2).
    #[arg(long, value_name = "PATTERN", requires = "schemas", hide = true)]
    pub(crate) databases: Option<String>,
    /// The routes file whose sink tables replay jobs started from the
    /// console may name as `route:NAME` (the relay's --config).
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// How replay jobs started from the console reach their sinks.
    #[command(flatten)]
    pub(crate) sink_options: Box<SinkArgs>,
}

/// `TYPE=MODE` of `--ordering-for`.
fn ordering_for(s: &str) -> Result<(String, OrderMode), String> {
    let (aggregate_type, mode) = s
        .split_once('=')
        .filter(|(t, _)| !t.is_empty())
        .ok_or_else(|| format!("expected AGGREGATE_TYPE=MODE, got {s:?}"))?;
    let mode = <OrderMode as clap::ValueEnum>::from_str(mode, false)
        .map_err(|_| format!("unknown ordering {mode:?} for {aggregate_type:?} (partition or strict)"))?;
    Ok((aggregate_type.to_owned(), mode))
}

/// A replay rate in events per second: `N/s`, `N`, or `unlimited`.
fn rate(s: &str) -> Result<f64, String> {
    outbox_relay::replay::parse_rate(s)
}

/// An instant: RFC 3339, or a duration before now (this machine's clock).
fn instant(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.to_utc());
    }
    let ago = humantime::parse_duration(s).map_err(|_| {
        format!("{s:?} is neither an RFC 3339 time (2026-12-05T00:00:00Z) nor a duration ago (24h)")
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| chrono::Utc::now().checked_sub_signed(ago))
        .ok_or_else(|| format!("{s:?} is too far back"))
}

/// A lease timeout: ticks come every third of it, so below a second the
/// heartbeat alone would keep PostgreSQL busy.
fn lease_timeout(s: &str) -> Result<Duration, String> {
    let d = positive_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err("must be at least 1s".to_owned());
    }
    Ok(d)
}

/// A size in bytes: a number, optionally followed by B, kB, KiB, MB, MiB,
/// GB or GiB.
fn byte_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 65536, 512KiB, 1MiB)"))?;
    let unit: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "KiB" => 1 << 10,
        "MB" => 1000 * 1000,
        "MiB" => 1 << 20,
        "GB" => 1000 * 1000 * 1000,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use B, kB, KiB, MB, MiB, GB or GiB)"
            ));
        }
    };
    match number.checked_mul(unit) {
        Some(0) => Err("must be greater than zero".to_owned()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

/// `--max-attempts`: a count of at least 1, or `none`: `i32::MAX`, which
/// no row's attempts reach (`outbox_relay::defaults::MAX_ATTEMPTS`).
fn max_attempts(s: &str) -> Result<i32, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(outbox_relay::defaults::MAX_ATTEMPTS);
    }
    match s.parse::<i32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a count of at least 1, nor `none`")),
    }
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 200ms, 1s, 5m)"))?;
    if d.is_zero() {
        return Err("must be greater than zero".to_owned());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::byte_size;

    /// Hand-written rather than `bytesize`'s `FromStr`, which saturates an
    /// overflow to `u64::MAX` and accepts zero and fractions: a limit flag
    /// should refuse those, naming the value.
    #[test]
    fn byte_sizes_are_exact_and_refuse_zero_and_overflow() {
        assert_eq!(byte_size("65536"), Ok(65_536));
        assert_eq!(byte_size("512KiB"), Ok(512 * 1024));
        assert_eq!(byte_size("1 MiB"), Ok(1 << 20));
        assert_eq!(byte_size("1MB"), Ok(1_000_000));
        assert_eq!(byte_size("16MiB"), Ok(16 << 20));
        assert_eq!(byte_size("0KiB"), Err("must be greater than zero".to_owned()));
        assert_eq!(
            byte_size("20000000000GiB"),
            Err("\"20000000000GiB\" is too large".to_owned())
        );
        assert!(byte_size("1.5MiB").unwrap_err().contains("unknown unit"));
        assert!(byte_size("1TiB").unwrap_err().contains("unknown unit"));
        assert!(byte_size("MiB").unwrap_err().contains("is not a size"));
    }
}
