//! TCP transport: one socket per pair of ranks, `TCP_NODELAY`, non-blocking after a handshake.
//!
//! Handshake (connector C, acceptor A), which proves the job token both ways before a byte of
//! a message flows ([`crate::auth`]):
//! 1. C → A: `b"XTRN" | version u8 | job_len u16 | job | key_len u16 | group key | from u32 |
//!    to u32 | nonce [32]`;
//! 2. A → C: `0 | nonce [32]`, or a refusal `1 | len u16 | reason` (foreign job id, another
//!    group's key, an unexpected rank);
//! 3. C → A: `proof [32]`: HMAC-SHA256 of the token over step 1's bytes and A's nonce;
//! 4. A → C: `0 | proof [32]` (A's own proof over the same), or a refusal.
//!
//! A refused connection is logged with its reason and the acceptor keeps waiting for the right
//! peers. Job ids and group keys longer than [`MAX_NAME`] bytes are refused before anything
//! is allocated for them.
//!
//! Messages are the same framed stream as shared memory; large payloads are streamed through
//! the socket in whatever pieces the kernel takes, and received into an aligned staging buffer.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::{LinkError, OutMsg, RecvReject};
use crate::auth::{nonce, JobToken, Role, NONCE_LEN, PROOF_LEN};
use crate::deadline_io::Deadlined;

const HS_MAGIC: &[u8; 4] = b"XTRN";
const HS_VERSION: u8 = 2;
/// Longest job id or group key a handshake may carry.
pub(crate) const MAX_NAME: usize = 1024;
const STAGE_BYTES: usize = 1 << 20;
const SOCK_BUF: libc::c_int = 4 << 20;

/// Identity a connector presents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub job: String,
    pub key: String,
    pub from: u32,
    pub to: u32,
}

impl Hello {
    fn encode(&self, nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.job.len() + self.key.len() + NONCE_LEN);
        b.extend_from_slice(HS_MAGIC);
        b.push(HS_VERSION);
        for s in [&self.job, &self.key] {
            b.extend_from_slice(&(s.len() as u16).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b.extend_from_slice(nonce);
        b
    }

    /// Reads a hello and its nonce; any byte stream gives one or an explanation, never a panic,
    /// and nothing larger than [`MAX_NAME`] is allocated.
    pub(crate) fn read(s: &mut impl Read) -> Result<(Hello, [u8; NONCE_LEN]), String> {
        let mut head = [0u8; 5];
        s.read_exact(&mut head)
            .map_err(|e| format!("reading handshake: {e}"))?;
        if &head[..4] != HS_MAGIC || head[4] != HS_VERSION {
            return Err(format!("not an xtrain handshake (first bytes {head:?})"));
        }
        let mut string = |what: &str| -> Result<String, String> {
            let mut l = [0u8; 2];
            s.read_exact(&mut l)
                .map_err(|e| format!("reading {what}: {e}"))?;
            let len = u16::from_le_bytes(l) as usize;
            if len > MAX_NAME {
                return Err(format!(
                    "{what} of {len} bytes is over the limit of {MAX_NAME}"
                ));
            }
            let mut v = vec![0u8; len];
            s.read_exact(&mut v)
                .map_err(|e| format!("reading {what}: {e}"))?;
            String::from_utf8(v).map_err(|_| format!("{what} is not UTF-8"))
        };
        let job = string("job id")?;
        let key = string("group key")?;
        let mut r = [0u8; 8 + NONCE_LEN];
        s.read_exact(&mut r)
            .map_err(|e| format!("reading ranks and nonce: {e}"))?;
        let hello = Hello {
            job,
            key,
            from: u32::from_le_bytes([r[0], r[1], r[2], r[3]]),
            to: u32::from_le_bytes([r[4], r[5], r[6], r[7]]),
        };
        Ok((hello, r[8..].try_into().expect("NONCE_LEN bytes")))
    }
}

/// `0 | payload` (go on) or `1 | len u16 | reason` (refused).
fn reply(s: &mut TcpStream, verdict: Result<&[u8], &str>) -> std::io::Result<()> {
    let b = match verdict {
        Ok(payload) => [&[0u8][..], payload].concat(),
        Err(reason) => {
            let r = &reason.as_bytes()[..reason.len().min(u16::MAX as usize)];
            [&[1u8][..], &(r.len() as u16).to_le_bytes(), r].concat()
        }
    };
    s.write_all(&b)
}

/// Reads a [`reply`]: its `N`-byte payload, or the peer's reason for refusing.
fn read_reply<const N: usize>(s: &mut TcpStream, addr: &str) -> Result<[u8; N], String> {
    let mut st = [0u8; 1];
    s.read_exact(&mut st)
        .map_err(|e| format!("reading handshake reply from {addr}: {e}"))?;
    if st[0] != 0 {
        let mut len = [0u8; 2];
        let _ = s.read_exact(&mut len);
        let mut reason = vec![0u8; u16::from_le_bytes(len) as usize];
        let _ = s.read_exact(&mut reason);
        return Err(format!(
            "{addr} refused: {}",
            String::from_utf8_lossy(&reason)
        ));
    }
    let mut payload = [0u8; N];
    s.read_exact(&mut payload)
        .map_err(|e| format!("reading handshake reply from {addr}: {e}"))?;
    Ok(payload)
}

fn configure(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a c_int value on our own socket; failure only loses speed.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &SOCK_BUF as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    Ok(())
}

/// Connects to `addr` (retrying until `deadline`, since the peer may not listen yet) and
/// performs the handshake, proving `token`. Returns the stream, or why it was refused.
pub(crate) fn connect(
    addr: &str,
    hello: &Hello,
    token: &JobToken,
    deadline: Instant,
) -> Result<TcpStream, String> {
    let sock: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "connecting to {addr}: {e} (gave up at the timeout)"
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream
        .set_read_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    configure(&stream).map_err(|e| e.to_string())?;
    let mine = nonce()?;
    let hello_bytes = hello.encode(&mine);
    stream
        .write_all(&hello_bytes)
        .map_err(|e| format!("sending handshake to {addr}: {e}"))?;
    let theirs: [u8; NONCE_LEN] = read_reply(&mut stream, addr)?;
    let transcript: [&[u8]; 2] = [&hello_bytes, &theirs];
    stream
        .write_all(&token.prove(Role::LinkConnector, &transcript))
        .map_err(|e| format!("sending the token proof to {addr}: {e}"))?;
    let proof: [u8; PROOF_LEN] = read_reply(&mut stream, addr)?;
    if !token.verify(Role::LinkAcceptor, &transcript, &proof) {
        return Err(format!(
            "{addr} did not prove this job's token (a process of another job on that port?)"
        ));
    }
    Ok(stream)
}

/// What an acceptor expects of its connectors: this job and group, its own rank, the token.
pub(crate) struct Expect<'a> {
    pub job: &'a str,
    pub key: &'a str,
    pub token: &'a JobToken,
    pub me: u32,
}

