//! The one report renderer of the lab and the bench: the statistics they
//! report (nearest-rank percentiles, `median [min–max]` spreads), text
//! tables (the lab's ruled ones and the bench's fixed columns, through one
//! line renderer, both from a [`Table`]), and for the lab its [`Outcome`]s: the table `measure |
//! ours | reference | verdict`, extra tables (logs) and plots (drawn by
//! `plot.rs`), as text, JSON and one self-contained HTML file. The bench's
//! figures and their check are in `bench/results.rs`.
//!
//! Only [`Verdict::Fail`] changes the lab's exit code. Timings get
//! [`Verdict::Timing`]: reported, never judged.

use std::fmt::Write as _;

use serde::Serialize;

/// Nearest-rank percentile of sorted values.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median, minimum and maximum of one figure over the repetitions.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Spread {
    pub(crate) fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut values: Vec<f64> = values.into_iter().collect();
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        let median = if values.len() % 2 == 1 {
            values[mid]
        } else {
            (values[mid - 1] + values[mid]) / 2.0
        };
        Self {
            median,
            min: values[0],
            max: values[values.len() - 1],
        }
    }

    /// `median [min–max]` with `decimals` digits.
    pub(crate) fn show(&self, decimals: usize) -> String {
        format!(
            "{:.d$} [{:.d$}–{:.d$}]",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

/// A column of a text table: its width, and which side its cells keep to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Col {
    Left(usize),
    Right(usize),
}

/// One line of a text table: each cell padded to its column, joined by
/// `sep`.
pub(crate) fn line<S: AsRef<str>>(cols: &[Col], cells: &[S], sep: &str) -> String {
    let padded: Vec<String> = cells
        .iter()
        .zip(cols)
        .map(|(c, col)| {
            let c = c.as_ref();
            match *col {
                Col::Left(w) => format!("{c:<w$}"),
                Col::Right(w) => format!("{c:>w$}"),
            }
        })
        .collect();
    padded.join(sep)
}

/// How a measured figure is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Verdict {
    /// A correctness property of ours held.
    Pass,
    /// A correctness property of ours failed: the lab exits 1.
    Fail,
    /// The naive variant broke the way the reference says it does.
    Reproduced,
    /// The naive variant did not break this time (not our failure).
    NotReproduced,
    /// A timing or size: reported, never judged.
    Timing,
}

impl Verdict {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "ok",
            Verdict::Fail => "FAIL",
            Verdict::Reproduced => "naive breaks, as in the reference",
            Verdict::NotReproduced => "naive did not break this run",
            Verdict::Timing => "reported",
        }
    }

    /// `Pass` when `holds`, else `Fail`.
    pub(crate) fn check(holds: bool) -> Self {
        if holds { Verdict::Pass } else { Verdict::Fail }
    }

    /// `Reproduced` when the naive variant broke.
    pub(crate) fn naive(broke: bool) -> Self {
        if broke {
            Verdict::Reproduced
        } else {
            Verdict::NotReproduced
        }
    }
}

/// One line of an experiment's main table.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) measure: String,
    pub(crate) ours: String,
    pub(crate) reference: String,
    pub(crate) verdict: Verdict,
}

/// A table beside the verdicts (an attempt log, a plan summary), or one of
/// the bench's.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Table {
    pub(crate) title: String,
    pub(crate) header: Vec<String>,
    pub(crate) rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table under `title` with these column names (none: no
    /// header line).
    pub(crate) fn new(title: impl Into<String>, header: &[&str]) -> Self {
        Self {
            title: title.into(),
            header: header.iter().map(|&h| h.to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// The bench's style: a blank line, the title, then the header and the
    /// rows in fixed `cols` joined by one space.
    pub(crate) fn print_fixed(&self, cols: &[Col]) {
        println!("\n{}", self.title);
        if !self.header.is_empty() {
            println!("{}", line(cols, &self.header, " "));
        }
        for row in &self.rows {
            println!("{}", line(cols, row, " "));
        }
    }
}

/// A plot, rendered to SVG by `plot.rs`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Plot {
    pub(crate) title: String,
    #[serde(skip)]
    pub(crate) svg: String,
}

/// What one experiment found.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Outcome {
    pub(crate) name: &'static str,
    pub(crate) title: &'static str,
    /// What it breaks and what it shows.
    pub(crate) story: &'static str,
    /// The setup, with this run's sizes.
    pub(crate) setup: String,
    pub(crate) rows: Vec<Row>,
    pub(crate) tables: Vec<Table>,
    pub(crate) plots: Vec<Plot>,
    pub(crate) seconds: f64,
}

impl Outcome {
    pub(crate) fn new(name: &'static str, title: &'static str, story: &'static str, setup: String) -> Self {
        Self {
            name,
            title,
            story,
            setup,
            rows: Vec::new(),
            tables: Vec::new(),
            plots: Vec::new(),
            seconds: 0.0,
        }
    }

    pub(crate) fn row(
        &mut self,
        measure: impl Into<String>,
        ours: impl ToString,
        reference: impl Into<String>,
        verdict: Verdict,
    ) {
        self.rows.push(Row {
            measure: measure.into(),
            ours: ours.to_string(),
            reference: reference.into(),
            verdict,
        });
    }

    pub(crate) fn failed(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.verdict == Verdict::Fail)
    }

    /// The experiment as text: title, setup, table, extra tables.
    pub(crate) fn print(&self) {
        println!("\n== {} ({}) — {:.1} s", self.title, self.name, self.seconds);
        println!("{}", self.setup);
        let header = ["measure", "ours", "reference", "verdict"].map(str::to_owned);
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    r.measure.clone(),
                    r.ours.clone(),
                    r.reference.clone(),
                    r.verdict.label().to_owned(),
                ]
            })
            .collect();
        print_table(&header, &rows);
        for t in &self.tables {
            println!("\n{}", t.title);
            print_table(&t.header, &t.rows);
        }
    }
}

