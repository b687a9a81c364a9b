//! `xtrain train`: one path for every layout. The config is resolved (preset → TOML →
//! `--set` and layout flags, or the checkpoint's own config when resuming), `nproc = pp · dp ·
//! cp · tp` is checked, and then either this process is the whole job (one rank), or it
//! re-runs itself as `nproc` workers through the launcher machinery and each worker joins the
//! job's communicator and runs the same trainer (`train::run`).
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use comm::Communicator;
use train::run::{run, RunOptions};
use train::trainer::Trainer;
use train::RunConfig;

use super::launch::{run_group, GroupSpec};

/// The layout flags of `xtrain train` and `xtrain bench train`.
#[derive(Args, Debug, Clone, Default)]
pub struct LayoutArgs {
    /// Processes (`parallel.nproc`); alone it sets dp = nproc / (pp·cp·tp).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Data-parallel degree (`parallel.dp`).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage 0-3 (`parallel.zero`).
    #[arg(long)]
    pub zero: Option<usize>,
    /// Tensor-parallel degree (`parallel.tp`).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sequence parallelism in the tensor-parallel group (`parallel.sp`).
    #[arg(long)]
    pub sp: bool,
    /// Pipeline-parallel degree (`parallel.pp`).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Context-parallel degree (`parallel.cp`).
    #[arg(long)]
    pub cp: Option<usize>,
    /// How context parallelism splits each sequence: zigzag, striped or none
    /// (`parallel.cp_balance`).
    #[arg(long)]
    pub cp_balance: Option<String>,
    /// How keys and values reach the other cp ranks: ring or allgather (`parallel.cp_comm`).
    #[arg(long)]
    pub cp_comm: Option<String>,
    /// Expert-parallel degree (`parallel.ep`).
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pipeline stages per pipeline rank of the interleaved schedule
    /// (`parallel.virtual_stages`; default 2, as `xtrain schedule`).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Pipeline schedule (`parallel.schedule`): gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v,
    /// dualpipev, dualpipe, or csv:FILE.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Micro-batches per optimizer step and dp rank (`train.grad_accum`): what a pipeline
    /// schedule fills its stages with.
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Where to train: cpu, cuda or cuda:N (`train.device`; default `XTRAIN_DEVICE`, else the
    /// CPU). On a GPU today: data and pipeline parallelism (docs/GPU.md).
    #[arg(long)]
    pub device: Option<String>,
    /// ZeRO-Offload: `optimizer` keeps the fp32 master weights and AdamW moments in host
    /// memory and runs AdamW on the CPU (`parallel.offload`; default none).
    #[arg(long)]
    pub offload: Option<String>,
}

impl LayoutArgs {
    /// The flags as `parallel.*` overrides.
    pub fn overrides(&self) -> Vec<String> {
        let mut o = Vec::new();
        if self.sp {
            o.push("parallel.sp=true".into());
        }
        for (k, v) in [
            ("nproc", self.nproc),
            ("dp", self.dp),
            ("zero", self.zero),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("virtual_stages", self.virtual_stages),
        ] {
            if let Some(v) = v {
                o.push(format!("parallel.{k}={v}"));
            }
        }
        for (k, v) in [
            ("schedule", &self.schedule),
            ("cp_balance", &self.cp_balance),
            ("cp_comm", &self.cp_comm),
            ("offload", &self.offload),
        ] {
            if let Some(v) = v {
                o.push(format!("parallel.{k}={}", toml::Value::String(v.clone())));
            }
        }
        if let Some(m) = self.microbatches {
            o.push(format!("train.grad_accum={m}"));
        }
        if let Some(d) = &self.device {
            o.push(format!("train.device={}", toml::Value::String(d.clone())));
        }
        o
    }
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// TOML run configuration (applied on top of the preset).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Base preset: tiny, small, medium or moe-small (default tiny).
    #[arg(long)]
    pub preset: Option<String>,
    /// Dataset: a shard folder (`xtrain tokenize … -o FOLDER`), a `.tok` token file or a text
    /// file (default: the built-in corpus). A mixture is `data.mix` in the config.
    #[arg(long)]
    pub data: Option<String>,
    /// Config overrides `section.key=value` (repeatable), e.g. `--set train.steps=100`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Continue from a checkpoint (or a run directory: its `latest`), at any layout. Its
    /// config is used; change settings with `--set` and the layout flags. `auto`: continue
    /// the `--out` directory's newest checkpoint when it has one, else start afresh (what a
    /// launcher restart needs: `xtrain launch --max-restarts R -- xtrain train --resume auto
    /// --out DIR ...`); a damaged checkpoint there is an error, never a fresh start. When it
    /// resumes, `--preset` and `--config` (read for the fresh start) are not read again.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Run directory (default: runs/<preset>, or the run directory resumed from).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Write the run as a Chrome trace (chrome://tracing, Perfetto) to this file, at any
    /// layout: one process per rank, its schedule actions (forwards, backwards, optimizer
    /// steps; with what each waited for), each unit's backward and each gradient bucket's
    /// data-parallel reduction.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// No progress bar, step lines or messages.
    #[arg(long)]
    pub quiet: bool,
}

/// The run config of a command line: from the preset and TOML file, or from the checkpoint
/// resumed; then the overrides and layout flags.
pub fn resolve_config(
    preset: Option<&str>,
    config: Option<&std::path::Path>,
    resume: Option<&std::path::Path>,
    layout: &LayoutArgs,
    data: Option<&str>,
    sets: &[String],
) -> Result<RunConfig> {
    let mut overrides = Vec::new();
    if let Some(d) = data {
        overrides.push(format!("data.path={}", toml::Value::String(d.to_string())));
    }
    overrides.extend(layout.overrides());
    overrides.extend(sets.iter().cloned());
    let (nproc_given, dp_given) = (layout.nproc.is_some(), layout.dp.is_some());
    let mut saved = None;
    let text = match (resume, config) {
        (Some(_), Some(_)) => bail!(
            "--config cannot be combined with --resume: the checkpoint's own config is used (change settings with --set)"
        ),
        (Some(ck), None) => {
            if preset.is_some() {
                bail!("--preset cannot be combined with --resume: the checkpoint's own config is used (change settings with --set)");
            }
            let ck = parallel::checkpoint::Checkpoint::open(ck)?;
            let text = train::trainer::checkpoint_config_text(&ck)?;
            saved = Some(RunConfig::resolve("tiny", Some(&text), &[])?);
            Some(text)
        }
        (None, Some(path)) => Some(std::fs::read_to_string(path).map_err(|e| {
            anyhow::anyhow!("reading config {}: {e}", path.display())
        })?),
        (None, None) => None,
    };
    let mut cfg = RunConfig::resolve_layout(
        preset.unwrap_or("tiny"),
        text.as_deref(),
        &overrides,
        nproc_given,
        dp_given,
    )?;
    if let Some(saved) = saved {
        keep_global_batch(&mut cfg, &saved, &overrides)?;
    }
    Ok(cfg)
}

/// A resumed run keeps the checkpoint's global batch (`dp × micro_batch × grad_accum`) when
/// its dp size changes, by re-deriving the accumulation steps, so it reads the same samples
/// in every step whatever the layout; setting `train.grad_accum` or `train.micro_batch`
/// explicitly to another value than the checkpoint's changes it on purpose (repeating the
/// saved value, as a restarted command line does, does not).
fn keep_global_batch(cfg: &mut RunConfig, saved: &RunConfig, sets: &[String]) -> Result<()> {
    let chosen = |key: &str| sets.iter().any(|s| s.trim_start().starts_with(key));
    let changed = (chosen("train.grad_accum") && cfg.train.grad_accum != saved.train.grad_accum)
        || (chosen("train.micro_batch") && cfg.train.micro_batch != saved.train.micro_batch);
    let want = saved.global_batch();
    if cfg.global_batch() == want || changed {
        return Ok(());
    }
    let per_step = cfg.parallel.dp * cfg.train.micro_batch;
    if !want.is_multiple_of(per_step) {
        bail!(
            "the checkpoint's global batch of {want} sequences is not a multiple of dp × micro_batch = {per_step}: set train.grad_accum (or train.micro_batch) to choose the new global batch"
        );
    }
    cfg.train.grad_accum = want / per_step;
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        println!(
            "global batch kept at {want} sequences: dp = {} × micro_batch = {} × grad_accum = {}",
            cfg.parallel.dp, cfg.train.micro_batch, cfg.train.grad_accum
        );
    }
    Ok(())
}

