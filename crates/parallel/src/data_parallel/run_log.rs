//! Rank 0's run-directory outputs of a data-parallel run, the same files the single-process
//! `train::run` writes: `config.toml`, one `train::metrics::StepRecord` per step in
//! `metrics.jsonl` (appended, so a resumed run continues the file), and the loss plot
//! (`loss.png`, `loss.svg`); and `memory.json`, every rank's accounted bytes by category
//! beside the formula, its measured peak RSS and baseline (see `docs/DATA_PARALLEL.md`).
//! Also rank 0's console ([`Console`]): the single-process run's progress bar when stderr is
//! a terminal, a step line about 50 times per run otherwise.
//! Used by the data-parallel and the tensor-parallel workers. Throughput is the global batch's
//! tokens per second; MFU divides the model FLOPs by the number of ranks (`dp × tp`) times the
//! fp32 GEMM peak measured on rank 0 (one rank per core set).
use std::path::{Path, PathBuf};

use train::metrics::{self, MetricsWriter, StepRecord};
use train::progress::{StepBar, StepStatus};
use train::RunConfig;

use crate::engine::StepStats;
use crate::memory::{formula_text, MemoryBytes, Precision, ZeroStage};
use crate::ParallelError;

fn io_err(e: impl std::fmt::Display) -> ParallelError {
    ParallelError::Checkpoint(e.to_string())
}

/// What the MFU of a parallel run divides: model FLOPs per token and the peak of all ranks.
#[derive(Clone, Copy, Debug)]
pub struct Throughput {
    /// 6N + 12LHS with the full model's N, as the single-process trainer counts them.
    pub flops_per_token: f64,
    /// Peak FLOP/s of all ranks.
    pub peak: f64,
}

impl Throughput {
    /// Measures the fp32 GEMM peak on this rank and scales it by `dp × tp`.
    pub fn measure(cfg: &RunConfig, num_params: usize) -> Self {
        Throughput {
            flops_per_token: train::trainer::flops_per_token(cfg, num_params),
            peak: train::run::gemm_peak_flops() * (cfg.parallel.dp * cfg.parallel.tp.max(1)) as f64,
        }
    }
}

pub struct RunLog {
    out: PathBuf,
    writer: MetricsWriter,
    rate: Throughput,
}

impl RunLog {
    /// Writes `out/config.toml` and opens `out/metrics.jsonl`.
    pub fn open(out: &Path, cfg: &RunConfig, rate: Throughput) -> Result<Self, ParallelError> {
        std::fs::create_dir_all(out).map_err(io_err)?;
        std::fs::write(out.join("config.toml"), cfg.to_toml()).map_err(io_err)?;
        let writer = MetricsWriter::append(&out.join("metrics.jsonl")).map_err(io_err)?;
        Ok(Self {
            out: out.to_path_buf(),
            writer,
            rate,
        })
    }

    /// Logs one step; `tokens` is the global batch's token count, `secs` the step time.
    pub fn step(
        &mut self,
        step: usize,
        stats: &StepStats,
        lr: f64,
        tokens: usize,
        secs: f64,
        val_loss: Option<f64>,
    ) -> Result<(), ParallelError> {
        let tps = tokens as f64 / secs.max(1e-9);
        let rec = StepRecord {
            step,
            loss: stats.loss as f64,
            lr,
            grad_norm: stats.grad_norm as f64,
            tokens_per_s: tps,
            mfu: tps * self.rate.flops_per_token / self.rate.peak.max(1e-9),
            val_loss,
            loss_scale: None,
            skipped: false,
        };
        self.writer.write(&rec).map_err(io_err)
    }

