//! The model's top: final RMSNorm, LM head and mean cross-entropy, fused in row chunks so the
//! `[tokens, vocab]` logits never exist at once. The LM-head weight is passed separately so it
//! can be the untied `lm_head.weight` or the tied embedding table.
//!
//! Early gradients: when the caller knows the gradient scale before the forward (a mean over
//! this batch's valid targets: `loss_scale / n_valid`), [`Head::forward_with_grad`] computes the
//! LM-head input and weight gradients during the forward, while each chunk of logits is in
//! cache, instead of recomputing the logits in the backward (3 head products instead of 4, or
//! 5 for the separable backward). The backward API is unchanged: `backward`,
//! `backward_input` and `backward_weight` return or accumulate what was computed early when
//! they are called with the same scale, and fall back to recomputing the logits for any other
//! scale (e.g. a mean over several ranks' tokens decided later). Either way the gradients are
//! the same: the one-pass kernel is bit-identical to forward-then-backward, and the early
//! weight gradient is added to the accumulator once (`g += dW`), which equals accumulating it
//! chunk by chunk up to f32 rounding when the accumulator already holds a gradient.

use std::sync::Arc;

use tensor::cross_entropy::{count_valid, CeConfig};
use tensor::ops::{fused_linear_ce, Lse};

use super::{rmsnorm, rmsnorm_backward_input, Act, Buf, BufMut, BufRef};
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
#[derive(Debug)]
pub struct HeadCache {
    x: Act,
    xn: Act,
    rstd: Act,
    lse: Buf,
    targets: Arc<Vec<i64>>,
    /// Sum of the loss over valid targets.
    pub loss_sum: f64,
    /// Number of valid (non-ignored) targets.
    pub n_valid: usize,
    early: Option<EarlyGrad>,
}

/// Gradients of `grad_scale · loss_sum` computed during the forward.
#[derive(Debug)]
struct EarlyGrad {
    grad_scale: f32,
    /// Gradient at the normed hidden states `[tokens, hidden]`.
    dxn: Buf,
    /// LM-head weight gradient `[vocab, hidden]`, not yet accumulated.
    dw: Buf,
}

impl HeadCache {
    /// The early gradients when they were computed for `grad_scale`.
    fn take_early(&mut self, grad_scale: f32) -> Option<EarlyGrad> {
        self.early.take().filter(|e| e.grad_scale == grad_scale)
    }
}

/// The head's deferred weight gradients (norm gain and LM head).
#[derive(Debug)]
pub struct HeadWeightGrad {
    xn: Act,
    dxn: Buf,
    x: Act,
    rstd: Act,
    targets: Arc<Vec<i64>>,
    lse: Buf,
    grad_scale: f32,
    /// LM-head weight gradient computed in the forward (else recomputed from the logits).
    early_dw: Option<Buf>,
}

impl HeadWeightGrad {
    /// Bytes held until the deferred weight gradients run.
    pub fn bytes(&self) -> usize {
        use super::act_bytes;
        act_bytes(&self.xn)
            + act_bytes(&self.dxn)
            + act_bytes(&self.x)
            + act_bytes(&self.rstd)
            + act_bytes(&self.lse)
            + 8 * self.targets.len()
            + self.early_dw.as_ref().map_or(0, act_bytes)
    }
}

/// `g += d` (the early LM-head weight gradient into its accumulator).
fn add_into(g: BufMut<'_>, d: &Buf) -> Result<()> {
    Ok(tensor::ops::add_assign(g, d.r())?)
}

impl HeadCache {
    /// Bytes this cache holds (input, normed input, rstd, lse, targets, and the early
    /// gradients `dxn` and `dW` when the forward computed them): the fused loss keeps no
    /// logits, so this is all the head keeps alive until its backward.
    pub fn bytes(&self) -> usize {
        super::act_bytes(&self.x)
            + super::act_bytes(&self.xn)
            + super::act_bytes(&self.rstd)
            + super::act_bytes(&self.lse)
            + std::mem::size_of_val(self.targets.as_slice())
            + self
                .early
                .as_ref()
                .map_or(0, |e| super::act_bytes(&e.dxn) + super::act_bytes(&e.dw))
    }
}

impl Head {
    fn hidden(&self) -> usize {
        self.norm.numel()
    }

