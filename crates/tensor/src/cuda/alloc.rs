//! The caching allocator: device memory is taken from the driver once and reused, so a
//! training step in steady state makes no driver allocation (`cuMemAlloc` synchronises the
//! device and costs tens of microseconds).
//!
//! Sizes are rounded up to a class: multiples of 512 bytes up to 1 MiB, then multiples of
//! 1/8 of the power of two below (≤ 12.5 % waste). A released block goes to the free list of
//! its class; an acquire takes a block of its class if one is free, else asks the driver. When
//! the driver is out of memory, every cached block is returned to it and the request tried
//! once more; a second failure is an error naming the request, what is live, what is free on
//! the device and what to do.
//!
//! Reuse is safe without events because every kernel runs on the one compute stream: a block
//! released after the kernels that read it were queued is only written by kernels queued later.

use super::sys::{self, CUdeviceptr};
use super::CudaError;
use std::collections::HashMap;
use std::sync::Mutex;

/// Counters of the allocator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes in blocks handed out now (rounded to their class).
    pub live: usize,
    /// Most bytes live at once.
    pub peak: usize,
    /// Bytes held in free lists.
    pub cached: usize,
    /// Driver allocations made (`cuMemAlloc` calls).
    pub driver_allocs: usize,
}

pub(crate) struct Allocator {
    lib: &'static sys::Driver,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    free: HashMap<usize, Vec<CUdeviceptr>>,
    stats: AllocStats,
}

/// The class (rounded size) of a request of `bytes`.
pub fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 1 << 20;
    let bytes = bytes.max(1);
    if bytes <= LARGE {
        return bytes.div_ceil(SMALL) * SMALL;
    }
    // 1/8 of the largest power of two not above `bytes`: at most 12.5 % rounded up.
    let step = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 8;
    bytes.div_ceil(step) * step
}

impl Allocator {
    pub(crate) fn new(lib: &'static sys::Driver) -> Allocator {
        Allocator {
            lib,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of at least `bytes` (the context must be current).
    pub(crate) fn acquire(&self, bytes: usize) -> Result<CUdeviceptr, CudaError> {
        let class = size_class(bytes);
        let mut st = self.state();
        if let Some(p) = st.free.get_mut(&class).and_then(Vec::pop) {
            st.stats.cached -= class;
            st.stats.live += class;
            st.stats.peak = st.stats.peak.max(st.stats.live);
            return Ok(p);
        }
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the caller made the context current.
        let mut r = unsafe { (self.lib.cuMemAlloc_v2)(&mut ptr, class) };
        if r == sys::CUDA_ERROR_OUT_OF_MEMORY {
            self.release_cached_locked(&mut st);
            // SAFETY: as above.
            r = unsafe { (self.lib.cuMemAlloc_v2)(&mut ptr, class) };
        }
        if r == sys::CUDA_ERROR_OUT_OF_MEMORY {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers.
            unsafe { (self.lib.cuMemGetInfo_v2)(&mut free, &mut total) };
            return Err(CudaError::OutOfMemory(format!(
                "asked for {} MiB with {} MiB live in xtrain's buffers; the device has {} MiB free of {} MiB. \
                 Lower train.micro_batch or model.seq_len, recompute activations (train.recompute = \"full\"), \
                 or shard the model over more GPUs (xtrain plan predicts what fits)",
                class >> 20,
                st.stats.live >> 20,
                free >> 20,
                total >> 20
            )));
        }
        super::driver::check(r, "cuMemAlloc")?;
        st.stats.driver_allocs += 1;
        st.stats.live += class;
        st.stats.peak = st.stats.peak.max(st.stats.live);
        Ok(ptr)
    }

    /// Returns a block of `bytes` (as asked for) to its class's free list.
    pub(crate) fn release(&self, ptr: CUdeviceptr, bytes: usize) {
        let class = size_class(bytes);
        let mut st = self.state();
        st.stats.live = st.stats.live.saturating_sub(class);
        st.stats.cached += class;
        st.free.entry(class).or_default().push(ptr);
    }

    /// Gives every cached block back to the driver.
    pub(crate) fn release_cached(&self) {
        let mut st = self.state();
        self.release_cached_locked(&mut st);
    }

    fn release_cached_locked(&self, st: &mut State) {
        for (_, ptrs) in st.free.drain() {
            for p in ptrs {
                // SAFETY: every cached pointer came from cuMemAlloc and is not in use.
                unsafe { (self.lib.cuMemFree_v2)(p) };
            }
        }
        st.stats.cached = 0;
    }

    pub(crate) fn stats(&self) -> AllocStats {
        self.state().stats
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        for bytes in [(1 << 20) + 1, 3 << 20, 100_000_000, 7 << 30] {
            let c = size_class(bytes);
            assert!(
                c >= bytes && (c - bytes) as f64 <= bytes as f64 / 8.0,
                "{bytes} -> {c}"
            );
        }
    }
}