/// This process's place in the job: the whole job (one rank), a launched worker, or the
/// parent that starts `nproc` workers running this same command line (`None`: the workers
/// ran and finished).
pub fn join_job(nproc: usize) -> Result<Option<Communicator>> {
    if let Ok(env) = comm::env::LaunchEnv::from_env() {
        if env.world_size == 1 {
            // A world of one (e.g. a batch job's single task): no rendezvous needed.
            return Ok(Some(Communicator::single_process()?));
        }
        let (comm, _) = comm::env::init_from_env()?;
        return Ok(Some(comm));
    }
    if nproc == 1 {
        return Ok(Some(Communicator::single_process()?));
    }
    let mut command = vec![std::env::current_exe()?.into_os_string()];
    command.extend(std::env::args_os().skip(1));
    let spec = GroupSpec {
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        max_restarts: 0,
        grace: Duration::from_secs(5),
        job_id: None,
        command,
        extra_env: Vec::new(),
        prefix_stdout: false,
    };
    run_group(&spec)?;
    Ok(None)
}

/// What `--resume auto` means for run directory `out`: its newest checkpoint (`Some(out)`,
/// resolved and verified when opened) when `out/latest` exists, `None` (a fresh start) when
/// `out` holds no checkpoint at all. Checkpoints without a `latest` naming one are an error:
/// a run was cut short between writing a checkpoint and pointing `latest` at it, or the
/// directory is not a run directory, and guessing could silently restart training.
pub fn resume_auto(out: &std::path::Path) -> Result<Option<PathBuf>> {
    if out.join("latest").exists() {
        return Ok(Some(out.to_path_buf()));
    }
    let any_checkpoint = std::fs::read_dir(out.join("checkpoints"))
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if any_checkpoint {
        bail!(
            "--resume auto: {} has checkpoints but no `latest` naming one; resume one of them explicitly with --resume {}/checkpoints/step_N",
            out.display(),
            out.display()
        );
    }
    Ok(None)
}

