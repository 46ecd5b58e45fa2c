//! SVG plots for the lab's HTML report, drawn with plotters' SVG backend
//! and its naive font (the browser picks the font; no font files are read),
//! on a blocking thread.

use anyhow::anyhow;
use plotters::prelude::*;

use crate::report::Plot;

/// How a series is drawn.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark {
    /// Points joined by a line (a CDF, a curve over sizes).
    Line,
    /// Points only (an attempt log).
    Points,
    /// A vertical rule at each point's x, across the whole chart (a fault
    /// on a timeline); the y values are ignored.
    Rules,
    /// A short tick at each point's x along the bottom (a frequent event on
    /// a timeline, which rules would bury the chart under).
    Ticks,
}

/// One named series of (x, y) points.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
    pub(crate) mark: Mark,
}

/// An x/y chart with a legend, as an `<svg>` element, drawn on a blocking
/// thread (it is CPU work).
pub(crate) async fn xy(
    title: &'static str,
    x_desc: &'static str,
    y_desc: &'static str,
    series: Vec<Series>,
) -> anyhow::Result<Plot> {
    tokio::task::spawn_blocking(move || draw(title, x_desc, y_desc, &series, (760, 380)))
        .await
        .map_err(|e| anyhow!("drawing a plot: {e}"))?
}

/// [`xy`] as a wide timeline, for marks (`Rules`, `Ticks`) over minutes.
pub(crate) async fn timeline(
    title: &'static str,
    y_desc: &'static str,
    series: Vec<Series>,
) -> anyhow::Result<Plot> {
    tokio::task::spawn_blocking(move || draw(title, "seconds", y_desc, &series, (1100, 440)))
        .await
        .map_err(|e| anyhow!("drawing a plot: {e}"))?
}

fn draw(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    size: (u32, u32),
) -> anyhow::Result<Plot> {
    let all = series
        .iter()
        .filter(|s| !matches!(s.mark, Mark::Rules | Mark::Ticks))
        .flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    // Some room around the points, and never an empty range.
    let pad = |lo: f64, hi: f64| {
        let span = (hi - lo).max(1e-9);
        (lo - span * 0.05, hi + span * 0.05)
    };
    let (x0, x1) = pad(x0.min(0.0), x1);
    let (y0, y1) = pad(y0.min(0.0), y1);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(plot_error)?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            match s.mark {
                Mark::Line => {
                    chart
                        .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                        .map_err(plot_error)?
                        .label(s.name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
                }
                Mark::Rules => {
                    chart
                        .draw_series(
                            s.points.iter().map(|&(x, _)| {
                                PathElement::new(vec![(x, y0), (x, y1)], color.stroke_width(1))
                            }),
                        )
                        .map_err(plot_error)?
                        .label(s.name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x + 8, y - 6), (x + 8, y + 6)], color));
                }
                Mark::Ticks => {
                    let top = y0 + (y1 - y0) * 0.04;
                    chart
                        .draw_series(
                            s.points.iter().map(|&(x, _)| {
                                PathElement::new(vec![(x, y0), (x, top)], color.stroke_width(2))
                            }),
                        )
                        .map_err(plot_error)?
                        .label(s.name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x + 8, y - 3), (x + 8, y + 3)], color));
                }
                Mark::Points => {
                    chart
                        .draw_series(s.points.iter().map(|&p| Circle::new(p, 5, color.filled())))
                        .map_err(plot_error)?
                        .label(s.name.as_str())
                        .legend(move |(x, y)| Circle::new((x + 8, y), 5, color.filled()));
                }
            }
        }
        // Where the series leave room: rising curves (CDFs, throughput)
        // leave the lower right free; the attempt log its middle.
        let legend = if series.iter().all(|s| matches!(s.mark, Mark::Points)) {
            SeriesLabelPosition::MiddleMiddle
        } else if series.iter().any(|s| matches!(s.mark, Mark::Rules | Mark::Ticks)) {
            SeriesLabelPosition::UpperRight
        } else {
            SeriesLabelPosition::LowerRight
        };
        chart
            .configure_series_labels()
            .position(legend)
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(Plot {
        title: title.to_owned(),
        svg,
    })
}

fn plot_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing a plot: {e}")
}
