//! The console of a fleet (`outbox admin --schemas PATTERN`): `GET /` lists
//! the tenant outboxes of the URL's database that `relay --schemas` would
//! serve, largest backlog first, and `/o/<schema>/…` are one outbox's
//! pages, the same router the console of one outbox serves at `/`.
//!
//! A tenant's router is built per request, after its schema is checked: a
//! valid [`outbox::Ident`], matching the pattern, holding an outbox at
//! this binary's version (else 404). So a tenant created after the console
//! started is there at once, a dropped one is gone, and no URL reaches a
//! table outside the pattern. Building the router costs microseconds
//! beside the statements its page runs; the one connection and the token's
//! sessions are shared by every tenant.
//!
//! The list reads every outbox's backlog in a few statements
//! ([`outbox::sql::fleet::summaries`], [`CHUNK`] outboxes each) and shows
//! the [`SHOWN`] largest, so thousands of tenants render in one page.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use maud::html;
use outbox::sql::fleet::{self, VersionedSummary};
use tower::ServiceExt;

use crate::auth::{Access, Auth};
use crate::db::Db;
use crate::view::{self, Failure, Frame};

/// Outboxes read per statement of the list: one `UNION ALL` part each.
const CHUNK: usize = 200;
/// Rows the list shows: the largest backlogs.
const SHOWN: usize = 200;

/// What the fleet's routes share.
pub(crate) struct FleetState {
    pub(crate) db: Arc<Db>,
    pub(crate) auth: Arc<Auth>,
    /// The replay jobs this console runs, of every tenant.
    pub(crate) runner: Arc<crate::jobs::Runner>,
    /// The `LIKE` pattern of `--schemas`.
    pub(crate) schemas: String,
    /// Every tenant's settings but its schema.
    pub(crate) template: outbox::Config,
}

/// The list at `/`, one outbox's pages under `/o/<schema>`.
pub(crate) fn routes(state: Arc<FleetState>) -> axum::Router {
    axum::Router::new()
        .route("/", get(list))
        .route("/pick", get(pick))
        .route("/o/{schema}", axum::routing::any(outbox_pages))
        .route("/o/{schema}/", axum::routing::any(outbox_pages))
        .route("/o/{schema}/{*rest}", axum::routing::any(outbox_pages))
        .with_state(state)
}

/// `GET /pick?schema=…`: the picker in every page's header opens that
/// tenant's outbox (its pages check the schema, so a wrong one is 404).
async fn pick(axum::extract::RawQuery(raw): axum::extract::RawQuery) -> Response {
    let p = crate::form::Params::query(raw.as_deref());
    match p.get("schema") {
        Some(schema) => {
            let path = format!(
                "/o/{}/",
                url::form_urlencoded::byte_serialize(schema.as_bytes()).collect::<String>()
            );
            axum::response::Redirect::to(&path).into_response()
        }
        None => axum::response::Redirect::to("/").into_response(),
    }
}

/// One row of the list.
struct Row {
    schema: String,
    label: String,
    listed: VersionedSummary,
    served_by: Option<String>,
}

