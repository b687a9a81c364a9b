//! Data-parallel communication of the executor: ZeRO-3's per-unit parameter gathers, and the
//! gradient bucket reductions launched during backward and completed later.
//!
//! The collectives run over the host transports: on a GPU a bucket's gradients are
//! downloaded when its reduction launches and the averaged values uploaded when it completes,
//! and gathered weights are uploaded for the unit's kernels (the staging of
//! [`crate::precision::Flat`]'s host methods). With an NCCL group (ranks with a GPU each,
//! [`crate::nccl`]) the exact reductions and the gathers stay on the devices,
//! on the communication stream, joined before their results are read.
use std::collections::HashMap;

use std::ops::Range;
use tensor::buf::{Buf, BufMut, BufRef, Dev, HostBuf};

use comm::{ReduceOp, Work};

use super::{Executor, TraceKind, F32};
use crate::data_parallel::grad_comm::GradComm;
use crate::nccl::{InFlight, NcclGroup};
use crate::precision::{Flat, Piece};
use crate::stage::StageModel;
use crate::ParallelError;
use comm::compress::Codec;

/// A reduction in flight.
pub(super) enum Pending {
    /// Stages 0/1: the bucket's gradients, summed over ranks.
    AllReduce { bucket: usize, work: Work<HostBuf> },
    /// Stages 2/3: the piece of a bucket owned by `root`, summed onto `root`.
    Reduce {
        bucket: usize,
        root: usize,
        range: Range<usize>,
        /// Bytes accounted for this reduction's buffer.
        bytes: usize,
        work: Work<HostBuf>,
    },
    /// Stages 0/1 under PowerSGD: the bucket's gradients, reduced when drained (its rounds of
    /// products and all-reduces run then, in launch order on every rank).
    PowerSgd { bucket: usize, buf: Vec<f32> },
    /// Stages 0/1 over NCCL: the bucket's fp32 gradients summed in place (`widened`: the fp32
    /// copy of 16-bit storage, rounded back when completed).
    NcclAllReduce {
        bucket: usize,
        widened: Option<Buf>,
        flight: InFlight,
    },
    /// Stages 2/3 over NCCL: the pieces of the bucket's staging buffer summed in place onto
    /// the ranks that own them.
    NcclReduce {
        bucket: usize,
        staged: Buf,
        flight: InFlight,
    },
}

impl Pending {
    fn bucket(&self) -> usize {
        match self {
            Pending::AllReduce { bucket, .. }
            | Pending::Reduce { bucket, .. }
            | Pending::PowerSgd { bucket, .. }
            | Pending::NcclAllReduce { bucket, .. }
            | Pending::NcclReduce { bucket, .. } => *bucket,
        }
    }
    fn is_completed(&self) -> bool {
        match self {
            Pending::AllReduce { work, .. } => work.is_completed(),
            Pending::Reduce { work, .. } => work.is_completed(),
            Pending::PowerSgd { .. } => false,
            Pending::NcclAllReduce { flight, .. } | Pending::NcclReduce { flight, .. } => {
                flight.is_done()
            }
        }
    }
}

/// A parameter all-gather in flight, in the weights' precision: over the host transports
/// from this rank's piece into the unit's buffer, both staged in host memory
/// ([`Piece`]: vectors on the CPU, page-locked scratch for a GPU), with the ranks' lengths;
/// or over NCCL.
pub(super) enum Gather {
    F32(Work<(HostBuf<f32>, HostBuf<f32>, Vec<usize>)>),
    Bf16(Work<(HostBuf<half::bf16>, HostBuf<half::bf16>, Vec<usize>)>),
    F16(Work<(HostBuf<half::f16>, HostBuf<half::f16>, Vec<usize>)>),
    /// Over NCCL, in place in a new GPU buffer of the unit's length.
    Nccl {
        full: Flat,
        flight: InFlight,
    },
}

/// Unit `u`'s fp32 weights: a gathered or widened copy (`owned`), a unit kept by `UNSHARD`,
/// or the fp32 buffer itself.
pub(super) fn param_slice<'a>(
    params: &'a Flat,
    resident: &'a HashMap<usize, Buf>,
    owned: &'a Option<UnitCopy>,
    u: usize,
    range: Range<usize>,
) -> BufRef<'a> {
    if let Some(o) = owned {
        return o.buf.r();
    }
    if let Some(r) = resident.get(&u) {
        return r.r();
    }
    params.view(range).expect("fp32 weights are used in place")
}

