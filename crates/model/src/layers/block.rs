//! A pre-norm decoder block: `h = x + Attn(RMSNorm(x))`, `y = h + FFN(RMSNorm(h))`, with the
//! FFN a SwiGLU MLP (Llama) or a mixture of experts (Mixtral), and activation recomputation.

use std::sync::Arc;

use super::attention::{Attention, AttnCache};
use super::mlp::{MlpCache, SwiGlu};
use super::moe::{Moe, MoeCache};
use super::{rmsnorm, rmsnorm_backward_input, Act, Pass, Recompute, WeightGradStore, WeightTask};
use crate::error::Result;
use crate::layout::View;

/// The feed-forward half of a block.
#[derive(Debug, Clone)]
pub enum Ffn {
    Dense(SwiGlu),
    Moe(Moe),
}

#[derive(Debug, Clone)]
enum FfnCache {
    Dense(MlpCache),
    Moe(MoeCache),
}

/// A decoder block (views relative to the block's parameter range).
#[derive(Debug, Clone)]
pub struct Block {
    pub attn_norm: View,
    pub attn: Attention,
    pub ffn_norm: View,
    pub ffn: Ffn,
    pub eps: f32,
}

#[derive(Debug, Clone)]
struct Saved {
    xn1: Option<Act>,
    rstd1: Act,
    attn: AttnCache,
    h: Act,
    xn2: Option<Act>,
    rstd2: Act,
    ffn: FfnCache,
}

/// What a block's backward needs; with [`Recompute::Full`] only the input is held.
#[derive(Debug, Clone)]
pub struct BlockCache {
    pass: Pass,
    x: Act,
    saved: Option<Saved>,
    aux: f32,
    routing: Option<super::moe::Routing>,
}

impl BlockCache {
    /// Weighted auxiliary loss of this block (its contribution to the total loss; 0 if dense).
    pub fn aux_loss(&self) -> f32 {
        self.aux
    }
    /// The pass this cache was made with.
    pub fn pass(&self) -> &Pass {
        &self.pass
    }
    /// The MoE routing of the forward, when recorded (not under full recomputation).
    pub fn routing(&self) -> Option<&super::moe::Routing> {
        self.routing.as_ref()
    }
}

impl Block {
    /// `x [tokens, hidden] -> y [tokens, hidden]`.
    pub fn forward(&self, p: &[f32], x: Act, pass: &Pass) -> Result<(Vec<f32>, BlockCache)> {
        let (y, saved, aux) = self.forward_saved(p, &x, pass)?;
        let keep = pass.recompute != Recompute::Full;
        let routing = match (&saved.ffn, keep) {
            (FfnCache::Moe(c), true) => Some(c.routing.clone()),
            _ => None,
        };
        let cache = BlockCache {
            pass: *pass,
            x,
            saved: keep.then_some(saved),
            aux,
            routing,
        };
        Ok((y, cache))
    }

    fn forward_saved(&self, p: &[f32], x: &Act, pass: &Pass) -> Result<(Vec<f32>, Saved, f32)> {
        let selective = pass.recompute == Recompute::Selective;
        let (xn1, rstd1) = rmsnorm(p, &self.attn_norm, x, self.eps)?;
        let (a, attn) = self.attn.forward(p, &xn1, pass)?;
        let mut h = a;
        h.iter_mut().zip(x.iter()).for_each(|(a, b)| *a += b);
        let (xn2, rstd2) = rmsnorm(p, &self.ffn_norm, &h, self.eps)?;
        let (mut y, ffn, aux) = match &self.ffn {
            Ffn::Dense(m) => {
                let (y, c) = m.forward(p, &xn2, !selective)?;
                (y, FfnCache::Dense(c), 0.0)
            }
            Ffn::Moe(m) => {
                let (y, c) = m.forward(p, &xn2, pass)?;
                let aux = m.aux_coef * c.aux;
                (y, FfnCache::Moe(c), aux)
            }
        };
        y.iter_mut().zip(&h).for_each(|(a, b)| *a += b);
        let saved = Saved {
            xn1: (!selective).then(|| Arc::new(xn1)),
            rstd1: Arc::new(rstd1),
            attn,
            h: Arc::new(h),
            xn2: (!selective).then(|| Arc::new(xn2)),
            rstd2: Arc::new(rstd2),
            ffn,
        };
        Ok((y, saved, aux))
    }

    /// Input gradient of the block; every weight gradient is left in the returned store.
    pub fn backward_input(
        &self,
        p: &[f32],
        cache: BlockCache,
        dy: Vec<f32>,
    ) -> Result<(Vec<f32>, WeightGradStore)> {
        let pass = cache.pass;
        let x = cache.x;
        let s = match cache.saved {
            Some(s) => s,
            None => {
                let full = pass.with_recompute(Recompute::None);
                self.forward_saved(p, &x, &full)?.1
            }
        };
        let mut store = WeightGradStore::new();
        let dy = Arc::new(dy);
        // FFN half.
        let xn2 = match s.xn2 {
            Some(v) => v,
            None => Arc::new(rmsnorm(p, &self.ffn_norm, &s.h, self.eps)?.0),
        };
        let dxn2 = match (&self.ffn, s.ffn) {
            (Ffn::Dense(m), FfnCache::Dense(c)) => {
                m.backward_input(p, &xn2, c, dy.clone(), &mut store)?
            }
            (Ffn::Moe(m), FfnCache::Moe(c)) => {
                m.backward_input(p, &xn2, c, dy.clone(), &pass, &mut store)?
            }
            _ => unreachable!("cache built by this block's own forward"),
        };
        let mut dh = Arc::try_unwrap(dy).unwrap_or_else(|a| (*a).clone());
        rmsnorm_backward_input(p, &self.ffn_norm, &s.h, &s.rstd2, &dxn2, &mut dh)?;
        store.push(WeightTask::Norm {
            w: self.ffn_norm.clone(),
            dy: Arc::new(dxn2),
            x: s.h,
            rstd: s.rstd2,
        });
        // Attention half.
        let xn1 = match s.xn1 {
            Some(v) => v,
            None => Arc::new(rmsnorm(p, &self.attn_norm, &x, self.eps)?.0),
        };
        let dh = Arc::new(dh);
        let dxn1 = self
            .attn
            .backward_input(p, &xn1, s.attn, dh.clone(), &pass, &mut store)?;
        let mut dx = (*dh).clone();
        rmsnorm_backward_input(p, &self.attn_norm, &x, &s.rstd1, &dxn1, &mut dx)?;
        store.push(WeightTask::Norm {
            w: self.attn_norm.clone(),
            dy: Arc::new(dxn1),
            x,
            rstd: s.rstd1,
        });
        Ok((dx, store))
    }

    /// Weight gradients recorded by [`Block::backward_input`], accumulated into `g`.
    pub fn backward_weight(&self, p: &[f32], store: WeightGradStore, g: &mut [f32]) -> Result<()> {
        store.apply(p, g)
    }

    /// Fused backward: input gradient returned, weight gradients accumulated into `g`.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        cache: BlockCache,
        dy: Vec<f32>,
    ) -> Result<Vec<f32>> {
        let (dx, store) = self.backward_input(p, cache, dy)?;
        self.backward_weight(p, store, g)?;
        Ok(dx)
    }
}
