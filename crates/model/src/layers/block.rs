//! A pre-norm decoder block: `h = x + Attn(RMSNorm(x))`, `y = h + FFN(RMSNorm(h))`, with the
//! FFN a SwiGLU MLP (Llama) or a mixture of experts (Mixtral), and activation recomputation.
//!
//! Tensor (and sequence) parallelism reuse this block unchanged: build it with a rank's local
//! head counts / FFN width and views into a local shard, and give it [`RegionHooks`], the
//! Megatron `f`/`g` operators around each parallel region (attention and FFN):
//! `enter` (TP: identity forward, all-reduce backward; SP: all-gather / reduce-scatter) and
//! `exit` (TP: all-reduce forward, identity backward; SP: reduce-scatter / all-gather).

use std::sync::Arc;

use super::attention::{Attention, AttnCache};
use super::mlp::{MlpCache, SwiGlu};
use super::moe::{Moe, MoeCache};
use super::{
    act_bytes, rmsnorm, rmsnorm_backward_input, rmsnorm_prepared, Act, Buf, BufMut, BufRef, Kept,
    Pass, Recompute, WeightGradStore, WeightTask,
};
use crate::error::Result;
use crate::layout::View;

/// Communication at the borders of a block's parallel regions (see the module doc). Each
/// method takes and returns a whole activation / gradient buffer on the host (a GPU's
/// activations go through host memory around the call).
pub trait RegionHooks: Send + Sync + std::fmt::Debug {
    /// Input of a region, forward (TP: identity). Each map takes and returns a buffer on the
    /// activation's device; how its collective reaches the other ranks is the hooks' own
    /// business (through host memory, or on the devices).
    fn enter_forward(&self, x: Buf) -> Result<Buf>;
    /// Gradient of a region's input, backward (TP: all-reduce sum).
    fn enter_backward(&self, dx: Buf) -> Result<Buf>;
    /// Output of a region, forward (TP: all-reduce sum of the partial outputs).
    fn exit_forward(&self, y: Buf) -> Result<Buf>;
    /// Gradient of a region's output, backward (TP: identity).
    fn exit_backward(&self, dy: Buf) -> Result<Buf>;
}

/// The feed-forward half of a block.
#[derive(Debug, Clone)]
pub enum Ffn {
    Dense(SwiGlu),
    Moe(Moe),
}

#[derive(Debug, Clone)]
enum FfnCache {
    Dense(MlpCache),
    Moe(Box<MoeCache>),
}

/// A decoder block (views relative to the block's parameter range).
#[derive(Debug, Clone)]
pub struct Block {
    pub attn_norm: View,
    pub attn: Attention,
    pub ffn_norm: View,
    pub ffn: Ffn,
    pub eps: f32,
    /// Parallel-region communication (`None`: single device).
    pub hooks: Option<Arc<dyn RegionHooks>>,
}

/// The block's activations between its forward and backward. The two norm outputs are
/// read again only by weight-gradient products (and a mixture of experts' dispatch), so they
/// are kept prepared for products ([`Kept`]: on a GPU in bf16 / fp16 the rounded copy alone).
#[derive(Debug, Clone)]
struct Saved {
    xn1: Option<Kept>,
    rstd1: Act,
    attn: AttnCache,
    h: Act,
    xn2: Option<Kept>,
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
    /// Bytes this cache holds in the norm / residual region: the block input, the residual
    /// after attention `h`, and the two RMSNorm `rstd` vectors (what sequence parallelism
    /// splits over the tp group). The region-internal activations are not counted.
    pub fn residual_bytes(&self) -> usize {
        let saved = self.saved.as_ref();
        4 * (self.x.len() + saved.map_or(0, |s| s.h.len() + s.rstd1.len() + s.rstd2.len()))
    }
    /// Bytes this cache holds (the block input, the saved activations and the MoE routing):
    /// what the block keeps alive between its forward and its backward.
    pub fn bytes(&self) -> usize {
        let opt = |a: &Option<Kept>| a.as_ref().map_or(0, Kept::bytes);
        let saved = self.saved.as_ref().map_or(0, |s| {
            let ffn = match &s.ffn {
                FfnCache::Dense(c) => c.bytes(),
                FfnCache::Moe(c) => c.bytes(),
            };
            opt(&s.xn1)
                + act_bytes(&s.rstd1)
                + s.attn.bytes()
                + act_bytes(&s.h)
                + opt(&s.xn2)
                + act_bytes(&s.rstd2)
                + ffn
        });
        act_bytes(&self.x) + saved + self.routing.as_ref().map_or(0, |r| r.bytes())
    }
    /// The MoE routing of the forward, when recorded (not under full recomputation).
    pub fn routing(&self) -> Option<&super::moe::Routing> {
        self.routing.as_ref()
    }
}

