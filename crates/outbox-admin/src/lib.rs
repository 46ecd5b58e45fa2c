//! `outbox admin`: a server-rendered operations console for one outbox
//! table, or for every tenant outbox of a fleet (`--schemas`): a list of
//! them, each with the one-outbox pages under `/o/<schema>/`; and the same
//! as a JSON API under `/api/`.
//!
//! | module | owns |
//! |---|---|
//! | [`auth`] | named tokens, browser sessions, CSRF tokens, the security headers |
//! | `fleet` | the list of a fleet's outboxes and the routing of `/o/<schema>/…` to one |
//! | `db` | the one PostgreSQL connection, reopened when it drops |
//! | `overview` | backlog per aggregate type, throughput chart, dead letters per error, relays |
//! | `dead` | the dead-letter list and its actions: requeue, give up and purge, each after a dry run |
//! | `routes` | routes → sinks as relays report them, and their pause and resume |
//! | `replays` | the replay jobs and their progress; the forms that start, cancel and resume them |
//! | `jobs` | the replay jobs this console runs: start, resume, cancel, and their tasks |
//! | `audit` | the audit trail's page |
//! | `actions` | every change, in one transaction with its audit row and the relays' wake-up |
//! | `api` | `/api/…`: the pages' data and actions as JSON, with status codes |
//! | `story` | one event and why it is where it is |
//! | `events` | every event by state and filters, one aggregate's history, and their JSON twins |
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
//! changes rows only in `actions`: requeue, give up and purge through
//! [`outbox::sql::OutboxSql`], pause and resume through
//! [`outbox::sql::RouteSql`], each after its dry run or confirmation and
//! recorded by [`outbox::sql::AuditSql`]; and runs replay jobs in `jobs`,
//! through the engine of [`outbox_relay::replay`]. It is never on the
//! relay's path.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

mod actions;
mod api;
mod audit;
pub mod auth;
mod chart;
mod db;
mod dead;
mod events;
mod fleet;
mod form;
mod jobs;
mod overview;
mod replays;
mod routes;
mod story;
mod view;

pub use auth::{NamedToken, Token};
pub use jobs::{ReplayTargets, Replays};

/// What the console serves and how it guards it.
#[derive(Debug)]
pub struct Admin {
    /// Where PostgreSQL is.
    pub pg: outbox_relay::pg::PgConfig,
    /// Which outbox table, or which tenant outboxes.
    pub scope: Scope,
    /// The tokens mutations (and, when any is set, every page) need, each
    /// with the name the audit trail records. Empty: read-only.
    pub tokens: Vec<NamedToken>,
    /// Whether the session cookie gets `Secure` (false on a loopback
    /// address, where tests and SSH tunnels speak plain HTTP).
    pub secure_cookie: bool,
    /// How to build replay jobs' sinks; None: the replays page lists jobs
    /// and cannot start or resume one.
    pub replays: Option<Replays>,
}

/// The outboxes a console shows.
#[derive(Debug)]
#[non_exhaustive]
pub enum Scope {
    /// One outbox, its pages at `/`.
    One(outbox::Config),
    /// The tenant outboxes of the URL's database (what `relay --schemas`
    /// serves): their list at `/`, each one's pages at `/o/<schema>/`.
    Fleet {
        /// The `LIKE` pattern of the schemas (`--schemas`).
        schemas: String,
        /// The outbox settings every tenant shares (table, channel); its
        /// schema is replaced by each tenant's.
        template: outbox::Config,
    },
}

/// What can stop the console.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The HTTP server failed.
    #[error("serving the admin console")]
    Serve(#[source] std::io::Error),
}

/// Shared by every handler of one outbox's pages.
pub(crate) struct AppState {
    /// Shared by every outbox of a fleet: one connection per console.
    pub(crate) db: Arc<db::Db>,
    pub(crate) sql: outbox::sql::OutboxSql,
    pub(crate) events: outbox::sql::EventsSql,
    pub(crate) audit: outbox::sql::AuditSql,
    /// None when the table's name is too long for the jobs table's (its
    /// migration would have failed, so there is no outbox to show).
    pub(crate) replays: Option<outbox::sql::ReplaySql>,
    /// As `replays`.
    pub(crate) routes: Option<outbox::sql::RouteSql>,
    pub(crate) outbox: outbox::Config,
    /// Shared by every outbox of a fleet: one session signs in to all.
    pub(crate) auth: Arc<auth::Auth>,
    /// The replay jobs this console runs, of every outbox it shows.
    pub(crate) runner: Arc<jobs::Runner>,
    pub(crate) frame: view::Frame,
}

