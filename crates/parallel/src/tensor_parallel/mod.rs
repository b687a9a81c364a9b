//! Tensor parallelism (Megatron-LM style) with optional sequence parallelism.
//!
//! - [`region`]: the conjugate `f` / `g` operators at the borders of a parallel region — the
//!   only place TP / SP collectives are issued.
//! - [`linear`]: column- and row-parallel linear layers built on them.
//! - [`plan`]: which slice of each parameter a rank holds (attention by heads with GQA, MLP and
//!   MoE experts by FFN columns, vocabulary rows, replicated norms / router), layout errors,
//!   gathering shards back, syncing partial gradients.
//! - [`embedding`], [`head`]: vocab-parallel embedding and LM head fused with cross-entropy.
//! - [`shard`]: the tensor-parallel pass — one rank's shard of the decoder from all of the
//!   above (what `crate::parallelize` applies first).
//!
//! The math (which collective where, forward and backward) is in `docs/TENSOR_PARALLEL.md`.
pub mod embedding;
pub mod head;
pub mod linear;
pub mod plan;
pub mod region;
pub mod shard;

pub use embedding::VocabParallelEmbedding;
pub use head::VocabParallelHead;
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use plan::{Split, TpPlan};
pub use region::TpRegion;
pub use shard::{shard_model, shard_model_with_experts, TpShard};
