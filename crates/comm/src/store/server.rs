//! The store server: one [`MemStore`] served over TCP to the clients that prove the job token.
//!
//! Each connection gets a thread. Until it has proved the token (hello, then auth: see
//! [`super::tcp`]) a connection may send only frames of [`StoreLimits::handshake_frame`]
//! bytes, must finish within [`StoreLimits::handshake_timeout`], and may touch no key; at most
//! [`StoreLimits::max_handshakes`] handshakes run at once (further connections wait in the
//! kernel's backlog). Refusals are logged with the peer's address and the reason. After the
//! proof, frames may be up to [`StoreLimits::max_frame`] bytes, and at most
//! [`StoreLimits::max_clients`] clients are served. A frame over the limit is refused from its
//! declared length, before anything is allocated for it. When a client leaves (even in the
//! middle of a blocking `get`) its socket is closed and its state dropped.
use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::codec::{
    millis, read_frame, write_frame, FrameError, Request, Writer, MAGIC, OP_AUTH, OP_HELLO,
    ST_ERROR, ST_OK, ST_TIMEOUT, VERSION,
};
use super::{MemStore, Store, StoreError};
use crate::auth::{nonce, JobToken, Role, NONCE_LEN};
use crate::deadline_io::Deadlined;

/// Bounds on what clients may cost the server.
#[derive(Clone, Debug)]
pub struct StoreLimits {
    /// Largest frame body from a client that proved the token (values are bootstrap metadata).
    pub max_frame: usize,
    /// Largest frame body before the proof (a hello or an auth frame is under 64 bytes).
    pub handshake_frame: usize,
    /// Time a connection has to prove the token.
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once; more connections wait to be accepted.
    pub max_handshakes: usize,
    /// Clients served at once (after the proof); more are refused.
    pub max_clients: usize,
}

/// Largest frame body accepted by default.
pub const MAX_FRAME: usize = 64 << 20;

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_frame: MAX_FRAME,
            handshake_frame: 64,
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 64,
            max_clients: 16384,
        }
    }
}

/// Granularity at which a blocking `get`/`wait` notices that its client left.
const GONE_POLL: Duration = Duration::from_millis(200);

/// Live connections: their sockets (to shut them down when the server stops) and counts.
#[derive(Default)]
struct Registry {
    sockets: Mutex<HashMap<u64, TcpStream>>,
    handshakes: Mutex<usize>,
    handshake_done: Condvar,
    clients: AtomicUsize,
    next_id: AtomicU64,
}

