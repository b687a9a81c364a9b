//! Single-copy ring steps between ranks on one host: the receiver reads the sender's buffer
//! directly with cross-memory attach (`transport::cma`) instead of the sender copying into the
//! shared ring and the receiver copying out of it.
//!
//! Work per rank for a ring all-reduce of m bytes over 2 ranks: the ring path copies m/2 into
//! the ring and reduces m/2 out of it, then copies m/2 in and m/2 out again; here the rank
//! reads the peer's half of the input into an L2-resident piece buffer, reduces it into place
//! and writes each finished piece back into the peer's buffer while it is hot: one kernel copy
//! in, one reduction and one kernel copy out of cache, and a single step.
//!
//! Protocol of one step (rank r, right = r+1 reads from r, left = r−1 is read by r), with the
//! small messages going through the ordinary shared-memory links, so they carry the usual
//! headers (kind, dtype, op, sequence, step tag, count: mismatches are detected as before):
//! 1. exchange: send right an *offer* (pid, address, length of the bytes it should take this
//!    step) and left an *ack* (r finished reading left's previous offer); receive left's offer
//!    and right's ack;
//! 2. pull left's offer into the step's sink, in pieces (`process_vm_readv`); in the last
//!    reduce-scatter step of a ring all-reduce, also write each finished piece back over the
//!    left neighbour's offered bytes (`process_vm_writev`; nobody else reads them), so the
//!    left neighbour already holds that segment's result and the all-gather needs n−2 steps
//!    instead of n−1 (none with 2 ranks).
//!
//! A region offered at step s is read (with write-back: read, then overwritten piece by piece)
//! by right only between exchange s and exchange s+1 (or the closing exchange
//! [`Engine::sc_finish`], a last round of acks); its owner neither reads nor writes it in that
//! interval. The collectives keep the rest: the region written at step s is disjoint from the
//! one offered at step s, data offered at step s was final before exchange s, and they return (freeing or reusing the buffer) only
//! after `sc_finish`, so no rank reads memory its owner has moved on from. If a peer dies its
//! pid reads as `ESRCH`; if it gave up and returned, its memory reads as `EFAULT` or the next
//! exchange finds its links closed: both become `PeerClosed` naming it.
use crate::element::ScaleBytesFn;
use crate::engine::{Ctx, Engine, Incoming, Outgoing, Sink};
use crate::error::{CommError, Result};
use crate::transport::cma::{self, CmaError, Offer};
use crate::transport::LinkError;

/// Tag bits of offers and acks (algorithm tags are `root << 16 | step`, below bit 30 for any
/// group of fewer than 16384 ranks).
const OFFER: u32 = 1 << 31;
const ACK: u32 = 1 << 30;
/// Step tag of the closing round of acks.
const FINISH: u32 = 0x7fff;
/// Bytes pulled per `process_vm_readv` when reducing: the piece and the matching part of the
/// destination stay in L2 (2 MiB per core here) while the reduction runs.
pub(crate) const REDUCE_PIECE: usize = 256 << 10;
/// Bytes pulled per call when copying straight into the destination (bounds one syscall).
const COPY_PIECE: usize = 8 << 20;

/// A reducing step that also writes each finished piece back into the left neighbour's
/// offered region (the last reduce-scatter step of a ring all-reduce: the left neighbour then
/// holds that segment's result without an all-gather step, and the write comes from a piece
/// that is still in cache). `scale` (the divisor of an average) finishes each piece first.
#[derive(Clone, Copy)]
pub(crate) struct WriteBack {
    pub scale: Option<(ScaleBytesFn, usize)>,
}

impl Engine {
    /// Whether a ring collective over `bytes` bytes in total uses single-copy steps (the same
    /// answer on every rank: the threshold and the set-up probe's verdict are group-wide).
    pub(crate) fn use_single_copy(&self, bytes: usize) -> bool {
        self.size() > 1 && self.single_copy.is_some_and(|min| bytes >= min)
    }

