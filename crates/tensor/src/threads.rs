//! The per-process thread budget: every parallel kernel of this crate runs on one dedicated
//! rayon pool whose size is the budget, so N ranks sharing a host can each be given
//! `cores / N` threads instead of all of them oversubscribing the machine.
//!
//! The budget is read once from the environment variable `XTRAIN_THREADS` (a positive
//! integer) when first needed, defaulting to the number of available cores, and can be
//! changed at any time with [`set_thread_budget`] (work already running keeps its pool).
//!
//! Long host work that runs *beside* a training step (the delayed optimizer update) runs on a
//! second pool of the same size ([`beside`]), so that it never holds the kernels' workers.

use crate::TensorError;
use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::{Arc, OnceLock, RwLock};

/// Environment variable holding the thread budget of this process.
pub const THREADS_ENV: &str = "XTRAIN_THREADS";

fn pool_cell() -> &'static RwLock<Arc<ThreadPool>> {
    static POOL: OnceLock<RwLock<Arc<ThreadPool>>> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = budget_from_env().unwrap_or_else(default_budget);
        RwLock::new(Arc::new(
            build_pool(n).expect("building the xtrain thread pool"),
        ))
    })
}

fn default_budget() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn budget_from_env() -> Option<usize> {
    std::env::var(THREADS_ENV)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

fn build_pool(n: usize) -> Result<ThreadPool, TensorError> {
    ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("xtrain-kernel-{i}"))
        .build()
        .map_err(|e| TensorError::Threads(e.to_string()))
}

/// The pool of [`beside`], built on first use at the budget's size; [`set_thread_budget`]
/// drops it, so that the next use builds it at the new size.
fn side_cell() -> &'static RwLock<Option<Arc<ThreadPool>>> {
    static SIDE: OnceLock<RwLock<Option<Arc<ThreadPool>>>> = OnceLock::new();
    SIDE.get_or_init(|| RwLock::new(None))
}

thread_local! {
    /// Whether this thread is one of [`beside`]'s workers.
    static ON_SIDE: Cell<bool> = const { Cell::new(false) };
}

fn side_pool() -> Result<Arc<ThreadPool>, TensorError> {
    let mut cell = side_cell().write().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = cell.as_ref() {
        return Ok(pool.clone());
    }
    let pool = ThreadPoolBuilder::new()
        .num_threads(thread_budget())
        .thread_name(|i| format!("xtrain-beside-{i}"))
        .start_handler(|_| ON_SIDE.with(|on| on.set(true)))
        .build()
        .map_err(|e| TensorError::Threads(e.to_string()))?;
    Ok(cell.insert(Arc::new(pool)).clone())
}

/// Runs `f` on a pool of its own beside the kernels' (as many threads as the budget): for
/// long host work that runs while a training step's kernels go on — the delayed optimizer
/// update. On the kernels' pool it would hold every worker, and each of the step's kernels,
/// handed to that pool by [`install`] from the step's thread, would queue behind it (a rayon
/// worker takes its own tasks before work handed in from outside): the step would wait for
/// the update it was meant to overlap. [`install`] inside `f` runs inline, so `f`'s parallel
/// iterators use this pool; the two pools share the cores by the OS's scheduling.
pub fn beside<R: Send>(f: impl FnOnce() -> R + Send) -> Result<R, TensorError> {
    Ok(side_pool()?.install(f))
}

fn current_pool() -> Arc<ThreadPool> {
    pool_cell()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// Parses a thread budget as written in `XTRAIN_THREADS` (positive integer).
pub fn parse_budget(s: &str) -> Result<usize, TensorError> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(TensorError::Threads(format!(
            "{THREADS_ENV} must be a positive integer, got {s:?}"
        ))),
    }
}

/// Sets the number of threads kernels may use in this process (replaces the pool).
pub fn set_thread_budget(n: usize) -> Result<(), TensorError> {
    if n == 0 {
        return Err(TensorError::Threads("budget must be at least 1".into()));
    }
    let pool = Arc::new(build_pool(n)?);
    *pool_cell().write().unwrap_or_else(|e| e.into_inner()) = pool;
    *side_cell().write().unwrap_or_else(|e| e.into_inner()) = None;
    Ok(())
}

