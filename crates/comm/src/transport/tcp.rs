//! TCP transport: one socket per pair of ranks, `TCP_NODELAY`, non-blocking after a handshake.
//!
//! Handshake (connector -> acceptor): `b"XTRN" | version u8 | job_len u16 | job | key_len u16 |
//! group key | from u32 | to u32`; the acceptor answers `status u8 (0 = accepted) | len u16 |
//! reason`. A connection with a foreign job id, another group's key or an unexpected rank is
//! refused with a logged reason and the acceptor keeps waiting for the right peers.
//!
//! Messages are the same framed stream as shared memory; large payloads are streamed through
//! the socket in whatever pieces the kernel takes, and received into an aligned staging buffer.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::{LinkError, OutMsg, RecvReject};

const HS_MAGIC: &[u8; 4] = b"XTRN";
const HS_VERSION: u8 = 1;
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
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.job.len() + self.key.len());
        b.extend_from_slice(HS_MAGIC);
        b.push(HS_VERSION);
        for s in [&self.job, &self.key] {
            b.extend_from_slice(&(s.len() as u16).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b
    }

    fn read(s: &mut TcpStream) -> Result<Hello, String> {
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
            let mut v = vec![0u8; u16::from_le_bytes(l) as usize];
            s.read_exact(&mut v)
                .map_err(|e| format!("reading {what}: {e}"))?;
            String::from_utf8(v).map_err(|_| format!("{what} is not UTF-8"))
        };
        let job = string("job id")?;
        let key = string("group key")?;
        let mut r = [0u8; 8];
        s.read_exact(&mut r)
            .map_err(|e| format!("reading ranks: {e}"))?;
        Ok(Hello {
            job,
            key,
            from: u32::from_le_bytes([r[0], r[1], r[2], r[3]]),
            to: u32::from_le_bytes([r[4], r[5], r[6], r[7]]),
        })
    }
}

fn reply(s: &mut TcpStream, reason: Option<&str>) -> std::io::Result<()> {
    let reason = reason.unwrap_or("");
    let mut b = vec![u8::from(!reason.is_empty())];
    b.extend_from_slice(&(reason.len().min(u16::MAX as usize) as u16).to_le_bytes());
    b.extend_from_slice(&reason.as_bytes()[..reason.len().min(u16::MAX as usize)]);
    s.write_all(&b)
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
/// performs the handshake. Returns the stream, or why it was refused.
pub(crate) fn connect(addr: &str, hello: &Hello, deadline: Instant) -> Result<TcpStream, String> {
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
    stream
        .write_all(&hello.encode())
        .map_err(|e| format!("sending handshake to {addr}: {e}"))?;
    let mut st = [0u8; 3];
    stream
        .read_exact(&mut st)
        .map_err(|e| format!("reading handshake reply from {addr}: {e}"))?;
    if st[0] != 0 {
        let mut reason = vec![0u8; u16::from_le_bytes([st[1], st[2]]) as usize];
        let _ = stream.read_exact(&mut reason);
        return Err(format!(
            "{addr} refused: {}",
            String::from_utf8_lossy(&reason)
        ));
    }
    Ok(stream)
}

/// Accepts one connection per rank in `expected` (connectors with job `job` and group `key`
/// addressed to rank `me`), refusing and logging any other. Returns streams by sender rank.
pub(crate) fn accept_all(
    listener: &TcpListener,
    job: &str,
    key: &str,
    me: u32,
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
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = s.set_read_timeout(Some(
            left.clamp(Duration::from_millis(10), Duration::from_secs(5)),
        ));
        let verdict = match Hello::read(&mut s) {
            Err(e) => Err(e),
            Ok(h) if h.job != job => {
                Err(format!("foreign job id {:?} (this job is {job:?})", h.job))
            }
            Ok(h) if h.key != key => Err(format!(
                "connection for group {:?}, expected {key:?}",
                h.key
            )),
            Ok(h) if h.to != me => Err(format!("addressed to rank {}, this is rank {me}", h.to)),
            Ok(h) if !expected.contains(&h.from) || got.iter().any(|(g, _)| *g == h.from) => Err(
                format!("unexpected or duplicate connection from rank {}", h.from),
            ),
            Ok(h) => Ok(h.from),
        };
        match verdict {
            Ok(from) => {
                configure(&s).map_err(|e| e.to_string())?;
                reply(&mut s, None).map_err(|e| format!("answering rank {from}: {e}"))?;
                got.push((from, s));
            }
            Err(reason) => {
                tracing::warn!(peer = %from_addr, "refused connection: {reason}");
                let _ = reply(&mut s, Some(&reason));
            }
        }
    }
    Ok(got)
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
