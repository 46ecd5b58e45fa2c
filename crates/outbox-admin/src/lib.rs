//! `outbox admin`: a server-rendered web console for one outbox table.
//!
//! | module | owns |
//! |---|---|
//! | [`auth`](crate::auth) | the token, browser sessions, CSRF tokens, the security headers |
//! | `db` | the one PostgreSQL connection, reopened when it drops |
//! | `overview` | backlog per aggregate type, throughput chart, dead letters per error, relays |
//! | `dead` | the dead-letter list and its actions: requeue and give up, each after a dry run |
//! | `story` | one event and why it is where it is |
//! | `view` | the page layout, shared snippets, durations and instants |
//! | `chart` | the throughput bars as inline SVG drawn by the server |
//!
//! Every page is HTML rendered with [`maud`], which escapes every value it
//! interpolates: a payload, header or error holding markup shows as text.
//! There is no JavaScript at all and the only asset, the stylesheet, is
//! compiled in; the `Content-Security-Policy` header forbids scripts and
//! anything from another origin, so markup that slipped through would still
//! not run.
//!
//! The console reads through the typed statements of [`outbox::sql`] (the
//! same ones `outbox stats`, `outbox relays` and `outbox dlq` run) and
//! changes rows only through [`outbox::sql::OutboxSql::requeue_dead`] and
//! [`outbox::sql::OutboxSql::give_up`], each after its dry-run count. It is
//! never on the relay's path.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod auth;
mod chart;
mod db;
mod dead;
mod form;
mod overview;
mod story;
mod view;

pub use auth::Token;

/// What the console serves and how it guards it.
#[derive(Debug)]
pub struct Admin {
    /// Where PostgreSQL is.
    pub pg: outbox_relay::pg::PgConfig,
    /// Which outbox table.
    pub outbox: outbox::Config,
    /// The token mutations (and, when set, every page) need. None: read-only.
    pub token: Option<Token>,
    /// Whether the session cookie gets `Secure` (false on a loopback
    /// address, where tests and SSH tunnels speak plain HTTP).
    pub secure_cookie: bool,
}

/// What can stop the console.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The HTTP server failed.
    #[error("serving the admin console")]
    Serve(#[source] std::io::Error),
}

/// Shared by every handler.
pub(crate) struct AppState {
    pub(crate) db: db::Db,
    pub(crate) sql: outbox::sql::OutboxSql,
    pub(crate) outbox: outbox::Config,
    pub(crate) auth: auth::Auth,
}

pub(crate) type State = Arc<AppState>;

/// Serves the console on `listener` until `cancel`, then lets requests in
/// flight finish.
pub async fn serve(admin: Admin, listener: TcpListener, cancel: CancellationToken) -> Result<(), Error> {
    let state = Arc::new(AppState {
        db: db::Db::new(admin.pg),
        sql: outbox::sql::OutboxSql::new(&admin.outbox),
        outbox: admin.outbox,
        auth: auth::Auth::new(admin.token, admin.secure_cookie),
    });
    axum::serve(listener, router(state))
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
        .map_err(Error::Serve)
}

fn router(state: State) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/dead", get(dead::list))
        .route("/dead/confirm", get(dead::confirm))
        .route("/dead/requeue", post(dead::requeue))
        .route("/dead/give-up", post(dead::give_up))
        .route("/event", get(story::page))
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/admin.css", get(view::stylesheet))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            auth::guard,
        ))
        .layer(axum::middleware::from_fn(auth::security_headers))
        .with_state(state)
}
