//! Metrics: one JSON object per line in `metrics.jsonl`, and the loss curve drawn as a PNG
//! (lines only: the bitmap backend has no font here) and an SVG (with axis labels and legend).
use crate::error::{IoContext, Result, TrainError};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// One logged step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss_scale: Option<f64>,
    /// The step was skipped (fp16 overflow).
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub skipped: bool,
    /// MoE: most tokens on one expert over the mean, the dropped share of assignments, and
    /// rank 0's wait for expert parallelism's all-to-alls (ms).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub expert_imbalance: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dropped_fraction: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub all_to_all_ms: Option<f64>,
    /// Bytes rank 0 sent over its data-parallel group in the step (with dp > 1).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dp_bytes_sent: Option<u64>,
}

/// Appends records to a JSONL file.
pub struct MetricsWriter {
    file: std::fs::File,
}

impl MetricsWriter {
    /// Opens `path` for appending (a resumed run continues the same file).
    pub fn append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .ctx(|| format!("opening {}", path.display()))?;
        Ok(Self { file })
    }

    /// Opens `path` to continue a run at `step` (0: a fresh run): rows of later steps (logged
    /// by a run that went on past the checkpoint resumed from, then failed) are dropped first,
    /// so every step appears once. The file is rewritten atomically (a temporary file renamed
    /// over it). A torn last line (a process killed mid-write) is dropped; any other
    /// unreadable line is an error.
    pub fn continue_at(path: &Path, step: usize) -> Result<Self> {
        if path.is_file() {
            let text =
                std::fs::read_to_string(path).ctx(|| format!("reading {}", path.display()))?;
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let mut kept = String::new();
            for (i, line) in lines.iter().enumerate() {
                match serde_json::from_str::<StepRecord>(line) {
                    Ok(r) if r.step <= step => {
                        kept.push_str(line);
                        kept.push('\n');
                    }
                    Ok(_) => {}
                    Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
                    Err(e) => {
                        return Err(TrainError::Data(format!(
                            "{} line {}: {e}",
                            path.display(),
                            i + 1
                        )))
                    }
                }
            }
            if kept != text {
                let tmp = path.with_extension("jsonl.tmp");
                std::fs::write(&tmp, &kept).ctx(|| format!("writing {}", tmp.display()))?;
                std::fs::rename(&tmp, path).ctx(|| format!("replacing {}", path.display()))?;
            }
        }
        Self::append(path)
    }

    pub fn write(&mut self, r: &StepRecord) -> Result<()> {
        let line = serde_json::to_string(r).expect("record serialises");
        writeln!(self.file, "{line}").ctx(|| "writing metrics".into())
    }
}

/// Reads a metrics file back.
pub fn read(path: &Path) -> Result<Vec<StepRecord>> {
    let text = std::fs::read_to_string(path).ctx(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))
        })
        .collect()
}

