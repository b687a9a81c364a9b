//! Softmax cross-entropy fused with the LM-head matmul, computed in chunks of rows so the
//! full `[tokens, vocab]` logits never exist at once.
//!
//! Per row with logits `z` and target `t`: `loss = lse(z) − z_t`, `lse(z) = m + log Σ e^(z−m)`,
//! `∂loss/∂z = softmax(z) − onehot(t)`. Rows whose target equals the ignore index contribute
//! neither loss nor gradient; the mean is over valid rows. The backward takes the gradient
//! scale explicitly (`1 / n_valid` for a per-batch mean; `1 / global_valid` when data-parallel
//! ranks or micro-batches share one mean).
//!
//! The row pieces ([`logits_row_stats`], [`combine_row_stats`], [`logits_grad_inplace`]) work
//! on a vocabulary *shard* `[vocab_start, vocab_start + shard)`, so a vocab-parallel
//! cross-entropy reuses them: all-reduce the per-row max, then the rescaled sums and target
//! logits, then apply the same gradient formula to the local shard.

use crate::error::check_len;
use crate::gemm::matmul;
use crate::microkernel::{exp_sub_scale, row_max, sum_exp_sub};
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// PyTorch's default ignore index.
pub const IGNORE_INDEX: i64 = -100;

/// Settings of the fused loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CeConfig {
    /// Target value meaning "no loss for this row".
    pub ignore_index: i64,
    /// Rows of logits materialised at once (memory: `chunk_rows · vocab` floats).
    pub chunk_rows: usize,
}

impl Default for CeConfig {
    fn default() -> Self {
        CeConfig {
            ignore_index: IGNORE_INDEX,
            chunk_rows: 128,
        }
    }
}

impl CeConfig {
    /// Floats of logits a chunk may hold in [`CeConfig::for_vocab`] (8 MiB).
    pub const CHUNK_FLOATS: usize = 1 << 21;

    /// The default settings with chunks sized for `vocab`: as many rows as fit in
    /// [`CeConfig::CHUNK_FLOATS`], between 128 and 512. Longer chunks make better products
    /// (the `x·Wᵀ` chunk product runs faster with more rows, and the `[vocab, hidden]` weight
    /// gradient is read and written once per chunk): on the medium preset's head (vocab 4096,
    /// 2 threads) 512-row chunks ran the fused pass 1.19–1.36× faster than 128-row ones
    /// (docs/PERFORMANCE.md, "LM head chunks").
    pub fn for_vocab(vocab: usize) -> CeConfig {
        CeConfig {
            chunk_rows: (Self::CHUNK_FLOATS / vocab.max(1)).clamp(128, 512),
            ..CeConfig::default()
        }
    }
}

/// Result of a loss forward: the sum over valid rows and their count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CeOutput {
    pub loss_sum: f64,
    pub n_valid: usize,
}

impl CeOutput {
    /// Mean loss over valid rows (0 when there are none).
    pub fn mean(&self) -> f32 {
        if self.n_valid == 0 {
            0.0
        } else {
            (self.loss_sum / self.n_valid as f64) as f32
        }
    }
}

/// Checks every target is in `[0, vocab)` or the ignore index; returns the valid count.
pub fn count_valid(targets: &[i64], vocab: usize, ignore_index: i64) -> Result<usize, TensorError> {
    let mut n = 0;
    for (pos, &t) in targets.iter().enumerate() {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as usize >= vocab {
            return Err(TensorError::IdOutOfRange { id: t, pos, vocab });
        }
        n += 1;
    }
    Ok(n)
}

