//! Small dense products and row reductions on row-major tiles, used inside attention where
//! each rayon task multiplies tiles of a few dozen rows (too small for `gemm`'s packing to
//! pay off), and the row kernels of the other layers (exp and softmax pieces, SwiGLU, RMSNorm,
//! RoPE rows).
//!
//! One product kernel serves every tile product: `C[m×n] (+)= A·B` with `A` addressed by a
//! row stride and a column stride (so `A` or `Aᵀ` is read without copying) and `B` row-major.
//! Every entry point dispatches on [`crate::isa::active`]: register-blocked intrinsics for
//! AVX-512 ([`avx512`]) or AVX2 + FMA ([`avx2`]), else a portable loop nest. Kernels that are
//! plain loops the compiler vectorises well ([`dot`], [`rms_apply`], ...) are one portable body
//! compiled once per path ([`compiled_per_isa`]): the same operations in the same order on
//! every path, so the same bits.

#[cfg(target_arch = "x86_64")]
mod row_groups;
#[cfg(target_arch = "x86_64")]
use row_groups::softmax_row_drivers;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::isa::{self, Isa};
use std::mem::MaybeUninit;

/// Returns `avx512::$f(args)` or `avx2::$f(args)` (the same signature in both modules) on the
/// active vector path; on the portable path it falls through to the code after it.
macro_rules! vector_path {
    ($f:ident($($arg:expr),* $(,)?)) => {
        #[cfg(target_arch = "x86_64")]
        match isa::active() {
            // SAFETY: the active path is one this CPU supports (`isa::selected`); the
            // caller's comment states the bounds.
            Isa::Avx512 => return unsafe { avx512::$f($($arg),*) },
            Isa::Avx2 => return unsafe { avx2::$f($($arg),*) },
            Isa::Portable => {}
        }
    };
}

/// Defines `$vis fn $name(args) -> ret` running the `#[inline(always)]` portable function
/// `$body` compiled for the active path (the compiler vectorises it for that path's registers).
/// Rust never contracts or reorders floating-point operations, so every path gives the bits of
/// the portable one.
macro_rules! compiled_per_isa {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn on_avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn on_avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                match crate::isa::active() {
                    // SAFETY: the active path is one this CPU supports (`isa::selected`).
                    crate::isa::Isa::Avx512 => return unsafe { on_avx512($($arg),*) },
                    crate::isa::Isa::Avx2 => return unsafe { on_avx2($($arg),*) },
                    crate::isa::Isa::Portable => {}
                }
            }
            $body($($arg),*)
        }
    };
}

/// `C[m×n] (+)= A[m×k] · B[k×n]` where `A(i, p) = a[i·a_rs + p·a_cs]`, `B(p, j) =
/// b[p·ldb + j]`, `C(i, j) = c[i·ldc + j]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mm(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Bounds of every addressed element (the kernels use raw pointers).
    assert!(c.len() > (m - 1) * ldc + n - 1, "mm: C too short");
    if k > 0 {
        assert!(a.len() > (m - 1) * a_rs + (k - 1) * a_cs, "mm: A too short");
        assert!(b.len() > (k - 1) * ldb + n - 1, "mm: B too short");
    }
    // SAFETY: bounds asserted above; `c` is exclusively borrowed, so it aliases neither input.
    unsafe {
        mm_raw(
            c.as_mut_ptr(),
            ldc,
            a.as_ptr(),
            a_rs,
            a_cs,
            b.as_ptr(),
            ldb,
            m,
            k,
            n,
            accumulate,
        )
    }
}

/// Pointer form of [`mm`], for outputs that are strided slices of a buffer shared between
/// tasks (e.g. one head of a `[tokens, heads, dim]` gradient).
///
/// # Safety
/// Every addressed element must be in bounds, `c`'s elements must not be accessed by anyone
/// else during the call, and `c` must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn mm_raw(
    c: *mut f32,
    ldc: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY (both arms): the active path is supported; bounds as promised by the caller.
    match isa::active() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => return avx512::mm(c, ldc, a, a_rs, a_cs, b, ldb, m, k, n, accumulate),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => return avx2::mm(c, ldc, a, a_rs, a_cs, b, ldb, m, k, n, accumulate),
        _ => {}
    }
    for i in 0..m {
        let crow = c.add(i * ldc);
        if !accumulate {
            (0..n).for_each(|j| *crow.add(j) = 0.0);
        }
        for p in 0..k {
            let av = *a.add(i * a_rs + p * a_cs);
            let brow = b.add(p * ldb);
            for j in 0..n {
                *crow.add(j) += av * *brow.add(j);
            }
        }
    }
}

/// Maximum of a row (`−∞` for an empty row).
#[inline]
pub(crate) fn row_max(x: &[f32]) -> f32 {
    // SAFETY: the kernel reads exactly x.len() elements.
    vector_path!(row_max(x.as_ptr(), x.len()));
    x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `x ← exp(scale·x − m)` elementwise; returns the sum of the new values. Inputs at `−∞`
/// give 0 (`scale > 0`).
#[inline]
pub(crate) fn exp_sub_sum(x: &mut [f32], scale: f32, m: f32) -> f32 {
    // SAFETY: the kernel touches exactly x.len() elements.
    vector_path!(exp_sub_sum(x.as_mut_ptr(), x.len(), scale, m));
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (scale * *v - m).exp();
        s += *v;
    }
    s
}

