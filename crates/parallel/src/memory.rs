//! Per-rank memory accounting, and the formulas it must follow.
//!
//! For Φ parameters on a rank (its tensor- or pipeline-parallel part of the model) over N
//! data-parallel ranks with AdamW (two moments), the model states per rank are (ZeRO paper,
//! Rajbhandari et al. 2020, §3 and Fig. 1; `Φ/N` means the padded shard `ceil(Φ/N)`):
//!
//! | stage | fp32 (params 4 + grads 4 + m,v 8) | bf16/fp16 (weights 2 + grads 2 + master 4 + m,v 8) |
//! |-------|-----------------------------------|----------------------------------------------------|
//! | DDP (0) | 16Φ                             | 2Φ + 2Φ + 12Φ = 16Φ                                |
//! | ZeRO-1  | 8Φ + 8Φ/N                       | 2Φ + 2Φ + 12Φ/N                                    |
//! | ZeRO-2  | 4Φ + 12Φ/N                      | 2Φ + 2Φ/N + 12Φ/N                                  |
//! | ZeRO-3  | 16Φ/N                           | 16Φ/N                                              |
//!
//! In fp32 the parameters are their own master copy; in 16-bit training the fp32 master copy
//! is sharded with the optimizer state (the paper's K = 12). Communication buffers (buckets,
//! the gathered units of ZeRO-3) and activations come on top and are reported separately.
use std::fmt;

use serde::Serialize;

use crate::data_parallel::ZeroStage;
use crate::precision::Precision;

/// Bytes per rank by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryAccount {
    /// Compute weights (fp32, or 16-bit beside the master copy).
    pub params: usize,
    /// Gradients in the compute precision.
    pub grads: usize,
    /// fp32 master weights (16-bit training only).
    pub master: usize,
    /// AdamW first and second moments (fp32).
    pub optimizer: usize,
    /// Peak of gradient buckets in flight, ZeRO-3's gathered units and widened 16-bit units.
    pub comm_buffers: usize,
    /// Peak of the activations kept for backward.
    pub activations: usize,
}

impl MemoryAccount {
    /// Parameters + gradients + master + optimizer state (what the formula covers).
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.master + self.optimizer
    }
    pub fn total(&self) -> usize {
        self.model_states() + self.comm_buffers + self.activations
    }
    /// Element-wise sum (e.g. over the ranks of a job).
    pub fn plus(&self, o: &Self) -> Self {
        MemoryAccount {
            params: self.params + o.params,
            grads: self.grads + o.grads,
            master: self.master + o.master,
            optimizer: self.optimizer + o.optimizer,
            comm_buffers: self.comm_buffers + o.comm_buffers,
            activations: self.activations + o.activations,
        }
    }
    /// As six numbers (params, grads, master, optimizer, comm buffers, activations), for
    /// gathering over ranks.
    pub fn to_array(&self) -> [i64; 6] {
        [
            self.params,
            self.grads,
            self.master,
            self.optimizer,
            self.comm_buffers,
            self.activations,
        ]
        .map(|x| x as i64)
    }
    pub fn from_array(a: &[i64]) -> Self {
        let v = |i: usize| a[i].max(0) as usize;
        MemoryAccount {
            params: v(0),
            grads: v(1),
            master: v(2),
            optimizer: v(3),
            comm_buffers: v(4),
            activations: v(5),
        }
    }
}

/// The formula's model-state bytes per rank for `phi` parameters over `n` ranks.
pub fn formula(phi: usize, n: usize, stage: ZeroStage, precision: Precision) -> MemoryAccount {
    let shard = phi.div_ceil(n.max(1));
    let per = |sharded: bool| if sharded { shard } else { phi };
    MemoryAccount {
        params: precision.compute_bytes() * per(stage.shards_params()),
        grads: precision.compute_bytes() * per(stage.shards_grads()),
        master: precision.master_bytes() * per(stage.shards_optimizer()),
        optimizer: 8 * per(stage.shards_optimizer()),
        comm_buffers: 0,
        activations: 0,
    }
}

/// The formula in words, e.g. `"4Φ + 12Φ/N"`, for printing beside the numbers.
pub fn formula_text(stage: ZeroStage, precision: Precision) -> &'static str {
    match (stage, precision) {
        (ZeroStage::Ddp, Precision::Fp32) => "16Φ",
        (ZeroStage::One, Precision::Fp32) => "8Φ + 8Φ/N",
        (ZeroStage::Two, Precision::Fp32) => "4Φ + 12Φ/N",
        (ZeroStage::Three, Precision::Fp32) => "16Φ/N",
        // 16-bit weights + 16-bit grads + fp32 master, m, v.
        (ZeroStage::Ddp, _) => "2Φ + 2Φ + 12Φ = 16Φ",
        (ZeroStage::One, _) => "2Φ + 2Φ + 12Φ/N",
        (ZeroStage::Two, _) => "2Φ + 2Φ/N + 12Φ/N",
        (ZeroStage::Three, _) => "2Φ/N + 2Φ/N + 12Φ/N = 16Φ/N",
    }
}

/// Bytes in binary units (`1.50 KiB`).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A size of this process in bytes from `/proc/self/status` (`VmHWM:` the peak resident set,
/// `VmRSS:` the current one); `None` off Linux.
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak resident set size of this process.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// A memory a rank's model states go to, as it is before the run allocates them: the host's
/// (with swap) or a GPU's, and how many ranks' states it must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Named in the error: `host memory`, `GPU 0 (NVIDIA H200)`.
    pub place: String,
    /// Bytes free now.
    pub free: u64,
    /// Bytes it has in all.
    pub total: u64,
    /// Ranks whose model states it holds (this one included): the processes or threads of
    /// the host, the ranks sharing the GPU.
    pub ranks: usize,
}