/// A unit's parameters as its layers read them where they are not used in place: a gathered
/// or widened fp32 copy, and, for a copy widened on a GPU from the 16-bit weights, its
/// registration with those weights ([`tensor::cuda::widening`]: the products read the 16-bit
/// weights themselves instead of rounding the copy back). Declared first, the registration is
/// dropped before the copy.
pub(super) struct UnitCopy {
    widening: Option<tensor::cuda::widening::Widening>,
    buf: Buf,
}

impl UnitCopy {
    fn plain(buf: Buf) -> Self {
        UnitCopy {
            widening: None,
            buf,
        }
    }
}

impl<M: StageModel> Executor<M> {
    /// This rank's real elements of flat range `r` of the compute weights (from the full
    /// buffer or the shard), in their own precision.
    fn own_piece(&self, r: &Range<usize>) -> Result<Piece, ParallelError> {
        let me = self.dp.rank();
        let own = self.spec.intersect(me, r);
        let local = if own.is_empty() {
            0..0
        } else if self.cfg.zero.shards_params() {
            self.spec.to_local(me, &own)
        } else {
            own
        };
        Ok(self.params.piece(local)?)
    }

    /// Starts gathering unit `u`'s compute weights from the shards (pieces arrive in rank
    /// order, which is flat order; 16-bit weights travel as 16 bits).
    pub(super) fn gather_async(&mut self, u: usize) -> Result<Gather, ParallelError> {
        self.order_uploads(None)?;
        if let Some(nccl) = self.cfg.nccl.clone() {
            return self.gather_nccl(u, &nccl);
        }
        let r = self.units[u].clone();
        let piece = self.own_piece(&r)?;
        let full = Piece::staging(piece.half(), &self.cfg.device, r.len())?;
        self.gathered_bytes.add(r.len() * piece.elem_bytes());
        Ok(match (piece, full) {
            (Piece::F32(p), Piece::F32(f)) => Gather::F32(self.dp.all_gather_v_into_async(p, f)),
            (Piece::Bf16(p), Piece::Bf16(f)) => Gather::Bf16(self.dp.all_gather_v_into_async(p, f)),
            (Piece::F16(p), Piece::F16(f)) => Gather::F16(self.dp.all_gather_v_into_async(p, f)),
            _ => unreachable!("the unit's buffer is staged in the piece's precision"),
        })
    }

    /// Where each rank's block of flat range `r` lies: its length, in rank order (the
    /// blocks tile `r` in flat order).
    fn block_counts(&self, r: &Range<usize>) -> Vec<usize> {
        (0..self.dp.size())
            .map(|q| self.spec.intersect(q, r).len())
            .collect()
    }

    /// [`Self::gather_async`] over NCCL: this rank's block copied into a new GPU buffer of the
    /// unit's length, the others broadcast into it from their owners.
    fn gather_nccl(&mut self, u: usize, nccl: &NcclGroup) -> Result<Gather, ParallelError> {
        let r = self.units[u].clone();
        let me = self.dp.rank();
        let own = self.spec.intersect(me, &r);
        let local = if own.is_empty() {
            0..0
        } else if self.cfg.zero.shards_params() {
            self.spec.to_local(me, &own)
        } else {
            own.clone()
        };
        // Where this rank's block starts in the unit (a rank holding none of it: nothing to
        // copy, and its empty range may lie past the unit).
        let at = if own.is_empty() {
            0
        } else {
            own.start - r.start
        };
        let mut full = self
            .params
            .dev_block(r.len(), local, at)?
            .ok_or_else(|| ParallelError::Model("NCCL gathers GPU weights".into()))?;
        self.gathered_bytes.add(full.bytes());
        let counts = self.block_counts(&r);
        let view = full.nccl_view_mut(0..r.len()).expect("a GPU buffer");
        let flight = nccl.all_gather_v(view, &counts)?;
        Ok(Gather::Nccl { full, flight })
    }

