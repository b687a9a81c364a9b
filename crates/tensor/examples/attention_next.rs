//! The candidate tensor-core attention forward (`dev/attention/attention_tc_next.cu`, kernels
//! `attn_fwd_tc_next_k4` / `_k8`) and backward (`dev/attention/attention_tc_bwd_next.cu`,
//! kernels `attn_bwd_dq_tc_next_k4` / `_k8` and `attn_bwd_dkv_tc_next_k4` / `_k8`) against the
//! library's (`attn_fwd_tc_k4` / `_k8`, `attn_bwd_dq_tc_k4` / `_k8`, `attn_bwd_dkv_tc_k4` /
//! `_k8` of `crates/tensor/src/cuda/kernels/attention_tc.cu`): correctness against the CPU fp32
//! kernels and speed, on the shapes of the training runs plus the edge cases of the contract.
//!
//! `cargo run --release -p tensor --example attention_next [-- NAME=VALUE ...]`
//!
//! Each `NAME=VALUE` is put in front of both candidates' sources as `#define NAME VALUE` (e.g.
//! `TN_K4_MIN_BLOCKS=4` to compile the head-64 forward for 4 blocks an SM,
//! `TB_DKV_KV_REGS_K8=1` to keep the head-128 dK/dV kernel's K and V fragments in registers).
//! Without a GPU it prints one line saying so and exits 0.
//!
//! The tensor-core kernels, the library's and the candidates, take Q, K, V and dO as bf16 bits
//! (the fp32 values rounded to nearest even once, by the caller): the example rounds each
//! uploaded fp32 tensor once on the device (`tensor::cuda::ops::cast_f32_to_bf16`, into a
//! whole allocation, so 16-byte aligned as the kernels need) and gives the same bf16 buffers
//! to both wherever it launches them itself.
//!
//! # Forward
//!
//! Per shape, with the same random inputs (fixed seed, N(0, 1)):
//! 1. the library's kernel through `tensor::ops::attention_forward` in a bf16 operand scope
//!    (the tensor-core path: bf16 operands and a head size the kernels take);
//! 2. the candidate, compiled here with NVRTC for this GPU (prelude in front, as the library
//!    builds its modules) and launched through the driver on the default stream, on the bf16
//!    copies of Q, K, V, with `512 (D + 8)` bytes of dynamic shared memory (its two stages of
//!    K and V tiles);
//! 3. the CPU fp32 kernel (`tensor::attention::attention_forward`) on the unrounded inputs.
//!
//! Errors: `out` as max |x − cpu| / max |cpu|, `lse` as max |x − cpu| over the rows that see a
//! key (a row that sees none must give `lse = −inf` in both). PASS when the candidate's errors
//! are at most twice the library's plus 1e-6: both round Q, K, V and P to bf16 the same way
//! (nearest even), so both carry the same operand-rounding error; what differs is exp2 against
//! exp, the order of the sums and where P's rounding falls, which moves the error by far less
//! than the factor 2. Otherwise FAIL, naming the first element beyond that bound; the process
//! then exits with 1.
//!
//! Time: the median over 5 rounds of the mean of 20 back-to-back launches (after 3 warm-ups),
//! between CUDA events; the library's kernel is timed through `cuda::ops::attention_forward_tc`
//! on the same bf16 copies (the launch the bf16 path makes, without the rounding of Q, K, V
//! and the allocation of new `out` / `lse` buffers). TFLOP/s count 4·D FLOP per visible
//! (query, key) pair (`AttnShape::flops`, the two products): for causal attention with
//! Sq = Sk and no offsets that is 4·B·H·D·S(S + 1)/2, FlashAttention's 4·B·H·S²·D/2 up to a
//! factor (S + 1)/S.
//!
//! # Backward
//!
//! Per shape, with the forward's inputs plus a random `dO` (N(0, 1), the next seed), and the
//! CPU fp32 forward's `out` and `lse` as the backward's `out` and `lse` for all three (so that
//! the backward alone is compared, not the forward's error carried into it):
//! 1. the library's kernels through `tensor::ops::attention_backward` in a bf16 operand scope
//!    (`attn_bwd_delta`, then `attn_bwd_dq_tc`, then `attn_bwd_dkv_tc`), into zeroed `dq`,
//!    `dk`, `dv`;
//! 2. the candidate's two kernels on the default stream, into zeroed `dq`, `dk`, `dv`, on the
//!    bf16 copies of Q, K, V and dO, with `delta` from the library's `attn_bwd_delta` (module
//!    "attention", the same kernel the library's backward runs first, on the fp32 dO), and
//!    dynamic shared memory `512 (D + 8)` bytes (dQ) and `512 (D + 8) + 512` (dK/dV);
//! 3. the CPU fp32 kernel (`tensor::attention::attention_backward`) on the unrounded inputs.
//!
//! Errors: `dq`, `dk`, `dv` each as max |x − cpu| / max |cpu| (the forward's `out` rule). PASS
//! when each of the candidate's is at most twice the library's plus 1e-6 (the forward's rule,
//! for the same reasons: the same bf16 rounding of Q, K, V, dO, P and dS in both), and the
//! candidate accumulates: launched a second time on its own result it gives twice that result
//! (max |x₂ − 2x₁| / max |cpu| ≤ 1e-6: both launches add the same fp32 values, so only the
//! rounding of the second sum differs). Otherwise FAIL, naming the first element beyond the
//! bound; the process then exits with 1.
//!
//! Time: the dQ kernel and the dK/dV kernel timed apart (the forward's rule: median over 5
//! rounds of the mean of 20 back-to-back launches, after 3 warm-ups), the library's launched
//! through `Gpu::launch` with the launcher's grid, block and shared memory on the same bf16
//! buffers, accumulating into the same buffers; `attn_bwd_delta` and the rounding of dO (the
//! library's launcher runs both before its two kernels) are not timed. TFLOP/s count 10·D FLOP
//! per visible pair (`AttnShape::flops`: the five products `S`, `dP`, `dV`, `dK`, `dQ`, though
//! both backward kernels recompute `S` and `dP`), over the sum of the two kernels' times.

