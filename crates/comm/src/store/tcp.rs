//! TCP rendezvous store: a server (hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`) holding
//! a [`MemStore`], and a client implementing [`Store`] over one TCP connection.
//!
//! ## Wire protocol
//! Every message is a frame: a little-endian `u32` body length, then the body.
//! Bodies are built from three field kinds: `u8`/`u32`/`u64`/`i64` (little-endian),
//! `bytes` (`u32` length + data) and `opt bytes` (`u8` 0/1 + bytes when 1).
//!
//! | request (`u8` op first) | fields | ok-reply payload |
//! | --- | --- | --- |
//! | 0 hello | magic `u32`, version `u32` | — |
//! | 1 set | key, value | — |
//! | 2 get | key, timeout ms `u64` | value |
//! | 3 wait | key count `u32`, keys…, timeout ms `u64` | — |
//! | 4 add | key, delta `i64` | new value `i64` |
//! | 5 compare-set | key, opt expected, new | value after |
//! | 6 delete | key | existed `u8` |
//!
//! A reply starts with a status `u8`: 0 ok (+ payload), 1 timeout (key count, keys,
//! timeout ms), 2 error (message). A malformed or oversized frame gets an error reply
//! and the connection is closed; the server itself never panics on input and keeps
//! serving other clients. Blocking waits run in the server (one thread per client), so
//! a `get` costs one round trip however long it waits.
use super::{MemStore, Store, StoreError};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// "XTST": first field of the hello frame, so connecting to the wrong service fails clearly.
const MAGIC: u32 = 0x5853_5454;
const VERSION: u32 = 1;
/// Largest frame body accepted (a value is bootstrap metadata: addresses, ids, small blobs).
pub const MAX_FRAME: usize = 64 << 20;
/// Extra time a client allows the server beyond a request's own timeout before
/// declaring it unresponsive.
const SERVER_SLACK: Duration = Duration::from_secs(30);

const OP_HELLO: u8 = 0;
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const OP_CAS: u8 = 5;
const OP_DELETE: u8 = 6;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

// ---------------------------------------------------------------- encoding

/// Builds a frame body field by field.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, v: &[u8]) -> Self {
        let mut w = self.u32(v.len() as u32);
        w.0.extend_from_slice(v);
        w
    }
    fn opt_bytes(self, v: Option<&[u8]>) -> Self {
        match v {
            None => self.u8(0),
            Some(v) => self.u8(1).bytes(v),
        }
    }
}

/// Reads fields from a frame body; every read checks bounds and reports what was cut short.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], StoreError> {
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
    fn u8(&mut self, what: &str) -> Result<u8, StoreError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn i64(&mut self, what: &str) -> Result<i64, StoreError> {
        Ok(i64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn bytes(&mut self, what: &str) -> Result<&'a [u8], StoreError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    fn opt_bytes(&mut self, what: &str) -> Result<Option<&'a [u8]>, StoreError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes(what)?)),
            f => Err(StoreError::Protocol(format!(
                "bad option flag {f} in {what}"
            ))),
        }
    }
    fn key(&mut self) -> Result<&'a str, StoreError> {
        std::str::from_utf8(self.bytes("key")?)
            .map_err(|_| StoreError::Protocol("key is not UTF-8".into()))
    }
    fn keys(&mut self) -> Result<Vec<&'a str>, StoreError> {
        let n = self.u32("key count")? as usize;
        // Each key takes at least 4 bytes: reject absurd counts before allocating.
        if n > (self.buf.len() - self.pos) / 4 {
            return Err(StoreError::Protocol(format!(
                "key count {n} exceeds the frame"
            )));
        }
        (0..n).map(|_| self.key()).collect()
    }
    fn finish(&self) -> Result<(), StoreError> {
        if self.pos != self.buf.len() {
            return Err(StoreError::Protocol(format!(
                "{} unexpected trailing byte(s) in frame",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

fn write_frame(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)
}

/// Why reading a frame failed: the peer left, the transport failed, or the frame is bad.
enum FrameError {
    Closed,
    Io(std::io::Error),
    TooLarge(usize),
}

fn read_frame(stream: &mut TcpStream) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    if let Err(e) = stream.read_exact(&mut len) {
        return Err(match e.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                FrameError::Closed
            }
            _ => FrameError::Io(e),
        });
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
            FrameError::Closed
        }
        _ => FrameError::Io(e),
    })?;
    Ok(body)
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