    /// Loss sum and count for final hidden states `x [tokens, hidden]` and `targets [tokens]`.
    pub fn forward<'a1, 'a2>(
        &self,
        p_norm: impl Into<BufRef<'a1>>,
        lm: impl Into<BufRef<'a2>>,
        x: Act,
        targets: Arc<Vec<i64>>,
    ) -> Result<HeadCache> {
        let p_norm: BufRef<'_> = p_norm.into();
        let lm: BufRef<'_> = lm.into();
        self.forward_impl(p_norm, lm, x, targets, None)
    }

    /// [`Head::forward`] that also computes the LM-head gradients of `grad_scale · loss_sum`
    /// (see the module doc); the backward then reuses them when given the same scale.
    pub fn forward_with_grad<'a1, 'a2>(
        &self,
        p_norm: impl Into<BufRef<'a1>>,
        lm: impl Into<BufRef<'a2>>,
        x: Act,
        targets: Arc<Vec<i64>>,
        grad_scale: f32,
    ) -> Result<HeadCache> {
        let p_norm: BufRef<'_> = p_norm.into();
        let lm: BufRef<'_> = lm.into();
        self.forward_impl(p_norm, lm, x, targets, Some(grad_scale))
    }

    /// `loss_scale / n_valid` for `targets` (0 when none is valid): the gradient scale of a
    /// mean over this batch's valid targets.
    pub fn mean_grad_scale(&self, targets: &[i64], loss_scale: f32) -> Result<f32> {
        let n = count_valid(targets, self.vocab, self.ce.ignore_index)?;
        Ok(if n == 0 { 0.0 } else { loss_scale / n as f32 })
    }

    fn forward_impl(
        &self,
        p_norm: BufRef<'_>,
        lm: BufRef<'_>,
        x: Act,
        targets: Arc<Vec<i64>>,
        grad_scale: Option<f32>,
    ) -> Result<HeadCache> {
        let (xn, rstd) = rmsnorm(p_norm, &self.norm, x.r(), self.eps)?;
        let dev = xn.dev();
        let mut lse = dev.zeros(targets.len())?;
        let (out, early) = match grad_scale {
            None => {
                let out = time(Kernel::Head, || {
                    fused_linear_ce(
                        xn.r(),
                        lm,
                        &targets,
                        self.hidden(),
                        self.vocab,
                        &self.ce,
                        Lse::Write(lse.m()),
                        None,
                    )
                })?;
                (out, None)
            }
            Some(grad_scale) => {
                let mut dxn = dev.zeros(xn.len())?;
                let mut dw = dev.zeros(lm.len())?;
                let out = time(Kernel::Head, || {
                    fused_linear_ce(
                        xn.r(),
                        lm,
                        &targets,
                        self.hidden(),
                        self.vocab,
                        &self.ce,
                        Lse::Write(lse.m()),
                        Some((grad_scale, Some(dxn.m()), Some(dw.m()))),
                    )
                })?;
                let e = EarlyGrad {
                    grad_scale,
                    dxn,
                    dw,
                };
                (out, Some(e))
            }
        };
        Ok(HeadCache {
            x,
            xn: Arc::new(xn),
            rstd: Arc::new(rstd),
            lse,
            targets,
            loss_sum: out.loss_sum,
            n_valid: out.n_valid,
            early,
        })
    }