    /// Writes `memory.json`: the formula's model-state bytes and, per rank, its accounted
    /// bytes and measured resident sizes (`per_rank`: 7 numbers per rank — params, grads,
    /// optimizer, comm buffers, activations, peak RSS, baseline RSS; -1 where unmeasured).
    pub fn write_memory(
        &self,
        formula: &MemoryBytes,
        stage: ZeroStage,
        precision: Precision,
        per_rank: &[i64],
    ) -> Result<(), ParallelError> {
        let ranks: Vec<_> = per_rank
            .chunks_exact(7)
            .enumerate()
            .map(|(r, v)| {
                serde_json::json!({
                    "rank": r,
                    "params": v[0],
                    "grads": v[1],
                    "optimizer": v[2],
                    "comm_buffers_peak": v[3],
                    "activations_peak": v[4],
                    "accounted_total": v[..5].iter().sum::<i64>(),
                    "peak_rss": v[5],
                    "baseline_rss": v[6],
                })
            })
            .collect();
        let doc = serde_json::json!({
            "zero": stage.index(),
            "precision": format!("{precision:?}"),
            "formula": formula_text(stage, precision),
            "formula_bytes": {
                "params": formula.params,
                "grads": formula.grads,
                "optimizer": formula.optimizer,
                "model_states": formula.model_states(),
            },
            "ranks": ranks,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(io_err)?;
        std::fs::write(self.out.join("memory.json"), text).map_err(io_err)
    }

    /// Draws the loss plot from the whole metrics file.
    pub fn finish(&self) -> Result<(), ParallelError> {
        let records = metrics::read(&self.out.join("metrics.jsonl")).map_err(io_err)?;
        metrics::plot_loss(
            &records,
            &self.out.join("loss.png"),
            &self.out.join("loss.svg"),
        )
        .map_err(io_err)
    }
}

/// Rank 0's run directory log (when `out` is given) and console (when `log`), for steps
/// `first..cfg.train.steps`; other ranks get neither. The GEMM peak behind the MFU is measured
/// only when one of them needs it.
pub fn rank0_outputs(
    rank: usize,
    out: Option<&Path>,
    log: bool,
    cfg: &RunConfig,
    num_params: usize,
    first: usize,
) -> Result<(Option<RunLog>, Option<Console>), ParallelError> {
    if rank != 0 || (out.is_none() && !log) {
        return Ok((None, None));
    }
    let rate = Throughput::measure(cfg, num_params);
    let run_log = out.map(|o| RunLog::open(o, cfg, rate)).transpose()?;
    let console = log.then(|| Console::new(first, cfg.train.steps, rate));
    Ok((run_log, console))
}

/// Rank 0's console during the step loop: the progress bar of `xtrain train` when stderr is a
/// terminal; otherwise (logs, CI, tests) a line per step for about 50 steps of the run (and the
/// first and last), `step N | loss L | lr … | grad norm … | … ms | … tok/s | MFU …%` followed by
/// the caller's detail.
pub struct Console {
    bar: StepBar,
    first: usize,
    total: usize,
}

impl Console {
    /// For steps `first..total`.
    pub fn new(first: usize, total: usize, rate: Throughput) -> Self {
        Console {
            bar: StepBar::new(total, first, false, rate.flops_per_token, rate.peak),
            first,
            total,
        }
    }

    /// Reports finished step `done` (counted from 1) with its statistics, learning rate, global
    /// batch tokens, validation loss (if measured) and time; `detail` (built only for printed
    /// lines) ends the line.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        done: usize,
        stats: &StepStats,
        lr: f64,
        tokens: usize,
        val_loss: Option<f64>,
        step_ms: f64,
        detail: impl FnOnce() -> String,
    ) {
        let s = StepStatus {
            step: done,
            loss: stats.loss as f64,
            val_loss,
            lr,
            tokens,
        };
        let rate = self.bar.update(&s);
        let every = (self.total / 50).max(1);
        let line = done == self.first + 1 || done.is_multiple_of(every) || done == self.total;
        if !self.bar.visible() && line {
            println!(
                "step {:>5} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {step_ms:.1} ms | {:.0} tok/s | MFU {:.1}%{}",
                done,
                s.loss,
                lr,
                stats.grad_norm,
                rate.tokens_per_s,
                100.0 * rate.mfu,
                detail()
            );
        }
        if let Some(v) = val_loss {
            self.note(&format!("validation loss {v:.4} after step {done}"));
        }
    }

    /// Prints a message line (above the bar when it is drawn).
    fn note(&self, msg: &str) {
        self.bar.println(msg);
    }

    /// Leaves the finished bar on the terminal.
    pub fn finish(&self) {
        self.bar.finish();
    }
}
