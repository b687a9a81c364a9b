//! Data parallelism: DDP and ZeRO-1/2/3 over the dp × cp group. The executor
//! (`crate::executor`) runs it; this folder holds its parts:
//!
//! - [`ZeroStage`]: what is sharded;
//! - [`shard`]: equal padded ranges of a flat buffer (ZeRO partitioning);
//! - [`bucket`]: gradient buckets in reverse layer order and their readiness during backward;
//! - [`grad_comm`]: the wire format of the gradient reductions (fp32, or bf16 / fp8 summed in
//!   fp32, or PowerSGD); [`powersgd`]: low-rank compression with error feedback;
//! - [`sampler`]: which samples of a global batch each dp rank reads;
//! - [`crate::nccl`]: its reductions and gathers on NCCL for ranks with a GPU each
//!   (`XTRAIN_BACKEND=nccl`).
//!
//! Design notes: `docs/DATA_PARALLEL.md`.
pub mod bucket;
pub mod grad_comm;
pub mod powersgd;
pub mod sampler;
pub mod shard;

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
    /// AdamW moments (and the fp32 master copy) are sharded.
    pub fn shards_optimizer(self) -> bool {
        self >= Self::One
    }
    /// Gradients are reduce-scattered into shards.
    pub fn shards_grads(self) -> bool {
        self >= Self::Two
    }
    /// Parameters are sharded and gathered unit by unit.
    pub fn shards_params(self) -> bool {
        self >= Self::Three
    }
}