    /// Logits `[tokens, vocab]` (for evaluation and generation; training uses the fused loss).
    pub fn logits<'a1, 'a2, 'a3>(
        &self,
        p_norm: impl Into<BufRef<'a1>>,
        lm: impl Into<BufRef<'a2>>,
        x: impl Into<BufRef<'a3>>,
    ) -> Result<Buf> {
        let p_norm: BufRef<'_> = p_norm.into();
        let lm: BufRef<'_> = lm.into();
        let x: BufRef<'_> = x.into();
        let (xn, _) = rmsnorm(p_norm, &self.norm, x, self.eps)?;
        let rows = x.len() / self.hidden();
        Ok(tensor::ops::matmul_new(
            xn.r(),
            lm,
            rows,
            self.hidden(),
            self.vocab,
            false,
            true,
        )?)
    }

    /// The LM head's gradients (`dxn` into the normed input, `g_lm` accumulated) by recomputing
    /// the logits chunk by chunk from `cache`: the path when the forward's early gradients were
    /// not kept or were made for another scale.
    fn recompute_grads(
        &self,
        lm: BufRef<'_>,
        cache: &HeadCache,
        grad_scale: f32,
        dxn: Option<BufMut<'_>>,
        g_lm: Option<BufMut<'_>>,
    ) -> Result<()> {
        time(Kernel::Head, || {
            fused_linear_ce(
                cache.xn.r(),
                lm,
                &cache.targets,
                self.hidden(),
                self.vocab,
                &self.ce,
                Lse::Read(cache.lse.r()),
                Some((grad_scale, dxn, g_lm)),
            )
        })?;
        Ok(())
    }

    /// Input gradient of `grad_scale · loss_sum`; the weight gradients are deferred.
    pub fn backward_input<'a1, 'a2>(
        &self,
        p_norm: impl Into<BufRef<'a1>>,
        lm: impl Into<BufRef<'a2>>,
        mut cache: HeadCache,
        grad_scale: f32,
    ) -> Result<(Buf, HeadWeightGrad)> {
        let p_norm: BufRef<'_> = p_norm.into();
        let lm: BufRef<'_> = lm.into();
        let (dxn, early_dw) = match cache.take_early(grad_scale) {
            Some(e) => (e.dxn, Some(e.dw)),
            None => {
                let mut dxn = cache.x.dev().zeros(cache.x.len())?;
                self.recompute_grads(lm, &cache, grad_scale, Some(dxn.m()), None)?;
                (dxn, None)
            }
        };
        let dx = rmsnorm_backward_input(
            p_norm,
            &self.norm,
            cache.x.r(),
            cache.rstd.r(),
            dxn.r(),
            None,
        )?;
        let pending = HeadWeightGrad {
            xn: cache.xn,
            dxn,
            x: cache.x,
            rstd: cache.rstd,
            targets: cache.targets,
            lse: cache.lse,
            grad_scale,
            early_dw,
        };
        Ok((dx, pending))
    }

    /// Deferred weight gradients: norm gain into `g_norm`, LM head into `g_lm` (accumulated).
    pub fn backward_weight<'a1, 'a2, 'a3>(
        &self,
        lm: impl Into<BufRef<'a1>>,
        w: HeadWeightGrad,
        g_norm: impl Into<BufMut<'a2>>,
        g_lm: impl Into<BufMut<'a3>>,
    ) -> Result<()> {
        let lm: BufRef<'_> = lm.into();
        let g_norm: BufMut<'_> = g_norm.into();
        let g_lm: BufMut<'_> = g_lm.into();
        match &w.early_dw {
            Some(dw) => time(Kernel::Head, || add_into(g_lm, dw))?,
            None => {
                time(Kernel::Head, || {
                    fused_linear_ce(
                        w.xn.r(),
                        lm,
                        &w.targets,
                        self.hidden(),
                        self.vocab,
                        &self.ce,
                        Lse::Read(w.lse.r()),
                        Some((w.grad_scale, None, Some(g_lm))),
                    )
                })?;
            }
        }
        time(Kernel::Norm, || {
            tensor::ops::rmsnorm_backward_weight(
                w.dxn.r(),
                w.x.r(),
                w.rstd.r(),
                self.hidden(),
                self.norm.at_mut(g_norm),
            )
        })?;
        Ok(())
    }

    /// Fused backward (one pass over the logits for both gradients). Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<'a1, 'a2, 'a3, 'a4>(
        &self,
        p_norm: impl Into<BufRef<'a1>>,
        lm: impl Into<BufRef<'a2>>,
        mut cache: HeadCache,
        grad_scale: f32,
        g_norm: impl Into<BufMut<'a3>>,
        g_lm: impl Into<BufMut<'a4>>,
    ) -> Result<Buf> {
        let p_norm: BufRef<'_> = p_norm.into();
        let lm: BufRef<'_> = lm.into();
        let g_norm: BufMut<'_> = g_norm.into();
        let g_lm: BufMut<'_> = g_lm.into();
        let dxn = match cache.take_early(grad_scale) {
            Some(e) => {
                time(Kernel::Head, || add_into(g_lm, &e.dw))?;
                e.dxn
            }
            None => {
                let mut dxn = cache.x.dev().zeros(cache.x.len())?;
                self.recompute_grads(lm, &cache, grad_scale, Some(dxn.m()), Some(g_lm))?;
                dxn
            }
        };
        let dx = rmsnorm_backward_input(
            p_norm,
            &self.norm,
            cache.x.r(),
            cache.rstd.r(),
            dxn.r(),
            None,
        )?;
        time(Kernel::Norm, || {
            tensor::ops::rmsnorm_backward_weight(
                dxn.r(),
                cache.x.r(),
                cache.rstd.r(),
                self.hidden(),
                self.norm.at_mut(g_norm),
            )
        })?;
        Ok(dx)
    }
}
