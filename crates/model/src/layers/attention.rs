//! Grouped-query self-attention layer: q/k/v projections (HF `[out, in]` weights, heads grouped
//! by rows), rotary embedding on q and k, causal FlashAttention-style core, output projection.
//! The layer is parameterised by its own head counts, so tensor parallelism reuses it with a
//! rank's local heads (then the output is a partial sum the caller all-reduces), and its core
//! (the attention of rotated q, k, v) is replaceable: context parallelism plugs in ring
//! attention over the ranks holding the other parts of the sequence ([`AttentionCore`]).
//! With a pass's [`Documents`](crate::Documents), attention is block-causal: no query sees a
//! key of another document (the kernel's document mask), and RoPE positions restart per
//! document when the documents say so ([`Pass::positions`]).

use std::sync::Arc;

use tensor::attention::AttnShape;
use tensor::rope::Rope;

use super::{
    linear_backward_input, linear_backward_input_kept, linear_backward_input_new,
    linear_for_attention, linear_forward_new, Act, Buf, BufRef, Kept, Operand, Pass, SeqPart,
    WeightGradStore, WeightTask,
};
use crate::documents::Documents;
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// The attention of rotated `q`, `k`, `v` (layouts of [`tensor::attention`]) for a pass whose
/// tokens may be one rank's part of the sequences: `shape` is the local one (`q_len = kv_len =`
/// the pass's tokens per sequence) and `part` says which global positions they are; `docs`,
/// when given, are the document boundaries of the whole sequences (global positions): no
/// query may see a key of another document. The buffers are on the model's device.
pub trait AttentionCore: Send + Sync + std::fmt::Debug {
    /// `(out, lse)` of the local queries against every key of their sequences, on the
    /// device of `q`.
    fn forward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        docs: Option<&Documents>,
        q: BufRef<'_>,
        k: BufRef<'_>,
        v: BufRef<'_>,
    ) -> Result<(Buf, Buf)>;
    /// `(dq, dk, dv)` of the local q, k, v, given the forward's `out` and `lse` and `dout`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        docs: Option<&Documents>,
        q: BufRef<'_>,
        k: BufRef<'_>,
        v: BufRef<'_>,
        out: BufRef<'_>,
        lse: BufRef<'_>,
        dout: BufRef<'_>,
    ) -> Result<(Buf, Buf, Buf)>;
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

/// What attention backward needs: rotated q and k, v — prepared for the attention kernels
/// ([`tensor::ops::attention_operand`]: on the GPU's tensor cores only their bf16 copies) —
/// the attention output and its lse.
#[derive(Debug, Clone)]
pub struct AttnCache {
    pub q: Kept,
    pub k: Kept,
    pub v: Kept,
    pub o: Act,
    pub lse: Act,
}

impl AttnCache {
    /// Bytes of the saved activations.
    pub fn bytes(&self) -> usize {
        [&self.q, &self.k, &self.v]
            .iter()
            .map(|x| x.bytes())
            .chain([&self.o, &self.lse].iter().map(|a| super::act_bytes(a)))
            .sum()
    }
}

