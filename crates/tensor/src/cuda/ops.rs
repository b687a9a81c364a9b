//! Typed launchers of the kernels, one per CPU kernel they mirror, with the same shapes,
//! layouts and accumulate/write conventions (see each CPU function), so that the engine can
//! call either and the tests compare them on the same inputs.

use super::doc_mask::DocMask;
use super::driver::{to_i32, DevBuf, DevSlice, DevSliceMut, Gpu, KArg, LaunchCfg};
use super::CudaError;
use crate::attention::AttnShape;
use std::sync::{Arc, Mutex, OnceLock};

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;

/// The largest grid dimension y or z of a launch.
const MAX_GRID_YZ: usize = 65_535;

fn same_len(what: &str, a: usize, b: usize) -> Result<(), CudaError> {
    if a == b {
        Ok(())
    } else {
        Err(CudaError::Shape(format!("{what}: {a} vs {b} elements")))
    }
}

/// Blocks for `n` elements (grid-stride kernels cap the grid; each thread loops).
fn elements(n: usize) -> LaunchCfg {
    LaunchCfg::linear(n.div_ceil(THREADS as usize).min(65_535), THREADS)
}

/// A block for each of `rows` rows, at most 65 535 (the kernels over rows, `XT_FOR_ROWS` in
/// prelude.cuh: grid-stride over the rows, the block's threads over a row's columns).
fn rows_of_blocks(rows: usize) -> LaunchCfg {
    LaunchCfg::linear(rows.min(65_535), THREADS)
}

/// `x` rounded (nearest even) to the 16-bit `operands` format (bf16 or fp16) into a new
/// buffer; fp32 is an error.
pub fn rounded_copy(
    x: DevSlice<'_, f32>,
    operands: crate::operands::Operands,
) -> Result<DevBuf<u16>, CudaError> {
    use crate::operands::Operands;
    let mut y = x.gpu().alloc::<u16>(x.len())?;
    match operands {
        Operands::Bf16 => cast_f32_to_bf16(x, &mut y)?,
        Operands::F16 => cast_f32_to_f16(x, &mut y)?,
        Operands::F32 => {
            return Err(CudaError::Shape(
                "a rounded copy needs a 16-bit format, not fp32".into(),
            ))
        }
    }
    Ok(y)
}

/// The kernel of a kernel family `[fp32, bf16, fp16]` that writes its results rounded to the
/// 16-bit `format` (the `XtOut` stores of prelude.cuh: the value the fp32 kernel writes, rounded
/// to nearest even as [`rounded_copy`] rounds it); fp32 is an error.
fn rounding_kernel(
    family: [&'static str; 3],
    format: crate::operands::Operands,
) -> Result<&'static str, CudaError> {
    use crate::operands::Operands;
    match format {
        Operands::Bf16 => Ok(family[1]),
        Operands::F16 => Ok(family[2]),
        Operands::F32 => Err(CudaError::Shape(format!(
            "{}: a rounded output needs a 16-bit format, not fp32",
            family[0]
        ))),
    }
}

/// A product's operand in the format of the product ([`crate::operands`]): the fp32 values
/// as they are, or their bf16 / fp16 copy (rounded to nearest even) for the tensor cores —
/// made here, or earlier for several products ([`crate::operands::Operand`]).
pub enum Operand<'a> {
    F32(DevSlice<'a, f32>),
    Half(DevBuf<u16>),
    /// A 16-bit copy rounded earlier, in the product's format (the caller's word).
    Rounded(DevSlice<'a, u16>),
}

impl Operand<'_> {
    /// `x` prepared for products with `operands`: a reference; the 16-bit bits `x` was widened
    /// from, where it lies in a registered widening (a unit's weights in a 16-bit step:
    /// [`super::widening`], the same bits rounding would give); or a rounded 16-bit copy
    /// (prepare an operand used by several products once).
    pub fn new(
        x: DevSlice<'_, f32>,
        operands: crate::operands::Operands,
    ) -> Result<Operand<'_>, CudaError> {
        if operands == crate::operands::Operands::F32 {
            return Ok(Operand::F32(x));
        }
        if let Some(bits) = super::widening::bits_of(x, operands) {
            return Ok(Operand::Rounded(bits));
        }
        Ok(Operand::Half(rounded_copy(x, operands)?))
    }

    fn ptr(&self) -> u64 {
        match self {
            Operand::F32(x) => x.ptr(),
            Operand::Half(x) => x.ptr(),
            Operand::Rounded(x) => x.ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Operand::F32(x) => x.len(),
            Operand::Half(x) => x.len(),
            Operand::Rounded(x) => x.len(),
        }
    }

    fn gpu(&self) -> &Arc<Gpu> {
        match self {
            Operand::F32(x) => x.gpu(),
            Operand::Half(x) => x.gpu(),
            Operand::Rounded(x) => x.gpu(),
        }
    }

    fn is_16bit(&self) -> bool {
        !matches!(self, Operand::F32(_))
    }
}

/// `C (+)= op(A)·op(B)` ([`super::blas::matmul_raw`]'s conventions) on operands prepared for
/// `operands` ([`Operand::new`]); accumulation and `C` are fp32.
///
/// # Safety
/// `c` is a device range of `m·n` fp32 elements on `gpu`; `a` and `b` are on `gpu`.
pub unsafe fn matmul_prepared(
    gpu: &Arc<Gpu>,
    operands: crate::operands::Operands,
    c: u64,
    a: &Operand<'_>,
    b: &Operand<'_>,
    [m, k, n]: [usize; 3],
    flags: [bool; 3],
) -> Result<(), CudaError> {
    let input = product_input(operands, a, b, [m, k, n])?;
    // SAFETY: the operands hold m·k and k·n elements; `c` per the caller's contract.
    unsafe { super::blas::matmul_raw(gpu, input, c, a.ptr(), b.ptr(), [m, k, n], flags) }
}

/// The element type of a product's inputs in `operands`, where `a` and `b` are prepared for
/// it and hold `m·k` and `k·n` elements.
fn product_input(
    operands: crate::operands::Operands,
    a: &Operand<'_>,
    b: &Operand<'_>,
    [m, k, n]: [usize; 3],
) -> Result<super::blas::GemmInput, CudaError> {
    use super::blas::GemmInput;
    use crate::operands::Operands;
    let input = match (operands, a.is_16bit(), b.is_16bit()) {
        (Operands::F32, false, false) => GemmInput::F32,
        (Operands::Bf16, true, true) => GemmInput::Bf16,
        (Operands::F16, true, true) => GemmInput::F16,
        _ => {
            return Err(CudaError::Shape(format!(
                "a product in {operands:?} given operands prepared for another format"
            )))
        }
    };
    same_len("product a", a.len(), m * k)?;
    same_len("product b", b.len(), k * n)?;
    Ok(input)
}

/// `op(A)·op(B)` rounded to the 16-bit `operands` format, into a new buffer: cuBLASLt writes
/// `D` in that format (fp32 accumulation, one rounding — the product's rounded copy, up to the
/// summation order of the kernel cuBLASLt picks for a 16-bit `D`).
pub fn matmul_new_rounded(
    gpu: &Arc<Gpu>,
    operands: crate::operands::Operands,
    a: &Operand<'_>,
    b: &Operand<'_>,
    [m, k, n]: [usize; 3],
    [trans_a, trans_b]: [bool; 2],
) -> Result<DevBuf<u16>, CudaError> {
    use super::blas::GemmOutput;
    let input = product_input(operands, a, b, [m, k, n])?;
    if !Arc::ptr_eq(a.gpu(), gpu) || !Arc::ptr_eq(b.gpu(), gpu) {
        return Err(CudaError::Shape(
            "a product's operands on another GPU".into(),
        ));
    }
    let c = gpu.alloc::<u16>(m * n)?;
    // SAFETY: the operands hold m·k and k·n elements on `gpu` (checked), `c` m·n 16-bit
    // ones; a 16-bit output with fp32 operands is refused by `matmul_raw_into`.
    unsafe {
        super::blas::matmul_raw_into(
            gpu,
            input,
            GemmOutput::Input,
            c.ptr(),
            a.ptr(),
            b.ptr(),
            [m, k, n],
            [trans_a, trans_b, false],
        )?
    };
    Ok(c)
}

/// `C (+)= op(A)·op(B)` with `operands`: [`matmul_prepared`] on `a` and `b` prepared here.
///
/// # Safety
/// `c` is a device range of `m·n` fp32 elements on `a`'s device; `a` and `b` hold `m·k` and
/// `k·n` elements.
pub unsafe fn matmul_operands(
    operands: crate::operands::Operands,
    c: u64,
    a: DevSlice<'_, f32>,
    b: DevSlice<'_, f32>,
    mkn: [usize; 3],
    flags: [bool; 3],
) -> Result<(), CudaError> {
    let gpu = a.gpu().clone();
    let (a, b) = (Operand::new(a, operands)?, Operand::new(b, operands)?);
    // SAFETY: the caller's contract.
    unsafe { matmul_prepared(&gpu, operands, c, &a, &b, mkn, flags) }
}

/// `y = bf16(x)` (round to nearest even), 16-bit storage.
pub fn cast_f32_to_bf16<'a>(
    x: impl Into<DevSlice<'a, f32>>,
    y: impl Into<DevSliceMut<'a, u16>>,
) -> Result<(), CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let y: DevSliceMut<'_, u16> = y.into();

    cast("cast_f32_bf16", x.gpu(), x.ptr(), y.ptr(), x.len(), y.len())
}

/// `y = f32(x)` from bf16 storage.
pub fn cast_bf16_to_f32<'a>(
    x: impl Into<DevSlice<'a, u16>>,
    y: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let x: DevSlice<'_, u16> = x.into();
    let y: DevSliceMut<'_, f32> = y.into();

    cast("cast_bf16_f32", x.gpu(), x.ptr(), y.ptr(), x.len(), y.len())
}

/// `y = f16(x)` (round to nearest even).
pub fn cast_f32_to_f16<'a>(
    x: impl Into<DevSlice<'a, f32>>,
    y: impl Into<DevSliceMut<'a, u16>>,
) -> Result<(), CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let y: DevSliceMut<'_, u16> = y.into();

    cast("cast_f32_f16", x.gpu(), x.ptr(), y.ptr(), x.len(), y.len())
}

/// `y = f32(x)` from fp16 storage.
pub fn cast_f16_to_f32<'a>(
    x: impl Into<DevSlice<'a, u16>>,
    y: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let x: DevSlice<'_, u16> = x.into();
    let y: DevSliceMut<'_, f32> = y.into();

    cast("cast_f16_f32", x.gpu(), x.ptr(), y.ptr(), x.len(), y.len())
}

fn cast(
    func: &'static str,
    gpu: &Arc<Gpu>,
    x: u64,
    y: u64,
    nx: usize,
    ny: usize,
) -> Result<(), CudaError> {
    same_len(func, nx, ny)?;
    let n = to_i32(nx, "elements")?;
    gpu.launch(
        "elementwise",
        func,
        elements(nx.div_ceil(per_thread(&[x, y]))),
        &[KArg::Ptr(x), KArg::Ptr(y), n.into()],
    )
}

