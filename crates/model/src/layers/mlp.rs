//! SwiGLU feed-forward: `y = W_down · (silu(W_gate·x) ∘ (W_up·x))` (Llama MLP). The same struct
//! is a Mixtral expert (views into the fused `gate_up_proj` / `down_proj` tensors), the shared
//! expert, or a tensor-parallel shard (column-split gate/up, row-split down).

use std::sync::Arc;

use super::{
    linear_backward_input, linear_backward_input_new, linear_forward_new, Act, WeightGradStore,
    WeightTask,
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

    fn product(g: &[f32], u: &[f32]) -> Result<Vec<f32>> {
        Ok(time(Kernel::Activation, || {
            tensor::activation::swiglu_forward(g, u)
        })?)
    }

    /// `x [n, hidden] -> y [n, hidden]`; `keep_product = false` drops `s` from the cache.
    pub fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        keep_product: bool,
    ) -> Result<(Vec<f32>, MlpCache)> {
        let hidden = self.gate.shape[1];
        let n = x.len() / hidden;
        let f = self.ffn();
        let g = linear_forward_new(p, &self.gate, x)?;
        let u = linear_forward_new(p, &self.up, x)?;
        debug_assert_eq!(g.len(), n * f);
        let s = Self::product(&g, &u)?;
        let y = linear_forward_new(p, &self.down, &s)?;
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
    pub fn backward_input(
        &self,
        p: &[f32],
        x: &Act,
        cache: MlpCache,
        dy: Act,
        store: &mut WeightGradStore,
    ) -> Result<Vec<f32>> {
        let s = match cache.s {
            Some(s) => s,
            None => Arc::new(Self::product(&cache.g, &cache.u)?),
        };
        let ds = linear_backward_input_new(p, &self.down, &dy)?;
        store.push(WeightTask::Linear {
            w: self.down.clone(),
            dy,
            x: s,
        });
        let (dg, du) = time(Kernel::Activation, || {
            tensor::activation::swiglu_backward(&ds, &cache.g, &cache.u)
        })?;
        let mut dx = linear_backward_input_new(p, &self.gate, &dg)?;
        linear_backward_input(p, &self.up, &du, &mut dx, true)?;
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
