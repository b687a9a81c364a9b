//! SwiGLU feed-forward: `y = W_down · (silu(W_gate·x) ∘ (W_up·x))` (Llama MLP). The same struct
//! is a Mixtral expert (views into the fused `gate_up_proj` / `down_proj` tensors), the shared
//! expert, or a tensor-parallel shard (column-split gate/up, row-split down).

use std::sync::Arc;

use super::{
    linear_backward_input, linear_backward_input_new, linear_forward_new, Act, Buf, BufRef,
    WeightGradStore, WeightTask,
};
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// Weights of one SwiGLU MLP: `gate [ffn, hidden]`, `up [ffn, hidden]`, `down [hidden, ffn]`.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    pub gate: View,
    pub up: View,
    pub down: View,
}

/// Activations SwiGLU backward needs (besides its input): the gate and up projections and,
/// unless dropped for selective recomputation, their product `s = silu(g)∘u`.
#[derive(Debug, Clone)]
pub struct MlpCache {
    pub g: Act,
    pub u: Act,
    pub s: Option<Act>,
}

impl MlpCache {
    /// Bytes of the saved activations.
    pub fn bytes(&self) -> usize {
        let s = self.s.as_ref().map_or(0, |s| super::act_bytes(s));
        super::act_bytes(&self.g) + super::act_bytes(&self.u) + s
    }
}

impl SwiGlu {
    pub fn ffn(&self) -> usize {
        self.gate.shape[0]
    }

    fn product(g: &Buf, u: &Buf) -> Result<Buf> {
        Ok(time(Kernel::Activation, || {
            tensor::ops::swiglu_forward(g.r(), u.r())
        })?)
    }

    /// `x [n, hidden] -> y [n, hidden]`; `keep_product = false` drops `s` from the cache.
    pub fn forward<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: impl Into<BufRef<'a2>>,
        keep_product: bool,
    ) -> Result<(Buf, MlpCache)> {
        let p: BufRef<'_> = p.into();
        let x: BufRef<'_> = x.into();
        let hidden = self.gate.shape[1];
        let n = x.len() / hidden;
        let f = self.ffn();
        let g = linear_forward_new(p, &self.gate, x)?;
        let u = linear_forward_new(p, &self.up, x)?;
        debug_assert_eq!(g.len(), n * f);
        let s = Self::product(&g, &u)?;
        let y = linear_forward_new(p, &self.down, s.r())?;
        debug_assert_eq!(y.len(), n * hidden);
        let cache = MlpCache {
            g: Arc::new(g),
            u: Arc::new(u),
            s: keep_product.then(|| Arc::new(s)),
        };
        Ok((y, cache))
    }

    /// Input gradient (written) from `dy`; records the three weight gradients. `x` is the
    /// forward input.
    pub fn backward_input<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: &Act,
        cache: MlpCache,
        dy: Act,
        store: &mut WeightGradStore,
    ) -> Result<Buf> {
        let p: BufRef<'_> = p.into();
        let s = match cache.s {
            Some(s) => s,
            None => Arc::new(Self::product(&cache.g, &cache.u)?),
        };
        let ds = linear_backward_input_new(p, &self.down, dy.r())?;
        store.push(WeightTask::Linear {
            w: self.down.clone(),
            dy,
            x: s,
        });
        let (dg, du) = time(Kernel::Activation, || {
            tensor::ops::swiglu_backward(ds.r(), cache.g.r(), cache.u.r())
        })?;
        let mut dx = linear_backward_input_new(p, &self.gate, dg.r())?;
        linear_backward_input(p, &self.up, du.r(), dx.m(), true)?;
        store.push(WeightTask::Linear {
            w: self.gate.clone(),
            dy: Arc::new(dg),
            x: x.clone(),
        });
        store.push(WeightTask::Linear {
            w: self.up.clone(),
            dy: Arc::new(du),
            x: x.clone(),
        });
        Ok(dx)
    }
}
