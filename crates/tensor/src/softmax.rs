//! Row-wise softmax: `y_j = exp(x_j − max x) / Σ_k exp(x_k − max x)`;
//! backward `dx = y ∘ (dy − Σ_j dy_j·y_j)`.

use crate::error::check_len;
use crate::microkernel::{dot, exp_sub_sum, row_max};
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// Softmax of each row of `x` (`[rows, cols]`) into `y`.
pub fn softmax_rows(x: &[f32], cols: usize, y: &mut [f32]) -> Result<(), TensorError> {
    check_rows(x.len(), cols)?;
    check_len("softmax y", y.len(), x.len())?;
    threads::install(|| {
        y.par_chunks_mut(cols)
            .zip(x.par_chunks(cols))
            .with_min_len(8)
            .for_each(|(y, x)| softmax_row(x, y));
    });
    Ok(())
}

/// Softmax of one row (the max is subtracted first so `exp` cannot overflow).
pub fn softmax_row(x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    let m = row_max(x);
    y.copy_from_slice(x);
    let inv = 1.0 / exp_sub_sum(y, 1.0, m);
    y.iter_mut().for_each(|v| *v *= inv);
}

/// Backward from the softmax output `y`: `dx = y ∘ (dy − rowsum(dy ∘ y))` (written).
pub fn softmax_rows_backward(
    dy: &[f32],
    y: &[f32],
    cols: usize,
    dx: &mut [f32],
) -> Result<(), TensorError> {
    check_rows(y.len(), cols)?;
    check_len("softmax dy", dy.len(), y.len())?;
    check_len("softmax dx", dx.len(), y.len())?;
    threads::install(|| {
        dx.par_chunks_mut(cols)
            .zip(y.par_chunks(cols))
            .zip(dy.par_chunks(cols))
            .with_min_len(8)
            .for_each(|((dx, y), dy)| {
                let dot = dot(dy, y, None);
                for ((dx, y), dy) in dx.iter_mut().zip(y).zip(dy) {
                    *dx = y * (dy - dot);
                }
            });
    });
    Ok(())
}

fn check_rows(len: usize, cols: usize) -> Result<(), TensorError> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(TensorError::Shape(format!(
            "length {len} is not a multiple of cols {cols}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_grad, rand_vec};

    fn loss_ref(x: &[f64], dy: &[f32], cols: usize) -> f64 {
        let mut l = 0.0;
        for (r, row) in x.chunks(cols).enumerate() {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
            for (j, v) in row.iter().enumerate() {
                l += dy[r * cols + j] as f64 * (v - m).exp() / s;
            }
        }
        l
    }

    #[test]
    fn softmax_matches_reference_and_finite_differences() {
        let (rows, cols) = (13, 11);
        let x: Vec<f32> = rand_vec(rows * cols, 5).iter().map(|v| v * 8.0).collect();
        let dy = rand_vec(rows * cols, 6);
        let mut y = vec![0.0; rows * cols];
        softmax_rows(&x, cols, &mut y).unwrap();
        for r in 0..rows {
            let s: f32 = y[r * cols..(r + 1) * cols].iter().sum();
            assert!((s - 1.0).abs() < 1e-6);
        }
        let mut dx = vec![0.0; rows * cols];
        softmax_rows_backward(&dy, &y, cols, &mut dx).unwrap();
        let g = fd_grad(&x, 1e-5, &mut |xv| loss_ref(xv, &dy, cols));
        assert_close("dx", &dx, &g, 1e-5, 1e-4);
        // Large inputs do not overflow.
        softmax_rows(&[1000.0, 1000.0], 2, &mut y[..2]).unwrap();
        assert_eq!(&y[..2], &[0.5, 0.5]);
        assert!(softmax_rows(&x, 0, &mut y).is_err());
    }
}
