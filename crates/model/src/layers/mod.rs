//! Layers with explicit forward/backward over views of a flat parameter buffer.
//!
//! Every layer follows one protocol:
//! - `forward(p, x, ..) -> (y, cache)`: `p` is the parameter range the layer's [`View`]s are
//!   relative to (a block's range, or a gathered ZeRO-3 / TP-local copy of it);
//! - `backward_input(p, cache, dy, store) -> dx`: the input gradient only; every weight
//!   gradient is *recorded* in a [`WeightGradStore`] (the inputs and output-gradients it needs);
//! - `WeightGradStore::apply(p, g)`: the weight gradients, accumulated (`+=`) into `g`.
//!
//! Fused backward is simply both in a row, so splitting them (zero-bubble, DualPipe) cannot
//! change the result. Activations are shared [`Act`]s, so caches and stores never copy them.
//! A product's operand read by several products is prepared once ([`Operand`]: on a GPU in
//! bf16 / fp16 its rounded copy), and a weight gradient's task keeps it prepared ([`Kept`]).
//!
//! Parameters, gradients and activations are [`Buf`]s (views [`BufRef`], [`BufMut`]) on the
//! host or a GPU; every kernel goes through [`tensor::ops`], which runs the CPU kernel or its
//! CUDA twin, so one model serves both devices.

pub mod attention;
pub mod block;
pub mod head;
pub mod mlp;
pub mod moe;

use std::sync::Arc;

pub use tensor::buf::{Buf, BufMut, BufRef};
pub use tensor::operands::{Kept, Operand};

use crate::error::Result;
use crate::layout::View;

/// A shared, immutable activation buffer.
pub type Act = Arc<Buf>;

/// Bytes of an activation buffer (caches report what they hold for memory accounting).
pub fn act_bytes(a: &Buf) -> usize {
    a.bytes()
}

/// Activation recomputation policy of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every activation backward needs.
    #[default]
    None,
    /// Keep only the block input; rerun the block's forward before its backward.
    Full,
    /// Drop the cheap-to-recompute element-wise activations (the two RMSNorm outputs and the
    /// SwiGLU product `silu(g)∘u`) and rebuild them in backward; keep matmul outputs and the
    /// attention output / log-sum-exp (the expensive parts).
    Selective,
}

/// Which global positions a pass's `seq` tokens of each sequence hold: all of a sequence, or a
/// context-parallel rank's part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqPart {
    /// Positions `offset..offset + seq` (a whole sequence at 0, or one contiguous block).
    Offset(usize),
    /// Two chunks of `seq / 2` tokens: global chunks `first` and `second` of that length
    /// (zigzag balancing: rank r of cp holds chunks r and 2·cp − 1 − r).
    Chunks { first: usize, second: usize },
    /// Positions `first, first + stride, first + 2·stride, …` (striped balancing).
    Strided { first: usize, stride: usize },
}

impl SeqPart {
    /// The global position of each of a sequence's `seq` local tokens.
    pub fn positions(&self, seq: usize) -> Vec<usize> {
        match *self {
            SeqPart::Offset(o) => (o..o + seq).collect(),
            SeqPart::Chunks { first, second } => {
                let c = seq / 2;
                (first * c..first * c + c)
                    .chain(second * c..second * c + c)
                    .collect()
            }
            SeqPart::Strided { first, stride } => (0..seq).map(|i| first + i * stride).collect(),
        }
    }
}

/// The ranks holding the other tokens of a pass's sequences (context parallelism): a layer whose
/// statistics are over whole sequences (MoE's load-balancing loss) sums them across the group.
pub trait SequenceGroup: Send + Sync + std::fmt::Debug {
    /// Element-wise sum of `x` over the group, with the same bits on every member.
    fn sum(&self, x: &mut [f64]) -> Result<()>;
}

/// Per-call settings of a forward pass (stored in caches, so backward needs nothing more).
#[derive(Debug, Clone, PartialEq)]
pub struct Pass {
    pub batch: usize,
    /// Tokens of each sequence in this pass (a context-parallel rank's share of it).
    pub seq: usize,
    /// Their global positions (RoPE, causal masking).
    pub part: SeqPart,
    pub recompute: Recompute,
    /// d(total loss)/d(this micro-batch's loss): scales the MoE auxiliary-loss gradient the
    /// same way the trainer scales the cross-entropy gradient (gradient accumulation).
    pub loss_scale: f32,
    /// Document boundaries of the whole sequences (`[batch, full seq]`, global positions):
    /// attention is block-causal over them, and RoPE positions restart per document when they
    /// say so ([`crate::Documents`]).
    pub docs: Option<Arc<crate::Documents>>,
}

