//! The error type of every communication operation.
//!
//! Errors name what a person debugging a hung job needs: the operation, the group (listed by
//! world ranks) and the peer rank (a world rank) that failed to answer or sent something wrong.
use std::time::Duration;

use crate::store::StoreError;

/// Errors from communicators, groups and collectives.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A blocking wait ran past the configured timeout.
    /// `note` tells, when known, whom the awaited ranks were themselves waiting for.
    #[error(
        "{op} on group {group}: timed out after {timeout:?} waiting for rank(s) {ranks:?}{note}"
    )]
    Timeout {
        group: String,
        op: String,
        ranks: Vec<usize>,
        note: String,
        timeout: Duration,
    },
    /// Peers this rank waits on stopped answering: their heartbeat has not advanced for
    /// `limit` (`XTRAIN_HEARTBEAT_INTERVAL` × 3); `diagnosis` says where every rank stands.
    #[error(
        "{op} on group {group}: rank(s) {ranks:?} stopped (no heartbeat for over {limit:?}: the process is stopped, frozen or gone){diagnosis}"
    )]
    Stopped {
        group: String,
        op: String,
        ranks: Vec<usize>,
        limit: Duration,
        diagnosis: String,
    },
    /// A peer closed its side: its process/thread exited or dropped the group (`cause` empty),
    /// or it aborted after an error of its own (`cause` holds that error, which names the rank
    /// at the origin of the failure).
    #[error(
        "{op} on group {group}: rank {rank} closed its connection{}",
        closed_cause(cause)
    )]
    PeerClosed {
        group: String,
        op: String,
        rank: usize,
        cause: String,
    },
    /// Ranks called different operations, or the same one with different lengths/types/roots.
    #[error("{op} on group {group}: mismatch with rank {rank}: {detail}")]
    Mismatch {
        group: String,
        op: String,
        rank: usize,
        detail: String,
    },
    /// Bytes on the wire that are not a valid message.
    #[error("{op} on group {group}: malformed message from rank {rank}: {detail}")]
    Malformed {
        group: String,
        op: String,
        rank: usize,
        detail: String,
    },
    /// A call whose arguments cannot work (wrong buffer length, rank out of range, ...).
    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument { op: String, detail: String },
    /// A connection handshake was refused (wrong job id, unexpected rank, ...).
    #[error("connection refused: {0}")]
    Refused(String),
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// An asynchronous operation panicked on the group's worker (a bug); the group is aborted.
    #[error("asynchronous operation panicked: {0}")]
    Panicked(String),
    /// The group failed earlier; its links are closed and it cannot be used again.
    #[error("group {group} is unusable after an earlier error: {first}")]
    Poisoned { group: String, first: String },
}

fn closed_cause(cause: &str) -> String {
    if cause.is_empty() {
        " (it exited or dropped its communicator)".to_string()
    } else {
        format!(" after an error of its own: {cause}")
    }
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn invalid(op: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            op: op.into(),
            detail: detail.into(),
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
