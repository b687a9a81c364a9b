//! The parallel crate's integration tests, one binary (one link, one instantiation of the
//! generic code they share); each module is one subject. Tests that need a process of
//! their own (GPU tests, thread counting) stay separate files beside this folder.
mod checkpoint_reshard;
#[path = "../common/mod.rs"]
mod common;
mod context_attention;
mod context_parity;
mod decoder_parity;
mod decoder_precision;
mod delayed_update;
mod document_mask;
mod executor_dp_parity;
mod executor_memory;
mod executor_pipeline;
mod expert_dispatch;
mod expert_parity;
mod grad_comm;
mod pipeline_parity;
mod plan_engine;
mod plan_offload;
mod plan_published;
mod powersgd;
mod schedules;
mod tied_parity;
mod tp_layers;
