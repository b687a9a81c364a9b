//! Packing for the AMX kernel: splits fp32 operands into three bf16 parts (see [`super`]) and
//! lays them out as the kernel's tiles, one [`STEP_BYTES`] block per 32-deep step of `k`.
//!
//! Within a step, part `p` (0 = high, 1 = middle, 2 = low) and half `h` is the 1 KiB tile at
//! `(2p + h)·1024`, sixteen 64-byte rows:
//! - `A` panel (32 rows × 32 `k`): half `h` holds rows `16h..16h+16`; tile row `r` is the 32
//!   bf16 values `A(16h + r, k₀..k₀+32)` in order.
//! - `B` panel (32 `k` × 32 columns), "VNNI" pairs: half `h` holds columns `16h..16h+16`; tile
//!   row `q`, dword `j` is `B(k₀+2q, 16h+j)` (low half) and `B(k₀+2q+1, 16h+j)` (high half),
//!   which is what `tdpbf16ps` multiplies against a row of `A`.
//!
//! Edges are zero-padded (rows, columns and `k` beyond the operand), so the kernel always
//! computes full 32 × 32 blocks. Sources are read as rows contiguous along the tile's inner
//! dimension (`A` along `k`, `B` along `n`); other layouts are first staged into that form by
//! the FMA kernel's packing ([`crate::sgemm::pack::pack_panel`], in-register transposes).

use super::STEP_BYTES;
use std::arch::x86_64::*;

const TILE: usize = 1024;

/// The fp32 values of 16 bf16 values (exact: a bf16 is the high half of an fp32).
#[inline(always)]
unsafe fn widen(h: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// `x − h`, or 0 where `h` is ±∞ (so an infinite input stays infinite rather than becoming
/// `∞ − ∞ = NaN` in the lower parts). Exact: the residual of rounding to fewer bits is
/// representable.
#[inline(always)]
unsafe fn residual(x: __m512, h: __m512) -> __m512 {
    let inf = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(h), _mm512_set1_ps(f32::INFINITY));
    _mm512_maskz_sub_ps(!inf, x, h)
}

/// The 32 values `(x₀, x₁)` (16 + 16 lanes) as three vectors of 32 bf16 in the same order,
/// high, middle and low parts: `h = bf16(x)`, `m = bf16(x − h)`, `l = bf16(x − h − m)` (round
/// to nearest even, `vcvtne2ps2bf16`), so `x = h + m + l` exactly unless a part underflows
/// (`|m| ≤ 2⁻⁸|x|`, `|l| ≤ 2⁻¹⁷|x|`).
#[inline(always)]
unsafe fn split(x0: __m512, x1: __m512) -> [__m512i; 3] {
    let round =
        |a: __m512, b: __m512| -> __m512i { std::mem::transmute(_mm512_cvtne2ps_pbh(b, a)) };
    let halves = |v: __m512i| {
        (
            widen(_mm512_castsi512_si256(v)),
            widen(_mm512_extracti64x4_epi64::<1>(v)),
        )
    };
    let h = round(x0, x1);
    let (h0, h1) = halves(h);
    let (r0, r1) = (residual(x0, h0), residual(x1, h1));
    let m = round(r0, r1);
    let (m0, m1) = halves(m);
    let l = round(_mm512_sub_ps(r0, m0), _mm512_sub_ps(r1, m1));
    [h, m, l]
}

/// Word indices for `_mm512_permutex2var_epi16` over `(even, odd)`, two rows of 32 bf16: the
/// VNNI pairs `even[j], odd[j]` for `j` in `16·half .. 16·half + 16`.
const fn interleaved(half: usize) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut j = 0;
    while j < 16 {
        idx[2 * j] = (16 * half + j) as i16;
        idx[2 * j + 1] = (32 + 16 * half + j) as i16;
        j += 1;
    }
    idx
}
const INTERLEAVED: [[i16; 32]; 2] = [interleaved(0), interleaved(1)];

#[inline(always)]
unsafe fn index(words: &[i16; 32]) -> __m512i {
    _mm512_loadu_si512(words.as_ptr() as *const _)
}

/// The mask selecting the first `n` (clamped to 16) lanes.
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// A row source: row `i`, step `s` starts at `ptr + s·step + i·ld` (floats) and holds
/// `valid(s)` meaningful values (the rest of the 32 are read as zeros).
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub ptr: *const f32,
    pub ld: usize,
    pub step: usize,
}

/// Packs an `A` panel: `rows ≤ 32` rows × `kc` of `src` (rows contiguous along `k`) into
/// `⌈kc/32⌉` steps at `dst`.
///
/// # Safety
/// AVX-512F/BW; every addressed source value (`i < rows`, `k < kc`) readable; `dst` 64-byte
/// aligned with room for `⌈kc/32⌉·STEP_BYTES` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_a(dst: *mut u8, src: Rows, rows: usize, kc: usize) {
    for s in 0..kc.div_ceil(32) {
        let valid = kc - 32 * s;
        let (m0, m1) = (lanes(valid), lanes(valid.saturating_sub(16)));
        let out = dst.add(s * STEP_BYTES);
        for r in 0..32 {
            let (v0, v1) = if r < rows {
                let row = src.ptr.add(s * src.step + r * src.ld);
                (
                    _mm512_maskz_loadu_ps(m0, row),
                    _mm512_maskz_loadu_ps(m1, row.add(16)),
                )
            } else {
                (_mm512_setzero_ps(), _mm512_setzero_ps())
            };
            let at = (r / 16) * TILE + (r % 16) * 64;
            for (part, values) in split(v0, v1).into_iter().enumerate() {
                _mm512_store_si512(out.add(2 * part * TILE + at) as *mut _, values);
            }
        }
    }
}

/// Packs a `B` panel: `kc` rows (of `k`) × `cols ≤ 32` columns of `src` (rows contiguous
/// along `n`) into `⌈kc/32⌉` steps at `dst`.
///
/// # Safety
/// As for [`pack_a`] with `p < kc`, `j < cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_b(dst: *mut u8, src: Rows, cols: usize, kc: usize) {
    let idx = [index(&INTERLEAVED[0]), index(&INTERLEAVED[1])];
    let (m0, m1) = (lanes(cols), lanes(cols.saturating_sub(16)));
    let row = |p: usize| -> [__m512; 2] {
        if p < kc {
            let r = src.ptr.add((p / 32) * src.step + (p % 32) * src.ld);
            [
                _mm512_maskz_loadu_ps(m0, r),
                _mm512_maskz_loadu_ps(m1, r.add(16)),
            ]
        } else {
            [_mm512_setzero_ps(); 2]
        }
    };
    for s in 0..kc.div_ceil(32) {
        let out = dst.add(s * STEP_BYTES);
        for q in 0..16 {
            let [e0, e1] = row(32 * s + 2 * q);
            let [o0, o1] = row(32 * s + 2 * q + 1);
            let (even, odd) = (split(e0, e1), split(o0, o1));
            for part in 0..3 {
                for (half, idx) in idx.iter().enumerate() {
                    let words = _mm512_permutex2var_epi16(even[part], *idx, odd[part]);
                    let at = (2 * part + half) * TILE + q * 64;
                    _mm512_store_si512(out.add(at) as *mut _, words);
                }
            }
        }
    }
}
