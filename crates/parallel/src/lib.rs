//! `parallel`: every parallelism of xtrain, one folder each, all derived from one device mesh.
//!
//! - [`data_parallel`]: DDP and ZeRO-1/2/3 (one engine parameterised by stage), with its
//!   sharding, gradient buckets, distributed sampler, memory accounting and resharding
//!   checkpoints. Its modules are re-exported at the crate root (`parallel::engine`, ...).
//! - [`staged`]: the unit-by-unit model contract the engines drive (embedding, blocks, head);
//!   [`llm`] adapts the Llama / Mixtral decoders to it.
//! - [`testing`]: small models and helpers for parity tests.
//!
//! Tensor, pipeline, context and expert parallelism get folders of their own beside
//! `data_parallel/` as they land.
pub mod data_parallel;
pub mod llm;
pub mod staged;
pub mod testing;

pub use data_parallel::{
    bucket, checkpoint, engine, flat, memory, reshard, run_log, sampler, shard, worker,
};

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
