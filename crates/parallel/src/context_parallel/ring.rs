//! Attention over a sequence split across the cp ranks ([`ContextAttention`], plugged into
//! each block's attention as its [`AttentionCore`]).
//!
//! **Ring** (`CpComm::Ring`). Forward: at step t = 0 … cp − 1 rank i holds the K/V block of
//! rank j = i − t (mod cp); it starts sending that block to rank i + 1 (and receiving the next
//! from i − 1) and meanwhile computes its queries' partial attention against it (the kernel
//! calls of [`super::block_calls`]), merging the partials by their log-sum-exp. Backward, in
//! FlashAttention-2 form from the final output and lse: the K/V blocks go round again; dQ
//! accumulates locally; each block's dK/dV contribution is added to the sum the previous rank
//! sent for the same block and passed on (a second group, so the gradients' transfer overlaps
//! the next step's compute), reaching the block's owner after cp hops.
//!
//! Bytes each rank sends per attention layer (B sequences of S tokens, K/V of `n_kv·d` per
//! token, f32): forward (cp − 1)·2·B·(S/cp)·n_kv·d·4, backward twice that for K/V plus
//! cp·2·B·(S/cp)·n_kv·d·4 for dK/dV.
//!
//! **All-gather** (`CpComm::AllGather`): every rank's K/V at once (cp blocks held), the same
//! kernel calls per block, dK/dV of all blocks reduce-scattered back to their owners.
//!
//! **Document masking** (block-causal attention over packed documents): the model passes the
//! document starts of the whole sequences (global positions). A rank looks up the start of
//! each of its queries, and each kernel call turns it into the first visible key of the block
//! at hand in that call's frame ([`super::BlockCall::first_key`]); the kernel masks keys before
//! it. A key block wholly in earlier documents gives a query `lse = −∞`, which the merge treats
//! as no contribution, and its backward adds nothing; so ring and all-gather compute exactly
//! the masked attention of the single process.
//!
//! The merge of two partial results over disjoint keys cannot overflow: with
//! `δ = lse_b − lse_a`, `lse = lse_a + softplus(δ)` and `o = o_a·σ(−δ) + o_b·σ(δ)`
//! (ring-flash-attention's `lse − logsigmoid(lse − lse_blk)` form); a side with `lse = −∞`
//! contributes nothing (`tensor::attention::merge_partial`, on the partials' device).
use comm::{ProcessGroup, ReduceOp};
use model::layers::attention::AttentionCore;
use model::layers::SeqPart;
use model::layers::{Buf, BufMut, BufRef};
use model::{Documents, ModelError, Result};
use tensor::attention::{AttnShape, MergeRows};
use tensor::buf::HostBuf;

use super::{block_calls, CpComm, CpLayout};
use crate::nccl::{InFlight, NcclGroup, NcclSlot};

const TAG_KV: u32 = 0x4b56;
const TAG_DKV: u32 = 0x644b56;

/// Ring (or all-gather) attention of one rank of a cp group.
#[derive(Debug)]
pub struct ContextAttention {
    pub layout: CpLayout,
    pub comm: CpComm,
    /// Carries the K/V blocks (and the all-gather / reduce-scatter).
    kv: ProcessGroup,
    /// Carries the dK/dV sums of ring attention's backward.
    dkv: ProcessGroup,
    /// Carries both on the devices, once attached ([`ContextAttention::attach_nccl`]).
    nccl: NcclSlot,
}

/// A block on its way round the ring (or a collective of the all-gather variant): over the
/// host transports, or over NCCL (joined before the result is read; the buffer it sends is
/// kept alive by the caller until then).
enum Shift {
    Host(comm::Work<Vec<HostBuf>>, tensor::buf::Dev),
    Nccl { flight: InFlight, recv: Buf },
}

impl Shift {
    /// The received buffer, on the device of the one sent (its wait charged to the profile's
    /// `ContextWait`).
    fn finish(self) -> Result<Buf> {
        match self {
            Shift::Host(w, dev) => Ok(dev.from_host(received(w)?)?),
            Shift::Nccl { flight, recv } => {
                model::profile::time(model::profile::Kernel::ContextWait, || flight.join())
                    .map_err(|e| {
                        ModelError::Collective(format!("context-parallel attention: {e}"))
                    })?;
                Ok(recv)
            }
        }
    }
}

