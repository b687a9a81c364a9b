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
//! contributes nothing.
use comm::{ProcessGroup, ReduceOp};
use model::layers::attention::AttentionCore;
use model::layers::SeqPart;
use model::{Documents, ModelError, Result};
use tensor::attention::{attention_backward_docs, attention_forward_docs, AttnShape, AttnTiles};

use super::{block_calls, CpComm, CpLayout};

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
}

fn cerr(e: comm::CommError) -> ModelError {
    ModelError::Collective(format!("context-parallel attention: {e}"))
}

/// `(a, b)`'s stable merge weights and lse (module doc).
#[inline]
fn merge_weights(la: f32, lb: f32) -> (f32, f32, f32) {
    if lb == f32::NEG_INFINITY {
        return (1.0, 0.0, la);
    }
    if la == f32::NEG_INFINITY {
        return (0.0, 1.0, lb);
    }
    let d = lb - la;
    let softplus = d.max(0.0) + (-d.abs()).exp().ln_1p();
    let sig = |x: f32| {
        if x >= 0.0 {
            1.0 / (1.0 + (-x).exp())
        } else {
            let e = x.exp();
            e / (1.0 + e)
        }
    };
    (sig(-d), sig(d), la + softplus)
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
        })
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

    /// Merges into `o`, `lse` the partial attention of this rank's queries against block
    /// `j` (`kv` = its K then V, `[batch, len, n_kv, d]` each).
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        shape: &AttnShape,
        docs: Option<&Documents>,
        q: &[f32],
        kv: &[f32],
        j: usize,
        o: &mut [f32],
        lse: &mut [f32],
    ) -> Result<()> {
        let (len, h, d) = (shape.q_len, shape.n_heads, shape.head_dim);
        let (hd, kvd) = (h * d, shape.n_kv_heads * d);
        let (k, v) = kv.split_at(kv.len() / 2);
        let pos = self.query_positions(docs, len);
        for (c, s) in self.calls(shape, j) {
            let rows = c.q_rows.len();
            let mut ob = vec![0.0f32; rows * hd];
            let mut lb = vec![0.0f32; h * rows];
            for b in 0..shape.batch {
                let qr = (b * len + c.q_rows.start) * hd..(b * len + c.q_rows.end) * hd;
                let kr = (b * len + c.k_rows.start) * kvd..(b * len + c.k_rows.end) * kvd;
                let ds = Self::call_docs(docs, pos.as_deref(), &c, b);
                model::profile::time(model::profile::Kernel::Attention, || {
                    attention_forward_docs(
                        &s,
                        ds.as_deref(),
                        &q[qr.clone()],
                        &k[kr.clone()],
                        &v[kr],
                        &mut ob,
                        &mut lb,
                        AttnTiles::default(),
                    )
                })?;
                // Merge: o rows [b, q_rows, h, d]; lse [b, h, len] at q_rows.
                for (r, row) in c.q_rows.clone().enumerate() {
                    for hh in 0..h {
                        let li = (b * h + hh) * len + row;
                        let (wa, wb, l) = merge_weights(lse[li], lb[hh * rows + r]);
                        lse[li] = l;
                        let oa = &mut o[(b * len + row) * hd + hh * d..][..d];
                        let obr = &ob[r * hd + hh * d..][..d];
                        for (x, &y) in oa.iter_mut().zip(obr) {
                            *x = *x * wa + y * wb;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds to `dq` and to `dkv` (block `j`'s dK then dV) the gradients of this rank's
    /// queries' attention to block `j`, from the final `o`, `lse` and `dout`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        shape: &AttnShape,
        docs: Option<&Documents>,
        q: &[f32],
        kv: &[f32],
        j: usize,
        o: &[f32],
        lse: &[f32],
        dout: &[f32],
        dq: &mut [f32],
        dkv: &mut [f32],
    ) -> Result<()> {
        let (len, h, d) = (shape.q_len, shape.n_heads, shape.head_dim);
        let (hd, kvd) = (h * d, shape.n_kv_heads * d);
        let (k, v) = kv.split_at(kv.len() / 2);
        let (dk, dv) = dkv.split_at_mut(dkv.len() / 2);
        let pos = self.query_positions(docs, len);
        for (c, s) in self.calls(shape, j) {
            let rows = c.q_rows.len();
            let mut lb = vec![0.0f32; h * rows];
            for b in 0..shape.batch {
                for hh in 0..h {
                    let from = (b * h + hh) * len + c.q_rows.start;
                    lb[hh * rows..(hh + 1) * rows].copy_from_slice(&lse[from..from + rows]);
                }
                let qr = (b * len + c.q_rows.start) * hd..(b * len + c.q_rows.end) * hd;
                let kr = (b * len + c.k_rows.start) * kvd..(b * len + c.k_rows.end) * kvd;
                let ds = Self::call_docs(docs, pos.as_deref(), &c, b);
                model::profile::time(model::profile::Kernel::Attention, || {
                    attention_backward_docs(
                        &s,
                        ds.as_deref(),
                        &q[qr.clone()],
                        &k[kr.clone()],
                        &v[kr.clone()],
                        &o[qr.clone()],
                        &lb,
                        &dout[qr.clone()],
                        &mut dq[qr],
                        &mut dk[kr.clone()],
                        &mut dv[kr],
                        AttnTiles::default(),
                    )
                })?;
            }
        }
        Ok(())
    }

    /// K then V as one buffer.
    fn kv_buffer(k: &[f32], v: &[f32]) -> Vec<f32> {
        let mut kv = Vec::with_capacity(k.len() + v.len());
        kv.extend_from_slice(k);
        kv.extend_from_slice(v);
        kv
    }

    /// Starts the ring shift of `buf` on `group`: sent to the next rank, the previous rank's
    /// received.
    fn shift(&self, group: &ProcessGroup, buf: Vec<f32>, tag: u32) -> comm::Work<Vec<Vec<f32>>> {
        let n = buf.len();
        group.send_recv_async(
            vec![(self.next(), buf)],
            vec![(self.prev(), vec![0.0; n])],
            tag,
        )
    }
}

/// The buffer a ring shift received (its wait charged to the profile's `ContextWait`).
fn received(w: comm::Work<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
    model::profile::time(model::profile::Kernel::ContextWait, || w.wait())
        .map_err(cerr)?
        .pop()
        .ok_or_else(|| ModelError::Collective("a ring shift received nothing".into()))
}

/// A blocking collective of the all-gather variant, charged to `ContextWait`.
fn waited<R>(f: impl FnOnce() -> comm::Result<R>) -> Result<R> {
    model::profile::time(model::profile::Kernel::ContextWait, f).map_err(cerr)
}

impl AttentionCore for ContextAttention {
    fn forward(
        &self,
        shape: &AttnShape,
        part: SeqPart,
        docs: Option<&Documents>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check(shape, part, docs)?;
        let cp = self.layout.cp;
        let mut o = vec![0.0f32; shape.q_elems()];
        let mut lse = vec![f32::NEG_INFINITY; shape.lse_elems()];
        let mine = Self::kv_buffer(k, v);
        match self.comm {
            CpComm::Ring => {
                let mut cur = mine;
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let next = (step + 1 < cp).then(|| self.shift(&self.kv, cur.clone(), TAG_KV));
                    self.block_forward(shape, docs, q, &cur, j, &mut o, &mut lse)?;
                    if let Some(w) = next {
                        cur = received(w)?;
                    }
                }
            }
            CpComm::AllGather => {
                let n = mine.len();
                let mut all = vec![0.0f32; n * cp];
                waited(|| self.kv.all_gather(&mine, &mut all))?;
                // The own block first, then the others in ring order: the ring's merge order.
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let blk = &all[j * n..(j + 1) * n];
                    self.block_forward(shape, docs, q, blk, j, &mut o, &mut lse)?;
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
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        self.check(shape, part, docs)?;
        let cp = self.layout.cp;
        let mut dq = vec![0.0f32; shape.q_elems()];
        let mine = Self::kv_buffer(k, v);
        let n = mine.len();
        let own = match self.comm {
            CpComm::Ring => {
                let mut cur = mine;
                // The sum the previous rank passed on for this step's block.
                let mut incoming: Option<comm::Work<Vec<Vec<f32>>>> = None;
                let mut alone = None; // cp = 1: the own block's gradient stays here
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let next = (step + 1 < cp).then(|| self.shift(&self.kv, cur.clone(), TAG_KV));
                    let mut dkv = vec![0.0f32; n];
                    let (o, l) = (out, lse);
                    self.block_backward(shape, docs, q, &cur, j, o, l, dout, &mut dq, &mut dkv)?;
                    if let Some(w) = incoming.take() {
                        let sum = received(w)?;
                        dkv.iter_mut().zip(&sum).for_each(|(a, b)| *a += b);
                    }
                    // On to the next rank, which sees block j at the next step; after the
                    // last step the next rank is j's owner.
                    if cp > 1 {
                        incoming = Some(self.shift(&self.dkv, dkv, TAG_DKV));
                    } else {
                        alone = Some(dkv);
                    }
                    if let Some(w) = next {
                        cur = received(w)?;
                    }
                }
                match (incoming, alone) {
                    (Some(w), _) => received(w)?,
                    (None, Some(g)) => g,
                    (None, None) => unreachable!("cp ≥ 1 steps ran"),
                }
            }
            CpComm::AllGather => {
                let mut all = vec![0.0f32; n * cp];
                waited(|| self.kv.all_gather(&mine, &mut all))?;
                let mut dall = vec![0.0f32; n * cp];
                for step in 0..cp {
                    let j = (self.layout.rank + cp - step) % cp;
                    let (blk, dblk) = (&all[j * n..(j + 1) * n], &mut dall[j * n..(j + 1) * n]);
                    self.block_backward(shape, docs, q, blk, j, out, lse, dout, &mut dq, dblk)?;
                }
                let mut own = vec![0.0f32; n];
                waited(|| self.kv.reduce_scatter(&dall, &mut own, ReduceOp::Sum))?;
                own
            }
        };
        let (dk, dv) = own.split_at(n / 2);
        Ok((dq, dk.to_vec(), dv.to_vec()))
    }
}
