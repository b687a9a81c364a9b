//! Mixed precision: the flat working buffers of each precision, the per-block upcast driver,
//! and dynamic loss scaling for fp16.
//!
//! The model computes in fp32 over fp32 parameter slices. For bf16/fp16 training the working
//! weights and gradients are stored as 16-bit flat buffers (2Φ + 2Φ bytes) beside the fp32
//! master weights; each forward/backward upcasts one part (embedding, one block, head) at a time
//! into an fp32 scratch buffer the size of the largest part, and backward accumulates that
//! part's gradient in fp32 before rounding it back into the 16-bit gradient buffer. So the
//! numerics are those of 16-bit storage with fp32 accumulation (as in Megatron's bf16 mode),
//! while the memory held is the accounted 2Φ + 2Φ + 12Φ plus one part's scratch.
use crate::config::Precision;
use crate::error::{Result, TrainError};
use model::{Batch, LossReport, Model, Pass, StepOptions};
use std::ops::Range;
use std::sync::Arc;

/// A 16-bit storage format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

impl Half {
    #[inline]
    pub fn to_f32(self, b: u16) -> f32 {
        match self {
            Half::Bf16 => half::bf16::from_bits(b).to_f32(),
            Half::F16 => half::f16::from_bits(b).to_f32(),
        }
    }

    /// Round to nearest even (both `half` conversions do); fp16 overflow becomes ±inf.
    #[inline]
    pub fn from_f32(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => half::bf16::from_f32(x).to_bits(),
            Half::F16 => half::f16::from_f32(x).to_bits(),
        }
    }

    pub fn upcast(self, src: &[u16], dst: &mut [f32]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = self.to_f32(s));
    }

    pub fn downcast(self, src: &[f32], dst: &mut [u16]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = self.from_f32(s));
    }
}

/// The parameter and gradient buffers of one run.
pub enum Weights {
    /// fp32 weights (which are also the master weights) and fp32 gradients.
    Full { params: Vec<f32>, grads: Vec<f32> },
    /// 16-bit working weights and gradients, fp32 master weights.
    Half {
        kind: Half,
        params: Vec<u16>,
        grads: Vec<u16>,
        master: Vec<f32>,
    },
}

