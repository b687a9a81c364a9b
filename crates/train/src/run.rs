//! A whole training run as `xtrain train` drives it: the step loop with a progress bar,
//! periodic validation and checkpoints, metrics in `metrics.jsonl`, the loss plot, and a sample
//! at the end. The run directory holds `config.toml`, `metrics.jsonl`, `loss.png`, `loss.svg`,
//! `checkpoints/step_NNNNNN/` and `latest`.
use crate::checkpoint::{self, SaveOptions};
use crate::error::{IoContext, Result};
use crate::generate::{generate, SampleOptions};
use crate::metrics::{self, MetricsWriter, StepRecord};
use crate::progress::{StepBar, StepStatus};
use crate::trainer::Trainer;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of a run beyond its config.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub out_dir: PathBuf,
    /// Suppress the progress bar and messages (tests).
    pub quiet: bool,
}

/// What a run returns.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub first_loss: f64,
    pub last_loss: f64,
    pub val_loss: Option<f64>,
    pub sample: Option<String>,
    pub checkpoint: PathBuf,
}

/// Measured fp32 GEMM throughput (FLOP/s) of this machine with the current thread budget:
/// the best of a few 512³ products. The MFU denominator.
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

fn checkpoint_name(step: usize) -> String {
    format!("step_{step:06}")
}

/// Saves the trainer into `out/checkpoints/step_N` and points `out/latest` at it.
pub fn save_into_run(t: &Trainer, out: &Path) -> Result<PathBuf> {
    let name = checkpoint_name(t.step);
    let dir = out.join("checkpoints").join(&name);
    t.save_checkpoint(&dir, SaveOptions::default())?;
    checkpoint::set_latest(out, &format!("checkpoints/{name}"))?;
    Ok(dir)
}

/// Trains `t` until `train.steps`, logging into `opts.out_dir`.
pub fn run(t: &mut Trainer, opts: &RunOptions) -> Result<RunSummary> {
    let out = &opts.out_dir;
    std::fs::create_dir_all(out).ctx(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.toml"), t.cfg.to_toml())
        .ctx(|| "writing config.toml".into())?;
    let mut writer = MetricsWriter::append(&out.join("metrics.jsonl"))?;
    let total = t.cfg.train.steps;
    let peak = gemm_peak_flops();
    let fpt = t.flops_per_token();
    let say = |s: String| {
        if !opts.quiet {
            eprintln!("{s}");
        }
    };
    say(format!(
        "model: {} parameters ({} layers, hidden {}), data: {} ({} train / {} val tokens)",
        t.num_params(),
        t.cfg.model.num_layers,
        t.cfg.model.hidden_size,
        t.data.source,
        t.data.train.len(),
        t.data.val.len()
    ));
    say(format!(
        "memory ({:?}): {}",
        t.cfg.train.precision,
        t.memory().summary()
    ));
    say(format!(
        "FLOPs/token 6N+12LHS = {:.3e}; measured fp32 GEMM peak {:.1} GFLOP/s",
        fpt,
        peak / 1e9
    ));
    let mut bar = StepBar::new(total, t.step, opts.quiet, fpt, peak);
    let (mut first, mut last, mut last_val) = (f64::NAN, f64::NAN, None);
    while t.step < total {
        let ts = Instant::now();
        let r = t.train_step()?;
        let dt = ts.elapsed().as_secs_f64();
        if first.is_nan() {
            first = r.loss;
        }
        last = r.loss;
        let tps = r.tokens as f64 / dt.max(1e-9);
        let mut rec = StepRecord {
            step: r.step,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.stats.grad_norm,
            tokens_per_s: tps,
            mfu: tps * fpt / peak,
            val_loss: None,
            loss_scale: t.scaler.dynamic.then_some(t.scaler.scale),
            skipped: !r.stats.applied,
        };
        let every = t.cfg.train.eval_every;
        if (every > 0 && r.step % every == 0) || r.step == total {
            rec.val_loss = t.evaluate()?;
            last_val = rec.val_loss.or(last_val);
        }
        writer.write(&rec)?;
        bar.update(&StepStatus {
            step: r.step,
            loss: r.loss,
            val_loss: rec.val_loss,
            lr: r.lr,
            tokens: r.tokens,
        });
        let ck = t.cfg.train.ckpt_every;
        if ck > 0 && r.step % ck == 0 && r.step < total {
            save_into_run(t, out)?;
        }
    }
    bar.finish();
    let checkpoint = save_into_run(t, out)?;
    say(format!("checkpoint: {}", checkpoint.display()));
    let records = metrics::read(&out.join("metrics.jsonl"))?;
    metrics::plot_loss(&records, &out.join("loss.png"), &out.join("loss.svg"))?;
    say(format!(
        "metrics: {}/metrics.jsonl, plot: {}/loss.png (+ .svg)",
        out.display(),
        out.display()
    ));
    let sample = if t.cfg.train.sample_tokens > 0 {
        let o = SampleOptions {
            max_new_tokens: t.cfg.train.sample_tokens,
            temperature: 0.8,
            top_k: 20,
            seed: t.cfg.train.seed,
            context: t.cfg.model.seq_len,
        };
        let prompt = t.cfg.train.sample_prompt.clone();
        let text = generate(&t.model, t.weights.master(), &t.tokenizer, &prompt, &o)?;
        say(format!("sample: {prompt}{text}"));
        Some(text)
    } else {
        None
    };
    Ok(RunSummary {
        first_loss: first,
        last_loss: last,
        val_loss: last_val,
        sample,
        checkpoint,
    })
}
