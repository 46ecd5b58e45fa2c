//! `outbox admin`: checks the flags (a token, or a loopback address), binds,
//! and hands over to `outbox_admin` until SIGINT/SIGTERM. With `--schemas`
//! the console serves a fleet's tenant outboxes of the URL's database; each
//! is checked when its page is asked for, as tenants come and go. The
//! replay jobs the console runs get their sinks from `Targets`: `outbox
//! replay --to`'s own rules, with the sink flags given to `outbox admin`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use outbox::sql::ReplayFilter;
use outbox_relay::sink::format::Formatter;
use outbox_relay::{Backoff, Sink, SinkOptions};

use super::replay::target::{Target, format_name, parse_format};
use crate::cli::{AdminArgs, Global};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, args: AdminArgs) -> anyhow::Result<()> {
    let tokens = tokens(&args)?;
    let loopback = args.listen.ip().is_loopback();
    if tokens.is_empty() && !loopback {
        return Err(ConfigError(format!(
            "refusing to serve the admin console on {} without a token: pass --admin-token (or set \
             OUTBOX_ADMIN_TOKEN) or --admin-tokens-file, or listen on a loopback address such as 127.0.0.1:9188",
            args.listen
        ))
        .into());
    }
    if let Some(databases) = &args.databases {
        return Err(ConfigError(format!(
            "outbox admin serves the outboxes of one database: --databases {databases:?} is not supported; \
             run one `outbox admin --schemas` per database (its URL names it)"
        ))
        .into());
    }
    let config = super::outbox_config(g)?;
    let replays = outbox_admin::Replays {
        targets: Arc::new(Targets {
            config: args.config,
            options: super::sink_options(&config, *args.sink_options),
        }),
        backoff: Backoff {
            max_attempts: g.max_attempts,
            ..Backoff::default()
        },
    };
    let pg = super::pg_config(g)?;
    let client = super::connect(&pg).await?;
    // Without a token the console only reads.
    let role = if !tokens.is_empty() {
        outbox::privileges::Role::Admin
    } else {
        outbox::privileges::Role::AdminRead
    };
    let (scope, serving) = match args.schemas {
        None => {
            super::require(&client, &config, &[role]).await?;
            outbox::check(&client, &config).await?;
            (outbox_admin::Scope::One(config.clone()), config.display_name())
        }
        Some(schemas) => {
            // clap refuses --schema beside --schemas, but not before the
            // subcommand (see `selection::no_schema_beside`).
            super::selection::no_schema_beside(g, &format!("--schemas {schemas:?}"))?;
            let found = outbox::sql::fleet::tenant_outboxes(&client, &schemas, &config.table)
                .await
                .context("listing the tenant outboxes")?;
            if found.is_empty() {
                tracing::warn!(
                    schemas,
                    "admin: no schema matching --schemas holds an outbox yet (`outbox migrate --schemas`)"
                );
            }
            let serving = format!("{} in schemas {schemas}", config.table);
            let scope = outbox_admin::Scope::Fleet {
                schemas,
                template: config,
            };
            (scope, serving)
        }
    };
    drop(client);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {} (--listen)", args.listen))?;
    let cancel = super::shutdown_token()?;
    let mode = if !tokens.is_empty() {
        "token required"
    } else {
        "read-only: no --admin-token"
    };
    tracing::info!(listen = %args.listen, outboxes = %serving, "admin console on http://{} ({mode})", args.listen);
    outbox::notify::send("READY=1\nSTATUS=admin console ready");
    let admin = outbox_admin::Admin {
        pg,
        scope,
        tokens,
        // Browsers drop `Secure` cookies over plain HTTP, which loopback
        // (tests, an SSH tunnel) speaks; anywhere else a TLS proxy is
        // expected in front.
        secure_cookie: !loopback,
        replays: Some(replays),
    };
    outbox_admin::serve(admin, listener, cancel).await?;
    tracing::info!("admin console stopped");
    Ok(())
}

/// `--admin-token` (named `admin`) and the lines of `--admin-tokens-file`;
/// a short token, a malformed line or a name given twice is exit 2.
fn tokens(args: &AdminArgs) -> anyhow::Result<Vec<outbox_admin::NamedToken>> {
    let mut tokens = Vec::new();
    if let Some(t) = &args.admin_token {
        let token = outbox_admin::Token::new(t.clone()).ok_or_else(|| {
            ConfigError(format!(
                "--admin-token (OUTBOX_ADMIN_TOKEN) must be at least {} characters",
                outbox_admin::auth::MIN_TOKEN_LEN
            ))
        })?;
        tokens.push(outbox_admin::NamedToken {
            name: outbox_admin::auth::DEFAULT_NAME.to_owned(),
            token,
        });
    }
    if let Some(path) = &args.admin_tokens_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("reading --admin-tokens-file {}: {e}", path.display())))?;
        let named = outbox_admin::auth::parse_tokens(&text)
            .map_err(|e| ConfigError(format!("--admin-tokens-file {}: {e}", path.display())))?;
        if named.is_empty() {
            return Err(ConfigError(format!("--admin-tokens-file {} holds no token", path.display())).into());
        }
        for t in named {
            if tokens
                .iter()
                .any(|o: &outbox_admin::NamedToken| o.token.same_as(&t.token))
            {
                return Err(ConfigError(format!(
                    "--admin-tokens-file {}: the token of {:?} is --admin-token's; give each name its own",
                    path.display(),
                    t.name
                ))
                .into());
            }
            if tokens.iter().any(|o: &outbox_admin::NamedToken| o.name == t.name) {
                return Err(ConfigError(format!(
                    "--admin-tokens-file {}: the name {:?} is --admin-token's; choose another",
                    path.display(),
                    t.name
                ))
                .into());
            }
            tokens.push(t);
        }
    }
    Ok(tokens)
}

/// `outbox replay --to`'s targets, for the replay jobs the console runs:
/// a sink URL, or `route:NAME` of `--config`, with the sink flags given
/// to `outbox admin`.
struct Targets {
    config: Option<PathBuf>,
    options: SinkOptions,
}

impl outbox_admin::ReplayTargets for Targets {
    fn sink(
        &self,
        target: &str,
        format: &str,
        filter: Option<&mut ReplayFilter>,
    ) -> Result<Box<dyn Sink>, String> {
        let (format, mode) = parse_format(format).map_err(|e| format!("{e:#}"))?;
        let mut options = self.options.clone();
        let (_, _, source) = options.formatter.parts();
        options.formatter = Formatter::new(format, mode, source.to_owned());
        Target::parse(target)
            .sink(self.config.as_deref(), &options, filter)
            .map_err(|e| format!("{e:#}"))
    }

    fn stored(&self, target: &str) -> String {
        Target::parse(target).stored()
    }

    fn default_format(&self) -> String {
        format_name(&self.options.formatter)
    }
}
