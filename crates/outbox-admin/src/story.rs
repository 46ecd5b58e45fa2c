//! `GET /event?id=…`: one event (by event id or row id) and why it is where
//! it is. The reasons come from one read of the row, the clock, the
//! earliest earlier pending event of its aggregate and its partition's
//! owner (`OutboxSql::event_story`), in the order the relay's claim checks
//! them: delivered; given up; dead; waiting for its retry; held behind an
//! earlier event (strict order); in a partition no live relay holds; else
//! due now. Then its last failed attempts (`attempt_log`), each with what
//! the sink answered.

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox::sql::EventStory;
use uuid::Uuid;

use crate::auth::Access;
use crate::form::Params;
use crate::overview::query;
use crate::view::{self, Failure};

/// Why an event is where it is (as JSON, `{"reason": "dead", "since": …}`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub(crate) enum Reason {
    /// A relay delivered it.
    Delivered { at: DateTime<Utc> },
    /// A dead letter someone gave up on.
    GivenUp {
        at: DateTime<Utc>,
        dead_at: Option<DateTime<Utc>>,
    },
    /// A dead letter waiting for a requeue or a give-up.
    Dead { since: DateTime<Utc> },
    /// Failed, and not due again until `at`.
    WaitingForRetry { at: DateTime<Utc> },
    /// An earlier event of its aggregate is still pending.
    HeldBehind { id: i64 },
    /// No live relay holds its partition.
    Unowned { partition: i32 },
    /// Nothing holds it back: the partition's relay claims it next.
    DueNow,
}

/// Every reason that applies, the deciding one first.
pub(crate) fn reasons(s: &EventStory) -> Vec<Reason> {
    let e = &s.event;
    if let Some(at) = e.published_at {
        return vec![Reason::Delivered { at }];
    }
    if let Some(at) = e.given_up_at {
        return vec![Reason::GivenUp {
            at,
            dead_at: e.dead_at,
        }];
    }
    if let Some(since) = e.dead_at {
        return vec![Reason::Dead { since }];
    }
    let mut out = Vec::new();
    if e.next_attempt_at > s.now {
        out.push(Reason::WaitingForRetry {
            at: e.next_attempt_at,
        });
    }
    if let Some(id) = s.held_behind {
        out.push(Reason::HeldBehind { id });
    }
    if let (Some(partition), None) = (s.partition, s.owner) {
        out.push(Reason::Unowned { partition });
    }
    if out.is_empty() {
        out.push(Reason::DueNow);
    }
    out
}

/// A story's key: a row id (a number) or an event id (a UUID), as the
/// `(row id, event id)` pair `event_story` takes.
pub(crate) fn parse_id(key: &str) -> Result<(Option<i64>, Option<Uuid>), String> {
    match (key.parse::<i64>(), key.parse::<Uuid>()) {
        (Ok(id), _) => Ok((Some(id), None)),
        (_, Ok(uuid)) => Ok((None, Some(uuid))),
        _ => Err(format!(
            "{key:?} is neither a row id (a number) nor an event id (a UUID)."
        )),
    }
}

/// `GET /event`.
pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let table = state.outbox.display_name();
    let frame = &state.frame;
    let Some(key) = p.get("id") else {
        let body = html! { p { "Give an event id (UUID) or a row id in the search box above." } };
        return Ok(view::layout("Event story", &access, frame, body).into_response());
    };
    let (id, event_id) = match parse_id(key) {
        Ok(ids) => ids,
        Err(message) => {
            return Ok(view::message_page(
                StatusCode::BAD_REQUEST,
                "Event story",
                &access,
                frame,
                &message,
            ));
        }
    };
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let story = state
        .sql
        .event_story(&*client, id, event_id)
        .await
        .map_err(|e| Failure("reading the event".into(), e))?;
    let Some(story) = story else {
        return Ok(view::message_page(
            StatusCode::NOT_FOUND,
            "Event story",
            &access,
            frame,
            &format!(
                "No event {key} in {table}: never written, or delivered and removed by `outbox cleanup`."
            ),
        ));
    };
    let title = format!("Event {}", story.event.id);
    Ok(view::layout(&title, &access, frame, render(&story, frame)).into_response())
}

