//! Drawing a simulated schedule: a compact text timeline for the terminal (one row per rank,
//! each action a cell as wide as its cost, idle time as dots) and an SVG picture (one row per
//! rank, a colour per action kind, the micro-batch number in each box, labelled axes).
use std::fmt::Write;

use super::action::Action;
use super::simulate::Simulation;

/// The letter of a compute action's kind (F, I, W, B; an overlapped pair is `X`).
fn letter(a: &Action) -> char {
    match a {
        Action::Forward { .. } => 'F',
        Action::BackwardInput { .. } => 'I',
        Action::BackwardWeight { .. } => 'W',
        Action::Backward { .. } => 'B',
        _ => 'X',
    }
}

/// The label inside an action's box: the kind and micro-batch (`F3`), the pair's two
/// micro-batches (`3|1`), with the stage when a rank runs several (`F3.5` is stage 5).
fn label(a: &Action, with_stage: bool) -> String {
    match *a {
        Action::ForwardBackward { f_mb, b_mb, .. } => format!("{f_mb}|{b_mb}"),
        _ => {
            let mb = a.microbatch().unwrap_or(0);
            match (with_stage, a.stage()) {
                (true, Some(s)) => format!("{}{mb}.{s}", letter(a)),
                _ => format!("{}{mb}", letter(a)),
            }
        }
    }
}

/// The timeline as text: `chars` characters per unit of cost.
pub fn text(sim: &Simulation, ranks: usize, chars: f64, with_stage: bool) -> String {
    let mut out = String::new();
    for r in 0..ranks {
        let mut line = String::new();
        let mut at = 0.0;
        for slot in sim.slots.iter().filter(|s| s.rank == r) {
            let gap = ((slot.start - at) * chars).round() as usize;
            line.extend(std::iter::repeat_n('.', gap));
            let width = (((slot.end - slot.start) * chars).round() as usize).max(1);
            let mut cell = label(&slot.action, with_stage);
            cell.truncate(width.saturating_sub(1).max(1));
            let _ = write!(line, "{cell:<w$}", w = width - 1);
            line.push(if width > 1 { '|' } else { ' ' });
            at = slot.end;
        }
        let gap = ((sim.makespan - at) * chars).round() as usize;
        line.extend(std::iter::repeat_n('.', gap));
        let _ = writeln!(out, "rank {r:>2} {line}");
    }
    out
}

/// The timeline as an SVG picture (`title` on top).
pub fn svg(
    sim: &Simulation,
    ranks: usize,
    title: &str,
    with_stage: bool,
) -> Result<String, String> {
    use plotters::prelude::*;
    crate::plot_font::register()?;
    let mut buf = String::new();
    {
        let width = 1200u32;
        let height = (120 + 40 * ranks as u32).max(200);
        let root = SVGBackend::with_string(&mut buf, (width, height)).into_drawing_area();
        fn e<E: std::fmt::Display>(err: E) -> String {
            err.to_string()
        }
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..sim.makespan.max(1e-9), -0.5..ranks as f64 - 0.5)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("time (cost units)")
            .y_desc("pp rank")
            .y_labels(ranks)
            .y_label_formatter(&|y| format!("{:.0}", y))
            .disable_y_mesh()
            .draw()
            .map_err(e)?;
        let colour = |a: &Action| match letter(a) {
            'F' => RGBColor(86, 140, 214),
            'I' => RGBColor(96, 180, 120),
            'W' => RGBColor(235, 164, 72),
            'B' => RGBColor(70, 150, 150),
            _ => RGBColor(150, 110, 190),
        };
        for slot in &sim.slots {
            let y = slot.rank as f64;
            let c = colour(&slot.action);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(slot.start, y - 0.4), (slot.end, y + 0.4)],
                    c.filled(),
                )))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(slot.start, y - 0.4), (slot.end, y + 0.4)],
                    BLACK.stroke_width(1),
                )))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    label(&slot.action, with_stage),
                    ((slot.start + slot.end) / 2.0, y),
                    ("sans-serif", 11).into_font().color(&BLACK).pos(
                        plotters::style::text_anchor::Pos::new(
                            plotters::style::text_anchor::HPos::Center,
                            plotters::style::text_anchor::VPos::Center,
                        ),
                    ),
                )))
                .map_err(e)?;
        }
        root.present().map_err(e)?;
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline_parallel::{generate, simulate, Costs, ScheduleKind};

    #[test]
    fn text_and_svg_show_every_action() {
        let s = generate(ScheduleKind::OneFOneB, 2, 3, 1).unwrap();
        let sim = simulate(&s, &Costs::default()).unwrap();
        let t = text(&sim, 2, 3.0, false);
        // Rank 1 starts after one forward of rank 0: one unit of dots.
        assert!(t.contains("rank  1 ...F0"), "{t}");
        assert_eq!(t.matches("F").count(), 6, "{t}");
        let svg = svg(&sim, 2, "1f1b", false).unwrap();
        assert!(svg.contains("<svg") && svg.contains("pp rank") && svg.contains("B2"));
    }
}
