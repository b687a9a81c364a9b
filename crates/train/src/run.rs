//! A whole training run as `xtrain train` drives it, on every layout: the step loop with a
//! progress bar (rank 0), periodic validation and checkpoints, metrics in `metrics.jsonl`, the
//! loss plot, every rank's memory account, and a sample at the end. Every rank runs it; rank 0
//! writes the run directory:
//!
//! ```text
//! <out>/config.toml  metrics.jsonl  loss.png  loss.svg  memory.json  pipeline.json (pp > 1)
//! <out>/events.out.tfevents.<time>.<host>.xtrain   (TensorBoard; one per start of the run)
//! <out>/checkpoints/step_NNNNNN/   (one format for every layout, see parallel::checkpoint)
//! <out>/latest                      (names the newest checkpoint)
//! ```
use std::path::{Path, PathBuf};
use std::time::Instant;

use comm::{Communicator, ReduceOp};
use parallel::memory::{formula, formula_text, peak_rss_bytes, MemoryAccount};

use crate::error::{IoContext, Result};
use crate::generate::{generate, SampleOptions};
use crate::metrics::{self, MetricsWriter, StepRecord};
use crate::progress::{Console, StepStatus};
use crate::tensorboard::{step_scalars, Board};
use crate::trainer::Trainer;

/// Options of a run beyond its config.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub out_dir: PathBuf,
    /// No progress bar, step lines or messages (the summary is still returned).
    pub quiet: bool,
    /// Write the run's schedule actions, units' backwards and gradient reductions as a Chrome
    /// trace to this file (any layout).
    pub trace: Option<PathBuf>,
}

/// What a run returns (on every rank).
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Loss of every step run (over the global batch).
    pub losses: Vec<f64>,
    pub val_loss: Option<f64>,
    /// The sample text (rank 0, when `train.sample_tokens > 0`).
    pub sample: Option<String>,
    pub checkpoint: PathBuf,
}

