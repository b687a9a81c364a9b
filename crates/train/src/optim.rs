//! The "gradient sync + optimizer step" boundary of the trainer.
//!
//! The trainer accumulates each rank's local gradients into [`Weights`] and then hands over to
//! a [`StepEngine`], which owns the optimizer state and does everything between "local
//! gradients ready" and "new weights ready": reduce gradients across data-parallel ranks,
//! compute the global gradient norm, clip, unscale (fp16), and apply AdamW to the fp32 master
//! weights. The single-process engine is [`LocalAdamW`]; DDP replaces the reduction with an
//! all-reduce, ZeRO with reduce-scatter + shard update + all-gather, behind the same trait.
use crate::error::Result;
use crate::precision::{LossScaler, Weights, CHUNK};
use model::{AdamW, AdamWState};

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping (of the unscaled gradient).
    pub grad_norm: f64,
    /// False when the step was skipped (non-finite gradients under fp16 loss scaling).
    pub applied: bool,
}

/// Gradient synchronisation plus optimizer update.
pub trait StepEngine {
    /// Turns the accumulated local gradients (of `loss_scale × mean loss`) into an update of
    /// the master weights at learning rate `lr`, refreshes the working weights and zeroes the
    /// gradients.
    fn step(
        &mut self,
        weights: &mut Weights,
        scaler: &mut LossScaler,
        lr: f64,
    ) -> Result<StepStats>;
    /// Mean of a scalar (e.g. the loss) over data-parallel ranks.
    fn mean_over_ranks(&mut self, x: f64) -> Result<f64>;
    /// The optimizer state, for checkpoints.
    fn state(&self) -> &AdamWState;
    fn state_mut(&mut self) -> &mut AdamWState;
}

/// Single-process AdamW with global-norm clipping.
pub struct LocalAdamW {
    pub hyper: AdamW,
    /// Max global gradient norm (0 disables clipping).
    pub clip: f64,
    pub state: AdamWState,
}

impl LocalAdamW {
    pub fn new(hyper: AdamW, clip: f64, num_params: usize) -> Self {
        Self {
            hyper,
            clip,
            state: AdamWState::new(num_params),
        }
    }
}

/// The optimizer update shared by every engine once gradients are reduced: clip, unscale,
/// AdamW on the master weights, refresh the working copy. `grad_sq` is the global Σg² of the
/// stored (scaled) gradients.
pub fn apply_update(
    hyper: &AdamW,
    clip: f64,
    state: &mut AdamWState,
    weights: &mut Weights,
    scaler: &mut LossScaler,
    grad_sq: f64,
    lr: f64,
) -> StepStats {
    let finite = grad_sq.is_finite();
    // True gradient = stored / scale, so ‖g‖ = sqrt(Σ stored²) / scale.
    let grad_norm = grad_sq.sqrt() / scaler.scale;
    if !scaler.update(finite) {
        weights.zero_grads();
        return StepStats {
            grad_norm,
            applied: false,
        };
    }
    // torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (‖g‖ + 1e-6)).
    let clip_coef = if clip > 0.0 {
        (clip / (grad_norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    let factor = (clip_coef / scaler.scale) as f32;
    state.step += 1;
    let (t, lr, wd) = (state.step, lr as f32, hyper.weight_decay);
    match weights {
        Weights::Full { params, grads } => {
            if factor != 1.0 {
                tensor::threads::scale(grads, factor);
            }
            hyper.update(t, lr, wd, params, grads, &mut state.m, &mut state.v);
        }
        Weights::Half {
            kind,
            params,
            grads,
            master,
        } => {
            let mut g = vec![0.0f32; CHUNK];
            for start in (0..master.len()).step_by(CHUNK) {
                let end = (start + CHUNK).min(master.len());
                let g = &mut g[..end - start];
                kind.upcast(&grads[start..end], g);
                g.iter_mut().for_each(|x| *x *= factor);
                hyper.update(
                    t,
                    lr,
                    wd,
                    &mut master[start..end],
                    g,
                    &mut state.m[start..end],
                    &mut state.v[start..end],
                );
                kind.downcast(&master[start..end], &mut params[start..end]);
            }
        }
    }
    weights.zero_grads();
    StepStats {
        grad_norm,
        applied: true,
    }
}

impl StepEngine for LocalAdamW {
    fn step(
        &mut self,
        weights: &mut Weights,
        scaler: &mut LossScaler,
        lr: f64,
    ) -> Result<StepStats> {
        let grad_sq = weights.grad_sq_sum();
        Ok(apply_update(
            &self.hyper,
            self.clip,
            &mut self.state,
            weights,
            scaler,
            grad_sq,
            lr,
        ))
    }

    fn mean_over_ranks(&mut self, x: f64) -> Result<f64> {
        Ok(x)
    }

    fn state(&self) -> &AdamWState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut AdamWState {
        &mut self.state
    }
}