    /// One single-copy ring step: offers `send` to the right neighbour and pulls the left
    /// neighbour's offer into `recv` (whose length the offer must match); with `write_back`
    /// (a reducing `recv` only), the result also replaces the left neighbour's offered bytes.
    pub(crate) fn sc_step(
        &mut self,
        ctx: &Ctx,
        t: u32,
        send: &[u8],
        mut recv: Sink<'_>,
        write_back: Option<WriteBack>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let mine = Offer::of(send).encode();
        let mut theirs = [0u8; Offer::LEN];
        self.exchange(
            ctx,
            &mut [
                Outgoing::control(ctx, t | OFFER, right, &mine),
                Outgoing::control(ctx, t | ACK, left, &[]),
            ],
            &mut [
                Incoming::new(ctx, t | OFFER, left, Sink::Copy(&mut theirs)),
                Incoming::new(ctx, t | ACK, right, Sink::Copy(&mut [])),
            ],
        )?;
        let offer = Offer::decode(&theirs);
        let result = if offer.len != recv.len() as u64 {
            Err(CommError::Mismatch {
                group: self.desc.name.clone(),
                op: ctx.kind.name().to_string(),
                rank: self.desc.world_ranks[left],
                detail: format!(
                    "this rank expected {} bytes at ring step {t:#x}, the peer offered {}",
                    recv.len(),
                    offer.len
                ),
            })
        } else {
            let mut scratch = std::mem::take(&mut self.scratch);
            let pulled = pull(offer, &mut recv, &mut scratch, write_back);
            self.scratch = scratch;
            pulled.map_err(|e| match e {
                CmaError::Gone => self.err_for(ctx, left, LinkError::Closed),
                CmaError::Io(e) => self.err_for(ctx, left, LinkError::Io(e)),
            })
        };
        match result {
            Ok(()) => {
                // The right neighbour pulls exactly what was offered (and the left one gets
                // what was written back): count it as sent, so the counters agree with the
                // ring path's.
                let back = write_back.map_or(0, |_| recv.len());
                self.count_sent(ctx, send.len() + back);
                Ok(())
            }
            Err(e) => {
                self.abort(e.to_string());
                Err(e)
            }
        }
    }

    /// Closing round: tells the left neighbour its last offer was read and waits until the
    /// right neighbour read ours, after which the caller may return (and free its buffer).
    pub(crate) fn sc_finish(&mut self, ctx: &Ctx) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        self.exchange(
            ctx,
            &mut [Outgoing::control(ctx, FINISH | ACK, left, &[])],
            &mut [Incoming::new(ctx, FINISH | ACK, right, Sink::Copy(&mut []))],
        )
    }
}

/// Reads `offer` into `sink`: copies go straight to the destination; reductions go through
/// `scratch` one cache-sized piece at a time (read the piece, then combine it while it is hot,
/// and with `write_back` send the finished piece back while it is still hot).
fn pull(
    offer: Offer,
    sink: &mut Sink<'_>,
    scratch: &mut Vec<u64>,
    write_back: Option<WriteBack>,
) -> Result<(), CmaError> {
    let len = sink.len();
    if let Sink::Copy(dst) = sink {
        debug_assert!(write_back.is_none(), "write-back needs a reduction");
        for off in (0..len).step_by(COPY_PIECE) {
            let end = (off + COPY_PIECE).min(len);
            cma::read(offer.pid, offer.addr + off as u64, &mut dst[off..end])?;
        }
        return Ok(());
    }
    scratch.resize(REDUCE_PIECE / 8, 0);
    let piece: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
    // Piece boundaries are multiples of 8 bytes, so every piece holds whole elements.
    for off in (0..len).step_by(REDUCE_PIECE) {
        let m = REDUCE_PIECE.min(len - off);
        let remote = offer.addr + off as u64;
        cma::read(offer.pid, remote, &mut piece[..m])?;
        sink.accept(off, &piece[..m]);
        if let Some(wb) = write_back {
            let done = &mut sink.dst()[off..off + m];
            if let Some((scale, n)) = wb.scale {
                scale(done, n);
            }
            cma::write(offer.pid, remote, done)?;
        }
    }
    Ok(())
}
