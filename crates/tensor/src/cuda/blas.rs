//! Matrix products on cuBLASLt, with [`crate::gemm::matmul`]'s row-major conventions:
//! `C[m, n] (+)= op(A)·op(B)`, `op(A)` `[m, k]` (stored `[k, m]` when `trans_a`), `op(B)`
//! `[k, n]` (stored `[n, k]` when `trans_b`).
//!
//! cuBLASLt is column-major; a row-major `C` is the column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so the
//! call passes `B` as its first operand and `A` as its second, each with the transpose flag
//! that turns its column-major view into the factor needed: `B` stored `[k, n]` row-major is
//! `Bᵀ` column-major (no transpose), `B` stored `[n, k]` is column-major `[k, n]` (transpose);
//! likewise for `A`.
//!
//! Inputs are fp32, bf16 or fp16; accumulation and `C` are fp32 (`CUBLAS_COMPUTE_32F`, which
//! never uses TF32: fp32 products keep fp32 accuracy for parity with the CPU). The
//! descriptors and the heuristic's best algorithm are cached per (types, shape, transposes),
//! so a training step's products after the first query nothing; one 32 MiB workspace serves
//! every product.

use super::driver::{DevBuf, Gpu};
use super::sys::{self, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t};
use super::timeline::Timed;
use super::CudaError;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Element type of the product's inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmInput {
    F32,
    Bf16,
    F16,
}

impl GemmInput {
    /// The operands' format, as the kernel timeline names it.
    pub fn name(self) -> &'static str {
        match self {
            GemmInput::F32 => "f32",
            GemmInput::Bf16 => "bf16",
            GemmInput::F16 => "f16",
        }
    }

    fn cuda_type(self) -> i32 {
        match self {
            GemmInput::F32 => sys::CUDA_R_32F,
            GemmInput::Bf16 => sys::CUDA_R_16BF,
            GemmInput::F16 => sys::CUDA_R_16F,
        }
    }
}

/// Element type of `C` (and `D`, the same buffer): fp32, or the inputs' 16-bit format — a
/// product accumulating into 16-bit storage, `C = round(op(A)·op(B) + β·C)` with fp32 compute
/// and scaling (`C` widened exactly), one rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmOutput {
    F32,
    Input,
}

/// Bytes of the workspace cuBLASLt may use.
pub(crate) const WORKSPACE: usize = 32 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    input: GemmInput,
    output: GemmOutput,
    mkn: [usize; 3],
    trans: [bool; 2],
    /// Alignments in bytes of the `a`, `b`, `c` addresses ([`alignment`]).
    align: [u32; 3],
}

/// The alignment in bytes of a device address, as cuBLASLt's preferences take it: the
/// largest power of two dividing it, at most 256 (the heuristic's default assumption).
/// Views into flat buffers (a weight inside the parameter buffer, a chunk of rows) are often
/// less aligned than the 256 bytes of a fresh allocation.
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

/// The descriptors and algorithm of one product shape.
struct Plan {
    desc: cublasLtMatmulDesc_t,
    layouts: [cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// The cuBLASLt handle, its workspace and the cached plans of one device.
pub(crate) struct Blas {
    lib: &'static sys::BlasLt,
    handle: sys::cublasLtHandle_t,
    /// [`WORKSPACE`] bytes from the device's allocator (a raw block, not a [`DevBuf`], which
    /// would hold the `Gpu` that holds this), returned by the `Gpu`'s drop.
    pub(crate) workspace: u64,
    plans: HashMap<Key, Plan>,
}

// SAFETY: used only under the Gpu's mutex, with the context current.
unsafe impl Send for Blas {}

fn ok(r: sys::cublasStatus_t, call: &str) -> Result<(), CudaError> {
    if r == sys::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Blas(format!(
            "{call} returned cuBLAS status {r}"
        )))
    }
}

