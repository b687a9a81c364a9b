//! Tensor parallelism (Megatron-LM style) with optional sequence parallelism.
//!
//! - [`region`]: the conjugate `f` / `g` operators at the borders of a parallel region — the
//!   only place TP / SP collectives are issued.
//! - [`linear`]: column- and row-parallel linear layers built on them.
//! - [`plan`]: which slice of each parameter a rank holds (attention by heads with GQA, MLP and
//!   MoE experts by FFN columns, vocabulary rows, replicated norms / router), layout errors,
//!   gathering shards back, resharding to another tp size, syncing partial gradients.
//! - [`embedding`], [`head`]: vocab-parallel embedding and LM head fused with cross-entropy.
//! - [`model`]: a whole decoder shard driving all of the above.
//! - [`staged`]: that shard as a [`crate::staged::StagedModel`], so the data-parallel engine
//!   (DDP / ZeRO-1/2/3) composes with TP on a `dp × tp` mesh.
//! - [`worker`]: a `dp × tp` training run of a run config (what `xtrain train --tp` runs), with
//!   checkpoints that load into another tp size.
//!
//! The math (which collective where, forward and backward) is in `docs/TENSOR_PARALLEL.md`.
pub mod embedding;
pub mod head;
pub mod linear;
pub mod model;
pub mod plan;
pub mod region;
pub mod staged;
pub mod worker;

pub use embedding::VocabParallelEmbedding;
pub use head::VocabParallelHead;
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use model::TpModel;
pub use plan::{Split, TpPlan};
pub use region::TpRegion;
pub use staged::StagedTp;
