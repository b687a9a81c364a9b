//! The kernels on either device: each function takes [`Buf`] views and runs the CPU kernel of
//! the same name on host buffers or its CUDA twin ([`crate::cuda::ops`]) on GPU buffers, with
//! the same shapes and write / accumulate conventions. Buffers on different devices are an
//! error. On the host every call is exactly the CPU kernel (same slices, same bits).

use crate::attention::{AttnShape, AttnTiles};
use crate::buf::{mixed, Buf, BufMut, BufRef, Dev};
use crate::cross_entropy::{CeConfig, CeOutput};
use crate::cuda::ops as gpu;
use crate::operands::{Operand, Operands};
use crate::rope::Rope;
use crate::TensorError;

type Result<T> = std::result::Result<T, TensorError>;

/// `op(A)·op(B)` as a new buffer ([`crate::gemm::matmul_new`]); `a` and `b` as in [`matmul`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_new<'a, 'b>(
    a: impl Into<Operand<'a>>,
    b: impl Into<Operand<'b>>,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
) -> Result<Buf> {
    let (a, b): (Operand<'a>, Operand<'b>) = (a.into(), b.into());
    match (&a, &b) {
        (Operand::Values(BufRef::Host(a)), Operand::Values(BufRef::Host(b))) => Ok(Buf::Host(
            crate::gemm::matmul_new(a, b, m, k, n, trans_a, trans_b)?,
        )),
        _ => {
            let mut c = match (a.dev(), b.dev()) {
                (Dev::Cuda(g), Dev::Cuda(_)) => Buf::Cuda(g.alloc::<f32>(m * n)?),
                _ => return Err(mixed("matmul")),
            };
            matmul(c.m(), a, b, m, k, n, trans_a, trans_b, false)?;
            Ok(c)
        }
    }
}

/// `C (+)= op(A)·op(B)` ([`crate::gemm::matmul`]); on a GPU with the calling thread's
/// operand format ([`crate::operands`]): `a` and `b` are fp32 values (a [`BufRef`], rounded
/// here where the format is 16-bit) or operands rounded once for several products
/// ([`Operand::new`], in the same format).
#[allow(clippy::too_many_arguments)]
pub fn matmul<'a, 'b>(
    c: BufMut<'_>,
    a: impl Into<Operand<'a>>,
    b: impl Into<Operand<'b>>,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<()> {
    let (a, b): (Operand<'a>, Operand<'b>) = (a.into(), b.into());
    match (c, &a, &b) {
        (BufMut::Host(c), Operand::Values(BufRef::Host(a)), Operand::Values(BufRef::Host(b))) => {
            crate::gemm::matmul(c, a, b, m, k, n, trans_a, trans_b, accumulate)
        }
        (BufMut::Cuda(c), a, b) if a.dev().is_cuda() && b.dev().is_cuda() => {
            if c.len() != m * n || a.len() != m * k || b.len() != k * n {
                return Err(TensorError::Shape(format!(
                    "matmul [{m}, {k}] x [{k}, {n}]: buffers of {}, {} and {}",
                    a.len(),
                    b.len(),
                    c.len()
                )));
            }
            let format = crate::operands::current();
            let gpu = c.gpu().clone();
            let (a, b) = (gpu_operand(a, format)?, gpu_operand(b, format)?);
            // SAFETY: lengths checked; the three ranges are on the same device.
            unsafe {
                gpu::matmul_prepared(
                    &gpu,
                    format,
                    c.ptr(),
                    &a,
                    &b,
                    [m, k, n],
                    [trans_a, trans_b, accumulate],
                )?
            };
            Ok(())
        }
        _ => Err(mixed("matmul")),
    }
}

/// A GPU operand for a product in `format`: fp32 values prepared now, or a copy rounded
/// earlier for the same format.
pub(crate) fn gpu_operand<'a>(x: &'a Operand<'_>, format: Operands) -> Result<gpu::Operand<'a>> {
    match x {
        Operand::Values(BufRef::Cuda(d)) => Ok(gpu::Operand::new(*d, format)?),
        Operand::Rounded(r) if r.format() == format => Ok(gpu::Operand::Rounded(r.bits())),
        Operand::Rounded(r) => Err(TensorError::Shape(format!(
            "an operand rounded to {:?} given to a {format:?} product",
            r.format()
        ))),
        Operand::Values(BufRef::Host(_)) => Err(mixed("matmul")),
    }
}

