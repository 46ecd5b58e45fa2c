//! `GET /replays`: the replay jobs of `outbox replay` (`<table>_replays`),
//! newest first, with their progress (acknowledged of matched, cursor of
//! bound), state, whether a process runs them now (it holds the job's
//! advisory lock) and why one stopped. Starting, stopping and resuming a
//! job stay with `outbox replay`: a job sends to a sink whose credentials
//! the console does not hold (a job's stored target is redacted).

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox::sql::ReplayState;

use crate::auth::Access;
use crate::view::{self, Failure};

pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
) -> Result<Response, Failure> {
    let jobs = match &state.replays {
        None => Vec::new(),
        Some(sql) => {
            let client = state
                .db
                .client()
                .await
                .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
            sql.jobs(&*client)
                .await
                .map_err(|e| Failure("listing replay jobs".into(), e))?
        }
    };
    let now = chrono::Utc::now();
    let body = html! {
        p.muted {
            "Jobs of " code { "outbox replay" } ". Resume a stopped or failed one with "
            code { "outbox replay --resume ID --to URL" } " (the URL's password is never stored); stop a running one with SIGTERM to its process."
        }
        @if jobs.is_empty() {
            p.muted #replays-empty { "No replay job yet." }
        } @else {
            table #replays {
                thead { tr {
                    th.num { "id" } th { "target" } th { "filter" } th { "state" } th { "progress" }
                    th.num { "rate/s" } th { "created" } th { "last error" }
                } }
                tbody {
                    @for j in &jobs {
                        @let pct = if j.matched > 0 { (j.sent as f64 * 100.0 / j.matched as f64).min(100.0) } else { 100.0 };
                        tr #(format!("replay-{}", j.id)) {
                            td.num { (j.id) }
                            td.mono { (j.target) " (" (j.format) ")" }
                            td.mono { (serde_json::to_string(&j.filter).unwrap_or_default()) }
                            td.state {
                                @match j.state {
                                    ReplayState::Running if j.live => span.ok { "running" },
                                    ReplayState::Running => span.error { "running, no process (died: resume it)" },
                                    ReplayState::Done => span.ok { "done" },
                                    ReplayState::Stopped => "stopped",
                                    ReplayState::Failed => span.error { "failed" },
                                }
                            }
                            td.progress {
                                progress max="100" value=(format!("{pct:.0}")) {}
                                " " (j.sent) " of " (j.matched) " sent, cursor " (j.cursor_id) " of " (j.upto_id)
                                @if j.removed.count > 0 { ", " (j.removed.count) " removed by retention" }
                            }
                            td.num { (j.rate) }
                            td { (view::when(j.created_at, now)) }
                            td.error { (j.last_error.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
    };
    Ok(view::layout("Replays", &access, &state.frame, body).into_response())
}