impl Pass {
    pub fn new(batch: usize, seq: usize) -> Self {
        Pass {
            batch,
            seq,
            part: SeqPart::Offset(0),
            recompute: Recompute::None,
            loss_scale: 1.0,
            docs: None,
        }
    }
    pub fn with_recompute(mut self, r: Recompute) -> Self {
        self.recompute = r;
        self
    }
    pub fn with_documents(mut self, docs: Option<Arc<crate::Documents>>) -> Self {
        self.docs = docs;
        self
    }
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
    /// The global position of every token of the pass (sequence after sequence).
    pub fn global_positions(&self) -> Vec<usize> {
        let one = self.part.positions(self.seq);
        (0..self.batch).flat_map(|_| one.iter().copied()).collect()
    }

    /// The RoPE position of every token of the pass: its global position, or its offset in its
    /// document when the documents restart positions.
    pub fn positions(&self) -> Vec<usize> {
        match &self.docs {
            Some(d) if d.restart_positions() => {
                let one = self.part.positions(self.seq);
                (0..self.batch)
                    .flat_map(|b| one.iter().map(move |&p| d.position(b, p)))
                    .collect()
            }
            _ => self.global_positions(),
        }
    }

    /// The document start of every local token (`[batch, seq]`, global positions), when the
    /// pass is masked per document; checks that the documents cover this pass's sequences.
    pub fn doc_starts(&self) -> Result<Option<Vec<usize>>> {
        let Some(d) = &self.docs else {
            return Ok(None);
        };
        let pos = self.part.positions(self.seq);
        if d.batch() != self.batch || pos.iter().any(|&p| p >= d.seq()) {
            return Err(crate::ModelError::InvalidBatch(format!(
                "document starts of {} × {} tokens for a pass of {} sequences at {:?}",
                d.batch(),
                d.seq(),
                self.batch,
                self.part
            )));
        }
        Ok(Some(
            (0..self.batch)
                .flat_map(|b| pos.iter().map(move |&p| d.start(b, p)))
                .collect(),
        ))
    }
}

/// `y = x·Wᵀ` for `W [out, in]` (Hugging Face layout), into a new buffer (the product writes
/// it; no zero fill). `x`: values, or an [`Operand`] several products share.
pub fn linear_forward_new<'x>(p: BufRef<'_>, w: &View, x: impl Into<Operand<'x>>) -> Result<Buf> {
    let x: Operand<'x> = x.into();
    let (dout, din) = (w.shape[0], w.shape[1]);
    let tokens = x.len() / din;
    Ok(crate::profile::time(
        crate::profile::Kernel::Matmul,
        || tensor::ops::matmul_new(x, w.at(p), tokens, din, dout, false, true),
    )?)
}

/// [`linear_forward_new`] prepared for attention of shape `s`: on the tensor cores, written
/// rounded by the product ([`tensor::prepared::linear_for_attention`]).
pub fn linear_for_attention<'x>(
    p: BufRef<'_>,
    w: &View,
    x: impl Into<Operand<'x>>,
    s: &tensor::attention::AttnShape,
) -> Result<Kept> {
    let (dout, din) = (w.shape[0], w.shape[1]);
    Ok(crate::profile::time(
        crate::profile::Kernel::Matmul,
        || tensor::prepared::linear_for_attention(s, x.into(), w.at(p), din, dout),
    )?)
}

/// `dx = dy·W` into a new buffer (the product writes it; no zero fill).
pub fn linear_backward_input_new<'y>(
    p: BufRef<'_>,
    w: &View,
    dy: impl Into<Operand<'y>>,
) -> Result<Buf> {
    let dy: Operand<'y> = dy.into();
    let (dout, din) = (w.shape[0], w.shape[1]);
    let tokens = dy.len() / dout;
    Ok(crate::profile::time(
        crate::profile::Kernel::Matmul,
        || tensor::ops::matmul_new(dy, w.at(p), tokens, dout, din, false, false),
    )?)
}

/// `dx (+)= dy·W` for `W [out, in]`.
pub fn linear_backward_input<'y>(
    p: BufRef<'_>,
    w: &View,
    dy: impl Into<Operand<'y>>,
    dx: BufMut<'_>,
    accumulate: bool,
) -> Result<()> {
    let dy: Operand<'y> = dy.into();
    let (dout, din) = (w.shape[0], w.shape[1]);
    let tokens = dy.len() / dout;
    crate::profile::time(crate::profile::Kernel::Matmul, || {
        tensor::ops::matmul(dx, dy, w.at(p), tokens, dout, din, false, false, accumulate)
    })?;
    Ok(())
}

