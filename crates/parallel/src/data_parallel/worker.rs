//! A data-parallel training run of a [`RunConfig`] on one rank: the model, the data stream of
//! `train::data` (rank-aware sampler), the LR schedule and the [`DataParallel`] engine at the
//! configured ZeRO stage. `xtrain train` calls [`run`] in each worker when `parallel.dp > 1`.
//! Rank 0 prints the memory accounting at start (with its formula) and per-step metrics.
//!
//! With a run directory, sharded checkpoints go to `<out>/dp-checkpoints/step_NNNNNN` every
//! `train.ckpt_every` steps and at the end, each with the run's `config.toml`, and
//! `<out>/latest` names the newest. A run resumed from one (saved at any dp size, ZeRO stage
//! or precision) continues at its step with the same data and learning rate schedule.
use std::path::{Path, PathBuf};

use comm::Communicator;
use model::Model;
use train::config::Precision as TrainPrecision;
use train::data::{Dataset, Sampler, Tokenizer};
use train::generate::{generate, SampleOptions};
use train::schedule::CosineSchedule;
use train::RunConfig;

use crate::checkpoint;
use crate::engine::{DataParallel, DpConfig};
use crate::llm::StagedLlm;
use crate::memory::{formula_text, mib, MemoryBytes, Precision, ZeroStage};
use crate::run_log::rank0_outputs;
use crate::staged::StagedModel;
use crate::ParallelError;

/// What a run reports.
#[derive(Clone, Debug)]
pub struct DpRunSummary {
    /// Mean loss of every step (over the global batch).
    pub losses: Vec<f32>,
    /// Accounted bytes on this rank after the run (peaks for transient buffers).
    pub memory: MemoryBytes,
    /// The formula's model-state bytes.
    pub formula: MemoryBytes,
}

/// What a data-parallel run (plain or with tensor parallelism inside each replica) reads from
/// its config: the tokenizer, the dataset, the sampler of this dp rank and the learning-rate
/// schedule.
pub(crate) struct RunInputs {
    pub tokenizer: Tokenizer,
    pub data: Dataset,
    pub sampler: Sampler,
    pub schedule: CosineSchedule,
}

impl RunInputs {
    /// Loads the tokenizer and dataset and builds dp rank `dp_rank`'s sampler and the schedule.
    pub(crate) fn load(cfg: &RunConfig, dp_rank: usize) -> Result<RunInputs, ParallelError> {
        let t = &cfg.train;
        let tokenizer = Tokenizer::from_spec(&cfg.data.tokenizer).map_err(cfg_err)?;
        let data = Dataset::load(
            &cfg.data,
            &tokenizer,
            cfg.model.vocab_size,
            cfg.model.seq_len,
        )
        .map_err(cfg_err)?;
        let sampler = Sampler {
            seed: t.seed,
            seq_len: cfg.model.seq_len,
            micro_batch: t.micro_batch,
            grad_accum: t.grad_accum,
            dp: cfg.parallel.dp,
            rank: dp_rank,
        };
        let schedule = CosineSchedule {
            peak: t.lr,
            min: t.min_lr,
            warmup: t.warmup_steps,
            total: t.steps,
        };
        Ok(RunInputs {
            tokenizer,
            data,
            sampler,
            schedule,
        })
    }

    /// This rank's micro-batches of training step `step`.
    pub(crate) fn batches(&self, step: usize) -> Result<Vec<model::Batch>, ParallelError> {
        (0..self.sampler.grad_accum)
            .map(|a| {
                let b = self.sampler.train_batch(&self.data.train, step as u64, a);
                let targets = b.targets.iter().map(|&x| x as i64).collect();
                model::Batch::new(b.batch, b.seq, b.inputs, targets).map_err(cfg_err)
            })
            .collect()
    }
}

