//! The AVX-512 micro-kernel: one `MR × NR` (14 × 32) tile of `C` from a packed `A` micro-panel
//! (`MR × kc`) and a packed `B` micro-panel (`kc × NR`).
//!
//! Register blocking: the tile lives in 28 zmm accumulators (14 rows × 2 vectors of 16
//! columns). Each step `p` of the `kc` loop loads the two `B` vectors `B(p, 0..32)` once and
//! issues two FMAs per row with `A(i, p)` broadcast, so 28 FMAs per step and no shuffles.
//! 28 independent accumulator chains cover the FMA latency (4 cycles × 2 ports = 8 chains
//! needed). With 2 FMA ports the loop runs at 14 cycles per `p`.
//!
//! The `kc` loop ([`k_loop`]) is inline assembly with the broadcast riding in each FMA's memory
//! operand (`vfmadd231ps zmm, zmm, m32{1to16}`, address = packed panel pointer + constant), so
//! a step is 2 loads + 28 fused load-FMAs + 3 loop µops = 33 µops through the front end, 2.4 per
//! cycle at the FMA peak. (A loop with one `vbroadcastss` per row, able to read a row-major `A`
//! in place without packing, needs 49 µops per step; on cores whose front end is shared with a
//! busy hyper-thread sibling it ran at 78 % of the register-only FMA rate where this one ran at
//! 80–85 %, docs/PERFORMANCE.md, "GEMM: own kernel, `gemm` crate, PyTorch, AMX"; so every `A`
//! is packed.)
//!
//! Edges: rows beyond `rows` are computed on zero padding and not stored; columns beyond
//! `cols` are excluded by the store masks, so the kernel never touches `C` outside the tile.

//!
//! Block sizes, for a core with 48 KiB L1d and 2 MiB L2 (Sapphire Rapids; reasonable for other
//! AVX-512 Xeons):
//! - `KC = 512`: the packed `A` micro-panel (`MR × KC` floats = 28 KiB) stays in L1 while the
//!   kernel walks across the packed `B` block; a deep `KC` halves the `C` tile traffic per
//!   multiply-add compared with 256 (each tile of `C` is read and written once per `KC` steps).
//! - `NC = 512`: columns of the packed `B` block (`KC × NC` floats = 1 MiB), resident in L2
//!   while every row panel of `A` passes over it; its `NR`-wide micro-panels stream from L2
//!   (128 bytes per 14 cycles, far below L2 bandwidth).
//! - `MC = 2100` rows of a packed `A` block when `n` needs several `B` blocks (≥ 2048 so that
//!   2048-row products use one block; 4.2 MiB of packed `A`, read back from L3 panel by panel).
//!
//! (A classic BLIS order with the `B` micro-panel in L1 and `KC = 256` measured 10–15 %
//! slower here: a 32 KiB `B` panel plus the streaming `A` panel overfill the 48 KiB L1.)

use super::pack;
use super::tile::Tile;
use super::MatRef;
use std::arch::x86_64::*;

/// Rows of the register tile (broadcast operand).
pub(crate) const MR: usize = 14;
/// Columns of the register tile (two 16-lane vectors).
pub(crate) const NR: usize = 32;

/// The AVX-512 tile.
pub(crate) struct Avx512;

impl Tile for Avx512 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = 512;
    const MC: usize = MR * 150;
    const NC: usize = NR * 16;

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
        pack::pack_a(dst, a, rows, kc)
    }

    unsafe fn pack_a_block(dst: &mut [f32], a: MatRef, mc: usize, kc: usize) {
        if a.rs == 1 {
            return pack::pack_a_columns(dst, a, mc, kc);
        }
        for r in 0..mc.div_ceil(MR) {
            let rows = MR.min(mc - r * MR);
            pack::pack_a(&mut dst[r * MR * kc..], a.sub(r * MR, 0), rows, kc);
        }
    }

    unsafe fn pack_b(dst: &mut [f32], b: MatRef, kc: usize, nc: usize) {
        pack::pack_b(dst, b, kc, nc)
    }
}

/// `C[rows × cols] (+)= Â · B̂` for a packed `A` micro-panel `Â` (`kc` steps of `MR` values) and
/// a packed `B̂` micro-panel (`kc` steps of `NR` values); `C(i, j) = c[i·ldc + j]`.
/// `accumulate = false` overwrites `C`.
///
/// # Safety
/// AVX-512F must be available; `kc ≥ 1`; `MR·kc` floats of `a` and `NR·kc` floats of `b`
/// (64-byte aligned) must be readable; every
/// `C(i, j)` with `i < rows ≤ MR`, `j < cols ≤ NR` must be writable and not accessed
/// concurrently.
#[target_feature(enable = "avx512f")]
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
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // Start moving the C tile towards L2 now; it is read or written after the k loop.
    for i in 0..rows {
        _mm_prefetch::<_MM_HINT_T1>(c.add(i * ldc) as *const i8);
        _mm_prefetch::<_MM_HINT_T1>(c.add(i * ldc + NR - 1) as *const i8);
    }
    k_loop(kc, a, b, &mut acc);
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