/// Elements a thread of the cast and SwiGLU kernels takes: 8 where every buffer starts 16-byte
/// aligned (16-byte loads and stores), else 1 — the kernels' own test (`xt_aligned16` in
/// elementwise.cu).
fn per_thread(buffers: &[u64]) -> usize {
    if buffers.iter().fold(0, |a, b| a | b).is_multiple_of(16) {
        8
    } else {
        1
    }
}

/// Rounds every element to bf16 (`bf16 = true`) or fp16 and back, in place.
pub fn round_to_16bit<'a>(x: impl Into<DevSliceMut<'a, f32>>, bf16: bool) -> Result<(), CudaError> {
    let x: DevSliceMut<'_, f32> = x.into();
    let f = if bf16 { "round_bf16" } else { "round_f16" };
    let n = to_i32(x.len(), "elements")?;
    x.gpu().launch(
        "elementwise",
        f,
        elements(x.len()),
        &[(&x).into(), n.into()],
    )
}

/// `x *= s`.
pub fn scale<'a>(x: impl Into<DevSliceMut<'a, f32>>, s: f32) -> Result<(), CudaError> {
    let x: DevSliceMut<'_, f32> = x.into();
    let n = to_i32(x.len(), "elements")?;
    x.gpu().launch(
        "elementwise",
        "scale_f32",
        elements(x.len()),
        &[(&x).into(), s.into(), n.into()],
    )
}

/// `y += a·x`.
pub fn axpy<'a>(
    y: impl Into<DevSliceMut<'a, f32>>,
    x: impl Into<DevSlice<'a, f32>>,
    a: f32,
) -> Result<(), CudaError> {
    let y: DevSliceMut<'_, f32> = y.into();
    let x: DevSlice<'_, f32> = x.into();

    same_len("axpy", y.len(), x.len())?;
    let n = to_i32(x.len(), "elements")?;
    y.gpu().launch(
        "elementwise",
        "axpy_f32",
        elements(x.len()),
        &[(&y).into(), x.into(), a.into(), n.into()],
    )
}

/// `a + b` as a new buffer.
pub fn add<'a>(
    a: impl Into<DevSlice<'a, f32>>,
    b: impl Into<DevSlice<'a, f32>>,
) -> Result<DevBuf<f32>, CudaError> {
    let a: DevSlice<'_, f32> = a.into();
    let b: DevSlice<'_, f32> = b.into();

    same_len("add", a.len(), b.len())?;
    let gpu = a.gpu().clone();
    let y = gpu.alloc::<f32>(a.len())?;
    let n = to_i32(a.len(), "elements")?;
    gpu.launch(
        "elementwise",
        "add_f32",
        elements(a.len()),
        &[(&y).into(), a.into(), b.into(), n.into()],
    )?;
    Ok(y)
}

/// Every element set to `v`.
pub fn fill<'a>(y: impl Into<DevSliceMut<'a, f32>>, v: f32) -> Result<(), CudaError> {
    let y: DevSliceMut<'_, f32> = y.into();
    let n = to_i32(y.len(), "elements")?;
    y.gpu().launch(
        "elementwise",
        "fill_f32",
        elements(y.len()),
        &[(&y).into(), v.into(), n.into()],
    )
}

const SWIGLU_FORWARD: [&str; 3] = [
    "swiglu_forward",
    "swiglu_forward_bf16",
    "swiglu_forward_f16",
];
const SWIGLU_BACKWARD: [&str; 3] = [
    "swiglu_backward",
    "swiglu_backward_bf16",
    "swiglu_backward_f16",
];

/// `silu(gate) ∘ up` ([`crate::activation::swiglu_forward`]).
pub fn swiglu_forward<'a>(
    gate: impl Into<DevSlice<'a, f32>>,
    up: impl Into<DevSlice<'a, f32>>,
) -> Result<DevBuf<f32>, CudaError> {
    let gate: DevSlice<'_, f32> = gate.into();
    let s = gate.gpu().alloc::<f32>(gate.len())?;
    swiglu_forward_launch(gate, up.into(), s.ptr(), SWIGLU_FORWARD[0])?;
    Ok(s)
}

/// [`swiglu_forward`] rounded to the 16-bit `format` by the kernel as it writes (the product
/// that reads `s` next reads these bits: the same as [`rounded_copy`] of the fp32 result).
pub fn swiglu_forward_rounded<'a>(
    gate: impl Into<DevSlice<'a, f32>>,
    up: impl Into<DevSlice<'a, f32>>,
    format: crate::operands::Operands,
) -> Result<DevBuf<u16>, CudaError> {
    let gate: DevSlice<'_, f32> = gate.into();
    let kernel = rounding_kernel(SWIGLU_FORWARD, format)?;
    let s = gate.gpu().alloc::<u16>(gate.len())?;
    swiglu_forward_launch(gate, up.into(), s.ptr(), kernel)?;
    Ok(s)
}

fn swiglu_forward_launch(
    gate: DevSlice<'_, f32>,
    up: DevSlice<'_, f32>,
    s: u64,
    kernel: &'static str,
) -> Result<(), CudaError> {
    same_len("swiglu", gate.len(), up.len())?;
    let n = to_i32(gate.len(), "elements")?;
    let per = per_thread(&[gate.ptr(), up.ptr(), s]);
    gate.gpu().launch(
        "elementwise",
        kernel,
        elements(gate.len().div_ceil(per)),
        &[gate.into(), up.into(), KArg::Ptr(s), n.into()],
    )
}

/// `(dgate, dup)` ([`crate::activation::swiglu_backward`]).
pub fn swiglu_backward<'a>(
    dout: impl Into<DevSlice<'a, f32>>,
    gate: impl Into<DevSlice<'a, f32>>,
    up: impl Into<DevSlice<'a, f32>>,
) -> Result<(DevBuf<f32>, DevBuf<f32>), CudaError> {
    let gate: DevSlice<'_, f32> = gate.into();
    let gpu = gate.gpu().clone();
    let (dg, du) = (gpu.alloc::<f32>(gate.len())?, gpu.alloc::<f32>(gate.len())?);
    let outs = [dg.ptr(), du.ptr()];
    swiglu_backward_launch(dout.into(), gate, up.into(), outs, SWIGLU_BACKWARD[0])?;
    Ok((dg, du))
}

/// [`swiglu_backward`] with `dgate` and `dup` rounded to the 16-bit `format` by the kernel as
/// it writes them (for the products that read them next).
pub fn swiglu_backward_rounded<'a>(
    dout: impl Into<DevSlice<'a, f32>>,
    gate: impl Into<DevSlice<'a, f32>>,
    up: impl Into<DevSlice<'a, f32>>,
    format: crate::operands::Operands,
) -> Result<(DevBuf<u16>, DevBuf<u16>), CudaError> {
    let gate: DevSlice<'_, f32> = gate.into();
    let kernel = rounding_kernel(SWIGLU_BACKWARD, format)?;
    let gpu = gate.gpu().clone();
    let (dg, du) = (gpu.alloc::<u16>(gate.len())?, gpu.alloc::<u16>(gate.len())?);
    swiglu_backward_launch(dout.into(), gate, up.into(), [dg.ptr(), du.ptr()], kernel)?;
    Ok((dg, du))
}

fn swiglu_backward_launch(
    dout: DevSlice<'_, f32>,
    gate: DevSlice<'_, f32>,
    up: DevSlice<'_, f32>,
    [dg, du]: [u64; 2],
    kernel: &'static str,
) -> Result<(), CudaError> {
    same_len("swiglu dout", dout.len(), gate.len())?;
    same_len("swiglu up", up.len(), gate.len())?;
    let n = to_i32(gate.len(), "elements")?;
    let per = per_thread(&[dout.ptr(), gate.ptr(), up.ptr(), dg, du]);
    gate.gpu().launch(
        "elementwise",
        kernel,
        elements(gate.len().div_ceil(per)),
        &[
            dout.into(),
            gate.into(),
            up.into(),
            KArg::Ptr(dg),
            KArg::Ptr(du),
            n.into(),
        ],
    )
}

/// How many elements are NaN or infinite (fp16 loss scaling's overflow check).
pub fn count_nonfinite<'a>(x: impl Into<DevSlice<'a, f32>>) -> Result<usize, CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let gpu = x.gpu().clone();
    let count = gpu.zeros::<i32>(1)?;
    let n = to_i32(x.len(), "elements")?;
    gpu.launch(
        "elementwise",
        "count_nonfinite",
        elements(x.len()),
        &[x.into(), n.into(), (&count).into()],
    )?;
    Ok(count.to_host()?[0].max(0) as usize)
}

/// Threads per block of the row kernels (a row per block).
fn row_threads(dim: usize) -> u32 {
    (dim.next_multiple_of(32) as u32).clamp(32, 256)
}

fn rows_of(len: usize, dim: usize, what: &str) -> Result<usize, CudaError> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(CudaError::Shape(format!(
            "{what}: {len} elements are not rows of {dim}"
        )));
    }
    Ok(len / dim)
}

const RMSNORM_FORWARD: [&str; 3] = [
    "rmsnorm_forward",
    "rmsnorm_forward_bf16",
    "rmsnorm_forward_f16",
];

/// `(y, rstd)` ([`crate::norm::rmsnorm_forward`]).
pub fn rmsnorm_forward<'a>(
    x: impl Into<DevSlice<'a, f32>>,
    w: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    eps: f32,
) -> Result<(DevBuf<f32>, DevBuf<f32>), CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let y = x.gpu().alloc::<f32>(x.len())?;
    let rstd = rmsnorm_forward_launch(x, w.into(), y.ptr(), dim, eps, RMSNORM_FORWARD[0])?;
    Ok((y, rstd))
}

/// [`rmsnorm_forward`] with `y` rounded to the 16-bit `format` by the kernel as it writes (for
/// the products that read it next: the same bits as [`rounded_copy`] of the fp32 `y`).
pub fn rmsnorm_forward_rounded<'a>(
    x: impl Into<DevSlice<'a, f32>>,
    w: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    eps: f32,
    format: crate::operands::Operands,
) -> Result<(DevBuf<u16>, DevBuf<f32>), CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let kernel = rounding_kernel(RMSNORM_FORWARD, format)?;
    let y = x.gpu().alloc::<u16>(x.len())?;
    let rstd = rmsnorm_forward_launch(x, w.into(), y.ptr(), dim, eps, kernel)?;
    Ok((y, rstd))
}

/// Launches an RMSNorm forward kernel writing `y` (a buffer of `x.len()` elements of the
/// kernel's output); returns `rstd`.
fn rmsnorm_forward_launch(
    x: DevSlice<'_, f32>,
    w: DevSlice<'_, f32>,
    y: u64,
    dim: usize,
    eps: f32,
    kernel: &'static str,
) -> Result<DevBuf<f32>, CudaError> {
    let rows = rows_of(x.len(), dim, "rmsnorm x")?;
    same_len("rmsnorm w", w.len(), dim)?;
    let gpu = x.gpu().clone();
    let rstd = gpu.alloc::<f32>(rows)?;
    gpu.launch(
        "norm",
        kernel,
        LaunchCfg::linear(rows, row_threads(dim)),
        &[
            x.into(),
            w.into(),
            KArg::Ptr(y),
            (&rstd).into(),
            to_i32(dim, "dim")?.into(),
            eps.into(),
        ],
    )?;
    Ok(rstd)
}