/// Lanes of the independent partial sums in [`dot_portable`]: one AVX-512 vector (or
/// four SSE / two AVX vectors), so the compiler can vectorise a reduction that in sequential
/// order it must not reorder.
const LANES: usize = 16;

/// `Σ_i a_i·b_i·c_i` (`c` all ones when `None`) over `LANES` partial sums, added at the end.
#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
    let mut acc = [0.0f32; LANES];
    let n = a.len() / LANES * LANES;
    match c {
        Some(c) => {
            for ((a, b), c) in a[..n]
                .chunks_exact(LANES)
                .zip(b[..n].chunks_exact(LANES))
                .zip(c[..n].chunks_exact(LANES))
            {
                for l in 0..LANES {
                    acc[l] += a[l] * b[l] * c[l];
                }
            }
        }
        None => {
            for (a, b) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
                for l in 0..LANES {
                    acc[l] += a[l] * b[l];
                }
            }
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n..a.len() {
        s += a[i] * b[i] * c.map_or(1.0, |c| c[i]);
    }
    s
}

/// `Σ_i a_i·b_i` (times `c_i` when given): the row reductions of RMSNorm and of the
/// attention backward's `D = rowsum(dO ∘ O)`. Summed in `LANES` interleaved partial sums
/// (the same order on both paths), so it vectorises.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
    assert!(
        b.len() == a.len() && c.is_none_or(|c| c.len() == a.len()),
        "dot: lengths"
    );
    dot_vectorised(a, b, c)
}

compiled_per_isa! {
    fn dot_vectorised(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 = dot_portable;
}

/// `y = x·r·w` and `dx = r·(dy∘w − x·c)` rows of RMSNorm: `out_i = r·(a_i·w_i − x_i·c)` with
/// `a = x, c = 0` (forward) or `a = dy` (backward), plus `res_i` when a residual is given
/// (`res_i + v_i`: the same rounding as adding `v` to a copy of `res` afterwards). `out` is
/// only written.
#[inline(always)]
fn rms_apply_portable(
    a: &[f32],
    x: &[f32],
    w: &[f32],
    r: f32,
    c: f32,
    res: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    let n = out.len();
    let (a, x, w, res) = (&a[..n], &x[..n], &w[..n], res.map(|v| &v[..n]));
    for i in 0..n {
        let v = r * (a[i] * w[i] - x[i] * c);
        // The branch is loop-invariant; the compiler hoists it out of the loop.
        out[i].write(res.map_or(v, |res| res[i] + v));
    }
}

/// See [`rms_apply_portable`]; writes every element of `out`.
#[inline]
pub(crate) fn rms_apply(
    a: &[f32],
    x: &[f32],
    w: &[f32],
    r: f32,
    c: f32,
    res: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    let n = out.len();
    assert!(
        a.len() == n && x.len() == n && w.len() == n && res.is_none_or(|v| v.len() == n),
        "rms_apply: lengths"
    );
    rms_apply_vectorised(a, x, w, r, c, res, out)
}

compiled_per_isa! {
    fn rms_apply_vectorised(
        a: &[f32],
        x: &[f32],
        w: &[f32],
        r: f32,
        c: f32,
        res: Option<&[f32]>,
        out: &mut [MaybeUninit<f32>],
    ) = rms_apply_portable;
}

/// `Σ e^(x − m)` (the softmax denominator after the row max `m`); `x` is not written.
#[inline]
pub(crate) fn sum_exp_sub(x: &[f32], m: f32) -> f32 {
    // SAFETY: the kernel reads exactly x.len() elements.
    vector_path!(sum_exp_sub(x.as_ptr(), x.len(), m));
    x.iter().map(|&v| (v - m).exp()).sum()
}

/// `x ← e^(x − m) · a` elementwise (softmax probabilities from a log-sum-exp, scaled).
#[inline]
pub(crate) fn exp_sub_scale(x: &mut [f32], m: f32, a: f32) {
    // SAFETY: the kernel touches exactly x.len() elements.
    vector_path!(exp_sub_scale(x.as_mut_ptr(), x.len(), m, a));
    x.iter_mut().for_each(|v| *v = (*v - m).exp() * a);
}

/// The rotate-half RoPE of one head row `x = [x1 | x2]` by the angles whose cosines and
/// (signed) sines are `cos`, `sin`: `x1 ← x1·cos − x2·sin`, `x2 ← x2·cos + x1·sin`.
#[inline(always)]
fn rotate_half_portable(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at_mut(half);
    let (x2, sin) = (&mut x2[..half], &sin[..half]);
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

compiled_per_isa! {
    /// See [`rotate_half_portable`]; `x` holds `2·cos.len()` values, `sin` as many as `cos`.
    pub(crate) fn rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) = rotate_half_portable;
}

/// `acc_i += a_i·b_i·r` (the per-row term of RMSNorm's weight gradient).
#[inline(always)]
fn scaled_product_add_portable(acc: &mut [f32], a: &[f32], b: &[f32], r: f32) {
    let n = acc.len();
    let (a, b) = (&a[..n], &b[..n]);
    for i in 0..n {
        acc[i] += a[i] * b[i] * r;
    }
}

compiled_per_isa! {
    /// See [`scaled_product_add_portable`]; `a` and `b` hold at least `acc.len()` values.
    pub(crate) fn scaled_product_add(acc: &mut [f32], a: &[f32], b: &[f32], r: f32) =
        scaled_product_add_portable;
}

/// Arguments of the vector `exp_nonpos` kernels (attention tiles) below this give exactly 0.
#[cfg(target_arch = "x86_64")]
const EXP_NONPOS_MIN: f32 = -86.5;

/// `σ(x) = 1 / (1 + e^(−x))` (portable path; the AVX-512 path uses the same formula on the
/// vector `exp`).
#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out = silu(g) ∘ u` (or `silu(g)` when `u` is `None`), `silu(g) = g·σ(g)`.
pub(crate) fn silu_mul(g: &[f32], u: Option<&[f32]>, out: &mut [MaybeUninit<f32>]) {
    let n = g.len();
    assert!(
        out.len() == n && u.is_none_or(|u| u.len() == n),
        "silu_mul: lengths"
    );
    let up = u.map_or(std::ptr::null(), |u| u.as_ptr());
    // SAFETY: every slice holds n elements (checked above).
    vector_path!(silu_mul(g.as_ptr(), up, out.as_mut_ptr().cast(), n));
    match u {
        Some(u) => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                o.write(g * sigmoid(g) * u);
            }
        }
        None => out.iter_mut().zip(g).for_each(|(o, &g)| {
            o.write(g * sigmoid(g));
        }),
    }
}

