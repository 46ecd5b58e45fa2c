//! `outbox admin`: checks the flags (a token, or a loopback address), binds,
//! and hands over to `outbox_admin` until SIGINT/SIGTERM.

use anyhow::Context;

use crate::cli::{AdminArgs, Global};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, args: AdminArgs) -> anyhow::Result<()> {
    let token = match args.admin_token {
        None => None,
        Some(t) => Some(outbox_admin::Token::new(t).ok_or_else(|| {
            ConfigError(format!(
                "--admin-token (OUTBOX_ADMIN_TOKEN) must be at least {} characters",
                outbox_admin::auth::MIN_TOKEN_LEN
            ))
        })?),
    };
    let loopback = args.listen.ip().is_loopback();
    if token.is_none() && !loopback {
        return Err(ConfigError(format!(
            "refusing to serve the admin console on {} without a token: pass --admin-token (or set \
             OUTBOX_ADMIN_TOKEN), or listen on a loopback address such as 127.0.0.1:9188",
            args.listen
        ))
        .into());
    }
    let config = super::outbox_config(g)?;
    let pg = super::pg_config(g)?;
    let client = super::connect(&pg).await?;
    // Without a token the console only reads.
    let role = if token.is_some() {
        outbox::privileges::Role::Admin
    } else {
        outbox::privileges::Role::AdminRead
    };
    super::require(&client, &config, &[role]).await?;
    outbox::check(&client, &config).await?;
    drop(client);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {} (--listen)", args.listen))?;
    let cancel = super::shutdown_token()?;
    let mode = if token.is_some() {
        "token required"
    } else {
        "read-only: no --admin-token"
    };
    tracing::info!(listen = %args.listen, table = %config.display_name(), "admin console on http://{} ({mode})", args.listen);
    outbox::notify::send("READY=1\nSTATUS=admin console ready");
    let admin = outbox_admin::Admin {
        pg,
        outbox: config,
        token,
        // Browsers drop `Secure` cookies over plain HTTP, which loopback
        // (tests, an SSH tunnel) speaks; anywhere else a TLS proxy is
        // expected in front.
        secure_cookie: !loopback,
    };
    outbox_admin::serve(admin, listener, cancel).await?;
    tracing::info!("admin console stopped");
    Ok(())
}
