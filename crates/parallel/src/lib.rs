//! `parallel`: every parallelism of xtrain, one folder each (dp, zero, tp, pp, cp, ep),
//! all derived from one device mesh.
//!
//! Shared data-parallel pieces:
//! - [`shard`]: equal padded ranges of a flat buffer (ZeRO partitioning);
//! - [`bucket`]: gradient buckets in reverse layer order and their readiness during backward;
//! - [`sampler`]: which samples of a global batch each dp rank reads;
//! - [`memory`]: per-rank memory accounting and the ZeRO formulas;
//! - [`reshard`]: re-cutting saved flat shards for a different dp size or stage.
pub mod bucket;
pub mod memory;
pub mod reshard;
pub mod sampler;
pub mod shard;

/// Errors of the parallel layer.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("parallel config: {0}")]
    Config(String),
    #[error("parallel layout: {0}")]
    Layout(String),
    #[error("parallel protocol: {0}")]
    Protocol(String),
}
