//! PowerSGD gradient compression (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank
//! Gradient Compression for Distributed Optimization", 2019), as PyTorch's DDP
//! `powerSGD_hook` runs it: `train.grad_comm = "powersgd:R"`.
//!
//! Per gradient bucket, each tensor of two or more dimensions (not counting dimensions of size
//! 1, such as the head-group axis of an unsplit projection) is viewed as a matrix `M [n, m]`
//! (`n` = its first such dimension) and, where it pays (`2·(n + m)·r < n·m`, PyTorch's
//! minimum compression rate of 2, `r = min(n, m, R)`), replaced by a rank-`r` approximation;
//! the other tensors are all-reduced exactly. With `e` this rank's error from the last step
//! (error feedback) and `Q [m, r]` the bucket's last `Q` (warm start; orthonormal random
//! columns, the same on every rank, the first time):
//!
//! 1. `M ← M + e`; keep a copy `M₀`;
//! 2. the uncompressed tensors: all-reduce, divide by the ranks `N`;
//! 3. `Q ← orth(Q)`, `P = M·Q`; all-reduce the bucket's `P`s; `P ← orth(P)`;
//! 4. `Q = Mᵀ·P`; all-reduce the bucket's `Q`s, divide by `N`;
//! 5. `M ← P·Qᵀ` (= the rank-r projection of the ranks' mean); `e ← M₀ − M`.
//!
//! `orth` is Gram-Schmidt over the columns (each normalised by `‖c‖ + 1e-8`, PyTorch's
//! epsilon, so a vanishing column stays finite). Bytes on the wire per compressed matrix:
//! `(n + m)·r` values instead of `n·m`.
//!
//! Everything after step 1 depends on the ranks' errors only through their sum (both
//! products are linear in `M`, and the exact part is a mean), so the error state a checkpoint
//! needs is the ranks' mean error — a tensor like the moments, which reshards like them.
use std::collections::HashMap;
use std::ops::Range;

use comm::{ProcessGroup, ReduceOp};

use crate::ParallelError;

/// PyTorch's `orthogonalization_epsilon`.
const ORTH_EPS: f32 = 1e-8;

/// A matrix of a bucket: elements `at..at + n·m` of the bucket, compressed to rank `r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub at: usize,
    pub n: usize,
    pub m: usize,
    pub r: usize,
}

/// How a bucket is compressed: its matrices and its exactly reduced ranges (relative to the
/// bucket).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketLayout {
    pub matrices: Vec<Matrix>,
    pub exact: Vec<Range<usize>>,
}

impl BucketLayout {
    /// The layout of a bucket covering flat `range`, from the tensors' flat ranges and local
    /// shapes (every element of the range belongs to one tensor).
    pub fn new(range: Range<usize>, tensors: &[(Range<usize>, Vec<usize>)], rank: usize) -> Self {
        let mut l = BucketLayout::default();
        let mut inside: Vec<&(Range<usize>, Vec<usize>)> = tensors
            .iter()
            .filter(|(r, _)| r.start >= range.start && r.end <= range.end && !r.is_empty())
            .collect();
        inside.sort_by_key(|(r, _)| r.start);
        for (r, shape) in inside {
            let at = r.start - range.start;
            let dims: Vec<usize> = shape.iter().copied().filter(|&d| d != 1).collect();
            let n = dims.first().copied().unwrap_or(1);
            let m = r.len() / n.max(1);
            let rr = rank.min(n).min(m);
            if dims.len() >= 2 && rr > 0 && 2 * (n + m) * rr < n * m {
                l.matrices.push(Matrix { at, n, m, r: rr });
            } else {
                l.exact.push(at..at + r.len());
            }
        }
        l
    }

    /// Values this layout puts on the wire per all-reduce round (exact + P + Q), for the
    /// compression ratio.
    pub fn wire_values(&self) -> usize {
        let exact: usize = self.exact.iter().map(|r| r.len()).sum();
        exact
            + self
                .matrices
                .iter()
                .map(|x| (x.n + x.m) * x.r)
                .sum::<usize>()
    }
}

/// One bucket's state: this rank's error and the warm-start `Q`s (concatenated).
#[derive(Clone, Debug)]
struct BucketState {
    error: Vec<f32>,
    qs: Vec<f32>,
}

/// The PowerSGD state of a rank: per bucket its error and its `Q`s.
#[derive(Clone, Debug)]
pub struct PowerSgd {
    pub rank: usize,
    seed: u64,
    buckets: HashMap<usize, BucketState>,
}

impl PowerSgd {
    pub fn new(rank: usize, seed: u64) -> Self {
        PowerSgd {
            rank,
            seed,
            buckets: HashMap::new(),
        }
    }

    /// This rank's error of bucket `b` (zeros before its first reduction).
    pub fn error(&self, b: usize) -> Option<&[f32]> {
        self.buckets.get(&b).map(|s| s.error.as_slice())
    }

    /// Sets bucket `b`'s error (a resumed run: the saved mean error, on every rank); its `Q`s
    /// start afresh.
    pub fn set_error(&mut self, b: usize, layout: &BucketLayout, error: Vec<f32>) {
        let qs = initial_qs(layout, self.seed, b);
        self.buckets.insert(b, BucketState { error, qs });
    }

