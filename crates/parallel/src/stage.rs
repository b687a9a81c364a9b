//! The contract between the executor and a model: what one rank holds of the model (all of
//! it, or a pipeline stage's share), as *units* run in order — the embedding, each block, the
//! head — each with its own slice of one flat parameter buffer and three entry points:
//!
//! - `forward(x) -> (y, cache)`;
//! - `backward_input(cache, dy) -> (dx, weight_grad)`: the input gradient only; what the
//!   weight gradients need is kept in `weight_grad` (zero-bubble's `B`);
//! - `backward_weight(weight_grad)`: the weight gradients, accumulated into the unit's
//!   gradient slice (zero-bubble's `W`).
//!
//! The fused backward is the two in a row ([`StageModel::backward`]), so splitting them cannot
//! change the result. Recomputation is a property of a unit's forward (it keeps less in its
//! cache and rebuilds it in `backward_input`).
//!
//! Parameters and gradients are ranges of the executor's flat buffers on its device
//! ([`BufRef`], [`BufMut`]: host memory, or a GPU's).
//!
//! The executor drives the unit loop itself, so the point where a unit's weight gradients are
//! final is the "gradients of this range are ready" event DDP buckets wait for, and ZeRO-3 can
//! gather a unit's parameters just before it runs and free them right after.
use std::ops::Range;

use tensor::buf::{Buf, BufMut, BufRef};

use crate::placement::Placement;
use crate::ParallelError;

pub trait StageModel: Sync {
    /// One micro-batch (inputs and targets).
    type Batch: Sync;
    /// What flows between units (activations forward, their gradients backward).
    type Act: Send;
    /// What a unit's backward needs from its forward.
    type Cache: Send;
    /// What a unit's weight gradients need after its input gradient was computed.
    type WeightGrad: Send;

    /// Flat ranges of this rank's units in forward order; contiguous, starting at 0.
    fn units(&self) -> Vec<Range<usize>>;
    /// Flat ranges of the individual tensors in layout order.
    fn tensors(&self) -> Vec<Range<usize>>;
    /// The parts of unit `unit` (flat ranges inside `units()[unit]`, in order) that its
    /// kernels read as fp32 values, rather than only as operands of matrix products in the
    /// step's format. In a bf16 or fp16 step on a GPU the executor widens only these into the
    /// unit's fp32 copy: the products read the other weights' stored 16-bit bits
    /// ([`tensor::cuda::widening`]), so the rest of the copy is never written. The default,
    /// the whole unit, is always right.
    fn value_ranges(&self, unit: usize) -> Vec<Range<usize>> {
        vec![self.units()[unit].clone()]
    }
    /// Where each tensor block this rank holds lives in its flat buffer, and which block of
    /// the full tensor it is (what checkpoints save and load).
    fn placements(&self) -> Vec<Placement>;
    /// Whether unit `unit` is the model's first (reads the batch's inputs, takes `x = None`).
    fn is_first(&self, unit: usize) -> bool;
    /// Whether unit `unit` is the model's last (returns the loss as its output).
    fn is_last(&self, unit: usize) -> bool;

    /// Forward of `unit` with its parameters `params`. `scale` is d(total loss)/d(this
    /// micro-batch's loss), for losses added inside units (MoE auxiliary loss) and for the
    /// last unit's gradient; the same value is passed to the backward.
    fn forward(
        &self,
        unit: usize,
        params: BufRef<'_>,
        x: Option<Self::Act>,
        batch: &Self::Batch,
        scale: f32,
    ) -> Result<(Self::Act, Self::Cache), ParallelError>;

    /// Input gradient of `unit`: `dy = None` for the last unit, which seeds d(loss) = `scale`.
    /// Returns dX (`None` for the first unit) and the pending weight-gradient work.
    fn backward_input(
        &self,
        unit: usize,
        params: BufRef<'_>,
        cache: Self::Cache,
        dy: Option<Self::Act>,
        scale: f32,
    ) -> Result<(Option<Self::Act>, Self::WeightGrad), ParallelError>;

    /// Weight gradients of `unit`, accumulated (`+=`) into `grads` (the unit's slice).
    fn backward_weight(
        &self,
        unit: usize,
        params: BufRef<'_>,
        pending: Self::WeightGrad,
        grads: BufMut<'_>,
    ) -> Result<(), ParallelError>;