/// The run directory: `--out`, or the run directory resumed from, or `runs/<preset>`.
fn out_dir(a: &TrainArgs) -> PathBuf {
    a.out.clone().unwrap_or_else(|| match &a.resume {
        // A resumed run continues in its run directory when given one.
        Some(dir) if dir != std::path::Path::new("auto") && dir.join("latest").is_file() => {
            dir.clone()
        }
        _ => PathBuf::from("runs").join(a.preset.as_deref().unwrap_or("tiny")),
    })
}

pub fn run_cmd(mut a: TrainArgs) -> Result<()> {
    let out = out_dir(&a);
    let auto = a.resume.as_deref() == Some(std::path::Path::new("auto"));
    if auto {
        a.resume = resume_auto(&out)?;
    }
    // A worker of `xtrain launch` without --nproc: the job's size is the launch's, so a
    // restart on fewer processes continues with a smaller dp.
    let mut layout = a.layout.clone();
    if layout.nproc.is_none() {
        if let Ok(env) = comm::env::LaunchEnv::from_env() {
            layout.nproc = Some(env.world_size);
        }
    }
    // An automatic resume uses the checkpoint's config: the preset and config file given
    // for the fresh start are not read again.
    let (preset, config) = match (auto, &a.resume) {
        (true, Some(_)) => (None, None),
        _ => (a.preset.as_deref(), a.config.as_deref()),
    };
    let cfg = resolve_config(
        preset,
        config,
        a.resume.as_deref(),
        &layout,
        a.data.as_deref(),
        &a.overrides,
    )?;
    let Some(comm) = join_job(cfg.parallel.nproc)? else {
        return Ok(());
    };
    train::allocator::reuse_freed_memory();
    let mut trainer = match &a.resume {
        Some(path) => {
            let ck = parallel::checkpoint::resolve(path)?;
            if comm.rank() == 0 && !a.quiet {
                println!("resuming from {}", ck.display());
            }
            Trainer::resume(cfg, &ck, &comm)?
        }
        None => Trainer::new(cfg, &comm)?,
    };
    let s = run(
        &mut trainer,
        &RunOptions {
            out_dir: out,
            quiet: a.quiet,
            trace: a.trace.clone(),
        },
    )?;
    if comm.rank() == 0 {
        let first = s.losses.first().copied().unwrap_or(f64::NAN);
        let last = s.losses.last().copied().unwrap_or(f64::NAN);
        println!(
            "loss {first:.4} -> {last:.4}{} ; checkpoint {}",
            s.val_loss
                .map(|v| format!(" (validation {v:.4})"))
                .unwrap_or_default(),
            s.checkpoint.display()
        );
    }
    Ok(())
}
