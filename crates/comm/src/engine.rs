//! The progress engine: one per group per rank, owning the links to every peer of the group.
//!
//! `exchange` drives any set of sends and receives concurrently to completion (this is what
//! makes ring shifts, where every rank sends and receives at once, deadlock-free), enforcing
//! the deadline and turning transport failures into errors that name the peer, the group and
//! the operation. Idle waiting spins briefly (configurable), yields, then sleeps on the shared
//! memory doorbell futex or in `poll(2)` for TCP sockets.
//!
//! After any error the engine closes all its links ("abort"), so peers fail promptly instead
//! of waiting for their own timeouts, and refuses further operations.
//!
//! Every operation is logged in the rank's [flight recorder](crate::flight) (begin here, end
//! in [`Engine::end_op`]); a wait that times out, or whose peer's heartbeat stopped
//! ([`crate::monitor`]), fails with a [diagnosis](crate::diagnosis) built from every rank's
//! record.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::diagnosis::{diagnose, Stuck};
use crate::element::{DType, ReduceBytesFn, ReduceOp};
use crate::error::{CommError, Result};
use crate::flight::{Dir, OpInfo};
use crate::monitor::Monitor;
use crate::store::Store;
use crate::transport::shm::Segment;
use crate::transport::{Link, LinkError, OutMsg, RecvReject};
use crate::wire::{Header, OpKind, HEADER_LEN};

/// The shortest spin budget [`Engine::adapt_spin`] goes down to: long enough to see a message
/// that is already on its way, so that a budget can grow again when the peer has its own core.
const MIN_SPIN: Duration = Duration::from_micros(1);

/// The spin budget after a wait that spun out (halve) or ended while spinning (double), kept
/// within [`MIN_SPIN`] and `max` (the configured budget; zero turns spinning off but for the
/// floor).
fn next_spin(spin: Duration, max: Duration, spun_out: bool) -> Duration {
    if spun_out {
        (spin / 2).max(MIN_SPIN)
    } else {
        (spin * 2).clamp(MIN_SPIN, max.max(MIN_SPIN))
    }
}

/// Names and ranks of a group (shared by the engine and the public handle).
#[derive(Debug)]
pub(crate) struct GroupDesc {
    /// e.g. `world[0,1,2,3]` or `dp[0,2]`.
    pub name: String,
    /// World rank of each group rank.
    pub world_ranks: Vec<usize>,
    /// This rank's index in the group.
    pub rank: usize,
}

/// Per-group counters, per [`OpKind`].
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub ops: [AtomicU64; 12],
    pub bytes: [AtomicU64; 12],
}

/// Tunables the engine needs.
#[derive(Clone, Debug)]
pub(crate) struct EngineConfig {
    pub timeout: Duration,
    pub spin: Duration,
}

/// Context of one operation: what goes into headers and error messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub kind: OpKind,
    pub dtype: DType,
    pub op: u8,
    pub seq: u32,
    pub count: u64,
    pub deadline: Instant,
}

impl Ctx {
    pub fn header(&self, tag: u32, payload_len: usize) -> Header {
        Header {
            kind: self.kind,
            dtype: self.dtype,
            op: self.op,
            seq: self.seq,
            tag,
            count: self.count,
            payload_len: payload_len as u64,
        }
    }
}

/// Where received payload bytes go.
pub(crate) enum Sink<'a> {
    /// `dst = received`.
    Copy(&'a mut [u8]),
    /// `dst = dst op received`.
    Reduce {
        dst: &'a mut [u8],
        f: ReduceBytesFn,
        op: ReduceOp,
    },
    /// `dst = base op received` (out-of-place: `dst` is not read, so it needs no prior copy).
    ReduceInto {
        dst: &'a mut [u8],
        base: &'a [u8],
        f: ReduceBytesFn,
        op: ReduceOp,
    },
}

impl Sink<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Sink::Copy(d) | Sink::Reduce { dst: d, .. } | Sink::ReduceInto { dst: d, .. } => {
                d.len()
            }
        }
    }

    /// The destination bytes.
    pub(crate) fn dst(&mut self) -> &mut [u8] {
        match self {
            Sink::Copy(d) | Sink::Reduce { dst: d, .. } | Sink::ReduceInto { dst: d, .. } => d,
        }
    }

    /// Delivers `bytes`, the received bytes `[offset, offset + bytes.len())` of the payload.
    pub(crate) fn accept(&mut self, offset: usize, bytes: &[u8]) {
        let range = offset..offset + bytes.len();
        match self {
            Sink::Copy(d) => d[range].copy_from_slice(bytes),
            Sink::Reduce { dst, f, op } => f(&mut dst[range], bytes, *op),
            Sink::ReduceInto { dst, base, f, op } => {
                dst[range.clone()].copy_from_slice(&base[range.clone()]);
                f(&mut dst[range], bytes, *op)
            }
        }
    }
}

