//! Byte transports between two ranks: shared memory on one host, TCP between hosts.
//!
//! Both expose the same two non-blocking operations, so the progress engine can drive many
//! sends and receives at once without threads:
//! - `try_write` copies as much of an outgoing message as fits right now;
//! - `try_read` offers the bytes that have arrived (in place: for shared memory a slice of the
//!   ring itself, so the receiver reduces straight out of shared memory) and is told how many
//!   were consumed.
//!
//! Every write and every consumption is a multiple of 8 bytes (messages are padded), so offered
//! regions start 8-byte aligned and hold whole elements of any supported type.
pub mod cma;
pub(crate) mod shm;
pub(crate) mod tcp;

use crate::wire::HEADER_LEN;

/// Which transport to use between two ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Shared memory between ranks with the same host identity, TCP otherwise.
    #[default]
    Auto,
    /// Shared memory for every pair (all ranks must be on one host).
    Shm,
    /// TCP for every pair (also on one host, e.g. to test TCP).
    Tcp,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportKind::Auto),
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            other => Err(format!(
                "unknown transport {other:?} (expected shm, tcp or auto)"
            )),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
        })
    }
}

/// Why a link operation failed.
#[derive(Debug)]
pub(crate) enum LinkError {
    /// The peer closed its side and the operation needs more from it.
    Closed,
    /// The receive callback rejected the bytes (mismatch or malformed); carries its error.
    Rejected(RecvReject),
    Io(std::io::Error),
}

/// A receive callback's reason for rejecting bytes.
#[derive(Debug)]
pub(crate) enum RecvReject {
    Mismatch(String),
    Malformed(String),
}

static ZEROS: [u8; 8] = [0; 8];

/// An outgoing message: header, payload, zero padding to a multiple of 8, and how much of it
/// has been written.
pub(crate) struct OutMsg<'a> {
    hdr: [u8; HEADER_LEN],
    payload: &'a [u8],
    pos: usize,
    total: usize,
}

impl<'a> OutMsg<'a> {
    pub fn new(hdr: [u8; HEADER_LEN], payload: &'a [u8]) -> Self {
        let total = crate::wire::wire_len(payload.len());
        OutMsg {
            hdr,
            payload,
            pos: 0,
            total,
        }
    }

    pub fn remaining(&self) -> usize {
        self.total - self.pos
    }

    pub fn payload_len(&self) -> usize {
        self.payload.len()
    }

    /// The remaining parts (header rest, payload rest, padding rest); empty ones included.
    pub fn parts(&self) -> [&[u8]; 3] {
        let h = self.pos.min(HEADER_LEN);
        let p = (self.pos.max(HEADER_LEN) - HEADER_LEN).min(self.payload.len());
        let pad_total = self.total - HEADER_LEN - self.payload.len();
        let pad_done = self.pos.saturating_sub(HEADER_LEN + self.payload.len());
        [
            &self.hdr[h..],
            &self.payload[p..],
            &ZEROS[..pad_total - pad_done],
        ]
    }

    pub fn advance(&mut self, n: usize) {
        self.pos += n;
        debug_assert!(self.pos <= self.total);
    }
}

/// One end of a connection to a peer.
pub(crate) enum Link {
    Shm(shm::ShmLink),
    Tcp(tcp::TcpLink),
}

impl Link {
    pub fn try_write(&mut self, msg: &mut OutMsg<'_>) -> Result<usize, LinkError> {
        match self {
            Link::Shm(l) => l.try_write(msg),
            Link::Tcp(l) => l.try_write(msg),
        }
    }

    pub fn try_read(
        &mut self,
        f: &mut dyn FnMut(&[u8]) -> Result<usize, RecvReject>,
    ) -> Result<usize, LinkError> {
        match self {
            Link::Shm(l) => l.try_read(f),
            Link::Tcp(l) => l.try_read(f),
        }
    }

    /// False when the peer's process is known to be gone (shared memory only; a TCP peer's
    /// death closes the socket, which reads report by themselves).
    pub fn peer_alive(&self) -> bool {
        match self {
            Link::Shm(l) => l.peer_alive(),
            Link::Tcp(_) => true,
        }
    }

    /// Tells the peer this side is gone (it then fails instead of waiting for a timeout).
    pub fn close(&mut self) {
        match self {
            Link::Shm(l) => l.close(),
            Link::Tcp(l) => l.close(),
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close();
    }
}
