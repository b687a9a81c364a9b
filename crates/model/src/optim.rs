//! AdamW over flat buffers (or any sub-range of them, so a ZeRO rank updates only its shard)
//! with exactly `torch.optim.AdamW` semantics, and global gradient-norm clipping split into a
//! partial sum of squares (all-reducible across shards) and a scale step.
//!
//! torch.optim.AdamW (single-tensor path), for step t = 1, 2, ...:
//! ```text
//! p  <- p * (1 - lr * wd)                      (decoupled weight decay)
//! m  <- lerp(m, g, 1 - beta1)                  (= beta1 m + (1 - beta1) g)
//! v  <- beta2 v + (1 - beta2) g^2
//! p  <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```

use rayon::prelude::*;

/// AdamW hyper-parameters (torch defaults except `weight_decay`, which torch sets to 0.01).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// First and second moments for one range of parameters, plus the step counter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWState {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Number of steps taken so far (torch's `state['step']`).
    pub step: u64,
}

impl AdamWState {
    /// Zero state for `n` parameters.
    pub fn new(n: usize) -> Self {
        AdamWState {
            m: vec![0.0; n],
            v: vec![0.0; n],
            step: 0,
        }
    }
}

const CHUNK: usize = 1 << 14;

impl AdamW {
    /// One optimizer step on `params` with gradients `grads` (same length as the state) at
    /// learning rate `lr` (from the schedule; `self.lr` is ignored here). Advances
    /// `state.step`. `weight_decay` applies to every element; use [`AdamW::step_segments`]
    /// for parameter groups.
    pub fn step(&self, state: &mut AdamWState, params: &mut [f32], grads: &[f32], lr: f32) {
        state.step += 1;
        self.update(
            state.step,
            lr,
            self.weight_decay,
            params,
            grads,
            &mut state.m,
            &mut state.v,
        );
    }

    /// One step where `segments` (relative ranges covering `params`, with their weight decay)
    /// select the decay per parameter group (e.g. no decay on norm gains).
    pub fn step_segments(
        &self,
        state: &mut AdamWState,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        segments: &[(std::ops::Range<usize>, f32)],
    ) {
        state.step += 1;
        for (r, wd) in segments {
            self.update(
                state.step,
                lr,
                *wd,
                &mut params[r.clone()],
                &grads[r.clone()],
                &mut state.m[r.clone()],
                &mut state.v[r.clone()],
            );
        }
    }

    /// The element-wise update at step `t` (already incremented), for any aligned slices.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        t: u64,
        lr: f32,
        weight_decay: f32,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        self.update_scaled(t, lr, weight_decay, 1.0, params, grads, m, v)
    }

    /// [`AdamW::update`] with the gradients `grad_scale · grads`: the clipping and unscaling
    /// factor applied in the same pass (one read of the gradients instead of a scaling pass
    /// and a read; `g · s` rounds as [`scale_grads`] stores it, and `g · 1` is `g`).
    #[allow(clippy::too_many_arguments)]
    pub fn update_scaled(
        &self,
        t: u64,
        lr: f32,
        weight_decay: f32,
        grad_scale: f32,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let n = params.len();
        assert!(
            grads.len() == n && m.len() == n && v.len() == n,
            "AdamW slice lengths differ"
        );
        let step = self.at_step(t, lr, weight_decay, grad_scale);
        // On the budget pool (as every kernel): a bare parallel iterator would run on rayon's
        // global pool, one thread per core whatever the process's budget.
        tensor::threads::install(|| {
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| step.apply(p, g, m, v))
        });
    }

    /// The update's scalars at step `t` (already incremented): [`AdamStep::apply`] runs it
    /// on the calling thread, for callers that spread their own pieces over the threads.
    pub fn at_step(&self, t: u64, lr: f32, weight_decay: f32, grad_scale: f32) -> AdamStep {
        assert!(t >= 1, "AdamW step counter starts at 1");
        // Scalars in f64 as torch computes them in Python floats.
        let (b1, b2) = (self.beta1 as f64, self.beta2 as f64);
        let bc1 = 1.0 - b1.powi(t as i32);
        AdamStep {
            grad_scale,
            decay: 1.0 - lr * weight_decay,
            one_m_b1: 1.0 - self.beta1,
            b2: self.beta2,
            one_m_b2: 1.0 - self.beta2,
            eps: self.eps,
            bc2_sqrt: (1.0 - b2.powi(t as i32)).sqrt() as f32,
            step_size: (lr as f64 / bc1) as f32,
        }
    }
}

/// One AdamW step's scalars ([`AdamW::at_step`]).
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    grad_scale: f32,
    decay: f32,
    one_m_b1: f32,
    b2: f32,
    one_m_b2: f32,
    eps: f32,
    bc2_sqrt: f32,
    step_size: f32,
}

