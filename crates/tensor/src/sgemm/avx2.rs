//! The AVX2 + FMA micro-kernel: one 6 × 16 tile of `C` from a packed `A` micro-panel
//! (`6 × kc`) and a packed `B` micro-panel (`kc × 16`).
//!
//! Register blocking for the 16 ymm registers: the tile lives in 12 accumulators (6 rows × 2
//! vectors of 8 columns); each step `p` loads the two `B` vectors once and, per row, broadcasts
//! `A(i, p)` and issues two FMAs: 12 FMAs per step against 2 loads + 6 broadcasts, and 12
//! independent accumulator chains cover the FMA latency (4–5 cycles × 2 ports). This is the
//! classic BLIS shape for Haswell/Zen (`MR × NR = 6 × 16`).
//!
//! Block sizes for a core with 32 KiB L1d and 512 KiB–1 MiB L2 (Zen 2–4, Intel client cores):
//! `KC = 256` keeps the packed `A` micro-panel (6 KiB) in L1 beside two `B` micro-panels
//! (16 KiB each) while the kernel walks across the packed `B` block; `NC = 384` columns make
//! that block `KC × NC` floats = 384 KiB, resident in L2.
//!
//! Edges: rows beyond `rows` are computed on zero padding and not stored; columns beyond
//! `cols` are excluded by masked loads and stores.

use super::tile::{pack_b_scalar, pack_panel_scalar, Tile};
use super::MatRef;
use std::arch::x86_64::*;

/// The AVX2 + FMA tile.
pub(crate) struct Avx2;

const MR: usize = 6;
const NR: usize = 16;

impl Tile for Avx2 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = 256;
    const MC: usize = MR * 340;
    const NC: usize = NR * 24;

    unsafe fn tile(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        tile(kc, a, b, c, ldc, rows, cols, accumulate)
    }

    unsafe fn pack_a(dst: &mut [f32], a: MatRef, rows: usize, kc: usize) {
        pack_panel::<MR>(&mut dst[..MR * kc], a.ptr, a.rs, a.cs, rows, kc);
    }

    unsafe fn pack_b(dst: &mut [f32], b: MatRef, kc: usize, nc: usize) {
        if b.cs == 1 {
            return pack_b_scalar::<NR>(dst, b, kc, nc);
        }
        let panels = nc.div_ceil(NR);
        for (s, panel) in dst.chunks_exact_mut(NR * kc).take(panels).enumerate() {
            let cols = NR.min(nc - s * NR);
            pack_panel::<NR>(panel, b.at(0, s * NR), b.cs, b.rs, cols, kc);
        }
    }
}

/// One panel of width `W` (`panel[p·W + i] = src[i·s_i + p·s_p]`, zero lines from `w`): lines
/// contiguous along `p` (a row-major `A`, a transposed `B`) go through 8 × 8 register
/// transposes, 8 lines × 8 steps at a time (a scalar copy would write one float per line
/// into each 64-byte step); other strides use the scalar packing.
///
/// # Safety
/// As for [`pack_panel_scalar`]; AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_panel<const W: usize>(
    panel: &mut [f32],
    src: *const f32,
    s_i: isize,
    s_p: isize,
    w: usize,
    kc: usize,
) {
    if s_p != 1 || s_i == 1 {
        return pack_panel_scalar::<W>(panel, src, s_i, s_p, w, kc);
    }
    debug_assert!(panel.len() >= W * kc && w <= W);
    let out = panel.as_mut_ptr();
    let full = kc / 8 * 8;
    for i0 in (0..W).step_by(8) {
        let width = (W - i0).min(8);
        let store = lane_mask(width);
        for p0 in (0..full).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate().take(w.saturating_sub(i0).min(8)) {
                *v = _mm256_loadu_ps(src.offset((i0 + i) as isize * s_i + p0 as isize));
            }
            let t = transpose8(r);
            for (q, v) in t.iter().enumerate() {
                _mm256_maskstore_ps(out.add((p0 + q) * W + i0), store, *v);
            }
        }
    }
    // The last kc mod 8 steps, and zero lines from w, one value at a time.
    for p in full..kc {
        for i in 0..W {
            *out.add(p * W + i) = if i < w {
                *src.offset(i as isize * s_i + p as isize)
            } else {
                0.0
            };
        }
    }
}

/// Transposes an 8 × 8 block held as 8 row vectors: `out[c][r] = rows[r][c]` (unpack pairs,
/// then quadruples, then swap 128-bit halves).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// See [`Tile::tile`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        let b0 = _mm256_load_ps(b);
        let b1 = _mm256_load_ps(b.add(8));
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = _mm256_broadcast_ss(&*a.add(i));
            row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
            row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
        }
        a = a.add(MR);
        b = b.add(NR);
    }
    if cols == NR {
        for (i, row) in acc.iter_mut().enumerate().take(rows) {
            let ci = c.add(i * ldc);
            if accumulate {
                row[0] = _mm256_add_ps(row[0], _mm256_loadu_ps(ci));
                row[1] = _mm256_add_ps(row[1], _mm256_loadu_ps(ci.add(8)));
            }
            _mm256_storeu_ps(ci, row[0]);
            _mm256_storeu_ps(ci.add(8), row[1]);
        }
        return;
    }
    let m0 = lane_mask(cols.min(8));
    let m1 = lane_mask(cols.saturating_sub(8));
    for (i, row) in acc.iter_mut().enumerate().take(rows) {
        let ci = c.add(i * ldc);
        if accumulate {
            row[0] = _mm256_add_ps(row[0], _mm256_maskload_ps(ci, m0));
            row[1] = _mm256_add_ps(row[1], _mm256_maskload_ps(ci.add(8), m1));
        }
        _mm256_maskstore_ps(ci, m0, row[0]);
        _mm256_maskstore_ps(ci.add(8), m1, row[1]);
    }
}

/// The mask selecting the first `n ≤ 8` lanes (sign bit set).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn lane_mask(n: usize) -> __m256i {
    const IDX: [i32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
    let idx = _mm256_loadu_si256(IDX.as_ptr() as *const __m256i);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx)
}
