//! `xtrain bench train`: steady-state training step time, tokens/s and MFU of a preset.
//! With `--nproc N` (and `--dp`, `--zero`) it times the data-parallel engine instead: N worker
//! processes through the launcher, each printing its median step after the warm-up step.
use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Kernel threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Config overrides (`key=value`, repeatable), e.g. `--set train.precision=bf16`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Worker processes for a data-parallel benchmark (`--nproc N` alone means `--dp N`).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Data-parallel degree.
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage (0-3).
    #[arg(long)]
    pub zero: Option<usize>,
}

pub fn run_cmd(a: BenchTrainArgs) -> Result<()> {
    let mut overrides = a.overrides.clone();
    if let Some(t) = a.threads {
        overrides.push(format!("train.threads={t}"));
    }
    for (k, v) in [("nproc", a.nproc), ("dp", a.dp), ("zero", a.zero)] {
        if let Some(v) = v {
            overrides.push(format!("parallel.{k}={v}"));
        }
    }
    let mut cfg = train::RunConfig::resolve(&a.preset, None, &overrides)?;
    if crate::cmd::train_dp::wants_dp(&cfg) {
        // One warm-up step plus the timed ones; no run directory, sample or validation.
        cfg.train.steps = a.steps + 1;
        cfg.train.sample_tokens = 0;
        return crate::cmd::train_dp::run(&cfg, None, None);
    }
    train::allocator::reuse_freed_memory();
    let r = train::bench::bench_train(&a.preset, cfg, a.steps)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("{r}");
    }
    Ok(())
}
