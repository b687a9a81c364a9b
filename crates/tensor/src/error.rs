//! The error type of the tensor crate: every input check a kernel performs reports here.

use thiserror::Error;

/// Errors reported by tensor kernels when their inputs are inconsistent.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum TensorError {
    /// A buffer does not have the length its declared shape implies.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A shape parameter is invalid (zero where not allowed, not divisible, ...).
    #[error("invalid shape: {0}")]
    Shape(String),
    /// A token id is outside the vocabulary.
    #[error("token id {id} at position {pos} is out of range for vocabulary size {vocab}")]
    IdOutOfRange { id: i64, pos: usize, vocab: usize },
    /// A byte buffer cannot be decoded as the requested dtype.
    #[error("cannot decode {len} bytes as {dtype:?} with shape {shape:?}")]
    Bytes {
        len: usize,
        dtype: crate::DType,
        shape: Vec<usize>,
    },
    /// The thread budget could not be applied.
    #[error("thread budget: {0}")]
    Threads(String),
    /// A setting from the environment is invalid or cannot apply on this machine.
    #[error("{0}")]
    Config(String),
    /// The GPU (or the CUDA libraries) failed or is missing (`crate::cuda::CudaError`).
    #[error("{0}")]
    Device(String),
}

/// Checks that `buf_len == expected`, naming the buffer in the error.
pub(crate) fn check_len(
    what: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), TensorError> {
    if got == expected {
        Ok(())
    } else {
        Err(TensorError::Length {
            what,
            expected,
            got,
        })
    }
}
