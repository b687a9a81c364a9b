//! `parallel`: every parallelism of xtrain, one folder each (dp, zero, tp, pp, cp, ep),
//! all derived from one device mesh.
//!
//! Shared data-parallel pieces:
//! - [`shard`]: equal padded ranges of a flat buffer (ZeRO partitioning);
//! - [`bucket`]: gradient buckets in reverse layer order and their readiness during backward;
//! - [`sampler`]: which samples of a global batch each dp rank reads;
//! - [`memory`]: per-rank memory accounting and the ZeRO formulas;
//! - [`staged`]: the unit-by-unit model contract the engines drive;
//! - [`llm`]: the Llama / Mixtral decoders as staged models;
//! - [`engine`]: DDP and ZeRO-1/2/3 training steps (one engine, parameterised by stage);
//! - [`worker`]: a data-parallel training run of a `RunConfig` on one rank;
//! - [`reshard`]: re-cutting saved flat shards for a different dp size or stage;
//! - [`checkpoint`]: sharded checkpoints that load into any dp size or stage.
pub mod bucket;
pub mod checkpoint;
pub mod engine;
pub mod llm;
pub mod memory;
pub mod reshard;
pub mod sampler;
pub mod shard;
pub mod staged;
pub mod testing;
pub mod worker;

/// Errors of the parallel layer.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("parallel config: {0}")]
    Config(String),
    #[error("parallel layout: {0}")]
    Layout(String),
    #[error("parallel protocol: {0}")]
    Protocol(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("model: {0}")]
    Model(String),
    #[error(transparent)]
    Comm(#[from] comm::CommError),
}