/// Per-row statistics of a logits block `[rows, shard]` covering vocabulary ids
/// `[vocab_start, vocab_start + shard)`: the row max, `Σ exp(z − max)` and the target's logit
/// (0 when the target is outside the shard or ignored).
#[allow(clippy::too_many_arguments)]
pub fn logits_row_stats(
    logits: &[f32],
    shard: usize,
    vocab_start: usize,
    targets: &[i64],
    ignore_index: i64,
    max: &mut [f32],
    sumexp: &mut [f32],
    target_logit: &mut [f32],
) {
    let rows = targets.len();
    debug_assert_eq!(logits.len(), rows * shard);
    debug_assert!(max.len() == rows && sumexp.len() == rows && target_logit.len() == rows);
    threads::install(|| {
        logits
            .par_chunks(shard)
            .zip(targets.par_iter())
            .zip(
                max.par_iter_mut()
                    .zip(sumexp.par_iter_mut())
                    .zip(target_logit.par_iter_mut()),
            )
            .with_min_len(4)
            .for_each(|((z, &t), ((mx, se), tl))| {
                let m = row_max(z);
                *mx = m;
                *se = sum_exp_sub(z, m);
                *tl = match local_target(t, ignore_index, vocab_start, shard) {
                    Some(j) => z[j],
                    None => 0.0,
                };
            });
    });
}

/// Combines per-shard `(max, sumexp)` of one row into its log-sum-exp:
/// `M = max_r m_r`, `lse = M + log Σ_r s_r·e^(m_r − M)`.
pub fn combine_row_stats(parts: &[(f32, f32)]) -> f32 {
    let m = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.0));
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + parts
        .iter()
        .map(|&(mi, si)| si * (mi - m).exp())
        .sum::<f32>()
        .ln()
}

/// Turns a logits block over a vocabulary shard into its gradient, in place:
/// `dz = (e^(z − lse) − onehot(t)) · grad_scale` for valid rows, `0` for ignored rows.
pub fn logits_grad_inplace(
    logits: &mut [f32],
    shard: usize,
    vocab_start: usize,
    targets: &[i64],
    ignore_index: i64,
    lse: &[f32],
    grad_scale: f32,
) {
    debug_assert_eq!(logits.len(), targets.len() * shard);
    threads::install(|| {
        logits
            .par_chunks_mut(shard)
            .zip(targets.par_iter().zip(lse.par_iter()))
            .with_min_len(4)
            .for_each(|(z, (&t, &l))| {
                if t == ignore_index {
                    z.fill(0.0);
                    return;
                }
                exp_sub_scale(z, l, grad_scale);
                if let Some(j) = local_target(t, ignore_index, vocab_start, shard) {
                    z[j] -= grad_scale;
                }
            });
    });
}

#[inline]
fn local_target(t: i64, ignore_index: i64, vocab_start: usize, shard: usize) -> Option<usize> {
    if t == ignore_index || t < vocab_start as i64 || t >= (vocab_start + shard) as i64 {
        None
    } else {
        Some(t as usize - vocab_start)
    }
}

/// Cross-entropy over given logits `[rows, vocab]`: writes `lse` (`[rows]`) and returns the
/// loss sum over valid rows.
pub fn cross_entropy_forward(
    logits: &[f32],
    targets: &[i64],
    vocab: usize,
    ignore_index: i64,
    lse: &mut [f32],
) -> Result<CeOutput, TensorError> {
    check_len("ce logits", logits.len(), targets.len() * vocab)?;
    check_len("ce lse", lse.len(), targets.len())?;
    let n_valid = count_valid(targets, vocab, ignore_index)?;
    let rows = targets.len();
    let (mut mx, mut se, mut tl) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
    logits_row_stats(
        logits,
        vocab,
        0,
        targets,
        ignore_index,
        &mut mx,
        &mut se,
        &mut tl,
    );
    let mut loss_sum = 0.0f64;
    for r in 0..rows {
        lse[r] = combine_row_stats(&[(mx[r], se[r])]);
        if targets[r] != ignore_index {
            loss_sum += (lse[r] - tl[r]) as f64;
        }
    }
    Ok(CeOutput { loss_sum, n_valid })
}

/// Gradient of `grad_scale · Σ_valid loss` with respect to the logits (written into `dlogits`).
pub fn cross_entropy_backward(
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    vocab: usize,
    ignore_index: i64,
    grad_scale: f32,
    dlogits: &mut [f32],
) -> Result<(), TensorError> {
    check_len("ce logits", logits.len(), targets.len() * vocab)?;
    check_len("ce dlogits", dlogits.len(), logits.len())?;
    check_len("ce lse", lse.len(), targets.len())?;
    count_valid(targets, vocab, ignore_index)?;
    dlogits.copy_from_slice(logits);
    logits_grad_inplace(dlogits, vocab, 0, targets, ignore_index, lse, grad_scale);
    Ok(())
}

