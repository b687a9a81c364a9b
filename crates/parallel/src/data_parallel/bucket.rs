//! Gradient buckets: contiguous ranges of the flat gradient buffer, planned in reverse layer
//! order (the order backward finalises gradients), and a tracker that says when each bucket's
//! gradients are all final so its reduction can be launched while backward continues.
//!
//! Planning walks the parameter tensors from the last to the first and closes a bucket as soon
//! as it holds at least `cap` elements (PyTorch DDP's `bucket_cap_mb`, Megatron's
//! `bucket_size`). A tensor is never split between buckets, so one larger than `cap` is a bucket
//! of its own. Because the flat buffer stores tensors in layer order, each bucket is one
//! contiguous range, and bucket 0 is the one at the end of the buffer (ready first).
use std::ops::Range;

use crate::ParallelError;

/// Default bucket size of PyTorch DDP: 25 MB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// One bucket: a contiguous flat range covering whole tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Flat element range in the gradient buffer.
    pub range: Range<usize>,
    /// Indices (into the planning input) of the tensors it covers.
    pub tensors: Range<usize>,
}

/// Buckets in launch order (reverse layer order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    pub buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// Plans buckets over `tensors` (flat ranges in layout order, sorted and non-overlapping)
    /// with at least `cap_elems` elements per bucket except possibly the last one planned.
    pub fn new(tensors: &[Range<usize>], cap_elems: usize) -> Result<Self, ParallelError> {
        if cap_elems == 0 {
            return Err(ParallelError::Config("bucket size must be positive".into()));
        }
        for w in tensors.windows(2) {
            if w[1].start < w[0].end {
                return Err(ParallelError::Config(format!(
                    "parameter ranges overlap or are unsorted: {:?} then {:?}",
                    w[0], w[1]
                )));
            }
        }
        let mut buckets = Vec::new();
        let mut end_tensor = tensors.len();
        while end_tensor > 0 {
            let mut start_tensor = end_tensor;
            let mut elems = 0;
            while start_tensor > 0 && elems < cap_elems {
                start_tensor -= 1;
                elems += tensors[start_tensor].len();
            }
            buckets.push(Bucket {
                range: tensors[start_tensor].start..tensors[end_tensor - 1].end,
                tensors: start_tensor..end_tensor,
            });
            end_tensor = start_tensor;
        }
        Ok(Self { buckets })
    }

    /// Bucket size in elements from a size in bytes and the gradient element size.
    pub fn cap_elems(bytes: usize, elem_bytes: usize) -> usize {
        (bytes / elem_bytes.max(1)).max(1)
    }

    /// Largest bucket, in elements (the size of a reusable communication buffer).
    pub fn max_len(&self) -> usize {
        self.buckets
            .iter()
            .map(|b| b.range.len())
            .max()
            .unwrap_or(0)
    }
}

/// Counts, per bucket, the gradient elements not yet final during one backward pass.
#[derive(Clone, Debug)]
pub struct ReadyTracker {
    ranges: Vec<Range<usize>>,
    pending: Vec<usize>,
}

impl ReadyTracker {
    pub fn new(plan: &BucketPlan) -> Self {
        Self::for_buckets(&plan.buckets)
    }

    /// A tracker over `buckets` (indices in the results are positions in this slice).
    pub fn for_buckets(buckets: &[Bucket]) -> Self {
        let ranges: Vec<_> = buckets.iter().map(|b| b.range.clone()).collect();
        let pending = ranges.iter().map(|r| r.len()).collect();
        Self { ranges, pending }
    }

    /// Records that the gradients in flat range `r` are final; returns the buckets that just
    /// became complete. Reporting an element twice is an error (it would launch a reduction of
    /// a gradient that is still changing).
    pub fn mark(&mut self, r: Range<usize>) -> Result<Vec<usize>, ParallelError> {
        let mut done = Vec::new();
        for (b, br) in self.ranges.iter().enumerate() {
            let overlap = r.end.min(br.end).saturating_sub(r.start.max(br.start));
            if overlap == 0 {
                continue;
            }
            if overlap > self.pending[b] {
                return Err(ParallelError::Protocol(format!(
                    "gradient range {r:?} reported final twice (bucket {b})"
                )));
            }
            self.pending[b] -= overlap;
            if self.pending[b] == 0 {
                done.push(b);
            }
        }
        Ok(done)
    }

    /// Buckets still waiting for gradients.
    pub fn incomplete(&self) -> Vec<usize> {
        (0..self.pending.len())
            .filter(|&b| self.pending[b] > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn contiguous(lens: &[usize]) -> Vec<Range<usize>> {
        let mut off = 0;
        lens.iter()
            .map(|&l| {
                off += l;
                off - l..off
            })
            .collect()
    }

    #[test]
    fn buckets_follow_reverse_layer_order() {
        let t = contiguous(&[4, 4, 10, 2, 3]);
        let plan = BucketPlan::new(&t, 5).unwrap();
        let got: Vec<_> = plan.buckets.iter().map(|b| b.range.clone()).collect();
        // From the end: [3,2] = 5 elems, then the oversized 10 alone, then [4,4].
        assert_eq!(got, vec![18..23, 8..18, 0..8]);
        assert_eq!(plan.buckets[0].tensors, 3..5);
        assert_eq!(plan.max_len(), 10);
        assert!(BucketPlan::new(&t, 0).is_err());
    }

    #[test]
    fn tracker_reports_completion_once() {
        let t = contiguous(&[4, 4, 10, 2, 3]);
        let plan = BucketPlan::new(&t, 5).unwrap();
        let mut tr = ReadyTracker::new(&plan);
        assert_eq!(tr.mark(20..23).unwrap(), Vec::<usize>::new());
        assert_eq!(tr.mark(18..20).unwrap(), vec![0]);
        // A coarse report can complete several buckets at once.
        assert_eq!(tr.mark(0..18).unwrap(), vec![1, 2]);
        assert!(tr.incomplete().is_empty());
        assert!(tr.mark(0..1).is_err());
    }

    proptest! {
        #[test]
        fn plan_covers_every_tensor_once(lens in proptest::collection::vec(1usize..50, 1..20), cap in 1usize..120) {
            let t = contiguous(&lens);
            let plan = BucketPlan::new(&t, cap).unwrap();
            let mut next_end = t.last().unwrap().end;
            let mut next_tensor = t.len();
            for b in &plan.buckets {
                prop_assert_eq!(b.range.end, next_end);
                prop_assert_eq!(b.tensors.end, next_tensor);
                // Closed as soon as it reached the cap: dropping its first tensor falls below.
                let first = t[b.tensors.start].len();
                prop_assert!(b.range.len() - first < cap);
                next_end = b.range.start;
                next_tensor = b.tensors.start;
            }
            prop_assert_eq!(next_end, 0);
            prop_assert_eq!(next_tensor, 0);
        }
    }
}