/// `(y, rstd)` ([`crate::norm::rmsnorm_forward`]).
pub fn rmsnorm_forward(x: BufRef<'_>, w: BufRef<'_>, dim: usize, eps: f32) -> Result<(Buf, Buf)> {
    match (x, w) {
        (BufRef::Host(x), BufRef::Host(w)) => {
            let (y, r) = crate::norm::rmsnorm_forward(x, w, dim, eps)?;
            Ok((Buf::Host(y), Buf::Host(r)))
        }
        (BufRef::Cuda(x), BufRef::Cuda(w)) => {
            let (y, r) = gpu::rmsnorm_forward(x, w, dim, eps)?;
            Ok((Buf::Cuda(y), Buf::Cuda(r)))
        }
        _ => Err(mixed("rmsnorm")),
    }
}

/// `dx (+ residual)` ([`crate::norm::rmsnorm_backward_input`]).
pub fn rmsnorm_backward_input(
    dy: BufRef<'_>,
    x: BufRef<'_>,
    w: BufRef<'_>,
    rstd: BufRef<'_>,
    dim: usize,
    residual: Option<BufRef<'_>>,
) -> Result<Buf> {
    match (dy, x, w, rstd) {
        (BufRef::Host(dy), BufRef::Host(x), BufRef::Host(w), BufRef::Host(r)) => {
            let res = match residual {
                Some(BufRef::Host(v)) => Some(v),
                None => None,
                Some(_) => return Err(mixed("rmsnorm backward")),
            };
            Ok(Buf::Host(crate::norm::rmsnorm_backward_input(
                dy, x, w, r, dim, res,
            )?))
        }
        (BufRef::Cuda(dy), BufRef::Cuda(x), BufRef::Cuda(w), BufRef::Cuda(r)) => {
            let res = match residual {
                Some(BufRef::Cuda(v)) => Some(v),
                None => None,
                Some(_) => return Err(mixed("rmsnorm backward")),
            };
            Ok(Buf::Cuda(gpu::rmsnorm_backward_input(
                dy, x, w, r, dim, res,
            )?))
        }
        _ => Err(mixed("rmsnorm backward")),
    }
}

/// `dw += Σ_rows dy ∘ x·rstd` ([`crate::norm::rmsnorm_backward_weight`]).
pub fn rmsnorm_backward_weight(
    dy: BufRef<'_>,
    x: BufRef<'_>,
    rstd: BufRef<'_>,
    dim: usize,
    dw: BufMut<'_>,
) -> Result<()> {
    match (dy, x, rstd, dw) {
        (BufRef::Host(dy), BufRef::Host(x), BufRef::Host(r), BufMut::Host(dw)) => {
            crate::norm::rmsnorm_backward_weight(dy, x, r, dim, dw)
        }
        (BufRef::Cuda(dy), BufRef::Cuda(x), BufRef::Cuda(r), BufMut::Cuda(dw)) => {
            Ok(gpu::rmsnorm_backward_weight(dy, x, r, dim, dw)?)
        }
        _ => Err(mixed("rmsnorm weight gradient")),
    }
}

/// `silu(gate) ∘ up` ([`crate::activation::swiglu_forward`]).
pub fn swiglu_forward(gate: BufRef<'_>, up: BufRef<'_>) -> Result<Buf> {
    match (gate, up) {
        (BufRef::Host(g), BufRef::Host(u)) => {
            Ok(Buf::Host(crate::activation::swiglu_forward(g, u)?))
        }
        (BufRef::Cuda(g), BufRef::Cuda(u)) => Ok(Buf::Cuda(gpu::swiglu_forward(g, u)?)),
        _ => Err(mixed("swiglu")),
    }
}

/// `(dgate, dup)` ([`crate::activation::swiglu_backward`]).
pub fn swiglu_backward(dout: BufRef<'_>, gate: BufRef<'_>, up: BufRef<'_>) -> Result<(Buf, Buf)> {
    match (dout, gate, up) {
        (BufRef::Host(d), BufRef::Host(g), BufRef::Host(u)) => {
            let (a, b) = crate::activation::swiglu_backward(d, g, u)?;
            Ok((Buf::Host(a), Buf::Host(b)))
        }
        (BufRef::Cuda(d), BufRef::Cuda(g), BufRef::Cuda(u)) => {
            let (a, b) = gpu::swiglu_backward(d, g, u)?;
            Ok((Buf::Cuda(a), Buf::Cuda(b)))
        }
        _ => Err(mixed("swiglu backward")),
    }
}