use std::error::Error;
use std::ffi::{c_void, CStr, CString};
use std::process::ExitCode;
use std::ptr::null_mut;
use std::sync::Arc;
use tensor::attention::{AttnShape, AttnTiles};
use tensor::buf::{Buf, BufMut, BufRef};
use tensor::cuda::{kernels, nvrtc, sys, DevBuf, Gpu, KArg, LaunchCfg};
use tensor::operands::{Operands, Scope};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// The forward candidate's source, without the prelude.
const SOURCE: &str = include_str!("../../../dev/attention/attention_tc_next.cu");

/// The backward candidate's source, without the prelude.
const BWD_SOURCE: &str = include_str!("../../../dev/attention/attention_tc_bwd_next.cu");

/// Threads a block, query rows a block.
const THREADS: u32 = 128;
const BLOCK_ROWS: usize = 64;

const WARMUP: usize = 3;
const LAUNCHES: usize = 20;
const ROUNDS: usize = 5;

fn main() -> ExitCode {
    let defines: Vec<String> = std::env::args().skip(1).collect();
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("attention_next: no GPU ({e}); nothing to compare");
            return ExitCode::SUCCESS;
        }
    };
    match run(&gpu, &defines) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("attention_next: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `(batch, q_len, kv_len, n_heads, n_kv_heads, head_dim, causal, q_start, k_start, what)`.
type Case = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    usize,
    usize,
    &'static str,
);

const CASES: &[Case] = &[
    (8, 1024, 1024, 12, 12, 64, true, 0, 0, "124M"),
    (4, 1024, 1024, 16, 16, 128, true, 0, 0, "head 128"),
    (2, 512, 512, 8, 2, 64, true, 0, 0, "GQA 8/2"),
    (2, 300, 300, 4, 4, 64, true, 0, 0, "ragged"),
    (1, 256, 512, 4, 4, 64, false, 0, 0, "non-causal"),
    (2, 256, 256, 8, 8, 64, true, 256, 0, "ring, after"),
    (1, 200, 300, 4, 2, 128, true, 50, 100, "ring, partial"),
    (2, 200, 200, 4, 4, 96, true, 0, 0, "head 96"),
    (1, 130, 70, 4, 1, 32, false, 0, 0, "head 32"),
];

fn run(gpu: &Arc<Gpu>, defines: &[String]) -> Result<bool> {
    let cand = Candidate::load(gpu, defines)?;
    let (major, minor) = nvrtc::version()?;
    let v = gpu.info.driver_version;
    println!(
        "attention_next: {} (sm_{}, {} SMs), driver CUDA {}.{}, NVRTC {major}.{minor}{}",
        gpu.info.name,
        gpu.info.arch(),
        gpu.info.multiprocessors,
        v / 1000,
        v % 1000 / 10,
        if defines.is_empty() {
            String::new()
        } else {
            format!(", defines {}", defines.join(" "))
        }
    );
    println!(
        "library attn_fwd_tc_k4/_k8 against candidate attn_fwd_tc_next_k4/_k8 (shared memory \
         512 (D + 8) bytes; bf16 Q, K, V); errors against the CPU fp32 kernel: out \
         max|x - cpu| / max|cpu|, lse max|x - cpu|; ms: median of {ROUNDS} rounds of \
         {LAUNCHES} launches; FLOP = 4 D per visible pair"
    );
    println!(
        "{:<40} {:<9} {:>9} {:>9} {:>9} {:>8} {:>7}",
        "B,Sq,Sk,H,Hkv,D,causal,q_start,k_start",
        "kernel",
        "out err",
        "lse err",
        "ms",
        "TFLOP/s",
        "lib/cand"
    );
    let mut all_pass = true;
    let mut bwd_rows = Vec::new();
    for (
        ci,
        &(batch, q_len, kv_len, n_heads, n_kv_heads, head_dim, causal, q_start, k_start, what),
    ) in CASES.iter().enumerate()
    {
        let s = AttnShape {
            batch,
            q_len,
            kv_len,
            n_heads,
            n_kv_heads,
            head_dim,
            causal,
            q_start,
            k_start,
        };
        let inp = Inputs::new(&s, 1000 + ci as u64)?;
        all_pass &= compare(gpu, &cand, &s, what, &inp)?;
        let (pass, rows) = compare_bwd(gpu, &cand, &s, what, &inp)?;
        all_pass &= pass;
        bwd_rows.extend(rows);
    }
    println!();
    println!(
        "library attn_bwd_dq_tc/attn_bwd_dkv_tc_k4/_k8 against candidate \
         attn_bwd_dq_tc_next/attn_bwd_dkv_tc_next_k4/_k8 (shared memory 512 (D + 8) and \
         512 (D + 8) + 512 bytes; bf16 Q, K, V, dO); errors against the CPU fp32 kernel: \
         max|x - cpu| / max|cpu|; ms: median of {ROUNDS} rounds of {LAUNCHES} launches \
         (attn_bwd_delta not timed); FLOP = 10 D per visible pair"
    );
    println!(
        "{:<40} {:<9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "B,Sq,Sk,H,Hkv,D,causal,q_start,k_start",
        "kernel",
        "dq err",
        "dk err",
        "dv err",
        "dq ms",
        "dkv ms",
        "ms",
        "TFLOP/s",
        "lib/cand"
    );
    for r in &bwd_rows {
        println!("{r}");
    }
    println!("{}", if all_pass { "all PASS" } else { "FAIL" });
    Ok(all_pass)
}

/// One shape's random inputs (fixed seeds) and the CPU fp32 forward's result on them.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    out_cpu: Vec<f32>,
    lse_cpu: Vec<f32>,
}

impl Inputs {
    fn new(s: &AttnShape, seed: u64) -> Result<Inputs> {
        let q = normal(s.q_elems(), seed);
        let k = normal(s.kv_elems(), seed + 1);
        let v = normal(s.kv_elems(), seed + 2);
        let dout = normal(s.q_elems(), seed + 3);
        let (mut out_cpu, mut lse_cpu) = (vec![0.0f32; s.q_elems()], vec![0.0f32; s.lse_elems()]);
        tensor::attention::attention_forward(
            s,
            &q,
            &k,
            &v,
            &mut out_cpu,
            &mut lse_cpu,
            AttnTiles::default(),
        )?;
        Ok(Inputs {
            q,
            k,
            v,
            dout,
            out_cpu,
            lse_cpu,
        })
    }
}

