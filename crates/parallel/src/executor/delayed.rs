//! ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021, "ZeRO-Offload", arXiv
//! 2101.06840, "Delayed Parameter Update"): past a warm-up of `delayed_update_after` AdamW
//! steps, the host's update from step t's gradients runs on a thread of its own (its
//! parallel loops on a pool beside the kernels', `tensor::threads::beside`) while step t+1's
//! forward and backward run, instead of between them. Step t+1's gradients are then
//! taken at the weights before update t — one step stale — and the host's AdamW time hides
//! behind the device's compute: a step costs about max(compute, host update) instead of their
//! sum. The paper turns it on only after the first steps, while the gradients still change
//! fast.
//!
//! The life of an update:
//!
//! ```text
//!  step t      forward/backward ─ optimizer point: ‖g_t‖, clip factor; g_t HELD (pending)
//!  step t+1    forward/backward beside [host thread: AdamW(g_t) → master, m, v, rounded weights]
//!              optimizer point: thread joined, weights of update t STORED (uploaded); g_t+1 held
//! ```
//!
//! What is held are this rank's own gradients (its `own_ranges().0`): in 16-bit training the
//! landing buffer they arrived in during the backward (`offload`), which the update then
//! overwrites with the rounded weights in place, so nothing is allocated beyond a second
//! landing buffer (2 bytes a parameter updated, page-locked on a GPU); in fp32 a host copy.
//! Between steps the master weights and moments are those before the held update, equal to
//! the compute weights, so a checkpoint taken there saves them as they are plus the held
//! gradients and the update's scalars, and a resumed run continues exactly
//! ([`crate::checkpoint::PendingUpdate`]).
use std::ops::Range;
use std::time::Duration;

use tensor::buf::Buf;
use tensor::cuda::Unordered;

use super::offload::adamw_in_place;
use super::run::terr;
use super::Executor;
use crate::checkpoint::PendingUpdate;
use crate::data_parallel::ZeroStage;
use crate::precision::{Flat, Half, Landing};
use crate::stage::StageModel;
use crate::ParallelError;

/// Held gradients (element `i` is the moments' element `own_ranges().2.start + i`).
pub(super) enum Held {
    /// 16-bit bits: the gradients, then (once updated) the rounded weights.
    Bits(Landing),
    /// fp32 gradients (the updated weights are the master itself).
    F32(Vec<f32>),
}

impl Held {
    /// The gradients' values (16-bit bits widened), for a checkpoint; `None` while a landing
    /// is still in flight.
    pub(super) fn values(&self, kind: Option<Half>) -> Option<Vec<f32>> {
        match (self, kind) {
            (Held::F32(g), _) => Some(g.clone()),
            (Held::Bits(l), Some(kind)) => {
                let bits = l.settled()?;
                let mut out = vec![0.0; bits.len()];
                kind.upcast(bits, &mut out);
                Some(out)
            }
            (Held::Bits(_), None) => None,
        }
    }

    fn pinned_bytes(&self) -> usize {
        match self {
            Held::Bits(l) => l.pinned_bytes(),
            Held::F32(_) => 0,
        }
    }
}

/// An update held for the next step: its gradients and its scalars.
pub(super) struct Pending {
    pub(super) grads: Held,
    /// Its AdamW step (bias correction).
    pub(super) t: u64,
    pub(super) scalars: PendingUpdate,
}

/// The executor's delayed update (see the module doc).
#[derive(Default)]
pub(super) struct Delayed {
    /// The update held since the last optimizer point.
    pub(super) pending: Option<Pending>,
    /// Its result after the step it ran beside, until the optimizer point stores it: the
    /// rounded weights (16-bit) or nothing more than the master (fp32).
    updated: Option<Held>,
    /// A stored result's buffer, kept for the next held update.
    spare: Option<Held>,
    /// The stored weights' uploads the compute stream is not yet ordered after, by flat
    /// range of the weights (ZeRO-0 on a GPU: unit by unit, each unit's first reader waits for
    /// its own, [`Executor::order_uploads`]).
    unordered: Vec<(Range<usize>, Unordered)>,
}