impl Blas {
    fn new(gpu: &Gpu) -> Result<Blas, CudaError> {
        let lib = sys::blaslt().map_err(CudaError::Library)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller made the context current.
        ok(
            unsafe { (lib.cublasLtCreate)(&mut handle) },
            "cublasLtCreate",
        )?;
        Ok(Blas {
            lib,
            handle,
            workspace: gpu.alloc.acquire(WORKSPACE)?,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, key: Key) -> Result<&Plan, CudaError> {
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, key: Key) -> Result<Plan, CudaError> {
        let lib = self.lib;
        let [m, k, n] = key.mkn.map(|v| v as u64);
        let [trans_a, trans_b] = key.trans;
        let t = key.input.cuda_type();
        let c_type = match key.output {
            GemmOutput::F32 => sys::CUDA_R_32F,
            GemmOutput::Input => t,
        };
        // First operand (B): N with a [n, k] column-major view (ld n), or T of [k, n] (ld k).
        let (x_rows, x_cols, op_x) = if trans_b {
            (k, n, sys::CUBLAS_OP_T)
        } else {
            (n, k, sys::CUBLAS_OP_N)
        };
        // Second operand (A): N with [k, m] (ld k), or T of [m, k] (ld m).
        let (y_rows, y_cols, op_y) = if trans_a {
            (m, k, sys::CUBLAS_OP_T)
        } else {
            (k, m, sys::CUBLAS_OP_N)
        };
        let mut desc = std::ptr::null_mut();
        let mut lx = std::ptr::null_mut();
        let mut ly = std::ptr::null_mut();
        let mut lc = std::ptr::null_mut();
        let mut pref = std::ptr::null_mut();
        // SAFETY: out-pointers valid; attribute buffers are the i32 / u64 values cuBLASLt
        // expects for these attributes.
        unsafe {
            ok(
                (lib.cublasLtMatmulDescCreate)(&mut desc, sys::CUBLAS_COMPUTE_32F, sys::CUDA_R_32F),
                "cublasLtMatmulDescCreate",
            )?;
            for (attr, op) in [
                (sys::CUBLASLT_MATMUL_DESC_TRANSA, op_x),
                (sys::CUBLASLT_MATMUL_DESC_TRANSB, op_y),
            ] {
                ok(
                    (lib.cublasLtMatmulDescSetAttribute)(
                        desc,
                        attr,
                        &op as *const i32 as *const c_void,
                        4,
                    ),
                    "cublasLtMatmulDescSetAttribute",
                )?;
            }
            ok(
                (lib.cublasLtMatrixLayoutCreate)(&mut lx, t, x_rows, x_cols, x_rows as i64),
                "cublasLtMatrixLayoutCreate",
            )?;
            ok(
                (lib.cublasLtMatrixLayoutCreate)(&mut ly, t, y_rows, y_cols, y_rows as i64),
                "cublasLtMatrixLayoutCreate",
            )?;
            ok(
                (lib.cublasLtMatrixLayoutCreate)(&mut lc, c_type, n, m, n as i64),
                "cublasLtMatrixLayoutCreate",
            )?;
            ok(
                (lib.cublasLtMatmulPreferenceCreate)(&mut pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let ws = WORKSPACE as u64;
            let set_pref = |attr: i32, value: *const c_void, size: usize| {
                ok(
                    (lib.cublasLtMatmulPreferenceSetAttribute)(pref, attr, value, size),
                    "cublasLtMatmulPreferenceSetAttribute",
                )
            };
            let prefs = (|| {
                set_pref(
                    sys::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                )?;
                // cuBLASLt's first operand is B, its second A (module doc); C and D are `c`.
                let [align_a, align_b, align_c] = key.align;
                // A 16-bit D is rounded once, from the fp32 sum: no split-K whose partial
                // sums are added up in D's own type (the in-place and output-type reduction
                // schemes would round each partial to 16 bits).
                if c_type != sys::CUDA_R_32F {
                    let compute_type_only = sys::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
                    set_pref(
                        sys::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                        &compute_type_only as *const u32 as *const c_void,
                        4,
                    )?;
                }
                for (attr, align) in [
                    (sys::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b),
                    (sys::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a),
                    (sys::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c),
                    (sys::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c),
                ] {
                    set_pref(attr, &align as *const u32 as *const c_void, 4)?;
                }
                Ok(())
            })();
            if let Err(e) = prefs {
                (lib.cublasLtMatmulPreferenceDestroy)(pref);
                return Err(e);
            }
            let mut result = sys::cublasLtMatmulHeuristicResult_t::default();
            let mut found = 0;
            let r = (lib.cublasLtMatmulAlgoGetHeuristic)(
                self.handle,
                desc,
                lx,
                ly,
                lc,
                lc,
                pref,
                1,
                &mut result,
                &mut found,
            );
            (lib.cublasLtMatmulPreferenceDestroy)(pref);
            ok(r, "cublasLtMatmulAlgoGetHeuristic")?;
            if found == 0 {
                return Err(CudaError::Blas(format!(
                    "cuBLASLt has no algorithm for a {:?} product [{m}, {k}] x [{k}, {n}] (transposes {trans_a}, {trans_b})",
                    key.input
                )));
            }
            Ok(Plan {
                desc,
                layouts: [lx, ly, lc],
                algo: result.algo,
            })
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: every handle was created by this Blas and is destroyed once.
        unsafe {
            for (_, p) in self.plans.drain() {
                for l in p.layouts {
                    (self.lib.cublasLtMatrixLayoutDestroy)(l);
                }
                (self.lib.cublasLtMatmulDescDestroy)(p.desc);
            }
            (self.lib.cublasLtDestroy)(self.handle);
        }
    }
}

/// `C[m, n] (+)= op(A)·op(B)` on the device (module doc), `A` and `B` of element type
/// `input` at device addresses `a`, `b`; `C` fp32.
///
/// # Safety
/// `a` must hold `m·k` and `b` `k·n` elements of `input`, `c` `m·n` floats, all on `gpu`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_raw(
    gpu: &Arc<Gpu>,
    input: GemmInput,
    c: u64,
    a: u64,
    b: u64,
    mkn: [usize; 3],
    flags: [bool; 3],
) -> Result<(), CudaError> {
    // SAFETY: the caller's contract.
    unsafe { matmul_raw_into(gpu, input, GemmOutput::F32, c, a, b, mkn, flags) }
}

/// [`matmul_raw`] with `C` of element type `output`. A 16-bit `C` is written, never
/// accumulated into: cuBLASLt's `D = A·B + C` in bf16 rounds `A·B` to bf16 before adding `C`
/// (an H200, CUDA 13), two roundings where an fp32 `C` rounded back makes one.
///
/// # Safety
/// As [`matmul_raw`], with `c` holding `m·n` elements of `output`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_raw_into(
    gpu: &Arc<Gpu>,
    input: GemmInput,
    output: GemmOutput,
    c: u64,
    a: u64,
    b: u64,
    [m, k, n]: [usize; 3],
    [trans_a, trans_b, accumulate]: [bool; 3],
) -> Result<(), CudaError> {
    if input == GemmInput::F32 && output == GemmOutput::Input {
        return Err(CudaError::Shape(
            "a product of fp32 operands writes fp32, not 16 bits".into(),
        ));
    }
    if accumulate && output == GemmOutput::Input {
        return Err(CudaError::Shape(
            "a product accumulates into fp32 only: into 16 bits cuBLASLt rounds it twice".into(),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let c_bytes = match output {
        GemmOutput::F32 => 4,
        GemmOutput::Input => 2,
    };
    gpu.bind()?;
    let mut guard = gpu.blas.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(Blas::new(gpu)?);
    }
    let blas = guard.as_mut().expect("created above");
    if k == 0 {
        drop(guard);
        if !accumulate {
            let lib = gpu.lib;
            gpu.timed(Timed::Copy("memset"), || {
                super::driver::check(
                    (lib.cuMemsetD8Async)(c, 0, m * n * c_bytes, gpu.stream),
                    "cuMemsetD8Async",
                )
            })?;
        }
        return Ok(());
    }
    let key = Key {
        input,
        output,
        mkn: [m, k, n],
        trans: [trans_a, trans_b],
        align: [alignment(a), alignment(b), alignment(c)],
    };
    let (lib, handle, ws) = (blas.lib, blas.handle, blas.workspace);
    let plan = blas.plan(key)?;
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    let [lx, ly, lc] = plan.layouts;
    let what = Timed::Product(input.name(), [m, k, n], [trans_a, trans_b]);
    gpu.timed(what, || {
        ok(
            (lib.cublasLtMatmul)(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                b as *const c_void,
                lx,
                a as *const c_void,
                ly,
                &beta as *const f32 as *const c_void,
                c as *const c_void,
                lc,
                c as *mut c_void,
                lc,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE,
                gpu.stream,
            ),
            "cublasLtMatmul",
        )
    })
}

/// [`matmul_raw`] on fp32 buffers, with the lengths checked.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    c: &mut DevBuf<f32>,
    a: &DevBuf<f32>,
    b: &DevBuf<f32>,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), CudaError> {
    let gpu = c.gpu().clone();
    if c.len() != m * n || a.len() != m * k || b.len() != k * n {
        return Err(CudaError::Shape(format!(
            "matmul [{m}, {k}] x [{k}, {n}]: buffers of {}, {} and {} elements",
            a.len(),
            b.len(),
            c.len()
        )));
    }
    // SAFETY: lengths checked; all three buffers live on `gpu`.
    unsafe {
        matmul_raw(
            &gpu,
            GemmInput::F32,
            c.ptr(),
            a.ptr(),
            b.ptr(),
            [m, k, n],
            [trans_a, trans_b, accumulate],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;

    #[test]
    fn alignments_are_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0100), 256);
        assert_eq!(alignment(0x7f00_0000_0080), 128);
        assert_eq!(alignment(0x7f00_0000_0004), 4);
        assert_eq!(alignment(0x7f00_0000_000c), 4);
        assert_eq!(alignment(0x7f00_0000_0010 + 8), 8);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
    }
}