fn check_fused(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
) -> Result<usize, TensorError> {
    check_len("fused ce x", x.len(), targets.len() * dim)?;
    check_len("fused ce w", w.len(), vocab * dim)?;
    if cfg.chunk_rows == 0 {
        return Err(TensorError::Shape(
            "fused ce: chunk_rows must be positive".into(),
        ));
    }
    count_valid(targets, vocab, cfg.ignore_index)
}

/// Fused `loss = CE(x·Wᵀ, targets)` with `x [rows, dim]`, `W [vocab, dim]` (HF `lm_head`
/// layout). Writes `lse` (`[rows]`, needed by the backward) and returns the loss sum.
pub fn fused_linear_ce_forward(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
    lse: &mut [f32],
) -> Result<CeOutput, TensorError> {
    let n_valid = check_fused(x, w, targets, dim, vocab, cfg)?;
    check_len("fused ce lse", lse.len(), targets.len())?;
    let loss_sum = chunk_pass(x, w, targets, dim, vocab, cfg, Lse::Write(lse), None)?;
    Ok(CeOutput { loss_sum, n_valid })
}

/// Backward of [`fused_linear_ce_forward`] for `grad_scale · loss_sum`: recomputes each chunk
/// of logits, then writes `dx = dz·W` (if given) and accumulates `dW += dzᵀ·x` (if given).
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_ce_backward(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    lse: &[f32],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
    grad_scale: f32,
    dx: Option<&mut [f32]>,
    dw_accum: Option<&mut [f32]>,
) -> Result<(), TensorError> {
    check_fused(x, w, targets, dim, vocab, cfg)?;
    check_len("fused ce lse", lse.len(), targets.len())?;
    let grad = check_grad_outputs(x, w, grad_scale, dx, dw_accum)?;
    chunk_pass(x, w, targets, dim, vocab, cfg, Lse::Read(lse), Some(grad))?;
    Ok(())
}

/// Forward and backward in one pass over the logits: the loss of
/// [`fused_linear_ce_forward`] and the gradients of [`fused_linear_ce_backward`] for
/// `grad_scale · loss_sum`, each chunk's logits computed once and turned into their gradient
/// while still in cache (as Liger-kernel's fused linear cross-entropy does). Saves one
/// `[rows, dim] × [dim, vocab]` product against forward-then-backward; usable whenever the
/// gradient scale is known before the forward (e.g. `loss_scale / n_valid` for a per-batch
/// mean, with `n_valid` from [`count_valid`]). Per element the operations, and therefore the
/// results (`lse`, `dx`, `dW`), are bit-identical to the two separate calls.
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_ce_forward_backward(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
    grad_scale: f32,
    lse: &mut [f32],
    dx: Option<&mut [f32]>,
    dw_accum: Option<&mut [f32]>,
) -> Result<CeOutput, TensorError> {
    let n_valid = check_fused(x, w, targets, dim, vocab, cfg)?;
    check_len("fused ce lse", lse.len(), targets.len())?;
    let grad = check_grad_outputs(x, w, grad_scale, dx, dw_accum)?;
    let loss_sum = chunk_pass(x, w, targets, dim, vocab, cfg, Lse::Write(lse), Some(grad))?;
    Ok(CeOutput { loss_sum, n_valid })
}

/// The log-sum-exps of a chunk pass: computed (forward) or given (backward).
enum Lse<'a> {
    Write(&'a mut [f32]),
    Read(&'a [f32]),
}

/// The gradient outputs of a chunk pass.
struct GradOut<'a> {
    scale: f32,
    dx: Option<&'a mut [f32]>,
    dw: Option<&'a mut [f32]>,
}

