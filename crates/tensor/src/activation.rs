//! Elementwise activations: SiLU and SwiGLU (`silu(gate) ∘ up`, the Llama MLP).
//!
//! `silu(g) = g·σ(g)`, `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.

use crate::error::check_len;
use crate::microkernel::{silu_mul, silu_mul_grad};
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 4096;

/// `out = silu(x)`.
pub fn silu_forward(x: &[f32], out: &mut [f32]) -> Result<(), TensorError> {
    check_len("silu out", out.len(), x.len())?;
    threads::install(|| {
        out.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| silu_mul(x, None, o));
    });
    Ok(())
}

/// `dx = dout ∘ silu'(x)` (written).
pub fn silu_backward(dout: &[f32], x: &[f32], dx: &mut [f32]) -> Result<(), TensorError> {
    check_len("silu dout", dout.len(), x.len())?;
    check_len("silu dx", dx.len(), x.len())?;
    threads::install(|| {
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .zip(dout.par_chunks(CHUNK))
            .for_each(|((dx, x), d)| silu_mul_grad(d, x, None, dx, None));
    });
    Ok(())
}

/// `out = silu(gate) ∘ up`.
pub fn swiglu_forward(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), TensorError> {
    check_len("swiglu up", up.len(), gate.len())?;
    check_len("swiglu out", out.len(), gate.len())?;
    threads::install(|| {
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK))
            .zip(up.par_chunks(CHUNK))
            .for_each(|((o, g), u)| silu_mul(g, Some(u), o));
    });
    Ok(())
}

/// `dgate = dout ∘ up ∘ silu'(gate)`, `dup = dout ∘ silu(gate)` (both written).
pub fn swiglu_backward(
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> Result<(), TensorError> {
    let n = gate.len();
    check_len("swiglu dout", dout.len(), n)?;
    check_len("swiglu up", up.len(), n)?;
    check_len("swiglu dgate", dgate.len(), n)?;
    check_len("swiglu dup", dup.len(), n)?;
    threads::install(|| {
        dgate
            .par_chunks_mut(CHUNK)
            .zip(dup.par_chunks_mut(CHUNK))
            .zip(gate.par_chunks(CHUNK))
            .zip(up.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK)))
            .for_each(|(((dg, du), g), (u, d))| silu_mul_grad(d, g, Some(u), dg, Some(du)));
    });
    Ok(())
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
        let mut out = vec![0.0; n];
        swiglu_forward(&gate, &up, &mut out).unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| silu64(gate[i] as f64) * up[i] as f64)
            .collect();
        assert_close("swiglu", &out, &want, 1e-6, 1e-5);
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu_backward(&dout, &gate, &up, &mut dg, &mut du).unwrap();
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
        let mut s = vec![0.0; n];
        silu_forward(&gate, &mut s).unwrap();
        let want: Vec<f64> = gate.iter().map(|&g| silu64(g as f64)).collect();
        assert_close("silu", &s, &want, 1e-6, 1e-5);
        let mut dx = vec![0.0; n];
        silu_backward(&dout, &gate, &mut dx).unwrap();
        for &i in &idx {
            let g = fd_grad(&gate[i..i + 1], 1e-5, &mut |x| {
                silu64(x[0]) * dout[i] as f64
            });
            assert_close("dsilu", &dx[i..i + 1], &g, 1e-5, 1e-4);
        }
        assert!(swiglu_forward(&gate, &up[1..], &mut out).is_err());
    }
}
