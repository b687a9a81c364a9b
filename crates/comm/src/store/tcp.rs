//! TCP rendezvous store client, and the protocol it speaks with [`TcpStoreServer`] (hosted by
//! rank 0 at `MASTER_ADDR:MASTER_PORT`).
//!
//! ## Wire protocol
//! Every message is a frame: a little-endian `u32` body length, then the body.
//! Bodies are built from four field kinds: `u8`/`u32`/`u64`/`i64` (little-endian), `raw[n]`
//! (n bytes), `bytes` (`u32` length + data) and `opt bytes` (`u8` 0/1 + bytes when 1).
//!
//! | request (`u8` op first) | fields | ok-reply payload |
//! | --- | --- | --- |
//! | 0 hello | magic `u32`, version `u32`, client nonce `raw[32]` | server nonce `raw[32]` |
//! | 7 auth | client proof `raw[32]` | server proof `raw[32]` |
//! | 1 set | key, value | — |
//! | 2 get | key, timeout ms `u64` | value |
//! | 3 wait | key count `u32`, keys…, timeout ms `u64` | — |
//! | 4 add | key, delta `i64` | new value `i64` |
//! | 5 compare-set | key, opt expected, new | value after |
//! | 6 delete | key | existed `u8` |
//!
//! A connection starts with hello then auth: the client proves the job token with
//! HMAC-SHA256 over both nonces, the server answers with its own proof, and only then are
//! other requests served ([`crate::auth`]). Until then frames are limited to a few dozen bytes.
//!
//! A reply starts with a status `u8`: 0 ok (+ payload), 1 timeout (key count, keys,
//! timeout ms), 2 error (message). A malformed or oversized frame, or a failed handshake, gets
//! an error reply and the connection is closed; the server itself never panics on input and
//! keeps serving other clients. Blocking waits run in the server (one thread per client), so
//! a `get` costs one round trip however long it waits.
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::codec::{
    millis, read_frame, write_frame, FrameError, Reader, Writer, MAGIC, OP_ADD, OP_AUTH, OP_CAS,
    OP_DELETE, OP_GET, OP_HELLO, OP_SET, OP_WAIT, ST_ERROR, ST_OK, ST_TIMEOUT, VERSION,
};
use super::server::{TcpStoreServer, MAX_FRAME};
use super::{Store, StoreError};
use crate::auth::{nonce, JobToken, Role};

