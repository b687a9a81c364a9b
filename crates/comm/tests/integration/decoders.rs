//! Fuzzing of every decoder of bytes from the network — store requests and replies, the hello
//! of a rank-to-rank link, transport message headers — with arbitrary and with mutated valid
//! input: each gives a value or an error, never a panic, and the memory it allocates is
//! bounded by the bytes it was given (plus one read chunk), never by a length those bytes
//! merely declare. Allocation is measured by a counting allocator, per thread.
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use comm::fuzzing;
use proptest::prelude::*;

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let v = live.get() + delta;
        live.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

// SAFETY: defers every call to the system allocator; only counts sizes on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        count(-(l.size() as isize));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            count(new as isize - l.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns the most bytes it had allocated at once (on this thread).
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, (PEAK.with(Cell::get) - base).max(0) as usize)
}

/// What a decoder may allocate for `input`: a few times its size, plus one 64 KiB read chunk
/// of the store's frame reader and the fixed-size fields.
fn bound(input: &[u8]) -> usize {
    4 * input.len() + (64 << 10) + 4096
}

const STORE_LIMIT: usize = 64 << 20;

fn framed(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn lp(b: &[u8]) -> Vec<u8> {
    [&(b.len() as u32).to_le_bytes()[..], b].concat()
}

/// A valid stream of store requests: hello, auth, set, get, wait, compare-set, delete.
fn valid_store_stream() -> Vec<u8> {
    let hello = [&[0u8][..], b"TTSX", &2u32.to_le_bytes(), &[9u8; 32]].concat();
    let auth = [&[7u8][..], &[1u8; 32]].concat();
    let set = [&[1u8][..], &lp(b"xtrain/job/addr/0"), &lp(b"10.0.0.1:5000")].concat();
    let get = [&[2u8][..], &lp(b"k"), &100u64.to_le_bytes()].concat();
    let wait = [
        &[3u8][..],
        &2u32.to_le_bytes(),
        &lp(b"a"),
        &lp(b"b"),
        &5u64.to_le_bytes(),
    ]
    .concat();
    let cas = [&[5u8][..], &lp(b"k"), &[1], &lp(b"old"), &lp(b"new")].concat();
    let del = [&[6u8][..], &lp(b"k")].concat();
    [hello, auth, set, get, wait, cas, del]
        .iter()
        .flat_map(|b| framed(b))
        .collect()
}

fn valid_link_hello() -> Vec<u8> {
    let mut b = b"XTRN\x02".to_vec();
    for s in [&b"job-42"[..], b"g0123456789abcdef-1"] {
        b.extend_from_slice(&(s.len() as u16).to_le_bytes());
        b.extend_from_slice(s);
    }
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&[3u8; 32]);
    b
}

fn valid_header() -> Vec<u8> {
    let mut b = vec![0u8; 32];
    b[0..2].copy_from_slice(&0x5854u16.to_le_bytes());
    b[2] = 1; // version
    b[3] = 4; // all_reduce
    b[4] = 1; // f32
    b[5] = 1; // sum
    b[16..24].copy_from_slice(&3u64.to_le_bytes());
    b[24..32].copy_from_slice(&12u64.to_le_bytes());
    b
}

/// `valid` with each `(position, byte)` written over it (positions wrap), then cut to `keep`
/// bytes when given: bit rot, hostile lengths and truncation in one.
fn mutate(mut valid: Vec<u8>, edits: &[(usize, u8)], keep: Option<usize>) -> Vec<u8> {
    for &(i, b) in edits {
        let n = valid.len();
        valid[i % n] = b;
    }
    if let Some(k) = keep {
        valid.truncate(k % (valid.len() + 1));
    }
    valid
}

fn edits() -> impl Strategy<Value = Vec<(usize, u8)>> {
    proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6)
}

