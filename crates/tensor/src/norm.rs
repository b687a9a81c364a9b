//! RMSNorm (Llama): `y = x · rstd · w`, `rstd = 1 / sqrt(mean(x²) + eps)` per row.
//!
//! Backward, with `x̂ = x·rstd` and `g = dy ∘ w`:
//! `dx = rstd · (g − x̂ · mean(g ∘ x̂))` and `dw += Σ_rows dy ∘ x̂`.

use crate::error::check_len;
use crate::microkernel::{dot, rms_apply, scaled_product_add};
use crate::threads::{self, new_written};
use crate::TensorError;
use rayon::prelude::*;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Forward over `rows = x.len() / dim` rows: `(y [rows, dim], rstd [rows])` as new vectors
/// (`rstd` is kept for backward). Outputs are written without a zero fill first.
pub fn rmsnorm_forward(
    x: &[f32],
    w: &[f32],
    dim: usize,
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>), TensorError> {
    let rows = rows_of(x.len(), dim)?;
    check_len("rmsnorm w", w.len(), dim)?;
    let task = dim * ROWS_PER_TASK;
    // SAFETY: each task writes all rows of its `y` chunk and their `rstd` (one per row).
    let [y, rstd] = unsafe {
        new_written([x.len(), rows], [task, ROWS_PER_TASK], |t, [y, rs]| {
            let x = &x[t * task..t * task + y.len()];
            for ((y, r), x) in y.chunks_mut(dim).zip(rs.iter_mut()).zip(x.chunks(dim)) {
                let ss = dot(x, x, None);
                let rstd = 1.0 / (ss / dim as f32 + eps).sqrt();
                r.write(rstd);
                rms_apply(x, x, w, rstd, 0.0, None, y);
            }
        })
    };
    Ok((y, rstd))
}

/// Input gradient as a new vector, `dx = rstd · (g − x̂ · mean(g ∘ x̂))`, or `residual + dx`
/// when a residual-stream gradient is given (one pass instead of a temporary and an add;
/// the same rounding).
pub fn rmsnorm_backward_input(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dim: usize,
    residual: Option<&[f32]>,
) -> Result<Vec<f32>, TensorError> {
    let rows = rows_of(x.len(), dim)?;
    check_len("rmsnorm dy", dy.len(), x.len())?;
    check_len("rmsnorm w", w.len(), dim)?;
    check_len("rmsnorm rstd", rstd.len(), rows)?;
    if let Some(res) = residual {
        check_len("rmsnorm residual", res.len(), x.len())?;
    }
    let task = dim * ROWS_PER_TASK;
    // SAFETY: each task writes every row of its chunk.
    let [dx] = unsafe {
        new_written([x.len()], [task], |t, [dx]| {
            let span = t * task..t * task + dx.len();
            let (dy, x) = (&dy[span.clone()], &x[span.clone()]);
            let rows = dx.chunks_mut(dim).zip(dy.chunks(dim)).zip(x.chunks(dim));
            for (i, ((dx, dy), x)) in rows.enumerate() {
                let r = rstd[t * ROWS_PER_TASK + i];
                let res = residual.map(|v| &v[span.start + i * dim..][..dim]);
                // mean(g ∘ x̂) with g = dy ∘ w, x̂ = x·r
                let c = dot(dy, w, Some(x)) * r * r / dim as f32;
                rms_apply(dy, x, w, r, c, res, dx);
            }
        })
    };
    Ok(dx)
}

/// Weight gradient, accumulated: `dw += Σ_rows dy ∘ x̂`. Input and weight gradients are
/// separate calls so that they can be scheduled separately.
pub fn rmsnorm_backward_weight(
    dy: &[f32],
    x: &[f32],
    rstd: &[f32],
    dim: usize,
    dw_accum: &mut [f32],
) -> Result<(), TensorError> {
    let rows = rows_of(x.len(), dim)?;
    check_len("rmsnorm dy", dy.len(), x.len())?;
    check_len("rmsnorm rstd", rstd.len(), rows)?;
    check_len("rmsnorm dw", dw_accum.len(), dim)?;
    // Fixed chunks summed in a fixed order: the result is bitwise reproducible, independent
    // of the thread count and of work stealing.
    let partials: Vec<Vec<f32>> = threads::install(|| {
        dy.par_chunks(dim * ROWS_PER_TASK)
            .zip(x.par_chunks(dim * ROWS_PER_TASK))
            .zip(rstd.par_chunks(ROWS_PER_TASK))
            .map(|((dy, x), rs)| {
                let mut acc = vec![0.0f32; dim];
                for ((dy, x), &r) in dy.chunks(dim).zip(x.chunks(dim)).zip(rs) {
                    scaled_product_add(&mut acc, dy, x, r);
                }
                acc
            })
            .collect()
    });
    let mut partial = vec![0.0f32; dim];
    for p in &partials {
        partial.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    dw_accum.iter_mut().zip(&partial).for_each(|(d, p)| *d += p);
    Ok(())
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
        let (y, rstd) = rmsnorm_forward(&x, &w, dim, eps).unwrap();
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            let want: Vec<f64> = (0..dim).map(|j| xr[j] as f64 * rs * w[j] as f64).collect();
            assert_close("y", &y[r * dim..(r + 1) * dim], &want, 1e-5, 1e-5);
        }
        let dx = rmsnorm_backward_input(&dy, &x, &w, &rstd, dim, None).unwrap();
        let mut dw = vec![1.0; dim]; // accumulate onto 1.0
        rmsnorm_backward_weight(&dy, &x, &rstd, dim, &mut dw).unwrap();
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
        // The weight gradient is the same, bit for bit, on every call (fixed summation order).
        for _ in 0..3 {
            let mut dw2 = vec![1.0; dim];
            rmsnorm_backward_weight(&dy, &x, &rstd, dim, &mut dw2).unwrap();
            assert!(dw.iter().zip(&dw2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        // With a residual: exactly `residual + dx` (one rounding, as a separate add).
        let res = rand_vec(rows * dim, 14);
        let fused = rmsnorm_backward_input(&dy, &x, &w, &rstd, dim, Some(&res)).unwrap();
        for ((f, r), d) in fused.iter().zip(&res).zip(&dx) {
            assert_eq!(f.to_bits(), (r + d).to_bits());
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(rmsnorm_forward(&[0.0; 6], &[1.0; 2], 3, 1e-5).is_err());
        assert!(rmsnorm_forward(&[0.0; 7], &[1.0; 3], 3, 1e-5).is_err());
        assert!(rmsnorm_forward(&[0.0; 6], &[1.0; 3], 3, 1e-5).is_ok());
        let (x, w, r) = ([0.5; 6], [1.0; 3], [1.0; 2]);
        assert!(rmsnorm_backward_input(&x, &x, &w, &r, 3, Some(&[0.0; 5])).is_err());
        assert!(rmsnorm_backward_input(&x, &x, &w, &r[..1], 3, None).is_err());
        assert!(rmsnorm_backward_weight(&x, &x, &r, 3, &mut [0.0; 2]).is_err());
    }
}
