//! Data parallelism: DDP and ZeRO-1/2/3 over the dp group.
//!
//! - [`shard`]: equal padded ranges of a flat buffer (ZeRO partitioning);
//! - [`bucket`]: gradient buckets in reverse layer order and their readiness during backward;
//! - [`sampler`]: which samples of a global batch each dp rank reads;
//! - [`memory`]: per-rank memory accounting and the ZeRO formulas;
//! - [`flat`]: parameter and gradient buffers in fp32 or bf16;
//! - [`engine`]: DDP and ZeRO-1/2/3 training steps (one engine, parameterised by stage);
//! - [`run_log`]: rank 0's metrics, loss plot and config in the run directory;
//! - [`worker`]: a data-parallel training run of a `RunConfig` on one rank;
//! - [`reshard`]: re-cutting saved flat shards for a different dp size or stage;
//! - [`checkpoint`]: sharded checkpoints that load into any dp size or stage.
//!
//! Design notes: `docs/DATA_PARALLEL.md`.
pub mod bucket;
pub mod checkpoint;
pub mod engine;
pub mod flat;
pub mod memory;
pub mod reshard;
pub mod run_log;
pub mod sampler;
pub mod shard;
pub mod worker;