/// The engine settings of a run: stage, bucket size, AdamW and clipping from `cfg.train`.
pub(crate) fn dp_config(cfg: &RunConfig, stage: ZeroStage, precision: Precision) -> DpConfig {
    let (t, p) = (&cfg.train, &cfg.parallel);
    DpConfig {
        stage,
        bucket_bytes: (p.bucket_mb * 1024.0 * 1024.0) as usize,
        adamw: model::AdamW {
            lr: t.lr as f32,
            beta1: t.beta1 as f32,
            beta2: t.beta2 as f32,
            eps: t.eps as f32,
            weight_decay: t.weight_decay as f32,
        },
        max_grad_norm: (t.grad_clip > 0.0).then_some(t.grad_clip as f32),
        precision,
    }
}

fn cfg_err(e: impl std::fmt::Display) -> ParallelError {
    ParallelError::Config(e.to_string())
}

/// The model of a run config, exactly as the single-process trainer builds it.
pub use train::trainer::model_config;

/// Where a run writes and what it resumes from.
#[derive(Clone, Debug, Default)]
pub struct DpRunOptions {
    /// Run directory for checkpoints (none: nothing is written).
    pub out: Option<PathBuf>,
    /// A sharded checkpoint to continue from.
    pub resume: Option<PathBuf>,
    /// Print the memory account and per-step lines (rank 0) and peak RSS (every rank).
    pub log: bool,
}