/// Rotates `x` (`[tokens, n_heads, head_dim]`) in place by RoPE at `positions`, or back by
/// `−a` when `backward` ([`Rope::apply`], [`Rope::apply_backward`]).
pub fn rope(
    rope: &Rope,
    x: BufMut<'_>,
    n_heads: usize,
    positions: &[usize],
    backward: bool,
) -> Result<()> {
    match x {
        BufMut::Host(x) if backward => rope.apply_backward(x, n_heads, positions),
        BufMut::Host(x) => rope.apply(x, n_heads, positions),
        BufMut::Cuda(x) => {
            let table = gpu::RopeTable::cached(x.gpu(), rope, positions, backward)?;
            Ok(gpu::rope_rotate(x, n_heads, &table)?)
        }
    }
}

/// The document mask as the CUDA attention kernels read it
/// ([`crate::cuda::doc_mask::DocMask`]: built from `doc_start` and uploaded once per shape and
/// starts), or `None` for plain causal attention.
fn gpu_docs(
    gpu: &std::sync::Arc<crate::cuda::Gpu>,
    s: &AttnShape,
    doc_start: Option<&[usize]>,
) -> Result<Option<std::sync::Arc<crate::cuda::doc_mask::DocMask>>> {
    Ok(match doc_start {
        Some(ds) => Some(crate::cuda::doc_mask::DocMask::cached(gpu, s, ds)?),
        None => None,
    })
}

/// Whether attention on a GPU runs on the tensor cores: in a bf16 or fp16 step
/// ([`crate::operands::Operands`]; Q, K, V, P, dO and dS rounded to the step's format, softmax
/// and sums in fp32) for head sizes the kernels take (multiples of 16 up to 128). Other head
/// sizes and fp32 steps use the fp32 kernels (the parity path) — by the shape and the run's
/// precision, never by a failure.
pub fn attention_runs_on_tensor_cores(s: &AttnShape) -> bool {
    crate::operands::current() != Operands::F32 && gpu::tensor_core_attention_fits(s)
}

/// `x` (Q, K or V of attention of shape `s`) prepared once for the attention kernels that will
/// read it, forward and backward: on a GPU where attention runs on the tensor cores, its bf16
/// or fp16 copy alone (half the bytes of the activation: what the layer keeps for its
/// backward); otherwise the values themselves (the CPU, GPU steps in fp32, and head sizes the
/// tensor cores do not take compute attention in fp32).
pub fn attention_operand(s: &AttnShape, x: std::sync::Arc<Buf>) -> Result<crate::operands::Kept> {
    use crate::operands::Kept;
    if attention_runs_on_tensor_cores(s) {
        Kept::new(x)
    } else {
        Ok(Kept::Values(x))
    }
}

