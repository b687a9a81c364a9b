//! The model's top: final RMSNorm, LM head and mean cross-entropy, fused in row chunks so the
//! `[tokens, vocab]` logits never exist at once. The LM-head weight is passed separately so it
//! can be the untied `lm_head.weight` or the tied embedding table.

use std::sync::Arc;

use tensor::cross_entropy::{fused_linear_ce_backward, fused_linear_ce_forward, CeConfig};

use super::{rmsnorm, rmsnorm_backward_input, Act};
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// Final norm + LM head + cross-entropy.
#[derive(Debug, Clone)]
pub struct Head {
    /// `model.norm.weight`, relative to the slice passed as `p_norm`.
    pub norm: View,
    pub vocab: usize,
    pub eps: f32,
    pub ce: CeConfig,
}

/// What the head's backward needs.
#[derive(Debug, Clone)]
pub struct HeadCache {
    x: Act,
    xn: Act,
    rstd: Act,
    lse: Vec<f32>,
    targets: Arc<Vec<i64>>,
    /// Sum of the loss over valid targets.
    pub loss_sum: f64,
    /// Number of valid (non-ignored) targets.
    pub n_valid: usize,
}

/// The head's deferred weight gradients (norm gain and LM head).
#[derive(Debug, Clone)]
pub struct HeadWeightGrad {
    xn: Act,
    dxn: Vec<f32>,
    x: Act,
    rstd: Act,
    targets: Arc<Vec<i64>>,
    lse: Vec<f32>,
    grad_scale: f32,
}

impl HeadCache {
    /// Bytes this cache holds (input, normed input, rstd, lse, targets): the fused loss keeps
    /// no logits, so this is all the head keeps alive until its backward.
    pub fn bytes(&self) -> usize {
        super::act_bytes(&self.x)
            + super::act_bytes(&self.xn)
            + super::act_bytes(&self.rstd)
            + super::act_bytes(&self.lse)
            + std::mem::size_of_val(self.targets.as_slice())
    }
}

impl Head {
    fn hidden(&self) -> usize {
        self.norm.numel()
    }

    /// Loss sum and count for final hidden states `x [tokens, hidden]` and `targets [tokens]`.
    pub fn forward(
        &self,
        p_norm: &[f32],
        lm: &[f32],
        x: Act,
        targets: Arc<Vec<i64>>,
    ) -> Result<HeadCache> {
        let (xn, rstd) = rmsnorm(p_norm, &self.norm, &x, self.eps)?;
        let mut lse = vec![0.0; targets.len()];
        let out = time(Kernel::Head, || {
            fused_linear_ce_forward(
                &xn,
                lm,
                &targets,
                self.hidden(),
                self.vocab,
                &self.ce,
                &mut lse,
            )
        })?;
        Ok(HeadCache {
            x,
            xn: Arc::new(xn),
            rstd: Arc::new(rstd),
            lse,
            targets,
            loss_sum: out.loss_sum,
            n_valid: out.n_valid,
        })
    }

    /// Logits `[tokens, vocab]` (for evaluation and generation; training uses the fused loss).
    pub fn logits(&self, p_norm: &[f32], lm: &[f32], x: &[f32]) -> Result<Vec<f32>> {
        let (xn, _) = rmsnorm(p_norm, &self.norm, x, self.eps)?;
        let rows = x.len() / self.hidden();
        let mut z = vec![0.0; rows * self.vocab];
        tensor::gemm::matmul(
            &mut z,
            &xn,
            lm,
            rows,
            self.hidden(),
            self.vocab,
            false,
            true,
            false,
        )?;
        Ok(z)
    }

    /// Input gradient of `grad_scale · loss_sum`; the weight gradients are deferred.
    pub fn backward_input(
        &self,
        p_norm: &[f32],
        lm: &[f32],
        cache: HeadCache,
        grad_scale: f32,
    ) -> Result<(Vec<f32>, HeadWeightGrad)> {
        let mut dxn = vec![0.0; cache.x.len()];
        time(Kernel::Head, || {
            fused_linear_ce_backward(
                &cache.xn,
                lm,
                &cache.targets,
                &cache.lse,
                self.hidden(),
                self.vocab,
                &self.ce,
                grad_scale,
                Some(&mut dxn),
                None,
            )
        })?;
        let mut dx = vec![0.0; cache.x.len()];
        rmsnorm_backward_input(p_norm, &self.norm, &cache.x, &cache.rstd, &dxn, &mut dx)?;
        let pending = HeadWeightGrad {
            xn: cache.xn,
            dxn,
            x: cache.x,
            rstd: cache.rstd,
            targets: cache.targets,
            lse: cache.lse,
            grad_scale,
        };
        Ok((dx, pending))
    }

    /// Deferred weight gradients: norm gain into `g_norm`, LM head into `g_lm` (accumulated).
    pub fn backward_weight(
        &self,
        p_norm: &[f32],
        lm: &[f32],
        w: HeadWeightGrad,
        g_norm: &mut [f32],
        g_lm: &mut [f32],
    ) -> Result<()> {
        time(Kernel::Head, || {
            fused_linear_ce_backward(
                &w.xn,
                lm,
                &w.targets,
                &w.lse,
                self.hidden(),
                self.vocab,
                &self.ce,
                w.grad_scale,
                None,
                Some(g_lm),
            )
        })?;
        time(Kernel::Norm, || {
            tensor::norm::rmsnorm_backward(
                &w.dxn,
                &w.x,
                self.norm.of(p_norm),
                &w.rstd,
                self.hidden(),
                None,
                Some(self.norm.of_mut(g_norm)),
            )
        })?;
        Ok(())
    }

    /// Fused backward (one pass over the logits for both gradients). Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        p_norm: &[f32],
        lm: &[f32],
        cache: HeadCache,
        grad_scale: f32,
        g_norm: &mut [f32],
        g_lm: &mut [f32],
    ) -> Result<Vec<f32>> {
        let mut dxn = vec![0.0; cache.x.len()];
        time(Kernel::Head, || {
            fused_linear_ce_backward(
                &cache.xn,
                lm,
                &cache.targets,
                &cache.lse,
                self.hidden(),
                self.vocab,
                &self.ce,
                grad_scale,
                Some(&mut dxn),
                Some(g_lm),
            )
        })?;
        let mut dx = vec![0.0; cache.x.len()];
        rmsnorm_backward_input(p_norm, &self.norm, &cache.x, &cache.rstd, &dxn, &mut dx)?;
        time(Kernel::Norm, || {
            tensor::norm::rmsnorm_backward(
                &dxn,
                &cache.x,
                self.norm.of(p_norm),
                &cache.rstd,
                self.hidden(),
                None,
                Some(self.norm.of_mut(g_norm)),
            )
        })?;
        Ok(dx)
    }
}
