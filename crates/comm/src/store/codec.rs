//! The store's wire format: frames, fields, and the decoding of a request (see [`super::tcp`]
//! for the protocol table). Every decoder here takes untrusted bytes: it bounds-checks each
//! read, and no allocation is sized by a length the peer declared beyond the limit in force.
use std::io::{Read, Write};
use std::time::Duration;

use super::StoreError;
use crate::auth::{NONCE_LEN, PROOF_LEN};

/// "XTST": first field of the hello frame, so connecting to the wrong service fails clearly.
pub(crate) const MAGIC: u32 = 0x5853_5454;
/// 2: the hello carries a nonce and an auth exchange follows.
pub(crate) const VERSION: u32 = 2;

pub(crate) const OP_HELLO: u8 = 0;
pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_WAIT: u8 = 3;
pub(crate) const OP_ADD: u8 = 4;
pub(crate) const OP_CAS: u8 = 5;
pub(crate) const OP_DELETE: u8 = 6;
pub(crate) const OP_AUTH: u8 = 7;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_TIMEOUT: u8 = 1;
pub(crate) const ST_ERROR: u8 = 2;

/// Bytes a frame body grows by per read: a peer that declares a large frame and sends little
/// costs no more than this.
const READ_CHUNK: usize = 64 << 10;

/// Builds a frame body field by field.
#[derive(Default)]
pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    pub fn bytes(self, v: &[u8]) -> Self {
        self.u32(v.len() as u32).raw(v)
    }
    pub fn opt_bytes(self, v: Option<&[u8]>) -> Self {
        match v {
            None => self.u8(0),
            Some(v) => self.u8(1).bytes(v),
        }
    }
}