    /// Replaces this rank's gradients `buf` of bucket `b` (laid out as `layout`) by the
    /// PowerSGD approximation of the ranks' mean over `group` (steps 1–5 of the module doc).
    pub fn reduce(
        &mut self,
        b: usize,
        layout: &BucketLayout,
        buf: &mut [f32],
        group: &ProcessGroup,
    ) -> Result<(), ParallelError> {
        let ranks = group.size() as f32;
        let seed = self.seed;
        let st = self.buckets.entry(b).or_insert_with(|| BucketState {
            error: vec![0.0; buf.len()],
            qs: initial_qs(layout, seed, b),
        });
        if st.error.len() != buf.len() {
            return Err(ParallelError::Protocol(format!(
                "PowerSGD bucket {b}: an error of {} values for a bucket of {}",
                st.error.len(),
                buf.len()
            )));
        }
        // 1. Error feedback.
        buf.iter_mut().zip(&st.error).for_each(|(g, e)| *g += e);
        let before = buf.to_vec();
        // 2. The exact part.
        let mut exact: Vec<f32> = layout
            .exact
            .iter()
            .flat_map(|r| buf[r.clone()].iter().copied())
            .collect();
        if !exact.is_empty() {
            group.all_reduce(&mut exact, ReduceOp::Sum)?;
            let mut at = 0;
            for r in &layout.exact {
                for (g, s) in buf[r.clone()].iter_mut().zip(&exact[at..at + r.len()]) {
                    *g = s / ranks;
                }
                at += r.len();
            }
        }
        if !layout.matrices.is_empty() {
            // 3. P = M·orth(Q), summed over the ranks, orthogonalised.
            let mut ps = Vec::new();
            let mut qo = 0;
            for x in &layout.matrices {
                let q = &mut st.qs[qo..qo + x.m * x.r];
                orthogonalize(q, x.m, x.r);
                let m = &buf[x.at..x.at + x.n * x.m];
                ps.extend(tensor::gemm::matmul_new(m, q, x.n, x.m, x.r, false, false)?);
                qo += x.m * x.r;
            }
            group.all_reduce(&mut ps, ReduceOp::Sum)?;
            // 4. Q = Mᵀ·P, averaged over the ranks.
            let (mut po, mut qo) = (0, 0);
            for x in &layout.matrices {
                let p = &mut ps[po..po + x.n * x.r];
                orthogonalize(p, x.n, x.r);
                let m = &buf[x.at..x.at + x.n * x.m];
                tensor::gemm::matmul(
                    &mut st.qs[qo..qo + x.m * x.r],
                    m,
                    p,
                    x.m,
                    x.n,
                    x.r,
                    true,
                    false,
                    false,
                )?;
                po += x.n * x.r;
                qo += x.m * x.r;
            }
            group.all_reduce(&mut st.qs, ReduceOp::Sum)?;
            st.qs.iter_mut().for_each(|q| *q /= ranks);
            // 5. M = P·Qᵀ.
            let (mut po, mut qo) = (0, 0);
            for x in &layout.matrices {
                tensor::gemm::matmul(
                    &mut buf[x.at..x.at + x.n * x.m],
                    &ps[po..po + x.n * x.r],
                    &st.qs[qo..qo + x.m * x.r],
                    x.n,
                    x.r,
                    x.m,
                    false,
                    true,
                    false,
                )?;
                po += x.n * x.r;
                qo += x.m * x.r;
            }
        }
        st.error
            .iter_mut()
            .zip(before.iter().zip(buf.iter()))
            .for_each(|(e, (b, a))| *e = b - a);
        Ok(())
    }
}

/// Gram-Schmidt over the `cols` columns of the row-major `[rows, cols]` matrix `a`: each
/// column normalised by `‖c‖ + ε`, then removed from the columns after it.
pub fn orthogonalize(a: &mut [f32], rows: usize, cols: usize) {
    for i in 0..cols {
        let norm = (0..rows)
            .map(|k| (a[k * cols + i] as f64).powi(2))
            .sum::<f64>()
            .sqrt() as f32;
        let inv = 1.0 / (norm + ORTH_EPS);
        for k in 0..rows {
            a[k * cols + i] *= inv;
        }
        for j in i + 1..cols {
            let dot: f64 = (0..rows)
                .map(|k| a[k * cols + i] as f64 * a[k * cols + j] as f64)
                .sum();
            let dot = dot as f32;
            for k in 0..rows {
                a[k * cols + j] -= dot * a[k * cols + i];
            }
        }
    }
}

/// The first `Q`s of bucket `b`: standard normal values from a generator seeded by the run
/// seed and the bucket (the same on every rank).
pub fn initial_qs(layout: &BucketLayout, seed: u64, b: usize) -> Vec<f32> {
    let len: usize = layout.matrices.iter().map(|x| x.m * x.r).sum();
    let mut s = seed ^ (b as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut uniform = move || {
        // splitmix64
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    // Box-Muller.
    (0..len)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_gives_orthonormal_columns() {
        let (rows, cols) = (9, 3);
        let mut a: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7 % 11) as f32) - 5.0)
            .collect();
        orthogonalize(&mut a, rows, cols);
        for i in 0..cols {
            for j in 0..cols {
                let d: f32 = (0..rows).map(|k| a[k * cols + i] * a[k * cols + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "column {i}·{j} = {d}");
            }
        }
        let mut zero = vec![0.0; rows * cols];
        orthogonalize(&mut zero, rows, cols);
        assert!(zero.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn layouts_compress_the_matrices_that_pay() {
        let tensors = vec![
            (10..10 + 64 * 32, vec![1, 64, 32]),
            (0..10, vec![10]),
            (10 + 64 * 32..10 + 64 * 32 + 16, vec![4, 4]),
        ];
        let l = BucketLayout::new(0..10 + 64 * 32 + 16, &tensors, 4);
        assert_eq!(
            l.matrices,
            [Matrix {
                at: 10,
                n: 64,
                m: 32,
                r: 4
            }]
        );
        // 4x4 at rank 4: 2·8·4 > 16, not worth it.
        assert_eq!(l.exact, [0..10, 10 + 64 * 32..10 + 64 * 32 + 16]);
        assert_eq!(l.wire_values(), 10 + 16 + (64 + 32) * 4);
    }
}