/// One shape's forward: errors and times of both kernels, one PASS / FAIL verdict.
fn compare(
    gpu: &Arc<Gpu>,
    cand: &Candidate,
    s: &AttnShape,
    what: &str,
    inp: &Inputs,
) -> Result<bool> {
    let (gq, gk, gv) = (
        gpu.upload(&inp.q)?,
        gpu.upload(&inp.k)?,
        gpu.upload(&inp.v)?,
    );
    // The tensor-core kernels' operands: bf16, rounded once.
    let (gq16, gk16, gv16) = (
        bf16_copy(gpu, &gq)?,
        bf16_copy(gpu, &gk)?,
        bf16_copy(gpu, &gv)?,
    );

    // (iii) The CPU fp32 kernel (run by `Inputs::new`).
    let (out_cpu, lse_cpu) = (&inp.out_cpu, &inp.lse_cpu);

    // (i) The library, on its tensor-core path.
    let (out_lib, lse_lib) = {
        let _bf16 = Scope::enter(Operands::Bf16);
        if !tensor::cuda::ops::tensor_core_attention_fits(s) {
            return Err(format!("{s:?} does not take the tensor-core kernels").into());
        }
        let (o, l) = tensor::ops::attention_forward(
            s,
            None,
            BufRef::Cuda(gq.as_slice()),
            BufRef::Cuda(gk.as_slice()),
            BufRef::Cuda(gv.as_slice()),
        )?;
        (host(o)?, host(l)?)
    };

    // (ii) The candidate, into buffers filled with NaN (an element it does not write fails).
    let mut go = gpu.upload(&vec![f32::NAN; s.q_elems()])?;
    let mut gl = gpu.upload(&vec![f32::NAN; s.lse_elems()])?;
    gpu.synchronize()?; // the uploads and the rounding ran on the library's stream
    cand.launch(s, &gq16, &gk16, &gv16, &mut go, &mut gl)?;
    cand.synchronize()?;
    let (out_cand, lse_cand) = (go.to_host()?, gl.to_host()?);

    let top = max_abs(out_cpu);
    let lib_out = out_err(&out_lib, out_cpu, top);
    let lib_lse = lse_err(&lse_lib, lse_cpu);
    let cand_out = out_err(&out_cand, out_cpu, top);
    let cand_lse = lse_err(&lse_cand, lse_cpu);
    let diff = out_err(&out_cand, &out_lib, top);

    // Times.
    let mut go_lib = gpu.alloc::<f32>(s.q_elems())?;
    let mut gl_lib = gpu.alloc::<f32>(s.lse_elems())?;
    let mut t_lib = Vec::new();
    let mut t_cand = Vec::new();
    for _ in 0..WARMUP {
        tensor::cuda::ops::attention_forward_tc(s, &gq16, &gk16, &gv16, &mut go_lib, &mut gl_lib)?;
    }
    gpu.synchronize()?;
    for _ in 0..WARMUP {
        cand.launch(s, &gq16, &gk16, &gv16, &mut go, &mut gl)?;
    }
    cand.synchronize()?;
    for _ in 0..ROUNDS {
        let ms = gpu.time_ms(|| {
            for _ in 0..LAUNCHES {
                tensor::cuda::ops::attention_forward_tc(
                    s,
                    &gq16,
                    &gk16,
                    &gv16,
                    &mut go_lib,
                    &mut gl_lib,
                )?;
            }
            Ok(())
        })?;
        t_lib.push(ms as f64 / LAUNCHES as f64);
        gpu.synchronize()?;
        let ms = cand.time_ms(|| {
            for _ in 0..LAUNCHES {
                cand.launch(s, &gq16, &gk16, &gv16, &mut go, &mut gl)?;
            }
            Ok(())
        })?;
        t_cand.push(ms as f64 / LAUNCHES as f64);
    }
    let (ms_lib, ms_cand) = (median(&mut t_lib), median(&mut t_cand));
    let flops = s.flops().0;
    let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;

    // Verdict: the candidate's errors within twice the library's plus 1e-6.
    let bound_out = 2.0 * lib_out.err + 1e-6;
    let bound_lse = 2.0 * lib_lse.err + 1e-6;
    let mut why = Vec::new();
    if lib_out.bad.is_some() || lib_lse.bad.is_some() {
        why.push("the library's own result is not finite where the CPU's is".to_string());
    }
    if cand_out.err > bound_out {
        let i = first_beyond(&out_cand, out_cpu, top, bound_out);
        why.push(format!(
            "out err {:.2e} > {bound_out:.2e}; first at {} = {}: candidate {}, library {}, cpu {}",
            cand_out.err,
            i,
            coords_q(s, i),
            out_cand[i],
            out_lib[i],
            out_cpu[i]
        ));
    }
    if let Some(i) = cand_lse.bad {
        why.push(format!(
            "lse at {i} = {}: candidate {}, library {}, cpu {} (finite against -inf, or NaN)",
            coords_lse(s, i),
            lse_cand[i],
            lse_lib[i],
            lse_cpu[i]
        ));
    } else if cand_lse.err > bound_lse {
        let i = (0..lse_cpu.len())
            .find(|&i| {
                lse_cpu[i].is_finite() && (lse_cand[i] - lse_cpu[i]).abs() as f64 > bound_lse
            })
            .unwrap_or(0);
        why.push(format!(
            "lse err {:.2e} > {bound_lse:.2e}; first at {i} = {}: candidate {}, library {}, cpu {}",
            cand_lse.err,
            coords_lse(s, i),
            lse_cand[i],
            lse_lib[i],
            lse_cpu[i]
        ));
    }
    let pass = why.is_empty();
    let label = label(s, what);
    println!(
        "{:<40} {:<9} {:>9.2e} {:>9.2e} {:>9.4} {:>8.1}",
        label,
        "library",
        lib_out.err,
        lib_lse.err,
        ms_lib,
        tflops(ms_lib)
    );
    println!(
        "{:<40} {:<9} {:>9.2e} {:>9.2e} {:>9.4} {:>8.1} {:>6.2}x {} (cand - lib: out {:.2e})",
        "",
        "candidate",
        cand_out.err,
        cand_lse.err,
        ms_cand,
        tflops(ms_cand),
        ms_lib / ms_cand,
        if pass { "PASS" } else { "FAIL" },
        diff.err
    );
    for w in &why {
        println!("{:<40}   FAIL: {w}", "");
    }
    Ok(pass)
}