fn cerr(e: comm::CommError) -> ModelError {
    ModelError::Collective(format!("context-parallel attention: {e}"))
}

fn nerr(e: crate::ParallelError) -> ModelError {
    ModelError::Collective(format!("context-parallel attention: {e}"))
}

impl ContextAttention {
    /// The attention of `layout`'s rank over `kv` (the cp group) and `dkv` (a second group of
    /// the same ranks, in the same order).
    pub fn new(
        layout: CpLayout,
        comm: CpComm,
        kv: ProcessGroup,
        dkv: ProcessGroup,
    ) -> std::result::Result<Self, crate::ParallelError> {
        if kv.size() != layout.cp || dkv.size() != layout.cp || kv.rank() != layout.rank {
            return Err(crate::ParallelError::Layout(format!(
                "context-parallel groups of {} and {} ranks (this one {}) for cp = {} rank {}",
                kv.size(),
                dkv.size(),
                kv.rank(),
                layout.cp,
                layout.rank
            )));
        }
        Ok(ContextAttention {
            layout,
            comm,
            kv,
            dkv,
            nccl: NcclSlot::default(),
        })
    }

    /// The cp group (the K/V blocks' group).
    pub fn group(&self) -> &ProcessGroup {
        &self.kv
    }

    /// Moves the blocks of GPU activations onto `nccl` (a communicator over [`Self::group`],
    /// on the communication stream). Once.
    pub fn attach_nccl(&self, nccl: NcclGroup) -> std::result::Result<(), crate::ParallelError> {
        self.nccl.attach(nccl, self.layout.cp, "cp")
    }

    fn next(&self) -> usize {
        (self.layout.rank + 1) % self.layout.cp
    }
    fn prev(&self) -> usize {
        (self.layout.rank + self.layout.cp - 1) % self.layout.cp
    }

    fn check(&self, shape: &AttnShape, part: SeqPart, docs: Option<&Documents>) -> Result<usize> {
        let len = shape.q_len;
        let seq = len * self.layout.cp;
        if let Some(d) = docs {
            d.check(shape.batch, seq)?;
        }
        if shape.kv_len != len || part != self.layout.part(seq) {
            return Err(ModelError::InvalidBatch(format!(
                "context-parallel attention of rank {} expects its own tokens {:?}, got {part:?} with {} queries and {} keys",
                self.layout.rank,
                self.layout.part(seq),
                shape.q_len,
                shape.kv_len
            )));
        }
        Ok(len)
    }

    /// The kernel calls of this rank's queries against block `j`'s keys, with their shapes
    /// (one sequence each).
    fn calls(&self, shape: &AttnShape, j: usize) -> Vec<(super::BlockCall, AttnShape)> {
        let len = shape.q_len;
        let seq = len * self.layout.cp;
        block_calls(self.layout.part(seq), self.layout.part_of(j, seq), len)
            .into_iter()
            .map(|c| {
                let s = AttnShape {
                    batch: 1,
                    q_len: c.q_rows.len(),
                    kv_len: c.k_rows.len(),
                    n_heads: shape.n_heads,
                    n_kv_heads: shape.n_kv_heads,
                    head_dim: shape.head_dim,
                    causal: true,
                    q_start: c.q_start,
                    k_start: c.k_start,
                };
                (c, s)
            })
            .collect()
    }

    /// The global positions of this rank's queries when the pass has documents (computed once
    /// per block, not per kernel call).
    fn query_positions(&self, docs: Option<&Documents>, len: usize) -> Option<Vec<usize>> {
        docs.map(|_| self.layout.part(len * self.layout.cp).positions(len))
    }

    /// The kernel's `doc_start` for call `c` on sequence `b`: the first visible key of each of
    /// the call's query rows at global positions `pos` (`None` without documents).
    fn call_docs(
        docs: Option<&Documents>,
        pos: Option<&[usize]>,
        c: &super::BlockCall,
        b: usize,
    ) -> Option<Vec<usize>> {
        let (docs, pos) = (docs?, pos?);
        Some(
            c.q_rows
                .clone()
                .map(|r| c.first_key(docs.start(b, pos[r])))
                .collect(),
        )
    }

