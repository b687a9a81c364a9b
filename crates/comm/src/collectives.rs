//! Collectives written on top of point-to-point exchanges (`Engine::exchange`).
//!
//! Algorithms (n ranks, message of m bytes):
//! - ring all-reduce: reduce-scatter then all-gather around the ring, n−1 steps each; every
//!   rank sends 2(n−1)/n·m bytes (bandwidth-optimal). Each step's send and receive run
//!   concurrently and stream through the transport in chunks, the receiver reducing each chunk
//!   as it arrives.
//! - tree all-reduce: binomial-tree reduce to rank 0, then binomial broadcast: 2⌈log2 n⌉
//!   message latencies (best for small messages).
//! - recursive halving-doubling (Rabenseifner): with p = 2^⌊log2 n⌋, the first 2(n−p) ranks
//!   pair up and the even one folds its data into the odd one; the p survivors reduce-scatter
//!   by recursive halving and all-gather by recursive doubling (2 log2 p steps, 2(p−1)/p·m
//!   bytes), then the odd ranks hand the result back.
//!
//! Segments of a length-L buffer over n ranks follow [`shard_range`]: the first L mod n shards
//! have one extra element, so any length (0 included) works for any n.
use std::ops::Range;

use crate::arg_check;
use crate::element::{reduce_bytes, scale_avg, scale_avg_bytes, Element, ReduceOp, ScaleBytesFn};
use crate::engine::{Ctx, Engine, Incoming, Outgoing, Sink};
use crate::error::Result;
use crate::single_copy::WriteBack;
use crate::wire::OpKind;

/// All-reduce algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AllReduceAlgo {
    /// Picked by message size and group size (see [`AllReduceAlgo::choose`]).
    #[default]
    Auto,
    Ring,
    Tree,
    HalvingDoubling,
    /// Whole-vector exchanges with partners at distance 1, 2, 4, ...: the fewest message
    /// latencies (log2 n), for small messages.
    RecursiveDoubling,
}

impl std::str::FromStr for AllReduceAlgo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(AllReduceAlgo::Auto),
            "ring" => Ok(AllReduceAlgo::Ring),
            "tree" => Ok(AllReduceAlgo::Tree),
            "hd" | "halving-doubling" | "halving_doubling" => Ok(AllReduceAlgo::HalvingDoubling),
            "rd" | "recursive-doubling" | "recursive_doubling" => {
                Ok(AllReduceAlgo::RecursiveDoubling)
            }
            other => Err(format!(
                "unknown all-reduce algorithm {other:?} (ring, tree, hd, rd, auto)"
            )),
        }
    }
}

impl AllReduceAlgo {
    /// Short name, as accepted by `FromStr` (`auto`, `ring`, `tree`, `hd`, `rd`).
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgo::Auto => "auto",
            AllReduceAlgo::Ring => "ring",
            AllReduceAlgo::Tree => "tree",
            AllReduceAlgo::HalvingDoubling => "hd",
            AllReduceAlgo::RecursiveDoubling => "rd",
        }
    }
}