/// The shape's label in the tables.
fn label(s: &AttnShape, what: &str) -> String {
    format!(
        "{},{},{},{},{},{},{},{},{} {what}",
        s.batch,
        s.q_len,
        s.kv_len,
        s.n_heads,
        s.n_kv_heads,
        s.head_dim,
        if s.causal { "c" } else { "nc" },
        s.q_start,
        s.k_start
    )
}

/// max |x| over `v`, at least the smallest normal (a divisor).
fn max_abs(v: &[f32]) -> f32 {
    v.iter()
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE)
}

/// `x` rounded to bf16 (nearest even) on the device, once, as the library rounds the
/// tensor-core kernels' operands (`Operand::new` runs the same cast), into a whole allocation:
/// 16-byte aligned, as the kernels read their rows 16 bytes at a time. On the library's
/// stream.
fn bf16_copy(gpu: &Arc<Gpu>, x: &DevBuf<f32>) -> Result<DevBuf<u16>> {
    let mut y = gpu.alloc::<u16>(x.len())?;
    tensor::cuda::ops::cast_f32_to_bf16(x, &mut y)?;
    Ok(y)
}

/// The backward's inputs on the GPU (`out` and `lse`: the CPU forward's): the fp32 tensors
/// (for the library's `attention_backward`, which rounds them itself, and for `delta`) and the
/// bf16 copies of Q, K, V and dO that the tensor-core kernels launched here take.
struct BwdIn {
    q: DevBuf<f32>,
    k: DevBuf<f32>,
    v: DevBuf<f32>,
    out: DevBuf<f32>,
    lse: DevBuf<f32>,
    dout: DevBuf<f32>,
    delta: DevBuf<f32>,
    q16: DevBuf<u16>,
    k16: DevBuf<u16>,
    v16: DevBuf<u16>,
    dout16: DevBuf<u16>,
}

/// `dq`, `dk`, `dv` on the GPU, zeroed.
struct Grads {
    dq: DevBuf<f32>,
    dk: DevBuf<f32>,
    dv: DevBuf<f32>,
}

impl Grads {
    fn zeros(gpu: &Arc<Gpu>, s: &AttnShape) -> Result<Grads> {
        Ok(Grads {
            dq: gpu.zeros(s.q_elems())?,
            dk: gpu.zeros(s.kv_elems())?,
            dv: gpu.zeros(s.kv_elems())?,
        })
    }

    /// `(dq, dk, dv)` on the host (waits for the library's stream; the caller synchronises
    /// the default stream first where the candidate wrote them).
    fn host(&self) -> Result<[Vec<f32>; 3]> {
        Ok([self.dq.to_host()?, self.dk.to_host()?, self.dv.to_host()?])
    }
}

/// The kernel arguments after the pointers, as `attn_args` of `tensor::cuda::ops` gives them.
fn shape_args(s: &AttnShape) -> Vec<KArg> {
    let i32_of = |x: usize| KArg::from(i32::try_from(x).expect("fits a kernel argument"));
    vec![
        i32_of(s.batch),
        i32_of(s.q_len),
        i32_of(s.kv_len),
        i32_of(s.n_heads),
        i32_of(s.n_kv_heads),
        i32_of(s.head_dim),
        KArg::from(s.causal as i32),
        i32_of(s.q_start),
        i32_of(s.k_start),
        KArg::from(s.scale()),
    ]
}

/// `delta = rowsum(dO ∘ O)` with the library's kernel (`attn_bwd_delta` of module "attention",
/// launched as `tensor::cuda::ops` launches it).
fn library_delta(gpu: &Arc<Gpu>, s: &AttnShape, i: &mut BwdIn) -> Result<()> {
    let rows = s.batch * s.q_len * s.n_heads;
    let i32_of = |x: usize| KArg::from(i32::try_from(x).expect("fits a kernel argument"));
    gpu.launch(
        "attention",
        "attn_bwd_delta",
        LaunchCfg::linear(rows.div_ceil(4), 128),
        &[
            (&i.out).into(),
            (&i.dout).into(),
            (&i.delta).into(),
            i32_of(s.batch),
            i32_of(s.q_len),
            i32_of(s.n_heads),
            i32_of(s.head_dim),
        ],
    )?;
    Ok(())
}

/// The library's dQ kernel (`dkv == false`: shared memory `256 (D + 8)` bytes, a block per 64
/// query rows) or dK/dV kernel (`384 (D + 8) + 256` bytes, a block per 64 keys) alone, with the
/// launcher's grid, block and shared memory, on the library's stream, on the bf16 Q, K, V, dO.
fn library_bwd(gpu: &Arc<Gpu>, s: &AttnShape, i: &BwdIn, g: &mut Grads, dkv: bool) -> Result<()> {
    let mut args: Vec<KArg> = vec![
        (&i.q16).into(),
        (&i.k16).into(),
        (&i.v16).into(),
        (&i.dout16).into(),
        (&i.lse).into(),
        (&i.delta).into(),
    ];
    let (kernel, rows, heads, shared) = if dkv {
        args.extend::<[KArg; 2]>([(&g.dk).into(), (&g.dv).into()]);
        let k = ["attn_bwd_dkv_tc_k4", "attn_bwd_dkv_tc_k8"];
        (k, s.kv_len, s.n_kv_heads, 384 * (s.head_dim + 8) + 256)
    } else {
        args.push((&g.dq).into());
        let k = ["attn_bwd_dq_tc_k4", "attn_bwd_dq_tc_k8"];
        (k, s.q_len, s.n_heads, 256 * (s.head_dim + 8))
    };
    args.extend(shape_args(s));
    gpu.launch(
        "attention_tc",
        kernel[usize::from(s.head_dim > 64)],
        LaunchCfg {
            grid: (
                rows.div_ceil(BLOCK_ROWS) as u32,
                (s.batch * heads) as u32,
                1,
            ),
            block: (THREADS, 1, 1),
            shared_bytes: shared as u32,
        },
        &args,
    )?;
    Ok(())
}

