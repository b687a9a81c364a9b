//! `xtrain train`: a single-process training run from a preset, a TOML config and overrides,
//! or resumed from a checkpoint.
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use train::run::{run, RunOptions};
use train::trainer::Trainer;
use train::RunConfig;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// TOML run configuration (applied on top of the preset).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Base preset: tiny, small or medium.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Dataset: a `.tok` token file or a text file (default: the built-in corpus).
    #[arg(long)]
    pub data: Option<String>,
    /// Config overrides `section.key=value` (repeatable), e.g. `--set train.steps=100`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Resume from a checkpoint directory or a run directory (uses its `latest`).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Run directory (default: runs/<preset>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Processes (same as `--set parallel.nproc=N`).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Data-parallel degree (same as `--set parallel.dp=N`).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage (same as `--set parallel.zero=N`).
    #[arg(long)]
    pub zero: Option<usize>,
    /// Tensor-parallel degree (same as `--set parallel.tp=N`; `nproc = dp × tp`).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sequence parallelism in the tensor-parallel group (same as `--set parallel.sp=true`).
    #[arg(long)]
    pub sp: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run_cmd(a: TrainArgs) -> Result<()> {
    let mut overrides = Vec::new();
    if let Some(d) = &a.data {
        overrides.push(format!("data.path={}", toml_string(d)));
    }
    if a.sp {
        overrides.push("parallel.sp=true".into());
    }
    for (k, v) in [
        ("nproc", a.nproc),
        ("dp", a.dp),
        ("zero", a.zero),
        ("tp", a.tp),
    ] {
        if let Some(v) = v {
            overrides.push(format!("parallel.{k}={v}"));
        }
    }
    overrides.extend(a.overrides.iter().cloned());
    // A tensor-parallel checkpoint (`tp-*` shards) resumes through the parallel path, at any
    // tp size; its layout flags are given again on the command line.
    let tp_resume = a
        .resume
        .as_deref()
        .and_then(parallel::tensor_parallel::worker::resolve);
    if a.resume.is_none() || tp_resume.is_some() {
        let cfg = RunConfig::load(&a.preset, a.config.as_deref(), &overrides)?;
        if super::train_dp::wants_dp(&cfg) {
            let out = a
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(&a.preset));
            return super::train_dp::run(&cfg, Some(&out), tp_resume.as_deref());
        }
    }
    // A sharded (data-parallel) checkpoint resumes data-parallel, at the dp size and stage of
    // the command line (or the saved ones), whatever it was saved at.
    if let Some(ck) = a.resume.as_deref().and_then(parallel::checkpoint::resolve) {
        let text = parallel::checkpoint::load_config(&ck)?;
        let mut overrides = overrides.clone();
        if let (Some(n), None) = (a.nproc, a.dp) {
            // `--nproc N` alone means `--dp N`, not the saved dp size.
            overrides.push(format!("parallel.dp={n}"));
        }
        let cfg = RunConfig::resolve("tiny", Some(&text), &overrides)?;
        let out = a.out.clone().unwrap_or_else(|| match &a.resume {
            Some(dir) if dir.join("latest").is_file() => dir.clone(),
            _ => PathBuf::from("runs").join(&a.preset),
        });
        return super::train_dp::run(&cfg, Some(&out), Some(&ck));
    }
    train::allocator::reuse_freed_memory();
    let mut trainer = match &a.resume {
        Some(dir) => {
            let ck = train::checkpoint::resolve(dir)?;
            eprintln!("resuming from {}", ck.display());
            Trainer::from_checkpoint(&ck, &overrides)?
        }
        None => Trainer::new(RunConfig::load(&a.preset, a.config.as_deref(), &overrides)?)?,
    };
    let out = a.out.clone().unwrap_or_else(|| match &a.resume {
        // A resumed run continues in its run directory when given one.
        Some(dir) if dir.join("latest").is_file() => dir.clone(),
        _ => PathBuf::from("runs").join(&a.preset),
    });
    let s = run(
        &mut trainer,
        &RunOptions {
            out_dir: out,
            quiet: a.quiet,
        },
    )?;
    println!(
        "loss {:.4} -> {:.4}{} ; checkpoint {}",
        s.first_loss,
        s.last_loss,
        s.val_loss
            .map(|v| format!(" (validation {v:.4})"))
            .unwrap_or_default(),
        s.checkpoint.display()
    );
    Ok(())
}

/// Quotes a path as a TOML string for an override.
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}
