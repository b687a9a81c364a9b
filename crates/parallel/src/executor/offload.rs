//! ZeRO-Offload's traffic between a GPU and the host, for 16-bit weights and gradients on the
//! GPU and the fp32 master weights and AdamW moments on the host (Ren et al. 2021,
//! "ZeRO-Offload", arXiv 2101.06840, §4): the gradients this rank updates land in page-locked
//! host memory bucket by bucket, the moment the backward has made each one final — on a
//! stream of their own, while the backward goes on — so that the optimizer step finds them on
//! the host; and the updated weights go up chunk by chunk from two page-locked stages while
//! the host updates the next chunk (`optimizer::host_update`). On the CPU the gradients land
//! in a vector by the same rules (a copy), so the CPU's offload tests check the rules.
//!
//! A bucket is final when its reduction is done ([`super::TraceKind::BucketDone`]) after its
//! pipeline stage's last weight-gradient action of the step: ZeRO-2/3 reduce a bucket after
//! every micro-batch's backward, and only the last sum is the gradient. Whatever has not
//! landed by the optimizer step (padding, a bucket reduced at the step's end) is queued then,
//! before the step waits, so the host always updates from every element of the step.
use std::ops::Range;

use model::optim::AdamW;
use rayon::prelude::*;
use tensor::cuda::Staged;

use super::run::terr;
use super::{Executor, TraceKind};
use crate::placement::uncovered;
use crate::precision::{Bucketed, Flat, Half, Landing, CHUNK, DEVICE_CHUNK};
use crate::stage::StageModel;
use crate::ParallelError;

/// The page-locked buffers of ZeRO-Offload on a GPU, made at the first step and kept.
pub(super) struct OffloadTraffic {
    /// The gradients AdamW reads: indices of the gradient buffers (the executor's
    /// `own_ranges().0`).
    grads: Range<usize>,
    /// Their 16-bit bits on the host, landed or in flight.
    landing: Landing,
    /// The pieces of `grads` queued into `landing` this step (relative to `grads.start`).
    landed: Vec<Range<usize>>,
    /// Per local stage: whether its last weight-gradient action of the step has run.
    final_stage: Vec<bool>,
    /// On a GPU: the rounded weights of a chunk on their way up, one stage per chunk in
    /// flight.
    uploads: Option<Uploads>,
}

/// The two page-locked stages rounded weights go up from, a chunk each in flight.
pub(super) type Uploads = [Staged<u16>; 2];

impl OffloadTraffic {
    /// Page-locked bytes held (none on the CPU).
    pub(super) fn pinned_bytes(&self) -> usize {
        match (&self.landing, &self.uploads) {
            (Landing::Gpu(l), Some([a, b])) => 2 * (l.len() + a.len() + b.len()),
            _ => 0,
        }
    }

    /// Lands the pieces of `grads` not landed yet, waits for every landing, and returns the
    /// gradients' bits (element `i` is gradient `grads.start + i`) and the upload stages.
    pub(super) fn landed(
        &mut self,
        grads: &Bucketed,
    ) -> Result<(&[u16], Option<&mut Uploads>), ParallelError> {
        for gap in uncovered(std::mem::take(&mut self.landed), 0..self.grads.len()) {
            let at = gap.start;
            let flat = self.grads.start + gap.start..self.grads.start + gap.end;
            grads.land(flat, &mut self.landing, at).map_err(terr)?;
        }
        let bits = self.landing.host().map_err(terr)?;
        Ok((&*bits, self.uploads.as_mut()))
    }
}

/// AdamW from 16-bit gradient bits: each piece of [`CHUNK`] elements widened into a buffer
/// that stays in cache, updated with the clipping factor (`step` = (t, lr, factor)), and the
/// master rounded into `out` — one pass over the state where widening, updating and rounding
/// each took one (28 bytes an element moved instead of 40), on the thread budget; every
/// element sees the operations of [`Half::upcast`], [`AdamW::update_scaled`] and
/// [`Half::downcast`], so the bits are theirs. Nothing inside a piece calls into the thread
/// pool (the widened piece is a worker's, borrowed for the piece).
pub(super) fn adamw_from_bits(
    kind: Half,
    opt: &AdamW,
    step: (u64, f32, f32),
    grads: &[u16],
    state: (&mut [f32], &mut [f32], &mut [f32]),
    out: &mut [u16],
) {
    adamw_bits_pieces(kind, opt, step, Some(grads), state, out)
}

