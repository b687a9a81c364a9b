//! Grouped-query self-attention layer: q/k/v projections (HF `[out, in]` weights, heads grouped
//! by rows), rotary embedding on q and k, causal FlashAttention-style core, output projection.
//! The layer is parameterised by its own head counts, so tensor parallelism reuses it with a
//! rank's local heads (then the output is a partial sum the caller all-reduces).

use std::sync::Arc;

use tensor::attention::{attention_backward, attention_forward, AttnShape, AttnTiles};
use tensor::rope::Rope;
use tensor::threads::zeros;

use super::{
    linear_backward_input, linear_backward_input_new, linear_forward_new, Act, Pass,
    WeightGradStore, WeightTask,
};
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// Attention weights (views relative to the parameter slice) and head geometry.
#[derive(Debug, Clone)]
pub struct Attention {
    pub wq: View,
    pub wk: View,
    pub wv: View,
    pub wo: View,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope: Arc<Rope>,
}

/// What attention backward needs: rotated q and k, v, the attention output and its lse.
#[derive(Debug, Clone)]
pub struct AttnCache {
    pub q: Act,
    pub k: Act,
    pub v: Act,
    pub o: Act,
    pub lse: Act,
}

impl AttnCache {
    /// Bytes of the saved activations.
    pub fn bytes(&self) -> usize {
        [&self.q, &self.k, &self.v, &self.o, &self.lse]
            .iter()
            .map(|a| super::act_bytes(a))
            .sum()
    }
}

impl Attention {
    fn shape(&self, pass: &Pass) -> AttnShape {
        let mut s = AttnShape::causal(
            pass.batch,
            pass.seq,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
        );
        s.q_start = pass.pos_offset;
        s.k_start = pass.pos_offset;
        s
    }

    fn positions(&self, pass: &Pass) -> Vec<usize> {
        tensor::rope::positions_range(pass.batch, pass.seq, pass.pos_offset)
    }

    /// `x [tokens, hidden]` (already normed) -> `y [tokens, hidden]` (before the residual add).
    pub fn forward(&self, p: &[f32], x: &[f32], pass: &Pass) -> Result<(Vec<f32>, AttnCache)> {
        let t = pass.tokens();
        let (dq, dkv) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let mut q = linear_forward_new(p, &self.wq, x)?;
        let mut k = linear_forward_new(p, &self.wk, x)?;
        let v = linear_forward_new(p, &self.wv, x)?;
        debug_assert_eq!((q.len(), k.len(), v.len()), (t * dq, t * dkv, t * dkv));
        let pos = self.positions(pass);
        time(Kernel::Rope, || -> Result<()> {
            self.rope.apply(&mut q, self.n_heads, &pos)?;
            self.rope.apply(&mut k, self.n_kv_heads, &pos)?;
            Ok(())
        })?;
        let shape = self.shape(pass);
        let mut o = zeros(t * dq);
        let mut lse = zeros(shape.lse_elems());
        time(Kernel::Attention, || {
            attention_forward(&shape, &q, &k, &v, &mut o, &mut lse, AttnTiles::default())
        })?;
        let y = linear_forward_new(p, &self.wo, &o)?;
        let cache = AttnCache {
            q: Arc::new(q),
            k: Arc::new(k),
            v: Arc::new(v),
            o: Arc::new(o),
            lse: Arc::new(lse),
        };
        Ok((y, cache))
    }

    /// Input gradient `dx` (written) from `dy`; records the four projection weight gradients.
    /// `x` is the forward input.
    pub fn backward_input(
        &self,
        p: &[f32],
        x: &Act,
        cache: AttnCache,
        dy: Act,
        pass: &Pass,
        store: &mut WeightGradStore,
    ) -> Result<Vec<f32>> {
        let t = pass.tokens();
        let (dqn, dkvn) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let d_o = linear_backward_input_new(p, &self.wo, &dy)?;
        debug_assert_eq!(d_o.len(), t * dqn);
        store.push(WeightTask::Linear {
            w: self.wo.clone(),
            dy,
            x: cache.o.clone(),
        });
        let shape = self.shape(pass);
        let mut dq = zeros(t * dqn);
        let mut dk = zeros(t * dkvn);
        let mut dv = zeros(t * dkvn);
        time(Kernel::Attention, || {
            attention_backward(
                &shape,
                &cache.q,
                &cache.k,
                &cache.v,
                &cache.o,
                &cache.lse,
                &d_o,
                &mut dq,
                &mut dk,
                &mut dv,
                AttnTiles::default(),
            )
        })?;
        let pos = self.positions(pass);
        time(Kernel::Rope, || -> Result<()> {
            self.rope.apply_backward(&mut dq, self.n_heads, &pos)?;
            self.rope.apply_backward(&mut dk, self.n_kv_heads, &pos)?;
            Ok(())
        })?;
        let mut dx = linear_backward_input_new(p, &self.wq, &dq)?;
        linear_backward_input(p, &self.wk, &dk, &mut dx, true)?;
        linear_backward_input(p, &self.wv, &dv, &mut dx, true)?;
        for (w, d) in [(&self.wq, dq), (&self.wk, dk), (&self.wv, dv)] {
            store.push(WeightTask::Linear {
                w: w.clone(),
                dy: Arc::new(d),
                x: x.clone(),
            });
        }
        Ok(dx)
    }
}
