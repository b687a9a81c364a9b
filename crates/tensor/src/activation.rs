//! Elementwise activations: SiLU and SwiGLU (`silu(gate) ∘ up`, the Llama MLP).
//!
//! `silu(g) = g·σ(g)`, `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.

use crate::error::check_len;
use crate::microkernel::{silu_mul, silu_mul_grad};
use crate::threads::new_written;
use crate::TensorError;

/// Elements per parallel task.
const CHUNK: usize = 4096;

/// Chunk `t` of `x` (the inputs matching task `t`'s output chunk).
fn chunk(x: &[f32], t: usize) -> &[f32] {
    let start = t * CHUNK;
    &x[start..(start + CHUNK).min(x.len())]
}

/// `silu(x)` as a new vector. Like every kernel here, the output is written without a zero
/// fill first.
pub fn silu_forward(x: &[f32]) -> Vec<f32> {
    // SAFETY: `silu_mul` writes every element of its output chunk.
    let [out] = unsafe { new_written([x.len()], [CHUNK], |t, [o]| silu_mul(chunk(x, t), None, o)) };
    out
}

/// `dx = dout ∘ silu'(x)` as a new vector.
pub fn silu_backward(dout: &[f32], x: &[f32]) -> Result<Vec<f32>, TensorError> {
    check_len("silu dout", dout.len(), x.len())?;
    // SAFETY: `silu_mul_grad` writes every element of its output chunk.
    let [dx] = unsafe {
        new_written([x.len()], [CHUNK], |t, [dx]| {
            silu_mul_grad(chunk(dout, t), chunk(x, t), None, dx, None)
        })
    };
    Ok(dx)
}

/// `silu(gate) ∘ up` as a new vector.
pub fn swiglu_forward(gate: &[f32], up: &[f32]) -> Result<Vec<f32>, TensorError> {
    check_len("swiglu up", up.len(), gate.len())?;
    // SAFETY: `silu_mul` writes every element of its output chunk.
    let [out] = unsafe {
        new_written([gate.len()], [CHUNK], |t, [o]| {
            silu_mul(chunk(gate, t), Some(chunk(up, t)), o)
        })
    };
    Ok(out)
}

/// `(dgate, dup)` as new vectors: `dgate = dout ∘ up ∘ silu'(gate)`, `dup = dout ∘ silu(gate)`.
pub fn swiglu_backward(
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), TensorError> {
    let n = gate.len();
    check_len("swiglu dout", dout.len(), n)?;
    check_len("swiglu up", up.len(), n)?;
    // SAFETY: `silu_mul_grad` writes every element of both output chunks.
    let [dg, du] = unsafe {
        new_written([n, n], [CHUNK, CHUNK], |t, [dg, du]| {
            let (d, g, u) = (chunk(dout, t), chunk(gate, t), chunk(up, t));
            silu_mul_grad(d, g, Some(u), dg, Some(du))
        })
    };
    Ok((dg, du))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_grad, rand_vec};

    fn silu64(g: f64) -> f64 {
        g / (1.0 + (-g).exp())
    }

    #[test]
    fn swiglu_and_silu_match_finite_differences() {
        let n = 9000; // spans several parallel chunks, not a multiple of CHUNK
        let gate: Vec<f32> = rand_vec(n, 1).iter().map(|v| v * 6.0).collect();
        let up = rand_vec(n, 2);
        let dout = rand_vec(n, 3);
        let out = swiglu_forward(&gate, &up).unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| silu64(gate[i] as f64) * up[i] as f64)
            .collect();
        assert_close("swiglu", &out, &want, 1e-6, 1e-5);
        let (dg, du) = swiglu_backward(&dout, &gate, &up).unwrap();
        // The function is elementwise, so a check on a subset of elements is complete for
        // those elements; f64 central differences with h = 1e-5 (truncation ~1e-10).
        let idx: Vec<usize> = (0..n).step_by(97).collect();
        for &i in &idx {
            let g = fd_grad(&gate[i..i + 1], 1e-5, &mut |x| {
                silu64(x[0]) * up[i] as f64 * dout[i] as f64
            });
            let u = fd_grad(&up[i..i + 1], 1e-5, &mut |x| {
                silu64(gate[i] as f64) * x[0] * dout[i] as f64
            });
            assert_close("dgate", &dg[i..i + 1], &g, 1e-5, 1e-4);
            assert_close("dup", &du[i..i + 1], &u, 1e-5, 1e-4);
        }
        let s = silu_forward(&gate);
        let want: Vec<f64> = gate.iter().map(|&g| silu64(g as f64)).collect();
        assert_close("silu", &s, &want, 1e-6, 1e-5);
        let dx = silu_backward(&dout, &gate).unwrap();
        for &i in &idx {
            let g = fd_grad(&gate[i..i + 1], 1e-5, &mut |x| {
                silu64(x[0]) * dout[i] as f64
            });
            assert_close("dsilu", &dx[i..i + 1], &g, 1e-5, 1e-4);
        }
        assert!(swiglu_forward(&gate, &up[1..]).is_err());
        assert!(swiglu_backward(&dout[1..], &gate, &up).is_err());
        assert!(silu_backward(&dout, &gate[1..]).is_err());
    }
}