/// The lab's ruled table: columns as wide as their widest cell, ` | `
/// between them, a rule under the header.
fn print_table(header: &[String], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let cols: Vec<Col> = widths.iter().map(|&w| Col::Left(w)).collect();
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    println!("  {}", line(&cols, header, " | ").trim_end());
    println!("  {}", rule.join("-+-"));
    for row in rows {
        println!("  {}", line(&cols, row, " | ").trim_end());
    }
}

/// Escapes text for HTML element content and attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem;color:#222}\
table{border-collapse:collapse;margin:0.8rem 0}th,td{border:1px solid #bbb;padding:0.25rem 0.6rem;text-align:left;vertical-align:top}\
th{background:#eee}td.pass{background:#dfd}td.fail{background:#fbb;font-weight:bold}td.reproduced{background:#ffd}\
td.not_reproduced{background:#eef}td.timing{color:#555}section{border-top:2px solid #ccc;margin-top:2rem}\
p.setup{font-family:monospace;white-space:pre-wrap;background:#f6f6f6;padding:0.5rem}figure{margin:1rem 0}";

/// One self-contained page: no script, no external resource. Written as
/// XHTML-compatible HTML (every element closed, every text escaped) so an
/// XML parser can check it. A summary table leads when there are several
/// outcomes.
pub(crate) fn html(title: &str, outcomes: &[Outcome], context: &str) -> String {
    let mut h = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n\
         <meta charset=\"utf-8\"/>\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>{}</h1>\n<p>{}</p>\n",
        escape(title),
        escape(title),
        escape(context)
    );
    if outcomes.len() > 1 {
        summary(&mut h, outcomes);
    }
    for o in outcomes {
        let _ = write!(
            h,
            "<section id=\"{}\">\n<h2>{} <small>({}, {:.1} s)</small></h2>\n<p>{}</p>\n<p class=\"setup\">{}</p>\n",
            escape(o.name),
            escape(o.title),
            escape(o.name),
            o.seconds,
            escape(o.story),
            escape(&o.setup)
        );
        h.push_str("<table class=\"verdicts\"><thead><tr><th>measure</th><th>ours</th><th>reference</th><th>verdict</th></tr></thead><tbody>\n");
        for r in &o.rows {
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td>{}</tr>",
                escape(&r.measure),
                escape(&r.ours),
                escape(&r.reference),
                verdict_cell(r.verdict)
            );
        }
        h.push_str("</tbody></table>\n");
        for t in &o.tables {
            let _ = write!(
                h,
                "<h3>{}</h3>\n<table class=\"log\"><thead><tr>",
                escape(&t.title)
            );
            for c in &t.header {
                let _ = write!(h, "<th>{}</th>", escape(c));
            }
            h.push_str("</tr></thead><tbody>\n");
            for row in &t.rows {
                h.push_str("<tr>");
                for c in row {
                    let _ = write!(h, "<td>{}</td>", escape(c));
                }
                h.push_str("</tr>\n");
            }
            h.push_str("</tbody></table>\n");
        }
        for p in &o.plots {
            let _ = write!(
                h,
                "<figure class=\"plot\">\n{}\n<figcaption>{}</figcaption>\n</figure>\n",
                p.svg,
                escape(&p.title)
            );
        }
        h.push_str("</section>\n");
    }
    h.push_str("</body>\n</html>\n");
    h
}

/// The summary table: every outcome's rows, each linked to its section.
fn summary(h: &mut String, outcomes: &[Outcome]) {
    h.push_str("<h2>Summary</h2>\n<table class=\"summary\"><thead><tr><th>experiment</th><th>measure</th><th>ours</th><th>reference</th><th>verdict</th></tr></thead><tbody>\n");
    for o in outcomes {
        for r in &o.rows {
            let _ = writeln!(
                h,
                "<tr><td><a href=\"#{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td>{}</tr>",
                escape(o.name),
                escape(o.name),
                escape(&r.measure),
                escape(&r.ours),
                escape(&r.reference),
                verdict_cell(r.verdict)
            );
        }
    }
    h.push_str("</tbody></table>\n");
}

fn verdict_cell(v: Verdict) -> String {
    let class = match v {
        Verdict::Pass => "pass",
        Verdict::Fail => "fail",
        Verdict::Reproduced => "reproduced",
        Verdict::NotReproduced => "not_reproduced",
        Verdict::Timing => "timing",
    };
    format!("<td class=\"{class}\">{}</td>", escape(v.label()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn spread_and_columns() {
        let s = Spread::of([3.0, 1.0, 2.0, 10.0]);
        assert_eq!(s.show(1), "2.5 [1.0–10.0]");
        let cols = [Col::Left(4), Col::Right(3)];
        assert_eq!(line(&cols, &["ab", "c"], " "), "ab     c");
        assert_eq!(line(&cols, &["ab", "c"], " | "), "ab   |   c");
    }

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn html_escapes_every_text() {
        let mut o = Outcome::new("x", "<t>", "s&s", "setup <b>".to_owned());
        o.row("m<", "1", "r>", Verdict::Pass);
        let page = html("outbox-lab lab", &[o], "ctx\"");
        assert!(!page.contains("<t>") && !page.contains("<b>") && !page.contains("m<"));
        assert!(page.contains("&lt;t&gt;") && page.contains("s&amp;s"));
    }
}
