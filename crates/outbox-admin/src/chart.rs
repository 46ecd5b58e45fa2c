//! Bar charts (the overview's throughput, the routes' deliveries and
//! failures per minute): one bar per bucket, drawn by the server as inline
//! SVG (no script, no image request). Sizes go in SVG attributes, not
//! `style`, which the Content-Security-Policy forbids inline.

use maud::{Markup, html};

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 140.0;
/// Room for the labels under the bars.
const AXIS: f64 = 18.0;

/// Bars of `counts` (most recent first, as `OutboxSql::throughput` returns
/// them), oldest on the left; `bucket_seconds` wide each.
pub(crate) fn throughput(counts: &[i64], bucket_seconds: f64) -> Markup {
    series("throughput", "published", counts, bucket_seconds)
}

/// Bars of `counts` (most recent first), labelled `what` (`delivered`),
/// as the SVG element `id`.
pub(crate) fn series(id: &str, what: &str, counts: &[i64], bucket_seconds: f64) -> Markup {
    let max = counts.iter().copied().max().unwrap_or(0).max(1);
    let n = counts.len().max(1) as f64;
    let slot = WIDTH / n;
    let plot = HEIGHT - AXIS;
    let span = crate::view::duration(bucket_seconds * n);
    html! {
        svg.chart #(id) xmlns="http://www.w3.org/2000/svg" viewBox=(format!("0 0 {WIDTH} {HEIGHT}"))
            role="img" aria-label=(format!("events {what} per {bucket_seconds} s over the last {span}")) {
            line.axis x1="0" y1=(plot) x2=(WIDTH) y2=(plot) {}
            @for (i, count) in counts.iter().rev().enumerate() {
                @let h = (*count as f64 / max as f64 * (plot - 4.0)).max(if *count > 0 { 1.0 } else { 0.0 });
                @let ago = (counts.len() - i) as f64 * bucket_seconds;
                rect.bar x=(format!("{:.1}", i as f64 * slot + 1.0)) y=(format!("{:.1}", plot - h))
                    width=(format!("{:.1}", (slot - 2.0).max(1.0))) height=(format!("{h:.1}")) {
                    title { (count) " " (what) " " (crate::view::duration(ago)) " to " (crate::view::duration(ago - bucket_seconds)) " ago" }
                }
            }
            text.label x="0" y=(HEIGHT - 4.0) { (span) " ago" }
            text.label x=(WIDTH) y=(HEIGHT - 4.0) text-anchor="end" { "now" }
            // Top left: the newest bars, on the right, would cover it.
            text.label x="4" y="12" { "max " (max) " per " (bucket_seconds) " s" }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_bar_per_bucket_oldest_left() {
        let svg = super::throughput(&[5, 0, 10], 10.0).into_string();
        assert_eq!(svg.matches("<rect").count(), 3);
        let first = svg.find("10 published").unwrap();
        let last = svg.find("5 published").unwrap();
        assert!(first < last, "{svg}");
        assert!(!svg.contains("style="), "{svg}");
    }
}
