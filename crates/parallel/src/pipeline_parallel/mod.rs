//! Pipeline parallelism: the model's layers split into stages on the `pp` ranks, and schedules
//! as data — a per-rank list of [`Action`]s the executor (`crate::executor`) runs.
//!
//! - [`action`]: the action IR and the one-stage schedule (training without pipelining);
//! - [`split`]: which layers each pipeline stage holds.
pub mod action;
pub mod split;

pub use action::{one_stage, Action};
