//! AVX-512 versions of the tile kernels: register-blocked `MR × (16·NV)` products with
//! broadcast-FMA inner loops, and a vectorised `exp` (Cephes polynomial + `vscalefps`).
//!
//! Every function requires AVX-512F (callers check) and trusts the caller for bounds; the
//! last vector of a row block is handled with masked loads/stores, which never touch memory
//! outside the mask.

use std::arch::x86_64::*;

/// See [`super::mm`]; pointers/strides as there.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn mm(
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
    acc: bool,
) {
    let mut j = 0;
    while j < n {
        let w = (n - j).min(64);
        let nv = w.div_ceil(16);
        let rem = w - (nv - 1) * 16; // lanes used in the last vector, 1..=16
        let mask: __mmask16 = if rem == 16 { 0xFFFF } else { (1u16 << rem) - 1 };
        let (cj, bj) = (c.add(j), b.add(j));
        // Register budget: MR·NV accumulators + NV B-vectors + 1 broadcast <= 32 zmm.
        match nv {
            4 => rows::<4, 4>(cj, ldc, a, a_rs, a_cs, bj, ldb, m, k, mask, acc),
            3 => rows::<6, 3>(cj, ldc, a, a_rs, a_cs, bj, ldb, m, k, mask, acc),
            2 => rows::<8, 2>(cj, ldc, a, a_rs, a_cs, bj, ldb, m, k, mask, acc),
            _ => rows::<8, 1>(cj, ldc, a, a_rs, a_cs, bj, ldb, m, k, mask, acc),
        }
        j += w;
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows<const MR: usize, const NV: usize>(
    c: *mut f32,
    ldc: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    m: usize,
    k: usize,
    mask: __mmask16,
    acc: bool,
) {
    let mut i = 0;
    while i + MR <= m {
        block::<MR, NV>(
            c.add(i * ldc),
            ldc,
            a.add(i * a_rs),
            a_rs,
            a_cs,
            b,
            ldb,
            k,
            mask,
            acc,
        );
        i += MR;
    }
    while i < m {
        block::<1, NV>(
            c.add(i * ldc),
            ldc,
            a.add(i * a_rs),
            a_rs,
            a_cs,
            b,
            ldb,
            k,
            mask,
            acc,
        );
        i += 1;
    }
}

/// `C[MR × 16·NV] (+)= A[MR × k] · B[k × 16·NV]` with all accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const MR: usize, const NV: usize>(
    c: *mut f32,
    ldc: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    k: usize,
    mask: __mmask16,
    acc: bool,
) {
    let mut s = [[_mm512_setzero_ps(); NV]; MR];
    for p in 0..k {
        let bp = b.add(p * ldb);
        let mut bv = [_mm512_setzero_ps(); NV];
        for (v, bvv) in bv.iter_mut().enumerate() {
            *bvv = if v + 1 == NV {
                _mm512_maskz_loadu_ps(mask, bp.add(16 * v))
            } else {
                _mm512_loadu_ps(bp.add(16 * v))
            };
        }
        let ap = a.add(p * a_cs);
        for (r, sr) in s.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*ap.add(r * a_rs));
            for (sv, bvv) in sr.iter_mut().zip(&bv) {
                *sv = _mm512_fmadd_ps(av, *bvv, *sv);
            }
        }
    }
    for (r, sr) in s.iter().enumerate() {
        for (v, &sv) in sr.iter().enumerate() {
            let mk = if v + 1 == NV { mask } else { 0xFFFF };
            let ptr = c.add(r * ldc + 16 * v);
            let x = if acc {
                _mm512_add_ps(sv, _mm512_maskz_loadu_ps(mk, ptr))
            } else {
                sv
            };
            _mm512_mask_storeu_ps(ptr, mk, x);
        }
    }
}

/// Mask selecting the first `n` (< 16) lanes.
#[inline]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn row_max(x: *const f32, n: usize) -> f32 {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 16 <= n {
        m = _mm512_max_ps(m, _mm512_loadu_ps(x.add(i)));
        i += 16;
    }
    if i < n {
        let v = _mm512_mask_loadu_ps(
            _mm512_set1_ps(f32::NEG_INFINITY),
            tail_mask(n - i),
            x.add(i),
        );
        m = _mm512_max_ps(m, v);
    }
    _mm512_reduce_max_ps(m)
}

