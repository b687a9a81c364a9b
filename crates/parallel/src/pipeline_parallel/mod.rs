//! Pipeline parallelism: the model's layers split into stages on the `pp` ranks, and schedules
//! as data — a per-rank list of [`Action`]s the executor (`crate::executor`) runs.
//!
//! - [`action`]: the action IR (`2F0`, `1SEND_B3`, …) and the one-stage schedule (training
//!   without pipelining);
//! - [`schedule`]: a whole schedule (stage placement, chains, every rank's actions) with its
//!   text and CSV forms;
//! - [`generators`]: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V, DualPipeV, DualPipe;
//! - [`validate`]: the checks a schedule passes before it runs, naming what can never run;
//! - [`lower`]: adds the sends, receives, gradient reductions and ZeRO-3 gathers;
//! - [`link`]: the channel of one stage boundary and direction between two ranks (host
//!   transports or NCCL) that carries the sends and receives;
//! - [`simulate`]: makespan, bubbles and activations in flight from per-action costs;
//! - [`render`]: the timeline as text and as an SVG picture;
//! - [`split`]: which layers each stage holds.
pub mod action;
pub mod generators;
pub mod link;
pub mod lower;
pub mod render;
pub mod schedule;
pub mod simulate;
pub mod split;
pub mod validate;

pub use action::{one_stage, Action};
pub use generators::{generate, ScheduleKind};
pub use lower::{lower, LowerOptions};
pub use schedule::Schedule;
pub use simulate::{simulate, simulate_with, Costs, Simulation};
pub use validate::validate;
