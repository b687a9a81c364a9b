//! `train`: the one trainer on top of `parallel` — the run configuration, data and
//! tokenizers, the learning-rate schedule, the step loop with validation, checkpoints,
//! metrics, plots and progress, for every layout from one process to a dp × tp mesh.
//!
//! Modules:
//! - [`config`]: run configuration (TOML, presets, overrides, the parallel layout);
//! - [`trainer`]: a rank's model part, executor and data, one optimizer step, checkpoints;
//! - [`run`]: a whole run (the loop, validation, checkpoints, metrics, memory report, sample);
//! - [`bench`]: `xtrain bench train` on any layout;
//! - [`pipeline`]: the run's pipeline schedule and its measured bubble and trace;
//! - [`data`]: built-in corpus, tokenizers, token files, deterministic sampling;
//! - [`schedule`]: warmup + cosine learning rate;
//! - [`metrics`], [`progress`]: `metrics.jsonl`, the loss plot, the progress bar;
//! - [`tensorboard`]: the run's TensorBoard event files (scalars and the config);
//! - [`generate`], [`hf`]: sampling, and Hugging Face export / import of any checkpoint;
//! - [`fault`]: the `XTRAIN_FAULT` hook that kills or stops a rank at a step (tests);
//! - [`rng`]: the seekable RNG of the sampler; [`allocator`]: glibc tuning so each step
//!   reuses the previous step's pages.
pub mod allocator;
pub mod bench;
pub mod config;
pub mod data;
pub mod error;
pub mod fault;
pub mod generate;
pub mod hf;
pub mod metrics;
pub mod pipeline;
pub mod progress;
pub mod rng;
pub mod run;
pub mod schedule;
pub mod tensorboard;
pub mod trainer;

pub use config::{Precision, RunConfig};
pub use error::{Result, TrainError};
