//! The candidate tensor-core attention forward (`dev/attention/attention_tc_next.cu`, kernels
//! `attn_fwd_tc_next_k4` / `_k8`) against the library's (`attn_fwd_tc_k4` / `_k8` of
//! `crates/tensor/src/cuda/kernels/attention_tc.cu`): correctness against the CPU fp32 kernel
//! and speed, on the shapes of the training runs plus the edge cases of the contract.
//!
//! `cargo run --release -p tensor --example attention_next [-- NAME=VALUE ...]`
//!
//! Each `NAME=VALUE` is put in front of the candidate's source as `#define NAME VALUE` (e.g.
//! `TN_K4_MIN_BLOCKS=4` to compile the head-64 kernel for 4 blocks an SM). Without a GPU it
//! prints one line saying so and exits 0.
//!
//! Per shape, with the same random inputs (fixed seed, N(0, 1)):
//! 1. the library's kernel through `tensor::ops::attention_forward` in a bf16 operand scope
//!    (the tensor-core path: bf16 operands and a head size the kernels take);
//! 2. the candidate, compiled here with NVRTC for this GPU (prelude in front, as the library
//!    builds its modules) and launched through the driver on the default stream;
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
//! (the launch the bf16 path makes, without the allocation and zeroing of new `out` / `lse`
//! buffers). TFLOP/s count 4·D FLOP per visible (query, key) pair (`AttnShape::flops`, the
//! two products): for causal attention with Sq = Sk and no offsets that is
//! 4·B·H·D·S(S + 1)/2, FlashAttention's 4·B·H·S²·D/2 up to a factor (S + 1)/S.

use std::error::Error;
use std::ffi::{c_void, CStr, CString};
use std::process::ExitCode;
use std::ptr::null_mut;
use std::sync::Arc;
use tensor::attention::{AttnShape, AttnTiles};
use tensor::buf::{Buf, BufRef};
use tensor::cuda::{kernels, nvrtc, sys, DevBuf, Gpu};
use tensor::operands::{Operands, Scope};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// The candidate's source, without the prelude.
const SOURCE: &str = include_str!("../../../dev/attention/attention_tc_next.cu");

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
         768 D + 2048 bytes); errors against the CPU fp32 kernel: out max|x - cpu| / max|cpu|, \
         lse max|x - cpu|; ms: median of {ROUNDS} rounds of {LAUNCHES} launches; FLOP = 4 D per \
         visible pair"
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
        all_pass &= compare(gpu, &cand, &s, what, 1000 + ci as u64)?;
    }
    println!("{}", if all_pass { "all PASS" } else { "FAIL" });
    Ok(all_pass)
}