/// `dx` (`+ residual` when given) ([`crate::norm::rmsnorm_backward_input`]).
pub fn rmsnorm_backward_input<'a>(
    dy: impl Into<DevSlice<'a, f32>>,
    x: impl Into<DevSlice<'a, f32>>,
    w: impl Into<DevSlice<'a, f32>>,
    rstd: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    residual: Option<DevSlice<'a, f32>>,
) -> Result<DevBuf<f32>, CudaError> {
    let dy: DevSlice<'_, f32> = dy.into();
    let x: DevSlice<'_, f32> = x.into();
    let w: DevSlice<'_, f32> = w.into();
    let rstd: DevSlice<'_, f32> = rstd.into();
    let rows = rows_of(x.len(), dim, "rmsnorm x")?;
    same_len("rmsnorm dy", dy.len(), x.len())?;
    same_len("rmsnorm rstd", rstd.len(), rows)?;
    if let Some(r) = residual {
        same_len("rmsnorm residual", r.len(), x.len())?;
    }
    let gpu = x.gpu().clone();
    let dx = gpu.alloc::<f32>(x.len())?;
    let res = residual.map_or(KArg::Ptr(0), KArg::from);
    gpu.launch(
        "norm",
        "rmsnorm_backward_input",
        LaunchCfg::linear(rows, row_threads(dim)),
        &[
            dy.into(),
            x.into(),
            w.into(),
            rstd.into(),
            res,
            (&dx).into(),
            to_i32(dim, "dim")?.into(),
        ],
    )?;
    Ok(dx)
}

/// `dw += Σ_rows dy ∘ x·rstd` ([`crate::norm::rmsnorm_backward_weight`]).
pub fn rmsnorm_backward_weight<'a>(
    dy: impl Into<DevSlice<'a, f32>>,
    x: impl Into<DevSlice<'a, f32>>,
    rstd: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    dw: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let dy: DevSlice<'_, f32> = dy.into();
    let x: DevSlice<'_, f32> = x.into();
    let rstd: DevSlice<'_, f32> = rstd.into();
    let dw: DevSliceMut<'_, f32> = dw.into();

    let rows = rows_of(x.len(), dim, "rmsnorm x")?;
    same_len("rmsnorm dy", dy.len(), x.len())?;
    same_len("rmsnorm rstd", rstd.len(), rows)?;
    same_len("rmsnorm dw", dw.len(), dim)?;
    let gpu = x.gpu().clone();
    // 64 rows per chunk, more where the chunks would exceed the grid's y limit (65 535).
    let rows_per_chunk = rows.div_ceil(MAX_GRID_YZ).max(64);
    let chunks = rows.div_ceil(rows_per_chunk).max(1);
    let partial = gpu.alloc::<f32>(chunks * dim)?;
    let cols = dim.div_ceil(128) as u32;
    gpu.launch(
        "norm",
        "rmsnorm_dw_partial",
        LaunchCfg {
            grid: (cols, chunks as u32, 1),
            block: (128, 1, 1),
            shared_bytes: 0,
        },
        &[
            dy.into(),
            x.into(),
            rstd.into(),
            (&partial).into(),
            to_i32(rows, "rows")?.into(),
            to_i32(dim, "dim")?.into(),
            to_i32(rows_per_chunk, "rows per chunk")?.into(),
        ],
    )?;
    gpu.launch(
        "norm",
        "rmsnorm_dw_reduce",
        LaunchCfg::linear(cols as usize, 128),
        &[
            (&partial).into(),
            (&dw).into(),
            (chunks as i32).into(),
            to_i32(dim, "dim")?.into(),
        ],
    )
}

/// The cos/sin rows of a RoPE rotation on the device: one row per distinct position,
/// computed on the host with [`crate::rope::Rope`]'s formula, and each token's row.
pub struct RopeTable {
    table: DevBuf<f32>,
    rows: DevBuf<i32>,
    head_dim: usize,
    tokens: usize,
}

impl RopeTable {
    /// The table for `positions` (one per token); `backward` rotates by `−a`.
    pub fn new(
        gpu: &Arc<Gpu>,
        rope: &crate::rope::Rope,
        positions: &[usize],
        backward: bool,
    ) -> Result<RopeTable, CudaError> {
        let d = rope.head_dim();
        let half = d / 2;
        let mut uniq = positions.to_vec();
        uniq.sort_unstable();
        uniq.dedup();
        let sign = if backward { -1.0f32 } else { 1.0 };
        let mut table = vec![0.0f32; uniq.len() * d];
        for (row, &pos) in table.chunks_mut(d).zip(&uniq) {
            for i in 0..half {
                let a = pos as f32 * rope.inv_freq()[i];
                row[i] = a.cos();
                row[half + i] = sign * a.sin();
            }
        }
        let rows: Vec<i32> = positions
            .iter()
            .map(|p| uniq.binary_search(p).expect("position in the table") as i32)
            .collect();
        Ok(RopeTable {
            table: gpu.upload(&table)?,
            rows: gpu.upload(&rows)?,
            head_dim: d,
            tokens: positions.len(),
        })
    }
}

/// The identity of a cached [`RopeTable`]: the device, the rotation's frequencies (bits),
/// the positions and the direction.
struct RopeKey {
    gpu: usize,
    inv_freq: Vec<u32>,
    positions: Vec<usize>,
    backward: bool,
}

/// Tables kept per process, most recently used first: a training step rotates with the same
/// positions in every layer, forward and backward, so a step builds no table after the first
/// (no trigonometry on the host, no upload) and only compares positions.
const ROPE_CACHE: usize = 8;

impl RopeTable {
    /// The table of [`RopeTable::new`], built once per (device, rotation, positions,
    /// direction) and shared from then on.
    pub fn cached(
        gpu: &Arc<Gpu>,
        rope: &crate::rope::Rope,
        positions: &[usize],
        backward: bool,
    ) -> Result<Arc<RopeTable>, CudaError> {
        static TABLES: Lru<RopeKey, RopeTable> = OnceLock::new();
        let at = Arc::as_ptr(gpu) as usize;
        let bits = || rope.inv_freq().iter().map(|f| f.to_bits());
        let is = |k: &RopeKey| {
            k.gpu == at
                && k.backward == backward
                && k.positions == positions
                && k.inv_freq.iter().copied().eq(bits())
        };
        let key = || RopeKey {
            gpu: at,
            inv_freq: bits().collect(),
            positions: positions.to_vec(),
            backward,
        };
        lru(&TABLES, is, key, ROPE_CACHE, || {
            RopeTable::new(gpu, rope, positions, backward)
        })
    }
}

/// A process-wide cache of device tables by key, most recently used first ([`lru`]).
pub(crate) type Lru<K, V> = OnceLock<Mutex<Vec<(K, Arc<V>)>>>;

/// The value whose key `is` in `cache` (at most `cap` entries), or on a miss the one `build`
/// makes, kept under `key()`: the tables that a step's layers share ([`RopeTable`],
/// [`super::doc_mask::DocMask`]). A hit compares the caller's borrowed identity and copies
/// nothing.
pub(crate) fn lru<K, V>(
    cache: &Lru<K, V>,
    is: impl Fn(&K) -> bool,
    key: impl FnOnce() -> K,
    cap: usize,
    build: impl FnOnce() -> Result<V, CudaError>,
) -> Result<Arc<V>, CudaError> {
    let mut cache = cache
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(i) = cache.iter().position(|(k, _)| is(k)) {
        let hit = cache.remove(i);
        let value = hit.1.clone();
        cache.insert(0, hit);
        return Ok(value);
    }
    let value = Arc::new(build()?);
    cache.insert(0, (key(), value.clone()));
    cache.truncate(cap);
    Ok(value)
}

/// Rotates `x` (`[tokens, n_heads, head_dim]`) in place ([`crate::rope::Rope::apply`], or
/// `apply_backward` with a backward table).
pub fn rope_rotate<'a>(
    x: impl Into<DevSliceMut<'a, f32>>,
    n_heads: usize,
    t: &RopeTable,
) -> Result<(), CudaError> {
    let x: DevSliceMut<'_, f32> = x.into();
    rope_launch(x.gpu(), x.ptr(), None, x.len(), n_heads, t, "rope_rotate")
}

/// `x` rotated as [`rope_rotate`] rotates it, into a new 16-bit copy rounded to `format` by
/// the kernel as it writes (for the products or the attention that read it next: the same bits
/// as [`rounded_copy`] of the rotated fp32 values); `x` is left as it was.
pub fn rope_rotate_rounded<'a>(
    x: impl Into<DevSlice<'a, f32>>,
    n_heads: usize,
    t: &RopeTable,
    format: crate::operands::Operands,
) -> Result<DevBuf<u16>, CudaError> {
    let x: DevSlice<'_, f32> = x.into();
    let kernel = rounding_kernel(
        ["rope_rotate", "rope_rotate_bf16", "rope_rotate_f16"],
        format,
    )?;
    let y = x.gpu().alloc::<u16>(x.len())?;
    rope_launch(x.gpu(), x.ptr(), Some(y.ptr()), x.len(), n_heads, t, kernel)?;
    Ok(y)
}

/// Launches a RoPE kernel on `len` elements at `x`: in place, or into `y`.
fn rope_launch(
    gpu: &Arc<Gpu>,
    x: u64,
    y: Option<u64>,
    len: usize,
    n_heads: usize,
    t: &RopeTable,
    kernel: &'static str,
) -> Result<(), CudaError> {
    same_len("rope x", len, t.tokens * n_heads * t.head_dim)?;
    // A warp per (token, head) row; the kernel indexes the rows in 32 bits.
    let rows = t.tokens * n_heads;
    to_i32(rows, "tokens × heads")?;
    let mut args = vec![KArg::Ptr(x)];
    args.extend(y.map(KArg::Ptr));
    args.extend::<[KArg; 5]>([
        (&t.table).into(),
        (&t.rows).into(),
        to_i32(t.tokens, "tokens")?.into(),
        to_i32(n_heads, "heads")?.into(),
        to_i32(t.head_dim, "head_dim")?.into(),
    ]);
    gpu.launch("rope", kernel, elements(rows * 32), &args)
}

/// `out[t] = table[ids[t] − vocab_start]` or zeros outside the shard
/// ([`crate::embedding::embedding_forward_shard`]); `table` holds `rows × dim`.
pub fn embedding_forward<'a>(
    ids: impl Into<DevSlice<'a, u32>>,
    table: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    vocab_start: usize,
) -> Result<DevBuf<f32>, CudaError> {
    let ids: DevSlice<'_, u32> = ids.into();
    let table: DevSlice<'_, f32> = table.into();
    let rows = rows_of(table.len(), dim, "embedding table")?;
    let gpu = table.gpu().clone();
    let out = gpu.alloc::<f32>(ids.len() * dim)?;
    gpu.launch(
        "embedding",
        "embedding_forward",
        rows_of_blocks(ids.len()),
        &[
            ids.into(),
            table.into(),
            (&out).into(),
            to_i32(ids.len(), "tokens")?.into(),
            to_i32(dim, "dim")?.into(),
            to_i32(vocab_start, "vocab_start")?.into(),
            to_i32(rows, "rows")?.into(),
        ],
    )?;
    Ok(out)
}

