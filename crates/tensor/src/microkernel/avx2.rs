//! AVX2 + FMA versions of the tile kernels (8 f32 lanes, 16 `ymm` registers): register-blocked
//! `MR × (8·NV)` products with broadcast-FMA inner loops and vectorised `exp` functions that
//! compute the same polynomials as the AVX-512 ones (`2^n` is built in the exponent bits, where
//! AVX-512 has `vscalefps`; both multiply by an exact power of two, so the results agree bit
//! for bit for normal results).
//!
//! Every function requires AVX2 and FMA (callers check) and trusts the caller for bounds. Row
//! tails use `vmaskmovps` loads and stores, which never touch memory outside the mask.

use std::arch::x86_64::*;

/// See [`super::mm`]; pointers/strides as there.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
        let w = (n - j).min(16);
        let nv = w.div_ceil(8);
        let mask = tail_mask(w - (nv - 1) * 8); // lanes used in the last vector, 1..=8
        let (cj, bj) = (c.add(j), b.add(j));
        let t = Tile {
            c: cj,
            ldc,
            a,
            a_rs,
            a_cs,
            b: bj,
            ldb,
            k,
            mask,
            acc,
        };
        // Register budget: MR·NV accumulators + NV B-vectors + 1 broadcast <= 16 ymm.
        if nv == 2 {
            rows::<2>(t, m);
        } else {
            rows::<1>(t, m);
        }
        j += w;
    }
}

/// One column block of a tile product: `C[· × 8·NV] (+)= A · B[k × 8·NV]`, the last vector of
/// each row masked by `mask`.
#[derive(Clone, Copy)]
struct Tile {
    c: *mut f32,
    ldc: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    k: usize,
    mask: __m256i,
    acc: bool,
}

impl Tile {
    /// The same block from row `i` on.
    #[inline(always)]
    unsafe fn rows_from(self, i: usize) -> Tile {
        Tile {
            c: self.c.add(i * self.ldc),
            a: self.a.add(i * self.a_rs),
            ..self
        }
    }
}

/// All `m` rows of one column block: blocks of 6 rows (12 accumulators with `NV = 2`, 6 with
/// `NV = 1`), then one block of the remaining 1–5 rows.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn rows<const NV: usize>(t: Tile, m: usize) {
    let mut i = 0;
    while i + 6 <= m {
        block::<6, NV>(t.rows_from(i));
        i += 6;
    }
    let t = t.rows_from(i);
    match m - i {
        5 => block::<5, NV>(t),
        4 => block::<4, NV>(t),
        3 => block::<3, NV>(t),
        2 => block::<2, NV>(t),
        1 => block::<1, NV>(t),
        _ => {}
    }
}

/// `C[MR × 8·NV] (+)= A[MR × k] · B[k × 8·NV]` with all accumulators in registers.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block<const MR: usize, const NV: usize>(t: Tile) {
    let mut s = [[_mm256_setzero_ps(); NV]; MR];
    for p in 0..t.k {
        let bp = t.b.add(p * t.ldb);
        let mut bv = [_mm256_setzero_ps(); NV];
        for (v, bvv) in bv.iter_mut().enumerate() {
            *bvv = if v + 1 == NV {
                _mm256_maskload_ps(bp.add(8 * v), t.mask)
            } else {
                _mm256_loadu_ps(bp.add(8 * v))
            };
        }
        let ap = t.a.add(p * t.a_cs);
        for (r, sr) in s.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*ap.add(r * t.a_rs));
            for (sv, bvv) in sr.iter_mut().zip(&bv) {
                *sv = _mm256_fmadd_ps(av, *bvv, *sv);
            }
        }
    }
    for (r, sr) in s.iter().enumerate() {
        for (v, &sv) in sr.iter().enumerate() {
            let ptr = t.c.add(r * t.ldc + 8 * v);
            if v + 1 == NV {
                let x = if t.acc {
                    _mm256_add_ps(sv, _mm256_maskload_ps(ptr, t.mask))
                } else {
                    sv
                };
                _mm256_maskstore_ps(ptr, t.mask, x);
            } else {
                let x = if t.acc {
                    _mm256_add_ps(sv, _mm256_loadu_ps(ptr))
                } else {
                    sv
                };
                _mm256_storeu_ps(ptr, x);
            }
        }
    }
}

/// The lane mask (all ones in a lane = selected) of the first `n` (0..=8) lanes.
#[inline(always)]
unsafe fn tail_mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The lane mask of the 8 elements starting at `i` of `n` (`i < n`).
#[inline(always)]
unsafe fn lanes(i: usize, n: usize) -> __m256i {
    tail_mask((n - i).min(8))
}

/// Horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn reduce_add(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
    _mm_cvtss_f32(s)
}

/// Horizontal maximum of 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn reduce_max(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<0x55>(s, s));
    _mm_cvtss_f32(s)
}

