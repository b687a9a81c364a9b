//! Error type of the `model` crate: every bad input (impossible config, malformed weights
//! file, wrong batch shape) becomes one of these variants instead of a panic.

use thiserror::Error;

/// Errors raised by configuration validation, weight loading/saving and model entry points.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The configuration describes a model that cannot exist.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A config file could not be parsed.
    #[error("cannot parse model config: {0}")]
    ConfigParse(String),
    /// A tensor the layout needs is absent from a weights file.
    #[error("weights file is missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor in a weights file has a different shape than the layout expects.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor in a weights file has a dtype we cannot read.
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDtype { name: String, dtype: String },
    /// The safetensors container itself is malformed.
    #[error("safetensors error: {0}")]
    Safetensors(String),
    /// A buffer passed in has the wrong length.
    #[error("buffer `{what}` has length {found}, expected {expected}")]
    BufferSize {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// A batch is inconsistent (length, token id out of range, ...).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A kernel rejected its input.
    #[error(transparent)]
    Tensor(#[from] tensor::TensorError),
    /// A collective inside a parallel layer failed (tensor / sequence parallel regions).
    #[error("collective in a parallel layer: {0}")]
    Collective(String),
    /// Filesystem error.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