/// `dtable[ids[t] − vocab_start] += dout[t]` for the tokens in the shard
/// ([`crate::embedding::embedding_backward_shard`]); the tokens are grouped by row on the
/// host (`ids` is the host copy), so the device sums each row's tokens in token order.
pub fn embedding_backward<'a>(
    ids: &[u32],
    dout: impl Into<DevSlice<'a, f32>>,
    dim: usize,
    vocab_start: usize,
    dtable: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let dout: DevSlice<'_, f32> = dout.into();
    let dtable: DevSliceMut<'_, f32> = dtable.into();
    let rows = rows_of(dtable.len(), dim, "embedding dtable")?;
    same_len("embedding dout", dout.len(), ids.len() * dim)?;
    let mut order: Vec<(i32, i32)> = ids
        .iter()
        .enumerate()
        .filter_map(|(t, &id)| {
            let r = (id as usize)
                .checked_sub(vocab_start)
                .filter(|&r| r < rows)?;
            Some((r as i32, t as i32))
        })
        .collect();
    if order.is_empty() {
        return Ok(());
    }
    order.sort_unstable();
    let (mut uniq, mut start, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
    for (k, &(r, t)) in order.iter().enumerate() {
        if uniq.last() != Some(&r) {
            uniq.push(r);
            start.push(k as i32);
        }
        tokens.push(t);
    }
    start.push(order.len() as i32);
    let gpu = dtable.gpu().clone();
    let (u, s, t) = (
        gpu.upload(&uniq)?,
        gpu.upload(&start)?,
        gpu.upload(&tokens)?,
    );
    gpu.launch(
        "embedding",
        "embedding_backward",
        LaunchCfg {
            grid: (uniq.len() as u32, dim.div_ceil(128) as u32, 1),
            block: (128, 1, 1),
            shared_bytes: 0,
        },
        &[
            dout.into(),
            (&u).into(),
            (&s).into(),
            (&t).into(),
            (&dtable).into(),
            to_i32(dim, "dim")?.into(),
        ],
    )
}

/// Per-row `(max, Σ exp(z − max), target logit)` of a logits block `[rows, shard]` over
/// vocabulary ids `[vocab_start, vocab_start + shard)` ([`crate::cross_entropy::logits_row_stats`]).
pub fn ce_row_stats<'a>(
    logits: impl Into<DevSlice<'a, f32>>,
    targets: impl Into<DevSlice<'a, i64>>,
    shard: usize,
    vocab_start: usize,
    ignore_index: i64,
) -> Result<[DevBuf<f32>; 3], CudaError> {
    let logits: DevSlice<'_, f32> = logits.into();
    let targets: DevSlice<'_, i64> = targets.into();
    let rows = targets.len();
    same_len("ce logits", logits.len(), rows * shard)?;
    let gpu = logits.gpu().clone();
    let out = [
        gpu.alloc::<f32>(rows)?,
        gpu.alloc::<f32>(rows)?,
        gpu.alloc::<f32>(rows)?,
    ];
    gpu.launch(
        "cross_entropy",
        "ce_row_stats",
        LaunchCfg::linear(rows.div_ceil(8), 256),
        &[
            logits.into(),
            targets.into(),
            to_i32(rows, "rows")?.into(),
            to_i32(shard, "shard")?.into(),
            to_i32(vocab_start, "vocab_start")?.into(),
            KArg::I64(ignore_index),
            (&out[0]).into(),
            (&out[1]).into(),
            (&out[2]).into(),
        ],
    )?;
    Ok(out)
}

/// `lse = max + log Σ exp` per row, for statistics that cover the whole vocabulary.
pub fn ce_lse<'a>(
    max: impl Into<DevSlice<'a, f32>>,
    sumexp: impl Into<DevSlice<'a, f32>>,
) -> Result<DevBuf<f32>, CudaError> {
    let max: DevSlice<'_, f32> = max.into();
    let sumexp: DevSlice<'_, f32> = sumexp.into();

    same_len("ce lse", max.len(), sumexp.len())?;
    let gpu = max.gpu().clone();
    let lse = gpu.alloc::<f32>(max.len())?;
    gpu.launch(
        "cross_entropy",
        "ce_lse",
        elements(max.len()),
        &[
            max.into(),
            sumexp.into(),
            (&lse).into(),
            to_i32(max.len(), "rows")?.into(),
        ],
    )?;
    Ok(lse)
}

/// Turns the logits block into its gradient in place ([`crate::cross_entropy::logits_grad_inplace`]).
#[allow(clippy::too_many_arguments)]
pub fn ce_grad_inplace<'a>(
    logits: impl Into<DevSliceMut<'a, f32>>,
    targets: impl Into<DevSlice<'a, i64>>,
    lse: impl Into<DevSlice<'a, f32>>,
    shard: usize,
    vocab_start: usize,
    ignore_index: i64,
    grad_scale: f32,
) -> Result<(), CudaError> {
    let logits: DevSliceMut<'_, f32> = logits.into();
    let targets: DevSlice<'_, i64> = targets.into();
    let lse: DevSlice<'_, f32> = lse.into();
    let rows = targets.len();
    same_len("ce logits", logits.len(), rows * shard)?;
    same_len("ce lse", lse.len(), rows)?;
    logits.gpu().launch(
        "cross_entropy",
        "ce_grad_inplace",
        rows_of_blocks(rows),
        &[
            (&logits).into(),
            targets.into(),
            lse.into(),
            to_i32(rows, "rows")?.into(),
            to_i32(shard, "shard")?.into(),
            to_i32(vocab_start, "vocab_start")?.into(),
            KArg::I64(ignore_index),
            grad_scale.into(),
        ],
    )
}

/// `Σ (lse − target logit)` over the valid rows, in f64.
pub fn ce_loss_sum<'a>(
    lse: impl Into<DevSlice<'a, f32>>,
    target_logit: impl Into<DevSlice<'a, f32>>,
    targets: impl Into<DevSlice<'a, i64>>,
    ignore_index: i64,
) -> Result<f64, CudaError> {
    let lse: DevSlice<'_, f32> = lse.into();
    let target_logit: DevSlice<'_, f32> = target_logit.into();
    let targets: DevSlice<'_, i64> = targets.into();

    same_len("ce lse", lse.len(), targets.len())?;
    let gpu = lse.gpu().clone();
    let out = gpu.alloc::<f64>(1)?;
    gpu.launch(
        "cross_entropy",
        "ce_loss_sum",
        LaunchCfg::linear(1, 1024),
        &[
            lse.into(),
            target_logit.into(),
            targets.into(),
            to_i32(targets.len(), "rows")?.into(),
            KArg::I64(ignore_index),
            (&out).into(),
        ],
    )?;
    Ok(out.to_host()?[0])
}

/// The shape's arguments of every attention kernel, then the document mask's arrays (null
/// without one: [`super::doc_mask`]).
fn attn_args(s: &AttnShape, docs: Option<&DocMask>) -> Result<Vec<KArg>, CudaError> {
    Ok(vec![
        to_i32(s.batch, "batch")?.into(),
        to_i32(s.q_len, "q_len")?.into(),
        to_i32(s.kv_len, "kv_len")?.into(),
        to_i32(s.n_heads, "n_heads")?.into(),
        to_i32(s.n_kv_heads, "n_kv_heads")?.into(),
        to_i32(s.head_dim, "head_dim")?.into(),
        (s.causal as i32).into(),
        to_i32(s.q_start, "q_start")?.into(),
        to_i32(s.k_start, "k_start")?.into(),
        s.scale().into(),
        docs.map_or(KArg::Ptr(0), |d| (&d.key_lo).into()),
        docs.map_or(KArg::Ptr(0), |d| (&d.q_end).into()),
    ])
}

fn check_attn(s: &AttnShape, q: usize, k: usize, v: usize) -> Result<(), CudaError> {
    if s.head_dim == 0
        || s.head_dim > 256
        || s.n_kv_heads == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
    {
        return Err(CudaError::Shape(format!(
            "attention on the GPU needs 1 <= head_dim <= 256 and n_heads a multiple of n_kv_heads: {s:?}"
        )));
    }
    if s.batch * s.n_heads > MAX_GRID_YZ {
        return Err(CudaError::Shape(format!(
            "attention on the GPU launches batch × n_heads = {} blocks in the grid's y \
             dimension (at most {MAX_GRID_YZ}): split the batch",
            s.batch * s.n_heads
        )));
    }
    same_len("attention q", q, s.q_elems())?;
    same_len("attention k", k, s.kv_elems())?;
    same_len("attention v", v, s.kv_elems())
}

/// The lengths of a backward's buffers against `s`: `q`, `k`, `v` ([`check_attn`]), then
/// `out`, `lse`, `dout` and `dq`, `dk`, `dv`.
fn check_attn_backward(
    s: &AttnShape,
    [q, k, v]: [usize; 3],
    [out, lse, dout]: [usize; 3],
    [dq, dk, dv]: [usize; 3],
) -> Result<(), CudaError> {
    check_attn(s, q, k, v)?;
    for (what, len, want) in [
        ("attention out", out, s.q_elems()),
        ("attention dout", dout, s.q_elems()),
        ("attention dq", dq, s.q_elems()),
        ("attention dk", dk, s.kv_elems()),
        ("attention dv", dv, s.kv_elems()),
        ("attention lse", lse, s.lse_elems()),
    ] {
        same_len(what, len, want)?;
    }
    Ok(())
}

/// Warps per block of the attention kernels.
const ATT_WARPS: usize = 4;

/// Forward: writes `out` and `lse` ([`crate::attention::attention_forward_docs`], under the
/// document mask `docs` if given).
pub fn attention_forward<'a>(
    s: &AttnShape,
    docs: Option<&DocMask>,
    q: impl Into<DevSlice<'a, f32>>,
    k: impl Into<DevSlice<'a, f32>>,
    v: impl Into<DevSlice<'a, f32>>,
    out: impl Into<DevSliceMut<'a, f32>>,
    lse: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let q: DevSlice<'_, f32> = q.into();
    let k: DevSlice<'_, f32> = k.into();
    let v: DevSlice<'_, f32> = v.into();
    let out: DevSliceMut<'_, f32> = out.into();
    let lse: DevSliceMut<'_, f32> = lse.into();

    check_attn(s, q.len(), k.len(), v.len())?;
    same_len("attention out", out.len(), s.q_elems())?;
    same_len("attention lse", lse.len(), s.lse_elems())?;
    if s.q_len == 0 {
        return Ok(());
    }
    let mut args = vec![q.into(), k.into(), v.into(), (&out).into(), (&lse).into()];
    args.extend(attn_args(s, docs)?);
    q.gpu().launch(
        "attention",
        "attn_fwd_f32",
        LaunchCfg {
            grid: (
                s.q_len.div_ceil(ATT_WARPS) as u32,
                (s.batch * s.n_heads) as u32,
                1,
            ),
            block: (32 * ATT_WARPS as u32, 1, 1),
            shared_bytes: (ATT_WARPS * s.head_dim * 4) as u32,
        },
        &args,
    )
}