/// Q, K, V as the attention kernel for `s` reads them: on the tensor cores 16-bit bits in the
/// step's format (fp32 values rounded here, or operands rounded once already), otherwise fp32
/// values.
enum AttnInputs<'a> {
    Host([&'a [f32]; 3]),
    Cuda([crate::cuda::DevSlice<'a, f32>; 3]),
    Cuda16(Operands, [crate::cuda::DevSlice<'a, u16>; 3]),
}

/// Q, K, V rounded for the tensor cores where `s` runs there ([`attention_operand`]'s rule),
/// so that [`attn_inputs`] can borrow their bits.
fn attn_prepare<'a>(s: &AttnShape, qkv: [Operand<'a>; 3]) -> Result<[Operand<'a>; 3]> {
    if !attention_runs_on_tensor_cores(s) {
        return Ok(qkv);
    }
    let [q, k, v] = qkv;
    Ok([Operand::new(q)?, Operand::new(k)?, Operand::new(v)?])
}

fn attn_inputs<'a>(s: &AttnShape, qkv: &'a [Operand<'_>; 3]) -> Result<AttnInputs<'a>> {
    use BufRef::{Cuda, Host};
    use Operand::{Rounded, Values};
    match qkv {
        [Values(Host(q)), Values(Host(k)), Values(Host(v))] => Ok(AttnInputs::Host([q, k, v])),
        [Values(Cuda(q)), Values(Cuda(k)), Values(Cuda(v))] => Ok(AttnInputs::Cuda([*q, *k, *v])),
        [Rounded(q), Rounded(k), Rounded(v)] => {
            let step = crate::operands::current();
            for x in [q, k, v] {
                if !attention_runs_on_tensor_cores(s) || x.format() != step {
                    return Err(TensorError::Shape(format!(
                        "attention was given Q, K, V rounded to {:?}, but this attention (head \
                         size {}, a {step:?} step) computes with {} operands",
                        x.format(),
                        s.head_dim,
                        if attention_runs_on_tensor_cores(s) {
                            "those"
                        } else {
                            "fp32"
                        }
                    )));
                }
            }
            Ok(AttnInputs::Cuda16(step, [q.bits(), k.bits(), v.bits()]))
        }
        _ => Err(mixed("attention")),
    }
}

/// `(out, lse)` of attention as new buffers ([`crate::attention::attention_forward_docs`]:
/// `doc_start` masks attention per document; `None` is plain causal attention). `q`, `k`, `v`
/// are fp32 values, or operands prepared by [`attention_operand`].
pub fn attention_forward<'a>(
    s: &AttnShape,
    doc_start: Option<&[usize]>,
    q: impl Into<Operand<'a>>,
    k: impl Into<Operand<'a>>,
    v: impl Into<Operand<'a>>,
) -> Result<(Buf, Buf)> {
    let qkv = attn_prepare(s, [q.into(), k.into(), v.into()])?;
    let dev = qkv[0].dev();
    let mut out = dev.zeros(s.q_elems())?;
    let mut lse = dev.zeros(s.lse_elems())?;
    match (attn_inputs(s, &qkv)?, out.m(), lse.m()) {
        (AttnInputs::Host([q, k, v]), BufMut::Host(o), BufMut::Host(l)) => {
            crate::attention::attention_forward_docs(
                s,
                doc_start,
                q,
                k,
                v,
                o,
                l,
                AttnTiles::default(),
            )?
        }
        (AttnInputs::Host(_), ..) => return Err(mixed("attention")),
        (AttnInputs::Cuda([q, k, v]), BufMut::Cuda(o), BufMut::Cuda(l)) => {
            let docs = gpu_docs(q.gpu(), s, doc_start)?;
            gpu::attention_forward(s, docs.as_deref(), q, k, v, o, l)?
        }
        (AttnInputs::Cuda16(format, [q, k, v]), BufMut::Cuda(o), BufMut::Cuda(l)) => {
            let docs = gpu_docs(q.gpu(), s, doc_start)?;
            gpu::attention_forward_tc(gpu::ATTN_KERNELS, s, docs.as_deref(), format, q, k, v, o, l)?
        }
        _ => return Err(mixed("attention")),
    }
    Ok((out, lse))
}

/// Merges a partial attention result into rows of a whole one
/// ([`crate::attention::merge_partial`]).
pub fn attention_merge(
    m: &crate::attention::MergeRows,
    out: BufMut<'_>,
    lse: BufMut<'_>,
    part: BufRef<'_>,
    part_lse: BufRef<'_>,
) -> Result<()> {
    match (out, lse, part, part_lse) {
        (BufMut::Host(o), BufMut::Host(l), BufRef::Host(p), BufRef::Host(pl)) => {
            crate::attention::merge_partial(m, o, l, p, pl)
        }
        (BufMut::Cuda(o), BufMut::Cuda(l), BufRef::Cuda(p), BufRef::Cuda(pl)) => {
            Ok(gpu::attention_merge(m, o, l, p, pl)?)
        }
        _ => Err(mixed("attention merge")),
    }
}

/// Attention backward, accumulated into `dq`, `dk`, `dv`
/// ([`crate::attention::attention_backward_docs`], the forward's `doc_start`); `q`, `k`, `v` as
/// the forward's.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<'a>(
    s: &AttnShape,
    doc_start: Option<&[usize]>,
    q: impl Into<Operand<'a>>,
    k: impl Into<Operand<'a>>,
    v: impl Into<Operand<'a>>,
    out: BufRef<'_>,
    lse: BufRef<'_>,
    dout: BufRef<'_>,
    dq: BufMut<'_>,
    dk: BufMut<'_>,
    dv: BufMut<'_>,
) -> Result<()> {
    use BufMut as M;
    use BufRef as R;
    let qkv = attn_prepare(s, [q.into(), k.into(), v.into()])?;
    match (attn_inputs(s, &qkv)?, (out, lse, dout), (dq, dk, dv)) {
        (
            AttnInputs::Host([q, k, v]),
            (R::Host(o), R::Host(l), R::Host(d)),
            (M::Host(a), M::Host(b), M::Host(c)),
        ) => crate::attention::attention_backward_docs(
            s,
            doc_start,
            q,
            k,
            v,
            o,
            l,
            d,
            a,
            b,
            c,
            AttnTiles::default(),
        ),
        (AttnInputs::Host(_), ..) => Err(mixed("attention backward")),
        (
            AttnInputs::Cuda([q, k, v]),
            (R::Cuda(o), R::Cuda(l), R::Cuda(d)),
            (M::Cuda(a), M::Cuda(b), M::Cuda(c)),
        ) => {
            let docs = gpu_docs(q.gpu(), s, doc_start)?;
            let docs = docs.as_deref();
            Ok(gpu::attention_backward(s, docs, q, k, v, o, l, d, a, b, c)?)
        }
        (
            AttnInputs::Cuda16(format, [q, k, v]),
            (R::Cuda(o), R::Cuda(l), R::Cuda(d)),
            (M::Cuda(a), M::Cuda(b), M::Cuda(c)),
        ) => {
            let docs = gpu_docs(q.gpu(), s, doc_start)?;
            let docs = docs.as_deref();
            Ok(gpu::attention_backward_tc(
                gpu::ATTN_KERNELS,
                s,
                docs,
                format,
                q,
                k,
                v,
                o,
                l,
                d,
                a,
                b,
                c,
            )?)
        }
        _ => Err(mixed("attention backward")),
    }
}

/// `table[ids[t] − vocab_start]` per token (zeros outside the shard) as a new buffer; `ids`
/// beyond the full table are an error when `vocab_start` is `None` (the whole table)
/// ([`crate::embedding::embedding_forward`], `_shard`).
pub fn embedding_forward(
    ids: &[u32],
    table: BufRef<'_>,
    dim: usize,
    vocab_start: Option<usize>,
) -> Result<Buf> {
    match table {
        BufRef::Host(t) => {
            let mut out = crate::threads::zeros(ids.len() * dim);
            match vocab_start {
                None => crate::embedding::embedding_forward(ids, t, dim, &mut out)?,
                Some(s) => crate::embedding::embedding_forward_shard(ids, t, dim, s, &mut out)?,
            }
            Ok(Buf::Host(out))
        }
        BufRef::Cuda(t) => {
            if vocab_start.is_none() {
                check_ids(ids, t.len() / dim.max(1))?;
            }
            let d_ids = t.gpu().upload(ids)?;
            Ok(Buf::Cuda(gpu::embedding_forward(
                &d_ids,
                t,
                dim,
                vocab_start.unwrap_or(0),
            )?))
        }
    }
}

fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(pos) => Err(TensorError::IdOutOfRange {
            id: ids[pos] as i64,
            pos,
            vocab,
        }),
        None => Ok(()),
    }
}