// ---------------------------------------------------------------- server

/// The store server: accepts clients on a TCP port and serves them from one [`MemStore`].
/// Dropping it stops accepting and closes every client connection.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    clients: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`Self::local_addr`]) and starts serving.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(&addr)
            .map_err(|e| StoreError::Io(format!("cannot host the store at {addr:?}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| StoreError::Io(format!("store listener address: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let clients = Arc::new(Mutex::new(Vec::new()));
        let state = Arc::new(MemStore::new());
        let accept = {
            let (stop, clients) = (Arc::clone(&stop), Arc::clone(&clients));
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(listener, state, stop, clients))
                .map_err(|e| StoreError::Io(format!("cannot start the store thread: {e}")))?
        };
        Ok(Self {
            addr: local,
            stop,
            clients,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a throwaway connection to ourselves.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip([127, 0, 0, 1].into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for c in self
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    state: Arc<MemStore>,
    stop: Arc<AtomicBool>,
    clients: Arc<Mutex<Vec<TcpStream>>>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        let _ = stream.set_nodelay(true);
        if let Ok(clone) = stream.try_clone() {
            clients
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(clone);
        }
        let state = Arc::clone(&state);
        let _ = std::thread::Builder::new()
            .name("store-client".into())
            .spawn(move || serve_client(stream, &state));
    }
}

/// Serves one client until it disconnects or sends something malformed.
fn serve_client(mut stream: TcpStream, state: &MemStore) {
    let mut greeted = false;
    loop {
        let body = match read_frame(&mut stream) {
            Ok(b) => b,
            Err(FrameError::TooLarge(n)) => {
                let msg = format!("frame of {n} bytes exceeds the limit of {MAX_FRAME}");
                let _ = write_frame(
                    &mut stream,
                    &Writer::default().u8(ST_ERROR).bytes(msg.as_bytes()).0,
                );
                return;
            }
            Err(_) => return,
        };
        let reply = match handle(&body, state, &mut greeted) {
            Ok(payload) => {
                let mut r = vec![ST_OK];
                r.extend_from_slice(&payload);
                r
            }
            Err(StoreError::Timeout { keys, timeout }) => {
                let mut w = Writer::default().u8(ST_TIMEOUT).u32(keys.len() as u32);
                for k in &keys {
                    w = w.bytes(k.as_bytes());
                }
                w.u64(millis(timeout)).0
            }
            Err(e) => {
                let fatal = matches!(e, StoreError::Protocol(_));
                let msg = e.to_string();
                let _ = write_frame(
                    &mut stream,
                    &Writer::default().u8(ST_ERROR).bytes(msg.as_bytes()).0,
                );
                if fatal {
                    // The stream may be out of step with the framing: drop the client.
                    return;
                }
                continue;
            }
        };
        if write_frame(&mut stream, &reply).is_err() {
            return;
        }
    }
}

/// Decodes one request, applies it to the store and encodes the ok-payload.
fn handle(body: &[u8], state: &MemStore, greeted: &mut bool) -> Result<Vec<u8>, StoreError> {
    let mut r = Reader::new(body);
    let op = r.u8("op")?;
    if !*greeted && op != OP_HELLO {
        return Err(StoreError::Protocol(
            "first message is not a store hello".into(),
        ));
    }
    let out = match op {
        OP_HELLO => {
            let (magic, version) = (r.u32("magic")?, r.u32("version")?);
            r.finish()?;
            if magic != MAGIC || version != VERSION {
                return Err(StoreError::Protocol(format!(
                    "bad hello (magic {magic:#x}, version {version}; expected {MAGIC:#x}, {VERSION})"
                )));
            }
            *greeted = true;
            Writer::default()
        }
        OP_SET => {
            let (key, value) = (r.key()?, r.bytes("value")?);
            r.finish()?;
            state.set(key, value)?;
            Writer::default()
        }
        OP_GET => {
            let (key, ms) = (r.key()?, r.u64("timeout")?);
            r.finish()?;
            Writer::default().bytes(&state.get(key, Duration::from_millis(ms))?)
        }
        OP_WAIT => {
            let (keys, ms) = (r.keys()?, r.u64("timeout")?);
            r.finish()?;
            state.wait(&keys, Duration::from_millis(ms))?;
            Writer::default()
        }
        OP_ADD => {
            let (key, delta) = (r.key()?, r.i64("delta")?);
            r.finish()?;
            Writer::default().i64(state.add(key, delta)?)
        }
        OP_CAS => {
            let (key, expected, new) = (r.key()?, r.opt_bytes("expected")?, r.bytes("new")?);
            r.finish()?;
            Writer::default().bytes(&state.compare_set(key, expected, new)?)
        }
        OP_DELETE => {
            let key = r.key()?;
            r.finish()?;
            Writer::default().u8(state.delete(key)? as u8)
        }
        other => return Err(StoreError::Protocol(format!("unknown op {other}"))),
    };
    Ok(out.0)
}

// ---------------------------------------------------------------- client

/// A [`Store`] client over TCP; optionally also hosts the server (rank 0).
///
/// Requests from several threads sharing one client are serialised on its single
/// connection (a long `wait` delays the others); give each thread its own client
/// if that matters.
pub struct TcpStore {
    conn: Mutex<Option<TcpStream>>,
    addr: String,
    /// Read timeout for requests that do not wait (set, add, …).
    op_timeout: Duration,
    // Declared last: dropped after the client connection above.
    server: Option<TcpStoreServer>,
}

impl TcpStore {
    /// Connects to the store at `addr` ("host:port"), retrying until `timeout` so that
    /// ranks may start before rank 0 has bound the port.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, StoreError> {
        // Saturate: a timeout of Duration::MAX means "keep trying".
        let far = Duration::from_secs(u32::MAX as u64);
        let deadline = Instant::now() + timeout.min(far);
        let mut backoff = Duration::from_millis(10);
        let mut stream = loop {
            let last = match try_connect(addr, deadline) {
                Ok(s) => break s,
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Io(format!(
                    "could not connect to the store at {addr} within {timeout:?} \
                     (is rank 0 running and MASTER_ADDR/MASTER_PORT right?): {last}"
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        let _ = stream.set_nodelay(true);
        let op_timeout = timeout
            .max(Duration::from_secs(1))
            .saturating_add(SERVER_SLACK);
        let hello = Writer::default().u8(OP_HELLO).u32(MAGIC).u32(VERSION).0;
        roundtrip(&mut stream, addr, &hello, op_timeout)?;
        Ok(Self {
            conn: Mutex::new(Some(stream)),
            addr: addr.to_string(),
            op_timeout,
            server: None,
        })
    }

    /// Hosts the server on `0.0.0.0:port` (all interfaces, so other hosts can reach it)
    /// and connects to it: what rank 0 does. Port 0 picks a free port.
    pub fn host(port: u16, timeout: Duration) -> Result<Self, StoreError> {
        let server = TcpStoreServer::bind(("0.0.0.0", port))?;
        let addr = format!("127.0.0.1:{}", server.local_addr().port());
        let mut store = Self::connect(&addr, timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Rank 0 (`is_host`) hosts the store on `port`; every rank connects to `host:port`.
    pub fn rendezvous(
        host: &str,
        port: u16,
        is_host: bool,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        if is_host {
            Self::host(port, timeout)
        } else {
            Self::connect(&format!("{host}:{port}"), timeout)
        }
    }

    /// The server this client hosts, if it is rank 0's.
    pub fn server(&self) -> Option<&TcpStoreServer> {
        self.server.as_ref()
    }

    /// Sends one request and returns the ok-payload; `wait` is how long the server may block.
    fn call(&self, body: &[u8], wait: Duration) -> Result<Vec<u8>, StoreError> {
        let mut guard = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stream) = guard.as_mut() else {
            return Err(StoreError::Io(format!(
                "connection to the store at {} was lost by an earlier error",
                self.addr
            )));
        };
        let result = roundtrip(
            stream,
            &self.addr,
            body,
            self.op_timeout.saturating_add(wait),
        );
        if matches!(
            result,
            Err(StoreError::Io(_)) | Err(StoreError::Protocol(_))
        ) {
            // The stream may be mid-frame: never reuse it.
            *guard = None;
        }
        result
    }
}

fn try_connect(addr: &str, deadline: Instant) -> Result<TcpStream, String> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{addr} resolved to no address");
    for a in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(50));
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// Writes a request frame and reads the reply, mapping the reply status to a result.
fn roundtrip(
    stream: &mut TcpStream,
    addr: &str,
    body: &[u8],
    read_timeout: Duration,
) -> Result<Vec<u8>, StoreError> {
    if body.len() > MAX_FRAME {
        return Err(StoreError::Io(format!(
            "store request of {} bytes exceeds the limit of {MAX_FRAME}",
            body.len()
        )));
    }
    let gone = || {
        StoreError::Io(format!(
            "the store server at {addr} closed the connection (did rank 0 exit?)"
        ))
    };
    write_frame(stream, body).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => gone(),
        _ => StoreError::Io(format!("sending to the store at {addr}: {e}")),
    })?;
    let _ = stream.set_read_timeout(Some(read_timeout));
    let reply = read_frame(stream).map_err(|e| match e {
        FrameError::Closed => gone(),
        FrameError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            StoreError::Io(format!(
                "the store server at {addr} did not answer within {read_timeout:?}"
            ))
        }
        FrameError::Io(e) => StoreError::Io(format!("reading from the store at {addr}: {e}")),
        FrameError::TooLarge(n) => {
            StoreError::Protocol(format!("reply of {n} bytes from {addr} exceeds the limit"))
        }
    })?;
    let mut r = Reader::new(&reply);
    match r.u8("reply status")? {
        ST_OK => Ok(reply[1..].to_vec()),
        ST_TIMEOUT => {
            let keys = r.keys()?.into_iter().map(str::to_string).collect();
            let timeout = Duration::from_millis(r.u64("timeout")?);
            r.finish()?;
            Err(StoreError::Timeout { keys, timeout })
        }
        ST_ERROR => {
            let msg = String::from_utf8_lossy(r.bytes("error message")?).into_owned();
            Err(StoreError::Rejected(format!(
                "by the store server at {addr}: {msg}"
            )))
        }
        s => Err(StoreError::Protocol(format!(
            "unknown reply status {s} from {addr}"
        ))),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let body = Writer::default()
            .u8(OP_SET)
            .bytes(key.as_bytes())
            .bytes(value)
            .0;
        let reply = self.call(&body, Duration::ZERO)?;
        Reader::new(&reply).finish()
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let body = Writer::default()
            .u8(OP_GET)
            .bytes(key.as_bytes())
            .u64(millis(timeout))
            .0;
        let reply = self.call(&body, timeout)?;
        let mut r = Reader::new(&reply);
        let value = r.bytes("value")?.to_vec();
        r.finish()?;
        Ok(value)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let mut w = Writer::default().u8(OP_WAIT).u32(keys.len() as u32);
        for k in keys {
            w = w.bytes(k.as_bytes());
        }
        let reply = self.call(&w.u64(millis(timeout)).0, timeout)?;
        Reader::new(&reply).finish()
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let body = Writer::default()
            .u8(OP_ADD)
            .bytes(key.as_bytes())
            .i64(delta)
            .0;
        let reply = self.call(&body, Duration::ZERO)?;
        let mut r = Reader::new(&reply);
        let v = r.i64("counter")?;
        r.finish()?;
        Ok(v)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let body = Writer::default()
            .u8(OP_CAS)
            .bytes(key.as_bytes())
            .opt_bytes(expected)
            .bytes(new)
            .0;
        let reply = self.call(&body, Duration::ZERO)?;
        let mut r = Reader::new(&reply);
        let v = r.bytes("value")?.to_vec();
        r.finish()?;
        Ok(v)
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let body = Writer::default().u8(OP_DELETE).bytes(key.as_bytes()).0;
        let reply = self.call(&body, Duration::ZERO)?;
        let mut r = Reader::new(&reply);
        let existed = r.u8("existed")? != 0;
        r.finish()?;
        Ok(existed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    const T: Duration = Duration::from_secs(5);

    fn server() -> (TcpStoreServer, String) {
        let s = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().to_string();
        (s, addr)
    }

    #[test]
    fn every_op_over_tcp() {
        let (_server, addr) = server();
        let a = TcpStore::connect(&addr, T).unwrap();
        let b = TcpStore::connect(&addr, T).unwrap();
        a.set("addr/0", b"10.0.0.1:5000").unwrap();
        assert_eq!(b.get("addr/0", T).unwrap(), b"10.0.0.1:5000");
        b.wait(&["addr/0"], T).unwrap();
        assert_eq!(a.add("n", 3).unwrap(), 3);
        assert_eq!(b.add("n", -1).unwrap(), 2);
        assert_eq!(a.get("n", T).unwrap(), b"2");
        assert_eq!(a.compare_set("k", None, b"x").unwrap(), b"x");
        assert_eq!(b.compare_set("k", Some(b"y"), b"z").unwrap(), b"x");
        assert_eq!(b.compare_set("k", Some(b"x"), b"z").unwrap(), b"z");
        assert!(a.delete("k").unwrap());
        assert!(!b.delete("k").unwrap());
        // Empty values and binary data survive the framing.
        assert_eq!(b.get("addr/0", Duration::MAX).unwrap(), b"10.0.0.1:5000");
        a.set("empty", b"").unwrap();
        assert_eq!(b.get("empty", T).unwrap(), b"");
        let blob: Vec<u8> = (0..=255).collect();
        a.set("blob", &blob).unwrap();
        assert_eq!(b.get("blob", T).unwrap(), blob);
        // add on a non-counter is an error reply, and the connection stays usable.
        let err = a.add("blob", 1).unwrap_err();
        assert!(err.to_string().contains("integer counter"), "{err}");
        assert_eq!(a.add("n", 1).unwrap(), 3);
    }

    #[test]
    fn get_blocks_until_another_client_sets() {
        let (_server, addr) = server();
        let reader = TcpStore::connect(&addr, T).unwrap();
        let writer_addr = addr.clone();
        let t = std::thread::spawn(move || {
            let w = TcpStore::connect(&writer_addr, T).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            w.set("late", b"v").unwrap();
        });
        assert_eq!(reader.get("late", T).unwrap(), b"v");
        t.join().unwrap();
    }

    #[test]
    fn concurrent_clients_count_exactly() {
        let (_server, addr) = server();
        let (clients, adds) = (8, 50);
        let barrier = Arc::new(Barrier::new(clients));
        let threads: Vec<_> = (0..clients)
            .map(|i| {
                let (addr, barrier) = (addr.clone(), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    let s = TcpStore::connect(&addr, T).unwrap();
                    barrier.wait();
                    for _ in 0..adds {
                        s.add("counter", 1).unwrap();
                    }
                    s.set(&format!("done/{i}"), b"1").unwrap();
                    let keys: Vec<String> = (0..clients).map(|j| format!("done/{j}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    s.wait(&keys, T).unwrap();
                    s.add("counter", 0).unwrap()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), (clients * adds) as i64);
        }
    }

    #[test]
    fn wait_timeout_names_the_missing_keys() {
        let (_server, addr) = server();
        let s = TcpStore::connect(&addr, T).unwrap();
        s.set("present", b"1").unwrap();
        let start = Instant::now();
        let err = s
            .wait(&["present", "absent/3"], Duration::from_millis(100))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(
            matches!(&err, StoreError::Timeout { keys, .. } if keys == &["absent/3"]),
            "{err}"
        );
        assert!(err.to_string().contains("absent/3"), "{err}");
        let err = s.get("nope", Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        // Still usable after timeouts.
        assert_eq!(s.get("present", T).unwrap(), b"1");
    }

    /// Sends a raw frame body and returns the reply (None if the server just closed).
    fn raw_exchange(addr: &str, frames: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        frames
            .iter()
            .map(|f| {
                s.write_all(f).ok()?;
                let mut len = [0u8; 4];
                s.read_exact(&mut len).ok()?;
                let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                s.read_exact(&mut body).ok()?;
                Some(body)
            })
            .collect()
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn malformed_frames_get_an_error_not_a_panic() {
        let (_server, addr) = server();
        let hello = framed(&Writer::default().u8(OP_HELLO).u32(MAGIC).u32(VERSION).0);
        let cases: Vec<(Vec<Vec<u8>>, &str)> = vec![
            (vec![framed(&[OP_SET, 1, 2])], "not a store hello"),
            (
                vec![framed(&Writer::default().u8(OP_HELLO).u32(7).u32(1).0)],
                "bad hello",
            ),
            (vec![hello.clone(), framed(&[99])], "unknown op"),
            (
                vec![hello.clone(), framed(&[OP_SET, 200, 0, 0, 0, b'k'])],
                "truncated",
            ),
            (
                vec![
                    hello.clone(),
                    framed(&Writer::default().u8(OP_DELETE).bytes(b"k").u8(0).0),
                ],
                "trailing",
            ),
            (
                vec![
                    hello.clone(),
                    framed(
                        &Writer::default()
                            .u8(OP_SET)
                            .bytes(&[0xff, 0xfe])
                            .bytes(b"")
                            .0,
                    ),
                ],
                "UTF-8",
            ),
            (
                vec![
                    hello.clone(),
                    framed(&Writer::default().u8(OP_WAIT).u32(u32::MAX).0),
                ],
                "key count",
            ),
            (
                vec![hello.clone(), u32::MAX.to_le_bytes().to_vec()],
                "exceeds the limit",
            ),
        ];
        for (frames, expect) in cases {
            let replies = raw_exchange(&addr, &frames);
            let last = replies.last().unwrap().as_ref().expect("an error reply");
            assert_eq!(last[0], ST_ERROR, "{expect}");
            let msg = String::from_utf8_lossy(&last[5..]);
            assert!(msg.contains(expect), "expected {expect:?} in {msg:?}");
        }
        // A frame cut off mid-way followed by a disconnect leaves the server serving.
        {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(&hello).unwrap();
            s.write_all(&[10, 0, 0, 0, OP_SET]).unwrap();
        }
        let s = TcpStore::connect(&addr, T).unwrap();
        s.set("alive", b"yes").unwrap();
        assert_eq!(s.get("alive", T).unwrap(), b"yes");
    }

    proptest::proptest! {
        /// Any body at all decodes to a reply or an error, never a panic; a byte flipped in a
        /// valid request is no different.
        #[test]
        fn arbitrary_request_bodies_never_panic(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            flip in 0usize..64,
        ) {
            let state = MemStore::new();
            let mut greeted = true;
            let _ = handle(&body, &state, &mut greeted);
            let mut valid = Writer::default().u8(OP_CAS).bytes(b"key").opt_bytes(Some(b"a")).bytes(b"b").0;
            let i = flip % valid.len();
            valid[i] ^= 0x5a;
            let _ = handle(&valid, &state, &mut greeted);
        }
    }

    #[test]
    fn garbage_from_a_fake_server_is_a_protocol_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let _ = read_frame(&mut c);
            c.write_all(&framed(&[7, 7, 7])).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        });
        let err = TcpStore::connect(&addr, T)
            .err()
            .expect("garbage reply must fail");
        assert!(err.to_string().contains("unknown reply status 7"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn server_gone_is_a_clear_error() {
        let (server, addr) = server();
        let s = TcpStore::connect(&addr, T).unwrap();
        s.set("a", b"1").unwrap();
        drop(server);
        let err = s.get("a", T).unwrap_err();
        assert!(err.to_string().contains("closed the connection"), "{err}");
        let err = s.set("b", b"2").unwrap_err();
        assert!(err.to_string().contains("lost"), "{err}");
    }

    #[test]
    fn a_blocked_get_fails_when_the_server_goes_away() {
        let (server, addr) = server();
        let s = TcpStore::connect(&addr, T).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(server);
        });
        let start = Instant::now();
        let err = s.get("never", Duration::from_secs(20)).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "took {:?}",
            start.elapsed()
        );
        assert!(err.to_string().contains("closed the connection"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn connect_retries_until_the_host_starts_and_times_out_clearly() {
        // Reserve a free port, release it, and host the store there a little later.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let host = TcpStore::host(port, T).unwrap();
            host.set("ready", b"1").unwrap();
            host.wait(&["bye"], T).unwrap();
        });
        let s = TcpStore::rendezvous("127.0.0.1", port, false, T).unwrap();
        assert_eq!(s.get("ready", T).unwrap(), b"1");
        s.set("bye", b"").unwrap();
        t.join().unwrap();

        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = Instant::now();
        let err = TcpStore::connect(&format!("127.0.0.1:{free}"), Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(err.to_string().contains("could not connect"), "{err}");
    }
}
