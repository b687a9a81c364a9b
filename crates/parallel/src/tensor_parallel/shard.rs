//! The tensor-parallel pass: one rank's shard of a decoder over the tp group. The shard is a
//! [`model::Model`] of the plan's local config (heads, KV heads, FFN and vocabulary split) whose
//! blocks carry the region operators as `RegionHooks`, beside a vocab-parallel embedding and a
//! vocab-parallel LM head with cross-entropy.
//!
//! MoE under TP: routing runs on the replicated router and the all-gathered (identical) input,
//! so every rank makes the same decisions; experts are split like the dense MLP. The router's
//! gradient is then a partial sum (each rank sees its experts' partial outputs), synced by
//! [`TpPlan::sync_grads_in`]. The auxiliary loss is the same on every rank, so its gradient is
//! seeded on tp rank 0 only, and the sums over ranks count it once.
use std::sync::Arc;

use comm::ProcessGroup;
use model::{Model, ModelConfig};

use super::embedding::VocabParallelEmbedding;
use super::head::VocabParallelHead;
use super::plan::TpPlan;
use super::region::TpRegion;
use crate::ParallelError;

/// The tensor-parallel parts of one rank's decoder shard.
#[derive(Debug, Clone)]
pub struct TpShard {
    pub plan: TpPlan,
    pub region: TpRegion,
    pub embed: VocabParallelEmbedding,
    pub head: VocabParallelHead,
}

impl TpShard {
    pub fn group(&self) -> &ProcessGroup {
        self.region.group()
    }
    pub fn rank(&self) -> usize {
        self.region.rank()
    }
}

/// This rank's shard of `cfg` over the tp `group` (`sp`: sequence parallel): the local model,
/// its blocks wired to the region operators, and the tensor-parallel parts.
pub fn shard_model(
    cfg: &ModelConfig,
    group: ProcessGroup,
    sp: bool,
) -> Result<(Model, TpShard), ParallelError> {
    shard_model_with_experts(cfg, group, sp, 1, 0)
}

/// [`shard_model`] holding rank `ep_rank`'s share of the experts of `ep` expert-parallel ranks
/// ([`TpPlan::with_experts`]).
pub fn shard_model_with_experts(
    cfg: &ModelConfig,
    group: ProcessGroup,
    sp: bool,
    ep: usize,
    ep_rank: usize,
) -> Result<(Model, TpShard), ParallelError> {
    let plan = TpPlan::with_experts(cfg, group.size(), sp, ep, ep_rank)?;
    let region = TpRegion::new(group, sp);
    let mut local = plan.local_model()?;
    let hooks: Arc<dyn model::layers::block::RegionHooks> = Arc::new(region.clone());
    for b in &mut local.blocks {
        b.hooks = Some(hooks.clone());
    }
    let hb = local.layout.head_range().start;
    let lm = local
        .layout
        .get("lm_head.weight")
        .ok_or_else(|| ParallelError::Layout("no lm_head.weight".into()))?
        .view
        .relative_to(hb);
    let head = VocabParallelHead {
        norm: local.head.norm.clone(),
        lm,
        vocab: cfg.vocab_size,
        eps: cfg.rms_norm_eps,
        ce: local.head.ce,
        region: region.clone(),
    };
    let embed = VocabParallelEmbedding {
        vocab: cfg.vocab_size,
        rows: plan.local_cfg.vocab_size,
        dim: cfg.hidden_size,
        region: region.clone(),
    };
    Ok((
        local,
        TpShard {
            plan,
            region,
            embed,
            head,
        },
    ))
}