impl Capacity {
    /// This host's memory with its swap (`/proc/meminfo`: `MemAvailable` + `SwapFree` free,
    /// `MemTotal` + `SwapTotal` in all), for `ranks` ranks; `None` where it cannot be read.
    pub fn host(ranks: usize) -> Option<Capacity> {
        Capacity::from_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?, ranks)
    }

    fn from_meminfo(text: &str, ranks: usize) -> Option<Capacity> {
        let kib = |field: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        };
        let swap = |field| kib(field).unwrap_or(0);
        Some(Capacity {
            place: "host memory".into(),
            free: (kib("MemAvailable:")? + swap("SwapFree:")) * 1024,
            total: (kib("MemTotal:")? + swap("SwapTotal:")) * 1024,
            ranks,
        })
    }
}

/// Refuses a rank's model states (`states` bytes; `what` says what they are) that cannot fit
/// `cap`: more than it has free now, or, times the ranks it holds, more than it has in all.
/// Activations and buffers come on top, so passing promises nothing; a refusal is certain
/// to have been an out-of-memory failure (or a kill) later.
pub fn check_states_fit(
    rank: usize,
    states: u64,
    what: &str,
    cap: &Capacity,
) -> Result<(), crate::ParallelError> {
    let all = states.saturating_mul(cap.ranks as u64);
    let short = if states > cap.free {
        format!("{} has {} free", cap.place, human(cap.free))
    } else if all > cap.total {
        format!(
            "{} ranks share {} ({} in all): {} × {} = {}",
            cap.ranks,
            cap.place,
            human(cap.total),
            cap.ranks,
            human(states),
            human(all)
        )
    } else {
        return Ok(());
    };
    Err(crate::ParallelError::Config(format!(
        "rank {rank}: the model states need {} in {} ({what}), but {short}. Raise the ZeRO stage \
         (parallel.zero), add ranks, offload the optimizer (--offload optimizer) or shrink the \
         model; `xtrain plan` predicts what fits",
        human(states),
        cap.place
    )))
}

impl fmt::Display for MemoryAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = |b: usize| human(b as u64);
        write!(
            f,
            "params {} + grads {} + master {} + adam m,v {} + comm buffers {} + activations {} = {}",
            h(self.params),
            h(self.grads),
            h(self.master),
            h(self.optimizer),
            h(self.comm_buffers),
            h(self.activations),
            h(self.total())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_that_cannot_fit_are_refused_naming_rank_and_figures() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\nSwapTotal:     1000000 kB\nSwapFree:       500000 kB\n";
        let cap = Capacity::from_meminfo(meminfo, 2).unwrap();
        assert_eq!(cap.free, 20_500_000 * 1024);
        assert_eq!(cap.total, 25_000_000 * 1024);
        // Fits alone and twice.
        check_states_fit(1, 10_000_000_000, "16Φ", &cap).unwrap();
        // More than is free now.
        let e = check_states_fit(1, 22_000_000_000, "16Φ", &cap)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1: the model states need 20.49 GiB in host memory"),
            "{e}"
        );
        assert!(
            e.contains("host memory has 19.55 GiB free") && e.contains("16Φ"),
            "{e}"
        );
        // Free now, but not for both ranks.
        let e = check_states_fit(0, 14_000_000_000, "16Φ", &cap)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0") && e.contains("2 ranks share host memory"),
            "{e}"
        );
        assert!(e.contains("2 × 13.04 GiB = 26.08 GiB"), "{e}");
        // No swap lines: memory alone; no MemAvailable: unknown.
        let no_swap = Capacity::from_meminfo("MemTotal: 100 kB\nMemAvailable: 50 kB\n", 1);
        assert_eq!(no_swap.map(|c| (c.free, c.total)), Some((51_200, 102_400)));
        assert_eq!(Capacity::from_meminfo("MemTotal: 100 kB\n", 1), None);
    }

    #[test]
    fn formulas_match_the_zero_paper() {
        let (phi, n) = (1000, 4);
        let total = |s, p| formula(phi, n, s, p).model_states();
        assert_eq!(total(ZeroStage::Ddp, Precision::Fp32), 16 * phi);
        assert_eq!(
            total(ZeroStage::One, Precision::Fp32),
            8 * phi + 8 * phi / n
        );
        assert_eq!(
            total(ZeroStage::Two, Precision::Fp32),
            4 * phi + 12 * phi / n
        );
        assert_eq!(total(ZeroStage::Three, Precision::Fp32), 16 * phi / n);
        for p in [Precision::Bf16, Precision::Fp16] {
            assert_eq!(total(ZeroStage::Ddp, p), 16 * phi);
            assert_eq!(total(ZeroStage::One, p), 4 * phi + 12 * phi / n);
            assert_eq!(total(ZeroStage::Two, p), 2 * phi + 14 * phi / n);
            assert_eq!(total(ZeroStage::Three, p), 16 * phi / n);
        }
    }

    #[test]
    fn shards_are_padded() {
        // 10 params over 4 ranks: every shard holds ceil(10/4) = 3 elements.
        let m = formula(10, 4, ZeroStage::Three, Precision::Fp32);
        assert_eq!(m.model_states(), 16 * 3);
        assert_eq!(human(1536), "1.50 KiB");
    }
}
