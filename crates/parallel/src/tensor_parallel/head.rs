//! Final RMSNorm + vocabulary-parallel LM head fused with cross-entropy. Rank `r` holds LM-head
//! rows `[r·n, (r+1)·n)`, `n = ⌈V/tp⌉`, and computes only the logits of its rows below `V`
//! (padding rows are left out of the softmax), chunk by chunk; the full `[tokens, V]` logits
//! never exist anywhere.
//!
//! Per row, with shard logits `z_r`, target `t` (Megatron's vocab-parallel CE):
//! ```text
//! m_r = max z_r,  M = max_r m_r                        (all-reduce max)
//! s_r = Σ e^(z_r − M),  S = Σ_r s_r;  z_t from its owner (one all-reduce sum of [s, z_t])
//! loss = log S + M − z_t
//! ∂loss/∂z_r = e^(z_r − lse) − onehot_r(t)             (local: no communication)
//! ```
//! The input gradient `dz_r·W_r` is a partial sum over ranks: the region's `f*` (all-reduce, or
//! reduce-scatter under sp) completes it, exactly like a column-parallel linear.

use std::sync::Arc;

use comm::ReduceOp;
use model::layers::block::RegionHooks;
use model::layers::{rmsnorm, rmsnorm_backward_input, Act};
use model::{ModelError, Result, View};
use tensor::cross_entropy::{count_valid, logits_grad_inplace, logits_row_stats, CeConfig};
use tensor::gemm::matmul;

use super::region::TpRegion;

#[derive(Debug, Clone)]
pub struct VocabParallelHead {
    /// `model.norm.weight` and the local `lm_head.weight` rows, relative to the head slice.
    pub norm: View,
    pub lm: View,
    /// Full vocabulary size.
    pub vocab: usize,
    pub eps: f32,
    pub ce: CeConfig,
    pub region: TpRegion,
}

/// What the head's backward needs.
#[derive(Debug, Clone)]
pub struct TpHeadCache {
    x: Act,
    rstd: Vec<f32>,
    /// Normed input of all tokens (gathered under sp).
    xn: Vec<f32>,
    lse: Vec<f32>,
    targets: Arc<Vec<i64>>,
    pub loss_sum: f64,
    pub n_valid: usize,
}

impl TpHeadCache {
    /// Bytes this cache holds until the backward.
    pub fn bytes(&self) -> usize {
        4 * (self.x.len() + self.rstd.len() + self.xn.len() + self.lse.len())
            + 8 * self.targets.len()
    }
}