/// Measured fp32 GEMM throughput (FLOP/s) of this process with its thread budget: the best
/// of a few 512³ products.
pub fn gemm_peak_flops() -> f64 {
    let n = 512;
    let a = vec![0.5f32; n * n];
    let b = vec![0.25f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let _ = tensor::gemm::matmul(&mut c, &a, &b, n, n, n, false, false, false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best.max(1e-9)
}

/// The MFU denominator of a job: every rank measures its cores' GEMM peak at the same time
/// (each with its own thread budget), and the sum is the peak of all the cores the job uses.
/// A collective.
pub fn job_peak_flops(comm: &Communicator, measure: impl Fn() -> f64) -> Result<f64> {
    let mut p = [measure() as f32];
    if comm.size() > 1 {
        comm.all_reduce(&mut p, ReduceOp::Sum)?;
    }
    Ok(p[0] as f64)
}

fn checkpoint_name(step: usize) -> String {
    format!("checkpoints/step_{step:06}")
}

/// Saves the trainer into `out/checkpoints/step_N` and points `out/latest` at it. A
/// collective.
pub fn save_into_run(t: &Trainer, out: &Path) -> Result<PathBuf> {
    let name = checkpoint_name(t.step);
    let dir = out.join(&name);
    t.save_checkpoint(&dir)?;
    if t.rank() == 0 {
        parallel::checkpoint::set_latest(out, &name)?;
    }
    // No rank returns (and no caller reads `latest`) before rank 0 has written it.
    t.comm().barrier()?;
    Ok(dir)
}

/// Trains `t` until `train.steps`, logging into `opts.out_dir`. Every rank calls it.
pub fn run(t: &mut Trainer, opts: &RunOptions) -> Result<RunSummary> {
    let out = &opts.out_dir;
    let rank0 = t.rank() == 0;
    let say = |s: &str| {
        if rank0 && !opts.quiet {
            println!("{s}");
        }
    };
    let mut writer = None;
    let mut board = Board::off();
    if rank0 {
        std::fs::create_dir_all(out).ctx(|| format!("creating {}", out.display()))?;
        std::fs::write(out.join("config.toml"), t.cfg.to_toml())
            .ctx(|| "writing config.toml".into())?;
        // Rows past the step resumed from (a run that failed after its last checkpoint) go.
        writer = Some(MetricsWriter::continue_at(
            &out.join("metrics.jsonl"),
            t.step,
        )?);
        if t.cfg.train.tensorboard {
            board = Board::open(out, t.step, &t.cfg.to_toml())?;
        }
    }
    let first_step = t.step;
    let fault = crate::fault::Fault::from_env()?;
    let total = t.cfg.train.steps;
    let peak = match &t.exec.config().device {
        // On a GPU the denominator is its dense bf16 tensor-core peak (the usual MFU), from
        // the data sheet of the model found (NaN for a GPU not in the table).
        tensor::buf::Dev::Cuda(g) => g.info.bf16_peak_flops().unwrap_or(f64::NAN),
        tensor::buf::Dev::Cpu => job_peak_flops(t.comm(), gemm_peak_flops)?,
    };
    if let tensor::buf::Dev::Cuda(g) = &t.exec.config().device {
        let i = &g.info;
        say(&format!(
            "device: cuda:{} {} (compute capability {}.{}, {} MiB, driver CUDA {}.{})",
            i.ordinal,
            i.name,
            i.capability.0,
            i.capability.1,
            i.total_memory >> 20,
            i.driver_version / 1000,
            i.driver_version % 1000 / 10
        ));
    }
    let fpt = t.flops_per_token();
    say(&format!(
        "model: {} parameters ({} layers, hidden {}), data: {} ({} train / {} val tokens)",
        t.num_params(),
        t.cfg.model.num_layers,
        t.cfg.model.hidden_size,
        t.data.source,
        t.data.train.len(),
        t.data.val.len()
    ));
    let d = &t.dims;
    let (local, precision) = (t.exec.spec().total(), t.cfg.train.precision);
    say(&format!(
        "layout: {} on {} process(es), {:?}; {local} of {} parameters per rank; model states per rank by formula {} = {}",
        d.describe(),
        t.cfg.parallel.nproc,
        precision,
        t.num_params(),
        formula_text(d.zero, precision),
        parallel::memory::human(formula(local, d.dp * d.cp, d.zero, precision).model_states() as u64),
    ));
    say(&format!("memory (rank 0, accounted): {}", t.memory()));
    say(&format!(
        "FLOPs/token 6N+12LHS = {fpt:.3e}; {}",
        match &t.exec.config().device {
            tensor::buf::Dev::Cuda(_) if peak.is_finite() => format!(
                "the GPU's dense bf16 peak (data sheet) {:.1} TFLOP/s",
                peak / 1e12
            ),
            tensor::buf::Dev::Cuda(_) => {
                "this GPU's dense bf16 peak is not known: no MFU figure".to_string()
            }
            tensor::buf::Dev::Cpu => format!(
                "measured fp32 GEMM peak of all {} rank(s) {:.1} GFLOP/s",
                t.comm().size(),
                peak / 1e9
            ),
        }
    ));
    if t.step > 0 {
        say(&format!("resumed at step {}", t.step));
        if t.exec.has_powersgd() {
            say("PowerSGD: the error feedback continues from the checkpoint (the ranks' mean; zero if it was saved without PowerSGD); the warm-start Q matrices begin afresh");
        }
    }
    if opts.trace.is_some() {
        t.keep_trace();
    }
    let mut console = rank0.then(|| Console::new(t.step, total, opts.quiet, fpt, peak));
    let (mut losses, mut last_val) = (Vec::new(), None);
    while t.step < total {
        let ts = Instant::now();
        let r = t.train_step()?;
        let dt = ts.elapsed().as_secs_f64();
        losses.push(r.loss);
        let tps = r.tokens as f64 / dt.max(1e-9);
        let mut rec = StepRecord {
            step: r.step,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.stats.grad_norm as f64,
            tokens_per_s: tps,
            mfu: tps * fpt / peak,
            val_loss: None,
            loss_scale: t.exec.loss_scaler().dynamic.then_some(r.stats.loss_scale),
            skipped: !r.stats.applied,
            expert_imbalance: r.experts.map(|e| e.imbalance),
            dropped_fraction: r.experts.map(|e| e.dropped),
            all_to_all_ms: r
                .experts
                .filter(|_| t.dims.ep > 1)
                .map(|e| e.all_to_all_s * 1e3),
            dp_bytes_sent: (t.dims.dp * t.dims.cp > 1).then_some(r.stats.dp_bytes_sent),
        };
        let every = t.cfg.train.eval_every;
        if (every > 0 && r.step % every == 0) || r.step == total {
            rec.val_loss = t.evaluate()?;
            last_val = rec.val_loss.or(last_val);
        }
        if let Some(w) = &mut writer {
            w.write(&rec)?;
            let mut scalars = step_scalars(&rec);
            let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
            let m = t.memory();
            scalars.push(("memory/rank0/accounted_mib".into(), mib(m.total())));
            scalars.push(("memory/rank0/activations_mib".into(), mib(m.activations)));
            board.scalars(r.step, &scalars);
        }
        if let Some(c) = &mut console {
            let status = StepStatus {
                step: r.step,
                loss: r.loss,
                val_loss: rec.val_loss,
                lr: r.lr,
                tokens: r.tokens,
            };
            let m = t.memory();
            let experts = r.experts.map_or(String::new(), |e| {
                let a2a = rec
                    .all_to_all_ms
                    .map_or(String::new(), |ms| format!(" all-to-all {ms:.1} ms"));
                format!(
                    " | experts max/mean {:.2} dropped {:.1}%{a2a}",
                    e.imbalance,
                    100.0 * e.dropped
                )
            });
            let dp_sent = rec.dp_bytes_sent.map_or(String::new(), |b| {
                format!(
                    " | dp sent {:.2} MiB ({})",
                    b as f64 / (1024.0 * 1024.0),
                    t.cfg.train.grad_comm
                )
            });
            c.step(&status, rec.grad_norm, dt * 1e3, || {
                let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
                experts
                    + &dp_sent
                    + &format!(
                    " | mem/rank params {:.2} grads {:.2} master+optim {:.2} comm {:.2} act {:.2} MiB",
                    mib(m.params),
                    mib(m.grads),
                    mib(m.master + m.optimizer),
                    mib(m.comm_buffers),
                    mib(m.activations)
                )
            });
        }
        let ck = t.cfg.train.ckpt_every;
        if ck > 0 && r.step % ck == 0 && r.step < total {
            save_into_run(t, out)?;
        }
        if let Some(f) = &fault {
            f.at_step_end(t.rank(), r.step);
        }
    }
    if let Some(c) = &console {
        c.finish();
    }
    for (r, accounted, rss) in write_memory(t, out)? {
        let mib = |b: f64| b / (1024.0 * 1024.0);
        // Rank 0's accounted bytes are in every step's scalars already.
        let mut v = Vec::new();
        if r > 0 {
            v.push((format!("memory/rank{r}/accounted_mib"), mib(accounted)));
        }
        if let Some(rss) = rss {
            v.push((format!("memory/rank{r}/peak_rss_mib"), mib(rss as f64)));
        }
        board.scalars(t.step, &v);
    }
    if let Some(report) = t.pipeline_report()? {
        if rank0 {
            // The measured bubble of each step this process ran (the last ones if fewer).
            let n = report.measured.len().min(t.step - first_step);
            let last = &report.measured[report.measured.len() - n..];
            for (i, b) in last.iter().enumerate() {
                let s = t.step - n + 1 + i;
                board.scalars(s, &[("pipeline/bubble_measured".into(), *b)]);
            }
            board.scalars(
                t.step,
                &[(
                    "pipeline/bubble_simulated".into(),
                    report.simulated_measured_costs,
                )],
            );
            say(&report.to_string());
            let text = serde_json::to_string_pretty(&report).expect("serialises");
            std::fs::write(out.join("pipeline.json"), text)
                .ctx(|| "writing pipeline.json".into())?;
        }
    }
    if let Some(path) = &opts.trace {
        t.write_trace(path)?;
        say(&format!("trace: {}", path.display()));
    }
    let checkpoint = save_into_run(t, out)?;
    say(&format!("checkpoint: {}", checkpoint.display()));
    let mut sample = None;
    if rank0 {
        let records = metrics::read(&out.join("metrics.jsonl"))?;
        metrics::plot_loss(&records, &out.join("loss.png"), &out.join("loss.svg"))?;
        say(&format!(
            "metrics: {0}/metrics.jsonl, plot: {0}/loss.png (+ .svg), memory: {0}/memory.json",
            out.display()
        ));
        if t.cfg.train.sample_tokens > 0 {
            // The full weights from the checkpoint just written (whatever the layout).
            let (cfg, model, params, tokenizer) = crate::trainer::load_model(&checkpoint)?;
            let o = SampleOptions {
                max_new_tokens: cfg.train.sample_tokens,
                temperature: 0.8,
                top_k: 20,
                seed: cfg.train.seed,
                context: cfg.model.seq_len,
            };
            let prompt = cfg.train.sample_prompt.clone();
            // On the device the run trained on.
            let dev = tensor::buf::Dev::open(&cfg.train.device_spec())
                .map_err(|e| crate::TrainError::Config(format!("train.device: {e}")))?;
            let params = dev
                .from_vec(params)
                .map_err(|e| crate::TrainError::Model(e.to_string()))?;
            let text = generate(&model, params.r(), &tokenizer, &prompt, &o)?;
            say(&format!("sample: {prompt}{text}"));
            sample = Some(text);
        }
    }
    Ok(RunSummary {
        losses,
        val_loss: last_val,
        sample,
        checkpoint,
    })
}

/// Writes `out/memory.json` (rank 0): every rank's accounted bytes by category beside the
/// formula's model states, its measured peak resident set and the baseline before the model
/// existed. A collective. Returns (on rank 0) every rank's accounted total and peak RSS.
pub fn write_memory(t: &Trainer, out: &Path) -> Result<Vec<(usize, f64, Option<u64>)>> {
    let mut mine = t.memory().to_array().to_vec();
    let kib = |b: Option<u64>| b.map_or(-1, |b| b as i64);
    mine.push(kib(peak_rss_bytes()));
    mine.push(kib(t.baseline_rss));
    let n = t.comm().size();
    let mut all = vec![0i64; mine.len() * n];
    t.comm().all_gather(&mine, &mut all)?;
    if t.rank() != 0 {
        return Ok(Vec::new());
    }
    let d = &t.dims;
    let precision = t.cfg.train.precision;
    let f = formula(t.exec.spec().total(), d.dp * d.cp, d.zero, precision);
    let ranks: Vec<_> = all
        .chunks_exact(mine.len())
        .enumerate()
        .map(|(r, v)| {
            let m = MemoryAccount::from_array(v);
            serde_json::json!({
                "rank": r,
                "params": m.params,
                "grads": m.grads,
                "master": m.master,
                "optimizer": m.optimizer,
                "comm_buffers_peak": m.comm_buffers,
                "activations_peak": m.activations,
                "accounted_total": m.total(),
                "peak_rss": v[6],
                "baseline_rss": v[7],
            })
        })
        .collect();
    let doc = serde_json::json!({
        "layout": d.describe(),
        "precision": precision,
        "formula": formula_text(d.zero, precision),
        "formula_bytes": {
            "params": f.params,
            "grads": f.grads,
            "master": f.master,
            "optimizer": f.optimizer,
            "model_states": f.model_states(),
        },
        "ranks": ranks,
    });
    let text = serde_json::to_string_pretty(&doc).expect("serialises");
    std::fs::write(out.join("memory.json"), text).ctx(|| "writing memory.json".into())?;
    Ok(all
        .chunks_exact(mine.len())
        .enumerate()
        .map(|(r, v)| {
            let m = MemoryAccount::from_array(v);
            (r, m.total() as f64, u64::try_from(v[6]).ok())
        })
        .collect())
}