/// `dtable[ids[t] − vocab_start] += dout[t]` ([`crate::embedding::embedding_backward`],
/// `_shard`).
pub fn embedding_backward(
    ids: &[u32],
    dout: BufRef<'_>,
    dim: usize,
    vocab_start: Option<usize>,
    dtable: BufMut<'_>,
) -> Result<()> {
    match (dout, dtable) {
        (BufRef::Host(d), BufMut::Host(t)) => match vocab_start {
            None => crate::embedding::embedding_backward(ids, d, dim, t),
            Some(s) => crate::embedding::embedding_backward_shard(ids, d, dim, s, t),
        },
        (BufRef::Cuda(d), BufMut::Cuda(t)) => {
            if vocab_start.is_none() {
                check_ids(ids, t.len() / dim.max(1))?;
            }
            Ok(gpu::embedding_backward(
                ids,
                d,
                dim,
                vocab_start.unwrap_or(0),
                t,
            )?)
        }
        _ => Err(mixed("embedding backward")),
    }
}

/// Indices for the GPU (checked on the host first: a kernel would read or write anywhere).
fn device_indices(
    gpu: &std::sync::Arc<crate::cuda::Gpu>,
    idx: &[u32],
) -> Result<crate::cuda::DevBuf<i32>> {
    if idx.iter().any(|&i| i > i32::MAX as u32) {
        return Err(TensorError::Shape("row index beyond i32".into()));
    }
    let idx: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
    Ok(gpu.upload(&idx)?)
}

/// `scale[r]·src[idx[r]]` per row of `dim` as a new buffer ([`crate::rows::gather_rows`]).
pub fn gather_rows(src: BufRef<'_>, idx: &[u32], scale: Option<&[f32]>, dim: usize) -> Result<Buf> {
    match src {
        BufRef::Host(s) => Ok(Buf::Host(crate::rows::gather_rows(s, idx, scale, dim)?)),
        BufRef::Cuda(s) => {
            let rows = crate::rows::rows_of(s.len(), dim, "gathered rows")?;
            crate::rows::check_indices(idx, rows, false, "gather")?;
            if let Some(sc) = scale {
                crate::error::check_len("gather scales", sc.len(), idx.len())?;
            }
            let gpu = s.gpu().clone();
            let d_idx = device_indices(&gpu, idx)?;
            let d_scale = scale.map(|sc| gpu.upload(sc)).transpose()?;
            Ok(Buf::Cuda(gpu::gather_rows(
                s,
                &d_idx,
                d_scale.as_ref().map(|b| b.as_slice()),
                dim,
            )?))
        }
    }
}