/// `e^x` for 16 lanes: `x = n·ln2 + r`, `|r| <= ln2/2`, `e^r` by the Cephes `expf` polynomial
/// (relative error ~1e-7), then `vscalefps` multiplies by `2^n`. Inputs are clamped to
/// [−87, 88.37] so the result is always a normal number: subnormal or underflowing results
/// would take slow microcode assists. Lanes below −87 (`e^x < 1.7e-38`, including `−∞`) are
/// then set to exactly 0 — negligible next to the softmax sums (>= 1) they enter.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_ps(x: __m512) -> __m512 {
    let xc = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
        _mm512_set1_ps(88.37),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    // r = x − n·ln2 with ln2 split in two parts for accuracy (Cody–Waite).
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_2e-3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166_666_65));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
    // e^r ≈ 1 + r + r²·p
    let r2 = _mm512_mul_ps(r, r);
    let er = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let e = _mm512_scalef_ps(er, n);
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
    _mm512_maskz_mov_ps(!tiny, e)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn exp_sub_sum(x: *mut f32, n: usize, scale: f32, m: f32) -> f32 {
    let mv = _mm512_set1_ps(m);
    let sv = _mm512_set1_ps(scale);
    let mut s = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let e = exp_ps(_mm512_fmsub_ps(sv, _mm512_loadu_ps(x.add(i)), mv));
        _mm512_storeu_ps(x.add(i), e);
        s = _mm512_add_ps(s, e);
        i += 16;
    }
    if i < n {
        let k = tail_mask(n - i);
        let e = exp_ps(_mm512_fmsub_ps(sv, _mm512_maskz_loadu_ps(k, x.add(i)), mv));
        let e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(x.add(i), k, e);
        s = _mm512_add_ps(s, e);
    }
    _mm512_reduce_add_ps(s)
}

/// `Σ e^(x − m)` without writing `x`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sum_exp_sub(x: *const f32, n: usize, m: f32) -> f32 {
    let mv = _mm512_set1_ps(m);
    let mut s = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x.add(i)), mv));
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(k, e));
        i += 16;
    }
    _mm512_reduce_add_ps(s)
}

/// `x ← e^(x − m) · a`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_sub_scale(x: *mut f32, n: usize, m: f32, a: f32) {
    let (mv, av) = (_mm512_set1_ps(m), _mm512_set1_ps(a));
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x.add(i)), mv));
        _mm512_mask_storeu_ps(x.add(i), k, _mm512_mul_ps(e, av));
        i += 16;
    }
}

/// `e^x` for 16 lanes whose arguments are `x <= 0` (softmax probabilities `e^(s − max)`), or
/// slightly above 0 by rounding, or `−∞`: the cheaper sibling of [`exp_ps`] used by the
/// attention tiles (11 vector µops against ≈ 19).
///
/// `n = round(x·log2 e)` by the add-magic-number trick (one FMA with `1.5·2²³`: the sum's ulp
/// is 1, so the FMA itself rounds `x·log2 e` to an integer; `vrndscaleps` is 2 µops), then
/// `r = x − n·ln2` with one FMA (`n·ln2_f32` is exact inside the FMA; `ln2 − ln2_f32 ≈ 1.9e-9`
/// adds `|n|·1.9e-9` relative error), then `e^r`, `|r| <= ln2/2`, by a degree-6 minimax
/// polynomial (relative error 1.9e-9, 0.03 ulp), and `vscalefps` multiplies by `2^n`.
/// No clamps: for `x >= −86.5`, `n >= −125` and the result is a normal number
/// (`>= 2^−125.5`); lanes below (and `−∞`, whose `n` and `r` are NaN) are set to exactly 0 by
/// the scalef's zero mask — below `e^−86.5 = 2.7e-38`, far under the rounding of the softmax
/// sums they would enter. Arguments above 88.7 overflow to `+∞` (not in the domain); NaN stays
/// NaN. Against the correctly rounded `e^x`, over every f32: within 1 ulp on [−16, 0], within
/// 4 ulp on [−86.5, −16] (where `e^x < 1.2e-7`; the absolute error stays below 1e-13).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_nonpos_ps(x: __m512) -> __m512 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³
    let magic = _mm512_set1_ps(MAGIC);
    let j = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), magic);
    let n = _mm512_sub_ps(j, magic);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(std::f32::consts::LN_2), x);
    // Horner from the top: e^r ≈ 1 + r + c2·r² + … + c6·r⁶ (minimax on [−ln2/2, ln2/2]).
    let mut p = _mm512_set1_ps(1.383_684_6e-3);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.374_816e-3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_822_5e-2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166_664_2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.499_999_9));
    let one = _mm512_set1_ps(1.0);
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(super::EXP_NONPOS_MIN));
    _mm512_maskz_scalef_ps(keep, p, n)
}

/// `e^x` of one scalar through [`exp_nonpos_ps`] (`x <= 0` or `−∞`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_nonpos_scalar(x: f32) -> f32 {
    _mm512_cvtss_f32(exp_nonpos_ps(_mm512_set1_ps(x)))
}