impl Weights {
    /// Buffers for `precision` starting from fp32 `master` weights.
    pub fn new(master: Vec<f32>, precision: Precision) -> Self {
        let n = master.len();
        match precision {
            Precision::Fp32 => Weights::Full {
                params: master,
                grads: vec![0.0; n],
            },
            Precision::Bf16 | Precision::Fp16 => {
                let kind = if precision == Precision::Bf16 {
                    Half::Bf16
                } else {
                    Half::F16
                };
                let mut params = vec![0u16; n];
                kind.downcast(&master, &mut params);
                Weights::Half {
                    kind,
                    params,
                    grads: vec![0; n],
                    master,
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.master().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fp32 weights the optimizer updates (and checkpoints save).
    pub fn master(&self) -> &[f32] {
        match self {
            Weights::Full { params, .. } => params,
            Weights::Half { master, .. } => master,
        }
    }

    /// Re-derives the working weights after the master weights changed.
    pub fn sync_working(&mut self) {
        if let Weights::Half {
            kind,
            params,
            master,
            ..
        } = self
        {
            kind.downcast(master, params);
        }
    }

    pub fn zero_grads(&mut self) {
        match self {
            Weights::Full { grads, .. } => tensor::threads::scale(grads, 0.0),
            Weights::Half { grads, .. } => grads.fill(0),
        }
    }

    /// Σ g² over the working gradients in f64, summed in a fixed order (chunk partials, then a
    /// sequential sum) so that it is bit-reproducible run to run.
    pub fn grad_sq_sum(&self) -> f64 {
        use model::optim::sq_sum;
        match self {
            Weights::Full { grads, .. } => {
                tensor::threads::sum_chunks(grads.len(), CHUNK, |r| sq_sum(&grads[r]))
            }
            Weights::Half { kind, grads, .. } => {
                // The same values in the same order as `sq_sum` of the upcast chunk, without
                // a buffer per chunk.
                tensor::threads::sum_chunks(grads.len(), CHUNK, |r| {
                    grads[r]
                        .iter()
                        .map(|&g| {
                            let g = kind.to_f32(g) as f64;
                            g * g
                        })
                        .sum::<f64>()
                })
            }
        }
    }

    /// Forward and backward of one micro-batch; gradients of `opts.loss_scale · loss` are
    /// accumulated into the working gradient buffer.
    pub fn forward_backward(
        &mut self,
        model: &Model,
        batch: &Batch,
        opts: &StepOptions,
    ) -> Result<LossReport> {
        let merr = |e: model::ModelError| TrainError::Model(e.to_string());
        match self {
            Weights::Full { params, grads } => model
                .forward_backward(params, grads, batch, opts, &mut |_| {})
                .map_err(merr),
            Weights::Half {
                kind,
                params,
                grads,
                ..
            } => half_step(model, *kind, params, Some(grads), batch, opts).map_err(merr),
        }
    }

    /// Forward only (validation): the loss computed with the working weights.
    pub fn forward_loss(&mut self, model: &Model, batch: &Batch) -> Result<LossReport> {
        let merr = |e: model::ModelError| TrainError::Model(e.to_string());
        match self {
            Weights::Full { params, .. } => model.forward_loss(params, batch).map_err(merr),
            Weights::Half { kind, params, .. } => {
                half_step(model, *kind, params, None, batch, &StepOptions::default()).map_err(merr)
            }
        }
    }
}

/// Elements per chunk of chunked passes over the flat buffers.
pub const CHUNK: usize = 1 << 16;

/// The whole-model step of [`Model::forward_backward`], part by part over 16-bit storage:
/// upcast a part's weights, run it, and (backward) accumulate its fp32 gradient into the
/// 16-bit buffer. With `grads = None` it is a forward only.
fn half_step(
    model: &Model,
    kind: Half,
    params: &[u16],
    grads: Option<&mut [u16]>,
    batch: &Batch,
    opts: &StepOptions,
) -> model::Result<LossReport> {
    let layout = &model.layout;
    let (er, hr) = (layout.embed_range(), layout.head_range());
    let up = |r: Range<usize>| {
        let mut v = vec![0.0f32; r.len()];
        kind.upcast(&params[r], &mut v);
        v
    };
    let mut pass = Pass::new(batch.batch, batch.seq).with_recompute(opts.recompute);
    pass.loss_scale = opts.loss_scale;
    let p_embed = up(er.clone());
    let mut x = model.embed_forward(&p_embed, &batch.inputs)?;
    let mut caches = Vec::with_capacity(model.blocks.len());
    for i in 0..model.blocks.len() {
        let p = up(layout.block_range(i));
        let (y, c) = model.block_forward(i, &p, Arc::new(x), &pass)?;
        caches.push(c);
        x = y;
    }
    let p_head = up(hr.clone());
    let (x, targets) = (Arc::new(x), Arc::new(batch.targets.clone()));
    let head = if grads.is_some() {
        // The gradient scale of the mean loss is known now: the head computes its gradients
        // in the forward pass (one logits product fewer); `head_backward` below reuses them.
        let s = model.head.mean_grad_scale(&targets, opts.loss_scale)?;
        model.head_forward_with_grad(&p_head, &p_embed, x, targets, s)?
    } else {
        model.head_forward(&p_head, &p_embed, x, targets)?
    };
    let ce = if head.n_valid == 0 {
        0.0
    } else {
        (head.loss_sum / head.n_valid as f64) as f32
    };
    let aux: f32 = caches.iter().map(|c| c.aux_loss()).sum();
    let report = LossReport {
        loss: ce + aux,
        ce,
        aux,
        n_valid: head.n_valid,
    };
    let Some(grads) = grads else {
        return Ok(report);
    };

    // Accumulate `f` into the 16-bit gradient range `r` through an fp32 copy.
    let accumulate =
        |grads: &mut [u16], r: Range<usize>, f: &mut dyn FnMut(&mut [f32]) -> model::Result<()>| {
            let mut g = vec![0.0f32; r.len()];
            kind.upcast(&grads[r.clone()], &mut g);
            f(&mut g)?;
            kind.downcast(&g, &mut grads[r]);
            Ok::<(), model::ModelError>(())
        };
    let scale = if head.n_valid == 0 {
        0.0
    } else {
        opts.loss_scale / head.n_valid as f32
    };
    let tied = model.cfg.tie_word_embeddings;
    let mut dx = Vec::new();
    {
        // Head (and the tied embedding, whose gradient also receives the LM-head term).
        let mut g_embed = if tied {
            let mut g = vec![0.0f32; er.len()];
            kind.upcast(&grads[er.clone()], &mut g);
            Some(g)
        } else {
            None
        };
        accumulate(grads, hr.clone(), &mut |g| {
            dx = model.head_backward(
                &p_head,
                &p_embed,
                g,
                g_embed.as_deref_mut(),
                head.clone(),
                scale,
            )?;
            Ok(())
        })?;
        if let Some(g) = g_embed {
            kind.downcast(&g, &mut grads[er.clone()]);
        }
    }
    drop(p_head);
    for (i, cache) in caches.into_iter().enumerate().rev() {
        let r = layout.block_range(i);
        let p = up(r.clone());
        let mut cache = Some(cache);
        accumulate(grads, r, &mut |g| {
            let dy = std::mem::take(&mut dx);
            dx = model.blocks[i].backward(
                &p,
                g,
                cache.take().expect("one backward per block"),
                dy,
            )?;
            Ok(())
        })?;
    }
    accumulate(grads, er, &mut |g| {
        model.embed_backward(g, &batch.inputs, &dx)
    })?;
    Ok(report)
}

/// Dynamic loss scaling (Micikevicius et al., 2018): multiply the loss by `scale` so small fp16
/// gradients do not underflow; on overflow (a non-finite gradient) skip the step and halve the
/// scale; after `growth_interval` clean steps double it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub good_steps: u64,
    pub growth_interval: u64,
    /// Fixed at 1 (no scaling) for fp32 and bf16, whose exponent range matches fp32.
    pub dynamic: bool,
}

impl LossScaler {
    pub fn new(precision: Precision, initial: f64) -> Self {
        let dynamic = precision == Precision::Fp16;
        Self {
            scale: if dynamic { initial } else { 1.0 },
            good_steps: 0,
            growth_interval: 200,
            dynamic,
        }
    }

    /// Records whether the step's gradients were finite; returns whether to apply the step.
    pub fn update(&mut self, finite: bool) -> bool {
        if !self.dynamic {
            return finite;
        }
        if finite {
            self.good_steps += 1;
            if self.good_steps.is_multiple_of(self.growth_interval) {
                self.scale *= 2.0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
        }
        finite
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions() {
        assert_eq!(Half::Bf16.to_f32(Half::Bf16.from_f32(1.0)), 1.0);
        // bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1.
        assert_eq!(
            Half::Bf16.to_f32(Half::Bf16.from_f32(1.0 + 1.0 / 512.0)),
            1.0
        );
        assert!(Half::F16.to_f32(Half::F16.from_f32(1e6)).is_infinite());
        let w = Weights::new(vec![0.1, -2.0, 3.0], Precision::Bf16);
        assert_eq!(w.master(), &[0.1, -2.0, 3.0]);
    }

    #[test]
    fn loss_scaler_backs_off_and_grows() {
        let mut s = LossScaler::new(Precision::Fp16, 1024.0);
        assert!(!s.update(false));
        assert_eq!(s.scale, 512.0);
        for _ in 0..200 {
            assert!(s.update(true));
        }
        assert_eq!(s.scale, 1024.0);
        let mut b = LossScaler::new(Precision::Bf16, 1024.0);
        assert_eq!(b.scale, 1.0);
        b.update(true);
        assert_eq!(b.scale, 1.0);
    }
}