impl Drop for Delayed {
    /// Uploads still unordered go into weights that may be freed before them: the compute
    /// stream, on which freed device memory is used again, waits for them.
    fn drop(&mut self) {
        for (_, up) in self.unordered.drain(..) {
            let _ = up.order_compute();
        }
    }
}

impl Delayed {
    pub(super) fn pinned_bytes(&self) -> usize {
        let pending = self.pending.iter().map(|p| &p.grads);
        pending
            .chain(&self.updated)
            .chain(&self.spare)
            .map(Held::pinned_bytes)
            .sum()
    }
}

/// The host's side of a held update while the next step runs: the optimizer state taken
/// from the executor, and the update.
pub(super) struct Work {
    master: Buf,
    m: Buf,
    v: Buf,
    /// The moments' (and master's) range the update covers.
    range: Range<usize>,
    pending: Pending,
    opt: model::optim::AdamW,
    kind: Option<Half>,
}

impl Work {
    /// Runs the update (on the thread beside the step): AdamW over the held gradients, the
    /// 16-bit weights rounded over them in place — on the pool beside the kernels'
    /// ([`tensor::threads::beside`]), so that the step's own kernels never queue behind it.
    pub(super) fn run(&mut self) -> Result<(), ParallelError> {
        tensor::threads::beside(|| self.update()).map_err(terr)?
    }

    fn update(&mut self) -> Result<(), ParallelError> {
        let r = self.range.clone();
        let master = &mut self
            .master
            .as_host_mut("the master weights")
            .map_err(terr)?[r.clone()];
        let m = &mut self.m.as_host_mut("the optimizer").map_err(terr)?[r.clone()];
        let v = &mut self.v.as_host_mut("the optimizer").map_err(terr)?[r];
        let (t, scalars) = (self.pending.t, self.pending.scalars);
        match (&mut self.pending.grads, self.kind) {
            (Held::Bits(landing), Some(kind)) => {
                // Landed before it was held (`take_landed` waited): on this thread, which has
                // no GPU context, nothing calls into the driver.
                let bits = landing.settled_mut().ok_or_else(|| {
                    ParallelError::Model("a held update's gradients are still landing".into())
                })?;
                let step = (t, scalars.lr, scalars.factor);
                adamw_in_place(kind, &self.opt, step, (master, m, v), bits);
            }
            (Held::F32(g), None) => scalars.apply(&self.opt, t, master, g, m, v),
            _ => {
                return Err(ParallelError::Config(
                    "a held update's gradients are not in the training's precision".into(),
                ))
            }
        }
        Ok(())
    }
}

impl<M: StageModel> Executor<M> {
    /// Whether the update of AdamW step `t` is held for the next step.
    pub(super) fn delays(&self, t: u64) -> bool {
        self.cfg.delayed_update_after.is_some_and(|n| t > n)
    }

    /// The held update, as work for the thread beside this step, with the optimizer state it
    /// updates taken from the executor (given back by [`Self::end_delayed_work`]).
    pub(super) fn begin_delayed_work(&mut self) -> Option<Work> {
        let pending = self.delayed.pending.take()?;
        let (_, _, range) = self.own_ranges();
        let take = |b: &mut Buf| std::mem::replace(b, Buf::Host(Vec::new()));
        Some(Work {
            master: take(&mut self.master),
            m: take(&mut self.m),
            v: take(&mut self.v),
            range,
            pending,
            opt: self.cfg.adamw,
            kind: self.cfg.precision.half(),
        })
    }