/// Reads fields from a frame body; every read checks bounds and reports what was cut short.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], StoreError> {
        if self.buf.len() - self.pos < n {
            return Err(StoreError::Protocol(format!(
                "frame truncated reading {what}: need {n} byte(s), {} left",
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], StoreError> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returned N bytes"))
    }
    pub fn u8(&mut self, what: &str) -> Result<u8, StoreError> {
        Ok(self.take(1, what)?[0])
    }
    pub fn u32(&mut self, what: &str) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &str) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub fn i64(&mut self, what: &str) -> Result<i64, StoreError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }
    pub fn bytes(&mut self, what: &str) -> Result<&'a [u8], StoreError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub fn opt_bytes(&mut self, what: &str) -> Result<Option<&'a [u8]>, StoreError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes(what)?)),
            f => Err(StoreError::Protocol(format!(
                "bad option flag {f} in {what}"
            ))),
        }
    }
    pub fn key(&mut self) -> Result<&'a str, StoreError> {
        std::str::from_utf8(self.bytes("key")?)
            .map_err(|_| StoreError::Protocol("key is not UTF-8".into()))
    }
    pub fn keys(&mut self) -> Result<Vec<&'a str>, StoreError> {
        let n = self.u32("key count")? as usize;
        // Each key takes at least 4 bytes: reject absurd counts before allocating.
        if n > (self.buf.len() - self.pos) / 4 {
            return Err(StoreError::Protocol(format!(
                "key count {n} exceeds the frame"
            )));
        }
        (0..n).map(|_| self.key()).collect()
    }
    pub fn finish(&self) -> Result<(), StoreError> {
        if self.pos != self.buf.len() {
            return Err(StoreError::Protocol(format!(
                "{} unexpected trailing byte(s) in frame",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// One decoded request.
#[derive(Debug, PartialEq)]
pub(crate) enum Request<'a> {
    Hello {
        magic: u32,
        version: u32,
        nonce: [u8; NONCE_LEN],
    },
    Auth {
        proof: [u8; PROOF_LEN],
    },
    Set {
        key: &'a str,
        value: &'a [u8],
    },
    Get {
        key: &'a str,
        timeout: Duration,
    },
    Wait {
        keys: Vec<&'a str>,
        timeout: Duration,
    },
    Add {
        key: &'a str,
        delta: i64,
    },
    CompareSet {
        key: &'a str,
        expected: Option<&'a [u8]>,
        new: &'a [u8],
    },
    Delete {
        key: &'a str,
    },
}

impl<'a> Request<'a> {
    /// Decodes a request body; any byte string gives a request or an error, never a panic.
    pub fn decode(body: &'a [u8]) -> Result<Self, StoreError> {
        let mut r = Reader::new(body);
        let ms = |r: &mut Reader| r.u64("timeout").map(Duration::from_millis);
        let req = match r.u8("op")? {
            OP_HELLO => Request::Hello {
                magic: r.u32("magic")?,
                version: r.u32("version")?,
                nonce: r.array("nonce")?,
            },
            OP_AUTH => Request::Auth {
                proof: r.array("proof")?,
            },
            OP_SET => Request::Set {
                key: r.key()?,
                value: r.bytes("value")?,
            },
            OP_GET => Request::Get {
                key: r.key()?,
                timeout: ms(&mut r)?,
            },
            OP_WAIT => Request::Wait {
                keys: r.keys()?,
                timeout: ms(&mut r)?,
            },
            OP_ADD => Request::Add {
                key: r.key()?,
                delta: r.i64("delta")?,
            },
            OP_CAS => Request::CompareSet {
                key: r.key()?,
                expected: r.opt_bytes("expected")?,
                new: r.bytes("new")?,
            },
            OP_DELETE => Request::Delete { key: r.key()? },
            other => return Err(StoreError::Protocol(format!("unknown op {other}"))),
        };
        r.finish()?;
        Ok(req)
    }
}

pub(crate) fn write_frame(stream: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)
}

/// Why reading a frame failed: the peer left, the transport failed, or the frame is bad.
#[derive(Debug)]
pub(crate) enum FrameError {
    Closed,
    Io(std::io::Error),
    /// The declared body length exceeds the limit in force (nothing was allocated for it).
    TooLarge(usize),
}

fn frame_io(e: std::io::Error) -> FrameError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted => FrameError::Closed,
        _ => FrameError::Io(e),
    }
}

/// Reads one frame whose body may be at most `limit` bytes. The body buffer grows with the
/// bytes that actually arrive, so a declared length costs nothing until it is sent.
pub(crate) fn read_frame(stream: &mut impl Read, limit: usize) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(frame_io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > limit {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = Vec::with_capacity(len.min(READ_CHUNK));
    while body.len() < len {
        let want = (len - body.len()).min(READ_CHUNK);
        let got = stream
            .by_ref()
            .take(want as u64)
            .read_to_end(&mut body)
            .map_err(frame_io)?;
        if got == 0 {
            return Err(FrameError::Closed);
        }
    }
    Ok(body)
}

pub(crate) fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_a_declared_length_is_not_allocated_up_front() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        write_frame(&mut wire, b"").unwrap();
        let mut r = wire.as_slice();
        assert_eq!(read_frame(&mut r, 5).unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 5).unwrap(), b"");
        assert!(matches!(read_frame(&mut r, 5), Err(FrameError::Closed)));

        let mut big = Vec::new();
        write_frame(&mut big, &[7u8; 10]).unwrap();
        assert!(matches!(
            read_frame(&mut big.as_slice(), 9),
            Err(FrameError::TooLarge(10))
        ));
        // 60 MiB declared, 3 bytes sent, then the peer leaves: an error, not a 60 MiB buffer.
        let mut liar = (60u32 << 20).to_le_bytes().to_vec();
        liar.extend_from_slice(b"abc");
        assert!(matches!(
            read_frame(&mut liar.as_slice(), 64 << 20),
            Err(FrameError::Closed)
        ));
    }

    #[test]
    fn requests_decode_exactly() {
        let body = Writer::default()
            .u8(OP_CAS)
            .bytes(b"k")
            .opt_bytes(Some(b"a"))
            .bytes(b"b")
            .0;
        assert_eq!(
            Request::decode(&body).unwrap(),
            Request::CompareSet {
                key: "k",
                expected: Some(b"a"),
                new: b"b"
            }
        );
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(Request::decode(&trailing)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
        let wait = Writer::default().u8(OP_WAIT).u32(u32::MAX).0;
        assert!(Request::decode(&wait)
            .unwrap_err()
            .to_string()
            .contains("key count"));
    }
}
