//! `parallel`: every parallelism of xtrain, composed on one device mesh and run by one
//! executor.
//!
//! From the command line to the arithmetic, one path:
//! - [`dims`]: the degrees `pp, dp, cp, tp, ep` (+ ZeRO stage, sp, virtual stages), validated,
//!   and the mesh `[pp, dp, cp, tp]` every process group is cut from;
//! - [`parallelize`]: the passes — tensor parallel → context parallel → expert parallel →
//!   pipeline split → data parallel / ZeRO — from a model config to what one rank runs, a
//!   [`decoder::DecoderStage`];
//! - [`stage`]: the contract of a rank's units (forward, backward-input, backward-weight);
//! - [`executor`]: runs a rank's schedule of [`pipeline_parallel::Action`]s — forward,
//!   backward, pipeline sends and receives, ZeRO gathers, bucketed gradient reductions, the
//!   optimizer step; training without pipelining is the one-stage schedule;
//! - [`checkpoint`]: one format for every layout (blocks with their place in the full tensor),
//!   loadable at any other layout and exportable to Hugging Face.
//!
//! One folder per parallelism: [`data_parallel`] (DDP, ZeRO-1/2/3: shards, buckets,
//! sampling), [`tensor_parallel`] (TP + SP), [`pipeline_parallel`] (the stage split and the
//! schedule IR); context and expert parallelism get theirs as they land. [`precision`] (fp32,
//! bf16, fp16 with loss scaling) and [`memory`] (the byte account and the ZeRO formulas) serve
//! them all, and [`nccl`] puts a group's communication on NCCL for ranks with a GPU each. [`testing`] holds a small model for the executor's tests.
pub mod checkpoint;
pub mod context_parallel;
pub mod data_parallel;
pub mod decoder;
pub mod dims;
pub mod executor;
pub mod expert_parallel;
pub mod memory;
pub mod nccl;
pub mod parallelize;
pub mod pipeline_parallel;
pub mod placement;
pub mod plan;
pub mod plot_font;
pub mod precision;
pub mod stage;
pub mod tensor_parallel;
pub mod testing;

pub use decoder::DecoderStage;
pub use dims::{Mesh, ParallelDims};
pub use executor::{ExecConfig, Executor, StepStats};
pub use parallelize::{parallelize, ModelOptions, Parallelized};
pub use precision::Precision;

/// Errors of the parallel layer.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("parallel config: {0}")]
    Config(String),
    #[error("parallel layout: {0}")]
    Layout(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("schedule: {0}")]
    Schedule(String),
    #[error("parallel protocol: {0}")]
    Protocol(String),
    #[error("{0}")]
    Checkpoint(String),
    #[error("model: {0}")]
    Model(String),
    /// A collective on the devices (NCCL) failed, naming the group and the rank.
    #[error("{0}")]
    Collective(String),
    #[error(transparent)]
    Comm(#[from] comm::CommError),
}

impl From<tensor::TensorError> for ParallelError {
    fn from(e: tensor::TensorError) -> Self {
        ParallelError::Model(e.to_string())
    }
}
