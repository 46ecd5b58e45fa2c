//! `GET /`: the backlog and its oldest age per aggregate type, events
//! delivered per minute over the last hour from the relays' rollup (or,
//! when no relay writes one, published per 10 s over the last ten minutes,
//! by `published_at`), dead letters per aggregate type and
//! error, and the live relays with the partitions each holds; what keeps
//! vacuum from cleaning the table (dead tuples, the oldest holder of the
//! xmin horizon); with log tailing set up, the replication slot's retained
//! WAL and lag.

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::auth::Access;
use crate::view::{self, Failure};

/// The chart's buckets: 60 of 10 s, the last ten minutes.
pub(crate) const THROUGHPUT: outbox::sql::Throughput = outbox::sql::Throughput {
    bucket_seconds: 10.0,
    buckets: 60,
};

/// The chart's span when it is drawn from the relays' rollup.
const ROLLUP_MINUTES: i64 = 60;

/// The rollup's rows summed over routes, one count per minute, newest
/// first (as `OutboxSql::throughput` returns its buckets).
fn per_minute(rows: &[outbox::sql::RollupRow], now: chrono::DateTime<chrono::Utc>) -> Vec<i64> {
    let mut counts = vec![0; ROLLUP_MINUTES as usize];
    for r in rows {
        if let Some(ago) = crate::routes::minutes_ago(now, r.minute, ROLLUP_MINUTES) {
            counts[ago] += r.delivered;
        }
    }
    counts
}

/// A relay silent for longer than this is flagged: the relays' default
/// `--lease-timeout` (past it the others take its partitions over).
const SILENT_SECONDS: f64 = 10.0;

pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let paused = crate::form::Params::query(raw.as_deref()).get("live") == Some("0");
    let fail = |what: &str| {
        let what = what.to_owned();
        move |e| Failure(what, e)
    };
    let client = state
        .db
        .client()
        .await
        .map_err(fail("connecting to PostgreSQL"))?;
    let sql = &state.sql;
    let now = chrono::Utc::now();
    let stats = sql.stats(&*client).await.map_err(fail("reading the backlog"))?;
    // The relays' rollup when they write one: a few rows, where counting
    // `published_at` reads the whole table, every refresh.
    let rolled = match &state.routes {
        Some(routes) => routes
            .rollup(&*client, now - chrono::Duration::minutes(ROLLUP_MINUTES))
            .await
            .map_err(fail("reading the relays' rollup"))?,
        None => Vec::new(),
    };
    let throughput = if rolled.is_empty() {
        sql.throughput(&*client, &THROUGHPUT)
            .await
            .map_err(fail("reading the throughput"))?
    } else {
        per_minute(&rolled, now)
    };
    let dead = sql
        .dead_by_error(&*client, 50)
        .await
        .map_err(fail("reading the dead letters"))?;
    let relays = sql.relays(&*client).await.map_err(fail("reading the relays"))?;
    let partitions = sql
        .partition_backlog(&*client)
        .await
        .map_err(fail("reading the partition backlog"))?;
    let slot = outbox::wal::slot_state(&*client, &state.outbox)
        .await
        .map_err(fail("reading the replication slot"))?;
    let dead_tuples = sql
        .dead_tuples(&*client)
        .await
        .map_err(fail("reading dead tuples"))?;
    let holders = sql
        .xmin_holders(&*client)
        .await
        .map_err(fail("reading who holds the xmin horizon"))?;
    // A transaction older than this is flagged: vacuum has been held back
    // as long as the example alert's threshold.
    let held_long = |h: &outbox::sql::HorizonHolder| {
        h.age_seconds
            .is_some_and(|a| a >= outbox_relay::HORIZON_WARN.as_secs_f64())
    };

    let backlog: i64 = stats.iter().map(|s| s.unpublished).sum();
    let dead_total: i64 = stats.iter().map(|s| s.dead_letters).sum();
    let oldest = stats.iter().filter_map(|s| s.oldest_unpublished).min();
    let published: i64 = throughput.iter().sum();
    let (span, bucket, counted) = if rolled.is_empty() {
        (
            f64::from(THROUGHPUT.buckets) * THROUGHPUT.bucket_seconds,
            THROUGHPUT.bucket_seconds,
            "published (counted by published_at, which outbox cleanup removes)",
        )
    } else {
        (
            ROLLUP_MINUTES as f64 * 60.0,
            60.0,
            "delivered (the relays' rollup: every route, per minute)",
        )
    };
    let backlog_of = |held: &[i32]| -> i64 {
        held.iter()
            .filter_map(|p| partitions.get(usize::try_from(*p).ok()?))
            .map(|p| p.backlog)
            .sum()
    };
    let unowned: Vec<i32> = partitions
        .iter()
        .filter(|p| p.owner.is_none_or(|o| !relays.iter().any(|r| r.relay_id == o)))
        .map(|p| p.partition)
        .collect();

    let body = html! {
        section.card {
            p.verdict {
                "Backlog: " span #backlog-total { (backlog) } " events waiting"
                @if let Some(oldest) = oldest { ", oldest " (view::relative(oldest, now)) }
                " · dead letters: " span #dead-total { (dead_total) }
                " · live relays: " span #relay-count { (relays.len()) }
            }
            @if let Some(slot) = &slot {
                p #wal-slot { "Log tailing: " (slot) }
            }
            p #vacuum {
                "Dead tuples: " span #dead-tuples { (dead_tuples) }
                " · xmin horizon: "
                @if holders.is_empty() { "not held" }
                @for (i, h) in holders.iter().enumerate() {
                    @if i > 0 { "; " }
                    @if held_long(h) { span.error { "held by " (h) } } @else { "held by " (h) }
                }
            }
        }
        h2 { "Backlog per aggregate type" }
        @if stats.is_empty() {
            p.muted { "Nothing unpublished." }
        } @else {
            table #backlog {
                thead { tr {
                    th { "aggregate type" } th.num { "waiting" } th { "oldest waiting" }
                    th.num { "dead letters" } th.num { "given up" } th.num { "aggregates blocked" }
                } }
                tbody {
                    @for s in &stats {
                        tr {
                            td { (s.aggregate_type) }
                            td.num { (s.unpublished) }
                            td { @if let Some(t) = s.oldest_unpublished { (view::relative(t, now)) } @else { "–" } }
                            td.num {
                                @if s.dead_letters > 0 {
                                    a href=(state.frame.href(&format!("/dead?{}", query(&[("aggregate_type", &s.aggregate_type)])))) { (s.dead_letters) }
                                } @else { "0" }
                            }
                            td.num { (s.given_up) }
                            td.num { (s.blocked_aggregates) }
                        }
                    }
                }
            }
        }
        h2 { "Delivered, last " (view::duration(span)) }
        p.muted #throughput-source { (published) " events " (counted) }
        (crate::chart::throughput(&throughput, bucket))
        h2 { "Dead letters per aggregate type and error" }
        @if dead.is_empty() {
            p.muted { "No dead letters waiting for a decision." }
        } @else {
            table #dead-by-error {
                thead { tr { th { "aggregate type" } th { "last error" } th.num { "dead letters" } } }
                tbody {
                    @for d in &dead {
                        tr {
                            td { (d.aggregate_type) }
                            td.error { (d.last_error) }
                            td.num {
                                a href=(state.frame.href(&format!("/dead?{}", query(&[("aggregate_type", &d.aggregate_type), ("error", &d.last_error)])))) { (d.count) }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Relays" }
        table #relays {
            thead { tr {
                th { "name" } th { "relay id" } th { "started" } th { "heartbeat" }
                th.num { "partitions held" } th { "which" } th.num { "backlog" }
            } }
            tbody {
                @for r in &relays {
                    tr {
                        td { (r.name) }
                        td.mono { (r.relay_id) }
                        td { (view::relative(r.started_at, now)) }
                        td {
                            (view::duration(r.silent_for_seconds)) " ago"
                            @if r.silent_for_seconds > SILENT_SECONDS { " " span.error { "(silent)" } }
                        }
                        td.num { (r.partitions.len()) }
                        td.mono { (outbox::sql::partition_ranges(&r.partitions)) }
                        td.num { (backlog_of(&r.partitions)) }
                    }
                }
                @if !unowned.is_empty() {
                    tr {
                        td.error { "(no live relay)" } td {} td {} td {}
                        td.num { (unowned.len()) }
                        td.mono { (outbox::sql::partition_ranges(&unowned)) }
                        td.num { (backlog_of(&unowned)) }
                    }
                }
            }
        }
        p.muted { (partitions.len()) " partitions." }
    };
    Ok(view::live_layout("Overview", &access, &state.frame, "/", paused, body).into_response())
}

/// A query string, percent-encoded.
pub(crate) fn query(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}
