//! Allocator tuning for a training process. Each step allocates and frees the same large
//! activation caches and scratch; with glibc's defaults every buffer above the adaptive mmap
//! threshold is a fresh `mmap` that faults in (and zeroes) its pages again each step, and the
//! freed heap top (all activations, once backward has consumed them) is trimmed back to the
//! OS, so the next forward faults it in again. Measured (`perf stat -e page-faults xtrain
//! bench train --preset P --threads T --steps S`): small, 1 thread, 4 steps 298 k → 86 k minor
//! faults (system time 0.73 → 0.22 s); small, 2 threads 300 k → 90 k; medium, 2 threads,
//! 2 steps 722 k → 335 k (system time per 3-step run 2.7 → 1.5 s), peak RSS 1.08× the account
//! either way (the peak already held these pages). Medium's remaining faults are buffers above
//! glibc's 32 MiB ceiling for the threshold, which stay mmapped.

/// Serve allocations below 32 MiB (glibc's maximum threshold) from the heap and never trim
/// less than 1 GiB of freed heap top, so each step reuses the previous step's pages (the
/// resident set stays at the step's peak between steps). No effect off glibc.
pub fn reuse_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; both parameters take byte counts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
