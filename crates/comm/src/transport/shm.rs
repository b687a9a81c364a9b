//! Shared-memory transport: one mapped file per (group, host) holding a single-producer
//! single-consumer byte ring for every directed pair of local ranks, plus one futex "doorbell"
//! word per rank.
//!
//! Ring protocol: `head` (bytes ever written, producer-owned) and `tail` (bytes ever consumed,
//! consumer-owned) are monotonically increasing `u64`s on separate cache lines; the data lives
//! at `pos % cap`. The producer publishes `head` with Release after copying, the consumer
//! publishes `tail` with Release after reading, each loading the other's counter with Acquire.
//!
//! Waiting: after any publish, the writer bumps the peer's doorbell and, only if the peer has
//! announced it is sleeping, calls `FUTEX_WAKE`. A waiter reads its doorbell *before* checking
//! its rings and sleeps with `FUTEX_WAIT(doorbell, seen)`, which returns at once if any publish
//! happened since the read — so no wake-up is lost. Non-private futexes work across processes.
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{LinkError, OutMsg, RecvReject};

const SEG_MAGIC: u64 = 0x5854_5348_4d5f_0001;
const PAGE: usize = 4096;
const BELL_STRIDE: usize = 128;
const CTRL_BYTES: usize = 256;
/// At most this many bytes are written before `head` is published, so the consumer can start
/// on a large message while the producer is still copying (pipelining through the ring).
/// 256 KiB (a quarter of the default 1 MiB ring) beat 64 KiB by ~7 % median busbw at 16–64 MiB
/// with 2 ranks (fewer publishes and doorbell bumps, same overlap; docs/PERFORMANCE.md).
const WRITE_CHUNK: usize = 256 << 10;

/// A mapped segment (unmapped on drop; the file itself is unlinked once every rank attached).
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    n: usize,
    cap: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics and the ring protocol
// above (each byte range of a ring has exactly one writer at a time).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn bells_bytes(n: usize) -> usize {
    (n * BELL_STRIDE).next_multiple_of(PAGE)
}

fn ring_stride(cap: usize) -> usize {
    CTRL_BYTES + cap
}

fn segment_len(n: usize, cap: usize) -> usize {
    PAGE + bells_bytes(n) + n * n * ring_stride(cap)
}

impl Segment {
    /// Creates (exclusively) and maps a new segment file for `n` local ranks.
    pub fn create(path: &Path, n: usize, cap: usize, token: u64) -> std::io::Result<Arc<Segment>> {
        assert!(cap.is_multiple_of(PAGE) && cap > 0);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let len = segment_len(n, cap);
        file.set_len(len as u64)?;
        let seg = Self::map(&file, len, n, cap)?;
        // The file starts zeroed, so every counter, flag and doorbell is 0. Publish the header.
        let hdr = seg.base as *mut u64;
        // SAFETY: the header page is inside the mapping; nobody reads it before the magic.
        unsafe {
            hdr.add(1).write(n as u64);
            hdr.add(2).write(cap as u64);
            hdr.add(3).write(token);
            (*(hdr as *const AtomicU64)).store(SEG_MAGIC, Ordering::Release);
        }
        Ok(seg)
    }

