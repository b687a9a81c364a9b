//! Allocator tuning for a training process. Each step allocates and frees the same large
//! activation caches and scratch; with glibc's defaults every buffer above the adaptive mmap
//! threshold is a fresh `mmap` that faults in (and zeroes) its pages again each step, and the
//! freed heap top (all activations, once backward has consumed them) is trimmed back to the
//! OS, so the next forward faults it in again. Measured (`perf stat -e page-faults xtrain
//! bench train --preset P --threads T --steps S`): small, 1 thread, 4 steps 298 k → 86 k minor
//! faults (system time 0.73 → 0.22 s); small, 2 threads 300 k → 90 k; medium, 2 threads,
//! 2 steps 722 k → 335 k (system time per 3-step run 2.7 → 1.5 s), peak RSS 1.08× the account
//! either way (the peak already held these pages). Medium's remaining faults are buffers above
//! glibc's 32 MiB ceiling for the threshold, which stay mmapped; of those, a 16-bit run's
//! widened fp32 copies of each unit's weights and gradients are kept from one layer to the
//! next by the executor instead (`parallel::executor`'s `Spare`). [`use_one_arena`] keeps the
//! pool worker that runs the step and the main thread in one arena, so they share those pages.

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

/// Keeps every thread's heap allocations in glibc's one main arena, unless the user chose
/// otherwise (`MALLOC_ARENA_MAX` or `GLIBC_TUNABLES`). Call it once, before threads start.
///
/// Why: the trainer runs each forward/backward on a pool worker (`tensor::threads::install`),
/// and glibc gives every thread that allocates its own arena. A second arena keeps what the
/// activations freed in its own 64 MiB heaps, which the main arena's allocations (optimizer,
/// gradients, data) cannot reuse, so the process holds roughly two copies of the activation
/// peak: medium preset, 2 threads, peak RSS 1.67× the account with per-thread arenas against
/// 1.07–1.10× with one (docs/PERFORMANCE.md, "Peak RSS against the byte account"). Our allocations are few and large,
/// so one arena costs no measurable lock contention.
pub fn use_one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let user_chose = std::env::var_os("MALLOC_ARENA_MAX").is_some()
            || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"));
        if !user_chose {
            // SAFETY: mallopt only changes allocator parameters; M_ARENA_MAX is a valid option.
            unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
        }
    }
}