/// `GET /`.
async fn list(
    State(state): State<Arc<FleetState>>,
    Extension(access): Extension<Access>,
) -> Result<Response, Failure> {
    let fail = |what: &'static str| move |e| Failure(what.to_owned(), e);
    let client = state
        .db
        .client()
        .await
        .map_err(fail("connecting to PostgreSQL"))?;
    let tenants = fleet::tenant_outboxes(&*client, &state.schemas, &state.template.table)
        .await
        .map_err(fail("listing the tenant outboxes"))?;
    let served = served_by(&client)
        .await
        .map_err(fail("reading who serves which outbox"))?;
    let configs: Vec<outbox::Config> = tenants
        .iter()
        .map(|t| {
            let mut config = state.template.clone();
            config.schema = t.schema.clone();
            config
        })
        .collect();
    let mut rows = Vec::with_capacity(configs.len());
    let mut left_out: Vec<(String, String)> = Vec::new();
    for (tenants, configs) in tenants.chunks(CHUNK).zip(configs.chunks(CHUNK)) {
        let listed = match fleet::summaries(&*client, configs).await {
            Ok(listed) => listed.into_iter().map(Ok).collect(),
            // One outbox the statement cannot read (a schema too old for a
            // column) fails its chunk: read those one at a time to find it.
            Err(_) => {
                let mut one_by_one = Vec::with_capacity(configs.len());
                for config in configs {
                    one_by_one.push(
                        fleet::summaries(&*client, std::slice::from_ref(config))
                            .await
                            .map(|mut l| l.remove(0)),
                    );
                }
                one_by_one
            }
        };
        for ((tenant, config), listed) in tenants.iter().zip(configs).zip(listed) {
            let label = config.display_name();
            match listed {
                Ok(listed) if listed.version == outbox::OUTBOX_VERSION => rows.push(Row {
                    schema: config.schema.as_str().to_owned(),
                    label,
                    listed,
                    served_by: served.get(&tenant.key).cloned(),
                }),
                // As `outbox stats --schemas` and the fleet: an outbox at
                // another version is left out, not misread.
                Ok(listed) => left_out.push((
                    label,
                    format!(
                        "schema version {}, this binary needs {}: run `outbox migrate --schemas` with the matching binary",
                        listed.version,
                        outbox::OUTBOX_VERSION
                    ),
                )),
                Err(e) => left_out.push((label, view::error_chain(&e))),
            }
        }
    }
    rows.sort_by(|a, b| {
        b.listed
            .summary
            .backlog
            .cmp(&a.listed.summary.backlog)
            .then_with(|| a.label.cmp(&b.label))
    });
    let sum =
        |f: fn(&outbox::sql::fleet::Summary) -> i64| rows.iter().map(|r| f(&r.listed.summary)).sum::<i64>();
    let oldest = rows
        .iter()
        .filter_map(|r| r.listed.summary.oldest_unpublished_age_seconds)
        .reduce(f64::max);
    let served_count = rows.iter().filter(|r| r.served_by.is_some()).count();
    let hidden = rows.len().saturating_sub(SHOWN);
    let age = |seconds: Option<f64>| seconds.map_or_else(|| "–".to_owned(), view::duration);
    let body = html! {
        @if rows.is_empty() && left_out.is_empty() {
            p.muted #no-outboxes {
                "No schema matching " code { (state.schemas) } " holds an outbox "
                code { (state.template.table) } ": make them with " code { "outbox migrate --schemas '" (state.schemas) "'" } "."
            }
        } @else {
            p.verdict #fleet-summary {
                (rows.len()) " outboxes · backlog " span #fleet-backlog { (sum(|s| s.backlog)) }
                " · dead letters " span #fleet-dead { (sum(|s| s.dead_letters)) }
                " · " (served_count) " served by a fleet process, " (rows.len() - served_count) " by nobody"
            }
            table #outboxes {
                thead { tr {
                    th { "outbox" } th.num { "backlog" } th.num { "due now" } th.num { "waiting" }
                    th.num { "dead letters" } th { "oldest unpublished" } th { "served by" }
                } }
                tbody {
                    @for r in rows.iter().take(SHOWN) {
                        @let s = &r.listed.summary;
                        tr.outbox #(format!("outbox-{}", r.schema)) {
                            td { a.outbox-link href=(format!("/o/{}/", r.schema)) { (r.label) } }
                            td.num.backlog { (s.backlog) }
                            td.num.due { (s.due_now) }
                            td.num.waiting { (s.waiting) }
                            td.num.dead { (s.dead_letters) }
                            td.oldest { (age(s.oldest_unpublished_age_seconds)) }
                            td.served {
                                @match &r.served_by { Some(by) => (by), None => span.error { "nobody" } }
                            }
                        }
                    }
                }
                tfoot {
                    tr #totals {
                        th { "total (" (rows.len()) " outboxes)" }
                        td.num.backlog { (sum(|s| s.backlog)) }
                        td.num.due { (sum(|s| s.due_now)) }
                        td.num.waiting { (sum(|s| s.waiting)) }
                        td.num.dead { (sum(|s| s.dead_letters)) }
                        td.oldest { (age(oldest)) }
                        td.served { (served_count) " served, " (rows.len() - served_count) " by nobody" }
                    }
                }
            }
            @if hidden > 0 {
                p.muted #more { (hidden) " more outboxes with smaller backlogs are not shown (the totals count them)." }
            }
            @if !left_out.is_empty() {
                h2 { "Left out" }
                ul #left-out {
                    @for (label, why) in &left_out { li { (label) ": " (why) } }
                }
            }
        }
        p.muted { "Reload the page to refresh." }
    };
    let frame = Frame {
        label: format!("{} in schemas {}", state.template.table, state.schemas),
        base: None,
        fleet: true,
    };
    Ok(view::layout("Outboxes", &access, &frame, body).into_response())
}

