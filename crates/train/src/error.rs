//! The error type of the `train` crate: every failure a user can cause (bad config, bad data,
//! corrupt checkpoint) is a variant with a message naming the culprit, never a panic.
use std::path::PathBuf;

/// Errors from configuration, data, checkpoints and the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("config: {0}")]
    Config(String),
    #[error("config: unknown key `{0}`")]
    UnknownKey(String),
    #[error("data: {0}")]
    Data(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("token file {path}: {msg}")]
    TokenFile { path: PathBuf, msg: String },
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    #[error("model: {0}")]
    Model(String),
    /// A failure of the parallel layer (communication, schedule, a peer that failed).
    #[error("{0}")]
    Parallel(String),
    #[error("training diverged: {0}")]
    Diverged(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

impl From<parallel::checkpoint::CheckpointError> for TrainError {
    fn from(e: parallel::checkpoint::CheckpointError) -> Self {
        TrainError::Checkpoint {
            path: e.path,
            msg: e.msg,
        }
    }
}

impl From<comm::CommError> for TrainError {
    fn from(e: comm::CommError) -> Self {
        TrainError::Parallel(e.to_string())
    }
}

/// Shorthand result.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// Attaches a context string (usually a path) to I/O errors.
pub trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| TrainError::Io {
            context: context(),
            source,
        })
    }
}
