//! The planner behind `xtrain plan`: for a model, a cluster, a global batch, a sequence length
//! and a precision, every layout this engine can run — dp with ZeRO 0-3, tp (+sp), pp with
//! each schedule, virtual stages and micro-batch counts, cp, ep, and recomputation — with its
//! per-rank memory and its step time, the feasible ones ranked by tokens per second.
//!
//! A pure library: no process runs, no time is measured (calibration of "this machine" lives
//! with the command). Files:
//! - [`shapes`]: named published model shapes;
//! - [`cluster`]: devices, links, presets;
//! - [`layout`]: one candidate and its printable name;
//! - [`memory`]: per-rank bytes, from the engine's own layout and formula functions;
//! - [`time`]: FLOPs, alpha-beta collectives, the simulated pipeline bubble, overlap;
//! - [`search`]: enumeration, ranking, and what would make an infeasible job fit;
//! - [`chart`]: the stacked memory bars against the device limit (SVG).
//!
//! The model, its formulas and how well it is validated: docs/PLAN.md.
pub mod chart;
pub mod cluster;
pub mod layout;
pub mod memory;
pub mod search;
pub mod shapes;
pub mod time;

pub use cluster::{Cluster, Host, Link};
pub use layout::{Layout, Offload};
pub use search::{evaluate, plan, Plan, Prediction, SearchSpace, Shortfall};

use model::ModelConfig;
use serde::Serialize;

use crate::Precision;

/// Whose conventions the memory and time model follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Conventions {
    /// This engine: fp32 activations and compute, gradients in the compute precision, the
    /// caches its layers keep (exact), ZeRO-2/3 reducing every micro-batch.
    Xtrain,
    /// Megatron-LM's, for comparing with published results: 16-bit activations counted by
    /// Korthikanti et al.'s formula, fp32 gradient accumulation beside 16-bit weights.
    Megatron,
}

/// What is being planned.
#[derive(Clone, Debug)]
pub struct Job {
    pub model: ModelConfig,
    pub seq_len: usize,
    /// Sequences per optimizer step.
    pub global_batch: usize,
    pub precision: Precision,
    /// The engine runs on GPUs: in bf16 / fp16 its products read 16-bit operands, and the
    /// activations only products read again are kept rounded, in 2 bytes
    /// ([`tensor::operands::Kept`]); on CPUs everything is computed and kept in fp32.
    pub gpu: bool,
    pub conventions: Conventions,
    /// With expert parallelism: over every MoE layer, the busiest rank's routed rows over the
    /// mean (1 = the balanced load). Routing decides it at run time, so it is an input: it
    /// multiplies the routed experts' compute on the critical path and their all-to-all
    /// bytes (the all-to-alls wait for the busiest rank). Memory is predicted at the
    /// balanced load, the expectation of every rank's rows summed over its layers.
    pub expert_imbalance: f64,
}
