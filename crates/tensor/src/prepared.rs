//! The kernels whose results only matrix products (or attention) read next, returning those
//! results prepared for them: what [`Kept::new`] (or [`ops::attention_operand`]) makes of the
//! plain kernel's output, made by the kernel itself.
//!
//! On a GPU in a bf16 or fp16 step a product reads a 16-bit copy of its fp32 operand, rounded
//! once ([`crate::operands`]). Rounding after the fact writes the fp32 result, reads it back
//! and writes the copy: 10 bytes an element and a launch. Here the kernel that computes the
//! value rounds it as it stores it (the `_bf16` / `_f16` twins of the CUDA kernels, the
//! `XtOut` stores of their prelude), 2 bytes an element: the same value through the same
//! rounding, so the same bits. (A product writing its result rounded — cuBLASLt's `D` in 16
//! bits — makes the same one rounding, of a sum cuBLASLt may order otherwise for a 16-bit `D`:
//! the same bits up to the last one.) Anywhere else (the CPU, fp32 steps, attention on the fp32
//! kernels) each function is the plain kernel followed by the preparation it replaces.
//!
//! Used by the model's layers for a normed input (the attention projections, a dense MLP), the
//! SwiGLU product and its two gradients, the rotated Q and K (for attention) or their
//! gradients (for the projections' backward), and V, which its projection writes rounded.

use crate::attention::AttnShape;
use crate::buf::{Buf, BufRef};
use crate::cuda::{ops as gpu, DevBuf};
use crate::operands::{Kept, Operand, Operands, Rounded};
use crate::ops;
use crate::rope::Rope;
use crate::TensorError;
use std::sync::Arc;

type Result<T> = std::result::Result<T, TensorError>;

/// The 16-bit format the kernel rounds its result to, where it does: the calling thread's
/// format when it is bf16 or fp16 ([`Kept::new`] rounds GPU values then, and only then).
fn rounding() -> Option<Operands> {
    match crate::operands::current() {
        Operands::F32 => None,
        f => Some(f),
    }
}

fn kept(bits: DevBuf<u16>, format: Operands) -> Kept {
    Kept::Rounded(Arc::new(Rounded::from_bits(bits, format)))
}

/// [`ops::rmsnorm_forward`] with `y` prepared for products: `(y, rstd)`.
pub fn rmsnorm_forward(x: BufRef<'_>, w: BufRef<'_>, dim: usize, eps: f32) -> Result<(Kept, Buf)> {
    match (x, w, rounding()) {
        (BufRef::Cuda(x), BufRef::Cuda(w), Some(f)) => {
            let (y, rstd) = gpu::rmsnorm_forward_rounded(x, w, dim, eps, f)?;
            Ok((kept(y, f), Buf::Cuda(rstd)))
        }
        (x, w, _) => {
            let (y, rstd) = ops::rmsnorm_forward(x, w, dim, eps)?;
            Ok((Kept::new(Arc::new(y))?, rstd))
        }
    }
}

/// [`ops::swiglu_forward`] prepared for products.
pub fn swiglu_forward(gate: BufRef<'_>, up: BufRef<'_>) -> Result<Kept> {
    match (gate, up, rounding()) {
        (BufRef::Cuda(g), BufRef::Cuda(u), Some(f)) => {
            Ok(kept(gpu::swiglu_forward_rounded(g, u, f)?, f))
        }
        (gate, up, _) => Kept::new(Arc::new(ops::swiglu_forward(gate, up)?)),
    }
}

/// [`ops::swiglu_backward`] with both gradients prepared for products.
pub fn swiglu_backward(dout: BufRef<'_>, gate: BufRef<'_>, up: BufRef<'_>) -> Result<(Kept, Kept)> {
    match (dout, gate, up, rounding()) {
        (BufRef::Cuda(d), BufRef::Cuda(g), BufRef::Cuda(u), Some(f)) => {
            let (dg, du) = gpu::swiglu_backward_rounded(d, g, u, f)?;
            Ok((kept(dg, f), kept(du, f)))
        }
        (dout, gate, up, _) => {
            let (dg, du) = ops::swiglu_backward(dout, gate, up)?;
            Ok((Kept::new(Arc::new(dg))?, Kept::new(Arc::new(du))?))
        }
    }
}

