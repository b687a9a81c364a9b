//! Packing: copies a block of a strided operand into the contiguous micro-panel order the
//! micro-kernel reads, padding partial panels with zeros. Transposed and strided operands are
//! handled only here, so the kernel always sees the same layout.
//!
//! - `A` rows `0..rows` (`≤ MR`) × `kc` → one panel: for each `p < kc`, the `MR` values
//!   `A(i, p)`: `dst[p·MR + i]`.
//! - `B` block `kc × nc` → `⌈nc/NR⌉` panels; panel `s` holds, for each `p < kc`, the `NR`
//!   values `B(p, s·NR + j)`: `dst[s·NR·kc + p·NR + j]`.
//!
//! Both are the same operation on a "panel of `W` lines": line `i` is the sequence
//! `src[i·s_i + p·s_p]` over `p`, written to `panel[p·W + i]`. When the lines are contiguous
//! across `i` (`s_i = 1`, e.g. a transposed `A`) each step is one masked vector copy; when they
//! are contiguous along `p` (`s_p = 1`, e.g. a row-major `A` or a transposed `B`) blocks of
//! 16 lines × 16 steps are loaded as 16 vectors and transposed in registers (64 shuffles per
//! 256 values instead of 256 scalar moves); other strides use a scalar loop.

use super::kernel::{MR, NR};
use super::MatRef;
use std::arch::x86_64::*;

/// Packs `A(0..rows, 0..kc)` into one `MR`-wide panel (`MR·kc` floats, zero rows beyond
/// `rows`).
///
/// # Safety
/// AVX-512F; every `A(i, p)` with `i < rows ≤ MR`, `p < kc` must be readable.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a(dst: &mut [f32], a: MatRef, rows: usize, kc: usize) {
    pack_panel::<MR>(&mut dst[..MR * kc], a.ptr, a.rs, a.cs, rows, kc);
}

/// Packs `A(0..mc, 0..kc)` of a column-major `A` (`rs = 1`, e.g. `dyᵀ` of a weight gradient)
/// into `⌈mc/MR⌉` panels, walking each source column `A(·, p)` front to back (one sequential
/// stream per step instead of one 56-byte piece per step per panel, which left packing
/// panel by panel waiting on strided misses).
///
/// # Safety
/// AVX-512F; `a.rs == 1`; every `A(i, p)` with `i < mc`, `p < kc` must be readable; `dst`
/// must hold `⌈mc/MR⌉·MR·kc` floats.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a_columns(dst: &mut [f32], a: MatRef, mc: usize, kc: usize) {
    debug_assert!(a.rs == 1 && dst.len() >= mc.div_ceil(MR) * MR * kc);
    let out = dst.as_mut_ptr();
    for p in 0..kc {
        let col = a.at(0, p);
        for r in 0..mc.div_ceil(MR) {
            let valid = MR.min(mc - r * MR);
            let v = _mm512_maskz_loadu_ps(lanes(valid), col.add(r * MR));
            _mm512_mask_storeu_ps(out.add(r * MR * kc + p * MR), lanes(MR), v);
        }
    }
}

/// Packs `B(0..kc, 0..nc)` of `b`; `dst` must hold `⌈nc/NR⌉·NR·kc` floats.
///
/// # Safety
/// AVX-512F; every `B(p, j)` with `p < kc`, `j < nc` must be readable.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_b(dst: &mut [f32], b: MatRef, kc: usize, nc: usize) {
    let panels = nc.div_ceil(NR);
    if b.cs == 1 {
        // Row-major B: read each row of the block front to back (one sequential stream per
        // row instead of one 128-byte piece per row per panel), scattering into the panels.
        let out = dst.as_mut_ptr();
        for p in 0..kc {
            let row = b.at(p, 0);
            for s in 0..panels {
                let cols = NR.min(nc - s * NR);
                let d = out.add(s * NR * kc + p * NR);
                for j0 in (0..NR).step_by(16) {
                    let v = _mm512_maskz_loadu_ps(
                        lanes(cols.saturating_sub(j0).min(16)),
                        row.add(s * NR + j0),
                    );
                    _mm512_store_ps(d.add(j0), v);
                }
            }
        }
        return;
    }
    for (s, panel) in dst.chunks_exact_mut(NR * kc).take(panels).enumerate() {
        let cols = NR.min(nc - s * NR);
        // Line j of the panel is column s·NR + j of B: stride cs across lines, rs along p.
        pack_panel::<NR>(panel, b.at(0, s * NR), b.cs, b.rs, cols, kc);
    }
}