/// Backward of [`silu_mul`] for upstream `d`: `dg = d ∘ u ∘ silu'(g)` and `du = d ∘ silu(g)`
/// (`u`, `du` both given or both `None`), with `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.
pub(crate) fn silu_mul_grad(
    d: &[f32],
    g: &[f32],
    u: Option<&[f32]>,
    dg: &mut [MaybeUninit<f32>],
    mut du: Option<&mut [MaybeUninit<f32>]>,
) {
    let n = g.len();
    assert!(
        d.len() == n
            && dg.len() == n
            && u.is_some() == du.is_some()
            && u.is_none_or(|u| u.len() == n)
            && du.as_ref().is_none_or(|du| du.len() == n),
        "silu_mul_grad: lengths"
    );
    let up = u.map_or(std::ptr::null(), |u| u.as_ptr());
    let dup = du
        .as_deref_mut()
        .map_or(std::ptr::null_mut(), |du| du.as_mut_ptr().cast());
    // SAFETY: every slice holds n elements (checked above).
    vector_path!(silu_mul_grad(
        d.as_ptr(),
        g.as_ptr(),
        up,
        dg.as_mut_ptr().cast(),
        dup,
        n
    ));
    match (u, du) {
        (Some(u), Some(du)) => {
            for i in 0..n {
                let s = sigmoid(g[i]);
                du[i].write(d[i] * g[i] * s);
                dg[i].write(d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s)));
            }
        }
        _ => {
            for i in 0..n {
                let s = sigmoid(g[i]);
                dg[i].write(d[i] * s * (1.0 + g[i] * (1.0 - s)));
            }
        }
    }
}

/// Softmax backward on a tile, in place: `dp ← scale · p ∘ (dp − delta_row)` for rows of
/// width `cols`.
#[inline]
pub(crate) fn softmax_grad_tile(dp: &mut [f32], p: &[f32], delta: &[f32], cols: usize, scale: f32) {
    softmax_grad_vectorised(dp, p, delta, cols, scale)
}

compiled_per_isa! {
    fn softmax_grad_vectorised(
        dp: &mut [f32],
        p: &[f32],
        delta: &[f32],
        cols: usize,
        scale: f32,
    ) = softmax_grad_tile_portable;
}

#[inline(always)]
fn softmax_grad_tile_portable(dp: &mut [f32], p: &[f32], delta: &[f32], cols: usize, scale: f32) {
    for ((dr, pr), &dl) in dp.chunks_mut(cols).zip(p.chunks(cols)).zip(delta) {
        for (x, &pv) in dr.iter_mut().zip(pr) {
            *x = scale * pv * (*x - dl);
        }
    }
}

/// Visible columns of row `r` of a score tile `bk` wide: `clamp(vis0 + r, 0, bk)`. A causal
/// mask by global position is linear in the row (query `i0 + r` sees keys `< q_start + i0 + r
/// + 1 − k_start`), so one offset `vis0` describes a whole tile; no mask is `vis0 >= bk`.
#[inline]
pub(crate) fn visible_cols(vis0: isize, r: usize, bk: usize) -> usize {
    vis0.saturating_add(r as isize).clamp(0, bk as isize) as usize
}