/// The values of an operand kept for an [`AttentionCore`], which takes Q, K, V as fp32 values
/// (the layer does not round them for a core: [`Attention::forward`]).
fn core_values(x: &Kept) -> Result<BufRef<'_>> {
    match x.values() {
        Some(v) => Ok(v.r()),
        None => Err(crate::ModelError::InvalidBatch(
            "an attention core needs q, k, v as values, but the layer kept only their rounded copies"
                .into(),
        )),
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

    /// `x [tokens, hidden]` (already normed; values, or prepared for the projections) ->
    /// `y [tokens, hidden]` (before the residual add).
    pub fn forward<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: impl Into<Operand<'a2>>,
        pass: &Pass,
    ) -> Result<(Buf, AttnCache)> {
        let p: BufRef<'_> = p.into();
        let t = pass.tokens();
        let (dq, dkv) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let x = Operand::new(x)?;
        let mut q = linear_forward_new(p, &self.wq, x.clone())?;
        let mut k = linear_forward_new(p, &self.wk, x.clone())?;
        debug_assert_eq!((q.len(), k.len()), (t * dq, t * dkv));
        let pos = pass.positions();
        let shape = self.shape(pass)?;
        // Q, K, V prepared once for the kernels that read them, forward and backward (on the
        // tensor cores their bf16 copies, Q and K written so by the RoPE kernel and V by its
        // projection: the fp32 projections go). A core (context parallelism) sends K and V around the ring and
        // slices them per call: it takes the values, and the kernel it calls rounds its slices.
        let (q, k, v) = match &self.core {
            Some(_) => {
                let v = linear_forward_new(p, &self.wv, x)?;
                time(Kernel::Rope, || -> Result<()> {
                    tensor::ops::rope(&self.rope, q.m(), self.n_heads, &pos, false)?;
                    tensor::ops::rope(&self.rope, k.m(), self.n_kv_heads, &pos, false)?;
                    Ok(())
                })?;
                let (q, k, v) = (Arc::new(q), Arc::new(k), Arc::new(v));
                (Kept::Values(q), Kept::Values(k), Kept::Values(v))
            }
            None => {
                let rotate = |x: Buf, heads: usize| {
                    time(Kernel::Rope, || {
                        tensor::prepared::rope_for_attention(&shape, &self.rope, x, heads, &pos)
                    })
                };
                (
                    rotate(q, self.n_heads)?,
                    rotate(k, self.n_kv_heads)?,
                    linear_for_attention(p, &self.wv, x, &shape)?,
                )
            }
        };
        let (o, lse) = match &self.core {
            Some(core) => core.forward(
                &shape,
                pass.part,
                pass.docs.as_deref(),
                core_values(&q)?,
                core_values(&k)?,
                core_values(&v)?,
            )?,
            None => {
                let docs = pass.doc_starts()?;
                time(Kernel::Attention, || {
                    tensor::ops::attention_forward(&shape, docs.as_deref(), q.r(), k.r(), v.r())
                })?
            }
        };
        let y = linear_forward_new(p, &self.wo, o.r())?;
        let cache = AttnCache {
            q,
            k,
            v,
            o: Arc::new(o),
            lse: Arc::new(lse),
        };
        Ok((y, cache))
    }

    /// Input gradient `dx` (written) from `dy`; records the four projection weight gradients.
    /// `x` is the forward input, prepared for products.
    pub fn backward_input<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: &Kept,
        cache: AttnCache,
        dy: Act,
        pass: &Pass,
        store: &mut WeightGradStore,
    ) -> Result<Buf> {
        let p: BufRef<'_> = p.into();
        let t = pass.tokens();
        let (dqn, dkvn) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let (d_o, dy) = linear_backward_input_kept(p, &self.wo, dy)?;
        debug_assert_eq!(d_o.len(), t * dqn);
        store.push(WeightTask::Linear {
            w: self.wo.clone(),
            dy,
            x: Kept::new(cache.o.clone())?,
        });
        let shape = self.shape(pass)?;
        let (dq, dk, dv) = match &self.core {
            Some(core) => core.backward(
                &shape,
                pass.part,
                pass.docs.as_deref(),
                core_values(&cache.q)?,
                core_values(&cache.k)?,
                core_values(&cache.v)?,
                cache.o.r(),
                cache.lse.r(),
                d_o.r(),
            )?,
            None => {
                let dev = d_o.dev();
                let mut dq = dev.zeros(t * dqn)?;
                let mut dk = dev.zeros(t * dkvn)?;
                let mut dv = dev.zeros(t * dkvn)?;
                let docs = pass.doc_starts()?;
                time(Kernel::Attention, || {
                    tensor::ops::attention_backward(
                        &shape,
                        docs.as_deref(),
                        cache.q.r(),
                        cache.k.r(),
                        cache.v.r(),
                        cache.o.r(),
                        cache.lse.r(),
                        d_o.r(),
                        dq.m(),
                        dk.m(),
                        dv.m(),
                    )
                })?;
                (dq, dk, dv)
            }
        };
        // Rotated back and prepared for the projections' products (by the RoPE kernel).
        let pos = pass.positions();
        let (dq, dk) = time(Kernel::Rope, || -> Result<(Kept, Kept)> {
            Ok((
                tensor::prepared::rope(&self.rope, dq, self.n_heads, &pos, true)?,
                tensor::prepared::rope(&self.rope, dk, self.n_kv_heads, &pos, true)?,
            ))
        })?;
        let dv = Kept::new(Arc::new(dv))?;
        let mut dx = linear_backward_input_new(p, &self.wq, dq.r())?;
        linear_backward_input(p, &self.wk, dk.r(), dx.m(), true)?;
        linear_backward_input(p, &self.wv, dv.r(), dx.m(), true)?;
        for (w, dy) in [(&self.wq, dq), (&self.wk, dk), (&self.wv, dv)] {
            store.push(WeightTask::Linear {
                w: w.clone(),
                dy,
                x: x.clone(),
            });
        }
        Ok(dx)
    }
}
