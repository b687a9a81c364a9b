//! The AVX-512 micro-kernel: one `MR × NR` (14 × 32) tile of `C` from a packed `A`
//! micro-panel and a packed `B` micro-panel.
//!
//! Register blocking: the tile lives in 28 zmm accumulators (14 rows × 2 vectors of 16
//! columns). Each step `p` of the `kc` loop loads the two `B` vectors `B(p, 0..32)` once and,
//! for each of the 14 rows, broadcasts `A(i, p)` and issues two FMAs, so 28 FMAs need 2 vector
//! loads + 14 broadcast loads and no shuffles. 28 independent accumulator chains cover the
//! FMA latency (4 cycles × 2 ports = 8 chains needed). With 2 FMA ports the loop runs at
//! 14 cycles per `p`; the load ports (2–3 per cycle) have room to spare.
//!
//! Written with intrinsics: LLVM keeps the 28 accumulators in registers and folds nothing
//! else into the loop; measured in isolation (operands in L1/L2) it runs at the FMA peak of the
//! core (134–135 GFLOP/s of 134–136), so the remaining losses of a whole product are memory
//! effects that the driver and packing address, not instruction scheduling.
//!
//! Edges: rows beyond `rows` are computed on zero padding and not stored; columns beyond
//! `cols` are excluded by the store masks, so the kernel never touches `C` outside the tile.

use super::blocking::{MR, NR};
use std::arch::x86_64::*;

/// `C[rows × cols] (+)= Â · B̂` for a packed `Â` micro-panel (`kc` steps of `MR` values) and a
/// packed `B̂` micro-panel (`kc` steps of `NR` values); `C(i, j) = c[i·ldc + j]`.
/// `accumulate = false` overwrites `C`.
///
/// # Safety
/// AVX-512F must be available; `a` must hold `MR·kc` and `b` `NR·kc` readable floats (`b`
/// 64-byte aligned); every `C(i, j)` with `i < rows ≤ MR`, `j < cols ≤ NR` must be writable
/// and not accessed concurrently.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // Start moving the C tile towards L2 now; it is read or written after the k loop.
    for i in 0..rows {
        _mm_prefetch::<_MM_HINT_T1>(c.add(i * ldc) as *const i8);
        _mm_prefetch::<_MM_HINT_T1>(c.add(i * ldc + NR - 1) as *const i8);
    }
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        let b0 = _mm512_load_ps(b);
        let b1 = _mm512_load_ps(b.add(16));
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = _mm512_set1_ps(*a.add(i));
            row[0] = _mm512_fmadd_ps(ai, b0, row[0]);
            row[1] = _mm512_fmadd_ps(ai, b1, row[1]);
        }
        a = a.add(MR);
        b = b.add(NR);
    }
    let m0: __mmask16 = lane_mask(cols.min(16));
    let m1: __mmask16 = lane_mask(cols.saturating_sub(16));
    // All loads of C before any store: a load issued after a store to an address with the
    // same low 12 bits (rows of a power-of-two leading dimension) waits on a false "4K
    // aliasing" dependency.
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate().take(rows) {
            let ci = c.add(i * ldc);
            row[0] = _mm512_add_ps(row[0], _mm512_maskz_loadu_ps(m0, ci));
            row[1] = _mm512_add_ps(row[1], _mm512_maskz_loadu_ps(m1, ci.add(16)));
        }
    }
    for (i, row) in acc.iter().enumerate().take(rows) {
        let ci = c.add(i * ldc);
        _mm512_mask_storeu_ps(ci, m0, row[0]);
        _mm512_mask_storeu_ps(ci.add(16), m1, row[1]);
    }
}

/// The mask selecting the first `n ≤ 16` lanes.
#[inline(always)]
fn lane_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}