/// Trains this rank up to `cfg.train.steps` optimizer steps (from the resumed step, if any).
/// Every rank of `comm`'s world must call it.
pub fn run(
    cfg: &RunConfig,
    comm: &Communicator,
    opts: &DpRunOptions,
) -> Result<DpRunSummary, ParallelError> {
    let log = opts.log;
    cfg.validate().map_err(cfg_err)?;
    let p = &cfg.parallel;
    let world = comm.world().clone();
    if p.dp != world.size() || p.nproc != world.size() {
        return Err(ParallelError::Config(format!(
            "parallel.dp = {} and parallel.nproc = {} must both equal the number of ranks ({}): only data parallelism is wired into the trainer",
            p.dp, p.nproc, world.size()
        )));
    }
    let stage = ZeroStage::from_index(p.zero).ok_or_else(|| {
        ParallelError::Config(format!(
            "parallel.zero = {} (expected 0, 1, 2 or 3)",
            p.zero
        ))
    })?;
    let t = &cfg.train;
    let precision = match t.precision {
        TrainPrecision::Fp32 => Precision::Fp32,
        TrainPrecision::Bf16 => Precision::Bf16Mixed,
        TrainPrecision::Fp16 => {
            return Err(ParallelError::Config(
                "train.precision = fp16: the data-parallel engine has no loss scaling; use bf16 or fp32"
                    .into(),
            ))
        }
    };
    release_large_frees();
    if t.threads > 0 {
        tensor::threads::set_thread_budget(t.threads).map_err(cfg_err)?;
    }
    let model = Model::new(model_config(cfg)).map_err(cfg_err)?;
    let rank = world.rank();
    let inputs = RunInputs::load(cfg, rank)?;
    // The process before any model state exists (code, threads, communicator, dataset): the
    // baseline that the accounted bytes come on top of.
    let baseline_kib = rss_kib("VmRSS:");
    let dp_cfg = dp_config(cfg, stage, precision);
    // Each rank generates only the initial parameters it keeps (its shard at ZeRO-3).
    let staged = StagedLlm::new(model)?;
    let init_model = staged.model.clone();
    let seed = t.seed;
    let mut engine = DataParallel::with_init(staged, world, dp_cfg, |r, out| {
        init_model.init_range(seed, r, out)
    })?;
    drop(init_model);
    if let Some(dir) = &opts.resume {
        engine.load_checkpoint(dir)?;
    }
    let start = engine.step_count() as usize;
    if start > t.steps {
        return Err(ParallelError::Config(format!(
            "the checkpoint is at step {start}, beyond train.steps = {}",
            t.steps
        )));
    }
    if log && rank == 0 && opts.resume.is_some() {
        println!("resumed at step {start}");
    }
    let formula = engine.formula();
    let phi = engine.spec().total();
    if log && rank == 0 {
        println!(
            "data parallel: dp={} ZeRO-{} Φ={phi} params; model states per rank by formula {} = {} ({})",
            p.dp,
            stage.index(),
            formula_text(stage, precision),
            mib(formula.model_states()),
            formula
        );
        println!("memory per rank (accounted): {}", engine.memory());
    }
    let (mut run_log, mut console) =
        rank0_outputs(rank, opts.out.as_deref(), log, cfg, phi, start)?;
    let global_tokens = p.dp * t.micro_batch * t.grad_accum * cfg.model.seq_len;
    let mut losses = Vec::with_capacity(t.steps);
    let mut step_ms_all = Vec::with_capacity(t.steps);
    for step in start..t.steps {
        let batches = inputs.batches(step)?;
        let lr = inputs.schedule.lr(step);
        engine.set_lr(lr as f32);
        let t0 = std::time::Instant::now();
        let s = engine.train_step(&batches)?;
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        if !s.loss.is_finite() {
            return Err(ParallelError::Protocol(format!(
                "loss is {} at step {step}",
                s.loss
            )));
        }
        losses.push(s.loss);
        step_ms_all.push(step_ms);
        let done = step + 1;
        // Validation as the single-process trainer does it: every `eval_every` steps and at
        // the end, on the same fixed held-out micro-batches (every rank evaluates all of them
        // with the same weights, so ZeRO-3's gathers stay matched).
        let eval_now = (t.eval_every > 0 && done % t.eval_every == 0) || done == t.steps;
        let val = if opts.out.is_some() && eval_now {
            evaluate(&mut engine, cfg, &inputs.sampler, &inputs.data)?
        } else {
            None
        };
        if let Some(l) = &mut run_log {
            l.step(done, &s, lr, global_tokens, step_ms / 1e3, val)?;
        }
        if let Some(c) = &mut console {
            c.step(done, &s, lr, global_tokens, val, step_ms, || {
                let m = engine.memory();
                format!(
                    " | mem/rank params {} grads {} optim {} comm {} act {}",
                    mib(m.params),
                    mib(m.grads),
                    mib(m.optimizer),
                    mib(m.comm_buffers),
                    mib(m.activations)
                )
            });
        }
        let every = t.ckpt_every;
        if let Some(out) = &opts.out {
            if every > 0 && (step + 1) % every == 0 && step + 1 < t.steps {
                save(&engine, cfg, out, step + 1)?;
            }
        }
    }
    if let Some(c) = &console {
        c.finish();
    }
    if log {
        // Every rank reports its measured peak resident set (Linux `VmHWM`, before the
        // checkpoint is written), the baseline and the accounted total on top of it.
        if let (Some(kib), Some(base)) = (rss_kib("VmHWM:"), baseline_kib) {
            // The first step pages buffers in and starts the comm threads: a warm-up.
            let mut sorted = step_ms_all[step_ms_all.len().min(1)..].to_vec();
            if sorted.is_empty() {
                sorted = step_ms_all.clone();
            }
            sorted.sort_by(f64::total_cmp);
            let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
            let accounted = engine.memory().total();
            println!(
                "rank {rank}: peak RSS {:.1} MiB | baseline {:.1} MiB + accounted {} = {:.1} MiB | median step {median:.1} ms (after the first)",
                kib as f64 / 1024.0,
                base as f64 / 1024.0,
                mib(accounted),
                base as f64 / 1024.0 + accounted as f64 / (1024.0 * 1024.0),
            );
        }
    }
    if let Some(out) = &opts.out {
        // Every rank's account and measured peak, gathered to rank 0 for `memory.json`.
        let m = engine.memory();
        let kib = |k: Option<u64>| k.map_or(-1, |k| k as i64 * 1024);
        let mine = [
            m.params as i64,
            m.grads as i64,
            m.optimizer as i64,
            m.comm_buffers as i64,
            m.activations as i64,
            kib(rss_kib("VmHWM:")),
            kib(baseline_kib),
        ];
        let mut all = vec![0i64; mine.len() * engine.group().size()];
        engine.group().all_gather(&mine, &mut all)?;
        if let Some(l) = &run_log {
            l.write_memory(&engine.formula(), stage, precision, &all)?;
        }
        let dir = save(&engine, cfg, out, t.steps)?;
        if log && rank == 0 {
            println!("sharded checkpoint {}", dir.display());
        }
        if let Some(l) = &run_log {
            l.finish()?;
        }
        if t.sample_tokens > 0 {
            // The full weights are a collective at ZeRO-1/2/3 (sharded master weights).
            let full = engine.full_params()?;
            if log && rank == 0 {
                let o = SampleOptions {
                    max_new_tokens: t.sample_tokens,
                    temperature: 0.8,
                    top_k: 20,
                    seed: t.seed,
                    context: cfg.model.seq_len,
                };
                let m = &engine.model().model;
                let text =
                    generate(m, &full, &inputs.tokenizer, &t.sample_prompt, &o).map_err(cfg_err)?;
                println!("sample: {}{text}", t.sample_prompt);
            }
        }
    }
    Ok(DpRunSummary {
        losses,
        memory: engine.memory(),
        formula,
    })
}

