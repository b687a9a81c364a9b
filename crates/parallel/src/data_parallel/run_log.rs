//! Rank 0's run-directory outputs of a data-parallel run, the same files the single-process
//! `train::run` writes: `config.toml`, one `train::metrics::StepRecord` per step in
//! `metrics.jsonl` (appended, so a resumed run continues the file), and the loss plot
//! (`loss.png`, `loss.svg`); and `memory.json`, every rank's accounted bytes by category
//! beside the formula, its measured peak RSS and baseline (see `docs/DATA_PARALLEL.md`).
//! Used by the data-parallel and the tensor-parallel workers. Throughput is the global batch's
//! tokens per second; MFU divides the model FLOPs by the number of ranks (`dp × tp`) times the
//! fp32 GEMM peak measured on rank 0 (one rank per core set).
use std::path::{Path, PathBuf};

use train::metrics::{self, MetricsWriter, StepRecord};
use train::RunConfig;

use crate::engine::StepStats;
use crate::memory::{formula_text, MemoryBytes, Precision, ZeroStage};
use crate::ParallelError;

fn io_err(e: impl std::fmt::Display) -> ParallelError {
    ParallelError::Checkpoint(e.to_string())
}

pub struct RunLog {
    out: PathBuf,
    writer: MetricsWriter,
    /// Model FLOPs per token (6N + 12LHS with the full model's N, as the single-process
    /// trainer counts them).
    flops_per_token: f64,
    /// Peak FLOP/s of all ranks.
    peak: f64,
}

impl RunLog {
    /// Writes `out/config.toml` and opens `out/metrics.jsonl`.
    pub fn open(out: &Path, cfg: &RunConfig, num_params: usize) -> Result<Self, ParallelError> {
        std::fs::create_dir_all(out).map_err(io_err)?;
        std::fs::write(out.join("config.toml"), cfg.to_toml()).map_err(io_err)?;
        let writer = MetricsWriter::append(&out.join("metrics.jsonl")).map_err(io_err)?;
        Ok(Self {
            out: out.to_path_buf(),
            writer,
            flops_per_token: train::trainer::flops_per_token(cfg, num_params),
            peak: train::run::gemm_peak_flops() * (cfg.parallel.dp * cfg.parallel.tp.max(1)) as f64,
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
            mfu: tps * self.flops_per_token / self.peak.max(1e-9),
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
