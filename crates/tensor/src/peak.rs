//! The machine's f32 arithmetic ceiling, measured: the FMA throughput of a loop that touches
//! no memory, on `threads` cores at once.
//!
//! Utilisation figures need a denominator. `xtrain bench train` reports MFU against the
//! measured GEMM rate (what a step could reach if it were all products); this module gives the
//! hardware's: 2 flops per lane per FMA, as many FMAs per cycle as the cores issue, at the
//! clock they run now. On a VM whose cores change speed from minute to minute (other guests
//! on the same host), measuring it next to a benchmark tells whether a slow figure is the code
//! or the machine; and a target above `threads ×` the per-core ceiling cannot be met by any
//! fp32 FMA code.
//!
//! The loop: `CHAINS` independent accumulators `acc = acc·x + y` (one fused multiply-add
//! each), enough to cover the FMA latency on every FMA port (4 cycles × 2 ports needs 8 in
//! flight), with all operands in registers.

use std::time::Instant;

/// Independent accumulator chains per thread with AVX-512 (vector registers; 32 hold 24
/// chains, `x` and `y`).
const CHAINS: usize = 24;

/// Chains with AVX2 (16 `ymm` registers hold 12 chains, `x` and `y`; 12 cover the latency of
/// 2 FMA ports × 4–5 cycles).
const CHAINS_AVX2: usize = 12;

/// FMA steps per timed run: 24 chains × 2²⁰ steps × 16 lanes × 2 flops ≈ 0.8 GFLOP per thread
/// with AVX-512 (about 8 ms on a 100 GFLOP/s core).
const STEPS: usize = 1 << 20;

/// Timed runs; the best one counts (the first ones also bring the cores to their vector clock).
const RUNS: usize = 5;

/// Measured f32 FMA peak of `threads` threads running at once, in flop/s, on the kernel path
/// in use (AVX-512 or AVX2 + FMA), or `None` on the portable path.
pub fn fma_peak_flops(threads: usize) -> Option<f64> {
    let threads = threads.max(1);
    let lanes = lanes_per_step()?;
    let flops_per_thread = (STEPS * lanes * 2) as f64;
    let mut best = f64::MAX;
    for _ in 0..RUNS {
        // Each worker times its own loop (a timer on the spawning thread would also count
        // that thread's scheduling); a run lasts from the first start to the last end.
        let start = std::sync::Barrier::new(threads);
        let spans: Vec<Option<(Instant, Instant)>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let t0 = Instant::now();
                        std::hint::black_box(fma_chains(STEPS, 1.0, 0.0));
                        (t0, Instant::now())
                    })
                })
                .collect();
            // A worker cannot panic (no allocation, no indexing); were one to, its run is
            // simply not counted.
            workers.into_iter().map(|w| w.join().ok()).collect()
        });
        let spans: Option<Vec<_>> = spans.into_iter().collect();
        if let Some(spans) = spans {
            let first = spans.iter().map(|s| s.0).min()?;
            let last = spans.iter().map(|s| s.1).max()?;
            best = best.min((last - first).as_secs_f64());
        }
    }
    Some(threads as f64 * flops_per_thread / best.max(1e-9))
}

/// f32 lanes over all chains of one step of the FMA loop on the kernel path in use
/// ([`crate::isa::active`]: 16-lane `zmm` or 8-lane `ymm` chains), or `None` on the portable
/// path.
fn lanes_per_step() -> Option<usize> {
    match crate::isa::active() {
        crate::isa::Isa::Avx512 => Some(CHAINS * 16),
        crate::isa::Isa::Avx2 => Some(CHAINS_AVX2 * 8),
        crate::isa::Isa::Portable => None,
    }
}

