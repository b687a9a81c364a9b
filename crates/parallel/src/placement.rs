//! Where each parameter tensor of the model lives on a rank: which block of the full tensor the
//! rank holds ([`TensorSlice`], Megatron's "sharded tensor": a global shape, an offset and a
//! local shape per dimension) and where that block starts in the rank's flat buffer
//! ([`Placement`]).
//!
//! Tensor parallelism cuts tensors by rows or columns, so a rank's part is a rectangle of a
//! *view* of the full tensor (any reshape with the same row-major order: the fused MoE
//! `gate_up [E, 2F, H]` split by rows within each of its `2E` row groups is the rectangle
//! `[2E, F/tp, H]` of the view `[2E, F, H]`). ZeRO then cuts the rank's flat buffer anywhere,
//! so a saved piece is a slice plus a range of its row-major elements. Everything that moves
//! tensors between layouts — the initialisation, checkpoint save and load, the Hugging Face
//! export — goes through [`TensorSlice::runs`]: the contiguous runs of full-tensor elements a
//! range of slice elements covers.
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A rectangular block of a tensor viewed as `shape`: `offset[d] .. offset[d] + local[d]` on
/// every dimension `d`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlice {
    /// The tensor's Hugging Face name.
    pub name: String,
    /// The view of the full tensor the block is cut from.
    pub shape: Vec<usize>,
    pub offset: Vec<usize>,
    pub local: Vec<usize>,
}

/// One contiguous run: `len` elements from full-tensor flat index `full` and slice flat index
/// `slice`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub full: usize,
    pub slice: usize,
    pub len: usize,
}

impl TensorSlice {
    /// The whole tensor `name` of shape `shape`.
    pub fn whole(name: &str, shape: &[usize]) -> Self {
        TensorSlice {
            name: name.to_string(),
            shape: shape.to_vec(),
            offset: vec![0; shape.len()],
            local: shape.to_vec(),
        }
    }

    /// Elements of the full tensor.
    pub fn full_numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements of the block.
    pub fn numel(&self) -> usize {
        self.local.iter().product()
    }

    /// Whether the block lies inside the view (same rank, every dimension in bounds).
    pub fn is_valid(&self) -> bool {
        self.shape.len() == self.offset.len()
            && self.shape.len() == self.local.len()
            && !self.shape.is_empty()
            && (0..self.shape.len()).all(|d| {
                self.offset[d]
                    .checked_add(self.local[d])
                    .is_some_and(|end| end <= self.shape[d])
            })
    }

    /// Elements of the full tensor, `None` when the count overflows (a corrupt record); a
    /// valid slice whose full count fits has block counts and strides that fit too.
    pub fn checked_full_numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// The runs of full-tensor elements that slice elements `r` (row-major in the block) cover,
    /// in order.
    pub fn runs(&self, r: Range<usize>) -> Vec<Run> {
        let n = self.shape.len();
        let last = self.local[n - 1];
        let mut out = Vec::new();
        if last == 0 || r.is_empty() {
            return out;
        }
        // Row-major strides of the full view.
        let mut stride = vec![1; n];
        for d in (0..n - 1).rev() {
            stride[d] = stride[d + 1] * self.shape[d + 1];
        }
        let mut pos = r.start;
        while pos < r.end {
            let row = pos / last;
            let col = pos % last;
            let len = (last - col).min(r.end - pos);
            // The block row's multi-index over all but the last dimension.
            let mut rest = row;
            let mut full = self.offset[n - 1] + col;
            for d in (0..n - 1).rev() {
                let i = rest % self.local[d];
                rest /= self.local[d];
                full += (self.offset[d] + i) * stride[d];
            }
            match out.last_mut() {
                // Adjacent in both: one longer run (a whole tensor is a single run).
                Some(prev) if prev.full + prev.len == full => prev.len += len,
                _ => out.push(Run {
                    full,
                    slice: pos,
                    len,
                }),
            }
            pos += len;
        }
        out
    }
}

/// A tensor block held by a rank: its slice, where it starts in the rank's flat parameter
/// buffer (its elements follow in row-major order), and whether this rank is the one that
/// counts it (the first of the ranks holding the same block: in gradient norms and
/// checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub slice: TensorSlice,
    pub start: usize,
    pub owner: bool,
}

impl Placement {
    /// The block's range in the rank's flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.slice.numel()
    }
}

/// The parts of `within` that no range of `ranges` covers, in order (the ranges in any order,
/// overlapping, repeated, empty or reaching outside `within`): the buckets' gradients not yet
/// landed under ZeRO-Offload, a unit's elements outside its value parts.
pub(crate) fn uncovered(mut ranges: Vec<Range<usize>>, within: Range<usize>) -> Vec<Range<usize>> {
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut next = within.start;
    for r in ranges
        .iter()
        .chain(std::iter::once(&(within.end..within.end)))
    {
        let start = r.start.min(within.end);
        if start > next {
            out.push(next..start);
        }
        next = next.max(r.end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one-range lists are the point
    fn uncovered_is_the_complement_within() {
        assert_eq!(uncovered(vec![], 0..10), vec![0..10]);
        assert_eq!(uncovered(vec![0..10], 0..10), vec![]);
        // Out of order, overlapping, repeated, empty, and a gap at the end.
        assert_eq!(
            uncovered(vec![6..8, 2..4, 3..5, 2..4, 5..5], 0..12),
            vec![0..2, 5..6, 8..12]
        );
        assert_eq!(uncovered(vec![0..3, 3..7, 7..9], 0..9), vec![]);
        // Within a range that does not start at 0, with ranges reaching outside it.
        assert_eq!(
            uncovered(vec![12..20, 30..30], 10..50),
            vec![10..12, 20..50]
        );
        assert_eq!(uncovered(vec![0..15, 45..60], 10..50), vec![15..45]);
        assert_eq!(uncovered(vec![60..70], 10..50), vec![10..50]);
    }

    /// The block's elements, read element by element from the full tensor.
    fn naive(s: &TensorSlice, full: &[f32]) -> Vec<f32> {
        let n = s.shape.len();
        (0..s.numel())
            .map(|mut k| {
                let mut idx = vec![0; n];
                for d in (0..n).rev() {
                    idx[d] = s.offset[d] + k % s.local[d];
                    k /= s.local[d];
                }
                let flat = idx.iter().zip(&s.shape).fold(0, |a, (i, d)| a * d + i);
                full[flat]
            })
            .collect()
    }

    #[test]
    fn runs_walk_the_block_in_row_major_order() {
        let full: Vec<f32> = (0..4 * 6 * 5).map(|i| i as f32).collect();
        let s = TensorSlice {
            name: "t".into(),
            shape: vec![4, 6, 5],
            offset: vec![1, 2, 1],
            local: vec![2, 3, 3],
        };
        assert!(s.is_valid());
        let want = naive(&s, &full);
        for (a, b) in [(0, s.numel()), (2, 11), (4, 5), (17, 18)] {
            let mut got = vec![f32::NAN; b - a];
            for run in s.runs(a..b) {
                got[run.slice - a..run.slice - a + run.len]
                    .copy_from_slice(&full[run.full..run.full + run.len]);
            }
            assert_eq!(got, want[a..b], "{a}..{b}");
        }
        assert!(s.runs(3..3).is_empty());
        let whole = TensorSlice::whole("w", &[3, 4]);
        assert_eq!(
            whole.runs(1..12),
            vec![Run {
                full: 1,
                slice: 1,
                len: 11
            }]
        );
        let bad = TensorSlice {
            offset: vec![3, 0, 0],
            ..s
        };
        assert!(!bad.is_valid());
    }
}