/// `y[idx[r]] += w[r]·rows[r]` at distinct indices ([`crate::rows::scatter_add_rows`]).
pub fn scatter_add_rows(
    rows: BufRef<'_>,
    idx: &[u32],
    w: Option<&[f32]>,
    y: BufMut<'_>,
    dim: usize,
) -> Result<()> {
    match (rows, y) {
        (BufRef::Host(r), BufMut::Host(y)) => crate::rows::scatter_add_rows(r, idx, w, y, dim),
        (BufRef::Cuda(r), BufMut::Cuda(y)) => {
            let n = crate::rows::rows_of(r.len(), dim, "scattered rows")?;
            crate::error::check_len("scatter indices", idx.len(), n)?;
            if let Some(w) = w {
                crate::error::check_len("scatter weights", w.len(), n)?;
            }
            let target = crate::rows::rows_of(y.len(), dim, "scatter target")?;
            crate::rows::check_indices(idx, target, true, "scatter")?;
            let gpu = r.gpu().clone();
            let d_idx = device_indices(&gpu, idx)?;
            let d_w = w.map(|w| gpu.upload(w)).transpose()?;
            Ok(gpu::scatter_add_rows(
                r,
                &d_idx,
                d_w.as_ref().map(|b| b.as_slice()),
                y,
                dim,
            )?)
        }
        _ => Err(mixed("scatter rows")),
    }
}

/// `a[ia[r]] · b[r]` per row of `dim`, on the host ([`crate::rows::row_dots`]).
pub fn row_dots(a: BufRef<'_>, ia: &[u32], b: BufRef<'_>, dim: usize) -> Result<Vec<f32>> {
    match (a, b) {
        (BufRef::Host(a), BufRef::Host(b)) => crate::rows::row_dots(a, ia, b, dim),
        (BufRef::Cuda(a), BufRef::Cuda(b)) => {
            let rows = crate::rows::rows_of(a.len(), dim, "row_dots a")?;
            crate::rows::check_indices(ia, rows, false, "row_dots")?;
            crate::error::check_len("row_dots b", b.len(), ia.len() * dim)?;
            let gpu = a.gpu().clone();
            let d_ia = device_indices(&gpu, ia)?;
            Ok(gpu::row_dots(a, &d_ia, b, None, dim)?.to_host()?)
        }
        _ => Err(mixed("row dots")),
    }
}

/// `dst += src` element-wise ([`crate::threads::add_assign`]).
pub fn add_assign(dst: BufMut<'_>, src: BufRef<'_>) -> Result<()> {
    match (dst, src) {
        (BufMut::Host(d), BufRef::Host(s)) => {
            crate::error::check_len("add_assign", s.len(), d.len())?;
            crate::threads::add_assign(d, s);
            Ok(())
        }
        (BufMut::Cuda(d), BufRef::Cuda(s)) => Ok(gpu::axpy(d, s, 1.0)?),
        _ => Err(mixed("add")),
    }
}

/// `dst *= factor` ([`crate::threads::scale`]).
pub fn scale(dst: BufMut<'_>, factor: f32) -> Result<()> {
    match dst {
        BufMut::Host(d) => {
            crate::threads::scale(d, factor);
            Ok(())
        }
        BufMut::Cuda(d) => Ok(gpu::scale(d, factor)?),
    }
}

/// `Σ x²` in f64 (global-norm clipping).
pub fn sq_sum(x: BufRef<'_>) -> Result<f64> {
    match x {
        BufRef::Host(x) => Ok(crate::threads::sum_chunks(x.len(), 1 << 16, |r| {
            x[r].iter().map(|&v| v as f64 * v as f64).sum::<f64>()
        })),
        BufRef::Cuda(x) => Ok(gpu::sq_sum(x)?),
    }
}

/// `n` zeros on the device of `like`.
pub fn zeros_like(like: BufRef<'_>, n: usize) -> Result<Buf> {
    like.dev().zeros(n)
}

