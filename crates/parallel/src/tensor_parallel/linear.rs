//! Column- and row-parallel linear layers (`y = x·Wᵀ`, `W [out, in]`), each owning its
//! collective through the region operators of [`super::region`].
//!
//! - **Column parallel**: rank `r` holds rows `[r·out/tp, (r+1)·out/tp)` of `W` (a slice of the
//!   output features). Forward `y_r = f(x)·W_rᵀ` (`f` = identity, or all-gather under sp);
//!   backward `dx = f*(dy_r·W_r)` (all-reduce, or reduce-scatter), `dW_r = dy_rᵀ·f(x)` local.
//! - **Row parallel**: rank `r` holds columns `[r·in/tp, (r+1)·in/tp)` of `W` and the matching
//!   slice `x_r` of the input features. Forward `y = g(x_r·W_rᵀ)` (all-reduce of partial sums,
//!   or reduce-scatter); backward `dy' = g*(dy)`, `dx_r = dy'·W_r`, `dW_r = dy'ᵀ·x_r` local.
//!
//! A column layer followed by a row layer needs no communication in between: that is how the
//! attention (q/k/v then o) and the MLP (gate/up then down) regions are built.

use model::layers::block::RegionHooks;
use model::layers::{linear_backward_input, linear_forward_new};
use model::{Result, View};

use super::region::TpRegion;

/// Output-feature-split linear: `W_r [out/tp, in]`.
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    /// The local shard's view into the rank's parameter buffer.
    pub w: View,
    pub region: TpRegion,
}

/// Input-feature-split linear: `W_r [out, in/tp]`.
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    pub w: View,
    pub region: TpRegion,
}

/// What a parallel linear's backward needs: the (gathered) input of the local matmul.
#[derive(Debug, Clone)]
pub struct LinearCache {
    x: Vec<f32>,
}

/// What needs host buffers here: these layers are the region operators' reference on host
/// buffers (the model's blocks call the operators through their hooks on either device).
const TP: &str = "tensor parallelism";

/// `dW += dyᵀ·x` for `W [out, in]`.
fn weight_grad(w: &View, dy: &[f32], x: &[f32], g: &mut [f32]) -> Result<()> {
    let (dout, din) = (w.shape[0], w.shape[1]);
    let tokens = x.len() / din;
    tensor::gemm::matmul(w.of_mut(g), dy, x, dout, tokens, din, true, false, true)?;
    Ok(())
}

fn local_backward_input(p: &[f32], w: &View, dy: &[f32]) -> Result<Vec<f32>> {
    let mut dx = vec![0.0; dy.len() / w.shape[0] * w.shape[1]];
    linear_backward_input(p.into(), w, dy, (&mut dx).into(), false)?;
    Ok(dx)
}

impl ColumnParallelLinear {
    /// `x [tokens(, local under sp), in] -> y_r [tokens, out/tp]`.
    pub fn forward(&self, p: &[f32], x: Vec<f32>) -> Result<(Vec<f32>, LinearCache)> {
        let x = self.region.enter_forward(x.into())?.into_host(TP)?;
        let y = linear_forward_new(p.into(), &self.w, &x)?.into_host(TP)?;
        Ok((y, LinearCache { x }))
    }

    /// Returns `dx`; accumulates `dW_r` into `g`.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        cache: LinearCache,
        dy: &[f32],
    ) -> Result<Vec<f32>> {
        let dx = local_backward_input(p, &self.w, dy)?;
        weight_grad(&self.w, dy, &cache.x, g)?;
        Ok(self.region.enter_backward(dx.into())?.into_host(TP)?)
    }
}

impl RowParallelLinear {
    /// `x_r [tokens, in/tp] -> y [tokens(, local under sp), out]`.
    pub fn forward(&self, p: &[f32], x: Vec<f32>) -> Result<(Vec<f32>, LinearCache)> {
        let y = linear_forward_new(p.into(), &self.w, &x)?.into_host(TP)?;
        Ok((
            self.region.exit_forward(y.into())?.into_host(TP)?,
            LinearCache { x },
        ))
    }

    /// Returns `dx_r`; accumulates `dW_r` into `g`.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        cache: LinearCache,
        dy: Vec<f32>,
    ) -> Result<Vec<f32>> {
        let dy = self.region.exit_backward(dy.into())?.into_host(TP)?;
        let dx = local_backward_input(p, &self.w, &dy)?;
        weight_grad(&self.w, &dy, &cache.x, g)?;
        Ok(dx)
    }
}
