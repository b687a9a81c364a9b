//! Metrics: one JSON object per line in `metrics.jsonl`, and the loss curve drawn as a PNG and
//! an SVG (axes, tick labels, axis titles and a legend). The PNG's text is rasterised from a
//! font compiled into the binary (`parallel::plot_font`, DejaVu Sans), so it renders on a machine
//! without system fonts.
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
    /// NaN where the device's peak is unknown: written as JSON's `null`, read back as NaN.
    #[serde(deserialize_with = "null_as_nan")]
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

/// A number, or `null` (how serde_json writes a NaN) as NaN.
fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
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

/// Registers the bundled chart font ([`parallel::plot_font`]).
fn register_font() -> Result<()> {
    parallel::plot_font::register().map_err(TrainError::Data)
}

/// Draws training and validation loss against step into `png` and `svg`.
pub fn plot_loss(records: &[StepRecord], png: &Path, svg: &Path) -> Result<()> {
    let fail = |p: &Path, e: String| TrainError::Io {
        context: format!("plotting {}", p.display()),
        source: std::io::Error::other(e),
    };
    let Some(curves) = Curves::new(records) else {
        return Ok(());
    };
    register_font()?;
    use plotters::prelude::*;
    curves
        .draw(BitMapBackend::new(png, SIZE).into_drawing_area(), true)
        .map_err(|e| fail(png, e))?;
    curves
        .draw(SVGBackend::new(svg, SIZE).into_drawing_area(), true)
        .map_err(|e| fail(svg, e))
}

/// Width and height of the plots in pixels.
const SIZE: (u32, u32) = (800, 500);

/// The loss curve as RGB pixels (row-major, `SIZE`), with or without its text and legend.
#[cfg(test)]
fn render_rgb(records: &[StepRecord], labels: bool) -> Vec<u8> {
    use plotters::prelude::IntoDrawingArea;
    let mut buf = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    register_font().unwrap();
    let area = plotters::prelude::BitMapBackend::with_buffer(&mut buf, SIZE);
    let curves = Curves::new(records).unwrap();
    curves.draw(area.into_drawing_area(), labels).unwrap();
    buf
}

/// The points of the loss plot and its axis ranges.
struct Curves {
    train: Vec<(f64, f64)>,
    val: Vec<(f64, f64)>,
    x_max: f64,
    y_max: f64,
}

impl Curves {
    /// `None` when there is no finite training loss to draw.
    fn new(records: &[StepRecord]) -> Option<Self> {
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
            return None;
        }
        let x_max = train.iter().chain(&val).map(|p| p.0).fold(1.0, f64::max);
        let y_max = train.iter().chain(&val).map(|p| p.1).fold(0.0, f64::max) * 1.05;
        Some(Self {
            train,
            val,
            x_max,
            y_max,
        })
    }

    fn draw<DB: plotters::prelude::DrawingBackend>(
        &self,
        root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
        labels: bool,
    ) -> std::result::Result<(), String>
    where
        DB::ErrorType: 'static,
    {
        use plotters::prelude::*;
        let (train, val, x_max, y_max) = (&self.train, &self.val, self.x_max, self.y_max);
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
            mesh.x_desc("step")
                .y_desc("loss (nats/token)")
                .x_label_formatter(&|x| format!("{x:.0}"));
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
            // Each evaluation also as a dot: a run evaluated once still shows its point.
            chart
                .draw_series(val.iter().map(|&p| Circle::new(p, 3, RED.filled())))
                .map_err(e)?;
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
                // Loss falls: the upper right stays clear of the curves.
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE)
                .border_style(BLACK)
                .draw()
                .map_err(e)?;
        }
        root.present().map_err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder `name` (per process) in the temporary folder, its `metrics.jsonl` and
    /// a writer appending to it.
    fn fresh(name: &str) -> (std::path::PathBuf, std::path::PathBuf, MetricsWriter) {
        let d = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("metrics.jsonl");
        let _ = std::fs::remove_file(&p);
        let w = MetricsWriter::append(&p).unwrap();
        (d, p, w)
    }

    #[test]
    fn jsonl_round_trip_and_plot() {
        let (d, p, mut w) = fresh("xtrain-metrics");
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

    /// A run on a GPU whose peak is unknown logs its MFU as NaN: written as `null`, read back.
    #[test]
    fn an_unknown_mfu_round_trips() {
        let (d, p, mut w) = fresh("xtrain-metrics-nan");
        w.write(&StepRecord {
            step: 1,
            mfu: f64::NAN,
            ..Default::default()
        })
        .unwrap();
        drop(w);
        assert!(std::fs::read_to_string(&p)
            .unwrap()
            .contains("\"mfu\":null"));
        let back = read(&p).unwrap();
        assert!(back.len() == 1 && back[0].mfu.is_nan() && back[0].step == 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Dark pixels (text and axes, not the light mesh or the coloured curves) of an RGB
    /// image `SIZE` wide in the rectangle `x0..x1` × `y0..y1`.
    fn dark(rgb: &[u8], (x0, x1): (u32, u32), (y0, y1): (u32, u32)) -> usize {
        (y0..y1)
            .flat_map(|y| (x0..x1).map(move |x| ((y * SIZE.0 + x) * 3) as usize))
            .filter(|&i| rgb[i..i + 3].iter().all(|&c| c < 100))
            .count()
    }

    #[test]
    fn the_png_has_tick_labels_axis_titles_and_a_legend() {
        let recs: Vec<StepRecord> = (1..=300)
            .map(|s| StepRecord {
                step: s,
                loss: 5.0 / (1.0 + 0.02 * s as f64),
                val_loss: (s % 50 == 0).then_some(5.2 / (1.0 + 0.02 * s as f64)),
                ..Default::default()
            })
            .collect();
        let d = std::env::temp_dir().join(format!("xtrain-metrics-png-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let png = d.join("loss.png");
        plot_loss(&recs, &png, &d.join("loss.svg")).unwrap();
        let mut reader = png::Decoder::new(std::fs::File::open(&png).unwrap())
            .read_info()
            .unwrap();
        let mut rgb = vec![0u8; reader.output_buffer_size()];
        let info = reader.next_frame(&mut rgb).unwrap();
        assert_eq!((info.width, info.height), SIZE);
        assert_eq!(info.color_type, png::ColorType::Rgb);
        std::fs::remove_dir_all(&d).unwrap();
        // Left of the y axis: the tick labels and the axis title; below the x axis: the tick
        // labels and "step"; the legend's words in the top right. Without the text these
        // regions hold no dark pixel, so the count is the text's.
        let (w, h) = SIZE;
        let regions = [
            ((0, 60), (30, h - 70)),
            ((80, w - 30), (h - 55, h)),
            ((w - 200, w - 20), (20, 110)),
        ];
        let bare = render_rgb(&recs, false);
        for (x, y) in regions {
            assert_eq!(dark(&bare, x, y), 0, "{x:?} {y:?}");
            let text = dark(&rgb, x, y);
            assert!(text > 100, "{x:?} {y:?}: {text} dark pixels");
        }
        assert_eq!(
            rgb,
            render_rgb(&recs, true),
            "the file is the labelled rendering"
        );
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