/// One step of the online softmax (FlashAttention) on a score tile `st [bq, bk]`, for rows
/// with running max `m` (in scaled units), running sum `l` and unnormalised output rows
/// `acc [bq, d]`. Row `r` sees its first `n = visible_cols(vis0, r, bk)` scores (the rest are
/// masked, whatever they hold): `m' = max(m, scale·max_{j<n} S)`, `st[..n] ← exp(scale·S −
/// m')`, `st[n..] ← 0`, `l' = l·e^(m−m') + Σ_j st`, `acc ← acc·e^(m−m')`. Rows with nothing
/// visible yet (`m' = −∞`) get `st = 0` and keep their state.
#[allow(clippy::too_many_arguments)]
pub(crate) fn online_softmax_tile(
    st: &mut [f32],
    bq: usize,
    bk: usize,
    vis0: isize,
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    d: usize,
) {
    assert!(st.len() >= bq * bk && m.len() >= bq && l.len() >= bq && acc.len() >= bq * d);
    // SAFETY: lengths asserted above.
    vector_path!(online_softmax_tile(
        st.as_mut_ptr(),
        bq,
        bk,
        vis0,
        scale,
        m.as_mut_ptr(),
        l.as_mut_ptr(),
        acc.as_mut_ptr(),
        d
    ));
    for r in 0..bq {
        let row = &mut st[r * bk..(r + 1) * bk];
        let (vis, masked) = row.split_at_mut(visible_cols(vis0, r, bk));
        masked.fill(0.0);
        let m_new = m[r].max(scale * row_max(vis));
        if m_new == f32::NEG_INFINITY {
            vis.fill(0.0);
            continue;
        }
        let alpha = (m[r] - m_new).exp();
        let sum = exp_sub_sum(vis, scale, m_new);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        if alpha != 1.0 {
            acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= alpha);
        }
    }
}

/// Probabilities from saved log-sum-exps: `p ← exp(scale·p − lse_row)` on a tile `[bq, bk]`
/// whose row `r` sees its first `visible_cols(vis0, r, bk)` columns (the rest become 0); rows
/// with `lse = −∞` (no visible key) become 0.
pub(crate) fn exp_tile(p: &mut [f32], bq: usize, bk: usize, vis0: isize, scale: f32, lse: &[f32]) {
    assert!(p.len() >= bq * bk && lse.len() >= bq);
    // SAFETY: lengths asserted above.
    vector_path!(exp_tile(p.as_mut_ptr(), bq, bk, vis0, scale, lse.as_ptr()));
    for (r, (row, &l)) in p[..bq * bk].chunks_mut(bk).zip(lse).enumerate() {
        let (vis, masked) = row.split_at_mut(visible_cols(vis0, r, bk));
        masked.fill(0.0);
        if l == f32::NEG_INFINITY {
            vis.fill(0.0);
        } else {
            exp_sub_sum(vis, scale, l);
        }
    }
}