/// The current thread budget of this process.
pub fn thread_budget() -> usize {
    current_pool().current_num_threads()
}

/// Runs `f` inside the budgeted pool: rayon parallel iterators (and `gemm`) inside `f` use at
/// most [`thread_budget`] threads. Calling it from inside the pool just runs `f`.
///
/// Every kernel calls this, so a caller outside the pool hands each kernel to a worker and
/// waits. Callers that run many kernels in a row (a training step) should wrap the whole phase
/// instead: its kernels then run inline on one worker, with no hand-off each, and small
/// products and element-wise loops that stay on the calling thread run on that same core
/// rather than passing every activation between two cores' caches (preset small, 1 thread:
/// 7–13 % less CPU time per run, docs/PERFORMANCE.md "Training throughput against PyTorch"). Only wrap work that does
/// not wait for another thread that itself needs the pool (ranks as threads of one process
/// share it): such a wait would hold a worker that the other thread needs. On a worker of
/// [`beside`]'s pool it runs `f` there.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = current_pool();
    if pool.current_thread_index().is_some() || ON_SIDE.with(|on| on.get()) {
        // Already on one of this pool's workers (or the side pool's): run directly, no
        // re-entry.
        f()
    } else {
        // The worker runs with the caller's GPU operand format.
        let operands = crate::operands::current();
        pool.install(move || {
            let _scope = crate::operands::Scope::enter(operands);
            f()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    #[test]
    fn sum_chunks_covers_every_element_once_in_chunk_order() {
        for len in [0, 1, 63, 64, 65, 1000] {
            // Each chunk's partial names its range, so a gap, an overlap or a short last
            // chunk changes the sum.
            let f = |r: std::ops::Range<usize>| r.map(|i| (i * i) as f64).sum::<f64>() + 0.5;
            let expected = (0..len)
                .step_by(64)
                .map(|s| f(s..(s + 64).min(len)))
                .fold(0.0, |t, p| t + p);
            assert_eq!(sum_chunks(len, 64, f), expected, "len {len}");
        }
    }

    #[test]
    fn budget_is_respected() {
        for n in [1usize, 3, 2] {
            set_thread_budget(n).unwrap();
            assert_eq!(thread_budget(), n);
            let seen = Mutex::new(HashSet::new());
            let inside = install(|| {
                (0..2000).into_par_iter().for_each(|_| {
                    seen.lock().unwrap().insert(std::thread::current().id());
                    std::hint::black_box((0..200).sum::<u64>());
                });
                rayon::current_num_threads()
            });
            assert_eq!(inside, n);
            let distinct = seen.lock().unwrap().len();
            assert!(distinct <= n, "{distinct} threads used with budget {n}");
        }
        assert!(set_thread_budget(0).is_err());
        assert!(parse_budget("0").is_err());
        assert!(parse_budget("x").is_err());
        assert_eq!(parse_budget(" 4 ").unwrap(), 4);
        // Nested install does not deadlock.
        assert_eq!(install(|| install(|| 7)), 7);
    }

    /// Work beside the kernels never holds them up: while every worker of the side pool waits
    /// for a flag, a kernel handed to the budget pool runs and sets it. (On one pool the kernel
    /// would queue behind the waiters, which give up after 30 s and fail the test.) Kernels
    /// called inside the side work run on its pool.
    #[test]
    fn work_beside_the_kernels_never_holds_them_up() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::time::{Duration, Instant};
        let (flag, waiting, size) = (
            AtomicBool::new(false),
            AtomicUsize::new(0),
            AtomicUsize::new(0),
        );
        let patience = Duration::from_secs(30);
        std::thread::scope(|s| {
            let side = s.spawn(|| {
                beside(|| {
                    size.store(rayon::current_num_threads(), Ordering::SeqCst);
                    let on_side = install(|| std::thread::current().name().map(str::to_owned));
                    let n = rayon::current_num_threads();
                    let set = (0..4 * n).into_par_iter().all(|_| {
                        waiting.fetch_add(1, Ordering::SeqCst);
                        let start = Instant::now();
                        while !flag.load(Ordering::SeqCst) && start.elapsed() < patience {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        flag.load(Ordering::SeqCst)
                    });
                    (set, on_side)
                })
                .unwrap()
            });
            // Once every side worker waits, hand a kernel to the budget pool.
            let start = Instant::now();
            while (size.load(Ordering::SeqCst) == 0
                || waiting.load(Ordering::SeqCst) < size.load(Ordering::SeqCst))
                && start.elapsed() < patience
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            install(|| flag.store(true, Ordering::SeqCst));
            let (set, on_side) = side.join().unwrap();
            assert!(set, "the kernel waited for the work beside it");
            assert!(
                on_side.is_some_and(|name| name.starts_with("xtrain-beside-")),
                "a kernel inside the side work runs on its pool"
            );
        });
    }
}

/// Below this many floats (256 KiB) [`zeros`], [`add_assign`] and [`scale`] stay on the
/// calling thread.
const PARALLEL_MIN_LEN: usize = 1 << 16;
/// Elements per task of those element-wise loops.
const PARALLEL_CHUNK: usize = PARALLEL_MIN_LEN / 4;

/// Whether an element-wise loop over `len` floats is worth the pool.
fn worth_parallel(len: usize) -> bool {
    len >= PARALLEL_MIN_LEN && thread_budget() >= 2
}

/// `Σ f(chunk)` over `0..len` cut into chunks of `chunk` elements: the partials are computed on
/// the budget pool and added in chunk order, so the sum is the same, bit for bit, at any thread
/// count and however rayon splits the work (a parallel `.sum()` would add in split order).
pub fn sum_chunks(len: usize, chunk: usize, f: impl Fn(Range<usize>) -> f64 + Sync) -> f64 {
    let partials: Vec<f64> = install(|| {
        (0..len.div_ceil(chunk))
            .into_par_iter()
            .map(|c| f(c * chunk..((c + 1) * chunk).min(len)))
            .collect()
    });
    partials.iter().fold(0.0, |total, p| total + p)
}

/// A vector of `n` zeros, filled in parallel over the thread budget when large. A training
/// process reuses freed heap pages (see `train::allocator`), so `vec![0.0; n]` is a `memset`
/// on the calling thread; for the activation and gradient buffers of a step that serial fill
/// measured ≈ 4–5 % of a 2-thread step (preset small).
pub fn zeros(n: usize) -> Vec<f32> {
    if !worth_parallel(n) {
        return vec![0.0; n];
    }
    let mut v: Vec<f32> = Vec::with_capacity(n);
    install(|| {
        v.spare_capacity_mut()[..n]
            .par_chunks_mut(PARALLEL_CHUNK)
            .for_each(|chunk| {
                chunk.fill(std::mem::MaybeUninit::new(0.0));
            });
    });
    // SAFETY: the first n elements were initialised above (every chunk of the first n
    // spare slots was written).
    unsafe { v.set_len(n) };
    v
}

/// `K` new vectors of `lens[i]` floats, written in parallel over the thread budget with no
/// zero fill first (a fill would be one more pass over memory that the kernel then overwrites:
/// ≈ 2–3 % of a small 1-thread step for the SwiGLU and RMSNorm outputs). Task `t` of
/// `lens[0].div_ceil(chunks[0])` calls `write(t, outs)` where `outs[i]` is chunk `t` of vector
/// `i` (`chunks[i]` elements, the last one possibly shorter), so one task can write matching
/// pieces of several outputs (e.g. the rows of a norm and their `rstd`).
///
/// # Panics
/// If a chunk length is 0 or the vectors do not split into the same number of chunks.
///
/// # Safety
/// `write` must write every element of every slice it is given (a panic inside `write` is
/// fine: the vectors are then dropped unread).
pub(crate) unsafe fn new_written<const K: usize>(
    lens: [usize; K],
    chunks: [usize; K],
    write: impl Fn(usize, [&mut [MaybeUninit<f32>]; K]) + Sync,
) -> [Vec<f32>; K] {
    assert!(
        K > 0 && chunks.iter().all(|&c| c > 0),
        "new_written: chunks"
    );
    let tasks = lens[0].div_ceil(chunks[0]);
    assert!(
        lens.iter()
            .zip(&chunks)
            .all(|(l, c)| l.div_ceil(*c) == tasks),
        "new_written: the outputs split into different numbers of chunks"
    );
    let mut vecs: [Vec<f32>; K] = std::array::from_fn(|i| Vec::with_capacity(lens[i]));
    let ptrs: [SyncPtr; K] = std::array::from_fn(|i| SyncPtr(vecs[i].as_mut_ptr()));
    install(|| {
        (0..tasks).into_par_iter().for_each(|t| {
            let outs = std::array::from_fn(|i| {
                let start = t * chunks[i];
                let len = chunks[i].min(lens[i] - start);
                // SAFETY: chunk t of vector i lies inside its capacity (start + len <=
                // lens[i]) and no other task addresses it.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        ptrs[i].get().add(start).cast::<MaybeUninit<f32>>(),
                        len,
                    )
                }
            });
            write(t, outs);
        })
    });
    for (v, &len) in vecs.iter_mut().zip(&lens) {
        // SAFETY: every chunk of the first `len` elements was written (the caller's contract).
        unsafe { v.set_len(len) };
    }
    vecs
}

