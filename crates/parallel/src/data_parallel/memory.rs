//! Per-rank memory accounting for data parallelism and ZeRO, and the formulas it must follow.
//!
//! For Φ parameters over N data-parallel ranks with AdamW (two moments), the model states per
//! rank are (ZeRO paper, Rajbhandari et al. 2020, §3 and Fig. 1; `Φ/N` means the padded shard
//! `ceil(Φ/N)`):
//!
//! | stage | fp32 (params 4 + grads 4 + m,v 8) | bf16-mixed (weights 2 + grads 2 + master,m,v 12) |
//! |-------|-----------------------------------|--------------------------------------------------|
//! | DDP (0) | 16Φ                             | 16Φ                                              |
//! | ZeRO-1  | 8Φ + 8Φ/N                       | 4Φ + 12Φ/N                                       |
//! | ZeRO-2  | 4Φ + 12Φ/N                      | 2Φ + 14Φ/N                                       |
//! | ZeRO-3  | 16Φ/N                           | 16Φ/N                                            |
//!
//! In fp32 the parameters are their own master copy; in bf16-mixed the fp32 master copy is
//! counted with the optimizer state (the paper's K = 12). Communication buffers (buckets, the
//! gathered blocks of ZeRO-3) and activations come on top and are reported separately.
use std::fmt;

/// Which ZeRO stage shards what (0 = plain DDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    Ddp = 0,
    One = 1,
    Two = 2,
    Three = 3,
}

impl ZeroStage {
    pub fn from_index(k: usize) -> Option<Self> {
        [Self::Ddp, Self::One, Self::Two, Self::Three]
            .get(k)
            .copied()
    }
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn shards_optimizer(self) -> bool {
        self >= Self::One
    }
    pub fn shards_grads(self) -> bool {
        self >= Self::Two
    }
    pub fn shards_params(self) -> bool {
        self >= Self::Three
    }
}

/// Numeric precision of the training state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Everything in fp32.
    Fp32,
    /// bf16 compute weights and gradients, fp32 master weights and moments.
    Bf16Mixed,
}

impl Precision {
    /// Bytes per element of the compute weights and of the gradients.
    pub fn compute_bytes(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Bf16Mixed => 2,
        }
    }
    /// Bytes per element of the optimizer state (fp32 m, v, plus the fp32 master in mixed).
    pub fn optimizer_bytes(self) -> usize {
        match self {
            Self::Fp32 => 8,
            Self::Bf16Mixed => 12,
        }
    }
}

/// Bytes per rank by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    pub comm_buffers: usize,
    pub activations: usize,
}

impl MemoryBytes {
    /// Parameters + gradients + optimizer state (what the formula covers).
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
    pub fn total(&self) -> usize {
        self.model_states() + self.comm_buffers + self.activations
    }
}

/// The formula's model-state bytes per rank for `phi` parameters over `n` ranks.
pub fn formula(phi: usize, n: usize, stage: ZeroStage, precision: Precision) -> MemoryBytes {
    let shard = phi.div_ceil(n.max(1));
    let per = |sharded: bool| if sharded { shard } else { phi };
    MemoryBytes {
        params: precision.compute_bytes() * per(stage.shards_params()),
        grads: precision.compute_bytes() * per(stage.shards_grads()),
        optimizer: precision.optimizer_bytes() * per(stage.shards_optimizer()),
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
        // bf16 weights + bf16 grads + fp32 master, m, v.
        (ZeroStage::Ddp, Precision::Bf16Mixed) => "2Φ + 2Φ + 12Φ = 16Φ",
        (ZeroStage::One, Precision::Bf16Mixed) => "2Φ + 2Φ + 12Φ/N",
        (ZeroStage::Two, Precision::Bf16Mixed) => "2Φ + 2Φ/N + 12Φ/N",
        (ZeroStage::Three, Precision::Bf16Mixed) => "2Φ/N + 2Φ/N + 12Φ/N = 16Φ/N",
    }
}

/// Human-readable byte count (MiB with two decimals).
pub fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for MemoryBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "params {} | grads {} | optimizer {} | comm buffers {} | activations {} | total {}",
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.comm_buffers),
            mib(self.activations),
            mib(self.total())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(total(ZeroStage::Ddp, Precision::Bf16Mixed), 16 * phi);
        assert_eq!(
            total(ZeroStage::One, Precision::Bf16Mixed),
            4 * phi + 12 * phi / n
        );
        assert_eq!(
            total(ZeroStage::Two, Precision::Bf16Mixed),
            2 * phi + 14 * phi / n
        );
        assert_eq!(total(ZeroStage::Three, Precision::Bf16Mixed), 16 * phi / n);
    }

    #[test]
    fn shards_are_padded() {
        // 10 params over 4 ranks: every shard holds ceil(10/4) = 3 elements.
        let m = formula(10, 4, ZeroStage::Three, Precision::Fp32);
        assert_eq!(m.model_states(), 16 * 3);
        assert_eq!(ZeroStage::from_index(2), Some(ZeroStage::Two));
        assert_eq!(ZeroStage::from_index(4), None);
    }
}