/// Median milliseconds of one launch of `f` (the forward's rule: `WARMUP` launches, then
/// `ROUNDS` rounds of `LAUNCHES` back-to-back launches between events): events on the
/// library's stream where `cand` is `None` (`f` launches a library kernel), on the default
/// stream where it is the candidate's.
fn time_launches(
    gpu: &Arc<Gpu>,
    cand: Option<&Candidate>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut t = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let ms = match cand {
            None => {
                let mut r = Ok(());
                let ms = gpu.time_ms(|| {
                    for _ in 0..LAUNCHES {
                        if let Err(e) = f() {
                            r = Err(e);
                            break;
                        }
                    }
                    Ok(())
                })?;
                r?;
                ms
            }
            Some(c) => c.time_ms(|| {
                for _ in 0..LAUNCHES {
                    f()?;
                }
                Ok(())
            })?,
        };
        t.push(ms as f64 / LAUNCHES as f64);
    }
    match cand {
        None => gpu.synchronize()?,
        Some(c) => c.synchronize()?,
    }
    Ok(median(&mut t))
}

/// One shape's backward: errors and times of both kernel pairs, one PASS / FAIL verdict; the
/// table's rows are returned (printed after the forward's table).
fn compare_bwd(
    gpu: &Arc<Gpu>,
    cand: &Candidate,
    s: &AttnShape,
    what: &str,
    inp: &Inputs,
) -> Result<(bool, Vec<String>)> {
    let (q, k, v, dout) = (
        gpu.upload(&inp.q)?,
        gpu.upload(&inp.k)?,
        gpu.upload(&inp.v)?,
        gpu.upload(&inp.dout)?,
    );
    let mut i = BwdIn {
        q16: bf16_copy(gpu, &q)?,
        k16: bf16_copy(gpu, &k)?,
        v16: bf16_copy(gpu, &v)?,
        dout16: bf16_copy(gpu, &dout)?,
        q,
        k,
        v,
        out: gpu.upload(&inp.out_cpu)?,
        lse: gpu.upload(&inp.lse_cpu)?,
        dout,
        delta: gpu.alloc::<f32>(s.lse_elems())?,
    };

    // (iii) The CPU fp32 kernel.
    let mut cpu = [
        vec![0.0f32; s.q_elems()],
        vec![0.0f32; s.kv_elems()],
        vec![0.0f32; s.kv_elems()],
    ];
    {
        let [dq, dk, dv] = &mut cpu;
        tensor::attention::attention_backward(
            s,
            &inp.q,
            &inp.k,
            &inp.v,
            &inp.out_cpu,
            &inp.lse_cpu,
            &inp.dout,
            dq,
            dk,
            dv,
            AttnTiles::default(),
        )?;
    }

    // (i) The library, on its tensor-core path.
    let mut lib = Grads::zeros(gpu, s)?;
    {
        let _bf16 = Scope::enter(Operands::Bf16);
        tensor::ops::attention_backward(
            s,
            None,
            BufRef::Cuda(i.q.as_slice()),
            BufRef::Cuda(i.k.as_slice()),
            BufRef::Cuda(i.v.as_slice()),
            BufRef::Cuda(i.out.as_slice()),
            BufRef::Cuda(i.lse.as_slice()),
            BufRef::Cuda(i.dout.as_slice()),
            BufMut::Cuda(lib.dq.as_mut_slice()),
            BufMut::Cuda(lib.dk.as_mut_slice()),
            BufMut::Cuda(lib.dv.as_mut_slice()),
        )?;
    }
    let lib_h = lib.host()?;

    // (ii) The candidate, with the library's delta; then once more on top of its result.
    library_delta(gpu, s, &mut i)?;
    let mut cg = Grads::zeros(gpu, s)?;
    gpu.synchronize()?; // delta, the rounding and the zeroing ran on the library's stream
    cand.launch_dq(s, &i, &mut cg.dq)?;
    cand.launch_dkv(s, &i, &mut cg.dk, &mut cg.dv)?;
    cand.synchronize()?;
    let cand_h = cg.host()?;
    cand.launch_dq(s, &i, &mut cg.dq)?;
    cand.launch_dkv(s, &i, &mut cg.dk, &mut cg.dv)?;
    cand.synchronize()?;
    let twice = cg.host()?;

    let names = ["dq", "dk", "dv"];
    let tops = [max_abs(&cpu[0]), max_abs(&cpu[1]), max_abs(&cpu[2])];
    let lib_e: Vec<Deviation> = (0..3)
        .map(|x| out_err(&lib_h[x], &cpu[x], tops[x]))
        .collect();
    let cand_e: Vec<Deviation> = (0..3)
        .map(|x| out_err(&cand_h[x], &cpu[x], tops[x]))
        .collect();
    let diff: Vec<Deviation> = (0..3)
        .map(|x| out_err(&cand_h[x], &lib_h[x], tops[x]))
        .collect();
    let doubled: Vec<Vec<f32>> = cand_h
        .iter()
        .map(|x| x.iter().map(|a| 2.0 * a).collect())
        .collect();
    let acc_e: Vec<Deviation> = (0..3)
        .map(|x| out_err(&twice[x], &doubled[x], tops[x]))
        .collect();

    // Times: each kernel of each pair apart (they accumulate into the buffers: harmless).
    let mut lg = Grads::zeros(gpu, s)?;
    let lib_dq_ms = time_launches(gpu, None, || library_bwd(gpu, s, &i, &mut lg, false))?;
    let lib_dkv_ms = time_launches(gpu, None, || library_bwd(gpu, s, &i, &mut lg, true))?;
    let cand_dq_ms = time_launches(gpu, Some(cand), || cand.launch_dq(s, &i, &mut cg.dq))?;
    let cand_dkv_ms = time_launches(gpu, Some(cand), || {
        cand.launch_dkv(s, &i, &mut cg.dk, &mut cg.dv)
    })?;
    let (ms_lib, ms_cand) = (lib_dq_ms + lib_dkv_ms, cand_dq_ms + cand_dkv_ms);
    let flops = s.flops().1;
    let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;

    // Verdict: each error within twice the library's plus 1e-6, and `+=`.
    let mut why = Vec::new();
    for x in 0..3 {
        if lib_e[x].bad.is_some() {
            why.push(format!(
                "the library's own {} is not finite where the CPU's is",
                names[x]
            ));
        }
        let bound = 2.0 * lib_e[x].err + 1e-6;
        if cand_e[x].err > bound {
            let e = first_beyond(&cand_h[x], &cpu[x], tops[x], bound);
            let at = if x == 0 {
                coords_q(s, e)
            } else {
                coords_kv(s, e)
            };
            why.push(format!(
                "{} err {:.2e} > {bound:.2e}; first at {e} = {at}: candidate {}, library {}, \
                 cpu {}",
                names[x], cand_e[x].err, cand_h[x][e], lib_h[x][e], cpu[x][e]
            ));
        }
        if acc_e[x].err > 1e-6 {
            let e = first_beyond(&twice[x], &doubled[x], tops[x], 1e-6);
            why.push(format!(
                "{} does not accumulate: a second launch gives {} at {e}, twice the first is {}",
                names[x], twice[x][e], doubled[x][e]
            ));
        }
    }
    let pass = why.is_empty();
    let mut rows = vec![
        format!(
            "{:<40} {:<9} {:>9.2e} {:>9.2e} {:>9.2e} {:>8.4} {:>8.4} {:>8.4} {:>8.1}",
            label(s, what),
            "library",
            lib_e[0].err,
            lib_e[1].err,
            lib_e[2].err,
            lib_dq_ms,
            lib_dkv_ms,
            ms_lib,
            tflops(ms_lib)
        ),
        format!(
            "{:<40} {:<9} {:>9.2e} {:>9.2e} {:>9.2e} {:>8.4} {:>8.4} {:>8.4} {:>8.1} {:>6.2}x {} \
             (cand - lib: dq {:.2e}, dk {:.2e}, dv {:.2e})",
            "",
            "candidate",
            cand_e[0].err,
            cand_e[1].err,
            cand_e[2].err,
            cand_dq_ms,
            cand_dkv_ms,
            ms_cand,
            tflops(ms_cand),
            ms_lib / ms_cand,
            if pass { "PASS" } else { "FAIL" },
            diff[0].err,
            diff[1].err,
            diff[2].err
        ),
    ];
    for w in &why {
        rows.push(format!("{:<40}   FAIL: {w}", ""));
    }
    Ok((pass, rows))
}

