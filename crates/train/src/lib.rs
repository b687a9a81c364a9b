//! `train`: the trainer loop, optimizer schedule, mixed precision, data and tokenizers,
//! checkpoints and metrics.
//!
//! Modules:
//! - [`config`]: run configuration (TOML, presets, overrides);
//! - [`data`]: built-in corpus, tokenizers, token files, deterministic sampling;
//! - [`schedule`]: warmup + cosine learning rate;
//! - [`memory`]: byte accounting of parameters, gradients, optimizer state, activations;
//! - [`rng`]: the seekable RNG whose state goes into checkpoints.
pub mod config;
pub mod data;
pub mod error;
pub mod memory;
pub mod rng;
pub mod schedule;

pub use config::{Precision, RunConfig};
pub use error::{Result, TrainError};
