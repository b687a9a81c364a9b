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
use model::layers::{rmsnorm, rmsnorm_backward_input, Act, Buf, BufMut, BufRef};
use model::{ModelError, Result, View};
use tensor::cross_entropy::{count_valid, CeConfig};
use tensor::ops::{logits_grad_inplace, logits_row_stats, matmul};

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

/// What the head's backward needs (on the device of the weights; the per-row log-sum-exp on
/// the host).
#[derive(Debug, Clone)]
pub struct TpHeadCache {
    x: Act,
    rstd: Act,
    /// Normed input of all tokens (gathered under sp).
    xn: Act,
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
    fn weights<'a>(&self, p: BufRef<'a>) -> BufRef<'a> {
        self.lm.at(p).slice(0..self.shard() * self.dim())
    }

    /// Local logits of rows `[r0, r0 + n)` of `xn` into `z` (`[n, shard]`).
    fn logits(&self, w: BufRef<'_>, xn: &Buf, r0: usize, n: usize, z: BufMut<'_>) -> Result<()> {
        let d = self.dim();
        let x = xn.r().slice(r0 * d..(r0 + n) * d);
        matmul(z, x, w, n, d, self.shard(), false, true, false)?;
        Ok(())
    }

    /// Loss sum over valid targets for final hidden states `x` (local tokens under sp) and
    /// the targets of all tokens. The products run on the weights' device; the per-row
    /// statistics (three values a row) and their all-reduces on the host.
    pub fn forward(&self, p: BufRef<'_>, x: Act, targets: Arc<Vec<i64>>) -> Result<TpHeadCache> {
        let n_valid = count_valid(&targets, self.vocab, self.ce.ignore_index)?;
        let (xn, rstd) = rmsnorm(p, &self.norm, x.r(), self.eps)?;
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
        let mut z = tensor::ops::zeros_like(xn.r(), chunk.min(rows) * v)?;
        for r0 in (0..rows).step_by(chunk).filter(|_| v > 0) {
            let n = chunk.min(rows - r0);
            self.logits(w, &xn, r0, n, z.m().slice_mut(0..n * v))?;
            logits_row_stats(
                z.r().slice(0..n * v),
                v,
                self.start(),
                &targets[r0..r0 + n],
                self.ce.ignore_index,
                &mut max[r0..r0 + n],
                &mut sum[r0..r0 + n],
                &mut tl[r0..r0 + n],
            )?;
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
            rstd: Arc::new(rstd),
            xn: Arc::new(xn),
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
        p: BufRef<'_>,
        mut g: BufMut<'_>,
        cache: TpHeadCache,
        grad_scale: f32,
    ) -> Result<Buf> {
        let (w, v, d) = (self.weights(p), self.shard(), self.dim());
        let rows = cache.targets.len();
        let chunk = self.ce.chunk_rows.max(1);
        let mut z = tensor::ops::zeros_like(cache.xn.r(), chunk.min(rows) * v)?;
        let mut dxn = tensor::ops::zeros_like(cache.xn.r(), rows * d)?;
        for r0 in (0..rows).step_by(chunk).filter(|_| v > 0) {
            let n = chunk.min(rows - r0);
            self.logits(w, &cache.xn, r0, n, z.m().slice_mut(0..n * v))?;
            logits_grad_inplace(
                z.m().slice_mut(0..n * v),
                v,
                self.start(),
                &cache.targets[r0..r0 + n],
                self.ce.ignore_index,
                &cache.lse[r0..r0 + n],
                grad_scale,
            )?;
            let zc = z.r().slice(0..n * v);
            matmul(
                dxn.m().slice_mut(r0 * d..(r0 + n) * d),
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
                self.lm.at_mut(g.reborrow()).slice_mut(0..v * d),
                zc,
                cache.xn.r().slice(r0 * d..(r0 + n) * d),
                v,
                n,
                d,
                true,
                false,
                true,
            )?;
        }
        let dxn = self.region.enter_backward(dxn)?;
        let dx = rmsnorm_backward_input(p, &self.norm, cache.x.r(), cache.rstd.r(), dxn.r(), None)?;
        tensor::ops::rmsnorm_backward_weight(
            dxn.r(),
            cache.x.r(),
            cache.rstd.r(),
            d,
            self.norm.at_mut(g),
        )?;
        Ok(dx)
    }
}