impl AppState {
    /// The statements and frame of one outbox's pages.
    pub(crate) fn new(
        db: Arc<db::Db>,
        auth: Arc<auth::Auth>,
        runner: Arc<jobs::Runner>,
        outbox: outbox::Config,
        frame: view::Frame,
    ) -> AppState {
        AppState {
            db,
            sql: outbox::sql::OutboxSql::new(&outbox),
            events: outbox::sql::EventsSql::new(&outbox),
            audit: outbox::sql::AuditSql::new(&outbox),
            replays: outbox::sql::ReplaySql::new(&outbox).ok(),
            routes: outbox::sql::RouteSql::new(&outbox).ok(),
            outbox,
            auth,
            runner,
            frame,
        }
    }
}

pub(crate) type State = Arc<AppState>;

/// Serves the console on `listener` until `cancel`, then lets requests in
/// flight finish and stops the replay jobs it runs, each saved resumable.
pub async fn serve(admin: Admin, listener: TcpListener, cancel: CancellationToken) -> Result<(), Error> {
    let db = Arc::new(db::Db::new(admin.pg));
    let auth = Arc::new(auth::Auth::new(admin.tokens, admin.secure_cookie));
    let runner = Arc::new(jobs::Runner::new(admin.replays));
    let pages = match admin.scope {
        Scope::One(outbox) => {
            let frame = view::Frame {
                label: outbox.display_name(),
                base: Some(String::new()),
                fleet: false,
            };
            pages(Arc::new(AppState::new(
                db,
                Arc::clone(&auth),
                Arc::clone(&runner),
                outbox,
                frame,
            )))
        }
        Scope::Fleet { schemas, template } => fleet::routes(Arc::new(fleet::FleetState {
            db,
            auth: Arc::clone(&auth),
            runner: Arc::clone(&runner),
            schemas,
            template,
        })),
    };
    let served = axum::serve(listener, guarded(pages, auth))
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
        .map_err(Error::Serve);
    runner.shutdown().await;
    served
}

/// One outbox's pages, paths relative to where they are served.
fn pages(state: State) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/dead", get(dead::list))
        .route("/dead/confirm", get(dead::confirm))
        .route("/dead/requeue", post(dead::requeue))
        .route("/dead/give-up", post(dead::give_up))
        .route("/dead/purge", get(dead::purge_confirm).post(dead::purge))
        .route("/event", get(story::page))
        .route("/events", get(events::list))
        .route("/aggregate", get(events::aggregate))
        .route("/api/events", get(events::api_list))
        .route("/api/aggregate", get(events::api_aggregate))
        .route("/replays", get(replays::page))
        .route("/replays/check", post(replays::check))
        .route("/replays/start", post(replays::start))
        .route(
            "/replays/resume",
            get(replays::resume_confirm).post(replays::resume),
        )
        .route("/replays/cancel", post(replays::cancel))
        .route("/routes", get(routes::page))
        .route("/routes/confirm", get(routes::confirm))
        .route("/routes/pause", post(routes::pause))
        .route("/routes/resume", post(routes::resume))
        .route("/api/routes", get(api::routes))
        .route("/api/routes/pause", post(api::pause))
        .route("/api/routes/resume", post(api::resume))
        .route("/audit", get(audit::page))
        .route("/api/whoami", get(api::whoami))
        .route("/api/overview", get(api::overview))
        .route("/api/dead", get(api::dead))
        .route("/api/dead/requeue", post(api::requeue))
        .route("/api/dead/give-up", post(api::give_up))
        .route("/api/dead/purge", post(api::purge))
        .route("/api/event", get(api::event))
        .route("/api/replays", get(api::replays).post(api::start_replay))
        .route("/api/replays/resume", post(api::resume_replay))
        .route("/api/replays/cancel", post(api::cancel_replay))
        .route("/api/audit", get(api::audit))
        .fallback(api::not_found)
        .with_state(state)
}

/// `pages` with signing in and out and the stylesheet, every request
/// through the token guard, every response with the security headers: the
/// same for one outbox and for a fleet, so every page and action of a
/// tenant is guarded exactly as the one outbox's are.
fn guarded(pages: Router, auth: Arc<auth::Auth>) -> Router {
    let open = Router::new()
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/admin.css", get(view::stylesheet))
        .with_state(Arc::clone(&auth));
    pages
        .merge(open)
        .layer(axum::middleware::from_fn_with_state(auth, auth::guard))
        .layer(axum::middleware::from_fn(auth::security_headers))
}