    /// Unit `u`'s gathered fp32 weights on the executor's device (uploaded to a GPU).
    pub(super) fn finish_gather_on_device(
        &mut self,
        u: usize,
        w: Gather,
    ) -> Result<Buf, ParallelError> {
        if let Gather::Nccl { full, flight } = w {
            flight.join()?;
            // 16-bit weights are widened for the kernels (accounted as fp32 from now on).
            let widened = full.len() * F32;
            if full.bytes() != widened {
                self.gathered_bytes.add(widened);
                self.gathered_bytes.sub(full.bytes());
            }
            return Ok(full.into_f32_buf()?);
        }
        let full = self.finish_gather_piece(u, w)?;
        let elem = full.elem_bytes();
        if elem != F32 {
            // Widened to fp32 for the kernels; the 16-bit copy is freed right after.
            let n = full.len();
            self.gathered_bytes.add(n * F32);
            self.gathered_bytes.sub(n * elem);
        }
        Ok(full.into_f32_buf(&self.cfg.device)?)
    }

    /// ZeRO-1/2 after the optimizer step over NCCL: each unit's updated weights gathered in
    /// place in the full weight buffer from the ranks that updated them.
    pub(super) fn gather_updated_nccl(&mut self, nccl: &NcclGroup) -> Result<(), ParallelError> {
        self.order_uploads(None)?;
        let mut flights = Vec::with_capacity(self.units.len());
        for u in 0..self.units.len() {
            let r = self.units[u].clone();
            let counts = self.block_counts(&r);
            let view = self
                .params
                .nccl_view_mut(r)
                .ok_or_else(|| ParallelError::Model("NCCL gathers GPU weights".into()))?;
            flights.push(nccl.all_gather_v(view, &counts)?);
        }
        flights.into_iter().try_for_each(InFlight::join)
    }

    /// Waits for unit `u`'s gather over the host transports and returns its weights in their
    /// own precision, staged in host memory (accounted until released); each rank's block
    /// checked against the layout.
    pub(super) fn finish_gather_piece(
        &mut self,
        u: usize,
        w: Gather,
    ) -> Result<Piece, ParallelError> {
        let (full, counts) = match w {
            Gather::F32(w) => w.wait().map(|(_, f, c)| (Piece::F32(f), c))?,
            Gather::Bf16(w) => w.wait().map(|(_, f, c)| (Piece::Bf16(f), c))?,
            Gather::F16(w) => w.wait().map(|(_, f, c)| (Piece::F16(f), c))?,
            Gather::Nccl { .. } => {
                return Err(ParallelError::Protocol(
                    "an NCCL gather finishes on the device".into(),
                ))
            }
        };
        let want = self.block_counts(&self.units[u]);
        if counts != want {
            return Err(ParallelError::Protocol(format!(
                "gathered blocks of {counts:?} parameters for unit {u}, expected {want:?}"
            )));
        }
        Ok(full)
    }

    /// Unit `u`'s parameters as an fp32 copy when they are not used in place: gathered
    /// (ZeRO-3, from the prefetch `w`) or widened from 16 bits (on the weights' device).
    /// `None`: read `self.params` (or the unit `UNSHARD` keeps).
    pub(super) fn unit_params(
        &mut self,
        u: usize,
        w: Option<Gather>,
    ) -> Result<Option<UnitCopy>, ParallelError> {
        // A delayed update's weights may still be going up (`delayed`): this unit's first.
        let r = self.units[u].clone();
        self.order_uploads(Some(&r))?;
        if let Some(w) = w {
            return Ok(Some(UnitCopy::plain(self.finish_gather_on_device(u, w)?)));
        }
        if self.resident.contains_key(&u) {
            return Ok(None);
        }
        if self.cfg.zero.shards_params() {
            let w = self.gather_async(u)?;
            return Ok(Some(UnitCopy::plain(self.finish_gather_on_device(u, w)?)));
        }
        if self.params.view(0..0).is_some() {
            return Ok(None);
        }
        if self.params.half().is_some() && !self.cfg.device.is_cuda() {
            let mut v = self.spare_params.take(r.len(), &mut self.gathered_bytes);
            self.params.read_into(r, &mut v)?;
            return Ok(Some(UnitCopy::plain(Buf::Host(v))));
        }
        self.gathered_bytes.add(r.len() * F32);
        // The products read the 16-bit weights themselves (the registration below), so only
        // what the kernels read as values is widened.
        let buf = self
            .params
            .read_buf_parts(r.clone(), &self.value_parts[u])?;
        // The 16-bit weights this copy widens, for the products (exactly its rounding).
        let widening = match (&buf, self.params.dev_bits(r)) {
            (Buf::Cuda(values), Some((kind, bits))) => {
                // SAFETY: `bits` are this executor's 16-bit weights, which change only in the
                // optimizer step, after every action, and outlive the copy; the registration
                // is dropped with the copy (`release`, or `UnitCopy`'s drop on an error), in
                // this action.
                Some(unsafe {
                    tensor::cuda::widening::Widening::register(
                        values.as_slice(),
                        bits,
                        kind.operands(),
                    )
                    .map_err(tensor::TensorError::from)?
                })
            }
            _ => None,
        };
        Ok(Some(UnitCopy { widening, buf }))
    }

