//! Distributed sampler math: which samples of a global batch each data-parallel rank reads on
//! each accumulation micro-step.
//!
//! A global batch of `B = dp * micro_batch * accum` samples is cut into `dp * accum`
//! micro-batches of `micro_batch`; micro-batch `k = a * dp + r` goes to rank `r` on
//! accumulation step `a` (the order of `train::data::Sampler`, so the single-process run with
//! `dp * accum` accumulation steps reads exactly the same micro-batches). Every sample is read by exactly one (rank, micro-step), so the mean loss over the global
//! batch — the single-process objective — is
//! `L = 1/dp * sum_r 1/accum * sum_a L(r, a)` when every micro-batch has the same token count;
//! hence gradients are scaled by `1/accum` on each micro-step and averaged over ranks.
use std::ops::Range;

use crate::ParallelError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    pub dp: usize,
    pub micro_batch: usize,
    pub accum: usize,
}

impl DistributedSampler {
    pub fn new(dp: usize, micro_batch: usize, accum: usize) -> Result<Self, ParallelError> {
        if dp == 0 || micro_batch == 0 || accum == 0 {
            return Err(ParallelError::Config(format!(
                "dp ({dp}), micro-batch ({micro_batch}) and accumulation steps ({accum}) must all be positive"
            )));
        }
        Ok(Self {
            dp,
            micro_batch,
            accum,
        })
    }

    /// The sampler for `dp` ranks that reads the same global batch of `global` samples with
    /// micro-batches of `micro_batch`: `accum = global / (dp * micro_batch)`.
    pub fn for_global_batch(
        global: usize,
        dp: usize,
        micro_batch: usize,
    ) -> Result<Self, ParallelError> {
        let per_step = dp
            .checked_mul(micro_batch)
            .filter(|&p| p > 0)
            .ok_or_else(|| ParallelError::Config("dp and micro-batch must be positive".into()))?;
        if global == 0 || !global.is_multiple_of(per_step) {
            return Err(ParallelError::Config(format!(
                "global batch {global} is not a positive multiple of dp ({dp}) x micro-batch ({micro_batch})"
            )));
        }
        Self::new(dp, micro_batch, global / per_step)
    }

    pub fn global_batch(&self) -> usize {
        self.dp * self.micro_batch * self.accum
    }

    /// Positions within the global batch read by `rank` on micro-step `micro`.
    pub fn positions(&self, rank: usize, micro: usize) -> Range<usize> {
        let start = (micro * self.dp + rank) * self.micro_batch;
        start..start + self.micro_batch
    }

    /// Dataset sample indices read by `rank` on micro-step `micro` of optimizer step `step`,
    /// when global batch `s` is samples `[s*B, (s+1)*B)` of an (already shuffled) sample order.
    pub fn samples(&self, step: usize, rank: usize, micro: usize) -> Range<usize> {
        let base = step * self.global_batch();
        let p = self.positions(rank, micro);
        base + p.start..base + p.end
    }

    /// Whether micro-step `micro` is the last of the step (the one whose backward reduces).
    pub fn is_last_micro(&self, micro: usize) -> bool {
        micro + 1 == self.accum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_read_exactly_once_whatever_dp() {
        let global = 24;
        for (dp, mb) in [(1, 24), (1, 4), (2, 3), (4, 2), (4, 6), (8, 1)] {
            let s = DistributedSampler::for_global_batch(global, dp, mb).unwrap();
            assert_eq!(s.global_batch(), global);
            let mut seen = vec![0; 2 * global];
            for step in 0..2 {
                for r in 0..dp {
                    for a in 0..s.accum {
                        for i in s.samples(step, r, a) {
                            seen[i] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "dp={dp} mb={mb}: {seen:?}");
        }
    }

    #[test]
    fn rejects_batches_that_do_not_divide() {
        assert!(DistributedSampler::for_global_batch(10, 4, 2).is_err());
        assert!(DistributedSampler::new(0, 1, 1).is_err());
        let s = DistributedSampler::new(2, 2, 3).unwrap();
        assert!(s.is_last_micro(2) && !s.is_last_micro(1));
    }
}
