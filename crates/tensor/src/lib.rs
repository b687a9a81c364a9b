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
//! - Results are bitwise reproducible run to run (fixed reduction orders).
//!
//! Map of the crate:
//! - [`isa`]: the kernel path of this process (AVX-512, AVX2 + FMA or portable), detected once,
//!   forced lower by `XTRAIN_ISA`; every hand-written kernel dispatches on it.
//! - [`gemm::matmul`]: `C (+)= op(A)·op(B)`, transposes by strides, on the own SGEMM
//!   ([`sgemm`]) with the micro-kernel of the kernel path (AVX-512, AVX2 + FMA, portable), rows
//!   independent of how many rows share a product; on request ([`gemm::matmul_using`]) the
//!   `gemm` crate or the fp32 product on AMX tiles from an exact bf16 split ([`sgemm::amx`]).
//! - [`skip`]: tests that cannot run here say so visibly, or fail where `XTRAIN_REQUIRE` says.
//! - [`buf`]: buffers on a device (host or GPU) and their views; [`ops`]: every kernel on
//!   either device (the CPU kernel on host buffers, its CUDA twin on GPU buffers);
//!   [`operands`]: a GPU product's operand format (fp32, bf16, fp16) and operands rounded
//!   once for several products.
//! - [`cuda`]: the same kernels on an NVIDIA GPU (driver, NVRTC and cuBLASLt opened at run
//!   time; CUDA C compiled for the GPU found), each tested against its CPU twin.
//! - [`norm`]: RMSNorm; [`rope::Rope`]: rotary embedding (HF rotate-half);
//!   [`activation`]: SiLU / SwiGLU; [`softmax`]: row softmax.
//! - [`attention`]: tiled online-softmax attention with GQA, causal offsets, log-sum-exp and
//!   [`attention::merge_partial`] for ring attention.
//! - [`cross_entropy`]: LM head + cross-entropy fused in row chunks, with vocab-shard pieces.
//! - [`embedding`]: lookup and scatter-add (full table or a vocabulary shard).
//! - [`rows`]: row gathers, scatter-adds and dot products (the mixture of experts' token moves).
//! - [`dtype`]: bf16 / f16 storage conversions; [`Tensor`]: small owned tensor.
//! - [`peak`]: the measured f32 FMA ceiling of this machine's cores, for utilisation figures.

pub mod activation;
pub mod attention;
pub mod buf;
pub mod cross_entropy;
pub mod cuda;
pub mod dtype;
pub mod embedding;
pub mod error;
pub mod gemm;
pub mod isa;
pub mod norm;
pub mod operands;
pub mod ops;
pub mod peak;
pub mod prepared;
pub mod rope;
pub mod rows;
pub mod sgemm;
pub mod skip;
pub mod softmax;
pub mod tensor;
pub mod threads;

mod microkernel;
#[cfg(test)]
pub(crate) mod testutil;

pub use dtype::DType;
pub use error::TensorError;
pub use isa::Isa;
pub use tensor::Tensor;
