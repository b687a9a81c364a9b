//! ZeRO-Offload's traffic between a GPU and the host, for 16-bit weights and gradients on the
//! GPU and the fp32 master weights and AdamW moments on the host (Ren et al. 2021,
//! "ZeRO-Offload", arXiv 2101.06840, §4): the gradients this rank updates land in page-locked
//! host memory bucket by bucket, the moment the backward has made each one final — on a
//! stream of their own, while the backward goes on — so that the optimizer step finds them on
//! the host; and the updated weights go up chunk by chunk from two page-locked stages while
//! the host updates the next chunk (`optimizer::host_update`).
//!
//! A bucket is final when its reduction is done ([`super::TraceKind::BucketDone`]) after its
//! pipeline stage's last weight-gradient action of the step: ZeRO-2/3 reduce a bucket after
//! every micro-batch's backward, and only the last sum is the gradient. Whatever has not
//! landed by the optimizer step (padding, a bucket reduced at the step's end) is queued then,
//! before the step waits, so the host always updates from every element of the step.
use std::ops::Range;

use tensor::cuda::Staged;

use super::run::terr;
use super::{Executor, TraceKind};
use crate::precision::{Bucketed, Flat, DEVICE_CHUNK};
use crate::stage::StageModel;
use crate::ParallelError;

/// The page-locked buffers of ZeRO-Offload on a GPU, made at the first step and kept.
pub(super) struct OffloadTraffic {
    /// The gradients AdamW reads: indices of the gradient buffers (the executor's
    /// `own_ranges().0`).
    grads: Range<usize>,
    /// Their 16-bit bits on the host, landed or in flight.
    landing: Staged<u16>,
    /// The pieces of `grads` queued into `landing` this step (relative to `grads.start`).
    landed: Vec<Range<usize>>,
    /// Per local stage: whether its last weight-gradient action of the step has run.
    final_stage: Vec<bool>,
    /// The rounded weights of a chunk on their way up, one stage per chunk in flight.
    uploads: [Staged<u16>; 2],
}

impl OffloadTraffic {
    /// Page-locked bytes held.
    pub(super) fn pinned_bytes(&self) -> usize {
        2 * (self.landing.len() + self.uploads.iter().map(|u| u.len()).sum::<usize>())
    }

    /// Queues the pieces of `grads` not landed yet, waits for every landing, and returns the
    /// gradients' bits (element `i` is gradient `grads.start + i`) and the upload stages.
    pub(super) fn landed(
        &mut self,
        grads: &Bucketed,
    ) -> Result<(&[u16], &mut [Staged<u16>; 2]), ParallelError> {
        let mut landed = std::mem::take(&mut self.landed);
        landed.sort_by_key(|r| r.start);
        let mut next = 0;
        let n = self.grads.len();
        for r in landed.iter().chain(std::iter::once(&(n..n))) {
            if r.start > next {
                let gap = self.grads.start + next..self.grads.start + r.start;
                grads.land(gap, &mut self.landing, next).map_err(terr)?;
            }
            next = next.max(r.end);
        }
        let bits = self.landing.host().map_err(|e| terr(e.into()))?;
        Ok((bits, &mut self.uploads))
    }
}

impl<M: StageModel> Executor<M> {
    /// At the start of a step: makes the offload buffers (ZeRO-Offload of 16-bit weights on a
    /// GPU, the first time) and forgets the last step's landings.
    pub(super) fn begin_offload_step(&mut self) -> Result<(), ParallelError> {
        let Flat::DevHalf { bits, .. } = &self.params else {
            return Ok(());
        };
        if !self.cfg.offload_optimizer {
            return Ok(());
        }
        if self.offload.is_none() {
            let gpu = bits.gpu().clone();
            let (grads, _, _) = self.own_ranges();
            let stage = || Staged::new(&gpu, DEVICE_CHUNK).map_err(|e| terr(e.into()));
            self.offload = Some(OffloadTraffic {
                landing: Staged::new(&gpu, grads.len()).map_err(|e| terr(e.into()))?,
                grads,
                landed: Vec::new(),
                final_stage: Vec::new(),
                uploads: [stage()?, stage()?],
            });
        }
        let stages = self.stages.len();
        if let Some(t) = &mut self.offload {
            t.landed.clear();
            t.final_stage = vec![false; stages];
        }
        Ok(())
    }

    /// Local stage `ls` has run its last weight-gradient action of the step: its buckets'
    /// next completions are final.
    pub(super) fn stage_grads_final(&mut self, ls: usize) {
        if let Some(t) = &mut self.offload {
            t.final_stage[ls] = true;
        }
    }

    /// Bucket `b`'s reduction is done: traced, and under ZeRO-Offload on a GPU its final
    /// gradients (this rank's part) queued to land on the host.
    pub(super) fn bucket_done(&mut self, b: usize) -> Result<(), ParallelError> {
        self.record(TraceKind::BucketDone(b));
        let Some(ls) = self.stages.iter().position(|s| s.buckets.contains(&b)) else {
            return Ok(());
        };
        let Some(t) = self.offload.as_mut().filter(|t| t.final_stage[ls]) else {
            return Ok(());
        };
        // The bucket's gradients in the gradient buffers' indices: the bucket's own range, or
        // (ZeRO-2/3) this rank's part of it in its shard.
        let br = self.buckets[b].range.clone();
        let held = if self.cfg.zero.shards_grads() {
            let me = self.dp.rank();
            let own = self.spec.intersect(me, &br);
            if own.is_empty() {
                return Ok(());
            }
            self.spec.to_local(me, &own)
        } else {
            br
        };
        let (s, e) = (held.start.max(t.grads.start), held.end.min(t.grads.end));
        if s >= e {
            return Ok(());
        }
        let at = s - t.grads.start;
        self.grads.land(s..e, &mut t.landing, at).map_err(terr)?;
        t.landed.push(at..at + (e - s));
        Ok(())
    }
}