    /// Merges into `o`, `lse` (on the device of `q`) the partial attention of this rank's
    /// queries against block `j` (`kv` = its K then V, `[batch, len, n_kv, d]` each).
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        shape: &AttnShape,
        docs: Option<&Documents>,
        q: BufRef<'_>,
        kv: BufRef<'_>,
        j: usize,
        mut o: BufMut<'_>,
        mut lse: BufMut<'_>,
    ) -> Result<()> {
        let (len, h, d) = (shape.q_len, shape.n_heads, shape.head_dim);
        let (hd, kvd) = (h * d, shape.n_kv_heads * d);
        let half = kv.len() / 2;
        let (k, v) = (kv.slice(0..half), kv.slice(half..kv.len()));
        let pos = self.query_positions(docs, len);
        for (c, s) in self.calls(shape, j) {
            for b in 0..shape.batch {
                let qr = (b * len + c.q_rows.start) * hd..(b * len + c.q_rows.end) * hd;
                let kr = (b * len + c.k_rows.start) * kvd..(b * len + c.k_rows.end) * kvd;
                let ds = Self::call_docs(docs, pos.as_deref(), &c, b);
                let (ob, lb) = model::profile::time(model::profile::Kernel::Attention, || {
                    tensor::ops::attention_forward(
                        &s,
                        ds.as_deref(),
                        q.slice(qr.clone()),
                        k.slice(kr.clone()),
                        v.slice(kr),
                    )
                })?;
                let rows = MergeRows {
                    b,
                    len,
                    heads: h,
                    head_dim: d,
                    row0: c.q_rows.start,
                    rows: c.q_rows.len(),
                };
                tensor::ops::attention_merge(&rows, o.reborrow(), lse.reborrow(), ob.r(), lb.r())?;
            }
        }
        Ok(())
    }

    /// Adds to `dq` and to `dkv` (block `j`'s dK then dV) the gradients of this rank's
    /// queries' attention to block `j`, from the final `o`, `lse` (host) and `dout`, on the
    /// device of `q`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        shape: &AttnShape,
        docs: Option<&Documents>,
        (q, kv, j): (BufRef<'_>, BufRef<'_>, usize),
        o: BufRef<'_>,
        lse: &[f32],
        dout: BufRef<'_>,
        mut dq: BufMut<'_>,
        dkv: BufMut<'_>,
    ) -> Result<()> {
        let (len, h, d) = (shape.q_len, shape.n_heads, shape.head_dim);
        let (hd, kvd) = (h * d, shape.n_kv_heads * d);
        let half = kv.len() / 2;
        let (k, v) = (kv.slice(0..half), kv.slice(half..kv.len()));
        let (mut dk, mut dv) = dkv.split_at_mut(half);
        let pos = self.query_positions(docs, len);
        let dev = q.dev();
        for (c, s) in self.calls(shape, j) {
            let rows = c.q_rows.len();
            for b in 0..shape.batch {
                let mut lb = vec![0.0f32; h * rows];
                for hh in 0..h {
                    let from = (b * h + hh) * len + c.q_rows.start;
                    lb[hh * rows..(hh + 1) * rows].copy_from_slice(&lse[from..from + rows]);
                }
                let lb = dev.from_vec(lb)?;
                let qr = (b * len + c.q_rows.start) * hd..(b * len + c.q_rows.end) * hd;
                let kr = (b * len + c.k_rows.start) * kvd..(b * len + c.k_rows.end) * kvd;
                let ds = Self::call_docs(docs, pos.as_deref(), &c, b);
                model::profile::time(model::profile::Kernel::Attention, || {
                    tensor::ops::attention_backward(
                        &s,
                        ds.as_deref(),
                        q.slice(qr.clone()),
                        k.slice(kr.clone()),
                        v.slice(kr.clone()),
                        o.slice(qr.clone()),
                        lb.r(),
                        dout.slice(qr.clone()),
                        dq.reborrow().slice_mut(qr),
                        dk.reborrow().slice_mut(kr.clone()),
                        dv.reborrow().slice_mut(kr),
                    )
                })?;
            }
        }
        Ok(())
    }

    /// K then V as one buffer on their device.
    fn kv_buffer(k: BufRef<'_>, v: BufRef<'_>) -> Result<Buf> {
        let mut kv = tensor::ops::zeros_like(k, k.len() + v.len())?;
        kv.m().slice_mut(0..k.len()).copy_from(k)?;
        kv.m().slice_mut(k.len()..k.len() + v.len()).copy_from(v)?;
        Ok(kv)
    }

    /// Starts the ring shift of `buf` on `group` (or NCCL): sent to the next rank, the
    /// previous rank's received. `buf` must live until the shift is finished.
    fn shift(&self, group: &ProcessGroup, buf: &Buf, tag: u32) -> Result<Shift> {
        let n = buf.len();
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(buf), buf) {
            let mut recv = d.gpu().alloc::<f32>(n).map_err(tensor::TensorError::from)?;
            let flight = nccl
                .send_recv(d.as_slice(), self.next(), recv.as_mut_slice(), self.prev())
                .map_err(nerr)?;
            return Ok(Shift::Nccl {
                flight,
                recv: Buf::Cuda(recv),
            });
        }
        let dev = buf.dev();
        let w = group.send_recv_async(
            vec![(self.next(), buf.r().to_host_buf()?)],
            vec![(self.prev(), dev.host_buf(n)?)],
            tag,
        );
        Ok(Shift::Host(w, dev))
    }

    /// Every rank's `mine` in rank order, on the device of `mine` (the all-gather variant).
    fn gather_blocks(&self, mine: &Buf) -> Result<Buf> {
        let cp = self.layout.cp;
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(mine), mine) {
            let mut all = d
                .gpu()
                .alloc::<f32>(d.len() * cp)
                .map_err(tensor::TensorError::from)?;
            let flight = nccl
                .all_gather(d.as_slice(), all.as_mut_slice())
                .map_err(nerr)?;
            Shift::Nccl {
                flight,
                recv: Buf::Cuda(all),
            }
            .finish()
        } else {
            let dev = mine.dev();
            let m = mine.r().to_host_buf()?;
            let mut all = dev.host_buf(mine.len() * cp)?;
            waited(|| self.kv.all_gather(&m, &mut all))?;
            Ok(dev.from_host(all)?)
        }
    }

    /// This rank's block of the sum over the ranks of `all` (the all-gather variant's
    /// gradients), on the device of `all`.
    fn scatter_sums(&self, all: &Buf) -> Result<Buf> {
        let n = all.len() / self.layout.cp;
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(all), all) {
            let mut own = d.gpu().alloc::<f32>(n).map_err(tensor::TensorError::from)?;
            let flight = nccl
                .reduce_scatter(d.as_slice(), own.as_mut_slice())
                .map_err(nerr)?;
            Shift::Nccl {
                flight,
                recv: Buf::Cuda(own),
            }
            .finish()
        } else {
            let dev = all.dev();
            let a = all.r().to_host_buf()?;
            let mut own = dev.host_buf(n)?;
            waited(|| self.kv.reduce_scatter(&a, &mut own, ReduceOp::Sum))?;
            Ok(dev.from_host(own)?)
        }
    }
}