/// The largest error of a result and the first element that is not finite where the
/// reference is (or is NaN), if any.
struct Deviation {
    err: f64,
    bad: Option<usize>,
}

/// max |x − r| / top over `out`; a non-finite x counts as an infinite error.
fn out_err(x: &[f32], r: &[f32], top: f32) -> Deviation {
    let mut e = Deviation {
        err: 0.0,
        bad: None,
    };
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        let d = if a.is_finite() {
            ((a - b).abs() / top) as f64
        } else {
            if e.bad.is_none() {
                e.bad = Some(i);
            }
            f64::INFINITY
        };
        e.err = e.err.max(d);
    }
    e
}

/// max |x − r| over the rows where `r` is finite; elsewhere (`r = −inf`: the row sees no key)
/// x must be −inf too.
fn lse_err(x: &[f32], r: &[f32]) -> Deviation {
    let mut e = Deviation {
        err: 0.0,
        bad: None,
    };
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        let ok = if b.is_finite() { a.is_finite() } else { a == b };
        if !ok {
            e.bad.get_or_insert(i);
            e.err = f64::INFINITY;
        } else if b.is_finite() {
            e.err = e.err.max((a - b).abs() as f64);
        }
    }
    e
}

fn first_beyond(x: &[f32], r: &[f32], top: f32, bound: f64) -> usize {
    (0..x.len())
        .find(|&i| !x[i].is_finite() || ((x[i] - r[i]).abs() / top) as f64 > bound)
        .unwrap_or(0)
}

/// `(b, i, h, d)` of element `e` of a `[B, Sq, H, D]` tensor.
fn coords_q(s: &AttnShape, e: usize) -> String {
    let d = e % s.head_dim;
    let h = e / s.head_dim % s.n_heads;
    let i = e / (s.head_dim * s.n_heads) % s.q_len;
    let b = e / (s.head_dim * s.n_heads * s.q_len);
    format!("(b {b}, i {i}, h {h}, d {d})")
}

/// `(b, j, hk, d)` of element `e` of a `[B, Sk, Hkv, D]` tensor.
fn coords_kv(s: &AttnShape, e: usize) -> String {
    let d = e % s.head_dim;
    let h = e / s.head_dim % s.n_kv_heads;
    let j = e / (s.head_dim * s.n_kv_heads) % s.kv_len;
    let b = e / (s.head_dim * s.n_kv_heads * s.kv_len);
    format!("(b {b}, j {j}, hk {h}, d {d})")
}

/// `(b, h, i)` of element `e` of `lse` `[B, H, Sq]`.
fn coords_lse(s: &AttnShape, e: usize) -> String {
    let i = e % s.q_len;
    let h = e / s.q_len % s.n_heads;
    let b = e / (s.q_len * s.n_heads);
    format!("(b {b}, h {h}, i {i})")
}

