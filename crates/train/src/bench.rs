//! `xtrain bench train`: steady-state step time, tokens/s and MFU of a preset on this machine,
//! plus peak RSS against the memory account.
use crate::config::RunConfig;
use crate::error::Result;
use crate::memory::{human, peak_rss_bytes};
use crate::run::gemm_peak_flops;
use crate::trainer::Trainer;
use std::time::Instant;

/// Benchmark figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub preset: String,
    pub threads: usize,
    pub params: usize,
    pub tokens_per_step: usize,
    pub median_step_s: f64,
    pub tokens_per_s: f64,
    pub flops_per_token: f64,
    pub achieved_gflops: f64,
    pub gemm_peak_gflops: f64,
    pub mfu: f64,
    pub accounted_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// Seconds per step in each model kernel class, and the rest ("other": optimizer,
    /// precision conversions, data, glue), from the model's kernel timers.
    pub profile: Vec<(String, f64)>,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "preset {} ({} params), {} thread(s), {} tokens/step",
            self.preset, self.params, self.threads, self.tokens_per_step
        )?;
        writeln!(
            f,
            "median step {:.4} s  ->  {:.0} tokens/s",
            self.median_step_s, self.tokens_per_s
        )?;
        writeln!(
            f,
            "FLOPs/token (6N + 12·L·H·S, N = all parameters) {:.3e}  ->  {:.1} GFLOP/s; GEMM peak {:.1} GFLOP/s; MFU {:.1}%",
            self.flops_per_token,
            self.achieved_gflops,
            self.gemm_peak_gflops,
            100.0 * self.mfu
        )?;
        let parts: Vec<String> = self
            .profile
            .iter()
            .map(|(k, s)| format!("{k} {:.0}%", 100.0 * s / self.median_step_s.max(1e-12)))
            .collect();
        writeln!(f, "time per step by kernel: {}", parts.join(", "))?;
        write!(
            f,
            "memory accounted {} ; peak RSS {} ({})",
            human(self.accounted_bytes),
            self.peak_rss_bytes.map(human).unwrap_or_else(|| "?".into()),
            self.peak_rss_bytes
                .map(|r| format!("{:.2}x the account", r as f64 / self.accounted_bytes as f64))
                .unwrap_or_default()
        )
    }
}

/// Runs `steps` timed optimizer steps (after one warm-up step) of `cfg` with synthetic-free,
/// real data (the built-in corpus) and reports the median.
pub fn bench_train(preset: &str, mut cfg: RunConfig, steps: usize) -> Result<BenchReport> {
    cfg.train.steps = steps + 1;
    cfg.data.corpus_bytes = cfg.data.corpus_bytes.min(400_000);
    let mut t = Trainer::new(cfg)?;
    let threads = tensor::threads::thread_budget();
    t.train_step()?; // warm-up: page in buffers, size the thread pool
    model::profile::reset();
    model::profile::enable(true);
    // The MFU denominator is sampled before every timed step and the best kept: on a shared
    // machine a single sample can land in a slow moment and put the MFU above 100 %.
    let mut peak = 0.0f64;
    let mut times: Vec<f64> = (0..steps.max(1))
        .map(|_| {
            peak = peak.max(gemm_peak_flops());
            let s = Instant::now();
            t.train_step().map(|_| s.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    model::profile::enable(false);
    let n = times.len() as f64;
    let mean_step = times.iter().sum::<f64>() / n;
    let mut profile: Vec<(String, f64)> = model::profile::report()
        .into_iter()
        .map(|(k, s)| (format!("{k:?}"), s / n))
        .filter(|(_, s)| *s > 0.0)
        .collect();
    let kernels: f64 = profile.iter().map(|p| p.1).sum();
    profile.push(("other".into(), (mean_step - kernels).max(0.0)));
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = t.cfg.train.micro_batch * t.cfg.train.grad_accum * t.cfg.model.seq_len;
    let tps = tokens as f64 / median;
    let fpt = t.flops_per_token();
    Ok(BenchReport {
        preset: preset.to_string(),
        threads,
        params: t.num_params(),
        tokens_per_step: tokens,
        median_step_s: median,
        tokens_per_s: tps,
        flops_per_token: fpt,
        achieved_gflops: tps * fpt / 1e9,
        gemm_peak_gflops: peak / 1e9,
        mfu: tps * fpt / peak,
        accounted_bytes: t.memory().total(),
        peak_rss_bytes: peak_rss_bytes(),
        profile,
    })
}
