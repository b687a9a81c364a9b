//! The train crate's integration tests, one binary (one link, one instantiation of the
//! generic code they share); each module is one subject. Tests that need a process of
//! their own (GPU tests, thread counting) stay separate files beside this folder.
mod bad_input;
#[path = "../common/mod.rs"]
mod common;
mod experts;
mod hf;
mod offload;
mod precision;
mod reshard_matrix;
mod shard_layouts;
#[cfg(feature = "parquet")]
mod shards;
mod tensorboard;
mod trainer;