fn host(b: Buf) -> Result<Vec<f32>> {
    Ok(b.into_vec()?)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `n` samples of N(0, 1) (Box–Muller on a 64-bit LCG), the same for the same seed.
fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x2545_F491_4F6C_DD1D;
    let mut uniform = move || {
        st = st
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((st >> 11) as f64 + 0.5) / (1u64 << 53) as f64 // in (0, 1)
    };
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (u1, u2) = (uniform(), uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// The candidates' modules, loaded into the context of the [`Gpu`] (the primary context,
/// which `Gpu::open` made current on this thread).
struct Candidate {
    lib: &'static sys::Driver,
    k4: sys::CUfunction,
    k8: sys::CUfunction,
    dq_k4: sys::CUfunction,
    dq_k8: sys::CUfunction,
    dkv_k4: sys::CUfunction,
    dkv_k8: sys::CUfunction,
}

/// The forward candidate's dynamic shared memory for head size `d` (the kernel's header): two
/// stages of a bf16 K and V tile of 64 rows, row stride `d + 8`; the backward candidate's dQ
/// kernel takes the same.
fn shared_bytes(d: usize) -> u32 {
    (2 * 2 * BLOCK_ROWS * (d + 8) * 2) as u32
}

/// The backward candidate's dK/dV kernel's dynamic shared memory (the kernel's header): its
/// bf16 K and V tiles (64 rows), two stages of the step's Q and dO tiles (32 rows) and of their
/// lse and delta (32 fp32 each).
fn dkv_shared_bytes(d: usize) -> u32 {
    ((2 * BLOCK_ROWS + 2 * 2 * 32) * (d + 8) * 2 + 2 * 2 * 32 * 4) as u32
}

impl Candidate {
    fn load(gpu: &Gpu, defines: &[String]) -> Result<Candidate> {
        let lib = sys::driver()?;
        let fwd = load_module(gpu, lib, defines, "attention_tc_next", SOURCE)?;
        let bwd = load_module(gpu, lib, defines, "attention_tc_bwd_next", BWD_SOURCE)?;
        Ok(Candidate {
            lib,
            k4: function(lib, fwd, "attn_fwd_tc_next_k4", shared_bytes(64))?,
            k8: function(lib, fwd, "attn_fwd_tc_next_k8", shared_bytes(128))?,
            dq_k4: function(lib, bwd, "attn_bwd_dq_tc_next_k4", shared_bytes(64))?,
            dq_k8: function(lib, bwd, "attn_bwd_dq_tc_next_k8", shared_bytes(128))?,
            dkv_k4: function(lib, bwd, "attn_bwd_dkv_tc_next_k4", dkv_shared_bytes(64))?,
            dkv_k8: function(lib, bwd, "attn_bwd_dkv_tc_next_k8", dkv_shared_bytes(128))?,
        })
    }

    /// Queues the forward candidate on the default stream, with the library launcher's grid, on
    /// bf16 `q`, `k`, `v` (16-byte aligned, as the library's launcher checks its own).
    fn launch(
        &self,
        s: &AttnShape,
        q: &DevBuf<u16>,
        k: &DevBuf<u16>,
        v: &DevBuf<u16>,
        out: &mut DevBuf<f32>,
        lse: &mut DevBuf<f32>,
    ) -> Result<()> {
        assert!(s.head_dim.is_multiple_of(16) && (16..=128).contains(&s.head_dim));
        check_aligned(&[("q", q.ptr()), ("k", k.ptr()), ("v", v.ptr())])?;
        assert_eq!(
            (q.len(), k.len(), v.len(), out.len(), lse.len()),
            (
                s.q_elems(),
                s.kv_elems(),
                s.kv_elems(),
                s.q_elems(),
                s.lse_elems()
            )
        );
        let f = if s.head_dim <= 64 { self.k4 } else { self.k8 };
        let grid = (
            s.q_len.div_ceil(BLOCK_ROWS) as u32,
            (s.batch * s.n_heads) as u32,
        );
        let ptrs = [q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr()];
        self.launch_raw(f, grid, shared_bytes(s.head_dim), &ptrs, s)
    }

    /// Queues the backward candidate's dQ kernel on the default stream, with the library
    /// launcher's grid (`delta` in `i` already computed).
    fn launch_dq(&self, s: &AttnShape, i: &BwdIn, dq: &mut DevBuf<f32>) -> Result<()> {
        self.check_bwd(s, i)?;
        assert_eq!(dq.len(), s.q_elems());
        if s.q_len == 0 || s.kv_len == 0 {
            return Ok(()); // as the library's launcher: nothing to add
        }
        let f = if s.head_dim <= 64 {
            self.dq_k4
        } else {
            self.dq_k8
        };
        let grid = (
            s.q_len.div_ceil(BLOCK_ROWS) as u32,
            (s.batch * s.n_heads) as u32,
        );
        let ptrs = [
            i.q16.ptr(),
            i.k16.ptr(),
            i.v16.ptr(),
            i.dout16.ptr(),
            i.lse.ptr(),
            i.delta.ptr(),
            dq.ptr(),
        ];
        self.launch_raw(f, grid, shared_bytes(s.head_dim), &ptrs, s)
    }

    /// Queues the backward candidate's dK/dV kernel on the default stream, with the library
    /// launcher's grid.
    fn launch_dkv(
        &self,
        s: &AttnShape,
        i: &BwdIn,
        dk: &mut DevBuf<f32>,
        dv: &mut DevBuf<f32>,
    ) -> Result<()> {
        self.check_bwd(s, i)?;
        assert_eq!((dk.len(), dv.len()), (s.kv_elems(), s.kv_elems()));
        if s.q_len == 0 || s.kv_len == 0 {
            return Ok(());
        }
        let f = if s.head_dim <= 64 {
            self.dkv_k4
        } else {
            self.dkv_k8
        };
        let grid = (
            s.kv_len.div_ceil(BLOCK_ROWS) as u32,
            (s.batch * s.n_kv_heads) as u32,
        );
        let ptrs = [
            i.q16.ptr(),
            i.k16.ptr(),
            i.v16.ptr(),
            i.dout16.ptr(),
            i.lse.ptr(),
            i.delta.ptr(),
            dk.ptr(),
            dv.ptr(),
        ];
        self.launch_raw(f, grid, dkv_shared_bytes(s.head_dim), &ptrs, s)
    }

    /// The backward candidate's requirements: the head size the kernels take, the buffers'
    /// lengths, and 16-byte aligned bf16 q, k, v, dout (cp.async copies 16 bytes of a row, as
    /// the library's launcher checks for its own; the outputs need 8 bytes, which every
    /// allocation has).
    fn check_bwd(&self, s: &AttnShape, i: &BwdIn) -> Result<()> {
        assert!(s.head_dim.is_multiple_of(16) && (16..=128).contains(&s.head_dim));
        assert_eq!(
            (i.q16.len(), i.k16.len(), i.v16.len(), i.dout16.len()),
            (s.q_elems(), s.kv_elems(), s.kv_elems(), s.q_elems())
        );
        assert_eq!((i.lse.len(), i.delta.len()), (s.lse_elems(), s.lse_elems()));
        check_aligned(&[
            ("q", i.q16.ptr()),
            ("k", i.k16.ptr()),
            ("v", i.v16.ptr()),
            ("dout", i.dout16.ptr()),
        ])
    }

    /// Queues `f` on the default stream: grid (x, y), 128 threads, `shared` bytes of dynamic
    /// shared memory; arguments `ptrs`, then the shape's (9 ints and the scale).
    fn launch_raw(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32),
        shared: u32,
        ptrs: &[u64],
        s: &AttnShape,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        let mut ptrs = ptrs.to_vec();
        let i32_of = |x: usize| i32::try_from(x).expect("fits a kernel argument");
        let mut ints = [
            i32_of(s.batch),
            i32_of(s.q_len),
            i32_of(s.kv_len),
            i32_of(s.n_heads),
            i32_of(s.n_kv_heads),
            i32_of(s.head_dim),
            s.causal as i32,
            i32_of(s.q_start),
            i32_of(s.k_start),
        ];
        let mut scale = s.scale();
        let mut params: Vec<*mut c_void> = Vec::with_capacity(ptrs.len() + 10);
        params.extend(ptrs.iter_mut().map(|p| p as *mut u64 as *mut c_void));
        params.extend(ints.iter_mut().map(|p| p as *mut i32 as *mut c_void));
        params.push(&mut scale as *mut f32 as *mut c_void);
        // SAFETY: the callers pass the pointers of the kernel's signature in order (the
        // forward's 5, the dQ kernel's 7, the dK/dV kernel's 8), then 9 ints and a float
        // follow as every candidate kernel takes them; all live until the call returns, and
        // the buffers hold the elements the shape names (asserted by the callers).
        check(
            self.lib,
            unsafe {
                (self.lib.cuLaunchKernel)(
                    f,
                    grid.0,
                    grid.1,
                    1,
                    THREADS,
                    1,
                    1,
                    shared,
                    null_mut(),
                    params.as_mut_ptr(),
                    null_mut(),
                )
            },
            "cuLaunchKernel(candidate)",
        )
    }

    /// Waits for everything queued on the device.
    fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments; the context is current.
        check(
            self.lib,
            unsafe { (self.lib.cuCtxSynchronize)() },
            "cuCtxSynchronize",
        )
    }

    /// Milliseconds of `f`'s launches on the default stream, between two events.
    fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let lib = self.lib;
        let (mut a, mut b): (sys::CUevent, sys::CUevent) = (null_mut(), null_mut());
        // SAFETY: events created, recorded on the default stream, waited for and destroyed here.
        unsafe {
            check(
                lib,
                (lib.cuEventCreate)(&mut a, sys::CU_EVENT_DEFAULT),
                "cuEventCreate",
            )?;
            check(
                lib,
                (lib.cuEventCreate)(&mut b, sys::CU_EVENT_DEFAULT),
                "cuEventCreate",
            )?;
        }
        let out = (|| {
            // SAFETY: as above.
            unsafe { check(lib, (lib.cuEventRecord)(a, null_mut()), "cuEventRecord")? };
            f()?;
            let mut ms = 0f32;
            // SAFETY: as above.
            unsafe {
                check(lib, (lib.cuEventRecord)(b, null_mut()), "cuEventRecord")?;
                check(lib, (lib.cuEventSynchronize)(b), "cuEventSynchronize")?;
                check(
                    lib,
                    (lib.cuEventElapsedTime)(&mut ms, a, b),
                    "cuEventElapsedTime",
                )?;
            }
            Ok(ms)
        })();
        // SAFETY: the events created above, no longer in use.
        unsafe {
            (lib.cuEventDestroy_v2)(a);
            (lib.cuEventDestroy_v2)(b);
        }
        out
    }
}

