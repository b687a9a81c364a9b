//! The single-threaded loop nest around a micro-kernel ([`super::tile::Tile`], GotoBLAS/BLIS
//! structure):
//!
//! ```text
//! for pc in 0..k step KC                // rank-KC update
//!   for ic in 0..m step MC              // pack A(ic.., pc..) → Â (when n needs several B̂)
//!     for jc in 0..n step NC            // pack B(pc.., jc..) → B̂ (KC × NC, L2)
//!       for ir in 0..mc step MR         // Â micro-panel (MR × KC) in L1
//!         for jr in 0..nc step NR       // B̂ micro-panels stream from L2
//!           C(ic+ir.., jc+jr..) (+)= Â_ir · B̂_jr
//! ```
//! When all of `n` fits one `B̂` block (the usual case at training shapes) each `A` micro-panel
//! is instead packed right before its `jr` loop into an L1-sized buffer, so packed `A` never
//! leaves L1; with several `B̂` blocks, or a column-major `A` (packed fastest as a whole block,
//! see `Tile::pack_a_block`), an `A` block is packed once per rank update and reused
//! for every `B̂` block (packing it per block would cost `m·k·n/NC` copies, measured 5 % of a
//! 2048³ product). The first rank update writes or accumulates as the caller asked; later ones
//! always accumulate.

use super::blocking::block_len;
use super::scratch::with_buffers;
use super::tile::Tile;
use super::MatRef;

/// `C[m × n] (+)= A·B` on the calling thread with the micro-kernel `T`,
/// `C(i, j) = c[i·ldc + j]`, `k ≥ 1`.
///
/// # Safety
/// `T`'s instruction set must be available; all addressed elements in bounds; `C` not
/// aliasing `A`/`B` and not accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm<T: Tile>(
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    let (mr, nr) = (T::MR, T::NR);
    let (kc_max, nc_max) = (block_len(k, T::KC, 1), block_len(n, T::NC, nr));
    // A column-major A is packed as whole blocks (sequential reads, see `Tile::pack_a_block`);
    // otherwise, when one B block covers n, A is packed panel by panel into L1.
    let col_major_a = a.rs == 1 && a.cs != 1;
    let one_b_block = n <= nc_max && !col_major_a;
    let mc_max = if one_b_block {
        mr
    } else {
        block_len(m, T::MC, mr)
    };
    with_buffers(|abuf, bbuf| {
        let ap = abuf.get(mc_max * kc_max);
        let bp = bbuf.get(nc_max * kc_max);
        for pc in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - pc);
            let acc = accumulate || pc > 0;
            if one_b_block {
                let bp = &mut bp[..n.div_ceil(nr) * nr * kc];
                T::pack_b(bp, b.sub(pc, 0), kc, n);
                for ir in (0..m).step_by(mr) {
                    let rows = mr.min(m - ir);
                    T::pack_a(&mut ap[..mr * kc], a.sub(ir, pc), rows, kc);
                    panel_row::<T>(ap.as_ptr(), bp, c.add(ir * ldc), ldc, rows, n, kc, acc);
                }
                continue;
            }
            for ic in (0..m).step_by(mc_max) {
                let mc = mc_max.min(m - ic);
                let panels = mc.div_ceil(mr);
                T::pack_a_block(ap, a.sub(ic, pc), mc, kc);
                for jc in (0..n).step_by(nc_max) {
                    let nc = nc_max.min(n - jc);
                    let bp = &mut bp[..nc.div_ceil(nr) * nr * kc];
                    T::pack_b(bp, b.sub(pc, jc), kc, nc);
                    for r in 0..panels {
                        let (ir, rows) = (ic + r * mr, mr.min(mc - r * mr));
                        let ct = c.add(ir * ldc + jc);
                        let panel = ap[r * mr * kc..].as_ptr();
                        panel_row::<T>(panel, bp, ct, ldc, rows, nc, kc, acc);
                    }
                }
            }
        }
    })
}

/// One row panel of `C` (`rows ≤ T::MR` rows from `c`, `nc` columns): every micro-tile of the
/// packed `A` panel at `ap` against the micro-panels of the packed `B` block `bp`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) unsafe fn panel_row<T: Tile>(
    ap: *const f32,
    bp: &[f32],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    nc: usize,
    kc: usize,
    acc: bool,
) {
    for (s, bpanel) in bp.chunks_exact(T::NR * kc).enumerate() {
        let jr = s * T::NR;
        let cols = T::NR.min(nc - jr);
        T::tile(kc, ap, bpanel.as_ptr(), c.add(jr), ldc, rows, cols, acc);
    }
}