    /// Frees a unit's parameter copy (a widened host one is kept for the next unit of the
    /// action: [`super::Spare`]).
    pub(super) fn release(&mut self, owned: Option<UnitCopy>) {
        let Some(UnitCopy { widening, buf }) = owned else {
            return;
        };
        drop(widening);
        match buf {
            Buf::Host(v) if self.params.half().is_some() && !self.cfg.zero.shards_params() => {
                self.spare_params.keep(v, &mut self.gathered_bytes)
            }
            o => self.gathered_bytes.sub(o.len() * F32),
        }
    }

    /// A copy of `values` for a collective: page-locked scratch on a GPU, a vector on the CPU.
    fn host_grads(&self, values: &[f32]) -> Result<HostBuf, ParallelError> {
        let mut h = self.cfg.device.host_buf(values.len())?;
        h.copy_from_slice(values);
        Ok(h)
    }

    /// Launches the reduction of bucket `b` (its gradients are final).
    pub(super) fn launch(
        &mut self,
        b: usize,
        pending: &mut Vec<Pending>,
    ) -> Result<(), ParallelError> {
        self.record(TraceKind::BucketLaunched(b));
        if let Some(nccl) = self.grads_nccl() {
            return self.launch_nccl(b, &nccl, pending);
        }
        let br = self.buckets[b].range.clone();
        if !self.cfg.zero.shards_grads() && self.dp.size() == 1 {
            // One rank: the accumulated gradients are already the sum (prepared on the host:
            // expert parallelism's average over the ep group).
            if self.model.prepares_reductions() {
                let model = &self.model;
                self.grads
                    .update(b, br.clone(), |g| model.prepare_reduction(br.clone(), g))??;
            }
            self.bucket_done(b)?;
            return Ok(());
        }
        let mut buf = self.take_bucket(b)?;
        self.model.prepare_reduction(br, &mut buf)?;
        self.reduce_taken(b, buf, pending, false)
    }

    /// The NCCL group, where the bucket reductions are exact sums it can run (no compression,
    /// no PowerSGD, nothing the model prepares on the host).
    fn grads_nccl(&self) -> Option<NcclGroup> {
        let plain = self.cfg.grad_comm.codec().is_none()
            && !matches!(self.cfg.grad_comm, GradComm::PowerSgd { .. })
            && !self.model.prepares_reductions();
        self.cfg.nccl.clone().filter(|_| plain)
    }

    /// Launches bucket `b`'s reduction over NCCL: at ZeRO-0/1 an all-reduce of its fp32
    /// gradients in place (16-bit storage: of a widened copy), at ZeRO-2/3 the pieces of its
    /// staging buffer reduced onto their owners.
    fn launch_nccl(
        &mut self,
        b: usize,
        nccl: &NcclGroup,
        pending: &mut Vec<Pending>,
    ) -> Result<(), ParallelError> {
        let br = self.buckets[b].range.clone();
        let on_host = || ParallelError::Model("NCCL reduces GPU gradients".into());
        if self.cfg.zero.shards_grads() {
            let mut staged = self.staging[b].take().ok_or_else(|| {
                ParallelError::Protocol(format!("bucket {b} has no staged gradients"))
            })?;
            let pieces: Vec<(usize, Range<usize>)> = self
                .spec
                .split(br.clone())
                .into_iter()
                .map(|(root, p)| (root, p.start - br.start..p.end - br.start))
                .collect();
            let BufMut::Cuda(g) = staged.m() else {
                return Err(on_host());
            };
            let flight = nccl.reduce_pieces(g, &pieces)?;
            pending.push(Pending::NcclReduce {
                bucket: b,
                staged,
                flight,
            });
            return Ok(());
        }
        if self.grads.is_f32() {
            let flight = self.grads.update_buf(b, br, |g| match g {
                BufMut::Cuda(g) => nccl.all_reduce_sum(g),
                BufMut::Host(_) => Err(on_host()),
            })?;
            pending.push(Pending::NcclAllReduce {
                bucket: b,
                widened: None,
                flight,
            });
            return Ok(());
        }
        let mut widened = self.grads.read_buf(b, br)?;
        self.comm_bytes.add(widened.len() * F32);
        let BufMut::Cuda(g) = widened.m() else {
            return Err(on_host());
        };
        let flight = nccl.all_reduce_sum(g)?;
        pending.push(Pending::NcclAllReduce {
            bucket: b,
            widened: Some(widened),
            flight,
        });
        Ok(())
    }