/// Announces that rows `r0..r1` of a row-major matrix (`len` floats per row, `stride` apart,
/// from `m`, inside a buffer of `m_len` floats from `m`) will be used soon, so that their cache
/// misses overlap the work before the use instead of stalling it: read (`WRITE = false`,
/// `prefetcht0`), or written (`prefetchw`: the lines are requested for ownership, which a
/// store to a cold line would otherwise wait for). Rows past `m_len` are skipped. A hint only
/// (a no-op off x86-64): it reads and writes nothing, so results never depend on it; a raw
/// pointer, so buffers that other threads write can be named without a reference.
pub(crate) fn prefetch_rows<const WRITE: bool>(
    m: *const f32,
    m_len: usize,
    stride: usize,
    (r0, r1): (usize, usize),
    len: usize,
) {
    #[cfg(target_arch = "x86_64")]
    for r in r0..r1 {
        let start = r * stride;
        if start + len > m_len {
            break;
        }
        // One hint per 64-byte line (16 floats), plus the row's last element.
        for i in (0..len).step_by(16).chain([len.saturating_sub(1)]) {
            let at = m.wrapping_add(start + i).cast();
            // SAFETY: a prefetch never faults and has no architectural effect, whatever the
            // address (`wrapping_add`: no pointer arithmetic UB); SSE is part of x86-64 (CPUs
            // without PREFETCHW treat that hint as a no-op).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
                if WRITE {
                    _mm_prefetch::<_MM_HINT_ET0>(at);
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(at);
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (m, m_len, stride, r0, r1, len);
}

/// Transposed gather of `n` rows: `dst[c·n + j] = src[j·stride + c]` for `j < n`, `c < d`.
pub(crate) fn gather_t(src: &[f32], stride: usize, n: usize, d: usize, dst: &mut [f32]) {
    if n == 0 || d == 0 {
        return;
    }
    assert!(src.len() > (n - 1) * stride + d - 1 && dst.len() >= n * d);
    #[cfg(target_arch = "x86_64")]
    if isa::active() == Isa::Avx512 {
        // SAFETY: AVX-512F is the active path; every read index j·stride + c (j < n, c < d) and
        // written index c·n + j is in bounds (asserted); masked lanes touch nothing.
        unsafe { avx512::gather_t(src.as_ptr(), stride, n, d, dst.as_mut_ptr()) };
        return;
    }
    // Once per head and call (d·n moves against the tiles' d·n² multiply-adds): the
    // portable loop serves the other paths.
    // Blocks of 8 keys: reads stay within 8 rows, writes are 8 contiguous floats.
    for j0 in (0..n).step_by(8) {
        let jn = 8.min(n - j0);
        for c in 0..d {
            for (jj, o) in dst[c * n + j0..c * n + j0 + jn].iter_mut().enumerate() {
                *o = src[(j0 + jj) * stride + c];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::matmul_reference;
    use crate::tensor::max_abs_diff;
    use crate::testutil::rand_vec;

    /// Runs `f` on every path this machine supports.
    fn both_paths(f: impl Fn()) {
        for isa in Isa::supported_paths() {
            isa::with_isa(isa, &f);
        }
    }

    #[test]
    fn tile_products_match_reference() {
        both_paths(tile_products);
    }

    #[test]
    fn row_reductions() {
        both_paths(row_reductions_once);
    }

    #[test]
    fn softmax_grad_tile_matches_formula() {
        both_paths(softmax_grad_once);
    }

    /// Runs `f` on every vector path this machine supports and on the portable one, on this
    /// thread: `[(vector path, its result, the portable result)]`.
    fn on_both<T: Clone>(f: impl Fn() -> T) -> Vec<(Isa, T, T)> {
        let portable = isa::with_isa(Isa::Portable, &f);
        Isa::supported_paths()
            .into_iter()
            .filter(|&i| i != Isa::Portable)
            .map(|i| (i, isa::with_isa(i, &f), portable.clone()))
            .collect()
    }

    /// Write-only kernel outputs pre-set to NaN: reading them back is safe, and an element a
    /// kernel failed to write shows up as NaN.
    fn nan_out(n: usize) -> Vec<MaybeUninit<f32>> {
        vec![MaybeUninit::new(f32::NAN); n]
    }

    fn read_out(v: Vec<MaybeUninit<f32>>) -> Vec<f32> {
        // SAFETY: every element was initialised by `nan_out` (and maybe overwritten since).
        v.into_iter().map(|x| unsafe { x.assume_init() }).collect()
    }

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn vector_exp_within_two_ulps_of_std() {
        // Every input in [−87, 88] on a fine grid (plus the endpoints): the vector exp
        // (Cephes polynomial, Cody–Waite reduction) and the portable `f32::exp` agree within
        // 2 ulp, so the two paths of every exp-based kernel differ only at rounding level.
        let x: Vec<f32> = (0..=175_000)
            .map(|i| -87.0 + i as f32 * 1e-3)
            .chain([0.0, -0.0, 88.0])
            .collect();
        let paths = on_both(|| {
            let mut y = x.clone();
            exp_sub_sum(&mut y, 1.0, 0.0);
            y
        });
        for (isa, fast, portable) in paths {
            let worst = fast.iter().zip(&portable).map(|(&a, &b)| ulps(a, b)).max();
            assert!(worst.unwrap() <= 2, "{isa}: worst {worst:?} ulp");
        }
    }

    /// `e^x` through the vector kernel of path `isa` for arguments `<= 0` (`None` where this
    /// machine lacks it).
    #[cfg(target_arch = "x86_64")]
    fn exp_nonpos_fast(isa: Isa, x: &[f32]) -> Option<Vec<f32>> {
        let mut y = x.to_vec();
        // SAFETY: the path is supported (checked); the kernels touch exactly y.len() elements.
        match isa {
            Isa::Avx512 if isa.supported() => unsafe { avx512::exp_nonpos(&mut y) },
            Isa::Avx2 if isa.supported() => unsafe { avx2::exp_nonpos(&mut y) },
            _ => return None,
        }
        Some(y)
    }

    /// Largest ulp distance (and where) of `exp_nonpos_fast` from the correctly rounded `e^x`
    /// over the f32 bit patterns from `hi` down to `lo` (both `<= 0`), every `step`-th one.
    #[cfg(target_arch = "x86_64")]
    fn exp_nonpos_worst_ulps(isa: Isa, lo: f32, hi: f32, step: usize) -> Option<(u32, f32)> {
        let x: Vec<f32> = (hi.to_bits()..=lo.to_bits())
            .step_by(step)
            .map(f32::from_bits)
            .collect();
        let y = exp_nonpos_fast(isa, &x)?;
        x.iter()
            .zip(&y)
            .map(|(&x, &y)| (ulps(y, (x as f64).exp() as f32), x))
            .max_by_key(|&(u, _)| u)
    }

    /// Ulp bounds of the cheap exp, on [−16, −0] and on [−86.5, −16]. The single-constant
    /// reduction `r = x − n·ln2_f32` adds `|n|·1.9e-9` relative error, which passes 1 ulp only
    /// below −16, where `e^x < 1.2e-7` is already below the rounding of the row maximum's
    /// `e^0 = 1` in a softmax sum (absolute error there < 1e-13). Exhaustive run: 1 and 4 ulp
    /// (2 ulp from −16 to −20).
    #[cfg(target_arch = "x86_64")]
    const EXP_NONPOS_ULPS: [(f32, f32, u32); 2] = [(-16.0, -0.0, 1), (EXP_NONPOS_MIN, -16.0, 4)];

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn exp_for_nonpositive_arguments_within_bounds() {
        // Every 61st f32 (8 M arguments: all exponents, scattered mantissas), on each vector
        // path.
        for isa in [Isa::Avx512, Isa::Avx2] {
            for (lo, hi, bound) in EXP_NONPOS_ULPS {
                if let Some((worst, at)) = exp_nonpos_worst_ulps(isa, lo, hi, 61) {
                    assert!(worst <= bound, "{isa}: {worst} ulp at {at}");
                }
            }
        }
        // Edges: exactly 0 below the cut-off and at −∞, normal at it, 1 at ±0, NaN kept, a
        // rounding excess above 0 still accurate.
        let x = [
            f32::NEG_INFINITY,
            -1e30,
            -86.51,
            EXP_NONPOS_MIN,
            0.0,
            -0.0,
            f32::NAN,
            1e-6,
        ];
        let on = |isa| exp_nonpos_fast(isa, &x);
        for y in [on(Isa::Avx512), on(Isa::Avx2)].into_iter().flatten() {
            assert_eq!(&y[..3], &[0.0; 3]);
            assert!(y[3].is_normal() && ulps(y[3], (-86.5f64).exp() as f32) <= 4);
            assert_eq!(&y[4..6], &[1.0, 1.0]);
            assert!(y[6].is_nan());
            assert!(ulps(y[7], 1e-6f64.exp() as f32) <= 1);
        }
        // The two vector paths build 2^n differently (scalef, exponent bits): same bits.
        let grid: Vec<f32> = (0..=90_000).map(|i| -i as f32 * 1e-3).collect();
        if let (Some(a), Some(b)) = (
            exp_nonpos_fast(Isa::Avx512, &grid),
            exp_nonpos_fast(Isa::Avx2, &grid),
        ) {
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    #[ignore = "exhaustive, ~20 s: cargo test --release -p tensor -- --ignored"]
    #[cfg(target_arch = "x86_64")]
    fn exp_for_nonpositive_arguments_exhaustive() {
        for isa in [Isa::Avx512, Isa::Avx2] {
            for (lo, hi, bound) in EXP_NONPOS_ULPS {
                if let Some((worst, at)) = exp_nonpos_worst_ulps(isa, lo, hi, 1) {
                    assert!(worst <= bound, "{isa}: {worst} ulp at {at}");
                }
            }
        }
    }

    #[test]
    fn dot_paths_agree_and_match_f64() {
        for n in [0usize, 1, 15, 16, 33, 512] {
            let (a, b, c) = (rand_vec(n, 1), rand_vec(n, 2), rand_vec(n, 3));
            for with_c in [false, true] {
                let cc = with_c.then_some(&c[..]);
                let want: f64 = (0..n)
                    .map(|i| a[i] as f64 * b[i] as f64 * if with_c { c[i] as f64 } else { 1.0 })
                    .sum();
                let portable = isa::with_isa(Isa::Portable, || dot(&a, &b, cc));
                assert!((portable as f64 - want).abs() <= 1e-6 * (n as f64 + 1.0));
                for (isa, fast, portable) in on_both(|| dot(&a, &b, cc)) {
                    // Same summation order on every path (the vector lanes are the partial
                    // sums).
                    assert_eq!(fast.to_bits(), portable.to_bits(), "{isa}");
                }
            }
        }
    }

    #[test]
    fn softmax_row_pieces_paths_agree() {
        for n in [1usize, 16, 37, 4096] {
            let x: Vec<f32> = rand_vec(n, 7).iter().map(|v| v * 30.0).collect();
            let m = row_max(&x);
            let paths = on_both(|| {
                let s = sum_exp_sub(&x, m);
                let mut y = x.clone();
                exp_sub_scale(&mut y, m + s.ln(), 0.25);
                (s, y)
            });
            for (isa, fast, portable) in paths {
                // Each exp within 2 ulp; the sum's rounding order differs (vector lanes).
                let tol = 1e-6 * portable.0 * (n as f32).sqrt();
                assert!((fast.0 - portable.0).abs() <= tol, "{isa}");
                for (a, b) in fast.1.iter().zip(&portable.1) {
                    assert!((a - b).abs() <= 1e-6 * b + 1e-37, "{isa}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn silu_mul_paths_agree() {
        // Lengths cover full vectors and a masked tail; inputs span the clamp ranges.
        let n = 16 * 7 + 5;
        let g: Vec<f32> = rand_vec(n, 4)
            .iter()
            .map(|v| v * 12.0)
            .chain([-100.0, -87.5, 87.5, 100.0, 0.0])
            .collect();
        let n = g.len();
        let u = rand_vec(n, 5);
        let d = rand_vec(n, 6);
        for with_up in [true, false] {
            let up = with_up.then_some(&u[..]);
            let paths = on_both(|| {
                let mut y = nan_out(n);
                silu_mul(&g, up, &mut y);
                let (mut dg, mut du) = (nan_out(n), nan_out(n));
                silu_mul_grad(&d, &g, up, &mut dg, with_up.then_some(&mut du[..]));
                let du = if with_up { read_out(du) } else { vec![0.0; n] };
                (read_out(y), read_out(dg), du)
            });
            // σ is within a few ulp on every path (exp within 2 ulp, one add and one
            // divide); products of a few such factors stay within 1e-6 relative.
            for (isa, fast, portable) in paths {
                for (a, b) in [
                    (&fast.0, &portable.0),
                    (&fast.1, &portable.1),
                    (&fast.2, &portable.2),
                ] {
                    for (x, y) in a.iter().zip(b) {
                        assert!(!x.is_nan(), "{isa}: an output element was not written");
                        assert!((x - y).abs() <= 1e-6 * y.abs() + 1e-30, "{isa}: {x} vs {y}");
                    }
                }
            }
        }
    }

    fn tile_products() {
        // Widths cover full and partial 16-lane vectors and every column-block width (1-4
        // vectors), heights cover full register blocks and remainders.
        for &(m, k, n) in &[
            (1, 1, 1),
            (5, 7, 3),
            (16, 32, 64),
            (13, 29, 17),
            (9, 3, 50),
            (11, 8, 100),
            (8, 5, 33),
        ] {
            let a = rand_vec(m * k, 1);
            let b = rand_vec(k * n, 2);
            let mut c = rand_vec(m * n, 3);
            let mut r = c.clone();
            mm(&mut c, n, &a, k, 1, &b, n, m, k, n, true);
            matmul_reference(&mut r, &a, &b, m, k, n, false, false, true);
            assert!(max_abs_diff(&c, &r) < 1e-5, "{m} {k} {n}");
            mm(&mut c, n, &a, k, 1, &b, n, m, k, n, false);
            matmul_reference(&mut r, &a, &b, m, k, n, false, false, false);
            assert!(max_abs_diff(&c, &r) < 1e-5);
            let at = rand_vec(k * m, 4);
            mm(&mut c, n, &at, 1, m, &b, n, m, k, n, true);
            matmul_reference(&mut r, &at, &b, m, k, n, true, false, true);
            assert!(max_abs_diff(&c, &r) < 1e-5);
        }
    }

    #[test]
    fn gather_transposed() {
        both_paths(|| {
            for &(n, d, stride) in &[
                (1usize, 1usize, 1usize),
                (17, 8, 24),
                (40, 32, 32),
                (5, 3, 7),
                (16, 16, 16),
                (33, 20, 21),
                (50, 48, 64),
            ] {
                let src = rand_vec((n - 1) * stride + d, 5);
                let mut dst = vec![0.0; n * d];
                gather_t(&src, stride, n, d, &mut dst);
                for j in 0..n {
                    for c in 0..d {
                        assert_eq!(dst[c * n + j], src[j * stride + c]);
                    }
                }
            }
        });
    }

    #[test]
    fn masked_softmax_tiles_match_f64() {
        both_paths(masked_softmax_tiles_once);
    }

    /// Relative error bound of an f32 `e^(x − m)` computed from `x = scale·s` and `m`: the exp
    /// itself (<= 4 ulp, 2^−23 each at worst) plus the f32 roundings of `scale·s` and of the
    /// difference (half an ulp each, which the exponential turns into relative errors).
    fn exp_tolerance(x: f64, m: f64) -> f64 {
        f32::EPSILON as f64 * (4.0 + 0.5 * x.abs() + 0.5 * (x - m).abs())
    }

    /// `online_softmax_tile` over two key tiles and `exp_tile` from the resulting log-sum-exp,
    /// for masks that hide whole rows, part of a vector, whole vectors, or nothing, against the
    /// f64 formulas; masked entries must be exactly 0. Rows start from the state of one earlier
    /// key with scaled score `M0` (`m = M0`, `l = 1`, `acc = 1`).
    fn masked_softmax_tiles_once() {
        const M0: f64 = 0.5;
        let (bq, bk, d, scale) = (6, 37, 3, 0.35f32);
        for vis0 in [-3isize, 0, 2, 20, 35, isize::MAX] {
            let s1: Vec<f32> = rand_vec(bq * bk, 11).iter().map(|v| v * 20.0).collect();
            let s2: Vec<f32> = rand_vec(bq * bk, 12).iter().map(|v| v * 20.0).collect();
            let (mut m, mut l) = (vec![M0 as f32; bq], vec![1.0f32; bq]);
            let mut acc = vec![1.0f32; bq * d];
            let (mut p1, mut p2) = (s1.clone(), s2.clone());
            // Tile 1 sees vis0 + r columns, tile 2 (the next keys) bk fewer.
            online_softmax_tile(&mut p1, bq, bk, vis0, scale, &mut m, &mut l, &mut acc, d);
            let m1 = m.clone();
            let vis2 = vis0.saturating_sub(bk as isize);
            online_softmax_tile(&mut p2, bq, bk, vis2, scale, &mut m, &mut l, &mut acc, d);
            let mut lse = vec![0.0f32; bq];
            for r in 0..bq {
                let (n1, n2) = (visible_cols(vis0, r, bk), visible_cols(vis2, r, bk));
                let scaled = |v: &f32| scale as f64 * *v as f64;
                let seen: Vec<f64> = s1[r * bk..][..n1]
                    .iter()
                    .chain(&s2[r * bk..][..n2])
                    .map(scaled)
                    .chain([M0])
                    .collect();
                let mx = seen.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = seen.iter().map(|v| (v - mx).exp()).sum();
                assert!((m[r] as f64 - mx).abs() <= 1e-6 * mx.abs());
                assert!((l[r] as f64 - sum).abs() <= 1e-6 * sum, "{} vs {sum}", l[r]);
                let want_acc = (M0 - mx).exp();
                assert!((acc[r * d] as f64 - want_acc).abs() <= 1e-6 * want_acc);
                let tiles = [(&p1, &s1, n1, m1[r]), (&p2, &s2, n2, m[r])];
                for (p, sc, n, m_t) in tiles {
                    for c in 0..bk {
                        let got = p[r * bk + c];
                        if c >= n {
                            assert_eq!(got, 0.0);
                        } else {
                            // Against the f32 running max the kernel used (its rounding is
                            // common to the whole row, so it cancels in the softmax).
                            let x = scaled(&sc[r * bk + c]);
                            let want = (x - m_t as f64).exp();
                            let tol = exp_tolerance(x, m_t as f64);
                            assert!((got as f64 - want).abs() <= tol * want, "{got} vs {want}");
                        }
                    }
                }
                lse[r] = (mx + sum.ln()) as f32;
            }
            lse[1] = f32::NEG_INFINITY; // as for a query that sees no key
                                        // Probabilities of tile 1 from the log-sum-exps; rows with lse = −∞ give 0.
            let mut p = s1.clone();
            exp_tile(&mut p, bq, bk, vis0, scale, &lse);
            for r in 0..bq {
                let n = visible_cols(vis0, r, bk);
                for c in 0..bk {
                    let got = p[r * bk + c];
                    if c >= n || lse[r] == f32::NEG_INFINITY {
                        assert_eq!(got, 0.0);
                    } else {
                        let x = scale as f64 * s1[r * bk + c] as f64;
                        let want = (x - lse[r] as f64).exp();
                        let tol = exp_tolerance(x, lse[r] as f64);
                        assert!((got as f64 - want).abs() <= tol * want, "{got} vs {want}");
                    }
                }
            }
        }
    }

    fn softmax_grad_once() {
        let (rows, cols) = (3, 37);
        let p = rand_vec(rows * cols, 1);
        let dp0 = rand_vec(rows * cols, 2);
        let delta = [0.1f32, -0.3, 0.7];
        let mut dp = dp0.clone();
        softmax_grad_tile(&mut dp, &p, &delta, cols, 0.5);
        for i in 0..rows * cols {
            let want = 0.5 * p[i] * (dp0[i] - delta[i / cols]);
            assert!((dp[i] - want).abs() < 1e-6);
        }
        // Scaled exp.
        let mut x = vec![2.0f32; 20];
        let s = exp_sub_sum(&mut x, 0.5, 1.0);
        assert!((x[19] - 1.0).abs() < 1e-6 && (s - 20.0).abs() < 1e-4);
    }

    fn row_reductions_once() {
        for n in [0usize, 1, 15, 16, 17, 64, 100] {
            let x: Vec<f32> = rand_vec(n, 9).iter().map(|v| v * 40.0).collect();
            let want = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(row_max(&x), want);
            let mut y = x.clone();
            if n > 2 {
                y[1] = f32::NEG_INFINITY;
            }
            // Reference from the same f32 difference, so only the exp approximation is tested.
            let expect: Vec<f64> = y.iter().map(|&v| ((v - 3.0) as f64).exp()).collect();
            let s = exp_sub_sum(&mut y, 1.0, 3.0);
            for (got, e) in y.iter().zip(&expect) {
                // The polynomial exp is accurate to a few ulp (relative 1e-6); results below
                // 1.7e-38 (inputs < −87) are flushed to 0 on the AVX-512 path.
                assert!((*got as f64 - e).abs() <= 1e-6 * e + 2e-38, "{got} vs {e}");
            }
            if n > 2 {
                assert_eq!(y[1], 0.0);
            }
            let es: f64 = expect.iter().sum();
            assert!((s as f64 - es).abs() <= 1e-5 * es + 1e-30);
        }
    }
}