/// Accepts one connection per rank in `expected` (connectors of `at`'s job and group,
/// addressed to its rank, proving its token), refusing and logging any other. Returns streams
/// by sender rank.
pub(crate) fn accept_all(
    listener: &TcpListener,
    at: &Expect,
    expected: &[u32],
    deadline: Instant,
) -> Result<Vec<(u32, TcpStream)>, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut got: Vec<(u32, TcpStream)> = Vec::new();
    while got.len() < expected.len() {
        let (mut s, from_addr) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<u32> = expected
                        .iter()
                        .copied()
                        .filter(|r| !got.iter().any(|(g, _)| g == r))
                        .collect();
                    return Err(format!(
                        "timed out waiting for connections from ranks {missing:?}"
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            Err(e) => return Err(format!("accept: {e}")),
        };
        let _ = s.set_nonblocking(false);
        // A connector has at most 5 s (or what is left) for its whole handshake, so one that
        // trickles bytes cannot hold up the peers behind it.
        let left = deadline.saturating_duration_since(Instant::now());
        let own = Instant::now() + left.clamp(Duration::from_millis(10), Duration::from_secs(5));
        match admit(&mut s, own, at, expected, &got) {
            Ok(from) => {
                configure(&s).map_err(|e| e.to_string())?;
                got.push((from, s));
            }
            Err(reason) => {
                tracing::warn!(peer = %from_addr, "refused connection: {reason}");
                let _ = reply(&mut s, Err(&reason));
            }
        }
    }
    Ok(got)
}