impl AdamStep {
    /// The element-wise update of equally long slices, on the calling thread:
    /// `g = s·grad; p ← p·(1 − lr·wd); m ← m + (1 − β1)(g − m); v ← β2·v + (1 − β2)·g²;
    /// p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)` (torch's AdamW, in its order).
    pub fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let s = *self;
        // Zipped iterators (no index bounds checks) let the loop vectorise; each element sees
        // the same operations in the same order as before.
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let gi = g * s.grad_scale;
            *p *= s.decay;
            *m += s.one_m_b1 * (gi - *m);
            *v = *v * s.b2 + s.one_m_b2 * gi * gi;
            let denom = v.sqrt() / s.bc2_sqrt + s.eps;
            *p -= s.step_size * (*m / denom);
        }
    }
}

/// Sum of squares of `grads` in f64: the partial that shards all-reduce before clipping.
/// Chunk partials are added in chunk order ([`tensor::threads::sum_chunks`]), so the result does
/// not depend on the thread count.
pub fn grad_sq_sum(grads: &[f32]) -> f64 {
    tensor::threads::sum_chunks(grads.len(), CHUNK, |r| sq_sum(&grads[r]))
}

/// `Σ g²` of one slice in f64, on the calling thread.
pub fn sq_sum(grads: &[f32]) -> f64 {
    grads.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>()
}

/// The factor torch's `clip_grad_norm_` multiplies gradients by:
/// `min(1, max_norm / (total_norm + 1e-6))`, with `total_norm = sqrt(total_sq)`.
/// Returns `(total_norm, factor)`.
pub fn clip_factor(total_sq: f64, max_norm: f32) -> (f32, f32) {
    let norm = total_sq.sqrt();
    let coef = (max_norm as f64 / (norm + 1e-6)).min(1.0);
    (norm as f32, coef as f32)
}

/// Multiply every gradient by `factor` (no-op when it is 1).
pub fn scale_grads(grads: &mut [f32], factor: f32) {
    if factor != 1.0 {
        tensor::threads::install(|| {
            grads
                .par_chunks_mut(CHUNK)
                .for_each(|c| c.iter_mut().for_each(|g| *g *= factor))
        });
    }
}

/// Clip a whole (unsharded) gradient buffer to `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let (norm, f) = clip_factor(grad_sq_sum(grads), max_norm);
    scale_grads(grads, f);
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive scalar AdamW in f64 written straight from the torch docs.
    fn reference(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: i32, o: &AdamW) {
        let (lr, b1, b2, eps, wd) = (
            o.lr as f64,
            o.beta1 as f64,
            o.beta2 as f64,
            o.eps as f64,
            o.weight_decay as f64,
        );
        for i in 0..p.len() {
            p[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let mh = m[i] / (1.0 - b1.powi(t));
            let vh = v[i] / (1.0 - b2.powi(t));
            p[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }

    #[test]
    fn matches_reference_and_shards_agree() {
        let o = AdamW {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let n = 40_000;
        let mut rng = crate::init::SplitMix64::new(3);
        let mut p: Vec<f32> = (0..n).map(|_| rng.next_normal() as f32).collect();
        let mut p_sh = p.clone();
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
        let mut st = AdamWState::new(n);
        let mut sh = [AdamWState::new(15_000), AdamWState::new(n - 15_000)];
        for t in 1..=3 {
            let g: Vec<f32> = (0..n).map(|_| rng.next_normal() as f32).collect();
            let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            o.step(&mut st, &mut p, &g, o.lr);
            let (pa, pb) = p_sh.split_at_mut(15_000);
            o.step(&mut sh[0], pa, &g[..15_000], o.lr);
            o.step(&mut sh[1], pb, &g[15_000..], o.lr);
            reference(&mut pr, &gr, &mut mr, &mut vr, t, &o);
        }
        assert_eq!(p, p_sh, "sharded update must be bitwise identical");
        for i in 0..n {
            assert!(
                (p[i] as f64 - pr[i]).abs() <= 1e-5 * (1.0 + pr[i].abs()),
                "{i}: {} vs {}",
                p[i],
                pr[i]
            );
        }
    }

    #[test]
    fn clipping_from_partials() {
        let mut g = vec![3.0f32, 4.0, 0.0, 12.0];
        let partial = grad_sq_sum(&g[..2]) + grad_sq_sum(&g[2..]);
        let (norm, f) = clip_factor(partial, 6.5);
        assert!((norm - 13.0).abs() < 1e-6);
        scale_grads(&mut g, f);
        assert!((grad_sq_sum(&g).sqrt() - 6.5).abs() < 1e-4);
        let mut h = vec![0.1f32, 0.2];
        let before = h.clone();
        clip_grad_norm(&mut h, 1.0);
        assert_eq!(h, before);
    }
}