/// A raw pointer that may be shared with pool tasks writing disjoint parts of one buffer;
/// every use documents why the tasks touch disjoint elements and that the pointee outlives
/// them.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: see the type's doc.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `dst[i] += src[i]` (residual sums, gradient accumulation), in parallel over the thread
/// budget when large; element-wise, so the result does not depend on the split.
///
/// # Panics
/// If the lengths differ (a caller bug).
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "add_assign lengths");
    let add = |(d, s): (&mut [f32], &[f32])| d.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    if !worth_parallel(dst.len()) {
        return add((dst, src));
    }
    install(|| {
        dst.par_chunks_mut(PARALLEL_CHUNK)
            .zip(src.par_chunks(PARALLEL_CHUNK))
            .for_each(add)
    });
}

/// `dst[i] *= factor` for every element; `factor = 0` zero-fills. In parallel over the thread
/// budget when large (gradient clipping and zeroing touch every gradient each step).
pub fn scale(dst: &mut [f32], factor: f32) {
    let apply = |d: &mut [f32]| {
        if factor == 0.0 {
            d.fill(0.0)
        } else {
            d.iter_mut().for_each(|x| *x *= factor)
        }
    };
    if !worth_parallel(dst.len()) {
        return apply(dst);
    }
    install(|| dst.par_chunks_mut(PARALLEL_CHUNK).for_each(apply));
}

