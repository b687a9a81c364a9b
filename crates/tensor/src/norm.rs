//! RMSNorm (Llama): `y = x · rstd · w`, `rstd = 1 / sqrt(mean(x²) + eps)` per row.
//!
//! Backward, with `x̂ = x·rstd` and `g = dy ∘ w`:
//! `dx = rstd · (g − x̂ · mean(g ∘ x̂))` and `dw += Σ_rows dy ∘ x̂`.

use crate::error::check_len;
use crate::microkernel::{dot, rms_apply};
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Forward over `rows = x.len() / dim` rows: writes `y` (`[rows, dim]`) and `rstd` (`[rows]`,
/// kept for backward).
pub fn rmsnorm_forward(
    x: &[f32],
    w: &[f32],
    dim: usize,
    eps: f32,
    y: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), TensorError> {
    let rows = rows_of(x.len(), dim)?;
    check_len("rmsnorm w", w.len(), dim)?;
    check_len("rmsnorm y", y.len(), x.len())?;
    check_len("rmsnorm rstd", rstd.len(), rows)?;
    threads::install(|| {
        y.par_chunks_mut(dim * ROWS_PER_TASK)
            .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
            .zip(x.par_chunks(dim * ROWS_PER_TASK))
            .for_each(|((y, rs), x)| {
                for ((y, r), x) in y.chunks_mut(dim).zip(rs.iter_mut()).zip(x.chunks(dim)) {
                    let ss = dot(x, x, None);
                    let rstd = 1.0 / (ss / dim as f32 + eps).sqrt();
                    *r = rstd;
                    rms_apply(x, x, w, rstd, 0.0, y);
                }
            });
    });
    Ok(())
}

/// Backward. `dx` (if given) is written; `dw_accum` (if given) is accumulated (`+=`).
/// Either may be skipped, so input and weight gradients can be scheduled separately.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dim: usize,
    dx: Option<&mut [f32]>,
    dw_accum: Option<&mut [f32]>,
) -> Result<(), TensorError> {
    let rows = rows_of(x.len(), dim)?;
    check_len("rmsnorm dy", dy.len(), x.len())?;
    check_len("rmsnorm w", w.len(), dim)?;
    check_len("rmsnorm rstd", rstd.len(), rows)?;
    threads::install(|| -> Result<(), TensorError> {
        if let Some(dx) = dx {
            check_len("rmsnorm dx", dx.len(), x.len())?;
            dx.par_chunks_mut(dim)
                .zip(dy.par_chunks(dim))
                .zip(x.par_chunks(dim))
                .zip(rstd.par_iter())
                .with_min_len(ROWS_PER_TASK)
                .for_each(|(((dx, dy), x), &r)| {
                    // mean(g ∘ x̂) with g = dy ∘ w, x̂ = x·r
                    let c = dot(dy, w, Some(x)) * r * r / dim as f32;
                    rms_apply(dy, x, w, r, c, dx);
                });
        }
        if let Some(dw) = dw_accum {
            check_len("rmsnorm dw", dw.len(), dim)?;
            // Fixed chunks summed in a fixed order: the result is bitwise reproducible,
            // independent of the thread count and of work stealing.
            let partials: Vec<Vec<f32>> = dy
                .par_chunks(dim * ROWS_PER_TASK)
                .zip(x.par_chunks(dim * ROWS_PER_TASK))
                .zip(rstd.par_chunks(ROWS_PER_TASK))
                .map(|((dy, x), rs)| {
                    let mut acc = vec![0.0f32; dim];
                    for ((dy, x), &r) in dy.chunks(dim).zip(x.chunks(dim)).zip(rs) {
                        for ((a, d), x) in acc.iter_mut().zip(dy).zip(x) {
                            *a += d * x * r;
                        }
                    }
                    acc
                })
                .collect();
            let mut partial = vec![0.0f32; dim];
            for p in &partials {
                partial.iter_mut().zip(p).for_each(|(a, b)| *a += b);
            }
            dw.iter_mut().zip(&partial).for_each(|(d, p)| *d += p);
        }
        Ok(())
    })
}

fn rows_of(len: usize, dim: usize) -> Result<usize, TensorError> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(TensorError::Shape(format!(
            "length {len} is not a multiple of dim {dim}"
        )));
    }
    Ok(len / dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_grad, rand_vec};

    /// f64 reference of `sum(dy ∘ rmsnorm(x, w))`.
    fn loss_ref(x: &[f64], w: &[f64], dy: &[f32], dim: usize, eps: f64) -> f64 {
        let mut l = 0.0;
        for (r, xr) in x.chunks(dim).enumerate() {
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
            let rstd = 1.0 / (ms + eps).sqrt();
            for j in 0..dim {
                l += dy[r * dim + j] as f64 * xr[j] * rstd * w[j];
            }
        }
        l
    }

    #[test]
    fn forward_and_gradients_match_f64_finite_differences() {
        let (rows, dim, eps) = (37, 24, 1e-5f32);
        let x = rand_vec(rows * dim, 11);
        let w = rand_vec(dim, 12);
        let dy = rand_vec(rows * dim, 13);
        let mut y = vec![0.0; rows * dim];
        let mut rstd = vec![0.0; rows];
        rmsnorm_forward(&x, &w, dim, eps, &mut y, &mut rstd).unwrap();
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            let want: Vec<f64> = (0..dim).map(|j| xr[j] as f64 * rs * w[j] as f64).collect();
            assert_close("y", &y[r * dim..(r + 1) * dim], &want, 1e-5, 1e-5);
        }
        let mut dx = vec![0.0; rows * dim];
        let mut dw = vec![1.0; dim]; // accumulate onto 1.0
        rmsnorm_backward(&dy, &x, &w, &rstd, dim, Some(&mut dx), Some(&mut dw)).unwrap();
        let wf: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let xf: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        // Central differences in f64 with h = 1e-4: truncation ~h²·|f'''| ≈ 1e-8, far below
        // the f32 rounding of the analytical gradient (~1e-6 relative).
        let gx = fd_grad(&x, 1e-4, &mut |xv| loss_ref(xv, &wf, &dy, dim, eps as f64));
        let gw: Vec<f64> = fd_grad(&w, 1e-4, &mut |wv| loss_ref(&xf, wv, &dy, dim, eps as f64))
            .into_iter()
            .map(|g| g + 1.0)
            .collect();
        assert_close("dx", &dx, &gx, 1e-4, 1e-4);
        assert_close("dw", &dw, &gw, 1e-4, 1e-4);
        // Only-weight backward gives the same weight gradient, bit for bit, with any budget.
        for _ in 0..3 {
            let mut dw2 = vec![1.0; dim];
            rmsnorm_backward(&dy, &x, &w, &rstd, dim, None, Some(&mut dw2)).unwrap();
            assert!(dw.iter().zip(&dw2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut y = vec![0.0; 6];
        let mut r = vec![0.0; 2];
        assert!(rmsnorm_forward(&[0.0; 6], &[1.0; 2], 3, 1e-5, &mut y, &mut r).is_err());
        assert!(rmsnorm_forward(&[0.0; 7], &[1.0; 3], 3, 1e-5, &mut y, &mut r).is_err());
        assert!(rmsnorm_forward(&[0.0; 6], &[1.0; 3], 3, 1e-5, &mut y, &mut r).is_ok());
    }
}