impl std::fmt::Display for AllReduceAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Messages up to this many bytes use recursive doubling under `Auto` (latency-bound: log2 n
/// message latencies, every rank busy each step).
pub const RD_MAX_BYTES: usize = 32 << 10;
/// Above `RD_MAX_BYTES` and up to this many bytes, groups of more than 2 ranks use the binomial
/// tree under `Auto`: measured fastest there with 3–8 ranks on 2 cores (docs/PERFORMANCE.md),
/// where every step that needs all ranks scheduled at once costs a scheduler round.
pub const TREE_MAX_BYTES: usize = 512 << 10;

impl AllReduceAlgo {
    /// The concrete algorithm `Auto` resolves to for `bytes` over `n` ranks; `single_copy`
    /// says whether ring steps of this size read the peer's buffer directly. Two such ranks
    /// use the ring, which is then one step that copies each byte once, against recursive
    /// doubling's two copies through the shared rings (all-reduce of 32 KiB: 4.6–5.2 µs against
    /// 5.8–7.2 µs, docs/PERFORMANCE.md).
    pub fn choose(self, bytes: usize, n: usize, single_copy: bool) -> AllReduceAlgo {
        match self {
            AllReduceAlgo::Auto if single_copy && n == 2 => AllReduceAlgo::Ring,
            AllReduceAlgo::Auto if bytes <= RD_MAX_BYTES => AllReduceAlgo::RecursiveDoubling,
            AllReduceAlgo::Auto if n > 2 && bytes <= TREE_MAX_BYTES => AllReduceAlgo::Tree,
            AllReduceAlgo::Auto => AllReduceAlgo::Ring,
            other => other,
        }
    }
}

/// Range of shard `i` when `len` elements are split over `n` ranks as evenly as possible
/// (the first `len % n` shards get one extra element).
pub fn shard_range(len: usize, n: usize, i: usize) -> Range<usize> {
    let (q, r) = (len / n, len % n);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

fn bytes<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn bytes_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

/// Disjoint `(&buf[a], &mut buf[b])`.
fn split_pair<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

fn reduce_sink<T: Element>(dst: &mut [T], op: ReduceOp) -> Sink<'_> {
    Sink::Reduce {
        dst: bytes_mut(dst),
        f: reduce_bytes::<T>,
        op,
    }
}

fn copy_sink<T: Element>(dst: &mut [T]) -> Sink<'_> {
    Sink::Copy(bytes_mut(dst))
}

/// Tag of a message: step within the algorithm, plus the root for rooted collectives (so
/// ranks that disagree on the root are detected).
fn tag(step: usize, root: usize) -> u32 {
    ((root as u32) << 16) | (step as u32 & 0xffff)
}

impl Engine {
    fn wrap(&self, x: usize) -> usize {
        let n = self.size();
        x % n
    }

    /// One exchange step with at most one send and one receive.
    fn step<'a>(
        &mut self,
        ctx: &Ctx,
        t: u32,
        send: Option<(usize, &'a [u8])>,
        recv: Option<(usize, Sink<'a>)>,
    ) -> Result<()> {
        let mut s: Vec<Outgoing<'a>> = send
            .into_iter()
            .map(|(p, b)| Outgoing::new(ctx, t, p, b))
            .collect();
        let mut r: Vec<Incoming<'a>> = recv
            .into_iter()
            .map(|(p, sink)| Incoming::new(ctx, t, p, sink))
            .collect();
        self.exchange(ctx, &mut s, &mut r)
    }

    fn check_root(&self, kind: OpKind, root: usize) -> Result<()> {
        arg_check::root(kind.name(), &self.desc.name, self.size(), root)
    }

    // ---------------------------------------------------------------- point-to-point

    /// Sends and receives concurrently (the batched point-to-point form). Ranks are group ranks.
    pub fn p2p<T: Element>(
        &mut self,
        sends: &[(usize, &[T])],
        recvs: &mut [(usize, &mut [T])],
        user_tag: u32,
    ) -> Result<()> {
        let ctx = self.begin(OpKind::P2p, T::DTYPE, None, 0)?;
        let dir = match (sends.is_empty(), recvs.is_empty()) {
            (false, true) => crate::flight::Dir::Send,
            (true, false) => crate::flight::Dir::Recv,
            _ => crate::flight::Dir::Both,
        };
        let peer = sends.first().map(|s| s.0).or(recvs.first().map(|r| r.0));
        let n_bytes = sends.iter().map(|s| s.1.len()).sum::<usize>()
            + recvs.iter().map(|r| r.1.len()).sum::<usize>();
        self.record_p2p(peer, dir, (n_bytes * T::DTYPE.size()) as u64);
        let mut s: Vec<Outgoing> = sends
            .iter()
            .map(|(p, b)| Outgoing::new(&ctx, user_tag, *p, bytes(b)))
            .collect();
        let mut r: Vec<Incoming> = recvs
            .iter_mut()
            .map(|(p, b)| Incoming::new(&ctx, user_tag, *p, copy_sink(b)))
            .collect();
        self.exchange(&ctx, &mut s, &mut r)
    }

    // ---------------------------------------------------------------- all-reduce family

    pub fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        algo: AllReduceAlgo,
    ) -> Result<()> {
        let ctx = self.begin(OpKind::AllReduce, T::DTYPE, Some(op), buf.len() as u64)?;
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        let bytes = std::mem::size_of_val(buf);
        let single_copy = self.single_copy.is_some_and(|min| bytes >= min);
        match algo.choose(bytes, n, single_copy) {
            AllReduceAlgo::Tree => self.tree_all_reduce(&ctx, buf, op),
            AllReduceAlgo::HalvingDoubling => self.hd_all_reduce(&ctx, buf, op, false),
            AllReduceAlgo::RecursiveDoubling => self.hd_all_reduce(&ctx, buf, op, true),
            _ => self.ring_all_reduce(&ctx, buf, op),
        }
    }

