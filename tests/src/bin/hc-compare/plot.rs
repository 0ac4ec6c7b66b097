//! One SVG per scenario: p99 (solid) and p50 (thin) latency over time per
//! balancer, the fault marked, and the huddle's rotations marked, so a
//! reader sees the slow backend leave and return.

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

pub struct Line<'a> {
    pub name: &'a str,
    /// (time s, p50 ms, p99 ms)
    pub points: &'a [(f64, f64, f64)],
}

const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws `lines` with the fault at `fault_s` (if any) and `events`
/// (time, label) of the huddle.
pub fn draw(
    path: &Path,
    title: &str,
    secs: f64,
    lines: &[Line<'_>],
    fault_s: Option<f64>,
    events: &[(f64, String)],
) -> Result<()> {
    let e = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let top = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.2))
        .fold(10.0f64, f64::max)
        * 1.5;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..secs, (1f64..top).log_scale())
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("time since the load started (s)")
        .y_desc("latency, ms (log): p99 thick, p50 thin")
        .draw()
        .map_err(|x| e(&x))?;
    if let Some(f) = fault_s {
        chart
            .draw_series(LineSeries::new(
                vec![(f, 1.0), (f, top)],
                BLACK.stroke_width(1),
            ))
            .map_err(|x| e(&x))?
            .label("fault starts")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    for (t, label) in events {
        let c = COLORS[0].mix(0.35);
        chart
            .draw_series(LineSeries::new(
                vec![(*t, 1.0), (*t, top)],
                c.stroke_width(1),
            ))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(std::iter::once(Text::new(
                label.clone(),
                (*t, top / 1.3),
                ("sans-serif", 12).into_font().color(&COLORS[0]),
            )))
            .map_err(|x| e(&x))?;
    }
    for (i, l) in lines.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                l.points.iter().map(|p| (p.0, p.2.max(1.0))),
                c.stroke_width(3),
            ))
            .map_err(|x| e(&x))?
            .label(l.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart
            .draw_series(LineSeries::new(
                l.points.iter().map(|p| (p.0, p.1.max(1.0))),
                c.stroke_width(1),
            ))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