/// The buffer a ring shift received (its wait charged to the profile's `ContextWait`).
fn received(w: comm::Work<Vec<HostBuf>>) -> Result<HostBuf> {
    model::profile::time(model::profile::Kernel::ContextWait, || w.wait())
        .map_err(cerr)?
        .pop()
        .ok_or_else(|| ModelError::Collective("a ring shift received nothing".into()))
}

/// A blocking collective of the all-gather variant, charged to `ContextWait`.
fn waited<R>(f: impl FnOnce() -> comm::Result<R>) -> Result<R> {
    model::profile::time(model::profile::Kernel::ContextWait, f).map_err(cerr)
}

// The blocks travel over the host transports (on a GPU each is downloaded to be sent and
// uploaded when received) or over NCCL; the partial outputs are merged on their device.
impl AttentionCore for ContextAttention {
    fn forward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        docs: Option<&Documents>,
        q: BufRef<'_>,
        k: BufRef<'_>,
        v: BufRef<'_>,
    ) -> Result<(Buf, Buf)> {
        self.check(shape, part, docs)?;
        let cp = self.layout.cp;
        let dev = q.dev();
        let mut o = dev.zeros(shape.q_elems())?;
        let mut lse = dev.from_vec(vec![f32::NEG_INFINITY; shape.lse_elems()])?;
        let mine = Self::kv_buffer(k, v)?;
        match self.comm {
            CpComm::Ring => {
                let mut cur = mine;
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let next = match step + 1 < cp {
                        true => Some(self.shift(&self.kv, &cur, TAG_KV)?),
                        false => None,
                    };
                    self.block_forward(shape, docs, q, cur.r(), j, o.m(), lse.m())?;
                    if let Some(w) = next {
                        cur = w.finish()?; // (the block sent is freed only now)
                    }
                }
            }
            CpComm::AllGather => {
                let n = mine.len();
                let all = self.gather_blocks(&mine)?;
                // The own block first, then the others in ring order: the ring's merge order.
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let blk = all.r().slice(j * n..(j + 1) * n);
                    self.block_forward(shape, docs, q, blk, j, o.m(), lse.m())?;
                }
            }
        }
        Ok((o, lse))
    }

    fn backward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        docs: Option<&Documents>,
        q: BufRef<'_>,
        k: BufRef<'_>,
        v: BufRef<'_>,
        out: BufRef<'_>,
        lse: BufRef<'_>,
        dout: BufRef<'_>,
    ) -> Result<(Buf, Buf, Buf)> {
        self.check(shape, part, docs)?;
        let cp = self.layout.cp;
        let lse = lse.to_vec()?;
        let mut dq = tensor::ops::zeros_like(q, shape.q_elems())?;
        let mine = Self::kv_buffer(k, v)?;
        let n = mine.len();
        let own = match self.comm {
            CpComm::Ring => {
                let mut cur = mine;
                // The sum the previous rank passed on for this step's block (and the sum this
                // rank sent, alive until then).
                let mut incoming: Option<(Shift, Buf)> = None;
                let mut alone = None; // cp = 1: the own block's gradient stays here
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let next = match step + 1 < cp {
                        true => Some(self.shift(&self.kv, &cur, TAG_KV)?),
                        false => None,
                    };
                    let mut dkv = tensor::ops::zeros_like(q, n)?;
                    self.block_backward(
                        shape,
                        docs,
                        (q, cur.r(), j),
                        out,
                        &lse,
                        dout,
                        dq.m(),
                        dkv.m(),
                    )?;
                    if let Some((w, _sent)) = incoming.take() {
                        let sum = w.finish()?;
                        tensor::ops::add_assign(dkv.m(), sum.r())?;
                    }
                    // On to the next rank, which sees block j at the next step; after the
                    // last step the next rank is j's owner.
                    if cp > 1 {
                        incoming = Some((self.shift(&self.dkv, &dkv, TAG_DKV)?, dkv));
                    } else {
                        alone = Some(dkv);
                    }
                    if let Some(w) = next {
                        cur = w.finish()?;
                    }
                }
                match (incoming, alone) {
                    (Some((w, _sent)), _) => w.finish()?,
                    (None, Some(g)) => g,
                    (None, None) => unreachable!("cp ≥ 1 steps ran"),
                }
            }
            CpComm::AllGather => {
                let all = self.gather_blocks(&mine)?;
                let mut dall = tensor::ops::zeros_like(q, n * cp)?;
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let blk = all.r().slice(j * n..(j + 1) * n);
                    let dblk = dall.m().slice_mut(j * n..(j + 1) * n);
                    let (o, l) = (out, &lse);
                    self.block_backward(shape, docs, (q, blk, j), o, l, dout, dq.m(), dblk)?;
                }
                self.scatter_sums(&dall)?
            }
        };
        let (dk, dv) = (own.r().slice(0..n / 2), own.r().slice(n / 2..n));
        Ok((dq, dk.to_buf()?, dv.to_buf()?))
    }
}
