//! `tensor`: contiguous row-major tensors and the numerical kernels of xtrain
//! (matrix products, norms, RoPE, activations, attention, cross-entropy, embedding),
//! each with an explicit forward and backward.
//!
//! Conventions shared by every kernel:
//! - Data is `f32`, contiguous, row-major; shapes are passed explicitly next to plain slices,
//!   so the `comm` crate and this one only meet through slices.
//! - Backward functions *accumulate* (`+=`) into weight-gradient buffers, so gradient
//!   accumulation over micro-batches and separately scheduled input/weight gradients work.
//!   Each function's doc says which outputs are written and which are accumulated.
//! - Kernels that validate their input return [`TensorError`]; hot inner loops only
//!   `debug_assert!`.
//! - Parallel kernels run on the process-wide thread budget of [`threads`].

pub mod activation;
pub mod attention;
pub mod cross_entropy;
pub mod dtype;
pub mod embedding;
pub mod error;
pub mod gemm;
pub mod norm;
pub mod rope;
pub mod softmax;
pub mod tensor;
pub mod threads;

mod microkernel;
#[cfg(test)]
pub(crate) mod testutil;

pub use dtype::DType;
pub use error::TensorError;
pub use tensor::Tensor;
