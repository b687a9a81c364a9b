//! `xtrain bench train`: steady-state training step time, tokens/s and MFU of a preset.
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
}

pub fn run_cmd(a: BenchTrainArgs) -> Result<()> {
    let mut overrides = a.overrides.clone();
    if let Some(t) = a.threads {
        overrides.push(format!("train.threads={t}"));
    }
    let cfg = train::RunConfig::resolve(&a.preset, None, &overrides)?;
    let r = train::bench::bench_train(&a.preset, cfg, a.steps)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("{r}");
    }
    Ok(())
}