    /// Bucket `b`'s fp32 gradients taken out for its reduction, on the host: at ZeRO-2/3 its
    /// staging buffer; else its own fp32 host allocation (lent to the collective, returned in
    /// `drain`), an fp32 host copy (16-bit storage — reductions run in fp32), or from a GPU
    /// page-locked scratch.
    fn take_bucket(&mut self, b: usize) -> Result<HostBuf, ParallelError> {
        if self.cfg.zero.shards_grads() {
            let staged = self.staging[b].take().ok_or_else(|| {
                ParallelError::Protocol(format!("bucket {b} has no staged gradients"))
            })?;
            return Ok(staged.into_host_buf()?);
        }
        let range = self.buckets[b].range.clone();
        let buf = match &self.cfg.device {
            Dev::Cpu if self.grads.is_f32() => {
                return match self.grads.take(b) {
                    Some(Flat::F32(v)) => Ok(HostBuf::Vec(v)),
                    _ => Err(ParallelError::Protocol(format!(
                        "bucket {b} is already in flight"
                    ))),
                };
            }
            Dev::Cpu => HostBuf::Vec(self.grads.read(b, range)?),
            dev => {
                let mut s = dev.host_buf(range.len())?;
                self.grads.read_into(range, &mut s)?;
                s
            }
        };
        self.comm_bytes.add(buf.len() * F32);
        Ok(buf)
    }

    /// Reduces bucket `b`'s taken and prepared gradients `buf` over the dp group: with
    /// `train.grad_comm`, or `exact`ly — uncompressed and every element summed in rank order
    /// wherever it sits ([`Codec::F32`]), which the tied copies need to stay equal.
    fn reduce_taken(
        &mut self,
        b: usize,
        buf: HostBuf,
        pending: &mut Vec<Pending>,
        exact: bool,
    ) -> Result<(), ParallelError> {
        let br = self.buckets[b].range.clone();
        let single = self.dp.size() == 1;
        let codec = if exact {
            Some(Codec::F32)
        } else {
            self.cfg.grad_comm.codec()
        };
        if !self.cfg.zero.shards_grads() {
            if single {
                self.store_mean(b, buf)?;
                self.bucket_done(b)?;
                return Ok(());
            }
            let powersgd_on = match self.cfg.grad_comm {
                GradComm::PowerSgd { start, .. } => !exact && self.step >= start,
                _ => false,
            };
            if powersgd_on {
                let buf = buf.into_vec();
                pending.push(Pending::PowerSgd { bucket: b, buf });
                return Ok(());
            }
            let work = match codec {
                Some(codec) => self.dp.all_reduce_compressed_async(buf, codec),
                None => self.dp.all_reduce_async(buf, ReduceOp::Sum),
            };
            pending.push(Pending::AllReduce { bucket: b, work });
            return Ok(());
        }
        if single {
            // One rank owns the whole shard: the staged gradients are the sum.
            self.grads.update(0, br.clone(), |g| {
                g.iter_mut().zip(buf.iter()).for_each(|(g, s)| *g += s);
            })?;
            self.comm_bytes.sub(buf.len() * F32);
            self.bucket_done(b)?;
            return Ok(());
        }
        // Reduce-scatter with uneven pieces: each piece of the bucket is summed onto the rank
        // whose shard contains it (one reduce per owning rank, issued in the same order
        // everywhere). A bucket inside one shard (the usual case when buckets are smaller than
        // shards) is handed over without a copy; a bucket spanning shards is copied piece by
        // piece and its staging buffer freed, so in-flight bytes never exceed the bucket's.
        let pieces = self.spec.split(br.clone());
        let me = self.dp.rank();
        for (root, piece) in &pieces {
            if *root != me {
                self.reduce_scratch = self.reduce_scratch.max(piece.len() * F32);
            }
        }
        let dp = &self.dp;
        let reduce = |data: HostBuf, root: usize| match codec {
            Some(c) => dp.reduce_compressed_async(data, c, root),
            None => dp.reduce_async(data, ReduceOp::Sum, root),
        };
        if let [(root, piece)] = pieces.as_slice() {
            let bytes = buf.len() * F32;
            let work = reduce(buf, *root);
            pending.push(Pending::Reduce {
                bucket: b,
                root: *root,
                range: piece.clone(),
                bytes,
                work,
            });
            return Ok(());
        }
        for (root, piece) in pieces {
            let data = self.host_grads(&buf[piece.start - br.start..piece.end - br.start])?;
            let bytes = data.len() * F32;
            self.comm_bytes.add(bytes);
            let work = reduce(data, root);
            pending.push(Pending::Reduce {
                bucket: b,
                root,
                range: piece,
                bytes,
                work,
            });
        }
        self.comm_bytes.sub(buf.len() * F32);
        Ok(())
    }