/// Extra time a client allows the server beyond a request's own timeout before
/// declaring it unresponsive.
const SERVER_SLACK: Duration = Duration::from_secs(30);
/// Largest reply a client reads: a value of [`MAX_FRAME`] bytes plus the reply's own fields.
const MAX_REPLY: usize = MAX_FRAME + 64;

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
    /// Connects to the store at `addr` ("host:port") and proves `token`, retrying the
    /// connection until `timeout` so that ranks may start before rank 0 has bound the port.
    pub fn connect(addr: &str, token: &JobToken, timeout: Duration) -> Result<Self, StoreError> {
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
        handshake(&mut stream, addr, token, op_timeout)?;
        Ok(Self {
            conn: Mutex::new(Some(stream)),
            addr: addr.to_string(),
            op_timeout,
            server: None,
        })
    }

    /// Hosts the server on `bind` (an address of this host; port 0 picks a free port) for
    /// the clients that prove `token`, and connects to it: what rank 0 does.
    pub fn host(
        bind: impl ToSocketAddrs + std::fmt::Debug,
        token: &JobToken,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let server = TcpStoreServer::bind(bind, token.clone())?;
        let mut own = server.local_addr();
        if own.ip().is_unspecified() {
            own.set_ip(match own {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let mut store = Self::connect(&own.to_string(), token, timeout)?;
        store.server = Some(server);
        Ok(store)
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

/// Hello and auth: proves `token` to the server and checks the server's proof in return.
fn handshake(
    stream: &mut TcpStream,
    addr: &str,
    token: &JobToken,
    timeout: Duration,
) -> Result<(), StoreError> {
    let client = nonce().map_err(StoreError::Io)?;
    let hello = Writer::default()
        .u8(OP_HELLO)
        .u32(MAGIC)
        .u32(VERSION)
        .raw(&client)
        .0;
    let reply = roundtrip(stream, addr, &hello, timeout)?;
    let mut r = Reader::new(&reply);
    let server: [u8; 32] = r.array("server nonce")?;
    r.finish()?;
    let proof = token.prove(Role::StoreClient, &[&client, &server]);
    let auth = Writer::default().u8(OP_AUTH).raw(&proof).0;
    let reply = roundtrip(stream, addr, &auth, timeout)?;
    let mut r = Reader::new(&reply);
    let theirs: [u8; 32] = r.array("server proof")?;
    r.finish()?;
    if !token.verify(Role::StoreServer, &[&client, &server], &theirs) {
        return Err(StoreError::Rejected(format!(
            "the store at {addr} did not prove this job's token \
             (another job's store, or a different XTRAIN_JOB_TOKEN)"
        )));
    }
    Ok(())
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
    let reply = read_frame(stream, MAX_REPLY).map_err(|e| match e {
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
    decode_reply(&reply, addr)
}

/// Maps a reply body to its ok-payload or the error it carries (any bytes: never a panic).
pub(crate) fn decode_reply(reply: &[u8], addr: &str) -> Result<Vec<u8>, StoreError> {
    let mut r = Reader::new(reply);
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
    use crate::store::StoreLimits;
    use std::io::Write;
    use std::net::TcpListener;
    use std::sync::{Arc, Barrier};

    const T: Duration = Duration::from_secs(5);

    fn token() -> JobToken {
        JobToken::new("test-token-0123456789").unwrap()
    }

    fn server() -> (TcpStoreServer, String) {
        server_with(StoreLimits::default())
    }

    fn server_with(limits: StoreLimits) -> (TcpStoreServer, String) {
        let s = TcpStoreServer::bind_with("127.0.0.1:0", token(), limits).unwrap();
        let addr = s.local_addr().to_string();
        (s, addr)
    }

    fn connect(addr: &str) -> TcpStore {
        TcpStore::connect(addr, &token(), T).unwrap()
    }

    /// Waits (bounded) until `f` holds: the server's threads notice closed sockets on their own.
    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(Instant::now() < deadline, "never happened: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn every_op_over_tcp() {
        let (_server, addr) = server();
        let a = connect(&addr);
        let b = connect(&addr);
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
        let reader = connect(&addr);
        let writer_addr = addr.clone();
        let t = std::thread::spawn(move || {
            let w = connect(&writer_addr);
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
                    let s = connect(&addr);
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
        let s = connect(&addr);
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

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    /// A raw connection; when `proven`, it has already passed the handshake with `token()`.
    fn raw(addr: &str, proven: bool) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        if proven {
            handshake(&mut s, addr, &token(), T).unwrap();
        }
        s
    }

    /// Writes each of `frames` and reads a reply to it (None once the server closed).
    fn exchange(s: &mut TcpStream, frames: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
        frames
            .iter()
            .map(|f| {
                s.write_all(f).ok()?;
                read_frame(s, MAX_REPLY).ok()
            })
            .collect()
    }

    /// The message of an error reply.
    fn error_of(reply: &Option<Vec<u8>>) -> String {
        let r = reply.as_ref().expect("an error reply");
        assert_eq!(r[0], ST_ERROR, "not an error reply: {r:?}");
        String::from_utf8_lossy(&r[5..]).into_owned()
    }

    fn hello_frame() -> Vec<u8> {
        framed(
            &Writer::default()
                .u8(OP_HELLO)
                .u32(MAGIC)
                .u32(VERSION)
                .raw(&[7; 32])
                .0,
        )
    }

    #[test]
    fn a_client_without_the_token_is_refused_and_changes_no_key() {
        let (server, addr) = server();
        let set = |k: &str| {
            framed(
                &Writer::default()
                    .u8(OP_SET)
                    .bytes(k.as_bytes())
                    .bytes(b"x")
                    .0,
            )
        };
        // Another job's token and no token: refused at the proof.
        for other in [
            JobToken::new("another-job-token-42").unwrap(),
            JobToken::none(),
        ] {
            let err = TcpStore::connect(&addr, &other, T).err().expect("refused");
            assert!(
                err.to_string().contains("job token proof rejected"),
                "{err}"
            );
        }
        // Skipping the hello, skipping the proof, or guessing it: refused, the key untouched.
        let mut s = raw(&addr, false);
        assert!(error_of(&exchange(&mut s, &[set("a")])[0]).contains("not a store hello"));
        let mut s = raw(&addr, false);
        let r = exchange(&mut s, &[hello_frame(), set("b")]);
        assert_eq!(r[0].as_ref().unwrap()[0], ST_OK);
        assert!(error_of(&r[1]).contains("before proving the job token"));
        let mut s = raw(&addr, false);
        let guess = framed(&Writer::default().u8(OP_AUTH).raw(&[0; 32]).0);
        let r = exchange(&mut s, &[hello_frame(), guess, set("c")]);
        assert!(error_of(&r[1]).contains("proof rejected"));
        assert!(r[2].is_none(), "the connection is closed after a refusal");
        // A frame too large for a handshake is refused from its header alone.
        let mut s = raw(&addr, false);
        let r = exchange(&mut s, &[(60u32 << 20).to_le_bytes().to_vec()]);
        assert!(error_of(&r[0]).contains("exceeds the limit of 64"));

        let s = connect(&addr);
        for k in ["a", "b", "c"] {
            assert!(matches!(
                s.get(k, Duration::from_millis(10)),
                Err(StoreError::Timeout { .. })
            ));
        }
        eventually("refused connections closed", || {
            server.open_connections() == 1 && server.clients() == 1
        });
    }

    #[test]
    fn a_store_that_cannot_prove_the_token_is_refused_by_the_client() {
        // A fake store that answers the handshake without knowing the token.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            for _ in 0..2 {
                read_frame(&mut c, 64).unwrap();
                let reply = Writer::default().u8(ST_OK).raw(&[1; 32]).0;
                write_frame(&mut c, &reply).unwrap();
            }
        });
        let err = TcpStore::connect(&addr, &token(), T)
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("did not prove this job's token"),
            "{err}"
        );
        t.join().unwrap();
    }

    #[test]
    fn malformed_frames_get_an_error_not_a_panic() {
        let (server, addr) = server();
        let cases: Vec<(bool, Vec<Vec<u8>>, &str)> = vec![
            (false, vec![framed(&[OP_SET, 1, 2])], "not a store hello"),
            (
                false,
                vec![framed(
                    &Writer::default().u8(OP_HELLO).u32(7).u32(2).raw(&[0; 32]).0,
                )],
                "bad hello",
            ),
            (false, vec![framed(&[OP_HELLO, 1])], "truncated"),
            (true, vec![framed(&[99])], "unknown op"),
            (
                true,
                vec![framed(&[OP_SET, 200, 0, 0, 0, b'k'])],
                "truncated",
            ),
            (
                true,
                vec![framed(&Writer::default().u8(OP_DELETE).bytes(b"k").u8(0).0)],
                "trailing",
            ),
            (
                true,
                vec![framed(
                    &Writer::default()
                        .u8(OP_SET)
                        .bytes(&[0xff, 0xfe])
                        .bytes(b"")
                        .0,
                )],
                "UTF-8",
            ),
            (
                true,
                vec![framed(&Writer::default().u8(OP_WAIT).u32(u32::MAX).0)],
                "key count",
            ),
            (true, vec![hello_frame()], "second handshake"),
            (
                true,
                vec![u32::MAX.to_le_bytes().to_vec()],
                "exceeds the limit",
            ),
        ];
        for (proven, frames, expect) in cases {
            let mut s = raw(&addr, proven);
            let replies = exchange(&mut s, &frames);
            let msg = error_of(replies.last().unwrap());
            assert!(msg.contains(expect), "expected {expect:?} in {msg:?}");
        }
        // A frame cut off mid-way followed by a disconnect leaves the server serving.
        {
            let mut s = raw(&addr, true);
            s.write_all(&[10, 0, 0, 0, OP_SET]).unwrap();
        }
        let s = connect(&addr);
        s.set("alive", b"yes").unwrap();
        assert_eq!(s.get("alive", T).unwrap(), b"yes");
        eventually("bad clients dropped", || server.open_connections() == 1);
    }

    #[test]
    fn handshakes_have_a_deadline_and_clients_a_cap() {
        let (server, addr) = server_with(StoreLimits {
            handshake_timeout: Duration::from_millis(300),
            max_clients: 2,
            ..StoreLimits::default()
        });
        // A connection that never proves anything is refused once its time is up.
        let mut idle = raw(&addr, false);
        let start = Instant::now();
        let reply = read_frame(&mut idle, MAX_REPLY).ok();
        assert!(error_of(&reply).contains("in time"));
        assert!(start.elapsed() < Duration::from_secs(4));
        // So is one that trickles its hello in a byte at a time (each read within its timeout).
        let mut slow = raw(&addr, false);
        let mut writer = slow.try_clone().unwrap();
        let start = Instant::now();
        let trickle = std::thread::spawn(move || {
            for b in hello_frame() {
                if writer.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(60));
            }
        });
        let reply = read_frame(&mut slow, MAX_REPLY).ok();
        assert!(error_of(&reply).contains("in time"));
        // Well before the whole hello (45 bytes, 2.7 s) could have arrived.
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        trickle.join().unwrap();
        // Two clients are served, a third is refused, and a departed one frees its place.
        let a = connect(&addr);
        let _b = connect(&addr);
        let err = TcpStore::connect(&addr, &token(), T)
            .err()
            .expect("over the cap");
        assert!(err.to_string().contains("limit of 2 clients"), "{err}");
        drop(a);
        eventually("a's place freed", || server.clients() == 1);
        connect(&addr).set("k", b"v").unwrap();
    }

    #[test]
    fn a_client_leaving_during_a_blocking_get_is_closed_at_once() {
        let (server, addr) = server();
        let mut s = raw(&addr, true);
        let get = Writer::default().u8(OP_GET).bytes(b"never").u64(600_000).0;
        s.write_all(&framed(&get)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(server.open_connections(), 1);
        drop(s);
        let start = Instant::now();
        eventually("the waiting client's connection closed", || {
            server.open_connections() == 0 && server.clients() == 0
        });
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn garbage_from_a_fake_server_is_a_protocol_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let _ = read_frame(&mut c, 64);
            c.write_all(&framed(&[7, 7, 7])).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        });
        let err = TcpStore::connect(&addr, &token(), T)
            .err()
            .expect("garbage reply must fail");
        assert!(err.to_string().contains("unknown reply status 7"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn server_gone_is_a_clear_error() {
        let (server, addr) = server();
        let s = connect(&addr);
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
        let s = connect(&addr);
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
            let host = TcpStore::host(("127.0.0.1", port), &token(), T).unwrap();
            host.set("ready", b"1").unwrap();
            host.wait(&["bye"], T).unwrap();
        });
        let s = connect(&format!("127.0.0.1:{port}"));
        assert_eq!(s.get("ready", T).unwrap(), b"1");
        s.set("bye", b"").unwrap();
        t.join().unwrap();

        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = Instant::now();
        let err = TcpStore::connect(
            &format!("127.0.0.1:{free}"),
            &token(),
            Duration::from_millis(200),
        )
        .err()
        .unwrap();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(err.to_string().contains("could not connect"), "{err}");
    }
}
