//! Grouped-query self-attention layer: q/k/v projections (HF `[out, in]` weights, heads grouped
//! by rows), rotary embedding on q and k, causal FlashAttention-style core, output projection.
//! The layer is parameterised by its own head counts, so tensor parallelism reuses it with a
//! rank's local heads (then the output is a partial sum the caller all-reduces), and its core
//! (the attention of rotated q, k, v) is replaceable: context parallelism plugs in ring
//! attention over the ranks holding the other parts of the sequence ([`AttentionCore`]).

use std::sync::Arc;

use tensor::attention::{attention_backward, attention_forward, AttnShape, AttnTiles};
use tensor::rope::Rope;
use tensor::threads::zeros;

use super::{
    linear_backward_input, linear_backward_input_new, linear_forward_new, Act, Pass, SeqPart,
    WeightGradStore, WeightTask,
};
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// The attention of rotated `q`, `k`, `v` (layouts of [`tensor::attention`]) for a pass whose
/// tokens may be one rank's part of the sequences: `shape` is the local one (`q_len = kv_len =`
/// the pass's tokens per sequence) and `part` says which global positions they are.
pub trait AttentionCore: Send + Sync + std::fmt::Debug {
    /// `(out, lse)` of the local queries against every key of their sequences.
    fn forward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)>;
    /// `(dq, dk, dv)` of the local q, k, v, given the forward's `out` and `lse` and `dout`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>;
}

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
    /// The attention core when it is not this rank's kernel alone (context parallelism).
    pub core: Option<Arc<dyn AttentionCore>>,
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
    /// The local problem shape; with this rank's kernel alone the tokens must be one
    /// contiguous block of positions (an [`AttentionCore`] handles the other parts).
    fn shape(&self, pass: &Pass) -> Result<AttnShape> {
        let mut s = AttnShape::causal(
            pass.batch,
            pass.seq,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
        );
        match (pass.part, &self.core) {
            (SeqPart::Offset(o), None) => {
                s.q_start = o;
                s.k_start = o;
            }
            (_, Some(_)) => {}
            (part, None) => {
                return Err(crate::ModelError::InvalidBatch(format!(
                    "tokens at {part:?} need a context-parallel attention core"
                )))
            }
        }
        Ok(s)
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
        let pos = pass.positions();
        time(Kernel::Rope, || -> Result<()> {
            self.rope.apply(&mut q, self.n_heads, &pos)?;
            self.rope.apply(&mut k, self.n_kv_heads, &pos)?;
            Ok(())
        })?;
        let shape = self.shape(pass)?;
        let (o, lse) = match &self.core {
            Some(core) => core.forward(&shape, pass.part, &q, &k, &v)?,
            None => {
                let mut o = zeros(t * dq);
                let mut lse = zeros(shape.lse_elems());
                time(Kernel::Attention, || {
                    attention_forward(&shape, &q, &k, &v, &mut o, &mut lse, AttnTiles::default())
                })?;
                (o, lse)
            }
        };
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
        let shape = self.shape(pass)?;
        let (mut dq, mut dk, dv) = match &self.core {
            Some(core) => core.backward(
                &shape, pass.part, &cache.q, &cache.k, &cache.v, &cache.o, &cache.lse, &d_o,
            )?,
            None => {
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
                (dq, dk, dv)
            }
        };
        let pos = pass.positions();
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
