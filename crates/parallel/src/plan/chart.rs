//! The memory chart: one stacked bar per layout (its fullest rank's parameters, gradients,
//! master weights, optimizer states, communication buffers, activations, and the backward's
//! workspace with the process around it) against a dashed line at the device's memory, as
//! SVG.
use plotters::prelude::*;

use super::search::Prediction;
use crate::ParallelError;

const GIB: f64 = (1u64 << 30) as f64;

/// Draws `preds` (at most the first 24) against `limit_bytes` into an SVG document.
pub fn memory_svg(
    preds: &[Prediction],
    limit_bytes: u64,
    title: &str,
) -> Result<String, ParallelError> {
    let preds = &preds[..preds.len().min(24)];
    let err = |e: String| ParallelError::Config(format!("chart: {e}"));
    crate::plot_font::register().map_err(err)?;
    let limit = limit_bytes as f64 / GIB;
    let top = preds
        .iter()
        .map(|p| p.resident as f64 / GIB)
        .fold(limit, f64::max)
        * 1.1;
    let mut svg = String::new();
    {
        let width = 220 + 60 * preds.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (width.max(640), 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(150)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..preds.len().max(1) as f64, 0f64..top)
            .map_err(|e| err(e.to_string()))?;
        let names: Vec<String> = preds.iter().map(|p| p.layout.to_string()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("layout (ranked by predicted tokens/s)")
            .y_desc("memory per device of the fullest rank (GiB)")
            .x_labels(preds.len().max(1))
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                names.get(i).cloned().unwrap_or_default()
            })
            .x_label_style(
                ("sans-serif", 10)
                    .into_font()
                    .transform(FontTransform::Rotate90),
            )
            .draw()
            .map_err(|e| err(e.to_string()))?;
        const PARTS: [(&str, RGBColor); 7] = [
            ("parameters", RGBColor(31, 119, 180)),
            ("gradients", RGBColor(255, 127, 14)),
            ("master weights", RGBColor(44, 160, 44)),
            ("optimizer states", RGBColor(214, 39, 40)),
            ("communication buffers", RGBColor(148, 103, 189)),
            ("activations", RGBColor(140, 86, 75)),
            ("workspace and process", RGBColor(127, 127, 127)),
        ];
        for (k, &(name, color)) in PARTS.iter().enumerate() {
            let bars = preds.iter().enumerate().map(|(i, p)| {
                let mut a = p.peak.to_array().to_vec();
                a.push(p.resident as i64 - p.peak.total() as i64);
                let below: f64 = a[..k].iter().sum::<i64>() as f64 / GIB;
                let h = a[k] as f64 / GIB;
                let x = i as f64;
                Rectangle::new([(x + 0.15, below), (x + 0.85, below + h)], color.filled())
            });
            chart
                .draw_series(bars)
                .map_err(|e| err(e.to_string()))?
                .label(name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, limit), (preds.len().max(1) as f64, limit)],
                6,
                4,
                BLACK.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label("device memory")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK.stroke_width(2)));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(svg)
}