/// `delta = rowsum(dO ∘ O)` ([B, H, Sq], fp32) for the backward kernels.
fn attn_delta(
    s: &AttnShape,
    out: DevSlice<'_, f32>,
    dout: DevSlice<'_, f32>,
) -> Result<DevBuf<f32>, CudaError> {
    let gpu = out.gpu().clone();
    let delta = gpu.alloc::<f32>(s.lse_elems())?;
    let rows = s.batch * s.q_len * s.n_heads;
    gpu.launch(
        "attention",
        "attn_bwd_delta",
        LaunchCfg::linear(rows.div_ceil(ATT_WARPS), 32 * ATT_WARPS as u32),
        &[
            out.into(),
            dout.into(),
            (&delta).into(),
            to_i32(s.batch, "batch")?.into(),
            to_i32(s.q_len, "q_len")?.into(),
            to_i32(s.n_heads, "n_heads")?.into(),
            to_i32(s.head_dim, "head_dim")?.into(),
        ],
    )?;
    Ok(delta)
}

/// Merges a partial result into rows of a whole one ([`crate::attention::merge_partial`]).
pub fn attention_merge(
    m: &crate::attention::MergeRows,
    out: DevSliceMut<'_, f32>,
    lse: DevSliceMut<'_, f32>,
    part: DevSlice<'_, f32>,
    part_lse: DevSlice<'_, f32>,
) -> Result<(), CudaError> {
    m.check(out.len(), lse.len(), part.len(), part_lse.len())
        .map_err(|e| CudaError::Shape(e.to_string()))?;
    let warps = m.rows * m.heads;
    if warps == 0 {
        return Ok(());
    }
    out.gpu().clone().launch(
        "attention",
        "attn_merge",
        LaunchCfg::linear(warps.div_ceil(ATT_WARPS), 32 * ATT_WARPS as u32),
        &[
            (&out).into(),
            (&lse).into(),
            part.into(),
            part_lse.into(),
            to_i32(m.b, "merge sequence")?.into(),
            to_i32(m.len, "merge length")?.into(),
            to_i32(m.heads, "merge heads")?.into(),
            to_i32(m.head_dim, "merge head_dim")?.into(),
            to_i32(m.row0, "merge first row")?.into(),
            to_i32(m.rows, "merge rows")?.into(),
        ],
    )
}

/// Backward: accumulates (`+=`) into `dq`, `dk`, `dv`
/// ([`crate::attention::attention_backward_docs`], under the forward's document mask `docs`;
/// pass the final merged `out` and `lse` for a partial key block).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<'a>(
    s: &AttnShape,
    docs: Option<&DocMask>,
    q: impl Into<DevSlice<'a, f32>>,
    k: impl Into<DevSlice<'a, f32>>,
    v: impl Into<DevSlice<'a, f32>>,
    out: impl Into<DevSlice<'a, f32>>,
    lse: impl Into<DevSlice<'a, f32>>,
    dout: impl Into<DevSlice<'a, f32>>,
    dq: impl Into<DevSliceMut<'a, f32>>,
    dk: impl Into<DevSliceMut<'a, f32>>,
    dv: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let q: DevSlice<'_, f32> = q.into();
    let k: DevSlice<'_, f32> = k.into();
    let v: DevSlice<'_, f32> = v.into();
    let out: DevSlice<'_, f32> = out.into();
    let lse: DevSlice<'_, f32> = lse.into();
    let dout: DevSlice<'_, f32> = dout.into();
    let dq: DevSliceMut<'_, f32> = dq.into();
    let dk: DevSliceMut<'_, f32> = dk.into();
    let dv: DevSliceMut<'_, f32> = dv.into();

    check_attn_backward(
        s,
        [q.len(), k.len(), v.len()],
        [out.len(), lse.len(), dout.len()],
        [dq.len(), dk.len(), dv.len()],
    )?;
    if s.q_len == 0 || s.kv_len == 0 {
        return Ok(());
    }
    let gpu = q.gpu().clone();
    let delta = attn_delta(s, out, dout)?;
    let mut args = vec![
        q.into(),
        k.into(),
        v.into(),
        dout.into(),
        lse.into(),
        (&delta).into(),
        (&dq).into(),
    ];
    args.extend(attn_args(s, docs)?);
    gpu.launch(
        "attention",
        "attn_bwd_dq",
        LaunchCfg {
            grid: (
                s.q_len.div_ceil(ATT_WARPS) as u32,
                (s.batch * s.n_heads) as u32,
                1,
            ),
            block: (32 * ATT_WARPS as u32, 1, 1),
            shared_bytes: 0,
        },
        &args,
    )?;
    let mut args = vec![
        q.into(),
        k.into(),
        v.into(),
        dout.into(),
        lse.into(),
        (&delta).into(),
        (&dk).into(),
        (&dv).into(),
    ];
    args.extend(attn_args(s, docs)?);
    gpu.launch(
        "attention",
        "attn_bwd_dkv",
        LaunchCfg {
            grid: (
                s.kv_len.div_ceil(ATT_WARPS) as u32,
                (s.batch * s.n_kv_heads) as u32,
                1,
            ),
            block: (32 * ATT_WARPS as u32, 1, 1),
            shared_bytes: 0,
        },
        &args,
    )
}

/// Query rows (forward, dQ) and keys (dK/dV) per block of the tensor-core attention kernels;
/// 4 warps of 16 rows each (the key and value tiles they stream are as long).
const ATT_TC_TILE: usize = 64;

/// The tensor-core attention's kernel choices. Each choice computes the same function (the
/// kernels' contract); they differ in speed and in the order of some fp32 sums, hence in the
/// last bits. [`ATTN_KERNELS`] is the library's; `xtrain bench kernels --device cuda` times
/// every choice against the others, alternating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnKernels {
    /// Query rows a warp of the forward and of dQ owns at head sizes up to 64 (above, one
    /// m-tile).
    pub warp_rows: WarpRows,
    /// The backward's kernels.
    pub backward: AttnBackwardKernels,
}

/// Query rows a warp of the tensor-core forward and dQ kernels owns at head sizes up to 64,
/// in m-tiles of 16 (a block of 4 warps owns four times as many).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarpRows {
    /// One m-tile (the `_k4` kernels: 166 and 161 registers, 3 blocks an SM).
    One,
    /// Two m-tiles (the `_m2_k4` kernels; FlashAttention-2's layout for head 64): each K and V
    /// fragment read from shared memory serves both tiles' products, half the shared-memory
    /// reads per FLOP, at 230–240 registers a thread and 2 blocks an SM.
    Two,
}

/// The kernels of the tensor-core attention backward at head sizes up to 64 without a document
/// mask (the others always take [`AttnBackwardKernels::Split`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnBackwardKernels {
    /// `attn_bwd_dq_tc` per query block beside `attn_bwd_dkv_tc` per key block: each computes
    /// `S` and `dP` itself, so seven products where FlashAttention-2's backward has five.
    Split,
    /// One kernel per key block (`attn_bwd_fused_tc`): dK and dV as the split kernel, and each
    /// key block's share of dQ (`dS K`) added into dQ in a fixed order (key block 0 first, a
    /// count per query step of 32 rows ordering the adds: deterministic, no atomic sums),
    /// five products.
    Fused,
}

/// The library's choice of [`AttnKernels`]: the measured kernels (docs/GPU.md).
pub const ATTN_KERNELS: AttnKernels = AttnKernels {
    warp_rows: WarpRows::One,
    backward: AttnBackwardKernels::Split,
};

impl AttnKernels {
    /// Query rows per block of the forward and dQ kernels at this shape's head size.
    fn query_rows(self, s: &AttnShape) -> usize {
        match self.warp_rows {
            WarpRows::Two if s.head_dim <= 64 => 2 * ATT_TC_TILE,
            _ => ATT_TC_TILE,
        }
    }
}

/// Query rows per step of the tensor-core dK/dV kernel.
const ATT_TC_QSTEP: usize = 32;

/// The register tiles of a tensor-core attention kernel: head sizes up to 64 (`_k4`; the
/// forward and dQ also with two m-tiles a warp, `_m2_k4`) or up to 128 (`_k8`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum TcTile {
    K4,
    M2K4,
    K8,
}

/// The instantiation of a tensor-core attention kernel (`attn_fwd_tc`, `attn_bwd_dq_tc`,
/// `attn_bwd_dkv_tc`, `attn_bwd_fused_tc`) for a document mask or none (`_docs`), the operand
/// format — bf16, or fp16 (`_f16`) — and the register tiles for the shape's head size and
/// `kernels`' rows a warp (the forward's and dQ's).
fn tc_kernel(
    s: &AttnShape,
    kernel: &'static str,
    format: crate::operands::Operands,
    docs: bool,
    kernels: AttnKernels,
) -> Result<&'static str, CudaError> {
    use crate::operands::Operands::{Bf16, F16, F32};
    use TcTile::{K4, K8, M2K4};
    let rows_a_warp = matches!(kernel, "attn_fwd_tc" | "attn_bwd_dq_tc");
    let tile = match (s.head_dim <= 64, kernels.warp_rows) {
        (false, _) => K8,
        (true, WarpRows::Two) if rows_a_warp => M2K4,
        (true, _) => K4,
    };
    let f16 = match format {
        Bf16 => false,
        F16 => true,
        F32 => {
            return Err(CudaError::Shape(
                "tensor-core attention takes bf16 or fp16 operands, not fp32: use \
                 attention_forward / attention_backward"
                    .into(),
            ))
        }
    };
    Ok(match (kernel, docs, f16, tile) {
        ("attn_fwd_tc", false, false, K4) => "attn_fwd_tc_k4",
        ("attn_fwd_tc", false, false, M2K4) => "attn_fwd_tc_m2_k4",
        ("attn_fwd_tc", false, false, K8) => "attn_fwd_tc_k8",
        ("attn_fwd_tc", false, true, K4) => "attn_fwd_tc_f16_k4",
        ("attn_fwd_tc", false, true, M2K4) => "attn_fwd_tc_f16_m2_k4",
        ("attn_fwd_tc", false, true, K8) => "attn_fwd_tc_f16_k8",
        ("attn_fwd_tc", true, false, K4) => "attn_fwd_tc_docs_k4",
        ("attn_fwd_tc", true, false, M2K4) => "attn_fwd_tc_docs_m2_k4",
        ("attn_fwd_tc", true, false, K8) => "attn_fwd_tc_docs_k8",
        ("attn_fwd_tc", true, true, K4) => "attn_fwd_tc_docs_f16_k4",
        ("attn_fwd_tc", true, true, M2K4) => "attn_fwd_tc_docs_f16_m2_k4",
        ("attn_fwd_tc", true, true, K8) => "attn_fwd_tc_docs_f16_k8",
        ("attn_bwd_dq_tc", false, false, K4) => "attn_bwd_dq_tc_k4",
        ("attn_bwd_dq_tc", false, false, M2K4) => "attn_bwd_dq_tc_m2_k4",
        ("attn_bwd_dq_tc", false, false, K8) => "attn_bwd_dq_tc_k8",
        ("attn_bwd_dq_tc", false, true, K4) => "attn_bwd_dq_tc_f16_k4",
        ("attn_bwd_dq_tc", false, true, M2K4) => "attn_bwd_dq_tc_f16_m2_k4",
        ("attn_bwd_dq_tc", false, true, K8) => "attn_bwd_dq_tc_f16_k8",
        ("attn_bwd_dq_tc", true, false, K4) => "attn_bwd_dq_tc_docs_k4",
        ("attn_bwd_dq_tc", true, false, M2K4) => "attn_bwd_dq_tc_docs_m2_k4",
        ("attn_bwd_dq_tc", true, false, K8) => "attn_bwd_dq_tc_docs_k8",
        ("attn_bwd_dq_tc", true, true, K4) => "attn_bwd_dq_tc_docs_f16_k4",
        ("attn_bwd_dq_tc", true, true, M2K4) => "attn_bwd_dq_tc_docs_f16_m2_k4",
        ("attn_bwd_dq_tc", true, true, K8) => "attn_bwd_dq_tc_docs_f16_k8",
        ("attn_bwd_dkv_tc", false, false, K4) => "attn_bwd_dkv_tc_k4",
        ("attn_bwd_dkv_tc", false, false, K8) => "attn_bwd_dkv_tc_k8",
        ("attn_bwd_dkv_tc", false, true, K4) => "attn_bwd_dkv_tc_f16_k4",
        ("attn_bwd_dkv_tc", false, true, K8) => "attn_bwd_dkv_tc_f16_k8",
        ("attn_bwd_dkv_tc", true, false, K4) => "attn_bwd_dkv_tc_docs_k4",
        ("attn_bwd_dkv_tc", true, false, K8) => "attn_bwd_dkv_tc_docs_k8",
        ("attn_bwd_dkv_tc", true, true, K4) => "attn_bwd_dkv_tc_docs_f16_k4",
        ("attn_bwd_dkv_tc", true, true, K8) => "attn_bwd_dkv_tc_docs_f16_k8",
        ("attn_bwd_fused_tc", false, false, K4) => "attn_bwd_fused_tc_k4",
        ("attn_bwd_fused_tc", false, true, K4) => "attn_bwd_fused_tc_f16_k4",
        (k, ..) => unreachable!("no tensor-core attention kernel {k} for this shape"),
    })
}

