//! The dynamic schedule of one product across threads: row panels (`MR` rows of `C`, for the
//! micro-kernel at hand) are
//! handed out one at a time from a shared counter, so a thread that runs faster simply takes
//! more of them. On the shared 2-vCPU VMs the two halves of a static split differed by 5–27 %
//! in duration, at random which one (docs/PERFORMANCE.md, "GEMM: own kernel, `gemm` crate, PyTorch, AMX"); the static split then
//! waits for the slower half.
//!
//! The product is a sequence of *stages*, one per (rank-`KC` update `pc`, `B̂` block `jc`), in
//! the driver's order. Each stage has its own panel counter. A thread enters a stage, packs
//! that stage's `B̂` block into its own buffer (kept in its own L2, as in the static split),
//! and takes panels until the counter runs out, then moves to the next stage. A panel may only
//! enter stage `s` once its stage `s − 1` is finished: a per-panel count of finished stages,
//! released after the tile's stores and acquired before its loads, orders the updates of each
//! tile of `C` exactly as on one thread. So every element of `C` is summed in the same order
//! with the same kernel, whatever thread computes it: the result is bitwise that of
//! [`super::driver::gemm`] on one thread.
//!
//! There is no barrier between stages: a thread only ever waits for one panel that another
//! thread is computing right now, typically the last few panels of the previous stage, which
//! always finish (no thread waits while holding an unfinished panel), so it spins briefly
//! instead of parking a rayon worker.
//!
//! With several `B̂` blocks per rank update a packed `A` panel is reused for every block; it is
//! then packed into a buffer shared by the threads, by whichever thread takes the panel in the
//! update's first stage (the stage order guarantees later stages see it, and that the next
//! update's packing waits for the last reader). With one `B̂` block each `A` panel is packed
//! into the taker's L1-sized buffer right before use, as in the driver.

use super::blocking::block_len;
use super::driver::panel_row;
use super::scratch::{with_buffers, with_shared_a};
use super::tile::Tile;
use super::MatRef;
use crate::threads;
use rayon::prelude::*;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The state the threads share; the caller of [`gemm`] blocks until all threads are done.
struct Schedule<T> {
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    kc_max: usize,
    nc_max: usize,
    n_blocks: usize,
    /// Packed `A` panels (`MR·kc_max` floats each) shared by all threads, or null when each
    /// thread packs its own.
    shared_a: *mut f32,
    /// `next[s]`: the next panel to hand out in stage `s`.
    next: Vec<AtomicUsize>,
    /// `finished[p]`: how many stages panel `p` has completed.
    finished: Vec<AtomicUsize>,
    kernel: PhantomData<T>,
}
// SAFETY: the raw pointers address the caller's operands and the shared A buffer, which
// outlive the parallel loop; every tile of C and every shared A panel is written by one
// thread at a time, ordered by `finished` (release/acquire).
unsafe impl<T> Sync for Schedule<T> {}

/// `C[m × n] (+)= A·B` with the micro-kernel `T` on `t ≥ 2` threads of the budget pool,
/// bitwise equal to the driver on one thread. Preconditions as for [`super::driver::gemm`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm<T: Tile>(
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    t: usize,
) {
    let (kc_max, nc_max) = (block_len(k, T::KC, 1), block_len(n, T::NC, T::NR));
    let (k_blocks, n_blocks) = (k.div_ceil(kc_max), n.div_ceil(nc_max));
    let panels = m.div_ceil(T::MR);
    let share_a = n_blocks > 1;
    with_shared_a(|buf| {
        let shared_a = if share_a {
            buf.get(panels * T::MR * kc_max).as_mut_ptr()
        } else {
            std::ptr::null_mut()
        };
        let schedule = Schedule::<T> {
            c,
            ldc,
            a,
            b,
            m,
            k,
            n,
            accumulate,
            kc_max,
            nc_max,
            n_blocks,
            shared_a,
            next: (0..k_blocks * n_blocks)
                .map(|_| AtomicUsize::new(0))
                .collect(),
            finished: (0..panels).map(|_| AtomicUsize::new(0)).collect(),
            kernel: PhantomData,
        };
        let schedule = &schedule;
        // SAFETY: as for this function; `work` only touches what the schedule hands it.
        threads::install(|| {
            (0..t)
                .into_par_iter()
                .for_each(|_| unsafe { schedule.work() })
        });
    })
}

impl<T: Tile> Schedule<T> {
    /// One thread's share: every stage in order, panels from the stage's counter.
    unsafe fn work(&self) {
        let panels = self.finished.len();
        with_buffers(|abuf, bbuf| {
            let (mr, nr) = (T::MR, T::NR);
            let a_own = abuf.get(mr * self.kc_max);
            let b_packed = bbuf.get(self.nc_max * self.kc_max);
            for (s, next) in self.next.iter().enumerate() {
                if next.load(Ordering::Relaxed) >= panels {
                    continue; // taken already: skip packing this stage's B̂
                }
                let (pc, jc) = (
                    (s / self.n_blocks) * self.kc_max,
                    (s % self.n_blocks) * self.nc_max,
                );
                let (kc, nc) = (self.kc_max.min(self.k - pc), self.nc_max.min(self.n - jc));
                let bp = &mut b_packed[..nc.div_ceil(nr) * nr * kc];
                T::pack_b(bp, self.b.sub(pc, jc), kc, nc);
                let acc = self.accumulate || pc > 0;
                loop {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    if p >= panels {
                        break;
                    }
                    self.wait_for(p, s);
                    let (ir, rows) = (p * mr, mr.min(self.m - p * mr));
                    let panel = if self.shared_a.is_null() {
                        T::pack_a(&mut a_own[..mr * kc], self.a.sub(ir, pc), rows, kc);
                        a_own.as_ptr()
                    } else {
                        let panel = self.shared_a.add(p * mr * self.kc_max);
                        if jc == 0 {
                            let dst = std::slice::from_raw_parts_mut(panel, mr * kc);
                            T::pack_a(dst, self.a.sub(ir, pc), rows, kc);
                        }
                        panel as *const f32
                    };
                    let c = self.c.add(ir * self.ldc + jc);
                    panel_row::<T>(panel, bp, c, self.ldc, rows, nc, kc, acc);
                    self.finished[p].store(s + 1, Ordering::Release);
                }
            }
        })
    }

    /// Waits until panel `p` has finished stage `s − 1` (another thread is computing it).
    fn wait_for(&self, p: usize, s: usize) {
        let mut spins = 0u32;
        while self.finished[p].load(Ordering::Acquire) < s {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                // Oversubscribed (more ranks than cores): let the holder run.
                std::thread::yield_now();
            }
        }
    }
}