    /// The buckets holding copies of a tied tensor, at the end of the step: their gradients
    /// taken and prepared in bucket order, the copies summed ([`StageModel::sum_tied`]: on
    /// this rank and over the tie group), then reduced exactly. Every copy enters its
    /// reduction with the same bits and every element is summed in rank order, so the copies
    /// leave it equal, and AdamW keeps them equal (Megatron sums its embedding group's
    /// gradients after the data-parallel reduction for the same reason).
    pub(super) fn reduce_tied(&mut self, pending: &mut Vec<Pending>) -> Result<(), ParallelError> {
        if self.tied.is_empty() {
            return Ok(());
        }
        let buckets: Vec<usize> = (0..self.buckets.len())
            .filter(|&b| self.tied_bucket[b])
            .collect();
        let mut bufs = Vec::with_capacity(buckets.len());
        for &b in &buckets {
            self.record(TraceKind::BucketLaunched(b));
            let mut buf = self.take_bucket(b)?;
            self.model
                .prepare_reduction(self.buckets[b].range.clone(), &mut buf)?;
            bufs.push(buf);
        }
        // Each copy's place: (index into `bufs`, range inside that buffer).
        let places: Vec<(usize, Range<usize>)> = self
            .tied
            .iter()
            .map(|t| {
                let i = buckets
                    .iter()
                    .position(|&b| {
                        let r = &self.buckets[b].range;
                        r.start <= t.start && t.end <= r.end
                    })
                    .expect("a tied copy lies inside one bucket");
                let base = self.buckets[buckets[i]].range.start;
                (i, t.start - base..t.end - base)
            })
            .collect();
        let mut copies: Vec<Vec<f32>> = places
            .iter()
            .map(|(i, r)| bufs[*i][r.clone()].to_vec())
            .collect();
        self.comm_bytes
            .add(copies.iter().map(|c| c.len() * F32).sum::<usize>());
        {
            let mut views: Vec<&mut [f32]> = copies.iter_mut().map(|c| c.as_mut_slice()).collect();
            self.model.sum_tied(&mut views)?;
        }
        for ((i, r), c) in places.iter().zip(&copies) {
            bufs[*i][r.clone()].copy_from_slice(c);
        }
        self.comm_bytes
            .sub(copies.iter().map(|c| c.len() * F32).sum::<usize>());
        for (b, buf) in buckets.into_iter().zip(bufs) {
            self.reduce_taken(b, buf, pending, true)?;
        }
        Ok(())
    }

    /// Puts bucket `b`'s averaged gradients (a whole-bucket fp32 host buffer) in place: back
    /// into its lent allocation, or written (rounded) into its 16-bit or GPU storage.
    fn store_mean(&mut self, b: usize, mean: HostBuf) -> Result<(), ParallelError> {
        if self.grads.has(b) {
            let r = self.buckets[b].range.clone();
            self.grads.write(b, r.start, &mean)?;
            self.comm_bytes.sub(mean.len() * F32);
        } else {
            self.grads.put(b, Flat::F32(mean.into_vec()));
        }
        Ok(())
    }

