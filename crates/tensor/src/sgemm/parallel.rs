//! Splitting one product across threads. With at least four row panels (`MR` rows) per
//! thread the FMA kernels (AVX-512, AVX2, portable) use the dynamic schedule of [`super::dynamic`]: panels are handed
//! out one at a time, so a thread whose vCPU runs slower takes fewer (on the shared VMs the
//! halves of a static split differed by 5–27 % in duration). Otherwise (few rows, or the AMX
//! kernel) the output is cut into `t` static slabs of whole
//! register tiles (so no tile is shared) along `m` (rows) or `n` (columns), whichever has more
//! tiles (at 2048³: 147 row tiles split 73/74; the even 32/32 column split measured 2–5 %
//! slower, since each thread then packs all of a row-major `A` whose 8 KiB stride rules out
//! reading it in place). Each slab is an independent [`super::driver::gemm`] on one rayon
//! worker of the budget pool, with that worker's own packing buffers: a row slab keeps its
//! packed `A` in its own core's L2 and packs the `B` blocks it reads itself. Re-packing `B` per
//! thread costs ≈ 3 % of a 2048³ product (a memory-bound strided read), but one packed `B`
//! shared by two threads measured 2–4 % slower still: half of every block then crosses between
//! cores. Both schedules give every element of `C` the bits it has on one thread.

use super::tile::Tile;
use super::{amx, driver, dynamic, Kernel, MatRef};
use crate::threads;
use rayon::prelude::*;

/// Below this many multiply-adds per thread a product stays on the calling thread.
const MIN_WORK_PER_THREAD: usize = 32 * 32 * 256;

/// Pointers that cross into the pool; the caller of [`run`] guarantees that slabs are
/// disjoint and that it blocks until every slab is done.
#[derive(Clone, Copy)]
struct Shared {
    c: *mut f32,
    a: MatRef,
    b: MatRef,
}
// SAFETY: see the type's doc; the pointees outlive the scoped parallel loop.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// The single-threaded loop nest of each kernel.
type Driver = unsafe fn(*mut f32, usize, MatRef, MatRef, usize, usize, usize, bool);

/// See [`super::sgemm_with`] (`k ≥ 1`, `m, n ≥ 1`).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run(
    kernel: Kernel,
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    mkn: [usize; 3],
    accumulate: bool,
    threads: usize,
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => {
            run_tiles::<super::kernel::Avx512>(c, ldc, a, b, mkn, accumulate, threads)
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => run_tiles::<super::avx2::Avx2>(c, ldc, a, b, mkn, accumulate, threads),
        Kernel::Portable => {
            run_tiles::<super::portable::Portable>(c, ldc, a, b, mkn, accumulate, threads)
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx => run_static(amx::gemm, [32, 32], c, ldc, a, b, mkn, accumulate, threads),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("{kernel:?} is x86-64 only"),
    }
}

/// [`run`] for an FMA micro-kernel `T`: the dynamic schedule where it applies, else the static
/// split.
#[allow(clippy::too_many_arguments)]
unsafe fn run_tiles<T: Tile>(
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    threads: usize,
) {
    let t = split_threads([m, k, n], [T::MR, T::NR], threads);
    if t >= 2 && dynamic_applies(m, T::MR, t) {
        return dynamic::gemm::<T>(c, ldc, a, b, [m, k, n], accumulate, t);
    }
    run_static(
        driver::gemm::<T>,
        [T::MR, T::NR],
        c,
        ldc,
        a,
        b,
        [m, k, n],
        accumulate,
        threads,
    )
}

/// The static split: `t` slabs of whole `[mr, nr]` register tiles along the dimension with more
/// tiles, each an independent `gemm` on one worker (one slab: the calling thread).
#[allow(clippy::too_many_arguments)]
unsafe fn run_static(
    gemm: Driver,
    [mr, nr]: [usize; 2],
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    threads: usize,
) {
    let t = split_threads([m, k, n], [mr, nr], threads);
    if t == 1 {
        return gemm(c, ldc, a, b, m, k, n, accumulate);
    }
    let (tiles_m, tiles_n) = (m.div_ceil(mr), n.div_ceil(nr));
    let by_rows = tiles_m >= tiles_n;
    let tiles = if by_rows { tiles_m } else { tiles_n };
    let sh = Shared { c, a, b };
    threads::install(move || {
        (0..t).into_par_iter().for_each(move |q| {
            let sh = sh;
            let (t0, t1) = (q * tiles / t, (q + 1) * tiles / t);
            // SAFETY: slab q covers rows (or columns) [t0, t1) tiles, disjoint from the
            // others; the caller's bounds guarantee covers every sub-view.
            unsafe {
                if by_rows {
                    let (i0, i1) = (t0 * mr, (t1 * mr).min(m));
                    let cq = sh.c.add(i0 * ldc);
                    gemm(cq, ldc, sh.a.sub(i0, 0), sh.b, i1 - i0, k, n, accumulate);
                } else {
                    let (j0, j1) = (t0 * nr, (t1 * nr).min(n));
                    let cq = sh.c.add(j0);
                    gemm(cq, ldc, sh.a, sh.b.sub(0, j0), m, k, j1 - j0, accumulate);
                }
            }
        })
    });
}

/// How many threads of a budget of `threads` a product with `[mr, nr]` register tiles uses.
fn split_threads([m, k, n]: [usize; 3], [mr, nr]: [usize; 2], threads: usize) -> usize {
    let tiles = m.div_ceil(mr).max(n.div_ceil(nr));
    let work = m.saturating_mul(n).saturating_mul(k);
    threads.min(tiles).min(work / MIN_WORK_PER_THREAD).max(1)
}

/// Whether `t ≥ 2` threads split an `m`-row product of `mr`-row panels by the dynamic
/// schedule: at least four row panels per thread, so that handing out single panels balances
/// the threads (fewer rows are split statically, by columns).
fn dynamic_applies(m: usize, mr: usize, t: usize) -> bool {
    m.div_ceil(mr) >= 4 * t
}

/// Whether the FMA kernel `kernel` splits `C[m × n] (+)= A[m × k]·B` across two or more
/// threads of a budget of `threads` with the dynamic schedule.
pub fn splits_dynamically(kernel: Kernel, [m, k, n]: [usize; 3], threads: usize) -> bool {
    let Some([mr, nr]) = kernel.tile() else {
        return false;
    };
    let t = split_threads([m, k, n], [mr, nr], threads);
    t >= 2 && dynamic_applies(m, mr, t)
}