/// One shape: errors and times of both kernels, one PASS / FAIL verdict.
fn compare(gpu: &Arc<Gpu>, cand: &Candidate, s: &AttnShape, what: &str, seed: u64) -> Result<bool> {
    let q = normal(s.q_elems(), seed);
    let k = normal(s.kv_elems(), seed + 1);
    let v = normal(s.kv_elems(), seed + 2);
    let (gq, gk, gv) = (gpu.upload(&q)?, gpu.upload(&k)?, gpu.upload(&v)?);

    // (iii) The CPU fp32 kernel.
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
    gpu.synchronize()?; // the uploads ran on the library's stream
    cand.launch(s, &gq, &gk, &gv, &mut go, &mut gl)?;
    cand.synchronize()?;
    let (out_cand, lse_cand) = (go.to_host()?, gl.to_host()?);

    let top = out_cpu
        .iter()
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let lib_out = out_err(&out_lib, &out_cpu, top);
    let lib_lse = lse_err(&lse_lib, &lse_cpu);
    let cand_out = out_err(&out_cand, &out_cpu, top);
    let cand_lse = lse_err(&lse_cand, &lse_cpu);
    let diff = out_err(&out_cand, &out_lib, top);

    // Times.
    let mut go_lib = gpu.alloc::<f32>(s.q_elems())?;
    let mut gl_lib = gpu.alloc::<f32>(s.lse_elems())?;
    let mut t_lib = Vec::new();
    let mut t_cand = Vec::new();
    for _ in 0..WARMUP {
        tensor::cuda::ops::attention_forward_tc(s, &gq, &gk, &gv, &mut go_lib, &mut gl_lib)?;
    }
    gpu.synchronize()?;
    for _ in 0..WARMUP {
        cand.launch(s, &gq, &gk, &gv, &mut go, &mut gl)?;
    }
    cand.synchronize()?;
    for _ in 0..ROUNDS {
        let ms = gpu.time_ms(|| {
            for _ in 0..LAUNCHES {
                tensor::cuda::ops::attention_forward_tc(
                    s,
                    &gq,
                    &gk,
                    &gv,
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
                cand.launch(s, &gq, &gk, &gv, &mut go, &mut gl)?;
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
        let i = first_beyond(&out_cand, &out_cpu, top, bound_out);
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
    let label = format!(
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
    );
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

/// The candidate's module, loaded into the context of the [`Gpu`] (the primary context, which
/// `Gpu::open` made current on this thread).
struct Candidate {
    lib: &'static sys::Driver,
    k4: sys::CUfunction,
    k8: sys::CUfunction,
}

/// The candidate's dynamic shared memory for head size `d` (the kernel's header).
fn shared_bytes(d: usize) -> u32 {
    (768 * d + 2048) as u32
}

impl Candidate {
    fn load(gpu: &Gpu, defines: &[String]) -> Result<Candidate> {
        let mut src = String::new();
        for d in defines {
            let (name, value) = d.split_once('=').unwrap_or((d.as_str(), ""));
            src.push_str(&format!("#define {name} {value}\n"));
        }
        // As `tensor::cuda::kernels::source` builds a module: the prelude, then the file.
        src.push_str(&format!(
            "{}\n#line 1 \"attention_tc_next.cu\"\n{SOURCE}",
            kernels::PRELUDE
        ));
        let compiled = nvrtc::compile_fresh("attention_tc_next", &src, gpu.info.arch())?;
        if !compiled.log.is_empty() {
            println!("NVRTC warnings (CI fails on these):\n{}", compiled.log);
        }
        let lib = sys::driver()?;
        let mut module: sys::CUmodule = null_mut();
        // SAFETY: a cubin NVRTC produced for this device; the context is current. The module
        // stays loaded for the life of the process.
        check(
            lib,
            unsafe {
                (lib.cuModuleLoadData)(&mut module, compiled.cubin.as_ptr() as *const c_void)
            },
            "cuModuleLoadData",
        )?;
        let function = |name: &str, max_d: usize| -> Result<sys::CUfunction> {
            let cname = CString::new(name)?;
            let mut f: sys::CUfunction = null_mut();
            // SAFETY: a loaded module and a NUL-terminated name.
            check(
                lib,
                unsafe { (lib.cuModuleGetFunction)(&mut f, module, cname.as_ptr()) },
                name,
            )?;
            // Above 48 KiB of dynamic shared memory a kernel needs an opt-in: the most it
            // launches with.
            // SAFETY: a valid function of the current context.
            check(
                lib,
                unsafe {
                    (lib.cuFuncSetAttribute)(
                        f,
                        sys::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared_bytes(max_d) as i32,
                    )
                },
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            )?;
            Ok(f)
        };
        Ok(Candidate {
            lib,
            k4: function("attn_fwd_tc_next_k4", 64)?,
            k8: function("attn_fwd_tc_next_k8", 128)?,
        })
    }

    /// Queues the candidate on the default stream, with the library launcher's grid.
    fn launch(
        &self,
        s: &AttnShape,
        q: &DevBuf<f32>,
        k: &DevBuf<f32>,
        v: &DevBuf<f32>,
        out: &mut DevBuf<f32>,
        lse: &mut DevBuf<f32>,
    ) -> Result<()> {
        assert!(s.head_dim.is_multiple_of(16) && (16..=128).contains(&s.head_dim));
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
        let mut ptrs = [q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr()];
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
        let mut params: Vec<*mut c_void> = Vec::with_capacity(15);
        params.extend(ptrs.iter_mut().map(|p| p as *mut u64 as *mut c_void));
        params.extend(ints.iter_mut().map(|p| p as *mut i32 as *mut c_void));
        params.push(&mut scale as *mut f32 as *mut c_void);
        let grid_x = s.q_len.div_ceil(BLOCK_ROWS) as u32;
        let grid_y = (s.batch * s.n_heads) as u32;
        if grid_x == 0 {
            return Ok(());
        }
        // SAFETY: the parameters match the kernel's signature (5 pointers, 9 ints, a float) and
        // live until the call returns; the buffers hold the elements the shape names (asserted).
        check(
            self.lib,
            unsafe {
                (self.lib.cuLaunchKernel)(
                    f,
                    grid_x,
                    grid_y,
                    1,
                    THREADS,
                    1,
                    1,
                    shared_bytes(s.head_dim),
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