/// Mean validation cross-entropy over `train.eval_batches` held-out micro-batches (`None`
/// without validation data). A collective at ZeRO-3.
pub(crate) fn evaluate<M: StagedModel<Batch = model::Batch>>(
    engine: &mut DataParallel<M>,
    cfg: &RunConfig,
    sampler: &Sampler,
    data: &Dataset,
) -> Result<Option<f64>, ParallelError> {
    let n = cfg.train.eval_batches;
    if data.val.is_empty() || n == 0 {
        return Ok(None);
    }
    let mut sum = 0.0f64;
    for i in 0..n {
        let b = sampler.val_batch(&data.val, i);
        let targets = b.targets.iter().map(|&x| x as i64).collect();
        let batch = model::Batch::new(b.batch, b.seq, b.inputs, targets).map_err(cfg_err)?;
        sum += engine.evaluate(&batch)? as f64;
    }
    Ok(Some(sum / n as f64))
}

/// Saves the sharded checkpoint of step `step` into `out/dp-checkpoints/step_NNNNNN` with the
/// run's config, and points `out/latest` at it. A collective.
fn save(
    engine: &DataParallel<StagedLlm>,
    cfg: &RunConfig,
    out: &Path,
    step: usize,
) -> Result<PathBuf, ParallelError> {
    let name = format!("{}/step_{step:06}", checkpoint::DIR);
    let dir = out.join(&name);
    engine.save_checkpoint(&dir)?;
    if engine.group().rank() == 0 {
        checkpoint::save_config(&dir, &cfg.to_toml())?;
        train::checkpoint::set_latest(out, &name)
            .map_err(|e| ParallelError::Checkpoint(e.to_string()))?;
    }
    // No rank returns (and no caller reads `latest`) before rank 0 has written it.
    engine.group().barrier()?;
    Ok(dir)
}

/// Makes glibc serve every allocation of 8 MiB or more with its own `mmap`, returned to the OS
/// on free. By default the threshold adapts upwards (to 32 MiB) after large frees, so the
/// per-step buckets and gathered units would then come from the heaps of the compute and the
/// communication threads, where freed space is only reused or trimmed piecemeal and the
/// resident set drifts above the live bytes the engine accounts for (+30–60 MiB per rank in the
/// second step of preset medium at ZeRO-3). A fixed threshold stops that. 8 MiB rather than
/// less: a 1 MiB threshold also mapped the per-layer activations and scratch of every step,
/// tripling the page faults (preset small, dp=2: 1.45 M minor faults and 2.8 s system time over
/// 4 steps, against 0.41 M / 0.86 s by default and 0.20 M / 0.53 s at 8 MiB).
fn release_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; M_MMAP_THRESHOLD takes a byte count.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 8 << 20);
    }
}

/// A size of this process in KiB from `/proc/self/status` (`VmHWM:` the peak resident set,
/// `VmRSS:` the current one); `None` off Linux.
fn rss_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