/// `x·Wᵀ` for `w [dout, din]` (the V projection) prepared for attention of shape `s` as
/// [`ops::attention_operand`] prepares it: where attention runs on the tensor cores, written
/// rounded by the product itself (cuBLASLt's `D` in the step's format — one rounding of the
/// fp32 accumulation, as the rounded copy of the fp32 product, up to the summation order of
/// the kernel cuBLASLt picks for a 16-bit `D`).
pub fn linear_for_attention(
    s: &AttnShape,
    x: Operand<'_>,
    w: BufRef<'_>,
    din: usize,
    dout: usize,
) -> Result<Kept> {
    let tokens = x.len() / din.max(1);
    match (&x, w, rounding()) {
        (x, BufRef::Cuda(wd), Some(f)) if ops::attention_runs_on_tensor_cores(s) => {
            let (a, b) = (ops::gpu_operand(x, f)?, gpu::Operand::new(wd, f)?);
            let y =
                gpu::matmul_new_rounded(wd.gpu(), f, &a, &b, [tokens, din, dout], [false, true])?;
            Ok(kept(y, f))
        }
        _ => ops::attention_operand(
            s,
            Arc::new(ops::matmul_new(x, w, tokens, din, dout, false, true)?),
        ),
    }
}

/// `x` (`[tokens, n_heads, head_dim]`) rotated by RoPE ([`ops::rope`]; `backward` rotates by
/// `−a`) and prepared for products: the rotated gradients of Q and K, which the projections'
/// backward reads.
pub fn rope(
    rope: &Rope,
    x: Buf,
    n_heads: usize,
    positions: &[usize],
    backward: bool,
) -> Result<Kept> {
    rotated(rope, x, n_heads, positions, backward, true)
}

/// `x` (Q or K of attention of shape `s`) rotated by RoPE and prepared for the attention kernels
/// as [`ops::attention_operand`] prepares it (rounded where attention runs on the tensor cores).
pub fn rope_for_attention(
    s: &AttnShape,
    rope: &Rope,
    x: Buf,
    n_heads: usize,
    positions: &[usize],
) -> Result<Kept> {
    let round = ops::attention_runs_on_tensor_cores(s);
    rotated(rope, x, n_heads, positions, false, round)
}

/// `x` rotated, then rounded (`round`: [`Kept::new`]'s rule) or kept as values.
fn rotated(
    r: &Rope,
    mut x: Buf,
    n_heads: usize,
    positions: &[usize],
    backward: bool,
    round: bool,
) -> Result<Kept> {
    match (&x, rounding().filter(|_| round)) {
        (Buf::Cuda(d), Some(f)) => {
            let table = gpu::RopeTable::cached(d.gpu(), r, positions, backward)?;
            Ok(kept(gpu::rope_rotate_rounded(d, n_heads, &table, f)?, f))
        }
        _ => {
            ops::rope(r, x.m(), n_heads, positions, backward)?;
            let x = Arc::new(x);
            if round {
                Kept::new(x)
            } else {
                Ok(Kept::Values(x))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operands::Scope;

    /// On the host every function is the plain kernel's values, in every step format (the
    /// GPU's rounding kernels are compared bit for bit with a rounded copy in `cuda_kernels`).
    #[test]
    fn on_the_host_each_is_the_plain_kernel() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..6).map(|i| 1.0 + i as f32 * 0.1).collect();
        let values = |k: &Kept| -> Vec<f32> {
            k.values()
                .expect("host values")
                .as_host("test")
                .unwrap()
                .to_vec()
        };
        for format in [Operands::F32, Operands::Bf16, Operands::F16] {
            let _s = Scope::enter(format);
            let (y, rstd) = rmsnorm_forward(BufRef::Host(&x), BufRef::Host(&w), 6, 1e-5).unwrap();
            let (y0, rstd0) = crate::norm::rmsnorm_forward(&x, &w, 6, 1e-5).unwrap();
            assert_eq!((values(&y), rstd.as_host("t").unwrap()), (y0, &rstd0[..]));

            let s = swiglu_forward(BufRef::Host(&x), BufRef::Host(&w.repeat(4))).unwrap();
            let s0 = crate::activation::swiglu_forward(&x, &w.repeat(4)).unwrap();
            assert_eq!(values(&s), s0);

            let (dg, du) = swiglu_backward(
                BufRef::Host(&w.repeat(4)),
                BufRef::Host(&x),
                BufRef::Host(&x),
            )
            .unwrap();
            let (dg0, du0) = crate::activation::swiglu_backward(&w.repeat(4), &x, &x).unwrap();
            assert_eq!((values(&dg), values(&du)), (dg0, du0));

            // 2 tokens × 3 heads × head size 4.
            let table = Rope::new(4, 10_000.0).unwrap();
            let pos = [3, 7];
            for backward in [false, true] {
                let r = rope(&table, Buf::Host(x.clone()), 3, &pos, backward).unwrap();
                let mut r0 = x.clone();
                if backward {
                    table.apply_backward(&mut r0, 3, &pos).unwrap();
                } else {
                    table.apply(&mut r0, 3, &pos).unwrap();
                }
                assert_eq!(values(&r), r0);
            }
        }
    }
}
