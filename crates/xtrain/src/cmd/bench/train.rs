//! `xtrain bench train`: steady-state training step time, tokens/s and MFU of a preset, on
//! any layout: the same flags and the same trainer as `xtrain train` (with `--nproc N` the
//! command re-runs itself as N workers through the launcher), the report printed by rank 0.
use anyhow::Result;
use clap::Args;

use crate::cmd::train::{join_job, resolve_config, LayoutArgs};

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Kernel threads per rank (default: the cores of the host over the ranks on it).
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
    #[command(flatten)]
    pub layout: LayoutArgs,
}

pub fn run_cmd(a: BenchTrainArgs) -> Result<()> {
    let mut sets = a.overrides.clone();
    if let Some(t) = a.threads {
        sets.push(format!("train.threads={t}"));
    }
    let cfg = resolve_config(Some(&a.preset), None, None, &a.layout, None, &sets)?;
    let Some(comm) = join_job(cfg.parallel.nproc)? else {
        return Ok(());
    };
    train::allocator::reuse_freed_memory();
    if let Some(r) = train::bench::bench_train(&a.preset, cfg, a.steps, &comm)? {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            println!("{r}");
        }
    }
    Ok(())
}
