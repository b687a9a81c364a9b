//! SwiGLU feed-forward: `y = W_down · (silu(W_gate·x) ∘ (W_up·x))` (Llama MLP). The same struct
//! is a Mixtral expert (views into the fused `gate_up_proj` / `down_proj` tensors), the shared
//! expert, or a tensor-parallel shard (column-split gate/up, row-split down).

use std::sync::Arc;

use super::{
    linear_backward_input, linear_backward_input_kept, linear_backward_input_new,
    linear_forward_new, Act, Buf, BufRef, Kept, Operand, WeightGradStore, WeightTask,
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
/// unless dropped for selective recomputation, their product `s = silu(g)∘u`, which only the
/// down projection's weight gradient reads again (so kept prepared for that product).
#[derive(Debug, Clone)]
pub struct MlpCache {
    pub g: Act,
    pub u: Act,
    pub s: Option<Kept>,
}

impl MlpCache {
    /// Bytes of the saved activations.
    pub fn bytes(&self) -> usize {
        let s = self.s.as_ref().map_or(0, Kept::bytes);
        super::act_bytes(&self.g) + super::act_bytes(&self.u) + s
    }
}

impl SwiGlu {
    pub fn ffn(&self) -> usize {
        self.gate.shape[0]
    }

    /// `s = silu(g)∘u`, prepared for the down projection (the kernel writes it so:
    /// [`tensor::prepared`]).
    fn product(g: &Buf, u: &Buf) -> Result<Kept> {
        Ok(time(Kernel::Activation, || {
            tensor::prepared::swiglu_forward(g.r(), u.r())
        })?)
    }

    /// `x [n, hidden] -> y [n, hidden]` (`x`: values, or prepared for the products);
    /// `keep_product = false` drops `s` from the cache.
    pub fn forward<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: impl Into<Operand<'a2>>,
        keep_product: bool,
    ) -> Result<(Buf, MlpCache)> {
        let p: BufRef<'_> = p.into();
        let x = Operand::new(x)?;
        let hidden = self.gate.shape[1];
        let n = x.len() / hidden;
        let f = self.ffn();
        let g = linear_forward_new(p, &self.gate, x.clone())?;
        let u = linear_forward_new(p, &self.up, x)?;
        debug_assert_eq!(g.len(), n * f);
        let s = Self::product(&g, &u)?;
        let y = linear_forward_new(p, &self.down, s.r())?;
        debug_assert_eq!(y.len(), n * hidden);
        let cache = MlpCache {
            g: Arc::new(g),
            u: Arc::new(u),
            s: keep_product.then_some(s),
        };
        Ok((y, cache))
    }

    /// Input gradient (written) from `dy`; records the three weight gradients. `x` is the
    /// forward input, prepared for products.
    pub fn backward_input<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: &Kept,
        cache: MlpCache,
        dy: Act,
        store: &mut WeightGradStore,
    ) -> Result<Buf> {
        let p: BufRef<'_> = p.into();
        let s = match cache.s {
            Some(s) => s,
            None => Self::product(&cache.g, &cache.u)?,
        };
        let (ds, dy) = linear_backward_input_kept(p, &self.down, dy)?;
        store.push(WeightTask::Linear {
            w: self.down.clone(),
            dy,
            x: s,
        });
        let (dg, du) = time(Kernel::Activation, || {
            tensor::prepared::swiglu_backward(ds.r(), cache.g.r(), cache.u.r())
        })?;
        let mut dx = linear_backward_input_new(p, &self.gate, dg.r())?;
        linear_backward_input(p, &self.up, du.r(), dx.m(), true)?;
        store.push(WeightTask::Linear {
            w: self.gate.clone(),
            dy: dg,
            x: x.clone(),
        });
        store.push(WeightTask::Linear {
            w: self.up.clone(),
            dy: du,
            x: x.clone(),
        });
        Ok(dx)
    }
}