/// Loads the lanes of `mask` from `p`, `fill` elsewhere.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load_or(p: *const f32, mask: __m256i, fill: __m256) -> __m256 {
    _mm256_blendv_ps(fill, _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask))
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row_max(x: *const f32, n: usize) -> f32 {
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m = ninf;
    let mut i = 0;
    while i + 8 <= n {
        m = _mm256_max_ps(m, _mm256_loadu_ps(x.add(i)));
        i += 8;
    }
    if i < n {
        m = _mm256_max_ps(m, load_or(x.add(i), lanes(i, n), ninf));
    }
    reduce_max(m)
}

/// `2^n` for integer-valued lanes `n` in `[−126, 127]`, built in the exponent field.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn pow2i(n: __m256) -> __m256 {
    let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
}

/// `e^x` for 8 lanes: the AVX-512 `exp_ps` (Cephes `expf`: `x = n·ln2 + r`, Cody–Waite
/// reduction, degree-5 polynomial), clamped to [−87, 88.37] so the result is a normal number;
/// lanes below −87 (and `−∞`) give exactly 0.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_ps(x: __m256) -> __m256 {
    let xc = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.37),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        xc,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_666_65));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    let r2 = _mm256_mul_ps(r, r);
    let er = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let e = _mm256_mul_ps(er, pow2i(n));
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
    _mm256_andnot_ps(tiny, e)
}

/// `e^x` for 8 lanes with `x <= 0` (or slightly above by rounding, or `−∞`): the AVX-512
/// `exp_nonpos_ps` (see there for the error bounds). `n = round(x·log2 e)` by the
/// add-magic-number trick leaves `n` in the low mantissa bits of `j = x·log2 e + 1.5·2²³`, so
/// shifting `j` left by 23 puts `n` in the exponent field (the magic's own bits shift out).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_nonpos_ps(x: __m256) -> __m256 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³
    let magic = _mm256_set1_ps(MAGIC);
    let j = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), magic);
    let n = _mm256_sub_ps(j, magic);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(std::f32::consts::LN_2), x);
    let mut p = _mm256_set1_ps(1.383_684_6e-3);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.374_816e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_822_5e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_664_2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.499_999_9));
    let one = _mm256_set1_ps(1.0);
    p = _mm256_fmadd_ps(p, r, one);
    p = _mm256_fmadd_ps(p, r, one);
    let bits = _mm256_add_epi32(
        _mm256_slli_epi32::<23>(_mm256_castps_si256(j)),
        _mm256_set1_epi32(127 << 23),
    );
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, _mm256_set1_ps(super::EXP_NONPOS_MIN));
    _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)))
}

/// `e^x` of one scalar through [`exp_nonpos_ps`].
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_nonpos_scalar(x: f32) -> f32 {
    _mm256_cvtss_f32(exp_nonpos_ps(_mm256_set1_ps(x)))
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sub_sum(x: *mut f32, n: usize, scale: f32, m: f32) -> f32 {
    let (mv, sv) = (_mm256_set1_ps(m), _mm256_set1_ps(scale));
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp_ps(_mm256_fmsub_ps(sv, _mm256_loadu_ps(x.add(i)), mv));
        _mm256_storeu_ps(x.add(i), e);
        s = _mm256_add_ps(s, e);
        i += 8;
    }
    if i < n {
        let k = lanes(i, n);
        let e = exp_ps(_mm256_fmsub_ps(sv, _mm256_maskload_ps(x.add(i), k), mv));
        let e = _mm256_and_ps(_mm256_castsi256_ps(k), e);
        _mm256_maskstore_ps(x.add(i), k, e);
        s = _mm256_add_ps(s, e);
    }
    reduce_add(s)
}

/// `Σ e^(x − m)` without writing `x`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn sum_exp_sub(x: *const f32, n: usize, m: f32) -> f32 {
    let mv = _mm256_set1_ps(m);
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(x.add(i), k), mv));
        s = _mm256_add_ps(s, _mm256_and_ps(_mm256_castsi256_ps(k), e));
        i += 8;
    }
    reduce_add(s)
}

/// `x ← e^(x − m) · a`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sub_scale(x: *mut f32, n: usize, m: f32, a: f32) {
    let (mv, av) = (_mm256_set1_ps(m), _mm256_set1_ps(a));
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(x.add(i), k), mv));
        _mm256_maskstore_ps(x.add(i), k, _mm256_mul_ps(e, av));
        i += 8;
    }
}

/// Rows handled together by the softmax tile kernels (independent dependency chains).
const GROUP: usize = 4;

/// Maxima of `R` rows, `x_r[..n_r]` (`−∞` for an empty row), interleaved.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn rows_max<const R: usize>(x: [*const f32; R], n: [usize; R]) -> [f32; R] {
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut acc = [ninf; R];
    let common = n.iter().min().map_or(0, |&m| m / 8 * 8);
    let mut i = 0;
    while i < common {
        for r in 0..R {
            acc[r] = _mm256_max_ps(acc[r], _mm256_loadu_ps(x[r].add(i)));
        }
        i += 8;
    }
    for r in 0..R {
        let mut j = common;
        while j < n[r] {
            acc[r] = _mm256_max_ps(acc[r], load_or(x[r].add(j), lanes(j, n[r]), ninf));
            j += 8;
        }
    }
    acc.map(|a| reduce_max(a))
}