impl VocabParallelHead {
    fn dim(&self) -> usize {
        self.norm.numel()
    }
    /// Vocabulary rows this rank holds (padding included).
    fn rows(&self) -> usize {
        self.lm.shape[0]
    }
    fn start(&self) -> usize {
        self.region.rank() * self.rows()
    }
    /// Real (non-padding) vocabulary rows of this rank: the width of its logits.
    fn shard(&self) -> usize {
        self.rows().min(self.vocab.saturating_sub(self.start()))
    }
    /// The LM-head rows of the real vocabulary.
    fn weights<'a>(&self, p: &'a [f32]) -> &'a [f32] {
        &self.lm.of(p)[..self.shard() * self.dim()]
    }

    /// Local logits of rows `[r0, r0 + n)` of `xn`.
    fn logits(&self, w: &[f32], xn: &[f32], r0: usize, n: usize, z: &mut [f32]) -> Result<()> {
        let d = self.dim();
        matmul(
            z,
            &xn[r0 * d..(r0 + n) * d],
            w,
            n,
            d,
            self.shard(),
            false,
            true,
            false,
        )?;
        Ok(())
    }

    /// Loss sum over valid targets for final hidden states `x` (local tokens under sp) and
    /// the targets of all tokens.
    pub fn forward(&self, p: &[f32], x: Act, targets: Arc<Vec<i64>>) -> Result<TpHeadCache> {
        let n_valid = count_valid(&targets, self.vocab, self.ce.ignore_index)?;
        let host = |b: model::layers::Buf| b.into_host("tensor parallelism");
        let (xn, rstd) = rmsnorm(p.into(), &self.norm, x.r(), self.eps)?;
        let (xn, rstd) = (host(xn)?, host(rstd)?);
        let xn = self.region.enter_forward(xn)?;
        let rows = targets.len();
        if xn.len() != rows * self.dim() {
            return Err(ModelError::InvalidBatch(format!(
                "head: {} hidden values for {rows} targets",
                xn.len()
            )));
        }
        let (w, v) = (self.weights(p), self.shard());
        // A rank whose rows are all padding has no logits: max −∞ and sum 0 drop out below.
        let mut max = vec![f32::NEG_INFINITY; rows];
        let (mut sum, mut tl) = (vec![0.0; rows], vec![0.0; rows]);
        let chunk = self.ce.chunk_rows.max(1);
        let mut z = vec![0.0; chunk.min(rows) * v];
        for r0 in (0..rows).step_by(chunk).filter(|_| v > 0) {
            let n = chunk.min(rows - r0);
            self.logits(w, &xn, r0, n, &mut z[..n * v])?;
            logits_row_stats(
                &z[..n * v],
                v,
                self.start(),
                &targets[r0..r0 + n],
                self.ce.ignore_index,
                &mut max[r0..r0 + n],
                &mut sum[r0..r0 + n],
                &mut tl[r0..r0 + n],
            );
        }
        let mut gmax = max.clone();
        self.region.all_reduce_op(&mut gmax, ReduceOp::Max)?;
        // Rescale to the global max, then one all-reduce of [Σ e^(z−M) | z_t].
        let mut st: Vec<f32> = sum
            .iter()
            .zip(max.iter().zip(&gmax))
            .map(|(s, (m, g))| s * (m - g).exp())
            .chain(tl.iter().copied())
            .collect();
        self.region.all_reduce_op(&mut st, ReduceOp::Sum)?;
        let (s, t) = st.split_at(rows);
        let lse: Vec<f32> = gmax.iter().zip(s).map(|(m, s)| m + s.ln()).collect();
        let loss_sum = targets
            .iter()
            .enumerate()
            .filter(|(_, &tg)| tg != self.ce.ignore_index)
            .map(|(i, _)| (lse[i] - t[i]) as f64)
            .sum();
        Ok(TpHeadCache {
            x,
            rstd,
            xn,
            lse,
            targets,
            loss_sum,
            n_valid,
        })
    }

    /// Input gradient of `grad_scale · loss_sum` (local tokens under sp); the norm-gain and
    /// local LM-head gradients are accumulated into `g` (same indexing as `p`).
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        cache: TpHeadCache,
        grad_scale: f32,
    ) -> Result<Vec<f32>> {
        let (w, v, d) = (self.weights(p), self.shard(), self.dim());
        let rows = cache.targets.len();
        let chunk = self.ce.chunk_rows.max(1);
        let mut z = vec![0.0; chunk.min(rows) * v];
        let mut dxn = vec![0.0; rows * d];
        for r0 in (0..rows).step_by(chunk).filter(|_| v > 0) {
            let n = chunk.min(rows - r0);
            let zc = &mut z[..n * v];
            self.logits(w, &cache.xn, r0, n, zc)?;
            logits_grad_inplace(
                zc,
                v,
                self.start(),
                &cache.targets[r0..r0 + n],
                self.ce.ignore_index,
                &cache.lse[r0..r0 + n],
                grad_scale,
            );
            matmul(
                &mut dxn[r0 * d..(r0 + n) * d],
                zc,
                w,
                n,
                v,
                d,
                false,
                false,
                false,
            )?;
            matmul(
                &mut self.lm.of_mut(g)[..v * d],
                zc,
                &cache.xn[r0 * d..(r0 + n) * d],
                v,
                n,
                d,
                true,
                false,
                true,
            )?;
        }
        let dxn = self.region.enter_backward(dxn)?;
        let dx = rmsnorm_backward_input(
            p.into(),
            &self.norm,
            cache.x.r(),
            (&cache.rstd).into(),
            (&dxn).into(),
            None,
        )?
        .into_host("tensor parallelism")?;
        let x = cache.x.as_host("tensor parallelism")?;
        tensor::norm::rmsnorm_backward_weight(&dxn, x, &cache.rstd, d, self.norm.of_mut(g))?;
        Ok(dx)
    }
}
