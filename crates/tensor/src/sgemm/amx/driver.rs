//! The single-threaded loop nest of the AMX path:
//!
//! ```text
//! for pc in 0..k step KC                    // rank-KC update
//!   for jc in 0..n step NC                  // pack B(pc.., jc..) → B̂ (⌈NC/32⌉ panels, L2)
//!     for ir in 0..m step 32                // pack A(ir.., pc..) → Â (one panel, L1)
//!       for jr in 0..nc step 32             // B̂ panels stream from L2
//!         C(ir.., jc+jr..) (+)= Â · B̂_jr    // kernel::block, 32 × 32
//! ```
//! Full blocks of `C` are read and written in place by the tile loads and stores; blocks at the
//! bottom or right edge go through a 32 × 32 scratch tile so nothing outside `C` is touched.

use super::kernel;
use super::pack::{pack_a, pack_b, Rows};
use super::{KC, NC, STEP_BYTES};
use crate::sgemm::blocking::block_len;
use crate::sgemm::pack::pack_panel;
use crate::sgemm::scratch::Aligned;
use crate::sgemm::MatRef;
use std::cell::RefCell;

/// Per-thread buffers: packed `A` panel, packed `B` block, and fp32 staging for operands
/// that are not contiguous along the packed dimension.
#[derive(Default)]
struct Buffers {
    a: Aligned,
    b: Aligned,
    stage: Aligned,
    edge: Aligned,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::default();
}

/// `C[m × n] (+)= A·B` on the calling thread, `C(i, j) = c[i·ldc + j]`, `k ≥ 1`.
///
/// # Safety
/// [`super::available`]; all addressed elements in bounds; `C` not aliasing `A`/`B` and not
/// accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
pub(in crate::sgemm) unsafe fn gemm(
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => run(&mut bufs, c, ldc, a, b, [m, k, n], accumulate),
        // Re-entered on this thread (not expected): fresh buffers rather than a panic.
        Err(_) => run(&mut Buffers::default(), c, ldc, a, b, [m, k, n], accumulate),
    })
}

/// Prefetches (into L2, for writing) the lines of a `rows × cols ≤ 32 × 32` block of `C`.
#[inline]
unsafe fn prefetch_block(c: *const f32, rows: usize, cols: usize, ldc: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET1};
    for i in 0..rows {
        let row = c.add(i * ldc);
        _mm_prefetch::<_MM_HINT_ET1>(row as *const i8);
        _mm_prefetch::<_MM_HINT_ET1>(row.add(cols - 1) as *const i8);
    }
}

/// Floats needed for `bytes` bytes.
fn floats(bytes: usize) -> usize {
    bytes.div_ceil(4)
}

unsafe fn run(
    bufs: &mut Buffers,
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    [m, k, n]: [usize; 3],
    accumulate: bool,
) {
    let (kc_max, nc_max) = (block_len(k, KC, 32), block_len(n, NC, 32));
    let steps_max = kc_max / 32;
    let ap = bufs.a.get(floats(steps_max * STEP_BYTES)).as_mut_ptr() as *mut u8;
    let bp = bufs
        .b
        .get(floats(nc_max / 32 * steps_max * STEP_BYTES))
        .as_mut_ptr() as *mut u8;
    let stage = bufs.stage.get(32 * kc_max).as_mut_ptr();
    let edge = bufs.edge.get(32 * 32).as_mut_ptr();
    kernel::configure();
    for pc in (0..k).step_by(kc_max) {
        let kc = kc_max.min(k - pc);
        let steps = kc.div_ceil(32);
        let load = accumulate || pc > 0;
        for jc in (0..n).step_by(nc_max) {
            let nc = nc_max.min(n - jc);
            for jr in (0..nc).step_by(32) {
                let cols = 32.min(nc - jr);
                let src = b.sub(pc, jc + jr);
                let rows = if src.cs == 1 {
                    Rows {
                        ptr: src.ptr,
                        ld: src.rs as usize,
                        step: 32 * src.rs as usize,
                    }
                } else {
                    // stage[p·32 + j] = B(pc + p, jc + jr + j)
                    let panel = std::slice::from_raw_parts_mut(stage, 32 * kc);
                    pack_panel::<32>(panel, src.ptr, src.cs, src.rs, cols, kc);
                    Rows {
                        ptr: stage,
                        ld: 32,
                        step: 32 * 32,
                    }
                };
                pack_b(bp.add(jr / 32 * steps * STEP_BYTES), rows, cols, kc);
            }
            for ir in (0..m).step_by(32) {
                let rows = 32.min(m - ir);
                let src = a.sub(ir, pc);
                let a_rows = if src.cs == 1 {
                    Rows {
                        ptr: src.ptr,
                        ld: src.rs as usize,
                        step: 32,
                    }
                } else {
                    // stage[s·1024 + i·32 + q] = A(ir + i, pc + 32s + q)
                    for s in 0..steps {
                        let valid = 32.min(kc - 32 * s);
                        let panel = std::slice::from_raw_parts_mut(stage.add(s * 1024), 32 * rows);
                        pack_panel::<32>(panel, src.at(0, 32 * s), src.cs, src.rs, valid, rows);
                    }
                    Rows {
                        ptr: stage,
                        ld: 32,
                        step: 1024,
                    }
                };
                pack_a(ap, a_rows, rows, kc);
                for jr in (0..nc).step_by(32) {
                    let cols = 32.min(nc - jr);
                    let bpanel = bp.add(jr / 32 * steps * STEP_BYTES);
                    let ct = c.add(ir * ldc + jc + jr);
                    // Start moving the next block of C towards L2 while this one computes (in
                    // a training step C is usually cold; the tile loads and stores would
                    // otherwise wait on memory for each of its 64 lines).
                    if jr + 32 < nc {
                        prefetch_block(ct.add(32), rows, (nc - jr - 32).min(32), ldc);
                    } else if ir + 32 < m {
                        prefetch_block(
                            c.add((ir + 32) * ldc + jc),
                            32.min(m - ir - 32),
                            32.min(nc),
                            ldc,
                        );
                    }
                    if rows == 32 && cols == 32 {
                        kernel::block(ap, bpanel, steps, ct, ldc, load);
                        continue;
                    }
                    // Edge block: through the 32 × 32 scratch tile.
                    if load {
                        for i in 0..32 {
                            for j in 0..32 {
                                *edge.add(i * 32 + j) = if i < rows && j < cols {
                                    *ct.add(i * ldc + j)
                                } else {
                                    0.0
                                };
                            }
                        }
                    }
                    kernel::block(ap, bpanel, steps, edge, 32, load);
                    for i in 0..rows {
                        std::ptr::copy_nonoverlapping(edge.add(i * 32), ct.add(i * ldc), cols);
                    }
                }
            }
        }
    }
    kernel::release();
}