/// Whether the tensor-core attention kernels take this shape's head size
/// ([`tensor_core_head_dim`]).
pub fn tensor_core_attention_fits(s: &AttnShape) -> bool {
    tensor_core_head_dim(s.head_dim)
}

/// The head sizes of the tensor-core attention kernels: multiples of 16 (the `k` of one
/// `mma.m16n8k16`) up to 128 (their register tiles).
pub fn tensor_core_head_dim(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && (16..=128).contains(&head_dim)
}

fn check_attn_tc(s: &AttnShape) -> Result<(), CudaError> {
    if !tensor_core_head_dim(s.head_dim) {
        return Err(CudaError::Shape(format!(
            "tensor-core attention needs head_dim a multiple of 16 in 16..=128 (got {}): use \
             attention_forward / attention_backward (fp32) instead",
            s.head_dim
        )));
    }
    let blocks = s.q_len.max(s.kv_len).div_ceil(ATT_TC_TILE);
    if blocks > MAX_GRID_YZ {
        return Err(CudaError::Shape(format!(
            "tensor-core attention launches a block per 64 rows of a head in the grid's y \
             dimension: {blocks} (at most {MAX_GRID_YZ}); split the sequence"
        )));
    }
    Ok(())
}

/// The grid of a tensor-core attention kernel: `heads` (batch × heads) in x, the head's
/// `blocks` in y, so that blocks, started in the order of their linear index (x fastest),
/// start in the kernels' order of blocks (the longest first: kernels/attention_tc.cu, f.)
/// across all heads.
fn tc_grid(heads: usize, blocks: usize) -> (u32, u32, u32) {
    (heads as u32, blocks as u32, 1)
}

/// Dynamic shared memory of `attn_fwd_tc` and `attn_bwd_dq_tc`: two stages (the double buffer
/// of their cp.async pipeline) of a K and a V tile of 64 rows, bf16, row stride
/// `head_dim + 8`: 36 864 bytes for head_dim 64, 69 632 for 128.
fn attn_tc_kv_shared(s: &AttnShape) -> u32 {
    (2 * 2 * ATT_TC_TILE * (s.head_dim + 8) * 2) as u32
}

/// Dynamic shared memory of `attn_bwd_dkv_tc`: two stages of the lse and delta of a step of 32
/// query rows (fp32), the CTA's K and V tiles of 64 rows, and two stages of the step's Q and dO
/// tiles of 32 rows (bf16, row stride `head_dim + 8`): 37 376 bytes for head_dim 64, 70 144
/// for 128.
fn attn_tc_dkv_shared(s: &AttnShape) -> u32 {
    ((2 * ATT_TC_TILE + 4 * ATT_TC_QSTEP) * (s.head_dim + 8) * 2 + 4 * ATT_TC_QSTEP * 4) as u32
}

/// The fused backward's `dSᵀ` tile beside `attn_bwd_dkv_tc`'s shared memory: 64 keys by a
/// query step of 32 bf16 plus 8 of padding (`TB_DS_LD`).
const ATT_TC_FUSED_DS_BYTES: u32 = (ATT_TC_TILE * (ATT_TC_QSTEP + 8) * 2) as u32;

/// A buffer of the tensor-core attention kernels starts `align`-byte aligned: Q, K, V (bf16
/// bits) 16, each row being copied 16 bytes at a time by cp.async (a whole allocation, as
/// [`Operand::new`] and the rounding of [`crate::operands`] make, always is; `head_dim` a
/// multiple of 16 keeps every row aligned after the first); the fp32 outputs 8, written (and
/// the backward's read back and accumulated) as pairs.
fn check_attn_aligned(what: &str, ptr: u64, align: u64) -> Result<(), CudaError> {
    if ptr.is_multiple_of(align) {
        Ok(())
    } else {
        Err(CudaError::Shape(format!(
            "tensor-core attention accesses {what} {align} bytes at a time: its buffer must start \
             {align}-byte aligned (a whole buffer, or a view at an even offset), not at {ptr:#x}"
        )))
    }
}

/// Forward on the tensor cores (sm_80+), FlashAttention-2 style: writes `out` and `lse` like
/// [`attention_forward`] (same shapes, layouts, causal mask by global positions, grouped KV
/// heads, `lse = -inf` and `out = 0` for a row that sees no key).
///
/// Numerics, in the operand `format` (bf16, or fp16 for fp16 steps; fp32 is an error): Q, K, V
/// come rounded to it (nearest even: the caller rounds each once, for every kernel that reads
/// it, [`crate::operands`]) and `S = Q Kᵀ` is one `mma.m16n8k16` product with fp32
/// accumulation; the online softmax (running max and sum, rescaling of the output
/// accumulators) is fp32, in the exp2 domain (`ex2.approx`), `P` is rounded to the format for
/// `O += P V` (fp32 accumulation), and `lse = (m₂ + log₂ l) · ln 2` with `l` summed from the
/// fp32 `P`. So the result is the fp32 kernel's up to the rounding of the operands (relative
/// 2⁻⁸ each in bf16, 2⁻¹¹ in fp16), not bit-equal.
///
/// One block of 4 warps per (query rows, batch × head), the longest (last) query blocks of all
/// heads first (the grid is (batch × heads, blocks)): 64 rows, or 128 at head sizes up to 64
/// with `kernels.warp_rows` [`WarpRows::Two`] (the library's choice: [`ATTN_KERNELS`]);
/// dynamic shared memory `512 · (head_dim + 8)` bytes (36 864 for head_dim 64, 69 632 for
/// 128: K and V tiles double-buffered by cp.async; kernels/attention_tc.cu). `head_dim` must
/// be a multiple of 16 in 16..=128: otherwise [`CudaError::Shape`], and the caller uses
/// [`attention_forward`]. `docs`: the document mask, as for [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_tc<'a>(
    kernels: AttnKernels,
    s: &AttnShape,
    docs: Option<&DocMask>,
    format: crate::operands::Operands,
    q: impl Into<DevSlice<'a, u16>>,
    k: impl Into<DevSlice<'a, u16>>,
    v: impl Into<DevSlice<'a, u16>>,
    out: impl Into<DevSliceMut<'a, f32>>,
    lse: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let q: DevSlice<'_, u16> = q.into();
    let k: DevSlice<'_, u16> = k.into();
    let v: DevSlice<'_, u16> = v.into();
    let out: DevSliceMut<'_, f32> = out.into();
    let lse: DevSliceMut<'_, f32> = lse.into();

    check_attn(s, q.len(), k.len(), v.len())?;
    check_attn_tc(s)?;
    let kernel = tc_kernel(s, "attn_fwd_tc", format, docs.is_some(), kernels)?;
    for (what, x) in [("q", &q), ("k", &k), ("v", &v)] {
        check_attn_aligned(what, x.ptr(), 16)?;
    }
    check_attn_aligned("out", out.ptr(), 8)?;
    same_len("attention out", out.len(), s.q_elems())?;
    same_len("attention lse", lse.len(), s.lse_elems())?;
    if s.q_len == 0 {
        return Ok(());
    }
    let mut args = vec![q.into(), k.into(), v.into(), (&out).into(), (&lse).into()];
    args.extend(attn_args(s, docs)?);
    q.gpu().launch(
        "attention_tc",
        kernel,
        LaunchCfg {
            grid: tc_grid(s.batch * s.n_heads, s.q_len.div_ceil(kernels.query_rows(s))),
            block: (32 * ATT_WARPS as u32, 1, 1),
            shared_bytes: attn_tc_kv_shared(s),
        },
        &args,
    )
}