/// For `R` rows interleaved: `x_r[..n_r] ← e^(scale·x − m_r)` with [`exp_nonpos_ps`],
/// `x_r[n_r..len] ← 0` (masked keys); returns the sums of the rows when `SUM`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn rows_exp<const R: usize, const SUM: bool>(
    x: [*mut f32; R],
    n: [usize; R],
    len: usize,
    scale: f32,
    m: [f32; R],
) -> [f32; R] {
    let sv = _mm256_set1_ps(scale);
    let mv = m.map(|m| _mm256_set1_ps(m));
    let mut sum = [_mm256_setzero_ps(); R];
    let common = n.iter().min().map_or(0, |&m| m / 8 * 8);
    let mut i = 0;
    while i < common {
        for r in 0..R {
            let e = exp_nonpos_ps(_mm256_fmsub_ps(sv, _mm256_loadu_ps(x[r].add(i)), mv[r]));
            _mm256_storeu_ps(x[r].add(i), e);
            if SUM {
                sum[r] = _mm256_add_ps(sum[r], e);
            }
        }
        i += 8;
    }
    for r in 0..R {
        let mut j = common;
        while j < len {
            let e = if n[r] > j {
                // The vector holding the row's last visible key: masked lanes become 0.
                let k = lanes(j, n[r]);
                let v = _mm256_maskload_ps(x[r].add(j), k);
                let e = exp_nonpos_ps(_mm256_fmsub_ps(sv, v, mv[r]));
                _mm256_and_ps(_mm256_castsi256_ps(k), e)
            } else {
                _mm256_setzero_ps()
            };
            _mm256_maskstore_ps(x[r].add(j), lanes(j, len), e);
            if SUM {
                sum[r] = _mm256_add_ps(sum[r], e);
            }
            j += 8;
        }
    }
    sum.map(|s| if SUM { reduce_add(s) } else { 0.0 })
}

/// `x[..n] *= a`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scale_row(x: *mut f32, n: usize, a: f32) {
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(x.add(i), _mm256_mul_ps(av, _mm256_loadu_ps(x.add(i))));
        i += 8;
    }
    if i < n {
        let k = lanes(i, n);
        let v = _mm256_mul_ps(av, _mm256_maskload_ps(x.add(i), k));
        _mm256_maskstore_ps(x.add(i), k, v);
    }
}

super::softmax_row_drivers!("avx2,fma");

/// `e^x` on every lane of `x[..n]` through [`exp_nonpos_ps`] (for the accuracy tests).
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_nonpos(x: &mut [f32]) {
    for c in x.chunks_mut(8) {
        let k = lanes(0, c.len());
        let e = exp_nonpos_ps(_mm256_maskload_ps(c.as_ptr(), k));
        _mm256_maskstore_ps(c.as_mut_ptr(), k, e);
    }
}

/// `σ(x) = 1 / (1 + e^(−x))` for 8 lanes, on [`exp_ps`].
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn sigmoid_ps(x: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    let e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_div_ps(one, _mm256_add_ps(one, e))
}

/// See [`super::silu_mul`]; `u` may be null (plain SiLU).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul(g: *const f32, u: *const f32, out: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let gv = _mm256_maskload_ps(g.add(i), k);
        let mut y = _mm256_mul_ps(gv, sigmoid_ps(gv));
        if !u.is_null() {
            y = _mm256_mul_ps(y, _mm256_maskload_ps(u.add(i), k));
        }
        _mm256_maskstore_ps(out.add(i), k, y);
        i += 8;
    }
}

/// See [`super::silu_mul_grad`]; `u` and `du` are both null (plain SiLU) or both valid.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul_grad(
    d: *const f32,
    g: *const f32,
    u: *const f32,
    dg: *mut f32,
    du: *mut f32,
    n: usize,
) {
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let k = lanes(i, n);
        let gv = _mm256_maskload_ps(g.add(i), k);
        let dv = _mm256_maskload_ps(d.add(i), k);
        let s = sigmoid_ps(gv);
        // silu'(g) = s·(1 + g·(1 − s))
        let ds = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
        let mut dgv = _mm256_mul_ps(dv, ds);
        if !u.is_null() {
            let uv = _mm256_maskload_ps(u.add(i), k);
            dgv = _mm256_mul_ps(dgv, uv);
            _mm256_maskstore_ps(du.add(i), k, _mm256_mul_ps(dv, _mm256_mul_ps(gv, s)));
        }
        _mm256_maskstore_ps(dg.add(i), k, dgv);
        i += 8;
    }
}
