//! `GET /audit`: the audit trail, newest first, 100 a page by keyset: who
//! (the token's name) changed what, to which rows, how many, and when.

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::auth::Access;
use crate::form::Params;
use crate::view::{self, Failure};

const PAGE: i64 = 100;

pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let before = p.get("before").and_then(|v| v.parse().ok()).unwrap_or(i64::MAX);
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let rows = state
        .audit
        .recent(&*client, before, PAGE)
        .await
        .map_err(|e| Failure("reading the audit trail".into(), e))?;
    let now = chrono::Utc::now();
    let next = rows
        .last()
        .filter(|_| rows.len() as i64 == PAGE)
        .map(|r| state.frame.href(&format!("/audit?before={}", r.id)));
    let body = html! {
        p.muted { "Every change made from this console or its API, in the change's own transaction." }
        @if rows.is_empty() {
            p.muted #audit-empty { "No change made yet." }
        } @else {
            table #audit {
                thead { tr { th.num { "id" } th { "when" } th { "who" } th { "action" } th.num { "rows" } th { "selection" } } }
                tbody {
                    @for r in &rows {
                        tr #(format!("audit-{}", r.id)) {
                            td.num { (r.id) }
                            td { (view::when(r.at, now)) }
                            td.by { (r.who) }
                            td.act { (r.action) }
                            td.num.affected { (r.affected) }
                            td.mono { (r.detail.to_string()) }
                        }
                    }
                }
            }
            @if let Some(next) = next { p { a #next-page href=(next) { "Older →" } } }
        }
    };
    Ok(view::layout("Audit trail", &access, &state.frame, body).into_response())
}