/// A send in progress.
pub(crate) struct Outgoing<'a> {
    pub peer: usize,
    msg: OutMsg<'a>,
    done: bool,
    /// Whether the payload counts in the bytes-sent counters (not for control messages).
    counted: bool,
}

impl<'a> Outgoing<'a> {
    pub fn new(ctx: &Ctx, tag: u32, peer: usize, payload: &'a [u8]) -> Self {
        let hdr = ctx.header(tag, payload.len()).encode();
        Outgoing {
            peer,
            msg: OutMsg::new(hdr, payload),
            done: false,
            counted: true,
        }
    }

    /// A control message (e.g. a single-copy offer): not counted as data sent.
    pub fn control(ctx: &Ctx, tag: u32, peer: usize, payload: &'a [u8]) -> Self {
        Outgoing {
            counted: false,
            ..Self::new(ctx, tag, peer, payload)
        }
    }
}

/// A receive in progress: header bytes, then payload delivered to the sink.
pub(crate) struct Incoming<'a> {
    pub peer: usize,
    expect: Header,
    sink: Sink<'a>,
    hdr: [u8; HEADER_LEN],
    got_hdr: usize,
    /// Padded payload bytes consumed so far (valid once the header is in).
    consumed: usize,
    done: bool,
}

impl<'a> Incoming<'a> {
    pub fn new(ctx: &Ctx, tag: u32, peer: usize, sink: Sink<'a>) -> Self {
        let expect = ctx.header(tag, sink.len());
        Incoming {
            peer,
            expect,
            sink,
            hdr: [0; HEADER_LEN],
            got_hdr: 0,
            consumed: 0,
            done: false,
        }
    }

    /// Consumes a prefix of `region` (a multiple of 8 bytes) belonging to this message.
    fn consume(&mut self, region: &[u8]) -> std::result::Result<usize, RecvReject> {
        let usable = region.len() & !7;
        let mut used = 0;
        if self.got_hdr < HEADER_LEN {
            let take = (HEADER_LEN - self.got_hdr).min(usable);
            self.hdr[self.got_hdr..self.got_hdr + take].copy_from_slice(&region[..take]);
            self.got_hdr += take;
            used = take;
            if self.got_hdr < HEADER_LEN {
                return Ok(used);
            }
            let h = Header::decode(&self.hdr).map_err(RecvReject::Malformed)?;
            self.check(&h)?;
        }
        let payload = self.expect.payload_len as usize;
        let padded = payload.next_multiple_of(8);
        let take = (padded - self.consumed).min(usable - used);
        let real_end = (self.consumed + take).min(payload);
        if real_end > self.consumed {
            self.sink.accept(
                self.consumed,
                &region[used..used + real_end - self.consumed],
            );
        }
        self.consumed += take;
        used += take;
        if self.consumed == padded {
            self.done = true;
        }
        Ok(used)
    }

    fn check(&self, h: &Header) -> std::result::Result<(), RecvReject> {
        let e = &self.expect;
        let same = h.kind == e.kind
            && h.dtype == e.dtype
            && h.op == e.op
            && h.seq == e.seq
            && h.tag == e.tag
            && h.count == e.count
            && h.payload_len == e.payload_len;
        if same {
            Ok(())
        } else {
            Err(RecvReject::Mismatch(format!(
                "this rank expected {}, the peer sent {}",
                e.describe(),
                h.describe()
            )))
        }
    }
}

