//! `train`: the trainer loop, optimizer schedule, mixed precision, data and tokenizers,
//! checkpoints and metrics.
//!
//! Modules:
//! - [`config`]: run configuration (TOML, presets, overrides);
//! - [`data`]: built-in corpus, tokenizers, token files, deterministic sampling;
//! - [`schedule`]: warmup + cosine learning rate;
//! - [`memory`]: byte accounting of parameters, gradients, optimizer state, activations;
//! - [`rng`]: the seekable RNG whose state goes into checkpoints;
//! - [`allocator`]: glibc tuning so each step reuses the previous step's pages.
pub mod allocator;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod generate;
pub mod hf;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod precision;
pub mod progress;
pub mod rng;
pub mod run;
pub mod schedule;
pub mod trainer;

pub use config::{Precision, RunConfig};
pub use error::{Result, TrainError};