    /// Stores the averaged gradients of the reductions that already finished.
    pub(super) fn poll(&mut self, pending: &mut Vec<Pending>) -> Result<(), ParallelError> {
        self.complete(pending, |p| p.is_completed())
    }

    /// Waits for and stores every reduction of `buckets` (all of them with `None`).
    pub(super) fn drain(
        &mut self,
        pending: &mut Vec<Pending>,
        buckets: Option<&Range<usize>>,
    ) -> Result<(), ParallelError> {
        self.complete(pending, |p| buckets.is_none_or(|r| r.contains(&p.bucket())))
    }

    /// Stores the averaged gradients of the reductions `take` selects (waiting for them).
    /// Every gradient element receives exactly one reduction result per backward, so the order
    /// in which they are consumed does not change the numbers.
    fn complete(
        &mut self,
        pending: &mut Vec<Pending>,
        take: impl Fn(&Pending) -> bool,
    ) -> Result<(), ParallelError> {
        let inv = 1.0 / self.dp.size() as f32;
        let me = self.dp.rank();
        let mut keep = Vec::new();
        let mut consumed = Vec::new();
        for p in pending.drain(..) {
            if !take(&p) {
                keep.push(p);
                continue;
            }
            let bucket = match p {
                Pending::AllReduce { bucket, work } => {
                    let mut sum = work.wait()?;
                    sum.iter_mut().for_each(|s| *s *= inv);
                    self.store_mean(bucket, sum)?;
                    bucket
                }
                Pending::PowerSgd { bucket, mut buf } => {
                    let (state, layouts) = self.powersgd.as_mut().ok_or_else(|| {
                        ParallelError::Protocol("a PowerSGD reduction without its state".into())
                    })?;
                    state.reduce(bucket, &layouts[bucket], &mut buf, &self.dp)?;
                    self.store_mean(bucket, HostBuf::Vec(buf))?;
                    bucket
                }
                Pending::Reduce {
                    bucket,
                    root,
                    range,
                    bytes,
                    work,
                } => {
                    let sum = work.wait()?;
                    if root == me {
                        let local = self.spec.to_local(me, &range);
                        self.grads.update(0, local, |g| {
                            for (g, s) in g.iter_mut().zip(sum.iter()) {
                                *g += s * inv;
                            }
                        })?;
                    }
                    self.comm_bytes.sub(bytes);
                    bucket
                }
                Pending::NcclAllReduce {
                    bucket,
                    widened,
                    flight,
                } => {
                    flight.join()?;
                    let br = self.buckets[bucket].range.clone();
                    match widened {
                        None => self
                            .grads
                            .update_buf(bucket, br, |g| tensor::ops::scale(g, inv))?,
                        Some(mut w) => {
                            tensor::ops::scale(w.m(), inv)?;
                            self.grads.write_buf(bucket, br.start, w.r())?;
                            self.comm_bytes.sub(w.len() * F32);
                        }
                    }
                    bucket
                }
                Pending::NcclReduce {
                    bucket,
                    mut staged,
                    flight,
                } => {
                    flight.join()?;
                    let br = self.buckets[bucket].range.clone();
                    let own = self.spec.intersect(me, &br);
                    if !own.is_empty() {
                        // g += (1/n)·sum, the sum rounded times 1/n first as on the host.
                        let rel = own.start - br.start..own.end - br.start;
                        tensor::ops::scale(staged.m().slice_mut(rel.clone()), inv)?;
                        let local = self.spec.to_local(me, &own);
                        let sum = staged.r().slice(rel);
                        self.grads
                            .update_buf(0, local, |g| tensor::ops::add_assign(g, sum))?;
                    }
                    self.comm_bytes.sub(staged.len() * F32);
                    bucket
                }
            };
            if consumed.last() != Some(&bucket) {
                consumed.push(bucket);
            }
        }
        for b in consumed {
            if !keep.iter().any(|k| k.bucket() == b) {
                self.bucket_done(b)?;
            }
        }
        *pending = keep;
        Ok(())
    }
}