/// The log-sum-exps of a fused cross-entropy call: computed or given.
pub enum Lse<'a> {
    Write(BufMut<'a>),
    Read(BufRef<'a>),
}

/// The fused LM head + cross-entropy on either device: the loss with `lse` written
/// ([`crate::cross_entropy::fused_linear_ce_forward`]), the gradients with `lse` read
/// (`_backward`), or both in one pass (`_forward_backward`). `grad = Some((scale, dx, dw))`
/// asks for the gradients of `scale · loss_sum` (`dx` written, `dW` accumulated).
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_ce(
    x: BufRef<'_>,
    w: BufRef<'_>,
    targets: &[i64],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
    lse: Lse<'_>,
    grad: Option<(f32, Option<BufMut<'_>>, Option<BufMut<'_>>)>,
) -> Result<CeOutput> {
    use crate::cross_entropy as ce;
    match (x, w) {
        (BufRef::Host(x), BufRef::Host(w)) => {
            fn host(b: Option<BufMut<'_>>) -> Result<Option<&mut [f32]>> {
                b.map(|b| b.as_host("fused cross-entropy")).transpose()
            }
            match (lse, grad) {
                (Lse::Write(l), None) => {
                    ce::fused_linear_ce_forward(x, w, targets, dim, vocab, cfg, l.as_host("ce")?)
                }
                (Lse::Write(l), Some((s, dx, dw))) => ce::fused_linear_ce_forward_backward(
                    x,
                    w,
                    targets,
                    dim,
                    vocab,
                    cfg,
                    s,
                    l.as_host("ce")?,
                    host(dx)?,
                    host(dw)?,
                ),
                (Lse::Read(l), Some((s, dx, dw))) => {
                    let n_valid = ce::count_valid(targets, vocab, cfg.ignore_index)?;
                    ce::fused_linear_ce_backward(
                        x,
                        w,
                        targets,
                        l.as_host("ce")?,
                        dim,
                        vocab,
                        cfg,
                        s,
                        host(dx)?,
                        host(dw)?,
                    )?;
                    Ok(CeOutput {
                        loss_sum: 0.0,
                        n_valid,
                    })
                }
                (Lse::Read(_), None) => Err(TensorError::Shape(
                    "fused cross-entropy: nothing to compute".into(),
                )),
            }
        }
        (BufRef::Cuda(x), BufRef::Cuda(w)) => {
            let n_valid = ce::count_valid(targets, vocab, cfg.ignore_index)?;
            fn dev(b: Option<BufMut<'_>>) -> Result<Option<crate::cuda::DevSliceMut<'_, f32>>> {
                match b {
                    None => Ok(None),
                    Some(BufMut::Cuda(s)) => Ok(Some(s)),
                    Some(BufMut::Host(_)) => Err(mixed("fused cross-entropy")),
                }
            }
            let lse = match lse {
                Lse::Write(BufMut::Cuda(l)) => gpu::CeLse::Write(l),
                Lse::Read(BufRef::Cuda(l)) => gpu::CeLse::Read(l),
                _ => return Err(mixed("fused cross-entropy")),
            };
            let grad = match grad {
                None => None,
                Some((scale, dx, dw)) => Some(gpu::CeGrad {
                    scale,
                    dx: dev(dx)?,
                    dw: dev(dw)?,
                }),
            };
            let loss_sum = gpu::fused_linear_ce(
                x,
                w,
                targets,
                dim,
                vocab,
                cfg.chunk_rows.max(gpu::GPU_CE_CHUNK_FLOATS / vocab.max(1)),
                cfg.ignore_index,
                lse,
                grad,
            )?;
            Ok(CeOutput { loss_sum, n_valid })
        }
        _ => Err(mixed("fused cross-entropy")),
    }
}

/// Per-row `(max, Σ exp(z − max), target logit)` of a logits block `[rows, shard]` over
/// vocabulary ids `[vocab_start, vocab_start + shard)`, into host slices
/// ([`crate::cross_entropy::logits_row_stats`]; a GPU's `3·rows` values downloaded).
#[allow(clippy::too_many_arguments)]
pub fn logits_row_stats(
    logits: BufRef<'_>,
    shard: usize,
    vocab_start: usize,
    targets: &[i64],
    ignore_index: i64,
    max: &mut [f32],
    sumexp: &mut [f32],
    target_logit: &mut [f32],
) -> Result<()> {
    let rows = targets.len();
    for (what, n) in [
        ("logits", logits.len()),
        ("max", max.len() * shard),
        ("sumexp", sumexp.len() * shard),
        ("target logit", target_logit.len() * shard),
    ] {
        crate::error::check_len(what, n, rows * shard)?;
    }
    match logits {
        BufRef::Host(z) => crate::cross_entropy::logits_row_stats(
            z,
            shard,
            vocab_start,
            targets,
            ignore_index,
            max,
            sumexp,
            target_logit,
        ),
        BufRef::Cuda(z) => {
            let t = z.gpu().upload(targets)?;
            let [m, s, tl] = gpu::ce_row_stats(z, &t, shard, vocab_start, ignore_index)?;
            max.copy_from_slice(&m.to_host()?);
            sumexp.copy_from_slice(&s.to_host()?);
            target_logit.copy_from_slice(&tl.to_host()?);
        }
    }
    Ok(())
}

/// Turns a logits block over a vocabulary shard into its gradient in place, with the rows'
/// log-sum-exp `lse` given on the host (uploaded for a GPU)
/// ([`crate::cross_entropy::logits_grad_inplace`]).
pub fn logits_grad_inplace(
    logits: BufMut<'_>,
    shard: usize,
    vocab_start: usize,
    targets: &[i64],
    ignore_index: i64,
    lse: &[f32],
    grad_scale: f32,
) -> Result<()> {
    crate::error::check_len("logits", logits.len(), targets.len() * shard)?;
    crate::error::check_len("lse", lse.len(), targets.len())?;
    match logits {
        BufMut::Host(z) => crate::cross_entropy::logits_grad_inplace(
            z,
            shard,
            vocab_start,
            targets,
            ignore_index,
            lse,
            grad_scale,
        ),
        BufMut::Cuda(z) => {
            let gpu = z.gpu().clone();
            let (t, l) = (gpu.upload(targets)?, gpu.upload(lse)?);
            gpu::ce_grad_inplace(z, &t, &l, shard, vocab_start, ignore_index, grad_scale)?;
        }
    }
    Ok(())
}

/// The device of a set of views, or an error when they differ.
pub fn same_dev(views: &[BufRef<'_>]) -> Result<Dev> {
    let first = views.first().map_or(Dev::Cpu, |v| v.dev());
    for v in views {
        if v.dev().is_cuda() != first.is_cuda() {
            return Err(mixed("operation"));
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    /// On host buffers the dispatch is the CPU kernel: the fused cross-entropy's split and
    /// one-pass forms give the same bits through it, and mixed devices never reach a kernel.
    #[test]
    fn host_dispatch_is_the_cpu_kernel() {
        let (rows, dim, vocab) = (40, 8, 30);
        let (x, w) = (rand_vec(rows * dim, 1), rand_vec(vocab * dim, 2));
        let targets: Vec<i64> = (0..rows as i64).map(|r| r % vocab as i64).collect();
        let cfg = CeConfig {
            chunk_rows: 16,
            ..CeConfig::default()
        };
        let (mut l1, mut dx1, mut dw1) = (
            vec![0.0; rows],
            vec![0.0; rows * dim],
            vec![0.0; vocab * dim],
        );
        let o1 = fused_linear_ce(
            (&x).into(),
            (&w).into(),
            &targets,
            dim,
            vocab,
            &cfg,
            Lse::Write((&mut l1[..]).into()),
            Some((
                0.25,
                Some((&mut dx1[..]).into()),
                Some((&mut dw1[..]).into()),
            )),
        )
        .unwrap();
        let (mut l2, mut dx2, mut dw2) = (
            vec![0.0; rows],
            vec![0.0; rows * dim],
            vec![0.0; vocab * dim],
        );
        let o2 = fused_linear_ce(
            (&x).into(),
            (&w).into(),
            &targets,
            dim,
            vocab,
            &cfg,
            Lse::Write((&mut l2[..]).into()),
            None,
        )
        .unwrap();
        fused_linear_ce(
            (&x).into(),
            (&w).into(),
            &targets,
            dim,
            vocab,
            &cfg,
            Lse::Read((&l2).into()),
            Some((
                0.25,
                Some((&mut dx2[..]).into()),
                Some((&mut dw2[..]).into()),
            )),
        )
        .unwrap();
        assert_eq!((o1.loss_sum, o1.n_valid), (o2.loss_sum, o2.n_valid));
        assert_eq!((l1, dx1, dw1), (l2, dx2, dw2));
        let mut y = Buf::from(vec![1.0; 4]);
        add_assign(y.m(), (&vec![1.0f32; 4]).into()).unwrap();
        assert_eq!(y.to_vec().unwrap(), vec![2.0; 4]);
        assert!(
            add_assign(y.m(), (&vec![1.0f32; 3]).into()).is_err(),
            "lengths"
        );
    }
}