    /// Maps an existing segment and checks it was made for this job and shape.
    pub fn open(path: &Path, n: usize, cap: usize, token: u64) -> std::io::Result<Arc<Segment>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = segment_len(n, cap);
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(std::io::Error::other(format!(
                "shared-memory segment {} has {actual} bytes, expected {len}",
                path.display()
            )));
        }
        let seg = Self::map(&file, len, n, cap)?;
        let hdr = seg.base as *const u64;
        // SAFETY: header page is inside the mapping; the magic is read with Acquire first.
        let (magic, sn, scap, stoken) = unsafe {
            (
                (*(hdr as *const AtomicU64)).load(Ordering::Acquire),
                hdr.add(1).read(),
                hdr.add(2).read(),
                hdr.add(3).read(),
            )
        };
        if magic != SEG_MAGIC || sn != n as u64 || scap != cap as u64 || stoken != token {
            return Err(std::io::Error::other(format!(
                "shared-memory segment {} belongs to another job or shape",
                path.display()
            )));
        }
        Ok(seg)
    }

    fn map(file: &File, len: usize, n: usize, cap: usize) -> std::io::Result<Arc<Segment>> {
        // SAFETY: plain shared mapping of a file we hold open; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(Segment {
            base: base as *mut u8,
            len,
            n,
            cap,
        }))
    }

    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.len);
        // SAFETY: in bounds, aligned (all offsets are multiples of 8), and the atomics we cast
        // to are valid for any bit pattern.
        unsafe { &*(self.base.add(off) as *const T) }
    }

    fn bell(&self, i: usize) -> &AtomicU32 {
        self.at(PAGE + i * BELL_STRIDE)
    }

    fn sleeping(&self, i: usize) -> &AtomicU32 {
        self.at(PAGE + i * BELL_STRIDE + 64)
    }

    fn pid_slot(&self, i: usize) -> &AtomicU32 {
        self.at(PAGE + i * BELL_STRIDE + 8)
    }

    /// Records this process as local rank `i` (so peers can tell when it died).
    pub fn set_pid(&self, i: usize) {
        self.pid_slot(i)
            .store(std::process::id(), Ordering::Release);
    }

    /// False only if local rank `i` recorded a pid and that process no longer exists (a rank
    /// killed without closing its rings is then noticed long before the timeout).
    pub fn alive(&self, i: usize) -> bool {
        let pid = self.pid_slot(i).load(Ordering::Acquire);
        if pid == 0 {
            return true;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }

    /// Current doorbell value of local rank `i` (read before checking for progress).
    pub fn doorbell(&self, i: usize) -> u32 {
        self.bell(i).load(Ordering::SeqCst)
    }

    /// Wakes local rank `i` if it sleeps (called after publishing anything it may wait for).
    pub fn notify(&self, i: usize) {
        self.bell(i).fetch_add(1, Ordering::SeqCst);
        if self.sleeping(i).load(Ordering::SeqCst) != 0 {
            futex_wake(self.bell(i));
        }
    }

    /// Sleeps until local rank `i`'s doorbell differs from `seen`, or `timeout`.
    pub fn wait(&self, i: usize, seen: u32, timeout: Duration) {
        self.sleeping(i).store(1, Ordering::SeqCst);
        futex_wait(self.bell(i), seen, timeout);
        self.sleeping(i).store(0, Ordering::SeqCst);
    }

    /// Maps the pages of the two rings between `me` and `peer` into this process now (the
    /// outgoing one writable), so that messages do not pay page faults as they first walk
    /// through the ring. Without it every fresh 4 KiB of ring cost a fault on each side: a
    /// 4 KiB all-reduce between two processes took 5 µs against 1.1 µs for 1 KiB, and 16 KiB
    /// took longer than 64 KiB (whose traffic wraps the ring within the warm-up). The
    /// segment is fresh when links are made, so populating changes no bytes.
    pub fn prefault(&self, me: usize, peer: usize) {
        for (from, to, advice) in [
            (me, peer, libc::MADV_POPULATE_WRITE),
            (peer, me, libc::MADV_POPULATE_READ),
        ] {
            let start = self.ring(from, to).ctrl as usize;
            let end = start + ring_stride(self.cap);
            let first = start & !(PAGE - 1);
            let len = end.next_multiple_of(PAGE) - first;
            // SAFETY: the range lies inside our mapping; populating does not change contents.
            let r = unsafe { libc::madvise(first as *mut libc::c_void, len, advice) };
            if r != 0 {
                // Kernels before 5.14 lack MADV_POPULATE_*: fault the pages in by reading.
                for page in (first..first + len).step_by(PAGE) {
                    // SAFETY: inside our mapping; a read of shared memory has no side effect.
                    unsafe { std::ptr::read_volatile(page as *const u8) };
                }
            }
        }
    }

    fn ring(&self, from: usize, to: usize) -> Ring {
        let off = PAGE + bells_bytes(self.n) + (from * self.n + to) * ring_stride(self.cap);
        // SAFETY: in bounds of the mapping by construction of `segment_len`.
        let ctrl = unsafe { self.base.add(off) };
        Ring {
            ctrl,
            data: unsafe { ctrl.add(CTRL_BYTES) },
            cap: self.cap,
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no references outlive the segment
        // (rings hold an Arc to it).
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid aligned u32 with a relative timeout; errors (EAGAIN when the
    // value already changed, EINTR, ETIMEDOUT) all mean "go and check again".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Raw view of one directed ring inside a segment.
struct Ring {
    ctrl: *mut u8,
    data: *mut u8,
    cap: usize,
}

impl Ring {
    fn word<T>(&self, off: usize) -> &T {
        // SAFETY: control block offsets below are inside the 256-byte control block.
        unsafe { &*(self.ctrl.add(off) as *const T) }
    }
    fn head(&self) -> &AtomicU64 {
        self.word(0)
    }
    fn producer_closed(&self) -> &AtomicU32 {
        self.word(8)
    }
    fn tail(&self) -> &AtomicU64 {
        self.word(128)
    }
    fn consumer_closed(&self) -> &AtomicU32 {
        self.word(136)
    }
}

/// This rank's end of the pair of rings to one local peer.
pub(crate) struct ShmLink {
    seg: Arc<Segment>,
    peer: usize,
    out: Ring,
    inn: Ring,
    /// Producer-owned `out.head` and consumer-owned `inn.tail`, cached locally.
    head: u64,
    tail: u64,
    closed: bool,
}

// SAFETY: the raw pointers point into `seg`, which the link keeps alive.
unsafe impl Send for ShmLink {}

impl ShmLink {
    pub fn new(seg: Arc<Segment>, me: usize, peer: usize) -> Self {
        let out = seg.ring(me, peer);
        let inn = seg.ring(peer, me);
        let head = out.head().load(Ordering::Acquire);
        let tail = inn.tail().load(Ordering::Acquire);
        ShmLink {
            seg,
            peer,
            out,
            inn,
            head,
            tail,
            closed: false,
        }
    }

    pub fn try_write(&mut self, msg: &mut OutMsg<'_>) -> Result<usize, LinkError> {
        if self.out.consumer_closed().load(Ordering::Acquire) != 0 {
            return Err(LinkError::Closed);
        }
        let cap = self.out.cap;
        let used = (self.head - self.out.tail().load(Ordering::Acquire)) as usize;
        let budget = (cap - used).min(msg.remaining()).min(WRITE_CHUNK) & !7;
        if budget == 0 {
            return Ok(0);
        }
        let mut pos = self.head as usize % cap;
        let mut left = budget;
        while left > 0 {
            let parts = msg.parts();
            let part = parts
                .iter()
                .find(|p| !p.is_empty())
                .expect("message has bytes left");
            let take = part.len().min(left);
            let first = take.min(cap - pos);
            // SAFETY: [pos, pos+first) and [0, take-first) lie in the ring's data area, which
            // the consumer does not read until `head` is published below.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), self.out.data.add(pos), first);
                std::ptr::copy_nonoverlapping(
                    part.as_ptr().add(first),
                    self.out.data,
                    take - first,
                );
            }
            pos = (pos + take) % cap;
            left -= take;
            msg.advance(take);
        }
        self.head += budget as u64;
        self.out.head().store(self.head, Ordering::Release);
        self.seg.notify(self.peer);
        Ok(budget)
    }

    pub fn try_read(
        &mut self,
        f: &mut dyn FnMut(&[u8]) -> Result<usize, RecvReject>,
    ) -> Result<usize, LinkError> {
        let mut head = self.inn.head().load(Ordering::Acquire);
        if head == self.tail {
            if self.inn.producer_closed().load(Ordering::Acquire) == 0 {
                return Ok(0);
            }
            // The producer may have published its last bytes just before closing.
            head = self.inn.head().load(Ordering::Acquire);
            if head == self.tail {
                return Err(LinkError::Closed);
            }
        }
        let cap = self.inn.cap;
        let off = self.tail as usize % cap;
        let len = ((head - self.tail) as usize).min(cap - off);
        // SAFETY: bytes [tail, head) were published by the producer (Acquire above) and are not
        // overwritten until we publish a larger tail.
        let region = unsafe { std::slice::from_raw_parts(self.inn.data.add(off), len) };
        let used = f(region).map_err(LinkError::Rejected)?;
        if used > 0 {
            self.tail += used as u64;
            self.inn.tail().store(self.tail, Ordering::Release);
            self.seg.notify(self.peer);
        }
        Ok(used)
    }

    /// Whether the peer's process still exists.
    pub fn peer_alive(&self) -> bool {
        self.seg.alive(self.peer)
    }

    pub fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            self.out.producer_closed().store(1, Ordering::Release);
            self.inn.consumer_closed().store(1, Ordering::Release);
            self.seg.notify(self.peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether every page of ring `(from, to)` is resident (mincore(2)).
    fn ring_resident(seg: &Segment, from: usize, to: usize) -> bool {
        let start = seg.ring(from, to).ctrl as usize & !(PAGE - 1);
        let end = (seg.ring(from, to).ctrl as usize + ring_stride(seg.cap)).next_multiple_of(PAGE);
        let mut vec = vec![0u8; (end - start) / PAGE];
        // SAFETY: the range lies inside the segment's mapping; `vec` has one byte per page.
        let r = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().all(|&v| v & 1 == 1)
    }

    #[test]
    fn prefault_maps_both_rings_of_the_pair_and_no_others() {
        let dir = if Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let path = dir.join(format!("xtrain-prefault-test-{}", std::process::id()));
        let cap = 16 * PAGE;
        let seg = Segment::create(&path, 3, cap, 7).expect("create segment");
        let _ = std::fs::remove_file(&path);
        assert!(!ring_resident(&seg, 0, 1) && !ring_resident(&seg, 1, 0));
        seg.prefault(0, 1);
        assert!(ring_resident(&seg, 0, 1), "outgoing ring not populated");
        assert!(ring_resident(&seg, 1, 0), "incoming ring not populated");
        assert!(
            !ring_resident(&seg, 2, 1),
            "a ring of other ranks was populated"
        );
        // Populating changed no bytes: the rings are still empty.
        let ring = seg.ring(0, 1);
        assert_eq!(ring.head().load(Ordering::Acquire), 0);
        let data = unsafe { std::slice::from_raw_parts(ring.data, cap) };
        assert!(data.iter().all(|&b| b == 0));
    }
}