    /// Fused backward: [`Self::backward_input`] then [`Self::backward_weight`].
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        unit: usize,
        params: BufRef<'_>,
        cache: Self::Cache,
        dy: Option<Self::Act>,
        scale: f32,
        grads: BufMut<'_>,
    ) -> Result<Option<Self::Act>, ParallelError> {
        let (dx, w) = self.backward_input(unit, params, cache, dy, scale)?;
        self.backward_weight(unit, params, w, grads)?;
        Ok(dx)
    }

    /// Scalar loss from the last unit's output.
    fn loss(&self, out: &Self::Act) -> f32;
    /// The validation metric of a forward-only pass (`last`: the last unit's cache); by
    /// default the loss. The decoders report the cross-entropy alone, without the MoE
    /// auxiliary loss (a collective over the cp group under context parallelism).
    fn eval_metric(&self, out: &Self::Act, last: &Self::Cache) -> Result<f32, ParallelError> {
        let _ = last;
        Ok(self.loss(out))
    }
    /// Bytes held by a cache (activation accounting).
    fn cache_bytes(&self, cache: &Self::Cache) -> usize;
    /// Bytes held by pending weight-gradient work.
    fn weight_grad_bytes(&self, pending: &Self::WeightGrad) -> usize;

    /// `Σ g²` (for global-norm clipping) of this rank's gradients in flat range `range`, where
    /// `sq(r)` is the plain sum of squares of a flat sub-range `r` of it. A model sharded over
    /// a tensor-parallel group counts replicated tensors once and sums over that group here
    /// (every member calls it); the default is `sq(range)`.
    fn grad_sq_sum(
        &self,
        range: Range<usize>,
        sq: &dyn Fn(Range<usize>) -> f64,
    ) -> Result<f64, ParallelError> {
        Ok(sq(range))
    }

    /// Called on the fp32 gradients of flat range `range` just before the executor reduces
    /// them over its data-parallel group (once per step, or per backward at ZeRO-2/3); every
    /// member of the model's groups calls it for the same ranges in the same order. Expert
    /// parallelism averages its replicated tensors over the ep ranks here. The default leaves
    /// them as they are.
    fn prepare_reduction(
        &self,
        range: Range<usize>,
        grads: &mut [f32],
    ) -> Result<(), ParallelError> {
        let _ = (range, grads);
        Ok(())
    }

    /// Whether [`Self::prepare_reduction`] changes anything (expert parallelism): where it
    /// does not, the executor skips it — and the trip of a GPU's bucket through host memory.
    fn prepares_reductions(&self) -> bool {
        false
    }

    /// Flat ranges of this rank's copies of a tied tensor (the embedding and the LM head of a
    /// model with tied embeddings), in flat order; empty when nothing is tied. The executor
    /// reduces the buckets holding them only after [`Self::sum_tied`], with an exact
    /// rank-order reduction, so every copy stays the same bits.
    fn tied_ranges(&self) -> Vec<Range<usize>> {
        Vec::new()
    }

    /// Makes each of `copies` (the fp32 gradients of [`Self::tied_ranges`], after
    /// [`Self::prepare_reduction`]) the sum over every copy of the tensor, on this rank and on
    /// the ranks holding the others; called once per step, by every rank holding a copy.
    fn sum_tied(&self, copies: &mut [&mut [f32]]) -> Result<(), ParallelError> {
        let _ = copies;
        Ok(())
    }

    /// Whether units issue collectives inside forward / backward (tensor parallelism): then
    /// ranks that are threads of one process must not share one compute pool worker.
    fn communicates(&self) -> bool {
        false
    }

    /// An activation (or its gradient) as the flat `f32` message sent between pipeline
    /// stages, on the activation's device (a pipeline link carries it over the host
    /// transports or, device to device, over NCCL: `pipeline_parallel::link`).
    fn act_to_wire(&self, act: Self::Act) -> Result<Buf, ParallelError>;
    /// The inverse of [`Self::act_to_wire`], given the message on the receiver's device.
    fn wire_to_act(&self, wire: Buf) -> Result<Self::Act, ParallelError>;
    /// Length of the message [`Self::act_to_wire`] makes between units for `batch` (receivers
    /// size their buffers with it).
    fn wire_len(&self, batch: &Self::Batch) -> usize;
}