/// One rank's connections within one group.
pub(crate) struct Engine {
    pub desc: Arc<GroupDesc>,
    links: Vec<Option<Link>>,
    /// The group's shared-memory segment on this host and this rank's index in it.
    shm: Option<(Arc<Segment>, usize)>,
    seq: u32,
    pub config: EngineConfig,
    /// How long an idle wait spins before yielding and then sleeping; adapts between
    /// [`MIN_SPIN`] and `config.spin` (see [`Engine::adapt_spin`]).
    spin: Duration,
    poisoned: Option<String>,
    pub counters: Arc<Counters>,
    /// Single-copy ring steps (`crate::single_copy`) for collectives of at least this many
    /// bytes; `None` when the group cannot or may not use them.
    pub single_copy: Option<usize>,
    /// Piece buffer of single-copy reductions (u64 for 8-byte alignment).
    pub scratch: Vec<u64>,
    /// Where aborting ranks post their reason (`<prefix>/<group rank>`), so peers that see the
    /// connection close can report the original cause.
    abort_board: Option<(Arc<dyn Store>, String)>,
    /// The rank's monitor (flight recorder, heartbeat) and this group's index in it.
    pub monitor: Option<(Arc<Monitor>, usize)>,
    /// Point-to-point operations issued (their numbers in the flight record).
    p2p_seq: u64,
    /// Flight-record id of the operation in progress (0: none).
    current_op: u64,
}

impl Engine {
    pub fn new(
        desc: Arc<GroupDesc>,
        links: Vec<Option<Link>>,
        shm: Option<(Arc<Segment>, usize)>,
        config: EngineConfig,
        counters: Arc<Counters>,
        abort_board: Option<(Arc<dyn Store>, String)>,
    ) -> Self {
        Engine {
            desc,
            links,
            shm,
            seq: 0,
            spin: config.spin,
            config,
            poisoned: None,
            counters,
            single_copy: None,
            scratch: Vec::new(),
            abort_board,
            monitor: None,
            p2p_seq: 0,
            current_op: 0,
        }
    }

    pub fn rank(&self) -> usize {
        self.desc.rank
    }

    pub fn size(&self) -> usize {
        self.desc.world_ranks.len()
    }

    /// Starts an operation: checks the group is usable, counts it and builds its context.
    pub fn begin(
        &mut self,
        kind: OpKind,
        dtype: DType,
        op: Option<ReduceOp>,
        count: u64,
    ) -> Result<Ctx> {
        if let Some(first) = &self.poisoned {
            return Err(CommError::Poisoned {
                group: self.desc.name.clone(),
                first: first.clone(),
            });
        }
        self.counters.ops[kind.index()].fetch_add(1, Ordering::Relaxed);
        let seq = if kind == OpKind::P2p {
            self.p2p_seq += 1;
            0 // point-to-point order is per link (FIFO), not per group
        } else {
            self.seq = self.seq.wrapping_add(1);
            self.seq
        };
        if let Some((m, gid)) = &self.monitor {
            let info = OpInfo {
                kind,
                seq: if kind == OpKind::P2p {
                    self.p2p_seq
                } else {
                    seq as u64
                },
                bytes: count * dtype.size() as u64,
                peer: None,
                dir: Dir::None,
            };
            self.current_op = m.recorder.begin(*gid, info);
        }
        Ok(Ctx {
            kind,
            dtype,
            op: op.map_or(0, |o| o as u8),
            seq,
            count,
            deadline: Instant::now() + self.config.timeout,
        })
    }

    /// Completes the flight record of a point-to-point operation just begun: its first peer
    /// (group rank), direction and bytes.
    pub(crate) fn record_p2p(&self, peer: Option<usize>, dir: Dir, bytes: u64) {
        if let Some((m, _)) = &self.monitor {
            let peer = peer.map(|p| self.desc.world_ranks.get(p).copied().unwrap_or(p));
            m.recorder.set_p2p(self.current_op, peer, dir, bytes);
        }
    }

    /// Records the end of the operation begun last (called once it returned).
    pub(crate) fn end_op(&mut self, ok: bool) {
        if let Some((m, gid)) = &self.monitor {
            if self.current_op != 0 {
                m.recorder.end(*gid, self.current_op, ok);
            }
        }
        self.current_op = 0;
    }

    /// The diagnosis of a wait in `ctx` on group ranks `waiting`, from every rank's record.
    fn diagnosis(&self, ctx: &Ctx, waiting: &[usize]) -> String {
        let Some((m, _)) = &self.monitor else {
            return String::new();
        };
        let stuck = Stuck {
            me: self.desc.world_ranks[self.desc.rank],
            group: self.desc.name.clone(),
            kind: ctx.kind,
            seq: self.op_number(ctx),
            waiting_on: waiting.iter().map(|&p| self.desc.world_ranks[p]).collect(),
        };
        format!("\n  diagnosis: {}", diagnose(&stuck, &m.gather()))
    }