/// [`adamw_from_bits`] with the rounded weights written over the gradient bits they came from
/// (each piece is widened before it is written: the same values).
pub(super) fn adamw_in_place(
    kind: Half,
    opt: &AdamW,
    step: (u64, f32, f32),
    state: (&mut [f32], &mut [f32], &mut [f32]),
    bits: &mut [u16],
) {
    adamw_bits_pieces(kind, opt, step, None, state, bits)
}

/// The pass of [`adamw_from_bits`] from `grads`, or (`None`) from `out` itself.
fn adamw_bits_pieces(
    kind: Half,
    opt: &AdamW,
    (t, lr, factor): (u64, f32, f32),
    grads: Option<&[u16]>,
    (master, m, v): (&mut [f32], &mut [f32], &mut [f32]),
    out: &mut [u16],
) {
    thread_local! {
        /// A worker's widened piece, kept between calls (no allocation a step).
        static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let step = opt.at_step(t, lr, opt.weight_decay, factor);
    let piece = |i: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32], o: &mut [u16]| {
        WIDE.with_borrow_mut(|wide| {
            wide.resize(CHUNK, 0.0);
            let w = &mut wide[..o.len()];
            match grads {
                Some(g) => kind.upcast(&g[i * CHUNK..i * CHUNK + o.len()], w),
                None => kind.upcast(o, w),
            }
            step.apply(p, w, m, v);
            kind.downcast(p, o);
        })
    };
    tensor::threads::install(|| {
        master
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .zip(out.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(i, ((p, (m, v)), o))| piece(i, p, m, v, o))
    });
}

