//! Each decoder of bytes from the network, run on a byte string: the entry points of the fuzz
//! tests (`tests/integration/decoders.rs`), which check that arbitrary input gives a value or an error,
//! never a panic, and that no decoder allocates by a length the input merely declares.
//! Not an API for anything else.
use crate::store::codec::{read_frame, Request};
use crate::store::tcp::decode_reply;
use crate::transport::tcp::Hello;
use crate::wire::{Header, HEADER_LEN};

/// Store requests as the server reads them: frames of at most `limit` bytes from `stream`,
/// each decoded, until the bytes run out or one is refused. Returns how many decoded.
pub fn store_requests(stream: &[u8], limit: usize) -> usize {
    let mut rest = stream;
    let mut n = 0;
    while let Ok(body) = read_frame(&mut rest, limit) {
        if Request::decode(&body).is_err() {
            break;
        }
        n += 1;
    }
    n
}

/// A store reply as a client decodes it.
pub fn store_reply(body: &[u8]) -> Result<Vec<u8>, String> {
    decode_reply(body, "fuzz").map_err(|e| e.to_string())
}

/// The hello a rank-to-rank TCP link starts with, as its acceptor reads it.
pub fn link_hello(stream: &[u8]) -> Result<(String, String, u32, u32), String> {
    let (h, _nonce) = Hello::read(&mut &stream[..])?;
    Ok((h.job, h.key, h.from, h.to))
}

/// A transport message header (shared memory and TCP), from the first 32 bytes.
pub fn message_header(bytes: &[u8]) -> Result<String, String> {
    let b: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("{} bytes, a header has {HEADER_LEN}", bytes.len()))?;
    Header::decode(b).map(|h| h.describe())
}