/// `asm!` with the tile's 28 accumulators bound to `zmm0`–`zmm27` (`acc[i][v]` in
/// `zmm(2i + v)`) and `zmm28`–`zmm31` free for the loop's own values; the loop reads memory
/// and writes none.
macro_rules! tile_asm {
    ($acc:ident, $($body:tt)*) => {
        std::arch::asm!(
            $($body)*
            inout("zmm0") $acc[0][0],
            inout("zmm1") $acc[0][1],
            inout("zmm2") $acc[1][0],
            inout("zmm3") $acc[1][1],
            inout("zmm4") $acc[2][0],
            inout("zmm5") $acc[2][1],
            inout("zmm6") $acc[3][0],
            inout("zmm7") $acc[3][1],
            inout("zmm8") $acc[4][0],
            inout("zmm9") $acc[4][1],
            inout("zmm10") $acc[5][0],
            inout("zmm11") $acc[5][1],
            inout("zmm12") $acc[6][0],
            inout("zmm13") $acc[6][1],
            inout("zmm14") $acc[7][0],
            inout("zmm15") $acc[7][1],
            inout("zmm16") $acc[8][0],
            inout("zmm17") $acc[8][1],
            inout("zmm18") $acc[9][0],
            inout("zmm19") $acc[9][1],
            inout("zmm20") $acc[10][0],
            inout("zmm21") $acc[10][1],
            inout("zmm22") $acc[11][0],
            inout("zmm23") $acc[11][1],
            inout("zmm24") $acc[12][0],
            inout("zmm25") $acc[12][1],
            inout("zmm26") $acc[13][0],
            inout("zmm27") $acc[13][1],
            out("zmm28") _,
            out("zmm29") _,
            out("zmm30") _,
            out("zmm31") _,
            options(readonly, nostack),
        )
    };
}

/// The `kc` loop of the tile: `acc[i] += Â(p, i) · B̂(p, ·)` for every step `p`, the broadcast
/// of `Â(p, i)` folded into the FMAs.
///
/// # Safety
/// AVX-512F; `kc ≥ 1`; `MR·kc` floats of `a` and `NR·kc` floats of `b` (64-byte aligned)
/// readable.
#[target_feature(enable = "avx512f")]
unsafe fn k_loop(kc: usize, a: *const f32, b: *const f32, acc: &mut [[__m512; 2]; MR]) {
    tile_asm!(
        acc,
        "2:",
        "vmovaps zmm28, [{b}]",
        "vmovaps zmm29, [{b} + 64]",
        "vfmadd231ps zmm0, zmm28, dword ptr [{a} + 0]{{1to16}}",
        "vfmadd231ps zmm1, zmm29, dword ptr [{a} + 0]{{1to16}}",
        "vfmadd231ps zmm2, zmm28, dword ptr [{a} + 4]{{1to16}}",
        "vfmadd231ps zmm3, zmm29, dword ptr [{a} + 4]{{1to16}}",
        "vfmadd231ps zmm4, zmm28, dword ptr [{a} + 8]{{1to16}}",
        "vfmadd231ps zmm5, zmm29, dword ptr [{a} + 8]{{1to16}}",
        "vfmadd231ps zmm6, zmm28, dword ptr [{a} + 12]{{1to16}}",
        "vfmadd231ps zmm7, zmm29, dword ptr [{a} + 12]{{1to16}}",
        "vfmadd231ps zmm8, zmm28, dword ptr [{a} + 16]{{1to16}}",
        "vfmadd231ps zmm9, zmm29, dword ptr [{a} + 16]{{1to16}}",
        "vfmadd231ps zmm10, zmm28, dword ptr [{a} + 20]{{1to16}}",
        "vfmadd231ps zmm11, zmm29, dword ptr [{a} + 20]{{1to16}}",
        "vfmadd231ps zmm12, zmm28, dword ptr [{a} + 24]{{1to16}}",
        "vfmadd231ps zmm13, zmm29, dword ptr [{a} + 24]{{1to16}}",
        "vfmadd231ps zmm14, zmm28, dword ptr [{a} + 28]{{1to16}}",
        "vfmadd231ps zmm15, zmm29, dword ptr [{a} + 28]{{1to16}}",
        "vfmadd231ps zmm16, zmm28, dword ptr [{a} + 32]{{1to16}}",
        "vfmadd231ps zmm17, zmm29, dword ptr [{a} + 32]{{1to16}}",
        "vfmadd231ps zmm18, zmm28, dword ptr [{a} + 36]{{1to16}}",
        "vfmadd231ps zmm19, zmm29, dword ptr [{a} + 36]{{1to16}}",
        "vfmadd231ps zmm20, zmm28, dword ptr [{a} + 40]{{1to16}}",
        "vfmadd231ps zmm21, zmm29, dword ptr [{a} + 40]{{1to16}}",
        "vfmadd231ps zmm22, zmm28, dword ptr [{a} + 44]{{1to16}}",
        "vfmadd231ps zmm23, zmm29, dword ptr [{a} + 44]{{1to16}}",
        "vfmadd231ps zmm24, zmm28, dword ptr [{a} + 48]{{1to16}}",
        "vfmadd231ps zmm25, zmm29, dword ptr [{a} + 48]{{1to16}}",
        "vfmadd231ps zmm26, zmm28, dword ptr [{a} + 52]{{1to16}}",
        "vfmadd231ps zmm27, zmm29, dword ptr [{a} + 52]{{1to16}}",
        "add {a}, 56",
        "add {b}, 128",
        "dec {k}",
        "jnz 2b",
        a = inout(reg) a => _,
        b = inout(reg) b => _,
        k = inout(reg) kc => _,
    );
}

/// The mask selecting the first `n ≤ 16` lanes.
#[inline(always)]
fn lane_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}