/// The store server: accepts clients on a TCP port and serves them from one [`MemStore`].
/// Dropping it stops accepting and closes every client connection.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    registry: Arc<Registry>,
    accept: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`Self::local_addr`]) and serves the
    /// clients that prove `token`, with the default [`StoreLimits`].
    pub fn bind(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: JobToken,
    ) -> Result<Self, StoreError> {
        Self::bind_with(addr, token, StoreLimits::default())
    }

    /// [`Self::bind`] with explicit limits.
    pub fn bind_with(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: JobToken,
        limits: StoreLimits,
    ) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(&addr)
            .map_err(|e| StoreError::Io(format!("cannot host the store at {addr:?}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| StoreError::Io(format!("store listener address: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let registry = Arc::new(Registry::default());
        let shared = Arc::new(Shared {
            state: MemStore::new(),
            token,
            limits,
            registry: Arc::clone(&registry),
        });
        let accept = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(listener, shared, stop))
                .map_err(|e| StoreError::Io(format!("cannot start the store thread: {e}")))?
        };
        Ok(Self {
            addr: local,
            stop,
            registry,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections open right now (handshaking or served).
    pub fn open_connections(&self) -> usize {
        self.registry
            .sockets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Clients that proved the token and are being served right now.
    pub fn clients(&self) -> usize {
        self.registry.clients.load(Ordering::SeqCst)
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.registry.handshake_done.notify_all();
        // Wake the blocking accept with a throwaway connection to ourselves.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => [127, 0, 0, 1].into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for (_, c) in self
            .registry
            .sockets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// What every connection thread shares.
struct Shared {
    state: MemStore,
    token: JobToken,
    limits: StoreLimits,
    registry: Arc<Registry>,
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let reg = &shared.registry;
    loop {
        // Back-pressure: wait for a handshake slot before taking the next connection.
        {
            let mut n = reg.handshakes.lock().unwrap_or_else(|e| e.into_inner());
            while *n >= shared.limits.max_handshakes && !stop.load(Ordering::SeqCst) {
                n = reg
                    .handshake_done
                    .wait(n)
                    .unwrap_or_else(|e| e.into_inner());
            }
            *n += 1;
        }
        let conn = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok((stream, peer)) = conn else {
            handshake_over(reg);
            // Out of descriptors or the like: do not spin on it.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let id = reg.next_id.fetch_add(1, Ordering::Relaxed);
        match stream.try_clone() {
            Ok(clone) => {
                reg.sockets
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, clone);
            }
            Err(e) => {
                tracing::warn!(%peer, "store: dropping a connection: {e}");
                handshake_over(reg);
                continue;
            }
        }
        let shared_c = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("store-client".into())
            .spawn(move || {
                let mut conn = Conn {
                    stream,
                    peer,
                    phase: Phase::New,
                };
                conn.serve(&shared_c);
                let reg = &shared_c.registry;
                if conn.phase == Phase::Served {
                    reg.clients.fetch_sub(1, Ordering::SeqCst);
                } else {
                    handshake_over(reg);
                }
                // Dropping `conn` and the registry's clone closes the socket.
                reg.sockets
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
            });
        if spawned.is_err() {
            tracing::warn!(%peer, "store: no thread for a new connection; closed it");
            reg.sockets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            handshake_over(reg);
        }
    }
}

fn handshake_over(reg: &Registry) {
    *reg.handshakes.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
    reg.handshake_done.notify_one();
}

/// Where a connection stands in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing received yet.
    New,
    /// Hello received; the client must prove the token over these nonces next.
    Challenged {
        client: [u8; NONCE_LEN],
        server: [u8; NONCE_LEN],
    },
    /// Proved the token: requests are served.
    Served,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    phase: Phase,
}

impl Conn {
    /// Serves one client until it disconnects, fails the handshake or sends something malformed.
    fn serve(&mut self, shared: &Shared) {
        let _ = self.stream.set_nodelay(true);
        let _ = self
            .stream
            .set_read_timeout(Some(shared.limits.handshake_timeout));
        let deadline = Instant::now() + shared.limits.handshake_timeout;
        loop {
            let served = self.phase == Phase::Served;
            if !served && Instant::now() >= deadline {
                return self.refuse("did not prove the job token in time");
            }
            let limit = match served {
                true => shared.limits.max_frame,
                false => shared.limits.handshake_frame,
            };
            let mut source = Deadlined {
                stream: &self.stream,
                deadline: (!served).then_some(deadline),
            };
            let body = match read_frame(&mut source, limit) {
                Ok(b) => b,
                Err(FrameError::TooLarge(n)) => {
                    let msg = format!("frame of {n} bytes exceeds the limit of {limit}");
                    return self.refuse(&msg);
                }
                Err(FrameError::Closed) if self.phase == Phase::New => {
                    // Port probes and the server's own wake-up: not worth a warning.
                    tracing::debug!(peer = %self.peer, "store: connection closed before its hello");
                    return;
                }
                Err(FrameError::Io(e))
                    if !served
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                {
                    return self.refuse("did not prove the job token in time");
                }
                Err(_) => return,
            };
            let reply = match self.handle(&body, shared) {
                Ok(payload) => payload,
                Err(StoreError::Timeout { keys, timeout }) => {
                    let mut w = Writer::default().u8(ST_TIMEOUT).u32(keys.len() as u32);
                    for k in &keys {
                        w = w.bytes(k.as_bytes());
                    }
                    w.u64(millis(timeout)).0
                }
                Err(StoreError::Rejected(msg)) if served => {
                    // A well-formed request the store refused: the connection stays usable.
                    let msg = format!("store: request rejected: {msg}");
                    Writer::default().u8(ST_ERROR).bytes(msg.as_bytes()).0
                }
                // Only a wait that saw its client leave fails with Io once serving.
                Err(StoreError::Io(_)) if served => return,
                Err(e) => return self.refuse(&e.to_string()),
            };
            if write_frame(&mut self.stream, &reply).is_err() {
                return;
            }
            if !served && self.phase == Phase::Served {
                // Proved: no deadline from here on (a rank may stay idle for a whole run).
                let _ = self.stream.set_read_timeout(None);
            }
        }
    }

    /// Sends an error reply, logs why, and ends the connection (the stream may be out of step).
    fn refuse(&mut self, reason: &str) {
        match self.phase {
            Phase::Served => tracing::warn!(peer = %self.peer, "store: dropped a client: {reason}"),
            _ => tracing::warn!(peer = %self.peer, "store: refused a connection: {reason}"),
        }
        let _ = self.stream.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = write_frame(
            &mut self.stream,
            &Writer::default().u8(ST_ERROR).bytes(reason.as_bytes()).0,
        );
        let _ = self.stream.flush();
    }

    /// Decodes and applies one request; returns the whole reply body.
    fn handle(&mut self, body: &[u8], shared: &Shared) -> Result<Vec<u8>, StoreError> {
        // The phase decides which ops may come at all: say so before decoding the rest.
        match (self.phase, body.first().copied()) {
            (Phase::New, Some(op)) if op != OP_HELLO => {
                return Err(StoreError::Protocol(
                    "first message is not a store hello".into(),
                ))
            }
            (Phase::Challenged { .. }, Some(op)) if op != OP_AUTH => {
                return Err(StoreError::Protocol(
                    "a request before proving the job token".into(),
                ))
            }
            _ => {}
        }
        let req = Request::decode(body)?;
        let ok = Writer::default().u8(ST_OK);
        let state = &shared.state;
        let out = match (self.phase, req) {
            (
                Phase::New,
                Request::Hello {
                    magic,
                    version,
                    nonce: client,
                },
            ) => {
                if magic != MAGIC || version != VERSION {
                    return Err(StoreError::Protocol(format!(
                        "bad hello (magic {magic:#x}, version {version}; expected {MAGIC:#x}, {VERSION})"
                    )));
                }
                let server = nonce().map_err(StoreError::Io)?;
                self.phase = Phase::Challenged { client, server };
                ok.raw(&server)
            }
            (Phase::New, _) => {
                return Err(StoreError::Protocol(
                    "first message is not a store hello".into(),
                ))
            }
            (Phase::Challenged { client, server }, Request::Auth { proof }) => {
                if !shared
                    .token
                    .verify(Role::StoreClient, &[&client, &server], &proof)
                {
                    return Err(StoreError::Protocol(
                        "job token proof rejected (a client of another job, or a different XTRAIN_JOB_TOKEN)".into(),
                    ));
                }
                let reg = &shared.registry;
                if reg.clients.fetch_add(1, Ordering::SeqCst) >= shared.limits.max_clients {
                    reg.clients.fetch_sub(1, Ordering::SeqCst);
                    return Err(StoreError::Protocol(format!(
                        "the store serves its limit of {} clients",
                        shared.limits.max_clients
                    )));
                }
                self.phase = Phase::Served;
                handshake_over(reg);
                ok.raw(&shared.token.prove(Role::StoreServer, &[&client, &server]))
            }
            (Phase::Challenged { .. }, _) => {
                return Err(StoreError::Protocol(
                    "a request before proving the job token".into(),
                ))
            }
            (Phase::Served, Request::Hello { .. } | Request::Auth { .. }) => {
                return Err(StoreError::Protocol("a second handshake".into()))
            }
            (Phase::Served, Request::Set { key, value }) => {
                state.set(key, value)?;
                ok
            }
            (Phase::Served, Request::Get { key, timeout }) => {
                self.wait_while_present(state, &[key], timeout)?;
                ok.bytes(&state.get(key, Duration::ZERO)?)
            }
            (Phase::Served, Request::Wait { keys, timeout }) => {
                self.wait_while_present(state, &keys, timeout)?;
                ok
            }
            (Phase::Served, Request::Add { key, delta }) => ok.i64(state.add(key, delta)?),
            (Phase::Served, Request::CompareSet { key, expected, new }) => {
                ok.bytes(&state.compare_set(key, expected, new)?)
            }
            (Phase::Served, Request::Delete { key }) => ok.u8(state.delete(key)? as u8),
        };
        Ok(out.0)
    }

    /// Waits up to `timeout` for `keys`, in slices, giving up early when the client has left
    /// (so its thread and socket do not outlive it by the rest of a long wait).
    fn wait_while_present(
        &self,
        state: &MemStore,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(GONE_POLL, |d| d.saturating_duration_since(Instant::now()));
            match state.wait(keys, left.min(GONE_POLL)) {
                Ok(()) => return Ok(()),
                Err(StoreError::Timeout { keys: missing, .. }) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(StoreError::Timeout {
                            keys: missing,
                            timeout,
                        });
                    }
                    if peer_left(&self.stream) {
                        return Err(StoreError::Io("the client left".into()));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Whether the peer closed its side (a non-blocking peek sees end of stream or a reset).
fn peer_left(stream: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: recv into a 1-byte buffer we own; MSG_PEEK leaves the data in the socket.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return true;
    }
    n < 0
        && !matches!(
            std::io::Error::last_os_error().kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        )
}
