//! [`StagedModel`] for the Llama / Mixtral decoders of the `model` crate: unit 0 is the token
//! embedding, units `1..=L` the blocks, unit `L+1` the final norm + LM head + cross-entropy.
//!
//! The loss of a micro-batch is the model's: mean cross-entropy over its valid targets plus the
//! blocks' MoE auxiliary losses, which travel forward with the activations. Tied embeddings
//! would make the head read the embedding unit's parameters, so they are refused here.
use std::ops::Range;
use std::sync::Arc;

use model::layers::block::BlockCache;
use model::layers::head::HeadCache;
use model::layers::Pass;
use model::{Batch, Model};

use crate::staged::StagedModel;
use crate::ParallelError;

/// A decoder split into embedding, blocks and head units.
#[derive(Clone, Debug)]
pub struct StagedLlm {
    pub model: Model,
}

/// Activations between units, with the auxiliary loss accumulated so far.
pub struct LlmAct {
    pub x: Vec<f32>,
    pub aux: f32,
}

pub enum LlmCache {
    Embed(Vec<u32>),
    Block(Box<BlockCache>),
    Head(HeadCache, f32),
}

fn merr(e: model::ModelError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

impl StagedLlm {
    pub fn new(model: Model) -> Result<Self, ParallelError> {
        if model.cfg.tie_word_embeddings {
            return Err(ParallelError::Config(
                "data parallelism over units needs untied embeddings (tie_word_embeddings = false)"
                    .into(),
            ));
        }
        let l = &model.layout;
        let mut next = l.embed_range().end;
        for i in 0..l.num_blocks() {
            if l.block_range(i).start != next {
                return Err(ParallelError::Layout(format!(
                    "block {i} does not follow its predecessor in the flat layout"
                )));
            }
            next = l.block_range(i).end;
        }
        if l.embed_range().start != 0
            || l.head_range().start != next
            || l.head_range().end != l.total()
        {
            return Err(ParallelError::Layout(
                "embedding, blocks and head must tile the flat buffer".into(),
            ));
        }
        Ok(Self { model })
    }

    fn blocks(&self) -> usize {
        self.model.layout.num_blocks()
    }
}

impl StagedModel for StagedLlm {
    type Batch = Batch;
    type Act = LlmAct;
    type Cache = LlmCache;

    fn units(&self) -> Vec<Range<usize>> {
        self.model.layout.part_ranges()
    }

    fn tensors(&self) -> Vec<Range<usize>> {
        self.model.layout.tensor_ranges()
    }

    fn forward(
        &self,
        unit: usize,
        p: &[f32],
        x: Option<LlmAct>,
        batch: &Batch,
        scale: f32,
    ) -> Result<(LlmAct, LlmCache), ParallelError> {
        let n = self.blocks();
        if unit == 0 {
            let x = self.model.embed_forward(p, &batch.inputs).map_err(merr)?;
            return Ok((
                LlmAct { x, aux: 0.0 },
                LlmCache::Embed(batch.inputs.clone()),
            ));
        }
        let act = x.ok_or_else(|| ParallelError::Model(format!("unit {unit} needs an input")))?;
        if unit <= n {
            let mut pass = Pass::new(batch.batch, batch.seq);
            pass.loss_scale = scale;
            let (y, cache) = self
                .model
                .block_forward(unit - 1, p, Arc::new(act.x), &pass)
                .map_err(merr)?;
            let aux = act.aux + cache.aux_loss();
            return Ok((LlmAct { x: y, aux }, LlmCache::Block(Box::new(cache))));
        }
        let cache = self
            .model
            .head_forward(p, &[], Arc::new(act.x), Arc::new(batch.targets.clone()))
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
            LlmCache::Head(cache, ce),
        ))
    }

    fn loss(&self, out: &LlmAct) -> f32 {
        out.x[0]
    }

    fn eval_metric(&self, out: &LlmAct, last: &LlmCache) -> f32 {
        match last {
            LlmCache::Head(_, ce) => *ce,
            _ => self.loss(out),
        }
    }

    fn backward(
        &self,
        unit: usize,
        p: &[f32],
        cache: LlmCache,
        dy: Option<LlmAct>,
        scale: f32,
        g: &mut [f32],
    ) -> Result<Option<LlmAct>, ParallelError> {
        let need = |dy: Option<LlmAct>| {
            dy.map(|a| a.x)
                .ok_or_else(|| ParallelError::Model(format!("unit {unit} backward needs dY")))
        };
        match cache {
            LlmCache::Head(cache, _) => {
                // d(mean CE)/d(loss_sum) = 1/n_valid, times the micro-batch's weight.
                let s = if cache.n_valid == 0 {
                    0.0
                } else {
                    scale / cache.n_valid as f32
                };
                let dx = self
                    .model
                    .head_backward(p, &[], g, None, cache, s)
                    .map_err(merr)?;
                Ok(Some(LlmAct { x: dx, aux: 0.0 }))
            }
            LlmCache::Block(cache) => {
                let dx = self.model.blocks[unit - 1]
                    .backward(p, g, *cache, need(dy)?)
                    .map_err(merr)?;
                Ok(Some(LlmAct { x: dx, aux: 0.0 }))
            }
            LlmCache::Embed(ids) => {
                self.model
                    .embed_backward(g, &ids, &need(dy)?)
                    .map_err(merr)?;
                Ok(None)
            }
        }
    }

    /// Everything the unit's cache holds, as the model's caches report it.
    fn cache_bytes(&self, cache: &LlmCache) -> usize {
        match cache {
            LlmCache::Embed(ids) => std::mem::size_of_val(ids.as_slice()),
            LlmCache::Block(c) => c.bytes(),
            LlmCache::Head(c, _) => c.bytes(),
        }
    }
}
