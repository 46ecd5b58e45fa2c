//! The page frame (navigation, who is signed in, the sign-out form), the
//! stylesheet, pages that only say something, and how instants and
//! durations read. Every value goes through maud's `( )`, which escapes it.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use crate::auth::Access;

/// The only asset, compiled in: the CSP allows styles from the console
/// itself and nothing from the network.
const CSS: &str = include_str!("../assets/admin.css");

/// `GET /admin.css`.
pub(crate) async fn stylesheet() -> Response {
    let mut response = CSS.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/css; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("max-age=3600"));
    response
}

/// Every page's `<head>`: its title and the console's one stylesheet, and
/// for a live page the refresh: a `<meta http-equiv="refresh">`, which
/// needs no script (the CSP allows none).
fn head(title: &str, refresh: Option<u32>) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            @if let Some(seconds) = refresh { meta http-equiv="refresh" content=(seconds); }
            title { (title) " · outbox admin" }
            link rel="stylesheet" href="/admin.css";
        }
    }
}

/// A page without navigation (the sign-in form).
pub(crate) fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title, None))
            body { main { (body) } }
        }
    }
}

/// Where a page sits: the outbox it is about and where that outbox's
/// pages are, or the list of a fleet's outboxes.
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    /// What the header names: `schema.table`, or the fleet's `--schemas`
    /// pattern on its list.
    pub(crate) label: String,
    /// The prefix of the outbox's pages: "" for the console of one outbox,
    /// `/o/<schema>` for one of a fleet's; None on the fleet's list.
    pub(crate) base: Option<String>,
    /// Whether `/` lists many outboxes (each outbox's pages link back).
    pub(crate) fleet: bool,
}

impl Frame {
    /// The path of this outbox's page `path` (which starts with `/`).
    pub(crate) fn href(&self, path: &str) -> String {
        format!("{}{path}", self.base.as_deref().unwrap_or(""))
    }
}

/// A page of the console: navigation, the table it shows, who is signed in.
pub(crate) fn layout(title: &str, access: &Access, frame: &Frame, body: Markup) -> Markup {
    page(title, access, frame, body, None)
}

/// How often live pages reload themselves.
pub(crate) const REFRESH_SECONDS: u32 = 5;

/// A page that reloads itself every [`REFRESH_SECONDS`] unless its query
/// says `live=0` (`paused`): the page links to the other state.
pub(crate) fn live_layout(
    title: &str,
    access: &Access,
    frame: &Frame,
    path: &str,
    paused: bool,
    body: Markup,
) -> Markup {
    let toggle = html! {
        p.muted #live {
            @if paused {
                "Not refreshing. " a #live-toggle href=(frame.href(path)) { "Refresh every " (REFRESH_SECONDS) " s" }
            } @else {
                "Refreshes every " (REFRESH_SECONDS) " s. " a #live-toggle href=(frame.href(&format!("{path}?live=0"))) { "Stop refreshing" }
            }
        }
    };
    let refresh = (!paused).then_some(REFRESH_SECONDS);
    page(title, access, frame, html! { (toggle) (body) }, refresh)
}

fn page(title: &str, access: &Access, frame: &Frame, body: Markup, refresh: Option<u32>) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title, refresh))
            body {
                header {
                    nav {
                        a.brand href="/" { "outbox admin" }
                        @if frame.fleet {
                            a #fleet-list href="/" { "All outboxes" }
                            form.lookup #picker method="get" action="/pick" {
                                input type="search" name="schema" placeholder="tenant schema" aria-label="open the outbox of a tenant schema";
                                button type="submit" { "Open" }
                            }
                        }
                        span.table #outbox-label { (frame.label) }
                        @if frame.base.is_some() {
                            a #overview-link href=(frame.href("/")) { "Overview" }
                            a #events-link href=(frame.href("/events")) { "Events" }
                            a #routes-link href=(frame.href("/routes")) { "Routes" }
                            a href=(frame.href("/dead")) { "Dead letters" }
                            a #replays-link href=(frame.href("/replays")) { "Replays" }
                            a #audit-link href=(frame.href("/audit")) { "Audit" }
                            form.lookup method="get" action=(frame.href("/event")) {
                                input type="search" name="id" placeholder="event id or row id" aria-label="event id or row id";
                                button type="submit" { "Story" }
                            }
                        }
                    }
                    div.who {
                        @match access {
                            Access::ReadOnly => span.badge.readonly { "read-only: no --admin-token" },
                            Access::Bearer { who } => span.badge { "bearer token: " (who) },
                            Access::Session { csrf, who, .. } => {
                                span.badge #who { "signed in as " (who) }
                                form.inline method="post" action="/logout" {
                                    input type="hidden" name="csrf" value=(csrf);
                                    button.link type="submit" { "Sign out" }
                                }
                            },
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// A page with one message, e.g. a refusal.
pub(crate) fn message_page(
    status: StatusCode,
    title: &str,
    access: &Access,
    frame: &Frame,
    message: &str,
) -> Response {
    let body =
        html! { p.message #message { (message) } p { a href=(frame.href("/")) { "Back to the overview" } } };
    (status, layout(title, access, frame, body)).into_response()
}

/// A failed page: the error chain (escaped) and a 500, also logged.
#[derive(Debug)]
pub(crate) struct Failure(pub(crate) String, pub(crate) tokio_postgres::Error);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let chain = error_chain(&self.1);
        tracing::error!(error = %chain, "admin: {}", self.0);
        let body = html! {
            h1 { "Something failed" }
            p.error { (self.0) ": " (chain) }
            p { a href="/" { "Back to the overview" } }
        };
        (StatusCode::INTERNAL_SERVER_ERROR, bare("Error", body)).into_response()
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// "1 dead letter", "3 dead letters".
pub(crate) fn dead_letters(n: impl Into<i128>) -> String {
    match n.into() {
        1 => "1 dead letter".to_owned(),
        n => format!("{n} dead letters"),
    }
}

/// `2024-05-01 12:00:03 UTC`.
pub(crate) fn instant(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `3m 12s`, whole seconds; `0s` for anything under one.
pub(crate) fn duration(seconds: f64) -> String {
    // Negative only when clocks disagree; whole seconds read better.
    let whole = seconds.max(0.0).round() as u64;
    humantime::format_duration(std::time::Duration::from_secs(whole)).to_string()
}

/// `3m 12s ago` / `in 5s` relative to `now`.
pub(crate) fn relative(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let seconds = (now - t).num_milliseconds() as f64 / 1000.0;
    if seconds >= 0.0 {
        format!("{} ago", duration(seconds))
    } else {
        format!("in {}", duration(-seconds))
    }
}

/// An instant with its age, e.g. `2024-05-01 12:00:03 UTC (3m 12s ago)`.
pub(crate) fn when(t: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    html! { time datetime=(t.to_rfc3339()) { (instant(t)) } " (" (relative(t, now)) ")" }
}

/// A JSON value indented, for a `<pre>`.
pub(crate) fn json(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_ranges_read() {
        assert_eq!(duration(192.4), "3m 12s");
        assert_eq!(duration(-1.0), "0s");
    }

    #[test]
    fn markup_in_values_is_escaped() {
        let page = layout(
            "<script>alert(1)</script>",
            &Access::ReadOnly,
            &Frame {
                label: "\"><img src=x onerror=alert(1)>".into(),
                base: Some(String::new()),
                fleet: false,
            },
            html! {},
        )
        .into_string();
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(!page.contains("<img src=x"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{page}");
    }
}