fn check_grad_outputs<'a>(
    x: &[f32],
    w: &[f32],
    scale: f32,
    dx: Option<&'a mut [f32]>,
    dw: Option<&'a mut [f32]>,
) -> Result<GradOut<'a>, TensorError> {
    if let Some(dx) = dx.as_deref() {
        check_len("fused ce dx", dx.len(), x.len())?;
    }
    if let Some(dw) = dw.as_deref() {
        check_len("fused ce dw", dw.len(), w.len())?;
    }
    Ok(GradOut { scale, dx, dw })
}

/// The one loop behind the fused entry points (inputs already checked): per chunk of
/// `chunk_rows` rows, `z = x·Wᵀ`; with [`Lse::Write`] the chunk's `lse` and loss; with a
/// gradient, `dz = (softmax(z) − onehot)·scale` in place, `dx = dz·W`, `dW += dzᵀ·x`.
/// Returns the loss sum (0 when only reading `lse`).
#[allow(clippy::too_many_arguments)]
fn chunk_pass(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    dim: usize,
    vocab: usize,
    cfg: &CeConfig,
    mut lse: Lse,
    mut grad: Option<GradOut>,
) -> Result<f64, TensorError> {
    let rows = targets.len();
    let mut logits = vec![0.0f32; cfg.chunk_rows.min(rows) * vocab];
    let mut loss_sum = 0.0f64;
    for r0 in (0..rows).step_by(cfg.chunk_rows) {
        let n = cfg.chunk_rows.min(rows - r0);
        let t = &targets[r0..r0 + n];
        let xc = &x[r0 * dim..(r0 + n) * dim];
        let ignored = t.iter().all(|&v| v == cfg.ignore_index);
        if ignored && matches!(lse, Lse::Read(_)) {
            // Backward of a chunk without targets: no logits needed.
            if let Some(dx) = grad.as_mut().and_then(|g| g.dx.as_deref_mut()) {
                dx[r0 * dim..(r0 + n) * dim].fill(0.0);
            }
            continue;
        }
        let z = &mut logits[..n * vocab];
        matmul(z, xc, w, n, dim, vocab, false, true, false)?;
        let lse_c: &[f32] = match &mut lse {
            Lse::Write(l) => {
                let l = &mut l[r0..r0 + n];
                loss_sum += cross_entropy_forward(z, t, vocab, cfg.ignore_index, l)?.loss_sum;
                l
            }
            Lse::Read(l) => &l[r0..r0 + n],
        };
        let Some(g) = grad.as_mut() else { continue };
        if ignored {
            if let Some(dx) = g.dx.as_deref_mut() {
                dx[r0 * dim..(r0 + n) * dim].fill(0.0);
            }
            continue;
        }
        logits_grad_inplace(z, vocab, 0, t, cfg.ignore_index, lse_c, g.scale);
        if let Some(dx) = g.dx.as_deref_mut() {
            let dxc = &mut dx[r0 * dim..(r0 + n) * dim];
            matmul(dxc, z, w, n, vocab, dim, false, false, false)?;
        }
        if let Some(dw) = g.dw.as_deref_mut() {
            matmul(dw, z, xc, vocab, n, dim, true, false, true)?;
        }
    }
    Ok(loss_sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_grad, rand_vec};

    /// f64 reference: full logits, then mean CE over valid rows.
    fn loss_ref(x: &[f64], w: &[f64], targets: &[i64], dim: usize, vocab: usize) -> f64 {
        let (mut sum, mut n) = (0.0, 0);
        for (r, &t) in targets.iter().enumerate() {
            if t == IGNORE_INDEX {
                continue;
            }
            let z: Vec<f64> = (0..vocab)
                .map(|v| (0..dim).map(|c| x[r * dim + c] * w[v * dim + c]).sum())
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            sum += lse - z[t as usize];
            n += 1;
        }
        sum / n as f64
    }

    #[test]
    fn fused_equals_naive_and_gradients_match() {
        let (rows, dim, vocab) = (11, 6, 13);
        let x: Vec<f32> = rand_vec(rows * dim, 1).iter().map(|v| v * 2.0).collect();
        let w = rand_vec(vocab * dim, 2);
        let mut targets: Vec<i64> = (0..rows as i64).map(|i| (i * 5) % vocab as i64).collect();
        targets[3] = IGNORE_INDEX;
        targets[7] = IGNORE_INDEX;
        let (x64, w64): (Vec<f64>, Vec<f64>) = (
            x.iter().map(|&v| v as f64).collect(),
            w.iter().map(|&v| v as f64).collect(),
        );
        let want = loss_ref(&x64, &w64, &targets, dim, vocab);
        // Chunk sizes: 1 row, not dividing rows, and larger than rows.
        for chunk_rows in [1, 4, 64] {
            let cfg = CeConfig {
                chunk_rows,
                ..Default::default()
            };
            let mut lse = vec![0.0; rows];
            let out =
                fused_linear_ce_forward(&x, &w, &targets, dim, vocab, &cfg, &mut lse).unwrap();
            assert_eq!(out.n_valid, rows - 2);
            assert!(
                (out.mean() as f64 - want).abs() < 1e-5,
                "{} vs {want}",
                out.mean()
            );
            let scale = 1.0 / out.n_valid as f32;
            let mut dx = vec![0.0; rows * dim];
            let mut dw = vec![0.5; vocab * dim];
            fused_linear_ce_backward(
                &x,
                &w,
                &targets,
                &lse,
                dim,
                vocab,
                &cfg,
                scale,
                Some(&mut dx),
                Some(&mut dw),
            )
            .unwrap();
            // f64 central differences (h = 1e-4; truncation ~1e-8).
            let gx = fd_grad(&x, 1e-4, &mut |xv| loss_ref(xv, &w64, &targets, dim, vocab));
            let gw: Vec<f64> =
                fd_grad(&w, 1e-4, &mut |wv| loss_ref(&x64, wv, &targets, dim, vocab))
                    .iter()
                    .map(|g| g + 0.5)
                    .collect();
            assert_close("dx", &dx, &gx, 1e-5, 1e-4);
            assert_close("dw", &dw, &gw, 1e-5, 1e-4);
            assert!(dx[3 * dim..4 * dim].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn forward_backward_in_one_pass_equals_separate_calls_exactly() {
        let (rows, dim, vocab) = (37, 8, 21);
        let x = rand_vec(rows * dim, 11);
        let w = rand_vec(vocab * dim, 12);
        let mut targets: Vec<i64> = (0..rows as i64).map(|i| (i * 7) % vocab as i64).collect();
        // Rows 8..12 form a fully ignored chunk when chunk_rows = 4.
        for t in &mut targets[8..12] {
            *t = IGNORE_INDEX;
        }
        targets[20] = IGNORE_INDEX;
        for chunk_rows in [4, 5, 64] {
            let cfg = CeConfig {
                chunk_rows,
                ..Default::default()
            };
            let scale = 0.37;
            let mut lse = vec![0.0; rows];
            let out =
                fused_linear_ce_forward(&x, &w, &targets, dim, vocab, &cfg, &mut lse).unwrap();
            let (mut dx, mut dw) = (vec![1.0; rows * dim], vec![0.25; vocab * dim]);
            fused_linear_ce_backward(
                &x,
                &w,
                &targets,
                &lse,
                dim,
                vocab,
                &cfg,
                scale,
                Some(&mut dx),
                Some(&mut dw),
            )
            .unwrap();
            let mut lse1 = vec![0.0; rows];
            let (mut dx1, mut dw1) = (vec![1.0; rows * dim], vec![0.25; vocab * dim]);
            let out1 = fused_linear_ce_forward_backward(
                &x,
                &w,
                &targets,
                dim,
                vocab,
                &cfg,
                scale,
                &mut lse1,
                Some(&mut dx1),
                Some(&mut dw1),
            )
            .unwrap();
            assert_eq!(out, out1);
            assert_eq!(lse, lse1);
            assert_eq!(dx, dx1);
            assert_eq!(dw, dw1);
            assert!(dx1[8 * dim..12 * dim].iter().all(|&v| v == 0.0));
        }
        let cfg = CeConfig::default();
        let mut lse = vec![0.0; rows];
        let mut short = vec![0.0; 3];
        let r = fused_linear_ce_forward_backward(
            &x,
            &w,
            &targets,
            dim,
            vocab,
            &cfg,
            1.0,
            &mut lse,
            Some(&mut short),
            None,
        );
        assert!(r.is_err());
    }

    #[test]
    fn shard_pieces_combine_to_full_softmax() {
        // Two vocabulary shards give the same lse and gradient as the full vocabulary.
        let (rows, vocab, split) = (5, 9, 4);
        let z = rand_vec(rows * vocab, 3)
            .iter()
            .map(|v| v * 5.0)
            .collect::<Vec<f32>>();
        let targets = vec![0i64, 8, 3, IGNORE_INDEX, 4];
        let mut lse = vec![0.0; rows];
        let out = cross_entropy_forward(&z, &targets, vocab, IGNORE_INDEX, &mut lse).unwrap();
        let mut dz = vec![0.0; z.len()];
        cross_entropy_backward(&z, &targets, &lse, vocab, IGNORE_INDEX, 0.5, &mut dz).unwrap();
        let shards = [(0usize, split), (split, vocab - split)];
        let mut stats = vec![Vec::new(); rows];
        let mut tl_sum = vec![0.0f32; rows];
        let blocks: Vec<Vec<f32>> = shards
            .iter()
            .map(|&(s0, n)| {
                (0..rows)
                    .flat_map(|r| z[r * vocab + s0..r * vocab + s0 + n].to_vec())
                    .collect()
            })
            .collect();
        for (blk, &(s0, n)) in blocks.iter().zip(&shards) {
            let (mut m, mut s, mut t) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
            logits_row_stats(blk, n, s0, &targets, IGNORE_INDEX, &mut m, &mut s, &mut t);
            for r in 0..rows {
                stats[r].push((m[r], s[r]));
                tl_sum[r] += t[r];
            }
        }
        let mut loss = 0.0f64;
        for r in 0..rows {
            let l = combine_row_stats(&stats[r]);
            assert!((l - lse[r]).abs() < 1e-5);
            if targets[r] != IGNORE_INDEX {
                loss += (l - tl_sum[r]) as f64;
            }
        }
        assert!((loss - out.loss_sum).abs() < 1e-4);
        for (blk, &(s0, n)) in blocks.iter().zip(&shards) {
            let mut g = blk.clone();
            logits_grad_inplace(&mut g, n, s0, &targets, IGNORE_INDEX, &lse, 0.5);
            for r in 0..rows {
                for j in 0..n {
                    assert!((g[r * n + j] - dz[r * vocab + s0 + j]).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn rejects_bad_targets_and_shapes() {
        let mut lse = vec![0.0; 2];
        let z = vec![0.0; 6];
        let e = cross_entropy_forward(&z, &[0, 3], 3, IGNORE_INDEX, &mut lse).unwrap_err();
        assert_eq!(
            e,
            TensorError::IdOutOfRange {
                id: 3,
                pos: 1,
                vocab: 3
            }
        );
        assert!(cross_entropy_forward(&z, &[0, -5], 3, IGNORE_INDEX, &mut lse).is_err());
        let cfg = CeConfig {
            chunk_rows: 0,
            ..Default::default()
        };
        assert!(
            fused_linear_ce_forward(&[0.0; 4], &[0.0; 6], &[0, 1], 2, 3, &cfg, &mut lse).is_err()
        );
        let out =
            cross_entropy_forward(&z, &[IGNORE_INDEX, IGNORE_INDEX], 3, IGNORE_INDEX, &mut lse)
                .unwrap();
        assert_eq!(out.mean(), 0.0);
    }

    #[test]
    fn chunks_sized_for_the_vocabulary() {
        // 8 MiB of logits per chunk, within [128, 512] rows.
        assert_eq!(CeConfig::for_vocab(4096).chunk_rows, 512);
        assert_eq!(CeConfig::for_vocab(8192).chunk_rows, 256);
        assert_eq!(CeConfig::for_vocab(32_000).chunk_rows, 128);
        assert_eq!(CeConfig::for_vocab(256).chunk_rows, 512);
        assert_eq!(CeConfig::for_vocab(0).chunk_rows, 512);
        assert_eq!(CeConfig::for_vocab(4096).ignore_index, IGNORE_INDEX);
    }
}