/// Backward on the tensor cores (sm_80+): accumulates (`+=`) into `dq`, `dk`, `dv` like
/// [`attention_backward`] (pass the final merged `out` and `lse` for a partial key block), and
/// like it deterministic (no atomic sums: every output element is summed in a fixed order).
///
/// Numerics, in the operand `format` (the forward's): `delta = rowsum(dO ∘ O)` is the fp32
/// kernel's, from the fp32 `dout`; `dout` is then rounded to the format once for both kernels;
/// the scores `S = Q Kᵀ` and `dP = dO Vᵀ` are recomputed with 16-bit operands (Q, K, V as
/// given, rounded by the caller like the forward's) and fp32 accumulation,
/// `P = exp(S · scale − lse)` and `dS = P ∘ (dP − delta)` are fp32, then rounded to the format
/// as the operands of `dV += Pᵀ dO`, `dK += scale · dSᵀ Q` and `dQ += scale · dS K` (fp32
/// accumulation).
///
/// Four launches: `attn_bwd_delta` (module "attention"); the rounding of `dout`; from module
/// "attention_tc_bwd" (kernels/attention_tc_bwd.cu), `attn_bwd_dq_tc`, 4 warps per (query
/// rows as the forward's, batch × head), dynamic shared memory `512 · (head_dim + 8)` bytes
/// (36 864 for head_dim 64, 69 632 for 128), and `attn_bwd_dkv_tc`, 4 warps per (64 keys, batch × KV
/// head), `512 · (head_dim + 8) + 512` bytes (37 376 and 70 144). `head_dim` must be a
/// multiple of 16 in 16..=128: otherwise [`CudaError::Shape`], and the caller uses
/// [`attention_backward`]. `docs`: the forward's document mask.
///
/// `kernels`: the library's choice is [`ATTN_KERNELS`]; dQ's query rows a block are the
/// forward's, and [`AttnBackwardKernels::Fused`] (at head sizes up to 64, without a document
/// mask) is one launch after the delta and the rounding of `dout`: `attn_bwd_fused_tc`, 4
/// warps per (64 keys, batch × KV head), `attn_bwd_dkv_tc`'s shared memory and a 64 × 40 bf16
/// tile of `dSᵀ` (42 496 bytes at head_dim 64), with `batch · n_heads · ⌈q_len / 32⌉`
/// counters zeroed before it. Its dQ sums in another order than the split kernel's (each key
/// block's share rounded into `dq` in turn), so the two agree to fp32's rounding of those
/// sums, not bit for bit; dK and dV are the split kernel's bits.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_tc<'a>(
    kernels: AttnKernels,
    s: &AttnShape,
    docs: Option<&DocMask>,
    format: crate::operands::Operands,
    q: impl Into<DevSlice<'a, u16>>,
    k: impl Into<DevSlice<'a, u16>>,
    v: impl Into<DevSlice<'a, u16>>,
    out: impl Into<DevSlice<'a, f32>>,
    lse: impl Into<DevSlice<'a, f32>>,
    dout: impl Into<DevSlice<'a, f32>>,
    dq: impl Into<DevSliceMut<'a, f32>>,
    dk: impl Into<DevSliceMut<'a, f32>>,
    dv: impl Into<DevSliceMut<'a, f32>>,
) -> Result<(), CudaError> {
    let q: DevSlice<'_, u16> = q.into();
    let k: DevSlice<'_, u16> = k.into();
    let v: DevSlice<'_, u16> = v.into();
    let out: DevSlice<'_, f32> = out.into();
    let lse: DevSlice<'_, f32> = lse.into();
    let dout: DevSlice<'_, f32> = dout.into();
    let dq: DevSliceMut<'_, f32> = dq.into();
    let dk: DevSliceMut<'_, f32> = dk.into();
    let dv: DevSliceMut<'_, f32> = dv.into();

    check_attn_tc(s)?;
    let fused =
        kernels.backward == AttnBackwardKernels::Fused && s.head_dim <= 64 && docs.is_none();
    let dq_kernel = tc_kernel(s, "attn_bwd_dq_tc", format, docs.is_some(), kernels)?;
    let dkv_kernel = tc_kernel(s, "attn_bwd_dkv_tc", format, docs.is_some(), kernels)?;
    check_attn_backward(
        s,
        [q.len(), k.len(), v.len()],
        [out.len(), lse.len(), dout.len()],
        [dq.len(), dk.len(), dv.len()],
    )?;
    for (what, x) in [("q", &q), ("k", &k), ("v", &v)] {
        check_attn_aligned(what, x.ptr(), 16)?;
    }
    for (what, x) in [("dq", dq.ptr()), ("dk", dk.ptr()), ("dv", dv.ptr())] {
        check_attn_aligned(what, x, 8)?;
    }
    if s.q_len == 0 || s.kv_len == 0 {
        return Ok(());
    }
    let gpu = q.gpu().clone();
    let delta = attn_delta(s, out, dout)?;
    let dout = rounded_copy(dout, format)?;
    // Every kernel of the module takes the inputs, its outputs, then the shape's arguments.
    let inputs: [KArg; 6] = [
        q.into(),
        k.into(),
        v.into(),
        (&dout).into(),
        lse.into(),
        (&delta).into(),
    ];
    let args = |outputs: &[KArg]| -> Result<Vec<KArg>, CudaError> {
        Ok([&inputs[..], outputs]
            .concat()
            .into_iter()
            .chain(attn_args(s, docs)?)
            .collect())
    };
    let launch = |kernel, grid, shared_bytes, args: &[KArg]| {
        let block = (32 * ATT_WARPS as u32, 1, 1);
        let cfg = LaunchCfg {
            grid,
            block,
            shared_bytes,
        };
        gpu.launch("attention_tc_bwd", kernel, cfg, args)
    };
    let dkv_grid = tc_grid(s.batch * s.n_kv_heads, s.kv_len.div_ceil(ATT_TC_TILE));
    if fused {
        // The counters of the adds into each (batch, head, query step of 32), zeroed; the
        // kernel indexes them with an int.
        let steps = s.batch * s.n_heads * s.q_len.div_ceil(ATT_TC_QSTEP);
        to_i32(steps, "batch × n_heads × query steps")?;
        let turns = gpu.zeros::<u32>(steps)?;
        return launch(
            tc_kernel(s, "attn_bwd_fused_tc", format, false, kernels)?,
            dkv_grid,
            attn_tc_dkv_shared(s) + ATT_TC_FUSED_DS_BYTES,
            &args(&[(&dq).into(), (&dk).into(), (&dv).into(), (&turns).into()])?,
        );
    }
    let dq_grid = tc_grid(s.batch * s.n_heads, s.q_len.div_ceil(kernels.query_rows(s)));
    launch(
        dq_kernel,
        dq_grid,
        attn_tc_kv_shared(s),
        &args(&[(&dq).into()])?,
    )?;
    launch(
        dkv_kernel,
        dkv_grid,
        attn_tc_dkv_shared(s),
        &args(&[(&dk).into(), (&dv).into()])?,
    )
}

/// The per-step scalars of AdamW (`model::optim::AdamW::update`'s, computed the same way).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    pub one_m_b1: f32,
    pub b2: f32,
    pub one_m_b2: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub step_size: f32,
}

impl AdamScalars {
    /// The scalars of step `t ≥ 1` with learning rate `lr` (bias corrections in f64, as torch).
    pub fn new(beta1: f32, beta2: f32, eps: f32, lr: f32, t: u64) -> AdamScalars {
        let (b1, b2) = (beta1 as f64, beta2 as f64);
        let bc1 = 1.0 - b1.powi(t as i32);
        AdamScalars {
            one_m_b1: 1.0 - beta1,
            b2: beta2,
            one_m_b2: 1.0 - beta2,
            bc2_sqrt: (1.0 - b2.powi(t as i32)).sqrt() as f32,
            eps,
            step_size: (lr as f64 / bc1) as f32,
        }
    }

    /// The kernels' trailing arguments, in the order both AdamW kernels take them.
    fn args(self) -> [KArg; 6] {
        [
            self.one_m_b1.into(),
            self.b2.into(),
            self.one_m_b2.into(),
            self.bc2_sqrt.into(),
            self.eps.into(),
            self.step_size.into(),
        ]
    }
}

/// One AdamW step over flat buffers; segment `i` of the buffer ends at `segments[i].0`
/// (increasing, the last = the length) and decays by `segments[i].1 = 1 − lr·weight_decay`.
pub fn adamw<'a>(
    p: impl Into<DevSliceMut<'a, f32>>,
    g: impl Into<DevSlice<'a, f32>>,
    m: impl Into<DevSliceMut<'a, f32>>,
    v: impl Into<DevSliceMut<'a, f32>>,
    segments: &[(usize, f32)],
    s: AdamScalars,
) -> Result<(), CudaError> {
    let p: DevSliceMut<'_, f32> = p.into();
    let g: DevSlice<'_, f32> = g.into();
    let m: DevSliceMut<'_, f32> = m.into();
    let v: DevSliceMut<'_, f32> = v.into();
    let n = p.len();
    same_len("adamw g", g.len(), n)?;
    same_len("adamw m", m.len(), n)?;
    same_len("adamw v", v.len(), n)?;
    if segments.last().map(|s| s.0) != Some(n) || segments.windows(2).any(|w| w[0].0 > w[1].0) {
        return Err(CudaError::Shape(format!(
            "adamw segments must increase and end at the buffer length {n}: {segments:?}"
        )));
    }
    let gpu = p.gpu().clone();
    let ends: Vec<i32> = segments.iter().map(|s| s.0 as i32).collect();
    let decays: Vec<f32> = segments.iter().map(|s| s.1).collect();
    let (ends, decays) = (gpu.upload(&ends)?, gpu.upload(&decays)?);
    gpu.launch(
        "optimizer",
        "adamw",
        elements(n),
        &[
            [
                (&p).into(),
                g.into(),
                (&m).into(),
                (&v).into(),
                to_i32(n, "elements")?.into(),
                (&ends).into(),
                (&decays).into(),
                (segments.len() as i32).into(),
            ]
            .as_slice(),
            &s.args(),
        ]
        .concat(),
    )
}

/// 16-bit training's AdamW step in one pass ([`adamw`] of one segment, decay factor
/// `decay`): the gradient bits `g` (bf16, or fp16 when `f16`) widened and scaled by `factor`
/// (clipping, loss unscaling), the fp32 master `p` and moments `m`, `v` updated, and `p`
/// rounded (nearest even) into the 16-bit weights `w`. The same bits as widening, scaling,
/// [`adamw`] and rounding one after the other (kernels/optimizer.cu), in one launch and 28
/// bytes an element instead of four launches and 48.
#[allow(clippy::too_many_arguments)]
pub fn adamw_bits<'a>(
    p: impl Into<DevSliceMut<'a, f32>>,
    g: impl Into<DevSlice<'a, u16>>,
    m: impl Into<DevSliceMut<'a, f32>>,
    v: impl Into<DevSliceMut<'a, f32>>,
    w: impl Into<DevSliceMut<'a, u16>>,
    f16: bool,
    factor: f32,
    decay: f32,
    s: AdamScalars,
) -> Result<(), CudaError> {
    let p: DevSliceMut<'_, f32> = p.into();
    let g: DevSlice<'_, u16> = g.into();
    let m: DevSliceMut<'_, f32> = m.into();
    let v: DevSliceMut<'_, f32> = v.into();
    let w: DevSliceMut<'_, u16> = w.into();
    let n = p.len();
    for (what, len) in [
        ("g", g.len()),
        ("m", m.len()),
        ("v", v.len()),
        ("w", w.len()),
    ] {
        same_len(&format!("adamw_bits {what}"), len, n)?;
    }
    p.gpu().clone().launch(
        "optimizer",
        "adamw_bits",
        elements(n),
        &[
            [
                (&p).into(),
                g.into(),
                (&m).into(),
                (&v).into(),
                (&w).into(),
                to_i32(n, "elements")?.into(),
                (f16 as i32).into(),
                factor.into(),
                decay.into(),
            ]
            .as_slice(),
            &s.args(),
        ]
        .concat(),
    )
}

