//! `xtrain bench kernels`: the two kernels a transformer step spends most of its time in, at
//! one layer's shapes of a preset, on the run's device and precision: causal attention
//! (forward and backward) and the MLP's up projection, as GFLOP/s each, and attention's time
//! per FLOP against the product's (the GPU issue's floor: within 2×).
//!
//! FLOPs counted as FlashAttention-2 does (Dao 2023, §4): a causal forward is
//! 4·B·H·S²·D / 2 (two products of 2·S·S·D per head, half the scores masked), the backward
//! 2.5× the forward (five products to the forward's two); the product 2·M·K·N.
//!
//! On a GPU in a 16-bit step at head sizes up to 64 it also times the tensor-core kernel
//! choices (`tensor::cuda::ops::AttnKernels`: the forward and dQ with one or two m-tiles of
//! query rows a warp, the backward split or fused) against each other, alternating, and
//! prints the per-FLOP ratio each combination would give.
//!
//! `--doc-len N` also times attention under a document mask (`data.document_mask`): every
//! sequence packed with documents of N tokens, so that a query sees only the earlier keys of
//! its own document. The kernels skip the key tiles before a query block's documents, so the
//! time falls with the pairs the mask leaves (printed beside it: S·(N + 1)/2 of a sequence's
//! S·(S + 1)/2 causal pairs when N divides S).
use std::time::Instant;

use anyhow::{bail, Result};
use tensor::attention::AttnShape;
use tensor::buf::{Buf, Dev};

