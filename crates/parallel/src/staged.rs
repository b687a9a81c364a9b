//! The contract between a data-parallel engine and a model: parameters in one flat buffer cut
//! into *units* (embedding, each block, head) run in order, each with its own forward and
//! backward over the unit's slice of the flat parameter and gradient buffers.
//!
//! The engine drives the unit loop itself, so the point where a unit's backward returns is the
//! "gradients of this range are final" event DDP buckets wait for, and ZeRO-3 can materialise a
//! unit's parameters just before it runs and free them right after.
use std::ops::Range;

use crate::ParallelError;

pub trait StagedModel: Sync {
    /// One micro-batch (inputs and targets).
    type Batch: Sync;
    /// What flows between units (activations forward, their gradients backward).
    type Act: Send;
    /// What a unit's backward needs from its forward.
    type Cache: Send;

    /// Flat ranges of the units in forward order; contiguous, starting at 0.
    fn units(&self) -> Vec<Range<usize>>;
    /// Flat ranges of the individual tensors in layout order (for planners finer than a unit;
    /// the data-parallel engine's buckets hold whole units).
    fn tensors(&self) -> Vec<Range<usize>>;
    /// Forward of `unit` with its parameters `params`. The first unit gets `x = None` and reads
    /// the batch; the last unit returns the loss (mean over the micro-batch) as its output.
    /// `scale` is d(total loss)/d(this micro-batch's loss), for losses added inside units (MoE
    /// auxiliary loss); the same value is passed to backward.
    fn forward(
        &self,
        unit: usize,
        params: &[f32],
        x: Option<Self::Act>,
        batch: &Self::Batch,
        scale: f32,
    ) -> Result<(Self::Act, Self::Cache), ParallelError>;
    /// Scalar loss from the last unit's output.
    fn loss(&self, out: &Self::Act) -> f32;
    /// The validation metric of a forward-only pass (`last`: the last unit's cache); by
    /// default the loss. The decoders report the cross-entropy alone, without the MoE
    /// auxiliary loss, as the single-process trainer's validation does.
    fn eval_metric(&self, out: &Self::Act, last: &Self::Cache) -> f32 {
        let _ = last;
        self.loss(out)
    }
    /// Backward of `unit`: `dy = None` for the last unit, which seeds d(loss) = `scale`.
    /// Adds the unit's parameter gradients into `grads` (the unit's slice) and returns dX
    /// (`None` for the first unit).
    fn backward(
        &self,
        unit: usize,
        params: &[f32],
        cache: Self::Cache,
        dy: Option<Self::Act>,
        scale: f32,
        grads: &mut [f32],
    ) -> Result<Option<Self::Act>, ParallelError>;
    /// Bytes held by a cache (activation accounting).
    fn cache_bytes(&self, cache: &Self::Cache) -> usize;
}