/// Rows handled together by the softmax tile kernels: their reductions are independent
/// dependency chains that the core overlaps (one row at a time, the serial max → exp → sum
/// chain of each row left the vector units idle).
const GROUP: usize = 4;

/// Maxima of `R` rows, `x_r[..n_r]` (`−∞` for an empty row), interleaved.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_max<const R: usize>(x: [*const f32; R], n: [usize; R]) -> [f32; R] {
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut acc = [ninf; R];
    let common = n.iter().min().map_or(0, |&m| m / 16 * 16);
    let mut i = 0;
    while i < common {
        for r in 0..R {
            acc[r] = _mm512_max_ps(acc[r], _mm512_loadu_ps(x[r].add(i)));
        }
        i += 16;
    }
    for r in 0..R {
        let mut j = common;
        while j < n[r] {
            let v = _mm512_mask_loadu_ps(ninf, lanes(j, n[r]), x[r].add(j));
            acc[r] = _mm512_max_ps(acc[r], v);
            j += 16;
        }
    }
    acc.map(|a| _mm512_reduce_max_ps(a))
}

/// For `R` rows interleaved: `x_r[..n_r] ← e^(scale·x − m_r)` with [`exp_nonpos_ps`] (so
/// `scale·x <= m_r` up to rounding), `x_r[n_r..len] ← 0` (masked keys); returns the sums of
/// the rows when `SUM` (zeros otherwise).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_exp<const R: usize, const SUM: bool>(
    x: [*mut f32; R],
    n: [usize; R],
    len: usize,
    scale: f32,
    m: [f32; R],
) -> [f32; R] {
    let sv = _mm512_set1_ps(scale);
    let mv = m.map(|m| _mm512_set1_ps(m));
    let mut sum = [_mm512_setzero_ps(); R];
    let common = n.iter().min().map_or(0, |&m| m / 16 * 16);
    let mut i = 0;
    while i < common {
        for r in 0..R {
            let e = exp_nonpos_ps(_mm512_fmsub_ps(sv, _mm512_loadu_ps(x[r].add(i)), mv[r]));
            _mm512_storeu_ps(x[r].add(i), e);
            if SUM {
                sum[r] = _mm512_add_ps(sum[r], e);
            }
        }
        i += 16;
    }
    for r in 0..R {
        let mut j = common;
        while j < len {
            let k = if n[r] > j { lanes(j, n[r]) } else { 0 };
            let e = if k == 0 {
                _mm512_setzero_ps()
            } else {
                // The vector holding the row's last visible key: masked lanes become 0.
                let v = _mm512_maskz_loadu_ps(k, x[r].add(j));
                _mm512_maskz_mov_ps(k, exp_nonpos_ps(_mm512_fmsub_ps(sv, v, mv[r])))
            };
            _mm512_mask_storeu_ps(x[r].add(j), lanes(j, len), e);
            if SUM {
                sum[r] = _mm512_add_ps(sum[r], e);
            }
            j += 16;
        }
    }
    sum.map(|s| if SUM { _mm512_reduce_add_ps(s) } else { 0.0 })
}

/// `x[..n] *= a`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scale_row(x: *mut f32, n: usize, a: f32) {
    let av = _mm512_set1_ps(a);
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(x.add(i), _mm512_mul_ps(av, _mm512_loadu_ps(x.add(i))));
        i += 16;
    }
    if i < n {
        let k = tail_mask(n - i);
        _mm512_mask_storeu_ps(
            x.add(i),
            k,
            _mm512_mul_ps(av, _mm512_maskz_loadu_ps(k, x.add(i))),
        );
    }
}

super::softmax_row_drivers!("avx512f");

/// `e^x` on every lane of `x[..n]` through [`exp_nonpos_ps`] (for the accuracy tests).
#[cfg(test)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_nonpos(x: &mut [f32]) {
    for c in x.chunks_mut(16) {
        let k = lanes(0, c.len());
        let e = exp_nonpos_ps(_mm512_maskz_loadu_ps(k, c.as_ptr()));
        _mm512_mask_storeu_ps(c.as_mut_ptr(), k, e);
    }
}

/// See [`super::gather_t`]: blocks of 16 keys × 16 components, loaded as 16 row segments,
/// transposed in registers ([`transpose16`]) and stored as 16 column segments. (One hardware
/// gather per component, as before, costs a load per element; this costs 4 shuffles per
/// 16 elements.)
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gather_t(src: *const f32, stride: usize, n: usize, d: usize, dst: *mut f32) {
    let mut j0 = 0;
    while j0 < n {
        let rows = (n - j0).min(16);
        let row_mask = lanes(0, rows);
        let mut c0 = 0;
        while c0 < d {
            let cols = (d - c0).min(16);
            let col_mask = lanes(0, cols);
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, ri) in r.iter_mut().enumerate().take(rows) {
                *ri = _mm512_maskz_loadu_ps(col_mask, src.add((j0 + i) * stride + c0));
            }
            transpose16(&mut r);
            for (c, rc) in r.iter().enumerate().take(cols) {
                _mm512_mask_storeu_ps(dst.add((c0 + c) * n + j0), row_mask, *rc);
            }
            c0 += 16;
        }
        j0 += 16;
    }
}