/// Parameters a second the host's update of ZeRO-Offload moves through: [`adamw_from_bits`]
/// over `n` elements of bf16 gradient bits on the thread budget, the best of three passes
/// (for the planner's calibration of a host; `n` well beyond the last-level cache, as a
/// model's optimizer state is).
pub fn host_update_rate(n: usize) -> f64 {
    let opt = AdamW::default();
    let grads = vec![0x3c00u16; n];
    let (mut p, mut m, mut v, mut out) = (vec![0.1f32; n], vec![0.0; n], vec![0.0; n], vec![0; n]);
    let best = (1..=3)
        .map(|t| {
            let start = std::time::Instant::now();
            let state = (&mut p[..], &mut m[..], &mut v[..]);
            adamw_from_bits(Half::Bf16, &opt, (t, 1e-3, 1.0), &grads, state, &mut out);
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    n as f64 / best.max(1e-9)
}

impl OffloadTraffic {
    /// [`Self::landed`], handing over the landing buffer itself — the step's gradients, for an
    /// update that runs later — with `spare` (when it is a twin) or a new buffer in its place.
    pub(super) fn take_landed(
        &mut self,
        grads: &Bucketed,
        spare: Option<Landing>,
    ) -> Result<Landing, ParallelError> {
        self.landed(grads)?;
        let fresh = match spare {
            Some(s) if s.is_twin(&self.landing) => s,
            _ => self.landing.twin().map_err(terr)?,
        };
        Ok(std::mem::replace(&mut self.landing, fresh))
    }
}

impl<M: StageModel> Executor<M> {
    /// At the start of a step: makes the offload buffers (ZeRO-Offload of 16-bit weights,
    /// the first time) and forgets the last step's landings.
    pub(super) fn begin_offload_step(&mut self) -> Result<(), ParallelError> {
        if !self.cfg.offload_optimizer {
            return Ok(());
        }
        if self.offload.is_none() {
            let (grads, _, _) = self.own_ranges();
            let (landing, uploads) = match &self.params {
                Flat::DevHalf { bits, .. } => {
                    let gpu = bits.gpu().clone();
                    let staged = |n| Staged::new(&gpu, n).map_err(|e| terr(e.into()));
                    (
                        Landing::Gpu(staged(grads.len())?),
                        Some([staged(DEVICE_CHUNK)?, staged(DEVICE_CHUNK)?]),
                    )
                }
                Flat::Half { .. } => (Landing::Host(vec![0; grads.len()]), None),
                Flat::F32(_) | Flat::Dev(_) => return Ok(()),
            };
            self.offload = Some(OffloadTraffic {
                landing,
                grads,
                landed: Vec::new(),
                final_stage: Vec::new(),
                uploads,
            });
        }
        let stages = self.stages.len();
        if let Some(t) = &mut self.offload {
            t.landed.clear();
            t.final_stage = vec![false; stages];
        }
        Ok(())
    }

    /// Local stage `ls` has run its last weight-gradient action of the step: its buckets'
    /// next completions are final.
    pub(super) fn stage_grads_final(&mut self, ls: usize) {
        if let Some(t) = &mut self.offload {
            t.final_stage[ls] = true;
        }
    }

    /// Bucket `b`'s reduction is done: traced, and under ZeRO-Offload of 16-bit weights its
    /// final gradients (this rank's part) landed on the host (from a GPU: queued).
    pub(super) fn bucket_done(&mut self, b: usize) -> Result<(), ParallelError> {
        self.record(TraceKind::BucketDone(b));
        let Some(ls) = self.stages.iter().position(|s| s.buckets.contains(&b)) else {
            return Ok(());
        };
        let Some(t) = self.offload.as_mut().filter(|t| t.final_stage[ls]) else {
            return Ok(());
        };
        // The bucket's gradients in the gradient buffers' indices: the bucket's own range, or
        // (ZeRO-2/3) this rank's part of it in its shard.
        let br = self.buckets[b].range.clone();
        let held = if self.cfg.zero.shards_grads() {
            let me = self.dp.rank();
            let own = self.spec.intersect(me, &br);
            if own.is_empty() {
                return Ok(());
            }
            self.spec.to_local(me, &own)
        } else {
            br
        };
        let (s, e) = (held.start.max(t.grads.start), held.end.min(t.grads.end));
        if s >= e {
            return Ok(());
        }
        let at = s - t.grads.start;
        self.grads.land(s..e, &mut t.landing, at).map_err(terr)?;
        t.landed.push(at..at + (e - s));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_update_rate_is_a_rate() {
        let r = host_update_rate(1 << 16);
        assert!(r.is_finite() && r > 1e5, "{r} parameters/s");
    }

    /// One pass equals the three it replaces — widen, AdamW with the factor, round — bit for
    /// bit, from separate gradient bits and over them in place, in both 16-bit formats, over
    /// lengths that end inside a piece and span several (the master, the moments and the
    /// rounded weights all compared).
    #[test]
    fn one_pass_equals_widen_update_round() {
        let opt = AdamW {
            lr: 3e-3,
            weight_decay: 0.1,
            ..AdamW::default()
        };
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            ((rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        };
        for kind in [Half::Bf16, Half::F16] {
            for n in [1, 1000, CHUNK, 3 * CHUNK + 17] {
                let values: Vec<f32> = (0..n).map(|_| next() * 1e-2).collect();
                let mut grads = vec![0u16; n];
                kind.downcast(&values, &mut grads);
                let master: Vec<f32> = (0..n).map(|_| next()).collect();
                let m: Vec<f32> = (0..n).map(|_| next() * 1e-3).collect();
                let v: Vec<f32> = (0..n).map(|_| next().abs() * 1e-5).collect();
                let step = (7, 2e-3, 0.75);
                let (mut p1, mut m1, mut v1, mut out1) =
                    (master.clone(), m.clone(), v.clone(), vec![0u16; n]);
                adamw_from_bits(
                    kind,
                    &opt,
                    step,
                    &grads,
                    (&mut p1, &mut m1, &mut v1),
                    &mut out1,
                );
                let mut wide = vec![0.0; n];
                kind.upcast(&grads, &mut wide);
                let (master0, m0, v0) = (master.clone(), m.clone(), v.clone());
                let (mut p2, mut m2, mut v2, mut out2) = (master, m, v, vec![0u16; n]);
                let (t, lr, factor) = step;
                opt.update_scaled(
                    t,
                    lr,
                    opt.weight_decay,
                    factor,
                    &mut p2,
                    &wide,
                    &mut m2,
                    &mut v2,
                );
                kind.downcast(&p2, &mut out2);
                let bits = |x: &[f32]| x.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p1), bits(&p2), "{kind:?} n={n}: master");
                assert_eq!(bits(&m1), bits(&m2), "{kind:?} n={n}: m");
                assert_eq!(bits(&v1), bits(&v2), "{kind:?} n={n}: v");
                assert_eq!(out1, out2, "{kind:?} n={n}: rounded weights");
                // In place (the delayed update's): the rounded weights over the gradient bits.
                let (mut p3, mut m3, mut v3, mut io) = (master0, m0, v0, grads.clone());
                adamw_in_place(kind, &opt, step, (&mut p3, &mut m3, &mut v3), &mut io);
                assert_eq!(bits(&p3), bits(&p1), "{kind:?} n={n}: master in place");
                assert_eq!(bits(&m3), bits(&m1), "{kind:?} n={n}: m in place");
                assert_eq!(bits(&v3), bits(&v1), "{kind:?} n={n}: v in place");
                assert_eq!(io, out1, "{kind:?} n={n}: rounded weights in place");
            }
        }
    }
}