/// `Σ g²` in f64 (global-norm clipping), summed in a fixed order.
pub fn sq_sum<'a>(g: impl Into<DevSlice<'a, f32>>) -> Result<f64, CudaError> {
    let g: DevSlice<'_, f32> = g.into();

    const CHUNK: usize = 1 << 16;
    let gpu = g.gpu().clone();
    let blocks = g.len().div_ceil(CHUNK).max(1);
    let partial = gpu.alloc::<f64>(blocks)?;
    let out = gpu.alloc::<f64>(1)?;
    gpu.launch(
        "optimizer",
        "sq_sum_partial",
        LaunchCfg::linear(blocks, 256),
        &[
            g.into(),
            to_i32(g.len(), "elements")?.into(),
            (CHUNK as i32).into(),
            (&partial).into(),
        ],
    )?;
    gpu.launch(
        "optimizer",
        "sum_f64",
        LaunchCfg::linear(1, 1024),
        &[(&partial).into(), (blocks as i32).into(), (&out).into()],
    )?;
    Ok(out.to_host()?[0])
}

/// What the router chose: `probs [T, E]`, `experts [T, k]`, `weights [T, k]`.
pub struct Routed {
    pub probs: DevBuf<f32>,
    pub experts: DevBuf<i32>,
    pub weights: DevBuf<f32>,
}

/// The router's [`Routed`] `(probs, experts, weights)` from its logits (softmax,
/// top-k by probability plus `bias`, ties to the lower expert, weights renormalised), as
/// `model::layers::moe::Moe::route` before capacity.
pub fn router_topk<'a>(
    logits: impl Into<DevSlice<'a, f32>>,
    bias: Option<DevSlice<'a, f32>>,
    experts: usize,
    k: usize,
) -> Result<Routed, CudaError> {
    let logits: DevSlice<'_, f32> = logits.into();
    let tokens = rows_of(logits.len(), experts, "router logits")?;
    if k == 0 || k > experts || experts > 1024 {
        return Err(CudaError::Shape(format!(
            "router top-{k} of {experts} experts (at most 1024)"
        )));
    }
    let gpu = logits.gpu().clone();
    let probs = gpu.alloc::<f32>(logits.len())?;
    let chosen = gpu.alloc::<i32>(tokens * k)?;
    let weights = gpu.alloc::<f32>(tokens * k)?;
    gpu.launch(
        "moe",
        "router_topk",
        LaunchCfg::linear(tokens.div_ceil(4), 128),
        &[
            logits.into(),
            bias.map_or(KArg::Ptr(0), KArg::from),
            (&probs).into(),
            (&chosen).into(),
            (&weights).into(),
            to_i32(tokens, "tokens")?.into(),
            to_i32(experts, "experts")?.into(),
            to_i32(k, "k")?.into(),
        ],
    )?;
    Ok(Routed {
        probs,
        experts: chosen,
        weights,
    })
}

/// `dst[r] = src[idx[r]]·scale[r]` (rows of `dim`).
pub fn gather_rows<'a>(
    src: impl Into<DevSlice<'a, f32>>,
    idx: impl Into<DevSlice<'a, i32>>,
    scale: Option<DevSlice<'a, f32>>,
    dim: usize,
) -> Result<DevBuf<f32>, CudaError> {
    let src: DevSlice<'_, f32> = src.into();
    let idx: DevSlice<'_, i32> = idx.into();
    let rows = idx.len();
    let gpu = src.gpu().clone();
    let dst = gpu.alloc::<f32>(rows * dim)?;
    gpu.launch(
        "moe",
        "gather_rows",
        rows_of_blocks(rows),
        &[
            src.into(),
            idx.into(),
            scale.map_or(KArg::Ptr(0), KArg::from),
            (&dst).into(),
            to_i32(rows, "rows")?.into(),
            to_i32(dim, "dim")?.into(),
        ],
    )?;
    Ok(dst)
}

/// `y[idx[r]] += w[r]·rows[r]` (`w` absent: 1), rows of `dim`; the indices must be distinct
/// (one expert's tokens), so calls made expert by expert add in the host's order.
pub fn scatter_add_rows<'a>(
    rows: impl Into<DevSlice<'a, f32>>,
    idx: impl Into<DevSlice<'a, i32>>,
    w: Option<DevSlice<'a, f32>>,
    y: impl Into<DevSliceMut<'a, f32>>,
    dim: usize,
) -> Result<(), CudaError> {
    let rows: DevSlice<'_, f32> = rows.into();
    let idx: DevSlice<'_, i32> = idx.into();
    let y: DevSliceMut<'_, f32> = y.into();
    let n = rows_of(rows.len(), dim, "scattered rows")?;
    same_len("scatter indices", idx.len(), n)?;
    if let Some(w) = &w {
        same_len("scatter weights", w.len(), n)?;
    }
    rows_of(y.len(), dim, "scatter target")?;
    y.gpu().launch(
        "moe",
        "scatter_add_rows",
        rows_of_blocks(n),
        &[
            rows.into(),
            idx.into(),
            w.map_or(KArg::Ptr(0), KArg::from),
            (&y).into(),
            to_i32(n, "rows")?.into(),
            to_i32(dim, "dim")?.into(),
        ],
    )
}

/// `out[r] = a[ia[r]] · b[ib[r]]` (rows of `dim`; `ib` absent: `b`'s rows in order).
pub fn row_dots<'a>(
    a: impl Into<DevSlice<'a, f32>>,
    ia: impl Into<DevSlice<'a, i32>>,
    b: impl Into<DevSlice<'a, f32>>,
    ib: Option<DevSlice<'a, i32>>,
    dim: usize,
) -> Result<DevBuf<f32>, CudaError> {
    let a: DevSlice<'_, f32> = a.into();
    let ia: DevSlice<'_, i32> = ia.into();
    let b: DevSlice<'_, f32> = b.into();
    let rows = ia.len();
    match &ib {
        Some(ib) => same_len("row_dots", ib.len(), rows)?,
        None => same_len("row_dots", b.len(), rows * dim)?,
    }
    let gpu = a.gpu().clone();
    let out = gpu.alloc::<f32>(rows)?;
    gpu.launch(
        "moe",
        "row_dots",
        LaunchCfg::linear(rows.div_ceil(4), 128),
        &[
            a.into(),
            ia.into(),
            b.into(),
            ib.map_or(KArg::Ptr(0), KArg::from),
            (&out).into(),
            to_i32(rows, "rows")?.into(),
            to_i32(dim, "dim")?.into(),
        ],
    )?;
    Ok(out)
}

/// The log-sum-exps of a fused cross-entropy pass on the device: computed or given.
pub enum CeLse<'a> {
    Write(DevSliceMut<'a, f32>),
    Read(DevSlice<'a, f32>),
}

/// The gradient outputs of a fused cross-entropy pass on the device.
pub struct CeGrad<'a> {
    pub scale: f32,
    pub dx: Option<DevSliceMut<'a, f32>>,
    pub dw: Option<DevSliceMut<'a, f32>>,
}

/// Logits a chunk of the fused head holds at least on a GPU (64 Mi floats, 256 MiB;
/// [`crate::ops::fused_linear_ce`]): memory is plentiful there, and each chunk's products
/// read and write the whole fp32 `dW` once, so 128-row chunks of a 32k vocabulary spent more
/// time streaming `dW` than multiplying.
pub const GPU_CE_CHUNK_FLOATS: usize = 1 << 26;

/// The fused LM head + cross-entropy ([`crate::cross_entropy::fused_linear_ce_forward`],
/// `_backward`, `_forward_backward` in one): per chunk of `chunk_rows` rows, `z = x·Wᵀ` on
/// cuBLASLt, the row statistics and log-sum-exps (written or read), the loss, and with a
/// gradient `dz = (softmax(z) − onehot)·scale` in place, `dx = dz·W`, `dW += dzᵀ·x`. `targets`
/// are on the host (uploaded once). Returns the loss sum over valid rows (0 when reading lse).
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_ce(
    x: DevSlice<'_, f32>,
    w: DevSlice<'_, f32>,
    targets: &[i64],
    dim: usize,
    vocab: usize,
    chunk_rows: usize,
    ignore_index: i64,
    mut lse: CeLse<'_>,
    mut grad: Option<CeGrad<'_>>,
) -> Result<f64, CudaError> {
    let rows = targets.len();
    same_len("fused ce x", x.len(), rows * dim)?;
    same_len("fused ce w", w.len(), vocab * dim)?;
    let gpu = x.gpu().clone();
    let dev_targets = gpu.upload(targets)?;
    let chunk_rows = chunk_rows.max(1);
    let mut logits = gpu.alloc::<f32>(chunk_rows.min(rows.max(1)) * vocab)?;
    let mut loss_sum = 0.0f64;
    // The products take the calling thread's operand format (the head's logits in bf16 on a
    // bf16 run, like every other product); the weight is prepared once for every chunk.
    let operands = crate::operands::current();
    let w_op = Operand::new(w, operands)?;
    let matmul = |c: u64, a: &Operand<'_>, b: &Operand<'_>, mkn: [usize; 3], flags: [bool; 3]| {
        // SAFETY: the callers pass ranges of the checked buffers with these shapes.
        unsafe { matmul_prepared(&gpu, operands, c, a, b, mkn, flags) }
    };
    for r0 in (0..rows).step_by(chunk_rows) {
        let n = chunk_rows.min(rows - r0);
        let t = dev_targets.slice(r0..r0 + n);
        let xc = x.slice(r0 * dim..(r0 + n) * dim);
        let ignored = targets[r0..r0 + n].iter().all(|&v| v == ignore_index);
        if ignored && matches!(lse, CeLse::Read(_)) {
            if let Some(dx) = grad.as_mut().and_then(|g| g.dx.as_mut()) {
                dx.reborrow().slice_mut(r0 * dim..(r0 + n) * dim).zero()?;
            }
            continue;
        }
        let z = logits.slice_mut(0..n * vocab);
        let x_op = Operand::new(xc, operands)?;
        matmul(z.ptr(), &x_op, &w_op, [n, dim, vocab], [false, true, false])?;
        let lse_c: DevSlice<'_, f32> = match &mut lse {
            CeLse::Write(l) => {
                let [mx, se, tl] = ce_row_stats(z.as_ref(), t, vocab, 0, ignore_index)?;
                let lc = ce_lse(&mx, &se)?;
                loss_sum += ce_loss_sum(&lc, &tl, t, ignore_index)?;
                l.reborrow()
                    .slice_mut(r0..r0 + n)
                    .copy_from(lc.as_slice())?;
                l.as_ref().slice(r0..r0 + n)
            }
            CeLse::Read(l) => l.slice(r0..r0 + n),
        };
        let Some(g) = grad.as_mut() else { continue };
        if ignored {
            if let Some(dx) = g.dx.as_mut() {
                dx.reborrow().slice_mut(r0 * dim..(r0 + n) * dim).zero()?;
            }
            continue;
        }
        let z = logits.slice_mut(0..n * vocab);
        ce_grad_inplace(z, t, lse_c, vocab, 0, ignore_index, g.scale)?;
        let z_op = Operand::new(logits.slice(0..n * vocab), operands)?;
        if let Some(dx) = g.dx.as_mut() {
            let dxc = dx.reborrow().slice_mut(r0 * dim..(r0 + n) * dim);
            matmul(
                dxc.ptr(),
                &z_op,
                &w_op,
                [n, vocab, dim],
                [false, false, false],
            )?;
        }
        if let Some(dw) = g.dw.as_mut() {
            matmul(dw.ptr(), &z_op, &x_op, [vocab, n, dim], [true, false, true])?;
        }
    }
    Ok(loss_sum)
}