/// Transposes the 16 × 16 matrix whose row `i` is `r[i]`, in registers. Lanes come in four
/// 128-bit quads; after stage 2, quad `q` of `u[4j + e]` holds column `4q + e` of rows
/// `4j..4j + 4`, and stages 3–4 gather the four quads of each column into one vector.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(r: &mut [__m512; 16]) {
    // Stage 1: interleave row pairs: t[2i] = (r2i[0], r2i+1[0], r2i[1], r2i+1[1]) per quad.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Stage 2: 4 × 4 transposes within each quad.
    let mut u = [_mm512_setzero_ps(); 16];
    for j in 0..4 {
        let (lo01, hi01, lo23, hi23) = (t[4 * j], t[4 * j + 1], t[4 * j + 2], t[4 * j + 3]);
        u[4 * j] = _mm512_shuffle_ps::<0x44>(lo01, lo23);
        u[4 * j + 1] = _mm512_shuffle_ps::<0xEE>(lo01, lo23);
        u[4 * j + 2] = _mm512_shuffle_ps::<0x44>(hi01, hi23);
        u[4 * j + 3] = _mm512_shuffle_ps::<0xEE>(hi01, hi23);
    }
    // Stages 3–4: output row 4q + e = [quad q of u[e], u[4 + e], u[8 + e], u[12 + e]].
    for e in 0..4 {
        let v_lo = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]); // quads 0, 2
        let v_hi = _mm512_shuffle_f32x4::<0xDD>(u[e], u[4 + e]); // quads 1, 3
        let w_lo = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
        let w_hi = _mm512_shuffle_f32x4::<0xDD>(u[8 + e], u[12 + e]);
        r[e] = _mm512_shuffle_f32x4::<0x88>(v_lo, w_lo);
        r[8 + e] = _mm512_shuffle_f32x4::<0xDD>(v_lo, w_lo);
        r[4 + e] = _mm512_shuffle_f32x4::<0x88>(v_hi, w_hi);
        r[12 + e] = _mm512_shuffle_f32x4::<0xDD>(v_hi, w_hi);
    }
}

/// `σ(x) = 1 / (1 + e^(−x))` for 16 lanes, on [`exp_ps`] (for `x > 87`, `e^(−x)` is flushed to
/// 0 and `σ = 1` exactly; for `x < −88.37` the clamp keeps `σ` a tiny positive normal).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sigmoid_ps(x: __m512) -> __m512 {
    let one = _mm512_set1_ps(1.0);
    let e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_div_ps(one, _mm512_add_ps(one, e))
}

/// Lane mask for the 16 elements starting at `i` of `n`.
#[inline]
fn lanes(i: usize, n: usize) -> __mmask16 {
    if n - i >= 16 {
        0xFFFF
    } else {
        tail_mask(n - i)
    }
}

/// See [`super::silu_mul`]; `u` may be null (plain SiLU).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn silu_mul(g: *const f32, u: *const f32, out: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let gv = _mm512_maskz_loadu_ps(k, g.add(i));
        let mut y = _mm512_mul_ps(gv, sigmoid_ps(gv));
        if !u.is_null() {
            y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, u.add(i)));
        }
        _mm512_mask_storeu_ps(out.add(i), k, y);
        i += 16;
    }
}

/// See [`super::silu_mul_grad`]; `u` and `du` are both null (plain SiLU) or both valid.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn silu_mul_grad(
    d: *const f32,
    g: *const f32,
    u: *const f32,
    dg: *mut f32,
    du: *mut f32,
    n: usize,
) {
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let gv = _mm512_maskz_loadu_ps(k, g.add(i));
        let dv = _mm512_maskz_loadu_ps(k, d.add(i));
        let s = sigmoid_ps(gv);
        // silu'(g) = s·(1 + g·(1 − s))
        let ds = _mm512_mul_ps(s, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one));
        let mut dgv = _mm512_mul_ps(dv, ds);
        if !u.is_null() {
            let uv = _mm512_maskz_loadu_ps(k, u.add(i));
            dgv = _mm512_mul_ps(dgv, uv);
            _mm512_mask_storeu_ps(du.add(i), k, _mm512_mul_ps(dv, _mm512_mul_ps(gv, s)));
        }
        _mm512_mask_storeu_ps(dg.add(i), k, dgv);
        i += 16;
    }
}
