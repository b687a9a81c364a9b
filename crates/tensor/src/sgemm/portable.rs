//! The portable micro-kernel: a 4 × 8 tile of `C` in plain Rust, for the portable kernel path
//! (and CPUs without AVX2). The compiler keeps the 32 accumulators in vector registers of the
//! baseline target (8 × 128-bit on x86-64) and vectorises the update `acc[i][j] += a_i · b_j`
//! (a multiply and an add, no fused multiply-add: the baseline has none, and a software
//! `mul_add` would be a library call per element).

use super::tile::{pack_b_scalar, pack_panel_scalar, Tile};
use super::MatRef;

/// The portable tile.
pub(crate) struct Portable;

const MR: usize = 4;
const NR: usize = 8;

impl Tile for Portable {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = 256;
    const MC: usize = MR * 256;
    const NC: usize = NR * 32;

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
        let a = std::slice::from_raw_parts(a, MR * kc);
        let b = std::slice::from_raw_parts(b, NR * kc);
        let mut acc = [[0.0f32; NR]; MR];
        for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
            for (row, &ai) in acc.iter_mut().zip(ap) {
                for (x, &bj) in row.iter_mut().zip(bp) {
                    *x += ai * bj;
                }
            }
        }
        for (i, row) in acc.iter().enumerate().take(rows) {
            let ci = std::slice::from_raw_parts_mut(c.add(i * ldc), cols);
            for (dst, &x) in ci.iter_mut().zip(row) {
                *dst = if accumulate { x + *dst } else { x };
            }
        }
    }

    unsafe fn pack_a(dst: &mut [f32], a: MatRef, rows: usize, kc: usize) {
        pack_panel_scalar::<MR>(&mut dst[..MR * kc], a.ptr, a.rs, a.cs, rows, kc);
    }

    unsafe fn pack_b(dst: &mut [f32], b: MatRef, kc: usize, nc: usize) {
        pack_b_scalar::<NR>(dst, b, kc, nc);
    }
}