fn render(s: &EventStory, frame: &view::Frame) -> Markup {
    let e = &s.event;
    let now = s.now;
    let reasons = reasons(s);
    let owner = html! {
        @match (&s.owner, &s.owner_name) {
            (Some(id), Some(name)) => {
                "relay " strong { (name) } " (" span.mono { (id) } "), heartbeat "
                (view::duration(s.owner_silent_for.unwrap_or(0.0))) " ago"
            },
            _ => span.error { "no live relay" },
        }
    };
    html! {
        section.card #story {
            ul.reasons {
                @for (i, r) in reasons.iter().enumerate() {
                    li.verdict[i == 0] .reason {
                        @match r {
                            Reason::Delivered { at } => { span.ok { "Delivered" } " at " (view::when(*at, now)) "." },
                            Reason::GivenUp { at, dead_at } => {
                                "Given up " (view::when(*at, now))
                                @if let Some(d) = dead_at { ", a dead letter since " (view::when(*d, now)) }
                                ". It stays for the record and no longer holds its aggregate back."
                            },
                            Reason::Dead { since } => {
                                span.error { "Dead letter" } " since " (view::when(*since, now)) " after " (e.attempts) " attempts. "
                                "It waits for a requeue or a give-up: "
                                a href=(frame.href(&format!("/dead?{}", query(&[("aggregate_type", &e.aggregate_type), ("event_type", &e.event_type)])))) { "dead letters like it" } "."
                            },
                            Reason::WaitingForRetry { at } => {
                                "Waiting for its retry at " (view::when(*at, now)) ", after " (e.attempts) " failed attempts."
                            },
                            Reason::HeldBehind { id } => {
                                "Held behind an earlier event of aggregate " (e.aggregate_type) " / " (e.aggregate_id) ": "
                                a #held-behind href=(frame.href(&format!("/event?id={id}"))) { "event " (id) }
                                " is not delivered (and nobody gave up on it). Relays with --ordering strict (or --ordering-for "
                                (e.aggregate_type) "=strict) deliver this one only after it."
                            },
                            Reason::Unowned { partition } => {
                                "In partition " (partition) " of " (s.partitions) ", which no live relay holds: it waits for a relay to start or take the partition over."
                            },
                            Reason::DueNow => {
                                "Due now: the relay holding partition "
                                (s.partition.map_or_else(|| "–".to_owned(), |p| p.to_string())) " claims it next (" (owner) ")."
                            },
                        }
                    }
                }
            }
            @if let Some(error) = &e.last_error { p { "Last error: " span.error #last-error { (error) } } }
        }
        dl.fields {
            dt { "row id" } dd { (e.id) }
            dt { "event id" } dd.mono { (e.event_id) }
            dt { "aggregate" } dd {
                (e.aggregate_type) " / "
                a #aggregate-link href=(frame.href(&format!("/aggregate?{}", query(&[("id", &e.aggregate_id), ("type", &e.aggregate_type)])))) { (e.aggregate_id) }
            }
            dt { "event type" } dd { (e.event_type) }
            dt { "attempts" } dd { (e.attempts) }
            dt { "created" } dd { (view::when(e.created_at, now)) }
            dt { "first failed" } dd { @if let Some(t) = e.first_failed_at { (view::when(t, now)) } @else { "–" } }
            dt { "next attempt" } dd { (view::when(e.next_attempt_at, now)) }
            dt { "published" } dd { @if let Some(t) = e.published_at { (view::when(t, now)) } @else { "–" } }
            dt { "dead since" } dd { @if let Some(t) = e.dead_at { (view::when(t, now)) } @else { "–" } }
            dt { "given up" } dd { @if let Some(t) = e.given_up_at { (view::when(t, now)) } @else { "–" } }
            dt { "partition" } dd {
                @if let Some(p) = s.partition { (p) " of " (s.partitions) ", held by " (owner) } @else { "–" }
            }
        }
        h2 { "Attempts" }
        @if e.attempt_log.is_empty() {
            p #attempts { "No failed attempt recorded." }
        } @else {
            table #attempts {
                thead { tr { th { "at" } th { "attempt" } th { "outcome" } th { "error" } } }
                tbody {
                    @for a in &e.attempt_log {
                        tr {
                            td { (view::when(a.at, now)) }
                            td { @if let Some(n) = a.attempt { (n) } @else { "–" } }
                            td { @if a.outcome == "dead" { span.error { (a.outcome) } } @else { (a.outcome) } }
                            td.mono { (a.error.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
        h2 { "Payload" }
        pre #payload { (view::json(&e.payload)) }
        h2 { "Headers" }
        pre #headers { (view::json(&e.headers)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox::sql::EventDetail;

    fn story() -> EventStory {
        let now = Utc::now();
        EventStory {
            event: EventDetail {
                id: 2,
                event_id: Uuid::nil(),
                aggregate_type: "orders".into(),
                aggregate_id: "1".into(),
                event_type: "Placed".into(),
                payload: serde_json::json!({}),
                headers: serde_json::json!({}),
                attempts: 0,
                last_error: None,
                created_at: now,
                next_attempt_at: now,
                published_at: None,
                dead_at: None,
                given_up_at: None,
                first_failed_at: None,
                attempt_log: Vec::new(),
            },
            now,
            held_behind: None,
            partition: Some(3),
            partitions: 64,
            owner: Some(Uuid::nil()),
            owner_name: Some("r".into()),
            owner_silent_for: Some(1.0),
        }
    }

    #[test]
    fn the_deciding_reason_comes_first() {
        let mut s = story();
        assert_eq!(reasons(&s), [Reason::DueNow]);
        s.held_behind = Some(1);
        s.owner = None;
        let later = s.now + chrono::Duration::seconds(5);
        s.event.next_attempt_at = later;
        assert_eq!(
            reasons(&s),
            [
                Reason::WaitingForRetry { at: later },
                Reason::HeldBehind { id: 1 },
                Reason::Unowned { partition: 3 }
            ]
        );
        s.event.dead_at = Some(s.now);
        assert_eq!(reasons(&s), [Reason::Dead { since: s.now }]);
        s.event.published_at = Some(s.now);
        assert_eq!(reasons(&s), [Reason::Delivered { at: s.now }]);
    }
}
