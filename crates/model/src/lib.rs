//! `model`: Llama and Mixtral-style decoders built from layers with explicit,
//! separable forward/backward over flat parameter and gradient buffers.
//!
//! - [`config`]: HF-named configuration, presets, validation.
//! - [`documents`]: document boundaries of packed batches (block-causal attention).
//! - [`layout`]: the flat parameter layout (HF names, shapes, offsets; blocks contiguous).
//! - [`init`]: deterministic initialisation.
//! - [`optim`]: AdamW over flat (sub-)ranges and gradient-norm clipping.
//! - [`layers`]: attention, SwiGLU MLP, MoE, block, head with separable backward.
//! - [`model`]: the whole decoder, per-part and whole-model forward/backward.
//! - [`profile`]: optional per-kernel timers.
//! - [`io`]: safetensors load/save with HF names and layouts.

pub mod config;
pub mod documents;
pub mod error;
pub mod init;
pub mod io;
pub mod layers;
pub mod layout;
pub mod model;
pub mod optim;
pub mod profile;

pub use config::ModelConfig;
pub use documents::Documents;
pub use error::{ModelError, Result};
pub use layers::{Pass, Recompute, WeightGradStore};
pub use layout::{ParamLayout, View};
pub use model::{Batch, LossReport, Model, StepOptions};
pub use optim::{AdamW, AdamWState};
