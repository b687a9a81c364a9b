//! The single-threaded loop nest around the micro-kernel (GotoBLAS/BLIS structure):
//!
//! ```text
//! for pc in 0..k step KC            // rank-KC update
//!   for jc in 0..n step NC          // pack B(pc.., jc..) → B̂ (KC × NC, L2)
//!     for ir in 0..m step MR        // A(ir.., pc..): read in place or packed (L1)
//!       for jr in 0..nc step NR     // B̂ micro-panels stream from L2
//!         C(ir.., jc+jr..) (+)= A_ir · B̂_jr
//! ```
//! A row-major `A` is read in place by the kernel (its `MR` rows × `KC` steps stay in L1
//! across the `jr` loop, and nothing is copied); other `A` layouts (transposed, general
//! strides) and the last partial row panel are packed one panel at a time into an L1-sized
//! buffer. The first rank-`KC` update writes or accumulates as the caller asked; later ones
//! always accumulate.

use super::blocking::{block_len, KC, MR, NC, NR};
use super::kernel;
use super::pack::{pack_a, pack_b};
use super::scratch::with_buffers;
use super::MatRef;

/// `C[m × n] (+)= A·B` on the calling thread, `C(i, j) = c[i·ldc + j]`, `k ≥ 1`.
///
/// # Safety
/// AVX-512F must be available; all addressed elements in bounds; `C` not aliasing `A`/`B`
/// and not accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm(
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    let row_major_a = a.cs == 1 && a.rs >= 0;
    let (kc_max, nc_max) = (block_len(k, KC, 1), block_len(n, NC, NR));
    with_buffers(|abuf, bbuf| {
        let ap = abuf.get(MR * kc_max);
        for pc in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - pc);
            let acc = accumulate || pc > 0;
            for jc in (0..n).step_by(nc_max) {
                let nc = nc_max.min(n - jc);
                let bp = bbuf.get(nc.div_ceil(NR) * NR * kc);
                pack_b(bp, b.sub(pc, jc), kc, nc);
                for ir in (0..m).step_by(MR) {
                    let rows = MR.min(m - ir);
                    let a_ir = a.sub(ir, pc);
                    let in_place = row_major_a && rows == MR;
                    if !in_place {
                        pack_a(ap, a_ir, rows, kc);
                    }
                    for (s, bpanel) in bp.chunks_exact(NR * kc).enumerate() {
                        let jr = s * NR;
                        let (cols, c_tile) = (NR.min(nc - jr), c.add(ir * ldc + jc + jr));
                        let bpanel = bpanel.as_ptr();
                        if in_place {
                            let lda = a.rs as usize;
                            kernel::tile::<true>(
                                kc, a_ir.ptr, lda, bpanel, c_tile, ldc, rows, cols, acc,
                            );
                        } else {
                            kernel::tile::<false>(
                                kc,
                                ap.as_ptr(),
                                MR,
                                bpanel,
                                c_tile,
                                ldc,
                                rows,
                                cols,
                                acc,
                            );
                        }
                    }
                }
            }
        }
    })
}