use crate::cmd::train::{resolve_config, LayoutArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Timed repetitions of each kernel (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Config overrides (`key=value`, repeatable), e.g. `--set model.seq_len=1024`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Also time attention under a document mask, each sequence packed with documents of
    /// this many tokens.
    #[arg(long, value_name = "TOKENS")]
    pub doc_len: Option<usize>,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

/// Median seconds of `reps` runs of `f` (after one warm-up), each waited for on `dev`.
fn median_secs(dev: &Dev, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let wait = || -> Result<()> {
        if let Dev::Cuda(g) = dev {
            g.synchronize()?;
        }
        Ok(())
    };
    f()?;
    wait()?;
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let s = Instant::now();
            f()?;
            wait()?;
            Ok(s.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Deterministic values in [-1, 1) on `dev`.
fn filled(dev: &Dev, n: usize, seed: u64) -> Result<Buf> {
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let x = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Ok(dev.from_vec(v)?)
}

pub fn run(a: Args) -> Result<()> {
    let cfg = resolve_config(Some(&a.preset), None, None, &a.layout, None, &a.overrides)?;
    if cfg.parallel.nproc > 1 {
        bail!("xtrain bench kernels runs one process: leave out --nproc and the layout flags");
    }
    let mc = train::trainer::model_config(&cfg);
    let dev = Dev::open(&cfg.train.device_spec())?;
    let exec = parallel::executor::ExecConfig {
        device: dev.clone(),
        precision: cfg.train.precision,
        ..Default::default()
    };
    let operands = exec.operands();
    let _scope = tensor::operands::Scope::enter(operands);
    let (b, s) = (cfg.train.micro_batch, cfg.model.seq_len);
    let shape = AttnShape::causal(b, s, mc.num_attention_heads, mc.kv_heads(), mc.head_dim());
    let (q, k, v, dout) = (
        filled(&dev, shape.q_elems(), 1)?,
        filled(&dev, shape.kv_elems(), 2)?,
        filled(&dev, shape.kv_elems(), 3)?,
        filled(&dev, shape.q_elems(), 4)?,
    );
    // Median seconds of attention's forward and backward under `docs` (the document starts
    // of every query, or none). The forward allocates its outputs (from the caching allocator
    // on a GPU: no driver call after the first), as in training.
    let attention = |docs: Option<&[usize]>| -> Result<(f64, f64)> {
        let (mut out, mut lse) = (Buf::Host(Vec::new()), Buf::Host(Vec::new()));
        let fwd = median_secs(&dev, a.reps, || {
            (out, lse) = tensor::ops::attention_forward(&shape, docs, q.r(), k.r(), v.r())?;
            Ok(())
        })?;
        let (mut dq, mut dk, mut dv) = (
            dev.zeros(shape.q_elems())?,
            dev.zeros(shape.kv_elems())?,
            dev.zeros(shape.kv_elems())?,
        );
        let bwd = median_secs(&dev, a.reps, || {
            tensor::ops::attention_backward(
                &shape,
                docs,
                q.r(),
                k.r(),
                v.r(),
                out.r(),
                lse.r(),
                dout.r(),
                dq.m(),
                dk.m(),
                dv.m(),
            )?;
            Ok(())
        })?;
        Ok((fwd, bwd))
    };
    let (fwd, bwd) = attention(None)?;
    let packed = match a.doc_len {
        Some(0) => bail!("--doc-len must be at least 1 token"),
        Some(n) => {
            let starts: Vec<usize> = (0..b)
                .flat_map(|_| (0..s).map(move |p| p / n * n))
                .collect();
            let pairs: usize = (0..s).map(|p| p - p / n * n + 1).sum();
            Some((
                n,
                attention(Some(&starts))?,
                pairs as f64 / (s * (s + 1) / 2) as f64,
            ))
        }
        None => None,
    };
    let attn_fwd_flops = 2.0 * (b * shape.n_heads * s * s * shape.head_dim) as f64;
    let attn_flops = 3.5 * attn_fwd_flops;
    let (m, kk, n) = (b * s, mc.hidden_size, mc.intermediate_size);
    let (x, w) = (filled(&dev, m * kk, 5)?, filled(&dev, n * kk, 6)?);
    let mut y = dev.zeros(m * n)?;
    let gemm = median_secs(&dev, a.reps, || {
        tensor::ops::matmul(y.m(), x.r(), w.r(), m, kk, n, false, true, false)?;
        Ok(())
    })?;
    let gemm_flops = 2.0 * (m * kk * n) as f64;
    let device = match &dev {
        Dev::Cuda(g) => format!(
            "cuda:{} {} (driver CUDA {}.{})",
            g.info.ordinal,
            g.info.name,
            g.info.driver_version / 1000,
            g.info.driver_version % 1000 / 10
        ),
        Dev::Cpu => format!(
            "CPU, {} thread(s), {}",
            tensor::threads::thread_budget(),
            tensor::isa::describe()
        ),
    };
    println!("preset {} on {device}", a.preset);
    println!(
        "precision {:?}: the products' operands {operands:?}",
        cfg.train.precision
    );
    let gf = |flops: f64, secs: f64| flops / secs / 1e9;
    println!(
        "attention (batch {b}, {} heads over {} KV heads, head {}, seq {s}, causal): forward {:.3} ms ({:.1} GFLOP/s), backward {:.3} ms ({:.1} GFLOP/s), together {:.1} GFLOP/s",
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
        fwd * 1e3,
        gf(attn_fwd_flops, fwd),
        bwd * 1e3,
        gf(2.5 * attn_fwd_flops, bwd),
        gf(attn_flops, fwd + bwd)
    );
    if let Some((n, (f, bk), share)) = packed {
        println!(
            "attention over packed documents of {n} tokens: forward {:.3} ms, backward {:.3} ms: {:.2} of the causal time, for {:.2} of its pairs",
            f * 1e3,
            bk * 1e3,
            (f + bk) / (fwd + bwd),
            share
        );
    }
    println!(
        "product [{m} x {kk}] x [{kk} x {n}] (the MLP's up projection): {:.3} ms ({:.1} GFLOP/s)",
        gemm * 1e3,
        gf(gemm_flops, gemm)
    );
    println!(
        "attention time per FLOP / the product's: {:.2}",
        ((fwd + bwd) / attn_flops) / (gemm / gemm_flops)
    );
    if let Some(choices) = kernel_choices(&dev, &shape, operands, [&q, &k, &v, &dout], a.reps)? {
        println!("tensor-core kernel choices, medians of 5 alternating rounds (range):");
        let ms = |t: &[f64]| {
            let (med, lo, hi) = median_range(t);
            format!("{:.3} ms ({:.3}..{:.3})", med * 1e3, lo * 1e3, hi * 1e3)
        };
        let total = |c: &Choice| median_range(&c.forward).0 + median_range(&c.backward).0;
        for c in &choices {
            println!(
                "  {:?}: forward {}, backward {}; attention time per FLOP / the product's: {:.2}{}",
                c.kernels,
                ms(&c.forward),
                ms(&c.backward),
                (total(c) / attn_flops) / (gemm / gemm_flops),
                if c.kernels == tensor::cuda::ops::ATTN_KERNELS {
                    " (the library's)"
                } else {
                    ""
                }
            );
        }
        let best = choices
            .iter()
            .min_by(|x, y| total(x).total_cmp(&total(y)))
            .expect("four choices");
        println!("  fastest: {:?}", best.kernels);
    }
    Ok(())
}

/// One tensor-core kernel choice's seconds, a median a round: its forward and its backward.
struct Choice {
    kernels: tensor::cuda::ops::AttnKernels,
    forward: Vec<f64>,
    backward: Vec<f64>,
}

/// The median, least and greatest of `t`.
fn median_range(t: &[f64]) -> (f64, f64, f64) {
    let mut t = t.to_vec();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0], t[t.len() - 1])
}

/// On a GPU in a 16-bit step at head sizes up to 64 (where the choices differ): every
/// tensor-core kernel choice (`tensor::cuda::ops::AttnKernels`: one or two m-tiles of query
/// rows a warp, the backward split or fused), its forward and backward each the median of
/// `reps` runs, in 5 rounds that take the choices in turn, so that all see the same minutes of
/// the machine.
fn kernel_choices(
    dev: &Dev,
    shape: &AttnShape,
    operands: tensor::operands::Operands,
    [q, k, v, dout]: [&Buf; 4],
    reps: usize,
) -> Result<Option<Vec<Choice>>> {
    use tensor::cuda::ops::{self as gpu, AttnBackwardKernels, AttnKernels, WarpRows};
    fn cuda(b: &Buf) -> Result<tensor::cuda::DevSlice<'_, f32>> {
        match b {
            Buf::Cuda(x) => Ok(x.as_slice()),
            Buf::Host(_) => bail!("a host buffer on a GPU run"),
        }
    }
    fn cuda_mut(b: &mut Buf) -> Result<tensor::cuda::DevSliceMut<'_, f32>> {
        match b {
            Buf::Cuda(x) => Ok(x.as_mut_slice()),
            Buf::Host(_) => bail!("a host buffer on a GPU run"),
        }
    }
    if !tensor::ops::attention_runs_on_tensor_cores(shape) || shape.head_dim > 64 {
        return Ok(None);
    }
    let (out, lse) = tensor::ops::attention_forward(shape, None, q.r(), k.r(), v.r())?;
    let [q16, k16, v16] =
        [q, k, v].map(|x| cuda(x).and_then(|x| Ok(gpu::rounded_copy(x, operands)?)));
    let (q16, k16, v16) = (q16?, k16?, v16?);
    let (mut o, mut l) = (dev.zeros(shape.q_elems())?, dev.zeros(shape.lse_elems())?);
    let (mut dq, mut dk, mut dv) = (
        dev.zeros(shape.q_elems())?,
        dev.zeros(shape.kv_elems())?,
        dev.zeros(shape.kv_elems())?,
    );
    let mut choices: Vec<Choice> = [WarpRows::One, WarpRows::Two]
        .into_iter()
        .flat_map(|warp_rows| {
            [AttnBackwardKernels::Split, AttnBackwardKernels::Fused].map(|backward| Choice {
                kernels: AttnKernels {
                    warp_rows,
                    backward,
                },
                forward: Vec::new(),
                backward: Vec::new(),
            })
        })
        .collect();
    for _round in 0..5 {
        for c in &mut choices {
            let kernels = c.kernels;
            c.forward.push(median_secs(dev, reps, || {
                gpu::attention_forward_tc(
                    kernels,
                    shape,
                    None,
                    operands,
                    &q16,
                    &k16,
                    &v16,
                    cuda_mut(&mut o)?,
                    cuda_mut(&mut l)?,
                )?;
                Ok(())
            })?);
            c.backward.push(median_secs(dev, reps, || {
                gpu::attention_backward_tc(
                    kernels,
                    shape,
                    None,
                    operands,
                    &q16,
                    &k16,
                    &v16,
                    cuda(&out)?,
                    cuda(&lse)?,
                    cuda(dout)?,
                    cuda_mut(&mut dq)?,
                    cuda_mut(&mut dk)?,
                    cuda_mut(&mut dv)?,
                )?;
                Ok(())
            })?);
        }
    }
    Ok(Some(choices))
}