/// The output gradient `dy` of a linear layer prepared once for both of its products (the
/// input gradient now, the weight gradient's task later), with the input gradient
/// `dx = dy·W` as a new buffer.
pub fn linear_backward_input_kept(p: BufRef<'_>, w: &View, dy: Act) -> Result<(Buf, Kept)> {
    let dy = Kept::new(dy)?;
    let dx = linear_backward_input_new(p, w, dy.r())?;
    Ok((dx, dy))
}

/// One deferred weight-gradient computation.
#[derive(Debug, Clone)]
pub enum WeightTask {
    /// `dW += dyᵀ·x` for a linear `W [out, in]` (operands prepared for the product).
    Linear { w: View, dy: Kept, x: Kept },
    /// RMSNorm gain gradient `dγ += Σ_rows dy ∘ x ∘ rstd`.
    Norm { w: View, dy: Act, x: Act, rstd: Act },
}

/// The weight gradients that a `backward_input` left to do (DualPipe's WeightGradStore).
#[derive(Debug, Clone, Default)]
pub struct WeightGradStore {
    tasks: Vec<WeightTask>,
}

impl WeightGradStore {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn push(&mut self, t: WeightTask) {
        self.tasks.push(t);
    }
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
    pub fn len(&self) -> usize {
        self.tasks.len()
    }
    /// Bytes the pending tasks keep alive: each activation counted once, however many tasks
    /// share it (a linear's input is shared by the projections that read it).
    pub fn bytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut add = |id: *const (), bytes: usize| if seen.insert(id) { bytes } else { 0 };
        let act = |a: &Act| (Arc::as_ptr(a).cast(), act_bytes(a));
        self.tasks
            .iter()
            .flat_map(|t| match t {
                WeightTask::Linear { dy, x, .. } => {
                    vec![(dy.id(), dy.bytes()), (x.id(), x.bytes())]
                }
                WeightTask::Norm { dy, x, rstd, .. } => vec![act(dy), act(x), act(rstd)],
            })
            .map(|(id, bytes)| add(id, bytes))
            .sum()
    }
    /// Move all tasks of `other` into this store.
    pub fn append(&mut self, other: WeightGradStore) {
        self.tasks.extend(other.tasks);
    }
    /// Run every task: accumulate into `g` (same indexing as `p`).
    pub fn apply<'a1>(self, g: impl Into<BufMut<'a1>>) -> Result<()> {
        let mut g: BufMut<'_> = g.into();
        for t in self.tasks {
            match t {
                WeightTask::Linear { w, dy, x } => {
                    let (dout, din) = (w.shape[0], w.shape[1]);
                    let tokens = x.len() / din;
                    crate::profile::time(crate::profile::Kernel::MatmulWeight, || {
                        tensor::ops::matmul(
                            w.at_mut(g.reborrow()),
                            dy.r(),
                            x.r(),
                            dout,
                            tokens,
                            din,
                            true,
                            false,
                            true,
                        )
                    })?;
                }
                WeightTask::Norm { w, dy, x, rstd } => {
                    crate::profile::time(crate::profile::Kernel::Norm, || {
                        tensor::ops::rmsnorm_backward_weight(
                            dy.r(),
                            x.r(),
                            rstd.r(),
                            w.numel(),
                            w.at_mut(g.reborrow()),
                        )
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// RMSNorm forward over rows of `x`: returns `(y, rstd)`.
pub fn rmsnorm(p: BufRef<'_>, w: &View, x: BufRef<'_>, eps: f32) -> Result<(Buf, Buf)> {
    Ok(crate::profile::time(crate::profile::Kernel::Norm, || {
        tensor::ops::rmsnorm_forward(x, w.at(p), w.numel(), eps)
    })?)
}

/// [`rmsnorm`] with the output prepared for the products that read it next, written so by the
/// norm kernel ([`tensor::prepared`]).
pub fn rmsnorm_prepared(p: BufRef<'_>, w: &View, x: BufRef<'_>, eps: f32) -> Result<(Kept, Buf)> {
    Ok(crate::profile::time(crate::profile::Kernel::Norm, || {
        tensor::prepared::rmsnorm_forward(x, w.at(p), w.numel(), eps)
    })?)
}

/// RMSNorm input gradient as a new buffer, plus `residual` (the residual stream's gradient)
/// when given.
pub fn rmsnorm_backward_input(
    p: BufRef<'_>,
    w: &View,
    x: BufRef<'_>,
    rstd: BufRef<'_>,
    dy: BufRef<'_>,
    residual: Option<BufRef<'_>>,
) -> Result<Buf> {
    Ok(crate::profile::time(crate::profile::Kernel::Norm, || {
        tensor::ops::rmsnorm_backward_input(dy, x, w.at(p), rstd, w.numel(), residual)
    })?)
}