#[test]
fn the_valid_inputs_decode() {
    assert_eq!(
        fuzzing::store_requests(&valid_store_stream(), STORE_LIMIT),
        7
    );
    let (job, key, from, to) = fuzzing::link_hello(&valid_link_hello()).unwrap();
    assert_eq!(
        (job.as_str(), key.as_str(), from, to),
        ("job-42", "g0123456789abcdef-1", 1, 0)
    );
    assert!(fuzzing::message_header(&valid_header())
        .unwrap()
        .contains("all_reduce"));
    assert_eq!(fuzzing::store_reply(&[0, 1, 2]).unwrap(), [1, 2]);
}

#[test]
fn declared_lengths_are_not_allocated() {
    // A frame announcing the whole limit, with 8 bytes of it sent.
    let liar = [&(STORE_LIMIT as u32).to_le_bytes()[..], &[1u8; 8]].concat();
    let (n, peak) = peak_of(|| fuzzing::store_requests(&liar, STORE_LIMIT));
    assert_eq!(n, 0);
    assert!(peak <= bound(&liar), "{peak} bytes for an 8-byte frame");
    // Over the limit: refused from the header alone.
    let (n, peak) = peak_of(|| fuzzing::store_requests(&u32::MAX.to_le_bytes(), STORE_LIMIT));
    assert_eq!(n, 0);
    assert!(peak < 1024, "{peak} bytes for a refused header");
    // A wait announcing 4 billion keys in a 9-byte body.
    let wait = framed(&[&[3u8][..], &u32::MAX.to_le_bytes(), &[0; 4]].concat());
    let (n, peak) = peak_of(|| fuzzing::store_requests(&wait, STORE_LIMIT));
    assert_eq!(n, 0);
    assert!(peak <= bound(&wait), "{peak}");
    // A link hello announcing a 65535-byte job id.
    let hello = [&b"XTRN\x02"[..], &u16::MAX.to_le_bytes(), b"abc"].concat();
    let (r, peak) = peak_of(|| fuzzing::link_hello(&hello));
    assert!(r.unwrap_err().contains("over the limit"));
    assert!(peak < 4096, "{peak}");
    // A reply announcing a 4 GiB error message.
    let reply = [&[2u8][..], &u32::MAX.to_le_bytes(), b"oops"].concat();
    let (r, peak) = peak_of(|| fuzzing::store_reply(&reply));
    assert!(r.unwrap_err().contains("truncated"));
    assert!(peak < 4096, "{peak}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn store_requests_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let (_, peak) = peak_of(|| fuzzing::store_requests(&bytes, STORE_LIMIT));
        prop_assert!(peak <= bound(&bytes), "{peak} bytes for {} input bytes", bytes.len());
        let (_, peak) = peak_of(|| fuzzing::store_requests(&bytes, 64));
        prop_assert!(peak <= bound(&bytes));
    }

    #[test]
    fn store_requests_from_mutated_valid_streams(e in edits(), keep in proptest::option::of(any::<usize>())) {
        let bytes = mutate(valid_store_stream(), &e, keep);
        let (_, peak) = peak_of(|| fuzzing::store_requests(&bytes, STORE_LIMIT));
        prop_assert!(peak <= bound(&bytes), "{peak} bytes for {} input bytes", bytes.len());
    }

    #[test]
    fn store_replies_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let (_, peak) = peak_of(|| fuzzing::store_reply(&bytes));
        prop_assert!(peak <= bound(&bytes));
    }

    #[test]
    fn link_hellos_from_arbitrary_and_mutated_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        e in edits(),
        keep in proptest::option::of(any::<usize>()),
    ) {
        let (_, peak) = peak_of(|| fuzzing::link_hello(&bytes));
        prop_assert!(peak <= bound(&bytes));
        let bytes = mutate(valid_link_hello(), &e, keep);
        let (_, peak) = peak_of(|| fuzzing::link_hello(&bytes));
        prop_assert!(peak <= bound(&bytes), "{peak}");
    }

    #[test]
    fn message_headers_from_arbitrary_and_mutated_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..40),
        e in edits(),
    ) {
        let (_, peak) = peak_of(|| fuzzing::message_header(&bytes));
        prop_assert!(peak <= bound(&bytes));
        let bytes = mutate(valid_header(), &e, None);
        let (_, peak) = peak_of(|| fuzzing::message_header(&bytes));
        prop_assert!(peak <= bound(&bytes));
    }
}