    fn ring_all_reduce<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        let sc = self.use_single_copy(std::mem::size_of_val(buf));
        let segs: Vec<Range<usize>> = (0..n).map(|i| shard_range(buf.len(), n, i)).collect();
        // Reduce-scatter leaves segment r+1 complete on rank r. With single copy its last step
        // also writes that result back into the left neighbour, so rank r then holds segments
        // r+1 and r+2 and the all-gather needs one step fewer (it receives r, r−1, …, r+3).
        let wb = sc.then_some(WriteBack {
            scale: (op == ReduceOp::Avg).then_some((scale_avg_bytes::<T> as ScaleBytesFn, n)),
        });
        self.ring_reduce_scatter(ctx, buf, &segs, op, sc, wb)?;
        let owned = segs[self.wrap(self.rank() + 1)].clone();
        if op == ReduceOp::Avg && wb.is_none() {
            scale_avg(&mut buf[owned], n);
        }
        let gather_steps = n - 1 - usize::from(wb.is_some());
        self.ring_all_gather(ctx, buf, &segs, 1, sc, gather_steps)?;
        self.ring_finish(ctx, sc)
    }

    /// One ring step: send `sb` to the right neighbour and deliver what the left one sends
    /// into `sink`, through the transport or, when `sc`, as a single-copy step.
    fn ring_step(
        &mut self,
        ctx: &Ctx,
        t: u32,
        sc: bool,
        sb: &[u8],
        sink: Sink<'_>,
        write_back: Option<WriteBack>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        if sc {
            self.sc_step(ctx, t, sb, sink, write_back)
        } else {
            debug_assert!(write_back.is_none(), "write-back needs single copy");
            self.step(
                ctx,
                t,
                Some(((r + 1) % n, sb)),
                Some(((r + n - 1) % n, sink)),
            )
        }
    }

    /// Ends a sequence of ring steps: with single-copy steps, waits until the right neighbour
    /// has read everything offered to it (so the caller's buffers may be reused or freed).
    fn ring_finish(&mut self, ctx: &Ctx, sc: bool) -> Result<()> {
        if sc {
            self.sc_finish(ctx)
        } else {
            Ok(())
        }
    }

    /// In-place ring reduce-scatter over `segs`: at step s rank r sends segment (r − s) to r+1
    /// and reduces segment (r − s − 1) from r−1 into place (straight out of the transport);
    /// afterwards rank r holds the full reduction of segment (r + 1).
    fn ring_reduce_scatter<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        segs: &[Range<usize>],
        op: ReduceOp,
        sc: bool,
        last_write_back: Option<WriteBack>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        for s in 0..n - 1 {
            let send = segs[self.wrap(r + n - s)].clone();
            let recv = segs[self.wrap(r + 2 * n - s - 1)].clone();
            let (sb, rb) = split_pair(buf, send, recv);
            let wb = last_write_back.filter(|_| s == n - 2);
            self.ring_step(ctx, tag(s, 0), sc, bytes(sb), reduce_sink(rb, op), wb)?;
        }
        Ok(())
    }

    /// Ring all-gather over `segs` when rank r starts owning segment (r + k): at step s it sends
    /// segment (r + k − s) to r+1 and receives segment (r + k − s − 1) from r−1, for the first
    /// `steps` of the n−1 steps.
    fn ring_all_gather<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        segs: &[Range<usize>],
        k: usize,
        sc: bool,
        steps: usize,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        for s in 0..steps {
            let send = segs[self.wrap(r + n + k - s)].clone();
            let recv = segs[self.wrap(r + 2 * n + k - s - 1)].clone();
            let (sb, rb) = split_pair(buf, send, recv);
            let t = tag(0x8000 + s, 0);
            self.ring_step(ctx, t, sc, bytes(sb), copy_sink(rb), None)?;
        }
        Ok(())
    }

    /// Binomial-tree reduce towards virtual rank 0 (= `root`): at level j a rank whose bit j is
    /// set sends its partial result to (vr − 2^j) and stops; otherwise it folds in (vr + 2^j).
    fn tree_reduce<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let n = self.size();
        let vr = (self.rank() + n - root) % n;
        let real = |v: usize| (v + root) % n;
        let mut mask = 1;
        let mut level = 0;
        while mask < n {
            if vr & mask != 0 {
                return self.step(
                    ctx,
                    tag(level, root),
                    Some((real(vr - mask), bytes(buf))),
                    None,
                );
            }
            if vr + mask < n {
                self.step(
                    ctx,
                    tag(level, root),
                    None,
                    Some((real(vr + mask), reduce_sink(buf, op))),
                )?;
            }
            mask <<= 1;
            level += 1;
        }
        Ok(())
    }

    /// Binomial-tree broadcast from `root`: receive from the parent (clear lowest set bit of
    /// vr), then send to all children at once.
    fn tree_broadcast<T: Element>(&mut self, ctx: &Ctx, buf: &mut [T], root: usize) -> Result<()> {
        let n = self.size();
        let vr = (self.rank() + n - root) % n;
        let real = |v: usize| (v + root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                self.step(
                    ctx,
                    tag(0x4000, root),
                    None,
                    Some((real(vr - mask), copy_sink(buf))),
                )?;
                break;
            }
            mask <<= 1;
        }
        let mut sends = Vec::new();
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                sends.push(Outgoing::new(
                    ctx,
                    tag(0x4000, root),
                    real(vr + mask),
                    bytes(buf),
                ));
            }
            mask >>= 1;
        }
        self.exchange(ctx, &mut sends, &mut [])
    }

    fn tree_all_reduce<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.tree_reduce(ctx, buf, op, 0)?;
        if op == ReduceOp::Avg && self.rank() == 0 {
            scale_avg(buf, self.size());
        }
        self.tree_broadcast(ctx, buf, 0)
    }

    /// Halving-doubling (`full = false`) or recursive doubling (`full = true`: every step
    /// exchanges the whole vector, log2 p message latencies; results are bit-identical on all
    /// ranks because each step combines the same two partial results, and + / max / min are
    /// commutative).
    fn hd_all_reduce<T: Element>(
        &mut self,
        ctx: &Ctx,
        buf: &mut [T],
        op: ReduceOp,
        full: bool,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p;
        // Fold: among the first 2·rem ranks, even ones hand their data to the next odd one.
        let fold = tag(0x2000, 0);
        let new_rank = if r < 2 * rem {
            if r % 2 == 0 {
                self.step(ctx, fold, Some((r + 1, bytes(buf))), None)?;
                None
            } else {
                self.step(ctx, fold, None, Some((r - 1, reduce_sink(buf, op))))?;
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        if let (Some(v), true) = (new_rank, full) {
            let mut mine = buf.to_vec();
            let mut d = 1;
            while d < p {
                let partner = real(v ^ d);
                mine.copy_from_slice(buf);
                let t = tag(0x1800 + d.trailing_zeros() as usize, 0);
                self.step(
                    ctx,
                    t,
                    Some((partner, bytes(&mine))),
                    Some((partner, reduce_sink(buf, op))),
                )?;
                d *= 2;
            }
            if op == ReduceOp::Avg {
                scale_avg(buf, n);
            }
        } else if let Some(v) = new_rank {
            // Recursive halving: keep the half on my side of bit d, send the other half.
            let mut lo = 0;
            let mut hi = buf.len();
            let mut d = p / 2;
            let mut step = 0;
            let mut ranges = Vec::new();
            while d > 0 {
                let mid = lo + (hi - lo) / 2;
                let (keep, give) = if v & d == 0 {
                    (lo..mid, mid..hi)
                } else {
                    (mid..hi, lo..mid)
                };
                let partner = real(v ^ d);
                let (sb, rb) = split_pair(buf, give.clone(), keep.clone());
                self.step(
                    ctx,
                    tag(step, 0),
                    Some((partner, bytes(sb))),
                    Some((partner, reduce_sink(rb, op))),
                )?;
                ranges.push((give, keep.clone()));
                (lo, hi) = (keep.start, keep.end);
                d /= 2;
                step += 1;
            }
            if op == ReduceOp::Avg {
                scale_avg(&mut buf[lo..hi], n);
            }
            // Recursive doubling: undo the halving, exchanging completed halves.
            let mut d = 1;
            while let Some((give, keep)) = ranges.pop() {
                let partner = real(v ^ d);
                let (sb, rb) = split_pair(buf, keep, give);
                self.step(
                    ctx,
                    tag(0x1000 + step, 0),
                    Some((partner, bytes(sb))),
                    Some((partner, copy_sink(rb))),
                )?;
                d *= 2;
                step += 1;
            }
        }
        // Unfold: odd ranks return the result to their even partner.
        let unfold = tag(0x3000, 0);
        if r < 2 * rem {
            if r % 2 == 0 {
                self.step(ctx, unfold, None, Some((r + 1, copy_sink(buf))))?;
            } else {
                self.step(ctx, unfold, Some((r - 1, bytes(buf))), None)?;
            }
        }
        Ok(())
    }

    pub fn reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root(OpKind::Reduce, root)?;
        let ctx = self.begin(OpKind::Reduce, T::DTYPE, Some(op), buf.len() as u64)?;
        if self.rank() == root {
            self.tree_reduce(&ctx, buf, op, root)?;
            if op == ReduceOp::Avg {
                scale_avg(buf, self.size());
            }
            Ok(())
        } else {
            // Non-roots keep their input intact: partial sums go through a scratch copy.
            let mut scratch = buf.to_vec();
            self.tree_reduce(&ctx, &mut scratch, op, root)
        }
    }

    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(OpKind::Broadcast, root)?;
        let ctx = self.begin(OpKind::Broadcast, T::DTYPE, None, buf.len() as u64)?;
        self.tree_broadcast(&ctx, buf, root)
    }

    /// Reduces `input` (same length on every rank) and leaves shard `rank` (see [`shard_range`])
    /// in `output`.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        arg_check::reduce_scatter(n, r, input.len(), output.len())?;
        let mine = shard_range(input.len(), n, r);
        let ctx = self.begin(
            OpKind::ReduceScatter,
            T::DTYPE,
            Some(op),
            input.len() as u64,
        )?;
        // Out of place (the input stays untouched, nothing of its size is allocated): at step s
        // rank r sends its partial of segment (r − s − 1) — its own input at s = 0 — and builds
        // the partial of segment (r − s − 2) = own input op what arrives (written only while
        // receiving, so a single-copy reader of the other scratch is never disturbed); the last
        // one is its shard.
        let segs: Vec<Range<usize>> = (0..n).map(|i| shard_range(input.len(), n, i)).collect();
        let sc = self.use_single_copy(std::mem::size_of_val(input));
        let most = if n > 2 { segs[0].len() } else { 0 };
        let (mut prev, mut cur) = (vec![T::zeroed(); most], vec![T::zeroed(); most]);
        if n == 1 {
            output.copy_from_slice(&input[mine]);
        }
        for s in 0..n.saturating_sub(1) {
            let seg = segs[(r + 2 * n - s - 2) % n].clone();
            let dst: &mut [T] = if s == n - 2 {
                &mut *output
            } else {
                &mut cur[..seg.len()]
            };
            let send = if s == 0 {
                &input[segs[(r + n - 1) % n].clone()]
            } else {
                &prev[..segs[(r + 2 * n - s - 1) % n].len()]
            };
            let sink = Sink::ReduceInto {
                dst: bytes_mut(dst),
                base: bytes(&input[seg]),
                f: reduce_bytes::<T>,
                op,
            };
            self.ring_step(&ctx, tag(s, 0), sc, bytes(send), sink, None)?;
            std::mem::swap(&mut prev, &mut cur);
        }
        self.ring_finish(&ctx, sc)?;
        if op == ReduceOp::Avg {
            scale_avg(output, n);
        }
        Ok(())
    }

    /// `output[i·m..(i+1)·m] = input of rank i`, m = `input.len()` (equal on all ranks).
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let (n, r, m) = (self.size(), self.rank(), input.len());
        arg_check::all_gather(n, m, output.len())?;
        let ctx = self.begin(OpKind::AllGather, T::DTYPE, None, m as u64)?;
        output[r * m..(r + 1) * m].copy_from_slice(input);
        let segs: Vec<Range<usize>> = (0..n).map(|i| i * m..(i + 1) * m).collect();
        let sc = self.use_single_copy(std::mem::size_of_val(output));
        self.ring_all_gather(&ctx, output, &segs, 0, sc, n - 1)?;
        self.ring_finish(&ctx, sc)
    }

    /// All-gather of per-rank inputs of different lengths: returns the concatenation in rank
    /// order and each rank's length.
    pub fn all_gather_v<T: Element>(&mut self, input: &[T]) -> Result<(Vec<T>, Vec<usize>)> {
        self.all_gather_v_to(input, |total| Ok(vec![T::zeroed(); total]))
    }

    /// [`Engine::all_gather_v`] into `output`, which must hold the sum of the ranks' lengths;
    /// returns the lengths.
    pub fn all_gather_v_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<Vec<usize>> {
        let held = output.len();
        let fits = |total| arg_check::received_into("all_gather_v", held, total).map(|_| output);
        self.all_gather_v_to(input, fits).map(|(_, counts)| counts)
    }

    /// All-gather-v into the buffer `output` makes for the total length (phase 1 exchanges
    /// the lengths). Where `output` refuses (a wrong length), the data still goes round the
    /// ring through a scratch buffer, so the other ranks finish, and then the refusal is
    /// returned.
    fn all_gather_v_to<T: Element, O: AsMut<[T]>>(
        &mut self,
        input: &[T],
        output: impl FnOnce(usize) -> Result<O>,
    ) -> Result<(O, Vec<usize>)> {
        let (n, r) = (self.size(), self.rank());
        let ctx = self.begin(OpKind::AllGatherV, T::DTYPE, None, 0)?;
        // Phase 1: lengths (as u64) around the ring; phase 2: data with those segments.
        let mut counts = vec![0i64; n];
        counts[r] = input.len() as i64;
        let unit: Vec<Range<usize>> = (0..n).map(|i| i..i + 1).collect();
        let count_ctx = Ctx {
            dtype: crate::element::DType::I64,
            ..ctx
        };
        self.ring_all_gather(&count_ctx, &mut counts, &unit, 0, false, n - 1)?;
        let counts: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
        let mut offs = vec![0usize; n + 1];
        for i in 0..n {
            offs[i + 1] = offs[i] + counts[i];
        }
        let mut made = output(offs[n]);
        let mut scratch = Vec::new();
        let out: &mut [T] = match &mut made {
            Ok(o) => o.as_mut(),
            Err(_) => {
                scratch = vec![T::zeroed(); offs[n]];
                &mut scratch
            }
        };
        out[offs[r]..offs[r + 1]].copy_from_slice(input);
        let segs: Vec<Range<usize>> = (0..n).map(|i| offs[i]..offs[i + 1]).collect();
        let data_ctx = Ctx { count: 1, ..ctx };
        let sc = self.use_single_copy(std::mem::size_of_val(&out[..]));
        self.ring_all_gather(&data_ctx, out, &segs, 0, sc, n - 1)?;
        self.ring_finish(&data_ctx, sc)?;
        drop(scratch);
        Ok((made?, counts))
    }

    /// Root receives every rank's `input` (equal lengths) into `output` (n × len, root only).
    pub fn gather<T: Element>(
        &mut self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.check_root(OpKind::Gather, root)?;
        let (n, r, m) = (self.size(), self.rank(), input.len());
        let ctx = self.begin(OpKind::Gather, T::DTYPE, None, m as u64)?;
        if r != root {
            return self.step(&ctx, tag(0, root), Some((root, bytes(input))), None);
        }
        let out = arg_check::root_blocks("gather", "output", n, m, output)?;
        let mut recvs = Vec::with_capacity(n - 1);
        let mut rest = out;
        for i in 0..n {
            let (block, tail) = rest.split_at_mut(m);
            rest = tail;
            if i == r {
                block.copy_from_slice(input);
            } else {
                recvs.push(Incoming::new(&ctx, tag(0, root), i, copy_sink(block)));
            }
        }
        self.exchange(&ctx, &mut [], &mut recvs)
    }

    /// Root sends block i of `input` (n × len, root only) to rank i, which receives `output`.
    pub fn scatter<T: Element>(
        &mut self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(OpKind::Scatter, root)?;
        let (n, r, m) = (self.size(), self.rank(), output.len());
        let ctx = self.begin(OpKind::Scatter, T::DTYPE, None, m as u64)?;
        if r != root {
            return self.step(&ctx, tag(0, root), None, Some((root, copy_sink(output))));
        }
        let inp = arg_check::root_blocks("scatter", "input", n, m, input)?;
        output.copy_from_slice(&inp[r * m..(r + 1) * m]);
        let mut sends: Vec<Outgoing> = (0..n)
            .filter(|&i| i != r)
            .map(|i| Outgoing::new(&ctx, tag(0, root), i, bytes(&inp[i * m..(i + 1) * m])))
            .collect();
        self.exchange(&ctx, &mut sends, &mut [])
    }

    /// Block i of `input` goes to rank i; block j of `output` comes from rank j (equal blocks).
    pub fn all_to_all<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = self.size();
        arg_check::all_to_all(n, input.len(), output.len())?;
        let ctx = self.begin(OpKind::AllToAll, T::DTYPE, None, input.len() as u64)?;
        let counts = vec![input.len() / n; n];
        self.all_to_all_blocks(&ctx, input, &counts, output, &counts)
    }

    /// Sends `send_counts[i]` consecutive elements of `input` to rank i; returns what every
    /// rank sent here, concatenated in rank order, and the per-rank counts.
    pub fn all_to_all_v<T: Element>(
        &mut self,
        input: &[T],
        send_counts: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>)> {
        self.all_to_all_v_to(input, send_counts, |total| Ok(vec![T::zeroed(); total]))
    }

    /// [`Engine::all_to_all_v`] into `output`, which must hold the sum of what the ranks send
    /// here; returns the per-rank counts.
    pub fn all_to_all_v_into<T: Element>(
        &mut self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
    ) -> Result<Vec<usize>> {
        let held = output.len();
        let fits = |total| arg_check::received_into("all_to_all_v", held, total).map(|_| output);
        self.all_to_all_v_to(input, send_counts, fits)
            .map(|(_, counts)| counts)
    }

    /// All-to-all-v into the buffer `output` makes for the received total (the counts are
    /// exchanged first). Where `output` refuses, the data still moves through a scratch
    /// buffer, so the other ranks finish, and then the refusal is returned.
    fn all_to_all_v_to<T: Element, O: AsMut<[T]>>(
        &mut self,
        input: &[T],
        send_counts: &[usize],
        output: impl FnOnce(usize) -> Result<O>,
    ) -> Result<(O, Vec<usize>)> {
        let n = self.size();
        arg_check::all_to_all_v(n, input.len(), send_counts)?;
        let ctx = self.begin(OpKind::AllToAllV, T::DTYPE, None, 0)?;
        let sc: Vec<i64> = send_counts.iter().map(|&c| c as i64).collect();
        let mut rc = vec![0i64; n];
        let ones = vec![1usize; n];
        let count_ctx = Ctx {
            dtype: crate::element::DType::I64,
            ..ctx
        };
        self.all_to_all_blocks(&count_ctx, &sc, &ones, &mut rc, &ones)?;
        let recv_counts: Vec<usize> = rc.iter().map(|&c| c as usize).collect();
        let total = recv_counts.iter().sum();
        let mut made = output(total);
        let mut scratch = Vec::new();
        let out: &mut [T] = match &mut made {
            Ok(o) => o.as_mut(),
            Err(_) => {
                scratch = vec![T::zeroed(); total];
                &mut scratch
            }
        };
        self.all_to_all_blocks(
            &Ctx { count: 1, ..ctx },
            input,
            send_counts,
            out,
            &recv_counts,
        )?;
        drop(scratch);
        Ok((made?, recv_counts))
    }

    /// All pairwise transfers of an all-to-all at once (the engine interleaves them).
    fn all_to_all_blocks<T: Element>(
        &mut self,
        ctx: &Ctx,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let offsets = |c: &[usize]| {
            let mut o = vec![0usize; n + 1];
            for i in 0..n {
                o[i + 1] = o[i] + c[i];
            }
            o
        };
        let so = offsets(send_counts);
        let mut outs: Vec<&mut [T]> = Vec::with_capacity(n);
        let mut rest = output;
        for &c in recv_counts {
            let (head, tail) = rest.split_at_mut(c);
            outs.push(head);
            rest = tail;
        }
        let mut recvs = Vec::with_capacity(n);
        for (i, o) in outs.into_iter().enumerate() {
            if i == r {
                o.copy_from_slice(&input[so[r]..so[r + 1]]);
            } else {
                recvs.push(Incoming::new(ctx, tag(0, 0), i, copy_sink(o)));
            }
        }
        // Send order (r+1, r+2, ...) spreads load so not every rank feeds rank 0 first.
        let mut sends: Vec<Outgoing> = (1..n)
            .map(|k| (r + k) % n)
            .map(|i| Outgoing::new(ctx, tag(0, 0), i, bytes(&input[so[i]..so[i + 1]])))
            .collect();
        self.exchange(ctx, &mut sends, &mut recvs)
    }

    pub fn barrier(&mut self) -> Result<()> {
        let ctx = self.begin(OpKind::Barrier, crate::element::DType::U8, None, 0)?;
        if self.size() > 1 {
            self.tree_all_reduce::<u8>(&ctx, &mut [], ReduceOp::Max)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_in_order_and_differ_by_at_most_one() {
        for len in [0, 1, 5, 7, 16, 1031] {
            for n in 1..=8 {
                let shards: Vec<Range<usize>> = (0..n).map(|i| shard_range(len, n, i)).collect();
                assert_eq!(shards[0].start, 0);
                assert_eq!(shards[n - 1].end, len);
                assert!(shards.windows(2).all(|w| w[0].end == w[1].start));
                let (lo, hi) = (len / n, len.div_ceil(n));
                assert!(shards.iter().all(|s| s.len() == lo || s.len() == hi));
            }
        }
    }

    #[test]
    fn auto_picks_by_size_and_group_size() {
        use AllReduceAlgo::*;
        assert_eq!(Auto.choose(4096, 2, false), RecursiveDoubling);
        assert_eq!(
            Auto.choose(RD_MAX_BYTES, 2, true),
            Ring,
            "2 ranks, single copy"
        );
        assert_eq!(Auto.choose(RD_MAX_BYTES, 4, true), RecursiveDoubling);
        assert_eq!(Auto.choose(RD_MAX_BYTES + 4, 4, false), Tree);
        assert_eq!(Auto.choose(RD_MAX_BYTES + 4, 2, false), Ring);
        assert_eq!(Auto.choose(TREE_MAX_BYTES + 4, 8, true), Ring);
        assert_eq!(Ring.choose(4, 8, false), Ring);
        assert_eq!(
            RecursiveDoubling.choose(1 << 20, 2, true),
            RecursiveDoubling
        );
        for a in [Auto, Ring, Tree, HalvingDoubling, RecursiveDoubling] {
            assert_eq!(a.name().parse::<AllReduceAlgo>().unwrap(), a);
        }
        assert!("fastest".parse::<AllReduceAlgo>().is_err());
    }
}