/// Draws training and validation loss against step into `png` and `svg`.
pub fn plot_loss(records: &[StepRecord], png: &Path, svg: &Path) -> Result<()> {
    use plotters::prelude::*;
    let train: Vec<(f64, f64)> = records
        .iter()
        .filter(|r| r.loss.is_finite())
        .map(|r| (r.step as f64, r.loss))
        .collect();
    let val: Vec<(f64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step as f64, v)))
        .collect();
    if train.is_empty() {
        return Ok(());
    }
    let x_max = train.iter().chain(&val).map(|p| p.0).fold(1.0, f64::max);
    let y_max = train.iter().chain(&val).map(|p| p.1).fold(0.0, f64::max) * 1.05;
    fn draw<DB: DrawingBackend>(
        root: DrawingArea<DB, plotters::coord::Shift>,
        labels: bool,
        train: &[(f64, f64)],
        val: &[(f64, f64)],
        x_max: f64,
        y_max: f64,
    ) -> std::result::Result<(), String>
    where
        DB::ErrorType: 'static,
    {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let mut b = ChartBuilder::on(&root);
        b.margin(20);
        if labels {
            b.caption("loss", ("sans-serif", 20))
                .x_label_area_size(40)
                .y_label_area_size(50);
        }
        let mut chart = b.build_cartesian_2d(0.0..x_max, 0.0..y_max).map_err(e)?;
        let mut mesh = chart.configure_mesh();
        if labels {
            mesh.x_desc("step").y_desc("loss (nats/token)");
        } else {
            mesh.disable_x_mesh()
                .disable_y_mesh()
                .x_labels(0)
                .y_labels(0);
        }
        mesh.draw().map_err(e)?;
        let s = chart
            .draw_series(LineSeries::new(train.iter().copied(), &BLUE))
            .map_err(e)?;
        if labels {
            s.label("train")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        }
        if !val.is_empty() {
            let s = chart
                .draw_series(LineSeries::new(val.iter().copied(), RED.stroke_width(2)))
                .map_err(e)?;
            if labels {
                s.label("validation")
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
            }
        }
        if labels {
            chart
                .configure_series_labels()
                .background_style(WHITE)
                .border_style(BLACK)
                .draw()
                .map_err(e)?;
        }
        root.present().map_err(e)
    }
    let fail = |p: &Path, e: String| TrainError::Io {
        context: format!("plotting {}", p.display()),
        source: std::io::Error::other(e),
    };
    draw(
        BitMapBackend::new(png, (800, 500)).into_drawing_area(),
        false,
        &train,
        &val,
        x_max,
        y_max,
    )
    .map_err(|e| fail(png, e))?;
    draw(
        SVGBackend::new(svg, (800, 500)).into_drawing_area(),
        true,
        &train,
        &val,
        x_max,
        y_max,
    )
    .map_err(|e| fail(svg, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_round_trip_and_plot() {
        let d = std::env::temp_dir().join(format!("xtrain-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("metrics.jsonl");
        let _ = std::fs::remove_file(&p);
        let mut w = MetricsWriter::append(&p).unwrap();
        let recs: Vec<StepRecord> = (0..20)
            .map(|s| StepRecord {
                step: s,
                loss: 5.0 - 0.25 * s as f64,
                lr: 1e-3,
                val_loss: (s % 5 == 0).then_some(4.0),
                ..Default::default()
            })
            .collect();
        for r in &recs {
            w.write(r).unwrap();
        }
        assert_eq!(read(&p).unwrap(), recs);
        plot_loss(&recs, &d.join("loss.png"), &d.join("loss.svg")).unwrap();
        let png = std::fs::read(d.join("loss.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(std::fs::read_to_string(d.join("loss.svg"))
            .unwrap()
            .contains("validation"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn continuing_drops_the_rows_after_the_resumed_step_and_a_torn_line() {
        let d = std::env::temp_dir().join(format!("xtrain-metrics-cont-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("metrics.jsonl");
        let row = |s: usize| {
            serde_json::to_string(&StepRecord {
                step: s,
                loss: s as f64,
                ..Default::default()
            })
            .unwrap()
        };
        // Steps 1-4 logged, then a torn fifth line (killed mid-write).
        let text: String = (1..=4).map(|s| row(s) + "\n").collect::<String>() + "{\"step\":5,\"lo";
        std::fs::write(&p, &text).unwrap();
        let mut w = MetricsWriter::continue_at(&p, 2).unwrap();
        w.write(&StepRecord {
            step: 3,
            loss: 30.0,
            ..Default::default()
        })
        .unwrap();
        drop(w);
        let steps: Vec<(usize, f64)> = read(&p).unwrap().iter().map(|r| (r.step, r.loss)).collect();
        assert_eq!(steps, [(1, 1.0), (2, 2.0), (3, 30.0)]);
        // A fresh run (step 0) starts an empty file; a corrupt line in the middle is an error.
        drop(MetricsWriter::continue_at(&p, 0).unwrap());
        assert!(read(&p).unwrap().is_empty());
        std::fs::write(&p, format!("{}\nnot json\n{}\n", row(1), row(2))).unwrap();
        let e = MetricsWriter::continue_at(&p, 2).err().unwrap().to_string();
        assert!(e.contains("line 2"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