/// Runs `steps` FMA steps on every chain from `acc = 0` with `acc = acc·x + y` and returns the
/// sum of all lanes of all chains (so the work cannot be skipped, and tests can check it ran).
/// Returns 0 on the portable path.
fn fma_chains(steps: usize, x: f32, y: f32) -> f32 {
    // SAFETY: the active path is one this CPU supports.
    match crate::isa::active() {
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx512 => unsafe { x86::chains_avx512(steps, x, y) },
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx2 => unsafe { x86::chains_avx2(steps, x, y) },
        _ => {
            let _ = (steps, x, y);
            0.0
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{CHAINS, CHAINS_AVX2};
    use std::arch::x86_64::*;

    /// [`chains_avx512`] on 8-lane `ymm` registers: `CHAINS_AVX2` FMAs per step.
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chains_avx2(steps: usize, x: f32, y: f32) -> f32 {
        let mut acc = [_mm256_setzero_ps(); CHAINS_AVX2];
        if steps > 0 {
            std::arch::asm!(
                "2:",
                "vfmadd213ps ymm0, ymm12, ymm13",
                "vfmadd213ps ymm1, ymm12, ymm13",
                "vfmadd213ps ymm2, ymm12, ymm13",
                "vfmadd213ps ymm3, ymm12, ymm13",
                "vfmadd213ps ymm4, ymm12, ymm13",
                "vfmadd213ps ymm5, ymm12, ymm13",
                "vfmadd213ps ymm6, ymm12, ymm13",
                "vfmadd213ps ymm7, ymm12, ymm13",
                "vfmadd213ps ymm8, ymm12, ymm13",
                "vfmadd213ps ymm9, ymm12, ymm13",
                "vfmadd213ps ymm10, ymm12, ymm13",
                "vfmadd213ps ymm11, ymm12, ymm13",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) steps => _,
                in("ymm12") _mm256_set1_ps(x),
                in("ymm13") _mm256_set1_ps(y),
                inout("ymm0") acc[0],
                inout("ymm1") acc[1],
                inout("ymm2") acc[2],
                inout("ymm3") acc[3],
                inout("ymm4") acc[4],
                inout("ymm5") acc[5],
                inout("ymm6") acc[6],
                inout("ymm7") acc[7],
                inout("ymm8") acc[8],
                inout("ymm9") acc[9],
                inout("ymm10") acc[10],
                inout("ymm11") acc[11],
                options(nomem, nostack),
            );
        }
        let mut lanes = [0.0f32; 8];
        acc.iter()
            .map(|&a| {
                _mm256_storeu_ps(lanes.as_mut_ptr(), a);
                lanes.iter().sum::<f32>()
            })
            .sum()
    }

    /// The loop is assembly so that the compiler can neither merge the identical chains nor
    /// spill them: exactly `CHAINS` register-to-register FMAs per step.
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chains_avx512(steps: usize, x: f32, y: f32) -> f32 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        if steps > 0 {
            std::arch::asm!(
                "2:",
                "vfmadd213ps zmm0, zmm24, zmm25",
                "vfmadd213ps zmm1, zmm24, zmm25",
                "vfmadd213ps zmm2, zmm24, zmm25",
                "vfmadd213ps zmm3, zmm24, zmm25",
                "vfmadd213ps zmm4, zmm24, zmm25",
                "vfmadd213ps zmm5, zmm24, zmm25",
                "vfmadd213ps zmm6, zmm24, zmm25",
                "vfmadd213ps zmm7, zmm24, zmm25",
                "vfmadd213ps zmm8, zmm24, zmm25",
                "vfmadd213ps zmm9, zmm24, zmm25",
                "vfmadd213ps zmm10, zmm24, zmm25",
                "vfmadd213ps zmm11, zmm24, zmm25",
                "vfmadd213ps zmm12, zmm24, zmm25",
                "vfmadd213ps zmm13, zmm24, zmm25",
                "vfmadd213ps zmm14, zmm24, zmm25",
                "vfmadd213ps zmm15, zmm24, zmm25",
                "vfmadd213ps zmm16, zmm24, zmm25",
                "vfmadd213ps zmm17, zmm24, zmm25",
                "vfmadd213ps zmm18, zmm24, zmm25",
                "vfmadd213ps zmm19, zmm24, zmm25",
                "vfmadd213ps zmm20, zmm24, zmm25",
                "vfmadd213ps zmm21, zmm24, zmm25",
                "vfmadd213ps zmm22, zmm24, zmm25",
                "vfmadd213ps zmm23, zmm24, zmm25",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) steps => _,
                in("zmm24") _mm512_set1_ps(x),
                in("zmm25") _mm512_set1_ps(y),
            inout("zmm0") acc[0],
            inout("zmm1") acc[1],
            inout("zmm2") acc[2],
            inout("zmm3") acc[3],
            inout("zmm4") acc[4],
            inout("zmm5") acc[5],
            inout("zmm6") acc[6],
            inout("zmm7") acc[7],
            inout("zmm8") acc[8],
            inout("zmm9") acc[9],
            inout("zmm10") acc[10],
            inout("zmm11") acc[11],
            inout("zmm12") acc[12],
            inout("zmm13") acc[13],
            inout("zmm14") acc[14],
            inout("zmm15") acc[15],
            inout("zmm16") acc[16],
            inout("zmm17") acc[17],
            inout("zmm18") acc[18],
            inout("zmm19") acc[19],
            inout("zmm20") acc[20],
            inout("zmm21") acc[21],
            inout("zmm22") acc[22],
            inout("zmm23") acc[23],
                options(nomem, nostack),
            );
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_runs_every_step_on_every_lane() {
        // acc = acc·1 + 1 counts the steps exactly (integers below 2²⁴ are exact in f32), so
        // a loop that skipped steps, chains or lanes would give a smaller sum.
        let Some(lanes) = lanes_per_step() else {
            return;
        };
        let steps = 1000;
        let sum = fma_chains(steps, 1.0, 1.0);
        assert_eq!(sum, (steps * lanes) as f32);
        // And it multiplies: acc = acc·2 + 1 after 3 steps is 7 in every lane.
        assert_eq!(fma_chains(3, 2.0, 1.0), (7 * lanes) as f32);
    }

    #[test]
    fn the_peak_is_reported_where_there_is_vector_fma() {
        match (lanes_per_step(), fma_peak_flops(1)) {
            (Some(_), Some(p)) => assert!(p.is_finite() && p > 1e9, "implausible peak {p}"),
            (None, None) => {}
            other => panic!("lanes and peak disagree: {other:?}"),
        }
    }
}
