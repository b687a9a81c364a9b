//! A whole decoder under tensor (and sequence) parallelism on one rank of a tp group: the
//! rank's shard is a [`model::Model`] of the local config ([`super::plan`]) whose blocks carry
//! the region operators as [`RegionHooks`](model::layers::block::RegionHooks), between a
//! vocab-parallel embedding and a vocab-parallel head.
//!
//! MoE under TP: routing runs on the replicated router and the all-gathered (identical) input,
//! so every rank makes the same decisions; experts are split like the dense MLP. The router's
//! gradient is then a partial sum (each rank sees its experts' partial outputs), synced by
//! [`TpPlan::sync_grads`]. The auxiliary loss is the same on every rank, so its gradient is
//! seeded on tp rank 0 only (its `Pass::loss_scale`), and the sums over ranks count it once.

use std::sync::Arc;

use comm::ProcessGroup;
use model::layers::Pass;
use model::optim::{clip_factor, scale_grads};
use model::{AdamW, AdamWState, Batch, LossReport, Model, ModelConfig, StepOptions};

use super::embedding::VocabParallelEmbedding;
use super::head::VocabParallelHead;
use super::plan::TpPlan;
use super::region::TpRegion;
use crate::ParallelError;

fn merr(e: model::ModelError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

/// One rank's tensor-parallel decoder.
#[derive(Debug, Clone)]
pub struct TpModel {
    pub plan: TpPlan,
    /// The local shard; its blocks carry the region hooks.
    pub local: Model,
    pub region: TpRegion,
    pub embed: VocabParallelEmbedding,
    pub head: VocabParallelHead,
}

impl TpModel {
    /// The shard of `cfg` for this rank of the tp `group`.
    pub fn new(cfg: &ModelConfig, group: ProcessGroup, sp: bool) -> Result<Self, ParallelError> {
        let plan = TpPlan::new(cfg, group.size(), sp)?;
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
        Ok(TpModel {
            plan,
            local,
            region,
            embed,
            head,
        })
    }

    pub fn group(&self) -> &ProcessGroup {
        self.region.group()
    }
    pub fn rank(&self) -> usize {
        self.region.rank()
    }

    /// This rank's shard of full-layout parameters.
    pub fn shard_params(&self, full: &[f32]) -> Vec<f32> {
        self.plan.shard(full, self.rank())
    }

    /// Forward and backward of one micro-batch on local parameters `p`: gradients of
    /// `loss_scale · (ce + aux)` are accumulated into `g`, *before* [`Self::finish_grads`].
    pub fn forward_backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        batch: &Batch,
        opts: &StepOptions,
    ) -> Result<LossReport, ParallelError> {
        let l = &self.local.layout;
        if p.len() != l.total() || g.len() != l.total() {
            return Err(ParallelError::Layout(format!(
                "local buffers must hold {} elements (got {} and {})",
                l.total(),
                p.len(),
                g.len()
            )));
        }
        self.plan.check_seq(batch.seq)?;
        let mut pass = Pass::new(batch.batch, batch.seq).with_recompute(opts.recompute);
        // The MoE auxiliary-loss gradient is seeded once over the group (module doc).
        pass.loss_scale = if self.rank() == 0 {
            opts.loss_scale
        } else {
            0.0
        };
        let (er, hr) = (l.embed_range(), l.head_range());
        let mut x = self
            .embed
            .forward(&p[er.clone()], &batch.inputs)
            .map_err(merr)?;
        let mut caches = Vec::with_capacity(self.local.blocks.len());
        let mut aux = 0.0f32;
        for (i, b) in self.local.blocks.iter().enumerate() {
            let (y, c) = b
                .forward(&p[l.block_range(i)], Arc::new(x), &pass)
                .map_err(merr)?;
            aux += c.aux_loss();
            caches.push(c);
            x = y;
        }
        let hc = self
            .head
            .forward(&p[hr.clone()], Arc::new(x), Arc::new(batch.targets.clone()))
            .map_err(merr)?;
        let ce = if hc.n_valid == 0 {
            0.0
        } else {
            (hc.loss_sum / hc.n_valid as f64) as f32
        };
        let report = LossReport {
            loss: ce + aux,
            ce,
            aux,
            n_valid: hc.n_valid,
        };
        let scale = if hc.n_valid == 0 {
            0.0
        } else {
            opts.loss_scale / hc.n_valid as f32
        };
        let mut dx = self
            .head
            .backward(&p[hr.clone()], &mut g[hr], hc, scale)
            .map_err(merr)?;
        for (i, c) in caches.into_iter().enumerate().rev() {
            let r = l.block_range(i);
            dx = self.local.blocks[i]
                .backward(&p[r.clone()], &mut g[r], c, dx)
                .map_err(merr)?;
        }
        self.embed
            .backward(&mut g[er], &batch.inputs, dx)
            .map_err(merr)?;
        Ok(report)
    }

    /// Completes the step's gradients: sums the partial gradients of replicated tensors.
    pub fn finish_grads(&self, g: &mut [f32]) -> Result<(), ParallelError> {
        self.plan.sync_grads(self.group(), g)
    }

    /// `Σ g²` of the full model's gradient (for global-norm clipping).
    pub fn grad_sq_sum(&self, g: &[f32]) -> Result<f64, ParallelError> {
        self.plan.grad_sq_sum(self.group(), g)
    }

    /// One optimizer step over `batches` (accumulated micro-batches, each weighted
    /// `1/batches.len()`): forward/backward, partial-gradient sync, global-norm clipping over
    /// the whole (unsharded) model, AdamW on the local shard (element-wise, so the shards'
    /// updates are exactly the slices of the full update). Returns the mean loss.
    pub fn train_step(
        &self,
        params: &mut [f32],
        state: &mut AdamWState,
        batches: &[Batch],
        adamw: &AdamW,
        max_grad_norm: Option<f32>,
    ) -> Result<f32, ParallelError> {
        let mut g = vec![0.0; params.len()];
        let n = batches.len() as f32;
        let opts = StepOptions {
            loss_scale: 1.0 / n,
            ..StepOptions::default()
        };
        let mut loss = 0.0;
        for b in batches {
            loss += self.forward_backward(params, &mut g, b, &opts)?.loss / n;
        }
        self.finish_grads(&mut g)?;
        if let Some(max) = max_grad_norm {
            let (_, coef) = clip_factor(self.grad_sq_sum(&g)?, max);
            scale_grads(&mut g, coef);
        }
        adamw.step(state, params, &g, adamw.lr);
        Ok(loss)
    }
}