impl Block {
    /// `x [tokens, hidden] -> y [tokens, hidden]`.
    pub fn forward<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: Act,
        pass: &Pass,
    ) -> Result<(Buf, BlockCache)> {
        let p: BufRef<'_> = p.into();
        let (y, saved, aux) = self.forward_saved(p, &x, pass)?;
        let keep = pass.recompute != Recompute::Full;
        let routing = match (&saved.ffn, keep) {
            (FfnCache::Moe(c), true) => Some(c.routing.clone()),
            _ => None,
        };
        let cache = BlockCache {
            pass: pass.clone(),
            x,
            saved: keep.then_some(saved),
            aux,
            routing,
        };
        Ok((y, cache))
    }

    fn forward_saved(&self, p: BufRef<'_>, x: &Act, pass: &Pass) -> Result<(Buf, Saved, f32)> {
        let selective = pass.recompute == Recompute::Selective;
        let (xn1, rstd1) = self.normed(p, &self.attn_norm, x.r(), true)?;
        let (a, attn) = self.attn.forward(p, xn1.r(), pass)?;
        let mut h = self.exit(a)?;
        tensor::ops::add_assign(h.m(), x.r())?;
        let (xn2, rstd2) = self.normed(p, &self.ffn_norm, h.r(), self.dense())?;
        let (mut y, ffn, aux) = match (&self.ffn, xn2.values()) {
            (Ffn::Dense(m), _) => {
                let (y, c) = m.forward(p, xn2.r(), !selective)?;
                (y, FfnCache::Dense(c), 0.0)
            }
            (Ffn::Moe(m), Some(x)) => {
                let (y, c) = m.forward(p, x.r(), pass)?;
                let aux = m.aux_coef * c.aux;
                (y, FfnCache::Moe(Box::new(c)), aux)
            }
            (Ffn::Moe(_), None) => unreachable!("a mixture of experts keeps its input's values"),
        };
        y = self.exit(y)?;
        tensor::ops::add_assign(y.m(), h.r())?;
        let saved = Saved {
            xn1: (!selective).then_some(xn1),
            rstd1: Arc::new(rstd1),
            attn,
            h: Arc::new(h),
            xn2: (!selective).then_some(xn2),
            rstd2: Arc::new(rstd2),
            ffn,
        };
        Ok((y, saved, aux))
    }

    /// Whether the feed-forward is a dense MLP (its input only feeds products).
    fn dense(&self) -> bool {
        matches!(self.ffn, Ffn::Dense(_))
    }

    /// `(RMSNorm of x, rstd)`, the normed values as the layer after the norm keeps them:
    /// prepared for its products (`for_products`: the attention projections, a dense MLP), or
    /// the values (a mixture of experts, which also routes and dispatches them). Without
    /// hooks the norm kernel itself writes the prepared operand ([`tensor::prepared`]); a
    /// tensor-parallel region's entry (sequence parallelism's gather) comes between the norm
    /// and the preparation.
    fn normed(
        &self,
        p: BufRef<'_>,
        w: &View,
        x: BufRef<'_>,
        for_products: bool,
    ) -> Result<(Kept, Buf)> {
        if self.hooks.is_none() && for_products {
            return rmsnorm_prepared(p, w, x, self.eps);
        }
        let (y, rstd) = rmsnorm(p, w, x, self.eps)?;
        let y = Arc::new(self.enter(y)?);
        let y = if for_products {
            Kept::new(y)?
        } else {
            Kept::Values(y)
        };
        Ok((y, rstd))
    }

    fn enter(&self, x: Buf) -> Result<Buf> {
        match &self.hooks {
            Some(h) => h.enter_forward(x),
            None => Ok(x),
        }
    }
    fn exit(&self, y: Buf) -> Result<Buf> {
        match &self.hooks {
            Some(h) => h.exit_forward(y),
            None => Ok(y),
        }
    }
    fn enter_backward(&self, dx: Buf) -> Result<Buf> {
        match &self.hooks {
            Some(h) => h.enter_backward(dx),
            None => Ok(dx),
        }
    }
    /// The gradient entering a region from its output; without hooks, `dy` itself (shared
    /// with the residual stream, which still needs it).
    fn exit_backward_shared(&self, dy: &Act) -> Result<Act> {
        match &self.hooks {
            Some(h) => Ok(Arc::new(h.exit_backward(dy.as_ref().try_clone()?)?)),
            None => Ok(dy.clone()),
        }
    }

    /// Input gradient of the block; every weight gradient is left in the returned store.
    pub fn backward_input<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        cache: BlockCache,
        dy: Buf,
    ) -> Result<(Buf, WeightGradStore)> {
        let p: BufRef<'_> = p.into();
        let pass = cache.pass;
        let x = cache.x;
        let s = match cache.saved {
            Some(s) => s,
            None => {
                let full = pass.clone().with_recompute(Recompute::None);
                self.forward_saved(p, &x, &full)?.1
            }
        };
        let mut store = WeightGradStore::new();
        // FFN half.
        let xn2 = match s.xn2 {
            Some(v) => v,
            None => self.normed(p, &self.ffn_norm, s.h.r(), self.dense())?.0,
        };
        let dy = Arc::new(dy);
        let dm = self.exit_backward_shared(&dy)?;
        let dxn2 = match (&self.ffn, s.ffn) {
            (Ffn::Dense(m), FfnCache::Dense(c)) => m.backward_input(p, &xn2, c, dm, &mut store)?,
            (Ffn::Moe(m), FfnCache::Moe(c)) => {
                let x = xn2
                    .values()
                    .expect("a mixture of experts keeps its input's values");
                m.backward_input(p, x, *c, dm, &pass, &mut store)?
            }
            _ => unreachable!("cache built by this block's own forward"),
        };
        let dxn2 = self.enter_backward(dxn2)?;
        let dh = rmsnorm_backward_input(
            p,
            &self.ffn_norm,
            s.h.r(),
            s.rstd2.r(),
            dxn2.r(),
            Some(dy.r()),
        )?;
        store.push(WeightTask::Norm {
            w: self.ffn_norm.clone(),
            dy: Arc::new(dxn2),
            x: s.h,
            rstd: s.rstd2,
        });
        // Attention half.
        let xn1 = match s.xn1 {
            Some(v) => v,
            None => self.normed(p, &self.attn_norm, x.r(), true)?.0,
        };
        let dh = Arc::new(dh);
        let da = self.exit_backward_shared(&dh)?;
        let dxn1 = self
            .attn
            .backward_input(p, &xn1, s.attn, da, &pass, &mut store)?;
        let dxn1 = self.enter_backward(dxn1)?;
        let dx = rmsnorm_backward_input(
            p,
            &self.attn_norm,
            x.r(),
            s.rstd1.r(),
            dxn1.r(),
            Some(dh.r()),
        )?;
        store.push(WeightTask::Norm {
            w: self.attn_norm.clone(),
            dy: Arc::new(dxn1),
            x,
            rstd: s.rstd1,
        });
        Ok((dx, store))
    }

    /// Weight gradients recorded by [`Block::backward_input`], accumulated into `g`.
    pub fn backward_weight<'a1>(
        &self,
        store: WeightGradStore,
        g: impl Into<BufMut<'a1>>,
    ) -> Result<()> {
        let g: BufMut<'_> = g.into();
        store.apply(g)
    }

    /// Fused backward: input gradient returned, weight gradients accumulated into `g`.
    pub fn backward<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        g: impl Into<BufMut<'a2>>,
        cache: BlockCache,
        dy: Buf,
    ) -> Result<Buf> {
        let p: BufRef<'_> = p.into();
        let g: BufMut<'_> = g.into();
        let (dx, store) = self.backward_input(p, cache, dy)?;
        self.backward_weight(store, g)?;
        Ok(dx)
    }
}