/// Runs the acceptor's side of the handshake on `s`; returns the connector's rank, or why it
/// is refused.
fn admit(
    s: &mut TcpStream,
    until: Instant,
    at: &Expect,
    expected: &[u32],
    got: &[(u32, TcpStream)],
) -> Result<u32, String> {
    let (h, theirs) = Hello::read(&mut Deadlined {
        stream: s,
        deadline: Some(until),
    })?;
    if h.job != at.job {
        return Err(format!(
            "foreign job id {:?} (this job is {:?})",
            h.job, at.job
        ));
    }
    if h.key != at.key {
        return Err(format!(
            "connection for group {:?}, expected {:?}",
            h.key, at.key
        ));
    }
    if h.to != at.me {
        return Err(format!(
            "addressed to rank {}, this is rank {}",
            h.to, at.me
        ));
    }
    if !expected.contains(&h.from) || got.iter().any(|(g, _)| *g == h.from) {
        return Err(format!(
            "unexpected or duplicate connection from rank {}",
            h.from
        ));
    }
    let mine = nonce()?;
    reply(s, Ok(&mine)).map_err(|e| format!("answering rank {}: {e}", h.from))?;
    let mut proof = [0u8; PROOF_LEN];
    Deadlined {
        stream: s,
        deadline: Some(until),
    }
    .read_exact(&mut proof)
    .map_err(|e| format!("reading the token proof of rank {}: {e}", h.from))?;
    let hello_bytes = h.encode(&theirs);
    let transcript: [&[u8]; 2] = [&hello_bytes, &mine];
    if !at.token.verify(Role::LinkConnector, &transcript, &proof) {
        return Err(format!(
            "rank {} did not prove the job token (a process that knows the job id but not \
             XTRAIN_JOB_TOKEN)",
            h.from
        ));
    }
    reply(s, Ok(&at.token.prove(Role::LinkAcceptor, &transcript)))
        .map_err(|e| format!("answering rank {}: {e}", h.from))?;
    Ok(h.from)
}

/// A connected, non-blocking socket with an aligned receive staging buffer.
pub(crate) struct TcpLink {
    stream: TcpStream,
    /// `u64` backing keeps offered regions 8-byte aligned for typed reductions.
    stage: Vec<u64>,
    start: usize,
    end: usize,
    eof: bool,
}

impl TcpLink {
    pub fn new(stream: TcpStream) -> std::io::Result<Self> {
        stream.set_read_timeout(None)?;
        stream.set_nonblocking(true)?;
        Ok(TcpLink {
            stream,
            stage: vec![0u64; STAGE_BYTES / 8],
            start: 0,
            end: 0,
            eof: false,
        })
    }

    pub fn fd(&self) -> i32 {
        self.stream.as_raw_fd()
    }

    pub fn try_write(&mut self, msg: &mut OutMsg<'_>) -> Result<usize, LinkError> {
        let parts = msg.parts();
        let iov: Vec<libc::iovec> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        if iov.is_empty() {
            return Ok(0);
        }
        // SAFETY: msghdr zero-initialised then pointed at iovecs that outlive the call.
        let n = unsafe {
            let mut mh: libc::msghdr = std::mem::zeroed();
            mh.msg_iov = iov.as_ptr() as *mut libc::iovec;
            mh.msg_iovlen = iov.len() as _;
            libc::sendmsg(
                self.stream.as_raw_fd(),
                &mh,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(0),
                std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted => Err(LinkError::Closed),
                _ => Err(LinkError::Io(e)),
            };
        }
        msg.advance(n as usize);
        Ok(n as usize)
    }

    fn stage_bytes(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.stage)
    }

    pub fn try_read(
        &mut self,
        f: &mut dyn FnMut(&[u8]) -> Result<usize, RecvReject>,
    ) -> Result<usize, LinkError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == STAGE_BYTES || self.end - self.start < 8 {
            // Keep the unconsumed tail (always 8-aligned: consumption is in multiples of 8).
            let (s, e) = (self.start, self.end);
            self.stage_bytes().copy_within(s..e, 0);
            self.start = 0;
            self.end = e - s;
        }
        if !self.eof && self.end < STAGE_BYTES {
            let end = self.end;
            let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.stage)[end..];
            match (&self.stream).read(dst) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end += n,
                Err(e) => match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => {}
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted => {
                        self.eof = true
                    }
                    _ => return Err(LinkError::Io(e)),
                },
            }
        }
        let (s, e) = (self.start, self.end);
        let used = if e > s {
            let region = &bytemuck::cast_slice::<u64, u8>(&self.stage)[s..e];
            f(region).map_err(LinkError::Rejected)?
        } else {
            0
        };
        self.start += used;
        if used == 0 && self.eof {
            return Err(LinkError::Closed);
        }
        Ok(used)
    }

    pub fn close(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
