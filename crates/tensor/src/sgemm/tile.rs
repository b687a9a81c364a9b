//! What the loop nest ([`super::driver`], [`super::dynamic`]) needs of a micro-kernel: its
//! register tile (`MR × NR`), its block sizes, the tile computation and the packing into the
//! micro-panel order it reads. One implementation per instruction set: [`super::kernel`]
//! (AVX-512, 14 × 32), [`super::avx2`] (AVX2 + FMA, 6 × 16) and [`super::portable`] (plain
//! Rust, 4 × 8).
//!
//! Every implementation sums `C(i, j)` over `p` in the same order whatever `m`, `n` and the
//! thread count: one accumulator per element, the steps of a rank-`KC` update in order, the
//! updates in order, with `KC` blocks that depend on `k` alone ([`super::blocking::block_len`]).
//! So a row of `C` has the same bits whether it is computed alone or among many rows (batch
//! invariance): a token's result does not depend on which other tokens share its product, as
//! when expert parallelism regroups an expert's tokens across ranks.

use super::MatRef;

/// A register-blocked micro-kernel with its packing.
pub(crate) trait Tile {
    /// Rows of the register tile (the broadcast operand `A`).
    const MR: usize;
    /// Columns of the register tile (the vector operand `B`).
    const NR: usize;
    /// Largest depth of one packed rank-`KC` update.
    const KC: usize;
    /// Rows of a packed `A` block when `n` needs several `B` blocks (a multiple of `MR`).
    const MC: usize;
    /// Columns of a packed `B` block (a multiple of `NR`).
    const NC: usize;

    /// `C[rows × cols] (+)= Â · B̂` for a packed `A` micro-panel `Â` (`kc` steps of `MR` values)
    /// and a packed `B̂` micro-panel (`kc` steps of `NR` values), `C(i, j) = c[i·ldc + j]`:
    /// the tile's sum over the `kc` steps, then (when `accumulate`) plus `C`.
    ///
    /// # Safety
    /// The kernel's instruction set is available; `kc ≥ 1`; `MR·kc` floats of `a` and `NR·kc`
    /// floats of `b` (64-byte aligned) readable; every `C(i, j)` with `i < rows ≤ MR`,
    /// `j < cols ≤ NR` writable and not accessed concurrently.
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
    );

    /// Packs `A(0..rows, 0..kc)` (`rows ≤ MR`) into one panel: `dst[p·MR + i] = A(i, p)`, zero
    /// for `rows ≤ i < MR`.
    ///
    /// # Safety
    /// The instruction set is available; every `A(i, p)` in range readable; `dst` holds
    /// `MR·kc` floats.
    unsafe fn pack_a(dst: &mut [f32], a: MatRef, rows: usize, kc: usize);

    /// Packs `A(0..mc, 0..kc)` into `⌈mc/MR⌉` consecutive panels (as [`Tile::pack_a`] each).
    ///
    /// # Safety
    /// As for [`Tile::pack_a`]; `dst` holds `⌈mc/MR⌉·MR·kc` floats.
    unsafe fn pack_a_block(dst: &mut [f32], a: MatRef, mc: usize, kc: usize) {
        let mr = Self::MR;
        let panels = mc.div_ceil(mr);
        if a.rs != 1 {
            for r in 0..panels {
                let rows = mr.min(mc - r * mr);
                Self::pack_a(
                    &mut dst[r * mr * kc..(r + 1) * mr * kc],
                    a.sub(r * mr, 0),
                    rows,
                    kc,
                );
            }
            return;
        }
        // Column-major A (e.g. `dyᵀ` of a weight gradient): walk each source column front to
        // back, one sequential read per step instead of `MR` values per step per panel.
        if !mc.is_multiple_of(mr) {
            dst[..panels * mr * kc].fill(0.0);
        }
        for p in 0..kc {
            let col = std::slice::from_raw_parts(a.at(0, p), mc);
            for (r, part) in col.chunks(mr).enumerate() {
                let d = r * mr * kc + p * mr;
                dst[d..d + part.len()].copy_from_slice(part);
            }
        }
    }

    /// Packs `B(0..kc, 0..nc)` into `⌈nc/NR⌉` panels: panel `s` holds
    /// `dst[s·NR·kc + p·NR + j] = B(p, s·NR + j)`, zero beyond `nc`.
    ///
    /// # Safety
    /// The instruction set is available; every `B(p, j)` in range readable; `dst` holds
    /// `⌈nc/NR⌉·NR·kc` floats.
    unsafe fn pack_b(dst: &mut [f32], b: MatRef, kc: usize, nc: usize);
}

/// One panel of width `W` in plain Rust: `panel[p·W + i] = src[i·s_i + p·s_p]` for `i < w`,
/// zero for `w ≤ i < W` (the packing of the AVX2 and portable kernels).
///
/// # Safety
/// Every `src[i·s_i + p·s_p]` with `i < w`, `p < kc` readable; `panel` holds `W·kc` floats.
pub(super) unsafe fn pack_panel_scalar<const W: usize>(
    panel: &mut [f32],
    src: *const f32,
    s_i: isize,
    s_p: isize,
    w: usize,
    kc: usize,
) {
    debug_assert!(panel.len() >= W * kc && w <= W);
    if w < W {
        panel[..W * kc].fill(0.0);
    }
    if s_i == 1 {
        // Step p's w values are contiguous.
        for p in 0..kc {
            let s = std::slice::from_raw_parts(src.offset(p as isize * s_p), w);
            panel[p * W..p * W + w].copy_from_slice(s);
        }
    } else {
        // Line by line: each line's reads are sequential when s_p = 1 (a row-major A, a
        // transposed B).
        for i in 0..w {
            let line = src.offset(i as isize * s_i);
            for p in 0..kc {
                *panel.get_unchecked_mut(p * W + i) = *line.offset(p as isize * s_p);
            }
        }
    }
}

/// [`Tile::pack_b`] for the AVX2 and portable kernels: row by row when `B` is row-major (one
/// sequential read per row of the block), else panel by panel.
///
/// # Safety
/// As for [`Tile::pack_b`].
pub(super) unsafe fn pack_b_scalar<const NR: usize>(
    dst: &mut [f32],
    b: MatRef,
    kc: usize,
    nc: usize,
) {
    let panels = nc.div_ceil(NR);
    if b.cs == 1 {
        if !nc.is_multiple_of(NR) {
            dst[..panels * NR * kc].fill(0.0);
        }
        for p in 0..kc {
            let row = std::slice::from_raw_parts(b.at(p, 0), nc);
            for (s, chunk) in row.chunks(NR).enumerate() {
                let d = s * NR * kc + p * NR;
                dst[d..d + chunk.len()].copy_from_slice(chunk);
            }
        }
        return;
    }
    for (s, panel) in dst.chunks_exact_mut(NR * kc).take(panels).enumerate() {
        let cols = NR.min(nc - s * NR);
        // Line j of the panel is column s·NR + j of B: stride cs across lines, rs along p.
        pack_panel_scalar::<NR>(panel, b.at(0, s * NR), b.cs, b.rs, cols, kc);
    }
}