    /// Drives all `sends` and `recvs` to completion. Several operations with the same peer and
    /// direction complete in list order.
    pub fn exchange(
        &mut self,
        ctx: &Ctx,
        sends: &mut [Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        if let Some(first) = &self.poisoned {
            return Err(CommError::Poisoned {
                group: self.desc.name.clone(),
                first: first.clone(),
            });
        }
        // Argument errors leave the links untouched; failures after this abort the group.
        let n = self.size();
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
        {
            if p >= n || self.links[p].is_none() {
                return Err(CommError::invalid(
                    ctx.kind.name(),
                    format!(
                        "peer {p} is not another rank of group {} (size {n})",
                        self.desc.name
                    ),
                ));
            }
        }
        let result = self.exchange_inner(ctx, sends, recvs);
        if let Err(e) = &result {
            self.abort(e.to_string());
        }
        result
    }

    /// Closes every link and refuses further operations.
    pub fn abort(&mut self, reason: String) {
        if self.poisoned.is_none() {
            tracing::debug!(group = %self.desc.name, "aborting group: {reason}");
            if let Some((store, prefix)) = &self.abort_board {
                let _ = store.set(&format!("{prefix}/{}", self.desc.rank), reason.as_bytes());
            }
            self.poisoned = Some(reason);
        }
        for link in self.links.iter_mut().flatten() {
            link.close();
        }
    }

    /// Adds `bytes` of payload to the bytes-sent counter of `ctx`'s operation kind.
    pub(crate) fn count_sent(&self, ctx: &Ctx, bytes: usize) {
        self.counters.bytes[ctx.kind.index()].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn err_for(&self, ctx: &Ctx, peer: usize, e: LinkError) -> CommError {
        let group = self.desc.name.clone();
        let op = ctx.kind.name().to_string();
        let rank = self.desc.world_ranks[peer];
        match e {
            LinkError::Closed => {
                let cause = self
                    .abort_board
                    .as_ref()
                    .and_then(|(store, prefix)| {
                        store.get(&format!("{prefix}/{peer}"), Duration::ZERO).ok()
                    })
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                CommError::PeerClosed {
                    group,
                    op,
                    rank,
                    cause,
                }
            }
            LinkError::Rejected(RecvReject::Mismatch(detail)) => CommError::Mismatch {
                group,
                op,
                rank,
                detail,
            },
            LinkError::Rejected(RecvReject::Malformed(detail)) => CommError::Malformed {
                group,
                op,
                rank,
                detail,
            },
            LinkError::Io(source) => {
                CommError::io(format!("{op} on group {group} with rank {rank}"), source)
            }
        }
    }

    /// The number of `ctx`'s operation in its flight record.
    fn op_number(&self, ctx: &Ctx) -> u64 {
        match ctx.kind {
            OpKind::P2p => self.p2p_seq,
            _ => ctx.seq as u64,
        }
    }

    /// Records on the board which group ranks this rank is stuck waiting for.
    fn post_waiting(&self, peers: &[usize]) {
        if let Some((store, prefix)) = &self.abort_board {
            let list: Vec<String> = peers
                .iter()
                .map(|&p| self.desc.world_ranks[p].to_string())
                .collect();
            let _ = store.set(
                &format!("{prefix}/wait/{}", self.desc.rank),
                list.join(",").as_bytes(),
            );
        }
    }

    /// " (rank X is itself waiting for rank(s) [..])" for every waited-on peer that posted.
    fn waiting_note(&self, peers: &[usize]) -> String {
        let Some((store, prefix)) = &self.abort_board else {
            return String::new();
        };
        let mut note = String::new();
        for &p in peers {
            if let Ok(v) = store.get(&format!("{prefix}/wait/{p}"), Duration::ZERO) {
                let me = self.desc.world_ranks[self.desc.rank].to_string();
                let theirs: Vec<String> = String::from_utf8_lossy(&v)
                    .split(',')
                    .filter(|r| *r != me)
                    .map(String::from)
                    .collect();
                if !theirs.is_empty() {
                    note += &format!(
                        " (rank {} is itself waiting for rank(s) [{}])",
                        self.desc.world_ranks[p],
                        theirs.join(", ")
                    );
                }
            }
        }
        note
    }

    fn exchange_inner(
        &mut self,
        ctx: &Ctx,
        sends: &mut [Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        let n = self.size();
        let mut busy = vec![false; n];
        let mut idle_since: Option<Instant> = None;
        let mut posted_wait = false;
        let mut idle_rounds = 0u32;
        let mut spun_out = false;
        loop {
            let seen = self.shm.as_ref().map(|(seg, me)| seg.doorbell(*me));
            let mut progress = false;
            let mut all_done = true;
            busy.fill(false);
            for s in sends.iter_mut().filter(|s| !s.done) {
                if std::mem::replace(&mut busy[s.peer], true) {
                    all_done = false;
                    continue;
                }
                let link = self.links[s.peer].as_mut().expect("checked above");
                let wrote = link.try_write(&mut s.msg);
                let wrote = wrote.map_err(|e| self.err_for(ctx, s.peer, e))?;
                progress |= wrote > 0;
                if s.msg.remaining() == 0 {
                    s.done = true;
                    if s.counted {
                        self.count_sent(ctx, s.msg.payload_len());
                    }
                } else {
                    all_done = false;
                }
            }
            busy.fill(false);
            for r in recvs.iter_mut().filter(|r| !r.done) {
                if std::mem::replace(&mut busy[r.peer], true) {
                    all_done = false;
                    continue;
                }
                let link = self.links[r.peer].as_mut().expect("checked above");
                let got = link.try_read(&mut |region| r.consume(region));
                let got = got.map_err(|e| self.err_for(ctx, r.peer, e))?;
                progress |= got > 0;
                all_done &= r.done;
            }
            if all_done {
                if idle_rounds > 0 {
                    self.adapt_spin(spun_out);
                }
                return Ok(());
            }
            if progress {
                idle_since = None;
                continue;
            }
            // Idle: spin briefly, then yield for as long again, then sleep. (The clock is read
            // every 16th idle round only: it costs more than a poll of the rings.)
            idle_rounds += 1;
            if idle_since.is_some() && !idle_rounds.is_multiple_of(16) {
                for _ in 0..8 {
                    std::hint::spin_loop();
                }
                continue;
            }
            let now = Instant::now();
            let idle = now.duration_since(*idle_since.get_or_insert(now));
            if idle < self.spin {
                continue;
            }
            spun_out = true;
            if idle < self.spin * 2 {
                std::thread::yield_now();
                continue;
            }
            // At the deadline, post whom we wait for and linger a little, so that if a peer we
            // wait on is itself stuck on a third rank, the error can say so (naming the origin).
            let grace = (self.config.timeout / 4).min(Duration::from_secs(2));
            if now >= ctx.deadline {
                let mut waiting: Vec<usize> = sends
                    .iter()
                    .filter(|s| !s.done)
                    .map(|s| s.peer)
                    .chain(recvs.iter().filter(|r| !r.done).map(|r| r.peer))
                    .collect();
                waiting.sort_unstable();
                waiting.dedup();
                if !posted_wait {
                    posted_wait = true;
                    self.post_waiting(&waiting);
                    // The others' diagnoses read this record after the grace period.
                    if let Some((m, _)) = &self.monitor {
                        m.publish();
                    }
                }
                if now >= ctx.deadline + grace {
                    return Err(CommError::Timeout {
                        group: self.desc.name.clone(),
                        op: ctx.kind.name().to_string(),
                        ranks: waiting.iter().map(|&p| self.desc.world_ranks[p]).collect(),
                        timeout: self.config.timeout,
                        note: self.waiting_note(&waiting) + &self.diagnosis(ctx, &waiting),
                    });
                }
            }
            let nap = (ctx.deadline + grace)
                .saturating_duration_since(now)
                .min(Duration::from_millis(50));
            self.sleep(sends, recvs, seen, nap);
            // After a long idle stretch, check that shared-memory peers' processes still exist.
            if now.duration_since(idle_since.unwrap_or(now)) > Duration::from_millis(10) {
                let pending = sends
                    .iter()
                    .filter(|s| !s.done)
                    .map(|s| s.peer)
                    .chain(recvs.iter().filter(|r| !r.done).map(|r| r.peer));
                let pending: Vec<usize> = pending.collect();
                for &p in &pending {
                    if self.links[p].as_ref().is_some_and(|l| !l.peer_alive()) {
                        return Err(self.err_for(ctx, p, LinkError::Closed));
                    }
                }
                // A peer whose heartbeat stopped will never answer: say so now, not at the
                // timeout.
                if let Some((m, _)) = &self.monitor {
                    let limit = m.limit().unwrap_or(Duration::MAX);
                    let world = |p: usize| self.desc.world_ranks[p];
                    let stopped: Vec<usize> = match idle > limit {
                        true => pending
                            .iter()
                            .copied()
                            .filter(|&p| m.stopped(world(p)))
                            .collect(),
                        false => Vec::new(),
                    };
                    if !stopped.is_empty() {
                        let mut stopped = stopped;
                        stopped.sort_unstable();
                        stopped.dedup();
                        return Err(CommError::Stopped {
                            group: self.desc.name.clone(),
                            op: format!("{} #{}", ctx.kind.name(), self.op_number(ctx)),
                            ranks: stopped.iter().map(|&p| world(p)).collect(),
                            limit,
                            diagnosis: self.diagnosis(ctx, &stopped),
                        });
                    }
                }
            }
        }
    }

    /// Adapts the spin budget to how waits end, as an adaptive mutex does: halved after a wait
    /// that outlasted it (and went on to yield or sleep), doubled up to `config.spin` after one
    /// that ended while spinning (waits that found their messages there tell nothing and leave
    /// it alone). Spinning pays only while the peer runs on a core of its own.
    /// When threads outnumber cores the peer often shares this rank's core and runs only once
    /// this rank yields, so every wait cost a whole spin budget: a 4 KiB all-reduce between two
    /// processes, the two cores busy with other work, took 45 µs with a 20 µs budget and 7 µs
    /// with none, against 1.8 µs with the full budget when each rank had a core of its own.
    fn adapt_spin(&mut self, spun_out: bool) {
        self.spin = next_spin(self.spin, self.config.spin, spun_out);
    }

    /// Sleeps until something may have changed: on the shm doorbell if only shared-memory links
    /// are pending, in poll(2) if only TCP ones are, alternating briefly if both.
    fn sleep(
        &self,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        seen: Option<u32>,
        nap: Duration,
    ) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut any_shm = false;
        let pending = sends
            .iter()
            .filter(|s| !s.done)
            .map(|s| (s.peer, libc::POLLOUT))
            .chain(
                recvs
                    .iter()
                    .filter(|r| !r.done)
                    .map(|r| (r.peer, libc::POLLIN)),
            );
        for (peer, events) in pending {
            match &self.links[peer] {
                Some(Link::Tcp(t)) => fds.push(libc::pollfd {
                    fd: t.fd(),
                    events,
                    revents: 0,
                }),
                Some(Link::Shm(_)) => any_shm = true,
                None => {}
            }
        }
        if fds.is_empty() {
            if let (Some((seg, me)), Some(seen)) = (&self.shm, seen) {
                seg.wait(*me, seen, nap);
            }
            return;
        }
        let ms = if any_shm {
            0
        } else {
            nap.as_millis().max(1) as libc::c_int
        };
        // SAFETY: poll on a valid array of pollfds we own.
        unsafe {
            libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms);
        }
        if any_shm {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
impl Engine {
    /// Writes 32 raw bytes (a would-be header) to `peer`, bypassing all framing.
    pub fn inject_raw(&mut self, peer: usize, bytes: [u8; HEADER_LEN]) {
        let mut msg = OutMsg::new(bytes, &[]);
        let link = self.links[peer].as_mut().expect("peer link");
        while msg.remaining() > 0 {
            link.try_write(&mut msg).expect("raw write");
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for link in self.links.iter_mut().flatten() {
            link.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_budget_halves_after_spinning_out_and_regrows_to_the_configured_one() {
        let us = Duration::from_micros;
        let max = us(20);
        let mut spin = max;
        for expected in [
            us(10),
            us(5),
            Duration::from_nanos(2500),
            Duration::from_nanos(1250),
        ] {
            spin = next_spin(spin, max, true);
            assert_eq!(spin, expected);
        }
        for _ in 0..10 {
            spin = next_spin(spin, max, true);
        }
        assert_eq!(spin, MIN_SPIN, "never below the floor");
        for expected in [us(2), us(4), us(8), us(16), us(20), us(20)] {
            spin = next_spin(spin, max, false);
            assert_eq!(spin, expected);
        }
        assert_eq!(next_spin(MIN_SPIN, Duration::ZERO, false), MIN_SPIN);
    }
}