/// The candidates read their bf16 inputs' rows 16 bytes at a time: each named buffer must
/// start 16-byte aligned.
fn check_aligned(bufs: &[(&str, u64)]) -> Result<()> {
    match bufs.iter().find(|(_, p)| !p.is_multiple_of(16)) {
        Some((name, _)) => Err(format!("the candidates need {name} 16-byte aligned").into()),
        None => Ok(()),
    }
}

/// Compiles a candidate's source with NVRTC for this GPU (the `NAME=VALUE` defines, then the
/// prelude, then the file, as `tensor::cuda::kernels::source` builds a module) and loads it;
/// the module stays loaded for the life of the process.
fn load_module(
    gpu: &Gpu,
    lib: &'static sys::Driver,
    defines: &[String],
    name: &str,
    source: &str,
) -> Result<sys::CUmodule> {
    let mut src = String::new();
    for d in defines {
        let (n, value) = d.split_once('=').unwrap_or((d.as_str(), ""));
        src.push_str(&format!("#define {n} {value}\n"));
    }
    src.push_str(&format!(
        "{}\n#line 1 \"{name}.cu\"\n{source}",
        kernels::PRELUDE
    ));
    let compiled = nvrtc::compile_fresh(name, &src, gpu.info.arch())?;
    if !compiled.log.is_empty() {
        println!(
            "NVRTC warnings in {name} (CI fails on these):\n{}",
            compiled.log
        );
    }
    let mut module: sys::CUmodule = null_mut();
    // SAFETY: a cubin NVRTC produced for this device; the context is current.
    check(
        lib,
        unsafe { (lib.cuModuleLoadData)(&mut module, compiled.cubin.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    )?;
    Ok(module)
}

/// Function `name` of `module`, allowed `max_shared` bytes of dynamic shared memory (above
/// 48 KiB a kernel needs an opt-in: the most it launches with).
fn function(
    lib: &'static sys::Driver,
    module: sys::CUmodule,
    name: &str,
    max_shared: u32,
) -> Result<sys::CUfunction> {
    let cname = CString::new(name)?;
    let mut f: sys::CUfunction = null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    check(
        lib,
        unsafe { (lib.cuModuleGetFunction)(&mut f, module, cname.as_ptr()) },
        name,
    )?;
    // SAFETY: a valid function of the current context.
    check(
        lib,
        unsafe {
            (lib.cuFuncSetAttribute)(
                f,
                sys::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                max_shared as i32,
            )
        },
        "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
    )?;
    Ok(f)
}

/// A driver result as an error naming the call.
fn check(lib: &sys::Driver, r: sys::CUresult, call: &str) -> Result<()> {
    if r == sys::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: writes a pointer to a static string, or leaves it null.
    unsafe { (lib.cuGetErrorName)(r, &mut name) };
    let name = if name.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    Err(format!("{call} failed: {name} (CUDA error {r})").into())
}
