//! AdamW over a flat (sub-)range and global gradient-norm clipping from partial sums.
//!
//! Decoupled weight decay (Loshchilov & Hutter 2019), as torch.optim.AdamW:
//! `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g²`,
//! `p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p)`.
//! Each element's update depends only on its own p, g, m, v, so a ZeRO rank updating its range
//! computes exactly what the single process computes there. Clipping needs the global norm:
//! every rank sums g² over the elements it owns and the sums are all-reduced.

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl AdamW {
    /// One update of step `t` (1-based) on equal-length slices; grads are multiplied by
    /// `grad_scale` first (the clipping coefficient).
    pub fn update(
        &self,
        t: u64,
        grad_scale: f32,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        for i in 0..p.len() {
            let gi = g[i] * grad_scale;
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
            let mhat = m[i] / bc1;
            let vhat = v[i] / bc2;
            p[i] -= self.lr * (mhat / (vhat.sqrt() + self.eps) + self.weight_decay * p[i]);
        }
    }
}

/// Partial sum of squares in f64 (so that summing shards in any grouping agrees to f32
/// precision with the single-process norm).
pub fn sum_sq(g: &[f32]) -> f64 {
    g.iter().map(|&x| (x as f64) * (x as f64)).sum()
}

/// Clipping coefficient for global norm `norm` and threshold `max_norm` (torch's
/// `clip_grad_norm_`: `min(1, max_norm / (norm + 1e-6))`).
pub fn clip_coef(norm: f64, max_norm: Option<f32>) -> f32 {
    match max_norm {
        Some(c) => ((c as f64) / (norm + 1e-6)).min(1.0) as f32,
        None => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_by_lr_times_sign() {
        // At t = 1, mhat = g and vhat = g², so the step is lr * g/|g| (+ decay).
        let opt = AdamW {
            lr: 0.1,
            weight_decay: 0.0,
            eps: 0.0,
            ..AdamW::default()
        };
        let (mut p, g, mut m, mut v) =
            (vec![1.0, 1.0], vec![3.0, -0.5], vec![0.0; 2], vec![0.0; 2]);
        opt.update(1, 1.0, &mut p, &g, &mut m, &mut v);
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6);
        assert_eq!(clip_coef(10.0, Some(1.0)), (1.0 / (10.0 + 1e-6)) as f32);
        assert_eq!(clip_coef(0.5, Some(1.0)), 1.0);
    }
}
