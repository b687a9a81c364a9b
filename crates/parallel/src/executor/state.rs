//! The executor's part of a checkpoint: the pieces this rank saves (the blocks it owns,
//! within the range of the flat buffer whose optimizer state it holds), and loading its
//! buffers from a checkpoint saved at any layout.
use std::borrow::Cow;
use std::ops::Range;

use tensor::buf::Buf;

use super::delayed::{Held, Pending};
use super::run::terr;
use super::Executor;
use crate::checkpoint::{Checkpoint, Kind, SavedPiece};
use crate::precision::{Flat, Landing, LossScaler};
use crate::stage::StageModel;
use crate::ParallelError;

impl<M: StageModel> Executor<M> {
    /// The flat range whose state this rank saves: its shard when the optimizer state is
    /// sharded; everything on dp rank 0 when it is replicated (nothing on the others).
    fn saved_range(&self) -> Range<usize> {
        if self.cfg.zero.shards_optimizer() {
            self.spec.range(self.dp.rank())
        } else if self.dp.rank() == 0 {
            0..self.spec.total()
        } else {
            0..0
        }
    }

    /// The pieces this rank writes into a checkpoint: fp32 master weights and AdamW moments of
    /// every block it owns, over [`Self::saved_range`] (copied from the GPU when the buffers
    /// are there).
    pub fn checkpoint_pieces(&self) -> Result<Vec<SavedPiece>, ParallelError> {
        // A collective over the dp group under PowerSGD: every dp rank takes part.
        let error = self.powersgd_mean_error()?;
        let saved = self.saved_range();
        if saved.is_empty() {
            return Ok(Vec::new());
        }
        let (master, master_sharded) = self.master_view()?;
        fn host(b: &Buf) -> Result<Cow<'_, [f32]>, ParallelError> {
            Ok(match b {
                Buf::Host(v) => Cow::Borrowed(v.as_slice()),
                dev => Cow::Owned(dev.to_vec().map_err(terr)?),
            })
        }
        let (m, v) = (host(&self.m)?, host(&self.v)?);
        // A held update's gradients, indexed like the moments.
        let pending = match &self.delayed.pending {
            Some(p) => Some(p.grads.values(self.cfg.precision.half()).ok_or_else(|| {
                ParallelError::Model("a held update's gradients are still landing".into())
            })?),
            None => None,
        };
        let own_start = self.spec.range(self.dp.rank()).start;
        let master_base = if master_sharded { own_start } else { 0 };
        let moment_base = if self.cfg.zero.shards_optimizer() {
            own_start
        } else {
            0
        };
        let mut out = Vec::new();
        for p in self.model.placements().into_iter().filter(|p| p.owner) {
            let r = p.range();
            let (s, e) = (r.start.max(saved.start), r.end.min(saved.end));
            if s >= e {
                continue;
            }
            let take = |buf: &[f32], base: usize| buf[s - base..e - base].to_vec();
            out.push(SavedPiece {
                start: s - p.start,
                param: take(&master, master_base),
                exp_avg: take(&m, moment_base),
                exp_avg_sq: take(&v, moment_base),
                grad_comm_error: error.as_deref().map(|e| take(e, 0)),
                pending_grad: pending.as_deref().map(|g| take(g, moment_base)),
                slice: p.slice,
            });
        }
        Ok(out)
    }

    /// Whether gradients are reduced by PowerSGD (its error feedback goes into checkpoints).
    pub fn has_powersgd(&self) -> bool {
        self.powersgd.is_some()
    }

    /// PowerSGD's error feedback, the mean over the dp ranks, as one flat buffer (zeros for
    /// buckets not reduced yet); `None` without PowerSGD. A collective over the dp group.
    ///
    /// The mean is what a checkpoint needs: after its first step PowerSGD depends on the
    /// ranks' errors only through their sum (see `data_parallel::powersgd`), so every rank
    /// resuming with the mean continues the same reductions, at this layout or any other.
    fn powersgd_mean_error(&self) -> Result<Option<Vec<f32>>, ParallelError> {
        let Some((state, _)) = &self.powersgd else {
            return Ok(None);
        };
        let mut flat = vec![0.0f32; self.spec.total()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            if let Some(e) = state.error(b) {
                flat[bucket.range.clone()].copy_from_slice(e);
            }
        }
        if self.dp.size() > 1 {
            self.dp.all_reduce(&mut flat, comm::ReduceOp::Sum)?;
            let inv = 1.0 / self.dp.size() as f32;
            flat.iter_mut().for_each(|v| *v *= inv);
        }
        Ok(Some(flat))
    }

    /// Elements `range` of this rank's flat buffer of checkpoint buffer `kind`, into `out`
    /// (zero where no tensor block lies: shard padding, vocabulary padding rows).
    fn read_range(
        &self,
        ck: &mut Checkpoint,
        kind: Kind,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), ParallelError> {
        out.fill(0.0);
        for p in self.model.placements() {
            let r = p.range();
            let (s, e) = (r.start.max(range.start), r.end.min(range.end));
            if s >= e {
                continue;
            }
            ck.read(
                kind,
                &p.slice,
                s - p.start..e - p.start,
                &mut out[s - range.start..e - range.start],
            )?;
        }
        Ok(())
    }

    /// Replaces this rank's parameters, master weights, moments, AdamW step and loss scaler
    /// with those of `ck` (saved at any layout and precision: a checkpoint holds fp32 master
    /// weights). The loss scaler is restored when the checkpoint was saved in the same
    /// precision, and starts afresh otherwise.
    pub fn load_checkpoint(&mut self, ck: &mut Checkpoint) -> Result<(), ParallelError> {
        // The weights are replaced: nothing may still be going up into them.
        self.order_uploads(None)?;
        let total = self.spec.total();
        let own = self.spec.range(self.dp.rank());
        let zero = self.cfg.zero;
        let state = ck.manifest.state.clone();
        // A buffer of `len` elements whose first real elements are flat range `r`.
        let mut buf =
            |kind: Kind, r: Range<usize>, len: usize| -> Result<Vec<f32>, ParallelError> {
                let mut b = vec![0.0; len];
                self.read_range(ck, kind, r.clone(), &mut b[..r.len()])?;
                Ok(b)
            };
        let cut = |sharded: bool| {
            if sharded {
                (own.clone(), self.spec.shard_len())
            } else {
                (0..total, total)
            }
        };
        // A held update ([`super::delayed`]): continued as held by a run that delays updates,
        // applied now by any other — once, over every element a buffer below reads (the
        // weights' and the optimizer's ranges are each the shard or everything, so the longer
        // holds the other; AdamW is elementwise).
        let delays = self.cfg.delayed_update_after.is_some();
        let applied = match state.pending_update.filter(|_| !delays) {
            None => None,
            Some(p) => {
                let (wr, or) = (cut(zero.shards_params()).0, cut(zero.shards_optimizer()).0);
                let u = if wr.len() >= or.len() { wr } else { or };
                let mut w = buf(Kind::Param, u.clone(), u.len())?;
                let g = buf(Kind::PendingGrad, u.clone(), u.len())?;
                let mut m = buf(Kind::ExpAvg, u.clone(), u.len())?;
                let mut v = buf(Kind::ExpAvgSq, u.clone(), u.len())?;
                p.apply(&self.cfg.adamw, state.adam_step, &mut w, &g, &mut m, &mut v);
                Some((u, w, m, v))
            }
        };
        let mut read = |kind: Kind, r: Range<usize>, len: usize| match &applied {
            None => buf(kind, r, len),
            Some((u, w, m, v)) => {
                let src = match kind {
                    Kind::ExpAvg => m,
                    Kind::ExpAvgSq => v,
                    _ => w,
                };
                let mut b = vec![0.0; len];
                b[..r.len()].copy_from_slice(&src[r.start - u.start..r.end - u.start]);
                Ok(b)
            }
        };
        let (pr, pl) = cut(zero.shards_params());
        let weights = read(Kind::Param, pr, pl)?;
        let master = if self.cfg.precision.half().is_some() || self.cfg.offload_optimizer {
            let (r, l) = cut(zero.shards_optimizer());
            read(Kind::Param, r, l)?
        } else {
            Vec::new()
        };
        let dev = self.cfg.device.clone();
        // AdamW's state on the device, or on the host under ZeRO-Offload.
        let state_dev = if self.cfg.offload_optimizer {
            tensor::buf::Dev::Cpu
        } else {
            dev.clone()
        };
        let master = if master.is_empty() {
            Buf::Host(master)
        } else {
            state_dev.from_vec(master).map_err(terr)?
        };
        let (mr, ml) = cut(zero.shards_optimizer());
        let m = read(Kind::ExpAvg, mr.clone(), ml)?;
        let v = read(Kind::ExpAvgSq, mr.clone(), ml)?;
        let held = match state.pending_update.filter(|_| delays) {
            Some(p) => Some((buf(Kind::PendingGrad, mr.clone(), mr.len())?, p)),
            None => None,
        };
        self.params = Flat::from_f32_on(&dev, weights, self.cfg.precision).map_err(terr)?;
        self.master = master;
        self.m = state_dev.from_vec(m).map_err(terr)?;
        self.v = state_dev.from_vec(v).map_err(terr)?;
        // PowerSGD continues from the saved mean error (every rank holds it); a checkpoint
        // without one starts its error feedback at zero, as a run switching PowerSGD on does.
        if self.powersgd.is_some() && ck.manifest.state.grad_comm_error {
            let mut e = vec![0.0; total];
            self.read_range(ck, Kind::GradCommError, 0..total, &mut e)?;
            let buckets: Vec<Range<usize>> = self.buckets.iter().map(|b| b.range.clone()).collect();
            if let Some((state, layouts)) = &mut self.powersgd {
                for (b, r) in buckets.into_iter().enumerate() {
                    state.set_error(b, &layouts[b], e[r].to_vec());
                }
            }
        }
        self.delayed = Default::default();
        if let Some((g, scalars)) = held {
            let grads = match self.cfg.precision.half() {
                Some(kind) => {
                    let mut bits = vec![0u16; g.len()];
                    kind.downcast(&g, &mut bits);
                    Held::Bits(Landing::Host(bits))
                }
                None => Held::F32(g),
            };
            self.delayed.pending = Some(Pending {
                grads,
                t: state.adam_step,
                scalars,
            });
        }
        self.step = state.adam_step;
        self.scaler = if ck.manifest.precision == self.cfg.precision {
            state.loss_scaler
        } else {
            LossScaler::new(self.cfg.precision, self.cfg.loss_scale)
        };
        Ok(())
    }
}