/// Which outbox key each fleet process serves, as `application_name (pid
/// N)` (or `pid N` without a name), from PostgreSQL's lock table.
async fn served_by(client: &tokio_postgres::Client) -> Result<HashMap<i32, String>, tokio_postgres::Error> {
    let names: HashMap<i32, String> = fleet::sessions(client)
        .await?
        .into_iter()
        .map(|s| (s.pid, s.application_name))
        .collect();
    Ok(fleet::owners(client)
        .await?
        .into_iter()
        .map(|(key, pid)| {
            let by = match names.get(&pid).filter(|n| !n.is_empty()) {
                Some(name) => format!("{name} (pid {pid})"),
                None => format!("pid {pid}"),
            };
            (key, by)
        })
        .collect())
}

/// `/o/<schema>/…`: one tenant's pages, after its schema is checked.
async fn outbox_pages(State(state): State<Arc<FleetState>>, request: Request) -> Response {
    let access = request.extensions().get::<Access>().cloned();
    let path = request.uri().path();
    let rest = path.strip_prefix("/o/").unwrap_or_default();
    let (schema, inner) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let not_found = |message: String| match &access {
        Some(access) => view::message_page(
            StatusCode::NOT_FOUND,
            "No such outbox",
            access,
            &Frame {
                label: String::new(),
                base: None,
                fleet: true,
            },
            &message,
        ),
        None => StatusCode::NOT_FOUND.into_response(),
    };
    let Ok(schema) = outbox::Ident::new("schema", schema) else {
        return not_found(format!("{schema:?} is not a schema name."));
    };
    let client = match state.db.client().await {
        Ok(client) => client,
        Err(e) => return Failure("connecting to PostgreSQL".into(), e).into_response(),
    };
    let tenant = fleet::tenant_outbox(&*client, &state.schemas, &schema, &state.template.table).await;
    match tenant {
        Ok(Some(_)) => {}
        Ok(None) => {
            return not_found(format!(
                "No outbox {schema}.{} among the schemas matching {}.",
                state.template.table, state.schemas
            ));
        }
        Err(e) => return Failure("looking up the outbox".into(), e).into_response(),
    }
    let mut config = state.template.clone();
    config.schema = schema.clone();
    match outbox::check(&*client, &config).await {
        Ok(()) => {}
        Err(e @ (outbox::Error::NotMigrated { .. } | outbox::Error::SchemaTooNew { .. })) => {
            return not_found(format!("{} is left out: {e}", config.display_name()));
        }
        Err(e) => {
            let chain = view::error_chain(&e);
            tracing::error!(error = %chain, "admin: checking the outbox {}", config.display_name());
            return (StatusCode::INTERNAL_SERVER_ERROR, chain).into_response();
        }
    }
    drop(client);
    let inner = match request.uri().query() {
        Some(query) => format!("{inner}?{query}"),
        None => inner.to_owned(),
    };
    let Ok(uri) = inner.parse::<Uri>() else {
        return not_found(format!("{inner:?} is not a page."));
    };
    let frame = Frame {
        label: config.display_name(),
        base: Some(format!("/o/{schema}")),
        fleet: true,
    };
    let app = Arc::new(crate::AppState::new(
        Arc::clone(&state.db),
        Arc::clone(&state.auth),
        Arc::clone(&state.runner),
        config,
        frame,
    ));
    let (mut parts, body) = request.into_parts();
    parts.uri = uri;
    match crate::pages(app).oneshot(Request::from_parts(parts, body)).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}
