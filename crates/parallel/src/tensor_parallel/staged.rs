//! [`StagedModel`] for a tensor-parallel decoder shard, so the data-parallel engine (DDP,
//! ZeRO-1/2/3) runs over the dp group of a `dp × tp` mesh with the TP shard as its "model":
//! units are the local embedding, blocks and head; TP collectives happen inside them.
//!
//! Two things make the composition exact:
//! - partial gradients of replicated tensors (router, replicated KV heads, norms under sp) are
//!   summed over tp inside each unit's backward, on a fresh buffer (so accumulation over
//!   micro-batches never sums an already-synced part twice), before the engine's dp reduction;
//! - the clipping norm ([`StagedModel::grad_sq_sum`]) counts every replicated tensor once and
//!   sums over the tp group.

use std::ops::Range;
use std::sync::Arc;

use model::layers::block::BlockCache;
use model::layers::Pass;
use model::Batch;

use super::head::TpHeadCache;
use super::model::TpModel;
use crate::llm::LlmAct;
use crate::staged::StagedModel;
use crate::ParallelError;

fn merr(e: model::ModelError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

/// A TP shard as a staged model.
#[derive(Debug, Clone)]
pub struct StagedTp {
    pub tp: TpModel,
}

pub enum TpCache {
    Embed(Vec<u32>),
    Block(Box<BlockCache>),
    Head(TpHeadCache),
}

impl StagedTp {
    fn blocks(&self) -> usize {
        self.tp.local.blocks.len()
    }

    /// Sums the partial gradients of the tensors inside `unit` over tp (see the module doc).
    fn sync_unit(&self, unit: usize, g_unit: &mut [f32]) -> Result<(), ParallelError> {
        let r = &self.units()[unit];
        let plan = &self.tp.plan;
        if !plan
            .tensors
            .iter()
            .any(|t| t.partial_grad && t.local.offset >= r.start && t.local.range().end <= r.end)
        {
            return Ok(());
        }
        plan.sync_grads_in(self.tp.group(), g_unit, r.clone())
    }
}

impl StagedModel for StagedTp {
    type Batch = Batch;
    type Act = LlmAct;
    type Cache = TpCache;

    fn units(&self) -> Vec<Range<usize>> {
        self.tp.local.layout.part_ranges()
    }

    fn tensors(&self) -> Vec<Range<usize>> {
        self.tp.local.layout.tensor_ranges()
    }

    fn forward(
        &self,
        unit: usize,
        p: &[f32],
        x: Option<LlmAct>,
        batch: &Batch,
        scale: f32,
    ) -> Result<(LlmAct, TpCache), ParallelError> {
        let n = self.blocks();
        if unit == 0 {
            self.tp.plan.check_seq(batch.seq)?;
            let x = self.tp.embed.forward(p, &batch.inputs).map_err(merr)?;
            return Ok((LlmAct { x, aux: 0.0 }, TpCache::Embed(batch.inputs.clone())));
        }
        let act = x.ok_or_else(|| ParallelError::Model(format!("unit {unit} needs an input")))?;
        if unit <= n {
            let mut pass = Pass::new(batch.batch, batch.seq);
            // The auxiliary-loss gradient is seeded on tp rank 0 only (see `super::model`).
            pass.loss_scale = if self.tp.rank() == 0 { scale } else { 0.0 };
            let (y, cache) = self.tp.local.blocks[unit - 1]
                .forward(p, Arc::new(act.x), &pass)
                .map_err(merr)?;
            let aux = act.aux + cache.aux_loss();
            return Ok((LlmAct { x: y, aux }, TpCache::Block(Box::new(cache))));
        }
        let cache = self
            .tp
            .head
            .forward(p, Arc::new(act.x), Arc::new(batch.targets.clone()))
            .map_err(merr)?;
        let ce = if cache.n_valid == 0 {
            0.0
        } else {
            (cache.loss_sum / cache.n_valid as f64) as f32
        };
        Ok((
            LlmAct {
                x: vec![ce + act.aux],
                aux: act.aux,
            },
            TpCache::Head(cache),
        ))
    }

    fn loss(&self, out: &LlmAct) -> f32 {
        out.x[0]
    }

    fn backward(
        &self,
        unit: usize,
        p: &[f32],
        cache: TpCache,
        dy: Option<LlmAct>,
        scale: f32,
        g: &mut [f32],
    ) -> Result<Option<LlmAct>, ParallelError> {
        let need = |dy: Option<LlmAct>| {
            dy.map(|a| a.x)
                .ok_or_else(|| ParallelError::Model(format!("unit {unit} backward needs dY")))
        };
        let mut gu = vec![0.0; g.len()];
        let dx = match cache {
            TpCache::Head(c) => {
                let s = if c.n_valid == 0 {
                    0.0
                } else {
                    scale / c.n_valid as f32
                };
                Some(self.tp.head.backward(p, &mut gu, c, s).map_err(merr)?)
            }
            TpCache::Block(c) => Some(
                self.tp.local.blocks[unit - 1]
                    .backward(p, &mut gu, *c, need(dy)?)
                    .map_err(merr)?,
            ),
            TpCache::Embed(ids) => {
                self.tp
                    .embed
                    .backward(&mut gu, &ids, need(dy)?)
                    .map_err(merr)?;
                None
            }
        };
        self.sync_unit(unit, &mut gu)?;
        g.iter_mut().zip(&gu).for_each(|(a, b)| *a += b);
        Ok(dx.map(|x| LlmAct { x, aux: 0.0 }))
    }

    fn cache_bytes(&self, cache: &TpCache) -> usize {
        match cache {
            TpCache::Embed(ids) => ids.len() * 4,
            TpCache::Block(c) => c.bytes(),
            TpCache::Head(_) => 0,
        }
    }

    fn eval_metric(&self, out: &LlmAct, last: &TpCache) -> f32 {
        match last {
            TpCache::Head(c) if c.n_valid > 0 => (c.loss_sum / c.n_valid as f64) as f32,
            _ => out.x[0] - out.aux,
        }
    }

    fn grad_sq_sum(
        &self,
        range: Range<usize>,
        sq: &dyn Fn(Range<usize>) -> f64,
    ) -> Result<f64, ParallelError> {
        self.tp.plan.grad_sq_sum_in(self.tp.group(), range, sq)
    }
}