    /// Gives the optimizer state back and keeps the update's result for the optimizer point;
    /// `ran` is the thread's outcome (the update's time). Returns that time.
    pub(super) fn end_delayed_work(
        &mut self,
        work: Option<Work>,
        ran: Option<std::thread::Result<Result<Duration, ParallelError>>>,
    ) -> Result<Option<Duration>, ParallelError> {
        let Some(w) = work else {
            return Ok(None);
        };
        self.master = w.master;
        self.m = w.m;
        self.v = w.v;
        match ran {
            Some(Ok(Ok(took))) => {
                self.delayed.updated = Some(w.pending.grads);
                Ok(Some(took))
            }
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) | None => Err(ParallelError::Model(format!(
                "the delayed optimizer update of AdamW step {} did not finish (its thread panicked)",
                w.pending.t
            ))),
        }
    }

    /// At the optimizer point: stores the weights of the update that ran beside this step
    /// into the compute weights. Returns whether there was one. At ZeRO-0 on a GPU they go
    /// up unit by unit without holding the compute stream: the next step's forward of each
    /// unit waits for its own upload only, so the copies run behind the units before it
    /// (the weights' upload is otherwise exposed between the steps, the update having run
    /// beside the step instead of beside the copies).
    pub(super) fn store_delayed_update(&mut self) -> Result<bool, ParallelError> {
        let Some(mut held) = self.delayed.updated.take() else {
            return Ok(false);
        };
        self.order_uploads(None)?;
        let (_, pr, mr) = self.own_ranges();
        let by_units = self.cfg.zero == ZeroStage::Ddp;
        match (&mut held, &mut self.params) {
            (Held::Bits(Landing::Gpu(stage)), Flat::DevHalf { bits, .. }) if by_units => {
                // ZeRO-0: the landing's element i is weight i, and the units tile them.
                for r in &self.units {
                    let up = stage
                        .upload_unordered(r.clone(), bits.slice_mut(r.clone()))
                        .map_err(|e| terr(e.into()))?;
                    self.delayed.unordered.push((r.clone(), up));
                }
                Ok(())
            }
            (Held::Bits(landing), params) => params.store_landed(pr.start, landing),
            (Held::F32(_), params) => {
                let master = &self.master.as_host("the master weights").map_err(terr)?[mr];
                params.write(pr.start, master)
            }
        }
        .map_err(terr)?;
        self.delayed.spare = Some(held);
        Ok(true)
    }

    /// Orders the compute stream after the unordered uploads of the weights in flat range
    /// `r` (`None`: all of them): before anything reads them.
    pub(super) fn order_uploads(&mut self, r: Option<&Range<usize>>) -> Result<(), ParallelError> {
        if self.delayed.unordered.is_empty() {
            return Ok(());
        }
        let mut ordered = Ok(());
        self.delayed.unordered.retain(|(u, up)| {
            let reads = r.is_none_or(|r| u.start < r.end && r.start < u.end);
            if reads && ordered.is_ok() {
                ordered = up.order_compute();
            }
            !reads
        });
        ordered.map_err(|e| terr(e.into()))
    }

    /// At the optimizer point of a delayed step: holds this rank's gradients, with the step's
    /// scalars, for the update that runs beside the next step.
    pub(super) fn hold_update(&mut self, factor: f32) -> Result<(), ParallelError> {
        let (gr, _, _) = self.own_ranges();
        let spare = self.delayed.spare.take();
        let grads = if self.cfg.precision.half().is_some() {
            let traffic = self.offload.as_mut().ok_or_else(|| {
                ParallelError::Config(
                    "a delayed update of 16-bit weights needs ZeRO-Offload's landing".into(),
                )
            })?;
            let spare = match spare {
                Some(Held::Bits(l)) => Some(l),
                _ => None,
            };
            Held::Bits(traffic.take_landed(&self.grads, spare)?)
        } else {
            let mut g = match spare {
                Some(Held::F32(g)) => g,
                _ => Vec::new(),
            };
            g.resize(gr.len(), 0.0);
            self.grads.read_into(gr, &mut g).map_err(terr)?;
            Held::F32(g)
        };
        self.delayed.pending = Some(Pending {
            grads,
            t: self.step,
            scalars: PendingUpdate {
                lr: self.lr,
                factor,
            },
        });
        Ok(())
    }

    /// The held update's scalars (for a checkpoint's training state).
    pub fn pending_update(&self) -> Option<PendingUpdate> {
        self.delayed.pending.as_ref().map(|p| p.scalars)
    }
}