/// One panel of width `W ≤ 32`: `panel[p·W + i] = src[i·s_i + p·s_p]`
/// for `i < w`, zero for `w ≤ i < W`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_panel<const W: usize>(
    panel: &mut [f32],
    src: *const f32,
    s_i: isize,
    s_p: isize,
    w: usize,
    kc: usize,
) {
    debug_assert!(panel.len() == W * kc && w <= W && W <= 32);
    let out = panel.as_mut_ptr();
    if s_i == 1 {
        // Step p's w values are contiguous: masked copies of up to 16 lanes.
        for p in 0..kc {
            let (s, d) = (src.offset(p as isize * s_p), out.add(p * W));
            for i0 in (0..W).step_by(16) {
                let width = (W - i0).min(16);
                let valid = w.saturating_sub(i0).min(16);
                let v = _mm512_maskz_loadu_ps(lanes(valid), s.add(i0));
                _mm512_mask_storeu_ps(d.add(i0), lanes(width), v);
            }
        }
    } else if s_p == 1 {
        // Lines contiguous along p: 16×16 register transposes. Fixed trip counts with masks
        // (all-zero masks for absent lines/steps, which touch no memory) keep the block in
        // registers.
        for p0 in (0..kc).step_by(16) {
            let steps = (kc - p0).min(16);
            for i0 in (0..W).step_by(16) {
                let width = lanes((W - i0).min(16));
                let valid = w.saturating_sub(i0).min(16);
                let mut r = [_mm512_setzero_ps(); 16];
                for (i, v) in r.iter_mut().enumerate() {
                    let mask = if i < valid { lanes(steps) } else { 0 };
                    let line = src.wrapping_offset((i0 + i) as isize * s_i + p0 as isize);
                    *v = _mm512_maskz_loadu_ps(mask, line);
                }
                let t = transpose16(r);
                for (q, v) in t.iter().enumerate() {
                    let mask = if q < steps { width } else { 0 };
                    let dst = out.wrapping_add((p0 + q) * W + i0);
                    _mm512_mask_storeu_ps(dst, mask, *v);
                }
            }
        }
    } else {
        for p in 0..kc {
            for i in 0..W {
                *out.add(p * W + i) = if i < w {
                    *src.offset(i as isize * s_i + p as isize * s_p)
                } else {
                    0.0
                };
            }
        }
    }
}

/// The mask selecting the first `n ≤ 16` lanes.
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Transposes a 16×16 block held as 16 row vectors: `out[c][r] = rows[r][c]`.
///
/// Stage 1 interleaves row pairs (`unpack*_ps`), stage 2 row quadruples (`unpack*_pd`), which
/// leaves each 128-bit lane `L` of `u[4j + c]` holding column `4L + c` of rows `4j..4j+4`;
/// stages 3–4 then transpose the 4×4 grid of 128-bit lanes (`shuffle_f32x4`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for j in 0..8 {
        t[2 * j] = _mm512_unpacklo_ps(r[2 * j], r[2 * j + 1]);
        t[2 * j + 1] = _mm512_unpackhi_ps(r[2 * j], r[2 * j + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    for j in 0..4 {
        let (e0, e1, o0, o1) = (
            pd(t[4 * j]),
            pd(t[4 * j + 2]),
            pd(t[4 * j + 1]),
            pd(t[4 * j + 3]),
        );
        u[4 * j] = ps(_mm512_unpacklo_pd(e0, e1));
        u[4 * j + 1] = ps(_mm512_unpackhi_pd(e0, e1));
        u[4 * j + 2] = ps(_mm512_unpacklo_pd(o0, o1));
        u[4 * j + 3] = ps(_mm512_unpackhi_pd(o0, o1));
    }
    let mut o = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let (x, y, z, w) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
        let s0 = _mm512_shuffle_f32x4::<0x88>(x, y);
        let s1 = _mm512_shuffle_f32x4::<0xDD>(x, y);
        let s2 = _mm512_shuffle_f32x4::<0x88>(z, w);
        let s3 = _mm512_shuffle_f32x4::<0xDD>(z, w);
        o[c] = _mm512_shuffle_f32x4::<0x88>(s0, s2);
        o[8 + c] = _mm512_shuffle_f32x4::<0xDD>(s0, s2);
        o[4 + c] = _mm512_shuffle_f32x4::<0x88>(s1, s3);
        o[12 + c] = _mm512_shuffle_f32x4::<0xDD>(s1, s3);
    }
    o
}