#[cfg(test)]
mod zeros_tests {
    #[test]
    fn scale_and_zero() {
        let n = super::PARALLEL_MIN_LEN + 9;
        let mut v: Vec<f32> = (0..n).map(|i| i as f32).collect();
        super::scale(&mut v, 0.5);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32 * 0.5));
        v[0] = f32::NAN;
        super::scale(&mut v, 0.0);
        assert!(v.iter().all(|&x| x == 0.0), "a zero fill, NaNs included");
    }

    #[test]
    fn add_assign_matches_serial() {
        for n in [0, 5, super::PARALLEL_MIN_LEN + 3] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
            let mut got = a.clone();
            super::add_assign(&mut got, &b);
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn new_written_hands_out_matching_disjoint_chunks() {
        for rows in [0usize, 1, 5, 40] {
            let dim = 3;
            // SAFETY: every element of both chunks is written.
            let [y, r] = unsafe {
                super::new_written([rows * dim, rows], [dim * 4, 4], |t, [y, r]| {
                    for (i, v) in y.iter_mut().enumerate() {
                        v.write((t * 4 * dim + i) as f32);
                    }
                    r.iter_mut().enumerate().for_each(|(i, v)| {
                        v.write(-((t * 4 + i) as f32));
                    });
                })
            };
            assert_eq!(y, (0..rows * dim).map(|i| i as f32).collect::<Vec<_>>());
            assert_eq!(r, (0..rows).map(|i| -(i as f32)).collect::<Vec<_>>());
        }
    }

    #[test]
    #[should_panic(expected = "different numbers of chunks")]
    fn new_written_rejects_mismatched_chunks() {
        // SAFETY: never reaches `write`.
        let _ = unsafe { super::new_written([10, 10], [5, 2], |_, _| {}) };
    }

    #[test]
    fn zeros_small_and_large() {
        for n in [
            0,
            1,
            1000,
            super::PARALLEL_MIN_LEN + 7,
            3 * super::PARALLEL_MIN_LEN,
        ] {
            let v = super::zeros(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
        }
    }
}
